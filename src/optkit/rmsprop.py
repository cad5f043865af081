"""RMSProp: ``tf.train.RMSPropOptimizer`` (registry name ``"RMSProp"``, as in OpenSeq2Seq).

TF rule (mean square ``ms`` starts at 1, ``mom`` and ``mg`` at 0)::

    ms  ← ms + (1 − ρ)·(g² − ms)
    mg  ← mg + (1 − ρ)·(g − mg)                               (centered only)
    mom ← μ·mom + lr·g / √(ms + ε)        (centered: √(max(ms − mg², 0) + ε))
    w   ← w − mom

``torch.optim.RMSprop`` differs in three places (``ms`` starts at 0, ε is added outside the root, the learning
rate stays out of the momentum buffer), so this is optkit's own optimizer. Centered: ``ms − mg²`` is the
gradient variance and is never negative in exact arithmetic; rounding can make it so when the variance is
tiny, and TF then takes the root of a negative number (NaN weights). optkit clamps it at 0 first
(``docs/compatibility.md``).

Implementation: the rule (:func:`_rmsprop_pointwise`) is the whole optimizer; the base runs it as a chain of
foreach kernels per (device, dtype) group over cache-sized blocks (its blocked pass,
:mod:`optkit._core.derived`); float16/bfloat16 tensors are computed on float32 copies, so each stored value
is rounded once. Sparse gradients update only the de-duplicated touched rows (weights and slots), as TF's
``SparseApplyRMSProp`` does; the base's decoupled ``weight_decay`` (``w ← w − lr·wd·w`` before the update)
then decays the touched rows only (with every row touched, the dense result). Complex parameters are refused
(``TypeError``) by the base.
"""

from __future__ import annotations

import torch
from typing_extensions import Unpack

from . import _multi_tensor as mt
from ._core.traits import Traits
from .optimizer import LearningRate, Optimizer, OptimizerOptions, ParamsT, check_number

__all__ = ["RMSProp"]


def _rmsprop_pointwise(hyper, w, g, slots, lr, k, aux):
    """Out-of-place TF RMSProp step (``slots = (rms, momentum[, mg])``): the rule of every dense path (run
    over tensor lists by the base, compiled by ``jit_compile``) and of the sparse rows.

    Centered: ``ms − mg²`` is ``addcmul(ms, mg, mg, value=−1)``, which torch's CPU kernel computes as one
    fused multiply-add where the CPU has one (inductor lowers it as ``ms − mg·mg``)."""
    decay, momentum, epsilon, centered = hyper
    if k is not None:
        g = g * k
    ms = slots[0] + (g * g - slots[0]) * (1.0 - decay)
    new = [ms]
    if centered:
        mg = slots[2] + (g - slots[2]) * (1.0 - decay)
        # the variance ms − mg² is >= 0 exactly; rounding must not make its root NaN
        root = (ms.addcmul(mg, mg, value=-1.0).clamp_min(0.0) + epsilon).sqrt()
    else:
        root = (ms + epsilon).sqrt()
    mom = slots[1] * momentum + lr * g / root
    new.append(mom)
    if centered:
        new.append(mg)
    return w - mom, new


