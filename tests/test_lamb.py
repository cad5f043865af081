"""optkit.LAMB against a float64 NumPy reference of You et al. 2019 Algorithm 2 (``reference_rules.lamb``),
Keras 3 and timm golden values, and timm's ``Lamb`` itself when its file is installed.

Upstream sources of the golden values:

* Keras 3, ``keras/src/optimizers/lamb_test.py`` (repository ``keras-team/keras``): ``test_single_step`` and
  ``test_correctness_with_golden``. Keras's ``Lamb`` always adapts, has no weight decay inside the direction
  and uses ``epsilon=1e-7``: optkit's ``LAMB(always_adapt=True, epsilon=1e-7)``.
* timm, ``timm/optim/lamb.py`` (repository ``huggingface/pytorch-image-models``, release 1.0.31). timm's test
  suite (``tests/test_optim.py``, ``test_lamb``) checks descent only (``_test_rosenbrock``, ``_test_model``,
  ported below); the numeric values in :data:`TIMM_GOLDEN` were produced by that release's ``Lamb`` on the
  float64 problem of :func:`_timm_problem` and are compared with optkit's equivalent configuration (and, when
  timm's ``lamb.py`` is present, with a live run of it).
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import numpy as np
import pytest
import torch

import optkit
from reference_rules import Reference
from scaled_grads import assert_skip_changes_nothing, step_checking_grads
from timm_optim import load_timm_optim

F64 = torch.float64


def _ref_run(ws, grads_seq, lr, hp, base=None, per_tensor=None):
    ref = Reference("lamb", ws, hp, {"lr": lr, **(base or {})}, per_tensor)
    for gs in grads_seq:
        ref.step(gs)
    return ref.ws


def _opt_run(ws, grads_seq, dtype=F64, names=None, **kw):
    ts = [torch.tensor(w, dtype=dtype, requires_grad=True) for w in ws]
    params = ts if names is None else list(zip(names, ts))
    opt = optkit.LAMB(params, **kw)
    for gs in grads_seq:
        for t, g in zip(ts, gs):
            t.grad = torch.tensor(g, dtype=dtype)
        opt.step()
    return [t.detach().double().numpy() for t in ts], opt


def _problem(seed, shapes=((5, 4), (4,), (3, 2, 2)), steps=4, w_scale=0.5):
    rng = np.random.default_rng(seed)
    ws = [rng.standard_normal(s) * w_scale for s in shapes]
    grads = [[rng.standard_normal(s) for s in shapes] for _ in range(steps)]
    return ws, grads


# ------------------------------------------------------------------------------------------------ reference

CASES = {
    "paper": dict(weight_decay=0.01),
    "no-bias-correction": dict(weight_decay=0.01, bias_correction=False, beta1=0.8, beta2=0.99),
    "always-adapt-no-wd": dict(always_adapt=True),
    "clamp": dict(weight_decay=0.01, min_coeff=0.9, max_coeff=1.1),
    "lambc": dict(weight_decay=0.01, lambc=True),
    "adam-like": dict(),  # weight_decay 0 and always_adapt False: no tensor adapts (timm's rule)
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_reference(case):
    """Seeded float64 weights and gradients, four steps, every option set; weights of scale 0.5 and 3 so
    that the trust ratio falls on both sides of 1 (the clamp and LAMBC bind)."""
    kw = CASES[case]
    for w_scale in (0.5, 3.0):
        ws, grads = _problem(1, w_scale=w_scale)
        got, _ = _opt_run(ws, grads, learning_rate=0.05, **kw)
        ref = _ref_run(ws, grads, 0.05, kw)
        for g, r in zip(got, ref):
            np.testing.assert_allclose(g, r, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("case", ["paper", "clamp", "always-adapt-no-wd"])
def test_blocks_of_many_tensors_and_a_skip_match_the_reference(case, dtype):
    """A block of more than four tensors takes pass 2's folded form (``s`` multiplied into the gradient
    chunks, one fused call), a block of few the per-tensor form (``s`` as the kernel's tensor learning rate);
    a skipped attempt (``found_inf``) between steps leaves weights, moments and the gradients themselves as
    they were, so the retried step on the same gradients is the reference's."""
    shapes = [(5, 4), (4,), (3, 2, 2), (7,), (2, 3), (6,), (4, 4), (1,), (3,)]
    names = [f"l{i}.weight" if len(sh) > 1 else f"l{i}.bias" for i, sh in enumerate(shapes)]
    ws, grads = _problem(7, shapes=shapes, w_scale=2.0)
    kw = CASES[case]
    ref = _ref_run(ws, grads, 0.05, kw)
    tol = dict(rtol=1e-11, atol=1e-12) if dtype == F64 else dict(rtol=2e-5, atol=2e-6)
    for block_numel in (1 << 20, 24):  # all nine tensors in one block; blocks of a few tensors
        ts = [torch.tensor(w, dtype=dtype, requires_grad=True) for w in ws]
        opt = optkit.LAMB(list(zip(names, ts)), 0.05, block_numel=block_numel, **kw)
        for i, gs in enumerate(grads):
            for t, g in zip(ts, gs):
                t.grad = torch.tensor(g, dtype=dtype)
            if i == 2:
                before = [t.detach().clone() for t in ts] + [t.grad.clone() for t in ts] + [
                    v.clone() for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
                opt.found_inf = torch.ones(())
                opt.step()
                del opt.found_inf
                after = [t.detach() for t in ts] + [t.grad for t in ts] + [
                    v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
                assert all(torch.equal(x, y) for x, y in zip(after, before))
            opt.step()
        sizes = [len(b.owners) for b in list(opt._plans.values())[0].blocks]
        assert sizes == [9] if block_numel == 1 << 20 else (len(sizes) > 1 and min(sizes) <= 4)
        for t, r in zip(ts, ref):
            np.testing.assert_allclose(t.detach().double().numpy(), r, **tol)


@pytest.mark.parametrize("layout", ["one-block", "small-blocks", "flat-rows", "flat-rows-jit"])
def test_skip_with_overflowed_gradients_leaves_everything_as_it_was(layout):
    """A skipped step (``found_inf``) after an overflow (a NaN in the gradients, so trust ratios are NaN)
    leaves the weights, the moments and the gradients bit for bit as they were, on every pass-2 form."""
    shapes = [(5, 4), (4,), (3, 2, 2), (7,), (2, 3), (6,), (4, 4), (1,), (3,)]
    if layout.startswith("flat-rows"):
        shapes = [(6,)] * 6 + [(2, 3)] * 3
    ws, grads = _problem(11, shapes=shapes, steps=2)
    ts = [torch.tensor(w, dtype=torch.float32, requires_grad=True) for w in ws]
    for t in ts:
        t.grad = torch.zeros_like(t)
    if layout.startswith("flat-rows"):
        optkit.flat_parameters(ts)
    opt = optkit.LAMB(ts, 0.05, weight_decay=0.01, block_numel=24 if layout == "small-blocks" else 1 << 20,
                      jit_compile=layout.endswith("jit"))
    for t, g in zip(ts, grads[0]):
        t.grad.copy_(torch.tensor(g))
    opt.step()  # state exists, the plan (and the flat part) is built
    for t, g in zip(ts, grads[1]):
        t.grad.copy_(torch.tensor(g))
    ts[0].grad.view(-1)[0] = float("nan")
    before = [t.detach().clone() for t in ts] + [t.grad.clone() for t in ts] + [
        v.clone() for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    opt.found_inf = torch.ones(())
    opt.step()
    after = [t.detach() for t in ts] + [t.grad for t in ts] + [
        v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    assert all(torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num())
               for x, y in zip(after, before))
    if layout.endswith("jit"):
        assert opt._compile_state == "ok" and list(opt._plans.values())[0].flat_active


@pytest.mark.parametrize("case,jit", [(c, False) for c in ("paper", "no-bias-correction", "clamp", "lambc",
                                                               "adam-like")]
                         + [("paper", True), ("no-bias-correction", True), ("adam-like", True)])
def test_flat_buffers_take_row_runs_and_match_the_reference(case, jit, monkeypatch):
    """Over flat buffers (``optkit.flat_parameters``) LAMB steps row runs (consecutive parameters of one size
    as the rows of a matrix: row norms, per-row factor columns), also when a run is cut across cache chunks
    (``block_numel``) and with a per-name exclusion inside a run, or the per-tensor pass when most elements
    are in parameters over a block; the result is the float64 reference, a skipped step (``found_inf``)
    changes nothing, and the state dict is the per-tensor one. With ``jit_compile`` the compiled row sums
    and the compiled rule run over the whole run matrices instead (one graph whatever the number of
    parameters)."""
    shapes = [(6,), (6,), (6,), (2, 3), (3, 2, 2), (3, 4), (4,), (4,), (1,)]
    names = [f"l{i}.weight" if len(s) > 1 else f"l{i}.bias" for i, s in enumerate(shapes)]
    names[1] = "l1.scale"
    ws, grads = _problem(3, shapes=shapes)
    kw = {**CASES[case], "skip_list": ["scale"]}
    per = [{"_skipped": True} if "scale" in n else {} for n in names]
    ref = _ref_run(ws, grads, 0.05, {k: v for k, v in kw.items() if k != "skip_list"}, per_tensor=per)
    row_steps = []
    entry = "_prepare_rows_compiled" if jit else "_prepare_rows"
    original = getattr(optkit.LAMB, entry)
    monkeypatch.setattr(optkit.LAMB, entry, lambda self, *a: (row_steps.append(1), original(self, *a))[1])
    tol = 1e-10
    if jit:
        kw["jit_compile"] = True
    for block_numel in (1 << 20, 16, 8):  # one chunk; runs cut across chunks; most elements over a block
        row_steps.clear()
        ts = [torch.tensor(w, dtype=F64, requires_grad=True) for w in ws]
        for t in ts:
            t.grad = torch.zeros_like(t)
        optkit.flat_parameters(ts)
        # (the eager row pass keeps u in the gradient rows: a step that may use the gradients as scratch,
        # as the train op's; with the caller's gradients LAMB takes the per-tensor chunks over the buffer)
        opt = optkit.LAMB(list(zip(names, ts)), 0.05, block_numel=block_numel, scratch_grads=not jit, **kw)
        for i, gs in enumerate(grads):
            for t, g in zip(ts, gs):
                t.grad.copy_(torch.tensor(g))
            if i == 2:  # a skipped attempt first: nothing moves
                assert_skip_changes_nothing(opt, ts)
            opt.step()
        flat = list(opt._plans.values())[0].flat
        # rows unless over a quarter of the elements sit in parameters larger than a block (then the
        # per-tensor pass cuts them into cache-sized chunks, over the same flat buffer)
        assert flat.rows_pay == (block_numel != 8) and bool(row_steps) == flat.rows_pay
        assert len(flat.row_blocks) > (1 if block_numel == 16 else 0)
        if jit:
            assert opt._compile_state == "ok"
        for t, r in zip(ts, ref):
            np.testing.assert_allclose(t.detach().numpy(), r, rtol=tol if jit else 1e-11,
                                       atol=tol if jit else 1e-12)
        sd = opt.state_dict()["state"]
        assert all(sd[i]["exp_avg"].shape == t.shape for i, t in enumerate(ts))


def test_options_change_the_result():
    """The clamp and LAMBC are not no-ops on the reference problem (guards the test above)."""
    ws, grads = _problem(1, w_scale=3.0)
    base = _ref_run(ws, grads, 0.05, CASES["paper"])
    for case in ("clamp", "lambc", "adam-like"):
        other = _ref_run(ws, grads, 0.05, CASES[case])
        assert max(np.abs(a - b).max() for a, b in zip(base, other)) > 1e-3, case


def test_skip_list_exclude_1d_and_weight_decay_exclusions():
    """``skip_list`` (by name) and ``exclude_1d``: no decay, no adaptation; ``exclude_from_weight_decay``: no
    decay, hence (timm's rule) no adaptation; ``always_adapt`` re-enables adaptation for the latter only."""
    names = ["enc.weight", "enc.bias", "conv.weight"]
    ws, grads = _problem(2)
    for kw, per in [
        (dict(skip_list=["bias"]), [{}, {"_skipped": True}, {}]),
        (dict(exclude_1d=True), [{}, {"_skipped": True}, {}]),
        (dict(skip_list=["conv"], always_adapt=True), [{}, {}, {"_skipped": True}]),
    ]:
        got, _ = _opt_run(ws, grads, names=names, learning_rate=0.05, weight_decay=0.1, **kw)
        ref = _ref_run(ws, grads, 0.05, {"weight_decay": 0.1, **kw}, per_tensor=per)
        for g, r in zip(got, ref):
            np.testing.assert_allclose(g, r, rtol=1e-11, atol=1e-12)
    for always in (False, True):
        ts = [torch.tensor(w, requires_grad=True) for w in ws]
        opt = optkit.LAMB(list(zip(names, ts)), 0.05, weight_decay=0.1, always_adapt=always)
        opt.exclude_from_weight_decay(var_names=["enc"])
        for gs in grads:
            for t, g in zip(ts, gs):
                t.grad = torch.tensor(g)
            opt.step()
        ref = _ref_run(ws, grads, 0.05, {"weight_decay": 0.1, "always_adapt": always},
                       per_tensor=[{"_decayed": False}, {"_decayed": False}, {}])
        for t, r in zip(ts, ref):
            np.testing.assert_allclose(t.detach().numpy(), r, rtol=1e-11, atol=1e-12)


def test_exclude_from_adaptation_group_key_and_group_weight_decay():
    """A param group may carry ``"exclude_from_adaptation": True`` (what :func:`optkit.param_groups`
    writes) and its own ``weight_decay``."""
    ws, grads = _problem(3)
    ts = [torch.tensor(w, requires_grad=True) for w in ws]
    groups = [{"params": [ts[0]]}, {"params": [ts[1]], "weight_decay": 0.0},
              {"params": [ts[2]], "exclude_from_adaptation": True}]
    opt = optkit.LAMB(groups, 0.05, weight_decay=0.02)
    for gs in grads:
        for t, g in zip(ts, gs):
            t.grad = torch.tensor(g)
        opt.step()
    refs = [_ref_run([ws[0]], [[g[0]] for g in grads], 0.05, {"weight_decay": 0.02}),
            _ref_run([ws[1]], [[g[1]] for g in grads], 0.05, {"weight_decay": 0.0}),
            _ref_run([ws[2]], [[g[2]] for g in grads], 0.05,
                     {"weight_decay": 0.02, "exclude_from_adaptation": True})]
    for t, r in zip(ts, refs):
        np.testing.assert_allclose(t.detach().numpy(), r[0], rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("block_numel", [1 << 20, 16])
def test_flat_buffers_default_mode_keep_row_runs_and_leave_grad(dtype, block_numel, monkeypatch):
    """By default (``scratch_grads=False``) LAMB over flat buffers still steps the row runs, on a flat copy
    of the flat gradient filled chunk by chunk: ``.grad`` is left bitwise as it was (``g/S`` under a loss
    scale ``S``), the weights and moments are bit for bit those of ``scratch_grads=True`` (the same kernels
    on the same values) and the float64 reference's."""
    shapes = [(6,), (6,), (6,), (2, 3), (3, 2, 2), (3, 4), (4,), (4,), (1,)]
    names = [f"l{i}.weight" if len(s) > 1 else f"l{i}.bias" for i, s in enumerate(shapes)]
    names[1] = "l1.scale"
    ws, grads = _problem(21, shapes=shapes, w_scale=2.0)
    kw = {"weight_decay": 0.01, "skip_list": ["scale"]}
    per = [{"_skipped": True} if "scale" in n else {} for n in names]
    ref = _ref_run(ws, grads, 0.05, {"weight_decay": 0.01}, per_tensor=per)
    row_steps = []
    original = optkit.LAMB._prepare_rows
    monkeypatch.setattr(optkit.LAMB, "_prepare_rows",
                        lambda self, *a: (row_steps.append(self.scratch_grads), original(self, *a))[1])
    tol = 1e-11 if dtype == F64 else 2e-5
    for scale in (None, 64.0):
        runs = []
        for scratch in (False, True):
            row_steps.clear()
            ts = [torch.tensor(w, dtype=dtype, requires_grad=True) for w in ws]
            for t in ts:
                t.grad = torch.zeros_like(t)
            optkit.flat_parameters(ts)
            opt = optkit.LAMB(list(zip(names, ts)), 0.05, block_numel=block_numel, scratch_grads=scratch,
                              **kw)
            for gs in grads:
                for t, g in zip(ts, gs):
                    t.grad.copy_(torch.tensor(g if scale is None else np.asarray(g) * scale))
                step_checking_grads(opt, ts, scale, scratch)
            plan = list(opt._plans.values())[0]
            assert plan.flat_active and plan.flat.rows_pay and row_steps == [scratch] * len(grads)
            assert len(plan.flat.row_blocks) > (1 if block_numel == 16 else 0)
            for t, r in zip(ts, ref):
                np.testing.assert_allclose(t.detach().double().numpy(), r, rtol=tol, atol=tol)
            runs.append((ts, [opt.state[t][s].clone() for t in ts for s in ("exp_avg", "exp_avg_sq")]))
        (wa, sa), (wb, sb) = runs
        assert all(torch.equal(a, b) for a, b in zip(wa + sa, wb + sb))


def test_zero_norms_give_ratio_one():
    """A zero weight or a zero update takes ``r = 1`` (no division by zero)."""
    ws = [np.zeros((3, 2)), np.ones(4)]
    grads = [[np.ones((3, 2)), np.zeros(4)]] * 2
    got, _ = _opt_run(ws, grads, learning_rate=0.1, always_adapt=True)
    ref = _ref_run(ws, grads, 0.1, {"always_adapt": True})
    for g, r in zip(got, ref):
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, r, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("layout,coeff", [("tensors", "min"), ("tensors", "max"), ("flat", "min"),
                                          ("flat", "max"), ("jit", "min")])
def test_zero_norm_ratio_one_is_not_clamped(layout, coeff):
    """DeepSpeed's fused LAMB kernel clamps ``‖w‖/‖u‖`` into ``[min_coeff, max_coeff]`` only when both norms
    are positive: the ratio 1 of a zero weight (``l0``, zero at the first step) stays 1 with
    ``min_coeff > 1`` and with ``max_coeff < 1``, and a zero update (``l2``: zero gradients, excluded from
    decay) stays finite. Eager per-tensor pass, flat buffers (row runs) and ``jit_compile``, against the
    float64 reference."""
    shapes = [(6,), (2, 3), (6,), (3, 2), (6,)] if layout == "flat" else [(3, 2), (5, 4), (4,), (3, 2, 2)]
    names = [f"l{i}.weight" for i in range(len(shapes))]
    names[2] = "l2.still"
    ws, grads = _problem(17, shapes=shapes, steps=3, w_scale=2.0)
    ws[0] = np.zeros(shapes[0])
    for gs in grads:
        gs[2] = np.zeros(shapes[2])
    kw = dict(weight_decay=0.01, always_adapt=True)
    kw.update(min_coeff=2.0) if coeff == "min" else kw.update(max_coeff=0.5)
    ref = _ref_run(ws, grads, 0.05, kw, per_tensor=[{"_decayed": n != "l2.still"} for n in names])
    ts = [torch.tensor(w, dtype=F64, requires_grad=True) for w in ws]
    for t in ts:
        t.grad = torch.zeros_like(t)
    if layout == "flat":
        optkit.flat_parameters(ts)
    # (the row runs keep u in the gradient rows: a step that may use the gradients as scratch, the train op's)
    opt = optkit.LAMB(list(zip(names, ts)), 0.05, jit_compile=layout == "jit", scratch_grads=layout == "flat",
                      **kw)
    opt.exclude_from_weight_decay(var_names=["still"])
    for gs in grads:
        for t, g in zip(ts, gs):
            t.grad.copy_(torch.tensor(g))
        opt.step()
    if layout == "flat":
        assert list(opt._plans.values())[0].flat_active and list(opt._plans.values())[0].flat.rows_pay
    if layout == "jit":
        assert opt._compile_state == "ok"
    tol = 1e-10 if layout == "jit" else 1e-12
    for t, r in zip(ts, ref):
        np.testing.assert_allclose(t.detach().numpy(), r, rtol=tol, atol=tol)


def test_global_grad_norm_clip_is_nvlamb_prenormalisation():
    """``global_grad_norm_clip=c``: ``g / max(1, ‖g‖_global / c)`` over all tensors before the moments."""
    ws, grads = _problem(4)
    c = 1.5
    got, opt = _opt_run(ws, grads, learning_rate=0.05, weight_decay=0.01, global_grad_norm_clip=c)
    pre = []
    for gs in grads:
        n = np.sqrt(sum(np.sum(g * g) for g in gs))
        pre.append([g / max(1.0, n / c) for g in gs])
    ref = _ref_run(ws, pre, 0.05, {"weight_decay": 0.01})
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, rtol=1e-11, atol=1e-12)
    cfg = opt.get_config()
    assert cfg["global_grad_norm_clip"] == c and cfg["global_clipnorm"] is None
    again = optkit.LAMB.from_config(cfg, [torch.zeros(2, requires_grad=True)])
    assert again.get_config() == cfg


def test_chunked_large_tensors_and_mixed_blocks():
    """Tensors larger than ``block_numel`` are cut into chunks (norms summed per tensor), small ones packed:
    the same result as the reference."""
    ws, grads = _problem(5, shapes=((300, 70), (17,), (50, 3)), steps=3)
    got, _ = _opt_run(ws, grads, learning_rate=0.05, weight_decay=0.01, block_numel=1000)
    ref = _ref_run(ws, grads, 0.05, {"weight_decay": 0.01})
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_update_norm_is_lr_times_weight_norm(dtype):
    """Half-precision moments: the applied direction is the one whose norm gave the trust ratio, so an
    adapted tensor moves by exactly ``lr·‖w‖`` (``‖lr·r·u‖`` with ``r = ‖w‖/‖u‖``), also where ``v`` rounds
    to 0 in half precision (small gradients on a large tensor, cut into chunks)."""
    torch.manual_seed(0)
    w = (torch.randn(700, 300) * 0.5).to(dtype).requires_grad_()
    w0 = w.detach().double().clone()
    opt = optkit.LAMB([w], 0.05, weight_decay=0.01, block_numel=50_000)
    for _ in range(2):
        w.grad = (torch.randn(700, 300) * 0.01).to(dtype)
        before = w.detach().double().clone()
        opt.step()
        moved = float((w.detach().double() - before).norm())
        np.testing.assert_allclose(moved, 0.05 * float(before.norm()), rtol=2e-2)
    assert float((w.detach().double() - w0).norm()) > 0


# ------------------------------------------------------------------------------------------------ Keras 3


def test_keras_single_step():
    """keras/src/optimizers/lamb_test.py ``test_single_step``: lr 0.5, one step."""
    w = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    opt = optkit.LAMB([w], learning_rate=0.5, epsilon=1e-7, always_adapt=True)
    opt.apply_gradients([(torch.tensor([1.0, 6.0, 7.0, 2.0]), w)])
    np.testing.assert_allclose(w.detach().numpy(), [-0.3693, 0.6306, 1.6306, 2.6306], rtol=1e-4, atol=1e-4)


def test_keras_correctness_with_golden():
    """keras/src/optimizers/lamb_test.py ``test_correctness_with_golden``: default lr 0.001, ones(10), a first
    gradient of 0.01 then 0.1 … 1.0."""
    x = torch.ones(10, requires_grad=True)
    opt = optkit.LAMB([x], epsilon=1e-7, always_adapt=True)
    grads = torch.arange(0.1, 1.1, 0.1)
    golden = np.tile([[0.999], [0.9982], [0.9974], [0.9965], [0.9955]], (1, 10))
    opt.apply_gradients([(torch.full((10,), 0.01), x)])
    for i in range(5):
        np.testing.assert_allclose(x.detach().numpy(), golden[i], rtol=5e-4, atol=5e-4)
        opt.apply_gradients([(grads, x)])


# ------------------------------------------------------------------------------------------------ timm


def _timm_problem():
    w = torch.tensor([[0.5, -1.0, 1.5], [2.0, -0.25, 0.75]], dtype=F64, requires_grad=True)
    b = torch.tensor([0.1, -0.2], dtype=F64, requires_grad=True)
    grads = [(torch.tensor([[0.3, -0.1 * k, 0.2], [-0.4, 0.5, 0.1 * k]], dtype=F64),
              torch.tensor([1.0 + k, -2.0], dtype=F64)) for k in range(3)]
    return w, b, grads


#: timm 1.0.31 ``Lamb`` over groups ``[{w}, {b, weight_decay: 0}]`` (defaults: weight_decay 0.01, eps 1e-6,
#: max_grad_norm 1.0), three steps of :func:`_timm_problem`; keys: (timm kwargs, optkit kwargs).
TIMM_GOLDEN = [
    (dict(lr=0.1), dict(weight_decay=0.01, global_grad_norm_clip=1.0),
     [[0.1075841090723152, -0.7943934660256999, 1.1036274123938985],
      [2.3825207855366513, -0.6394484525218798, 0.5453830606578615]],
     [-0.1975675137659465, 0.09572422507643989]),
    (dict(lr=0.1, max_grad_norm=None, trust_clip=True, weight_decay=0.1), dict(weight_decay=0.1, lambc=True),
     [[0.18814049003003397, -0.8137738747176789, 1.1584399850425755],
      [2.2376072574768555, -0.5395841559811873, 0.571199124717679]],
     [-0.19231811962368325, 0.0999998500000742]),
    (dict(lr=0.1, max_grad_norm=None, always_adapt=True, bias_correction=False),
     dict(weight_decay=0.01, always_adapt=True, bias_correction=False),
     [[0.10610235485328089, -0.8018590875968276, 1.1051184911719554],
      [2.3914059561044607, -0.6431605491339324, 0.5521090573114371]],
     [0.05742754489736521, -0.15636327248461804]),
]


@pytest.mark.parametrize("i", range(len(TIMM_GOLDEN)))
def test_timm_golden_values(i):
    timm_kw, optkit_kw, w_gold, b_gold = TIMM_GOLDEN[i]
    w, b, grads = _timm_problem()
    lr = timm_kw["lr"]
    opt = optkit.LAMB([{"params": [w]}, {"params": [b], "weight_decay": 0.0}], lr, **optkit_kw)
    for gw, gb in grads:
        w.grad, b.grad = gw.clone(), gb.clone()
        opt.step()
    np.testing.assert_allclose(w.detach().numpy(), w_gold, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(b.detach().numpy(), b_gold, rtol=1e-12, atol=1e-14)
    Lamb = load_timm_optim("lamb", "Lamb")
    if Lamb is None:
        return
    tw, tb, _ = _timm_problem()
    topt = Lamb([{"params": [tw]}, {"params": [tb], "weight_decay": 0.0}], **timm_kw)
    for gw, gb in grads:
        tw.grad, tb.grad = gw.clone(), gb.clone()
        topt.step()
    np.testing.assert_allclose(tw.detach().numpy(), w_gold, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(tb.detach().numpy(), b_gold, rtol=1e-12, atol=1e-14)


def test_timm_lamb_live_on_random_problem():
    """A live float64 comparison with timm's ``Lamb`` (weight decay 0.05, max_grad_norm 2.0) over five
    steps of seeded random gradients, when timm's file is available."""
    Lamb = load_timm_optim("lamb", "Lamb")
    if Lamb is None:
        pytest.skip("timm's lamb.py is not installed")
    ws, grads = _problem(6, steps=5)
    tts = [torch.tensor(w, requires_grad=True) for w in ws]
    topt = Lamb(tts, lr=0.02, weight_decay=0.05, max_grad_norm=2.0)
    got, _ = _opt_run(ws, grads, learning_rate=0.02, weight_decay=0.05, global_grad_norm_clip=2.0)
    for gs in grads:
        for t, g in zip(tts, gs):
            t.grad = torch.tensor(g)
        topt.step()
    for g, t in zip(got, tts):
        np.testing.assert_allclose(g, t.detach().numpy(), rtol=1e-11, atol=1e-13)


def test_timm_model_descends():
    """timm tests/test_optim.py ``test_lamb`` → ``_test_model``: Linear(2, 3) → Sigmoid → Linear(3, 1) →
    Sigmoid with timm's fixed weights, loss = sum of outputs, lr 1e-3 (timm's factory default weight decay
    and max_grad_norm): 20 strictly decreasing losses."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1),
                                torch.nn.Sigmoid()).double()
    weights = {"0.weight": [[-0.2109, -0.4976], [-0.1413, -0.3420], [-0.2524, 0.6976]],
               "0.bias": [-0.1085, -0.2979, 0.6892], "2.weight": [[-0.0508, -0.3941, -0.2843]],
               "2.bias": [-0.0711]}
    model.load_state_dict({k: torch.tensor(v, dtype=F64) for k, v in weights.items()})
    inp = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], dtype=F64).reshape(3, 2)
    opt = optkit.create_optimizer(model, "LAMB", lr=1e-3, weight_decay=0.01, global_grad_norm_clip=1.0)
    prev = float("inf")
    for _ in range(20):
        opt.zero_grad()
        loss = model(inp).sum()
        loss.backward()
        assert loss.item() < prev
        prev = loss.item()
        opt.step()


def test_timm_rosenbrock():
    """timm ``_test_rosenbrock`` (lr 1e-3, 2000 steps from [1.5, 1.5], always adapting): the distance to
    the minimum [1, 1] must not grow."""
    p = torch.nn.Parameter(torch.tensor([1.5, 1.5], dtype=F64))
    opt = optkit.LAMB([p], 1e-3, always_adapt=True)
    start = float(p.detach().dist(torch.ones(2, dtype=F64)))
    for _ in range(2000):
        x, y = p.detach().tolist()
        p.grad = torch.tensor([-400 * x * (y - x * x) - 2 * (1 - x), 200 * (y - x * x)], dtype=F64)
        opt.step()
    assert float(p.detach().dist(torch.ones(2, dtype=F64))) <= start


# ------------------------------------------------------------------------------------------------ paths


def test_jit_compile_and_compiled_step_match_eager():
    """``jit_compile=True`` (the pointwise rule) and ``torch.compile(opt.step)`` give the eager result; the
    update really compiles (a failed compile falls back to eager with a warning, and would match too)."""
    ws, grads = _problem(7, steps=3)
    eager, _ = _opt_run(ws, grads, dtype=torch.float32, learning_rate=0.05, weight_decay=0.01)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="jit_compile")
        jit, jopt = _opt_run(ws, grads, dtype=torch.float32, learning_rate=0.05, weight_decay=0.01,
                             jit_compile=True)
    assert jopt._compile_state == "ok"
    for a, b in zip(eager, jit):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    ts = [torch.tensor(w, dtype=torch.float32, requires_grad=True) for w in ws]
    opt = optkit.LAMB(ts, 0.05, weight_decay=0.01)
    step = torch.compile(opt.step, backend="eager")
    for gs in grads:
        for t, g in zip(ts, gs):
            t.grad = torch.tensor(g, dtype=torch.float32)
        step()
    for a, t in zip(eager, ts):
        np.testing.assert_allclose(a, t.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("case", ["paper", "no-bias-correction", "always-adapt-no-wd", "lambc"])
def test_jit_compile_two_compiled_passes_match_the_reference(case, dtype):
    """``jit_compile=True``: pass 1 is the compiled sums of squares (it writes nothing: the gradients are
    left as they were, where the eager CPU pass writes the direction into them) and pass 2 the compiled
    rule updating moments and weights; the float64 reference of Algorithm 2 holds in every dtype."""
    ws, grads = _problem(21, steps=3)
    kw = CASES[case]
    ts = [torch.tensor(w, dtype=dtype, requires_grad=True) for w in ws]
    opt = optkit.LAMB(ts, 0.05, jit_compile=True, **kw)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="jit_compile")
        for gs in grads:
            given = [torch.tensor(g, dtype=dtype) for g in gs]
            for t, g in zip(ts, given):
                t.grad = g.clone()
            opt.step()
            for t, g in zip(ts, given):
                assert torch.equal(t.grad, g)
    assert opt._compile_state == "ok"
    ref = _ref_run(ws, grads, 0.05, kw)
    tol = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2}[dtype]
    for r, t in zip(ref, ts):
        np.testing.assert_allclose(t.detach().double().numpy(), r, rtol=tol, atol=tol)


@pytest.mark.parametrize("layout", ["tensors", "flat"])
@pytest.mark.parametrize("broken", ["pass 1", "pass 2"])
def test_jit_compile_failure_in_either_pass_falls_back_to_the_eager_result(broken, layout, monkeypatch):
    """A compile failure in pass 1 (nothing written yet) or in pass 2 (after the compiled pass 1: the eager
    pointwise rule then forms the moments from k·g) warns once and gives the eager result, with a skipped
    step (GradScaler-style ``found_inf``) and a loss-scale factor on the way; over flat buffers too (the
    compiled row sums, then the rule over the run matrices run eagerly)."""
    import optkit._core.compiled as base
    from optkit._core import chain as _compile

    def fail(*args, **kwargs):
        raise RuntimeError("simulated compiler failure")

    if broken == "pass 1":
        sums = optkit.lamb._lamb_row_sums if layout == "flat" else optkit.lamb._lamb_sums
        monkeypatch.setitem(_compile._COMPILED_OTHER, sums, fail)
    else:
        monkeypatch.setattr(base, "compiled_chain", lambda: fail)
    shapes = ((4,), (4,), (4,), (2, 3), (2, 3)) if layout == "flat" else ((5, 4), (4,), (3, 2, 2))
    ws, grads = _problem(22, shapes=shapes, steps=3)

    def run(jit):
        ts = [torch.tensor(w, dtype=torch.float32, requires_grad=True) for w in ws]
        if layout == "flat":
            for t in ts:
                t.grad = torch.zeros_like(t)
            optkit.flat_parameters(ts)
        # (eager row runs over flat buffers keep u in the gradient rows: scratch_grads, as the train op)
        opt = optkit.LossScaleOptimizer(optkit.LAMB(ts, 0.05, weight_decay=0.01, jit_compile=jit,
                                                    scratch_grads=layout == "flat"),
                                        optkit.DynamicLossScale(8.0))
        for k, gs in enumerate(grads):
            for t, g in zip(ts, gs):
                if layout == "flat":  # into the flat gradient's views
                    t.grad.copy_(torch.tensor(g, dtype=torch.float32) * 8.0)
                else:
                    t.grad = torch.tensor(g, dtype=torch.float32) * 8.0
            if k == 1:
                ts[0].grad.view(-1)[0] = float("inf")
            opt.grads_scaled = True
            opt.step()
        return [t.detach().clone() for t in ts], opt

    eager, _ = run(False)
    with pytest.warns(RuntimeWarning, match="running eagerly"):
        jit, opt = run(True)
    assert opt.optimizer._compile_state == "failed"
    assert list(opt.optimizer._plans.values())[0].flat_active == (layout == "flat")
    for a, b in zip(eager, jit):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_device_chain_with_fused_sgd(dtype, monkeypatch):
    """Pass 2 as run off the CPU (the chain ending in the fused SGD kernel with ``found_inf``), forced on
    the CPU: the CPU path's result, and a skipped step changes nothing."""
    ws, grads = _problem(10, steps=3)
    cpu, _ = _opt_run(ws, grads, dtype=dtype, learning_rate=0.05, weight_decay=0.01)
    monkeypatch.setattr(optkit.LAMB, "_cpu_direct", False)
    dev, opt = _opt_run(ws, grads, dtype=dtype, learning_rate=0.05, weight_decay=0.01)
    tol = 1e-12 if dtype == torch.float64 else 1e-6 if dtype == torch.float32 else 2e-3
    for a, b in zip(cpu, dev):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
    ps = [p for g in opt.param_groups for p in g["params"]]
    before = [p.detach().clone() for p in ps] + [t.clone() for p in ps for t in opt.state[p].values()]
    for p in ps:
        p.grad = torch.full_like(p, float("nan"))
    opt.found_inf = torch.ones(())
    opt.step()
    after = [p.detach().clone() for p in ps] + [t.clone() for p in ps for t in opt.state[p].values()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_update_step_single_variable():
    """Keras ``update_step``: the rule on one variable (no clipping, no counter)."""
    ws, grads = _problem(8, shapes=((4, 3),), steps=1)
    t = torch.tensor(ws[0], requires_grad=True)
    opt = optkit.LAMB([t], 0.05, weight_decay=0.01)
    opt.update_step(torch.tensor(grads[0][0]), t)
    ref = _ref_run(ws, grads, 0.05, {"weight_decay": 0.01})
    np.testing.assert_allclose(t.detach().numpy(), ref[0], rtol=1e-11, atol=1e-12)


def test_deepcopy_drops_scratch_and_continues():
    ws, grads = _problem(9)
    ts = [torch.tensor(w, dtype=torch.float32, requires_grad=True) for w in ws]
    opt = optkit.LAMB(ts, 0.05, weight_decay=0.01)
    for t, g in zip(ts, grads[0]):
        t.grad = torch.tensor(g, dtype=torch.float32)
    opt.step()
    ts2, opt2 = copy.deepcopy((ts, opt))
    assert opt2._block_cache == {}
    for pair_ts, o in ((ts, opt), (ts2, opt2)):
        for t, g in zip(pair_ts, grads[1]):
            t.grad = torch.tensor(g, dtype=torch.float32)
        o.step()
    for a, b in zip(ts, ts2):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize("kw,err,match", [
    (dict(beta1=1.0), ValueError, "beta1"),
    (dict(beta2=-0.1), ValueError, "beta2"),
    (dict(epsilon=0.0), ValueError, "epsilon"),
    (dict(weight_decay=-1.0), ValueError, "weight_decay"),
    (dict(bias_correction=1), TypeError, "bias_correction"),
    (dict(always_adapt="yes"), TypeError, "always_adapt"),
    (dict(lambc=None), TypeError, "lambc"),
    (dict(max_coeff=0.0), ValueError, "max_coeff"),
    (dict(min_coeff=-1.0), ValueError, "min_coeff"),
    (dict(min_coeff=2.0, max_coeff=1.0), ValueError, "min_coeff"),
    (dict(skip_list="bias"), TypeError, "skip_list"),
    (dict(global_grad_norm_clip=0.0), ValueError, "global_grad_norm_clip"),
    (dict(global_grad_norm_clip=1.0, clipnorm=1.0), ValueError, "global_grad_norm_clip"),
    (dict(trust_coeff=1.0), ValueError, "trust_coeff"),
])
def test_bad_arguments_raise_naming_them(kw, err, match):
    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(err, match=match):
        optkit.LAMB([p], 0.01, **kw)


def test_skip_list_needs_names():
    with pytest.raises(ValueError, match="named_parameters"):
        optkit.LAMB([torch.zeros(3, requires_grad=True)], 0.01, skip_list=["bias"])


def test_registry_and_config_round_trip():
    assert optkit.get_optimizer("lamb") is optkit.LAMB
    opt = optkit.LAMB([torch.zeros(3, requires_grad=True)], 0.01, beta1=0.8, weight_decay=0.1, lambc=True,
                      max_coeff=3.0, min_coeff=0.1, exclude_1d=True, bias_correction=False)
    cfg = opt.get_config()
    assert optkit.LAMB.from_config(cfg, [torch.zeros(3, requires_grad=True)]).get_config() == cfg


# ------------------------------------------------------------------------------------------------ .grad


@pytest.mark.parametrize("copy", [True, False])
@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.float16])
@pytest.mark.parametrize("block_numel", [1 << 20, 24, 8])
def test_step_leaves_grad_and_matches_the_reference(dtype, block_numel, copy, monkeypatch):
    """``step()`` leaves every ``.grad`` bitwise as it was, as ``torch.optim`` does (on the CPU LAMB used to
    leave the direction ``u`` there), or ``g/S`` under a loss scale ``S`` (``grad_scale``), also with a
    binding NVLAMB clip (``global_grad_norm_clip``: the clip factor never reaches ``.grad``). The update is
    the float64 reference's, and the one of ``scratch_grads=True`` (pass 1 writes ``u`` into the gradients):
    the applied direction is the one whose norm set the trust ratio: the eager passes run on a copy of the
    gradients (``copy``), or, as inside ``torch.compile``, pass 2 forms it again with the same kernel from
    in-cache copies of the gradients."""
    traits = dataclasses.replace(optkit.LAMB.traits, keeps_values_in_grads=copy)
    monkeypatch.setattr(optkit.LAMB, "traits", traits)
    ws, grads = _problem(12, shapes=((5, 4), (4,), (3, 2, 2), (7,), (2, 3), (6,)), w_scale=2.0)
    kw = {"weight_decay": 0.01, "global_grad_norm_clip": 2.0}
    ref = _ref_run(ws, grads, 0.05, {"weight_decay": 0.01}, base={"global_clipnorm": 2.0})
    tol = {F64: 1e-11, torch.float32: 2e-5, torch.float16: 4e-3}[dtype]
    for scale in (None, 64.0):
        runs = []
        for scratch in (False, True):
            ts = [torch.tensor(w, dtype=dtype, requires_grad=True) for w in ws]
            opt = optkit.LAMB(ts, 0.05, block_numel=block_numel, scratch_grads=scratch, **kw)
            for gs in grads:
                for t, g in zip(ts, gs):
                    t.grad = torch.tensor(g if scale is None else np.asarray(g) * scale, dtype=dtype)
                step_checking_grads(opt, ts, scale, scratch)
            runs.append(ts)
            for t, r in zip(ts, ref):
                np.testing.assert_allclose(t.detach().double().numpy(), r, rtol=tol, atol=tol)
        for a, b in zip(*runs):
            if copy and dtype != torch.float16:  # (the same kernels on the same values: bit for bit)
                assert torch.equal(a, b)
            torch.testing.assert_close(a.detach(), b.detach(), rtol=tol, atol=tol)
