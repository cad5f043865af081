"""Loss scaling on the CUDA path: O(1) kernel launches per step (counted on ``meta`` tensors, see
``bench/launches.py``), and the numbers of the paths that take them checked on the CPU.

* the non-finite check on an accelerator is torch's AMP kernel over every tensor
  (``mt._local_non_finite(..., read_only=False)``, the CPU's routing of that path);
* ``DynamicLossScale.update`` is torch's ``_amp_update_scale_`` and one ``clamp_`` where that is TF's rule
  exactly: its scale trajectory is the generic transition's, bit for bit, and a state outside the kernel's
  domain (loaded) takes the generic transition.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bench.launches import count, make_params, rows

import optkit
from optkit import _multi_tensor as mt
from optkit.loss_scale import DynamicLossScale, LossScale

pytestmark = pytest.mark.filterwarnings("ignore::optkit.loss_scale.LossScaleAtMinimumWarning")

LSO_ROW = "LossScaleOptimizer(SGD, dynamic)"
#: launches per step of the LSO row (GradScaler + torch's fused SGD: 9); was 46 on ResNet-50, 123 on 10,000
LSO_MAX = 16


def _mp_dynamic(ps):
    opt = optkit.MixedPrecisionOptimizerWrapper(optkit.SGD(ps, learning_rate=0.01, momentum=0.9),
                                                optkit.DynamicLossScale(2.0**15, increment_period=10**9))

    def step():
        opt.grads_scaled = True
        opt.step()

    return step


@pytest.mark.parametrize(("build", "most"), [(rows()[LSO_ROW], LSO_MAX), (_mp_dynamic, LSO_MAX + 1)],
                         ids=["lso", "mixed_precision"])  # (MP: a snapshot of the scale, 1 copy)
@pytest.mark.parametrize("flat", [False, True])
def test_loss_scaled_sgd_launches_are_o1(build, most, flat):
    a = count(build(make_params("resnet50", flat=flat)))
    b = count(build(make_params("tiny_1k", flat=flat)))
    assert a.launches == b.launches <= most, (a.by_op, b.by_op)
    assert a.syncs == b.syncs == 0
    assert a.by_op["_amp_update_scale_"] == 1 and a.by_op["_amp_foreach_non_finite_check_and_unscale_"] == 1


# -- the accelerator's non-finite check, routed on the CPU --------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
def test_accelerator_non_finite_check_matches_cpu_check_and_keeps_values(dtype, bad):
    rng = np.random.default_rng(7)
    sizes = [3, 1 << 17, 1000, 5]
    ts = [torch.from_numpy(rng.standard_normal(n) * 100).to(dtype) for n in sizes]
    if bad is not None:
        ts[1][12345] = bad
    before = [t.clone() for t in ts]
    ref = mt._local_non_finite(ts)  # the CPU's routing (read-only pass for the large tensor)
    got = mt._local_non_finite(ts, read_only=False)  # the accelerator's: the AMP kernel over all
    assert got.dtype == torch.float32 and got.item() == ref.item() == (0.0 if bad is None else 1.0)
    for t, u in zip(ts, before):
        assert torch.equal(t.view(-1), u.view(-1)) or (bad is not None and torch.equal(t.isnan(), u.isnan()))


# -- DynamicLossScale: the AMP kernel's update against the generic transition -------------------------------

CONFIGS = [
    dict(),
    dict(initial_loss_scale=8.0, increment_period=3, min_loss_scale=2.0, max_loss_scale=64.0),
    dict(initial_loss_scale=2.0**120, increment_period=2, multiplier=4.0),  # growth past float32 max
    dict(initial_loss_scale=1.0, increment_period=1, multiplier=2.0**10, min_loss_scale=2.0**-20),
    dict(initial_loss_scale=3.0, increment_period=2, multiplier=0.5 + 1.5, max_loss_scale=48.0),
]


def _generic_update(s: DynamicLossScale, found: torch.Tensor) -> torch.Tensor:
    return LossScale.update(s, found)  # (the base class: the generic _transition)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_amp_scale_update_is_the_generic_transition_bit_for_bit(cfg):
    rng = np.random.default_rng(11)
    fast, ref = DynamicLossScale(**cfg), DynamicLossScale(**cfg)
    assert fast._amp_key() is not None
    for flag in rng.random(300) < 0.3:
        found = torch.tensor(1.0 if flag else 0.0)
        a = fast.update(found)
        b = _generic_update(ref, found)
        assert a.dtype == b.dtype == torch.bool and bool(a) == bool(b)
        sa, sb = fast.state_dict(), ref.state_dict()
        for k in ("scale", "good_steps", "overflow_run", "floor_overflows"):
            assert torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype, k


def test_amp_path_runs_the_kernel_only_where_it_is_exact():
    assert DynamicLossScale(hysteresis=2)._amp_key() is None
    assert DynamicLossScale(multiplier=3.0)._amp_key() is None
    assert DynamicLossScale(increment_period=2**31)._amp_key() is None
    assert DynamicLossScale(max_loss_scale=float(torch.finfo(torch.float32).max))._amp_key() is None


@pytest.mark.parametrize("state", [dict(good_steps=7), dict(scale=0.5), dict(scale=2.0**20)])
def test_loaded_state_outside_the_kernel_domain_takes_the_generic_transition(state):
    cfg = dict(initial_loss_scale=8.0, increment_period=3, min_loss_scale=1.0, max_loss_scale=2.0**10)
    fast, ref = DynamicLossScale(**cfg), DynamicLossScale(**cfg)
    sd = fast.state_dict()
    sd.update({k: torch.tensor(v, dtype=sd[k].dtype) for k, v in state.items()})
    fast.load_state_dict(sd)
    ref.load_state_dict(sd)
    for flag in [0, 0, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0]:
        found = torch.tensor(float(flag))
        fast.update(found)
        _generic_update(ref, found)
        assert fast().item() == ref().item() and fast.good_steps.item() == ref.good_steps.item()


def test_skip_flag_is_not_would_apply():
    s = DynamicLossScale()
    for v in (0.0, 1.0):
        f = torch.tensor(v)
        assert s.skip_flag(f).item() == float(not bool(s.would_apply(f)))
    fixed = optkit.FixedLossScale(4.0)
    assert fixed.skip_flag(torch.tensor(1.0)).item() == 0.0
    assert optkit.FixedLossScale(4.0, skip_non_finite=True).skip_flag(torch.tensor(1.0)).item() == 1.0
