"""Stacked wrappers: LARC inside LossScaleOptimizer inside VariableClippingOptimizer over optkit SGD and torch
AdamW (float64 references), protocol propagation, skips through the stack, GradScaler and lr schedulers on a
stack, masters seen by inner wrappers, nested checkpoints."""

from __future__ import annotations

import contextlib
import copy
import warnings

import numpy as np
import pytest
import torch

from optkit import LARC, LossScaleOptimizer, MixedPrecisionOptimizerWrapper, VariableClippingOptimizer
from optkit.loss_scale import DynamicLossScale
from optkit.sgd import SGD
from scaled_grads import scaled_step

INF = float("inf")
S0 = 1024.0


def np_ratio_clip(w, g, lr, eta, eps=1e-7, min_update=1e-7):
    return min(max(eta * np.linalg.norm(w) / (lr * (np.linalg.norm(g) + eps)), min_update), 1.0)


def np_clip_rows(w, c):
    n = np.sqrt((w * w).sum(axis=1, keepdims=True))
    return w * c / np.maximum(n, c)


def _stack(kind, ps, lr=0.1):
    if kind == "optkit_sgd":
        base = SGD(ps, lr, momentum=0.9)
    elif kind == "torch_adamw":
        base = torch.optim.AdamW(ps, lr=lr, weight_decay=0.01)
    else:
        base = torch.optim.SGD(ps, lr=lr, momentum=0.9, fused=True)
    lso = LossScaleOptimizer(LARC(base, 0.01), DynamicLossScale(S0, increment_period=1000))
    return VariableClippingOptimizer(lso, {ps[0]: [1]}, 1.5), base


@pytest.mark.parametrize("kind", ["optkit_sgd", "torch_adamw", "torch_fused_sgd"])
def test_stack_matches_float64_reference(rng, kind):
    shapes = [(4, 3), (6,)]
    ws = [rng.normal(size=s) for s in shapes]
    ps = [torch.tensor(w, requires_grad=True) for w in ws]
    opt, _ = _stack(kind, ps)
    ref = [torch.tensor(w, requires_grad=True) for w in ws]
    if kind == "torch_adamw":
        ref_opt = torch.optim.AdamW(ref, lr=0.1, weight_decay=0.01)
    else:
        ref_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9)
    keras_v = [np.zeros_like(w) for w in ws]
    for _ in range(3):
        gs = [rng.normal(size=s) for s in shapes]
        for p, g in zip(ps, gs):
            p.grad = torch.tensor(g * S0)
        scaled_step(opt)
        gps = [np_ratio_clip(r.detach().numpy(), g, 0.1, 0.01) * g for r, g in zip(ref, gs)]
        if kind == "optkit_sgd":  # Keras form: v = μv − lr g; w += v
            with torch.no_grad():
                for i, (r, gp) in enumerate(zip(ref, gps)):
                    keras_v[i] = 0.9 * keras_v[i] - 0.1 * gp
                    r.add_(torch.tensor(keras_v[i]))
        else:
            for r, gp in zip(ref, gps):
                r.grad = torch.tensor(gp)
            ref_opt.step()
        with torch.no_grad():
            ref[0].copy_(torch.tensor(np_clip_rows(ref[0].numpy(), 1.5)))
        for p, r in zip(ps, ref):
            np.testing.assert_allclose(p.detach().numpy(), r.detach().numpy(), rtol=1e-6, atol=1e-9)
    assert np.all(np.linalg.norm(ps[0].detach().numpy(), axis=1) <= 1.5 * (1 + 1e-12))


