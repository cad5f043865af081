"""Tests for optkit.loss_scale against spec vectors and float64 NumPy reference state machines.

References: ``shared/spec/tf_keras.md`` §3.1/§3.5 (TF1 Fixed/Dynamic, LS1), ``shared/spec/openseq2seq.md``
§6 (Backoff, LogMax) and §9 #2 (the LogMax fixes), ``shared/spec/pytorch_anchors.md`` §7.2
(DeepSpeed hysteresis).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import optkit
from optkit import (
    AutomaticLossScaler,
    BackoffScaler,
    DynamicLossScale,
    FixedLossScale,
    LogMaxScaler,
    LossScale,
    LossScaleAtMinimumWarning,
    get_loss_scale,
)

FP32_MAX = float(np.finfo(np.float32).max)
NO_FLOOR_WARN = pytest.mark.filterwarnings("ignore::optkit.LossScaleAtMinimumWarning")
pytestmark = NO_FLOOR_WARN  # the floor-warning tests below turn warnings back on where they check them
PROP = settings(max_examples=40, deadline=None, derandomize=True)

ZERO = torch.tensor(0.0)
ONE = torch.tensor(1.0)


def f(flag: int | bool) -> torch.Tensor:
    return torch.tensor(float(flag))


# ----------------------------------------------------------------------------------------------------------
# float64 NumPy reference state machines, written from the spec formulas


def ref_dynamic(flags, init, period, mult, hyst=1, lo=1.0, hi=None):
    """TF1 DynamicLossScale with DeepSpeed's hysteresis counter (consecutive_hysteresis=True form)."""
    scale, good, cur_hyst, floor = np.float64(init), 0, hyst, 0
    out = []
    for overflow in flags:
        if overflow:
            if scale <= lo:
                floor += 1
            if cur_hyst == 1:
                scale = max(scale / mult, lo)
            else:
                cur_hyst -= 1
            good = 0
        else:
            cur_hyst = hyst
            if good + 1 >= period:
                cand = scale * mult
                if hi is not None:
                    cand = min(cand, hi)
                if cand <= FP32_MAX:
                    scale = cand
                good = 0
            else:
                good += 1
        out.append((float(scale), good, not overflow, floor))
    return out


def ref_backoff(flags, smin, smax, factor, window):
    """OpenSeq2Seq BackoffScaler, pre-increment reading of `iteration`."""
    scale, it, last, floor = np.float64(smax), 0, -1, 0
    out = []
    for overflow in flags:
        if overflow:
            if scale <= smin:
                floor += 1
            scale = min(max(scale / factor, smin), smax)
            last = it
        elif (it - last) % window == 0:
            scale = min(max(scale * factor, smin), smax)
        it += 1
        out.append((float(scale), not overflow, floor))
    return out


def ref_logmax(events, smin=1.0, smax=2.0**14, log_max=16.0, b1=0.99, b2=0.999, z=3.09, bug=False,
               log_min=-24.0):
    """OpenSeq2Seq LogMaxScaler in float64. ``events`` = [(overflow, amax)]. With the optkit fixes unless
    ``bug``: overflow sample log_max (bug: 2**log_max), target exponent log_max (bug: 16), amax == 0 (every
    scaled gradient underflowed) grows the scale by 2^(log_max − log_min), clipped, statistics unchanged.
    Returns [(scale, mu, sigma)]."""
    xh = sl = sq = 0.0
    c1 = c2 = 1.0
    scale = min(max(1.0, smin), smax)
    mu = sigma = 0.0
    out = []
    for overflow, amax in events:
        if not bug and not overflow and amax == 0:
            scale = min(max(scale * 2.0 ** (log_max - log_min), smin), smax)
        elif overflow or amax > 0 or bug:
            x = (2.0**log_max if bug else log_max) if overflow else math.log2(amax)
            xh = b1 * xh + (1 - b1) * x
            c1 *= b1
            mu = xh / (1 - c1)
            sl = b2 * sl + (1 - b2) * x
            sq = b2 * sq + (1 - b2) * x * x
            c2 *= b2
            mean_slow = sl / (1 - c2)
            sigma = math.sqrt(max(sq / (1 - c2) - mean_slow**2, 0.0))
            target = 16.0 if bug else log_max
            scale = min(max(2.0 ** (target - (mu + z * sigma)), smin), smax)
        out.append((scale, mu, sigma))
    return out


def drive(scaler: LossScale, flags, amaxes=None):
    """Run update() over a flag sequence; returns [(scale, should_apply)]."""
    out = []
    for k, overflow in enumerate(flags):
        amax = None if amaxes is None else torch.tensor(float(amaxes[k]))
        apply = scaler.update(f(overflow), amax)
        out.append((scaler().item(), bool(apply)))
    return out


# ----------------------------------------------------------------------------------------------------------
# spec vectors


def test_ls1_vector():
    s = DynamicLossScale(initial_loss_scale=4, increment_period=2, multiplier=2)
    finite = [True, True, False, False, False, False, True, True]
    want = [(4, 1), (8, 0), (4, 0), (2, 0), (1, 0), (1, 0), (1, 1), (2, 0)]
    grads_seq = [1.0, 1.0, math.inf, math.nan, math.inf, math.nan, 1.0, 1.0]
    for fin, (scale, good), g in zip(finite, want, grads_seq, strict=True):
        apply = s.update_from_grads([torch.tensor([g, 0.5]), None])
        assert bool(apply) is fin
        assert s().item() == scale and s.good_steps.item() == good
    assert s().dtype == torch.float32 and s.good_steps.dtype == torch.int64


