"""MixedPrecisionOptimizerWrapper: fp32 masters for fp16/bf16 models (spec/openseq2seq.md §5, §8.2),
saturating copy-back, skip semantics, the fp16 underflow training run, the model converter, checkpoints."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from optkit import LARC, LossScaleOptimizer, MixedPrecisionOptimizerWrapper, convert_model_to_half
from optkit.loss_scale import DynamicLossScale
from optkit.sgd import SGD
from scaled_grads import scaled_step

MP = MixedPrecisionOptimizerWrapper
HALF = [torch.float16, torch.bfloat16]


def _half_params(rng, dtype, shapes=((4, 3), (5,))):
    return [torch.tensor(rng.normal(size=s), dtype=torch.float32).to(dtype).requires_grad_() for s in shapes]


@pytest.mark.parametrize("dtype", HALF)
def test_masters_state_and_update_against_float64(rng, dtype):
    ps = _half_params(rng, dtype)
    b = torch.tensor(rng.normal(size=3), dtype=torch.float32, requires_grad=True)  # an fp32 param
    opt = MP(torch.optim.SGD(ps + [b], lr=0.1, momentum=0.9), DynamicLossScale(64.0))
    assert len(opt.master_params) == 2 and all(m.dtype == torch.float32 for m in opt.master_params)
    group = opt.param_groups[0]["params"]
    assert group[2] is b and all(m is q for m, q in zip(opt.master_params, group[:2]))
    ref_w = [p.detach().double().numpy() for p in ps] + [b.detach().double().numpy()]
    ref_m = [np.zeros_like(w) for w in ref_w]
    bufs = None
    for _ in range(3):
        gs = [rng.normal(size=w.shape) for w in ref_w]
        for p, g in zip(ps, gs):
            p.grad = (torch.tensor(g, dtype=torch.float32) * 64.0).to(dtype)
        b.grad = torch.tensor(gs[2], dtype=torch.float32) * 64.0
        scaled_step(opt)
        for i, g in enumerate(gs):
            half_g = (torch.tensor(g, dtype=torch.float32) * 64).to(dtype)
            g_seen = g if i == 2 else half_g.double().numpy() / 64
            ref_m[i] = 0.9 * ref_m[i] + g_seen
            ref_w[i] = ref_w[i] - 0.1 * ref_m[i]
        for m, rw in zip(opt.master_params + [b], ref_w):
            np.testing.assert_allclose(m.detach().numpy(), rw, rtol=2e-6, atol=1e-7)
        for p, m in zip(ps, opt.master_params):
            assert p.dtype == dtype and torch.equal(p.detach(), m.detach().to(dtype))
        now = [m.grad.data_ptr() for m in opt.master_params]
        assert bufs is None or now == bufs  # one reused fp32 gradient buffer per master
        bufs = now
        opt.zero_grad()
    assert all(v["momentum_buffer"].dtype == torch.float32 for v in opt.state.values())


@pytest.mark.parametrize("dtype", HALF)
def test_saturating_copy_back(dtype):
    big = float(torch.finfo(dtype).max)
    p = torch.tensor([big, -big, 1.0], dtype=dtype, requires_grad=True)
    opt = MP(torch.optim.SGD([p], lr=1.0))
    delta = big / 2 if dtype == torch.float16 else 1e36  # bf16's max is close to fp32's
    p.grad = torch.tensor([-delta, delta, 0.0], dtype=dtype)
    scaled_step(opt)
    assert torch.equal(p.detach(), torch.tensor([big, -big, 1.0], dtype=dtype))
    m = opt.master_params[0]
    assert big < m[0].item() < float(torch.finfo(torch.float32).max) and torch.isfinite(p).all()
    assert torch.isinf(m.detach().to(dtype)[0])  # a plain cast would have given inf


@pytest.mark.parametrize("dtype", HALF)
def test_skip_leaves_masters_model_and_state_bit_identical(rng, dtype):
    ps = _half_params(rng, dtype)
    opt = MP(SGD(ps, 0.1, momentum=0.9, use_ema=True), "dynamic")
    for p in ps:
        p.grad = torch.ones_like(p)
    scaled_step(opt)
    snap = [(p.detach().clone(), m.detach().clone(), {k: v.clone() for k, v in opt.state[m].items()})
            for p, m in zip(ps, opt.master_params)]
    it = int(opt.iterations)
    scale = float(opt.loss_scale)
    ps[0].grad = torch.full_like(ps[0], float("inf"))
    scaled_step(opt)
    assert not bool(opt.step_applied) and int(opt.iterations) == it
    assert float(opt.loss_scale) == scale / 2
    for (p0, m0, st0), p, m in zip(snap, ps, opt.master_params):
        assert torch.equal(p.detach(), p0) and torch.equal(m.detach(), m0)
        for k, v in opt.state[m].items():
            assert torch.equal(v, st0[k]), k


def _regression(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 4, generator=g)
    w_true = torch.tensor([0.5, -1.0, 2.0, 0.25])
    return x.to(dtype), (x @ w_true).to(dtype)


@pytest.mark.parametrize("loss_scale,converges", [(None, False), ("dynamic", True)])
def test_fp16_training_underflows_without_scaling(loss_scale, converges):
    """The loss carries a factor 1e-9, so fp16 gradients (~1e-11) underflow to 0 without loss scaling."""
    x, y = _regression(torch.float16)
    w = torch.zeros(4, dtype=torch.float16, requires_grad=True)
    opt = MP.wrap(torch.optim.Adam, [w], loss_scale, lr=0.05, fused=True)

    def closure():
        opt.zero_grad()
        return ((x @ w - y).float() ** 2).mean() * 1e-9

    first = float(closure().detach())
    for _ in range(300):
        last = float(opt.step(closure).detach())
    if converges:
        assert last < 0.05 * first
    else:
        assert last == first and torch.equal(w.detach(), torch.zeros(4, dtype=torch.float16))


def test_regularization_vectors_8_2():
    """mp_wrapper_test: the L2 gradient λ·w = 1e-8 underflows in fp16 but survives on the fp32 master."""
    x = torch.full((3, 2), 0.5)
    w32 = torch.full((2, 1), 1e-4, requires_grad=True)
    reg32 = 1e-4 * (w32 ** 2).sum() / 2
    assert reg32.item() == pytest.approx(1e-12, rel=1e-5)
    (g32,) = torch.autograd.grad(reg32, [w32])
    np.testing.assert_allclose(g32.numpy(), 1e-8, rtol=1e-5)
    w16 = torch.full((2, 1), 1e-4, dtype=torch.float16, requires_grad=True)
    reg16 = 1e-4 * (w16 ** 2).sum() / 2
    (g16,) = torch.autograd.grad(reg16, [w16])
    assert reg16.item() == 0.0 and torch.equal(g16, torch.zeros_like(g16))
    opt = MP(torch.optim.SGD([w16], lr=0.1), l2_regularization=1e-4)
    y = torch.full((3, 1), 1e-4, dtype=torch.float16)
    (g, v), = opt.compute_gradients(lambda: ((x.half() @ w16 - y).float() ** 2).mean())
    assert v is opt.master_params[0] and v.dtype == torch.float32
    assert float(v[0]) == pytest.approx(1.0001659e-4, rel=1e-7)
    np.testing.assert_allclose(g.numpy(), 1e-8, atol=1e-11)
    opt.apply_gradients([(g, v)])
    np.testing.assert_allclose(v.detach().numpy(), 1.0001659e-4 - 0.1 * g.numpy(), rtol=1e-7)


@pytest.mark.parametrize("dtype", HALF)
def test_wrap_equals_rebuild_and_named_params(dtype):
    torch.manual_seed(0)
    m1 = convert_model_to_half(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1)), dtype)
    m2 = convert_model_to_half(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1)), dtype)
    m2.load_state_dict(m1.state_dict())
    o1 = MP(SGD(m1.named_parameters(), 0.1, momentum=0.9), "dynamic")
    o2 = MP.wrap(SGD, m2.named_parameters(), "dynamic", learning_rate=0.1, momentum=0.9)
    assert o2.param_groups[0]["param_names"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    x = torch.randn(8, 3).to(dtype)
    for _ in range(3):
        for model, opt in ((m1, o1), (m2, o2)):
            opt.step(lambda model=model: model(x).float().pow(2).mean())
            opt.zero_grad()
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_larc_inside_sees_fp32_masters(rng):
    p = torch.tensor([[3.0, 4.0]], dtype=torch.float16, requires_grad=True)
    opt = MP(LARC(torch.optim.SGD([p], lr=0.1), 0.002), 8.0)
    p.grad = torch.tensor([[0.3, 0.4]], dtype=torch.float16) * 8
    scaled_step(opt)
    m = opt.master_params[0]
    g = torch.tensor([[0.3, 0.4]], dtype=torch.float16).double().numpy()
    r = min(max(0.002 * 5.0 / (0.1 * (np.linalg.norm(g) + 1e-7)), 1e-7), 1.0)
    np.testing.assert_allclose(m.detach().numpy(), np.array([[3.0, 4.0]]) - 0.1 * r * g, rtol=1e-6)


def test_state_dict_round_trip(rng):
    def make():
        torch.manual_seed(1)
        model = convert_model_to_half(torch.nn.Linear(3, 2))
        return model, MP(SGD(model.parameters(), 0.05, momentum=0.9), DynamicLossScale(128.0, 2))

    x = torch.randn(4, 3).half()

    def run(model, opt, n):
        for _ in range(n):
            opt.step(lambda: model(x).float().pow(2).sum())
            opt.zero_grad()

    ma, oa = make()
    run(ma, oa, 5)
    mb, ob = make()
    run(mb, ob, 2)
    sd = ob.state_dict()
    mc, oc = make()
    oc.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(mb.parameters(), mc.parameters()))
    run(mc, oc, 3)
    assert all(torch.equal(a, b) for a, b in zip(ma.parameters(), mc.parameters()))
    assert float(oa.loss_scale) == float(oc.loss_scale)
    bad = {"optimizer": sd["optimizer"], "wrapper": dict(sd["wrapper"], masters=sd["wrapper"]["masters"][:1])}
    before = [m.clone() for m in oc.master_params]
    with pytest.raises(ValueError, match="masters"):
        oc.load_state_dict(bad)
    assert all(torch.equal(a, b) for a, b in zip(before, oc.master_params))


def test_validation_and_outermost():
    p = torch.zeros(2, dtype=torch.float16, requires_grad=True)
    with pytest.raises(ValueError):
        MP(torch.optim.SGD([p], lr=0.1), "sometimes")
    with pytest.raises(ValueError, match="l2_regularization"):
        MP(torch.optim.SGD([p], lr=0.1), l2_regularization=-1.0)
    assert p.dtype == torch.float16  # nothing was swapped by the failed constructions
    mp = MP(torch.optim.SGD([p], lr=0.1))
    with pytest.raises(TypeError, match="outermost"):
        LossScaleOptimizer(mp)
    with pytest.raises(ValueError, match="dtype"):
        convert_model_to_half(torch.nn.Linear(2, 2), torch.float32)


def test_convert_model_keeps_norms_fp32():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.LayerNorm(4),
                                torch.nn.Linear(4, 2))
    convert_model_to_half(model, torch.bfloat16)
    assert model[0].weight.dtype == torch.bfloat16 and model[3].bias.dtype == torch.bfloat16
    assert model[1].weight.dtype == torch.float32 and model[1].running_mean.dtype == torch.float32
    assert model[2].weight.dtype == torch.float32
    out = model(torch.randn(5, 3).to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    plain = convert_model_to_half(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2)),
                                  keep_norm_fp32=False)
    assert plain[1].weight.dtype == torch.float16


def test_add_param_group_creates_masters(rng):
    a = torch.tensor(rng.normal(size=(2, 2)), dtype=torch.float16, requires_grad=True)
    b = torch.tensor(rng.normal(size=3), dtype=torch.bfloat16, requires_grad=True)
    opt = MP(SGD([a], 0.1), "dynamic")
    opt.add_param_group({"params": [b], "lr": 0.5})
    assert len(opt.master_params) == 2 and opt.param_groups[1]["params"][0] is opt.master_of(b)
    assert opt.master_of(b).dtype == torch.float32
    b0 = b.detach().float().numpy()
    a.grad = torch.ones_like(a) * float(opt.loss_scale)
    b.grad = (torch.ones(3) * float(opt.loss_scale)).to(torch.bfloat16)
    scaled_step(opt)
    np.testing.assert_allclose(opt.master_of(b).detach().numpy(), b0 - 0.5, rtol=1e-6)
    with pytest.raises(ValueError, match="master_of"):
        opt.master_of(torch.zeros(1))


def _flat_state(opt):
    """Every tensor and value of ``opt.state_dict()``, flattened to (path, value) pairs (tensors cloned)."""
    out = []

    def walk(path, v):
        if isinstance(v, dict):
            for k in v:
                walk(f"{path}/{k}", v[k])
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(f"{path}/{i}", x)
        else:
            out.append((path, v.detach().clone() if isinstance(v, torch.Tensor) else v))

    walk("", opt.state_dict())
    return out


def _same(a, b):
    def eq(x, y):
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        return x == y

    return len(a) == len(b) and all(pa == pb and eq(va, vb) for (pa, va), (pb, vb) in zip(a, b))


def test_bad_masters_rejected_before_anything_loads():
    """A meta, integer, complex or sparse master raises naming it; inner state, masters, model unchanged."""
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)

    def make(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
        model = model.to(torch.bfloat16)
        return model, MP(SGD(model.parameters(), 0.05, momentum=0.9), DynamicLossScale(64.0, 3))

    def run(model, opt, n):
        for _ in range(n):
            opt.step(lambda: model(x).float().pow(2).sum())
            opt.zero_grad()

    src_model, src = make(0)
    run(src_model, src, 4)
    good = src.state_dict()
    model, opt = make(1)
    run(model, opt, 1)
    before, params_before = _flat_state(opt), [p.detach().clone() for p in model.parameters()]
    last = len(good["wrapper"]["masters"]) - 1
    for idx, bad_master, exc in [
        (last, lambda t: t.to("meta"), ValueError),
        (0, lambda t: t.to(torch.int64), TypeError),
        (1, lambda t: t.to(torch.complex64), TypeError),
        (last, lambda t: t.to_sparse(), ValueError),
        (0, lambda t: "x", TypeError),
    ]:
        masters = list(good["wrapper"]["masters"])
        masters[idx] = bad_master(masters[idx])
        bad = {"optimizer": good["optimizer"], "wrapper": dict(good["wrapper"], masters=masters)}
        with pytest.raises(exc, match=rf"'masters'\[{idx}\]"):
            opt.load_state_dict(bad)
        assert _same(_flat_state(opt), before)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), params_before))
    opt.load_state_dict(good)  # still loads, then continues exactly like the source
    run(model, opt, 2)
    run(src_model, src, 2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), src_model.parameters()))


def _snapshot(opt, model_params):
    return [p.detach().clone() for p in model_params], _flat_state(opt)


def _unchanged(opt, model_params, snap):
    params0, state0 = snap
    return all(torch.equal(p.detach(), q) for p, q in zip(model_params, params0)) and _same(
        _flat_state(opt), state0)


@pytest.mark.parametrize("dtype", HALF)
def test_unscaled_backward_raises_on_the_first_step(rng, dtype):
    """Under a dynamic scale a plain ``loss.backward()`` (no ``scale_loss``) raises ``RuntimeError`` on the
    FIRST step too (as LossScaleOptimizer): the check reads the model's gradients, not the fp32 masters',
    which have none before the first step. The first step used to divide the gradients by S silently.
    Nothing changes on the refused step; the same loss through ``scale_loss`` then matches a float64 SGD
    reference."""
    S, lr = 1024.0, 0.1
    w = torch.tensor(rng.normal(size=(4, 3)), dtype=torch.float32).to(dtype).requires_grad_()
    b = torch.tensor(rng.normal(size=3), dtype=torch.float32, requires_grad=True)  # an fp32 parameter
    c = rng.uniform(0.5, 2.0, size=(4, 3))
    ct = torch.tensor(c, dtype=torch.float32)

    def half_part():
        return 0.5 * (ct * w.float() ** 2).sum()

    def fp32_part():
        return 0.5 * (b ** 2).sum()

    def loss():  # ½Σ c·w² + ½Σ b²: gradients c·w and b
        return half_part() + fp32_part()

    # gradients on the half parameter only (the case that slipped through), the fp32 one only, both
    for part in (half_part, fp32_part, loss):
        opt = MP(torch.optim.SGD([w, b], lr=lr), DynamicLossScale(S))
        snap = _snapshot(opt, [w, b])
        part().backward()
        with pytest.raises(RuntimeError, match="scale_loss"):
            opt.step()
        assert _unchanged(opt, [w, b], snap) and float(opt.loss_scale) == S
        opt.zero_grad()

    # the same refusal when the unscaled gradients were folded by accumulate_grads() before the step
    opt.zero_grad()
    half_part().backward()
    opt.accumulate_grads()
    assert w.grad is None
    with pytest.raises(RuntimeError, match="scale_loss"):
        opt.step()
    opt.zero_grad()

    w64, b64 = w.detach().double().numpy(), b.detach().double().numpy()
    opt.scale_loss(loss()).backward()
    opt.step()
    assert bool(opt.step_applied)
    np.testing.assert_allclose(opt.master_of(w).detach().numpy(), w64 - lr * c * w64, rtol=2e-3, atol=1e-6)
    np.testing.assert_allclose(b.detach().numpy(), b64 - lr * b64, rtol=1e-6)
    assert torch.equal(w.detach(), opt.master_of(w).detach().to(dtype))


def test_restored_accumulation_steps_without_a_new_backward(rng):
    """``accumulate_grads(grads=...)`` (an open window restored from a checkpoint, carrying the scale) is not
    taken for an unscaled backward: ``step()`` divides it by S (float64 reference); an unscaled backward
    after the restore still raises."""
    S, lr = 256.0, 0.5
    w = torch.tensor(rng.normal(size=5), dtype=torch.float16, requires_grad=True)
    g = rng.normal(size=5)
    saved = torch.tensor(g * S, dtype=torch.float32)  # a window's fp32 sum of scaled gradients
    w64 = w.detach().double().numpy()

    opt = MP(torch.optim.SGD([w], lr=lr), DynamicLossScale(S))
    opt.accumulate_grads([saved])
    (w.float() * torch.tensor(g, dtype=torch.float32)).sum().backward()  # an unscaled micro-batch
    with pytest.raises(RuntimeError, match="scale_loss"):
        opt.step()
    w.grad = None  # drop it; the restored sum is still pending

    opt.step()
    assert bool(opt.step_applied)
    np.testing.assert_allclose(opt.master_of(w).detach().numpy(), w64 - lr * g, rtol=1e-6, atol=1e-7)


def test_add_param_group_rejects_a_half_parameter_already_managed(rng):
    """A half parameter that already has a master (or appears twice in the new group) raises ValueError like
    torch's "more than one parameter group"; the wrapper, inner optimizer and state are untouched, and the
    parameter keeps one master (it used to get a second one and the two diverged)."""
    lr = 0.1
    a = torch.tensor(rng.normal(size=(2, 3)), dtype=torch.float16, requires_grad=True)
    c = torch.tensor(rng.normal(size=4), dtype=torch.bfloat16, requires_grad=True)
    f = torch.tensor(rng.normal(size=2), dtype=torch.float32, requires_grad=True)
    opt = MP(torch.optim.SGD([a], lr=lr, momentum=0.9), DynamicLossScale(8.0))
    a.grad = torch.tensor(rng.normal(size=(2, 3)) * 8.0, dtype=torch.float16)
    scaled_step(opt)  # momentum state exists
    opt.zero_grad()
    masters = list(opt.master_params)
    inner_groups = opt.optimizer.param_groups
    n_groups, snap = len(inner_groups), _snapshot(opt, [a, c, f])

    for group, msg in [({"params": [a], "lr": 1.0}, "more than one parameter group"),
                       ({"params": [f, c, a]}, "more than one parameter group"),
                       ({"params": a}, "more than one parameter group"),
                       ({"params": [c, f, c]}, "twice")]:
        with pytest.raises(ValueError, match=msg):
            opt.add_param_group(group)
        assert len(opt.param_groups) == n_groups and opt.optimizer.param_groups is inner_groups
        assert len(opt.master_params) == 1 and opt.master_params[0] is masters[0] and opt.model_params[0] is a
        assert _unchanged(opt, [a, c, f], snap)
    with pytest.raises(ValueError, match="master_of"):
        opt.master_of(c)

    # still one master per half parameter: two more steps against a float64 momentum reference
    m64 = opt.master_of(a).detach().double().numpy()
    buf = opt.state[opt.master_of(a)]["momentum_buffer"].double().numpy()
    opt.add_param_group({"params": [c], "lr": lr})  # a new half parameter is still welcome
    for _ in range(2):
        ga = rng.normal(size=(2, 3))
        a.grad = torch.tensor(ga * 8.0, dtype=torch.float16)
        seen = a.grad.double().numpy() / 8.0
        scaled_step(opt)
        opt.zero_grad()
        buf = 0.9 * buf + seen
        m64 = m64 - lr * buf
        np.testing.assert_allclose(opt.master_of(a).detach().numpy(), m64, rtol=1e-6, atol=1e-7)
        assert torch.equal(a.detach(), opt.master_of(a).detach().half())
    assert len(opt.master_params) == 2


def test_a_half_parameter_twice_in_the_wrapped_optimizer_is_refused():
    """torch only warns about ``SGD([a, a])``; the wrapper would give ``a`` two fp32 masters that drift apart.
    It raises ValueError before any master replaces a parameter in the inner optimizer."""
    a = torch.ones(3, dtype=torch.float16, requires_grad=True)
    b = torch.ones(2, dtype=torch.bfloat16, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's duplicate-parameter warning
        inner = torch.optim.SGD([{"params": [b]}, {"params": [a, a]}], lr=0.1)
    with pytest.raises(ValueError, match="twice"):
        MP(inner)
    assert inner.param_groups[0]["params"][0] is b and inner.param_groups[1]["params"] == [a, a]



def test_an_unscaled_micro_batch_in_a_window_is_refused_even_after_a_scaled_one():
    """A plain backward folded with accumulate_grads, then a micro-batch through scale_loss: the first one's
    gradient would be divided by the scale. The step raises, whatever the later micro-batches did."""
    w = torch.ones(3, dtype=torch.float16, requires_grad=True)
    opt = MP(torch.optim.SGD([w], lr=0.1), DynamicLossScale(128.0))
    (w.float() ** 2).sum().backward()
    opt.accumulate_grads()
    opt.scale_loss((w.float() ** 2).sum()).backward()
    with pytest.raises(RuntimeError, match="scale_loss"):
        opt.step()
    assert torch.equal(w.detach(), torch.ones(3, dtype=torch.float16))



def test_each_micro_batch_of_a_window_must_be_scaled_and_scaled_windows_pass():
    """Each fold clears ``grads_scaled``: a scaled micro-batch then a plain backward raises (the second
    gradient would be divided by the scale). Legitimate patterns pass: a window of scaled micro-batches over
    half and fp32 parameters (the fp32 ones keep their gradients through the window), and the scaled loss
    computed before ``zero_grad`` (torch's loop order), on both loss-scale wrappers."""
    w = torch.ones(3, dtype=torch.float16, requires_grad=True)
    f = torch.ones(2, dtype=torch.float32, requires_grad=True)
    opt = MP(torch.optim.SGD([w, f], lr=0.1), DynamicLossScale(128.0))
    opt.scale_loss((w.float() ** 2).sum()).backward()
    opt.accumulate_grads()
    (w.float() ** 2).sum().backward()
    opt.accumulate_grads()
    with pytest.raises(RuntimeError, match="scale_loss"):
        opt.step()
    assert torch.equal(w.detach(), torch.ones(3, dtype=torch.float16))
    opt.zero_grad()
    for _ in range(2):  # two scaled micro-batches over both parameters: Σ gradients = 2·2w, 2·2f
        opt.scale_loss((w.float() ** 2).sum() + (f ** 2).sum()).backward()
        opt.accumulate_grads()
    opt.step()
    torch.testing.assert_close(f.detach(), torch.full((2,), 1.0 - 0.1 * 4.0))
    torch.testing.assert_close(w.detach().float(), torch.full((3,), 1.0 - 0.1 * 4.0), rtol=1e-3, atol=1e-3)
    for wrapper in (MP(torch.optim.SGD([w], lr=0.1), 128.0),
                    LossScaleOptimizer(torch.optim.SGD([f], lr=0.1), 128.0)):
        x = w if isinstance(wrapper, MP) else f
        before = x.detach().float().clone()
        loss = wrapper.scale_loss((x.float() ** 2).sum())
        wrapper.zero_grad()
        loss.backward()
        wrapper.step()
        torch.testing.assert_close(x.detach().float(), before * 0.8, rtol=1e-3, atol=1e-3)



def test_fp32_gradients_count_as_scaled_after_a_scaled_fold():
    """fp32 parameters keep their gradients through a window. A window that reaches only fp32 parameters
    (a frozen half backbone) and scales every micro-batch steps, also when the gradients are clipped or
    averaged in place between the last fold and the step (a hand-written data-parallel loop); an unscaled
    fold raises, with step() and with step(closure)."""
    h = torch.ones(3, dtype=torch.float16, requires_grad=False)  # frozen
    f = torch.ones(2, dtype=torch.float32, requires_grad=True)
    opt = MP(torch.optim.SGD([h, f], lr=0.1), DynamicLossScale(1024.0))
    for _ in range(2):
        opt.scale_loss((f ** 2).sum()).backward()
        opt.accumulate_grads()
    f.grad.div_(1.0)  # e.g. an all-reduce average over one process
    torch.nn.utils.clip_grad_norm_([f], 1e9)
    opt.step()
    torch.testing.assert_close(f.detach(), torch.full((2,), 1.0 - 0.1 * 4.0))
    opt.zero_grad()
    (f * 1.0).sum().backward()  # plain, folded: refused
    opt.accumulate_grads()
    with pytest.raises(RuntimeError, match="scale_loss"):
        opt.step()
    w = torch.ones(3, dtype=torch.float16, requires_grad=True)
    opt2 = MP(torch.optim.SGD([w], lr=0.1), DynamicLossScale(1024.0))
    (w.float() ** 2).sum().backward()  # plain, folded
    opt2.accumulate_grads()
    with pytest.raises(RuntimeError, match="accumulate_grads"):
        opt2.step(lambda: (w.float() ** 2).sum())


def test_a_wrapper_pickled_before_the_window_flags_existed_still_steps():
    """Objects unpickled from an earlier optkit lack the window flags in their ``__dict__``: the class
    defaults stand in (it raised AttributeError)."""
    import pickle

    f = torch.ones(2, dtype=torch.float32, requires_grad=True)
    opt = MP(torch.optim.SGD([f], lr=0.1))
    state = pickle.loads(pickle.dumps(opt))
    for key in ("_unscaled_fold", "_scaled_fold"):
        state.__dict__.pop(key, None)
    g = state.optimizer.param_groups[0]["params"][0]
    (g * 2.0).sum().backward()
    state.accumulate_grads()
    state.step()
    torch.testing.assert_close(g.detach(), torch.full((2,), 0.8))


@pytest.mark.parametrize("inner", ["optkit", "torch"])
def test_a_refused_inner_step_keeps_the_window_for_a_retry(inner):
    """A window folded with ``accumulate_grads`` (two bf16 micro-batches, an fp32 LayerNorm weight beside,
    L2 on the masters), then an inner step that raises once: the fp32 sum stayed marked as folded no more,
    so the retry applied nothing to the half parameters (and, around a torch optimizer, divided the fp32
    gradient by S once more). Now the retry equals a twin that never failed, bit for bit."""
    def run(fail):
        torch.manual_seed(0)
        lin, norm = torch.nn.Linear(4, 3).to(torch.bfloat16), torch.nn.LayerNorm(3)
        params = [*lin.parameters(), *norm.parameters()]
        if inner == "optkit":
            opt = MP.wrap(SGD, params, 1024.0, l2_regularization=0.01, learning_rate=0.1, momentum=0.9)
        else:
            opt = MP.wrap(torch.optim.SGD, params, 1024.0, l2_regularization=0.01, lr=0.1, momentum=0.9)
        for k in range(2):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(k))
            opt.scale_loss(norm(lin(x.to(torch.bfloat16)).float()).pow(2).mean()).backward()
            opt.accumulate_grads()
        if fail:
            armed = [True]

            def pre(o, a, kw):
                if armed[0]:
                    armed[0] = False
                    raise RuntimeError("inner step refused")

            opt.optimizer.register_step_pre_hook(pre)
            with pytest.raises(RuntimeError, match="refused"):
                opt.step()
        opt.step()
        return [p.detach().clone() for p in params] + [m.detach().clone() for _, m in opt._pairs]

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


