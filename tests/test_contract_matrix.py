"""The contract matrix (issue #10): every row of ``tests/contract_table.py`` crossed with dtypes, layouts,
sparse gradients, skips, checkpoints, deepcopy, names, tensor learning rates, hooks, closures and
``apply_gradients``.

References: the float64 NumPy pipeline of ``tests/reference_rules.py`` for every numeric case (and
``torch.optim``'s single-tensor path where the semantics coincide); for skips, checkpoints and copies the
uninterrupted run of the same row, bit for bit. Small tensors, a few steps each.
"""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch

import optkit
from compiled_passes import run_uncompiled
from contract_table import (
    BY_ID,
    LR,
    ROW_IDS,
    ROWS,
    SHAPES,
    SPARSE_ROWS,
    SPARSE_SHAPE,
    Row,
    innermost,
    state_tensors,
)
from host_reads import HostReads
from reference_rules import Reference

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")

STEPS = 3
DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "fp16": torch.float16, "bf16": torch.bfloat16}
LAYOUTS = ["contiguous", "noncontig_param", "channels_last", "channels_last_param_contig_grad", "transposed",
           "grad_strides", "flat"]


# ------------------------------------------------------------------------------------------------ fixtures


def values(seed: int, scale: float = 1.0, shapes: dict = SHAPES) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s) * scale for n, s in shapes.items()}


def laid_out(x: torch.Tensor, name: str, layout: str, role: str) -> torch.Tensor:
    """``x`` (contiguous) copied into the memory layout ``layout`` asks for this tensor and role."""
    four_d, two_d = x.ndim == 4, x.ndim == 2
    if layout == "noncontig_param" and role == "param":
        base = torch.zeros(*x.shape, 2, dtype=x.dtype, device=x.device)
        view = base[..., 0]
        view.copy_(x)
        return view
    if layout == "channels_last" and four_d:
        return x.contiguous(memory_format=torch.channels_last)
    if layout == "channels_last_param_contig_grad" and four_d and role == "param":
        return x.contiguous(memory_format=torch.channels_last)
    if layout == "transposed" and two_d and role == "param":
        return x.t().contiguous().t()
    if layout == "grad_strides" and role == "grad":
        if two_d:
            return x.t().contiguous().t()
        if four_d:
            return x.contiguous(memory_format=torch.channels_last)
    return x.clone()


def make_params(dtype, layout="contiguous", seed=0, device="cpu", shapes: dict = SHAPES,
                ) -> list[tuple[str, torch.Tensor]]:
    """The row's parameters (on ``device``); ``layout="flat"``: views into one buffer
    (``optkit.flat_parameters``), the conv weight in channels_last, so the flat path also sees a
    non-contiguous dense segment."""
    out = []
    for name, v in values(seed, 0.5, shapes).items():
        t = torch.tensor(v, dtype=torch.float64).to(device=device, dtype=dtype)
        t = laid_out(t, name, "channels_last" if layout == "flat" else layout, "param")
        out.append((name, t.requires_grad_()))
    if layout == "flat":
        optkit.flat_parameters(out)
    return out


def grads_at(step: int, dtype, seed=1, device="cpu", shapes: dict = SHAPES) -> list[torch.Tensor]:
    return [torch.tensor(v, dtype=torch.float64).to(device=device, dtype=dtype)
            for v in values(1000 * seed + step, shapes=shapes).values()]


def shapes_of(params) -> dict:
    """The ``{name: shape}`` of a row's parameters (``make_params``'s order)."""
    return {n: tuple(p.shape) for n, p in params}


def set_grads(params, grads, layout="contiguous", scale=1.0, opt=None):
    """``.grad`` = ``scale·g`` in ``layout``; a loss-scale wrapper ``opt`` is told the gradients carry its
    scale (as ``scale_loss(loss).backward()`` would)."""
    for (name, p), g in zip(params, grads):
        g = (g.double() * scale).to(g.dtype)
        if layout == "flat" and p.grad is not None:
            p.grad.copy_(g)  # into the flat gradient's view (a backward accumulates there)
        else:
            p.grad = laid_out(g, name, layout, "grad")
    if opt is not None and hasattr(opt, "grads_scaled"):
        opt.grads_scaled = True


def snapshot(params, opt) -> list[torch.Tensor]:
    """Everything that must not change on a skip: parameters, every tensor in the state dict, the count."""
    return [p.detach().clone() for _, p in params] + state_tensors(opt.state_dict())


def assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert torch.equal(x, y) or (x.isnan().any() and torch.equal(x.nan_to_num(), y.nan_to_num()))


def feed_scale(row: Row, opt) -> float:
    """The scale the gradients must carry: a loss-scale wrapper's current ``S`` (it backs off after an
    overflow), else the row's."""
    scale = getattr(opt, "loss_scale", None)
    return float(scale) if isinstance(scale, torch.Tensor) else row.feed_scale


def train(row: Row, dtype=torch.float32, layout="contiguous", steps=STEPS, lr=LR, params=None, opt=None,
          start=0, device="cpu"):
    params = make_params(dtype, layout, device=device, shapes=row.shapes) if params is None else params
    opt = row.build(params, lr) if opt is None else opt
    for k in range(start, start + steps):
        set_grads(params, grads_at(k, dtype, device=device, shapes=shapes_of(params)), layout,
                  feed_scale(row, opt), opt)
        opt.step()
    return params, opt


def optimizer_snapshot(params, opt) -> list[torch.Tensor]:
    """:func:`snapshot` without the loss-scale state: parameters, fp32 masters and the innermost optimizer's
    state (what a skipped step must leave alone even while a dynamic scaler backs off)."""
    inner = innermost(opt)
    masters = [p for g in inner.param_groups for p in g["params"]]
    return snapshot(params + [("master", m) for m in masters], inner)


