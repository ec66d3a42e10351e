"""DeepSeek-V3 <-> transformers' DeepseekV3ForCausalLM: logits of random checkpoints (low-rank
and full-rank queries, groups, YaRN, both rotary layouts), exports transformers loads, `torchloom
convert` both ways, the MTP layers (what transformers' own MTP model reads, and what its
save_pretrained drops), the config mapping and its refusals."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.modeling_layers import MtpModel

import torchloom
from torchloom.checkpoint.hf import save_hf
from torchloom.checkpoint.model_io import save_model
from torchloom.checkpoint.safetensors_io import iter_tensors
from torchloom.cli import main
from torchloom.config.errors import ConfigError
from torchloom.models import build_model
from torchloom.models.deepseek_v3 import DEEPSEEK_V3_FLAVORS, DeepSeekV3, DeepSeekV3HFAdapter

ADAPTER = DeepSeekV3HFAdapter()
# 1 dense + 2 MoE layers of 8 experts in 2 groups (1 per token), one shared expert.
DS_TINY = dict(
    hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
    n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
)  # fmt: skip
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 32}  # fmt: skip
CASES = {
    "q_lora": {},
    "q_proj": {"q_lora_rank": None},
    "yarn": {"rope_parameters": YARN},
    "rotate_half": {"rope_interleave": False, "n_group": 4, "topk_group": 2},
}


@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_from_hf_logits_match_transformers(case, hf_checkpoint, logits_parity) -> None:
    path, reference = hf_checkpoint("deepseek_v3", **(DS_TINY | CASES[case]))
    model = torchloom.from_hf(path)
    assert isinstance(model, DeepSeekV3)
    assert model.mtp is None  # config.json says 1 MTP layer; transformers saved none
    assert (model.layers["0"].attention.q_proj is None) == (case != "q_proj")
    tokens = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    logits_parity(f"deepseek_v3 {case}", model(tokens), reference(tokens).logits)


def test_training_step_matches_transformers(hf_training_step) -> None:
    """Loss and gradients of the latent projections, the norms, the router and the experts."""
    model, reference = hf_training_step("deepseek_v3", **DS_TINY)
    theirs = reference.model.layers
    pairs = {
        "q_a_layernorm": (model.layers["0"].attention.q_a_layernorm.weight,
                          theirs[0].self_attn.q_a_layernorm.weight),
        "kv_a_proj_with_mqa": (model.layers["1"].attention.kv_a_proj_with_mqa.weight,
                               theirs[1].self_attn.kv_a_proj_with_mqa.weight),
        "kv_b_proj": (model.layers["2"].attention.kv_b_proj.weight,
                      theirs[2].self_attn.kv_b_proj.weight),
        "router": (model.layers["1"].mlp.router.weight, theirs[1].mlp.gate.weight),
        "shared experts": (model.layers["2"].mlp.shared_experts.down_proj.weight,
                           theirs[2].mlp.shared_experts.down_proj.weight),
    }  # fmt: skip
    # transformers keeps its experts fused as gate_up_proj [E, 2I, D] in memory.
    gate_grad, _ = theirs[2].mlp.experts.gate_up_proj.grad.chunk(2, dim=1)
    grads = {name: (ours.grad, hf.grad) for name, (ours, hf) in pairs.items()}
    grads["experts"] = (model.layers["2"].mlp.experts.gate_proj.grad, gate_grad)
    for name, (ours, hf) in grads.items():
        diff = (ours - hf).abs().max().item()
        print(f"  grad {name}: max abs diff {diff:.2e} (max {hf.abs().max().item():.2e})")
        torch.testing.assert_close(ours, hf, rtol=1e-4, atol=1e-6)


def test_generate_command_matches_transformers_greedy(
    hf_checkpoint, generate_matches_greedy
) -> None:
    """`torchloom generate` (latent cache, kv_b_proj absorbed) on prompts of different lengths
    decoded together gives transformers' greedy continuations (its cache up-projects)."""
    path, reference = hf_checkpoint("deepseek_v3", **DS_TINY)
    generate_matches_greedy(path, reference, max_new_tokens=8)


def _random_model(randomize, **changes) -> DeepSeekV3:
    model = build_model(replace(DEEPSEEK_V3_FLAVORS["debug"], vocab_size=512, **changes))
    randomize(model)
    return model.eval()


