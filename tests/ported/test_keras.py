"""Reference tests ported from Keras 3's optimizer suites.

Upstream files (repository ``keras-team/keras``):

* ``keras/src/optimizers/sgd_test.py``                  -> :class:`optkit.SGD`
* ``keras/src/optimizers/optimizer_test.py``            -> the Keras-style base of every optkit optimizer
  (iterations, empty gradients, clipnorm / clipvalue / global_clipnorm, EMA, callable learning rates,
  weights, config, pickling)
* ``keras/src/optimizers/loss_scale_optimizer_test.py`` -> :class:`optkit.LossScaleOptimizer` with a
  :class:`optkit.DynamicLossScale` (Keras 3 hands **scaled** gradients to ``apply``; in optkit that is
  ``.grad`` holding the scaled gradients followed by ``step()``)

plus the worked examples K1–K16 and S1–S4 of ``shared/spec/tf_keras.md`` §4.3/§5.1 (checked there against
Keras 3.15.1). Keras features optkit does not have (``gradient_accumulation_steps``, ``loss_scale_factor``,
variable constraints, ``overwrite_with_gradient``) are not ported. Deliberate differences follow
``docs/compatibility.md``; each test names the row it relies on.
"""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch

import optkit
from optkit import SGD, DynamicLossScale, LossScaleOptimizer
from scaled_grads import scaled_step

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")

F32, F64 = torch.float32, torch.float64


def var(values, dtype=F32):
    return torch.tensor(values, dtype=dtype, requires_grad=True)


def T(values, dtype=F32):
    return torch.tensor(values, dtype=dtype)


def close(t, expected, tol=1e-6):
    np.testing.assert_allclose(t.detach().to(F64).numpy(), np.asarray(expected, dtype=np.float64),
                               rtol=tol, atol=tol)


def grads_step(opt, pairs):
    for g, v in pairs:
        v.grad = None if g is None else g.clone()
    scaled_step(opt)


# ============================================================================================================
# sgd_test.py


def test_sgd_config_round_trip():
    """sgd_test.py: test_config (SGD(0.5, momentum 0.06, nesterov, weight_decay 0.004) survives
    get_config → from_config)."""
    w = var([1.0])
    opt = SGD([w], learning_rate=0.5, momentum=0.06, nesterov=True, weight_decay=0.004)
    cfg = opt.get_config()
    expected = {"learning_rate": 0.5, "momentum": 0.06, "nesterov": True, "weight_decay": 0.004}
    assert expected.items() <= cfg.items()
    assert SGD.from_config(cfg, [var([1.0])]).get_config() == cfg


def test_sgd_single_step():
    """sgd_test.py: test_single_step (lr 0.5, grads [1, 6, 7, 2]). Keras lists [iterations, learning_rate] as
    variables; optkit's ``variables()`` holds iterations and slots only (the learning rate lives in the param
    groups)."""
    v = var([1.0, 2.0, 3.0, 4.0])
    opt = SGD([v], learning_rate=0.5)
    opt.apply_gradients([(T([1.0, 6.0, 7.0, 2.0]), v)])
    close(v, [0.5, -1.0, -0.5, 3.0], tol=1e-4)
    assert len(opt.variables()) == 1 and int(opt.variables()[0]) == 1
    assert opt.learning_rate == 0.5 and opt.param_groups[0]["lr"] == 0.5


def test_sgd_weight_decay_and_exclusions():
    """sgd_test.py: test_weight_decay (lr 1.0, wd 0.004, zero gradients on 0-d variables; var1 is decayed by
    three optimizers in turn → 1.9760959; the variable named ``exclude`` and the one excluded by identity
    keep 2.0)."""
    var1, var2, var3 = var(2.0), var(2.0), var(2.0)
    zero = torch.zeros(())
    opt1 = SGD([("var1", var1)], learning_rate=1.0, weight_decay=0.004)
    opt1.apply_gradients([(zero, var1)])
    opt2 = SGD([("var1", var1), ("exclude", var2)], learning_rate=1.0, weight_decay=0.004)
    opt2.exclude_from_weight_decay(var_names=["exclude"])
    opt2.apply_gradients([(zero, var1), (zero, var2)])
    opt3 = SGD([var1, var3], learning_rate=1.0, weight_decay=0.004)
    opt3.exclude_from_weight_decay(var_list=[var3])
    opt3.apply_gradients([(zero, var1), (zero, var3)])
    assert abs(float(var1.detach()) - 1.9760959) < 1e-6
    assert float(var2.detach()) == 2.0 and float(var3.detach()) == 2.0


