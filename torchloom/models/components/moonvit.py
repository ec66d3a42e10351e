"""MoonViT, Kimi K2.5's vision encoder, with its patch merger and projector into the text model.

Each image (or video chunk of t frames) is cut into p x p patches in raster order; a patch's
pixels go through a linear patch embedding, to which a learned 2-D position grid, resampled
bicubically to the image's (h, w), is added (plus a sinusoid of the frame index for t > 1).
Pre-norm blocks (LayerNorm, attention with 2-D rotary embeddings, GELU MLP) attend over all
patches of one image and no other. After a final LayerNorm every 2 x 2 block of patches (averaged
over the frames) becomes one merged token; the projector (LayerNorm per patch, then a two-layer
GELU MLP over the concatenated block) maps it to the text model's width.

Fixed shapes: ``pixel_values [B, N, L, P]`` holds N image slots per row, each with up to L
patches of P = channels * p * p values (the order Kimi's image processor emits: frame, row,
column; within a patch channel, y, x); ``image_grid_thw [B, N, 3]`` gives (t, h, w) per slot,
zeros for an absent slot. The output is ``[B, N, L // merge**2, text_dim]``: slot n's first
h * w / merge**2 rows are its merged tokens in raster order of the merged grid, the rest zeros.
Padding patches never change the valid outputs and an absent slot gives zeros, not NaN.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchloom.config.errors import ConfigError
from torchloom.kernels.rope import apply_rotary
from torchloom.models.components.param_init import ParamInit, replicated_local


@dataclass(frozen=True)
class MoonViTConfig:
    """Architecture of MoonViT and its projector (Kimi K2.5: the defaults)."""

    patch_size: int = 14
    """Side of a square patch in pixels."""
    num_channels: int = 3
    """Colour channels of a pixel."""
    dim: int = 1152
    """Width of the encoder."""
    num_layers: int = 27
    """Encoder blocks."""
    num_heads: int = 16
    """Attention heads; dim / num_heads must be a multiple of 4 (2-D rotary pairs)."""
    ffn_dim: int = 4304
    """Hidden width of each block's GELU MLP."""
    pos_grid: int = 64
    """Side of the learned square position grid, resampled to every image's patch grid."""
    max_frames: int = 4
    """Frames of a video chunk transformers' temporal table holds (pos_emb_time); kept for
    export: the sinusoid here is computed for any frame count."""
    merge: int = 2
    """Side of the square block of patches merged into one token for the text model."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies over rows and columns."""
    norm_eps: float = 1e-5
    """Epsilon of the encoder's LayerNorms."""
    projector_norm_eps: float = 1e-5
    """Epsilon of the projector's LayerNorm."""
    text_dim: int = 7168
    """Width of the text model the merged tokens are projected to."""
    init_std: float = 0.02
    """Standard deviation of the initial weights (biases start at zero, norms at one)."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def patch_values(self) -> int:
        """P: the values of one patch, channels * patch_size**2."""
        return self.num_channels * self.patch_size**2

    def validate(self) -> None:
        """Raise ConfigError naming the first impossible setting and how to fix it."""
        for name in ("patch_size", "num_channels", "dim", "num_layers", "num_heads", "ffn_dim",
                     "pos_grid", "merge", "text_dim"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ConfigError(f"moonvit {name} must be positive, got {getattr(self, name)}.")
        for name in ("rope_theta", "norm_eps", "projector_norm_eps", "init_std"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"moonvit {name} must be positive, got {getattr(self, name)}.")
        if self.dim % self.num_heads or self.head_dim % 4:
            raise ConfigError(
                f"moonvit dim {self.dim} must split into {self.num_heads} heads of a width "
                "divisible by 4 (each head rotates pairs by row and by column); choose "
                "num_heads accordingly."
            )

    def build(self) -> MoonViT:
        return MoonViT(self)

    def num_params(self) -> int:
        """Parameter count of the encoder and projector."""
        return sum(p.numel() for p in _meta_model(self).parameters())


@functools.cache
def _meta_model(config: MoonViTConfig) -> MoonViT:
    with torch.device("meta"):
        return config.build()


def _init_linear(init: ParamInit, linear: nn.Linear, std: float) -> None:
    init.trunc_normal_(linear.weight, std)
    if linear.bias is not None:
        init.zeros_(linear.bias)


def _init_layer_norm(init: ParamInit, norm: nn.LayerNorm) -> None:
    init.ones_(norm.weight)
    init.zeros_(norm.bias)


class PatchLayout:
    """Where each of a slot's L patch places sits in its image (all [S, L], from the grids).

    Places past t * h * w (padding) get clamped, finite coordinates and ``valid`` False.
    """

    def __init__(self, grid_S3: torch.Tensor, length: int) -> None:
        t_S, h_S, w_S = grid_S3.unbind(-1)
        self.frames_S, self.height_S, self.width_S = t_S, h_S, w_S
        place_L = torch.arange(length, device=grid_S3.device)
        area_S1 = (h_S * w_S).clamp(min=1)[:, None]
        self.valid_SL = place_L < (t_S * h_S * w_S)[:, None]
        self.frame_SL = place_L // area_S1
        within_SL = place_L % area_S1
        self.row_SL = within_SL // w_S.clamp(min=1)[:, None]
        self.col_SL = within_SL % w_S.clamp(min=1)[:, None]


def _bicubic_taps(
    index: torch.Tensor, size: torch.Tensor, grid: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The four source cells (clamped to the grid) and weights that resample a ``grid``-long
    axis to ``size`` cells at target cell ``index``: F.interpolate's bicubic (Keys, a = -0.75)
    with align_corners=False."""
    a = -0.75
    source = (index.float() + 0.5) * grid / size.clamp(min=1).float() - 0.5
    base = source.floor()
    offsets = torch.arange(-1, 3, device=index.device)
    taps = (base.long()[..., None] + offsets).clamp(0, grid - 1)
    x = ((source - base)[..., None] - offsets).abs()  # distance to each tap, below 2
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return taps, torch.where(x <= 1, near, far)


