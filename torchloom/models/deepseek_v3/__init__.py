"""DeepSeek-V3 family (registered as 'deepseek_v3'): multi-head latent attention, DeepSeekMoE
and multi-token prediction; its flavors cover DeepSeek-V2-Lite, DeepSeek-V2, DeepSeek-V3 and
Kimi-K2."""

from torchloom.models.deepseek_v3.config import DEEPSEEK_V3_FLAVORS, DeepSeekV3Config
from torchloom.models.deepseek_v3.hf_adapter import DeepSeekV3HFAdapter
from torchloom.models.deepseek_v3.model import DeepSeekV3
from torchloom.models.deepseek_v3.parallelize import tp_plan
from torchloom.models.registry import ModelSpec, register_model

register_model(
    ModelSpec(
        name="deepseek_v3",
        config_cls=DeepSeekV3Config,
        flavors=DEEPSEEK_V3_FLAVORS,
        hf_adapter=DeepSeekV3HFAdapter(),
        tp_plan=tp_plan,
        description="DeepSeek-V2/V3 and Kimi-K2 decoder (multi-head latent attention, "
        "DeepSeekMoE with shared experts and group-limited routing, multi-token prediction)",
    )
)

__all__ = ["DEEPSEEK_V3_FLAVORS", "DeepSeekV3", "DeepSeekV3Config", "DeepSeekV3HFAdapter"]
