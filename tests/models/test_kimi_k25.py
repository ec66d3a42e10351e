"""Kimi K2.5 against transformers' Kimi_K25ForConditionalGeneration: logits on text and on rows
of images of different grids, export both ways, `torchloom convert`, --checkpoint.initial_load_hf,
fixed-shape padding, the backward through the vision tower, the published shape's parameter
count and the config mapping's refusals. (MoonViT alone, and its FLOPs by hand:
tests/models/test_moonvit.py.)"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import transformers
from safetensors.torch import save_file

import torchloom
from torchloom.checkpoint.hf import save_hf
from torchloom.config.errors import ConfigError
from torchloom.models.kimi_k25 import KIMI_K25_FLAVORS, KimiK25, KimiK25HFAdapter

ADAPTER = KimiK25HFAdapter()
IMAGE, PATCH = 4093, 4
PATCH_DIM = 3 * PATCH * PATCH
# 1 dense + 2 MoE layers of 8 experts in 2 groups, a shared expert, low-rank q.
TEXT = dict(
    model_type="deepseek_v3", vocab_size=4100, hidden_size=64, intermediate_size=96,
    moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
    first_k_dense_replace=1, num_nextn_predict_layers=0,
)  # fmt: skip
VISION = dict(
    patch_size=PATCH, pos_emb_height=6, pos_emb_width=6, num_attention_heads=2,
    num_hidden_layers=2, hidden_size=32, intermediate_size=48,
    rope_parameters={"rope_type": "axial", "rope_theta": 100.0},
)  # fmt: skip
# Row 0: two images (4x6 and 8x4 patches); row 1: one (6x2) and an absent slot.
GRIDS = [[(1, 4, 6), (1, 8, 4)], [(1, 6, 2)]]


def save_in_memory_names(reference, path) -> None:
    """The folder layout torchloom reads and writes: transformers' module names, experts one
    tensor each. (transformers 5.24's save_pretrained writes Moonshot's release layout instead,
    with a fused, rotary-permuted wqkv, which torchloom does not read yet.)"""
    tensors = {}
    for name, tensor in reference.state_dict().items():
        prefix, _, kind = name.rpartition(".")
        if kind == "gate_up_proj":  # [E, 2I, D], gate rows first
            for e, (gate, up) in enumerate(zip(*tensor.chunk(2, dim=1), strict=True)):
                tensors[f"{prefix}.{e}.gate_proj.weight"] = gate
                tensors[f"{prefix}.{e}.up_proj.weight"] = up
        elif kind == "down_proj" and ".experts." in name:
            tensors |= {f"{prefix}.{e}.down_proj.weight": t for e, t in enumerate(tensor)}
        else:
            tensors[name] = tensor
    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    reference.config.to_json_file(path / "config.json")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(folder, transformers model) of a tiny random Kimi K2.5 (untied head)."""
    hf_config = transformers.Kimi_K25Config(
        text_config=TEXT, vision_config=VISION, projection_hidden_size=32,
        projection_layer_norm_eps=1e-6, image_token_id=IMAGE, video_token_id=4094,
        vision_start_token_id=4090, vision_end_token_id=4091, tie_word_embeddings=False,
        attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    reference = transformers.Kimi_K25ForConditionalGeneration(hf_config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)
        for name, buffer in reference.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))
    path = tmp_path_factory.mktemp("kimi_k25") / "hf"
    save_in_memory_names(reference, path)
    return path, reference.eval()


