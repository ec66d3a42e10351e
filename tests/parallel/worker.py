"""Run under torchrun (gloo): compare parallel layouts with a single-process reference.

    torchrun --standalone --nproc-per-node 2 tests/parallel/worker.py fsdp tp ...

For every layout named on the command line and every model family, each rank builds the same
model from the same seed, applies the layout with ``torchloom.parallel.parallelize``, and runs
a few AdamW steps with global-norm clipping on fixed packed batches: each data-parallel rank
takes its share of one global batch, and the loss is divided by the global label-token count.
The same steps run on an unparallelized copy over the whole batch. Rank 0 prints one
``RESULT {json}`` line per (layout, family) with the largest differences in loss, gradient norm
and parameters, ``MESH {json}`` lines for the ``mesh`` pseudo-layout, and ``INIT {json}`` lines
for ``init`` (weights initialized shard by shard vs one process).
"""

from __future__ import annotations

import copy
import json
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchloom.models import ModelConfig, build_model, resolve_model_config
from torchloom.models.components.decoder_plan import decoder_tp_plan
from torchloom.parallel import (
    ParallelConfig,
    as_local,
    build_parallel_dims,
    destroy,
    global_label_count,
    init_distributed,
    leave,
    loss_context,
    parallelize,
    sum_over_data_ranks,
)
from torchloom.parallel.mesh import FLATTENED, MESH_AXES
from torchloom.parallel.pipeline import build_pipeline
from torchloom.parallel.state import full_state_items
from torchloom.train.loss import IGNORE_INDEX, CrossEntropy, cross_entropy_sum
from torchloom.train.optim import TritonAdamW, clip_gradients

LAYOUTS: dict[str, dict] = {
    "fsdp": {"dp_shard": 2},
    "replicate": {"dp_replicate": 2, "dp_shard": 1},
    "tp": {"tp": 2, "dp_shard": 1, "loss_parallel": False},
    "tp_loss_parallel": {"tp": 2, "dp_shard": 1, "loss_parallel": True},
    "hsdp": {"dp_replicate": 2, "dp_shard": 2},
    "fsdp_tp": {"dp_shard": 2, "tp": 2, "reshard_after_forward": "always"},
    "replicate_tp": {"dp_replicate": 2, "dp_shard": 1, "tp": 2},
    # The Triton AdamW on DTensor shards (the kernels run in Triton's interpreter: the launch
    # sets TRITON_INTERPRET=1), the clip folded into it instead of scaling the gradients.
    "fsdp_tp_triton_adamw": {"dp_shard": 2, "tp": 2, "triton_adamw": True},
}
MESH_LAYOUTS: dict[str, dict] = {
    "hsdp": {"dp_replicate": 2, "dp_shard": 2},
    "fsdp_tp": {"dp_shard": 2, "tp": 2},
    "replicate_cp": {"dp_replicate": 2, "cp": 2, "dp_shard": 1},
    "pp_tp": {"pp": 2, "tp": 2, "dp_shard": 1},
    "replicate_tp": {"dp_replicate": 2, "tp": 2, "dp_shard": 1},
}
# Weights initialized on the meta device, parallelized, then materialized: every layout must
# hold bitwise the single-process weights of the same seed (models/components/param_init.py).
# (layout, model overrides, families); uneven: FSDP shards of 4099 and 191 rows.
INIT_LAYOUTS: dict[int, dict[str, tuple[dict, dict, tuple[str, ...]]]] = {
    2: {
        "fsdp": ({"dp_shard": 2}, {}, ("llama3", "qwen3")),
        "fsdp_uneven": ({"dp_shard": 2}, {"vocab_size": 4099, "ffn_dim": 191}, ("llama3",)),
        "tp": ({"tp": 2, "dp_shard": 1}, {}, ("llama3", "qwen3")),
        "pp": ({"pp": 2, "dp_shard": 1}, {"num_layers": 4}, ("llama3",)),
    },
    4: {
        "fsdp_tp": ({"dp_shard": 2, "tp": 2}, {}, ("llama3", "qwen3")),
        "pp_fsdp": ({"pp": 2, "dp_shard": 2}, {"num_layers": 4}, ("llama3",)),
    },
}
FAMILIES = ("llama3", "qwen3")  # qwen3 debug: tied embeddings and per-head q/k norms
STEPS, BATCH, SEQ_LEN, MAX_NORM = 3, 4, 16, 0.5
# Adam divides by |grad| + eps on the first step, so gradients far below eps-scale rounding
# noise would otherwise move weights by a sizeable fraction of lr in either direction.
ADAM_EPS = 1e-6


