"""Qwen3-VL (dense and MoE) against transformers' Qwen3VL(Moe)ForConditionalGeneration: logits on
text and on rows of images of different grids, M-RoPE positions, export both ways, fixed-shape
padding, the backward through the vision tower, the published shapes and the vision FLOPs."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import torchloom
from torchloom.checkpoint.hf import save_hf
from torchloom.config.errors import ConfigError
from torchloom.data.mrope import mrope_positions
from torchloom.models.qwen3_vl import QWEN3_VL_FLAVORS, Qwen3VLHFAdapter

ADAPTER = Qwen3VLHFAdapter()
IMAGE, START, END = 500, 498, 499
MERGE, PATCH_DIM = 2, 3 * 2 * 4 * 4
TEXT = dict(
    vocab_size=4100, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2],
                     "mrope_interleaved": True},
)  # fmt: skip
MOE_TEXT = TEXT | dict(moe_intermediate_size=48, num_experts=8, num_experts_per_tok=3,
                       mlp_only_layers=[0])  # fmt: skip
VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
              out_hidden_size=64, num_position_embeddings=36, deepstack_visual_indexes=[0, 2])  # fmt: skip
KINDS = {
    "dense": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", TEXT),
    "moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration", MOE_TEXT),
}
# Row 0: two images (4x6 and 8x4 patches); row 1: one of two frames (2x4x6), an absent slot.
GRIDS = [[(1, 4, 6), (1, 8, 4)], [(2, 4, 6)]]


@pytest.fixture(params=list(KINDS))
def checkpoint(request, tmp_path):
    """(folder, transformers model) of a tiny random Qwen3-VL(-MoE), saved with save_pretrained."""
    config_name, model_name, text = KINDS[request.param]
    hf_config = getattr(transformers, config_name)(
        text_config=text, vision_config=VISION, image_token_id=IMAGE, vision_start_token_id=START,
        vision_end_token_id=END, video_token_id=501, attn_implementation="eager",
    )  # fmt: skip
    reference = getattr(transformers, model_name)(hf_config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)
    reference.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf", reference.eval()


def image_batch(grids=GRIDS, slots=2, places=48, seed=1, pad_value=0.0):
    """(tokens [B, T], media, HF's packed pixel_values and grids): each image between vision
    start/end tokens in random text; padding places hold ``pad_value``."""
    generator = torch.Generator().manual_seed(seed)
    rows, pixel_rows, packed = [], [], []
    for row_grids in grids:
        tokens = torch.randint(0, 490, (3,), generator=generator).tolist()
        pixels = torch.full((slots, places, PATCH_DIM), pad_value)
        for slot, (t, h, w) in enumerate(row_grids):
            patches = torch.randn(t * h * w, PATCH_DIM, generator=generator)
            pixels[slot, : t * h * w] = patches
            packed.append(patches)
            tokens += [START] + [IMAGE] * (t * h * w // MERGE**2) + [END]
            tokens += torch.randint(0, 490, (4,), generator=generator).tolist()
        rows.append(tokens)
        pixel_rows.append(pixels)
    length = max(len(r) for r in rows)
    tokens = torch.tensor([r + [7] * (length - len(r)) for r in rows])
    grid = torch.zeros(len(grids), slots, 3, dtype=torch.int64)
    for row, row_grids in enumerate(grids):
        grid[row, : len(row_grids)] = torch.tensor(row_grids)
    media = {"pixel_values": torch.stack(pixel_rows), "image_grid_thw": grid}
    hf_grids = torch.tensor([g for row in grids for g in row])
    return tokens, media, torch.cat(packed), hf_grids


def positions_of(tokens, media):
    return torch.stack([
        mrope_positions(t, g, IMAGE, START, MERGE)
        for t, g in zip(tokens, media["image_grid_thw"], strict=True)
    ])  # fmt: skip


@torch.no_grad()
def test_logits_match_transformers(checkpoint, logits_parity) -> None:
    path, reference = checkpoint
    model = torchloom.from_hf(path)
    text = torch.randint(0, 490, (2, 24), generator=torch.Generator().manual_seed(3))
    logits_parity("qwen3_vl text only", model(text), reference(text).logits)

    tokens, media, pixel_values, grids = image_batch()
    positions = positions_of(tokens, media)
    hf_positions, _ = reference.model.get_rope_index(
        tokens, (tokens == IMAGE).int(), image_grid_thw=grids
    )
    assert torch.equal(positions, hf_positions.permute(1, 2, 0)), "M-RoPE positions differ"
    theirs = reference(input_ids=tokens, pixel_values=pixel_values, image_grid_thw=grids,
                       mm_token_type_ids=(tokens == IMAGE).int()).logits  # fmt: skip
    logits_parity("qwen3_vl 2 + 1 images", model(tokens, positions, media=media), theirs)
    # Positions left out are computed by the model from the same function.
    torch.testing.assert_close(model(tokens, media=media), model(tokens, positions, media=media))


@torch.no_grad()
def test_padding_slots_and_places_change_nothing(checkpoint, logits_parity) -> None:
    model = torchloom.from_hf(checkpoint[0])
    tokens, media, _, _ = image_batch()
    expected = model(tokens, media=media)
    _, garbage, _, _ = image_batch(pad_value=3.0)  # the same shapes, other padding values
    assert torch.equal(model(tokens, media=garbage), expected), "padding patches leak"
    _, padded, _, _ = image_batch(slots=4, places=64, pad_value=3.0)
    got = model(tokens, media=padded)  # other shapes: only the float summation order changes
    assert torch.isfinite(got).all()
    logits_parity("2 more absent slots, 16 more padded places", got, expected)


@torch.no_grad()
def test_export_round_trips_through_transformers(checkpoint, tmp_path) -> None:
    path, _ = checkpoint
    model = torchloom.from_hf(path)
    out = tmp_path / "export"
    save_hf(out, "qwen3_vl", model.config, model.state_dict().items())
    hf_config = json.loads((out / "config.json").read_text())
    moe = model.config.is_moe
    assert hf_config["model_type"] == ("qwen3_vl_moe" if moe else "qwen3_vl")
    cls = "Qwen3VLMoeForConditionalGeneration" if moe else "Qwen3VLForConditionalGeneration"
    reloaded = getattr(transformers, cls).from_pretrained(out).eval()
    tokens, media, pixel_values, grids = image_batch(seed=5)
    theirs = reloaded(input_ids=tokens, pixel_values=pixel_values, image_grid_thw=grids,
                      mm_token_type_ids=(tokens == IMAGE).int()).logits  # fmt: skip
    torch.testing.assert_close(model(tokens, media=media), theirs, rtol=1e-5, atol=1e-5)
    assert torchloom.from_hf(out).config == model.config


def test_backward_reaches_the_vision_tower(checkpoint) -> None:
    model = torchloom.from_hf(checkpoint[0]).train()
    tokens, media, _, _ = image_batch()
    model(tokens, media=media).float().square().mean().backward()
    for name, param in model.visual.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, f"{name} got no gradient"


def test_media_count_mismatch_is_one_line() -> None:
    model = QWEN3_VL_FLAVORS["debug"].build()
    model.init_weights(0)
    cfg = model.config
    tokens = torch.full((1, 12), 5)
    tokens[0, 2], tokens[0, 3:6] = cfg.vision_start_token_id, cfg.image_token_id  # 3, not 4
    media = {"pixel_values": torch.zeros(1, 1, 16, cfg.vision.patch_dim),
             "image_grid_thw": torch.tensor([[[1, 4, 4]]])}  # fmt: skip
    with pytest.raises(
        ConfigError, match="row 0 has 3 image placeholder tokens but its images give 4"
    ):
        model(tokens, torch.arange(12)[None], media=media)


def test_mrope_positions_continue_after_each_image() -> None:
    tokens = torch.tensor([1, START, IMAGE, IMAGE, IMAGE, IMAGE, IMAGE, IMAGE, END, 2])
    positions = mrope_positions(tokens, torch.tensor([[1, 4, 6], [0, 0, 0]]), IMAGE, START, 2)
    assert positions[:2].tolist() == [[0, 0, 0], [1, 1, 1]]
    # a 2x3 merged grid from position 2: (t, h, w) = 2 + (0, row, col)
    assert positions[2:8].tolist() == [[2, 2 + r, 2 + c] for r in range(2) for c in range(3)]
    assert positions[8:].tolist() == [[5, 5, 5], [6, 6, 6]]  # max + 1 = 2 + max(2, 3)


def test_media_flops_by_hand() -> None:
    cfg = QWEN3_VL_FLAVORS["debug"]
    model = cfg.build()
    v, D = cfg.vision, cfg.dim
    weights_per_patch = v.patch_dim * v.dim + v.depth * (4 * v.dim**2 + 2 * v.dim * v.ffn_dim)
    joined = v.dim * 4
    merger = joined * joined + joined * D  # three mergers: the merger and two DeepStack ones
    for t, h, w in ((1, 4, 6), (2, 8, 4)):
        patches = t * h * w
        attention = v.depth * 12 * v.dim * (h * w) * patches
        expected = 6 * weights_per_patch * patches + attention + 6 * 3 * merger * patches // 4
        grid = torch.tensor([[[t, h, w], [0, 0, 0]]])
        assert model.media_flops({"image_grid_thw": grid, "pixel_values": None}) == expected
    both = torch.tensor([[[1, 4, 6], [2, 8, 4]]])
    assert model.media_flops({"image_grid_thw": both}) == sum(
        model.media_flops({"image_grid_thw": torch.tensor([[g]])}) for g in both[0].tolist()
    )
    assert cfg.flops_per_token(64) == model.flops_per_token(64)  # text-only


@pytest.mark.parametrize("flavor", list(QWEN3_VL_FLAVORS))
def test_config_round_trips_and_counts_match_transformers(flavor: str) -> None:
    cfg = QWEN3_VL_FLAVORS[flavor]
    hf = ADAPTER.config_to_hf(cfg)
    assert ADAPTER.config_from_hf(hf) == cfg
    if flavor.startswith("debug"):
        return
    names = {"qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
             "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration")}  # fmt: skip
    config_name, model_name = names[hf["model_type"]]
    with torch.device("meta"):
        reference = getattr(transformers, model_name)(getattr(transformers, config_name)(**hf))
    theirs = sum(p.numel() for p in reference.parameters())
    print(f"{flavor}: {cfg.num_params() / 1e9:.3f}B params, transformers {theirs / 1e9:.3f}B")
    assert cfg.num_params() == theirs


def test_config_refusals() -> None:
    base = ADAPTER.config_to_hf(QWEN3_VL_FLAVORS["debug_moe"])
    with pytest.raises(ConfigError, match="unknown option spatial_tokens"):
        ADAPTER.config_from_hf(base | {"spatial_tokens": 4})
    vision = base["vision_config"]
    with pytest.raises(ConfigError, match="hidden_act='gelu'"):
        ADAPTER.config_from_hf(base | {"vision_config": vision | {"hidden_act": "gelu"}})
    with pytest.raises(ConfigError, match="out_hidden_size=32"):
        ADAPTER.config_from_hf(base | {"vision_config": vision | {"out_hidden_size": 32}})
    with pytest.raises(ConfigError, match="unknown option window_size"):
        ADAPTER.config_from_hf(base | {"vision_config": vision | {"window_size": 112}})


@torch.no_grad()
def test_released_transposed_experts_load_alike(checkpoint, tmp_path) -> None:
    """The released Qwen3-VL-MoE files store gate_up_proj [E, D, 2I] and down_proj [E, I, D]
    (transformers transposes them on load); they load as the untransposed ones do."""
    from safetensors.torch import load_file, save_file

    path, _ = checkpoint
    tensors = load_file(path / "model.safetensors")
    fused = [name for name in tensors if ".mlp.experts." in name]
    if not fused:
        pytest.skip("a dense model has no fused experts")
    released = tmp_path / "released"
    released.mkdir()
    (released / "config.json").write_text((path / "config.json").read_text())
    tensors |= {name: tensors[name].transpose(1, 2).contiguous() for name in fused}
    save_file(tensors, released / "model.safetensors", metadata={"format": "pt"})
    tokens, media, _, _ = image_batch()
    expected = torchloom.from_hf(path)(tokens, media=media)
    assert torch.equal(torchloom.from_hf(released)(tokens, media=media), expected)


def test_convert_round_trips_every_tensor(checkpoint, tmp_path, capsys) -> None:
    from torchloom.checkpoint.safetensors_io import iter_tensors
    from torchloom.cli import main

    path, _ = checkpoint
    assert main(["convert", "--from-hf", str(path), "--to", str(tmp_path / "tl")]) == 0
    assert main(["convert", "--from", str(tmp_path / "tl"), "--to-hf", str(tmp_path / "back")]) == 0
    original, back = dict(iter_tensors(path)), dict(iter_tensors(tmp_path / "back"))
    assert back.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name


def test_initial_load_hf_trains_on_text(checkpoint, tmp_path) -> None:
    """--checkpoint.initial_load_hf of a Qwen3-VL folder: a text run trains it and exports it."""
    from torchloom.cli import resolve_job
    from torchloom.train.trainer import Trainer

    path, _ = checkpoint
    args = ["--recipe", "debug", "--model.name", "qwen3_vl", "--model.flavor", "debug",
            "--checkpoint.initial_load_hf", str(path), "--training.steps", "1",
            "--training.sample_tokens", "0", "--metrics.tensorboard", "false",
            "--checkpoint.export_hf", "true", "--output.dir", str(tmp_path / "run")]  # fmt: skip
    _, job = resolve_job(args)
    result = Trainer(job).train()
    assert result.steps == 1 and torch.isfinite(torch.tensor(result.first_loss))
    assert torchloom.from_hf(tmp_path / "run" / "hf").config == torchloom.from_hf(path).config
