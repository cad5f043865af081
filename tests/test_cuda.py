"""The contract matrix on CUDA, and what only a GPU can show (issue #13, its GPU part). Skipped without CUDA.

* Every row of ``tests/contract_table.py`` in every dtype it takes, in every layout of the matrix (torch's
  CUDA fused kernels guard no layout) and with sparse gradients, against the float64 NumPy reference; skipped
  steps change nothing; the ``optimize_loss`` rows against their CPU run.
* **No host sync** inside ``step()``: after the first step (which builds the plans and the state), the steps
  run under ``torch.cuda.set_sync_debug_mode("error")``, which raises at any device-to-host read or blocking
  copy.
* **CUDA graphs**: one ``step()`` captured with ``torch.cuda.graph`` and replayed over fresh gradients gives
  the eager run's weights, state and counts. Every optkit optimizer and wrapper is capturable without a flag
  (torch's ``capturable=True`` behaviour is optkit's only one: counts, schedules and skips live on the
  device); a float hyperparameter is baked into the graph, a tensor learning rate is read at each replay.

The one documented exception: ``LossScaleOptimizer`` over a ``torch.optim`` optimizer reads the skip flag on
the host (torch's optimizers take no device-side skip), as ``torch.amp.GradScaler`` does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import optkit
from contract_table import BY_ID, LR, ROW_IDS, ROWS, SPARSE_ROWS, SPARSE_SHAPE, innermost
from reference_rules import Reference
from test_contract_matrix import (
    DTYPES,
    LAYOUTS,
    _sparse_grad,
    assert_bitwise,
    assert_matches,
    cases,
    default_dtype,
    feed_scale,
    grads_at,
    make_params,
    optimizer_snapshot,
    reference,
    set_grads,
    train,
)

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.filterwarnings("ignore:Sparse invariant checks"),
]

CUDA = "cuda"
#: rows whose step reads the skip flag on the host by design (a torch.optim optimizer under a loss scale)
HOST_SKIP = {"LossScale(torch.Adam,dynamic)"}
DEVICE_ROWS = [r for r in ROW_IDS if r not in HOST_SKIP]


def _cpu_params(params):
    return [(n, p.detach().cpu()) for n, p in params]


# ------------------------------------------------------------------------------------------------ numerics


@pytest.mark.parametrize("row_id,dt", cases(dtype_key=True))
def test_cuda_dtype_matches_float64_reference(row_id, dt):
    row, dtype = BY_ID[row_id], DTYPES[dt]
    params, _ = train(row, dtype, device=CUDA)
    for _, p in params:
        assert p.device.type == torch.device(CUDA).type and p.dtype == dtype
    assert_matches(_cpu_params(params), reference(row, dtype), dtype, row)


@pytest.mark.parametrize("layout", LAYOUTS[1:])
@pytest.mark.parametrize("row_id", ROW_IDS)
def test_cuda_layout_matches_reference(row_id, layout):
    """Non-dense parameters, channels_last, transposed weights, gradient strides unlike the parameter's and
    flat buffers on CUDA, where torch's fused kernels would silently mis-index them."""
    row = BY_ID[row_id]
    dtype = default_dtype(row)
    params, _ = train(row, dtype, layout, device=CUDA)
    assert_matches(_cpu_params(params), reference(row, dtype), dtype, row)


@pytest.mark.parametrize("row_id", [r.id for r in ROWS
                                    if not r.half_masters and not isinstance(r.sparse, type)])
