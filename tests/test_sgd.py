"""``optkit.SGD`` (Keras 3 form) against the spec vectors, a float64 NumPy reference of the whole Keras
pipeline, and ``torch.optim.SGD`` where the two coincide.

Spec: ``shared/spec/tf_keras.md`` §4.1 (pipeline: clip → decoupled decay → update → EMA → overwrite), §4.3
(vectors K1-K16, checked there against Keras 3.15.1) and §5.1 (SGD rule, vectors S1-S4).
"""

from __future__ import annotations

import copy
import itertools
import math
import shutil
import warnings
import zlib

import numpy as np
import pytest
import torch

import optkit
from optkit import SGD, PolicySchedule

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")

T = torch.tensor


def leaf(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype, requires_grad=True)


def run_steps(opt, params, grads_per_step):
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = None if g is None else torch.as_tensor(g, dtype=p.dtype).clone()
        opt.step()


def close(t, expected, tol=1e-6):
    np.testing.assert_allclose(
        t.detach().to(torch.float64).numpy(), np.asarray(expected, dtype=np.float64), rtol=tol, atol=tol
    )


# ------------------------------------------------------------------------------------------------------------
# float64 NumPy reference of the Keras 3 pipeline with the SGD rule (tf_keras.md §4.1, §5.1)


def keras_sgd_reference(
    ws,
    grads_seq,
    lrs,
    *,
    momentum=0.0,
    nesterov=False,
    weight_decay=None,
    clip=None,
    ema=None,
    decay_mask=None,
):
    """ws: list of float64 arrays; grads_seq: per step, a list (None = no gradient); lrs: lr per step.

    clip: None | ("clipnorm"|"clipvalue"|"global_clipnorm", value); ema: None | (ema_momentum, freq).
    """
    ws = [w.copy() for w in ws]
    vs = [np.zeros_like(w) for w in ws]
    avgs = [np.zeros_like(w) for w in ws]
    it = 0
    for grads, lr in zip(grads_seq, lrs):
        idx = [i for i, g in enumerate(grads) if g is not None]
        gs = {i: grads[i].astype(np.float64).copy() for i in idx}
        if clip is not None:
            kind, c = clip
            if kind == "clipvalue":
                gs = {i: np.clip(g, -c, c) for i, g in gs.items()}
            elif kind == "clipnorm":
                gs = {i: g * c / max(np.sqrt(np.sum(g * g)), c) for i, g in gs.items()}
            else:
                n = np.sqrt(sum(np.sum(g * g) for g in gs.values()))
                s = c / max(n, c) if np.isfinite(n) else np.nan
                gs = {i: g * s for i, g in gs.items()}
        for i in idx:
            if weight_decay and (decay_mask is None or decay_mask[i]):
                ws[i] = ws[i] - ws[i] * weight_decay * lr
            g = gs[i]
            if momentum == 0.0:
                ws[i] = ws[i] - lr * g
            else:
                vs[i] = momentum * vs[i] - lr * g
                ws[i] = ws[i] + (momentum * vs[i] - lr * g if nesterov else vs[i])
        if ema is not None:
            mu, freq = ema
            m = 0.0 if it == 0 else mu
            avgs = [m * a + (1 - m) * w for a, w in zip(avgs, ws)]
            if freq and (it + 1) % freq == 0:
                ws = [a.copy() for a in avgs]
        it += 1
    return ws, vs, avgs


CLIPS = [None, ("clipnorm", 0.5), ("clipvalue", 0.3), ("global_clipnorm", 0.8)]
DECAYS = [None, 0.1]
EMAS = [None, (0.9, None), (0.5, 3)]
RULES = [(0.0, False), (0.9, False), (0.9, True)]


