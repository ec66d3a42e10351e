"""The MoE layer against direct formulas: routing (softmax / sigmoid, bias, groups, scaling,
renormalisation), the grouped experts against a per-token loop (values and gradients), the
balance loss, the load count (once per token, recomputation or not) and the bias update."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from torchloom.kernels.grouped_mm import grouped_linear
from torchloom.models.components.moe import MoE, MoEConfig, balance_loss
from torchloom.models.components.param_init import ParamInit

DIM = 24
SIGMOID_GROUPS = MoEConfig(
    num_experts=8, top_k=3, expert_dim=20, num_shared_experts=2, score_func="sigmoid",
    num_groups=4, top_groups=2, normalize_top_k=True, route_scale=2.5, expert_bias=True,
    bias_update_rate=0.01,
)  # fmt: skip
SOFTMAX = MoEConfig(num_experts=6, top_k=2, expert_dim=16)


def _layer(cfg: MoEConfig, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    layer = MoE(DIM, cfg)
    layer.init_weights(ParamInit(layer, seed))
    with torch.no_grad():
        layer.router.weight.mul_(20)  # spread the scores so ties are impossible
        if layer.router.expert_bias is not None:
            layer.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, cfg.num_experts))
    return layer


def _direct(layer: MoE, x_ND: torch.Tensor) -> torch.Tensor:
    """The layer's output token by token, from the definitions in moe.py's docstring."""
    cfg, experts = layer.cfg, layer.experts
    out = []
    for x_D in x_ND:
        logits = layer.router.weight.float() @ x_D.float()
        scores = logits.softmax(-1) if cfg.score_func == "softmax" else logits.sigmoid()
        choice = scores.clone()
        if layer.router.expert_bias is not None:
            choice = choice + layer.router.expert_bias
        if cfg.num_groups > 1:
            size = cfg.num_experts // cfg.num_groups
            group_score = [sorted(choice[g * size : (g + 1) * size].tolist())[-2:]
                           for g in range(cfg.num_groups)]  # fmt: skip
            ranked = sorted(range(cfg.num_groups), key=lambda g: -sum(group_score[g]))
            allowed = {e for g in ranked[: cfg.top_groups] for e in range(g * size, (g + 1) * size)}
            choice = torch.tensor(
                [c.item() if e in allowed else -math.inf for e, c in enumerate(choice)]
            )
        chosen = sorted(range(cfg.num_experts), key=lambda e: -choice[e])[: cfg.top_k]
        weights = scores[chosen]
        if cfg.normalize_top_k:
            weights = weights / weights.sum()
        weights = weights * cfg.route_scale
        y = torch.zeros(DIM)
        for w, e in zip(weights, chosen, strict=True):
            hidden = F.silu(experts.gate_proj[e] @ x_D) * (experts.up_proj[e] @ x_D)
            y = y + w * (experts.down_proj[e] @ hidden)
        if layer.shared_experts is not None:
            y = y + layer.shared_experts(x_D)
        out.append(y)
    return torch.stack(out)


@pytest.mark.parametrize("cfg", [SIGMOID_GROUPS, SOFTMAX], ids=["sigmoid_groups", "softmax"])
def test_layer_matches_direct_formulas(cfg: MoEConfig) -> None:
    layer = _layer(cfg)
    x_BTD = torch.randn(2, 7, DIM, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = layer.eval()(x_BTD).reshape(-1, DIM)
        torch.testing.assert_close(ours, _direct(layer, x_BTD.reshape(-1, DIM)))


@pytest.mark.parametrize("cfg", [SIGMOID_GROUPS, SOFTMAX], ids=["shared_experts", "routed_only"])
def test_output_is_its_own_tensor_not_a_view(cfg: MoEConfig) -> None:
    """FSDP2 warns on every step when a module it wraps alone (the MoE under tensor or expert
    parallelism) returns a view; with and without shared experts, in fp32 and under bf16."""
    layer = _layer(cfg)
    x_BTD = torch.randn(2, 7, DIM)
    assert not layer(x_BTD)._is_view()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not layer(x_BTD)._is_view()


def test_gradients_match_the_direct_loop() -> None:
    layer = _layer(SIGMOID_GROUPS).train()
    reference = _layer(SIGMOID_GROUPS).train()
    x_ND = torch.randn(9, DIM, generator=torch.Generator().manual_seed(2))
    x1, x2 = x_ND.clone().requires_grad_(), x_ND.clone().requires_grad_()
    layer(x1[None]).square().sum().backward()
    _direct(reference, x2).square().sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad)
    for (name, ours), theirs in zip(layer.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, msg=name)


def test_grouped_linear_matches_a_loop_with_empty_groups() -> None:
    g = torch.Generator().manual_seed(3)
    x_MD, w_EOD = torch.randn(10, 6, generator=g), torch.randn(4, 5, 6, generator=g)
    ends = torch.tensor([3, 3, 10, 10], dtype=torch.int32)  # groups 1 and 3 empty
    out = grouped_linear(x_MD, w_EOD, ends)
    expected = torch.cat([x_MD[:3] @ w_EOD[0].T, x_MD[3:10] @ w_EOD[2].T])
    torch.testing.assert_close(out, expected)
    # A row in no group: torch._grouped_mm would leave it unwritten, so the loop refuses it.
    with pytest.raises(ValueError, match="groups end at row 9 of 10"):
        grouped_linear(x_MD, w_EOD, torch.tensor([3, 3, 9, 9], dtype=torch.int32))


def test_balance_loss_matches_its_formula() -> None:
    g = torch.Generator().manual_seed(4)
    E, K, B, T = 6, 2, 3, 5
    scores = torch.rand(B * T, E, generator=g)
    experts = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * T)])
    for groups in (B, 1):
        T_g = B * T // groups
        total = 0.0
        for s in range(groups):
            rows = range(s * T_g, (s + 1) * T_g)
            for i in range(E):
                f = E / (K * T_g) * sum(int((experts[t] == i).sum()) for t in rows)
                p = sum(float(scores[t, i] / scores[t].sum()) for t in rows) / T_g
                total += f * p
        expected = total / groups
        assert balance_loss(scores, experts, groups).item() == pytest.approx(expected, rel=1e-6)


def test_balance_loss_reaches_the_objective_once() -> None:
    cfg = MoEConfig(num_experts=4, top_k=2, expert_dim=8, balance_loss="sequence",
                    balance_loss_coef=0.1)  # fmt: skip
    layer = _layer(cfg).train()
    layer(torch.randn(2, 5, DIM))
    terms = layer.pop_auxiliary_losses()
    assert set(terms) == {"balance"} and terms["balance"].requires_grad
    assert layer.pop_auxiliary_losses() == {}
    with torch.no_grad():  # evaluation reports nothing
        layer.eval()(torch.randn(2, 5, DIM))
    assert layer.pop_auxiliary_losses() == {}


def test_load_is_counted_once_with_recomputation() -> None:
    """A checkpointed forward recomputed in the backward does not count its tokens again."""
    layer = _layer(SOFTMAX).train()
    x_BTD = torch.randn(2, 9, DIM, requires_grad=True)
    layer(x_BTD).sum().backward()
    plain = layer.take_load()
    assert plain.sum().item() == 2 * 9 * SOFTMAX.top_k
    out = torch.utils.checkpoint.checkpoint(layer, x_BTD, use_reentrant=False)
    out.sum().backward()
    torch.testing.assert_close(layer.take_load(), plain)
    assert layer.tokens_per_expert.sum().item() == 0


def test_bias_moves_toward_underloaded_experts() -> None:
    layer = _layer(SIGMOID_GROUPS)
    before = layer.router.expert_bias.clone()
    load = torch.tensor([10.0, 0, 5, 5, 5, 5, 1, 9])  # mean 5
    layer.update_bias(load)
    step = torch.tensor([-1.0, 1, 0, 0, 0, 0, 1, -1]) * SIGMOID_GROUPS.bias_update_rate
    torch.testing.assert_close(layer.router.expert_bias, before + step)
    assert "router.expert_bias" in layer.state_dict()  # saved with checkpoints
    assert "tokens_per_expert" not in layer.state_dict()


def test_config_refusals() -> None:
    from torchloom.config.errors import ConfigError

    for bad, message in (
        (dict(top_k=9), "top_k .9. exceeds moe.num_experts .8."),
        (dict(num_groups=3), "num_groups .3. must divide"),
        (dict(num_groups=4, top_groups=1, top_k=3), "raise moe.top_groups"),
        (dict(bias_update_rate=0.1), "needs moe.expert_bias true"),
        (dict(balance_loss="sequence"), "go together"),
        (dict(num_shared_experts=2, shared_expert_dim=48), "set moe.num_shared_experts 1"),
    ):
        with pytest.raises(ConfigError, match=message):
            MoEConfig(**{"num_experts": 8, **bad}).validate()


def test_compiles_as_one_graph_and_matches_eager() -> None:
    """fullgraph: the per-expert loop (CPU) is one opaque op, nothing breaks the graph."""
    layer = _layer(SOFTMAX).train()
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(2, 7, DIM, generator=torch.Generator().manual_seed(5))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    eager_out = layer(x1)
    eager_out.square().sum().backward()
    eager_grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    compiled_out = compiled(x2)
    compiled_out.square().sum().backward()
    torch.testing.assert_close(compiled_out, eager_out)
    torch.testing.assert_close(x2.grad, x1.grad)
    for p, expected in zip(layer.parameters(), eager_grads, strict=True):
        torch.testing.assert_close(p.grad, expected)
    assert layer.take_load().sum().item() == 2 * (2 * 7 * SOFTMAX.top_k)  # both passes counted


@pytest.mark.parametrize("kind, groups", [("sequence", 2), ("batch", 1)])
def test_balance_loss_kind_picks_its_token_runs(kind: str, groups: int) -> None:
    """'sequence' averages the loss over each sequence's tokens, 'batch' over the micro-batch:
    the layer's term equals the formula with that grouping and differs from the other one."""
    cfg = MoEConfig(num_experts=4, top_k=2, expert_dim=8, balance_loss=kind, balance_loss_coef=0.1)
    layer = _layer(cfg).train()
    x_BTD = torch.randn(2, 5, DIM, generator=torch.Generator().manual_seed(7))
    layer(x_BTD)
    term = layer.pop_auxiliary_losses()["balance"].item()
    with torch.no_grad():
        _, experts_NK, scores_NE = layer.router(x_BTD.reshape(-1, DIM))
    mine = 0.1 * balance_loss(scores_NE, experts_NK, groups).item()
    other = 0.1 * balance_loss(scores_NE, experts_NK, 3 - groups).item()
    print(f"{kind}: layer {term:.6f}, formula {mine:.6f}, other grouping {other:.6f}")
    assert abs(mine - other) > 1e-4  # the input tells the two apart
    assert term == pytest.approx(mine, rel=1e-6)