def test_dynamic_growth_overflow_is_skipped():
    s = DynamicLossScale(initial_loss_scale=2.0**127, increment_period=1)
    assert bool(s.update(ZERO))
    assert s().item() == pytest.approx(1.7014118e38, rel=1e-7)
    assert s().item() == 2.0**127 and s.good_steps.item() == 0


def test_dynamic_defaults_and_config():
    s = DynamicLossScale()
    assert s().item() == 32768.0 and s.dynamic and not s.needs_amax
    cfg = s.get_config()
    assert cfg == {"initial_loss_scale": 32768.0, "increment_period": 2000, "multiplier": 2.0,
                   "hysteresis": 1, "min_loss_scale": 1.0, "max_loss_scale": None}
    assert DynamicLossScale.from_config(cfg).get_config() == cfg


def test_fixed_loss_scale():
    s = FixedLossScale(128)
    assert s().item() == 128.0 and not s.dynamic and s.get_config()["loss_scale_value"] == 128.0
    grads = [torch.tensor([math.inf, 1.0])]
    assert bool(s.update_from_grads(grads)) is True  # TF: applies even non-finite gradients
    assert bool(s.update(s.unscale_([torch.tensor([math.nan])]))) is True
    assert s().item() == 128.0
    for bad in (0.5, "8", True, math.inf, math.nan, None, 0):
        with pytest.raises(ValueError, match="loss_scale_value"):
            FixedLossScale(bad)
    with pytest.raises(TypeError, match="skip_non_finite"):
        FixedLossScale(2.0, skip_non_finite=1)
    skip = FixedLossScale(4.0, skip_non_finite=True)
    assert bool(skip.update_from_grads(grads)) is False
    assert bool(skip.update(ZERO)) is True and bool(skip.update(ONE)) is False
    assert FixedLossScale.from_config(skip.get_config()).skip_non_finite


def test_backoff_vector():
    s = BackoffScaler({"scale_min": 1.0, "scale_max": 16.0, "step_factor": 2.0, "step_window": 3})
    flags = [int(c) for c in "0 0 0 1 0 0 0 1 1 0 0 0 0 0 0 0 0 0 0".split()]
    used, after = [], []
    for flag in flags:
        used.append(s().item())
        assert bool(s.update(f(flag))) is (flag == 0)
        after.append(s().item())
    assert used == [16, 16, 16, 16, 8, 8, 8, 16, 8, 4, 4, 4, 8, 8, 8, 16, 16, 16, 16]
    assert after == [16, 16, 16, 8, 8, 8, 16, 8, 4, 4, 4, 8, 8, 8, 16, 16, 16, 16, 16]
    assert s.iteration.item() == 19


def test_backoff_default_facts():
    s = BackoffScaler()
    assert s().item() == 16384.0
    assert s.get_config() == {"params": {"scale_min": 1.0, "scale_max": 16384.0, "step_factor": 2.0,
                                         "step_window": 2000}}
    for _ in range(5):
        s.update(ONE)
    assert s().item() == 512.0
    for _ in range(1999):
        s.update(ZERO)
    assert s().item() == 512.0
    s.update(ZERO)
    assert s().item() == 1024.0
    t = BackoffScaler()
    for _ in range(20):
        t.update(ONE)
    assert t().item() == 1.0


def test_logmax_vectors():
    for amax, want in ((2.0**-10, 16384.0), (16.0, 4096.0)):
        s = LogMaxScaler()
        for _ in range(3):
            assert bool(s.update(ZERO, torch.tensor(amax)))
            assert s().item() == want
    seq = [1.0, 4.0, 0.25, 2.0]
    ref = ref_logmax([(False, a) for a in seq])
    # the reference reproduces the spec's float64 numbers
    np.testing.assert_allclose([r[0] for r in ref], [16384, 3834.905, 1991.340, 2321.136], rtol=2e-7)
    np.testing.assert_allclose([r[1] for r in ref], [0, 1.00503, -0.00673, 0.24876], atol=1e-5)
    np.testing.assert_allclose([r[2] for r in ref], [0, 1.0, 1.63340, 1.47917], atol=1e-5)
    s = LogMaxScaler()
    got = [r[0] for r in drive(s, [0] * 4, seq)]
    # float64 statistics, float32 scale: the fp32 rounding of the scale is the only difference (the original's
    # float32 statistics drift by ~1e-4 relative, spec §6.3)
    np.testing.assert_allclose(got, [r[0] for r in ref], rtol=1e-6)
    assert s.iteration.item() == 4 and s.needs_amax and s.dynamic


def test_logmax_defaults():
    s = LogMaxScaler()
    assert s().item() == 1.0
    assert s.get_config()["params"] == {"scale_min": 1.0, "scale_max": 16384.0, "log_max": 16.0,
                                        "beta1": 0.99, "beta2": 0.999, "overflow_std_dev": 3.09,
                                        "log_min": -24.0}


# ----------------------------------------------------------------------------------------------------------
# LogMax fixes (docs/compatibility.md)


