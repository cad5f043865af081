"""``optkit.clipping`` against the TF / OpenSeq2Seq vectors of the specs and float64 NumPy references.

Spec vectors: ``shared/spec/tf_keras.md`` §6.1-6.3 (checked there against TF 2.21) and
``shared/spec/openseq2seq.md`` §1.3. NumPy references implement t · c / max(N, c) in float64.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import optkit
from optkit import (
    clip_by_global_norm,
    clip_by_norm,
    clip_coefficient,
    clip_gradients_by_norm,
    clip_grads_by_global_norm_,
    clip_grads_by_norm_,
    clip_grads_by_value_,
    global_norm,
)

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")

T = torch.tensor
NAN = math.nan
INF = math.inf


def np64(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).numpy().copy()


def indexed_slices(values, indices, dense_shape) -> torch.Tensor:
    """The PyTorch counterpart of a TF ``IndexedSlices``: an uncoalesced hybrid COO tensor (rows sparse)."""
    return torch.sparse_coo_tensor(T([indices]), T(values), dense_shape)


def random_list(rng, dtype=torch.float32, n=6):
    shapes = [tuple(int(d) for d in rng.integers(1, 6, size=rng.integers(0, 4))) for _ in range(n)]
    return [torch.tensor(rng.standard_normal(s) + 0.01, dtype=torch.float64).to(dtype) for s in shapes]


def ref_clip(arrays, c, norm=None):
    """float64 reference of TF's clip_by_global_norm: t · c / max(N, c), NaN everywhere for non-finite N."""
    n = np.sqrt(sum(np.sum(a**2) for a in arrays)) if norm is None else norm
    s = c / max(n, c) if np.isfinite(n) else np.nan
    return [a * s for a in arrays], n


# ------------------------------------------------------------------------------------------------------------
# spec vectors


def test_os2s_vectors():
    """openseq2seq.md §1.3: grads {[3,4],[12]}: N = 13; clip 6.5 halves, 20 keeps, zeros stay zeros."""
    g = [T([3.0, 4.0], dtype=torch.float64), T([12.0], dtype=torch.float64)]
    out, n = clip_by_global_norm(g, 6.5)
    assert n.item() == 13.0
    assert out[0].tolist() == [1.5, 2.0] and out[1].tolist() == [6.0]
    out, _ = clip_by_global_norm(g, 20.0)
    assert out[0].tolist() == [3.0, 4.0] and out[1].tolist() == [12.0]
    z = [torch.zeros(2), torch.zeros(3)]
    out, n = clip_by_global_norm(z, 1.0)
    assert n.item() == 0.0 and all(o.tolist() == [0.0] * o.numel() for o in out)


def test_tf_clip_by_global_norm_table():
    """tf_keras.md §6.3 table (TF 2.21)."""
    out, n = clip_by_global_norm([T([3.0, 4.0]), None, T([[12.0]])], 6.5)
    assert out[0].tolist() == [1.5, 2.0] and out[1] is None and out[2].tolist() == [[6.0]]
    assert n.item() == 13.0

    out, n = clip_by_global_norm([T([3.0, 4.0]), T([[12.0]])], 6.5, use_norm=26)
    assert out[0].tolist() == [0.75, 1.0] and out[1].tolist() == [[3.0]] and n.item() == 26.0

    sl = indexed_slices([[3.0, 4.0], [3.0, 4.0]], [1, 1], (3, 2))
    out, n = clip_by_global_norm([T([3.0, 4.0]), sl], 100)
    assert out[0].tolist() == [3.0, 4.0]
    assert out[1].is_sparse and out[1]._values().tolist() == [[3.0, 4.0], [3.0, 4.0]]
    assert out[1]._indices().tolist() == [[1, 1]]
    np.testing.assert_allclose(n.item(), 8.6602545, rtol=1e-7)  # duplicates counted

    out, n = clip_by_global_norm([T([INF, 1.0]), T([[12.0]])], 1)
    assert all(math.isnan(v) for v in out[0].tolist()) and math.isnan(out[1].item())
    assert n.item() == INF

    out, n = clip_by_global_norm([T([0.0, 0.0])], 1)
    assert out[0].tolist() == [0.0, 0.0] and n.item() == 0.0

    out, n = clip_by_global_norm([None, None], 1)
    assert out == [None, None] and n.item() == 0.0 and n.dtype == torch.float32


