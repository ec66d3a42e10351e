"""DeepSeek-V3.2 <-> transformers' DeepseekV32ForCausalLM: logits of random checkpoints on
sequences longer than index_topk (the indexer really selects), a training step's gradients,
`torchloom generate` against transformers' greedy decoding, exports transformers loads (indexer
tensors included), `torchloom convert` both ways, the config mapping and its refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers

import torchloom
from torchloom.checkpoint.hf import save_hf
from torchloom.checkpoint.model_io import save_model
from torchloom.checkpoint.safetensors_io import iter_tensors
from torchloom.cli import main
from torchloom.config.errors import ConfigError
from torchloom.models import build_model
from torchloom.models.deepseek_v32 import (
    DEEPSEEK_V32_FLAVORS,
    DeepSeekV32,
    DeepSeekV32HFAdapter,
)

ADAPTER = DeepSeekV32HFAdapter()
# 1 dense + 2 MoE layers of 8 experts in 2 groups; a 16-head indexer picking 8 keys (with
# fewer heads, some keys score exactly 0, every head's ReLU closed, and ties at the top-k
# boundary, which transformers' torch.topk and our stable sort break differently).
V32_TINY = dict(
    hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
    n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
    index_topk=8, index_n_heads=16, index_head_dim=16,
)  # fmt: skip
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 32}  # fmt: skip


@pytest.mark.parametrize("case", ["default", "yarn"])
@torch.no_grad()
def test_from_hf_logits_match_transformers(case, hf_checkpoint, logits_parity) -> None:
    """40 tokens, 8 picks per query: our logits are transformers'; the same model attending to
    every causal key (index_topk 40) gives clearly different ones."""
    change = {"rope_parameters": YARN} if case == "yarn" else {}
    path, reference = hf_checkpoint("deepseek_v32", **(V32_TINY | change))
    model = torchloom.from_hf(path)
    assert isinstance(model, DeepSeekV32) and model.config.index_topk == 8
    tokens = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    ours = model(tokens)
    logits_parity(f"deepseek_v32 {case}", ours, reference(tokens).logits)
    for block in model.layers.values():
        block.attention.indexer.mask = replace(block.attention.indexer.mask, topk=40)
    dense = model(tokens)
    relative = ((dense - ours).abs().max() / ours.abs().max()).item()
    print(f"  sparse vs dense attention: relative logit difference {relative:.1e}")
    assert relative > 1e-2


@torch.no_grad()
def test_shorter_than_topk_attends_to_every_key(hf_checkpoint, logits_parity) -> None:
    """T < index_topk: every query picks all its causal keys (the dense model's logits)."""
    path, reference = hf_checkpoint("deepseek_v32", **(V32_TINY | {"index_topk": 64}))
    model = torchloom.from_hf(path)
    tokens = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    logits_parity("deepseek_v32 T < topk", model(tokens), reference(tokens).logits)


def test_training_step_matches_transformers(hf_training_step) -> None:
    """Loss and gradients through the sparse attention (40 tokens, 8 picks): the latent
    projections, the query latent the indexer also reads, the experts. The indexer gets no
    gradient from the language-model loss in either (its picks are discrete)."""
    model, reference = hf_training_step("deepseek_v32", length=41, **V32_TINY)
    theirs = reference.model.layers
    pairs = {
        "q_a_proj": (model.layers["0"].attention.q_a_proj.weight,
                     theirs[0].self_attn.q_a_proj.weight),
        "q_b_proj": (model.layers["1"].attention.q_b_proj.weight,
                     theirs[1].self_attn.q_b_proj.weight),
        "kv_a_proj_with_mqa": (model.layers["1"].attention.kv_a_proj_with_mqa.weight,
                               theirs[1].self_attn.kv_a_proj_with_mqa.weight),
        "kv_b_proj": (model.layers["2"].attention.kv_b_proj.weight,
                      theirs[2].self_attn.kv_b_proj.weight),
        "o_proj": (model.layers["2"].attention.o_proj.weight, theirs[2].self_attn.o_proj.weight),
        "router": (model.layers["1"].mlp.router.weight, theirs[1].mlp.gate.weight),
    }  # fmt: skip
    for name, (ours, hf) in pairs.items():
        diff = (ours.grad - hf.grad).abs().max().item()
        print(f"  grad {name}: max abs diff {diff:.2e} (max {hf.grad.abs().max().item():.2e})")
        torch.testing.assert_close(ours.grad, hf.grad, rtol=1e-4, atol=1e-6)
    for layer in range(3):
        ours_indexer = model.layers[str(layer)].attention.indexer
        assert all(p.grad is None for p in ours_indexer.parameters())
        assert all(p.grad is None for p in theirs[layer].self_attn.indexer.parameters())


def test_generate_command_matches_transformers_greedy(
    hf_checkpoint, generate_matches_greedy
) -> None:
    """`torchloom generate` (latent and indexer-key cache) on prompts of different lengths
    decoded together past index_topk gives transformers' greedy continuations."""
    path, reference = hf_checkpoint("deepseek_v32", **V32_TINY)
    generate_matches_greedy(path, reference, max_new_tokens=12)


def _random_model(randomize, **changes) -> DeepSeekV32:
    """The debug flavor with random weights and 16 indexer heads (see V32_TINY)."""
    cfg = replace(DEEPSEEK_V32_FLAVORS["debug"], vocab_size=512, index_num_heads=16)
    model = build_model(replace(cfg, **changes))
    randomize(model)
    return model.eval()


def test_export_loads_in_transformers(tmp_path, logits_parity, randomize) -> None:
    """Our export (indexer and MTP tensors included): transformers gives our logits on 48
    tokens with 32 picks, and torchloom reads it back exactly."""
    model = _random_model(randomize)
    save_hf(tmp_path / "hf", "deepseek_v32", model.config, model.state_dict().items())
    names = set(dict(iter_tensors(tmp_path / "hf")))
    assert {"model.layers.0.self_attn.indexer.wq_b.weight",
            "model.layers.2.self_attn.indexer.k_norm.bias",
            "model.layers.1.self_attn.indexer.weights_proj.weight",
            "model.layers.3.self_attn.indexer.wk.weight"} <= names  # fmt: skip
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", attn_implementation="eager"
    ).eval()
    assert isinstance(reference, transformers.DeepseekV32ForCausalLM)
    tokens = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits_parity("deepseek_v32 export", model(tokens), reference(tokens).logits)
    back = torchloom.from_hf(tmp_path / "hf")
    assert back.config == replace(model.config, moe=replace(model.config.moe, bias_update_rate=0))
    for (name, ours_t), theirs_t in zip(model.state_dict().items(), back.state_dict().values()):
        assert torch.equal(ours_t, theirs_t), name


