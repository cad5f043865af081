"""Reference tests ported from TensorFlow 1.x's own optimizer suites.

Upstream files (repository ``tensorflow/tensorflow``):

* ``tensorflow/python/training/momentum_test.py``          -> :class:`optkit.Momentum`
* ``tensorflow/python/training/adagrad_test.py``           -> :class:`optkit.Adagrad`
* ``tensorflow/python/training/adam_test.py``              -> :class:`optkit.Adam`
* ``tensorflow/python/training/rmsprop_test.py``           -> :class:`optkit.RMSProp`
* ``tensorflow/python/training/ftrl_test.py``              -> :class:`optkit.Ftrl`
* ``tensorflow/python/training/gradient_descent_test.py``  -> :class:`optkit.SGD` (registry name ``"SGD"``)

The numbers (initial values, gradients, hyperparameters, expected results) are TF's; the code is new.
Where optkit deliberately differs, the test encodes optkit's documented behaviour and names the row of
``docs/compatibility.md``:

* Adam / AdamW: ε is added to the bias-corrected √v̂ (row "registry: Adam"); references below use that form,
  and one test shows how far TF's printed rule is from it for the upstream vectors.
* SGD: optkit's SGD is the Keras form (row "registry: SGD"); with momentum 0 it is TF's GradientDescent.

``IndexedSlices`` gradients become sparse COO tensors.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import optkit

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")

F16, F32, F64 = torch.float16, torch.float32, torch.float64


# TF's assertAllCloseAccordingToType tolerances
TOL = {F16: 1e-3, torch.bfloat16: 1e-2, F32: 1e-6, F64: 1e-6}


def var(values, dtype=F32):
    return torch.tensor(values, dtype=dtype, requires_grad=True)


def const(values, dtype=F32):
    return torch.tensor(values, dtype=dtype)


def sparse(values, indices, shape, dtype=F32):
    """A COO gradient standing in for ``IndexedSlices(values, indices, dense_shape)`` (first-dim rows)."""
    return torch.sparse_coo_tensor(torch.tensor([indices]), torch.tensor(values, dtype=dtype), tuple(shape))


def close(t, expected, dtype=F32, tol=None):
    tol = TOL[dtype] if tol is None else tol
    np.testing.assert_allclose(
        t.detach().to(F64).numpy(), np.asarray(expected, dtype=np.float64), rtol=tol, atol=tol)


def step_with(opt, pairs):
    """Set ``.grad`` from ``(grad, var)`` pairs (fresh copies) and take one torch step."""
    for g, v in pairs:
        v.grad = None if g is None else g.clone()
    opt.step()


# ============================================================================================================
# momentum_test.py


def _nesterov_numpy(var_, accum, g, lr, momentum):
    """TF's own nesterov helper, re-derived: w ← w − lr·(g + m·a_new)."""
    accum = accum * momentum + g
    return var_ - lr * (g + momentum * accum), accum


@pytest.mark.parametrize(
    "dtype,tile",
    [(F16, 1), (torch.bfloat16, 1), (F32, 1), (F64, 1), (F32, 32), (F64, 32),
     (F16, 32),
     (torch.bfloat16, 32)],
)
def test_momentum_basic(dtype, tile):
    """momentum_test.py: doTestBasic / testBasic / testResourceBasic (two steps, lr 2.0, momentum 0.9). The
    vectors are also tiled 32 times so that vectorised kernels see more than one SIMD vector."""
    v0, v1 = var([1.0, 2.0] * tile, dtype), var([3.0, 4.0] * tile, dtype)
    g0, g1 = const([0.1, 0.1] * tile, dtype), const([0.01, 0.01] * tile, dtype)
    opt = optkit.Momentum([v0, v1], learning_rate=2.0, momentum=0.9)
    step_with(opt, [(g0, v0), (g1, v1)])
    slot0, slot1 = opt.state[v0]["momentum_buffer"], opt.state[v1]["momentum_buffer"]
    assert slot0.shape == v0.shape and slot1.shape == v1.shape
    close(slot0, [0.1, 0.1] * tile, dtype)
    close(slot1, [0.01, 0.01] * tile, dtype)
    close(v0, [1.0 - 0.1 * 2.0, 2.0 - 0.1 * 2.0] * tile, dtype)
    close(v1, [3.0 - 0.01 * 2.0, 4.0 - 0.01 * 2.0] * tile, dtype)
    step_with(opt, [(g0, v0), (g1, v1)])
    close(opt.state[v0]["momentum_buffer"], [0.9 * 0.1 + 0.1] * 2 * tile, dtype)
    close(opt.state[v1]["momentum_buffer"], [0.9 * 0.01 + 0.01] * 2 * tile, dtype)
    close(v0, [1.0 - 0.2 - (0.9 * 0.1 + 0.1) * 2.0, 2.0 - 0.2 - (0.9 * 0.1 + 0.1) * 2.0] * tile, dtype)
    close(v1, [2.98 - (0.9 * 0.01 + 0.01) * 2.0, 3.98 - (0.9 * 0.01 + 0.01) * 2.0] * tile, dtype)


def test_momentum_tensor_learning_rate():
    """momentum_test.py: testTensorLearningRateAndMomentum (learning rate given as a 0-d tensor)."""
    v0 = var([1.0, 2.0])
    opt = optkit.Momentum([v0], learning_rate=torch.tensor(2.0), momentum=0.9)
    step_with(opt, [(const([0.1, 0.1]), v0)])
    step_with(opt, [(const([0.1, 0.1]), v0)])
    close(v0, [1.0 - 0.2 - 0.19 * 2.0, 2.0 - 0.2 - 0.19 * 2.0])