def reference(row: Row, dtype, steps=STEPS, lr=LR) -> list[np.ndarray]:
    names = list(row.shapes)
    ws0 = [p.detach().double().numpy() for _, p in make_params(dtype, shapes=row.shapes)]
    ref = row.reference(names, ws0, lr)
    for k in range(steps):
        ref.step([g.double().numpy() for g in grads_at(k, dtype, shapes=row.shapes)])
    return ref.ws


def tolerance(dtype, row: Row) -> tuple[float, float]:
    rtol, atol = _dtype_tolerance(dtype)
    if row.lean_tol is not None:  # slots stored in bfloat16 or 8 bits: the row's bound
        return max(rtol, row.lean_tol), max(atol, row.lean_tol)
    return rtol, atol


def _dtype_tolerance(dtype) -> tuple[float, float]:
    if dtype == torch.float64:  # the documented promise (docs/compatibility.md): 1e-12 in float64
        return 1e-12, 1e-13
    if dtype == torch.float32:
        return 2e-5, 5e-6
    eps = torch.finfo(dtype).eps
    return 4 * eps, 8 * eps


def assert_matches(params, ref_ws, dtype, row):
    rtol, atol = tolerance(dtype, row)
    for (name, p), w in zip(params, ref_ws):
        got = p.detach().double().cpu().numpy()
        scale = max(1.0, float(np.abs(w).max()))
        np.testing.assert_allclose(got, w, rtol=rtol, atol=atol * scale, err_msg=name)


def param_dtypes(row: Row) -> list[str]:
    return [k for k, d in DTYPES.items() if d in row.dtypes]


def cases(*, dtype_key=False):
    out = []
    for row in ROWS:
        if dtype_key:
            out += [pytest.param(row.id, k, id=f"{row.id}-{k}") for k in param_dtypes(row)]
        else:
            out.append(pytest.param(row.id, id=row.id))
    return out


def default_dtype(row: Row):
    return row.dtypes[0]


# ------------------------------------------------------------------------------------------------ the table


def test_every_registry_optimizer_and_wrapper_is_a_row():
    built = {}
    for row in ROWS:
        opt = row.build(make_params(default_dtype(row), shapes=row.shapes), LR)
        built.setdefault(type(innermost(opt)), row.id)
        o = opt
        while o is not innermost(opt):
            built.setdefault(type(o), row.id)
            o = o.optimizer
    missing = [n for n, cls in optkit.OPTIMIZER_CLS_NAMES.items() if cls not in built]
    wrappers = [optkit.LossScaleOptimizer, optkit.LARC, optkit.VariableClippingOptimizer,
                optkit.MixedPrecisionOptimizerWrapper]
    missing += [w.__name__ for w in wrappers if w not in built]
    assert not missing, f"not in the contract table: {missing}"


# ------------------------------------------------------------------------------------------------ numerics


@pytest.mark.parametrize("row_id,dt", cases(dtype_key=True))
def test_dtype_matches_float64_reference(row_id, dt):
    row, dtype = BY_ID[row_id], DTYPES[dt]
    params, _ = train(row, dtype)
    assert_matches(params, reference(row, dtype), dtype, row)
    for _, p in params:
        assert p.dtype == dtype


@pytest.mark.parametrize("row_id", [r.id for r in ROWS if torch.float64 in r.dtypes])
def test_float64_without_a_float64_kernel_takes_the_exact_fallback(row_id, monkeypatch):
    """Where a fused kernel takes no float64 (CUDA's read a tensor learning rate as float32), float64
    parameters run the foreach fallback, exact in float64, rather than staged copies through the kernel
    (which refused them). Emulated on the CPU: float64 out of the kernels' table, and kernels that refuse
    float64 tensors as CUDA's do."""
    from optkit._core import fused as _fused

    table = {k: {dev: tuple(d for d in dts if d != torch.float64) for dev, dts in v.items()}
             for k, v in _fused.KERNELS.items() if k != "foreach"}
    monkeypatch.setattr(_fused, "KERNELS", {**_fused.KERNELS, **table})

    def refusing(kernel):
        def run(params, *args, **kwargs):
            if any(p.dtype == torch.float64 for p in params):
                raise RuntimeError("expected scalar type Float but found Double")
            return kernel(params, *args, **kwargs)
        return run

    for name in ("_fused_sgd_", "_fused_adam_", "_fused_adamw_", "_fused_adagrad_"):
        monkeypatch.setattr(torch, name, refusing(getattr(torch, name)))
    row = BY_ID[row_id]
    params, _ = train(row, torch.float64)
    assert_matches(params, reference(row, torch.float64), torch.float64, row)


@pytest.mark.parametrize("layout", LAYOUTS[1:])
@pytest.mark.parametrize("row_id", ROW_IDS)
def test_layout_matches_reference(row_id, layout):
    """Non-dense parameters, channels_last and transposed weights, and gradients whose strides differ from the
    parameter's give the same update as contiguous tensors (torch's fused kernels alone get these wrong)."""
    row = BY_ID[row_id]
    dtype = default_dtype(row)
    params, _ = train(row, dtype, layout)
    assert_matches(params, reference(row, dtype), dtype, row)
    base, _ = train(row, dtype)
    for (n, p), (_, q) in zip(params, base):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7, msg=n)


