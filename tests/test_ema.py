"""EMA warm-up (``ema_warmup``) and EMA of buffers (``ema_buffers``) in the optimizer base, against float64
references of the formulas: Keras 3's EMA (the first applied update copies) with the decay of the update
after ``k`` applied ones ``min(ema_momentum, (1 + k)/(10 + k))`` (``tf.train.ExponentialMovingAverage`` with
``num_updates``), and the same average over BatchNorm running statistics (timm ``ModelEmaV3`` averages
buffers with the weights)."""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch
from torch import nn

import optkit
import optkit._multi_tensor as _mt

F64 = torch.float64


def _ema_reference(values, momentum, warmup):
    """Averages after each applied update of the weight sequence ``values`` (float64)."""
    avg, out = None, []
    for k, w in enumerate(values):
        if k == 0:
            avg = w.copy()
        else:
            mu = min(momentum, (1 + k) / (10 + k)) if warmup else momentum
            avg = mu * avg + (1 - mu) * w
        out.append(avg.copy())
    return out


@pytest.mark.parametrize("warmup", [False, True])
def test_warmup_decay_matches_reference(warmup):
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((4, 3))
    p = torch.tensor(w0, requires_grad=True)
    opt = optkit.SGD([p], learning_rate=0.1, momentum=0.5, use_ema=True, ema_momentum=0.9,
                     ema_warmup=warmup)
    seen = []
    for _ in range(30):
        p.grad = torch.tensor(rng.standard_normal((4, 3)))
        opt.step()
        seen.append(p.detach().numpy().copy())
    ref = _ema_reference(seen, 0.9, warmup)[-1]
    np.testing.assert_allclose(opt.get_slot(p, "average").numpy(), ref, rtol=1e-13, atol=1e-14)
    other = _ema_reference(seen, 0.9, not warmup)[-1]
    assert np.abs(ref - other).max() > 1e-4  # the warm-up changes the average


@pytest.mark.parametrize("write", ["zero_", "copy_"])
def test_warmup_follows_a_count_written_from_outside(write):
    """``opt.iterations`` is the live count tensor: a write into it from outside (resetting it, or copying a
    checkpoint's step into it, Keras's ``assign``) restarts the warm-up where the count now stands, as the
    schedules do (the host's own count would be stale)."""
    rng = np.random.default_rng(2)
    p = torch.tensor(rng.standard_normal(6), requires_grad=True)
    opt = optkit.SGD([p], learning_rate=0.1, use_ema=True, ema_momentum=0.99, ema_warmup=True)
    avg, k = None, 0
    for step in range(9):
        if step == 5:
            if write == "zero_":
                opt.iterations.zero_()
                k = 0
            else:
                opt.iterations.copy_(torch.tensor(2))
                k = 2
        p.grad = torch.tensor(rng.standard_normal(6))
        opt.step()
        w = p.detach().numpy().copy()
        if k == 0:
            avg = w.copy()
        else:
            mu = min(0.99, (1 + k) / (10 + k))
            avg = mu * avg + (1 - mu) * w
        k += 1
    np.testing.assert_allclose(opt.get_slot(p, "average").numpy(), avg, rtol=1e-13, atol=1e-14)
    assert int(opt.iterations) == k


def test_overwrite_cadence_follows_a_count_written_from_outside():
    """``ema_overwrite_frequency`` overwrites the weights when ``iterations + 1`` is a multiple of it: after
    ``opt.iterations.zero_()`` the cadence restarts from the written count (the host's own count is stale)."""
    rng = np.random.default_rng(3)
    p = torch.tensor(rng.standard_normal(4), requires_grad=True)
    opt = optkit.SGD([p], learning_rate=0.1, use_ema=True, ema_momentum=0.8, ema_overwrite_frequency=3)
    w, avg, k = p.detach().numpy().copy(), p.detach().numpy().copy(), 0
    for step in range(10):
        if step == 4:
            opt.iterations.zero_()
            k = 0
        g = rng.standard_normal(4)
        p.grad = torch.tensor(g)
        opt.step()
        w = w - 0.1 * g
        avg = w.copy() if k == 0 else 0.8 * avg + 0.2 * w
        if (k + 1) % 3 == 0:
            w = avg.copy()
        k += 1
        np.testing.assert_allclose(p.detach().numpy(), w, rtol=1e-13, atol=1e-14, err_msg=f"step {step}")


