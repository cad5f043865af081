"""Reference tests ported from TensorFlow's clipping-op suites.

Upstream files (repository ``tensorflow/tensorflow``):

* ``tensorflow/python/kernel_tests/clip_ops_test.py`` (clip_by_value, clip_by_norm, clip_by_global_norm)
* ``tensorflow/python/ops/clip_ops_test.py`` (clip_by_norm of tensors and of ``IndexedSlices``)

against :func:`optkit.clip_by_norm`, :func:`optkit.clip_by_global_norm`, :func:`optkit.global_norm` and the
in-place :func:`optkit.clip_grads_by_value_`. The extra vectors of ``shared/spec/tf_keras.md`` §6 (checked
there against TF 2.21) are included. ``IndexedSlices`` become sparse COO tensors (hybrid COO when the slices
have trailing dimensions). ``clip_by_average_norm`` has no optkit counterpart and is not ported.
Deliberate differences follow ``docs/compatibility.md`` (rows "clipping: …").
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import optkit

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")

F16, F32, F64 = torch.float16, torch.float32, torch.float64


def T(values, dtype=F32):
    return torch.tensor(values, dtype=dtype)


def close(t, expected, tol=1e-6):
    np.testing.assert_allclose(t.detach().to(F64).numpy(), np.asarray(expected, dtype=np.float64),
                               rtol=tol, atol=tol)


def slices(values, indices, shape, dtype=F32):
    """``IndexedSlices(values, indices, dense_shape)`` as a (hybrid) sparse COO tensor."""
    return torch.sparse_coo_tensor(torch.tensor([indices]), torch.tensor(values, dtype=dtype), tuple(shape))


X6 = [[-3.0, 0.0, 0.0], [4.0, 0.0, 0.0]]  # norm 5
X6B = [[-3.0, 0.0, 0.0], [4.0, 0.0, 3.0]]  # column 0 norm 5, row 1 norm 5


# ------------------------------------------------------------------------------------------------------------
# clip_by_value


def test_clip_by_value():
    """kernel_tests/clip_ops_test.py: testClipByValue (clip to ±4.4)."""
    x = T([[-5.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    optkit.clip_grads_by_value_([x], 4.4)
    close(x, [[-4.4, 2.0, 3.0], [4.0, 4.4, 4.4]])


def test_clip_by_value_non_finite():
    """kernel_tests/clip_ops_test.py: testClipByValueNonFinite (NaN stays NaN, ±inf are clipped)."""
    x = T([float("nan"), float("inf"), -float("inf")])
    optkit.clip_grads_by_value_([x], 4.0)
    assert math.isnan(float(x[0])) and x[1:].tolist() == [4.0, -4.0]


def test_clip_by_value_indexed_slices():
    """kernel_tests/clip_ops_test.py: testClipByValueWithIndexedSlicesClipped, the symmetric [−2, 2] case (the
    in-place form clips to ±v only)."""
    values = [[[-3.0, 0.0, 0.0], [4.0, 0.0, 0.0]], [[0.0, 2.0, 0.0], [0.0, 0.0, -1.0]]]
    t = slices(values, [2, 6], [10, 2, 3])
    optkit.clip_grads_by_value_([t], 2.0)
    close(t._values(), [[[-2.0, 0.0, 0.0], [2.0, 0.0, 0.0]], [[0.0, 2.0, 0.0], [0.0, 0.0, -1.0]]])


# ------------------------------------------------------------------------------------------------------------
# clip_by_norm


@pytest.mark.parametrize("c,expected", [(4.0, [[-2.4, 0.0, 0.0], [3.2, 0.0, 0.0]]), (6.0, X6)],
                         ids=["clipped", "not_clipped"])
@pytest.mark.parametrize("clip_as_tensor", [False, True])
def test_clip_by_norm(c, expected, clip_as_tensor):
    """kernel_tests/clip_ops_test.py: testClipByNormClipped (tensor and scalar-tensor clip_norm) /
    testClipByNormNotClipped; ops/clip_ops_test.py: testClipTensorByNorm."""
    clip = torch.tensor(c) if clip_as_tensor else c
    close(optkit.clip_by_norm(T(X6), clip), expected)


def test_clip_by_norm_zero():
    """kernel_tests/clip_ops_test.py: testClipByNormZero and ops/clip_ops_test.py's zero-norm case."""
    out = optkit.clip_by_norm(torch.zeros(2, 3), 6.0)
    assert torch.equal(out, torch.zeros(2, 3))


