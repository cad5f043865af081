"""Reference tests ported from TensorFlow's mixed-precision loss-scale suites.

Upstream files (repository ``tensorflow/tensorflow``):

* ``tensorflow/python/training/experimental/loss_scale_test.py``
  -> :class:`optkit.FixedLossScale`, :class:`optkit.DynamicLossScale`, :func:`optkit.get_loss_scale`
* ``tensorflow/python/training/experimental/loss_scale_optimizer_test.py``
  -> :class:`optkit.LossScaleOptimizer` (``MixedPrecisionLossScaleOptimizer``)

plus the worked examples LS1/LS2 of ``shared/spec/tf_keras.md`` §3.5 (run there on TF 2.21). TF1's
``update(grads) -> (op, should_apply)`` maps to ``update_from_grads(grads) -> should_apply`` (a 0-d bool
tensor, compatibility.md row "loss scaling: update API"). The distribution-strategy variants of the
upstream tests have no single-process counterpart and are not ported.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import optkit
from optkit import DynamicLossScale, FixedLossScale, LossScaleAtMinimumWarning, LossScaleOptimizer

F32_MAX = float(np.finfo(np.float32).max)


def var(values):
    return torch.tensor(values, requires_grad=True)


def close(t, expected, tol=1e-6):
    np.testing.assert_allclose(t.detach().double().numpy(), np.asarray(expected, dtype=np.float64),
                               rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------------------------------
# loss_scale_test.py: FixedLossScale


def test_fixed_loss_scale_basic():
    """loss_scale_test.py: FixedLossScaleTest.test_basic (update never changes the scale and always says
    apply, even for a NaN gradient)."""
    ls = FixedLossScale(1000)
    for g in (torch.tensor(0.0), torch.tensor(float("nan"))):
        should_apply = ls.update_from_grads([g])
        assert should_apply.dtype == torch.bool and should_apply.shape == () and bool(should_apply)
        assert float(ls()) == 1000.0


def test_fixed_loss_scale_serialization_and_call_type():
    """loss_scale_test.py: FixedLossScaleTest.test_serialization / test_call_type."""
    ls = optkit.get_loss_scale(123)
    assert isinstance(ls, FixedLossScale)
    ls = FixedLossScale.from_config(ls.get_config())
    assert float(ls()) == 123.0
    assert isinstance(FixedLossScale(123)(), torch.Tensor) and FixedLossScale(123)().dtype == torch.float32


def test_fixed_loss_scale_argument_checks():
    """tf_keras.md §3.1: values below 1 and non-numbers raise ValueError; optkit also rejects bool and
    inf (compatibility.md, row "loss scaling: FixedLossScale")."""
    for bad in (0.5, "8", True, float("inf")):
        with pytest.raises(ValueError):
            FixedLossScale(bad)


# ------------------------------------------------------------------------------------------------------------
# loss_scale_test.py: DynamicLossScale


def _run(inputs, initial_loss_scale=1.0, increment_period=2, multiplier=2.0):
    """loss_scale_test.py _test_helper: one update per flag (finite gradient 1.0 or NaN), recording the
    scale after each; should_apply must equal the flag."""
    ls = DynamicLossScale(initial_loss_scale=initial_loss_scale, increment_period=increment_period,
                          multiplier=multiplier)
    out = []
    for finite in inputs:
        grad = torch.tensor(1.0 if finite else float("nan"))
        assert bool(ls.update_from_grads([grad])) == finite
        out.append(float(ls()))
    return out


@pytest.mark.parametrize(
    "inputs,expected,kw",
    [
        ([True] * 6, [1, 2, 2, 4, 4, 8], {}),
        ([False] * 6, [512, 256, 128, 64, 32, 16], {"initial_loss_scale": 1024}),
        ([True, True, True, False, True], [1, 2, 2, 1, 1], {}),
        ([True] * 3 + [False, True, True], [2, 4, 8, 4, 8, 16], {"increment_period": 1}),
        ([True, False] * 4 + [True], [2, 1, 2, 1, 2, 1, 2, 1, 2], {"increment_period": 1}),
        ([True, False] * 3 + [True], [32, 16, 16, 8, 8, 4, 4], {"initial_loss_scale": 32}),
        ([True, True, False, True, True], [4, 12, 4, 4, 12], {"initial_loss_scale": 4, "multiplier": 3}),
        ([False, True, True, True, False, True, False, True, True, True, False],
         [2, 2, 4, 4, 2, 2, 1, 1, 2, 2, 1], {"initial_loss_scale": 4}),
    ],
    ids=["increase", "decrease_every_step", "nan_clear_good_step", "trigger_each_step",
         "alternating_each_step", "alternating_every_other_step", "nondefault_multiplier", "random_mix"],
)
def test_dynamic_loss_scale_sequences(inputs, expected, kw):
    """loss_scale_test.py: test_increase / test_decrease_every_step / test_nan_clear_good_step /
    test_trigger_loss_scale_update_each_step / test_alternating_good_and_bad_gradients_trigger_each_step /
    …_every_other_step / test_nondefault_multiplier / test_random_mix_good_and_bad_gradients."""
    assert _run(inputs, **kw) == expected


def test_dynamic_loss_scale_keeps_increasing_until_capped():
    """loss_scale_test.py: test_keep_increasing_until_capped (a growth that would overflow float32 is
    skipped: the scale stops at float32 max)."""
    init = F32_MAX / 4
    assert _run([True] * 6, init) == [init, init * 2, init * 2, F32_MAX, F32_MAX, F32_MAX]


def test_dynamic_loss_scale_keeps_decreasing_until_one():
    """loss_scale_test.py: test_keep_decreasing_until_one (floor at 1). optkit warns when an overflow happens
    at the floor (compatibility.md, row "loss scaling: overflow at the minimum")."""
    with pytest.warns(LossScaleAtMinimumWarning):
        assert _run([False] * 6, 16) == [8, 4, 2, 1, 1, 1]


def test_dynamic_loss_scale_single_tensor_and_none_gradients():
    """loss_scale_test.py: test_single_tensor_gradient (a bare tensor) / test_update_with_none_gradients."""
    ls = DynamicLossScale()
    assert bool(ls.update_from_grads(torch.tensor(4.0)))
    assert bool(ls.update_from_grads([None]))


def test_dynamic_loss_scale_serialization_get_and_call_type():
    """loss_scale_test.py: test_serialization / test_get / test_call_type."""
    ls = DynamicLossScale.from_config(
        DynamicLossScale(initial_loss_scale=1, increment_period=2, multiplier=3).get_config())
    assert float(ls()) == 1.0 and ls.increment_period == 2 and ls.multiplier == 3
    a, b = optkit.get_loss_scale("dynamic"), DynamicLossScale()
    assert isinstance(a, DynamicLossScale)
    assert (a.initial_loss_scale, a.increment_period, a.multiplier) == (
        b.initial_loss_scale, b.increment_period, b.multiplier) == (2.0**15, 2000, 2.0)
    assert isinstance(b(), torch.Tensor) and b().dtype == torch.float32
    with pytest.raises(ValueError, match="Could not interpret"):
        optkit.get_loss_scale("bogus")
    assert optkit.get_loss_scale(None) is None


def test_dynamic_loss_scale_spec_ls1():
    """tf_keras.md §3.5 LS1: DynamicLossScale(4, increment_period=2, multiplier=2) over T, T, F(inf), F(nan),
    F, F, T, T — scales and good_steps after each step; and a growth past float32 max is dropped while
    good_steps still resets."""
    ls = DynamicLossScale(initial_loss_scale=4, increment_period=2, multiplier=2)
    grads = [1.0, 1.0, float("inf"), float("nan"), float("inf"), float("inf"), 1.0, 1.0]
    expect = [(True, 4, 1), (True, 8, 0), (False, 4, 0), (False, 2, 0), (False, 1, 0), (False, 1, 0),
              (True, 1, 1), (True, 2, 0)]
    with pytest.warns(LossScaleAtMinimumWarning):
        for g, (apply, scale, good) in zip(grads, expect):
            assert bool(ls.update_from_grads([torch.tensor([g, 0.5])])) == apply
            assert float(ls()) == scale and int(ls.good_steps) == good
    big = DynamicLossScale(initial_loss_scale=2.0**127, increment_period=1)
    big.update_from_grads([torch.tensor(1.0)])
    assert float(big()) == 2.0**127 and int(big.good_steps) == 0


# ------------------------------------------------------------------------------------------------------------
# loss_scale_optimizer_test.py


def _recorder(v):
    """The gradient arriving at the loss (the upstream ``create_identity_with_grad_check_fn``)."""
    seen = []
    y = v.clone()
    y.register_hook(lambda g: seen.append(g.detach().clone()))
    return y, seen


def test_fixed_loss_scale_applied_to_loss_with_minimize():
    """loss_scale_optimizer_test.py: testFixedLossScaleAppliedToLossWithMinimize (backward sees the scale 10;
    the variable gets the unscaled gradient: 5 − 1·2 = 3)."""
    v = var([5.0])
    opt = LossScaleOptimizer(optkit.SGD([v], learning_rate=2.0), 10.0)
    seen = []

    def loss():
        y, s = _recorder(v)
        seen.append(s)
        return y.sum()

    opt.minimize(loss, var_list=[v])
    close(seen[0][0], [10.0])
    close(v, [3.0])


def test_fixed_loss_scale_applied_to_loss_with_get_gradients():
    """loss_scale_optimizer_test.py: testFixedLossScaleAppliedToLossWithGetGradients (compute_gradients
    back-propagates loss·10 and returns the unscaled gradient)."""
    v = var([2.0])
    opt = LossScaleOptimizer(optkit.SGD([v], learning_rate=1.0), 10.0)
    y, seen = _recorder(v)
    ((g, w),) = opt.compute_gradients(y.sum(), [v])
    close(seen[0], [10.0])
    assert w is v
    close(g, [1.0])


def test_dynamic_loss_scale_in_optimizer():
    """loss_scale_optimizer_test.py: testDynamicLossScale (scale 2, period 1: backward sees 2 then 4; the
    variable moves by lr·1 each time: 5 → 3 → 1)."""
    v = var([5.0])
    opt = LossScaleOptimizer(optkit.SGD([v], learning_rate=2.0),
                             DynamicLossScale(initial_loss_scale=2, increment_period=1, multiplier=2))
    for expected_grad, expected_var in ((2.0, 3.0), (4.0, 1.0)):
        seen = []

        def loss(seen=seen):
            y, s = _recorder(v)
            seen.append(s)
            return y.sum()

        opt.minimize(loss, var_list=[v])
        close(seen[0][0], [expected_grad])
        close(v, [expected_var])


def test_dynamic_update():
    """loss_scale_optimizer_test.py: testDynamicUpdate (finite step: applied, scale 2 → 4; NaN step: skipped,
    scale 4 → 2)."""
    v = var([1.0, 2.0])
    opt = LossScaleOptimizer(optkit.SGD([v], learning_rate=1.0),
                             DynamicLossScale(initial_loss_scale=2, increment_period=1, multiplier=2))
    opt.minimize(lambda: (v * 2.0).sum(), var_list=[v])
    close(v, [-1.0, 0.0])
    assert float(opt.loss_scale) == 4.0
    opt.minimize(lambda: (v * float("nan")).sum(), var_list=[v])
    close(v, [-1.0, 0.0])
    assert float(opt.loss_scale) == 2.0 and not bool(opt.step_applied)


def test_dynamic_loss_scale_with_slots():
    """loss_scale_optimizer_test.py: testDynamicLossScaleWithSlots (MomentumOptimizer(1.0, momentum=1) has a
    slot; multiplier 4, period 1: var [1,2] → [0,1] → [−2,−1], scale 2 → 8 → 32)."""
    v = var([1.0, 2.0])
    opt = LossScaleOptimizer(optkit.Momentum([v], learning_rate=1.0, momentum=1.0),
                             DynamicLossScale(initial_loss_scale=2.0, increment_period=1, multiplier=4))
    opt.minimize(lambda: v.sum(), var_list=[v])
    close(v, [0.0, 1.0])
    assert float(opt.loss_scale) == 8.0
    opt.minimize(lambda: v.sum(), var_list=[v])
    close(v, [-2.0, -1.0])
    assert float(opt.loss_scale) == 32.0


def test_checkpoint_restores_loss_scale():
    """loss_scale_optimizer_test.py: testCheckpoint (save after one step: scale 1, good_steps 1; one more
    step: scale 2, good_steps 0; restoring brings back 1 and 1)."""
    v = var([2.0])
    ls = DynamicLossScale(initial_loss_scale=1.0, increment_period=2, multiplier=2.0)
    opt = LossScaleOptimizer(optkit.Momentum([v], learning_rate=1.0, momentum=1.0), ls)
    opt.minimize(lambda: (v + 1.0).sum(), var_list=[v])
    assert float(ls()) == 1.0 and int(ls.good_steps) == 1
    saved = copy.deepcopy(opt.state_dict())
    opt.minimize(lambda: (v + 1.0).sum(), var_list=[v])
    assert float(ls()) == 2.0 and int(ls.good_steps) == 0
    opt.load_state_dict(saved)
    assert float(opt.loss_scaler()) == 1.0 and int(opt.loss_scaler.good_steps) == 1


def test_passing_none_to_loss_scale():
    """loss_scale_optimizer_test.py: testPassingNoneToLossScale; a non-optimizer is a TypeError in optkit
    (compatibility.md, row "wrappers: LossScaleOptimizer arguments")."""
    v = var([1.0])
    with pytest.raises(ValueError, match="loss_scale.? cannot be None"):
        LossScaleOptimizer(optkit.SGD([v], learning_rate=1.0), None)
    with pytest.raises(TypeError):
        LossScaleOptimizer(object(), "dynamic")
    assert LossScaleOptimizer is optkit.MixedPrecisionLossScaleOptimizer
    assert isinstance(LossScaleOptimizer(optkit.SGD([v], learning_rate=1.0)).loss_scaler, DynamicLossScale)


def test_spec_ls2_global_step_does_not_move_on_skip():
    """tf_keras.md §3.5 LS2: GradientDescent(0.5) under DynamicLossScale(8, increment_period=2), loss Σ w·x;
    a skipped step leaves the weights and the global step (``iterations``) alone."""
    w = var([1.0, 2.0])
    inner = optkit.SGD([w], learning_rate=0.5)
    opt = LossScaleOptimizer(inner, DynamicLossScale(initial_loss_scale=8, increment_period=2))
    table = [([1.0, 1.0], [0.5, 1.5], 1, 8.0), ([1.0, 1.0], [0.0, 1.0], 2, 16.0),
             ([float("inf"), 1.0], [0.0, 1.0], 2, 8.0), ([1.0, 2.0], [-0.5, 0.0], 3, 8.0)]
    for x, w_after, step, scale in table:
        opt.minimize(lambda x=x: (w * torch.tensor(x)).sum())
        close(w, w_after)
        assert int(opt.iterations) == step and float(opt.loss_scale) == scale


def test_apply_gradients_takes_unscaled_gradients():
    """tf_keras.md §3.2: TF1's apply_gradients takes the unscaled gradients; the dynamic scale checks them,
    then the inner optimizer applies them unchanged."""
    w = var([1.0, 2.0])
    opt = LossScaleOptimizer(optkit.SGD([w], learning_rate=0.5), DynamicLossScale(initial_loss_scale=8))
    opt.apply_gradients([(torch.tensor([1.0, 1.0]), w)])
    close(w, [0.5, 1.5])
    opt.apply_gradients([(torch.tensor([float("nan"), 1.0]), w)])
    close(w, [0.5, 1.5])
    assert float(opt.loss_scale) == 4.0


@pytest.mark.parametrize("make_inner", [lambda ps: optkit.Momentum(ps, learning_rate=1.0, momentum=1.0),
                                        lambda ps: optkit.SGD(ps, learning_rate=1.0, momentum=1.0)],
                         ids=["Momentum", "SGD"])
def test_dynamic_loss_scale_with_slots_after_a_skipped_first_step(make_inner, monkeypatch):
    """loss_scale_optimizer_test.py: testDynamicLossScaleWithSlots, preceded by an overflowing first step.
    The skipped step must leave the momentum slot as if it never happened (compatibility.md, row "wrappers:
    skipped torch fused optimizer steps"); fresh memory is made NaN so that an uninitialised buffer would
    show. Scale 2 → 1 on the overflow, then ×4 per finite step."""
    real_empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: real_empty_like(*a, **k).fill_(float("nan")))
    v = var([1.0, 2.0])
    opt = LossScaleOptimizer(make_inner([v]),
                             DynamicLossScale(initial_loss_scale=2.0, increment_period=1, multiplier=4))
    opt.minimize(lambda: (v * torch.tensor([float("inf"), 1.0])).sum(), var_list=[v])
    close(v, [1.0, 2.0])
    assert float(opt.loss_scale) == 1.0
    opt.minimize(lambda: v.sum(), var_list=[v])
    close(v, [0.0, 1.0])
    opt.minimize(lambda: v.sum(), var_list=[v])
    close(v, [-2.0, -1.0])
    assert float(opt.loss_scale) == 16.0
