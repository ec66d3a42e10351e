"""Run under torchrun (gloo): mixture-of-experts layers under parallel layouts against one
process.

    torchrun --standalone --nproc-per-node 2 tests/parallel/moe_worker.py dispatch fsdp_ep ...

``dispatch``: one MoE layer with its experts split over ep ranks by ``AllToAllDispatch`` gives
the outputs and gradients of the whole layer run by ``LocalDispatch`` on one rank over every
rank's tokens (``DISPATCH`` line).

The other names are layouts: qwen3_moe debug (2 MoE layers of 8 experts, top-2, its
micro-batch balance loss, the expert bias moved after every step) and a variant (per-sequence
balance loss, a shared expert) train 3 AdamW steps through the trainer's own step
(train/step.py, expert balancing included) on packed rows. The balance loss is a function of a
micro-batch, so the reference, on one process, accumulates over the same micro-batches the data
ranks hold. Rank 0 prints one ``RESULT`` line per (layout, family): the largest differences in
loss, gradient norm, expert loads, the final weights and expert biases (gathered as the export
does).
"""

from __future__ import annotations

import copy
import json
import sys
import time

import torch
import torch.distributed as dist
from pipeline_worker import rows_of
from worker import ADAM_EPS, BATCH, MAX_NORM, SEQ_LEN, make_batches

from torchloom.models import ModelConfig, build_model, resolve_model_config
from torchloom.models.components.decoder_plan import decoder_tp_plan
from torchloom.models.components.moe import MoE, MoEConfig
from torchloom.parallel import (
    ParallelConfig,
    ParallelDims,
    build_parallel_dims,
    destroy,
    init_distributed,
    leave,
    parallelize,
)
from torchloom.parallel.context_parallel import shard_sequence
from torchloom.parallel.expert_parallel import apply_expert_parallel
from torchloom.parallel.pipeline import build_pipeline
from torchloom.parallel.state import full_state_items
from torchloom.train.expert_balance import expert_balance
from torchloom.train.loss import CrossEntropy
from torchloom.train.step import StepParts, TrainStep

LAYOUTS: dict[str, dict] = {
    "fsdp_ep": {"dp_shard": 2, "ep": 2},
    "cp_ep": {"cp": 2, "dp_shard": 1, "ep": 2},  # ep borrowed from cp
    "tp": {"tp": 2, "dp_shard": 1},  # MoE weights FSDP over tp alone
    "fsdp_tp_ep": {"dp_shard": 2, "tp": 2, "ep": 2},
    "hsdp_ep": {"dp_replicate": 2, "dp_shard": 2, "ep": 2},
    "fsdp4_ep2": {"dp_shard": 4, "ep": 2},  # experts also FSDP-sharded (efsdp 2)
    "pp_fsdp_ep": {"pp": 2, "dp_shard": 2, "ep": 2},
    "pp": {"pp": 2, "dp_shard": 1},
}
FAMILIES: dict[str, dict] = {
    "batch": {"moe.expert_bias": True, "moe.bias_update_rate": 0.01},
    "sequence": {
        "moe.expert_bias": True,
        "moe.bias_update_rate": 0.01,
        "moe.balance_loss": "sequence",
        "moe.num_shared_experts": 1,
    },
}
# One expert per ep rank, two ranks sharing it: FSDP shards the experts along their width.
OVERRIDES = {"fsdp4_ep2": {"moe.num_experts": 2, "moe.top_k": 1}}
CPU = torch.device("cpu")


def build(overrides: dict) -> torch.nn.Module:
    with torch.device("meta"):
        model = build_model(
            resolve_model_config(ModelConfig(name="qwen3_moe", flavor="debug", overrides=overrides))
        )
    return model


def train(parts: StepParts, micro_batches: list[list]) -> list[dict]:
    step = TrainStep(parts, before_update=lambda: None)
    records = []
    for batches in micro_batches:
        loss, norm, metrics = step(batches)
        loads = {k: v.item() for k, v in metrics.items() if k.startswith("expert_load")}
        records.append({"loss": loss.item(), "norm": norm.item(), "loads": loads})
    return records


def reference_run(model: torch.nn.Module, batches: list[dict], pieces: int) -> tuple:
    """One process, the global batch as the ``pieces`` micro-batches the layout's forwards see
    (a pipeline cuts each data rank's rows into microbatches)."""
    model.to_empty(device=CPU)
    model.init_weights(0)
    dims = ParallelDims(ParallelConfig().resolve(1), 1, 0, "cpu")
    share = BATCH // pieces
    micro = [[rows_of(b, slice(r * share, (r + 1) * share)) for r in range(pieces)]
             for b in batches]  # fmt: skip
    parts = _parts(model, None, dims)
    return train(parts, micro), {n: t.clone() for n, t in model.state_dict().items()}


def parallel_run(model: torch.nn.Module, layout: dict, batches: list[dict]) -> tuple:
    dims = build_parallel_dims(ParallelConfig(**layout), "cpu")
    pipeline = None
    if dims.degrees.pp > 1:
        pipeline = build_pipeline(model, dims, seq_len=SEQ_LEN, tp_plan=decoder_tp_plan,
                                  device=CPU, objective=CrossEntropy())  # fmt: skip
        for stage in pipeline.stages:
            stage.to_empty(device=CPU)
            stage.init_weights(0)
        held = pipeline.stages
    else:
        parallelize(model, dims, seq_len=SEQ_LEN)
        model.to_empty(device=CPU)
        model.init_weights(0)
        held = model
    share = BATCH // dims.dp_size
    rows = slice(dims.dp_rank * share, (dims.dp_rank + 1) * share)
    cp_rank, cp = dims.local_rank("cp"), dims.size("cp")
    micro = []
    for batch in batches:
        local = rows_of(batch, rows)
        if cp > 1:
            local = local.map_tokens(lambda t: shard_sequence(t, cp_rank, cp))
        micro.append([local])
    records = train(_parts(held, pipeline, dims), micro)
    state = dict(pipeline.full_state_items() if pipeline else full_state_items(held))
    return records, state


