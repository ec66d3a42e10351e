"""deepseek_v4's multi-token prediction: the reported loss against the depths run by hand from
their modules, a zero loss weight against no MTP at all (bitwise gradients), the checkpoints'
``mtp.{k}.`` tensors through export, load and convert (bitwise), which forwards run the depths,
the layouts that refuse them, and the parts of the trainer that must not mistake them for the
decoder's layers (expert balancing, FLOPs, the dry run's estimate)."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

import torchloom
from tests.models.test_deepseek_v3 import packed_batch as packed_mtp_batch
from torchloom.checkpoint.hf import save_hf
from torchloom.cli import resolve_job
from torchloom.config.errors import ConfigError
from torchloom.models import build_model
from torchloom.models.config import ModelConfig
from torchloom.models.deepseek_v4 import DEEPSEEK_V4_FLAVORS, DeepSeekV4, DeepSeekV4HFAdapter
from torchloom.models.deepseek_v4.parallelize import tp_plan
from torchloom.train.builders import check_layout
from torchloom.train.expert_balance import ExpertBalance
from torchloom.train.loss import IGNORE_INDEX, CrossEntropy

DEBUG = DEEPSEEK_V4_FLAVORS["debug"]  # sliding, CSA (groups of 4), HCA (groups of 16); no MTP
DOCS = [23, 9, 32]  # three documents packed into rows of 64: groups and windows inside each


def mtp_model(**changes) -> DeepSeekV4:
    """The debug flavor with one MTP depth (or ``changes``), its weights moved off their init so
    that every one of them (norms, biases, sinks, mixings) matters."""
    model = build_model(replace(DEBUG, **({"mtp_layers": 1} | changes)))
    model.init_weights(0)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return model.train()


def packed_batch() -> tuple[torch.Tensor, ...]:
    """(tokens, positions, doc_ids, labels) of two rows of DOCS, some labels ignored."""
    return packed_mtp_batch(DEBUG.vocab_size, DOCS, ignored=((0, 5), (1, 40)))


def ahead_in_document(x: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """x[i + k] at position i of each document of DOCS (``fill`` past its end), row by row."""
    rows = []
    for row in x:
        parts = [torch.cat([doc[k:], doc.new_full((min(k, len(doc)),), fill)])
                 for doc in row.split(DOCS)]  # fmt: skip
        rows.append(torch.cat(parts))
    return torch.stack(rows)


def mtp_loss_by_hand(model: DeepSeekV4, tokens, positions, doc_ids, labels) -> torch.Tensor:
    """lambda / D * sum_k mean CE, every depth run from its modules as DeepSeek's MTPBlock does:
    e_proj(enorm(embedding of the tokens k ahead)) added to h_proj(hnorm(stream)) on every
    stream, the block, the depth's hc_head and norm, the model's head."""
    cfg = model.config
    h = model.embed_tokens(tokens)
    streams = h[:, :, None].expand(-1, -1, cfg.hc_streams, -1).contiguous()
    for block in model.layers.values():
        streams = block(streams, tokens, positions, doc_ids)
    total = torch.zeros(())
    for k, depth in enumerate(model.mtp.layers.values(), start=1):
        ahead = ahead_in_document(tokens, k, 0)
        e = depth.e_proj(depth.enorm(model.embed_tokens(ahead)))
        streams = depth.h_proj(depth.hnorm(streams)) + e[:, :, None]
        streams = depth.block(streams, ahead, positions, doc_ids)
        logits = model.output(depth.norm(depth.hc_head(streams)))
        targets = ahead_in_document(labels, k, IGNORE_INDEX)
        ce = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                             ignore_index=IGNORE_INDEX, reduction="sum")  # fmt: skip
        total = total + ce / (targets != IGNORE_INDEX).sum()
    return total * (cfg.mtp_loss_weight / cfg.mtp_layers)


@pytest.mark.parametrize("depths", [1, 2])
def test_mtp_loss_equals_the_depths_run_by_hand(depths: int) -> None:
    """Packed documents, some labels ignored: the loss the MTP module hands the objective is
    bitwise the one computed from the depths' submodules, and aux_mtp is it times the label
    count (with_auxiliary's weight)."""
    model = mtp_model(mtp_layers=depths, mtp_loss_weight=0.2)
    tokens, positions, doc_ids, labels = packed_batch()
    reported = []
    model.mtp.register_forward_hook(lambda _m, _a, loss: reported.append(loss.detach()))
    out = model(tokens, positions, doc_ids, objective=CrossEntropy(), targets={"labels": labels})
    with torch.no_grad():
        by_hand = mtp_loss_by_hand(model, tokens, positions, doc_ids, labels)
    print(f"D={depths}: MTP loss {reported[0].item():.8f}, by hand {by_hand.item():.8f}")
    assert torch.equal(reported[0], by_hand), (reported[0] - by_hand).item()
    count = (labels != IGNORE_INDEX).sum()
    torch.testing.assert_close(out.metrics["aux_mtp"], by_hand * count, rtol=1e-6, atol=0)
    out.loss.backward()
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in model.mtp.parameters())


