"""Held-out exact-match accuracy of qwen3_vl_debug after SFT on builtin:shapes_chat: the
questions of builtin:shapes_chat_test asked with their pictures, greedy generation through
torchloom's generator, the whole reply compared with the answer sentence, per question type
against chance (1 / the number of possible answers) and against the untrained model.

    python benchmarks/vl_eval.py --steps 200 --json vl.json
    python benchmarks/vl_eval.py --steps 200 --recipe qwen3_vl_moe_debug -- --optimizer.lr 2e-3

Arguments after ``--`` go to the recipe (torchloom train's overrides).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

from torch import nn

from torchloom.cli import resolve_job
from torchloom.data.cache import resolve_cache_dir
from torchloom.data.multimodal import resolve_image_processing
from torchloom.data.shapes_chat import COLOURS, SHAPES, ensure_shapes_chat_test
from torchloom.generate.engine import Generator, Request, SamplingParams
from torchloom.generate.run import image_prompt
from torchloom.train.trainer import Trainer

# Question type: (how its question starts, how many answers it has).
TYPES = {
    "colour": ("What colour is", len(COLOURS)),
    "shape": ("Which shape is", len(SHAPES)),
    "count": ("How many", 5),  # 1..5 of one shape in one picture
    "count_two": ("How many", 6),  # 0..3 + 1..3 in two pictures: 1..6
}


def question_type(question: str, images: int) -> str:
    if question.startswith(TYPES["colour"][0]):
        return "colour"
    if question.startswith(TYPES["shape"][0]):
        return "shape"
    return "count_two" if images == 2 else "count"


def evaluate(model: nn.Module, trainer: Trainer, limit: int, slots: int) -> dict[str, Any]:
    """Exact-match accuracy per question type on the first ``limit`` held-out samples."""
    job, tokenizer = trainer.job, trainer.tokenizer
    path = ensure_shapes_chat_test(resolve_cache_dir(job.data.cache_dir))
    processing = resolve_image_processing(job.data, tokenizer)
    lines = path.read_text().splitlines()[:limit]
    requests, answers, kinds = [], [], []
    stop = tokenizer.stop_ids(True)
    for number, line in enumerate(lines, 1):
        messages = json.loads(line)["messages"]
        prompt, reply = messages[:-1], messages[-1]["content"]
        ids, media = image_prompt(prompt, f"{path}:{number}", path.parent, tokenizer, processing)
        params = SamplingParams(max_new_tokens=24, temperature=0.0, stop_ids=stop)
        requests.append(Request(ids, params, media=media))
        answers.append(reply)
        parts = prompt[0]["content"]
        question = next(p["text"] for p in parts if p["type"] == "text")
        kinds.append(question_type(question, sum(p["type"] == "image" for p in parts)))
    longest = max(len(r.prompt_ids) for r in requests) + 24
    was_training = model.training
    model.eval()
    completions = Generator(model, max_batch=slots, max_len=longest).generate(requests)
    model.train(was_training)
    right, total = Counter(), Counter(kinds)
    shown = []
    for completion, answer, kind in zip(completions, answers, kinds, strict=True):
        tokens = [t for t in completion.tokens if t not in stop]
        text = tokenizer.decode(tokens).strip()
        right[kind] += text == answer
        if len(shown) < 4:
            shown.append({"answer": answer, "reply": text})
    per_type = {
        kind: {"n": total[kind], "accuracy": right[kind] / total[kind],
               "chance": 1 / TYPES[kind][1]}
        for kind in TYPES if total[kind]
    }  # fmt: skip
    chance = sum(1 / TYPES[k][1] for k in kinds) / len(kinds)
    return {"accuracy": sum(right.values()) / len(kinds), "chance": chance, "n": len(kinds),
            "per_type": per_type, "examples": shown}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="qwen3_vl_debug")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--samples", type=int, default=200, help="held-out questions (<= 200)")
    parser.add_argument("--slots", type=int, default=32, help="requests decoded at once")
    parser.add_argument("--output", default="outputs/vl_eval")
    parser.add_argument("--json", type=Path, help="write the numbers here")
    parser.add_argument("overrides", nargs="*", help="after --: the recipe's overrides")
    args = parser.parse_args()
    argv = ["--recipe", args.recipe, "--training.steps", str(args.steps), "--output.dir",
            args.output, "--metrics.tensorboard", "false", "--checkpoint.save_final_model",
            "false", *args.overrides]  # fmt: skip
    _, job = resolve_job(argv)
    trainer = Trainer(job)
    start = time.perf_counter()
    untrained = evaluate(trainer.model, trainer, args.samples, args.slots)
    print(f"untrained: {untrained['accuracy']:.3f} (chance {untrained['chance']:.3f})")
    result = trainer.train()
    seconds = time.perf_counter() - start
    trained = evaluate(trainer.model, trainer, args.samples, args.slots)
    numbers = {
        "recipe": args.recipe, "steps": result.steps, "loss": [result.first_loss, result.last_loss],
        "val_loss": [result.val_loss_before, result.val_loss_after], "seconds": seconds,
        "untrained": untrained, "trained": trained,
    }  # fmt: skip
    for name in ("untrained", "trained"):
        r = numbers[name]
        types = "  ".join(f"{k} {v['accuracy']:.2f}/{v['chance']:.2f} (n={v['n']})"
                          for k, v in r["per_type"].items())  # fmt: skip
        print(f"{name}: exact match {r['accuracy']:.3f} vs chance {r['chance']:.3f}; {types}")
    print("examples:", trained["examples"])
    if args.json:
        args.json.write_text(json.dumps(numbers, indent=2))


if __name__ == "__main__":
    main()
