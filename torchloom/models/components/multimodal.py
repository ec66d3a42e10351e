"""Media in the decoder: image (and audio) tokens scattered into the text embedding at fixed
shapes (``MediaEmbedding``, a mixin for any decoder model holding a ``MediaEncoder`` and,
optionally, an ``AudioEncoder``), and ``MultimodalDecoder``, the generic decoder with Qwen3-VL's
vision encoder in front of it.

A row's images are ``pixel_values [B, N, L, P]`` and ``image_grid_thw [B, N, 3]`` (see
models/components/vision.py); its audio clips ``audio_values [B, A, S, 1]`` and
``audio_lengths [B, A]`` (see models/components/audio.py). The k-th placeholder token
(``image_token_id``) of row b takes the k-th valid merged token of row b: images in slot order,
an image's tokens in the processor's order; audio likewise (``audio_token_id``, clips in slot
order). The gather index comes from cumulative sums and a sorted search, so no shape depends on
the data (torch.compile and CUDA graphs see one graph).
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from torchloom.config.errors import ConfigError
from torchloom.data.mrope import mrope_positions
from torchloom.models.components.cache import ModelCache
from torchloom.models.components.decoder import Decoder, DecoderConfig, LayerInputs
from torchloom.models.components.param_init import ParamInit
from torchloom.models.components.vision import VisionEncoder

MEDIA_KEYS = ("pixel_values", "image_grid_thw")
"""The image keys of a multimodal batch's ``media`` dict."""
AUDIO_KEYS = ("audio_values", "audio_lengths")
"""The audio keys of a ``media`` dict (models with an audio encoder)."""


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
    encoder: MediaEncoder,
    audio: tuple[int, AudioEncoder] | None = None,
) -> None:
    """ConfigError (one line) unless every row's placeholder count equals its images' merged
    token count (``encoder.merged_counts``) and every image fits its slot as whole merge
    windows; with ``audio`` (its placeholder id and encoder), the same for the audio
    placeholders and the clips' tokens (``audio_output_lengths``). Reads the tensors on the
    host: call it where they are there (the data layer), not in a compiled step."""
    if "pixel_values" in media:
        _check_images(media, encoder)
        grid_BN3 = media["image_grid_thw"].cpu()
        counts = encoder.merged_counts(grid_BN3)
        _check_counts(tokens_BT, image_token_id, counts, "image", "images", "merged",
                      "image_grid_thw", grid_BN3)  # fmt: skip
    else:
        _check_counts(tokens_BT, image_token_id, None, "image", "images", "merged")
    if audio is None:
        return
    audio_token_id, audio_encoder = audio
    if "audio_values" in media:
        lengths_BA = media["audio_lengths"].cpu()
        counts = audio_encoder.audio_output_lengths(lengths_BA)
        _check_counts(tokens_BT, audio_token_id, counts, "audio", "clips", "audio",
                      "audio_lengths", lengths_BA)  # fmt: skip
    else:
        _check_counts(tokens_BT, audio_token_id, None, "audio", "clips", "audio")


def _check_images(media: dict[str, torch.Tensor], encoder: MediaEncoder) -> None:
    pixel_values, grid_BN3 = media["pixel_values"], media["image_grid_thw"].cpu()
    L, m = pixel_values.shape[2], encoder.merge_size
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


def _check_counts(
    tokens_BT: torch.Tensor,
    token_id: int,
    counts_BN: torch.Tensor | None,
    kind: str,
    items: str,
    tokens: str,
    key: str = "",
    inputs: torch.Tensor | None = None,
) -> None:
    """ConfigError naming the first row whose ``kind`` placeholders differ in number from the
    tokens its ``items`` give (``counts_BN``; None: the batch has none of them), with the row's
    ``inputs`` (the media key ``key``) shown."""
    placeholders = (tokens_BT == token_id).sum(1).cpu().tolist()
    features = [0] * len(placeholders) if counts_BN is None else counts_BN.sum(1).tolist()
    for row, (have, need) in enumerate(zip(placeholders, features, strict=True)):
        if have != need:
            shown = f" ({key} {inputs[row].tolist()})" if inputs is not None else ""
            raise ConfigError(
                f"row {row} has {have} {kind} placeholder tokens but its {items} give {need} "
                f"{tokens} tokens{shown}."
            )


