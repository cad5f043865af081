"""Reference tests ported from timm's optimizer suite, LARS/LARC cases.

Upstream file (repository ``huggingface/pytorch-image-models``): ``tests/test_optim.py``, ``test_lars`` over
``['lars', 'larc', 'nlars', 'nlarc']`` with its helpers ``_test_basic_cases`` (state-dict continuation,
200 closure steps on contiguous and non-contiguous parameters, param-group variants),
``_test_rosenbrock`` (2000 steps of cyclic coordinate descent) and ``_test_model`` (20 strictly decreasing
losses on a fixed two-layer model).

optkit's counterparts: :class:`optkit.LARS` (TF 1.15 and TF 1.14 rules, Nesterov) for ``lars``/``nlars``
and the :class:`optkit.LARC` wrapper around :class:`optkit.Momentum` for ``larc``/``nlarc``. timm's ``Lars``
adapts only when ``weight_decay != 0`` and puts ``wd·‖w‖`` in the denominator; that exact rule is
``LARC(..., wd_in_denominator=wd)`` (compatibility.md, row "wrappers: LARC options and checks"), which is
compared step by step with a float64 NumPy transcription of timm's ``Lars.step``.

The tests run with one intra-op thread (restored afterwards): the results do not depend on it, and the
fused CPU kernels are much slower when two threads compete for the two shared cores.
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
from torch.nn import Parameter

import optkit

F64 = torch.float64


def _lars(variant="tf1.15", nesterov=False):
    def make(params, lr, exclude_1d=False):
        return optkit.LARS(params, learning_rate=lr, use_nesterov=nesterov, variant=variant,
                           exclude_1d=exclude_1d)
    return make


def _larc(mode="clip", nesterov=False, wd=None):
    def make(params, lr, exclude_1d=False):
        inner = optkit.Momentum(params, learning_rate=lr, momentum=0.9, use_nesterov=nesterov)
        exclude = (lambda name, p: p.ndim <= 1) if exclude_1d else None
        return optkit.LARC(inner, larc_eta=0.001, larc_mode=mode, wd_in_denominator=wd, exclude=exclude)
    return make


TIMM_NAMES = ["lars", "larc", "nlars", "nlarc"]  # timm's test_lars parameters
FACTORIES = {
    "lars": _lars(),
    "lars_tf1.14": _lars("tf1.14"),
    "nlars": _lars(nesterov=True),
    "larc": _larc(),
    "nlarc": _larc(nesterov=True),
    "larc_scale_wd": _larc("scale", wd=1e-4),
}


def _params_dict(weight, bias, **kw):
    return [{"params": [weight]}, dict(params=[bias], **kw)]


def _params_dict_single(weight, bias, **kw):
    return [dict(params=bias, **kw)]


def _variants(make):
    """The constructor shapes of timm's test_lars: flat list, two groups (bias with its own lr), a single
    group holding only the bias (with and without an explicit lr)."""
    return [
        lambda w, b: make([w, b], 1e-3),
        lambda w, b: make(_params_dict(w, b, lr=1e-3), 1e-3),
        lambda w, b: make(_params_dict_single(w, b, lr=1e-3), 1e-3),
        lambda w, b: make(_params_dict_single(w, b), 1e-3),
    ]


def _loss(weight, bias, inp):
    return (weight.mv(inp) + bias).pow(2).sum()


def _assert_same(a, b):
    """Exact structural equality of two state dicts (tensors compared by value)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def _state_dict_continuation(constructor):
    """timm _test_state_dict: prime 20 closure steps, clone the weights, load a deep copy of the state dict
    into a fresh optimizer over the clones, then 20 parallel steps must agree exactly."""
    torch.manual_seed(0)
    weight, bias, inp = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10)), torch.randn(5)

    def fn_base(opt, w, b):
        opt.zero_grad()
        loss = _loss(w, b, inp)
        loss.backward()
        return loss

    opt = constructor(weight, bias)
    fn = functools.partial(fn_base, opt, weight, bias)
    for _ in range(20):
        opt.step(fn)
    with torch.no_grad():
        weight_c, bias_c = Parameter(weight.clone()), Parameter(bias.clone())
    opt_c = constructor(weight_c, bias_c)
    fn_c = functools.partial(fn_base, opt_c, weight_c, bias_c)
    state = copy.deepcopy(opt.state_dict())
    opt_c.load_state_dict(copy.deepcopy(opt.state_dict()))
    for _ in range(20):
        opt.step(fn)
        opt_c.step(fn_c)
        torch.testing.assert_close(weight, weight_c, rtol=0, atol=0)
        torch.testing.assert_close(bias, bias_c, rtol=0, atol=0)
    _assert_same(opt.state_dict(), opt_c.state_dict())
    return state


