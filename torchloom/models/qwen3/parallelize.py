"""Qwen3's tensor-parallel plan: the shared decoder's (components/decoder_plan.py), which
also splits the per-head q/k norms with the heads.

``tp_plan(model, tp, loss_parallel)`` is what the family's ModelSpec points at;
``torchloom.parallel.parallelize`` applies it.
"""

from torchloom.models.components.decoder_plan import decoder_tp_plan as tp_plan

__all__ = ["tp_plan"]
