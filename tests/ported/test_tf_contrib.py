"""Reference tests ported from TensorFlow's ``tf.contrib.opt`` suites.

Upstream files (repository ``tensorflow/tensorflow``, last shipped in TF 1.15):

* ``tensorflow/contrib/opt/python/training/lars_optimizer_test.py``  -> :class:`optkit.LARS`
* ``tensorflow/contrib/opt/python/training/variable_clipping_optimizer_test.py``
  -> :class:`optkit.VariableClippingOptimizer`

The upstream LARS test pins the TF 1.11–1.14 rule (``variant="tf1.14"``); the TF 1.15 rule
(``variant="tf1.15"``, optkit's default) is checked against a float64 NumPy implementation written from
``shared/spec/tf_keras.md`` §1.1 and against the spec's worked examples L1–L8, which were run on the real
TF 1.14/1.15 sources. The variable-clipping vectors V1–V5 come from §2 of the same spec. Where optkit
deliberately differs (duplicate sparse indices, validation), the row of ``docs/compatibility.md`` is named.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import optkit

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")

F16, F32, F64 = torch.float16, torch.float32, torch.float64


TOL = {F16: 1e-3, F32: 1e-6, F64: 1e-6}


def var(values, dtype=F32):
    return torch.tensor(values, dtype=dtype, requires_grad=True)


def close(t, expected, dtype=F32, tol=None):
    tol = TOL[dtype] if tol is None else tol
    np.testing.assert_allclose(
        t.detach().to(F64).numpy(), np.asarray(expected, dtype=np.float64), rtol=tol, atol=tol)


def sparse_rows(values, indices, shape, dtype=F32):
    return torch.sparse_coo_tensor(torch.tensor([indices]), torch.tensor(values, dtype=dtype), tuple(shape))


# ============================================================================================================
# lars_optimizer_test.py


def lars_numpy(w, a, g, *, lr, m, wd, eeta, eps, variant, nesterov=False):
    """One LARS step in float64 (tf_keras.md §1.1: trust ratio; variant A = tf1.14, variant B = tf1.15)."""
    w_n, g_n = np.linalg.norm(w.ravel()), np.linalg.norm(g.ravel())
    trust = eeta * w_n / (g_n + wd * w_n + eps) if (w_n > 0 and g_n > 0) else 1.0
    s = lr * trust
    if variant == "tf1.14":
        a = m * a + g
        step = s * g + s * m * a if nesterov else s * a
    else:
        u = s * (g + wd * w)
        a = m * a + u
        step = u + m * a if nesterov else a
    return w - step, a


@pytest.mark.parametrize("variant", ["tf1.14", "tf1.15"])
@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("steps", [1, 10], ids=["OneStep", "MultiStep"])
def test_lars_gradient_steps(steps, dtype, variant):
    """lars_optimizer_test.py: testLARSGradientOneStep / testLARSGradientMultiStep (ones(3, 3) weights and
    gradients, lr 0.1, momentum 0.9, weight decay 0.1, epsilon 1e-5, eeta 0.1). The upstream file pins the
    tf1.14 rule; the tf1.15 run uses the same inputs against the spec's TF 1.15 rule."""
    w_np, a_np, g_np = np.ones((3, 3)), np.zeros((3, 3)), np.ones((3, 3))
    w = var(w_np.tolist(), dtype)
    opt = optkit.LARS([w], learning_rate=0.1, momentum=0.9, weight_decay=0.1, eeta=0.1, epsilon=1e-5,
                      variant=variant)
    close(opt.get_slot(w, "momentum"), a_np, dtype)
    for _ in range(steps):
        opt.apply_gradients([(torch.tensor(g_np, dtype=dtype), w)])
        w_np, a_np = lars_numpy(w_np, a_np, g_np, lr=0.1, m=0.9, wd=0.1, eeta=0.1, eps=1e-5, variant=variant)
        close(w, w_np, dtype, tol=1e-6 if dtype == F32 else 1e-12)
        close(opt.get_slot(w, "momentum"), a_np, dtype, tol=1e-6 if dtype == F32 else 1e-12)


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("variant", ["tf1.14", "tf1.15"])
def test_lars_random_float64_against_numpy(variant, nesterov):
    """lars_optimizer_test.py, generalised: seeded random weights/gradients of several shapes, five steps,
    both variants, float64 against the NumPy rule."""
    rng = np.random.default_rng(7)
    shapes = [(4, 3), (5,), (2, 3, 2)]
    ws = [rng.standard_normal(s) for s in shapes]
    ts = [var(w.tolist(), F64) for w in ws]
    accs = [np.zeros_like(w) for w in ws]
    opt = optkit.LARS(ts, learning_rate=0.3, momentum=0.8, weight_decay=0.01, eeta=0.05, epsilon=1e-6,
                      use_nesterov=nesterov, variant=variant)
    for _ in range(5):
        gs = [rng.standard_normal(s) for s in shapes]
        opt.apply_gradients([(torch.tensor(g), t) for g, t in zip(gs, ts)])
        for j in range(len(ws)):
            ws[j], accs[j] = lars_numpy(ws[j], accs[j], gs[j], lr=0.3, m=0.8, wd=0.01, eeta=0.05, eps=1e-6,
                                        variant=variant, nesterov=nesterov)
    for t, w, a in zip(ts, ws, accs):
        close(t, w, F64, tol=1e-12)
        close(opt.get_slot(t, "momentum"), a, F64, tol=1e-12)


