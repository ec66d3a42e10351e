"""TorchTitan's own trainer on the shapes torchloom's benchmarks measure, for a side-by-side run
on the same machine (TorchTitan is not a dependency: install torchtitan==0.2.2 and its
requirements first).

    # benchmarks/train_moe.py's dsv3-16B-6L (the default)
    python benchmarks/torchtitan_anchor.py --workdir /tmp/tt -- --compile.enable \\
        --training.local_batch_size 4 --training.seq_len 4096 --training.steps 12
    # the llama3 1B shape (Llama-3.2-1B; TorchTitan 0.2.2 has no 1B flavor, this registers it)
    python benchmarks/torchtitan_anchor.py --model llama3 --flavor 1B --workdir /tmp/tt -- \\
        --compile.enable --training.local_batch_size 8 --training.seq_len 4096

benchmarks/vs_torchtitan.py runs this and `torchloom train` on the same inputs in one command.
It writes the inputs TorchTitan's trainer reads and nothing downloads them: a word-level
tokenizer of ``--vocab`` words (``tokenizer.json``, ``tokenizer_config.json``; default the
flavor's vocabulary) and a folder of long documents of uniformly random words, so the token
stream is random ids over the vocabulary (as torchloom's benchmarks' random tokens) and every
4096-token window lies inside one document (block-causal attention is then plain causal
attention, as torchloom's SDPA). Then it runs ``torchtitan.train.main`` with the arguments
after ``--``; TorchTitan's log reports tokens/s ("tps"), TFLOP/s, MFU and memory per step.

- ``--model deepseek_v3`` (flavor 16B, DeepSeek-V2-Lite's shape) is cut to ``--layers`` layers
  (1 dense + the rest MoE).
- ``--model llama3``: flavor 8B as TorchTitan defines it, or 1B, registered here with Llama
  3.2 1B's shape (dim 2048, 16 layers, 32 heads, 8 kv heads, FFN 8192, RoPE theta 500000).
  TorchTitan's llama3 has its own output head, where Llama 3.2 1B ties it to the embedding:
  run torchloom with ``--model.overrides '{"tie_embeddings": false}'`` for the same parameters.
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
    parser.add_argument("--model", default="deepseek_v3", choices=["deepseek_v3", "llama3"])
    parser.add_argument("--flavor", default=None, help="default: 16B (deepseek_v3), 1B (llama3)")
    parser.add_argument("--layers", type=int, default=6, help="deepseek_v3's layers")
    parser.add_argument("--vocab", type=int, default=None,
                        help="default: 102400 (deepseek_v3), 128256 (llama3)")  # fmt: skip
    parser.add_argument("--docs", type=int, default=64)
    parser.add_argument("--words", type=int, default=20000)
    args, rest = parser.parse_known_args()
    rest = [a for a in rest if a != "--"]
    flavor = args.flavor or {"deepseek_v3": "16B", "llama3": "1B"}[args.model]
    args.vocab = args.vocab or {"deepseek_v3": 102400, "llama3": 128256}[args.model]
    write_tokenizer(args.workdir / "tokenizer", args.vocab)
    write_documents(args.workdir / "data", args.vocab, args.docs, args.words)

    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533")):  # fmt: skip
        os.environ.setdefault(name, value)  # one process without torchrun
    # Before importing TorchTitan: its argument parser takes sys.argv as a default at import.
    sys.argv = [sys.argv[0], "--model.name", args.model, "--model.flavor", flavor,
                "--model.hf_assets_path", str(args.workdir / "tokenizer"),
                "--training.dataset", "c4_test",
                "--training.dataset_path", str(args.workdir / "data"), *rest]  # fmt: skip
    from torchtitan.train import Trainer
    from torchtitan.train import main as torchtitan_main

    if args.model == "deepseek_v3":
        from torchtitan.models import deepseek_v3

        deepseek_v3.deepseekv3_args[flavor].n_layers = args.layers
    else:
        from torchtitan.models import llama3

        llama3.llama3_args.setdefault("1B", llama3.TransformerModelArgs(
            dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5,
            multiple_of=256, rope_theta=500000, vocab_size=args.vocab,
        ))  # fmt: skip
        llama3.llama3_args[flavor].vocab_size = args.vocab
    torchtitan_main(Trainer)


if __name__ == "__main__":
    main()
