"""The multi-tensor form derived from a pointwise rule (optkit._core.derived): every op bitwise the
per-tensor op, a rule over lists bitwise ``chain``, and an optimizer that states only its rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from optkit import _multi_tensor as mt
from optkit._core import derived as _derived
from optkit._core.chain import chain
from optkit._core.derived import TensorList, run_rule
from optkit.adagrad import _adagrad_pointwise
from optkit.adam import _adam_pointwise
from optkit.ftrl import _ftrl_pointwise
from optkit.momentum import _momentum_pointwise
from optkit.optimizer import Optimizer
from optkit.rmsprop import _rmsprop_pointwise
from optkit.sgd import _keras_sgd_pointwise

DTYPES = [torch.float32, torch.float64, torch.bfloat16]
SHAPES = [(5, 3), (17,), (), (4, 1, 6), (6, 4)]


def _lists(dtype, seed, n=2, positive=False):
    """``n`` parallel lists of seeded random tensors (one of them a transposed, non-contiguous view)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ts = [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]
        if positive:
            ts = [t.abs() + 0.25 for t in ts]
        ts = [t.to(dtype) for t in ts]
        ts[-1] = ts[-1].t()
        out.append(ts)
    return out


S64 = torch.tensor(0.37, dtype=torch.float64)  # a float64 0-d tensor, as chain sees a float64 lr
S32 = torch.tensor(-1.3, dtype=torch.float32)

