"""Sources: .txt, .jsonl and directories become documents; mistakes name file and fix."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tests.data.stream_files import write_arrow, write_hf_dataset, write_npy, write_parquet
from torchloom.config.errors import ConfigError
from torchloom.data import DataConfig, build_dataloaders
from torchloom.data.readers import load_token_array, read_documents
from torchloom.data.sources import iter_documents, resolve_sources


def documents(sources: list[str], tmp_path: Path, text_field: str = "text") -> list[str]:
    return list(iter_documents(resolve_sources(sources, text_field, tmp_path / "cache")))


def write_jsonl(path: Path, records: list[object]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_txt_is_one_document(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("line one\nline two\n", encoding="utf-8")
    assert documents([str(tmp_path / "a.txt")], tmp_path) == ["line one\nline two\n"]


def test_jsonl_one_document_per_line(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"body": "first"}, {"body": ""}, {"body": "ü 2"}])
    with path.open("a") as f:
        f.write("\n")  # blank lines are skipped, as are empty documents
    assert documents([str(path)], tmp_path, text_field="body") == ["first", "ü 2"]


def test_a_null_text_is_an_empty_document_and_other_types_are_refused(tmp_path: Path) -> None:
    """A JSON null (as exports of tables with missing values write) is skipped like a null
    parquet row; a number or a list is a mistake, named with its line."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": None}, {"text": "kept"}])
    assert documents([str(path)], tmp_path) == ["kept"]
    path = write_jsonl(tmp_path / "n.jsonl", [{"text": "ok"}, {"text": ["a", "b"]}])
    with pytest.raises(ConfigError, match=r"n.jsonl:2: field 'text' is a list, not a string"):
        documents([str(path)], tmp_path)


def test_extensions_are_read_in_any_case(tmp_path: Path) -> None:
    """Shards named ``*.PARQUET`` or ``*.Jsonl`` are data, not files a folder skips."""
    root = tmp_path / "corpus"
    write_parquet(root / "a.PARQUET", ["upper parquet"])
    write_jsonl(root / "b.Jsonl", [{"text": "mixed-case jsonl"}])
    (root / "c.TXT").write_text("upper txt", encoding="utf-8")
    expected = ["upper parquet", "mixed-case jsonl", "upper txt"]
    assert documents([str(root)], tmp_path) == expected
    assert documents([str(root / "a.PARQUET")], tmp_path) == expected[:1]


def test_directory_takes_sorted_txt_and_jsonl(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    write_jsonl(root / "b" / "z.jsonl", [{"text": "b/z 1"}, {"text": "b/z 2"}])
    (root / "a.txt").write_text("a", encoding="utf-8")
    (root / "c.md").write_text("ignored", encoding="utf-8")
    assert documents([str(root)], tmp_path) == ["a", "b/z 1", "b/z 2"]


def test_bad_jsonl_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"text": oops}\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=re.escape(f"{path}:2: not a valid JSON line")):
        documents([str(path)], tmp_path)


def test_missing_text_field_suggests_the_close_one(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"txt": "hello"}])
    with pytest.raises(ConfigError, match=r"d.jsonl:1: no field 'text'.*Did you mean 'txt'"):
        documents([str(path)], tmp_path)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'nope.jsonl' does not exist"):
        documents(["nope.jsonl"], tmp_path)


def test_unsupported_extension_and_unknown_builtin(tmp_path: Path) -> None:
    (tmp_path / "data.csv").write_text("a,b", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"unsupported extension '.csv': use .txt .* .parquet"):
        documents([str(tmp_path / "data.csv")], tmp_path)
    with pytest.raises(ConfigError, match="Did you mean 'builtin:stdlib_docs'"):
        documents(["builtin:stdlib_doc"], tmp_path)


