"""The builtin audio-chat set ``builtin:tones_chat``: two tones one after the other and a question
about them ("Which tone is higher?", "Which tone is longer?"), for models with an audio encoder
(--data.media_layout muse_spark).

Generated on first use into the cache (no download): a folder of 24 kHz 16-bit WAV files and a
multimodal chat JSONL beside it. The tones are triangle waves computed in integers, so every
machine writes the same files. ``builtin:tones_chat_test`` is the held-out split (another seed).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np

from torchloom.data.audio import write_wav
from torchloom.data.cache import atomic_write, ensure_generated_jsonl

# Bump when the tones, questions or lengths change, so old cached sets are not reused.
TONES_CHAT_VERSION = 1
SPLITS = {"train": ("tones_chat:train", 1000), "test": ("tones_chat:test", 100)}
"""Split name -> (seed, samples)."""
RATE = 24000
"""Muse Spark's sampling rate."""
PITCHES = (220, 262, 330, 392, 440, 523, 659, 784, 880, 1047)
"""Hertz of the tones a sample picks two different ones from."""
DURATIONS_MS = (150, 250, 400, 600)
AMPLITUDE = 12000
"""Peak of a tone in 16-bit units."""
ORDINALS = ("first", "second")


def tones_chat_path(cache_dir: Path, split: str) -> Path:
    """The JSONL of ``split`` (train or test); its clips are in the folder ``split``/."""
    return cache_dir / "builtin" / f"tones_chat-v{TONES_CHAT_VERSION}" / f"{split}.jsonl"


def ensure_tones_chat(cache_dir: Path, split: str = "train") -> Path:
    """Path of ``split``'s JSONL, writing the set on first use."""
    path = tones_chat_path(cache_dir, split)
    seed, count = SPLITS[split]
    return ensure_generated_jsonl(
        path, lambda: generate_tones_chat(path.parent, split, count, seed)
    )


def ensure_tones_chat_test(cache_dir: Path) -> Path:
    """``builtin:tones_chat_test``: the held-out split."""
    return ensure_tones_chat(cache_dir, "test")


def generate_tones_chat(folder: Path, split: str, count: int, seed: str) -> list[dict[str, Any]]:
    """``count`` samples, their clips written to ``folder / split``; JSONL records back."""
    rng = random.Random(seed)
    samples = []
    for index in range(count):
        pitches = rng.sample(PITCHES, 2)
        durations = rng.sample(DURATIONS_MS, 2)
        parts: list[dict[str, str]] = []
        for number, (hertz, ms) in enumerate(zip(pitches, durations)):
            name = f"{split}/{index:05d}_{number}.wav"
            samples_N = triangle(hertz, ms * RATE // 1000) / 32767
            atomic_write(folder / name, lambda f, s=samples_N: write_wav(f, s, RATE))
            parts.append({"type": "audio", "path": name})
        if rng.randrange(2):
            values, question, quality = pitches, "Which tone is higher?", "higher"
        else:
            values, question, quality = durations, "Which tone is longer?", "longer"
        answer = f"The {ORDINALS[values.index(max(values))]} tone is {quality}."
        parts.append({"type": "text", "text": question})
        samples.append({"messages": [{"role": "user", "content": parts},
                                     {"role": "assistant", "content": answer}]})  # fmt: skip
    return samples


def triangle(hertz: int, count: int) -> np.ndarray:
    """``count`` samples of a triangle wave of ``hertz`` at RATE, int64, in integer arithmetic."""
    phase = np.arange(count, dtype=np.int64) * hertz * 4 % (4 * RATE)  # quarter periods x RATE
    rising = np.where(phase < 2 * RATE, phase, 4 * RATE - phase)  # 0 .. 2 RATE .. 0
    return (rising - RATE) * AMPLITUDE // RATE
