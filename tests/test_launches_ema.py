"""Kernel launches per step of the EMA on the CUDA path (counted on the CPU over ``meta`` tensors, which take
optkit's CUDA branches; see ``bench/launches.py``): O(1) per (device, dtype) group, the same on 161
ResNet-50 tensors as on 1,000, with and without flat buffers, and no host read.

The host's weight (no skip flag this step) is one Scalar ``_foreach_lerp_``; under a device skip flag
(a LossScaleOptimizer) the device weight goes as views of one filled buffer: one fill and one lerp, plus the
weight's few one-element kernels."""

from __future__ import annotations

import pytest
from bench.launches import count, make_params

import optkit

SETS = ("resnet50", "tiny_1k")


def _sgd_wd_ema(warmup):
    def build(ps):
        return optkit.SGD(ps, learning_rate=0.01, momentum=0.9, weight_decay=1e-4, use_ema=True,
                          ema_momentum=0.99, ema_warmup=warmup)
    return build


def _lso(use_ema):
    def build(ps):
        inner = optkit.SGD(ps, learning_rate=0.01, momentum=0.9, use_ema=use_ema, ema_momentum=0.99)
        opt = optkit.LossScaleOptimizer(inner, optkit.DynamicLossScale(2.0**15, increment_period=10**9))

        def step():
            opt.grads_scaled = True
            opt.step()

        return step
    return build


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("warmup", [False, True])
def test_sgd_wd_ema_launches_do_not_grow_with_the_tensors(flat, warmup):
    """The "SGD + wd + EMA" row: 173 launches over 161 tensors and 10,012 over 10,000 before (a lerp per
    tensor); now the same small count on both, the EMA one lerp."""
    cs = [count(_sgd_wd_ema(warmup)(make_params(s, flat=flat)).step) for s in SETS]
    assert cs[0].launches == cs[1].launches <= 10, [dict(c.by_op) for c in cs]
    for c in cs:
        assert c.by_op["_foreach_lerp_"] == 1
        assert c.syncs == 0


@pytest.mark.parametrize("flat", [False, True])
def test_ema_under_a_device_skip_flag_launches_do_not_grow_with_the_tensors(flat):
    """Under a LossScaleOptimizer (the weight is a device value): what the EMA adds to a step is the same
    few launches on 161 tensors as on 1,000 (one lerp), and no host read."""
    added = []
    for s in SETS:
        with_ema, without = (count(_lso(e)(make_params(s, flat=flat))) for e in (True, False))
        assert with_ema.by_op["_foreach_lerp_"] == 1
        assert with_ema.syncs == 0
        added.append(with_ema.launches - without.launches)
    assert added[0] == added[1] <= 12, added
