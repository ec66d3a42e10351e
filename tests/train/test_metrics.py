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
