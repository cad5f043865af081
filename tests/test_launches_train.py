"""The train op (``optimize_loss``) on the CUDA path: kernel launches per update, counted on ``meta`` tensors
(``bench/launches.py``), and the numbers of the forms that take fewer of them checked on the CPU.

* launches of one update less those of the loss and its backward alone, on the 161 ResNet-50 shapes and on
  1,000 tensors: equal, except the ``torch.stack`` of the per-tensor norms (one launch per 128 tensors, as
  ``torch.nn.utils.clip_grad_norm_``), and no host read; over flat parameters equal outright;
* the plain norm-and-check (:func:`optkit._multi_tensor.global_norm_and_found_inf` with nothing to reduce
  across ranks) gives the numbers of the reduction form, bit for bit;
* ``BackoffScaler.update`` is torch's ``_amp_update_scale_`` and one ``clamp_`` where that is OpenSeq2Seq's
  rule exactly: its trajectory (scale, iteration, last overflow, floor count) is the generic transition's,
  bit for bit, also across a checkpoint; other hyperparameters take the generic transition.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from bench.launches import count, make_params

import optkit
from optkit import _multi_tensor as mt
from optkit.loss_scale import AutomaticLossScaler, BackoffScaler

pytestmark = pytest.mark.filterwarnings("ignore::optkit.loss_scale.LossScaleAtMinimumWarning")

#: keyword arguments of optimize_loss -> the most launches per update on 161 tensors, one more over flat
#: parameters (their flat gradients zeroed in one kernel instead of dropped) (before: 5, 47, 58, 17,
#: 71, 52 for the window of two calls, and with "mixed" 172 and 224, both per tensor: 1,011 and 1,069 on
#: 1,000 tensors)
CASES = {
    "plain": ({}, 4),
    "dynamic": ({"loss_scaling": "dynamic"}, 30),
    "backoff": ({"loss_scaling": "Backoff"}, 33),
    "clip": ({"clip_gradients": 1.0}, 14),
    "backoff_clip": ({"loss_scaling": "Backoff", "clip_gradients": 1.0}, 45),
    "iter_size": ({"iter_size": 2, "loss_scaling": "dynamic"}, 34),  # (a window: two calls)
    "mixed": ({"dtype": "mixed"}, 12),
    "mixed_backoff": ({"dtype": "mixed", "loss_scaling": "Backoff"}, 39),
}


def _update_launches(set_name: str, kw: dict, flat: bool):
    """(counter of one update, counter of the loss and backward alone) of the train op over ``set_name``."""
    dtype = torch.float16 if kw.get("dtype") == "mixed" else torch.float32
    ps = make_params(set_name, dtype, flat=flat)
    if not flat:
        for p in ps:
            p.grad = None

    def loss_fn():
        return sum(p.sum() for p in ps)

    op = optkit.optimize_loss(loss_fn, "Momentum", {"momentum": 0.9}, 0.01, var_list=ps, **kw)
    calls = kw.get("iter_size", 1)  # (a window: its accumulation micro-steps and the update)

    def update():
        for _ in range(calls):
            op()

    def alone():
        for _ in range(calls):
            loss_fn().float().backward()
            if not flat:
                for p in ps:
                    p.grad = None

    return count(update), count(alone)


@pytest.mark.parametrize("flat", [False, True], ids=["tensors", "flat"])
@pytest.mark.parametrize("case", list(CASES))
def test_train_op_launches_are_o1(case, flat):
    kw, most = CASES[case]
    a, a0 = _update_launches("resnet50", kw, flat)
    b, b0 = _update_launches("tiny_1k", kw, flat)
    na, nb = a.launches - a0.launches, b.launches - b0.launches
    sa, sb = a.by_op["stack"] - a0.by_op["stack"], b.by_op["stack"] - b0.by_op["stack"]
    assert sa <= math.ceil(161 / 128) and sb <= math.ceil(1000 / 128)  # (one stack of per-tensor norms)
    assert na - sa == nb - sb and na <= most + flat, (na, nb, a.by_op - a0.by_op)
    if flat and kw.get("dtype") != "mixed":  # (the fp32 masters of "mixed" are not flat)
        assert na == nb
    assert a.syncs == b.syncs == 0


# -- the plain norm-and-check: the reduction form's numbers --------------------------------------------------

def _reduction_form(ts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm and flag as the form with a cross-rank reduction computes them (one fp64 vector)."""
    l2 = torch._foreach_norm(ts)
    sq = torch.stack(l2).to(torch.float64)
    flag = mt.any_non_finite(ts)
    z = torch.zeros(len(ts), dtype=torch.float64)
    z[0] = torch.where(flag > 0, math.nan, 0.0)
    v = torch.cat([sq * sq, z])
    n = len(ts)
    totals = torch.stack([v[:n].sum(), v[n:].sum()])
    return totals[0].sqrt().to(torch.float32), torch.isnan(totals[1]).to(torch.float32)