def test_convert_both_ways(hf_checkpoint, convert_round_trip) -> None:
    path, _ = hf_checkpoint("deepseek_v32", **V32_TINY)
    original, back = convert_round_trip(path)
    assert back.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name


def test_save_model_then_convert_to_hf(tmp_path, randomize, logits_parity) -> None:
    model = _random_model(randomize, mtp_layers=0)
    save_model(model, "deepseek_v32", model.config, tmp_path / "ours")
    assert main(["convert", "--from", str(tmp_path / "ours"), "--to-hf",
                 str(tmp_path / "ours_hf")]) == 0  # fmt: skip
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours_hf", attn_implementation="eager"
    ).eval()
    tokens = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits_parity("deepseek_v32 convert --to-hf", model(tokens), loaded(tokens).logits)


@pytest.mark.parametrize("flavor", list(DEEPSEEK_V32_FLAVORS))
def test_config_round_trips_through_hf(flavor: str) -> None:
    cfg = DEEPSEEK_V32_FLAVORS[flavor]
    expected = replace(cfg, moe=replace(cfg.moe, bias_update_rate=0.0))
    assert ADAPTER.config_from_hf(ADAPTER.config_to_hf(cfg)) == expected


def test_transformers_defaults_are_the_published_flavor() -> None:
    """DeepseekV32Config's defaults (the DeepSeek-V3.2-Exp checkpoint), with the YaRN and the
    keys only DeepSeek's own config.json holds, read as the 671B flavor."""
    published = transformers.DeepseekV32Config(
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    ).to_dict()  # fmt: skip
    published |= {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
                  "ep_size": 1, "aux_loss_alpha": 0.0001, "seq_aux": True,
                  "num_nextn_predict_layers": 1}  # fmt: skip
    flavor = DEEPSEEK_V32_FLAVORS["671B"]
    assert ADAPTER.config_from_hf(published) == replace(
        flavor, moe=replace(flavor.moe, bias_update_rate=0.0)
    )


REFUSED = {
    "unknown": ({"index_share": True}, "unknown option index_share=True"),
    "interleave": ({"rope_interleave": False}, "rope_interleave=false is not"),
    "no q latent": ({"q_lora_rank": None}, "q_lora_rank must be set"),
    "mlp types": ({"mlp_layer_types": ["sparse"] * 3}, "mlp_layer_types=.*is not supported"),
    "layer types": ({"layer_types": ["full_attention"] * 3}, "layer_types=.*is not supported"),
    "mlp bias": ({"mlp_bias": True}, "mlp_bias=True is not supported"),
    "index dim": ({"index_head_dim": 4}, r"index_head_dim \(4\) must be at least"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_options_are_refused_by_name(case: str) -> None:
    change, message = REFUSED[case]
    hf = ADAPTER.config_to_hf(DEEPSEEK_V32_FLAVORS["debug"]) | change
    with pytest.raises(ConfigError, match=message):
        ADAPTER.config_from_hf(hf)


def test_indexer_names_map_both_ways() -> None:
    cfg = DEEPSEEK_V32_FLAVORS["debug"]
    for part in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias",
                 "weights_proj.weight"):  # fmt: skip
        ours, theirs = (
            f"layers.1.attention.indexer.{part}",
            f"model.layers.1.self_attn.indexer.{part}",
        )
        assert ADAPTER.hf_names(ours, cfg) == theirs
        assert ADAPTER.from_hf_name(theirs) == ours
    mtp = "mtp.layers.3.block.attention.indexer.wk.weight"
    assert ADAPTER.to_hf_name(mtp) == "model.layers.3.self_attn.indexer.wk.weight"


def test_initial_load_hf_warms_up_the_indexers(hf_checkpoint, tmp_path) -> None:
    """--checkpoint.initial_load_hf of a DeepSeek-V3.2 folder with the dsa_warmup transform:
    two steps change the indexers' tensors only, and the export holds them all."""
    from torchloom.cli import resolve_job
    from torchloom.train.trainer import Trainer

    path, _ = hf_checkpoint("deepseek_v32", **(V32_TINY | {"vocab_size": 4096}))
    args = ["--recipe", "deepseek_v32_debug", "--checkpoint.initial_load_hf", str(path),
            "--model.transforms", '["dsa_warmup"]', "--training.steps", "2",
            "--training.seq_len", "64", "--training.sample_tokens", "0",
            "--training.val_sequences", "8", "--metrics.tensorboard", "false",
            "--checkpoint.export_hf", "true", "--output.dir", str(tmp_path / "run")]  # fmt: skip
    _, job = resolve_job(args)
    assert Trainer(job).train().steps == 2
    original, exported = dict(iter_tensors(path)), dict(iter_tensors(tmp_path / "run" / "hf"))
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor) == (".indexer." not in name), name
