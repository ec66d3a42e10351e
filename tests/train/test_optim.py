import math

import numpy as np
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


def _scheduled_rates(lr: float, cfg: LRScheduleConfig, total: int, steps: int):
    """(optimizer, scheduler, the rate of each of the first ``steps`` steps)."""
    opt = build_optimizer(torch.nn.Linear(4, 4), OptimizerConfig(lr=lr), torch.device("cpu"))
    sched = build_lr_scheduler(opt, cfg, total)
    seen = []
    for _ in range(steps):
        seen.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return opt, sched, seen


def test_scheduler_follows_the_multiplier_and_restores():
    cfg = LRScheduleConfig(warmup_steps=2)
    opt, sched, seen = _scheduled_rates(1.0, cfg, 10, 5)
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


def _expected_multipliers(cfg: LRScheduleConfig, total: int) -> list[float]:
    """The documented schedule, step by step: warm-up step i (1-based, i <= W) gives i / (W + 1);
    the k-th step after warm-up has decay progress k / (total - W), so the last step of the run
    sits at the floor; WSD instead holds the peak until its last D = round(f * total) steps,
    which fall linearly, the j-th of them to 1 - (1 - floor) * j / D."""
    warmup, floor = cfg.warmup_steps, cfg.min_lr_ratio
    out = [i / (warmup + 1) for i in range(1, min(warmup, total) + 1)]
    span = max(1, total - warmup)
    decay_steps = max(1, round(cfg.decay_fraction * total))
    for step in range(warmup, total):
        k = step - warmup + 1  # 1 for the first step after warm-up
        if cfg.decay == "constant":
            out.append(1.0)
        elif cfg.decay == "linear":
            out.append(1.0 - (1.0 - floor) * min(1.0, k / span))
        elif cfg.decay == "cosine":
            out.append(floor + (1.0 - floor) * (1.0 + math.cos(math.pi * min(1.0, k / span))) / 2)
        else:  # wsd: the j-th of the last decay_steps steps of the run
            j = step - (total - decay_steps) + 1
            out.append(1.0 if j < 1 else 1.0 - (1.0 - floor) * min(1.0, j / decay_steps))
    return out


_SCHEDULES = [  # (total steps, warm-up steps, min_lr_ratio, decay_fraction)
    (100, 10, 0.1, 0.2),
    (20, 0, 0.0, 0.3),
    (7, 1, 0.25, 0.5),
    (12, 11, 0.1, 0.2),  # warm-up ends on the last step but one, inside WSD's decay window
    (5, 5, 0.1, 0.2),  # warm-up as long as the run
    (3, 8, 0.1, 0.2),  # and longer
    (1, 0, 0.5, 1.0),
    (30, 4, 1.0, 0.1),  # a floor at the peak: flat after warm-up
]


@pytest.mark.parametrize("decay", ["cosine", "linear", "wsd", "constant"])
@pytest.mark.parametrize(("total", "warmup", "floor", "fraction"), _SCHEDULES)
def test_every_step_follows_the_closed_form(decay, total, warmup, floor, fraction):
    cfg = LRScheduleConfig(
        warmup_steps=warmup, decay=decay, min_lr_ratio=floor, decay_fraction=fraction
    )
    got = [lr_multiplier(s, total, cfg) for s in range(total)]
    want = _expected_multipliers(cfg, total)
    wrong = [(s, g, w) for s, (g, w) in enumerate(zip(got, want)) if abs(g - w) > 1e-12]
    assert not wrong, f"{len(wrong)} of {total} steps differ; (step, got, expected): {wrong[:4]}"
    if decay != "constant" and total > warmup:
        assert got[-1] == pytest.approx(floor, abs=1e-12), "the last step sits at the floor"
    assert min(got) >= min(floor, got[0]) - 1e-12


@pytest.mark.parametrize("decay", ["cosine", "linear", "wsd", "constant"])
def test_scheduler_gives_every_step_its_float32_rate(decay):
    cfg = LRScheduleConfig(warmup_steps=3, decay=decay, min_lr_ratio=0.2, decay_fraction=0.5)
    _, _, seen = _scheduled_rates(2e-3, cfg, 12, 12)
    want = [float(np.float32(2e-3 * m)) for m in _expected_multipliers(cfg, 12)]
    assert seen == want, [g - w for g, w in zip(seen, want)]


def _two_optimizers(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """AdamW for the matrices, SGD with momentum for the rest: a container of two kinds."""
    matrices = [p for p in model.parameters() if p.ndim == 2]
    vectors = [p for p in model.parameters() if p.ndim != 2]
    return [torch.optim.AdamW(matrices, lr=1.0), torch.optim.SGD(vectors, lr=1.0, momentum=0.9)]


def test_a_container_of_two_optimizers_steps_schedules_and_checkpoints(tmp_path):
    """Each optimizer updates its own parameters as it would alone; one schedule sets both
    rates; a DCP checkpoint restores both, and the schedule still reaches them afterwards (a
    loaded optimizer has new group dicts)."""
    from torchloom.checkpoint.stateful import OptimizerState
    from torchloom.train.optim import OptimizerContainer

    torch.manual_seed(0)
    model, twin = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    twin.load_state_dict(model.state_dict())
    container, separate = OptimizerContainer(_two_optimizers(model)), _two_optimizers(twin)
    cfg = LRScheduleConfig(warmup_steps=2, decay="linear", min_lr_ratio=0.0)
    scheduler = build_lr_scheduler(container, cfg, total_steps=6)
    x = torch.randn(5, 4)

    def step(m, optimizers) -> None:
        m(x).square().sum().backward()
        for o in optimizers:
            o.step()
            o.zero_grad()

    for s in range(3):
        step(model, [container])
        scheduler.step()
        for o in separate:
            for g in o.param_groups:
                g["lr"] = float(np.float32(lr_multiplier(s, 6, cfg)))  # the rate of step s
        step(twin, separate)
    for name, p in model.named_parameters():
        assert torch.equal(p, twin.get_parameter(name)), name
    assert [g["lr"] for g in container.param_groups] == [
        float(np.float32(lr_multiplier(3, 6, cfg)))
    ] * 2

    import torch.distributed.checkpoint as dcp

    dcp.save({"optimizer": OptimizerState(model, container)}, checkpoint_id=str(tmp_path))
    restored = OptimizerContainer(_two_optimizers(model))
    dcp.load({"optimizer": OptimizerState(model, restored)}, checkpoint_id=str(tmp_path))
    for mine, theirs in zip(restored.optimizers, container.optimizers):
        for p in mine.state:
            for key, value in mine.state[p].items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(theirs.state[p][key]))
    schedule = build_lr_scheduler(restored, cfg, total_steps=6)
    schedule.load_state_dict(scheduler.state_dict())
    schedule.step()
    want = float(np.float32(lr_multiplier(4, 6, cfg)))
    assert [g["lr"] for o in restored.optimizers for g in o.param_groups] == [want, want]