def test_warmup_counts_applied_updates_only():
    """A skipped step (``found_inf``) neither moves the averages nor advances the warm-up."""
    rng = np.random.default_rng(1)
    grads = [torch.tensor(rng.standard_normal(5)) for _ in range(6)]

    def run(skip_at):
        p = torch.zeros(5, dtype=F64, requires_grad=True)
        opt = optkit.SGD([p], learning_rate=0.1, use_ema=True, ema_momentum=0.99, ema_warmup=True)
        for k, g in enumerate(grads):
            if k == skip_at:
                p.grad = torch.full((5,), float("nan"), dtype=F64)
                opt.found_inf = torch.ones(())
                opt.step()
                del opt.found_inf
            p.grad = g.clone()
            opt.step()
        return p.detach(), opt.get_slot(p, "average")

    a, avg_a = run(None)
    b, avg_b = run(3)
    assert torch.equal(a, b) and torch.equal(avg_a, avg_b)


def test_warmup_config_and_validation():
    p = torch.zeros(3, requires_grad=True)
    opt = optkit.Adam([p], 0.01, use_ema=True, ema_warmup=True)
    cfg = opt.get_config()
    assert cfg["ema_warmup"] is True
    assert optkit.Adam.from_config(cfg, [torch.zeros(3, requires_grad=True)]).ema_warmup is True
    with pytest.raises(TypeError, match="ema_warmup"):
        optkit.Adam([p], 0.01, use_ema=True, ema_warmup=1)


# ------------------------------------------------------------------------------------------------ buffers


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4)
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.fc(x))))


def _train(model, opt, steps, seed=0, start=0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(16, 3, generator=g, dtype=F64) * 2 + 1 for _ in range(start + steps)]
    seen = []
    for x in xs[start:]:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        seen.append({n: b.detach().numpy().copy() for n, b in model.named_buffers() if b.is_floating_point()})
    return seen


def _net():
    torch.manual_seed(0)
    return Net().double()


@pytest.mark.parametrize("warmup", [False, True])
def test_buffer_averages_match_reference(warmup):
    model = _net()
    opt = optkit.SGD(model.named_parameters(), learning_rate=0.05, use_ema=True, ema_momentum=0.8,
                     ema_warmup=warmup, ema_buffers=model)
    seen = _train(model, opt, 12)
    sd = opt.state_dict()
    assert sorted(sd["ema_buffers"]) == ["bn.running_mean", "bn.running_var"]  # num_batches_tracked: int
    for name in ("bn.running_mean", "bn.running_var"):
        ref = _ema_reference([s[name] for s in seen], 0.8, warmup)[-1]
        np.testing.assert_allclose(sd["ema_buffers"][name].numpy(), ref, rtol=1e-13, atol=1e-15)


def test_ema_weights_and_finalize_swap_buffers():
    model = _net()
    opt = optkit.SGD(model.named_parameters(), learning_rate=0.05, use_ema=True, ema_momentum=0.8,
                     ema_buffers=model)
    _train(model, opt, 5)
    live = {n: t.detach().clone() for n, t in model.state_dict().items()}
    avgs = opt.state_dict()["ema_buffers"]
    with opt.ema_weights():
        assert torch.equal(model.bn.running_mean, avgs["bn.running_mean"])
        assert torch.equal(model.fc.weight, opt.get_slot(model.fc.weight, "average"))
    for n, t in model.state_dict().items():
        assert torch.equal(t, live[n]), n
    opt.finalize_variable_values()
    assert torch.equal(model.bn.running_var, avgs["bn.running_var"])