def test_zero_loss_weight_leaves_the_main_gradients_bitwise() -> None:
    """mtp_loss_weight 0: the loss and every main parameter's gradient are bitwise those of the
    same weights without MTP (the depths run, but send back exact zeros)."""
    with_mtp = mtp_model(mtp_loss_weight=0.0)
    without = build_model(DEBUG).train()
    main = {n: p for n, p in with_mtp.state_dict().items() if not n.startswith("mtp.")}
    without.load_state_dict(main)
    tokens, positions, doc_ids, labels = packed_batch()
    results = []
    for model in (with_mtp, without):
        out = model(tokens, positions, doc_ids, objective=CrossEntropy(),
                    targets={"labels": labels})  # fmt: skip
        out.loss.backward()
        results.append((out, dict(model.named_parameters())))
    (out, params), (ref_out, ref_params) = results
    assert out.metrics["aux_mtp"].item() == 0.0 and "aux_mtp" not in ref_out.metrics
    assert torch.equal(out.loss, ref_out.loss), (out.loss - ref_out.loss).item()
    differ = []
    for name, param in ref_params.items():  # the indexers' have none in both: no indexer loss
        grad, ref_grad = params[name].grad, param.grad
        if (grad is None) != (ref_grad is None) or (ref_grad is not None and not torch.equal(grad, ref_grad)):  # fmt: skip
            differ.append(name)
    compared = sum(p.grad is not None for p in ref_params.values())
    print(f"{compared} main gradients compared, {len(differ)} differ: {differ[:5]}")
    assert compared > 0 and not differ


def test_mtp_runs_only_in_training_forwards_with_labels() -> None:
    """Plain logits, evaluation with an objective and generation with a cache never run the
    depths; a training forward with labels runs them once and hands the loss over once."""
    model = mtp_model()
    tokens, positions, _, labels = packed_batch()
    targets = {"labels": labels}
    calls = []
    model.mtp.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        assert model(tokens).shape == (2, sum(DOCS), DEBUG.vocab_size)  # train mode, no objective
        cache = model.new_cache(2, 80, torch.device("cpu"), torch.float32)
        bound = cache.bind(torch.arange(2), positions[:, :20])
        prefill = model(tokens[:, :20], positions[:, :20], cache=bound, objective=CrossEntropy(),
                        targets={"labels": labels[:, :20]})  # fmt: skip
        assert "aux_mtp" not in prefill.metrics  # train mode and labels, but a generation cache
        model.eval()
        assert "aux_mtp" not in model(tokens, objective=CrossEntropy(), targets=targets).metrics
    assert not calls
    model.train()
    assert "aux_mtp" in model(tokens, objective=CrossEntropy(), targets=targets).metrics
    assert calls == [1] and model.auxiliary_losses() == {}  # handed over once


def mtp_names(depth: int, layer0: set[str]) -> set[str]:
    """What MTP depth ``depth`` writes: its own tensors, and layer 0's (sliding, hash-routed)
    under mtp.{depth}. with top-k routing (the choice bias instead of the hash table)."""
    own = {"enorm.weight", "e_proj.weight", "hnorm.weight", "h_proj.weight", "norm.weight",
           "hc_head_fn", "hc_head_base", "hc_head_scale"}  # fmt: skip
    block = {n.removeprefix("model.layers.0.") for n in layer0} - {"ffn.gate.tid2eid"}
    return {f"mtp.{depth}.{n}" for n in own | block | {"ffn.gate.bias"}}


