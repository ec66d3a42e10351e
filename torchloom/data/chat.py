"""Chat templates: render conversations to text the way Hugging Face templates expect, and
find the characters each assistant turn contributes (the text SFT trains on).

Templates are Jinja programs shipped with model folders, so they are untrusted code: they run in
jinja2's immutable sandbox, with the variables and helpers ``transformers`` gives them.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from torchloom.config.errors import ConfigError

Message = dict[str, Any]
"""One chat message: at least ``role`` and ``content``."""

DEFAULT_TEMPLATE_NAME = "default"
CHATML_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)
"""The builtin tokenizer's template: ChatML, each turn ``<|im_start|>role\\ncontent<|im_end|>\\n``."""


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}``: transformers uses it to mark assistant text.
    We locate assistant text by rendering prefixes instead, so the block renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes; templates expect plain json.dumps, as transformers gives.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    # trim_blocks/lstrip_blocks and loopcontrols are what every HF template is written for.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=32)
def compile_chat_template(source: str, origin: str = "") -> jinja2.Template:
    """The compiled template (cached: SFT renders the same template thousands of times);
    ``origin`` names where it comes from in the error for a syntax error."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        named = f" ({origin})" if origin else ""
        raise ConfigError(
            f"The chat template{named} has a syntax error on line {e.lineno}: {e}"
        ) from None


def render_chat(
    source: str,
    messages: Sequence[Message],
    add_generation_prompt: bool = False,
    origin: str = "",
    **variables: Any,
) -> str:
    """``messages`` rendered by the template ``source``; ``variables`` are e.g. ``bos_token``.

    A template's own ``raise_exception`` (say, roles that do not alternate) or any other error
    raised while it runs (an overflowing ``range``, endless recursion, a type error) becomes a
    ConfigError quoting it; ``origin`` names where the template comes from.
    """
    template = compile_chat_template(source, origin)
    try:
        return template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            tools=None,  # templates test `tools is not none`; undefined would read as set
            documents=None,
            **variables,
        )
    except jinja2.TemplateError as e:
        error = str(e).rstrip(".")
    except Exception as e:  # the template is a program: it can raise anything while it runs
        error = f"{type(e).__name__}: {str(e).rstrip('.')}"
    named = f" ({origin})" if origin else ""
    raise ConfigError(
        f"The chat template{named} failed on this conversation: {error}. Fix the template "
        "(--data.chat_template FILE.jinja) or the conversation."
    ) from None


def read_template_file(path: Path) -> str:
    """The chat template in ``path``, or a ConfigError when the file is not UTF-8 text."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); save "
            "the chat template as UTF-8."
        ) from None


def read_chat_templates(folder: Path, tokenizer_config: dict[str, Any]) -> dict[str, str]:
    """The named chat templates of a Hugging Face tokenizer folder, ``default`` first if any.

    Looks where transformers does: ``chat_template`` in tokenizer_config.json (a string, or a
    list of ``{"name", "template"}``), then ``chat_template.jinja`` and ``chat_templates/*.jinja``
    (transformers 5 writes these), which win over the config.
    """
    templates: dict[str, str] = {}
    value = tokenizer_config.get("chat_template")
    if isinstance(value, str):
        templates[DEFAULT_TEMPLATE_NAME] = value
    elif isinstance(value, list):
        for entry in value:
            if not (isinstance(entry, dict) and {"name", "template"} <= entry.keys()):
                raise ConfigError(
                    f"{folder / 'tokenizer_config.json'}: each entry of the chat_template list "
                    f'must be {{"name": ..., "template": ...}}; got {str(entry)[:80]}.'
                )
            templates[str(entry["name"])] = str(entry["template"])
    elif value is not None:
        raise ConfigError(
            f"{folder / 'tokenizer_config.json'}: chat_template is a {type(value).__name__}; "
            "expected a string or a list of named templates."
        )
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        templates[DEFAULT_TEMPLATE_NAME] = read_template_file(jinja_file)
    named_dir = folder / "chat_templates"
    if named_dir.is_dir():
        for path in sorted(named_dir.glob("*.jinja")):
            templates[path.stem] = read_template_file(path)
    return templates


def assistant_spans(
    render: Callable[[Sequence[Message], bool], str], messages: Sequence[Message]
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span ``[start, end)`` of each assistant turn.

    Works for any template without knowing its markers: the span of assistant turn i starts
    where ``render(messages[:i], add_generation_prompt=True)`` ends and stops where
    ``render(messages[:i + 1])`` ends. So it covers the reply and whatever the template closes
    the turn with (``<|im_end|>\\n``, ``<|eot_id|>``), and never the prompt's header. This holds
    only if each rendering is a prefix of the next; a template that renders a turn differently
    once more messages follow (e.g. dropping reasoning from earlier turns) is refused.
    """
    text = render(messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt = render(messages[:i], True)
        through = render(messages[: i + 1], False)
        for shorter, longer, what in (
            (prompt, through, "the prompt before it (with add_generation_prompt=True)"),
            (through, text, "the whole conversation"),
        ):
            if not longer.startswith(shorter):
                raise ConfigError(
                    f"The chat template renders assistant message {i} inconsistently: the text "
                    f"up to it is not a prefix of {what}; {_first_difference(shorter, longer)}. "
                    "SFT finds assistant tokens by rendering growing prefixes of a conversation, "
                    "so every turn must render the same whatever follows it. Use a template "
                    "without such position-dependent output (--data.chat_template FILE.jinja)."
                )
        spans.append((len(prompt), len(through)))
    return text, spans


def _first_difference(shorter: str, longer: str) -> str:
    same = min(len(shorter), len(longer))
    at = next((i for i, (a, b) in enumerate(zip(shorter, longer)) if a != b), same)
    return f"they differ at character {at}: {shorter[at : at + 30]!r} vs {longer[at : at + 30]!r}"
