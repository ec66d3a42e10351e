"""MoonViT (models/components/moonvit.py) against transformers' Kimi_K25ForConditionalGeneration:
merged, projected image features of a tiny random model for one image, two images of different
grids (placed at the placeholder tokens as transformers does), a video chunk; padding that changes
nothing; finite gradients; the parameter and FLOP counts; the config mapping."""

from __future__ import annotations

import pytest
import torch
import transformers

from torchloom.config.errors import ConfigError
from torchloom.models.components.moonvit import MoonViT, MoonViTConfig
from torchloom.models.components.param_init import ParamInit
from torchloom.models.kimi_k25.moonvit_hf import (
    config_from_hf,
    from_hf_name,
    hf_name,
    is_hf_moonvit_name,
)

PATCH, CHANNELS, IMAGE_TOKEN = 4, 3, 200
TEXT = dict(
    model_type="deepseek_v3", vocab_size=256, hidden_size=40, intermediate_size=64,
    moe_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
    kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
    n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
    first_k_dense_replace=1,
)  # fmt: skip
# A 6 x 6 position grid: the test images are resampled both up (8 rows) and down (4 rows).
VISION = dict(
    patch_size=PATCH, pos_emb_height=6, pos_emb_width=6, pos_emb_time=4, num_attention_heads=2,
    num_hidden_layers=2, hidden_size=32, intermediate_size=48,
    rope_parameters={"rope_type": "axial", "rope_theta": 100.0},
)  # fmt: skip


@pytest.fixture(scope="module")
def models() -> tuple[MoonViT, torch.nn.Module]:
    """Ours and transformers' reference, both holding the same random weights (norms too)."""
    config = transformers.Kimi_K25Config(
        text_config=TEXT, vision_config=VISION, projection_hidden_size=32,
        projection_layer_norm_eps=1e-6, image_token_id=IMAGE_TOKEN, video_token_id=201,
    )  # fmt: skip
    torch.manual_seed(0)
    reference = transformers.Kimi_K25ForConditionalGeneration(config).eval()
    generator = torch.Generator().manual_seed(1)
    ours = config_from_hf(config.to_dict()).build()
    state = {}
    with torch.no_grad():
        for name, tensor in reference.state_dict().items():
            if not is_hf_moonvit_name(name) or from_hf_name(name) is None:
                continue
            noise = torch.randn(tensor.shape, generator=generator)
            tensor.copy_(1 + 0.1 * noise if "norm" in name else 0.3 * noise)
            state[from_hf_name(name)] = tensor.clone()
    ours.load_state_dict(state)  # strict: every parameter of ours, nothing else
    return ours, reference


def random_images(grids: list[tuple[int, int, int]], seed: int = 0) -> list[torch.Tensor]:
    """Each image's patches as Kimi's processor emits them: [t * h * w, C, p, p]."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(t * h * w, CHANNELS, PATCH, PATCH, generator=generator) for t, h, w in grids
    ]


def padded(images: list[torch.Tensor], grids: list[tuple[int, int, int]],
           slots: list[tuple[int, int]], rows: int, per_row: int, length: int,
           fill: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The fixed-shape layout: image i at (row, slot) ``slots[i]``; everything else ``fill``."""
    pixels = torch.full((rows, per_row, length, CHANNELS * PATCH * PATCH), fill)
    grid = torch.zeros(rows, per_row, 3, dtype=torch.int64)
    for image, thw, (row, slot) in zip(images, grids, slots, strict=True):
        pixels[row, slot, : len(image)] = image.flatten(1)
        grid[row, slot] = torch.tensor(thw)
    return pixels, grid


def check_close(what: str, ours: torch.Tensor, reference: torch.Tensor) -> None:
    relative = ((ours - reference).abs().max() / reference.abs().max()).item()
    print(f"  {what}: max abs diff / max abs = {relative:.2e}")
    assert relative < 1e-5, f"{what}: relative difference {relative:.2e}"


