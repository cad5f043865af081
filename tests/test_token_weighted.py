"""Token-weighted accumulation in ``optimize_loss``: a loss function returning ``(loss_sum, num_items)``
updates with ``Σ loss_sum / Σ num_items`` over the window (transformers#34242's fix for gradient
accumulation with variable-length batches), against a float64 reference that differentiates the pooled loss
of the whole window directly. The cross-rank case is in ``tests/distributed/test_token_weighted.py``."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from torch import nn

import optkit

F64 = torch.float64
LENGTHS = [3, 11, 6, 1, 9, 4]  # tokens per micro-batch: very different lengths


def _model(dtype=F64):
    torch.manual_seed(0)
    return nn.Linear(4, 2).to(dtype)


def _batch(k, dtype=F64):
    g = torch.Generator().manual_seed(50 + k)
    n = LENGTHS[k % len(LENGTHS)]
    return torch.randn(n, 4, generator=g).to(dtype), torch.randn(n, 2, generator=g).to(dtype)


def _loss_pair(model):
    def loss(x, y):
        per_token = ((model(x).double() - y.double()) ** 2).sum(dim=1)
        return per_token.sum(), x.shape[0]
    return loss


def _reference(windows, lr, clip=None):
    """Plain SGD on the pooled window loss ``Σ loss_sum / Σ n`` (float64 autograd on a fresh copy)."""
    model = _model()
    for window in windows:
        model.zero_grad()
        total = sum(((model(x) - y) ** 2).sum() for x, y in window)
        count = sum(x.shape[0] for x, _ in window)
        (total / count).backward()
        with torch.no_grad():
            grads = [p.grad for p in model.parameters()]
            if clip is not None:
                n = torch.sqrt(sum((g * g).sum() for g in grads))
                grads = [g * min(1.0, clip / float(n)) for g in grads]
            for p, g in zip(model.parameters(), grads):
                p -= lr * g
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("clip", [None, 0.5])
def test_window_uses_pooled_items(clip):
    model = _model()
    op = optkit.optimize_loss(_loss_pair(model), "SGD", None, 0.1, model=model, iter_size=3,
                              clip_gradients=clip)
    windows = [[_batch(3 * w + m) for m in range(3)] for w in range(2)]
    for window in windows:
        for x, y in window:
            result = op(x, y)
    assert int(op.global_step) == 2
    for p, r in zip(model.parameters(), _reference(windows, 0.1, clip)):
        torch.testing.assert_close(p.detach(), r, rtol=1e-6, atol=1e-9)  # fp32 update factor
    assert bool(result.applied)


def test_differs_from_mean_of_micro_batch_means():
    """The pooled mean is not the mean of the micro-batch means when lengths differ (what the old way did)."""
    model = _model()
    op = optkit.optimize_loss(_loss_pair(model), "SGD", None, 0.1, model=model, iter_size=3)
    window = [_batch(m) for m in range(3)]
    for x, y in window:
        op(x, y)
    old = _model()
    op_old = optkit.optimize_loss(lambda x, y: ((old(x) - y) ** 2).sum(dim=1).mean(), "SGD", None, 0.1,
                                  model=old, iter_size=3)
    for x, y in window:
        op_old(x, y)
    assert (model.weight - old.weight).abs().max() > 1e-4


def test_partial_windows_and_tensor_counts():
    """``skip_update_ph`` closes windows of 1, 3 and 2 micro-batches; ``num_items`` given as tensors."""
    model = _model()
    flags = iter([False, True, True, False, True, False])

    def loss(x, y):
        s, n = _loss_pair(model)(x, y)
        return s, torch.tensor(n)

    op = optkit.optimize_loss(loss, "Momentum", {"momentum": 0.0}, 0.05, model=model,
                              skip_update_ph=lambda: next(flags))
    batches = [_batch(k) for k in range(6)]
    for x, y in batches:
        op(x, y)
    windows = [batches[:1], batches[1:4], batches[4:]]
    for p, r in zip(model.parameters(), _reference(windows, 0.05)):
        torch.testing.assert_close(p.detach(), r, rtol=1e-6, atol=1e-9)  # fp32 update factor


def test_reported_loss_is_the_micro_batch_mean():
    model = _model()
    op = optkit.optimize_loss(_loss_pair(model), "SGD", None, 0.1, model=model, iter_size=2)
    x, y = _batch(1)
    expected = ((model(x) - y) ** 2).sum(dim=1).mean()
    result = op(x, y)
    torch.testing.assert_close(result.loss.double(), expected.detach(), rtol=1e-6, atol=1e-9)


def test_mixed_precision_loss_scaling():
    """fp16 model, fp32 masters, a static loss scale: the pooled update within half-precision error."""
    model = _model(torch.float16)

    def loss(x, y):
        per = ((model(x.half()).float() - y.float()) ** 2).sum(dim=1)
        return per.sum(), x.shape[0]

    op = optkit.optimize_loss(loss, "SGD", None, 0.1, model=model, iter_size=3, dtype="mixed",
                              loss_scaling=128.0)
    windows = [[_batch(3 * w + m) for m in range(3)] for w in range(2)]
    for window in windows:
        for x, y in window:
            op(x.float(), y.float())
    ref_model = _model()
    ref_model.load_state_dict({k: v.double() for k, v in _model(torch.float16).state_dict().items()})
    with torch.no_grad():
        for window in windows:
            ref_model.zero_grad()
            with torch.enable_grad():
                total = sum(((ref_model(x) - y) ** 2).sum() for x, y in window)
                (total / sum(x.shape[0] for x, _ in window)).backward()
            for p in ref_model.parameters():
                p -= 0.1 * p.grad
    for m, r in zip(op.masters, ref_model.parameters()):
        torch.testing.assert_close(m.detach().double(), r.detach(), rtol=2e-3, atol=2e-3)


def test_checkpoint_inside_a_window_resumes_bit_identically():
    def make():
        model = _model()
        return model, optkit.optimize_loss(_loss_pair(model), "Adam", None, 0.01, model=model, iter_size=3)

    batches = [_batch(k) for k in range(6)]
    m1, op1 = make()
    for x, y in batches:
        op1(x, y)
    m2, op2 = make()
    for x, y in batches[:2]:
        op2(x, y)
    buf = io.BytesIO()
    torch.save({"model": m2.state_dict(), "op": op2.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    m3, op3 = make()
    m3.load_state_dict(saved["model"])
    op3.load_state_dict(saved["op"])
    for x, y in batches[2:]:
        op3(x, y)
    for a, b in zip(m1.parameters(), m3.parameters()):
        assert torch.equal(a, b)


def test_window_without_items_takes_a_zero_gradient_step():
    model = _model()
    w0 = [p.detach().clone() for p in model.parameters()]
    op = optkit.optimize_loss(lambda x: ((model(x) * 0).sum(), 0), "SGD", None, 0.1, model=model)
    op(torch.randn(2, 4, dtype=F64))
    for p, w in zip(model.parameters(), w0):
        assert torch.equal(p.detach(), w)


def test_bad_returns_raise_naming_the_problem():
    model = _model()
    x, y = _batch(0)
    op = optkit.optimize_loss(_loss_pair(model), "SGD", None, 0.1, model=model, iter_size=2)
    op(x, y)
    bad = optkit.optimize_loss(lambda x, y: (model(x).sum(), 1, 2), "SGD", None, 0.1, model=model)
    with pytest.raises(ValueError, match="tuple of 3"):
        bad(x, y)
    for items, match in [(-1, "num_items"), ("3", "num_items"), (torch.ones(2), "one-element")]:
        op = optkit.optimize_loss(lambda x, y, n=items: (model(x).sum(), n), "SGD", None, 0.1, model=model)
        with pytest.raises(ValueError, match=match):
            op(x, y)
    calls = iter([True, False])

    def flip(x, y):
        s = model(x).sum()
        return (s, 3) if next(calls) else s

    op = optkit.optimize_loss(flip, "SGD", None, 0.1, model=model, iter_size=2)
    op(x, y)
    with pytest.raises(ValueError, match="on every call"):
        op(x, y)
    assert np.isfinite(model.weight.detach().numpy()).all()


def _reference_regularized(windows, lr, lam, model):
    """Plain SGD on ``Σ loss_sum / Σ n + lam·‖W‖²`` (the regularizer weighs once per update)."""
    for window in windows:
        model.zero_grad()
        with torch.enable_grad():
            total = sum(((model(x) - y) ** 2).sum() for x, y in window)
            count = sum(x.shape[0] for x, _ in window)
            (total / count + lam * (model.weight ** 2).sum()).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("mixed", [False, True])
def test_regularizer_weighs_once_per_update(mixed):
    """The documented form ``(loss_sum + num_items·R, num_items)`` weighs the regularization loss ``R`` once
    per update, as an averaged window does; ``"mixed"`` diverts a half weight's ``R`` to its fp32 master with
    the same weight, so both paths train the same objective."""
    from optkit.regularization import add_regularizer, clear_regularizers, get_regularization_loss

    lam = 0.5
    dtype = torch.float16 if mixed else F64
    model = _model(dtype)
    add_regularizer(model.weight, lambda w: lam * (w.float() ** 2).sum())
    try:
        def loss(x, y):
            per = ((model(x.to(dtype)).double() - y.double()) ** 2).sum(dim=1)
            return per.sum() + x.shape[0] * get_regularization_loss().double(), x.shape[0]

        kw = {"dtype": "mixed", "loss_scaling": 64.0} if mixed else {}
        op = optkit.optimize_loss(loss, "SGD", None, 0.1, model=model, iter_size=3, **kw)
        windows = [[_batch(3 * w + m) for m in range(3)] for w in range(2)]
        for window in windows:
            for x, y in window:
                op(x, y)
    finally:
        clear_regularizers()
    def start():
        ref = _model()
        if mixed:  # start from the same fp16-rounded weights
            ref.load_state_dict({k: v.double() for k, v in _model(torch.float16).state_dict().items()})
        return ref

    expected = _reference_regularized(windows, 0.1, lam, start())
    got = op.masters if mixed else list(model.parameters())
    tol = 2e-3 if mixed else 1e-6
    for p, r in zip(got, expected):
        torch.testing.assert_close(p.detach().double(), r, rtol=tol, atol=tol)
    unregularized = _reference_regularized(windows, 0.1, 0.0, start())  # R is not lost in the tolerance
    assert (got[0].detach().double() - unregularized[0]).abs().max() > 10 * tol