# each op twice: on the lists as given, and on a temporary (``a * 1.0``: the list updated in place)
OPS = {
    "add": lambda a, b: a + b,
    "add_tmp": lambda a, b: (a * 1.0) + b,
    "add_tmp_right": lambda a, b: a + (b * 1.0),
    "sub": lambda a, b: a - b,
    "sub_tmp": lambda a, b: (a * 1.0) - b,
    "mul": lambda a, b: a * b,
    "mul_tmp": lambda a, b: (a + 0.0) * b,
    "mul_tmp_right": lambda a, b: a * (b + 0.0),
    "div": lambda a, b: a / b,
    "div_tmp": lambda a, b: (a * 1.0) / b,
    "add_num": lambda a, b: a + 0.7,
    "add_num_tmp": lambda a, b: (a * b) + 0.7,
    "sub_num": lambda a, b: a - 0.7,
    "mul_num": lambda a, b: a * 0.7,
    "div_num": lambda a, b: a / 0.7,
    "div_num_tmp": lambda a, b: (a * b) / 0.7,
    "radd_num": lambda a, b: 0.7 + a,
    "radd_num_tmp": lambda a, b: 0.7 + (a * b),
    "rsub_num": lambda a, b: 0.7 - a,
    "rsub_num_tmp": lambda a, b: 0.7 - (a * b),
    "rmul_num": lambda a, b: 0.7 * a,
    "rdiv_num": lambda a, b: 0.7 / a,
    "add_s64": lambda a, b: a + S64,
    "add_s64_tmp": lambda a, b: (a * b) + S64,
    "sub_s64": lambda a, b: a - S64,
    "sub_s64_tmp": lambda a, b: (a * b) - S64,
    "mul_s64": lambda a, b: a * S64,
    "mul_s32_tmp": lambda a, b: (a + b) * S32,
    "div_s64": lambda a, b: a / S64,
    "div_s64_tmp": lambda a, b: (a + b) / S64,
    "radd_s64": lambda a, b: S64 + a,
    "rsub_s64": lambda a, b: S64 - a,
    "rsub_s64_tmp": lambda a, b: S64 - (a * b),
    "rmul_s64": lambda a, b: S64 * a,
    "rdiv_s64": lambda a, b: S64 / a,
    "rdiv_s32": lambda a, b: S32 / a,
    "neg": lambda a, b: -a,
    "neg_tmp": lambda a, b: -(a * b),
    "abs": lambda a, b: a.abs(),
    "sign": lambda a, b: a.sign(),
    "sign_tmp": lambda a, b: (a - b).sign(),
    "clamp_min": lambda a, b: a.clamp_min(0.1),
    "clamp_min_tmp": lambda a, b: (a - b).clamp_min(0.0),
    "clamp_min_s32": lambda a, b: a.clamp_min(S32),
    "clamp_max": lambda a, b: a.clamp_max(0.1),
    "clamp": lambda a, b: a.clamp(-0.5, 0.4),
    "clamp_tmp": lambda a, b: (a * b).clamp(min=-0.2),
    "maximum": lambda a, b: a.maximum(b),
    "minimum": lambda a, b: a.minimum(b),
    "lerp": lambda a, b: a.lerp(b, 0.3),
    "lerp_s64": lambda a, b: a.lerp(b, S32),
    "addcmul": lambda a, b: a.addcmul(b, b, value=-0.5),
    "addcmul_tmp": lambda a, b: (a * 1.0).addcmul(b, a, value=-0.5),
    "add_alpha": lambda a, b: a.add(b, alpha=0.3),
    "sub_alpha_s64": lambda a, b: a.sub(S64, alpha=0.3),
    "addcdiv": lambda a, b: a.addcdiv(a, b, value=0.25),
    "torch_where": lambda a, b: torch.where(a > b, a, b),
    "torch_where_0d": lambda a, b: torch.where(S64 > 0, a * b, b),
    "torch_maximum": lambda a, b: torch.maximum(a, b),
    "torch_maximum_0d": lambda a, b: torch.maximum(S32, a),
    "torch_minimum": lambda a, b: torch.minimum(a, b),
    "torch_sign": lambda a, b: torch.sign(a),
    "torch_abs": lambda a, b: torch.abs(a),
    "torch_neg": lambda a, b: torch.neg(a),
    "torch_clamp": lambda a, b: torch.clamp(a, -0.3, 0.3),
    "torch_add": lambda a, b: torch.add(S64, a),
    "torch_mul": lambda a, b: torch.mul(a, b),
    "torch_sub": lambda a, b: torch.sub(S64, a),
    "torch_div": lambda a, b: torch.div(S64, a),
    "torch_lerp": lambda a, b: torch.lerp(a, b, 0.75),
    "compare": lambda a, b: a <= b,
    "method_loop": lambda a, b: a.square(),  # no foreach form: the per-tensor loop
    "torch_loop": lambda a, b: torch.atan2(a, b),
}
# ops that need positive inputs
POSITIVE_OPS = {
    "sqrt": lambda a, b: a.sqrt(),
    "sqrt_tmp": lambda a, b: (a * b).sqrt(),
    "rsqrt": lambda a, b: a.rsqrt(),
    "exp": lambda a, b: a.exp(),
    "log": lambda a, b: a.log(),
    "log_tmp": lambda a, b: (a + b).log(),
    "reciprocal": lambda a, b: a.reciprocal(),
    "pow": lambda a, b: a ** b,
    "pow_num": lambda a, b: a ** 1.7,
    "pow_two_tmp": lambda a, b: (a * b) ** 2,
    "pow_s64": lambda a, b: a ** S64,
    "rpow_num": lambda a, b: 1.5 ** a,
    "rpow_s64": lambda a, b: S64 ** a,
    "torch_pow_tensor_exponent": lambda a, b: torch.pow(a, S64),
    "torch_pow_scalar_base": lambda a, b: torch.pow(S64, a),
    "torch_sqrt": lambda a, b: torch.sqrt(a),
    "torch_rsqrt": lambda a, b: torch.rsqrt(a),
}


