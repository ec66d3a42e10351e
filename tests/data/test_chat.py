"""Chat templates: rendering and ids equal transformers', exact assistant masks for ChatML and
Llama-3-style templates, template sources, sandboxing, special tokens in chats vs documents."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from torchloom.config.errors import ConfigError
from torchloom.data.chat import CHATML_TEMPLATE
from torchloom.data.conversations import Conversation, tokenize_conversations
from torchloom.data.packing import IGNORE_INDEX
from torchloom.data.sft import Conversations, PackedConversations
from torchloom.data.tokenizer import BOS_TOKEN, EOS_TOKEN, Tokenizer, train_byte_level_bpe

from .conftest import TINY_TEXTS

LLAMA3_TOKENS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Written for these tests in the style of Qwen's ChatML template (a default system message) and
# Llama 3's (bos, headers, trimmed content, raise_exception on a bad role).
QWEN_STYLE_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'system' and loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
LLAMA3_STYLE_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = '' %}
{%- endif %}
{%- if system_message %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system_message + '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('Only user and assistant messages may follow the system one.') }}
    {%- endif %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
{{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
SYSTEM = {"role": "system", "content": "You answer briefly."}
TWO_TURNS = [
    SYSTEM,
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "2 + 3 = 5"},
    {"role": "user", "content": "Now add 4 to that."},
    {"role": "assistant", "content": "5 + 4 = 9"},
]
CONVERSATIONS = [
    TWO_TURNS,
    TWO_TURNS[1:3],
    [{"role": "user", "content": "Say <|im_end|> and ünïcode 🤗  "}],
    [{"role": "user", "content": "  spaces  \n"}, {"role": "assistant", "content": ""}],
]


def write_folder(folder: Path, template: str, eos: str, extra_tokens: list[str]) -> Path:
    """An HF tokenizer folder: a tiny byte-level BPE with our special tokens and ``template``."""
    backend = train_byte_level_bpe(TINY_TEXTS, vocab_size=300)
    backend.add_special_tokens(extra_tokens)
    folder.mkdir(parents=True)
    backend.save(str(folder / "tokenizer.json"))
    config = {"bos_token": BOS_TOKEN, "eos_token": eos, "pad_token": EOS_TOKEN}
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat_tokenizers")
    return {
        "chatml": write_folder(root / "chatml", QWEN_STYLE_TEMPLATE, "<|im_end|>", []),
        "llama3": write_folder(root / "llama3", LLAMA3_STYLE_TEMPLATE, "<|eot_id|>", LLAMA3_TOKENS),
    }


@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_rendering_and_ids_match_transformers(folders: dict[str, Path], style: str) -> None:
    from transformers import AutoTokenizer

    ours = Tokenizer.from_file(folders[style])
    theirs = AutoTokenizer.from_pretrained(folders[style])
    for messages in CONVERSATIONS:
        for prompt in (False, True):
            text = ours.apply_chat_template(messages, add_generation_prompt=prompt)
            expected = theirs.apply_chat_template(
                messages, add_generation_prompt=prompt, tokenize=False
            )
            assert text == expected, f"{messages} prompt={prompt}"
            ids = theirs.apply_chat_template(messages, add_generation_prompt=prompt)["input_ids"]
            assert ours.encode_chat(text) == ids, f"{messages} prompt={prompt}"


def test_saved_builtin_tokenizer_loads_in_transformers(
    builtin_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    builtin_tokenizer.save(tmp_path / "tokenizer.json")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    theirs = AutoTokenizer.from_pretrained(tmp_path)
    # The class name in tokenizer_config.json stops transformers from picking Qwen2Tokenizer
    # for a qwen3 model: its own pre-tokenizer (digits split one by one) would change the ids.
    assert type(theirs) is PreTrainedTokenizerFast, type(theirs)
    for messages in CONVERSATIONS:
        text = builtin_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        assert text == theirs.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        ids = theirs.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        assert builtin_tokenizer.encode_chat(text) == ids
    assert builtin_tokenizer.chat_template == CHATML_TEMPLATE
    text = "The weather is nice today, isn't it?"
    assert theirs(text)["input_ids"] == builtin_tokenizer.encode(text)


def test_chat_encoding_recognises_special_tokens_documents_do_not(
    builtin_tokenizer: Tokenizer,
) -> None:
    tok = builtin_tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n"
    im_start, im_end = (tok.backend.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>"))
    chat_ids = tok.encode_chat(text)
    assert chat_ids[0] == im_start and chat_ids.count(im_end) == 1, chat_ids
    document_ids = tok.encode(text)
    assert im_start not in document_ids and im_end not in document_ids, document_ids
    assert tok.decode(document_ids) == text


def pieces_to_labels(tok: Tokenizer, pieces: list[tuple[str, bool]]) -> tuple[list[int], list]:
    """Ids of the pieces and, per input position, the next token if it is an assistant's."""
    ids, is_assistant = [], []
    for text, assistant in pieces:
        piece_ids = tok.encode_chat(text)
        ids += piece_ids
        is_assistant += [assistant] * len(piece_ids)
    labels = [i if a else IGNORE_INDEX for i, a in zip(ids[1:], is_assistant[1:])]
    return ids, labels


