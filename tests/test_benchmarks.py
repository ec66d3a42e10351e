"""The training and generation benchmarks run end to end on the CPU at the tiny shape (their
GPU numbers are in benchmarks/RESULTS.md): each writes its JSON, rows agree where they must.
The GPU-only step floor is checked for its memory model and its refusal without a GPU."""

import ast
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchloom.models import ModelConfig, resolve_model_config

ROOT = Path(__file__).resolve().parents[1]


def _result(script: str, *args: str, interpreted: bool = False) -> subprocess.CompletedProcess:
    """benchmarks/``script`` run with ``args``; ``interpreted``: under Triton's interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1"} if interpreted else None
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env,
    )  # fmt: skip


def _run(script: str, *args: str, interpreted: bool = False) -> str:
    """``script``'s stdout (it must succeed)."""
    result = _result(script, *args, interpreted=interpreted)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_train_benchmark_rows_and_loss_check(tmp_path):
    out = tmp_path / "train.json"
    stdout = _run("train.py", "--shapes", "tiny", "--device", "cpu", "--no-compile", "--steps",
                  "2", "--warmup", "1", "--rows", "torchloom-eager", "torchloom",
                  "torchloom-chunked", "torchloom-autocast", "hf", "hf-layers", "--json",
                  str(out))  # fmt: skip
    print(stdout)
    report = json.loads(out.read_text())
    rows = {r["row"]: r for r in report["rows"]}
    assert set(rows) == {"torchloom-eager", "torchloom", "torchloom-chunked",
                         "torchloom-autocast", "hf", "hf-layers"}  # fmt: skip
    assert all(r["error"] is None and r["tokens_per_s"] > 0 for r in rows.values())
    assert rows["hf"]["vs_hf"] == 1.0 and rows["hf-layers"]["vs_hf_layers"] == 1.0
    # Uncompiled, the two HF loops are one model: the same init, the same losses.
    assert rows["hf-layers"]["losses"] == rows["hf"]["losses"]
    # Same init, same batches, fp32 on the CPU: the torchloom rows agree with the eager step
    # (chunked only reorders the loss's sums). HF's model has its own init: only the scale of
    # its first loss (about log(vocab)) agrees.
    checks = report["loss_diff"]["tiny"]
    assert set(checks) == {"torchloom", "torchloom-chunked", "torchloom-autocast"}
    assert max(c["step_1"] for c in checks.values()) < 1e-5
    assert abs(rows["hf"]["losses"][0] - rows["torchloom-eager"]["losses"][0]) < 0.1


def test_moe_train_benchmark_rows_agree(tmp_path):
    out = tmp_path / "train_moe.json"
    _run("train_moe.py", "--shapes", "tiny", "--device", "cpu", "--no-compile", "--steps", "2",
         "--warmup", "1", "--rows", "torchloom", "torchloom-eager", "--json", str(out))  # fmt: skip
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert all(r["error"] is None and r["tokens_per_s"] > 0 for r in rows.values())
    assert rows["torchloom"]["active_params"] < rows["torchloom"]["params"]
    # fp32 on the CPU, same init and batches: FSDP at world size 1 changes nothing.
    eager, fsdp = rows["torchloom-eager"]["losses"], rows["torchloom"]["losses"]
    assert max(abs(a - b) for a, b in zip(eager, fsdp, strict=True)) < 1e-5


def test_generate_benchmark_runs(tmp_path):
    out = tmp_path / "generate.json"
    _run("generate.py", "--shape", "tiny", "--device", "cpu", "--batches", "1", "2",
         "--new-tokens", "4", "--prompt-len", "8", "--rows", "ours", "hf-eager", "--train-seq",
         "0", "--decode-attention", "torch", "--max-len", "32", "--json", str(out))  # fmt: skip
    report = json.loads(out.read_text())
    assert {r["row"] for r in report["rows"]} == {"ours", "hf-eager"}
    assert all("tokens_per_s" in r for r in report["rows"]), report["rows"]
    assert report["decode_attention"] == "torch" and report["max_len"] == 32


