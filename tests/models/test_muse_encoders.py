"""Muse Glimmer's vision encoder + adapter and Muse Spark's audio encoder against transformers:
the features our modules give equal those HF scatters into the text embeddings (read off the
language model's input), for one item, two of different sizes and padded slots; gradients,
FLOP counts, init and the HF names."""

from __future__ import annotations

import pytest
import torch
import transformers

from torchloom.config.errors import ConfigError
from torchloom.models.components.audio import (
    MuseAudioEncoder,
    muse_audio_config_from_hf,
    muse_audio_hf_name,
)
from torchloom.models.components.muse_vision import (
    MuseVisionEncoder,
    muse_vision_config_from_hf,
    muse_vision_hf_name,
)
from torchloom.models.components.param_init import ParamInit

IMAGE_TOKEN, AUDIO_TOKEN = 60, 61
TEXT = dict(vocab_size=64, hidden_size=40, intermediate_size=48, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=20, bos_token_id=0,
            eos_token_id=1)  # fmt: skip
# 4x4 position table, so 4x4-patch windows; layers 0-2 windowed, 3 and 4 full.
VISION = dict(patch_size=2, pos_emb_height=4, pos_emb_width=4, num_attention_heads=2,
              num_hidden_layers=5, hidden_size=32, intermediate_size=40, merge_size=2)  # fmt: skip
AUDIO = dict(patch_sizes=(2, 3), hidden_sizes=(8, 16), depths=(1, 2), num_hidden_layers=2,
             out_hidden_size=40)  # fmt: skip
PATCH_DIM = 2 * 3 * 2 * 2  # temporal x channels x pixels


def _randomize(model: torch.nn.Module) -> torch.nn.Module:
    """Every weight random (HF's init leaves biases at 0 and norms at 1, hiding name swaps)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def glimmer() -> tuple[torch.nn.Module, MuseVisionEncoder]:
    config = transformers.MuseGlimmerConfig(
        text_config=TEXT, vision_config=VISION, out_hidden_size=32 * 4, projector_hidden_size=48,
        image_token_id=IMAGE_TOKEN,
    )  # fmt: skip
    reference = _randomize(transformers.MuseGlimmerForConditionalGeneration(config))
    ours = MuseVisionEncoder(muse_vision_config_from_hf(config.to_dict()))
    state = reference.state_dict()
    ours.load_state_dict({n: state[muse_vision_hf_name(n)] for n in ours.state_dict()})
    return reference, ours


@pytest.fixture(scope="module")
def spark() -> tuple[torch.nn.Module, MuseAudioEncoder]:
    text = dict(TEXT, moe_intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                moe_hidden_size=24)  # fmt: skip
    config = transformers.MuseSparkConfig(
        text_config=text, vision_config=dict(VISION, num_hidden_layers=1), audio_config=AUDIO,
        out_hidden_size=32 * 4, projector_hidden_size=48, audio_token_id=AUDIO_TOKEN,
    )  # fmt: skip
    reference = _randomize(transformers.MuseSparkForConditionalGeneration(config))
    ours = MuseAudioEncoder(muse_audio_config_from_hf(config.to_dict()))
    state = reference.state_dict()
    ours.load_state_dict({n: state[muse_audio_hf_name(n)] for n in ours.state_dict()})
    return reference, ours


def _scattered(reference: torch.nn.Module, input_ids: torch.Tensor, token: int, **inputs):
    """The rows HF writes into the text embeddings at ``token``'s placeholders, in order."""
    seen = {}

    def grab(module, args, kwargs):
        seen["embeds"] = kwargs["inputs_embeds"]

    hook = reference.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            reference(input_ids=input_ids, **inputs)
    finally:
        hook.remove()
    return seen["embeds"][input_ids == token]


def _prompt(counts: list[int], token: int) -> torch.Tensor:
    """One row: a text token, then each item's placeholders followed by a text token."""
    ids = [2]
    for count in counts:
        ids += [token] * count + [3]
    return torch.tensor([ids])


