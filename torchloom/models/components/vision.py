"""A native-resolution vision transformer (Qwen3-VL's), run at fixed shapes.

An image of ``t x h x w`` patches (each ``in_channels x temporal_patch_size x patch_size^2``
pixels, flattened) is embedded by one linear map, given a learned position embedding
bilinearly resized to its ``h x w`` grid, and run through pre-norm blocks whose attention turns
q and k by a 2-D RoPE of each patch's (row, col) and sees only the patches of the same frame.
A merger then joins each ``m x m`` window of patches (m = spatial_merge_size) into one token of
the language model's width; DeepStack mergers do the same on the outputs of a few early blocks,
for the decoder's first layers.

Fixed shapes, so compiled code and CUDA graphs see one shape whatever the images: the input is
``pixel_values [B, N, L, P]`` (N image slots per row, L patches per slot) with
``image_grid_thw [B, N, 3]`` (a zero row for an absent slot). An image's patches fill the
first t*h*w of its slot's L places in the processor's order (window-major: the m*m patches
of a merge window are consecutive, windows row by row, frame by frame); the rest is padding,
which attends only to itself and so changes nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchloom.config.errors import ConfigError
from torchloom.kernels.rope import apply_rotary
from torchloom.models.components.param_init import ParamInit


@dataclass(frozen=True)
class VisionConfig:
    """Architecture of the vision encoder (Hugging Face's ``vision_config``)."""

    depth: int = 2
    """Transformer blocks."""
    dim: int = 32
    """Width of the patch stream (hidden_size)."""
    ffn_dim: int = 64
    """Hidden width of each block's GELU MLP (intermediate_size)."""
    num_heads: int = 2
    """Attention heads; dim / num_heads must be a multiple of 4 (2-D RoPE)."""
    in_channels: int = 3
    """Image channels."""
    patch_size: int = 4
    """Pixels per patch side."""
    temporal_patch_size: int = 2
    """Frames per patch (an image is repeated to fill them)."""
    spatial_merge_size: int = 2
    """Side of the window of patches the merger joins into one token."""
    num_position_embeddings: int = 16
    """Rows of the learned position table, a square number: a side x side grid."""
    deepstack_layers: tuple[int, ...] = (0,)
    """Blocks (ascending) whose outputs a DeepStack merger turns into tokens added to the
    decoder's hidden states after its layers 0, 1, ... (deepstack_visual_indexes)."""
    rope_theta: float = 10000.0
    """Base of the 2-D RoPE frequencies."""
    norm_eps: float = 1e-6
    """Epsilon of every LayerNorm."""

    @property
    def patch_dim(self) -> int:
        """Numbers per flattened patch: in_channels * temporal_patch_size * patch_size^2."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def flops(self, image_grid_thw: torch.Tensor, out_dim: int) -> int:
        """Training FLOPs (forward + backward) of encoding the images of ``image_grid_thw``
        (``[..., 3]``, zero rows skipped) for a decoder of width ``out_dim``: 6 per matmul
        weight per patch (patch embedding, blocks), each block's attention over the patches of
        the patch's frame (QK^T and AV: 4 * dim * frame_patches, times 3), and 6 per merger
        weight per merged token (the merger and every DeepStack merger). Arithmetic on the
        config only, so it holds for a sharded or pipeline-split model."""
        block = 3 * self.dim * self.dim + self.dim * self.dim + 2 * self.dim * self.ffn_dim
        per_patch = self.patch_dim * self.dim + self.depth * block
        joined = self.dim * self.spatial_merge_size**2
        per_token = (1 + len(self.deepstack_layers)) * (joined * joined + joined * out_dim)
        total = 0
        for t, h, w in torch.as_tensor(image_grid_thw).reshape(-1, 3).tolist():
            patches = t * h * w
            attention = self.depth * 12 * self.dim * h * w
            total += patches * (6 * per_patch + attention)
            total += patches // self.spatial_merge_size**2 * 6 * per_token
        return total

    def validate(self) -> None:
        """Raise ConfigError naming the first impossible setting."""
        for name in ("depth", "dim", "ffn_dim", "num_heads", "in_channels", "patch_size",
                     "temporal_patch_size", "spatial_merge_size", "num_position_embeddings"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ConfigError(
                    f"model vision.{name} must be positive, got {getattr(self, name)}."
                )
        if self.dim % self.num_heads or (self.dim // self.num_heads) % 4:
            raise ConfigError(
                f"vision.dim ({self.dim}) / vision.num_heads ({self.num_heads}) must be a "
                "multiple of 4: the 2-D RoPE gives a quarter of each head to rows and to columns."
            )
        side = math.isqrt(self.num_position_embeddings)
        if side * side != self.num_position_embeddings:
            raise ConfigError(
                f"vision.num_position_embeddings ({self.num_position_embeddings}) must be a "
                "square number (a side x side grid of position embeddings)."
            )
        layers = list(self.deepstack_layers)
        if layers != sorted(set(layers)) or any(not 0 <= i < self.depth for i in layers):
            raise ConfigError(
                f"vision.deepstack_layers {layers} must be distinct block indices in "
                f"[0, depth={self.depth}), ascending."
            )


class VisionAttention(nn.Module):
    """Multi-head attention with biases over one image's patches, q and k turned by 2-D RoPE."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self, x_SLD: torch.Tensor, cos_SLd: torch.Tensor, sin_SLd: torch.Tensor,
        visible_S1LL: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        S, L, _ = x_SLD.shape
        # -1 heads: under tensor parallelism a rank's qkv holds its own heads' q, k and v.
        q, k, v = self.qkv(x_SLD).view(S, L, 3, -1, self.head_dim).unbind(2)
        q, k = apply_rotary(q, cos_SLd, sin_SLd), apply_rotary(k, cos_SLd, sin_SLd)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible_S1LL)
        return self.proj(out.transpose(1, 2).reshape(S, L, -1))