def test_buffer_averages_round_trip_and_continue_bit_identically():
    model = _net()
    opt = optkit.SGD(model.named_parameters(), learning_rate=0.05, momentum=0.9, use_ema=True,
                     ema_momentum=0.9, ema_warmup=True, ema_buffers=model)
    _train(model, opt, 3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model2 = _net()
    model2.load_state_dict(saved["model"])
    opt2 = optkit.SGD(model2.named_parameters(), learning_rate=0.05, momentum=0.9, use_ema=True,
                      ema_momentum=0.9, ema_warmup=True, ema_buffers=model2)
    opt2.load_state_dict(saved["opt"])
    _train(model, opt, 3, start=3)
    _train(model2, opt2, 3, start=3)
    for a, b in zip(opt.state_dict()["ema_buffers"].values(), opt2.state_dict()["ema_buffers"].values()):
        assert torch.equal(a, b)
    for (n, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(a, b), n
    # deepcopy of (model, optimizer) keeps the buffers linked to the copied model
    model3, opt3 = copy.deepcopy((model, opt))
    _train(model3, opt3, 1, start=6)
    _train(model, opt, 1, start=6)
    assert torch.equal(opt3.state_dict()["ema_buffers"]["bn.running_mean"],
                       opt.state_dict()["ema_buffers"]["bn.running_mean"])


def test_bad_buffer_states_and_arguments_are_refused():
    model = _net()
    opt = optkit.SGD(model.named_parameters(), learning_rate=0.05, use_ema=True, ema_buffers=model)
    _train(model, opt, 1)
    before = opt.state_dict()
    for bad, match in [({"bn.running_mean": torch.zeros(4, dtype=F64)}, "must hold"),
                       ({"bn.running_mean": torch.zeros(3, dtype=F64),
                         "bn.running_var": torch.zeros(4, dtype=F64)}, "bn.running_mean")]:
        sd = copy.deepcopy(before)
        sd["ema_buffers"] = bad
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(sd)
        after = opt.state_dict()
        for k, v in before["ema_buffers"].items():
            assert torch.equal(after["ema_buffers"][k], v)
    plain = optkit.SGD(_net().named_parameters(), learning_rate=0.05, use_ema=True)
    with pytest.raises(ValueError, match="averages no buffers"):
        plain.load_state_dict(before)
    with pytest.raises(ValueError, match="use_ema"):
        optkit.SGD(model.parameters(), learning_rate=0.1, ema_buffers=model)
    with pytest.raises(TypeError, match="ema_buffers"):
        optkit.SGD(model.parameters(), learning_rate=0.1, use_ema=True, ema_buffers=[model.bn.running_mean])
    with pytest.raises(TypeError, match="ema_buffers"):
        optkit.SGD(model.parameters(), learning_rate=0.1, use_ema=True,
                   ema_buffers=[("n", model.bn.num_batches_tracked)])


def test_buffers_through_a_loss_scale_wrapper():
    """The wrapper's state dict nests the inner optimizer's, buffer averages included; ``ema_weights``
    passes through."""
    model = _net()
    inner = optkit.SGD(model.named_parameters(), learning_rate=0.05, use_ema=True, ema_buffers=model)
    opt = optkit.LossScaleOptimizer(inner, 1.0)
    x = torch.randn(8, 3, dtype=F64)
    opt.scale_loss(model(x).sum()).backward()
    opt.step()
    assert "ema_buffers" in inner.state_dict()
    with opt.ema_weights():
        assert torch.equal(model.bn.running_mean, inner.state_dict()["ema_buffers"]["bn.running_mean"])


@pytest.mark.parametrize("bad", ["meta", "complex", "sparse"])
def test_a_buffer_average_that_holds_no_real_data_is_refused_before_anything_loads(bad):
    """A buffer average that is a meta tensor (no data), complex or sparse raises ``ValueError`` naming the
    buffer before the optimizer state changes."""
    model = _net()
    opt = optkit.SGD(model.named_parameters(), learning_rate=0.05, momentum=0.9, use_ema=True,
                     ema_buffers=model)
    _train(model, opt, 1)
    sd = copy.deepcopy(opt.state_dict())
    _train(model, opt, 2, start=1)
    before = copy.deepcopy(opt.state_dict())
    v = sd["ema_buffers"]["bn.running_var"]
    sd["ema_buffers"]["bn.running_var"] = {"meta": lambda: torch.empty(v.shape, device="meta"),
                                           "complex": lambda: v.to(torch.complex128),
                                           "sparse": lambda: v.to_sparse()}[bad]()
    with pytest.raises(ValueError, match="running_var"):
        opt.load_state_dict(sd)
    after = opt.state_dict()
    assert int(after["state"][0]["step"]) == int(before["state"][0]["step"]) == 3
    for k, t in before["ema_buffers"].items():
        assert torch.equal(after["ema_buffers"][k], t)


# ------------------------------------------------------------------------------------------------------------
# found by an adversarial sweep of the EMA


@pytest.mark.parametrize("pattern", ["cccc", "ceec", "eccc"])
def test_overwrite_frequency_under_torch_compile_of_step(pattern):
    """Spec vector K8 (SGD lr 1, μ 0.5, overwrite every 3, w0 2, g 1): ``torch.compile(opt.step)`` steps
    (c) mixed with eager ones (e) overwrite at the same updates as eager steps alone."""
    torch._dynamo.reset()
    w = nn.Parameter(torch.tensor([2.0]))
    opt = optkit.SGD([w], learning_rate=1.0, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=3)
    compiled = torch.compile(opt.step, backend="eager")
    ws, avgs = [], []
    for c in pattern:
        w.grad = torch.tensor([1.0])
        (compiled if c == "c" else opt.step)()
        ws.append(w.item())
        avgs.append(opt.get_slot(w, "average").item())
    assert ws == [1.0, 0.0, -0.25, -1.25]
    assert avgs == [1.0, 0.5, -0.25, -0.75]
    assert bool(opt.step_applied) and int(opt.iterations) == 4


def test_a_group_added_later_averages_from_its_weights():
    """A group added after updates (unfreezing a backbone), or a parameter whose state ``build()`` recreates,
    starts its average from its weights (Keras's first-update copy), not from zeros."""
    head = nn.Parameter(torch.tensor([1.0, 2.0], dtype=F64))
    opt = optkit.SGD([head], learning_rate=0.1, use_ema=True, ema_momentum=0.9)
    head.grad = torch.ones(2, dtype=F64)
    opt.step()
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal(3)
    backbone = nn.Parameter(torch.tensor(w0))
    opt.add_param_group({"params": [backbone]})
    g = rng.standard_normal(3)
    backbone.grad = torch.tensor(g)
    head.grad = torch.ones(2, dtype=F64)
    opt.step()
    w1 = w0 - 0.1 * g
    np.testing.assert_allclose(opt.get_slot(backbone, "average").numpy(), 0.9 * w0 + 0.1 * w1, rtol=1e-15)
    with opt.ema_weights():
        np.testing.assert_allclose(backbone.detach().numpy(), 0.9 * w0 + 0.1 * w1, rtol=1e-15)
    del opt.state[head]
    opt.build([head])
    assert torch.equal(opt.get_slot(head, "average"), head.detach())


def _bn_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))


