"""Generation with tensor parallelism (`torchloom generate --tp 2` under torchrun, gloo on the
CPU): the same tokens and, within fp32 rounding, the same log-probabilities as one process, for
dense and hybrid linear-attention models (recurrent states split by heads); weights updated in
place on the split model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchloom.cli import main

pytestmark = pytest.mark.distributed  # torchrun launches (slow: make test-slow)


def _prompts(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n"
                               for p in ([1, 2, 3], [4] * 9, [5, 6], [7])))  # fmt: skip
    return prompts


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# Hybrid linear-attention models (their recurrent states split by heads too): Qwen3.5's Gated
# DeltaNet with gated attention, Kimi Linear's KDA with MLA and experts.
HYBRID = {
    "qwen3_5_text": dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=8,
                         linear_value_head_dim=12),
    "kimi_linear": dict(num_hidden_layers=2, num_key_value_heads=4, kv_lora_rank=32,
                        q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        moe_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                        n_shared_experts=1, linear_num_heads=4, linear_head_dim=16,
                        layer_types=["linear_attention", "full_attention"], pad_token_id=None,
                        bos_token_id=None, eos_token_id=None),
}  # fmt: skip


@pytest.mark.parametrize(
    ("family", "tied"),
    [("llama", False), ("qwen3", True), ("qwen3_5_text", False), ("kimi_linear", False)],
    ids=["llama", "qwen3-tied", "qwen3_5", "kimi_linear"],
)
def test_tp2_generation_matches_one_process(tmp_path, hf_checkpoint, family, tied):
    folder, _ = hf_checkpoint(family, tie_word_embeddings=tied, **HYBRID.get(family, {}))
    prompts = _prompts(tmp_path)
    flags = ["--from-hf", str(folder), "--prompts-file", str(prompts), "--max-new-tokens", "6",
             "--max-batch", "2", "--device", "cpu", "--dtype", "fp32"]  # fmt: skip
    sampled = ["--temperature", "0.9", "--seed", "3"]
    single, single_sampled = tmp_path / "one.jsonl", tmp_path / "one_sampled.jsonl"
    assert main(["generate", *flags, "--greedy", "--output", str(single)]) == 0
    assert main(["generate", *flags, *sampled, "--output", str(single_sampled)]) == 0
    for name, extra in (("tp", ["--greedy"]), ("tp_sampled", sampled)):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", "-m", "torchloom", "generate", *flags, *extra, "--tp", "2",
               "--output", str(tmp_path / f"{name}.jsonl")]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-16000:]
    for one, tp in ((single, "tp"), (single_sampled, "tp_sampled")):
        a, b = _records(one), _records(tmp_path / f"{tp}.jsonl")
        assert [r["tokens"] for r in a] == [r["tokens"] for r in b]
        worst = max(abs(x - y) for r, s in zip(a, b) for x, y in zip(r["logprobs"], s["logprobs"]))
        scale = max(abs(x) for r in a for x in r["logprobs"])
        print(f"{family} {tp}: max |logprob(tp 2) - logprob(1 process)| = {worst:.1e} "
              f"(largest |logprob| {scale:.1f})")  # fmt: skip
        assert worst < 1e-5 * max(scale, 1.0)  # fp32 rounding: sums split over two ranks


def test_tp_needs_as_many_processes(tmp_path, hf_checkpoint, capsys):
    folder, _ = hf_checkpoint("llama")
    code = main(["generate", "--from-hf", str(folder), "--prompt", "x", "--tp", "2",
                 "--device", "cpu"])  # fmt: skip
    assert code == 2
    assert "--tp 2 needs 2 processes" in capsys.readouterr().err


def test_update_weights_on_a_tp2_model():
    """Full tensors (each rank copies its box) and DTensors placed like the parameters (each
    copies its shard) give what one process gives with those weights; storage is kept."""
    worker = Path(__file__).with_name("tp_weights_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(worker)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-16000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    print(result)
    assert result["pointers_kept"]
    for source in ("full", "dtensor"):
        assert result[source]["tokens_equal"], source
        assert result[source]["max_logprob_diff"] < 1e-5, source
