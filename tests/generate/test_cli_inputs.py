"""`torchloom generate` on bad input: one error line and a non-zero exit, nothing of the user's
overwritten (prompts and an earlier output are byte-compared); requests that fail alone; and
--chat, whose prompts are the model's chat template rendered with the assistant's reply opened."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from torchloom.checkpoint.model_io import save_model
from torchloom.cli import main
from torchloom.data.chat import CHATML_TEMPLATE
from torchloom.data.tokenizer import BOS_TOKEN, EOS_TOKEN, Tokenizer, train_byte_level_bpe
from torchloom.generate import run
from torchloom.generate.engine import Generator, SamplingParams
from torchloom.models import TransformerConfig, build_model

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello there, how are you?"] * 10
CONFIG = TransformerConfig(vocab_size=320, dim=32, num_layers=1, num_heads=2, num_kv_heads=1,
                           ffn_dim=64, max_seq_len=64)  # fmt: skip
LLAMA3_STYLE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{{ m.content | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def tokenizer(template: str | None) -> Tokenizer:
    backend = train_byte_level_bpe(TEXTS, vocab_size=300)  # ids 0..3: eos, bos, im_start, im_end
    templates = {"default": template} if template else None
    return Tokenizer(backend, EOS_TOKEN, BOS_TOKEN, chat_templates=templates)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """torchloom model folders of a 1-layer llama3: with a ChatML tokenizer, with a tokenizer
    without chat template, and without tokenizer."""
    root = tmp_path_factory.mktemp("generate_models")
    model = build_model(CONFIG)
    model.init_weights(0)
    folders = {}
    for name, tok in (("chat", tokenizer(CHATML_TEMPLATE)), ("plain", tokenizer(None)),
                      ("bare", None)):  # fmt: skip
        folders[name] = root / name
        save_model(model, "llama3", CONFIG, folders[name], tok)
    return folders


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def generate(capsys, *args: object) -> tuple[int, str, str]:
    code = main(["generate", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_error(err: str, pattern: str) -> None:
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert re.search(pattern, err), err


NUMBERS = {
    "max-batch 0": (["--max-batch", "0"], "--max-batch must be an integer >= 1; got '0'"),
    "max-batch -1": (["--max-batch", "-1"], "--max-batch must be an integer >= 1; got '-1'"),
    "max-batch x": (["--max-batch", "two"], "--max-batch must be an integer >= 1"),
    "max-new-tokens": (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1"),
    "tp": (["--tp", "0"], "--tp must be an integer >= 1"),
    "top-k": (["--top-k", "-1"], r"--top-k must be an integer .*\(0 keeps every token\)"),
    "top-p 0": (["--top-p", "0"], r"--top-p must be a number in \(0, 1\]; got '0'"),
    "top-p 1.5": (["--top-p", "1.5"], r"--top-p must be a number in \(0, 1\]"),
    "top-p nan": (["--top-p", "nan"], r"--top-p must be a number in \(0, 1\]; got 'nan'"),
    "temperature": (["--temperature", "-0.5"], "--temperature must be a number >= 0"),
    "temperature inf": (["--temperature", "inf"], "--temperature must be a number >= 0"),
    "seed": (["--seed", "-3"], "--seed must be an integer .*; got '-3'"),
    "seed float": (["--seed", "1.5"], "--seed must be an integer"),
    "device": (["--device", "gpu"], "--device must be cpu, cuda or cuda:N; got 'gpu'"),
}


def test_cuda_without_a_gpu_says_to_use_cpu(models, capsys, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = generate(capsys, "--checkpoint", models["chat"], "--prompt", "Hi",
                            "--device", "cuda")  # fmt: skip
    assert code == 2
    assert_one_error(err, "no CUDA device .* use --device cpu")


def test_generator_refuses_no_slots() -> None:
    model = build_model(CONFIG)
    for max_batch in (0, -1, 1.5):
        with pytest.raises(ValueError, match=r"max_batch \(cache slots\) must be an integer >= 1"):
            Generator(model, max_batch=max_batch)
    with pytest.raises(ValueError, match="max_len must be None or an integer >= 1; got 0"):
        Generator(model, max_batch=1, max_len=0)


IDS = '"prompt_ids" must hold token ids \\(integers >= 0\\); '
ONE_OF = 'expected an object with exactly one of "prompt" \\(text\\), "prompt_ids"'
BAD_LINES = {
    "prompt 5": ('{"prompt": 5}', '"prompt" must be text \\(a string\\); got 5'),
    "ids of text": ('{"prompt_ids": ["a"]}', IDS + 'item 0 is "a"'),
    "float ids": ('{"prompt_ids": [1.5, 2]}', IDS + "item 0 is 1.5"),
    "bool id": ('{"prompt_ids": [3, true]}', IDS + "item 1 is true"),
    "nested ids": ('{"prompt_ids": [[1, 2]]}', IDS + "item 0 is \\[1, 2\\]"),
    "negative id": ('{"prompt_ids": [-1]}', IDS + "item 0 is -1"),
    "ids not a list": ('{"prompt_ids": 7}', '"prompt_ids" must be a list of token ids; got 7'),
    "both": ('{"prompt": "a", "prompt_ids": [1]}', ONE_OF + '.* got {"prompt": "a"'),
    "not an object": ("[1, 2]", ONE_OF + ".* got \\[1, 2\\]"),
    "not JSON": ('{"prompt": "a"', "not a valid JSON line"),
    "messages without --chat": ('{"messages": [{"role": "user", "content": "Hi"}]}',
                                'a "messages" line is a chat .* add --chat'),
    "settings on a line": ('{"prompt": "a", "max_new_tokens": 3, "temperature": 0}',
                           'unknown keys "max_new_tokens", "temperature"; a line holds exactly one '
                           'of "prompt", "prompt_ids" or "messages" and nothing else \\(sampling '
                           "settings are options: --max-new-tokens, --temperature"),
    "unknown key": ('{"text": "a"}', 'unknown key "text"; a line holds exactly one of "prompt"'),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_bad_prompt_lines_name_file_and_line(case, models, tmp_path, capsys) -> None:
    line, message = BAD_LINES[case]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello"}\n' + line + "\n")
    output = tmp_path / "out.jsonl"
    output.write_text("an earlier result\n")
    before = files_of(tmp_path)
    code, _, err = generate(capsys, "--checkpoint", models["chat"], "--prompts-file", prompts,
                            "--output", output)  # fmt: skip
    assert code == 2
    assert_one_error(err, re.escape(f"{prompts}:2: ") + message)
    assert files_of(tmp_path) == before


SAMPLING = {
    "temperature 1e-45": (["--temperature", "1e-45", "--seed", "0"],
                          r"--temperature: temperature must be 0 \(greedy\) or a finite number "
                          r">= 0.0001 \(got 1e-45\).*use 0 for greedy"),
    "greedy with top-k": (["--greedy", "--top-k", "5"],
                          r"--greedy \(or --temperature 0\) takes the most likely token, so "
                          "--top-k would be ignored; drop one or the other"),
    "temperature 0 with top-p": (["--temperature", "0", "--top-p", "0.9"],
                                 "so --top-p would be ignored"),
    "greedy with a temperature": (["--greedy", "--temperature", "0.7"],
                                  "--greedy takes the most likely token, so --temperature 0.7 "
                                  "would be ignored; drop one of the two"),
    "top-k past int64": (["--top-k", "9223372036854775808"],
                         r"--top-k must be an integer in \[0, 2\*\*31\)"),
    "seed + i past int64": (["--prompt", "Ho", "--seed", "9223372036854775807"],
                            r"--seed must be an integer in \[0, 2\*\*62\)"),
    "given twice": (["--max-new-tokens", "4", "--max-new-tokens", "1"],
                    "--max-new-tokens is given twice for generate; give it once"),
}  # fmt: skip


@pytest.mark.parametrize("case", [*NUMBERS, *SAMPLING])
def test_option_values_are_checked_before_anything_runs(case, models, tmp_path, capsys) -> None:
    """Numeric options, the device, and sampling settings the generator cannot honour."""
    args, message = {**NUMBERS, **SAMPLING}[case]
    output = tmp_path / "out.jsonl"
    code, _, err = generate(capsys, "--checkpoint", models["chat"], "--prompt", "Hi", *args,
                            "--output", output)  # fmt: skip
    assert code == 2
    assert_one_error(err, message)
    assert not output.exists()


BAD_CHATS = {
    "role typo": ([{"role": "usr", "content": "Hi"}],
                  "message 0 has role 'usr'; roles are .* Did you mean 'user'"),
    "content int": ([{"role": "user", "content": 5}],
                    'message 0 must be an object with a "role" string and a "content" string or '
                    "list of parts"),
    "empty": ([], '"messages" must be a non-empty list'),
    "not a list": ("Hi", '"messages" must be a non-empty list .* got "Hi"'),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_CHATS))
def test_bad_messages_name_file_and_line(case, models, tmp_path, capsys) -> None:
    messages, message = BAD_CHATS[case]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n" + json.dumps({"messages": messages}) + "\n")
    before = files_of(tmp_path)
    code, _, err = generate(capsys, "--checkpoint", models["chat"], "--prompts-file", prompts,
                            "--chat")  # fmt: skip
    assert code == 2
    assert_one_error(err, re.escape(f"{prompts}:2: ") + message)
    assert files_of(tmp_path) == before


def test_every_request_failing_writes_nothing_and_exits_1(models, tmp_path, capsys) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [1, 9999]}\n{"prompt_ids": []}\n')
    output = tmp_path / "out.jsonl"
    output.write_text("an earlier result\n")
    before = files_of(tmp_path)
    code, _, err = generate(capsys, "--checkpoint", models["chat"], "--prompts-file", prompts,
                            "--output", output, "--max-new-tokens", "3")  # fmt: skip
    assert code == 1
    assert_one_error(
        err,
        re.escape(f"error: 2 of 2 requests failed, so nothing was written; the first ({prompts}:1)")
        + ": prompt token ids \\[9999\\] are outside the vocabulary",
    )
    assert files_of(tmp_path) == before


def test_some_requests_failing_is_a_warning_and_their_records_say_why(
    models, tmp_path, capsys
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [5, 6]}\n{"prompt": "' + "fox " * 80 + '"}\n')
    output = tmp_path / "out.jsonl"
    code, _, err = generate(capsys, "--checkpoint", models["chat"], "--prompts-file", prompts,
                            "--prompt", "Hi", "--output", output,
                            "--max-new-tokens", "3")  # fmt: skip
    assert code == 0, err
    assert err.count("\n") == 1 and err.startswith("warning: 1 of 3 requests failed"), err
    assert f"the first ({prompts}:2): the prompt's" in err and "exceed the context" in err
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["finish_reason"] for r in records][2] == "error"
    assert "exceed the context of 64 tokens" in records[2]["error"]
    assert all(len(records[i]["tokens"]) == 3 for i in (0, 1))


def test_output_that_cannot_be_written_is_refused_first(models, tmp_path, capsys) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello"}\n')
    (tmp_path / "afile").write_text("mine")
    (tmp_path / "link.jsonl").symlink_to(prompts)
    in_file = tmp_path / "afile" / "out.jsonl"
    cases = {
        tmp_path / "sub" / ".." / "prompts.jsonl": "is the prompts file, which writing would",
        tmp_path / "link.jsonl": "is the prompts file",
        in_file: re.escape(f"Cannot create {in_file}: {tmp_path}/afile is a file, not a folder"),
        tmp_path / "afile" / "deeper" / "out.jsonl": "afile is a file, not a folder",
        tmp_path: "is a folder; give a file such as",
    }
    before = files_of(tmp_path)
    for output, message in cases.items():
        code, out, err = generate(capsys, "--checkpoint", models["chat"], "--prompts-file",
                                  prompts, "--output", output)  # fmt: skip
        assert code == 2 and out == "", out  # refused before the model ran
        assert_one_error(err, message)
    assert files_of(tmp_path) == before


def test_unwritable_output_folder_is_refused(models, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr("os.access", lambda path, mode: False)  # root may write anywhere
    code, _, err = generate(capsys, "--checkpoint", models["chat"], "--prompt", "Hi",
                            "--output", tmp_path / "out.jsonl")  # fmt: skip
    assert code == 2
    assert_one_error(err, f"the folder {tmp_path} is not writable")


def test_missing_prompts_file(models, tmp_path, capsys) -> None:
    code, _, err = generate(capsys, "--checkpoint", models["chat"], "--prompts-file",
                            tmp_path / "nope.jsonl")  # fmt: skip
    assert code == 2
    assert_one_error(err, "nope.jsonl does not exist or is not a file")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    code, _, err = generate(capsys, "--checkpoint", models["chat"], "--prompts-file",
                            tmp_path / "blank.jsonl")  # fmt: skip
    assert code == 2
    assert_one_error(err, "blank.jsonl holds no prompts")


def test_chat_prompts_are_the_template_rendering(models, tmp_path, capsys, monkeypatch) -> None:
    """--prompt texts become one user message, "messages" lines whole chats, both with the
    assistant's reply opened; requests stop at <|im_end|> as well as at eos."""
    requests = []

    class Recording(Generator):
        def generate(self, batch):
            requests.extend(batch)
            return super().generate(batch)

    monkeypatch.setattr(run, "Generator", Recording)
    chat = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": chat}) + "\n" + '{"prompt_ids": [5, 6]}\n')
    output = tmp_path / "out.jsonl"
    code, _, err = generate(capsys, "--checkpoint", models["chat"], "--chat", "--prompt",
                            "Hello there", "--prompts-file", prompts, "--greedy",
                            "--max-new-tokens", "4", "--output", output)  # fmt: skip
    assert code == 0, err
    tok = Tokenizer.from_file(models["chat"])
    expected = [
        tok.encode_chat(tok.apply_chat_template(messages, add_generation_prompt=True))
        for messages in ([{"role": "user", "content": "Hello there"}], chat)
    ]
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["prompt_ids"] for r in records] == [*expected, [5, 6]]
    assert tok.decode(records[0]["prompt_ids"]) == (
        "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    )
    end_of_turn = tok.backend.token_to_id("<|im_end|>")
    assert [r.params.stop_ids for r in requests] == [(tok.eos_id, end_of_turn)] * 3
    assert [r.prompt_ids for r in requests] == [*expected, [5, 6]]


def test_end_of_turn_is_found_for_any_template() -> None:
    tok = tokenizer(LLAMA3_STYLE)
    tok.backend.add_special_tokens(["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    tok = Tokenizer(tok.backend, EOS_TOKEN, BOS_TOKEN, chat_templates={"default": LLAMA3_STYLE})
    assert tok.stop_ids(chat=True) == (tok.eos_id, tok.backend.token_to_id("<|eot_id|>"))
    assert tok.stop_ids(chat=False) == (tok.eos_id,)
    ends_with_eos = "{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
    assert Tokenizer(tok.backend, EOS_TOKEN, chat_templates={"default": ends_with_eos}).stop_ids(
        chat=True
    ) == (tok.eos_id,)


def test_chat_needs_a_chat_template(models, capsys) -> None:
    code, _, err = generate(capsys, "--checkpoint", models["plain"], "--chat", "--prompt", "Hi")
    assert code == 2
    assert_one_error(err, "--chat needs a chat template, and the tokenizer in .* has none")
    code, _, err = generate(capsys, "--checkpoint", models["bare"], "--chat", "--prompt", "Hi")
    assert code == 2
    assert_one_error(err, "--chat needs the model's tokenizer, and the model folder has no")


def test_a_folder_of_the_other_kind_names_the_flag_that_reads_it(
    models, tmp_path, hf_checkpoint, capsys
) -> None:
    """A torchloom model folder given to --from-hf (generate, convert, train's
    --checkpoint.initial_load_hf) and a Hugging Face folder given to --checkpoint: one line
    saying which flag reads it; a config.json without model_type says so."""
    ours = models["plain"]
    says = f"{ours} is a torchloom model folder, not a Hugging Face one: generate reads it with "
    code, _, err = generate(capsys, "--from-hf", ours, "--prompt", "hi", "--device", "cpu")
    assert code == 2
    assert_one_error(err, re.escape(f"{says}--checkpoint {ours}, and `torchloom convert --from"))
    assert main(["convert", "--from-hf", str(ours), "--to", str(tmp_path / "out")]) == 2
    assert_one_error(capsys.readouterr().err, re.escape(says))
    train = ["train", "--recipe", "debug", "--checkpoint.initial_load_hf", str(ours),
             "--output.dir", str(tmp_path / "run")]  # fmt: skip
    assert main(train) == 2
    assert_one_error(capsys.readouterr().err, re.escape(says))
    assert not (tmp_path / "out").exists() and not (tmp_path / "run/config.json").exists()
    hf, _ = hf_checkpoint("llama")
    code, _, err = generate(capsys, "--checkpoint", hf, "--prompt", "hi", "--device", "cpu")
    assert code == 2
    assert_one_error(err, re.escape(f"{hf} is a Hugging Face model folder (model_type 'llama'); "
                                    f"pass it with --from-hf {hf}."))  # fmt: skip
    config = json.loads((hf / "config.json").read_text())
    del config["model_type"]
    (hf / "config.json").write_text(json.dumps(config))
    code, _, err = generate(capsys, "--from-hf", hf, "--prompt", "hi", "--device", "cpu")
    assert code == 2
    assert_one_error(err, re.escape(f"{hf / 'config.json'} has no model_type"))


def test_a_cache_that_cannot_fit_names_max_batch(models, capsys, monkeypatch) -> None:
    """A machine with 1 KiB available (the tiny model's cache of one 64-token slot is 16 KiB):
    one line naming --max-batch, not an allocation failure or an OOM kill."""
    from torchloom.generate import engine

    monkeypatch.setattr(engine, "available_memory", lambda device: 1024)
    code, _, err = generate(capsys, "--checkpoint", models["chat"], "--prompt", "Hi",
                            "--max-batch", "2", "--max-new-tokens", "8")  # fmt: skip
    assert code == 2
    assert_one_error(err, r"--max-batch 2: the cache of 1 requests of up to \d+ tokens needs "
                     r"0.0 MiB, but the cpu device has 0.0 MiB available; lower --max-batch or "
                     "--max-new-tokens.")  # fmt: skip


def test_a_prompt_too_long_for_the_model_does_not_size_the_cache(monkeypatch) -> None:
    """A request the generator refuses as too long (prompt + new tokens past the model's
    context) fails alone: the cache is sized by the longest request that fits, so the refused
    one cannot make every slot's cache the model's whole context (and the run fail for
    memory)."""
    from torchloom.generate import run

    model = build_model(CONFIG)
    model.init_weights(0)
    sizes = []

    class Recording(run.Generator):
        def __init__(self, *args, max_len, **kwargs) -> None:
            sizes.append(max_len)
            super().__init__(*args, max_len=max_len, **kwargs)

    monkeypatch.setattr(run, "Generator", Recording)
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    too_long = [5] * CONFIG.max_seq_len
    records = run.generate_records(model, None, [[1, 2, 3], too_long, [7, 8]], params, 3,
                                   verbose=False)  # fmt: skip
    assert sizes == [3 + 4]
    assert [r["finish_reason"] for r in records] == ["length", "error", "length"]
    assert "exceed the context" in records[1]["error"], records[1]
    assert "exceed the context of 64 tokens" in records[1]["error"]  # the model's, not the cache's
    # None fits: no generator (no cache) at all, every record says why.
    records = run.generate_records(model, None, [too_long], params, 1, verbose=False)
    assert sizes == [3 + 4] and records[0]["finish_reason"] == "error"
