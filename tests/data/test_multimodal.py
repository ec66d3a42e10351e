"""Multimodal data: image patches equal Hugging Face's Qwen2-VL processor with Qwen3-VL's
settings, the multimodal chat JSONL (relative paths, every bad case one line naming file and
line), assistant-only labels, packing that keeps images with their text, exact resume with media,
the builtin shapes set, the builtin VL tokenizer and the data config.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from torchloom.config.errors import ConfigError
from torchloom.data.config import DataConfig
from torchloom.data.images import ImageProcessing, image_patches
from torchloom.data.loader import TrainLoader
from torchloom.data.mrope import mrope_positions
from torchloom.data.multimodal import (
    PackedMultimodal,
    load_multimodal_splits,
    resolve_image_processing,
)
from torchloom.data.multimodal_format import MediaTokens, iter_samples
from torchloom.data.packing import IGNORE_INDEX
from torchloom.data.shapes_chat import generate_shapes_chat
from torchloom.data.sources import SourceFile
from torchloom.data.tokenizer import (
    EOS_TOKEN,
    MEDIA_SPECIAL_TOKENS,
    Tokenizer,
    builtin_tokenizer_path,
    load_tokenizer,
)

# Qwen3-VL's patches (16 px, 2 frames, 2x2 merge, mean/std 0.5) with small pixel bounds.
PROCESSING = ImageProcessing(min_pixels=32 * 32, max_pixels=32 * 32 * 16)
MERGE = PROCESSING.merge_size


def drawn(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """A picture with a few filled shapes and some noise (so resampling has edges to round)."""
    rng = np.random.default_rng(seed)
    noise = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    image = Image.fromarray(noise // 4 + 150).convert(mode)
    pen = ImageDraw.Draw(image)
    for _ in range(3):
        x0, y0 = int(rng.integers(0, width // 2)), int(rng.integers(0, height // 2))
        x1, y1 = x0 + int(rng.integers(2, width // 2)), y0 + int(rng.integers(2, height // 2))
        colour = tuple(int(c) for c in rng.integers(0, 256, len(mode) if mode != "P" else 1))
        pen.ellipse((x0, y0, x1, y1), fill=colour if mode != "P" else colour[0])
    return image


@pytest.mark.parametrize(
    ("width", "height", "mode"),
    [(64, 64, "RGB"), (100, 37, "RGB"), (333, 517, "RGBA"), (20, 20, "L"), (900, 90, "P")],
)
def test_image_patches_equal_hugging_face(width: int, height: int, mode: str) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    reference = Qwen2VLImageProcessorPil(
        patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        size={"shortest_edge": PROCESSING.min_pixels, "longest_edge": PROCESSING.max_pixels},
    )  # fmt: skip
    image = drawn(width, height, mode)
    expected = reference(image, return_tensors="np")
    patches, grid = image_patches(image, PROCESSING)
    assert [list(grid)] == expected["image_grid_thw"].tolist()
    assert patches.shape == expected["pixel_values"].shape
    difference = float(np.abs(patches - expected["pixel_values"]).max())
    print(f"{width}x{height} {mode}: grid {grid}, max |difference| {difference}")
    assert np.array_equal(patches, expected["pixel_values"]), f"max difference {difference}"


def write_sample(folder: Path, lines: list[object], name: str = "data.jsonl") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def sample(images: list[str], question: str = "What is it?", answer: str = "A shape.") -> dict:
    parts = [{"type": "image", "path": p} for p in images] + [{"type": "text", "text": question}]
    return {"messages": [{"role": "user", "content": parts},
                         {"role": "assistant", "content": answer}]}  # fmt: skip


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sub/img/{0..5}.png of different sizes, for a JSONL in sub/."""
    folder = tmp_path_factory.mktemp("mm") / "sub"
    (folder / "img").mkdir(parents=True)
    for i, (w, h) in enumerate([(40, 40), (64, 32), (90, 70), (30, 60), (128, 128), (50, 20)]):
        drawn(w, h, seed=i).save(folder / "img" / f"{i}.png")
    return folder