def test_tf_clip_by_norm_table():
    """tf_keras.md §6.1 (TF 2.21), t = [[3,4],[0.3,0.4],[0,0]], c = 1."""
    t = T([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])
    tol = {"rtol": 1e-7, "atol": 1e-7}  # the table prints 7 decimals
    np.testing.assert_allclose(
        clip_by_norm(t, 1).numpy(), [[0.5970223, 0.7960298], [0.0597022, 0.0796030], [0, 0]], **tol)
    np.testing.assert_allclose(clip_by_norm(t, 1, [1]).numpy(), [[0.6, 0.8], [0.3, 0.4], [0, 0]], **tol)
    np.testing.assert_allclose(
        clip_by_norm(t, 1, [0]).numpy(), [[0.9950372, 0.9950372], [0.0995037, 0.0995037], [0, 0]], **tol)
    assert clip_by_norm(t, 1, 1).tolist() == clip_by_norm(t, 1, [1]).tolist()
    assert clip_by_norm(t, 1, -1).tolist() == clip_by_norm(t, 1, [1]).tolist()

    r = clip_by_norm(T([INF, 1.0]), 1)
    assert math.isnan(r[0].item()) and r[1].item() == 0.0
    assert all(math.isnan(v) for v in clip_by_norm(torch.zeros(2), 0).tolist())
    assert clip_by_norm(T([3.0, 4.0]), -1).tolist() == [0.0, 0.0]

    sl = indexed_slices([[3.0, 4.0], [3.0, 4.0]], [1, 1], (3, 2))
    out = clip_by_norm(sl, 5)
    assert out.is_sparse and out._indices().tolist() == [[1, 1]] and out.shape == (3, 2)
    np.testing.assert_allclose(out._values().numpy(), [[2.1213203, 2.8284271]] * 2, rtol=1e-7)


def test_tf_global_norm_rules():
    """tf_keras.md §6.2: None skipped, raw sparse values, all-None -> 0.0 (float32), sequence check."""
    assert global_norm([None, T([3.0, 4.0]), None]).item() == 5.0
    out = global_norm([])
    assert out.item() == 0.0 and out.dtype == torch.float32
    sl = indexed_slices([[3.0, 4.0], [3.0, 4.0]], [1, 1], (3, 2))
    np.testing.assert_allclose(global_norm([sl]).item(), math.sqrt(50.0), rtol=1e-7)
    assert global_norm((T([6.0]), T([8.0]))).item() == 10.0
    for bad in (T([3.0, 4.0]), "abc", b"ab", 3.0, (x for x in [T([1.0])]), {T([1.0])}):
        with pytest.raises(TypeError, match="t_list"):
            global_norm(bad)
    with pytest.raises(TypeError, match=r"t_list\[1\]"):
        global_norm([T([1.0]), 2.0])
    with pytest.raises(TypeError, match="floating"):
        global_norm([T([1, 2])])


def test_scalar_stays_scalar():
    """openseq2seq.md §9 item 7: the shape-[1] scale bug is not reproduced."""
    out, n = clip_by_global_norm([T(5.0), T([[3.0]])], 1.0)
    assert out[0].shape == () and out[1].shape == (1, 1)
    np.testing.assert_allclose(out[0].item(), 5.0 / math.sqrt(34.0), rtol=1e-7)
    (g, v), = clip_gradients_by_norm([(T(10.0), T(1.0))], 2.0)
    assert g.shape == () and g.item() == 2.0


def test_clip_coefficient_values():
    assert clip_coefficient(T(13.0), 6.5).item() == 0.5
    assert clip_coefficient(T(5.0), 10.0).item() == 1.0
    assert clip_coefficient(T(0.0), 1.0).item() == 1.0
    assert math.isnan(clip_coefficient(T(INF), 1.0).item())
    assert math.isnan(clip_coefficient(T(NAN), 1.0).item())
    assert clip_coefficient(T(INF), 1.0, nan_on_nonfinite=False).item() == 0.0
    assert math.isnan(clip_coefficient(T(NAN), 1.0, nan_on_nonfinite=False).item())
    c = clip_coefficient(T([20.0]), T(5.0))
    assert c.shape == () and c.dtype == torch.float32 and c.item() == 0.25
    assert clip_coefficient(T(4.0, dtype=torch.float16), 1.0).dtype == torch.float32
    c64 = clip_coefficient(T(3.0, dtype=torch.float64), 1.0)
    assert c64.dtype == torch.float64 and c64.item() == 1.0 / 3.0
    with pytest.raises(ValueError, match="clip_norm"):
        clip_coefficient(T(1.0), 0.0)
    with pytest.raises(TypeError, match="norm"):
        clip_coefficient(1.0, 1.0)


