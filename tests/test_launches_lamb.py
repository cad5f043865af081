"""LAMB's kernel launches per step on a GPU (``bench.launches``: the CUDA path counted over ``meta`` tensors):
the same small number on the 161 ResNet-50 shapes and on 1,000 tensors, per tensor and over flat buffers,
with no host read."""

from __future__ import annotations

import pytest
from bench.launches import launches

#: launches per step (second step) of ``LAMB(weight_decay=0.01, always_adapt=True)``, float32
BOUND = 24


@pytest.mark.parametrize("flat", [False, True], ids=["per-tensor", "flat"])
def test_launches_do_not_grow_with_the_number_of_tensors(flat):
    counts = [launches("LAMB", set_name, flat) for set_name in ("resnet50", "tiny_1k")]
    assert counts[0].launches == counts[1].launches <= BOUND, [c.by_op for c in counts]
    assert all(c.syncs == 0 for c in counts)
