"""The Keras-style base (``optkit.Optimizer``), exercised through ``optkit.SGD`` (and the other optkit
optimizers where the base does the work): checkpoints, config, validation, skip semantics and the TF
surface (``spec/tf_keras.md`` §4.1, DESIGN §1 and §2.1)."""

from __future__ import annotations

import copy
import gc
import math
import warnings

import numpy as np
import pytest
import torch

from optkit import LARC, LARS, SGD, Ftrl, LearningRateSchedule, LossScaleOptimizer, PolicySchedule, RMSProp
from optkit._gc import GC_PAUSE_MIN_TENSORS

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")


def make_params(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    shapes = {"enc.weight": (6, 4), "enc.bias": (4,), "dec.weight": (3, 3, 2)}
    return [(n, torch.randn(s, generator=g, dtype=dtype).requires_grad_()) for n, s in shapes.items()]


def grads_for(params, step, seed=1):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return [torch.randn(p.shape, generator=g, dtype=p.dtype) for _, p in params]


def do_step(opt, params, step, **attrs):
    for (_, p), g in zip(params, grads_for(params, step)):
        p.grad = g
    for k, v in attrs.items():
        setattr(opt, k, v)
    opt.step()
    for k in attrs:
        delattr(opt, k)


def snapshot(opt, params):
    return (
        [p.detach().clone() for _, p in params],
        {id(p): {k: v.clone() for k, v in opt.state[p].items()} for _, p in params},
        opt.iterations.clone(),
    )


def assert_same(a, b):
    (pa, sa, ia), (pb, sb, ib) = a, b
    for x, y in zip(pa, pb):
        assert torch.equal(x, y)
    for (_, xa), (_, xb) in zip(sa.items(), sb.items()):
        assert xa.keys() == xb.keys()
        for k in xa:
            assert torch.equal(xa[k], xb[k]), k
    assert torch.equal(ia, ib)


FACTORIES = {
    "sgd": lambda ps: SGD(
        ps,
        learning_rate=lambda step: 0.1 / (1 + step),
        momentum=0.9,
        nesterov=True,
        weight_decay=0.01,
        use_ema=True,
        ema_momentum=0.9,
        ema_overwrite_frequency=4,
        global_clipnorm=3.0,
    ),
    "lars": lambda ps: LARS(ps, learning_rate=0.5, skip_list=["bias"], use_ema=True, clipnorm=2.0),
    "lars14": lambda ps: LARS(ps, learning_rate=0.5, use_nesterov=True, variant="tf1.14"),
    "ftrl": lambda ps: Ftrl(
        ps, learning_rate=0.2, l1_regularization_strength=0.01, l2_regularization_strength=0.02
    ),
    "rmsprop": lambda ps: RMSProp(ps, learning_rate=0.01, momentum=0.5, centered=True),
}


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_state_dict_round_trip_continues_bit_identically(kind):
    make = FACTORIES[kind]
    params = make_params()
    opt = make(params)
    for k in range(3):
        do_step(opt, params, k)
    saved_params = [p.detach().clone() for _, p in params]
    saved_state = copy.deepcopy(opt.state_dict())
    for k in range(3, 6):
        do_step(opt, params, k)
    expected = snapshot(opt, params)

    params2 = make_params(seed=99)  # different values, overwritten from the checkpoint
    with torch.no_grad():
        for (_, p), v in zip(params2, saved_params):
            p.copy_(v)
    opt2 = make(params2)
    opt2.load_state_dict(saved_state)
    assert int(opt2.iterations) == 3
    for k in range(3, 6):
        do_step(opt2, params2, k)
    assert_same(snapshot(opt2, params2), expected)


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_get_config_from_config_round_trip(kind):
    params = make_params()
    opt = FACTORIES[kind](params)
    cfg = opt.get_config()
    clone = type(opt).from_config(cfg, make_params())
    assert clone.get_config() == cfg


def test_config_round_trip_with_schedule():
    sched = PolicySchedule("poly_decay", learning_rate=0.1, decay_steps=10)
    opt = SGD(make_params(), learning_rate=sched, momentum=0.5, clipvalue=0.3)
    cfg = opt.get_config()
    assert cfg["momentum"] == 0.5 and cfg["clipvalue"] == 0.3 and isinstance(cfg["learning_rate"], dict)
    clone = SGD.from_config(cfg, make_params())
    assert clone.get_config() == cfg
    assert float(clone._current_lr(clone.param_groups[0])) == pytest.approx(0.1)


def test_config_records_the_optimizers_lr_not_a_groups_own():
    """A first group with its own ``lr`` is not the optimizer's learning rate: the config (and a load) keep
    the one the other groups took, and ``from_config`` over the same groups trains identically."""
    def groups(params):
        return [{"params": [params[0][1]], "lr": 0.5}, {"params": [p for _, p in params[1:]]}]

    params = make_params()
    opt = SGD(groups(params), learning_rate=0.01, momentum=0.5)
    cfg = opt.get_config()
    assert cfg["learning_rate"] == 0.01
    params2 = make_params()
    clone = SGD.from_config(cfg, groups(params2))
    assert [g["lr"] for g in clone.param_groups] == [0.5, 0.01]
    for k in range(3):
        do_step(opt, params, k)
        do_step(clone, params2, k)
    for (_, a), (_, b) in zip(params, params2):
        assert torch.equal(a, b)
    opt.load_state_dict(opt.state_dict())
    assert opt.learning_rate == 0.01
    for g in opt.param_groups[1:]:  # a torch scheduler moves the groups' lr: the config follows them
        g["lr"] = 0.002
    assert opt.get_config()["learning_rate"] == 0.002
    opt.learning_rate = 0.003  # the setter is the optimizer's lr: a group added later takes it
    opt.add_param_group({"params": [torch.randn(2, requires_grad=True)]})
    assert opt.param_groups[-1]["lr"] == 0.003


def test_from_config_rebuilds_the_schedule_class_it_recorded():
    """The config names the schedule's class: a subclass (with or without a config tag of its own) comes back
    as itself, found by name or through ``custom_objects`` (Keras), never silently as its base class."""
    class Doubled(PolicySchedule):
        def __call__(self, step):
            return 2 * super().__call__(step)

    class Halving(LearningRateSchedule):
        def __init__(self, lr0):
            self.lr0 = lr0

        def __call__(self, step):
            return self.lr0 * 0.5 ** step

        def get_config(self):
            return {"lr0": self.lr0}

    for sched in (Doubled("fixed_lr", learning_rate=0.1), Halving(0.2)):
        params, params2 = make_params(), make_params()
        opt = SGD(params, learning_rate=sched)
        clone = SGD.from_config(opt.get_config(), params2)
        assert type(clone.learning_rate) is type(sched)
        for k in range(2):
            do_step(opt, params, k)
            do_step(clone, params2, k)
        for (_, a), (_, b) in zip(params, params2):
            assert torch.equal(a, b)
    cfg = SGD(make_params(), learning_rate=Halving(0.2)).get_config()
    other = type("Halving", (Halving,), {})  # another class of that name elsewhere: the name is ambiguous
    with pytest.raises(ValueError, match="custom_objects"):
        SGD.from_config(cfg, make_params())
    clone = SGD.from_config(cfg, make_params(), custom_objects={"Halving": other})
    assert type(clone.learning_rate) is other


def test_a_subclass_keeps_its_own_options_in_the_config():
    """A custom optimizer written as the base's docstring says (``slot_names``, ``_pointwise``, ``_update``)
    keeps the options it passes to ``Optimizer.__init__`` in ``get_config``, with no ``_hyper_config``."""
    from optkit import Optimizer

    class ScaledSGD(Optimizer):
        slot_names = ()

        def __init__(self, params, learning_rate=0.01, factor=1.0, **kw):
            super().__init__(params, learning_rate, factor=float(factor), **kw)

        @staticmethod
        def _pointwise(hyper, w, g, slots, lr, k, aux):
            (factor,) = hyper
            return w - (g * lr if k is None else g * (lr * k)) * factor, []

        def _pointwise_hyper(self, group):
            return (float(group["factor"]),)

        def _update(self, group, params, grads, slots, lr, k, found_inf, aux):
            self._pointwise_fallback(group, params, grads, [], lr, k, found_inf, aux)

    params, params2 = make_params(), make_params()
    opt = ScaledSGD(params, learning_rate=0.1, factor=5.0)
    assert opt.get_config()["factor"] == 5.0
    clone = ScaledSGD.from_config(opt.get_config(), params2)
    do_step(opt, params, 0)
    do_step(clone, params2, 0)
    for (_, a), (_, b) in zip(params, params2):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------------------
# skip semantics and grad_scale


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_found_inf_leaves_everything_bit_identical(kind):
    params = make_params()
    opt = FACTORIES[kind](params)
    do_step(opt, params, 0)
    before = snapshot(opt, params)
    for (_, p), g in zip(params, grads_for(params, 1)):
        g.view(-1)[0] = math.inf
        g.view(-1)[-1] = math.nan
        p.grad = g
    opt.found_inf = torch.ones(())
    opt.step()
    del opt.found_inf
    assert not bool(opt.step_applied)
    assert_same(snapshot(opt, params), before)
    do_step(opt, params, 2)  # still usable, and the next step applies
    assert bool(opt.step_applied) and int(opt.iterations) == 2


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_skipped_step_leaves_a_scheduled_learning_rate_as_it_was(wrapped):
    """With a schedule, each applied step writes the value it used to the group's ``lr`` (Keras reads the
    schedule the same way); a skipped step (``found_inf``, here also through LARC, which reads the rate
    first) writes nothing, so its ``state_dict()`` equals the one before it, and the next applied step
    writes the schedule's value at the unchanged iteration count."""
    import optkit

    sched = PolicySchedule("poly_decay", learning_rate=0.5, decay_steps=10, warmup_steps=2, begin_decay_at=2)
    params = make_params()
    inner = SGD(params, learning_rate=sched, momentum=0.5)
    opt = optkit.LARC(inner, 0.02) if wrapped else inner
    for k in range(2):
        do_step(opt, params, k)
    before = inner.state_dict()["param_groups"][0]["lr"]
    for (_, p), g in zip(params, grads_for(params, 2)):
        p.grad = g
    opt.found_inf = torch.ones(())
    opt.step()
    del opt.found_inf
    assert torch.equal(torch.as_tensor(inner.state_dict()["param_groups"][0]["lr"]), torch.as_tensor(before))
    do_step(opt, params, 3)
    lr = torch.as_tensor(inner.param_groups[0]["lr"])
    assert float(lr) == pytest.approx(float(sched(torch.tensor(2))))
    assert float(lr) != pytest.approx(float(torch.as_tensor(before)))


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_grad_scale_unscales(kind):
    a, b = make_params(), make_params()
    oa, ob = FACTORIES[kind](a), FACTORIES[kind](b)
    for k in range(3):
        do_step(oa, a, k)
        for (_, p), g in zip(b, grads_for(b, k)):
            p.grad = g * 1024.0
        ob.grad_scale = torch.tensor(1024.0)
        ob.found_inf = torch.zeros(())
        ob.step()
        del ob.grad_scale, ob.found_inf
        assert bool(ob.step_applied)
    for (_, x), (_, y) in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_grad_multipliers_scale_one_parameter():
    a, b = make_params(), make_params()
    oa = SGD(a, learning_rate=0.1, momentum=0.9, weight_decay=0.1)
    ob = SGD(b, learning_rate=0.1, momentum=0.9, weight_decay=0.1)
    for k in range(2):
        for (_, p), g in zip(a, grads_for(a, k)):
            p.grad = g
        a[1][1].grad = a[1][1].grad * 0.25
        oa.step()
        do_step(ob, b, k, grad_multipliers={id(b[1][1]): torch.tensor(0.25)})
    for (_, x), (_, y) in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_torch_grad_scaler_protocol_flag():
    assert SGD._step_supports_amp_scaling is True


# ------------------------------------------------------------------------------------------------------------
# validation: ValueError/TypeError naming the argument; nothing is created or changed


@pytest.mark.parametrize(
    "kwargs,exc,name",
    [
        ({"learning_rate": -0.1}, ValueError, "learning_rate"),
        ({"learning_rate": "fast"}, TypeError, "learning_rate"),
        ({"momentum": 1.5}, ValueError, "momentum"),
        ({"momentum": -0.1}, ValueError, "momentum"),
        ({"momentum": "0.9"}, TypeError, "momentum"),
        ({"nesterov": "yes"}, TypeError, "nesterov"),
        ({"weight_decay": -1.0}, ValueError, "weight_decay"),
        ({"clipnorm": 0.0}, ValueError, "clipnorm"),
        ({"clipvalue": -1.0}, ValueError, "clipvalue"),
        ({"global_clipnorm": math.nan}, ValueError, "global_clipnorm"),
        ({"clipnorm": 1.0, "clipvalue": 1.0}, ValueError, "clipvalue"),
        ({"clipnorm": 1.0, "global_clipnorm": 1.0}, ValueError, "global_clipnorm"),
        ({"use_ema": 1}, TypeError, "use_ema"),
        ({"ema_momentum": 1.5}, ValueError, "ema_momentum"),
        ({"ema_overwrite_frequency": 0}, ValueError, "ema_overwrite_frequency"),
        ({"ema_overwrite_frequency": 2.5}, TypeError, "ema_overwrite_frequency"),
        ({"jit_compile": "yes"}, TypeError, "jit_compile"),
        ({"name": 3}, TypeError, "name"),
    ],
)
def test_constructor_validation(kwargs, exc, name):
    params = make_params()
    before = [p.detach().clone() for _, p in params]
    with pytest.raises(exc, match=name):
        SGD(params, **kwargs)
    for (_, p), b in zip(params, before):
        assert torch.equal(p, b)


@pytest.mark.parametrize("key, value", [("momentum", None), ("lr_scale", "x"), ("lr", None),
                                        ("weight_decay", "a")])
def test_a_bad_hyperparameter_in_a_later_group_raises_before_any_group_is_written(key, value):
    """A hyperparameter written into the second group between steps (or loaded for a key this optimizer's
    groups lack) that is not a number raised from ``float()`` after the first group was updated. Now the
    step raises TypeError naming the key before any weight, slot or the step count changes, and such a
    loaded value is refused (ValueError) before anything loads."""
    from optkit import Momentum

    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(3, dtype=torch.float64)) for _ in range(4)]
    opt = Momentum([{"params": ps[:2]}, {"params": ps[2:]}], 0.1, momentum=0.9)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    before = [p.detach().clone() for p in ps]
    slots = [opt.state[p]["momentum_buffer"].clone() for p in ps]
    opt.param_groups[1][key] = value
    with pytest.raises(TypeError, match=key):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(ps, before))
    assert all(torch.equal(opt.state[p]["momentum_buffer"], m) for p, m in zip(ps, slots))
    assert int(opt.iterations) == 1
    if key == "lr_scale":  # a key the live groups lack, from a file
        del opt.param_groups[1][key]
        saved["param_groups"][1][key] = value
        with pytest.raises(ValueError, match=key):
            opt.load_state_dict(saved)
        assert "lr_scale" not in opt.param_groups[1]


