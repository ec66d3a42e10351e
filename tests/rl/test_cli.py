"""`torchloom rl` shares train's config system: help, print-config, overrides, refusals."""

from __future__ import annotations

import json

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
