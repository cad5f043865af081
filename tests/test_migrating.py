"""docs/migrating.md, pinned: every optkit spelling that the page says reproduces another library exactly is
run here beside that library over several seeded steps (``torch.optim``, timm's files loaded by path, or a
float64 NumPy reference written from the other library's formula for Keras 3, TF1 and apex), and every
"same name, other meaning" trap the page names is shown to be one (the other spelling differs).

float64 throughout (exact agreement is then visible: ~1e-16 relative), except where the other library only
runs in float32 (``torch.amp.GradScaler``).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as S
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import optkit
from timm_optim import load_timm_optim

F64 = torch.float64
SHAPES = ((5, 4), (5,), (3, 5), (3,))  # the parameters of _net(), in order
DOC = Path(__file__).resolve().parents[1] / "docs" / "migrating.md"


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def _weights(seed: int = 0) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in _net(seed).parameters()]


def _grads(seed: int = 1, steps: int = 10, scale: float = 1.0) -> list[list[np.ndarray]]:
    """Seeded random gradients (never zero), one list per step."""
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(s) * scale for s in SHAPES] for _ in range(steps)]


def _train(make, grads, *, sched=None, after=None) -> list[np.ndarray]:
    """Build ``make(net)`` on a fresh :func:`_net`, feed ``grads`` as ``.grad`` and step (a torch scheduler
    ``sched(opt)`` is stepped after each update); the final weights."""
    net = _net()
    opt = make(net)
    scheduler = None if sched is None else sched(opt)
    params = list(net.parameters())
    for k, gs in enumerate(grads):
        opt.zero_grad()
        for p, g in zip(params, gs):
            p.grad = torch.tensor(g)
        opt.step()
        if scheduler is not None:
            scheduler.step()
        if after is not None:
            after(k, net, opt)
    return [p.detach().numpy().copy() for p in params]


def _same(got, want, rtol=1e-12, atol=1e-14):
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


def _apart(a, b) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def _decay_groups(net: nn.Module, wd: float) -> list[dict]:
    """timm's ``param_groups_weight_decay``: ≥2-D tensors decay, biases (1-D) do not."""
    return [{"params": [p for p in net.parameters() if p.ndim > 1], "weight_decay": wd},
            {"params": [p for p in net.parameters() if p.ndim <= 1], "weight_decay": 0.0}]


def _timm(module: str, cls: str):
    found = load_timm_optim(module, cls)
    if found is None:
        pytest.skip(f"timm's optim/{module}.py is not installed")
    return found


def _zero_slot(opt: optkit.Optimizer, slot: str) -> optkit.Optimizer:
    """Start every ``slot`` at 0 (optkit's state exists from construction; the step uses it as it is)."""
    for group in opt.param_groups:
        for p in group["params"]:
            opt.get_slot(p, slot).zero_()
    return opt


# ------------------------------------------------------------------------------------------ torch.optim


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_torch_sgd_is_momentum(nesterov, wd):
    """``torch.optim.SGD(momentum, nesterov, weight_decay)`` ≡ ``optkit.Momentum`` with the same numbers, also
    when a torch scheduler changes the learning rate (the buffer holds raw gradients in both)."""
    def sched(o):
        return S.StepLR(o, step_size=3, gamma=0.5)

    want = _train(lambda n: torch.optim.SGD(n.parameters(), 0.1, momentum=0.9, nesterov=nesterov,
                                            weight_decay=wd), _grads(), sched=sched)
    got = _train(lambda n: optkit.Momentum(n.parameters(), 0.1, momentum=0.9, nesterov=nesterov,
                                           weight_decay=wd), _grads(), sched=sched)
    _same(got, want)


def test_torch_sgd_through_create_optimizer():
    """``create_optimizer(model, "Momentum", ..., no_decay_1d=False)`` is torch's SGD over all parameters;
    the default ``no_decay_1d=True`` is torch's SGD over timm-style decay / no-decay groups."""
    kw = dict(momentum=0.9, nesterov=True)
    want = _train(lambda n: torch.optim.SGD(n.parameters(), 0.1, weight_decay=0.01, **kw), _grads())
    got = _train(lambda n: optkit.create_optimizer(n, "momentum", lr=0.1, weight_decay=0.01,
                                                   no_decay_1d=False, momentum=0.9, nesterov=True), _grads())
    _same(got, want)
    want = _train(lambda n: torch.optim.SGD(_decay_groups(n, 0.01), 0.1, **kw), _grads())
    got = _train(lambda n: optkit.create_optimizer(n, "momentum", lr=0.1, weight_decay=0.01, momentum=0.9,
                                                   nesterov=True), _grads())
    _same(got, want)


