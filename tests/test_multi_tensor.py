"""Tests of the multi-tensor layer (``optkit._multi_tensor``) against float64 NumPy references.

Every kernel is checked on fp32, fp64, fp16 and bf16 inputs, mixed dtypes, ``None`` entries and sparse COO
tensors with duplicate indices. References are written from the formulas in the module's docstrings.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from optkit import _multi_tensor as mt

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# relative tolerance of a reduction accumulated in fp32 (fp64 for fp64 input), vs a float64 reference
RTOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 1e-5, torch.bfloat16: 1e-5}

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")


def np64(t: torch.Tensor) -> np.ndarray:
    """float64 NumPy copy of a dense tensor (the reference sees exactly the stored, rounded values)."""
    return t.detach().to(torch.float64).numpy().copy()


def make(rng: np.random.Generator, shape, dtype, scale=1.0) -> torch.Tensor:
    arr = rng.standard_normal(shape) * scale + 0.01  # never all zeros
    return torch.tensor(arr, dtype=torch.float64).to(dtype)


def make_list(rng, dtype, shapes=((7,), (3, 5), (), (2, 3, 4), (1,))):
    return [make(rng, s, dtype) for s in shapes]


def sparse_with_duplicates(rng, dtype=torch.float32) -> torch.Tensor:
    """Uncoalesced COO [6, 3] tensor whose rows 1 and 4 appear twice (raw values keep both copies)."""
    idx = torch.tensor([[1, 4, 1, 0, 4]])
    vals = make(rng, (5, 3), dtype)
    t = torch.sparse_coo_tensor(idx, vals, (6, 3))
    assert not t.is_coalesced()
    return t


# ------------------------------------------------------------------------------------------------------------
# views and grouping


def test_views_and_present(rng):
    t = make(rng, (3,), torch.float32)
    assert not mt.is_dtensor(t) and not mt.is_dtensor(3.0)
    assert mt.local(t) is t
    assert mt.values_of(t) is t
    sp = sparse_with_duplicates(rng)
    assert mt.values_of(sp).shape == (5, 3)
    assert mt.values_of(sp).data_ptr() == sp._values().data_ptr()
    assert mt.present([None, t, None, sp]) == [t, sp]
    assert mt.present([]) == []


def test_acc_dtype():
    assert mt.acc_dtype(torch.float64) == torch.float64
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        assert mt.acc_dtype(dt) == torch.float32


class _Sub(torch.Tensor):
    """A tensor subclass: takes the Python grouping path instead of torch's C++ one."""


def test_group_by_device_dtype_mixed_and_parallel(rng):
    dts = [torch.float32, torch.float16, torch.float32, torch.float64, torch.float16, torch.bfloat16]
    a = [make(rng, (i + 1,), dt) for i, dt in enumerate(dts)]
    b = [make(rng, (i + 1,), dt) for i, dt in enumerate(dts)]
    g = mt.group_by_device_dtype(a, b)
    cpu = torch.device("cpu")
    assert set(g) == {(cpu, torch.float32), (cpu, torch.float16), (cpu, torch.float64), (cpu, torch.bfloat16)}
    assert g[(cpu, torch.float32)][0] == [0, 2]
    assert g[(cpu, torch.float16)][0] == [1, 4]
    for (_, dtype), (idx, (la, lb)) in g.items():
        for j, i in enumerate(idx):
            assert la[j] is a[i] and lb[j] is b[i] and la[j].dtype == dtype
    # the Python path (a tensor subclass is not "plain") groups identically
    sub = [x.as_subclass(_Sub) for x in a]
    g2 = mt.group_by_device_dtype(sub, b)
    assert {k: v[0] for k, v in g2.items()} == {k: v[0] for k, v in g.items()}
    # parallel lists that disagree on dtype fall back to the Python path, grouped by the first list
    c = [x.to(torch.float64) for x in a]
    g3 = mt.group_by_device_dtype(a, c)
    assert {k: v[0] for k, v in g3.items()} == {k: v[0] for k, v in g.items()}
    assert mt.group_by_device_dtype([]) == {}


def test_all_plain_and_values_list(rng):
    t = make(rng, (3,), torch.float32)
    p = torch.nn.Parameter(t.clone())
    assert mt._all_plain([t, p])
    assert not mt._all_plain([t, t.as_subclass(_Sub)])
    sp = sparse_with_duplicates(rng)
    vals = mt._values_list([t, sp])
    assert vals[0] is t and vals[1].shape == (5, 3)


# ------------------------------------------------------------------------------------------------------------
# reductions


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_l2_and_inf(rng, dtype):
    ts = make_list(rng, dtype)
    n2 = mt.norms(ts)
    ninf = mt.norms(ts, math.inf)
    for t, a, b in zip(ts, n2, ninf):
        assert a.dtype == mt.acc_dtype(dtype) and a.shape == ()
        np.testing.assert_allclose(a.item(), np.sqrt(np.sum(np64(t) ** 2)), rtol=RTOL[dtype])
        np.testing.assert_allclose(b.item(), np.max(np.abs(np64(t))), rtol=RTOL[dtype])
    assert mt.norms([]) == []


