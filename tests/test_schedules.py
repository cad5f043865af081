"""Tests for optkit.schedules: PolicySchedule, config round-trips, build_schedule and the ScheduleLR adapter
(checked against torch.optim.lr_scheduler.LambdaLR and against an uninterrupted run for resume)."""

from __future__ import annotations

import copy
import io
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from optkit import (
    LR_POLICIES,
    LearningRateSchedule,
    PolicySchedule,
    ScheduleLR,
    build_schedule,
    cosine_decay,
    poly_decay,
    transformer_policy,
)

CONFIGS = {
    "fixed_lr": dict(learning_rate=0.1),
    "piecewise_constant": dict(
        learning_rate=0.1, boundaries=[3, 7], decay_rates=[0.5, 0.1], steps_per_epoch=2
    ),
    "exp_decay": dict(
        learning_rate=0.1, decay_steps=10, decay_rate=0.5, use_staircase_decay=False, min_lr=0.01
    ),
    "poly_decay": dict(learning_rate=0.1, decay_steps=20, power=2.0, begin_decay_at=5, warmup_steps=5),
    "cosine_decay": dict(learning_rate=0.1, decay_steps=20, begin_decay_at=5, warmup_steps=5, min_lr=0.1),
    "inv_poly_decay": dict(learning_rate=0.1, decay_steps=20, min_lr=0.01, power=2.0, begin_decay_at=3),
    "transformer_policy": dict(
        learning_rate=2.0, d_model=64, warmup_steps=5, max_lr=0.05, dtype=torch.float32
    ),
}
STEPS = [0, 1, 4, 5, 9, 17, 25, 40]


# ------------------------------------------------------------------------------------------------------------
# PolicySchedule and configs


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_policy_schedule_calls_the_policy(name):
    kw = CONFIGS[name]
    for policy in (name, name.upper(), LR_POLICIES[name]):
        s = PolicySchedule(policy, **kw)
        for t in STEPS:
            assert s(t) == LR_POLICIES[name](t, **kw)
            got = s(torch.tensor(t))
            assert isinstance(got, torch.Tensor) and got.shape == ()
            assert float(got) == float(LR_POLICIES[name](torch.tensor(t), **kw))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_round_trip(name):
    s = PolicySchedule(name, **CONFIGS[name])
    cfg = s.get_config()
    assert cfg == {"policy": name, **CONFIGS[name]}
    rebuilt = [PolicySchedule.from_config(cfg), LearningRateSchedule.from_config(cfg), build_schedule(cfg)]
    if "dtype" not in cfg:  # everything else is plain JSON
        rebuilt.append(LearningRateSchedule.from_config(json.loads(json.dumps(cfg))))
    for r in rebuilt:
        assert isinstance(r, PolicySchedule) and r.get_config() == cfg
        assert [r(t) for t in STEPS] == [s(t) for t in STEPS]


def test_config_is_a_copy():
    bounds = [3, 7]
    s = PolicySchedule("piecewise_constant", learning_rate=0.1, boundaries=bounds, decay_rates=[0.5, 0.1])
    bounds.append(9)
    s.get_config()["boundaries"].append(11)
    assert s.get_config()["boundaries"] == [3, 7]
    assert s(8) == pytest.approx(0.01)


def test_repr():
    r = repr(PolicySchedule("poly_decay", learning_rate=0.1, decay_steps=10))
    assert r == "PolicySchedule(policy='poly_decay', learning_rate=0.1, decay_steps=10)"


def linear_policy(global_step, learning_rate, slope=0.0):
    return learning_rate + slope * global_step


def test_custom_policy_function(monkeypatch):
    s = PolicySchedule(linear_policy, learning_rate=1.0, slope=0.5)
    assert s(4) == 3.0
    assert s.get_config() == {"policy": linear_policy, "learning_rate": 1.0, "slope": 0.5}
    assert LearningRateSchedule.from_config(s.get_config())(4) == 3.0
    monkeypatch.setitem(LR_POLICIES, "linear_policy", linear_policy)
    s = build_schedule("Linear_Policy", learning_rate=1.0)
    assert s.get_config() == {"policy": "linear_policy", "learning_rate": 1.0}


def test_build_schedule_forms():
    s = build_schedule("cosine_decay", learning_rate=0.1, decay_steps=10)
    assert s(5) == cosine_decay(5, 0.1, 10)
    assert build_schedule(s) is s
    over = build_schedule({"policy": "poly_decay", "learning_rate": 0.1, "decay_steps": 10}, decay_steps=20)
    assert over(5) == poly_decay(5, 0.1, 20)
    assert build_schedule(poly_decay, learning_rate=0.1, decay_steps=10)(5) == poly_decay(5, 0.1, 10)
    with pytest.raises(ValueError, match="params"):
        build_schedule(s, learning_rate=0.2)
    with pytest.raises(TypeError, match="name_or_config"):
        build_schedule(3)