def _keras_sgd(ws, grads, lrs, momentum, wd, nesterov=False):
    """Keras 3 ``SGD``: decoupled decay ``w ← w − lr·wd·w`` before the update, velocity ``v ← μv − lr·g``,
    ``w ← w + v`` (Nesterov ``w ← w + μv − lr·g``)."""
    ws = [w.copy() for w in ws]
    vs = [np.zeros_like(w) for w in ws]
    for lr, gs in zip(lrs, grads):
        for w, v, g in zip(ws, vs, gs):
            w -= lr * wd * w
            v *= momentum
            v -= lr * g
            w += momentum * v - lr * g if nesterov else v
    return ws


@pytest.mark.parametrize("nesterov", [False, True])
def test_create_optimizer_sgd_is_keras_sgd(nesterov):
    """``create_optimizer(model, "sgd")`` and ``optkit.SGD`` are Keras's SGD (decoupled decay, the velocity
    carries the learning rate), not torch's: with decay and a changing learning rate they part from
    ``torch.optim.SGD`` by far more than rounding."""
    lrs = [0.1 * 0.5 ** (k // 3) for k in range(10)]

    def sched(o):
        return S.StepLR(o, step_size=3, gamma=0.5)

    want = _keras_sgd(_weights(), _grads(), lrs, 0.9, 0.01, nesterov)
    got = _train(lambda n: optkit.create_optimizer(n, "sgd", lr=0.1, weight_decay=0.01, no_decay_1d=False,
                                                   momentum=0.9, nesterov=nesterov), _grads(), sched=sched)
    _same(got, want)
    got = _train(lambda n: optkit.SGD(n.parameters(), 0.1, momentum=0.9, nesterov=nesterov,
                                      weight_decay=0.01), _grads(), sched=sched)
    _same(got, want)
    torch_sgd = _train(lambda n: torch.optim.SGD(n.parameters(), 0.1, momentum=0.9, nesterov=nesterov,
                                                 weight_decay=0.01), _grads(), sched=sched)
    assert _apart(got, torch_sgd) > 1e-3


def test_keras_and_torch_sgd_agree_without_decay_at_constant_lr():
    """Without weight decay and at a constant learning rate the two momentum forms give the same weights."""
    want = _train(lambda n: torch.optim.SGD(n.parameters(), 0.1, momentum=0.9), _grads())
    got = _train(lambda n: optkit.SGD(n.parameters(), 0.1, momentum=0.9), _grads())
    _same(got, want)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_torch_adam_and_adamw(amsgrad):
    """``betas=(b1, b2)``, ``eps`` → ``beta1``, ``beta2``, ``epsilon``; coupled decay in ``Adam``, decoupled
    in ``AdamW``, ε added to the bias-corrected root in both, as torch."""
    kw_t = dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, amsgrad=amsgrad)
    kw_o = dict(beta1=0.8, beta2=0.99, epsilon=1e-6, weight_decay=0.1, amsgrad=amsgrad)
    _same(_train(lambda n: optkit.Adam(n.parameters(), 0.01, **kw_o), _grads()),
          _train(lambda n: torch.optim.Adam(n.parameters(), 0.01, **kw_t), _grads()))
    _same(_train(lambda n: optkit.AdamW(n.parameters(), learning_rate=0.01, **kw_o), _grads()),
          _train(lambda n: torch.optim.AdamW(n.parameters(), 0.01, **kw_t), _grads()))


def test_adamw_defaults_are_torchs():
    """``optkit.AdamW(params, lr)`` ≡ ``torch.optim.AdamW(params, lr)``: weight decay 0.01, betas (0.9,
    0.999), eps 1e-8 by default."""
    _same(_train(lambda n: optkit.AdamW(n.parameters(), 3e-3), _grads()),
          _train(lambda n: torch.optim.AdamW(n.parameters(), 3e-3), _grads()))


@pytest.mark.parametrize("torch_default", [False, True])
def test_torch_adagrad(torch_default):
    """``torch.optim.Adagrad``: the same option names except ``eps`` → ``epsilon``; torch's default
    accumulator start 0 (optkit refuses 0, as TF) is reached by zeroing the ``sum`` slots."""
    if torch_default:
        want = _train(lambda n: torch.optim.Adagrad(n.parameters(), 0.01), _grads())
        got = _train(lambda n: _zero_slot(optkit.Adagrad(n.parameters(), 0.01, epsilon=1e-10), "sum"),
                     _grads())
    else:
        kw = dict(lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1)
        want = _train(lambda n: torch.optim.Adagrad(n.parameters(), 0.1, eps=1e-10, **kw), _grads())
        got = _train(lambda n: optkit.Adagrad(n.parameters(), 0.1, epsilon=1e-10, **kw), _grads())
    _same(got, want)


# ------------------------------------------------------------------------------------------ schedules


def _torch_lrs(make, n=40, lr=0.1) -> list[float]:
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr)
    sched = make(opt)
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def _warmup_cosine(k: int, warmup: int = 5, total: int = 40) -> float:
    if k < warmup:
        return k / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (k - warmup) / (total - warmup)))


