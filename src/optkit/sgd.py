"""Keras-style SGD with momentum and Nesterov (seed 004, ``spec/tf_keras.md`` §5.1).

Update, with ``g`` the processed gradient and ``lr`` the current learning rate::

    momentum == 0:   w ← w − lr·g
    otherwise:       v ← μ·v − lr·g
                     plain:    w ← w + v
                     nesterov: w ← w + μ·v − lr·g        (v is the new velocity)

The velocity holds ``−lr·accum`` (Keras form), so it differs from ``torch.optim.SGD`` / TF1 Momentum only when
the learning rate changes between steps.

Implementation: one call of torch's fused SGD kernel per (device, dtype) group. The kernel divides the gradient
by its ``grad_scale`` operand before the momentum update; passing ``grad_scale = −1/(lr·k)`` (``k`` = unscale ×
global-clip factor) makes the kernel's buffer exactly the Keras velocity and folds learning rate, unscaling and
clipping into the same memory pass (``lr = −1`` then adds the buffer). ``found_inf`` makes it a no-op. As with
``torch.amp.GradScaler`` + fused optimizers, the kernel writes the scaled gradient back: after ``step()``,
``p.grad`` holds ``−lr·g``; call ``zero_grad()`` before the next backward as usual.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import _multi_tensor as mt
from .optimizer import Optimizer

__all__ = ["SGD"]

_FUSED_DEVICES = ("cpu", "cuda")


def _keras_sgd_foreach(
    params: list[Tensor],
    grads: list[Tensor],
    bufs: list[Tensor],
    eff_lr: Tensor,
    momentum: float,
    nesterov: bool,
    applied: Tensor | None,
) -> None:
    """Reference foreach form (devices without the fused kernel): same math, a few passes."""
    step = [g * (-eff_lr) for g in grads]
    if applied is not None:
        step = [s * applied for s in step]
    if momentum == 0.0:
        torch._foreach_add_(params, step)
        return
    if applied is None:
        torch._foreach_mul_(bufs, momentum)
    else:
        torch._foreach_mul_(bufs, 1.0 - (1.0 - momentum) * applied)
    torch._foreach_add_(bufs, step)
    if nesterov:
        torch._foreach_add_(params, step)
        torch._foreach_add_(params, [b * momentum if applied is None else b * (momentum * applied) for b in bufs])
    else:
        if applied is None:
            torch._foreach_add_(params, bufs)
        else:
            torch._foreach_add_(params, [b * applied for b in bufs])


class SGD(Optimizer):
    """Gradient descent with optional (Nesterov) momentum, in the Keras form, plus every base option.

    Args:
        params: tensors, named parameters or param groups.
        learning_rate: number, schedule or callable (default 0.01).
        momentum: float in [0, 1] (default 0.0). A ``momentum`` slot exists only when it is non-zero.
        nesterov: Nesterov momentum (default False).
        **kwargs: base options (weight_decay, clipnorm, clipvalue, global_clipnorm, use_ema, ema_momentum,
            ema_overwrite_frequency, jit_compile, mesh, name, amsgrad).

    Reference: Keras 3 ``SGD`` (``keras/src/optimizers/sgd.py``), tf.keras DTensor SGD (seed 004).
    """

    def __init__(
        self,
        params: Any,
        learning_rate: Any = 0.01,
        momentum: float = 0.0,
        nesterov: bool = False,
        **kwargs: Any,
    ) -> None:
        from .optimizer import check_number

        check_number("momentum", momentum, low=0.0, high=1.0)
        if not isinstance(nesterov, bool):
            raise TypeError(f"`nesterov` must be a bool, got {nesterov!r}")
        self.slot_names = ("momentum",) if momentum != 0 else ()
        super().__init__(params, learning_rate, momentum=float(momentum), nesterov=nesterov, **kwargs)

    def _hyper_config(self) -> dict:
        return {"momentum": self.defaults["momentum"], "nesterov": self.defaults["nesterov"]}

    def _update(self, group, params, grads, slots, lr, k, found_inf, aux) -> None:
        momentum = float(group["momentum"])
        nesterov = bool(group["nesterov"])
        if momentum != 0.0 and "momentum" not in slots:
            raise ValueError(
                "param group momentum was changed from 0 after construction; momentum slots do not exist"
            )
        eff = lr if k is None else lr * k
        bufs = slots.get("momentum", []) if momentum != 0.0 else []
        lists = (params, grads, bufs) if bufs else (params, grads)
        for (device, _dtype), (_, grouped) in mt.group_by_device_dtype(*lists).items():
            p, g = grouped[0], grouped[1]
            b = grouped[2] if bufs else []
            e = eff.to(device)
            fi = None if found_inf is None else found_inf.to(device)
            if device.type in _FUSED_DEVICES:
                torch._fused_sgd_(
                    p, g, b,
                    weight_decay=0.0, momentum=momentum, lr=-1.0, dampening=0.0, nesterov=nesterov,
                    maximize=False, is_first_step=False, grad_scale=-1.0 / e, found_inf=fi,
                )
            else:  # pragma: no cover - exercised only on other accelerators
                _keras_sgd_foreach(p, g, b, e, momentum, nesterov, None if fi is None else 1.0 - fi)
