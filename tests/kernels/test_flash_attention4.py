"""The ``fa4`` attention slot (kernels/flash_attention4.py): its custom ops and PyTorch reference
against the SDPA backend on the CPU, its refusals, training through it, and on a GPU with
flash-attn-4 installed the kernels against SDPA."""

from __future__ import annotations

import json
import re
import sys
from unittest import mock

import pytest
import torch

from torchloom.cli import main, resolve_job
from torchloom.config.errors import ConfigError
from torchloom.kernels import flash_attention4 as fa4
from torchloom.kernels.attention_mask import AttentionMask
from torchloom.models import ATTENTION_BACKENDS
from torchloom.models.components.attention import (
    Attention,
    sdpa_attention,
    shared_attention_input,
)
from torchloom.train.trainer import Trainer


def _qkv(B: int, T: int, H: int, K: int, d: int, **kwargs) -> list[torch.Tensor]:
    """q, k, v as the backends take them: [B, heads, T, d] (transposed views of [B, T, heads, d],
    as the model hands them over)."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(B, T, heads, d, generator=gen).to(**kwargs).transpose(1, 2).requires_grad_()
            for heads in (H, K, K)]  # fmt: skip


def _assert_same_with_gradients(got: torch.Tensor, want: torch.Tensor, views) -> None:
    """``got`` equals ``want``, and so do their gradients into ``views`` under one random
    upstream gradient."""
    torch.testing.assert_close(got, want)
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(torch.autograd.grad(got, views, grad),
                               torch.autograd.grad(want, views, grad))  # fmt: skip


def test_the_ops_are_well_formed_and_match_sdpa_on_cpu() -> None:
    """torch.library.opcheck (schema, fake forms, the registered backward, compile's view), then
    the backend's output and gradients against the SDPA backend (GQA: 4 query heads, 2 kv)."""
    assert ATTENTION_BACKENDS["fa4"] is fa4.fa4_attention
    q, k, v = (t.detach().transpose(1, 2).requires_grad_() for t in _qkv(2, 7, 4, 2, 8))
    torch.library.opcheck(fa4.fa4_fwd, (q, k, v))
    views = _qkv(2, 7, 4, 2, 8)
    _assert_same_with_gradients(
        fa4.fa4_attention(*views, None), sdpa_attention(*views, None), views
    )


def test_value_heads_narrower_than_key_heads_on_cpu() -> None:
    """MLA's shape (DeepSeek-V3: 192-wide queries and keys, 128-wide values), scaled down."""
    gen = torch.Generator().manual_seed(2)
    views = [torch.randn(2, 6, heads, d, generator=gen).transpose(1, 2).requires_grad_()
             for heads, d in ((4, 12), (2, 12), (2, 8))]  # fmt: skip
    got, want = fa4.fa4_attention(*views, None), sdpa_attention(*views, None)
    assert got.shape == (2, 4, 6, 8)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), views),
                               torch.autograd.grad(want.sum(), views))  # fmt: skip


def test_compiled_through_the_ops_on_cpu() -> None:
    """torch.compile traces the ops as opaque calls (fake forms) and runs their backward."""
    views = _qkv(1, 5, 2, 1, 4)
    eager = fa4.fa4_attention(*views, None)
    compiled = torch.compile(fa4.fa4_attention, backend="aot_eager", fullgraph=True)(*views, None)
    torch.testing.assert_close(compiled, eager)
    compiled.sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in views)


DOC_IDS = torch.tensor([[0, 0, 0, 1, 1, 2, 2], [3, 3, 3, 3, 3, 3, 3]])
"""Two rows of 7 tokens: three documents (3, 2, 2 tokens), then one filling its row."""


