"""MoonViT <-> transformers' Kimi_K25ForConditionalGeneration: the vision tower's and the
projector's tensor names (MoonViT's own, relative to the module), and the MoonViTConfig of a
Kimi K2.5 config.json and back.

Names are transformers' (what its ``save_pretrained`` writes): ``model.vision_tower.*`` and
``model.mm_projector.*``. Every tensor keeps its shape, so loading is a rename. Moonshot's own
release names them differently (``vision_tower.encoder.blocks.*`` with a fused ``wqkv`` whose
q/k rows are in the interleaved rotary order, ``mm_projector.proj.0/2``); transformers converts
those when it loads them, and so must a reader of that release (not done here).
"""

from __future__ import annotations

import re
from typing import Any

from torchloom.config.errors import ConfigError
from torchloom.models.components.moonvit import MoonViTConfig
from torchloom.models.hf_adapter import refuse_unknown_keys

_TOWER, _PROJECTOR = "model.vision_tower.", "model.mm_projector."
# Ours -> transformers', outside the blocks.
_OUTER = {
    "patch_embed.weight": _TOWER + "patch_embed.proj.weight",
    "patch_embed.bias": _TOWER + "patch_embed.proj.bias",
    "pos_embed.table": _TOWER + "patch_embed.pos_emb.position_embeddings",
    "norm.weight": _TOWER + "final_layernorm.weight",
    "norm.bias": _TOWER + "final_layernorm.bias",
    "projector.norm.weight": _PROJECTOR + "pre_norm.weight",
    "projector.norm.bias": _PROJECTOR + "pre_norm.bias",
    **{f"projector.{proj}.{kind}": f"{_PROJECTOR}{proj}.{kind}"
       for proj in ("in_proj", "out_proj") for kind in ("weight", "bias")},
}  # fmt: skip
_OUTER_FROM_HF = {hf: ours for ours, hf in _OUTER.items()}
# Ours -> transformers', inside block i (the module path before .weight / .bias).
_IN_BLOCK = {
    "attention_norm": "norm1",
    "attention.q_proj": "attn.q_proj",
    "attention.k_proj": "attn.k_proj",
    "attention.v_proj": "attn.v_proj",
    "attention.o_proj": "attn.proj",
    "mlp_norm": "norm2",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}
_IN_BLOCK_FROM_HF = {hf: ours for ours, hf in _IN_BLOCK.items()}
_OUR_BLOCK = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)")
_HF_BLOCK = re.compile(r"model\.vision_tower\.layers\.(\d+)\.(.+)\.(weight|bias)")
# Buffers transformers computes from the config (non-persistent, but older files may hold them).
_HF_DERIVED = re.compile(r"model\.vision_tower\.(rotary_emb\.\w+|patch_embed\.pos_emb\.time_\w+)")


def is_hf_moonvit_name(hf_name: str) -> bool:
    """Whether a Kimi K2.5 checkpoint tensor belongs to the vision tower or the projector."""
    return hf_name.startswith((_TOWER, _PROJECTOR))


def hf_name(name: str) -> str:
    """transformers' name of MoonViT parameter ``name`` ('layers.0.attention.o_proj.weight'
    -> 'model.vision_tower.layers.0.attn.proj.weight')."""
    if name in _OUTER:
        return _OUTER[name]
    match = _OUR_BLOCK.fullmatch(name)
    if match and match.group(2) in _IN_BLOCK:
        index, module, kind = match.groups()
        return f"{_TOWER}layers.{index}.{_IN_BLOCK[module]}.{kind}"
    raise KeyError(f"{name!r} is not a MoonViT parameter")


def from_hf_name(hf_name: str) -> str | None:
    """The MoonViT parameter a vision-tower or projector tensor loads into; None for a buffer
    transformers derives from the config. ConfigError for a tensor MoonViT has no place for."""
    if hf_name in _OUTER_FROM_HF:
        return _OUTER_FROM_HF[hf_name]
    match = _HF_BLOCK.fullmatch(hf_name)
    if match and match.group(2) in _IN_BLOCK_FROM_HF:
        index, module, kind = match.groups()
        return f"layers.{index}.{_IN_BLOCK_FROM_HF[module]}.{kind}"
    if _HF_DERIVED.fullmatch(hf_name):
        return None
    raise ConfigError(
        f"Unexpected tensor '{hf_name}' in a Kimi K2.5 checkpoint: MoonViT has no parameter for "
        "it (transformers' names are expected, model.vision_tower.* and model.mm_projector.*)."
    )


