"""Momentum: ``tf.train.MomentumOptimizer`` (registry name ``"Momentum"``, as in OpenSeq2Seq).

With ``g`` the processed gradient (plus ``weight_decay·w``, torch's coupled L2, when set) and ``lr`` the
current learning rate::

    a ← μ·a + g
    w ← w − lr·a                 (Nesterov: w ← w − lr·(g + μ·a), a the new accumulator)

This is ``torch.optim.SGD(momentum=μ, dampening=0, nesterov=...)`` exactly; the accumulator starts at zero
(torch starts it at the first gradient: the same value after one step). The accumulator holds raw gradients,
so unlike Keras ``SGD`` it does not rescale past steps when the learning rate changes.

An optkit optimizer (every base option: clipping, EMA, schedules, ``grad_scale``/``found_inf``, the TF
surface), so a skipped step changes nothing and all state exists from construction. Implementation: one call
of
torch's fused SGD kernel per (device, dtype) group, through the gate of :mod:`optkit._core.fused` (learning
rate, unscale and global-clip factor and ``found_inf`` folded in). Sparse gradients take the TF rule on the
de-duplicated touched rows only (``a[r] ← μ·a[r] + g[r]; w[r] ← w[r] − lr·a[r]``).

With ``μ = 0`` both paths keep torch's rule: ``w ← w − lr·g`` and the accumulator is left as it is (torch's
``SGD(momentum=0)`` keeps no buffer; TF's ``ApplyMomentum`` would store ``g`` in it). A momentum raised later
(``param_groups[i]["momentum"]``, a cycling schedule) then starts from the accumulator as it was, zero on a
fresh optimizer, exactly as torch's SGD starts a fresh buffer, on dense and sparse gradients alike (with every
row touched, TF's sparse rule is the dense one).
"""

from __future__ import annotations

import torch
from torch import Tensor
from typing_extensions import Unpack

from . import _multi_tensor as mt
from ._core.fused import kernel_calls
from ._core.traits import Traits
from .optimizer import LearningRate, Optimizer, OptimizerOptions, ParamsT, check_nesterov, check_number

__all__ = ["Momentum"]


def _momentum_pointwise(hyper, w, g, slots, lr, k, aux):
    """Out-of-place Momentum step (``aux``: whether weight decay applies to this tensor, or None)."""
    momentum, nesterov, wd = hyper
    if k is not None:
        g = g * k
    if wd and aux is not False:
        g = g + w * wd
    a = slots[0] * momentum + g if momentum else slots[0]
    step = (g + a * momentum if nesterov else a) if momentum else g
    return w - step * lr, [a]


