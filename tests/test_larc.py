"""LARC: spec vectors (spec/openseq2seq.md §4), float64 NumPy references, lr handling, exclusion, the
apex/timm variant (against timm's Lars when installed), strict parameter checks, checkpoints."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from optkit import LARC
from optkit._validation import ParameterTypeError
from optkit.sgd import SGD
from scaled_grads import assert_skip_changes_nothing
from timm_optim import load_timm_optim


def _w(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype, requires_grad=True)


def np_ratio(w, g, lr, eta, mode, min_update=1e-7, eps=1e-7):
    """OpenSeq2Seq LARC ratio in float64 (with optkit's lr == 0 guard in clip mode)."""
    wn, gn = np.linalg.norm(w), np.linalg.norm(g)
    if mode == "clip":
        if lr == 0:
            return 1.0
        return min(max(eta * wn / (lr * (gn + eps)), min_update), 1.0)
    return max(eta * wn / (gn + eps), min_update)


def _seen(opt) -> dict:
    """The gradients the inner torch optimizer steps on, recorded by its step pre-hook: LARC hands it the
    ratio-scaled gradients in copies and leaves the caller's ``.grad`` as it was (torch.optim's contract)."""
    seen = {}

    def hook(o, args, kwargs):
        for group in o.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    seen[p] = p.grad.detach().clone()

    opt.optimizer.register_step_pre_hook(hook)
    return seen


def _scaled_grad(v, g, eta, mode, lr=0.1, dtype=torch.float32):
    """g' as LARC hands it to a plain torch SGD (the caller's p.grad is left as it was)."""
    p = _w(v, dtype)
    opt = LARC(torch.optim.SGD([p], lr=lr), eta, mode)
    seen = _seen(opt)
    p.grad = torch.tensor(g, dtype=dtype)
    opt.step()
    assert torch.equal(p.grad, torch.tensor(g, dtype=dtype))
    return seen[p].numpy()


@pytest.mark.parametrize("eta,mode,v,g,expect", [
    (0.002, "clip", [3, 4], [0.3, 0.4], [0.05999999, 0.07999998]),
    (0.002, "scale", [3, 4], [0.3, 0.4], [0.006, 0.008]),
    (0.1, "clip", [3, 4], [0.3, 0.4], [0.3, 0.4]),
    (0.1, "scale", [3, 4], [0.3, 0.4], [0.3 * 0.9999998, 0.4 * 0.9999998]),
    (0.002, "clip", [0, 0], [0.3, 0.4], [3e-8, 4e-8]),
    (0.002, "clip", [3, 4], [0, 0], [0, 0]),
])
def test_spec_vectors(eta, mode, v, g, expect):
    got = _scaled_grad([float(x) for x in v], [float(x) for x in g], eta, mode)
    np.testing.assert_allclose(got, expect, rtol=2e-6, atol=1e-12)


def test_zero_grad_scale_mode_ratio_1e5():
    """g = 0: scale mode gives r = η‖v‖/ε = 1e5 (no NaN); a gradient of 1e-9 shows it: r·g = 1e-4-ish."""
    p = _w([3.0, 4.0], torch.float64)
    opt = LARC(torch.optim.SGD([p], lr=0.1), 0.002, "scale")
    seen = _seen(opt)
    p.grad = torch.zeros(2, dtype=torch.float64)
    opt.step()
    assert torch.equal(seen[p], torch.zeros(2, dtype=torch.float64)) and torch.equal(p.detach(), torch.tensor(
        [3.0, 4.0], dtype=torch.float64))
    g = np.array([0.0, 1e-9])
    p.grad = torch.tensor(g)
    opt.step()
    r = np_ratio(np.array([3.0, 4.0]), g, 0.1, 0.002, "scale")
    assert r == pytest.approx(0.01 / (1e-9 + 1e-7))
    np.testing.assert_allclose(seen[p].numpy(), r * g, rtol=1e-12)


@pytest.mark.parametrize("mode", ["clip", "scale"])
@pytest.mark.parametrize("inner_kind", ["torch", "optkit"])
def test_float64_reference_two_groups_momentum(rng, mode, inner_kind):
    shapes = [(4, 3), (5,), (2, 2, 2)]
    ws = [rng.normal(size=s) for s in shapes]
    ps = [torch.tensor(w, requires_grad=True) for w in ws]
    lrs = [0.1, 0.02]
    groups = [{"params": ps[:2], "lr": lrs[0]}, {"params": ps[2:], "lr": lrs[1]}]
    if inner_kind == "torch":
        inner = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    else:
        groups = [{"params": ps[:2], "lr": lrs[0]}, {"params": ps[2:], "lr": lrs[1]}]
        inner = SGD(groups, 0.1, momentum=0.9)
    opt = LARC(inner, 0.01, mode)
    ref_w = [w.copy() for w in ws]
    ref_m = [np.zeros_like(w) for w in ws]
    group_of = [0, 0, 1]
    for _ in range(3):
        gs = [rng.normal(size=s) * 0.5 for s in shapes]
        for p, g in zip(ps, gs):
            p.grad = torch.tensor(g)
        opt.step()
        for i, g in enumerate(gs):
            lr = lrs[group_of[i]]
            gp = np_ratio(ref_w[i], g, lr, 0.01, mode) * g
            if inner_kind == "torch":  # m = μm + g; w -= lr m
                ref_m[i] = 0.9 * ref_m[i] + gp
                ref_w[i] = ref_w[i] - lr * ref_m[i]
            else:  # Keras: v = μv − lr g; w += v
                ref_m[i] = 0.9 * ref_m[i] - lr * gp
                ref_w[i] = ref_w[i] + ref_m[i]
        for p, rw in zip(ps, ref_w):
            np.testing.assert_allclose(p.detach().numpy(), rw, rtol=1e-6, atol=1e-12)


def test_uses_current_lr_tensor_and_schedule():
    p = _w([3.0, 4.0])
    inner = torch.optim.SGD([p], lr=torch.tensor(0.1))
    opt = LARC(inner, 0.002)
    seen = _seen(opt)
    p.grad = torch.tensor([0.3, 0.4])
    opt.step()
    np.testing.assert_allclose(seen[p].numpy(), [0.06, 0.08], rtol=1e-5)
    # optkit schedule: the ratio uses schedule(iterations) of the step being taken
    q = _w([3.0, 4.0], torch.float64)
    sched_inner = SGD([q], lambda step: 0.1 if int(step) == 0 else 0.05)
    opt2 = LARC(sched_inner, 0.002)
    q.grad = torch.tensor([0.3, 0.4], dtype=torch.float64)
    opt2.step()
    g = np.array([0.3, 0.4])
    w1 = np.array([3.0, 4.0]) - 0.1 * np_ratio(np.array([3.0, 4.0]), g, 0.1, 0.002, "clip") * g
    np.testing.assert_allclose(q.detach().numpy(), w1, rtol=1e-9)  # optkit keeps lr in fp32
    q.grad = torch.tensor([0.3, 0.4], dtype=torch.float64)
    opt2.step()
    w2 = w1 - 0.05 * np_ratio(w1, np.array([0.3, 0.4]), 0.05, 0.002, "clip") * np.array([0.3, 0.4])
    np.testing.assert_allclose(q.detach().numpy(), w2, rtol=1e-9)


def test_zero_lr_guard_no_nan():
    p, q = _w([0.0, 0.0]), _w([3.0, 4.0])
    opt = LARC(torch.optim.SGD([p, q], lr=0.0), 0.002)
    p.grad, q.grad = torch.tensor([0.3, 0.4]), torch.tensor([0.3, 0.4])
    opt.step()
    assert torch.equal(p.grad, torch.tensor([0.3, 0.4])) and torch.equal(q.grad, torch.tensor([0.3, 0.4]))
    assert torch.isfinite(p.detach()).all()


def test_exclude_predicate_by_name_and_rank():
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(1.0)
    seen = []

    def exclude(name, p):
        seen.append(name)
        return p.ndim <= 1

    opt = LARC(SGD(model.named_parameters(), 0.1), 0.001, exclude=exclude)
    assert seen == ["weight", "bias"]
    model.weight.grad = torch.full((2, 3), 0.5)
    model.bias.grad = torch.full((2,), 0.5)
    opt.step()
    w_ratio = np_ratio(np.ones(6), np.full(6, 0.5), 0.1, 0.001, "clip")
    np.testing.assert_allclose(model.weight.detach().numpy(), 1 - 0.1 * w_ratio * 0.5, rtol=1e-6)
    np.testing.assert_allclose(model.bias.detach().numpy(), 1 - 0.1 * 0.5, rtol=1e-6)


def np_timm_ratio(w, g, lr, tc, wd, eps=1e-8):
    wn, gn = np.linalg.norm(w), np.linalg.norm(g)
    r = tc * wn / (gn + wn * wd + eps) if wn > 0 and gn > 0 else 1.0
    return min(r / lr, 1.0)


def test_wd_in_denominator_matches_timm_formula(rng):
    shapes = [(4, 3), (6,)]
    ws = [rng.normal(size=s) for s in shapes]
    ps = [torch.tensor(w, requires_grad=True) for w in ws]
    opt = LARC(torch.optim.SGD(ps, lr=0.5, momentum=0.9), 0.02, epsilon=1e-8, min_update=0.0,
               wd_in_denominator=1e-2)
    ref_w = [w.copy() for w in ws]
    ref_m = [np.zeros_like(w) for w in ws]
    Lars = load_timm_optim("lars", "Lars")
    tps = [torch.tensor(w, requires_grad=True) for w in ws]
    topt = None
    if Lars is not None:
        topt = Lars(tps, lr=0.5, momentum=0.9, weight_decay=1e-2, trust_coeff=0.02, trust_clip=True)
    for _ in range(3):
        gs = [rng.normal(size=s) for s in shapes]
        for p, g in zip(ps, gs):
            p.grad = torch.tensor(g)
        opt.step()
        for i, g in enumerate(gs):
            gp = (g + 1e-2 * ref_w[i]) * np_timm_ratio(ref_w[i], g, 0.5, 0.02, 1e-2)
            ref_m[i] = 0.9 * ref_m[i] + gp
            ref_w[i] = ref_w[i] - 0.5 * ref_m[i]
        if topt is not None:
            for p, g in zip(tps, gs):
                p.grad = torch.tensor(g)
            topt.step()
    for p, rw in zip(ps, ref_w):
        np.testing.assert_allclose(p.detach().numpy(), rw, rtol=1e-10)
    if topt is not None:
        for p, tp in zip(ps, tps):
            torch.testing.assert_close(p.detach(), tp.detach(), rtol=1e-10, atol=1e-12)


def test_sparse_gradient_densified_duplicates_summed():
    p = _w([[3.0, 4.0], [1.0, 1.0]])
    opt = LARC(torch.optim.SGD([p], lr=0.1), 0.002, "scale")
    seen = _seen(opt)
    p.grad = torch.sparse_coo_tensor(torch.tensor([[0, 0]]), torch.tensor([[0.15, 0.2], [0.15, 0.2]]), (2, 2),
                                     check_invariants=True)
    opt.step()
    w = np.array([[3.0, 4.0], [1.0, 1.0]])
    g = np.array([[0.3, 0.4], [0.0, 0.0]])
    np.testing.assert_allclose(seen[p].numpy(), np_ratio(w, g, 0.1, 0.002, "scale") * g, rtol=1e-6)


def test_strict_parameter_checks_leave_optimizer_untouched():
    p = _w([1.0, 2.0])
    inner = torch.optim.SGD([p], lr=0.1)
    with pytest.raises(ParameterTypeError):
        LARC(inner, 1)  # int where float is declared (OpenSeq2Seq check_params)
    with pytest.raises(ValueError, match="larc_mode"):
        LARC(inner, 0.001, "clipped")
    with pytest.raises(ValueError, match="larc_eta"):
        LARC(inner, -0.001)
    with pytest.raises(ValueError, match="epsilon"):
        LARC(inner, 0.001, epsilon=0.0)
    with pytest.raises(ValueError, match="min_update"):
        LARC(inner, 0.001, min_update=-1.0)
    with pytest.raises(TypeError, match="exclude"):
        LARC(inner, 0.001, exclude="bias")
    with pytest.raises(ValueError, match="wd_in_denominator"):
        LARC(inner, 0.001, wd_in_denominator=-0.1)
    with pytest.raises(ValueError, match="Unknown parameter"):
        LARC.from_params(inner, {"larc_eta": 0.001, "eta": 0.1})
    with pytest.raises(ValueError, match="required"):
        LARC.from_params(inner, {"larc_mode": "scale"})
    assert not inner.state and inner.param_groups[0]["lr"] == 0.1
    opt = LARC.from_params(inner, {"larc_eta": 0.001, "larc_mode": "scale"})
    assert opt.get_config()["larc_mode"] == "scale"


def test_state_dict_round_trip_and_scheduler(rng):
    grads = [rng.normal(size=(3, 2)) for _ in range(4)]
    w0 = rng.normal(size=(3, 2))

    def make():
        p = torch.tensor(w0, dtype=torch.float32, requires_grad=True)
        opt = LARC(SGD([p], 0.1, momentum=0.9), 0.01)
        return p, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def run(p, opt, sched, gs):
        for g in gs:
            p.grad = torch.tensor(g, dtype=torch.float32)
            opt.step()
            sched.step()

    p1, o1, s1 = make()
    run(p1, o1, s1, grads)
    p2, o2, s2 = make()
    run(p2, o2, s2, grads[:2])
    sd, ssd = o2.state_dict(), s2.state_dict()
    p3, o3, s3 = make()
    with torch.no_grad():
        p3.copy_(p2)
    o3.load_state_dict(sd)
    s3.load_state_dict(ssd)
    run(p3, o3, s3, grads[2:])
    assert torch.equal(p1.detach(), p3.detach())
    assert o3.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 4)