@pytest.mark.parametrize("clip,wd,ema,rule", list(itertools.product(CLIPS, DECAYS, EMAS, RULES)))
def test_pipeline_matches_float64_reference(clip, wd, ema, rule):
    """Every combination of clip × weight decay × EMA × (Nesterov) momentum, 5 steps, a changing learning rate
    (callable of the step), one parameter without a gradient on some steps, one excluded from decay."""
    rng = np.random.default_rng(zlib.crc32(repr((clip, wd, ema, rule)).encode()))
    shapes = [(3, 4), (5,), (2, 2, 3)]
    ws = [rng.standard_normal(s) for s in shapes]
    steps = 5
    grads_seq = [[rng.standard_normal(s) * 0.7 for s in shapes] for _ in range(steps)]
    grads_seq[1][2] = None
    grads_seq[3][0] = None
    lrs = [0.1 / (1.0 + 0.5 * k) for k in range(steps)]
    momentum, nesterov = rule
    params = [("layer.weight", leaf(ws[0])), ("layer.bias", leaf(ws[1])), ("conv.weight", leaf(ws[2]))]
    kw = {} if clip is None else {clip[0]: clip[1]}
    if ema is not None:
        kw.update(use_ema=True, ema_momentum=ema[0], ema_overwrite_frequency=ema[1])
    opt = SGD(
        params,
        learning_rate=lambda step: 0.1 / (1.0 + 0.5 * step),
        momentum=momentum,
        nesterov=nesterov,
        weight_decay=wd,
        **kw,
    )
    opt.exclude_from_weight_decay(var_names=["bias"])
    tensors = [t for _, t in params]
    run_steps(opt, tensors, grads_seq)
    ref_w, ref_v, ref_avg = keras_sgd_reference(
        ws,
        grads_seq,
        lrs,
        momentum=momentum,
        nesterov=nesterov,
        weight_decay=wd,
        clip=clip,
        ema=ema,
        decay_mask=[True, False, True],
    )
    for t, w in zip(tensors, ref_w):
        close(t, w, 2e-6)
    if momentum:
        for t, v in zip(tensors, ref_v):
            close(opt.get_slot(t, "momentum"), v, 2e-6)
    if ema is not None:
        for t, a in zip(tensors, ref_avg):
            close(opt.get_slot(t, "average"), a, 2e-6)
    assert int(opt.iterations) == steps


def test_pipeline_float64_params_tight():
    rng = np.random.default_rng(7)
    ws = [rng.standard_normal((4, 3)), rng.standard_normal(6)]
    grads_seq = [[rng.standard_normal(w.shape) for w in ws] for _ in range(4)]
    lrs = [0.05, 0.1, 0.02, 0.07]
    ts = [leaf(w, torch.float64) for w in ws]
    opt = SGD(
        ts,
        learning_rate=0.05,
        momentum=0.8,
        nesterov=True,
        weight_decay=0.2,
        global_clipnorm=1.0,
        use_ema=True,
        ema_momentum=0.7,
    )
    for grads, lr in zip(grads_seq, lrs):
        opt.learning_rate = lr
        run_steps(opt, ts, [grads])
    ref_w, _, ref_avg = keras_sgd_reference(
        ws,
        grads_seq,
        lrs,
        momentum=0.8,
        nesterov=True,
        weight_decay=0.2,
        clip=("global_clipnorm", 1.0),
        ema=(0.7, None),
    )
    for t, w, a in zip(ts, ref_w, ref_avg):
        close(t, w, 1e-12)
        close(opt.get_slot(t, "average"), a, 1e-12)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 3e-3), (torch.bfloat16, 2e-2)])