def test_params_validation():
    with pytest.raises(TypeError, match="params"):
        SGD(torch.zeros(3, requires_grad=True))
    with pytest.raises(ValueError, match="params"):
        SGD([])
    with pytest.raises(ValueError, match="`params`: the param groups hold no parameters"):
        SGD([{"params": []}, {"params": iter(())}])  # (was a bare StopIteration)


def usable(opt, params):
    before = snapshot(opt, params)
    do_step(opt, params, 7)
    after = snapshot(opt, params)
    assert int(after[2]) == int(before[2]) + 1
    assert not all(torch.equal(x, y) for x, y in zip(before[0], after[0]))


def test_method_validation_leaves_optimizer_usable():
    params = make_params()
    opt = SGD(params, learning_rate=0.1, momentum=0.9, use_ema=True)
    do_step(opt, params, 0)
    state = snapshot(opt, params)
    tensors = [p for _, p in params]
    stranger = torch.zeros(3, requires_grad=True)
    bad_calls = [
        (lambda: setattr(opt, "learning_rate", -1.0), ValueError, "learning_rate"),
        (lambda: setattr(opt, "learning_rate", "x"), TypeError, "learning_rate"),
        (lambda: opt.apply_gradients([(torch.ones(3), stranger)]), ValueError, "unknown variable"),
        (lambda: opt.apply_gradients([(None, tensors[0]), (None, tensors[1])]), ValueError, "No gradients"),
        (lambda: opt.apply_gradients([(torch.ones(2), tensors[1])]), ValueError, "shape"),
        (lambda: opt.apply_gradients([("g", tensors[1])]), TypeError, "Tensors"),
        (lambda: opt.apply_gradients([tensors[0]]), TypeError, "pairs"),
        (lambda: opt.set_weights(opt.get_weights()[:-1]), ValueError, "expected"),
        (lambda: opt.set_weights([torch.zeros(9)] * len(opt.variables())), ValueError, "shape"),
        (lambda: opt.get_slot(tensors[0], "velocity"), ValueError, "unknown slot"),
        (lambda: opt.get_slot(stranger, "momentum"), ValueError, "var"),
        (lambda: opt.update_step(torch.ones(2), tensors[0]), ValueError, "shape"),
        (lambda: opt.update_step(torch.ones(3), stranger), ValueError, "variable"),
        (lambda: opt.build([stranger]), ValueError, "build"),
        (lambda: opt.add_variable((2,), initializer="glorot"), ValueError, "initializer"),
        (lambda: opt.exclude_from_weight_decay(var_names="bias"), TypeError, "var_names"),
        (lambda: opt.exclude_from_weight_decay(var_list=["bias"]), TypeError, "var_list"),
        (lambda: opt.finalize_variable_values([stranger]), ValueError, "average"),
        (
            lambda: opt.compute_gradients(
                lambda: torch.ones(2, requires_grad=True).sum() * tensors[0].sum() * torch.ones(2)
            ),
            ValueError,
            "scalar",
        ),
    ]
    for call, exc, match in bad_calls:
        with pytest.raises(exc, match=match):
            call()
        assert_same(snapshot(opt, params), state)
    assert opt.learning_rate == 0.1
    usable(opt, params)