def _trained_bn(steps=6):
    m = _bn_net()
    opt = optkit.SGD(m.parameters(), learning_rate=0.01, use_ema=True, ema_momentum=0.5, ema_buffers=m)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        m(torch.randn(8, 2, generator=g) + 5).sum().backward()
        opt.step()
    return m, opt


def test_dcp_state_dict_keeps_the_buffer_averages():
    """``optkit.distributed.get/set_optimizer_state_dict`` carry the ``ema_buffers`` averages (torch's DCP
    state dict has only ``state`` and ``param_groups``); a misfit entry is refused before anything loads."""
    from optkit import distributed as od

    m, opt = _trained_bn()
    osd = copy.deepcopy(od.get_optimizer_state_dict(m, opt))
    assert od.EMA_BUFFERS_KEY in osd
    m2 = _bn_net()
    opt2 = optkit.SGD(m2.parameters(), learning_rate=0.01, use_ema=True, ema_momentum=0.5, ema_buffers=m2)
    m2.load_state_dict(m.state_dict())
    od.set_optimizer_state_dict(m2, opt2, osd)
    for a, b in zip(opt._ema_buffer_avgs, opt2._ema_buffer_avgs):
        assert torch.equal(a, b)
    bad = copy.deepcopy(osd)
    bad[od.EMA_BUFFERS_KEY]["1.running_mean"] = torch.zeros(5)
    before = [a.clone() for a in opt2._ema_buffer_avgs]
    with pytest.raises(ValueError, match="running_mean"):
        od.set_optimizer_state_dict(m2, opt2, bad)
    assert all(torch.equal(a, b) for a, b in zip(opt2._ema_buffer_avgs, before))


