"""Muse Glimmer's (and Muse Spark's) vision encoder: a ViT over 14-pixel patches with a learned,
resampled position table and 2-D axial RoPE, windowed attention in most layers, a 2x2 pixel
shuffle and a two-layer GELU adapter projected to the text width (Kimi K2.5's MoonViT lineage).

Fixed shapes: a batch holds N image slots per row, each padded to L patches (``pixel_values``
``[B, N, L, P]``, ``image_grid_thw`` ``[B, N, 3]``; zero rows for absent slots). An image's
patches fill the first t*h*w slots in the image processor's raster order (frame, row, column).
The encoder runs on ``[B*N, L, P]`` with attention masks built from the grid, so the shapes never
depend on the images, padding never changes a valid output and an absent slot gives zeros.
Merged tokens come out in the processor's placeholder order: image k's first
``merged_counts`` slots are the features of its <|patch|> tokens. The encoder follows the
``MediaEncoder`` protocol (models/components/multimodal.py; no DeepStack tokens). Shape letters: I = B*N
image slots, L patch slots, M = L / merge_size^2 merged tokens, d a head's width.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchloom.config.errors import ConfigError
from torchloom.models.components.mlp import GeluMLP
from torchloom.models.components.param_init import ParamInit, replicated_local


@dataclass(frozen=True)
class MuseVisionConfig:
    """The ViT, its pixel shuffle and the adapter into the text model's embedding space."""

    patch_size: int = 14
    """Side of a square patch, in pixels."""
    temporal_patch: int = 2
    """Frames per patch (an image's patch repeats its one frame this many times)."""
    dim: int = 1536
    """Width of the ViT."""
    num_layers: int = 50
    """ViT blocks."""
    num_heads: int = 16
    """Attention heads (head_dim = dim / num_heads, a multiple of 4 for the 2-D RoPE)."""
    ffn_dim: int = 8960
    """Hidden width of each block's GELU MLP."""
    pos_grid: int = 32
    """Side of the learned position table (bilinearly resampled to each image's grid); also the
    side, in patches, of the attention windows."""
    full_attention_interval: int = 4
    """Every this-many-th layer (and the last) attends over the whole frame; the rest attend
    within pos_grid x pos_grid windows."""
    merge_size: int = 2
    """The pixel shuffle folds merge_size x merge_size patches into one token."""
    rope_theta: float = 10000.0
    """Base of the axial RoPE frequencies."""
    norm_eps: float = 1e-5
    """Epsilon of the ViT's LayerNorms."""
    adapter_dim: int = 4096
    """Width of the adapter (HF projector_hidden_size)."""
    text_dim: int = 6656
    """Width of the text model the features are scattered into."""
    text_norm_eps: float = 1e-5
    """Epsilon of the scale-free RMSNorm applied last (the text model's rms_norm_eps)."""
    init_std: float = 0.02
    """Std of the initial weights."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        """P: values per patch, laid out (temporal, channel, row, column)."""
        return self.temporal_patch * 3 * self.patch_size**2

    def is_full_attention(self, layer: int) -> bool:
        return (layer + 1) % self.full_attention_interval == 0 or layer == self.num_layers - 1

    def validate(self) -> None:
        for name in ("patch_size", "temporal_patch", "dim", "num_layers", "num_heads",
                     "ffn_dim", "pos_grid", "full_attention_interval", "merge_size",
                     "adapter_dim", "text_dim"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ConfigError(f"vision {name} must be positive, got {getattr(self, name)}.")
        if self.dim % self.num_heads or self.head_dim % 4:
            raise ConfigError(
                f"vision dim {self.dim} must split into {self.num_heads} heads whose size is a "
                "multiple of 4 (the 2-D RoPE gives each axis half of every rotated pair)."
            )


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention with biases and 2-D RoPE over a masked patch set.
    Heads are counted from the projections' width (-1 heads), so a tensor-parallel split of
    q/k/v by columns (muse_glimmer/parallelize.py) runs each rank's heads."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // num_heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x_ILD, cos_ILd, sin_ILd, mask_I1LL) -> torch.Tensor:
        items, L, _ = x_ILD.shape
        q, k, v = (
            proj(x_ILD).view(items, L, -1, self.head_dim)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        q, k = (_rotate(t, cos_ILd, sin_ILd) for t in (q, k))
        out_IHLd = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask_I1LL
        )
        return self.o_proj(out_IHLd.transpose(1, 2).reshape(items, L, -1))


def _rotate(x_ILHd, cos_ILd, sin_ILd) -> torch.Tensor:
    """Rotate-half RoPE in fp32 (channel i pairs with i + d/2), cast back."""
    x = x_ILHd.float()
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    out = x * cos_ILd[:, :, None] + rotated * sin_ILd[:, :, None]
    return out.to(x_ILHd.dtype)


class VisionBlock(nn.Module):
    """Pre-LayerNorm block: x + attention(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, cfg: MuseVisionConfig) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = VisionAttention(cfg.dim, cfg.num_heads)
        self.mlp_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = GeluMLP(cfg.dim, cfg.ffn_dim)

    def forward(self, x_ILD, cos_ILd, sin_ILd, mask_I1LL) -> torch.Tensor:
        h_ILD = x_ILD + self.attention(self.attention_norm(x_ILD), cos_ILd, sin_ILd, mask_I1LL)
        return h_ILD + self.mlp(self.mlp_norm(h_ILD))


