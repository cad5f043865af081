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


@pytest.mark.parametrize("kind", ["adam"])  # (one: each compile costs seconds here)
def test_torch_compile_of_step_runs_the_lean_pass(kind):
    """``torch.compile(opt.step)`` over a lean group traces the rule's pointwise form (torch's fused kernels
    have no fake implementation) and matches the eager step (float32 tolerance on the split master; the
    ``aot_eager`` backend, no C++ build)."""
    make = {"sgd": lambda ps: optkit.SGD(ps, learning_rate=0.1, momentum=0.9, precision="split"),
            "adam": lambda ps: optkit.Adam(ps, 0.01, precision="split", state_dtype="bfloat16"),
            "lamb": lambda ps: optkit.LAMB(ps, 0.01, weight_decay=0.01, precision="split")}[kind]
    w0 = _t((64, 80), 0)
    a, b = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    oa, ob = make([a]), make([b])
    torch._dynamo.reset()
    step = torch.compile(ob.step, backend="aot_eager")
    for k in range(3):
        a.grad = _t(a.shape, 10 + k, scale=1.0)
        b.grad = a.grad.clone()
        oa.step()
        step()
    torch.testing.assert_close(master(ob, b), master(oa, a), rtol=1e-5, atol=1e-6)
    assert int(ob.iterations) == 3
