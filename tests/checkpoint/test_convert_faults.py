"""`torchloom convert` never deletes or changes its input: an output folder that is, holds or lies
inside the source (or the tokenizer folder), symlinks resolved, or whose staging folder is the
source, is refused with one line and exit 2 before anything is written; so is an output that
cannot be created, and a tokenizer with more tokens than the model's vocabulary. Every file
under the test folder is byte-compared before and after."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

import torchloom
from tests.checkpoint.test_faults import train
from torchloom.checkpoint.model_io import save_model
from torchloom.cli import main
from torchloom.config.errors import ConfigError
from torchloom.models import TransformerConfig, build_model

CONFIG = TransformerConfig(vocab_size=64, dim=32, num_layers=1, num_heads=2, num_kv_heads=1,
                           ffn_dim=64, max_seq_len=32)  # fmt: skip


def files_of(folder: Path) -> dict[str, bytes]:
    """Every file and symlink under ``folder`` with its bytes (a link by its target)."""
    return {
        str(p.relative_to(folder)): str(p.readlink()).encode() if p.is_symlink() else p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() or p.is_symlink()
    }


def refused(capsys, tmp_path: Path, pattern: str, *args: object, code: int = 2) -> None:
    before = files_of(tmp_path)
    assert main(["convert", *map(str, args)]) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert re.search(pattern, err), err
    assert files_of(tmp_path) == before


@pytest.fixture
def hf_source(tmp_path, hf_checkpoint) -> Path:
    """A tiny Hugging Face llama folder at tmp_path/work/src, with a tokenizer file."""
    path, _ = hf_checkpoint("llama", name="work/src")
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return path


@pytest.fixture
def model_source(tmp_path) -> Path:
    """A tiny torchloom model folder at tmp_path/work/model."""
    model = build_model(CONFIG)
    model.init_weights(0)
    path = tmp_path / "work" / "model"
    save_model(model, "llama3", CONFIG, path)
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return path


def test_from_hf_output_holding_the_source_is_refused(tmp_path, hf_source, capsys) -> None:
    work = hf_source.parent
    (tmp_path / "alias").symlink_to(work)
    contains = "contains the source folder .*src, which writing the output would delete"
    refused(capsys, tmp_path, contains, "--from-hf", hf_source, "--to", work, "--overwrite")
    refused(capsys, tmp_path, contains, "--from-hf", hf_source, "--to", tmp_path, "--overwrite")
    refused(capsys, tmp_path, contains, "--from-hf", hf_source, "--to", tmp_path / "alias",
            "--overwrite")  # fmt: skip
    refused(capsys, tmp_path, re.escape(f"The output folder {hf_source} is the source folder;"),
            "--from-hf", hf_source, "--to", hf_source, "--overwrite")  # fmt: skip
    refused(capsys, tmp_path, "is the source folder", "--from-hf", hf_source, "--to",
            tmp_path / "alias" / "src" / ".." / "src", "--overwrite")  # fmt: skip
    inside = re.escape(f"is inside the source folder {hf_source}; choose an output folder outside")
    refused(capsys, tmp_path, inside, "--from-hf", hf_source, "--to", hf_source / "tl")


def test_to_hf_output_holding_the_source_or_tokenizer_is_refused(
    tmp_path, model_source, hf_source, capsys
) -> None:
    work = model_source.parent
    refused(capsys, tmp_path, "contains the source folder .*model", "--from", model_source,
            "--to-hf", work, "--overwrite")  # fmt: skip
    refused(capsys, tmp_path, "is inside the source folder", "--from", model_source,
            "--to-hf", model_source / "hf")  # fmt: skip
    tokenizer = tmp_path / "outer" / "tok"
    tokenizer.mkdir(parents=True)
    (tokenizer / "tokenizer_config.json").write_text("{}")
    refused(capsys, tmp_path, "is the tokenizer folder", "--from", model_source, "--to-hf",
            tokenizer, "--tokenizer", tokenizer, "--overwrite")  # fmt: skip
    refused(capsys, tmp_path, "contains the tokenizer folder .*tok, which writing", "--from",
            model_source, "--to-hf", tokenizer.parent, "--tokenizer", tokenizer,
            "--overwrite")  # fmt: skip
    refused(capsys, tmp_path, "is inside the tokenizer folder", "--from", model_source,
            "--to-hf", tokenizer / "hf", "--tokenizer", tokenizer)  # fmt: skip


def test_source_in_the_staging_folder_is_refused(tmp_path, hf_checkpoint, capsys) -> None:
    """`<out>.partial` is cleared before the write and `<out>.old` after it."""
    staged, _ = hf_checkpoint("llama", name="out.partial")
    refused(capsys, tmp_path, re.escape(f"The source folder {staged} is where the output "),
            "--from-hf", staged, "--to", tmp_path / "out")  # fmt: skip
    old = staged.rename(tmp_path / "out.old")
    (tmp_path / "out").mkdir()
    refused(capsys, tmp_path, "out.partial, out.old\\), which writing it deletes", "--from-hf",
            old, "--to", tmp_path / "out", "--overwrite")  # fmt: skip


def test_output_that_cannot_be_created_is_refused(tmp_path, hf_source, model_source, capsys):
    (tmp_path / "afile").write_text("mine")
    for args in (["--from-hf", hf_source, "--to"], ["--from", model_source, "--to-hf"]):
        refused(capsys, tmp_path, re.escape(f"Cannot create {tmp_path}/afile/out: {tmp_path}/"
                "afile is a file, not a folder; choose another path."), *args,
                tmp_path / "afile" / "out")  # fmt: skip
        refused(capsys, tmp_path, "afile is a file, not a folder", *args,
                tmp_path / "afile" / "a" / "b")  # fmt: skip
        refused(capsys, tmp_path, "afile exists and is not a folder", *args, tmp_path / "afile")


def test_unwritable_output_parent_is_refused(tmp_path, hf_source, capsys, monkeypatch) -> None:
    monkeypatch.setattr("os.access", lambda path, mode: False)  # root may write anywhere
    refused(capsys, tmp_path, f"the folder {tmp_path} is not writable", "--from-hf", hf_source,
            "--to", tmp_path / "out")  # fmt: skip


def test_a_sibling_output_still_converts(tmp_path, hf_source, capsys) -> None:
    """The checks refuse overlap only: a folder beside the source (its name a prefix of the
    source's) converts, and the source is untouched."""
    before = files_of(hf_source)
    beside, other = tmp_path / "work" / "sr", tmp_path / "work" / "src2"
    assert main(["convert", "--from-hf", str(hf_source), "--to", str(beside)]) == 0
    assert main(["convert", "--from", str(beside), "--to-hf", str(other)]) == 0
    capsys.readouterr()
    assert files_of(hf_source) == before


def test_a_damaged_step_is_pointed_at_an_undamaged_step_only(tmp_path, capsys) -> None:
    """The step a damaged one's error suggests passes its own checks (the newest older first):
    never another damaged step; with none left, the run's model folder."""
    run = tmp_path / "run"
    assert train(run, "--training.steps", "3", "--checkpoint.interval", "1") == 0
    capsys.readouterr()
    step_1, step_2, step_3 = (run / "checkpoints" / f"step-{n}" for n in (1, 2, 3))
    with open(step_2 / "__0_0.distcp", "r+b") as file:
        file.truncate(500)
    (step_3 / ".metadata").unlink()
    out = tmp_path / "hf"
    cut = re.escape(f"Checkpoint file {step_2}/__0_0.distcp has 500 bytes where ") + ".*; "
    lost = re.escape(f"Checkpoint file {step_3}/.metadata is missing; ")
    older = re.escape(f"use an older step folder, e.g. --from {step_1}.")
    refused(capsys, tmp_path, cut + older, "--from", step_2, "--to-hf", out, code=1)
    refused(capsys, tmp_path, lost + older, "--from", step_3, "--to-hf", out, code=1)
    shutil.rmtree(step_1)
    none = re.escape("no other step beside it is complete and undamaged, so use the run's model "
                     "folder (<output_dir>/model).")  # fmt: skip
    refused(capsys, tmp_path, cut + none, "--from", step_2, "--to-hf", out, code=1)
    refused(capsys, tmp_path, lost + none, "--from", step_3, "--to-hf", out, code=1)


def write_tokenizer_of(folder: Path, num_tokens: int) -> Path:
    """A word-level tokenizer.json of ``num_tokens`` ids (the last one </s>) in ``folder``."""
    import tokenizers

    vocab = {f"w{i}": i for i in range(num_tokens - 1)} | {"</s>": num_tokens - 1}
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def test_a_tokenizer_bigger_than_the_vocabulary_is_refused(
    tmp_path, hf_source, model_source, capsys
) -> None:
    """Its ids past the embedding would break the export in transformers: refused up front."""
    tokenizer = write_tokenizer_of(tmp_path / "work" / "tok", 600)
    refused(capsys, tmp_path, re.escape(f"The tokenizer in {tokenizer} has 600 tokens but the "
            "model's vocabulary holds only 64; pass the model's own --tokenizer."),
            "--from", model_source, "--to-hf", tmp_path / "out", "--tokenizer", tokenizer)  # fmt: skip
    write_tokenizer_of(hf_source, 600)
    refused(capsys, tmp_path, "has 600 tokens but the model's vocabulary holds only 512; replace "
            "the folder's tokenizer files", "--from-hf", hf_source, "--to", tmp_path / "out")  # fmt: skip


@pytest.mark.parametrize("size", ["0", "0.5"])
def test_a_max_shard_size_below_one_byte_is_refused(capsys, tmp_path, size):
    """Named as the option the user typed, not as the writer's internal max_shard_bytes."""
    refused(
        capsys, tmp_path,
        rf"^error: --max-shard-size {re.escape(size)} leaves no room for a weight file; give a "
        r"size of at least 1 byte, e.g\. 2GB or 500MB\.\n$",
        "--from-hf", tmp_path / "hf", "--to", tmp_path / "out", "--max-shard-size", size,
    )  # fmt: skip


def edit_config(folder: Path, **changes: object) -> None:
    """Change keys of a Hugging Face folder's config.json."""
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | changes))


