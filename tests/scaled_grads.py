"""Test helper for gradients set by hand under a loss-scale wrapper."""

from __future__ import annotations

import torch


def scaled_step(opt):
    """``opt.step()`` on gradients set by hand that already carry the loss scale (as after
    ``scale_loss(loss).backward()``): loss-scale wrappers refuse unmarked gradients, so mark every level."""
    level = opt
    while isinstance(level, torch.optim.Optimizer):
        if hasattr(level, "grads_scaled"):
            level.grads_scaled = True
        level = getattr(level, "optimizer", None)
    return opt.step()


def assert_skip_changes_nothing(opt, params, grad_scale=None) -> None:
    """Step ``opt`` with ``found_inf = 1`` (and ``grad_scale`` when given, left set) and assert that no
    parameter and no tensor of the optimizer state changed, bit for bit."""
    def tensors():
        return [t.detach() for t in params] + [v for st in opt.state.values() for v in st.values()
                                               if torch.is_tensor(v)]

    before = [t.clone() for t in tensors()]
    opt.found_inf = torch.ones(())
    if grad_scale is not None:
        opt.grad_scale = grad_scale
    opt.step()
    del opt.found_inf
    after = tensors()
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))


def step_checking_grads(opt, params, scale=None, scratch=False) -> None:
    """``opt.step()`` with ``grad_scale = scale`` handed to it as ``torch.amp.GradScaler`` does (the
    gradients set by hand carry ``scale``), then, unless the optimizer was built with ``scratch_grads=True``,
    assert that each ``.grad`` is what ``torch.optim`` leaves: bitwise the gradient before the step, or
    ``g/scale`` (rounded once from float64)."""
    before = [p.grad.clone() for p in params]
    if scale is not None:
        opt.grad_scale = torch.tensor(scale)
    opt.step()
    opt.__dict__.pop("grad_scale", None)
    if not scratch:
        want = before if scale is None else [(b.double() / scale).to(b.dtype) for b in before]
        assert all(torch.equal(p.grad, b) for p, b in zip(params, want))