def test_logmax_overflow_sample_fix_recovers_fast():
    events = [(False, 2.0**-4)] * 100 + [(True, math.inf)] + [(False, 2.0**-4)] * 40
    ref = [r[0] for r in ref_logmax(events)]
    buggy = [r[0] for r in ref_logmax(events + [(False, 2.0**-4)] * 11600, bug=True)]
    # the original collapses to scale_min for ~11.5k updates (spec §9 #2); the fix recovers in 18
    assert buggy[101] == 1.0 and buggy[100 + 11532] == 1.0
    assert next(k for k in range(101, len(ref)) if ref[k] == 2.0**14) - 100 == 18
    s = LogMaxScaler()
    got = drive(s, [e[0] for e in events], [e[1] for e in events])
    np.testing.assert_allclose([g[0] for g in got], ref, rtol=1e-5)
    assert got[100][1] is False and all(g[1] for g in got[101:])


def test_logmax_uses_log_max_as_target_exponent():
    s = LogMaxScaler({"log_max": 10.0})
    s.update(ZERO, torch.tensor(2.0**-3))
    # 2^(log_max − log2 amax); the original's hard-coded 16 would give 2^19, clipped to 2^14
    assert s().item() == 2.0**13
    ref = ref_logmax([(False, 2.0**-3)], log_max=10.0)
    assert s().item() == ref[0][0]


def test_logmax_zero_amax_means_underflow_and_the_scale_grows():
    """An all-zero gradient at scale S: every |g|·S fell below float16's smallest subnormal 2^-24, so the
    scale grows by 2^40, clipped (issue #11: LogMax stayed at 1 forever); the statistics do not move."""
    s = LogMaxScaler()
    assert s().item() == 1.0
    before = {k: v.clone() for k, v in s.state_dict().items() if k not in ("config", "scale", "iteration")}
    assert bool(s.update(ZERO, torch.tensor(0.0)))
    assert s().item() == ref_logmax([(False, 0.0)])[0][0] == 2.0**14  # 2^(16 + 24) clipped to scale_max
    after = s.state_dict()
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    seq = [(False, 0.0), (False, 1.0), (False, 0.0), (False, 4.0), (False, 0.0), (False, 0.25)]
    got = drive(LogMaxScaler(), [0] * 6, [a for _, a in seq])
    ref = ref_logmax(seq)
    np.testing.assert_allclose([g[0] for g in got], [r[0] for r in ref], rtol=1e-5)
    assert all(math.isfinite(g[0]) for g in got)


# ----------------------------------------------------------------------------------------------------------
# property tests against the references


@PROP
@given(
    flags=st.lists(st.booleans(), min_size=1, max_size=60),
    init_exp=st.integers(-2, 20),
    period=st.integers(1, 5),
    mult=st.sampled_from([2.0, 4.0, 8.0]),
    hyst=st.integers(1, 4),
    lo_exp=st.integers(-3, 2),
    hi_exp=st.one_of(st.none(), st.integers(20, 24)),
)
def test_dynamic_matches_reference(flags, init_exp, period, mult, hyst, lo_exp, hi_exp):
    lo = 2.0**lo_exp
    init = max(2.0**init_exp, lo)
    hi = None if hi_exp is None else 2.0**hi_exp
    s = DynamicLossScale(init, period, mult, hysteresis=hyst, min_loss_scale=lo, max_loss_scale=hi)
    ref = ref_dynamic(flags, init, period, mult, hyst, lo, hi)
    for overflow, (scale, good, apply, floor) in zip(flags, ref, strict=True):
        assert bool(s.update(f(overflow))) is apply
        got = s().item()
        assert got == scale and s.good_steps.item() == good and s.floor_overflow_count.item() == floor
        assert lo <= got <= (hi if hi is not None else FP32_MAX) and math.isfinite(got) and got > 0


@PROP
@given(
    flags=st.lists(st.booleans(), min_size=1, max_size=60),
    lo_exp=st.integers(-2, 3),
    span=st.integers(0, 8),
    factor=st.sampled_from([2.0, 4.0]),
    window=st.integers(1, 6),
)
def test_backoff_matches_reference(flags, lo_exp, span, factor, window):
    smin, smax = 2.0**lo_exp, 2.0 ** (lo_exp + span)
    s = BackoffScaler({"scale_min": smin, "scale_max": smax, "step_factor": factor, "step_window": window})
    for overflow, (scale, apply, floor) in zip(flags, ref_backoff(flags, smin, smax, factor, window),
                                               strict=True):
        assert bool(s.update(f(overflow))) is apply
        assert s().item() == scale and s.floor_overflow_count.item() == floor
        assert smin <= s().item() <= smax


@PROP
@given(
    events=st.lists(
        st.tuples(st.booleans(), st.one_of(st.just(0.0), st.floats(2.0**-30, 2.0**10))),
        min_size=1, max_size=60,
    ),
    log_max=st.sampled_from([8.0, 16.0, 20.0]),
    z=st.sampled_from([0.0, 1.0, 3.09]),
)
def test_logmax_matches_reference(events, log_max, z):
    params = {"log_max": log_max, "overflow_std_dev": z, "scale_min": 0.5, "scale_max": 2.0**20}
    s = LogMaxScaler(params)
    amaxes = [math.inf if of else a for of, a in events]
    got = drive(s, [of for of, _ in events], amaxes)
    ref = ref_logmax(events, smin=0.5, smax=2.0**20, log_max=log_max, z=z)
    np.testing.assert_allclose([g[0] for g in got], [r[0] for r in ref], rtol=1e-5)
    for (scale, apply), (overflow, _) in zip(got, events, strict=True):
        assert apply is (not overflow)
        assert 0.5 <= scale <= 2.0**20 and math.isfinite(scale)


