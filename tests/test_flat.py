"""``optkit.flat_parameters``: the layout it makes, the errors it raises, ``zero_grad`` keeping the views, and
the fallbacks when a gradient or a parameter's storage is replaced. Every step is checked against
``torch.optim.SGD(momentum, foreach=False)`` (``optkit.Momentum`` has torch's rule) on plain copies."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import optkit
from optkit.flat import flat_buffer_of
from scaled_grads import assert_skip_changes_nothing

LR, MU = 0.1, 0.9


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 4 * 4, 5),
                      nn.Linear(5, 5), nn.Linear(5, 5))
    m[0].weight.data = m[0].weight.data.contiguous(memory_format=torch.channels_last)
    return m


def _batch(k: int) -> torch.Tensor:
    return torch.randn(8, 3, 6, 6, generator=torch.Generator().manual_seed(100 + k))


def _loss(m: nn.Module, k: int) -> torch.Tensor:
    return m(_batch(k)).square().mean()


def _twin(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A plain copy of ``model`` (no flat buffers) with the torch reference optimizer."""
    twin = _model()
    twin.load_state_dict(model.state_dict())
    return twin, torch.optim.SGD(twin.parameters(), lr=LR, momentum=MU, foreach=False)


def _ref_step(twin, ref_opt, k):
    ref_opt.zero_grad()
    _loss(twin, k).backward()
    ref_opt.step()


def _assert_same(model, twin):
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7, msg=n)


def test_layout_views_values_names_and_strides():
    """Each parameter (and its gradient) becomes a view into one buffer per (device, dtype), in order, with
    its values, its name and its strides (channels_last stays channels_last); existing gradients are copied
    in; ``flat_buffer_of`` finds the buffer."""
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model[3].weight.grad = torch.randn_like(model[3].weight)
    g_before = model[3].weight.grad.clone()
    strides = {n: p.stride() for n, p in model.named_parameters()}
    flat = optkit.flat_parameters(model)
    key = (torch.device("cpu"), torch.float32)
    assert list(flat.buffers) == [key]
    buf, gbuf = flat.buffers[key], flat.grads[key]
    assert buf.numel() == sum(p.numel() for p in model.parameters())
    offset = 0
    for n, p in model.named_parameters():
        assert p.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr(), n
        assert p.storage_offset() == offset and p.stride() == strides[n], n
        assert p.grad.untyped_storage().data_ptr() == gbuf.untyped_storage().data_ptr(), n
        assert torch.equal(p.detach(), before[n]), n
        offset += p.numel()
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(model[3].weight.grad, g_before) and model[4].weight.grad.abs().sum() == 0
    whole = flat_buffer_of(model[4].bias)
    assert whole is not None and whole.numel() == buf.numel() and whole.data_ptr() == buf.data_ptr()
    assert flat_buffer_of(torch.zeros(3)) is None
    assert flat.views_intact() and "7 tensors" not in repr(flat) and "10 tensors" in repr(flat)


@pytest.mark.parametrize("bad, err, match", [
    ([], ValueError, "no parameter"),
    ([torch.zeros(2, requires_grad=True) * 2], ValueError, "non-leaf"),
    ([torch.zeros(2, 2).to_sparse().requires_grad_()], TypeError, "dense strided"),
    (["weight"], TypeError, "expected tensors"),
    ([{"lr": 0.1}], TypeError, "'params' entry"),
    ([{"params": (p for p in [nn.Parameter(torch.ones(2))])}], TypeError, "one-shot iterator"),
])
def test_refusals_name_the_problem(bad, err, match):
    with pytest.raises(err, match=match):
        optkit.flat_parameters(bad)


def test_steps_match_torch_and_zero_grad_keeps_the_views():
    """Three steps with ``opt.zero_grad()`` between them: the gradients stay views of the flat buffer (one
    fill), the plan steps one flat run, and the weights are torch's."""
    model = _model()
    twin, ref_opt = _twin(model)
    flat = optkit.flat_parameters(model)
    opt = optkit.Momentum(model.parameters(), LR, momentum=MU)
    for k in range(3):
        opt.zero_grad()
        assert flat.views_intact()
        _loss(model, k).backward()
        opt.step()
        _ref_step(twin, ref_opt, k)
    plan = next(iter(opt._plans.values()))
    assert plan.flat is not None and plan.flat.same_grads([p.grad for p in model.parameters()])
    _assert_same(model, twin)


def test_param_groups_are_laid_out_group_after_group_and_step_flat():
    """Given param groups (weights and biases split, as ``no_decay_1d`` does), the buffer holds each group's
    parameters back to back in the group's order, so every group steps over the flat buffer, without a
    warning (also not for a step where some parameters have no gradient), and the weights are those of
    per-tensor steps on a plain copy. The same model flattened in module order interleaves the groups: they
    step tensor by tensor (same weights) and the optimizer says so, once, pointing at the ``step()``."""
    rules = [(r"^[45]\.", {"lr_scale": 2.0})]
    results = {}
    for how in ("groups", "module", "plain"):
        model = _model()
        if how == "groups":
            flat = optkit.flat_parameters(optkit.param_groups(model, rules))
            bufs = {id(p): (flat.buffers[(p.device, p.dtype)], p) for p in model.parameters()}
            start = 0
            for g in optkit.param_groups(model, rules):  # back to back, group after group
                for _, p in g["params"]:
                    buf, _ = bufs[id(p)]
                    assert p.data_ptr() == buf.data_ptr() + start * p.element_size()
                    start += p.numel()
        elif how == "module":
            optkit.flat_parameters(model)
        opt = optkit.SGD(optkit.param_groups(model, rules), 0.1, momentum=MU, weight_decay=0.01)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for k in range(4):
                if k == 1:  # a parameter without a gradient for one step is not a layout matter
                    model.zero_grad()
                    model[5](model[4].bias.detach().unsqueeze(0)).sum().backward()  # model[4] gets none
                else:
                    opt.zero_grad()
                    _loss(model, k).backward()
                opt.step()
        said = [w for w in caught if "not back to back" in str(w.message)]
        assert all(w.filename == __file__ for w in said)  # pointed at the step() that met the layout
        flat_groups = [opt._plans[id(g)].flat is not None for g in opt.param_groups]
        assert len(opt.param_groups) == 4
        if how == "groups":
            assert all(flat_groups) and not said
        else:
            assert not any(flat_groups) and len(said) == (1 if how == "module" else 0)
        results[how] = [p.detach().clone() for p in model.parameters()]
    for a, b, c in zip(results["groups"], results["module"], results["plain"]):
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(b, c, rtol=1e-6, atol=1e-7)


