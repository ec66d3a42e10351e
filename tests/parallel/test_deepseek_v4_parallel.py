"""deepseek_v4_debug under FSDP, expert and tensor parallelism (gloo, CPU) gives the
single-process losses (with an MTP depth too), and generation with tensor parallelism its tokens and log-probabilities;
tensor parallelism refuses a degree that does not split the heads into whole output groups,
and pipeline and context parallelism are refused with one clear message."""

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import torchloom.recipes  # noqa: F401  (registers the recipes)
from torchloom.cli import main
from torchloom.config.errors import ConfigError
from torchloom.config.recipes import get_recipe
from torchloom.models import build_model, resolve_model_config
from torchloom.models.deepseek_v4.parallelize import tp_plan
from torchloom.parallel import ParallelConfig, ParallelDims
from torchloom.train.builders import check_layout

pytestmark = pytest.mark.distributed

COMMON = ["--recipe", "deepseek_v4_debug", "--training.steps", "3",
          "--metrics.tensorboard", "false", "--training.sample_tokens", "0",
          "--training.val_sequences", "8", "--training.device", "cpu", "--training.seq_len", "64",
          "--training.micro_batch_size", "4", "--checkpoint.save_final_model", "false"]  # fmt: skip


def losses(output_dir) -> list[float]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [r.get("loss", r.get("val_loss")) for r in map(json.loads, lines)
            if "loss" in r or "val_loss" in r]  # fmt: skip


LAYOUTS = {  # name: (processes, flags)
    "dp_shard 2": (2, ["--parallel.dp_shard", "2"]),
    "ep 2 x dp_shard 2": (2, ["--parallel.ep", "2", "--parallel.dp_shard", "2"]),
    # Heads split, the shared key and indexer replicated, the streams sequence-parallel.
    "tp 2": (2, ["--parallel.tp", "2"]),
    "tp 2 x ep 2 x dp_shard 2": (4, ["--parallel.tp", "2", "--parallel.ep", "2",
                                     "--parallel.dp_shard", "2"]),
}  # fmt: skip


def test_layouts_match_one_process(tmp_path, torchrun_train) -> None:
    single = tmp_path / "single"
    assert main(["train", *COMMON, "--output.dir", str(single)]) == 0
    one = losses(single)
    assert len(one) == 5 and one[-1] < one[0]
    for name, (nproc, flags) in LAYOUTS.items():
        out = tmp_path / name.replace(" ", "_")
        torchrun_train(nproc, *COMMON, "--output.dir", str(out), *flags)
        other = losses(out)
        diff = max(abs(a - b) for a, b in zip(one, other, strict=True))
        print(f"deepseek_v4_debug: one process {one}, {name} {other}, max |diff| {diff:.2e}")
        assert diff < 1e-5, f"{name}: losses differ by {diff:.2e}"


def test_tp2_with_indexer_loss_matches_one_process(tmp_path, torchrun_train) -> None:
    """The indexer loss's target sums every head's attention: under tp the ranks' heads are
    added up (``head_sum``), so the loss, the indexer loss and what it trains match."""
    flags = [*COMMON, "--model.overrides", '{"indexer_loss_weight": 1.0}']
    single, parallel = tmp_path / "single", tmp_path / "tp2"
    assert main(["train", *flags, "--output.dir", str(single)]) == 0
    torchrun_train(2, *flags, "--output.dir", str(parallel), "--parallel.tp", "2")
    records = []
    for run in (single, parallel):
        lines = (run / "metrics.jsonl").read_text().splitlines()
        records.append(
            [(r["loss"], r["aux_indexer"]) for r in map(json.loads, lines) if "loss" in r]
        )
    assert len(records[0]) == len(records[1]) == 3
    loss_diff, aux_diff = (max(abs(a[i] - b[i]) for a, b in zip(*records)) for i in (0, 1))
    print(f"deepseek_v4_debug with indexer loss, tp 2: max |loss diff| {loss_diff:.2e}, "
          f"|indexer loss diff| {aux_diff:.2e}")  # fmt: skip
    assert loss_diff < 1e-5 and aux_diff < 1e-6