def test_a_state_without_buffer_averages_restarts_them_from_the_buffers():
    """Resuming a run saved without ``ema_buffers`` (EMA turned on at resume): the buffer averages start
    from the loaded buffers, as the weight averages start from the weights, not from a fresh BatchNorm."""
    m, plain = _trained_bn()
    sd = plain.state_dict()
    del sd["ema_buffers"]
    for entry in sd["state"].values():
        entry.pop("average")
    m2 = _bn_net()
    opt2 = optkit.SGD(m2.parameters(), learning_rate=0.01, use_ema=True, ema_momentum=0.5, ema_buffers=m2)
    m2.load_state_dict(m.state_dict())
    opt2.load_state_dict(sd)
    for (_, b), a in zip(opt2._ema_buffers, opt2._ema_buffer_avgs):
        assert torch.equal(a, b)


def test_a_refused_step_inside_ema_weights_changes_nothing():
    """``step()`` inside ``ema_weights()`` raises before anything changes: a mixed-precision wrapper keeps
    its accumulation window, a train op its micro-batch count and gradients, so the next update is exact."""
    def mixed(mistake):
        torch.manual_seed(0)
        p = torch.randn(4).half().requires_grad_()
        opt = optkit.MixedPrecisionOptimizerWrapper(optkit.SGD([p], learning_rate=0.1, use_ema=True), None)
        for mb in range(2):
            (p.float() * (mb + 1)).sum().backward()
            opt.accumulate_grads()
        if mistake:
            with opt.ema_weights(), pytest.raises(RuntimeError, match="ema_weights"):
                opt.step()
        opt.step()
        return p.detach().clone(), int(opt.iterations)

    (a, ka), (b, kb) = mixed(False), mixed(True)
    assert torch.equal(a, b) and ka == kb == 1

    def train_op(mistake):
        w = nn.Parameter(torch.zeros(2, dtype=F64))
        op = optkit.optimize_loss(lambda x: (w * x).sum(), "SGD", {"use_ema": True}, 1.0, var_list=[w],
                                  iter_size=2)
        x = torch.tensor([1.0, 3.0], dtype=F64)
        op(x)
        if mistake:
            with op.optimizer.ema_weights(), pytest.raises(RuntimeError, match="ema_weights"):
                op(x)
            assert op.micro_steps == 1
        for _ in range(3):
            op(x)
        return w.detach().clone(), int(op.global_step)

    (a, ka), (b, kb) = train_op(False), train_op(True)
    assert torch.equal(a, b) and ka == kb == 2


def test_ema_weights_takes_any_iterable_and_copies_forget_the_block():
    """``ema_weights(model.parameters())`` (a generator) and empty lists work; a copy or pickle taken inside
    the block is an optimizer that can step (it does not inherit the block)."""
    import pickle

    m, opt = _trained_bn()
    with opt.ema_weights(m.parameters()):
        for p in m.parameters():
            assert torch.equal(p, opt.get_slot(p, "average"))
        twin = copy.deepcopy((m, opt))
        unpickled = pickle.loads(pickle.dumps((m, opt)))
    with opt.ema_weights([]):
        pass
    opt.finalize_variable_values([])
    for model, o in (twin, unpickled):
        model(torch.randn(4, 2)).sum().backward()
        o.step()
        with o.ema_weights():
            pass


