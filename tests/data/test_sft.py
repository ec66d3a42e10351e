"""SFT data: chat JSONL checks, packing that keeps conversations whole, over-long handling, the
loader's resume and layout guarantees over packed rows, the builtin chat set, the whole path."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from torchloom.config.errors import ConfigError
from torchloom.data import DataConfig, build_dataloaders
from torchloom.data.chat_tasks import builtin_chat_path, ensure_builtin_chat, generate_chat_tasks
from torchloom.data.conversations import iter_conversations, parse_messages
from torchloom.data.loader import TrainLoader, ValLoader
from torchloom.data.packing import IGNORE_INDEX
from torchloom.data.sft import Conversations, PackedConversations, pack_best_fit
from torchloom.data.sources import resolve_chat_sources

PAD = 0
T = 16


def synthetic_conversations(lengths: list[int], seed: int = 0) -> Conversations:
    """Conversation i has tokens 1000*(i+1) + 0, 1, ...; about half of them are assistant's."""
    rng = np.random.default_rng(seed)
    items = []
    for i, n in enumerate(lengths):
        is_assistant = rng.random(n) < 0.5
        is_assistant[-1] = True  # every conversation has something to learn
        items.append((1000 * (i + 1) + np.arange(n), is_assistant))
    return Conversations.from_list(items)


LENGTHS = [5, 17, 3, 9, 12, 2, 8, 16, 7, 4, 11, 6, 10, 13, 3, 15, 5, 9, 20, 6]


