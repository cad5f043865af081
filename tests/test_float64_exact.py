"""float64 runs are carried in float64 throughout (issue 29, items 1 and 2): every gradient-scale reciprocal,
accumulation-window divisor and token count, and a schedule's learning rate.

The issue's examples first: ``SGD(learning_rate=1.0)`` on a float64 parameter whose true (mean, unscaled)
gradient is 1, under an accumulation window of 3, a static loss scale of 3 or a token-weighted window with
counts 1, 2, 3, lands on ``w = −1.0`` exactly (a float32 ``1/3`` or ``1/6`` gives −1.0000000298). Then the
same under the unscaling paths of the wrappers and clips, against float64 NumPy references (``g/3`` and the
rules of ``tests/reference_rules.py``), and the schedules: a float64 group's learning rate is the schedule's
float64 value (TF's float32 learning-rate variable would round it; the policies' formulas are in
``tests/test_lr_policies.py``'s references, here the schedule's Python-number value, computed in float64).
Float32 groups beside float64 ones keep their float32 factors, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import optkit
from contract_table import larc_transform
from reference_rules import Reference

F64 = torch.float64


# -------------------------------------------------------------------------------------------------- train op


@pytest.mark.parametrize("counts,kwargs", [
    (None, {"iter_size": 3}),
    (None, {"loss_scaling": 3.0}),
    ((1, 2, 3), {"iter_size": 3}),
    ((1, 2, 3), {"iter_size": 3, "loss_scaling": 3.0, "clip_gradients": 10.0}),
], ids=["accumulate-3", "static-scale-3", "tokens-1-2-3", "all-with-clip"])
def test_train_op_divides_a_float64_window_exactly(counts, kwargs):
    """The issue's example: the window's mean gradient is exactly 1 (each micro-batch's loss sum is ``c·w``
    with ``c`` items, or ``w``), so one SGD update with learning rate 1 from 0 gives −1.0 exactly."""
    w = torch.zeros(2, dtype=F64, requires_grad=True)
    window = counts or (1,) * kwargs.get("iter_size", 1)
    calls = iter(window)

    def loss():
        if counts is None:
            return w.sum()
        c = next(calls)
        return c * w.sum(), c

    op = optkit.optimize_loss(loss, "SGD", {}, 1.0, var_list=[w], **kwargs)
    for _ in window:
        result = op()
    assert bool(result.applied) and int(op.global_step) == 1
    assert w.detach().tolist() == [-1.0, -1.0]


def test_train_op_token_count_past_float32_is_exact():
    """Counts above 2^24 per window are summed and divided in float64: 2^24 + 1 items with a loss sum whose
    gradient is 2^24 + 1 give a mean gradient of exactly 1 (a float32 count rounds to 2^24)."""
    w = torch.zeros(1, dtype=F64, requires_grad=True)
    n = 2**24 + 1
    op = optkit.optimize_loss(lambda: (n * w.sum(), n), "SGD", {}, 1.0, var_list=[w])
    op()
    assert w.item() == -1.0


# ------------------------------------------------------------------------------------------------ wrappers


def _params(dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 3, generator=g, dtype=F64).to(dtype).requires_grad_(),
            torch.randn(4, generator=g, dtype=F64).to(dtype).requires_grad_()]


def _grads(k, dtype=F64):
    g = torch.Generator().manual_seed(100 + k)
    return [torch.randn(5, 3, generator=g, dtype=F64).to(dtype),
            torch.randn(4, generator=g, dtype=F64).to(dtype)]


def _protocol(build):
    """A bare optkit optimizer handed ``grad_scale = 3`` as ``torch.amp.GradScaler`` does."""
    def step(opt, grads, params):
        for p, g in zip(params, grads):
            p.grad = g * 3.0
        opt.grad_scale = torch.tensor(3.0)
        try:
            opt.step()
        finally:
            del opt.grad_scale
    return build, step


def _wrapped(build):
    """A loss-scale wrapper with a static scale of 3: the gradients carry ``3·g``."""
    def step(opt, grads, params):
        for p, g in zip(params, grads):
            p.grad = g * 3.0
        opt.grads_scaled = True
        opt.step()
    return build, step


_SGD = {"learning_rate": 0.1, "momentum": 0.9}
CASES = {
    # (a binding global clip or trust ratio would cancel the scale: these do not bind)
    "SGD-global-clip": (_protocol(lambda ps: optkit.SGD(ps, **_SGD, global_clipnorm=100.0)),
                        ("keras_sgd", {"momentum": 0.9}, {"global_clipnorm": 100.0}, None)),
    "SGD-clipnorm": (_protocol(lambda ps: optkit.SGD(ps, **_SGD, clipnorm=1.0)),
                     ("keras_sgd", {"momentum": 0.9}, {"clipnorm": 1.0}, None)),
    "SGD-clipvalue": (_protocol(lambda ps: optkit.SGD(ps, **_SGD, clipvalue=0.5)),
                      ("keras_sgd", {"momentum": 0.9}, {"clipvalue": 0.5}, None)),
    "Momentum": (_protocol(lambda ps: optkit.Momentum(ps, learning_rate=0.1, momentum=0.9)),
                 ("momentum", {"momentum": 0.9}, {}, None)),
    "LossScale(SGD)": (_wrapped(lambda ps: optkit.LossScaleOptimizer(optkit.SGD(ps, **_SGD), 3.0)),
                       ("keras_sgd", {"momentum": 0.9}, {}, None)),
    "LossScale(torch.SGD)": (_wrapped(lambda ps: optkit.LossScaleOptimizer(
        torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False), 3.0)),
        ("momentum", {"momentum": 0.9}, {}, None)),
    "LossScale(LARC(SGD))": (_wrapped(lambda ps: optkit.LossScaleOptimizer(
        optkit.LARC(optkit.SGD(ps, **_SGD), 1.0), 3.0)),
        ("keras_sgd", {"momentum": 0.9}, {}, larc_transform(1.0))),
    "LossScale(LARC-wd(SGD))": (_wrapped(lambda ps: optkit.LossScaleOptimizer(
        optkit.LARC(optkit.SGD(ps, **_SGD), 0.02, larc_mode="scale", wd_in_denominator=0.01), 3.0)),
        ("keras_sgd", {"momentum": 0.9}, {}, "larc-wd")),
}


def _larc_wd(ws, gs, lr, eta=0.02, wd=0.01, eps=1e-7):
    """apex/timm LARC (scale mode) with the decay in the denominator: ``g ← r·(g + wd·w)``,
    ``r = η‖w‖/(‖g‖ + wd·‖w‖ + ε)`` (its floor, 1e-7, does not bind here)."""
    out = []
    for w, g in zip(ws, gs):
        wn, gn = np.linalg.norm(w), np.linalg.norm(g)
        out.append(eta * wn / (gn + wd * wn + eps) * (g + wd * w))
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_static_scale_of_three_unscales_float64_exactly(case):
    """Gradients that carry a scale of 3 are unscaled by the float64 ``1/3`` for float64 parameters, on
    every path (the clips' factors, the wrappers' non-finite check, LARC's trust ratios): three updates
    match the float64 NumPy reference of the unscaled gradients to 1e-13 (a float32 ``1/3`` is 3e-8 off)."""
    (build, step), (rule, hp, base, transform) = CASES[case]
    params = _params()
    opt = build(params)
    ref = Reference(rule, [p.detach().numpy().copy() for p in params], hp, {"lr": 0.1, **base})
    for k in range(3):
        grads = _grads(k)
        step(opt, grads, params)
        gs = [g.numpy() for g in grads]
        if transform == "larc-wd":
            gs = _larc_wd(ref.ws, gs, ref.lr())
        elif transform is not None:
            gs = transform(ref.ws, gs, ref.lr())
        ref.step(gs)
    for p, w in zip(params, ref.ws):
        np.testing.assert_allclose(p.detach().numpy(), w, rtol=1e-13, atol=1e-15)


def test_unscaling_helpers_divide_float64_by_the_float64_scale():
    """``LossScale.unscale_``, ``LossScaleOptimizer.get_unscaled_gradients`` and ``compute_gradients`` give
    ``g/3`` in float64 for float64 tensors, and for a float32 tensor beside them exactly what it gets alone
    (its float32 factor)."""
    g64 = _grads(0)
    g32 = [g.float() for g in _grads(1)]
    want64 = [g.numpy() / 3.0 for g in g64]

    got = [g.clone() for g in g64] + [g.clone() for g in g32]
    found = optkit.FixedLossScale(3.0).unscale_(got)
    assert float(found) == 0.0
    alone = [g.clone() for g in g32]
    optkit.FixedLossScale(3.0).unscale_(alone)
    for a, w in zip(got[:2], want64):
        np.testing.assert_allclose(a.numpy(), w, rtol=5e-16, atol=0)  # (g·fl(1/3): within an ulp of g/3)
    for a, b in zip(got[2:], alone):
        assert torch.equal(a, b)

    params = _params()
    opt = optkit.LossScaleOptimizer(optkit.SGD(params, learning_rate=0.1), 3.0)
    for a, w in zip(opt.get_unscaled_gradients(g64), want64):
        np.testing.assert_allclose(a.numpy(), w, rtol=5e-16, atol=0)
    x = torch.randn(7, 5, generator=torch.Generator().manual_seed(3), dtype=F64)
    loss = lambda: (torch.tanh(x @ params[0]).sum(1) * params[1][:1]).sum()  # noqa: E731
    direct = torch.autograd.grad(loss(), params)
    for (g, _), d in zip(opt.compute_gradients(loss, params), direct):
        np.testing.assert_allclose(g.numpy(), d.numpy(), rtol=1e-15, atol=1e-16)


def test_float32_group_beside_float64_keeps_its_float32_factor():
    """A float32 group next to a float64 one is unscaled by the float32 ``1/3`` as when it is alone (bit for
    bit, slots included), while the float64 group gets the float64 ``1/3``."""
    p32 = _params(torch.float32)
    alone = [p.detach().clone().requires_grad_() for p in p32]
    p64 = _params(seed=1)
    both = optkit.SGD([{"params": p32}, {"params": p64}], learning_rate=0.1, momentum=0.9)
    single = optkit.SGD(alone, learning_rate=0.1, momentum=0.9)
    ref = Reference("keras_sgd", [p.detach().numpy().copy() for p in p64], {"momentum": 0.9}, {"lr": 0.1})
    _, step = _protocol(None)
    for k in range(3):
        g32 = _grads(k, torch.float32)
        g64 = _grads(10 + k)
        step(both, g32 + g64, p32 + p64)
        step(single, g32, alone)
        ref.step([g.numpy() for g in g64])
    for a, b in zip(p32, alone):
        assert torch.equal(a, b) and torch.equal(both.state[a]["momentum"], single.state[b]["momentum"])
    for p, w in zip(p64, ref.ws):
        np.testing.assert_allclose(p.detach().numpy(), w, rtol=1e-13, atol=1e-15)


# ------------------------------------------------------------------------------------------------ schedules


SCHEDULE = {"learning_rate": 0.3, "decay_steps": 7, "power": 2.0, "warmup_steps": 3, "min_lr": 1e-3}


def test_float64_group_takes_the_schedules_float64_value():
    """A float64 group's learning rate is the schedule's value in float64 (its Python-number value, to
    rounding); a float32 group beside it keeps the float32 value of the int64 step tensor, as before."""
    schedule = optkit.PolicySchedule("poly_decay", **SCHEDULE)
    p64, p32 = _params(), _params(torch.float32, seed=1)
    opt = optkit.SGD([{"params": p64}, {"params": p32}], learning_rate=schedule)
    ws = [p.detach().numpy().copy() for p in p64]
    for k in range(6):
        grads = _grads(k)
        for p, g in zip(p64 + p32, grads + [g.float() for g in _grads(k)]):
            p.grad = g
        opt.step()
        lr64, lr32 = opt.param_groups[0]["lr"], opt.param_groups[1]["lr"]
        assert lr64.dtype == F64 and lr32.dtype == torch.float32
        assert lr64.item() == pytest.approx(schedule(k), rel=1e-15, abs=0)
        assert torch.equal(lr32, schedule(torch.tensor(k)))
        ws = [w - schedule(k) * g.numpy() for w, g in zip(ws, grads)]
    for p, w in zip(p64, ws):
        np.testing.assert_allclose(p.detach().numpy(), w, rtol=1e-14, atol=1e-16)


def test_train_op_with_a_device_step_evaluates_the_schedule_in_float64():
    """Under a dynamic loss scale the train op's step count lives on the device (an update may be skipped),
    so the schedule gets a step tensor: for a float64 model a float64 one, and the updates follow the
    schedule's float64 values (a float32 learning rate would be ~3e-8 off)."""
    schedule = optkit.PolicySchedule("poly_decay", **SCHEDULE)
    w = torch.zeros(3, dtype=F64, requires_grad=True)
    c = torch.tensor([0.7, -1.3, 2.1], dtype=F64)
    op = optkit.optimize_loss(lambda: (w * c).sum(), "SGD", {}, schedule, var_list=[w],
                              loss_scaling="dynamic")
    want = np.zeros(3)
    for k in range(6):
        op()
        want = want - schedule(k) * c.numpy()
    assert int(op.global_step) == 6
    np.testing.assert_allclose(w.detach().numpy(), want, rtol=1e-14, atol=1e-16)


@pytest.mark.parametrize("scale", [None, 3.0], ids=["plain", "static-scale-3"])
def test_keras_sgd_momentum_with_a_small_float64_learning_rate_is_exact(scale):
    """Keras SGD with momentum on float64 parameters and a small host learning rate: the velocity
    ``v ← μ·v − lr·g`` is carried in float64 (torch's fused kernel with the learning rate folded into its
    dampening, ``1 − fl(1 + lr)``, would give ``−lr`` only to 1.1e-16 absolute: 1e-11 relative at
    lr = 1e-5)."""
    gen = torch.Generator().manual_seed(3)
    w0 = torch.randn(5, 4, generator=gen, dtype=F64)
    grads = [torch.randn(5, 4, generator=gen, dtype=F64) for _ in range(4)]
    w = torch.nn.Parameter(w0.clone())
    lr, mu = 1e-5, 0.9
    opt = optkit.SGD([w], lr, momentum=mu)
    if scale is not None:
        opt = optkit.LossScaleOptimizer(opt, optkit.FixedLossScale(scale))
    v_ref, w_ref = np.zeros((5, 4)), w0.numpy().copy()
    for g in grads:
        w.grad = g.clone() if scale is None else g * scale
        if scale is not None:
            opt.grads_scaled = True
        opt.step()
        v_ref = mu * v_ref - lr * g.numpy()
        w_ref = w_ref + v_ref
    inner = opt if scale is None else opt.optimizer
    np.testing.assert_allclose(inner.state[w]["momentum"].numpy(), v_ref, rtol=1e-13, atol=0)
    np.testing.assert_allclose(w.detach().numpy(), w_ref, rtol=1e-13, atol=0)


class _TableSchedule(optkit.LearningRateSchedule):
    """A user's schedule that indexes a table with the step (an integer tensor, as it always was)."""

    def __init__(self, rates):
        self.rates = torch.tensor(rates, dtype=F64)

    def __call__(self, step):
        return self.rates[step]

    def get_config(self):
        return {"rates": self.rates.tolist()}


@pytest.mark.parametrize("via", ["optimizer", "train-op"])
def test_a_users_schedule_still_gets_the_integer_step_on_float64_parameters(via):
    """Only optkit's own policies are asked for their float64 value with a float64 step
    (``LearningRateSchedule.value``); a user's schedule gets the integer step tensor: one SGD step per rate,
    each ``w ← w − lr_t·1`` exactly."""
    rates = [0.5, 0.25, 0.125]
    w = torch.zeros(3, dtype=F64, requires_grad=True)
    sched = _TableSchedule(rates)
    if via == "optimizer":
        opt = optkit.SGD([w], sched)
        for _ in rates:
            w.grad = torch.ones_like(w)
            opt.step()
    else:
        op = optkit.optimize_loss(lambda: w.sum(), "SGD", {}, sched, var_list=[w])
        for _ in rates:
            op()
    assert w.detach().tolist() == [-sum(rates)] * 3