def test_cuda_sparse_gradients(row_id):
    """``nn.Embedding(sparse=True)`` gradients on CUDA: the touched-rows rule or the densified one
    (float64)."""
    row = BY_ID[row_id]
    torch.manual_seed(0)
    w0 = torch.randn(SPARSE_SHAPE, dtype=torch.float64) * 0.5
    w = w0.clone().to(CUDA).requires_grad_()
    opt = row.build([("emb.weight", w)], LR)
    for k in range(3):
        w.grad = (_sparse_grad(k, torch.float64) * row.feed_scale).to(CUDA)
        if hasattr(opt, "grads_scaled"):
            opt.grads_scaled = True
        opt.step()
    got = w.detach().cpu()
    dense = [_sparse_grad(k, torch.float64).to_dense() for k in range(3)]
    rows = sorted(set(SPARSE_ROWS))
    if row.sparse == "dense":
        ref = row.reference(["emb.weight"], [w0.numpy()])
        for g in dense:
            ref.step([g.numpy()], rows=rows)
        np.testing.assert_allclose(got.numpy(), ref.ws[0], rtol=1e-10, atol=1e-12)
        return
    others = [i for i in range(SPARSE_SHAPE[0]) if i not in rows]
    assert torch.equal(got[others], w0[others])
    clip = {k: v for k, v in row.base.items() if k in ("clipnorm", "clipvalue", "global_clipnorm")}
    sub = Reference(row.sparse_rule, [w0[rows].numpy()], row.sparse_hp or row.hp, {"lr": LR, **clip})
    for g in dense:
        sub.step([g[rows].numpy()])
    np.testing.assert_allclose(got[rows].numpy(), sub.ws[0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("at", [0, 2])
@pytest.mark.parametrize("row_id", ROW_IDS)
def test_cuda_skip_changes_nothing(row_id, at):
    """``found_inf`` = 1 on the device (GradScaler's protocol): nothing changes, and the run goes on bit for
    bit as the run without the skipped step (stochastic rounding: the run whose ``rounding_step`` counts the
    skipped call, as on the CPU)."""
    row = BY_ID[row_id]
    dtype = default_dtype(row)
    plain_params, plain_opt = train(row, dtype, steps=at, device=CUDA)
    inner = innermost(plain_opt)
    if getattr(inner, "precision", None) == "stochastic" and dtype == torch.bfloat16:
        sd = inner.state_dict()
        sd["rounding_step"] += 1
        inner.load_state_dict(sd)
    train(row, dtype, steps=4 - at, params=plain_params, opt=plain_opt, start=at, device=CUDA)
    params = make_params(dtype, device=CUDA, shapes=row.shapes)
    opt = row.build(params, LR)
    if at:
        train(row, dtype, steps=at, params=params, opt=opt, device=CUDA)
    before = optimizer_snapshot(params, opt)
    garbage = grads_at(99, dtype, device=CUDA, shapes=row.shapes)
    garbage[0].view(-1)[0] = float("inf")
    set_grads(params, garbage, scale=feed_scale(row, opt), opt=opt)
    opt.found_inf = torch.ones((), device=CUDA)
    try:
        opt.step()
    finally:
        del opt.found_inf
    assert not bool(opt.step_applied)
    assert_bitwise(optimizer_snapshot(params, opt), before)
    train(row, dtype, steps=4 - at, params=params, opt=opt, start=at, device=CUDA)
    assert_bitwise(optimizer_snapshot(params, opt), optimizer_snapshot(plain_params, plain_opt))


# ---------------------------------------------------------------------------------------------- no host sync


def _scaled_grads(row, opt, dtype, steps, start=0, layout="contiguous"):
    scale = feed_scale(row, opt)
    return [[(g.double() * scale).to(dtype) for g in grads_at(k, dtype, device=CUDA, shapes=row.shapes)]
            for k in range(start, start + steps)]


def _feed(params, grads, opt):
    for (_, p), g in zip(params, grads):
        if p.grad is None or p.grad.shape != g.shape:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)
    if hasattr(opt, "grads_scaled"):
        opt.grads_scaled = True


@pytest.mark.parametrize("layout", ["contiguous", "flat"])
@pytest.mark.parametrize("row_id", DEVICE_ROWS)
def test_step_makes_no_host_sync(row_id, layout):
    """After the first step, ``step()`` neither reads the device nor blocks on a copy: it only queues kernels
    (``set_sync_debug_mode("error")`` raises at any synchronizing call)."""
    row = BY_ID[row_id]
    dtype = default_dtype(row)
    params = make_params(dtype, layout, device=CUDA, shapes=row.shapes)
    opt = row.build(params, LR)
    feeds = _scaled_grads(row, opt, dtype, 5)
    for g in feeds[:2]:
        _feed(params, g, opt)
        opt.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for g in feeds[2:]:
            _feed(params, g, opt)
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref, _ = train(row, dtype, layout, steps=5, device=CUDA)
    for (n, p), (_, q) in zip(params, ref):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("row_id", sorted(HOST_SKIP))
def test_torch_optimizer_under_a_loss_scale_reads_the_skip_on_the_host(row_id):
    """The documented exception: a torch.optim optimizer cannot take a device-side skip."""
    row = BY_ID[row_id]
    dtype = default_dtype(row)
    params = make_params(dtype, device=CUDA, shapes=row.shapes)
    opt = row.build(params, LR)
    feeds = _scaled_grads(row, opt, dtype, 2)
    _feed(params, feeds[0], opt)
    opt.step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _feed(params, feeds[1], opt)
        with pytest.raises(RuntimeError, match="synchroniz"):
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ------------------------------------------------------------------------------------------------ CUDA graphs


def _capture(opt, params, warm_feeds):
    """Warm up on a side stream (torch's recipe), then capture one ``step()``; returns the graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for g in warm_feeds:
            _feed(params, g, opt)
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    if hasattr(opt, "grads_scaled"):
        opt.grads_scaled = True
    with torch.cuda.graph(graph):
        opt.step()
    return graph


def _replay(graph, params, feeds, opt):
    for g in feeds:
        for (_, p), x in zip(params, g):
            p.grad.copy_(x)
        graph.replay()
    torch.cuda.synchronize()


def _assert_same_run(params, opt, ref_params, ref_opt, exact=True):
    tol = {} if not exact else {"rtol": 0, "atol": 0}
    for (n, p), (_, q) in zip(params, ref_params):
        torch.testing.assert_close(p.detach(), q.detach(), msg=n, **tol)
    a, b = optimizer_snapshot(params, opt), optimizer_snapshot(ref_params, ref_opt)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, **tol)
    inner, ref_inner = innermost(opt), innermost(ref_opt)
    if hasattr(inner, "iterations"):  # (a torch.optim optimizer inside an optkit wrapper has no count)
        assert int(inner.iterations) == int(ref_inner.iterations)


@pytest.mark.parametrize("row_id", DEVICE_ROWS)
def test_step_captured_in_a_cuda_graph_matches_eager(row_id):
    """Three eager warm-up steps, one captured ``step()``, five replays over fresh gradients (copied into the
    same ``.grad`` tensors): the eager run's weights, state, averages and count. The EMA overwrite row
    overwrites at the right replays (its count lives on the device)."""
    row = BY_ID[row_id]
    dtype = default_dtype(row)
    ref_params = make_params(dtype, device=CUDA, shapes=row.shapes)
    ref_opt = row.build(ref_params, LR)
    feeds = _scaled_grads(row, ref_opt, dtype, 8)
    for g in feeds:
        _feed(ref_params, g, ref_opt)
        ref_opt.step()
    params = make_params(dtype, device=CUDA, shapes=row.shapes)
    opt = row.build(params, LR)
    graph = _capture(opt, params, feeds[:3])
    _replay(graph, params, feeds[3:], opt)
    _assert_same_run(params, opt, ref_params, ref_opt)


def _schedule():
    return optkit.PolicySchedule("cosine_decay", learning_rate=0.1, decay_steps=6, warmup_steps=2)


@pytest.mark.parametrize("name", ["SGD", "LARS", "LAMB", "Adam"])
def test_cuda_graph_replays_follow_a_schedule_and_a_tensor_lr(name):
    """A schedule is evaluated on the device count at every replay; a tensor learning rate changed in place
    between replays takes effect (a float would be baked into the graph, as in torch)."""
    def build(params, lr):
        ps = [p for _, p in params]
        return {"SGD": lambda: optkit.SGD(ps, learning_rate=lr, momentum=0.9),
                "LARS": lambda: optkit.LARS(ps, lr, eeta=0.01),
                "LAMB": lambda: optkit.LAMB(ps, lr, weight_decay=0.01),
                "Adam": lambda: optkit.Adam(ps, lr)}[name]()

    for kind in ("schedule", "tensor"):
        def lr_for(kind=kind):
            return _schedule() if kind == "schedule" else torch.tensor(0.05, device=CUDA)

        ref_params = make_params(torch.float32, device=CUDA)
        ref_lr = lr_for()
        ref_opt = build(ref_params, ref_lr)
        feeds = [[g.clone() for g in grads_at(k, torch.float32, device=CUDA)] for k in range(9)]
        for k, g in enumerate(feeds):
            if kind == "tensor" and k == 6:
                ref_lr.fill_(0.01)
            _feed(ref_params, g, ref_opt)
            ref_opt.step()
        params = make_params(torch.float32, device=CUDA)
        lr = lr_for()
        opt = build(params, lr)
        graph = _capture(opt, params, feeds[:3])
        _replay(graph, params, feeds[3:6], opt)
        if kind == "tensor":
            lr.fill_(0.01)
        _replay(graph, params, feeds[6:], opt)
        _assert_same_run(params, opt, ref_params, ref_opt, exact=False)


def test_cuda_graph_replay_skips_an_overflow_and_backs_off():
    """A dynamic loss scale inside the graph: a replay whose gradients overflow changes no weight, halves the
    scale on the device, and the next replays go on as the eager run does."""
    def build(params):
        return optkit.LossScaleOptimizer(optkit.SGD([p for _, p in params], learning_rate=LR, momentum=0.9),
                                         optkit.DynamicLossScale(256.0))

    feeds = [[(g * 256.0) for g in grads_at(k, torch.float32, device=CUDA)] for k in range(8)]
    feeds[5][1].view(-1)[0] = float("inf")
    for k in (6, 7):
        feeds[k] = [g / 2 for g in feeds[k]]
    ref_params = make_params(torch.float32, device=CUDA)
    ref_opt = build(ref_params)
    for g in feeds:
        _feed(ref_params, g, ref_opt)
        ref_opt.step()
    assert float(ref_opt.loss_scale) == 128.0
    params = make_params(torch.float32, device=CUDA)
    opt = build(params)
    graph = _capture(opt, params, feeds[:3])
    _replay(graph, params, feeds[3:], opt)
    assert float(opt.loss_scale) == 128.0
    _assert_same_run(params, opt, ref_params, ref_opt)


# --------------------------------------------------------------------------------------------- optimize_loss


def _train_op_rows():
    import test_contract_train_op as T

    return T, [pytest.param(r.id, id=r.id) for r in T.ROWS]


@pytest.mark.parametrize("row_id", _train_op_rows()[1])
def test_cuda_optimize_loss_matches_its_cpu_run(row_id):
    """Each ``optimize_loss`` configuration on CUDA gives its CPU run's weights (the CPU run is checked
    against references in ``test_contract_train_op.py`` and ``test_train.py``)."""
    T, _ = _train_op_rows()
    row = T.BY_ID[row_id]
    dt = T.model_dtype(row)
    results = {}
    for device in ("cpu", CUDA):
        model = T.make_model(dt).to(device)
        op = T.build(row, model)
        for u in range(T.UPDATES):
            for m in range(row.iter_size):
                x, y = T.batch(10 * u + m, dt)
                op(x.to(device), y.to(device))
        results[device] = [p.detach().double().cpu() for p in model.parameters()]
    tol = 2e-5 if dt == torch.float32 else 3e-2
    for p, q in zip(results[CUDA], results["cpu"]):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol)


@pytest.mark.parametrize("row_id", _train_op_rows()[1])
def test_cuda_optimize_loss_call_makes_no_host_sync(row_id):
    """After the first updates a train-op call (forward, backward, the update at a window's end) queues
    kernels only: nothing waits for the device."""
    T, _ = _train_op_rows()
    row = T.BY_ID[row_id]
    dt = T.model_dtype(row)
    model = T.make_model(dt).to(CUDA)
    op = T.build(row, model)
    batches = [[t.to(CUDA) for t in T.batch(10 * u + m, dt)] for u in range(4) for m in range(row.iter_size)]
    warm = 2 * row.iter_size
    for x, y in batches[:warm]:
        op(x, y)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in batches[warm:]:
            op(x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ------------------------------------------------------------------------------------------------ jit_compile


@pytest.mark.parametrize("name", ["SGD-wd-ema", "LARS", "LAMB"])
def test_cuda_jit_compile_matches_eager(name):
    """``jit_compile=True`` on CUDA (Triton kernels) gives the eager step's weights, and compiles (its
    fallback warning is an error here)."""
    import warnings

    def build(params, jit):
        ps = [p for _, p in params]
        return {"SGD-wd-ema": lambda: optkit.SGD(ps, learning_rate=LR, momentum=0.9, weight_decay=0.01,
                                                 use_ema=True, ema_momentum=0.9, jit_compile=jit),
                "LARS": lambda: optkit.LARS(ps, LR, eeta=0.01, weight_decay=0.01, jit_compile=jit),
                "LAMB": lambda: optkit.LAMB(ps, LR, weight_decay=0.01, jit_compile=jit)}[name]()

    runs = []
    for jit in (False, True):
        params = make_params(torch.float32, device=CUDA)
        opt = build(params, jit)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="jit_compile")
            for k in range(3):
                _feed(params, grads_at(k, torch.float32, device=CUDA), opt)
                opt.step()
        runs.append(params)
    for (n, p), (_, q) in zip(*runs):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=n)


# ------------------------------------------------------------------------------------------------ EMA lerp


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_cuda_ema_lerp_forms_are_bit_identical(dtype):
    """On CUDA, the EMA's one-kernel forms (the host's weight through torch's Scalar ``_foreach_lerp_``; the
    device weight as ``weights_like`` views, the List overload's fast route) give the bits of ``torch.lerp``
    tensor by tensor with the 0-d device weight in the tensors' dtype (the form before)."""
    import optkit._multi_tensor as mt

    rng = np.random.default_rng(5)
    shapes = [(3, 5), (7,), (2, 3, 4, 5), (1,), (130,), (1000, 33)]

    def tensors():
        out = [torch.tensor(rng.standard_normal(s)).to(device=CUDA, dtype=dtype) for s in shapes]
        out[2] = out[2].contiguous(memory_format=torch.channels_last)
        return out

    for w64 in [1.0, 0.0, 0.01, 1 - 0.9999, 1 / 11, 0.5, 0.7, float(rng.uniform())]:
        tg, src = tensors(), tensors()
        w = torch.tensor(w64, dtype=torch.float64, device=CUDA)
        want = [torch.lerp(t, s, w.to(dtype)) for t, s in zip(tg, src)]
        for weight, broadcast in [(w64, None), (w, True), (w, False)]:
            got = [t.clone(memory_format=torch.preserve_format) for t in tg]
            mt.lerp_group_(got, src, weight, torch.device(CUDA, torch.cuda.current_device()), dtype,
                           broadcast=broadcast)
            for g, x in zip(got, want):
                assert torch.equal(g, x), (w64, type(weight), broadcast)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lso", [False, True])
def test_cuda_ema_paths_match_the_per_tensor_lerp(monkeypatch, dtype, lso):
    """SGD + wd + EMA (with warm-up) on CUDA: the averages of the shipped path (the host's weight, or under a
    LossScaleOptimizer with skipped steps the device weight as one kernel) equal the per-tensor lerp's by the
    device weight bit for bit, also across a resume from a state dict."""
    from test_ema import _ema_run

    skip = (2, 4) if lso else ()
    old, _ = _ema_run(monkeypatch, "old", dtype, True, skip_at=skip, lso=lso, device=CUDA)
    for resume_at in (None, 3):
        new, _ = _ema_run(monkeypatch, "host", dtype, True, skip_at=skip, resume_at=resume_at, lso=lso,
                          device=CUDA)
        for step, (a, b) in enumerate(zip(old, new)):
            for x, y in zip(a, b):
                assert torch.equal(x, y), (resume_at, step)
