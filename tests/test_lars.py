"""``optkit.LARS`` against the spec vectors L1-L8 (both TF variants; ``shared/spec/tf_keras.md`` §1.1, checked
there against the TF 1.14/1.15 sources), M1/M5 (where Model Garden coincides with TF 1.15) and a float64 NumPy
reference written from the formulas over random multi-tensor problems."""

from __future__ import annotations

import itertools
import math
import zlib

import numpy as np
import pytest
import torch

import optkit
from optkit import LARS
from scaled_grads import step_checking_grads

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")

VARIANTS = ("tf1.14", "tf1.15")


def run(variant, grads, w0=(3.0, 4.0), *, name="w", lr=0.1, **kw):
    cfg = dict(momentum=0.9, weight_decay=0.1, eeta=0.1)
    cfg.update(kw)
    w = torch.tensor(w0, requires_grad=True)
    opt = LARS([(name, w)], lr, variant=variant, **cfg)
    out = []
    for g in grads:
        w.grad = torch.tensor(g)
        opt.step()
        out.append((w.detach().clone(), opt.get_slot(w, "momentum").clone()))
    return out


def close(t, expected, tol=1e-6):
    np.testing.assert_allclose(
        t.detach().double().numpy(), np.asarray(expected, np.float64), rtol=tol, atol=tol
    )


# (case, kwargs, grads, {variant: [(w, a) per step]}) — tf_keras.md §1.1 table
SPEC = [
    (
        "L1",
        {},
        [[0.3, 0.4]] * 2,
        {
            "tf1.14": [([2.985, 3.98], [0.3, 0.4]), ([2.9565714, 3.9420952], [0.57, 0.76])],
            "tf1.15": [([2.97, 3.96], [0.03, 0.04]), ([2.9133, 3.8844], [0.0567, 0.0756])],
        },
    ),
    (
        "L2",
        {"use_nesterov": True},
        [[0.3, 0.4]] * 2,
        {
            "tf1.14": [([2.9715, 3.962], None), ([2.931044, 3.9080587], [0.57, 0.76])],
            "tf1.15": [([2.943, 3.924], None), ([2.862783, 3.817044], [0.05643, 0.07524])],
        },
    ),
    (
        "L3",
        {},
        [[0.4, -0.3]] * 2,
        {
            "tf1.14": [([2.98, 4.015], [0.4, -0.3]), ([2.9419998, 4.0435002], [0.76, -0.57])],
            "tf1.15": [([2.965, 3.995], [0.035, 0.005]), ([2.8987621, 3.9855374], [0.0662379, 0.0094626])],
        },
    ),
    (
        "L4",
        {},
        [[0.0, 0.0]],
        {"tf1.14": [([3.0, 4.0], [0.0, 0.0])], "tf1.15": [([2.97, 3.96], [0.03, 0.04])]},
    ),
    (
        "L5",
        {"w0": (0.0, 0.0)},
        [[0.3, 0.4]],
        {"tf1.14": [([-0.03, -0.04], [0.3, 0.4])], "tf1.15": [([-0.03, -0.04], [0.03, 0.04])]},
    ),
    (
        "L6",
        {"name": "dense_bias", "skip_list": ["bias"]},
        [[0.3, 0.4]] * 2,
        {
            "tf1.14": [([2.97, 3.96], None), ([2.913, 3.884], [0.57, 0.76])],
            "tf1.15": [([2.97, 3.96], None), ([2.913, 3.884], [0.057, 0.076])],
        },
    ),
    (
        "L7",
        {"momentum": 0.9, "weight_decay": 1e-4, "eeta": 1e-3, "lr": 1.0},
        [[0.3, 0.4]],
        {"tf1.14": [([2.997003, 3.996004], [0.3, 0.4])], "tf1.15": [([2.997, 3.996], [0.003, 0.004])]},
    ),
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", SPEC, ids=[c[0] for c in SPEC])
def test_spec_vectors_l1_to_l7(case, variant):
    _, kw, grads, expected = case
    out = run(variant, grads, **kw)
    for (w, a), (ew, ea) in zip(out, expected[variant]):
        close(w, ew)
        if ea is not None:
            close(a, ea)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("nesterov", [False, True])
def test_spec_l8_sparse_plain_momentum_base_lr(variant, nesterov):
    w = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]], requires_grad=True)
    opt = LARS([w], 0.1, momentum=0.9, weight_decay=0.1, eeta=0.1, variant=variant, use_nesterov=nesterov)
    ref_w, ref_a = np.array([1.0, 1.0]), np.zeros(2)
    for _ in range(2):
        w.grad = torch.sparse_coo_tensor(
            torch.tensor([[0, 0]]), torch.tensor([[1.0, 1.0], [2.0, 2.0]]), (3, 2)
        )
        opt.step()
        g = np.array([3.0, 3.0])  # de-duplicated sum
        ref_a = 0.9 * ref_a + g
        ref_w = ref_w - (0.1 * g + 0.1 * 0.9 * ref_a if nesterov else 0.1 * ref_a)
    if not nesterov:
        close(w[0], [0.13, 0.13])
        close(opt.get_slot(w, "momentum")[0], [5.7, 5.7])
    close(w[0], ref_w)
    close(opt.get_slot(w, "momentum")[0], ref_a)
    close(w[1:], [[2.0, 2.0], [3.0, 3.0]])
    close(opt.get_slot(w, "momentum")[1:], [[0.0, 0.0], [0.0, 0.0]])