def test_export_with_mtp_loads_in_transformers_and_its_mtp_model(
    tmp_path, logits_parity, randomize
):
    """Our export: transformers' model gives our logits, and transformers' MTP model (which
    reads model.layers.3.* through its own name conversions) gives our MTP depth's output for
    the same previous hidden state; torchloom reads the export back exactly."""
    model = _random_model(randomize)
    save_hf(tmp_path / "hf", "deepseek_v3", model.config, model.state_dict().items())
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["num_nextn_predict_layers"] == 1
    names = set(dict(iter_tensors(tmp_path / "hf")))
    assert {"model.layers.3.eh_proj.weight", "model.layers.3.shared_head.norm.weight",
            "model.layers.3.self_attn.kv_b_proj.weight",
            "model.layers.3.mlp.experts.7.down_proj.weight"} <= names  # fmt: skip
    reference = transformers.DeepseekV3ForCausalLM.from_pretrained(
        tmp_path / "hf", attn_implementation="eager"
    ).eval()
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits_parity("deepseek_v3 export", model(tokens), reference(tokens).logits)
        # transformers looks for MTP layers at index 61 (DeepSeek-V3's) only.
        reference._keys_to_ignore_on_load_unexpected = [r"model\.layers\.3\..*"]
        mtp_reference = MtpModel.from_pretrained(reference)
        inputs = model.layer_inputs(tokens)
        h_BTD = model.run_blocks(model.embed_tokens(tokens), inputs)
        ahead = tokens.roll(-1, 1)
        _, ours = model.mtp.layers["3"](h_BTD, model.embed_tokens(ahead), inputs)
        positions = torch.arange(24).expand(2, 24)
        theirs = mtp_reference.forward_layer(0, h_BTD, positions, None, input_ids=ahead)
        logits_parity("deepseek_v3 MTP depth 1", model.logits(ours),
                      mtp_reference._project_to_logits(theirs))  # fmt: skip
    back = torchloom.from_hf(tmp_path / "hf")
    assert back.config == replace(model.config, moe=replace(model.config.moe, bias_update_rate=0))
    for (name, ours_t), theirs_t in zip(model.state_dict().items(), back.state_dict().values()):
        assert torch.equal(ours_t, theirs_t), name


