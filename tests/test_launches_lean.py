"""Kernel launches per step of the lean pass on the CUDA path (counted on the CPU over ``meta`` tensors, which
take optkit's CUDA branches; see ``bench/launches.py``): master-free bfloat16 weights (split, Kahan,
stochastic) and bfloat16 slots decode and encode each bunch through flat scratch buffers with multi-tensor
copies, so a bunch costs the same few launches on 161 ResNet-50 tensors as on 1,000 small ones (plus
``torch.cat``'s one launch per 128 inputs, as ``clip_grad_norm_``'s stack), and nothing reads the device.

8-bit slots off the CPU are decoded and quantised for the whole bunch at once (``lowp.dequantize_flat_`` /
``quantize_flat_``: the block scales by segment reductions), so they too cost a fixed number of launches
per bunch, plus the concatenations of their codes and scales."""

from __future__ import annotations

import pytest
import torch
from bench.launches import count, make_params

import optkit

#: one bunch for both sets (a bunch off the CPU holds max(block_numel, 2**24) elements)
ONE_BUNCH = 1 << 25


@pytest.mark.parametrize("name, kw", [("SGD", {"momentum": 0.9}), ("Adam", {})])
@pytest.mark.parametrize("precision, state_dtype", [("split", None), ("kahan", None), ("stochastic", None),
                                                    ("split", "bfloat16")])
def test_lean_launches_do_not_grow_with_the_tensors(name, kw, precision, state_dtype):
    cs = []
    for s in ("resnet50", "tiny_1k"):
        ps = make_params(s, dtype=torch.bfloat16)
        opt = getattr(optkit, name)(ps, 1e-3, precision=precision, state_dtype=state_dtype,
                                    block_numel=ONE_BUNCH, **kw)
        cs.append(count(opt.step))
    small, many = cs
    assert small.syncs == many.syncs == 0
    # (the cats: one launch per 128 inputs, 2 on 161 tensors and 8 on 1,000, for at most two cats a format)
    assert many.launches - small.launches <= 2 * (8 - 2), [dict(c.by_op) for c in cs]
    assert small.launches <= 45, dict(small.by_op)


def _thousand_8bit():
    """1,000 tensors of 4,096 elements (every one with 8-bit slots) on ``meta``, with gradients."""
    ps = []
    for _ in range(1000):
        p = torch.nn.Parameter(torch.empty((16, 256), device="meta", dtype=torch.bfloat16))
        p.grad = torch.empty((16, 256), device="meta", dtype=torch.bfloat16)
        ps.append(p)
    return ps


@pytest.mark.parametrize("name, kw", [("SGD", {"momentum": 0.9}), ("Adam", {})])
@pytest.mark.parametrize("precision", ["split", None])
def test_int8_launches_do_not_grow_with_the_tensors(name, kw, precision):
    """8-bit slots: the same launches on 161 ResNet-50 tensors (53 of them 8-bit) as on 1,000 8-bit tensors,
    but for the concatenations (one launch per 128 inputs: at most 6 of them, 2 per 8-bit slot and 2 for a
    split master's halves), and no host read."""
    cs = []
    for ps in (make_params("resnet50", dtype=torch.bfloat16), _thousand_8bit()):
        opt = getattr(optkit, name)(ps, 1e-3, precision=precision, state_dtype="int8", block_numel=ONE_BUNCH,
                                    **kw)
        cs.append(count(opt.step))
    small, many = cs
    assert small.syncs == many.syncs == 0
    assert many.launches - small.launches <= 6 * (8 - 2) + 6, [dict(c.by_op) for c in cs]
    assert small.launches <= 80, dict(small.by_op)
