"""The CUDA forms of ``LARS`` and ``LARC`` run on CPU tensors (routed there by patching the two predicates
that pick them: :meth:`optkit._core.plan.FlatPart.expands` for per-parameter factors over a flat buffer as
element vectors, ``optkit.lars._cpu_forms`` for the per-tensor forms over separate tensors) against the
float64 reference (``reference_rules``) and against the CPU path's results."""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest
import torch

import optkit
import optkit.lars
from optkit._core.plan import FlatPart
from reference_rules import Reference
from scaled_grads import step_checking_grads

SHAPES = [(8, 3), (5,), (2, 3, 4), (1,), (7, 2), (30,), (6, 5)]
EQUAL = [(4, 4), (16,), (2, 8), (16,), (4, 4)]  # equal sizes: one row run (the row norms pay)
VARIANTS = ("tf1.14", "tf1.15")


@pytest.fixture
def expands(monkeypatch):
    """Route flat parts through the element-vector form and LARS through its device forms (the rule then
    writes only ``k·g`` into the gradients: no copies of them); yields the list of expansions made."""
    calls = []
    orig = FlatPart.expand_segments

    def spy(self, values):
        calls.append(values.shape)
        return orig(self, values)

    monkeypatch.setattr(FlatPart, "expands", lambda self: True)
    monkeypatch.setattr(FlatPart, "expand_segments", spy)
    monkeypatch.setattr(optkit.lars, "_cpu_forms", lambda device: False)
    return calls


def _names(shapes):
    return [f"l{i}.weight" if len(s) > 1 else f"l{i}.bias" for i, s in enumerate(shapes)]


def _problem(seed, shapes, steps=4):
    rng = np.random.default_rng(seed)
    ws = [rng.standard_normal(s) for s in shapes]
    ws[3] = np.zeros(shapes[3])  # a zero-norm parameter (trust 1)
    grads = [[rng.standard_normal(s) * 0.1 for s in shapes] for _ in range(steps)]
    grads[1][0] = np.zeros(shapes[0])  # a zero gradient
    return ws, grads


def _lars_run(ws, grads, shapes, flat, scale=None, dtype=torch.float32, **kw):
    ps = [torch.tensor(w, dtype=dtype, requires_grad=True) for w in ws]
    if flat:
        optkit.flat_parameters(ps)
    opt = optkit.LARS(list(zip(_names(shapes), ps)), 0.5, **kw)
    for step in grads:
        for p, g in zip(ps, step):
            gt = torch.tensor(g if scale is None else g * scale, dtype=dtype)
            if p.grad is None:
                p.grad = gt
            else:
                p.grad.copy_(gt)
        step_checking_grads(opt, ps, scale, kw.get("scratch_grads", False))
    return ps, opt


def _reference(ws, grads, shapes, skipped, **hp):
    ref = Reference("lars", ws, hp, {"lr": 0.5}, per_tensor=[{"_lars_skipped": s} for s in skipped])
    for step in grads:
        ref.step(step)
    return ref


OPTIONS = {
    "plain": {},
    "exclude_1d": {"exclude_1d": True},
    "skip": {"skip_list": ["l1.", "l5."]},
    "no_decay": {"weight_decay": 0.0},
}


