"""Llama 3 family (registered as 'llama3')."""

from torchloom.models.components.transformer import TransformerConfig
from torchloom.models.llama3.config import LLAMA3_FLAVORS
from torchloom.models.llama3.hf_adapter import Llama3HFAdapter
from torchloom.models.llama3.parallelize import tp_plan
from torchloom.models.registry import ModelSpec, register_model

register_model(
    ModelSpec(
        name="llama3",
        config_cls=TransformerConfig,
        flavors=LLAMA3_FLAVORS,
        hf_adapter=Llama3HFAdapter(),
        tp_plan=tp_plan,
        description="Llama 3.1 / 3.2 dense decoder (GQA, RoPE with llama3 scaling, SwiGLU)",
    )
)

__all__ = ["LLAMA3_FLAVORS", "Llama3HFAdapter"]
