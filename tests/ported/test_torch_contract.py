"""The ``torch.optim.Optimizer`` contract, ported from PyTorch's optimizer suites.

Upstream files (repository ``pytorch/pytorch``): ``test/test_optim.py`` (``TestOptimRenewed``) and
``torch/testing/_internal/common_optimizers.py`` (the shared error inputs and per-optimizer inputs). The
contract checked for every optkit optimizer and wrapper: printing; ``step(closure)`` returning the loss;
no-op steps for parameters without gradients; ``zero_grad``; param groups with their own learning rates and
an ``lr_scheduler`` driving them; tensor learning rates; ``state_dict`` / ``load_state_dict`` continuing
bit-identically (also through ``torch.save(weights_only=True)``, from a checkpoint with a non-tensor ``step``
and after ``deepcopy``/pickle); step hooks (per optimizer and global), state-dict hooks; named parameters;
non-contiguous parameters (``torch.randn(10, 5, 2)[..., 0]``) and gradients whose strides differ from the
parameter's; mixed float32/float64 parameters; ``add_param_group``; the common error inputs. Complex
parameters are refused with ``TypeError``; torch's ``maximize`` has no optkit counterpart.

optkit-specific points, each from ``docs/compatibility.md``: ``LossScaleOptimizer`` and
``MixedPrecisionOptimizerWrapper`` take a closure that returns the unscaled loss without calling
``backward`` (row "wrappers: LossScaleOptimizer.step(closure)"); wrapper checkpoints are ``{"optimizer",
"wrapper"}`` (row "wrappers: checkpoints").
"""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import optkit

F32, F64 = torch.float32, torch.float64


@dataclass
class Case:
    name: str
    make: Callable  # make(params) -> optimizer; params: a list of tensors, (name, tensor) pairs or groups
    wrapper: bool = False
    backward_in_closure: bool = True  # False: the closure returns the unscaled loss, the wrapper back-props
    tags: set = field(default_factory=set)


def _first_tensor(params):
    item = params[0]
    if isinstance(item, dict):
        ps = item["params"]
        item = ps if isinstance(ps, torch.Tensor) else list(ps)[0]
    return item[1] if isinstance(item, tuple) else item


BASE = [
    Case("SGD", lambda ps: optkit.SGD(ps, learning_rate=0.01)),
    Case("SGD_momentum", lambda ps: optkit.SGD(ps, learning_rate=0.01, momentum=0.9)),
    Case("SGD_nesterov_wd_ema", lambda ps: optkit.SGD(ps, learning_rate=0.01, momentum=0.9, nesterov=True,
                                                      weight_decay=0.01, use_ema=True)),
    Case("Momentum", lambda ps: optkit.Momentum(ps, learning_rate=0.01, momentum=0.9)),
    Case("Adam", lambda ps: optkit.Adam(ps, learning_rate=0.01)),
    Case("AdamW", lambda ps: optkit.AdamW(ps, 0.01, weight_decay=0.01)),
    Case("Adagrad", lambda ps: optkit.Adagrad(ps, learning_rate=0.1)),
    Case("RMSProp", lambda ps: optkit.RMSProp(ps, learning_rate=0.01, momentum=0.5, centered=True)),
    Case("Ftrl", lambda ps: optkit.Ftrl(ps, learning_rate=0.1, l1_regularization_strength=0.01)),
    Case("LARS", lambda ps: optkit.LARS(ps, learning_rate=0.1)),
    Case("LARS_tf1.14_nesterov", lambda ps: optkit.LARS(ps, learning_rate=0.1, variant="tf1.14",
                                                       use_nesterov=True)),
]
WRAPPERS = [
    Case("LARC(SGD)", lambda ps: optkit.LARC(optkit.SGD(ps, learning_rate=0.01, momentum=0.9), larc_eta=0.01),
         wrapper=True),
    Case("VariableClipping(SGD)", lambda ps: optkit.VariableClippingOptimizer(
        optkit.SGD(ps, learning_rate=0.01, momentum=0.9), {_first_tensor(ps): [0]}, 1.0), wrapper=True),
    Case("LossScale(SGD)", lambda ps: optkit.LossScaleOptimizer(
        optkit.SGD(ps, learning_rate=0.01, momentum=0.9), optkit.DynamicLossScale(initial_loss_scale=8.0)),
        wrapper=True, backward_in_closure=False),
    Case("MixedPrecision(SGD)", lambda ps: optkit.MixedPrecisionOptimizerWrapper(
        optkit.SGD(ps, learning_rate=0.01, momentum=0.9), "dynamic"), wrapper=True,
        backward_in_closure=False),
]
ALL = BASE + WRAPPERS
UNCLIPPED = [c for c in ALL if c.name != "VariableClipping(SGD)"]  # its clip table names one parameter


