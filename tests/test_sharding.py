"""`pytest --shard I/N` (tests/conftest.py), which `make test-gpu SHARD=I/N` passes: the GPU
suite outgrew one ten-minute device call, so its parts must cover it exactly."""

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def _collect(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
         "-m", "gpu", str(TESTS / "kernels"), *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _ids(*args: str) -> list[str]:
    result = _collect(*args)
    assert result.returncode == 0, result.stdout + result.stderr
    return [line for line in result.stdout.splitlines() if "::" in line]


def test_shards_are_disjoint_and_cover_the_selection_in_order():
    everything = _ids()
    first, second = _ids("--shard", "1/2"), _ids("--shard", "2/2")
    assert len(everything) >= 6  # the -m gpu selection of tests/kernels, not an empty one
    assert first == everything[0::2]  # interleaved: the slow tests of a file spread out
    assert second == everything[1::2]


def test_a_malformed_shard_names_the_form_it_wants():
    for spec in ("3/2", "1-2"):
        result = _collect("--shard", spec)
        assert result.returncode == 4, (spec, result.stdout, result.stderr)  # usage error
        assert f"--shard '{spec}': want I/N with 1 <= I <= N" in result.stdout + result.stderr
