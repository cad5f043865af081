"""VariableClippingOptimizer: spec vectors V1-V5 (spec/tf_keras.md §2), float64 NumPy references, validation,
skip semantics, chaining, checkpoints and LR schedulers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from optkit import LossScaleOptimizer, VariableClippingOptimizer
from optkit.loss_scale import DynamicLossScale
from optkit.sgd import SGD

VC = VariableClippingOptimizer


def _t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype, requires_grad=True)


def _sparse(idx, n=3, val=0.1):
    return torch.sparse_coo_tensor(torch.tensor([idx]), torch.full((len(idx), 2), val), (n, 2),
                                   check_invariants=True)


def np_clip_by_norm(w: np.ndarray, c: float, dims) -> np.ndarray:
    """tf.clip_by_norm: (w·c)/max(n, c), n over dims with keepdims (float64)."""
    n = np.sqrt((w * w).sum(axis=tuple(dims), keepdims=True))
    return w * c / np.maximum(n, c)


@pytest.mark.parametrize("inner", ["torch", "optkit"])
def test_v1_dense(inner):
    v0, v1 = _t([[0.0, 1.0], [2.0, 3.0]]), _t([4.0, 5.0])
    opt = torch.optim.SGD([v0, v1], lr=3.0) if inner == "torch" else SGD([v0, v1], 3.0)
    o = VC(opt, {v0: [1]}, 2.0)
    v0.grad, v1.grad = torch.full((2, 2), 0.1), torch.full((2,), 0.01)
    o.step()
    torch.testing.assert_close(v0.detach(), torch.tensor([[-0.3, 0.7], [1.0656265, 1.6924657]]))
    torch.testing.assert_close(v1.detach(), torch.tensor([3.97, 4.97]))


def test_v2_sparse_touched_rows_only():
    v0 = _t([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]])
    o = VC(torch.optim.SGD([v0], lr=3.0), {v0: [1]}, 2.0)
    v0.grad = _sparse([0, 2])
    o.step()
    torch.testing.assert_close(v0.detach(), torch.tensor([[-0.3, 0.7], [2.0, 3.0], [1.2371192, 1.5714758]]))


def test_v3_sparse_dim0_dense_fallback_warns():
    v1 = _t([[0.0, 1.0], [0.0, 3.0], [0.0, 5.0]])
    o = VC(torch.optim.SGD([v1], lr=3.0), {v1: [0]}, 2.0)
    v1.grad = _sparse([0, 2])
    with pytest.warns(UserWarning, match="dense fallback"):
        o.step()
    torch.testing.assert_close(v1.detach(), torch.tensor([[-0.3, 0.2491277], [0.0, 1.0676900],
                                                          [-0.3, 1.6727142]]))


def test_v4_duplicate_indices_clip_once():
    """The original subtracts the delta once per duplicate ([-0.954, -1.235]); optkit clips the row once."""
    v0 = _t([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]])
    o = VC(torch.optim.SGD([v0], lr=3.0), {v0: [1]}, 2.0)
    v0.grad = _sparse([2, 2])
    o.step()
    row = np.array([3.4, 4.4])
    expect = row * 2.0 / np.linalg.norm(row)
    np.testing.assert_allclose(v0.detach()[2].numpy(), expect, rtol=1e-6)
    np.testing.assert_allclose(expect, [1.2229, 1.5826], atol=1e-4)
    torch.testing.assert_close(v0.detach()[:2], torch.tensor([[0.0, 1.0], [2.0, 3.0]]))


def test_v5_whole_matrix():
    v0 = _t([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]])
    o = VC(torch.optim.SGD([v0], lr=3.0), {v0: [0, 1]}, 2.0)
    v0.grad = _sparse([0, 2])
    with pytest.warns(UserWarning):
        o.step()
    torch.testing.assert_close(v0.detach(), torch.tensor([[-0.0854011, 0.1992694], [0.5693409, 0.8540115],
                                                          [1.0532806, 1.3379512]]))


@pytest.mark.parametrize("dims", [[1], [0], [0, 1], [-1], [1, 2], [0, 2]])
def test_float64_reference_random(rng, dims):
    shapes = [(5, 4, 3), (6, 2, 2)]
    ws = [rng.normal(size=s) * 2.0 for s in shapes]
    gs = [rng.normal(size=s) for s in shapes]
    ps = [torch.tensor(w, requires_grad=True) for w in ws]
    o = VC(torch.optim.SGD(ps, lr=0.5), {ps[0]: dims, ps[1]: dims}, 1.5)
    for p, g in zip(ps, gs):
        p.grad = torch.tensor(g)
    o.step()
    for p, w, g in zip(ps, ws, gs):
        np.testing.assert_allclose(p.detach().numpy(), np_clip_by_norm(w - 0.5 * g, 1.5, dims), rtol=1e-12)


def test_param_without_gradient_is_not_clipped():
    a, b = _t([[3.0, 4.0]]), _t([[6.0, 8.0]])
    o = VC(SGD([a, b], 0.1), {a: [1], b: [1]}, 1.0)
    a.grad = torch.zeros(1, 2) + 1e-3
    o.step()
    assert torch.equal(b.detach(), torch.tensor([[6.0, 8.0]]))
    np.testing.assert_allclose(np.linalg.norm(a.detach().numpy()), 1.0, rtol=1e-6)


def test_chaining_clips_inner_first(rng):
    w = rng.normal(size=(4, 3)) * 3
    g = rng.normal(size=(4, 3))
    p = torch.tensor(w, requires_grad=True)
    o = VC(VC(torch.optim.SGD([p], lr=0.1), {p: [1]}, 2.0), {p: [0, 1]}, 3.0)
    p.grad = torch.tensor(g)
    o.step()
    expect = np_clip_by_norm(np_clip_by_norm(w - 0.1 * g, 2.0, [1]), 3.0, [0, 1])
    np.testing.assert_allclose(p.detach().numpy(), expect, rtol=1e-12)


def test_skipped_step_clips_nothing():
    p = _t([[30.0, 40.0], [0.3, 0.4]])
    inner = LossScaleOptimizer(SGD([p], 0.1, momentum=0.9), DynamicLossScale(8.0))
    o = VC(inner, {p: [1]}, 1.0)
    before = p.detach().clone()
    mom = inner.get_slot(p, "momentum").clone()
    p.grad = torch.tensor([[float("inf"), 1.0], [1.0, 1.0]])
    inner.grads_scaled = True  # as scale_loss(loss).backward() would mark it
    o.step()
    assert not bool(o.step_applied)
    assert torch.equal(p.detach(), before) and torch.equal(inner.get_slot(p, "momentum"), mom)
    assert int(o.iterations) == 0


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_max_norm_validation(bad):
    p = _t([[1.0, 2.0]])
    with pytest.raises(ValueError, match="max_norm"):
        VC(torch.optim.SGD([p], lr=0.1), {p: [1]}, bad)
    with pytest.raises(TypeError, match="max_norm"):
        VC(torch.optim.SGD([p], lr=0.1), {p: [1]}, "1.0")


def test_dims_and_vars_validation():
    p, q = _t([[1.0, 2.0]]), _t([1.0])
    opt = torch.optim.SGD([p], lr=0.1)
    groups_before = [dict(g) for g in opt.param_groups]
    with pytest.raises(ValueError, match="out of range"):
        VC(opt, {p: [2]}, 1.0)
    with pytest.raises(ValueError, match="repeated"):
        VC(opt, {p: [1, -1]}, 1.0)
    with pytest.raises(ValueError, match="empty"):
        VC(opt, {p: []}, 1.0)
    with pytest.raises(TypeError, match="ints"):
        VC(opt, {p: [1.0]}, 1.0)
    with pytest.raises(ValueError, match="not one of"):
        VC(opt, {q: [0]}, 1.0)
    with pytest.raises(TypeError, match="dict"):
        VC(opt, [(p, [1])], 1.0)
    with pytest.raises(TypeError, match="opt"):
        VC("sgd", {p: [1]}, 1.0)
    assert [dict(g) for g in opt.param_groups] == groups_before and not opt.state
    s = torch.tensor(1.0, requires_grad=True)
    with pytest.raises(ValueError, match="0-d"):
        VC(torch.optim.SGD([s], lr=0.1), {s: [0]}, 1.0)


def test_state_dict_round_trip_bit_identical(rng):
    w = rng.normal(size=(3, 4)) * 2
    grads = [rng.normal(size=(3, 4)) for _ in range(4)]

    def make():
        p = torch.tensor(w, dtype=torch.float32, requires_grad=True)
        return p, VC(torch.optim.SGD([p], lr=0.3, momentum=0.9), {p: [1]}, 1.0)

    p1, o1 = make()
    for g in grads:
        p1.grad = torch.tensor(g, dtype=torch.float32)
        o1.step()
    p2, o2 = make()
    for g in grads[:2]:
        p2.grad = torch.tensor(g, dtype=torch.float32)
        o2.step()
    sd = o2.state_dict()
    p3, o3 = make()
    with torch.no_grad():
        p3.copy_(p2)
    o3.load_state_dict(sd)
    for g in grads[2:]:
        p3.grad = torch.tensor(g, dtype=torch.float32)
        o3.step()
    assert torch.equal(p1.detach(), p3.detach())
    with pytest.raises(ValueError):
        o3.load_state_dict({"optimizer": sd["optimizer"], "wrapper": {"type": "LARC"}})


def test_lr_scheduler_and_surface():
    p = _t([[1.0, 2.0]])
    o = VC(SGD([p], 0.4), {p: [1]}, 10.0)
    sched = torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
    p.grad = torch.ones(1, 2)
    o.step()
    sched.step()
    assert o.param_groups[0]["lr"] == pytest.approx(0.2)
    assert o.optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
    assert o.get_slot_names() == [] and int(o.iterations) == 1
    assert o.get_config()["max_norm"] == 10.0


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.1, 5.0), st.sampled_from([[0], [1], [0, 1]]))
def test_property_rows_within_norm(seed, c, dims):
    g = np.random.default_rng(seed)
    w = g.normal(size=(4, 3)) * 3
    p = torch.tensor(w, requires_grad=True)
    o = VC(torch.optim.SGD([p], lr=0.1), {p: dims}, c)
    p.grad = torch.tensor(g.normal(size=(4, 3)))
    o.step()
    n = np.sqrt((p.detach().numpy() ** 2).sum(axis=tuple(dims)))
    assert np.all(n <= c * (1 + 1e-9))


def test_apply_gradients_tf_surface_with_duplicate_sparse_rows():
    v0 = _t([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]])
    o = VC(torch.optim.SGD([v0], lr=3.0), {v0: [1]}, 2.0)
    o.apply_gradients([(_sparse([2, 2]), v0)])
    np.testing.assert_allclose(v0.detach()[2].numpy(), np.array([3.4, 4.4]) * 2 / np.linalg.norm([3.4, 4.4]),
                               rtol=1e-6)
    assert v0.grad is None  # the caller's .grad is restored
    with pytest.raises(ValueError, match="No gradients"):
        o.apply_gradients([(None, v0)])


def test_mixed_precision_wrapper_inside_raises_type_error_outermost():
    """A MixedPrecisionOptimizerWrapper must be the outermost wrapper: VariableClippingOptimizer over it
    raises the same TypeError as LossScaleOptimizer and LARC (the wrapper base's check) instead of a
    misleading "not one of the optimizer's parameters" ValueError; the other order works."""
    from optkit import LARC, MixedPrecisionOptimizerWrapper

    p = torch.tensor([[3.0, 4.0], [0.3, 0.4], [1.0, -2.0]], dtype=torch.float16, requires_grad=True)
    mp = MixedPrecisionOptimizerWrapper(torch.optim.SGD([p], lr=0.1))
    for keys in ({p: [1]}, {mp.master_params[0]: [1]}):
        with pytest.raises(TypeError, match="MixedPrecisionOptimizerWrapper must be the outermost") as vc_err:
            VC(mp, keys, 1.0)
        with pytest.raises(TypeError) as larc_err:
            LARC(mp, 0.01)
        assert str(vc_err.value) == str(larc_err.value).replace("LARC", "VariableClippingOptimizer")
    q = torch.tensor([[3.0, 4.0], [0.3, 0.4]], dtype=torch.float16, requires_grad=True)
    outer = MixedPrecisionOptimizerWrapper(VC(torch.optim.SGD([q], lr=0.1), {q: [1]}, 1.0))
    assert list(outer.optimizer.vars_to_clip_dims.values()) == [[1]]
