"""Reference tests ported from OpenSeq2Seq's optimizer package.

Upstream files (repository ``NVIDIA/OpenSeq2Seq``):

* ``open_seq2seq/optimizers/optimizers_test.py`` (``IterSizeTests.test_updates``)
  -> :func:`optkit.optimize_loss`
* ``open_seq2seq/optimizers/mp_wrapper_test.py`` (regularization in fp32/fp16/mixed, convergence)
  -> :class:`optkit.MixedPrecisionOptimizerWrapper`, :func:`optkit.optimize_loss`, the regularizer registry

The package has no tests of its own for ``lr_policies.py``, ``automatic_loss_scaler.py`` or the LARC and
clipping code in ``optimizers.py``; for those, the hand vectors of ``shared/spec/openseq2seq.md`` (§1.3, §4,
§6.2, §6.3, §7, all recomputed there in NumPy) stand in for an upstream suite, next to float64 NumPy
implementations of the spec formulas. Deliberate differences follow ``docs/compatibility.md`` (rows
"optimize_loss: iter_size", "lr policies: inv_poly_decay", "loss scaling: LogMax …", "wrappers: LARC zero
learning rate", "clipping: OpenSeq2Seq …").
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import optkit
from optkit import (
    BackoffScaler,
    LogMaxScaler,
    cosine_decay,
    exp_decay,
    fixed_lr,
    inv_poly_decay,
    optimize_loss,
    piecewise_constant,
    poly_decay,
    transformer_policy,
)
from optkit.regularization import add_regularizer, clear_regularizers, get_regularization_loss, l2_regularizer

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")

F16, F32, F64 = torch.float16, torch.float32, torch.float64


@pytest.fixture(autouse=True)
def _no_leftover_regularizers():
    clear_regularizers()
    yield
    clear_regularizers()


def close(t, expected, tol=1e-6, rtol=None):
    t = t.detach().to(F64).numpy() if isinstance(t, torch.Tensor) else np.asarray(t, dtype=np.float64)
    np.testing.assert_allclose(t, np.asarray(expected, dtype=np.float64), rtol=tol if rtol is None else rtol,
                               atol=tol)


# ============================================================================================================
# optimizers_test.py: IterSizeTests.test_updates


def test_iter_size_updates():
    """optimizers_test.py: IterSizeTests.test_updates (numpy seed 0, X 10×10, y 10×1, bias-free dense layer,
    mse, "SGD" with fixed_lr 0.1, iter_size 8; three cycles of three accumulation runs and one update).

    Upstream the accumulator holds k·g/8 and the update is w − 0.1·4g/8. optkit sums the micro-batch
    gradients in ``.grad`` (k·g) and updates with their exact mean, w − 0.1·g, and needs no Horovod
    (compatibility.md, row "optimize_loss: iter_size")."""
    rs = np.random.RandomState(0)
    X, y = rs.rand(10, 10), rs.rand(10, 1)
    w0 = np.random.default_rng(1).uniform(-0.5, 0.5, (10, 1))
    w = torch.nn.Parameter(torch.tensor(w0))
    Xt, yt = torch.tensor(X), torch.tensor(y)
    skip = iter([True, True, True, False] * 3)
    op = optimize_loss(lambda: torch.mean((yt - Xt @ w) ** 2), "SGD", {}, lambda gs: fixed_lr(gs, 0.1),
                       var_list=[w], iter_size=8, skip_update_ph=lambda: next(skip))
    wn = w0.copy()
    for _ in range(3):
        assert w.grad is None
        true_g = 2 * (X.T @ X @ wn - X.T @ y) / X.shape[0]
        before = w.detach().clone()
        for k in range(1, 4):
            r = op()
            assert not bool(r.applied)
            close(w.grad, true_g * k, tol=1e-12)
            assert torch.equal(w.detach(), before)
        r = op()
        assert bool(r.applied)
        wn = wn - 0.1 * true_g
        close(w, wn, tol=1e-12)
    assert int(op.global_step) == 3


def test_iter_size_hand_vector():
    """openseq2seq.md §8.1 hand vector: X = [[1,2],[3,4]], y = [[1],[2]], w = 0, iter_size 8, three skips
    then an update. Upstream: w = [0.35, 0.5]; optkit (exact mean of the four micro-batches):
    w = [0.7, 1.0]."""
    X, y = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=F64), torch.tensor([[1.0], [2.0]], dtype=F64)
    w = torch.nn.Parameter(torch.zeros(2, 1, dtype=F64))
    flags = iter([True, True, True, False])
    op = optimize_loss(lambda: torch.mean((X @ w - y) ** 2), "SGD", None, 0.1, var_list=[w], iter_size=8,
                       skip_update_ph=lambda: next(flags))
    for k in range(1, 4):
        op()
        close(w.grad, [[-7.0 * k], [-10.0 * k]], tol=1e-12)
    op()
    close(w, [[0.7], [1.0]], tol=1e-12)


# ============================================================================================================
# mp_wrapper_test.py


def _regularized_dense(dtype):
    """mp_wrapper_test.py set-up: 3 samples, 2 features, X = 1/2, y = 1e-4, kernel initialised to 1e-4 (the
    data residual is 0), l2_regularizer(1e-4)."""
    X = torch.full((3, 2), 0.5, dtype=dtype)
    y = torch.full((3, 1), 1e-4, dtype=dtype)
    w = torch.nn.Parameter(torch.full((2, 1), 1e-4, dtype=dtype))
    add_regularizer(w, l2_regularizer(1e-4), name="dense/kernel")
    return X, y, w


@pytest.mark.parametrize("dtype", [F16, F32])
def test_regularization_normal(dtype):
    """mp_wrapper_test.py: test_regularization_normal (fp32: regularization loss 1e-12 and gradient 1e-8;
    fp16: both underflow to 0). The summed loss is fp32 whatever the parameter dtype (openseq2seq.md §2)."""
    X, y, w = _regularized_dense(dtype)
    reg = get_regularization_loss()
    assert reg.dtype == F32
    loss = torch.mean(((y - X @ w) ** 2).float()) + reg
    (g,) = torch.autograd.grad(loss, [w])
    if dtype == F16:
        assert float(reg.detach()) == 0.0
        assert torch.equal(g, torch.zeros(2, 1, dtype=F16))
    else:
        close(reg, 1e-12, tol=0, rtol=1e-6)
        close(g, np.ones((2, 1)) * 1e-8, tol=0, rtol=1e-5)


def test_regularization_mixed():
    """mp_wrapper_test.py: test_regularization_mixed (fp16 model, the L2 regularizer applied on the fp32
    master: master gradient 1e-8 within 1e-11, and no regularization term in the loss). optkit spells the
    diverted regularizer ``l2_regularization=λ`` (compatibility.md, row "wrappers:
    MixedPrecisionOptimizerWrapper regularization"); the default loss scale is 1."""
    X = torch.full((3, 2), 0.5, dtype=F16)
    y = torch.full((3, 1), 1e-4, dtype=F16)
    w = torch.nn.Parameter(torch.full((2, 1), 1e-4, dtype=F16))
    opt = optkit.MixedPrecisionOptimizerWrapper(optkit.Adam([w]), l2_regularization=1e-4)
    assert float(opt.loss_scale) == 1.0
    assert float(get_regularization_loss()) == 0.0
    ((g, master),) = opt.compute_gradients(lambda: torch.mean(((y - X @ w) ** 2).float()))
    assert master.dtype == F32 and master is opt.master_of(w)
    close(master, [[1.0001659e-4]] * 2, tol=0, rtol=1e-7)  # fp32 master of fp16(1e-4)
    close(g, np.ones((2, 1)) * 1e-8, tol=1e-11)


@pytest.mark.parametrize("dtype", ["mixed", F32])
def test_convergence(dtype):
    """mp_wrapper_test.py: test_convergence (numpy seed 0, linear least squares 10×10, "Adam" with lr 0.05:
    within 6000 updates, 'mixed' and float32 both reach the closed-form solution within atol 0.01). The run
    stops early once it is there (checked every 200 updates) to keep the suite fast."""
    rs = np.random.RandomState(0)
    X, y = rs.rand(10, 10), rs.rand(10, 1)
    w_star = np.linalg.solve(X.T @ X, X.T @ y)
    pdt = F16 if dtype == "mixed" else F32
    w = torch.nn.Parameter(torch.tensor(np.random.default_rng(0).uniform(-0.5, 0.5, (10, 1)), dtype=pdt))
    Xt, yt = torch.tensor(X, dtype=pdt), torch.tensor(y, dtype=pdt)
    op = optimize_loss(lambda: torch.mean(((yt - Xt @ w) ** 2).float()), "Adam", {}, 0.05, var_list=[w],
                       dtype=dtype)
    for k in range(1, 6001):
        op()
        if k % 200 == 0 and np.abs(op.masters[0].detach().double().numpy() - w_star).max() < 0.01:
            break
    close(op.masters[0], w_star, tol=0.01)
    if dtype == "mixed":
        assert w.dtype == F16 and op.masters[0].dtype == F32


# ============================================================================================================
# optimizers.py without an upstream test: clipping (§1.3), LARC (§4), validation (§3.3)


def test_clip_gradients_by_norm_vectors():
    """openseq2seq.md §1.3: grads {[3, 4], [12]} (N = 13): clip 6.5 halves them, clip 20 leaves them, all-zero
    gradients stay; each clipped gradient is cast to its variable's dtype; a scalar stays 0-d
    (compatibility.md, row "clipping: OpenSeq2Seq clip scale shape")."""
    v1, v2 = torch.zeros(2, dtype=F16), torch.zeros((), dtype=F32)
    pairs = [(torch.tensor([3.0, 4.0], dtype=F64), v1), (torch.tensor(12.0, dtype=F64), v2)]
    (g1, a), (g2, b) = optkit.clip_gradients_by_norm(pairs, 6.5)
    assert a is v1 and b is v2 and g1.dtype == F16 and g2.dtype == F32 and g2.shape == ()
    close(g1, [1.5, 2.0])
    close(g2, 6.0)
    (g1, _), (g2, _) = optkit.clip_gradients_by_norm(pairs, 20.0)
    close(g1, [3.0, 4.0])
    close(g2, 12.0)
    ((gz, _),) = optkit.clip_gradients_by_norm([(torch.zeros(3), torch.zeros(3))], 1.0)
    assert torch.equal(gz, torch.zeros(3))
    out = optkit.clip_gradients_by_norm([(None, v1), (torch.tensor([3.0, 4.0]), torch.zeros(2))], 1.0)
    assert out[0][0] is None  # compatibility.md, row "clipping: None gradients"
    close(out[1][0], [0.6, 0.8])


def test_clip_gradients_by_norm_non_finite_norm():
    """openseq2seq.md §1.3 non-finite norms: the original zeroed finite gradients (N = inf); optkit follows
    TF ≥ 1.11 and makes every output NaN (compatibility.md, row "clipping: OpenSeq2Seq non-finite global
    norm")."""
    out = optkit.clip_gradients_by_norm([(torch.tensor([float("inf"), 1.0]), torch.zeros(2)),
                                         (torch.tensor([2.0]), torch.zeros(1))], 1.0)
    assert all(bool(torch.isnan(g).all()) for g, _ in out)


LARC_V = [3.0, 4.0]  # ‖v‖ = 5
LARC_G = [0.3, 0.4]  # ‖g‖ = 0.5


@pytest.mark.parametrize(
    "w0,g,eta,mode,ratio",
    [
        (LARC_V, LARC_G, 0.002, "clip", 0.01 / (0.1 * 0.5000001)),
        (LARC_V, LARC_G, 0.002, "scale", 0.01 / 0.5000001),
        (LARC_V, LARC_G, 0.1, "clip", 1.0),
        (LARC_V, LARC_G, 0.1, "scale", 0.5 / 0.5000001),
        ([0.0, 0.0], LARC_G, 0.002, "clip", 1e-7),
        (LARC_V, [0.0, 0.0], 0.002, "clip", 1.0),
    ],
    ids=["clip", "scale", "clip_capped", "scale_large_eta", "zero_weights", "zero_gradient"],
)
def test_larc_vectors(w0, g, eta, mode, ratio):
    """openseq2seq.md §4 vectors (v = [3, 4], g = [0.3, 0.4], lr 0.1, ε = min_update = 1e-7): the gradient
    reaching the optimizer is r·g. Checked through plain SGD (lr 0.1): w − 0.1·r·g."""
    w = torch.tensor(w0, dtype=F64, requires_grad=True)
    opt = optkit.LARC(optkit.SGD([w], learning_rate=0.1), larc_eta=eta, larc_mode=mode)
    w.grad = torch.tensor(g, dtype=F64)
    opt.step()
    close(opt.last_ratios, [ratio], tol=0, rtol=1e-7)
    close(w, np.array(w0) - 0.1 * ratio * np.array(g), tol=1e-12)


def test_larc_scale_mode_zero_gradient_ratio():
    """openseq2seq.md §4: with g = 0, scale mode gives r = η‖v‖/ε = 1e5 (multiplied by a zero gradient)."""
    w = torch.tensor(LARC_V, dtype=F64, requires_grad=True)
    opt = optkit.LARC(optkit.SGD([w], learning_rate=0.1), larc_eta=0.002, larc_mode="scale")
    w.grad = torch.zeros(2, dtype=F64)
    opt.step()
    close(opt.last_ratios, [1e5], tol=0, rtol=1e-9)
    close(w, LARC_V, tol=0)


def test_larc_zero_learning_rate_no_nan():
    """openseq2seq.md §4 / §9 #9: clip mode with lr = 0 and a zero-norm variable divided 0/0 upstream (NaN on
    CPU); optkit uses r = 1 (compatibility.md, row "wrappers: LARC zero learning rate")."""
    w = torch.zeros(2, requires_grad=True)
    opt = optkit.LARC(optkit.SGD([w], learning_rate=0.0), larc_eta=0.002)
    w.grad = torch.tensor(LARC_G)
    opt.step()
    assert float(opt.last_ratios[0]) == 1.0 and bool(torch.isfinite(w).all())


def test_larc_params_checked_strictly():
    """openseq2seq.md §0/§4 check_params: larc_eta is a required float (an int is rejected), larc_mode one of
    'clip'/'scale', unknown keys raise."""
    w = torch.zeros(2, requires_grad=True)
    sgd = optkit.SGD([w], learning_rate=0.1)
    with pytest.raises((TypeError, ValueError)):
        optkit.LARC(sgd, larc_eta=1)
    with pytest.raises(ValueError):
        optkit.LARC(sgd, larc_eta=0.1, larc_mode="bogus")
    with pytest.raises(ValueError):
        optkit.LARC.from_params(sgd, {"larc_eta": 0.1, "eta": 0.2})
    assert optkit.LARC.from_params(sgd, {"larc_eta": 0.001}).larc_mode == "clip"


def test_optimize_loss_argument_checks():
    """openseq2seq.md §3.3 A/E: an unknown summary name and an unknown optimizer name raise ValueError;
    clipping together with LARC raises ValueError (AttributeError upstream; compatibility.md, row
    "optimize_loss: clip + LARC")."""
    w = torch.nn.Parameter(torch.ones(2))
    loss = lambda: (w * w).sum()  # noqa: E731
    with pytest.raises(ValueError):
        optimize_loss(loss, "SGD", None, 0.1, var_list=[w], summaries=["bogus"])
    with pytest.raises(ValueError, match="Adadelta|Unknown"):
        optimize_loss(loss, "Adadelta", None, 0.1, var_list=[w])
    with pytest.raises(ValueError, match="LARC and gradient norm clipping"):
        optimize_loss(loss, "SGD", None, 0.1, var_list=[w], clip_gradients=1.0, larc_params={"larc_eta": 0.1})
    assert list(optkit.OPTIMIZER_CLS_NAMES)[:7] == ["SGD", "Momentum", "Adam", "AdamW", "Adagrad", "RMSProp",
                                                    "Ftrl"]


# ============================================================================================================
# automatic_loss_scaler.py (no upstream test): §6.1–§6.3


def test_check_grads():
    """openseq2seq.md §6.1 check_grads: has_nan and amax = max|g| over the non-None gradients (sparse: their
    values); overflow = has_nan or amax = inf."""
    has_nan, amax = optkit.AutomaticLossScaler.check_grads(
        [(torch.tensor([1.0, -3.0]), None), (None, None),
         (torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([2.5]), (4,)), None)])
    assert not bool(has_nan) and float(amax) == 3.0
    has_nan, amax = optkit.AutomaticLossScaler.check_grads([torch.tensor([1.0, float("nan")])])
    assert bool(has_nan)
    has_nan, amax = optkit.AutomaticLossScaler.check_grads([torch.tensor([1.0, -float("inf")])])
    assert not bool(has_nan) and float(amax) == float("inf")
    with pytest.raises(ValueError, match="Unknown scaling algorithm"):
        optkit.AutomaticLossScaler("Bogus")
    assert isinstance(optkit.AutomaticLossScaler(" LogMax ").scaler, LogMaxScaler)