def test_clip_factor_folds_the_unscale():
    """The one clip factor every clip calls (``_multi_tensor.clip_factor``) against float64 NumPy: for norms
    N of gradients scaled by S (``inv = 1/S``) it is ``inv·c/max(N·inv, c)``; the (N − N) term only when
    asked; a list of 0-d norms gives the norm vector's factors bit for bit."""
    from optkit import _multi_tensor as mt

    rng = np.random.default_rng(31)
    n = torch.tensor(rng.uniform(0.0, 40.0, 64), dtype=torch.float32)
    c, s = 2.5, 8.0
    got = mt.clip_factor(n, c, inv=torch.tensor(1.0 / s))
    want = (1.0 / s) * c / np.maximum(np64(n) / s, c)
    np.testing.assert_allclose(np64(got), want, rtol=3e-7, atol=0)
    assert np.any(np64(got) < 1.0 / s) and np.any(np64(got) == 1.0 / s)  # (both sides of the clip)
    assert torch.equal(torch.stack(mt.clip_factor(list(n.unbind()), c)), mt.clip_factor(n, c))
    bad = torch.tensor([INF, NAN, 1.0])
    assert np.isnan(np64(mt.clip_factor(bad, c, nan_on_nonfinite=True))[:2]).all()
    assert np64(mt.clip_factor(bad, c))[0] == 0.0


# ------------------------------------------------------------------------------------------------------------
# OpenSeq2Seq _clip_gradients_by_norm


def test_clip_gradients_by_norm_casts_to_variable_dtype(rng):
    g16 = torch.tensor(rng.standard_normal(5) * 8, dtype=torch.float16)
    g32 = torch.tensor(rng.standard_normal((2, 3)) * 8, dtype=torch.float32)
    v32, v16 = torch.zeros(5), torch.zeros(2, 3, dtype=torch.float16)
    vnone = torch.zeros(4)
    out = clip_gradients_by_norm([(g16, v32), (None, vnone), (g32, v16)], 1.0)
    assert [v for _, v in out] == [v32, vnone, v16] and out[0][1] is v32
    assert out[1][0] is None
    assert out[0][0].dtype == torch.float32 and out[2][0].dtype == torch.float16
    refs, n = ref_clip([np64(g16), np64(g32)], 1.0)
    # fp32 norm: the product is formed in fp32 and rounded once to the variable's dtype
    coef = clip_coefficient(global_norm([g16, g32]), 1.0)
    np.testing.assert_allclose(coef.item(), 1.0 / n, rtol=1e-6)
    assert torch.equal(out[0][0], g16.float() * coef)
    assert torch.equal(out[2][0], (g32 * coef).half())
    np.testing.assert_allclose(np64(out[0][0]), refs[0], rtol=1e-6)
    np.testing.assert_allclose(np64(out[2][0]), refs[1], rtol=1e-3)


def test_clip_gradients_by_norm_nonfinite_and_errors():
    out = clip_gradients_by_norm([(T([INF, 1.0]), torch.zeros(2)), (T([2.0]), torch.zeros(1))], 1.0)
    assert all(math.isnan(v) for g, _ in out for v in g.tolist())  # §9 item 8: NaN everywhere
    with pytest.raises(ValueError, match="clip_gradients"):
        clip_gradients_by_norm([(T([1.0]), T([0.0]))], 0.0)
    with pytest.raises(TypeError, match="pair"):
        clip_gradients_by_norm([T([1.0])], 1.0)
    with pytest.raises(TypeError, match="variable"):
        clip_gradients_by_norm([(T([1.0]), None)], 1.0)
    with pytest.raises(TypeError, match="grads_and_vars"):
        clip_gradients_by_norm(3, 1.0)
    assert clip_gradients_by_norm([], 1.0) == []
    # any iterable of pairs, e.g. zip
    (g, _), = clip_gradients_by_norm(zip([T([3.0, 4.0])], [torch.zeros(2)]), 1.0)
    np.testing.assert_allclose(g.numpy(), [0.6, 0.8], rtol=1e-7)