@pytest.mark.parametrize("reuse", [True, False],
                         ids=["same_tensor", "fresh_copies"])
def test_sgd_correctness_with_golden(reuse):
    """sgd_test.py: test_correctness_with_golden (defaults: lr 0.01, momentum 0, nesterov; a first step with
    0.01 everywhere, then grads 0.1 … 1.0, five checkpoints, atol 5e-4). Upstream passes the same gradient
    tensor on every step; the ``fresh_copies`` run keeps the numeric check independent of that bug."""
    x = var(np.ones(10).tolist())
    opt = SGD([x], nesterov=True)
    golden = np.array([
        [0.9999] * 10,
        [0.9989, 0.9979, 0.9969, 0.9959, 0.9949, 0.9939, 0.9929, 0.9919, 0.9909, 0.9899],
        [0.9979, 0.9959, 0.9939, 0.9919, 0.9899, 0.9879, 0.9859, 0.9839, 0.9819, 0.9799],
        [0.9969, 0.9939, 0.9909, 0.9879, 0.9849, 0.9819, 0.9789, 0.9759, 0.9729, 0.9699],
        [0.9959, 0.9919, 0.9879, 0.9839, 0.9799, 0.9759, 0.9719, 0.9679, 0.9639, 0.9599],
    ])
    grads = torch.arange(1, 11, dtype=F32) / 10
    opt.apply_gradients([(torch.full((10,), 0.01), x)])
    for row in golden:
        close(x, row, tol=5e-4)
        opt.apply_gradients([(grads if reuse else grads.clone(), x)])


@pytest.mark.parametrize(
    "kw,expected",
    [({"clipnorm": 1}, [2**0.5 / 2] * 2), ({"clipvalue": 1}, [1.0, 1.0]),
     ({"global_clipnorm": 1}, [50 / math.hypot(50, 100), 100 / math.hypot(50, 100)])],
    ids=["clipnorm", "clipvalue", "global_clipnorm"],
)
def test_clip_gradients(kw, expected):
    """sgd_test.py / optimizer_test.py: test_clip_norm, test_clip_value, test_global_clip_norm ([100, 100]
    or [50, 100]). optkit has no public ``_clip_gradients``; with lr 1 from zero weights the update is the
    clipped gradient."""
    g = [50.0, 100.0] if "global_clipnorm" in kw else [100.0, 100.0]
    w = var([0.0, 0.0])
    SGD([w], learning_rate=1.0, **kw).apply_gradients([(T(g), w)])
    close(-w.detach(), expected)


# ============================================================================================================
# optimizer_test.py

NATIVE = {
    "SGD": lambda ps, lr: optkit.SGD(ps, learning_rate=lr),
    "RMSProp": lambda ps, lr: optkit.RMSProp(ps, learning_rate=lr),
    "Ftrl": lambda ps, lr: optkit.Ftrl(ps, learning_rate=lr),
    "LARS": lambda ps, lr: optkit.LARS(ps, learning_rate=lr),
}


@pytest.mark.parametrize("name", list(NATIVE))
def test_iterations_counter(name):
    """optimizer_test.py: test_iterations_counter (0, then 1, then 2 after two apply_gradients)."""
    v = var([[1.0, 2.0], [3.0, 4.0]])
    opt = NATIVE[name]([v], 1.0)
    assert int(opt.iterations) == 0
    for i in (1, 2):
        opt.apply_gradients([(torch.ones(2, 2), v)])
        assert int(opt.iterations) == i


def test_empty_gradients():
    """optimizer_test.py: test_empty_gradients (all-None gradients raise "No gradients provided for any
    variable."; a None gradient next to a real one leaves its variable alone)."""
    v = var([[3.0, 4.0], [5.0, 6.0]])
    with pytest.raises(ValueError, match="No gradients provided for any variable."):
        SGD([v], learning_rate=1.0).apply_gradients([(None, v)])
    v2 = var([[3.0, 4.0], [5.0, 6.0]])
    SGD([v, v2], learning_rate=1.0).apply_gradients([(None, v), (torch.ones(2, 2), v2)])
    close(v, [[3.0, 4.0], [5.0, 6.0]])
    close(v2, [[2.0, 3.0], [4.0, 5.0]])