# ------------------------------------------------------------------------------------------------------------
# TF surface


def test_compute_apply_minimize():
    w = torch.tensor([1.0, -2.0], requires_grad=True)
    unused = torch.tensor([5.0], requires_grad=True)
    opt = SGD([w, unused], learning_rate=0.1)
    pairs = opt.compute_gradients(lambda: (w * w).sum() / 2)
    assert pairs[1][0] is None and torch.equal(pairs[0][0], w.detach())
    it = opt.apply_gradients(pairs)
    assert int(it) == 1
    torch.testing.assert_close(w.detach(), torch.tensor([0.9, -1.8]))
    assert torch.equal(unused.detach(), torch.tensor([5.0]))
    opt.minimize(lambda: (w * w).sum() / 2, var_list=[w])
    torch.testing.assert_close(w.detach(), torch.tensor([0.81, -1.62]))
    assert int(opt.iterations) == 2
    assert w.grad is None  # apply_gradients restores the .grad fields it borrowed


def test_apply_gradients_refuses_a_variable_given_twice():
    """The second pair's gradient replaced the first one silently (one ``.grad`` per variable); now a
    ValueError naming the pair, with nothing changed."""
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    opt = SGD([w], learning_rate=0.1, momentum=0.9)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"grads_and_vars\[1\].*given before"):
        opt.apply_gradients([(torch.ones(2), w), (2 * torch.ones(2), w)])
    with pytest.raises(ValueError, match="given before"):
        opt.minimize(lambda: (w * w).sum(), var_list=[w, w])
    assert torch.equal(w.detach(), torch.tensor([1.0, 2.0])) and int(opt.iterations) == 0
    assert torch.equal(opt.state_dict()["state"][0]["momentum"], before["state"][0]["momentum"])