def test_export_writes_deepseek_mtp_names_and_loads_back_bitwise(
    tmp_path, logits_parity, convert_round_trip
) -> None:
    """Two depths exported under DeepSeek's mtp.{k}. names (a layer's names for the block);
    from_hf and `torchloom convert` both ways give every tensor back bitwise; transformers
    loads the folder (skipping mtp.*) with the same logits."""
    model = mtp_model(mtp_layers=2, index_heads=8).eval()  # 8: tied index scores stay rare
    save_hf(tmp_path / "out", "deepseek_v4", model.config, model.state_dict().items())
    hf_config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf_config["num_nextn_predict_layers"] == 2
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    layer0 = {n for n in tensors if n.startswith("model.layers.0.")}
    for depth in (0, 1):
        written = {n for n in tensors if n.startswith(f"mtp.{depth}.")}
        assert written == mtp_names(depth, layer0), written ^ mtp_names(depth, layer0)
    assert not any(n.startswith("mtp.2.") for n in tensors)
    back = torchloom.from_hf(tmp_path / "out")
    assert back.config == replace(model.config, moe=replace(model.config.moe, bias_update_rate=0.0))
    state, back_state = model.state_dict(), back.state_dict()
    assert state.keys() == back_state.keys()
    assert [n for n, t in state.items() if not torch.equal(back_state[n], t)] == []
    original, converted = convert_round_trip(tmp_path / "out")
    assert converted.keys() == original.keys()
    assert [n for n, t in original.items() if not torch.equal(converted[n], t)] == []
    reference = transformers.DeepseekV4ForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    ).eval()
    window = packed_batch()[0][:, :40]
    with torch.no_grad():
        logits_parity("deepseek_v4 export with MTP", model(window), reference(window).logits)


def test_published_folders_load_their_mtp_depth(tmp_path) -> None:
    """DeepSeek's spelling (no "model." prefix, embed / norm / hc_head_* at the top) with an MTP
    depth loads it; a transformers folder announcing one (its default) but holding none loads
    without MTP; one holding another depth than it announces is refused."""
    model = mtp_model().eval()
    save_hf(tmp_path / "out", "deepseek_v4", model.config, model.state_dict().items())
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    top = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
           "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
           "model.hc_head.hc_scale": "hc_head_scale"}  # fmt: skip
    published = {top.get(n, n.removeprefix("model.")): t for n, t in tensors.items()}
    (tmp_path / "out" / "model.safetensors").unlink()
    save_file(published, tmp_path / "out" / "model.safetensors")
    back = torchloom.from_hf(tmp_path / "out")
    assert back.config.mtp_layers == 1
    for name, tensor in model.mtp.state_dict().items():
        assert torch.equal(back.mtp.state_dict()[name], tensor), name
    without = {n: t for n, t in published.items() if not n.startswith("mtp.")}
    save_file(without, tmp_path / "out" / "model.safetensors")
    assert torchloom.from_hf(tmp_path / "out").mtp is None
    other = without | {n.replace("mtp.0.", "mtp.1."): t for n, t in published.items()
                       if n.startswith("mtp.")}  # fmt: skip
    save_file(other, tmp_path / "out" / "model.safetensors")
    with pytest.raises(ConfigError, match="announces 1 MTP layer.* holds MTP layer.* mtp.1"):
        torchloom.from_hf(tmp_path / "out")


def test_published_config_keeps_its_mtp_depth() -> None:
    adapter = DeepSeekV4HFAdapter()
    hf = adapter.config_to_hf(DEEPSEEK_V4_FLAVORS["flash"])
    assert hf["num_nextn_predict_layers"] == 1
    assert adapter.config_from_hf(hf).mtp_layers == 1
    assert adapter.config_from_hf(hf | {"num_nextn_predict_layers": 0}).mtp_layers == 0
    del hf["num_nextn_predict_layers"]  # transformers' default: 1
    assert adapter.config_from_hf(hf).mtp_layers == 1
    with pytest.raises(ConfigError, match="mtp_layers and mtp_loss_weight must be >= 0"):
        replace(DEBUG, mtp_loss_weight=-0.1).validate()


