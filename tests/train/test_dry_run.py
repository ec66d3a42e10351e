"""`torchloom train --dry-run`: per-rank bytes equal the real model's, refusals are one line, and
a 70B layout is checked in seconds without allocating it."""

import os
import subprocess
import sys
import time

import pytest
import torch

from torchloom.cli import main, resolve_job
from torchloom.models import build_model, resolve_model_config
from torchloom.models.config import ModelConfig
from torchloom.parallel import build_parallel_dims
from torchloom.train.builders import build_model_config, build_objective
from torchloom.train.dry_run import estimate_activations, kept_by_forward, rank_memory
from torchloom.train.optim import OPTIMIZER_STATE_BYTES, OPTIMIZERS
from torchloom.train.remat import apply_remat

COLUMNS = ("params", "grads", "optimizer", "total", "activations", "peak_rss")


def per_rank(output: str, unit: str = "bytes") -> dict[int, dict[str, float | None]]:
    """The report's table in ``unit`` (bytes or GiB): {rank: {column: value or None}}."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.rstrip().endswith(f"({unit})")) + 1
    rows = {}
    for line in lines[start:]:
        if not line.strip() or line.split()[0] == "rank":
            break
        rank, *cells = line.split()
        rows[int(rank)] = {c: None if v == "n/a" else float(v) for c, v in zip(COLUMNS, cells)}
    return rows


def estimate_and_real_forward(job, micro: int) -> tuple:
    """The dry run's activation estimate for ``job`` (one process: no process group) and the
    bytes a real forward of the whole model keeps for backward, on the CPU."""
    config, objective = build_model_config(job), build_objective(job)
    cpu = torch.device("cpu")
    dims = build_parallel_dims(job.parallel, cpu.type)
    estimate = estimate_activations(job, config, dims, cpu, objective, micro=micro)
    model = build_model(config)
    model.init_weights(0)
    apply_remat(model.layers, job.remat, compile_enabled=False)
    real = kept_by_forward(
        model, job=job, device=cpu, objective=objective, micro=micro, autocast=None
    )
    return estimate, real


def test_every_optimizer_declares_its_state_bytes():
    assert set(OPTIMIZER_STATE_BYTES) == set(OPTIMIZERS)


def test_debug_dry_run_reports_the_real_model(capsys):
    assert main(["train", "--recipe", "debug", "--dry-run"]) == 0
    out = capsys.readouterr().out
    print(out)
    row = per_rank(out)[0]
    _, job = resolve_job(["--recipe", "debug"])
    params = list(build_model(resolve_model_config(job.model)).parameters())  # materialized
    nbytes = sum(p.numel() * p.element_size() for p in params)
    assert params[0].device.type == "cpu"
    assert row["params"] == row["grads"] == nbytes
    # AdamW: exp_avg and exp_avg_sq in fp32 like each parameter, and a 4-byte step count.
    assert row["optimizer"] == 2 * nbytes + 4 * len(params)
    assert row["total"] == row["params"] + row["grads"] + row["optimizer"]
    assert row["activations"] > 0
    assert "not checked: the tokenizer's vocabulary" in out


@pytest.mark.parametrize("remat", ["none", "full", "selective", "every_k"])
def test_activation_estimate_equals_a_real_forward(remat):
    """The estimate (one block per kind on fake tensors, extrapolated) equals the bytes a real
    forward of the whole model leaves alive for backward."""
    overrides = '{"num_layers": 5}'
    _, job = resolve_job(
        ["--recipe", "debug", "--remat.mode", remat, "--model.overrides", overrides]
    )
    estimate, real = estimate_and_real_forward(job, micro=4)
    print(f"remat {remat}: estimate {estimate.bytes}, real forward keeps {real} bytes")
    assert estimate.bytes == real


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--training.micro_batch_size", "3"], "global_batch_size=8 is not a multiple of"),
        (["--training.seq_len", "1024"], "exceeds the model's max_seq_len 512"),
    ],
)
def test_refused_layout_is_one_line(capsys, flags, message):
    assert main(["train", "--recipe", "debug", *flags, "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    assert message in captured.err


@pytest.mark.distributed
def test_70b_over_two_fsdp_ranks_halves_the_parameters():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "torchloom", "train", "--recipe", "debug", "--model.flavor", "70B",
           "--parallel.dp_shard", "2", "--dry-run"]  # fmt: skip
    start = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    print(proc.stdout, f"took {seconds:.1f} s")
    rows = per_rank(proc.stdout)
    config = resolve_model_config(ModelConfig(name="llama3", flavor="70B"))
    model_bytes = config.num_params() * 4  # fp32
    assert sorted(rows) == [0, 1]
    for row in rows.values():
        assert row["params"] == model_bytes // 2  # every 70B dimension splits evenly
        assert row["activations"] is not None
    peak_rss_gib = [row["peak_rss"] for row in per_rank(proc.stdout, "GiB").values()]
    assert max(peak_rss_gib) < 3.0, peak_rss_gib
    assert seconds < 120


@pytest.mark.distributed
@pytest.mark.multiprocess_core
def test_pp_over_more_stages_than_layers_is_refused():
    """A 1-layer model over pp 2 used to report layers per stage [0, 1] and exit 0."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "torchloom", "train", "--recipe", "debug", "--training.device", "cpu",
           "--parallel.pp", "2", "--model.overrides", '{"num_layers": 1}', "--dry-run"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    message = (
        "error: 1 layer(s) cannot fill 2 pipeline stages (layers per stage [0, 1]); lower pp or "
        "pp_stages_per_rank, or pass --parallel.pp_layers_per_stage."
    )
    # Each rank ends with the line and exit 2 (torchrun then exits 1, naming that status).
    assert proc.returncode != 0 and "(exitcode: 2)" in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count(message) == 2, proc.stderr[-3000:]
    assert "dry run:" not in proc.stdout