class RMSProp(Optimizer):
    """``tf.train.RMSPropOptimizer(learning_rate, decay=0.9, momentum=0.0, epsilon=1e-10, centered=False)``
    (module doc for the rule). ``params`` and the learning rate are the only positional arguments; the rest
    are keywords: ``decay`` (torch's ``alpha``, Keras's ``rho``), ``momentum``, ``epsilon``, ``centered``,
    ``weight_decay`` (the base class's decoupled decay, default None) and every base option
    (:class:`~optkit.optimizer.OptimizerOptions`).

    State per parameter: ``rms`` (starts at 1), ``momentum`` and, centered, ``mg`` (TF's slot names).
    """

    traits = Traits(blocks="always", writes_grads=False, sparse=True, unsigned_slots=("rms",))
    #: every slot a group may keep; a group keeps ``mg`` when its ``centered`` is on
    slot_names = ("rms", "momentum", "mg")
    #: torch.optim.RMSprop's names of these hyperparameters (its rule differs): refused in a param group
    _torch_group_keys = {"eps": ("epsilon",), "alpha": ("decay",)}

    def __init__(self, params: ParamsT, learning_rate: LearningRate = 0.001, *, decay: float = 0.9,
                 momentum: float = 0.0, epsilon: float = 1e-10, centered: bool = False,
                 weight_decay: float | None = None, **kwargs: Unpack[OptimizerOptions]) -> None:
        check_number("decay", decay, low=0.0, high=1.0)
        check_number("momentum", momentum, low=0.0)
        check_number("epsilon", epsilon, low=0.0)
        if not isinstance(centered, bool):
            raise TypeError(f"`centered` must be a bool, got {centered!r}")
        super().__init__(params, learning_rate, weight_decay=weight_decay, decay=float(decay),
                         momentum=float(momentum), epsilon=float(epsilon), centered=centered, **kwargs)

    def _active_slots(self, group: dict) -> tuple[str, ...]:
        return self.slot_names if group["centered"] else self.slot_names[:2]

    def _slot_fill(self, slot: str, group: dict) -> float:
        return 1.0 if slot == "rms" else 0.0

    def _hyper_config(self) -> dict:
        d = self.defaults
        return {key: d[key] for key in ("decay", "momentum", "epsilon", "centered")}

    def _pointwise_hyper(self, group: dict) -> tuple:
        return (group["decay"], group["momentum"], group["epsilon"], group["centered"])

    _pointwise = staticmethod(_rmsprop_pointwise)

    def _sparse_update(self, group, params, grads, slots, lr, k, found_inf) -> None:
        """TF's ``SparseApplyRMSProp`` / ``SparseApplyCenteredRMSProp``: the rule on the touched rows of
        coalesced sparse gradients; other rows keep their weights and slots. The base's decoupled
        ``weight_decay`` applies to the touched rows as the dense rule applies it to every row,
        ``w[r] ← w[r] − lr·wd·w[r]`` before the update (honouring :meth:`exclude_from_weight_decay`), as the
        decoupled decay of TF Addons (``DecoupledWeightDecayExtension``) treats ``IndexedSlices``."""
        hyper = self._pointwise_hyper(group)
        skip = None if found_inf is None else found_inf > 0.5
        names = self._active_slots(group)
        wd = float(group.get("weight_decay", 0.0))
        decayed = self._sparse_decayed(group, params) if wd else [False] * len(params)
        for i, (p, g) in enumerate(zip(params, grads)):
            targets = [mt.local(p)] + [mt.local(slots[s][i]) for s in names]
            index = tuple(g._indices())
            acc = mt.acc_dtype(g.dtype)
            rows = [t[index].to(acc) for t in targets]
            kk = None if k is None else k.to(device=g.device, dtype=acc)
            lr_ = lr.to(device=g.device, dtype=acc)
            w_rows = rows[0] * (1.0 - lr_ * wd) if decayed[i] else rows[0]
            w_new, new_slots = _rmsprop_pointwise(hyper, w_rows, g._values().to(acc), rows[1:], lr_, kk, None)
            for t, old, new in zip(targets, rows, [w_new, *new_slots]):
                if skip is not None:
                    new = torch.where(skip.to(t.device), old, new)
                t.index_put_(index, new.to(t.dtype))

    def _sparse_decayed(self, group: dict, params: list) -> list[bool]:
        """Per sparse-updated parameter, whether the decoupled decay applies to it (the dense path's mask,
        :meth:`exclude_from_weight_decay`; names are looked up only when an exclusion exists)."""
        if not self._wd_exclude_ids and self._wd_exclude_regex is None:
            return [True] * len(params)
        name_of = dict(zip(map(id, group["params"]), group["param_names"]))
        return [self._use_weight_decay(p, name_of.get(id(p), "")) for p in params]