def _ftrl_float64(w, gs, lr, n0, l1, l2):
    """FTRL-proximal in float64 NumPy (McMahan et al. 2013, Algorithm 1; TF's ``ApplyFtrlV2`` with
    ``learning_rate_power = -0.5``), from ``n = n0``, ``z = 0``."""
    n, z = np.full_like(w, n0), np.zeros_like(w)
    for g in gs:
        n_new = n + g * g
        z = z + g - (np.sqrt(n_new) - np.sqrt(n)) / lr * w
        w = np.where(np.abs(z) > l1, (np.sign(z) * l1 - z) / (np.sqrt(n_new) / lr + 2 * l2), 0.0)
        n = n_new
    return w


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", ["Adagrad", "Ftrl"])
def test_accumulators_built_on_half_parameters_start_in_fp32_under_the_wrapper(rng, name, dtype):
    """An optimizer built on the half parameters and then wrapped starts its accumulators (Adagrad's and
    Ftrl's ``initial_accumulator_value`` 0.1) on the fp32 masters in fp32, as construction on fp32
    parameters would: the masters equal, bit for bit, the same optimizer on fp32 copies fed the same
    gradients (``test_ftrl_masters_follow_a_float64_reference``: float64 NumPy). Before, the fill was
    fp16(0.1) = 0.0999755859375 (bf16: 0.10009765625) cast up, 5e-5 relative off for Ftrl. State written
    before the wrapping (a step, a loaded state dict) is not rebuilt, only cast."""
    from optkit import Adagrad, Ftrl

    make = {"Adagrad": lambda ps: Adagrad(ps, learning_rate=0.1),
            "Ftrl": lambda ps: Ftrl(ps, learning_rate=0.1, l1_regularization_strength=0.01,
                                    l2_regularization_strength=0.02)}[name]
    slot = {"Adagrad": "sum", "Ftrl": "accum"}[name]
    ps = _half_params(rng, dtype)
    refs = [p.detach().float().clone().requires_grad_() for p in ps]
    opt = MP(make(ps))
    ref = make(refs)
    fill = float(ref.state[refs[0]][slot].flatten()[0])
    assert fill == np.float32(0.1)
    assert all(torch.equal(opt.state[m][slot], ref.state[r][slot]) for m, r in zip(opt.master_params, refs))
    gs = [[rng.normal(size=p.shape) for p in ps] for _ in range(3)]
    for step in gs:
        for p, r, g in zip(ps, refs, step):
            p.grad = torch.tensor(g, dtype=torch.float32).to(dtype)
            r.grad = p.grad.float()
        opt.step()
        ref.step()
    for m, r in zip(opt.master_params, refs):
        assert torch.equal(m, r.detach())
        assert torch.equal(opt.state[m][slot], ref.state[r][slot])

    # state an earlier step wrote is kept: wrapping a stepped optimizer casts it (no refill)
    ps2 = _half_params(rng, dtype)
    inner = make(ps2)
    for p in ps2:
        p.grad = torch.tensor(rng.normal(size=p.shape), dtype=torch.float32).to(dtype)
    inner.step()
    stepped = inner.state[ps2[0]][slot].float()
    wrapped = MP(inner)
    assert torch.equal(wrapped.state[wrapped.master_params[0]][slot], stepped)
    # a loaded state (at iteration 0, written by hand to other values) is kept as well
    ps3 = _half_params(rng, dtype)
    src = make([p.detach().clone() for p in ps3])
    sd = src.state_dict()
    for entry in sd["state"].values():
        entry[slot] = torch.full_like(entry[slot], 0.375)
    inner = make(ps3)
    inner.load_state_dict(sd)
    wrapped = MP(inner)
    assert all(bool((wrapped.state[m][slot] == 0.375).all()) for m in wrapped.master_params)


@pytest.mark.parametrize("dtype", HALF)
def test_ftrl_masters_follow_a_float64_reference(rng, dtype):
    """Ftrl built on half parameters and wrapped: the masters follow FTRL-proximal in float64 NumPy (from the
    half weights, fed the half gradients) to float32 rounding over 3 steps; the half-rounded start of the
    accumulator (5e-5 relative) is gone."""
    from optkit import Ftrl

    lr, l1, l2 = 0.1, 0.01, 0.02
    ps = _half_params(rng, dtype)
    w64 = [p.detach().double().numpy() for p in ps]
    opt = MP(Ftrl(ps, learning_rate=lr, l1_regularization_strength=l1, l2_regularization_strength=l2))
    gs = []
    for _ in range(3):
        step = [torch.tensor(rng.normal(size=p.shape), dtype=torch.float32).to(dtype) for p in ps]
        gs.append([g.double().numpy() for g in step])
        for p, g in zip(ps, step):
            p.grad = g
        opt.step()
    for j, m in enumerate(opt.master_params):
        expected = _ftrl_float64(w64[j], [step[j] for step in gs], lr, 0.1, l1, l2)
        np.testing.assert_allclose(m.detach().double().numpy(), expected, rtol=2e-6, atol=1e-7)