class PatchEmbed(nn.Module):
    """A linear map of each patch's C * p * p values. The weight keeps a convolution's shape
    [dim, C, p, p] (a stride-p convolution over p x p patches is this matmul), so checkpoints
    load as they are."""

    def __init__(self, channels: int, patch_size: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, channels, patch_size, patch_size))
        self.bias = nn.Parameter(torch.empty(dim))

    def forward(self, pixels_SLP: torch.Tensor) -> torch.Tensor:
        return F.linear(pixels_SLP, self.weight.flatten(1), self.bias)

    def init_weights(self, init: ParamInit, std: float) -> None:
        init.trunc_normal_(self.weight, std)
        init.zeros_(self.bias)


class PositionEmbedding(nn.Module):
    """The learned grid resampled to each image's (h, w), plus sin/cos of the frame index for
    a clip of several frames (none for a single image)."""

    def __init__(self, grid: int, dim: int) -> None:
        super().__init__()
        self.grid = grid
        self.table = nn.Parameter(torch.empty(grid, grid, dim))

    def forward(self, layout: PatchLayout) -> torch.Tensor:
        """pos_SLD in fp32."""
        rows, row_w = _bicubic_taps(layout.row_SL, layout.height_S[:, None], self.grid)
        cols, col_w = _bicubic_taps(layout.col_SL, layout.width_S[:, None], self.grid)
        S, L = rows.shape[:2]
        cells_SL16 = (rows[..., :, None] * self.grid + cols[..., None, :]).reshape(S * L, 16)
        weights_SL16 = (row_w[..., :, None] * col_w[..., None, :]).reshape(S * L, 16)
        table = replicated_local(self.table).flatten(0, 1)
        # A weighted sum of 16 rows per patch without materializing [S, L, 16, D].
        pos = F.embedding_bag(cells_SL16, table, per_sample_weights=weights_SL16.to(table.dtype),
                              mode="sum")  # fmt: skip
        pos_SLD = pos.view(S, L, -1).float()
        dim = pos_SLD.shape[-1]
        inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, device=pos.device).float() / dim)
        angle_SLF = layout.frame_SL[..., None].float() * inv_freq
        temporal_SLD = torch.cat((angle_SLF.sin(), angle_SLF.cos()), dim=-1)
        is_clip_S11 = (layout.frames_S > 1)[:, None, None]
        return pos_SLD + torch.where(is_clip_S11, temporal_SLD, 0.0)

    def init_weights(self, init: ParamInit, std: float) -> None:
        init.trunc_normal_(self.table, std)