def test_frozen_parameters_have_no_gradient_bytes():
    """A frozen parameter (requires_grad False) is counted in the parameters, not the
    gradients."""
    _, job = resolve_job(["--recipe", "debug"])
    with torch.device("meta"):
        model = build_model(resolve_model_config(job.model))
    model.embed_tokens.weight.requires_grad_(False)
    params = list(model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in params)
    frozen = model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    row = rank_memory(0, model, job, None)
    print(f"parameters {row.params}, gradients {row.grads}, frozen {frozen}")
    assert row.params == nbytes
    assert row.grads == nbytes - frozen


@pytest.mark.parametrize("remat", ["none", "full"])
def test_activation_estimate_covers_multi_token_prediction(remat):
    """deepseek_v3's MTP depths sit outside the blocks: the estimate's shells share them (they
    used to stay on meta, and the fake forward failed: activations n/a)."""
    overrides = '{"num_layers": 4}'
    _, job = resolve_job(
        ["--recipe", "deepseek_v3_debug", "--remat.mode", remat, "--model.overrides", overrides]
    )
    estimate, real = estimate_and_real_forward(job, micro=4)
    print(f"remat {remat}: estimate {estimate.bytes} ({estimate.note[:40]}), real {real} bytes")
    assert estimate.bytes == real


def test_simulated_world_holds_what_launched_ranks_hold(capsys):
    """--world-size 2 in one process reports what each of 2 torchrun ranks does (the
    distributed test above): half of every 70B weight."""
    argv = ["train", "--recipe", "debug", "--model.flavor", "70B", "--parallel.dp_shard", "2"]
    assert main([*argv, "--dry-run", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    print(out)
    rows = per_rank(out)
    config = resolve_model_config(ModelConfig(name="llama3", flavor="70B"))
    assert sorted(rows) == [0]
    assert rows[0]["params"] == config.num_params() * 4 // 2
    assert rows[0]["activations"] is not None
    assert "on 2 simulated rank(s)" in out


def test_simulated_pipeline_reports_every_stage(capsys):
    """One rank per pipeline stage; their parameters add up to the whole model."""
    overrides = '{"num_layers": 4}'
    argv = ["train", "--recipe", "debug", "--parallel.pp", "2", "--model.overrides", overrides]
    assert main([*argv, "--training.device", "cpu", "--dry-run", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    print(out)
    rows = per_rank(out)
    config = resolve_model_config(
        ModelConfig(name="llama3", flavor="debug", overrides={"num_layers": 4})
    )
    assert sorted(rows) == [0, 1]
    assert rows[0]["params"] + rows[1]["params"] == config.num_params() * 4


def test_world_size_needs_the_dry_run(capsys):
    assert main(["train", "--recipe", "debug", "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --world-size 2 applies only with --dry-run"), err
    assert main(["train", "--recipe", "debug", "--dry-run", "--world-size", "two"]) == 2
    assert "give a number of ranks" in capsys.readouterr().err


def test_a_tp_that_splits_heads_is_named_before_the_seq_len(capsys):
    """tp 3 over 4 heads: the heads are the problem (a seq_len divisible by 3 would not help),
    so that is the error, not a seq_len suggestion."""
    argv = ["train", "--recipe", "debug", "--dry-run", "--world-size", "3", "--parallel.tp", "3"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--parallel.tp 3 does not divide the model's num_heads (4)" in err, err


@pytest.mark.distributed
@pytest.mark.parametrize(
    "flags, message",
    [
        # torch's 1F1B raised a ValueError traceback from inside its schedule for this one.
        (
            ["--parallel.pp_microbatches", "1"],
            "1f1b cannot run --parallel.pp_microbatches 1 over 2 stages: it needs at least one "
            "microbatch per stage (>= 2)",
        ),
        (
            ["--parallel.pp_schedule", "interleaved_1f1b", "--parallel.pp_microbatches", "5"],
            "5 does not split into 2 equal rounds; e.g. 4 or 6",
        ),
        # The default (0) was named as if the user had set it.
        (
            ["--training.global_batch_size", "6", "--parallel.pp_schedule", "interleaved_1f1b"],
            "does not split into 4 microbatches (--parallel.pp_microbatches 0: one per stage); "
            "choose --parallel.pp_microbatches 6",
        ),
    ],
    ids=["1f1b-too-few", "interleaved-rounds", "default-named"],
)
def test_pipeline_microbatches_a_schedule_cannot_run_are_one_line(capsys, flags, message):
    argv = ["train", "--recipe", "debug", "--dry-run", "--world-size", "2", "--parallel.pp", "2"]
    assert main([*argv, "--model.overrides", '{"tie_embeddings": false}', *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err