@pytest.mark.parametrize(
    "dims,c,expected",
    [([0], 4.0, [[-2.4, 0.0, 0.0], [3.2, 0.0, 3.0]]),
     ([1], 4.0, [[-3.0, 0.0, 0.0], [3.2, 0.0, 2.4]]),
     ([1], 6.0, X6B)],
    ids=["dim0", "dim1", "dim1_not_clipped"],
)
def test_clip_by_norm_with_axes(dims, c, expected):
    """kernel_tests/clip_ops_test.py: testClipByNormClippedWithDim0 / …WithDim1 / testClipByNormNotClipped
    WithAxes."""
    close(optkit.clip_by_norm(T(X6B), c, dims), expected)


def test_clip_by_norm_gradient_at_zero():
    """kernel_tests/clip_ops_test.py: testClipByNormGradientZeros (the gradient of clip_by_norm at a zero
    tensor is ones, not NaN)."""
    x = torch.zeros(3, requires_grad=True)
    optkit.clip_by_norm(x, 1.0).sum().backward()
    assert torch.equal(x.grad, torch.ones(3))


def test_clip_by_norm_bad_clip_shape():
    """kernel_tests/clip_ops_test.py: testClipByNormBadShape (a two-element clip_norm is rejected; optkit
    raises TypeError where TF raised ValueError at graph construction)."""
    with pytest.raises(TypeError, match="clip_norm"):
        optkit.clip_by_norm(T([[[-3.0], [0.0], [0.0]], [[4.0], [0.0], [0.0]]]), T([1.0, 2.0]))


@pytest.mark.parametrize("axes", [None, [0], [1], [2], [0, 1], [0, 2], [1, 2], [0, 1, 2]],
                         ids=lambda a: "none" if a is None else "".join(map(str, a)))
def test_clip_indexed_slices_by_norm_matches_dense(axes):
    """ops/clip_ops_test.py: testClipIndexedSlicesByNorm (clipping the slices over their values tensor equals
    clipping the dense tensor, for every choice of axes; the result stays sparse)."""
    values = [[[-3.0, 0.0, 0.0], [4.0, 0.0, 0.0]], [[0.0, 2.0, 0.0], [0.0, 0.0, -1.0]]]
    t = slices(values, [2, 6], [10, 2, 3])
    clipped = optkit.clip_by_norm(t, 4.0, axes)
    assert clipped.is_sparse and clipped.shape == t.shape
    dense = optkit.clip_by_norm(t.to_dense(), 4.0, axes)
    close(clipped.to_dense(), dense.numpy())


def test_clip_by_norm_spec_examples():
    """tf_keras.md §6.1 (checked against TF 2.21): t = [[3,4],[0.3,0.4],[0,0]], c = 1 over all / each row /
    each column; an inf element; c = 0 on zeros (NaN); a negative c (zeros); duplicated slices."""
    t = T([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])
    close(optkit.clip_by_norm(t, 1.0), [[0.5970223, 0.7960298], [0.0597022, 0.0796030], [0, 0]])
    close(optkit.clip_by_norm(t, 1.0, [1]), [[0.6, 0.8], [0.3, 0.4], [0, 0]])
    close(optkit.clip_by_norm(t, 1.0, [0]), [[0.9950372, 0.9950372], [0.0995037, 0.0995037], [0, 0]])
    out = optkit.clip_by_norm(T([float("inf"), 1.0]), 1.0)
    assert math.isnan(float(out[0])) and float(out[1]) == 0.0
    assert bool(torch.isnan(optkit.clip_by_norm(torch.zeros(2), 0.0)).all())
    assert torch.equal(optkit.clip_by_norm(T([3.0, 4.0]), -1.0), torch.zeros(2))
    dup = optkit.clip_by_norm(slices([[3.0, 4.0], [3.0, 4.0]], [1, 1], [3, 2]), 5.0)
    close(dup._values(), [[2.1213203, 2.8284271]] * 2)


