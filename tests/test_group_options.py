"""Per-group options and torch.optim interplay of the TF-named optimizers (Adam, AdamW, Adagrad, Momentum,
RMSProp): torch.optim checkpoints load and continue as torch would, per-group ``amsgrad`` / ``centered`` are
honoured, group keys that would be ignored are refused, and ``jit_compile`` keeps 0-d float64 state.

References: ``torch.optim`` (whose rule these optimizers keep, module docs) continuing from the same
checkpoint, and float64 NumPy written from the TF RMSProp formula (``spec/openseq2seq.md`` §3.9)."""

from __future__ import annotations

import copy
import inspect
import warnings

import numpy as np
import pytest
import torch

import optkit

SHAPES = [(4, 3), (5,), ()]


def _params(seed: int, dtype=torch.float64) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in SHAPES]


def _grads(seed: int, k: int, dtype=torch.float64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * seed + k)
    return [torch.randn(s, generator=g, dtype=dtype) for s in SHAPES]


def _run(opt, params, seed, steps, start=0):
    for k in range(start, start + steps):
        for p, g in zip(params, _grads(seed, k)):
            p.grad = g.clone()
        opt.step()


TORCH_CHECKPOINTS = {
    "Adam": (lambda ps: torch.optim.Adam(ps, lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.01,
                                         amsgrad=True),
             lambda ps: optkit.Adam(ps, learning_rate=0.3)),
    "AdamW": (lambda ps: torch.optim.AdamW(ps, lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
              lambda ps: optkit.AdamW(ps, weight_decay=0.5, learning_rate=0.3)),
    "Adagrad": (lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01, eps=1e-8, weight_decay=0.01,
                                               initial_accumulator_value=0.2),
                lambda ps: optkit.Adagrad(ps, learning_rate=0.7)),
    "Momentum": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
                 lambda ps: optkit.Momentum(ps, learning_rate=0.7, momentum=0.5)),
}


@pytest.mark.parametrize("kind", sorted(TORCH_CHECKPOINTS))
def test_a_torch_checkpoint_loads_and_continues_as_torch_does(kind):
    """The module docs promise that torch.optim checkpoints load: torch's group keys (``betas``, ``eps``,
    ``nesterov``) become optkit's, and the next steps match torch continuing from the same checkpoint (they
    raised ``KeyError`` at the first step)."""
    make_torch, make_optkit = TORCH_CHECKPOINTS[kind]
    tp = _params(1)
    topt = make_torch(tp)
    _run(topt, tp, 1, 3)
    sd = copy.deepcopy(topt.state_dict())
    op = [torch.nn.Parameter(p.detach().clone()) for p in tp]
    oopt = make_optkit(op)  # other hyperparameters: the checkpoint's must win
    oopt.load_state_dict(sd)
    _run(topt, tp, 1, 3, start=3)
    _run(oopt, op, 1, 3, start=3)
    for a, b in zip(op, tp):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-12, atol=1e-14)
    assert "betas" not in oopt.param_groups[0] and "foreach" not in oopt.param_groups[0]
    assert int(oopt.iterations) == (3 if kind == "Momentum" else 6)  # torch's SGD keeps no step count


@pytest.mark.parametrize("kind,key,value", [
    ("Adam", "maximize", True), ("Adam", "decoupled_weight_decay", True),
    ("AdamW", "decoupled_weight_decay", False), ("Momentum", "dampening", 0.5), ("Adam", "betas", (0.9,)),
])
def test_a_torch_checkpoint_with_settings_optkit_does_not_compute_is_refused(kind, key, value):
    make_torch, make_optkit = TORCH_CHECKPOINTS[kind]
    tp = _params(2)
    topt = make_torch(tp)
    _run(topt, tp, 2, 1)
    sd = topt.state_dict()
    sd["param_groups"][0][key] = value
    op = [torch.nn.Parameter(p.detach().clone()) for p in tp]
    oopt = make_optkit(op)
    before = copy.deepcopy(oopt.state_dict())
    with pytest.raises(ValueError, match=key):
        oopt.load_state_dict(sd)
    after = oopt.state_dict()
    assert after["param_groups"] == before["param_groups"] and after["state"].keys() == before["state"].keys()


def test_amsgrad_in_a_param_group_is_honoured_as_in_torch():
    """``amsgrad`` is a per-group option of ``torch.optim.Adam``; a group's ``amsgrad=True`` was ignored."""
    tp, op = _params(3), _params(3)
    topt = torch.optim.Adam([{"params": tp[:2], "amsgrad": True}, {"params": tp[2:]}], lr=0.1)
    oopt = optkit.Adam([{"params": op[:2], "amsgrad": True}, {"params": op[2:]}], learning_rate=0.1)
    for k in range(6):  # large then small gradients: the running maximum matters
        for ps in (tp, op):
            for p, g in zip(ps, _grads(3, k)):
                p.grad = g * (10.0 if k == 0 else 0.1)
        topt.step()
        oopt.step()
    for a, b in zip(op, tp):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-12, atol=1e-14)
    assert "max_exp_avg_sq" in oopt.state[op[0]] and "max_exp_avg_sq" not in oopt.state[op[2]]
    assert oopt.get_slot_names() == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]


