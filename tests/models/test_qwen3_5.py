"""Qwen3.5 (dense and MoE text decoders) <-> transformers' Qwen3_5ForCausalLM and
Qwen3_5MoeForCausalLM: logits in fp32, export, config round trips, published shapes, and
greedy generation through `torchloom generate`."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import transformers

import torchloom
from torchloom.checkpoint.hf import save_hf
from torchloom.config.errors import ConfigError
from torchloom.models import get_hf_model_spec
from torchloom.models.qwen3_5 import (
    QWEN3_5_FLAVORS,
    QWEN3_5_MOE_FLAVORS,
    Qwen3_5HFAdapter,
    Qwen3_5MoeHFAdapter,
)

_LINEAR = dict(
    num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=8, linear_value_head_dim=12,
    # What the released configs hold: MRoPE sections (a no-op for text), theta 1e7.
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                     "mrope_section": [1, 1, 0], "mrope_interleaved": True},
)  # fmt: skip
KINDS = {
    # family, HF model_type, its ForCausalLM class, tiny config
    "dense": ("qwen3_5", "qwen3_5_text", transformers.Qwen3_5ForCausalLM, _LINEAR),
    "moe": ("qwen3_5_moe", "qwen3_5_moe_text", transformers.Qwen3_5MoeForCausalLM,
            _LINEAR | dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=32)),
}  # fmt: skip


def _checkpoint(kind: str, hf_checkpoint):
    _, model_type, _, tiny = KINDS[kind]
    config = dict(tiny)
    if kind == "moe":
        config["intermediate_size"] = None  # Qwen3_5MoeTextConfig has none
    return hf_checkpoint(model_type, **config)


@pytest.mark.parametrize("kind", list(KINDS))
@torch.no_grad()
def test_from_hf_logits_match_transformers(kind, hf_checkpoint, logits_parity) -> None:
    path, reference = _checkpoint(kind, hf_checkpoint)
    model = torchloom.from_hf(path)
    cfg = model.config
    assert not cfg.linear_fused_projections and cfg.ffn == ("moe" if kind == "moe" else "swiglu")
    tokens = torch.randint(0, 512, (2, 70), generator=torch.Generator().manual_seed(0))
    logits_parity(f"qwen3.5 {kind}", model(tokens), reference(tokens).logits)


@pytest.mark.parametrize("kind", list(KINDS))
@torch.no_grad()
def test_export_round_trips_through_transformers(
    kind, hf_checkpoint, tmp_path, logits_parity
) -> None:
    family, model_type, model_cls, _ = KINDS[kind]
    path, _ = _checkpoint(kind, hf_checkpoint)
    model = torchloom.from_hf(path)
    out = tmp_path / "export"
    save_hf(out, family, model.config, model.state_dict().items())
    assert json.loads((out / "config.json").read_text())["model_type"] == model_type
    reloaded = model_cls.from_pretrained(out).eval()
    tokens = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(2))
    logits_parity(f"qwen3.5 {kind} exported", model(tokens), reloaded(tokens).logits)
    assert torchloom.from_hf(out).config == model.config


@pytest.mark.parametrize(
    "adapter, flavors",
    [(Qwen3_5HFAdapter(), QWEN3_5_FLAVORS), (Qwen3_5MoeHFAdapter(), QWEN3_5_MOE_FLAVORS)],
    ids=["dense", "moe"],
)
def test_config_round_trips_through_hf(adapter, flavors) -> None:
    for cfg in flavors.values():
        assert adapter.config_from_hf(adapter.config_to_hf(cfg)) == cfg


def test_published_shapes() -> None:
    """The 9B-style dense default and Qwen3.5-35B-A3B (35B parameters, 3B active: the
    attention, DeltaNet, 8 routed + 1 shared experts and the output head)."""
    dense = QWEN3_5_FLAVORS["9B"].num_params()
    moe_cfg = QWEN3_5_MOE_FLAVORS["35B-A3B"]
    total, moe = moe_cfg.num_params(), moe_cfg.moe
    idle = (moe.num_experts - moe.top_k) * 3 * moe.expert_dim * moe_cfg.dim * moe_cfg.num_layers
    head = moe_cfg.vocab_size * moe_cfg.dim  # the output head works for every token
    active = moe_cfg.num_params(include_embedding=False) - idle + head
    print(f"dense {dense / 1e9:.2f}B; moe {total / 1e9:.2f}B, active {active / 1e9:.2f}B")
    assert 8.5e9 < dense < 10e9
    assert abs(total / 35e9 - 1) < 0.02 and 2.5e9 < active < 3.5e9


# The released checkpoints' classes: config, model, model_type.
MULTIMODAL = {
    "dense": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", "qwen3_5"),
    "moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe"),
}


@pytest.mark.parametrize("kind", list(KINDS))
@torch.no_grad()
def test_reads_the_language_model_of_a_multimodal_checkpoint(kind, tmp_path, logits_parity) -> None:
    """The released Qwen3.5 folders are Qwen3_5(Moe)ForConditionalGeneration: the language
    model loads from text_config and model.language_model.*, the vision tower is skipped, and
    the logits of a text prompt are the multimodal model's."""
    family, _, _, tiny = KINDS[kind]
    config_name, model_name, model_type = MULTIMODAL[kind]
    text = tiny | dict(
        vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256,
    )  # fmt: skip
    if kind == "dense":
        text["intermediate_size"] = 96
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=4, spatial_merge_size=2, temporal_patch_size=2)  # fmt: skip
    config = getattr(transformers, config_name)(text_config=text, vision_config=vision)
    reference = getattr(transformers, model_name)(config)
    generator = torch.Generator().manual_seed(0)
    for name, param in reference.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        param.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)
    reference.save_pretrained(tmp_path / "hf")
    assert get_hf_model_spec(model_type).name == family
    model = torchloom.from_hf(tmp_path / "hf")
    assert model.config.ffn == ("moe" if kind == "moe" else "swiglu")
    tokens = torch.randint(0, 512, (2, 30), generator=generator)
    logits_parity(f"qwen3.5 {kind} multimodal", model(tokens), reference.eval()(tokens).logits)


