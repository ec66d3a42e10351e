import json

import pytest
import torch

from torchloom.cli import main
from torchloom.config.errors import ConfigError
from torchloom.train.profiling import ProfilingConfig, StepProfiler


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
