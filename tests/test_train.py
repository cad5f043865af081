"""Tests for optkit.train.optimize_loss: order of operations against float64 NumPy written from
spec/openseq2seq.md §3.3/§4/§11, accumulation (§3.4, fixed semantics), the §8.1 and §8.2 vectors, the §5.3
convergence test, overflow skips, checkpoint/resume and the validation paths."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from optkit import DynamicLossScale, fixed_lr, poly_decay
from optkit.regularization import add_regularizer, clear_regularizers, get_regularization_loss, l2_regularizer
from optkit.sgd import SGD
from optkit.train import StepResult, TrainOp, optimize_loss

F64 = torch.float64


@pytest.fixture(autouse=True)
def _clean_registry():
    clear_regularizers()
    yield
    clear_regularizers()


def lsq_problem(seed=0, n=12, d=4, dtype=F64):
    r = np.random.default_rng(seed)
    X = r.standard_normal((n, d))
    y = r.standard_normal((n, 1))
    w0 = r.standard_normal((d, 1)) * 0.5
    return X, y, w0, torch.tensor(X, dtype=dtype), torch.tensor(y, dtype=dtype)


def lsq_grad(X, y, w):
    """∇ mean((Xw − y)²) in float64."""
    return 2.0 * X.T @ (X @ w - y) / X.shape[0]


def make_param(w0, dtype=F64):
    return torch.nn.Parameter(torch.tensor(w0, dtype=dtype))


def lsq_loss(w):
    return lambda X, y: ((X @ w - y) ** 2).mean()


# ------------------------------------------------------------------------------------------------------------
# order of operations, hand-computed (float64)


def test_plain_sgd_step_matches_numpy():
    X, y, w0, Xt, yt = lsq_problem()
    w = make_param(w0)
    op = optimize_loss(lsq_loss(w), SGD, None, 0.1, var_list=[w])
    r = op(Xt, yt)
    assert isinstance(r, StepResult) and isinstance(op, TrainOp)
    np.testing.assert_allclose(w.detach().numpy(), w0 - 0.1 * lsq_grad(X, y, w0), rtol=1e-13)
    assert bool(r.applied) and int(r.global_step) == 1 and int(op.global_step) == 1
    np.testing.assert_allclose(float(r.loss), np.mean((X @ w0 - y) ** 2), rtol=1e-13)
    assert r.grad_norm is None  # nothing needed it
    assert w.grad is None  # gradients cleared after the update


@pytest.mark.parametrize("clip", [0.05, 100.0])
@pytest.mark.parametrize("loss_scaling", [1.0, 256.0, "dynamic", "Backoff"])
def test_accumulate_scale_clip_order(clip, loss_scaling):
    """unscale → mean over the window → global norm (summary) → clip s = min(1, c/N) → update."""
    X, y, w0, Xt, yt = lsq_problem(seed=1)
    w = make_param(w0)
    op = optimize_loss(lsq_loss(w), SGD, {"momentum": 0.9}, 0.1, var_list=[w], clip_gradients=clip,
                       loss_scaling=loss_scaling, iter_size=3)
    parts = [(X[:4], y[:4]), (X[4:8], y[4:8]), (X[8:], y[8:])]
    wn, m = w0.copy(), np.zeros_like(w0)
    for _cycle in range(2):
        gs = [lsq_grad(a, b, wn) for a, b in parts]
        g = sum(gs) / 3
        N = np.linalg.norm(g)
        g = g * min(1.0, clip / N)
        m = 0.9 * m - 0.1 * g  # Keras SGD
        wn = wn + m
        for k, (a, b) in enumerate(parts):
            r = op(torch.tensor(a), torch.tensor(b))
            assert bool(r.applied) == (k == 2)
        np.testing.assert_allclose(float(r.grad_norm), N, rtol=1e-8)
        # the optimizer runs with an fp32 lr and an fp32 grad_scale (1/(S·n) folded in): ~1e-7 of a step
        np.testing.assert_allclose(w.detach().numpy(), wn, rtol=0, atol=1e-8)
    assert int(op.global_step) == 2


def test_k_micro_batches_equal_one_batch_k_times_larger():
    X, y, w0, Xt, yt = lsq_problem(seed=2, n=24)
    results = []
    for k in (1, 4):
        w = make_param(w0)
        op = optimize_loss(lsq_loss(w), torch.optim.SGD, {"momentum": 0.5, "nesterov": True}, 0.05,
                           var_list=[w], iter_size=k, clip_gradients=0.5)
        for _ in range(3):
            for j in range(k):
                sl = slice(j * 24 // k, (j + 1) * 24 // k)
                op(Xt[sl], yt[sl])
        results.append(w.detach().clone())
    torch.testing.assert_close(results[0], results[1], rtol=1e-13, atol=1e-15)


@settings(max_examples=15, deadline=None)
@given(k=st.integers(1, 4), seed=st.integers(0, 10_000), clip=st.sampled_from([None, 0.3]),
       scaling=st.sampled_from([1.0, 64.0, "dynamic"]))
def test_property_window_mean_equals_big_batch(k, seed, clip, scaling):
    """One update over k equal micro-batches (any scale, with or without clipping) equals plain gradient
    descent on the mean gradient of the whole batch (float64 NumPy reference)."""
    X, y, w0, Xt, yt = lsq_problem(seed=seed, n=4 * k, d=3)
    w = make_param(w0)
    op = optimize_loss(lsq_loss(w), torch.optim.SGD, None, 0.05, var_list=[w], iter_size=k,
                       clip_gradients=clip, loss_scaling=scaling)
    for j in range(k):
        r = op(Xt[4 * j:4 * j + 4], yt[4 * j:4 * j + 4])
    assert bool(r.applied)
    g = lsq_grad(X, y, w0)
    if clip is not None:
        g = g * min(1.0, clip / np.linalg.norm(g))
    np.testing.assert_allclose(w.detach().numpy(), w0 - 0.05 * g, rtol=0, atol=1e-8)


# ------------------------------------------------------------------------------------------------------------
# spec §8.1, adapted to the fixed semantics (exact mean of the micro-batches accumulated)


def test_iter_size_hand_vector():
    """§8.1 hand vector. Original: accum k·g/8 then w = 0.1·4·g/8 = [0.35, 0.5]. Fixed: the update uses the
    mean of the 4 micro-batches accumulated (each the full batch), so w = 0.1·[7, 10] = [0.7, 1.0]; the
    accumulators hold k·g_full (sum of raw micro-batch gradients) and are cleared by the update."""
    X = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=F64)
    y = torch.tensor([[1.0], [2.0]], dtype=F64)
    w = torch.nn.Parameter(torch.zeros(2, 1, dtype=F64))
    skip = [True, True, True, False]
    op = optimize_loss(lambda: ((X @ w - y) ** 2).mean(), "SGD", None,
                       lambda gs: fixed_lr(gs, 0.1), var_list=[w], on_horovod=False, iter_size=8,
                       skip_update_ph=lambda: skip[op.micro_steps])
    g = np.array([[-7.0], [-10.0]])
    for k in range(3):
        r = op()
        assert not bool(r.applied)
        np.testing.assert_allclose(w.grad.numpy(), (k + 1) * g, rtol=1e-15)
        np.testing.assert_array_equal(w.detach().numpy(), np.zeros((2, 1)))
    r = op()
    assert bool(r.applied) and int(r.global_step) == 1
    np.testing.assert_allclose(w.detach().numpy(), [[0.7], [1.0]], rtol=1e-14)
    assert w.grad is None and op.micro_steps == 0


def test_iter_size_test_updates_vector():
    """§8.1 ``test_updates`` (numpy seed 0, 10×10, SGD lr 0.1, iter_size 8, 3 cycles of 3 skips + 1 update):
    with exact means every update is w ← w − 0.1·∇L(w) (the original's 4g/8 factor of ½ is gone)."""
    rs = np.random.RandomState(0)
    X, y = rs.rand(10, 10), rs.rand(10, 1)
    w = torch.nn.Parameter(torch.zeros(10, 1, dtype=F64))
    Xt, yt = torch.tensor(X), torch.tensor(y)
    flags = iter([True, True, True, False] * 3)
    op = optimize_loss(lambda: ((Xt @ w - yt) ** 2).mean(), SGD, None, lambda gs: fixed_lr(gs, 0.1),
                       var_list=[w], on_horovod=False, iter_size=8, skip_update_ph=lambda: next(flags))
    wn = np.zeros((10, 1))
    for _ in range(3):
        g = lsq_grad(X, y, wn)
        for k in range(4):
            op()
            if k < 3:
                np.testing.assert_allclose(w.grad.numpy(), (k + 1) * g, rtol=1e-12)
        wn = wn - 0.1 * g
        np.testing.assert_allclose(w.detach().numpy(), wn, rtol=1e-12, atol=1e-7)


def test_automatic_windows_first_update_uses_full_window():
    X, y, w0, Xt, yt = lsq_problem(seed=3)
    w = make_param(w0)
    op = optimize_loss(lsq_loss(w), SGD, None, 0.1, var_list=[w], iter_size=3)
    applied = [bool(op(Xt, yt).applied) for _ in range(6)]
    assert applied == [False, False, True, False, False, True]
    # per-call override: update early with the 1 micro-batch accumulated (exact mean of 1)
    before = w.detach().numpy().copy()
    assert bool(op(Xt, yt, skip_update=False).applied)
    np.testing.assert_allclose(w.detach().numpy(), before - 0.1 * lsq_grad(X, y, before), rtol=1e-12)


# ------------------------------------------------------------------------------------------------------------
# LARC (§4 vectors)


@pytest.mark.parametrize(
    "mode,eta,w0,expected_ratio",
    [
        ("clip", 0.002, [3.0, 4.0], 0.01 / (0.1 * 0.5000001)),
        ("scale", 0.002, [3.0, 4.0], 0.01 / 0.5000001),
        ("clip", 0.1, [3.0, 4.0], 1.0),
        ("scale", 0.1, [3.0, 4.0], 0.5 / 0.5000001),
        ("clip", 0.002, [0.0, 0.0], 1e-7),
    ],
)
def test_larc_vectors(mode, eta, w0, expected_ratio):
    w = torch.nn.Parameter(torch.tensor(w0, dtype=F64))
    g = torch.tensor([0.3, 0.4], dtype=F64)
    op = optimize_loss(lambda: (w * g).sum(), SGD, None, 0.1, var_list=[w],
                       larc_params={"larc_eta": eta, "larc_mode": mode})
    op()
    want = np.array(w0) - 0.1 * expected_ratio * np.array([0.3, 0.4])
    # fp32 learning rate inside r and the update (as in TF): agreement to ~1e-8 of the step
    np.testing.assert_allclose(w.detach().numpy(), want, rtol=0, atol=1e-9 * max(1.0, expected_ratio))


def test_larc_zero_lr_has_no_nan():
    w = torch.nn.Parameter(torch.zeros(2, dtype=F64))
    op = optimize_loss(lambda: (w * torch.tensor([0.3, 0.4], dtype=F64)).sum(), torch.optim.SGD,
                       {"momentum": 0.9}, 0.0, var_list=[w], larc_params={"larc_eta": 0.002})
    op()
    assert torch.isfinite(op.optimizer.state[w]["momentum_buffer"]).all()


# ------------------------------------------------------------------------------------------------------------
# spec §8.2 mixed-precision regularization


def _reg_model(dtype):
    X = torch.full((3, 2), 0.5, dtype=dtype)
    y = torch.full((3, 1), 1e-4, dtype=dtype)
    w = torch.nn.Parameter(torch.full((2, 1), 1e-4, dtype=dtype))
    add_regularizer(w, l2_regularizer(1e-4), name="dense/kernel")
    return X, y, w


def test_regularization_normal_fp32_and_fp16():
    X, y, w = _reg_model(torch.float32)
    reg = get_regularization_loss()
    np.testing.assert_allclose(float(reg.detach()), 1e-12, rtol=1e-6)
    (g,) = torch.autograd.grad(((X @ w - y) ** 2).mean() + reg, [w])
    np.testing.assert_allclose(g.numpy().ravel(), [1e-8, 1e-8], rtol=1e-5)
    clear_regularizers()
    X, y, w = _reg_model(torch.float16)
    reg = get_regularization_loss()
    assert reg.dtype == torch.float32 and float(reg.detach()) == 0.0  # fp16 underflow
    (g,) = torch.autograd.grad(((X @ w - y) ** 2).float().mean() + reg, [w])
    assert float(g.abs().max()) == 0.0


def test_regularization_mixed_master_gradient():
    X, y, w = _reg_model(torch.float16)
    seen = []

    def loss():
        reg = get_regularization_loss()
        seen.append(reg)
        return ((X @ w - y) ** 2).float().mean() + reg

    lr = 1e4
    op = optimize_loss(loss, torch.optim.SGD, None, lr, var_list=[w], dtype="mixed")
    master0 = op.masters[0].detach().clone()
    np.testing.assert_allclose(master0.numpy().ravel(), [1.0001659e-4] * 2, rtol=1e-7)
    op()
    assert float(seen[0]) == 0.0  # the fp16 weight's regularizer is diverted to the master
    g = (master0 - op.masters[0].detach()) / lr
    np.testing.assert_allclose(g.numpy().ravel(), [1e-8, 1e-8], atol=1e-11)
    np.testing.assert_allclose(g.numpy().ravel(), 1e-4 * master0.numpy().ravel(), rtol=1e-4)


# ------------------------------------------------------------------------------------------------------------
# convergence (§5.3)


@pytest.mark.parametrize("dtype", [torch.float32, "mixed"])
def test_convergence_adam_least_squares(dtype):
    rs = np.random.RandomState(0)
    X, y = rs.rand(10, 10), rs.rand(10, 1)
    w_star = np.linalg.solve(X, y)
    pd = torch.float16 if dtype == "mixed" else torch.float32
    w = torch.nn.Parameter(torch.zeros(10, 1, dtype=pd))
    Xt, yt = torch.tensor(X, dtype=pd), torch.tensor(y, dtype=pd)
    op = optimize_loss(lambda: ((Xt @ w - yt).float() ** 2).mean(), "Adam", None, 0.05,
                       var_list=[w], dtype=dtype, loss_scaling="Backoff" if dtype == "mixed" else 1.0)
    for k in range(1, 3001):  # converges in about 2,200 updates; stop once within the tolerance
        op()
        if k % 100 == 0 and np.abs(op.masters[0].detach().double().numpy() - w_star).max() < 0.01:
            break
    np.testing.assert_allclose(op.masters[0].detach().double().numpy(), w_star, atol=0.01)
    if dtype == "mixed":
        assert w.dtype == torch.float16 and op.masters[0].dtype == torch.float32
        torch.testing.assert_close(w.detach(), op.masters[0].detach().half())


# ------------------------------------------------------------------------------------------------------------
# overflow: a skipped update touches nothing


def _snapshot(op, w):
    return (w.detach().clone(), {k: v.clone() for k, v in op.optimizer.state[op.masters[0]].items()},
            int(op.global_step))


@pytest.mark.parametrize("opt_cls,kw", [(SGD, {"momentum": 0.9, "use_ema": True}),
                                        ("Momentum", {"momentum": 0.9}),
                                        ("Adam", {}),
                                        (torch.optim.Adam, {})])
def test_overflow_skips_everything(opt_cls, kw):
    X, y, w0, Xt, yt = lsq_problem(seed=4)
    w = make_param(w0)
    bad = {"on": False}

    def loss(X, y):
        value = ((X @ w - y) ** 2).mean()
        return value * float("inf") if bad["on"] else value

    op = optimize_loss(loss, opt_cls, kw, lambda k: poly_decay(k, 0.1, 10), var_list=[w],
                       loss_scaling="dynamic", loss_scaling_params={"initial_loss_scale": 1024.0})
    op(Xt, yt)
    lr_before = float(op.learning_rate)
    before = _snapshot(op, w)
    bad["on"] = True
    r = op(Xt, yt)
    assert not bool(r.applied)
    after = _snapshot(op, w)
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    for k in before[1]:
        torch.testing.assert_close(after[1][k], before[1][k], rtol=0, atol=0)
    assert after[2] == before[2] == 1
    assert float(op.learning_rate) == lr_before  # the schedule did not advance
    assert float(op.scaler.loss_scale) == 512.0
    assert w.grad is None
    bad["on"] = False
    assert bool(op(Xt, yt).applied) and int(op.global_step) == 2


def test_window_with_non_finite_micro_batch_is_dropped_whole():
    X, y, w0, Xt, yt = lsq_problem(seed=5)
    w = make_param(w0)
    calls = {"n": 0}

    def loss(X, y):
        calls["n"] += 1
        value = ((X @ w - y) ** 2).mean()
        return value * float("nan") if calls["n"] == 2 else value

    op = optimize_loss(loss, SGD, None, 0.1, var_list=[w], iter_size=3, loss_scaling="Backoff")
    for _ in range(3):
        r = op(Xt, yt)
    assert not bool(r.applied) and int(op.global_step) == 0
    np.testing.assert_array_equal(w.detach().numpy(), w0)
    assert float(op.scaler.loss_scale) == 2.0**13  # backed off once (Backoff starts at 2^14)
    for _ in range(3):
        r = op(Xt, yt)
    assert bool(r.applied)
    np.testing.assert_allclose(w.detach().numpy(), w0 - 0.1 * lsq_grad(X, y, w0), rtol=0, atol=1e-8)


def test_float16_with_dynamic_scaling_and_frozen_var():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).half()
    frozen = model[0].bias
    frozen0 = frozen.detach().clone()
    x = torch.randn(16, 4).half()
    t = torch.randn(16, 1).half()
    var_list = [(n, p) for n, p in model.named_parameters() if n != "0.bias"]
    op = optimize_loss(lambda: ((model(x) - t) ** 2).float().mean(), SGD, None, 0.05, var_list=var_list,
                       dtype=torch.float16, loss_scaling="dynamic")
    losses = [float(op().loss) for _ in range(20)]
    assert losses[-1] < losses[0]
    assert frozen.grad is None
    torch.testing.assert_close(frozen.detach(), frozen0, rtol=0, atol=0)
    assert model[0].weight.dtype == torch.float16