@pytest.mark.parametrize("dtype", [F32, F64])
def test_momentum_nesterov_matches_numpy(dtype):
    """momentum_test.py: testNesterovMomentum (cost 5·var0² + 3·var1, lr 2.0, m 0.9, 4 steps)."""
    v0, v1 = var([1.0, 2.0], dtype), var([3.0, 4.0], dtype)
    n0, n1 = np.array([1.0, 2.0]), np.array([3.0, 4.0])
    a0, a1 = np.zeros(2), np.zeros(2)
    opt = optkit.Momentum([v0, v1], learning_rate=2.0, momentum=0.9, use_nesterov=True)
    for _ in range(4):
        opt.zero_grad()
        (5 * v0 * v0 + 3 * v1).sum().backward()
        opt.step()
        n0, a0 = _nesterov_numpy(n0, a0, n0 * 10, 2.0, 0.9)
        n1, a1 = _nesterov_numpy(n1, a1, 3.0, 2.0, 0.9)
        close(v0, n0, dtype, tol=1e-6 if dtype == F32 else 1e-12)
        close(v1, n1, dtype, tol=1e-6 if dtype == F32 else 1e-12)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_momentum_sparse_nesterov(dtype):
    """momentum_test.py: testSparseNesterovMomentum (var0's gradient as IndexedSlices over rows [0, 1])."""
    v0, v1 = var([1.0, 2.0], dtype), var([3.0, 4.0], dtype)
    n0, n1, a0, a1 = np.array([1.0, 2.0]), np.array([3.0, 4.0]), np.zeros(2), np.zeros(2)
    opt = optkit.Momentum([v0, v1], learning_rate=2.0, momentum=0.9, use_nesterov=True)
    for _ in range(4):
        g0 = sparse((n0 * 10).tolist(), [0, 1], [2], dtype)
        step_with(opt, [(g0, v0), (const([3.0, 3.0], dtype), v1)])
        n0, a0 = _nesterov_numpy(n0, a0, n0 * 10, 2.0, 0.9)
        n1, a1 = _nesterov_numpy(n1, a1, 3.0, 2.0, 0.9)
        close(v0, n0, dtype)
        close(v1, n1, dtype)


def _embedding_loss(v0, sparse_grad):
    x = torch.tensor([[4.0], [5.0]], dtype=v0.dtype)
    pred = F.embedding(torch.tensor([0]), v0, sparse=sparse_grad) @ x
    return (pred * pred).sum()


@pytest.mark.parametrize("sparse_grad", [False, (True)])
@pytest.mark.parametrize("dtype", [F32, F64])
def test_momentum_minimize_embedding_lookup(dtype, sparse_grad):
    """momentum_test.py: testMinimizeSparseResourceVariable (momentum 0, lr 1: [[1, 2]] → [[−111, −138]])."""
    v0 = var([[1.0, 2.0]], dtype)
    opt = optkit.Momentum([v0], learning_rate=1.0, momentum=0.0)
    _embedding_loss(v0, sparse_grad).backward()
    opt.step()
    close(v0, [[-111.0, -138.0]], dtype)


@pytest.mark.parametrize("sparse_grad", [False, (True)])
def test_momentum_minimize_with_2d_indices_embedding_lookup(sparse_grad):
    """momentum_test.py: testMinimizeWith2DIndicesForEmbeddingLookup (ones(2, 2), sum of row [[1]])."""
    v0 = var(torch.ones(2, 2).tolist())
    opt = optkit.Momentum([v0], learning_rate=1.0, momentum=0.0)
    F.embedding(torch.tensor([[1]]), v0, sparse=sparse_grad).sum().backward()
    opt.step()
    close(v0, [[1.0, 1.0], [0.0, 0.0]])


# dist-belief reference run (momentum_test.py _dbParamsMom01): lr 0.1, momentum 0.1, 10 steps from zeros
DB_GRAD = [
    [0.00096264342, 0.17914793, 0.93945462, 0.41396621, 0.53037018, 0.93197989, 0.78648776, 0.50036013,
     0.55345792, 0.96722615],
    [0.17075552, 0.88821375, 0.20873757, 0.25236958, 0.57578111, 0.15312378, 0.5513742, 0.94687688,
     0.16012503, 0.22159521],
    [0.35077485, 0.47304362, 0.44412705, 0.44368884, 0.078527533, 0.81223965, 0.31168157, 0.43203235,
     0.16792089, 0.24644311],
    [0.9694621, 0.75035888, 0.28171822, 0.83813518, 0.53807181, 0.3728098, 0.81454384, 0.03848977,
     0.89759839, 0.93665648],
    [0.38578293, 0.8536852, 0.88722926, 0.66276771, 0.13678469, 0.94036359, 0.69107032, 0.81897682,
     0.5433259, 0.67860287],
    [0.27885768, 0.76100707, 0.24625534, 0.81354135, 0.18959245, 0.48038563, 0.84163809, 0.41172323,
     0.83259648, 0.44941229],
    [0.27233034, 0.056316052, 0.5039115, 0.24105175, 0.35697976, 0.75913221, 0.73577434, 0.16014607,
     0.57500273, 0.071136251],
    [0.58697265, 0.2494842, 0.08106143, 0.39954534, 0.15892942, 0.12683646, 0.74053431, 0.16033,
     0.66625422, 0.73515922],
    [0.8215279, 0.41994119, 0.95172721, 0.68000203, 0.79439718, 0.43384039, 0.55561525, 0.22567581,
     0.93331909, 0.29438227],
    [0.68297005, 0.67758518, 0.1748755, 0.13266537, 0.70697063, 0.055731893, 0.68593478, 0.50580865,
     0.12602448, 0.093537711],
]
DB_OUT = [
    [-9.6264346e-05, -0.017914793, -0.093945466, -0.041396622, -0.053037018, -0.093197994, -0.078648776,
     -0.050036013, -0.055345792, -0.096722618],
    [-0.017181443, -0.10852765, -0.12421377, -0.070773244, -0.11591884, -0.11783017, -0.14165108,
     -0.14972731, -0.076892875, -0.1285544],
    [-0.053967446, -0.1648933, -0.1716533, -0.1180798, -0.13005978, -0.20151734, -0.17911947, -0.20289968,
     -0.095839672, -0.15638189],
    [-0.15459226, -0.24556576, -0.20456907, -0.20662397, -0.18528105, -0.24716705, -0.2643207, -0.21206589,
     -0.18749419, -0.2528303],
    [-0.20323303, -0.33900154, -0.29658359, -0.28175515, -0.20448165, -0.34576839, -0.34194785,
     -0.29488021, -0.25099224, -0.33033544],
    [-0.23598288, -0.42444581, -0.33041057, -0.3706224, -0.22536094, -0.40366709, -0.43387437, -0.34433398,
     -0.34060168, -0.38302717],
    [-0.26649091, -0.43862185, -0.38418442, -0.40361428, -0.26314685, -0.48537019, -0.51664448,
     -0.36529395, -0.40706289, -0.39540997],
    [-0.32823896, -0.46498787, -0.39766794, -0.446868, -0.28281838, -0.50622416, -0.59897494, -0.38342294,
     -0.48033443, -0.47016418],
    [-0.41656655, -0.50961858, -0.49418902, -0.51919359, -0.36422527, -0.55169362, -0.6627695, -0.40780342,
     -0.58099347, -0.50707781],
    [-0.49369633, -0.58184016, -0.52132869, -0.5396927, -0.44306302, -0.56181377, -0.73774242, -0.46082234,
     -0.60366184, -0.52012295],
]


