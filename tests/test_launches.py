"""Kernel launches of a CUDA step, counted on the CPU over ``meta`` tensors (``bench/launches.py``): the
counter's model of torch's multi-tensor routes, and O(1) launches per (device, dtype) group for the
optimizers whose rule is one fused kernel or a chain of multi-tensor ops, with no host read.

The launch tests (this file and ``test_launches_*.py``) compare the 161 ResNet-50 shapes with 1,000 tensors
(``tiny_1k``): equal counts show the independence of the tensor count as well as 10,000 would, at a tenth of
the test time (a meta step still does per-tensor host work). ``python -m bench.launches`` and the SGD pin
below use 10,000."""

from __future__ import annotations

import pytest
import torch
from bench.launches import LaunchCounter, count, make_params, rows

import optkit


def _meta(shapes, dtype=torch.float32):
    return [torch.empty(s, device="meta", dtype=dtype) for s in shapes]


def test_counter_models_the_fast_and_the_slow_route():
    a, b = _meta([(3, 4), (5,), (2, 2, 2)]), _meta([(3, 4), (5,), (2, 2, 2)])
    w = torch.empty((), device="meta")
    with LaunchCounter() as c:
        torch._foreach_mul_(a, b)  # equal sizes: one launch
        torch._foreach_mul_(a, w)  # one 0-d tensor scalar of the tensors' dtype: one launch
        torch._foreach_mul_(a, [w] * 3)  # 0-d tensors in a list: sizes differ, one launch per tensor
        torch._foreach_mul_(a, torch.empty((), device="meta", dtype=torch.float64))  # other dtype: per tensor
        torch._foreach_lerp_(a, b, 0.5)
        a[0].view(-1)  # a view launches nothing
        torch.empty_like(a[0])  # neither does an allocation
        torch.stack([w] * 200)  # CUDA's batched copy: 128 inputs per launch
    assert c.by_op["_foreach_mul_"] == 1 + 1 + 3 + 3
    assert c.by_op["_foreach_lerp_"] == 1
    assert c.by_op["stack"] == 2
    assert c.launches == 11 and c.syncs == 0


def test_counter_counts_host_reads():
    x = torch.ones(3, device="meta")
    with LaunchCounter() as c:
        try:
            x.sum().item()
        except Exception:  # noqa: BLE001 - a meta tensor has no value to read; the read was dispatched
            pass
    assert c.syncs == 1


def _two_sizes(build, flat: bool = False, many: str = "tiny_1k") -> tuple[int, int]:
    """Launches per step on the 161 ResNet-50 shapes and on ``many`` (1,000 or 10,000 tensors of 256)."""
    out = []
    for set_name in ("resnet50", many):
        c = count(build(make_params(set_name, flat=flat)).step)
        assert c.syncs == 0, set_name
        out.append(c.launches)
    return out[0], out[1]


CONSTANT = {
    # name -> (build, most launches per step); one fused kernel or a fixed chain of multi-tensor ops
    "SGD momentum": (lambda ps: optkit.SGD(ps, learning_rate=0.01, momentum=0.9), 2),
    "SGD nesterov + wd": (lambda ps: optkit.SGD(ps, learning_rate=0.01, momentum=0.9, nesterov=True,
                                                weight_decay=1e-4), 8),
    "SGD clipvalue": (lambda ps: optkit.SGD(ps, learning_rate=0.01, momentum=0.9, clipvalue=1.0), 6),
    "Adam": (lambda ps: optkit.Adam(ps, 0.01), 4),
    "AdamW": (lambda ps: optkit.AdamW(ps, 0.01, weight_decay=0.01), 4),
    "Adagrad": (lambda ps: optkit.Adagrad(ps, 0.01), 4),
    "RMSProp centered + momentum": (lambda ps: optkit.RMSProp(ps, 0.01, momentum=0.9, centered=True), 18),
    "Lion": (lambda ps: optkit.Lion(ps, 1e-4, weight_decay=0.1), 14),
}


@pytest.mark.parametrize("flat", [False, True], ids=["tensors", "flat"])
@pytest.mark.parametrize("name", sorted(CONSTANT))
def test_launches_do_not_grow_with_the_tensor_count(name, flat):
    build, most = CONSTANT[name]
    small, large = _two_sizes(build, flat)
    assert small == large <= most, (small, large)


def test_sgd_launches_the_fused_kernel_and_the_counter():
    c = count(rows()["SGD momentum"](make_params("resnet50")))
    assert dict(c.by_op) == {"_fused_sgd_": 1, "add_": 1}
    assert _two_sizes(CONSTANT["SGD momentum"][0], many="tiny_10k") == (2, 2)
