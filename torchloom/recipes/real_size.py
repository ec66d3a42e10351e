"""Real-size pre-training recipes: the published shapes of Llama 3.1 8B and 70B, Qwen3-30B-A3B,
DeepSeek-V2-Lite (deepseek_v3 16B) and DeepSeek-V3 671B, each under a parallel layout for the
cluster it names.

They are templates to point at your own data: ``data.sources`` is a directory of parquet shards
(``data/fineweb_edu``: every ``*.parquet`` under it, the text in the column ``--data.text_field``,
default ``text``) and ``data.tokenizer`` a Hugging Face tokenizer folder (``tokenizers/llama3``
...: the folder holding the model's tokenizer.json). Neither ships with torchloom; override both::

    torchrun --nnodes 4 --nproc-per-node 8 ... -m torchloom train --recipe llama3_70b \\
        --data.sources '["/data/my_corpus"]' --data.tokenizer /models/Llama-3.1-70B

Check a layout without the cluster, data or tokenizer (one process simulates every rank;
nothing is allocated, no data is read)::

    torchloom train --recipe llama3_70b --dry-run --world-size 32

Common to all: bf16 compute with fp32 master weights and AdamW state (FSDP's mixed precision:
16 bytes per parameter between steps, divided over the ranks that shard it), compiled blocks,
full activation recomputation (each block keeps only its input). The memory per GPU in each
docstring is the dry run's (``tests/recipes/test_real_size_recipes.py`` checks it): parameters +
gradients + optimizer state, plus the activation estimate where the dry run makes one (ranks
running whole blocks on whole sequences, i.e. without tp, cp or pp); not counted: allocator
overhead, temporary buffers and the parameters FSDP gathers for the block it runs.
"""

from __future__ import annotations

from torchloom.checkpoint.config import CheckpointConfig
from torchloom.config import register_recipe
from torchloom.data.config import DataConfig
from torchloom.models.config import ModelConfig
from torchloom.parallel.config import ParallelConfig
from torchloom.train.compile import CompileConfig
from torchloom.train.config import TrainingConfig
from torchloom.train.job import JobConfig, OutputConfig
from torchloom.train.optim import LRScheduleConfig, OptimizerConfig
from torchloom.train.remat import RematConfig

PARQUET_SOURCE = "data/fineweb_edu"
"""Placeholder: a directory of parquet shards with a ``text`` column (e.g. FineWeb-Edu)."""


def _pretrain(
    name: str,
    model: ModelConfig,
    tokenizer: str,
    parallel: ParallelConfig,
    *,
    seq_len: int,
    global_batch_size: int,
    micro_batch_size: int,
    lr: float,
    steps: int,
) -> JobConfig:
    """The parts every real-size recipe shares; the arguments are what differs."""
    return JobConfig(
        model=model,
        data=DataConfig(sources=[PARQUET_SOURCE], text_field="text", tokenizer=tokenizer),
        training=TrainingConfig(
            steps=steps,
            seq_len=seq_len,
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
            val_interval=1000,
            val_sequences=256,
        ),
        optimizer=OptimizerConfig(lr=lr, weight_decay=0.1),
        lr_schedule=LRScheduleConfig(warmup_steps=2000, decay="cosine"),
        # Each recipe names bf16 FSDP compute (auto is bf16 on GPUs but fp32 on the CPU), so the
        # CPU dry run estimates the activations the GPUs will hold.
        parallel=parallel,
        remat=RematConfig(mode="full"),
        compile=CompileConfig(enabled=True),
        checkpoint=CheckpointConfig(interval=500, mode="async", keep_latest_k=3),
        output=OutputConfig(dir=f"outputs/{name}"),
    )


@register_recipe("llama3_8b")
def llama3_8b() -> JobConfig:
    """Llama-3.1-8B (8.03B parameters) from scratch on parquet shards: 1 node of 8 H100/H200.

    Layout: dp_shard 8 (FSDP: every parameter, gradient and AdamW state split 8 ways; each rank
    reads its own sequences). No tp/pp: the whole block fits one GPU and FSDP's all-gathers stay
    on NVLink. Batch: 64 sequences x 8192 tokens = 512K tokens per step, micro-batches of 2 per
    GPU (4 accumulation steps). Full recomputation, compiled blocks, float8 (tensorwise) linears
    in the blocks (Hopper; --model.float8 none elsewhere). Dry run per GPU: 14.96 GiB of
    parameters, gradients and optimizer state, 27.30 GiB with the activation estimate (80 GiB
    GPU)."""
    return _pretrain(
        "llama3_8b",
        ModelConfig(name="llama3", flavor="8B", float8="tensorwise"),
        "tokenizers/llama3",
        ParallelConfig(dp_shard=8, mixed_precision_param="bf16"),
        seq_len=8192,
        global_batch_size=64,
        micro_batch_size=2,
        lr=3e-4,
        steps=100_000,
    )


