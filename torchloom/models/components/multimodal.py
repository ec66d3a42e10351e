"""Media in the decoder: image tokens scattered into the text embedding at fixed shapes, and
``MultimodalDecoder``, the generic decoder with a vision encoder in front of it.

A row's media are ``pixel_values [B, N, L, P]`` and ``image_grid_thw [B, N, 3]`` (see
models/components/vision.py). The k-th placeholder token (``image_token_id``) of row b takes
the k-th valid merged token of row b: images in slot order, an image's tokens in the
processor's order. The gather index comes from cumulative sums and a sorted search, so no shape
depends on the data (torch.compile and CUDA graphs see one graph).
"""

from __future__ import annotations

from typing import Any

import torch

from torchloom.config.errors import ConfigError
from torchloom.data.mrope import mrope_positions
from torchloom.models.components.cache import ModelCache
from torchloom.models.components.decoder import Decoder, DecoderConfig, LayerInputs
from torchloom.models.components.param_init import ParamInit
from torchloom.models.components.vision import VisionEncoder

MEDIA_KEYS = ("pixel_values", "image_grid_thw")
"""The keys of a multimodal batch's ``media`` dict."""


def merged_counts(image_grid_thw_BN3: torch.Tensor, spatial_merge_size: int) -> torch.Tensor:
    """Merged tokens of every image slot, [B, N] (0 for an absent slot)."""
    return image_grid_thw_BN3.prod(-1) // spatial_merge_size**2


