"""Lean-memory modes (:mod:`optkit._core.lean`) with the options around them: parameters of other dtypes under
a ``precision``, sparse gradients (TF's touched-rows rules), ``torch.compile(opt.step)``, ``jit_compile``,
param groups added later, groups with momentum 0, parameters without gradients.

References: the same optimizer over float32 parameters fed the same (bfloat16-valued) gradients, whose
trajectory the split master reproduces bit for bit (the lean module's promise); the run without the option.
"""

from __future__ import annotations

import pytest
import torch

import optkit
from optkit._core import lowp

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")

PRECISIONS = ["split", "kahan", "stochastic"]
STATES = [None, "bfloat16", "int8"]


def _t(shape, seed, dtype=torch.bfloat16, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def master(opt, p):
    """The split master of ``p`` (fp32: the bfloat16 weight's bits and its low halves)."""
    return lowp.split_decode(p.detach(), opt.state[p]["master_low"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_other_dtypes_under_a_precision_step_as_without_it(dtype):
    """``precision`` is for bfloat16 parameters: float32 and float64 ones beside them keep their slots in
    their own dtype (not float32 for float64) and step bit for bit as without the option."""
    runs = []
    for precision in (None, "split"):
        ps = [_t((6, 5), 0, dtype).requires_grad_(), _t((64,), 1).requires_grad_()]
        opt = optkit.Adam(ps, 0.01, precision=precision)
        for k in range(3):
            for j, p in enumerate(ps):
                p.grad = _t(p.shape, 10 * k + j, p.dtype, 1.0)
            opt.step()
        assert opt.state[ps[0]]["exp_avg"].dtype == dtype
        runs.append([ps[0].detach().clone(), opt.state[ps[0]]["exp_avg"].clone()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
