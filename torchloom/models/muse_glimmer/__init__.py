"""Muse Glimmer family (registered as 'muse_glimmer'): the dense text decoder of Muse Glimmer
(sliding-window + NoPE full gated attention, sandwich norms, soft-capped logits) reading images
through the Muse vision encoder (models/components/muse_vision.py; model.py)."""

from typing import Any

from torch import nn

from torchloom.config.errors import ConfigError
from torchloom.models.components.decoder_plan import decoder_tp_plan
from torchloom.models.muse_glimmer.config import MUSE_GLIMMER_FLAVORS, MuseGlimmerConfig
from torchloom.models.muse_glimmer.hf_adapter import MuseGlimmerHFAdapter
from torchloom.models.registry import ModelSpec, register_model


def muse_tp_plan(model: nn.Module, tp: int, *args: Any, **kwargs: Any) -> Any:
    """Refuses tp > 1: the decoder plan has no styles yet for the Muse blocks' post-norms,
    residual gates, embedding norm and soft-capped head."""
    if tp > 1:
        raise ConfigError(
            f"--parallel.tp {tp}: the Muse families have no tensor-parallel plan yet (their "
            "post-norms, residual gates, embedding norm and logit soft-cap are not split); set "
            "--parallel.tp 1."
        )
    return decoder_tp_plan(model, tp, *args, **kwargs)


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
