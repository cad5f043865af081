"""The low-precision formats of ``optkit._core.lowp`` against float64 NumPy references written from their
formulas (never by calling ``lowp``): the 8-bit dynamic tree map (Dettmers 2016, "8-Bit Approximations for
Parallelism in Deep Learning"), block-wise quantisation (Dettmers et al. 2022, "8-bit Optimizers via
Block-wise Quantization": blocks of 256 along each row of dim 0), the split fp32 master (high half bf16, low
half int16; Zamirai et al. 2020), stochastic rounding to bf16 (Gupta et al. 2015) and the Kahan-compensated
bf16 write (Kahan 1965).

bfloat16 round-to-nearest-even is emulated in NumPy on the uint32 bit patterns (``_rn_bf16``): add
``0x7FFF + (bit 16)`` and clear the low half (NaN kept a NaN)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lean_reference import dynamic_map_np
from optkit._core import lowp

F32, BF16 = torch.float32, torch.bfloat16


# ------------------------------------------------------------------------------------------ NumPy references

def _np_map(signed: bool) -> np.ndarray:
    """The dynamic tree map from its definition (:func:`lean_reference.dynamic_map_np`), as float32."""
    return dynamic_map_np(signed).astype(np.float32)


def _np_blocks(shape) -> tuple[int, int]:
    """(rows, row length): rows along dim 0; a 1-d tensor is one row."""
    n = int(np.prod(shape))
    rows = shape[0] if len(shape) >= 2 else 1
    return rows, n // rows


def _np_quantize(x: np.ndarray, signed: bool):
    """Reference block-wise quantisation in float64: per block of 256 along each row (the last one partial),
    ``a = max |x|`` (signed: ``max(max x, min x / Q[0])``), code = index of the map value nearest to ``x/a``.
    Also returns ``ambiguous``: elements whose ``x/a`` lies within 8 float32 ulps of the midpoint between two
    map values (a near-tie: float32 arithmetic may pick either neighbour)."""
    q = _np_map(signed).astype(np.float64)
    mids = (q[1:] + q[:-1]) / 2
    rows, length = _np_blocks(x.shape)
    flat = x.astype(np.float64).reshape(rows, length)
    nb = -(-length // 256)
    codes = np.zeros((rows, length), np.int64)
    scales = np.zeros((rows, nb), np.float64)
    amb = np.zeros((rows, length), bool)
    for r in range(rows):
        for b in range(nb):
            sl = slice(b * 256, min((b + 1) * 256, length))
            blk = flat[r, sl]
            # the scale: the absolute maximum, or (signed map, which has no −1) max(max x, min x / Q[0]) in
            # float32, so that a block's most negative element is Q[0]·a
            a = np.float32(np.abs(blk).max())
            if signed:
                a = max(np.float32(blk.max()), np.float32(blk.min()) / np.float32(q[0]))
            scales[r, b] = a
            t = blk / a if a > 0 else np.zeros_like(blk)  # (an all-zero block: every element the map's 0)
            codes[r, sl] = np.abs(t[:, None] - q[None, :]).argmin(axis=1)
            d = np.abs(t[:, None] - mids[None, :]).min(axis=1)
            amb[r, sl] = d <= 8 * np.spacing(np.float32(np.abs(t) + 1e-30)).astype(np.float64)
    shape_s = (rows, nb) if x.ndim >= 2 else (nb,)
    return codes.reshape(x.shape), scales.reshape(shape_s), amb.reshape(x.shape)


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


def _rn_bf16(x: np.ndarray) -> np.ndarray:
    """float32 → nearest bfloat16 (ties to even), as float32, on the bit patterns."""
    b = _bits(x).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    out = r.view(np.float32).copy()
    nan = np.isnan(x)
    out[nan] = x[nan]
    return out


def _f32(x) -> np.ndarray:
    """float64 → float32 (one rounding: the result of a float32 add/sub of float32 operands)."""
    return np.asarray(x, np.float64).astype(np.float32)


def _torch_bf16_as_f32(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy()


# ------------------------------------------------------------------------------------------ dynamic map

@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_is_the_formula(signed):
    q = lowp.dynamic_map(signed)
    assert q.dtype == F32 and q.shape == (256,)
    v = q.numpy()
    assert np.all(np.diff(v) > 0)  # sorted, distinct
    np.testing.assert_array_equal(v, _np_map(signed))
    assert v[-1] == 1.0 and 0.0 in v
    if signed:
        assert v[0] < 0 and -1.0 not in v and np.sum(v < 0) == 127
        assert v[0] == np.float32(-(0.1 + 0.9 * 63 / 64 + 1.0) / 2)  # the most negative value: −0.99296875
    else:
        assert v[0] == 0.0 and v[1] == np.float32(1e-6 * (0.1 + 0.55) / 2)  # the first midpoint: 3.25e-7
        assert np.all(v >= 0)


# ------------------------------------------------------------------------------------------ 8-bit blocks

SHAPES = [(5000,), (64, 600), (32, 64, 3, 3)]


def _data(rng, shape, signed):
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-6, 2, shape))  # magnitudes over several decades
    return (x if signed else np.abs(x)).astype(np.float32)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("signed", [True, False])
def test_quantize_matches_reference(rng, shape, signed):
    x = _data(rng, shape, signed)
    # an all-zero block, and (signed) a block whose largest magnitude is negative
    flat = x.reshape(_np_blocks(shape))
    flat[0, :256] = 0.0
    if signed:
        flat[-1, 256:512] = np.abs(flat[-1, 256:512])
        flat[-1, 300] = -10.0 * np.abs(flat[-1, 256:512]).max()
    codes, scales = lowp.quantize(torch.from_numpy(x), signed)
    assert codes.dtype == torch.uint8 and codes.shape == shape and codes.is_contiguous()
    assert scales.dtype == F32 and tuple(scales.shape) == lowp.scales_shape(shape)
    want_c, want_s, amb = _np_quantize(x, signed)
    # the scales are each block's scale (the absolute maximum, or max(max x, min x / Q[0]) signed), exactly
    assert scales.shape == want_s.shape
    np.testing.assert_array_equal(scales.numpy(), want_s.astype(np.float32))
    got = codes.numpy().astype(np.int64)
    assert amb.mean() < 1e-3  # near-ties are rare in this data
    np.testing.assert_array_equal(got[~amb], want_c[~amb])
    assert np.all(np.abs(got[amb] - want_c[amb]) <= 1)  # a near-tie: one of the two neighbours
    # the all-zero block: scale 0, every code the index of the map's 0, read back as 0
    assert scales.reshape(flat.shape[0], -1)[0, 0] == 0
    assert np.all(got.reshape(flat.shape)[0, :256] == int(np.flatnonzero(_np_map(signed) == 0)[0]))
    # dequantize = Q[code] · a, the float32 product, exactly
    dq = lowp.dequantize(codes, scales, signed).numpy()
    q = _np_map(signed)
    rows, length = _np_blocks(shape)
    a_el = np.repeat(want_s.astype(np.float32).reshape(rows, -1), 256, axis=1)[:, :length].reshape(shape)
    np.testing.assert_array_equal(dq, q[got] * a_el)
    assert not np.any(dq.reshape(flat.shape)[0, :256])
    # error bound: within the map's range, |dq − x| ≤ half the local gap · a (plus the float32 roundings of
    # x/a and of the product)
    qd = q.astype(np.float64)
    t = np.where(a_el > 0, x.astype(np.float64) / np.where(a_el > 0, a_el, 1), 0.0)
    k = np.clip(np.searchsorted(qd, t, side="right") - 1, 0, 254)
    inside = t >= qd[0]
    gap = qd[k + 1] - qd[k]
    err = np.abs(dq.astype(np.float64) - x)
    bound = 0.5 * gap * a_el + 4 * np.spacing(np.abs(x).astype(np.float32)) + 1e-45
    assert np.all(err[inside] <= bound[inside])
    if signed:
        # the signed map has no −1: a block's most negative element sets the scale to min x / Q[0], so it is
        # read back as itself (Q[0]·a, to float32 roundings) instead of 0.70% short; nothing lies below Q[0]
        planted = flat.shape[0] - 1, 300
        assert got.reshape(flat.shape)[planted] == 0
        x_p, dq_p = flat[planted], dq.reshape(flat.shape)[planted]
        assert abs(dq_p - x_p) <= 2 * np.spacing(np.float32(abs(x_p)))
        assert np.all(inside | (a_el == 0) | (np.abs(t - qd[0]) <= 1e-6))


def test_quantize_into_buffers_and_partial_tail(rng):
    """quantize_ writes the given buffers; a row shorter than one block is a single partial block."""
    x = _data(rng, (7, 100), True)
    codes = torch.full((7, 100), 255, dtype=torch.uint8)
    scales = torch.full(lowp.scales_shape((7, 100)), -1.0)
    assert tuple(scales.shape) == (7, 1)
    lowp.quantize_(torch.from_numpy(x), codes, scales, True)
    want_c, want_s, amb = _np_quantize(x, True)
    np.testing.assert_array_equal(scales.numpy(), want_s.astype(np.float32))
    np.testing.assert_array_equal(codes.numpy()[~amb], want_c[~amb])


def test_unsigned_map_keeps_small_values_next_to_large():
    """A small second-moment entry beside a large one in its block: the unsigned map (all 8 bits on
    magnitudes, twice the values per decade) reads it back closer than the signed one."""
    x = np.full(256, 1e-3, np.float32)
    x[0] = 1.0
    x[1:] = np.linspace(3e-4, 3e-2, 255, dtype=np.float32)
    err = {}
    for signed in (True, False):
        c, s = lowp.quantize(torch.from_numpy(x), signed)
        err[signed] = np.abs(lowp.dequantize(c, s, signed).numpy() - x)[1:].max()
    assert err[False] < 0.6 * err[True]


# ------------------------------------------------------------------------------------------ split master

def _special_f32(rng, n):
    bits = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32).copy()  # every class: normal, subnormal, ±0, ±inf, NaN payloads
    x[:8] = np.array([0.0, -0.0, np.inf, -np.inf, 1e-40, -1e-40, 3.0, -3.0], np.float32)
    x[8:10] = np.array([0x7FC01234, 0xFF812345], np.uint32).view(np.float32)  # NaN payloads
    return x


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed"])
def test_split_round_trip_bit_exact(rng, layout):
    shape = (8, 6, 5, 7)
    x = _special_f32(rng, int(np.prod(shape))).reshape(shape)
    w = torch.from_numpy(x.copy())
    if layout == "channels_last":
        hi = torch.empty(shape, dtype=BF16).to(memory_format=torch.channels_last)
    elif layout == "transposed":
        hi = torch.empty((shape[1], shape[0], *shape[2:]), dtype=BF16).transpose(0, 1)
    else:
        hi = torch.empty(shape, dtype=BF16)
    assert hi.is_contiguous() == (layout == "contiguous")
    lo = torch.empty(shape, dtype=torch.int16)
    lowp.split_encode_(w, hi, lo)
    # hi is the float32 truncated toward zero: the high 16 bits
    hi_bits = hi.contiguous().view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(hi_bits, (_bits(x) >> 16).astype(np.uint16))
    np.testing.assert_array_equal(lo.numpy().view(np.uint16), (_bits(x) & 0xFFFF).astype(np.uint16))
    back = lowp.split_decode(hi, lo)
    np.testing.assert_array_equal(back.numpy().view(np.uint32), _bits(x))
    out = torch.empty(shape)
    assert lowp.split_decode(hi, lo, out=out) is out
    np.testing.assert_array_equal(out.numpy().view(np.uint32), _bits(x))
    # truncation toward zero: |hi| ≤ |x| for finite x
    fin = np.isfinite(x)
    assert np.all(np.abs(hi.float().numpy()[fin]) <= np.abs(x[fin]))


# ------------------------------------------------------------------------------- stochastic rounding

def _bf16_neighbours(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(truncated toward zero, next bf16 away from zero) of float32 ``x``, as float32."""
    b = _bits(x)
    lo = (b & np.uint32(0xFFFF0000)).view(np.float32)
    hi = ((b & np.uint32(0xFFFF0000)) + np.uint32(0x10000)).view(np.float32)
    return lo, hi