@pytest.mark.parametrize("dtype", [F16, F32, F64])
def test_clip_by_norm_keeps_dtype(dtype):
    """tf_keras.md §6.1 applied per dtype; compatibility.md row "clipping: arithmetic for half inputs" (the
    product is formed in fp32, rounded once)."""
    out = optkit.clip_by_norm(T(X6, dtype), 4.0)
    assert out.dtype == dtype
    close(out, [[-2.4, 0.0, 0.0], [3.2, 0.0, 0.0]], tol=1e-3 if dtype == F16 else 1e-6)


# ------------------------------------------------------------------------------------------------------------
# clip_by_global_norm

X0 = [[-2.0, 0.0, 0.0], [4.0, 0.0, 0.0]]
X1 = [1.0, -2.0]  # global norm of (X0, X1) is 5
X0_CLIPPED = [[-1.6, 0.0, 0.0], [3.2, 0.0, 0.0]]
X1_CLIPPED = [0.8, -1.6]


@pytest.mark.parametrize("clip", [4.0, torch.tensor(4.0)], ids=["float", "tensor"])
def test_clip_by_global_norm_clipped(clip):
    """kernel_tests/clip_ops_test.py: testClipByGlobalNormClipped / …ClippedTensor (scaled by 4/5; the
    returned norm is 5)."""
    (a, b), norm = optkit.clip_by_global_norm((T(X0), T(X1)), clip)
    close(norm, 5.0)
    close(a, X0_CLIPPED)
    close(b, X1_CLIPPED)


def test_clip_by_global_norm_supports_none():
    """kernel_tests/clip_ops_test.py: testClipByGlobalNormSupportsNone (None entries stay None in place)."""
    out, norm = optkit.clip_by_global_norm((T(X0), None, T(X1), None), 4.0)
    assert out[1] is None and out[3] is None
    close(norm, 5.0)
    close(out[0], X0_CLIPPED)
    close(out[2], X1_CLIPPED)


def test_clip_by_global_norm_with_indexed_slices():
    """kernel_tests/clip_ops_test.py: testClipByGlobalNormWithIndexedSlicesClipped (the slices' values take
    part in the norm and are scaled; indices kept)."""
    (a, b), norm = optkit.clip_by_global_norm([T(X0), slices([1.0, -2.0], [3, 4], [5])], 4.0)
    close(norm, 5.0)
    close(a, X0_CLIPPED)
    assert b.is_sparse and b._indices().tolist() == [[3, 4]]
    close(b._values(), X1_CLIPPED)


def test_clip_by_global_norm_preserves_dense_shape():
    """kernel_tests/clip_ops_test.py: testClipByGlobalNormPreservesDenseShape."""
    s = slices([1.0], [0], [1])
    (out,), _ = optkit.clip_by_global_norm([s], 1.0)
    assert tuple(out.shape) == (1,) and tuple(s.shape) == (1,)


def test_clip_by_global_norm_not_clipped():
    """kernel_tests/clip_ops_test.py: testClipByGlobalNormNotClipped (clip 6 > norm 5)."""
    (a, b), norm = optkit.clip_by_global_norm([T(X0), T(X1)], 6.0)
    close(norm, 5.0)
    close(a, X0)
    close(b, X1)


def test_clip_by_global_norm_zero():
    """kernel_tests/clip_ops_test.py: testClipByGlobalNormZero (zero norm: unchanged, no NaN)."""
    (a, b), norm = optkit.clip_by_global_norm([torch.zeros(2, 3), torch.zeros(2)], 6.0)
    assert float(norm) == 0.0
    assert torch.equal(a, torch.zeros(2, 3)) and torch.equal(b, torch.zeros(2))