def test_momentum_like_dist_belief_mom01():
    """momentum_test.py: testLikeDistBeliefMom01 (ten recorded steps of a dist-belief momentum run)."""
    v0 = var([0.0] * 10)
    opt = optkit.Momentum([v0], learning_rate=0.1, momentum=0.1)
    for g, out in zip(DB_GRAD, DB_OUT):
        step_with(opt, [(const(g), v0)])
        np.testing.assert_allclose(v0.detach().numpy(), out, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_momentum_sparse(dtype):
    """momentum_test.py: testSparse (row 1 of zeros(4, 2) and rows 2, 3 of ones(4, 2), two steps)."""
    v0 = var(torch.zeros(4, 2).tolist(), dtype)
    v1 = var(torch.ones(4, 2).tolist(), dtype)
    opt = optkit.Momentum([v0, v1], learning_rate=2.0, momentum=0.9)
    g0 = sparse([[0.1, 0.1]], [1], [4, 2], dtype)
    g1 = sparse([[0.01, 0.01], [0.01, 0.01]], [2, 3], [4, 2], dtype)
    step_with(opt, [(g0, v0), (g1, v1)])
    close(opt.state[v0]["momentum_buffer"][0], [0, 0], dtype)
    close(opt.state[v0]["momentum_buffer"][1], [0.1, 0.1], dtype)
    close(opt.state[v1]["momentum_buffer"][2], [0.01, 0.01], dtype)
    close(v0[0], [0, 0], dtype)
    close(v0[1], [-0.2, -0.2], dtype)
    close(v1[2], [0.98, 0.98], dtype)
    step_with(opt, [(g0, v0), (g1, v1)])
    close(v0[1], [-0.2 - 0.19 * 2.0] * 2, dtype)
    close(v1[2], [0.98 - 0.019 * 2.0] * 2, dtype)


def test_momentum_skipped_first_update_leaves_no_garbage(monkeypatch):
    """momentum_test.py: the basic two-step vector, after a first update that a loss-scaling caller skipped
    through the GradScaler protocol (``grad_scale``/``found_inf``, which ``Momentum`` advertises). A skipped
    step must change nothing (compatibility.md, row "wrappers: skipped torch fused optimizer steps"); fresh
    memory is made NaN so that an uninitialised momentum buffer cannot pass by luck."""
    real_empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: real_empty_like(*a, **k).fill_(float("nan")))
    v0 = var([1.0, 2.0])
    opt = optkit.Momentum([v0], learning_rate=2.0, momentum=0.9)
    assert opt._step_supports_amp_scaling
    v0.grad = const([float("inf"), 1.0])
    opt.grad_scale, opt.found_inf = torch.tensor(1.0), torch.tensor(1.0)
    opt.step()
    del opt.grad_scale, opt.found_inf
    close(v0, [1.0, 2.0])
    step_with(opt, [(const([0.1, 0.1]), v0)])
    step_with(opt, [(const([0.1, 0.1]), v0)])
    close(v0, [1.0 - 0.2 - 0.19 * 2.0, 2.0 - 0.2 - 0.19 * 2.0])


# ============================================================================================================
# adagrad_test.py

ADAGRAD_VAR0 = [-1.6026098728179932, -0.6026098728179932]
ADAGRAD_VAR1 = [2.715679168701172, 3.715679168701172]


@pytest.mark.parametrize("dtype", [F16, F32, F64])
def test_adagrad_basic(dtype):
    """adagrad_test.py: doTestBasic / testBasic (lr 3.0, initial accumulator 0.1, three steps)."""
    v0, v1 = var([1.0, 2.0], dtype), var([3.0, 4.0], dtype)
    opt = optkit.Adagrad([v0, v1], learning_rate=3.0, initial_accumulator_value=0.1)
    for _ in range(3):
        step_with(opt, [(const([0.1, 0.1], dtype), v0), (const([0.01, 0.01], dtype), v1)])
    close(v0, ADAGRAD_VAR0, dtype)
    close(v1, ADAGRAD_VAR1, dtype)
    close(opt.state[v0]["sum"], [0.1 + 3 * 0.01] * 2, dtype)


def test_adagrad_basic_matches_tf_rule_float64():
    """adagrad_test.py: the basic vector recomputed in float64 from TF's rule s ← s + g²; w ← w − lr·g/√s."""
    v0 = var([1.0, 2.0], F64)
    opt = optkit.Adagrad([v0], learning_rate=3.0)
    w, s = np.array([1.0, 2.0]), np.full(2, 0.1)
    for _ in range(3):
        step_with(opt, [(const([0.1, 0.1], F64), v0)])
        s = s + 0.01
        w = w - 3.0 * 0.1 / np.sqrt(s)
    close(v0, w, F64, tol=1e-14)


def test_adagrad_tensor_learning_rate():
    """adagrad_test.py: testTensorLearningRate (lr = constant(3.0))."""
    v0 = var([1.0, 2.0])
    opt = optkit.Adagrad([v0], learning_rate=torch.tensor(3.0), initial_accumulator_value=0.1)
    for _ in range(3):
        step_with(opt, [(const([0.1, 0.1]), v0)])
    close(v0, ADAGRAD_VAR0)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_adagrad_sparse_basic(dtype):
    """adagrad_test.py: testSparseBasic (row 0 of var0 and row 1 of var1 get gradients; three steps)."""
    v0, v1 = var([[1.0], [2.0]], dtype), var([[3.0], [4.0]], dtype)
    opt = optkit.Adagrad([v0, v1], learning_rate=3.0, initial_accumulator_value=0.1)
    for _ in range(3):
        step_with(opt, [(sparse([[0.1]], [0], [2, 1], dtype), v0),
                        (sparse([[0.01]], [1], [2, 1], dtype), v1)])
    close(v0, [[ADAGRAD_VAR0[0]], [2.0]], dtype)
    close(v1, [[3.0], [ADAGRAD_VAR1[1]]], dtype)


def test_adagrad_sparse_repeated_indices():
    """adagrad_test.py: testSparseRepeatedIndices (indices [1, 1] with 0.1 each ≡ index [1] with 0.2)."""
    rep, agg = var([[1.0], [2.0]]), var([[1.0], [2.0]])
    opt_rep = optkit.Adagrad([rep], learning_rate=3.0)
    opt_agg = optkit.Adagrad([agg], learning_rate=3.0)
    for _ in range(3):
        step_with(opt_rep, [(sparse([[0.1], [0.1]], [1, 1], [2, 1]), rep)])
        step_with(opt_agg, [(sparse([[0.2]], [1], [2, 1]), agg)])
        close(rep, agg.detach().numpy())


