"""MixedPrecisionOptimizerWrapper's precision= and state_dtype= (master-free bfloat16 weights, low-precision
slots) and the engine's set_lean conversion of state already built."""

from __future__ import annotations

import io

import pytest
import torch

import optkit
from lean_reference import same_bits
from optkit import MixedPrecisionOptimizerWrapper as MPW
from optkit._core import lowp

MODES = ("fp32-masters", "split", "kahan", "stochastic")


def _params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(64, 128, generator=g).bfloat16().requires_grad_(),
            torch.randn(4096, generator=g).bfloat16().requires_grad_(),
            torch.randn(32, generator=g).requires_grad_()]  # an fp32 parameter beside the bf16 ones


def _grads(ps: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in ps]


def _set_grads(ps, gs) -> None:
    for p, g in zip(ps, gs):
        p.grad = g.clone()


def _master(opt: optkit.Optimizer, p: torch.Tensor) -> torch.Tensor:
    return lowp.split_decode(p.detach(), opt.state[p]["master_low"])


def test_split_wrapper_follows_the_fp32_run_bit_for_bit():
    ps = _params()
    ref = [p.detach().float().clone().requires_grad_() for p in ps]
    inner = optkit.SGD(ps, learning_rate=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)
    mp = MPW(inner, precision="split")
    fp32 = optkit.SGD(ref, learning_rate=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)
    assert mp.master_params == [] and mp.param_groups[0]["params"][0] is ps[0]  # no masters
    for step in range(4):
        gs = _grads(ps, step)
        _set_grads(ps, gs)
        _set_grads(ref, [g.float() for g in gs])
        mp.step()
        fp32.step()
        mp.zero_grad()
        fp32.zero_grad()
    for p, r in zip(ps[:2], ref[:2]):
        assert torch.equal(_master(inner, p), r.detach())
        assert p.dtype == torch.bfloat16
    assert torch.equal(ps[2].detach(), ref[2].detach())


@pytest.mark.parametrize("precision", ["split", "kahan", "stochastic"])
def test_switching_at_construction_equals_building_with_the_precision(precision):
    a, b = _params(), _params()
    mp = MPW(optkit.Adam(a, learning_rate=0.01), "dynamic", precision=precision, state_dtype="int8")
    direct = optkit.Adam(b, learning_rate=0.01, precision=precision, state_dtype="int8")
    scale = float(mp.loss_scale)
    for step in range(3):
        gs = _grads(a, step)
        _set_grads(a, [g * scale for g in gs])  # (exact: a power of two)
        mp.grads_scaled = True
        mp.step()
        _set_grads(b, gs)
        direct.step()
    for p, q in zip(a, b):
        assert torch.equal(p.detach(), q.detach())
        sa, sb = mp.state[p], direct.state[q]
        assert set(sa) == set(sb)
        for k in sa:
            if isinstance(sa[k], torch.Tensor):
                assert same_bits(sa[k], sb[k]), k
    assert mp.state[a[0]]["exp_avg"].dtype == torch.uint8