class HalvingSchedule(LearningRateSchedule):
    """A user subclass: no tag, rebuilt through its own class."""

    def __init__(self, lr: float, every: int) -> None:
        self.lr, self.every = lr, every

    def __call__(self, step):
        return self.lr * 0.5 ** (step // self.every)

    def get_config(self):
        return {"lr": self.lr, "every": self.every}


def test_subclass_round_trip():
    s = HalvingSchedule(1.0, 3)
    r = HalvingSchedule.from_config(s.get_config())
    assert [r(t) for t in range(10)] == [s(t) for t in range(10)]
    assert repr(s) == "HalvingSchedule(lr=1.0, every=3)"
    with pytest.raises(ValueError, match="policy"):
        LearningRateSchedule.from_config(s.get_config())  # the base needs a tag key


@pytest.mark.parametrize(
    "args,kw,exc,match",
    [
        (("poly_decay",), dict(learning_rate=0.1, decay_steps=10, decay_rate=0.5), ValueError, "decay_rate"),
        (("poly_decay",), dict(learning_rate=0.1), ValueError, "decay_steps"),
        (
            ("exp_decay",),
            dict(learning_rate=0.1, decay_steps=10, decay_rate=0.5),
            ValueError,
            "use_staircase_decay",
        ),
        (("poly_decay",), dict(learning_rate=0.1, decay_steps=0), ValueError, "decay_steps"),
        (
            ("inv_poly_decay",),
            dict(learning_rate=0.1, decay_steps=10, min_lr=0.0, power=0),
            ValueError,
            "power",
        ),
        (("poly_decay",), dict(global_step=3, learning_rate=0.1, decay_steps=10), ValueError, "global_step"),
        (("warmup_cosine",), dict(learning_rate=0.1), ValueError, "cosine_decay"),
        ((3,), dict(learning_rate=0.1), TypeError, "policy"),
    ],
)
def test_construction_errors(args, kw, exc, match):
    with pytest.raises(exc, match=match):
        PolicySchedule(*args, **kw)


def test_from_config_errors():
    with pytest.raises(TypeError, match="config"):
        LearningRateSchedule.from_config([("policy", "fixed_lr")])
    with pytest.raises(ValueError, match="policy"):
        PolicySchedule.from_config({"learning_rate": 0.1})
    with pytest.raises(ValueError, match="bogus"):
        LearningRateSchedule.from_config({"policy": "fixed_lr", "learning_rate": 0.1, "bogus": 1})


# ------------------------------------------------------------------------------------------------------------
# ScheduleLR


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)) for _ in range(n)]


def train(model, opt, sched, data, lrs):
    for x, y in data:
        lrs.append([float(g["lr"]) for g in opt.param_groups])
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()


SCHED = dict(
    policy="poly_decay",
    learning_rate=0.2,
    decay_steps=30,
    power=2.0,
    begin_decay_at=5,
    warmup_steps=5,
    min_lr=1e-3,
)


def test_update_k_uses_schedule_of_k():
    s = build_schedule(SCHED)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=123.0)
    sched = ScheduleLR(opt, s)
    lrs = []
    train(model, opt, sched, batches(40), lrs)
    assert [lr[0] for lr in lrs] == [s(k) for k in range(40)]
    assert sched.last_step == 40 and sched.get_last_lr() == [s(40)]


def test_multiplier_mode_matches_lambda_lr():
    """mode='multiplier' is LambdaLR with the schedule as the lambda: same lrs, same parameters."""
    s = build_schedule("cosine_decay", learning_rate=1.0, decay_steps=25, warmup_steps=4, begin_decay_at=4)
    runs = []
    for use_ours in (True, False):
        model = make_model()
        params = list(model.parameters())
        opt = torch.optim.SGD(
            [{"params": params[:2], "lr": 0.1}, {"params": params[2:], "lr": 0.03}], momentum=0.9
        )
        sched = (
            ScheduleLR(opt, s, mode="multiplier") if use_ours else torch.optim.lr_scheduler.LambdaLR(opt, s)
        )
        lrs = []
        train(model, opt, sched, batches(30), lrs)
        runs.append((lrs, [p.detach().clone() for p in model.parameters()]))
    (lrs_a, p_a), (lrs_b, p_b) = runs
    np.testing.assert_allclose(np.array(lrs_a), np.array(lrs_b), rtol=1e-15, atol=0)
    for a, b in zip(p_a, p_b):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_absolute_mode_sgd_matches_numpy():
    """Plain SGD on a least-squares problem with lr(k) from the schedule, against a float64 NumPy loop."""
    s = build_schedule(
        "exp_decay", learning_rate=0.05, decay_steps=5, decay_rate=0.7, use_staircase_decay=True
    )
    rng = np.random.default_rng(3)
    X, y, w0 = rng.normal(size=(32, 5)), rng.normal(size=(32,)), rng.normal(size=(5,))
    w = torch.tensor(w0, requires_grad=True)
    opt = torch.optim.SGD([w], lr=1.0)
    sched = ScheduleLR(opt, s)
    Xt, yt = torch.tensor(X), torch.tensor(y)
    ref = w0.copy()
    for k in range(20):
        opt.zero_grad()
        ((Xt @ w - yt) ** 2).mean().backward()
        opt.step()
        sched.step()
        ref -= s(k) * (2 * X.T @ (X @ ref - y) / len(y))
    np.testing.assert_allclose(w.detach().numpy(), ref, rtol=1e-12)


