"""`torchloom rl` shares train's config system: help, print-config, overrides, refusals."""

from __future__ import annotations

import json

from tests.rl.common import BASE
from torchloom.cli import main


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
