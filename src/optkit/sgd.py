"""Keras-style SGD with momentum and Nesterov (Keras 3 ``keras.optimizers.SGD``).

Update, with ``g`` the processed gradient and ``lr`` the current learning rate::

    momentum == 0:   w ← w − lr·g
    otherwise:       v ← μ·v − lr·g
                     plain:    w ← w + v
                     nesterov: w ← w + μ·v − lr·g        (v is the new velocity)

The velocity holds ``−lr·accum`` (Keras form), so it differs from ``torch.optim.SGD`` / TF1 Momentum only when
the learning rate changes between steps.

Implementation: one call of torch's fused SGD kernel per (device, dtype) group. The kernel divides the
gradient by its ``grad_scale`` operand before the momentum update; passing ``grad_scale = −1/(lr·k)`` (``k``
= unscale × global-clip factor) makes the kernel's buffer exactly the Keras velocity and folds learning
rate, unscaling and clipping into the same memory pass (``lr = −1`` then adds the buffer). ``found_inf``
makes it a no-op. The kernel writes the divided gradient back (``−lr·k·g``), so this form runs on in-cache
copies of the gradient chunks (the base's blocked pass) unless ``scratch_grads=True``: ``p.grad`` is left as
``torch.optim.SGD`` leaves it. With no Nesterov and the learning rate a host number (a constant or a torch
scheduler's value), the kernel's dampening carries ``lr`` instead (``1 − d = −lr``) and ``grad_scale = 1/k``
only unscales: no copy, no gradient write-back without a loss scale (the minimal 20 bytes per parameter),
``g/S`` under one (as ``GradScaler`` leaves it).

Exceptions: float64 groups fold ``−lr·k`` into the gradient in float64 (the kernel's ``grad_scale`` is
float32), and with a momentum buffer never take the dampening form (``1 − fl(1 + lr)`` is ``−lr`` only to
1.1e-16 absolute). The kernel runs only where the gate (:mod:`optkit._core.fused`) says it is exact:
float16/bfloat16 tensors on CPU (torch 2.13's vectorised CPU kernel is wrong for them), non-dense tensors
and gradients whose strides differ from the parameter's run it on contiguous float32 copies. With
``weight_decay`` or EMA the base runs decay → kernel → EMA block by block over cache-sized chunks.
"""

from __future__ import annotations

import torch
from typing_extensions import Unpack

from ._core.fused import unscale_arg
from ._core.traits import Traits
from .optimizer import LearningRate, Optimizer, OptimizerOptions, ParamsT, check_nesterov, check_number

__all__ = ["SGD"]



def _keras_sgd_pointwise(hyper, w, g, slots, lr, k, aux):
    """Out-of-place Keras SGD for ``jit_compile`` (``hyper = (momentum, nesterov)``; true gradient
    ``k·g``)."""
    momentum, nesterov = hyper
    step = g * lr if k is None else g * (lr * k)
    if momentum == 0.0:
        return w - step, []
    v = slots[0] * momentum - step
    if nesterov:
        return w + (v * momentum - step), [v]
    return w + v, [v]


def _stacked(mult, device):
    """Per-tensor multipliers (0-d tensors, None for 1) as one float32 vector on ``device``."""
    one = torch.ones((), dtype=torch.float32, device=device)
    return torch.stack([one if x is None else x.to(device).reshape(()) for x in mult])