@pytest.mark.parametrize("row_id", [r.id for r in ROWS if r.torch_twin is not None])
def test_torch_twin_single_tensor_path(row_id):
    """Where optkit's rule is torch's, the result equals ``torch.optim`` with ``foreach=False`` (float64)."""
    row = BY_ID[row_id]
    params, _ = train(row, torch.float64)
    twin_params = make_params(torch.float64, shapes=row.shapes)
    twin = row.torch_twin([p for _, p in twin_params], LR)
    train(row, torch.float64, params=twin_params, opt=twin)
    for (n, p), (_, q) in zip(params, twin_params):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-12, atol=1e-13, msg=n)


# ------------------------------------------------------------------------------------------------ sparse


def _sparse_grad(step: int, dtype) -> torch.Tensor:
    rng = np.random.default_rng(500 + step)
    vals = torch.tensor(rng.standard_normal((len(SPARSE_ROWS), SPARSE_SHAPE[1])), dtype=dtype)
    idx = torch.tensor([SPARSE_ROWS])
    return torch.sparse_coo_tensor(idx, vals, SPARSE_SHAPE)


@pytest.mark.parametrize("row_id", [r.id for r in ROWS if not r.half_masters])
def test_sparse_gradients(row_id):
    """``nn.Embedding(sparse=True)`` gradients: the touched-rows rule (TF's ``IndexedSlices`` semantics, the
    duplicate row summed), the densified gradient, or a clear refusal, as the table says."""
    row = BY_ID[row_id]
    torch.manual_seed(0)
    w0 = torch.randn(SPARSE_SHAPE, dtype=torch.float64) * 0.5
    w = w0.clone().requires_grad_()
    opt = row.build([("emb.weight", w)], LR)
    scaled = hasattr(opt, "grads_scaled")
    if isinstance(row.sparse, type):
        w.grad = _sparse_grad(0, torch.float64) * row.feed_scale
        if scaled:
            opt.grads_scaled = True
        before = snapshot([("w", w)], opt)
        with pytest.raises(row.sparse):
            opt.step()
        assert_bitwise(snapshot([("w", w)], opt), before)
        return
    for k in range(STEPS):
        w.grad = _sparse_grad(k, torch.float64) * row.feed_scale
        if scaled:
            opt.grads_scaled = True
        opt.step()
    dense = [_sparse_grad(k, torch.float64).to_dense() for k in range(STEPS)]
    if row.sparse == "dense":
        ref = row.reference(["emb.weight"], [w0.numpy()])
        for g in dense:
            ref.step([g.numpy()], rows=sorted(set(SPARSE_ROWS)))
        rtol, atol = (1e-10, 1e-12) if row.lean_tol is None else tolerance(torch.float64, row)
        np.testing.assert_allclose(w.detach().numpy(), ref.ws[0], rtol=rtol, atol=atol)
        return
    rows = sorted(set(SPARSE_ROWS))
    others = [i for i in range(SPARSE_SHAPE[0]) if i not in rows]
    assert torch.equal(w.detach()[others], w0[others]), "untouched rows must not change"
    clip = {k: v for k, v in row.base.items() if k in ("clipnorm", "clipvalue", "global_clipnorm")}
    sub = Reference(row.sparse_rule, [w0[rows].numpy()], row.sparse_hp or row.hp, {"lr": LR, **clip})
    for g in dense:
        sub.step([g[rows].numpy()])
    np.testing.assert_allclose(w.detach()[rows].numpy(), sub.ws[0], rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------------------ skips


def _skip_step(params, opt, dtype, row, layout="contiguous"):
    garbage = grads_at(99, dtype, shapes=shapes_of(params))
    garbage[0].view(-1)[0] = float("inf")
    garbage[1].view(-1)[0] = float("nan")
    set_grads(params, garbage, layout, scale=feed_scale(row, opt), opt=opt)
    opt.found_inf = torch.ones(())
    try:
        opt.step()
    finally:
        del opt.found_inf
    assert not bool(opt.step_applied)


@pytest.mark.parametrize("layout", ["contiguous", "flat"])
@pytest.mark.parametrize("at", [0, 2])
@pytest.mark.parametrize("row_id", ROW_IDS)
def test_skip_changes_nothing(row_id, at, layout):
    """A skipped step (``found_inf`` = 1, the ``torch.amp.GradScaler`` protocol) at the first or a later
    update changes no parameter, slot, average or counter (no lazily created state), and the run continues
    bit-identically to the run without it. (A dynamic loss scale still backs off: that is its job.)
    Stochastic rounding (``precision="stochastic"`` over bfloat16 parameters) seeds each step call, skipped
    or not (reading the skip flag would be a host sync): the run continues bit-identically to the run whose
    ``rounding_step`` (state dict) was advanced by the skipped call."""
    row = BY_ID[row_id]
    dtype = default_dtype(row)
    plain_params, plain_opt = train(row, dtype, layout, steps=at)
    inner = innermost(plain_opt)
    if getattr(inner, "precision", None) == "stochastic" and dtype == torch.bfloat16:
        sd = inner.state_dict()
        sd["rounding_step"] += 1  # (the skipped call's draw)
        inner.load_state_dict(sd)
    train(row, dtype, layout, steps=4 - at, params=plain_params, opt=plain_opt, start=at)
    params = make_params(dtype, layout, shapes=row.shapes)
    opt = row.build(params, LR)
    if at:
        train(row, dtype, layout, steps=at, params=params, opt=opt)
    before = optimizer_snapshot(params, opt)
    _skip_step(params, opt, dtype, row, layout)
    assert_bitwise(optimizer_snapshot(params, opt), before)
    train(row, dtype, layout, steps=4 - at, params=params, opt=opt, start=at)
    assert_bitwise(optimizer_snapshot(params, opt), optimizer_snapshot(plain_params, plain_opt))


@pytest.mark.parametrize("row_id", [r.id for r in ROWS if r.feed_scale == 1.0 and not r.half_masters])
def test_gradscaler_skips_first_step(row_id):
    """Under ``torch.amp.GradScaler`` an overflowing first step leaves everything as it was."""
    row = BY_ID[row_id]
    params = make_params(torch.float32, shapes=row.shapes)
    opt = row.build(params, LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    before = snapshot(params, opt)
    loss = sum((p * g).sum() for (_, p), g in zip(params, grads_at(0, torch.float32, shapes=row.shapes)))
    scaler.scale(loss * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    assert_bitwise(snapshot(params, opt), before)
    assert float(scaler.get_scale()) == 2.0**7


# ------------------------------------------------------------------------------------------------ .grad


def _unscaled(grads: list[torch.Tensor], scale: float) -> list[torch.Tensor]:
    """``g·(1/S)`` in each gradient's dtype, as ``GradScaler.unscale_`` leaves it: the product in float32
    (float64 for float64 gradients) with ``1/S`` rounded to that precision, rounded once (exactly ``g/S`` for
    the power-of-two scales)."""
    out = []
    for g in grads:
        acc = torch.float64 if g.dtype == torch.float64 else torch.float32
        out.append((g.to(acc) * torch.tensor(1.0 / scale, dtype=acc)).to(g.dtype))
    return out


@pytest.mark.filterwarnings("ignore:.*not back to back")
@pytest.mark.parametrize("layout", ["contiguous", "grad_strides", "flat"])
@pytest.mark.parametrize("row_id", [r for r in ROW_IDS if "scratch" not in r])  # (scratch: asked for)
def test_step_leaves_grad_as_torch_optim_does(row_id, layout):
    """After ``step()`` every ``.grad`` is bitwise what it was, as ``torch.optim`` leaves it (reference: the
    gradient before the step), so gradients logged after the step, accumulated into by a backward that
    forgot ``zero_grad``, or shared with another optimizer are the gradients. Rows that step a loss scale
    ``S`` (their ``.grad`` carries ``S·g``): ``g/S``, what ``GradScaler.unscale_`` and torch's fused kernels
    leave, except the half parameters of a mixed-precision wrapper, whose gradients the wrapper only copies
    to the fp32 masters (torch never unscales float16 gradients in place). Clipping, LARC's ratios, decay
    and the update itself (LARS, LAMB, Nesterov SGD) never reach ``.grad``."""
    row = BY_ID[row_id]
    dtype = default_dtype(row)
    params = make_params(dtype, layout, shapes=row.shapes)
    opt = row.build(params, LR)
    for k in range(STEPS):
        scale = feed_scale(row, opt)
        set_grads(params, grads_at(k, dtype, shapes=row.shapes), layout, scale, opt)
        before = [p.grad.detach().clone() for _, p in params]
        opt.step()
        assert bool(innermost(opt).step_applied) if hasattr(innermost(opt), "step_applied") else True
        expected = before if scale == 1.0 or row.half_masters else _unscaled(before, scale)
        assert_bitwise([p.grad for _, p in params], expected)


@pytest.mark.parametrize("row_id", [r.id for r in ROWS if r.feed_scale == 1.0 and not r.half_masters
                                    and "scratch" not in r.id])
def test_gradscaler_step_leaves_the_unscaled_grad(row_id):
    """Under ``torch.amp.GradScaler`` (``grad_scale``/``found_inf`` handed to the step) ``.grad`` ends as
    ``g/S``, what ``scaler.step`` leaves with a torch optimizer (``unscale_``, or the fused kernels), and the
    update equals the unscaled run's."""
    row = BY_ID[row_id]
    params = make_params(torch.float32, shapes=row.shapes)
    opt = row.build(params, LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    ref_params, _ = train(row, torch.float32, steps=1)
    loss = sum((p * g).sum() for (_, p), g in zip(params, grads_at(0, torch.float32, shapes=row.shapes)))
    scaler.scale(loss).backward()
    before = [p.grad.detach().clone() for _, p in params]
    scaler.step(opt)
    scaler.update()
    assert_bitwise([p.grad for _, p in params], _unscaled(before, 2.0**8))
    for (n, p), (_, q) in zip(params, ref_params):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7, msg=n)


# ------------------------------------------------------------------------------------------------ state


def _fresh_copy(params):
    return [(n, p.detach().clone().requires_grad_()) for n, p in params]


@pytest.mark.parametrize("row_id", ROW_IDS)
def test_flat_buffers_with_parameters_over_a_block(row_id):
    """Over flat buffers whose parameters are mostly larger than a block (``block_numel`` 4 here), the
    per-tensor blocked pass runs on the buffer's views (LARS and LAMB leave their row runs, which would not
    cut a large parameter) and matches the per-tensor layout."""
    row = BY_ID[row_id]
    dtype = default_dtype(row)
    params = make_params(dtype, "flat", shapes=row.shapes)
    opt = row.build(params, LR)
    inner = innermost(opt)
    if not isinstance(inner, optkit.Optimizer):
        pytest.skip("a torch.optim inner optimizer has no plans")
    inner.block_numel = 4
    train(row, dtype, "flat", steps=2, params=params, opt=opt)
    plain_params, _ = train(row, dtype, steps=2)
    for (n, p), (_, q) in zip(params, plain_params):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7, msg=n)
    flats = [plan.flat for plan in inner._plans.values() if getattr(plan, "flat", None) is not None]
    assert all(not f.rows_pay for f in flats)


@pytest.mark.parametrize("row_id", ROW_IDS)
def test_flat_buffers_are_exercised_and_round_trip(row_id):
    """Flat parameter buffers (``optkit.flat_parameters``): the step matches the per-tensor one, a state
    saved by a flat optimizer continues in a per-tensor one and back, and for optimizers the flat plan is the
    one in use (one run over the buffer)."""
    row = BY_ID[row_id]
    dtype = default_dtype(row)
    flat_params, flat_opt = train(row, dtype, "flat", steps=2)
    plain_params, plain_opt = train(row, dtype, steps=2)
    for (n, p), (_, q) in zip(flat_params, plain_params):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7, msg=n)
    inner = innermost(flat_opt)
    if isinstance(inner, optkit.Optimizer) and not row.half_masters and len(inner.param_groups) == 1 \
            and not inner._clips_copy():
        # (param groups cut the buffer: a group whose tensors are not back to back steps them one by one;
        # clipnorm/clipvalue transform copies of the caller's gradients, which step per tensor)
        assert all(plan.flat is not None for plan in inner._plans.values())
    for src_params, src, layout in ((flat_params, flat_opt, "contiguous"), (plain_params, plain_opt, "flat")):
        buf = io.BytesIO()
        torch.save(src.state_dict(), buf)
        buf.seek(0)
        params2 = make_params(dtype, layout, shapes=row.shapes)
        with torch.no_grad():
            for (_, p2), (_, p) in zip(params2, src_params):
                p2.copy_(p)
        opt2 = row.build(params2, LR)
        opt2.load_state_dict(torch.load(buf, weights_only=True))
        train(row, dtype, layout, steps=2, params=params2, opt=opt2, start=2)
        train(row, dtype, "flat" if src is flat_opt else "contiguous", steps=2, params=src_params, opt=src,
              start=2)
        for (n, p), (_, q) in zip(params2, src_params):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-6, msg=n)


