"""Kimi Linear <-> transformers' KimiLinearForCausalLM: logits and a training step of random
checkpoints (KDA and NoPE MLA layers, dense and MoE feed-forwards), `torchloom generate` against
transformers' greedy generate, exports transformers loads, the config mapping (Moonshot's
config.json and transformers'), the published shape and the refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers

import torchloom
from torchloom.checkpoint.hf import save_hf
from torchloom.checkpoint.safetensors_io import iter_tensors
from torchloom.config.errors import ConfigError
from torchloom.models import build_model
from torchloom.models.kimi_linear import KIMI_LINEAR_FLAVORS, KimiLinearHFAdapter

ADAPTER = KimiLinearHFAdapter()
# KDA, MLA, KDA, MLA; 1 dense + 3 MoE layers of 8 experts (2 per token) and a shared expert.
KL_TINY = dict(
    hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_local_experts=8,
    num_experts_per_tok=2, n_shared_experts=1, linear_num_heads=4, linear_head_dim=16,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    pad_token_id=None, bos_token_id=None, eos_token_id=None,
)  # fmt: skip
CASES = {
    "q_proj": {},
    "q_lora": {"q_lora_rank": 48},
    "groups": {"n_group": 4, "topk_group": 2, "num_experts_per_tok": 3},
}


@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_from_hf_logits_match_transformers(case, hf_checkpoint, logits_parity) -> None:
    path, reference = hf_checkpoint("kimi_linear", **(KL_TINY | CASES[case]))
    model = torchloom.from_hf(path)
    kinds = [type(block.attention).__name__ for block in model.layers.values()]
    assert kinds == ["KimiDeltaAttention", "MultiHeadLatentAttention"] * 2
    tokens = torch.randint(0, 512, (2, 70), generator=torch.Generator().manual_seed(0))
    logits_parity(f"kimi_linear {case}", model(tokens), reference(tokens).logits)


def test_training_step_matches_transformers(hf_training_step) -> None:
    """Loss and the gradients of KDA's gates and convolutions, MLA and the experts."""
    model, reference = hf_training_step("kimi_linear", **KL_TINY, length=41)
    ours, theirs = model.layers, reference.model.layers
    gate_grad, _ = theirs[2].mlp.experts.gate_up_proj.grad.chunk(2, dim=1)
    q_conv_grad = theirs[0].self_attn.conv1d.weight.grad.chunk(3, dim=0)[0]
    grads = {
        "A_log": (ours["0"].attention.A_log, theirs[0].self_attn.forget_gate.A_log.grad),
        "dt_bias": (ours["2"].attention.dt_bias, theirs[2].self_attn.forget_gate.dt_bias.grad),
        "q_conv1d": (ours["0"].attention.q_conv1d.weight, q_conv_grad),
        "b_proj": (ours["2"].attention.b_proj.weight, theirs[2].self_attn.b_proj.weight.grad),
        "g_b_proj": (ours["0"].attention.g_b_proj.weight, theirs[0].self_attn.g_b_proj.weight.grad),
        "kv_b_proj": (ours["1"].attention.kv_b_proj.weight,
                      theirs[1].self_attn.kv_b_proj.weight.grad),
        "router": (ours["3"].mlp.router.weight, theirs[3].mlp.gate.weight.grad),
        "experts": (ours["2"].mlp.experts.gate_proj, gate_grad),
    }  # fmt: skip
    for name, (param, hf_grad) in grads.items():
        diff = (param.grad - hf_grad).abs().max().item()
        print(f"  grad {name}: max abs diff {diff:.2e} (max {hf_grad.abs().max().item():.2e})")
        torch.testing.assert_close(param.grad, hf_grad, rtol=1e-4, atol=1e-6)


def test_generate_command_matches_transformers_greedy(
    hf_checkpoint, generate_matches_greedy
) -> None:
    """`torchloom generate` (KDA's recurrent state, MLA's latent cache) on prompts of different
    lengths decoded together gives transformers' greedy continuations."""
    path, reference = hf_checkpoint("kimi_linear", **KL_TINY)
    generate_matches_greedy(path, reference, max_new_tokens=8)


def test_export_loads_in_transformers_and_reads_back(tmp_path, logits_parity, randomize) -> None:
    model = build_model(replace(KIMI_LINEAR_FLAVORS["debug"], vocab_size=512))
    randomize(model)
    model.eval()
    save_hf(tmp_path / "hf", "kimi_linear", model.config, model.state_dict().items())
    names = set(dict(iter_tensors(tmp_path / "hf")))
    assert {"model.layers.0.mlp.gate_proj.weight", "model.layers.0.self_attn.q_conv1d.weight",
            "model.layers.1.block_sparse_moe.experts.7.w3.weight",
            "model.layers.1.block_sparse_moe.gate.e_score_correction_bias",
            "model.layers.3.self_attn.kv_b_proj.weight"} <= names  # fmt: skip
    reference = transformers.KimiLinearForCausalLM.from_pretrained(
        tmp_path / "hf", attn_implementation="eager"
    ).eval()
    assert reference.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits_parity("kimi_linear export", model(tokens), reference(tokens).logits)
    back = torchloom.from_hf(tmp_path / "hf")
    assert back.config == replace(model.config, moe=replace(model.config.moe, bias_update_rate=0))
    for (name, ours_t), theirs_t in zip(model.state_dict().items(), back.state_dict().values()):
        assert torch.equal(ours_t, theirs_t), name


