"""The TF1 optimizers behind the registry names, as PyTorch optimizers (``spec/openseq2seq.md`` §3.9).

Where ``torch.optim`` has the algorithm, the class is a thin subclass that accepts ``learning_rate`` and the
TF argument names, with TF's defaults, and picks torch's fused kernel where torch supports it:

* :class:`Momentum` — ``tf.train.MomentumOptimizer``: ``a ← μ·a + g; w ← w − lr·a`` (Nesterov
  ``w ← w − lr·(g + μ·a)``); identical to ``torch.optim.SGD(momentum=μ, dampening=0)``.
* :class:`Adam` / :class:`AdamW` — ``tf.train.AdamOptimizer`` / ``tf.contrib.opt.AdamWOptimizer``; torch adds
  ``epsilon`` to the bias-corrected ``√v̂`` where TF adds it to ``√v`` (see ``docs/compatibility.md``).
* :class:`Adagrad` — ``tf.train.AdagradOptimizer``: ``s ← s + g²; w ← w − lr·g/√s`` with ``s₀ = 0.1`` and no
  epsilon (torch with ``eps=0``), exactly TF's rule.

``tf.train.RMSPropOptimizer`` differs from ``torch.optim.RMSprop`` in three places (mean square starts at 1,
epsilon inside the square root, learning rate inside the momentum buffer), so :class:`RMSProp` is an optkit
optimizer implementing the TF rule.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import _multi_tensor as mt
from .optimizer import Optimizer, check_number

__all__ = ["Momentum", "Adam", "AdamW", "Adagrad", "RMSProp"]


def _materialize(params: Any) -> list:
    if isinstance(params, Tensor):
        raise TypeError("`params` must be an iterable of tensors or param groups, got a single Tensor")
    return list(params)


def _tensors(params: list) -> list[Tensor]:
    out: list[Tensor] = []
    for item in params:
        if isinstance(item, dict):
            ps = item["params"]
            out += [ps] if isinstance(ps, Tensor) else [x[1] if isinstance(x, tuple) else x for x in ps]
        else:
            out.append(item[1] if isinstance(item, tuple) else item)
    return out


def _fused_ok(params: list) -> bool:
    """torch's fused kernels take floating-point, non-DTensor tensors on CPU or CUDA."""
    ts = _tensors(params)
    return bool(ts) and all(
        isinstance(t, Tensor) and not mt.is_dtensor(t) and t.is_floating_point()
        and t.device.type in ("cpu", "cuda")
        for t in ts
    )


def _init_torch(cls: type, self: torch.optim.Optimizer, params: Any, fused: bool | None, **kw: Any) -> None:
    """Call the torch base ``__init__`` with ``fused=True`` where supported (unless ``fused`` is given)."""
    params = _materialize(params)
    if fused is None and _fused_ok(params):
        try:
            super(cls, self).__init__(params, fused=True, **kw)
            return
        except (RuntimeError, ValueError):  # pragma: no cover - torch build without the fused kernel
            pass
    super(cls, self).__init__(params, fused=fused, **kw)


class Momentum(torch.optim.SGD):
    """``tf.train.MomentumOptimizer(learning_rate, momentum, use_nesterov=False)`` on ``torch.optim.SGD``.

    ``momentum`` is required, as in TF. ``a ← μ·a + g; w ← w − lr·a``; Nesterov ``w ← w − lr·(g + μ·a)``.
    ``weight_decay`` (torch's coupled L2, default 0) and ``fused`` are torch's options.
    """

    def __init__(self, params: Any, learning_rate: float, momentum: float, use_nesterov: bool = False, *,
                 weight_decay: float = 0.0, fused: bool | None = None, **kwargs: Any) -> None:
        check_number("learning_rate", learning_rate, low=0.0)
        check_number("momentum", momentum, low=0.0)
        if not isinstance(use_nesterov, bool):
            raise TypeError(f"`use_nesterov` must be a bool, got {use_nesterov!r}")
        _init_torch(Momentum, self, params, fused, lr=learning_rate, momentum=momentum, dampening=0.0,
                    nesterov=use_nesterov, weight_decay=weight_decay, **kwargs)


class Adam(torch.optim.Adam):
    """``tf.train.AdamOptimizer(learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8)`` on
    ``torch.optim.Adam``. torch adds ``epsilon`` to ``√v̂`` (bias-corrected); TF adds it to ``√v``."""

    def __init__(self, params: Any, learning_rate: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8, *, fused: bool | None = None, **kwargs: Any) -> None:
        check_number("learning_rate", learning_rate, low=0.0)
        check_number("beta1", beta1, low=0.0, high=1.0)
        check_number("beta2", beta2, low=0.0, high=1.0)
        check_number("epsilon", epsilon, low=0.0)
        _init_torch(Adam, self, params, fused, lr=learning_rate, betas=(beta1, beta2), eps=epsilon, **kwargs)


class AdamW(torch.optim.AdamW):
    """``tf.contrib.opt.AdamWOptimizer(weight_decay, learning_rate=0.001, beta1, beta2, epsilon)`` as used by
    OpenSeq2Seq (decay ``w ← w − lr·weight_decay·w`` before the Adam step) on ``torch.optim.AdamW``.
    ``weight_decay`` is required, as in TF; it applies to every parameter."""

    def __init__(self, params: Any, weight_decay: float, learning_rate: float = 0.001, beta1: float = 0.9,
                 beta2: float = 0.999, epsilon: float = 1e-8, *, fused: bool | None = None,
                 **kwargs: Any) -> None:
        check_number("weight_decay", weight_decay, low=0.0)
        check_number("learning_rate", learning_rate, low=0.0)
        check_number("beta1", beta1, low=0.0, high=1.0)
        check_number("beta2", beta2, low=0.0, high=1.0)
        check_number("epsilon", epsilon, low=0.0)
        _init_torch(AdamW, self, params, fused, lr=learning_rate, betas=(beta1, beta2), eps=epsilon,
                    weight_decay=weight_decay, **kwargs)