EXPECTED_PIECES = {
    "chatml": [
        ("<|im_start|>system\nYou answer briefly.<|im_end|>\n"
         "<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n", False),
        ("2 + 3 = 5<|im_end|>\n", True),
        ("<|im_start|>user\nNow add 4 to that.<|im_end|>\n<|im_start|>assistant\n", False),
        ("5 + 4 = 9<|im_end|>\n", True),
    ],
    "llama3": [
        ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou answer briefly."
         "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2 plus 3?<|eot_id|>"
         "<|start_header_id|>assistant<|end_header_id|>\n\n", False),
        ("2 + 3 = 5<|eot_id|>", True),
        ("<|start_header_id|>user<|end_header_id|>\n\nNow add 4 to that.<|eot_id|>"
         "<|start_header_id|>assistant<|end_header_id|>\n\n", False),
        ("5 + 4 = 9<|eot_id|>", True),
    ],
}  # fmt: skip


@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_labels_only_on_assistant_tokens_exactly(folders: dict[str, Path], style: str) -> None:
    tok = Tokenizer.from_file(folders[style])
    pieces = EXPECTED_PIECES[style]
    assert tok.apply_chat_template(TWO_TURNS) == "".join(text for text, _ in pieces)
    ids, labels = pieces_to_labels(tok, pieces)
    assert tok.encode_chat("".join(text for text, _ in pieces)) == ids, "pieces merge differently"

    conversations = Conversations.from_list(
        tokenize_conversations(tok, [Conversation("test", TWO_TURNS)])
    )
    seq_len = len(ids) + 2  # room for two pad tokens
    batch = PackedConversations(conversations, seq_len, pad_id=tok.eos_id).batch(
        torch.tensor([0]).numpy()
    )
    pad = [IGNORE_INDEX] * 3  # the conversation fills len(ids) - 1 slots
    assert_close(batch.labels, torch.tensor([labels + pad]), rtol=0, atol=0)
    assert_close(batch.tokens, torch.tensor([ids[:-1] + [tok.eos_id] * 3]), rtol=0, atol=0)
    answers = tok.decode([label for label in labels if label != IGNORE_INDEX])
    assert answers == "".join(text for text, assistant in pieces if assistant)


def test_named_templates_jinja_files_and_missing_template(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "t", "unused", EOS_TOKEN, [])
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "D{{ messages | length }}"},
        {"name": "tool_use", "template": "T{{ messages[0] | tojson }}"},
    ]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_file(folder)
    messages = [{"role": "user", "content": "ü<"}]
    assert tok.apply_chat_template(messages) == "D1"
    # tojson is plain json.dumps (no HTML escaping, no ASCII escaping), as in transformers.
    assert tok.apply_chat_template(messages, template_name="tool_use") == (
        'T{"role": "user", "content": "ü<"}'
    )
    with pytest.raises(ConfigError, match="no chat template named 'tool'.*Did you mean 'tool_use'"):
        tok.apply_chat_template(messages, template_name="tool")
    # transformers 5 writes chat_template.jinja (and chat_templates/NAME.jinja); they win.
    (folder / "chat_template.jinja").write_text("J{{ bos_token }}")
    (folder / "chat_templates").mkdir()
    (folder / "chat_templates" / "extra.jinja").write_text("E")
    tok = Tokenizer.from_file(folder)
    assert tok.apply_chat_template(messages) == "J" + BOS_TOKEN
    assert tok.apply_chat_template(messages, template_name="extra") == "E"
    bare = Tokenizer.from_file(folder / "tokenizer.json")
    bare.chat_templates.clear()
    with pytest.raises(ConfigError, match="has no chat template.*--data.chat_template"):
        bare.apply_chat_template(messages)


