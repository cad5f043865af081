"""The constructor signatures a torch.optim / timm user meets (issue 30, items 1 and 2).

Every optimizer takes ``params`` and then the learning rate positionally, everything else keyword-only;
``lr=`` (torch, timm) is an alias of ``learning_rate`` and ``use_nesterov=`` (TF1) of ``nesterov``, in
every constructor that has the option; AdamW's decay defaults to torch's. A keyword of torch, timm, apex or
Keras that optkit spells otherwise is refused before anything is built, naming it and the optkit spelling
(``optkit._arguments.HINTS``). References: ``torch.optim`` (the same rule and arguments), and the
uninterrupted run for resumed state.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

import optkit
from optkit import OPTIMIZER_CLS_NAMES
from optkit._arguments import ALIASES, HINTS

NAMES = list(OPTIMIZER_CLS_NAMES)
REQUIRED = {"Momentum": {"momentum": 0.9}}  # keyword-only and required, as in TF


def _params(seed: int = 0, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, generator=g, dtype=dtype).requires_grad_(),
            torch.randn(3, generator=g, dtype=dtype).requires_grad_()]


def _grads(seed: int, like: list[torch.Tensor], steps: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g, dtype=p.dtype) for p in like] for _ in range(steps)]


def _run(opt: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> None:
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()


# ------------------------------------------------------------------------------------------------ item 1


@pytest.mark.parametrize("name", NAMES)
def test_params_then_the_learning_rate_then_keywords_only(name):
    """torch.optim's order: ``params``, the learning rate, then keywords (no optimizer-specific option can
    be given positionally, so TF's orders cannot silently misassign)."""
    ps = list(inspect.signature(OPTIMIZER_CLS_NAMES[name]).parameters.values())
    assert [p.name for p in ps[:2]] == ["params", "learning_rate"]
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in ps[:2])
    assert all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in ps[2:]), [p.name for p in ps[2:]]


@pytest.mark.parametrize("name", NAMES)
def test_second_positional_is_the_learning_rate_and_a_third_is_refused(name):
    cls = OPTIMIZER_CLS_NAMES[name]
    opt = cls(_params(), 3e-4, **REQUIRED.get(name, {}))
    assert opt.param_groups[0]["lr"] == 3e-4 and opt.get_config()["learning_rate"] == 3e-4
    ps = _params()
    before = [p.detach().clone() for p in ps]
    with pytest.raises(TypeError, match="positional"):
        cls(ps, 3e-4, 0.9, **REQUIRED.get(name, {}))
    assert all(torch.equal(p, b) for p, b in zip(ps, before))


def test_adamw_positional_learning_rate_and_default_decay_are_torchs():
    """``AdamW(params, 3e-4)`` trains as ``torch.optim.AdamW(params, 3e-4)``: lr 3e-4 and torch's default
    decay 0.01 (it used to mean weight_decay=3e-4 with lr 0.001, TF Addons' order)."""
    ours, ref = _params(1), _params(1)
    grads = _grads(2, ours, 5)
    _run(optkit.AdamW(ours, 3e-4), ours, grads)
    _run(torch.optim.AdamW(ref, 3e-4), ref, grads)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
    ours_wd = optkit.AdamW(_params(), 3e-4).defaults["weight_decay"]
    assert ours_wd == torch.optim.AdamW(_params(), 3e-4).defaults["weight_decay"] == 0.01


@pytest.mark.parametrize("name", NAMES)
def test_get_config_round_trips_with_keyword_only_options(name):
    cls = OPTIMIZER_CLS_NAMES[name]
    opt = cls(_params(), 0.05, **REQUIRED.get(name, {}), clipnorm=0.5, use_ema=True, ema_momentum=0.9)
    cfg = opt.get_config()
    assert cls.from_config(cfg, _params()).get_config() == cfg


def test_create_optimizer_and_get_optimizer_keep_working():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1)).double()
    opt = optkit.create_optimizer(model, "AdamW", lr=1e-3, weight_decay=0.05)
    assert isinstance(opt, optkit.AdamW) and {g["lr"] for g in opt.param_groups} == {1e-3}
    assert {g["weight_decay"] for g in opt.param_groups} == {0.05, 0.0}  # biases: no decay
    built = optkit.get_optimizer("adamw")(model.parameters(), learning_rate=2e-3)
    assert isinstance(built, optkit.AdamW) and built.param_groups[0]["lr"] == 2e-3


# -------------------------------------------------------------------------------------------- item 2: aliases