VAR_STABILITY = [[0.00872496, -0.106952, 0.110467, 0.226505, -0.0147257, -0.0105945]]
GRAD_STABILITY = [[-5.91278e-05, 5.31673e-05, -2.5779e-06, 4.29153e-05, -8.4877e-05, -9.48906e-05]]
OUT_STABILITY = [[0.00891194, -0.10712013, 0.11047515, 0.22636929, -0.0144573, -0.01029443]]


@pytest.mark.parametrize(
    "dtype,sparse_grad",
    [(F16, False), (F32, False), (F64, False),
     (F32, True), (F64, True)],
)
def test_adagrad_stability(dtype, sparse_grad):
    """adagrad_test.py: testSparseStability (tiny gradients, lr 1.0: one step from a fresh optimizer,
    repeated; the accumulator stays at 0.1 to the type's precision). The dense form gives the same values
    because the only row is touched."""
    for _ in range(5):
        v0 = var(VAR_STABILITY, dtype)
        opt = optkit.Adagrad([v0], learning_rate=1.0, initial_accumulator_value=0.1)
        g = sparse(GRAD_STABILITY, [0], [1, 6], dtype) if sparse_grad else const(GRAD_STABILITY, dtype)
        step_with(opt, [(g, v0)])
        close(opt.state[v0]["sum"], [[0.1] * 6], dtype)
        close(v0, OUT_STABILITY, dtype)


def test_adagrad_sharing():
    """adagrad_test.py: testSharing (two update ops share one optimizer's accumulators: three mixed updates
    equal three updates of one)."""
    v0, v1 = var([1.0, 2.0]), var([3.0, 4.0])
    opt = optkit.Adagrad([v0, v1], learning_rate=3.0)
    for _ in range(3):
        step_with(opt, [(const([0.1, 0.1]), v0), (const([0.01, 0.01]), v1)])
    assert list(opt.state[v0]) == ["step", "sum"] and opt.state[v0]["sum"].shape == v0.shape
    close(v0, ADAGRAD_VAR0)
    close(v1, ADAGRAD_VAR1)


# ============================================================================================================
# adam_test.py


def adam_numpy(param, g, t, m, v, lr=0.001, beta1=0.9, beta2=0.999, eps=1e-8):
    """Adam with optkit's (torch's) ε placement: ε added to the bias-corrected √v̂
    (compatibility.md, row "registry: Adam")."""
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
    return param - lr * m_hat / (np.sqrt(v_hat) + eps), m, v


def adam_numpy_tf(param, g, t, m, v, lr=0.001, beta1=0.9, beta2=0.999, eps=1e-8):
    """TF's own reference helper (adam_test.py adam_update_numpy), re-derived."""
    alpha_t = lr * np.sqrt(1 - beta2**t) / (1 - beta1**t)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    return param - alpha_t * m / (np.sqrt(v) + eps), m, v


@pytest.mark.parametrize("dtype", [F16, F32, F64])
def test_adam_basic(dtype):
    """adam_test.py: doTestBasic (default hyperparameters, three steps, var0=[1,2] g=0.1, var1=[3,4] g=0.01);
    the step counter plays the role of TF's beta-power accumulators."""
    v0, v1 = var([1.0, 2.0], dtype), var([3.0, 4.0], dtype)
    n0, n1 = np.array([1.0, 2.0]), np.array([3.0, 4.0])
    g0, g1 = np.array([0.1, 0.1]), np.array([0.01, 0.01])
    m0 = s0 = m1 = s1 = 0.0
    opt = optkit.Adam([v0, v1])
    for t in range(1, 4):
        step_with(opt, [(const(g0.tolist(), dtype), v0), (const(g1.tolist(), dtype), v1)])
        n0, m0, s0 = adam_numpy(n0, g0, t, m0, s0)
        n1, m1, s1 = adam_numpy(n1, g1, t, m1, s1)
        assert float(opt.state[v0]["step"]) == t
        close(v0, n0, dtype, tol=1e-12 if dtype == F64 else None)
        close(v1, n1, dtype, tol=1e-12 if dtype == F64 else None)
        close(opt.state[v0]["exp_avg"], m0, dtype, tol=1e-12 if dtype == F64 else None)
        close(opt.state[v0]["exp_avg_sq"], s0, dtype, tol=1e-12 if dtype == F64 else None)


def test_adam_epsilon_placement_against_tf_reference():
    """adam_test.py's own reference (ε added to √v, not √v̂) differs from optkit's by ε·(1 − √(1−β2^t))-sized
    terms: invisible at the upstream vectors (below 1e-8) and visible once ε is comparable to √v̂
    (compatibility.md, row "registry: Adam")."""
    v0 = var([1.0, 2.0], F64)
    opt = optkit.Adam([v0])
    tf_ref, m, v = np.array([1.0, 2.0]), 0.0, 0.0
    for t in range(1, 4):
        step_with(opt, [(const([0.1, 0.1], F64), v0)])
        tf_ref, m, v = adam_numpy_tf(tf_ref, np.array([0.1, 0.1]), t, m, v)
    np.testing.assert_allclose(v0.detach().numpy(), tf_ref, rtol=0, atol=1e-8)
    w = var([1.0], F64)
    opt = optkit.Adam([w], learning_rate=0.1, epsilon=1.0)
    step_with(opt, [(const([0.1], F64), w)])
    torch_form = adam_numpy(np.array([1.0]), 0.1, 1, 0.0, 0.0, lr=0.1, eps=1.0)[0]
    tf_form = adam_numpy_tf(np.array([1.0]), 0.1, 1, 0.0, 0.0, lr=0.1, eps=1.0)[0]
    close(w, torch_form, F64, tol=1e-14)
    assert abs(torch_form[0] - tf_form[0]) > 1e-3


