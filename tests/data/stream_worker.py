"""Run under torchrun (gloo, 2 ranks): the streaming loader of each rank saves its state with
DCP (as the trainer's checkpoints do) and resumes it; it also resumes a 1-rank checkpoint.

    torchrun --standalone --nproc-per-node 2 tests/data/stream_worker.py DIR

DIR holds ``config.json`` (the DataConfig fields) and ``ckpt-dp1`` (a 1-rank loader state);
prints ``RESULT {...}`` with this rank's input tokens per step, writes ``DIR/ckpt-dp2``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from torchloom.data import DataConfig, build_tokenizer
from torchloom.data.build import streaming_loader
from torchloom.parallel import leave

SEQ_LEN, GLOBAL_BATCH, MICRO_BATCH, SEED = 16, 8, 2, 5


def main() -> None:
    folder = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    cfg = DataConfig(**json.loads((folder / "config.json").read_text()))
    tokenizer = build_tokenizer(cfg)

    def loader():
        return streaming_loader(cfg, tokenizer, SEQ_LEN, GLOBAL_BATCH, MICRO_BATCH, rank, size,
                                SEED)  # fmt: skip

    def tokens(train, steps: int) -> list[list[int]]:
        return [[t for b in train.next_step() for t in b.tokens.reshape(-1).tolist()]
                for _ in range(steps)]  # fmt: skip

    first = loader()
    before = tokens(first, 3)
    dcp.save({"dataloader": first.state_dict()}, checkpoint_id=folder / "ckpt-dp2")
    uninterrupted = tokens(first, 3)
    resumed = loader()
    dcp.load({"dataloader": resumed}, checkpoint_id=folder / "ckpt-dp2")
    from_dp2 = tokens(resumed, 3)
    from_dp1_loader = loader()
    dcp.load({"dataloader": from_dp1_loader}, checkpoint_id=folder / "ckpt-dp1")
    from_dp1 = tokens(from_dp1_loader, 3)
    result = {"rank": rank, "before": before, "uninterrupted": uninterrupted,
              "from_dp2": from_dp2, "from_dp1": from_dp1}  # fmt: skip
    print("RESULT " + json.dumps(result), flush=True)
    for train in (first, resumed, from_dp1_loader):
        train.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave(0)  # skips the interpreter teardown, where gloo can abort a finished rank