def test_packing_keeps_every_conversation_whole() -> None:
    conversations = synthetic_conversations(LENGTHS)
    rows = PackedConversations(conversations, T, PAD)
    assert (rows.num_dropped, rows.num_truncated) == (1, 0)  # the 20-token one
    batch = rows.batch(np.arange(rows.num_rows))
    seen = []
    for r in range(rows.num_rows):
        tokens, labels = batch.tokens[r], batch.labels[r]
        positions, doc_ids = batch.positions[r], batch.doc_ids[r]
        expected_docs = rows.conversations_of(r).tolist()
        column = 0
        for doc, index in enumerate(expected_docs):
            start, n = conversations.offsets[index], LENGTHS[index]
            ids = conversations.tokens[start : start + n]
            mask = conversations.is_assistant[start + 1 : start + n]
            span = slice(column, column + n - 1)
            assert tokens[span].tolist() == ids[:-1].tolist(), f"row {r} doc {doc}"
            expected = np.where(mask, ids[1:], IGNORE_INDEX).tolist()
            assert labels[span].tolist() == expected, f"row {r} doc {doc}"
            assert positions[span].tolist() == list(range(n - 1))
            assert (doc_ids[span] == doc).all()
            column += n - 1
        # The rest is padding: its own doc id, positions from 0, nothing to predict.
        assert (tokens[column:] == PAD).all() and (labels[column:] == IGNORE_INDEX).all()
        assert (doc_ids[column:] == len(expected_docs)).all()
        assert positions[column:].tolist() == list(range(T - column))
        seen += expected_docs
    assert sorted(seen) == [i for i, n in enumerate(LENGTHS) if n - 1 <= T]
    filled = sum(n - 1 for n in LENGTHS if n - 1 <= T) / (rows.num_rows * T)
    print(f"{rows.num_rows} rows, {filled:.0%} filled")
    assert rows.num_rows == -(-sum(n - 1 for n in LENGTHS if n - 1 <= T) // T)  # optimal here


def test_best_fit_decreasing_is_deterministic_and_within_capacity() -> None:
    sizes = np.random.default_rng(1).integers(1, 50, size=300)
    bins = pack_best_fit(sizes, 64)
    assert sorted(i for b in bins for i in b) == list(range(300))
    assert max(sum(sizes[b]) for b in bins) <= 64
    assert bins == pack_best_fit(sizes.copy(), 64)
    waste = 1 - sizes.sum() / (64 * len(bins))
    print(f"{len(bins)} bins, {waste:.1%} padding")
    assert waste < 0.05


def test_overlong_conversations_dropped_or_truncated(caplog: pytest.LogCaptureFixture) -> None:
    conversations = synthetic_conversations([5, 30, 40])
    conversations.is_assistant[5 : 5 + 30] = False  # the 30-token one: prompt ...
    conversations.is_assistant[5 + 25] = True  # ... with its only answer token beyond T + 1
    dropped = PackedConversations(conversations, T, PAD)
    assert (dropped.num_dropped, dropped.num_truncated, dropped.num_rows) == (2, 0, 1)
    assert "Dropped 2 of 3 training conversations longer than seq_len + 1 = 17" in caplog.text
    truncated = PackedConversations(conversations, T, PAD, overlong="truncate")
    # The 30-token one keeps no assistant token in its first 17 and is dropped anyway.
    assert (truncated.num_dropped, truncated.num_truncated, truncated.num_rows) == (1, 1, 2)
    assert "without assistant tokens in their first 17 tokens" in caplog.text
    batch = truncated.batch(np.arange(2))
    long_row = int(np.flatnonzero([2 in truncated.conversations_of(r) for r in range(2)])[0])
    assert batch.tokens[long_row].tolist() == (3000 + np.arange(T)).tolist()
    assert batch.doc_ids[long_row].tolist() == [0] * T
    with pytest.raises(ConfigError, match="All 3 training conversations were left out"):
        PackedConversations(conversations, 2, PAD)


def left_out(lengths: list[int], seq_len: int, answers: bool = True, **kwargs: object) -> str:
    """The error when packing conversations of ``lengths`` leaves none (one-line checked)."""
    conversations = synthetic_conversations(lengths)
    if not answers:
        conversations.is_assistant[:] = False
    with pytest.raises(ConfigError) as caught:
        PackedConversations(conversations, seq_len, PAD, **kwargs)  # type: ignore[arg-type]
    error = str(caught.value)
    print(error)
    assert "\n" not in error and "lower seq_len" not in error
    return error


def test_when_every_conversation_is_left_out_the_error_names_why_and_the_fix() -> None:
    # Too long: raising seq_len (or truncating) helps; lowering it, as the loader said, would not.
    error = left_out([30, 40, 25], T)
    assert "All 3 training conversations were left out" in error
    assert "3 longer than seq_len + 1 = 17 tokens (the longest has 40)" in error
    assert "raise --training.seq_len (to 39 to keep them all)" in error
    assert "--data.overlong_conversations truncate" in error
    # Multimodal samples cannot be truncated, so that fix is not offered.
    counts = np.zeros((3, 2), np.int64)
    assert "truncate" not in left_out(
        [30, 40, 25], T, media_counts=counts, max_media_per_row=(1, 0)
    )
    # Truncated, but every reply lies past the cut.
    conversations = synthetic_conversations([30, 40])
    conversations.is_assistant[:] = False
    conversations.is_assistant[[25, 30 + 35]] = True
    with pytest.raises(ConfigError) as caught:
        PackedConversations(conversations, T, PAD, overlong="truncate", split="validation")
    assert re.search(r"All 2 validation conversations .*2 without an assistant token in their "
                     r"first 17 tokens.*raise --training.seq_len so that their replies fit",
                     str(caught.value))  # fmt: skip
    # No assistant token anywhere, long or short: the chat template is the cause.
    error = left_out([5, 40], T, answers=False)
    assert "2 without any assistant token after chat templating" in error
    assert "check that the chat template renders the assistant messages" in error
    assert "longer than" not in error


def make_loader(rows: PackedConversations, **overrides: object) -> TrainLoader:
    kwargs: dict = dict(global_batch_size=4, micro_batch_size=2, seed=3)
    kwargs.update(overrides)
    return TrainLoader(rows, **kwargs)


def step_union(rows: PackedConversations, dp_size: int, micro: int, steps: int) -> list:
    loaders = [make_loader(rows, dp_rank=r, dp_size=dp_size, micro_batch_size=micro)
               for r in range(dp_size)]  # fmt: skip
    result = []
    for _ in range(steps):
        batches = [b for loader in loaders for b in loader.next_step()]
        names = ("tokens", "labels", "positions", "doc_ids")
        result.append([torch.cat([getattr(b, n) for b in batches]) for n in names])
    return result


@pytest.mark.parametrize(("dp_size", "micro"), [(2, 1), (4, 1), (2, 2)])
def test_sft_loader_union_independent_of_layout_and_resumes(dp_size: int, micro: int) -> None:
    rows = PackedConversations(synthetic_conversations(LENGTHS * 3), T, PAD)
    reference = step_union(rows, dp_size=1, micro=4, steps=6)  # > 1 epoch
    for step, (expected, actual) in enumerate(zip(reference, step_union(rows, dp_size, micro, 6))):
        for e, a in zip(expected, actual):
            assert_close(a, e, rtol=0, atol=0, msg=lambda m, s=step: f"step {s}: {m}")
    first = make_loader(rows)
    for _ in range(4):
        first.next_step()
    resumed = make_loader(rows, micro_batch_size=1, dp_size=1)
    resumed.load_state_dict(first.state_dict())
    for step in range(4, 6):
        expected = torch.cat([b.labels for b in first.next_step()])
        assert torch.equal(torch.cat([b.labels for b in resumed.next_step()]), expected), step
    fewer = PackedConversations(synthetic_conversations(LENGTHS), T, PAD)
    with pytest.raises(ConfigError, match=r"num_rows was \d+ in the checkpoint and is \d+ now"):
        make_loader(fewer).load_state_dict(first.state_dict())


def test_val_loader_pads_with_ignored_rows() -> None:
    rows = PackedConversations(synthetic_conversations(LENGTHS[:6]), T, PAD)
    loader = ValLoader(rows, batch_size=rows.num_rows + 1)
    (batch,) = list(loader)
    assert (batch.labels[-1] == IGNORE_INDEX).all()
    assert batch.num_label_tokens == rows.batch(np.arange(rows.num_rows)).num_label_tokens


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


GOOD = json.dumps({"messages": [{"role": "user", "content": "a"},
                                {"role": "assistant", "content": "b"}]})  # fmt: skip


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not a valid JSON line"),
        ('{"text": "hi"}', "no field 'messages' (found ['text'])."),
        ('{"msgs": []}', "no field 'messages' (found ['msgs']). Rename 'msgs' to 'messages'."),
        ('[{"messages": []}]', "the line is a JSON array, not an object; a .jsonl file holds one "
                               "JSON object per line"),
        ('{"messages": []}', "'messages' must be a non-empty list"),
        ('{"messages": ["hi"]}', "message 0 must be an object with 'role' and 'content'"),
        ('{"messages": [{"role": "asistant", "content": "x"}]}',
         "message 0 has role 'asistant'; roles are system, user, assistant. Did you mean "
         "'assistant'?"),
        ('{"messages": [{"role": "user", "content": ["x"]}]}',
         "message 0 (user) has content of type list; content must be a string"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "has no assistant message"),
    ],
)  # fmt: skip
def test_bad_chat_lines_name_file_line_and_problem(tmp_path: Path, line: str, message: str) -> None:
    path = write_lines(tmp_path / "chats.jsonl", [GOOD, "", line])
    with pytest.raises(ConfigError, match=re.escape(f"{path}:3: ") + ".*" + re.escape(message)):
        list(iter_conversations(resolve_chat_sources([str(path)], tmp_path)))


