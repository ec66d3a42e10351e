"""Kimi Linear family (registered as 'kimi_linear'): Kimi Delta Attention and NoPE multi-head
latent attention layers, DeepSeek-style mixture of experts."""

from torchloom.models.components.decoder_plan import decoder_tp_plan
from torchloom.models.kimi_linear.config import KIMI_LINEAR_FLAVORS, KimiLinearConfig
from torchloom.models.kimi_linear.hf_adapter import KimiLinearHFAdapter
from torchloom.models.registry import ModelSpec, register_model

register_model(
    ModelSpec(
        name="kimi_linear",
        config_cls=KimiLinearConfig,
        flavors=KIMI_LINEAR_FLAVORS,
        hf_adapter=KimiLinearHFAdapter(),
        tp_plan=decoder_tp_plan,
        description="Kimi Linear hybrid decoder (Kimi Delta Attention + NoPE multi-head latent "
        "attention, sigmoid-routed experts with a shared expert)",
    )
)

__all__ = ["KIMI_LINEAR_FLAVORS", "KimiLinearConfig", "KimiLinearHFAdapter"]