SCHEDULES = {
    "CosineAnnealingLR": (lambda o: S.CosineAnnealingLR(o, T_max=40, eta_min=0.002),
                          ("cosine_decay", dict(decay_steps=40, min_lr=0.02))),
    "PolynomialLR": (lambda o: S.PolynomialLR(o, total_iters=30, power=2.0),
                     ("poly_decay", dict(decay_steps=30, power=2.0))),
    "ExponentialLR": (lambda o: S.ExponentialLR(o, gamma=0.9),
                      ("exp_decay", dict(decay_steps=1, decay_rate=0.9, use_staircase_decay=False))),
    "StepLR": (lambda o: S.StepLR(o, step_size=7, gamma=0.5),
               ("exp_decay", dict(decay_steps=7, decay_rate=0.5, use_staircase_decay=True))),
    "MultiStepLR": (lambda o: S.MultiStepLR(o, milestones=[10, 25], gamma=0.1),
                    ("piecewise_constant", dict(boundaries=[9, 24], decay_rates=[0.1, 0.01]))),
    "LambdaLR warm-up + cosine": (lambda o: S.LambdaLR(o, _warmup_cosine),
                                  ("cosine_decay", dict(decay_steps=35, warmup_steps=5, begin_decay_at=5))),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_torch_scheduler_as_policy(name):
    """Each torch scheduler stepped once per update and its optkit policy give the same learning rate at
    every update (update ``k`` uses ``lr(k)`` in both)."""
    make, (policy, kw) = SCHEDULES[name]
    want = _torch_lrs(make)
    schedule = optkit.PolicySchedule(policy, learning_rate=0.1, **kw)
    got = [float(schedule(k)) for k in range(len(want))]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


def test_cosine_annealing_rises_after_t_max_cosine_decay_stays():
    """Past ``T_max`` torch's cosine climbs back (it is periodic); optkit's stays at the floor."""
    lrs = _torch_lrs(lambda o: S.CosineAnnealingLR(o, T_max=20, eta_min=0.0), n=30)
    schedule = optkit.PolicySchedule("cosine_decay", learning_rate=0.1, decay_steps=20)
    assert lrs[25] > 0.005 and float(schedule(25)) == 0.0


def test_schedule_drives_an_optimizer_like_a_scheduler():
    """A schedule as the learning rate of an optkit optimizer, or ``ScheduleLR`` on a torch optimizer, trains
    exactly as torch's SGD with ``CosineAnnealingLR``."""
    def sched(o):
        return S.CosineAnnealingLR(o, T_max=10, eta_min=0.001)

    want = _train(lambda n: torch.optim.SGD(n.parameters(), 0.1, momentum=0.9), _grads(), sched=sched)
    schedule = optkit.PolicySchedule("cosine_decay", learning_rate=0.1, decay_steps=10, min_lr=0.01)
    _same(_train(lambda n: optkit.Momentum(n.parameters(), schedule, momentum=0.9), _grads()), want)
    _same(_train(lambda n: torch.optim.SGD(n.parameters(), 0.1, momentum=0.9), _grads(),
                 sched=lambda o: optkit.ScheduleLR(o, schedule)), want)


# ------------------------------------------------------------------------------------------ timm, apex: LAMB


@pytest.mark.parametrize("max_grad_norm", [1.0, None])
def test_timm_lamb(max_grad_norm):
    """timm ``Lamb(weight_decay=wd, max_grad_norm=c)`` over ``param_groups_weight_decay`` groups ≡
    ``optkit.LAMB(param_groups(model, weight_decay=wd), lr, global_grad_norm_clip=c)`` (or
    ``exclude_1d=True``, or ``global_clipnorm=c``, or ``create_optimizer``). The gradients' global norm is
    about 15, so the clip acts on every step."""
    Lamb = _timm("lamb", "Lamb")
    grads = _grads(scale=3.0)
    want = _train(lambda n: Lamb(_decay_groups(n, 0.01), lr=0.01, max_grad_norm=max_grad_norm), grads)
    _same(_train(lambda n: optkit.LAMB(optkit.param_groups(n, weight_decay=0.01), 0.01,
                                       global_grad_norm_clip=max_grad_norm), grads), want)
    _same(_train(lambda n: optkit.LAMB(n.named_parameters(), 0.01, weight_decay=0.01, exclude_1d=True,
                                       global_clipnorm=max_grad_norm), grads), want)
    _same(_train(lambda n: optkit.create_optimizer(n, "LAMB", lr=0.01, weight_decay=0.01,
                                                   global_grad_norm_clip=max_grad_norm), grads), want)


def test_timm_lamb_defaults_are_not_optkits():
    """timm's ``Lamb(params, lr)`` decays by 0.01 and clips the global norm at 1.0;
    ``optkit.LAMB(params, lr)`` does neither (no tensor adapts: Adam with ε = 1e-6)."""
    Lamb = _timm("lamb", "Lamb")
    grads = _grads(scale=3.0)
    want = _train(lambda n: Lamb(_decay_groups(n, 0.01), lr=0.01), grads)
    assert _apart(_train(lambda n: optkit.LAMB(optkit.param_groups(n), 0.01), grads), want) > 1e-3
    assert _apart(_train(lambda n: optkit.LAMB(optkit.param_groups(n, weight_decay=0.01), 0.01), grads),
                  want) > 1e-3


def test_timm_lambc_always_adapt():
    """timm ``trust_clip=True`` → ``lambc=True``; ``always_adapt`` is the same name."""
    Lamb = _timm("lamb", "Lamb")
    grads = _grads(scale=3.0)
    want = _train(lambda n: Lamb(n.parameters(), lr=0.01, weight_decay=0.0, max_grad_norm=None,
                                 trust_clip=True, always_adapt=True), grads)
    _same(_train(lambda n: optkit.LAMB(n.parameters(), 0.01, lambc=True, always_adapt=True), grads), want)


def _apex_fused_lamb(ws, grads, wds, lr, *, eps=1e-6, max_grad_norm=1.0, use_nvlamb=False, b1=0.9, b2=0.999):
    """apex ``FusedLAMB`` (``adam_w_mode=True``, ``grad_averaging=True``; csrc/multi_tensor_lamb.cu): global
    norm clip ``g / (N/c if N > c else 1)``; ``u = m̂/(√v̂ + ε) + wd·w``; ``w ← w − lr·(‖w‖/‖u‖)·u`` where
    ``use_nvlamb`` or ``wd ≠ 0`` and both norms are non-zero, else ``w ← w − lr·u``."""
    ws = [w.copy() for w in ws]
    ms = [np.zeros_like(w) for w in ws]
    vs = [np.zeros_like(w) for w in ws]
    for t, gs in enumerate(grads, start=1):
        norm = math.sqrt(sum(float((g * g).sum()) for g in gs))
        clip = norm / max_grad_norm if max_grad_norm is not None and norm > max_grad_norm else 1.0
        for w, m, v, g, wd in zip(ws, ms, vs, gs, wds):
            g = g / clip
            m[:] = b1 * m + (1 - b1) * g
            v[:] = b2 * v + (1 - b2) * g * g
            u = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps) + wd * w
            ratio = lr
            if use_nvlamb or wd != 0:
                pn, un = np.linalg.norm(w), np.linalg.norm(u)
                ratio = lr * pn / un if pn != 0 and un != 0 else lr
            w -= ratio * u
    return ws