@pytest.mark.parametrize(
    ("axis", "message"),
    [("pp", "--parallel.pp 2 cannot split a DeepSeekV4"),
     ("cp", "--parallel.cp 2 with multi-token prediction is not supported yet")],
)  # fmt: skip
def test_layouts_a_model_with_mtp_refuses(axis: str, message: str) -> None:
    """Pipeline parallelism is refused for the streams, before the MTP depth (mtp_layers 0
    would not help); context parallelism names the MTP depth first, as for deepseek_v3."""
    with torch.device("meta"):
        model = build_model(replace(DEBUG, mtp_layers=1))
    degrees = SimpleNamespace(pp=2 if axis == "pp" else 1, cp=2 if axis == "cp" else 1)
    with pytest.raises(ConfigError, match=message):
        check_layout(model, SimpleNamespace(degrees=degrees))


def test_tensor_parallel_plan_covers_the_depths_when_training() -> None:
    with torch.device("meta"):
        model = build_model(replace(DEBUG, mtp_layers=1))
    plan = tp_plan(model, 2)
    depth = "mtp.layers.0."
    expected = {"enorm", "e_proj", "hnorm", "h_proj", "hc_head", "norm", "block.attention_hc",
                "block.mlp_hc", "block.mlp", "block.attention.q_b_proj"}  # fmt: skip
    assert {depth + part for part in expected} <= set(plan)
    assert not any(path.startswith("mtp.") for path in tp_plan(model, 2, sequence_parallel=False))


def test_expert_balancing_leaves_the_depths_alone() -> None:
    """The depths are keyed 0, 1, ... like the decoder's layers: balancing (which moves the
    routed layers' choice bias) still holds the decoder's layer 0, not MTP depth 0's MoE."""
    with torch.device("meta"):
        model = build_model(replace(DEBUG, hash_layers=0, mtp_layers=1))
    balance = ExpertBalance(model, [0, 1, 2], 8, SimpleNamespace(), torch.device("cpu"))
    assert balance.held == {i: model.layers[str(i)].mlp for i in range(3)}


def test_flops_and_parameters_count_the_depths() -> None:
    """A depth costs its block, its mixings, e_proj once, h_proj once per stream and a pass
    through the head; DeepSeek-V4-Flash's MTP depth adds 6.6B parameters to the published 284B
    (the embedding and head are shared)."""
    cfg = replace(DEBUG, mtp_layers=1)
    with torch.device("meta"):
        depth = build_model(cfg).mtp.layers["0"]
    block = depth.block
    hc = sum(p.numel() for n, p in depth.named_parameters() if n.endswith("fn"))
    per_token = (block.attention.flops_per_token(64) + block.mlp.flops_per_token(64) + 6 * hc
                 + 6 * (1 + cfg.hc_streams) * cfg.dim**2 + 6 * cfg.vocab_size * cfg.dim)  # fmt: skip
    assert cfg.flops_per_token(64) - replace(cfg, mtp_layers=0).flops_per_token(64) == per_token
    flash = DEEPSEEK_V4_FLAVORS["flash"]
    extra = replace(flash, mtp_layers=1).num_params() - replace(flash, mtp_layers=0).num_params()
    print(f"flash MTP depth: {extra / 1e9:.2f}B parameters")
    assert round(extra / 1e8) == 66


@pytest.mark.parametrize("remat", ["none", "full"])
def test_activation_estimate_covers_the_depths(remat: str) -> None:
    """The dry run's shells share the MTP depths (modules beside the blocks): the estimate runs
    them and equals what a real training forward keeps."""
    from tests.train.test_dry_run import estimate_and_real_forward

    _, job = resolve_job(["--recipe", "deepseek_v4_debug", "--remat.mode", remat])
    job.model = ModelConfig(name="deepseek_v4", flavor="debug", overrides={"mtp_layers": 1})
    estimate, real = estimate_and_real_forward(job, micro=2)
    job.model = ModelConfig(name="deepseek_v4", flavor="debug")
    base = estimate_and_real_forward(job, micro=2)[1]
    print(f"remat {remat}: estimate {estimate.bytes}, real {real} bytes ({base} without MTP)")
    assert estimate.bytes == real > base