@pytest.mark.parametrize("name", NAMES)
def test_lr_is_an_alias_of_learning_rate_in_every_optimizer(name):
    cls, extra = OPTIMIZER_CLS_NAMES[name], REQUIRED.get(name, {})
    a, b = _params(3), _params(3)
    grads = _grads(4, a, 3)
    oa, ob = cls(a, lr=0.05, **extra), cls(b, learning_rate=0.05, **extra)
    assert oa.get_config() == ob.get_config()
    _run(oa, a, grads)
    _run(ob, b, grads)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_lr_keyword_trains_as_torch():
    """``Momentum(params, lr=..., momentum=...)`` (learning rate required, as in TF) is torch's SGD."""
    ours, ref = _params(5), _params(5)
    grads = _grads(6, ours, 4)
    _run(optkit.Momentum(ours, lr=0.1, momentum=0.9), ours, grads)
    _run(torch.optim.SGD(ref, lr=0.1, momentum=0.9), ref, grads)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("how", ["positional", "keyword"])
def test_lr_with_learning_rate_is_refused(name, how):
    ps = _params()
    before = [p.detach().clone() for p in ps]
    args = (ps, 0.1) if how == "positional" else (ps,)
    kw = {} if how == "positional" else {"learning_rate": 0.1}
    with pytest.raises(TypeError, match="both `lr` and `learning_rate`"):
        OPTIMIZER_CLS_NAMES[name](*args, lr=0.2, **kw, **REQUIRED.get(name, {}))
    assert all(torch.equal(p, b) for p, b in zip(ps, before))


@pytest.mark.parametrize("name", ["Momentum", "LARS"])
def test_a_required_learning_rate_missing_names_both_spellings(name):
    with pytest.raises(TypeError, match=r"`learning_rate` \(or torch's `lr`\)"):
        OPTIMIZER_CLS_NAMES[name](_params(), **REQUIRED.get(name, {}))


NESTEROV = {
    "SGD": lambda ps, **kw: optkit.SGD(ps, 0.1, momentum=0.9, **kw),
    "Momentum": lambda ps, **kw: optkit.Momentum(ps, 0.1, momentum=0.9, **kw),
    "LARS": lambda ps, **kw: optkit.LARS(ps, 0.1, momentum=0.9, **kw),
}


@pytest.mark.parametrize("name", sorted(NESTEROV))
def test_use_nesterov_is_an_alias_of_nesterov(name):
    a, b, c = _params(7), _params(7), _params(7)
    grads = _grads(8, a, 3)
    oa, ob, oc = NESTEROV[name](a, use_nesterov=True), NESTEROV[name](b, nesterov=True), NESTEROV[name](c)
    assert oa.get_config() == ob.get_config() and oa.get_config()["nesterov"] is True
    for o, ps in ((oa, a), (ob, b), (oc, c)):
        _run(o, ps, grads)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))  # it is Nesterov momentum, not the default


def test_momentum_nesterov_spellings_train_as_torch():
    for kw in ({"nesterov": True}, {"use_nesterov": True}):
        ours, ref = _params(9), _params(9)
        grads = _grads(10, ours, 4)
        _run(optkit.Momentum(ours, 0.1, momentum=0.9, **kw), ours, grads)
        _run(torch.optim.SGD(ref, lr=0.1, momentum=0.9, nesterov=True), ref, grads)
        for x, y in zip(ours, ref):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", sorted(NESTEROV))
def test_nesterov_spelt_twice_or_not_a_bool_is_refused(name):
    with pytest.raises(TypeError, match="both `use_nesterov` and `nesterov`"):
        NESTEROV[name](_params(), nesterov=True, use_nesterov=True)
    with pytest.raises(TypeError, match="`use_nesterov` must be a bool"):
        NESTEROV[name](_params(), use_nesterov=1)


@pytest.mark.parametrize("name", sorted(NESTEROV))
def test_use_nesterov_in_a_param_group(name):
    a, b = _params(11), _params(11)
    opt = NESTEROV[name]([{"params": a[:1], "use_nesterov": True}, {"params": a[1:]}])
    assert [g["nesterov"] for g in opt.param_groups] == [True, False]
    assert all("use_nesterov" not in g for g in opt.param_groups)
    opt.add_param_group({"params": b[:1], "use_nesterov": True})
    assert opt.param_groups[-1]["nesterov"] is True
    group = {"params": b[1:], "nesterov": True, "use_nesterov": False}
    with pytest.raises(ValueError, match="both 'nesterov' and 'use_nesterov'"):
        opt.add_param_group(group)
    assert len(opt.param_groups) == 3 and group["use_nesterov"] is False  # the caller's dict untouched


