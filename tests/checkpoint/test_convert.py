"""`torchloom convert` both ways: exact tensors, transformers loading our exports with the same
logits, bf16 export, the error lines, and streaming memory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors import safe_open
from tokenizers import Tokenizer, models, pre_tokenizers

from torchloom.checkpoint.model_io import parameter_shapes, save_model
from torchloom.checkpoint.safetensors_io import iter_tensors, write_tensors
from torchloom.cli import main
from torchloom.models import RopeConfig, TransformerConfig, build_model
from torchloom.models.llama3 import LLAMA3_FLAVORS, Llama3HFAdapter
from torchloom.models.qwen3 import QWEN3_FLAVORS

QWEN_TINY = {"head_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}


def add_tokenizer(folder) -> None:
    """A word-level tokenizer with an HF tokenizer_config.json and a chat template beside it."""
    vocab = {"<s>": 0, "</s>": 1, "hello": 2, "world": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="hello"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )


def convert(capsys, *args: str) -> str:
    code = main(["convert", *map(str, args)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


@pytest.mark.parametrize("case", ["llama untied sharded", "qwen3 tied"])
def test_from_hf_then_to_hf_gives_the_original_tensors(case, tmp_path, hf_checkpoint, capsys):
    if case.startswith("llama"):
        path, _ = hf_checkpoint("llama", max_shard_size="40KB")
    else:
        path, _ = hf_checkpoint("qwen3", tie_word_embeddings=True, **QWEN_TINY)
    add_tokenizer(path)
    out = convert(capsys, "--from-hf", path, "--to", tmp_path / "tl", "--max-shard-size", "50KB")
    assert "wrote" in out and (tmp_path / "tl" / "model.safetensors.index.json").exists()
    convert(capsys, "--from", tmp_path / "tl", "--to-hf", tmp_path / "back")
    original, back = dict(iter_tensors(path)), dict(iter_tensors(tmp_path / "back"))
    assert back.keys() == original.keys()  # a tied checkpoint has no lm_head either way
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "back" / name).read_bytes() == (path / name).read_bytes()
    hf_config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (hf_config["bos_token_id"], hf_config["eos_token_id"]) == (0, 1)


def random_model(family: str, cfg: TransformerConfig):
    model = build_model(cfg).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)
    return model


EXPORTS = {
    "llama3 yarn untied": ("llama3", TransformerConfig(
        rope=RopeConfig(scaling="yarn", factor=4.0, original_max_seq_len=64), max_seq_len=256)),
    "llama3 llama3-rope tied": ("llama3", TransformerConfig(
        rope=RopeConfig(theta=5e5, scaling="llama3", factor=4.0, high_freq_factor=8.0,
                        original_max_seq_len=64), tie_embeddings=True, max_seq_len=256)),
    "qwen3 tied": ("qwen3", QWEN3_FLAVORS["debug"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(EXPORTS))
def test_export_loads_in_transformers_with_the_same_logits(case, tmp_path, capsys, logits_parity):
    family, cfg = EXPORTS[case]
    model = random_model(family, cfg)
    save_model(model, family, cfg, tmp_path / "model")
    convert(capsys, "--from", tmp_path / "model", "--to-hf", tmp_path / "hf")
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", attn_implementation="eager"
    ).eval()
    assert "lm_head.weight" not in dict(iter_tensors(tmp_path / "hf")) or not cfg.tie_embeddings
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits_parity(f"export {case}", model(tokens), reference(tokens).logits)


def test_bf16_export_writes_bf16(tmp_path, capsys) -> None:
    cfg = LLAMA3_FLAVORS["debug"]
    model = random_model("llama3", cfg)
    save_model(model, "llama3", cfg, tmp_path / "model")
    convert(capsys, "--from", tmp_path / "model", "--to-hf", tmp_path / "hf", "--dtype", "bf16")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}  # noqa: SIM118
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto")
    assert reference.dtype == torch.bfloat16


ERRORS = {
    "missing source": (["--from-hf", "{tmp}/nope", "--to", "{tmp}/out"], "{tmp}/nope does not exist"),
    "a file": (["--from-hf", "{tmp}/hf/config.json", "--to", "{tmp}/out"], "config.json is a file, not a folder; pass the folder that holds it \\({tmp}/hf\\)"),
    "no direction": (["--from-hf", "{tmp}/hf"], "convert needs either --from-hf HF_DIR --to OUT_DIR"),
    "mixed": (["--from", "{tmp}/m", "--to-hf", "{tmp}/o", "--to", "{tmp}/x"], "convert needs either"),
    "not empty": (["--from-hf", "{tmp}/hf", "--to", "{tmp}/busy"], "busy is not empty; .*--overwrite"),
    "dtype": (["--from-hf", "{tmp}/hf", "--to", "{tmp}/o", "--dtype", "fp8"], "Unknown dtype 'fp8'"),
    "typo": (["--from_hf", "{tmp}/hf", "--to", "{tmp}/o"], "Unexpected argument '--from_hf'.*'--from-hf'"),
    "twice": (["--from-hf", "{tmp}/hf", "--to", "{tmp}/o", "--to={tmp}/p"], "--to is given twice for convert; give it once"),
    "size": (["--from-hf", "{tmp}/hf", "--to", "{tmp}/o", "--max-shard-size", "big"], "2GB or 500MB"),
    "tokenizer": (["--from-hf", "{tmp}/hf", "--to", "{tmp}/o", "--tokenizer", "{tmp}"], "--tokenizer goes with --to-hf"),
    "not ours": (["--from", "{tmp}/hf", "--to-hf", "{tmp}/o"], "hf is a Hugging Face model folder .*; pass it with --from-hf"),
    "value": (["--from-hf"], "--from-hf needs a value"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_is_one_error_line(case, tmp_path, hf_checkpoint, capsys) -> None:
    hf_checkpoint("llama")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    args, message = ERRORS[case]
    assert main(["convert", *(a.format(tmp=tmp_path) for a in args)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert re.search(message.format(tmp=tmp_path), err), err
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine"
    assert not (tmp_path / "o").exists() and not (tmp_path / "out").exists()


def test_overwrite_replaces_a_folder(tmp_path, hf_checkpoint, capsys) -> None:
    path, _ = hf_checkpoint("llama")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("old")
    convert(capsys, "--from-hf", path, "--to", tmp_path / "out", "--overwrite")
    assert (
        not (tmp_path / "out" / "old.txt").exists() and (tmp_path / "out" / "config.json").exists()
    )


_MEASURE = """
import json, sys
from torchloom.checkpoint.convert import convert_from_hf, convert_to_hf
from torchloom.checkpoint.model_io import parameter_shapes
from torchloom.models import TransformerConfig
def status(key): return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))
parameter_shapes("llama3", TransformerConfig())  # the first model build imports more of torch
# Importing torch peaks above the RSS it settles at: restart the peak (VmHWM) from here, which
# getrusage's ru_maxrss cannot do.
open("/proc/self/clear_refs", "w").write("5")
base = status("VmRSS:")
src, mid, out, shard = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
convert_from_hf(src, mid, max_shard_bytes=shard)
convert_to_hf(mid, out, max_shard_bytes=shard)
print(json.dumps({"base": base, "peak": status("VmHWM:")}))
"""


def test_convert_streams_with_memory_well_below_the_checkpoint_size(tmp_path) -> None:
    """Both directions on a ~110 MiB fp32 checkpoint in 16 MiB shards, in a fresh process."""
    cfg = TransformerConfig(vocab_size=4096, dim=512, num_layers=8, num_heads=8, num_kv_heads=4,
                            ffn_dim=1536, max_seq_len=512)  # fmt: skip
    adapter, shard = Llama3HFAdapter(), 16 * 2**20
    generator = torch.Generator().manual_seed(0)
    hf = tmp_path / "hf"
    hf.mkdir()
    tensors = (
        (adapter.to_hf_name(name), torch.rand(shape, generator=generator))
        for name, shape in parameter_shapes("llama3", cfg).items()
    )
    size = write_tensors(hf, tensors, max_shard_bytes=shard).total_bytes
    (hf / "config.json").write_text(json.dumps(adapter.config_to_hf(cfg)))
    cmd = [sys.executable, "-c", _MEASURE, hf, tmp_path / "tl", tmp_path / "back", str(shard)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rss = json.loads(proc.stdout.splitlines()[-1])
    growth = rss["peak"] - rss["base"]
    print(
        f"convert {size / 2**20:.0f} MiB both ways in {shard / 2**20:.0f} MiB shards: peak RSS "
        f"growth {growth / 2**20:.0f} MiB ({growth / size:.2f}x the checkpoint)"
    )
    assert growth < 0.5 * size and growth < 3 * shard
    assert len(list((tmp_path / "back").glob("*.safetensors"))) > 5