def save(obj_state) -> bytes:
    buf = io.BytesIO()
    torch.save(obj_state, buf)
    return buf.getvalue()


def load(raw: bytes):
    return torch.load(io.BytesIO(raw), weights_only=True)


@pytest.mark.parametrize("order", ["scheduler_first", "optimizer_first"])
@pytest.mark.parametrize("tensor_lr", [False, True])
def test_resume_gives_identical_sequence(order, tensor_lr):
    s = build_schedule(SCHED)
    data = batches(40)
    lr0 = torch.tensor(0.5) if tensor_lr else 0.5

    def fresh():
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=lr0.clone() if tensor_lr else lr0, momentum=0.9)
        return model, opt, ScheduleLR(opt, s)

    model, opt, sched = fresh()
    full = []
    train(model, opt, sched, data, full)
    want = [p.detach().clone() for p in model.parameters()]

    model, opt, sched = fresh()
    part = []
    train(model, opt, sched, data[:17], part)
    ckpt = save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()})
    assert "schedule" not in sched.state_dict()

    model, opt, sched = fresh()
    state = load(ckpt)
    model.load_state_dict(state["model"])
    if order == "scheduler_first":
        sched.load_state_dict(state["sched"])
        opt.load_state_dict(state["opt"])
    else:
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
    train(model, opt, sched, data[17:], part)

    assert part == full
    for a, b in zip(model.parameters(), want):
        assert torch.equal(a.detach(), b)
    if tensor_lr:
        assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)


def test_load_state_dict_reapplies_closed_form_lr():
    s = build_schedule(SCHED)
    opt = torch.optim.SGD(make_model().parameters(), lr=0.5)
    sched = ScheduleLR(opt, s)
    for _ in range(12):
        opt.step()
        sched.step()
    state = copy.deepcopy(sched.state_dict())
    opt2 = torch.optim.SGD(make_model().parameters(), lr=0.5)
    sched2 = ScheduleLR(opt2, s)
    sched2.load_state_dict(state)  # optimizer state deliberately not loaded
    assert opt2.param_groups[0]["lr"] == s(12) and sched2.get_last_lr() == [s(12)]


def test_last_step_resume_constructor():
    s = build_schedule(SCHED)
    opt = torch.optim.SGD(make_model().parameters(), lr=0.5)
    opt.param_groups[0]["initial_lr"] = 0.5
    sched = ScheduleLR(opt, s, last_step=9)
    assert sched.last_step == 10 and opt.param_groups[0]["lr"] == s(10)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 60), name=st.sampled_from(sorted(CONFIGS)))
def test_lr_after_n_steps_is_schedule_of_n(n, name):
    s = PolicySchedule(name, **CONFIGS[name])
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0)
    sched = ScheduleLR(opt, s)
    for _ in range(n):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == s(n)


def test_schedule_lr_validation_leaves_optimizer_untouched():
    s = build_schedule(SCHED)
    opt = torch.optim.SGD(make_model().parameters(), lr=0.5)
    before = copy.deepcopy(opt.state_dict()["param_groups"])
    for kw, exc, match in [
        (dict(schedule=s, mode="relative"), ValueError, "mode"),
        (dict(schedule="poly_decay"), TypeError, "schedule"),
        (dict(schedule=s, last_step=-2), ValueError, "last_step"),
        (dict(schedule=s, last_step=1.5), TypeError, "last_step"),
    ]:
        with pytest.raises(exc, match=match):
            ScheduleLR(opt, **kw)
        assert opt.state_dict()["param_groups"] == before


def test_bad_state_dict_leaves_scheduler_untouched():
    s = build_schedule(SCHED)
    opt = torch.optim.SGD(make_model().parameters(), lr=0.5)
    sched = ScheduleLR(opt, s)
    opt.step()
    sched.step()
    before = copy.deepcopy(sched.state_dict())
    bad_last = dict(before, last_epoch="3")
    bad_bases = dict(before, base_lrs=[0.5, 0.5])
    for bad, match in [(bad_last, "last_epoch"), (bad_bases, "base_lrs")]:
        with pytest.raises(ValueError, match=match):
            sched.load_state_dict(bad)
        assert sched.state_dict() == before and opt.param_groups[0]["lr"] == s(1)


