"""FTRL-proximal (``tf.compat.v1.train.FtrlOptimizer``; registry name ``"Ftrl"``, as in OpenSeq2Seq).

Per element, with ``p = −learning_rate_power`` (TF's ``ApplyFtrlV2`` as documented; McMahan et al., "Ad Click
Prediction: a View from the Trenches", KDD 2013, Algorithm 1)::

    g_s       = g + 2·l2_shrinkage·w
    n_new     = n + g²
    σ         = (n_new^p − n^p) / lr
    z         ← z + g_s − σ·w
    quadratic = n_new^p / lr + 2·l2 + beta/lr            (beta/(2·lr) is added to l2, as TF 2's ``beta``)
    w         ← (sign(z)·l1 − z) / quadratic   if |z| > l1,   else 0
    n         ← n_new

Slots: ``accum`` (``n``, initialised to ``initial_accumulator_value``) and ``linear`` (``z``, zeros). A zero
learning rate (the first step of a warm-up) leaves weights and slots unchanged; TF writes NaN (``0/0`` in
``σ``). TF 1 defaults: ``learning_rate_power=-0.5``, ``initial_accumulator_value=0.1``, all regularisation
0. Sparse gradients update only their (de-duplicated) rows, as TF's ``SparseApplyFtrlV2`` does.

The rule (:func:`_ftrl_pointwise`) runs as grouped foreach kernels over cache-sized blocks (the base's
blocked pass, :mod:`optkit._core.derived`); the soft threshold is written ``−sign(z)·max(|z| − l1, 0) /
quadratic``, which equals the TF form exactly.
"""

from __future__ import annotations

import torch
from typing_extensions import Unpack

from . import _multi_tensor as mt
from ._core.traits import Traits
from .optimizer import LearningRate, Optimizer, OptimizerOptions, ParamsT, check_number

__all__ = ["Ftrl"]


def _ftrl_pointwise(hyper, w, g, slots, lr, k, aux):
    """Out-of-place FTRL-proximal step: the rule of every dense path (run over tensor lists by the base,
    compiled by ``jit_compile``) and of the sparse rows. ``n + g²`` and ``z + g_s − σ·w`` are written with
    ``addcmul`` and ``g + 2·l2_shrinkage·w`` with ``add(..., alpha=)``, which torch's CPU kernels compute
    with fused multiply-adds where the CPU has them (inductor lowers them as plain products and sums)."""
    lr_power, l1, l2, l2_shrinkage, beta = hyper
    accum, linear = slots
    if k is not None:
        g = g * k
    g_s = g.add(w, alpha=2.0 * l2_shrinkage) if l2_shrinkage else g
    accum_new = accum.addcmul(g, g)
    if lr_power == -0.5:
        p_new, p_old = accum_new.sqrt(), accum.sqrt()
    else:
        p_new, p_old = accum_new.pow(-lr_power), accum.pow(-lr_power)
    linear_new = (linear + g_s).addcmul((p_new - p_old) / lr, w, value=-1.0)
    quadratic = p_new / lr + (2.0 * l2 + beta / lr)
    shrunk = (linear_new.abs() - l1).clamp_min(0.0)
    w_new = -(linear_new.sign() * shrunk) / quadratic
    idle = lr == 0  # a zero learning rate (warm-up step 0) changes nothing instead of writing NaN
    return (torch.where(idle, w, w_new),
            [torch.where(idle, accum, accum_new), torch.where(idle, linear, linear_new)])


