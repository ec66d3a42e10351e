"""The streaming data loader keeps ahead of training: the data wait's share of the step, the
time to step 1 and the host memory while a model trains on a multi-GB parquet corpus.

    python benchmarks/data_stall.py                       # one H200: llama3 1B (fast settings), 3 GB
    python benchmarks/data_stall.py --small               # the CPU: debug flavor, 20 MB corpus
    python benchmarks/data_stall.py -- --training.micro_batch_size 4   # more `train` flags

The corpus is generated on the machine under --out/corpus (parquet shards of --shard-mb MB, one
"text" column, each row a document of 300 to 3000 words of lines drawn with a seeded RNG from
the builtin corpus, builtin:stdlib_docs), in parallel, once per size. Then `torchloom train`
streams it (--data.streaming true: tokenized and packed in the background, no tokenization pass
before step 1) in a subprocess whose resident memory, its children's included, is sampled every
0.5 s. From its metrics.jsonl: the time from launch to step 1, step 1's data wait, and over the
steps after --warmup the median tokens/s and step time, the data wait's share of the summed step
time and the longest data wait. Arguments after ``--`` go to `torchloom train`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from torchloom.data.cache import resolve_cache_dir
from torchloom.data.corpus import ensure_builtin_corpus
from torchloom.train.metrics import read_records

ROOT = Path(__file__).resolve().parents[1]
MIN_WORDS, MAX_WORDS = 300, 3000  # words per generated document
_LINES: np.ndarray  # the builtin corpus's lines, set in each generating process


def builtin_lines() -> list[str]:
    """The builtin corpus's lines of at least four words: prose, mostly."""
    path = ensure_builtin_corpus(resolve_cache_dir())
    docs = (json.loads(line)["text"] for line in path.read_text().splitlines())
    return [s for doc in docs for line in doc.splitlines() if len((s := line.strip()).split()) >= 4]


def _init_worker(lines: list[str]) -> None:
    global _LINES
    _LINES = np.array(lines, dtype=object)


