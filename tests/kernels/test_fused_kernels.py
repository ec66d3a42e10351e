"""Fused Triton kernels (RMSNorm, RoPE, SwiGLU) against their PyTorch references.

On CPU the public ``*_fused`` ops are the references: checked bitwise, alone and through a whole
model. The Triton kernels themselves run in Triton's interpreter, all in one subprocess (this
file run as a script with TRITON_INTERPRET=1, which Triton reads when it is imported). On a GPU
the compiled kernels get the same checks, plus batch invariance and torch.compile.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from torchloom.config.errors import ConfigError
from torchloom.kernels.rmsnorm import rms_norm, rms_norm_fused, rms_norm_triton
from torchloom.kernels.rope import apply_rotary, apply_rotary_fused, apply_rotary_triton
from torchloom.kernels.swiglu import swiglu, swiglu_fused, swiglu_triton
from torchloom.kernels.triton_support import use_triton
from torchloom.models import Decoder, ModelConfig, TransformerConfig, resolve_model_config
from torchloom.models.components.decoder import Block
from torchloom.models.components.norms import TritonRMSNorm
from torchloom.models.components.rope import RotaryEmbedding
from torchloom.parallel.config import ParallelConfig
from torchloom.train.job import JobConfig
from torchloom.train.loss import CrossEntropy

TINY = TransformerConfig(
    vocab_size=97, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=48, qk_norm=True
)
TRITON_SLOTS = {"norm_impl": "triton", "rope_impl": "triton", "mlp_impl": "triton"}
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # atol = rtol, by activation dtype
Op = Callable[..., torch.Tensor]


def _randn(*shape: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    return torch.randn(shape, dtype=dtype, device=device, requires_grad=dtype.is_floating_point)


class Case(NamedTuple):
    name: str
    triton_op: Op  # the Triton kernels on any device (CPU: under the interpreter)
    fused: Op  # the public op: Triton on CUDA, the reference elsewhere
    reference: Op
    inputs: tuple


def _cases(device: str) -> list[Case]:
    """Odd widths (not powers of two), single tokens, fp32 and bf16 activations, fp32 and bf16
    norm weights, more heads than one RoPE program takes, cos/sin whose two halves differ."""
    cases = []
    for x_dtype, w_dtype, shape in [
        (torch.float32, torch.float32, (3, 5, 37)),
        (torch.float32, torch.float32, (2, 1, 1000)),
        (torch.bfloat16, torch.float32, (1, 1, 64)),
        (torch.bfloat16, torch.bfloat16, (7, 100)),
    ]:
        inputs = (
            _randn(*shape, dtype=x_dtype, device=device),
            _randn(shape[-1], dtype=w_dtype, device=device),
            1e-6,
        )
        name = f"rms_norm {x_dtype} x {w_dtype} {shape}"
        cases.append(Case(name, rms_norm_triton, rms_norm_fused, rms_norm, inputs))
    for dtype in (torch.float32, torch.bfloat16):
        for B, T, H, d in [(2, 5, 3, 10), (1, 1, 20, 64), (3, 2, 1, 2)]:
            angles = torch.randn(B, T, d, device=device) * 10
            inputs = (_randn(B, T, H, d, dtype=dtype, device=device), angles.cos(), angles.sin())
            name = f"apply_rotary {dtype} {(B, T, H, d)}"
            cases.append(Case(name, apply_rotary_triton, apply_rotary_fused, apply_rotary, inputs))
        for shape in [(3, 7, 37), (1, 1, 1), (2, 1500)]:
            inputs = (
                _randn(*shape, dtype=dtype, device=device),
                _randn(*shape, dtype=dtype, device=device),
            )
            cases.append(
                Case(f"swiglu {dtype} {shape}", swiglu_triton, swiglu_fused, swiglu, inputs)
            )
    return cases


def _forward_backward(op: Op, inputs: tuple, grad_seed: int = 0) -> list[torch.Tensor]:
    """[output, gradient of every input that requires one] for a fixed random output gradient."""
    out = op(*inputs)
    gen = torch.Generator(device=out.device).manual_seed(grad_seed)
    grad_out = torch.randn(out.shape, generator=gen, device=out.device).to(out.dtype)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return [out.detach(), *torch.autograd.grad(out, leaves, grad_out)]


def check_kernels_against_references(device: str) -> list[str]:
    """Forward and backward of every Triton op against its reference; a line per case with the
    largest difference. Raises AssertionError naming the case and the tensor on a mismatch."""
    torch.manual_seed(0)
    lines = []
    for name, triton_op, _, reference, inputs in _cases(device):
        got, want = _forward_backward(triton_op, inputs), _forward_backward(reference, inputs)
        tol = TOLERANCES[inputs[0].dtype]
        diffs = []
        for label, g, w in zip(["out", *(f"grad{i}" for i in range(len(got) - 1))], got, want):
            assert g.dtype == w.dtype, f"{name} {label}: dtype {g.dtype}, reference {w.dtype}"
            diff = (g.float() - w.float()).abs().max().item()
            msg = f"{name} {label}: max |diff| {diff:.2e} (atol = rtol = {tol})"
            torch.testing.assert_close(g, w, atol=tol, rtol=tol, msg=msg)
            diffs.append(f"{label} {diff:.1e}")
        lines.append(f"{name}: max |diff| {', '.join(diffs)}")
    return lines


def test_fused_ops_are_the_references_on_cpu() -> None:
    for name, _, fused, reference, inputs in _cases("cpu"):
        got, want = _forward_backward(fused, inputs), _forward_backward(reference, inputs)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), name


def test_model_with_triton_slots_is_the_torch_model_on_cpu() -> None:
    tokens_BT = torch.randint(
        0, TINY.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0)
    )
    results = {}
    for slots in ({}, TRITON_SLOTS):
        model = Decoder(replace(TINY, **slots))
        model.init_weights(0)
        targets = {"labels": tokens_BT.roll(-1, 1)}
        loss = model(tokens_BT, objective=CrossEntropy(), targets=targets).loss
        loss.backward()
        results[bool(slots)] = loss, {n: p.grad for n, p in model.named_parameters()}
    assert isinstance(model.norm, TritonRMSNorm)  # the last model built has the triton slots
    assert model.layers["0"].attention.rotate is apply_rotary_fused
    assert model.layers["0"].mlp.gated is swiglu_fused
    (loss_torch, grads_torch), (loss_triton, grads_triton) = results[False], results[True]
    assert grads_torch.keys() == grads_triton.keys()  # same parameter names: checkpoints load
    assert torch.equal(loss_torch, loss_triton), (loss_torch.item(), loss_triton.item())
    unequal = [n for n in grads_torch if not torch.equal(grads_torch[n], grads_triton[n])]
    assert not unequal, unequal


def test_slots_and_transform_choose_the_triton_kernels() -> None:
    cfg = resolve_model_config(ModelConfig(transforms=["triton_kernels"]))
    assert (cfg.norm_impl, cfg.rope_impl, cfg.mlp_impl) == ("triton", "triton", "triton")
    cfg = resolve_model_config(ModelConfig(rope_impl="triton"))
    assert (cfg.norm_impl, cfg.rope_impl, cfg.mlp_impl) == ("torch", "triton", "torch")
    with pytest.raises(ConfigError, match=r"Unknown mlp_impl 'trition'\. Did you mean 'triton'"):
        resolve_model_config(ModelConfig(mlp_impl="trition"))
    with pytest.raises(ConfigError, match=r"use --model.rope_impl triton instead"):
        resolve_model_config(ModelConfig(overrides={"rope_impl": "triton"}))


def test_triton_norm_is_refused_with_tensor_parallelism() -> None:
    tp2 = ParallelConfig(tp=2)
    for model in (ModelConfig(norm_impl="triton"), ModelConfig(transforms=["triton_kernels"])):
        with pytest.raises(ConfigError, match=r"keep --model.norm_impl torch"):
            JobConfig(model=model, parallel=tp2).validate()
    # RoPE and SwiGLU see plain local tensors under tensor parallelism; one rank takes anything.
    JobConfig(model=ModelConfig(rope_impl="triton", mlp_impl="triton"), parallel=tp2).validate()
    JobConfig(model=ModelConfig(transforms=["triton_kernels"])).validate()


def test_triton_kernels_in_the_interpreter(run_in_triton_interpreter) -> None:
    run_in_triton_interpreter(__file__)


@pytest.mark.gpu
def test_compiled_kernels_match_the_references_on_gpu() -> None:
    assert use_triton(torch.empty(0, device="cuda")), "Triton is not installed"
    print("\n".join(check_kernels_against_references("cuda")))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_forward_is_batch_invariant_on_gpu(dtype: torch.dtype) -> None:
    """A row's output is bitwise the same whether it is normalized alone or among 77 rows."""
    for dim in (64, 1000, 4096):
        x = torch.randn(77, dim, dtype=dtype, device="cuda")
        weight = torch.rand(dim, dtype=dtype, device="cuda") + 0.5
        together = rms_norm_fused(x, weight, 1e-6)
        alone = torch.cat([rms_norm_fused(x[i : i + 1].clone(), weight, 1e-6) for i in range(77)])
        diff = (together.float() - alone.float()).abs().max().item()
        assert torch.equal(together, alone), f"dim {dim}: max |diff| {diff:.2e}"