class Adagrad(torch.optim.Adagrad):
    """``tf.train.AdagradOptimizer(learning_rate, initial_accumulator_value=0.1)`` on ``torch.optim.Adagrad``:
    ``s ← s + g²; w ← w − lr·g/√s``. ``epsilon`` defaults to 0 (TF has none); torch adds it outside the
    root."""

    def __init__(self, params: Any, learning_rate: float = 0.001, initial_accumulator_value: float = 0.1, *,
                 epsilon: float = 0.0, fused: bool | None = None, **kwargs: Any) -> None:
        check_number("learning_rate", learning_rate, low=0.0)
        check_number("initial_accumulator_value", initial_accumulator_value, low=0.0, low_open=True)
        check_number("epsilon", epsilon, low=0.0)
        _init_torch(Adagrad, self, params, fused, lr=learning_rate,
                    initial_accumulator_value=initial_accumulator_value, eps=epsilon, **kwargs)


def _rmsprop_pointwise(hyper, w, g, slots, lr, k, aux):
    """Out-of-place TF RMSProp step (``slots = (rms, momentum[, mg])``)."""
    decay, momentum, epsilon, centered = hyper
    if k is not None:
        g = g * k
    ms = slots[0] + (g * g - slots[0]) * (1.0 - decay)
    denom = ms + epsilon
    new = [ms]
    if centered:
        mg = slots[2] + (g - slots[2]) * (1.0 - decay)
        denom = denom - mg * mg
    mom = slots[1] * momentum + lr * g / denom.sqrt()
    new.append(mom)
    if centered:
        new.append(mg)
    return w - mom, new


class RMSProp(Optimizer):
    """``tf.train.RMSPropOptimizer(learning_rate, decay=0.9, momentum=0.0, epsilon=1e-10, centered=False)``.

    TF rule (mean square ``ms`` starts at 1, ``mom`` and ``mg`` at 0)::

        ms  ← ms + (1 − ρ)·(g² − ms)
        mg  ← mg + (1 − ρ)·(g − mg)                               (centered only)
        mom ← μ·mom + lr·g / √(ms + ε)        (centered: √(ms − mg² + ε))
        w   ← w − mom

    An optkit optimizer (all base options) because ``torch.optim.RMSprop`` initialises ``ms`` to 0, adds ε
    outside the root and keeps the learning rate out of the momentum buffer.
    """

    _always_block = True

    def __init__(self, params: Any, learning_rate: Any = 0.001, decay: float = 0.9, momentum: float = 0.0,
                 epsilon: float = 1e-10, centered: bool = False, **kwargs: Any) -> None:
        check_number("decay", decay, low=0.0, high=1.0)
        check_number("momentum", momentum, low=0.0)
        check_number("epsilon", epsilon, low=0.0)
        if not isinstance(centered, bool):
            raise TypeError(f"`centered` must be a bool, got {centered!r}")
        self.slot_names = ("rms", "momentum", "mg") if centered else ("rms", "momentum")
        super().__init__(params, learning_rate, decay=float(decay), momentum=float(momentum),
                         epsilon=float(epsilon), centered=centered, **kwargs)

    def _make_slot(self, p: Tensor, slot: str, group: dict) -> Tensor:
        if slot == "rms":
            return torch.ones_like(p, memory_format=torch.preserve_format)
        return torch.zeros_like(p, memory_format=torch.preserve_format)

    def _hyper_config(self) -> dict:
        d = self.defaults
        return {key: d[key] for key in ("decay", "momentum", "epsilon", "centered")}

    def _pointwise_hyper(self, group: dict) -> tuple:
        return (group["decay"], group["momentum"], group["epsilon"], group["centered"])

    _pointwise = staticmethod(_rmsprop_pointwise)

    def _update(self, group, params, grads, slots, lr, k, found_inf, aux) -> None:
        decay, momentum, epsilon, centered = self._pointwise_hyper(group)
        lists = [params, grads] + [slots[s] for s in self.slot_names]
        for (device, dtype), (_, grouped) in self._by_device_dtype(*lists).items():
            w, g, ms, mom = grouped[:4]
            lr_ = lr.to(device=device, dtype=mt.acc_dtype(dtype))
            if k is not None:
                torch._foreach_mul_(g, k.to(device))
            ms_new = torch._foreach_mul(g, g)
            torch._foreach_sub_(ms_new, ms)
            torch._foreach_mul_(ms_new, 1.0 - decay)
            torch._foreach_add_(ms_new, ms)
            denom = torch._foreach_add(ms_new, epsilon)
            new_lists, olds = [ms_new], [ms]
            if centered:
                mg = grouped[4]
                mg_new = torch._foreach_sub(g, mg)
                torch._foreach_mul_(mg_new, 1.0 - decay)
                torch._foreach_add_(mg_new, mg)
                torch._foreach_addcmul_(denom, mg_new, mg_new, value=-1.0)
            torch._foreach_sqrt_(denom)
            step = torch._foreach_mul(g, lr_)
            torch._foreach_div_(step, denom)
            mom_new = torch._foreach_mul(mom, momentum)
            torch._foreach_add_(mom_new, step)
            w_new = torch._foreach_sub(w, mom_new)
            new_lists.append(mom_new)
            olds.append(mom)
            if centered:
                new_lists.append(mg_new)
                olds.append(mg)
            skip = None if found_inf is None else found_inf.to(device) > 0.5
            targets = list(w) + [t for o in olds for t in o]
            mt.commit_(targets, list(w_new) + [t for n in new_lists for t in n], skip)