def test_packed_documents_match_sdpa_on_cpu() -> None:
    """Packed rows: each document causal on its own through the varlen op, as SDPA's document
    mask computes, forward and backward; the documents' starts as flash-attn's cu_seqlens (a
    row's start always starts one, even where the id runs on from the row before)."""
    documents = fa4.fa4_documents(DOC_IDS)
    assert documents.cu_seqlens.dtype == torch.int32
    assert documents.cu_seqlens.tolist() == [0, 3, 5, 7, 14]
    runs_on = torch.tensor([[5, 5, 6], [6, 6, 6]])  # document 6 crosses the row boundary
    assert fa4.fa4_documents(runs_on).cu_seqlens.tolist() == [0, 2, 3, 6]
    q, k, v = (t.detach().transpose(1, 2).reshape(14, *t.shape[1:2], -1).requires_grad_()
               for t in _qkv(2, 7, 4, 2, 8))  # fmt: skip
    torch.library.opcheck(fa4.fa4_varlen_fwd, (q, k, v, documents.cu_seqlens, 7))
    views = _qkv(2, 7, 4, 2, 8)
    for docs in (DOC_IDS, documents):  # ids (built here) or what the model built once
        got, want = fa4.fa4_attention(*views, docs), sdpa_attention(*views, DOC_IDS)
        _assert_same_with_gradients(got, want, views)


def test_packed_documents_compile_to_one_graph_on_cpu() -> None:
    """The documents' count is data: the compiled backend takes any count without recompiling
    (cu_seqlens is marked dynamic where it is built), and runs the varlen op's backward."""
    attend = torch.compile(fa4.fa4_attention, backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for doc_ids in (DOC_IDS, torch.zeros(2, 7, dtype=torch.long), torch.arange(14).view(2, 7)):
            views = _qkv(2, 7, 4, 2, 8)
            documents = fa4.fa4_documents(doc_ids)
            got, want = attend(*views, documents), sdpa_attention(*views, doc_ids)
            _assert_same_with_gradients(got, want, views)


def test_the_model_builds_the_documents_once_per_forward() -> None:
    """``shared_attention_input`` hands fa4 layers ``Fa4Documents`` (built once, not per layer),
    and every other kernel the ids."""
    fa4_layer = Attention(16, 4, 2, 4, backend="fa4")
    sdpa_layer = Attention(16, 4, 2, 4, backend="sdpa")
    built = shared_attention_input([fa4_layer, fa4_layer], DOC_IDS, 7, torch.device("cpu"))
    assert isinstance(built, fa4.Fa4Documents)
    assert shared_attention_input([sdpa_layer], DOC_IDS, 7, torch.device("cpu")) is DOC_IDS
    assert shared_attention_input([fa4_layer], None, 7, torch.device("cpu")) is None


def test_refusals() -> None:
    with pytest.raises(ValueError, match=r"attn_backend 'fa4' computes causal.*window 4"):
        Attention(16, 4, 2, 4, backend="fa4", mask=AttentionMask(window=4))
    with (
        mock.patch.dict(sys.modules, {"flash_attn": None}),
        pytest.raises(  # not installed
            ConfigError, match="needs flash-attn-4: pip install flash-attn-4"
        ),
    ):
        fa4.flash_interface()
    fa4.check_fa4_device("fa4", torch.device("cpu"))  # the CPU runs the reference
    fa4.check_fa4_device("sdpa", torch.device("cuda"))  # another backend: nothing to check


COMMON = ["--recipe", "debug", "--metrics.tensorboard", "false", "--training.sample_tokens", "0",
          "--checkpoint.save_final_model", "false", "--training.steps", "3",
          "--training.device", "cpu"]  # fmt: skip


def test_cuda_graph_refuses_packed_documents() -> None:
    """The documents' starts are read back each step, which a captured step cannot do."""
    graphed = [*COMMON[:-1], "auto", "--model.attn_backend", "fa4", "--training.cuda_graph", "true"]
    with pytest.raises(ConfigError, match="cannot capture fa4 over packed documents"):
        resolve_job(graphed)
    resolve_job([*graphed, "--data.document_mask", "false"])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            [
                "--model.name",
                "qwen3",
                "--model.flavor",
                "debug",
                "--model.overrides",
                '{"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16, '
                '"num_layers": 2}',
            ],
            r"attn_backend 'fa4' computes causal.*window 16",
        ),
        (["--recipe", "deepseek_v4_debug"], "deepseek_v4's attention .* would not be used"),
        (["--parallel.cp", "2"], "--parallel.cp attends through its own kernel"),
    ],
    ids=["sliding-window", "deepseek_v4", "cp"],
)
def test_what_fa4_cannot_run_is_one_line(tmp_path, capsys, extra, message) -> None:
    """Each a one-line error at the CLI (exit 2), train and --dry-run alike, no traceback."""
    recipe = extra[1] if extra[0] == "--recipe" else "debug"
    extra = extra[2:] if extra[0] == "--recipe" else extra
    args = ["--recipe", recipe, *COMMON[2:], "--model.attn_backend", "fa4", *extra]
    runs = [["--output.dir", str(tmp_path / "run")], ["--dry-run"]]
    if "--parallel.cp" in extra:  # needs two ranks: the dry run simulates them
        runs = [["--dry-run", "--world-size", "2"]]
    for run in runs:
        assert main(["train", *args, *run]) == 2
        err = capsys.readouterr().err
        assert re.search(message, err) and "Traceback" not in err, err


