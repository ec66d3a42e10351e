"""`pytest --shard I/N` (tests/conftest.py), which `make test-gpu SHARD=I/N` passes: the GPU
suite outgrew one ten-minute device call, so its parts must cover it exactly."""

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def _collect(*args: str, marks: str = "gpu", path: Path = TESTS / "kernels"):
    """`pytest --collect-only -m MARKS PATH ARGS` in a fresh process."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
         "-m", marks, str(path), *args],
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


def test_the_slow_marks_conftest_adds_are_read_by_dash_m():
    """tests/conftest.py marks every multi-process test slow (bar the trimmed core) before -m
    deselects, and shards after: `make test` (-m "not slow") must not run them."""
    result = _collect(marks="not slow", path=TESTS / "parallel" / "test_pipeline.py")
    assert result.returncode == 0, result.stdout + result.stderr
    selected = [line for line in result.stdout.splitlines() if "::" in line]
    launched = ("test_every_schedule_matches_single_process", "test_pp_composes_with_fsdp_and_tp",
                "test_an_objective_reading_batch_extras_runs_on_the_last_stage")  # fmt: skip
    assert selected, result.stdout
    assert not [line for line in selected if line.split("::")[1].startswith(launched)], selected