def test_dynamic_non_power_of_two_multiplier_within_fp32_tolerance():
    rng = np.random.default_rng(3)
    flags = list(rng.random(200) < 0.3)
    s = DynamicLossScale(1000.0, 3, 3.0, min_loss_scale=0.25)
    ref = ref_dynamic(flags, 1000.0, 3, 3.0, lo=0.25)
    got = drive(s, flags)
    np.testing.assert_allclose([g[0] for g in got], [r[0] for r in ref], rtol=1e-5)


def test_hysteresis():
    s = DynamicLossScale(64.0, 3, 2.0, hysteresis=3)
    # two overflows: skipped but the scale is kept
    assert [drive(s, [1])[0] for _ in range(2)] == [(64.0, False), (64.0, False)]
    # a finite step resets the run; then the 3rd consecutive overflow halves, and every later one too
    assert drive(s, [0, 1, 1, 1, 1, 0]) == [(64.0, True), (64.0, False), (64.0, False), (32.0, False),
                                            (16.0, False), (16.0, True)]
    assert drive(s, [1, 1, 1]) == [(16.0, False), (16.0, False), (8.0, False)]


def test_dynamic_max_loss_scale_caps_growth():
    s = DynamicLossScale(4.0, 1, 4.0, max_loss_scale=32.0)
    assert [g[0] for g in drive(s, [0, 0, 0])] == [16.0, 32.0, 32.0]


# ----------------------------------------------------------------------------------------------------------
# unscale_ and the gradient checks


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).numpy().copy()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("scale", [1024.0, 3.0])
def test_unscale_matches_numpy(dtype, scale):
    gen = torch.Generator().manual_seed(7)
    grads = [torch.randn(5, 3, generator=gen).mul(50).to(dtype), None,
             torch.randn(7, generator=gen).to(dtype)]
    before = [None if g is None else _np(g) for g in grads]
    s = FixedLossScale(scale)
    found = s.unscale_(grads)
    assert found.shape == () and found.dtype == torch.float32 and found.item() == 0.0
    assert grads[1] is None
    for g, b in zip(grads, before, strict=True):
        if g is None:
            continue
        assert g.dtype == dtype
        want = b * (1.0 / scale)
        if scale == 1024.0:
            np.testing.assert_array_equal(_np(g), want)  # power of two: exact in every dtype
        else:
            rtol = {torch.float16: 2**-10, torch.bfloat16: 2**-7}.get(dtype, 1e-6)
            np.testing.assert_allclose(_np(g), want, rtol=rtol)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_unscale_found_inf(bad):
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(4, generator=gen), torch.randn(3, generator=gen).half()]
    grads[1][2] = bad
    s = DynamicLossScale(8.0)
    found = s.unscale_(grads)
    assert found.item() == 1.0
    assert not bool(s.update(found)) and s().item() == 4.0


def test_unscale_sparse_coo_grad():
    idx = torch.tensor([[0, 2, 0]])  # duplicate row 0, uncoalesced
    vals = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    g = torch.sparse_coo_tensor(idx, vals, (4, 2), check_invariants=True)
    dense_before = _np(g.to_dense())
    s = FixedLossScale(4.0)
    found = s.unscale_([g, None])
    assert found.item() == 0.0
    np.testing.assert_array_equal(_np(g.to_dense()), dense_before / 4.0)
    bad_vals = torch.tensor([[1.0, 2.0], [math.nan, 4.0], [5.0, 6.0]])
    bad = torch.sparse_coo_tensor(idx, bad_vals, (4, 2), check_invariants=True)
    assert s.unscale_([bad]).item() == 1.0


def test_logmax_unscale_records_amax_and_update_consumes_it():
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(6, generator=gen) * 512, torch.randn(2, 2, generator=gen).half() * 64]
    want = max(np.abs(_np(g)).max() for g in grads) / 512.0
    s = LogMaxScaler({"scale_max": 512.0})
    s.update(ZERO, torch.tensor(2.0**-20))
    assert s().item() == 512.0
    found = s.unscale_(grads)
    assert s.last_amax.item() == pytest.approx(want, rel=1e-6)
    s.update(found)
    assert s.last_amax is None
    with pytest.raises(ValueError, match="needs amax"):
        s.update(ZERO)