def ids(cases):
    return [c.name for c in cases]


def cases_of(cases):
    return [pytest.param(c, id=c.name) for c in cases]


# ------------------------------------------------------------------------------------------------------------
# a small least-squares problem


def make_problem(seed=0, dtype=F32, weight=None, bias=None):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(10, 5, generator=g, dtype=dtype) if weight is None else weight
    b = torch.randn(10, generator=g, dtype=dtype) if bias is None else bias
    x = torch.randn(5, generator=g, dtype=dtype)
    return torch.nn.Parameter(w), torch.nn.Parameter(b), x


def loss_of(w, b, x):
    return (w.mv(x) + b).pow(2).sum()


def closure_for(case, opt, w, b, x):
    def closure():
        opt.zero_grad()
        loss = loss_of(w, b, x)
        if case.backward_in_closure:
            loss.backward()
        return loss
    return closure


def set_grads(case, opt, w, b, x):
    """One gradient evaluation the way each optimizer expects it (``.grad`` carries the loss scale for the
    loss-scaling wrappers)."""
    opt.zero_grad()
    loss = loss_of(w, b, x)
    if not case.backward_in_closure:
        loss = opt.scale_loss(loss)
    loss.backward()


def run(case, opt, w, b, x, steps):
    for _ in range(steps):
        set_grads(case, opt, w, b, x)
        opt.step()


def assert_same(a, b):
    """Exact structural equality (tensors by value, including dtype)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (a.keys(), b.keys())
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b, (a, b)


# ------------------------------------------------------------------------------------------------------------
# basic behaviour


@pytest.mark.parametrize("case", ALL, ids=ids(ALL))
def test_optimizer_can_be_printed(case):
    """test_optim.py: test_optimizer_can_be_printed."""
    w, b, _ = make_problem()
    assert repr(case.make([w, b]))


@pytest.mark.parametrize("case", ALL, ids=ids(ALL))
def test_step_with_closure_returns_loss_and_goes_right_direction(case):
    """test_optim.py: test_forloop_goes_right_direction (closure steps lower the loss; step returns the
    closure's value)."""
    w, b, x = make_problem(1)
    opt = case.make([w, b])
    closure = closure_for(case, opt, w, b, x)
    first = closure().item()
    for _ in range(20):
        out = opt.step(closure)
        assert isinstance(out, torch.Tensor) and out.dim() == 0
    assert loss_of(w, b, x).item() < first


@pytest.mark.parametrize("case", ALL, ids=ids(ALL))
def test_step_is_noop_when_params_have_no_grad(case):
    """test_optim.py: test_step_is_noop_when_params_have_no_grad (three steps without gradients change no
    parameter)."""
    w, b, _ = make_problem(2)
    before = (w.detach().clone(), b.detach().clone())
    opt = case.make([w, b])
    for _ in range(3):
        opt.step()
    assert torch.equal(w.detach(), before[0]) and torch.equal(b.detach(), before[1])


@pytest.mark.parametrize("case", ALL, ids=ids(ALL))
def test_params_without_grad_are_left_alone(case):
    """test_optim.py: a parameter of the group whose gradient is None is not touched while the others
    update (torch's "step only the params with grads")."""
    w, b, x = make_problem(3)
    frozen = torch.nn.Parameter(torch.randn(3))
    before = frozen.detach().clone()
    opt = case.make([w, b, frozen])
    run(case, opt, w, b, x, 3)
    assert frozen.grad is None and torch.equal(frozen.detach(), before)


@pytest.mark.parametrize("case", ALL, ids=ids(ALL))
def test_zero_grad(case):
    """test_optim.py: test_zero_grad (set_to_none=True is the default; False zeroes in place)."""
    w, b, x = make_problem(4)
    opt = case.make([w, b])
    set_grads(case, opt, w, b, x)
    opt.zero_grad(set_to_none=False)
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))
    opt.zero_grad()
    assert w.grad is None and b.grad is None


