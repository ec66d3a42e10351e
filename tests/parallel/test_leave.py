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


def test_a_rank_of_python_m_torchloom_leaves_with_its_result(tmp_path):
    """Under torchrun (WORLD_SIZE > 1) `python -m torchloom` ends through leave: the command's
    output and exit code come through (here its usage, and 2 for an unknown command), and the
    interpreter's teardown (an atexit probe) is skipped; a single process still runs it."""
    probe = "import atexit, sys\natexit.register(lambda: sys.stderr.write('teardown ran'))\n"
    (tmp_path / "sitecustomize.py").write_text(probe)
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    ok = _python("-m", "torchloom", "--help", WORLD_SIZE="2", PYTHONPATH=path)
    assert ok.returncode == 0 and ok.stdout.startswith("usage: torchloom"), ok.stderr
    assert "teardown ran" not in ok.stderr
    bad = _python("-m", "torchloom", "tarin", WORLD_SIZE="2", PYTHONPATH=path)
    assert bad.returncode == 2 and "unknown command 'tarin'" in bad.stderr
    assert "teardown ran" not in bad.stderr
    single = _python("-m", "torchloom", "--help", WORLD_SIZE="1", PYTHONPATH=path)
    assert single.returncode == 0 and single.stderr.endswith("teardown ran"), single.stderr