@pytest.mark.parametrize("use_nvlamb", [False, True])
def test_apex_fused_lamb(use_nvlamb):
    """apex ``FusedLAMB(lr, weight_decay=wd)`` over decay / no-decay groups ≡
    ``optkit.LAMB(param_groups(model, weight_decay=wd), lr, global_grad_norm_clip=1.0)``;
    ``use_nvlamb=True`` → ``always_adapt=True``."""
    grads = _grads(scale=3.0)
    want = _apex_fused_lamb(_weights(), grads, [0.01, 0.0, 0.01, 0.0], 0.01, use_nvlamb=use_nvlamb)
    got = _train(lambda n: optkit.LAMB(optkit.param_groups(n, weight_decay=0.01), 0.01,
                                       global_grad_norm_clip=1.0, always_adapt=use_nvlamb), grads)
    _same(got, want)


# ------------------------------------------------------------------------------------------ LARS, LARC


@pytest.mark.parametrize("nesterov", [False, True])
def test_timm_lars(nesterov):
    """timm ``Lars(lr, momentum, weight_decay=wd, trust_coeff=η)`` over decay / no-decay groups ≡
    ``optkit.LARS(named_parameters(), lr, momentum=..., weight_decay=wd, eeta=η, epsilon=1e-8,
    exclude_1d=True)`` at a constant learning rate."""
    Lars = _timm("lars", "Lars")
    want = _train(lambda n: Lars(_decay_groups(n, 1e-3), lr=0.5, momentum=0.9, trust_coeff=0.02,
                                 nesterov=nesterov), _grads())
    got = _train(lambda n: optkit.LARS(n.named_parameters(), 0.5, momentum=0.9, weight_decay=1e-3, eeta=0.02,
                                       epsilon=1e-8, exclude_1d=True, nesterov=nesterov), _grads())
    _same(got, want)