@pytest.mark.parametrize("variant,nesterov,opts,shapes,scale", [
    (v, n, o, s, sc) for v, n, o in itertools.product(VARIANTS, [False, True], OPTIONS)
    for s, sc in (("varied", None), ("equal", 256.0))
])
def test_flat_element_vectors_match_the_float64_reference(expands, variant, nesterov, opts, shapes, scale):
    """Flat buffers with factors expanded to the elements (sizes that vary, and equal sizes whose norms
    come from the row runs), cut into chunks on the CPU (``block_numel``), with and without a loss scale
    (``.grad`` left as ``torch.optim`` leaves it)."""
    shp = SHAPES if shapes == "varied" else EQUAL
    ws, grads = _problem(zlib.crc32(repr((variant, nesterov, opts, shapes)).encode()), shp)
    hp = {"momentum": 0.9, "weight_decay": 0.01, "eeta": 0.02, "epsilon": 1e-5, "variant": variant}
    hp.update({k: v for k, v in OPTIONS[opts].items() if k == "weight_decay"})
    ps, opt = _lars_run(ws, grads, shp, True, scale, use_nesterov=nesterov, block_numel=40, **{
        **{k: v for k, v in hp.items() if k != "momentum"}, "momentum": 0.9, **OPTIONS[opts]})
    assert expands  # (the element-vector form ran)
    skipped = [opts == "exclude_1d" and len(s) <= 1 or opts == "skip" and n.startswith(("l1.", "l5."))
               for s, n in zip(shp, _names(shp))]
    ref = _reference(ws, grads, shp, skipped, use_nesterov=nesterov, **hp)
    for p, w, st in zip(ps, ref.ws, ref.states):
        np.testing.assert_allclose(p.detach().double().numpy(), w, rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(opt.get_slot(p, "momentum").double().numpy(), st["a"], rtol=2e-5,
                                   atol=2e-6)


@pytest.mark.parametrize("variant,nesterov", [("tf1.15", False), ("tf1.15", True), ("tf1.14", True)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_flat_element_vectors_scratch_mode_and_dtypes(expands, variant, nesterov, dtype):
    """``scratch_grads=True`` (the train op's mode: the rule runs in the flat gradient itself) gives the
    default mode's result bit for bit; float64 matches the reference to 1e-12, bfloat16 to its precision."""
    ws, grads = _problem(11, SHAPES, steps=3)
    out = []
    for scratch in (False, True):
        ps, _ = _lars_run(ws, grads, SHAPES, True, dtype=dtype, use_nesterov=nesterov, variant=variant,
                          exclude_1d=True, weight_decay=0.01, eeta=0.02, scratch_grads=scratch)
        out.append(ps)
    assert all(torch.equal(a, b) for a, b in zip(*out))
    skipped = [len(s) <= 1 for s in SHAPES]
    ref = _reference(ws, grads, SHAPES, skipped, variant=variant, use_nesterov=nesterov, momentum=0.9,
                     weight_decay=0.01, eeta=0.02)
    tol = 1e-12 if dtype == torch.float64 else 3e-2
    for p, w in zip(out[0], ref.ws):
        np.testing.assert_allclose(p.detach().double().numpy(), w, rtol=tol, atol=tol)


@pytest.mark.parametrize("variant,nesterov,opts,scale", [
    (v, n, o, sc) for v, n, o, sc in itertools.product(VARIANTS, [False, True], ["plain", "skip"],
                                                       [None, 64.0])
])
def test_separate_tensor_device_forms_match_the_float64_reference(monkeypatch, variant, nesterov, opts,
                                                                   scale):
    """Separate tensors with the device forms (the decay in one multi-tensor call, one per-tensor multiply
    by ``s·k``; TF 1.14: ``(g + m·a)·s`` or ``s·a`` written in one call)."""
    routed = []
    monkeypatch.setattr(optkit.lars, "_cpu_forms", lambda device: routed.append(device) and False)
    ws, grads = _problem(zlib.crc32(repr((variant, nesterov, opts, scale)).encode()), SHAPES)
    hp = {"momentum": 0.9, "weight_decay": 0.01, "eeta": 0.02, "epsilon": 1e-5, "variant": variant}
    ps, opt = _lars_run(ws, grads, SHAPES, False, scale, use_nesterov=nesterov, **hp, **OPTIONS[opts])
    assert routed  # (the device forms ran)
    skipped = [opts == "skip" and n.startswith(("l1.", "l5.")) for n in _names(SHAPES)]
    ref = _reference(ws, grads, SHAPES, skipped, use_nesterov=nesterov, **hp)
    for p, w, st in zip(ps, ref.ws, ref.states):
        np.testing.assert_allclose(p.detach().double().numpy(), w, rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(opt.get_slot(p, "momentum").double().numpy(), st["a"], rtol=2e-5,
                                   atol=2e-6)


# ------------------------------------------------------------------------------------------------ LARC


def _larc_run(ws, grads, shapes, flat, scale=None, inner_scratch=False, **kw):
    ps = [torch.tensor(w, dtype=torch.float32, requires_grad=True) for w in ws]
    if flat:
        optkit.flat_parameters(ps)
    inner = optkit.SGD(list(zip(_names(shapes), ps)), learning_rate=0.3, momentum=0.9,
                       scratch_grads=inner_scratch)
    opt = optkit.LARC(inner, larc_eta=0.02, **kw)
    for step in grads:
        for p, g in zip(ps, step):
            gt = torch.tensor(g if scale is None else g * scale, dtype=torch.float32)
            if p.grad is None:
                p.grad = gt
            else:
                p.grad.copy_(gt)
        if scale is None:
            opt.step()
        else:
            step_checking_grads(opt, ps, scale, inner_scratch)
    return ps, opt


@pytest.mark.parametrize("mode,opts,shapes,scale", [
    (m, o, s, sc) for m, o in itertools.product(["clip", "scale"], ["plain", "exclude", "wd"])
    for s, sc in (("varied", None), ("equal", 128.0))
])
def test_larc_flat_element_vectors_match_the_cpu_path(monkeypatch, mode, opts, shapes, scale):
    """LARC(SGD) over flat buffers with the ratios expanded to the elements gives the CPU path's result
    (row columns, or per-tensor multipliers where the row runs do not pay) to float32 rounding, and the
    same ratios."""
    shp = SHAPES if shapes == "varied" else EQUAL
    ws, grads = _problem(zlib.crc32(repr((mode, opts, shapes)).encode()), shp)
    kw = {"larc_mode": mode}
    if opts == "exclude":
        kw["exclude"] = lambda n, p: p.ndim <= 1
    if opts == "wd":
        kw["wd_in_denominator"] = 0.01
    inner_scratch = opts == "wd"  # (the flat path of wd_in_denominator needs scratch gradients)
    cpu, cpu_opt = _larc_run(ws, grads, shp, True, scale, inner_scratch, **kw)
    calls = []
    orig = FlatPart.expand_segments
    monkeypatch.setattr(FlatPart, "expands", lambda self: True)
    monkeypatch.setattr(FlatPart, "expand_segments", lambda self, v: calls.append(1) or orig(self, v))
    dev, dev_opt = _larc_run(ws, grads, shp, True, scale, inner_scratch, **kw)
    assert calls
    for a, b in zip(dev, cpu):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(dev_opt.last_ratios, cpu_opt.last_ratios, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("variant,nesterov,opts", [("tf1.15", False, "plain"), ("tf1.15", True, "exclude_1d"),
                                                   ("tf1.14", True, "plain"), ("tf1.14", False, "skip")])
def test_flat_element_vectors_without_a_fused_kernel(expands, monkeypatch, variant, nesterov, opts):
    """A device without torch's fused SGD kernel steps the element vectors with the pointwise rule
    (``_lars_pointwise``'s element-vector form, for ``k·g``): the same reference, under a loss scale."""
    from optkit._core import fused

    monkeypatch.setitem(fused.KERNELS, "sgd", {k: v for k, v in fused.KERNELS["sgd"].items() if k != "cpu"})
    ws, grads = _problem(zlib.crc32(repr((variant, nesterov, opts, "pointwise")).encode()), SHAPES)
    hp = {"momentum": 0.9, "weight_decay": 0.01, "eeta": 0.02, "epsilon": 1e-5, "variant": variant}
    ps, _ = _lars_run(ws, grads, SHAPES, True, 32.0, use_nesterov=nesterov, block_numel=40, **hp,
                      **OPTIONS[opts])
    assert expands
    skipped = [opts == "exclude_1d" and len(s) <= 1 or opts == "skip" and n.startswith(("l1.", "l5."))
               for s, n in zip(SHAPES, _names(SHAPES))]
    ref = _reference(ws, grads, SHAPES, skipped, use_nesterov=nesterov, **hp)
    for p, w in zip(ps, ref.ws):
        np.testing.assert_allclose(p.detach().double().numpy(), w, rtol=2e-5, atol=2e-6)
