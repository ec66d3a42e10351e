"""Run under torchrun (gloo): pipeline layouts against a single-process reference.

    torchrun --standalone --nproc-per-node 2 tests/parallel/pipeline_worker.py gpipe 1f1b ...

Every rank builds llama3 debug with 4 layers from one seed; the reference trains the whole
batch on one process, the layout splits it into stages (and shards it with FSDP / TP). Rank 0
prints one ``RESULT {json}`` line per layout: the largest loss / gradient-norm differences over
3 AdamW steps, the validation-loss difference (forward only) and the final parameter difference
(the tensors are gathered to rank 0 the way the trainer's export does).
"""

from __future__ import annotations

import copy
import json
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from worker import ADAM_EPS, BATCH, MAX_NORM, SEQ_LEN, make_batches, reference_run

from torchloom.data.packing import Batch
from torchloom.models import ModelConfig, build_model, resolve_model_config
from torchloom.models.components.decoder_plan import decoder_tp_plan
from torchloom.parallel import (
    ParallelConfig,
    build_parallel_dims,
    clip_grad_norm_,
    destroy,
    global_label_count,
    init_distributed,
    leave,
    sum_over_data_ranks,
)
from torchloom.parallel.pipeline import build_pipeline
from torchloom.train.loss import IGNORE_INDEX, CrossEntropy, LossOutput, cross_entropy_sum

LAYOUTS: dict[str, dict] = {
    name: {"pp": 2, "dp_shard": 1, "pp_schedule": name}
    for name in ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv")
}
LAYOUTS["gpipe_nomask"] = {"pp": 2, "dp_shard": 1, "pp_schedule": "gpipe"}
LAYOUTS["fsdp_pp"] = {"pp": 2, "dp_shard": 2, "pp_schedule": "1f1b"}
LAYOUTS["tp_pp_zbv"] = {"pp": 2, "tp": 2, "dp_shard": 1, "pp_schedule": "zbv"}
LAYOUTS["tp_pp"] = {"pp": 2, "tp": 2, "dp_shard": 1, "pp_schedule": "interleaved_1f1b"}
# An objective that reads an extra field of the batch (a per-token weight): the last stage
# receives it cut into micro-batches like the labels.
LAYOUTS["1f1b_weighted"] = {"pp": 2, "dp_shard": 1, "pp_schedule": "1f1b"}


class WeightedCrossEntropy(CrossEntropy):
    """Token cross-entropies times a per-token weight from the batch's extras."""

    fields = ("labels", "weight")

    def __call__(self, h_BTD, model, targets) -> LossOutput:
        logits_BTV = model.logits(h_BTD).float()
        token_BT = F.cross_entropy(logits_BTV.transpose(1, 2), targets["labels"],
                                   ignore_index=IGNORE_INDEX, reduction="none")  # fmt: skip
        return LossOutput((token_BT * targets["weight"]).sum())


def weighted(batches: list[dict]) -> list[dict]:
    gen = torch.Generator().manual_seed(5)
    return [{**b, "weight": torch.rand(BATCH, SEQ_LEN, generator=gen)} for b in batches]


