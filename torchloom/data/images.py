"""Images for vision-language models: load and check a file, then resize, normalize and cut it
into the patches a vision encoder reads, in Hugging Face's order. Three processors:
``qwen2vl`` (Qwen2-VL / Qwen3-VL, below), ``kimi`` (Kimi K2.5's MoonViT) and ``muse`` (Muse
Glimmer / Spark), the last two at the end of this file.

The steps follow transformers' PIL image processor for Qwen2-VL (``Qwen2VLImageProcessorPil``),
which Qwen3-VL uses with patch 16 and mean/std 0.5: convert to RGB (transparency composited on
white), resize with PIL's bicubic filter to a size ``smart_resize`` picks, scale by 1/255 in
float64 then cast to float32, normalize in float32, repeat the still frame ``temporal_patch``
times, and order patches by merge window (rows of windows, then the ``merge x merge`` patches
inside one), each patch flattened as (channel, frame, row, column). Matching those steps bit for
bit is what lets a model trained here read images the way its Hugging Face twin does.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from torchloom.config.errors import ConfigError

MAX_ASPECT_RATIO = 200
"""The longest side over the shortest that smart_resize accepts (as Hugging Face's)."""


@dataclass(frozen=True)
class ImageProcessing:
    """How images become patches. The defaults are Qwen3-VL's (its preprocessor_config.json);
    ``ImageProcessing.of(processor)`` gives each processor's."""

    patch_size: int = 16
    """Side of a square patch, in pixels."""
    temporal_patch_size: int = 2
    """Frames per patch; a still image is repeated this many times."""
    merge_size: int = 2
    """Patches merged per side into one language-model token (merge^2 patches per token)."""
    min_pixels: int = 256 * 256
    """An image is resized up to at least this many pixels (Hugging Face's size.shortest_edge)."""
    max_pixels: int = 4096 * 4096
    """...and down to at most this many (size.longest_edge)."""
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    decode_limit: int = 100_000_000
    """A file whose width x height exceeds this is refused before decoding it."""
    rescale_factor: float = field(default=1 / 255, repr=False)
    max_patches: int = 16384
    """kimi: at most this many patches; larger images are scaled down (never up)."""
    max_patches_per_side: int = 512
    """kimi: at most this many patches along a side (its size.max_height)."""
    max_padded_patches: int = 0
    """kimi: when set, an image whose grid, once padded, exceeds this many patches shrinks
    further until it fits (Hugging Face's processor lets the padding exceed max_patches)."""
    max_image_tokens: int = 4096
    """muse: at most this many merged tokens (merge^2 patches each) per image."""
    processor: Literal["qwen2vl", "kimi", "muse"] = "qwen2vl"
    """Whose resize rule, normalization and patch order (MediaLayout.image_processor)."""

    @classmethod
    def of(cls, processor: str, **overrides: int) -> ImageProcessing:
        """The Hugging Face defaults of ``processor`` (qwen2vl, kimi or muse)."""
        defaults = {
            "qwen2vl": {},
            # Kimi's patches hold one frame: 3 x 14 x 14 values.
            "kimi": {"patch_size": 14, "temporal_patch_size": 1},
            "muse": {"patch_size": 14},
        }[processor]
        return cls(processor=processor, **{**defaults, **overrides})  # type: ignore[arg-type]

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one merge window."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Values per patch, P = channels x frames x patch x patch (1536 for Qwen3-VL)."""
        return 3 * self.temporal_patch_size * self.patch_size**2

    def validate(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels"):
            if getattr(self, name) < 1:
                raise ConfigError(f"Image processing: {name}={getattr(self, name)} must be >= 1.")
        if self.max_pixels < max(self.min_pixels, self.factor**2):
            raise ConfigError(
                f"Image processing: max_pixels={self.max_pixels} is below min_pixels="
                f"{self.min_pixels} or one {self.factor}x{self.factor} merge window; raise it."
            )
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ConfigError("Image processing: image_mean and image_std need 3 values (RGB).")

    @classmethod
    def from_preprocessor_config(cls, path: Path, **overrides: int) -> ImageProcessing:
        """The settings of a Hugging Face ``preprocessor_config.json`` (Qwen2-VL style keys)."""
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: cannot read the image preprocessor config ({e}).") from None
        size = config.get("size") or {}
        found = {
            "patch_size": config.get("patch_size"),
            "temporal_patch_size": config.get("temporal_patch_size"),
            "merge_size": config.get("merge_size"),
            # Older Qwen2-VL folders put min/max_pixels at the top or inside "size".
            "min_pixels": config.get(
                "min_pixels", size.get("shortest_edge", size.get("min_pixels"))
            ),
            "max_pixels": config.get(
                "max_pixels", size.get("longest_edge", size.get("max_pixels"))
            ),
            "image_mean": tuple(config["image_mean"]) if "image_mean" in config else None,
            "image_std": tuple(config["image_std"]) if "image_std" in config else None,
        }
        settings = {k: v for k, v in found.items() if v is not None}
        return cls(**{**settings, **overrides})


def smart_resize(height: int, width: int, processing: ImageProcessing) -> tuple[int, int]:
    """The (height, width) an image is resized to: multiples of ``processing.factor``, the
    aspect ratio kept as well as rounding allows, the area within [min_pixels, max_pixels].
    The same rule as Hugging Face's Qwen2-VL ``smart_resize``, written from its description."""
    factor = processing.factor
    new_h, new_w = round(height / factor) * factor, round(width / factor) * factor
    if new_h * new_w > processing.max_pixels:
        shrink = math.sqrt(height * width / processing.max_pixels)
        new_h = max(factor, math.floor(height / shrink / factor) * factor)
        new_w = max(factor, math.floor(width / shrink / factor) * factor)
    elif new_h * new_w < processing.min_pixels:
        grow = math.sqrt(processing.min_pixels / (height * width))
        new_h = math.ceil(height * grow / factor) * factor
        new_w = math.ceil(width * grow / factor) * factor
    return new_h, new_w


def image_grid(width: int, height: int, processing: ImageProcessing) -> tuple[int, int, int]:
    """The (t, h, w) patch grid of a still image of ``width x height`` pixels."""
    if processing.processor == "kimi":
        _, (new_h, new_w) = kimi_resize(height, width, processing)
    elif processing.processor == "muse":
        new_h, new_w = muse_resize(height, width, processing)
    else:
        new_h, new_w = smart_resize(height, width, processing)
    return 1, new_h // processing.patch_size, new_w // processing.patch_size


def load_image(path: Path, where: str, processing: ImageProcessing) -> Image.Image:
    """The decoded image at ``path``, or a ConfigError naming ``where`` (the JSONL line), the
    file and the fix: missing, not an image, truncated, too large, or too thin to resize."""
    fix = "Fix or replace the file, or remove the line."
    if path.is_dir():
        raise ConfigError(
            f"{where}: image {path} is a folder, not an image file. Give the path of the image "
            "file in it, or remove the line."
        )
    if not path.is_file():
        raise ConfigError(
            f"{where}: image {path} does not exist. Image paths are relative to the JSONL "
            f"file's folder. {fix}"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # we check below
            image = Image.open(path)
            width, height = image.size
            if width * height > processing.decode_limit:
                raise ConfigError(
                    f"{where}: image {path} is {width}x{height} = {width * height} pixels, above "
                    f"the limit of {processing.decode_limit} (--data.image_decode_limit). "
                    "Downscale the file, or raise the limit."
                )
            image.load()
    except ConfigError:
        raise
    except Exception as e:  # PIL raises many types (UnidentifiedImageError, OSError, bombs)
        raise ConfigError(
            f"{where}: image {path} cannot be decoded ({type(e).__name__}: {e}). {fix}"
        ) from None
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise ConfigError(
            f"{where}: image {path} is {width}x{height}, more than {MAX_ASPECT_RATIO} times "
            f"longer than wide; crop or pad it. {fix}"
        )
    return image


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited on white (as Hugging Face's processors do)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def image_patches(
    image: Image.Image, processing: ImageProcessing
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """``(patches [t*h*w, P] float32, (t, h, w))`` of a still image, in Hugging Face's order."""
    if processing.processor != "qwen2vl":
        return _raster_patches(image, processing)
    rgb = to_rgb(image)
    new_h, new_w = smart_resize(rgb.height, rgb.width, processing)
    resized_HWC = np.asarray(rgb.resize((new_w, new_h), resample=Image.Resampling.BICUBIC))
    # Scale in float64 then cast, normalize in float32: the same roundings as Hugging Face.
    scaled_HWC = (resized_HWC.astype(np.float64) * processing.rescale_factor).astype(np.float32)
    mean = np.asarray(processing.image_mean, dtype=np.float32)
    std = np.asarray(processing.image_std, dtype=np.float32)
    pixels_CHW = ((scaled_HWC - mean) / std).transpose(2, 0, 1)
    p, m, frames = processing.patch_size, processing.merge_size, processing.temporal_patch_size
    grid_h, grid_w = new_h // p, new_w // p
    windows = pixels_CHW.reshape(3, grid_h // m, m, p, grid_w // m, m, p)
    # -> (window row, window column, row in window, column in window, channel, y, x)
    patches = windows.transpose(1, 4, 2, 5, 0, 3, 6)
    frames_shape = (*patches.shape[:5], frames, p, p)
    patches = np.broadcast_to(patches[:, :, :, :, :, None], frames_shape)
    return patches.reshape(grid_h * grid_w, processing.patch_dim), (1, grid_h, grid_w)


# Kimi's and Muse's processors run on torchvision tensors: their resize is torch's antialiased
# interpolation of the uint8 image (torchvision calls F.interpolate on uint8 on the CPU), and
# normalization is (x - mean * 255) / (std * 255) in float32. Both lay patches out in raster
# order of the image (rows of patches), not in merge windows.


def kimi_resize(
    height: int, width: int, processing: ImageProcessing
) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((h, w) resized, (h, w) padded)`` under Kimi K2.5's rule: scale down (never up) to at
    most ``max_patches`` patches and ``max_patches_per_side`` per side, truncating, then pad the
    bottom and right to multiples of patch x merge. With ``max_padded_patches``, the budget
    shrinks one patch at a time until the padded grid fits that many patch slots."""
    p, factor = processing.patch_size, processing.factor
    side = processing.max_patches_per_side * p
    budget = processing.max_patches
    while True:
        patches = max(1, height // p) * max(1, width // p)
        scale = min(1.0, math.sqrt(budget / patches), side / height, side / width)
        new_h = min(max(1, int(height * scale)), side)
        new_w = min(max(1, int(width * scale)), side)
        pad_h, pad_w = -(-new_h // factor) * factor, -(-new_w // factor) * factor
        limit = processing.max_padded_patches
        if not limit or pad_h * pad_w <= limit * p * p or budget <= 1:
            return (new_h, new_w), (pad_h, pad_w)
        budget -= 1


def muse_resize(height: int, width: int, processing: ImageProcessing) -> tuple[int, int]:
    """The (h, w) Muse's processor resizes to: the grid of merge windows nearest the image's
    aspect ratio with at most ``max_image_tokens`` windows (up or down, floor or ceil of the
    ideal grid on each side, whichever ratio is closest; the first in floor-first order on a
    tie)."""
    factor, limit = processing.factor, processing.max_image_tokens
    ideal_h, ideal_w = height / factor, width / factor
    if ideal_h * ideal_w > limit:
        ratio = ideal_w / ideal_h
        ideal_h = math.sqrt(limit / ratio)
        ideal_w = ideal_h * ratio
    candidates = [
        (h, w)
        for h in dict.fromkeys((math.floor(ideal_h), math.ceil(ideal_h)))
        for w in dict.fromkeys((math.floor(ideal_w), math.ceil(ideal_w)))
        if h >= 1 and w >= 1 and h * w <= limit
    ] or [(max(1, round(ideal_h)), max(1, round(ideal_w)))]
    grid_h, grid_w = min(candidates, key=lambda g: abs(g[0] / g[1] - height / width))
    return grid_h * factor, grid_w * factor


def _raster_patches(
    image: Image.Image, processing: ImageProcessing
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Kimi's or Muse's patches: ``[h*w, P]`` in raster order, each patch (channel, y, x) for
    Kimi, (frame, channel, y, x) with the frame repeated for Muse."""
    pixels_CHW = torch.from_numpy(np.array(to_rgb(image))).permute(2, 0, 1).contiguous()
    height, width = pixels_CHW.shape[1:]
    if processing.processor == "kimi":
        size, padded = kimi_resize(height, width, processing)
        mode = "bicubic"
    else:
        size = padded = muse_resize(height, width, processing)
        mode = "lanczos"
    if size != (height, width):
        pixels_CHW = F.interpolate(
            pixels_CHW[None], size=size, mode=mode, align_corners=False, antialias=True
        )[0]
    pixels_CHW = F.pad(pixels_CHW, (0, padded[1] - size[1], 0, padded[0] - size[0]))
    scale = 1.0 / processing.rescale_factor
    mean = (torch.tensor(processing.image_mean) * scale)[:, None, None]
    std = (torch.tensor(processing.image_std) * scale)[:, None, None]
    normalized_CHW = (pixels_CHW.to(torch.float32) - mean) / std
    p = processing.patch_size
    grid_h, grid_w = padded[0] // p, padded[1] // p
    patches = normalized_CHW.reshape(3, grid_h, p, grid_w, p).permute(1, 3, 0, 2, 4)
    if processing.processor == "muse":
        frames = processing.temporal_patch_size
        patches = patches[:, :, None].expand(grid_h, grid_w, frames, 3, p, p)
    flat = patches.reshape(grid_h * grid_w, processing.patch_dim)
    return flat.numpy(), (1, grid_h, grid_w)
