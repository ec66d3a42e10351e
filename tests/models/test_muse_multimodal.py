"""Muse Glimmer (images) and Muse Spark (images + audio) as multimodal models against
transformers: logits on text, image rows (two images of different grids in a row, a row with
one), audio rows (two clips of different lengths) and an image + audio row; export that
transformers loads, the convert round trip, padding invariance, the media check and backward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from torchloom.checkpoint.hf import hf_architecture, load_hf_weights, save_hf
from torchloom.config import ConfigError
from torchloom.models import build_model

IMAGE, VIDEO, AUDIO = 250, 251, 252
TEXT = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
    max_position_embeddings=128,
)  # fmt: skip
SPARK_TEXT = TEXT | dict(
    moe_intermediate_size=24, num_local_experts=6, num_experts_per_tok=2, moe_hidden_size=40,
    mlp_layer_types=["sparse", "dense", "sparse", "sparse"],
)  # fmt: skip
# 2-pixel patches, a 4x4 position table (4x4-patch windows); layers 0 windowed, 1 full.
VISION = dict(patch_size=2, pos_emb_height=4, pos_emb_width=4, max_position_embeddings=16,
              num_attention_heads=2, num_hidden_layers=2, hidden_size=32, intermediate_size=40)  # fmt: skip
AUDIO_CFG = dict(patch_sizes=(2, 3), hidden_sizes=(8, 16), depths=(1, 2), num_hidden_layers=2,
                 out_hidden_size=64)  # fmt: skip
TOP = dict(out_hidden_size=128, projector_hidden_size=48, image_token_id=IMAGE,
           video_token_id=VIDEO)  # fmt: skip
PATCH_DIM, SPT = 2 * 3 * 2 * 2, 6
HF = {
    "muse_glimmer": lambda: transformers.MuseGlimmerForConditionalGeneration(
        transformers.MuseGlimmerConfig(text_config=TEXT, vision_config=VISION, **TOP)
    ),
    "muse_spark": lambda: transformers.MuseSparkForConditionalGeneration(
        transformers.MuseSparkConfig(text_config=SPARK_TEXT, vision_config=VISION,
                                     audio_config=AUDIO_CFG, audio_token_id=AUDIO, **TOP)
    ),
}  # fmt: skip


def tiny_hf(family: str) -> torch.nn.Module:
    """Every weight random (norm offsets, gates and biases too, so a swapped name would show)."""
    torch.manual_seed(0)
    model = HF[family]().float().eval()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and "inv_freq" not in name:
                tensor.normal_(0.0, 0.5 if "norm" in name or "residual_gate" in name else 0.1)
    return model


def load_ours(path: Path) -> torch.nn.Module:
    _, config = hf_architecture(path)
    model = build_model(config)
    load_hf_weights(model, path)
    return model.eval()


@pytest.fixture(scope="module", params=list(HF))
def checkpoint(request, tmp_path_factory) -> tuple[str, torch.nn.Module, Path]:
    hf = tiny_hf(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, hf, path


def batch(rows: list[list], L: int = 64, S: int = 60, slots: int = 0, seed: int = 0):
    """(tokens, HF's inputs, our media) for rows of items: an int is a text token, ("image",
    (t, h, w)) an image's placeholders, ("audio", samples) a clip's. Rows are padded with text
    to one length; our slots with 9.0 (pixels) and 5.0 (samples) past the valid ones."""
    generator = torch.Generator().manual_seed(seed)
    ids, patches, grids, clips = [], [], [], []
    for row in rows:
        tokens, row_grids, row_clips = [], [], []
        for item in row:
            if isinstance(item, int):
                tokens.append(item)
            elif item[0] == "image":
                t, h, w = item[1]
                tokens += [IMAGE] * (t * h * w // 4)
                row_grids.append(item[1])
                patches.append(torch.randn(t * h * w, PATCH_DIM, generator=generator))
            else:
                tokens += [AUDIO] * -(-item[1] // SPT)
                row_clips.append(torch.randn(item[1], generator=generator))
        ids.append(tokens)
        grids.append(row_grids)
        clips.append(row_clips)
    T = max(map(len, ids))
    tokens_BT = torch.tensor([row + [7 + i % 5 for i in range(T - len(row))] for row in ids])
    B, N = len(rows), max(slots, *map(len, grids))
    A = max(slots, *map(len, clips))
    hf_inputs, media = {}, {}
    if patches:
        pixel_values = torch.full((B, N, L, PATCH_DIM), 9.0)
        grid_BN3 = torch.zeros(B, N, 3, dtype=torch.long)
        it = iter(patches)
        for b, row_grids in enumerate(grids):
            for n, grid in enumerate(row_grids):
                p = next(it)
                pixel_values[b, n, : len(p)], grid_BN3[b, n] = p, torch.tensor(grid)
        hf_inputs |= dict(pixel_values=torch.cat(patches),
                          image_grid_thw=torch.tensor([g for r in grids for g in r]))  # fmt: skip
        media |= dict(pixel_values=pixel_values, image_grid_thw=grid_BN3)
    waves = [w for r in clips for w in r]
    if waves:
        longest = -(-max(map(len, waves)) // SPT) * SPT
        values, mask = torch.zeros(len(waves), longest), torch.zeros(len(waves), longest)
        audio_values, lengths = torch.full((B, A, S, 1), 5.0), torch.zeros(B, A, dtype=torch.long)
        i = 0
        for b, row_clips in enumerate(clips):
            for a, wave in enumerate(row_clips):
                values[i, : len(wave)], mask[i, : len(wave)] = wave, 1
                audio_values[b, a, : len(wave), 0], lengths[b, a] = wave, len(wave)
                i += 1
        hf_inputs |= dict(input_values=values, input_values_mask=mask.long())
        media |= dict(audio_values=audio_values, audio_lengths=lengths)
    return tokens_BT, hf_inputs, media


def rel_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


TWO_IMAGES = [[3, ("image", (1, 4, 6)), 4, ("image", (1, 4, 4)), 5, 6],
              [3, 8, ("image", (1, 6, 4)), 9]]  # fmt: skip
CASES = {
    "text": [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [20, 21, 22, 23, 24, 25, 26, 27, 28]],
    "images": TWO_IMAGES,
    "two clips": [[3, ("audio", 40), 4, ("audio", 23), 5], [3, 4, ("audio", 30), 9]],
    "image + audio": [[3, ("image", (1, 4, 4)), 4, ("audio", 40), 5], [6, ("audio", 17), 7]],
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(checkpoint, case) -> None:
    family, hf, path = checkpoint
    if family == "muse_glimmer" and "audio" in str(CASES[case]) + case:
        pytest.skip("Muse Glimmer has no audio encoder")
    model = load_ours(path)
    tokens, hf_inputs, media = batch(CASES[case])
    with torch.no_grad():
        ours = model(tokens, media=media)
        theirs = hf(input_ids=tokens, **hf_inputs).logits
    diff = rel_diff(ours, theirs)
    print(f"{family} {case}: max |ours - transformers| / max |transformers| = {diff:.1e}")
    assert diff < 1e-5, diff
    if media:  # the media matter
        with torch.no_grad():
            assert rel_diff(model(tokens), theirs) > 1e-3


def test_export_loads_in_transformers_and_round_trips(checkpoint, tmp_path) -> None:
    family, hf, path = checkpoint
    model = load_ours(path)
    save_hf(tmp_path / "out", family, model.config, model.state_dict().items())
    again = load_ours(tmp_path / "out")
    assert again.config == model.config
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    reference = type(hf).from_pretrained(tmp_path / "out").float().eval()
    case = CASES["image + audio" if family == "muse_spark" else "images"]
    tokens, hf_inputs, media = batch(case, seed=3)
    with torch.no_grad():
        diff = rel_diff(model(tokens, media=media), reference(input_ids=tokens, **hf_inputs).logits)
    print(f"{family}: exported, transformers' logits differ by {diff:.1e}")
    assert diff < 1e-5


def test_padding_and_empty_slots_change_nothing(checkpoint) -> None:
    family, _, path = checkpoint
    model = load_ours(path)
    case = CASES["image + audio" if family == "muse_spark" else "images"]
    tight = batch(case, L=36 if family == "muse_glimmer" else 16, S=42)
    loose = batch(case, L=100, S=120, slots=3)
    with torch.no_grad():
        a, b = model(tight[0], media=tight[2]), model(loose[0], media=loose[2])
    assert rel_diff(b, a) < 1e-5  # masked reductions of another length: fp32 rounding


def test_media_check_names_the_counts(checkpoint) -> None:
    family, _, path = checkpoint
    model = load_ours(path)
    tokens, _, media = batch(TWO_IMAGES)
    tokens[1, 3] = 4  # one image placeholder short
    with pytest.raises(
        ConfigError, match="row 1 has 5 image placeholder tokens but its images give 6"
    ):
        model(tokens, media=media)
    if family == "muse_spark":
        tokens, _, media = batch(CASES["two clips"])
        tokens[0, 2] = 4
        with pytest.raises(
            ConfigError, match="row 0 has 10 audio placeholder tokens but its clips give 11"
        ):
            model(tokens, media=media)


def test_backward_reaches_every_parameter(checkpoint) -> None:
    family, _, path = checkpoint
    model = load_ours(path).train()
    case = CASES["image + audio" if family == "muse_spark" else "images"]
    tokens, _, media = batch(case)
    model(tokens, media=media).float().square().mean().backward()
    for name, p in model.named_parameters():
        if "experts" in name or "router" in name:
            continue  # a tiny batch need not reach every expert
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    flops = model.media_flops(media)
    expected = model.vision_tower.flops(media["image_grid_thw"])
    if family == "muse_spark":
        expected += model.audio_tower.flops(media["audio_lengths"])
    assert flops == expected > 0