def _check(label: str, ours: torch.Tensor, theirs: torch.Tensor, rtol: float = 1e-5) -> None:
    diff = (ours - theirs).abs().max().item()
    scale = theirs.abs().max().item()
    print(f"  {label}: max abs diff {diff:.2e}, relative {diff / scale:.2e} (max {scale:.2f})")
    assert ours.shape == theirs.shape and diff <= rtol * scale, label


# -- vision -----------------------------------------------------------------------------------


def _images(grids: list[tuple[int, int, int]], L: int, slots: int, seed: int = 0):
    """Packed HF inputs and our fixed-shape ones (one row, ``slots`` slots, padding = 9.0)."""
    generator = torch.Generator().manual_seed(seed)
    patches = [torch.randn(t * h * w, PATCH_DIM, generator=generator) for t, h, w in grids]
    pixel_values = torch.full((1, slots, L, PATCH_DIM), 9.0)
    grid_thw = torch.zeros(1, slots, 3, dtype=torch.long)
    for i, (p, grid) in enumerate(zip(patches, grids)):
        pixel_values[0, i, : len(p)] = p
        grid_thw[0, i] = torch.tensor(grid)
    return torch.cat(patches), torch.tensor(grids), pixel_values, grid_thw


@pytest.mark.parametrize(
    "grids",
    [[(1, 4, 6)], [(1, 6, 10), (1, 10, 4)], [(2, 4, 6), (1, 2, 2)]],
    ids=["one image", "two images, several windows", "two frames + a 2x2 image"],
)
def test_vision_matches_the_features_hf_scatters(glimmer, grids) -> None:
    reference, ours = glimmer
    packed, grid_thw, pixel_values, slots_thw = _images(grids, L=64, slots=len(grids))
    tokens = [t * h * w // 4 for t, h, w in grids]
    theirs = _scattered(reference, _prompt(tokens, IMAGE_TOKEN), IMAGE_TOKEN,
                        pixel_values=packed, image_grid_thw=grid_thw)  # fmt: skip
    with torch.no_grad():
        out, deepstack = ours(pixel_values, slots_thw)
    assert deepstack == []
    assert ours.merged_counts(slots_thw).tolist() == [tokens]
    valid = torch.cat([out[0, i, :n] for i, n in enumerate(tokens)])
    _check(f"vision {grids}", valid, theirs)


def test_vision_padding_and_absent_slots_change_nothing(glimmer) -> None:
    _, ours = glimmer
    grids = [(1, 6, 10), (1, 4, 4)]
    _, _, tight, tight_thw = _images(grids, L=60, slots=2)
    _, _, loose, loose_thw = _images(grids, L=100, slots=4)
    loose = torch.cat((loose, loose.flip(1)))  # a second row: the images in slots 2, 3
    loose_thw = torch.cat((loose_thw, loose_thw.flip(1)))
    with torch.no_grad():
        a, b = ours(tight, tight_thw)[0], ours(loose, loose_thw)[0]
    assert b.shape == (2, 4, 25, 40) and torch.isfinite(b).all()
    for i, n in enumerate((15, 4)):
        _check(f"slot {i} padded to 100 patches", b[0, i, :n], a[0, i, :n], rtol=1e-6)
        _check(f"slot {i} in row 2, slot {3 - i}", b[1, 3 - i, :n], a[0, i, :n], rtol=1e-6)
        assert b[0, i, n:].abs().max() == 0
    assert b[0, 2:].abs().max() == 0 and b[1, :2].abs().max() == 0


def test_vision_backward_is_finite(glimmer) -> None:
    _, ours = glimmer
    _, _, pixel_values, grid_thw = _images([(1, 6, 10), (1, 4, 4)], L=64, slots=3)
    ours.zero_grad()
    ours(pixel_values, grid_thw)[0].square().sum().backward()
    for name, p in ours.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().max() > 0, name
    ours.zero_grad()


def test_vision_flops_match_a_hand_count(glimmer) -> None:
    _, ours = glimmer
    # A patch: embed 24*32, 5 blocks of q/k/v/o 4*32*32 + MLP 2*32*40. A merged token: adapter
    # 128*48 + 48*48 + projection 48*40. Attention: 12 * 32 per query-key pair.
    patch = 24 * 32 + 5 * (4 * 32 * 32 + 2 * 32 * 40)
    token = 128 * 48 + 48 * 48 + 48 * 40
    # 4x4: one window; 2 full + 3 windowed layers of 16 x 16 pairs.
    small = 6 * 16 * patch + 6 * 4 * token + 12 * 32 * 5 * 16**2
    # 6x10: windows 4x4, 4x4, 4x2 / 2x4, 2x4, 2x2 -> 2*256 + 3*64 + 16 pairs per windowed layer.
    large = 6 * 60 * patch + 6 * 15 * token + 12 * 32 * (2 * 60**2 + 3 * (2 * 256 + 3 * 64 + 16))
    assert ours.flops(torch.tensor([[1, 4, 4], [0, 0, 0]])) == small
    assert ours.flops(torch.tensor([[[1, 6, 10], [1, 4, 4]]])) == large + small


# -- audio ------------------------------------------------------------------------------------


def _clips(lengths: list[int], S: int, slots: int, seed: int = 0):
    """HF's batch (padded to a multiple of 6 samples, with its mask) and our fixed-shape one."""
    generator = torch.Generator().manual_seed(seed)
    waves = [torch.randn(n, generator=generator) for n in lengths]
    longest = -(-max(lengths) // 6) * 6
    values, mask = torch.zeros(len(lengths), longest), torch.zeros(len(lengths), longest)
    audio_values = torch.full((1, slots, S, 1), 5.0)
    audio_lengths = torch.zeros(1, slots, dtype=torch.long)
    for i, wave in enumerate(waves):
        values[i, : len(wave)], mask[i, : len(wave)] = wave, 1
        audio_values[0, i, : len(wave), 0] = wave
        audio_lengths[0, i] = len(wave)
    return values, mask.long(), audio_values, audio_lengths


@pytest.mark.parametrize("lengths", [[42], [40, 23]], ids=["one clip", "two clips"])
def test_audio_matches_the_features_hf_scatters(spark, lengths) -> None:
    reference, ours = spark
    values, mask, audio_values, audio_lengths = _clips(lengths, S=60, slots=len(lengths))
    tokens = ours.audio_output_lengths(audio_lengths)[0].tolist()
    assert tokens == [-(-n // 6) for n in lengths]
    theirs = _scattered(reference, _prompt(tokens, AUDIO_TOKEN), AUDIO_TOKEN,
                        input_values=values, input_values_mask=mask)  # fmt: skip
    with torch.no_grad():
        out = ours(audio_values, audio_lengths)
    valid = torch.cat([out[0, i, :n] for i, n in enumerate(tokens)])
    _check(f"audio {lengths} samples", valid, theirs)


def test_audio_padding_and_absent_slots_change_nothing(spark) -> None:
    _, ours = spark
    _, _, tight, tight_lengths = _clips([40, 23], S=42, slots=2)
    _, _, loose, loose_lengths = _clips([40, 23], S=120, slots=3)
    with torch.no_grad():
        a, b = ours(tight, tight_lengths), ours(loose, loose_lengths)
    assert b.shape == (1, 3, 20, 40) and torch.isfinite(b).all()
    for i, n in enumerate((7, 4)):
        _check(f"clip {i} padded to 120 samples", b[0, i, :n], a[0, i, :n], rtol=1e-6)
        assert b[0, i, n:].abs().max() == 0
    assert b[0, 2].abs().max() == 0


def test_audio_backward_is_finite(spark) -> None:
    _, ours = spark
    _, _, audio_values, audio_lengths = _clips([40, 23], S=60, slots=3)
    ours.zero_grad()
    ours(audio_values, audio_lengths).square().sum().backward()
    for name, p in ours.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().max() > 0, name
    ours.zero_grad()


def test_audio_flops_match_a_hand_count(spark) -> None:
    _, ours = spark
    # Stage 0 (per 2 samples): patch 1*2*8, one block of depthwise 8*7 + MLP 2*8*32.
    # Stage 1 (per 6 samples): patch 8*3*16, two blocks of 16*7 + 2*16*64; projection 16*40.
    stage0, stage1, proj = (
        2 * 8 + 8 * 7 + 2 * 8 * 32,
        8 * 3 * 16 + 2 * (16 * 7 + 2 * 16 * 64),
        16 * 40,
    )
    clip40 = 6 * (20 * stage0 + 7 * (stage1 + proj))
    clip23 = 6 * (12 * stage0 + 4 * (stage1 + proj))
    assert ours.flops(torch.tensor([40, 0])) == clip40
    assert ours.flops(torch.tensor([[40, 23]])) == clip40 + clip23


# -- both -------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["vision", "audio"])
def test_hf_names_cover_both_sides(glimmer, spark, which) -> None:
    reference, ours = glimmer if which == "vision" else spark
    to_hf = muse_vision_hf_name if which == "vision" else muse_audio_hf_name
    theirs = reference.state_dict()
    prefixes = {
        "vision": ("model.vision_tower.", "model.vision_adapter.", "model.vision_projection."),
        "audio": ("model.audio_tower.",),
    }[which]
    mapped = {to_hf(name): p.shape for name, p in ours.named_parameters()}
    wanted = {k: v.shape for k, v in theirs.items() if k.startswith(prefixes)}
    assert mapped == wanted


@pytest.mark.parametrize("which", ["vision", "audio"])
def test_init_weights_covers_every_parameter(glimmer, spark, which) -> None:
    config = (glimmer if which == "vision" else spark)[1].config
    model = MuseVisionEncoder(config) if which == "vision" else MuseAudioEncoder(config)
    init = ParamInit(model, seed=0)
    model.init_weights(init)
    init.check_complete(model)


def test_unsupported_hf_options_are_refused() -> None:
    glimmer = transformers.MuseGlimmerConfig(
        text_config=TEXT, vision_config=VISION, out_hidden_size=128, projector_hidden_act="silu"
    )
    with pytest.raises(ConfigError, match="projector_hidden_act"):
        muse_vision_config_from_hf(glimmer.to_dict())
    layers = dict(VISION, layer_types=["full_attention"] * 5)
    glimmer = transformers.MuseGlimmerConfig(
        text_config=TEXT, vision_config=layers, out_hidden_size=128
    )
    with pytest.raises(ConfigError, match="layer_types"):
        muse_vision_config_from_hf(glimmer.to_dict())
    spark = transformers.MuseSparkConfig(
        text_config=TEXT, audio_config=dict(AUDIO, hidden_act="relu")
    )
    with pytest.raises(ConfigError, match="hidden_act"):
        muse_audio_config_from_hf(spark.to_dict())


def test_forwards_trace_as_one_graph(glimmer, spark) -> None:
    """No data-dependent Python in either forward (what torch.compile and CUDA graphs need)."""
    _, _, pixel_values, grid_thw = _images([(1, 4, 6), (1, 2, 2)], L=32, slots=3)
    _, _, audio_values, audio_lengths = _clips([40, 23], S=60, slots=3)
    for (_, model), inputs in ((glimmer, (pixel_values, grid_thw)),
                               (spark, (audio_values, audio_lengths))):  # fmt: skip
        with torch.no_grad():
            compiled = torch.compile(model, backend="eager", fullgraph=True)(*inputs)
            torch.testing.assert_close(compiled, model(*inputs), rtol=0, atol=0)  # (tensor, [])