class Ftrl(Optimizer):
    """FTRL-proximal with TF1 semantics and defaults.

    Args:
        params: tensors, named parameters or param groups.
        learning_rate: number, schedule or callable (> 0 when used).
        learning_rate_power: ``<= 0`` (default −0.5; 0 gives a fixed learning rate).
        initial_accumulator_value: ``>= 0`` (default 0.1), the starting value of the ``accum`` slot.
        l1_regularization_strength, l2_regularization_strength: ``>= 0`` (default 0).
        l2_shrinkage_regularization_strength: ``>= 0`` (default 0): an L2 term added to the gradient of the
            linear term only (magnitude penalty, not in the accumulator).
        beta: ``>= 0`` (default 0), adds ``beta/(2·lr)`` to the L2 strength (TF 2's argument).
        weight_decay: the base class's decoupled decay (default None).
        **kwargs: base options (``lr``, clipnorm, clipvalue, global_clipnorm, use_ema, ...):
            :class:`~optkit.optimizer.OptimizerOptions`.

    ``params`` and the learning rate are the only positional arguments.
    """

    slot_names = ("accum", "linear")
    traits = Traits(blocks="always", writes_grads=False, sparse=True, unsigned_slots=("accum",),
                    exact_slots=("linear",))

    def __init__(
        self,
        params: ParamsT,
        learning_rate: LearningRate = 0.001,
        *,
        learning_rate_power: float = -0.5,
        initial_accumulator_value: float = 0.1,
        l1_regularization_strength: float = 0.0,
        l2_regularization_strength: float = 0.0,
        l2_shrinkage_regularization_strength: float = 0.0,
        beta: float = 0.0,
        weight_decay: float | None = None,
        **kwargs: Unpack[OptimizerOptions],
    ) -> None:
        check_number("learning_rate_power", learning_rate_power, high=0.0)
        check_number("initial_accumulator_value", initial_accumulator_value, low=0.0)
        check_number("l1_regularization_strength", l1_regularization_strength, low=0.0)
        check_number("l2_regularization_strength", l2_regularization_strength, low=0.0)
        check_number("l2_shrinkage_regularization_strength", l2_shrinkage_regularization_strength, low=0.0)
        check_number("beta", beta, low=0.0)
        super().__init__(
            params, learning_rate,
            weight_decay=weight_decay,
            learning_rate_power=float(learning_rate_power),
            initial_accumulator_value=float(initial_accumulator_value),
            l1_regularization_strength=float(l1_regularization_strength),
            l2_regularization_strength=float(l2_regularization_strength),
            l2_shrinkage_regularization_strength=float(l2_shrinkage_regularization_strength),
            beta=float(beta),
            **kwargs,
        )

    _KEYS = ("learning_rate_power", "initial_accumulator_value", "l1_regularization_strength",
             "l2_regularization_strength", "l2_shrinkage_regularization_strength", "beta")

    def _hyper_config(self) -> dict:
        return {key: self.defaults[key] for key in self._KEYS}

    def _slot_fill(self, slot: str, group: dict) -> float:
        return float(group["initial_accumulator_value"]) if slot == "accum" else 0.0

    def _pointwise_hyper(self, group: dict) -> tuple:
        return (group["learning_rate_power"], group["l1_regularization_strength"],
                group["l2_regularization_strength"], group["l2_shrinkage_regularization_strength"],
                group["beta"])

    _pointwise = staticmethod(_ftrl_pointwise)

    def _sparse_update(self, group, params, grads, slots, lr, k, found_inf) -> None:
        """The same rule on the touched rows of coalesced sparse gradients; other rows are left alone."""
        hyper = self._pointwise_hyper(group)
        skip = None if found_inf is None else found_inf > 0.5
        for p, g, n, z in zip(params, grads, slots["accum"], slots["linear"]):
            pl, nl, zl = mt.local(p), mt.local(n), mt.local(z)
            index = tuple(g._indices())
            vals = g._values()
            lr_ = lr.to(device=vals.device, dtype=mt.acc_dtype(vals.dtype))
            kk = None if k is None else k.to(vals.device)
            rows = [pl[index], nl[index], zl[index]]
            w_new, (n_new, z_new) = _ftrl_pointwise(hyper, rows[0], vals, rows[1:], lr_, kk, None)
            for t, old, new in zip((pl, nl, zl), rows, (w_new, n_new, z_new)):
                new = new.to(t.dtype)
                t.index_put_(index, new if skip is None else torch.where(skip.to(t.device), old, new))