def test_adam_tensor_learning_rate():
    """adam_test.py: testTensorLearningRate (lr = constant(0.001))."""
    v0 = var([1.0, 2.0])
    opt = optkit.Adam([v0], learning_rate=torch.tensor(0.001))
    n0, m0, s0 = np.array([1.0, 2.0]), 0.0, 0.0
    for t in range(1, 4):
        step_with(opt, [(const([0.1, 0.1]), v0)])
        n0, m0, s0 = adam_numpy(n0, np.array([0.1, 0.1]), t, m0, s0)
    close(v0, n0)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_adam_sparse(dtype):
    """adam_test.py: doTestSparse (IndexedSlices covering both rows; same numbers as the dense run)."""
    v0 = var([1.0, 2.0], dtype)
    opt = optkit.Adam([v0])
    n0, m0, s0 = np.array([1.0, 2.0]), 0.0, 0.0
    for t in range(1, 4):
        step_with(opt, [(sparse([0.1, 0.1], [0, 1], [2], dtype), v0)])
        n0, m0, s0 = adam_numpy(n0, np.array([0.1, 0.1]), t, m0, s0)
        close(v0, n0, dtype)


def test_adam_sparse_repeated_indices():
    """adam_test.py: testSparseRepeatedIndices (indices [1, 1] with 0.1 each ≡ index [1] with 0.2)."""
    rep, agg = var([[1.0], [2.0]]), var([[1.0], [2.0]])
    opt_rep, opt_agg = optkit.Adam([rep]), optkit.Adam([agg])
    for _ in range(3):
        step_with(opt_rep, [(sparse([[0.1], [0.1]], [1, 1], [2, 1]), rep)])
        step_with(opt_agg, [(sparse([[0.2]], [1], [2, 1]), agg)])
        close(rep, agg.detach().numpy())


def test_adam_sharing_and_unique_slots():
    """adam_test.py: testSharing (alternating two update ops on one optimizer ≡ one update op) and
    testSlotsUniqueEager (two variables get two distinct moment slots each)."""
    v0, v1 = var([1.0, 2.0]), var(1.0)
    opt = optkit.Adam([v0, v1])
    n0, m0, s0 = np.array([1.0, 2.0]), 0.0, 0.0
    for t in range(1, 4):
        step_with(opt, [(const([0.1, 0.1]), v0), (const(1.0), v1)])
        n0, m0, s0 = adam_numpy(n0, np.array([0.1, 0.1]), t, m0, s0)
        close(v0, n0)
    slots = [opt.state[p][k] for p in (v0, v1) for k in ("exp_avg", "exp_avg_sq")]
    assert len({id(s) for s in slots}) == 4


# ============================================================================================================
# rmsprop_test.py

RMSPROP_PARAMS = [
    # learning_rate, decay, momentum, epsilon, centered
    (0.5, 0.9, 0.0, 1e-3, True),
    (0.5, 0.9, 0.0, 1e-3, False),
    (0.1, 0.9, 0.0, 1e-3, True),
    (0.5, 0.95, 0.0, 1e-3, False),
    (0.5, 0.95, 0.0, 1e-5, True),
    (0.5, 0.95, 0.9, 1e-5, True),
]


def rmsprop_numpy(var_, g, mg, rms, mom, lr, decay, momentum, epsilon, centered):
    rms = rms * decay + (1 - decay) * g * g
    denom = rms + epsilon
    if centered:
        mg = mg * decay + (1 - decay) * g
        denom = denom - mg * mg
    mom = momentum * mom + lr * g / np.sqrt(denom)
    return var_ - mom, mg, rms, mom


def _rms_opt(params, lr, decay, momentum, epsilon, centered):
    return optkit.RMSProp(params, learning_rate=lr, decay=decay, momentum=momentum, epsilon=epsilon,
                          centered=centered)


@pytest.mark.parametrize("dtype", [F16, F32])
@pytest.mark.parametrize("hp", RMSPROP_PARAMS)
def test_rmsprop_dense(hp, dtype):
    """rmsprop_test.py: testDense (every hyperparameter row, four steps; slots rms/momentum/mg checked)."""
    lr, decay, momentum, epsilon, centered = hp
    v0, v1 = var([1.0, 2.0], dtype), var([3.0, 4.0], dtype)
    g0, g1 = np.array([0.1, 0.2]), np.array([0.01, 0.2])
    opt = _rms_opt([v0, v1], *hp)
    assert ("mg" in opt.get_slot_names()) == centered
    ref = [[np.array([1.0, 2.0]), np.zeros(2), np.ones(2), np.zeros(2)],
           [np.array([3.0, 4.0]), np.zeros(2), np.ones(2), np.zeros(2)]]
    for _ in range(4):
        opt.apply_gradients([(const(g0.tolist(), dtype), v0), (const(g1.tolist(), dtype), v1)])
        for j, (v, g) in enumerate(((v0, g0), (v1, g1))):
            ref[j] = list(rmsprop_numpy(*ref[j][:1], g, *ref[j][1:], lr, decay, momentum, epsilon, centered))
            w_np, mg_np, rms_np, mom_np = ref[j]
            if centered:
                close(opt.get_slot(v, "mg"), mg_np, dtype)
            close(opt.get_slot(v, "rms"), rms_np, dtype)
            close(opt.get_slot(v, "momentum"), mom_np, dtype)
            close(v, w_np, dtype)


def _sparse_rmsprop_run(hp, dtype):
    lr, decay, momentum, epsilon, centered = hp
    v0, v1 = var([1.0, 2.0], dtype), var([3.0, 4.0], dtype)
    opt = _rms_opt([v0, v1], *hp)
    refs = []
    for init, idx, gval in (([1.0, 2.0], 0, 0.1), ([3.0, 4.0], 1, 0.01)):
        refs.append([np.array(init), np.zeros(2), np.ones(2), np.zeros(2), idx, gval])
    for _ in range(4):
        opt.apply_gradients([(sparse([0.1], [0], [2], dtype), v0), (sparse([0.01], [1], [2], dtype), v1)])
        for r in refs:
            w, mg, rms, mom, i, g = r
            # TF SparseApplyRMSProp: only the touched row changes (weights and slots)
            w2, mg2, rms2, mom2 = rmsprop_numpy(w[i], g, mg[i], rms[i], mom[i], lr, decay, momentum, epsilon,
                                                centered)
            w[i], mg[i], rms[i], mom[i] = w2, mg2, rms2, mom2
    return opt, (v0, v1), refs


@pytest.mark.parametrize("dtype", [F16, F32])
@pytest.mark.parametrize("hp", RMSPROP_PARAMS)
def test_rmsprop_sparse_weights(hp, dtype):
    """rmsprop_test.py: testSparse, the weights (one touched row per variable, four steps). optkit densifies
    the sparse gradient; the weights of untouched rows still stay put because their momentum is zero."""
    opt, vs, refs = _sparse_rmsprop_run(hp, dtype)
    for v, r in zip(vs, refs):
        close(v, r[0], dtype)
        close(opt.get_slot(v, "momentum"), r[3], dtype)
        if hp[4]:
            close(opt.get_slot(v, "mg"), r[1], dtype)


