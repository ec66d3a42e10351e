import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from torchloom.cli import main
from torchloom.config.errors import ConfigError
from torchloom.train.profiling import (
    ProfilingConfig,
    StepProfiler,
    format_kernel_summary,
    kernel_kind,
    kernel_summary,
)


def test_chosen_steps_are_traced(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--recipe", "debug", "--training.steps", "4", "--training.sample_tokens",
                 "0", "--metrics.tensorboard", "false", "--profiling.steps", "[2, 3]",
                 "--output.dir", str(out)]) == 0  # fmt: skip
    trace = out / "profile" / "trace_rank0_steps2-3.json"
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    matmuls = sum(e.get("name") == "aten::mm" for e in events)
    print(f"{trace.name}: {len(events)} events, {matmuls} aten::mm")
    # Exactly the 2 chosen steps: 2 layers x 7 linears + the head = 15 matmuls forward and 30
    # backward (input and weight gradients) per step.
    assert "aten::mm" in names and matmuls == 2 * 3 * 15
    assert [p.name for p in (out / "profile").iterdir()] == [trace.name]


def test_profiling_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="consecutive"):
        ProfilingConfig(steps=[2, 5]).validate()
    with pytest.raises(ConfigError, match="memory_snapshot"):
        StepProfiler(ProfilingConfig(steps=[1], memory_snapshot=True), tmp_path, 0,
                     torch.device("cpu"))  # fmt: skip


def test_kernel_kinds_and_summary():
    """Kernel names as CUPTI reports them map to their kinds; a CPU-only profile has no GPU
    kernels, so its summary is empty but well formed."""
    names = {
        "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN": "matmul",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16": "attention",
        "triton_poi_fused__to_copy_mul_0": "triton",
        "_cross_entropy_grad_kernel": "triton",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda": "copy",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<": "multi_tensor",
        "ncclDevKernel_AllGather_RING_LL": "communication",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4": "elementwise",
        "some_unknown_thing": "other",
    }
    assert {name: kernel_kind(name) for name in names} == names
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.randn(8, 8) @ torch.randn(8, 8)
    summary = kernel_summary(prof, steps=2, wall_s=0.01)
    assert summary["gpu_busy_ms_per_step"] == 0 and summary["top"] == []
    assert summary["wall_ms_per_step"] == 5.0
    assert "5.000 ms/step wall" in format_kernel_summary("cpu", summary)