class SGD(Optimizer):
    """Gradient descent with optional (Nesterov) momentum, in the Keras form, plus every base option.

    Args:
        params: tensors, named parameters or param groups.
        learning_rate: number, schedule or callable (default 0.01).
        momentum: float in [0, 1] (default 0.0). A group keeps a ``momentum`` slot while its momentum is
            non-zero; a scheduler that turns it on (``OneCycleLR``) gets a zero slot at the next step.
        nesterov: Nesterov momentum (default False); ``use_nesterov`` (TF1's name) is accepted for it.
        weight_decay: the base class's decoupled decay ``w ← w − lr·weight_decay·w`` (Keras; default None).
        **kwargs: base options (``lr``, clipnorm, clipvalue, global_clipnorm, use_ema, ema_momentum,
            ema_overwrite_frequency, jit_compile, mesh, name): :class:`~optkit.optimizer.OptimizerOptions`.

    ``params`` and the learning rate are the only positional arguments.

    Reference: Keras 3 ``SGD`` (``keras/src/optimizers/sgd.py``), tf.keras 2.11 DTensor SGD
    (``keras/dtensor/optimizers.py``).
    """

    def __init__(
        self,
        params: ParamsT,
        learning_rate: LearningRate = 0.01,
        *,
        momentum: float = 0.0,
        nesterov: bool = False,
        use_nesterov: bool | None = None,
        weight_decay: float | None = None,
        **kwargs: Unpack[OptimizerOptions],
    ) -> None:
        check_number("momentum", momentum, low=0.0, high=1.0)
        nesterov = check_nesterov(nesterov, use_nesterov)
        super().__init__(params, learning_rate, weight_decay=weight_decay, momentum=float(momentum),
                         nesterov=nesterov, **kwargs)

    slot_names = ("momentum",)
    #: torch.optim.SGD's dampening has no Keras counterpart: a param group may only hold its neutral value
    _torch_required = {"dampening": 0.0}
    _pointwise = staticmethod(_keras_sgd_pointwise)

    def _active_slots(self, group: dict) -> tuple[str, ...]:
        """A ``momentum`` slot for groups with non-zero momentum (created when a scheduler turns it on)."""
        return ("momentum",) if group["momentum"] else ()

    def _hyper_config(self) -> dict:
        return {"momentum": self.defaults["momentum"], "nesterov": self.defaults["nesterov"]}

    def _pointwise_hyper(self, group: dict) -> tuple:
        return (float(group["momentum"]), bool(group["nesterov"]))

    traits = Traits(multipliers_in_kernel=True)

    def _update_writes_grads(self, group: dict) -> bool:
        """The dampening form (no Nesterov, the learning rate a host number: see :meth:`_update`) leaves
        ``g`` or ``k·g`` in the gradients; the ``grad_scale`` form writes ``−lr·k·g`` there (the base then
        hands it in-cache copies). Mirrors when ``_current_lr`` gives a host value."""
        host = isinstance(self._learning_rate, (float, torch.Tensor)) and not isinstance(
            group["lr"], torch.Tensor) and not isinstance(group.get("lr_scale", 1.0), torch.Tensor)
        damp64 = float(group["momentum"]) != 0.0 and self._has_fp64(group)  # (no dampening form: _update)
        return bool(group["nesterov"]) or not host or damp64

    def _pointwise_fallback(self, group, params, grads, slot_lists, lr, k, found_inf, aux) -> None:
        """The base's, after the per-tensor multipliers ``aux`` (see :meth:`_update`), when there are any,
        went into the gradients."""
        if aux is not None:
            m = _stacked(aux, params[0].device)
            torch._foreach_mul_(grads, list(m.to(params[0].dtype).unbind()))
        super()._pointwise_fallback(group, params, grads, slot_lists, lr, k, found_inf, None)

    def _update(self, group, params, grads, slots, lr, k, found_inf, aux) -> None:
        """``aux``: None, or per-tensor gradient multipliers ``m`` (0-d tensors or None for 1) from a wrapper
        such as LARC; the true gradient is then ``m·k·g`` and each tensor gets its own kernel call with
        ``grad_scale = −1/(lr·k·m)`` (no extra pass over the gradient)."""
        momentum = float(group["momentum"])
        nesterov = bool(group["nesterov"])
        eff = None  # lr·k, made when a part needs it (the host-lr kernel call does not)
        mult = None if aux is None or all(m is None for m in aux) else aux
        # With nothing to unscale or clip and the learning rate a host number, the kernel's dampening carries
        # it: buf ← μ·buf + (1 − d)·g with 1 − d = −lr is the Keras velocity, and the gradient is not written
        # back (the grad_scale form writes the scaled gradient: 4 more bytes per parameter).
        host_lr = getattr(lr, "host_value", None) if not nesterov and mult is None else None
        bufs = slots.get("momentum", []) if momentum != 0.0 else []
        lists, written = ((params, grads, bufs), (0, 2)) if bufs else ((params, grads), (0,))
        if host_lr is not None and k is not None:  # (the kernel leaves k·g in the gradients: see the base)
            written = (*written, 1)
        parts = self._fused_parts("sgd", group, lists, lr, k, found_inf, mult, written)
        for device, dtype, ix, (p, g, *b), fi in parts:
            m = None if mult is None else _stacked([mult[i] for i in ix], device)
            # (not for float64 with a buffer: 1 − fl(1 + lr) is −lr only to 1e-16 absolute, 1e-12 relative for
            # an lr of 1e-4, where float64 runs promise 1e-12)
            if host_lr is not None and not (b and dtype == torch.float64):
                # (k: the kernel divides by grad_scale = 1/k first and stores k·g)
                torch._fused_sgd_(
                    p, g, b[0] if b else [],
                    weight_decay=0.0, momentum=momentum, lr=-1.0 if b else host_lr,
                    dampening=1.0 + host_lr if b else 0.0, nesterov=False, maximize=False,
                    is_first_step=False, grad_scale=unscale_arg(k, g, device, dtype), found_inf=fi,
                )
                continue
            if eff is None:
                eff = lr if k is None else lr * k
            e = eff.to(device)
            if dtype == torch.float64:
                # the kernel's grad_scale is float32: fold −lr·k(·m) into the gradient in float64 instead
                f = -e.to(dtype)
                torch._foreach_mul_(g, f if m is None else list((f * m.to(dtype)).unbind()))
                scale = None
            elif m is None:
                scale = (-1.0 / e).to(torch.float32)
            else:
                scales = (-1.0 / (e * m)).to(torch.float32).unbind()
                for j, sc in enumerate(scales):
                    torch._fused_sgd_(
                        [p[j]], [g[j]], [b[0][j]] if b else [],
                        weight_decay=0.0, momentum=momentum, lr=-1.0, dampening=0.0, nesterov=nesterov,
                        maximize=False, is_first_step=False, grad_scale=sc, found_inf=fi,
                    )
                continue
            torch._fused_sgd_(
                p, g, b[0] if b else [],
                weight_decay=0.0, momentum=momentum, lr=-1.0, dampening=0.0, nesterov=nesterov,
                maximize=False, is_first_step=False, grad_scale=scale, found_inf=fi,
            )