@pytest.mark.parametrize("bad, exc", [(float("nan"), ValueError), (float("inf"), ValueError),
                                        (-0.1, ValueError), (10**400, ValueError), ("0.1", TypeError),
                                        (torch.ones(2), TypeError)])
def test_refused_schedule_value_changes_nothing(bad, exc):
    """A user schedule whose value at some step is not a learning rate raises at that ``step()``, naming the
    step, with the position and every group's lr as before (a NaN lr trained to NaN)."""
    opt = torch.optim.SGD(make_model().parameters(), lr=0.5)
    sched = ScheduleLR(opt, lambda t: bad if t == 2 else 0.1 * (t + 1))
    opt.step()
    sched.step()
    before = copy.deepcopy(sched.state_dict())
    with pytest.raises(exc, match="at step 2" if exc is ValueError else "schedule returned"):
        sched.step()
    assert sched.state_dict() == before and sched.last_step == 1
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2)
    with pytest.raises(exc):  # the same step is refused again, not skipped over
        sched.step()
    with pytest.raises(exc):
        ScheduleLR(torch.optim.SGD(make_model().parameters(), lr=0.5), lambda t: bad)


def test_transformer_schedule_with_tensor_steps():
    s = build_schedule("transformer_policy", learning_rate=2.0, d_model=512, warmup_steps=8000)
    got = s(torch.arange(3)[1])
    assert isinstance(got, torch.Tensor) and float(got) == pytest.approx(
        transformer_policy(1, 2.0, 512, 8000), rel=1e-6
    )


def test_bad_state_values_and_unknown_keys_rejected_atomically():
    """Bad base_lrs / last_epoch values and unknown keys raise naming the entry, before anything changes."""
    s = PolicySchedule("poly_decay", learning_rate=1.0, decay_steps=100)
    torch.manual_seed(0)
    opt = torch.optim.SGD(make_model().parameters(), lr=0.5)
    sched = ScheduleLR(opt, s, mode="multiplier")
    for _ in range(3):
        opt.step()
        sched.step()
    good = copy.deepcopy(sched.state_dict())
    meta = torch.empty((), device="meta")
    cases = [
        (dict(good, base_lrs=["x"]), TypeError, r"base_lrs\[0\]"),
        (dict(good, base_lrs=[float("nan")]), ValueError, r"base_lrs\[0\]"),
        (dict(good, base_lrs=[-0.5]), ValueError, r"base_lrs\[0\]"),
        (dict(good, base_lrs=[10**400]), ValueError, r"base_lrs\[0\]"),
        (dict(good, base_lrs=[meta]), ValueError, r"base_lrs\[0\]"),
        (dict(good, base_lrs=[torch.tensor(0.5 + 1j)]), TypeError, r"base_lrs\[0\]"),
        (dict(good, last_epoch=10**400), ValueError, "last_epoch"),
        (dict(good, last_epoch=2**62), ValueError, "last_epoch"),
        (dict(good, last_epoch=True), TypeError, "last_epoch"),
        (dict(good, _step_count=-1), ValueError, "_step_count"),
        (dict(good, _last_lr=[float("inf")]), ValueError, "_last_lr"),
        (dict(good, _scales_itself="x"), TypeError, "_scales_itself"),
        (dict(good, get_lr=None), ValueError, "get_lr"),
        (dict(good, step=None), ValueError, "'step'"),
    ]
    for bad, exc, match in cases:
        if match != "last_epoch":
            bad["last_epoch"] = 7  # a valid new position, so a half-done load would be visible
        with pytest.raises(exc, match=match):
            sched.load_state_dict(bad)
        after = sched.state_dict()
        assert set(after) == set(good) and all(after[k] == good[k] for k in good)
        assert opt.param_groups[0]["lr"] == 0.5 * s(3)
        assert "get_lr" not in vars(sched) and "step" not in vars(sched)
    sched.load_state_dict(dict(good, last_epoch=7))  # still works: a valid load, then a step
    assert opt.param_groups[0]["lr"] == 0.5 * s(7)
    opt.step()
    sched.step()
    assert sched.last_step == 8 and opt.param_groups[0]["lr"] == 0.5 * s(8)


def test_resuming_last_step_without_initial_lr_names_the_argument():
    """torch's resume path needs each group's ``initial_lr``; without it the error names ``last_step``
    (torch raises a bare ``KeyError``)."""
    import optkit

    opt = optkit.SGD([torch.nn.Parameter(torch.randn(2))], learning_rate=0.1)
    with pytest.raises(ValueError, match="last_step"):
        optkit.ScheduleLR(opt, lambda s: 0.1, last_step=5)