class Momentum(Optimizer):
    """``tf.train.MomentumOptimizer(learning_rate, momentum, use_nesterov=False)`` (module doc).

    Args:
        params: tensors, named parameters or param groups.
        learning_rate: number, 0-d tensor, schedule or callable (required, as in TF; or torch's ``lr=``).
        momentum: ``μ >= 0`` (required, as in TF; keyword-only).
        nesterov: Nesterov momentum (torch's and Keras's name; TF1's ``use_nesterov`` is accepted for it).
        weight_decay: torch's coupled L2 (``g ← g + weight_decay·w``, default 0), honouring
            :meth:`exclude_from_weight_decay`.
        **kwargs: base options (``lr``, clipnorm, clipvalue, global_clipnorm, use_ema, ema_momentum,
            ema_overwrite_frequency, jit_compile, mesh, name): :class:`~optkit.optimizer.OptimizerOptions`.

    ``params`` and the learning rate are the only positional arguments:
    ``Momentum(params, 0.1, momentum=0.9, nesterov=True)``.

    State per parameter: ``momentum_buffer`` (torch's name, so ``torch.optim.SGD`` checkpoints load).
    """

    slot_names = ("momentum_buffer",)
    #: torch.optim.SGD's checkpoints load (their group keys are this optimizer's) with the setting this rule
    #: computes with
    _loads_torch_checkpoints = True
    _torch_required = {"dampening": 0.0}
    traits = Traits(decoupled_weight_decay=False, sparse=True, writes_grads=False)

    def __init__(self, params: ParamsT, learning_rate: LearningRate | None = None, *, momentum: float,
                 nesterov: bool = False, use_nesterov: bool | None = None, weight_decay: float = 0.0,
                 **kwargs: Unpack[OptimizerOptions]) -> None:
        check_number("momentum", momentum, low=0.0)
        nesterov = check_nesterov(nesterov, use_nesterov)
        check_number("weight_decay", weight_decay, low=0.0)
        super().__init__(params, learning_rate, weight_decay=float(weight_decay), momentum=float(momentum),
                         nesterov=nesterov, **kwargs)

    def _hyper_config(self) -> dict:
        d = self.defaults
        return {"momentum": d["momentum"], "nesterov": d["nesterov"]}

    def _pointwise_hyper(self, group: dict) -> tuple:
        return (float(group["momentum"]), bool(group["nesterov"]), float(group["weight_decay"]))

    _pointwise = staticmethod(_momentum_pointwise)

    def _prepare(self, group, plan, params, grads, lr, k) -> list | None:
        """The weight-decay mask when some parameters are excluded from the coupled decay."""
        if group["weight_decay"] and not all(plan.use_wd):
            return list(plan.use_wd)
        return None

    def _update(self, group, params, grads, slots, lr, k, found_inf, aux) -> None:
        """``aux``: the weight-decay mask (see :meth:`_prepare`) or None."""
        m, nesterov, wd = self._pointwise_hyper(group)
        lists = (params, grads, slots["momentum_buffer"])
        parts = self._fused_parts("sgd", group, lists, lr, k, found_inf, aux)
        for c in kernel_calls(parts, lr, k, wd, aux):
            p, g, b = c.lists
            torch._fused_sgd_(p, g, b if m else [], weight_decay=c.weight_decay, momentum=m, lr=c.lr,
                              dampening=0.0, nesterov=nesterov, maximize=False, is_first_step=False,
                              grad_scale=c.grad_scale, found_inf=c.found_inf)

    def _check_sparse(self, group: dict) -> None:
        if group["weight_decay"]:
            raise ValueError("Momentum: weight_decay does not combine with sparse gradients (TF's sparse "
                             "rule updates the touched rows only); use a dense gradient or weight_decay=0")

    def _sparse_update(self, group, params, grads, slots, lr, k, found_inf) -> None:
        """TF's ``SparseApplyMomentum`` on the touched rows of coalesced sparse gradients."""
        m, nesterov, _ = self._pointwise_hyper(group)
        skip = None if found_inf is None else found_inf > 0.5
        for p, g, a in zip(params, grads, slots["momentum_buffer"]):
            # μ = 0: no buffer, as the dense path (torch's rule: the buffer is left as it is)
            sparse_momentum_rows_(p, g, a if m else None, m, nesterov, lr, k, skip)


def sparse_momentum_rows_(p: Tensor, g: Tensor, a: Tensor | None, m: float, nesterov: bool, lr: Tensor,
                          k: Tensor | None, skip: Tensor | None) -> None:
    """``a[r] ← m·a[r] + g[r]``; ``w[r] ← w[r] − lr·a[r]`` (Nesterov ``w[r] − lr·g[r] − lr·m·a[r]``) on the
    rows of the coalesced sparse gradient ``g``; unchanged when ``skip`` is True. ``a`` None: no buffer,
    ``w[r] ← w[r] − lr·g[r]`` (``Momentum`` with ``μ = 0``, as torch's fused SGD kernel given no buffers;
    LARS passes its slot, which TF's rule writes for every ``μ``). Shared with LARS."""
    pl = mt.local(p)
    index = tuple(g._indices())
    vals = g._values()
    acc = mt.acc_dtype(vals.dtype)
    lr_ = lr.to(device=vals.device, dtype=acc)
    vals = vals.to(acc)
    if k is not None:
        vals = vals * k.to(device=vals.device, dtype=acc)
    if a is None:
        step = lr_ * vals
    else:
        al = mt.local(a)
        a_rows = al[index].to(acc)
        a_new = a_rows * m + vals
        step = lr_ * vals + (lr_ * m) * a_new if nesterov else lr_ * a_new
        if skip is not None:
            a_new = torch.where(skip, a_rows, a_new)
        al.index_put_(index, a_new.to(al.dtype))
    w_rows = pl[index].to(acc)
    w_new = w_rows - step
    if skip is not None:
        w_new = torch.where(skip, w_rows, w_new)
    pl.index_put_(index, w_new.to(pl.dtype))