# ------------------------------------------------------------------------------------------------------------
# seeded random lists vs float64 NumPy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_clip_by_global_norm_random(rng, dtype):
    ts = random_list(rng, dtype)
    arrays = [np64(t) for t in ts]
    n_ref = np.sqrt(sum(np.sum(a**2) for a in arrays))
    rtol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    for c in (0.3 * n_ref, 0.9 * n_ref, 1.5 * n_ref):
        out, n = clip_by_global_norm([None, *ts], c)
        refs, _ = ref_clip(arrays, c)
        np.testing.assert_allclose(n.item(), n_ref, rtol=1e-6 if dtype != torch.float64 else 1e-12)
        assert out[0] is None
        for o, t, r in zip(out[1:], ts, refs):
            assert o.dtype == dtype and o.shape == t.shape
            np.testing.assert_allclose(np64(o), r, rtol=rtol, atol=1e-30)
        for t, a in zip(ts, arrays):  # out of place: inputs untouched
            np.testing.assert_array_equal(np64(t), a)


def test_clip_by_global_norm_mixed_dtypes_and_use_norm(rng):
    ts = [t.to(dt) for t, dt in zip(random_list(rng, n=4),
                                     [torch.float16, torch.float32, torch.float64, torch.bfloat16])]
    arrays = [np64(t) for t in ts]
    out, n = clip_by_global_norm(ts, 0.5)
    refs, n_ref = ref_clip(arrays, 0.5)
    assert n.dtype == torch.float64
    np.testing.assert_allclose(n.item(), n_ref, rtol=1e-6)
    for o, t, r in zip(out, ts, refs):
        assert o.dtype == t.dtype
        np.testing.assert_allclose(np64(o), r, rtol=8e-3)
    # use_norm is taken on trust
    un = T(123.0)
    out, n = clip_by_global_norm(ts, 0.5, use_norm=un)
    assert n is un
    np.testing.assert_allclose(np64(out[1]), arrays[1] * 0.5 / 123.0, rtol=1e-6)
    # a Python-number use_norm: the float64 entry's factor is formed in float64, as for a computed norm
    out, n = clip_by_global_norm(ts, 0.5, use_norm=0.7)
    assert n.dtype == torch.float64
    np.testing.assert_allclose(np64(out[2]), arrays[2] * (0.5 / 0.7), rtol=1e-15)


@pytest.mark.parametrize("dims", [None, 0, [1], [0, 1], (-1, 0)])
def test_clip_by_norm_random(rng, dims):
    t = torch.tensor(rng.standard_normal((4, 5)), dtype=torch.float32)
    t[2] = 0.0  # a zero row
    a = np64(t)
    for c in (0.5, 2.0, T(1.5)):
        out = clip_by_norm(t, c, dims)
        axes = tuple(range(2)) if dims is None else tuple(np.atleast_1d(dims))
        n = np.sqrt(np.sum(a**2, axis=axes, keepdims=True))
        cf = float(c)
        np.testing.assert_allclose(out.numpy(), a * cf / np.maximum(n, cf), rtol=1e-6, atol=1e-7)
        assert out.dtype == t.dtype and out.shape == t.shape
    np.testing.assert_array_equal(np64(t), a)


def test_clip_by_norm_half_and_scalar(rng):
    t = torch.full((1000,), 60.0, dtype=torch.float16)  # Σt² overflows fp16; fp32 arithmetic does not
    out = clip_by_norm(t, 1.0)
    assert out.dtype == torch.float16
    np.testing.assert_allclose(np64(out), np.full(1000, 1.0 / math.sqrt(1000.0)), rtol=1e-3)
    assert clip_by_norm(T(-4.0), 2.0).item() == -2.0
    assert clip_by_norm(T(-4.0), 2.0).shape == ()


def test_clip_by_norm_where_trick_gradient():
    x = torch.zeros(3, requires_grad=True)
    clip_by_norm(x, 1.0).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_clip_by_norm_errors():
    with pytest.raises(TypeError, match="t must"):
        clip_by_norm([1.0, 2.0], 1.0)
    with pytest.raises(TypeError, match="t must"):
        clip_by_norm(T([1, 2]), 1.0)
    with pytest.raises(TypeError, match="dims"):
        clip_by_norm(T([1.0]), 1.0, dims="0")
    with pytest.raises(TypeError, match="dims"):
        clip_by_norm(T([1.0]), 1.0, dims=[0.5])
    with pytest.raises(ValueError, match="dims"):
        clip_by_norm(T([[1.0]]), 1.0, dims=[0, 0])
    with pytest.raises(ValueError, match="dims"):
        clip_by_norm(T([[1.0]]), 1.0, dims=2)
    with pytest.raises(ValueError, match="clip_norm"):
        clip_by_norm(T([1.0]), NAN)
    with pytest.raises(TypeError, match="clip_norm"):
        clip_by_norm(T([1.0]), "1")