def _sr(x: np.ndarray, seed: int) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=BF16)
    g = torch.Generator().manual_seed(seed)
    lowp.stochastic_round_(torch.from_numpy(x.copy()), out, g)
    return out


def test_stochastic_round_neighbours_determinism_and_exact(rng):
    x = (rng.standard_normal(20000) * np.exp(rng.uniform(-20, 20, 20000))).astype(np.float32)
    x[:4] = [0.0, -0.0, 1.5, -2.0]  # bf16-representable
    x[4:6] = [1e-40, -3e-39]  # subnormals
    a, b = _sr(x, 7), _sr(x, 7)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert not torch.equal(a, _sr(x, 8))
    got = _torch_bf16_as_f32(a)
    lo, hi = _bf16_neighbours(x)
    assert np.all((got == lo) | (got == hi))
    assert np.any(got == hi) and np.any((got == lo) & (lo != x))  # both directions occur
    exact = (_bits(x) & 0xFFFF) == 0
    np.testing.assert_array_equal(got[exact].view(np.uint32), _bits(x)[exact])
    np.testing.assert_array_equal(np.signbit(got[:2]), [False, True])
    # channels_last target
    x4 = x[:2 * 3 * 4 * 5].reshape(2, 3, 4, 5)
    out = torch.empty(x4.shape, dtype=BF16).to(memory_format=torch.channels_last)
    lowp.stochastic_round_(torch.from_numpy(x4.copy()), out, torch.Generator().manual_seed(7))
    np.testing.assert_array_equal(out.float().numpy(), _torch_bf16_as_f32(_sr(x4, 7)))


