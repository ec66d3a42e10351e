"""Llama 3's tensor-parallel plan: the shared decoder's (components/decoder_plan.py).

``tp_plan(model, tp, loss_parallel)`` is what the family's ModelSpec points at;
``torchloom.parallel.parallelize`` applies it. Llama 3.2's tied flavors (1B, 3B) are covered:
the plan then feeds the embedding-matrix head a replicated hidden state.
"""

from torchloom.models.components.decoder_plan import decoder_tp_plan as tp_plan

__all__ = ["tp_plan"]