@pytest.mark.parametrize(
    "data",
    [
        ["--data.document_mask", "false"],
        [],
        ["--data.format", "chat", "--data.sources", '["builtin:chat_tasks"]'],
    ],
    ids=["one-document-rows", "packed-documents", "chat"],
)
def test_trains_with_the_losses_of_sdpa_on_cpu(tmp_path, capsys, data) -> None:
    """Three steps through fa4's reference give SDPA's losses: rows of one stream, packed
    documents (the varlen op) and packed conversations; and the dry run estimates each one's
    activations."""
    losses = {}
    for backend in ("sdpa", "fa4"):
        args = [*COMMON, "--model.attn_backend", backend, *data]
        _, job = resolve_job([*args, "--output.dir", str(tmp_path / backend)])
        Trainer(job).train()
        capsys.readouterr()
        assert main(["train", *args, "--dry-run"]) == 0
        assert "with activations" in capsys.readouterr().out
        lines = (tmp_path / backend / "metrics.jsonl").read_text().splitlines()
        losses[backend] = [r["loss"] for r in map(json.loads, lines) if "loss" in r]
        config = json.loads((tmp_path / backend / "config.json").read_text())
        assert config["model"]["attn_backend"] == backend
    assert len(losses["fa4"]) == 3
    assert losses["fa4"] == pytest.approx(losses["sdpa"], rel=1e-5), losses


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["qwen3_next_debug", "kimi_linear_debug", "qwen3_vl_debug"])
def test_other_families_train_over_packed_documents_with_the_losses_of_sdpa_on_cpu(
    tmp_path, recipe
):
    """A hybrid's linear-attention layers (Gated DeltaNet, KDA) read the ids that fa4's
    ``Fa4Documents`` carries, beside its full-attention layers' varlen op; a vision-language
    model's packed picture chats go through the varlen op too: two steps over packed rows give
    SDPA's losses."""
    losses = {}
    for backend in ("sdpa", "fa4"):
        args = ["--recipe", recipe, *COMMON[2:], "--training.steps", "2",
                "--model.attn_backend", backend, "--output.dir", str(tmp_path / backend)]  # fmt: skip
        _, job = resolve_job(args)
        Trainer(job).train()
        lines = (tmp_path / backend / "metrics.jsonl").read_text().splitlines()
        losses[backend] = [r["loss"] for r in map(json.loads, lines) if "loss" in r]
    assert len(losses["fa4"]) == 2
    assert losses["fa4"] == pytest.approx(losses["sdpa"], rel=1e-5), losses


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flash_attention4_matches_sdpa_on_gpu(head_dim: int) -> None:
    """FlashAttention 4's kernels (bf16, causal GQA at 1,024 tokens) against SDPA's, forward and
    backward, within bf16 rounding; and through the fp32 reference, further from neither."""
    pytest.importorskip(
        "flash_attn.cute", reason="flash-attn-4 is not installed (pip install flash-attn-4)"
    )
    device = torch.device("cuda")
    if torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("FlashAttention 4 needs sm_90 or newer")
    fa4.check_fa4_device("fa4", device)
    views = _qkv(2, 1024, 8, 2, head_dim, device=device, dtype=torch.bfloat16)
    got, want = fa4.fa4_attention(*views, None), sdpa_attention(*views, None)
    grad = torch.randn_like(got)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    for g, w in zip(torch.autograd.grad(got, views, grad), torch.autograd.grad(want, views, grad)):
        torch.testing.assert_close(g, w, atol=5e-2, rtol=5e-2)
    reference, _ = fa4.reference_forward(*(t.detach().transpose(1, 2) for t in views))
    error = (got.transpose(1, 2).float() - reference.float()).abs().max()
    assert error <= (want.transpose(1, 2).float() - reference.float()).abs().max() * 2 + 1e-3