def _tf_rmsprop(w, grads, lr, rho, mu, eps, centered):
    """float64 TF RMSProp (module doc): ms starts at 1, mom and mg at 0."""
    w = w.copy()
    ms, mom, mg = np.ones_like(w), np.zeros_like(w), np.zeros_like(w)
    for g in grads:
        ms = ms + (1 - rho) * (g * g - ms)
        if centered:
            mg = mg + (1 - rho) * (g - mg)
            denom = np.maximum(ms - mg * mg, 0.0) + eps
        else:
            denom = ms + eps
        mom = mu * mom + lr * g / np.sqrt(denom)
        w = w - mom
    return w


def test_rmsprop_centered_per_param_group():
    """``centered`` set in one param group (it raised ``IndexError``), and turned off in another."""
    ps = _params(4)
    opt = optkit.RMSProp([{"params": ps[:1], "centered": True}, {"params": ps[1:2]},
                          {"params": ps[2:], "centered": False}], learning_rate=0.01, momentum=0.5,
                         epsilon=1e-6, centered=False)
    w0 = [p.detach().numpy().copy() for p in ps]
    grads = [_grads(4, k) for k in range(4)]
    for gs in grads:
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt.step()
    for i, centered in enumerate((True, False, False)):
        ref = _tf_rmsprop(w0[i], [gs[i].numpy() for gs in grads], 0.01, 0.9, 0.5, 1e-6, centered)
        np.testing.assert_allclose(ps[i].detach().numpy(), ref, rtol=1e-12, atol=1e-14)
    assert "mg" in opt.state[ps[0]] and "mg" not in opt.state[ps[1]]


@pytest.mark.parametrize("make,group,match", [
    (lambda g: optkit.Adam(g), {"betas": (0.5, 0.9)}, "'betas' is torch's name"),
    (lambda g: optkit.Adam(g), {"eps": 0.1}, "'eps' is torch's name"),
    (lambda g: optkit.SGD(g), {"clipnorm": 0.1}, "optimizer-wide"),
    (lambda g: optkit.SGD(g), {"use_ema": True}, "optimizer-wide"),
    (lambda g: optkit.LAMB(g), {"global_grad_norm_clip": 1.0}, "optimizer-wide"),
    (lambda g: optkit.Adam(g), {"maximize": True}, "maximize"),
    (lambda g: optkit.LAMB(g), {"betas": (0.9, 0.99)}, "'betas' is torch's name"),
    (lambda g: optkit.RMSProp(g), {"alpha": 0.5}, "'alpha' is torch's name"),
    (lambda g: optkit.RMSProp(g), {"eps": 1e-3}, "'eps' is torch's name"),
    (lambda g: optkit.SGD(g, momentum=0.9), {"dampening": 0.5}, "dampening"),
    (lambda g: optkit.LARS(g, 0.1), {"eps": 0.1}, "'eps' is torch's name"),
])
@pytest.mark.parametrize("where", ["constructor", "add_param_group"])
def test_group_keys_that_would_be_ignored_are_refused(make, group, match, where):
    a, b = _params(5)[:2]
    if where == "constructor":
        with pytest.raises(ValueError, match=match):
            make([{"params": [a], **group}])
        return
    opt = make([a])
    with pytest.raises(ValueError, match=match):
        opt.add_param_group({"params": [b], **group})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("make,key", [(lambda g: optkit.Adam(g), "amsgrad"),
                                      (lambda g: optkit.RMSProp(g), "centered"),
                                      (lambda g: optkit.SGD(g, momentum=0.9), "nesterov")])
def test_boolean_group_options_must_be_bools(make, key):
    with pytest.raises(TypeError, match=key):
        make([{"params": [_params(6)[0]], key: 1}])


