"""Qwen3 dense family (registered as 'qwen3')."""

from torchloom.models.qwen3.config import QWEN3_FLAVORS, Qwen3Config
from torchloom.models.qwen3.hf_adapter import Qwen3HFAdapter
from torchloom.models.qwen3.parallelize import tp_plan
from torchloom.models.registry import ModelSpec, register_model

register_model(
    ModelSpec(
        name="qwen3",
        config_cls=Qwen3Config,
        flavors=QWEN3_FLAVORS,
        hf_adapter=Qwen3HFAdapter(),
        tp_plan=tp_plan,
        description="Qwen3 dense decoder (GQA with q/k RMSNorm, RoPE theta 1e6, SwiGLU)",
    )
)

__all__ = ["QWEN3_FLAVORS", "Qwen3Config", "Qwen3HFAdapter"]
