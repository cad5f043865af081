"""The contract matrix, train-op rows: ``optimize_loss`` configurations crossed with overflow skips (first and
later update), checkpoints through ``torch.load(weights_only=True)`` (also inside an accumulation window),
dtypes and parameter layouts.

References: the same configuration without the overflowing window (skips), the uninterrupted run (checkpoints,
bit for bit), the same configuration on a float64 model (dtypes), the contiguous model (layouts); for the
float64 rows a float64 NumPy transcription of the model, the window's token-weighted mean and the rule
(1e-12).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import contract_table
import optkit
from compiled_passes import run_uncompiled
from host_reads import HostReads
from reference_rules import Reference

UPDATES = 4


@dataclass(frozen=True)
class TrainRow:
    id: str
    optimizer: str
    params: dict = field(default_factory=dict)
    lr: float = 0.05
    dtype: Any = torch.float32
    loss_scaling: Any = 1.0
    loss_scaling_params: dict | None = None
    larc_params: dict | None = None
    clip_gradients: float | None = None
    iter_size: int = 1
    #: further optimize_loss keywords (parameter rules, layer decay)
    extra: dict = field(default_factory=dict)
    #: the loss returns (Σ loss, number of items), a varying count per micro-batch (token weighting)
    token_weighted: bool = False
    #: with ``token_weighted``: the count of the window's m-th micro-batch (its first rows are the items),
    #: instead of the rows whose target's first entry is positive
    token_counts: tuple[int, ...] | None = None

    @property
    def dynamic(self) -> bool:
        return isinstance(self.loss_scaling, str)


ROWS = [
    # every registry optimizer in float32 under dynamic scaling: a first-update overflow must skip cleanly
    *[TrainRow(f"{name}-fp32-dynamic", name, p, loss_scaling="dynamic")
      for name, p in [("SGD", {"momentum": 0.9}), ("Momentum", {"momentum": 0.9}), ("Adam", {}),
                      ("AdamW", {"weight_decay": 0.01}), ("Adagrad", {}), ("RMSProp", {}), ("Ftrl", {}),
                      ("LARS", {"eeta": 0.01}), ("LAMB", {"weight_decay": 0.01})]],
    TrainRow("Momentum-fp32-Backoff", "Momentum", {"momentum": 0.9}, loss_scaling="Backoff"),
    TrainRow("Momentum-fp32-LogMax", "Momentum", {"momentum": 0.9}, loss_scaling="LogMax"),
    TrainRow("Momentum-bf16", "Momentum", {"momentum": 0.9}, dtype=torch.bfloat16),
    TrainRow("SGD-mixed-Backoff-LARC", "SGD", {"momentum": 0.9}, dtype="mixed", loss_scaling="Backoff",
             larc_params={"larc_eta": 0.02}),
    TrainRow("Adam-fp32-accumulate-clip", "Adam", {}, clip_gradients=0.5, iter_size=2,
             loss_scaling="dynamic"),
    TrainRow("LARS-bf16", "LARS", {"eeta": 0.01}, dtype=torch.bfloat16),
    TrainRow("AdamW-fp16-dynamic", "AdamW", {"weight_decay": 0.01}, dtype=torch.float16,
             loss_scaling="dynamic"),
    TrainRow("LAMB-mixed-Backoff-accumulate-clip", "LAMB",
             {"weight_decay": 0.01, "max_coeff": 5.0, "global_grad_norm_clip": 2.0}, dtype="mixed",
             loss_scaling="Backoff", iter_size=2),
    TrainRow("Momentum-mixed-LogMax-accumulate", "Momentum", {"momentum": 0.9}, dtype="mixed",
             loss_scaling="LogMax", iter_size=2),
    TrainRow("SGD-fp32-rules-accumulate-tokens", "SGD", {"momentum": 0.9, "weight_decay": 0.01},
             loss_scaling="dynamic", iter_size=2, token_weighted=True,
             extra={"rules": [(r"^2\.", {"lr_scale": 0.5})], "no_decay_1d": True}),
    TrainRow("LAMB-mixed-layer-decay", "LAMB", {"weight_decay": 0.01}, dtype="mixed", loss_scaling="Backoff",
             extra={"layer_decay": 0.8, "layer_regex": r"^(\d+)\."}),
    # jit_compile: the compiled norm-and-check pass, the compiled update (zeroing flat gradients in its loop)
    TrainRow("SGD-jit-fp32-dynamic-clip-ema", "SGD",
             {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01, "use_ema": True, "jit_compile": True},
             loss_scaling="dynamic", clip_gradients=0.5),
    # float64 with a gradient scale that is no power of two: a static loss scale of 3, a window of 3
    # micro-batches with 1, 2 and 3 items and a binding clip, so the update divides by 3·6/coef (a float32
    # 1/18 is 3e-8 off); checked against the float64 NumPy reference to 1e-12
    TrainRow("SGD-fp64-static3-accumulate3-tokens-clip", "SGD", {"momentum": 0.9}, dtype=torch.float64,
             loss_scaling=3.0, iter_size=3, token_weighted=True, token_counts=(1, 2, 3), clip_gradients=0.5),
]
BY_ID = {r.id: r for r in ROWS}


def model_dtype(row: TrainRow):
    return torch.float16 if row.dtype == "mixed" else row.dtype


def train_dtype(row: TrainRow):
    """``optimize_loss``'s ``dtype``: a float64 model trains in its own precision (``torch.float32``)."""
    return torch.float32 if row.dtype == torch.float64 else row.dtype