def test_add_param_group_rescans_exclusions():
    a, b = _w([[3.0, 4.0]]), _w([1.0, 1.0])
    opt = LARC(torch.optim.SGD([a], lr=0.1), 0.002, exclude=lambda n, p: p.ndim == 1)
    opt.add_param_group({"params": [b]})
    seen = _seen(opt)
    a.grad, b.grad = torch.tensor([[0.3, 0.4]]), torch.tensor([0.5, 0.5])
    opt.step()
    assert torch.equal(seen[b], torch.tensor([0.5, 0.5]))
    np.testing.assert_allclose(seen[a].numpy(), [[0.06, 0.08]], rtol=1e-5)



def _exclude_vectors(name, p):
    return p.ndim <= 1


def _step_against_reference(opt, params, rng, eta=0.001):
    """One step of ``opt`` (a LARC over plain SGD, lr 1, ``exclude`` = vectors) on random gradients, checked
    against the float64 reference ``w ← w − r·g`` (``r = 1`` for vectors) over ``params``, the parameters the
    optimizer holds now; ``last_params`` are the matrices."""
    gs = [rng.normal(size=tuple(p.shape)) for p in params]
    ws = [p.detach().numpy() for p in params]
    want = [w - (1.0 if w.ndim <= 1 else np_ratio(w, g, 1.0, eta, "clip")) * g for w, g in zip(ws, gs)]
    for p, g in zip(params, gs):
        if p.grad is None:
            p.grad = torch.tensor(g)
        else:
            p.grad.copy_(torch.tensor(g))  # (flat buffers: into the gradient view)
    opt.step()
    for p, w in zip(params, want):
        np.testing.assert_allclose(p.detach().numpy(), w, rtol=1e-12, atol=1e-15)
    assert [id(p) for p in opt.last_params] == [id(p) for p in params if p.ndim > 1]