def placeholder_sources(
    tokens_BT: torch.Tensor, counts_BN: torch.Tensor, per_slot: int, image_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(is_image_BT, source_BT): which tokens are placeholders, and for each, its merged token's
    index in the row's [N * per_slot] flattened slots (0 for the other tokens)."""
    is_image_BT = tokens_BT == image_token_id
    rank_BT = is_image_BT.long().cumsum(1) - 1  # the k of the k-th placeholder
    ends_BN = counts_BN.long().cumsum(1)
    slot_BT = torch.searchsorted(ends_BN, rank_BT.clamp(min=0), right=True)
    slot_BT = slot_BT.clamp(max=counts_BN.shape[1] - 1)
    starts_BT = (ends_BN - counts_BN.long()).gather(1, slot_BT)
    within_BT = (rank_BT - starts_BT).clamp(0, per_slot - 1)
    return is_image_BT, torch.where(is_image_BT, slot_BT * per_slot + within_BT, 0)


def gather_tokens(features_BNQD: torch.Tensor, source_BT: torch.Tensor) -> torch.Tensor:
    """features_BNQD's tokens at ``source_BT`` (indices into each row's N * Q tokens): [B, T, D]."""
    B, N, Q, D = features_BNQD.shape
    index_BTD = source_BT[..., None].expand(-1, -1, D)
    return features_BNQD.reshape(B, N * Q, D).gather(1, index_BTD)


def check_media(
    tokens_BT: torch.Tensor,
    media: dict[str, torch.Tensor],
    image_token_id: int,
    spatial_merge_size: int,
) -> None:
    """ConfigError (one line) unless every row's placeholder count equals its images' merged
    token count and every image fits its slot as whole merge windows. Reads the tensors on the
    host: call it where they are there (the data layer), not in a compiled step."""
    pixel_values, grid_BN3 = media["pixel_values"], media["image_grid_thw"].cpu()
    L, m = pixel_values.shape[2], spatial_merge_size
    if L % (m * m):
        raise ConfigError(
            f"pixel_values has {L} patches per image slot, not a multiple of {m * m}."
        )
    for row, grids in enumerate(grid_BN3.tolist()):
        for slot, (t, h, w) in enumerate(grids):
            if t * h * w > L or h % m or w % m:
                raise ConfigError(
                    f"row {row} image slot {slot}: grid {t}x{h}x{w} does not fit {L} patches "
                    f"as whole {m}x{m} merge windows."
                )
    placeholders = (tokens_BT == image_token_id).sum(1).cpu().tolist()
    features = merged_counts(grid_BN3, m).sum(1).tolist()
    for row, (have, need) in enumerate(zip(placeholders, features, strict=True)):
        if have != need:
            raise ConfigError(
                f"row {row} has {have} image placeholder tokens but its images give {need} "
                f"merged tokens (image_grid_thw {grid_BN3[row].tolist()})."
            )


def media_flops(config: DecoderConfig, media: dict[str, torch.Tensor] | None) -> int:
    """Training FLOPs of the vision encoder of ``config`` on ``media``'s images (0 for text or
    a model without one): VisionConfig.flops, from the config and the grids only, so it holds
    however the model is sharded or split. A decoder's flops_per_token counts the text."""
    vision = getattr(config, "vision", None)
    if not media or vision is None:
        return 0
    return vision.flops(media["image_grid_thw"], config.dim)


class MultimodalCache(ModelCache):
    """ModelCache plus each slot's M-RoPE offset (``rope_delta_S``): past a prompt's images, a
    token's rotary position is its cache position + the offset on all three axes (Qwen-VL's
    rope_deltas: the prompt's largest M-RoPE position + 1 - its length; 0 for text), while the
    layers' states stay indexed by cache position. The model sets it when a row starts its
    sequence and reads it in every later forward, so decode steps (CUDA graphs included) need
    no host work and the engine stays generic."""

    def __init__(self, cache: ModelCache) -> None:
        super().__init__(cache.states, cache.slots, cache.max_len, cache.device)
        self.rope_delta_S = torch.zeros(cache.slots, dtype=torch.int64, device=cache.device)

    def copy_slot(self, src_slot: int, dst_slots: list[int], length: int) -> None:
        super().copy_slot(src_slot, dst_slots, length)
        self.rope_delta_S[dst_slots] = self.rope_delta_S[src_slot].clone()


class MultimodalDecoder(Decoder):
    """The generic decoder with a vision encoder (``visual``) in front: the placeholders'
    embeddings are replaced by the image tokens, and the encoder's DeepStack tokens are added
    to the hidden states at the placeholders after the first ``len(deepstack)`` layers.

    The config adds to DecoderConfig's protocol: ``vision`` (a VisionConfig),
    ``image_token_id``, ``vision_start_token_id``, and a ``rotary()`` that reads ``[B, T, 3]``
    (t, h, w) positions (MRotaryEmbedding). ``media`` is passed by keyword; None or empty runs
    the text model. A pipeline stage without ``embed_tokens`` has no ``visual``.
    """

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__(cfg)
        self.visual: VisionEncoder | None = VisionEncoder(cfg.vision, cfg.dim, cfg.init_std)

    def forward_hidden(
        self,
        tokens_BT: torch.Tensor,
        positions_BT: torch.Tensor | None = None,
        doc_ids_BT: torch.Tensor | None = None,
        cache: ModelCache | None = None,
        *,
        media: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Final hidden states. positions: ``[B, T, 3]`` M-RoPE positions (data/mrope.py), or
        ``[B, T]`` for text; left out with media, they are computed here on the host. With a
        generation ``cache`` they are the tokens' cache positions ``[B, T]``, and the rotary
        positions come from ``generation_positions``."""
        media = media if media and self.visual is not None else None
        if isinstance(cache, MultimodalCache):
            positions_BT = self.generation_positions(tokens_BT, cache, media)
        elif media is not None and positions_BT is None:
            positions_BT = self.mrope_positions(tokens_BT, media["image_grid_thw"])
        inputs = self.layer_inputs(tokens_BT, positions_BT, doc_ids_BT, cache)
        h_BTD = self.embed_tokens(tokens_BT) if self.embed_tokens is not None else tokens_BT
        deepstack: list[torch.Tensor] = []
        if media is not None:
            h_BTD, deepstack = self.embed_media(tokens_BT, h_BTD, media)
        h_BTD = self.run_blocks(h_BTD, inputs, cache, deepstack)
        return self.norm(h_BTD) if self.norm is not None else h_BTD

    def embed_media(
        self, tokens_BT: torch.Tensor, h_BTD: torch.Tensor, media: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The embeddings with the image tokens at the placeholders, and the DeepStack
        additions (zero away from the placeholders), one [B, T, D] per deepstack layer."""
        cfg = self.config
        grid_BN3 = media["image_grid_thw"]
        if tokens_BT.device.type == "cpu" and not torch.compiler.is_compiling():
            check_media(tokens_BT, media, cfg.image_token_id, cfg.vision.spatial_merge_size)
        merged_BNQD, deepstack_BNQD = self.visual(media["pixel_values"], grid_BN3)
        counts_BN = merged_counts(grid_BN3, cfg.vision.spatial_merge_size)
        is_image_BT, source_BT = placeholder_sources(
            tokens_BT, counts_BN, merged_BNQD.shape[2], cfg.image_token_id
        )
        is_image_BT1 = is_image_BT[..., None]
        images_BTD = gather_tokens(merged_BNQD, source_BT).to(h_BTD.dtype)
        h_BTD = torch.where(is_image_BT1, images_BTD, h_BTD)
        deepstack = [
            torch.where(is_image_BT1, gather_tokens(d, source_BT).to(h_BTD.dtype), 0.0)
            for d in deepstack_BNQD
        ]
        return h_BTD, deepstack

    def run_blocks(
        self,
        h_BTD: torch.Tensor,
        inputs: LayerInputs,
        cache: ModelCache | None = None,
        deepstack: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The blocks in order, adding ``deepstack[i]`` after layer i."""
        deepstack = deepstack or []
        for name, block in self.layers.items():
            layer_cache = None if cache is None else cache.layer(int(name))
            h_BTD = block(h_BTD, *inputs, cache=layer_cache)
            if int(name) < len(deepstack):
                h_BTD = h_BTD + deepstack[int(name)]
        return h_BTD

    def forward(
        self,
        tokens_BT: torch.Tensor,
        positions_BT: torch.Tensor | None = None,
        doc_ids_BT: torch.Tensor | None = None,
        *,
        cache: ModelCache | None = None,
        objective: Any = None,
        targets: dict[str, torch.Tensor] | None = None,
        media: dict[str, torch.Tensor] | None = None,
    ) -> Any:
        """Decoder.forward with the row's ``media`` (MEDIA_KEYS) by keyword."""
        h_BTD = self.forward_hidden(tokens_BT, positions_BT, doc_ids_BT, cache, media=media)
        if not self.has_head:
            return h_BTD
        if objective is not None:
            return objective(h_BTD, self, targets or {})
        return self.logits(h_BTD)

    def mrope_positions(self, tokens_BT: torch.Tensor, grid_BN3: torch.Tensor) -> torch.Tensor:
        """[B, T, 3] positions of every row (data/mrope.py), computed on the host."""
        cfg = self.config
        rows = [
            mrope_positions(tokens, grid, cfg.image_token_id, cfg.vision_start_token_id,
                            cfg.vision.spatial_merge_size)
            for tokens, grid in zip(tokens_BT.cpu(), grid_BN3.cpu(), strict=True)
        ]  # fmt: skip
        return torch.stack(rows).to(tokens_BT.device)

    def generation_positions(
        self, tokens_BT: torch.Tensor, cache: MultimodalCache, media: dict[str, torch.Tensor] | None
    ) -> torch.Tensor:
        """[B, T, 3] rotary positions of a forward bound to ``cache``: each token's cache
        position + its slot's offset on all three axes, except that the tokens of a row that
        starts its sequence take their M-RoPE positions (``start_sequences``)."""
        binding = cache.binding
        prompts = {} if binding.leading else self.start_sequences(tokens_BT, cache, media)
        rotary_BT = binding.positions_BT + cache.rope_delta_S[binding.slot_ids_B][:, None]
        rotary_BT3 = rotary_BT[..., None].repeat(1, 1, 3)
        for row, prompt_L3 in prompts.items():
            rotary_BT3[row, : len(prompt_L3)] = prompt_L3
        return rotary_BT3

    def start_sequences(
        self, tokens_BT: torch.Tensor, cache: MultimodalCache, media: dict[str, torch.Tensor] | None
    ) -> dict[int, torch.Tensor]:
        """For each row of the bound forward at cache position 0 (a prefill: the host may be
        read), set its slot's offset: 0 without images, else its largest M-RoPE position + 1 -
        its length. Returns the M-RoPE positions [length, 3] of the rows with images."""
        binding = cache.binding
        prompts: dict[int, torch.Tensor] = {}
        for row in (binding.positions_BT[:, 0] == 0).nonzero().flatten().tolist():
            slot = binding.slot_ids_B[row]
            grid_1N3 = None if media is None else media["image_grid_thw"][row : row + 1]
            if grid_1N3 is None or not bool(grid_1N3.any()):
                cache.rope_delta_S[slot] = 0
                continue
            length = tokens_BT.shape[1]
            if binding.lengths_B is not None:
                length = int(binding.lengths_B[row])
            prompts[row] = self.mrope_positions(tokens_BT[row : row + 1, :length], grid_1N3)[0]
            cache.rope_delta_S[slot] = prompts[row].max() + 1 - length
        return prompts

    def new_cache(
        self, slots: int, max_len: int, device: torch.device, dtype: torch.dtype
    ) -> MultimodalCache:
        """The decoder's cache with each slot's M-RoPE offset (MultimodalCache)."""
        return MultimodalCache(super().new_cache(slots, max_len, device, dtype))

    def media_flops(self, media: dict[str, torch.Tensor] | None) -> int:
        """Training FLOPs of the vision encoder on this batch's images (``media_flops``);
        flops_per_token stays the text model's."""
        return media_flops(self.config, media) if self.visual is not None else 0

    @torch.no_grad()
    def init_weights(self, init: ParamInit | int = 0) -> None:
        """The encoder's weights (VisionEncoder.init_weights), then the decoder's."""
        if isinstance(init, int):
            init = ParamInit(self, init)
        if self.visual is not None:
            self.visual.init_weights(init)
        super().init_weights(init)
