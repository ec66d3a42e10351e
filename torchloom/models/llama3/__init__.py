"""Llama 3 family (registered as 'llama3')."""

from torchloom.models.llama3.config import LLAMA3_FLAVORS
from torchloom.models.llama3.hf_adapter import Llama3HFAdapter
from torchloom.models.llama3.model import Llama3
from torchloom.models.llama3.parallelize import tp_plan
from torchloom.models.registry import ModelSpec, register_model

register_model(
    ModelSpec(
        name="llama3",
        model_cls=Llama3,
        flavors=LLAMA3_FLAVORS,
        hf_adapter=Llama3HFAdapter(),
        tp_plan=tp_plan,
        description="Llama 3.1 / 3.2 dense decoder (GQA, RoPE with llama3 scaling, SwiGLU)",
    )
)

__all__ = ["LLAMA3_FLAVORS", "Llama3", "Llama3HFAdapter"]
