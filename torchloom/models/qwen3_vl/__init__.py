"""Qwen3-VL family, dense and MoE (registered as 'qwen3_vl')."""

from torchloom.models.qwen3_vl.config import QWEN3_VL_FLAVORS, Qwen3VLConfig
from torchloom.models.qwen3_vl.hf_adapter import Qwen3VLHFAdapter
from torchloom.models.registry import ModelSpec, register_model

register_model(
    ModelSpec(
        name="qwen3_vl",
        config_cls=Qwen3VLConfig,
        flavors=QWEN3_VL_FLAVORS,
        hf_adapter=Qwen3VLHFAdapter(),
        tp_plan=None,  # the vision encoder has no tensor-parallel plan yet
        description="Qwen3-VL (dense or MoE Qwen3 decoder + native-resolution ViT, DeepStack, "
        "interleaved M-RoPE)",
    )
)

__all__ = ["QWEN3_VL_FLAVORS", "Qwen3VLConfig", "Qwen3VLHFAdapter"]