def test_backoff_vector():
    """openseq2seq.md §6.2 vector (scale_min 1, scale_max 16, factor 2, window 3): overflow flags for i =
    0..18, the scale used in each step and the scale after it."""
    s = BackoffScaler({"scale_min": 1.0, "scale_max": 16.0, "step_factor": 2.0, "step_window": 3})
    flags = [0, 0, 0, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    used = [16, 16, 16, 16, 8, 8, 8, 16, 8, 4, 4, 4, 8, 8, 8, 16, 16, 16, 16]
    after = [16, 16, 16, 8, 8, 8, 16, 8, 4, 4, 4, 8, 8, 8, 16, 16, 16, 16, 16]
    for f, u, a in zip(flags, used, after):
        assert float(s()) == u
        applied = s.update(torch.tensor(float(f)))
        assert bool(applied) == (not f) and float(s()) == a
    assert int(s.iteration) == 19


def test_backoff_defaults():
    """openseq2seq.md §6.2 defaults: starts at 2^14; five overflows give 512; 1999 clean updates keep 512 and
    the 2000th doubles it; 20 overflows from the start reach the floor 1."""
    s = BackoffScaler()
    assert float(s()) == 2.0**14
    for _ in range(5):
        s.update(torch.tensor(1.0))
    assert float(s()) == 512.0
    for _ in range(1999):
        s.update(torch.tensor(0.0))
    assert float(s()) == 512.0
    s.update(torch.tensor(0.0))
    assert float(s()) == 1024.0
    s = BackoffScaler()
    with pytest.warns(optkit.LossScaleAtMinimumWarning):
        for _ in range(20):
            s.update(torch.tensor(1.0))
    assert float(s()) == 1.0


def logmax_numpy(amaxes, *, log_max=16.0, beta1=0.99, beta2=0.999, z=3.09, lo=1.0, hi=2.0**14):
    """openseq2seq.md §6.3 in float64, with optkit's overflow sample x = log_max (compatibility.md)."""
    x_hat = slow = sq = 0.0
    b1c = b2c = 1.0
    out = []
    for amax in amaxes:
        x = log_max if not math.isfinite(amax) else math.log2(amax)
        x_hat = beta1 * x_hat + (1 - beta1) * x
        b1c *= beta1
        mu = x_hat / (1 - b1c)
        slow = beta2 * slow + (1 - beta2) * x
        sq = beta2 * sq + (1 - beta2) * x * x
        b2c *= beta2
        sigma = math.sqrt(max(sq / (1 - b2c) - (slow / (1 - b2c)) ** 2, 0.0))
        out.append(min(max(2.0 ** (log_max - (mu + z * sigma)), lo), hi))
    return out


@pytest.mark.parametrize(
    "amaxes,expected",
    [([2.0**-10] * 3, [16384.0] * 3), ([16.0] * 3, [4096.0] * 3),
     ([1.0, 4.0, 0.25, 2.0], [16384.0, 3834.905, 1991.340, 2321.136])],
    ids=["small", "sixteen", "mixed"],
)
def test_logmax_vectors(amaxes, expected):
    """openseq2seq.md §6.3 vectors (fresh scaler, no overflow; float64 statistics, compatibility.md row
    "loss scaling: LogMax precision and start": optkit matches the float64 vectors to fp32 rounding)."""
    s = LogMaxScaler()
    assert float(s()) == 1.0
    ref = logmax_numpy(amaxes)
    for amax, exp, r in zip(amaxes, expected, ref):
        s.update(torch.tensor(0.0), torch.tensor(amax))
        close(s(), r, tol=0, rtol=1e-7)  # float64 reference, fp32 scale
        close(s(), exp, tol=5e-4, rtol=0)  # the spec prints three decimals


def test_logmax_overflow_recovers_quickly():
    """openseq2seq.md §9 #2: after 100 steady steps at amax 2^-4 and one overflow, the original sat at the
    floor for ~11.5k updates; optkit feeds x = log_max and is back at 2^14 within 18 updates
    (compatibility.md, row "loss scaling: LogMax overflow sample"); the float64 reference agrees."""
    s = LogMaxScaler()
    seq = [2.0**-4] * 100 + [float("inf")] + [2.0**-4] * 18
    for amax in seq:
        s.update(torch.tensor(0.0 if math.isfinite(amax) else 1.0), torch.tensor(amax))
    assert float(s()) == 2.0**14
    assert logmax_numpy(seq)[-1] == 2.0**14


def test_logmax_zero_amax_is_an_underflow_bound():
    """openseq2seq.md §6.3 edge case: amax = 0 made the original NaN forever; optkit reads it as "every scaled
    gradient underflowed" (compatibility.md, row "loss scaling: LogMax amax == 0"): the scale grows by
    2^(log_max − log_min) = 2^40, clipped to scale_max, and the statistics are untouched, so the next
    informative step gives what it would have given without the zero step."""
    s = LogMaxScaler()
    s.update(torch.tensor(0.0), torch.tensor(16.0))
    assert float(s()) == 4096.0
    s.update(torch.tensor(0.0), torch.tensor(0.0))
    assert float(s()) == 2.0**14
    s.update(torch.tensor(0.0), torch.tensor(16.0))
    t = LogMaxScaler()
    t.update(torch.tensor(0.0), torch.tensor(16.0))
    t.update(torch.tensor(0.0), torch.tensor(16.0))
    close(s(), float(t()), tol=0, rtol=1e-6)


# ============================================================================================================
# lr_policies.py (no upstream test): §7 vectors


def _check(policy, kwargs, table, rtol=1e-6):
    for step, expected in table:
        got = policy(step, **kwargs)
        assert isinstance(got, float)
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=0)
        t = policy(torch.tensor(step), **kwargs)
        assert isinstance(t, torch.Tensor) and t.shape == () and t.dtype == F32
        np.testing.assert_allclose(float(t), expected, rtol=max(rtol, 2e-7), atol=0)