def _separable(seed):
    """Two parameters with independent losses, so that each can also be trained alone."""
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(10, 5, generator=g))
    b = torch.nn.Parameter(torch.randn(10, generator=g))
    xw, xb = torch.randn(10, 5, generator=g), torch.randn(10, generator=g)
    return w, b, lambda: (w * xw).pow(2).sum() + (b * xb).pow(2).sum()


def _train(case, opt, loss_fn, steps):
    for _ in range(steps):
        opt.zero_grad()
        value = loss_fn()
        if not case.backward_in_closure:
            value = opt.scale_loss(value)
        value.backward()
        opt.step()


@pytest.mark.parametrize("case", UNCLIPPED, ids=ids(UNCLIPPED))
def test_param_groups_with_their_own_lr(case):
    """test_optim.py / common_optimizers.py: param groups with their own ``lr`` (the bias group 10× the
    weight group) update each group with its own rate: the same as two single-group optimizers (separable
    loss)."""
    w, b, loss_fn = _separable(5)
    opt = case.make([{"params": [w], "lr": 1e-3}, {"params": [b], "lr": 1e-2}])
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 1e-2]
    _train(case, opt, loss_fn, 4)
    w1, b1, loss1 = _separable(5)
    _train(case, case.make([{"params": [w1], "lr": 1e-3}]), loss1, 4)
    w2, b2, loss2 = _separable(5)
    _train(case, case.make([{"params": [b2], "lr": 1e-2}]), loss2, 4)
    torch.testing.assert_close(w.detach(), w1.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.detach(), b2.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ALL, ids=ids(ALL))
def test_lr_scheduler_drives_the_group_lr(case):
    """test_optim.py: test_param_group_with_lrscheduler_goes_right_direction (a torch LR scheduler edits the
    group's ``lr`` and the next step uses it): StepLR(gamma=0.5) gives the same trajectory as halving
    ``param_groups[i]['lr']`` by hand, and a different one from a constant rate."""
    def trajectory(mode):
        w, b, loss_fn = _separable(6)
        opt = case.make([w, b])
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if mode == "scheduler" else None
        base = [grp["lr"] for grp in opt.param_groups]
        for k in range(3):
            if mode == "manual":
                for grp, lr0 in zip(opt.param_groups, base):
                    grp["lr"] = lr0 * 0.5**k
            _train(case, opt, loss_fn, 1)
            if sched is not None:
                sched.step()
        return w.detach(), b.detach()

    sched_w, sched_b = trajectory("scheduler")
    man_w, man_b = trajectory("manual")
    const_w, _ = trajectory("constant")
    torch.testing.assert_close(sched_w, man_w, rtol=0, atol=0)
    torch.testing.assert_close(sched_b, man_b, rtol=0, atol=0)
    assert not torch.equal(sched_w, const_w)


# ------------------------------------------------------------------------------------------------------------
# tensor learning rate


def _tensor_lr_cases():
    return cases_of(BASE)


KWARG_LR = {
    "SGD": lambda ps, lr: optkit.SGD(ps, learning_rate=lr),
    "SGD_momentum": lambda ps, lr: optkit.SGD(ps, learning_rate=lr, momentum=0.9),
    "SGD_nesterov_wd_ema": lambda ps, lr: optkit.SGD(ps, learning_rate=lr, momentum=0.9, nesterov=True,
                                                     weight_decay=0.01, use_ema=True),
    "Momentum": lambda ps, lr: optkit.Momentum(ps, learning_rate=lr, momentum=0.9),
    "Adam": lambda ps, lr: optkit.Adam(ps, learning_rate=lr),
    "AdamW": lambda ps, lr: optkit.AdamW(ps, lr, weight_decay=0.01),
    "Adagrad": lambda ps, lr: optkit.Adagrad(ps, learning_rate=lr),
    "RMSProp": lambda ps, lr: optkit.RMSProp(ps, learning_rate=lr, momentum=0.5, centered=True),
    "Ftrl": lambda ps, lr: optkit.Ftrl(ps, learning_rate=lr, l1_regularization_strength=0.01),
    "LARS": lambda ps, lr: optkit.LARS(ps, learning_rate=lr),
    "LARS_tf1.14_nesterov": lambda ps, lr: optkit.LARS(ps, learning_rate=lr, variant="tf1.14",
                                                       use_nesterov=True),
}


