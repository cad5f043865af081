"""LossScaleOptimizer: LS2/LS3 vectors (spec/tf_keras.md §3.5), float64 NumPy references, closure contract,
skip semantics (optkit and torch inner optimizers, incl. fused SGD's lazy state), checkpoints, validation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from optkit import LossScaleOptimizer, MixedPrecisionLossScaleOptimizer
from optkit.loss_scale import DynamicLossScale, FixedLossScale, LogMaxScaler
from optkit.sgd import SGD
from scaled_grads import scaled_step

INF, NAN = float("inf"), float("nan")


def _w(x=(1.0, 2.0), dtype=torch.float32):
    return torch.tensor(x, dtype=dtype, requires_grad=True)


@pytest.mark.parametrize("inner", ["optkit", "torch"])
def test_ls2_tf1_minimize(inner):
    """TF1 MixedPrecisionLossScaleOptimizer(GradientDescent(0.5), DynamicLossScale(8, 2)), loss = Σ w·x."""
    w = _w()
    base = SGD([w], 0.5) if inner == "optkit" else torch.optim.SGD([w], lr=0.5)
    opt = MixedPrecisionLossScaleOptimizer(base, DynamicLossScale(8.0, increment_period=2))
    table = [([1, 1], [0.5, 1.5], 1, 8), ([1, 1], [0, 1], 2, 16), ([INF, 1], [0, 1], 2, 8),
             ([1, 2], [-0.5, 0], 3, 8)]
    for x, w_after, step, scale in table:
        xt = torch.tensor(x, dtype=torch.float32)
        opt.minimize(lambda xt=xt: (w * xt).sum())
        torch.testing.assert_close(w.detach(), torch.tensor(w_after, dtype=torch.float32))
        assert float(opt.loss_scale) == scale
        if inner == "optkit":
            assert int(opt.iterations) == step
        assert bool(opt.step_applied) == (x[0] != INF)


@pytest.mark.parametrize("inner", ["optkit", "torch", "torch_fused"])
def test_ls3_scaled_gradients_through_step(inner):
    """Keras 3 LS3 vector with TF1's rule (they coincide here: the floor of 1 is never reached)."""
    w = _w()
    if inner == "optkit":
        base = SGD([w], 0.5)
    else:
        base = torch.optim.SGD([w], lr=0.5, fused=inner == "torch_fused")
    opt = LossScaleOptimizer(base, DynamicLossScale(8.0, increment_period=2))
    assert float(opt.scale_loss(torch.tensor(3.0))) == 24.0
    table = [([8, 16], [0.5, 1.0], 8, 1), ([8, 16], [0, 0], 16, 2), ([INF, 0], [0, 0], 8, 2),
             ([NAN, 0], [0, 0], 4, 2), ([4, 4], [-0.5, -0.5], 4, 3), ([4, 4], [-1, -1], 8, 4)]
    for g, w_after, scale, its in table:
        w.grad = torch.tensor(g, dtype=torch.float32)
        scaled_step(opt)
        torch.testing.assert_close(w.detach(), torch.tensor(w_after, dtype=torch.float32))
        assert float(opt.loss_scale) == scale
        if inner == "optkit":
            assert int(opt.iterations) == its
        opt.zero_grad()


def _np_dynamic(seq_finite, init, period):
    """TF1 DynamicLossScale rule in Python (float64)."""
    s, good, out = init, 0, []
    for fin in seq_finite:
        used = s
        if fin:
            if good + 1 >= period:
                s, good = s * 2, 0
            else:
                good += 1
        else:
            s, good = max(s / 2, 1.0), 0
        out.append((used, fin))
    return out