def test_timm_lars_always_adapt():
    """timm ``always_adapt=True`` with no weight decay ≡ ``optkit.LARS(weight_decay=0.0)`` (every tensor
    adapts unless skipped)."""
    Lars = _timm("lars", "Lars")
    want = _train(lambda n: Lars(n.parameters(), lr=0.5, momentum=0.9, trust_coeff=0.02, always_adapt=True),
                  _grads())
    got = _train(lambda n: optkit.LARS(n.parameters(), 0.5, momentum=0.9, weight_decay=0.0, eeta=0.02,
                                       epsilon=1e-8), _grads())
    _same(got, want)


def test_timm_lars_parts_under_a_schedule():
    """TF 1.15's LARS keeps the learning rate inside the momentum (as Keras SGD), timm's outside: with a
    changing learning rate they part."""
    Lars = _timm("lars", "Lars")

    def sched(o):
        return S.StepLR(o, step_size=3, gamma=0.5)

    want = _train(lambda n: Lars(_decay_groups(n, 1e-3), lr=0.5, momentum=0.9, trust_coeff=0.02), _grads(),
                  sched=sched)
    got = _train(lambda n: optkit.LARS(n.named_parameters(), 0.5, momentum=0.9, weight_decay=1e-3, eeta=0.02,
                                       epsilon=1e-8, exclude_1d=True), _grads(), sched=sched)
    assert _apart(got, want) > 1e-3


def test_timm_lars_trust_clip_is_larc():
    """timm ``Lars(trust_clip=True)`` ≡ ``optkit.LARC(torch.optim.SGD(params, lr, momentum), larc_eta=η,
    epsilon=1e-8, min_update=0.0, wd_in_denominator=wd)`` (the inner optimizer without decay of its own)."""
    Lars = _timm("lars", "Lars")
    want = _train(lambda n: Lars(n.parameters(), lr=0.5, momentum=0.9, weight_decay=1e-3, trust_coeff=0.02,
                                 trust_clip=True), _grads())
    got = _train(lambda n: optkit.LARC(torch.optim.SGD(n.parameters(), 0.5, momentum=0.9), larc_eta=0.02,
                                       epsilon=1e-8, min_update=0.0, wd_in_denominator=1e-3), _grads())
    _same(got, want)


def _apex_larc(ws, grads, lr, momentum, wd, *, trust_coefficient=0.02, clip=True, eps=1e-8):
    """apex ``LARC(torch.optim.SGD(lr, momentum, weight_decay=wd), trust_coefficient, clip, eps)``
    (apex/parallel/LARC.py): where ``‖w‖ ≠ 0`` and ``‖g‖ ≠ 0``, ``a = tc·‖w‖/(‖g‖ + wd·‖w‖ + eps)``
    (clip: ``min(a/lr, 1)``) and ``g ← (g + wd·w)·a``; the inner SGD then steps without decay (torch's
    momentum: the buffer starts at the first gradient)."""
    ws = [w.copy() for w in ws]
    bufs: list = [None] * len(ws)
    for gs in grads:
        for i, (w, g) in enumerate(zip(ws, gs)):
            pn, gn = np.linalg.norm(w), np.linalg.norm(g)
            if pn != 0 and gn != 0:
                a = trust_coefficient * pn / (gn + pn * wd + eps)
                if clip:
                    a = min(a / lr, 1.0)
                g = (g + wd * w) * a
            bufs[i] = g.copy() if bufs[i] is None else momentum * bufs[i] + g
            w -= lr * bufs[i]
    return ws


@pytest.mark.parametrize("clip", [True, False])
def test_apex_larc(clip):
    """apex ``LARC(SGD(lr, momentum, weight_decay=wd), trust_coefficient=η, clip=...)`` ≡
    ``optkit.LARC(SGD(lr, momentum), larc_eta=η, larc_mode="clip"/"scale", epsilon=1e-8, min_update=0.0,
    wd_in_denominator=wd)``. The learning rate 0.5 makes the clip bind on some tensors and not others."""
    want = _apex_larc(_weights(), _grads(), 0.5, 0.9, 1e-3, clip=clip)
    got = _train(lambda n: optkit.LARC(torch.optim.SGD(n.parameters(), 0.5, momentum=0.9), larc_eta=0.02,
                                       larc_mode="clip" if clip else "scale", epsilon=1e-8, min_update=0.0,
                                       wd_in_denominator=1e-3), _grads())
    _same(got, want)