def test_seed_docstring_examples():
    var = torch.tensor(1.0, requires_grad=True)
    opt = SGD([var], learning_rate=0.1)
    opt.minimize(lambda: var**2 / 2.0, [var])
    assert float(var.detach()) == pytest.approx(0.9)
    var = torch.tensor(1.0, requires_grad=True)
    opt = SGD([var], learning_rate=0.1, momentum=0.9)
    v0 = float(var.detach())
    opt.minimize(lambda: var**2 / 2.0, [var])
    v1 = float(var.detach())
    opt.minimize(lambda: var**2 / 2.0, [var])
    v2 = float(var.detach())
    assert v0 - v1 == pytest.approx(0.1) and v1 - v2 == pytest.approx(0.18)


def test_slots_variables_order_and_weights():
    params = make_params()
    opt = SGD(params, learning_rate=0.1, momentum=0.9, use_ema=True)
    ts = [p for _, p in params]
    assert opt.get_slot_names() == ["momentum", "average"]
    vs = opt.variables()
    assert vs[0] is opt.iterations
    assert [v.shape for v in vs[1:4]] == [p.shape for p in ts]  # averages, then momentum slots
    assert all(v is opt.get_slot(p, "average") for v, p in zip(vs[1:4], ts))
    assert all(v is opt.get_slot(p, "momentum") for v, p in zip(vs[4:7], ts))
    extra = opt.add_variable((2,), initializer="ones", name="extra")
    assert opt.variables()[-1] is extra and torch.equal(extra, torch.ones(2))
    do_step(opt, params, 0)
    weights = opt.get_weights()
    do_step(opt, params, 1)
    opt.set_weights(weights)
    assert int(opt.iterations) == 1
    for v, w in zip(opt.variables(), weights):
        assert torch.equal(v, w)
    assert SGD(make_params(), momentum=0.0).get_slot_names() == []


def test_update_step_single_variable():
    w = torch.tensor([1.0, -2.0], requires_grad=True)
    other = torch.tensor([3.0], requires_grad=True)
    opt = SGD([w, other], learning_rate=0.1, momentum=0.9)
    opt.update_step(torch.tensor([0.5, 1.0]), w)
    torch.testing.assert_close(w.detach(), torch.tensor([0.95, -2.1]))
    torch.testing.assert_close(opt.get_slot(w, "momentum"), torch.tensor([-0.05, -0.1]))
    assert int(opt.iterations) == 0 and torch.equal(other.detach(), torch.tensor([3.0]))
    opt.update_step(torch.tensor([0.5, 1.0]), w, learning_rate=0.2)
    torch.testing.assert_close(w.detach(), torch.tensor([0.805, -2.39]))


def test_build_is_idempotent_and_state_exists_at_construction():
    params = make_params()
    opt = SGD(params, momentum=0.5)
    assert all("momentum" in opt.state[p] and "step" in opt.state[p] for _, p in params)
    slot = opt.get_slot(params[0][1], "momentum")
    opt.build()
    assert opt.get_slot(params[0][1], "momentum") is slot


def test_add_param_group_builds_state_and_names():
    params = make_params()
    opt = SGD(params[:2], learning_rate=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="with/without names"):  # torch's rule: all named or none
        opt.add_param_group({"params": [params[2][1]], "lr": 0.01})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [params[2]], "lr": 0.01})
    assert "momentum" in opt.state[params[2][1]]
    assert opt.param_groups[1]["param_names"] == [params[2][0]]
    do_step(opt, params, 0)
    assert int(opt.iterations) == 1


def test_amsgrad_accepted_and_ignored():
    a, b = make_params(), make_params()
    oa, ob = SGD(a, momentum=0.5), SGD(b, momentum=0.5, amsgrad=True)
    do_step(oa, a, 0)
    do_step(ob, b, 0)
    for (_, x), (_, y) in zip(a, b):
        assert torch.equal(x, y)


def test_param_groups_with_own_lr_and_decay():
    params = make_params()
    groups = [
        {"params": [params[0][1], params[2][1]], "weight_decay": 0.1},
        {"params": [params[1][1]], "lr": 0.5, "weight_decay": 0.0},
    ]
    opt = SGD(groups, learning_rate=0.1)
    before = [p.detach().clone() for _, p in params]
    grads = grads_for(params, 0)
    for (_, p), g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    np.testing.assert_allclose(params[1][1].detach().numpy(), (before[1] - 0.5 * grads[1]).numpy(), rtol=1e-6)
    expect0 = before[0] - before[0] * 0.1 * 0.1 - 0.1 * grads[0]
    np.testing.assert_allclose(params[0][1].detach().numpy(), expect0.numpy(), rtol=1e-5, atol=1e-7)


def test_no_gradients_at_all_is_a_no_op():
    params = make_params()
    opt = SGD(params, momentum=0.9)
    before = snapshot(opt, params)
    opt.step()
    assert not bool(opt.step_applied)
    assert_same(snapshot(opt, params), before)