def test_float64_reference_momentum(rng):
    shapes = [(3, 4), (5,)]
    ws = [rng.normal(size=s) for s in shapes]
    finite = [True, True, False, True, True, True, False, True]
    grads = [[rng.normal(size=s) for s in shapes] for _ in finite]
    ps = [torch.tensor(w, requires_grad=True) for w in ws]
    opt = LossScaleOptimizer(SGD(ps, 0.1, momentum=0.9), DynamicLossScale(4.0, increment_period=2))
    ref_w = [w.copy() for w in ws]
    ref_v = [np.zeros_like(w) for w in ws]
    for (scale, fin), gs in zip(_np_dynamic(finite, 4.0, 2), grads):
        for p, g in zip(ps, gs):
            sg = g * scale
            if not fin:
                sg = sg.copy()
                sg.flat[0] = np.inf
            p.grad = torch.tensor(sg)
        scaled_step(opt)
        if fin:
            for i, g in enumerate(gs):
                ref_v[i] = 0.9 * ref_v[i] - 0.1 * g
                ref_w[i] = ref_w[i] + ref_v[i]
        for p, rw in zip(ps, ref_w):
            np.testing.assert_allclose(p.detach().numpy(), rw, rtol=1e-12, atol=1e-14)
    assert int(opt.iterations) == sum(finite)


def test_closure_contract_and_compute_gradients(rng):
    x = torch.tensor(rng.normal(size=(6, 3)), dtype=torch.float32)
    w0 = rng.normal(size=3)
    w = torch.tensor(w0, dtype=torch.float32, requires_grad=True)
    opt = LossScaleOptimizer(torch.optim.SGD([w], lr=0.1), FixedLossScale(128.0))

    def closure():
        opt.zero_grad()
        return (x @ w).pow(2).mean()

    loss = opt.step(closure)
    g_ref = 2 * x.numpy().T @ (x.numpy() @ w0) / 6
    assert float(loss.detach()) == pytest.approx(float(np.mean((x.numpy() @ w0) ** 2)), rel=1e-5)
    np.testing.assert_allclose(w.detach().numpy(), w0 - 0.1 * g_ref, rtol=1e-5)
    (g, v), = opt.compute_gradients(lambda: (x @ w).pow(2).mean())
    assert v is w
    g_ref = 2 * x.numpy().T @ (x.numpy() @ w.detach().numpy()) / 6
    np.testing.assert_allclose(g.numpy(), g_ref, rtol=1e-5)  # unscaled (TF1)
    assert opt.get_unscaled_gradients([torch.tensor([256.0]), None])[0].item() == 2.0


def test_fixed_scale_applies_non_finite_like_tf():
    w = _w()
    opt = LossScaleOptimizer(SGD([w], 0.5), 4)
    w.grad = torch.tensor([INF, 4.0])
    scaled_step(opt)
    assert math.isnan(w[0].item()) or math.isinf(w[0].item())
    w2 = _w()
    opt2 = LossScaleOptimizer(SGD([w2], 0.5), FixedLossScale(4.0, skip_non_finite=True))
    w2.grad = torch.tensor([INF, 4.0])
    scaled_step(opt2)
    assert torch.equal(w2.detach(), torch.tensor([1.0, 2.0])) and not bool(opt2.step_applied)


def test_skip_bit_identical_optkit_with_ema_and_schedule():
    w = _w((1.0, -2.0, 3.0))
    base = SGD([w], lambda step: 0.1 / (1.0 + step), momentum=0.9, use_ema=True)
    opt = LossScaleOptimizer(base, DynamicLossScale(16.0, increment_period=3))
    w.grad = torch.tensor([16.0, 32.0, -16.0])
    scaled_step(opt)
    snap = {k: v.clone() for k, v in opt.state[w].items()}
    w_snap, it_snap = w.detach().clone(), int(opt.iterations)
    w.grad = torch.tensor([NAN, 1.0, 1.0])
    scaled_step(opt)
    assert torch.equal(w.detach(), w_snap) and int(opt.iterations) == it_snap
    for k, v in opt.state[w].items():
        assert torch.equal(v, snap[k]), k
    # the next applied update uses schedule(1): v = 0.9 v - lr g; w += v
    w.grad = torch.tensor([8.0, 8.0, 8.0])  # scale is now 8
    scaled_step(opt)
    v1 = -0.1 * np.array([1.0, 2.0, -1.0])
    v2 = 0.9 * v1 - 0.05 * np.ones(3)
    np.testing.assert_allclose(w.detach().numpy(), np.array([1.0, -2.0, 3.0]) + v1 + v2, rtol=1e-6)


