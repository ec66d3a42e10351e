"""Run under torchrun (gloo): context-parallel layouts against a single-process reference.

    torchrun --standalone --nproc-per-node 2 tests/parallel/cp_worker.py cp

Like worker.py (whose batches, models and comparison it reuses), plus a forward check: the cp
ranks' logits, put back in sequence order, must equal the single-process logits. Every data
rank takes its rows of the global batch, and every cp rank its tokens of those rows.
Rank 0 prints one ``RESULT {json}`` line per (layout, family).
"""

from __future__ import annotations

import copy
import json
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from worker import (
    ADAM_EPS,
    BATCH,
    FAMILIES,
    MAX_NORM,
    SEQ_LEN,
    build,
    compare,
    full_params,
    make_batches,
    reference_run,
)

from torchloom.data.packing import Batch
from torchloom.kernels.attention_mask import AttentionMask
from torchloom.models import ModelConfig, build_model, resolve_model_config
from torchloom.parallel import (
    ParallelConfig,
    ParallelDims,
    as_local,
    build_parallel_dims,
    clip_grad_norm_,
    destroy,
    global_label_count,
    init_distributed,
    leave,
    loss_context,
    parallelize,
    sum_over_data_ranks,
)
from torchloom.parallel.context_parallel import (
    shard_sequence,
    unshard_sequence,
)
from torchloom.train.loss import cross_entropy_sum

LAYOUTS: dict[str, dict] = {
    "cp": {"cp": 2, "dp_shard": 1},
    "cp_fsdp": {"cp": 2, "dp_shard": 2},
    "cp_tp": {"cp": 2, "tp": 2, "dp_shard": 1, "loss_parallel": False},
    "cp_replicate": {"cp": 2, "dp_replicate": 2, "dp_shard": 1},
    "cp_masks": {"cp": 2, "dp_shard": 1},  # MASKED only: the gathered keys keep each layer's mask
}
MASKED = "qwen3 window+chunk"


def build_masked() -> nn.Module:
    """qwen3 debug with a sliding layer (window 5) and a chunked one (chunk 8): both cross the
    cp shards' boundaries (rows of 16 tokens in four 4-token chunks)."""
    debug = resolve_model_config(ModelConfig(name="qwen3", flavor="debug"))
    model = build_model(
        replace(debug, layer_types=("sliding_attention", "full_attention"), sliding_window=5)
    )
    model.layers["1"].attention.mask = AttentionMask(chunk=8)
    model.init_weights(0)
    return model


def local_batch(batch: dict, dims: ParallelDims) -> Batch:
    """This rank's rows (data rank) and tokens (cp rank) of a global batch."""
    share = BATCH // dims.dp_size
    rows = slice(dims.dp_rank * share, (dims.dp_rank + 1) * share)
    full = Batch(*(batch[k][rows] for k in ("tokens", "labels", "positions", "doc_ids")))
    rank, size = dims.local_rank("cp"), dims.size("cp")
    return full.map_tokens(lambda t: shard_sequence(t, rank, size))


@torch.no_grad()
def logits_diff(model: nn.Module, reference: nn.Module, batch: dict, dims: ParallelDims) -> float:
    """Largest |logit difference| of the parallel model (reassembled) vs the reference."""
    local = local_batch(batch, dims)
    logits = as_local(model(local.tokens, local.positions, local.doc_ids))
    mine = (dims.dp_rank, dims.local_rank("cp"), logits)
    everyone: list = [None] * dims.world_size
    dist.all_gather_object(everyone, mine)
    rows = []
    for dp_rank in range(dims.dp_size):
        shards = {cp: t for d, cp, t in everyone if d == dp_rank}  # tp ranks repeat a shard
        rows.append(unshard_sequence([shards[cp] for cp in range(dims.size("cp"))]))
    # FSDP keeps the root's and the last block's parameters gathered after a forward without
    # backward, and the next training forward would then read them stale after the optimizer
    # step: free them.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    expected = reference(batch["tokens"], batch["positions"], batch["doc_ids"])
    return (torch.cat(rows) - expected).abs().max().item()


def parallel_run(model: nn.Module, dims: ParallelDims, batches: list) -> list[dict]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=ADAM_EPS)
    steps = []
    for batch in batches:
        local = local_batch(batch, dims)
        count = global_label_count(local.num_label_tokens, dims)
        logits = model(local.tokens, local.positions, local.doc_ids)
        with loss_context(dims):
            loss = cross_entropy_sum(logits, local.labels) / count
            loss.backward()
        norm = clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = sum_over_data_ranks(loss, dims).item()
        steps.append({"loss": loss_value, "norm": norm.item(), "params": full_params(model)})
    return steps


def main(names: list[str]) -> None:
    init_distributed("cpu")
    torch.manual_seed(0)
    rank0 = dist.get_rank() == 0
    references: dict[str, list] = {}
    for name in names:
        for family in (MASKED,) if name == "cp_masks" else FAMILIES:
            start = time.perf_counter()
            model = build_masked() if family == MASKED else build(family)
            untouched = copy.deepcopy(model)
            batches = make_batches(model.config.vocab_size)
            if family not in references:
                references[family] = reference_run(copy.deepcopy(model), batches)
            dims = build_parallel_dims(ParallelConfig(**LAYOUTS[name]), "cpu")
            parallelize(model, dims, seq_len=SEQ_LEN)
            logits = logits_diff(model, untouched, batches[0], dims)
            runs = parallel_run(model, dims, batches)
            result = compare(name, family, references[family], runs, time.perf_counter() - start)
            result["logits_diff"] = logits
            if rank0:
                print("RESULT " + json.dumps(result), flush=True)
    destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
    leave(0)  # skips the interpreter teardown, where gloo can abort a finished rank