def test_sparse_momentum_zero_keeps_tf_slot_as_the_dense_rule():
    """LARS keeps TF's ``ApplyMomentum`` slot at ``momentum=0`` (``a ← 0·a + g``) on both paths, unlike
    ``Momentum`` (torch's rule): with every row touched the TF 1.14 slot of sparse gradients equals the dense
    one when the momentum is raised from 0 to 0.9, and both match the float64 reference ``a ← m·a + g``."""
    rng = np.random.default_rng(8)
    w0 = rng.standard_normal((4, 2))
    grads = [rng.standard_normal((4, 2)) for _ in range(3)]
    slots = []
    for sparse in (True, False):
        w = torch.tensor(w0, requires_grad=True)
        opt = LARS([w], 0.1, momentum=0.0, weight_decay=0.1, eeta=0.1, variant="tf1.14")
        for g, mu in zip(grads, (0.0, 0.0, 0.9)):
            opt.param_groups[0]["momentum"] = mu
            g = torch.tensor(g)
            w.grad = g.to_sparse(1) if sparse else g  # (row slices, as nn.Embedding)
            opt.step()
        slots.append(opt.get_slot(w, "momentum"))
    a = np.zeros_like(w0)
    for g, mu in zip(grads, (0.0, 0.0, 0.9)):
        a = mu * a + g
    for s in slots:
        np.testing.assert_allclose(s.numpy(), a, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "case,grad,step1,step2",
    [
        ("M1", [0.3, 0.4], ([2.97, 3.96], [0.03, 0.04]), ([2.9133, 3.8844], [0.0567, 0.0756])),
        ("M5", [0.3, 0.4], ([2.97, 3.96], [0.03, 0.04]), ([2.913, 3.884], [0.057, 0.076])),
    ],
)
def test_model_garden_vectors_where_tf115_coincides(case, grad, step1, step2):
    kw = {"name": "dense/bias", "skip_list": ["bias"]} if case == "M5" else {}
    out = run("tf1.15", [grad, grad], **kw)
    for (w, a), (ew, ea) in zip(out, (step1, step2)):
        close(w, ew)
        close(a, ea)


def test_non_finite_gradient_follows_tf():
    ((w, _),) = run("tf1.14", [[math.inf, 0.4]])
    assert math.isnan(float(w[0])) and float(w[1]) == pytest.approx(4.0)  # trust 0: 0·inf = NaN, 0 elsewhere
    ((w, a),) = run("tf1.15", [[math.inf, 0.4]])
    assert math.isnan(float(w[0])) and math.isnan(float(a[0]))
    assert float(a[1]) == 0.0 and float(w[1]) == pytest.approx(4.0)


def test_exclude_1d_skips_vectors():
    w = torch.tensor([3.0, 4.0], requires_grad=True)
    m = torch.tensor([[3.0, 4.0]], requires_grad=True)
    opt = LARS([("b", w), ("k", m)], 0.1, momentum=0.9, weight_decay=0.1, eeta=0.1, exclude_1d=True)
    for t in (w, m):
        t.grad = torch.tensor([0.3, 0.4]).reshape(t.shape)
    opt.step()
    close(w, [2.97, 3.96])  # trust 1, no decay (L6)
    close(m, [[2.97, 3.96]])  # trust 0.5 with decay (L1-B)
    close(opt.get_slot(w, "momentum"), [0.03, 0.04])


