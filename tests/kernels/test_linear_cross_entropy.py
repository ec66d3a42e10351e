"""The chunked fused head + cross-entropy against logits followed by cross_entropy.

The Triton kernel of the chunks (loss and gradient over the logits in place) runs on CPU in
Triton's interpreter, in a subprocess (this file run as a script with TRITON_INTERPRET=1); on a
GPU the compiled kernel gets the same checks and the whole fused head runs against the
reference in bf16.
"""

import os

import pytest
import torch

from torchloom.kernels.linear_cross_entropy import (
    IGNORE_INDEX,
    cross_entropy_and_grad_,
    cross_entropy_and_grad_triton_,
    cross_entropy_sum,
    linear_cross_entropy_sum,
)
from torchloom.models import ModelConfig, build_model, resolve_model_config
from torchloom.train.loss import CrossEntropy


@pytest.mark.parametrize("chunk", [1, 64, 10_000])
def test_matches_full_logits_loss_and_gradients(chunk):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(300, 32, generator=gen, requires_grad=True)
    w = torch.randn(1000, 32, generator=gen, requires_grad=True)
    labels = torch.randint(0, 1000, (300,), generator=gen)
    labels[::7] = IGNORE_INDEX
    reference = cross_entropy_sum((h @ w.T)[None], labels[None])
    (2 * reference).backward()
    grads = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    fused = linear_cross_entropy_sum(h, w, labels, chunk_tokens=chunk)
    (2 * fused).backward()
    diffs = [abs(fused.item() - reference.item()) / reference.item(),
             (h.grad - grads[0]).abs().max().item(), (w.grad - grads[1]).abs().max().item()]  # fmt: skip
    print(f"chunk {chunk}: rel loss diff {diffs[0]:.1e}, max |grad h diff| {diffs[1]:.1e}, "
          f"max |grad w diff| {diffs[2]:.1e}")  # fmt: skip
    assert diffs[0] < 1e-6 and diffs[1] < 1e-4 and diffs[2] < 1e-4
    with torch.no_grad():  # no gradients kept: only the loss
        assert torch.allclose(linear_cross_entropy_sum(h, w, labels), reference, rtol=1e-6)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])  # untied head / tied embeddings
def test_model_loss_impls_agree(family):
    losses, grads = {}, {}
    for impl in ("full", "chunked"):
        config = resolve_model_config(ModelConfig(name=family, flavor="debug"))
        model = build_model(config)
        model.init_weights(0)
        tokens = torch.randint(
            0, config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1)
        )
        labels = tokens.roll(-1, 1)
        labels[:, -1] = IGNORE_INDEX
        losses[impl] = model(tokens, objective=CrossEntropy(impl), targets={"labels": labels}).loss
        losses[impl].backward()
        grads[impl] = {n: p.grad for n, p in model.named_parameters()}
    diff = max((grads["full"][n] - g).abs().max().item() for n, g in grads["chunked"].items())
    print(f"{family}: loss {losses['full'].item():.4f} vs {losses['chunked'].item():.4f}, "
          f"max |grad diff| {diff:.1e}")  # fmt: skip
    torch.testing.assert_close(losses["chunked"], losses["full"], rtol=1e-6, atol=0)
    assert diff < 1e-5


def check_kernel_against_reference(device: str) -> list[str]:
    """The Triton kernel's losses and in-place gradients against F.cross_entropy's, for fp32
    and bf16 logits, a vocabulary that is not a multiple of the kernel's block, ignored labels
    and extreme logits."""
    lines = []
    gen = torch.Generator().manual_seed(0)
    for dtype, vocab in [(torch.float32, 5000), (torch.bfloat16, 9001), (torch.float32, 17)]:
        logits = (4 * torch.randn(6, vocab, generator=gen)).to(dtype)
        logits[1, 3] = 80.0  # one dominant logit
        labels = torch.randint(0, vocab, (6,), generator=gen)
        labels[2] = IGNORE_INDEX
        labels[1] = 3
        ref_logits = logits.float().requires_grad_()
        ref_loss = torch.nn.functional.cross_entropy(
            ref_logits, labels, ignore_index=IGNORE_INDEX, reduction="none"
        )
        ref_loss.sum().backward()
        work = logits.to(device).clone()
        loss = cross_entropy_and_grad_triton_(work, labels.to(device)).cpu()
        loss_diff = (loss - ref_loss.detach()).abs().max().item()
        grad_diff = (work.cpu().float() - ref_logits.grad).abs().max().item()
        lines.append(f"  {dtype} V={vocab}: max |loss diff| {loss_diff:.1e}, "
                     f"max |grad diff| {grad_diff:.1e}")  # fmt: skip
        assert loss_diff < 1e-4, (dtype, vocab, loss_diff)
        # bf16: one unit in the last place of values in [-1, 1) (the interpreter truncates).
        assert grad_diff < (1e-6 if dtype == torch.float32 else 2**-8 + 1e-6), (dtype, grad_diff)
        assert torch.equal(work[2].cpu(), torch.zeros(vocab, dtype=dtype)), "ignored row"
        assert loss[2].item() == 0.0
    return lines


def test_reference_steps_match_cross_entropy():
    """The CPU path of cross_entropy_and_grad_ (what the kernel must equal) is cross_entropy."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 40, generator=gen, requires_grad=True)
    labels = torch.tensor([1, IGNORE_INDEX, 39, 0, 7])
    ref = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    ref.sum().backward()
    work = logits.detach().clone()
    loss = cross_entropy_and_grad_(work, labels)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(work, logits.grad, rtol=1e-6, atol=1e-7)


def test_triton_kernel_in_the_interpreter(run_in_triton_interpreter) -> None:
    run_in_triton_interpreter(__file__)


@pytest.mark.gpu
def test_fused_head_on_gpu_matches_the_reference():
    """On CUDA: the compiled kernel's checks, then the fused head in bf16 (Triton kernel, fp32
    accumulation of w's gradient) against bf16 logits + cross_entropy, loss and gradients."""
    print("\n".join(check_kernel_against_reference("cuda")))
    gen = torch.Generator("cuda").manual_seed(0)
    h = torch.randn(3000, 256, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (0.05 * torch.randn(20_000, 256, device="cuda", generator=gen)).requires_grad_()
    labels = torch.randint(0, 20_000, (3000,), device="cuda", generator=gen)
    labels[::5] = IGNORE_INDEX
    with torch.autocast("cuda", dtype=torch.bfloat16):
        reference = cross_entropy_sum((h @ w.T)[None], labels[None])
    reference.backward()
    grads = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fused = linear_cross_entropy_sum(h, w, labels, chunk_tokens=1024)
    fused.backward()
    assert w.grad.dtype == torch.float32 and h.grad.dtype == torch.bfloat16
    rel = abs(fused.item() - reference.item()) / reference.item()
    diffs = [((g.float() - r.float()).abs().max() / r.float().abs().max()).item()
             for g, r in zip((h.grad, w.grad), grads)]  # fmt: skip
    print(f"bf16 fused head: rel loss diff {rel:.1e}, grad h {diffs[0]:.1e}, grad w {diffs[1]:.1e}")
    assert rel < 1e-5 and max(diffs) < 2e-2


if __name__ == "__main__":  # run by test_triton_kernel_in_the_interpreter
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 on CPU"
    print("Triton interpreter checks (cross_entropy_and_grad_):")
    print("\n".join(check_kernel_against_reference("cpu")))