def test_rmsprop_sparse_untouched_rows_keep_rms():
    """rmsprop_test.py: testSparse, the ``rms`` slot of the row that never gets a gradient stays at 1."""
    hp = RMSPROP_PARAMS[1]
    opt, vs, refs = _sparse_rmsprop_run(hp, F32)
    for v, r in zip(vs, refs):
        close(opt.get_slot(v, "rms"), r[2], F32)


@pytest.mark.parametrize("dtype", [F16, F32])
def test_rmsprop_without_momentum(dtype):
    """rmsprop_test.py: testWithoutMomentum (lr 2.0, decay 0.9, momentum 0, epsilon 1.0; two steps)."""
    v0, v1 = var([1.0, 2.0], dtype), var([3.0, 4.0], dtype)
    opt = optkit.RMSProp([v0, v1], learning_rate=2.0, decay=0.9, momentum=0.0, epsilon=1.0)
    pairs = [(const([0.1, 0.1], dtype), v0), (const([0.01, 0.01], dtype), v1)]
    opt.apply_gradients(pairs)
    close(opt.get_slot(v0, "rms"), [0.901, 0.901], dtype)
    close(opt.get_slot(v1, "rms"), [0.90001, 0.90001], dtype)
    d0, d1 = 0.1 * 2.0 / math.sqrt(0.901 + 1.0), 0.01 * 2.0 / math.sqrt(0.90001 + 1.0)
    close(v0, [1.0 - d0, 2.0 - d0], dtype)
    close(v1, [3.0 - d1, 4.0 - d1], dtype)
    opt.apply_gradients(pairs)
    close(opt.get_slot(v0, "rms"), [0.901 * 0.9 + 0.001] * 2, dtype)
    close(opt.get_slot(v1, "rms"), [0.90001 * 0.9 + 1e-5] * 2, dtype)
    e0 = 0.1 * 2.0 / math.sqrt(0.901 * 0.9 + 0.001 + 1.0)
    e1 = 0.01 * 2.0 / math.sqrt(0.90001 * 0.9 + 1e-5 + 1.0)
    close(v0, [1.0 - d0 - e0, 2.0 - d0 - e0], dtype)
    close(v1, [3.0 - d1 - e1, 4.0 - d1 - e1], dtype)


@pytest.mark.parametrize("dtype", [F16, F32])
def test_rmsprop_with_momentum(dtype):
    """rmsprop_test.py: testWithMomentum (lr 2.0, decay 0.9, momentum 0.5, epsilon 1e-5; two steps)."""
    v0, v1 = var([1.0, 2.0], dtype), var([3.0, 4.0], dtype)
    opt = optkit.RMSProp([v0, v1], learning_rate=2.0, decay=0.9, momentum=0.5, epsilon=1e-5)
    pairs = [(const([0.1, 0.1], dtype), v0), (const([0.01, 0.01], dtype), v1)]
    opt.apply_gradients(pairs)
    m0, m1 = 0.1 * 2.0 / math.sqrt(0.901 + 1e-5), 0.01 * 2.0 / math.sqrt(0.90001 + 1e-5)
    close(opt.get_slot(v0, "rms"), [0.901] * 2, dtype)
    close(opt.get_slot(v1, "rms"), [0.90001] * 2, dtype)
    close(opt.get_slot(v0, "momentum"), [m0] * 2, dtype)
    close(opt.get_slot(v1, "momentum"), [m1] * 2, dtype)
    close(v0, [1.0 - m0, 2.0 - m0], dtype)
    close(v1, [3.0 - m1, 4.0 - m1], dtype)
    opt.apply_gradients(pairs)
    n0 = 0.5 * m0 + 0.1 * 2.0 / math.sqrt(0.901 * 0.9 + 0.001 + 1e-5)
    n1 = 0.5 * m1 + 0.01 * 2.0 / math.sqrt(0.90001 * 0.9 + 2e-5)
    close(opt.get_slot(v0, "rms"), [0.901 * 0.9 + 0.001] * 2, dtype)
    close(opt.get_slot(v1, "rms"), [0.90001 * 0.9 + 1e-5] * 2, dtype)
    close(opt.get_slot(v0, "momentum"), [n0] * 2, dtype)
    close(opt.get_slot(v1, "momentum"), [n1] * 2, dtype)
    close(v0, [1.0 - m0 - n0, 2.0 - m0 - n0], dtype)
    close(v1, [3.0 - m1 - n1, 4.0 - m1 - n1], dtype)


# ============================================================================================================
# ftrl_test.py


def _ftrl(params, **kw):
    return optkit.Ftrl(params, learning_rate=3.0, initial_accumulator_value=0.1, **kw)


def _ftrl_run(opt, pairs, steps):
    for _ in range(steps):
        opt.apply_gradients([(g.clone(), v) for g, v in pairs])


@pytest.mark.parametrize("dtype", [F16, F32])
def test_ftrl_without_regularization(dtype):
    """ftrl_test.py: doTestFtrlwithoutRegularization (zeros, three steps; half with rtol 1e-2)."""
    v0, v1 = var([0.0, 0.0], dtype), var([0.0, 0.0], dtype)
    opt = _ftrl([v0, v1], l1_regularization_strength=0.0, l2_regularization_strength=0.0)
    _ftrl_run(opt, [(const([0.1, 0.2], dtype), v0), (const([0.01, 0.02], dtype), v1)], 3)
    close(v0, [-2.60260963, -4.29698515], dtype, tol=1e-2 if dtype == F16 else None)
    close(v1, [-0.28432083, -0.56694895], dtype)


@pytest.mark.parametrize("dtype", [F16, F32])
def test_ftrl_without_regularization_2(dtype):
    """ftrl_test.py: testFtrlwithoutRegularization2 (var0=[1,2], var1=[4,3], three steps)."""
    v0, v1 = var([1.0, 2.0], dtype), var([4.0, 3.0], dtype)
    opt = _ftrl([v0, v1])
    _ftrl_run(opt, [(const([0.1, 0.2], dtype), v0), (const([0.01, 0.02], dtype), v1)], 3)
    close(v0, [-2.55607247, -3.98729396], dtype)
    close(v1, [-0.28232238, -0.56096673], dtype)