# ------------------------------------------------------------------------------------------------------------
# float64 reference over random multi-tensor problems


def lars_reference(
    ws,
    grads_seq,
    lrs,
    names,
    *,
    variant,
    momentum,
    wd,
    eeta,
    eps,
    nesterov,
    skip_list=None,
    exclude_1d=False,
    global_clip=None,
):
    ws = [w.copy() for w in ws]
    accs = [np.zeros_like(w) for w in ws]
    for grads, lr in zip(grads_seq, lrs):
        gs = [g.copy() for g in grads]
        if global_clip is not None:
            n = math.sqrt(sum(float(np.sum(g * g)) for g in gs))
            gs = [g * global_clip / max(n, global_clip) for g in gs]
        for i, (w, g) in enumerate(zip(ws, gs)):
            skipped = (exclude_1d and w.ndim <= 1) or (
                skip_list is not None and any(s in names[i] for s in skip_list)
            )
            if skipped:
                trust = 1.0
            else:
                wn, gn = np.linalg.norm(w), np.linalg.norm(g)
                trust = eeta * wn / (gn + wd * wn + eps) if wn > 0 and gn > 0 else 1.0
            s = lr * trust
            if variant == "tf1.15":
                u = s * (g + (0.0 if skipped else wd) * w)
                accs[i] = momentum * accs[i] + u
                ws[i] = w - (u + momentum * accs[i] if nesterov else accs[i])
            else:
                accs[i] = momentum * accs[i] + g
                ws[i] = w - (s * g + s * momentum * accs[i] if nesterov else s * accs[i])
    return ws, accs


SHAPES = [(8, 3), (5,), (2, 3, 4), (1,), (7, 2)]
NAMES = ["conv.weight", "conv.bias", "block.weight", "bn.scale", "fc.weight"]


@pytest.mark.parametrize(
    "variant,nesterov,momentum,opts",
    list(itertools.product(VARIANTS, [False, True], [0.0, 0.9], ["plain", "skip", "exclude_1d", "clip"])),
)
def test_random_problems_match_float64_reference(variant, nesterov, momentum, opts):
    rng = np.random.default_rng(zlib.crc32(repr((variant, nesterov, momentum, opts)).encode()))
    ws = [rng.standard_normal(s) for s in SHAPES]
    ws[3] = np.zeros(1)  # a zero-norm parameter (trust falls back to 1)
    steps = 4
    grads_seq = [[rng.standard_normal(s) * 0.1 for s in SHAPES] for _ in range(steps)]
    grads_seq[1][0] = np.zeros(SHAPES[0])  # a zero gradient
    lrs = [0.5, 0.2, 0.8, 0.3]
    kw = dict(
        momentum=momentum, weight_decay=0.01, eeta=0.02, epsilon=1e-5, use_nesterov=nesterov, variant=variant
    )
    extra = {
        "skip": {"skip_list": ["bias", "bn"]},
        "exclude_1d": {"exclude_1d": True},
        "clip": {"global_clipnorm": 0.3},
    }.get(opts, {})
    ts = [torch.tensor(w, dtype=torch.float32, requires_grad=True) for w in ws]
    opt = LARS(list(zip(NAMES, ts)), lrs[0], **kw, **extra)
    for grads, lr in zip(grads_seq, lrs):
        opt.learning_rate = lr
        for t, g in zip(ts, grads):
            t.grad = torch.tensor(g, dtype=torch.float32)
        opt.step()
    ref_w, ref_a = lars_reference(
        [t.detach().double().numpy() * 0 + w for t, w in zip(ts, ws)],
        grads_seq,
        lrs,
        NAMES,
        variant=variant,
        momentum=momentum,
        wd=0.01,
        eeta=0.02,
        eps=1e-5,
        nesterov=nesterov,
        skip_list=extra.get("skip_list"),
        exclude_1d=extra.get("exclude_1d", False),
        global_clip=extra.get("global_clipnorm"),
    )
    for t, w, a in zip(ts, ref_w, ref_a):
        close(t, w, 2e-5)
        close(opt.get_slot(t, "momentum"), a, 2e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_blocked_pass_splits_large_tensors(variant):
    """Tensors bigger than ``block_numel`` are updated chunk by chunk; per-tensor trust ratios still use the
    norm of the whole tensor."""
    rng = np.random.default_rng(4)
    ws = [rng.standard_normal((40, 30)), rng.standard_normal(50), rng.standard_normal((3, 7))]
    grads_seq = [[rng.standard_normal(w.shape) for w in ws] for _ in range(3)]
    outs = []
    for block in (64, 1 << 20):
        ts = [torch.tensor(w, dtype=torch.float64, requires_grad=True) for w in ws]
        opt = LARS(ts, 0.3, variant=variant, use_nesterov=True, weight_decay=0.01, block_numel=block)
        for grads in grads_seq:
            for t, g in zip(ts, grads):
                t.grad = torch.tensor(g)
            opt.step()
        outs.append(ts)
    ref_w, _ = lars_reference(
        ws,
        grads_seq,
        [0.3] * 3,
        ["a", "b", "c"],
        variant=variant,
        momentum=0.9,
        wd=0.01,
        eeta=0.001,
        eps=0.0,
        nesterov=True,
    )
    for a, b, r in zip(outs[0], outs[1], ref_w):
        close(a, r, 1e-12)
        close(b, r, 1e-12)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 5e-3), (torch.bfloat16, 3e-2)])
