"""Low-precision storage: how a bfloat16 weight keeps fp32 accuracy without an fp32 master, and how an
optimizer slot is kept in bfloat16 or in 8 bits. Pure functions over tensors; :mod:`optkit._core.lean` runs
the optimizers' rules through them.

Weights (a bfloat16 parameter ``p``; the rule updates an fp32 value ``w``):

* **split master** (exact). An fp32 number is 32 bits; a bfloat16 number is its high 16 bits. Keeping the
  low 16 bits ``l`` (2 B/param, raw bits) beside ``p`` keeps the whole fp32 master, ``w = bits⁻¹(p, l)``,
  updated in fp32 and cut again. The fp32 trajectory is bit for bit the one of an fp32 master; the model sees
  ``p``, the master rounded toward zero (as in Zamirai et al. 2020, "Revisiting BFloat16 Training", and the
  bf16-fused-adam package's split form).
* **Kahan** summation with a bfloat16 compensation ``c`` (2 B/param; Kahan 1965, as optimi and
  AnyPrecisionAdamW): with ``u = w_new − w`` the rule's update of ``w = p``::

      s = c + u;   p ← rn_bf16(p + s);   c ← rn_bf16(s − (p_new − p_old))

  ``c`` carries what the rounding of ``p`` lost to the next step.
* **stochastic rounding** (0 B; Gupta et al. 2015, as torchao): ``p ← bf16(w)`` rounded up with probability
  equal to the fraction of an ulp that ``w`` is above the value below it: add 16 uniform random bits to the
  low half of ``w``'s bit pattern, keep the high half. Unbiased: ``E[p] = w``.

Slots (fp32 values ``x`` of a slot, kept as):

* **bfloat16**: ``rn_bf16(x)``, 2 B/param.
* **8-bit block-wise** (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization"): blocks of
  :data:`BLOCK` = 256 consecutive elements (within each slice along dim 0, so that a tensor sharded along dim
  0, as FSDP2 shards, shards its scales alike), each with its absolute maximum ``a`` (fp32; for the signed
  map, which has no −1, ``max(max x, min x / Q[0])``); an element is the index of the nearest value of a
  256-entry *dynamic map* ``Q`` (:func:`dynamic_map`) to ``x/a``, and is read back as ``Q[code]·a``.
  1 B/param plus 4 B per block (1.016 B/param). First moments and other signed slots use the signed map;
  second moments and accumulators (never negative) the unsigned one, which spends all 8 bits on magnitudes.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["BLOCK", "MIN_QUANT_NUMEL", "dynamic_map", "scales_shape", "quantize_", "quantize", "dequantize",
           "block_lengths", "quantize_flat_", "dequantize_flat_", "split_decode", "split_encode_",
           "stochastic_round_", "kahan_encode_"]

#: elements per 8-bit block (bitsandbytes' and torchao's block size)
BLOCK = 256
#: tensors with fewer elements keep fp32 slots under 8-bit state (bitsandbytes' ``min_8bit_size``): their
#: block scales would cost more than the bytes saved, and they are the norms and biases
MIN_QUANT_NUMEL = 4096

_maps: dict[tuple[bool, torch.device], Tensor] = {}


def dynamic_map(signed: bool, device: torch.device | str = "cpu") -> Tensor:
    """The 256 values of the 8-bit dynamic (tree) quantisation map, sorted, float32 (Dettmers 2016, "8-Bit
    Approximations for Parallelism in Deep Learning"; the map of Dettmers et al. 2022 with 7 exponent bits).

    For ``i = 0..6`` the decade ``10^(i−6)`` holds ``n_i`` values ``10^(i−6)·m`` where ``m`` runs over the
    midpoints of ``n_i + 1`` equally spaced points from 0.1 to 1 (``n_i = 2^i`` signed, each with its
    negative; ``2^(i+1)`` unsigned); then 0 and 1. Signed: 2·127 + 2 = 256 values in (−1, 1]; unsigned: 254 +
    2 = 256 values in [0, 1]."""
    key = (bool(signed), torch.device(device))
    hit = _maps.get(key)
    if hit is None:
        values = [0.0, 1.0]
        for i in range(7):
            n = 2 ** i if signed else 2 ** (i + 1)
            edges = [0.1 + 0.9 * j / n for j in range(n + 1)]
            scale = 10.0 ** (i - 6)
            for a, b in zip(edges[:-1], edges[1:]):
                values.append(scale * (a + b) / 2)
                if signed:
                    values.append(-scale * (a + b) / 2)
        hit = _maps[key] = torch.tensor(sorted(values), dtype=torch.float32, device=key[1])
    return hit


_luts: dict[tuple[bool, torch.device], tuple[Tensor, Tensor]] = {}


def _nearest_tables(signed: bool, device: torch.device) -> tuple[Tensor, Tensor]:
    """Tables for the nearest map index of an fp32 ``v`` from the high 16 bits of its pattern ``h`` (index
    ``h + 32768``): ``base[h]``, the count of the map's midpoints below every fp32 value with those high
    bits, and ``mid[h]``, the one midpoint among them (+inf if none), so that the index is ``base + (mid <
    v)``: the count of midpoints below ``v``, which is what a binary search returns. Exact because the
    map's midpoints are further apart than such a range of values is wide (at most one in each: checked)."""
    key = (bool(signed), torch.device(device))
    hit = _luts.get(key)
    if hit is None:
        q = dynamic_map(signed)
        mids = (q[1:] + q[:-1]) * 0.5
        high = torch.arange(-32768, 32768, dtype=torch.int32) << 16
        a, b = high.view(torch.float32), (high | 0xFFFF).view(torch.float32)
        lo, hi = torch.minimum(a, b), torch.maximum(a, b)
        base = torch.searchsorted(mids, lo)
        count = torch.searchsorted(mids, hi, right=True) - base
        finite = lo.isfinite() & hi.isfinite()
        if bool((count[finite] > 1).any()):  # pragma: no cover - a property of the map, checked once
            raise AssertionError("dynamic map midpoints closer than a bfloat16 range")
        mid = torch.where(finite & (count == 1), mids[base.clamp(max=mids.numel() - 1)],
                          torch.full_like(lo, float("inf")))
        base = torch.where(finite, base, torch.zeros_like(base))
        hit = _luts[key] = (base.to(torch.uint8).to(key[1]), mid.to(key[1]))
    return hit


def _nearest_codes(v: Tensor, signed: bool) -> Tensor:
    """The index of the map value nearest to each fp32 in ``v`` (flat, contiguous), as uint8: the count of
    the map's midpoints below it, from the tables of :func:`_nearest_tables`."""
    base_t, mid_t = _nearest_tables(signed, v.device)
    idx = v.view(torch.int32).bitwise_right_shift(16).add_(32768)
    code = torch.index_select(base_t, 0, idx)
    return code.add_(torch.index_select(mid_t, 0, idx).lt_(v).to(torch.uint8))


def _rows(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """``(rows, row length)``: a tensor's elements as rows along dim 0 (one row for 0-d and 1-d); a shard
    with no rows keeps the row length (its block scales keep their columns)."""
    if len(shape) >= 2:
        return shape[0], math.prod(shape[1:])
    return 1, math.prod(shape)


def scales_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the block scales of a tensor of ``shape``: ``(rows, ⌈row/256⌉)`` for 2-d and more (rows
    along dim 0), ``(⌈n/256⌉,)`` for 1-d."""
    rows, length = _rows(shape)
    nb = -(-length // BLOCK)
    return (rows, nb) if len(shape) >= 2 else (nb,)


def _blocks(x: Tensor) -> tuple[Tensor, Tensor | None]:
    """``x`` (contiguous) as ``(rows, full blocks, 256)`` and the rows' last partial block ``(rows, 1, r)``
    (None when rows divide evenly)."""
    rows, length = _rows(x.shape)
    flat = x.reshape(rows, length)
    full = length // BLOCK
    main = flat[:, :full * BLOCK].reshape(rows, full, BLOCK)
    tail = flat[:, full * BLOCK:].reshape(rows, 1, length - full * BLOCK) if length % BLOCK else None
    return main, tail


def quantize_(x: Tensor, codes: Tensor, scales: Tensor, signed: bool) -> None:
    """Write the 8-bit form of fp32 ``x`` into ``codes`` (uint8, ``x``'s shape, contiguous) and ``scales``
    (fp32, :func:`scales_shape`): each block's scale ``a``, each element the index of the map value
    nearest to ``x/a`` (ties to the lower index; an all-zero block gets ``a = 0`` and every code the index
    of the map's 0: 127 signed, 0 unsigned). ``a`` is the block's absolute maximum, except that the signed
    map has no −1 (its most negative value is ``Q[0] ≈ −0.99297``): there ``a = max(max x, min x / Q[0])``,
    so that a block whose largest magnitude is negative holds it as ``Q[0]·a`` (bitsandbytes' absolute
    maximum would read it back 0.70% short, and every re-encoding would shrink the block again)."""
    if x.numel() == 0:  # (a shard with no rows)
        return
    q0 = dynamic_map(signed, x.device)[0]
    x = x.contiguous()
    main, tail = _blocks(x)
    c_main, c_tail = _blocks(codes)
    s = scales.view(main.shape[0], -1)
    parts = [(main, c_main, s[:, :main.shape[1]])]
    if tail is not None:
        parts.append((tail, c_tail, s[:, main.shape[1]:]))
    for xs, cs, ss in parts:
        if xs.numel() == 0:
            continue
        if signed:  # the larger of the maximum and min/Q[0]: both extremes on the map (it has no −1)
            lo, hi = torch.aminmax(xs, dim=2)
            a = torch.maximum(hi, lo / q0)
        else:
            a = xs.abs().amax(dim=2)
        ss.copy_(a)
        safe = torch.where(a > 0, a, torch.ones((), dtype=a.dtype, device=a.device)).unsqueeze(2)
        cs.copy_(_nearest_codes(torch.div(xs, safe).view(-1), signed).view(cs.shape))


def quantize(x: Tensor, signed: bool) -> tuple[Tensor, Tensor]:
    """``(codes, scales)`` of fp32 ``x`` (:func:`quantize_`)."""
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty(scales_shape(x.shape), dtype=torch.float32, device=x.device)
    quantize_(x.float(), codes, scales, signed)
    return codes, scales


def dequantize(codes: Tensor, scales: Tensor, signed: bool, out: Tensor | None = None) -> Tensor:
    """fp32 values of an 8-bit slot: ``Q[code]·a`` (contiguous, ``codes``' shape; into ``out`` if given)."""
    q = dynamic_map(signed, codes.device)
    if out is not None and out.dtype != torch.float32:  # (the float32 values, then converted)
        return out.copy_(dequantize(codes, scales, signed))
    if out is None:
        out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    torch.index_select(q, 0, codes.reshape(-1).to(torch.int32), out=out.view(-1))
    if out.numel() == 0:  # (a shard with no rows)
        return out
    main, tail = _blocks(out)
    s = scales.view(main.shape[0], -1)
    main.mul_(s[:, :main.shape[1]].unsqueeze(2))
    if tail is not None:
        tail.mul_(s[:, main.shape[1]:].unsqueeze(2))
    return out


def block_lengths(shapes: list) -> list[int]:
    """The lengths of the 8-bit blocks of tensors of ``shapes`` laid end to end (their codes concatenated):
    each row along dim 0 in blocks of :data:`BLOCK`, its last one partial; the scales concatenated are in
    the same order."""
    out: list[int] = []
    for shape in shapes:
        rows, length = _rows(tuple(shape))
        row = [BLOCK] * (length // BLOCK) + ([length % BLOCK] if length % BLOCK else [])
        out += row * rows
    return out


def dequantize_flat_(codes: Tensor, scales: Tensor, lengths: Tensor, signed: bool, out: Tensor) -> None:
    """:func:`dequantize` of many tensors at once: ``codes`` their concatenated codes, ``scales`` their
    concatenated scales, ``lengths`` the blocks' lengths (:func:`block_lengths`, on the device), into the
    float32 ``out`` (flat). Two kernels whatever the number of tensors; the same values as tensor by
    tensor."""
    torch.index_select(dynamic_map(signed, codes.device), 0, codes.to(torch.int32), out=out)
    out.mul_(scales.repeat_interleave(lengths, output_size=out.numel()))


def quantize_flat_(x: Tensor, codes: Tensor, scales: Tensor, lengths: Tensor, signed: bool) -> None:
    """:func:`quantize_` of many tensors at once (``x`` their float32 values concatenated; ``codes``,
    ``scales`` and ``lengths`` as in :func:`dequantize_flat_`): the block scales by segment reductions, the
    codes by the same table. A fixed number of kernels whatever the number of tensors; the same codes and
    scales as tensor by tensor."""
    if x.numel() == 0:
        return
    if signed:  # (as quantize_: the larger of the maximum and min/Q[0])
        hi = torch.segment_reduce(x, "max", lengths=lengths)
        lo = torch.segment_reduce(x, "min", lengths=lengths)
        a = torch.maximum(hi, lo / dynamic_map(signed, x.device)[0])
    else:
        a = torch.segment_reduce(x.abs(), "max", lengths=lengths)
    scales.copy_(a)
    safe = torch.where(a > 0, a, torch.ones((), dtype=a.dtype, device=a.device))
    codes.copy_(_nearest_codes(torch.div(x, safe.repeat_interleave(lengths, output_size=x.numel())), signed))


def split_decode(hi: Tensor, lo: Tensor, out: Tensor | None = None) -> Tensor:
    """The fp32 master whose high half is the bfloat16 ``hi`` and low half the 16 bits of ``lo`` (int16, or
    any 16-bit tensor read as raw bits; contiguous,
    ``hi``'s shape; into ``out`` if given)."""
    if out is None:
        out = torch.empty(hi.shape, dtype=torch.float32, device=hi.device)
    out.copy_(hi)  # (exact: the bfloat16's bits become the high half, the low half zero)
    # (integer arithmetic over contiguous tensors: a copy into every other int16 is a slow strided loop)
    out.view(torch.int32).bitwise_or_(lo.view(torch.int16).to(torch.int32).bitwise_and_(0xFFFF).view(
        out.shape))
    return out


def split_encode_(w: Tensor, hi: Tensor, lo: Tensor) -> None:
    """Cut the fp32 ``w`` (contiguous) into its high half, written into the bfloat16 ``hi`` (any layout: the
    weight rounded toward zero), and its low half, into the 16 bits of ``lo`` (int16, or any 16-bit tensor
    written as raw bits)."""
    bits = w.view(torch.int32)
    hi.view(torch.int16).copy_(bits.bitwise_right_shift(16).view(hi.shape))  # (fits: an arithmetic shift)
    lo.view(torch.int16).copy_(bits.view(lo.shape))  # (int32 → int16 keeps the low 16 bits)


def stochastic_round_(w: Tensor, out: Tensor, generator: torch.Generator | None) -> None:
    """``out`` (bfloat16, ``w``'s shape, any layout) ← ``w`` (fp32, contiguous) rounded stochastically: 16
    uniform random bits added to the low half of ``w``'s bits (as an integer, so a carry rounds the magnitude
    up), the high half kept. NaN stays NaN (no random bits added to it); a value within an ulp of the largest
    finite one may round to infinity, as rounding up does."""
    bits = w.view(torch.int32)
    r = torch.randint(0, 1 << 16, w.shape, dtype=torch.int32, device=w.device, generator=generator)
    r.masked_fill_(w.isnan(), 0)
    r.add_(bits).bitwise_right_shift_(16)
    out.view(torch.int16).copy_(r.view(out.shape))


def kahan_encode_(old: Tensor, new: Tensor, p: Tensor, comp: Tensor) -> None:
    """Kahan-compensated write of the rule's fp32 result ``new`` into the bfloat16 ``p`` (module doc): ``old``
    is ``p``'s value as fp32 (contiguous, scratch: it is overwritten), ``comp`` the bfloat16 compensation."""
    s = comp.float().reshape(new.shape).add_(new).sub_(old)  # c + u
    rounded = old.add(s).to(torch.bfloat16)  # rn(p + s)
    p.copy_(rounded.view(p.shape))
    # c ← s − (p_new − p_old)
    comp.copy_(s.sub_(rounded.float().sub_(old)).view(comp.shape))