# Worked examples of tf_keras.md §1.1 (w0=[3,4], lr 0.1, m 0.9, wd 0.1, eeta 0.1, eps 0; same g twice).
# Each entry: (case, variant, kwargs, g, w0, [(w, a) after step 1], [(w, a) after step 2] or None)
L_VECTORS = [
    ("L1", "tf1.14", {}, [0.3, 0.4], [3, 4], ([2.985, 3.98], [0.3, 0.4]),
     ([2.9565714, 3.9420952], [0.57, 0.76])),
    ("L1", "tf1.15", {}, [0.3, 0.4], [3, 4], ([2.97, 3.96], [0.03, 0.04]),
     ([2.9133, 3.8844], [0.0567, 0.0756])),
    ("L2", "tf1.14", {"use_nesterov": True}, [0.3, 0.4], [3, 4], ([2.9715, 3.962], None),
     ([2.931044, 3.9080587], [0.57, 0.76])),
    ("L2", "tf1.15", {"use_nesterov": True}, [0.3, 0.4], [3, 4], ([2.943, 3.924], None),
     ([2.862783, 3.817044], [0.05643, 0.07524])),
    ("L3", "tf1.14", {}, [0.4, -0.3], [3, 4], ([2.98, 4.015], [0.4, -0.3]),
     ([2.9419998, 4.0435002], [0.76, -0.57])),
    ("L3", "tf1.15", {}, [0.4, -0.3], [3, 4], ([2.965, 3.995], [0.035, 0.005]),
     ([2.8987621, 3.9855374], [0.0662379, 0.0094626])),
    ("L4", "tf1.14", {}, [0.0, 0.0], [3, 4], ([3.0, 4.0], [0.0, 0.0]), None),
    ("L4", "tf1.15", {}, [0.0, 0.0], [3, 4], ([2.97, 3.96], [0.03, 0.04]), None),
    ("L5", "tf1.14", {}, [0.3, 0.4], [0, 0], ([-0.03, -0.04], [0.3, 0.4]), None),
    ("L5", "tf1.15", {}, [0.3, 0.4], [0, 0], ([-0.03, -0.04], [0.03, 0.04]), None),
]


@pytest.mark.parametrize("case,variant,kw,g,w0,first,second", L_VECTORS,
                         ids=[f"{c[0]}-{c[1]}" for c in L_VECTORS])
def test_lars_spec_worked_examples(case, variant, kw, g, w0, first, second):
    """tf_keras.md §1.1 L1–L5 (run there on the TF 1.14/1.15 contrib sources): parallel and orthogonal
    gradients, Nesterov, the zero-gradient and zero-weight fallbacks (trust 1; TF 1.15 still applies the
    weight decay at full lr)."""
    w = var([float(x) for x in w0])
    opt = optkit.LARS([w], learning_rate=0.1, momentum=0.9, weight_decay=0.1, eeta=0.1, epsilon=0.0,
                      variant=variant, **kw)
    for expected in (first, second):
        if expected is None:
            break
        opt.apply_gradients([(torch.tensor(g), w)])
        close(w, expected[0], tol=2e-6)
        if expected[1] is not None:
            close(opt.get_slot(w, "momentum"), expected[1], tol=2e-6)


