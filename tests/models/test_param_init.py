"""Each module initializes its own parameters, from a seed, in a layout-invariant way; a
parameter nobody initialized is an error, not uninitialized memory. (That every FSDP / TP / PP
layout gets bitwise the same weights is tests/parallel/test_layouts.py's init check.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchloom.models import ModelConfig, build_model, list_models, resolve_model_config
from torchloom.models.components.attention import Attention
from torchloom.models.components.param_init import ParamInit


def _materialized(config: ModelConfig, fill: float = float("nan")) -> nn.Module:
    with torch.device("meta"):
        model = build_model(resolve_model_config(config))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(fill)  # what to_empty might leave: anything
    return model


@pytest.mark.parametrize("family", [spec.name for spec in list_models()])
@pytest.mark.parametrize("tied", [False, True])
def test_every_parameter_of_every_family_is_initialized(family: str, tied: bool) -> None:
    transforms = ["tie_embeddings" if tied else "untie_embeddings"]
    model = _materialized(ModelConfig(name=family, transforms=transforms))
    model.init_weights(7)
    left = [name for name, p in model.named_parameters() if torch.isnan(p).any()]
    assert not left, f"{family}: left uninitialized: {left}"


def test_a_parameter_nobody_initializes_is_an_error() -> None:
    class AttentionWithGate(Attention):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.gate = nn.Parameter(torch.empty(4))  # a new kind its init_weights forgot

    model = _materialized(ModelConfig(name="llama3"))
    block = model.layers["1"]
    old = block.attention
    block.attention = AttentionWithGate(64, 4, 2, 16)
    block.attention.load_state_dict(old.state_dict(), strict=False)
    with pytest.raises(RuntimeError, match=r"uninitialized: layers\.1\.attention\.gate"):
        model.init_weights(0)


def test_same_seed_same_weights_and_the_documented_distributions() -> None:
    first, second = (_materialized(ModelConfig(name="llama3")) for _ in range(2))
    first.init_weights(3)
    second.init_weights(3)
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name
    other = _materialized(ModelConfig(name="llama3"))
    other.init_weights(4)
    assert not torch.equal(other.output.weight, first.output.weight)
    cfg = first.config
    block = first.layers["0"]
    std, residual = cfg.init_std, cfg.init_std / (2 * cfg.num_layers) ** 0.5
    q, o = block.attention.q_proj.weight, block.attention.o_proj.weight
    print(f"q std {q.std():.4f} (want ~{std}), o std {o.std():.4f} (want ~{residual:.4f})")
    assert abs(q.std() - std) < 0.1 * std and q.abs().max() <= 3 * std
    assert abs(o.std() - residual) < 0.1 * residual and o.abs().max() <= 3 * residual
    assert torch.equal(block.attention_norm.weight, torch.ones_like(block.attention_norm.weight))
    embed = first.embed_tokens.weight
    assert abs(embed.std() - std) < 0.05 * std and embed.abs().max() > 3 * std  # not truncated


def test_the_seed_comes_from_each_parameter_s_name() -> None:
    """Same-shaped parameters (every layer's q_proj, ...) get different values, and a parameter's
    values follow its name, not the order in which the parameters are registered."""
    model = _materialized(ModelConfig(name="llama3"))
    model.init_weights(3)
    randoms = {n: p for n, p in model.named_parameters() if p.std() > 0}  # not ones / zeros
    by_shape: dict[tuple[int, ...], list[str]] = {}
    for name, p in randoms.items():
        by_shape.setdefault(tuple(p.shape), []).append(name)
    pairs = [(a, b) for names in by_shape.values() for a in names for b in names if a < b]
    assert len(pairs) >= 5, by_shape
    same = [(a, b) for a, b in pairs if torch.equal(randoms[a], randoms[b])]
    assert not same, f"identical values: {same}"

    def init(order: list[str]) -> dict[str, torch.Tensor]:
        layers = nn.ModuleDict({name: nn.Linear(4, 4, bias=False) for name in order})
        param_init = ParamInit(layers, seed=5)
        for layer in layers.values():
            param_init.normal_(layer.weight, std=1.0)
        return {name: layer.weight.detach().clone() for name, layer in layers.items()}

    forward, backward = init(["a", "b"]), init(["b", "a"])
    for name in ("a", "b"):
        assert torch.equal(forward[name], backward[name]), name