def test_jsonl_paths_are_relative_to_the_file(vl_tokenizer: Tokenizer, image_folder: Path) -> None:
    path = write_sample(image_folder, [sample(["img/1.png", "img/2.png"])])
    media = MediaTokens.from_tokenizer(vl_tokenizer)
    [parsed] = iter_samples([SourceFile(path, "messages")], media, PROCESSING)
    assert [i.path for i in parsed.images] == [
        image_folder / "img/1.png",
        image_folder / "img/2.png",
    ]
    grids = [i.grid for i in parsed.images]
    assert grids == [image_patches(Image.open(i.path), PROCESSING)[1] for i in parsed.images]
    text = parsed.conversation.messages[0]["content"]
    expected = "".join(media.image_placeholder(t * h * w // MERGE**2) for t, h, w in grids)
    assert text == expected + "What is it?"


BAD_CASES = {
    "missing": ([sample(["img/nope.png"])], "does not exist"),
    "folder": ([sample(["img"])], "image {folder}/img is a folder, not an image file"),
    "undecodable": ([sample(["junk.png"])], "cannot be decoded"),
    "truncated": ([sample(["cut.png"])], "cannot be decoded"),
    "too large": ([sample(["img/4.png"])], "above the limit of 10000"),
    "audio": ([{"messages": [{"role": "user", "content": [{"type": "audio", "path": "a.wav"}]},
                             {"role": "assistant", "content": "hi"}]}], "has no audio encoder"),
    "no path": ([{"messages": [{"role": "user", "content": [{"type": "image", "url": "x"}]},
                               {"role": "assistant", "content": "hi"}]}], "needs a 'path'"),
    "path typo": ([{"messages": [{"role": "user", "content": [{"type": "image", "pth": "x"}]},
                                 {"role": "assistant", "content": "hi"}]}],
                  "found ['pth']. Rename 'pth' to 'path'."),
    "path not text": ([{"messages": [{"role": "user", "content": [{"type": "image", "path": 5}]},
                                     {"role": "assistant", "content": "hi"}]}],
                      "'path' must be a non-empty string, the file's path relative to the JSONL "
                      "file; got 5."),
    "bad type": ([{"messages": [{"role": "user", "content": [{"type": "imag", "path": "x"}]},
                                {"role": "assistant", "content": "hi"}]}], "Did you mean 'image'"),
    "forged token": ([sample([], question="look <|image_pad|>")], "only a media part"),
    "assistant image": ([{"messages": [{"role": "user", "content": "hi"},
                                       {"role": "assistant",
                                        "content": [{"type": "image", "path": "img/0.png"}]}]}],
                        "assistant message cannot hold an image"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_media_is_one_line_naming_file_and_line(
    case: str, vl_tokenizer: Tokenizer, image_folder: Path
) -> None:
    (image_folder / "junk.png").write_bytes(b"not an image at all")
    full = (image_folder / "img" / "2.png").read_bytes()
    (image_folder / "cut.png").write_bytes(full[: len(full) // 2])
    lines, message = BAD_CASES[case]
    path = write_sample(image_folder, [sample(["img/0.png"]), *lines], f"{case}.jsonl")
    processing = ImageProcessing(min_pixels=32 * 32, max_pixels=32 * 32 * 16, decode_limit=10_000)
    media = MediaTokens.from_tokenizer(vl_tokenizer)
    with pytest.raises(ConfigError) as caught:
        list(iter_samples([SourceFile(path, "messages")], media, processing))
    error = str(caught.value)
    print(error)
    assert "\n" not in error and f"{path}:2" in error
    assert message.format(folder=image_folder) in error


def test_samples_that_fit_no_row_or_a_template_without_replies(
    vl_tokenizer: Tokenizer, image_folder: Path
) -> None:
    with pytest.raises(ConfigError) as caught:
        build_rows(vl_tokenizer, image_folder, [sample(["img/4.png"])] * 3, seq_len=16)
    error = str(caught.value)
    print(error)
    assert error.startswith("All 3 training conversations were left out")
    assert "raise --training.seq_len" in error and "truncate" not in error  # media are never cut
    constant = Tokenizer(vl_tokenizer.backend, EOS_TOKEN, chat_templates={"default": "x"})
    path = write_sample(image_folder, [sample(["img/0.png"])] * 2, "constant.jsonl")
    media = MediaTokens.from_tokenizer(constant)
    with pytest.raises(ConfigError, match=f"{path}:1: the chat template renders this "
                                          "conversation as 'x', without its assistant"):  # fmt: skip
        load_multimodal_splits([SourceFile(path, "messages")], constant, media, PROCESSING, 0.0)


def build_rows(
    tokenizer: Tokenizer, folder: Path, lines: list[object], seq_len: int, max_images: int = 3
) -> PackedMultimodal:
    path = write_sample(folder, lines, "rows.jsonl")
    media = MediaTokens.from_tokenizer(tokenizer)
    files = [SourceFile(path, "messages")]
    train, _ = load_multimodal_splits(files, tokenizer, media, PROCESSING, val_fraction=0.0)
    return PackedMultimodal(train, seq_len, tokenizer.eos_id, media, PROCESSING, max_images,
                            PROCESSING.max_pixels // 16**2, )  # fmt: skip


def mixed_lines(count: int) -> list[object]:
    rng = np.random.default_rng(0)
    lines = []
    for i in range(count):
        images = [f"img/{j}.png" for j in rng.choice(6, int(rng.integers(0, 3)), replace=False)]
        lines.append(sample(images, f"Question {i}?", f"Answer {i}" + "!" * int(rng.integers(9))))
    return lines


def test_labels_are_the_assistant_replies_only(vl_tokenizer: Tokenizer, image_folder: Path) -> None:
    rows = build_rows(vl_tokenizer, image_folder, [sample(["img/1.png"], "Q?", "Red.")], 128)
    batch = rows.batch(np.array([0]))
    labels = batch.labels[0][batch.labels[0] != IGNORE_INDEX].tolist()
    assert vl_tokenizer.decode(labels) == "Red.<|im_end|>\n"
    assert rows.media.image_token_id not in labels


def test_packing_keeps_images_with_their_text(vl_tokenizer: Tokenizer, image_folder: Path) -> None:
    rows = build_rows(vl_tokenizer, image_folder, mixed_lines(24), seq_len=160)
    batch = rows.batch(np.arange(rows.num_rows))
    media, samples = rows.media, rows.samples
    grids_BN3, pixels_BNLP = batch.media["image_grid_thw"], batch.media["pixel_values"]
    assert pixels_BNLP.shape == (rows.num_rows, 3, PROCESSING.max_pixels // 256, 1536)
    packed = 0
    for r in range(rows.num_rows):
        indices = rows.text.conversations_of(r).tolist()
        images = [i for s in indices for i in range(*samples.image_offsets[s : s + 2])]
        packed += len(indices)
        present = grids_BN3[r].prod(dim=1) > 0
        assert present.tolist() == [True] * len(images) + [False] * (3 - len(images))
        for slot, image in enumerate(images):  # each image in its slot, in token order
            patches, grid = image_patches(Image.open(samples.image_paths[image]), PROCESSING)
            assert tuple(grids_BN3[r, slot].tolist()) == grid
            assert torch.equal(pixels_BNLP[r, slot, : len(patches)], torch.from_numpy(patches))
            assert not pixels_BNLP[r, slot, len(patches) :].any()
        placeholders = int((batch.tokens[r] == media.image_token_id).sum())
        expected = int((grids_BN3[r].prod(dim=1) // MERGE**2).sum())
        assert placeholders == expected, f"row {r}: {placeholders} placeholders, {expected} needed"
        # M-RoPE restarts at each packed sample: each sample's positions are its own.
        column = 0
        for s in indices:
            length = int(rows.text.kept_lengths[s]) - 1
            first, last = samples.image_offsets[s : s + 2]
            alone = mrope_positions(batch.tokens[r, column : column + length],
                                  torch.from_numpy(samples.image_grids[first:last]),
                                  media.image_token_id, media.image_start_token_id, MERGE)  # fmt: skip
            assert torch.equal(batch.positions[r, column : column + length], alone)
            column += length
    assert packed == 24 and rows.text.num_dropped == 0
    assert batch.positions.shape == (rows.num_rows, 160, 3)


def test_resume_gives_the_same_batches_media_included(
    vl_tokenizer: Tokenizer, image_folder: Path
) -> None:
    rows = build_rows(vl_tokenizer, image_folder, mixed_lines(24), seq_len=96, max_images=2)

    def loader() -> TrainLoader:
        return TrainLoader(rows, global_batch_size=2, micro_batch_size=1, seed=3)

    first = loader()
    for _ in range(rows.num_rows // 2 + 1):  # into the second epoch
        first.next_step()
    state = first.state_dict()
    expected = [first.next_step() for _ in range(3)]
    resumed = loader()
    resumed.load_state_dict(state)
    for want, got in zip(expected, [resumed.next_step() for _ in range(3)]):
        for a, b in zip(want, got):
            for name, tensor in a.named_tensors().items():
                assert torch.equal(tensor, b.named_tensors()[name]), name
    assert set(expected[0][0].media) == {"pixel_values", "image_grid_thw"}


def test_shapes_chat_is_deterministic_and_its_splits_differ(tmp_path: Path) -> None:
    one = generate_shapes_chat(tmp_path / "a", "train", 12, "shapes_chat:train")
    two = generate_shapes_chat(tmp_path / "b", "train", 12, "shapes_chat:train")
    test = generate_shapes_chat(tmp_path / "c", "test", 12, "shapes_chat:test")
    assert one == two and one != test
    for record in one:
        for part in record["messages"][0]["content"]:
            if part["type"] == "image":
                a, b = (np.asarray(Image.open(tmp_path / f / part["path"])) for f in "ab")
                assert np.array_equal(a, b), part["path"]


def test_builtin_vl_tokenizer_keeps_text_ids(builtin_cache: Path) -> None:
    text = load_tokenizer("builtin:stdlib_bpe", builtin_cache, 4096)
    vl = load_tokenizer("builtin:stdlib_bpe_vl", builtin_cache, 4096)
    sample_text = "<|im_start|>user\nWhat colour is the circle?<|im_end|>\n"
    assert vl.encode_chat(sample_text) == text.encode_chat(sample_text)
    ids = [vl.backend.token_to_id(t) for t in MEDIA_SPECIAL_TOKENS]
    assert ids == list(range(text.vocab_size, text.vocab_size + len(MEDIA_SPECIAL_TOKENS)))
    assert vl.vocab_size == text.vocab_size + len(MEDIA_SPECIAL_TOKENS)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tokenizer": "builtin:stdlib_bpe"}, "has no image tokens"),
        ({"overlong_conversations": "truncate"}, "could split an image"),
        ({"sources": ["builtin:chat_tasks"]}, "holds chat data"),
        ({"max_images_per_row": 0}, "must be at least 1"),
        ({"image_min_pixels": 9, "image_max_pixels": 4}, "min <= max"),
    ],
)
def test_multimodal_config_errors(fields: dict, message: str) -> None:
    base = {"format": "multimodal", "sources": ["builtin:shapes_chat"],
            "tokenizer": "builtin:stdlib_bpe_vl"}  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        DataConfig(**{**base, **fields}).validate()
    with pytest.raises(ConfigError, match="holds multimodal data"):
        DataConfig(format="chat", sources=["builtin:shapes_chat"]).validate()


def test_builtin_shapes_chat_builds_loaders(
    builtin_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchloom.data import build_dataloaders, shapes_chat

    tokenizer_file = builtin_tokenizer_path(builtin_cache, 4096)
    (tmp_path / "builtin").mkdir()
    shutil.copy(tokenizer_file, builtin_tokenizer_path(tmp_path, 4096))
    monkeypatch.setattr(shapes_chat, "SPLITS", {"train": ("shapes_chat:train", 40)})
    cfg = DataConfig(format="multimodal", sources=["builtin:shapes_chat"],
                     tokenizer="builtin:stdlib_bpe_vl", cache_dir=str(tmp_path),
                     val_fraction=0.1, image_min_pixels=32 * 32, max_image_patches=64)  # fmt: skip
    _, train, val = build_dataloaders(cfg, seq_len=256, global_batch_size=2,
                                              micro_batch_size=2)  # fmt: skip
    [batch] = train.next_step()
    assert batch.media["pixel_values"].shape == (2, 4, 64, 1536)
    assert batch.positions.shape == (2, 256, 3) and val is not None


def test_image_settings_come_from_the_tokenizer_folder(
    vl_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    config = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
              "image_mean": [0.48, 0.46, 0.41], "image_std": [0.27, 0.26, 0.28],
              "size": {"shortest_edge": 3136, "longest_edge": 12845056}}  # fmt: skip
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    vl_tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    folder_tokenizer = Tokenizer.from_file(tmp_path)
    cfg = DataConfig(format="multimodal", max_image_patches=100)
    processing = resolve_image_processing(cfg, folder_tokenizer)
    assert (processing.patch_size, processing.min_pixels) == (14, 3136)
    assert processing.image_mean == (0.48, 0.46, 0.41)
    assert processing.max_pixels == 100 * 14 * 14  # lowered so an image fits its 100 slots
    with pytest.raises(ConfigError, match="raise it to 16"):
        resolve_image_processing(DataConfig(max_image_patches=15), folder_tokenizer)
