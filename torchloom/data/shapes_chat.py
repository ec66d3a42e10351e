"""The builtin image-chat set ``builtin:shapes_chat``: pictures of coloured shapes drawn with
pillow, each with a question whose answer is in the picture ("What colour is the circle?",
"How many squares are there?"); one sample in eight shows two pictures.

Generated on first use into the cache (no download): a folder of PNGs and a multimodal chat
JSONL beside it. The train split (``builtin:shapes_chat``) and the held-out split
(``builtin:shapes_chat_test``) are drawn from different seeds; every draw uses only
``random.Random``'s integer methods and pillow's integer drawing, so every machine writes the
same pictures.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from torchloom.data.cache import atomic_write, ensure_generated_jsonl

# Bump when the pictures, questions or sizes change, so old cached sets are not reused.
SHAPES_CHAT_VERSION = 1
SPLITS = {"train": ("shapes_chat:train", 2000), "test": ("shapes_chat:test", 200)}
"""Split name -> (seed, samples)."""
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 40), "blue": (30, 60, 220),
           "yellow": (235, 200, 0), "purple": (130, 40, 170), "orange": (245, 120, 0)}  # fmt: skip
SHAPES = ("circle", "square", "triangle")
CELLS = 3
"""Pictures are a CELLS x CELLS grid; a shape sits inside one cell, so shapes never overlap."""
SIDES = (96, 128, 160)
TWO_PICTURE_SHARE = 8
"""One sample in this many asks about two pictures."""

Shape = tuple[str, str]
"""(shape, colour)."""


def shapes_chat_path(cache_dir: Path, split: str) -> Path:
    """The JSONL of ``split`` (train or test); its pictures are in the folder ``split``/."""
    return cache_dir / "builtin" / f"shapes_chat-v{SHAPES_CHAT_VERSION}" / f"{split}.jsonl"


def ensure_shapes_chat(cache_dir: Path, split: str = "train") -> Path:
    """Path of ``split``'s JSONL, drawing the set on first use."""
    path = shapes_chat_path(cache_dir, split)
    seed, count = SPLITS[split]
    return ensure_generated_jsonl(
        path, lambda: generate_shapes_chat(path.parent, split, count, seed)
    )


def ensure_shapes_chat_test(cache_dir: Path) -> Path:
    """``builtin:shapes_chat_test``: the held-out split."""
    return ensure_shapes_chat(cache_dir, "test")


def generate_shapes_chat(folder: Path, split: str, count: int, seed: str) -> list[dict[str, Any]]:
    """``count`` samples, their pictures written to ``folder / split``; JSONL records back."""
    rng = random.Random(seed)
    samples = []
    for index in range(count):
        if rng.randrange(TWO_PICTURE_SHARE) == 0:
            question, answer, scenes = _count_in_two(rng)
        else:
            question, answer, scene = rng.choice((_colour_of, _count_of, _shape_of))(rng)
            scenes = [scene]
        parts: list[dict[str, str]] = []
        for number, scene in enumerate(scenes):
            name = f"{split}/{index:05d}_{number}.png"
            picture = draw(scene, rng)
            atomic_write(folder / name, lambda f, p=picture: p.save(f, format="PNG"))
            parts.append({"type": "image", "path": name})
        parts.append({"type": "text", "text": question})
        samples.append({"messages": [{"role": "user", "content": parts},
                                     {"role": "assistant", "content": answer}]})  # fmt: skip
    return samples


def draw(scene: list[Shape], rng: random.Random) -> Image.Image:
    """A picture of ``scene``'s shapes, each in its own random cell, at a random size."""
    width, height = rng.choice(SIDES), rng.choice(SIDES)
    background = (255, 255, 255) if rng.randrange(2) else (235, 235, 225)
    picture = Image.new("RGB", (width, height), background)
    pen = ImageDraw.Draw(picture)
    cells = rng.sample(range(CELLS * CELLS), len(scene))
    cell_w, cell_h = width // CELLS, height // CELLS
    for (shape, colour), cell in zip(scene, cells):
        size = rng.randrange(min(cell_w, cell_h) // 2, min(cell_w, cell_h) - 2)
        left = cell % CELLS * cell_w + rng.randrange(cell_w - size)
        top = cell // CELLS * cell_h + rng.randrange(cell_h - size)
        box = (left, top, left + size, top + size)
        fill = COLOURS[colour]
        if shape == "circle":
            pen.ellipse(box, fill=fill)
        elif shape == "square":
            pen.rectangle(box, fill=fill)
        else:
            pen.polygon([(left + size // 2, top), (left, top + size), (left + size, top + size)],
                        fill=fill)  # fmt: skip
    return picture


def _others(
    rng: random.Random, count: int, not_shape: str = "", not_colour: str = ""
) -> list[Shape]:
    shapes = [s for s in SHAPES if s != not_shape]
    colours = [c for c in COLOURS if c != not_colour]
    return [(rng.choice(shapes), rng.choice(colours)) for _ in range(count)]


def _colour_of(rng: random.Random) -> tuple[str, str, list[Shape]]:
    shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
    scene = [(shape, colour), *_others(rng, rng.randrange(3), not_shape=shape)]
    return f"What colour is the {shape}?", f"The {shape} is {colour}.", scene


def _shape_of(rng: random.Random) -> tuple[str, str, list[Shape]]:
    shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
    scene = [(shape, colour), *_others(rng, rng.randrange(3), not_colour=colour)]
    return f"Which shape is {colour}?", f"The {colour} shape is a {shape}.", scene


def _count_of(rng: random.Random) -> tuple[str, str, list[Shape]]:
    shape, count = rng.choice(SHAPES), rng.randrange(1, 6)
    scene = [(shape, rng.choice(list(COLOURS))) for _ in range(count)]
    scene += _others(rng, rng.randrange(CELLS * CELLS - count + 1) // 2, not_shape=shape)
    rng.shuffle(scene)
    answer = f"There is 1 {shape}." if count == 1 else f"There are {count} {shape}s."
    return f"How many {shape}s are there?", answer, scene


def _count_in_two(rng: random.Random) -> tuple[str, str, list[list[Shape]]]:
    shape, counts = rng.choice(SHAPES), (rng.randrange(0, 4), rng.randrange(1, 4))
    scenes = []
    for count in counts:
        scene = [(shape, rng.choice(list(COLOURS))) for _ in range(count)]
        scene += _others(rng, rng.randrange(1, 3), not_shape=shape)
        rng.shuffle(scene)
        scenes.append(scene)
    total = sum(counts)
    answer = f"There is 1 {shape}." if total == 1 else f"There are {total} {shape}s."
    return f"How many {shape}s are in the two pictures together?", answer, scenes