@pytest.mark.parametrize("row_id", ROW_IDS)
def test_checkpoint_round_trip_is_bit_identical(row_id):
    """``state_dict`` → ``torch.save`` → ``torch.load(weights_only=True)`` → a fresh optimizer → continue
    equals the uninterrupted run, bit for bit."""
    row = BY_ID[row_id]
    dtype = default_dtype(row)
    ref_params, ref_opt = train(row, dtype, steps=4)
    params, opt = train(row, dtype, steps=2)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    params2 = _fresh_copy(params)
    opt2 = row.build(params2, LR)
    opt2.load_state_dict(loaded)
    train(row, dtype, steps=2, params=params2, opt=opt2, start=2)
    assert_bitwise(snapshot(params2, opt2), snapshot(ref_params, ref_opt))


@pytest.mark.parametrize("row_id", ROW_IDS)
def test_deepcopy_continues_identically(row_id):
    row = BY_ID[row_id]
    dtype = default_dtype(row)
    params, opt = train(row, dtype, steps=2)
    params2, opt2 = copy.deepcopy((params, opt))
    train(row, dtype, steps=2, params=params, opt=opt, start=2)
    train(row, dtype, steps=2, params=params2, opt=opt2, start=2)
    assert_bitwise(snapshot(params2, opt2), snapshot(params, opt))


