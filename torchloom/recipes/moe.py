"""Mixture-of-experts and hybrid linear-attention recipes on the built-in English corpus: small
enough for a CPU, except deepseek_v4_flash4 (one GPU)."""

from __future__ import annotations

from torchloom.checkpoint.config import CheckpointConfig
from torchloom.config import register_recipe
from torchloom.data.config import DataConfig
from torchloom.models.config import ModelConfig
from torchloom.train.compile import CompileConfig
from torchloom.train.config import TrainingConfig
from torchloom.train.job import JobConfig, OutputConfig
from torchloom.train.optim import LRScheduleConfig, OptimizerConfig
from torchloom.train.remat import RematConfig


@register_recipe("qwen3_moe_debug")
def qwen3_moe_debug() -> JobConfig:
    """qwen3_moe's debug flavor (2 MoE layers of 8 experts, top-2) on the built-in corpus:
    seconds on a CPU."""
    return JobConfig(
        model=ModelConfig(name="qwen3_moe", flavor="debug"),
        training=TrainingConfig(steps=50, seq_len=128, global_batch_size=8, val_sequences=16),
        optimizer=OptimizerConfig(lr=3e-3),
        lr_schedule=LRScheduleConfig(warmup_steps=5),
        output=OutputConfig(dir="outputs/qwen3_moe_debug"),
    )


@register_recipe("deepseek_v3_debug")
def deepseek_v3_debug() -> JobConfig:
    """deepseek_v3's debug flavor (multi-head latent attention, 1 dense + 2 MoE layers of 8
    experts in 2 groups with a shared expert and the balancing bias, one MTP depth) on the
    built-in corpus: seconds on a CPU."""
    return JobConfig(
        model=ModelConfig(name="deepseek_v3", flavor="debug"),
        training=TrainingConfig(steps=50, seq_len=128, global_batch_size=8, val_sequences=16),
        optimizer=OptimizerConfig(lr=3e-3),
        lr_schedule=LRScheduleConfig(warmup_steps=5),
        output=OutputConfig(dir="outputs/deepseek_v3_debug"),
    )


@register_recipe("deepseek_v32_debug")
def deepseek_v32_debug() -> JobConfig:
    """deepseek_v32's debug flavor (deepseek_v3_debug with DeepSeek sparse attention: each
    query attends to the 32 keys its lightning indexer picks out of up to 128, the indexer
    trained by its KL loss, logged as aux_indexer_kl) on the built-in corpus: seconds on a CPU.
    Add --model.transforms '["dsa_warmup"]' for the dense warm-up of the indexers alone."""
    job = deepseek_v3_debug()
    job.model = ModelConfig(name="deepseek_v32", flavor="debug")
    job.output.dir = "outputs/deepseek_v32_debug"
    return job


@register_recipe("deepseek_v4_debug")
def deepseek_v4_debug() -> JobConfig:
    """deepseek_v4's debug flavor (a sliding-window, a compressed sparse and a heavily compressed
    attention layer over 4-wide hyper-connected streams; the first MoE layer hash-routed, the
    others by sqrt-softplus scores with the balancing bias) on the built-in corpus: seconds on
    a CPU."""
    return JobConfig(
        model=ModelConfig(name="deepseek_v4", flavor="debug"),
        training=TrainingConfig(steps=50, seq_len=128, global_batch_size=8, val_sequences=16),
        optimizer=OptimizerConfig(lr=3e-3),
        lr_schedule=LRScheduleConfig(warmup_steps=5),
        output=OutputConfig(dir="outputs/deepseek_v4_debug"),
    )


@register_recipe("kimi_linear_debug")
def kimi_linear_debug() -> JobConfig:
    """kimi_linear's debug flavor (3 Kimi Delta Attention layers and 1 NoPE MLA layer, 1 dense
    + 3 MoE layers of 8 experts with a shared expert and the balancing bias) on the built-in
    corpus: seconds on a CPU."""
    return JobConfig(
        model=ModelConfig(name="kimi_linear", flavor="debug"),
        training=TrainingConfig(steps=50, seq_len=128, global_batch_size=8, val_sequences=16),
        optimizer=OptimizerConfig(lr=3e-3),
        lr_schedule=LRScheduleConfig(warmup_steps=5),
        output=OutputConfig(dir="outputs/kimi_linear_debug"),
    )