def test_fixed_lr():
    """openseq2seq.md §7.1: 0.1 at steps 0, 1, 1e6."""
    _check(fixed_lr, {"learning_rate": 0.1}, [(0, 0.1), (1, 0.1), (1_000_000, 0.1)])


def test_piecewise_constant():
    """openseq2seq.md §7.2: epochs [30, 60, 80, 90] × 100 steps, rates [0.1, 0.01, 0.001, 1e-4] (boundaries
    inclusive on the left piece); steps [10, 20] with rates [0.5, 0.25] from 2.0; float boundaries raise."""
    _check(piecewise_constant, {"learning_rate": 0.1, "boundaries": [30, 60, 80, 90],
                                "decay_rates": [0.1, 0.01, 0.001, 1e-4], "steps_per_epoch": 100},
           [(0, 0.1), (3000, 0.1), (3001, 0.01), (6000, 0.01), (6001, 0.001), (8000, 0.001), (8001, 1e-4),
            (9000, 1e-4), (9001, 1e-5), (20000, 1e-5)])
    _check(piecewise_constant, {"learning_rate": 2.0, "boundaries": [10, 20], "decay_rates": [0.5, 0.25]},
           [(0, 2.0), (10, 2.0), (11, 1.0), (20, 1.0), (21, 0.5)])
    with pytest.raises(ValueError):
        piecewise_constant(0, 0.1, [1.5], [0.1])