@pytest.mark.parametrize("name", ["tp 2 x ep 2 x dp_shard 2"])
def test_mtp_matches_one_process(name, tmp_path, torchrun_train) -> None:
    """With an MTP depth (its block sequence-parallel and split by heads, its experts split
    over ep, its other weights in the root's FSDP group): the losses and aux_mtp of one
    process."""
    flags = [*COMMON, "--model.overrides", '{"mtp_layers": 1}']
    single, parallel = tmp_path / "single", tmp_path / "parallel"
    assert main(["train", *flags, "--output.dir", str(single)]) == 0
    nproc, layout = LAYOUTS[name]
    torchrun_train(nproc, *flags, "--output.dir", str(parallel), *layout)
    records = []
    for run in (single, parallel):
        lines = (run / "metrics.jsonl").read_text().splitlines()
        records.append([(r["loss"], r["aux_mtp"]) for r in map(json.loads, lines) if "loss" in r])
    assert len(records[0]) == len(records[1]) == 3
    loss_diff, aux_diff = (max(abs(a[i] - b[i]) for a, b in zip(*records)) for i in (0, 1))
    print(f"deepseek_v4_debug with MTP, {name}: one process {records[0]}, parallel "
          f"{records[1]}, max |loss diff| {loss_diff:.2e}, |aux_mtp diff| {aux_diff:.2e}")  # fmt: skip
    assert loss_diff < 1e-5 and aux_diff < 1e-5


def test_tp2_generation_matches_one_process(tmp_path) -> None:
    """Greedy decoding past the sliding window and several compressed groups (prompts of 1 to
    20 tokens, 24 new ones) with the replicated-stream plan."""
    run = tmp_path / "run"
    # One step, and the model folder saved (COMMON's last flags turn that off).
    assert main(["train", *COMMON[:-2], "--training.steps", "1", "--output.dir", str(run)]) == 0
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n"
                               for p in (list(range(1, 21)), [5, 6], [7])))  # fmt: skip
    flags = ["--checkpoint", str(run / "model"), "--prompts-file", str(prompts),
             "--max-new-tokens", "24", "--max-batch", "2", "--device", "cpu", "--dtype", "fp32",
             "--greedy"]  # fmt: skip
    assert main(["generate", *flags, "--output", str(tmp_path / "one.jsonl")]) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "torchloom", "generate", *flags, "--tp", "2",
           "--output", str(tmp_path / "tp.jsonl")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-16000:]
    a, b = (
        [json.loads(line) for line in (tmp_path / f).read_text().splitlines()]
        for f in ("one.jsonl", "tp.jsonl")
    )
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]
    worst = max(abs(x - y) for r, s in zip(a, b) for x, y in zip(r["logprobs"], s["logprobs"]))
    print(f"deepseek_v4_debug generation: max |logprob(tp 2) - logprob(1 process)| {worst:.1e}")
    assert worst < 1e-5


@pytest.mark.parametrize(
    ("tp", "overrides", "message"),
    [(4, {}, r"--parallel.tp 4 must divide the model's num_heads \(4\) and o_groups \(2\)"),
     (2, {"o_groups": 1}, r"--parallel.tp 2 must divide .* o_groups \(1\)")],
)  # fmt: skip
def test_tensor_parallel_refuses_what_it_cannot_split(tp, overrides, message) -> None:
    """Every rank must hold whole heads in whole output groups."""
    job = get_recipe("deepseek_v4_debug").build()
    config = replace(resolve_model_config(job.model), **overrides)
    with torch.device("meta"):
        model = build_model(config)
    with pytest.raises(ConfigError, match=message):
        tp_plan(model, tp)


@pytest.mark.parametrize(
    ("axis", "message"),
    [("cp", "supports grouped-query attention layers only"), ("pp", "cannot split a DeepSeekV4")],
)
def test_context_and_pipeline_parallel_are_refused(axis, message) -> None:
    job = get_recipe("deepseek_v4_debug").build()
    with torch.device("meta"):
        model = build_model(resolve_model_config(job.model))
    dims = ParallelDims(ParallelConfig(dp_shard=1, **{axis: 2}), 2, 0, "cpu")
    with pytest.raises(ConfigError, match=message):
        check_layout(model, dims)