def test_half_precision_params(dtype, tol):
    rng = np.random.default_rng(3)
    ws = [rng.standard_normal((8, 5)), rng.standard_normal(7)]
    grads_seq = [[rng.standard_normal(w.shape) for w in ws] for _ in range(3)]
    ts = [leaf(w, dtype) for w in ws]
    ws16 = [t.detach().double().numpy() for t in ts]
    g16 = [[torch.tensor(g).to(dtype).double().numpy() for g in gs] for gs in grads_seq]
    opt = SGD(ts, learning_rate=0.05, momentum=0.9, weight_decay=0.1, use_ema=True)
    run_steps(opt, ts, g16)
    ref_w, _, _ = keras_sgd_reference(ws16, g16, [0.05] * 3, momentum=0.9, weight_decay=0.1, ema=(0.99, None))
    for t, w in zip(ts, ref_w):
        assert t.dtype == dtype and opt.get_slot(t, "momentum").dtype == dtype
        np.testing.assert_allclose(t.detach().double().numpy(), w, rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------------------------------
# spec vectors S1-S4 (tf_keras.md §5.1) and K-vectors that exercise the SGD pipeline (§4.3)

S_GRADS = [[0.5, 1.0], [0.5, 1.0], [-1.0, 2.0]]


@pytest.mark.parametrize(
    "momentum,nesterov,expected",
    [
        (0.0, False, [[0.95, -2.1], [0.9, -2.2]]),
        (0.9, False, [[0.95, -2.1], [0.855, -2.29], [0.8695, -2.661]]),
        (0.9, True, [[0.905, -2.19], [0.7695, -2.461], [0.88255, -2.9949]]),
    ],
)
def test_spec_s1_s2_s3(momentum, nesterov, expected):
    w = leaf([1.0, -2.0])
    opt = SGD([w], learning_rate=0.1, momentum=momentum, nesterov=nesterov)
    for g, exp in zip(S_GRADS, expected):
        run_steps(opt, [w], [[g]])
        close(w, exp)


@pytest.mark.parametrize("momentum,row0", [(0.0, [0.4, 0.4]), (0.5, [0.25, 0.25])])
def test_spec_s4_sparse(momentum, row0):
    w = leaf([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    opt = SGD([w], learning_rate=0.1, momentum=momentum)
    for _ in range(2):
        w.grad = torch.sparse_coo_tensor(T([[0, 0]]), T([[1.0, 1.0], [2.0, 2.0]]), (3, 2))
        opt.step()
    close(w, [row0, [2.0, 2.0], [3.0, 3.0]])


def test_k1_exclude_by_name_and_by_var_list():
    for how in ("names", "vars"):
        kernel, bias = leaf([1.0, -2.0]), leaf([4.0])
        opt = SGD([("dense.kernel", kernel), ("dense.bias", bias)], learning_rate=0.1, weight_decay=0.5)
        if how == "names":
            opt.exclude_from_weight_decay(var_names=["bias"])
        else:
            opt.exclude_from_weight_decay(var_list=[bias])
        run_steps(opt, [kernel, bias], [[[0.5, 1.0], [1.0]]])
        close(kernel, [0.9, -2.0])
        close(bias, [3.9])
        run_steps(opt, [kernel, bias], [[[0.5, 1.0], [1.0]]])
        close(kernel, [0.805, -2.0])
        close(bias, [3.8])


@pytest.mark.parametrize(
    "kw,grads,expected",
    [
        ({"clipnorm": 1.0}, [[3.0, 4.0], [0.5]], [[-0.6, -0.8], [-0.5]]),  # K2
        ({"global_clipnorm": 1.0}, [[3.0, 4.0], [12.0]], [[-0.2307692, -0.3076923], [-0.9230769]]),  # K3
        ({"clipvalue": 0.5}, [[3.0, -0.25], [-12.0]], [[-0.5, 0.25], [0.5]]),  # K4
    ],
)
def test_k2_k3_k4_clipping(kw, grads, expected):
    a, b = leaf([0.0, 0.0]), leaf([0.0])
    opt = SGD([a, b], learning_rate=1.0, **kw)
    run_steps(opt, [a, b], [grads])
    close(a, expected[0])
    close(b, expected[1])


def test_k5_nonfinite_global_norm_makes_everything_nan():
    a, b = leaf([0.0, 0.0]), leaf([0.0])
    opt = SGD([a, b], learning_rate=1.0, global_clipnorm=1.0)
    run_steps(opt, [a, b], [[[math.inf, 4.0], [12.0]]])
    assert torch.isnan(a).all() and torch.isnan(b).all()


@pytest.mark.parametrize("kw", [{"global_clipnorm": 1.0}, {"clipnorm": 1.0}])
def test_k6_zero_norm_no_nan(kw):
    w = leaf([1.0, 1.0])
    opt = SGD([w], learning_rate=1.0, **kw)
    run_steps(opt, [w], [[[0.0, 0.0]]])
    close(w, [1.0, 1.0])


def test_k7_clip_then_decay_then_momentum():
    w = leaf([3.0, 4.0])
    opt = SGD([w], learning_rate=0.1, weight_decay=0.1, clipnorm=1.0, momentum=0.9)
    run_steps(opt, [w], [[[30.0, 40.0]]])
    close(w, [2.91, 3.88])
    run_steps(opt, [w], [[[0.0, 0.0]]])
    close(w, [2.8269, 3.7692])


def test_k8_ema_overwrite():
    w = leaf([2.0])
    opt = SGD([w], learning_rate=1.0, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=3)
    ws, avgs = [], []
    for _ in range(4):
        run_steps(opt, [w], [[[1.0]]])
        ws.append(float(w.detach()))
        avgs.append(float(opt.get_slot(w, "average")))
    np.testing.assert_allclose(ws, [1.0, 0.0, -0.25, -1.25])
    np.testing.assert_allclose(avgs, [1.0, 0.5, -0.25, -0.75])


def test_k9_finalize_variable_values():
    w = leaf([2.0])
    opt = SGD([w], learning_rate=1.0, use_ema=True, ema_momentum=0.9)
    run_steps(opt, [w], [[[1.0]]] * 3)
    close(w, [-1.0])
    close(opt.get_slot(w, "average"), [0.71])
    opt.finalize_variable_values()
    close(w, [0.71])


def test_k13_schedule_learning_rate():
    w = leaf([1.0])
    sched = PolicySchedule(
        "exp_decay", learning_rate=0.1, decay_steps=1, decay_rate=0.5, use_staircase_decay=False
    )
    opt = SGD([w], learning_rate=sched)
    out = []
    for _ in range(3):
        run_steps(opt, [w], [[[1.0]]])
        out.append(float(w))
    np.testing.assert_allclose(out, [0.9, 0.85, 0.825], rtol=1e-6)


def test_k14_zero_argument_callable():
    w = leaf([1.0])
    opt = SGD([w], learning_rate=lambda: 0.25)
    out = []
    for _ in range(2):
        run_steps(opt, [w], [[[1.0]]])
        out.append(float(w))
    np.testing.assert_allclose(out, [0.75, 0.5])


def test_k15_ema_covers_params_without_gradient():
    a, b = leaf([1.0]), leaf([5.0])
    opt = SGD([a, b], learning_rate=1.0, use_ema=True, ema_momentum=0.5)
    with torch.no_grad():
        b.fill_(7.0)
    run_steps(opt, [a, b], [[[1.0], None]])
    close(opt.get_slot(a, "average"), [0.0])
    run_steps(opt, [a, b], [[[1.0], None]])
    close(opt.get_slot(a, "average"), [-0.5])
    close(opt.get_slot(b, "average"), [7.0])
    close(b, [7.0])


def test_k16_sparse_clipnorm_uses_deduplicated_gradient():
    """Keras clips the raw IndexedSlices values (row0 → [−0.8485, −1.1314]); optkit's dense fallback sums the
    duplicates first, giving the clip of the de-duplicated gradient [6, 8] (docs/compatibility.md)."""
    w = leaf([[0.0, 0.0]] * 3)
    opt = SGD([w], learning_rate=1.0, clipnorm=1.0)
    w.grad = torch.sparse_coo_tensor(T([[0, 0]]), T([[3.0, 4.0], [3.0, 4.0]]), (3, 2))
    opt.step()
    close(w, [[-0.6, -0.8], [0.0, 0.0], [0.0, 0.0]])


# ------------------------------------------------------------------------------------------------------------
# torch.optim.SGD where the semantics coincide, and torch LR schedulers


@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_equals_torch_sgd_constant_lr(momentum, nesterov):
    rng = np.random.default_rng(11)
    ws = [rng.standard_normal((6, 4)), rng.standard_normal(5)]
    ours = [leaf(w) for w in ws]
    theirs = [leaf(w) for w in ws]
    opt = SGD(ours, learning_rate=0.03, momentum=momentum, nesterov=nesterov)
    ref = torch.optim.SGD(theirs, lr=0.03, momentum=momentum, nesterov=nesterov)
    for _ in range(6):
        gs = [rng.standard_normal(w.shape) for w in ws]
        run_steps(opt, ours, [gs])
        run_steps(ref, theirs, [gs])
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


def test_torch_lr_scheduler_drives_group_lr():
    rng = np.random.default_rng(5)
    ws = [rng.standard_normal((3, 3))]
    t = [leaf(ws[0])]
    opt = SGD(t, learning_rate=0.2, momentum=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    grads_seq, lrs = [], []
    for _ in range(5):
        g = [rng.standard_normal((3, 3))]
        grads_seq.append(g)
        lrs.append(opt.param_groups[0]["lr"])
        run_steps(opt, t, [g])
        sched.step()
    np.testing.assert_allclose(lrs, [0.2, 0.2, 0.02, 0.02, 0.002], rtol=1e-9)
    ref_w, _, _ = keras_sgd_reference(ws, grads_seq, lrs, momentum=0.5)
    close(t[0], ref_w[0], 2e-6)


# ------------------------------------------------------------------------------------------------------------
# jit_compile


def _compile_usable() -> str | None:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        return "no C compiler for torch.compile's CPU backend"
    return None


def _train(jit, lrs, seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(4, 3, generator=g).requires_grad_(), torch.randn(5, generator=g).requires_grad_()]
    opt = SGD(
        ps,
        learning_rate=0.1,
        momentum=0.9,
        nesterov=True,
        weight_decay=0.05,
        use_ema=True,
        ema_momentum=0.8,
        global_clipnorm=2.0,
        jit_compile=jit,
    )
    for lr in lrs:
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.learning_rate = lr
        opt.step()
    return ps, opt


@pytest.mark.skipif(_compile_usable() is not None, reason=str(_compile_usable()))
def test_jit_compile_matches_eager_without_recompiling():
    """Compiled decay → update → EMA equals eager; four different learning rates compile one graph."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    lrs = [0.1, 0.05, 0.02, 0.07]
    eager, eopt = _train(False, lrs)
    torch._dynamo.reset()
    counters.clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a fallback would be a failure here
            compiled, copt = _train(True, lrs)
    except RuntimeWarning as err:  # pragma: no cover - environment without a working inductor
        pytest.skip(f"torch.compile unusable here: {err}")
    assert copt._compile_state == "ok"
    assert counters["stats"]["unique_graphs"] == 1  # changing lr (a tensor input) never recompiled
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for slot in ("average", "momentum"):
            torch.testing.assert_close(eopt.get_slot(a, slot), copt.get_slot(b, slot), rtol=1e-5, atol=1e-6)


def test_jit_compile_falls_back_with_warning(monkeypatch):
    import optkit._core.compiled as base

    def broken(*args, **kwargs):
        raise RuntimeError("simulated compiler failure")

    monkeypatch.setattr(base, "compiled_chain", lambda: broken)
    lrs = [0.1, 0.05]
    eager, _ = _train(False, lrs)
    with pytest.warns(RuntimeWarning, match="running eagerly"):
        fallback, opt = _train(True, lrs)
    assert opt._compile_state == "failed"
    for a, b in zip(eager, fallback):
        assert torch.equal(a, b)


def test_public_names():
    assert optkit.SGD is SGD
    assert optkit.Optimizer is optkit.optimizer.Optimizer


def test_one_cycle_lr_turns_momentum_on():
    """torch's OneCycleLR cycles the group's momentum, also over SGD(momentum=0): the momentum slot appears
    (zeros, as the Keras rule starts) and each step uses the scheduled lr and momentum (float64 NumPy)."""
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal(5)
    grads = [rng.standard_normal(5) for _ in range(6)]
    w = torch.tensor(w0, requires_grad=True)
    opt = SGD([w], learning_rate=0.1)
    assert "momentum" not in opt.state[w]
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=6)
    ref_w, m = w0.copy(), np.zeros(5)
    for g in grads:
        lr, mu = opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]
        m = mu * m - lr * g
        ref_w = ref_w + m
        w.grad = torch.tensor(g)
        opt.step()
        sched.step()
    assert "momentum" in opt.state[w]
    np.testing.assert_allclose(w.detach().numpy(), ref_w, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------------ .grad


@pytest.mark.parametrize("lr", [0.1, "tensor", "schedule"])
def test_nesterov_step_leaves_grad_as_torch_sgd_does(lr):
    """``torch.optim.SGD(nesterov=True)`` leaves ``.grad`` as it was after ``step()``; so does ``optkit.SGD``
    (it wrote ``−lr·g`` there), for a number, a tensor and a schedule learning rate. A second backward
    without ``zero_grad`` then accumulates onto the true gradient in both, and the runs agree (with a
    constant learning rate the Keras velocity form is torch's momentum)."""
    torch.manual_seed(0)
    x = torch.randn(16, 5)
    ref = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
    model = copy.deepcopy(ref)
    rate = {0.1: 0.1, "tensor": torch.tensor(0.1, dtype=torch.float64), "schedule": lambda step: 0.1}[lr]
    t_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, nesterov=True, foreach=False)
    o_opt = SGD(model.parameters(), rate, momentum=0.9, nesterov=True)
    for m, opt in ((ref, t_opt), (model, o_opt)):
        for _ in range(3):  # no zero_grad: each backward accumulates into .grad
            m(x.double()).square().sum().backward()
            before = [p.grad.clone() for p in m.parameters()]
            opt.step()
            assert all(torch.equal(p.grad, b) for p, b in zip(m.parameters(), before))
    for p, q in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-13)


def test_scratch_grads_steps_the_same_and_may_write_the_gradients():
    """``scratch_grads=True`` (the train op's mode) gives the same update bit for bit and may leave anything
    in ``.grad`` (Nesterov SGD leaves ``−lr·g`` there); a non-bool is refused naming the argument."""
    torch.manual_seed(1)
    ws = [torch.randn(40, 30), torch.randn(30)]
    gs = [[torch.randn_like(w) for w in ws] for _ in range(3)]
    out = []
    for scratch in (False, True):
        ps = [w.clone().requires_grad_() for w in ws]
        opt = SGD(ps, 0.05, momentum=0.9, nesterov=True, weight_decay=0.01, scratch_grads=scratch)
        for step in gs:
            for p, g in zip(ps, step):
                p.grad = g.clone()
            opt.step()
        out.append(ps)
    assert all(torch.equal(a, b) for a, b in zip(*out))
    assert not torch.equal(out[1][0].grad, gs[-1][0])  # (scratch: the gradient was written)
    with pytest.raises(TypeError, match="scratch_grads"):
        SGD([ws[0].clone().requires_grad_()], 0.1, scratch_grads=1)