def test_replaced_gradients_fall_back_per_tensor_and_views_come_back():
    """``model.zero_grad()`` sets ``.grad`` to None: the next backward makes separate gradients and the step
    runs per tensor (still torch's numbers); one gradient replaced by hand is noticed too;
    ``FlatParameters.zero_grad()`` restores the views and the flat path (its new view objects are taken
    as the cached plan's)."""
    model = _model()
    twin, ref_opt = _twin(model)
    flat = optkit.flat_parameters(model)
    opt = optkit.Momentum(model.parameters(), LR, momentum=MU)
    gbuf = next(iter(flat.grads.values()))
    k = 0
    for how in ("flat", "model.zero_grad", "one replaced", "restored"):
        if how == "model.zero_grad":
            model.zero_grad()
            assert all(p.grad is None for p in model.parameters())
        elif how == "restored":
            flat.zero_grad()
            assert flat.views_intact()
        else:
            opt.zero_grad()
        _loss(model, k).backward()
        if how == "one replaced":
            model[4].weight.grad = model[4].weight.grad.clone() * 1.0  # a fresh tensor, same values
        before = gbuf.clone()
        opt.step()
        _ref_step(twin, ref_opt, k)
        _assert_same(model, twin)
        if how in ("flat", "restored"):
            assert flat.views_intact()
            assert opt.whole_grads() is not None  # the flat part serves (again): one gradient tensor
        else:
            assert not flat.views_intact()
            if how == "model.zero_grad":
                assert torch.equal(gbuf, before)  # the flat gradient buffer was not used
        k += 1


def test_replaced_parameter_storage_is_followed():
    """``p.data = ...`` takes a parameter out of its buffer: the optimizer follows the new storage (its plan
    is rebuilt) and the step is still torch's on it."""
    model = _model()
    twin, ref_opt = _twin(model)
    optkit.flat_parameters(model)
    opt = optkit.Momentum(model.parameters(), LR, momentum=MU)
    opt.zero_grad()
    _loss(model, 0).backward()
    opt.step()
    _ref_step(twin, ref_opt, 0)
    model[5].weight.data = model[5].weight.data.clone()
    for k in (1, 2):
        opt.zero_grad()
        _loss(model, k).backward()
        opt.step()
        _ref_step(twin, ref_opt, k)
    _assert_same(model, twin)


@pytest.mark.parametrize("how", ["data", "set_"])
def test_a_gradient_moved_out_of_the_flat_gradient_is_followed(how):
    """``p.grad.data = t`` or ``p.grad.set_(t)`` keeps the gradient object but moves its storage out of the
    flat gradient: the step uses the new values (per tensor, the flat gradient is stale for it), as torch
    does, at a later step too (the cached plan's checks catch it)."""
    model = _model()
    twin, ref_opt = _twin(model)
    optkit.flat_parameters(model)
    opt = optkit.Momentum(model.parameters(), LR, momentum=MU)
    for k in range(4):
        opt.zero_grad()
        _loss(model, k).backward()
        ref_opt.zero_grad()
        _loss(twin, k).backward()
        if k == 2:
            new = torch.full_like(model[3].weight.grad, 0.25)
            if how == "data":
                model[3].weight.grad.data = new
            else:
                model[3].weight.grad.set_(new)
            twin[3].weight.grad = new.clone()
        opt.step()
        ref_opt.step()
        _assert_same(model, twin)


@pytest.mark.parametrize("how", ["param.data", "param.t_", "grad.t_"])
def test_a_tensor_restrided_in_place_is_followed(how):
    """An alias of the same memory with other strides (``p.data = p.data.t()`` or ``p.t_()`` on a square
    weight, ``p.grad.t_()``) keeps every data pointer: the step follows the new strides per tensor, as torch
    does, instead of pairing parameter and gradient memory laid out differently."""
    model = _model()
    twin, ref_opt = _twin(model)
    optkit.flat_parameters(model)
    opt = optkit.Momentum(model.parameters(), LR, momentum=MU)
    for k in range(4):
        for m, o in ((model, opt), (twin, ref_opt)):
            w = m[4].weight  # 5 x 5
            if k == 2 and how.startswith("param"):
                with torch.no_grad():
                    if how == "param.data":
                        w.data = w.data.t()
                    else:
                        w.t_()
            o.zero_grad()
            _loss(m, k).backward()
            if k == 2 and how == "grad.t_":
                w.grad.t_()
            o.step()
        _assert_same(model, twin)