# Kimi_K25VisionConfig's keys (model_type checked below; architectures: null in a sub-config).
_VISION_KEYS = frozenset({
    "model_type", "architectures", "patch_size", "pos_emb_height", "pos_emb_width", "pos_emb_time",
    "num_attention_heads", "num_hidden_layers", "hidden_size", "intermediate_size", "hidden_act",
    "merge_kernel_size", "rope_parameters",
})  # fmt: skip


def config_from_hf(hf: dict[str, Any]) -> MoonViTConfig:
    """The MoonViTConfig of a Kimi K2.5 config.json (its vision_config, the projector's keys and
    the text model's width); ConfigError for what MoonViT does not compute, and for a
    vision_config key it does not know."""
    vision = hf.get("vision_config") or {}
    text = hf.get("text_config") or {}
    refuse_unknown_keys(vision, _VISION_KEYS, "a kimi_k25 vision_config")
    if vision.get("model_type", "kimi_k25_vision") != "kimi_k25_vision":
        raise ConfigError(f"vision_config model_type {vision['model_type']!r} is not MoonViT's.")

    def get(key: str, default: Any) -> Any:
        value = vision.get(key)
        return default if value is None else value

    defaults = MoonViTConfig()
    dim = get("hidden_size", defaults.dim)
    patch = get("patch_size", defaults.patch_size)
    grid = (get("pos_emb_height", 64), get("pos_emb_width", 64))
    merge = tuple(get("merge_kernel_size", (2, 2)))
    rope = get("rope_parameters", {})
    if set(rope) - {"rope_type", "rope_theta"}:
        raise ConfigError(f"vision rope_parameters {rope} are not supported (axial only).")
    act, rope_type = get("hidden_act", "gelu_pytorch_tanh"), rope.get("rope_type", "axial")
    projected = hf.get("projection_hidden_size") or dim
    checks = (
        ("patch_size", patch, isinstance(patch, int)),
        ("pos_emb_height/pos_emb_width", grid, grid[0] == grid[1]),
        ("merge_kernel_size", merge, len(merge) == 2 and merge[0] == merge[1]),
        ("hidden_act", act, act == "gelu_pytorch_tanh"),
        ("rope_type", rope_type, rope_type == "axial"),
        ("projection_hidden_size", projected, projected == dim),
    )
    for key, value, ok in checks:
        if not ok:
            raise ConfigError(
                f"vision {key}={value!r} is not supported: MoonViT computes square patches, a "
                "square position grid and merge, gelu_pytorch_tanh, axial rotary embeddings and "
                "a projector normalizing patches of the encoder's width."
            )
    if text.get("hidden_size") is None:
        raise ConfigError("text_config.hidden_size is missing: the projector's output width.")
    cfg = MoonViTConfig(
        patch_size=patch,
        dim=dim,
        num_layers=get("num_hidden_layers", defaults.num_layers),
        num_heads=get("num_attention_heads", defaults.num_heads),
        ffn_dim=get("intermediate_size", defaults.ffn_dim),
        pos_grid=grid[0],
        max_frames=get("pos_emb_time", defaults.max_frames),
        merge=merge[0],
        rope_theta=float(rope.get("rope_theta", defaults.rope_theta)),
        projector_norm_eps=float(hf.get("projection_layer_norm_eps", 1e-5)),
        text_dim=text["hidden_size"],
    )
    cfg.validate()
    return cfg


def config_to_hf(cfg: MoonViTConfig) -> dict[str, Any]:
    """The vision_config and projector keys of a Kimi K2.5 config.json for ``cfg``; ConfigError
    for what transformers' MoonViT does not compute (its LayerNorms' epsilon and the channels
    are fixed there)."""
    if cfg.num_channels != 3 or cfg.norm_eps != 1e-5:
        raise ConfigError(
            f"MoonViT with num_channels={cfg.num_channels}, norm_eps={cfg.norm_eps} cannot be "
            "exported: transformers' Kimi K2.5 vision tower has 3 channels and LayerNorm "
            "epsilon 1e-5."
        )
    vision = {
        "model_type": "kimi_k25_vision", "patch_size": cfg.patch_size,
        "pos_emb_height": cfg.pos_grid, "pos_emb_width": cfg.pos_grid,
        "pos_emb_time": cfg.max_frames, "num_attention_heads": cfg.num_heads,
        "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim, "hidden_act": "gelu_pytorch_tanh",
        "merge_kernel_size": [cfg.merge, cfg.merge],
        "rope_parameters": {"rope_type": "axial", "rope_theta": cfg.rope_theta},
    }  # fmt: skip
    return {"vision_config": vision, "projection_hidden_size": cfg.dim,
            "projection_layer_norm_eps": cfg.projector_norm_eps}  # fmt: skip