def image_batch(grids=GRIDS, slots=2, places=40, seed=1, pad_value=0.0):
    """(tokens [B, T], media, HF's packed pixel_values and grids): each image's h*w/4
    placeholders between media begin/end tokens in random text; padding places hold
    ``pad_value``."""
    generator = torch.Generator().manual_seed(seed)
    rows, pixel_rows, packed = [], [], []
    for row_grids in grids:
        tokens = torch.randint(0, 4000, (3,), generator=generator).tolist()
        pixels = torch.full((slots, places, PATCH_DIM), pad_value)
        for slot, (t, h, w) in enumerate(row_grids):
            patches = torch.randn(t * h * w, PATCH_DIM, generator=generator)
            pixels[slot, : t * h * w] = patches
            packed.append(patches)
            tokens += [4090, 17] + [IMAGE] * (h * w // 4) + [4091]
            tokens += torch.randint(0, 4000, (4,), generator=generator).tolist()
        rows.append(tokens)
        pixel_rows.append(pixels)
    length = max(len(r) for r in rows)
    tokens = torch.tensor([r + [7] * (length - len(r)) for r in rows])
    grid = torch.zeros(len(grids), slots, 3, dtype=torch.int64)
    for row, row_grids in enumerate(grids):
        grid[row, : len(row_grids)] = torch.tensor(row_grids)
    media = {"pixel_values": torch.stack(pixel_rows), "image_grid_thw": grid}
    hf_pixels = torch.cat(packed).view(-1, 3, PATCH, PATCH)  # Kimi's processor: [n, C, p, p]
    return tokens, media, hf_pixels, torch.tensor([g for row in grids for g in row])


def reference_logits(reference, tokens, hf_pixels, grids):
    return reference(input_ids=tokens, pixel_values=hf_pixels, image_grid_thw=grids).logits


@torch.no_grad()
def test_logits_match_transformers(checkpoint, logits_parity) -> None:
    path, reference = checkpoint
    model = torchloom.from_hf(path)
    assert isinstance(model, KimiK25) and model.output is not None
    text = torch.randint(0, 4000, (2, 24), generator=torch.Generator().manual_seed(3))
    logits_parity("kimi_k25 text only", model(text), reference(text).logits)
    tokens, media, hf_pixels, grids = image_batch()
    theirs = reference_logits(reference, tokens, hf_pixels, grids)
    logits_parity("kimi_k25 2 + 1 images", model(tokens, media=media), theirs)


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
    logits_parity("2 more absent slots, 24 more padded places", got, expected)


@torch.no_grad()
def test_export_round_trips_through_transformers(checkpoint, tmp_path, logits_parity) -> None:
    model = torchloom.from_hf(checkpoint[0])
    out = tmp_path / "export"
    save_hf(out, "kimi_k25", model.config, model.state_dict().items())
    assert json.loads((out / "config.json").read_text())["model_type"] == "kimi_k25"
    reloaded = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(out).eval()
    tokens, media, hf_pixels, grids = image_batch(seed=5)
    theirs = reference_logits(reloaded, tokens, hf_pixels, grids)
    logits_parity("kimi_k25 export", model(tokens, media=media), theirs)
    assert torchloom.from_hf(out).config == model.config


def test_backward_reaches_the_vision_tower(checkpoint) -> None:
    model = torchloom.from_hf(checkpoint[0]).train()
    tokens, media, _, _ = image_batch()
    model(tokens, media=media).float().square().mean().backward()
    for name, param in model.vision_tower.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, f"{name} got no gradient"
    assert torch.isfinite(model.layers["2"].mlp.experts.gate_proj.grad).all()


def test_convert_round_trips_every_tensor(checkpoint, tmp_path) -> None:
    from torchloom.checkpoint.safetensors_io import iter_tensors
    from torchloom.cli import main

    path, _ = checkpoint
    assert main(["convert", "--from-hf", str(path), "--to", str(tmp_path / "tl")]) == 0
    assert main(["convert", "--from", str(tmp_path / "tl"), "--to-hf", str(tmp_path / "back")]) == 0
    original, back = dict(iter_tensors(path)), dict(iter_tensors(tmp_path / "back"))
    assert back.keys() == original.keys()
    assert any(name.startswith("model.mm_projector.") for name in back)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name


def test_initial_load_hf_trains_on_text(checkpoint, tmp_path) -> None:
    """--checkpoint.initial_load_hf of a Kimi K2.5 folder: a text run trains it and exports it."""
    from torchloom.cli import resolve_job
    from torchloom.train.trainer import Trainer

    path, _ = checkpoint
    args = ["--recipe", "debug", "--model.name", "kimi_k25", "--model.flavor", "debug",
            "--checkpoint.initial_load_hf", str(path), "--training.steps", "1",
            "--training.sample_tokens", "0", "--metrics.tensorboard", "false",
            "--checkpoint.export_hf", "true", "--output.dir", str(tmp_path / "run")]  # fmt: skip
    _, job = resolve_job(args)
    result = Trainer(job).train()
    assert result.steps == 1 and torch.isfinite(torch.tensor(result.first_loss))
    assert torchloom.from_hf(tmp_path / "run" / "hf").config == torchloom.from_hf(path).config


def test_debug_flavor_trains_and_counts_media_flops() -> None:
    cfg = KIMI_K25_FLAVORS["debug"]
    model = cfg.build()
    model.init_weights(0)
    tokens = torch.full((1, 12), 5)
    tokens[0, 2:6] = cfg.image_token_id  # a 4x4 image: 4 merged tokens
    media = {"pixel_values": torch.randn(1, 1, 16, cfg.vision.patch_values),
             "image_grid_thw": torch.tensor([[[1, 4, 4]]])}  # fmt: skip
    model(tokens, media=media).square().mean().backward()
    assert model.vision_tower.patch_embed.weight.grad.abs().sum() > 0
    assert model.media_flops(media) == model.vision_tower.flops(media["image_grid_thw"]) > 0
    assert model.media_flops(None) == 0
    tokens[0, 5] = 5  # 3 placeholders for 4 merged tokens
    with pytest.raises(ConfigError, match="row 0 has 3 image placeholder tokens but its"):
        model(tokens, media=media)


@pytest.mark.parametrize("flavor", list(KIMI_K25_FLAVORS))
def test_config_round_trips_and_counts_match_transformers(flavor: str) -> None:
    cfg = KIMI_K25_FLAVORS[flavor]
    hf = ADAPTER.config_to_hf(cfg)
    # The bias update rate is a training setting no config.json holds.
    assert ADAPTER.config_from_hf(hf) == replace(cfg, moe=replace(cfg.moe, bias_update_rate=0.0))
    if flavor == "debug":
        return
    with torch.device("meta"):
        reference = transformers.Kimi_K25ForConditionalGeneration(transformers.Kimi_K25Config(**hf))
    theirs = sum(p.numel() for p in reference.parameters())
    print(f"{flavor}: {cfg.num_params() / 1e9:.3f}B params, transformers {theirs / 1e9:.3f}B")
    assert cfg.num_params() == theirs


def test_config_refusals() -> None:
    base = ADAPTER.config_to_hf(KIMI_K25_FLAVORS["debug"])
    with pytest.raises(ConfigError, match="unknown option media_placeholder_token_id"):
        ADAPTER.config_from_hf(base | {"media_placeholder_token_id": 5})
    vision = base["vision_config"]
    with pytest.raises(ConfigError, match="unknown option init_pos_emb_height"):
        ADAPTER.config_from_hf(base | {"vision_config": vision | {"init_pos_emb_height": 64}})
    with pytest.raises(ConfigError, match="hidden_act='gelu'"):
        ADAPTER.config_from_hf(base | {"vision_config": vision | {"hidden_act": "gelu"}})
    with pytest.raises(ConfigError, match="unknown option sliding_window"):
        ADAPTER.config_from_hf(base | {"text_config": base["text_config"] | {"sliding_window": 8}})
    with pytest.raises(ConfigError, match="model.vision_tower.encoder.blocks.0.wqkv.weight"):
        ADAPTER.from_hf_name("model.vision_tower.encoder.blocks.0.wqkv.weight")
