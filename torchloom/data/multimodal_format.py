"""The multimodal chat JSONL format: one sample per line, message content a string or a list of
parts, images and audio clips by path relative to the JSONL file.

    {"messages": [{"role": "user", "content": [{"type": "text", "text": "What colour?"},
                                               {"type": "image", "path": "img/0.png"}]},
                  {"role": "assistant", "content": "Red."}]}

Each image part is rendered into its message's text as the media layout's placeholder (for
Qwen-VL: ``<|vision_start|>`` + one ``<|image_pad|>`` per language-model token of the image +
``<|vision_end|>``, the text its chat template and processor produce together), so any chat
template renders the sample and SFT's assistant-only masking applies unchanged. An
``{"type": "audio", "path": "clip.wav"}`` part becomes the layout's audio placeholder; layouts
without an audio encoder refuse it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchloom.config.errors import ConfigError, did_you_mean
from torchloom.data.audio import AudioProcessing, wav_info
from torchloom.data.chat import Message
from torchloom.data.conversations import Conversation, parse_messages, rename_hint
from torchloom.data.images import ImageProcessing, image_grid, load_image
from torchloom.data.media_layout import MEDIA_LAYOUTS, MediaLayout
from torchloom.data.sources import MESSAGES_FIELD, SourceFile, iter_jsonl_records
from torchloom.data.tokenizer import Tokenizer

PART_TYPES = ("text", "image", "audio")
EXAMPLE = (
    f'{{"{MESSAGES_FIELD}": [{{"role": "user", "content": [{{"type": "text", "text": "What is '
    'this?"}, {"type": "image", "path": "img/0.png"}]}, {"role": "assistant", "content": '
    '"A cat."}]}'
)
NO_ID = -1
"""The id of a token the layout does not use (audio tokens of a layout without audio)."""


@dataclass(frozen=True)
class MediaTokens:
    """A media layout's tokens and their ids in the tokenizer (a model's config names the same
    ids: image_token_id, ...)."""

    layout: MediaLayout
    image_token_id: int
    image_start_token_id: int
    image_end_token_id: int
    audio_token_id: int = NO_ID
    audio_start_token_id: int = NO_ID
    audio_end_token_id: int = NO_ID

    @classmethod
    def from_tokenizer(
        cls, tokenizer: Tokenizer, layout: MediaLayout = MEDIA_LAYOUTS["qwen3_vl"]
    ) -> MediaTokens:
        """The ids of ``layout``'s tokens in ``tokenizer``; a ConfigError when it lacks one."""

        def token_id(token: str) -> int:
            if not token:
                return NO_ID
            found = tokenizer.backend.token_to_id(token)
            if found is None:
                raise ConfigError(
                    f"Tokenizer {tokenizer.path} has no '{token}' token, which --data.media_layout "
                    f"{layout.name} writes around media: use the {layout.name} model's tokenizer, "
                    "or builtin:stdlib_bpe_vl (which spells every layout with its own tokens)."
                )
            return found

        return cls(
            layout, token_id(layout.image_token), token_id(layout.image_start_token),
            token_id(layout.image_end_token), token_id(layout.audio_token),
            token_id(layout.audio_start_token), token_id(layout.audio_end_token),
        )  # fmt: skip

    @property
    def image_token(self) -> str:
        return self.layout.image_token

    @property
    def audio_token(self) -> str:
        return self.layout.audio_token

    def image_placeholder(self, num_tokens: int) -> str:
        """The text that stands for an image of ``num_tokens`` language-model tokens."""
        return self.layout.image_placeholder(num_tokens)

    def check_model_ids(self, image_token_id: int, image_start_token_id: int) -> None:
        """Refuse a model whose config expects other ids than this tokenizer gives."""
        if (image_token_id, image_start_token_id) != (
            self.image_token_id,
            self.image_start_token_id,
        ):
            raise ConfigError(
                f"The model expects image_token_id={image_token_id} and image start id "
                f"{image_start_token_id}, but the tokenizer gives {self.image_token_id} and "
                f"{self.image_start_token_id}: use the model's own tokenizer."
            )


@dataclass(frozen=True)
class ImageRef:
    path: Path
    where: str
    """``file:line`` of the sample, for errors."""
    grid: tuple[int, int, int]
    """(t, h, w) patches after resizing."""


@dataclass(frozen=True)
class AudioRef:
    path: Path
    where: str
    num_samples: int
    """Samples of the clip (before padding to whole tokens)."""


@dataclass(frozen=True)
class MultimodalSample:
    conversation: Conversation
    """Messages with string content, each image already rendered as its placeholder."""
    images: list[ImageRef]
    """In order of appearance, which is the order of their placeholders."""
    audios: list[AudioRef]
    """Likewise."""


