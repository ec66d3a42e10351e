"""DeepSeek-V4 family (registered as 'deepseek_v4'): sliding-window, compressed sparse and
heavily compressed attention, manifold-constrained hyper-connections and hash-routed MoE; its
flavors cover DeepSeek-V4-Flash and DeepSeek-V4-Pro."""

from torchloom.models.deepseek_v4.config import DEEPSEEK_V4_FLAVORS, DeepSeekV4Config
from torchloom.models.deepseek_v4.hf_adapter import DeepSeekV4HFAdapter
from torchloom.models.deepseek_v4.model import DeepSeekV4
from torchloom.models.deepseek_v4.parallelize import tp_plan
from torchloom.models.registry import ModelSpec, register_model

register_model(
    ModelSpec(
        name="deepseek_v4",
        config_cls=DeepSeekV4Config,
        flavors=DEEPSEEK_V4_FLAVORS,
        hf_adapter=DeepSeekV4HFAdapter(),
        tp_plan=tp_plan,
        description="DeepSeek-V4 decoder (sliding / compressed sparse / heavily compressed "
        "attention with sinks, hyper-connections, hash-routed and sqrt-softplus MoE)",
    )
)

__all__ = ["DEEPSEEK_V4_FLAVORS", "DeepSeekV4", "DeepSeekV4Config", "DeepSeekV4HFAdapter"]