@pytest.mark.parametrize("bad", [None, math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plain_norm_and_check_matches_reduction_form(seed, bad):
    rng = np.random.default_rng(seed)
    ts = [torch.from_numpy(rng.standard_normal(int(n)) * 10.0 ** rng.integers(-8, 8)).float()
          for n in rng.integers(1, 5000, size=37)]
    if bad is not None:
        ts[int(rng.integers(0, 37))][0] = bad
    norm, flag = mt.global_norm_and_found_inf(ts, pipeline_group=None)
    ref_norm, ref_flag = _reduction_form(ts)
    assert flag.dtype == torch.float32 and float(flag) == float(ref_flag) == float(bad is not None)
    assert norm.dtype == torch.float32
    assert torch.equal(norm, ref_norm) or (math.isnan(norm) and math.isnan(ref_norm))
    if bad is None:  # against float64 NumPy from the formula
        ref = math.sqrt(sum(float(np.sum(t.double().numpy() ** 2)) for t in ts))
        assert float(norm) == pytest.approx(ref, rel=1e-6)


# -- BackoffScaler: the AMP form against the generic transition ----------------------------------------------

def _twins(params):
    amp, generic = BackoffScaler(params), BackoffScaler(params)
    generic._amp_domain = None  # (the generic transition, as for hyperparameters outside the AMP domain)
    return amp, generic


def _assert_same_state(a: BackoffScaler, b: BackoffScaler) -> None:
    for k in a._state:
        assert torch.equal(a._state[k], b._state[k]), k


@pytest.mark.parametrize("params", [
    None,
    {"scale_min": 1.0, "scale_max": 16.0, "step_factor": 2.0, "step_window": 3},
    {"scale_min": 0.25, "scale_max": 2.0**20, "step_factor": 4.0, "step_window": 1},
    {"scale_min": 3.0, "scale_max": 100.0, "step_factor": 0.5 * 4, "step_window": 2},
    {"scale_min": 1.0, "scale_max": 3.0e38, "step_factor": 2.0, "step_window": 2},  # (max·f not finite)
    {"scale_min": 1.0, "scale_max": 1000.0, "step_factor": 3.0, "step_window": 2},  # (f not a power of 2)
])
@pytest.mark.parametrize("seed", [0, 1])
def test_backoff_amp_update_matches_generic_transition(params, seed):
    rng = np.random.default_rng(seed)
    amp, generic = _twins(params)
    p = amp.params
    in_domain = math.frexp(p["step_factor"])[0] == 0.5 and p["scale_max"] * p["step_factor"] < 3.4e38
    assert (amp._amp_key() is not None) == in_domain
    for i in range(300):
        found = torch.tensor(float(rng.random() < 0.3), dtype=torch.float32)
        a, g = amp.update(found), generic.update(found)
        assert a.dtype == g.dtype == torch.bool and bool(a) == bool(g) == (float(found) == 0)
        _assert_same_state(amp, generic)
        if i == 150:  # a checkpoint mid-run: the AMP form's tracker is derived from the loaded state
            restored = BackoffScaler(params)
            restored.load_state_dict(copy.deepcopy(amp.state_dict()))
            amp = restored
    if in_domain:
        assert amp._tracker is not None  # (it ran the AMP form)


def test_backoff_amp_update_after_generic_updates_and_through_automatic_scaler():
    """Updates with ``amax`` (OpenSeq2Seq's ``update_op``) take the generic transition; the AMP form that
    follows derives its tracker again."""
    amp, generic = AutomaticLossScaler("Backoff", {"scale_max": 64.0, "step_window": 3}), \
        AutomaticLossScaler("Backoff", {"scale_max": 64.0, "step_window": 3})
    generic.scaler._amp_domain = None
    rng = np.random.default_rng(3)
    for i in range(120):
        found = torch.tensor(float(rng.random() < 0.25), dtype=torch.float32)
        if i % 7 == 0:
            amax = torch.tensor(math.inf if float(found) else 1.0)
            a, g = amp.update_op(found > 0, amax), generic.update_op(found > 0, amax)
        else:
            a, g = amp.update(found), generic.update(found)
        assert bool(a) == bool(g)
        _assert_same_state(amp.scaler, generic.scaler)