def test_tuning_turns_one_row_linears_into_reductions_on_cuda():
    """The premise of generate.py's ours-tuned row, traced with fake CUDA tensors (no GPU
    needed): with coordinate-descent tuning, inductor's decompositions lower a decode step's
    linear of one row ([1, 1, D]) to a product and a sum, not a matmul; two rows keep it."""
    import torch
    import torch._inductor.config as inductor_config
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    def traced_ops(rows: int, tuning: bool) -> list[str]:
        x = torch.empty(rows, 1, 64, dtype=torch.bfloat16, device="cuda")
        w = torch.empty(128, 64, dtype=torch.bfloat16, device="cuda")
        with inductor_config.patch(coordinate_descent_tuning=tuning):
            graph = make_fx(torch.nn.functional.linear, select_decomp_table(), "fake")(x, w)
        return [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]

    with FakeTensorMode():
        assert "aten.mm.default" in traced_ops(1, tuning=False)
        tuned = traced_ops(1, tuning=True)
        assert "aten.mm.default" not in tuned and "aten.sum.dim_IntList" in tuned, tuned
        assert "aten.mm.default" in traced_ops(2, tuning=True)


@pytest.mark.slow  # an inductor compile
def test_generate_benchmark_tuned_row_runs(tmp_path):
    """The ours-tuned row compiles the decode step with coordinate-descent tuning in force (on
    the CPU inductor keeps the matmuls: only the row's wiring is checked here)."""
    out = tmp_path / "generate.json"
    _run("generate.py", "--shape", "tiny", "--device", "cpu", "--batches", "1", "--new-tokens",
         "4", "--prompt-len", "8", "--rows", "ours-tuned", "--train-seq", "0", "--json", str(out))  # fmt: skip
    (row,) = json.loads(out.read_text())["rows"]
    assert row["row"] == "ours-tuned" and row["tokens_per_s"] > 0, row


