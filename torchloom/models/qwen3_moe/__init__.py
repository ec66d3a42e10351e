"""Qwen3-MoE family (registered as 'qwen3_moe')."""

from torchloom.models.components.decoder_plan import decoder_tp_plan
from torchloom.models.components.transformer import MoETransformerConfig
from torchloom.models.qwen3_moe.config import QWEN3_MOE_FLAVORS
from torchloom.models.qwen3_moe.hf_adapter import Qwen3MoeHFAdapter
from torchloom.models.registry import ModelSpec, register_model

register_model(
    ModelSpec(
        name="qwen3_moe",
        config_cls=MoETransformerConfig,
        flavors=QWEN3_MOE_FLAVORS,
        hf_adapter=Qwen3MoeHFAdapter(),
        tp_plan=decoder_tp_plan,
        description="Qwen3-MoE decoder (GQA with q/k RMSNorm, softmax top-k routed SwiGLU experts)",
    )
)

__all__ = ["QWEN3_MOE_FLAVORS", "Qwen3MoeHFAdapter"]