# ------------------------------------------------------------------------------------------------------------
# in-place forms


def _params(rng, dtype=torch.float32, n=5):
    ps = []
    for t in random_list(rng, dtype, n):
        p = torch.nn.Parameter(t.clone())
        p.grad = (t * 3.0).clone()
        ps.append(p)
    return ps


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_in_place_equals_out_of_place(rng, dtype):
    ts = random_list(rng, dtype)
    want, n_want = clip_by_global_norm(ts, 0.7)
    grads = [t.clone() for t in ts]
    n = clip_grads_by_global_norm_([None, *grads], 0.7)
    assert torch.equal(n, n_want)
    for g, w in zip(grads, want):
        assert torch.equal(g, w)


def test_in_place_params_and_none_grads(rng):
    ps = _params(rng)
    ps.append(torch.nn.Parameter(torch.ones(3)))  # grad None: skipped
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    grads = [np64(p.grad) for p in ps[:-1]]
    refs, n_ref = ref_clip(grads, 1.0)
    n = clip_grads_by_global_norm_(iter([*ps, frozen]), 1.0)  # any iterable, e.g. model.parameters()
    np.testing.assert_allclose(n.item(), n_ref, rtol=1e-6)
    for p, r in zip(ps, refs):
        np.testing.assert_allclose(np64(p.grad), r, rtol=1e-6)
    assert ps[-1].grad is None and frozen.grad is None
    # a single tensor (not a parameter) is clipped itself
    t = T([3.0, 4.0])
    assert clip_grads_by_global_norm_(t, 1.0).item() == 5.0
    np.testing.assert_allclose(t.numpy(), [0.6, 0.8], rtol=1e-7)
    assert clip_grads_by_global_norm_([], 1.0).item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_matches_torch_clip_grad_norm(rng, dtype):
    """Same result as torch.nn.utils.clip_grad_norm_ up to its max_norm/(N + 1e-6) epsilon."""
    ps = _params(rng, dtype)
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for p, q in zip(ps, qs):
        q.grad = p.grad.clone()
    n_ref = np.sqrt(sum(np.sum(np64(p.grad) ** 2) for p in ps))
    c = 0.25 * n_ref
    n = clip_grads_by_global_norm_(ps, c)
    n_t = torch.nn.utils.clip_grad_norm_(qs, c, foreach=True)
    np.testing.assert_allclose(n.item(), n_t.item(), rtol=1e-3 if dtype == torch.float16 else 1e-6)
    eps_rel = 1e-6 / n_ref
    rtol = {torch.float16: 2e-3, torch.float32: 1e-6, torch.float64: 1e-12}[dtype] + eps_rel
    for p, q in zip(ps, qs):
        np.testing.assert_allclose(np64(p.grad), np64(q.grad), rtol=rtol, atol=1e-30)
    # below the threshold: ours is exactly untouched, torch's differs by at most the epsilon
    g0 = [p.grad.clone() for p in ps]
    clip_grads_by_global_norm_(ps, 10 * n_ref)
    assert all(torch.equal(p.grad, g) for p, g in zip(ps, g0))


def test_in_place_nonfinite_modes():
    g = [T([INF, 1.0]), T([2.0])]
    n = clip_grads_by_global_norm_(g, 1.0)
    assert n.item() == INF and all(math.isnan(v) for t in g for v in t.tolist())
    g = [T([INF, 1.0]), T([2.0])]
    clip_grads_by_global_norm_(g, 1.0, nan_on_nonfinite=False)  # torch's behaviour
    assert math.isnan(g[0][0].item()) and g[0][1].item() == 0.0 and g[1].item() == 0.0
    g = [T([NAN, 1.0]), T([2.0])]
    before = [t.clone() for t in g]
    with pytest.raises(RuntimeError, match="nan"):
        clip_grads_by_global_norm_(g, 1.0, error_if_nonfinite=True)
    for a, b in zip(g, before):  # untouched after the failed call (NaN compares equal here)
        np.testing.assert_array_equal(np64(a), np64(b))


