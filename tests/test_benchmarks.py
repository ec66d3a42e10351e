"""The training and generation benchmarks run end to end on the CPU at the tiny shape (their
GPU numbers are in benchmarks/RESULTS.md): each writes its JSON, rows agree where they must."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_train_benchmark_rows_and_loss_check(tmp_path):
    out = tmp_path / "train.json"
    stdout = _run("train.py", "--shapes", "tiny", "--device", "cpu", "--no-compile", "--steps",
                  "2", "--warmup", "1", "--rows", "torchloom-eager", "torchloom",
                  "torchloom-chunked", "torchloom-autocast", "hf", "--json", str(out))  # fmt: skip
    print(stdout)
    report = json.loads(out.read_text())
    rows = {r["row"]: r for r in report["rows"]}
    assert set(rows) == {"torchloom-eager", "torchloom", "torchloom-chunked",
                         "torchloom-autocast", "hf"}  # fmt: skip
    assert all(r["error"] is None and r["tokens_per_s"] > 0 for r in rows.values())
    assert rows["hf"]["vs_hf"] == 1.0
    # Same init, same batches, fp32 on the CPU: the torchloom rows agree with the eager step
    # (chunked only reorders the loss's sums). HF's model has its own init: only the scale of
    # its first loss (about log(vocab)) agrees.
    checks = report["loss_diff"]["tiny"]
    assert set(checks) == {"torchloom", "torchloom-chunked", "torchloom-autocast"}
    assert max(c["step_1"] for c in checks.values()) < 1e-5
    assert abs(rows["hf"]["losses"][0] - rows["torchloom-eager"]["losses"][0]) < 0.1


def test_generate_benchmark_runs(tmp_path):
    out = tmp_path / "generate.json"
    _run("generate.py", "--shape", "tiny", "--device", "cpu", "--batches", "1", "2",
         "--new-tokens", "4", "--prompt-len", "8", "--rows", "ours", "hf-eager", "--train-seq",
         "0", "--json", str(out))  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert {r["row"] for r in rows} == {"ours", "hf-eager"}