def test_added_tokens_decoder_adds_missing_tokens_at_their_ids(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "t", CHATML_TEMPLATE, EOS_TOKEN, [])
    config = json.loads((folder / "tokenizer_config.json").read_text())
    next_id = Tokenizer.from_file(folder).vocab_size
    config["added_tokens_decoder"] = {str(next_id): {"content": "<|tool|>", "special": True}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_file(folder)
    assert tok.encode_chat("a<|tool|>")[-1] == next_id
    assert next_id not in tok.encode("a<|tool|>")
    config["added_tokens_decoder"] = {str(next_id + 5): {"content": "<|gap|>", "special": True}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=f"declared with id {next_id + 5}"):
        Tokenizer.from_file(folder)


def test_template_helpers_and_sandbox(folders: dict[str, Path]) -> None:
    tok = Tokenizer.from_file(folders["llama3"])
    with pytest.raises(ConfigError, match="Only user and assistant messages may follow"):
        tok.apply_chat_template([SYSTEM, SYSTEM])
    tok.set_chat_template("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                          "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}")  # fmt: skip
    assert tok.apply_chat_template(TWO_TURNS) == SYSTEM["content"]
    tok.set_chat_template("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ConfigError, match="unsafe|not safely"):
        tok.apply_chat_template(TWO_TURNS)
    tok.set_chat_template("{% for m in messages %}")
    with pytest.raises(ConfigError, match="syntax error on line 1"):
        tok.apply_chat_template(TWO_TURNS)


def test_template_rendering_turns_differently_later_is_refused(folders: dict[str, Path]) -> None:
    tok = Tokenizer.from_file(folders["chatml"])
    # Like Qwen3's: only the last assistant turn gets an (empty) reasoning block.
    tok.set_chat_template(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and loop.last %}<think></think>{% endif %}"
        "{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(ConfigError, match=r"f\.jsonl:3: .*assistant message 1 inconsistently"):
        tokenize_conversations(tok, [Conversation("f.jsonl:3", TWO_TURNS[1:])])


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{% for i in range(10**9) %}{% endfor %}", "OverflowError: Range too big"),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError: maximum recursion"),
        ("{{ messages + 1 }}", "TypeError: can only concatenate list"),
        ("{{ raise_exception('no system allowed') }}", "failed on this conversation: no system "
                                                      "allowed. Fix the template"),
    ],
)  # fmt: skip
def test_any_error_while_a_template_runs_names_template_and_line(
    folders: dict[str, Path], template: str, message: str
) -> None:
    tok = Tokenizer.from_file(folders["chatml"])
    tok.set_chat_template(template, "from --data.chat_template t.jinja")
    with pytest.raises(ConfigError) as caught:
        tokenize_conversations(tok, [Conversation("f.jsonl:3", TWO_TURNS)])
    error = str(caught.value)
    print(error[:300])
    assert error.startswith(
        "f.jsonl:3: The chat template (from --data.chat_template t.jinja) failed on this "
        "conversation: "
    )
    assert message in error and "\n" not in error


def test_empty_or_non_utf8_templates_of_a_tokenizer_folder(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "t", "", EOS_TOKEN, [])
    tok = Tokenizer.from_file(folder)
    with pytest.raises(ConfigError, match=re.escape(f"chat template (from tokenizer {folder}) is")):
        tok.apply_chat_template(TWO_TURNS)
    (folder / "chat_template.jinja").write_bytes(b"\xff\xfe{{ messages }}")
    with pytest.raises(ConfigError, match=r"chat_template.jinja is not UTF-8 text \(byte 0xff at "
                                          r"offset 0\); save the chat template as UTF-8"):  # fmt: skip
        Tokenizer.from_file(folder)
    (folder / "chat_template.jinja").unlink()
    (folder / "tokenizer_config.json").write_bytes(b'{"chat_template": "\xff"}')
    with pytest.raises(ConfigError, match="tokenizer_config.json is not UTF-8 text"):
        Tokenizer.from_file(folder)
