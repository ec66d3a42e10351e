"""`torchloom rl` through the training step with every kind of layer: MoE (qwen3_moe: the
balance term and expert loads come through the step as in pre-training), MLA + MoE
(deepseek_v3) and the Gated DeltaNet hybrid (qwen3_5), each taking real updates."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.rl.common import BASE, records
from torchloom.cli import main


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "qwen3_5"])
def test_rl_trains_each_family(tmp_path: Path, family: str) -> None:
    assert main(["rl", *BASE, "--output.dir", str(tmp_path), "--model.name", family,
                 "--model.flavor", "debug", "--training.steps", "2",
                 "--rl.minibatches", "2"]) == 0  # fmt: skip
    rows = records(tmp_path)
    print([{k: v for k, v in r.items() if k in ("step", "updates", "grad_norm")
            or k.startswith(("aux_", "moe"))} for r in rows])  # fmt: skip
    assert any(r["updates"] > 0 and r["grad_norm"] > 0 for r in rows)
    if family == "qwen3_moe":  # its balance term reached the RL update through the step
        assert all(r["aux_balance"] > 0 for r in rows)
    if family == "deepseek_v3":  # multi-token prediction's cross-entropy is not a policy loss
        assert not any(k == "aux_mtp" for r in rows for k in r)