def test_clip_args():
    """optimizer_test.py: test_clip_args (each option is stored; two at once raise ValueError)."""
    w = var([1.0])
    assert SGD([w], learning_rate=1.0, clipnorm=0.1).clipnorm == 0.1
    assert SGD([w], learning_rate=1.0, clipvalue=0.1).clipvalue == 0.1
    assert SGD([w], learning_rate=1.0, global_clipnorm=0.1).global_clipnorm == 0.1
    for kw in ({"clipnorm": 0.1, "clipvalue": 0.1}, {"clipnorm": 0.1, "global_clipnorm": 0.1}):
        with pytest.raises(ValueError, match="Only one of `clipnorm`, `clipvalue` and `global_clipnorm` can"):
            SGD([w], learning_rate=1.0, **kw)


def test_ema_overwrite():
    """optimizer_test.py: test_ema (lr 1, ema_momentum 0.9, overwrite every 3 steps: the average is set on the
    first step, then averaged; on step 3 the weights are overwritten with it → 1.71 … 4.71)."""
    v = var([[3.0, 4.0], [5.0, 6.0]])
    opt = SGD([v], learning_rate=1.0, use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=3)
    opt.apply_gradients([(torch.ones(2, 2), v)])
    close(v, [[2.0, 3.0], [4.0, 5.0]])
    close(opt.get_slot(v, "average"), [[2.0, 3.0], [4.0, 5.0]])
    opt.apply_gradients([(torch.ones(2, 2), v)])
    close(v, [[1.0, 2.0], [3.0, 4.0]])
    close(opt.get_slot(v, "average"), [[1.9, 2.9], [3.9, 4.9]])
    opt.apply_gradients([(torch.ones(2, 2), v)])
    close(v, [[1.71, 2.71], [3.71, 4.71]])
    close(opt.get_slot(v, "average"), [[1.71, 2.71], [3.71, 4.71]])


def test_ema_with_model_fit():
    """optimizer_test.py: test_ema_with_model_fit (Dense(2) with ones kernel and no bias, mse on x=1, y=0,
    SGD(0.1, EMA 0.9), two steps; fit ends with finalize_variable_values: kernel = average = 0.891)."""
    model = torch.nn.Linear(1, 2, bias=False)
    torch.nn.init.ones_(model.weight)
    opt = SGD(model.named_parameters(), learning_rate=0.1, use_ema=True, ema_momentum=0.9)
    x, y = torch.ones(1, 1), torch.zeros(1, 2)
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        scaled_step(opt)
    close(opt.get_slot(model.weight, "average"), [[0.891], [0.891]], tol=1e-5)
    opt.finalize_variable_values()
    close(model.weight, [[0.891], [0.891]], tol=1e-5)


def test_get_method():
    """optimizer_test.py: test_get_method (by name, case-insensitive; a typo raises ValueError)."""
    assert optkit.get_optimizer("sgd") is optkit.SGD
    assert optkit.get_optimizer("adamw") is optkit.AdamW
    with pytest.raises(ValueError):
        optkit.get_optimizer("typo")


def test_static_loss_scaling():
    """optimizer_test.py: test_static_loss_scaling (gradients carry the factor 1024; the update sees them
    divided by it; scale_loss(1.0) == 1024). optkit spells this LossScaleOptimizer(opt, 1024.0)."""
    v = var([[1.0, 2.0], [3.0, 4.0]])
    opt = LossScaleOptimizer(SGD([v], learning_rate=1.0), 1024.0)
    v.grad = T([[1.0, 2.0], [3.0, 4.0]]) * 1024.0
    scaled_step(opt)
    assert float(opt.scale_loss(torch.tensor(1.0))) == 1024.0
    close(v, [[0.0, 0.0], [0.0, 0.0]])


