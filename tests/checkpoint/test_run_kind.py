"""A checkpoint folder is continued only by the command that saved it: `torchloom rl` does not
resume a `torchloom train` run's checkpoints, nor the other way round (their optimizer,
schedule and loader or rollout state belong to different loops), even with the part the other
run lacks excluded from loading. The error names the way to start from the weights instead."""

from __future__ import annotations

from tests.rl.common import BASE
from torchloom.cli import main

TRAIN = ["train", "--recipe", "debug", "--training.device", "cpu", "--training.global_batch_size",
         "2", "--training.val_sequences", "2", "--training.sample_tokens", "0",
         "--checkpoint.interval", "1", "--metrics.tensorboard", "false"]  # fmt: skip
RL = ["rl", *BASE, "--training.device", "cpu", "--checkpoint.interval", "1"]


def test_train_and_rl_do_not_resume_each_others_checkpoints(tmp_path, capsys) -> None:
    trained, reinforced = tmp_path / "train", tmp_path / "rl"
    assert main([*TRAIN, "--training.steps", "1", "--output.dir", str(trained)]) == 0
    assert main([*RL, "--training.steps", "1", "--output.dir", str(reinforced)]) == 0
    capsys.readouterr()
    resume = ["--training.steps", "2", "--checkpoint.resume", "true"]
    code = main([*RL, *resume, "--output.dir", str(trained),
                 "--checkpoint.exclude_from_loading", '["rollouts"]'])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1, err
    assert "was saved by `torchloom train`, and `torchloom rl` does not continue" in err, err
    assert "--checkpoint.initial_load_hf DIR" in err and err.count("\n") == 1, err
    code = main([*TRAIN, *resume, "--output.dir", str(reinforced),
                 "--checkpoint.exclude_from_loading", '["dataloader"]'])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1, err
    assert "was saved by `torchloom rl`, and `torchloom train` does not continue" in err, err
    # Each still resumes its own.
    assert main([*TRAIN, *resume, "--output.dir", str(trained)]) == 0