def test_clip_grads_by_norm_per_tensor(rng):
    ps = _params(rng)
    zero = torch.nn.Parameter(torch.ones(3))
    zero.grad = torch.zeros(3)
    grads = [np64(p.grad) for p in ps]
    norms = clip_grads_by_norm_([*ps, zero], 1.0)
    assert len(norms) == len(ps) + 1 and norms[-1].item() == 0.0
    for p, a, n in zip(ps, grads, norms):
        na = np.linalg.norm(a)
        np.testing.assert_allclose(n.item(), na, rtol=1e-6)
        np.testing.assert_allclose(np64(p.grad), a / max(na, 1.0), rtol=1e-6)
    assert zero.grad.tolist() == [0.0, 0.0, 0.0]
    g = [T([INF, 1.0]), T([3.0, 4.0])]
    clip_grads_by_norm_(g, 1.0)
    assert math.isnan(g[0][0].item()) and g[0][1].item() == 0.0
    np.testing.assert_allclose(g[1].numpy(), [0.6, 0.8], rtol=1e-7)
    # equals the out-of-place TF form up to rounding (c/max vs (t·c)/max)
    t = T([[3.0, 4.0], [0.3, 0.4]])
    want = clip_by_norm(t, 2.0)
    clip_grads_by_norm_([t], 2.0)
    np.testing.assert_allclose(t.numpy(), want.numpy(), rtol=1e-7)
    assert clip_grads_by_norm_([], 1.0) == []


def test_clip_grads_by_value(rng):
    ps = _params(rng)
    grads = [np64(p.grad) for p in ps]
    clip_grads_by_value_(ps, 0.5)
    for p, a in zip(ps, grads):
        np.testing.assert_array_equal(np64(p.grad), np.clip(a, -0.5, 0.5))
    g = T([NAN, -3.0, 0.1])
    clip_grads_by_value_(g, 1.0)
    assert math.isnan(g[0].item()) and g[1:].tolist() == [-1.0, pytest.approx(0.1)]
    clip_grads_by_value_(g, INF)


# ------------------------------------------------------------------------------------------------------------
# validation: errors name the argument and leave inputs untouched


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, NAN, INF])
def test_non_positive_clip_norm_rejected(rng, bad):
    ts = random_list(rng)
    before = [t.clone() for t in ts]
    with pytest.raises(ValueError, match="clip_norm"):
        clip_by_global_norm(ts, bad)
    with pytest.raises(ValueError, match="clip_norm"):
        clip_grads_by_global_norm_(ts, bad)
    with pytest.raises(ValueError, match="clip_norm"):
        clip_grads_by_norm_(ts, bad)
    with pytest.raises(ValueError, match="clip_gradients"):
        clip_gradients_by_norm([(t, t) for t in ts], bad)
    if not (isinstance(bad, float) and math.isinf(bad)):
        with pytest.raises(ValueError, match="clip_value"):
            clip_grads_by_value_(ts, bad)
    assert all(torch.equal(a, b) for a, b in zip(ts, before))


def test_type_errors_leave_inputs_untouched(rng):
    ts = random_list(rng)
    before = [t.clone() for t in ts]
    for bad in ("1.0", True, None, [1.0], T([1.0, 2.0])):
        with pytest.raises(TypeError, match="clip_norm"):
            clip_by_global_norm(ts, bad)
        with pytest.raises(TypeError, match="clip_norm"):
            clip_grads_by_global_norm_(ts, bad)
    with pytest.raises(TypeError, match="clip_norm"):
        clip_grads_by_global_norm_(ts, T([1, 2]))
    with pytest.raises(TypeError, match="use_norm"):
        clip_by_global_norm(ts, 1.0, use_norm="5")
    with pytest.raises(TypeError, match="use_norm"):
        clip_by_global_norm(ts, 1.0, use_norm=T([1.0, 2.0]))
    with pytest.raises(TypeError, match="t_list"):
        clip_by_global_norm(ts[0], 1.0)
    with pytest.raises(TypeError, match="t_list"):
        clip_by_global_norm(iter(ts), 1.0)
    with pytest.raises(TypeError, match="tensors_or_params"):
        clip_grads_by_global_norm_(5, 1.0)
    with pytest.raises(TypeError, match="tensors_or_params"):
        clip_grads_by_global_norm_([*ts, "x"], 1.0)  # the bad entry is last: nothing scaled before it
    with pytest.raises(TypeError, match="tensors_or_params"):
        clip_grads_by_norm_([*ts, T([1, 2])], 1.0)
    with pytest.raises(TypeError, match="clip_value"):
        clip_grads_by_value_(ts, "1")
    assert all(torch.equal(a, b) for a, b in zip(ts, before))