@pytest.mark.parametrize("kind", ["optkit_sgd", "torch_adamw", "torch_fused_sgd"])
def test_skip_through_stack_is_bit_identical(rng, kind):
    ps = [torch.tensor(rng.normal(size=s) * 3, dtype=torch.float32, requires_grad=True)
          for s in [(4, 3), (5,)]]
    opt, base = _stack(kind, ps)
    if kind != "optkit_sgd":  # first step skipped: torch must not create (uninitialised) state
        ps[1].grad = torch.full((5,), INF)
        ps[0].grad = torch.ones(4, 3)
        scaled_step(opt)
        assert not bool(opt.step_applied) and not any(base.state.get(p) for p in ps)
    for p in ps:
        p.grad = torch.ones_like(p) * float(opt.optimizer.loss_scale)
    scaled_step(opt)
    assert bool(opt.step_applied)
    snap_p = [p.detach().clone() for p in ps]
    snap_s = [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in base.state[p].items()}
              for p in ps]
    its = int(opt.iterations) if kind == "optkit_sgd" else None
    scale = float(opt.optimizer.loss_scale)
    ps[0].grad = torch.ones(4, 3)
    ps[1].grad = torch.tensor([float("nan")] * 5)
    scaled_step(opt)
    assert not bool(opt.step_applied) and float(opt.optimizer.loss_scale) == scale / 2
    for p, sp_, ss in zip(ps, snap_p, snap_s):
        assert torch.equal(p.detach(), sp_)
        for k, v in base.state[p].items():
            assert torch.equal(v, ss[k]) if isinstance(v, torch.Tensor) else v == ss[k]
    if its is not None:
        assert int(opt.iterations) == its


def test_protocol_reaches_optkit_inner_as_a_context():
    """The loss scale, the skip flag and LARC's multipliers reach the innermost optkit optimizer as its
    ``apply_step`` context (between its own step hooks); nothing is set on any optimizer of the stack."""
    p = torch.tensor([3.0, 4.0], requires_grad=True)
    base = SGD([p], 0.1)
    seen, contexts = {}, []

    def hook(o, args, kwargs):
        seen.update({k: getattr(o, k, None) for k in ("grad_scale", "found_inf", "grad_multipliers")})

    base.register_step_pre_hook(hook)
    apply = base.apply_step
    base.apply_step = lambda context: contexts.append(context) or apply(context)
    opt = LossScaleOptimizer(LARC(base, 0.002), DynamicLossScale(8.0))
    p.grad = torch.tensor([0.3, 0.4]) * 8
    scaled_step(opt)
    assert seen == dict.fromkeys(("grad_scale", "found_inf", "grad_multipliers"))  # (ran; no attributes)
    (context,) = contexts
    assert float(context.grad_scale) == 8.0 and float(context.found_inf) == 0.0
    (key, mult), = context.multipliers.items()
    assert key == id(p) and float(mult) == pytest.approx(0.19999996, rel=1e-6)
    for k in ("grad_scale", "found_inf", "grad_multipliers"):
        assert k not in base.__dict__ and k not in opt.optimizer.__dict__
    np.testing.assert_allclose(p.detach().numpy(), [3 - 0.1 * 0.06, 4 - 0.1 * 0.08], rtol=1e-6)


def test_larc_outside_loss_scaling_over_fused_torch():
    """Multipliers from an outer LARC travel through LossScaleOptimizer to a torch fused optimizer. (An
    outer LARC sees the gradients as they come, i.e. scaled: put loss scaling outside LARC in real use.)"""
    p = torch.tensor([3.0, 4.0], requires_grad=True)
    opt = LARC(LossScaleOptimizer(torch.optim.SGD([p], lr=0.1, fused=True), 1.0), 0.002)
    p.grad = torch.tensor([0.3, 0.4])
    scaled_step(opt)
    np.testing.assert_allclose(p.detach().numpy(), [3 - 0.1 * 0.06, 4 - 0.1 * 0.08], rtol=1e-6)


def test_grad_scaler_drives_a_stack(rng):
    x = torch.tensor(rng.normal(size=(8, 3)), dtype=torch.float32)
    w0 = rng.normal(size=(2, 3))

    def make():
        w = torch.tensor(w0, dtype=torch.float32, requires_grad=True)
        return w, VariableClippingOptimizer(LARC(SGD([w], 0.1, momentum=0.9), 0.01), {w: [1]}, 2.0)

    w1, o1 = make()
    w2, o2 = make()
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    for _ in range(3):
        o1.zero_grad()
        (x @ w1.T).pow(2).mean().backward()
        o1.step()
        o2.zero_grad()
        scaler.scale((x @ w2.T).pow(2).mean()).backward()
        scaler.step(o2)
        scaler.update()
    torch.testing.assert_close(w1.detach(), w2.detach(), rtol=1e-6, atol=1e-7)


