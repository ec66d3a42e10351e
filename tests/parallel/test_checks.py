"""Impossible splits are refused up front with the numbers involved (no processes needed)."""

import pytest
import torch

from torchloom.config import ConfigError
from torchloom.models import ModelConfig, build_model, resolve_model_config
from torchloom.models.components.decoder_plan import decoder_tp_plan
from torchloom.parallel import ParallelConfig, ParallelDims, build_parallel_dims, parallelize
from torchloom.parallel.tensor_parallel import check_sequence_parallel


def debug_model(family: str = "llama3", **overrides):
    with torch.device("meta"):
        return build_model(
            resolve_model_config(ModelConfig(name=family, flavor="debug", overrides=overrides))
        )


def test_tp_must_divide_heads_kv_heads_ffn_and_vocab():
    model = debug_model()  # 4 heads, 2 kv heads, ffn 192, vocab 4096
    with pytest.raises(
        ConfigError, match=r"--parallel.tp 3 does not divide the model's num_heads \(4\)"
    ):
        decoder_tp_plan(model, 3)
    with pytest.raises(ConfigError, match=r"tp 4 does not divide the model's num_kv_heads \(2\)"):
        decoder_tp_plan(model, 4)
    odd_vocab = debug_model(vocab_size=4097)
    with pytest.raises(ConfigError, match=r"tp 2 does not divide the model's vocab_size \(4097\)"):
        decoder_tp_plan(odd_vocab, 2)
    assert "layers.1.attention.q_proj" in decoder_tp_plan(model, 2)


def test_plan_covers_qk_norms_and_the_tied_head():
    qwen3 = debug_model("qwen3")
    plan = decoder_tp_plan(qwen3, 2, loss_parallel=False)
    assert "layers.0.attention.q_norm" in plan and "output" not in plan
    # The tied head's vocabulary-sharded logits are gathered by Decoder.logits itself (an
    # objective computes them inside the forward, past a hook on the model's output).
    assert "" not in plan and qwen3.gather_tied_logits
    decoder_tp_plan(qwen3, 2, loss_parallel=True)
    assert not qwen3.gather_tied_logits


def test_sequence_parallel_needs_seq_len_divisible_by_tp():
    check_sequence_parallel(16, 2)
    with pytest.raises(
        ConfigError, match=r"seq_len 15 is not divisible by --parallel.tp 2.*e.g. 16"
    ):
        check_sequence_parallel(15, 2)


def test_expert_parallel_refusals_name_the_numbers():
    """Before any process group is touched: a dense model, experts that do not split."""
    dims = ParallelDims(ParallelConfig(ep=2, dp_shard=2), world_size=2, rank=0, device_type="cpu")
    with pytest.raises(ConfigError, match=r"--parallel.ep 2 needs a mixture-of-experts model"):
        parallelize(debug_model(), dims, seq_len=16)
    dims = ParallelDims(ParallelConfig(ep=3, dp_shard=3), world_size=3, rank=0, device_type="cpu")
    with pytest.raises(
        ConfigError, match=r"--parallel.ep 3 does not divide num_experts 8: .* 2, 4, 8"
    ):
        parallelize(debug_model("qwen3_moe"), dims, seq_len=16)
    with pytest.raises(ConfigError, match=r"--parallel.ep 3 does not divide dp_shard x cp = 2 x 1"):
        ParallelConfig(ep=3, dp_shard=2, tp=2).resolve(4)


def test_moe_layers_split_under_any_tp():
    plan = decoder_tp_plan(debug_model("qwen3_moe"), 2)
    assert "layers.0.mlp" in plan and "layers.0.mlp.experts" not in plan


def test_single_process_needs_no_mesh_and_parallelize_is_a_no_op():
    dims = build_parallel_dims(ParallelConfig(), "cpu")
    assert (dims.world_size, dims.dp_rank, dims.dp_size, dims.is_rank0) == (1, 0, 1, True)
    assert dims.world_mesh is None and dims.mesh("dp") is None and dims.fsdp_mesh is None
    model = debug_model()
    before = dict(model.named_parameters())
    assert parallelize(model, dims, seq_len=16) is model
    assert dict(model.named_parameters()) == before
    with pytest.raises(KeyError, match="unknown mesh name 'dq'"):
        dims.mesh("dq")


def test_new_fields_are_validated():
    with pytest.raises(ConfigError, match="--parallel.reshard_after_forward must be one of"):
        ParallelConfig(reshard_after_forward="sometimes").resolve(1)
