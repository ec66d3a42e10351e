"""Run under torchrun (gloo, 2 ranks): token mixers split over tp ranks by heads against one
process: multi-head latent attention (heads column-wise, the low-rank projections replicated)
on all-dense deepseek_v3 models with a low-rank and a full-rank query, and the hybrid
linear-attention families' debug flavors (Gated DeltaNet in Qwen3-Next's fused and Qwen3.5's
separate layout, KDA with MLA in Kimi Linear; convolutions and gate constants split by heads,
output norms replicated). Rank 0 prints ``RESULT {json}`` per (layout, model) as
tests/parallel/worker.py does, and ``INIT {json}`` for weights initialized shard by shard
(those models under tp, deepseek_v3's debug flavor with its MoE layers and MTP depth under
FSDP)."""

from __future__ import annotations

import copy
import json
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist
from worker import ADAM_EPS, MAX_NORM, SEQ_LEN, compare, full_params, make_batches, reference_run

from torchloom.models import build_model, get_model_spec
from torchloom.models.deepseek_v3 import DEEPSEEK_V3_FLAVORS
from torchloom.models.kimi_linear import KIMI_LINEAR_FLAVORS
from torchloom.models.qwen3_5 import QWEN3_5_FLAVORS
from torchloom.models.qwen3_next import QWEN3_NEXT_FLAVORS
from torchloom.parallel import (
    ParallelConfig,
    build_parallel_dims,
    destroy,
    global_label_count,
    init_distributed,
    leave,
    loss_context,
    parallelize,
)
from torchloom.parallel.state import full_state_items
from torchloom.train.loss import IGNORE_INDEX, cross_entropy_sum
from torchloom.train.optim import clip_gradients

DENSE = replace(DEEPSEEK_V3_FLAVORS["debug"], first_dense_layers=3, mtp_layers=0)
# name -> (family, config)
MODELS = {
    "mla_q_lora": ("deepseek_v3", DENSE),
    "mla_q_proj": ("deepseek_v3", replace(DENSE, q_lora_rank=None)),
    "qwen3_next": ("qwen3_next", QWEN3_NEXT_FLAVORS["debug"]),
    "qwen3_5": ("qwen3_5", QWEN3_5_FLAVORS["debug"]),
    "kimi_linear": ("kimi_linear", KIMI_LINEAR_FLAVORS["debug"]),
}
# Init only: deepseek_v3's debug flavor itself (MoE layers, MTP depth) sharded by FSDP.
INIT_MODELS = MODELS | {"debug": ("deepseek_v3", DEEPSEEK_V3_FLAVORS["debug"])}
LAYOUTS = {
    "tp": {"tp": 2, "dp_shard": 1, "loss_parallel": False},
    "tp_loss_parallel": {"tp": 2, "dp_shard": 1, "loss_parallel": True},
}


def tensor_parallel_run(
    model: torch.nn.Module, family: str, layout: dict, batches: list
) -> list[dict]:
    dims = build_parallel_dims(ParallelConfig(**layout), "cpu")
    parallelize(model, dims, seq_len=SEQ_LEN, tp_plan=get_model_spec(family).tp_plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=ADAM_EPS)
    steps = []
    for batch in batches:
        count = global_label_count((batch["labels"] != IGNORE_INDEX).sum(), dims)
        logits = model(batch["tokens"], batch["positions"], batch["doc_ids"])
        with loss_context(dims):
            loss = cross_entropy_sum(logits, batch["labels"]) / count
            loss.backward()
        norm = clip_gradients(optimizer, model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        steps.append({"loss": value.item(), "norm": norm.item(), "params": full_params(model)})
    return steps


def init_report(name: str, layout: dict) -> dict:
    family, config = INIT_MODELS[name]
    reference = build_model(config)
    reference.init_weights(0)
    dims = build_parallel_dims(ParallelConfig(**layout), "cpu")
    with torch.device("meta"):
        model = build_model(config)
    parallelize(model, dims, seq_len=SEQ_LEN, tp_plan=get_model_spec(family).tp_plan)
    model.to_empty(device="cpu")
    model.init_weights(0)
    items = dict(full_state_items(model))
    expected = reference.state_dict()
    return {"model": name, "layout": layout, "missing": sorted(set(expected) ^ set(items)),
            "equal": all(torch.equal(expected[n], items[n]) for n in expected if n in items)}  # fmt: skip


def main(names: list[str]) -> None:
    init_distributed("cpu")
    torch.manual_seed(0)
    rank0 = dist.get_rank() == 0
    if "init" in names:
        inits = [(name, LAYOUTS["tp"]) for name in MODELS] + [("debug", {"dp_shard": 2})]
        for model_name, layout in inits:
            report = init_report(model_name, layout)
            if rank0:
                print("INIT " + json.dumps(report), flush=True)
    for model_name, (family, config) in MODELS.items():
        model = build_model(config)
        model.init_weights(0)
        batches = make_batches(config.vocab_size)
        reference = reference_run(copy.deepcopy(model), batches)
        for layout in (n for n in names if n in LAYOUTS):
            start = time.perf_counter()
            runs = tensor_parallel_run(copy.deepcopy(model), family, LAYOUTS[layout], batches)
            result = compare(layout, model_name, reference, runs, time.perf_counter() - start)
            if rank0:
                print("RESULT " + json.dumps(result), flush=True)
    destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
    leave(0)  # skips the interpreter teardown, where gloo can abort a finished rank