@pytest.mark.parametrize("case", _tensor_lr_cases())
def test_tensor_lr(case):
    """test_optim.py: test_tensor_lr (a 0-d tensor learning rate gives the same trajectory as the float)."""
    w, b, x = make_problem(7)
    w2, b2 = torch.nn.Parameter(w.detach().clone()), torch.nn.Parameter(b.detach().clone())
    ref = KWARG_LR[case.name]([w, b], 0.05)
    opt = KWARG_LR[case.name]([w2, b2], torch.tensor(0.05))
    run(case, ref, w, b, x, 4)
    run(case, opt, w2, b2, x, 4)
    # torch's own test uses assertEqual's float32 defaults: a tensor lr may take another (equally exact)
    # kernel path than a Python float (optkit's SGD folds a float lr into the kernel's dampening)
    torch.testing.assert_close(w2.detach(), w.detach(), rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(b2.detach(), b.detach(), rtol=1.3e-6, atol=1e-5)


# ------------------------------------------------------------------------------------------------------------
# state dicts


def _continuation(case, transform):
    """test_optim.py: test_state_dict_deterministic / _test_state_dict (prime, rebuild over clones, load
    the transformed state dict, then parallel steps must agree exactly)."""
    w, b, x = make_problem(8)
    opt = case.make([w, b])
    run(case, opt, w, b, x, 5)
    w2, b2 = torch.nn.Parameter(w.detach().clone()), torch.nn.Parameter(b.detach().clone())
    opt2 = case.make([w2, b2])
    opt2.load_state_dict(transform(opt.state_dict()))
    for _ in range(5):
        run(case, opt, w, b, x, 1)
        run(case, opt2, w2, b2, x, 1)
        assert torch.equal(w.detach(), w2.detach()) and torch.equal(b.detach(), b2.detach())
    assert_same(opt.state_dict(), opt2.state_dict())
    return opt, opt2


@pytest.mark.parametrize("case", ALL, ids=ids(ALL))
def test_state_dict_round_trip_continues_identically(case):
    """test_optim.py: test_state_dict_deterministic and the load-into-a-fresh-optimizer part of
    _test_state_dict (a deep copy of the dict is loaded, as upstream)."""
    saved = {}

    def transform(sd):
        saved["copy"] = copy.deepcopy(sd)
        return copy.deepcopy(sd)

    opt, _ = _continuation(case, transform)
    assert set(opt.state_dict()) == ({"optimizer", "wrapper"} if case.wrapper else {"state", "param_groups"})


@pytest.mark.parametrize("case", ALL, ids=ids(ALL))
def test_save_load_with_weights_only(case):
    """test_optim.py: test_save_load_equality_with_weights_only (torch.save, then
    torch.load(weights_only=True), continues identically)."""
    def transform(sd):
        buf = io.BytesIO()
        torch.save(sd, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=True)

    _continuation(case, transform)


def _steps_to_python(sd):
    sd = copy.deepcopy(sd)
    for st in sd["state"].values():
        if isinstance(st.get("step"), torch.Tensor):
            st["step"] = int(st["step"].item()) if not st["step"].is_floating_point() else st["step"].item()
    return sd


@pytest.mark.parametrize("case", cases_of([c for c in BASE if c.name != "Momentum"]))
def test_load_nontensor_step(case):
    """test_optim.py: test_load_nontensor_step (older checkpoints hold ``step`` as a Python number; loading
    one continues identically)."""
    _continuation(case, _steps_to_python)


@pytest.mark.parametrize("case", ALL, ids=ids(ALL))
def test_deepcopy_and_pickle(case):
    """test_optim.py: test_deepcopy_copies_all_public_attrs (and a pickle round trip keeps the state)."""
    w, b, x = make_problem(9)
    opt = case.make([w, b])
    run(case, opt, w, b, x, 2)

    def public(o):
        return {k for k in o.__dict__ if not k.startswith("_")}

    clone = copy.deepcopy(opt)
    assert public(opt) == public(clone)
    assert_same(opt.state_dict(), clone.state_dict())
    again = pickle.loads(pickle.dumps(opt))
    assert_same(opt.state_dict(), again.state_dict())


@pytest.mark.parametrize("case", cases_of(ALL))
def test_unnamed_checkpoint_keeps_param_names(case):
    """test_optim.py named-parameter tests: names are saved in ``param_groups[i]['param_names']``; loading a
    checkpoint taken from an optimizer over unnamed parameters keeps the loading optimizer's names (torch)."""
    w, b, x = make_problem(10)
    named = case.make([("layer.weight", w), ("layer.bias", b)])
    inner = named
    while hasattr(inner, "optimizer"):
        inner = inner.optimizer
    assert inner.state_dict()["param_groups"][0]["param_names"] == ["layer.weight", "layer.bias"]
    w2, b2, _ = make_problem(10)
    unnamed = case.make([w2, b2])
    run(case, unnamed, w2, b2, x, 1)
    named.load_state_dict(unnamed.state_dict())
    assert inner.param_groups[0]["param_names"] == ["layer.weight", "layer.bias"]


def test_unnamed_checkpoint_keeps_name_based_weight_decay_exclusion():
    """The consequence of the previous test for Keras-style ``exclude_from_weight_decay(var_names=...)``:
    after loading, the bias must still be excluded from the decay (zero gradient, lr 0.1, wd 0.5)."""
    w, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = optkit.SGD([("layer.weight", w), ("layer.bias", b)], learning_rate=0.1, weight_decay=0.5)
    opt.exclude_from_weight_decay(var_names=["bias"])
    opt.load_state_dict(optkit.SGD([torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))],
                                   learning_rate=0.1, weight_decay=0.5).state_dict())
    w.grad, b.grad = torch.zeros(2), torch.zeros(2)
    opt.step()
    assert torch.equal(b.detach(), torch.ones(2)) and torch.allclose(w.detach(), torch.full((2,), 0.95))