def test_fp32_masters_with_state_dtype_equals_wrap():
    a, b = _params(), _params()
    mp = MPW(optkit.Adam(a, learning_rate=0.01), state_dtype="bf16")
    ref = MPW.wrap(lambda ps: optkit.Adam(ps, learning_rate=0.01, state_dtype="bfloat16"), b)
    assert len(mp.master_params) == 2
    for step in range(3):
        gs = _grads(a, step)
        _set_grads(a, gs)
        _set_grads(b, gs)
        mp.step()
        ref.step()
    for p, q in zip(a, b):
        assert torch.equal(p.detach(), q.detach())
    for m, n in zip(mp.master_params, ref.master_params):
        assert mp.state[m]["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(mp.state[m]["exp_avg_sq"], ref.state[n]["exp_avg_sq"])


def test_bad_options_raise_and_change_nothing():
    ps = _params()
    inner = optkit.Adam(ps[:2], learning_rate=0.01)
    before = {k: v.clone() for k, v in inner.state[ps[0]].items()}
    with pytest.raises(ValueError, match="precision"):
        MPW(inner, precision="bf16")
    with pytest.raises(ValueError, match="state_dtype"):
        MPW(inner, precision="split", state_dtype="int4")
    with pytest.raises(ValueError, match="l2_regularization"):
        MPW(inner, precision="kahan", l2_regularization=1e-4)
    assert inner.precision is None and inner.state_dtype is None
    assert all(same_bits(v, inner.state[ps[0]][k]) for k, v in before.items())
    assert inner.param_groups[0]["params"][0] is ps[0]
    torch_opt = torch.optim.SGD([ps[2]], lr=0.1)
    with pytest.raises(TypeError, match="precision"):
        MPW(torch_opt, precision="split")
    with pytest.raises(TypeError, match="state_dtype"):
        MPW(torch_opt, state_dtype="int8")
    half = torch.randn(8, dtype=torch.float16, requires_grad=True)
    with pytest.raises(ValueError, match="float16"):
        MPW(optkit.SGD([half], learning_rate=0.1), precision="split")
    with pytest.raises(ValueError, match="precision"):
        inner.engine.set_lean("fp32-masters", None)  # (the wrapper's, not a per-optimizer format)
    assert inner.precision is None


def test_set_lean_converts_weights_and_slots():
    ps = _params()[:2]
    opt = optkit.SGD(ps, learning_rate=0.1, momentum=0.9, precision="split", state_dtype="float32")
    for step in range(3):
        _set_grads(ps, _grads(ps, step))
        opt.step()
    masters = [_master(opt, p) for p in ps]
    moms = [opt.state[p]["momentum"].clone() for p in ps]
    # split -> split int8: the masters stay, the slots (4096 elements and more) are quantised
    opt.engine.set_lean("split", "int8")
    for p, m in zip(ps, masters):
        assert torch.equal(_master(opt, p), m)
    codes, scales = lowp.quantize(moms[0], signed=True)
    assert torch.equal(opt.state[ps[0]]["momentum"], codes)
    assert torch.equal(opt.state[ps[0]]["momentum_absmax"], scales)
    assert torch.equal(opt.state[ps[1]]["momentum"], lowp.quantize(moms[1], signed=True)[0])
    # split -> kahan: rn(master) and the residual
    opt.engine.set_lean("kahan", "float32")
    for p, m in zip(ps, masters):
        st = opt.state[p]
        assert "master_low" not in st
        assert torch.equal(p.detach(), m.bfloat16())
        assert torch.equal(st["kahan_comp"], (m - p.detach().float()).bfloat16())
        assert st["momentum"].dtype == torch.float32
    expect = [p.detach().float() + opt.state[p]["kahan_comp"].float() for p in ps]
    # kahan -> split: the master is p + comp
    opt.engine.set_lean("split", None)
    for p, e in zip(ps, expect):
        assert torch.equal(_master(opt, p), e)
        assert "kahan_comp" not in opt.state[p]
    # split -> none: the weight is rn(master); slots like the parameter (bfloat16)
    opt.engine.set_lean(None, None)
    for p, e in zip(ps, expect):
        assert torch.equal(p.detach(), e.bfloat16())
        assert set(opt.state[p]) == {"step", "momentum"}
        assert opt.state[p]["momentum"].dtype == torch.bfloat16
    _set_grads(ps, _grads(ps, 9))
    opt.step()  # (it still steps)
    assert all(torch.isfinite(p).all() for p in ps)


@pytest.mark.parametrize("precision", MODES)
@pytest.mark.parametrize("state_dtype", [None, "int8"])
def test_state_dict_round_trip_resumes_bit_for_bit(precision, state_dtype):
    def make(ps):
        return MPW(optkit.Adam(ps, learning_rate=0.01), "dynamic", precision=precision,
                   state_dtype=state_dtype)

    a = _params()
    mp = make(a)

    def run(opt, ps, steps):
        for step in steps:
            _set_grads(ps, [g * float(opt.loss_scale) for g in _grads(ps, step)])
            opt.grads_scaled = True
            opt.step()
            opt.zero_grad()

    run(mp, a, range(2))
    buf = io.BytesIO()
    torch.save(mp.state_dict(), buf)
    b = [p.detach().clone().requires_grad_() for p in a]
    resumed = make(_params(1))
    resumed_ps = [q for g in resumed.param_groups for q in g["params"]]
    if precision == "fp32-masters":
        resumed_ps = resumed.model_params + [q for q in resumed_ps if q.dtype == torch.float32][-1:]
    with torch.no_grad():
        for q, p in zip(resumed_ps, b):
            q.copy_(p)
    buf.seek(0)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    run(mp, a, range(2, 4))
    run(resumed, resumed_ps, range(2, 4))
    for p, q in zip(a, resumed_ps):
        assert torch.equal(p.detach(), q.detach())
    assert resumed.get_config()["precision"] == precision


def test_a_skipped_step_changes_nothing_without_masters():
    ps = _params()
    mp = MPW(optkit.LAMB(ps, learning_rate=0.01), "dynamic", precision="kahan", state_dtype="int8")
    _set_grads(ps, _grads(ps, 0))
    mp.grads_scaled = True
    mp.step()
    snap = [p.detach().clone() for p in ps]
    state = {k: v.clone() for k, v in mp.state[ps[0]].items() if isinstance(v, torch.Tensor)}
    scale = float(mp.loss_scale)
    gs = _grads(ps, 1)
    gs[1][3] = float("inf")
    _set_grads(ps, gs)
    mp.grads_scaled = True
    mp.step()
    assert not bool(mp.step_applied)
    assert float(mp.loss_scale) < scale
    assert all(torch.equal(p.detach(), s) for p, s in zip(ps, snap))
    assert all(same_bits(mp.state[ps[0]][k], v) for k, v in state.items())


def test_set_lean_to_the_same_options_changes_no_bit():
    ps = _params()[:2]
    opt = optkit.Adam(ps, learning_rate=0.01, precision="kahan", state_dtype="int8")
    for step in range(2):
        _set_grads(ps, _grads(ps, step))
        opt.step()
    before = {k: v.clone() for k, v in opt.state[ps[0]].items()}
    opt.engine.set_lean("kahan", "int8")
    assert all(same_bits(v, opt.state[ps[0]][k]) for k, v in before.items())


def test_add_param_group_without_masters():
    ps = _params()
    mp = MPW(optkit.SGD(ps[:1], learning_rate=0.1, momentum=0.9), precision="split", state_dtype="bf16")
    mp.add_param_group({"params": [ps[1]]})
    assert mp.master_params == [] and mp.param_groups[1]["params"][0] is ps[1]
    st = mp.state[ps[1]]
    assert st["master_low"].shape == ps[1].shape and st["momentum"].dtype == torch.bfloat16


def test_fp32_masters_over_a_master_free_optimizer_is_refused():
    """fp32 masters would replace bfloat16 weights whose formats keep state of their own (a split
    master's low halves, a Kahan sum): refused, naming both, before anything is built."""
    ps = [torch.nn.Parameter(torch.randn(8, 8).to(torch.bfloat16))]
    inner = optkit.SGD(ps, 0.1, momentum=0.9, precision="split")
    before = ps[0].detach().clone()
    with pytest.raises(ValueError, match="fp32-masters.*split"):
        optkit.MixedPrecisionOptimizerWrapper(inner)
    assert torch.equal(ps[0].detach(), before) and inner.param_groups[0]["params"][0] is ps[0]
    optkit.MixedPrecisionOptimizerWrapper(inner, precision="split")  # (the same format: accepted)
