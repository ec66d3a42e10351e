"""`torchloom rl` shares train's config system: help, print-config, overrides, refusals."""

from __future__ import annotations

import json

from rl.common import BASE  # tests/ is on sys.path (rootdir-relative imports)
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
