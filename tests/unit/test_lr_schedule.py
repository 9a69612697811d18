"""sparkdl/strategies/lr_schedule.py: built-in curves against torch's own schedulers, checkpoint
round trip, callable schedules, step_every=0 meaning once per epoch.

Curves are read as the optimizer's lr before each optimizer step t = 0..total (the lr step t uses),
stepping optimizer.step() then scheduler.step() in between. With warm-up W the reference is
SequentialLR([LambdaLR(t / W), <torch scheduler over total - W steps>], milestones=[W]): at the
milestone SequentialLR restarts the second scheduler at its epoch 0 (_update_lr(0)), so its lr at
step W is the base lr and step W + s uses the second scheduler's epoch s -- the same as ours, no
off-by-one (the comparison below covers every step 0..total, including W).
"""
from __future__ import annotations

import io
import types

import pytest
import torch
from torch.optim import lr_scheduler as tls

from sparkdl.errors import ConfigError, ModelError
from sparkdl.strategies.lr_schedule import LrCurve, build_scheduler, current_lr

LR, MIN_LR, TOTAL = 0.1, 0.004, 30


def train_cfg(**kw):
    base = dict(lr=LR, lr_schedule="constant", warmup_steps=0, min_lr=0.0, step_every=0, step_gamma=0.1)
    return types.SimpleNamespace(**{**base, **kw})


def sgd():
    return torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=LR)


def curve(opt, sched, total=TOTAL):
    """lr before each optimizer step 0..total."""
    lrs = []
    for _ in range(total + 1):
        lrs.append(current_lr(opt))
        opt.step()
        if sched is not None:
            sched.step()
    return lrs


def torch_ref(schedule, opt, n, min_lr, step_size, gamma):
    if schedule == "cosine":
        return tls.CosineAnnealingLR(opt, T_max=n, eta_min=min_lr)
    if schedule == "linear":
        return tls.LinearLR(opt, start_factor=1.0, end_factor=min_lr / LR, total_iters=n)
    if schedule == "step":
        return tls.StepLR(opt, step_size=step_size, gamma=gamma)
    return tls.ConstantLR(opt, factor=1.0, total_iters=n)


CASES = [("constant", 0.0), ("linear", 0.0), ("linear", MIN_LR), ("cosine", 0.0), ("cosine", MIN_LR),
         ("step", 0.0)]


@pytest.mark.parametrize("warmup", [0, 1, 7])
@pytest.mark.parametrize("schedule,min_lr", CASES)
def test_matches_torch_schedulers(schedule, min_lr, warmup):
    cfg = train_cfg(lr_schedule=schedule, warmup_steps=warmup, min_lr=min_lr, step_every=4, step_gamma=0.5)
    opt = sgd()
    ours = curve(opt, build_scheduler(cfg, opt, total_steps=TOTAL, steps_per_epoch=10))
    ref_opt = sgd()
    ref = torch_ref(schedule, ref_opt, TOTAL - warmup, min_lr, 4, 0.5)
    if warmup:
        ramp = tls.LambdaLR(ref_opt, lambda t: t / warmup)
        ref = tls.SequentialLR(ref_opt, [ramp, torch_ref(schedule, ref_opt, TOTAL - warmup, min_lr, 4, 0.5)],
                               milestones=[warmup])
    expected = curve(ref_opt, ref)
    assert ours == pytest.approx(expected, rel=1e-6, abs=1e-12)
    if warmup:
        assert ours[0] == 0.0 and ours[warmup] == pytest.approx(LR)
    if schedule in ("linear", "cosine"):
        assert ours[-1] == pytest.approx(min_lr, abs=1e-12)


def test_constant_without_warmup_is_none():
    assert build_scheduler(train_cfg(), sgd(), total_steps=TOTAL, steps_per_epoch=10) is None


def test_curve_formula_and_floors():
    c = LrCurve("cosine", total_steps=12, warmup_steps=2, min_factor=0.1)
    assert [c(0), c(1), c(2)] == [0.0, 0.5, 1.0]
    assert c(7) == pytest.approx(0.55) and c(12) == pytest.approx(0.1) and c(50) == pytest.approx(0.1)
    assert LrCurve("linear", 10, min_factor=0.2)(99) == pytest.approx(0.2)  # clamped past the end
    step = LrCurve("step", 100, min_factor=0.05, step_every=3, step_gamma=0.1)
    assert [step(t) for t in (0, 2, 3, 5, 6, 9)] == pytest.approx([1, 1, 0.1, 0.1, 0.05, 0.05])
    assert LrCurve("cosine", total_steps=3, warmup_steps=5)(7) == pytest.approx(0.0)  # D = max(1, ...)
    with pytest.raises(ConfigError, match="lr_schedule"):
        LrCurve("exponential", 10)
    with pytest.raises(ConfigError, match="step_every"):
        LrCurve("step", 10, step_every=0)


def test_step_every_zero_means_once_per_epoch():
    opt = sgd()
    sched = build_scheduler(train_cfg(lr_schedule="step", step_gamma=0.5), opt, total_steps=20, steps_per_epoch=5)
    lrs = curve(opt, sched, total=19)
    assert lrs == pytest.approx([LR * 0.5 ** (t // 5) for t in range(20)])
    assert sched.lr_lambdas[0].step_every == 5
    opt = sgd()  # steps_per_epoch 0 (an empty epoch) still steps every step, never divides by 0
    assert build_scheduler(train_cfg(lr_schedule="step"), opt, 20, 0).lr_lambdas[0].step_every == 1


def _save_load(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("schedule", ["cosine", "step", "constant"])
def test_state_dict_round_trip_mid_warmup(schedule):
    cfg = train_cfg(lr_schedule=schedule, warmup_steps=6, min_lr=MIN_LR, step_every=4)
    opt = sgd()
    full = curve(opt, build_scheduler(cfg, opt, TOTAL, 10))
    k = 3  # save mid-warm-up
    opt = sgd()
    sched = build_scheduler(cfg, opt, TOTAL, 10)
    head = curve(opt, sched, total=k - 1)
    saved = _save_load({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()})
    assert isinstance(saved["scheduler"]["lr_lambdas"][0], dict)  # the curve's plain fields
    opt2 = sgd()
    sched2 = build_scheduler(cfg, opt2, TOTAL, 10)
    opt2.load_state_dict(saved["optimizer"])
    sched2.load_state_dict(saved["scheduler"])
    assert sched2.lr_lambdas[0] == sched.lr_lambdas[0]
    tail = curve(opt2, sched2, total=TOTAL - k)
    assert head + tail == pytest.approx(full, rel=1e-6)


def test_callable_schedule():
    opt = sgd()
    sched = build_scheduler(train_cfg(lr_schedule=lambda o: tls.StepLR(o, 10, gamma=0.5)), opt, TOTAL, 10)
    assert isinstance(sched, tls.StepLR)
    assert curve(opt, sched, total=20)[::10] == pytest.approx([LR, LR / 2, LR / 4])


@pytest.mark.parametrize("factory", [lambda o: None, lambda o: "cosine", lambda o: tls.ReduceLROnPlateau(o)])
def test_callable_schedule_must_return_scheduler(factory):
    with pytest.raises(ModelError) as err:
        build_scheduler(train_cfg(lr_schedule=factory), sgd(), TOTAL, 10)
    assert "lr_schedule=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 100)" in str(err.value)