def test_chat_files_not_in_utf8_are_refused_saying_so(tmp_path: Path) -> None:
    utf16 = tmp_path / "utf16.jsonl"
    utf16.write_text(GOOD + "\n", encoding="utf-16")  # with a byte order mark, as editors save
    with pytest.raises(ConfigError, match=re.escape(f"{utf16} is UTF-16 text; save it as UTF-8")):
        list(iter_conversations(resolve_chat_sources([str(utf16)], tmp_path)))
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(GOOD.encode() + b"\n" + GOOD.replace('"a"', '"\xe9"').encode("latin-1"))
    with pytest.raises(ConfigError, match=re.escape(f"{latin1}:2: not UTF-8 text (byte 0xe9")):
        list(iter_conversations(resolve_chat_sources([str(latin1)], tmp_path)))
    bom = write_lines(tmp_path / "bom.jsonl", ["\ufeff" + GOOD, GOOD])  # a UTF-8 BOM is fine
    assert len(list(iter_conversations(resolve_chat_sources([str(bom)], tmp_path)))) == 2


def test_chat_sources_must_be_jsonl(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ConfigError, match="is not a .jsonl file"):
        resolve_chat_sources([str(tmp_path / "notes.txt")], tmp_path)
    with pytest.raises(ConfigError, match="Did you mean 'builtin:chat_tasks'"):
        resolve_chat_sources(["builtin:chat_task"], tmp_path)