# ------------------------------------------------------------------------------------------------------------
# schedule and the AdamW quirk


def test_schedule_uses_applied_update_count():
    w = torch.nn.Parameter(torch.ones(3, dtype=F64))
    op = optimize_loss(lambda: (w * w).sum(), SGD, None, lambda k: 0.1 / (1 + k), var_list=[w], iter_size=2)
    lrs = []
    for _ in range(6):
        r = op()
        lrs.append(float(r.lr))
    np.testing.assert_allclose(lrs, [0.1, 0.1, 0.05, 0.05, 0.1 / 3, 0.1 / 3], rtol=1e-7)


@pytest.mark.parametrize("scaling", [1.0, "dynamic"])
def test_schedule_follows_a_global_step_written_from_outside(scaling):
    """``global_step`` is the live count: written in place (restarting the schedule), the next update takes
    the written count's learning rate, and the ones after it count on from there."""
    w = torch.nn.Parameter(torch.ones(3, dtype=F64))
    op = optimize_loss(lambda: (w * w).sum(), SGD, None, lambda k: 0.1 / (1 + k), var_list=[w],
                       loss_scaling=scaling)
    for _ in range(5):
        op()
    op.global_step.zero_()
    lrs = [float(op().lr) for _ in range(3)]
    np.testing.assert_allclose(lrs, [0.1, 0.05, 0.1 / 3], rtol=1e-7)
    assert int(op.global_step) == 3


