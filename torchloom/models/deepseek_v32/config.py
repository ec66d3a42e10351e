"""DeepSeek-V3.2's architecture (``DeepSeekV32Config``): DeepSeek-V3 (multi-head latent
attention, DeepSeekMoE, multi-token prediction) whose every attention layer is DeepSeek sparse
attention ('dsa', models/components/dsa.py), and its flavors: ``debug`` and the published
DeepSeek-V3.2 (671B).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from torchloom.config.errors import ConfigError
from torchloom.models.components.decoder import MIXERS, LayerSpec, _residual_std
from torchloom.models.components.dsa import IndexerTrain, SparseLatentAttention
from torchloom.models.components.mla import mla_softmax_scale
from torchloom.models.deepseek_v3.config import DEEPSEEK_V3_FLAVORS, DeepSeekV3Config
from torchloom.models.transforms import register_transform


@dataclass(frozen=True)
class DeepSeekV32Config(DeepSeekV3Config):
    """Architecture of a DeepSeek-V3.2 decoder (one flavor of deepseek_v32): DeepSeek-V3 plus
    a lightning indexer per layer choosing the keys each query attends to."""

    index_topk: int = 2048
    """Keys each query attends to (the indexer's top-k; fewer visible keys: all of them)."""
    index_num_heads: int = 64
    """Heads of the lightning indexer."""
    index_head_dim: int = 128
    """Channels of each indexer head and of its one key per token (the first
    qk_rope_head_dim of them rotated by RoPE)."""
    indexer_train: IndexerTrain = "sparse"
    """How a training forward trains the indexer (DeepSeek-V3.2's two stages): 'warmup' (main
    attention dense, every parameter but the indexers' frozen, KL to the dense attention; the
    'dsa_warmup' transform sets it), 'sparse' (main attention over the picks, KL on the picked
    keys with the indexer's input detached), or 'off' (no indexer loss)."""
    indexer_loss_coef: float = 1.0
    """Weight of the indexer's KL loss (the auxiliary term 'indexer_kl')."""

    def layer_specs(self) -> list[LayerSpec]:
        return [
            LayerSpec("dsa", "swiglu" if i < self.first_dense_layers else "moe")
            for i in range(self.num_layers)
        ]

    def build(self) -> nn.Module:
        from torchloom.models.deepseek_v32.model import DeepSeekV32

        return DeepSeekV32(self)

    def validate(self) -> None:
        """Raise ConfigError naming the first impossible setting and how to fix it."""
        super().validate()
        if not self.q_lora_rank:
            raise ConfigError(
                "deepseek_v32 needs a low-rank query (q_lora_rank > 0): the indexer's queries "
                "are made from the query latent."
            )
        for name in ("index_topk", "index_num_heads", "index_head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model {name} must be positive, got {getattr(self, name)}.")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ConfigError(
                f"model index_head_dim ({self.index_head_dim}) must be at least "
                f"qk_rope_head_dim ({self.qk_rope_head_dim}): RoPE rotates that many channels."
            )
        if self.indexer_train not in ("off", "warmup", "sparse"):
            raise ConfigError(
                f"model indexer_train must be 'off', 'warmup' or 'sparse', got "
                f"{self.indexer_train!r}."
            )
        if self.indexer_loss_coef < 0:
            raise ConfigError(
                f"model indexer_loss_coef must be >= 0, got {self.indexer_loss_coef}."
            )
        if self.attn_backend != "sdpa":
            raise ConfigError(
                f"deepseek_v32 attends with SDPA under its top-k mask; attn_backend "
                f"{self.attn_backend!r} (batch-invariant mode sets one too) cannot take that "
                "mask. Keep --model.attn_backend sdpa and --model.batch_invariant false."
            )
        if self.indexer_train == "warmup" and self.moe.bias_update_rate:
            raise ConfigError(
                "indexer_train 'warmup' freezes everything but the indexers, but "
                f"moe.bias_update_rate {self.moe.bias_update_rate} would still move the routing "
                "bias; set it to 0 (the dsa_warmup transform does)."
            )


def _dsa(cfg: Any, layer: int) -> nn.Module:
    return SparseLatentAttention(
        cfg.dim, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim, cfg.v_head_dim, mla_softmax_scale(cfg.qk_head_dim, cfg.rope),
        rope_interleave=cfg.rope_interleave, norm_eps=cfg.latent_norm_eps,
        backend=cfg.attn_backend, norm_impl=cfg.norm_impl, rope_impl=cfg.rope_impl,
        init_std=cfg.init_std, out_std=_residual_std(cfg), index_num_heads=cfg.index_num_heads,
        index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
        indexer_train=cfg.indexer_train, indexer_loss_coef=cfg.indexer_loss_coef,
    )  # fmt: skip


MIXERS["dsa"] = _dsa


@register_transform("dsa_warmup")
def dsa_warmup(cfg: Any) -> Any:
    """DeepSeek-V3.2's dense warm-up: train only the indexers (KL to the dense attention)."""
    if not isinstance(cfg, DeepSeekV32Config):
        raise ConfigError(f"dsa_warmup applies to deepseek_v32 models, not {type(cfg).__name__}.")
    return replace(cfg, indexer_train="warmup", moe=replace(cfg.moe, bias_update_rate=0.0))


# -- flavors --------------------------------------------------------------------------------

DEEPSEEK_V32_FLAVORS: dict[str, DeepSeekV32Config] = {
    # deepseek_v3's debug model with a 2-head indexer picking 32 keys: sequences of the
    # debug recipe (128 tokens) really attend sparsely.
    "debug": DeepSeekV32Config(
        **{**vars(DEEPSEEK_V3_FLAVORS["debug"])},
        index_topk=32, index_num_heads=2, index_head_dim=16,
    ),
    # DeepSeek-V3.2 (deepseek-ai/DeepSeek-V3.2-Exp, -V3.2): the sizes, routing and indexer
    # (index_topk 2048, index_n_heads 64, index_head_dim 128) are transformers 5.24's
    # DeepseekV32Config defaults (its docstring names that checkpoint), max_position_embeddings
    # 163840 included; they equal deepseek_v3's 671B flavor, whose YaRN (factor 40 from 4096,
    # mscale 1.0) and one MTP depth the checkpoint keeps (transformers ignores its
    # model.layers.61 on load: _keys_to_ignore_on_load_unexpected).
    "671B": DeepSeekV32Config(
        **{**vars(DEEPSEEK_V3_FLAVORS["671B"])},
        index_topk=2048, index_num_heads=64, index_head_dim=128,
    ),
}  # fmt: skip