def test_half_precision(dtype, tol):
    rng = np.random.default_rng(8)
    ts = [torch.tensor(rng.standard_normal((16, 8)), dtype=dtype, requires_grad=True)]
    ws = [t.detach().double().numpy() for t in ts]
    grads_seq = [
        [torch.tensor(rng.standard_normal((16, 8)) * 0.1).to(dtype).double().numpy()] for _ in range(2)
    ]
    opt = LARS(ts, 1.0, weight_decay=0.01, eeta=0.1)
    for grads in grads_seq:
        ts[0].grad = torch.tensor(grads[0]).to(dtype)
        opt.step()
    ref_w, _ = lars_reference(
        ws,
        grads_seq,
        [1.0] * 2,
        ["w"],
        variant="tf1.15",
        momentum=0.9,
        wd=0.01,
        eeta=0.1,
        eps=0.0,
        nesterov=False,
    )
    assert ts[0].dtype == dtype
    np.testing.assert_allclose(ts[0].detach().double().numpy(), ref_w[0], rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------------------------------
# validation and config


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"momentum": -0.1}, ValueError, "momentum should be positive"),
        ({"weight_decay": -1e-4}, ValueError, "weight_decay should be positive"),
        ({"momentum": "0.9"}, TypeError, "momentum"),
        ({"eeta": None}, TypeError, "eeta"),
        ({"skip_list": "bias"}, TypeError, "skip_list"),
        ({"use_nesterov": 1}, TypeError, "use_nesterov"),
        ({"variant": "tf2"}, ValueError, "variant"),
        ({"exclude_1d": "yes"}, TypeError, "exclude_1d"),
        ({"learning_rate": -1.0}, ValueError, "learning_rate"),
    ],
)
def test_validation(kwargs, exc, match):
    w = torch.ones(3, requires_grad=True)
    kw = {"learning_rate": 0.1, **kwargs}
    with pytest.raises(exc, match=match):
        LARS([w], **kw)
    assert torch.equal(w.detach(), torch.ones(3))


def test_zero_momentum_and_zero_decay_allowed_and_learning_rate_required():
    LARS([torch.ones(2, requires_grad=True)], 0.1, momentum=0.0, weight_decay=0.0)
    with pytest.raises(TypeError):
        LARS([torch.ones(2, requires_grad=True)])  # learning_rate is required, as in TF


def test_config_keeps_options():
    opt = LARS(
        [("w", torch.ones(2, requires_grad=True))],
        0.2,
        momentum=0.8,
        weight_decay=1e-3,
        eeta=0.01,
        epsilon=1e-6,
        skip_list=["bn"],
        use_nesterov=True,
        variant="tf1.14",
        exclude_1d=True,
    )
    cfg = opt.get_config()
    assert {
        k: cfg[k]
        for k in (
            "momentum",
            "weight_decay",
            "eeta",
            "epsilon",
            "skip_list",
            "nesterov",
            "variant",
            "exclude_1d",
        )
    } == {
        "momentum": 0.8,
        "weight_decay": 1e-3,
        "eeta": 0.01,
        "epsilon": 1e-6,
        "skip_list": ["bn"],
        "nesterov": True,  # the canonical name (TF1's use_nesterov= is accepted for it)
        "variant": "tf1.14",
        "exclude_1d": True,
    }
    assert LARS.from_config(cfg, [("w", torch.ones(2, requires_grad=True))]).get_config() == cfg


