"""A family that mixes layer kinds per layer index goes through the whole core with no change
to it: its own config class and flavors, a feed-forward kind the core has never seen, counts
and FLOPs from what is built, init, overrides, the trainer, a saved model folder, and a clear
refusal where a kind declares no tensor-parallel split. This is the "adding a model family"
guide (docs/adding_a_family.md) as a test."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchloom.checkpoint.model_io import load_model
from torchloom.cli import resolve_job
from torchloom.config import ConfigError
from torchloom.models import (
    LayerSpec,
    ModelConfig,
    ModelSpec,
    ParamInit,
    TransformerConfig,
    build_model,
    registry,
    resolve_model_config,
)
from torchloom.models.components import decoder
from torchloom.models.components.decoder_plan import decoder_tp_plan
from torchloom.train.trainer import Trainer


class GeluMLP(nn.Module):
    """A feed-forward kind the core does not know: fc2(gelu(fc1(x)))."""

    def __init__(self, dim: int, hidden: int, std: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, dim, bias=False)
        self.std = std

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x_BTD)))

    def init_weights(self, init: ParamInit) -> None:
        init.trunc_normal_(self.fc1.weight, self.std)
        init.trunc_normal_(self.fc2.weight, self.std)

    def flops_per_token(self, seq_len: int) -> int:
        return 6 * (self.fc1.weight.numel() + self.fc2.weight.numel())


@dataclass(frozen=True)
class HybridConfig(TransformerConfig):
    """SwiGLU in the first ``dense_layers`` layers, the GELU MLP after."""

    dense_layers: int = 1
    gelu_dim: int = 96

    def layer_specs(self) -> list[LayerSpec]:
        return [LayerSpec("attention", "swiglu" if i < self.dense_layers else "gelu_mlp")
                for i in range(self.num_layers)]  # fmt: skip


FLAVOR = HybridConfig(vocab_size=4096, dim=64, num_layers=3, num_heads=4, num_kv_heads=2,
                      ffn_dim=192, max_seq_len=512)  # fmt: skip


@pytest.fixture(autouse=True)
def hybrid_family(monkeypatch):
    monkeypatch.setitem(
        decoder.FFNS, "gelu_mlp", lambda cfg, i: GeluMLP(cfg.dim, cfg.gelu_dim, cfg.init_std)
    )
    spec = ModelSpec("hybrid", HybridConfig, {"debug": FLAVOR}, description="test family",
                     tp_plan=decoder_tp_plan)  # fmt: skip
    monkeypatch.setitem(registry._MODELS, "hybrid", spec)


def test_the_layers_are_of_the_kinds_the_config_says() -> None:
    model = build_model(ModelConfig(name="hybrid", overrides={"dense_layers": 2, "num_layers": 4}))
    kinds = [type(block.mlp).__name__ for block in model.layers.values()]
    assert kinds == ["SwiGLU", "SwiGLU", "GeluMLP", "GeluMLP"]
    cfg = model.config
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    attention = 64 * 16 * (2 * 4 + 2 * 2)  # q, o (4 heads of 16) and k, v (2) per layer
    matmuls = 4 * attention + 2 * 3 * 64 * 192 + 2 * 2 * 64 * 96 + 4096 * 64
    assert cfg.flops_per_token(128) == 6 * matmuls + 6 * 4 * 4 * 16 * 128
    with pytest.raises(ConfigError, match="Unknown model override 'gelu_dm'.*gelu_dim"):
        resolve_model_config(ModelConfig(name="hybrid", overrides={"gelu_dm": 8}))


def test_it_initializes_trains_saves_and_reloads(tmp_path) -> None:
    _, job = resolve_job(["--recipe", "debug", "--model.name", "hybrid", "--training.steps", "3",
                          "--output.dir", str(tmp_path / "run"), "--metrics.tensorboard", "false",
                          "--training.sample_tokens", "0"])  # fmt: skip
    trainer = Trainer(job)
    result = trainer.train()
    assert result.last_loss < result.first_loss
    model, family, config = load_model(tmp_path / "run" / "model")
    assert family == "hybrid" and isinstance(config, HybridConfig)
    assert type(model.layers["2"].mlp) is GeluMLP
    tokens = torch.randint(0, 4096, (2, 16))
    with torch.no_grad():
        assert torch.equal(model(tokens), trainer.model.eval()(tokens))


def test_a_kind_without_a_tensor_parallel_split_is_refused() -> None:
    with torch.device("meta"):
        model = build_model(ModelConfig(name="hybrid"))
    with pytest.raises(ConfigError, match="GeluMLP layers declare no tensor-parallel split"):
        decoder_tp_plan(model, 2)