@pytest.mark.gpu
def test_flash_attention4_packed_documents_match_sdpa_on_gpu() -> None:
    """FlashAttention 4's varlen kernels over packed rows (documents of 1 to 700 tokens, one
    crossing no row: a row's start starts a document) against SDPA under the document mask,
    forward and backward, within bf16 rounding."""
    pytest.importorskip(
        "flash_attn.cute", reason="flash-attn-4 is not installed (pip install flash-attn-4)"
    )
    device = torch.device("cuda")
    if torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("FlashAttention 4 needs sm_90 or newer")
    lengths = [[700, 1, 300, 23], [1024], [100, 400, 524]]
    doc_ids = torch.cat([torch.repeat_interleave(torch.arange(len(row)) + 10 * i,
                                                 torch.tensor(row)) for i, row in enumerate(lengths)])  # fmt: skip
    doc_ids = doc_ids.view(3, 1024).to(device)
    views = _qkv(3, 1024, 8, 2, 128, device=device, dtype=torch.bfloat16)
    got, want = fa4.fa4_attention(*views, doc_ids), sdpa_attention(*views, doc_ids)
    grad = torch.randn_like(got)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    for g, w in zip(torch.autograd.grad(got, views, grad), torch.autograd.grad(want, views, grad)):
        torch.testing.assert_close(g, w, atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["one-document-rows", "packed-documents"])
def test_compiled_training_through_flash_attention4_on_gpu(tmp_path, packed) -> None:
    """Three compiled bf16 steps of the debug model through fa4 (rows of one stream, or packed
    documents through the varlen kernels) land within bf16 rounding of the same steps through
    SDPA (the kernels differ, so not bitwise)."""
    pytest.importorskip(
        "flash_attn.cute", reason="flash-attn-4 is not installed (pip install flash-attn-4)"
    )
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("FlashAttention 4 needs sm_90 or newer")
    losses = {}
    for backend in ("sdpa", "fa4"):
        args = [*COMMON[:-1], "cuda", "--compile.enabled", "true", "--model.attn_backend", backend,
                "--data.document_mask", str(packed).lower(), "--output.dir",
                str(tmp_path / backend)]  # fmt: skip
        _, job = resolve_job(args)
        Trainer(job).train()
        lines = (tmp_path / backend / "metrics.jsonl").read_text().splitlines()
        losses[backend] = [r["loss"] for r in map(json.loads, lines) if "loss" in r]
    print(losses)
    assert len(losses["fa4"]) == 3
    assert losses["fa4"] == pytest.approx(losses["sdpa"], abs=2e-2), losses
