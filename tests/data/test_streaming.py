"""The streaming loader: every source format, weighted mixes, a background thread that never
needs a tokenization pass, bitwise resume and resume on another data-parallel size."""

from __future__ import annotations

import collections
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.data.stream_files import (
    document_ids,
    stream_tokens,
    texts,
    write_arrow,
    write_hf_dataset,
    write_jsonl,
    write_npy,
    write_parquet,
)
from torchloom.config.errors import ConfigError
from torchloom.data import DataConfig, build_dataloaders
from torchloom.data.build import streaming_loader
from torchloom.data.streaming import StreamingLoader
from torchloom.data.tokenizer import Tokenizer

T = 16


def config(sources: list[Path | str], tmp_path: Path, **overrides: object) -> DataConfig:
    return DataConfig(sources=[str(s) for s in sources], streaming=True, val_fraction=0.0,
                      cache_dir=str(tmp_path / "cache"), **overrides)  # fmt: skip


def loader(
    cfg: DataConfig, tokenizer: Tokenizer, dp_rank: int = 0, dp_size: int = 1, **kw: int
) -> StreamingLoader:
    sizes = {"global_batch_size": 8, "micro_batch_size": 2, "seed": 5} | kw
    return streaming_loader(cfg, tokenizer, T, dp_rank=dp_rank, dp_size=dp_size, **sizes)


def run(train: StreamingLoader, steps: int) -> list[list]:
    return [train.next_step() for _ in range(steps)]


def assert_same_steps(ours: list[list], theirs: list[list]) -> None:
    assert len(ours) == len(theirs)
    for s, (a_step, b_step) in enumerate(zip(ours, theirs, strict=True)):
        for a, b in zip(a_step, b_step, strict=True):
            for name, value in a.named_tensors().items():
                other = b.named_tensors()[name]
                same = (value is None and other is None) or torch.equal(value, other)
                assert same, f"step {s}: {name} differs at {(value != other).nonzero()[:4]}"


def test_parquet_stream_equals_the_cached_path(tmp_path, tiny_tokenizer) -> None:
    """Without shuffling, streaming a parquet file serves bitwise the batches the cached
    loader cuts from the same documents in a JSONL file."""
    docs = texts("doc", 120)
    cached_cfg = DataConfig(sources=[str(write_jsonl(tmp_path / "d.jsonl", docs))],
                            tokenizer=str(tiny_tokenizer.path), val_fraction=0.0, shuffle=False,
                            cache_dir=str(tmp_path / "cache"))  # fmt: skip
    _, cached, _ = build_dataloaders(cached_cfg, T, 8, 2)
    cfg = config([write_parquet(tmp_path / "d.parquet", docs)], tmp_path,
                 tokenizer=str(tiny_tokenizer.path))  # fmt: skip
    _, streamed, val = build_dataloaders(cfg, T, 8, 2)
    assert val is None and isinstance(streamed, StreamingLoader)
    steps = cached.num_rows // 8
    assert steps >= 5, steps
    assert_same_steps(run(streamed, steps), [cached.next_step() for _ in range(steps)])