def test_closure_return_value():
    w = torch.tensor([1.0], requires_grad=True)
    opt = SGD([w], learning_rate=0.1)

    def closure():
        opt.zero_grad()
        loss = (w * w).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert float(loss.detach()) == 1.0 and float(w.detach()) == pytest.approx(0.8)


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_pointwise_rules_used_by_jit_compile_match_eager(kind, monkeypatch):
    """``jit_compile`` hands ``optkit._core.chain.chain`` (decay → each optimizer's pointwise rule → EMA) to
    ``torch.compile``; running it uncompiled must reproduce the eager update, skipped steps included."""
    import optkit._core.compiled as base
    from optkit._core.chain import chain

    monkeypatch.setattr(base, "compiled_chain", lambda: chain)
    a, b = make_params(), make_params()
    oa = FACTORIES[kind](a)
    ob = FACTORIES[kind](b)
    ob.jit_compile = True
    for k in range(4):
        do_step(oa, a, k)
        do_step(ob, b, k)
    for opt, ps in ((oa, a), (ob, b)):  # a skipped step changes nothing on either path
        for (_, p), g in zip(ps, grads_for(ps, 9)):
            p.grad = g.fill_(math.inf)
        opt.found_inf = torch.ones(())
        opt.step()
        del opt.found_inf
    assert ob._compile_state == "ok"
    for (_, x), (_, y) in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
        for slot in oa.get_slot_names():
            torch.testing.assert_close(oa.get_slot(x, slot), ob.get_slot(y, slot), rtol=1e-5, atol=1e-6)


def test_jit_compile_warns_before_tracing_a_group_of_thousands_of_tensors(monkeypatch):
    """Compiling traces one graph input per tensor: over ``COMPILE_WARN_TENSORS`` tensors in a group the
    first compiled step warns once (naming the count and the flat-buffer alternative) and still runs."""
    import optkit._core.compiled as base
    from optkit._core.chain import chain

    monkeypatch.setattr(base, "compiled_chain", lambda: chain)
    monkeypatch.setattr(base, "COMPILE_WARN_TENSORS", 3)
    for n, warns in ((3, False), (4, True)):
        ps = [torch.ones(2, requires_grad=True) for _ in range(n)]
        opt = SGD(ps, learning_rate=0.5, momentum=0.9, jit_compile=True)
        for p in ps:
            p.grad = torch.ones(2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
            opt.step()
        msgs = [str(w.message) for w in caught if "jit_compile=True over" in str(w.message)]
        assert len(msgs) == (1 if warns else 0) and (not warns or "4 tensors" in msgs[0])
        assert opt._compile_state == "ok"
        torch.testing.assert_close(ps[0].detach(), torch.full((2,), 1.0 - 0.5 - (0.9 * 0.5 + 0.5)))


def test_replaced_parameter_storage_is_followed():
    """The cached per-group structure must follow ``p.data = ...`` (new storage) instead of updating stale
    memory."""
    w = torch.ones(4, requires_grad=True)
    opt = SGD([w], learning_rate=0.5, momentum=0.5, weight_decay=0.1, use_ema=True)
    w.grad = torch.ones(4)
    opt.step()
    w.data = torch.full((4,), 2.0)
    w.grad = torch.ones(4)
    opt.step()
    v = 0.5 * (-0.5) - 0.5  # velocity −0.5 after step 1, then 0.5·(−0.5) − 0.5
    torch.testing.assert_close(opt.get_slot(w, "momentum"), torch.full((4,), v))
    torch.testing.assert_close(w.detach(), torch.full((4,), 2.0 * (1 - 0.5 * 0.1) + v))  # decay, then + v


def test_deepcopy_keeps_options_counters_and_continues_identically():
    import copy

    import torch

    from optkit import SGD

    torch.manual_seed(7)
    w = torch.nn.Parameter(torch.randn(5))
    opt = SGD([w], 0.1, momentum=0.9, weight_decay=0.01, use_ema=True, global_clipnorm=1.0)
    w.grad = torch.randn(5)
    opt.step()
    clone = copy.deepcopy({"w": w, "opt": opt})
    o2, w2 = clone["opt"], clone["w"]
    assert o2.global_clipnorm == 1.0 and o2.use_ema and int(o2.iterations) == 1
    g = torch.randn(5)
    w.grad, w2.grad = g.clone(), g.clone()
    opt.step()
    o2.step()
    assert torch.equal(w.detach(), w2.detach())
    assert torch.equal(opt.state[w]["average"], o2.state[w2]["average"])
    assert int(o2.iterations) == 2 and o2.state[w2]["step"] is o2.iterations


@pytest.mark.parametrize("cls, kwargs", [("SGD", {"momentm": 0.9}), ("LARS", {"eta": 0.1}),
                                         ("Ftrl", {"l3": 1.0}), ("RMSProp", {"rho": 0.9})])
def test_unknown_keyword_arguments_are_rejected(cls, kwargs):
    import optkit

    w = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        getattr(optkit, cls)([w], 0.1, **kwargs)


def test_lars_rejects_negative_eeta_and_epsilon():
    from optkit import LARS

    w = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="eeta"):
        LARS([w], 0.1, eeta=-0.001)
    with pytest.raises(ValueError, match="epsilon"):
        LARS([w], 0.1, epsilon=-1.0)


def test_name_based_options_need_names():
    """exclude_from_weight_decay(var_names=...) and LARS skip_list match names: with model.parameters()
    (no names) they would match nothing, silently; both refuse and name the remedy."""
    ps = [p for _, p in make_params()]
    opt = SGD(ps, learning_rate=0.1, weight_decay=0.1)
    with pytest.raises(ValueError, match="named_parameters"):
        opt.exclude_from_weight_decay(var_names=["bias"])
    opt.exclude_from_weight_decay(var_list=ps[1:2])  # by identity still works
    with pytest.raises(ValueError, match="named_parameters"):
        LARS(ps, learning_rate=0.1, skip_list=["bias"])
    LARS(make_params(), learning_rate=0.1, skip_list=["bias"])