def test_mtp_layers_in_a_checkpoint(tmp_path, randomize) -> None:
    """Copies of the embedding and head in an MTP layer (DeepSeek-V3's files) are skipped; a
    checkpoint holding only some of the announced MTP layers is refused by name."""
    model = _random_model(randomize, mtp_layers=2)
    save_hf(tmp_path / "hf", "deepseek_v3", model.config, model.state_dict().items())
    file = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(file)
    for depth in ("3", "4"):
        tensors[f"model.layers.{depth}.embed_tokens.weight"] = tensors[
            "model.embed_tokens.weight"
        ].clone()
        tensors[f"model.layers.{depth}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(file), metadata={"format": "pt"})
    back = torchloom.from_hf(tmp_path / "hf")
    assert back.config.mtp_layers == 2
    assert torch.equal(back.mtp.layers["4"].eh_proj.weight, model.mtp.layers["4"].eh_proj.weight)
    save_file({k: v for k, v in tensors.items() if not k.startswith("model.layers.4.")},
              str(file), metadata={"format": "pt"})  # fmt: skip
    with pytest.raises(ConfigError, match=r"announces 2 MTP layer\(s\).*holds MTP layer\(s\) "
                       r"model\.layers\.3; set num_nextn_predict_layers"):  # fmt: skip
        torchloom.from_hf(tmp_path / "hf")


def test_convert_both_ways(
    tmp_path, hf_checkpoint, logits_parity, randomize, convert_round_trip
) -> None:
    path, _ = hf_checkpoint("deepseek_v3", max_shard_size="100KB", **DS_TINY)
    original, back = convert_round_trip(path)
    assert back.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    model = _random_model(randomize, mtp_layers=0, first_dense_layers=2)
    save_model(model, "deepseek_v3", model.config, tmp_path / "ours")
    assert main(["convert", "--from", str(tmp_path / "ours"), "--to-hf",
                 str(tmp_path / "ours_hf")]) == 0  # fmt: skip
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours_hf", attn_implementation="eager"
    ).eval()
    tokens = torch.randint(0, 512, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits_parity("deepseek_v3 convert --to-hf", model(tokens), loaded(tokens).logits)


@pytest.mark.parametrize("flavor", list(DEEPSEEK_V3_FLAVORS))
def test_config_round_trips_through_hf(flavor: str) -> None:
    cfg = DEEPSEEK_V3_FLAVORS[flavor]
    if cfg.moe.score_func != "sigmoid":  # DeepSeek-V2's softmax routing: not a DeepseekV3
        with pytest.raises(ConfigError, match="score_func 'softmax'.*cannot be exported"):
            ADAPTER.config_to_hf(cfg)
        return
    # No config.json field holds the bias update rate: a loaded model keeps its bias fixed.
    expected = replace(cfg, moe=replace(cfg.moe, bias_update_rate=0.0))
    assert ADAPTER.config_from_hf(ADAPTER.config_to_hf(cfg)) == expected
    # transformers' shared experts are n_shared_experts experts wide, nothing else.
    with pytest.raises(ConfigError, match="shared_expert_dim 48.*cannot be exported"):
        ADAPTER.config_to_hf(replace(cfg, moe=replace(cfg.moe, shared_expert_dim=48)))


def test_config_written_by_transformers_and_deepseek_is_read() -> None:
    published = transformers.DeepseekV3Config(
        max_position_embeddings=163840,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    ).to_dict()  # fmt: skip
    # The keys only DeepSeek's own config.json has, with DeepSeek-V3's values.
    published |= {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
                  "ep_size": 1, "aux_loss_alpha": 0.0001, "seq_aux": True}  # fmt: skip
    expected = replace(DEEPSEEK_V3_FLAVORS["671B"], moe=replace(
        DEEPSEEK_V3_FLAVORS["671B"].moe, bias_update_rate=0.0))  # fmt: skip
    assert ADAPTER.config_from_hf(published) == expected


REFUSED = {
    "softmax": ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
    "greedy": ({"topk_method": "greedy"}, "topk_method='greedy' is not supported"),
    "kv heads": ({"num_key_value_heads": 2}, "num_key_value_heads=2 is not supported"),
    "head_dim": ({"head_dim": 16}, "head_dim=16 contradicts qk_nope_head_dim"),
    "no shared": ({"n_shared_experts": 0}, "n_shared_experts=0 is not supported"),
    "fp8": ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config=.*not supported"),
    "mscale": ({"rope_scaling": {"type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0,
                                 "original_max_position_embeddings": 64}},
               "mscale_all_dim without mscale"),
    "unknown": ({"index_topk": 2048}, "unknown option index_topk=2048"),
    "groups": ({"n_group": 3}, r"moe.num_groups \(3\) must divide moe.num_experts \(8\)"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_options_are_refused_by_name(case: str) -> None:
    change, message = REFUSED[case]
    hf = ADAPTER.config_to_hf(DEEPSEEK_V3_FLAVORS["debug"]) | change
    with pytest.raises(ConfigError, match=message):
        ADAPTER.config_from_hf(hf)


def test_names_map_both_ways() -> None:
    cfg = DEEPSEEK_V3_FLAVORS["debug"]
    pairs = {
        "layers.0.attention.q_a_layernorm.weight": "model.layers.0.self_attn.q_a_layernorm.weight",
        "layers.1.mlp.router.expert_bias": "model.layers.1.mlp.gate.e_score_correction_bias",
        "mtp.layers.3.enorm.weight": "model.layers.3.enorm.weight",
        "mtp.layers.3.norm.weight": "model.layers.3.shared_head.norm.weight",
        "mtp.layers.3.block.attention_norm.weight": "model.layers.3.input_layernorm.weight",
        "mtp.layers.3.block.mlp.router.weight": "model.layers.3.mlp.gate.weight",
    }
    for ours, theirs in pairs.items():
        assert ADAPTER.hf_names(ours, cfg) == ADAPTER.to_hf_name(ours) == theirs
    stacked = ADAPTER.hf_names("mtp.layers.3.block.mlp.experts.up_proj", cfg)
    assert stacked == [f"model.layers.3.mlp.experts.{e}.up_proj.weight" for e in range(8)]
    for copy in ("model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"):
        assert ADAPTER.from_hf_name(copy) is None
    assert re.fullmatch(r"layers\.2\.attention\.kv_b_proj\.weight",
                        ADAPTER.from_hf_name("model.layers.2.self_attn.kv_b_proj.weight"))  # fmt: skip