def test_update_from_grads_and_check_grads():
    gen = torch.Generator().manual_seed(11)
    a, b = torch.randn(3, generator=gen), torch.randn(2, 2, generator=gen)
    sp = torch.sparse_coo_tensor(torch.tensor([[1, 1]]), torch.tensor([-9.0, 2.0]), (3,),
                                 check_invariants=True)
    has_nan, amax = AutomaticLossScaler.check_grads([(a, "w"), (None, "v"), (b, "u"), (sp, "e")])
    assert has_nan.dtype == torch.bool and not bool(has_nan)
    assert amax.item() == pytest.approx(max(np.abs(_np(a)).max(), np.abs(_np(b)).max(), 9.0))
    has_nan, amax = AutomaticLossScaler.check_grads([a, torch.tensor([1.0, math.nan])])
    assert bool(has_nan)
    has_nan, amax = AutomaticLossScaler.check_grads([torch.tensor([1.0, -math.inf])])
    assert not bool(has_nan) and math.isinf(amax.item())
    has_nan, amax = AutomaticLossScaler.check_grads([])
    assert not bool(has_nan) and amax.item() == 0.0
    s = DynamicLossScale(8.0, 1)
    assert bool(s.update_from_grads([])) and s().item() == 16.0  # empty list counts as finite
    assert bool(s.update_from_grads([None, a])) and s().item() == 32.0
    assert not bool(s.update_from_grads([a, torch.tensor([math.inf])])) and s().item() == 16.0
    assert not bool(s.update_from_grads([torch.tensor([math.nan])])) and s().item() == 8.0
    big = DynamicLossScale(8.0, 1)
    assert bool(big.update_from_grads([torch.tensor([1e30, -3e38])]))  # large but finite gradients apply


def test_nonfinite_amax_counts_as_overflow():
    s = BackoffScaler({"scale_max": 64.0})
    assert not bool(s.update(ZERO, torch.tensor(math.inf))) and s().item() == 32.0


@pytest.mark.parametrize("make", [lambda: DynamicLossScale(8.0), lambda: BackoffScaler({"scale_max": 8.0})])
def test_python_amax_beyond_float32_counts_as_overflow(make):
    """A Python number past float32's range (a float64 max, say) is inf in the float32 state: an overflow,
    not an error from torch."""
    s = make()
    assert not bool(s.update(0.0, 1e39)) and s().item() == 4.0


class _OpLog(TorchDispatchMode):
    """Records the aten ops that read or write any of the watched tensors (by storage)."""

    def __init__(self, watched):
        super().__init__()
        self.ptrs = {t.untyped_storage().data_ptr() for t in watched}
        self.touching: list[str] = []
        self.all: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        name = str(func.overloadpacket.__name__)
        self.all.append(name)
        if any(isinstance(x, torch.Tensor) and not x.is_meta and x.untyped_storage().data_ptr() in self.ptrs
               for x in leaves):
            self.touching.append(name)
        return func(*args, **kwargs)


@pytest.mark.parametrize("make", [lambda: DynamicLossScale(8.0),
                                  lambda: BackoffScaler(),
                                  lambda: AutomaticLossScaler("backoff"),
                                  lambda: FixedLossScale(8.0),
                                  lambda: LogMaxScaler()])
def test_one_pass_over_gradients_and_no_host_sync(make):
    grads = [torch.randn(8, 4) for _ in range(6)] + [None]
    s = make()
    getattr(s, "scaler", s)._state_on_host = lambda: False  # behave as if the state lived on an accelerator
    log = _OpLog([g for g in grads if g is not None])
    with log:
        found = s.unscale_(grads)
        s.update(found)
    expected = ["_amp_foreach_non_finite_check_and_unscale_"]
    if s.needs_amax:
        # LogMax's extra, read-only max-abs pass: one aminmax per gradient on CPU (the CPU inf-norm kernel is
        # ~10x slower), one _foreach_norm(inf) elsewhere
        expected += ["aminmax"] * 6
    assert log.touching == expected
    assert "_local_scalar_dense" not in log.all  # no .item()/float()/bool() on a tensor


# ----------------------------------------------------------------------------------------------------------
# floor warning