def test_norms_half_accumulates_in_fp32():
    # 4096 elements of 300: Σx² = 3.7e8 overflows fp16 (max 65504), the norm 19200 does not.
    for dtype in (torch.float16, torch.bfloat16):
        t = torch.full((4096,), 300.0, dtype=dtype)
        (n,) = mt.norms([t])
        assert n.dtype == torch.float32
        np.testing.assert_allclose(n.item(), 300.0 * 64.0, rtol=1e-6)
        np.testing.assert_allclose(mt.global_norm([t]).item(), 19200.0, rtol=1e-6)
        np.testing.assert_allclose(mt.sum_of_squares([t]).item(), 19200.0**2, rtol=1e-6)
    # many bf16 elements: the fp32 accumulator is within 1e-4 (a bf16 result is off by ~1e-3)
    t = torch.full((100_000,), 0.1, dtype=torch.bfloat16)
    ref = math.sqrt(100_000) * float(torch.tensor(0.1, dtype=torch.bfloat16))
    np.testing.assert_allclose(mt.global_norm([t]).item(), ref, rtol=1e-4)
    assert abs(t.norm().item() - ref) > 1e-4 * ref


def test_norms_inf_of_empty_tensor_is_zero(rng):
    ts = [torch.empty(0), make(rng, (4,), torch.float32), torch.empty(0, 3)]
    res = mt.norms(ts, math.inf)
    assert res[0].item() == 0.0 and res[2].item() == 0.0
    np.testing.assert_allclose(res[1].item(), np.abs(np64(ts[1])).max(), rtol=1e-7)
    assert mt.max_abs(ts).item() == res[1].item()
    assert mt.norms([torch.empty(0)], 2.0)[0].item() == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_global_norm_sum_of_squares_max_abs(rng, dtype):
    ts = make_list(rng, dtype)
    with_none = [None, *ts[:2], None, *ts[2:]]
    ref_sq = sum(np.sum(np64(t) ** 2) for t in ts)
    ref_max = max(np.max(np.abs(np64(t))) for t in ts)
    want = torch.float64 if dtype == torch.float64 else torch.float32
    for fn, ref in ((mt.global_norm, np.sqrt(ref_sq)), (mt.sum_of_squares, ref_sq), (mt.max_abs, ref_max)):
        out = fn(with_none)
        assert out.shape == () and out.dtype == want
        np.testing.assert_allclose(out.item(), ref, rtol=RTOL[dtype])
    np.testing.assert_allclose(mt.sum_of_squares_raw(ts).item(), ref_sq, rtol=RTOL[dtype])
    # one tensor: the norm itself
    np.testing.assert_allclose(mt.global_norm([ts[0]]).item(), np.linalg.norm(np64(ts[0])), rtol=RTOL[dtype])


def test_reductions_mixed_dtypes(rng):
    ts = [make(rng, (5,), dt) for dt in DTYPES] + [make(rng, (2, 2), torch.float32)]
    ref_sq = sum(np.sum(np64(t) ** 2) for t in ts)
    out = mt.global_norm(ts)
    assert out.dtype == torch.float64  # any fp64 input makes the result fp64
    np.testing.assert_allclose(out.item(), np.sqrt(ref_sq), rtol=1e-6)
    np.testing.assert_allclose(mt.sum_of_squares(ts).item(), ref_sq, rtol=1e-6)
    np.testing.assert_allclose(mt.sum_of_squares_raw(ts).item(), ref_sq, rtol=1e-6)
    no64 = [t for t in ts if t.dtype != torch.float64]
    assert mt.global_norm(no64).dtype == torch.float32
    np.testing.assert_allclose(
        mt.max_abs(ts).item(), max(np.abs(np64(t)).max() for t in ts), rtol=1e-7)


def test_reductions_empty_and_all_none():
    for fn in (mt.global_norm, mt.sum_of_squares, mt.max_abs, mt.any_non_finite):
        for arg in ([], [None, None]):
            out = fn(arg)
            assert out.shape == () and out.dtype == torch.float32 and out.item() == 0.0


