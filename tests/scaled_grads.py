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
