"""optkit.Lion against a float64 NumPy reference written from Chen et al. 2023 ("Symbolic Discovery of
Optimization Algorithms", arXiv:2302.06675, Algorithm 2) and against timm's ``Lion`` (``timm/optim/lion.py``,
release 1.0.31) when its file is installed; its argument checks; and the base's default update path it runs
on (no ``_update`` of its own)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import optkit
from scaled_grads import assert_skip_changes_nothing, step_checking_grads
from timm_optim import load_timm_optim

F64 = torch.float64
NAMES = ["enc.weight", "enc.bias", "conv.weight"]
SHAPES = [(5, 4), (4,), (3, 2, 2)]


def _problem(seed: int, steps: int = 6):
    rng = np.random.default_rng(seed)
    ws = [rng.standard_normal(s) * 0.5 for s in SHAPES]
    grads = [[rng.standard_normal(s) for s in SHAPES] for _ in range(steps)]
    return ws, grads


def _reference(ws, grads, lr, beta1, beta2, wd, decayed):
    """Algorithm 2 in float64: ``c = β1·m + (1 − β1)·g``, ``w ← w − lr·(sign(c) + λ·w)``,
    ``m ← β2·m + (1 − β2)·g`` (``decayed[i]``: whether tensor i takes the decay λ; ``beta1[i]``: its β1)."""
    ws = [w.copy() for w in ws]
    ms = [np.zeros_like(w) for w in ws]
    for gs in grads:
        for i, g in enumerate(gs):
            c = beta1[i] * ms[i] + (1 - beta1[i]) * g
            ws[i] = ws[i] - lr * (np.sign(c) + (wd * ws[i] if decayed[i] else 0.0))
            ms[i] = beta2 * ms[i] + (1 - beta2) * g
    return ws


def _tensors(ws, dtype=F64):
    return [torch.tensor(w, dtype=dtype, requires_grad=True) for w in ws]


def _run(opt, ts, grads):
    for gs in grads:
        for t, g in zip(ts, gs):
            t.grad = torch.tensor(g, dtype=t.dtype)
        opt.step()
    return [t.detach().double().numpy() for t in ts]


@pytest.mark.parametrize("dtype,rtol,atol", [(torch.float64, 1e-12, 1e-13), (torch.float32, 2e-6, 1e-6)])
def test_matches_float64_reference_with_decay_exclusion_and_group_beta(dtype, rtol, atol):
    """Six seeded steps; the decay excluded from the bias by name, and the conv weight in a group of its own
    with another ``beta1``."""
    ws, grads = _problem(0)
    ts = _tensors(ws, dtype)
    named = list(zip(NAMES, ts))
    opt = optkit.Lion([{"params": named[:2]}, {"params": named[2:], "beta1": 0.5}], 3e-3, beta1=0.8,
                      beta2=0.95, weight_decay=0.5)
    opt.exclude_from_weight_decay(var_names=["bias"])
    got = _run(opt, ts, grads)
    want = _reference(ws, grads, 3e-3, [0.8, 0.8, 0.5], 0.95, 0.5, [True, False, True])
    for name, a, b in zip(NAMES, got, want):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=name)
    assert set(opt.state[ts[0]]) == {"step", "exp_avg"}


def test_matches_timm_lion():
    """timm's ``Lion(lr, betas, weight_decay)`` (its decoupled decay ``w·(1 − lr·wd)``, the moment
    ``exp_avg``) is ``optkit.Lion(lr, beta1=, beta2=, weight_decay=)``: weights and moments agree."""
    timm_lion = load_timm_optim("lion", "Lion")
    if timm_lion is None:
        pytest.skip("timm is not installed (timm/optim/lion.py)")
    ws, grads = _problem(1)
    ours, theirs = _tensors(ws), _tensors(ws)
    opt = optkit.Lion(ours, 1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)
    ref = timm_lion(theirs, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, foreach=False)
    for a, b in zip(_run(opt, ours, grads), _run(ref, theirs, grads)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"], rtol=1e-12, atol=1e-14)


def test_grads_skip_and_no_gradient_copies():
    """The base's default update (the pointwise rule) leaves ``.grad`` as torch.optim does (bitwise, or
    ``g/S`` under GradScaler's ``grad_scale``), so the base hands it the caller's gradients (no in-cache
    copies); a skipped step changes nothing."""
    ws, grads = _problem(2, steps=3)
    ts = _tensors(ws, torch.float32)
    opt = optkit.Lion(ts, 1e-3, weight_decay=0.1)
    assert not opt._update_writes_grads(opt.param_groups[0])
    for k, gs in enumerate(grads):
        for t, g in zip(ts, gs):
            t.grad = torch.tensor(g, dtype=torch.float32) * 256.0
        step_checking_grads(opt, ts, scale=256.0 if k else None)
    assert_skip_changes_nothing(opt, ts, torch.tensor(1 / 256.0))


def test_jit_compile_matches_eager():
    """``jit_compile=True`` compiles the same pointwise rule (with decay and EMA): the eager result."""
    ws, grads = _problem(3, steps=3)
    runs = []
    for jit in (False, True):
        ts = _tensors(ws, torch.float32)
        opt = optkit.Lion(ts, 1e-2, weight_decay=0.1, use_ema=True, ema_momentum=0.5, jit_compile=jit)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="jit_compile")
            runs.append(_run(opt, ts, grads) + [opt.state[t]["exp_avg"].double().numpy() for t in ts])
        assert opt._compile_state == ("ok" if jit else "untried")
    for a, b in zip(*runs):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kwargs,exc,name", [
    ({"beta1": 1.0}, ValueError, "beta1"),
    ({"beta1": -0.1}, ValueError, "beta1"),
    ({"beta2": 1.5}, ValueError, "beta2"),
    ({"beta2": float("nan")}, ValueError, "beta2"),
    ({"beta1": "0.9"}, TypeError, "beta1"),
    ({"weight_decay": -0.1}, ValueError, "weight_decay"),
    ({"learning_rate": -1e-4}, ValueError, "learning_rate"),
    ({"betas": (0.9, 0.99)}, TypeError, "beta1=`, `beta2="),
])
def test_bad_arguments_name_the_argument(kwargs, exc, name):
    w = torch.ones(3, requires_grad=True)
    with pytest.raises(exc, match=name):
        optkit.Lion([w], **kwargs)
    assert torch.equal(w, torch.ones(3))


def test_timm_betas_in_a_param_group_is_refused():
    w = torch.ones(3, requires_grad=True)
    with pytest.raises(ValueError, match="'betas' is torch's name; Lion takes 'beta1' and 'beta2'"):
        optkit.Lion([{"params": [w], "betas": (0.9, 0.99)}])
