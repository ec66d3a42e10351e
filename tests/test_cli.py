import json
import os
import subprocess
import sys

from torchloom.cli import main


def test_recipes_lists_one_line_each(capsys):
    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("debug ") for line in lines)
    assert any("(default)" in line for line in lines)
    assert main(["recipes", "--foo"]) == 2
    assert "torchloom recipes takes no arguments (got --foo)" in capsys.readouterr().err


def test_typo_in_a_field_is_refused_with_a_suggestion(capsys):
    assert main(["train", "--recipe", "debug", "--trainig.steps", "20"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "Unknown option --trainig.steps" in err and "--training.steps" in err


def test_ill_typed_value_and_unknown_recipe(capsys):
    assert main(["train", "--recipe", "debug", "--training.steps", "ten"]) == 2
    assert "--training.steps expects an integer" in capsys.readouterr().err
    assert main(["train", "--recipe", "debgu"]) == 2
    assert "Did you mean 'debug'" in capsys.readouterr().err
    assert main(["trian"]) == 2
    assert "Did you mean 'train'" in capsys.readouterr().err


def test_print_config_and_help(capsys):
    assert main(["train", "--recipe", "debug", "--training.steps", "7", "--print-config"]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config["recipe"] == "debug" and config["training"]["steps"] == 7
    # A model override the run would refuse is refused here too, not printed as if valid.
    argv = ["train", "--recipe", "debug", "--print-config", "--model.overrides", '{"num_layer": 3}']
    assert main(argv) == 2
    assert "Unknown model override 'num_layer'" in capsys.readouterr().err
    assert main(["train", "--recipe", "debug", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--training.global_batch_size int" in text and "Optimizer steps to run." in text


def test_train_command_end_to_end(tmp_path):
    """The documented check: a 20-step debug run writes metrics.jsonl and config.json."""
    out = tmp_path / "D"
    cmd = [sys.executable, "-m", "torchloom", "train", "--recipe", "debug",
           "--training.steps", "20", "--output.dir", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 21))
    assert json.loads((out / "config.json").read_text())["training"]["steps"] == 20
    assert "sample:" in proc.stdout and "done: 20 steps" in proc.stdout


def test_plot_help_is_help_not_a_folder(capsys):
    assert main(["plot", "--help"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("usage: torchloom plot OUTPUT_DIR") and captured.err == ""


def test_plot_names_an_unknown_option_and_takes_the_metrics_file(tmp_path, capsys):
    records = [{"step": s, "loss": 3.0 / s, "tps": 100.0} for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["plot", str(tmp_path), "--out", "x.png"]) == 2
    assert "Unknown option --out for plot" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "metrics.jsonl")]) == 0  # its folder is meant
    assert (tmp_path / "metrics.png").is_file()
