"""Run a test worker script under torchrun (gloo, CPU) and read back its JSON result lines."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_worker(
    worker: Path, nproc: int, *names: str, env: dict[str, str] | None = None
) -> list[tuple[str, dict]]:
    """(KIND, payload) for every ``KIND {json}`` line the worker printed (RESULT, MESH, ...);
    ``env`` adds variables to the workers' environment."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(worker), *names]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    if proc.returncode:
        pytest.fail(
            f"torchrun exited with {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-16000:]}"
        )
    lines = (line.partition(" ") for line in proc.stdout.splitlines())
    return [(kind, json.loads(payload)) for kind, _, payload in lines if kind.isupper() and payload]
