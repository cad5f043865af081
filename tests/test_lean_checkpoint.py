"""Lean-memory modes (``precision`` x ``state_dtype``, :mod:`optkit._core.lean`): nothing lost, nothing
trusted.

* a skipped step (a dynamic loss scale seeing an inf, ``torch.amp.GradScaler`` on the CPU) changes no bit of
  the weights, slots, block scales, split-master low halves, Kahan compensations or the iteration count;
* a resume through ``torch.save``/``torch.load(weights_only=True)`` continues bit for bit (stochastic
  rounding's ``"rounding_step"`` included);
* a checkpoint of one form loads into another: 8-bit → float32 is the exact dequantisation (checked against
  the dynamic map built here in float64 NumPy from Dettmers' formula), float32 → 8-bit quantises (the
  nearest map value of each element over its block's absolute maximum), bfloat16 ↔ float32, a split master
  into Kahan or plain bfloat16 (the low halves dropped);
* hostile state dicts raise ``ValueError`` naming the parameter and the key, and change nothing;
* ``get_config``/``from_config``, bad constructor values, EMA under each precision, ``get_slot`` of an 8-bit
  slot (its values).

Small tensors (a 16 x 320 weight: 16 rows of one full block and a partial one; a 1-d of 4,160: 16 full blocks
and a partial one; a bias of 7 that keeps float32 slots), a few Adam steps (a signed and an unsigned slot).
"""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch

import optkit
from lean_reference import dynamic_map_np
from optkit._core import lowp

PRECISIONS = ["split", "kahan", "stochastic"]
STATES = ["float32", "bfloat16", "int8"]
SHAPES = {"w": (16, 320), "v": (4160,), "b": (7,)}
EXTRA = {"split": "master_low", "kahan": "kahan_comp"}


def params(dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(n, (torch.randn(s, generator=g) * 0.5).to(dtype).requires_grad_()) for n, s in SHAPES.items()]


def grads(k: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(100 + k)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES.values()]


def adam(ps, precision, state_dtype, **kw):
    return optkit.Adam(ps, 0.01, precision=precision, state_dtype=state_dtype, **kw)


def feed(ps, k, scale=1.0):
    for (_, p), g in zip(ps, grads(k)):
        p.grad = (g.float() * scale).to(p.dtype)


def train(opt, ps, steps, start=0, scale=1.0):
    for k in range(start, start + steps):
        feed(ps, k, scale)
        if hasattr(opt, "grads_scaled"):
            opt.grads_scaled = True
        opt.step()


def tensors(x):
    """Every tensor of a (nested) state dict, keys sorted."""
    out = []
    if isinstance(x, torch.Tensor):
        out.append(x.detach().clone())
    elif isinstance(x, dict):
        for k in sorted(x, key=str):
            out += tensors(x[k])
    elif isinstance(x, (list, tuple)):
        for v in x:
            out += tensors(v)
    return out


def snap(ps, opt):
    inner = getattr(opt, "optimizer", opt)
    sd = inner.state_dict()
    return [p.detach().clone() for _, p in ps] + tensors(sd["state"]) + [inner.iterations.clone()]


def bits(x):
    """``x``'s bit pattern (a split master's low halves are raw bits in a bfloat16 tensor: NaN patterns)."""
    return x.contiguous().view(torch.uint8) if x.is_floating_point() and x.dim() > 0 else x


def same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(bits(x), bits(y))