# ------------------------------------------------------------------------------------------------------------
# hooks


@pytest.mark.parametrize("case", ALL, ids=ids(ALL))
def test_step_pre_and_post_hooks(case):
    """test_optim.py: test_step_pre_hook / test_step_post_hook / test_step_all_hooks (each hook runs once per
    step, pre before post; a removed hook no longer runs)."""
    w, b, x = make_problem(11)
    opt = case.make([w, b])
    calls = []
    h1 = opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    h2 = opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    run(case, opt, w, b, x, 2)
    assert calls == ["pre", "post", "pre", "post"]
    h1.remove()
    h2.remove()
    run(case, opt, w, b, x, 1)
    assert len(calls) == 4


@pytest.mark.parametrize("case", cases_of(ALL))
def test_global_step_hooks_fire_once_per_step(case):
    """test_optim.py: test_step_all_hooks (global pre/post hooks from register_optimizer_step_pre_hook /
    _post_hook run once per user ``step()``, around the per-optimizer hooks)."""
    w, b, x = make_problem(12)
    opt = case.make([w, b])
    calls = []
    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: calls.append("global_pre")),
        register_optimizer_step_post_hook(lambda o, a, k: calls.append("global_post")),
    ]
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    try:
        run(case, opt, w, b, x, 1)
    finally:
        for h in handles:
            h.remove()
    assert calls == ["global_pre", "pre", "post", "global_post"]


@pytest.mark.parametrize("case", cases_of(ALL))
def test_state_dict_hooks(case):
    """test_optim.py: test_state_dict_pre_hook / test_state_dict_post_hook / test_load_state_dict_pre_hook /
    test_load_state_dict_post_hook (each runs once; a post hook may return a modified dict)."""
    w, b, x = make_problem(13)
    opt = case.make([w, b])
    run(case, opt, w, b, x, 1)
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("sd_pre"))

    def post(o, sd):
        calls.append("sd_post")
        sd["extra"] = 1
        return sd

    opt.register_state_dict_post_hook(post)
    sd = opt.state_dict()
    assert sd.get("extra") == 1
    del sd["extra"]
    opt.register_load_state_dict_pre_hook(lambda o, s: calls.append("load_pre"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))
    opt.load_state_dict(sd)
    assert calls == ["sd_pre", "sd_post", "load_pre", "load_post"]


# ------------------------------------------------------------------------------------------------------------
# tensors: non-contiguous, strides, dtypes, complex


