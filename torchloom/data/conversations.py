"""Chat JSONL -> checked conversations -> token ids with the assistant tokens marked."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchloom.config.errors import ConfigError, did_you_mean
from torchloom.data.chat import Message, assistant_spans
from torchloom.data.sources import MESSAGES_FIELD, SourceFile, iter_jsonl_records
from torchloom.data.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant")
_EXAMPLE = (
    f'{{"{MESSAGES_FIELD}": [{{"role": "user", "content": "Hi"}}, '
    '{"role": "assistant", "content": "Hello!"}]}'
)


@dataclass(frozen=True)
class Conversation:
    where: str
    """``file:line`` it came from, for error messages."""
    messages: list[Message]


def iter_conversations(files: list[SourceFile]) -> Iterator[Conversation]:
    """Every conversation of the chat JSONL ``files``, in order, checked line by line."""
    for file in files:
        for where, record in iter_jsonl_records(file.path, _EXAMPLE):
            yield Conversation(where, parse_messages(record, where))


def parse_messages(record: Any, where: str) -> list[Message]:
    """The messages of one chat JSONL record, or a ConfigError naming ``where`` and the fix."""
    if not isinstance(record, dict) or MESSAGES_FIELD not in record:
        keys = list(record) if isinstance(record, dict) else []
        raise ConfigError(
            f"{where}: no field '{MESSAGES_FIELD}' (found {keys or type(record).__name__})."
            f"{did_you_mean(MESSAGES_FIELD, keys)} A chat line looks like {_EXAMPLE}."
        )
    messages = record[MESSAGES_FIELD]
    if not isinstance(messages, list) or not messages:
        raise ConfigError(
            f"{where}: '{MESSAGES_FIELD}' must be a non-empty list of "
            f"{{role, content}} objects; got {str(messages)[:60]}."
        )
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ConfigError(
                f"{where}: message {index} must be an object with 'role' and 'content'; "
                f"got {str(message)[:60]}."
            )
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise ConfigError(
                f"{where}: message {index} has role {role!r}; roles are "
                f"{', '.join(ROLES)}.{did_you_mean(str(role), ROLES)}"
            )
        if not isinstance(content, str):
            raise ConfigError(
                f"{where}: message {index} ({role}) has content of type "
                f"{type(content).__name__}; content must be a string."
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(
            f"{where}: the conversation has no assistant message, so SFT has nothing to learn "
            "from it. Remove the line or add the assistant's reply."
        )
    return messages


def render_with_spans(
    tokenizer: Tokenizer, conversation: Conversation
) -> tuple[str, list[tuple[int, int]]]:
    """The conversation as chat-template text and the character spans of its assistant turns."""

    def render(messages: list[Message], add_generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages, add_generation_prompt)

    try:
        return assistant_spans(render, conversation.messages)
    except ConfigError as e:
        raise ConfigError(f"{conversation.where}: {e}") from None


def tokenize_conversations(
    tokenizer: Tokenizer, conversations: list[Conversation]
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per conversation: token ids of its rendering and which of them are assistant tokens.

    A token is an assistant token when its characters overlap an assistant span (the same rule
    as transformers' assistant masks), so a token straddling a span's edge is trained on.
    """
    rendered = [render_with_spans(tokenizer, c) for c in conversations]
    encodings = tokenizer.encode_chat_batch([text for text, _ in rendered])
    result = []
    for (_, spans), (ids, offsets) in zip(rendered, encodings):
        offsets_N2 = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
        is_assistant_N = np.zeros(len(ids), dtype=bool)
        for start, end in spans:
            is_assistant_N |= (offsets_N2[:, 1] > start) & (offsets_N2[:, 0] < end)
        result.append((np.asarray(ids, dtype=np.int64), is_assistant_N))
    return result