def test_builtin_chat_set_is_deterministic_and_valid(tmp_path: Path) -> None:
    path = ensure_builtin_chat(tmp_path)
    assert path == builtin_chat_path(tmp_path) and path.name == "chat_tasks-v1.jsonl"
    lines = path.read_text().splitlines()
    regenerated = generate_chat_tasks(len(lines), seed=2024)
    assert [json.loads(line)["messages"] for line in lines] == regenerated
    conversations = [parse_messages(json.loads(line), "x") for line in lines]
    assert len(conversations) == 3000
    systems = sum(c[0]["role"] == "system" for c in conversations)
    multi_turn = sum(sum(m["role"] == "assistant" for m in c) == 2 for c in conversations)
    print(f"{systems} with a system message, {multi_turn} with two turns")
    assert 800 < systems < 1200 and 600 < multi_turn < 900
    sums = [m for c in conversations for m in c if re.fullmatch(r"\d+ \+ \d+ = \d+", m["content"])]
    for message in sums:
        a, b, total = map(int, re.findall(r"\d+", message["content"]))
        assert a + b == total, message
    assert len(sums) > 200
    assert generate_chat_tasks(20, seed=1) != generate_chat_tasks(20, seed=2)


def test_chat_dataloaders_end_to_end(tmp_path: Path, builtin_cache: Path) -> None:
    chats = [
        {"messages": [{"role": "user", "content": f"Count to {i}."},
                      {"role": "assistant", "content": " ".join(map(str, range(1, i + 1)))}]}
        for i in range(1, 41)
    ]  # fmt: skip
    path = write_lines(tmp_path / "chats.jsonl", [json.dumps(c) for c in chats])
    cfg = DataConfig(format="chat", sources=[str(path)], val_fraction=0.1,
                     cache_dir=str(builtin_cache))  # fmt: skip
    tokenizer, train, val = build_dataloaders(cfg, seq_len=64, global_batch_size=4,
                                              micro_batch_size=2)  # fmt: skip
    assert val is not None and len(val.rows.conversations) == 4
    assert len(train.rows.conversations) == 36
    batches = train.next_step()
    assert len(batches) == 2 and batches[0].tokens.shape == (2, 64)
    answer = [t for t in batches[0].labels[0].tolist() if t != IGNORE_INDEX]
    assert tokenizer.decode(answer).endswith("<|im_end|>\n")
    assert all(b.doc_ids is not None for b in batches)
    again = build_dataloaders(cfg, seq_len=64, global_batch_size=4, micro_batch_size=2)
    assert torch.equal(again.train.next_step()[0].tokens, batches[0].tokens)
