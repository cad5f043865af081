"""Kernel launches per ``LARS`` / ``LARC`` step on the CUDA path, counted on the CPU over ``meta``
tensors (``bench.launches``: torch's multi-tensor fast-route rules). Over flat buffers
(:func:`optkit.flat_parameters`) a step takes a fixed number of launches whatever the number and the
sizes of the parameters (the per-tensor factors go over the buffer as one element vector); over separate
tensors one launch per tensor stays (no multi-tensor op takes a device vector of per-tensor factors), the
rest is O(1)."""

from __future__ import annotations

import pytest
import torch
from bench.launches import count, make_params

import optkit

#: a small bound for a flat step: the norms, the trust-ratio vector arithmetic, the expansion, two
#: elementwise passes and the fused kernel
FLAT_BOUND = 32
SETS = ("resnet50", "tiny_1k", "tiny_2k")


def _params(set_name: str, flat: bool = False) -> list:
    """``bench.launches.make_params``'s ResNet-50 shapes, or 1,000 (2,000) tensors of 256 elements that
    alternate between ``(16, 16)`` and ``(256,)`` (so that ``exclude_1d`` and the skip lists leave half of
    them to the trust ratio)."""
    if set_name == "resnet50":
        return make_params(set_name, flat=flat)
    ps = []
    for i in range(int(set_name[5:-1]) * 1000):
        shape = (16, 16) if i % 2 == 0 else (256,)
        p = torch.nn.Parameter(torch.empty(shape, device="meta"))
        p.grad = torch.empty(shape, device="meta")
        ps.append(p)
    if flat:
        optkit.flat_parameters(ps)
    return ps


def _n(set_name: str) -> int:
    return len(_params(set_name))


def _lars(**kw):
    def build(ps):
        return optkit.LARS(ps, 0.1, momentum=0.9, weight_decay=1e-4, eeta=0.001, **kw).step
    return build


def _larc(**kw):
    def build(ps):
        return optkit.LARC(optkit.SGD(ps, learning_rate=0.1, momentum=0.9), larc_eta=0.001, **kw).step
    return build


def _named(ps):
    """``(name, param)`` pairs: weights (2-D and up) and 1-D biases, for ``skip_list`` / ``exclude``."""
    return [(f"l{i}.{'weight' if p.ndim > 1 else 'bias'}", p) for i, p in enumerate(ps)]


FLAT_CASES = {
    "LARS": (_lars(), False),
    "LARS tf1.15 exclude_1d": (_lars(exclude_1d=True), False),
    "LARS tf1.15 skip_list nesterov": (_lars(skip_list=["bias"], nesterov=True), True),
    "LARS tf1.14 nesterov": (_lars(variant="tf1.14", nesterov=True), False),
    "LARS tf1.14": (_lars(variant="tf1.14"), False),
    "LARC(SGD)": (_larc(), False),
    "LARC(SGD) scale, exclude": (_larc(larc_mode="scale", exclude=lambda n, p: p.ndim <= 1), True),
}


def _flat_counts(build, named=False) -> list[int]:
    counts = []
    for set_name in SETS:
        ps = _params(set_name, flat=True)
        c = count(build(_named(ps) if named else ps))
        assert c.syncs == 0
        counts.append(c.launches)
    return counts


@pytest.mark.parametrize("case", list(FLAT_CASES))
def test_flat_step_is_o1_launches(case):
    """The same small number of launches on 161 ResNet-50 tensors (sizes vary: one grouped norm call and
    one stack) as on 1,000 and 2,000 equal sizes (row norms); the counts of the two norm routes differ by
    at most a few vector operations on the norms."""
    counts = _flat_counts(*FLAT_CASES[case])
    assert counts[1] == counts[2], counts  # independent of the number of tensors
    assert abs(counts[0] - counts[1]) <= 3, counts
    assert max(counts) <= FLAT_BOUND, counts


def test_flat_lars_under_a_loss_scale_is_o1_launches():
    def build(ps):
        opt = optkit.LossScaleOptimizer(optkit.LARS(ps, 0.1, momentum=0.9, weight_decay=1e-4), 1024.0)

        def step():
            opt.grads_scaled = True
            opt.step()

        return step

    counts = _flat_counts(build)
    assert counts[1] == counts[2] and abs(counts[0] - counts[1]) <= 3, counts
    assert max(counts) <= FLAT_BOUND + 8, counts


@pytest.mark.parametrize("variant,nesterov", [("tf1.15", False), ("tf1.15", True), ("tf1.14", False),
                                              ("tf1.14", True)])
def test_separate_tensors_are_o1_launches(variant, nesterov):
    """Without flat buffers the per-tensor factors go over the elements as one vector kept with the group
    (:class:`optkit._multi_tensor.ElementFactors`) and the norms into a vector by one copy: the same small
    number of launches on 161 ResNet-50 tensors as on 1,000 and 2,000 (no multiply per tensor)."""
    counts = []
    for set_name in SETS:
        c = count(_lars(variant=variant, nesterov=nesterov)(_params(set_name)))
        assert c.syncs == 0
        counts.append(c.launches)
    assert counts[0] == counts[1] == counts[2] <= FLAT_BOUND, counts


def test_separate_tensors_larc_is_o1_launches():
    """LARC(SGD) over separate tensors: the ratios reach the inner SGD as multipliers, which its pass applies
    in one multi-tensor multiply by their element vector (into copies of the gradients), then one fused SGD
    kernel for all tensors."""
    counts = []
    for set_name in SETS:
        c = count(_larc()(_params(set_name)))
        assert c.syncs == 0
        counts.append(c.launches)
    assert counts[0] == counts[1] == counts[2] <= FLAT_BOUND, counts
