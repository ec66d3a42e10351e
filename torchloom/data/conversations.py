"""Chat JSONL -> checked conversations -> token ids with the assistant tokens marked."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchloom.config.errors import ConfigError, did_you_mean, near_matches
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
    if isinstance(record, list):
        raise ConfigError(
            f"{where}: the line is a JSON array, not an object; a .jsonl file holds one JSON "
            f"object per line (not one array of them), each like {_EXAMPLE}."
        )
    if not isinstance(record, dict) or MESSAGES_FIELD not in record:
        keys = [str(key) for key in record] if isinstance(record, dict) else []
        raise ConfigError(
            f"{where}: no field '{MESSAGES_FIELD}' (found {keys or type(record).__name__})."
            f"{rename_hint(MESSAGES_FIELD, keys)} A chat line looks like {_EXAMPLE}."
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


def rename_hint(field: str, keys: list[str]) -> str:
    """' Rename 'msgs' to 'messages'.' when one of ``keys`` looks like the missing ``field``."""
    hits = near_matches(field, keys, n=1)
    return f" Rename '{hits[0]}' to '{field}'." if hits else ""


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


def check_template_marks_replies(tokenizer: Tokenizer, conversations: list[Conversation]) -> None:
    """Refuse, before a whole data set is tokenized, a chat template that renders no text of the
    assistant's messages (a constant, or one that drops them): SFT would find nothing to train
    on. Tried on the first of ``conversations`` with a non-empty reply, else the first."""
    if not conversations:
        return
    probe = next(
        (c for c in conversations
         if any(m["role"] == "assistant" and m["content"] for m in c.messages)),
        conversations[0],
    )  # fmt: skip
    ((_, is_assistant_N),) = tokenize_conversations(tokenizer, [probe])
    if is_assistant_N[1:].any():  # token 0 is never a label
        return
    text = tokenizer.apply_chat_template(probe.messages)
    origin = tokenizer.chat_template_origin
    rendering = f"as {text[:60]!r}, without its assistant messages" if text else "as nothing"
    raise ConfigError(
        f"{probe.where}: the chat template{f' ({origin})' if origin else ''} renders this "
        f"conversation {rendering}, so there is nothing to train on: give a template that "
        "renders every message with --data.chat_template FILE.jinja."
    )
