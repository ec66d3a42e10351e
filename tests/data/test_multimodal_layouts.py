"""Media layouts beyond Qwen-VL: Kimi K2.5's and Muse's image processors equal transformers' own
(live when torchvision imports, else against numbers recorded from them), WAV reading and Muse
Spark's audio features equal transformers' feature extractor, audio parts in the JSONL (every bad
clip one line naming file and line), packing that keeps clips with their text, and every layout
built from config with the builtin VL tokenizer.
"""

from __future__ import annotations

import json
import shutil
import wave
from dataclasses import replace
from pathlib import Path
from typing import Any, get_args, get_type_hints

import numpy as np
import pytest
import torch

from torchloom.config.errors import ConfigError
from torchloom.data.audio import AudioProcessing, audio_features, load_wav, write_wav
from torchloom.data.config import DataConfig
from torchloom.data.images import ImageProcessing, image_patches, kimi_resize
from torchloom.data.media_layout import MEDIA_LAYOUTS, builtin_media_ids, media_layout
from torchloom.data.multimodal import PackedMultimodal, load_multimodal_splits
from torchloom.data.multimodal_format import MediaTokens, iter_samples
from torchloom.data.sources import SourceFile
from torchloom.data.tokenizer import Tokenizer, builtin_tokenizer_path

from .test_multimodal import drawn

RATE = 24000
SPARK = MEDIA_LAYOUTS["muse_spark"].with_builtin_tokens()
AUDIO = AudioProcessing(RATE, 1920, max_seconds=1.0)
MUSE = ImageProcessing.of("muse", max_image_tokens=16)

# transformers 5.24's Kimi_K25ImageProcessor / MuseGlimmerImageProcessor (torchvision 0.28, CPU)
# on drawn(width, height, mode): (processor, w, h, mode, kwargs, grid, sum, sum of |x|) of the
# float64 pixel values. Recorded with the live comparison below, which they must keep passing.
RECORDED = [
    ("kimi", 100, 37, "RGB", {}, (1, 4, 8), -4016.0626486241817, 13371.874623596668),
    ("kimi", 333, 517, "RGBA", {}, (1, 38, 24), 199220.10043148324, 239843.51220379397),
    ("kimi", 20, 20, "L", {}, (1, 2, 2), -752.8470446169376, 1693.6235447824001),
    ("kimi", 900, 90, "P", {}, (1, 8, 66), 8950.403037115932, 173225.20315651596),
    ("kimi", 333, 517, "RGB", {"max_patches": 64}, (1, 12, 8), -2190.776297508739,
     33774.61982548237),
    ("muse", 100, 37, "RGB", {}, (1, 2, 6), 4710.431482838467, 7114.258956369013),
    ("muse", 333, 517, "RGBA", {}, (1, 38, 24), 454755.82428000215, 456941.0478362227),
    ("muse", 20, 20, "L", {}, (1, 2, 2), 1564.5647535603493, 2089.882410770282),
    ("muse", 900, 90, "P", {}, (1, 6, 64), 142141.58915269934, 196091.89531668462),
    ("muse", 333, 517, "RGB", {"max_image_tokens": 16}, (1, 10, 6), 26439.70227899961,
     30032.282746754587),
]  # fmt: skip


@pytest.mark.parametrize("case", RECORDED, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}-{c[3]}")
def test_raster_patches_equal_recorded_hugging_face(case: tuple[Any, ...]) -> None:
    kind, width, height, mode, kwargs, grid, total, magnitude = case
    patches, got = image_patches(drawn(width, height, mode), ImageProcessing.of(kind, **kwargs))
    values = patches.astype(np.float64)
    print(kind, got, values.sum() - total, np.abs(values).sum() - magnitude)
    assert got == grid and len(patches) == grid[1] * grid[2]
    assert patches.shape[1] == {"kimi": 3 * 14 * 14, "muse": 2 * 3 * 14 * 14}[kind]
    assert values.sum() == total and np.abs(values).sum() == magnitude


