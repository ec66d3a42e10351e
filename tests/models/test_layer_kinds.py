"""A family that mixes layer kinds per layer index goes through the whole core with no change
to it: its own config class and flavors, a feed-forward kind the core has never seen, counts
and FLOPs from what is built, init, overrides, the trainer, a saved model folder, and a clear
refusal where a kind declares no tensor-parallel split. This is the "adding a model family"
guide (docs/adding_a_family.md) as a test."""

from __future__ import annotations

import json
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
from torchloom.train.loss import IGNORE_INDEX, CrossEntropy, cross_entropy_sum
from torchloom.train.trainer import Trainer


class GeluMLP(nn.Module):
    """A feed-forward kind the core does not know: fc2(gelu(fc1(x)))."""

    def __init__(self, dim: int, hidden: int, std: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, dim, bias=False)
        self.std = std

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(self.fc1(x_BTD))
        # An auxiliary loss the layer reports (as an MoE layer reports its balance loss).
        self._aux = 1e-3 * hidden.square().mean()
        return self.fc2(hidden)

    def pop_auxiliary_losses(self) -> dict[str, torch.Tensor]:
        aux, self._aux = getattr(self, "_aux", None), None
        return {} if aux is None else {"activation": aux}

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
    model = build_model(
        resolve_model_config(
            ModelConfig(name="hybrid", overrides={"dense_layers": 2, "num_layers": 4})
        )
    )
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
    logged = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert all(r["aux_activation"] > 0 for r in logged if "loss" in r)  # the layers' term, logged
    model, family, config = load_model(tmp_path / "run" / "model")
    assert family == "hybrid" and isinstance(config, HybridConfig)
    assert type(model.layers["2"].mlp) is GeluMLP
    tokens = torch.randint(0, 4096, (2, 16))
    with torch.no_grad():
        assert torch.equal(model(tokens), trainer.model.eval()(tokens))


def test_auxiliary_losses_that_layers_report_join_the_objective() -> None:
    """Each GELU layer reports an auxiliary term; the objective adds their sum times the
    micro-batch's label count (so the step's division makes it a token-weighted mean) and logs
    it; the gradient reaches fc1 through it."""
    model = build_model(resolve_model_config(ModelConfig(name="hybrid")))
    model.init_weights(0)
    tokens = torch.randint(0, 4096, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = tokens.roll(-1, 1)
    labels[:, -1] = IGNORE_INDEX
    hidden = [F.gelu(model.layers[i].mlp.fc1(x)) for i, x in _mlp_inputs(model, tokens).items()]
    aux = sum(1e-3 * h.square().mean() for h in hidden)
    plain = cross_entropy_sum(model(tokens), labels)
    model.auxiliary_losses()  # drop what the forward without an objective reported
    out = model(tokens, objective=CrossEntropy(), targets={"labels": labels})
    print(f"loss {out.loss.item():.6f} = CE {plain.item():.6f} + 22 x aux {aux.item():.3e}")
    torch.testing.assert_close(out.loss, plain + 22 * aux)
    torch.testing.assert_close(out.metrics["aux_activation"], 22 * aux.detach())
    assert model.auxiliary_losses() == {}, "each term is handed over once"


def _mlp_inputs(model, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """The normed input each GELU layer's MLP saw (captured with forward hooks)."""
    seen: dict[str, torch.Tensor] = {}
    hooks = [block.mlp.register_forward_hook(lambda m, args, out, i=i: seen.__setitem__(i, args[0]))
             for i, block in model.layers.items() if isinstance(block.mlp, GeluMLP)]  # fmt: skip
    model(tokens)
    for hook in hooks:
        hook.remove()
    model.auxiliary_losses()  # drop what this extra forward reported
    return seen


def test_a_kind_without_a_tensor_parallel_split_is_refused() -> None:
    with torch.device("meta"):
        model = build_model(resolve_model_config(ModelConfig(name="hybrid")))
    with pytest.raises(ConfigError, match="GeluMLP layers declare no tensor-parallel split"):
        decoder_tp_plan(model, 2)