@pytest.mark.parametrize("dtype", [F16, F32, F64])
def test_ftrl_minimize_sparse_resource_variable(dtype):
    """ftrl_test.py: testMinimizeSparseResourceVariable (embedding lookup, lr 1.0, one step: [[0, 1]],
    atol 0.01)."""
    v0 = var([[1.0, 2.0]], dtype)
    opt = optkit.Ftrl([v0], learning_rate=1.0)
    opt.minimize(lambda: _embedding_loss(v0, True), var_list=[v0])
    close(v0, [[0.0, 1.0]], dtype, tol=0.01)


@pytest.mark.parametrize("dtype", [F16, F32])
@pytest.mark.parametrize(
    "kw,steps,out0,out1",
    [
        ({"l1_regularization_strength": 0.001}, 10, [-7.66718769, -10.91273689], [-0.93460727, -1.86147261]),
        ({"l1_regularization_strength": 0.001, "l2_regularization_strength": 2.0}, 10,
         [-0.24059935, -0.46829352], [-0.02406147, -0.04830509]),
        ({"l1_regularization_strength": 0.001, "l2_regularization_strength": 2.0,
          "l2_shrinkage_regularization_strength": 0.1}, 10,
         [-0.22578995, -0.44345796], [-0.14378493, -0.13229476]),
    ],
    ids=["l1", "l1_l2", "l1_l2_shrinkage"],
)
def test_ftrl_with_regularization(kw, steps, out0, out1, dtype):
    """ftrl_test.py: testFtrlWithL1 / testFtrlWithL1_L2 / testFtrlWithL1_L2_L2Shrinkage (ten steps)."""
    v0, v1 = var([1.0, 2.0], dtype), var([4.0, 3.0], dtype)
    opt = _ftrl([v0, v1], **kw)
    _ftrl_run(opt, [(const([0.1, 0.2], dtype), v0), (const([0.01, 0.02], dtype), v1)], steps)
    close(v0, out0, dtype)
    close(v1, out1, dtype)


@pytest.mark.parametrize("dtype", [F16, F32])
def test_ftrl_l1_l2_shrinkage_sparse(dtype):
    """ftrl_test.py: testFtrlWithL1_L2_L2ShrinkageSparse (only the touched rows move)."""
    v0, v1 = var([[1.0], [2.0]], dtype), var([[4.0], [3.0]], dtype)
    opt = _ftrl([v0, v1], l1_regularization_strength=0.001, l2_regularization_strength=2.0,
                l2_shrinkage_regularization_strength=0.1)
    pairs = [(sparse([[0.1]], [0], [2, 1], dtype), v0), (sparse([[0.02]], [1], [2, 1], dtype), v1)]
    _ftrl_run(opt, pairs, 10)
    close(v0, [[-0.22578995], [2.0]], dtype)
    close(v1, [[4.0], [-0.13229476]], dtype)


@pytest.mark.parametrize("dtype", [F16, F32])
def test_ftrl_l2_shrinkage_does_not_change_lr_schedule(dtype):
    """ftrl_test.py: testFtrlWithL2ShrinkageDoesNotChangeLrSchedule (shrinkage gives smaller weights but the
    same accumulator)."""
    v0, v1 = var([1.0, 2.0], dtype), var([1.0, 2.0], dtype)
    opt0 = _ftrl([v0], l1_regularization_strength=0.001, l2_regularization_strength=2.0,
                 l2_shrinkage_regularization_strength=0.1)
    opt1 = _ftrl([v1], l1_regularization_strength=0.001, l2_regularization_strength=2.0)
    for _ in range(10):
        opt0.apply_gradients([(const([0.1, 0.2], dtype), v0)])
        opt1.apply_gradients([(const([0.1, 0.2], dtype), v1)])
    assert bool(((v0.detach() ** 2) < (v1.detach() ** 2)).all())
    close(opt0.get_slot(v0, "accum"), opt1.get_slot(v1, "accum").detach().numpy(), dtype)


def _apply_equiv(opt_factory, dtype, is_sparse, steps=5):
    """ftrl_test.py applyOptimizer: zeros, gradients [0.1, 0.2] / [0.01, 0.02] (or one sparse row each)."""
    if is_sparse:
        v0, v1 = var([[0.0], [0.0]], dtype), var([[0.0], [0.0]], dtype)
        pairs = [(sparse([[0.1]], [0], [2, 1], dtype), v0), (sparse([[0.02]], [1], [2, 1], dtype), v1)]
    else:
        v0, v1 = var([0.0, 0.0], dtype), var([0.0, 0.0], dtype)
        pairs = [(const([0.1, 0.2], dtype), v0), (const([0.01, 0.02], dtype), v1)]
    opt = opt_factory([v0, v1])
    for _ in range(steps):
        step_with(opt, pairs)
    return v0.detach().to(F64).numpy(), v1.detach().to(F64).numpy()


def _adagrad_numpy_from_zero(is_sparse, steps=5):
    out = []
    grads = ([[0.1], [0.0]], [[0.0], [0.02]]) if is_sparse else ([0.1, 0.2], [0.01, 0.02])
    for g in grads:
        g = np.array(g)
        w, s = np.zeros_like(g), np.full_like(g, 0.1)
        for _ in range(steps):
            s = s + g * g
            w = w - 3.0 * g / np.sqrt(s)
        out.append(w)
    return out


@pytest.mark.parametrize("is_sparse", [False, True])
@pytest.mark.parametrize("dtype", [F16, F32])
def test_ftrl_equivalent_to_adagrad_without_regularization(dtype, is_sparse):
    """ftrl_test.py: testEquivAdagradwithoutRegularization / testEquivSparseAdagradwithoutRegularization
    (from zeros, FTRL with lr_power −0.5 and no regularisation is Adagrad). The sparse Adagrad side is a
    float64 NumPy Adagrad on the touched rows."""
    ftrl = _apply_equiv(lambda ps: optkit.Ftrl(ps, learning_rate=3.0, learning_rate_power=-0.5,
                                               initial_accumulator_value=0.1), dtype, is_sparse)
    if is_sparse:
        ada = _adagrad_numpy_from_zero(True)
    else:
        ada = _apply_equiv(lambda ps: optkit.Adagrad(ps, learning_rate=3.0, initial_accumulator_value=0.1),
                           dtype, False)
    tol = 2e-3 if dtype == F16 else 1e-6
    for a, b in zip(ftrl, ada):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("is_sparse", [False, True])