def test_every_format_streams_the_same_tokens(tmp_path, tiny_tokenizer) -> None:
    docs = texts("doc", 60)
    sources = {
        "jsonl": write_jsonl(tmp_path / "a.jsonl", docs),
        "parquet": write_parquet(tmp_path / "a.parquet", docs),
        "parquet shards": write_parquet(tmp_path / "shards/part-1.parquet", docs[40:]).parent,
        "arrow file": write_arrow(tmp_path / "a.arrow", docs),
        "arrow stream": write_arrow(tmp_path / "s/a.arrow", docs, stream=True),
        "datasets folder": write_hf_dataset(tmp_path / "hf", docs, num_shards=3),
        "npy uint16": write_npy(tmp_path / "a.npy", docs, tiny_tokenizer),
        "npy int32": write_npy(tmp_path / "b.npy", docs, tiny_tokenizer, np.int32),
    }
    write_parquet(tmp_path / "shards/part-0.parquet", docs[:40], rows_per_group=3)
    expected = np.array([i for d in tiny_tokenizer.encode_batch(docs)
                         for i in [*d, tiny_tokenizer.eos_id]])  # fmt: skip
    for name, path in sources.items():
        cfg = config([path], tmp_path, tokenizer=str(tiny_tokenizer.path))
        train = loader(cfg, tiny_tokenizer, global_batch_size=4, micro_batch_size=4)
        got = stream_tokens(run(train, len(expected) // (4 * T)))
        assert np.array_equal(got, expected[: len(got)]), name
        # Sources restart when they run out: the stream goes on into a second pass.
        more = stream_tokens(run(train, len(expected) // (4 * T)))
        assert np.array_equal(np.concatenate([got, more])[len(expected):][:100],
                              expected[:100]), name  # fmt: skip
        train.close()


def test_mix_draws_documents_by_weight(tmp_path, tiny_tokenizer) -> None:
    sources = [write_parquet(tmp_path / "big.parquet", texts("big", 50)),
               write_arrow(tmp_path / "small.arrow", texts("small", 10), stream=True),
               write_jsonl(tmp_path / "unused.jsonl", texts("unused", 10))]  # fmt: skip
    cfg = config(sources, tmp_path, tokenizer=str(tiny_tokenizer.path), mix=[0.75, 0.25, 0.0])
    stream = loader(cfg, tiny_tokenizer).stream
    tokens = stream.take(150_000)  # the packed stream from its start: ~3,000 documents
    found = document_ids(np.concatenate([[tiny_tokenizer.eos_id], tokens]), tiny_tokenizer)
    counts = collections.Counter(name for name, _ in found)
    share = counts["big"] / len(found)
    print(f"{len(found)} documents: {dict(counts)}, big's share {share:.3f}")
    assert len(found) > 2000 and counts["unused"] == 0
    assert abs(share - 0.75) < 0.025, share
    # Each source is read in order and restarts when it runs out.
    for name, size in (("big", 50), ("small", 10)):
        numbers = [i for source, i in found if source == name]
        assert numbers == [k % size for k in range(len(numbers))], (name, numbers[:30])


def test_resume_is_bitwise(tmp_path, tiny_tokenizer) -> None:
    """Stop anywhere (mid row group, mid record batch, mid document, with the worker thread
    ahead), save through DCP, load into a fresh loader: the next steps are the same bits."""
    sources = [write_parquet(tmp_path / "p.parquet", texts("p", 40)),
               write_hf_dataset(tmp_path / "hf", texts("h", 30)),
               write_npy(tmp_path / "t.npy", texts("n", 20), tiny_tokenizer)]  # fmt: skip
    cfg = config(sources, tmp_path, tokenizer=str(tiny_tokenizer.path), mix=[0.5, 0.3, 0.2])
    steps = 48  # ~150 documents: the resumed runs read past the carry, through many draws
    full = run(loader(cfg, tiny_tokenizer), steps)
    for stop in (1, 19):
        first = loader(cfg, tiny_tokenizer)
        assert_same_steps(run(first, stop), full[:stop])
        time.sleep(0.2)  # let the worker run ahead of what was served
        dcp.save({"dataloader": first.state_dict()}, checkpoint_id=tmp_path / f"ckpt{stop}")
        first.close()
        resumed = loader(cfg, tiny_tokenizer)
        dcp.load({"dataloader": resumed}, checkpoint_id=tmp_path / f"ckpt{stop}")
        assert resumed.step == stop and resumed.tokens_seen == stop * 8 * T
        assert_same_steps(run(resumed, steps - stop), full[stop:])


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "arrow file", "arrow stream", "npy"])
def test_resume_into_a_source_that_shrank_is_refused(tmp_path, tiny_tokenizer, kind) -> None:
    """A saved position past the end of a source rewritten shorter since the checkpoint is
    named in one error (a .jsonl offset past the end once hung the reader, counting lines)."""
    path = tmp_path / ("a." + (kind if kind in ("jsonl", "parquet", "npy") else "arrow"))

    def write(docs: list[str]) -> None:
        if kind == "jsonl":
            write_jsonl(path, docs)
        elif kind == "parquet":
            write_parquet(path, docs)
        elif kind == "npy":
            write_npy(path, docs, tiny_tokenizer)
        else:
            write_arrow(path, docs, stream=kind == "arrow stream")

    write(texts("doc", 60))
    cfg = config([path], tmp_path, tokenizer=str(tiny_tokenizer.path))
    first = loader(cfg, tiny_tokenizer)
    run(first, 3)  # past the first few documents, wherever the worker has read to
    state = first.state_dict()
    first.close()
    write(texts("s", 1))
    resumed = loader(cfg, tiny_tokenizer)
    resumed.load_state_dict(state)
    with pytest.raises(ConfigError, match=r"past what the file now holds: the source changed"):
        run(resumed, 1)
    resumed.close()


def test_resume_into_a_folder_that_gained_or_lost_a_file_is_refused(tmp_path, tiny_tokenizer):
    """A saved position names a file by its index in its folder: a shard added before it (or
    one removed) would resume in another file at the saved offset, skipping documents. The
    resume is refused, naming the files added and removed."""
    shards = tmp_path / "shards"
    write_jsonl(shards / "b.jsonl", texts("b", 40))
    write_jsonl(shards / "c.jsonl", texts("c", 40))
    cfg = config([shards], tmp_path, tokenizer=str(tiny_tokenizer.path))
    first = loader(cfg, tiny_tokenizer)
    run(first, 3)
    state = first.state_dict()
    first.close()
    write_jsonl(shards / "a.jsonl", texts("a", 5))
    resumed = loader(cfg, tiny_tokenizer)
    with pytest.raises(ConfigError, match=r"the sources' files changed since the checkpoint "
                       r"\(1 added: .*a\.jsonl\).*--checkpoint.exclude_from_loading"):  # fmt: skip
        resumed.load_state_dict(state)
    (shards / "a.jsonl").unlink()
    (shards / "c.jsonl").unlink()
    with pytest.raises(ConfigError, match=r"\(1 removed: .*c\.jsonl\)"):
        loader(cfg, tiny_tokenizer).load_state_dict(state)
    # A checkpoint saved before the files were recorded resumes as it did.
    write_jsonl(shards / "c.jsonl", texts("c", 40))
    older = {k: v for k, v in state.items() if k != "files"}
    loader(cfg, tiny_tokenizer).load_state_dict(older)


def test_resume_on_another_data_parallel_size(tmp_path, tiny_tokenizer) -> None:
    """2 ranks -> 1 and 1 -> 2: the union of the ranks' rows continues the same stream, so
    every document is served once, none repeated or skipped."""
    docs = texts("doc", 400)
    cfg = config([write_parquet(tmp_path / "d.parquet", docs)], tmp_path,
                 tokenizer=str(tiny_tokenizer.path))  # fmt: skip
    sizes = {"global_batch_size": 16, "micro_batch_size": 4}
    one = run(loader(cfg, tiny_tokenizer, **sizes), 12)
    ranks = [loader(cfg, tiny_tokenizer, r, 2, **sizes) for r in range(2)]
    two = [[*ranks[0].next_step(), *ranks[1].next_step()] for _ in range(6)]
    assert ranks[0].state_dict() == ranks[1].state_dict()  # one global position
    assert_same_steps(two, one[:6])
    single = loader(cfg, tiny_tokenizer, **sizes)  # 2 -> 1
    single.load_state_dict(ranks[0].state_dict())
    after = run(single, 6)
    solo = loader(cfg, tiny_tokenizer, **sizes)  # 1 -> 2, micro-batches of 2 now
    run(solo, 6)
    pair = [loader(cfg, tiny_tokenizer, r, 2, global_batch_size=16, micro_batch_size=2)
            for r in range(2)]  # fmt: skip
    for rank in pair:
        rank.load_state_dict(solo.state_dict())
    split = [[*pair[0].next_step(), *pair[1].next_step()] for _ in range(6)]
    for resized in (two + after, one[:6] + split):
        found = document_ids(stream_tokens(resized), tiny_tokenizer)
        numbers = [i for _, i in found]
        assert numbers == list(range(1, len(numbers) + 1)), numbers[:20]  # each once, in order
        assert len(numbers) > 40, len(numbers)
        assert np.array_equal(stream_tokens(resized), stream_tokens(one))


def test_resume_with_another_batch_size_and_seq_len(tmp_path, tiny_tokenizer) -> None:
    """The state is a stream position: rows of any length and number continue from it."""
    cfg = config([write_parquet(tmp_path / "d.parquet", texts("doc", 200))], tmp_path,
                 tokenizer=str(tiny_tokenizer.path))  # fmt: skip
    reference = stream_tokens(run(loader(cfg, tiny_tokenizer), 10))
    first = loader(cfg, tiny_tokenizer)
    head = stream_tokens(run(first, 4))
    other = streaming_loader(cfg, tiny_tokenizer, seq_len=8, global_batch_size=6,
                             micro_batch_size=3, seed=5)  # fmt: skip
    other.load_state_dict(first.state_dict())
    first.close()
    tail = stream_tokens(run(other, 5))
    assert np.array_equal(np.concatenate([head, tail]), reference[: len(head) + len(tail)])


def test_worker_runs_ahead_without_a_tokenization_pass(tmp_path, tiny_tokenizer) -> None:
    """The first step arrives after reading only the start of the data, the worker then fills
    its bounded queue and stops there, and later steps wait on nothing."""
    path = write_parquet(tmp_path / "big.parquet", texts("doc", 20_000), rows_per_group=500)
    cfg = config([path], tmp_path, tokenizer=str(tiny_tokenizer.path), prefetch_steps=3)
    train = loader(cfg, tiny_tokenizer)
    train.next_step()
    deadline = time.monotonic() + 10
    while train._queue.qsize() < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert train._queue.qsize() == 3  # full, and bounded
    documents = train.stream.documents  # the worker waits to put a 5th step: nothing moves
    epoch, file, group, row = train.stream.streams[0].position
    assert documents < 200 and (epoch, file, group) == (0, 0, 0), (documents, group, row)
    start = time.perf_counter()
    train.next_step()
    assert time.perf_counter() - start < 0.05
    train.close()
