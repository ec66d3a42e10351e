"""Qwen3-Next family (registered as 'qwen3_next'): Gated DeltaNet and gated attention layers
(three to one), a mixture of experts with a gated shared expert in every layer."""

from torchloom.models.components.decoder_plan import decoder_tp_plan
from torchloom.models.qwen3_next.config import QWEN3_NEXT_FLAVORS, Qwen3NextConfig
from torchloom.models.qwen3_next.hf_adapter import Qwen3NextHFAdapter
from torchloom.models.registry import ModelSpec, register_model

register_model(
    ModelSpec(
        name="qwen3_next",
        config_cls=Qwen3NextConfig,
        flavors=QWEN3_NEXT_FLAVORS,
        hf_adapter=Qwen3NextHFAdapter(),
        tp_plan=decoder_tp_plan,
        description="Qwen3-Next hybrid decoder (Gated DeltaNet + gated attention, MoE with a "
        "gated shared expert)",
    )
)

__all__ = ["QWEN3_NEXT_FLAVORS", "Qwen3NextConfig", "Qwen3NextHFAdapter"]