@pytest.mark.parametrize("inner_kind", ["torch", "optkit", "flat"])
def test_exclusions_follow_the_parameters_when_a_group_changes(rng, inner_kind):
    """``exclude`` verdicts belong to the tensors, not to their positions: after a parameter leaves a group
    (with its name) the excluded bias still keeps ``r = 1`` and the remaining weight is still rescaled
    (float64 reference; the position-keyed version rescaled the bias and left the weight alone); a parameter
    appended to the group later is asked about once, the others are not asked again. ``flat``: over flat
    buffers (the steps after the removal still run on them)."""
    import optkit

    w1, b, w2 = (torch.tensor(rng.normal(size=s), requires_grad=True) for s in [(4, 3), (3,), (4, 3)])
    if inner_kind == "flat":
        optkit.flat_parameters([w1, b, w2])
    asked = []

    def exclude(name, p):
        asked.append(name)
        return p.ndim <= 1

    named = [("l0.weight", w1), ("l0.bias", b), ("l1.weight", w2)]
    inner = torch.optim.SGD(named, lr=1.0) if inner_kind == "torch" else SGD(named, 1.0)
    opt = LARC(inner, 0.001, exclude=exclude)
    _step_against_reference(opt, [w1, b, w2], rng)
    group = opt.param_groups[0]
    del group["params"][0], group["param_names"][0]  # w1 leaves the optimizer (frozen, pruned)
    w1_before = w1.detach().clone()
    for _ in range(2):
        _step_against_reference(opt, [b, w2], rng)
    assert torch.equal(w1.detach(), w1_before)
    b2 = torch.tensor(rng.normal(size=5), requires_grad=True)
    group["params"].append(b2)
    group["param_names"].append("l2.bias")
    _step_against_reference(opt, [b, w2, b2], rng)
    assert asked == ["l0.weight", "l0.bias", "l1.weight", "l2.bias"]