def test_skipped_first_step_torch_fused_sgd_momentum(rng):
    """P13: a skipped FIRST step must not leave uninitialised momentum buffers behind."""
    w0 = rng.normal(size=4)
    w = torch.tensor(w0, dtype=torch.float32, requires_grad=True)
    inner = torch.optim.SGD([w], lr=0.1, momentum=0.9, fused=True)
    opt = LossScaleOptimizer(inner, DynamicLossScale(8.0, increment_period=100))
    w.grad = torch.tensor([INF, 1.0, 1.0, 1.0])
    scaled_step(opt)
    assert not bool(opt.step_applied)
    assert not inner.state.get(w) and torch.equal(w.detach(), torch.tensor(w0, dtype=torch.float32))
    ref = torch.tensor(w0, dtype=torch.float32, requires_grad=True)
    ref_opt = torch.optim.SGD([ref], lr=0.1, momentum=0.9)
    for _ in range(3):
        g = torch.tensor(rng.normal(size=4), dtype=torch.float32)
        w.grad = g * 4.0  # scale after the overflow
        scaled_step(opt)
        ref.grad = g.clone()
        ref_opt.step()
        torch.testing.assert_close(w.detach(), ref.detach(), rtol=1e-6, atol=1e-7)
    # later skips use the folded found_inf (state exists) and still change nothing
    snap_w, snap_m = w.detach().clone(), inner.state[w]["momentum_buffer"].clone()
    w.grad = torch.tensor([NAN, 1.0, 1.0, 1.0])
    scaled_step(opt)
    assert torch.equal(w.detach(), snap_w) and torch.equal(inner.state[w]["momentum_buffer"], snap_m)


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adam(ps, lr=0.1),
    lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.0, foreach=True),
    lambda ps: torch.optim.Adam(ps, lr=0.1, fused=True),
])
def test_skip_generic_and_fused_adam(make, rng):
    ws = [torch.tensor(rng.normal(size=s), dtype=torch.float32, requires_grad=True) for s in [(3, 2), (4,)]]
    w_init = [p.detach().clone() for p in ws]
    inner = make(ws)
    opt = LossScaleOptimizer(inner, DynamicLossScale(4.0))
    for p in ws:
        p.grad = torch.full_like(p, INF)
    scaled_step(opt)
    assert all(not inner.state.get(p) for p in ws)
    for p in ws:
        p.grad = torch.ones_like(p) * 2.0
    scaled_step(opt)
    snap = [{k: v.clone() for k, v in inner.state[p].items()} for p in ws]
    snap_w = [p.detach().clone() for p in ws]
    for p in ws:
        p.grad = torch.full_like(p, NAN)
    scaled_step(opt)
    for p, s, sw in zip(ws, snap, snap_w):
        assert torch.equal(p.detach(), sw)
        for k, v in inner.state[p].items():
            assert torch.equal(v, s[k]), k
    # the applied step was Adam's first step on the unscaled gradient 1 (scale 2 after the overflow):
    # m̂ = 1, v̂ = 1, so every weight moved by -lr/(1 + eps)
    for sw, wi in zip(snap_w, w_init):
        torch.testing.assert_close(sw, wi - 0.1 / (1 + 1e-8), rtol=1e-6, atol=1e-7)


def test_logmax_scaler_gets_unscaled_amax():
    w = _w((1.0, -3.0))
    scaler = LogMaxScaler()
    opt = LossScaleOptimizer(SGD([w], 0.1), scaler)
    s0 = float(opt.loss_scale)
    w.grad = torch.tensor([0.5, -4.0]) * s0
    scaled_step(opt)
    ref = LogMaxScaler()
    ref.update(torch.zeros(()), torch.tensor(4.0))
    assert float(opt.loss_scale) == pytest.approx(float(ref()), rel=1e-6)


