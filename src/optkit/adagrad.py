"""Adagrad: ``tf.train.AdagradOptimizer`` (registry name ``"Adagrad"``, as in OpenSeq2Seq).

With ``g`` the processed gradient, ``t`` the number of this update (the optimizer's count, as in TF; torch
counts per parameter) and ``lr`` the current learning rate
(``torch.optim.Adagrad``, whose options it keeps)::

    g  ← g + wd·w                         (torch's coupled L2, when weight_decay is set)
    s  ← s + g²                           (s starts at initial_accumulator_value, TF default 0.1)
    w  ← w − lr/(1 + (t − 1)·lr_decay) · g / (√s + ε)

TF has neither ``lr_decay`` nor ``ε``: with the defaults (0 and 0) this is exactly TF's rule. State keeps
torch's
name ``sum``, so ``torch.optim.Adagrad`` checkpoints load. Sparse gradients update only the de-duplicated
touched
rows (TF's ``SparseApplyAdagrad`` and torch's sparse rule agree). An optkit optimizer: every base option, a
skipped step changes nothing. Implementation: torch's fused Adagrad kernel through the gate of
:mod:`optkit._core.fused`.
"""

from __future__ import annotations

import torch
from typing_extensions import Unpack

from . import _multi_tensor as mt
from ._core.fused import kernel_calls
from ._core.traits import Traits
from .optimizer import LearningRate, Optimizer, OptimizerOptions, ParamsT, check_number

__all__ = ["Adagrad"]


def _adagrad_pointwise(hyper, w, g, slots, lr, k, aux):
    """Out-of-place Adagrad step; ``aux = (t, decayed)``."""
    lr_decay, wd, eps = hyper
    t, decayed = aux
    if k is not None:
        g = g * k
    if wd and decayed:
        g = g + w * wd
    s = slots[0] + g * g
    clr = lr / (1.0 + (t - 1.0) * lr_decay)
    return w - clr * g / (s.sqrt() + eps), [s]


class Adagrad(Optimizer):
    """``tf.train.AdagradOptimizer(learning_rate, initial_accumulator_value=0.1)`` (module doc).

    Args:
        params: tensors, named parameters or param groups.
        learning_rate: number, 0-d tensor, schedule or callable (default 0.001).
        initial_accumulator_value: ``> 0`` (default 0.1, TF).
        epsilon: added to ``√s`` (default 0, TF has none).
        lr_decay: torch's learning-rate decay (default 0).
        weight_decay: torch's coupled L2 (default 0), honouring :meth:`exclude_from_weight_decay`; not with
            sparse gradients (``ValueError``, as torch).
        **kwargs: base options (``lr``, clipnorm, ..., name): :class:`~optkit.optimizer.OptimizerOptions`.

    ``params`` and the learning rate are the only positional arguments.
    """

    slot_names = ("sum",)
    traits = Traits(writes_grads=False, decoupled_weight_decay=False, sparse=True, unsigned_slots=("sum",))
    #: torch.optim.Adagrad's name for epsilon (its checkpoints load)
    _torch_group_keys = {"eps": ("epsilon",)}
    _loads_torch_checkpoints = True

    def __init__(self, params: ParamsT, learning_rate: LearningRate = 0.001, *,
                 initial_accumulator_value: float = 0.1, epsilon: float = 0.0, lr_decay: float = 0.0,
                 weight_decay: float = 0.0, **kwargs: Unpack[OptimizerOptions]) -> None:
        check_number("initial_accumulator_value", initial_accumulator_value, low=0.0, low_open=True)
        check_number("epsilon", epsilon, low=0.0)
        check_number("lr_decay", lr_decay, low=0.0)
        check_number("weight_decay", weight_decay, low=0.0)
        super().__init__(params, learning_rate, weight_decay=float(weight_decay),
                         initial_accumulator_value=float(initial_accumulator_value), epsilon=float(epsilon),
                         lr_decay=float(lr_decay), **kwargs)

    def _hyper_config(self) -> dict:
        d = self.defaults
        return {k: d[k] for k in ("initial_accumulator_value", "epsilon", "lr_decay")}

    def _slot_fill(self, slot: str, group: dict) -> float:
        return float(group["initial_accumulator_value"])

    def _pointwise_hyper(self, group: dict) -> tuple:
        return (float(group["lr_decay"]), float(group["weight_decay"]), float(group["epsilon"]))

    _pointwise = staticmethod(_adagrad_pointwise)

    def _prepare(self, group, plan, params, grads, lr, k) -> list:
        """``(t, decayed)`` per tensor: the update number (0-d float32, float64 for a group holding float64
        parameters, as the compiled rule forms ``lr/(1 + (t-1)·lr_decay)`` in it; no host sync) and the
        decay mask."""
        t = (self._iterations + 1).to(torch.float64 if self._has_fp64(group) else torch.float32)
        if plan.uniform_wd is not None:  # one shared entry: the base may then step a flat buffer at once
            return [(t, plan.uniform_wd)] * len(params)
        return [(t, d) for d in plan.use_wd]

    def _update(self, group, params, grads, slots, lr, k, found_inf, aux) -> None:
        lr_decay, wd, eps = self._pointwise_hyper(group)
        mask = [d for _, d in aux] if wd and not all(d for _, d in aux) else None
        parts = self._fused_parts("adagrad", group, (params, grads, slots["sum"]), lr, k, found_inf, aux)
        for c in kernel_calls(parts, lr, k, wd, mask, step=aux[0][0]):
            p, g, s = c.lists
            torch._fused_adagrad_(p, g, s, c.state_steps, lr=c.lr, lr_decay=lr_decay,
                                  weight_decay=c.weight_decay, eps=eps, maximize=False,
                                  grad_scale=c.grad_scale, found_inf=c.found_inf)

    def _check_sparse(self, group: dict) -> None:
        if group["weight_decay"]:
            raise ValueError("Adagrad: weight_decay does not combine with sparse gradients (as in torch); "
                             "use a dense gradient or weight_decay=0")

    def _sparse_update(self, group, params, grads, slots, lr, k, found_inf) -> None:
        """The rule on the touched rows of coalesced sparse gradients; other rows are left alone."""
        lr_decay, _, eps = self._pointwise_hyper(group)
        t = (self._iterations + 1).to(torch.float32)
        skip = None if found_inf is None else found_inf > 0.5
        for p, g, s in zip(params, grads, slots["sum"]):
            pl, sl = mt.local(p), mt.local(s)
            index = tuple(g._indices())
            vals = g._values()
            acc = mt.acc_dtype(vals.dtype)
            vals = vals.to(acc)
            if k is not None:
                vals = vals * k.to(device=vals.device, dtype=acc)
            s_rows, w_rows = sl[index].to(acc), pl[index].to(acc)
            s_new = s_rows + vals * vals
            clr = lr.to(device=vals.device, dtype=acc) / (1.0 + (t.to(vals.device, acc) - 1.0) * lr_decay)
            w_new = w_rows - clr * vals / (s_new.sqrt() + eps)
            if skip is not None:
                s_new = torch.where(skip, s_rows, s_new)
                w_new = torch.where(skip, w_rows, w_new)
            sl.index_put_(index, s_new.to(sl.dtype))
            pl.index_put_(index, w_new.to(pl.dtype))
