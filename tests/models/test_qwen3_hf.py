"""Qwen3 <-> transformers' Qwen3ForCausalLM: config mapping, refusals, logits and training-step
parity of checkpoints written by ``save_pretrained``, tied and untied."""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import torchloom
from torchloom.config.errors import ConfigError
from torchloom.models import Decoder
from torchloom.models.qwen3 import QWEN3_FLAVORS, Qwen3HFAdapter

ADAPTER = Qwen3HFAdapter()
# heads * head_dim (4 * 32) != hidden_size (64), as in the released 0.6B and 4B shapes.
QWEN_TINY = {"head_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@torch.no_grad()
def test_from_hf_logits_match_transformers(tied, hf_checkpoint, logits_parity) -> None:
    # The untied checkpoint is sharded (transformers writes an index), the tied one is one file.
    shard = None if tied else "40KB"
    path, reference = hf_checkpoint(
        "qwen3", tie_word_embeddings=tied, max_shard_size=shard, **QWEN_TINY
    )
    model = torchloom.from_hf(path)
    assert isinstance(model, Decoder) and model.config.qk_norm
    assert model.config.tie_embeddings == tied and (model.output is None) == tied
    tokens = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(0))
    label = f"qwen3 GQA 4/2 head_dim 32 {'tied' if tied else 'untied'}"
    logits_parity(label, model(tokens), reference(tokens).logits)


def test_tied_checkpoint_ignores_a_stored_lm_head(hf_checkpoint, logits_parity) -> None:
    """Some tied checkpoints also store lm_head.weight; transformers ignores it, and so do we."""
    path, reference = hf_checkpoint("qwen3", tie_word_embeddings=True, **QWEN_TINY)
    tensors = load_file(path / "model.safetensors")
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = torch.zeros_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    tokens = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits_parity("qwen3 tied + stored lm_head", torchloom.from_hf(path)(tokens),
                      reference(tokens).logits)  # fmt: skip


def test_training_step_matches_transformers(hf_training_step) -> None:
    """Tied head: the embedding's gradient sums the lookup's and the head's, as in transformers."""
    model, reference = hf_training_step("qwen3", tie_word_embeddings=True, **QWEN_TINY)
    for name in ("embed_tokens.weight", "layers.0.attention.k_norm.weight",
                 "layers.0.attention.v_proj.weight", "layers.1.attention_norm.weight"):  # fmt: skip
        ours = model.get_parameter(name).grad
        theirs = reference.get_parameter(ADAPTER.to_hf_name(name)).grad
        diff = (ours - theirs).abs().max().item()
        print(f"  grad {name}: max abs diff {diff:.2e} (max {theirs.abs().max().item():.2e})")
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("flavor", list(QWEN3_FLAVORS))
def test_config_round_trips_through_hf(flavor: str) -> None:
    cfg = QWEN3_FLAVORS[flavor]
    assert ADAPTER.config_from_hf(ADAPTER.config_to_hf(cfg)) == cfg


def test_config_written_by_transformers_is_read() -> None:
    published = transformers.Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ).to_dict()  # fmt: skip
    assert ADAPTER.config_from_hf(published) == QWEN3_FLAVORS["0.6B"]
    # Qwen3Config's head_dim default is 128, not hidden_size // heads (64 here).
    assert ADAPTER.config_from_hf(published | {"head_dim": None}).head_dim == 128


REFUSED = {
    "window off": ({"layer_types": ["full_attention", "sliding_attention"]},
                   "sliding_attention layers but use_sliding_window is not true"),
    "layer types": ({"layer_types": ["full_attention", "chunked_attention"]},
                    "layer_types ['chunked_attention'] are not supported"),
    "attention_bias": ({"attention_bias": True}, "attention_bias=True is not supported"),
    "model_type": ({"model_type": "qwen3_moe"}, "model_type is 'qwen3_moe', not 'qwen3'"),
    "unknown": ({"num_experts": 8}, "unknown option num_experts=8"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_options_are_refused_by_name(case: str) -> None:
    change, message = REFUSED[case]
    hf = ADAPTER.config_to_hf(QWEN3_FLAVORS["debug"]) | change
    with pytest.raises(ConfigError, match=re.escape(message)):
        ADAPTER.config_from_hf(hf)


def test_export_refuses_an_architecture_transformers_cannot_hold() -> None:
    from dataclasses import replace

    with pytest.raises(ConfigError, match="qk_norm=False.*Qwen3ForCausalLM"):
        ADAPTER.config_to_hf(replace(QWEN3_FLAVORS["debug"], qk_norm=False))


# Gemma-style interleaving: a sliding-window layer, then a full one; the window (4) is shorter
# than the sequences (24 tokens), so the sliding layer's mask matters.
SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": True,
           "sliding_window": 4, **QWEN_TINY}  # fmt: skip


@torch.no_grad()
def test_sliding_window_layers_match_transformers(hf_checkpoint, logits_parity, tmp_path) -> None:
    """layer_types + sliding_window are read into per-layer masks; the logits equal
    transformers' (whose eager mask slides on the sliding layer), and export -> reload keeps
    the config, the keys transformers reads and the logits."""
    from dataclasses import replace

    from torchloom.checkpoint.hf import save_hf
    from torchloom.kernels.attention_mask import CAUSAL, AttentionMask

    path, reference = hf_checkpoint("qwen3", **SLIDING)
    model = torchloom.from_hf(path)
    assert model.config.layer_types == ("sliding_attention", "full_attention")
    assert model.layers["0"].attention.mask == AttentionMask(window=4)
    assert model.layers["1"].attention.mask == CAUSAL
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    theirs = reference(tokens).logits
    logits_parity("qwen3 sliding window 4 + full", model(tokens), theirs)
    # The reference really slides: the same weights with full attention everywhere differ.
    full = Decoder(replace(model.config, layer_types=(), sliding_window=None))
    full.load_state_dict(model.state_dict())
    differs = ((full(tokens) - theirs).abs().max() / theirs.abs().max()).item()
    print(f"full attention everywhere vs transformers: relative {differs:.1e}")
    assert differs > 1e-3

    save_hf(tmp_path / "out", "qwen3", model.config, model.state_dict().items())
    reloaded = torchloom.from_hf(tmp_path / "out")
    assert reloaded.config == model.config
    assert torch.equal(reloaded(tokens), model(tokens))
    exported = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert exported.layer_types == SLIDING["layer_types"] and exported.sliding_window == 4


def test_sliding_layers_from_max_window_layers() -> None:
    """Without layer_types, transformers slides the layers from max_window_layers on, and only
    with use_sliding_window; sliding layers elsewhere than qwen3 are refused, not dropped."""
    from torchloom.models.qwen3_moe import Qwen3MoeHFAdapter

    hf = ADAPTER.config_to_hf(QWEN3_FLAVORS["debug"])
    window = {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}
    cfg = ADAPTER.config_from_hf(hf | window)
    assert cfg.layer_types == ("full_attention", "sliding_attention") and cfg.sliding_window == 8
    assert ADAPTER.config_from_hf(hf | window | {"use_sliding_window": False}).layer_types == ()
    moe = Qwen3MoeHFAdapter()
    moe_hf = hf | {"model_type": "qwen3_moe", "architectures": [moe.architecture]}
    with pytest.raises(ConfigError, match="use_sliding_window=True is not supported"):
        moe.config_from_hf(moe_hf | {"layer_types": ["sliding_attention"] * 2, **window})
