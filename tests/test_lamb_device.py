"""LAMB's form off the CPU (``LAMB._device_step``: both passes in a number of kernel launches independent of
the number of tensors), run on CPU tensors by routing them the way of other devices (``_cpu_direct =
False``), against the float64 NumPy reference of You et al. 2019 Algorithm 2 (``reference_rules.lamb``):
per tensor (the expanded step sizes applied by one ``torch._foreach_addcmul_``) and over flat buffers
(expanded to blocks of the segment sizes' common divisor, one broadcast ``addcmul_``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import optkit
from optkit import _multi_tensor as mt
from reference_rules import Reference
from scaled_grads import step_checking_grads

F64 = torch.float64

CASES = {
    "paper": dict(weight_decay=0.01),
    "no-bias-correction": dict(weight_decay=0.01, bias_correction=False, beta1=0.8, beta2=0.99),
    "always-adapt-no-wd": dict(always_adapt=True),
    "clamp": dict(weight_decay=0.01, min_coeff=0.9, max_coeff=1.1),
    "lambc": dict(weight_decay=0.01, lambc=True),
    "adam-like": dict(),
    "exclude-1d": dict(weight_decay=0.1, exclude_1d=True),  # mixed decay: the per-tensor / per-block wd
}
# segment sizes with common divisor 1 (odd sizes) and 2 (blocks of two elements over the flat buffer)
SHAPES = {"odd": [(5, 3), (3,), (3, 1, 3), (7,), (1,), (2, 3)],
          "even": [(4, 2), (6,), (2, 2, 2), (2,), (10,)]}


@pytest.fixture(autouse=True)
def _device_form(monkeypatch):
    monkeypatch.setattr(optkit.LAMB, "_cpu_direct", False)
    # (the per-tensor element vector, mt.ElementFactors, on CPU tensors too)
    monkeypatch.setattr(mt.ElementFactors, "applies",
                        staticmethod(lambda device, dtype: dtype in (torch.float32, torch.float64)))


def _problem(seed, shapes, steps=4, w_scale=2.0):
    rng = np.random.default_rng(seed)
    ws = [rng.standard_normal(s) * w_scale for s in shapes]
    return ws, [[rng.standard_normal(s) for s in shapes] for _ in range(steps)]


def _reference(ws, grads, kw, shapes):
    hp = {k: v for k, v in kw.items() if k != "exclude_1d"}
    per = [{"_skipped": True} if kw.get("exclude_1d") and len(s) <= 1 else {} for s in shapes]
    ref = Reference("lamb", ws, hp, {"lr": 0.05}, per)
    for gs in grads:
        ref.step(gs)
    return ref.ws


def _device_info(opt):
    (_, _, info), = opt._device_cache.values()
    return info


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("sizes", list(SHAPES))
@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_float64_reference(case, sizes, dtype, flat):
    shapes = SHAPES[sizes]
    kw = CASES[case]
    ws, grads = _problem(5, shapes)
    ref = _reference(ws, grads, kw, shapes)
    ts = [torch.tensor(w, dtype=dtype, requires_grad=True) for w in ws]
    for t in ts:
        t.grad = torch.zeros_like(t)
    if flat:
        optkit.flat_parameters(ts)
    names = [f"l{i}.weight" if len(s) > 1 else f"l{i}.bias" for i, s in enumerate(shapes)]
    opt = optkit.LAMB(list(zip(names, ts)), 0.05, **kw)
    for gs in grads:
        for t, g in zip(ts, gs):
            t.grad.copy_(torch.tensor(g))
        step_checking_grads(opt, ts)  # (the caller's gradients are only read)
    info = _device_info(opt)
    assert info is not None and (info.u_flat is not None) == flat and bool(opt._factor_cache) != flat
    if flat:
        assert list(opt._plans.values())[0].flat_active
        assert info.block == (2 if sizes == "even" else 1)
    tol = dict(rtol=1e-11, atol=1e-12) if dtype == F64 else dict(rtol=2e-5, atol=2e-6)
    for t, r in zip(ts, ref):
        np.testing.assert_allclose(t.detach().double().numpy(), r, **tol)


@pytest.mark.parametrize("flat", [False, True])
def test_equals_the_cpu_form_bit_for_bit_in_float64(flat, monkeypatch):
    """The same kernels' arithmetic as the CPU's direct form (``u`` formed once, ``w ← w − s·u``)."""
    shapes = SHAPES["even"]
    ws, grads = _problem(8, shapes)
    runs = []
    for direct in (True, False):
        monkeypatch.setattr(optkit.LAMB, "_cpu_direct", direct)
        ts = [torch.tensor(w, dtype=F64, requires_grad=True) for w in ws]
        for t in ts:
            t.grad = torch.zeros_like(t)
        if flat:
            optkit.flat_parameters(ts)
        opt = optkit.LAMB(ts, 0.05, weight_decay=0.01, scratch_grads=True)
        for gs in grads:
            for t, g in zip(ts, gs):
                t.grad.copy_(torch.tensor(g))
            opt.step()
        runs.append(ts)
    for a, b in zip(*runs):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("case", ["paper", "exclude-1d", "adam-like"])
def test_skipped_step_changes_nothing_not_even_a_zero_sign(case, flat):
    """``found_inf`` with NaN gradients: weights (a −0 and a +0 among them, by sign bit), moments and the
    gradients bit for bit as they were."""
    shapes = SHAPES["odd"]
    ws, grads = _problem(9, shapes, steps=2)
    ts = [torch.tensor(w, dtype=torch.float32, requires_grad=True) for w in ws]
    for t in ts:
        t.grad = torch.zeros_like(t)
    if flat:
        optkit.flat_parameters(ts)
    names = [f"l{i}.weight" if len(s) > 1 else f"l{i}.bias" for i, s in enumerate(shapes)]
    opt = optkit.LAMB(list(zip(names, ts)), 0.05, **CASES[case])
    for t, g in zip(ts, grads[0]):
        t.grad.copy_(torch.tensor(g))
    opt.step()
    with torch.no_grad():
        ts[0].view(-1)[0] = -0.0
        ts[0].view(-1)[1] = 0.0
    for t, g in zip(ts, grads[1]):
        t.grad.copy_(torch.tensor(g))
    ts[0].grad.view(-1)[2] = float("nan")
    ts[2].grad.view(-1)[0] = float("inf")

    def snapshot():
        vals = [t.detach() for t in ts] + [t.grad for t in ts] + [
            v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
        # (float32 as bits: −0 is not +0, NaN is NaN)
        return [x.clone().view(torch.int32) if x.dtype == torch.float32 else x.clone() for x in vals]

    before = snapshot()
    opt.found_inf = torch.ones(())
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(snapshot(), before))


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_loss_scale_unscales_in_the_kernel_and_leaves_g_over_s(dtype, flat):
    """Under a loss scale ``S`` (``grad_scale``) the kernel unscales: the reference's weights, and each
    ``.grad`` left as ``g/S`` (as ``torch.optim``'s fused kernels leave it)."""
    shapes = SHAPES["even"]
    ws, grads = _problem(10, shapes)
    ref = _reference(ws, grads, CASES["paper"], shapes)
    ts = [torch.tensor(w, dtype=dtype, requires_grad=True) for w in ws]
    for t in ts:
        t.grad = torch.zeros_like(t)
    if flat:
        optkit.flat_parameters(ts)
    opt = optkit.LAMB(ts, 0.05, **CASES["paper"])
    for gs in grads:
        for t, g in zip(ts, gs):
            t.grad.copy_(torch.tensor(np.asarray(g) * 64.0))
        step_checking_grads(opt, ts, 64.0)
    assert _device_info(opt) is not None
    tol = dict(rtol=1e-11, atol=1e-12) if dtype == F64 else dict(rtol=2e-5, atol=2e-6)
    for t, r in zip(ts, ref):
        np.testing.assert_allclose(t.detach().double().numpy(), r, **tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["paper", "exclude-1d", "clamp"])
def test_half_precision_flat_buffer(case, dtype):
    """Half-precision flat buffers take the form too (``u`` rounded once into the buffer, whose norm sets
    the ratio; the update formed in float32): the float64 reference within half-precision rounding, and a
    skipped step changes no bit; per-tensor half-precision groups keep the per-chunk passes."""
    shapes = SHAPES["even"]
    kw = CASES[case]
    ws, grads = _problem(12, shapes, steps=3)
    ref = _reference(ws, grads[:2], kw, shapes)
    for flat in (True, False):
        ts = [torch.tensor(w, dtype=dtype, requires_grad=True) for w in ws]
        for t in ts:
            t.grad = torch.zeros_like(t)
        if flat:
            optkit.flat_parameters(ts)
        names = [f"l{i}.weight" if len(s) > 1 else f"l{i}.bias" for i, s in enumerate(shapes)]
        opt = optkit.LAMB(list(zip(names, ts)), 0.05, **kw)
        for i, gs in enumerate(grads):
            for t, g in zip(ts, gs):
                t.grad.copy_(torch.tensor(g))
            if i == 2:
                ts[1].grad.view(-1)[0] = float("nan")
                vals = [t.detach() for t in ts] + [
                    v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
                before = [x.clone() for x in vals]
                opt.found_inf = torch.ones(())
                opt.step()
                del opt.found_inf
                assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) if a.dtype == dtype
                           else torch.equal(a, b) for a, b in zip(vals, before))
                break
            step_checking_grads(opt, ts)
        info = _device_info(opt)
        assert (info is not None and info.u_flat is not None) == flat
        tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
        for t, r in zip(ts, ref):
            np.testing.assert_allclose(t.detach().double().numpy(), r, rtol=tol, atol=tol)