def test_stochastic_round_specials():
    x = np.array([np.nan, -np.nan, np.inf, -np.inf], np.float32)
    x = np.concatenate([x, np.array([0x7FC01234], np.uint32).view(np.float32)])
    got = _sr(x, 3).float().numpy()
    assert np.all(np.isnan(got[[0, 1, 4]]))
    assert got[2] == np.inf and got[3] == -np.inf


@pytest.mark.parametrize("frac", [0.1, 0.37, 0.5, 0.93])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_stochastic_round_unbiased(frac, sign):
    """Mean of 40,000 draws of a constant ``x`` a fraction ``frac`` of an ulp above a bf16 value: within 4
    standard errors ``ulp·sqrt(f(1−f)/N)`` of ``x`` (seeded: the same draws every run)."""
    base = np.float32(1.3125) * np.float32(sign)
    ulp = 2.0 ** -7  # bf16 ulp on [1, 2)
    x = np.float32(base + sign * frac * ulp)
    n = 40000
    got = _sr(np.full(n, x, np.float32), 11).float().numpy().astype(np.float64)
    f = abs(float(x) - float(base)) / ulp
    se = ulp * np.sqrt(f * (1 - f) / n)
    assert abs(got.mean() - float(x)) <= 4 * se
    assert set(np.unique(got)) <= {float(base), float(base) + sign * ulp}