def _pair_runs(case, w_src, b_src, x, grad_layout=None, steps=3):
    """The same trajectory from equal values held in (possibly non-contiguous) parameters, against
    contiguous clones."""
    w, b = torch.nn.Parameter(w_src), torch.nn.Parameter(b_src)
    wc = torch.nn.Parameter(w_src.detach().clone(memory_format=torch.contiguous_format))
    bc = torch.nn.Parameter(b_src.detach().clone(memory_format=torch.contiguous_format))
    opt, ref = case.make([w, b]), case.make([wc, bc])
    for _ in range(steps):
        for o, ww, bb in ((opt, w, b), (ref, wc, bc)):
            set_grads(case, o, ww, bb, x)
        if grad_layout is not None:
            w.grad = grad_layout(w.grad)
        opt.step()
        ref.step()
    torch.testing.assert_close(w.detach(), wc.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.detach(), bc.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", cases_of(ALL))
def test_non_contiguous_params(case):
    """test_optim.py / timm _test_basic_cases: parameters ``torch.randn(10, 5, 2)[..., 0]`` and
    ``torch.randn(10, 2)[..., 0]`` follow the same trajectory as contiguous copies."""
    g = torch.Generator().manual_seed(14)
    w_src = torch.randn(10, 5, 2, generator=g)[..., 0]
    b_src = torch.randn(10, 2, generator=g)[..., 0]
    assert not w_src.is_contiguous()
    _pair_runs(case, w_src, b_src, torch.randn(5, generator=g))


def _transposed_layout(grad):
    """The same values, column-major (strides differ from the parameter's)."""
    return grad.t().contiguous().t()


@pytest.mark.parametrize("case", cases_of(ALL))
def test_gradient_with_different_strides(case):
    """test_optim.py (grads need not share the parameter's layout): a column-major gradient for a row-major
    parameter gives the same update as the contiguous gradient."""
    g = torch.Generator().manual_seed(15)
    _pair_runs(case, torch.randn(10, 5, generator=g), torch.randn(10, generator=g),
               torch.randn(5, generator=g), grad_layout=_transposed_layout)


@pytest.mark.parametrize("case", UNCLIPPED, ids=ids(UNCLIPPED))
def test_mixed_float32_float64_params(case):
    """common_optimizers.py mixed-dtype inputs: a float32 and a float64 parameter in one optimizer each
    follow the trajectory they have alone (the clipping wrapper is left out: its clip couples nothing but
    is built around the first parameter only)."""
    g = torch.Generator().manual_seed(16)
    a0, c0 = torch.randn(4, 3, generator=g), torch.randn(6, generator=g, dtype=F64)
    xa, xc = torch.randn(4, 3, generator=g), torch.randn(6, generator=g, dtype=F64)

    def loss(a, c):
        return (a * xa).pow(2).sum() + (c * xc).pow(2).sum()

    def steps(opt, params):
        for _ in range(3):
            opt.zero_grad()
            value = loss(*params)
            if not case.backward_in_closure:
                value = opt.scale_loss(value)
            value.backward()
            opt.step()

    a, c = torch.nn.Parameter(a0.clone()), torch.nn.Parameter(c0.clone())
    steps(case.make([a, c]), (a, c))
    a1, c1 = torch.nn.Parameter(a0.clone()), torch.nn.Parameter(c0.clone())
    steps(case.make([a1]), (a1, c1.detach()))
    steps(case.make([c1]), (a1.detach(), c1))
    torch.testing.assert_close(a.detach(), a1.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c.detach(), c1.detach(), rtol=1e-12, atol=1e-12)


def _complex_refused_cases():
    return cases_of(BASE)


@pytest.mark.parametrize("case", _complex_refused_cases())
def test_complex_params_are_refused(case):
    """test_optim.py: test_complex (torch optimizers support complex parameters); optkit refuses them with
    TypeError at construction or at the first step."""
    w = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))
    with pytest.raises(TypeError):
        opt = case.make([w])
        w.grad = torch.randn(3, dtype=torch.complex64)
        opt.step()


# ------------------------------------------------------------------------------------------------------------
# param groups and error inputs


@pytest.mark.parametrize("case", ALL, ids=ids(ALL))
def test_add_param_group(case):
    """test_optim.py: add_param_group (the new group's parameters get updated, with the group's lr)."""
    w, b, x = make_problem(17)
    opt = case.make([w])
    opt.add_param_group({"params": [b], "lr": 0.005})
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == 0.005
    before = b.detach().clone()
    run(case, opt, w, b, x, 2)
    assert not torch.equal(b.detach(), before)