def test_an_untied_config_without_a_head_is_refused(tmp_path, hf_source, capsys) -> None:
    """config.json says the head is its own tensor, but the weights have none: named, not a
    safetensors traceback about shared memory."""
    from safetensors.torch import load_file, save_file

    weights = load_file(hf_source / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, str(hf_source / "model.safetensors"), metadata={"format": "pt"})
    refused(capsys, tmp_path, re.escape(f"{hf_source}/config.json does not set "
            f"tie_word_embeddings true, but the weights in {hf_source} have no lm_head.weight "
            "(the output head); set tie_word_embeddings to true if the head is the embedding, "
            "or add lm_head.weight"), "--from-hf", hf_source, "--to", tmp_path / "out")  # fmt: skip


def test_a_tied_config_with_a_distinct_head_is_refused(tmp_path, hf_source, capsys) -> None:
    """Tying would drop a trained head; a head that is a copy of the embedding still converts."""
    edit_config(hf_source, tie_word_embeddings=True)
    refused(capsys, tmp_path, re.escape(f"{hf_source}/config.json sets tie_word_embeddings "
            f"true, but {hf_source} holds an lm_head.weight that differs from the embedding "
            "'model.embed_tokens.weight': tying would drop that head. Set tie_word_embeddings "
            "to false to keep it"), "--from-hf", hf_source, "--to", tmp_path / "out")  # fmt: skip
    from safetensors.torch import load_file, save_file

    weights = load_file(hf_source / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(hf_source / "model.safetensors"), metadata={"format": "pt"})
    assert main(["convert", "--from-hf", str(hf_source), "--to", str(tmp_path / "out")]) == 0
    capsys.readouterr()