@pytest.mark.parametrize("opt", ["AdamW", torch.optim.AdamW])
def test_adamw_weight_decay_not_mutated_and_lr_scaled_once(opt):
    w = torch.nn.Parameter(torch.full((2,), 2.0, dtype=F64))
    params = {"weight_decay": 0.1}
    op = optimize_loss(lambda: (w * 0.0).sum(), opt, params, 0.5, var_list=[w])
    op()
    assert params == {"weight_decay": 0.1}
    # zero gradient: only the decoupled decay moves w, by lr·wd·w (the original's wd_eff = wd·lr(k))
    np.testing.assert_allclose(w.detach().numpy(), [2.0 * (1 - 0.5 * 0.1)] * 2, rtol=1e-12)


# ------------------------------------------------------------------------------------------------------------
# checkpoint / resume


def _resume_setup(dtype):
    torch.manual_seed(0)
    pd = torch.float16 if dtype == "mixed" else torch.float32
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1)).to(pd)
    data = [(torch.randn(8, 5).to(pd), torch.randn(8, 1).to(pd)) for _ in range(11)]

    def build(m):
        return optimize_loss(lambda x, t: ((m(x) - t) ** 2).float().mean(), SGD,
                             {"momentum": 0.9, "nesterov": True, "use_ema": True},
                             lambda k: poly_decay(k, 0.1, 20), model=m, dtype=dtype, iter_size=2,
                             clip_gradients=0.5, loss_scaling="dynamic",
                             loss_scaling_params={"initial_loss_scale": 256.0, "increment_period": 2})
    return model, data, build


@pytest.mark.parametrize("dtype", [torch.float32, "mixed"])
def test_resume_is_bit_identical(dtype):
    model, data, build = _resume_setup(dtype)
    m1 = copy.deepcopy(model)
    op1 = build(m1)
    for x, t in data:
        op1(x, t)

    m2 = copy.deepcopy(model)
    op2 = build(m2)
    for x, t in data[:5]:  # stops inside an accumulation window
        op2(x, t)
    ckpt = copy.deepcopy({"model": m2.state_dict(), "train": op2.state_dict()})
    m3 = copy.deepcopy(model)
    op3 = build(m3)
    m3.load_state_dict(ckpt["model"])
    op3.load_state_dict(ckpt["train"])
    for x, t in data[5:]:
        op3(x, t)
    for p1, p3 in zip(m1.parameters(), m3.parameters()):
        torch.testing.assert_close(p1, p3, rtol=0, atol=0)
    for q1, q3 in zip(op1.masters, op3.masters):
        torch.testing.assert_close(q1, q3, rtol=0, atol=0)
        for k in op1.optimizer.state[q1]:
            torch.testing.assert_close(op1.optimizer.state[q1][k], op3.optimizer.state[q3][k], rtol=0, atol=0)
    assert int(op1.global_step) == int(op3.global_step) == 5
    assert float(op1.scaler.loss_scale) == float(op3.scaler.loss_scale)


def test_load_state_dict_rejects_bad_input_untouched():
    X, y, w0, Xt, yt = lsq_problem()
    w = make_param(w0)
    op = optimize_loss(lsq_loss(w), SGD, None, 0.1, var_list=[w])
    op(Xt, yt)
    sd = op.state_dict()
    step = int(op.global_step)
    with pytest.raises(TypeError):
        op.load_state_dict([1])
    with pytest.raises(ValueError, match="missing"):
        op.load_state_dict({k: v for k, v in sd.items() if k != "scaler"})
    bad = dict(sd, accumulators=[torch.zeros(7)])
    with pytest.raises(ValueError, match="accumulator"):
        op.load_state_dict(bad)
    assert int(op.global_step) == step


