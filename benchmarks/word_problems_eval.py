"""Held-out word-problem accuracy of a Hugging Face model folder: greedy pass@1 and sampled
pass@k through torchloom's generator (torchloom/rl/evaluate.py), plus the accuracy of always
giving the most common answer; JSON to --json.

    python benchmarks/word_problems_eval.py outputs/wp_sft_tiny/hf --problems 100 --k 8
    python benchmarks/word_problems_eval.py outputs/wp_sft/hf --device cuda --json wp.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from torchloom import from_hf
from torchloom.data.cache import resolve_cache_dir
from torchloom.data.tokenizer import load_tokenizer
from torchloom.generate.engine import Generator
from torchloom.rl.env import Check
from torchloom.rl.evaluate import evaluate
from torchloom.rl.word_problems import best_constant_accuracy, check_final_answer, held_out_problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hf_dir", help="a Hugging Face folder with its tokenizer (an export)")
    parser.add_argument("--problems", type=int, default=500, help="held-out problems (<= 1000)")
    parser.add_argument("--k", type=int, default=8, help="samples per problem for pass@k")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--slots", type=int, default=64, help="requests decoded at once")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the numbers here")
    parser.add_argument("--show", type=int, default=3, help="print this many greedy replies")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model = from_hf(args.hf_dir, device=args.device)
    tokenizer = load_tokenizer(args.hf_dir, resolve_cache_dir(), 0)
    prompts = held_out_problems(args.problems)
    context = max(len(tokenizer.encode_prompt(p.text, chat=True)) for p in prompts)
    generator = Generator(model, max_batch=args.slots, max_len=context + args.max_new_tokens)
    replies: list[str] = []

    def check(reply: str, answer: int) -> Check:
        replies.append(reply)  # the first len(prompts) are the greedy replies, in order
        return check_final_answer(reply, answer)

    start = time.perf_counter()
    metrics = evaluate(generator, tokenizer, prompts, check,
                       max_new_tokens=args.max_new_tokens, k=args.k,
                       temperature=args.temperature, seed=args.seed)  # fmt: skip
    answer, constant = best_constant_accuracy(prompts)
    report = {"model": args.hf_dir, "problems": args.problems, "k": args.k,
              "temperature": args.temperature, **metrics, "best_constant": constant,
              "best_constant_answer": answer, "seconds": time.perf_counter() - start}  # fmt: skip
    for prompt, reply in zip(prompts[: args.show], replies, strict=False):
        print(f"--- {prompt.text}\n{reply}\n(expected {prompt.answer})")
    width = max(map(len, report))
    for key, value in report.items():
        shown = f"{value:.4f}" if isinstance(value, float) else value
        print(f"{key:<{width}}  {shown}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