def make_batches(vocab_size: int) -> list[dict[str, torch.Tensor]]:
    """Packed rows of two documents each, with some ignored labels (same on every rank)."""
    gen = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(STEPS):
        tokens = torch.randint(0, vocab_size, (BATCH, SEQ_LEN), generator=gen)
        labels = torch.randint(0, vocab_size, (BATCH, SEQ_LEN), generator=gen)
        labels[torch.rand(BATCH, SEQ_LEN, generator=gen) < 0.2] = IGNORE_INDEX
        split = torch.randint(3, SEQ_LEN - 3, (BATCH, 1), generator=gen)
        index = torch.arange(SEQ_LEN).expand(BATCH, SEQ_LEN)
        doc_ids = (index >= split).long()
        positions = torch.where(doc_ids == 0, index, index - split)
        batches.append(
            {"tokens": tokens, "labels": labels, "doc_ids": doc_ids, "positions": positions}
        )
    return batches


def build(family: str) -> nn.Module:
    model = build_model(resolve_model_config(ModelConfig(name=family, flavor="debug")))
    model.init_weights(0)
    return model


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def reference_run(model: nn.Module, batches: list) -> list[dict]:
    """Whole batch on one process: the numbers every layout must reproduce."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=ADAM_EPS)
    steps = []
    for batch in batches:
        logits = model(batch["tokens"], batch["positions"], batch["doc_ids"])
        count = (batch["labels"] != IGNORE_INDEX).sum()
        loss = cross_entropy_sum(logits, batch["labels"]) / count
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps.append({"loss": loss.item(), "norm": norm.item(), "params": full_params(model)})
    return steps


def parallel_run(model: nn.Module, layout: dict, batches: list) -> list[dict]:
    layout = dict(layout)
    triton_adamw = layout.pop("triton_adamw", False)
    dims = build_parallel_dims(ParallelConfig(**layout), "cpu")
    parallelize(model, dims, seq_len=SEQ_LEN)
    adamw = TritonAdamW if triton_adamw else torch.optim.AdamW
    optimizer = adamw(model.parameters(), lr=1e-3, weight_decay=0.1, eps=ADAM_EPS)
    share = BATCH // dims.dp_size
    rows = slice(dims.dp_rank * share, (dims.dp_rank + 1) * share)
    steps = []
    for batch in batches:
        local = {key: value[rows] for key, value in batch.items()}
        count = global_label_count((local["labels"] != IGNORE_INDEX).sum(), dims)
        with loss_context(dims):  # the trainer's path: the objective runs inside the forward
            out = model(local["tokens"], local["positions"], local["doc_ids"],
                        objective=CrossEntropy(), targets={"labels": local["labels"]})  # fmt: skip
            loss = out.loss / count
            loss.backward()
        loss = as_local(loss.detach())
        norm = clip_gradients(optimizer, model.parameters(), MAX_NORM)  # as the Trainer does
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = sum_over_data_ranks(loss, dims).item()
        steps.append({"loss": loss_value, "norm": norm.item(), "params": full_params(model)})
    return steps


def compare(layout_name: str, family: str, reference: list, runs: list, seconds: float) -> dict:
    result = {"layout": layout_name, "family": family, "seconds": round(seconds, 2)}
    result["loss_diff"] = max(abs(r["loss"] - p["loss"]) for r, p in zip(reference, runs))
    result["norm_diff"] = max(abs(r["norm"] - p["norm"]) for r, p in zip(reference, runs))
    result["param_diff"], result["worst_param"] = max(
        ((r["params"][name] - p["params"][name]).abs().max().item(), name)
        for r, p in zip(reference, runs)
        for name in r["params"]
    )
    result["missing"] = sorted(set(reference[0]["params"]) ^ set(runs[0]["params"]))
    result["losses"] = [p["loss"] for p in runs]
    result["norms"] = [p["norm"] for p in runs]
    return result


def init_report(name: str, layout: dict, overrides: dict, family: str) -> dict:
    """The largest difference between the single-process weights of seed 0 and those this
    layout initializes shard by shard (gathered); 0.0 when bitwise equal."""
    config = resolve_model_config(ModelConfig(name=family, flavor="debug", overrides=overrides))
    with torch.device("meta"):
        reference = build_model(config)
    reference.to_empty(device="cpu")
    reference.init_weights(0)
    dims = build_parallel_dims(ParallelConfig(**layout), "cpu")
    with torch.device("meta"):
        model = build_model(config)
    if dims.degrees.pp > 1:
        pipe = build_pipeline(model, dims, seq_len=SEQ_LEN, tp_plan=decoder_tp_plan,
                              device=torch.device("cpu"), objective=CrossEntropy())  # fmt: skip
        for stage in pipe.stages:
            stage.to_empty(device="cpu")
            stage.init_weights(0)
        items = dict(pipe.full_state_items())
    else:
        parallelize(model, dims, seq_len=SEQ_LEN)
        model.to_empty(device="cpu")
        model.init_weights(0)
        items = dict(full_state_items(model))
    expected = reference.state_dict()
    diffs = [(expected[n] - items[n]).abs().max().item() for n in expected if n in items]
    return {"layout": name, "family": family, "missing": sorted(set(expected) ^ set(items)),
            "max_diff": max(diffs), "equal": all(torch.equal(expected[n], items[n])
                                                 for n in expected if n in items)}  # fmt: skip


def mesh_report(name: str, layout: dict) -> dict:
    """Every rank's group members for each axis and flattened name (gathered on every rank)."""
    dims = build_parallel_dims(ParallelConfig(**layout), "cpu")
    mine = {}
    for key in (*MESH_AXES, *FLATTENED):
        mesh = dims.mesh(key)
        mine[key] = None if mesh is None else mesh.mesh.flatten().tolist()
    fsdp = dims.fsdp_mesh
    mine["fsdp"] = None if fsdp is None else fsdp.mesh.tolist()
    mine["dp_rank"], mine["dp_size"] = dims.dp_rank, dims.dp_size
    everyone: list = [None] * dims.world_size
    dist.all_gather_object(everyone, mine)
    return {"layout": name, "ranks": everyone}


def main(names: list[str]) -> None:
    init_distributed("cpu")
    torch.manual_seed(0)
    rank0 = dist.get_rank() == 0
    references: dict[str, list] = {}
    for name in names:
        if name == "init":
            for init_name, (layout, overrides, families) in INIT_LAYOUTS[
                dist.get_world_size()
            ].items():
                for family in families:
                    report = init_report(init_name, layout, overrides, family)
                    if rank0:
                        print("INIT " + json.dumps(report), flush=True)
            continue
        if name == "mesh":
            for mesh_name, layout in MESH_LAYOUTS.items():
                report = mesh_report(mesh_name, layout)
                if rank0:
                    print("MESH " + json.dumps(report), flush=True)
            continue
        for family in FAMILIES:
            start = time.perf_counter()
            model = build(family)
            batches = make_batches(model.config.vocab_size)
            if family not in references:
                references[family] = reference_run(copy.deepcopy(model), batches)
            runs = parallel_run(model, LAYOUTS[name], batches)
            result = compare(name, family, references[family], runs, time.perf_counter() - start)
            if rank0:
                print("RESULT " + json.dumps(result), flush=True)
    destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
    leave(0)  # skips the interpreter teardown, where gloo can abort a finished rank