@pytest.mark.parametrize("case", RECORDED, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}-{c[3]}")
def test_raster_patches_equal_hugging_face_live(case: tuple[Any, ...]) -> None:
    pytest.importorskip("torchvision")
    from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor
    from transformers.models.muse_glimmer.image_processing_muse_glimmer import (
        MuseGlimmerImageProcessor,
    )

    kind, width, height, mode, kwargs, *_ = case
    image = drawn(width, height, mode)
    hf = {"kimi": Kimi_K25ImageProcessor, "muse": MuseGlimmerImageProcessor}[kind]()
    expected = hf(image, return_tensors="pt", **kwargs)
    pixels = expected["pixel_values"].reshape(len(expected["pixel_values"]), -1).numpy()
    patches, grid = image_patches(image, ImageProcessing.of(kind, **kwargs))
    assert grid == tuple(expected["image_grid_thw"][0].tolist())
    difference = np.abs(patches - pixels).max()
    print(f"{kind} {width}x{height} {mode}: max |difference| {difference}")
    assert difference == 0.0


def test_kimi_padding_fits_the_patch_slots() -> None:
    """Hugging Face's padding may exceed max_patches; with max_padded_patches it never does."""
    exact = ImageProcessing.of("kimi", max_patches=64)
    fitted = ImageProcessing.of("kimi", max_patches=64, max_padded_patches=64)
    _, padded = kimi_resize(517, 333, exact)
    assert padded[0] * padded[1] // 14**2 == 96  # over 64: as Hugging Face's
    for height, width in [(517, 333), (90, 900), (1000, 1000), (15, 4000)]:
        _, (pad_h, pad_w) = kimi_resize(height, width, fitted)
        assert pad_h * pad_w // 14**2 <= 64, (height, width, pad_h, pad_w)


def sine(seconds: float, hertz: float, rate: int = RATE) -> np.ndarray:
    return 0.5 * np.sin(2 * np.pi * hertz * np.arange(round(seconds * rate)) / rate)


def test_wav_samples_are_the_pcm_values(tmp_path: Path) -> None:
    ints = np.array([0, 1, -1, 12345, -32768, 32767], dtype="<i2")
    for width, scale, data in [
        (2, 2**15, ints.tobytes()),
        (4, 2**31, (ints.astype("<i4") << 16).tobytes()),
        (1, 2**7, ((ints >> 8) + 128).astype(np.uint8).tobytes()),
        (3, 2**23, b"".join((int(v) << 8).to_bytes(3, "little", signed=True) for v in ints)),
    ]:
        path = tmp_path / f"w{width}.wav"
        with wave.open(str(path), "wb") as writer:
            writer.setnchannels(1)
            writer.setsampwidth(width)
            writer.setframerate(RATE)
            writer.writeframes(data)
        samples, rate = load_wav(path, "here")
        expected = (ints >> 8 if width == 1 else ints).astype(np.int64) << {
            1: 0,
            2: 0,
            3: 8,
            4: 16,
        }[width]
        assert rate == RATE and samples.dtype == np.float32
        assert np.array_equal(samples, (expected.astype(np.float64) / scale).astype(np.float32))
    stereo = tmp_path / "stereo.wav"
    with wave.open(str(stereo), "wb") as writer:
        writer.setnchannels(2)
        writer.setsampwidth(2)
        writer.setframerate(RATE)
        writer.writeframes(np.array([100, 300, -50, 50], dtype="<i2").tobytes())
    samples, _ = load_wav(stereo, "here")
    assert np.array_equal(samples, np.array([200, 0], dtype=np.float32) / 2**15)


def test_audio_features_equal_muse_spark_feature_extractor(tmp_path: Path) -> None:
    from transformers.models.muse_spark.feature_extraction_muse_spark import (
        MuseSparkFeatureExtractor,
    )

    extractor = MuseSparkFeatureExtractor()
    assert (extractor.sampling_rate, extractor.samples_per_token) == (RATE, 1920)
    for seconds, hertz in [(0.05, 440.0), (0.08, 1000.0), (0.2, 3000.0), (1920 / RATE, 220.0)]:
        path = tmp_path / f"{hertz}.wav"
        write_wav(path, sine(seconds, hertz), RATE)
        samples, _ = load_wav(path, "here")
        expected = extractor(samples, sampling_rate=RATE, return_tensors="np")
        values = audio_features(samples, AUDIO)
        difference = np.abs(values - expected["input_values"][0]).max()
        print(f"{seconds:.3f} s {hertz} Hz: {len(values)} values, max |difference| {difference}")
        assert values.shape == expected["input_values"][0].shape and difference == 0.0
        assert int(expected["input_values_mask"][0].sum()) == len(samples)
        assert SPARK.audio_tokens(len(samples)) == len(values) // 1920


