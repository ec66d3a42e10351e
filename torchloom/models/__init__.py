"""Model layer: shared components, families (llama3, qwen3), registry, config and transforms.

Importing a family package registers it, so importing this package registers them all.
"""

from torchloom.models import (  # noqa: F401  (registers)
    deepseek_v3,
    deepseek_v4,
    deepseek_v32,
    kimi_k25,
    kimi_linear,
    llama3,
    muse_glimmer,
    muse_spark,
    qwen3,
    qwen3_5,
    qwen3_moe,
    qwen3_next,
    qwen3_vl,
)
from torchloom.models.components.attention import ATTENTION_BACKENDS, Attention
from torchloom.models.components.decoder import Block, Decoder, DecoderConfig, LayerSpec
from torchloom.models.components.mlp import SwiGLU
from torchloom.models.components.norms import NORM_IMPLS, RMSNorm
from torchloom.models.components.param_init import ParamInit
from torchloom.models.components.rope import RopeConfig, RotaryEmbedding, apply_rotary
from torchloom.models.components.transformer import TransformerConfig
from torchloom.models.config import ModelConfig, apply_overrides, resolve_model_config
from torchloom.models.hf_adapter import HFAdapter
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
    "Decoder",
    "DecoderConfig",
    "HFAdapter",
    "LayerSpec",
    "ModelConfig",
    "ModelSpec",
    "ParamInit",
    "RMSNorm",
    "RopeConfig",
    "RotaryEmbedding",
    "SwiGLU",
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