def test_config_refusals() -> None:
    dense, moe = Qwen3_5HFAdapter(), Qwen3_5MoeHFAdapter()
    with pytest.raises(ConfigError, match="unknown option num_experts"):
        dense.config_from_hf(dense.config_to_hf(QWEN3_5_FLAVORS["debug"]) | {"num_experts": 4})
    with pytest.raises(ConfigError, match="unknown option norm_topk_prob"):
        moe.config_from_hf(moe.config_to_hf(QWEN3_5_MOE_FLAVORS["debug"]) | {"norm_topk_prob": 0})
    raw = QWEN3_5_MOE_FLAVORS["debug"]
    raw = replace(raw, moe=replace(raw.moe, normalize_top_k=False))
    with pytest.raises(ConfigError, match="cannot be exported"):
        moe.config_to_hf(raw)
    with pytest.raises(ConfigError, match="no 'moe' feed-forward"):
        dense.config_to_hf(QWEN3_5_MOE_FLAVORS["debug"])
    text = dense.config_to_hf(QWEN3_5_FLAVORS["debug"])
    wrapped = {"model_type": "qwen3_5", "text_config": text}
    assert dense.config_from_hf(wrapped) == QWEN3_5_FLAVORS["debug"]
    with pytest.raises(ConfigError, match="reads the language model of Qwen3_5For"):
        dense.config_from_hf(wrapped | {"architectures": ["Qwen3_5ForSequenceClassification"]})
    with pytest.raises(ConfigError, match="needs a text_config"):
        dense.config_from_hf({"model_type": "qwen3_5"})


@pytest.mark.parametrize("kind", list(KINDS))
def test_generate_command_matches_transformers_greedy(
    kind, hf_checkpoint, generate_matches_greedy
) -> None:
    path, reference = _checkpoint(kind, hf_checkpoint)
    generate_matches_greedy(path, reference, max_new_tokens=6)