@pytest.mark.slow  # inductor compiles
def test_block_memory_benchmark_splits_the_weight_copies(tmp_path):
    """block_memory.py at the debug shape: keep's kept block holds a bf16 copy of every block
    matrix, recompute's none, and otherwise the same bytes; a recomputed block holds the same
    under both; fewer recomputed blocks keep more; a smaller --remat.mode budget keeps less."""
    out = tmp_path / "block_memory.json"
    _run("block_memory.py", "--flavor", "debug", "--batch", "2", "--seq", "256",
         "--probe-tokens", "48", "--budgets", "0.9", "0.2", "--json", str(out))  # fmt: skip
    report = json.loads(out.read_text())
    keep, recompute = report["blocks"]["keep"], report["blocks"]["recompute"]
    # A smaller budget keeps less, and below the kept block (nothing recomputed) either way.
    high, low = (b["block_bytes"] for b in report["budgets"])
    assert low < high < keep["kept"]["at_step"]
    cfg = resolve_model_config(ModelConfig(name="llama3", flavor="debug"))
    d, kv = cfg.dim, cfg.num_kv_heads * (cfg.dim // cfg.num_heads)
    matrices = 2 * (2 * d * d + 2 * d * kv + 3 * d * cfg.ffn_dim)  # q, o, k, v, gate, up, down
    assert keep["kept"]["weight_copies"] == matrices and recompute["kept"]["weight_copies"] == 0
    assert keep["kept"]["per_token"] == recompute["kept"]["per_token"]
    assert keep["recomputed"] == recompute["recomputed"]
    for casts in ("keep", "recompute"):
        rows = [r for r in report["rows"] if r["weight_casts"] == casts]
        by_recomputed = sorted(rows, key=lambda r: r["recomputed"])
        sizes = [r["activations_bytes"] for r in by_recomputed]
        assert sizes == sorted(sizes, reverse=True)


@pytest.mark.slow  # inductor compiles
def test_block_memory_with_float8_keeps_no_weight_copies(tmp_path):
    """With torchao's float8 linears (tensorwise), no block keeps a copy of a weight for its
    backward in any dtype, transposed or not: the float8 row has nothing for
    --remat.weight_casts to free (benchmarks/RESULTS.md, twenty-sixth session)."""
    pytest.importorskip("torchao.float8")
    out = tmp_path / "block_memory.json"
    _run("block_memory.py", "--flavor", "debug", "--batch", "2", "--seq", "256", "--float8",
         "--probe-tokens", "48", "--json", str(out))  # fmt: skip
    report = json.loads(out.read_text())
    assert report["float8"]
    for casts in ("keep", "recompute"):
        for kind in ("kept", "recomputed"):
            assert report["blocks"][casts][kind]["weight_copies"] == 0, (casts, kind)
    assert report["blocks"]["keep"]["kept"]["per_token"] > 0


def test_hybrid_benchmark_rows(tmp_path):
    """benchmarks/hybrid.py at the tiny shape: the 3:1 hybrid and its all-attention twin, our
    Gated DeltaNet layer and transformers' of the same shape, each against its baseline."""
    out = tmp_path / "hybrid.json"
    _run("hybrid.py", "--device", "cpu", "--shape", "tiny", "--compile", "none", "--rows",
         "hybrid", "full", "layer", "hf-layer", "--seq-lens", "64", "--tokens", "128",
         "--steps", "2", "--warmup", "1", "--json", str(out))  # fmt: skip
    report = json.loads(out.read_text())
    rows = {r["row"]: r for r in report["rows"]}
    assert set(rows) == {"hybrid", "full", "layer", "hf-layer"}
    assert all(r["error"] is None and r["tokens_per_s"] > 0 for r in rows.values()), rows
    assert report["delta_rule"] == "torch" and set(report["hf_kernels"]) == {"delta_rule", "conv"}
    linear, full = "linear_attention", "full_attention"
    assert rows["hybrid"]["layer_types"] == [linear, linear, linear, full]
    assert rows["full"]["layer_types"] == [full] * 4
    # One layer of the same shape: the same parameters, whoever built it.
    assert rows["layer"]["params"] == rows["hf-layer"]["params"]
    assert rows["hybrid"]["ratio_over"] == "full" and rows["layer"]["ratio_over"] == "hf-layer"


def test_step_floor_memory_model(monkeypatch):
    """benchmarks/step_floor.py's memory-bound term: the parameter counts are llama3's, the
    optimizer's bytes per parameter are AdamW's plus the norm's read, and every activation term
    grows with the tokens while the optimizer's does not."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import step_floor

    cfg = {s: resolve_model_config(ModelConfig(name="llama3", flavor=s)) for s in ("1B", "8B")}
    params = {s: step_floor.parameter_count(c) for s, c in cfg.items()}
    assert params == {"1B": 1_235_814_400, "8B": 8_030_261_248}  # 1B ties the head
    bf16 = step_floor.memory_traffic(cfg["8B"], 16384, params["8B"], fp32_master=False)
    fp32 = step_floor.memory_traffic(cfg["1B"], 32768, params["1B"], fp32_master=True)
    assert bf16["optimizer"] == 16 * params["8B"] and fp32["optimizer"] == 38 * params["1B"]
    assert bf16["swiglu"] == 2 * 8 * 16384 * 14336 * 32  # bf16 gate, up, product and grads
    assert bf16["loss"] == 2 * 2 * 16384 * 128256  # each logit read once, its gradient written
    twice = step_floor.memory_traffic(cfg["8B"], 32768, params["8B"], fp32_master=False)
    assert all(twice[k] == 2 * v for k, v in bf16.items() if k != "optimizer")
    assert twice["optimizer"] == bf16["optimizer"]
    assert round(sum(bf16.values()) / 1e9, 1) == 348.3  # as benchmarks/RESULTS.md quotes


def test_step_floor_refuses_without_a_gpu():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_floor.py")],
                            capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
    assert result.returncode == 1 and "run it on a CUDA machine" in result.stderr


def test_rl_chain_benchmark_reports_the_curve_and_the_time_split(tmp_path):
    """benchmarks/rl_gpu.py end to end at the tiny shape (a random model, 2 updates)."""
    out = tmp_path / "rl.json"
    stdout = _run("rl_gpu.py", "--recipe", "rl_debug", "--json", str(out), "--",
                  "--checkpoint.initial_load_hf", "", "--data.tokenizer", "builtin:stdlib_bpe",
                  "--rl.init_recipes", "[]", "--training.steps", "2", "--rl.prompts_per_step",
                  "2", "--rl.group_size", "2", "--training.device", "cpu",
                  # A random model's groups are all wrong alike: keep them, so steps train.
                  "--rl.filter_zero_variance", "false",
                  "--metrics.tensorboard", "false", "--output.dir", str(tmp_path / "run"))  # fmt: skip
    print(stdout)
    report = json.loads(out.read_text())
    assert report["steps"] == 2 and len(report["reward_curve"]) == 2
    assert report["gen_tps_median"] > 0 and report["train_tps_median"] > 0
    assert set(report["time_split_s"]) == {"time_generate_s", "time_train_s", "time_sync_s"}
    assert "time split: generate" in stdout


def test_sampling_benchmark_runs_both_draws(tmp_path):
    out = tmp_path / "sampling.json"
    _run("sampling.py", "--shape", "tiny", "--device", "cpu", "--requests", "4",
         "--new-tokens", "3", "--json", str(out))  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [r["draw"] for r in rows] == ["per-row", "batched"]
    assert all(r["tokens"] == 12 and r["tokens_per_s"] > 0 for r in rows)


def test_rl_turns_benchmark_rows_agree(tmp_path):
    out = tmp_path / "rl_turns.json"
    stdout = _run("rl_turns.py", "--rollouts", "8", "--turns", "3", "--tool-s", "0.05",
                  "--json", str(out))  # fmt: skip
    print(stdout)
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [r["row"] for r in rows] == ["pipeline", "turns", "serial"]
    assert all(r["same_tokens"] and r["wall_s"] > 0 for r in rows)
    # Every row continues each turn's cache: the kept count, far below whole contexts.
    assert {r["prefill_tokens"] for r in rows} == {report["prefill_tokens_kept"]}
    assert report["prefill_tokens_kept"] < report["prefill_tokens_whole"]


def test_sparse_attention_benchmark_small(tmp_path):
    """benchmarks/sparse_attention.py at its tiny CPU shape: the dense chunked form and the
    gather reference time forward and backward, and agree on the output."""
    out = tmp_path / "sparse.json"
    _run("sparse_attention.py", "--small", "--json", str(out))
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"dense", "gather"}, rows
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 for r in rows.values()), rows
    assert rows["dense"]["max_abs_diff_vs_gather"] < 1e-5


def test_deepseek_v4_benchmark_small(tmp_path):
    """benchmarks/deepseek_v4.py --small: the debug recipe through `torchloom train`, and the
    hyper-connections' eager forward + backward with their share of its step."""
    out = tmp_path / "deepseek_v4.json"
    _run("deepseek_v4.py", "--small", "--device", "cpu", "--out", str(tmp_path / "runs"),
         "--json", str(out))  # fmt: skip
    report = json.loads(out.read_text())
    parts = {p["part"]: p for p in report["parts"]}
    assert set(parts) == {"hc-eager", "train"}
    assert all(p["error"] is None for p in parts.values()), parts
    train, hc = parts["train"], parts["hc-eager"]
    assert train["tokens_per_s"] > 0 and len(train["losses"]) == 2
    assert report["active_params"] < report["params"]
    assert hc["fwd_s"] > 0 and hc["fwd_bwd_s"] > 0  # not ordered: 2 steps on a shared CPU
    assert hc["share_of_step"] == hc["per_step_s"] / train["step_s"]


def test_data_stall_benchmark_small(tmp_path):
    """benchmarks/data_stall.py --small: a parquet corpus generated, then streamed by `torchloom
    train` on the CPU with its data wait's share of the step and its memory measured."""
    out = tmp_path / "data_stall.json"
    _run("data_stall.py", "--small", "--out", str(tmp_path), "--json", str(out))
    report = json.loads(out.read_text())
    assert report["error"] is None, report["train_log"]
    assert report["corpus_bytes"] > 0 and list((tmp_path / "corpus").glob("*.parquet"))
    assert report["steps"] == 6 and report["timed_steps"] == [3, 4, 5, 6]
    assert report["tokens_per_s"] > 0
    assert 0 <= report["data_wait_share_pct"] <= 100, report["data_wait_share_pct"]
    assert report["peak_rss_gib"] > 0


def test_rollout_generation_benchmark_rows(tmp_path):
    """Both scheduling rows generate every requested token; batched admission runs fewer
    prefills than admitting at once."""
    stdout = _run("rollout_generate.py", "--device", "cpu", "--dim", "64", "--layers", "2",
                  "--groups", "12", "--slots", "32")  # fmt: skip
    print(stdout)
    rows = {line.split()[0]: line.split() for line in stdout.splitlines()
            if line.startswith(("before ", "after "))}  # fmt: skip
    assert set(rows) == {"before", "after"}
    assert rows["before"][2] == rows["after"][2]  # tokens
    assert int(rows["after"][4]) < int(rows["before"][4])  # prefills


TITAN_LOG = """\
[titan] 2026-12-04 16:20:01,100 - root - INFO - \x1b[31mstep:  1  \x1b[32mloss: 12.25011  \
\x1b[38;2;180;60;0mgrad_norm:  0.5007  \x1b[38;2;54;234;195mmemory: 63.27GiB(45.26%)  \
\x1b[34mtps: 2,511  \x1b[36mtflops: 22.66  \x1b[35mmfu: 2.29%\x1b[39m
[titan] 2026-12-04 16:20:07,100 - root - INFO - step: 10  loss: 12.14127  grad_norm:  0.3470  \
memory: 78.93GiB(56.46%)  tps: 55,977  tflops: 505.22  mfu: 51.08%
[titan] 2026-12-04 16:20:13,100 - root - INFO - step: 20  loss: 11.97192  grad_norm:  1.1262  \
memory: 78.93GiB(56.46%)  tps: 61,393  tflops: 554.10  mfu: 56.03%
[titan] 2026-12-04 16:20:19,100 - root - INFO - step: 30  loss: 12.03468  grad_norm:  3.3004  \
memory: 78.93GiB(56.46%)  tps: 61,938  tflops: 559.02  mfu: 56.52%
"""


def _benchmark(name: str):
    """The module benchmarks/<name>.py, imported (benchmarks/ is no package)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_vs_torchtitan_reads_torchtitan_logs():
    """benchmarks/vs_torchtitan.py: TorchTitan's log lines (from its 0.2.2 trainer on an H200,
    colours included) give its windows and their mean after the compile window."""
    bench = _benchmark("vs_torchtitan")
    windows = bench.titan_windows(TITAN_LOG)
    assert [(w["step"], w["reserved_gib"], w["tps"]) for w in windows] == [
        (1, 63.27, 2511), (10, 78.93, 55977), (20, 78.93, 61393), (30, 78.93, 61938)]  # fmt: skip
    assert bench.windows_tokens_per_s(windows) == (61393 + 61938) / 2
    assert bench.windows_tokens_per_s(windows[:2]) is None


@pytest.mark.parametrize(
    ("model", "extra"),
    [("llama3", []), ("deepseek_v3", []), ("llama3", ["--fa4"])],
    ids=["llama3", "deepseek_v3", "llama3-fa4"],
)
def test_vs_torchtitan_runs_the_torchloom_side(tmp_path, model, extra):
    """The torchloom side runs `torchloom train` on the inputs written for both trainers (the
    CPU check; TorchTitan's trainer needs CUDA), the model matched to TorchTitan's; with --fa4
    through the fa4 attention backend (its PyTorch reference on the CPU)."""
    out = tmp_path / "anchor.json"
    stdout = _run("vs_torchtitan.py", "--model", model, "--flavor", "debug", "--seq", "64",
                  "--batch", "2", "--steps", "4", "--log-interval", "2", "--sides", "torchloom",
                  "--device", "cpu", "--words", "500", "--workdir", str(tmp_path / "work"),
                  "--json", str(out), *extra)  # fmt: skip
    report = json.loads(out.read_text())
    side = report["sides"]["torchloom"]
    assert side["error"] is None and side["tokens_per_s"] > 0, stdout
    assert [r["step"] for r in side["steps"]] == [1, 2, 4]  # the first, every 2nd, the last
    assert "ratio" not in report  # one side only
    want = {"llama3": {"tie_embeddings": False},
            "deepseek_v3": {"num_layers": 6, "mtp_layers": 0}}[model]  # fmt: skip
    config = json.loads((tmp_path / "work" / "torchloom" / "config.json").read_text())
    assert config["model"]["name"] == model and config["model"]["overrides"] == want
    assert config["model"]["attn_backend"] == ("fa4" if extra else "sdpa")
    assert report["fa4"] == bool(extra)


def test_persistent_decode_chain_matches_its_reference():
    """benchmarks/persistent_decode.py's kernels (a decode step's chain of one-row matmuls in
    one launch, programs taking tiles in dependency order) in Triton's interpreter: every link
    (the RMS norms and residual adds, the o projection's slice, the SwiGLU read, the head)
    against PyTorch's chain, at several tilings and program counts, both kernels."""
    pytest.importorskip("triton")
    assert "check passed" in _run("persistent_decode.py", "--check", interpreted=True)


def test_persistent_decode_kernels_compile_for_hopper():
    """Both probe kernels compile for sm_90 here (Triton's bundled ptxas; no GPU needed), which
    Triton's interpreter never checks (a value's type across branches, register use), without
    spilling registers at the 1B shape (ptxas's report)."""
    pytest.importorskip("triton")
    stdout = _run("persistent_decode.py", "--compile-only", "--configs", "16x512x4x2", "p8x8x1")
    lines = [line for line in stdout.splitlines() if "REG:" in line]
    assert len(lines) == 2 and all(line.endswith(" SPILLS:0") for line in lines), stdout


def test_decode_step_compiles_fused_tilings_for_hopper():
    """decode_step.py --compile-only: the fused step's sm_90 build at the 1B shape with no GPU,
    one tile a task, strips, and the default tiling (8192x4x2x1x3), alone and with the head
    strips combined first, each without spills and with the strips' asynchronous copies (the
    numbers RESULTS.md quotes)."""
    pytest.importorskip("triton")
    stdout = _run("decode_step.py", "--compile-only", "--fused", "16384x8x1", "16384x8x1x1",
                  "8192x4x2x1x3", "8192x4x2x1x3x1x0x1x1x1x1")  # fmt: skip
    rows = [line for line in stdout.splitlines() if line.startswith("sm_90 ")]
    assert len(rows) == 4 and all("'SPILLS:0'" in r and "'async_copies': 0" not in r for r in rows)
    assert "'tasks': 77599" in rows[0] and "'tasks': 10531" in rows[1], rows
    assert "'tasks': 18838" in rows[2] and "'shared_kb': 32" in rows[2], rows


def test_strip_loop_forms_match_their_reference():
    """benchmarks/strip_loop.py's forms of the fused step's inner loop (whole rows summed
    every iteration; row segments accumulated, summed once a row block; tasks of a few blocks
    taken from a counter, bare, as the fused step runs them, with the wait inside the loop and
    each of its two costs alone; dealt out as one stream a program) in Triton's interpreter
    against w @ x, with uneven strips and a ragged last row block; the publishing forms count
    every task once."""
    pytest.importorskip("triton")
    stdout = _run("strip_loop.py", "--check", "--configs", "whole-4x4x2x3", "seg-16x256x4x2x3",
                  "seg-8x32x4x1x2", "bare-4x4x2x3x2", "peeled-4x4x2x3x1", "peeled-8x4x2x2x3",
                  "inloop-4x4x2x3x3", "inloop-8x4x1x2x1", "waiting-4x4x2x3x2",
                  "publishing-4x4x2x3x3", "flow-4x4x2x3x2", "flow-8x4x1x2x1",
                  interpreted=True)  # fmt: skip
    assert "check passed: 12 configurations" in stdout


def test_strip_loop_compiles_for_hopper():
    """The loop's forms build for sm_90 without spills, the segmented one's loop holds fewer
    barriers (its sums stay inside each warp): the figures benchmarks/RESULTS.md quotes; and the
    task forms stay pipelined with the fused step's wait before and inside the loop, and with
    waits and publishing inside one loop over a program's tasks (its barrier in PTX)."""
    pytest.importorskip("triton")
    stdout = _run("strip_loop.py", "--compile-only", "--configs", "whole-4x4x2x3",
                  "seg-16x256x4x2x3", "peeled-4x4x2x3x2", "inloop-4x4x2x3x2",
                  "flow-4x4x2x3x2")  # fmt: skip
    rows = {line.split()[1]: ast.literal_eval(line.split(" ", 2)[2])
            for line in stdout.splitlines() if line.startswith("sm_90 ")}  # fmt: skip
    whole, seg = rows["whole-4x4x2x3"], rows["seg-16x256x4x2x3"]
    assert {row["spills"] for row in rows.values()} == {"SPILLS:0"}, rows
    assert whole["async_copies_in_loop"] > 0 and seg["async_copies_in_loop"] > 0, rows
    assert seg["bar_sync_in_loop"] < whole["bar_sync_in_loop"], rows
    # The wait inside the loop leaves it pipelined (asynchronous copies), as the peeled form is.
    for form in ("peeled-4x4x2x3x2", "inloop-4x4x2x3x2", "flow-4x4x2x3x2"):
        assert rows[form]["async_copies"] > 0 and rows[form]["acquire_loads"] > 0, rows


@pytest.mark.parametrize(
    ("script", "message"),
    [
        ("decode_step.py", "needs a CUDA GPU"),
        ("strip_loop.py", "times kernels on a CUDA GPU"),
        ("one_row_matmul.py", "this machine has none"),
        ("persistent_decode.py", "without a CUDA GPU run --check"),
    ],
)
def test_decode_benchmarks_need_a_gpu(script, message):
    """The decode-step benchmarks replay CUDA graphs; without a GPU each says so in one line."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script would run")
    result = _result(script)
    assert result.returncode == 1 and message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args",
    [["strip_loop.py"], ["decode_step.py", "--fused", "8192x4x2x2x3"]],
    ids=["strip", "step"],
)
def test_compile_only_under_the_interpreter_says_to_run_without_it(args):
    """--compile-only builds with Triton's compiler, which TRITON_INTERPRET=1 replaces: one line
    naming the fix, not the compiler's traceback about an interpreted function."""
    result = _result(args[0], "--compile-only", *args[1:], interpreted=True)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "run it without TRITON_INTERPRET=1" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--words", "0"], "--words must be at least 1"), (["--flavor", "nope"], "Unknown flavor")],
)
def test_vs_torchtitan_bad_options_are_one_line(tmp_path, args, message):
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "vs_torchtitan.py"), "--sides", "torchloom",
         "--device", "cpu", "--workdir", str(tmp_path), *args],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_fused_trace_summary_recovers_known_phases(tmp_path):
    """benchmarks/fused_trace.py: stamps made up with known phase lengths (2 cycles a ns, the
    tasks one after another on three multiprocessors) come back as those lengths for every
    kind of task, the programs' shares and the stage timeline add up to the step, the strip's
    bytes are the weights' (q/k/v's: its rows times the model's width), and each stage's
    hand-off (its first wait's end after the previous stage's end) is the gap made up."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(ROOT / "tests" / "kernels"))
    try:
        from test_fused_decode import random_weights
    finally:
        sys.path.remove(str(ROOT / "tests" / "kernels"))
    from torchloom.kernels.fused_decode import TRACE_FIELDS, FusedDecodeStep

    trace = _benchmark("fused_trace")
    weights = random_weights(64, 4, 2, 16, 192, 300, layers=2, max_len=40, device="cpu",
                             dtype=torch.float32)  # fmt: skip
    one = torch.zeros(1, dtype=torch.long)
    step = FusedDecodeStep(weights, one, one, tile_elements=256, programs=3)
    lengths = [100, 200, 50, 400, 30]  # ns: table, wait, input, strip, finish
    stamps = torch.zeros(len(step.tasks), TRACE_FIELDS, dtype=torch.long)
    for i in range(len(step.tasks)):
        start = 1000 * i
        cycles = [2 * (start + sum(lengths[:j])) for j in range(len(lengths) + 1)]
        stamps[i, trace.START_NS], stamps[i, trace.END_NS] = start, start + sum(lengths)
        stamps[i, trace.START], stamps[i, trace.WAIT], stamps[i, trace.WAITED] = cycles[:3]
        stamps[i, trace.INPUT], stamps[i, trace.STRIP], stamps[i, trace.END] = cycles[3:]
        stamps[i, trace.SM] = i % 3
    summary = trace.summarize(step, stamps)
    assert summary["cycles_per_ns"] == 2.0
    kinds = summary["kinds"]
    assert set(kinds) == {"embed", "q/k/v", "attention", "o", "gate/up", "down", "head",
                          "logprob"}  # fmt: skip
    for label in ("q/k/v", "o", "gate/up", "down", "head"):
        phases = [kinds[label][name]["mean_us"] for name in trace.MATRIX_PHASES]
        assert phases == [n / 1e3 for n in lengths], (label, phases)
    assert kinds["attention"]["wait"]["mean_us"] == 0.2
    assert kinds["attention"]["attend"]["mean_us"] == 0.48
    assert kinds["logprob"]["whole"]["mean_us"] == 0.78
    shares = sum(v["per_program_us"] for kind in kinds.values() for v in kind.values()
                 if isinstance(v, dict))  # fmt: skip
    assert abs(shares - len(step.tasks) * 0.78 / 3) < 0.1, shares
    # q/k/v: 2 layers x (4 + 2 + 2) heads x 16 rows, 64 wide, fp32; its strips took 400 ns each
    qkv = kinds["q/k/v"]
    assert qkv["strip_GB_per_s_a_program"] == round(2 * 128 * 64 * 4 / (qkv["tasks"] * 400), 2)
    timeline = summary["timeline"]
    assert abs(sum(t["total_us"] for t in timeline.values()) - summary["step_us"]) < 0.2
    assert timeline["q/k/v"]["stages"] == 2 and timeline["head"]["stages"] == 1
    # each stage's first wait ends 520 ns after the stage before it ends (its first task starts
    # 220 ns after that one's end, then 100 + 200 ns to its wait's end)
    handoffs = {k: t["first_release_after_previous_end_us"] for k, t in timeline.items()}
    trace.save_tables(step, tmp_path / "raw" / "stamps.pt")
    saved = torch.load(tmp_path / "raw" / "stamps.pt")
    assert torch.equal(saved["tasks"], step.tasks) and saved["programs"] == 3
    assert handoffs == {"embed": None, "logprob": None} | {
        k: 0.52 for k in ("q/k/v", "attention", "o", "gate/up", "down", "head")
    }, handoffs


@pytest.mark.parametrize("script", ["decode_step.py", "fused_trace.py"])
def test_fused_tiling_typos_are_one_usage_error(script):
    """A malformed --fused tiling is refused before anything is built (no GPU needed), in one
    usage line naming the form."""
    result = _result(script, "--fused", "8192x4x2", "8192x4")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "argument --fused: --fused '8192x4': want TxWxP" in result.stderr, result.stderr
    # the tenth field (small_waves) is a count of at least one, not a 0/1 switch
    result = _result(script, "--fused", "8192x4x2x2x3x1x0x1x1x2", "8192x4x2x2x3x1x0x1x1x0")
    assert result.returncode == 2 and "'8192x4x2x2x3x1x0x1x1x0': want" in result.stderr
    # the eleventh (strip_tops) is a 0/1 switch, and there is no twelfth
    result = _result(script, "--fused", "8192x4x2x1x3x1x0x1x1x1x1", "8192x4x2x1x3x1x0x1x1x1x2")
    assert result.returncode == 2 and "'8192x4x2x1x3x1x0x1x1x1x2': want" in result.stderr
    result = _result(script, "--fused", "8192x4x2x1x3x1x0x1x1x1x1x1")
    assert result.returncode == 2 and "'8192x4x2x1x3x1x0x1x1x1x1x1': want" in result.stderr
    # named settings after the fields: known names, each once, in range (splits and block_l
    # powers of two)
    for bad in ("8192x4x2,prefetch=-1", "8192x4x2,splits=3", "8192x4x2,block_l=0",
                "8192x4x2,warps=4", "8192x4x2,splits=2,splits=4", "8192x4x2,", "8192x4x2,splits"):  # fmt: skip
        result = _result(script, "--fused", "8192x4x2,prefetch=2,splits=8,block_l=32", bad)
        assert result.returncode == 2 and f"'{bad}': want" in result.stderr, (bad, result.stderr)


def test_fused_tiling_reads_named_settings():
    """decode_step.py's tiling: the fields, then any named settings, into FusedDecodeStep's
    keyword arguments; fields not given keep its defaults."""
    bench = _benchmark("decode_step")
    assert bench.fused_tiling("8192x4x2x1x3,prefetch=2,splits=8,block_l=32") == {
        "tile_elements": 8192, "num_warps": 4, "programs_per_sm": 2, "waves": 1, "pipeline": 3,
        "prefetch": 2, "splits": 8, "block_l": 32,
    }  # fmt: skip
    assert bench.fused_tiling("16384x8x1") == {"waves": None, "tile_elements": 16384,
                                              "num_warps": 8, "programs_per_sm": 1}  # fmt: skip


def test_bi_decode_tiling_times_the_tilings_the_gpu_test_checks():
    """benchmarks/bi_decode_tiling.py: each row count draws its candidates from the kernel's
    timed set for its band (16 rows and fewer: decode; up to 64: small), every one of which
    test_matmul_tilings_agree_on_gpu checks; their labels name them apart."""
    from torchloom.kernels import batch_invariant_triton as kernels

    bench = _benchmark("bi_decode_tiling")
    bands = [bench.band(M) for M in (1, 16, 17, 64, 65)]
    assert bands == ["decode", "decode", "small", "small", None]
    for dtype in (torch.bfloat16, torch.float16):
        checked = kernels.checked_matmul_configs(dtype)
        for rows in ("decode", "small"):
            timed = kernels.timed_matmul_configs(dtype, rows)
            assert timed and set(timed) <= checked
            assert len({bench.label(c) for c in timed}) == len(timed)
    assert kernels.timed_matmul_configs(torch.float32, "small") == ()