def _descends(constructor, weight, bias, inp, steps=200):
    """timm _test_basic_cases_template: the optimizer can be printed and 200 closure steps lower the loss."""
    weight, bias = Parameter(weight), Parameter(bias)
    opt = constructor(weight, bias)
    assert repr(opt)

    def fn():
        opt.zero_grad()
        loss = _loss(weight, bias, inp)
        loss.backward()
        return loss

    initial = fn().item()
    for _ in range(steps):
        opt.step(fn)
    assert fn().item() < initial


VARIANT_IDS = ["flat", "two_groups", "single_group_lr", "single_group"]


@pytest.mark.parametrize("variant", range(4), ids=VARIANT_IDS)
@pytest.mark.parametrize("name", TIMM_NAMES)
def test_lars_basic_cases(name, variant):
    """test_optim.py: test_lars → _test_basic_cases (state-dict continuation, then descent over 200 closure
    steps), for each constructor shape."""
    constructor = _variants(FACTORIES[name])[variant]
    _state_dict_continuation(constructor)
    torch.manual_seed(1)
    _descends(constructor, torch.randn(10, 5), torch.randn(10), torch.randn(5))


def _non_contiguous_cases():
    for name in TIMM_NAMES:
        for variant, vid in enumerate(VARIANT_IDS):
            yield pytest.param(name, variant, id=f"{name}-{vid}")


@pytest.mark.parametrize("name,variant", list(_non_contiguous_cases()))
def test_lars_basic_cases_non_contiguous(name, variant):
    """test_optim.py: _test_basic_cases, the non-contiguous run (``torch.randn(10, 5, 2)[..., 0]`` weight and
    ``torch.randn(10, 2)[..., 0]`` bias): 200 closure steps must lower the loss."""
    constructor = _variants(FACTORIES[name])[variant]
    torch.manual_seed(2)
    _descends(constructor, torch.randn(10, 5, 2)[..., 0], torch.randn(10, 2)[..., 0], torch.randn(5))


@pytest.mark.parametrize("name", ["lars", "larc"])
def test_lars_deepcopy_copies_public_attributes(name):
    """test_optim.py _test_state_dict, last check: deepcopy keeps every public attribute."""
    w, b = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10))
    opt = FACTORIES[name]([w, b], 1e-3)

    def public(obj):
        return {k for k in obj.__dict__ if not k.startswith("_")}

    assert public(opt) == public(copy.deepcopy(opt))


def _rosenbrock_and_grad(x, y):
    value = (1 - x) ** 2 + 100 * (y - x**2) ** 2
    return value, (-400 * x * (y - x**2) - 2 * (1 - x), 200 * (y - x**2))


@pytest.mark.parametrize("name", TIMM_NAMES)
def test_lars_rosenbrock(name):
    """test_optim.py: _test_rosenbrock (lr 1e-3, momentum 0.9, 2000 steps of cyclic coordinate descent from
    [1.5, 1.5], each gradient built from an uncoalesced sparse tensor and densified; the distance to [1, 1]
    must not grow). timm builds its Lars with weight_decay 0, which switches the layer adaptation off; the
    optkit equivalent for this 1-D parameter is the bias/norm exclusion (``exclude_1d`` for LARS, an
    ``exclude`` predicate for LARC), so the run is plain (Nesterov) heavy-ball momentum. The closure sets the
    analytic gradient directly (timm's also back-propagates the loss, then overwrites the gradient)."""
    params = Parameter(torch.tensor([1.5, 1.5]))
    opt = FACTORIES[name]([params], 1e-3, exclude_1d=True)
    solution = torch.tensor([1.0, 1.0])
    initial_dist = params.detach().clone().dist(solution)
    first, second = torch.tensor([[0, 0]]), torch.tensor([[1, 1]])

    def closure(w):
        x, y = params.detach().tolist()
        value, (gx, gy) = _rosenbrock_and_grad(x, y)
        if w:
            i, v = first, torch.tensor([gx / 4.0, gx - gx / 4.0])
        else:
            i, v = second, torch.tensor([gy - gy / 4.0, gy / 4.0])
        params.grad = torch.sparse_coo_tensor(i, v, (2,)).to_dense()
        return value

    for k in range(2000):
        opt.step(functools.partial(closure, k % 2))
    assert params.detach().dist(solution) <= initial_dist


