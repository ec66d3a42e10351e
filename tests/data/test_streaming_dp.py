"""The streaming loader on 2 gloo ranks: DCP saves its state and resumes it bitwise, and a
checkpoint moves between 1 and 2 ranks without repeating or skipping a document."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch.distributed.checkpoint as dcp

from tests.data.stream_files import document_ids, texts, write_hf_dataset, write_parquet
from tests.data.stream_worker import GLOBAL_BATCH, MICRO_BATCH, SEED, SEQ_LEN
from tests.parallel.launcher import run_worker
from torchloom.data import DataConfig
from torchloom.data.build import streaming_loader

pytestmark = [pytest.mark.distributed, pytest.mark.multiprocess_core]
WORKER = Path(__file__).with_name("stream_worker.py")


def flat_steps(train, steps: int) -> list[np.ndarray]:
    return [np.concatenate([b.tokens.reshape(-1).numpy() for b in train.next_step()])
            for _ in range(steps)]  # fmt: skip


def test_two_ranks_resume_bitwise_and_across_sizes(tmp_path: Path, tiny_tokenizer) -> None:
    sources = [write_parquet(tmp_path / "a.parquet", texts("alpha", 80), rows_per_group=9),
               write_hf_dataset(tmp_path / "b", texts("beta", 60), num_shards=2)]  # fmt: skip
    cfg = DataConfig(sources=[str(s) for s in sources], mix=[0.5, 0.5], streaming=True,
                     val_fraction=0.0, tokenizer=str(tiny_tokenizer.path),
                     cache_dir=str(tmp_path / "cache"))  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))

    def loader():
        return streaming_loader(cfg, tiny_tokenizer, SEQ_LEN, GLOBAL_BATCH, MICRO_BATCH, 0, 1,
                                SEED)  # fmt: skip

    single = loader()
    reference = flat_steps(single, 3)
    dcp.save({"dataloader": single.state_dict()}, checkpoint_id=tmp_path / "ckpt-dp1")
    reference += flat_steps(single, 3)
    single.close()

    results = sorted((p for kind, p in run_worker(WORKER, 2, str(tmp_path)) if kind == "RESULT"),
                     key=lambda r: r["rank"])  # fmt: skip
    assert [r["rank"] for r in results] == [0, 1]

    def union(name: str) -> list[np.ndarray]:
        return [np.array(a + b) for a, b in zip(results[0][name], results[1][name], strict=True)]

    for step, (ours, theirs) in enumerate(zip(union("before") + union("uninterrupted"),
                                              reference, strict=True)):  # fmt: skip
        assert np.array_equal(ours, theirs), f"2 ranks differ from 1 at step {step}"
    for rank in results:  # 2 -> 2: bitwise
        assert rank["from_dp2"] == rank["uninterrupted"], f"rank {rank['rank']} resumed differently"
    for step, (ours, theirs) in enumerate(zip(union("from_dp1"), reference[3:], strict=True)):
        assert np.array_equal(ours, theirs), f"1 -> 2 ranks: step {3 + step} differs"

    resized = loader()  # 2 -> 1
    dcp.load({"dataloader": resized}, checkpoint_id=tmp_path / "ckpt-dp2")
    after = flat_steps(resized, 3)
    resized.close()
    for resumed in (union("before") + after, reference[:3] + union("from_dp1")):
        found = document_ids(np.concatenate(resumed), tiny_tokenizer)
        for name in ("alpha", "beta"):
            numbers = [i for source, i in found if source == name]
            first = numbers[0]
            assert numbers == list(range(first, first + len(numbers))), (name, numbers)
            assert first <= 1 and len(numbers) >= 3, (name, numbers)