# ------------------------------------------------------------------------------------------ Adam: apex, Keras


def _apex_fused_adam(ws, grads, lr, wd, *, adam_w_mode=True, b1=0.9, b2=0.999, eps=1e-8):
    """apex ``FusedAdam`` (csrc/multi_tensor_adam.cu): ε added to ``√v̂``; ``adam_w_mode=True`` (its default):
    ``u = m̂/(√v̂ + ε) + wd·w``, ``w ← w − lr·u``; ``False``: ``g ← g + wd·w`` first."""
    ws = [w.copy() for w in ws]
    ms = [np.zeros_like(w) for w in ws]
    vs = [np.zeros_like(w) for w in ws]
    for t, gs in enumerate(grads, start=1):
        for w, m, v, g in zip(ws, ms, vs, gs):
            if not adam_w_mode:
                g = g + wd * w
            m[:] = b1 * m + (1 - b1) * g
            v[:] = b2 * v + (1 - b2) * g * g
            u = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
            if adam_w_mode:
                u = u + wd * w
            w -= lr * u
    return ws


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_apex_fused_adam(adam_w_mode):
    """apex ``FusedAdam(weight_decay=wd)`` ≡ ``optkit.AdamW(weight_decay=wd)`` (its default
    ``adam_w_mode=True``) or ``optkit.Adam(weight_decay=wd)`` (``adam_w_mode=False``)."""
    want = _apex_fused_adam(_weights(), _grads(), 0.01, 0.1, adam_w_mode=adam_w_mode)
    cls = optkit.AdamW if adam_w_mode else optkit.Adam
    _same(_train(lambda n: cls(n.parameters(), learning_rate=0.01, weight_decay=0.1), _grads()), want)


def _keras_adam(ws, grads, lr, *, wd=0.0, b1=0.9, b2=0.999, eps=0.0):
    """Keras 3 ``Adam``/``AdamW``: decoupled decay ``w ← w − lr·wd·w`` first (AdamW, or Adam given a
    ``weight_decay``); ``w ← w − lr·√(1 − β2^t)/(1 − β1^t)·m/(√v + ε̂)`` (ε̂ added to the uncorrected root)."""
    ws = [w.copy() for w in ws]
    ms = [np.zeros_like(w) for w in ws]
    vs = [np.zeros_like(w) for w in ws]
    for t, gs in enumerate(grads, start=1):
        alpha = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
        for w, m, v, g in zip(ws, ms, vs, gs):
            w -= lr * wd * w
            m += (g - m) * (1 - b1)
            v += (g * g - v) * (1 - b2)
            w -= m * alpha / (np.sqrt(v) + eps)
    return ws


def test_keras_adam_and_adamw_with_epsilon_zero():
    """Keras's ε sits on the uncorrected root, torch's (and optkit's) on the corrected one: with ``epsilon=0``
    the rules coincide (Keras ``Adam``, and ``AdamW``'s decoupled decay)."""
    _same(_train(lambda n: optkit.Adam(n.parameters(), 0.01, epsilon=0.0), _grads()),
          _keras_adam(_weights(), _grads(), 0.01))
    _same(_train(lambda n: optkit.AdamW(n.parameters(), learning_rate=0.01, weight_decay=0.004, epsilon=0.0),
                 _grads()), _keras_adam(_weights(), _grads(), 0.01, wd=0.004))


# ------------------------------------------------------------------------------------------ Adagrad, RMSProp


def _tf_adagrad(ws, grads, lr, init=0.1):
    """TF1 ``AdagradOptimizer`` (and Keras 3 ``Adagrad(epsilon=0)``): ``s ← s + g²``, ``w ← w − lr·g/√s``."""
    ws = [w.copy() for w in ws]
    ss = [np.full_like(w, init) for w in ws]
    for gs in grads:
        for w, s, g in zip(ws, ss, gs):
            s += g * g
            w -= lr * g / np.sqrt(s)
    return ws


def test_tf_adagrad_is_the_default():
    """``optkit.Adagrad(params, lr)`` is TF1's Adagrad exactly (accumulator from 0.1, no ε)."""
    _same(_train(lambda n: optkit.Adagrad(n.parameters(), 0.1), _grads()),
          _tf_adagrad(_weights(), _grads(), 0.1))