def test_tensor_clip_norm_is_taken_on_trust(rng):
    ts = random_list(rng)
    out, n = clip_by_global_norm(ts, T(0.5))
    refs, _ = ref_clip([np64(t) for t in ts], 0.5)
    for o, r in zip(out, refs):
        np.testing.assert_allclose(np64(o), r, rtol=1e-6)
    g = [t.clone() for t in ts]
    clip_grads_by_global_norm_(g, T(0.5))
    assert all(torch.equal(a, b) for a, b in zip(g, out))


def test_public_names():
    for name in optkit.clipping.__all__:
        assert getattr(optkit, name) is getattr(optkit.clipping, name)


# ------------------------------------------------------------------------------------------------------------
# properties

_arrays = st.lists(
    hnp.arrays(
        np.float32,
        hnp.array_shapes(min_dims=0, max_dims=3, max_side=6),
        elements=st.floats(-1e3, 1e3, width=32, allow_subnormal=False),
    ),
    min_size=1,
    max_size=5,
)
_clip = st.floats(1e-3, 1e3)


def _norm64(ts):
    return math.sqrt(sum(float(np.sum(np64(t) ** 2)) for t in ts))


@settings(max_examples=60, deadline=None)
@given(arrays=_arrays, c=_clip)
def test_property_global_clip(arrays, c):
    ts = [torch.from_numpy(a.copy()) for a in arrays]
    n = _norm64(ts)
    out, _ = clip_by_global_norm(ts, c)
    # bounded
    assert _norm64(out) <= c * (1 + 1e-6)
    # direction preserved: out = s · t with one s in (0, 1]
    s = c / max(n, c) if n > 0 else 1.0
    for o, t in zip(out, ts):
        np.testing.assert_allclose(np64(o), np64(t) * s, rtol=1e-6, atol=1e-30)
    # idempotent (up to the last ulp of the coefficient)
    again, _ = clip_by_global_norm(out, c)
    for a, b in zip(again, out):
        np.testing.assert_allclose(np64(a), np64(b), rtol=1e-6, atol=1e-30)
    # the in-place form agrees exactly
    g = [t.clone() for t in ts]
    clip_grads_by_global_norm_(g, c)
    assert all(torch.equal(a, b) for a, b in zip(g, out))


@settings(max_examples=40, deadline=None)
@given(
    a=hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=2, max_side=6),
                 elements=st.floats(-1e3, 1e3, width=32, allow_subnormal=False)),
    c=_clip,
    axis=st.sampled_from([None, 0, 1]),
)
def test_property_clip_by_norm(a, c, axis):
    t = torch.from_numpy(a.copy())
    out = np64(clip_by_norm(t, c, axis))
    axes = (0, 1) if axis is None else (axis,)
    assert np.all(np.sqrt(np.sum(out**2, axis=axes)) <= c * (1 + 1e-6))
    n = np.sqrt(np.sum(a.astype(np.float64) ** 2, axis=axes, keepdims=True))
    np.testing.assert_allclose(out, a * (c / np.maximum(n, c)), rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(np64(clip_by_norm(torch.from_numpy(out.astype(np.float32)), c, axis)), out,
                               rtol=1e-6, atol=1e-30)


def test_tensor_clip_norm_is_not_read_on_the_host():
    """A 0-d tensor ``clip_norm`` stays on the device (reading it would be a host sync, and fail inside a
    CUDA graph capture); a number past float32's range is inf there, as ``torch.tensor`` makes it."""
    from host_reads import HostReads

    g = [torch.randn(5, generator=torch.Generator().manual_seed(0))]
    norm = torch.linalg.vector_norm(g[0])
    mode = HostReads()
    with mode:
        coef = optkit.clip_coefficient(norm, torch.tensor(0.5))
        clipped, _ = optkit.clip_by_global_norm([g[0].clone()], torch.tensor(0.5))
    assert mode.reads == 0
    torch.testing.assert_close(coef, 0.5 / norm)
    torch.testing.assert_close(torch.linalg.vector_norm(clipped[0]), torch.tensor(0.5))
    assert optkit.clip_coefficient(norm, 1e39).isnan()  # inf/inf: TF's NaN for an infinite clip