@pytest.mark.parametrize("row_id", ROW_IDS)
def test_misfit_state_is_refused_and_nothing_changes(row_id):
    """A state dict whose slot does not fit its parameter (another model, a truncated file) raises
    ``ValueError`` naming the slot, before anything is loaded."""
    row = BY_ID[row_id]
    dtype = default_dtype(row)
    params, opt = train(row, dtype, steps=1)
    sd = opt.state_dict()
    inner_sd = sd
    while "optimizer" in inner_sd and "wrapper" in inner_sd:
        inner_sd = inner_sd["optimizer"]
    entry = next(iter(inner_sd["state"].values()))
    slot = next((k for k in entry if k != "step"), "momentum")
    entry[slot] = torch.zeros(3, dtype=entry[slot].dtype if slot in entry else torch.float32)
    before = snapshot(params, opt)
    with pytest.raises(ValueError, match=str(slot)):
        opt.load_state_dict(sd)
    assert_bitwise(snapshot(params, opt), before)


def _corrupt_step(value):
    def apply(entry, group):
        entry["step"] = value
    return apply


def _corrupt_lr(value):
    def apply(entry, group):
        group["lr"] = value
    return apply


def _meta_slot(entry, group):
    slot = next(k for k in entry if k != "step")
    entry[slot] = torch.empty(entry[slot].shape, device="meta")


HOSTILE = {
    "step-inf": _corrupt_step(float("inf")), "step-huge-int": _corrupt_step(10**400),
    "step-meta": _corrupt_step(torch.empty((), device="meta")), "slot-meta": _meta_slot,
    "lr-nan": _corrupt_lr(float("nan")), "lr-negative": _corrupt_lr(-0.5),
    "lr-huge-int": _corrupt_lr(10**400),
    "lr-meta": _corrupt_lr(torch.empty((), device="meta")),
}


@pytest.mark.parametrize("what", sorted(HOSTILE))
@pytest.mark.parametrize("row_id", ROW_IDS)
def test_hostile_values_are_refused_and_nothing_changes(row_id, what):
    """Values a file may hold but no run makes (a step of inf or 10**400, meta tensors that hold no data, a
    NaN, negative or unrepresentable learning rate) raise ``ValueError`` before anything is loaded: the
    optimizer is bitwise as before and trains on."""
    row = BY_ID[row_id]
    dtype = default_dtype(row)
    params, opt = train(row, dtype, steps=1)
    sd = copy.deepcopy(opt.state_dict())  # (torch's own optimizers hand out their live per-parameter dicts)
    inner_sd = sd
    while "optimizer" in inner_sd and "wrapper" in inner_sd:
        inner_sd = inner_sd["optimizer"]
    entry = next((e for e in inner_sd["state"].values() if "step" in e and len(e) > 1), None)
    if entry is None and not what.startswith("lr"):
        pytest.skip("no per-parameter state with a step and a slot")
    HOSTILE[what](entry, inner_sd["param_groups"][0])
    before = snapshot(params, opt)
    with pytest.raises(ValueError):
        opt.load_state_dict(sd)
    assert_bitwise(snapshot(params, opt), before)
    train(row, dtype, steps=1, params=params, opt=opt, start=1)


