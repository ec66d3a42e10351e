"""The deepseek_v4_flash4 GPU recipe, checked on the CPU without allocating it: it resolves and
builds on the meta device with DeepSeek-V4-Flash's active parameters per token and a cut total,
and its dry run reports the counts and a memory estimate."""

from __future__ import annotations

from dataclasses import replace

import torch

from tests.train.test_dry_run import estimate_and_real_forward, per_rank
from torchloom.cli import main, resolve_job
from torchloom.models import build_model, resolve_model_config
from torchloom.models.config import ModelConfig

TOTAL = 3_225_076_317
"""Parameters of the 4-layer, 16-expert cut (embedding and head 2 x 129280 x 4096 included)."""
ACTIVE = 1_688_804_480
"""Parameters a token uses (flops_per_token(0) / 6): attention, router, 6 routed experts and
the shared one per layer, the hyper-connections, the head."""


def test_flash4_builds_on_meta_with_flash_active_parameters():
    _, job = resolve_job(["--recipe", "deepseek_v4_flash4"])
    assert job.compile.enabled and job.training.seq_len == 4096
    cfg = resolve_model_config(job.model)
    assert (cfg.dim, cfg.num_heads, cfg.head_dim, cfg.moe.top_k, cfg.moe.expert_dim) == (
        4096, 64, 512, 6, 2048,
    )  # fmt: skip
    assert cfg.kinds() == ("sliding_attention", "sliding_attention",
                           "compressed_sparse_attention", "heavily_compressed_attention")  # fmt: skip
    assert [s.ffn for s in cfg.layer_specs()] == ["hash_moe"] * 3 + ["moe"]
    with torch.device("meta"):
        model = build_model(cfg)
    total = sum(p.numel() for p in model.parameters())
    active = cfg.flops_per_token(0) // 6
    print(f"total {total:,}, active {active:,}")
    assert (total, active) == (TOTAL, ACTIVE)
    # Active = everything but the embedding and the 10 of 16 routed experts a token skips.
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    expected = total - cfg.vocab_size * cfg.dim - routed * (16 - 6) // 16
    assert abs(active - expected) / expected < 1e-3, (active, expected)
    # Per layer, a token uses what it uses in the full Flash layer (256 experts): only the
    # router, 6 FLOPs per weight of its 256 - 16 fewer rows, differs.
    full = replace(cfg, moe=replace(cfg.moe, num_experts=256))
    with torch.device("meta"):
        full_model = build_model(full)
    for name, block in model.layers.items():
        full_block = full_model.layers[name]
        assert block.attention.flops_per_token(4096) == full_block.attention.flops_per_token(4096)
        router_rows = 6 * (256 - 16) * cfg.dim
        assert block.mlp.flops_per_token(0) == full_block.mlp.flops_per_token(0) - router_rows


def test_flash4_dry_run_reports_counts_and_memory(capsys):
    assert main(["train", "--recipe", "deepseek_v4_flash4", "--training.device", "cpu",
                 "--dry-run"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    print(out)
    assert "deepseek_v4/flash, 3.23B parameters" in out
    row = per_rank(out)[0]
    assert row["params"] == 4 * TOTAL  # fp32 master weights
    assert row["activations"] and row["activations"] > 0  # not n/a: the fake forward ran


def test_deepseek_v4_activation_estimate_equals_a_real_forward():
    """The dry run's shells share deepseek_v4's hc_head (a module beyond the decoder's own), so
    the estimate runs and equals what a real forward keeps."""
    _, job = resolve_job(["--recipe", "deepseek_v4_debug", "--remat.mode", "full"])
    job.model = ModelConfig(name="deepseek_v4", flavor="debug",
                            overrides={"num_layers": 4, "attention_kinds": [
                                "sliding_attention", "compressed_sparse_attention",
                                "heavily_compressed_attention", "sliding_attention"]})  # fmt: skip
    estimate, real = estimate_and_real_forward(job, micro=2)
    print(f"estimate {estimate.bytes} ({estimate.note}), real forward keeps {real} bytes")
    assert estimate.bytes == real