class PatchEmbed(nn.Module):
    """One linear map of each flattened patch: transformers' Conv3d whose stride is its
    kernel, applied as the matmul it amounts to."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Conv3d(
            cfg.in_channels, cfg.dim, (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size),
            stride=(cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size),
        )  # fmt: skip

    def forward(self, x_SLP: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(x_SLP.to(weight.dtype), weight.flatten(1), self.proj.bias)


class VisionMLP(nn.Module):
    """linear_fc2(gelu_tanh(linear_fc1(x))), with biases."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden)
        self.linear_fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    """x + attn(norm1(x)), then h + mlp(norm2(h)), LayerNorms."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = VisionAttention(cfg.dim, cfg.num_heads)
        self.norm2 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = VisionMLP(cfg.dim, cfg.ffn_dim)

    def forward(self, x_SLD, cos_SLd, sin_SLd, visible_S1LL) -> torch.Tensor:
        h_SLD = x_SLD + self.attn(self.norm1(x_SLD), cos_SLd, sin_SLd, visible_S1LL)
        return h_SLD + self.mlp(self.norm2(h_SLD))


class PatchMerger(nn.Module):
    """m x m consecutive patches -> one token: LayerNorm (per patch, or over the joined window
    with ``norm_joined``: DeepStack's), then a GELU MLP to the language model's width."""

    def __init__(self, cfg: VisionConfig, out_dim: int, norm_joined: bool) -> None:
        super().__init__()
        self.joined_dim = cfg.dim * cfg.spatial_merge_size**2
        self.norm_joined = norm_joined
        self.norm = nn.LayerNorm(self.joined_dim if norm_joined else cfg.dim, eps=cfg.norm_eps)
        self.linear_fc1 = nn.Linear(self.joined_dim, self.joined_dim)
        self.linear_fc2 = nn.Linear(self.joined_dim, out_dim)

    def forward(self, x_SLD: torch.Tensor) -> torch.Tensor:
        S = x_SLD.shape[0]
        if self.norm_joined:
            x_SQJ = self.norm(x_SLD.reshape(S, -1, self.joined_dim))
        else:
            x_SQJ = self.norm(x_SLD).reshape(S, -1, self.joined_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x_SQJ)))


class VisionEncoder(nn.Module):
    """pixel_values [B, N, L, P] + image_grid_thw [B, N, 3] -> merged tokens [B, N, L/m^2, D]
    and the DeepStack tokens (one such tensor per deepstack layer). Module names follow
    transformers' Qwen3VLVisionModel, so checkpoints map one to one."""

    def __init__(self, cfg: VisionConfig, out_dim: int, init_std: float = 0.02) -> None:
        super().__init__()
        self.cfg = cfg
        self.init_std = init_std
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.dim)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, out_dim, norm_joined=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(cfg, out_dim, norm_joined=True) for _ in cfg.deepstack_layers
        )

    def forward(
        self, pixel_values_BNLP: torch.Tensor, image_grid_thw_BN3: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        B, N, L, P = pixel_values_BNLP.shape
        x_SLD = self.patch_embed(pixel_values_BNLP.reshape(B * N, L, P))
        grid_S3 = image_grid_thw_BN3.reshape(-1, 3)
        frame_SL, row_SL, col_SL = self.patch_coordinates(grid_S3, L)
        x_SLD = x_SLD + self.interpolated_positions(row_SL, col_SL, grid_S3).to(x_SLD.dtype)
        cos_SLd, sin_SLd = self.rotary_tables(row_SL, col_SL)
        # A patch sees the valid patches of its own frame; a padding patch only itself.
        visible_S1LL = (frame_SL[:, :, None] == frame_SL[:, None, :])[:, None]
        deepstack = []
        for index, block in enumerate(self.blocks):
            x_SLD = block(x_SLD, cos_SLd, sin_SLd, visible_S1LL)
            if index in self.cfg.deepstack_layers:
                merger = self.deepstack_merger_list[self.cfg.deepstack_layers.index(index)]
                deepstack.append(merger(x_SLD).reshape(B, N, -1, merger.linear_fc2.out_features))
        merged = self.merger(x_SLD)
        return merged.reshape(B, N, -1, merged.shape[-1]), deepstack

    def patch_coordinates(
        self, grid_S3: torch.Tensor, L: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each of the L places' frame, row and col in its image (window-major order). A padding
        place's frame is negative and unique (-1 - place), so it matches no other place."""
        m = self.cfg.spatial_merge_size
        t_S1, h_S1, w_S1 = (grid_S3[:, i : i + 1] for i in range(3))
        place_1L = torch.arange(L, device=grid_S3.device)[None]
        per_frame_S1 = (h_S1 * w_S1).clamp(min=1)
        within_SL = place_1L % per_frame_S1
        windows_per_row_S1 = (w_S1 // m).clamp(min=1)
        window_SL = within_SL // (m * m)
        row_SL = (window_SL // windows_per_row_S1) * m + (within_SL // m) % m
        col_SL = (window_SL % windows_per_row_S1) * m + within_SL % m
        valid_SL = place_1L < t_S1 * h_S1 * w_S1
        frame_SL = torch.where(valid_SL, place_1L // per_frame_S1, -1 - place_1L)
        return frame_SL, row_SL, col_SL

    def interpolated_positions(
        self, row_SL: torch.Tensor, col_SL: torch.Tensor, grid_S3: torch.Tensor
    ) -> torch.Tensor:
        """The learned side x side position table resized to each image's h x w grid
        (bilinear, corners aligned), read at every place: [S, L, D]."""
        side = math.isqrt(self.cfg.num_position_embeddings)

        def taps(index_SL: torch.Tensor, size_S1: torch.Tensor) -> tuple[torch.Tensor, ...]:
            source_SL = index_SL.float() * (side - 1) / (size_S1 - 1).clamp(min=1)
            low_SL = source_SL.floor()
            frac_SL = source_SL - low_SL
            low = low_SL.long().clamp(0, side - 1)
            return low, (low + 1).clamp(max=side - 1), 1 - frac_SL, frac_SL

        h0, h1, wh0, wh1 = taps(row_SL, grid_S3[:, 1:2])
        w0, w1, ww0, ww1 = taps(col_SL, grid_S3[:, 2:3])
        index_SL4 = torch.stack(
            (h0 * side + w0, h0 * side + w1, h1 * side + w0, h1 * side + w1), -1
        )
        weight_SL4 = torch.stack((wh0 * ww0, wh0 * ww1, wh1 * ww0, wh1 * ww1), -1)
        return (self.pos_embed(index_SL4) * weight_SL4[..., None]).sum(-2)

    def rotary_tables(
        self, row_SL: torch.Tensor, col_SL: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [S, L, head_dim]: the first quarter of each half turns by the row, the
        second by the column (each at the same head_dim/4 frequencies)."""
        quarter = self.cfg.dim // self.cfg.num_heads // 4
        exponent = torch.arange(quarter, device=row_SL.device, dtype=torch.float32) / quarter
        inv_freq_F = 1.0 / self.cfg.rope_theta**exponent
        angles = torch.cat((row_SL[..., None] * inv_freq_F, col_SL[..., None] * inv_freq_F), -1)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    @property
    def merge_size(self) -> int:
        """Side of the window of patches the merger joins into one token."""
        return self.cfg.spatial_merge_size

    def merged_counts(self, image_grid_thw_BN3: torch.Tensor) -> torch.Tensor:
        """Merged tokens of every image slot, [B, N]: t * h * w / m^2 (0 for an absent slot)."""
        return image_grid_thw_BN3.prod(-1) // self.merge_size**2

    def flops(self, image_grid_thw: torch.Tensor) -> int:
        """Training FLOPs of encoding these images (VisionConfig.flops)."""
        return self.cfg.flops(image_grid_thw, self.merger.linear_fc2.out_features)

    @torch.no_grad()
    def init_weights(self, init: ParamInit) -> None:
        """Linears (patch embedding included) trunc_normal(init_std) with zero biases; the
        position table normal(init_std); LayerNorms ones and zeros."""
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Conv3d):
                init.trunc_normal_(module.weight, self.init_std)
                init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                init.ones_(module.weight)
                init.zeros_(module.bias)
        init.normal_(self.pos_embed.weight, self.init_std)