def valid_features(out: torch.Tensor, grid: torch.Tensor, model: MoonViT) -> torch.Tensor:
    """The valid merged features of every slot, in row-major slot order: [total, text_dim]."""
    lengths = model.merged_counts(grid).flatten().tolist()
    return torch.cat([slot[:n] for slot, n in zip(out.flatten(0, 1), lengths)])


@torch.no_grad()
def test_one_image_matches_transformers(models) -> None:
    ours, reference = models
    grids = [(1, 8, 6)]
    images = random_images(grids)
    pixels, grid = padded(images, grids, [(0, 0)], rows=1, per_row=1, length=48)
    out, _ = ours(pixels, grid)
    assert out.shape == (1, 1, 12, TEXT["hidden_size"])
    expected = reference.get_image_features(torch.cat(images), torch.tensor(grids)).pooler_output
    check_close("one image 8x6", out[0, 0], expected[0])


@torch.no_grad()
def test_two_images_at_the_placeholders_as_transformers_scatters_them(models) -> None:
    """Two rows, the second holding two images of other grids: the k-th valid merged feature
    (row-major over slots) is what transformers puts at the k-th image token."""
    ours, reference = models
    grids = [(1, 4, 4), (1, 8, 4), (1, 2, 10)]
    images = random_images(grids, seed=1)
    pixels, grid = padded(images, grids, [(0, 0), (1, 0), (1, 1)], rows=2, per_row=2, length=40)
    features = valid_features(ours(pixels, grid)[0], grid, ours)

    counts = [h * w // 4 for _, h, w in grids]  # 4, 8, 5 placeholder tokens
    rows = [
        [1, 2] + [IMAGE_TOKEN] * counts[0] + [3] * 13,
        [4] + [IMAGE_TOKEN] * counts[1] + [5, 6] + [IMAGE_TOKEN] * counts[2] + [7, 8, 9],
    ]
    input_ids = torch.tensor(rows)  # fmt: skip
    scattered = {}
    hook = reference.model.language_model.register_forward_pre_hook(
        lambda module, args, kwargs: scattered.update(embeds=kwargs["inputs_embeds"]),
        with_kwargs=True,
    )
    try:
        reference(input_ids=input_ids, pixel_values=torch.cat(images),
                  image_grid_thw=torch.tensor(grids))  # fmt: skip
    finally:
        hook.remove()
    check_close("two rows, three images", features, scattered["embeds"][input_ids == IMAGE_TOKEN])


@torch.no_grad()
def test_video_chunk_matches_transformers(models) -> None:
    """Three frames: a temporal term in the position embedding, attention across the frames,
    the merge averaging them."""
    ours, reference = models
    grids = [(3, 4, 6)]
    images = random_images(grids, seed=2)
    pixels, grid = padded(images, grids, [(0, 0)], rows=1, per_row=1, length=80)
    out, _ = ours(pixels, grid)
    expected = reference.get_video_features(torch.cat(images), torch.tensor(grids)).pooler_output
    check_close("video chunk 3x4x6", out[0, 0, :6], expected[0])


@torch.no_grad()
def test_padding_and_absent_slots_change_nothing(models) -> None:
    """Garbage in padding patches and absent slots, more of both: valid outputs unchanged,
    everything else zero, no NaN."""
    ours, _ = models
    grids = [(1, 4, 6), (1, 6, 2)]
    images = random_images(grids, seed=3)
    tight, _ = ours(*padded(images, grids, [(0, 0), (0, 1)], rows=1, per_row=2, length=24))
    garbage, _ = ours(*padded(images, grids, [(0, 0), (0, 1)], rows=1, per_row=2, length=24,
                           fill=1e3))  # fmt: skip
    assert torch.equal(garbage, tight)
    pixels, grid = padded(images, grids, [(1, 2), (0, 1)], rows=2, per_row=3, length=40, fill=7.0)
    loose, _ = ours(pixels, grid)
    assert not loose.isnan().any()
    check_close("image 0, padded", loose[1, 2, :6], tight[0, 0, :6])
    check_close("image 1, padded", loose[0, 1, :3], tight[0, 1, :3])
    valid = torch.zeros(loose.shape[:3], dtype=torch.bool)
    valid[1, 2, :6] = valid[0, 1, :3] = True
    assert (loose[~valid] == 0).all()


def test_backward_gives_finite_gradients_and_none_into_padding(models) -> None:
    ours, _ = models
    grids = [(1, 4, 4), (2, 2, 4)]
    pixels, grid = padded(random_images(grids, seed=4), grids, [(0, 0), (1, 1)], rows=2,
                          per_row=2, length=20, fill=3.0)  # fmt: skip
    pixels.requires_grad_(True)
    ours.zero_grad()
    ours(pixels, grid)[0].square().sum().backward()
    for name, param in ours.named_parameters():
        assert param.grad is not None and param.grad.isfinite().all(), name
        assert param.grad.abs().sum() > 0, f"{name} got no gradient"
    valid = torch.zeros(pixels.shape[:3], dtype=torch.bool)
    valid[0, 0, :16] = valid[1, 1, :16] = True
    assert pixels.grad[valid].abs().sum() > 0
    assert (pixels.grad[~valid] == 0).all()


def test_parameter_count_and_names_match_transformers(models) -> None:
    ours, reference = models
    theirs = {k: v for k, v in reference.state_dict().items() if is_hf_moonvit_name(k)}
    assert {hf_name(name) for name, _ in ours.named_parameters()} == set(theirs)
    assert ours.config.num_params() == sum(v.numel() for v in theirs.values())
    for name, param in ours.named_parameters():
        assert from_hf_name(hf_name(name)) == name
        assert param.shape == theirs[hf_name(name)].shape, name


def test_media_flops_against_a_hand_count() -> None:
    cfg = MoonViTConfig(patch_size=4, dim=32, num_layers=2, num_heads=2, ffn_dim=48,
                        pos_grid=6, text_dim=40)  # fmt: skip
    with torch.device("meta"):
        model = cfg.build()
    layer_weights = 4 * 32 * 32 + 2 * 32 * 48
    projector_weights = 128 * 128 + 128 * 40

    def by_hand(t: int, h: int, w: int) -> int:
        patches = t * h * w
        matmuls = 6 * patches * (48 * 32 + 2 * layer_weights)
        attention = 2 * 3 * (2 * 2 * 32 * patches) * patches  # layers x fwd+bwd x QK^T, AV
        return matmuls + attention + 6 * projector_weights * (h * w // 4)

    grids = torch.tensor([[[1, 8, 6], [0, 0, 0]], [[1, 4, 10], [3, 2, 2]]])
    expected = by_hand(1, 8, 6) + by_hand(1, 4, 10) + by_hand(3, 2, 2)
    assert model.flops(grids) == expected
    assert model.flops(grids[:1, :1]) == by_hand(1, 8, 6)


def test_init_weights_fills_every_parameter_the_same_for_a_seed() -> None:
    cfg = MoonViTConfig(patch_size=4, dim=32, num_layers=2, num_heads=2, ffn_dim=48,
                        pos_grid=6, text_dim=40)  # fmt: skip
    first, second = cfg.build(), cfg.build()
    with torch.no_grad():
        for param in first.parameters():
            param.fill_(float("nan"))
    first.init_weights(ParamInit(first, seed=3))
    second.init_weights(3)
    for (name, a), b in zip(first.named_parameters(), second.parameters()):
        assert torch.equal(a, b) and a.isfinite().all(), name
    assert (first.layers["0"].attention.q_proj.bias == 0).all()
    assert (first.norm.weight == 1).all()


def test_config_mapping_refuses_what_moonvit_does_not_compute() -> None:
    hf = {"vision_config": dict(VISION), "text_config": {"hidden_size": 40}}
    assert config_from_hf(hf).pos_grid == 6
    for key, value in (("pos_emb_width", 8), ("merge_kernel_size", [2, 3]),
                       ("hidden_act", "gelu")):  # fmt: skip
        with pytest.raises(ConfigError, match=key.split("_")[0]):
            config_from_hf(hf | {"vision_config": VISION | {key: value}})
    with pytest.raises(ConfigError, match="divisible by 4"):
        MoonViTConfig(dim=24, num_heads=4).validate()
