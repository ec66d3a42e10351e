"""What an RL checkpoint holds beyond training's registry: the rollout batches generated ahead
of the trainer (colocated with lag), so a resumed run trains on them as the interrupted one
would have."""

from __future__ import annotations

import json
from typing import Any

from torchloom.rl.rollout import Rollout, RolloutBatch


class RolloutBuffer:
    """Batches generated ahead of the trainer (max_offpolicy_steps > 0), checkpointed as JSON."""

    def __init__(self) -> None:
        self.batches: list[RolloutBatch] = []

    def state_dict(self) -> dict[str, Any]:
        return {"json": json.dumps([_batch_to_dict(b) for b in self.batches])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches[:] = [_batch_from_dict(d) for d in json.loads(state["json"])]


def _batch_to_dict(batch: RolloutBatch) -> dict[str, Any]:
    return {**vars(batch), "rollouts": [vars(r) for r in batch.rollouts]}


def _batch_from_dict(d: dict[str, Any]) -> RolloutBatch:
    return RolloutBatch(**{**d, "rollouts": [Rollout(**r) for r in d["rollouts"]]})