def test_parquet_arrow_and_datasets_folders_are_text_sources(tmp_path: Path) -> None:
    docs = [f"document {i}" for i in range(23)]
    docs_with_gaps = [*docs[:5], "", None, *docs[5:]]  # empty and null rows are skipped
    sources = {
        "parquet": write_parquet(tmp_path / "a.parquet", docs_with_gaps, rows_per_group=4),
        "arrow file": write_arrow(tmp_path / "a.arrow", docs_with_gaps),
        "arrow stream": write_arrow(tmp_path / "s.arrow", docs_with_gaps, stream=True),
        "datasets folder": write_hf_dataset(tmp_path / "hf", docs, num_shards=3),
    }
    for name, path in sources.items():
        assert documents([str(path)], tmp_path) == docs, name
    shards = tmp_path / "shards"
    write_parquet(shards / "b.parquet", docs[10:])
    write_parquet(shards / "a.parquet", docs[:10])
    assert documents([str(shards)], tmp_path) == docs  # a directory: sorted shards


def test_missing_column_names_the_columns(tmp_path: Path) -> None:
    parquet = write_parquet(tmp_path / "d.parquet", ["x"])
    with pytest.raises(ConfigError, match=r"d.parquet: no column 'txt' \(columns: id, text\)\."
                       r".*Did you mean 'text'.*--data.text_field"):  # fmt: skip
        documents([str(parquet)], tmp_path, text_field="txt")
    arrow = write_arrow(tmp_path / "d.arrow", ["x"], stream=True)
    with pytest.raises(ConfigError, match=r"d.arrow: no column 'body' \(columns: text, id\)"):
        documents([str(arrow)], tmp_path, text_field="body")
    with pytest.raises(ConfigError, match="column 'id' holds int64, not strings"):
        documents([str(parquet)], tmp_path, text_field="id")
    # A shard whose text column is all nulls (typed null) holds no documents, as null rows.
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array([None, None])}), tmp_path / "nulls.parquet")
    assert pq.read_schema(tmp_path / "nulls.parquet").field("text").type == pa.null()
    assert documents([str(tmp_path / "nulls.parquet"), str(parquet)], tmp_path) == ["x"]


def test_datasets_dict_folder_asks_for_a_split(tmp_path: Path) -> None:
    import datasets

    splits = {"train": datasets.Dataset.from_dict({"text": ["a"]}),
              "test": datasets.Dataset.from_dict({"text": ["b"]})}  # fmt: skip
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ConfigError, match=r"DatasetDict folder \(splits: test, train\).*dd/train"):
        documents([str(tmp_path / "dd")], tmp_path)


def test_token_arrays_are_cached_like_their_text(tmp_path: Path, tiny_tokenizer) -> None:
    """A .npy of pre-tokenized documents gives the cached loader the tokens and the validation
    split that the same documents as JSONL give."""
    docs = [f"document {i}: " + "text " * (i % 7) for i in range(50)]
    cached = {}
    for name, path in (("jsonl", write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in docs])),
                       ("npy", write_npy(tmp_path / "d.npy", docs, tiny_tokenizer))):  # fmt: skip
        cfg = DataConfig(sources=[str(path)], tokenizer=str(tiny_tokenizer.path),
                         cache_dir=str(tmp_path / "c"), val_fraction=0.1)  # fmt: skip
        _, train, val = build_dataloaders(cfg, seq_len=8, global_batch_size=2, micro_batch_size=2)
        cached[name] = (train.rows.tokens, val.rows.tokens)
    assert all(np.array_equal(a, b) for a, b in zip(cached["jsonl"], cached["npy"]))
    assert len(cached["npy"][1]) > 0


def test_token_arrays_need_a_known_dtype_and_ids(tmp_path: Path, tiny_tokenizer) -> None:
    np.save(tmp_path / "f.npy", np.zeros((2, 3), dtype=np.float32))
    cfg = DataConfig(sources=[str(tmp_path / "f.npy")], streaming=True, val_fraction=0.0,
                     tokenizer=str(tiny_tokenizer.path), cache_dir=str(tmp_path / "c"))  # fmt: skip
    with pytest.raises(ConfigError, match="f.npy: a token source must be a 1-D array.*2-D float32"):
        build_dataloaders(cfg, seq_len=8, global_batch_size=2, micro_batch_size=2)
    np.save(tmp_path / "big.npy", np.array([5, 900, 0], dtype=np.int32))
    cfg.sources = [str(tmp_path / "big.npy")]
    _, train, _ = build_dataloaders(cfg, seq_len=8, global_batch_size=2, micro_batch_size=2)
    with pytest.raises(ConfigError, match="big.npy: token id 900 is outside the tokenizer's"):
        train.next_step()  # raised on the worker thread, re-raised here