@pytest.mark.parametrize("kw", [{}, {"momentum": 0.9}, {"centered": True, "momentum": 0.5}], ids=str)
def test_timm_rmsprop_tf(kw):
    """timm ``RMSpropTF(lr, alpha=ρ, eps, momentum, centered)`` ≡ ``optkit.RMSProp(lr, decay=ρ, epsilon=eps,
    momentum, centered)``: TF1's rule (mean square from 1, ε inside the root, lr inside the momentum)."""
    RMSpropTF = _timm("rmsprop_tf", "RMSpropTF")
    want = _train(lambda n: RMSpropTF(n.parameters(), lr=0.01, alpha=0.9, eps=1e-10, **kw), _grads())
    got = _train(lambda n: optkit.RMSProp(n.parameters(), 0.01, decay=0.9, epsilon=1e-10, **kw), _grads())
    _same(got, want)


def test_timm_rmsprop_tf_decoupled_decay():
    """timm ``RMSpropTF(weight_decay=wd, decoupled_decay=True)`` ≡ ``optkit.RMSProp(weight_decay=wd)`` (the
    Keras decoupled decay of the base class)."""
    RMSpropTF = _timm("rmsprop_tf", "RMSpropTF")
    want = _train(lambda n: RMSpropTF(n.parameters(), lr=0.01, alpha=0.9, eps=1e-10, momentum=0.9,
                                      weight_decay=0.1, decoupled_decay=True), _grads())
    got = _train(lambda n: optkit.RMSProp(n.parameters(), 0.01, decay=0.9, epsilon=1e-10, momentum=0.9,
                                          weight_decay=0.1), _grads())
    _same(got, want)


def _keras_rmsprop(ws, grads, lr, *, rho=0.9, momentum=0.0, eps=1e-7, centered=False):
    """Keras 3 ``RMSprop``: ``v ← ρv + (1 − ρ)g²`` from 0, ``a ← ρa + (1 − ρ)g`` (centered),
    ``inc = lr·g/√(v − a² + ε)``; ``m ← μm + inc``, ``w ← w − m`` (``w ← w − inc`` without momentum)."""
    ws = [w.copy() for w in ws]
    vs = [np.zeros_like(w) for w in ws]
    avs = [np.zeros_like(w) for w in ws]
    moms = [np.zeros_like(w) for w in ws]
    for gs in grads:
        for w, v, av, mom, g in zip(ws, vs, avs, moms, gs):
            v[:] = rho * v + (1 - rho) * g * g
            denom = v + eps
            if centered:
                av[:] = rho * av + (1 - rho) * g
                denom = v - av * av + eps
            inc = lr * g / np.sqrt(denom)
            if momentum > 0:
                mom[:] = momentum * mom + inc
                w -= mom
            else:
                w -= inc
    return ws


@pytest.mark.parametrize("kw", [{}, {"momentum": 0.9, "centered": True}], ids=str)
def test_keras_rmsprop(kw):
    """Keras 3 ``RMSprop(rho, epsilon)`` ≡ ``optkit.RMSProp(decay=rho, epsilon=...)`` with the ``rms`` slots
    started at 0 (Keras's mean square starts at 0, TF1's at 1)."""
    want = _keras_rmsprop(_weights(), _grads(), 0.01, **kw)
    got = _train(lambda n: _zero_slot(optkit.RMSProp(n.parameters(), 0.01, decay=0.9, epsilon=1e-7, **kw),
                                      "rms"), _grads())
    _same(got, want)


# ------------------------------------------------------------------------------------------ loss scaling