def test_a_loaded_state_goes_back_into_the_flat_buffers():
    """``load_state_dict`` into an optimizer over flat parameters puts the loaded slots and EMA averages back
    into their flat buffers (a resumed run keeps the one-run step), and the run continues exactly as the
    uninterrupted one."""
    import io

    def build(model):
        return optkit.SGD(model.parameters(), LR, momentum=MU, weight_decay=0.01, use_ema=True)

    ref_model = _model()
    optkit.flat_parameters(ref_model)
    ref_opt = build(ref_model)
    model = _model()
    optkit.flat_parameters(model)
    opt = build(model)
    for k in range(2):
        for m, o in ((ref_model, ref_opt), (model, opt)):
            o.zero_grad()
            _loss(m, k).backward()
            o.step()
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)
    saved.seek(0)
    resumed = _model()
    resumed.load_state_dict(model.state_dict())
    optkit.flat_parameters(resumed)
    opt2 = build(resumed)
    opt2.load_state_dict(torch.load(saved, weights_only=True))
    for k in (2, 3):
        for m, o in ((ref_model, ref_opt), (resumed, opt2)):
            o.zero_grad()
            _loss(m, k).backward()
            o.step()
    plan = next(iter(opt2._plans.values()))
    assert plan.flat is not None and plan.flat.same_grads([p.grad for p in resumed.parameters()])
    for (n, p), (_, q) in zip(resumed.named_parameters(), ref_model.named_parameters()):
        assert torch.equal(p.detach(), q.detach()), n
        for slot in ("momentum", "average"):
            assert torch.equal(opt2.state[p][slot], ref_opt.state[q][slot]), (n, slot)


def test_optimize_loss_over_a_subset_of_flat_parameters():
    """``optimize_loss`` over the last two layers of a flat model, with clipping and dynamic scaling: the
    global norm and the overflow check read the optimizer's flat gradients (only the updated layers'), and
    the norm, the updates and the untouched layers equal those of the same train op on a plain copy."""
    model = _model()
    twin = _model()
    twin.load_state_dict(model.state_dict())
    optkit.flat_parameters(model)
    frozen = [p.detach().clone() for p in model[:4].parameters()]

    def build(m):
        return optkit.optimize_loss(lambda k: _loss(m, k), "SGD", {"momentum": MU}, LR,
                                    var_list=list(m[4:].parameters()), clip_gradients=0.05,
                                    loss_scaling="dynamic")

    op, ref = build(model), build(twin)
    inner = op.base_optimizer
    whole, whole_grads = [], inner.whole_grads
    inner.whole_grads = lambda seen=None: whole.append(whole_grads(seen)) or whole[-1]
    for k in range(4):
        r, s = op(k), ref(k)
        torch.testing.assert_close(r.grad_norm, s.grad_norm, rtol=1e-6, atol=0)
    assert whole[0] is None and all(w is not None for w in whole[1:])  # plans exist after the first update
    assert sum(w.numel() for w in whole[-1]) == sum(p.numel() for p in model[4:].parameters())
    for p, q in zip(model[4:].parameters(), twin[4:].parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
    for p, f in zip(model[:4].parameters(), frozen):
        assert torch.equal(p.detach(), f)


class _Scalars:
    """A summary writer that keeps the scalars."""

    def __init__(self):
        self.scalars: dict[str, list[tuple[int, float]]] = {}

    def add_scalar(self, tag, value, step):
        self.scalars.setdefault(tag, []).append((step, value))

    def add_histogram(self, tag, values, step):  # (not asked for here)
        raise AssertionError(tag)


@pytest.mark.parametrize("rules", [None, [(r"^[45]\.", {"lr_scale": 2.0})]], ids=["one-group", "rules"])
def test_optimize_loss_over_flat_parameters_reads_each_gradient_once(rules):
    """Once the optimizer's plans are flat, the train op takes the gradients from the optimizer's own read
    (it reads no ``.grad`` itself), also when rules split and reorder the groups (the buffer laid out by the
    same groups): the per-variable gradient norms, the global norm and the updates equal those of the same
    train op on a plain copy. A gradient set to None in between sends it back to its own read for that
    update, with the same results."""
    model = _model()
    twin = _model()
    twin.load_state_dict(model.state_dict())
    optkit.flat_parameters(model if rules is None else optkit.param_groups(model, rules))
    writers = [_Scalars(), _Scalars()]

    def build(m, w):
        return optkit.optimize_loss(lambda k: _loss(m, k), "SGD", {"momentum": MU}, LR, model=m, rules=rules,
                                    clip_gradients=0.05, loss_scaling="dynamic", summary_writer=w,
                                    summaries=["global_gradient_norm", "gradient_norm"], summary_every=1)

    op, ref = build(model, writers[0]), build(twin, writers[1])
    reads, with_grads = [], op._with_grads
    op._with_grads = lambda: reads.append(1) or with_grads()
    for k in range(5):
        if k == 3:  # a gradient dropped by hand: not the flat part's any more
            model[5].bias.grad = None
            twin[5].bias.grad = None
        n = len(reads)
        op(k), ref(k)
        assert len(reads) - n == (1 if k in (0, 3) else 0), k  # first update: no plan yet
    inner = op.base_optimizer
    assert all(inner._plans[id(g)].flat is not None for g in inner.param_groups)
    if rules is not None:
        assert len(inner.param_groups) > 1 and op._group_idx != sorted(op._group_idx)
    got, want = writers[0].scalars, writers[1].scalars
    assert got.keys() == want.keys() and len(got) == 2 + len(list(model.parameters()))  # + the clipped norm
    for tag in want:
        assert [s for s, _ in got[tag]] == [s for s, _ in want[tag]] == list(range(5))
        # (abs: the conv bias before batch norm has a gradient of rounding noise, about 1e-10)
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in want[tag]], rel=1e-5, abs=1e-8), tag
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7, msg=n)