def test_fewer_layers_in_the_config_than_the_weights_are_named(tmp_path, hf_source, capsys):
    edit_config(hf_source, num_hidden_layers=1)
    refused(capsys, tmp_path, re.escape(f"The weights in {hf_source} hold layers 0-1, but "
            f"{hf_source}/config.json gives num_hidden_layers 1; config.json does not describe "
            "these weights: set its num_hidden_layers to 2."), "--from-hf", hf_source, "--to",
            tmp_path / "out")  # fmt: skip


def test_more_layers_in_the_config_than_the_weights_are_named(tmp_path, hf_source, capsys):
    """Named as config.json's count, not as the tensors of layer 2 the weights lack, by convert
    and by from_hf alike; a tensor missing inside a held layer is still named as missing."""
    from safetensors.torch import load_file, save_file

    edit_config(hf_source, num_hidden_layers=3)
    message = re.escape(f"The weights in {hf_source} hold layers 0-1, but {hf_source}/config.json "
                        "gives num_hidden_layers 3; config.json does not describe these weights: "
                        "set its num_hidden_layers to 2.")  # fmt: skip
    refused(capsys, tmp_path, message, "--from-hf", hf_source, "--to", tmp_path / "out")
    with pytest.raises(ConfigError, match=message):
        torchloom.from_hf(str(hf_source))
    edit_config(hf_source, num_hidden_layers=2)
    weights = load_file(hf_source / "model.safetensors")
    del weights["model.layers.1.input_layernorm.weight"]
    save_file(weights, str(hf_source / "model.safetensors"), metadata={"format": "pt"})
    refused(capsys, tmp_path, re.escape(f"{hf_source} is missing tensor(s) "
            "model.layers.1.input_layernorm.weight."), "--from-hf", hf_source, "--to",
            tmp_path / "out")  # fmt: skip


