"""`torchloom rl` shares train's config system: help, print-config, overrides, refusals."""

from __future__ import annotations

import json
import re
import shlex

from tests.rl.common import BASE, records
from torchloom.cli import main
from torchloom.config.fields import field_docs
from torchloom.rl.config import RLConfig
from torchloom.rl.env import Check, Prompt
from torchloom.rl.sources import prompt_index
from torchloom.rl.tasks import BUILTIN_TASKS, TASKS, register_task


def test_help_and_print_config(capsys) -> None:
    assert main(["rl", "--recipe", "rl_debug", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--rl.max_offpolicy_steps" in text and "--training.steps" in text
    assert main(["rl", "--recipe", "rl_debug", "--print-config", "--rl.group_size", "4"]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config["recipe"] == "rl_debug" and config["rl"]["group_size"] == 4


def test_bad_input_gets_one_clear_error(capsys) -> None:
    cases = {
        ("rl", "--recipe", "debug"): "is a training recipe, not an RL one",
        ("train", "--recipe", "rl_debug"): "run it with `torchloom rl --recipe rl_debug`",
        ("rl", "--rl.group_size", "1"): "--rl.group_size must be at least 2",
        ("rl", "--rl.max_offpolicy_steps", "-1"): "--rl.max_offpolicy_steps must be >= 0",
        ("rl", "--parallel.dp_shard", "2"): "or use --rl.placement disaggregated",
        ("rl", "--rl.placement", "disaggregated", "--parallel.pp", "2"): "--parallel.pp 2 is not "
        "supported by torchloom rl",
        (
            "rl",
            "--rl.placement",
            "disaggregated",
            "--checkpoint.initial_load_hf",
            "",
            "--rl.init_recipes",
            "[]",
            "--data.tokenizer",
            "builtin:stdlib_bpe",
        ): "needs trainer ranks beside its --rl.generator_ranks 1",
        ("rl", "--rl.grup_size", "4"): "Did you mean '--rl.group_size'",
    }
    for argv, message in cases.items():
        assert main(list(argv)) == 2, argv
        err = capsys.readouterr().err
        assert message in err, (argv, err)


def test_resume_at_the_last_step_says_so_and_touches_nothing(tmp_path, capsys) -> None:
    """The run scaffold's rule holds for `torchloom rl` too: one line, exit 0, no file touched."""
    args = ["rl", *BASE, "--output.dir", str(tmp_path), "--training.steps", "2",
            "--checkpoint.interval", "2", "--training.device", "cpu"]  # fmt: skip
    assert main(args) == 0
    files = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in tmp_path.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main([*args, "--checkpoint.resume", "true"]) == 0
    printed = capsys.readouterr().out
    print(printed)
    assert printed.startswith("Nothing to train: ") and printed.count("\n") == 1
    assert files == {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in tmp_path.rglob("*")
                     if p.is_file()}  # fmt: skip


def test_removed_and_nonsense_values_end_in_one_exact_line(capsys) -> None:
    """Every message is checked in full: one line, exit 2, before anything is built."""
    cases = {
        ("--rl.tis_cap", "0"): "--rl.tis_cap no longer exists; it is now --rl.is_high (the "
        "importance weight's cap; --rl.is_low is its floor).",
        ("--rl.format_reward", "nan"): "--rl.format_reward must be in [0, 1] (an unparsable "
        "reply scores 0, a correct one 1); got nan.",
        ("--rl.format_reward", "-0.5"): "--rl.format_reward must be in [0, 1] (an unparsable "
        "reply scores 0, a correct one 1); got -0.5.",
        ("--rl.is_low", "nan"): "--rl.is_low must be a finite number >= 0; got nan.",
        ("--rl.is_low", "-1"): "--rl.is_low must be a finite number >= 0; got -1.0.",
        ("--rl.kl_coef", "inf"): "--rl.kl_coef must be a finite number >= 0; got inf.",
        ("--rl.overlong_penalty", "inf"): "--rl.overlong_penalty must be a finite number >= 0; "
        "got inf.",
        ("--rl.temperature", "inf"): "--rl.temperature must be a finite number >= 0.0001 for "
        "rollouts (greedy rollouts of a group are all alike, a smaller one overflows the "
        "sampler's division, an infinite one samples uniform noise); got inf.",
        ("--rl.temperature", "1e-45"): "--rl.temperature must be a finite number >= 0.0001 for "
        "rollouts (greedy rollouts of a group are all alike, a smaller one overflows the "
        "sampler's division, an infinite one samples uniform noise); got 1e-45.",
        ("--rl.clip_high", "inf"): "--rl.clip_high must be a finite number >= 0; got inf.",
        ("--rl.clip_low", "1"): "--rl.clip_low must be in [0, 1); got 1.0.",
        ("--rl.group_size", "0"): "--rl.group_size must be at least 2: advantages are relative "
        "within a group; got 0.",
        ("--rl.group_size", "1"): "--rl.group_size must be at least 2: advantages are relative "
        "within a group; got 1.",
        ("--rl.is_high", "nan"): "--rl.is_high must be a finite number above --rl.is_low (0.0); "
        "got nan.",
        ("--rl.is_high", "-1"): "--rl.is_high must be a finite number above --rl.is_low (0.0); "
        "got -1.0.",
        ("--rl.is_low", "1.5", "--rl.is_high", "1.5"): "--rl.is_high must be a finite number "
        "above --rl.is_low (1.5); got 1.5.",
    }
    for argv, message in cases.items():
        assert main(["rl", "--recipe", "rl_debug", *argv, "--print-config"]) == 2, argv
        assert capsys.readouterr().err == f"error: {message}\n", argv


def test_an_unknown_init_recipe_names_its_option(capsys, tmp_path) -> None:
    code = main(["rl", "--recipe", "rl_debug", "--rl.init_recipes", '["sft_tny"]',
                 "--output.dir", str(tmp_path / "run")])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --rl.init_recipes: Unknown recipe 'sft_tny'. Did you mean"), err


def test_a_missing_start_model_is_named_before_any_recipe_runs(capsys, tmp_path) -> None:
    """rl_debug's init recipes build outputs/sft_tiny/hf, which cannot stand in for another
    path: the error names the user's path (not the recipe's tokenizer) and nothing trains."""
    missing = tmp_path / "MISSING"
    code = main(["rl", "--recipe", "rl_debug", "--checkpoint.initial_load_hf", str(missing),
                 "--output.dir", str(tmp_path / "run")])  # fmt: skip
    assert code == 2
    captured = capsys.readouterr()
    assert captured.err == (
        f"error: --checkpoint.initial_load_hf {missing} does not exist (--rl.init_recipes build "
        "outputs/sft_tiny/hf, not it); point it at a Hugging Face model folder.\n"
    )
    assert "training recipe" not in captured.out
    assert not (tmp_path / "run").exists()
    code = main(["rl", "--recipe", "rl_debug", "--checkpoint.initial_load_hf", str(missing),
                 "--rl.init_recipes", "[]", "--output.dir", str(tmp_path / "run")])  # fmt: skip
    assert code == 2
    assert capsys.readouterr().err == (
        f"error: --checkpoint.initial_load_hf {missing} does not exist; point it at a Hugging "
        "Face model folder.\n"
    )


def test_resume_with_another_task_or_prompt_count_is_refused(tmp_path, capsys) -> None:
    """The prompts are addressed by (task, seed, step, group): a resume that changes the task,
    the seed or the prompts per step would train on other prompts than the run it continues.
    A new group size draws more rollouts of the same prompts and resumes."""

    def rl(steps: int, *extra: str) -> int:
        return main(["rl", *BASE, "--output.dir", str(tmp_path), "--training.steps", str(steps),
                     "--checkpoint.interval", "1", "--training.device", "cpu", *extra])  # fmt: skip

    assert rl(1) == 0
    capsys.readouterr()
    assert rl(2, "--checkpoint.resume", "true", "--rl.task", "sort") == 1
    err = capsys.readouterr().err
    assert "continues another run: --rl.task was" in err and "is 'sort' now" in err, err
    assert rl(2, "--checkpoint.resume", "true", "--rl.group_size", "2") == 0


def test_turning_on_the_kl_term_at_a_resume_names_the_missing_reference(tmp_path, capsys):
    """A run saved with --rl.kl_coef 0 has no reference model in its checkpoint: the error
    says so (not that the reference has another shape) and how to resume without it."""
    args = ["rl", *BASE, "--output.dir", str(tmp_path), "--checkpoint.interval", "1",
            "--training.device", "cpu"]  # fmt: skip
    assert main([*args, "--training.steps", "1"]) == 0
    capsys.readouterr()
    resume = [*args, "--training.steps", "2", "--checkpoint.resume", "true"]
    assert main([*resume, "--rl.kl_coef", "0.1"]) == 1
    err = capsys.readouterr().err
    assert "The checkpoint holds no reference state: the run that saved it had none" in err, err
    assert main([*resume, "--rl.kl_coef", "0.1",
                 "--checkpoint.exclude_from_loading", '["reference"]']) == 0  # fmt: skip


def _never_right(reply: str, answer: object) -> Check:
    return Check(format_ok=True, correct=False)


def _long_sometimes(rng) -> Prompt:
    words = 40 if rng.randrange(4) == 0 else 1  # a prompt of 53 chat tokens, or a short one
    return Prompt("Say " + "word " * words, meta={"task": "long_sometimes"})


if "never_right" not in TASKS:
    register_task("never_right", lambda rng: Prompt(f"Say a word ({rng.randrange(100)}).",
                                                   meta={"task": "never_right"}), _never_right)  # fmt: skip
    register_task("long_sometimes", _long_sometimes, _never_right)


def rl(out, *extra: str) -> int:
    return main(["rl", *BASE, "--output.dir", str(out), "--training.device", "cpu", *extra])


def errors(err: str) -> str:
    """``err`` without the warnings about options given twice (BASE's, then the test's)."""
    return "".join(line for line in err.splitlines(keepends=True)
                   if not line.startswith("warning: ") or "is given twice" not in line)  # fmt: skip


def test_an_output_dir_that_cannot_be_written_is_refused_as_train_refuses_it(tmp_path, capsys):
    """The same one line and exit 2 as `torchloom train`, before anything is built (it was a
    FileExistsError / NotADirectoryError traceback)."""
    file = tmp_path / "file"
    file.write_text("x")
    assert rl(file) == 2
    assert capsys.readouterr().err == (
        f"error: --output.dir {file} is a file, not a folder; choose another path.\n"
    )
    assert rl(file / "run") == 2
    assert capsys.readouterr().err == (
        f"error: Cannot create {file / 'run'}: {file} is a file, not a folder; choose another "
        "path.\n"
    )


def test_a_run_that_never_updated_the_policy_fails_with_the_fixes(tmp_path, capsys):
    """Every reply is wrong: every group's rewards are equal, dynamic sampling drops them all
    and no step updates the policy. The run says so in one line and exits 1, as train does
    when every step was skipped; nothing is exported (it said "done: 2 policy updates")."""
    out = tmp_path / "run"
    assert rl(out, "--rl.task", "never_right", "--training.steps", "2",
              "--checkpoint.save_final_model", "true") == 1  # fmt: skip
    captured = capsys.readouterr()
    assert errors(captured.err) == (
        "error: Nothing was trained: none of the 2 steps updated the policy (2 kept no group: "
        "each group's rollouts all got the same reward, and --rl.filter_zero_variance drops "
        "such groups). Give the groups rewards that differ: --rl.format_reward 0.1 if the task "
        "checks a format, more refill rounds (--rl.max_refill_rounds) or a larger "
        "--rl.group_size, or a stronger starting model (--checkpoint.initial_load_hf); or "
        "--rl.filter_zero_variance false to update on every group.\n"
    )
    assert "done:" not in captured.out and not (out / "model").exists()
    assert [r["updates"] for r in records(out)] == [0, 0]


def test_steps_that_trained_nothing_are_counted_and_not_called_updates(
    tmp_path, capsys, monkeypatch
):
    """Step 1's groups are all dropped (as dynamic sampling drops equal-reward groups), step 2
    trains: the run says 1 of 2 steps trained nothing, and the done line counts 1 update."""
    from torchloom.rl import loop

    original, calls = loop.collect, []

    def collect(*args, **kwargs):
        batch = original(*args, **kwargs)
        calls.append(1)
        if len(calls) == 1:
            batch.rollouts = []
        return batch

    monkeypatch.setattr(loop, "collect", collect)
    assert rl(tmp_path / "run", "--training.steps", "2") == 0
    out = capsys.readouterr().out
    assert "1 of 2 steps trained nothing (1 kept no group: each group's rollouts all got" in out
    assert "done: 1 policy updates," in out
    assert [r["updates"] > 0 for r in records(tmp_path / "run")] == [False, True]


def test_a_context_too_short_names_seq_len_before_the_folder_is_written(tmp_path, capsys):
    """The rollouts' context is --training.seq_len (64 here), not the model's (512): the error
    names it and the numbers, before any file is written, so the corrected run in the same
    folder starts (it was refused: the failed run had written config.json)."""
    out = tmp_path / "run"
    assert rl(out, "--rl.max_new_tokens", "60") == 2
    assert errors(capsys.readouterr().err) == (
        "error: A prompt of the first step of 18 tokens + --rl.max_new_tokens 60 = 78 tokens "
        "exceed --training.seq_len 64, the context rollouts and evaluations are generated in; "
        "raise --training.seq_len to 78 or more (up to the model's context), or lower "
        "--rl.max_new_tokens to 46 or less.\n"
    )
    evaluating = ["--rl.task", "letters", "--eval.every", "1", "--eval.problems", "2"]
    assert rl(out, *evaluating, "--eval.max_new_tokens", "60") == 2
    assert errors(capsys.readouterr().err) == (
        "error: A held-out evaluation prompt of 24 tokens + --eval.max_new_tokens 60 = 84 "
        "tokens exceed --training.seq_len 64, the context rollouts and evaluations are "
        "generated in; raise --training.seq_len to 84 or more (up to the model's context), or "
        "lower --eval.max_new_tokens to 40 or less.\n"
    )
    assert not out.exists()
    assert rl(out, "--training.steps", "1") == 0


def test_a_later_prompt_too_long_for_the_context_names_seq_len(tmp_path, capsys):
    """A prompt of a later step (not checked up front) refused by the generator: the error
    names the step, --training.seq_len and --rl.max_new_tokens (not "the model's context")."""
    seed = next(s for s in range(100)  # step 1's prompts short, one of step 2's long
                if [len(TASKS["long_sometimes"](seed=s).prompt(prompt_index(step, j)).text) > 20
                    for step in (1, 2) for j in range(2)] == [False, False, True, False])  # fmt: skip
    assert rl(tmp_path / "run", "--rl.task", "long_sometimes", "--training.seed", str(seed),
              "--rl.filter_zero_variance", "false", "--rl.max_new_tokens", "16",
              "--training.steps", "2") == 2  # fmt: skip
    assert errors(capsys.readouterr().err) == (
        "error: A prompt of step 2 of 53 tokens + --rl.max_new_tokens 16 = 69 tokens exceed "
        "--training.seq_len 64, the context rollouts and evaluations are generated in; raise "
        "--training.seq_len to 69 or more (up to the model's context), or lower "
        "--rl.max_new_tokens to 11 or less.\n"
    )


def test_ctrl_c_says_where_it_stopped_and_how_to_resume(tmp_path, capsys, monkeypatch):
    """As `torchloom train` says it: the step, the last complete checkpoint and the exact
    command that resumes (it said only "rl was interrupted (Ctrl-C)."); that command finishes
    the run. The command is built from cmd_rl's own arguments, as train's, so main() called
    in-process gets it too (it was read from sys.argv)."""
    from torchloom.rl.loop import RLRunner

    original = RLRunner.update

    def update(self, batch):
        if self.step == 2:  # Ctrl-C during step 3's update
            raise KeyboardInterrupt
        return original(self, batch)

    out = tmp_path / "run"
    args = ["rl", *BASE, "--output.dir", str(out), "--training.device", "cpu",
            "--training.steps", "4", "--checkpoint.interval", "2"]  # fmt: skip
    with monkeypatch.context() as patch:
        patch.setattr(RLRunner, "update", update)
        assert main(args) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(
        f"error: Interrupted at step 2 of 4; the last complete checkpoint is "
        f"{out / 'checkpoints/step-2'}. Resume with: torchloom rl --recipe rl_debug "
    ), err
    command = shlex.split(err.split("Resume with: ")[1])
    assert command == ["torchloom", *args, "--checkpoint.resume", "true"]
    assert main(command[1:]) == 0
    assert f"resumed from {out / 'checkpoints/step-2'}" in capsys.readouterr().out


def test_help_lists_every_built_in_task():
    """--rl.task's help names each task torchloom ships, and no other (it listed four of
    seven, and not rl_debug's own default, letters)."""
    doc = field_docs(RLConfig)["task"]
    named = set(re.findall(r"\b[a-z]+(?:_[a-z]+)*\b", doc)) & {*BUILTIN_TASKS, "even_length",
                                                                 "never_right", "times"}  # fmt: skip
    assert named == set(BUILTIN_TASKS), named
    assert set(BUILTIN_TASKS) == {*TASKS, "python_tool"} - {"even_length", "never_right",
                                                            "long_sometimes"}  # fmt: skip


def test_the_resume_command_drops_the_resume_options_it_adds():
    from torchloom.train.run import resume_command

    argv = ["--checkpoint.resume", "true", "--checkpoint.load_step=2", "--rl.kl_coef", "-0"]
    assert resume_command("rl", argv) == "torchloom rl --rl.kl_coef -0 --checkpoint.resume true"


def test_options_rl_does_not_read_are_refused_and_left_out_of_its_help(capsys):
    """Train's options that rl never reads were accepted and ignored (a missing data file went
    unnoticed); or validated for a fix that does not apply (--data.format chat)."""
    assert main(["rl", "--training.global_batch_size", "64", "--data.sources",
                 '["/nonexistent.txt"]']) == 2  # fmt: skip
    assert capsys.readouterr().err == (
        "error: torchloom rl does not read --training.global_batch_size (a policy update trains "
        "on --rl.prompts_per_step x --rl.group_size rollouts) or --data.sources (its prompts "
        "come from --rl.task); leave them out.\n"
    )
    assert main(["rl", "--data.format", "chat"]) == 2
    assert capsys.readouterr().err == (
        "error: torchloom rl does not read --data.format (its prompts come from --rl.task); "
        "leave it out.\n"
    )
    # Off, or the recipe's own value: nothing asked for, so one list of flags serves train and rl.
    assert main(["rl", "--print-config", "--training.val_interval", "0", "--training.sample_tokens",
                 "0", "--training.global_batch_size", "16", "--data.shuffle", "false"]) == 0  # fmt: skip
    assert "does not read" not in capsys.readouterr().err
    assert main(["rl", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--data.tokenizer" in text and "--rl.micro_batch_size" in text
    for hidden in ("--data.sources", "--training.micro_batch_size", "--compile.backend"):
        assert hidden not in text, hidden


def test_rl_options_for_a_feature_that_is_off_are_named(capsys):
    """As train's are: accepted (a later run may turn the feature on), with a warning."""
    assert main(["rl", "--print-config", "--rl.filter_zero_variance", "false",
                 "--rl.max_refill_rounds", "5", "--rl.sync_bucket_mb", "64"]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "warning: --rl.max_refill_rounds 5 has no effect until --rl.filter_zero_variance " in err
    assert "warning: --rl.sync_bucket_mb 64 has no effect until --rl.placement disaggregated" in err


def test_rl_traces_the_steps_profiling_names(tmp_path, capsys):
    """--profiling.steps traces an RL step (generation included), as it traces a train step;
    rl wrote no trace before."""
    assert rl(tmp_path / "run", "--training.steps", "2", "--profiling.steps", "[2]") == 0
    trace = tmp_path / "run" / "profile" / "trace_rank0_steps2-2.json"
    assert f"wrote {trace}" in capsys.readouterr().out
    names = {event.get("name") for event in json.loads(trace.read_text())["traceEvents"]}
    assert "aten::mm" in names or "aten::addmm" in names or "aten::linear" in names


def test_profiling_options_are_checked_before_the_run_writes(tmp_path, capsys):
    """A memory snapshot on the CPU was refused after config.json and metrics.jsonl existed, so
    the corrected command met 'already holds a run'; the run folder is left unmade."""
    flags = ["--training.steps", "2", "--profiling.steps", "[1]"]
    assert rl(tmp_path / "run", *flags, "--profiling.memory_snapshot", "true") == 2
    assert "--profiling.memory_snapshot records the CUDA allocator" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_generator_slots_that_cannot_fit_are_refused_before_anything_is_written(tmp_path, capsys):
    """The cache is allocated up front: a slot count whose cache exceeds the memory available
    got the process OOM-killed without a word."""
    assert rl(tmp_path / "run", "--rl.generator_slots", "100000000") == 2
    err = errors(capsys.readouterr().err)
    assert re.fullmatch(
        r"error: --rl.generator_slots 100000000: its cache of that many rollouts of "
        r"--training.seq_len 64 tokens needs [\d.]+ GiB, but the cpu device has [\d.]+ GiB "
        r"available; lower --rl.generator_slots \(a step's first round generates 8 rollouts\) "
        r"or --training.seq_len.\n", err), err  # fmt: skip
    assert not (tmp_path / "run").exists()
