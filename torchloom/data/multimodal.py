"""Multimodal SFT data: samples of the multimodal chat format (multimodal_format.py) tokenized
with their images' placeholders, split into train and validation, and packed whole, images
with their text, into rows whose ``Batch.media`` the model reads.

Media layout of a batch (``Batch.media``), N = --data.max_images_per_row image slots per row
and L = --data.max_image_patches patch slots per image:

- ``pixel_values`` float32 ``[B, N, L, P]``: slot n of row b holds the row's n-th image (in
  token order, which is the order of their ``<|image_pad|>`` runs); its t*h*w patches fill the
  first slots of L, in Hugging Face's Qwen2-VL order (data/images.py); the rest is zero.
- ``image_grid_thw`` int64 ``[B, N, 3]``: each image's (t, h, w), zero rows for empty slots.

Positions are M-RoPE ``[B, T, 3]`` (temporal, height, width), computed per sample so they
restart at each packed sample, as text positions do.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from torchloom.config.errors import ConfigError
from torchloom.data.config import DataConfig
from torchloom.data.conversations import tokenize_conversations
from torchloom.data.dataset import chunked, held_out_mask
from torchloom.data.images import ImageProcessing, image_patches, load_image
from torchloom.data.mrope import mrope_positions
from torchloom.data.multimodal_format import MediaTokens, MultimodalSample, iter_samples
from torchloom.data.packing import Batch
from torchloom.data.sft import Conversations, PackedConversations
from torchloom.data.sources import SourceFile
from torchloom.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

TOKENIZE_CHUNK = 256
PREPROCESSOR_CONFIG = "preprocessor_config.json"


def resolve_image_processing(cfg: DataConfig, tokenizer: Tokenizer) -> ImageProcessing:
    """How this run turns images into patches: the tokenizer folder's preprocessor_config.json
    (Hugging Face's, beside the tokenizer of a vision-language model) or Qwen3-VL's settings,
    with --data's pixel bounds, and max_pixels lowered so an image fits max_image_patches."""
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


@dataclass
class MultimodalSamples:
    """Tokenized samples and their images, flat: sample i's images are
    ``image_offsets[i]:image_offsets[i + 1]`` of the image tables."""

    conversations: Conversations
    wheres: list[str]
    """``file:line`` of each sample."""
    image_offsets: np.ndarray
    image_paths: list[Path]
    image_grids: np.ndarray
    """``[num_images, 3]`` int64 (t, h, w)."""

    @property
    def image_counts(self) -> np.ndarray:
        return np.diff(self.image_offsets)

    @classmethod
    def tokenize(
        cls, samples: list[MultimodalSample], tokenizer: Tokenizer, media: MediaTokens,
        processing: ImageProcessing,
    ) -> MultimodalSamples:  # fmt: skip
        """Token ids, assistant masks and image tables of ``samples``."""
        items = []
        for chunk in chunked(iter(samples), TOKENIZE_CHUNK):
            items += tokenize_conversations(tokenizer, [s.conversation for s in chunk])
        merge = processing.merge_size**2
        for sample, (ids, _) in zip(samples, items):
            found = int((ids == media.image_token_id).sum())
            expected = sum(t * h * w // merge for t, h, w in (i.grid for i in sample.images))
            if found != expected:
                raise ConfigError(
                    f"{sample.conversation.where}: the chat template's rendering holds {found} "
                    f"'{media.image_token}' tokens where the images need {expected}; the "
                    "template must keep message content as it is."
                )
        images = [image for sample in samples for image in sample.images]
        offsets = np.zeros(len(samples) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(s.images) for s in samples])
        grids = np.array([i.grid for i in images], dtype=np.int64).reshape(-1, 3)
        wheres = [s.conversation.where for s in samples]
        paths = [i.path for i in images]
        return cls(Conversations.from_list(items), wheres, offsets, paths, grids)


def load_multimodal_splits(
    files: list[SourceFile], tokenizer: Tokenizer, media: MediaTokens,
    processing: ImageProcessing, val_fraction: float,
) -> tuple[MultimodalSamples, MultimodalSamples]:  # fmt: skip
    """The train and validation samples of ``files``; every image is decoded once here, so a
    bad one fails before training. Not cached on disk: images may change between runs."""
    start = time.perf_counter()
    samples = list(iter_samples(files, media, processing))
    if not samples:
        raise ConfigError(f"The multimodal sources {[str(f.path) for f in files]} hold no sample.")
    is_val = held_out_mask(len(samples), val_fraction)
    splits = [
        MultimodalSamples.tokenize([s for s, v in zip(samples, is_val) if v == held_out],
                                   tokenizer, media, processing)
        for held_out in (False, True)
    ]  # fmt: skip
    log.info(
        "Read %d multimodal samples with %d images (%d held out) in %.1fs",
        len(samples), sum(len(s.images) for s in samples), int(is_val.sum()),
        time.perf_counter() - start,
    )  # fmt: skip
    return splits[0], splits[1]


class PackedMultimodal:
    """The row source of multimodal SFT: whole samples packed into rows of ``seq_len`` tokens
    with their images, at most ``max_images_per_row`` per row (the text packing, masking and
    dropping of PackedConversations), media and M-RoPE positions filled per row."""

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
    ) -> None:
        self.samples = samples
        self.seq_len = seq_len
        self.media = media
        self.processing = processing
        self.max_images_per_row = max_images_per_row
        self.max_image_patches = max_image_patches
        self._check_limits()
        self.text = PackedConversations(
            samples.conversations, seq_len, pad_id, "drop", split,
            images=samples.image_counts, max_images_per_row=max_images_per_row,
        )  # fmt: skip
        self.num_rows = self.text.num_rows

    def _check_limits(self) -> None:
        counts = self.samples.image_counts
        if len(counts) and counts.max() > self.max_images_per_row:
            at = int(counts.argmax())
            raise ConfigError(
                f"{self.samples.wheres[at]}: the sample has {counts[at]} images, more than "
                f"--data.max_images_per_row={self.max_images_per_row}; raise it."
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
        """Rows ``rows_B`` as one batch, with media and M-RoPE positions."""
        batch = self.text.batch(rows_B)
        B, T, N, L = len(rows_B), self.seq_len, self.max_images_per_row, self.max_image_patches
        pixels_BNLP = torch.zeros(B, N, L, self.processing.patch_dim, dtype=torch.float32)
        grids_BN3 = torch.zeros(B, N, 3, dtype=torch.int64)
        positions_BT3 = batch.positions[:, :, None].expand(B, T, 3).clone()  # padding: 0, 1, ...
        for b, row in enumerate(rows_B.tolist()):
            column, slot = 0, 0
            for index in self.text.conversations_of(row).tolist():
                length = int(self.text.kept_lengths[index]) - 1
                first, last = self.samples.image_offsets[index : index + 2]
                grids_K3 = torch.from_numpy(self.samples.image_grids[first:last])
                tokens_N = batch.tokens[b, column : column + length]
                positions_BT3[b, column : column + length] = mrope_positions(
                    tokens_N, grids_K3, self.media.image_token_id,
                    self.media.vision_start_token_id, self.processing.merge_size,
                )  # fmt: skip
                for image in range(first, last):
                    patches, grid = self._patches(image, index)
                    pixels_BNLP[b, slot, : len(patches)] = torch.from_numpy(patches)
                    grids_BN3[b, slot] = torch.tensor(grid)
                    slot += 1
                column += length
        batch.positions = positions_BT3
        batch.media = {"pixel_values": pixels_BNLP, "image_grid_thw": grids_BN3}
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

    def identity(self) -> dict[str, int]:
        """What decides the rows and their media, for checking a resumed loader."""
        return {
            **self.text.identity(),
            "num_images": len(self.samples.image_paths),
            "max_images_per_row": self.max_images_per_row,
            "max_image_patches": self.max_image_patches,
        }

    def describe(self) -> str:
        return f"{self.text.describe()}, {len(self.samples.image_paths)} images"