def test_exclusions_survive_deepcopy_and_pickle_after_a_group_changed(rng):
    """A copy or an unpickled (parameters, LARC) pair has new tensors: its exclusions are those of its own
    parameters, also after a group lost a parameter before the copy (float64 reference for each)."""
    import pickle

    ps = [torch.tensor(rng.normal(size=s), requires_grad=True) for s in [(4, 3), (3,), (4, 3), (2,)]]
    opt = LARC(SGD(list(ps), 1.0), 0.001, exclude=_exclude_vectors)
    _step_against_reference(opt, ps, rng)
    del opt.param_groups[0]["params"][0]
    kept = ps[1:]
    copies = [copy.deepcopy((kept, opt)), pickle.loads(pickle.dumps((kept, opt)))]
    for params, o in [(kept, opt), *copies]:
        assert all(p is q for p, q in zip(params, o.param_groups[0]["params"]))
        _step_against_reference(o, params, rng)


def test_unpickling_a_position_keyed_larc_keeps_its_exclusions():
    """State pickled by an earlier optkit (exclusions as (group, position) pairs) is converted on load."""
    a, b = _w([[3.0, 4.0]]), _w([1.0, 1.0])
    opt = LARC(torch.optim.SGD([a, b], lr=0.1), 0.002, exclude=_exclude_vectors)
    state = opt.__getstate__()
    del state["_scan"]
    state["_scanned"], state["_excluded"] = {(0, 0), (0, 1)}, {(0, 1)}
    old = LARC.__new__(LARC)
    old.__setstate__(state)
    seen = _seen(old)
    a.grad, b.grad = torch.tensor([[0.3, 0.4]]), torch.tensor([0.5, 0.5])
    old.step()
    assert torch.equal(seen[b], torch.tensor([0.5, 0.5]))
    np.testing.assert_allclose(seen[a].numpy(), [[0.06, 0.08]], rtol=1e-5)


