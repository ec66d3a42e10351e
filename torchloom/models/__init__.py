"""Model layer: shared components, families (llama3, qwen3), registry, config and transforms.

Importing a family package registers it, so importing this package registers them all.
"""

from torchloom.models.components.attention import ATTENTION_BACKENDS, Attention
from torchloom.models.components.mlp import SwiGLU
from torchloom.models.components.norms import NORM_IMPLS, RMSNorm
from torchloom.models.components.rope import RopeConfig, RotaryEmbedding, apply_rotary
from torchloom.models.components.transformer import Block, Transformer, TransformerConfig
from torchloom.models.config import ModelConfig, apply_overrides, resolve_model_config
from torchloom.models.hf_adapter import HFAdapter
from torchloom.models.llama3 import Llama3
from torchloom.models.qwen3 import Qwen3
from torchloom.models.registry import (
    ModelSpec,
    build_model,
    get_hf_model_spec,
    get_model_spec,
    list_models,
    register_model,
)
from torchloom.models.transforms import apply_transforms, list_transforms, register_transform

__all__ = [
    "ATTENTION_BACKENDS",
    "NORM_IMPLS",
    "Attention",
    "Block",
    "HFAdapter",
    "Llama3",
    "ModelConfig",
    "ModelSpec",
    "Qwen3",
    "RMSNorm",
    "RopeConfig",
    "RotaryEmbedding",
    "SwiGLU",
    "Transformer",
    "TransformerConfig",
    "apply_overrides",
    "apply_rotary",
    "apply_transforms",
    "build_model",
    "get_hf_model_spec",
    "get_model_spec",
    "list_models",
    "list_transforms",
    "register_model",
    "register_transform",
    "resolve_model_config",
]