def test_convert_both_ways(hf_checkpoint, convert_round_trip) -> None:
    """transformers' folder -> torchloom -> HF: the same tensors (a dense layer's SwiGLU, which
    transformers writes under block_sparse_moe, comes back under Moonshot's mlp)."""
    path, _ = hf_checkpoint("kimi_linear", max_shard_size="100KB", **KL_TINY)
    original, back = convert_round_trip(path)
    renamed = {n.replace("0.block_sparse_moe.", "0.mlp."): t for n, t in original.items()}
    assert back.keys() == renamed.keys()
    for name, tensor in renamed.items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize("flavor", list(KIMI_LINEAR_FLAVORS))
def test_config_round_trips_through_hf(flavor: str) -> None:
    cfg = KIMI_LINEAR_FLAVORS[flavor]
    expected = replace(cfg, moe=replace(cfg.moe, bias_update_rate=0.0), rope=type(cfg.rope)())
    assert ADAPTER.config_from_hf(ADAPTER.config_to_hf(cfg)) == expected
    hf = transformers.KimiLinearConfig(**ADAPTER.config_to_hf(cfg))
    assert hf.layer_types == ADAPTER.config_to_hf(cfg)["layer_types"]
    assert hf.mlp_layer_types == ["dense"] + ["sparse"] * (cfg.num_layers - 1)


# Moonshot's config.json of moonshotai/Kimi-Linear-48B-A3B-Instruct (the network's keys).
PUBLISHED = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
    "first_k_dense_replace": 1, "head_dim": 72, "hidden_act": "silu", "hidden_size": 2304,
    "initializer_range": 0.02, "intermediate_size": 9216, "kv_lora_rank": 512,
    "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128,
                           "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18,
                                          19, 21, 22, 23, 25, 26],
                           "num_heads": 32, "short_conv_kernel_size": 4},
    "mla_use_nope": True, "model_max_length": 1048576, "moe_intermediate_size": 1024,
    "moe_layer_freq": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
    "num_attention_heads": 32, "num_expert_group": 1, "num_experts": 256,
    "num_experts_per_token": 8, "num_hidden_layers": 27, "num_key_value_heads": 32,
    "num_nextn_predict_layers": 0, "num_shared_experts": 1, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-5,
    "rope_scaling": None, "rope_theta": 10000.0, "routed_scaling_factor": 2.446,
    "tie_word_embeddings": False, "topk_group": 1, "torch_dtype": "bfloat16",
    "use_grouped_topk": True, "v_head_dim": 128, "vocab_size": 163840,
    "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
}  # fmt: skip


def test_published_config_is_read_as_the_flavor() -> None:
    assert ADAPTER.config_from_hf(PUBLISHED) == KIMI_LINEAR_FLAVORS["48B-A3B"]
    # transformers' own reading of it gives the same schedule.
    hf = transformers.KimiLinearConfig(**PUBLISHED)
    assert ADAPTER.config_from_hf(hf.to_dict()) == KIMI_LINEAR_FLAVORS["48B-A3B"]


def test_published_shape() -> None:
    """48B total, 3B activated (Moonshot's model card), counted from the built model."""
    cfg = KIMI_LINEAR_FLAVORS["48B-A3B"]
    total, active = cfg.num_params(), cfg.flops_per_token(0) / 6
    print(f"Kimi-Linear-48B-A3B: {total / 1e9:.3f}B parameters, {active / 1e9:.3f}B active")
    assert abs(total / 48e9 - 1) < 0.03 and abs(active / 3e9 - 1) < 0.1


REFUSED = {
    "rope": ({"mla_use_nope": False}, "mla_use_nope=False is not supported"),
    "softmax": ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
    "kv heads": ({"num_key_value_heads": 2}, "num_key_value_heads=2 is not supported"),
    "gate bound": ({"linear_attn_config": {"gate_lower_bound": -5.0}}, "gate_lower_bound"),
    "schedule": ({"mlp_layer_types": ["sparse", "dense", "sparse", "sparse"]},
                 "mlp_layer_types .* is not supported"),
    "mtp": ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers=1 is not supported"),
    "unknown": ({"index_topk": 2048}, "unknown option index_topk=2048"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_options_are_refused_by_name(case: str) -> None:
    change, message = REFUSED[case]
    hf = ADAPTER.config_to_hf(KIMI_LINEAR_FLAVORS["debug"]) | change
    with pytest.raises(ConfigError, match=message):
        ADAPTER.config_from_hf(hf)


def test_export_refuses_what_transformers_cannot_hold() -> None:
    cfg = KIMI_LINEAR_FLAVORS["debug"]
    with pytest.raises(ConfigError, match="never ties them"):
        ADAPTER.config_to_hf(replace(cfg, tie_embeddings=True))
    with pytest.raises(ConfigError, match="mla_use_nope false"):
        ADAPTER.config_to_hf(replace(cfg, mla_use_nope=False))
    with pytest.raises(ConfigError, match="score_func 'softmax'"):
        ADAPTER.config_to_hf(replace(cfg, moe=replace(cfg.moe, score_func="softmax")))
    # transformers' shared experts are ungated and n_shared_experts experts wide.
    for change, message in (({"shared_expert_gate": True}, "shared_expert_gate True"),
                            ({"shared_expert_dim": 48}, "shared_expert_dim 48")):  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            ADAPTER.config_to_hf(replace(cfg, moe=replace(cfg.moe, **change)))


def test_flex_backend_is_refused() -> None:
    with pytest.raises(ConfigError, match="attn_backend 'flex' is not supported by kimi_linear"):
        replace(KIMI_LINEAR_FLAVORS["debug"], attn_backend="flex").validate()
