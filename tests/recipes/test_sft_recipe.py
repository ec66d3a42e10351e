"""The sft_tiny recipe end to end: the assistant-token loss falls, from scratch and from a
Hugging Face folder exported by a pre-training run, and the export carries the chat template."""

from __future__ import annotations

import json
from pathlib import Path

from torchloom.cli import resolve_job
from torchloom.train.trainer import Trainer

QUICK = ["--metrics.tensorboard", "false", "--training.val_interval", "0",
         "--checkpoint.save_final_model", "false"]  # fmt: skip


def train(*argv: str):
    _, job = resolve_job(list(argv))
    trainer = Trainer(job)
    return trainer, trainer.train()


def val_losses(output_dir: Path) -> list[float]:
    records = map(json.loads, (output_dir / "metrics.jsonl").read_text().splitlines())
    return [r["val_loss"] for r in records if "val_loss" in r]


def test_sft_from_scratch_learns_the_assistant_answers(tmp_path: Path) -> None:
    trainer, result = train(
        "--recipe", "sft_tiny", "--checkpoint.initial_load_hf", "", "--checkpoint.export_hf",
        "false", "--data.tokenizer", "builtin:stdlib_bpe", "--training.steps", "40",
        "--training.seq_len", "128", "--training.global_batch_size", "8", "--optimizer.lr",
        "3e-3", "--output.dir", str(tmp_path / "sft"), *QUICK,
    )  # fmt: skip
    assert trainer.job.data.format == "chat"
    print(
        f"assistant-token loss {result.first_loss:.3f} -> {result.last_loss:.3f}, "
        f"val {result.val_loss_before:.3f} -> {result.val_loss_after:.3f}"
    )
    assert result.last_loss < result.first_loss - 3.0
    assert result.val_loss_after < result.val_loss_before - 3.0


def test_sft_from_an_exported_pretraining_run(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    pretrain = tmp_path / "pretrain"
    train("--recipe", "debug", "--training.steps", "10", "--checkpoint.export_hf", "true",
          "--output.dir", str(pretrain), "--training.sample_tokens", "0", *QUICK)  # fmt: skip
    hf_dir = pretrain / "hf"
    _, result = train(
        "--recipe", "sft_tiny", "--checkpoint.initial_load_hf", str(hf_dir), "--data.tokenizer",
        str(hf_dir), "--training.steps", "12", "--training.seq_len", "128",
        "--training.global_batch_size", "8", "--optimizer.lr", "3e-3", "--output.dir",
        str(tmp_path / "sft"), *QUICK,
    )  # fmt: skip
    print(f"assistant-token loss {result.first_loss:.3f} -> {result.last_loss:.3f}")
    assert result.last_loss < result.first_loss - 1.0
    assert result.val_loss_after < result.val_loss_before - 1.0
    # The fine-tuned export renders chats like its tokenizer did: a working chat template.
    theirs = AutoTokenizer.from_pretrained(tmp_path / "sft" / "hf")
    prompt = theirs.apply_chat_template(
        [{"role": "user", "content": "Add 2 and 3."}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nAdd 2 and 3.<|im_end|>\n<|im_start|>assistant\n"