def test_optimize_loss_honours_a_step_pre_hook_on_its_wrapper():
    """A step pre-hook on the train op's optimizer (here LARC around SGD) runs after the train op read the
    flat gradients: when it replaces a gradient, the update uses the replacement (nothing read before the
    hook is handed to the inner step), as on a plain copy of the model."""
    models = [_model(), _model()]
    models[1].load_state_dict(models[0].state_dict())
    optkit.flat_parameters(models[0])
    ops = []
    for m in models:
        op = optkit.optimize_loss(lambda k, m=m: _loss(m, k), "SGD", {"momentum": MU}, LR,
                                  larc_params={"larc_eta": 0.002}, loss_scaling="dynamic", model=m)
        calls = []

        def zero_one(opt, args, kwargs, m=m, calls=calls):  # from the third update on
            calls.append(1)
            if len(calls) >= 3:
                m[3].weight.grad = torch.zeros_like(m[3].weight)
        op.optimizer.register_step_pre_hook(zero_one)
        ops.append(op)
    for k in range(5):
        for op in ops:
            op(k)
        _assert_same(*models)


@pytest.mark.parametrize("hook", [None, "inner", "middle wrapper"])
def test_loss_scale_optimizer_hands_what_it_read_to_the_step(hook):
    """``LossScaleOptimizer`` over flat buffers checks the flat gradients and hands what it read of the
    groups to the inner step (which then reads no gradient again); a step pre-hook that replaces a gradient,
    on the inner optimizer or on a wrapper between (it runs after the read), is honoured (nothing is handed
    over then). Either way the updates are torch's, and nothing of the hand-over stays on the optimizer."""
    model = _model()
    twin, ref_opt = _twin(model)
    flat = optkit.flat_parameters(model)
    inner = optkit.Momentum(model.parameters(), LR, momentum=MU)
    middle = optkit.VariableClippingOptimizer(inner, {}, max_norm=1.0)  # clips nothing
    steps = []
    if hook:  # from the second step on (the first builds the plan over the views)
        def double_one(opt, args, kwargs):
            if steps:
                model[3].weight.grad = model[3].weight.grad * 2.0  # a new tensor: out of the flat gradient
        (inner if hook == "inner" else middle).register_step_pre_hook(double_one)
    opt = optkit.LossScaleOptimizer(middle, optkit.FixedLossScale(8.0))
    gathers = []
    gather = inner._gather
    inner._gather = lambda group: gathers.append(1) or gather(group)
    for k in range(4):
        flat.zero_grad()  # the views come back (the hook's replacement is dropped)
        opt.scale_loss(_loss(model, k)).backward()
        assert flat.views_intact()
        n_before = len(gathers)
        opt.step()
        ref_opt.zero_grad()
        _loss(twin, k).backward()
        if hook and steps:
            twin[3].weight.grad *= 2.0
        ref_opt.step()
        steps.append(k)
        _assert_same(model, twin)
        assert "_gathered" not in inner.__dict__
        if k >= 1 and not hook:  # plans exist: whole_grads read the groups, the step did not again
            assert len(gathers) - n_before == len(inner.param_groups)


def test_a_hand_over_does_not_pass_a_step_pre_hook():
    """What ``whole_grads`` read reaches the step in its context (``StepContext.gathered``), not through
    the optimizer: nothing is left on it. A step pre-hook may replace a gradient after that read, so under
    one the step reads the gradients again and updates with the hook's gradient, as a plain copy does."""
    from optkit._core.context import StepContext
    from optkit._wrapper import step_inner

    model, twin = _model(), _model()
    optkit.flat_parameters(model)
    opt = optkit.Momentum(model.parameters(), LR, momentum=MU)
    ref = optkit.Momentum(twin.parameters(), LR, momentum=MU)
    for k in range(3):
        for m, o in ((model, opt), (twin, ref)):
            o.zero_grad()
            _loss(m, k).backward()
        seen = {}
        if k:  # (a plan over the buffer exists after the first step)
            assert opt.whole_grads(seen) is not None and seen
        if k == 2:
            def double(o, args, kwargs):
                o.param_groups[0]["params"][0].grad = o.param_groups[0]["params"][0].grad * 2.0
            opt.register_step_pre_hook(double)
            ref.register_step_pre_hook(double)
        step_inner(opt, StepContext(gathered=seen), global_hooks=True)
        ref.step()
        assert "_gathered" not in opt.__dict__
        _assert_same(model, twin)


def test_a_probe_check_does_not_outlive_its_step():
    """A wrapper's probe (``_flat_part``, as LARC's) remembers that it found the plan current, for the step
    that takes its gathered lists only: a parameter taken out of its buffer after a probe whose step never
    came is noticed by the next plain step, which stays torch's."""
    model = _model()
    twin, ref_opt = _twin(model)
    optkit.flat_parameters(model)
    opt = optkit.Momentum(model.parameters(), LR, momentum=MU)
    group = opt.param_groups[0]
    for k in range(3):
        opt.zero_grad()
        _loss(model, k).backward()
        if k == 1:
            assert opt._flat_part(group) is not None and id(group) in opt._fit_seen  # no step follows
            model[5].weight.data = model[5].weight.data.clone()
            assert opt._flat_part(group) is None and id(group) not in opt._fit_seen  # a new probe sees it
            assert opt._flat_part(group) is None
        opt.step()
        assert not opt._fit_seen  # consumed by the step
        _ref_step(twin, ref_opt, k)
        _assert_same(model, twin)


@pytest.mark.parametrize("clear", ["optimizer", "FlatParameters"])
def test_gradients_come_back_to_their_views_after_model_zero_grad(clear):
    """As in Lightning, which calls ``model.zero_grad()`` once before the first backward: that first step
    runs per tensor over separate gradients (its plan has no flat part), then the optimizer's
    ``zero_grad()`` (or ``FlatParameters.zero_grad()``) points every ``.grad`` back at its zeroed view of the
    flat gradient, the next step plans again, and the later steps run over the flat gradient. torch's
    numbers throughout."""
    model = _model()
    twin, ref_opt = _twin(model)
    flat = optkit.flat_parameters(model)
    opt = optkit.Momentum(model.parameters(), LR, momentum=MU)
    model.zero_grad()
    for k in range(4):
        if k:
            (opt if clear == "optimizer" else flat).zero_grad()
        _loss(model, k).backward()
        assert flat.views_intact() == (k > 0)
        opt.step()
        _ref_step(twin, ref_opt, k)
        _assert_same(model, twin)
        assert (opt.whole_grads() is not None) == (k > 0)