@pytest.mark.parametrize("row_id", ROW_IDS)
def test_python_number_step_loads(row_id):
    """Older checkpoints store ``step`` as a Python number."""
    row = BY_ID[row_id]
    dtype = default_dtype(row)
    ref_params, ref_opt = train(row, dtype, steps=3)
    params, opt = train(row, dtype, steps=2)
    sd = opt.state_dict()
    inner_sd = sd
    while "optimizer" in inner_sd and "wrapper" in inner_sd:
        inner_sd = inner_sd["optimizer"]
    for entry in inner_sd["state"].values():
        if "step" in entry:
            entry["step"] = int(entry["step"])
    params2 = _fresh_copy(params)
    opt2 = row.build(params2, LR)
    opt2.load_state_dict(sd)
    train(row, dtype, steps=1, params=params2, opt=opt2, start=2)
    assert_bitwise([p for _, p in params2], [p for _, p in ref_params])


# ------------------------------------------------------------------------------------------------ names


def _optimizer_rows():
    return [r.id for r in ROWS
            if isinstance(r.build(make_params(r.dtypes[0], shapes=r.shapes), LR), optkit.Optimizer)]


@pytest.mark.parametrize("row_id", _optimizer_rows())
def test_names_given_at_construction_win_over_a_loaded_state(row_id):
    """A state dict saved by an optimizer built without names (``param_0``, ...) must not replace the real
    names: name-based options (exclusions, LARS ``skip_list``) keep applying after the load."""
    row = BY_ID[row_id]
    params, opt = train(row, torch.float32, steps=2)
    sd = opt.state_dict()
    for g in sd["param_groups"]:
        g["param_names"] = [f"param_{i}" for i in range(len(g["params"]))]
    params2 = _fresh_copy(params)
    opt2 = row.build(params2, LR)
    names_before = [list(g["param_names"]) for g in opt2.param_groups]
    opt2.load_state_dict(sd)
    assert [list(g["param_names"]) for g in opt2.param_groups] == names_before
    train(row, torch.float32, steps=2, params=params, opt=opt, start=2)
    train(row, torch.float32, steps=2, params=params2, opt=opt2, start=2)
    assert_bitwise([p for _, p in params2], [p for _, p in params])


@pytest.mark.parametrize("row_id", _optimizer_rows())
def test_named_and_unnamed_parameters(row_id):
    """The same optimizer built from ``named_parameters()`` or plain tensors computes the same update (rows
    whose options do not use names); mixing named and unnamed parameters raises, as torch does."""
    row = BY_ID[row_id]
    opt0 = row.build(make_params(torch.float32, shapes=row.shapes), LR)
    cls, cfg = type(opt0), opt0.get_config()
    named, plain = (make_params(torch.float32, shapes=row.shapes) for _ in range(2))
    a = cls.from_config(cfg, named)
    if row.uses_names:  # a name-based option over unnamed parameters would silently match nothing
        assert a.param_groups[0]["param_names"] == list(row.shapes)
        with pytest.raises(ValueError, match="named_parameters"):
            b = cls.from_config(cfg, [p for _, p in plain])
            b.exclude_from_weight_decay(var_names=["bias"])
    else:
        b = cls.from_config(cfg, [p for _, p in plain])
        train(row, torch.float32, params=named, opt=a)
        train(row, torch.float32, params=plain, opt=b)
        assert_bitwise([p for _, p in named], [p for _, p in plain])
    mixed = make_params(torch.float32, shapes=row.shapes)
    with pytest.raises(ValueError, match="with/without names"):
        cls.from_config(cfg, [mixed[0], mixed[1][1], mixed[2]])
    with pytest.raises(TypeError, match="complex"):
        cls.from_config(cfg, [torch.zeros(3, dtype=torch.complex64, requires_grad=True)])


# ------------------------------------------------------------------------------------------------ lr, hooks


@pytest.mark.parametrize("row_id", ROW_IDS)
def test_tensor_learning_rate(row_id):
    """A 0-d tensor learning rate works like the number, and changing it in place takes effect (torch)."""
    row = BY_ID[row_id]
    dtype = default_dtype(row)
    lr_t = torch.tensor(LR)
    params, opt = train(row, dtype, steps=2, lr=lr_t)
    ref_params, ref_opt = train(row, dtype, steps=2, lr=float(lr_t))
    # a float lr may ride another kernel path (SGD's dampening)
    for (_, p), (_, q) in zip(params, ref_params):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1.3e-6, atol=1e-6)
    lr_t.fill_(LR / 2)
    for g in innermost(ref_opt).param_groups:
        g["lr"] = LR / 2
    if isinstance(innermost(ref_opt), optkit.Optimizer):
        innermost(ref_opt).learning_rate = LR / 2
    train(row, dtype, steps=1, params=params, opt=opt, start=2)
    train(row, dtype, steps=1, params=ref_params, opt=ref_opt, start=2)
    for (_, p), (_, q) in zip(params, ref_params):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("row_id", ROW_IDS)