# ------------------------------------------------------------------------------------------ Kahan

def _np_kahan(old: np.ndarray, new: np.ndarray, c: np.ndarray):
    """One Kahan write in float32 arithmetic (each op done in float64 and rounded once to float32, which is
    the float32 op's correctly rounded result): ``s = (c + new) − old``; ``p = rn_bf16(f32(old + s))``;
    ``c = rn_bf16(f32(s − f32(p − old)))``."""
    o, nw, c = old.astype(np.float64), new.astype(np.float64), c.astype(np.float64)
    s = _f32(_f32(c + nw).astype(np.float64) - o).astype(np.float64)
    p = _rn_bf16(_f32(o + s))
    d = _f32(p.astype(np.float64) - o).astype(np.float64)
    return p, _rn_bf16(_f32(s - d))


def test_rn_bf16_emulation_matches_torch(rng):
    x = _special_f32(rng, 50000)
    got = torch.from_numpy(x.copy()).to(BF16).float().numpy()
    want = _rn_bf16(x)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert np.all(np.isnan(got[nan]))


def test_kahan_encode_bitwise(rng):
    n = 6000
    p0 = _rn_bf16((rng.standard_normal(n) * np.exp(rng.uniform(-8, 4, n))).astype(np.float32))
    c0 = _rn_bf16((rng.standard_normal(n) * 1e-3 * np.abs(p0) * 2 ** -8).astype(np.float32))
    u = (rng.standard_normal(n) * np.abs(p0) * np.exp(rng.uniform(-14, 0, n))).astype(np.float32)
    new = _f32(p0.astype(np.float64) + u)
    p, c = torch.from_numpy(p0).to(BF16), torch.from_numpy(c0).to(BF16)
    old = p.float()
    lowp.kahan_encode_(old, torch.from_numpy(new), p, c)
    wp, wc = _np_kahan(p0, new, c0)
    np.testing.assert_array_equal(p.float().numpy().view(np.uint32), wp.view(np.uint32))
    np.testing.assert_array_equal(c.float().numpy().view(np.uint32), wc.view(np.uint32))
    # non-contiguous targets: the same values
    p2 = torch.from_numpy(p0).to(BF16).reshape(60, 100).t().contiguous().t()
    c2 = torch.from_numpy(c0).to(BF16).reshape(60, 100)
    lowp.kahan_encode_(p2.float().contiguous(), torch.from_numpy(new).reshape(60, 100), p2, c2)
    np.testing.assert_array_equal(p2.float().numpy().reshape(-1), wp)
    np.testing.assert_array_equal(c2.float().numpy().reshape(-1), wc)