def test_a_streamed_source_without_documents_fails(tmp_path: Path, tiny_tokenizer) -> None:
    empty = write_parquet(tmp_path / "empty.parquet", ["", None])
    cfg = DataConfig(sources=[str(empty)], streaming=True, val_fraction=0.0,
                     tokenizer=str(tiny_tokenizer.path), cache_dir=str(tmp_path / "c"))  # fmt: skip
    _, train, _ = build_dataloaders(cfg, seq_len=8, global_batch_size=2, micro_batch_size=2)
    with pytest.raises(ConfigError, match="empty.parquet' contains no documents"):
        train.next_step()


def test_sources_named_wrong_get_one_line_with_the_fix(tmp_path: Path) -> None:
    """Inputs a sweep of bad data found unclear, each now refused in one line naming it."""
    with pytest.raises(ConfigError, match="entry is an empty string"):
        documents([""], tmp_path)  # Path("") would be the working directory
    write_jsonl(tmp_path / "list.jsonl", [{"text": "ok"}, ["a", "b"]])
    with pytest.raises(ConfigError, match=r"list.jsonl:2: the line is a list, not a JSON object"):
        documents([str(tmp_path / "list.jsonl")], tmp_path)
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    for field in ("text", "messages"):  # the missing field, then the list where text should be
        with pytest.raises(ConfigError, match="holds chat 'messages'.*--data.format chat"):
            documents([str(chat)], tmp_path, text_field=field)
    (tmp_path / "c.npy").write_bytes(b"not a numpy file" * 10)
    with pytest.raises(ConfigError, match=r"c.npy: not a NumPy .npy file .*numpy.save"):
        load_token_array(tmp_path / "c.npy")


def test_datasets_folder_missing_a_listed_shard(tmp_path: Path) -> None:
    folder = write_hf_dataset(tmp_path / "hf", ["a", "b", "c", "d"], num_shards=2)
    shards = sorted(folder.glob("*.arrow"))
    shards[1].unlink()
    with pytest.raises(ConfigError, match=rf"state.json lists {shards[1].name}, which is missing"):
        documents([str(folder)], tmp_path)


def test_hidden_files_and_folders_are_skipped(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    write_jsonl(root / "a.jsonl", [{"text": "kept"}])
    write_jsonl(root / ".ipynb_checkpoints" / "a-checkpoint.jsonl", [{"text": "a copy"}])
    (root / ".notes.txt").write_text("hidden", encoding="utf-8")
    assert documents([str(root)], tmp_path) == ["kept"]


def test_dictionary_encoded_text_column_reads_as_strings(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = ["one", "two", "one", "three"]
    table = pa.table({"text": pa.array(docs).dictionary_encode()})
    pq.write_table(table, tmp_path / "d.parquet")
    assert documents([str(tmp_path / "d.parquet")], tmp_path) == docs


def test_a_bytes_text_column_reads_as_utf8(tmp_path: Path) -> None:
    """Parquet writers that leave out the UTF-8 annotation store text as binary; it reads as
    text (parquet row groups and arrow record batches, resumed mid-batch too), and bytes that
    are not UTF-8 are named with their row group."""
    docs = [f"bytes doc {i} é" for i in range(12)]
    encoded = [d.encode() for d in docs]
    assert documents([str(write_parquet(tmp_path / "b.parquet", encoded))], tmp_path) == docs
    arrow = write_arrow(tmp_path / "b.arrow", encoded)
    assert documents([str(arrow)], tmp_path) == docs
    assert [t for t, _ in read_documents(arrow, "text", (1, 2))] == docs[7:]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array(encoded * 2).dictionary_encode()}),
                   tmp_path / "dict.parquet", use_dictionary=False)  # fmt: skip
    assert documents([str(tmp_path / "dict.parquet")], tmp_path) == docs * 2
    bad = write_parquet(tmp_path / "bad.parquet", [b"fine", b"not \xff utf-8"], rows_per_group=1)
    with pytest.raises(ConfigError, match=r"bad.parquet: row group 1 of the text column holds "
                       "bytes that are not UTF-8"):  # fmt: skip
        documents([str(bad)], tmp_path)