def test_exp_decay():
    """openseq2seq.md §7.3: lr 1e-3, decay_steps 1000, rate 0.5, begin_decay_at 500, min_lr 1e-4, continuous
    and staircase; lr 0.1, decay_steps 100, rate 0.9."""
    base = {"learning_rate": 1e-3, "decay_steps": 1000, "decay_rate": 0.5, "begin_decay_at": 500,
            "min_lr": 1e-4}
    _check(exp_decay, {**base, "use_staircase_decay": False},
           [(0, 1e-3), (499, 1e-3), (500, 1e-3), (1000, 7.0710678e-4), (1500, 5e-4), (3000, 1.7677670e-4),
            (5000, 1e-4)])
    _check(exp_decay, {**base, "use_staircase_decay": True},
           [(999, 1e-3), (1000, 1e-3), (1499, 1e-3), (1500, 5e-4), (2500, 2.5e-4), (3000, 2.5e-4),
            (10000, 1e-4)])
    _check(exp_decay,
           {"learning_rate": 0.1, "decay_steps": 100, "decay_rate": 0.9, "use_staircase_decay": False},
           [(0, 0.1), (1, 0.099894695), (100, 0.09), (1000, 0.034867844)])


def test_poly_decay():
    """openseq2seq.md §7.4: no warmup; Model-injected warmup (bda 100, ds 900); explicit ds with warmup
    overlapping the decay."""
    _check(poly_decay, {"learning_rate": 0.01, "decay_steps": 1000, "power": 2, "min_lr": 1e-5},
           [(0, 0.01), (250, 0.005629375), (500, 0.0025075), (750, 0.000634375), (1000, 1e-5), (2000, 1e-5)])
    _check(poly_decay, {"learning_rate": 0.01, "decay_steps": 900, "power": 2, "min_lr": 1e-5,
                        "begin_decay_at": 100, "warmup_steps": 100},
           [(1, 1e-4), (50, 0.005), (99, 0.0099), (100, 0.01), (550, 0.0025075), (1000, 1e-5), (1200, 1e-5)])
    assert poly_decay(0, 0.01, 900, power=2, min_lr=1e-5, begin_decay_at=100, warmup_steps=100) == 0.0
    _check(poly_decay, {"learning_rate": 0.01, "decay_steps": 1000, "warmup_steps": 100},
           [(50, 0.00475), (99, 0.0089199), (100, 0.009), (500, 0.005)])
    assert poly_decay(1000, 0.01, 1000, warmup_steps=100) == 0.0