def _check_op(fn, dtype, positive):
    a, b = _lists(dtype, 11, positive=positive)
    a0, b0 = [t.clone() for t in a], [t.clone() for t in b]
    got = fn(TensorList(a), TensorList(b))
    want = [fn(x, y) for x, y in zip(a, b)]
    assert isinstance(got, TensorList) and len(got) == len(want)
    for x, y in zip(got, want):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y), (x, y)
    # the inputs are never written (only temporaries are updated in place)
    assert all(torch.equal(x, y) for x, y in zip(a + b, a0 + b0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(OPS))
def test_op_matches_per_tensor(name, dtype):
    _check_op(OPS[name], dtype, positive=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(POSITIVE_OPS))
def test_positive_op_matches_per_tensor(name, dtype):
    _check_op(POSITIVE_OPS[name], dtype, positive=True)


def test_float64_scalar_keeps_the_list_dtype():
    """A float32 list with a float64 0-d learning rate stays float32 (0-d tensors promote within their
    kind only), as chain's per-tensor ops do."""
    (a,) = _lists(torch.float32, 3, n=1)
    for out in (TensorList(a) * S64, S64 * TensorList(a), TensorList(a) / S64, S64 - TensorList(a)):
        assert out.dtype == torch.float32


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(not _derived.ELIDE, reason="this interpreter cannot tell temporaries from named lists")
def test_temporaries_updated_in_place_named_lists_kept():
    a, b = (TensorList(x) for x in _lists(torch.float32, 5, positive=True))
    with _Ops() as ops:
        out = ((a * b + 1.0) * 0.5).sqrt()
    assert ops.seen == ["aten._foreach_mul.List", "aten._foreach_add_.Scalar", "aten._foreach_mul_.Scalar",
                        "aten._foreach_sqrt_.default"]
    with _Ops() as ops:
        x = a * b
        y = x.sqrt()
        z = x + 1.0
    assert ops.seen == ["aten._foreach_mul.List", "aten._foreach_sqrt.default", "aten._foreach_add.Scalar"]
    assert all(torch.equal(u, v * w) for u, v, w in zip(x, a, b))
    assert all(torch.equal(u, (v * w).sqrt()) for u, v, w in zip(y, a, b))
    assert all(torch.equal(u, v * w + 1.0) for u, v, w in zip(z, a, b))
    assert all(torch.equal(u, ((v * w + 1.0) * 0.5).sqrt()) for u, v, w in zip(out, a, b))


def test_handed_out_tensors_are_never_updated_in_place():
    """A list whose tensors left it (iterated, indexed, or passed to a per-tensor op that may return views)
    is not a temporary any more, even when nothing refers to the list object itself."""
    a, b = (TensorList(x) for x in _lists(torch.float32, 8))
    kept = []

    def keep_iterated(lst):
        kept.extend(lst)
        return lst

    def keep_indexed(lst):
        kept.append(lst[0])
        return lst

    def keep_views(lst):
        kept.extend(lst.unsqueeze(0))
        return lst

    outs = [keep_iterated(a * b) + 1.0, keep_indexed(a * b) * 2.0, keep_views(a * b).sqrt()]
    n = len(SHAPES)
    want = [x * y for x, y in zip(a.tensors, b.tensors)]
    assert all(torch.equal(k, w) for k, w in zip(kept[:n], want))
    assert torch.equal(kept[n], want[0])
    assert all(torch.equal(k, w.unsqueeze(0)) for k, w in zip(kept[n + 1:], want))
    assert all(torch.equal(o, w + 1.0) for o, w in zip(outs[0], want))


def test_zero_d_tensor_read_on_device_not_host():
    """A 0-d tensor operand goes to the foreach Tensor overloads (or a list of itself), never through a host
    read (``aten._local_scalar_dense``)."""
    a, b = (TensorList(x) for x in _lists(torch.float32, 6, positive=True))
    with _Ops() as ops:
        _ = (a + S64, a - S64, S64 - a, a * S64, a / S64, S64 / a, (a * b) + S32, (a * b) - S32,
             (a * b) * S32, (a * b) / S32, S32 * a, S32 + a, a.clamp_min(S32), a ** S64,
             torch.maximum(S32, a))
    assert not any("_local_scalar_dense" in s or ".Scalar" in s for s in ops.seen), ops.seen


def test_bad_use_is_refused():
    a, b = (TensorList(x) for x in _lists(torch.float32, 7))
    with pytest.raises(TypeError, match="truth value"):
        bool(a)
    with pytest.raises(ValueError, match="lengths differ"):
        _ = a + TensorList(b.tensors[:2])
    with pytest.raises(AttributeError, match="shape"):
        _ = a.shape


# ---------------------------------------------------------------------------------------------------------
# a rule over lists equals chain

ADAM_HYPER = (0.9, 0.999, 1e-7, True, 0.01, False)


def _adam_aux(n, dtype):
    t = torch.tensor(3.0)
    return [(t, True)] * n


def _reads_raw_g(hyper, w, g, slots, lr, k, aux):
    """Reads ``g`` again after ``g * k`` (so ``k·g`` must not go into the gradients early)."""
    gk = g if k is None else g * k
    return w - lr * gk + 0.001 * g, [slots[0] + g]


def _aliases_raw_g(hyper, w, g, slots, lr, k, aux):
    """Holds the raw gradient's tensors through a per-tensor op (``.float()`` returns float32 tensors
    themselves) before ``g = g * k``."""
    held = g.float()
    if k is not None:
        g = g * k
    return w - lr * g - 0.001 * held, [slots[0] + held * held]


RULES = {
    "rmsprop": (_rmsprop_pointwise, (0.9, 0.0, 1e-7, False), 2, None),
    "rmsprop_centered_momentum": (_rmsprop_pointwise, (0.8, 0.9, 1e-7, True), 3, None),
    "ftrl": (_ftrl_pointwise, (-0.5, 0.0, 0.0, 0.0, 0.0), 2, None),
    "ftrl_l1_l2_shrinkage_beta": (_ftrl_pointwise, (-0.6, 0.01, 0.02, 0.1, 0.3), 2, None),
    "adam_amsgrad_l2": (_adam_pointwise, ADAM_HYPER, 3, _adam_aux),
    "adagrad": (_adagrad_pointwise, (0.01, 0.0, 1e-7), 1,
                lambda n, d: [(torch.tensor(2.0), False)] * n),
    "momentum_nesterov_wd": (_momentum_pointwise, (0.9, True, 0.01), 1, None),
    "keras_sgd_nesterov": (_keras_sgd_pointwise, (0.9, True), 1, None),
    "reads_raw_g": (_reads_raw_g, (), 1, None),
    "aliases_raw_g": (_aliases_raw_g, (), 1, None),
    "ftrl_zero_lr": (_ftrl_pointwise, (-0.5, 0.01, 0.0, 0.0, 0.0), 2, None),
    # aux shared by some tensors only: runs per shared object, the single ones through chain
    "adam_mixed_aux": (_adam_pointwise, ADAM_HYPER, 3,
                       lambda n, d: [(torch.tensor(3.0), True)] * 2 + [(torch.tensor(5.0), False)] * (n - 3)
                       + [(torch.tensor(1.0), True)]),
}


def _state(dtype, n_slots, seed, mixed=False):
    g = torch.Generator().manual_seed(seed)
    shapes = SHAPES + [(3000,)]

    def t(s, i, positive=False):
        x = torch.randn(s, generator=g, dtype=torch.float64)
        x = x.abs() + 0.05 if positive else x
        return x.to(torch.bfloat16 if mixed and i % 2 else dtype)

    ws = [t(s, i) for i, s in enumerate(shapes)]
    gs = [t(s, i) * 3 for i, s in enumerate(shapes)]
    slots = [[t(s, i, positive=True) for i, s in enumerate(shapes)] for _ in range(n_slots)]
    return ws, gs, slots


@pytest.mark.parametrize("mode", ["plain", "k", "k_skip", "no_skip", "mixed_dtypes"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(RULES))
def test_rule_over_lists_equals_chain(name, dtype, mode):
    rule, hyper, n_slots, make_aux = RULES[name]
    mixed = mode == "mixed_dtypes"
    ws, gs, slots = _state(dtype, n_slots, seed=sorted(RULES).index(name), mixed=mixed)
    aux = None if make_aux is None else make_aux(len(ws), dtype)
    # a float64 0-d lr with float32 tensors too (0-d tensors do not promote the lists)
    lr = torch.tensor(0.0 if name == "ftrl_zero_lr" else 0.05,
                      dtype=torch.float32 if dtype == torch.bfloat16 else torch.float64)
    k = torch.tensor(1 / 1024) if mode in ("k", "k_skip") else None
    found_inf = {"k_skip": torch.ones(()), "no_skip": torch.zeros(())}.get(mode)

    ref = [[t.clone() for t in lst] for lst in (ws, gs, *slots)]
    chain(rule, hyper, ref[0], ref[1], tuple(ref[2:]), None, lr, k, None, None, None, found_inf, None, aux,
          upcast=True)
    if k is not None:
        mt.scale_(ref[1], k)
    before = [[t.clone() for t in lst] for lst in (ws, gs, *slots)]
    run_rule(rule, hyper, ws, gs, slots, lr, k, found_inf, aux)
    for got, want, old in zip((ws, gs, *slots), ref, before):
        for x, y, z in zip(got, want, old):
            assert x.dtype == y.dtype and torch.equal(x, y)
            if mode == "k_skip" and got is not gs:
                assert torch.equal(x, z)
    if mode == "plain":
        assert all(torch.equal(x, z) for x, z in zip(ws, before[0])) == (name == "ftrl_zero_lr")


def _count(ops, name):
    return sum(s == name for s in ops.seen)


@pytest.mark.skipif(not _derived.ELIDE, reason="this interpreter cannot tell temporaries from named lists")
def test_true_gradient_goes_into_the_gradients_once():
    """``g = g * k`` in the rule multiplies the gradients in place (where the step leaves ``k·g``): one
    multiply of the gradients, no second pass afterwards; the values are chain's."""
    ws, gs, slots = _state(torch.float32, 2, seed=3)
    k = torch.tensor(1 / 512)
    lr = torch.tensor(0.01)
    ref = [[t.clone() for t in lst] for lst in (ws, gs, *slots)]
    chain(_rmsprop_pointwise, (0.9, 0.5, 1e-7, False), ref[0], ref[1], tuple(ref[2:]), None, lr, k, None,
          None, None, None, None, None, upcast=True)
    mt.scale_(ref[1], k)
    with _Ops() as ops:
        run_rule(_rmsprop_pointwise, (0.9, 0.5, 1e-7, False), ws, gs, slots, lr, k, None, None)
    assert _count(ops, "aten._foreach_mul_.Tensor") == 1  # (g·k, in the gradients)
    assert _count(ops, "aten._foreach_mul.Tensor") == 1  # (lr·g)
    for got, want in zip((ws, gs, *slots), ref):
        assert all(torch.equal(x, y) for x, y in zip(got, want))


def test_select_against_the_old_value_is_one_masked_write():
    """FTRL's ``torch.where(lr == 0, old, new)`` for weights and slots: written back as one masked write per
    tensor (``where(..., out=old)``), not a select and then a copy; a zero learning rate changes nothing."""
    for lr_value in (0.0, 0.05):
        ws, gs, slots = _state(torch.float32, 2, seed=4, mixed=False)
        slots = [[t.abs() for t in s] for s in slots]
        before = [[t.clone() for t in lst] for lst in (ws, *slots)]
        with _Ops() as ops:
            run_rule(_ftrl_pointwise, (-0.5, 0.01, 0.0, 0.0, 0.0), ws, gs, slots, torch.tensor(lr_value),
                     None, None, None)
        n = len(ws)
        assert _count(ops, "aten.where.self_out") == 3 * n
        assert _count(ops, "aten.where.self") == 0 and _count(ops, "aten._foreach_copy_.default") == 0
        unchanged = all(torch.equal(x, y) for lst, old in zip((ws, *slots), before) for x, y in zip(lst, old))
        assert unchanged == (lr_value == 0.0)


# ---------------------------------------------------------------------------------------------------------
# an optimizer that states only its rule


def _toy_rule(hyper, w, g, slots, lr, k, aux):
    """Momentum over an RMS normaliser: ``m ← β·m + (1−β)·g``, ``v ← ρ·v + (1−ρ)·g²``,
    ``w ← w − lr·m/(√v + ε)``."""
    beta, rho, eps = hyper
    if k is not None:
        g = g * k
    m = slots[0] * beta + g * (1.0 - beta)
    v = slots[1] * rho + g * g * (1.0 - rho)
    return w - lr * m / (v.sqrt() + eps), [m, v]


class _Toy(Optimizer):
    """The rule, its slots and its hyperparameters: nothing else."""

    slot_names = ("m", "v")

    def __init__(self, params, learning_rate=0.01, *, beta: float = 0.9, rho: float = 0.99,
                 epsilon: float = 1e-8, **kwargs) -> None:
        super().__init__(params, learning_rate, beta=beta, rho=rho, epsilon=epsilon, **kwargs)

    def _pointwise_hyper(self, group: dict) -> tuple:
        return (group["beta"], group["rho"], group["epsilon"])

    _pointwise = staticmethod(_toy_rule)


def _toy_reference(ws, grads_per_step, lr, beta, rho, eps, clipnorm=None, skipped=()):
    """float64 NumPy, written from the formula (Keras per-tensor clipnorm: g·c/max(‖g‖, c))."""
    ws = [np.array(w, dtype=np.float64) for w in ws]
    ms = [np.zeros_like(w) for w in ws]
    vs = [np.zeros_like(w) for w in ws]
    for step, grads in enumerate(grads_per_step):
        if step in skipped:
            continue
        for i, g in enumerate(grads):
            g = np.asarray(g, dtype=np.float64)
            if clipnorm is not None:
                g = g * clipnorm / max(np.sqrt((g * g).sum()), clipnorm)
            ms[i] = beta * ms[i] + (1 - beta) * g
            vs[i] = rho * vs[i] + (1 - rho) * g * g
            ws[i] = ws[i] - lr * ms[i] / (np.sqrt(vs[i]) + eps)
    return ws, ms, vs


@pytest.mark.parametrize("case", ["float32", "float64", "clipnorm", "loss_scale_skip", "bfloat16"])
def test_optimizer_with_only_a_rule(case):
    dtype = {"float64": torch.float64, "bfloat16": torch.bfloat16}.get(case, torch.float32)
    g = torch.Generator().manual_seed(42)
    shapes = [(40, 30), (300,), (8, 3, 3), (2_000_000,)]  # the last one spans several cache blocks
    params = [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64).to(dtype)) for s in shapes]
    w0 = [p.detach().double().numpy().copy() for p in params]
    grads = [[torch.randn(s, generator=g, dtype=torch.float64) * 0.1 for s in shapes] for _ in range(4)]
    kw = {"clipnorm": 0.5} if case == "clipnorm" else {}
    opt = _Toy(params, 0.01, beta=0.8, rho=0.95, epsilon=1e-6, **kw)
    scale, skipped = (512.0, {2}) if case == "loss_scale_skip" else (None, set())
    for step, gs in enumerate(grads):
        for p, gr in zip(params, gs):
            p.grad = (gr * (scale or 1.0)).to(dtype)
        sent = [p.grad.clone() for p in params]
        if scale is not None:
            opt.grad_scale = torch.tensor(scale)
        if step in skipped:
            opt.found_inf = torch.ones(())
            before = [p.detach().clone() for p in params] + [v.clone() for st in opt.state.values()
                                                            for v in st.values() if torch.is_tensor(v)]
        opt.step()
        opt.__dict__.pop("grad_scale", None)
        opt.__dict__.pop("found_inf", None)
        if step in skipped:
            after = [p.detach() for p in params] + [v for st in opt.state.values()
                                                   for v in st.values() if torch.is_tensor(v)]
            assert all(torch.equal(a, b) for a, b in zip(after, before))
        # .grad as torch.optim leaves it: g, or g/S under a loss scale
        want = sent if scale is None else [(s.double() / scale).to(dtype) for s in sent]
        assert all(torch.equal(p.grad, w) for p, w in zip(params, want))
    ref_grads = [[gr.to(dtype).double().numpy() for gr in gs] for gs in grads]
    ws, ms, vs = _toy_reference(w0, ref_grads, 0.01, 0.8, 0.95, 1e-6, kw.get("clipnorm"), skipped)
    tol = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    for p, w, m, v in zip(params, ws, ms, vs):
        np.testing.assert_allclose(p.detach().double().numpy(), w, rtol=tol, atol=tol)
        np.testing.assert_allclose(opt.state[p]["m"].double().numpy(), m, rtol=tol, atol=tol * 0.1)
        np.testing.assert_allclose(opt.state[p]["v"].double().numpy(), v, rtol=tol, atol=tol * 0.01)
    assert opt.state[params[0]]["m"].dtype == dtype


def test_optimizer_without_a_rule_is_refused():
    class NoRule(Optimizer):
        slot_names = ()

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = NoRule([p], 0.1)
    with pytest.raises(TypeError, match="_pointwise"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(3))
