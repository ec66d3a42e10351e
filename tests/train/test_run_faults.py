"""Inputs that used to start a run and then fail late, grind or end quietly wrong: a model too
large for the machine, a compile backend that cannot run, MoE settings no model can use, a
gradient norm that goes non-finite, and an FSDP compute dtype that overrode
--training.mixed_precision. Each now ends at once with one line, or runs as asked."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch import nn

import torchloom.train.builders as builders
import torchloom.train.step as step_module
from torchloom.cli import main, resolve_job
from torchloom.config import errors
from torchloom.models import build_model, resolve_model_config
from torchloom.parallel import ParallelConfig
from torchloom.parallel.data_parallel import mixed_precision_policy
from torchloom.train.dry_run import rank_memory

COMMON = ["--recipe", "debug", "--metrics.tensorboard", "false", "--training.sample_tokens", "0",
          "--training.val_sequences", "8", "--checkpoint.save_final_model", "false",
          "--training.device", "cpu", "--lr_schedule.warmup_steps", "1"]  # fmt: skip


def train(output_dir: Path, *flags: str) -> int:
    return main(["train", *COMMON, "--output.dir", str(output_dir), *flags])


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.startswith("error: "), err
    print(err)
    return err


@pytest.mark.parametrize(
    "override, message",
    [
        ({"moe.hash_routing": True},
         "model moe.hash_routing needs the token ids in every MoE layer, which qwen3_moe's blocks "
         "do not pass"),
        ({"moe.route_scale": 0}, "model moe.route_scale must be a finite number > 0"),
        ({"moe.route_scale": -1.0}, "model moe.route_scale must be a finite number > 0"),
    ],
)  # fmt: skip
def test_moe_settings_no_model_can_use_are_refused(capsys, override, message):
    argv = ["train", "--recipe", "qwen3_moe_debug", "--model.overrides", json.dumps(override)]
    assert main([*argv, "--print-config"]) == 2
    assert message in one_line(capsys.readouterr().err)


@pytest.mark.skipif(importlib.util.find_spec("tvm") is not None, reason="tvm is installed")
def test_a_compile_backend_that_cannot_run_is_refused_at_start(capsys, monkeypatch):
    flags = ["--compile.enabled", "true", "--print-config"]
    assert main(["train", "--recipe", "debug", "--compile.backend", "tvm", *flags]) == 2
    assert "--compile.backend tvm is registered but cannot run here: it needs apache-tvm" in (
        one_line(capsys.readouterr().err)
    )

    def broken_plugin(name):
        raise ImportError(f"No module named '{name}_plugin'")

    monkeypatch.setattr(torch._dynamo, "lookup_backend", broken_plugin)
    assert main(["train", "--recipe", "debug", "--compile.backend", "cudagraphs", *flags]) == 2
    assert "loading it failed (ImportError: No module named 'cudagraphs_plugin')" in (
        one_line(capsys.readouterr().err)
    )
    # Off, it only warns: the backend is looked up when compile is turned on.
    assert main(["train", "--recipe", "debug", "--compile.backend", "tvm", "--print-config"]) == 0


def test_a_model_too_large_for_the_machine_is_refused(tmp_path, capsys, monkeypatch):
    """The lower bound (parameters, gradients, AdamW moments) against the device's total memory:
    here a machine of 1 MiB, which the 2.4 MB debug model's parameters alone exceed."""
    monkeypatch.setattr(builders, "device_memory", lambda device: 2**20)
    monkeypatch.setattr(nn.Module, "to_empty", lambda *a, **k: pytest.fail("allocated"))
    assert train(tmp_path / "run", "--training.steps", "1") == 2
    err = one_line(capsys.readouterr().err)
    assert "Training this model needs at least 0.0 GiB per rank" in err
    assert "more than the 0.0 GiB of memory of this cpu device; plan a layout" in err
    assert "--dry-run" in err and "--model.flavor" in err and "torchrun" in err


def test_running_out_of_memory_while_allocating_is_one_line(tmp_path, capsys, monkeypatch):
    def to_empty(self, *, device, recurse=True):
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you "
            "tried to allocate 1638400000000 bytes."
        )

    monkeypatch.setattr(nn.Module, "to_empty", to_empty)
    assert train(tmp_path / "run", "--training.steps", "1") == 2
    err = one_line(capsys.readouterr().err)
    assert "The cpu device ran out of memory while allocating the model's parameters" in err


@pytest.mark.parametrize("recipe", ["debug", "qwen3_vl_debug", "deepseek_v4_debug"])
def test_the_memory_lower_bound_never_exceeds_what_training_holds(recipe):
    """Never refuse a run that fits: the bound counts what every step surely allocates, at most
    the dry run's parameters + gradients + optimizer state; a vision encoder (no gradient on
    text) and a sparse-attention indexer (trained in some phases only) add only parameters."""
    _, job = resolve_job(["--recipe", recipe])
    config = resolve_model_config(job.model)
    with torch.device("meta"):
        model = build_model(config)
    params, trained = builders.training_bytes_lower_bound([model], job)
    row = rank_memory(0, model, job, None)
    print(f"{recipe}: bound {params} + {trained}, dry run {row.params} + {row.grads} + "
          f"{row.optimizer}")  # fmt: skip
    assert params == row.params
    assert trained <= row.grads + row.optimizer
    untrained = [n for n, _ in model.named_parameters() if not builders.surely_trained(n)]
    assert (recipe == "debug") == (not untrained), untrained[:3]