def _ref_larc_keras_sgd(ws, grads, lrs, group_of, eta, mode, keep, wd=None, momentum=0.9, eps=1e-7):
    """Float64 LARC (clip/scale, optional apex/timm ``wd`` in the denominator) over Keras SGD momentum
    (``v ← μ·v − lr·g'``; ``w ← w + v``); ``keep[i]`` False: parameter i is excluded (r = 1, no wd)."""
    ws = [w.copy() for w in ws]
    vs = [np.zeros_like(w) for w in ws]
    for gs in grads:
        for i, g in enumerate(gs):
            lr = lrs[group_of[i]]
            if not keep[i]:
                gp = g
            elif wd is None:
                gp = np_ratio(ws[i], g, lr, eta, mode, eps=eps) * g
            else:
                wn, gn = np.linalg.norm(ws[i]), np.linalg.norm(g)
                raw = eta * wn / (gn + wd * wn + eps)
                r = (min(max(raw / lr, 1e-7), 1.0) if mode == "clip" else max(raw, 1e-7))
                r = r if wn > 0 and gn > 0 else 1.0
                gp = r * (g + wd * ws[i])
            vs[i] = momentum * vs[i] - lr * gp
            ws[i] = ws[i] + vs[i]
    return ws


@pytest.mark.parametrize("case", ["clip", "scale", "exclude", "wd", "two-groups"])
def test_flat_buffers_take_row_runs_and_match_the_reference(rng, case):
    """Over flat buffers (``optkit.flat_parameters``) LARC reads the norms as row norms of the inner
    optimizer's row runs and hands the ratios on as one vector per group (``RowMultipliers``), from the first
    update on; the inner SGD multiplies each cache-sized row chunk by its column. The result is the float64
    reference (with a loss scale to divide out and a skipped attempt that changes nothing); with most
    elements in parameters over a block (``block_numel=8``) the per-tensor path runs instead."""
    import optkit

    shapes = [(6,), (6,), (2, 3), (3, 2), (3, 4), (12,), (4,), (4,), (1,)]
    names = [f"l{i}.weight" if len(s) > 1 else f"l{i}.bias" for i, s in enumerate(shapes)]
    ws = [rng.normal(size=s) for s in shapes]
    grads = [[rng.normal(size=s) * 0.3 for s in shapes] for _ in range(3)]
    mode = "scale" if case == "scale" else "clip"
    eta = 0.02 if mode == "clip" else 0.001
    keep = [not (case == "exclude" and len(s) <= 1) for s in shapes]
    wd = 1e-2 if case == "wd" else None
    lrs = [0.1, 0.03] if case == "two-groups" else [0.1]
    group_of = [0] * 5 + [len(lrs) - 1] * 4
    ref = _ref_larc_keras_sgd(ws, grads, lrs, group_of, eta, mode, keep, wd=wd)
    for block_numel in (1 << 20, 16, 8):
        ts = [torch.tensor(w, requires_grad=True) for w in ws]
        optkit.flat_parameters(ts)
        named = list(zip(names, ts))
        groups = ([{"params": named[:5], "lr": lrs[0]}, {"params": named[5:], "lr": lrs[1]}]
                  if case == "two-groups" else named)
        # (wd_in_denominator writes g + wd·v into the flat gradient only when the step may use the gradients
        # as scratch, as the train op lets it; otherwise into per-tensor copies: no row runs at block 16)
        scratch = wd is not None and block_numel != 16
        opt = LARC(SGD(groups, 0.1, momentum=0.9, block_numel=block_numel, scratch_grads=scratch), eta, mode,
                   exclude=(lambda n, p: p.ndim <= 1) if case == "exclude" else None, wd_in_denominator=wd)
        flat_steps = []
        original = opt._flat_step
        opt._flat_step = lambda *a, _n=flat_steps, _f=original: (_n.append(1), _f(*a))
        for i, gs in enumerate(grads):
            if i == 1:  # a skipped attempt first: nothing moves
                for t in ts:
                    t.grad.fill_(float("nan"))
                assert_skip_changes_nothing(opt, ts)
            for t, g in zip(ts, gs):
                t.grad.copy_(torch.tensor(g) * 8.0)  # a loss scale of 8, divided out through grad_scale
            opt.grad_scale = torch.tensor(8.0)
            opt.step()
            del opt.grad_scale
        assert len(flat_steps) == (0 if block_numel == 8 or (wd and not scratch) else 4), block_numel
        for t, r in zip(ts, ref):
            np.testing.assert_allclose(t.detach().numpy(), r, rtol=1e-9, atol=1e-12)
        kept = [t for t, k in zip(ts, keep) if k]
        assert len(opt.last_params) == len(kept) and all(a is b for a, b in zip(opt.last_params, kept))
        assert opt.last_ratios.shape == (len(kept),)


