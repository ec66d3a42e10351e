"""Muse Glimmer family (registered as 'muse_glimmer'): the dense text decoder of Muse Glimmer
(sliding-window + NoPE full gated attention, sandwich norms, soft-capped logits) reading images
through the Muse vision encoder (models/components/muse_vision.py; model.py). Its tensor-parallel
plan, shared with Muse Spark, is parallelize.py."""

from torchloom.models.muse_glimmer.config import MUSE_GLIMMER_FLAVORS, MuseGlimmerConfig
from torchloom.models.muse_glimmer.hf_adapter import MuseGlimmerHFAdapter
from torchloom.models.muse_glimmer.parallelize import muse_tp_plan
from torchloom.models.registry import ModelSpec, register_model

register_model(
    ModelSpec(
        name="muse_glimmer",
        config_cls=MuseGlimmerConfig,
        flavors=MUSE_GLIMMER_FLAVORS,
        hf_adapter=MuseGlimmerHFAdapter(),
        tp_plan=muse_tp_plan,
        description="Muse Glimmer (sliding-window and NoPE gated attention, sandwich norms, "
        "soft-capped logits) reading images",
    )
)

__all__ = ["MUSE_GLIMMER_FLAVORS", "MuseGlimmerConfig", "MuseGlimmerHFAdapter", "muse_tp_plan"]