@pytest.mark.parametrize("name", ["Momentum", "LARS"])
def test_state_dicts_and_configs_of_optkit_0_3_spell_use_nesterov(name):
    """Momentum and LARS kept the group key and config key ``use_nesterov`` until 0.3: such a state dict
    loads (the resumed run equals the uninterrupted one) and such a config rebuilds."""
    make = NESTEROV[name]
    whole, half = _params(12), _params(12)
    grads = _grads(13, whole, 6)
    _run(make(whole, nesterov=True), whole, grads)
    first = make(half, nesterov=True)
    _run(first, half, grads[:3])
    old = copy.deepcopy(first.state_dict())
    for g in old["param_groups"]:
        g["use_nesterov"] = g.pop("nesterov")
    resumed = make(half)  # nesterov=False: the file's True must win
    resumed.load_state_dict(old)
    assert [g["nesterov"] for g in resumed.param_groups] == [True]
    assert "use_nesterov" not in resumed.param_groups[0]
    _run(resumed, half, grads[3:])
    assert all(torch.equal(x, y) for x, y in zip(whole, half))
    cfg = first.get_config()
    cfg["use_nesterov"] = cfg.pop("nesterov")
    assert type(first).from_config(cfg, _params()).get_config() == first.get_config()


def test_torch_sgd_checkpoint_keeps_nesterov_in_momentum():
    ref, ours = _params(14), _params(14)
    grads = _grads(15, ref, 6)
    torch_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9, nesterov=True)
    _run(torch_opt, ref, grads[:3])
    with torch.no_grad():
        for o, r in zip(ours, ref):
            o.copy_(r)
    opt = optkit.Momentum(ours, 0.1, momentum=0.9)
    opt.load_state_dict(torch_opt.state_dict())
    assert opt.param_groups[0]["nesterov"] is True
    _run(torch_opt, ref, grads[3:])
    _run(opt, ours, grads[3:])
    for x, y in zip(ours, ref):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------------- item 2: hints


def _sgd():
    return optkit.SGD(_params(), 0.1, momentum=0.9)


HINT_CASES = [
    # (constructor, keywords, what the message must say besides the argument's name)
    (lambda ps, **kw: optkit.Adam(ps, **kw), {"betas": (0.9, 0.99)}, ["`beta1=`, `beta2=`"]),
    (lambda ps, **kw: optkit.LAMB(ps, **kw), {"betas": (0.9, 0.99)}, ["`beta1=`, `beta2=`"]),
    (lambda ps, **kw: optkit.Momentum(ps, 0.1, **kw), {"betas": (0.9, 0.99)}, ["Momentum has no beta1"]),
    (lambda ps, **kw: optkit.AdamW(ps, **kw), {"eps": 1e-8}, ["`epsilon=`"]),
    (lambda ps, **kw: optkit.SGD(ps, **kw), {"eps": 1e-8}, ["SGD has no epsilon"]),
    (lambda ps, **kw: optkit.Adam(ps, **kw), {"beta_1": 0.9}, ["`beta1=`"]),
    (lambda ps, **kw: optkit.RMSProp(ps, **kw), {"alpha": 0.99}, ["`decay=`"]),
    (lambda ps, **kw: optkit.RMSProp(ps, **kw), {"rho": 0.9}, ["`decay=`"]),
    (lambda ps, **kw: optkit.Adam(ps, **kw), {"maximize": True}, ["not supported", "loss = -objective"]),
    (lambda ps, **kw: optkit.SGD(ps, **kw), {"maximize": False}, ["not supported"]),
    (lambda ps, **kw: optkit.SGD(ps, **kw), {"dampening": 0.1}, ["not supported"]),
    (lambda ps, **kw: optkit.Adam(ps, **kw), {"nesterov": True}, ["Adam has no Nesterov momentum"]),
    (lambda ps, **kw: optkit.Adagrad(ps, **kw), {"use_nesterov": True}, ["Adagrad has no Nesterov momentum"]),
    (lambda ps, **kw: optkit.Adam(ps, **kw), {"momentum": 0.9}, ["`beta1=`"]),
    (lambda ps, **kw: optkit.Ftrl(ps, **kw), {"momentum": 0.9}, ["Ftrl has no momentum"]),
    (lambda ps, **kw: optkit.LARS(ps, 0.1, **kw), {"trust_coefficient": 0.02}, ["`eeta=`"]),
    (lambda ps, **kw: optkit.LARS(ps, 0.1, **kw), {"trust_coeff": 0.001}, ["`eeta=`"]),
    (lambda ps, **kw: optkit.LARS(ps, 0.1, **kw), {"trust_clip": True}, ["optkit.LARC"]),
    (lambda ps, **kw: optkit.LAMB(ps, **kw), {"trust_clip": True}, ["`lambc=`"]),
    (lambda ps, **kw: optkit.LAMB(ps, **kw), {"max_grad_norm": 1.0}, ["`global_grad_norm_clip=`"]),
    (lambda ps, **kw: optkit.SGD(ps, **kw), {"max_grad_norm": 1.0}, ["`global_clipnorm=`"]),
    (lambda ps, **kw: optkit.LAMB(ps, **kw), {"grad_averaging": False}, ["not supported"]),
    (lambda ps, **kw: optkit.Adam(ps, **kw), {"decoupled_weight_decay": True}, ["optkit.AdamW"]),
    (lambda ps, **kw: optkit.Adam(ps, **kw), {"fused": True}, ["drop it"]),
    (lambda ps, **kw: optkit.SGD(ps, **kw), {"foreach": False}, ["drop it"]),
    (lambda ps, **kw: optkit.SGD(ps, **kw), {"momentm": 0.9}, ["did you mean `momentum=`"]),
    # before Python binds the arguments: the hint, not "missing required argument 'momentum'"
    (lambda ps, **kw: optkit.Momentum(ps, 0.1, **kw), {"eps": 1e-8}, ["Momentum has no epsilon"]),
]