def test_cosine_decay():
    """openseq2seq.md §7.5: min_lr is the relative α; warmup with bda 100, ds 900."""
    _check(cosine_decay, {"learning_rate": 0.01, "decay_steps": 1000},
           [(0, 0.01), (250, 0.0085355339), (500, 0.005), (750, 0.0014644661)])
    assert cosine_decay(1000, 0.01, 1000) < 1e-18 and cosine_decay(1500, 0.01, 1000) < 1e-18
    _check(cosine_decay, {"learning_rate": 0.01, "decay_steps": 1000, "min_lr": 0.1},
           [(0, 0.01), (250, 0.0086819805), (500, 0.0055), (1000, 0.001)])
    _check(cosine_decay, {"learning_rate": 0.01, "decay_steps": 900, "begin_decay_at": 100,
                          "warmup_steps": 100},
           [(50, 0.005), (99, 0.0099), (100, 0.01), (550, 0.005)])


def test_transformer_policy():
    """openseq2seq.md §7.6 (note the +1 on the step)."""
    _check(transformer_policy, {"learning_rate": 2.0, "d_model": 512, "warmup_steps": 8000},
           [(0, 1.2352647e-7), (1, 2.4705294e-7), (999, 1.2352647e-4), (3999, 4.9410588e-4),
            (7999, 9.8821177e-4), (8000, 9.8815001e-4), (15999, 6.9877124e-4), (99999, 2.7950850e-4)])
    _check(transformer_policy, {"learning_rate": 9.0, "d_model": 1024, "warmup_steps": 4000, "max_lr": 1e-3},
           [(0, 1.1117382e-6), (100, 1.1228556e-4), (800, 8.9050233e-4), (900, 1e-3), (3999, 1e-3),
            (20000, 1e-3)])
    _check(transformer_policy, {"learning_rate": 1.0, "d_model": 512, "warmup_steps": 4000,
                                "coefficient": 0.002},
           [(0, 3.4938562e-10), (3999, 1.3975425e-6), (10000, 8.8383929e-7)])


def test_inv_poly_decay():
    """openseq2seq.md §7.7: up to decay_steps the original's vectors hold; after it the original kept falling
    (2000 → 2.7700831e-5, 3000 → 0.0035714286), optkit stays at min_lr (compatibility.md, row "lr policies:
    inv_poly_decay")."""
    _check(inv_poly_decay, {"learning_rate": 0.01, "decay_steps": 1000, "min_lr": 1e-4, "power": 2},
           [(0, 0.01), (100, 0.0027700831), (500, 3.3057851e-4), (1000, 1e-4), (2000, 1e-4)])
    _check(inv_poly_decay, {"learning_rate": 0.1, "decay_steps": 1000, "min_lr": 0.01, "power": 1},
           [(0, 0.1), (500, 0.018181818), (1000, 0.01), (3000, 0.01)])
    with pytest.raises(ValueError):
        inv_poly_decay(0, 0.1, 1000, 0.01, power=0)
    with pytest.raises(ValueError):
        inv_poly_decay(None, 0.1, 1000, 0.01)
