"""Float8 training (torchao): which linears convert, unchanged parameter names, config, numerics.

torchao's Float8Linear runs on the CPU through PyTorch's reference ``_scaled_mm`` (slow), so
the numerics here use tiny shapes; the GPU tests train the debug model, also compiled.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest
import torch
from torch import nn

from torchloom.cli import resolve_job
from torchloom.config.errors import ConfigError
from torchloom.kernels.float8 import TORCHAO_REQUIREMENT, convert_linears_to_float8
from torchloom.models import (
    Decoder,
    ModelConfig,
    TransformerConfig,
    apply_transforms,
    build_model,
    resolve_model_config,
)
from torchloom.models.config import apply_overrides as apply_model_overrides
from torchloom.train.compile import CompileConfig, compile_regions
from torchloom.train.loss import CrossEntropy
from torchloom.train.trainer import Trainer

Float8Linear = pytest.importorskip("torchao.float8.float8_linear").Float8Linear

TINY = TransformerConfig(
    vocab_size=128, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=128, max_seq_len=64
)
BLOCK_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _model(cfg: TransformerConfig) -> nn.Module:
    model = build_model(cfg)
    model.init_weights(0)
    return model


def _float8_names(model: nn.Module) -> set[str]:
    return {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_block_linears_convert_and_names_stay(recipe: str) -> None:
    with torch.device("meta"):  # as the trainer builds it
        plain, float8 = build_model(TINY), build_model(replace(TINY, float8=recipe))
    linear_names = {n for n, m in float8.named_modules() if isinstance(m, nn.Linear)}
    assert {n.rsplit(".", 1)[-1] for n in linear_names} >= set(BLOCK_LINEARS)
    assert _float8_names(float8) == linear_names - {"output"}, "head and embedding stay"
    assert type(float8.output) is nn.Linear and type(float8.embed_tokens) is nn.Embedding
    assert list(float8.state_dict()) == list(plain.state_dict())
    assert [(n, p.shape) for n, p in float8.named_parameters()] == [
        (n, p.shape) for n, p in plain.named_parameters()
    ]


def test_linears_not_multiples_of_16_stay_high_precision() -> None:
    model = build_model(replace(TINY, ffn_dim=40, float8="rowwise"))
    converted = {name.rsplit(".", 1)[1] for name in _float8_names(model)}
    assert converted == {"q_proj", "k_proj", "v_proj", "o_proj"}, converted


def test_slot_transforms_and_refusals() -> None:
    assert resolve_model_config(ModelConfig(float8="rowwise")).float8 == "rowwise"
    assert apply_transforms(TINY, ["float8_tensorwise"]).float8 == "tensorwise"
    assert apply_transforms(TINY, ["float8_rowwise"]).float8 == "rowwise"
    with pytest.raises(ConfigError, match="use --model.float8 rowwise"):
        apply_model_overrides(TINY, {"float8": "rowwise"})
    with pytest.raises(ConfigError, match="Unknown float8 recipe 'rowise'.*'rowwise'"):
        replace(TINY, float8="rowise").validate()  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="float8 and batch_invariant"):
        replace(TINY, float8="rowwise", batch_invariant=True).validate()


def test_missing_torchao_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import now raises ImportError
    with pytest.raises(ConfigError, match=f"pip install '{TORCHAO_REQUIREMENT}'"):
        convert_linears_to_float8(Decoder(TINY), "rowwise")


def _loss_and_grads(model: nn.Module, tokens: torch.Tensor) -> tuple[float, torch.Tensor]:
    model.zero_grad()
    targets = {"labels": tokens[:, 1:]}
    loss = model(tokens[:, :-1], objective=CrossEntropy(), targets=targets).loss
    loss = loss / tokens[:, 1:].numel()
    loss.backward()
    return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_loss_and_gradients_track_high_precision(recipe: str) -> None:
    tokens = torch.randint(0, TINY.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    loss, grads = _loss_and_grads(_model(TINY), tokens)
    loss8, grads8 = _loss_and_grads(_model(replace(TINY, float8=recipe)), tokens)
    grad_error = ((grads8 - grads).norm() / grads.norm()).item()
    print(f"{recipe}: loss {loss8:.6f} vs {loss:.6f}, gradient relative error {grad_error:.3f}")
    assert abs(loss8 - loss) / loss < 1e-3 and grad_error < 0.1


def test_float8_blocks_compile() -> None:
    tokens = torch.randint(0, TINY.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    eager = _model(replace(TINY, float8="tensorwise"))
    compiled = _model(replace(TINY, float8="tensorwise"))
    assert compile_regions(compiled, CompileConfig(enabled=True, backend="aot_eager"))
    loss, grads = _loss_and_grads(eager, tokens)
    loss_c, grads_c = _loss_and_grads(compiled, tokens)
    print(f"compiled (aot_eager) vs eager float8: loss diff {abs(loss - loss_c):.2e}")
    torch.testing.assert_close(grads_c, grads, rtol=1e-5, atol=1e-6)


def _train(tmp_path, name: str, *overrides: str) -> tuple[Trainer, list[float]]:
    _, job = resolve_job(
        ["--recipe", "debug", "--output.dir", str(tmp_path / name), "--training.steps", "10",
         "--training.seq_len", "32", "--training.global_batch_size", "2",
         "--training.val_sequences", "2", "--metrics.tensorboard", "false",
         "--training.sample_tokens", "0", *overrides]
    )  # fmt: skip
    trainer = Trainer(job)
    trainer.train()
    records = map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
    return trainer, [r["loss"] for r in records if "loss" in r]


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory) -> list[float]:
    return _train(tmp_path_factory.mktemp("float8"), "reference")[1]


@pytest.mark.parametrize("transform", ["float8_rowwise", "float8_tensorwise"])
def test_trainer_float8_tracks_the_reference_and_saves_plain_models(
    tmp_path, reference_losses: list[float], transform: str
) -> None:
    trainer, losses = _train(tmp_path, "f8", "--model.transforms", f'["{transform}"]',
                             "--checkpoint.export_hf", "true")  # fmt: skip
    assert trainer.model_config.float8 == transform.removeprefix("float8_")
    worst = max(abs(a - b) / b for a, b in zip(losses, reference_losses))
    print(f"{transform}: worst relative loss difference over 10 steps {worst:.2e}")
    assert worst < 0.01
    saved = json.loads((tmp_path / "f8" / "model" / "config.json").read_text())["config"]
    assert saved["float8"] == "none"  # the weights are high precision; so is the saved model
    hf = json.loads((tmp_path / "f8" / "hf" / "config.json").read_text())
    assert hf["num_hidden_layers"] == 2


def _cuda_losses(tmp_path, name: str, *overrides: str) -> list[float]:
    return _train(tmp_path, name, "--training.device", "cuda", "--training.steps", "20",
                  "--training.seq_len", "256", "--training.global_batch_size", "8",
                  "--compile.enabled", "true", *overrides)[1]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_float8_on_gpu_compiles_and_tracks_bf16(tmp_path, recipe: str) -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 matmuls need compute capability 8.9+")
    bf16 = _cuda_losses(tmp_path, "bf16")
    float8 = _cuda_losses(tmp_path, "float8", "--model.float8", recipe)
    diffs = [abs(a - b) / b for a, b in zip(float8, bf16)]
    print(f"{recipe} vs bf16 over 20 compiled steps: losses {float8[0]:.4f} -> {float8[-1]:.4f} "
          f"vs {bf16[0]:.4f} -> {bf16[-1]:.4f}; worst relative difference {max(diffs):.2e}")  # fmt: skip
    assert len(float8) == 20 and max(diffs) < 0.03
    assert float8[-1] < float8[0] - 1.0, "float8 training learns"


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["--parallel.tp 2", "--parallel.dp_shard 2"])
def test_float8_composes_with_tensor_and_data_parallelism(tmp_path, torchrun_train, layout: str):
    """Converted at build, before TP and FSDP wrap the blocks: the layouts' losses match one
    process's (float8 scales of a sharded weight are taken over the whole weight)."""
    args = ["--recipe", "debug", "--model.float8", "rowwise", "--training.steps", "3",
            "--training.seq_len", "32", "--training.global_batch_size", "4",
            "--training.val_sequences", "4", "--metrics.tensorboard", "false",
            "--training.sample_tokens", "0", "--training.device", "cpu"]  # fmt: skip
    _, single = _train(tmp_path, "single", *args[2:])
    torchrun_train(2, *args, *layout.split(), "--output.dir", str(tmp_path / "layout"))
    records = map(json.loads, (tmp_path / "layout" / "metrics.jsonl").read_text().splitlines())
    parallel = [r["loss"] for r in records if "loss" in r]
    worst = max(abs(a - b) / b for a, b in zip(parallel, single))
    print(f"{layout}: losses {parallel} vs one process {single}; worst relative {worst:.1e}")
    assert len(parallel) == 3 and worst < 1e-3