@register_recipe("llama3_70b")
def llama3_70b() -> JobConfig:
    """Llama-3.1-70B (70.55B parameters) from scratch on parquet shards: 4 nodes of 8 H100/H200
    (32 GPUs; scale dp_shard to 8 for 8 nodes, keeping the global batch a multiple of dp_shard).

    Layout: tp 8 x dp_shard 4. tp splits every block's matrices 8 ways inside a node (NVLink)
    and runs the norms sequence-parallel, so FSDP's all-gathers across nodes move 1/8 of each
    block; dp_shard 4 shards the rest (FSDP) and reads 4 different micro-batches. Batch: 128
    sequences x 8192 tokens = 1M tokens per step, micro-batches of 1 per tp group (32
    accumulation steps). Full recomputation, compiled blocks, float8 (tensorwise) linears.
    Dry run per GPU: 32.86 GiB of parameters, gradients and optimizer state. It makes no
    activation estimate under tp; without tp (--parallel.tp 1 --parallel.dp_shard 32) one
    micro-batch keeps 14.42 GiB, a bound for a tp 8 rank, which keeps 1/8 of each block's input
    (sequence parallel) and of the logits (loss parallel): at most 47.28 GiB (80 GiB GPU)."""
    return _pretrain(
        "llama3_70b",
        ModelConfig(name="llama3", flavor="70B", float8="tensorwise"),
        "tokenizers/llama3",
        ParallelConfig(dp_shard=4, tp=8, mixed_precision_param="bf16"),
        seq_len=8192,
        global_batch_size=128,
        micro_batch_size=1,
        lr=1.5e-4,
        steps=100_000,
    )


@register_recipe("qwen3_30b_a3b")
def qwen3_30b_a3b() -> JobConfig:
    """Qwen3-30B-A3B (30.5B parameters, 3.3B active: 48 layers of 128 experts, top-8) from
    scratch on parquet shards: 2 nodes of 8 H100/H200 (16 GPUs).

    Layout: dp_shard 16 with ep 8. FSDP shards the attention, norms, embedding and head 16 ways;
    expert parallelism gives each GPU 16 of the 128 experts, exchanging tokens (all-to-all)
    inside its node of 8, and the 2 GPUs holding the same experts (one per node) shard them
    with FSDP. Batch: 256 sequences x 4096 tokens = 1M tokens per step, micro-batches of 2 per
    GPU (8 accumulation steps). Full recomputation, compiled blocks; no float8 (the experts'
    grouped matmuls stay bf16 and the 2048-wide attention gains little). Dry run per GPU: 28.44
    GiB of parameters, gradients and optimizer state, 34.70 GiB with the activation estimate
    (80 GiB GPU). One node (--parallel.dp_shard 8) needs 57 GiB plus activations: H200s."""
    return _pretrain(
        "qwen3_30b_a3b",
        ModelConfig(name="qwen3_moe", flavor="30B-A3B"),
        "tokenizers/qwen3",
        ParallelConfig(dp_shard=16, ep=8, mixed_precision_param="bf16"),
        seq_len=4096,
        global_batch_size=256,
        micro_batch_size=2,
        lr=3e-4,
        steps=100_000,
    )


@register_recipe("deepseek_v3_16b")
def deepseek_v3_16b() -> JobConfig:
    """deepseek_v3's 16B flavor, DeepSeek-V2-Lite's shape (15.7B parameters, 2.4B active: MLA,
    1 dense + 26 MoE layers of 64 routed experts, top-6, and 2 shared), from scratch on parquet
    shards: 1 node of 8 H100/H200.

    Layout: dp_shard 8 with ep 8. FSDP shards attention, dense layer, shared experts, embedding
    and head 8 ways; expert parallelism gives each GPU 8 of the 64 routed experts, tokens
    exchanged inside the node. Batch: 128 sequences x 4096 tokens = 512K tokens per step,
    micro-batches of 2 per GPU (8 accumulation steps). Full recomputation, compiled blocks; no
    float8 (the experts' grouped matmuls stay bf16). Dry run per GPU: 29.26 GiB of parameters,
    gradients and optimizer state, 33.35 GiB with the activation estimate (80 GiB GPU)."""
    return _pretrain(
        "deepseek_v3_16b",
        ModelConfig(name="deepseek_v3", flavor="16B"),
        "tokenizers/deepseek_v2",
        ParallelConfig(dp_shard=8, ep=8, mixed_precision_param="bf16"),
        seq_len=4096,
        global_batch_size=128,
        micro_batch_size=2,
        lr=4.2e-4,
        steps=100_000,
    )


@register_recipe("deepseek_v3_671b")
def deepseek_v3_671b() -> JobConfig:
    """DeepSeek-V3 (671B parameters in the main model, 682.6B with the multi-token-prediction
    depth, 37B active: MLA, 3 dense + 58 MoE layers of 256 routed experts, top-8, and 1 shared) from
    scratch on parquet shards: 32 nodes of 8 H100/H200 (256 GPUs) or more.

    Layout: dp_shard 256 with ep 64, as DeepSeek trained it (EP64 over 8 nodes, no tensor
    parallelism): FSDP shards attention, dense layers, shared experts, embedding and head 256
    ways; each GPU holds 4 of the 256 routed experts, exchanging tokens with the 63 others of
    its ep group, and the 4 GPUs holding the same experts shard them with FSDP. No pp: the MTP
    depth does not run under pipeline parallelism yet. Batch: 1024 sequences x 4096 tokens = 4M
    tokens per step, micro-batches of 1 per GPU (4 accumulation steps). Full recomputation,
    compiled blocks; no float8 here (DeepSeek's blockwise fp8 is not torchao's recipes). Dry
    run per GPU: 39.74 GiB of parameters, gradients and optimizer state, 59.08 GiB with the
    activation estimate (80 GiB GPU)."""
    return _pretrain(
        "deepseek_v3_671b",
        ModelConfig(name="deepseek_v3", flavor="671B"),
        "tokenizers/deepseek_v3",
        ParallelConfig(dp_shard=256, ep=64, mixed_precision_param="bf16"),
        seq_len=4096,
        global_batch_size=1024,
        micro_batch_size=1,
        lr=2.2e-4,
        steps=100_000,
    )