def test_lr_scheduler_on_stack_reaches_larc():
    p = torch.tensor([[3.0, 4.0]], requires_grad=True)
    opt, base = _stack("optkit_sgd", [p], lr=0.2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    assert opt.param_groups is base.param_groups
    for lr in (0.2, 0.1):
        w = p.detach().numpy().copy()
        g = np.array([[0.3, 0.4]])
        p.grad = torch.tensor(g * S0, dtype=torch.float32)
        scaled_step(opt)
        sched.step()
        expect = np_clip_rows(w - lr * np_ratio_clip(w, g, lr, 0.01) * g, 1.5)  # momentum buffer was zero
        if lr == 0.2:
            np.testing.assert_allclose(p.detach().numpy(), expect, rtol=1e-6)
    assert base.param_groups[0]["lr"] == pytest.approx(0.05)


def test_nested_state_dict_round_trip(rng):
    grads = [[rng.normal(size=s) for s in [(4, 3), (6,)]] for _ in range(5)]
    w0 = [rng.normal(size=s) for s in [(4, 3), (6,)]]

    def make():
        ps = [torch.tensor(w, dtype=torch.float32, requires_grad=True) for w in w0]
        return ps, _stack("torch_adamw", ps)[0]

    def run(ps, opt, gs):
        for step_g in gs:
            for p, g in zip(ps, step_g):
                p.grad = torch.tensor(g, dtype=torch.float32) * opt.optimizer.loss_scale
            scaled_step(opt)

    pa, oa = make()
    run(pa, oa, grads)
    pb, ob = make()
    run(pb, ob, grads[:2])
    sd = ob.state_dict()
    assert sd["wrapper"]["type"] == "VariableClippingOptimizer"
    assert sd["optimizer"]["wrapper"]["type"] == "LossScaleOptimizer"
    assert sd["optimizer"]["optimizer"]["wrapper"]["type"] == "LARC"
    pc, oc = make()
    with torch.no_grad():
        for c, b in zip(pc, pb):
            c.copy_(b)
    oc.load_state_dict(sd)
    run(pc, oc, grads[2:])
    for a, c in zip(pa, pc):
        assert torch.equal(a.detach(), c.detach())


def test_masters_remapped_into_inner_wrappers():
    """MixedPrecisionOptimizerWrapper(VariableClippingOptimizer(LARC(SGD))) built on fp16 model params."""
    p = torch.tensor([[3.0, 4.0], [0.3, 0.4]], dtype=torch.float16, requires_grad=True)
    vc = VariableClippingOptimizer(LARC(SGD([p], 0.1), 0.01), {p: [1]}, 1.0)
    opt = MixedPrecisionOptimizerWrapper(vc, "dynamic")
    m = opt.master_params[0]
    assert vc.vars_to_clip_dims == {m: [1]}
    p.grad = torch.full((2, 2), 0.01, dtype=torch.float16) * float(opt.loss_scale)
    scaled_step(opt)
    norms = np.linalg.norm(m.detach().numpy(), axis=1)
    assert norms[0] == pytest.approx(1.0, rel=1e-6) and norms[1] < 1.0
    torch.testing.assert_close(p.detach(), m.detach().half())


def test_finalize_variable_values_passes_through_wrappers_and_refreshes_half_params():
    import torch

    from optkit import LARC, SGD, LossScaleOptimizer, MixedPrecisionOptimizerWrapper

    torch.manual_seed(3)
    w32 = torch.nn.Parameter(torch.randn(6))
    opt = LossScaleOptimizer(LARC(SGD([w32], 0.1, use_ema=True, ema_momentum=0.5), larc_eta=0.01), 4.0)
    for _ in range(3):
        w32.grad = torch.randn(6) * 4.0  # scaled by the fixed loss scale
        scaled_step(opt)
    avg = opt.optimizer.optimizer.state[w32]["average"].clone()
    opt.finalize_variable_values()
    assert torch.equal(w32.detach(), avg)

    w16 = torch.nn.Parameter(torch.randn(5).half())
    mp = MixedPrecisionOptimizerWrapper(SGD([w16], 0.1, use_ema=True, ema_momentum=0.5))
    for _ in range(2):
        w16.grad = torch.randn(5).half()
        mp.step()
    master = mp.master_of(w16)
    avg = mp.optimizer.state[master]["average"].clone()
    mp.finalize_variable_values()
    assert torch.equal(master.detach(), avg)
    assert torch.equal(w16.detach(), avg.half())


@pytest.mark.parametrize("slot,value,match", [
    ("exp_avg", torch.zeros(3), "shape"),
    ("exp_avg_sq", torch.zeros(4, 3, dtype=torch.int64), "dtype"),
    ("step", torch.tensor(-1.0), "whole number in"),
    ("exp_avg", [0.0] * 12, "not a tensor"),
])
def test_torch_inner_state_is_validated_before_loading(rng, slot, value, match):
    """A wrapper over a ``torch.optim`` optimizer checks the inner state before torch loads it (torch checks
    only the group and parameter counts; its kernels would read past a short slot)."""
    w = torch.nn.Parameter(torch.tensor(rng.standard_normal((4, 3)), dtype=torch.float32))
    opt = LossScaleOptimizer(torch.optim.Adam([w], lr=0.1), DynamicLossScale(8.0))
    w.grad = torch.tensor(rng.standard_normal((4, 3)), dtype=torch.float32) * 8.0
    scaled_step(opt)
    sd = copy.deepcopy(opt.state_dict())  # torch's state_dict holds the live per-parameter dicts
    sd["optimizer"]["state"][0][slot] = value
    before = (w.detach().clone(), {k: v.clone() for k, v in opt.optimizer.state[w].items()},
              opt.loss_scale.clone())
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    assert torch.equal(w.detach(), before[0]) and torch.equal(opt.loss_scale, before[2])
    for k, v in before[1].items():
        assert torch.equal(opt.optimizer.state[w][k], v)
    unknown = copy.deepcopy(opt.state_dict())
    unknown["optimizer"]["state"][7] = {}
    with pytest.raises(ValueError, match="unknown parameter id 7"):
        opt.load_state_dict(unknown)


def test_a_raising_inner_step_leaves_the_scale_alone(rng):
    """torch's Adam refuses sparse gradients: the wrapper has not advanced its scale when the error comes."""
    emb = torch.nn.Embedding(6, 3, sparse=True)
    opt = LossScaleOptimizer(torch.optim.Adam(emb.parameters(), lr=0.1), DynamicLossScale(8.0, 1))
    emb(torch.tensor([1, 4])).sum().mul(8.0).backward()
    sd = opt.loss_scaler.state_dict()
    with pytest.raises(RuntimeError, match="sparse"):
        scaled_step(opt)
    for k, v in opt.loss_scaler.state_dict().items():
        assert k == "config" or torch.equal(v, sd[k]), k


@contextlib.contextmanager
def _global_step_hooks(calls):
    """Global step pre/post hooks recording ``global-pre:<class>``/``global-post:<class>`` into ``calls``."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def record(what):
        return lambda o, a, k: calls.append(f"{what}:{type(o).__name__}")

    handles = [register_optimizer_step_pre_hook(record("global-pre")),
               register_optimizer_step_post_hook(record("global-post"))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _instance_step_hooks(opt, tag, calls):
    opt.register_step_pre_hook(lambda o, a, k: calls.append(f"{tag}-pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append(f"{tag}-post"))


@pytest.mark.parametrize("inner_kind", ["optkit_sgd", "torch_sgd"])
def test_global_step_hooks_fire_once_with_an_lr_scheduler_on_the_inner_optimizer(inner_kind):
    """A torch LR scheduler built on the inner optimizer patches its ``step`` per instance; through a stack
    the global step hooks still fire once per outermost ``step()`` (docs/compatibility.md), the inner
    optimizer's own hooks once, the scheduler sees the step (no order warning) and the trajectory is torch
    SGD's under the same ``StepLR`` (η large: LARC's ratio is 1; a fixed loss scale of 1)."""
    p = torch.tensor([3.0, 4.0], requires_grad=True)
    q = p.detach().clone().requires_grad_()
    inner = SGD([p], 0.1) if inner_kind == "optkit_sgd" else torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    opt = LossScaleOptimizer(LARC(inner, 1e3), 1.0)
    ref = torch.optim.SGD([q], lr=0.1)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=1, gamma=0.5)
    calls: list[str] = []
    _instance_step_hooks(inner, "inner", calls)
    with _global_step_hooks(calls), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            p.grad = torch.tensor([0.3 * (i + 1), -0.4])
            q.grad = p.grad.clone()
            calls.clear()
            opt.step()
            assert calls == ["global-pre:LossScaleOptimizer", "inner-pre", "inner-post",
                             "global-post:LossScaleOptimizer"]
            ref.step()
            sched.step()
            ref_sched.step()
    assert not [w for w in caught if "lr_scheduler" in str(w.message)]
    torch.testing.assert_close(p.detach(), q.detach())
    assert inner.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 3)


def _hooked_wrapper(kind, p):
    base = SGD([p], 0.1)
    if kind == "larc":
        return LARC(base, 1e3), base  # η large: r = 1
    if kind == "loss_scale":
        return LossScaleOptimizer(base, DynamicLossScale(S0)), base
    if kind == "variable_clipping":
        return VariableClippingOptimizer(base, {p: [0]}, 1e3), base
    return MixedPrecisionOptimizerWrapper(base, DynamicLossScale(S0)), base


@pytest.mark.parametrize("entry", ["apply_gradients", "minimize"])
@pytest.mark.parametrize("kind", ["larc", "loss_scale", "variable_clipping", "mixed_precision"])
def test_apply_gradients_is_one_step_of_the_wrapper_with_its_hooks(kind, entry):
    """``apply_gradients``/``minimize`` of a wrapper is one step of it, as for an optkit optimizer: the global
    and the wrapper's own step hooks fire once around it (torch's order), the inner optimizer's own hooks once
    inside. A pre-hook of the wrapper sees the installed gradient copy (halving it halves the update; the
    caller's tensor stays), and the loss-scale wrappers still take **unscaled** gradients: the result is torch
    SGD's with half the gradient."""
    p = torch.tensor([3.0, 4.0], requires_grad=True)
    q = p.detach().clone().requires_grad_()
    opt, base = _hooked_wrapper(kind, p)
    ref = torch.optim.SGD([q], lr=0.1)
    calls: list[str] = []
    _instance_step_hooks(opt, "wrapper", calls)
    _instance_step_hooks(base, "inner", calls)

    def halve(o, args, kwargs):
        p.grad.mul_(0.5)

    opt.register_step_pre_hook(halve)
    c = torch.tensor([0.3, -0.4])
    g = c.clone()
    with _global_step_hooks(calls):
        for _ in range(2):
            calls.clear()
            if entry == "apply_gradients":
                opt.apply_gradients([(g, p)])
            else:
                opt.minimize(lambda: (p * c).sum())
            name = type(opt).__name__
            assert calls == [f"global-pre:{name}", "wrapper-pre", "inner-pre", "inner-post", "wrapper-post",
                             f"global-post:{name}"]
            q.grad = 0.5 * c
            ref.step()
    assert torch.equal(g, c) and p.grad is None
    torch.testing.assert_close(p.detach(), q.detach())


def test_apply_gradients_counts_as_a_step_for_an_lr_scheduler_on_the_wrapper():
    """As ``apply_gradients`` of an optkit optimizer goes through its ``step()``, a wrapper's records the
    call for a torch LR scheduler built on the wrapper: no "lr_scheduler.step() before optimizer.step()"
    warning."""
    for make in (lambda p: SGD([p], 0.1), lambda p: LARC(SGD([p], 0.1), 0.01)):
        p = torch.tensor([3.0, 4.0], requires_grad=True)
        opt = make(p)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.apply_gradients([(torch.tensor([0.3, -0.4]), p)])
            sched.step()
        assert not [w for w in caught if "lr_scheduler" in str(w.message)], type(opt).__name__