def test_flat_step_honours_an_inner_step_pre_hook_that_replaces_a_gradient(rng):
    """The inner optimizer re-reads the gradients when a step pre-hook could have changed them: a hook that
    replaces one gradient (no longer a view of the flat buffer) gives the same result over flat buffers as
    per tensor (the ratios are LARC's, from the gradients it saw)."""
    import optkit

    shapes = [(4, 3), (4, 3), (5,)]
    ws = [rng.normal(size=s) for s in shapes]
    gs = [rng.normal(size=s) for s in shapes]
    results = []
    for flat in (False, True):
        ts = [torch.tensor(w, requires_grad=True) for w in ws]
        for t in ts:
            t.grad = torch.zeros_like(t)
        if flat:
            optkit.flat_parameters(ts)
        inner = SGD(ts, 0.1, momentum=0.9)
        inner.register_step_pre_hook(lambda opt, args, kwargs, _t=ts[0]: setattr(_t, "grad", _t.grad * 2.0))
        opt = LARC(inner, 0.01)
        for _ in range(3):
            for t, g in zip(ts, gs):
                t.grad.copy_(torch.tensor(g))  # (into the flat view, or the hook's replacement)
            opt.step()
        results.append([t.detach().clone() for t in ts])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_tensors_fold_the_ratios_into_the_sgd_kernel(rng, dtype):
    """With tensors of at least ``FOLD_MIN_NUMEL`` elements on average, optkit SGD takes LARC's ratios into
    its fused kernel (``grad_scale = −1/(lr·k·r)``, one call per tensor; float64 folds them into the gradient
    in float64) instead of the blocked multiply; with a loss scale to divide out and a skipped attempt, the
    result is the float64 reference."""
    from optkit._core.passes import FOLD_MIN_NUMEL

    shapes = [(512, 300), (FOLD_MIN_NUMEL + 7,), (3,)]
    ws = [rng.normal(size=s) for s in shapes]
    grads = [[rng.normal(size=s) * 0.3 for s in shapes] for _ in range(3)]
    ref = _ref_larc_keras_sgd(ws, grads, [0.1], [0, 0, 0], 0.02, "clip", [True] * 3)
    ts = [torch.tensor(w, dtype=dtype, requires_grad=True) for w in ws]
    opt = LARC(SGD(ts, 0.1, momentum=0.9), 0.02)
    assert opt.optimizer._folds_mult(opt.param_groups[0])
    for i, gs in enumerate(grads):
        for t, g in zip(ts, gs):
            t.grad = torch.tensor(g, dtype=dtype) * 4.0
        if i == 1:
            assert_skip_changes_nothing(opt, ts, grad_scale=torch.tensor(4.0))
            for t, g in zip(ts, gs):
                t.grad = torch.tensor(g, dtype=dtype) * 4.0
        opt.grad_scale = torch.tensor(4.0)
        opt.step()
        del opt.grad_scale
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=1e-6)
    for t, r in zip(ts, ref):
        np.testing.assert_allclose(t.detach().double().numpy(), r, **tol)


