"""Independent references shared by the lean-precision tests (:mod:`optkit._core.lowp`,
:mod:`optkit._core.lean`): the 8-bit dynamic map from its definition, and bit-for-bit equality of state."""

from __future__ import annotations

import numpy as np
import torch


def dynamic_map_np(signed: bool) -> np.ndarray:
    """Dettmers' dynamic (tree) map from its definition, float64: for i = 0..6, ``10^(i−6)`` times the
    midpoints of ``linspace(0.1, 1, n+1)`` with ``n = 2^i`` (signed, each with its negative) or ``2^(i+1)``
    (unsigned), plus 0 and 1; sorted."""
    vals = [np.array([0.0, 1.0])]
    for i in range(7):
        n = 2 ** i if signed else 2 ** (i + 1)
        e = np.linspace(0.1, 1.0, n + 1)
        m = 10.0 ** (i - 6) * (e[:-1] + e[1:]) / 2
        vals.append(m)
        if signed:
            vals.append(-m)
    return np.sort(np.concatenate(vals))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (a split master's low halves are raw bits in a bfloat16 tensor: NaN patterns included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dim() == 0 or not a.is_floating_point():
        return torch.equal(a, b)
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