def test_step_hooks_fire_once_per_step(row_id):
    """Instance and global step hooks fire once per ``step()``, also through a stack of wrappers."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    row = BY_ID[row_id]
    dtype = default_dtype(row)
    params = make_params(dtype, shapes=row.shapes)
    opt = row.build(params, LR)
    calls = []
    handles = [opt.register_step_pre_hook(lambda o, a, k: calls.append("pre")),
               opt.register_step_post_hook(lambda o, a, k: calls.append("post")),
               register_optimizer_step_pre_hook(lambda o, a, k: calls.append("global-pre")),
               register_optimizer_step_post_hook(lambda o, a, k: calls.append("global-post"))]
    try:
        train(row, dtype, steps=2, params=params, opt=opt)
    finally:
        for h in handles:
            h.remove()
    assert sorted(calls) == sorted(["pre", "post", "global-pre", "global-post"] * 2)


@pytest.mark.parametrize("row_id", ROW_IDS)
def test_state_dict_hooks(row_id):
    """``register_state_dict_pre/post_hook`` and ``register_load_state_dict_pre/post_hook`` run, in torch's
    order, on optimizers and wrappers alike; a post hook may replace the dict."""
    row = BY_ID[row_id]
    params, opt = train(row, default_dtype(row), steps=1)
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("post") or {**sd, "extra": 1})
    opt.register_load_state_dict_pre_hook(
        lambda o, sd: calls.append("load-pre") or {k: v for k, v in sd.items() if k != "extra"})
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load-post"))
    sd = opt.state_dict()
    assert sd["extra"] == 1
    opt.load_state_dict(sd)
    assert calls == ["pre", "post", "load-pre", "load-post"]


def _keep_notes(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Hooks that keep values under keys of ``opt.state`` that are not parameters, as torch's contract allows:
    a note stored before saving, an entry the innermost optimizer's post hook adds to the saved state (the
    packed ``"state"`` dict), a tensor stored after loading."""
    opt.register_state_dict_pre_hook(lambda o: o.state.__setitem__("note", 1))
    innermost(opt).register_state_dict_post_hook(
        lambda o, sd: sd["state"].__setitem__("meta", {"epoch": 3, "tags": ["a", "b"]}))
    opt.register_load_state_dict_post_hook(lambda o: o.state.__setitem__("loaded", torch.arange(3.0)))
    return opt


def _notes(opt: torch.optim.Optimizer) -> dict:
    return {k: v for k, v in opt.state.items() if not isinstance(k, torch.Tensor)}


@pytest.mark.parametrize("row_id", ROW_IDS)
def test_state_keeps_any_value_under_a_non_parameter_key(row_id):
    """torch's optimizer contract: ``opt.state`` holds any value under a key that is not a parameter (a
    hook's ``state["note"] = 1``); it goes through ``state_dict`` → ``torch.save`` →
    ``torch.load(weights_only=True)`` → ``load_state_dict`` untouched, exactly as with ``torch.optim.SGD``
    driven by the same hooks, and changes nothing in training (the continued run equals the uninterrupted
    one, bit for bit). A parameter's state in an optkit optimizer must stay a dict of slots: anything else
    is a ``TypeError`` that leaves the state as it was."""
    row = BY_ID[row_id]
    dtype = default_dtype(row)

    def round_trip(opt, build):
        opt.state["direct"] = "kept"
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        buf.seek(0)
        fresh = _keep_notes(build())
        fresh.load_state_dict(torch.load(buf, weights_only=True))
        return fresh

    ref_params, ref_opt = train(row, dtype, steps=4)
    params, opt = train(row, dtype, steps=2)
    params2 = _fresh_copy(params)
    opt2 = round_trip(_keep_notes(opt), lambda: row.build(params2, LR))
    w = [torch.nn.Parameter(p.detach().float().clone()) for _, p in make_params(dtype, shapes=row.shapes)]
    torch_opt = torch.optim.SGD(w, lr=LR)
    torch_opt2 = round_trip(_keep_notes(torch_opt), lambda: torch.optim.SGD(w, lr=LR))
    expected = _notes(torch_opt2)
    assert set(expected) == {"note", "direct", "meta", "loaded"}
    got = _notes(opt2)
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert type(got[k]) is type(v), k
        assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k
    assert _notes(opt) == {"note": 1, "direct": "kept"}
    train(row, dtype, steps=2, params=params2, opt=opt2, start=2)

    def trained(ps, o):  # the parameters and their state (whose keys are their positions)
        sd = innermost(o).state_dict()["state"]
        return [p.detach() for _, p in ps] + state_tensors({k: v for k, v in sd.items() if type(k) is int})

    assert_bitwise(trained(params2, opt2), trained(ref_params, ref_opt))
    if not isinstance(innermost(opt2), optkit.Optimizer):
        return
    p0 = innermost(opt2).param_groups[0]["params"][0]
    before = innermost(opt2).state[p0]
    with pytest.raises(TypeError, match="state of a parameter must be a dict"):
        opt2.state[p0] = 1
    assert opt2.state[p0] is before


# ------------------------------------------------------------------------------------------------ step API


def _closure_backwards(row: Row) -> bool:
    """Loss-scale and mixed-precision wrappers back-propagate ``loss·S`` themselves."""
    return row.feed_scale == 1.0 and not row.half_masters


@pytest.mark.parametrize("row_id", ROW_IDS)
def test_closure(row_id):
    """``step(closure)`` returns the closure's loss and applies the gradients the closure produced."""
    row = BY_ID[row_id]
    dtype = default_dtype(row)
    params = make_params(dtype, shapes=row.shapes)
    opt = row.build(params, LR)
    cs = grads_at(0, dtype, shapes=row.shapes)

    def closure():
        opt.zero_grad()
        loss = sum((p * c).sum() for (_, p), c in zip(params, cs))
        if _closure_backwards(row):
            loss.backward()
        return loss

    loss = opt.step(closure)
    expected = sum((p0 * c).sum() for (_, p0), c in zip(make_params(dtype, shapes=row.shapes), cs))
    torch.testing.assert_close(loss.detach(), expected.detach())
    ref_params, _ = train(row, dtype, steps=1)
    for (_, p), (_, q) in zip(params, ref_params):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("row_id", ROW_IDS)