@pytest.mark.parametrize("mode,wd", [("clip", None), ("scale", None), ("clip", 0.01)])
def test_jit_compile_inner_takes_the_compiled_norm_pass(rng, monkeypatch, mode, wd):
    """Over an optkit optimizer built with ``jit_compile=True``, LARC reads ``‖v‖`` and ``‖g‖`` with the
    compiled norm pass (:func:`optkit._core.chain.norm_sums`, counted), also for :meth:`LARC.trust_ratios`;
    the result is the float64 reference (a loss scale to divide out, a skipped attempt, an excluded
    parameter). When the pass fails to compile: one warning, and the eager LARC's result exactly; past
    ``COMPILE_WARN_TENSORS`` parameters, the eager norms."""
    import warnings

    from compiled_passes import VARIANTS, set_variant
    from optkit._core import chain as _compile

    shapes = [(70, 90), (5,), (4, 3, 2)]  # the first is longer than a row of the split (4,096)
    ws = [rng.normal(size=s) for s in shapes]
    grads = [[rng.normal(size=s) * 0.3 for s in shapes] for _ in range(3)]
    keep = [True, False, True]
    ref = _ref_larc_keras_sgd(ws, grads, [0.1], [0, 0, 0], 0.02, mode, keep, wd=wd)
    calls: list[int] = []
    runs = []
    for variant in VARIANTS:
        set_variant(monkeypatch, _compile.norm_sums, variant, calls)
        ts = [torch.tensor(w, dtype=torch.float64, requires_grad=True) for w in ws]
        opt = LARC(SGD(ts, 0.1, momentum=0.9, jit_compile=variant != "eager"), 0.02, mode,
                   exclude=lambda name, p: p.ndim == 1, wd_in_denominator=wd)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i, gs in enumerate(grads):
                for t, g in zip(ts, gs):
                    t.grad = torch.tensor(g) * 4.0
                if i == 1:
                    params, r = opt.trust_ratios(grad_scale=torch.tensor(4.0))
                    assert len(params) == 2 and r.dtype == torch.float64
                    assert_skip_changes_nothing(opt, ts, grad_scale=torch.tensor(4.0))
                    for t, g in zip(ts, gs):
                        t.grad = torch.tensor(g) * 4.0
                opt.grad_scale = torch.tensor(4.0)
                opt.step()
                del opt.grad_scale
        fell_back = sum("running eagerly" in str(w.message) for w in caught)
        assert fell_back == (1 if variant == "jit-fails" else 0)
        if variant == "jit":  # every step, the look-ahead, the skipped attempt: the two rescaled parameters
            assert calls and set(calls) == {2}
        else:
            assert not calls
        for t, r in zip(ts, ref):
            np.testing.assert_allclose(t.detach().numpy(), r, rtol=1e-10, atol=1e-12)
        runs.append([t.detach() for t in ts])
    for a, b in zip(runs[0], runs[2]):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert len(runs) == 4