def test_zero_grad_does_not_point_a_parameter_back_into_a_buffer_it_left():
    """A parameter moved out of its buffer (``p.data = ...``) is an ordinary parameter again: the optimizer's
    ``zero_grad()`` does not point its gradient at its old view (torch's ``set_to_none``) and forgets the
    view."""
    model = _model()
    optkit.flat_parameters(model)
    opt = optkit.Momentum(model.parameters(), LR, momentum=MU)
    model[5].weight.data = model[5].weight.data.clone()
    model.zero_grad()
    _loss(model, 0).backward()
    opt.step()
    opt.zero_grad()
    w = model[5].weight
    assert flat_buffer_of(w) is None and w.grad is None and id(w) not in opt._flat_grad_views
    assert flat_buffer_of(model[4].weight) is not None and model[4].weight.grad is not None


@pytest.mark.parametrize("bad", [None, 3, "weights", torch.zeros(2)])
def test_params_that_are_not_a_module_or_an_iterable_of_tensors_are_named(bad):
    with pytest.raises(TypeError, match="`params` must be"):
        optkit.flat_parameters(bad)


class _SparseModel(nn.Module):
    """A Linear registered before a sparse ``nn.Embedding`` and a sparse ``nn.EmbeddingBag``, and one after:
    the embeddings sit between flat parameters in the parameter order."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(3, 3)
        self.emb = nn.Embedding(10, 3, sparse=True)
        self.bag = nn.EmbeddingBag(10, 3, mode="sum", sparse=True)
        self.head = nn.Linear(3, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.pre(self.emb(idx) + self.bag((idx + 1).view(-1, 1))))


_EMB_ROWS, _BAG_ROWS = [1, 4, 7], [2, 5, 8]  # the rows that _sparse_loss touches (idx and idx + 1)


def _sparse_model() -> nn.Module:
    torch.manual_seed(0)
    return _SparseModel().double()


def _sparse_loss(m: nn.Module, k: int) -> torch.Tensor:
    idx = torch.tensor([[1, 4, 4, 7], [7, 7, 1, 1], [4, 1, 4, 4]][k % 3])  # a row left out at steps 1 and 2
    return (m(idx) - 1).square().sum()


_SPARSE_RULES = {
    "Ftrl(l1)": lambda ps: optkit.Ftrl(ps, 0.05, l1_regularization_strength=0.01),
    "Adagrad": lambda ps: optkit.Adagrad(ps, 0.05),
    "Momentum": lambda ps: optkit.Momentum(ps, 0.05, momentum=0.9),
    "RMSProp": lambda ps: optkit.RMSProp(ps, 0.05, momentum=0.5),
    "LARS": lambda ps: optkit.LARS(ps, 0.05),
}


@pytest.mark.parametrize("name", list(_SPARSE_RULES))
def test_sparse_embedding_weights_stay_out_and_keep_their_sparse_rule(name):
    """The weights of ``nn.Embedding`` / ``nn.EmbeddingBag(sparse=True)`` stay out of the flat buffers (their
    own storage, a sparse ``.grad``), so that an optimizer's touched-rows rule runs for them: the weights
    after three steps equal those of the same model without flat buffers (float64), only the touched rows
    changed, the Linears are still in one flat buffer and their part of the group still steps over it.
    (Adagrad's dense rule leaves a zero row as it is: the old dense views showed only in the layout.)"""
    model, twin = _sparse_model(), _sparse_model()
    emb0, bag0 = model.emb.weight.detach().clone(), model.bag.weight.detach().clone()
    flat = optkit.flat_parameters(model)
    opt, ref = _SPARSE_RULES[name](model.named_parameters()), _SPARSE_RULES[name](twin.named_parameters())
    for k in range(3):
        for m, o in ((model, opt), (twin, ref)):
            o.zero_grad()
            _sparse_loss(m, k).backward()
            o.step()
        for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-12, msg=f"{n} step {k}")
        for w, w0, rows in ((model.emb.weight, emb0, _EMB_ROWS), (model.bag.weight, bag0, _BAG_ROWS)):
            assert set((w.detach() != w0).any(1).nonzero().flatten().tolist()) <= set(rows), k
    assert model.emb.weight.grad.is_sparse and model.bag.weight.grad.is_sparse
    sparse = [model.emb.weight, model.bag.weight]
    dense = [model.pre.weight, model.pre.bias, model.head.weight, model.head.bias]
    assert all(flat_buffer_of(p) is None for p in sparse)
    buf = flat_buffer_of(model.head.weight)
    assert buf is not None and buf.numel() == sum(p.numel() for p in dense)
    assert all(flat_buffer_of(p).data_ptr() == buf.data_ptr() for p in dense)
    assert [id(p) for p in flat.separate] == [id(p) for p in sparse]
    assert flat.views_intact() and "4 tensors" in repr(flat) and "2 kept out" in repr(flat)
    plan = opt._plans[id(opt.param_groups[0])]
    assert plan.flat is not None and plan.flat.grad.numel() == buf.numel()  # the Linears: one flat run
    assert plan.flat.same_grads([p.grad for p in dense])