def test_state_dict_round_trip_includes_scaler(rng):
    grads = [rng.normal(size=3) for _ in range(6)]
    bad = {1, 4}

    def make():
        w = _w((0.5, -0.5, 1.0))
        return w, LossScaleOptimizer(SGD([w], 0.1, momentum=0.5), DynamicLossScale(8.0, increment_period=2))

    def run(w, opt, gs, offset):
        for i, g in enumerate(gs):
            g = torch.tensor(g, dtype=torch.float32) * opt.loss_scale
            if i + offset in bad:
                g[0] = INF
            w.grad = g
            scaled_step(opt)

    w1, o1 = make()
    run(w1, o1, grads, 0)
    w2, o2 = make()
    run(w2, o2, grads[:3], 0)
    sd = o2.state_dict()
    assert set(sd["wrapper"]) == {"type", "loss_scale"}
    w3, o3 = make()
    with torch.no_grad():
        w3.copy_(w2)
    o3.load_state_dict(sd)
    assert float(o3.loss_scale) == float(o2.loss_scale)
    run(w3, o3, grads[3:], 3)
    assert torch.equal(w1.detach(), w3.detach()) and float(o1.loss_scale) == float(o3.loss_scale)
    # a bad wrapper part leaves everything untouched
    scale_before = float(o3.loss_scale)
    broken = {"optimizer": o3.optimizer.state_dict(), "wrapper": {"type": "LossScaleOptimizer",
                                                                   "loss_scale": {"scale": "x"}}}
    with pytest.raises(ValueError):
        o3.load_state_dict(broken)
    assert float(o3.loss_scale) == scale_before
    with pytest.raises(ValueError):
        o3.load_state_dict(o3.optimizer.state_dict())


def test_validation_and_surface():
    w = _w()
    with pytest.raises(ValueError, match="None"):
        LossScaleOptimizer(SGD([w], 0.1), None)
    with pytest.raises(ValueError, match="interpret"):
        LossScaleOptimizer(SGD([w], 0.1), "sometimes")
    with pytest.raises(ValueError):
        LossScaleOptimizer(SGD([w], 0.1), 0.5)
    with pytest.raises(TypeError, match="opt"):
        LossScaleOptimizer(object(), "dynamic")
    opt = LossScaleOptimizer(SGD([w], 0.1))
    assert float(opt.loss_scale) == 2.0**15
    assert opt.get_config()["loss_scale"]["class_name"] == "DynamicLossScale"
    assert len(opt.variables()) == 1 + 4  # inner iterations + the scaler's state tensors
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5 ** e)
    w.grad = torch.ones(2) * float(opt.loss_scale)
    scaled_step(opt)
    sched.step()
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


@pytest.mark.parametrize("wrapper", ["LossScaleOptimizer", "MixedPrecisionOptimizerWrapper"])
def test_both_loss_scale_wrappers_refuse_an_unscaled_backward_from_the_first_step(rng, wrapper):
    """``scaled_backward_step``'s check (shared by both wrappers) reads the model's gradients: a plain
    ``loss.backward()`` raises on every step, the first included (the mixed-precision wrapper used to look at
    its fp32 masters, which have no gradient before the first step, and silently divided by S there). After
    the refusals the scaled path applies ``w - lr·g`` (float64 reference)."""
    from optkit import MixedPrecisionOptimizerWrapper

    S, lr = 512.0, 0.25
    dtype = torch.float32 if wrapper == "LossScaleOptimizer" else torch.float16
    w = torch.tensor(rng.normal(size=6), dtype=dtype, requires_grad=True)
    c = rng.uniform(0.5, 2.0, size=6)
    make = LossScaleOptimizer if wrapper == "LossScaleOptimizer" else MixedPrecisionOptimizerWrapper
    opt = make(torch.optim.SGD([w], lr=lr), DynamicLossScale(S))
    w0 = w.detach().clone()

    def loss():  # ½Σ c·w²: gradient c·w
        return 0.5 * (torch.tensor(c, dtype=torch.float32) * w.float() ** 2).sum()

    for _ in range(2):
        opt.zero_grad()
        loss().backward()
        with pytest.raises(RuntimeError, match="did not come from scale_loss"):
            opt.step()
        assert torch.equal(w.detach(), w0) and float(opt.loss_scale) == S
    opt.zero_grad()
    opt.scale_loss(loss()).backward()
    opt.step()
    w64 = w0.double().numpy()
    got = w.detach().double().numpy() if dtype == torch.float32 else opt.master_params[0].detach().numpy()
    np.testing.assert_allclose(got, w64 - lr * c * w64, rtol=2e-3 if dtype == torch.float16 else 1e-6)


