"""The checkpoint's RNG part: a resumed run continues torch's global random stream exactly where
the uninterrupted run had it at the save."""

import shutil
from pathlib import Path

import torch

from torchloom.cli import resolve_job
from torchloom.train.trainer import Trainer

COMMON = ["--recipe", "debug", "--metrics.tensorboard", "false", "--training.sample_tokens", "0",
          "--training.val_sequences", "8", "--checkpoint.save_final_model", "false",
          "--training.device", "cpu", "--training.steps", "2", "--checkpoint.interval", "1"]  # fmt: skip


def _trainer(output_dir: Path, *flags: str) -> Trainer:
    return Trainer(resolve_job([*COMMON, "--output.dir", str(output_dir), *flags])[1])


def test_resume_restores_the_global_rng(tmp_path):
    full = _trainer(tmp_path / "full")  # seeds torch's global generator with --training.seed
    torch.manual_seed(4321)  # a stream that seeding alone does not give
    torch.rand(5)
    full.train()  # saves at steps 1 and 2
    after_full = torch.rand(6)

    # Resume a copy of step 1: the resumed run repeats step 2 and its save, so it ends
    # with the uninterrupted run's stream iff loading step 1 restored the one saved there.
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "full/checkpoints/step-1", resumed_dir / "checkpoints/step-1")
    resumed = _trainer(resumed_dir, "--checkpoint.resume", "true")
    resumed.train()
    assert resumed.checkpointer.loaded_step == 1
    after_resumed = torch.rand(6)
    print(f"drawn after the uninterrupted run {after_full.tolist()}\n"
          f"drawn after the resumed run       {after_resumed.tolist()}")  # fmt: skip
    assert torch.equal(after_resumed, after_full), "the resumed run has another random stream"