def test_grad_scaler_and_loss_scale_optimizer():
    """``GradScaler(init_scale, growth_factor=m, backoff_factor=1/m, growth_interval)`` ≡
    ``LossScaleOptimizer(opt, DynamicLossScale(init_scale, increment_period=growth_interval, multiplier=m,
    min_loss_scale=...))``: the same scales step by step (overflows at updates 4, 5 and 9) and the same
    weights; an optkit optimizer also runs under the ``GradScaler`` itself. ``min_loss_scale`` (default 1,
    TF's floor; GradScaler has none) matters once the scale would fall below 1."""
    torch.manual_seed(0)
    x, y = torch.randn(32, 4), torch.randn(32, 3)
    bad = {4, 5, 9}

    def loss_of(net, k):
        loss = nn.functional.mse_loss(net(x), y)
        return loss * math.inf if k in bad else loss

    for init, floor in ((2.0**16, 1.0), (1.0, 2.0**-10)):
        nets = [nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)) for _ in range(3)]
        for net in nets[1:]:
            net.load_state_dict(nets[0].state_dict())
        ref = torch.optim.SGD(nets[0].parameters(), 0.1, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", init_scale=init, growth_interval=3)
        ours = optkit.LossScaleOptimizer(torch.optim.SGD(nets[1].parameters(), 0.1, momentum=0.9),
                                         optkit.DynamicLossScale(init, increment_period=3, multiplier=2.0,
                                                                 min_loss_scale=floor))
        inner = optkit.Momentum(nets[2].parameters(), 0.1, momentum=0.9)
        scaler2 = torch.amp.GradScaler("cpu", init_scale=init, growth_interval=3)
        scales = []
        for k in range(12):
            ref.zero_grad()
            scaler.scale(loss_of(nets[0], k)).backward()
            scaler.step(ref)
            scaler.update()
            ours.zero_grad()
            ours.scale_loss(loss_of(nets[1], k)).backward()
            ours.step()
            inner.zero_grad()
            scaler2.scale(loss_of(nets[2], k)).backward()
            scaler2.step(inner)
            scaler2.update()
            assert float(ours.loss_scale) == scaler.get_scale() == scaler2.get_scale()
            scales.append(scaler.get_scale())
        assert len(set(scales)) >= 3  # grew and backed off
        for a, b, c in zip(*(net.parameters() for net in nets)):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
            torch.testing.assert_close(c, a, rtol=1e-6, atol=1e-7)
    assert min(scales) < 1.0


# ------------------------------------------------------------------------------------------ EMA


def _load_model_ema():
    spec = importlib.util.find_spec("timm")
    if spec is None or spec.origin is None:
        pytest.skip("timm is not installed")
    path = os.path.join(os.path.dirname(spec.origin), "utils", "model_ema.py")
    file_spec = importlib.util.spec_from_file_location("_optkit_test_timm_model_ema", path)
    mod = importlib.util.module_from_spec(file_spec)
    try:
        file_spec.loader.exec_module(mod)
    except Exception:  # noqa: BLE001 - another timm layout: no reference
        pytest.skip("timm's utils/model_ema.py does not load by itself")
    return mod.ModelEmaV3


@pytest.mark.parametrize("buffers", [False, True])
def test_ema_matches_averaged_model_and_model_ema_v3(buffers):
    """``use_ema=True, ema_momentum=d`` (``ema_buffers=model`` for BatchNorm statistics) ≡ torch
    ``AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(d), use_buffers=...)`` updated after every step
    ≡ timm ``ModelEmaV3(model, decay=d)`` updated with ``step=`` the count of updates (1 for the first): the
    first update copies, then ``avg ← d·avg + (1 − d)·w``."""
    ModelEmaV3 = _load_model_ema()
    torch.manual_seed(0)
    x, y = torch.randn(32, 4, dtype=F64), torch.randn(32, 3, dtype=F64)

    def make():
        torch.manual_seed(0)
        layers = [nn.Linear(4, 5), nn.BatchNorm1d(5)] if buffers else [nn.Linear(4, 5)]
        return nn.Sequential(*layers, nn.Tanh(), nn.Linear(5, 3)).double()

    theirs, mine = make(), make()
    initial = {k: v.clone() for k, v in mine.state_dict().items()}
    ref = torch.optim.SGD(theirs.parameters(), 0.1, momentum=0.9)
    averaged = AveragedModel(theirs, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=buffers)
    v3 = ModelEmaV3(theirs, decay=0.9)
    opt = optkit.Momentum(mine.parameters(), 0.1, momentum=0.9, use_ema=True, ema_momentum=0.9,
                          ema_buffers=mine if buffers else None)
    for k in range(12):
        for net, o in ((theirs, ref), (mine, opt)):
            o.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            o.step()
        averaged.update_parameters(theirs)
        v3.update(theirs, step=k + 1)
    live = {k: v.clone() for k, v in mine.state_dict().items()}
    with opt.ema_weights():
        ours = {k: v.clone() for k, v in mine.state_dict().items()}
    for key, value in ours.items():
        if not value.is_floating_point():
            continue
        if not torch.equal(live[key], initial[key]):  # (a bias before BatchNorm gets no gradient)
            assert not torch.equal(value, live[key]), key  # an average, not the live value
        torch.testing.assert_close(value, averaged.module.state_dict()[key], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(value, v3.module.state_dict()[key], rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------------------------------ the page


def test_every_spelling_on_the_page_is_pinned_here():
    """The page names this file as the proof of its equivalences; every test it cites exists."""
    text = DOC.read_text(encoding="utf-8")
    cited = set(re.findall(r"`(test_[a-z0-9_]+)`", text))
    here = {name for name in globals() if name.startswith("test_")}
    assert cited, "docs/migrating.md cites no test"
    assert cited <= here, sorted(cited - here)