class VisionAdapter(nn.Module):
    """Merged patches to the text width: gelu(fc2(gelu(fc1(x)))), a projection, then a scale-free
    RMSNorm so image tokens arrive with the text embeddings' (normalized) scale."""

    def __init__(self, cfg: MuseVisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.dim * cfg.merge_size**2, cfg.adapter_dim, bias=False)
        self.fc2 = nn.Linear(cfg.adapter_dim, cfg.adapter_dim, bias=False)
        self.projection = nn.Linear(cfg.adapter_dim, cfg.text_dim, bias=False)
        self.eps = cfg.text_norm_eps

    def forward(self, x_IMK: torch.Tensor) -> torch.Tensor:
        h = self.projection(F.gelu(self.fc2(F.gelu(self.fc1(x_IMK)))))
        return F.rms_norm(h.float(), (h.shape[-1],), eps=self.eps).to(h.dtype)


class MuseVisionEncoder(nn.Module):
    """pixel_values [B, N, L, P] + image_grid_thw [B, N, 3] -> (features [B, N, L / m^2,
    text_dim], no DeepStack tokens): a ``MediaEncoder``."""

    def __init__(self, cfg: MuseVisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch_embed = nn.Linear(cfg.patch_dim, cfg.dim, bias=False)
        self.pos_embed = nn.Parameter(torch.empty(cfg.pos_grid**2, cfg.dim))
        self.norm_pre = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.layers = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.num_layers))
        self.norm_post = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.adapter = VisionAdapter(cfg)

    @property
    def merge_size(self) -> int:
        return self.config.merge_size

    def forward(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        cfg = self.config
        B, N, L, P = pixel_values.shape
        if cfg.patch_dim != P or L % cfg.merge_size**2:
            raise ValueError(
                f"pixel_values [B, N, L, P] = {tuple(pixel_values.shape)}: P must be "
                f"{cfg.patch_dim} and L a multiple of {cfg.merge_size**2}."
            )
        grid_I3 = image_grid_thw.reshape(B * N, 3)
        patches = _PatchGrid(grid_I3, L)
        pixels_ILP = pixel_values.reshape(B * N, L, P).to(self.patch_embed.weight.dtype)
        x_ILD = self.patch_embed(pixels_ILP)
        x_ILD = self.norm_pre(x_ILD + self._positions(patches).to(x_ILD.dtype))
        cos_ILd, sin_ILd = self._rope(patches)
        full_mask, window_mask = patches.attention_masks(cfg.pos_grid)
        for index, block in enumerate(self.layers):
            mask = full_mask if cfg.is_full_attention(index) else window_mask
            x_ILD = block(x_ILD, cos_ILd, sin_ILd, mask)
        merged_IMK = _pixel_shuffle(self.norm_post(x_ILD), grid_I3, cfg.merge_size)
        out_IMD = self.adapter(merged_IMK)
        slot_M = torch.arange(out_IMD.shape[1], device=out_IMD.device)
        valid_IM = slot_M < self.merged_counts(grid_I3)[:, None]
        out_IMD = torch.where(valid_IM[..., None], out_IMD, 0.0)
        return out_IMD.view(B, N, -1, out_IMD.shape[-1]), []

    def merged_counts(self, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """Tokens each image gives the text (t*h*w / merge_size^2; 0 for an absent slot)."""
        return image_grid_thw.prod(-1) // self.config.merge_size**2

    def _positions(self, patches: _PatchGrid) -> torch.Tensor:
        """The learned table resampled to each grid: bilinear, half-pixel centres, zero outside
        (grid_sample(align_corners=False, padding_mode="zeros")). As in the original, a frame's
        raster index k is read as the point (k // h, k % h) of a w x h grid, the table's rows
        sampled over w and its columns over h (for square grids: row, column)."""
        side = self.config.pos_grid
        k_IL, h_I, w_I = patches.within_frame, patches.h_I, patches.w_I
        rows, row_w = _bilinear_taps(k_IL // h_I[:, None], w_I, side)
        cols, col_w = _bilinear_taps(k_IL % h_I[:, None], h_I, side)
        index_IL4 = (rows[..., :, None] * side + cols[..., None, :]).flatten(-2)
        weight_IL4 = (row_w[..., :, None] * col_w[..., None, :]).flatten(-2)
        table = replicated_local(self.pos_embed)
        return (table[index_IL4] * weight_IL4[..., None].to(table.dtype)).sum(-2)

    def _rope(self, patches: _PatchGrid) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [I, L, head_dim] in fp32: the first quarter of a head's pairs turns with the
        column + 1, the second with the row + 1 (positions start at 1, as in the original)."""
        quarter = self.config.head_dim // 4
        exponent = torch.arange(quarter, device=patches.row.device, dtype=torch.float32) / quarter
        inv_freq_F = 1.0 / self.config.rope_theta**exponent
        col = (patches.col + 1).float()[..., None] * inv_freq_F
        row = (patches.row + 1).float()[..., None] * inv_freq_F
        angles = torch.cat((col, row, col, row), dim=-1)
        return angles.cos(), angles.sin()

    def init_weights(self, init: ParamInit) -> None:
        """Linear and position weights: truncated normal(0, init_std); biases 0; LayerNorms 1, 0."""
        std = self.config.init_std
        init.normal_(self.pos_embed, std)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                init.trunc_normal_(module.weight, std)
                if module.bias is not None:
                    init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                init.ones_(module.weight)
                init.zeros_(module.bias)

    def flops(self, image_grid_thw: torch.Tensor) -> int:
        """Training FLOPs (6 per weight a patch or merged token uses; attention 12 * dim per
        query-key pair) of the valid images in ``image_grid_thw`` [..., 3]; padding not counted."""
        cfg = self.config
        block = cfg.dim * cfg.dim * 4 + 2 * cfg.dim * cfg.ffn_dim
        adapter = cfg.adapter_dim * (cfg.dim * cfg.merge_size**2 + cfg.adapter_dim + cfg.text_dim)
        full = sum(cfg.is_full_attention(i) for i in range(cfg.num_layers))
        total = 0
        for t, h, w in image_grid_thw.reshape(-1, 3).tolist():
            patches = t * h * w
            if not patches:
                continue
            windows = sum(
                (min(cfg.pos_grid, h - r) * min(cfg.pos_grid, w - c)) ** 2
                for r in range(0, h, cfg.pos_grid) for c in range(0, w, cfg.pos_grid)
            )  # fmt: skip
            pairs = full * t * (h * w) ** 2 + (cfg.num_layers - full) * t * windows
            total += 6 * patches * (cfg.patch_dim * cfg.dim + cfg.num_layers * block)
            total += 12 * cfg.dim * pairs + 6 * (patches // cfg.merge_size**2) * adapter
        return total


class _PatchGrid:
    """Where each of an image's L slots sits: frame, row, column and validity, from the grid."""

    def __init__(self, grid_I3: torch.Tensor, L: int) -> None:
        t_I, h_I, w_I = grid_I3.unbind(-1)
        self.h_I, self.w_I = h_I.clamp(min=1), w_I.clamp(min=1)  # absent slots: no 0-division
        slot_L = torch.arange(L, device=grid_I3.device)
        area_I1 = (self.h_I * self.w_I)[:, None]
        self.valid = slot_L < (t_I * h_I * w_I)[:, None]
        self.frame = slot_L // area_I1
        self.within_frame = slot_L % area_I1
        self.row = self.within_frame // self.w_I[:, None]
        self.col = self.within_frame % self.w_I[:, None]

    def attention_masks(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[I, 1, L, L] boolean masks: valid patches of one frame (full layers) and of one
        window x window tile of it (windowed layers). A padding slot sees only itself, so no row
        is empty (no NaN) and no valid patch ever reads padding."""

        def pairs(key: torch.Tensor) -> torch.Tensor:
            return key[:, :, None] == key[:, None, :]

        valid = self.valid[:, :, None] & self.valid[:, None, :]
        eye = torch.eye(self.valid.shape[1], dtype=torch.bool, device=self.valid.device)
        full = valid & pairs(self.frame)
        tile = (self.row // window) * self.w_I[:, None] + self.col // window
        windowed = full & pairs(tile)
        return (full | eye)[:, None], (windowed | eye)[:, None]


def _bilinear_taps(coord_IL, size_I, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two table indices [I, L, 2] and their weights for resampling a ``side``-long axis to
    ``size`` points (align_corners=False); taps outside the table weigh 0."""
    src = (coord_IL.float() + 0.5) * side / size_I[:, None].float() - 0.5
    low = src.floor()
    frac = src - low
    taps = torch.stack((low, low + 1), dim=-1)
    weights = torch.stack((1 - frac, frac), dim=-1) * ((taps >= 0) & (taps <= side - 1))
    return taps.clamp(0, side - 1).long(), weights


def _pixel_shuffle(x_ILD: torch.Tensor, grid_I3: torch.Tensor, m: int) -> torch.Tensor:
    """[I, L, D] -> [I, L / m^2, D * m^2]: merged token j of a frame takes the m x m block j (blocks
    in raster order); its channels are laid out channel-major (d * m^2 + position in block)."""
    items, L, D = x_ILD.shape
    _, h_I, w_I = grid_I3.clamp(min=m).unbind(-1)
    bw_I1 = (w_I // m)[:, None]
    block_M = torch.arange(L // m**2, device=x_ILD.device)
    area_I1 = (h_I // m * bw_I1[:, 0])[:, None]
    frame, block = block_M // area_I1, block_M % area_I1
    top = frame * (h_I * w_I)[:, None] + (block // bw_I1) * m * w_I[:, None] + (block % bw_I1) * m
    offset_K = (torch.arange(m, device=x_ILD.device)[:, None] * w_I[:, None, None]
                + torch.arange(m, device=x_ILD.device)).flatten(-2)  # fmt: skip
    source_IMK = (top[..., None] + offset_K[:, None, :]).clamp(max=L - 1)
    gathered = x_ILD.gather(1, source_IMK.flatten(1)[..., None].expand(-1, -1, D))
    return gathered.view(items, -1, m * m, D).transpose(-1, -2).reshape(items, -1, D * m * m)


# -- Hugging Face ---------------------------------------------------------------------------

_HF_RENAMES = [
    (r"^patch_embed\.", "vision_tower.patch_embedder.patch_embedding."),
    (r"^pos_embed$", "vision_tower.patch_embedder.position_embedding_table.weight"),
    (r"^norm_pre\.", "vision_tower.ln_pre."),
    (r"^norm_post\.", "vision_tower.ln_post."),
    (r"^layers\.(\d+)\.attention_norm\.", r"vision_tower.layers.\1.norm1."),
    (r"^layers\.(\d+)\.mlp_norm\.", r"vision_tower.layers.\1.norm2."),
    (r"^layers\.(\d+)\.attention\.o_proj\.", r"vision_tower.layers.\1.attn.proj."),
    (r"^layers\.(\d+)\.attention\.", r"vision_tower.layers.\1.attn."),
    (r"^layers\.(\d+)\.mlp\.", r"vision_tower.layers.\1.mlp."),
    (r"^adapter\.projection\.", "vision_projection."),
    (r"^adapter\.", "vision_adapter."),
]


def muse_vision_hf_name(name: str, prefix: str = "model.") -> str:
    """The Hugging Face tensor (MuseGlimmer/MuseSpark ForConditionalGeneration) holding our
    parameter ``name``."""
    for pattern, replacement in _HF_RENAMES:
        hf, count = re.subn(pattern, replacement, name)
        if count:
            return prefix + hf
    raise KeyError(f"no Hugging Face name for vision parameter {name!r}")


def muse_vision_config_from_hf(hf: dict[str, Any], **overrides: Any) -> MuseVisionConfig:
    """Our config from a MuseGlimmer / MuseSpark ``config.json`` dict (the top level), refusing
    by name what this encoder does not implement."""
    vision, text = hf["vision_config"], hf["text_config"]
    merge, dim, grid = vision["merge_size"], vision["hidden_size"], vision["pos_emb_height"]
    cfg = MuseVisionConfig(
        patch_size=vision["patch_size"], temporal_patch=vision["patch_temporal"], dim=dim,
        num_layers=vision["num_hidden_layers"], num_heads=vision["num_attention_heads"],
        ffn_dim=vision["intermediate_size"], pos_grid=grid, merge_size=merge,
        rope_theta=vision["rope_parameters"]["rope_theta"], norm_eps=vision["layer_norm_eps"],
        adapter_dim=hf["projector_hidden_size"], text_dim=text["hidden_size"],
        text_norm_eps=text["rms_norm_eps"], **overrides,
    )  # fmt: skip
    layer_types = ["full_attention" if cfg.is_full_attention(i) else "window_attention"
                   for i in range(cfg.num_layers)]  # fmt: skip
    rope_type = vision["rope_parameters"]["rope_type"]
    checks = {
        "vision_config.hidden_act": (vision["hidden_act"], "gelu"),
        "projector_hidden_act": (hf["projector_hidden_act"], "gelu"),
        "vision_config.rope_parameters.rope_type": (rope_type, "axial"),
        "vision_config.pos_emb_width": (vision["pos_emb_width"], grid),
        "vision_config.layer_norm_eps": (vision["layer_norm_eps"], 1e-5),  # the blocks' fixed eps
        "out_hidden_size": (hf["out_hidden_size"], dim * merge**2),
        "vision_config.layer_types": (vision["layer_types"], layer_types),
    }
    for key, (value, supported) in checks.items():
        if value != supported:
            raise ConfigError(f"Muse vision {key} = {value!r} is not supported (only {supported}).")
    cfg.validate()
    return cfg
