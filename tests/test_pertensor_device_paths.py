"""The per-tensor factors of the CUDA path over separate tensors (:class:`optkit._multi_tensor.
ElementFactors`:
the factors expanded into an element vector whose views have the tensors' shapes and strides, one multi-tensor
op) run on CPU tensors by patching its routing predicate (``ElementFactors.applies``), for ``LARS`` (with
``optkit.lars._cpu_forms`` routed to its device forms), ``LARC(SGD)`` (the inner optimizer's multipliers)
and ``clipnorm``: bit for bit the results of the per-tensor multiply by each tensor's 0-d factor that the
same path takes without it (and, on the CPU, the CPU path's results for LARC and clipnorm), and for LARS
the float64 reference. Channels-last, float64 and bfloat16 parameters (bfloat16 keeps the per-tensor
multiply: its factor stays float32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import optkit
import optkit.lars
from optkit import _multi_tensor as mt
from scaled_grads import step_checking_grads
from test_lars_device_paths import _reference

SHAPES = [(4, 3, 3, 2), (5,), (2, 3, 4), (1,), (7, 2), (30,), (3, 2, 2, 3)]
CHANNELS_LAST = (0, 6)  # 4-D parameters stored channels-last (views of the vector with their strides)


def _problem(seed, steps=3):
    rng = np.random.default_rng(seed)
    ws = [rng.standard_normal(s) for s in SHAPES]
    ws[3] = np.zeros(SHAPES[3])  # a zero-norm parameter (trust 1)
    grads = [[rng.standard_normal(s) * 0.1 for s in SHAPES] for _ in range(steps)]
    grads[1][0] = np.zeros(SHAPES[0])  # a zero gradient
    return ws, grads


def _tensor(x, dtype, i):
    t = torch.tensor(x, dtype=dtype)
    return t.contiguous(memory_format=torch.channels_last) if i in CHANNELS_LAST else t


def _route(monkeypatch, on: bool) -> list:
    """Route ElementFactors onto CPU tensors (``on``) or off entirely; returns the list of its uses."""
    used: list = []
    orig = mt.ElementFactors.expand
    monkeypatch.setattr(mt.ElementFactors, "applies",
                        staticmethod(lambda device, dtype: on and dtype in (torch.float32, torch.float64)))
    monkeypatch.setattr(mt.ElementFactors, "expand", lambda self, f: used.append(1) or orig(self, f))
    return used


def _run(make_opt, ws, grads, dtype, scale=None, scratch=False):
    ps = [torch.nn.Parameter(_tensor(w, dtype, i)) for i, w in enumerate(ws)]
    opt = make_opt(list(zip([f"l{i}.weight" if len(s) > 1 else f"l{i}.bias" for i, s in enumerate(SHAPES)],
                            ps)))
    for step in grads:
        for i, (p, g) in enumerate(zip(ps, step)):
            gt = _tensor(g if scale is None else g * scale, dtype, i)
            if p.grad is None:
                p.grad = gt
            else:
                p.grad.copy_(gt)
        # (bfloat16 under a loss scale: LARS's device forms leave g/S rounded from float32 in .grad)
        step_checking_grads(opt, ps, scale, scratch or (dtype == torch.bfloat16 and scale is not None))
    slots = [t.clone() for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim()]
    return [p.detach().clone() for p in ps], slots


def _same(a, b):
    assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1]))


DTYPES = [torch.float32, torch.float64, torch.bfloat16]


@pytest.mark.parametrize("variant", ["tf1.15", "tf1.14"])
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [None, 64.0])
def test_lars_element_factors_match_the_per_tensor_multiply(monkeypatch, variant, nesterov, dtype, scale):
    monkeypatch.setattr(optkit.lars, "_cpu_forms", lambda device: False)
    ws, grads = _problem(hash((variant, nesterov, str(dtype), scale)) % 2**32)
    hp = {"momentum": 0.9, "weight_decay": 0.01, "eeta": 0.02, "epsilon": 1e-5, "variant": variant}

    def make(named):
        return optkit.LARS(named, 0.5, use_nesterov=nesterov, skip_list=["l5."], **hp)

    out = []
    for on in (False, True):
        used = _route(monkeypatch, on)
        out.append(_run(make, ws, grads, dtype, scale))
        assert bool(used) == on or dtype == torch.bfloat16  # (bfloat16 LARS may step float32 staged copies)
    _same(*out)
    ref = _reference(ws, grads, SHAPES, [i == 5 for i in range(len(SHAPES))], use_nesterov=nesterov, **hp)
    tol = {torch.float32: 2e-5, torch.float64: 1e-12, torch.bfloat16: 3e-2}[dtype]
    for p, w in zip(out[1][0], ref.ws):
        np.testing.assert_allclose(p.double().numpy(), w, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [None, 128.0])
@pytest.mark.parametrize("scratch", [False, True])
@pytest.mark.parametrize("mode", ["clip", "scale"])
def test_larc_element_factors_match_the_cpu_path(monkeypatch, dtype, scale, scratch, mode):
    """The CPU path (small tensors: the inner SGD's blocked per-tensor multiply) and the routed one."""
    ws, grads = _problem(hash((str(dtype), scale, scratch, mode)) % 2**32)

    def make(named):
        inner = optkit.SGD(named, learning_rate=0.3, momentum=0.9, scratch_grads=scratch)
        return optkit.LARC(inner, larc_eta=0.02, larc_mode=mode, exclude=lambda n, p: n.startswith("l5."))

    out = []
    for on in (False, True):
        used = _route(monkeypatch, on)
        out.append(_run(make, ws, grads, dtype, scale, scratch))
        assert bool(used) == (on and dtype != torch.bfloat16)
    _same(*out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [None, 32.0])
@pytest.mark.parametrize("scratch", [False, True])
def test_clipnorm_element_factors_match_the_cpu_path(monkeypatch, dtype, scale, scratch):
    """``clipnorm`` (small enough that most gradients are clipped) on copies of the gradients (default) or
    in them (``scratch_grads``), with and without a loss scale."""
    ws, grads = _problem(hash((str(dtype), scale, scratch)) % 2**32)

    def make(named):
        return optkit.SGD(named, learning_rate=0.3, momentum=0.9, clipnorm=0.3, scratch_grads=scratch)

    out = []
    for on in (False, True):
        used = _route(monkeypatch, on)
        out.append(_run(make, ws, grads, dtype, scale, scratch))
        assert bool(used) == (on and dtype != torch.bfloat16)
    _same(*out)


def test_views_keep_the_tensors_strides(monkeypatch):
    """The views of the element vector have each tensor's strides (channels-last stays channels-last), so
    torch's multi-tensor fast route (equal sizes and strides at each position) holds."""
    ts = [torch.zeros(2, 3, 4, 5).contiguous(memory_format=torch.channels_last), torch.zeros(7),
          torch.zeros(3, 4).t()]
    cache: dict = {}
    monkeypatch.setattr(mt.ElementFactors, "applies", staticmethod(lambda device, dtype: True))
    ef = mt.ElementFactors.cached(cache, 0, ts)
    assert ef is not None and mt.ElementFactors.cached(cache, 0, ts) is ef
    views = ef.expand(torch.tensor([2.0, 3.0, 5.0]))
    assert [v.stride() for v in views] == [t.stride() for t in ts]
    assert [float(v.unique()) for v in views] == [2.0, 3.0, 5.0]
