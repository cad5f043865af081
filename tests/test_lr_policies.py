"""Tests for optkit.lr_policies: spec vectors (spec/openseq2seq.md §7), float64 NumPy references written from
the spec formulas, hypothesis properties, step-type equivalence and the error paths."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from optkit import (
    LR_POLICIES,
    cosine_decay,
    exp_decay,
    fixed_lr,
    get_policy,
    inv_poly_decay,
    piecewise_constant,
    poly_decay,
    transformer_policy,
)

RTOL64, RTOL32 = 1e-7, 1e-6
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def close(got: float, want: float, rtol: float, atol: float = 1e-15) -> bool:
    return abs(got - want) <= atol + rtol * abs(want)


# ------------------------------------------------------------------------------------------------------------
# spec vectors (§7), each (policy, kwargs, {step: expected})

PW_EPOCHS = dict(learning_rate=0.1, boundaries=[30, 60, 80, 90], decay_rates=[0.1, 0.01, 0.001, 1e-4])
VECTORS = [
    (fixed_lr, dict(learning_rate=0.1), {0: 0.1, 1: 0.1, 1_000_000: 0.1}),
    (
        piecewise_constant,
        dict(PW_EPOCHS, steps_per_epoch=100),
        {
            0: 0.1,
            3000: 0.1,
            3001: 0.01,
            6000: 0.01,
            6001: 0.001,
            8000: 0.001,
            8001: 1e-4,
            9000: 1e-4,
            9001: 1e-5,
            20000: 1e-5,
        },
    ),
    (
        piecewise_constant,
        dict(learning_rate=2.0, boundaries=[10, 20], decay_rates=[0.5, 0.25]),
        {0: 2.0, 10: 2.0, 11: 1.0, 20: 1.0, 21: 0.5},
    ),
    (
        exp_decay,
        dict(
            learning_rate=1e-3,
            decay_steps=1000,
            decay_rate=0.5,
            use_staircase_decay=False,
            begin_decay_at=500,
            min_lr=1e-4,
        ),
        {0: 1e-3, 499: 1e-3, 500: 1e-3, 1000: 7.0710678e-4, 1500: 5e-4, 3000: 1.7677670e-4, 5000: 1e-4},
    ),
    (
        exp_decay,
        dict(
            learning_rate=1e-3,
            decay_steps=1000,
            decay_rate=0.5,
            use_staircase_decay=True,
            begin_decay_at=500,
            min_lr=1e-4,
        ),
        {999: 1e-3, 1000: 1e-3, 1499: 1e-3, 1500: 5e-4, 2500: 2.5e-4, 3000: 2.5e-4, 10000: 1e-4},
    ),
    (
        exp_decay,
        dict(learning_rate=0.1, decay_steps=100, decay_rate=0.9, use_staircase_decay=False),
        {0: 0.1, 1: 0.099894695, 100: 0.09, 1000: 0.034867844},
    ),
    (
        poly_decay,
        dict(learning_rate=0.01, decay_steps=1000, power=2.0, min_lr=1e-5),
        {0: 0.01, 250: 0.005629375, 500: 0.0025075, 750: 0.000634375, 1000: 1e-5, 2000: 1e-5},
    ),
    (  # Model-injected: max_steps 1000, warmup 100 -> begin_decay_at 100, decay_steps 900
        poly_decay,
        dict(
            learning_rate=0.01, decay_steps=900, power=2.0, begin_decay_at=100, min_lr=1e-5, warmup_steps=100
        ),
        {0: 0.0, 1: 1e-4, 50: 0.005, 99: 0.0099, 100: 0.01, 550: 0.0025075, 1000: 1e-5, 1200: 1e-5},
    ),
    (  # explicit decay_steps with warmup and begin_decay_at 0: decay overlaps warmup (§9 item 12)
        poly_decay,
        dict(learning_rate=0.01, decay_steps=1000, power=1.0, warmup_steps=100),
        {0: 0.0, 50: 0.00475, 99: 0.0089199, 100: 0.009, 500: 0.005, 1000: 0.0},
    ),
    (
        cosine_decay,
        dict(learning_rate=0.01, decay_steps=1000),
        {0: 0.01, 250: 0.0085355339, 500: 0.005, 750: 0.0014644661, 1000: 0.0, 1500: 0.0},
    ),
    (
        cosine_decay,
        dict(learning_rate=0.01, decay_steps=1000, min_lr=0.1),
        {0: 0.01, 250: 0.0086819805, 500: 0.0055, 1000: 0.001},
    ),
    (
        cosine_decay,
        dict(learning_rate=0.01, decay_steps=900, begin_decay_at=100, warmup_steps=100),
        {0: 0.0, 50: 0.005, 99: 0.0099, 100: 0.01, 550: 0.005, 1000: 0.0},
    ),
    (
        transformer_policy,
        dict(learning_rate=2.0, d_model=512, warmup_steps=8000),
        {
            0: 1.2352647e-7,
            1: 2.4705294e-7,
            999: 1.2352647e-4,
            3999: 4.9410588e-4,
            7999: 9.8821177e-4,
            8000: 9.8815001e-4,
            15999: 6.9877124e-4,
            99999: 2.7950850e-4,
        },
    ),
    (
        transformer_policy,
        dict(learning_rate=9.0, d_model=1024, warmup_steps=4000, max_lr=1e-3),
        {0: 1.1117382e-6, 100: 1.1228556e-4, 800: 8.9050233e-4, 900: 1e-3, 3999: 1e-3, 20000: 1e-3},
    ),
    (
        transformer_policy,
        dict(learning_rate=1.0, d_model=512, warmup_steps=4000, coefficient=0.002),
        {0: 3.4938562e-10, 3999: 1.3975425e-6, 10000: 8.8383929e-7},
    ),
    # inv_poly_decay up to decay_steps (the original formula); beyond it see test_inv_poly_beyond_decay_steps
    (
        inv_poly_decay,
        dict(learning_rate=0.01, decay_steps=1000, min_lr=1e-4, power=2.0),
        {0: 0.01, 100: 0.0027700831, 500: 3.3057851e-4, 1000: 1e-4},
    ),
    (
        inv_poly_decay,
        dict(learning_rate=0.1, decay_steps=1000, min_lr=0.01, power=1.0),
        {0: 0.1, 500: 0.018181818, 1000: 0.01},
    ),
]
VECTOR_CASES = [
    pytest.param(fn, kw, step, want, id=f"{fn.__name__}-{i}-{step}")
    for i, (fn, kw, table) in enumerate(VECTORS)
    for step, want in table.items()
]


@pytest.mark.parametrize("fn,kw,step,want", VECTOR_CASES)
def test_spec_vector_python(fn, kw, step, want):
    got = fn(step, **kw)
    assert type(got) is float
    assert close(got, want, RTOL64), (got, want)


@pytest.mark.parametrize("fn,kw,step,want", VECTOR_CASES)
@pytest.mark.parametrize("device", DEVICES)
def test_spec_vector_tensor(fn, kw, step, want, device):
    got = fn(torch.tensor(step, device=device), **kw)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and got.dim() == 0
    assert got.device.type == device
    assert close(float(got), want, RTOL32, atol=1e-12), (float(got), want)


def test_piecewise_fp32_value_is_fp32_of_python_value():
    got = piecewise_constant(torch.tensor(3001), **PW_EPOCHS, steps_per_epoch=100)
    assert float(got) == float(np.float32(0.1 * 0.1))  # 0.0099999998 in fp32, as the spec notes


def test_inv_poly_beyond_decay_steps():
    """The seed page makes min_lr the end rate: optkit holds m after decay_steps; the original kept
    decreasing (spec vectors 2000 -> 2.7700831e-5 and 3000 -> 0.0035714286)."""
    kw = dict(learning_rate=0.01, decay_steps=1000, min_lr=1e-4, power=2.0)
    assert close(inv_poly_decay(2000, **kw), 1e-4, RTOL64)
    assert close(ref_inv_poly_original(2000, **kw), 2.7700831e-5, RTOL64)
    kw = dict(learning_rate=0.1, decay_steps=1000, min_lr=0.01, power=1.0)
    assert close(inv_poly_decay(3000, **kw), 0.01, RTOL64)
    assert close(ref_inv_poly_original(3000, **kw), 0.0035714286, RTOL64)


def test_inv_poly_begin_decay_at_and_warmup():
    kw = dict(
        learning_rate=0.01, decay_steps=1000, min_lr=1e-4, power=2.0, begin_decay_at=200, warmup_steps=200
    )
    assert inv_poly_decay(0, **kw) == 0.0
    assert close(inv_poly_decay(100, **kw), 0.005, RTOL64)
    assert close(inv_poly_decay(200, **kw), 0.01, RTOL64)
    assert close(inv_poly_decay(300, **kw), 0.0027700831, RTOL64)  # decay-relative step 100
    assert close(inv_poly_decay(1200, **kw), 1e-4, RTOL64)
    assert close(inv_poly_decay(5000, **kw), 1e-4, RTOL64)


# ------------------------------------------------------------------------------------------------------------
# float64 NumPy references, written from the spec formulas (vectorised over steps)


def ref_warmup(t, lr, warmup_steps):
    if warmup_steps > 0:
        return np.where(t < warmup_steps, lr * t / warmup_steps, lr)
    return np.full_like(t, lr)


def ref_fixed(t, learning_rate):
    return np.full_like(t, learning_rate)


def ref_piecewise(t, learning_rate, boundaries, decay_rates, steps_per_epoch=None):
    b = np.asarray(boundaries, dtype=np.float64) * (steps_per_epoch or 1)
    values = learning_rate * np.asarray([1.0, *decay_rates])
    return values[np.searchsorted(b, t, side="left")]  # number of boundaries strictly below t


def ref_exp(t, learning_rate, decay_steps, decay_rate, use_staircase_decay, begin_decay_at=0, min_lr=0.0):
    p = (t - begin_decay_at) / decay_steps
    if use_staircase_decay:
        p = np.floor(p)
    lr = np.where(t < begin_decay_at, learning_rate, learning_rate * np.power(decay_rate, np.maximum(p, 0)))
    return np.maximum(min_lr, lr)


def ref_poly(t, learning_rate, decay_steps, power=1.0, begin_decay_at=0, min_lr=0.0, warmup_steps=0):
    lw = ref_warmup(t, learning_rate, warmup_steps)
    s = np.minimum(np.maximum(t - begin_decay_at, 0), decay_steps)
    return np.where(t < begin_decay_at, lw, (lw - min_lr) * (1 - s / decay_steps) ** power + min_lr)


def ref_cosine(t, learning_rate, decay_steps, power=1.0, begin_decay_at=0, min_lr=0.0, warmup_steps=0):
    lw = ref_warmup(t, learning_rate, warmup_steps)
    s = np.minimum(np.maximum(t - begin_decay_at, 0), decay_steps)
    c = 0.5 * (1 + np.cos(np.pi * s / decay_steps))
    return np.where(t < begin_decay_at, lw, lw * ((1 - min_lr) * c + min_lr))


def ref_inv_poly(t, learning_rate, decay_steps, min_lr, power=1.0, begin_decay_at=0, warmup_steps=0):
    m = min(max(min_lr, 1e-8), learning_rate)
    a = ((learning_rate / m) ** (1 / power) - 1) / decay_steps
    lw = ref_warmup(t, learning_rate, warmup_steps)
    s = np.minimum(np.maximum(t - begin_decay_at, 0), decay_steps)
    return np.where(t < begin_decay_at, lw, lw / (1 + a * s) ** power)


def ref_inv_poly_original(t, learning_rate, decay_steps, min_lr, power=1.0):
    m = min(max(min_lr, 1e-8), learning_rate)
    a = ((learning_rate / m) ** (1 / power) - 1) / decay_steps
    return learning_rate / (1 + a * t) ** power


def ref_transformer(t, learning_rate, d_model, warmup_steps, max_lr=None, coefficient=1.0):
    n = t + 1.0
    lr = learning_rate * coefficient * d_model**-0.5 * np.minimum(n * warmup_steps**-1.5, n**-0.5)
    return lr if max_lr is None else np.minimum(max_lr, lr)


def random_params(name, rng):
    lr = float(10 ** rng.uniform(-4, 0))
    ds = int(rng.integers(1, 5000))
    if name == "fixed_lr":
        return dict(learning_rate=lr)
    if name == "piecewise_constant":
        k = int(rng.integers(0, 5))
        bounds = sorted(int(x) for x in rng.integers(0, 100, size=k))
        return dict(
            learning_rate=lr,
            boundaries=bounds,
            decay_rates=[float(x) for x in rng.uniform(0, 1, k)],
            steps_per_epoch=int(rng.integers(1, 50)) if rng.random() < 0.5 else None,
        )
    if name == "exp_decay":
        return dict(
            learning_rate=lr,
            decay_steps=ds,
            decay_rate=float(rng.uniform(0.05, 1.0)),
            use_staircase_decay=bool(rng.random() < 0.5),
            begin_decay_at=int(rng.integers(0, 2000)),
            min_lr=float(lr * rng.uniform(0, 0.5)),
        )
    if name in ("poly_decay", "cosine_decay"):
        return dict(
            learning_rate=lr,
            decay_steps=ds,
            power=float(rng.uniform(0.25, 4)),
            begin_decay_at=int(rng.integers(0, 2000)),
            min_lr=float(lr * rng.uniform(0, 0.5)) if name == "poly_decay" else float(rng.uniform(0, 1)),
            warmup_steps=int(rng.integers(0, 2000)),
        )
    if name == "inv_poly_decay":
        return dict(
            learning_rate=lr,
            decay_steps=ds,
            min_lr=float(lr * rng.uniform(1e-3, 1)),
            power=float(rng.uniform(0.25, 4)),
            begin_decay_at=int(rng.integers(0, 2000)),
            warmup_steps=int(rng.integers(0, 2000)),
        )
    return dict(
        learning_rate=float(rng.uniform(0.1, 10)),
        d_model=int(rng.integers(16, 4096)),
        warmup_steps=int(rng.integers(1, 10000)),
        max_lr=float(10 ** rng.uniform(-5, -2)) if rng.random() < 0.5 else None,
        coefficient=float(rng.uniform(0.001, 2)),
    )


REFS = {
    "fixed_lr": ref_fixed,
    "piecewise_constant": ref_piecewise,
    "exp_decay": ref_exp,
    "poly_decay": ref_poly,
    "cosine_decay": ref_cosine,
    "inv_poly_decay": ref_inv_poly,
    "transformer_policy": ref_transformer,
}


@pytest.mark.parametrize("name", sorted(REFS))
def test_against_numpy_reference(name):
    rng = np.random.default_rng(sum(map(ord, name)))
    fn = LR_POLICIES[name]
    for _ in range(20):
        kw = random_params(name, rng)
        steps = np.concatenate([rng.integers(0, 12000, size=20), rng.uniform(0, 12000, size=5)])
        want = REFS[name](steps.astype(np.float64), **kw)
        for step, w in zip(steps, want):
            step = int(step) if float(step).is_integer() else float(step)
            got = fn(step, **kw)
            assert close(got, float(w), 1e-12, atol=1e-300), (kw, step, got, w)
            got_t = fn(
                torch.tensor(step, dtype=torch.float64 if isinstance(step, float) else torch.int64), **kw
            )
            assert close(float(got_t), float(w), RTOL32, atol=1e-30), (kw, step, float(got_t), w)
            # a float64 step (a float64 parameter group's) gives the float64 value, not rounded to float32
            got_64 = fn(torch.tensor(float(step), dtype=torch.float64), **kw)
            assert got_64.dtype == torch.float64
            assert close(float(got_64), float(w), 1e-12, atol=1e-300), (kw, step, float(got_64), w)


# ------------------------------------------------------------------------------------------------------------
# step types


@pytest.mark.parametrize("name", sorted(REFS))
def test_int_float_tensor_steps_agree(name):
    rng = np.random.default_rng(7 + len(name))
    fn = LR_POLICIES[name]
    kw = random_params(name, rng)
    for step in [0, 1, 17, 999, 1000, 4321, 11999]:
        a, b = fn(step, **kw), fn(float(step), **kw)
        assert a == b and type(a) is float and type(b) is float
        assert fn(np.int64(step), **kw) == a
        for dtype in (torch.int32, torch.int64, torch.float32):
            t = fn(torch.tensor(step, dtype=dtype), **kw)
            assert t.dtype == torch.float32 and t.shape == ()
            assert close(float(t), a, RTOL32, atol=1e-30)
        t = fn(torch.tensor(step, dtype=torch.float64), **kw)  # float64 in, float64 out, unrounded
        assert t.dtype == torch.float64 and t.shape == ()
        assert close(float(t), a, 1e-14, atol=1e-300)


def test_tensor_step_keeps_no_graph_and_does_not_touch_input():
    step = torch.tensor(10.0, requires_grad=True)
    out = poly_decay(step, 0.1, 100, warmup_steps=20)
    assert not out.requires_grad and step.item() == 10.0


def test_transformer_dtype():
    out = transformer_policy(torch.tensor(5), 2.0, 512, 8000, dtype=torch.float64)
    assert out.dtype == torch.float64
    assert close(float(out), ref_transformer(5.0, 2.0, 512, 8000), 1e-12)


POLICY_ARGS = {
    "fixed_lr": dict(learning_rate=0.1),
    "piecewise_constant": dict(learning_rate=0.1, boundaries=[3, 7], decay_rates=[0.5, 0.1]),
    "exp_decay": dict(
        learning_rate=0.1, decay_steps=10, decay_rate=0.5, use_staircase_decay=True, min_lr=0.01
    ),
    "poly_decay": dict(learning_rate=0.1, decay_steps=10, power=2.0, begin_decay_at=2, warmup_steps=3),
    "cosine_decay": dict(learning_rate=0.1, decay_steps=10, begin_decay_at=2, warmup_steps=3, min_lr=0.1),
    "inv_poly_decay": dict(learning_rate=0.1, decay_steps=10, min_lr=0.01, begin_decay_at=2, warmup_steps=3),
    "transformer_policy": dict(learning_rate=2.0, d_model=64, warmup_steps=5, max_lr=0.05),
}


@pytest.mark.parametrize("name", sorted(POLICY_ARGS))
def test_tensor_path_traces_without_graph_breaks(name):
    """fullgraph=True fails on any .item() or python branch on a tensor value, i.e. on any host sync."""
    fn, kw = LR_POLICIES[name], POLICY_ARGS[name]
    compiled = torch.compile(lambda s: fn(s, **kw), backend="eager", fullgraph=True)
    for step in (0, 4, 30):
        assert close(float(compiled(torch.tensor(step))), fn(step, **kw), RTOL32, atol=1e-30)


# ------------------------------------------------------------------------------------------------------------
# hypothesis properties

lrs = st.floats(1e-6, 10.0)
steps = st.integers(0, 10**6)
decay_steps = st.integers(1, 10**5)
small = st.integers(0, 10**4)


@settings(max_examples=60, deadline=None)
@given(
    lr=lrs,
    ds=decay_steps,
    power=st.floats(0.1, 5),
    bda=small,
    ws=small,
    frac=st.floats(0, 1),
    t=steps,
    staircase=st.booleans(),
    rate=st.floats(0.01, 1.0),
)
def test_finite_and_non_negative(lr, ds, power, bda, ws, frac, t, staircase, rate):
    values = [
        fixed_lr(t, lr),
        exp_decay(t, lr, ds, rate, staircase, bda, lr * frac),
        poly_decay(t, lr, ds, power, bda, lr * frac, ws),
        cosine_decay(t, lr, ds, power, bda, frac, ws),
        inv_poly_decay(t, lr, ds, lr * frac, power, bda, ws),
        transformer_policy(t, lr, 512, ws + 1, None if frac < 0.5 else frac),
        piecewise_constant(t, lr, [bda, bda + ws], [frac, frac / 2]),
    ]
    assert all(math.isfinite(v) and v >= 0 for v in values)


@settings(max_examples=60, deadline=None)
@given(
    lr=lrs,
    ds=decay_steps,
    power=st.floats(0.1, 5),
    bda=small,
    ws=small,
    frac=st.floats(0, 1),
    t0=steps,
    dt=st.integers(1, 10**4),
)
def test_decays_are_monotone_after_warmup(lr, ds, power, bda, ws, frac, t0, dt):
    t0 = t0 + ws  # at or after the end of warmup
    t1 = t0 + dt
    for fn, kw in [
        (poly_decay, dict(min_lr=lr * frac)),
        (cosine_decay, dict(min_lr=frac)),
        (inv_poly_decay, dict(min_lr=lr * frac)),
    ]:
        a = fn(t0, lr, ds, power=power, begin_decay_at=bda, warmup_steps=ws, **kw)
        b = fn(t1, lr, ds, power=power, begin_decay_at=bda, warmup_steps=ws, **kw)
        assert b <= a * (1 + 1e-12), (fn.__name__, t0, t1, a, b)


@settings(max_examples=60, deadline=None)
@given(lr=lrs, bounds=st.lists(st.integers(0, 1000), max_size=6), t=st.integers(0, 3000), data=st.data())
def test_piecewise_is_one_of_the_values(lr, bounds, t, data):
    bounds = sorted(bounds)
    rates = data.draw(st.lists(st.floats(0, 1), min_size=len(bounds), max_size=len(bounds)))
    values = [lr] + [lr * r for r in rates]
    assert piecewise_constant(t, lr, bounds, rates) in values
    got = piecewise_constant(torch.tensor(t), lr, bounds, rates)
    assert float(got) in [float(np.float32(v)) for v in values]


# ------------------------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("name", sorted(POLICY_ARGS))
def test_bad_global_step(name):
    fn, kw = LR_POLICIES[name], POLICY_ARGS[name]
    with pytest.raises(ValueError, match="global_step"):
        fn(None, **kw)
    for bad in ("3", [3], True):
        with pytest.raises(TypeError, match="global_step"):
            fn(bad, **kw)
    for bad in (-1, float("nan"), float("inf"), torch.tensor([1, 2])):
        with pytest.raises(ValueError, match="global_step"):
            fn(bad, **kw)
    with pytest.raises(TypeError, match="global_step"):
        fn(torch.tensor(True), **kw)


@pytest.mark.parametrize(
    "fn,kw,arg,exc",
    [
        (fixed_lr, dict(learning_rate="0.1"), "learning_rate", TypeError),
        (fixed_lr, dict(learning_rate=-0.1), "learning_rate", ValueError),
        (
            exp_decay,
            dict(learning_rate=0.1, decay_steps=0, decay_rate=0.5, use_staircase_decay=False),
            "decay_steps",
            ValueError,
        ),
        (
            exp_decay,
            dict(learning_rate=0.1, decay_steps=10, decay_rate=0.5, use_staircase_decay="yes"),
            "use_staircase_decay",
            TypeError,
        ),
        (
            exp_decay,
            dict(learning_rate=0.1, decay_steps=10, decay_rate=0.0, use_staircase_decay=False),
            "decay_rate",
            ValueError,
        ),
        (poly_decay, dict(learning_rate=0.1, decay_steps=-5), "decay_steps", ValueError),
        (poly_decay, dict(learning_rate=0.1, decay_steps=10, power=0.0), "power", ValueError),
        (poly_decay, dict(learning_rate=0.1, decay_steps=10, warmup_steps=-1), "warmup_steps", ValueError),
        (
            poly_decay,
            dict(learning_rate=0.1, decay_steps=10, begin_decay_at=-1),
            "begin_decay_at",
            ValueError,
        ),
        (cosine_decay, dict(learning_rate=0.1, decay_steps=0), "decay_steps", ValueError),
        (cosine_decay, dict(learning_rate=0.1, decay_steps=10, min_lr=1.5), "min_lr", ValueError),
        (
            inv_poly_decay,
            dict(learning_rate=0.1, decay_steps=10, min_lr=0.01, power=0.0),
            "power",
            ValueError,
        ),
        (
            inv_poly_decay,
            dict(learning_rate=0.1, decay_steps=10, min_lr=0.01, power=-1.0),
            "power",
            ValueError,
        ),
        (inv_poly_decay, dict(learning_rate=0.1, decay_steps=0, min_lr=0.01), "decay_steps", ValueError),
        (inv_poly_decay, dict(learning_rate=0.0, decay_steps=10, min_lr=0.01), "learning_rate", ValueError),
        (inv_poly_decay, dict(learning_rate=0.1, decay_steps=10, min_lr=None), "min_lr", TypeError),
        (
            piecewise_constant,
            dict(learning_rate=0.1, boundaries=[1, 2], decay_rates=[0.5]),
            "boundaries",
            ValueError,
        ),
        (
            piecewise_constant,
            dict(learning_rate=0.1, boundaries=[1.5], decay_rates=[0.5]),
            "boundaries",
            ValueError,
        ),
        (
            piecewise_constant,
            dict(learning_rate=0.1, boundaries=[5, 2], decay_rates=[0.5, 0.1]),
            "boundaries",
            ValueError,
        ),
        (
            piecewise_constant,
            dict(learning_rate=0.1, boundaries=["a"], decay_rates=[0.5]),
            "boundaries",
            TypeError,
        ),
        (
            piecewise_constant,
            dict(learning_rate=0.1, boundaries=3, decay_rates=[0.5]),
            "boundaries",
            TypeError,
        ),
        (
            piecewise_constant,
            dict(learning_rate=0.1, boundaries=[3], decay_rates=[0.5], steps_per_epoch=0),
            "steps_per_epoch",
            ValueError,
        ),
        (
            piecewise_constant,
            dict(learning_rate=0.1, boundaries=[3], decay_rates=[0.5], steps_per_epoch=2.5),
            "steps_per_epoch",
            TypeError,
        ),
        (transformer_policy, dict(learning_rate=1.0, d_model=0, warmup_steps=10), "d_model", ValueError),
        (transformer_policy, dict(learning_rate=1.0, d_model=8, warmup_steps=0), "warmup_steps", ValueError),
        (
            transformer_policy,
            dict(learning_rate=1.0, d_model=8, warmup_steps=10, max_lr=-1.0),
            "max_lr",
            ValueError,
        ),
        (
            transformer_policy,
            dict(learning_rate=1.0, d_model=8, warmup_steps=10, dtype="float32"),
            "dtype",
            TypeError,
        ),
    ],
)
def test_bad_parameters(fn, kw, arg, exc):
    for step in (5, torch.tensor(5)):
        with pytest.raises(exc, match=arg):
            fn(step, **kw)


def test_required_arguments_have_no_default():
    with pytest.raises(TypeError, match="use_staircase_decay"):
        exp_decay(0, 0.1, 10, 0.5)
    with pytest.raises(TypeError, match="min_lr"):
        inv_poly_decay(0, 0.1, 10)


def test_get_policy():
    assert get_policy("poly_decay") is poly_decay
    assert get_policy("Transformer_Policy") is transformer_policy
    with pytest.raises(ValueError, match="poly_decay") as err:
        get_policy("nope")
    assert "cosine_decay" in str(err.value)
    with pytest.raises(TypeError, match="name"):
        get_policy(poly_decay)
    assert sorted(LR_POLICIES) == sorted(REFS)