def test_clip_by_global_norm_inf():
    """kernel_tests/clip_ops_test.py: testClipByGlobalNormInf (an inf anywhere: every output NaN, the returned
    norm is inf)."""
    x0 = T([[-2.0, 0.0, float("inf")], [4.0, 0.0, 0.0]])
    (a, b), norm = optkit.clip_by_global_norm([x0, T(X1)], 6.0)
    assert float(norm) == float("inf")
    assert bool(torch.isnan(a).all()) and bool(torch.isnan(b).all())


def test_clip_by_global_norm_spec_examples():
    """tf_keras.md §6.3 (checked against TF 2.21): use_norm taken on trust; duplicates counted in the norm;
    an all-None list gives norm 0."""
    out, norm = optkit.clip_by_global_norm([T([3.0, 4.0]), None, T([[12.0]])], 6.5)
    close(out[0], [1.5, 2.0])
    assert out[1] is None
    close(out[2], [[6.0]])
    close(norm, 13.0)
    out, norm = optkit.clip_by_global_norm([T([3.0, 4.0]), T([[12.0]])], 6.5, use_norm=26.0)
    close(out[0], [0.75, 1.0])
    close(out[1], [[3.0]])
    close(norm, 26.0)
    dup = slices([[3.0, 4.0], [3.0, 4.0]], [1, 1], [3, 2])
    out, norm = optkit.clip_by_global_norm([T([3.0, 4.0]), dup], 100.0)
    close(norm, 8.6602545)
    close(out[1]._values(), [[3.0, 4.0], [3.0, 4.0]])
    out, norm = optkit.clip_by_global_norm([None, None], 1.0)
    assert out == [None, None] and float(norm) == 0.0


def test_clip_by_global_norm_rejects_non_positive_clip_norm():
    """tf_keras.md §6.3: TF returns zeros for clip_norm 0 ([3, 4] → [0, 0]); optkit raises ValueError
    (compatibility.md, row "clipping: clip_by_global_norm with clip_norm <= 0")."""
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="clip_norm"):
            optkit.clip_by_global_norm([T([3.0, 4.0])], bad)


def test_clip_by_global_norm_sequence_checks():
    """tf_keras.md §6.2/§6.3: t_list must be a sequence of tensors, not a bare tensor or a string."""
    for bad in (T([3.0, 4.0]), "abc", 3.0):
        with pytest.raises(TypeError):
            optkit.clip_by_global_norm(bad, 1.0)
        with pytest.raises(TypeError):
            optkit.global_norm(bad)


def test_global_norm_mixed_dtypes_and_scalars():
    """tf_keras.md §6.2: TF rejects mixed dtypes; optkit accumulates them in fp32 (compatibility.md, row
    "clipping: dtypes of global_norm"), keeps 0-d entries 0-d (row "clipping: OpenSeq2Seq clip scale
    shape") and returns each output in its input's dtype."""
    h = T([3.0, 4.0], F16)
    s = torch.tensor(12.0)
    n = optkit.global_norm([h, s])
    assert n.dtype == F32
    close(n, 13.0)
    (oh, os_), _ = optkit.clip_by_global_norm([h, s], 6.5)
    assert oh.dtype == F16 and os_.shape == () and os_.dtype == F32
    close(oh, [1.5, 2.0], tol=1e-3)
    close(os_, 6.0)
    n64 = optkit.global_norm([T([3.0, 4.0], F64), T([12.0])])
    assert n64.dtype == F64 and float(n64) == 13.0


def test_global_norm_random_against_numpy(rng):
    """tf_keras.md §6.2 formula sqrt(Σ_i Σ t_i²), seeded random float64 tensors against NumPy."""
    arrays = [rng.standard_normal(s) for s in ((4, 3), (7,), (2, 2, 2))]
    expected = math.sqrt(sum(float((a * a).sum()) for a in arrays))
    n = optkit.global_norm([torch.tensor(a) for a in arrays])
    assert n.dtype == F64 and abs(float(n) - expected) < 1e-12
    out, _ = optkit.clip_by_global_norm([torch.tensor(a) for a in arrays], 0.5 * expected)
    for o, a in zip(out, arrays):
        close(o, a * 0.5, tol=1e-14)