def test_set_weights():
    """optimizer_test.py: test_set_weights (optimizer 2 takes optimizer 1's variables). optkit builds the
    state at construction (DESIGN §1.4), so there is no "call build first" error; a count mismatch raises."""
    x = var([[1.0, 2.0], [3.0, 4.0]])
    opt1 = optkit.RMSProp([x], learning_rate=0.01, momentum=0.5)
    opt1.apply_gradients([(T([[1.0, 2.0], [3.0, 4.0]]), x)])
    opt2 = optkit.RMSProp([var([[1.0, 2.0], [3.0, 4.0]])], learning_rate=0.01, momentum=0.5)
    with pytest.raises(ValueError):
        opt2.set_weights(opt1.get_weights()[:-1])
    opt2.set_weights(opt1.get_weights())
    for a, b in zip(opt1.variables(), opt2.variables()):
        assert torch.equal(a, b)
    assert int(opt2.iterations) == 1


def test_callable_learning_rate():
    """optimizer_test.py: test_callable_learning_rate (lr = lambda: 0.1)."""
    v = var([[1.0, 2.0], [3.0, 4.0]])
    opt = SGD([v], learning_rate=lambda: 0.1)
    assert int(opt.iterations) == 0
    opt.apply_gradients([(torch.ones(2, 2), v)])
    close(v, [[0.9, 1.9], [2.9, 3.9]])
    assert int(opt.iterations) == 1


@pytest.mark.parametrize("name", list(NATIVE))
def test_pickleable_optimizers(name):
    """optimizer_test.py: test_pickleable_optimizers (a pickled round trip keeps the config)."""
    opt = NATIVE[name]([var([1.0, 2.0])], 0.01)
    reloaded = pickle.loads(pickle.dumps(opt))
    assert reloaded.get_config() == opt.get_config()


# ============================================================================================================
# loss_scale_optimizer_test.py (Keras 3: gradients handed to the wrapper carry the scale)


def test_lso_config():
    """loss_scale_optimizer_test.py: test_config (the wrapper's config nests the inner SGD's config)."""
    inner = SGD([var([1.0])], learning_rate=0.5, momentum=0.06, nesterov=True, weight_decay=0.004)
    cfg = LossScaleOptimizer(inner, DynamicLossScale()).get_config()
    assert cfg["inner_optimizer"] == inner.get_config()
    assert cfg["loss_scale"]["config"]["initial_loss_scale"] == 2.0**15


def test_lso_finite_step():
    """loss_scale_optimizer_test.py: test_finite_step (scaled gradients [1, 6, 7, 2]·2^15, SGD(0.5))."""
    v = var([1.0, 2.0, 3.0, 4.0])
    opt = LossScaleOptimizer(SGD([v], learning_rate=0.5), DynamicLossScale())
    v.grad = T([1.0, 6.0, 7.0, 2.0]) * 2.0**15
    scaled_step(opt)
    close(v, [0.5, -1.0, -0.5, 3.0], tol=1e-4)


def test_lso_infinite_step():
    """loss_scale_optimizer_test.py: test_infinite_step (inf gradients: the variable is unchanged)."""
    v = var([1.0, 2.0, 3.0, 4.0])
    opt = LossScaleOptimizer(SGD([v], learning_rate=0.5), DynamicLossScale())
    v.grad = torch.full((4,), float("inf"))
    scaled_step(opt)
    close(v, [1.0, 2.0, 3.0, 4.0])


def test_lso_downscaling():
    """loss_scale_optimizer_test.py: test_downscaling (initial scale 400, four inf steps → 25)."""
    v = var([1.0, 2.0, 3.0, 4.0])
    opt = LossScaleOptimizer(SGD([v], learning_rate=0.5), DynamicLossScale(initial_loss_scale=400.0))
    for _ in range(4):
        v.grad = torch.full((4,), float("inf"))
        scaled_step(opt)
    assert float(opt.scale_loss(torch.tensor(1.0))) == 25.0


def test_lso_upscaling():
    """loss_scale_optimizer_test.py: test_upscaling (initial scale 2, growth every 2 finite steps, 8 steps →
    32)."""
    v = var([1.0, 2.0, 3.0, 4.0])
    opt = LossScaleOptimizer(SGD([v], learning_rate=0.5),
                             DynamicLossScale(initial_loss_scale=2.0, increment_period=2))
    for _ in range(8):
        v.grad = T([1.0, 6.0, 7.0, 2.0])
        scaled_step(opt)
    assert float(opt.scale_loss(torch.tensor(1.0))) == 32.0