def write_shard(path: Path, seed: int, text_bytes: int) -> int:
    """One parquet shard of about ``text_bytes`` bytes of text; returns its documents."""
    rng = np.random.default_rng(seed)
    line_bytes = np.array([len(s.encode()) + 1 for s in _LINES])
    line_words = np.array([len(s.split()) for s in _LINES])
    drawn = rng.integers(len(_LINES), size=int(1.1 * text_bytes / line_bytes.mean()) + 1)
    drawn = drawn[: np.searchsorted(np.cumsum(line_bytes[drawn]), text_bytes) + 1]
    # Cut the drawn lines into documents of MIN_WORDS to MAX_WORDS words.
    words = np.cumsum(line_words[drawn])
    lengths = rng.integers(MIN_WORDS, MAX_WORDS + 1, size=int(words[-1]) // MIN_WORDS + 1)
    cuts = np.unique(np.searchsorted(words, np.cumsum(lengths)) + 1)
    bounds = [0, *cuts[cuts < len(drawn)].tolist(), len(drawn)]
    docs = ["\n".join(_LINES[drawn[a:b]]) for a, b in itertools.pairwise(bounds)]
    table = pa.table({"text": pa.array(docs, type=pa.string())})
    pq.write_table(table, path, row_group_size=4096)
    return len(docs)


def ensure_corpus(folder: Path, gigabytes: float, shard_mb: int, seed: int) -> dict:
    """The corpus's manifest, generating the shards unless a corpus of this size is there."""
    manifest_path = folder / "manifest.json"
    wanted = {"corpus_gb": gigabytes, "shard_mb": shard_mb, "seed": seed}
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        if {k: manifest.get(k) for k in wanted} == wanted and all(
            (folder / name).exists() for name in manifest["shards"]
        ):
            print(f"corpus: reusing {folder} ({len(manifest['shards'])} shards)", flush=True)
            return manifest | {"generated_s": 0.0}
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.parquet"):
        old.unlink()
    total = int(gigabytes * 1e9)
    count = max(1, round(total / (shard_mb * 1e6)))
    names = [f"shard_{i:05d}.parquet" for i in range(count)]
    jobs = [(folder / name, seed + i, total // count) for i, name in enumerate(names)]
    start = time.perf_counter()
    lines = builtin_lines()
    with multiprocessing.Pool(min(count, os.cpu_count() or 1), _init_worker, (lines,)) as pool:
        documents = sum(pool.starmap(write_shard, jobs))
    manifest = wanted | {"shards": names, "text_bytes": total, "documents": documents}
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    seconds = time.perf_counter() - start
    print(f"corpus: {count} shards, {documents:,} documents, {total / 1e9:.2f} GB of text in "
          f"{seconds:.1f} s", flush=True)  # fmt: skip
    return manifest | {"generated_s": seconds}


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants (0 once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        rss = next(int(s.split()[1]) * 1024 for s in status.splitlines() if s.startswith("VmRSS:"))
        children = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            children += (task / "children").read_text().split()
    except (OSError, StopIteration):
        return 0
    return rss + sum(tree_rss(int(child)) for child in children)


def run_train(command: list[str], out: Path, timeout: float) -> dict:
    """``command`` in a subprocess, its memory sampled every 0.5 s; the RSS also when its first
    and its last step reach metrics.jsonl."""
    metrics, log = out / "metrics.jsonl", out.parent / "train.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    metrics.unlink(missing_ok=True)  # no steps of an earlier run read as this one's
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    record: dict = {"error": None, "log": str(log), "peak_rss": 0, "rss_first": None}
    launched = time.time()
    with log.open("w") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        logged = 0
        while proc.poll() is None:
            rss = tree_rss(proc.pid)
            record["peak_rss"] = max(record["peak_rss"], rss)
            steps = metrics.read_text().count('"tps"') if metrics.exists() else 0
            if steps > logged:
                logged = steps
                record["rss_first"] = record["rss_first"] or rss
                record["rss_last"] = rss
            if time.time() - launched > timeout:
                proc.kill()
                record["error"] = f"timed out after {timeout:.0f} s (see {log})"
            time.sleep(0.5)
    record["wall_s"] = time.time() - launched
    if proc.returncode and not record["error"]:
        lines = log.read_text().strip().splitlines()
        record["error"] = f"exit {proc.returncode}: " + " | ".join(lines[-3:])[-400:]
    record["steps"] = [r for r in read_records(metrics) if "tps" in r] if metrics.exists() else []
    record["launched"] = launched
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true",
                        help="the CPU check: 0.02 GB, debug flavor, seq 256, batch 2, 6 steps")  # fmt: skip
    parser.add_argument("--corpus-gb", type=float, default=3.0, help="GB of text to generate")
    parser.add_argument("--shard-mb", type=int, default=256, help="MB of text per parquet shard")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    parser.add_argument("--train-timeout", type=float, default=480, help="seconds for training")
    parser.add_argument("--out", type=Path, default=Path("outputs/data_stall"))
    parser.add_argument("--json", type=Path, default=Path("outputs/data_stall.json"))
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    # The 1B row's fast settings on one GPU (docs/performance.md), so the loader is timed at the
    # trainer's full speed (~65K tokens/s on an H200); later flags after `--` override them.
    shape = ["--model.flavor", "1B", "--training.seq_len", "4096", "--training.global_batch_size", "8",
             "--compile.enabled", "true", "--model.loss_impl", "chunked",
             "--optimizer.implementation", "triton"]  # fmt: skip
    if args.small:
        args.corpus_gb, args.steps, args.warmup = 0.02, 6, 2
        shape = ["--training.seq_len", "256", "--training.global_batch_size", "2",
                 "--training.device", "cpu"]  # fmt: skip
    corpus_dir = args.out.resolve() / "corpus"
    manifest = ensure_corpus(corpus_dir, args.corpus_gb, args.shard_mb, args.seed)
    shards = sorted(corpus_dir.glob("*.parquet"))
    corpus_bytes = sum(p.stat().st_size for p in shards)
    train_dir = args.out.resolve() / "train"
    command = [
        sys.executable, "-m", "torchloom", "train", "--recipe", "debug", *shape,
        "--data.streaming", "true", "--data.sources", json.dumps([str(corpus_dir)]),
        "--data.val_fraction", "0", "--data.format", "text", "--training.steps", str(args.steps),
        "--metrics.tensorboard", "false", "--metrics.progress_bar", "false",
        "--checkpoint.save_final_model", "false", "--training.sample_tokens", "0",
        "--output.dir", str(train_dir), "--output.overwrite", "true", *extra,
    ]  # fmt: skip
    print(f"train: {' '.join(command)}", flush=True)
    train = run_train(command, train_dir, args.train_timeout)
    steps = train.pop("steps")
    if train["error"]:
        print(f"train: {train['error']}", flush=True)
    timed = [r for r in steps if r["step"] > args.warmup] or steps[-1:]
    gib = 2**30
    report = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.small else "cpu",
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": " ".join([sys.executable, *sys.argv]), "train_command": command,
        "error": train["error"], "train_log": train["log"], "train_wall_s": train["wall_s"],
        "corpus_dir": str(corpus_dir), "corpus_shards": len(shards), "corpus_bytes": corpus_bytes,
        "corpus_text_bytes": manifest["text_bytes"], "corpus_documents": manifest["documents"],
        "corpus_generated_s": manifest["generated_s"], "steps": len(steps),
        "warmup": args.warmup, "timed_steps": [r["step"] for r in timed],
        "peak_rss_gib": train["peak_rss"] / gib,
        "rss_first_step_gib": (train["rss_first"] or 0) / gib,
        "rss_last_step_gib": train.get("rss_last", 0) / gib,
    }  # fmt: skip
    if timed:
        report |= {
            "launch_to_step1_s": steps[0]["time"] - train["launched"],
            "step1_data_wait_s": steps[0]["data_wait_s"],
            "tokens_per_s": statistics.median(r["tps"] for r in timed),
            "step_s": statistics.median(r["step_s"] for r in timed),
            "data_wait_share_pct": 100
            * sum(r["data_wait_s"] for r in timed)
            / sum(r["step_s"] for r in timed),
            "max_data_wait_s": max(r["data_wait_s"] for r in timed),
            "losses": [r["loss"] for r in steps],
        }
    rows = [
        (
            "corpus",
            f"{manifest['text_bytes'] / 1e9:.2f} GB of text, {corpus_bytes / 1e9:.2f} GB "
            f"on disk in {len(shards)} shards",
        ),
        ("corpus generated in", f"{manifest['generated_s']:.1f} s"),
        ("steps (timed)", f"{len(steps)} ({len(timed)})"),
    ]
    if timed:
        rows += [
            ("launch to step 1", f"{report['launch_to_step1_s']:.1f} s"),
            ("step 1 data wait", f"{report['step1_data_wait_s'] * 1e3:.1f} ms"),
            ("tokens/s (median)", f"{report['tokens_per_s']:,.0f}"),
            ("step time (median)", f"{report['step_s'] * 1e3:.1f} ms"),
            ("data wait share", f"{report['data_wait_share_pct']:.3f} %"),
            ("max data wait", f"{report['max_data_wait_s'] * 1e3:.1f} ms"),
        ]
    rows += [
        ("peak RSS", f"{report['peak_rss_gib']:.2f} GiB"),
        ("RSS first / last step", f"{report['rss_first_step_gib']:.2f} / "
                                  f"{report['rss_last_step_gib']:.2f} GiB"),
    ]  # fmt: skip
    print(f"\n{report['device']}: streaming {args.corpus_gb:g} GB of parquet")
    for name, value in rows:
        print(f"  {name:<24} {value}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