@pytest.mark.parametrize("wrapped", [False, True])
def test_ema_weights_swaps_in_and_back(wrapped):
    """``with opt.ema_weights():`` evaluates with the averages and restores the training weights bit for bit
    (also after an exception); step() inside raises; without EMA it is a ValueError."""
    from optkit import LARC, MixedPrecisionOptimizerWrapper

    params = make_params()
    opt = SGD(params, learning_rate=0.1, momentum=0.9, use_ema=True, ema_momentum=0.5)
    for k in range(3):
        do_step(opt, params, k)
    live = [p.detach().clone() for _, p in params]
    avgs = [opt.get_slot(p, "average").clone() for _, p in params]
    outer = LARC(opt, 0.01) if wrapped else opt
    with outer.ema_weights():
        for (_, p), a in zip(params, avgs):
            assert torch.equal(p, a)
        with pytest.raises(RuntimeError, match="ema_weights"):
            outer.step()
    for (_, p), w in zip(params, live):
        assert torch.equal(p, w)
    with pytest.raises(KeyError):
        with opt.ema_weights():
            raise KeyError("boom")
    for (_, p), w in zip(params, live):
        assert torch.equal(p, w)
    with pytest.raises(ValueError, match="use_ema"):
        with SGD(make_params(), learning_rate=0.1).ema_weights():
            pass
    # half parameters with fp32 masters: the model sees the rounded averages inside, its own weights after
    w = torch.nn.Parameter(torch.randn(8, dtype=torch.float16))
    mp = MixedPrecisionOptimizerWrapper(SGD([w], learning_rate=0.1, use_ema=True, ema_momentum=0.5))
    for k in range(2):
        w.grad = torch.randn(8, generator=torch.Generator().manual_seed(k)).half()
        mp.step()
    before = w.detach().clone()
    avg = mp.optimizer.get_slot(mp.optimizer.param_groups[0]["params"][0], "average")
    with mp.ema_weights():
        assert torch.equal(w, avg.half())
    assert torch.equal(w, before)


@pytest.mark.parametrize("kind", ["sgd", "lars", "adam"])
def test_torch_compile_of_step_traces_the_pointwise_rule(kind):
    """``torch.compile(opt.step)``: torch's fused kernels have no fake implementation, so under tracing the
    optimizer runs its pointwise rule (inductor fuses it); the result matches the eager step. (The
    ``aot_eager`` backend checks the tracing without a C++ build.)"""
    from optkit import Adam

    make = {"sgd": lambda ps: SGD(ps, learning_rate=0.1, momentum=0.9, weight_decay=0.01, use_ema=True),
            "lars": lambda ps: LARS(ps, learning_rate=0.5, skip_list=["bias"]),
            "adam": lambda ps: Adam(ps, 0.1, amsgrad=True)}[kind]
    a, b = make_params(), make_params()
    oa, ob = make(a), make(b)
    torch._dynamo.reset()
    step = torch.compile(ob.step, backend="aot_eager")
    for k in range(3):
        do_step(oa, a, k)
        for (_, p), g in zip(b, grads_for(b, k)):
            p.grad = g
        step()
    for (_, x), (_, y) in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    assert int(ob.iterations) == 3


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_parameter_replaced_by_another_size_is_refused(kind):
    """``p.data = <a tensor of another size>``: torch's fused kernels would read the old slots out of bounds;
    the plan is rebuilt, the misfit slot named in a ValueError, and nothing is written."""
    params = make_params()
    opt = FACTORIES[kind](params)
    do_step(opt, params, 0)
    w = params[0][1]
    w.data = torch.randn(3, 2)
    w.grad = torch.randn(3, 2)
    before = w.detach().clone()
    with pytest.raises(ValueError, match=params[0][0]):
        opt.step()
    assert torch.equal(w.detach(), before)


def test_a_later_groups_misfit_refuses_the_step_before_any_group_changes():
    """Every group's plan is checked before the first group is updated: a resized parameter in group 1
    raises ``ValueError`` with group 0's weights, slots and the counter untouched."""
    from optkit import Adam

    a = torch.nn.Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(0)))
    b = torch.nn.Parameter(torch.randn(3, generator=torch.Generator().manual_seed(1)))
    opt = Adam([{"params": [a]}, {"params": [b]}], 0.1, global_clipnorm=1.0)
    for p in (a, b):
        p.grad = torch.ones_like(p)
    opt.step()
    b.data = torch.randn(5)
    for p in (a, b):
        p.grad = torch.ones_like(p)
    before = (a.detach().clone(), opt.state[a]["exp_avg"].clone(), a.grad.clone())
    with pytest.raises(ValueError, match="exp_avg"):
        opt.step()
    assert torch.equal(a, before[0]) and torch.equal(opt.state[a]["exp_avg"], before[1])
    assert torch.equal(a.grad, before[2]) and int(opt.iterations) == 1


@pytest.mark.parametrize("how", ["as-built", "deepcopy", "loaded", "mixed-precision"])
def test_names_follow_their_parameters_when_a_group_list_changes_alone(how):
    """torch's ``group["params"].pop(0)`` (the names not touched): the remaining parameters keep their own
    names, so name rules (decay exclusions) still hit them, also in a copy, after a load and over fp32
    masters; an append to a later group of two equal-sized groups steps too."""
    from optkit import AdamW, MixedPrecisionOptimizerWrapper

    m = torch.nn.Linear(2, 1)
    if how == "mixed-precision":
        m = m.half()
    opt = AdamW(m.named_parameters(), learning_rate=0.1, weight_decay=0.5)
    opt.exclude_from_weight_decay(var_names=["bias"])
    if how == "deepcopy":
        m, opt = copy.deepcopy((m, opt))
    elif how == "loaded":
        fresh = AdamW(m.named_parameters(), learning_rate=0.1, weight_decay=0.5)
        fresh.exclude_from_weight_decay(var_names=["bias"])
        fresh.load_state_dict(opt.state_dict())
        opt = fresh
    elif how == "mixed-precision":
        opt = MixedPrecisionOptimizerWrapper(opt)
    with torch.no_grad():
        m.bias.fill_(1.0)
        for p in opt.param_groups[0]["params"]:
            p.fill_(1.0)
    opt.param_groups[0]["params"].pop(0)
    m.bias.grad = torch.zeros_like(m.bias)
    opt.step()
    assert opt.param_groups[0]["param_names"] == ["bias"] and m.bias.item() == 1.0
    a, b, c, d, e = (torch.nn.Parameter(torch.ones(2)) for _ in range(5))
    opt = AdamW([{"params": [a, b]}, {"params": [c, d]}], weight_decay=0.1)
    opt.param_groups[1]["params"].append(e)
    for p in (a, b, c, d, e):
        p.grad = torch.ones(2)
    opt.step()
    assert opt.param_groups[1]["param_names"] == ["param_2", "param_3", "param_4"] and e.detach()[0] < 1