def test_reductions_sparse_count_raw_values(rng):
    sp = sparse_with_duplicates(rng)
    dense = make(rng, (4,), torch.float32)
    raw = np64(sp._values())
    coalesced = np64(sp.coalesce()._values())
    assert not np.isclose(np.sum(raw**2), np.sum(coalesced**2))  # duplicates matter
    ref = np.sqrt(np.sum(raw**2) + np.sum(np64(dense) ** 2))
    np.testing.assert_allclose(mt.global_norm([sp, dense]).item(), ref, rtol=1e-6)
    np.testing.assert_allclose(mt.norms([sp])[0].item(), np.sqrt(np.sum(raw**2)), rtol=1e-6)
    np.testing.assert_allclose(mt.max_abs([sp]).item(), np.abs(raw).max(), rtol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_flags(rng, dtype):
    ts = make_list(rng, dtype)
    assert mt.any_non_finite(ts).item() == 0.0
    for bad in (math.inf, -math.inf, math.nan):
        t2 = [t.clone() for t in ts]
        t2[3].view(-1)[5] = bad
        flag = mt.any_non_finite([None, *t2])
        assert flag.dtype == torch.float32 and flag.item() == 1.0
        assert math.isnan(mt.max_abs(t2).item()) == math.isnan(bad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_flags_of_large_tensors(rng, dtype):
    """Tensors of at least CHECK_READ_MIN elements take a read-only check (float32: scaled row sums, others
    aminmax; small ones the AMP kernel): a NaN or ±inf anywhere in either kind sets the flag, large finite
    values never do, and no value changes (compared bit for bit)."""
    n = mt.CHECK_READ_MIN + 37
    big = torch.from_numpy(rng.standard_normal(n)).to(dtype)
    big[7] = 6.0e4 if dtype == torch.float16 else 3.0e38 if dtype != torch.float64 else 1e300
    ts = [big, make(rng, (5, 3), dtype), make(rng, (n // 2 + 1, 2), dtype)]
    before = [t.clone() for t in ts]
    assert mt.any_non_finite(ts).item() == 0.0
    assert mt.global_norm_and_found_inf(ts)[1].item() == 0.0
    for a, b in zip(ts, before):
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    for which, pos in ((0, 0), (0, n - 1), (0, n // 2), (1, 4), (2, 17)):
        for bad in (math.inf, -math.inf, math.nan):
            t2 = [t.clone() for t in ts]
            t2[which].view(-1)[pos] = bad
            assert mt.any_non_finite(t2).item() == 1.0, (which, pos, bad)
            assert mt.global_norm_and_found_inf(t2)[1].item() == 1.0, (which, pos, bad)


def test_float32_row_sum_check_is_exact(rng):
    """Large float32 tensors are checked by scaled row sums (one matrix-vector product, read only): the flag
    is set exactly when an element is non-finite. Rows full of ±FLT_MAX, of subnormals or of mixed huge
    values never set it (no finite overflow); a NaN, +inf, −inf or +inf next to −inf (which sum to NaN) at
    a row's first or last element, in the tail after the last full row or in a second large tensor does."""
    fmax = float(torch.finfo(torch.float32).max)
    n = mt.CHECK_READ_MIN + 8 * mt._FINITE_ROW + 5
    base = torch.from_numpy(rng.standard_normal(n)).float()
    extremes = [torch.full((n,), fmax), torch.full((n,), -fmax), torch.full((n,), 1e-45),
                torch.from_numpy(rng.choice([fmax, -fmax, 3e38, 1e-40], n)).float()]
    for t in extremes:
        assert mt.any_non_finite([t]).item() == 0.0
        assert mt.global_norm_and_found_inf([t])[1].item() == 0.0
    big = base
    other = torch.from_numpy(rng.standard_normal(mt.CHECK_READ_MIN + 3 * mt._FINITE_ROW)).float()
    row = mt._FINITE_ROW
    for pos in (0, row - 1, row, 5 * row + 17, big.numel() - 1 - (big.numel() % row), big.numel() - 1):
        for bad in ((math.inf,), (-math.inf,), (math.nan,), (math.inf, -math.inf)):
            b = big.clone()
            for j, v in enumerate(bad):
                b[pos - j if pos > 0 else pos + j] = v
            before = b.clone()
            assert mt.any_non_finite([other, b]).item() == 1.0, (pos, bad)
            assert mt.global_norm_and_found_inf([b, other])[1].item() == 1.0, (pos, bad)
            assert torch.equal(b.view(torch.int32), before.view(torch.int32))  # read only
    o = other.clone()
    o[-1] = math.nan
    assert mt.any_non_finite([big, o]).item() == 1.0
    assert mt.any_non_finite([big, other]).item() == 0.0


@pytest.mark.parametrize("how", ["legacy", "backend"])
def test_row_sum_check_steps_aside_under_low_precision_matmul(how):
    """With float32 matrix products set to bfloat16 precision (which rounds FLT_MAX up to inf) the check
    falls back to aminmax: a tensor full of FLT_MAX is still finite, an inf still found."""
    backend, cuda = torch.backends.mkldnn.matmul, torch.backends.cuda.matmul
    before = (backend.fp32_precision, cuda.fp32_precision)  # (the legacy setter changes both)
    t = torch.full((mt.CHECK_READ_MIN + 3,), float(torch.finfo(torch.float32).max))
    try:
        if how == "legacy":
            torch.set_float32_matmul_precision("medium")
        else:
            backend.fp32_precision = "bf16"
        assert not mt._exact_cpu_matmul()
        assert mt.any_non_finite([t]).item() == 0.0
        t[5] = math.inf
        assert mt.any_non_finite([t]).item() == 1.0
    finally:
        if how == "legacy":
            torch.set_float32_matmul_precision("highest")
        backend.fp32_precision, cuda.fp32_precision = before
    assert mt._exact_cpu_matmul()
    assert torch.get_float32_matmul_precision() == "highest"  # the process is as it was


def test_non_finite_check_of_sparse_values(rng):
    """Sparse COO gradients are checked through their values (the AMP kernel takes the dense values, the
    sparse tensor itself it would refuse)."""
    sp = sparse_with_duplicates(rng)
    dense = make(rng, (3, 4), torch.float32)
    assert mt.any_non_finite([sp, dense]).item() == 0.0
    norm, found = mt.global_norm_and_found_inf([sp, dense])
    ref = np.sqrt(np.sum(np64(sp._values()) ** 2) + np.sum(np64(dense) ** 2))
    assert found.item() == 0.0 and abs(norm.item() - ref) <= 1e-6 * ref
    bad = torch.sparse_coo_tensor(sp._indices(), sp._values().clone(), sp.shape)
    bad._values()[1, 2] = math.inf
    assert mt.any_non_finite([bad, dense]).item() == 1.0
    assert mt.global_norm_and_found_inf([bad, dense])[1].item() == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_large_tensor_norms_are_row_norms_and_exact(rng, dtype):
    """Contiguous tensors of ``ROW_NORM_MIN`` elements or more take the row-norm path (norm of 1024-element
    row norms plus the tail); mixed with small and non-contiguous ones, every norm is the float64 reference
    to a few ulps (the two-level sum is more accurate than one long fp32 accumulation), in input order, and
    NaN/inf propagate."""
    n = mt.ROW_NORM_MIN
    ts = [make(rng, (n,), dtype), make(rng, (7,), dtype), make(rng, (n + 5,), dtype),
          make(rng, (3, n // 3 + 1), dtype).t(), make(rng, (1 << 20,), dtype) * 3, make(rng, (2, 3), dtype)]
    got = mt.norms(ts)
    tol = {torch.float32: 1e-6, torch.float64: 1e-13, torch.bfloat16: 1e-6}[dtype]
    for i, (g, t) in enumerate(zip(got, ts)):
        ref = float(np.sqrt(np.sum(np64(t) ** 2)))
        # rows: 0, 2, 4; torch's kernel (up to ~1e-5 off in fp32 accumulation) for the small and strided ones
        assert abs(g.item() - ref) <= (tol if i in (0, 2, 4) else max(tol, 2e-5)) * ref, i
    assert got[0].dtype == mt.acc_dtype(dtype)
    total = float(np.sqrt(sum(np.sum(np64(t) ** 2) for t in ts)))
    np.testing.assert_allclose(mt.global_norm(ts).item(), total, rtol=max(tol, 2e-5))
    for bad in (math.inf, math.nan):
        t2 = [t.clone() for t in ts]
        t2[2][n + 3] = bad  # in the tail
        t2[4][5000] = bad  # in a row
        res = mt.norms(t2)
        for i in (2, 4):
            assert math.isnan(res[i].item()) if math.isnan(bad) else res[i].item() == math.inf


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_expanded", [False, True])
def test_non_finite_check_leaves_values_and_takes_every_layout(rng, dtype, with_expanded):
    """The check runs torch's AMP kernel with an inverse scale of 1 (it rewrites the values): every value,
    -0.0 included, stays bit-identical; transposed, sliced and channels-last tensors are checked; an expanded
    tensor (elements sharing memory: the kernel refuses it) falls back to the per-tensor max-abs; the flag of
    ``global_norm_and_found_inf`` agrees, and its norm is the float64 reference."""
    odd = [make(rng, (6, 5), dtype).t(), make(rng, (4, 8), dtype)[:, ::2],
           make(rng, (2, 3, 4, 5), dtype).to(memory_format=torch.channels_last),
           torch.tensor([-0.0, 1.5], dtype=dtype)]
    base = make_list(rng, dtype) + odd

    def tensors(bad_at=None, bad=0.0):
        ts = [t.clone(memory_format=torch.preserve_format) for t in base]
        if with_expanded:
            ts.append(torch.full((1,), bad if bad_at == len(base) else 2.0, dtype=dtype).expand(7))
        if bad_at is not None and bad_at < len(base):
            ts[bad_at][(0,) * ts[bad_at].dim()] = bad
        return ts

    ts = tensors()
    before = [t.clone() for t in ts]
    ref = math.sqrt(sum(float((t.double() ** 2).sum()) for t in ts))
    assert mt.any_non_finite(ts).item() == 0.0
    norm, found = mt.global_norm_and_found_inf(ts)
    assert found.item() == 0.0 and abs(norm.item() - ref) <= 1e-5 * ref
    for a, b in zip(ts, before):
        assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    for at in (1, len(base) - 4, len(base) - 1, len(base) if with_expanded else 0):
        for bad in (math.inf, -math.inf, math.nan):
            t2 = tensors(at, bad)
            assert mt.any_non_finite(t2).item() == 1.0, (at, bad)
            assert mt.global_norm_and_found_inf(t2)[1].item() == 1.0, (at, bad)


# ------------------------------------------------------------------------------------------------------------
# in-place kernels


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_number_and_tensor(rng, dtype):
    ts = make_list(rng, dtype)
    refs = [np64(t) for t in ts]
    mt.scale_([None, *ts], 0.37)
    factor = 0.37 if dtype == torch.float64 else float(np.float32(0.37))  # the factor's fp32 rounding
    for t, r in zip(ts, refs):
        np.testing.assert_array_equal(np64(t), np64(torch.tensor(r * factor).to(dtype)))
    refs = [np64(t) for t in ts]
    s = torch.tensor(0.4567891, dtype=torch.float32)
    mt.scale_(ts, s)
    for t, r in zip(ts, refs):
        # the factor stays fp32 for half groups: one rounding of the exact product (fp64 product for fp64)
        exact = r * (float(s) if dtype != torch.float64 else float(s.double()))
        np.testing.assert_array_equal(np64(t), np64(torch.tensor(exact).to(dtype)))


def test_scale_per_tensor_list_with_none(rng):
    ts = [make(rng, (4,), torch.float32), None, make(rng, (2, 2), torch.float16),
          make(rng, (3,), torch.float64)]
    refs = [None if t is None else np64(t) for t in ts]
    # one factor per entry of the full list, None positions included (their factor is ignored)
    scales = [torch.tensor(0.5), torch.tensor(99.0), torch.tensor(2.0),
              torch.tensor(-0.25, dtype=torch.float64)]
    mt.scale_(ts, scales)
    for t, r, s in zip(ts, refs, scales):
        if t is not None:
            np.testing.assert_array_equal(np64(t), r * float(s))  # powers of two: exact
    mt.scale_([], 2.0)
    mt.scale_([None], 2.0)


def test_scale_sparse_scales_raw_values(rng):
    sp = sparse_with_duplicates(rng)
    raw = np64(sp._values())
    mt.scale_([sp], torch.tensor(0.5))
    np.testing.assert_allclose(np64(sp._values()), raw * 0.5, rtol=1e-7)
    assert not sp.is_coalesced()


@pytest.mark.parametrize("dtype", DTYPES)
def test_clamp(rng, dtype):
    ts = make_list(rng, dtype)
    ts[0][0] = math.nan
    refs = [np64(t) for t in ts]
    mt.clamp_([None, *ts], -0.5, 0.25)
    for t, r in zip(ts, refs):
        np.testing.assert_array_equal(np64(t), np.clip(r, -0.5, 0.25))  # NaN stays NaN
    sp = sparse_with_duplicates(rng)
    raw = np64(sp._values())
    mt.clamp_([sp], -0.1, 0.1)
    np.testing.assert_array_equal(np64(sp._values()), np.clip(raw, -0.1, 0.1).astype(np.float32))
    mt.clamp_([], 0.0, 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lerp_float_and_tensor_weight(rng, dtype):
    half = dtype in (torch.float16, torch.bfloat16)
    tol = {"rtol": 1e-2, "atol": 1e-2} if half else {"rtol": 1e-6, "atol": 1e-7}
    tg = make_list(rng, dtype)
    src = make_list(rng, dtype)
    a, b = [np64(t) for t in tg], [np64(t) for t in src]
    mt.lerp_(tg, src, 0.3)
    for t, x, y in zip(tg, a, b):
        np.testing.assert_allclose(np64(t), x + 0.3 * (y - x), **tol)
    a = [np64(t) for t in tg]
    w = torch.tensor(0.125)
    mt.lerp_(tg, src, w)
    for t, x, y in zip(tg, a, b):
        np.testing.assert_allclose(np64(t), x + 0.125 * (y - x), **tol)
    # a zero tensor weight (a skipped step) leaves the targets bit-identical
    before = [t.clone() for t in tg]
    mt.lerp_(tg, src, torch.tensor(0.0))
    for t, bt in zip(tg, before):
        assert torch.equal(t, bt)
    mt.lerp_([], [], 0.5)


def test_lerp_mixed_dtypes(rng):
    tg = [make(rng, (3,), torch.float32), make(rng, (3,), torch.float64)]
    src = [make(rng, (3,), torch.float32), make(rng, (3,), torch.float64)]
    a, b = [np64(t) for t in tg], [np64(t) for t in src]
    mt.lerp_(tg, src, torch.tensor(0.75))
    for t, x, y in zip(tg, a, b):
        np.testing.assert_allclose(np64(t), x + 0.75 * (y - x), rtol=1e-6)


def test_blocks_cover_every_element_once(rng):
    a = [make(rng, s, torch.float32) for s in [(5,), (40,), (3, 4), (7,), (2,)]]
    b = [t.clone() for t in a]
    bl = mt.blocks([a, b], block_numel=16)
    seen = {i: 0 for i in range(len(a))}
    for owners, (ca, cb) in bl:
        assert len(owners) == len(ca) == len(cb)
        for i, x, y in zip(owners, ca, cb):
            seen[i] += x.numel()
            assert torch.equal(x, y)
    assert seen == {i: t.numel() for i, t in enumerate(a)}
    # chunks are views: writing through them reaches the original tensors
    for _, (ca, _) in bl:
        for x in ca:
            x.mul_(2.0)
    for t, r in zip(a, b):
        assert torch.equal(t, r * 2)
    # the big tensor is split into chunks of at most block_numel
    assert sum(1 for owners, _ in bl if owners == [1]) == 3
    # non-contiguous big tensors stay whole
    nc = make(rng, (8, 8), torch.float32).t()
    assert [o for o, _ in mt.blocks([[nc]], block_numel=16)] == [[0]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_check_and_unscale(rng, dtype):
    ts = make_list(rng, dtype)
    refs = [np64(t) for t in ts]
    found = torch.zeros(())
    inv = torch.tensor(0.25)
    out = mt.non_finite_check_and_unscale_([None, *ts], found, inv)
    assert out is found and found.item() == 0.0
    for t, r in zip(ts, refs):
        np.testing.assert_array_equal(np64(t), np64(torch.tensor(r * 0.25).to(dtype)))
    for bad in (math.inf, math.nan):
        t2 = [t.clone() for t in ts]
        t2[1][1, 1] = bad
        found = torch.zeros(())
        mt.non_finite_check_and_unscale_(t2, found, inv)
        assert found.item() == 1.0
    # the flag is OR-ed into: a set flag stays set after a finite batch
    found = torch.ones(())
    mt.non_finite_check_and_unscale_(ts, found, torch.tensor(1.0))
    assert found.item() == 1.0
    assert mt.non_finite_check_and_unscale_([None], torch.zeros(()), inv).item() == 0.0


def test_non_finite_check_mixed_and_sparse(rng):
    ts = [make(rng, (4,), dt) for dt in DTYPES]
    sp = sparse_with_duplicates(rng)
    raw = np64(sp._values())
    refs = [np64(t) for t in ts]
    found = torch.zeros(())
    mt.non_finite_check_and_unscale_([*ts, sp], found, torch.tensor(2.0))
    assert found.item() == 0.0
    np.testing.assert_allclose(np64(sp._values()), raw * 2.0)
    for t, r in zip(ts, refs):
        np.testing.assert_allclose(np64(t), r * 2.0)
    sp._values()[2, 0] = math.inf
    mt.non_finite_check_and_unscale_([ts[0], sp], found, torch.tensor(1.0))
    assert found.item() == 1.0


def test_reduce_flag_without_dtensors_is_identity(rng):
    flag = torch.tensor(1.0)
    assert mt.reduce_flag_(flag, [make(rng, (2,), torch.float32)]) is flag and flag.item() == 1.0
    parts = [torch.tensor(1.0), torch.tensor(2.0)]
    assert mt._combine_partials([torch.ones(1), torch.ones(1)], parts, "sum") == parts


def test_add_scaled_mixed_dtypes_and_none(rng):
    tg = [make(rng, (4,), torch.float32), None, make(rng, (2, 3), torch.float16),
          make(rng, (3,), torch.float64)]
    src = [make(rng, (4,), torch.float64), make(rng, (2,), torch.float32), make(rng, (2, 3), torch.float32),
           make(rng, (3,), torch.float64)]
    a = [None if t is None else np64(t) for t in tg]
    b = [np64(x) for x in src]
    mt.add_scaled_(tg, src, -0.3)
    assert tg[1] is None
    for t, x, y in zip(tg, a, b):
        if t is not None:
            tol = 2e-3 if t.dtype == torch.float16 else 1e-6
            np.testing.assert_allclose(np64(t), x - 0.3 * y, rtol=tol, atol=tol)
    mt.add_scaled_([None], [torch.ones(1)], 1.0)


def test_commit_with_and_without_skip(rng):
    tg = [make(rng, (4,), torch.float32), make(rng, (2, 2), torch.float64)]
    new = [make(rng, (4,), torch.float32), make(rng, (2, 2), torch.float64)]
    new[0][1] = math.nan  # a skipped step must leave no trace of non-finite values
    before = [t.clone() for t in tg]
    mt.commit_(tg, new, skip=torch.tensor(True))
    assert all(torch.equal(t, b) for t, b in zip(tg, before))
    mt.commit_(tg, new, skip=torch.tensor(False))
    np.testing.assert_array_equal(np64(tg[0]), np64(new[0]))
    np.testing.assert_array_equal(np64(tg[1]), np64(new[1]))
    fresh = [make(rng, (4,), torch.float32), make(rng, (2, 2), torch.float64)]
    mt.commit_(tg, fresh)
    assert all(torch.equal(t, f) for t, f in zip(tg, fresh))
    mt.commit_([], [])


_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
         torch.float64: torch.int64}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_commit_on_the_bits_selects_every_bit_pattern_exactly(dtype):
    """The GPU form of a skippable write (three multi-tensor integer ops on the bits, run here on CPU
    tensors) gives the new value or the old one bit for bit: random bit patterns (NaN payloads,
    infinities, subnormals, signed zeros among them) and the extreme patterns whose difference wraps."""
    g = torch.Generator().manual_seed(7)
    bits = _BITS[dtype]
    info = torch.iinfo(bits)

    def patterns(shape):
        return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(bits).view(dtype)

    shapes = [(64,), (3, 5), (), (2, 1, 4)]
    for skip in (True, False):
        tg, new = [patterns(s) for s in shapes], [patterns(s) for s in shapes]
        tg[0][:4] = torch.tensor([0.0, -0.0, math.inf, -math.inf], dtype=dtype)
        new[0][:4] = torch.tensor([-0.0, 0.0, -math.inf, math.nan], dtype=dtype)
        extremes = torch.tensor([info.min, info.max, info.max, info.min], dtype=bits).view(dtype)
        tg[0][4:8], new[0][4:8] = extremes, extremes.flip(0)
        want = [(t if skip else n).view(bits).clone() for t, n in zip(tg, new)]
        mt.commit_(tg, new, skip=torch.tensor(skip), per_tensor=False)
        for t, w in zip(tg, want):
            assert torch.equal(t.view(bits), w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_along(rng, dtype):
    ts = [make(rng, (4, 5), dtype), make(rng, (3, 2, 2), dtype), make(rng, (6,), dtype), make(rng, (), dtype)]
    dims = [(1,), (0, -1), (0,), ()]
    out = mt.norms_along(ts, dims)
    for t, d, o in zip(ts, dims, out):
        axes = tuple(k % max(t.ndim, 1) for k in d)
        ref = np.sqrt(np.sum(np64(t) ** 2, axis=axes, keepdims=True)) if axes else np.abs(np64(t))
        assert o.dtype == mt.acc_dtype(dtype) and o.shape == ref.shape
        np.testing.assert_allclose(np64(o), ref, rtol=RTOL[dtype])
    assert mt._crossing_mesh_dims(ts[0], (1,)) is None


# ------------------------------------------------------------------------------------------------------------
# out-of-place kernel


@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_copies_dtype_and_rounding(rng, dtype):
    ts = make_list(rng, dtype)
    before = [t.clone() for t in ts]
    s = torch.tensor(0.3141, dtype=torch.float32)
    out = mt.scaled_copies([None, *ts, None], s)
    assert out[0] is None and out[-1] is None
    for t, o, b in zip(ts, out[1:-1], before):
        assert o.dtype == dtype and o.shape == t.shape and o.data_ptr() != t.data_ptr()
        assert torch.equal(t, b)  # inputs untouched
        exact = np64(t) * (float(s) if dtype != torch.float64 else float(s.double()))
        np.testing.assert_array_equal(np64(o), np64(torch.tensor(exact).to(dtype)))


def test_scaled_copies_out_dtypes_and_sparse(rng):
    g16 = make(rng, (5,), torch.float16)
    g32 = make(rng, (3, 2), torch.float32)
    sp = sparse_with_duplicates(rng)
    s = torch.tensor(0.7)
    out = mt.scaled_copies([g16, g32, sp, None], s, out_dtypes=[torch.float32, torch.float16, torch.float32,
                                                                 torch.float32])
    assert out[0].dtype == torch.float32
    np.testing.assert_array_equal(np64(out[0]), np64(torch.tensor(np64(g16) * float(s)).float()))
    assert out[1].dtype == torch.float16
    np.testing.assert_array_equal(np64(out[1]), np64((g32 * s).half()))
    assert out[2].is_sparse and not out[2].is_coalesced()
    assert torch.equal(out[2]._indices(), sp._indices())
    np.testing.assert_allclose(np64(out[2]._values()), np64(sp._values()) * float(s), rtol=1e-7)
    assert out[3] is None
    assert mt.scaled_copies([], s) == []


# ------------------------------------------------------------------------------------------------------------
# DTensor paths (one rank, in a subprocess so the test process keeps no process group)

_DTENSOR_SCRIPT = textwrap.dedent(
    """
    import math, sys, tempfile, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from optkit import _multi_tensor as mt

    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(8, 3, generator=g) + 0.01
        y = torch.randn(5, generator=g) + 0.01
        dx = distribute_tensor(x, mesh, [Shard(0)])
        dy = distribute_tensor(y, mesh, [Replicate()])
        ts = [dx, dy, torch.ones(2)]
        assert mt.is_dtensor(dx) and mt.local(dx).shape == (8, 3)
        ref = math.sqrt(float((x.double() ** 2).sum() + (y.double() ** 2).sum() + 2))
        assert abs(mt.global_norm(ts).item() - ref) < 1e-5 * ref
        n = mt.norms(ts)
        assert abs(n[0].item() - x.norm().item()) < 1e-5
        assert abs(mt.max_abs(ts).item() - max(x.abs().max().item(), y.abs().max().item(), 1.0)) < 1e-7
        out = mt.scaled_copies(ts, torch.tensor(0.5))
        assert mt.is_dtensor(out[0]) and out[0].placements == dx.placements
        assert torch.allclose(out[0].full_tensor(), x * 0.5)
        flag = torch.zeros(())
        mt.non_finite_check_and_unscale_(ts, flag, torch.tensor(2.0))
        assert flag.item() == 0.0 and torch.allclose(dx.full_tensor(), x * 2)
        assert mt.any_non_finite(ts).item() == 0.0
        mt.scale_(ts, torch.tensor(0.5))
        assert torch.allclose(dx.full_tensor(), x)
        assert mt._crossing_mesh_dims(dx, (0,)) is not None and mt._crossing_mesh_dims(dx, (1,)) is None
        rows, cols = mt.norms_along([dx, dx], [(1,), (0,)])
        assert torch.allclose(rows, x.norm(dim=1, keepdim=True), rtol=1e-5)
        assert torch.allclose(cols, x.norm(dim=0, keepdim=True), rtol=1e-5)
        print("ok")
    finally:
        dist.destroy_process_group()
    """
)


def test_dtensor_paths_single_rank():
    res = subprocess.run([sys.executable, "-c", _DTENSOR_SCRIPT], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_scalar_rounds_as_torch_tensor_does(dtype):
    """``mt.scalar`` (a fill kernel, no host-to-device copy) gives the value ``torch.tensor`` gives: rounded
    to the dtype, and ±inf for a finite number beyond its range (the fill alone would refuse it)."""
    top = float(torch.finfo(dtype).max)
    for v in [0.05, -1.5e-3, 1 / 3, top, -top, top * 1.0000001, 1e39, -1e39, 1e300, float("inf"),
              float("-inf")]:
        got, want = mt.scalar(v, dtype, "cpu"), torch.tensor(v, dtype=dtype)
        assert got.dtype == dtype and got.shape == ()
        assert torch.equal(got, want), (v, got, want)
    assert mt.scalar(float("nan"), dtype, "cpu").isnan()


def test_foreach_chain_stages_half_dtypes_on_any_device():
    """The foreach pseudo-kernel runs anywhere: on a device it has no entry for, half tensors are staged in
    float32 (not handed to the caller's fallback); a real kernel with no entry falls back."""
    from optkit._core import fused as _fused

    lists = [[torch.zeros(4, dtype=torch.float16)], [torch.zeros(4, dtype=torch.float16)]]
    for dev in ("mps", "xpu"):
        parts = _fused.partition("foreach", torch.device(dev), torch.float16, lists)
        assert [p.mode for p in parts] == ["staged"]
        parts = _fused.partition("sgd", torch.device(dev), torch.float16, lists)
        assert [p.mode for p in parts] == ["fallback"]
    f64 = [[torch.zeros(4, dtype=torch.float64)], [torch.zeros(4, dtype=torch.float64)]]
    cuda = torch.device("cuda")
    assert [p.mode for p in _fused.partition("sgd", cuda, torch.float64, f64)] == ["fallback"]
    assert [p.mode for p in _fused.partition("foreach", cuda, torch.float64, f64)] == ["native"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_compiled_norm_and_check_pass_matches_the_eager_one(rng, dtype):
    """``global_norm_and_found_inf(compiled=...)`` with the compiled
    :func:`optkit._core.chain.norm_check_sums` (the train op's pass under ``jit_compile``: both sums per
    tensor from one read): the norm is the float64 reference and the eager result; the flag is set exactly
    when an element is NaN or ±inf (first, last, inside a row, in the tail after the last full row, in a
    small or a transposed tensor), never by large finite values whose squares overflow (the norm is then inf,
    as the eager one); nothing is written."""
    from optkit._core import chain as _compile

    compiled = _compile.compiled_function(_compile.norm_check_sums)
    n = 3 * _compile.SUM_ROW + 37
    ts = [make(rng, (n,), dtype), make(rng, (5, 3), dtype), make(rng, (40, 300), dtype).t(),
          torch.zeros(0, dtype=dtype)]
    before = [t.clone() for t in ts]
    norm, found = mt.global_norm_and_found_inf(ts, compiled=compiled)
    want = math.sqrt(sum(float(t.double().square().sum()) for t in ts))
    assert norm.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) and found.item() == 0.0
    assert norm.item() == pytest.approx(want, rel=1e-12 if dtype == torch.float64 else 1e-6)
    eager = mt.global_norm_and_found_inf(ts)
    assert norm.item() == pytest.approx(eager[0].item(), rel=1e-12 if dtype == torch.float64 else 1e-5)
    for a, b in zip(ts, before):
        assert torch.equal(a, b)
    for which, pos in ((0, 0), (0, n - 1), (0, _compile.SUM_ROW + 5), (1, 4), (2, 77)):
        for bad in (math.inf, -math.inf, math.nan):
            t2 = [t.clone() for t in ts]
            cols = t2[which].shape[-1]
            t2[which][divmod(pos, cols) if t2[which].dim() == 2 else pos] = bad
            assert mt.global_norm_and_found_inf(t2, compiled=compiled)[1].item() == 1.0, (which, pos, bad)
    if dtype != torch.float64:
        huge = [t.clone() for t in ts]
        huge[0][5] = 3.0e38
        norm, found = mt.global_norm_and_found_inf(huge, compiled=compiled)
        eager = mt.global_norm_and_found_inf(huge)
        assert found.item() == 0.0 and eager[1].item() == 0.0
        assert math.isinf(norm.item()) and math.isinf(eager[0].item())