def make_model(dtype, layout="contiguous") -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(dtype)
    if layout == "transposed":
        w = model[0].weight
        model[0].weight = nn.Parameter(w.detach().t().contiguous().t())
    return model


def batch(k: int, dtype, poison: bool = False):
    g = torch.Generator().manual_seed(100 + k)
    x = torch.randn(8, 4, generator=g).to(dtype)
    y = torch.randn(8, 2, generator=g).to(dtype)
    if poison:
        x = x * float("inf")
    return x, y


def build(row: TrainRow, model: nn.Module, op_dtype=None):
    acc = torch.float64 if row.dtype == torch.float64 else torch.float32  # the loss's precision
    built: list = []

    def loss(x, y):
        if row.token_counts is not None:  # the first c rows are the items, c by position in the window
            c = row.token_counts[built[0].micro_steps]
            return ((model(x).to(acc) - y.to(acc)) ** 2).sum(1)[:c].sum(), c
        if row.token_weighted:  # the rows whose target's first entry is positive count (1-7 of 8 here)
            keep = (y[:, 0] > 0).to(acc)
            return (((model(x).to(acc) - y.to(acc)) ** 2).sum(1) * keep).sum(), keep.sum()
        return ((model(x).to(acc) - y.to(acc)) ** 2).mean()

    built.append(optimize_loss(row, loss, model, op_dtype))
    return built[0]


def optimize_loss(row, loss, model, op_dtype=None):
    return optkit.optimize_loss(
        loss, row.optimizer, dict(row.params), row.lr,
        dtype=train_dtype(row) if op_dtype is None else op_dtype,
        loss_scaling=row.loss_scaling, loss_scaling_params=row.loss_scaling_params,
        larc_params=row.larc_params, clip_gradients=row.clip_gradients, iter_size=row.iter_size, model=model,
        **row.extra)


def run(row, op, model, updates, start=0, dtype=None, poison_at=None):
    dtype = model_dtype(row) if dtype is None else dtype
    results = []
    for u in range(start, start + updates):
        for m in range(row.iter_size):
            results.append(op(*batch(10 * u + m, dtype)))
        if poison_at is not None and u == poison_at:
            for m in range(row.iter_size):
                results.append(op(*batch(10 * u + m, dtype, poison=m == 0)))
    return results


def state_tensors(op, model) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    out += [m.detach().clone() for m in op.masters]
    return out + contract_table.state_tensors(op.optimizer.state_dict())