def _assert_same(a, b, where="state"):
    """``a`` and ``b`` are equal bit for bit (tensors: dtype, shape and values)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b) and a == b, where


_BAD_ENTRIES = [
    ("global_step", torch.tensor([1, 2]), ValueError, "global_step"),
    ("global_step", torch.tensor(float("nan")), ValueError, "global_step"),
    ("global_step", torch.tensor(float("inf")), ValueError, "global_step"),
    ("global_step", torch.tensor(1.5), ValueError, "global_step"),
    ("global_step", torch.tensor(-1), ValueError, "global_step"),
    ("global_step", 2**62, ValueError, "global_step"),
    ("global_step", torch.tensor(True), TypeError, "global_step"),
    ("global_step", "3", TypeError, "global_step"),
    ("host_step", "abc", TypeError, "host_step"),
    ("host_step", -1, ValueError, "host_step"),
    ("host_step", None, TypeError, "host_step"),
    ("host_exact", 1, TypeError, "host_exact"),
    ("host_exact", True, ValueError, "host_exact"),  # the dynamic scaler can skip updates
    ("micro", None, TypeError, "micro"),
    ("micro", 1.0, TypeError, "micro"),
    ("micro", -1, ValueError, "micro"),
    ("micro", 2, ValueError, "micro"),  # iter_size is 2
    ("micro", 99, ValueError, "micro"),
    ("summary_attempts", -1, ValueError, "summary_attempts"),
    ("summary_attempts", 2.5, TypeError, "summary_attempts"),
    ("accumulators", "nope", TypeError, "accumulators"),
    ("items", torch.tensor(float("nan"), dtype=F64), ValueError, "items"),
    ("items", torch.tensor(-1.0, dtype=F64), ValueError, "items"),
    ("accumulators_world_size", "2", TypeError, "accumulators_world_size"),
]


@pytest.mark.parametrize("dtype", [torch.float32, "mixed"])
@pytest.mark.parametrize("key,value,exc,match", _BAD_ENTRIES,
                         ids=[f"{k}={v!r}" for k, v, _, _ in _BAD_ENTRIES])
def test_load_state_dict_refuses_bad_entries_atomically(dtype, key, value, exc, match):
    """Each bad entry of a train op state: the error names it, nothing changes (optimizer, scaler, counters,
    accumulators, parameters), and the train op still loads a good state and continues bit-identically."""
    model, data, build = _resume_setup(dtype)
    m1 = copy.deepcopy(model)
    op1 = build(m1)
    for x, t in data[:5]:  # inside an accumulation window
        op1(x, t)
    good = copy.deepcopy(op1.state_dict())
    good_model = copy.deepcopy(m1.state_dict())
    for x, t in data[5:]:
        op1(x, t)

    m3 = copy.deepcopy(model)
    op3 = build(m3)
    for x, t in data[:2]:  # another state: a load that went through would change it
        op3(x, t)
    before = copy.deepcopy(op3.state_dict())
    masters = [q.detach().clone() for q in op3.masters]
    params = [p.detach().clone() for p in m3.parameters()]
    bad = copy.deepcopy(good)
    bad[key] = value
    with pytest.raises(exc, match=match):
        op3.load_state_dict(bad)
    _assert_same(op3.state_dict(), before)
    for q, q0 in zip(op3.masters, masters):
        assert torch.equal(q, q0)
    for p, p0 in zip(m3.parameters(), params):
        assert torch.equal(p, p0)
    assert op3.micro_steps == before["micro"]

    m3.load_state_dict(good_model)
    op3.load_state_dict(good)
    for x, t in data[5:]:
        op3(x, t)
    for p1, p3 in zip(m1.parameters(), m3.parameters()):
        torch.testing.assert_close(p1, p3, rtol=0, atol=0)
    assert int(op1.global_step) == int(op3.global_step) == 5


@pytest.mark.parametrize("part", ["optimizer", "scaler"])
def test_load_state_dict_checks_optimizer_and_scaler_before_assigning(part):
    """A bad optimizer or scaler part changes neither of them (nor the counters)."""
    model, data, build = _resume_setup(torch.float32)
    op1 = build(copy.deepcopy(model))
    for x, t in data[:4]:
        op1(x, t)
    good = copy.deepcopy(op1.state_dict())
    op3 = build(copy.deepcopy(model))
    op3(*data[0])
    before = copy.deepcopy(op3.state_dict())
    bad = copy.deepcopy(good)
    if part == "optimizer":
        bad["optimizer"]["param_groups"][0]["momentum"] = "fast"
    else:
        bad["scaler"]["scale"] = torch.tensor([1.0, 2.0])
    with pytest.raises((TypeError, ValueError)):
        op3.load_state_dict(bad)
    _assert_same(op3.state_dict(), before)


def test_load_state_dict_micro_and_host_counter_rules():
    """``micro`` must lie inside the window unless a skip-update placeholder decides the updates; an exact
    host counter (no loss scaler that skips) must equal the step; a window at ``micro = iter_size - 1``
    loads and the next micro-batch applies the update."""
    X, y, w0, Xt, yt = lsq_problem()
    w = make_param(w0)
    op = optimize_loss(lsq_loss(w), SGD, None, 0.1, var_list=[w], iter_size=3)
    op(Xt, yt)
    sd = copy.deepcopy(op.state_dict())
    assert sd["host_exact"] is True
    with pytest.raises(ValueError, match="micro"):
        op.load_state_dict(dict(sd, micro=3))
    with pytest.raises(ValueError, match="host_step"):
        op.load_state_dict(dict(sd, host_step=7))
    with pytest.raises(ValueError, match="accumulators"):
        op.load_state_dict(dict(sd, accumulators=[torch.full_like(w, float("nan"))]))
    with pytest.raises(ValueError, match="accumulators"):
        op.load_state_dict(dict(sd, accumulators=[torch.ones(w.shape, dtype=torch.int64)]))
    assert op.micro_steps == 1 and int(op.global_step) == 0
    op.load_state_dict(dict(sd, micro=2, global_step=torch.tensor(4.0), host_step=4))
    assert int(op.global_step) == 4 and op.global_step.dtype == torch.int64
    op(Xt, yt)
    assert op.micro_steps == 0 and int(op.global_step) == 5

    w2 = make_param(w0)
    op2 = optimize_loss(lsq_loss(w2), SGD, None, 0.1, var_list=[w2], iter_size=3, skip_update_ph=True)
    op2(Xt, yt)
    op2.load_state_dict(dict(op2.state_dict(), micro=5))  # the placeholder decides: any count is possible
    assert op2.micro_steps == 5


# ------------------------------------------------------------------------------------------------------------
# validation: ValueError/TypeError naming the argument, nothing built or changed


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(summaries=["nope"]), ValueError, "Summaries"),
        (dict(clip_gradients=1.0, larc_params={"larc_eta": 0.01}), ValueError, "LARC"),
        (dict(dtype=torch.int32), ValueError, "dtype"),
        (dict(dtype="half"), ValueError, "dtype"),
        (dict(iter_size=0), ValueError, "iter_size"),
        (dict(iter_size=2.0), ValueError, "iter_size"),
        (dict(clip_gradients=-1.0), ValueError, "clip_gradients"),
        (dict(clip_gradients="1"), TypeError, "clip_gradients"),
        (dict(larc_params={"larc_eta": 1}), TypeError, "larc_eta"),
        (dict(larc_params={}), ValueError, "larc_eta"),
        (dict(larc_params={"larc_eta": 0.1, "larc_mode": "lars"}), ValueError, "larc_mode"),
        (dict(larc_params={"larc_eta": 0.1, "foo": 1.0}), ValueError, "foo"),
        (dict(larc_params={"larc_eta": -1.0}), ValueError, "larc_eta"),
        (dict(larc_params={"larc_eta": 0.1, "epsilon": 0.0}), ValueError, "epsilon"),
        (dict(loss_scaling="nope"), ValueError, "loss_scaling"),
        (dict(loss_scaling=True), TypeError, "loss_scaling"),
        (dict(loss_scaling=2.0, loss_scaling_params={"scale_min": 1.0}), ValueError, "loss_scaling_params"),
        (dict(loss_scaling="dynamic", loss_scaling_params={"scale_min": 1.0}), ValueError, "scale_min"),
        (dict(loss_scaling="Backoff", loss_scaling_params={"step_window": 2.0}), TypeError, "step_window"),
        (dict(loss_scaling="LogMax", loss_scaling_params={"nope": 2.0}), ValueError, "nope"),
        (dict(on_horovod=True), ValueError, "on_horovod"),
        (dict(on_horovod=1), TypeError, "on_horovod"),
        (dict(skip_update_ph="yes"), TypeError, "skip_update_ph"),
        (dict(optimizer_params=[1]), TypeError, "optimizer_params"),
        (dict(learning_rate_decay_fn=None), ValueError, "learning_rate_decay_fn"),
        (dict(learning_rate_decay_fn="fast"), TypeError, "learning_rate_decay_fn"),
        (dict(optimizer_params={"learning_rate": 0.1}), ValueError, "learning_rate"),
        (dict(var_list=[]), ValueError, "var_list"),
        (dict(summary_every=0), ValueError, "summary_every"),
        (dict(summary_writer=object()), TypeError, "summary_writer"),
        (dict(optimizer=torch.optim.SGD([torch.nn.Parameter(torch.ones(1))])), TypeError, "optimizer"),
        (dict(optimizer=3), TypeError, "optimizer"),
        (dict(loss=3), TypeError, "loss"),
    ],
)
def test_validation_errors(kwargs, exc, match):
    w = torch.nn.Parameter(torch.full((2,), 0.5, dtype=torch.float16))
    add_regularizer(w, l2_regularizer(1.0))
    args = dict(loss=lambda: (w.float() ** 2).sum(), optimizer=SGD, optimizer_params=None,
                learning_rate_decay_fn=0.1, var_list=[w], dtype="mixed")
    args.update(kwargs)
    before = w.detach().clone()
    with pytest.raises(exc, match=match):
        optimize_loss(**args)
    torch.testing.assert_close(w.detach(), before, rtol=0, atol=0)
    assert float(get_regularization_loss().detach()) > 0  # not diverted by the failed call


def test_unknown_registry_name():
    w = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="Nadam"):
        optimize_loss(lambda: w.sum(), "Nadam", None, 0.1, var_list=[w])


def test_loss_must_be_scalar():
    w = torch.nn.Parameter(torch.ones(2))
    op = optimize_loss(lambda: w * 2, SGD, None, 0.1, var_list=[w])
    with pytest.raises(ValueError, match="scalar"):
        op()
    torch.testing.assert_close(w.detach(), torch.ones(2))


def test_var_list_from_model_and_dynamic_instance():
    model = torch.nn.Linear(3, 1)
    scaler = DynamicLossScale(initial_loss_scale=8.0)
    op = optimize_loss(lambda x: model(x).pow(2).mean(), SGD, None, 0.1, model=model, loss_scaling=scaler)
    assert op.scaler is scaler and op.names == ["weight", "bias"]
    r = op(torch.randn(4, 3))
    assert float(r.loss_scale) == 8.0 and bool(r.applied)


# --------------------------------------------------------------------------------------------------------
# no host reads in the hot path when summaries are off


@pytest.mark.parametrize("mixed", [False, True])
def test_no_host_sync_without_summaries(monkeypatch, mixed):
    """With dynamic scaling, clipping (or, mixed: fp16 model, fp32 masters and LARC), accumulation, SGD + EMA
    and a tensor-step schedule, no code of the train op, the wrappers, the optimizer, clipping or the
    policies reads a tensor on the host (the scaler's CPU-only floor-warning read in loss_scale.py is the one
    exception, and it is skipped on accelerators)."""
    import inspect

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    x, t = torch.randn(6, 4), torch.randn(6, 1)
    extra = {"clip_gradients": 0.5}
    if mixed:
        model, x, t = model.half(), x.half(), t.half()
        extra = {"dtype": "mixed", "larc_params": {"larc_eta": 0.01}}
    op = optimize_loss(lambda: ((model(x) - t) ** 2).float().mean(), "SGD",
                       {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-4, "use_ema": True},
                       lambda k: poly_decay(k, 0.1, 100), model=model, loss_scaling="dynamic", iter_size=2,
                       summaries=[], **extra)
    op()
    op()  # warm: first update done
    reads: list[str] = []
    watched = ("train.py", "optimizer.py", "sgd.py", "clipping.py", "lr_policies.py", "schedules.py",
               "_multi_tensor.py", "summaries.py", "regularization.py", "_wrapper.py", "mixed_precision.py",
               "larc.py", "loss_scale_optimizer.py", "_train_build.py", "_train_window.py",
               "_train_checkpoint.py")

    def spy(name):
        orig = getattr(torch.Tensor, name)

        def wrapper(self, *a, **k):
            caller = inspect.stack()[1].filename
            if caller.endswith(watched) and "/optkit/" in caller:
                reads.append(f"{name} from {caller}")
            return orig(self, *a, **k)

        return wrapper

    for name in ("item", "__bool__", "__float__", "__int__", "__index__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, spy(name))
    for _ in range(6):
        op()
    monkeypatch.undo()
    assert reads == []
    assert int(op.global_step) == 4


def test_logmax_scaler_gets_amax_of_unscaled_clipped_grads():
    """LogMax (§6.3) on the first clean update: x = log2(amax), μ = x, σ = 0, S = clip(2^(16 − x), 1, 2^14),
    with amax = max|mean gradient · clip factor|."""
    X, y, w0, Xt, yt = lsq_problem(seed=6)
    w = make_param(w0)
    op = optimize_loss(lsq_loss(w), SGD, None, 0.01, var_list=[w], loss_scaling="LogMax", clip_gradients=0.1)
    g = lsq_grad(X, y, w0)
    g = g * min(1.0, 0.1 / np.linalg.norm(g))
    amax = np.abs(g).max()
    assert bool(op(Xt, yt).applied)
    want = min(max(2.0 ** (16 - np.log2(amax)), 1.0), 2.0**14)
    np.testing.assert_allclose(float(op.scaler.loss_scale), want, rtol=1e-4)


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_mixed_masters_and_saturating_copy_back(half):
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=half))
    op = optimize_loss(lambda: (w.float() * torch.tensor([-1.0, 1.0])).sum(), torch.optim.SGD, None, 1e5,
                       var_list=[w], dtype="mixed")
    op()
    master = op.masters[0]
    assert master.dtype == torch.float32 and op.optimizer.param_groups[0]["params"][0] is master
    np.testing.assert_allclose(master.detach().numpy(), [100001.0, -100002.0])
    big = float(torch.finfo(half).max)
    want = [min(100001.0, big), max(-100002.0, -big)]
    torch.testing.assert_close(w.detach(), torch.tensor(want, dtype=torch.float32).to(half))
    assert torch.isfinite(w).all()


def test_no_gradient_at_all_raises():
    w = torch.nn.Parameter(torch.ones(2))
    z = torch.zeros((), requires_grad=True)
    op = optimize_loss(lambda: z * 2.0, SGD, None, 0.1, var_list=[w])
    with pytest.raises(ValueError, match="No gradients"):
        op()
    assert int(op.global_step) == 0 and op.micro_steps == 0
    torch.testing.assert_close(w.detach(), torch.ones(2))


@pytest.mark.parametrize("name,kw", [("SGD", {}), ("Momentum", {"momentum": 0.9}), ("Adam", {}),
                                     ("AdamW", {"weight_decay": 0.01}), ("Adagrad", {}), ("RMSProp", {}),
                                     ("Ftrl", {}), ("LARS", {})])
def test_every_registry_optimizer_matches_a_hand_step(name, kw):
    """Two updates through the train op (2 micro-batches each, scale 2^10, clip) equal the same registry
    class stepped by hand with the clipped mean gradient."""
    from optkit import get_optimizer

    X, y, w0, Xt, yt = lsq_problem(seed=7, n=8)
    w = make_param(w0)
    op = optimize_loss(lsq_loss(w), name, dict(kw), 0.05, var_list=[w], iter_size=2, clip_gradients=0.2,
                       loss_scaling=1024.0)
    v = make_param(w0)
    ref = get_optimizer(name)([v], learning_rate=0.05, **kw)
    for _ in range(2):
        g = lsq_grad(X, y, v.detach().numpy())
        g = g * min(1.0, 0.2 / np.linalg.norm(g))
        v.grad = torch.tensor(g)
        ref.step()
        v.grad = None
        op(Xt[:4], yt[:4])
        op(Xt[4:], yt[4:])
    np.testing.assert_allclose(w.detach().numpy(), v.detach().numpy(), rtol=1e-6, atol=1e-8)


# --------------------------------------------------------------------------------------------------------
# the optimizer stack: MixedPrecisionOptimizerWrapper(LARC(cls)) driven through the step protocol


class _Writer:
    def __init__(self):
        self.scalars = {}

    def add_scalar(self, tag, value, step):
        self.scalars.setdefault(tag, []).append((step, float(value)))

    def add_histogram(self, tag, values, step):
        pass


def test_stack_is_built_from_the_library_wrappers():
    from optkit.larc import LARC
    from optkit.loss_scale import FixedLossScale
    from optkit.mixed_precision import MixedPrecisionOptimizerWrapper

    w = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    op = optimize_loss(lambda: (w.float() ** 2).sum(), SGD, None, 0.1, var_list=[w], dtype="mixed",
                       larc_params={"larc_eta": 0.01}, loss_scaling="Backoff")
    assert isinstance(op.optimizer, MixedPrecisionOptimizerWrapper)
    assert isinstance(op.optimizer.optimizer, LARC) and op.optimizer.optimizer.optimizer is op.base_optimizer
    assert isinstance(op.base_optimizer, SGD)
    scaler = op.optimizer.loss_scaler  # the wrapper checks nothing and scales by 1: the train op drives S
    assert isinstance(scaler, FixedLossScale) and scaler.loss_scale_value == 1.0 and not scaler.dynamic
    assert op.masters[0] is op.optimizer.master_params[0] is op.base_optimizer.param_groups[0]["params"][0]
    v = torch.nn.Parameter(torch.ones(3))
    op = optimize_loss(lambda: (v ** 2).sum(), SGD, None, 0.1, var_list=[v])
    assert op.optimizer is op.base_optimizer and op.masters[0] is v


def test_mixed_window_is_accumulated_in_fp32():
    """S·g = 49152 per micro-batch fits float16, the sum of two (98304) does not: the window is summed in
    the fp32 master buffers, so the update is the exact mean (float64 NumPy reference)."""
    c = np.array([3.0, -2.0])
    w = torch.nn.Parameter(torch.tensor([1.0, 0.5], dtype=torch.float16))
    ct = torch.tensor(c, dtype=torch.float32)
    op = optimize_loss(lambda k: (w.float() * ct).sum() * k, torch.optim.SGD, None, 0.01, var_list=[w],
                       dtype="mixed", loss_scaling=2.0**14, iter_size=2)
    assert not bool(op(1.0).applied)
    assert w.grad is None and op.masters[0].grad is not None  # folded into the fp32 buffer
    r = op(1.0)
    assert bool(r.applied)
    want = np.array([1.0, 0.5]) - 0.01 * c  # mean of two equal micro-batch gradients
    np.testing.assert_allclose(op.masters[0].detach().double().numpy(), want, rtol=0, atol=1e-7)
    torch.testing.assert_close(w.detach(), op.masters[0].detach().half(), rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["clip", "scale"])
def test_mixed_larc_matches_numpy_and_summaries(mode):
    """LARC on the fp32 masters with the mean unscaled gradient (S = 1024, 2 micro-batches, fp16 model)."""
    w0, g = np.array([3.0, 4.0]), np.array([0.375, 0.5])  # S·g exact in float16
    w = torch.nn.Parameter(torch.tensor(w0, dtype=torch.float16))
    gt = torch.tensor(g, dtype=torch.float32)
    writer = _Writer()
    op = optimize_loss(lambda: (w.float() * gt).sum(), SGD, None, 0.1, var_list=[("v", w)], dtype="mixed",
                       larc_params={"larc_eta": 0.002, "larc_mode": mode}, loss_scaling=1024.0, iter_size=2,
                       summaries=["larc_summaries"], summary_writer=writer, summary_every=1)
    op()
    op()
    raw = 0.002 * np.linalg.norm(w0) / (np.linalg.norm(g) + 1e-7)
    ratio = min(max(raw / 0.1, 1e-7), 1.0) if mode == "clip" else max(raw, 1e-7)
    master = op.masters[0].detach().double().numpy()
    np.testing.assert_allclose(master, w0 - 0.1 * ratio * g, rtol=0, atol=1e-6)
    assert writer.scalars["larc_grad_update/v"][0][1] == pytest.approx(ratio, rel=1e-6)
    assert writer.scalars["larc_final_lr/v"][0][1] == pytest.approx(0.1 * ratio, rel=1e-6)
    if mode == "clip":
        assert writer.scalars["larc_clip_on/v"] == [(0, 1.0)]
    else:
        assert "larc_clip_on/v" not in writer.scalars


def test_logmax_with_larc_takes_amax_after_the_ratios():
    """§3.3 order: LARC before the scaler update, so LogMax sees max|r·g| (r = 0.1 here, scale mode)."""
    w = torch.nn.Parameter(torch.tensor([3.0, 4.0], dtype=F64))
    g = np.array([300.0, 400.0])
    gt = torch.tensor(g, dtype=F64)
    op = optimize_loss(lambda: (w * gt).sum(), SGD, None, 1e-3, var_list=[w], loss_scaling="LogMax",
                       larc_params={"larc_eta": 10.0, "larc_mode": "scale"})
    assert bool(op().applied)
    r = 10.0 * 5.0 / (500.0 + 1e-7)
    amax = np.abs(g).max() * r
    want = min(max(2.0 ** (16 - np.log2(amax)), 1.0), 2.0**14)
    np.testing.assert_allclose(float(op.scaler.loss_scale), want, rtol=1e-4)
    np.testing.assert_allclose(w.detach().numpy(), [3.0, 4.0] - 1e-3 * r * g, rtol=0, atol=1e-9)


def test_mixed_larc_resume_is_bit_identical():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1)).half()
    data = [(torch.randn(8, 5).half(), torch.randn(8, 1).half()) for _ in range(9)]

    def build(m):
        return optimize_loss(lambda x, t: ((m(x) - t) ** 2).float().mean(), "Momentum", {"momentum": 0.9},
                             0.05, model=m, dtype="mixed", iter_size=2, loss_scaling="Backoff",
                             larc_params={"larc_eta": 0.01})
    m1, m2, m3 = (copy.deepcopy(model) for _ in range(3))
    op1 = build(m1)
    for x, t in data:
        op1(x, t)
    op2 = build(m2)
    for x, t in data[:3]:
        op2(x, t)
    ckpt = copy.deepcopy({"model": m2.state_dict(), "train": op2.state_dict()})
    op3 = build(m3)
    op3(*data[0])  # a pending half-window in the new op is replaced by the checkpoint's
    m3.load_state_dict(ckpt["model"])
    op3.load_state_dict(ckpt["train"])
    for x, t in data[3:]:
        op3(x, t)
    for p1, p3 in zip(m1.parameters(), m3.parameters()):
        torch.testing.assert_close(p1, p3, rtol=0, atol=0)
    for q1, q3 in zip(op1.masters, op3.masters):
        torch.testing.assert_close(q1, q3, rtol=0, atol=0)
    assert int(op1.global_step) == int(op3.global_step) == 4


def test_wrapper_hooks_used_by_the_train_op():
    """MixedPrecisionOptimizerWrapper.accumulate_grads (fp32 sum, validation, zero_grad drops it) and
    LARC.trust_ratios (look-ahead equal to what the step then uses; NumPy formula)."""
    from optkit.larc import LARC
    from optkit.mixed_precision import MixedPrecisionOptimizerWrapper

    w = torch.nn.Parameter(torch.tensor([60000.0, -1.0], dtype=torch.float16))
    opt = MixedPrecisionOptimizerWrapper(torch.optim.SGD([w], lr=1.0))
    m = opt.master_params[0]
    for _ in range(2):
        w.grad = torch.tensor([60000.0, 0.5], dtype=torch.float16)
        opt.accumulate_grads()
        assert w.grad is None
    np.testing.assert_array_equal(m.grad.numpy(), [120000.0, 1.0])  # beyond float16's range
    with pytest.raises(ValueError, match="grads"):
        opt.accumulate_grads([None, None])
    np.testing.assert_array_equal(m.grad.numpy(), [120000.0, 1.0])
    opt.zero_grad()
    assert m.grad is None
    opt.accumulate_grads([torch.tensor([1.0, 2.0])])
    w.grad = torch.tensor([1.0, 1.0], dtype=torch.float16)  # arrives after the fold: added by step()
    opt.step()
    np.testing.assert_array_equal(m.detach().numpy(), [60000.0 - 2.0, -4.0])

    v = torch.nn.Parameter(torch.tensor([3.0, 4.0], dtype=F64))
    larc = LARC(SGD([v], learning_rate=0.1), larc_eta=0.002)
    v.grad = torch.tensor([0.6, 0.8], dtype=F64)
    params, r = larc.trust_ratios(grad_scale=torch.tensor(2.0))
    want = min(max(0.002 * 5.0 / (0.1 * (0.5 + 1e-7)), 1e-7), 1.0)
    assert params == [v]
    np.testing.assert_allclose(r.numpy(), [want], rtol=1e-6)
    larc.grad_scale = torch.tensor(2.0)
    larc.step()
    del larc.grad_scale
    torch.testing.assert_close(larc.last_ratios, r, rtol=0, atol=0)
    assert float(larc.last_clip_on[0]) == 1.0


@pytest.mark.parametrize("fn", [float("nan"), float("inf"), -1.0, lambda s: float("nan"),
                                lambda s: 0.1 if s < 2 else -0.5, lambda s: "x"])
def test_a_learning_rate_that_is_not_a_finite_non_negative_number_is_refused(fn):
    """``learning_rate_decay_fn`` as a number, or a callable's value (a Python number; tensors are not read),
    must be finite and >= 0: a NaN learning rate trained the weights to NaN; the error names the argument,
    and raises no later than the update that would use the value."""
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    with pytest.raises((ValueError, TypeError), match="learning_rate_decay_fn"):
        op = optimize_loss(lambda: m(x).pow(2).sum(), "SGD", {}, learning_rate_decay_fn=fn, model=m)
        for _ in range(3):
            op()
    assert bool(torch.isfinite(m.weight).all())


def test_a_schedule_failing_for_the_next_update_raises_before_that_update_changes_anything():
    """The lr of update k+1 is computed right after update k. A schedule that fails there (NaN from step 2)
    raised after update k was applied, and each later call applied another update with the stale lr and
    raised again. Now update k completes without an error, and every call that would make update k+1
    raises before anything changes."""
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    op = optimize_loss(lambda: (w * w).sum() / 2, "SGD", None, var_list=[w],
                       learning_rate_decay_fn=lambda k: 0.1 if k < 2 else float("nan"))
    ref = np.array([1.0, -2.0])
    for _ in range(2):  # updates 0 and 1 with lr 0.1: w ← w − 0.1·w
        op()
        ref = ref - 0.1 * ref
    np.testing.assert_allclose(w.detach().numpy(), ref, rtol=1e-15)
    for _ in range(2):
        with pytest.raises(ValueError, match="returned nan at step 2"):
            op()
        np.testing.assert_allclose(w.detach().numpy(), ref, rtol=1e-15)
        assert int(op.global_step) == 2


class _FailingWriter:
    """A summary writer whose ``add_scalar`` raises once, at step ``fail_at`` (an I/O error)."""

    def __init__(self, fail_at):
        self.fail_at = fail_at

    def add_scalar(self, tag, value, step):
        if step == self.fail_at:
            self.fail_at = None
            raise OSError("disk full")

    def add_histogram(self, tag, values, step):
        pass


@pytest.mark.parametrize("layout", ["plain", "flat", "mixed"])
def test_an_update_that_raises_drops_its_window(layout):
    """An update that raises before it is committed (here the summary writer, at update 1 of windows of two
    micro-batches) changes no weight, step or scale and drops its window: the window's gradients are
    cleared, so the next window is not added to them (it was: the next update applied two windows'
    gradients divided by one window's count). The run equals one that never saw the failed window."""
    import optkit

    def make():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        if layout == "mixed":
            m = m.to(torch.bfloat16)
        elif layout == "flat":
            optkit.flat_parameters(m)
        return m

    xs = [torch.randn(5, 3, generator=torch.Generator().manual_seed(k)) for k in range(8)]

    def build(m, writer):
        return optimize_loss(lambda x: m(x.to(next(m.parameters()).dtype)).float().pow(2).mean(), "Momentum",
                             {"momentum": 0.9}, 0.1, model=m, iter_size=2, loss_scaling="dynamic",
                             dtype="mixed" if layout == "mixed" else torch.float32,
                             summaries=["learning_rate"],
                             summary_writer=writer, summary_every=1)

    m, ref_m = make(), make()
    op, ref = build(m, _FailingWriter(fail_at=1)), build(ref_m, _FailingWriter(fail_at=None))
    for x in xs[:2]:
        op(x), ref(x)
    before = [p.detach().clone() for p in m.parameters()]
    op(xs[2])
    with pytest.raises(OSError, match="disk full"):
        op(xs[3])
    assert op.micro_steps == 0 and int(op.global_step) == 1
    assert all(torch.equal(p.detach(), b) for p, b in zip(m.parameters(), before))
    assert all(p.grad is None or not p.grad.any() for p in m.parameters())
    for x in xs[4:]:  # the reference never saw xs[2:4]
        op(x), ref(x)
    assert int(op.global_step) == int(ref.global_step) == 3
    for p, q in zip(m.parameters(), ref_m.parameters()):
        assert torch.equal(p.detach(), q.detach())


@pytest.mark.parametrize("flat", [False, True])
def test_a_parameter_frozen_after_the_op_was_built_gets_no_gradient(flat):
    """``requires_grad_(False)`` on a ``var_list`` parameter after the op was built (freezing a backbone for a
    while) raised torch's "can't retain_grad" from ``backward(inputs=...)``. Now it gets no gradient, as in a
    torch.optim loop: the weights equal ``torch.optim.SGD(momentum)`` with ``zero_grad()`` (a frozen
    parameter's gradient is None, so it stays) or, over flat buffers, ``zero_grad(set_to_none=False)`` (its
    gradient is a zero view, so momentum still moves it, as documented); unfreezing trains it again. All
    frozen: a ValueError."""
    import optkit

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()

    xs = [torch.randn(5, 3, dtype=F64, generator=torch.Generator().manual_seed(k)) for k in range(6)]
    m, ref_m = make(), make()
    if flat:
        optkit.flat_parameters(m)
    op = optimize_loss(lambda x: m(x).pow(2).mean(), "Momentum", {"momentum": 0.9}, 0.1, model=m)
    ref = torch.optim.SGD(ref_m.parameters(), lr=0.1, momentum=0.9)
    for k, x in enumerate(xs):
        frozen = k in (2, 3)
        for mm in (m, ref_m):
            mm[0].weight.requires_grad_(not frozen)
        op(x)
        ref.zero_grad(set_to_none=not flat)
        ref_m(x).pow(2).mean().backward()
        ref.step()
        for p, q in zip(m.parameters(), ref_m.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-12, atol=1e-14)
    for p in m.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad=False"):
        op(xs[0])


@pytest.mark.parametrize("token", [False, True], ids=["mean", "token-weighted"])
@pytest.mark.parametrize("where", ["first-node", "mid-way"])
def test_a_backward_that_raises_drops_its_window(token, where):
    """A micro-step whose backward raises (out of memory, a hook), at the first node or after some gradients
    landed, drops its window: gradients and item count cleared, micro-step count 0 (the partial gradient and,
    token-weighted, the items used to stay in the window). The next window's update equals one SGD step on
    that window alone (float64, from torch.autograd.grad)."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()

    xs = [torch.randn(5, 3, dtype=F64, generator=torch.Generator().manual_seed(k)) for k in range(4)]
    m, fail = model(), {"on": False}

    def boom(_):
        raise OSError("backward failed")

    def loss(x, n):
        h = m[1](m[0](x))
        if fail["on"] and where == "mid-way":  # after the last layer's gradients landed
            h.register_hook(boom)
        out = m[2](h).pow(2).sum(1)
        out = out.sum() if token else out.mean()
        if fail["on"] and where == "first-node":
            out.register_hook(boom)
        fail["on"] = False
        return (out, n) if token else out

    op = optimize_loss(loss, "SGD", None, 0.1, model=m, iter_size=2)
    w0 = [p.detach().clone() for p in m.parameters()]
    op(xs[0], 5.0)
    fail["on"] = True
    with pytest.raises(OSError, match="backward failed"):
        op(xs[1], 5.0)
    assert op.micro_steps == 0 and all(p.grad is None for p in m.parameters())
    assert all(torch.equal(p.detach(), w) for p, w in zip(m.parameters(), w0))
    assert not bool(op(xs[2], 3.0).applied) and bool(op(xs[3], 4.0).applied)
    ref = model()
    ps = list(ref.parameters())
    if token:
        tot = (ref(xs[2]).pow(2).sum() + ref(xs[3]).pow(2).sum()) / 7.0
    else:
        tot = (ref(xs[2]).pow(2).sum(1).mean() + ref(xs[3]).pow(2).sum(1).mean()) / 2.0
    tol = 1e-7 if token else 1e-12  # (1/7 as the float32 factor of the step protocol: about 3e-8 relative)
    for p, w, g in zip(m.parameters(), w0, torch.autograd.grad(tot, ps)):
        torch.testing.assert_close(p.detach(), w - 0.1 * g, rtol=tol, atol=tol / 100)


def test_a_schedule_failing_at_a_written_global_step_raises_at_every_call():
    """After ``global_step`` is written to a count the schedule fails at, every call raises before anything
    changes (the write stays pending until the schedule answers), as for a count reached by updates."""
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    table = [0.1, 0.05, 0.025, 0.0125]
    op = optimize_loss(lambda: (w * w).sum() / 2, "SGD", None, var_list=[w],
                       learning_rate_decay_fn=lambda k: table[int(k)])
    for _ in range(2):
        op()
    before = w.detach().clone()
    op.global_step.fill_(10)
    for _ in range(3):
        with pytest.raises(IndexError):
            op()
        assert torch.equal(w.detach(), before) and int(op.global_step) == 10
    op.global_step.fill_(3)  # a count the schedule answers: the next update takes its rate
    assert float(op().lr) == pytest.approx(0.0125) and int(op.global_step) == 4


def test_a_train_op_state_without_a_recorded_count_version_keeps_counting_on_the_host():
    """A train op pickled by an earlier optkit has no record of its count's version: it goes on with the
    host count it had, so its learning rates are those of the uninterrupted run, bit for bit."""
    def build():
        w = torch.nn.Parameter(torch.ones(3))
        return w, optimize_loss(lambda: (w * w).sum(), "SGD", None, var_list=[w],
                                learning_rate_decay_fn=lambda k: 0.1 / (1 + 0.5 * k))

    w_ref, ref = build()
    lrs_ref = [float(ref().lr) for _ in range(6)]
    w, op = build()
    lrs = [float(op().lr) for _ in range(3)]
    state = op.__getstate__()
    del state["_step_seen"]  # as an earlier optkit's pickle
    op2 = type(op).__new__(type(op))
    op2.__setstate__(state)
    lrs += [float(op2().lr) for _ in range(3)]
    assert lrs == lrs_ref and op2._host_exact


def test_a_bad_first_return_value_does_not_fix_the_token_weighted_mode():
    """A first call whose loss returned a tuple of 3 raised, but had already switched the op to token
    weighting, so every later scalar return raised too."""
    w = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    calls = [0]

    def loss():
        calls[0] += 1
        value = (w * w).sum()
        return (value, 4, 1) if calls[0] == 1 else value

    op = optimize_loss(loss, "SGD", None, var_list=[w], learning_rate_decay_fn=0.1)
    with pytest.raises(ValueError, match="tuple of 3"):
        op()
    op()  # a scalar loss: plain averaging
    np.testing.assert_allclose(w.detach().numpy(), [0.8, 0.8], rtol=1e-15)


def test_scaler_params_and_a_negative_initial_tensor_lr_are_refused():
    w = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(TypeError, match="loss_scaling_params"):
        optimize_loss(lambda: w.sum(), "SGD", None, var_list=[w], learning_rate_decay_fn=0.1,
                      loss_scaling="Backoff", loss_scaling_params=[("scale_min", 2.0)])
    with pytest.raises(ValueError, match="learning_rate_decay_fn.*-0.5"):
        optimize_loss(lambda: w.sum(), "SGD", None, var_list=[w],
                      learning_rate_decay_fn=lambda k: torch.tensor(-0.5))


class _LinearLoss(torch.nn.Module):
    """A module loss (module level, so a train op over it pickles)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 2).double()

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.lin(x), y)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_train_op_continues_like_the_original(how):
    """A deep-copied or unpickled train op (clipping and a skipping scaler: the paths that read the pipeline
    group setting) continues bit for bit like the original, which it shares nothing with."""
    import pickle

    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(8, 4, generator=g, dtype=F64), torch.randint(0, 2, (8,), generator=g))
               for _ in range(4)]
    op = optimize_loss(_LinearLoss(), "SGD", {"momentum": 0.9}, 0.1, clip_gradients=0.5,
                       loss_scaling="Backoff", iter_size=2)
    for b in batches[:3]:
        op(*b)
    twin = copy.deepcopy(op) if how == "deepcopy" else pickle.loads(pickle.dumps(op))
    for b in batches[3:]:
        op(*b)
        twin(*b)
    assert int(twin.global_step) == int(op.global_step) == 2
    for a, b in zip(op.masters, twin.masters):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()