@pytest.mark.parametrize("variant,a1,a2", [("tf1.14", [0.3, 0.4], [0.57, 0.76]),
                                           ("tf1.15", [0.03, 0.04], [0.057, 0.076])])
def test_lars_skip_list_is_a_substring_match(variant, a1, a2):
    """tf_keras.md §1.1 L6: a variable whose name contains a skip_list entry gets the plain learning rate
    and no weight decay (``dense_bias`` with ``skip_list=['bias']``, two steps)."""
    w, other = var([3.0, 4.0]), var([3.0, 4.0])
    opt = optkit.LARS([("dense_bias", w), ("dense_kernel", other)], learning_rate=0.1, momentum=0.9,
                      weight_decay=0.1, eeta=0.1, skip_list=["bias"], variant=variant)
    g = torch.tensor([0.3, 0.4])
    opt.apply_gradients([(g.clone(), w), (g.clone(), other)])
    close(w, [2.97, 3.96])
    close(opt.get_slot(w, "momentum"), a1)
    opt.apply_gradients([(g.clone(), w), (g.clone(), other)])
    close(w, [2.913, 3.884])
    close(opt.get_slot(w, "momentum"), a2)
    assert not torch.allclose(other.detach(), w.detach())  # the kernel is LARS-scaled
    w2 = var([3.0, 4.0])
    opt2 = optkit.LARS([("dense_bias", w2)], learning_rate=0.1, momentum=0.9, weight_decay=0.1, eeta=0.1,
                       skip_list=["^dense_bias$"], variant=variant)
    opt2.apply_gradients([(g.clone(), w2)])
    close(w2, [2.985, 3.98] if variant == "tf1.14" else [2.97, 3.96])  # a regex is not a substring: trusted


@pytest.mark.parametrize("variant,w1,a1", [("tf1.14", [2.997003, 3.996004], [0.3, 0.4]),
                                           ("tf1.15", [2.997, 3.996], [0.003, 0.004])])
def test_lars_defaults(variant, w1, a1):
    """tf_keras.md §1.1 L7: all defaults (m 0.9, wd 1e-4, eeta 1e-3, eps 0), lr 1.0, trust 0.00999001."""
    w = var([3.0, 4.0])
    opt = optkit.LARS([w], learning_rate=1.0, variant=variant)
    opt.apply_gradients([(torch.tensor([0.3, 0.4]), w)])
    close(w, w1)
    close(opt.get_slot(w, "momentum"), a1)


