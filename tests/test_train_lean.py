"""optimize_loss(precision=..., state_dtype=...): master-free bfloat16 weights and low-precision slots
through the train op."""

from __future__ import annotations

import copy

import pytest
import torch

import optkit
from lean_reference import same_bits
from optkit import Adam, optimize_loss
from optkit._core import lowp


def _model(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(dtype)


def _data(n=6, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 64, generator=g).to(dtype), torch.randn(8, 1, generator=g).to(dtype))
            for _ in range(n)]


def _loss(m):
    return lambda x, t: ((m(x) - t) ** 2).float().mean()


@pytest.mark.parametrize("precision", ["split", "kahan", "stochastic"])
def test_train_op_steps_as_the_optimizer_built_with_the_precision(precision):
    m1, m2 = _model(), _model()
    op = optimize_loss(_loss(m1), "Adam", {"epsilon": 1e-7}, 0.01, model=m1, dtype=torch.bfloat16,
                       precision=precision, state_dtype="int8")
    opt = Adam(m2.parameters(), learning_rate=0.01, epsilon=1e-7, precision=precision, state_dtype="int8")
    assert op.base_optimizer.precision == precision and op.base_optimizer.state_dtype == "int8"
    for x, t in _data():
        op(x, t)
        _loss(m2)(x, t).backward()
        opt.step()
        opt.zero_grad()
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert p.dtype == torch.bfloat16
        assert torch.equal(p.detach(), q.detach())
    w1, w2 = next(m1.parameters()), next(m2.parameters())
    for k, v in opt.state[w2].items():
        if isinstance(v, torch.Tensor):
            assert same_bits(op.optimizer.state[w1][k], v), k
    assert op.optimizer.state[w1]["exp_avg"].dtype == torch.uint8  # (4096 elements: 8-bit)


def test_split_through_the_train_op_follows_the_fp32_trajectory():
    m = _model()
    op = optimize_loss(_loss(m), "SGD", {"momentum": 0.9}, 0.05, model=m, dtype=torch.bfloat16,
                       precision="split")
    ref = [p.detach().float().clone() for p in m.parameters()]
    fp32 = optkit.SGD([torch.nn.Parameter(r) for r in ref], learning_rate=0.05, momentum=0.9)
    for x, t in _data():
        op(x, t)
    # the reference: the fp32 run fed the bfloat16 gradients of a second split run (the same bf16 weights)
    m2 = _model()
    opt2 = optkit.SGD(m2.parameters(), learning_rate=0.05, momentum=0.9, precision="split")
    for x, t in _data():
        _loss(m2)(x, t).backward()
        for rp, p in zip(fp32.param_groups[0]["params"], m2.parameters()):
            rp.grad = p.grad.float()
        fp32.step()
        opt2.step()
        opt2.zero_grad()
    for p, rp in zip(m.parameters(), fp32.param_groups[0]["params"]):
        master = lowp.split_decode(p.detach(), op.optimizer.state[p]["master_low"])
        assert torch.equal(master, rp.detach())


def test_state_dtype_under_mixed_is_the_masters_slots():
    m = _model()
    op = optimize_loss(_loss(m), "Adam", None, 0.01, model=m, dtype="mixed", precision="fp32-masters",
                       state_dtype="bf16")
    for x, t in _data(2):
        op(x, t)
    assert all(q.dtype == torch.float32 for q in op.masters)
    assert op.optimizer.state[op.masters[0]]["exp_avg"].dtype == torch.bfloat16


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"precision": "split", "dtype": torch.float32}, ValueError, "dtype=torch.bfloat16"),
    ({"precision": "split", "dtype": "mixed"}, ValueError, "dtype=torch.bfloat16"),
    ({"precision": "fp32-masters", "dtype": torch.bfloat16}, ValueError, "mixed"),
    ({"precision": "bf16", "dtype": torch.bfloat16}, ValueError, "precision"),
    ({"state_dtype": "int4"}, ValueError, "state_dtype"),
    ({"precision": "kahan", "dtype": torch.bfloat16, "optimizer": torch.optim.SGD}, TypeError, "precision"),
    ({"state_dtype": "int8", "optimizer": torch.optim.SGD}, TypeError, "state_dtype"),
    ({"state_dtype": "int8", "optimizer_params": {"state_dtype": "bf16"}}, ValueError, "state_dtype"),
])
def test_validation(kwargs, exc, match):
    m = _model()
    kw = {"optimizer": "SGD", "optimizer_params": None, **kwargs}
    with pytest.raises(exc, match=match):
        optimize_loss(_loss(m), kw.pop("optimizer"), kw.pop("optimizer_params"), 0.1, model=m, **kw)


@pytest.mark.parametrize("precision, state_dtype", [("split", "int8"), ("kahan", "bf16"),
                                                    ("stochastic", "int8"), ("fp32-masters", "int8")])
def test_resume_is_bit_identical(precision, state_dtype):
    dtype = "mixed" if precision == "fp32-masters" else torch.bfloat16
    model, data = _model(), _data(8)

    def build(m):
        return optimize_loss(_loss(m), "LAMB", None, 0.01, model=m, dtype=dtype, precision=precision,
                             state_dtype=state_dtype, iter_size=2, clip_gradients=0.5, loss_scaling="dynamic")

    m1 = copy.deepcopy(model)
    op1 = build(m1)
    for x, t in data:
        op1(x, t)
    m2 = copy.deepcopy(model)
    op2 = build(m2)
    for x, t in data[:3]:  # (inside a window)
        op2(x, t)
    ckpt = copy.deepcopy({"model": m2.state_dict(), "train": op2.state_dict()})
    m3 = copy.deepcopy(model)
    op3 = build(m3)
    m3.load_state_dict(ckpt["model"])
    op3.load_state_dict(ckpt["train"])
    for x, t in data[3:]:
        op3(x, t)
    for p1, p3 in zip(m1.parameters(), m3.parameters()):
        assert torch.equal(p1, p3)
    for q1, q3 in zip(op1.masters, op3.masters):
        for k, v in op1.optimizer.state[q1].items():
            if isinstance(v, torch.Tensor):
                assert same_bits(v, op3.optimizer.state[q3][k]), k
