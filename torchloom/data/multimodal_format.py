"""The multimodal chat JSONL format: one sample per line, message content a string or a list of
parts, images by path relative to the JSONL file.

    {"messages": [{"role": "user", "content": [{"type": "text", "text": "What colour?"},
                                               {"type": "image", "path": "img/0.png"}]},
                  {"role": "assistant", "content": "Red."}]}

Each image part is rendered into its message's text as the Qwen-VL placeholder:
``<|vision_start|>`` + one ``<|image_pad|>`` per language-model token of the image +
``<|vision_end|>`` (the text Qwen-VL's chat template and processor produce together), so any chat
template renders the sample and SFT's assistant-only masking applies unchanged. An
``{"type": "audio", "path": ...}`` part is reserved for models with an audio encoder; none has
one yet, so it is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchloom.config.errors import ConfigError, did_you_mean
from torchloom.data.chat import Message
from torchloom.data.conversations import Conversation, parse_messages
from torchloom.data.images import ImageProcessing, image_grid, load_image
from torchloom.data.sources import MESSAGES_FIELD, SourceFile, iter_jsonl_records
from torchloom.data.tokenizer import IMAGE_TOKEN, VISION_END_TOKEN, VISION_START_TOKEN, Tokenizer

PART_TYPES = ("text", "image", "audio")
EXAMPLE = (
    f'{{"{MESSAGES_FIELD}": [{{"role": "user", "content": [{{"type": "text", "text": "What is '
    'this?"}, {"type": "image", "path": "img/0.png"}]}, {"role": "assistant", "content": '
    '"A cat."}]}'
)


@dataclass(frozen=True)
class MediaTokens:
    """The special tokens that frame and stand for an image in the token stream, and their ids
    in the tokenizer (a model's config names the same ids: image_token_id, ...)."""

    image_token: str
    image_token_id: int
    vision_start_token: str
    vision_start_token_id: int
    vision_end_token: str
    vision_end_token_id: int

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: Tokenizer,
        image_token: str = IMAGE_TOKEN,
        vision_start_token: str = VISION_START_TOKEN,
        vision_end_token: str = VISION_END_TOKEN,
    ) -> MediaTokens:
        """The tokens' ids in ``tokenizer``; a ConfigError when it lacks one."""
        ids = {}
        for token in (image_token, vision_start_token, vision_end_token):
            token_id = tokenizer.backend.token_to_id(token)
            if token_id is None:
                raise ConfigError(
                    f"Tokenizer {tokenizer.path} has no '{token}' token, which multimodal data "
                    "needs around each image: use a vision-language model's tokenizer, or "
                    "builtin:stdlib_bpe_vl."
                )
            ids[token] = token_id
        return cls(image_token, ids[image_token], vision_start_token, ids[vision_start_token],
                   vision_end_token, ids[vision_end_token])  # fmt: skip

    def image_placeholder(self, num_tokens: int) -> str:
        """The text that stands for an image of ``num_tokens`` language-model tokens."""
        return self.vision_start_token + self.image_token * num_tokens + self.vision_end_token

    def check_model_ids(self, image_token_id: int, vision_start_token_id: int) -> None:
        """Refuse a model whose config expects other ids than this tokenizer gives."""
        if (image_token_id, vision_start_token_id) != (
            self.image_token_id,
            self.vision_start_token_id,
        ):
            raise ConfigError(
                f"The model expects image_token_id={image_token_id} and vision_start_token_id="
                f"{vision_start_token_id}, but the tokenizer gives {self.image_token_id} and "
                f"{self.vision_start_token_id}: use the model's own tokenizer."
            )


@dataclass(frozen=True)
class ImageRef:
    path: Path
    where: str
    """``file:line`` of the sample, for errors."""
    grid: tuple[int, int, int]
    """(t, h, w) patches after resizing."""


@dataclass(frozen=True)
class MultimodalSample:
    conversation: Conversation
    """Messages with string content, each image already rendered as its placeholder."""
    images: list[ImageRef]
    """In order of appearance, which is the order of their placeholders."""


def iter_samples(
    files: list[SourceFile], media: MediaTokens, processing: ImageProcessing
) -> Iterator[MultimodalSample]:
    """Every sample of the multimodal JSONL ``files``, checked line by line (images decoded)."""
    for file in files:
        for where, record in iter_jsonl_records(file.path, EXAMPLE):
            yield parse_sample(record, where, file.path.parent, media, processing)


def parse_sample(
    record: Any, where: str, folder: Path, media: MediaTokens, processing: ImageProcessing
) -> MultimodalSample:
    """One JSONL record as a sample, or a ConfigError naming ``where`` and the fix."""
    messages = record.get(MESSAGES_FIELD) if isinstance(record, dict) else None
    if not isinstance(messages, list):
        parse_messages(record, where)  # raises, naming what is wrong
        raise AssertionError("unreachable")
    # The roles and the shape of each message are checked with parts standing in as text.
    parse_messages({MESSAGES_FIELD: [_without_parts(m) for m in messages]}, where)
    images: list[ImageRef] = []
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
            elif kind == "image":
                if message["role"] == "assistant":
                    raise ConfigError(f"{at}: an assistant message cannot hold an image.")
                image = _image(part, at, where, folder, processing)
                images.append(image)
                text += media.image_placeholder(_num_tokens(image.grid, processing))
            else:
                raise ConfigError(
                    f"{at} is audio: audio parts are reserved for models with an audio encoder, "
                    "and none has one yet. Remove the part."
                )
        rendered.append({**message, "content": text})
    return MultimodalSample(Conversation(where, rendered), images)


def parse_prompt(
    messages: list[Any], where: str, folder: Path, media: MediaTokens, processing: ImageProcessing
) -> MultimodalSample:
    """A generation prompt's messages (parts as in a sample, images relative to ``folder``),
    rendered as ``parse_sample`` renders a sample's; no assistant reply is needed."""
    # parse_sample checks a training sample, which needs an assistant message: an empty one
    # stands in and is dropped.
    reply = {"role": "assistant", "content": ""}
    sample = parse_sample({MESSAGES_FIELD: [*messages, reply]}, where, folder, media, processing)
    return MultimodalSample(Conversation(where, sample.conversation.messages[:-1]), sample.images)


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
    for token in (media.image_token, media.vision_start_token, media.vision_end_token):
        if token in text:
            raise ConfigError(
                f"{at}: the text holds '{token}', which only an image part may produce; use "
                '{"type": "image", "path": ...} or remove it.'
            )
    return text


def _image(
    part: dict[str, Any], at: str, where: str, folder: Path, processing: ImageProcessing
) -> ImageRef:
    path_text = part.get("path")
    if not isinstance(path_text, str) or not path_text:
        keys = [k for k in part if k != "type"]
        raise ConfigError(
            f"{at}: an image part needs a 'path' (relative to the JSONL file); found "
            f"{keys}.{did_you_mean('path', keys)}"
        )
    path = folder / Path(path_text).expanduser()
    image = load_image(path, where, processing)
    return ImageRef(path, where, image_grid(image.width, image.height, processing))