def test_floor_warning_on_cpu():
    s = DynamicLossScale(2.0, min_loss_scale=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.update(ONE)  # 2 -> 1: not at the minimum yet
    assert s().item() == 1.0
    with pytest.warns(LossScaleAtMinimumWarning, match="minimum"):
        s.update(ONE)
    assert s.floor_overflow_count.item() == 1 and s().item() == 1.0
    assert issubclass(LossScaleAtMinimumWarning, RuntimeWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.update(ZERO)  # a clean step at the minimum is fine


@pytest.mark.parametrize("make", [lambda: BackoffScaler({"scale_max": 1.0}), lambda: LogMaxScaler(),
                                  lambda: AutomaticLossScaler("LogMax")])
def test_floor_warning_openseq2seq_scalers(make):
    s = make()
    with pytest.warns(LossScaleAtMinimumWarning):
        s.update(ONE, torch.tensor(math.inf))
    assert s.floor_overflow_count.item() == 1


def test_floor_check_interval_on_accelerators():
    s = DynamicLossScale(1.0)
    s._state_on_host = lambda: False
    s.floor_check_interval = 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            s.update(ONE)
    with pytest.warns(LossScaleAtMinimumWarning):
        s.update(ONE)  # the 5th update reads the device counter
    assert s.floor_overflow_count.item() == 5
    s.floor_check_interval = 0  # off
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(10):
            s.update(ONE)


# ----------------------------------------------------------------------------------------------------------
# state_dict round trips


SCALERS = {
    "fixed": lambda: FixedLossScale(16.0, skip_non_finite=True),
    "dynamic": lambda: DynamicLossScale(256.0, 3, 2.0, hysteresis=2, min_loss_scale=0.5,
                                        max_loss_scale=2.0**12),
    "backoff": lambda: BackoffScaler({"scale_max": 256.0, "step_window": 3}),
    "logmax": lambda: LogMaxScaler({"beta1": 0.9}),
    "auto": lambda: AutomaticLossScaler("LogMax", {"scale_max": 1024.0}),
}


def _events(seed, n):
    rng = np.random.default_rng(seed)
    flags = rng.random(n) < 0.25
    amaxes = np.where(flags, np.inf, 2.0 ** rng.uniform(-12, 4, n))
    amaxes[rng.random(n) < 0.1] = 0.0
    return flags, amaxes


def _state(s):
    sd = s.state_dict()
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("name", list(SCALERS))
def test_state_dict_roundtrip_continues_bit_identically(name):
    flags, amaxes = _events(3, 60)
    a = SCALERS[name]()
    drive(a, flags[:30], amaxes[:30])
    sd = a.state_dict()
    b = SCALERS[name]()
    b.load_state_dict(sd)
    for k, v in _state(a).items():
        assert torch.equal(_state(b)[k], v) and _state(b)[k].dtype == v.dtype
    ra = drive(a, flags[30:], amaxes[30:])
    rb = drive(b, flags[30:], amaxes[30:])
    assert ra == rb
    for k, v in _state(a).items():
        assert torch.equal(_state(b)[k], v), k
    assert b.get_config() == a.get_config()


def test_load_state_dict_restores_hyperparameters():
    a = DynamicLossScale(64.0, 7, 4.0, hysteresis=3)
    drive(a, [1, 0, 0])
    b = DynamicLossScale()
    b.load_state_dict(a.state_dict())
    assert b.get_config() == a.get_config()
    assert drive(b, [0] * 10 + [1] * 4) == drive(a, [0] * 10 + [1] * 4)


@pytest.mark.parametrize("name", list(SCALERS))
def test_bad_state_dict_leaves_state_untouched(name):
    flags, amaxes = _events(5, 10)
    s = SCALERS[name]()
    drive(s, flags, amaxes)
    before = _state(s)
    cfg = s.get_config()
    good = s.state_dict()
    bad_dicts = [
        {**good, "bogus": torch.tensor(1.0)},
        {k: v for k, v in good.items() if k != "scale"},
        {**good, "scale": torch.ones(3)},
        {**good, "scale": 2.0},
        {**good, "scale": torch.tensor(4)},  # integer tensor for the float32 scale
        {**good, "config": {"nonsense": 1}},
    ]
    for bad in bad_dicts:
        with pytest.raises((ValueError, TypeError)):
            s.load_state_dict(bad)
        assert all(torch.equal(_state(s)[k], v) for k, v in before.items())
        assert s.get_config() == cfg
    with pytest.raises(TypeError):
        s.load_state_dict([1, 2])


def test_automatic_state_dict_algorithm_mismatch():
    a = AutomaticLossScaler("backoff")
    b = AutomaticLossScaler("logmax")
    with pytest.raises(ValueError, match="algorithm"):
        b.load_state_dict(a.state_dict())
    assert b().item() == 1.0


# ----------------------------------------------------------------------------------------------------------
# validation: every error names the argument and leaves state untouched


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"initial_loss_scale": "8"}, TypeError, "initial_loss_scale"),
        ({"initial_loss_scale": 0.0}, ValueError, "initial_loss_scale"),
        ({"initial_loss_scale": math.inf}, ValueError, "initial_loss_scale"),
        ({"initial_loss_scale": 1e39}, ValueError, "initial_loss_scale"),
        ({"initial_loss_scale": 0.5}, ValueError, "min_loss_scale"),
        ({"increment_period": 0}, ValueError, "increment_period"),
        ({"increment_period": 2.5}, TypeError, "increment_period"),
        ({"increment_period": True}, TypeError, "increment_period"),
        ({"multiplier": 1.0}, ValueError, "multiplier"),
        ({"multiplier": None}, TypeError, "multiplier"),
        ({"hysteresis": 0}, ValueError, "hysteresis"),
        ({"min_loss_scale": 0.0}, ValueError, "min_loss_scale"),
        ({"max_loss_scale": 2.0**10}, ValueError, "max_loss_scale"),
        ({"max_loss_scale": 0.5}, ValueError, "max_loss_scale"),
    ],
)
def test_dynamic_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        DynamicLossScale(**kwargs)


@pytest.mark.parametrize("cls", [BackoffScaler, LogMaxScaler])
@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"scale_min": 1}, "int is not accepted"),
        ({"scale_max": "big"}, "scale_max"),
        ({"scale_min": True}, "scale_min"),
        ({"scale_min": 0.0}, "scale_min"),
        ({"scale_min": 4.0, "scale_max": 2.0}, "scale_max"),
        ({"scale_max": math.inf}, "scale_max"),
        ({"unknown_key": 1.0}, "Unknown parameter 'unknown_key'"),
    ],
)
def test_openseq2seq_param_validation(cls, params, match):
    with pytest.raises(ValueError, match=match):
        cls(params)