@pytest.mark.parametrize("case", BASE, ids=ids(BASE))
def test_common_error_inputs(case):
    """common_optimizers.py get_error_inputs_for_all_optims: a bare tensor as params is a TypeError;
    duplicates across groups and an empty parameter list are ValueErrors. Duplicates inside a group: torch
    warns that this "will cause an error" in future, and steps such a parameter twice; optkit raises the
    ValueError now (deliberately stricter: a double update is a silent wrong number)."""
    p, q = torch.nn.Parameter(torch.randn(1, 1)), torch.nn.Parameter(torch.randn(1, 1))
    with pytest.raises(TypeError):
        case.make(p)
    with pytest.raises(ValueError, match="appears twice"):
        case.make([p, p])
    with pytest.raises(ValueError, match="more than one parameter group"):
        case.make([{"params": [p]}, {"params": [q, p]}])
    with pytest.raises(ValueError, match="empty"):
        case.make([])


@pytest.mark.parametrize("case", cases_of(BASE))
def test_named_and_unnamed_params_cannot_be_mixed(case):
    """common_optimizers.py: "all optimizer params should be with/without names" (within a group and across
    groups)."""
    p, q = torch.nn.Parameter(torch.randn(1, 1)), torch.nn.Parameter(torch.randn(1, 1))
    with pytest.raises(ValueError, match="with/without names"):
        case.make([("weight", p), q])
    with pytest.raises(ValueError, match="with/without names"):
        case.make([{"params": [p], "lr": 1e-2}, {"params": [("weight", q)]}])


def test_tensor_lr_must_have_one_element():
    """common_optimizers.py: "Tensor lr must be 1-element" (ValueError)."""
    with pytest.raises(ValueError):
        optkit.SGD([torch.nn.Parameter(torch.randn(1))], learning_rate=torch.tensor([0.001, 0.001]))


# ------------------------------------------------------------------------------------------------------------
# the TF surface promised for every optkit optimizer

TF_SURFACE = ["compute_gradients", "apply_gradients", "minimize", "get_slot", "get_slot_names", "variables",
              "get_config", "iterations"]


@pytest.mark.parametrize("case", cases_of(BASE))
def test_tf_surface(case):
    """optkit's API: every optimizer is a torch.optim.Optimizer and also has compute_gradients,
    apply_gradients, minimize, get_slot(_names), variables, get_config/from_config and iterations; one
    ``minimize`` of the least-squares loss counts one iteration."""
    w, b, x = make_problem(18)
    opt = case.make([w, b])
    assert isinstance(opt, torch.optim.Optimizer)
    missing = [m for m in TF_SURFACE if not hasattr(opt, m)] + ([] if hasattr(type(opt), "from_config")
                                                                 else ["from_config"])
    assert not missing, missing
    opt.minimize(lambda: loss_of(w, b, x))
    assert int(opt.iterations) == 1
    for s in opt.get_slot_names():
        assert opt.get_slot(w, s).shape == w.shape


@pytest.mark.parametrize("case", WRAPPERS, ids=ids(WRAPPERS))
def test_wrapper_tf_surface(case):
    """The wrappers proxy the TF surface of their (optkit) inner optimizer: apply_gradients of a finite
    gradient counts one iteration; get_slot reaches the inner slots."""
    w, b, x = make_problem(19)
    opt = case.make([w, b])
    pairs = opt.compute_gradients(lambda: loss_of(w, b, x))
    opt.apply_gradients(pairs)
    assert int(opt.iterations) == 1
    assert opt.get_slot_names() == ["momentum"]
    target = opt.master_params[0] if hasattr(opt, "master_params") and opt.master_params else w
    assert opt.get_slot(target, "momentum").shape == w.shape


def test_closure_contract_of_loss_scaling_wrappers():
    """compatibility.md, row "wrappers: LossScaleOptimizer.step(closure)": the closure returns the unscaled
    loss and does not call backward; the wrapper back-propagates loss·S and returns the unscaled loss. The
    result equals a plain SGD step."""
    w, b, x = make_problem(20)
    w2, b2 = torch.nn.Parameter(w.detach().clone()), torch.nn.Parameter(b.detach().clone())
    opt = optkit.LossScaleOptimizer(optkit.SGD([w, b], learning_rate=0.01), optkit.DynamicLossScale(1024.0))
    ref = optkit.SGD([w2, b2], learning_rate=0.01)

    def closure():
        opt.zero_grad()
        return loss_of(w, b, x)

    loss = opt.step(closure)
    np.testing.assert_allclose(loss.item(), loss_of(w2, b2, x).item(), rtol=1e-6)
    loss_of(w2, b2, x).backward()
    ref.step()
    torch.testing.assert_close(w.detach(), w2.detach(), rtol=1e-5, atol=1e-6)