@pytest.mark.parametrize("kind", ["Momentum", "Adam"])
def test_jit_compile_updates_0d_float64_state(kind):
    """Inductor drops in-place writes to 0-d float64 CPU inputs (torch 2.13): with ``jit_compile`` such a
    parameter's slots stayed at their initial values. The compiled step must match ``torch.optim``."""
    make = {"Momentum": (lambda ps, jit: optkit.Momentum(ps, 0.1, momentum=0.9, jit_compile=jit),
                         lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
            "Adam": (lambda ps, jit: optkit.Adam(ps, learning_rate=0.01, jit_compile=jit),
                     lambda ps: torch.optim.Adam(ps, lr=0.01))}[kind]
    op, tp = _params(7), _params(7)
    _compiled_matches(make[0](op, True), op, make[1](tp), tp, seed=7, steps=4, rtol=1e-12, atol=1e-14)


def _compiled_matches(jit, jp, ref, rp, *, seed, steps, rtol, atol):
    """``steps`` steps of the ``jit_compile`` optimizer (which must compile: its fallback warning is an
    error) and of the reference on the same gradients; the parameters agree to ``rtol``/``atol``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="jit_compile")
        _run(jit, jp, seed, steps)
    _run(ref, rp, seed, steps)
    assert jit._compile_state == "ok"
    for a, b in zip(jp, rp):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("kind", ["SGD-decay", "Adagrad-lr_decay"])
def test_jit_compile_keeps_float64_hyperparameters(kind):
    """The compiled update forms the decoupled decay and Adagrad's ``lr/(1 + (t-1)·lr_decay)`` in float64
    for float64 parameters (they were float32 tensors: 1e-8 relative errors); it matches the eager step, which
    matches a float64 reference."""
    make = {"SGD-decay": lambda ps, jit: optkit.SGD(ps, 0.1, momentum=0.9, weight_decay=0.1, jit_compile=jit),
            "Adagrad-lr_decay": lambda ps, jit: optkit.Adagrad(ps, 0.1, lr_decay=0.1, jit_compile=jit)}[kind]
    jp, ep = _params(8), _params(8)
    _compiled_matches(make(jp, True), jp, make(ep, False), ep, seed=8, steps=3, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("lr_kind", ["callable", "schedule"])
@pytest.mark.parametrize("wrapped", [False, True])
def test_a_torch_scheduler_over_a_schedule_learning_rate_warns_once(lr_kind, wrapped):
    """With a schedule or callable ``learning_rate`` the optimizer sets the group's lr every step, so a
    torch lr scheduler attached to it (or to a wrapper around it) has no effect: one UserWarning, pointing
    at the caller's ``step()`` line (not into torch or optkit), and the update uses the schedule's value
    (reference: w −= lr·g with lr = 0.1 each step, as before)."""
    from torch.optim.lr_scheduler import StepLR

    w = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    lr = (lambda: 0.1) if lr_kind == "callable" else optkit.build_schedule("fixed_lr", learning_rate=0.1)
    opt = optkit.Momentum([w], learning_rate=lr, momentum=0.0)
    driven = optkit.LossScaleOptimizer(opt, 1.0) if wrapped else opt
    sched = StepLR(driven, 1, gamma=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            w.grad = torch.ones(2, dtype=torch.float64)
            step_line = inspect.currentframe().f_lineno + 1
            driven.step()
            sched.step()
    said = [c for c in caught if "learning_rate is a schedule" in str(c.message)]
    assert len(said) == 1 and "torch lr scheduler" in str(said[0].message)
    assert (said[0].filename, said[0].lineno) == (__file__, step_line)
    torch.testing.assert_close(w.detach(), torch.full((2,), -0.3, dtype=torch.float64))


def test_a_schedule_learning_rate_alone_does_not_warn():
    w = torch.nn.Parameter(torch.zeros(2))
    opt = optkit.Momentum([w], learning_rate=optkit.build_schedule("exp_decay", learning_rate=0.1,
                                                                   decay_steps=1, decay_rate=0.5,
                                                                   use_staircase_decay=False),
                          momentum=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            w.grad = torch.ones(2)
            opt.step()
        opt.load_state_dict(opt.state_dict())
        w.grad = torch.ones(2)
        opt.step()


def test_no_warning_when_the_schedule_itself_changes_the_lr():
    """No false alarm: a callable returning a tensor the user updates in place (TF's variable learning rate),
    a schedule returning one cached tensor, and the ``learning_rate`` setter switching between a number and a
    schedule all set the lr the optimizer uses."""
    w = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    lr_t = torch.tensor(0.1, dtype=torch.float64)
    opt = optkit.Momentum([w], learning_rate=lambda: lr_t, momentum=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in range(3):
            w.grad = torch.ones(2, dtype=torch.float64)
            opt.step()
            lr_t.fill_(0.1 * 0.5 ** (k + 1))
        torch.testing.assert_close(w.detach(), torch.full((2,), -0.175, dtype=torch.float64))
        opt.learning_rate = 0.01
        w.grad = torch.ones(2, dtype=torch.float64)
        opt.step()
        opt.learning_rate = lambda: 0.02
        for _ in range(2):
            w.grad = torch.ones(2, dtype=torch.float64)
            opt.step()
    torch.testing.assert_close(w.detach(), torch.full((2,), -0.225, dtype=torch.float64))


def test_get_slot_of_a_slot_only_other_groups_keep_is_a_value_error():
    a, b = _params(8)[:2]
    opt = optkit.RMSProp([{"params": [a], "centered": True}, {"params": [b]}])
    assert opt.get_slot(a, "mg").shape == a.shape
    with pytest.raises(ValueError, match="keeps no 'mg' slot"):
        opt.get_slot(b, "mg")


def test_an_older_amsgrad_checkpoint_keeps_amsgrad():
    """A group saved before ``amsgrad`` was a group option has no such key: it is on when the saved state
    holds ``max_exp_avg_sq`` (the checkpoint of an ``Adam(amsgrad=True)``), whatever the loading optimizer's
    constructor says; the run continues as the saving one would."""
    p, q, r = _params(9), _params(9), _params(9)
    src = optkit.Adam(p, learning_rate=0.1, amsgrad=True)
    _run(src, p, 9, 3)
    sd = copy.deepcopy(src.state_dict())
    for g in sd["param_groups"]:
        del g["amsgrad"]
    for a, b in zip(q, p):
        a.data.copy_(b.detach())
    dst = optkit.Adam(q, learning_rate=0.1)
    dst.load_state_dict(sd)
    assert dst.param_groups[0]["amsgrad"] is True
    twin = optkit.Adam(r, learning_rate=0.1, amsgrad=True)
    _run(twin, r, 9, 3)
    _run(twin, r, 9, 3, start=3)
    _run(dst, q, 9, 3, start=3)
    for a, b in zip(q, r):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-12, atol=1e-14)


def test_a_loaded_group_holding_an_optimizer_wide_option_is_refused():
    p = _params(10)
    opt = optkit.SGD(p, learning_rate=0.1)
    sd = opt.state_dict()
    sd["param_groups"][0]["clipnorm"] = 1.0
    with pytest.raises(ValueError, match="'clipnorm' is an optimizer-wide option"):
        opt.load_state_dict(sd)
    assert "clipnorm" not in opt.param_groups[0]


def test_a_scheduler_writing_into_a_cached_schedule_tensor_warns():
    """A callable that rewrites one cached tensor each step overwrites a torch scheduler's in-place write:
    that is warned about (the scheduler has no effect), as for a float or fresh-tensor schedule."""
    from torch.optim.lr_scheduler import StepLR

    cache = torch.tensor(0.1)

    def lr():
        cache.fill_(0.1)
        return cache

    w = torch.nn.Parameter(torch.zeros(2))
    opt = optkit.Momentum([w], learning_rate=lr, momentum=0.0)
    sched = StepLR(opt, 1, gamma=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            w.grad = torch.ones(2)
            opt.step()
            sched.step()
    assert sum("learning_rate is a schedule" in str(c.message) for c in caught) == 1


def test_a_torch_rmsprop_checkpoint_is_refused():
    """optkit's RMSProp is TF's rule (ε inside the root, ms from 1): torch.optim.RMSprop's names are not
    translated on load, so even a checkpoint saved before any step (no slots to refuse) is refused."""
    tp = _params(11)
    sd = torch.optim.RMSprop(tp).state_dict()
    opt = optkit.RMSProp(_params(11))
    with pytest.raises(ValueError, match="torch's name"):
        opt.load_state_dict(sd)
    assert "alpha" not in opt.param_groups[0] and "eps" not in opt.param_groups[0]


def test_jit_compile_keeps_compiling_past_torchs_recompile_limit(monkeypatch):
    """Each param group is a graph of its own (its shapes): twelve groups (layer-wise decay of a small
    model) passed torch's limit of 8 graphs per function and fell back to eager; the limit is raised for
    the compiled update's calls. (The ``eager`` backend checks the tracing without a C++ build.)"""
    from optkit._core import chain as _compile

    torch._dynamo.reset()
    monkeypatch.setattr(_compile, "_COMPILED", [_compile._make_compiled("eager")])
    gen = torch.Generator().manual_seed(3)
    shapes = [(i + 1, 2) for i in range(12)]
    jp = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for s in shapes]
    ep = [torch.nn.Parameter(p.detach().clone()) for p in jp]
    jit = optkit.SGD([{"params": [p], "lr": 0.01 * (i + 1)} for i, p in enumerate(jp)], 0.1, momentum=0.9,
                     jit_compile=True)
    eager = optkit.SGD([{"params": [p], "lr": 0.01 * (i + 1)} for i, p in enumerate(ep)], 0.1, momentum=0.9)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="jit_compile")
        for _ in range(2):
            for a, b in zip(jp, ep):
                a.grad = torch.randn(a.shape, generator=gen, dtype=torch.float64)
                b.grad = a.grad.clone()
            jit.step()
            eager.step()
    assert jit._compile_state == "ok"
    for a, b in zip(jp, ep):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-14, atol=1e-15)