def rotary_tables(
    layout: PatchLayout, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_SLd, sin_SLd of the 2-D rotary embedding in the "rotate half" layout: the first half
    of a head alternates column and row angles over head_dim / 4 frequencies; the second half
    repeats them."""
    quarter = torch.arange(0, head_dim // 2, 2, device=layout.row_SL.device).float()
    inv_freq_F = 1.0 / theta ** (quarter / (head_dim // 2))
    cols_SLF = layout.col_SL[..., None].float() * inv_freq_F
    rows_SLF = layout.row_SL[..., None].float() * inv_freq_F
    half_SLd = torch.stack((cols_SLF, rows_SLF), dim=-1).flatten(-2)
    angles_SLd = torch.cat((half_SLd, half_SLd), dim=-1)
    return angles_SLd.cos(), angles_SLd.sin()


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention over the patches of one image, with biases."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim)

    def forward(
        self, x_SLD: torch.Tensor, cos_SLd: torch.Tensor, sin_SLd: torch.Tensor,
        keys_S11L: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        S, L, _ = x_SLD.shape
        # -1 heads: under tensor parallelism a rank's projections hold its share of them.
        q, k, v = (p(x_SLD).view(S, L, -1, self.head_dim)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # fmt: skip
        # Rotated in fp32 and cast back, as the reference does.
        q, k = (apply_rotary(t.float(), cos_SLd, sin_SLd).to(t.dtype) for t in (q, k))
        # torch's SDPA directly: the ATTENTION_BACKENDS are causal, this is not.
        out_SHLd = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=keys_S11L
        )
        return self.o_proj(out_SHLd.transpose(1, 2).reshape(S, L, -1))

    def init_weights(self, init: ParamInit, std: float) -> None:
        for linear in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            _init_linear(init, linear, std)


class VisionMLP(nn.Module):
    """fc2(gelu_tanh(fc1(x))), with biases."""

    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, dim)

    def forward(self, x_SLD: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x_SLD), approximate="tanh"))

    def init_weights(self, init: ParamInit, std: float) -> None:
        _init_linear(init, self.fc1, std)
        _init_linear(init, self.fc2, std)


class VisionBlock(nn.Module):
    """x + attention(norm(x)), then h + mlp(norm(h)); LayerNorms with biases."""

    def __init__(self, cfg: MoonViTConfig) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = VisionAttention(cfg.dim, cfg.num_heads)
        self.mlp_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = VisionMLP(cfg.dim, cfg.ffn_dim)

    def forward(
        self, x_SLD: torch.Tensor, cos_SLd: torch.Tensor, sin_SLd: torch.Tensor,
        keys_S11L: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        h_SLD = x_SLD + self.attention(self.attention_norm(x_SLD), cos_SLd, sin_SLd, keys_S11L)
        return h_SLD + self.mlp(self.mlp_norm(h_SLD))

    def init_weights(self, init: ParamInit, std: float) -> None:
        _init_layer_norm(init, self.attention_norm)
        self.attention.init_weights(init, std)
        _init_layer_norm(init, self.mlp_norm)
        self.mlp.init_weights(init, std)


class Projector(nn.Module):
    """A merged token's merge**2 patches, each LayerNorm'd, concatenated, then
    out_proj(gelu(in_proj(.))) to the text model's width."""

    def __init__(self, cfg: MoonViTConfig) -> None:
        super().__init__()
        merged = cfg.dim * cfg.merge**2
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.projector_norm_eps)
        self.in_proj = nn.Linear(merged, merged)
        self.out_proj = nn.Linear(merged, cfg.text_dim)

    def forward(self, blocks_SMKD: torch.Tensor) -> torch.Tensor:
        x_SMC = self.norm(blocks_SMKD).flatten(-2)
        return self.out_proj(F.gelu(self.in_proj(x_SMC)))

    def init_weights(self, init: ParamInit, std: float) -> None:
        _init_layer_norm(init, self.norm)
        _init_linear(init, self.in_proj, std)
        _init_linear(init, self.out_proj, std)