def iter_samples(
    files: list[SourceFile], media: MediaTokens, processing: ImageProcessing,
    audio: AudioProcessing | None = None,
) -> Iterator[MultimodalSample]:  # fmt: skip
    """Every sample of the multimodal JSONL ``files``, checked line by line (images decoded,
    audio headers read)."""
    for file in files:
        for where, record in iter_jsonl_records(file.path, EXAMPLE):
            yield parse_sample(record, where, file.path.parent, media, processing, audio)


def parse_sample(
    record: Any, where: str, folder: Path, media: MediaTokens, processing: ImageProcessing,
    audio: AudioProcessing | None = None,
) -> MultimodalSample:  # fmt: skip
    """One JSONL record as a sample, or a ConfigError naming ``where`` and the fix."""
    messages = record.get(MESSAGES_FIELD) if isinstance(record, dict) else None
    if not isinstance(messages, list):
        parse_messages(record, where)  # raises, naming what is wrong
        raise AssertionError("unreachable")
    # The roles and the shape of each message are checked with parts standing in as text.
    parse_messages({MESSAGES_FIELD: [_without_parts(m) for m in messages]}, where)
    images: list[ImageRef] = []
    audios: list[AudioRef] = []
    rendered: list[Message] = []
    for index, message in enumerate(messages):
        content = message["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        text = ""
        for number, part in enumerate(parts):
            at = f"{where}: message {index} ({message['role']}) part {number}"
            kind = _part_type(part, at)
            if kind == "text":
                text += _text(part, at, media)
            elif message["role"] == "assistant":
                raise ConfigError(f"{at}: an assistant message cannot hold an {kind} part.")
            elif kind == "image":
                image = _image(part, at, where, folder, processing)
                images.append(image)
                text += media.image_placeholder(_num_tokens(image.grid, processing))
            else:
                if not media.layout.has_audio or audio is None:
                    raise ConfigError(
                        f"{at} is audio, but --data.media_layout {media.layout.name} has no "
                        "audio encoder (muse_spark has one). Remove the part."
                    )
                path = folder / Path(_path(part, at, kind)).expanduser()
                clip = AudioRef(path, where, wav_info(path, where, audio))
                audios.append(clip)
                text += media.layout.audio_placeholder(clip.num_samples)
        rendered.append({**message, "content": text})
    return MultimodalSample(Conversation(where, rendered), images, audios)


def parse_prompt(
    messages: list[Any], where: str, folder: Path, media: MediaTokens, processing: ImageProcessing
) -> MultimodalSample:
    """A generation prompt's messages (parts as in a sample, images relative to ``folder``),
    rendered as ``parse_sample`` renders a sample's; no assistant reply is needed."""
    # parse_sample checks a training sample, which needs an assistant message: an empty one
    # stands in and is dropped.
    reply = {"role": "assistant", "content": ""}
    sample = parse_sample({MESSAGES_FIELD: [*messages, reply]}, where, folder, media, processing)
    return MultimodalSample(
        Conversation(where, sample.conversation.messages[:-1]), sample.images, sample.audios
    )


def _num_tokens(grid: tuple[int, int, int], processing: ImageProcessing) -> int:
    t, h, w = grid
    return t * h * w // processing.merge_size**2


def _without_parts(message: Any) -> Any:
    if isinstance(message, dict) and isinstance(message.get("content"), list):
        return {**message, "content": ""}
    return message


def _part_type(part: Any, at: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in PART_TYPES:
        raise ConfigError(
            f"{at} must be an object with 'type' one of {', '.join(PART_TYPES)}; got "
            f"{str(part)[:60]}.{did_you_mean(str(kind), PART_TYPES)} A line looks like {EXAMPLE}."
        )
    return kind


def _text(part: dict[str, Any], at: str, media: MediaTokens) -> str:
    text = part.get("text")
    if not isinstance(text, str):
        raise ConfigError(f"{at}: a text part needs a string 'text'; got {str(part)[:60]}.")
    for token in media.layout.special_tokens():
        if token in text:
            raise ConfigError(
                f"{at}: the text holds '{token}', which only a media part may produce; use "
                '{"type": "image", "path": ...} (or "audio") or remove it.'
            )
    return text


def _image(
    part: dict[str, Any], at: str, where: str, folder: Path, processing: ImageProcessing
) -> ImageRef:
    path = folder / Path(_path(part, at, "image")).expanduser()
    image = load_image(path, where, processing)
    return ImageRef(path, where, image_grid(image.width, image.height, processing))


def _path(part: dict[str, Any], at: str, kind: str) -> str:
    path_text = part.get("path")
    if "path" in part and not (isinstance(path_text, str) and path_text):
        raise ConfigError(
            f"{at}: an {kind} part's 'path' must be a non-empty string, the file's path relative "
            f"to the JSONL file; got {path_text!r}."
        )
    if path_text is None:
        keys = [str(k) for k in part if k != "type"]
        raise ConfigError(
            f"{at}: an {kind} part needs a 'path' (relative to the JSONL file); found "
            f"{keys}.{rename_hint('path', keys)}"
        )
    return path_text