def test_state_dict_post_hooks_see_the_buffer_averages():
    """torch's state-dict post-hooks get the whole state dict, ``"ema_buffers"`` included, and what they
    return is the state dict."""
    m, opt = _trained_bn()
    seen = []

    def hook(o, sd):
        seen.append(sorted(sd))
        return {k: v for k, v in sd.items() if k != "ema_buffers"}

    opt.register_state_dict_post_hook(hook)
    sd = opt.state_dict()
    assert seen == [["ema_buffers", "param_groups", "state"]]
    assert sorted(sd) == ["param_groups", "state"]


# ------------------------------------------------------------------------------------------------------------
# the EMA's lerp forms: the host's weight (torch's Scalar lerp, one kernel), the device weight tensor by
# tensor (the CPU's form), and the device weight as views of one filled buffer (CUDA's form, one kernel), all
# the same bits as a per-tensor lerp by the weight rounded to the tensors' dtype

_LERP_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
_SHAPES = [(3, 5), (7,), (2, 3, 4, 5), (1,), (130,), (0,)]


def _params(rng, dtype, n=_SHAPES, device="cpu"):
    out = []
    for s in n:
        t = torch.tensor(rng.standard_normal(s)).to(device=device, dtype=dtype)
        if len(s) == 4:  # channels_last: strides that are not the contiguous ones
            t = t.contiguous(memory_format=torch.channels_last)
        out.append(t)
    return out


@pytest.mark.parametrize("dtype", _LERP_DTYPES)
def test_lerp_forms_are_bit_identical(dtype):
    """``lerp_group_`` with a float, with a 0-d tensor passed per tensor, and with a 0-d tensor as
    ``weights_like`` views give the bits of ``torch.lerp(t, s, w.to(dtype))`` tensor by tensor, for weights
    below and above 1/2 (torch's lerp switches formula there), 1 and 0."""
    rng = np.random.default_rng(7)
    for w64 in [1.0, 0.0, 0.01, 1 - 0.99, 1 - 0.9999, 1 / 11, 2 / 12, 0.5, 0.7, float(rng.uniform())]:
        tg, src = _params(rng, dtype), _params(rng, dtype)
        w = torch.tensor(w64, dtype=F64)
        want = [torch.lerp(t, s, w.to(dtype)) for t, s in zip(tg, src)]
        for weight, broadcast in [(w64, None), (w, False), (w, True)]:
            got = [t.clone(memory_format=torch.preserve_format) for t in tg]
            _mt.lerp_group_(got, src, weight, torch.device("cpu"), dtype, broadcast=broadcast)
            for g, x in zip(got, want):
                assert torch.equal(g, x), (w64, type(weight), broadcast)
                assert g.stride() == x.stride() or not g.numel()