@pytest.mark.parametrize("clip", ["global_clipnorm", "clipnorm"])
def test_a_scale_too_large_for_a_float32_norm_backs_off_instead_of_nan(clip):
    """A dynamic scale grown so large that the norm of the scaled gradients overflows float32 (S·|g| beyond
    about 1.8e19; every element finite): the clip would be NaN (global) or 0. The step is skipped and counted
    as an overflow, so the scale halves until the norm fits, and the updates that apply are exact."""
    rng = np.random.default_rng(5)
    w0 = rng.standard_normal(64).astype(np.float32)
    g = rng.standard_normal(64).astype(np.float32)  # ‖g‖ ≈ 8: the norm overflows above S ≈ 2^61
    w = torch.nn.Parameter(torch.tensor(w0))
    opt = LossScaleOptimizer(SGD([w], learning_rate=0.1, **{clip: 1.0}),
                             DynamicLossScale(initial_loss_scale=2.0 ** 70, increment_period=1000))
    applied = []
    for _ in range(12):
        opt.scale_loss((w * torch.tensor(g)).sum()).backward()
        opt.step()
        opt.zero_grad()
        applied.append(bool(opt.step_applied))
    assert np.isfinite(w.detach().numpy()).all()
    backoffs = applied.index(True)
    assert 5 <= backoffs <= 10 and all(applied[backoffs:])
    assert float(opt.loss_scale) == 2.0 ** (70 - backoffs)
    clipped = g.astype(np.float64) * min(1.0, 1.0 / np.linalg.norm(g.astype(np.float64)))
    expected = w0.astype(np.float64) - 0.1 * (12 - backoffs) * clipped
    np.testing.assert_allclose(w.detach().numpy(), expected, rtol=1e-5, atol=1e-6)


