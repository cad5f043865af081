"""``optkit.Ftrl`` against a float64 NumPy reference written from the FTRL-proximal formulas as TF documents
them (``ApplyFtrlV2``: shrinkage on the linear term only, ``beta`` added to l2 as ``beta/(2·lr)``)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from optkit import Ftrl

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")


def ftrl_reference(w, grads_seq, lrs, *, lr_power=-0.5, init=0.1, l1=0.0, l2=0.0, shrink=0.0, beta=0.0):
    w = w.astype(np.float64).copy()
    n = np.full_like(w, init)
    z = np.zeros_like(w)
    for g, lr in zip(grads_seq, lrs):
        g_s = g + 2.0 * shrink * w
        n_new = n + g * g
        sigma = (n_new ** (-lr_power) - n ** (-lr_power)) / lr
        z = z + g_s - sigma * w
        quadratic = 1.0 / (n_new**lr_power * lr) + 2.0 * (l2 + beta / (2.0 * lr))
        w = np.where(np.abs(z) > l1, (np.sign(z) * l1 - z) / quadratic, 0.0)
        n = n_new
    return w, n, z


CONFIGS = [
    {},
    {"l1": 0.05},
    {"l2": 0.1},
    {"l1": 0.02, "l2": 0.05, "shrink": 0.1},
    {"lr_power": -0.3, "init": 0.5},
    {"lr_power": 0.0, "l1": 0.01},
    {"beta": 0.2, "l2": 0.01},
]


def _kwargs(cfg):
    names = {
        "lr_power": "learning_rate_power",
        "init": "initial_accumulator_value",
        "l1": "l1_regularization_strength",
        "l2": "l2_regularization_strength",
        "shrink": "l2_shrinkage_regularization_strength",
        "beta": "beta",
    }
    return {names[k]: v for k, v in cfg.items()}


@pytest.mark.parametrize("cfg,dtype", list(itertools.product(CONFIGS, [torch.float32, torch.float64])))
def test_matches_float64_reference(cfg, dtype):
    rng = np.random.default_rng(len(str(cfg)) + (dtype == torch.float64))
    shapes = [(5, 4), (7,), (2, 3, 2)]
    ws = [rng.standard_normal(s) for s in shapes]
    steps = 5
    grads_seq = [[rng.standard_normal(s) for s in shapes] for _ in range(steps)]
    lrs = [0.1, 0.05, 0.2, 0.1, 0.07]
    ts = [torch.tensor(w, dtype=dtype, requires_grad=True) for w in ws]
    opt = Ftrl(ts, learning_rate=lrs[0], **_kwargs(cfg))
    for grads, lr in zip(grads_seq, lrs):
        opt.learning_rate = lr
        for t, g in zip(ts, grads):
            t.grad = torch.tensor(g, dtype=dtype)
        opt.step()
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    for j, t in enumerate(ts):
        w, n, z = ftrl_reference(ws[j], [gs[j] for gs in grads_seq], lrs, **cfg)
        np.testing.assert_allclose(t.detach().double().numpy(), w, rtol=tol, atol=tol)
        np.testing.assert_allclose(opt.get_slot(t, "accum").double().numpy(), n, rtol=tol, atol=tol)
        np.testing.assert_allclose(opt.get_slot(t, "linear").double().numpy(), z, rtol=tol, atol=tol)


def test_tf1_defaults_and_slots():
    w = torch.ones(3, requires_grad=True)
    opt = Ftrl([w], learning_rate=0.1)
    cfg = opt.get_config()
    assert cfg["learning_rate_power"] == -0.5 and cfg["initial_accumulator_value"] == 0.1
    assert cfg["l1_regularization_strength"] == 0.0 and cfg["l2_shrinkage_regularization_strength"] == 0.0
    assert opt.get_slot_names() == ["accum", "linear"]
    assert torch.equal(opt.get_slot(w, "accum"), torch.full((3,), 0.1))


def test_sparse_gradient_updates_touched_rows_only():
    rng = np.random.default_rng(2)
    w0 = rng.standard_normal((4, 3))
    w = torch.tensor(w0, requires_grad=True)
    opt = Ftrl([w], learning_rate=0.1, l1_regularization_strength=0.01)
    vals = rng.standard_normal((3, 3))
    w.grad = torch.sparse_coo_tensor(torch.tensor([[1, 3, 1]]), torch.tensor(vals), (4, 3))
    opt.step()
    out = w.detach().numpy()
    np.testing.assert_array_equal(out[[0, 2]], w0[[0, 2]])  # untouched rows keep their values
    for row, g in ((1, vals[0] + vals[2]), (3, vals[1])):  # duplicates summed
        ref, n, _ = ftrl_reference(w0[row], [g], [0.1], l1=0.01)
        np.testing.assert_allclose(out[row], ref, rtol=1e-12)
        np.testing.assert_allclose(opt.get_slot(w, "accum")[row].numpy(), n, rtol=1e-12)


@pytest.mark.parametrize(
    "kwargs,exc,name",
    [
        ({"learning_rate_power": 0.5}, ValueError, "learning_rate_power"),
        ({"initial_accumulator_value": -0.1}, ValueError, "initial_accumulator_value"),
        ({"l1_regularization_strength": -1.0}, ValueError, "l1_regularization_strength"),
        ({"l2_regularization_strength": -1.0}, ValueError, "l2_regularization_strength"),
        ({"l2_shrinkage_regularization_strength": -1.0}, ValueError, "l2_shrinkage_regularization_strength"),
        ({"beta": "x"}, TypeError, "beta"),
        ({"learning_rate": -0.1}, ValueError, "learning_rate"),
    ],
)
def test_validation(kwargs, exc, name):
    w = torch.ones(2, requires_grad=True)
    with pytest.raises(exc, match=name):
        Ftrl([w], **kwargs)
    assert torch.equal(w.detach(), torch.ones(2))
