"""Multimodal SFT data: samples of the multimodal chat format (multimodal_format.py) tokenized
with their media's placeholders, split into train and validation, and packed whole, media
with their text, into rows whose ``Batch.media`` the model reads.

Media of a batch (``Batch.media``), N = --data.max_images_per_row image slots per row,
L = --data.max_image_patches patch slots per image, and for layouts with audio A =
--data.max_audios_per_row clip slots of S samples (--data.max_audio_seconds, whole tokens):

- ``pixel_values`` float32 ``[B, N, L, P]``: slot n of row b holds the row's n-th image (in
  token order, which is the order of their placeholder runs); its t*h*w patches fill the
  first slots of L, in the layout's processor's order (data/images.py); the rest is zero.
- ``image_grid_thw`` int64 ``[B, N, 3]``: each image's (t, h, w), zero rows for empty slots.
- ``audio_values`` float32 ``[B, A, S, 1]``: the row's clips in token order, each its
  feature extractor's waveform (data/audio.py), zeros after.
- ``audio_lengths`` int64 ``[B, A]``: each clip's samples, 0 for empty slots.

Positions are M-RoPE ``[B, T, 3]`` (temporal, height, width) for the mrope layout (qwen3_vl),
computed per sample so they restart at each packed sample as text positions do; the other
layouts keep the text's ``[B, T]`` positions.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from torchloom.config.errors import ConfigError
from torchloom.data.audio import AudioProcessing, audio_features, load_wav
from torchloom.data.config import BUILTIN_VL_TOKENIZER, DataConfig
from torchloom.data.conversations import check_template_marks_replies, tokenize_conversations
from torchloom.data.dataset import chunked, held_out_mask
from torchloom.data.images import ImageProcessing, image_patches, load_image
from torchloom.data.media_layout import MediaLayout, media_layout
from torchloom.data.mrope import mrope_positions
from torchloom.data.multimodal_format import MediaTokens, MultimodalSample, iter_samples
from torchloom.data.packing import Batch
from torchloom.data.sft import PROBE_CONVERSATIONS, Conversations, PackedConversations
from torchloom.data.sources import SourceFile
from torchloom.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

TOKENIZE_CHUNK = 256
PREPROCESSOR_CONFIG = "preprocessor_config.json"


def resolve_media_layout(cfg: DataConfig) -> MediaLayout:
    """--data.media_layout, spelled with builtin:stdlib_bpe_vl's tokens when that is the
    tokenizer (so every family's debug recipe trains on builtin ids)."""
    layout = media_layout(cfg.media_layout)
    return layout.with_builtin_tokens() if cfg.tokenizer == BUILTIN_VL_TOKENIZER else layout


def resolve_image_processing(
    cfg: DataConfig, tokenizer: Tokenizer, layout: MediaLayout | None = None
) -> ImageProcessing:
    """How this run turns images into patches. Qwen-VL's: the tokenizer folder's
    preprocessor_config.json (Hugging Face's, beside the tokenizer of a vision-language model)
    or Qwen3-VL's settings, with --data's pixel bounds, and max_pixels lowered so an image fits
    max_image_patches. Kimi's and Muse's: their Hugging Face defaults, the patch (Kimi) or
    token (Muse) budget lowered so an image fits max_image_patches."""
    kind = "qwen2vl" if layout is None else layout.image_processor
    if kind != "qwen2vl":
        return _raster_processing(cfg, kind)
    path = tokenizer.path
    config_path = None if path is None else (path if path.is_dir() else path.parent)
    config_path = None if config_path is None else config_path / PREPROCESSOR_CONFIG
    if config_path is not None and config_path.is_file():
        base = ImageProcessing.from_preprocessor_config(config_path)
    else:
        base = ImageProcessing()
    min_pixels = cfg.image_min_pixels or base.min_pixels
    slots_pixels = cfg.max_image_patches * base.patch_size**2
    max_pixels = min(cfg.image_max_pixels or base.max_pixels, slots_pixels)
    if min_pixels > max_pixels:
        need = -(-min_pixels // base.patch_size**2)
        raise ConfigError(
            f"--data.max_image_patches={cfg.max_image_patches} holds {slots_pixels} pixels of "
            f"{base.patch_size}x{base.patch_size} patches, fewer than the {min_pixels} every "
            f"image is resized up to: raise it to {need}, or lower --data.image_min_pixels."
        )
    processing = ImageProcessing(
        base.patch_size, base.temporal_patch_size, base.merge_size, min_pixels, max_pixels,
        base.image_mean, base.image_std, cfg.image_decode_limit,
    )  # fmt: skip
    processing.validate()
    return processing


def _raster_processing(cfg: DataConfig, kind: str) -> ImageProcessing:
    if cfg.image_min_pixels or cfg.image_max_pixels:
        raise ConfigError(
            f"--data.image_min_pixels / image_max_pixels apply to Qwen-VL's processor only; "
            f"--data.media_layout {cfg.media_layout} sizes images by --data.max_image_patches."
        )
    base = ImageProcessing.of(kind, decode_limit=cfg.image_decode_limit)
    window = base.merge_size**2
    if cfg.max_image_patches < window:
        raise ConfigError(
            f"--data.max_image_patches={cfg.max_image_patches} is below one {base.merge_size}x"
            f"{base.merge_size} merge window; raise it to at least {window}."
        )
    if kind == "kimi":
        patches = min(base.max_patches, cfg.max_image_patches)
        return replace(base, max_patches=patches, max_padded_patches=cfg.max_image_patches)
    tokens = min(base.max_image_tokens, cfg.max_image_patches // window)
    return replace(base, max_image_tokens=tokens)


def resolve_audio_processing(cfg: DataConfig, layout: MediaLayout) -> AudioProcessing | None:
    """The layout's audio settings with --data.max_audio_seconds; None without audio."""
    if not layout.has_audio:
        return None
    return AudioProcessing(
        layout.audio_sampling_rate, layout.audio_samples_per_token, cfg.max_audio_seconds
    )


@dataclass
class MultimodalSamples:
    """Tokenized samples and their media, flat: sample i's images are
    ``image_offsets[i]:image_offsets[i + 1]`` of the image tables, its clips likewise."""

    conversations: Conversations
    wheres: list[str]
    """``file:line`` of each sample."""
    image_offsets: np.ndarray
    image_paths: list[Path]
    image_grids: np.ndarray
    """``[num_images, 3]`` int64 (t, h, w)."""
    audio_offsets: np.ndarray
    audio_paths: list[Path]
    audio_lengths: np.ndarray
    """``[num_clips]`` int64 samples of each clip."""

    @property
    def image_counts(self) -> np.ndarray:
        return np.diff(self.image_offsets)

    @property
    def audio_counts(self) -> np.ndarray:
        return np.diff(self.audio_offsets)

    @classmethod
    def tokenize(
        cls, samples: list[MultimodalSample], tokenizer: Tokenizer, media: MediaTokens,
        processing: ImageProcessing,
    ) -> MultimodalSamples:  # fmt: skip
        """Token ids, assistant masks and media tables of ``samples``."""
        items = []
        for chunk in chunked(iter(samples), TOKENIZE_CHUNK):
            items += tokenize_conversations(tokenizer, [s.conversation for s in chunk])
        merge = processing.merge_size**2
        for sample, (ids, _) in zip(samples, items):
            images = sum(t * h * w // merge for t, h, w in (i.grid for i in sample.images))
            clips = sum(media.layout.audio_tokens(a.num_samples) for a in sample.audios)
            for token, token_id, expected in (
                (media.image_token, media.image_token_id, images),
                (media.audio_token, media.audio_token_id, clips),
            ):
                found = int((ids == token_id).sum())
                if found != expected:
                    raise ConfigError(
                        f"{sample.conversation.where}: the chat template's rendering holds "
                        f"{found} '{token}' tokens where the media need {expected}; the "
                        "template must keep message content as it is."
                    )
        images = [image for sample in samples for image in sample.images]
        clips = [clip for sample in samples for clip in sample.audios]
        return cls(
            Conversations.from_list(items),
            [s.conversation.where for s in samples],
            _offsets([len(s.images) for s in samples]),
            [i.path for i in images],
            np.array([i.grid for i in images], dtype=np.int64).reshape(-1, 3),
            _offsets([len(s.audios) for s in samples]),
            [c.path for c in clips],
            np.array([c.num_samples for c in clips], dtype=np.int64),
        )


def _offsets(counts: list[int]) -> np.ndarray:
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(counts)
    return offsets


def load_multimodal_splits(
    files: list[SourceFile], tokenizer: Tokenizer, media: MediaTokens,
    processing: ImageProcessing, val_fraction: float, audio: AudioProcessing | None = None,
) -> tuple[MultimodalSamples, MultimodalSamples]:  # fmt: skip
    """The train and validation samples of ``files``; every image is decoded (and every audio
    header read) once here, so a bad one fails before training. Not cached on disk: media may
    change between runs."""
    start = time.perf_counter()
    samples = list(iter_samples(files, media, processing, audio))
    if not samples:
        raise ConfigError(f"The multimodal sources {[str(f.path) for f in files]} hold no sample.")
    check_template_marks_replies(tokenizer, [s.conversation for s in samples[:PROBE_CONVERSATIONS]])
    is_val = held_out_mask(len(samples), val_fraction)
    splits = [
        MultimodalSamples.tokenize([s for s, v in zip(samples, is_val) if v == held_out],
                                   tokenizer, media, processing)
        for held_out in (False, True)
    ]  # fmt: skip
    log.info(
        "Read %d multimodal samples with %d images and %d audio clips (%d held out) in %.1fs",
        len(samples), sum(len(s.images) for s in samples), sum(len(s.audios) for s in samples),
        int(is_val.sum()), time.perf_counter() - start,
    )  # fmt: skip
    return splits[0], splits[1]


class PackedMultimodal:
    """The row source of multimodal SFT: whole samples packed into rows of ``seq_len`` tokens
    with their media, at most ``max_images_per_row`` images and ``max_audios_per_row`` clips
    per row (the text packing, masking and dropping of PackedConversations), media and (for
    the mrope layout) M-RoPE positions filled per row."""

    def __init__(
        self,
        samples: MultimodalSamples,
        seq_len: int,
        pad_id: int,
        media: MediaTokens,
        processing: ImageProcessing,
        max_images_per_row: int,
        max_image_patches: int,
        split: str = "training",
        audio: AudioProcessing | None = None,
        max_audios_per_row: int = 0,
    ) -> None:
        self.samples = samples
        self.seq_len = seq_len
        self.media = media
        self.processing = processing
        self.audio = audio
        self.max_images_per_row = max_images_per_row
        self.max_image_patches = max_image_patches
        self.max_audios_per_row = max_audios_per_row if audio is not None else 0
        self._check_limits()
        counts = np.stack([samples.image_counts, samples.audio_counts], axis=1)
        self.text = PackedConversations(
            samples.conversations, seq_len, pad_id, "drop", split, media_counts=counts,
            max_media_per_row=(max_images_per_row, self.max_audios_per_row),
        )  # fmt: skip
        self.num_rows = self.text.num_rows

    def _check_limits(self) -> None:
        for counts, limit, kind, flag in (
            (self.samples.image_counts, self.max_images_per_row, "images", "max_images_per_row"),
            (self.samples.audio_counts, self.max_audios_per_row, "audio clips",
             "max_audios_per_row"),
        ):  # fmt: skip
            if len(counts) and counts.max() > limit:
                at = int(counts.argmax())
                raise ConfigError(
                    f"{self.samples.wheres[at]}: the sample has {counts[at]} {kind}, more than "
                    f"--data.{flag}={limit}; raise it."
                )
        patches = self.samples.image_grids.prod(axis=1)
        if len(patches) and patches.max() > self.max_image_patches:
            at = int(patches.argmax())  # only for extreme aspect ratios: smart_resize's floor
            sample = int(np.searchsorted(self.samples.image_offsets, at, side="right")) - 1
            raise ConfigError(
                f"{self.samples.wheres[sample]}: image {self.samples.image_paths[at]} needs "
                f"{patches[at]} patches after resizing, more than --data.max_image_patches="
                f"{self.max_image_patches}; raise it, or crop the image."
            )

    def batch(self, rows_B: np.ndarray) -> Batch:
        """Rows ``rows_B`` as one batch, with media (and M-RoPE positions for mrope)."""
        batch = self.text.batch(rows_B)
        B, T, N, L = len(rows_B), self.seq_len, self.max_images_per_row, self.max_image_patches
        mrope = self.media.layout.positions == "mrope"
        pixels_BNLP = torch.zeros(B, N, L, self.processing.patch_dim, dtype=torch.float32)
        grids_BN3 = torch.zeros(B, N, 3, dtype=torch.int64)
        A = self.max_audios_per_row
        S = 0 if self.audio is None else self.audio.max_samples
        audio_BAS1 = torch.zeros(B, A, S, 1, dtype=torch.float32)
        audio_lengths_BA = torch.zeros(B, A, dtype=torch.int64)
        positions_BT3 = batch.positions[:, :, None].expand(B, T, 3).clone()  # padding: 0, 1, ...
        for b, row in enumerate(rows_B.tolist()):
            column, slot, clip_slot = 0, 0, 0
            for index in self.text.conversations_of(row).tolist():
                length = int(self.text.kept_lengths[index]) - 1
                first, last = self.samples.image_offsets[index : index + 2]
                if mrope:
                    grids_K3 = torch.from_numpy(self.samples.image_grids[first:last])
                    tokens_N = batch.tokens[b, column : column + length]
                    positions_BT3[b, column : column + length] = mrope_positions(
                        tokens_N, grids_K3, self.media.image_token_id,
                        self.media.image_start_token_id, self.processing.merge_size,
                    )  # fmt: skip
                for image in range(first, last):
                    patches, grid = self._patches(image, index)
                    pixels_BNLP[b, slot, : len(patches)] = torch.from_numpy(patches)
                    grids_BN3[b, slot] = torch.tensor(grid)
                    slot += 1
                for clip in range(*self.samples.audio_offsets[index : index + 2].tolist()):
                    values = self._audio(clip, index)
                    audio_BAS1[b, clip_slot, : len(values), 0] = torch.from_numpy(values)
                    audio_lengths_BA[b, clip_slot] = int(self.samples.audio_lengths[clip])
                    clip_slot += 1
                column += length
        if mrope:
            batch.positions = positions_BT3
        batch.media = {"pixel_values": pixels_BNLP, "image_grid_thw": grids_BN3}
        if self.audio is not None:
            batch.media |= {"audio_values": audio_BAS1, "audio_lengths": audio_lengths_BA}
        return batch

    def _patches(self, image: int, sample: int) -> tuple[np.ndarray, tuple[int, int, int]]:
        where, path = self.samples.wheres[sample], self.samples.image_paths[image]
        patches, grid = image_patches(load_image(path, where, self.processing), self.processing)
        if grid != tuple(self.samples.image_grids[image].tolist()):
            raise ConfigError(
                f"{where}: image {path} changed size since the data was read; restart the run "
                "(its token count no longer matches)."
            )
        return patches, grid

    def _audio(self, clip: int, sample: int) -> np.ndarray:
        assert self.audio is not None
        where, path = self.samples.wheres[sample], self.samples.audio_paths[clip]
        samples, _ = load_wav(path, where)
        if len(samples) != self.samples.audio_lengths[clip]:
            raise ConfigError(
                f"{where}: audio {path} changed length since the data was read; restart the "
                "run (its token count no longer matches)."
            )
        return audio_features(samples, self.audio)

    def identity(self) -> dict[str, int]:
        """What decides the rows and their media, for checking a resumed loader."""
        identity = {
            **self.text.identity(),
            "num_images": len(self.samples.image_paths),
            "max_images_per_row": self.max_images_per_row,
            "max_image_patches": self.max_image_patches,
        }
        if self.audio is not None:  # absent without audio, so older checkpoints still match
            identity |= {
                "num_audio_clips": len(self.samples.audio_paths),
                "max_audios_per_row": self.max_audios_per_row,
                "max_audio_samples": self.audio.max_samples,
            }
        return identity

    def describe(self) -> str:
        clips = f", {len(self.samples.audio_paths)} audio clips" if self.audio is not None else ""
        return f"{self.text.describe()}, {len(self.samples.image_paths)} images{clips}"