@pytest.mark.parametrize("name", list(FACTORIES))
def test_lars_model(name):
    """test_optim.py: _test_model (Linear(2, 3) → Sigmoid → Linear(3, 1) → Sigmoid with timm's fixed weights,
    input 0.1 … 0.6, loss = sum of outputs, lr 1e-3: 20 strictly decreasing losses). Run in float64 so that
    LARS's small trust-scaled steps are not lost to float32 rounding of the loss."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1),
                                torch.nn.Sigmoid()).double()
    weights = {
        "0.weight": [[-0.2109, -0.4976], [-0.1413, -0.3420], [-0.2524, 0.6976]],
        "0.bias": [-0.1085, -0.2979, 0.6892],
        "2.weight": [[-0.0508, -0.3941, -0.2843]],
        "2.bias": [-0.0711],
    }
    model.load_state_dict({k: torch.tensor(v, dtype=F64) for k, v in weights.items()})
    inp = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], dtype=F64).reshape(3, 2)
    opt = FACTORIES[name](list(model.parameters()), 1e-3)
    prev = float("inf")
    for _ in range(20):
        opt.zero_grad()
        loss = model(inp).sum()
        loss.backward()
        assert loss.item() < prev
        prev = loss.item()
        opt.step()


# ------------------------------------------------------------------------------------------------------------
# timm's Lars rule, step by step


def timm_lars_numpy(ws, grads_seq, *, lr, momentum, wd, tc, eps, trust_clip, nesterov):
    """A float64 transcription of timm.optim.Lars.step (dampening 0, weight_decay != 0)."""
    ws = [w.copy() for w in ws]
    bufs = [None] * len(ws)
    for grads in grads_seq:
        for j, (w, g) in enumerate(zip(ws, grads)):
            w_norm, g_norm = np.linalg.norm(w), np.linalg.norm(g)
            ratio = tc * w_norm / (g_norm + w_norm * wd + eps) if (w_norm > 0 and g_norm > 0) else 1.0
            if trust_clip:
                ratio = min(ratio / lr, 1.0)
            d = (g + wd * w) * ratio
            bufs[j] = d.copy() if bufs[j] is None else momentum * bufs[j] + d
            step = d + momentum * bufs[j] if nesterov else bufs[j]
            ws[j] = w - lr * step
    return ws


@pytest.mark.parametrize("nesterov", [False, True], ids=["lars", "nlars"])
@pytest.mark.parametrize("trust_clip", [False, True], ids=["no_clip", "larc"])
def test_larc_wd_in_denominator_matches_timm_lars(trust_clip, nesterov, rng):
    """timm's Lars (trust coefficient 0.02, weight decay 1e-2, eps 1e-8, momentum 0.9) equals optkit's
    LARC(Momentum, wd_in_denominator=wd) in scale mode (no clip) or clip mode (LARC), with
    ``min_update=0``: seeded float64 weights and gradients (one zero gradient to hit the ratio-1 branch)."""
    shapes = [(4, 3), (6,), (2, 2, 2)]
    ws = [rng.standard_normal(s) for s in shapes]
    grads_seq = [[rng.standard_normal(s) for s in shapes] for _ in range(5)]
    grads_seq[2][1] = np.zeros(shapes[1])
    lr, wd, tc = 0.5, 1e-2, 0.02
    ts = [torch.tensor(w, requires_grad=True) for w in ws]
    opt = optkit.LARC(optkit.Momentum(ts, learning_rate=lr, momentum=0.9, use_nesterov=nesterov),
                      larc_eta=tc, larc_mode="clip" if trust_clip else "scale", min_update=0.0, epsilon=1e-8,
                      wd_in_denominator=wd)
    for grads in grads_seq:
        for t, g in zip(ts, grads):
            t.grad = torch.tensor(g)
        opt.step()
    ref = timm_lars_numpy(ws, grads_seq, lr=lr, momentum=0.9, wd=wd, tc=tc, eps=1e-8, trust_clip=trust_clip,
                          nesterov=nesterov)
    for t, r in zip(ts, ref):
        np.testing.assert_allclose(t.detach().numpy(), r, rtol=1e-12, atol=1e-12)