@pytest.mark.parametrize("how", ["append-unnamed", "replace-in-list"])
def test_a_parameter_put_into_a_group_list_steps_at_once(how):
    """torch's idioms on ``group["params"]`` without touching ``param_names``: an appended parameter gets
    a name and its state; one put in place of another gets its state on the first step (not a ValueError
    that a retry would not raise)."""
    from optkit import Momentum

    def make(seed, n):
        g = torch.Generator().manual_seed(seed)
        return torch.nn.Parameter(torch.randn(n, generator=g, dtype=torch.float64))

    ours, ref = [make(0, 3), make(1, 4), make(2, 4)], [make(0, 3), make(1, 4), make(2, 4)]
    opt = Momentum(ours[:2], 0.1, momentum=0.9)
    topt = torch.optim.SGD(ref[:2], lr=0.1, momentum=0.9)
    for k in range(3):
        if k == 1:
            for o, ps in ((opt, ours), (topt, ref)):
                if how == "append-unnamed":
                    o.param_groups[0]["params"].append(ps[2])
                else:
                    o.param_groups[0]["params"][1] = ps[2]
        for o, ps in ((opt, ours), (topt, ref)):
            for j, p in enumerate(ps):
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * k + j),
                                     dtype=torch.float64)
            o.step()
    for x, y in zip(ours, ref):
        torch.testing.assert_close(x.detach(), y.detach(), rtol=1e-13, atol=1e-15)
    assert len(opt.param_groups[0]["param_names"]) == len(opt.param_groups[0]["params"])


def test_a_parameter_appended_to_a_group_gets_its_state_as_in_torch():
    """``group["params"].append(p)`` after a step (torch creates state lazily): the parameter gets zero
    slots and trains exactly as with ``torch.optim.SGD``."""
    from optkit import Momentum

    def make(seed, n):
        g = torch.Generator().manual_seed(seed)
        return torch.nn.Parameter(torch.randn(n, generator=g, dtype=torch.float64))

    ours = [make(0, 4), make(1, 3), make(2, 2)]
    ref = [make(0, 4), make(1, 3), make(2, 2)]
    opt = Momentum([{"params": ours[:1]}, {"params": ours[1:2]}], 0.1, momentum=0.9)
    topt = torch.optim.SGD([{"params": ref[:1]}, {"params": ref[1:2]}], lr=0.1, momentum=0.9)
    for k in range(3):
        if k == 1:
            opt.param_groups[1]["params"].append(ours[2])
            opt.param_groups[1]["param_names"].append("extra")
            topt.param_groups[1]["params"].append(ref[2])
        for x, y in zip(ours, ref):
            g = torch.randn(x.shape, generator=torch.Generator().manual_seed(10 + k), dtype=torch.float64)
            x.grad, y.grad = g.clone(), g.clone()
        opt.step()
        topt.step()
    for x, y in zip(ours, ref):
        torch.testing.assert_close(x.detach(), y.detach(), rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("how", ["replace-slot", "del-entry", "empty-entry", "clear-entry", "ior-state",
                                 "ior-entry", "new-state"])
def test_state_replaced_or_reset_by_the_user_is_what_the_next_step_uses(how, flat):
    """torch.optim reads ``state`` afresh every step, so a slot replaced (or an entry deleted, emptied, or the
    whole ``state`` swapped) is what the next step uses, and a missing slot starts over; the cached plans
    must follow (they held the old slot tensors, and the old momentum kept training invisibly)."""
    import collections

    from optkit import Momentum, flat_parameters

    def params():
        g = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64)) for s in ((5, 4), (4,))]

    ours, ref = params(), params()
    if flat:
        flat_parameters(ours)
    opt = Momentum(ours, 0.05, momentum=0.9)
    topt = torch.optim.SGD(ref, lr=0.05, momentum=0.9)
    for k in range(4):
        if k == 2:
            for o, ps in ((opt, ours), (topt, ref)):
                if how == "replace-slot":
                    o.state[ps[0]]["momentum_buffer"] = torch.full_like(ps[0], 0.5)
                elif how == "del-entry":
                    del o.state[ps[0]]
                elif how == "empty-entry":
                    o.state[ps[0]] = {}
                elif how == "clear-entry":
                    o.state[ps[0]].clear()
                elif how == "ior-state":
                    o.state |= {ps[0]: {}}
                elif how == "ior-entry":
                    o.state[ps[0]] |= {"momentum_buffer": torch.full_like(ps[0], 0.5)}
                else:
                    o.state = collections.defaultdict(dict)
        g = torch.Generator().manual_seed(10 + k)
        for x, y in zip(ours, ref):
            grad = torch.randn(x.shape, generator=g, dtype=torch.float64)
            if x.grad is not None and flat:
                x.grad.copy_(grad)
            else:
                x.grad = grad.clone()
            y.grad = grad.clone()
        opt.step()
        topt.step()
    for x, y in zip(ours, ref):
        torch.testing.assert_close(x.detach(), y.detach(), rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(opt.state[ours[0]]["momentum_buffer"], topt.state[ref[0]]["momentum_buffer"],
                               rtol=1e-13, atol=1e-15)
    seen = []
    opt.register_state_dict_post_hook(lambda o, sd: seen.extend(type(v) for v in sd["state"].values()))
    assert all(type(v) is dict for v in opt.state_dict()["state"].values()) and set(seen) == {dict}
    twin = opt.state.copy()  # a plain mapping of the same entries, as dict.copy
    twin[ours[0]] = {}
    merged = {} | opt.state
    merged[ours[0]] = {}
    assert len(twin) == len(opt.state) and opt.state[ours[0]]


def _gc_seen_during_update(opt, monkeypatch, where="_run_group"):
    seen = []
    target = opt if hasattr(opt, where) else opt.optimizer
    orig = getattr(target, where)

    def spy(*a, **k):
        seen.append(gc.isenabled())
        return orig(*a, **k)

    monkeypatch.setattr(target, where, spy)
    return seen


@pytest.mark.parametrize("n", [GC_PAUSE_MIN_TENSORS - 1, GC_PAUSE_MIN_TENSORS])
def test_cyclic_gc_is_paused_only_over_updates_of_many_tensors(monkeypatch, n):
    """An update over GC_PAUSE_MIN_TENSORS parameters or more runs with the cyclic collector paused (it traced
    the update's short-lived factor tensors: LARS on 10,000 tensors 252 -> 115 ms per step), smaller ones
    with it as it was; it is enabled again afterwards, also through a wrapper (LARC), and the update is the
    same (against a step with the collector left on)."""
    g = torch.Generator().manual_seed(3)
    ps = [torch.nn.Parameter(torch.randn(3, generator=g)) for _ in range(n)]
    for p in ps:
        p.grad = torch.randn(3, generator=g)
    ref = [p.detach().clone() for p in ps]
    ref_g = [p.grad.clone() for p in ps]  # (LARS leaves its update direction in .grad)
    opt = LARS(ps, 0.1, momentum=0.9, weight_decay=1e-4)
    seen = _gc_seen_during_update(opt, monkeypatch)
    assert gc.isenabled()
    opt.step()
    assert gc.isenabled() and seen == [n < GC_PAUSE_MIN_TENSORS]
    # the same numbers as with the pause switched off (threshold raised past n)
    monkeypatch.setattr("optkit._gc.GC_PAUSE_MIN_TENSORS", 10**9)
    qs = [torch.nn.Parameter(r.clone()) for r in ref]
    for q, rg in zip(qs, ref_g):
        q.grad = rg.clone()
    LARS(qs, 0.1, momentum=0.9, weight_decay=1e-4).step()
    assert all(torch.equal(p, q) for p, q in zip(ps, qs))
    assert not all(torch.equal(p, r) for p, r in zip(ps, ref))  # the step did move the weights
    monkeypatch.undo()
    wrapped = LARC(SGD(qs, 0.1, momentum=0.9), 0.001)
    seen = _gc_seen_during_update(wrapped, monkeypatch, "_wrapped_step")
    wrapped.step()
    assert gc.isenabled() and seen == [n < GC_PAUSE_MIN_TENSORS]
    monkeypatch.undo()
    lso = LossScaleOptimizer(SGD(qs, 0.1), "dynamic")
    seen = _gc_seen_during_update(lso, monkeypatch, "_wrapped_step")
    lso.scale_loss(sum(q.sum() for q in qs)).backward()
    lso.step()
    assert gc.isenabled() and seen == [n < GC_PAUSE_MIN_TENSORS]


def test_cyclic_gc_state_is_restored_when_the_update_raises_or_was_disabled(monkeypatch):
    """The collector comes back on when the update raises, and a collector the user disabled stays off."""
    ps = [torch.nn.Parameter(torch.ones(2)) for _ in range(GC_PAUSE_MIN_TENSORS)]
    for p in ps:
        p.grad = torch.ones(2)
    opt = SGD(ps, 0.1)

    def boom(*a, **k):
        assert not gc.isenabled()
        raise RuntimeError("boom")

    monkeypatch.setattr(opt, "_run_group", boom)
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()
    assert gc.isenabled()
    monkeypatch.undo()
    gc.disable()
    try:
        opt.step()
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("key,value", [("variant", "zzz"), ("skip_list", "weight"), ("skip_list", [3]),
                                       ("max_coeff", "zzz"), ("max_coeff", float("nan")),
                                       ("min_coeff", -1.0), ("eeta", float("inf"))])
def test_loaded_hyperparameters_of_options_that_are_off_or_enumerated_are_checked(key, value):
    """An option that is off in the live group (LAMB's ``max_coeff`` None, LARS's ``skip_list`` None) takes
    only None or its own kind from a file, numbers must be finite and in range, and an enumerated string
    (LARS's ``variant``) one of its values: otherwise ``ValueError`` naming the key, nothing changed."""
    import copy

    import optkit

    params = make_params()
    cls = optkit.LARS if key in ("variant", "skip_list", "eeta") else optkit.LAMB
    opt = cls(params, 0.1)
    do_step(opt, params, 0)
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0][key] = value
    before = snapshot(opt, params)
    group_before = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    with pytest.raises(ValueError, match=key):
        opt.load_state_dict(sd)
    assert_same(snapshot(opt, params), before)
    assert {k: v for k, v in opt.param_groups[0].items() if k != "params"} == group_before
    do_step(opt, params, 1)