def test_a_tokenizer_folder_without_a_tokenizer_is_refused(
    tmp_path, model_source, hf_source, capsys
) -> None:
    """A folder holding only the files that go with a tokenizer (generation_config.json,
    tokenizer_config.json) would export a model without one."""
    (hf_source / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    refused(capsys, tmp_path, re.escape(f"--tokenizer {hf_source} holds no tokenizer "
            "(tokenizer.json, tokenizer.model or vocab.json), only tokenizer_config.json, "
            "generation_config.json; pass the folder the model's tokenizer is saved in."),
            "--from", model_source, "--to-hf", tmp_path / "out", "--tokenizer", hf_source)  # fmt: skip


def test_a_tokenizer_json_that_is_not_json_is_refused(
    tmp_path, model_source, hf_source, capsys
) -> None:
    """Copied as it is, it would convert fine and fail in generate."""
    tokenizer = hf_source / "tokenizer.json"
    tokenizer.write_text('{"version": "1.0", "model": ')
    refused(capsys, tmp_path, re.escape(f"{tokenizer} is not valid JSON (") + ".*"
            + re.escape("so no tokenizer library can load it; replace the folder's tokenizer "
            "files with the model's own."), "--from-hf", hf_source, "--to", tmp_path / "out")  # fmt: skip
    refused(capsys, tmp_path, re.escape(f"{tokenizer} is not valid JSON (") + ".*"
            + re.escape("pass the model's own --tokenizer."), "--from", model_source, "--to-hf",
            tmp_path / "out", "--tokenizer", hf_source)  # fmt: skip


def test_a_stale_staging_path_is_named(tmp_path, hf_source, capsys) -> None:
    """<out>.partial as a file, or as a folder holding what convert never writes, is refused; a
    folder an interrupted convert left is removed with one line."""
    out, staging = tmp_path / "out", tmp_path / "out.partial"
    staging.write_text("mine")
    refused(capsys, tmp_path, re.escape(f"{staging} exists and is not a folder, but the output "
            f"{out} is staged there while it is written; move it away or choose another output "
            "folder."), "--from-hf", hf_source, "--to", out)  # fmt: skip
    staging.unlink()
    staging.mkdir()
    (staging / "config.json").write_text("{}")
    (staging / "notes.txt").write_text("mine")
    refused(capsys, tmp_path, re.escape(f"{staging} holds notes.txt, which writing a model "
            "folder never puts there"), "--from-hf", hf_source, "--to", out)  # fmt: skip
    (staging / "notes.txt").unlink()
    (staging / "shard-00001.safetensors").write_bytes(b"cut short")
    assert main(["convert", "--from-hf", str(hf_source), "--to", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"removed {staging}: the staging folder of an earlier, interrupted write"
    assert printed[1].startswith(f"wrote {out}: ") and len(printed) == 2
    assert not staging.exists() and (out / "model.safetensors").is_file()


def test_a_stale_replaced_folder_is_named(tmp_path, hf_source, capsys) -> None:
    """<out>.old, where replacing <out> moves it, is deleted only when it is what an interrupted
    replace left (model files only, removed with one line); a folder of the user's is refused."""
    out, old = tmp_path / "out", tmp_path / "out.old"
    assert main(["convert", "--from-hf", str(hf_source), "--to", str(out)]) == 0
    capsys.readouterr()
    old.mkdir()
    (old / "config.json").write_text("{}")
    (old / "backup.txt").write_text("mine")
    refused(capsys, tmp_path, re.escape(f"{old} holds backup.txt, which writing a model folder "
            "never puts there, so it is not the folder an interrupted write replaced (those are "
            "deleted); move it away or choose another output folder."), "--from-hf", hf_source,
            "--to", out, "--overwrite")  # fmt: skip
    (old / "backup.txt").unlink()
    (old / "model.safetensors").write_bytes(b"the replaced weights")
    assert main(["convert", "--from-hf", str(hf_source), "--to", str(out), "--overwrite"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"removed {old}: the folder an earlier, interrupted write replaced"
    assert printed[1].startswith(f"wrote {out}: ") and len(printed) == 2
    assert not old.exists() and (out / "model.safetensors").is_file()