def write_jsonl(folder: Path, lines: list[Any], name: str = "data.jsonl") -> Path:
    path = folder / name
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def audio_sample(
    clips: list[str], images: tuple[str, ...] | list[str] = (), answer: str = "High."
) -> Any:
    parts = [{"type": "image", "path": i} for i in images]
    parts += [{"type": "audio", "path": c} for c in clips]
    parts.append({"type": "text", "text": "Which tone is higher?"})
    return {"messages": [{"role": "user", "content": parts},
                         {"role": "assistant", "content": answer}]}  # fmt: skip


@pytest.fixture
def media_folder(tmp_path: Path) -> Path:
    (tmp_path / "clips").mkdir()
    for index, (seconds, hertz) in enumerate([(0.1, 440.0), (0.25, 880.0), (0.5, 660.0)]):
        write_wav(tmp_path / "clips" / f"{index}.wav", sine(seconds, hertz), RATE)
    write_wav(tmp_path / "slow.wav", sine(0.1, 440.0, 16000), 16000)
    write_wav(tmp_path / "long.wav", sine(1.5, 440.0), RATE)
    (tmp_path / "junk.wav").write_bytes(b"RIFF not really a wave file")
    (tmp_path / "cut.wav").write_bytes((tmp_path / "clips" / "1.wav").read_bytes()[:60])
    drawn(60, 40).save(tmp_path / "a.png")
    return tmp_path


BAD_AUDIO = {
    "missing": ("clips/nope.wav", "does not exist"),
    "undecodable": ("junk.wav", "cannot be decoded as a PCM WAV"),
    "other rate": ("slow.wav", "16000 Hz, but the audio encoder expects 24000 Hz"),
    "too long": ("long.wav", "longer than --data.max_audio_seconds=1"),
    # The header alone looks fine: caught when the data is read, not when its batch is built.
    "truncated": ("cut.wav", "is truncated: its header promises 6000 frames (12000 bytes of "
                             "samples), but the file holds only 60 bytes"),
    "folder": ("clips", "is a folder, not a WAV file"),
}  # fmt: skip


@pytest.mark.parametrize("case", [*BAD_AUDIO, "no audio encoder", "assistant audio"])
def test_bad_audio_is_one_line_naming_file_and_line(
    case: str,
    vl_tokenizer: Tokenizer,
    media_folder: Path,
) -> None:
    layout = SPARK
    if case in BAD_AUDIO:
        clip, message = BAD_AUDIO[case]
        bad = audio_sample([clip])
    elif case == "no audio encoder":
        layout, message = MEDIA_LAYOUTS["qwen3_vl"], "qwen3_vl has no audio encoder"
        bad = audio_sample(["clips/0.wav"])
    else:
        message = "assistant message cannot hold an audio part"
        bad = {"messages": [{"role": "user", "content": "hi"},
                            {"role": "assistant",
                             "content": [{"type": "audio", "path": "clips/0.wav"}]}]}  # fmt: skip
    path = write_jsonl(media_folder, [audio_sample([], ["a.png"]), bad])
    media = MediaTokens.from_tokenizer(vl_tokenizer, layout)
    with pytest.raises(ConfigError) as caught:
        list(iter_samples([SourceFile(path, "messages")], media, MUSE, AUDIO))
    error = str(caught.value)
    print(error)
    assert "\n" not in error and f"{path}:2" in error and message in error


