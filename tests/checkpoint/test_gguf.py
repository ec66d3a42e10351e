"""`torchloom convert --from-gguf`: a tiny random llama written as a GGUF file (as llama.cpp
lays it out: q/k rows interleaved per head, a byte-level BPE tokenizer in the metadata) comes
out as a Hugging Face folder whose logits match transformers' reading of the file, with the
same tokenizer and chat template, or as a torchloom model folder; bad input is one line."""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest
import torch
import transformers

import torchloom
from torchloom.checkpoint.model_io import load_model
from torchloom.checkpoint.safetensors_io import iter_tensors
from torchloom.cli import main
from torchloom.data.chat import CHATML_TEMPLATE
from torchloom.data.tokenizer import BUILTIN_SPECIAL_TOKENS, Tokenizer, train_byte_level_bpe
from torchloom.models.llama3 import Llama3HFAdapter

gguf = pytest.importorskip("gguf", reason="needs the gguf package: pip install 'torchloom[gguf]'")
pytest.importorskip("accelerate", reason="transformers reads GGUF files only with accelerate")

TEXTS = [
    "def add(a, b):\n    return a + b  # sum",
    "  Leading spaces, tabs\tand ünïcödé: 日本語 🤖 12345!",
]
SIZES = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
             rope_theta=10000.0)  # fmt: skip


def llama_cpp_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """q/k rows in llama.cpp's order: each head's two rotated halves interleaved row by row
    (GGUF readers undo this to get transformers' "rotate half" layout back)."""
    out_dim, in_dim = weight.shape
    halves = weight.reshape(num_heads, 2, out_dim // num_heads // 2, in_dim)
    return halves.transpose(1, 2).reshape(out_dim, in_dim)


def gguf_name(hf_name: str) -> str:
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}  # fmt: skip
    stem = hf_name.removesuffix(".weight")
    if match := re.fullmatch(r"model\.layers\.(\d+)\.(.+)", stem):
        return f"blk.{match[1]}.{layer[match[2]]}.weight"
    return f"{names[stem]}.weight"