@pytest.mark.parametrize(
    ("cls", "params", "exc", "match"),
    [
        (BackoffScaler, {"step_window": 2000.0}, TypeError, "step_window"),
        (BackoffScaler, {"step_window": True}, TypeError, "step_window"),
        (BackoffScaler, {"step_window": 0}, ValueError, "step_window"),
        (BackoffScaler, {"step_factor": 1.0}, ValueError, "step_factor"),
        (BackoffScaler, {"log_max": 16.0}, ValueError, "Unknown parameter 'log_max' in BackoffScaler"),
        (LogMaxScaler, {"beta1": 1.0}, ValueError, "beta1"),
        (LogMaxScaler, {"beta2": -0.1}, ValueError, "beta2"),
        (LogMaxScaler, {"overflow_std_dev": -1.0}, ValueError, "overflow_std_dev"),
        (LogMaxScaler, {"log_max": math.nan}, ValueError, "log_max"),
        (LogMaxScaler, {"log_max": 16}, TypeError, "log_max"),
        (LogMaxScaler, {"step_window": 3}, ValueError, "Unknown parameter 'step_window' in LogMaxScaler"),
        (LogMaxScaler, [("beta1", 0.9)], TypeError, "dict"),
    ],
)
def test_openseq2seq_param_validation_specific(cls, params, exc, match):
    with pytest.raises(exc, match=match):
        cls(params)


def test_params_are_not_mutated_and_logmax_initial_scale_is_clipped():
    params = {"scale_min": 4.0}
    s = LogMaxScaler(params)
    assert params == {"scale_min": 4.0} and s().item() == 4.0


def test_automatic_loss_scaler_surface():
    for name, cls in (("Backoff", BackoffScaler), (" LOGMAX ", LogMaxScaler), ("logmax", LogMaxScaler)):
        a = AutomaticLossScaler(name)
        assert isinstance(a.scaler, cls) and isinstance(a, LossScale)
        assert a.needs_amax is cls.needs_amax
    assert AutomaticLossScaler.SUPPORTED_ALGOS == ["backoff", "logmax"]
    a = AutomaticLossScaler()
    assert a.loss_scale.item() == 16384.0 and a.algorithm == "backoff"
    assert not bool(a.update_op(torch.tensor(True), torch.tensor(1.0))) and a().item() == 8192.0
    assert not bool(a.update_op(torch.tensor(False), torch.tensor(math.inf))) and a().item() == 4096.0
    assert bool(a.update_op(torch.tensor(False), torch.tensor(3.0)))
    assert a.scale_loss(torch.tensor(2.0)).item() == 8192.0
    cfg = a.get_config()
    assert cfg == {"algorithm": "backoff", "params": BackoffScaler().get_config()["params"]}
    assert AutomaticLossScaler.from_config(cfg).get_config() == cfg
    with pytest.raises(ValueError, match="Unknown scaling algorithm 'adam'"):
        AutomaticLossScaler("adam")
    with pytest.raises(TypeError, match="algorithm"):
        AutomaticLossScaler(3)
    with pytest.raises(ValueError, match="scale_max"):
        AutomaticLossScaler("backoff", {"scale_max": 2})


@pytest.mark.parametrize("name", list(SCALERS))
def test_bad_update_arguments_leave_state_untouched(name):
    s = SCALERS[name]()
    drive(s, [0, 1], [1.0, math.inf])
    before = _state(s)
    bad_calls = [
        (("yes",), TypeError),
        ((None,), TypeError),
        ((torch.zeros(3),), ValueError),
        ((ZERO, "amax"), TypeError),
        ((ZERO, torch.ones(2)), ValueError),
    ]
    for args, exc in bad_calls:
        with pytest.raises(exc):
            s.update(*args)
        assert all(torch.equal(_state(s)[k], v) for k, v in before.items())


def test_get_loss_scale():
    assert get_loss_scale(None) is None
    fx = get_loss_scale(128)
    assert isinstance(fx, FixedLossScale) and fx().item() == 128.0
    assert isinstance(get_loss_scale(2.5), FixedLossScale)
    dyn = get_loss_scale(" Dynamic ")
    assert isinstance(dyn, DynamicLossScale) and dyn().item() == 2.0**15
    for name, cls in (("backoff", BackoffScaler), ("LogMax", LogMaxScaler), (" BACKOFF", BackoffScaler)):
        obj = get_loss_scale(name)
        assert isinstance(obj, AutomaticLossScaler) and isinstance(obj.scaler, cls)
    assert get_loss_scale(dyn) is dyn
    for bad in ("static", True, [1.0], {"a": 1}, object()):
        with pytest.raises(ValueError, match="Could not interpret loss scale.*'dynamic', 'backoff'"):
            get_loss_scale(bad)
    with pytest.raises(ValueError, match="at least 1"):
        get_loss_scale(0.5)


def test_scale_loss_snapshot_and_to():
    s = DynamicLossScale(8.0, 1)
    snap = s()
    loss = torch.tensor(3.0, requires_grad=True)
    scaled = s.scale_loss(loss)
    assert scaled.item() == 24.0 and scaled.dtype == torch.float32
    scaled.backward()
    assert loss.grad.item() == 8.0
    half = s.scale_loss(torch.tensor([1.5, 2.0], dtype=torch.float16))
    assert half.dtype == torch.float16 and half.tolist() == [12.0, 16.0]
    s.update(ZERO)
    assert snap.item() == 8.0 and s.loss_scale.item() == 16.0  # snapshots do not follow updates
    with pytest.raises(TypeError, match="loss"):
        s.scale_loss(3.0)
    assert s.to("cpu") is s and s.device.type == "cpu"
    s.to("meta")
    assert s.device.type == "meta" and s._state["good_steps"].device.type == "meta"


def test_base_class_is_abstract():
    with pytest.raises(TypeError):
        LossScale()