@register_recipe("qwen3_next_debug")
def qwen3_next_debug() -> JobConfig:
    """qwen3_next's debug flavor (3 Gated DeltaNet layers and 1 gated attention layer, MoE of 8
    experts with a gated shared expert) on the built-in corpus: seconds on a CPU."""
    return JobConfig(
        model=ModelConfig(name="qwen3_next", flavor="debug"),
        training=TrainingConfig(steps=50, seq_len=128, global_batch_size=8, val_sequences=16),
        optimizer=OptimizerConfig(lr=3e-3),
        lr_schedule=LRScheduleConfig(warmup_steps=5),
        output=OutputConfig(dir="outputs/qwen3_next_debug"),
    )


@register_recipe("qwen3_5_debug")
def qwen3_5_debug() -> JobConfig:
    """qwen3_5's debug flavor (the dense Qwen3.5 text decoder: 3 Gated DeltaNet layers, then 1
    gated attention layer, SwiGLU feed-forwards) on the built-in corpus: seconds on a CPU."""
    job = qwen3_next_debug()
    job.model = ModelConfig(name="qwen3_5", flavor="debug")
    job.output.dir = "outputs/qwen3_5_debug"
    return job


# DeepSeek-V4-Flash's first four layers (sliding, sliding, CSA, HCA; the first three hash-
# routed) at its full width, with 16 of its 256 routed experts so AdamW fits one GPU; without
# the flavor's MTP depth, so the step times stay those benchmarks/RESULTS.md records.
FLASH4_OVERRIDES = {
    "num_layers": 4,
    "attention_kinds": ["sliding_attention", "sliding_attention",
                        "compressed_sparse_attention", "heavily_compressed_attention"],
    "moe.num_experts": 16,
    "mtp_layers": 0,
}  # fmt: skip


@register_recipe("deepseek_v4_flash4")
def deepseek_v4_flash4() -> JobConfig:
    """DeepSeek-V4-Flash's first 4 layers with 16 routed experts each, compiled: one GPU.

    The flash flavor's shapes (dim 4096, 64 heads of 512, q rank 1024, 8 output groups of 1024,
    indexer 64 x 128 picking 512, window 128, CSA groups of 4, HCA groups of 128, 4 hyper-
    connected streams, sqrt-softplus top-6 of 2048-wide experts plus one shared, the first 3
    layers hash-routed) and its schedule's first layers: sliding, sliding, CSA, HCA. A token
    uses Flash's active parameters per layer (6 routed experts + the shared one; MFU counts
    those: 1.69B active with the head); the total is cut to 16 routed experts per layer, not
    256 (4 x 256 would be 26B parameters, 420 GB with AdamW): 3.23B, 48 GiB with fp32 master
    weights, gradients and AdamW moments, under bf16 autocast. Each block is recomputed in the
    backward: the attention's dense reference path keeps [B, 64, T, T + groups] fp32 scores
    (5.4 GB per CSA layer at seq_len 4096; without recomputation the dry run estimates 41 GiB
    of activations in fp32), so seq_len 4096, two sequences per step in micro-batches of one.
    30 steps on the built-in corpus: a speed measurement (benchmarks/deepseek_v4.py), not a
    training run."""
    return JobConfig(
        model=ModelConfig(
            name="deepseek_v4",
            flavor="flash",
            overrides=dict(FLASH4_OVERRIDES),
            loss_impl="chunked",
        ),
        data=DataConfig(val_fraction=0.0),
        training=TrainingConfig(
            steps=30, seq_len=4096, global_batch_size=2, micro_batch_size=1, sample_tokens=0
        ),
        optimizer=OptimizerConfig(lr=3e-4),
        lr_schedule=LRScheduleConfig(warmup_steps=5),
        remat=RematConfig(mode="full"),
        compile=CompileConfig(enabled=True, regions=["DeepSeekV4Block"]),
        checkpoint=CheckpointConfig(save_final_model=False),
        output=OutputConfig(dir="outputs/deepseek_v4_flash4"),
    )