def test_lso_spec_ls3_and_no_floor_option():
    """tf_keras.md §3.5 LS3 (Keras 3, SGD(0.5), initial scale 8, growth every 2 steps; scaled gradients):
    weights, scale and inner iterations per step — a skipped step does not advance iterations. Keras 3 has no
    floor (scale 1 → 0.125 after three overflows); optkit floors at 1 by default (TF rule) and
    ``min_loss_scale=1/8`` gives Keras's numbers (compatibility.md, row "loss scaling: DynamicLossScale")."""
    w = var([1.0, 2.0])
    inner = SGD([w], learning_rate=0.5)
    opt = LossScaleOptimizer(inner, DynamicLossScale(initial_loss_scale=8.0, increment_period=2))
    table = [([8.0, 16.0], [0.5, 1.0], 8, 1), ([8.0, 16.0], [0.0, 0.0], 16, 2),
             ([float("inf"), 0.0], [0.0, 0.0], 8, 2), ([float("nan"), 0.0], [0.0, 0.0], 4, 2),
             ([4.0, 4.0], [-0.5, -0.5], 4, 3), ([4.0, 4.0], [-1.0, -1.0], 8, 4)]
    for g, w_after, scale, it in table:
        w.grad = T(g)
        scaled_step(opt)
        close(w, w_after)
        assert float(opt.loss_scale) == scale and int(opt.iterations) == it
    v = var([1.0])
    keras_like = LossScaleOptimizer(SGD([v], learning_rate=0.5),
                                    DynamicLossScale(initial_loss_scale=1.0, min_loss_scale=0.125))
    for _ in range(3):
        v.grad = T([float("inf")])
        scaled_step(keras_like)
    assert float(keras_like.loss_scale) == 0.125


# ============================================================================================================
# tf_keras.md §4.3 (K1–K16) and §5.1 (S1–S4), checked against Keras 3.15.1


def test_k1_weight_decay_with_name_exclusion():
    """K1: lr 0.1, weight decay 0.5, ``exclude_from_weight_decay(var_names=["bias"])``, two steps."""
    kernel, bias = var([1.0, -2.0]), var([4.0])
    opt = SGD([("dense.kernel", kernel), ("dense.bias", bias)], learning_rate=0.1, weight_decay=0.5)
    opt.exclude_from_weight_decay(var_names=["bias"])
    pairs = [(T([0.5, 1.0]), kernel), (T([1.0]), bias)]
    grads_step(opt, pairs)
    close(kernel, [0.9, -2.0])
    close(bias, [3.9])
    grads_step(opt, pairs)
    close(kernel, [0.805, -2.0])
    close(bias, [3.8])


@pytest.mark.parametrize(
    "kw,grads,expected",
    [
        ({"clipnorm": 1}, ([3.0, 4.0], [0.5]), ([-0.6, -0.8], [-0.5])),
        ({"global_clipnorm": 1}, ([3.0, 4.0], [12.0]), ([-0.2307692, -0.3076923], [-0.9230769])),
        ({"clipvalue": 0.5}, ([3.0, -0.25], [-12.0]), ([-0.5, 0.25], [0.5])),
    ],
    ids=["K2", "K3", "K4"],
)
def test_k2_k4_clipping(kw, grads, expected):
    """K2 (clipnorm per gradient), K3 (global_clipnorm over both), K4 (clipvalue); lr 1 from zeros."""
    a, b = var([0.0, 0.0]), var([0.0])
    SGD([a, b], learning_rate=1.0, **kw).apply_gradients([(T(grads[0]), a), (T(grads[1]), b)])
    close(a, expected[0])
    close(b, expected[1])


def test_k5_global_clipnorm_non_finite_gives_all_nan():
    """K5: global_clipnorm with an inf gradient makes every update NaN."""
    a, b = var([0.0, 0.0]), var([0.0])
    SGD([a, b], learning_rate=1.0, global_clipnorm=1.0).apply_gradients(
        [(T([float("inf"), 4.0]), a), (T([12.0]), b)])
    assert bool(torch.isnan(a).all()) and bool(torch.isnan(b).all())