class MediaEncoder(Protocol):
    """What ``MediaEmbedding`` needs of an encoder (VisionEncoder: Qwen3-VL's ViT; MoonViT)."""

    merge_size: int
    """Side of the square window of patches that becomes one merged token."""

    def __call__(
        self, pixel_values_BNLP: torch.Tensor, image_grid_thw_BN3: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Merged tokens [B, N, Q, D] of every slot (each slot's first merged_counts valid),
        and the DeepStack tokens (one [B, N, Q, D] per layer; none for most encoders)."""
        ...

    def merged_counts(self, image_grid_thw_BN3: torch.Tensor) -> torch.Tensor:
        """Valid merged tokens of every slot, [B, N]: the placeholders each image takes."""
        ...

    def flops(self, image_grid_thw: torch.Tensor) -> int:
        """Training FLOPs of encoding these images."""
        ...

    def init_weights(self, init: ParamInit) -> None: ...


class AudioEncoder(Protocol):
    """What ``MediaEmbedding`` needs of an audio encoder (MuseAudioEncoder)."""

    def __call__(
        self, audio_values_BAS1: torch.Tensor, audio_lengths_BA: torch.Tensor
    ) -> torch.Tensor:
        """Tokens [B, A, S', D] of every clip slot (each slot's first audio_output_lengths valid)."""
        ...

    def audio_output_lengths(self, audio_lengths_BA: torch.Tensor) -> torch.Tensor:
        """Valid tokens of every clip slot, [B, A]: the placeholders each clip takes."""
        ...

    def flops(self, audio_lengths: torch.Tensor) -> int:
        """Training FLOPs of encoding these clips."""
        ...

    def init_weights(self, init: ParamInit) -> None: ...


class MediaEmbedding:
    """Mixin for a decoder model (a ``Decoder`` subclass, listed after this class) that reads
    images: the encoder is the module attribute named ``media_encoder_name`` (so checkpoints
    keep the family's names: ``visual`` for Qwen3-VL, ``vision_tower`` for Kimi K2.5), the
    config gives ``image_token_id``. A model that also hears audio names its ``AudioEncoder``
    in ``audio_encoder_name``, and its config gives ``audio_token_id``. A pipeline stage without
    ``embed_tokens`` sets the encoders to None; how positions and DeepStack tokens are used is
    the model's own business."""

    media_encoder_name: ClassVar[str] = "visual"
    audio_encoder_name: ClassVar[str | None] = None
    config: Any
    embed_tokens: nn.Embedding | None

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)  # type: ignore[call-arg]
        # Where the embeddings (with the media tokens scattered in over the whole sequence)
        # enter the residual stream: an identity that sequence parallelism hooks to cut them
        # along the sequence (vision_plan.media_entry_plan).
        self.residual_entry = nn.Identity()

    @classmethod
    def media_encoder_names(cls) -> tuple[str, ...]:
        """The attributes holding this model's encoders (the image one first)."""
        return (cls.media_encoder_name,) + (
            (cls.audio_encoder_name,) if cls.audio_encoder_name else ()
        )

    @property
    def media_encoder(self) -> MediaEncoder | None:
        return getattr(self, self.media_encoder_name, None)

    @property
    def audio_encoder(self) -> AudioEncoder | None:
        return getattr(self, self.audio_encoder_name, None) if self.audio_encoder_name else None

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
        """The decoder model's forward, its first block reading the media tokens at the
        placeholders (1-D positions, no DeepStack: MultimodalDecoder has its own)."""
        embeds_BTD = None
        media = self.media_or_none(media)
        if self.embed_tokens is not None:
            embeds_BTD = self.embed(tokens_BT)
            if media is not None:
                embeds_BTD, _ = self.embed_media(tokens_BT, embeds_BTD, media)
            embeds_BTD = self.residual_entry(embeds_BTD)
        return super().forward(  # type: ignore[misc]
            tokens_BT, positions_BT, doc_ids_BT, cache=cache, objective=objective,
            targets=targets, embeds_BTD=embeds_BTD,
        )  # fmt: skip

    @torch.no_grad()
    def init_weights(self, init: ParamInit | int = 0) -> None:
        """Every media encoder's own init, then the decoder's."""
        if isinstance(init, int):
            init = ParamInit(self, init)  # type: ignore[arg-type]
        for name in self.media_encoder_names():
            encoder = getattr(self, name)
            if encoder is not None:
                encoder.init_weights(init)
        super().init_weights(init)  # type: ignore[misc]

    def media_or_none(self, media: dict[str, torch.Tensor] | None) -> dict | None:
        """``media`` when there are some and this model (stage) encodes them, else None."""
        return media if media and self.media_encoder is not None else None

    def embed_media(
        self, tokens_BT: torch.Tensor, h_BTD: torch.Tensor, media: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The embeddings with the image (and audio) tokens at their placeholders, and the
        DeepStack additions (zero away from the placeholders), one [B, T, D] per deepstack
        layer. The placeholders' own embeddings are replaced, whatever norm made them."""
        encoder, image_token_id = self.media_encoder, self.config.image_token_id
        audio = self.audio_encoder
        if tokens_BT.device.type == "cpu" and not torch.compiler.is_compiling():
            heard = None if audio is None else (self.config.audio_token_id, audio)
            check_media(tokens_BT, media, image_token_id, encoder, heard)
        deepstack: list[torch.Tensor] = []
        if "pixel_values" in media:
            grid_BN3 = media["image_grid_thw"]
            merged_BNQD, deepstack_BNQD = encoder(media["pixel_values"], grid_BN3)
            is_image_BT, source_BT = placeholder_sources(
                tokens_BT, encoder.merged_counts(grid_BN3), merged_BNQD.shape[2], image_token_id
            )
            is_image_BT1 = is_image_BT[..., None]
            images_BTD = gather_tokens(merged_BNQD, source_BT).to(h_BTD.dtype)
            h_BTD = torch.where(is_image_BT1, images_BTD, h_BTD)
            deepstack = [
                torch.where(is_image_BT1, gather_tokens(d, source_BT).to(h_BTD.dtype), 0.0)
                for d in deepstack_BNQD
            ]
        if audio is not None and "audio_values" in media:
            lengths_BA = media["audio_lengths"]
            clips_BASD = audio(media["audio_values"], lengths_BA)
            is_audio_BT, source_BT = placeholder_sources(
                tokens_BT, audio.audio_output_lengths(lengths_BA), clips_BASD.shape[2],
                self.config.audio_token_id,
            )  # fmt: skip
            sounds_BTD = gather_tokens(clips_BASD, source_BT).to(h_BTD.dtype)
            h_BTD = torch.where(is_audio_BT[..., None], sounds_BTD, h_BTD)
        return h_BTD, deepstack

    def media_flops(self, media: dict[str, torch.Tensor] | None) -> int:
        """Training FLOPs of the encoders on this batch's images and clips (their ``flops``);
        flops_per_token stays the text model's."""
        if self.media_or_none(media) is None:
            return 0
        total = 0
        if "image_grid_thw" in media:
            total += self.media_encoder.flops(media["image_grid_thw"])
        if self.audio_encoder is not None and "audio_lengths" in media:
            total += self.audio_encoder.flops(media["audio_lengths"])
        return total


def media_encoder_names(model: nn.Module) -> tuple[str, ...]:
    """The attributes holding a model's media encoders (a MediaEmbedding's); none for text."""
    return model.media_encoder_names() if isinstance(model, MediaEmbedding) else ()


def media_flops(config: DecoderConfig, media: dict[str, torch.Tensor] | None) -> int:
    """Training FLOPs of the media encoders of ``config``'s model on ``media`` (0 for text or
    a model without encoders): the model's own ``media_flops`` on a meta-device build of it
    (made once per config), so it depends on the config and the grids (and clip lengths) only
    and holds however the real model is sharded or split. flops_per_token counts the text."""
    if not media:
        return 0
    model = _meta_model(config)
    return model.media_flops(media) if isinstance(model, MediaEmbedding) else 0


@functools.lru_cache(maxsize=4)
def _meta_model(config: DecoderConfig) -> nn.Module:
    with torch.device("meta"):
        return config.build()


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


class MultimodalDecoder(MediaEmbedding, Decoder):
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
        # (MediaEmbedding's residual_entry cuts the DeepStack tokens too.)
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
        media = self.media_or_none(media)
        if isinstance(cache, MultimodalCache):
            positions_BT = self.generation_positions(tokens_BT, cache, media)
        elif media is not None and positions_BT is None:
            positions_BT = self.mrope_positions(tokens_BT, media["image_grid_thw"])
        inputs = self.layer_inputs(tokens_BT, positions_BT, doc_ids_BT, cache)
        h_BTD, deepstack = self.embed(tokens_BT), []  # a later pipeline stage: the hidden state
        if self.embed_tokens is not None:
            if media is not None:
                h_BTD, deepstack = self.embed_media(tokens_BT, h_BTD, media)
            h_BTD = self.residual_entry(h_BTD)
            deepstack = [self.residual_entry(d_BTD) for d_BTD in deepstack]
        h_BTD = self.run_blocks(h_BTD, inputs, cache, deepstack)
        return self.norm(h_BTD) if self.norm is not None else h_BTD

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