def test_a_compiled_training_step_with_scale_loss_matches_eager():
    """``torch.compile`` of a training step that calls ``scale_loss(loss).backward()`` and ``step()``: the
    wrapper's flags (``grads_scaled``, ``step_applied``) live in an object whose mutations dynamo replays
    (assignments on an optimizer it drops, and the step refused the gradients as unscaled)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 8, generator=g, dtype=torch.float64)
    y = torch.randn(16, 4, generator=g, dtype=torch.float64)

    def build():
        gen = torch.Generator().manual_seed(1)
        w = torch.nn.Parameter(torch.randn(8, 4, generator=gen, dtype=torch.float64))
        return w, LossScaleOptimizer(SGD([w], learning_rate=0.05, momentum=0.9),
                                     DynamicLossScale(2.0 ** 10, increment_period=2))

    def step(w, opt, factor):
        opt.zero_grad()
        opt.scale_loss(((x @ w - y) ** 2).mean() * factor).backward()
        opt.step()

    torch._dynamo.reset()
    (we, oe), (wc, oc) = build(), build()
    compiled = torch.compile(step, backend="eager")
    for k in range(5):
        factor = torch.tensor(float("inf") if k == 2 else 1.0, dtype=torch.float64)
        step(we, oe, factor)
        compiled(wc, oc, factor)
        assert bool(oc.step_applied) == bool(oe.step_applied) == (k != 2)
        assert torch.equal(wc, we) and float(oc.loss_scale) == float(oe.loss_scale)


def test_steps_without_gradients_leave_the_dynamic_scale_alone():
    """A step where no parameter has a gradient (a frozen phase, the other half of a GAN loop) finds nothing:
    the scale stays (the overflow probe counts only a clip norm that overflowed)."""
    a = torch.nn.Parameter(torch.ones(3))
    opt = LossScaleOptimizer(SGD([a], learning_rate=0.1, global_clipnorm=1.0), DynamicLossScale(2.0 ** 15))
    for _ in range(3):
        opt.zero_grad()
        opt.grads_scaled = True
        opt.step()
        assert float(opt.loss_scale) == 2.0 ** 15


def test_a_huge_scale_under_gradscaler_is_not_skipped_for_good():
    """torch.amp.GradScaler cannot back off for a refusal it does not see: under it the optimizer does not
    skip for an overflowed clip norm (its documented NaN, as before), so a GradScaler run never stalls."""
    w = torch.nn.Parameter(torch.ones(4))
    opt = SGD([w], learning_rate=0.1, clipnorm=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20)
    for _ in range(2):
        opt.zero_grad()
        scaler.scale((w * 3.0).sum()).backward()
        scaler.step(opt)
        scaler.update()
    np.testing.assert_allclose(w.detach().numpy(), 1.0 - 2 * 0.1 * 0.5, rtol=1e-6)  # clip to norm 1: 0.5 each


def _refuse_once(opt):
    """A step pre-hook on ``opt`` that raises at the first step only (any refusal of the inner step)."""
    armed = [True]

    def pre(o, args, kwargs):
        if armed[0]:
            armed[0] = False
            raise RuntimeError("inner step refused")

    return opt.register_step_pre_hook(pre)


@pytest.mark.parametrize("scale", [128.0, 1000.0])
def test_a_refused_inner_step_leaves_the_gradients_scaled_for_a_retry(scale):
    """Around a torch optimizer (the gradients are unscaled in place before its step), an inner step that
    raises left them unscaled while they still counted as scaled, so a retried step unscaled them twice.
    Now they carry the scale again, and the retry gives the one-step result (float64 formula, and
    torch.amp.GradScaler's retry); a non-power-of-two scale comes back to within the float32 rounding of the
    factor 1/S (which the step protocol uses, as GradScaler does)."""
    import optkit

    w0 = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    w = torch.nn.Parameter(w0.clone())
    inner = torch.optim.SGD([w], lr=0.1)
    opt = optkit.LossScaleOptimizer(inner, scale)
    opt.scale_loss((w ** 2).sum()).backward()  # grad = S·2w
    g = w.grad.clone()
    _refuse_once(inner)
    with pytest.raises(RuntimeError, match="refused"):
        opt.step()
    tol = 1e-15 if scale == 128.0 else 1e-7
    torch.testing.assert_close(w.grad, g, rtol=tol, atol=0)
    assert torch.equal(w.detach(), w0)
    opt.step()
    torch.testing.assert_close(w.detach(), w0 * (1 - 0.2), rtol=tol, atol=0)
    w2 = torch.nn.Parameter(w0.clone())
    inner2 = torch.optim.SGD([w2], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    scaler.scale((w2 ** 2).sum()).backward()
    _refuse_once(inner2)
    with pytest.raises(RuntimeError, match="refused"):
        scaler.step(inner2)
    scaler.step(inner2)
    torch.testing.assert_close(w.detach(), w2.detach(), rtol=tol, atol=0)


@pytest.mark.parametrize("how", ["step", "closure-constant", "closure-none", "closure-unconnected"])
@pytest.mark.parametrize("inner", ["optkit", "torch"])
@pytest.mark.parametrize("wrapper", ["LossScaleOptimizer", "MixedPrecisionOptimizerWrapper"])
def test_a_step_without_any_gradient_is_a_no_op(rng, wrapper, inner, how):
    """torch's contract: a step where no parameter has a gradient changes nothing and returns the closure's
    loss (the closure's loss may not require grad: a frozen phase, an evaluation closure, a loss that does not
    reach the parameters). Both loss-scale wrappers, over optkit's Adam and ``torch.optim.Adam``: the
    parameters, fp32 masters, inner state, ``iterations`` and the whole scaler state (its good-step count
    too: with ``increment_period=2`` a counted no-op would double the scale) stay bit for bit, and
    ``step_applied`` is False; ``torch.optim.Adam`` driven by the same closure is the reference. An unscaled
    backward inside the closure still raises (the guard for gradients that would be divided)."""
    from optkit import Adam, MixedPrecisionOptimizerWrapper

    dtype = torch.float32 if wrapper == "LossScaleOptimizer" else torch.float16
    w0 = rng.normal(size=(4, 3))
    c = torch.tensor(rng.uniform(0.5, 2.0, size=(4, 3)), dtype=torch.float32)
    w = torch.tensor(w0, dtype=dtype, requires_grad=True)
    ref_w = torch.tensor(w0, dtype=torch.float32, requires_grad=True)
    build = (lambda ps: Adam(ps, learning_rate=0.1)) if inner == "optkit" else (
        lambda ps: torch.optim.Adam(ps, lr=0.1))
    make = LossScaleOptimizer if wrapper == "LossScaleOptimizer" else MixedPrecisionOptimizerWrapper
    opt = make(build([w]), DynamicLossScale(64.0, increment_period=2))
    ref = torch.optim.Adam([ref_w], lr=0.1)
    opt.scale_loss((c * w.float()).sum()).backward()  # one real step first: state and a good-step count
    opt.step()
    (c * ref_w).sum().backward()
    ref.step()
    x = torch.tensor(rng.normal(size=3), dtype=torch.float32, requires_grad=True)
    value = torch.tensor(1.5)

    def closure_for(model_opt):
        def closure():
            model_opt.zero_grad()
            if how == "closure-constant":
                return value
            if how == "closure-unconnected":  # requires grad, reaches no parameter
                return (x ** 2).sum()
            return None
        return closure

    def frozen(o, ps):
        return [t.detach().clone() for t in ps] + [v.detach().clone() for st in o.state.values()
                                                   for v in st.values() if isinstance(v, torch.Tensor)]

    opt.zero_grad()
    ref.zero_grad()
    masters = list(getattr(opt, "master_params", []))
    before, ref_before = frozen(opt, [w] + masters), frozen(ref, [ref_w])
    scaler_before = opt.loss_scaler.state_dict()
    its = int(opt.iterations) if inner == "optkit" else None
    for _ in range(2):
        if how == "step":
            got, expected = opt.step(), ref.step()
        else:
            got, expected = opt.step(closure_for(opt)), ref.step(closure_for(ref))
        if isinstance(expected, torch.Tensor):
            assert torch.equal(got.detach(), expected.detach())
        else:
            assert got is expected is None
        assert not bool(opt.step_applied)
        for a, b in zip(frozen(ref, [ref_w]), ref_before):
            assert torch.equal(a, b)
        after = frozen(opt, [w] + masters)
        assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
        for k, v in opt.loss_scaler.state_dict().items():
            assert k == "config" or torch.equal(v, scaler_before[k]), k
        if its is not None:
            assert int(opt.iterations) == its

    def unscaled_backward():
        opt.zero_grad()
        (c * w.float()).sum().backward()
        return None

    with pytest.raises(RuntimeError, match="back-propagated by itself, unscaled"):
        opt.step(unscaled_backward)
    assert all(torch.equal(a, b) for a, b in zip(frozen(opt, [w] + masters), before))
