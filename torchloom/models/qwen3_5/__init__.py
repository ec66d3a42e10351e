"""Qwen3.5 families (text decoders): 'qwen3_5' (dense SwiGLU) and 'qwen3_5_moe' (MoE with a
gated shared expert), both Gated DeltaNet + gated attention hybrids like Qwen3-Next."""

from torchloom.models.components.decoder_plan import decoder_tp_plan
from torchloom.models.qwen3_5.config import QWEN3_5_FLAVORS, QWEN3_5_MOE_FLAVORS
from torchloom.models.qwen3_5.hf_adapter import Qwen3_5HFAdapter, Qwen3_5MoeHFAdapter
from torchloom.models.qwen3_next.config import Qwen3NextConfig
from torchloom.models.registry import ModelSpec, register_model

register_model(
    ModelSpec(
        name="qwen3_5",
        config_cls=Qwen3NextConfig,
        flavors=QWEN3_5_FLAVORS,
        hf_adapter=Qwen3_5HFAdapter(),
        tp_plan=decoder_tp_plan,
        description="Qwen3.5 dense hybrid decoder (Gated DeltaNet + gated attention, SwiGLU)",
    )
)
register_model(
    ModelSpec(
        name="qwen3_5_moe",
        config_cls=Qwen3NextConfig,
        flavors=QWEN3_5_MOE_FLAVORS,
        hf_adapter=Qwen3_5MoeHFAdapter(),
        tp_plan=decoder_tp_plan,
        description="Qwen3.5 MoE hybrid decoder (Gated DeltaNet + gated attention, MoE with a "
        "gated shared expert)",
    )
)

__all__ = ["QWEN3_5_FLAVORS", "QWEN3_5_MOE_FLAVORS", "Qwen3_5HFAdapter", "Qwen3_5MoeHFAdapter"]