def saved(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def fresh(ps):
    return [(n, p.detach().clone().requires_grad_()) for n, p in ps]


COMBOS = [(p, s) for p in PRECISIONS for s in STATES]
IDS = [f"{p}-{s}" for p, s in COMBOS]


# -------------------------------------------------------------------------------- skips


@pytest.mark.parametrize("precision,state_dtype", COMBOS, ids=IDS)
def test_skipped_step_changes_no_bit_and_resume_continues(precision, state_dtype):
    """A dynamic loss scale sees an inf: weights, every state entry (slots, block scales, master_low,
    kahan_comp) and the count are bitwise as before; the scale halves. Then a resume through torch.save /
    torch.load(weights_only=True) continues bit for bit, the rounding step included."""
    ps = params()
    opt = optkit.LossScaleOptimizer(adam(ps, precision, state_dtype), optkit.DynamicLossScale(256.0))
    train(opt, ps, 2, scale=256.0)
    inner = opt.optimizer
    st = inner.state[ps[0][1]]
    if precision in EXTRA:
        assert EXTRA[precision] in st
    assert st["exp_avg"].dtype == {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                   "int8": torch.uint8}[state_dtype]
    before = snap(ps, opt)
    feed(ps, 9, 256.0)
    ps[0][1].grad.view(-1)[3] = float("inf")
    opt.grads_scaled = True
    opt.step()
    assert not bool(inner.step_applied)
    same(snap(ps, opt), before)
    assert float(opt.loss_scale) == 128.0
    # resume: the saved run and the uninterrupted one continue alike
    ps2 = fresh(ps)
    opt2 = optkit.LossScaleOptimizer(adam(ps2, precision, state_dtype), optkit.DynamicLossScale(256.0))
    opt2.load_state_dict(saved(opt.state_dict()))
    if precision == "stochastic":
        assert opt2.optimizer.state_dict()["rounding_step"] == inner.state_dict()["rounding_step"] == 3
    train(opt, ps, 2, start=2, scale=128.0)
    train(opt2, ps2, 2, start=2, scale=128.0)
    same(snap(ps2, opt2), snap(ps, opt))


@pytest.mark.parametrize("precision,state_dtype", COMBOS, ids=IDS)
def test_gradscaler_skip_on_cpu_with_bfloat16(precision, state_dtype):
    """``torch.amp.GradScaler("cpu")`` over bfloat16 parameters: an overflowing step (found_inf handed to
    the optimizer) changes no bit; a finite one then steps as the unscaled run does."""
    ps = params()
    opt = adam(ps, precision, state_dtype)
    train(opt, ps, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    before = snap(ps, opt)
    loss = sum((p.float() * g.float()).sum() for (_, p), g in zip(ps, grads(5)))
    scaler.scale(loss * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    same(snap(ps, opt), before)
    assert float(scaler.get_scale()) == 2.0**7


# -------------------------------------------------------------------------------- resume


@pytest.mark.parametrize("precision,state_dtype", COMBOS, ids=IDS)
def test_resume_is_bit_identical(precision, state_dtype):
    ps = params()
    opt = adam(ps, precision, state_dtype, rounding_seed=7)
    train(opt, ps, 2)
    sd = saved(opt.state_dict())
    ps2 = fresh(ps)
    opt2 = adam(ps2, precision, state_dtype, rounding_seed=7)
    opt2.load_state_dict(sd)
    train(opt, ps, 2, start=2)
    train(opt2, ps2, 2, start=2)
    same(snap(ps2, opt2), snap(ps, opt))
    if precision == "stochastic":
        assert opt2.state_dict()["rounding_step"] == opt.state_dict()["rounding_step"] == 4


# -------------------------------------------------------------------------------- cross-loading


def blocks_np(x: np.ndarray) -> list[np.ndarray]:
    """Index arrays of the 256-element blocks of ``x`` (within each row along dim 0; 1-d: one row)."""
    rows = x.shape[0] if x.ndim >= 2 else 1
    idx = np.arange(x.size).reshape(rows, -1)
    return [r[i:i + 256] for r in idx for i in range(0, idx.shape[1], 256)]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_int8_checkpoint_loads_into_float32_as_exact_dequantisation(precision):
    ps = params()
    src = adam(ps, precision, "int8")
    train(src, ps, 2)
    sd = saved(src.state_dict())
    dst = adam(fresh(ps), precision, "float32")
    dst.load_state_dict(sd)
    for j, (name, p) in enumerate(ps):
        if p.numel() < 4096:
            continue
        for slot, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            codes = sd["state"][j][slot].numpy().reshape(-1)
            scales = sd["state"][j][f"{slot}_absmax"].numpy().reshape(-1)
            q = dynamic_map_np(signed).astype(np.float32)
            assert q.shape == (256,)
            expect = np.empty(codes.size, dtype=np.float32)
            for b, ix in enumerate(blocks_np(np.empty(p.shape))):
                expect[ix] = q[codes[ix]] * scales[b]
            got = dst.state[dst.param_groups[0]["params"][j]][slot]
            assert got.dtype == torch.float32
            np.testing.assert_array_equal(got.numpy().reshape(-1), expect, err_msg=f"{name} {slot}")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_float32_checkpoint_loads_into_int8_quantised(precision):
    """Each element becomes the nearest value of the map to x/a (a: its block's absolute maximum, or for the
    signed map, which has no −1, max(max x, min x / Q[0])): the dequantised slot is within half the gap
    between the neighbouring map values, times a, of the saved one, and the block scales are exactly that."""
    ps = params()
    src = adam(ps, precision, "float32")
    train(src, ps, 2)
    sd = saved(src.state_dict())
    ps2 = fresh(ps)
    dst = adam(ps2, precision, "int8")
    dst.load_state_dict(sd)
    for j, (name, p) in enumerate(ps2):
        for slot, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            x = sd["state"][j][slot].double().numpy().reshape(-1)
            st = dst.state[p]
            if p.numel() < 4096:
                assert st[slot].dtype == torch.float32 and torch.equal(st[slot], sd["state"][j][slot])
                continue
            assert st[slot].dtype == torch.uint8
            scales = st[f"{slot}_absmax"].double().numpy().reshape(-1)
            got = dst.lean_slot_values(p, slot).double().numpy().reshape(-1)
            q = dynamic_map_np(signed)
            gap = np.max(np.diff(q))
            for b, ix in enumerate(blocks_np(np.empty(p.shape))):
                a = np.float32(np.abs(x[ix]).max())
                if signed:
                    a = max(np.float32(x[ix].max()), np.float32(x[ix].min()) / np.float32(q[0]))
                assert scales[b] == a
                a = float(a)
                # nearest: no map value is closer to x/a than the chosen one (float32 rounding aside)
                r = x[ix] / a
                best = np.abs(r[:, None] - q[None, :]).min(axis=1)
                assert np.all(np.abs(got[ix] / a - r) <= best + 1e-6), f"{name} {slot} {b}"
                assert np.all(np.abs(got[ix] - x[ix]) <= gap / 2 * a + 1e-7)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_bfloat16_and_float32_states_cross_load(precision):
    ps = params()
    a = adam(ps, precision, "bfloat16")
    train(a, ps, 2)
    sd_bf = saved(a.state_dict())
    b = adam(fresh(ps), precision, "float32")
    b.load_state_dict(sd_bf)
    for j, p in enumerate(b.param_groups[0]["params"]):
        for slot in ("exp_avg", "exp_avg_sq"):
            assert b.state[p][slot].dtype == torch.float32
            assert torch.equal(b.state[p][slot], sd_bf["state"][j][slot].float())  # (exact: bf16 ⊂ fp32)
    train(b, b_ps := [(n, p) for (n, _), p in zip(ps, b.param_groups[0]["params"])], 1, start=2)
    sd_fp = saved(b.state_dict())
    c = adam(fresh(b_ps), precision, "bfloat16")
    c.load_state_dict(sd_fp)
    for j, p in enumerate(c.param_groups[0]["params"]):
        for slot in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(c.state[p][slot], sd_fp["state"][j][slot].to(torch.bfloat16))  # nearest


@pytest.mark.parametrize("target", ["kahan", None])
def test_split_checkpoint_into_kahan_or_none_drops_the_low_halves(target):
    """A split master's low halves have no place in another weight format: dropped (the master is then
    the bfloat16 weight); a Kahan target starts with a zero compensation; the slots load as they were."""
    ps = params()
    src = adam(ps, "split", None)
    train(src, ps, 2)
    sd = saved(src.state_dict())
    assert all("master_low" in e for e in sd["state"].values())
    ps2 = fresh(ps)
    dst = optkit.Adam(ps2, 0.01, precision=target)
    dst.load_state_dict(sd)
    for j, (_, p) in enumerate(ps2):
        st = dst.state[p]
        assert "master_low" not in st
        if target == "kahan":
            assert st["kahan_comp"].dtype == torch.bfloat16 and not st["kahan_comp"].any()
            assert torch.equal(st["exp_avg"], sd["state"][j]["exp_avg"])
        else:  # plain bfloat16 Adam: its slots are bfloat16 (torch's load casts to the parameter's dtype)
            assert torch.equal(st["exp_avg"], sd["state"][j]["exp_avg"].to(torch.bfloat16))
        assert torch.equal(p, ps[j][1])
    train(dst, ps2, 1, start=2)
    assert all(torch.isfinite(p).all() for _, p in ps2)


# -------------------------------------------------------------------------------- hostile


def _entry(sd, j=0):
    return sd["state"][j]


def _set(key, value):
    def fn(sd):
        _entry(sd)[key] = value(_entry(sd)) if callable(value) else value
    return fn


def _drop(key):
    def fn(sd):
        del _entry(sd)[key]
    return fn


HOSTILE = {
    "codes-shape": ("int8", "exp_avg", _set("exp_avg", lambda e: e["exp_avg"].reshape(-1)[:100].clone())),
    "missing-absmax": ("int8", "exp_avg", _drop("exp_avg_absmax")),
    "scales-shape": ("int8", "exp_avg_absmax", _set("exp_avg_absmax", lambda e: e["exp_avg_absmax"][:3])),
    "scales-dtype": ("int8", "exp_avg_absmax",
                     _set("exp_avg_absmax", lambda e: e["exp_avg_absmax"].double())),
    "scales-negative": ("int8", "exp_avg_absmax",
                        _set("exp_avg_absmax", lambda e: e["exp_avg_absmax"].clone().index_fill_(
                            1, torch.tensor([0]), -1.0))),
    "scales-nan": ("int8", "exp_avg_sq_absmax",
                   _set("exp_avg_sq_absmax", lambda e: e["exp_avg_sq_absmax"].clone().index_fill_(
                       1, torch.tensor([1]), float("nan")))),
    "master_low-int32": ("split", "master_low", _set("master_low", lambda e: e["master_low"].int())),
    "master_low-float": ("split", "master_low", _set("master_low", lambda e: e["master_low"].float())),
    "kahan_comp-shape": ("kahan", "kahan_comp", _set("kahan_comp", lambda e: e["kahan_comp"][:2])),
}


@pytest.mark.parametrize("what", sorted(HOSTILE))
def test_hostile_state_dicts_raise_naming_parameter_and_key(what):
    form, key, corrupt = HOSTILE[what]
    precision = form if form in PRECISIONS else "stochastic"
    state_dtype = "int8" if form == "int8" else None
    ps = params()
    opt = adam(ps, precision, state_dtype)
    train(opt, ps, 1)
    sd = copy.deepcopy(opt.state_dict())
    corrupt(sd)
    before = snap(ps, opt)
    with pytest.raises(ValueError, match=f"(?s)(?=.*'w')(?=.*{key})"):
        opt.load_state_dict(sd)
    same(snap(ps, opt), before)
    train(opt, ps, 1, start=1)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_hostile_rounding_step_is_refused(bad):
    ps = params()
    opt = adam(ps, "stochastic", "int8")
    train(opt, ps, 1)
    sd = copy.deepcopy(opt.state_dict())
    sd["rounding_step"] = bad
    before = snap(ps, opt)
    with pytest.raises(ValueError, match="rounding_step"):
        opt.load_state_dict(sd)
    same(snap(ps, opt), before)
    assert opt.state_dict()["rounding_step"] == 1


# -------------------------------------------------------------------------------- config, args


@pytest.mark.parametrize("precision,state_dtype", COMBOS, ids=IDS)
def test_config_round_trip(precision, state_dtype):
    ps = params()
    opt = optkit.LAMB(ps, 0.01, precision=precision, state_dtype=state_dtype, rounding_seed=11)
    cfg = opt.get_config()
    assert (cfg["precision"], cfg["state_dtype"], cfg["rounding_seed"]) == (precision, state_dtype, 11)
    again = optkit.LAMB.from_config(cfg, fresh(ps))
    assert (again.precision, again.state_dtype, again.rounding_seed) == (precision, state_dtype, 11)
    assert again.get_config() == cfg
    plain = optkit.LAMB(fresh(ps), 0.01).get_config()
    assert "precision" not in plain  # (configs of optimizers without the options stay as they were)


@pytest.mark.parametrize("kw,arg", [({"precision": "fp16"}, "precision"),
                                    ({"precision": "bf16"}, "precision"),
                                    ({"state_dtype": "int4"}, "state_dtype"),
                                    ({"state_dtype": torch.float16}, "state_dtype"),
                                    ({"rounding_seed": -1}, "rounding_seed"),
                                    ({"rounding_seed": 1.0}, "rounding_seed")])
def test_bad_constructor_values_name_the_argument(kw, arg):
    with pytest.raises(ValueError, match=arg):
        optkit.SGD(params(), learning_rate=0.1, **kw)


def test_precision_over_float16_parameters_is_refused():
    with pytest.raises(ValueError, match="precision"):
        optkit.Adam(params(torch.float16), 0.01, precision="split")
    optkit.Adam(params(torch.float16), 0.01, state_dtype="int8")  # (slots alone: any dtype)


# -------------------------------------------------------------------------------- EMA, get_slot


@pytest.mark.parametrize("precision", PRECISIONS)
def test_ema_follows_the_weights_under_each_precision(precision):
    """``use_ema``: a master-free weight's average is float32 and follows the weight the optimizer holds
    (float64 reference from the recorded values: the first update copies w, then avg ← m·avg + (1 − m)·w,
    Keras): the split master exactly (float32 roundings aside), Kahan's ``p + c``, and for stochastic
    rounding the unrounded result, which the bfloat16 weight the model sees is within an ulp of. Inside
    ``ema_weights()`` the weights hold the averages rounded to bfloat16."""
    ps = params()
    opt = optkit.SGD(ps, learning_rate=0.1, momentum=0.9, precision=precision, state_dtype="int8",
                     use_ema=True, ema_momentum=0.8)
    ref = None
    for k in range(4):
        feed(ps, k)
        opt.step()
        ws = []
        for _, p in ps:
            st = opt.state[p]
            if precision == "split":
                ws.append(lowp.split_decode(p.detach(), st["master_low"]).double())
            elif precision == "kahan":
                ws.append(p.detach().double() + st["kahan_comp"].double())
            else:
                ws.append(p.detach().double())
        ref = ws if ref is None else [0.8 * a + 0.2 * w for a, w in zip(ref, ws)]
    tol = {"split": (1e-6, 1e-7), "kahan": (1e-6, 1e-7), "stochastic": (2 ** -7, 2 ** -9)}[precision]
    for (n, p), a in zip(ps, ref):
        got = opt.state[p]["average"]
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), a, rtol=tol[0], atol=tol[1], msg=n)
    with opt.ema_weights():  # swap in and out
        assert all(torch.equal(p, opt.state[p]["average"].to(p.dtype)) for _, p in ps)


def test_get_slot_of_an_int8_slot_gives_its_values():
    """Keras' ``get_slot`` gives a slot's values: an 8-bit slot comes back decoded (float32, the
    parameter's shape; a copy), a float one as the stored tensor."""
    ps = params()
    opt = adam(ps, "split", "int8")
    train(opt, ps, 2)
    w, b = ps[0][1], ps[2][1]
    got = opt.get_slot(w, "exp_avg")
    assert got.dtype == torch.float32 and got.shape == w.shape
    assert torch.equal(got, opt.lean_slot_values(w, "exp_avg"))
    assert opt.get_slot(b, "exp_avg") is opt.state[b]["exp_avg"]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_ema_overwrite_makes_the_average_the_master(precision):
    """``ema_overwrite_frequency``: every f applied steps the weight becomes its average; a master-free
    weight's float32 average becomes its master (split: both halves, exactly; Kahan: the rounded weight
    and its residual; stochastic: the average rounded to nearest)."""
    ps = params()
    opt = optkit.SGD(ps, learning_rate=0.1, momentum=0.9, precision=precision, use_ema=True,
                     ema_momentum=0.5, ema_overwrite_frequency=2)
    for k in range(2):
        feed(ps, k)
        opt.step()
    for n, p in ps:
        st = opt.state[p]
        avg = st["average"]
        if precision == "split":
            assert torch.equal(lowp.split_decode(p.detach(), st["master_low"]), avg), n
        elif precision == "kahan":
            torch.testing.assert_close(p.detach().double() + st["kahan_comp"].double(), avg.double(),
                                       rtol=2 ** -15, atol=0.0, msg=n)
        else:
            assert torch.equal(p.detach(), avg.to(torch.bfloat16)), n