@pytest.mark.parametrize("layout", ["tensors", "flat"])
@pytest.mark.parametrize("variant,nesterov", [("tf1.15", False), ("tf1.14", True)])
def test_jit_compile_matches_eager(variant, nesterov, layout):
    """``jit_compile=True`` (LARS's pointwise rule in one compiled graph) really compiles and gives the eager
    result, with a skip list, under a loss scale's unscaling factor (global clipping) and a skipped step;
    over flat buffers the compiled rule steps the whole run matrices (with EMA over their averages)."""
    import warnings

    from optkit.optimizer import Optimizer

    torch.manual_seed(3)
    shapes = [(6, 5), (5,), (4, 3, 2)]
    names = ["a.weight", "a.bias", "b.weight"]
    if layout == "flat":
        shapes = [(5,), (5,), (5,), (2, 3), (3, 2), (4,)]
        names = ["a.weight", "a.bias", "b.weight", "c.weight", "d.weight", "d.bias"]
    w0 = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(4)]
    runs = []
    rows = []
    original = Optimizer._run_compiled_rows

    def counted(self, *a, **kw):
        rows.append(1)
        return original(self, *a, **kw)

    for jit in (False, True):
        ts = [w.clone().requires_grad_() for w in w0]
        if layout == "flat":
            for t in ts:
                t.grad = torch.zeros_like(t)
            optkit.flat_parameters(ts)
        opt = LARS(list(zip(names, ts)), 0.5, momentum=0.9, weight_decay=0.01,
                   eeta=0.01, skip_list=["bias"], use_nesterov=nesterov, variant=variant, global_clipnorm=2.0,
                   jit_compile=jit, use_ema=layout == "flat", ema_momentum=0.5)
        with warnings.catch_warnings(), pytest.MonkeyPatch.context() as mp:
            mp.setattr(Optimizer, "_run_compiled_rows", counted)
            warnings.filterwarnings("error", message="jit_compile")
            for k, gs in enumerate(grads):
                for t, g in zip(ts, gs):
                    if layout == "flat":  # into the flat gradient's views
                        t.grad.copy_(g)
                    else:
                        t.grad = g.clone()
                if k == 2:
                    opt.found_inf = torch.ones(())
                opt.step()
                opt.__dict__.pop("found_inf", None)
        if jit:
            assert opt._compile_state == "ok"
            assert len(rows) == (len(grads) if layout == "flat" else 0)
        runs.append([t.detach() for t in ts] + ([opt.state[t]["average"] for t in ts] if opt.use_ema else []))
    for a, b in zip(*runs):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_jit_compile_norm_pass_failure_falls_back_to_the_eager_result(monkeypatch):
    """``jit_compile``'s compiled norm pass (:func:`optkit._core.chain.norm_sums`, row sums of squares)
    failing to compile warns once and gives the eager result (the eager norms, then eager steps), with a
    skipped step on the way; when it compiles, its norms are the float64 norms of the tensors."""
    import warnings

    from optkit._core import chain as _compile

    torch.manual_seed(5)
    shapes = [(70, 90), (5,), (4, 3, 2)]  # the first is longer than a row of the split (4,096)
    ws = [torch.randn(s) for s in shapes]
    gs = [torch.randn(s) for s in shapes]
    fn = _compile.compiled_function(_compile.norm_sums)
    got = fn(ws, gs)
    want = torch.stack([torch.stack((w.double().square().sum(), g.double().square().sum()))
                        for w, g in zip(ws, gs)])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)

    def fail(*args, **kwargs):
        raise RuntimeError("simulated compiler failure")

    monkeypatch.setitem(_compile._COMPILED_OTHER, _compile.norm_sums, fail)
    runs = []
    for jit in (False, True):
        ts = [w.clone().requires_grad_() for w in ws]
        opt = LARS(ts, 0.5, momentum=0.9, weight_decay=0.01, eeta=0.01, jit_compile=jit)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for k in range(3):
                for t, g in zip(ts, gs):
                    t.grad = (g * (k + 1)).clone()
                if k == 1:
                    opt.found_inf = torch.ones(())
                opt.step()
                opt.__dict__.pop("found_inf", None)
        assert sum("running eagerly" in str(w.message) for w in caught) == (1 if jit else 0)
        if jit:
            assert opt._compile_state == "failed"
        runs.append([t.detach() for t in ts])
    for a, b in zip(*runs):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_jit_compile_update_step_and_many_flat_runs_take_the_eager_paths(monkeypatch):
    """``update_step`` (Keras, one variable) under ``jit_compile`` gives the eager result (its light plan
    takes the eager norms); over flat buffers with more row runs than
    ``optkit.optimizer.COMPILE_WARN_TENSORS`` (lowered to 2 here; weights and biases alternate, so every
    parameter is its own run), LARS and LAMB take the eager row pass instead of compiling every run, with
    the eager result."""
    from optkit import lamb, lars
    from optkit.optimizer import Optimizer

    torch.manual_seed(2)
    w0, g0 = torch.randn(4, 3), torch.randn(4, 3)
    got = []
    for jit in (False, True):
        w = w0.clone().requires_grad_()
        opt = LARS([w], 0.5, momentum=0.9, weight_decay=0.01, eeta=0.01, jit_compile=jit)
        for _ in range(2):
            opt.update_step(g0, w, 0.5)
        got.append(w.detach())
    torch.testing.assert_close(got[1], got[0], rtol=1e-6, atol=1e-7)

    monkeypatch.setattr(lars, "COMPILE_WARN_TENSORS", 2)
    monkeypatch.setattr(lamb, "COMPILE_WARN_TENSORS", 2)
    compiled_rows = []
    original = Optimizer._run_compiled_rows
    monkeypatch.setattr(Optimizer, "_run_compiled_rows",
                        lambda self, *a, **kw: (compiled_rows.append(1), original(self, *a, **kw))[1])
    for build in (lambda ps, jit: LARS(ps, 0.5, eeta=0.01, jit_compile=jit),
                  # (LAMB's eager row runs keep u in the gradient rows: scratch_grads, as the train op)
                  lambda ps, jit: optkit.LAMB(ps, 0.05, weight_decay=0.01, jit_compile=jit,
                                              scratch_grads=True)):
        runs = []
        for jit in (False, True):
            torch.manual_seed(3)
            net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).double()
            optkit.flat_parameters(net)
            opt = build(list(net.parameters()), jit)
            x = torch.randn(5, 3, dtype=torch.float64)
            for _ in range(3):
                opt.zero_grad()
                net(x).square().sum().backward()
                opt.step()
            assert list(opt._plans.values())[0].flat_active
            runs.append([p.detach() for p in net.parameters()])
        for a, b in zip(*runs):
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-14)
    assert not compiled_rows


