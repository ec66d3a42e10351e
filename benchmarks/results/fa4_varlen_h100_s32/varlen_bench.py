"""The probe behind fa4_varlen_h100_s32 (run as .probe/varlen_bench.py on one H100, the same
code, reformatted): torchloom's fa4 slot at the 1B training shape, forward + backward, on rows
of one document (the dense kernels) and on rows cut at random places (the varlen kernels)."""

import torch

from torchloom.kernels import flash_attention4 as fa4

dev = torch.device("cuda")
B, T, H, K, d = 8, 4096, 32, 8, 64


def views():
    g = torch.Generator(device=dev).manual_seed(0)
    return [
        torch.randn(B, T, h, d, device=dev, dtype=torch.bfloat16, generator=g)
        .transpose(1, 2)
        .requires_grad_()
        for h in (H, K, K)
    ]


def timeit(docs):
    """Mean ms of 10 forward + backward after 3 warm-up."""
    v, grad = views(), None
    for i in range(13):
        if i == 3:
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
        out = fa4.fa4_attention(*v, docs)
        if grad is None:
            grad = torch.randn_like(out)
        torch.autograd.grad(out, v, grad)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 10


g = torch.Generator().manual_seed(1)
for label, mean in (("one document per row", None), ("documents of ~2048", 2048), ("~512", 512)):
    if mean is None:
        print(f"{label}: {timeit(None):.2f} ms fwd+bwd")
        continue
    rows = []
    for _ in range(B):
        cuts = sorted(torch.randint(1, T, (T // mean - 1,), generator=g).tolist())
        ids = torch.zeros(T, dtype=torch.long)
        for c in cuts:
            ids[c:] += 1
        rows.append(ids)
    docs = fa4.fa4_documents(torch.stack(rows).to(dev))
    print(f"{label}: {timeit(docs):.2f} ms fwd+bwd ({docs.cu_seqlens.numel() - 1} documents)")