def assert_bitwise(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def assert_close_models(a: nn.Module, b: nn.Module, dtype):
    tol = {torch.float32: 1e-6, torch.float64: 1e-12}.get(dtype, 4 * torch.finfo(dtype).eps)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.detach().double(), q.detach().double(), rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------------------ scratch


@pytest.mark.parametrize("row_id", [r.id for r in ROWS])
def test_update_may_use_the_gradients_as_scratch(row_id):
    """``optimize_loss`` clears the gradients after every update, so it builds its optkit optimizer with
    ``scratch_grads=True`` (the step may use ``.grad`` as scratch: LARS, LAMB and Nesterov SGD skip their
    in-cache copies; torch optimizers are left as they are). ``scratch_grads=False`` in ``optimizer_params``
    is honoured, and the weights are those of the scratch run (the opt-in changes where the math runs, not
    the math)."""
    row = BY_ID[row_id]
    model = make_model(model_dtype(row))
    op = build(row, model)
    inner = op.base_optimizer
    assert not isinstance(inner, optkit.Optimizer) or inner.scratch_grads
    run(row, op, model, UPDATES)
    kept = replace(row, params={**row.params, "scratch_grads": False})
    model2 = make_model(model_dtype(row))
    op2 = build(kept, model2)
    assert not getattr(op2.base_optimizer, "scratch_grads", False)
    run(kept, op2, model2, UPDATES)
    assert_close_models(model2, model, model_dtype(row))


# ------------------------------------------------------------------------------------------------ skips


@pytest.mark.parametrize("at", [0, 2])
@pytest.mark.parametrize("row_id", [r.id for r in ROWS if r.dynamic])
def test_overflow_window_is_skipped_cleanly(row_id, at):
    """A window whose loss overflows (the common OpenSeq2Seq set-up: Momentum + dynamic scaling, first
    update) changes no weight, master or optimizer slot, and the run continues as if it never happened."""
    row = BY_ID[row_id]
    ref_model = make_model(model_dtype(row))
    ref_op = build(row, ref_model)
    run(row, ref_op, ref_model, UPDATES)
    model = make_model(model_dtype(row))
    op = build(row, model)
    run(row, op, model, at)
    before = state_tensors(op, model)
    step_before = int(op.global_step)
    results = [op(*batch(999 + m, model_dtype(row), poison=m == 0)) for m in range(row.iter_size)]
    assert not bool(results[-1].applied)
    assert int(op.global_step) == step_before
    assert_bitwise(state_tensors(op, model), before)
    run(row, op, model, UPDATES - at, start=at)
    for p in model.parameters():
        assert torch.isfinite(p).all()
    assert_close_models(model, ref_model, model_dtype(row))


# ------------------------------------------------------------------------------------------------ state


@pytest.mark.parametrize("micro", [0, 1])
@pytest.mark.parametrize("row_id", [r.id for r in ROWS])
def test_checkpoint_round_trip_is_bit_identical(row_id, micro):
    """Train op ``state_dict`` → ``torch.save`` → ``torch.load(weights_only=True)`` → a fresh train op over a
    copy of the model → continue: bit-identical to the uninterrupted run, also from inside a window."""
    row = BY_ID[row_id]
    if micro and row.iter_size == 1:
        pytest.skip("no accumulation window")
    dt = model_dtype(row)
    ref_model = make_model(dt)
    ref_op = build(row, ref_model)
    run(row, ref_op, ref_model, UPDATES)
    model = make_model(dt)
    op = build(row, model)
    run(row, op, model, 2)
    for m in range(micro):
        op(*batch(10 * 2 + m, dt))
    buf = io.BytesIO()
    torch.save({"op": op.state_dict(), "model": model.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model2 = make_model(dt)
    model2.load_state_dict(saved["model"])
    op2 = build(row, model2)
    op2.load_state_dict(saved["op"])
    for m in range(micro, row.iter_size):
        op2(*batch(10 * 2 + m, dt))
    run(row, op2, model2, UPDATES - 3, start=3)
    assert_bitwise([p.detach() for p in model2.parameters()], [p.detach() for p in ref_model.parameters()])
    assert_bitwise(state_tensors(op2, model2), state_tensors(ref_op, ref_model))


@pytest.mark.parametrize("row_id", [r.id for r in ROWS])
def test_dtype_against_float64_model(row_id):
    """Each configuration in its own precision stays close to the same configuration on a float64 model."""
    row = BY_ID[row_id]
    dt = model_dtype(row)
    model = make_model(dt)
    run(row, build(row, model), model, UPDATES)
    ref = make_model(torch.float64)
    run(row, build(row, ref, op_dtype=torch.float32), ref, UPDATES, dtype=torch.float64)
    tol = {torch.float32: 2e-5}.get(dt, 20 * torch.finfo(dt).eps)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().double(), q.detach(), rtol=tol, atol=tol)


def _mlp_grads(ws: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """∂/∂(W1, b1, W2, b2) of Σ_i ‖W2·tanh(W1·x_i + b1) + b2 − y_i‖² (:func:`make_model`'s network), by hand
    in float64."""
    w1, b1, w2, b2 = ws
    h = np.tanh(x @ w1.T + b1)
    d = 2.0 * (h @ w2.T + b2 - y)
    dh = (d @ w2) * (1.0 - h * h)
    return [dh.T @ x, dh.sum(0), d.T @ h, d.sum(0)]


@pytest.mark.parametrize("row_id", [r.id for r in ROWS if r.dtype == torch.float64])
def test_float64_row_matches_numpy_reference(row_id):
    """A float64 model under a gradient scale that is no power of two (static loss scale, accumulation
    window, token counts, clip) matches the float64 NumPy reference to 1e-12: the update is
    ``rule(clip(Σ_m ∇loss_sum_m / Σ_m c_m))``, whatever the scale the gradients carried."""
    row = BY_ID[row_id]
    model = make_model(torch.float64)
    op = build(row, model)
    ref = Reference("keras_sgd", [p.detach().numpy().copy() for p in model.parameters()],
                    {"momentum": row.params.get("momentum", 0.0)}, {"lr": row.lr})
    for u in range(UPDATES):
        total, items = [np.zeros_like(w) for w in ref.ws], 0
        for m in range(row.iter_size):
            x, y = batch(10 * u + m, torch.float64)
            op(x, y)
            c = row.token_counts[m]
            total = [t + g for t, g in zip(total, _mlp_grads(ref.ws, x.numpy()[:c], y.numpy()[:c]))]
            items += c
        grads = [t / items for t in total]
        if row.clip_gradients is not None:
            n = np.sqrt(sum(np.sum(g * g) for g in grads))
            grads = [g * row.clip_gradients / max(n, row.clip_gradients) for g in grads]
        ref.step(grads)
    assert int(op.global_step) == UPDATES
    for p, w in zip(model.parameters(), ref.ws):
        np.testing.assert_allclose(p.detach().numpy(), w, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("row_id", [r.id for r in ROWS])
def test_transposed_weight_layout(row_id):
    """A weight whose strides are not contiguous gives the update of the contiguous model."""
    row = BY_ID[row_id]
    dt = model_dtype(row)
    a, b = make_model(dt), make_model(dt, "transposed")
    assert not b[0].weight.is_contiguous()
    run(row, build(row, a), a, UPDATES)
    run(row, build(row, b), b, UPDATES)
    assert_close_models(a, b, dt)


@pytest.mark.parametrize("row_id", [r.id for r in ROWS])
def test_flat_buffer_layout(row_id):
    """Over flat buffers (``optkit.flat_parameters``) the train op gives the updates of the per-tensor model,
    a poisoned window (dynamic rows) changes nothing, and after every update the gradients are zero views of
    the flat gradient again (an optkit optimizer zeroes them in its update pass; the next backward
    accumulates into them)."""
    row = BY_ID[row_id]
    dt = model_dtype(row)
    a, b = make_model(dt), make_model(dt)
    flat = optkit.flat_parameters(b)
    op_a, op_b = build(row, a), build(row, b)
    half = row.dtype == "mixed"  # the half parameters' gradients are dropped: the masters are updated
    inner, skipped, whole = op_b.base_optimizer, [], []
    zero_grad, whole_grads = inner._zero_grad, inner.whole_grads
    inner._zero_grad = lambda set_to_none, skip: (skipped.append(set(skip)), zero_grad(set_to_none, skip))
    inner.whole_grads = lambda seen=None: whole.append(whole_grads(seen)) or whole[-1]
    for u in range(UPDATES):
        for m in range(row.iter_size):
            ra = op_a(*batch(10 * u + m, dt))
            rb = op_b(*batch(10 * u + m, dt))
            assert "_gathered" not in inner.__dict__  # the hand-over of what whole_grads read ends there
            if ra.grad_norm is not None:  # the global norm (clip, overflow check), also from flat gradients
                torch.testing.assert_close(rb.grad_norm, ra.grad_norm, rtol=1e-5, atol=0)
        if not half:
            assert flat.views_intact()
            for p in b.parameters():
                assert p.grad is not None and not p.grad.any()
        if row.dynamic and u == 1:
            before = state_tensors(op_b, b)
            res = [op_b(*batch(999 + m, dt, poison=m == 0)) for m in range(row.iter_size)]
            assert not bool(res[-1].applied)
            assert_bitwise(state_tensors(op_b, b), before)
    assert_close_models(a, b, dt)
    # groups with a flat part (two or more parameters back to back) were zeroed in the update's pass
    flat_groups = {g for g, plan in inner._plans.items() if getattr(plan, "flat", None) is not None}
    assert any(skipped) == (not half and bool(flat_groups))
    assert set().union(*skipped) <= flat_groups
    # and the norm and overflow check read the flat gradients once the plans were built
    assert any(w is not None for w in whole) == (not half and bool(flat_groups) and bool(whole))


# ------------------------------------------------------------------------------------------------ host reads


@pytest.mark.parametrize("row_id", [r.id for r in ROWS])
def test_train_op_call_reads_no_tensor_on_the_host(row_id, monkeypatch):
    """After the first updates, a train-op call (forward, backward, and the update at a window's end) reads
    no tensor value on the host: on a GPU nothing waits for the device. The loss scale is told its state
    lives on an accelerator (on the CPU it reads it, which costs nothing there). ``jit_compile`` rows: the
    compiled functions run as plain Python under the counting dispatch mode (compiled code cannot run under
    it), so the code around them is checked."""
    row = BY_ID[row_id]
    dt = model_dtype(row)
    model = make_model(dt)
    op = build(row, model)
    scaler = op.scaler
    getattr(scaler, "scaler", scaler)._state_on_host = lambda: False
    run(row, op, model, 2)
    if row.params.get("jit_compile"):
        run_uncompiled(monkeypatch)
    mode = HostReads()
    for u in range(2, 4):
        for m in range(row.iter_size):
            x, y = batch(10 * u + m, dt)
            with mode:
                op(x, y)
    assert mode.reads == 0