def _block(cfg: TransformerConfig) -> Block:
    """Layer 0 of ``cfg`` on its own, as the decoder builds it."""
    return Block(cfg, 0, cfg.layer_specs()[0])


def test_block_with_triton_slots_builds_on_cpu() -> None:
    """What the GPU test below builds, built where CI runs: a change to Block's constructor
    fails here, not only on a GPU machine."""
    block, reference = _block(replace(TINY, head_dim=16, **TRITON_SLOTS)), _block(TINY)
    assert isinstance(block.attention_norm, TritonRMSNorm)
    assert block.state_dict().keys() == reference.state_dict().keys()


@pytest.mark.gpu
def test_compiled_block_with_triton_slots_matches_eager_on_gpu() -> None:
    """torch.compile traces the Triton ops without graph breaks (fullgraph) and agrees with
    eager, which agrees with the PyTorch slots (same state dict), within bf16 rounding."""
    torch.manual_seed(0)
    cfg = replace(TINY, head_dim=16, **TRITON_SLOTS)
    block = _block(cfg).cuda().to(torch.bfloat16)
    with torch.no_grad():
        for name, param in block.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    reference = _block(replace(TINY, head_dim=16)).cuda().to(torch.bfloat16)
    reference.load_state_dict(block.state_dict())
    x_BTD = torch.randn(2, 33, cfg.dim, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    positions_BT = torch.arange(33, device="cuda").expand(2, -1)
    cos_BTd, sin_BTd = RotaryEmbedding(cfg.rope, cfg.resolved_head_dim)(positions_BT)

    def run(module: torch.nn.Module, forward: Op) -> list[torch.Tensor]:
        return _forward_backward(
            lambda x, *params: forward(x, cos_BTd, sin_BTd), (x_BTD, *module.parameters())
        )

    eager = run(block, block)
    for label, got in (("compiled", run(block, torch.compile(block, fullgraph=True))),
                       ("torch slots", run(reference, reference))):  # fmt: skip
        for i, (g, w) in enumerate(zip(got, eager)):
            rel = ((g.float() - w.float()).abs().max() / w.float().abs().max()).item()
            print(f"{label} vs eager triton, tensor {i}: max |diff| / max |value| {rel:.1e}")
            assert rel < 3e-2, (label, i, rel)


if __name__ == "__main__":  # run by test_triton_kernels_in_the_interpreter
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 on CPU"
    print(f"Triton interpreter checks ({Path(__file__).name}):")
    print("\n".join(check_kernels_against_references("cpu")))