@pytest.mark.parametrize("kw", [{"global_clipnorm": 1.0}, {"clipnorm": 1.0}])
def test_k6_zero_gradient_no_nan(kw):
    """K6: a zero gradient under norm clipping gives no NaN; the weights stay [1, 1]."""
    w = var([1.0, 1.0])
    SGD([w], learning_rate=1.0, **kw).apply_gradients([(T([0.0, 0.0]), w)])
    close(w, [1.0, 1.0])


def test_k7_clip_then_decay_then_momentum():
    """K7: lr 0.1, wd 0.1, clipnorm 1, momentum 0.9; g [30, 40] then [0, 0] → [2.91, 3.88] → [2.8269,
    3.7692]."""
    w = var([3.0, 4.0])
    opt = SGD([w], learning_rate=0.1, weight_decay=0.1, clipnorm=1.0, momentum=0.9)
    opt.apply_gradients([(T([30.0, 40.0]), w)])
    close(w, [2.91, 3.88])
    opt.apply_gradients([(T([0.0, 0.0]), w)])
    close(w, [2.8269, 3.7692])


def test_k8_ema_overwrite_sequence():
    """K8: lr 1, EMA 0.5, overwrite every 3 steps, w0 2, g 1 ×4: w 1, 0, −0.25 (overwritten), −1.25;
    average 1, 0.5, −0.25, −0.75."""
    w = var([2.0])
    opt = SGD([w], learning_rate=1.0, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=3)
    for w_after, avg in zip([1.0, 0.0, -0.25, -1.25], [1.0, 0.5, -0.25, -0.75]):
        opt.apply_gradients([(T([1.0]), w)])
        close(w, [w_after])
        close(opt.get_slot(w, "average"), [avg])


def test_k9_finalize_variable_values():
    """K9: EMA 0.9 without overwrite, three steps: w 1, 0, −1; average 1 → 0.9 → 0.71; finalize sets w."""
    w = var([2.0])
    opt = SGD([w], learning_rate=1.0, use_ema=True, ema_momentum=0.9)
    for w_after, avg in zip([1.0, 0.0, -1.0], [1.0, 0.9, 0.71]):
        opt.apply_gradients([(T([1.0]), w)])
        close(w, [w_after])
        close(opt.get_slot(w, "average"), [avg])
    opt.finalize_variable_values()
    close(w, [0.71])


def test_k13_k14_schedules_and_callables():
    """K13: ExponentialDecay(0.1, decay_steps 1, rate 0.5) → 0.9, 0.85, 0.825 (the schedule reads the
    applied-update count); K14: lr = lambda: 0.25 → 0.75, 0.5. The schedule also survives get_config."""
    sched = optkit.PolicySchedule("exp_decay", learning_rate=0.1, decay_steps=1, decay_rate=0.5,
                                  use_staircase_decay=False)
    w = var([1.0])
    opt = SGD([w], learning_rate=sched)
    for w_after in (0.9, 0.85, 0.825):
        opt.apply_gradients([(T([1.0]), w)])
        close(w, [w_after])
    again = SGD.from_config(opt.get_config(), [var([1.0])])
    assert again.get_config() == opt.get_config()
    w = var([1.0])
    opt = SGD([w], learning_rate=lambda: 0.25)
    for w_after in (0.75, 0.5):
        opt.apply_gradients([(T([1.0]), w)])
        close(w, [w_after])


def test_k15_ema_covers_variables_without_gradient():
    """K15: EMA 0.5 over a (g = 1 each step) and b (no gradient, set to 7 after build): avg_a 0 → −0.5,
    avg_b = 7."""
    a, b = var([1.0]), var([5.0])
    opt = SGD([a, b], learning_rate=1.0, use_ema=True, ema_momentum=0.5)
    with torch.no_grad():
        b.fill_(7.0)
    for avg_a in (0.0, -0.5):
        opt.apply_gradients([(T([1.0]), a), (None, b)])
        close(opt.get_slot(a, "average"), [avg_a])
    close(opt.get_slot(b, "average"), [7.0])


def test_k16_sparse_gradient_clipnorm_after_deduplication():
    """K16: clipnorm 1 with IndexedSlices [[3,4],[3,4]] at [0, 0]. Keras clips the raw rows
    ([−0.8485, −1.1314]); optkit densifies first, so the norm is that of the summed row [6, 8] → [−0.6, −0.8]
    (compatibility.md, row "optimizer base: sparse gradients with clipnorm")."""
    w = var(torch.zeros(3, 2).tolist())
    g = torch.sparse_coo_tensor(torch.tensor([[0, 0]]), T([[3.0, 4.0], [3.0, 4.0]]), (3, 2))
    SGD([w], learning_rate=1.0, clipnorm=1.0).apply_gradients([(g, w)])
    close(w, [[-0.6, -0.8], [0.0, 0.0], [0.0, 0.0]])