class MoonViT(nn.Module):
    """Images at fixed shapes -> merged, projected tokens for the text model (see the module
    docstring for the layout)."""

    def __init__(self, cfg: MoonViTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg.num_channels, cfg.patch_size, cfg.dim)
        self.pos_embed = PositionEmbedding(cfg.pos_grid, cfg.dim)
        self.layers = nn.ModuleDict({str(i): VisionBlock(cfg) for i in range(cfg.num_layers)})
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.projector = Projector(cfg)

    @property
    def merge_size(self) -> int:
        """Side of the square block of patches merged into one token."""
        return self.config.merge

    def forward(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """[B, N, L, P] pixels and [B, N, 3] grids -> ([B, N, L // merge**2, text_dim], []):
        the merged tokens, and no DeepStack tokens (the MediaEncoder protocol of
        models/components/multimodal.py)."""
        B, N, L, P = pixel_values.shape
        layout = PatchLayout(image_grid_thw.reshape(B * N, 3), L)
        x_SLD = self.patch_embed(pixel_values.reshape(B * N, L, P))
        x_SLD = x_SLD + self.pos_embed(layout).to(x_SLD.dtype)
        cos_SLd, sin_SLd = rotary_tables(layout, self.config.head_dim, self.config.rope_theta)
        # A patch sees the patches of its own image; an absent slot's padding sees all of its
        # own padding instead of nothing (softmax over no key is NaN), and is zeroed at the end.
        absent_S1 = ~layout.valid_SL.any(dim=1, keepdim=True)
        keys_S11L = (layout.valid_SL | absent_S1)[:, None, None, :]
        for block in self.layers.values():
            x_SLD = block(x_SLD, cos_SLd, sin_SLd, keys_S11L)
        blocks_SMKD = self.merge_patches(self.norm(x_SLD), layout)
        out_SMT = self.projector(blocks_SMKD)
        M = out_SMT.shape[1]
        counts_S1 = self.merged_counts(image_grid_thw).reshape(B * N, 1)
        valid_SM1 = (torch.arange(M, device=out_SMT.device) < counts_S1)[..., None]
        return torch.where(valid_SM1, out_SMT, 0.0).view(B, N, M, -1), []

    def merge_patches(self, x_SLD: torch.Tensor, layout: PatchLayout) -> torch.Tensor:
        """[S, L // k**2, k**2, D] (k = merge): each merged token's k x k patches in raster
        order, averaged over the frames (in fp32); padding patches land in a dropped row."""
        k = self.config.merge
        S, L, D = x_SLD.shape
        M = L // (k * k)
        merged_width_S1 = (layout.width_S // k).clamp(min=1)[:, None]
        token_SL = (layout.row_SL // k) * merged_width_S1 + layout.col_SL // k
        in_block_SL = (layout.row_SL % k) * k + layout.col_SL % k
        target_SL = torch.where(layout.valid_SL, token_SL * k * k + in_block_SL, M * k * k)
        weight_SL = torch.where(layout.valid_SL, 1.0 / layout.frames_S.clamp(min=1)[:, None], 0.0)
        pooled = x_SLD.new_zeros(S, M * k * k + 1, D, dtype=torch.float32)
        pooled = pooled.scatter_add(
            1, target_SL[..., None].expand(S, L, D), x_SLD.float() * weight_SL[..., None]
        )
        return pooled[:, :-1].view(S, M, k * k, D).to(x_SLD.dtype)

    def merged_counts(self, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """Merged tokens of each slot, h * w / merge**2 (0 for an absent slot), shaped like the
        grids without their last dim: how many image placeholder tokens each image takes."""
        return image_grid_thw[..., 1] * image_grid_thw[..., 2] // self.config.merge**2

    def flops(self, image_grid_thw: torch.Tensor) -> int:
        """Training FLOPs (forward + backward) of encoding the images of ``image_grid_thw``
        ([..., 3], zero rows for absent slots) and projecting their merged tokens: 6 per matmul
        weight per patch (patch embedding, each block's projections and MLP), attention over
        the t * h * w patches of each image (QK^T and AV: 2 * 2 * dim * n per patch and layer,
        times 3), and 6 per projector weight per merged token. Norms, biases, position
        embeddings and the merge are not counted."""
        cfg = self.config
        per_patch = self.patch_embed.weight.numel()
        for block in self.layers.values():
            matmuls = (block.attention.q_proj, block.attention.k_proj, block.attention.v_proj,
                       block.attention.o_proj, block.mlp.fc1, block.mlp.fc2)  # fmt: skip
            per_patch += sum(m.weight.numel() for m in matmuls)
        per_token = self.projector.in_proj.weight.numel() + self.projector.out_proj.weight.numel()
        total = 0
        for t, h, w in image_grid_thw.reshape(-1, 3).tolist():
            patches = t * h * w
            attention = cfg.num_layers * 12 * cfg.dim * patches * patches
            total += 6 * per_patch * patches + attention + 6 * per_token * (h * w // cfg.merge**2)
        return total

    @torch.no_grad()
    def init_weights(self, init: ParamInit | int = 0) -> None:
        """Every parameter from a seed (or a ParamInit): weights normal(0, init_std) truncated
        at 3 std, biases zero, LayerNorms one and zero."""
        if isinstance(init, int):
            init = ParamInit(self, init)
        std = self.config.init_std
        self.patch_embed.init_weights(init, std)
        self.pos_embed.init_weights(init, std)
        for block in self.layers.values():
            block.init_weights(init, std)
        _init_layer_norm(init, self.norm)
        self.projector.init_weights(init, std)
        init.check_complete(self)