def test_a_nonfinite_gradient_stops_with_a_hint_that_fits(tmp_path, capsys):
    """init_std 1e30: a finite loss (8.3) but a nan gradient norm at step 1. The step is not
    let through (it was: the weights went nan and step 2 blamed the learning rate)."""
    flags = ["--training.steps", "2", "--model.overrides", '{"init_std": 1e30}']
    assert train(tmp_path / "run", *flags) == 1
    err = one_line(capsys.readouterr().err)
    assert "The gradient norm became nan at step 1 while the loss was finite" in err
    assert "init_std" in err and "--training.skip_nonfinite true" in err


def test_skipped_steps_are_counted_and_a_run_that_skipped_all_fails(tmp_path, capsys):
    flags = ["--training.steps", "2", "--model.overrides", '{"init_std": 1e30}',
             "--training.skip_nonfinite", "true"]  # fmt: skip
    assert train(tmp_path / "all", *flags) == 1
    err = one_line(capsys.readouterr().err)
    assert "Every one of the 2 steps had a non-finite loss or gradient norm and was skipped" in err


def test_a_skipped_gradient_is_reported_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    """Step 2's gradient norm is made nan: skip_nonfinite skips it (the loss alone was finite)
    and the done line says so."""
    original, calls = step_module.backward_and_clip, []

    def backward_and_clip(*args):
        loss, norm, metrics = original(*args)
        calls.append(1)
        return loss, norm * math.nan if len(calls) == 2 else norm, metrics

    monkeypatch.setattr(step_module, "backward_and_clip", backward_and_clip)
    flags = ["--training.steps", "3", "--training.skip_nonfinite", "true"]
    assert train(tmp_path / "run", *flags) == 0
    out = capsys.readouterr().out
    assert "done: 3 steps (1 skipped as non-finite), train loss" in out, out


def test_a_nonfinite_validation_loss_at_the_end_is_an_error(tmp_path, capsys):
    """lr 1e10: step 1's update blows the weights up, the later steps are skipped, and the run
    used to end with exit 0 and `validation loss 8.3 -> nan`."""
    flags = ["--training.steps", "3", "--optimizer.lr", "1e10", "--training.skip_nonfinite", "true"]
    assert train(tmp_path / "run", *flags) == 1
    err = one_line(capsys.readouterr().err)
    assert "after training" in err and "(2 of 3 steps were skipped as non-finite)" in err


def test_fsdp_computes_in_the_dtype_training_asks_for(capsys):
    """mixed_precision_param auto follows an explicit --training.mixed_precision (FSDP used to
    compute in fp32 on the CPU whatever it said); both auto: the device decides, as before."""
    argv = ["train", "--recipe", "debug", "--parallel.fsdp_always", "true", "--dry-run"]
    assert main([*argv, "--training.mixed_precision", "bf16"]) == 0
    assert "bfloat16 compute" in capsys.readouterr().out
    assert main(argv) == 0
    assert "float32 compute" in capsys.readouterr().out
    expected = [("auto", "cpu", torch.float32), ("auto", "cuda", torch.bfloat16),
                ("bf16", "cpu", torch.bfloat16), ("fp32", "cuda", torch.float32)]  # fmt: skip
    for run, device, dtype in expected:
        policy = mixed_precision_policy(ParallelConfig().following(run), device)
        assert policy.param_dtype == dtype, (run, device, policy)
    explicit = ParallelConfig(mixed_precision_param="bf16")
    assert explicit.following("auto") is explicit


def test_fsdp_options_on_one_process_without_fsdp_warn(capsys, monkeypatch):
    monkeypatch.setattr(errors, "_warned", set())  # each warning prints once per process
    argv = ["train", "--recipe", "debug", "--parallel.mixed_precision_param", "bf16", "--dry-run"]
    assert main(argv) == 0
    assert capsys.readouterr().err == (
        "warning: --parallel.mixed_precision_param bf16 has no effect until FSDP is on (more "
        "than one process, or --parallel.fsdp_always true).\n"
    )


def test_degrees_that_need_more_processes_say_how_to_launch_them(capsys):
    assert main(["train", "--recipe", "debug", "--parallel.tp", "2", "--dry-run"]) == 2
    assert "launch them with torchrun --nproc-per-node 2 (--dry-run simulates them with " in (
        one_line(capsys.readouterr().err)
    )


def test_multimodal_data_for_a_text_model_is_refused_before_the_data(tmp_path, capsys):
    """The media-encoder check needs no tokenizer, so it comes before the data pass: here the
    source does not even exist, and the model is what the one line names."""
    flags = [
        "--data.format",
        "multimodal",
        "--data.sources",
        '["missing.jsonl"]',
        "--data.tokenizer",
        "builtin:stdlib_bpe_vl",
    ]
    assert train(tmp_path / "run", "--training.steps", "1", *flags) == 2
    message = one_line(capsys.readouterr().err)
    assert "--data.format multimodal needs a model with a media encoder" in message
