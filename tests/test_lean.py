"""Lean-memory precision for every registry optimizer (``precision=`` and ``state_dtype=``), checked against
independent references:

* ``precision="split"`` (float32 state): the decoded master (high half the bf16 weight, low half
  ``master_low``; Zamirai et al. 2020) is bit for bit the same optimizer's float32 parameter fed the same
  bf16-valued gradients, with and without a dynamic loss scale, ``clipnorm``, ``global_clipnorm`` and
  ``clipvalue``.
* ``precision="kahan"`` / ``"stochastic"``: drift from a float64 run of the same optimizer (the fp32
  trajectory without its roundings) within bounds derived in each test's docstring, and both beat plain bf16
  weights (round to nearest each step) on a long run of updates smaller than half an ulp.
* ``state_dtype="bfloat16"`` / ``"int8"`` on float32 parameters: drift of the slots and weights from the
  float32 state run within stated bounds; the 8-bit first step is exactly the block-wise quantisation
  (Dettmers et al. 2022) of the float32 slots, with the unsigned map for second moments and accumulators.
* stochastic rounding is reproducible from ``rounding_seed``.

``ulp(x)`` below is the bfloat16 spacing at ``|x|``: ``2^(⌊log2|x|⌋ − 7)``; ``M`` an element's largest
magnitude over both trajectories (its rounding errors are at most ``ulp(M)``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from optkit import (
    LAMB,
    LARS,
    SGD,
    Adagrad,
    Adam,
    AdamW,
    Ftrl,
    Lion,
    LossScaleOptimizer,
    Momentum,
    RMSProp,
)
from optkit._core import lowp
from optkit.loss_scale import DynamicLossScale
from scaled_grads import scaled_step

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
SHAPES = [(64, 128), (64,), (32, 3, 3, 3)]

CONFIGS = {
    "sgd": (SGD, dict(learning_rate=0.1)),
    "sgd_momentum": (SGD, dict(learning_rate=0.1, momentum=0.9)),
    "sgd_nesterov_wd": (SGD, dict(learning_rate=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "momentum": (Momentum, dict(learning_rate=0.1, momentum=0.9)),
    "adam": (Adam, dict(learning_rate=1e-2)),
    "adam_amsgrad": (Adam, dict(learning_rate=1e-2, amsgrad=True)),
    "adamw": (AdamW, dict(learning_rate=1e-2, weight_decay=0.1)),
    "lamb": (LAMB, dict(learning_rate=1e-2, weight_decay=0.01)),
    "lars": (LARS, dict(learning_rate=0.1)),
    "adagrad": (Adagrad, dict(learning_rate=0.1)),
    "rmsprop": (RMSProp, dict(learning_rate=1e-2, momentum=0.9)),
    "rmsprop_centered": (RMSProp, dict(learning_rate=1e-2, centered=True)),
    "ftrl": (Ftrl, dict(learning_rate=0.1, l1_regularization_strength=1e-3, l2_regularization_strength=1e-2)),
    "lion": (Lion, dict(learning_rate=1e-3, weight_decay=0.1)),
}
#: the slots each optimizer keeps never negative (stored with the unsigned 8-bit map); the others signed
UNSIGNED = {"adam": {"exp_avg_sq"}, "adam_amsgrad": {"exp_avg_sq", "max_exp_avg_sq"}, "adamw": {"exp_avg_sq"},
            "lamb": {"exp_avg_sq"}, "adagrad": {"sum"}, "rmsprop": {"rms"}, "rmsprop_centered": {"rms"},
            "ftrl": {"accum"}}


def _problem(seed: int, steps: int, shapes=SHAPES, spread: bool = False):
    """Initial weights (bf16-representable) and per-step gradients (bf16-valued), as float32 NumPy arrays."""
    rng = np.random.default_rng(seed)
    ws = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    ws = [torch.from_numpy(w).to(BF16).float().numpy() for w in ws]
    gs = []
    for _ in range(steps):
        step = []
        for s in shapes:
            g = rng.standard_normal(s) * 0.1
            if spread:  # magnitudes over a few decades (8-bit blocks see small values beside large ones)
                g = g * np.exp(rng.uniform(-3, 0, s))
            step.append(torch.from_numpy(g.astype(np.float32)).to(BF16).float().numpy())
        gs.append(step)
    return ws, gs


def _params(ws, dtype):
    return [torch.tensor(w, dtype=dtype, requires_grad=True) for w in ws]


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """bfloat16 spacing at |x| (float64)."""
    return torch.exp2(torch.floor(torch.log2(x.double().abs().clamp_min(1e-30))) - 7)


def _run(name, dtype, gs, ws, hp=None, track=False, loss_scale=False, inf_at=None, **kw):
    """Run optimizer ``name`` on parameters of ``dtype`` over the gradients ``gs``; returns (optimizer,
    params, running max |w| per param)."""
    cls, base = CONFIGS[name]
    ps = _params(ws, dtype)
    opt = cls(ps, **(hp or base), **kw)
    outer = LossScaleOptimizer(opt, DynamicLossScale(2.0 ** 10, increment_period=2)) if loss_scale else opt
    mx = [p.detach().double().abs() for p in ps]
    for t, g in enumerate(gs):
        s = float(outer.loss_scale) if loss_scale else 1.0
        for p, x in zip(ps, g):
            gt = torch.from_numpy(x).to(BF16) * s  # (a power of two: exact)
            if t == inf_at:
                gt.view(-1)[0] = float("inf")
            p.grad = gt.to(dtype)
        scaled_step(outer) if loss_scale else outer.step()
        if track:
            mx = [torch.maximum(m, p.detach().double().abs()) for m, p in zip(mx, ps)]
    return opt, ps, mx


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


# --------------------------------------------------------------------------------------- split: bit for bit

@pytest.mark.parametrize("variant", ["plain", "loss_scale", "clipnorm", "global_clipnorm", "clipvalue",
                                     "loss_scale_clipnorm"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_split_master_is_the_fp32_run(name, variant):
    """4 steps (5 under the loss scale, one of them with an inf gradient: skipped, the scale backs off): the
    decoded master ``split_decode(p, master_low)`` and every slot equal the float32 run's bit for bit; the
    bf16 weight is the master truncated toward zero."""
    kw = {"clipnorm": dict(clipnorm=0.5), "global_clipnorm": dict(global_clipnorm=0.5),
          "clipvalue": dict(clipvalue=0.05), "loss_scale_clipnorm": dict(clipnorm=0.5)}.get(variant, {})
    ls = variant.startswith("loss_scale")
    ws, gs = _problem(0, 5 if ls else 4)
    extra = dict(loss_scale=ls, inf_at=2 if ls else None, **kw)
    o32, p32, _ = _run(name, F32, gs, ws, **extra)
    ob, pb, _ = _run(name, BF16, gs, ws, precision="split", **extra)
    for p, q in zip(pb, p32):
        st = ob.state[p]
        assert p.dtype == BF16 and st["master_low"].dtype == torch.bfloat16
        master = lowp.split_decode(p.detach(), st["master_low"])
        assert torch.equal(_bits(master), _bits(q)), name
        assert torch.equal(_bits(p.float()), _bits(q) & ~0xFFFF)  # the high half: truncated toward zero
        for slot, v in o32.state[q].items():
            if slot != "step" and torch.is_tensor(v):
                assert st[slot].dtype == F32
                assert torch.equal(_bits(ob.lean_slot_values(p, slot)), _bits(v)), (name, slot)
    assert not torch.equal(pb[0].float(), torch.from_numpy(ws[0]))  # (it moved)


# ------------------------------------------------------------------------------------------ Kahan, stochastic

N_DRIFT = 20


@pytest.mark.parametrize("name", list(CONFIGS))
def test_kahan_and_stochastic_drift_from_float64(name):
    """20 steps against the same optimizer on float64 parameters (the fp32 trajectory without roundings), per
    element, with ``M`` its largest magnitude over both runs:

    * Kahan: the bf16 weight ``p`` is the compensated sum ``p + c`` rounded to nearest, so
      ``|p − w64| ≤ (1/2 + N·2^-9 + 2^-8)·ulp(M)``: half an ulp for that rounding, and what ``c`` itself loses
      each step by its own bf16 rounding (``|c| ≤ ulp/2``: at most ``2^-9·ulp``), plus the double rounding
      fp32→bf16 (``2^-8``). FTRL recomputes its weight from its accumulators rather than adding an update:
      the previous step's residual ``c`` (up to ``ulp/2``) is then added to a fresh value, so its bound is
      ``(1 + N·2^-9 + 2^-8)·ulp(M)``. Measured: 0.506 ulp (FTRL 0.992); bounds 0.543 and 1.043.
    * stochastic: each step's rounding error is below one ulp of the value, unbiased and independent, so
      ``|p − w64| ≤ N·ulp(M)`` (no compensation; the rules' updates do not depend on the weight but through
      decay and trust ratios, which do not amplify), and their root mean square over a tensor is about
      ``√(N/6)·ulp`` (variance ``f(1−f)·ulp²`` per step for a fraction ``f`` uniform in [0, 1)): checked
      ``≤ 1.5·√(N/6)`` = 2.74. Measured: max 7.7 ulp (bound 20), rms ≤ 1.90 (√(20/6) = 1.83)."""
    ws, gs = _problem(1, N_DRIFT)
    _, p64, m64 = _run(name, F64, gs, ws, track=True)
    n = N_DRIFT
    for mode in ("kahan", "stochastic"):
        _, pb, mb = _run(name, BF16, gs, ws, track=True, precision=mode)
        for p, r, ma, mr in zip(pb, p64, mb, m64):
            err = (p.detach().double() - r.detach()).abs() / _ulp(torch.maximum(ma, mr))
            if mode == "kahan":
                lead = 1.0 if name == "ftrl" else 0.5
                assert err.max() <= lead + n * 2.0 ** -9 + 2.0 ** -8, (name, err.max())
            else:
                assert err.max() <= n, (name, err.max())
                assert err.square().mean().sqrt() <= 1.5 * (n / 6) ** 0.5, name


#: hyperparameters giving steady updates of 0.1–0.45 ulp for weights of magnitude in [1, 2) (ulp 2^-7) under
#: gradients of one sign per element: each is below half an ulp, so a bf16 weight rounded to nearest stalls
SMALL = {
    "sgd": dict(learning_rate=3e-2),
    "sgd_momentum": dict(learning_rate=3e-3, momentum=0.9),
    "sgd_nesterov_wd": dict(learning_rate=3e-3, momentum=0.9, nesterov=True, weight_decay=0.01),
    "momentum": dict(learning_rate=3e-3, momentum=0.9),
    "adam": dict(learning_rate=3e-3),
    "adam_amsgrad": dict(learning_rate=3e-3, amsgrad=True),
    "adamw": dict(learning_rate=3e-3, weight_decay=0.1),
    "lamb": dict(learning_rate=2e-3, weight_decay=0.01),
    "lars": dict(learning_rate=0.2),
    "adagrad": dict(learning_rate=1e-2),
    "rmsprop": dict(learning_rate=4e-4, momentum=0.9),
    "rmsprop_centered": dict(learning_rate=1e-3, centered=True),
    "lion": dict(learning_rate=3e-3, weight_decay=0.1),
}
N_LONG = 60


@pytest.mark.parametrize("name", list(SMALL))
def test_kahan_and_stochastic_beat_plain_bf16_on_small_updates(name):
    """60 steps of sub-half-ulp updates (:data:`SMALL`) on weights of magnitude in [1, 2): plain bf16
    weights (``precision=None``, float32 state, so only the weight format differs) stall: their mean error
    is at least half the float64 run's displacement (measured 0.59 for SGD, whose noisier updates sometimes
    pass half an ulp; 0.97–1.00 for the others). Kahan stays within ``(1/2 + N·2^-9 + 2^-8)`` ulp of the
    float64 run (mean error ≤ 5% of plain's; measured 0.9–4.6%, max 0.505 ulp); stochastic rounding has only
    its random walk, about ``√(N·ulp·u)`` for updates ``u`` (mean error ≤ 40% of plain's; measured 11–28%).
    FTRL is not here: its weight is recomputed each step, nothing accumulates in it to stall."""
    rng = np.random.default_rng(2)
    shapes = [(16, 16), (16,)]
    ws = [(np.sign(rng.standard_normal(s)) * rng.uniform(1, 2, s)).astype(np.float32) for s in shapes]
    ws = [torch.from_numpy(w).to(BF16).float().numpy() for w in ws]
    sign = [np.sign(rng.standard_normal(s)) for s in shapes]
    gs = [[torch.from_numpy((0.1 * sg * (1 + 0.3 * rng.standard_normal(sg.shape))).astype(np.float32))
           .to(BF16).float().numpy() for sg in sign] for _ in range(N_LONG)]
    _, p64, m64 = _run(name, F64, gs, ws, hp=SMALL[name], track=True)
    disp = np.mean([(r.detach() - torch.from_numpy(w).double()).abs().mean().item() for r, w in zip(p64, ws)])
    err = {}
    for mode in ("kahan", "stochastic", None):
        _, pb, mb = _run(name, BF16, gs, ws, hp=SMALL[name], track=True, precision=mode,
                         state_dtype="float32")
        err[mode] = np.mean([(p.detach().double() - r.detach()).abs().mean().item() for p, r in zip(pb, p64)])
        if mode == "kahan":
            for p, r, ma, mr in zip(pb, p64, mb, m64):
                e = (p.detach().double() - r.detach()).abs() / _ulp(torch.maximum(ma, mr))
                assert e.max() <= 0.5 + N_LONG * 2.0 ** -9 + 2.0 ** -8, name
    assert err[None] >= 0.5 * disp, (name, err, disp)  # plain bf16 stalls
    assert err["kahan"] <= 0.05 * err[None], (name, err)
    assert err["stochastic"] <= 0.4 * err[None], (name, err)


@pytest.mark.parametrize("name", ["adam", "sgd_momentum", "lion"])
def test_stochastic_rounding_reproducible(name):
    """The same ``rounding_seed`` gives the same bf16 weights bit for bit; another seed other ones."""
    ws, gs = _problem(3, 3)
    runs = [_run(name, BF16, gs, ws, precision="stochastic", rounding_seed=s)[1] for s in (5, 5, 6)]
    same = [torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(runs[0], runs[1])]
    assert all(same)
    assert not torch.equal(runs[0][0].view(torch.int16), runs[2][0].view(torch.int16))


# ------------------------------------------------------------------------------------- low-precision state

N_STATE = 10
#: half the largest gap between neighbouring values of the 8-bit map (relative to the block maximum): the
#: top decade holds 64 values over [0.1, 1] signed, 128 unsigned
HALF_GAP = {True: 0.9 / 64 / 2, False: 0.9 / 128 / 2}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_first_int8_step_is_the_quantised_fp32_state(name):
    """One step from fresh state (every slot starts exactly representable: 0, or Adagrad/FTRL's 0.1 and
    RMSProp's 1 as ``Q[1]·a``): the weights equal the float32-state run's bit for bit, and each 8-bit slot of
    the (64, 128) weight is exactly the block-wise quantisation of the float32 run's slot, with the unsigned
    map for the slots in :data:`UNSIGNED` (decoded ≥ 0) and the signed one for the rest; the 1-d and conv
    weights (< 4,096 elements) and FTRL's ``linear`` keep float32."""
    ws, gs = _problem(4, 1, spread=True)
    o32, p32, _ = _run(name, F32, gs, ws)
    o8, p8, _ = _run(name, F32, gs, ws, state_dtype="int8")
    for p, q in zip(p8, p32):
        assert torch.equal(_bits(p), _bits(q)), name
    big, ref = p8[0], p32[0]
    st = o8.state[big]
    for slot, v in o32.state[ref].items():
        if slot == "step" or not torch.is_tensor(v):
            continue
        if slot == "linear":
            assert st[slot].dtype == F32 and torch.equal(st[slot], v)
            continue
        signed = slot not in UNSIGNED.get(name, set())
        assert st[slot].dtype == torch.uint8 and st[lowp_scales(slot)].shape == (64, 1), (name, slot)
        codes, scales = lowp.quantize(v, signed)
        assert torch.equal(st[slot], codes) and torch.equal(st[lowp_scales(slot)], scales), (name, slot)
        dq = o8.lean_slot_values(big, slot)
        assert torch.equal(dq, lowp.dequantize(codes, scales, signed))
        if not signed:
            assert (dq >= 0).all()
    for p in p8[1:]:
        assert all(t.dtype == F32 for k, t in o8.state[p].items() if k != "step" and torch.is_tensor(t))


def lowp_scales(slot: str) -> str:
    return f"{slot}_absmax"


def test_unsigned_map_keeps_small_second_moments():
    """Adam's ``exp_avg_sq`` after one step, rows with one large gradient and the rest 10–100× smaller (second
    moments 1e-4–1e-2 of the block maximum): the unsigned map it is kept with reads the small entries back
    with less than 60% of the error the signed map would give (twice the values per decade)."""
    rng = np.random.default_rng(6)
    g = (rng.choice([-1, 1], (64, 128)) * rng.uniform(0.01, 0.1, (64, 128))).astype(np.float32)
    g[:, 0] = 1.0
    w = rng.standard_normal((64, 128)).astype(np.float32)
    out = {}
    for sd in ("float32", "int8"):
        p = torch.tensor(w, requires_grad=True)
        opt = Adam([p], 1e-3, state_dtype=sd)
        p.grad = torch.from_numpy(g)
        opt.step()
        out[sd] = opt.lean_slot_values(p, "exp_avg_sq")
    v = out["float32"]
    signed = lowp.dequantize(*lowp.quantize(v, True), True)
    small = torch.ones_like(v, dtype=torch.bool)
    small[:, 0] = False
    e_unsigned = ((out["int8"] - v).abs() / v)[small].mean()
    e_signed = ((signed - v).abs() / v)[small].mean()
    assert e_unsigned < 0.6 * e_signed, (e_unsigned, e_signed)


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_low_precision_state_drift(name, state_dtype):
    """10 steps on float32 parameters against the same optimizer with float32 state. Slots of the (64, 128)
    weight, relative to their row's (= block's) maximum magnitude ``a``:

    * bfloat16: each write rounds a slot by at most ``2^-9`` relative; a slot carries at most ``N`` of those
      writes, each decayed with the slot itself (EMAs, ``β ≤ 1``), so ``|s − s32| ≤ N·2^-9·a`` (1.95%;
      measured ≤ 0.94% signed, 1.69% unsigned).
    * int8: each write is off by at most half the map's largest relative gap (0.70% of ``a`` signed, 0.35%
      unsigned), so ``|s − s32| ≤ N·h·a`` (7.0% / 3.5%; measured ≤ 5.8% / 2.0%). FTRL's ``linear`` stays
      float32; the accumulator's error reaches it through ``σ`` (checked ≤ 1% of ``a``; measured 0.21%).

    Weights: ``|w − w32| ≤ ε·max|w32 − w0|`` with ε = 1% (bfloat16) and 6% (int8) for these data (measured ≤
    0.50% and 4.6%); Lion's update is ``lr·sign(c)``, and a small slot error flips a sign near ``c = 0``: its
    bound is the flip of every step, ``2·lr·N`` per element (measured 10% of it with bfloat16 state, 20%
    with int8)."""
    ws, gs = _problem(7, N_STATE, spread=True)
    o32, p32, _ = _run(name, F32, gs, ws)
    o, ps, _ = _run(name, F32, gs, ws, state_dtype=state_dtype)
    p, q = ps[0], p32[0]
    for slot, v in o32.state[q].items():
        if slot == "step" or not torch.is_tensor(v):
            continue
        a = v.abs().amax(dim=1, keepdim=True)
        e = ((o.lean_slot_values(p, slot) - v).abs() / a).max().item()
        if slot == "linear":
            bound = 1e-2  # (the accumulator's error enters it through σ = (√n_new − √n)/lr)
        elif state_dtype == "bfloat16":
            bound = N_STATE * 2.0 ** -9
        else:
            bound = N_STATE * HALF_GAP[slot not in UNSIGNED.get(name, set())]
        assert e <= bound, (name, slot, e, bound)
    lr = CONFIGS[name][1]["learning_rate"]
    for p, q, w0 in zip(ps, p32, ws):
        drift = (p.detach() - q.detach()).abs().max().item()
        if name == "lion":
            assert drift <= 2 * lr * N_STATE * (1 + 1e-3)
        else:
            disp = (q.detach() - torch.from_numpy(w0)).abs().max().item()
            assert drift <= (0.01 if state_dtype == "bfloat16" else 0.06) * disp, (name, drift / disp)
