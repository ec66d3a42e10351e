"""A finished torchrun rank leaves through ``parallel.leave``: at once, with its exit code, and
with everything it printed (os._exit alone would drop what sits in a pipe's buffer)."""

import os
import subprocess
import sys


def _python(*args: str, **env: str) -> subprocess.CompletedProcess:
    # Buffered streams (as a script of one's own under torchrun without -u would have them).
    base = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          env={**base, **env})  # fmt: skip


def test_leave_keeps_the_code_and_the_buffered_output():
    proc = _python("-c", "import sys; from torchloom.parallel import leave; print('out', end=''); "
                   "print('err', end='', file=sys.stderr); leave(3)")  # fmt: skip
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "out", "err")


def test_a_rank_of_python_m_torchloom_leaves_with_its_result():
    """Under torchrun (WORLD_SIZE > 1) `python -m torchloom` ends through leave: the command's
    output and exit code come through (here its usage, and 2 for an unknown command)."""
    ok = _python("-m", "torchloom", "--help", WORLD_SIZE="2")
    assert ok.returncode == 0 and ok.stdout.startswith("usage: torchloom"), ok.stderr
    bad = _python("-m", "torchloom", "tarin", WORLD_SIZE="2")
    assert bad.returncode == 2 and "unknown command 'tarin'" in bad.stderr