# ------------------------------------------------------------------------------------------------ .grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("variant,nesterov", [("tf1.15", False), ("tf1.15", True), ("tf1.14", True)])
def test_step_leaves_grad_and_matches_the_scratch_mode(variant, nesterov, dtype):
    """``step()`` leaves every ``.grad`` bitwise as it was, as ``torch.optim`` does (LARS used to leave
    ``s·k·g + s·wd·w`` there), or ``g/S`` under a loss scale ``S`` (``grad_scale``); the update is bit for bit
    the one of ``scratch_grads=True``, where the rule runs in the gradients themselves: the default mode runs
    it on in-cache copies of the gradient chunks. Blocks of a few large tensors (``s·k`` in the kernel) and
    of many small ones, tensors cut across blocks, with and without a loss scale."""
    rng = np.random.default_rng(4)
    shapes = [(40, 30), (30,), (7, 5), (5,), (300,)]
    names = [f"l{i}.weight" if len(s) > 1 else f"l{i}.bias" for i, s in enumerate(shapes)]
    ws = [torch.tensor(rng.standard_normal(s) * 0.5, dtype=dtype) for s in shapes]
    gs = [[torch.tensor(rng.standard_normal(s), dtype=dtype) for s in shapes] for _ in range(3)]
    for scale in (None, 256.0):
        out = []
        for scratch in (False, True):
            ps = [w.clone().requires_grad_() for w in ws]
            opt = LARS(list(zip(names, ps)), 0.1, eeta=0.01, weight_decay=1e-3, use_nesterov=nesterov,
                       variant=variant, skip_list=["l1."], block_numel=500, scratch_grads=scratch)
            for step in gs:
                for p, g in zip(ps, step):
                    p.grad = g.clone() if scale is None else (g.double() * scale).to(dtype)
                step_checking_grads(opt, ps, scale, scratch)
            out.append(ps)
        assert all(torch.equal(a, b) for a, b in zip(*out))