@pytest.mark.parametrize("where", ["constructor", "add_param_group"])
@pytest.mark.parametrize("key,value,exc", [("lr", float("nan"), ValueError), ("lr", float("inf"), ValueError),
                                           ("lr", -0.1, ValueError), ("lr", "x", TypeError),
                                           ("momentum", -5.0, ValueError), ("weight_decay", -1.0, ValueError),
                                           ("learning_rate", float("nan"), ValueError)])
def test_param_group_hyperparameters_are_checked(where, key, value, exc):
    """A param group's own settings get the constructor's checks (finite, in range, a number), with the key
    named, before anything is built or added: a NaN learning rate in a group used to train to NaN."""
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))
    if where == "constructor":
        with pytest.raises(exc, match=key):
            SGD([{"params": [a], key: value}], learning_rate=0.1, momentum=0.9)
        return
    opt = SGD([a], learning_rate=0.1, momentum=0.9)
    with pytest.raises(exc, match=key):
        opt.add_param_group({"params": [b], key: value})
    assert len(opt.param_groups) == 1 and b not in opt.state


def test_a_tensor_listed_twice_in_a_group_is_refused():
    """``[p, p]`` would update ``p`` twice per step (torch warns that it will become an error)."""
    p, q = torch.nn.Parameter(torch.randn(2)), torch.nn.Parameter(torch.randn(2))
    with pytest.raises(ValueError, match="twice"):
        SGD([p, p], learning_rate=0.1)
    opt = SGD([q], learning_rate=0.1)
    with pytest.raises(ValueError, match="twice"):
        opt.add_param_group({"params": [p, p]})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("kw", ["clipnorm", "global_clipnorm", "clipvalue", "weight_decay", "ema_momentum"])
def test_infinite_options_are_refused(kw):
    """``clipnorm=inf`` used to give NaN weights on the first step (``g·inf/inf``); every numeric option must
    be finite."""
    with pytest.raises(ValueError, match=kw):
        SGD([torch.nn.Parameter(torch.randn(2))], learning_rate=0.1, **{kw: float("inf")})