def test_public_names():
    for name in ("FixedLossScale", "DynamicLossScale", "BackoffScaler", "LogMaxScaler", "AutomaticLossScaler",
                 "LossScale", "LossScaleAtMinimumWarning", "get_loss_scale"):
        assert hasattr(optkit, name)
    assert "FixedLossScale(loss_scale_value=2.0" in repr(FixedLossScale(2))


def test_logmax_recovers_from_underflowing_float16_gradients():
    """The issue's case: float16 gradients of 1e-9 underflow to 0 at S = 1; LogMax must raise the scale until
    they are representable, and the updates then apply the unscaled gradient."""
    from optkit import SGD, LossScaleOptimizer

    w = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    opt = LossScaleOptimizer(SGD([w], learning_rate=1e6), "logmax")
    for _ in range(3):
        opt.zero_grad()
        loss = (w.float() * 1e-9).sum()
        opt.scale_loss(loss).backward()
        opt.step()
    assert float(opt.loss_scale) > 1.0
    assert float(w[0]) < 0.0  # lr·g = 1e-3 per update once the gradient survives in float16


@pytest.mark.parametrize("name", [*SCALERS, "fixed-tf"])
def test_would_apply_predicts_update_and_changes_nothing(name):
    """``would_apply`` (what wrappers decide a step with before they advance the scale) equals what
    ``update`` then returns, and reads the state without changing it."""
    s = FixedLossScale(16.0) if name == "fixed-tf" else SCALERS[name]()
    flags, amaxes = _events(5, 40)
    for overflow, amax in zip(flags, amaxes):
        found, am = f(overflow), torch.tensor(float(amax))
        before = _state(s)
        predicted = s.would_apply(found, am)
        for k, v in _state(s).items():
            assert torch.equal(v, before[k]), k
        assert bool(predicted) == bool(s.update(found, am))
        if name == "fixed-tf":
            assert bool(predicted)  # TF: a fixed scale applies every step
        else:
            assert bool(predicted) == (not overflow)


def _bad_values(name, good):
    """Entries that must be rejected for scaler ``name`` (key, value, error type, text naming the entry)."""
    meta = torch.empty((), device="meta")
    cases = [
        ("scale", torch.tensor(float("nan")), ValueError, "'scale'"),
        ("scale", torch.tensor(-4.0), ValueError, "'scale'"),
        ("scale", torch.tensor(float("inf")), ValueError, "'scale'"),
        ("scale", torch.tensor(1e300, dtype=torch.float64), ValueError, "'scale'"),
        ("scale", torch.tensor(0.0), ValueError, "'scale'"),
        ("scale", torch.tensor(2.0 + 1j), TypeError, "'scale'"),
        ("scale", meta, ValueError, "'scale'"),
        ("scale", torch.tensor([2.0]).to_sparse(), ValueError, "'scale'"),
    ]
    counters = [k for k, v in good.items() if isinstance(v, torch.Tensor) and not v.is_floating_point()]
    for k in counters:
        low = -2 if k == "last_overflow_iteration" else -1
        cases += [
            (k, torch.tensor(low), ValueError, f"'{k}'"),
            (k, torch.tensor(3 + 0j), TypeError, f"'{k}'"),
            (k, torch.tensor(True), TypeError, f"'{k}'"),
            (k, torch.tensor(2**62), ValueError, f"'{k}'"),
            (k, torch.empty((), dtype=torch.int64, device="meta"), ValueError, f"'{k}'"),
        ]
    if "b1_correction" in good:
        cases += [("b1_correction", torch.tensor(1.5, dtype=torch.float64), ValueError, "'b1_correction'"),
                  ("x_hat", torch.tensor(float("-inf"), dtype=torch.float64), ValueError, "'x_hat'"),
                  ("xsquared_hat", torch.tensor(-1.0, dtype=torch.float64), ValueError, "'xsquared_hat'")]
    cases.append(("config", [1, 2], TypeError, "'config'"))
    return cases


@pytest.mark.parametrize("name", list(SCALERS))
def test_bad_state_values_rejected_atomically(name):
    """Every state value is validated before anything (config or scale) is assigned."""
    flags, amaxes = _events(7, 12)
    src = SCALERS[name]()
    drive(src, flags, amaxes)
    good = src.state_dict()
    s = SCALERS[name]()
    drive(s, flags[:4], amaxes[:4])
    before, cfg = _state(s), s.get_config()
    for key, value, exc, text in _bad_values(name, good):
        # a config that would change the hyperparameters, so a half-done load is visible
        bad = {**good, key: value}
        if key != "config" and "config" in good:
            cfg_bad = dict(good["config"])
            if "params" in cfg_bad:
                cfg_bad["params"] = {**cfg_bad["params"], "scale_max": 512.0}
            else:
                cfg_bad = {**cfg_bad, "max_loss_scale": None} if "max_loss_scale" in cfg_bad else cfg_bad
            bad["config"] = cfg_bad
        with pytest.raises(exc, match=text):
            s.load_state_dict(bad)
        after = _state(s)
        assert set(after) == set(before)
        assert all(torch.equal(after[k], v) and after[k].dtype == v.dtype for k, v in before.items()), key
        assert s.get_config() == cfg
    s.load_state_dict(good)  # still loads and runs, continuing like the source
    assert drive(s, flags, amaxes) == drive(src, flags, amaxes)
