import json

import pytest
import torch

from torchloom.train.metrics import MetricsConfig, MetricsLogger, device_peak_tflops, read_records


def test_step_record_arithmetic_and_jsonl(tmp_path):
    logger = MetricsLogger(
        tmp_path, MetricsConfig(tensorboard=False, peak_tflops=100.0), 10, torch.device("cpu"),
        flops_per_token=1e9,
    )  # fmt: skip
    record = logger.step_record(3, 2.5, float("nan"), 1e-3, tokens=4000, step_seconds=2.0,
                                data_seconds=0.1, num_devices=2)  # fmt: skip
    assert record["tps"] == 1000.0
    assert record["tflops"] == pytest.approx(1.0)
    assert record["mfu"] == pytest.approx(1.0)
    logger.log(record)
    logger.close()
    written = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert written["grad_norm"] is None  # non-finite numbers become null, JSON stays valid
    assert written["loss"] == 2.5


def test_cpu_has_no_invented_peak():
    peak, name = device_peak_tflops(torch.device("cpu"))
    assert peak is None and name.startswith("CPU")
    assert device_peak_tflops(torch.device("cpu"), override=50.0)[0] == 50.0


def test_should_log_first_last_and_interval(tmp_path):
    logger = MetricsLogger(tmp_path, MetricsConfig(log_interval=5), 12, torch.device("cpu"), 1.0,
                           enabled=False)  # fmt: skip
    assert [s for s in range(1, 13) if logger.should_log(s)] == [1, 5, 10, 12]


def test_records_survive_non_utf8_bytes_left_by_a_crash(tmp_path, capsys):
    """A crash can leave a torn line with arbitrary bytes (here invalid UTF-8): the records
    around it are read and the line is skipped with a warning naming it."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 2.5}\n{"step": 2, "lo\xff\xfe\x00\x9c\n'
                     b'{"step": 3, "loss": 2.25}\n')  # fmt: skip
    assert read_records(path) == [{"step": 1, "loss": 2.5}, {"step": 3, "loss": 2.25}]
    assert capsys.readouterr().err == (
        f"warning: skipping line 2 of {path}: not a metrics record (a write cut short by a kill "
        "or a full disk)\n"
    )


def test_step_record_counts_the_vision_encoder_per_image_grid(tmp_path):
    """Two images of known grids through qwen3_vl's debug encoder, counted by hand: 6 FLOPs per
    weight per patch (patch embedding 96x32, per block qkv 32x96, proj 32x32, MLP 32x64 twice),
    attention 12 * dim * frame patches per block, and 6 per merger weight per merged token
    (the merger and two DeepStack mergers, each 128x128 + 128x64)."""
    from torchloom.models import resolve_model_config
    from torchloom.models.components.multimodal import media_flops
    from torchloom.models.config import ModelConfig

    config = resolve_model_config(ModelConfig(name="qwen3_vl", flavor="debug"))
    grids = torch.tensor([[[1, 4, 4], [1, 2, 6]], [[0, 0, 0], [0, 0, 0]]])  # one row empty
    per_patch = 96 * 32 + 2 * (32 * 96 + 32 * 32 + 2 * 32 * 64)
    per_merged = 3 * (128 * 128 + 128 * 64)
    by_hand = sum(
        t * h * w * (6 * per_patch + 2 * 12 * 32 * h * w) + t * h * w // 4 * 6 * per_merged
        for t, h, w in [(1, 4, 4), (1, 2, 6)]
    )
    assert by_hand == 3833856 + 2838528
    flops = media_flops(config, {"image_grid_thw": grids})
    assert flops == by_hand, f"counted {flops}, by hand {by_hand}"
    logger = MetricsLogger(tmp_path, MetricsConfig(tensorboard=False, peak_tflops=1.0), 10,
                           torch.device("cpu"), flops_per_token=1e6, enabled=False)  # fmt: skip
    record = logger.step_record(1, 2.0, 1.0, 1e-3, tokens=1000, step_seconds=1e-3,
                                data_seconds=0.0, num_devices=2, media_flops=flops)  # fmt: skip
    text_tflops = 1000 * 1e6 / 1e-3 / 2 / 1e12
    assert record["media_tflops"] == pytest.approx(by_hand / 1e-3 / 2 / 1e12)
    assert record["tflops"] == pytest.approx(text_tflops + by_hand / 1e-3 / 2 / 1e12)
    assert record["mfu"] == pytest.approx(100 * record["tflops"])
    text_only = logger.step_record(1, 2.0, 1.0, 1e-3, 1000, 1e-3, 0.0, num_devices=2)
    assert "media_tflops" not in text_only and text_only["tflops"] == pytest.approx(text_tflops)
