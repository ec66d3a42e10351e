"""Qwen3-MoE <-> transformers' Qwen3MoeForCausalLM: per-expert tensors stacked on load and
unstacked on export, config mapping and refusals, logits and a training step in fp32."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import torchloom
from torchloom.checkpoint.hf import save_hf
from torchloom.config.errors import ConfigError
from torchloom.models.qwen3_moe import QWEN3_MOE_FLAVORS, Qwen3MoeHFAdapter

ADAPTER = Qwen3MoeHFAdapter()
# 8 experts, 3 per token, renormalised; layer 0 dense (mlp_only_layers), layers 1-2 MoE.
MOE_TINY = dict(
    num_hidden_layers=3, head_dim=16, moe_intermediate_size=48, num_experts=8,
    num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[0],
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)  # fmt: skip


@pytest.mark.parametrize("normalize", [True, False], ids=["norm_topk", "raw_topk"])
@torch.no_grad()
def test_from_hf_logits_match_transformers(normalize, hf_checkpoint, logits_parity) -> None:
    path, reference = hf_checkpoint("qwen3_moe", **(MOE_TINY | {"norm_topk_prob": normalize}))
    model = torchloom.from_hf(path)
    cfg = model.config
    assert (cfg.first_dense_layers, cfg.moe.num_experts, cfg.moe.top_k) == (1, 8, 3)
    assert cfg.moe.normalize_top_k == normalize
    assert model.layers["1"].mlp.experts.gate_proj.shape == (8, 48, 64)
    tokens = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    logits_parity(
        f"qwen3_moe 8 experts top-3 {normalize=}", model(tokens), reference(tokens).logits
    )


def test_training_step_matches_transformers(hf_training_step) -> None:
    """Loss and gradients of the router and the stacked experts, against transformers'."""
    model, reference = hf_training_step("qwen3_moe", **MOE_TINY)
    router = model.layers["1"].mlp.router.weight.grad
    torch.testing.assert_close(router, reference.model.layers[1].mlp.gate.weight.grad)
    # transformers keeps its experts fused as gate_up_proj [E, 2I, D] in memory.
    theirs = reference.model.layers[2].mlp.experts
    ours = model.layers["2"].mlp.experts
    gate_grad, up_grad = theirs.gate_up_proj.grad.chunk(2, dim=1)
    torch.testing.assert_close(ours.gate_proj.grad, gate_grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(ours.up_proj.grad, up_grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(ours.down_proj.grad, theirs.down_proj.grad, rtol=1e-4, atol=1e-7)


@torch.no_grad()
def test_export_round_trips_through_transformers(hf_checkpoint, tmp_path) -> None:
    path, _ = hf_checkpoint("qwen3_moe", **MOE_TINY)
    model = torchloom.from_hf(path)
    out = tmp_path / "export"
    save_hf(out, "qwen3_moe", model.config, model.state_dict().items())
    hf_config = json.loads((out / "config.json").read_text())
    assert hf_config["mlp_only_layers"] == [0] and hf_config["num_experts"] == 8
    reloaded = transformers.Qwen3MoeForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(reloaded(tokens).logits, model(tokens), rtol=1e-5, atol=1e-5)
    assert torchloom.from_hf(out).config == model.config


@pytest.mark.parametrize("flavor", list(QWEN3_MOE_FLAVORS))
def test_config_round_trips_through_hf(flavor: str) -> None:
    cfg = QWEN3_MOE_FLAVORS[flavor]
    assert ADAPTER.config_from_hf(ADAPTER.config_to_hf(cfg)) == cfg


def test_published_shapes() -> None:
    """Parameter counts of the released models: 30.5B total / 3.3B active, 235B / 22B."""
    for flavor, total, active in (("30B-A3B", 30.53e9, 3.35e9), ("235B-A22B", 235.1e9, 22.2e9)):
        cfg = QWEN3_MOE_FLAVORS[flavor]
        assert abs(cfg.num_params() / total - 1) < 0.01, (flavor, cfg.num_params())
        # Active weights per token: 6 FLOPs each; attention's seq term is zero at seq_len 0.
        active_params = cfg.flops_per_token(0) / 6 + cfg.vocab_size * cfg.dim  # + embedding
        assert abs(active_params / active - 1) < 0.02, (flavor, active_params)


def test_config_refusals() -> None:
    base = ADAPTER.config_to_hf(QWEN3_MOE_FLAVORS["debug"])
    with pytest.raises(ConfigError, match=r"mlp_only_layers=\[1\].*dense layers first"):
        ADAPTER.config_from_hf(base | {"mlp_only_layers": [1]})
    with pytest.raises(ConfigError, match="decoder_sparse_step=2"):
        ADAPTER.config_from_hf(base | {"decoder_sparse_step": 2})
    with pytest.raises(ConfigError, match="moe.top_k .9. exceeds moe.num_experts .8."):
        ADAPTER.config_from_hf(base | {"num_experts_per_tok": 9})
    aux = ADAPTER.config_from_hf(base | {"output_router_logits": True})
    assert aux.moe.balance_loss == "batch"
    assert aux.moe.balance_loss_coef == pytest.approx(base["router_aux_loss_coef"] * 2)
    grouped = QWEN3_MOE_FLAVORS["debug"]
    from dataclasses import replace

    sigmoid = replace(grouped, moe=replace(grouped.moe, score_func="sigmoid"))
    with pytest.raises(ConfigError, match="cannot be exported"):
        ADAPTER.config_to_hf(sigmoid)


def test_generate_command_matches_transformers_greedy(
    hf_checkpoint, generate_matches_greedy
) -> None:
    """`torchloom generate` on a Qwen3-MoE folder: prompts of different lengths decoded
    together give transformers' greedy continuations."""
    path, reference = hf_checkpoint("qwen3_moe", **MOE_TINY)
    generate_matches_greedy(path, reference, max_new_tokens=6)