def test_weights_like_views_match_their_targets():
    """One buffer of the largest target's extent; each view has its target's sizes and strides."""
    ts = [torch.empty(3, 4), torch.empty(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
          torch.empty(3, 4), torch.empty(0, 2)]
    ws = _mt.weights_like(torch.tensor(0.25, dtype=F64), ts, torch.bfloat16)
    for w, t in zip(ws, ts):
        assert w.shape == t.shape and w.stride() == t.stride() and w.dtype == torch.bfloat16
        assert bool((w == 0.25).all())
    assert ws[0].untyped_storage().data_ptr() == ws[1].untyped_storage().data_ptr()
    assert ws[1].untyped_storage().nbytes() == 120 * 2


def _ema_run(monkeypatch, route, dtype, warmup, skip_at=(), resume_at=None, steps=7, lso=False, device="cpu"):
    """Averages after each step of SGD + wd + EMA over ``_SHAPES`` (two groups: the second float64) along
    ``route``: 'old' (the device weight, tensor by tensor: the form before the host's weight), 'host' (as
    shipped) or 'cuda' (as shipped, tensor weights through ``weights_like`` as on CUDA). ``skip_at``: steps
    whose gradients hold an inf (under a LossScaleOptimizer: skipped); ``resume_at``: a fresh optimizer loads
    the state dict there. Returns the averages per step and the weight kinds the lerps got."""
    kinds = []
    orig = _mt.lerp_group_

    def spy(tg, src, weight, device, dt, broadcast=None):
        kinds.append("tensor" if isinstance(weight, torch.Tensor) else "float")
        return orig(tg, src, weight, device, dt, broadcast=True if route == "cuda" else broadcast)

    rng = np.random.default_rng(11)
    ps = [nn.Parameter(t) for t in _params(rng, dtype, device=device)]
    ps64 = [nn.Parameter(t) for t in _params(rng, F64, [(4,), (2, 3)], device=device)]
    gs = [[_params(rng, p.dtype, [tuple(p.shape)], device=device)[0] for p in ps + ps64]
          for _ in range(steps)]

    def build(params):
        inner = optkit.SGD([{"params": params[:len(ps)]}, {"params": params[len(ps):]}], learning_rate=0.1,
                           momentum=0.9, weight_decay=1e-2, use_ema=True, ema_momentum=0.9, ema_warmup=warmup)
        return inner, (optkit.LossScaleOptimizer(inner, optkit.DynamicLossScale(4.0, increment_period=3))
                       if lso else inner)

    params = ps + ps64
    inner, opt = build(params)
    out = []
    with monkeypatch.context() as m:
        m.setattr(_mt, "lerp_group_", spy)
        if route == "old":
            m.setattr(optkit.Optimizer, "_ema_lerp_weight", lambda self, applied: self._ema_weight(applied))
        for step in range(steps):
            if step == resume_at:
                sd = copy.deepcopy(opt.state_dict())
                params = [nn.Parameter(p.detach().clone(memory_format=torch.preserve_format)) for p in params]
                inner, opt = build(params)
                opt.load_state_dict(sd)
            for p, g in zip(params, gs[step]):
                p.grad = g.clone(memory_format=torch.preserve_format)
                if step in skip_at and p.numel() > 3:
                    p.grad[(0,) * p.ndim] = float("inf")
            if lso:
                opt.grads_scaled = True
            opt.step()
            out.append([inner.get_slot(p, "average").clone() for p in params])
    return out, kinds


@pytest.mark.parametrize("dtype", _LERP_DTYPES)
@pytest.mark.parametrize("warmup", [False, True])
def test_ema_host_weight_is_bit_identical_to_the_device_weight(monkeypatch, dtype, warmup):
    """The host's weight (one Scalar lerp per group) and the device weight as CUDA takes it (views of one
    buffer) give the averages of the per-tensor lerp by the device weight bit for bit, from the first step
    (a copy) on, through the warm-up, and across a resume from a state dict in the middle of the run."""
    old, kinds_old = _ema_run(monkeypatch, "old", dtype, warmup)
    assert set(kinds_old) == {"tensor"}
    for route in ("host", "cuda"):
        for resume_at in (None, 3):
            new, kinds = _ema_run(monkeypatch, route, dtype, warmup, resume_at=resume_at)
            assert set(kinds) == {"float"}  # the host knew the weight at every step
            for step, (a, b) in enumerate(zip(old, new)):
                for x, y in zip(a, b):
                    assert torch.equal(x, y), (route, resume_at, step)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("warmup", [False, True])
def test_ema_under_skipped_steps_is_bit_identical(monkeypatch, dtype, warmup):
    """Under a LossScaleOptimizer (a device skip flag: the device weight, tensor by tensor on the CPU or as
    ``weights_like`` views on CUDA) the averages equal the old path's bit for bit, a skipped step changes
    none of them, and a resume from a state dict (where the host count is re-read) changes nothing."""
    skip = (2, 4)
    old, _ = _ema_run(monkeypatch, "old", dtype, warmup, skip_at=skip, lso=True)
    for step in skip:
        for x, y in zip(old[step - 1], old[step]):
            assert torch.equal(x, y)
    for route in ("host", "cuda"):
        for resume_at in (None, 3):
            new, kinds = _ema_run(monkeypatch, route, dtype, warmup, skip_at=skip, resume_at=resume_at,
                                  lso=True)
            assert "tensor" in kinds
            for step, (a, b) in enumerate(zip(old, new)):
                for x, y in zip(a, b):
                    assert torch.equal(x, y), (route, resume_at, step)