@pytest.mark.parametrize("name", ["Momentum", "Adagrad"])
def test_optimize_loss_clears_kept_out_sparse_gradients(name):
    """``optimize_loss`` over a flat model whose sparse embeddings stay out of the buffer: the update's pass
    zeroes the flat part, and the embeddings' sparse gradients are still cleared after every update (they
    used to pile up: each update then applied the sum of all gradients so far), so the weights equal those
    of the same train op on a plain copy (float64)."""
    model, twin = _sparse_model(), _sparse_model()
    optkit.flat_parameters(model)
    opts = {"Momentum": {"momentum": 0.9}, "Adagrad": {}}[name]
    ops = [optkit.optimize_loss(lambda k, m=m: _sparse_loss(m, k), name, opts, 0.05, model=m)
           for m in (model, twin)]
    for k in range(4):
        for op in ops:
            op(k)
        assert model.emb.weight.grad is None and model.bag.weight.grad is None, k
        assert ops[0]._zeroed == frozenset()  # (the step's zeroed groups: handed to the clear, then reset)
        for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-12, msg=f"{n} update {k}")
    plan = next(iter(ops[0].base_optimizer._plans.values()))
    assert plan.flat is not None  # the dense part of the group still stepped over the buffer


def test_param_groups_of_a_module_keep_its_sparse_embeddings_out():
    """``flat_parameters(optkit.param_groups(model))`` keeps the module's sparse embedding weights out of the
    buffer as ``flat_parameters(model)`` does (the groups carry which ones they are); the sparse rule then
    steps them as on a plain copy."""
    model, twin = _sparse_model(), _sparse_model()
    groups = optkit.param_groups(model, [("head", {"lr_scale": 2.0})])
    flat = optkit.flat_parameters(groups)
    assert {id(p) for p in flat.separate} == {id(model.emb.weight), id(model.bag.weight)}
    opt = optkit.Momentum(groups, 0.05, momentum=0.9)
    ref = optkit.Momentum(optkit.param_groups(twin, [("head", {"lr_scale": 2.0})]), 0.05, momentum=0.9)
    for k in range(3):
        for m, o in ((model, opt), (twin, ref)):
            o.zero_grad()
            _sparse_loss(m, k).backward()
            o.step()
    assert model.emb.weight.grad.is_sparse
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-12, msg=n)


def test_kept_out_parameters_keep_names_state_dict_and_zero_grad():
    """``named_parameters()`` and the model's ``state_dict()`` are unchanged; the optimizer's ``state_dict``
    loads into an optimizer without flat buffers and back; its ``zero_grad()`` sets the embeddings'
    gradients to None (a sparse gradient next time) and keeps the Linears' views."""
    model, twin = _sparse_model(), _sparse_model()
    names = [n for n, _ in model.named_parameters()]
    flat = optkit.flat_parameters(model)
    assert [n for n, _ in model.named_parameters()] == names
    opt = optkit.Adagrad(model.named_parameters(), 0.05)
    _sparse_loss(model, 0).backward()
    opt.step()
    opt.zero_grad()
    assert model.emb.weight.grad is None and model.bag.weight.grad is None
    assert flat.views_intact() and all(g.abs().sum() == 0 for g in flat.grads.values())
    twin.load_state_dict(model.state_dict())
    ref = optkit.Adagrad(twin.named_parameters(), 0.05)
    ref.load_state_dict(opt.state_dict())
    back = optkit.Adagrad(model.named_parameters(), 0.05)
    back.load_state_dict(ref.state_dict())
    for k in (1, 2):
        for m, o in ((model, back), (twin, ref)):
            o.zero_grad()
            _sparse_loss(m, k).backward()
            o.step()
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-12, msg=n)
    assert flat_buffer_of(model.pre.weight) is not None and flat_buffer_of(model.emb.weight) is None
    # FlatParameters.zero_grad() clears them too (they used to keep their sparse gradients, which the next
    # backward added to): three steps cleared that way equal three cleared by the optimizer
    for k in (3, 4, 5):
        for m, o, clear in ((model, back, flat.zero_grad), (twin, ref, ref.zero_grad)):
            clear()
            assert m.emb.weight.grad is None and m.bag.weight.grad is None
            _sparse_loss(m, k).backward()
            o.step()
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-12, msg=n)


def test_a_parameter_with_a_sparse_gradient_already_stays_out_of_given_tensors():
    """Given tensors (no module to look into), a parameter whose gradient is already sparse stays out (one
    backward before the call tells it); a dense embedding (``sparse=False``) is flattened as any parameter."""
    model = _sparse_model()
    _sparse_loss(model, 0).backward()
    g = model.emb.weight.grad
    model.bag.weight.grad = None
    flat = optkit.flat_parameters(model.named_parameters())
    assert model.emb.weight.grad is g and flat_buffer_of(model.emb.weight) is None
    assert [id(p) for p in flat.separate] == [id(model.emb.weight)]
    assert flat_buffer_of(model.bag.weight) is not None  # nothing tells it from a tensor: flattened
    dense = optkit.flat_parameters(nn.Embedding(4, 2))
    assert not dense.separate and "1 tensors" in repr(dense)


def test_a_module_of_sparse_embeddings_only_makes_no_buffer():
    flat = optkit.flat_parameters(nn.Embedding(4, 2, sparse=True))
    assert not flat.buffers and len(flat.separate) == 1 and flat.views_intact()


def _excluding_bias(opt):
    opt.exclude_from_weight_decay(var_names=["bias"])
    return opt