def test_packing_keeps_audio_with_its_text(
    vl_tokenizer: Tokenizer,
    media_folder: Path,
) -> None:
    lines = [audio_sample(["clips/0.wav", "clips/1.wav"], ["a.png"]),
             audio_sample(["clips/2.wav"]), audio_sample(["clips/1.wav"], answer="Low."),
             audio_sample([], ["a.png"])]  # fmt: skip
    path = write_jsonl(media_folder, lines)
    media = MediaTokens.from_tokenizer(vl_tokenizer, SPARK)
    files = [SourceFile(path, "messages")]
    train, _ = load_multimodal_splits(files, vl_tokenizer, media, MUSE, 0.0, AUDIO)
    rows = PackedMultimodal(train, 512, vl_tokenizer.eos_id, media, MUSE, 2, 64,
                            audio=AUDIO, max_audios_per_row=2)  # fmt: skip
    batch = rows.batch(np.arange(rows.num_rows))
    values_BAS1, lengths_BA = batch.media["audio_values"], batch.media["audio_lengths"]
    S = AUDIO.max_samples
    assert S == 13 * 1920 and values_BAS1.shape == (rows.num_rows, 2, S, 1)
    assert batch.media["pixel_values"].shape == (rows.num_rows, 2, 64, 1176)
    assert batch.positions.shape == (rows.num_rows, 512)  # 1-D positions
    clips_seen = 0
    for r in range(rows.num_rows):
        indices = rows.text.conversations_of(r).tolist()
        clips = [c for s in indices for c in range(*train.audio_offsets[s : s + 2].tolist())]
        assert len(clips) <= 2
        clips_seen += len(clips)
        for slot, clip in enumerate(clips):
            samples, _ = load_wav(train.audio_paths[clip], "here")
            assert int(lengths_BA[r, slot]) == len(samples)
            features = torch.from_numpy(audio_features(samples, AUDIO))
            assert torch.equal(values_BAS1[r, slot, : len(features), 0], features)
            assert not values_BAS1[r, slot, len(features) :].any()
        assert not lengths_BA[r, len(clips) :].any()
        audio_tokens = int((batch.tokens[r] == media.audio_token_id).sum())
        needed = sum(SPARK.audio_tokens(int(n)) for n in lengths_BA[r].tolist() if n)
        assert audio_tokens == needed, f"row {r}: {audio_tokens} audio tokens, {needed} needed"
    assert clips_seen == 4 and rows.text.num_dropped == 0
    with pytest.raises(ConfigError, match="max_audios_per_row=1; raise it"):
        PackedMultimodal(train, 512, vl_tokenizer.eos_id, media, MUSE, 2, 64,
                         audio=AUDIO, max_audios_per_row=1)  # fmt: skip


def test_layouts_and_their_placeholders() -> None:
    assert tuple(MEDIA_LAYOUTS) == get_args(get_type_hints(DataConfig)["media_layout"])
    kimi, spark = MEDIA_LAYOUTS["kimi_k25"], MEDIA_LAYOUTS["muse_spark"]
    assert kimi.image_placeholder(2) == (
        "<|media_begin|>image<|media_content|><|media_pad|><|media_pad|><|media_end|>"
    )
    assert spark.image_placeholder(1) == "<|image_start|><|patch|><|image_end|>"
    assert (
        spark.audio_placeholder(1921) == "<|soft_audio_start|><|audio|><|audio|><|soft_audio_end|>"
    )
    assert not MEDIA_LAYOUTS["muse_glimmer"].has_audio and spark.has_audio
    builtin = kimi.with_builtin_tokens()
    assert builtin.image_placeholder(1) == "<|vision_start|><|image_pad|><|vision_end|>"
    assert spark.with_builtin_tokens().audio_token == "<|audio_pad|>"
    with pytest.raises(ConfigError, match="Did you mean 'kimi_k25'"):
        media_layout("kimi_k2.5")


def test_model_tokenizer_without_layout_tokens_is_refused(
    vl_tokenizer: Tokenizer,
) -> None:
    with pytest.raises(ConfigError, match="no '<|media_begin|>' token.*kimi_k25"):
        MediaTokens.from_tokenizer(vl_tokenizer, MEDIA_LAYOUTS["kimi_k25"])


