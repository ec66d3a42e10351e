"""Audio clips for models with an audio encoder: read a WAV file and turn it into the waveform
Muse Spark's feature extractor (transformers' ``MuseSparkFeatureExtractor``) gives its model.

Muse Spark's audio tower reads the raw mono waveform, so the features are the samples as
float32 in [-1, 1), zero-padded on the right to a multiple of ``samples_per_token`` (1920); the
clip's real length travels beside them. WAV files are read with the standard library's ``wave``
(integer PCM, 8 to 32 bits; several channels are averaged to mono). A file at another sampling
rate than the extractor's is refused, naming both rates: resampling changes what the model
hears, so it is left to a tool the user chooses (``sox in.wav -r 24000 out.wav``), as the
extractor itself refuses it.
"""

from __future__ import annotations

import wave
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from torchloom.config.errors import ConfigError


@dataclass(frozen=True)
class AudioProcessing:
    """How audio clips become the model's waveform slots (Muse Spark's settings by default)."""

    sampling_rate: int = 24000
    """Hertz the encoder expects; files at another rate are refused."""
    samples_per_token: int = 1920
    """Samples folded into one language-model token; slots are multiples of it."""
    max_seconds: float = 30.0
    """Longer clips are refused (--data.max_audio_seconds)."""

    @property
    def max_samples(self) -> int:
        """S, the samples of one clip slot: max_seconds rounded up to whole tokens."""
        tokens = -(-round(self.max_seconds * self.sampling_rate) // self.samples_per_token)
        return tokens * self.samples_per_token


def wav_info(path: Path, where: str, processing: AudioProcessing) -> int:
    """The number of samples of the WAV file at ``path``, checked without reading them (only
    the last one): a ConfigError naming ``where`` (the JSONL line), the file and the fix when it
    is missing, not a PCM WAV, shorter than its header says, at another rate, or longer than
    ``processing.max_seconds``."""
    with _open(path, where) as reader:
        rate, frames = reader.getframerate(), reader.getnframes()
        frame_bytes = reader.getnchannels() * reader.getsampwidth()
        complete = True
        if frames:  # the header's count, checked by reading the last frame it promises
            reader.setpos(frames - 1)
            complete = len(reader.readframes(1)) == frame_bytes
    if not complete:
        raise ConfigError(
            f"{where}: audio {path} is truncated: its header promises {frames} frames "
            f"({frames * frame_bytes} bytes of samples), but the file holds only "
            f"{path.stat().st_size} bytes. Fix or replace the file, or remove the line."
        )
    if rate != processing.sampling_rate:
        raise ConfigError(
            f"{where}: audio {path} is sampled at {rate} Hz, but the audio encoder expects "
            f"{processing.sampling_rate} Hz; resample the file (e.g. sox in.wav -r "
            f"{processing.sampling_rate} out.wav)."
        )
    if frames == 0:
        raise ConfigError(f"{where}: audio {path} holds no samples. Fix or remove the part.")
    if frames > processing.max_seconds * rate:
        raise ConfigError(
            f"{where}: audio {path} lasts {frames / rate:.2f} s, longer than "
            f"--data.max_audio_seconds={processing.max_seconds:g}; cut the clip or raise the limit."
        )
    return frames


def load_wav(path: Path, where: str) -> tuple[np.ndarray, int]:
    """``(samples [n] float32 in [-1, 1), rate)`` of the WAV file at ``path``, channels averaged."""
    with _open(path, where) as reader:
        channels, width = reader.getnchannels(), reader.getsampwidth()
        rate, frames = reader.getframerate(), reader.getnframes()
        data = reader.readframes(frames)
    if len(data) != frames * channels * width:
        raise ConfigError(
            f"{where}: audio {path} is truncated ({len(data)} of {frames * channels * width} "
            "bytes). Fix or replace the file, or remove the line."
        )
    samples = _pcm_to_float(data, width).reshape(frames, channels)
    return samples.mean(axis=1, dtype=np.float32) if channels > 1 else samples[:, 0], rate


def audio_features(samples: np.ndarray, processing: AudioProcessing) -> np.ndarray:
    """Muse Spark's input values of one clip: float32 ``[n']``, zero-padded to a multiple of
    ``samples_per_token``."""
    padded = -(-len(samples) // processing.samples_per_token) * processing.samples_per_token
    values = np.zeros(padded, dtype=np.float32)
    values[: len(samples)] = samples
    return values


def write_wav(file: Path | BinaryIO, samples: np.ndarray, rate: int) -> None:
    """Write mono float samples in [-1, 1] as 16-bit PCM (builtin data and tests)."""
    pcm = np.clip(np.round(samples * 32767), -32768, 32767).astype("<i2")
    with wave.open(str(file) if isinstance(file, Path) else file, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(rate)
        writer.writeframes(pcm.tobytes())


def _open(path: Path, where: str) -> wave.Wave_read:
    if path.is_dir():
        raise ConfigError(
            f"{where}: audio {path} is a folder, not a WAV file. Give the path of the WAV file "
            "in it, or remove the line."
        )
    if not path.is_file():
        raise ConfigError(
            f"{where}: audio {path} does not exist. Audio paths are relative to the JSONL "
            "file's folder. Fix the path, or remove the line."
        )
    try:
        return wave.open(str(path), "rb")
    except (wave.Error, EOFError, OSError) as e:
        raise ConfigError(
            f"{where}: audio {path} cannot be decoded as a PCM WAV file ({type(e).__name__}: "
            f"{e}). Convert it to 16-bit PCM WAV, or remove the line."
        ) from None


def _pcm_to_float(data: bytes, width: int) -> np.ndarray:
    """Little-endian PCM of ``width`` bytes per sample as float32 in [-1, 1)."""
    if width == 1:  # 8-bit WAV is unsigned
        return (np.frombuffer(data, np.uint8).astype(np.float32) - 128) / 128
    if width == 3:  # 24-bit: widen to 32 bits, the sample in the top three bytes
        raw = np.frombuffer(data, np.uint8).reshape(-1, 3)
        wide = np.zeros((len(raw), 4), dtype=np.uint8)
        wide[:, 1:] = raw
        return (wide.view("<i4")[:, 0].astype(np.float64) / 2**31).astype(np.float32)
    ints = np.frombuffer(data, {2: "<i2", 4: "<i4"}[width])
    return (ints.astype(np.float64) / 2 ** (8 * width - 1)).astype(np.float32)
