import math

import pytest
import torch

from torchloom.train.optim import (
    LRScheduleConfig,
    OptimizerConfig,
    build_lr_scheduler,
    build_optimizer,
    lr_multiplier,
)


def _curve(decay: str, steps: int = 100, warmup: int = 10, **kw) -> list[float]:
    cfg = LRScheduleConfig(warmup_steps=warmup, decay=decay, min_lr_ratio=0.1, **kw)
    return [lr_multiplier(s, steps, cfg) for s in range(steps)]


@pytest.mark.parametrize("decay", ["cosine", "linear", "wsd", "constant"])
def test_warmup_is_linear_and_reaches_peak(decay):
    curve = _curve(decay)
    assert curve[:10] == pytest.approx([(s + 1) / 11 for s in range(10)])
    assert max(curve) == pytest.approx(1.0, abs=0.02)


def test_decay_shapes_end_at_the_floor():
    cosine, linear, wsd = _curve("cosine"), _curve("linear"), _curve("wsd", decay_fraction=0.2)
    assert cosine[-1] == pytest.approx(0.1) and linear[-1] == pytest.approx(0.1)
    assert cosine[55] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 46 / 90)))
    assert linear[55] == pytest.approx(1 - 0.9 * 46 / 90)
    assert wsd[10:80] == [1.0] * 70  # stable phase
    assert wsd[-1] == pytest.approx(0.1) and wsd[80] == pytest.approx(1 - 0.9 / 20)
    assert _curve("constant")[-1] == 1.0


def test_scheduler_follows_the_multiplier_and_restores():
    model = torch.nn.Linear(4, 4)
    opt = build_optimizer(model, OptimizerConfig(lr=1.0), torch.device("cpu"))
    cfg = LRScheduleConfig(warmup_steps=2)
    sched = build_lr_scheduler(opt, cfg, 10)
    seen = []
    for _ in range(5):
        seen.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert seen == pytest.approx([lr_multiplier(s, 10, cfg) for s in range(5)])
    state = sched.state_dict()
    sched2 = build_lr_scheduler(opt, cfg, 10)
    sched2.load_state_dict(state)
    assert sched2.get_last_lr() == sched.get_last_lr()


def test_weight_decay_only_on_matrices_not_embeddings_or_norms():
    model = torch.nn.Sequential(
        torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)
    )
    opt = build_optimizer(model, OptimizerConfig(weight_decay=0.1), torch.device("cpu"))
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == {id(model[1].weight)}