def write_gguf(path, model, backend, float_type="F32", arch="llama", rope_freqs=False) -> None:
    """``model`` (a transformers llama or qwen3) and ``backend`` (a byte-level BPE) as a GGUF
    file, with the metadata keys llama.cpp writes for the architecture and a "gpt2" tokenizer
    (SmolLM2's kind); ``rope_freqs``: with Llama 3.1's RoPE frequency factors."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny test llama")
    writer.add_file_type(0 if float_type == "F32" else 1)  # ALL_F32, MOSTLY_F16
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    vocab = sorted(backend.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1])
    merges = json.loads(backend.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([token for token, _ in vocab])
    special = gguf.TokenType.CONTROL, gguf.TokenType.NORMAL
    writer.add_token_types([special[t not in BUILTIN_SPECIAL_TOKENS] for t, _ in vocab])
    writer.add_token_merges([" ".join(pair) for pair in merges])
    writer.add_bos_token_id(backend.token_to_id("<|im_start|>"))
    writer.add_eos_token_id(backend.token_to_id("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            tensor = llama_cpp_rows(tensor, heads)
        array = tensor.numpy()
        if tensor.ndim == 2 and float_type == "F16":  # llama.cpp keeps norms in F32
            array = array.astype(np.float16)
        writer.add_tensor(gguf_name(name), array)
    if rope_freqs:
        writer.add_tensor("rope_freqs.weight", np.ones(cfg.head_dim // 2, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """``make(float_type, tie, arch)``: (GGUF file, the transformers model it holds, its
    tokenizer), written once per module."""
    backend = train_byte_level_bpe(TEXTS * 20, 320)
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    made = {}

    def make(float_type="F32", tie=False, arch="llama", rope_freqs=False):
        key = (float_type, tie, arch, rope_freqs)
        if key not in made:
            # transformers reads no head_dim from a qwen3 file: Qwen3Config's default (128) holds.
            qwen = {"head_dim": 128} if arch == "qwen3" else {}
            config = (transformers.Qwen3Config if qwen else transformers.LlamaConfig)(
                **SIZES, **qwen, vocab_size=vocab_size, tie_word_embeddings=tie
            )
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config).eval()
            with torch.no_grad():  # random norms too, so every weight matters
                for name, param in model.named_parameters():
                    noise = torch.randn(param.shape)
                    param.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)
            path = tmp_path_factory.mktemp("gguf") / f"{arch}.gguf"
            write_gguf(path, model, backend, float_type, arch, rope_freqs)
            made[key] = path, model, backend
        return made[key]

    return make


def convert(capsys, *args) -> None:
    code = main(["convert", *map(str, args)])
    captured = capsys.readouterr()
    assert code == 0, captured.err


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gguf_to_hf_matches_transformers_logits_and_tokenizer(
    arch, tmp_path, tiny_gguf, capsys, logits_parity
):
    path, original, backend = tiny_gguf(arch=arch)
    out = tmp_path / "hf"
    convert(capsys, "--from-gguf", path, "--to-hf", out)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"
    ]  # fmt: skip
    # An F32 file keeps its values exactly: the original model's tensors, q/k rows restored.
    written = dict(iter_tensors(out))
    assert written.keys() == original.state_dict().keys()
    for name, tensor in original.state_dict().items():
        assert written[name].dtype == torch.float32 and torch.equal(written[name], tensor), name

    ours = torchloom.from_hf(out)
    location = {"pretrained_model_name_or_path": str(path.parent), "gguf_file": str(path)}
    theirs = transformers.AutoModelForCausalLM.from_pretrained(**location, dtype=torch.float32)
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokens = torch.randint(0, ours.config.vocab_size, (2, 48), generator=torch.Generator())
    with torch.no_grad():
        logits = ours(tokens)
        logits_parity("torchloom vs transformers on the GGUF", logits, theirs.eval()(tokens).logits)
        logits_parity("torchloom vs transformers on the folder", logits, exported(tokens).logits)

    tokenizer = Tokenizer.from_file(out)
    from_file = transformers.AutoTokenizer.from_pretrained(**location)
    from_folder = transformers.AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == backend.encode(text).ids, text
        assert ids == from_file(text, add_special_tokens=False).input_ids, text
        assert ids == from_folder(text, add_special_tokens=False).input_ids, text
        assert tokenizer.decode(ids) == text
    chat = [{"role": "user", "content": TEXTS[0]}, {"role": "assistant", "content": "ok"}]
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    assert rendered == from_file.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
    assert (
        tokenizer.encode_chat(rendered) == from_file(rendered, add_special_tokens=False).input_ids
    )
    assert (tokenizer.bos_id, tokenizer.eos_id) == (2, 3)  # <|im_start|>, <|im_end|>
    hf_config = json.loads((out / "config.json").read_text())
    assert (hf_config["bos_token_id"], hf_config["eos_token_id"]) == (2, 3)


def test_f16_gguf_to_torchloom_folder_and_bf16(tmp_path, tiny_gguf, capsys) -> None:
    """A tied F16 file: its float type by default, --dtype when asked; --to gives a torchloom
    model folder, --overwrite replaces an output."""
    path, original, _ = tiny_gguf("F16", tie=True)
    convert(capsys, "--from-gguf", path, "--to", tmp_path / "tl")
    _, family, config = load_model(tmp_path / "tl")
    assert family == "llama3" and config.tie_embeddings
    hf_tensors = original.state_dict()
    for name, tensor in iter_tensors(tmp_path / "tl"):  # every one in the file's F16
        expected = hf_tensors[Llama3HFAdapter().to_hf_name(name)].half()
        assert tensor.dtype == torch.float16 and torch.equal(tensor, expected), name
    assert Tokenizer.from_file(tmp_path / "tl").chat_template == CHATML_TEMPLATE

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "old.txt").write_text("old")
    convert(capsys, "--from-gguf", path, "--to-hf", tmp_path / "hf", "--dtype", "bf16",
            "--overwrite")  # fmt: skip
    written = dict(iter_tensors(tmp_path / "hf"))
    assert "lm_head.weight" not in written and not (tmp_path / "hf" / "old.txt").exists()
    assert {t.dtype for t in written.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"


ERRORS = {
    "missing": (["--from-gguf", "{tmp}/nope.gguf", "--to-hf", "{tmp}/o"], "GGUF file .*nope.gguf does not exist"),
    "not gguf": (["--from-gguf", "{tmp}/busy/keep.txt", "--to-hf", "{tmp}/o"], "is not a GGUF file"),
    "no family": (["--from-gguf", "{tmp}/qwen2.gguf", "--to-hf", "{tmp}/o"], "'qwen2' model, which torchloom has no family for"),
    "unreadable": (["--from-gguf", "{tmp}/rwkv7.gguf", "--to-hf", "{tmp}/o"], "'rwkv7' model, which transformers cannot read"),
    "rope scaling": (["--from-gguf", "{tmp}/rope.gguf", "--to-hf", "{tmp}/o"], "scales RoPE .*rope_freqs.*Hugging Face release"),
    "exists": (["--from-gguf", "{tmp}/tiny.gguf", "--to-hf", "{tmp}/busy"], "not empty.*--overwrite"),
    "holds it": (["--from-gguf", "{tmp}/tiny.gguf", "--to-hf", "{tmp}"], "contains the GGUF file"),
    "two outputs": (["--from-gguf", "{tmp}/tiny.gguf", "--to-hf", "{tmp}/o", "--to", "{tmp}/out"], "convert needs either"),
    "tokenizer": (["--from-gguf", "{tmp}/tiny.gguf", "--to", "{tmp}/o", "--tokenizer", "{tmp}"], "--from-gguf writes the file's tokenizer"),
    "no deps": (["--from-gguf", "{tmp}/tiny.gguf", "--to-hf", "{tmp}/o"], r"needs gguf \(not installed\): pip install 'torchloom\[gguf\]'"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_is_one_error_line(case, tmp_path, tiny_gguf, capsys, monkeypatch) -> None:
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    (tmp_path / "tiny.gguf").write_bytes(tiny_gguf()[0].read_bytes())
    for arch in ("qwen2", "rwkv7"):  # an architecture torchloom / transformers cannot read
        (tmp_path / f"{arch}.gguf").symlink_to(tiny_gguf(arch=arch)[0])
    (tmp_path / "rope.gguf").symlink_to(tiny_gguf(rope_freqs=True)[0])
    if case == "no deps":
        monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    args, message = ERRORS[case]
    assert main(["convert", *(a.format(tmp=tmp_path) for a in args)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert re.search(message, err), err
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine"
    assert not (tmp_path / "o").exists() and not (tmp_path / "out").exists()
    assert not list(tmp_path.glob("*.partial"))