@pytest.mark.parametrize("dtype", [F16, F32])
def test_ftrl_equivalent_to_gradient_descent_without_regularization(dtype, is_sparse):
    """ftrl_test.py: testEquivGradientDescentwithoutRegularization / testEquivSparseGradientDescent… (from
    zeros, FTRL with lr_power 0 is plain gradient descent)."""
    ftrl = _apply_equiv(lambda ps: optkit.Ftrl(ps, learning_rate=3.0, learning_rate_power=-0.0,
                                               initial_accumulator_value=0.1), dtype, is_sparse)
    sgd = _apply_equiv(lambda ps: optkit.SGD(ps, learning_rate=3.0), dtype, is_sparse)
    for a, b in zip(ftrl, sgd):
        np.testing.assert_allclose(a, b, rtol=TOL[dtype], atol=TOL[dtype])


# ============================================================================================================
# gradient_descent_test.py (optkit.SGD with momentum 0 is TF's GradientDescentOptimizer)


@pytest.mark.parametrize("lr", [3.0, lambda: 3.0, torch.tensor(3.0)], ids=["float", "callable", "tensor"])
@pytest.mark.parametrize("dtype", [F16, F32, F64])
def test_gradient_descent_basic(dtype, lr):
    """gradient_descent_test.py: testBasic / testBasicCallableParams / testTensorLearningRate (one step,
    lr 3.0); TF's GradientDescent has no variables, optkit's SGD holds only ``iterations``."""
    v0, v1 = var([1.0, 2.0], dtype), var([3.0, 4.0], dtype)
    opt = optkit.SGD([v0, v1], learning_rate=lr)
    opt.apply_gradients([(const([0.1, 0.1], dtype), v0), (const([0.01, 0.01], dtype), v1)])
    close(v0, [1.0 - 3.0 * 0.1, 2.0 - 3.0 * 0.1], dtype)
    close(v1, [3.0 - 3.0 * 0.01, 4.0 - 3.0 * 0.01], dtype)
    assert opt.get_slot_names() == []
    assert len(opt.variables()) == 1 and opt.variables()[0] is opt.iterations


@pytest.mark.parametrize("sparse_grad", [False, True])
@pytest.mark.parametrize("dtype", [F16, F32, F64])
def test_gradient_descent_minimize(dtype, sparse_grad):
    """gradient_descent_test.py: testMinimizeResourceVariable / testMinimizeSparseResourceVariable
    (pred = var0·x + var1, loss = pred², lr 1.0, one step)."""
    v0, v1 = var([[1.0, 2.0]], dtype), var([3.0], dtype)
    x = torch.tensor([[4.0], [5.0]], dtype=dtype)

    def loss():
        rows = F.embedding(torch.tensor([0]), v0, sparse=True) if sparse_grad else v0
        pred = rows @ x + v1
        return (pred * pred).sum()

    optkit.SGD([v0, v1], learning_rate=1.0).minimize(loss)
    np_grad = 2 * (1.0 * 4.0 + 2.0 * 5.0 + 3.0)
    close(v0, [[1.0 - np_grad * 4.0, 2.0 - np_grad * 5.0]], dtype)
    close(v1, [3.0 - np_grad], dtype)


@pytest.mark.parametrize("dtype", [F16, F32, F64])
def test_gradient_descent_grad_wrt_ref(dtype):
    """gradient_descent_test.py: testGradWrtRef (compute_gradients of var0 + var1 gives ones)."""
    vs = [var([1.0], dtype), var([3.0], dtype)]
    opt = optkit.SGD(vs, learning_rate=3.0)
    pairs = opt.compute_gradients(lambda: (vs[0] + vs[1]).sum(), vs)
    assert [v for _, v in pairs] == vs
    for g, _ in pairs:
        close(g, [1.0], dtype)


@pytest.mark.parametrize("dtype", [F16, F32, F64])
def test_gradient_descent_with_global_step(dtype):
    """gradient_descent_test.py: testWithGlobalStep (``iterations`` is the global step: 1 after one apply)."""
    v0, v1 = var([1.0, 2.0], dtype), var([3.0, 4.0], dtype)
    opt = optkit.SGD([v0, v1], learning_rate=3.0)
    it = opt.apply_gradients([(const([0.1, 0.1], dtype), v0), (const([0.01, 0.01], dtype), v1)])
    assert int(it) == 1 and int(opt.iterations) == 1
    close(v0, [0.7, 1.7], dtype)
    close(v1, [2.97, 3.97], dtype)


@pytest.mark.parametrize("dtype", [F16, F32, F64])
def test_gradient_descent_sparse_basic(dtype):
    """gradient_descent_test.py: testSparseBasic (row 0 of var0, row 1 of var1)."""
    v0, v1 = var([[1.0], [2.0]], dtype), var([[3.0], [4.0]], dtype)
    opt = optkit.SGD([v0, v1], learning_rate=3.0)
    opt.apply_gradients([(sparse([[0.1]], [0], [2, 1], dtype), v0),
                         (sparse([[0.01]], [1], [2, 1], dtype), v1)])
    close(v0, [[1.0 - 3.0 * 0.1], [2.0]], dtype)
    close(v1, [[3.0], [4.0 - 3.0 * 0.01]], dtype)


# ------------------------------------------------------------------------------------------------------------
# "Sharing" tests: one set of gradient tensors applied twice (momentum_test.py / adagrad_test.py testSharing)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda ps: optkit.SGD(ps, learning_rate=2.0, momentum=0.9), id="SGD"),
        pytest.param(lambda ps: optkit.LARS([(f"param_{i}", p) for i, p in enumerate(ps)], learning_rate=2.0,
                                            momentum=0.9, weight_decay=0.0, eeta=1e9, skip_list=["param"]),
                     id="LARS"),
        pytest.param(lambda ps: optkit.RMSProp(ps, learning_rate=2.0, momentum=0.9), id="RMSProp"),
        pytest.param(lambda ps: optkit.Ftrl(ps, learning_rate=2.0), id="Ftrl"),
    ],
)
def test_apply_gradients_twice_with_the_same_gradient_tensors(make):
    """momentum_test.py testSharing: two apply ops built from the same gradient constants run one after the
    other; the gradients are inputs and must be the same on the second run (checked against two runs with
    fresh copies of the gradients)."""
    g0 = const([0.1, 0.1])
    v0, w0 = var([1.0, 2.0]), var([1.0, 2.0])
    opt_shared, opt_fresh = make([v0]), make([w0])
    opt_fresh.apply_gradients([(g0.clone(), w0)])
    opt_fresh.apply_gradients([(g0.clone(), w0)])
    opt_shared.apply_gradients([(g0, v0)])
    opt_shared.apply_gradients([(g0, v0)])
    assert torch.equal(g0, const([0.1, 0.1]))
    close(v0, w0.detach().numpy())