def test_kahan_tracks_float64_sum():
    """2,000 additions of ``u = 1e-4`` (varying sign pattern, mean ≈ 1e-4) to ``w₀ = 1``: plain bf16
    round-to-nearest stalls (the ulp at 1 is 2^-7 ≈ 7.8e-3, each update rounds away, error ≈ 25 ulp); Kahan's
    ``p`` stays within one ulp of the float64 sum and ``p + c`` within ``3·√N·ulp·2^-9``: what is lost is only
    the rounding of ``c`` to bf16 each step (``|c| ≤ ulp/2``, so at most half its spacing, ``ulp·2^-9``),
    errors of either sign that add as a random walk (measured: 1.5e-4 = 0.019 ulp; the bound 0.26 ulp)."""
    rng = np.random.default_rng(5)
    us = (1e-4 * (1.0 + 0.5 * rng.standard_normal(2000))).astype(np.float32)
    exact = 1.0 + us.astype(np.float64).sum()
    p = torch.ones(1, dtype=BF16)
    c = torch.zeros(1, dtype=BF16)
    plain = torch.ones(1, dtype=BF16)
    pn, cn = np.ones(1, np.float32), np.zeros(1, np.float32)
    for u in us:
        old = p.float()
        lowp.kahan_encode_(old.clone(), old + float(u), p, c)
        plain = (plain.float() + float(u)).to(BF16)
        pn, cn = _np_kahan(pn, _f32(pn.astype(np.float64) + np.float64(u)), cn)
    assert p.float().item() == pn[0] and c.float().item() == cn[0]
    ulp = 2.0 ** -7
    kahan_err = abs(p.float().item() + c.float().item() - exact)
    plain_err = abs(plain.float().item() - exact)
    assert plain.float().item() == 1.0  # stalled
    assert abs(p.float().item() - exact) <= ulp
    assert kahan_err <= 3 * np.sqrt(len(us)) * ulp * 2.0 ** -9
    assert plain_err > 20 * ulp
