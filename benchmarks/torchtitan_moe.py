"""TorchTitan's own trainer on benchmarks/train_moe.py's dsv3-16B-6L shape, for a side-by-side
run on the same machine (TorchTitan is not a dependency: install torchtitan==0.2.2 and its
requirements first).

    python benchmarks/torchtitan_moe.py --workdir /tmp/tt -- --compile.enable \\
        --training.local_batch_size 4 --training.seq_len 4096 --training.steps 12

It writes the inputs TorchTitan's trainer reads and nothing downloads them: a word-level
tokenizer of ``--vocab`` words (``tokenizer.json``, ``tokenizer_config.json``) and a folder of
long documents of uniformly random words, so the token stream is random ids over the
vocabulary (as train_moe.py's random tokens) and every 4096-token window lies inside one
document (TorchTitan's 16B flavor uses block-causal FlexAttention, which is then plain causal
attention, as train_moe.py's SDPA). Then it shortens the "16B" flavor (DeepSeek-V2-Lite's
shape) to ``--layers`` layers (1 dense + the rest MoE) and runs ``torchtitan.train.main``
with the arguments after ``--``; TorchTitan's log reports tokens/s ("tps"), TFLOP/s, MFU and
memory per step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path


def write_tokenizer(folder: Path, vocab: int) -> None:
    """A whitespace word-level tokenizer: ids 0..vocab-3 are the words w0.., then BOS, EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(vocab - 2)}
    words |= {"<bos>": vocab - 2, "<eos>": vocab - 1}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<eos>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def write_documents(folder: Path, vocab: int, docs: int, words: int) -> None:
    """``docs`` JSON-lines documents of ``words`` uniformly random words each."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    with open(folder / "train.jsonl", "w") as f:
        for _ in range(docs):
            text = " ".join(f"w{rng.randrange(vocab - 2)}" for _ in range(words))
            f.write(json.dumps({"text": text}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=102400)
    parser.add_argument("--docs", type=int, default=64)
    parser.add_argument("--words", type=int, default=20000)
    args, rest = parser.parse_known_args()
    rest = [a for a in rest if a != "--"]
    write_tokenizer(args.workdir / "tokenizer", args.vocab)
    write_documents(args.workdir / "data", args.vocab, args.docs, args.words)

    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533")):  # fmt: skip
        os.environ.setdefault(name, value)  # one process without torchrun
    # Before importing TorchTitan: its argument parser takes sys.argv as a default at import.
    sys.argv = [sys.argv[0], "--model.name", "deepseek_v3", "--model.flavor", "16B",
                "--model.hf_assets_path", str(args.workdir / "tokenizer"),
                "--training.dataset", "c4_test",
                "--training.dataset_path", str(args.workdir / "data"), *rest]  # fmt: skip
    from torchtitan.models import deepseek_v3
    from torchtitan.train import Trainer
    from torchtitan.train import main as torchtitan_main

    deepseek_v3.deepseekv3_args["16B"].n_layers = args.layers
    torchtitan_main(Trainer)


if __name__ == "__main__":
    main()