def _parts(model, pipeline, dims: ParallelDims) -> StepParts:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=ADAM_EPS)
    config = (pipeline.stages[0] if pipeline else model).config
    return StepParts(model, pipeline, CrossEntropy(), optimizer, dims, CPU, MAX_NORM,
                     expert_balance=expert_balance(model, config, dims, CPU))  # fmt: skip


def compare(layout: str, family: str, ref: tuple, run: tuple, seconds: float) -> dict:
    (ref_steps, ref_state), (steps, state) = ref, run
    biases = [n for n in ref_state if n.endswith("expert_bias")]
    return {
        "layout": layout, "family": family, "seconds": round(seconds, 2),
        "loss_diff": max(abs(r["loss"] - p["loss"]) for r, p in zip(ref_steps, steps)),
        "norm_diff": max(abs(r["norm"] - p["norm"]) for r, p in zip(ref_steps, steps)),
        "norms": [p["norm"] for p in steps],
        "losses": [p["loss"] for p in steps],
        "load_diff": max(abs(r["loads"][k] - p["loads"][k])
                         for r, p in zip(ref_steps, steps) for k in r["loads"]),
        "param_diff": max((ref_state[n] - state[n]).abs().max().item() for n in ref_state),
        "bias_equal": all(torch.equal(ref_state[n], state[n]) for n in biases),
        "bias_moved": all(ref_state[n].abs().max().item() > 0 for n in biases) and bool(biases),
        "missing": sorted(set(ref_state) ^ set(state)),
    }  # fmt: skip


def dispatch_report() -> dict:
    """AllToAllDispatch over every rank against LocalDispatch on all the tokens."""
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = MoEConfig(num_experts=4 * world, top_k=3, expert_dim=16, balance_loss="none")
    torch.manual_seed(0)
    reference = MoE(32, cfg)
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.3)
    layer = copy.deepcopy(reference)
    # Ranks hold different numbers of tokens.
    tokens = [torch.randn(2, 5 + r, 32, generator=torch.Generator().manual_seed(r))
              for r in range(world)]  # fmt: skip
    probes = [torch.randn_like(t) for t in tokens]
    x_all = torch.cat([t.flatten(0, 1) for t in tokens])[None].requires_grad_()
    (reference(x_all) * torch.cat([p.flatten(0, 1) for p in probes])[None]).sum().backward()
    ep_mesh = build_parallel_dims(ParallelConfig(dp_shard=world, ep=world), "cpu").moe_meshes().ep
    apply_expert_parallel(layer, ep_mesh)
    x = tokens[rank].clone().requires_grad_()
    out = layer(x)
    (out * probes[rank]).sum().backward()
    start = sum(t.shape[0] * t.shape[1] for t in tokens[:rank])  # rows before mine in x_all
    mine = slice(start, start + x.shape[0] * x.shape[1])
    with torch.no_grad():
        ref_out = reference(x_all)[0, mine].view_as(out)
    router_grad = layer.router.weight.grad.clone()
    dist.all_reduce(router_grad)  # each rank's grad covers its own tokens
    per_rank = cfg.num_experts // world
    own = slice(rank * per_rank, (rank + 1) * per_rank)
    diffs = {
        "output": (out - ref_out).abs().max().item(),
        "input_grad": (x.grad - x_all.grad[0, mine].view_as(x)).abs().max().item(),
        "router_grad": (router_grad - reference.router.weight.grad).abs().max().item(),
        "expert_grad": max(
            (getattr(layer.experts, n).grad.to_local() - getattr(reference.experts, n).grad[own])
            .abs().max().item()
            for n in ("gate_proj", "up_proj", "down_proj")
        ),
    }  # fmt: skip
    everyone: list = [None] * world
    dist.all_gather_object(everyone, diffs)
    return {name: max(d[name] for d in everyone) for name in diffs}


def main(names: list[str]) -> None:
    init_distributed("cpu")
    rank0 = dist.get_rank() == 0
    references: dict[tuple, tuple] = {}
    for name in names:
        if name == "dispatch":
            report = dispatch_report()
            if rank0:
                print("DISPATCH " + json.dumps(report), flush=True)
            continue
        for family, overrides in FAMILIES.items():
            start = time.perf_counter()
            overrides = {**overrides, **OVERRIDES.get(name, {})}
            layout = LAYOUTS[name]
            # Each data rank's rows, cut into the pipeline's microbatches (2 stages: 2).
            pieces = layout.get("dp_replicate", 1) * layout.get("dp_shard", 1)
            pieces *= 2 if layout.get("pp", 1) > 1 else 1
            key = (json.dumps(overrides, sort_keys=True), pieces)
            batches = make_batches(4096)
            if key not in references:
                references[key] = reference_run(build(overrides), batches, pieces)
            run = parallel_run(build(overrides), layout, batches)
            if rank0:
                result = compare(name, family, references[key], run, time.perf_counter() - start)
                print("RESULT " + json.dumps(result), flush=True)
    destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
    leave(0)  # skips the interpreter teardown, where gloo can abort a finished rank