def test_apply_gradients_leaves_its_arguments_untouched(row_id):
    """TF/Keras ``apply_gradients``: the given gradient tensors are never written (fused kernels, clipping and
    unscaling work on copies), so re-applying one gradient list is two equal steps."""
    row = BY_ID[row_id]
    dtype = default_dtype(row)
    params = make_params(dtype, shapes=row.shapes)
    opt = row.build(params, LR)
    variables = [p for _, p in params] if not row.half_masters else opt._all_params()
    grads = [g.to(v.dtype) for g, v in zip(grads_at(0, dtype, shapes=row.shapes), variables)]
    if row.half_masters:
        grads = [g * row.feed_scale for g in grads]
    kept = [g.clone() for g in grads]
    opt.apply_gradients(list(zip(grads, variables)))
    opt.apply_gradients(list(zip(grads, variables)))
    assert_bitwise(grads, kept)
    ref_params = make_params(dtype, shapes=row.shapes)
    ref_opt = row.build(ref_params, LR)
    for _ in range(2):
        set_grads(ref_params, grads_at(0, dtype, shapes=row.shapes), scale=row.feed_scale, opt=ref_opt)
        ref_opt.step()
    for (_, p), (_, q) in zip(params, ref_params):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------ host reads


@pytest.mark.parametrize("layout", ["contiguous", "flat"])
@pytest.mark.parametrize("row_id", [r for r in ROW_IDS if r != "LossScale(torch.Adam,dynamic)"])
def test_step_reads_no_tensor_on_the_host(row_id, layout, monkeypatch):
    """After the first steps, ``step()`` reads no tensor value on the host (on a GPU each read is a sync; the
    CUDA run of ``tests/test_cuda.py`` checks the syncs themselves). Loss scales are told their state lives on
    an accelerator (on the CPU they read it, which costs nothing there). The one exception by design, a
    torch.optim optimizer under a dynamic loss scale, reads its skip flag as GradScaler does. ``jit_compile``
    rows: compiled code cannot run under the dispatch mode that counts the reads, so the compiled functions
    run as plain Python here (their bodies are the same tensor math) and the code around them is checked."""
    row = BY_ID[row_id]
    dtype = default_dtype(row)
    params, opt = train(row, dtype, layout, steps=2)
    if "jit" in row_id:
        run_uncompiled(monkeypatch)
    o = opt
    while o is not None:
        scaler = getattr(o, "loss_scaler", None)
        if scaler is not None:
            getattr(scaler, "scaler", scaler)._state_on_host = lambda: False
        o = getattr(o, "optimizer", None)
    mode = HostReads()
    for k in range(2, 4):
        set_grads(params, grads_at(k, dtype, shapes=row.shapes), layout, feed_scale(row, opt), opt)
        with mode:
            opt.step()
    assert mode.reads == 0


# ------------------------------------------------------------------------------------------------ lean rows


def _lean_rows() -> list[Row]:
    """Rows whose innermost optimizer asks for a ``precision`` or a ``state_dtype``."""
    def lean(r: Row) -> bool:
        inner = innermost(r.build(make_params(r.dtypes[0], shapes=r.shapes), LR))
        return any(getattr(inner, a, None) is not None for a in ("precision", "state_dtype"))
    return [r for r in ROWS if lean(r)]


@pytest.mark.parametrize("row_id", [r.id for r in _lean_rows()])
def test_lean_rows_run_the_lean_pass(row_id):
    """The lean rows' default dtype keeps the forms they ask for, so every crossing above that takes it runs
    the lean pass: a split master's low halves (raw bits), a Kahan compensation in bfloat16 (bfloat16 weights
    only), 8-bit codes with float32 block scales (tensors of 4,096 elements or more; the others float32),
    bfloat16 slots; ``"rounding_step"`` in the state dict under stochastic rounding."""
    row = BY_ID[row_id]
    dtype = default_dtype(row)
    params, opt = train(row, dtype, steps=1)
    inner = innermost(opt)
    extra = {"split": ("master_low", torch.bfloat16), "kahan": ("kahan_comp", torch.bfloat16)}
    for name, p in params:
        st = inner.state[p]
        if inner.precision in extra and dtype == torch.bfloat16:
            key, kind = extra[inner.precision]
            assert st[key].dtype == kind and st[key].shape == p.shape, name
        for slot in inner.get_slot_names():
            if inner.state_dtype == "int8":
                big = p.numel() >= 4096
                assert st[slot].dtype == (torch.uint8 if big else torch.float32 if dtype != torch.float64
                                          else torch.float64), (name, slot)
                assert (f"{slot}_absmax" in st) == big
            elif inner.state_dtype == "bfloat16":
                assert st[slot].dtype == torch.bfloat16, (name, slot)
            else:
                assert st[slot].dtype == torch.float32, (name, slot)
    assert ("rounding_step" in inner.state_dict()) == (inner.precision == "stochastic")


@pytest.mark.parametrize("row_id", [r.id for r in _lean_rows() if torch.float16 not in r.dtypes])
def test_lean_rows_refuse_float16(row_id):
    """A master-free ``precision`` is for bfloat16 parameters: over float16 parameters (which train with fp32
    masters and a loss scale) the optimizer refuses to be built, naming the argument."""
    row = BY_ID[row_id]
    with pytest.raises(ValueError, match="precision"):
        row.build(make_params(torch.float16, shapes=row.shapes), LR)
