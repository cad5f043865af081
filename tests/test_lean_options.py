"""Lean-memory modes (:mod:`optkit._core.lean`) with the options around them: parameters of other dtypes under
a ``precision``, sparse gradients (TF's touched-rows rules), ``torch.compile(opt.step)``, ``jit_compile``,
param groups added later, groups with momentum 0, parameters without gradients.

References: the same optimizer over float32 parameters fed the same (bfloat16-valued) gradients, whose
trajectory the split master reproduces bit for bit (the lean module's promise); the run without the option.
"""

from __future__ import annotations

import pytest
import torch

import optkit
from optkit._core import lowp

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")

PRECISIONS = ["split", "kahan", "stochastic"]
STATES = [None, "bfloat16", "int8"]


def _t(shape, seed, dtype=torch.bfloat16, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def master(opt, p):
    """The split master of ``p`` (fp32: the bfloat16 weight's bits and its low halves)."""
    return lowp.split_decode(p.detach(), opt.state[p]["master_low"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_other_dtypes_under_a_precision_step_as_without_it(dtype):
    """``precision`` is for bfloat16 parameters: float32 and float64 ones beside them keep their slots in
    their own dtype (not float32 for float64) and step bit for bit as without the option."""
    runs = []
    for precision in (None, "split"):
        ps = [_t((6, 5), 0, dtype).requires_grad_(), _t((64,), 1).requires_grad_()]
        opt = optkit.Adam(ps, 0.01, precision=precision)
        for k in range(3):
            for j, p in enumerate(ps):
                p.grad = _t(p.shape, 10 * k + j, p.dtype, 1.0)
            opt.step()
        assert opt.state[ps[0]]["exp_avg"].dtype == dtype
        runs.append([ps[0].detach().clone(), opt.state[ps[0]]["exp_avg"].clone()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def _sparse(rows, step, n=512, d=8):
    vals = _t((len(rows), d), 100 + step, torch.float32, 1.0).to(torch.bfloat16)
    return torch.sparse_coo_tensor(torch.tensor([rows]), vals, (n, d))


ROW_STEPS = [[1, 4, 4, 7], [4, 9], [2, 300]]  # (row 4 twice: summed; row 1 touched once, then left alone)


@pytest.mark.parametrize("cls,kw,slot", [(optkit.Momentum, {"momentum": 0.9}, "momentum_buffer"),
                                         (optkit.Adagrad, {}, "sum")])
def test_sparse_gradients_take_the_rows_rule_bit_for_bit_under_split(cls, kw, slot):
    """The split master over sparse gradients equals the float32 run of the same rule (TF's touched-rows
    rule: momentum and accumulators of untouched rows are left alone), bit for bit."""
    w0 = _t((512, 8), 0)
    a = w0.float().requires_grad_()
    b = w0.clone().requires_grad_()
    oa, ob = cls([a], 0.1, **kw), cls([b], 0.1, precision="split", **kw)
    for k, rows in enumerate(ROW_STEPS):
        b.grad = _sparse(rows, k)
        a.grad = b.grad.coalesce().float()  # (the same gradient: its duplicate rows summed in bfloat16)
        oa.step()
        ob.step()
        assert torch.equal(master(ob, b), a.detach()), k
        assert torch.equal(ob.state[b][slot], oa.state[a][slot])


@pytest.mark.parametrize("state_dtype", STATES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_sparse_gradients_leave_untouched_rows_under_every_lean_form(precision, state_dtype):
    """Momentum (TF's ``SparseApplyMomentum``) on a 512 x 8 bfloat16 embedding (8-bit slots under int8):
    rows no gradient touches keep their weights and their momentum bit for bit (row 1 after step 0: its
    momentum is not decayed as a densified gradient would)."""
    w = _t((512, 8), 0).requires_grad_()
    opt = optkit.Momentum([w], 0.1, momentum=0.9, precision=precision, state_dtype=state_dtype)
    for k, rows in enumerate(ROW_STEPS):
        before_w = w.detach().clone()
        before_m = opt.lean_slot_values(w, "momentum_buffer") if opt.state[w] else None
        w.grad = _sparse(rows, k)
        opt.step()
        untouched = [r for r in range(512) if r not in rows]
        assert torch.equal(w.detach()[untouched], before_w[untouched]), k
        if before_m is not None:
            after_m = opt.lean_slot_values(w, "momentum_buffer")
            assert torch.equal(after_m[untouched], before_m[untouched]), k
        assert not torch.equal(w.detach()[rows], before_w[rows])


@pytest.mark.parametrize("kind", ["adam"])  # (one: each compile costs seconds here)
def test_torch_compile_of_step_runs_the_lean_pass(kind):
    """``torch.compile(opt.step)`` over a lean group traces the rule's pointwise form (torch's fused kernels
    have no fake implementation) and matches the eager step (float32 tolerance on the split master; the
    ``aot_eager`` backend, no C++ build)."""
    make = {"sgd": lambda ps: optkit.SGD(ps, learning_rate=0.1, momentum=0.9, precision="split"),
            "adam": lambda ps: optkit.Adam(ps, 0.01, precision="split", state_dtype="bfloat16"),
            "lamb": lambda ps: optkit.LAMB(ps, 0.01, weight_decay=0.01, precision="split")}[kind]
    w0 = _t((64, 80), 0)
    a, b = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    oa, ob = make([a]), make([b])
    torch._dynamo.reset()
    step = torch.compile(ob.step, backend="aot_eager")
    for k in range(3):
        a.grad = _t(a.shape, 10 + k, scale=1.0)
        b.grad = a.grad.clone()
        oa.step()
        step()
    torch.testing.assert_close(master(ob, b), master(oa, a), rtol=1e-5, atol=1e-6)
    assert int(ob.iterations) == 3


def test_jit_compile_with_a_lean_group_steps_as_eager():
    """``jit_compile=True``: a lean group runs the lean pass (its decode and encode around the rule), bit for
    bit the run without ``jit_compile``."""
    runs = []
    for jit in (False, True):
        w = _t((64, 80), 0).requires_grad_()
        opt = optkit.Adam([w], 0.01, precision="kahan", state_dtype="int8", jit_compile=jit)
        for k in range(3):
            w.grad = _t(w.shape, 10 + k, scale=1.0)
            opt.step()
        runs.append([w.detach().clone(), opt.state[w]["kahan_comp"].clone(), opt.state[w]["exp_avg"].clone()])
    assert all(torch.equal(x, y) for x, y in zip(*runs))


def test_group_added_later_with_momentum_zero_and_params_without_grads():
    """A group added with ``add_param_group`` (momentum 0: no slot; a 4,160-element bfloat16 tensor: its
    Kahan sum is made at its first step) and a parameter that gets no gradient (untouched, no state) step as
    an optimizer built with both groups from the start."""
    def run(later: bool):
        w, v, idle = _t((64, 80), 0).requires_grad_(), _t((4160,), 1).requires_grad_(), \
            _t((5,), 2).requires_grad_()
        groups = [{"params": [w, idle]}, {"params": [v], "momentum": 0.0}]
        opt = optkit.SGD(groups[:1] if later else groups, learning_rate=0.1, momentum=0.9, precision="kahan",
                         state_dtype="int8")
        for k in range(3):
            w.grad = _t(w.shape, 10 + k, scale=1.0)
            if k == 1 and later:
                opt.add_param_group(groups[1])
            if k >= 1:
                v.grad = _t(v.shape, 20 + k, scale=1.0)
            opt.step()
        assert torch.equal(idle, _t((5,), 2))
        assert set(opt.state[v]) == {"step", "kahan_comp"}
        assert opt.state[w]["momentum"].dtype == torch.uint8
        return [w.detach().clone(), v.detach().clone(), opt.state[v]["kahan_comp"].clone()]

    assert all(torch.equal(x, y) for x, y in zip(run(False), run(True)))


def test_sparse_gradient_of_a_1d_tensor_keeps_untouched_8bit_blocks():
    """A 1-d tensor's 8-bit blocks are 256 consecutive elements: a sparse gradient touching elements of one
    block re-encodes that block alone; the other blocks keep their codes and scales bit for bit."""
    v = _t((4160,), 0).requires_grad_()
    opt = optkit.Momentum([v], 0.1, momentum=0.9, precision="split", state_dtype="int8")
    v.grad = _t((4160,), 1, scale=1.0)  # (dense: every block's momentum nonzero)
    opt.step()
    codes, scales = opt.state[v]["momentum_buffer"].clone(), opt.state[v]["momentum_buffer_absmax"].clone()
    idx = torch.tensor([[300, 310, 4100]])  # blocks 1 and 16 (the partial one)
    v.grad = torch.sparse_coo_tensor(idx, torch.ones(3), (4160,)).to(torch.bfloat16)
    opt.step()
    kept = [b for b in range(scales.numel()) if b not in (1, 16)]
    assert torch.equal(opt.state[v]["momentum_buffer_absmax"][kept], scales[kept])
    new = opt.state[v]["momentum_buffer"]
    for b in kept:
        assert torch.equal(new[256 * b:256 * (b + 1)], codes[256 * b:256 * (b + 1)]), b
    assert not torch.equal(new[256:512], codes[256:512])


@pytest.mark.parametrize("state_dtype", [None, "int8"])
def test_update_step_runs_the_lean_pass(state_dtype):
    """Keras ``update_step(gradient, variable)`` on a parameter of a lean group decodes, applies the rule and
    encodes (it ran the rule on the stored forms: 8-bit codes crashed it, a split master's low halves were
    left behind): under split with float32 slots the master is bit for bit the float32 parameter's."""
    w0 = _t((64, 80), 0)
    a, b = w0.float().requires_grad_(), w0.clone().requires_grad_()
    oa = optkit.Adam([a], 0.01)
    ob = optkit.Adam([b], 0.01, precision="split", state_dtype=state_dtype)
    for k in range(3):
        g = _t(a.shape, 10 + k, scale=1.0)
        if k == 0:  # (the state is made by a first step)
            oa.apply_gradients([(g.float(), a)])
            ob.apply_gradients([(g, b)])
        else:
            oa.update_step(g.float(), a, 0.01)
            ob.update_step(g, b, 0.01)
    if state_dtype is None:
        assert torch.equal(master(ob, b), a.detach())
    else:
        torch.testing.assert_close(master(ob, b), a.detach(), rtol=0, atol=2e-3)


def test_get_and_set_weights_give_and_take_8bit_slots_as_values():
    """Keras ``get_weights`` gives an 8-bit slot's values (float32; it gave the uint8 codes, which
    ``set_weights`` then refused); ``set_weights`` quantises values into the slot: each within the map's
    resolution of the value given (0.7% of its block's largest magnitude near 1, the coarsest gap)."""
    ps = [_t((64, 80), 0).requires_grad_(), _t((7,), 1).requires_grad_()]
    opt = optkit.Adam(ps, 0.01, precision="split", state_dtype="int8")
    for k in range(2):
        for j, p in enumerate(ps):
            p.grad = _t(p.shape, 10 * k + j, scale=1.0)
        opt.step()
    weights = opt.get_weights()
    assert [w.dtype for w in weights] == [torch.int64] + [torch.float32] * 4
    assert torch.equal(weights[1], opt.lean_slot_values(ps[0], "exp_avg"))
    qs = [_t((64, 80), 0).requires_grad_(), _t((7,), 1).requires_grad_()]
    other = optkit.Adam(qs, 0.01, precision="split", state_dtype="int8")
    other.apply_gradients([(torch.ones_like(q), q) for q in qs])
    other.set_weights(weights)
    for j, slot in ((1, "exp_avg"), (3, "exp_avg_sq")):
        got = other.lean_slot_values(qs[0], slot)
        torch.testing.assert_close(got, weights[j], rtol=0, atol=0.011 * float(weights[j].abs().max()))
    assert torch.equal(other.state[qs[1]]["exp_avg"], weights[2])
    assert int(other.iterations) == 2


@pytest.mark.parametrize("skip", [False, True])
def test_flat_int8_form_is_the_per_tensor_one(monkeypatch, skip):
    """Off the CPU a bunch's 8-bit slots are decoded and quantised all at once (lowp.dequantize_flat_ /
    quantize_flat_: a fixed number of launches); routed through it on the CPU, every weight, code and scale
    is bit for bit what the CPU's tensor-by-tensor form gives, also over a skipped step."""
    from optkit._core import lean

    def run(flat):
        monkeypatch.setattr(lean, "FLAT_INT8_ON_CPU", flat)
        g = torch.Generator().manual_seed(3)
        shapes = [(64, 600), (5000,), (32, 8, 3, 3), (10,)]
        ps = [torch.nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16)) for s in shapes]
        inner = optkit.Adam(ps, 0.01, precision="kahan", state_dtype="int8")
        opt = optkit.LossScaleOptimizer(inner, optkit.DynamicLossScale(256.0)) if skip else inner
        for k in range(3):
            for p in ps:
                p.grad = (torch.randn(p.shape, generator=g) * (256.0 if skip else 1.0)).to(torch.bfloat16)
            if skip and k == 1:
                ps[0].grad.view(-1)[7] = float("inf")
            if skip:
                opt.grads_scaled = True  # (the gradients above carry the loss scale 256)
            opt.step()
        return [p.detach().clone() for p in ps], [{k: v.clone() for k, v in inner.state[p].items()
                                                   if torch.is_tensor(v)} for p in ps]

    (w0, s0), (w1, s1) = run(False), run(True)
    assert any(st["exp_avg"].dtype == torch.uint8 for st in s0)
    for a, b in zip(w0, w1):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    for a, b in zip(s0, s1):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k
