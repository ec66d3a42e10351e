"""Run a test worker script under torchrun (gloo, CPU) and read back its JSON result lines."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_worker(
    worker: Path, nproc: int, *names: str, env: dict[str, str] | None = None
) -> list[tuple[str, dict]]:
    """(KIND, payload) for every ``KIND {json}`` line the worker printed (RESULT, MESH, ...);
    ``env`` adds variables to the workers' environment."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    with tempfile.TemporaryDirectory() as logs:
        # Each rank's stdout also goes to a file of its own: lines longer than a pipe's atomic
        # write (4 KiB) from two ranks can interleave on the shared console.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "--log-dir", logs, "--tee", "1", str(worker),
               *names]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
        if proc.returncode:
            pytest.fail(
                f"torchrun exited with {proc.returncode}:\n{proc.stdout[-4000:]}\n"
                f"{proc.stderr[-16000:]}"
            )
        files = sorted(Path(logs).rglob("stdout.log"), key=lambda f: int(f.parent.name))
        assert len(files) == nproc, f"expected {nproc} rank logs under {logs}, found {files}"
        text = "\n".join(f.read_text() for f in files)
    lines = (line.partition(" ") for line in text.splitlines())
    return [(kind, json.loads(payload)) for kind, _, payload in lines if kind.isupper() and payload]
