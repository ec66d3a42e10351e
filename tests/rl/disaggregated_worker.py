"""One `torchloom rl` run with disaggregated placement under torchrun (tests/rl/test_disaggregated.py).

    torchrun --standalone --nproc-per-node 3 tests/rl/disaggregated_worker.py OUT_DIR [ARGS...]

After the run the trainer sends its final policy once more and every rank writes what it holds
(the trainer's full tensors on rank 0, each generator rank its copy) to OUT_DIR/weights-RANK.pt,
so the test can compare them bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from common import BASE  # this folder is the script's: on sys.path

from torchloom.cli import resolve_job
from torchloom.parallel import destroy, leave
from torchloom.parallel.state import full_state_items
from torchloom.rl.loop import RLRunner


def main() -> None:
    out = Path(sys.argv[1])
    _, job = resolve_job([*BASE, "--output.dir", str(out), "--rl.placement", "disaggregated",
                          *sys.argv[2:]])  # fmt: skip
    rl = RLRunner(job)
    rl.train()
    assert rl.link is not None
    rank = dist.get_rank()
    if rl.is_generator:
        rl.link.receive_weights(rl.gen_model)
        weights = {n: p.detach().clone() for n, p in rl.gen_model.named_parameters()}
    else:
        rl.link.send_weights(rl.model)
        rl.link.wait_sent()
        weights = dict(full_state_items(rl.model))  # every trainer rank gathers
    if rank == 0 or rl.is_generator:
        torch.save(weights, out / f"weights-{rank}.pt")
    destroy()


if __name__ == "__main__":
    main()
    leave(0)  # skips the interpreter teardown, where gloo can abort a finished rank