def objective_reference(model, batches: list[dict], objective) -> list[dict]:
    """The whole batch on one process through ``objective`` (as the trainer's step does)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=ADAM_EPS)
    steps = []
    for batch in batches:
        b = rows_of(batch, slice(None))
        out = model(b.tokens, b.positions, b.doc_ids, objective=objective,
                    targets=b.fields(objective.fields))  # fmt: skip
        loss = out.loss / b.num_label_tokens
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        steps.append({"loss": loss.item(), "norm": norm.item(), "params": params})
    return steps


def build() -> torch.nn.Module:
    model = build_model(
        resolve_model_config(
            ModelConfig(name="llama3", flavor="debug", overrides={"num_layers": 4})
        )
    )
    model.init_weights(0)
    return model


def rows_of(batch: dict, rows: slice) -> Batch:
    fields = {k: None if v is None else v[rows] for k, v in batch.items()}
    extras = {
        k: v for k, v in fields.items() if k not in ("tokens", "labels", "positions", "doc_ids")
    }
    return Batch(fields["tokens"], fields["labels"], fields["positions"], fields["doc_ids"], extras)


def pipeline_run(
    model, layout: dict, batches: list, objective=None
) -> tuple[list[dict], float, dict]:
    dims = build_parallel_dims(ParallelConfig(**layout), "cpu")
    pipe = build_pipeline(
        model, dims, seq_len=SEQ_LEN, tp_plan=decoder_tp_plan, device=torch.device("cpu"),
        objective=objective or CrossEntropy(),
    )  # fmt: skip
    del model
    optimizer = torch.optim.AdamW(pipe.stages.parameters(), lr=1e-3, weight_decay=0.1, eps=ADAM_EPS)
    share = BATCH // dims.dp_size
    rows = slice(dims.dp_rank * share, (dims.dp_rank + 1) * share)
    steps = []
    for batch in batches:
        local = rows_of(batch, rows)
        count = global_label_count((local.labels != IGNORE_INDEX).sum(), dims)
        loss = pipe.step(local, count)
        norm = clip_grad_norm_(pipe.stages.parameters(), MAX_NORM, pp_mesh=dims.mesh("pp"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = pipe.reduce_over_stages(sum_over_data_ranks(loss, dims))
        steps.append({"loss": loss.item(), "norm": norm.item()})
    local = rows_of(batches[0], rows)
    val = pipe.reduce_over_stages(sum_over_data_ranks(pipe.eval_loss_sum(local), dims))
    params = dict(pipe.full_state_items())
    return steps, val.item(), params


LAYOUTS_WITH_VAL = set(LAYOUTS) - {"gpipe_nomask", "1f1b_weighted"}


def main(names: list[str]) -> None:
    init_distributed("cpu")
    rank0 = dist.get_rank() == 0
    model = build()
    batches = make_batches(model.config.vocab_size)
    reference = reference_run(copy.deepcopy(model), batches)
    nomask = [{**b, "doc_ids": None, "positions": torch.arange(SEQ_LEN).expand(BATCH, -1)}
              for b in batches]  # fmt: skip
    reference_nomask = reference_run(copy.deepcopy(model), nomask)
    trained = build()  # the reference after its 3 steps, for the forward-only loss
    trained.load_state_dict(reference[-1]["params"])
    with torch.no_grad():
        b = batches[0]
        ref_val = cross_entropy_sum(trained(b["tokens"], b["positions"], b["doc_ids"]), b["labels"])
    weighted_batches = weighted(batches)
    for name in names:
        start = time.perf_counter()
        ref, data = (reference_nomask, nomask) if name == "gpipe_nomask" else (reference, batches)
        objective = None
        if name == "1f1b_weighted":
            objective, data = WeightedCrossEntropy(), weighted_batches
            ref = objective_reference(build(), data, objective)
        steps, val, params = pipeline_run(build(), LAYOUTS[name], data, objective)
        if not rank0:
            continue
        final = ref[-1]["params"]
        result = {
            "layout": name,
            "seconds": round(time.perf_counter() - start, 2),
            "loss_diff": max(abs(r["loss"] - p["loss"]) for r, p in zip(ref, steps)),
            "norm_diff": max(abs(r["norm"] - p["norm"]) for r, p in zip(ref, steps)),
            "val_diff": abs(val - ref_val.item()) if name in LAYOUTS_WITH_VAL else 0.0,
            "param_diff": max((final[n] - params[n]).abs().max().item() for n in final),
            "missing": sorted(set(final) ^ set(params)),
            "losses": [p["loss"] for p in steps],
        }
        print("RESULT " + json.dumps(result), flush=True)
    destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
    leave(0)  # skips the interpreter teardown, where gloo can abort a finished rank