@pytest.mark.parametrize("make,kwargs,says", HINT_CASES,
                         ids=[f"{i}-{next(iter(kw))}" for i, (_, kw, _) in enumerate(HINT_CASES)])
def test_foreign_keyword_gets_a_hint_and_nothing_is_built(make, kwargs, says):
    ps = _params()
    for p in ps:
        p.grad = torch.ones_like(p)
    group = {"params": ps, "lr": 0.1}
    snapshot = copy.deepcopy(group)
    with pytest.raises(TypeError) as err:
        make([group], **kwargs)
    assert isinstance(err.value, ValueError)  # optkit's earlier (and Keras's) exception type too
    msg = str(err.value)
    name = next(iter(kwargs))
    assert f"`{name}`" in msg and "not recognized" in msg, msg
    for s in says:
        assert s in msg, msg
    assert group.keys() == snapshot.keys() and group["lr"] == 0.1
    for p, q in zip(ps, snapshot["params"]):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad)


WRAPPER_CASES = [
    (lambda opt, **kw: optkit.LARC(opt, **kw), {"trust_coefficient": 0.02}, "`larc_eta=`"),
    (lambda opt, **kw: optkit.LARC(opt, 0.002, **kw), {"clip": False}, "larc_mode='scale'"),
    (lambda opt, **kw: optkit.LARC(opt, 0.002, **kw), {"eps": 1e-8}, "`epsilon=`"),
    (lambda opt, **kw: optkit.LossScaleOptimizer(opt, **kw), {"init_scale": 2.0**16}, "DynamicLossScale("),
]


@pytest.mark.parametrize("make,kwargs,says", WRAPPER_CASES, ids=[next(iter(c[1])) for c in WRAPPER_CASES])
def test_wrapper_foreign_keyword_gets_a_hint_and_the_optimizer_is_untouched(make, kwargs, says):
    opt = _sgd()
    attrs, state = dict(vars(opt)), copy.deepcopy(opt.state_dict())
    with pytest.raises(TypeError, match=next(iter(kwargs))) as err:
        make(opt, **kwargs)
    assert says in str(err.value)
    assert dict(vars(opt)).keys() == attrs.keys() and all(vars(opt)[k] is v for k, v in attrs.items())
    sd = opt.state_dict()
    assert sd["param_groups"] == state["param_groups"]


def test_every_hint_names_arguments_that_exist():
    """The table suggests only spellings some optkit constructor takes (and aliases point at real names)."""
    from optkit._arguments import accepted_keywords
    from optkit._wrapper import OptimizerWrapper
    from optkit.optimizer import Optimizer

    taken = set().union(*(accepted_keywords(c, Optimizer) for c in OPTIMIZER_CLS_NAMES.values()))
    taken |= accepted_keywords(optkit.LARC, OptimizerWrapper)
    for name, hint in HINTS.items():
        for targets, _ in hint.alternatives:
            assert set(targets) <= taken, (name, targets)
    assert set(ALIASES.values()) <= taken and set(ALIASES) <= taken