_JIT_RULES = {
    # nothing per tensor: the compiled chain over the whole flat buffer
    "SGD-nesterov-wd-ema": (lambda ps: optkit.SGD(ps, 0.05, momentum=0.9, nesterov=True, weight_decay=0.01,
                                                  use_ema=True, ema_momentum=0.5, jit_compile=True), "whole"),
    "AdamW": (lambda ps: optkit.AdamW(ps, 0.01, weight_decay=0.01, jit_compile=True), "whole"),
    "Adagrad": (lambda ps: optkit.Adagrad(ps, 0.05, jit_compile=True), "whole"),
    "RMSProp": (lambda ps: optkit.RMSProp(ps, 0.05, momentum=0.5, jit_compile=True), "whole"),
    "Ftrl": (lambda ps: optkit.Ftrl(ps, 0.05, l1_regularization_strength=0.01, jit_compile=True), "whole"),
    # the decay differs per tensor: per tensor, as before
    "SGD-wd-exclusion": (lambda ps: _excluding_bias(optkit.SGD(ps, 0.05, momentum=0.9, weight_decay=0.01,
                                                               jit_compile=True)), "per tensor"),
    # per-tensor trust ratios: the compiled rule over the row runs
    "LARS": (lambda ps: optkit.LARS(ps, 0.05, skip_list=["bias"], use_ema=True, jit_compile=True), "runs"),
    "LAMB": (lambda ps: optkit.LAMB(ps, 0.01, weight_decay=0.01, jit_compile=True), "runs"),
}


@pytest.mark.parametrize("name", list(_JIT_RULES))
def test_jit_compile_over_flat_buffers_steps_the_buffer_and_matches_eager(name, monkeypatch):
    """``jit_compile=True`` over flat buffers: when nothing differs per tensor the compiled chain steps the
    whole buffer as one tensor, LARS and LAMB step the row runs (``(count, size)`` matrices with per-row
    factor columns), and a mixed decay mask keeps the per-tensor compiled chain; every form gives the eager
    per-tensor result (float64, EMA averages included), a skipped step changes nothing, and the state dict
    is the per-tensor one."""
    from optkit.optimizer import Optimizer

    build, form = _JIT_RULES[name]
    seen = []
    original = Optimizer._run_compiled

    def counted(self, group, idx, params, *a, **kw):
        seen.append(len(params))
        return original(self, group, idx, params, *a, **kw)

    monkeypatch.setattr(Optimizer, "_run_compiled", counted)

    def model():  # parameters of 16, 16, 16, 12 and 3 elements: three row runs
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(3)], nn.Linear(4, 3)).double()

    net, twin = model(), model()
    flat = optkit.flat_parameters(net)
    opt, ref = build(net.named_parameters()), build(twin.named_parameters())
    ref.jit_compile = False
    x = torch.randn(8, 4, dtype=torch.float64)
    for k in range(3):
        for m, o in ((net, opt), (twin, ref)):
            o.zero_grad()
            (m(x) - 1).square().sum().backward()
            if k == 1 and o is opt:
                assert_skip_changes_nothing(opt, list(net.parameters()))
            o.step()
    assert opt._compile_state == "ok" and flat.views_intact()
    n = len(list(net.parameters()))
    assert seen and all(s == {"whole": 1, "runs": 3, "per tensor": n}[form] for s in seen), seen
    for (pn, p), (_, q) in zip(net.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-10, atol=1e-12, msg=pn)
    sd, sd_ref = opt.state_dict()["state"], ref.state_dict()["state"]
    assert sd.keys() == sd_ref.keys()
    for i in sd:
        for key, v in sd_ref[i].items():
            if torch.is_tensor(v):
                torch.testing.assert_close(sd[i][key], v, rtol=1e-10, atol=1e-12, msg=f"{i} {key}")