def test_a_streamed_corpus_shorter_than_one_sequence_is_refused(tmp_path, tiny_tokenizer) -> None:
    """As the cached loader refuses it, instead of serving rows of a few tokens repeated."""
    (tmp_path / "tiny.txt").write_text("hi", encoding="utf-8")
    cfg = DataConfig(sources=[str(tmp_path / "tiny.txt")], streaming=True, val_fraction=0.0,
                     tokenizer=str(tiny_tokenizer.path), cache_dir=str(tmp_path / "c"))  # fmt: skip
    _, train, _ = build_dataloaders(cfg, seq_len=64, global_batch_size=2, micro_batch_size=2)
    with pytest.raises(ConfigError, match=r"hold \d+ tokens in all.*seq_len=64 needs 65"):
        train.next_step()
    # A source the mix never draws (weight 0) never goes round: the check still runs on the
    # drawn ones (it once waited for every stream, and never ran).
    (tmp_path / "other.txt").write_text("more text than one row " * 20, encoding="utf-8")
    mixed = replace(cfg, sources=[str(tmp_path / "tiny.txt"), str(tmp_path / "other.txt")],
                    mix=[1.0, 0.0])  # fmt: skip
    _, train, _ = build_dataloaders(mixed, seq_len=64, global_batch_size=2, micro_batch_size=2)
    with pytest.raises(ConfigError, match=r"hold \d+ tokens in all.*seq_len=64 needs 65"):
        train.next_step()
    # Enough text for a row, fewer tokens than a whole step: a small corpus repeats, as before.
    _, train, _ = build_dataloaders(cfg, seq_len=1, global_batch_size=2, micro_batch_size=2)
    assert len(train.next_step()) == 1


def test_validation_fraction_that_starves_training_is_named(tmp_path, tiny_tokenizer) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "word " * 30 + str(i)} for i in range(10)])
    cfg = DataConfig(sources=[str(path)], tokenizer=str(tiny_tokenizer.path),
                     cache_dir=str(tmp_path / "c"), val_fraction=0.9)  # fmt: skip
    with pytest.raises(ConfigError, match=r"--data.val_fraction 0.9 holds out \d+ tokens"):
        build_dataloaders(cfg, seq_len=256, global_batch_size=2, micro_batch_size=2)


@pytest.mark.parametrize("streaming", [False, True])
def test_a_source_entry_without_documents_is_named(tmp_path, tiny_tokenizer, streaming) -> None:
    """Cached, and streamed without a mix (one stream over the entries, one after the other):
    an entry with no text beside one with text is refused, as the mix refuses it."""
    text = write_jsonl(tmp_path / "d.jsonl", [{"text": "word " * 5 + str(i)} for i in range(20)])
    empty = write_parquet(tmp_path / "nulls.parquet", ["", None])
    cfg = DataConfig(sources=[str(text), str(empty)], streaming=streaming, val_fraction=0.0,
                     tokenizer=str(tiny_tokenizer.path), cache_dir=str(tmp_path / "c"))  # fmt: skip
    with pytest.raises(ConfigError, match="nulls.parquet' contains no documents"):
        _, train, _ = build_dataloaders(cfg, seq_len=8, global_batch_size=2, micro_batch_size=2)
        for _ in range(200):  # streamed: found when the stream goes round
            train.next_step()