@pytest.mark.parametrize("variant", ["tf1.14", "tf1.15"])
def test_lars_sparse_duplicates_plain_momentum(variant):
    """tf_keras.md §1.1 L8: IndexedSlices values [[1,1],[2,2]] at indices [0, 0] are de-duplicated (sum 3),
    updated with plain momentum and the base lr (no trust ratio, no decay), other rows untouched; two
    steps give row 0 = 0.13 and accumulator 5.7 in both variants (compatibility.md, row "LARS: sparse
    gradients")."""
    w = var([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    opt = optkit.LARS([w], learning_rate=0.1, momentum=0.9, weight_decay=0.1, eeta=0.1, variant=variant)
    for _ in range(2):
        opt.apply_gradients([(sparse_rows([[1.0, 1.0], [2.0, 2.0]], [0, 0], [3, 2]), w)])
    close(w, [[0.13, 0.13], [2.0, 2.0], [3.0, 3.0]])
    close(opt.get_slot(w, "momentum"), [[5.7, 5.7], [0.0, 0.0], [0.0, 0.0]])


@pytest.mark.parametrize("variant", ["tf1.14", "tf1.15"])
def test_lars_non_finite_gradient_is_not_guarded(variant):
    """tf_keras.md §1.1 edge cases: g = [inf, 0.4] makes the trust ratio 0 (‖g‖ = inf), so the inf element
    becomes NaN and, for TF 1.15, the finite element gets u = 0 (TF 1.14: 0·accumulated g)."""
    w = var([3.0, 4.0])
    opt = optkit.LARS([w], learning_rate=0.1, momentum=0.9, weight_decay=0.1, eeta=0.1, variant=variant)
    opt.apply_gradients([(torch.tensor([float("inf"), 0.4]), w)])
    assert torch.isnan(w.detach()[0]) and float(w.detach()[1]) == 4.0


@pytest.mark.parametrize("variant,slot", [("tf1.14", [0.3, 0.4]), ("tf1.15", [0.03, 0.04])])
def test_lars_momentum_zero_keeps_last_step_in_slot(variant, slot):
    """compatibility.md, row "LARS: momentum=0 slot": with momentum 0 the slot holds this step's u (TF 1.15)
    or g (TF 1.14), as ApplyMomentum stores it; trust 0.5 as in L1."""
    w = var([3.0, 4.0])
    opt = optkit.LARS([w], learning_rate=0.1, momentum=0.0, weight_decay=0.1, eeta=0.1, variant=variant)
    opt.apply_gradients([(torch.tensor([0.3, 0.4]), w)])
    close(opt.get_slot(w, "momentum"), slot)
    close(w, [2.985, 3.98] if variant == "tf1.14" else [2.97, 3.96])


def test_lars_callable_learning_rate_works():
    """compatibility.md, row "LARS: options beyond TF1": TF's dense path fails on a callable learning rate;
    optkit calls it (here, L1's first step with lr = lambda: 0.1)."""
    w = var([3.0, 4.0])
    opt = optkit.LARS([w], learning_rate=lambda: 0.1, momentum=0.9, weight_decay=0.1, eeta=0.1)
    opt.apply_gradients([(torch.tensor([0.3, 0.4]), w)])
    close(w, [2.97, 3.96])


def test_lars_argument_checks():
    """tf_keras.md §1.1 constructor: negative momentum / weight_decay raise ValueError with TF's wording;
    optkit also rejects negative eeta/epsilon (compatibility.md, row "LARS: eeta, epsilon") and unknown
    keywords (row "optimizer keyword arguments")."""
    w = var([1.0])
    with pytest.raises(ValueError, match="momentum should be positive"):
        optkit.LARS([w], learning_rate=0.1, momentum=-0.1)
    with pytest.raises(ValueError, match="weight_decay should be positive"):
        optkit.LARS([w], learning_rate=0.1, weight_decay=-1e-4)
    optkit.LARS([w], learning_rate=0.1, momentum=0.0, weight_decay=0.0)  # zero is allowed
    for kw in ({"eeta": -0.001}, {"epsilon": -1.0}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            optkit.LARS([w], learning_rate=0.1, **kw)
    with pytest.raises(ValueError, match="eta"):
        optkit.LARS([w], learning_rate=0.1, eta=0.01)
    with pytest.raises(TypeError):
        optkit.LARS([w])  # learning_rate is required
    assert optkit.LARS([w], learning_rate=0.1).get_slot_names() == ["momentum"]


# ============================================================================================================
# variable_clipping_optimizer_test.py


def _dense_setup(dtype):
    v0 = var([[0.0, 1.0], [2.0, 3.0]], dtype)
    v1 = var([4.0, 5.0], dtype)
    opt = optkit.VariableClippingOptimizer(optkit.SGD([v0, v1], learning_rate=3.0), {v0: [1]}, 2.0)
    return v0, v1, opt


@pytest.mark.parametrize("dtype", [F32, F64, F16])
def test_variable_clipping_dense(dtype):
    """variable_clipping_optimizer_test.py: testDenseLocal (GradientDescent 3.0, var0 rows clipped to norm 2;
    var1 not listed). Numbers also in tf_keras.md §2 V1."""
    v0, v1, opt = _dense_setup(dtype)
    close(v0, [[0.0, 1.0], [2.0, 3.0]], dtype)
    opt.apply_gradients([(torch.full((2, 2), 0.1, dtype=dtype), v0),
                         (torch.full((2,), 0.01, dtype=dtype), v1)])
    close(v0[0], [0.0 - 0.3, 1.0 - 0.3], dtype)  # norm < 2: not clipped
    unclipped = np.array([2.0 - 0.3, 3.0 - 0.3])
    close(v0[1], 2.0 * unclipped / np.linalg.norm(unclipped), dtype)
    close(v1, [4.0 - 0.03, 5.0 - 0.03], dtype)
    close(v0, [[-0.3, 0.7], [1.0656265, 1.6924657]], dtype, tol=1e-3 if dtype == F16 else 1e-6)


def _sparse_setup(dtype):
    v0 = var([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]], dtype)
    v1 = var([[0.0, 1.0], [0.0, 3.0], [0.0, 5.0]], dtype)
    opt = optkit.VariableClippingOptimizer(optkit.SGD([v0, v1], learning_rate=3.0), {v0: [1], v1: [0]}, 2.0)
    return v0, v1, opt


@pytest.mark.parametrize("dtype", [F64, F32, F16])
def test_variable_clipping_sparse(dtype):
    """variable_clipping_optimizer_test.py: testSparseLocal (IndexedSlices rows [0, 2]; var0 clipped per
    touched row; var1 clipped along the sparse dimension 0, the dense fallback with a warning — optkit warns
    once per wrapper, compatibility.md row "dense-fallback warning"). V2/V3 of tf_keras.md §2."""
    v0, v1, opt = _sparse_setup(dtype)
    g = [[0.1, 0.1], [0.1, 0.1]]
    with pytest.warns(UserWarning, match="dense"):
        opt.apply_gradients([(sparse_rows(g, [0, 2], [3, 2], dtype), v0),
                             (sparse_rows(g, [0, 2], [3, 2], dtype), v1)])
    out1 = v1.detach().to(F64).numpy()
    close(torch.tensor(out1[:, 0]), [-0.3, 0.0, -0.3], dtype)  # column norm < 2: not clipped
    unclipped = np.array([1.0 - 0.3, 3.0, 5.0 - 0.3])
    close(torch.tensor(out1[:, 1]), 2.0 * unclipped / np.linalg.norm(unclipped), dtype)
    close(v0[0], [-0.3, 0.7], dtype)
    close(v0[1], [2.0, 3.0], dtype)  # no gradient: unchanged even though its norm exceeds 2
    unclipped = np.array([4.0 - 0.3, 5.0 - 0.3])
    close(v0[2], 2.0 * unclipped / np.linalg.norm(unclipped), dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # only one warning per wrapper
        opt.apply_gradients([(sparse_rows(g, [0, 2], [3, 2], dtype), v1)])


def test_variable_clipping_spec_vectors_v3_v5():
    """tf_keras.md §2 V3 (dims [0], dense fallback) and V5 (dims [0, 1]: the whole matrix scaled to
    norm 2)."""
    g = [[0.1, 0.1], [0.1, 0.1]]
    v1 = var([[0.0, 1.0], [0.0, 3.0], [0.0, 5.0]])
    opt = optkit.VariableClippingOptimizer(optkit.SGD([v1], learning_rate=3.0), {v1: [0]}, 2.0)
    with pytest.warns(UserWarning):
        opt.apply_gradients([(sparse_rows(g, [0, 2], [3, 2]), v1)])
    close(v1, [[-0.3, 0.2491277], [0.0, 1.0676900], [-0.3, 1.6727142]])
    v0 = var([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]])
    opt = optkit.VariableClippingOptimizer(optkit.SGD([v0], learning_rate=3.0), {v0: [0, 1]}, 2.0)
    with pytest.warns(UserWarning):
        opt.apply_gradients([(sparse_rows(g, [0, 2], [3, 2]), v0)])
    close(v0, [[-0.0854011, 0.1992694], [0.5693409, 0.8540115], [1.0532806, 1.3379512]])


def test_variable_clipping_duplicate_sparse_indices_clip_each_row_once():
    """tf_keras.md §2 V4: indices [2, 2] on var0 (dims [1]). TF subtracted the clip delta once per duplicate
    ([−0.9542098, −1.2348599]); optkit clips each touched row once (compatibility.md, row "wrappers:
    VariableClippingOptimizer duplicate sparse indices"): row 2 = 2·[3.4, 4.4]/‖[3.4, 4.4]‖."""
    v0 = var([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]])
    opt = optkit.VariableClippingOptimizer(optkit.SGD([v0], learning_rate=3.0), {v0: [1]}, 2.0)
    opt.apply_gradients([(sparse_rows([[0.1, 0.1], [0.1, 0.1]], [2, 2], [3, 2]), v0)])
    row = np.array([3.4, 4.4])
    close(v0[2], 2.0 * row / np.linalg.norm(row))
    close(v0[2], [1.2229, 1.5826], tol=1e-4)
    close(v0[:2], [[0.0, 1.0], [2.0, 3.0]])


def test_variable_clipping_chained_wrappers_clip_inner_first():
    """tf_keras.md §2 "Chaining": an outer VariableClippingOptimizer runs its clip after the inner wrapper's
    update and clip, so a variable listed in both is clipped twice in sequence."""
    v = var([[3.0, 4.0], [0.3, 0.4]])
    inner = optkit.VariableClippingOptimizer(optkit.SGD([v], learning_rate=1.0), {v: [1]}, 2.0)
    outer = optkit.VariableClippingOptimizer(inner, {v: [0, 1]}, 1.0)
    outer.apply_gradients([(torch.zeros(2, 2), v)])
    after_inner = np.array([[1.2, 1.6], [0.3, 0.4]])
    close(v, after_inner / np.linalg.norm(after_inner))


def test_variable_clipping_listed_variable_without_gradient_is_not_clipped():
    """tf_keras.md §2: a listed variable whose gradient is None this step is left alone."""
    v0, v1 = var([[3.0, 4.0]]), var([1.0])
    opt = optkit.VariableClippingOptimizer(optkit.SGD([v0, v1], learning_rate=1.0), {v0: [1]}, 2.0)
    opt.apply_gradients([(None, v0), (torch.tensor([0.5]), v1)])
    close(v0, [[3.0, 4.0]])
    close(v1, [0.5])


def test_variable_clipping_skipped_step_clips_nothing():
    """compatibility.md, row "wrappers: VariableClippingOptimizer on a skipped step": under a dynamic loss
    scale an overflowing step changes nothing, the clip included."""
    v = var([[3.0, 4.0]])
    opt = optkit.LossScaleOptimizer(
        optkit.VariableClippingOptimizer(optkit.SGD([v], learning_rate=1.0), {v: [1]}, 2.0),
        optkit.DynamicLossScale(initial_loss_scale=4.0))
    v.grad = torch.tensor([[float("inf"), 0.0]])
    opt.grads_scaled = True  # hand-set gradients that carry the scale, as after scale_loss(loss).backward()
    opt.step()
    assert not bool(opt.step_applied)
    close(v, [[3.0, 4.0]])
    v.grad = torch.zeros(1, 2)
    opt.grads_scaled = True
    opt.step()
    close(v, [[1.2, 1.6]])


def test_variable_clipping_delegates_tf_surface():
    """tf_keras.md §2: compute_gradients, get_slot and get_slot_names are the inner optimizer's; minimize
    = the wrapper's apply_gradients of the inner compute_gradients."""
    v = var([[0.0, 1.0], [2.0, 3.0]])
    inner = optkit.SGD([v], learning_rate=3.0, momentum=0.5)
    opt = optkit.VariableClippingOptimizer(inner, {v: [1]}, 2.0)
    assert opt.get_slot_names() == ["momentum"]
    assert opt.get_slot(v, "momentum") is inner.get_slot(v, "momentum")
    opt.minimize(lambda: 0.1 * v.sum())
    unclipped = np.array([2.0 - 0.3, 3.0 - 0.3])
    close(v, [[-0.3, 0.7], (2.0 * unclipped / np.linalg.norm(unclipped)).tolist()])


def test_variable_clipping_argument_checks():
    """compatibility.md, row "wrappers: VariableClippingOptimizer validation": TF accepted anything; optkit
    raises for max_norm <= 0, dims out of range, repeated or empty, and keys the optimizer does not train."""
    v, stranger = var([[1.0, 2.0]]), var([1.0])
    sgd = optkit.SGD([v], learning_rate=1.0)
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="max_norm"):
            optkit.VariableClippingOptimizer(sgd, {v: [1]}, bad)
    for dims in ([2], [1, 1], []):
        with pytest.raises(ValueError):
            optkit.VariableClippingOptimizer(sgd, {v: dims}, 1.0)
    with pytest.raises(ValueError):
        optkit.VariableClippingOptimizer(sgd, {stranger: [0]}, 1.0)
    with pytest.raises(TypeError):
        optkit.VariableClippingOptimizer(sgd, {v: [1.0]}, 1.0)
    table = {v: [1]}
    opt = optkit.VariableClippingOptimizer(sgd, table, 1.0)
    table[v].append(0)  # a defensive copy is kept
    assert opt.vars_to_clip_dims[v] == [1]