S_GRADS = [[0.5, 1.0], [0.5, 1.0], [-1.0, 2.0]]


@pytest.mark.parametrize(
    "kw,expected",
    [
        ({}, [[0.95, -2.1], [0.9, -2.2]]),
        ({"momentum": 0.9}, [[0.95, -2.1], [0.855, -2.29], [0.8695, -2.661]]),
        ({"momentum": 0.9, "nesterov": True}, [[0.905, -2.19], [0.7695, -2.461], [0.88255, -2.9949]]),
    ],
    ids=["S1", "S2", "S3"],
)
@pytest.mark.parametrize("dtype", [F32, F64])
def test_sgd_spec_momentum_forms(kw, expected, dtype):
    """S1–S3: w0 = [1, −2], lr 0.1, gradients [0.5, 1], [0.5, 1], [−1, 2]: plain, momentum 0.9, Nesterov."""
    w = var([1.0, -2.0], dtype)
    opt = SGD([w], learning_rate=0.1, **kw)
    for g, w_after in zip(S_GRADS, expected):
        opt.apply_gradients([(T(g, dtype), w)])
        close(w, w_after)


@pytest.mark.parametrize("momentum,row0", [(0.0, [0.4, 0.4]), (0.5, [0.25, 0.25])])
def test_sgd_spec_sparse_duplicates(momentum, row0):
    """S4: var [[1,1],[2,2],[3,3]], IndexedSlices [[1,1],[2,2]] at [0, 0], lr 0.1, two steps."""
    w = var([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    opt = SGD([w], learning_rate=0.1, momentum=momentum)
    for _ in range(2):
        g = torch.sparse_coo_tensor(torch.tensor([[0, 0]]), T([[1.0, 1.0], [2.0, 2.0]]), (3, 2))
        opt.apply_gradients([(g, w)])
    close(w, [row0, [2.0, 2.0], [3.0, 3.0]])


def test_keras_sgd_velocity_differs_from_tf1_momentum_when_lr_changes():
    """tf_keras.md §5.1: Keras keeps v = m·v − lr·g (lr inside the velocity); TF1 Momentum keeps a = m·a + g
    and multiplies by the current lr. Equal for a constant lr, different once the lr changes."""
    lrs = iter([0.1, 0.1, 0.5])
    a, b = var([1.0, -2.0], F64), var([1.0, -2.0], F64)
    keras = SGD([a], learning_rate=0.1, momentum=0.9)
    tf1 = optkit.Momentum([b], learning_rate=0.1, momentum=0.9)
    for g in S_GRADS:
        lr = next(lrs)
        keras.learning_rate = lr
        tf1.param_groups[0]["lr"] = lr
        keras.apply_gradients([(T(g, F64), a)])
        b.grad = T(g, F64)
        tf1.step()
    v = np.zeros(2)
    w = np.array([1.0, -2.0])
    for g, lr in zip(S_GRADS, [0.1, 0.1, 0.5]):
        v = 0.9 * v - lr * np.array(g)
        w = w + v
    close(a, w, tol=1e-12)
    assert not torch.allclose(a.detach(), b.detach())


def test_sgd_argument_checks():
    """tf_keras.md §5.1: momentum must lie in [0, 1]; optkit accepts ints (compatibility.md, row "optimizer
    base: numbers") and rejects unknown keywords (row "optimizer keyword arguments")."""
    w = var([1.0])
    with pytest.raises(ValueError, match="momentum"):
        SGD([w], momentum=1.5)
    with pytest.raises(ValueError, match="momentum"):
        SGD([w], momentum=-0.1)
    SGD([w], learning_rate=1, momentum=0)
    assert SGD([w], lr=0.1).get_config()["learning_rate"] == 0.1  # torch's name: an alias (compatibility.md)
    assert SGD([w], momentum=0.5).get_slot_names() == ["momentum"]
    assert SGD([w]).get_slot_names() == []
