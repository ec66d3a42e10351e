"""Run under torchrun (gloo, 2 CPU processes): ``Generator.update_weights`` on a
tensor-parallel model, given full tensors (each rank copies its box) or DTensors placed like the
parameters (each rank copies its shard), against one process generating with those weights.

    torchrun --standalone --nproc-per-node 2 tests/generate/tp_weights_worker.py

Rank 0 prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from torchloom.generate.engine import Generator, Request, SamplingParams
from torchloom.generate.run import tensor_parallel
from torchloom.models import ModelConfig, build_model, get_model_spec, resolve_model_config
from torchloom.models.components.param_init import local_tensor
from torchloom.parallel import leave
from torchloom.parallel.mesh import destroy, init_distributed

CONFIG = resolve_model_config(ModelConfig(name="llama3", flavor="debug"))
REQUESTS = [Request(p, SamplingParams(max_new_tokens=6, temperature=0.0))
            for p in ([1, 2, 3], [4] * 7, [5])]  # fmt: skip


def single(seed: int) -> torch.nn.Module:
    model = build_model(CONFIG)
    model.init_weights(seed)
    return model


def sharded(seed: int, device: torch.device) -> torch.nn.Module:
    """Built on meta, split, materialized: init is layout-invariant, so it equals single(seed)."""
    with torch.device("meta"):
        model = build_model(CONFIG)
    tensor_parallel(model, get_model_spec("llama3"), 2, device)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


def main() -> None:
    device = init_distributed("cpu")
    model = sharded(0, device)
    generator = Generator(model, max_batch=2, max_len=32)
    generator.generate(REQUESTS)
    pointers = [local_tensor(p).data_ptr() for p in model.parameters()]
    want = Generator(single(1), max_batch=2, max_len=32).generate(REQUESTS)
    result = {}
    for source in ("full", "dtensor"):
        weights = single(1) if source == "full" else sharded(1, device)
        generator.update_weights(weights.state_dict())
        got = generator.generate(REQUESTS)
        diffs = [abs(a - b) for c, w in zip(got, want) for a, b in zip(c.logprobs, w.logprobs)]
        result[source] = {
            "tokens_equal": [c.tokens for c in got] == [c.tokens for c in want],
            "max_logprob_diff": max(diffs),
        }
        generator.update_weights(single(0).state_dict())  # back, for the next source
    result["pointers_kept"] = pointers == [local_tensor(p).data_ptr() for p in model.parameters()]
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    destroy()


if __name__ == "__main__":
    main()
    leave(0)  # skips the interpreter teardown, where gloo can abort a finished rank