@pytest.mark.parametrize(
    ("layout", "patch_values", "audio"),
    [("kimi_k25", 588, False), ("muse_glimmer", 1176, False), ("muse_spark", 1176, True)],
)
def test_every_layout_builds_loaders_on_builtin_ids(
    layout: str, patch_values: int, audio: bool, builtin_cache: Path, media_folder: Path
) -> None:
    from torchloom.data import build_dataloaders

    cache = media_folder / "cache"
    (cache / "builtin").mkdir(parents=True)
    shutil.copy(builtin_tokenizer_path(builtin_cache, 4096), builtin_tokenizer_path(cache, 4096))
    clips = ["clips/0.wav"] if audio else []
    path = write_jsonl(media_folder, [audio_sample(clips, ["a.png"])] * 4)
    cfg = DataConfig(format="multimodal", sources=[str(path)], tokenizer="builtin:stdlib_bpe_vl",
                     cache_dir=str(cache), val_fraction=0.0, media_layout=layout,
                     max_image_patches=64, max_audio_seconds=1.0)  # fmt: skip
    tokenizer, train, _ = build_dataloaders(cfg, seq_len=128, global_batch_size=2,
                                            micro_batch_size=2)  # fmt: skip
    [batch] = train.next_step()
    media = MediaTokens.from_tokenizer(tokenizer, media_layout(layout).with_builtin_tokens())
    assert media.image_token_id == tokenizer.backend.token_to_id("<|image_pad|>") >= 4096
    ids = builtin_media_ids(media_layout(layout), 4096)  # what a debug recipe gives its model
    assert ids == {role: getattr(media, role) for role in ids}
    assert len(ids) == (6 if audio else 3)
    assert batch.media["pixel_values"].shape == (2, 4, 64, patch_values)
    assert batch.positions.shape == (2, 128)
    assert ("audio_values" in batch.media) == audio
    if audio:
        assert batch.media["audio_values"].shape == (2, 2, 13 * 1920, 1)  # 1 s: 12.5 tokens
        clips = int((batch.media["audio_lengths"] > 0).sum())
        assert int((batch.tokens == media.audio_token_id).sum()) == 2 * clips  # 0.1 s: 2 tokens


def test_builtin_tones_chat(
    builtin_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchloom.data import build_dataloaders, tones_chat

    (tmp_path / "builtin").mkdir()
    shutil.copy(builtin_tokenizer_path(builtin_cache, 4096), builtin_tokenizer_path(tmp_path, 4096))
    monkeypatch.setattr(tones_chat, "SPLITS", {"train": ("tones_chat:train", 12)})
    path = tones_chat.ensure_tones_chat(tmp_path)
    for line in path.read_text().splitlines():
        record = json.loads(line)
        clips = [path.parent / p["path"] for p in record["messages"][0]["content"][:2]]
        waves = [load_wav(clip, "here")[0] for clip in clips]
        question, answer = record["messages"][0]["content"][2]["text"], record["messages"][1]
        crossings = [int((np.diff(np.sign(w)) > 0).sum()) * RATE / len(w) for w in waves]
        measure = crossings if "higher" in question else [len(w) for w in waves]
        first = "first" if measure[0] > measure[1] else "second"
        assert answer["content"] == f"The {first} tone is {question.split()[-1][:-1]}.", record
        assert all(abs(np.abs(w).max() - 12000 / 32767) < 1e-4 for w in waves)
    cfg = DataConfig(format="multimodal", sources=["builtin:tones_chat"],
                     tokenizer="builtin:stdlib_bpe_vl", cache_dir=str(tmp_path),
                     val_fraction=0.0, media_layout="muse_spark", max_audio_seconds=0.6)  # fmt: skip
    _, train, _ = build_dataloaders(cfg, seq_len=256, global_batch_size=2, micro_batch_size=2)
    [batch] = train.next_step()
    assert batch.media["audio_values"].shape == (2, 2, 8 * 1920, 1)  # 0.6 s: 7.5 tokens
    assert (batch.media["audio_lengths"] > 0).sum() >= 2
    with pytest.raises(ConfigError, match="qwen3_vl has no audio encoder"):
        build_dataloaders(replace(cfg, media_layout="qwen3_vl"), 256, 2, 2)
