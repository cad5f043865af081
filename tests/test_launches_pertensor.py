"""Per-tensor device factors over separate (not flat) tensors on the CUDA path, counted on the CPU over
``meta`` tensors (``bench.launches``): ``LARS``'s step sizes, ``LARC``'s ratios (multipliers of the inner
optimizer) and ``clipnorm``'s clip factors go over the elements as one vector kept per group
(:class:`optkit._multi_tensor.ElementFactors`), so a step takes the same small number of launches on the 161
ResNet-50 tensors as on 1,000 tensors, with no host read."""

from __future__ import annotations

import pytest
from bench.launches import count, make_params

import optkit

BOUND = 24

CASES = {
    "LARS": lambda ps: optkit.LARS(ps, 0.1, momentum=0.9, weight_decay=1e-4, eeta=0.001).step,
    "LARS nesterov": lambda ps: optkit.LARS(ps, 0.1, momentum=0.9, weight_decay=1e-4, nesterov=True).step,
    "LARS tf1.14": lambda ps: optkit.LARS(ps, 0.1, momentum=0.9, variant="tf1.14").step,
    "LARS tf1.14 nesterov": lambda ps: optkit.LARS(ps, 0.1, momentum=0.9, variant="tf1.14",
                                                   nesterov=True).step,
    "LARC(SGD)": lambda ps: optkit.LARC(optkit.SGD(ps, learning_rate=0.1, momentum=0.9), larc_eta=0.001).step,
    "LARC(SGD) scale": lambda ps: optkit.LARC(optkit.SGD(ps, learning_rate=0.1, momentum=0.9),
                                              larc_eta=0.001, larc_mode="scale").step,
    "LARC(SGD scratch)": lambda ps: optkit.LARC(optkit.SGD(ps, learning_rate=0.1, momentum=0.9,
                                                           scratch_grads=True), larc_eta=0.001).step,
    "SGD(clipnorm)": lambda ps: optkit.SGD(ps, learning_rate=0.1, momentum=0.9, clipnorm=1.0).step,
    "SGD(clipnorm, scratch_grads)": lambda ps: optkit.SGD(ps, learning_rate=0.1, momentum=0.9, clipnorm=1.0,
                                                          scratch_grads=True).step,
}


@pytest.mark.parametrize("case", list(CASES))
def test_separate_tensors_take_o1_launches(case):
    counts = []
    for set_name in ("resnet50", "tiny_1k"):
        c = count(CASES[case](make_params(set_name)))
        assert c.syncs == 0
        counts.append(c)
    assert counts[0].launches == counts[1].launches <= BOUND, [dict(c.by_op) for c in counts]