@pytest.mark.parametrize("flat", [True, False])
def test_optimize_loss_under_jit_compile_reads_each_gradient_once_for_norm_and_check(flat, monkeypatch):
    """``optimize_loss`` over an optimizer built with ``jit_compile=True`` (SGD, Nesterov, decay, EMA, a clip
    and a dynamic scale): the global norm and the overflow flag come from one compiled read per gradient
    (:func:`optkit._core.chain.norm_check_sums`, counted) and, over flat buffers, the compiled update zeroes
    the flat gradient in its own loop (the train op's clear skips that group) and the views stay. The weights,
    EMA, norms, skip flags and loss scale equal the eager train op's in float64, through an overflowing
    update (a NaN gradient: skipped, the scale halves). If the pass fails to compile: one warning, then the
    eager passes with the same results; past ``COMPILE_WARN_TENSORS`` tensors, the eager passes."""
    import warnings

    from compiled_passes import VARIANTS, set_variant
    from optkit._core import chain as _compile

    calls: list[int] = []
    runs = []
    for variant in VARIANTS:
        set_variant(monkeypatch, _compile.norm_check_sums, variant, calls)
        model = _model().double()
        if flat:
            optkit.flat_parameters(model)
        hp = {"momentum": MU, "nesterov": True, "weight_decay": 0.01, "use_ema": True}
        def loss(k, model=model):
            return model(_batch(k).double()).square().mean() * (math.nan if k == 2 else 1.0)

        op = optkit.optimize_loss(loss, "SGD", {**hp, "jit_compile": variant != "eager"}, LR, model=model,
                                  clip_gradients=0.05, loss_scaling="dynamic")
        skips = []
        base = op.base_optimizer
        zero_grad = base._zero_grad
        monkeypatch.setattr(base, "_zero_grad", lambda s, skip, skips=skips, zero_grad=zero_grad: (
            skips.append(set(skip)) or zero_grad(s, skip)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = [op(k) for k in range(5)]
        assert sum("running eagerly" in str(w.message) for w in caught) == (variant == "jit-fails")
        assert [bool(r.applied) for r in res] == [True, True, False, True, True]
        if variant == "jit":
            # (over flat parameters the first update, before the optimizer's plans exist, takes the eager
            # passes rather than compiling a per-tensor graph for that one update)
            n = sum(1 for p in model.parameters())
            assert calls == ([1] * 4 if flat else [n] * 5)
            # from the second update on (plans exist), the compiled pass zeroed the flat gradient itself
            assert all(s == ({id(base.param_groups[0])} if flat else set()) for s in skips[1:])
        else:
            assert not calls
        if flat:
            assert len({flat_buffer_of(p).data_ptr() for p in model.parameters()}) == 1
            assert len({p.grad.untyped_storage().data_ptr() for p in model.parameters()}) == 1  # views
            assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())
        state = [p.detach().clone() for p in model.parameters()]
        state += [base.state[p]["average"].clone() for p in model.parameters()]
        runs.append((state, [r.grad_norm for r in res], op.scaler.loss_scale))
    for other in runs[1:]:
        for a, b in zip(runs[0][0], other[0]):
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(torch.stack(other[1]), torch.stack(runs[0][1]), rtol=1e-12, atol=0,
                                   equal_nan=True)
        assert float(other[2]) == float(runs[0][2])


def test_a_freed_buffers_address_does_not_make_a_later_parameter_flat(monkeypatch):
    """A flat buffer is freed, and a later plain parameter's storage has its address and byte size (forced
    here: the buffer is laid over memory the test owns, as an allocator may hand a freed block back). That
    parameter is not flat: ``zero_grad()`` sets its ``.grad`` to None and a step in which it has no gradient
    leaves it and its moments alone, as ``torch.optim.Adam`` (coupled decay) does on a copy; a registry of
    addresses took it for a flat one (a zero gradient kept, the moments decayed and the decay moved it)."""
    import gc

    n, f64 = 1000, torch.float64
    gen = torch.Generator().manual_seed(11)
    values = torch.randn(n, generator=gen, dtype=f64)
    grads = [torch.randn(n, generator=gen, dtype=f64) for _ in range(3)]
    memory = bytearray(n * 8)
    empty = torch.empty

    def empty_over_memory(*size, **kw):  # the flat parameter buffer lies in `memory`
        if size == (n,) and kw.get("dtype") is f64:
            return torch.frombuffer(memory, dtype=f64)
        return empty(*size, **kw)

    w = nn.Parameter(torch.randn(n, generator=gen, dtype=f64))
    monkeypatch.setattr(torch, "empty", empty_over_memory)
    made = optkit.flat_parameters([w])
    monkeypatch.setattr(torch, "empty", empty)
    storage = w.untyped_storage()
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    assert flat_buffer_of(w) is not None and ptr == torch.frombuffer(memory, dtype=f64).data_ptr()
    del storage, made, w  # the flat buffer's storage is freed
    gc.collect()
    q = nn.Parameter(torch.frombuffer(memory, dtype=f64).copy_(values))  # a new storage, same address, size
    assert (q.untyped_storage().data_ptr(), q.untyped_storage().nbytes()) == (ptr, nbytes)
    assert flat_buffer_of(q) is None
    ref = nn.Parameter(values.clone())
    opt = optkit.Adam([q], learning_rate=0.1, weight_decay=0.01)
    ref_opt = torch.optim.Adam([ref], lr=0.1, weight_decay=0.01, foreach=False)
    for k in range(3):  # step 1: no gradient at all
        for o, p in ((opt, q), (ref_opt, ref)):
            o.zero_grad()
            assert p.grad is None
            if k != 1:
                p.grad = grads[k].clone()
            o.step()
        torch.testing.assert_close(q.detach(), ref.detach(), rtol=1e-12, atol=1e-14, msg=f"step {k}")
        for slot in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[q][slot], ref_opt.state[ref][slot], rtol=1e-12, atol=1e-14)


def test_the_registry_forgets_freed_buffers():
    """Entries of freed flat buffers go at the next ``flat_parameters`` call; live ones stay."""
    import gc

    from optkit import flat as flat_mod

    a = nn.Parameter(torch.randn(7))
    flat_mod.flat_parameters([a])
    key = a.untyped_storage()._cdata
    assert key in flat_mod._REGISTRY and flat_buffer_of(a) is not None
    del a
    gc.collect()
    b = nn.Parameter(torch.randn(9))
    flat_mod.flat_parameters([b])
    assert all(not ref.expired() for ref in flat_mod._REGISTRY.values())
    assert flat_buffer_of(b) is not None
    assert key not in flat_mod._REGISTRY or key == b.untyped_storage()._cdata  # (b's may take its place)


def test_per_tensor_clip_over_a_flat_gradient_as_one_element_vector(monkeypatch):
    """``clipnorm`` with ``scratch_grads`` over a flat buffer, as a GPU runs it (each tensor's factor
    c/max(‖g‖, c) expanded over the flat gradient and applied in one multiply; routed here onto CPU tensors):
    the same weights, bit for bit, as the per-tensor multiplies of the CPU path, and the float64 formula."""
    from optkit._core.plan import FlatPart

    shapes = [(7, 5), (13,), (3, 4, 2), (1,), (6, 6)]
    g = torch.Generator().manual_seed(3)
    w0 = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(s, generator=g) * (0.2 if i % 2 else 4.0) for i, s in enumerate(shapes)]

    def run(flat: bool) -> list[torch.Tensor]:
        ps = [nn.Parameter(w.clone()) for w in w0]
        if flat:
            optkit.flat_parameters(ps)
        opt = optkit.SGD(ps, learning_rate=0.5, clipnorm=1.0, scratch_grads=True)
        for _ in range(2):  # (the second step runs over the flat plan the first one built)
            for p, gr in zip(ps, grads):
                if p.grad is None:
                    p.grad = gr.clone()
                else:
                    p.grad.copy_(gr)
            opt.step()
        return [p.detach().clone() for p in ps]

    per_tensor = run(False)
    monkeypatch.setattr(FlatPart, "expands", lambda self: True)
    expanded = run(True)
    for a, b in zip(per_tensor, expanded):
        assert torch.equal(a, b)
    for w, gr, out in zip(w0, grads, expanded):
        n = float(gr.double().norm())
        want = w.double() - 2 * 0.5 * gr.double() * (1.0 / max(n, 1.0))
        torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-7)