@pytest.mark.parametrize("clip", ["clip_gradients", "global_clipnorm", "clipnorm"])
def test_a_scale_too_large_for_a_float32_norm_backs_off(clip):
    """``optimize_loss`` with a dynamic scale so large that ``‖Σ grads‖`` overflows float32 (finite elements):
    the update is skipped and the scale backs off (the clip would have been a zero update, or NaN for the
    optimizer's own ``global_clipnorm``, applied), then the updates apply exactly; the train op's clip or
    the optimizer's."""
    rng = np.random.default_rng(6)
    w0 = rng.standard_normal(64).astype(np.float32)
    g = rng.standard_normal(64).astype(np.float32)
    w = torch.nn.Parameter(torch.tensor(w0))
    gt = torch.tensor(g)
    own = {clip: 1.0} if clip != "clip_gradients" else None
    op = optimize_loss(lambda: (w * gt).sum(), "SGD", own, 0.1, var_list=[w],
                       clip_gradients=1.0 if clip == "clip_gradients" else None, loss_scaling="dynamic",
                       loss_scaling_params={"initial_loss_scale": 2.0 ** 70, "increment_period": 1000})
    applied = [bool(op().applied) for _ in range(12)]
    backoffs = applied.index(True)
    assert 5 <= backoffs <= 10 and all(applied[backoffs:])
    clipped = g.astype(np.float64) * min(1.0, 1.0 / np.linalg.norm(g.astype(np.float64)))
    np.testing.assert_allclose(w.detach().numpy(), w0 - 0.1 * (12 - backoffs) * clipped, rtol=1e-5, atol=1e-6)


def test_a_fixed_skipping_scale_without_a_clip_applies_huge_finite_gradients():
    """The "scale too large for a float32 norm" overflow needs a clip that uses the norm and a scaler that
    can back off: a fixed scale (which cannot) without a clip applies a huge finite gradient as plain SGD."""
    from optkit.loss_scale import FixedLossScale

    w = torch.nn.Parameter(torch.ones(4))
    op = optimize_loss(lambda: (w * 1e14).sum(), "SGD", None, 1e-15, var_list=[w],
                       loss_scaling=FixedLossScale(2.0 ** 20, skip_non_finite=True))
    for _ in range(3):
        assert bool(op().applied)
    np.testing.assert_allclose(w.detach().numpy(), 1.0 - 3 * 0.1, rtol=1e-6)
