"""Adam and AdamW (registry names ``"Adam"``, ``"AdamW"``, as in OpenSeq2Seq).

With ``g`` the processed gradient, ``t`` the number of this update (``iterations + 1``: skipped steps do not
count; one count for the whole optimizer as in TF and Keras, where torch counts per parameter, so a parameter
added or unfrozen later gets the optimizer's ``t``) and ``lr`` the current learning rate
(``torch.optim.Adam`` / ``AdamW``)::

    Adam:   g ← g + wd·w                                   (torch's coupled L2, when weight_decay is set)
    AdamW:  w ← w − lr·wd·w                                (decoupled; OpenSeq2Seq's effective AdamW rule)
    m ← β1·m + (1 − β1)·g
    v ← β2·v + (1 − β2)·g²                                 (amsgrad: v̂max ← max(v̂max, v), used below)
    w ← w − lr/(1 − β1^t) · m / (√v / √(1 − β2^t) + ε)

TF's ``AdamOptimizer`` adds ``ε`` to ``√v`` instead of the bias-corrected root: TF's ε equals this ε·√(1 −
β2^t) (``docs/compatibility.md``). Arguments keep TF's names (``beta1``, ``beta2``, ``epsilon``); state
keeps torch's (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``), so ``torch.optim.Adam`` checkpoints load
(their group keys ``betas`` and ``eps`` become ``beta1``, ``beta2``, ``epsilon``). ``amsgrad`` is a
per-group option, as in torch.

Optkit optimizers with every base option; a skipped step changes nothing (no lazily created state, ``t`` does
not advance). Implementation: torch's fused Adam/AdamW kernel per (device, dtype) group through the gate of
:mod:`optkit._core.fused` (learning rate, unscale and global-clip factor, decay and ``found_inf`` in one
pass). Sparse gradients are densified (duplicates summed): TF's dense-equivalent rule.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import Unpack

from ._core.fused import kernel_calls
from ._core.traits import Traits
from .optimizer import LearningRate, Optimizer, OptimizerOptions, ParamsT, check_number

__all__ = ["Adam", "AdamW"]


def _adam_pointwise(hyper, w, g, slots, lr, k, aux):
    """Out-of-place Adam/AdamW step; ``aux = (t, decayed)``."""
    beta1, beta2, eps, amsgrad, wd, decoupled = hyper
    t, decayed = aux
    if k is not None:
        g = g * k
    if wd and decayed:
        if decoupled:
            w = w - w * (lr * wd)
        else:
            g = g + w * wd
    if w.dtype == torch.float64:  # bias corrections in the parameter's precision (t is a float32 count)
        t = t.to(torch.float64)
    m = slots[0] + (g - slots[0]) * (1.0 - beta1)
    v = slots[1] * beta2 + g * g * (1.0 - beta2)
    bc1 = 1.0 - torch.pow(beta1, t)
    bc2_sqrt = (1.0 - torch.pow(beta2, t)).sqrt()
    new = [m, v]
    if amsgrad:
        vmax = torch.maximum(slots[2], v)
        new.append(vmax)
        v = vmax
    denom = v.sqrt() / bc2_sqrt + eps
    return w - (lr / bc1) * m / denom, new


class Adam(Optimizer):
    """``tf.train.AdamOptimizer(learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8)`` with torch's
    rule (module doc).

    Args:
        params: tensors, named parameters or param groups.
        learning_rate, beta1, beta2, epsilon: as in TF (``0 <= beta < 1``, ``epsilon >= 0``); torch's
            ``betas=(b1, b2)`` is ``beta1=b1, beta2=b2`` and its ``eps`` is ``epsilon``.
        weight_decay: torch's coupled L2 (default 0), honouring :meth:`exclude_from_weight_decay`.
        amsgrad: keep the running maximum of ``v`` (torch's option).
        **kwargs: base options (``lr``, clipnorm, clipvalue, global_clipnorm, use_ema, ..., jit_compile, mesh,
            name): :class:`~optkit.optimizer.OptimizerOptions`.

    ``params`` and the learning rate are the only positional arguments: ``Adam(params, 3e-4)``.
    """

    traits = Traits(decoupled_weight_decay=False, writes_grads=False,
                    unsigned_slots=("exp_avg_sq", "max_exp_avg_sq"))
    _kernel_name = "adam"

    def __init__(self, params: ParamsT, learning_rate: LearningRate = 0.001, *, beta1: float = 0.9,
                 beta2: float = 0.999, epsilon: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, **kwargs: Unpack[OptimizerOptions]) -> None:
        check_number("beta1", beta1, low=0.0, high=1.0)
        check_number("beta2", beta2, low=0.0, high=1.0)
        if beta1 >= 1.0 or beta2 >= 1.0:
            raise ValueError(f"`beta1` and `beta2` must be < 1, got {beta1!r}, {beta2!r}")
        check_number("epsilon", epsilon, low=0.0)
        check_number("weight_decay", weight_decay, low=0.0)
        if not isinstance(amsgrad, bool):
            raise TypeError(f"`amsgrad` must be a bool, got {amsgrad!r}")
        self._amsgrad_default = amsgrad  # read by add_param_group, which torch's __init__ calls
        super().__init__(params, learning_rate, weight_decay=float(weight_decay), beta1=float(beta1),
                         beta2=float(beta2), epsilon=float(epsilon), amsgrad=amsgrad, **kwargs)
        self.defaults["amsgrad"] = amsgrad

    #: every slot an Adam group may keep; a group keeps ``max_exp_avg_sq`` when its ``amsgrad`` is on
    slot_names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    #: torch.optim.Adam's group keys (its checkpoints load) and the setting optkit's rule computes with
    _torch_group_keys = {"betas": ("beta1", "beta2"), "eps": ("epsilon",)}
    _loads_torch_checkpoints = True
    _torch_required = {"decoupled_weight_decay": False}

    def add_param_group(self, param_group: dict) -> None:
        """torch's, with ``amsgrad`` a per-group option (as in ``torch.optim.Adam``): a bool, default the
        constructor's."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        value = param_group.get("amsgrad", self._amsgrad_default)
        if not isinstance(value, bool):
            raise TypeError(f"param group key 'amsgrad' must be a bool, got {value!r}")
        super().add_param_group({**param_group, "amsgrad": value})

    def _active_slots(self, group: dict) -> tuple[str, ...]:
        return self.slot_names if group["amsgrad"] else self.slot_names[:2]

    @staticmethod
    def _missing_group_key(key: str, live: Any, saved_group: dict, saved_state: Any) -> Any:
        """A group saved before ``amsgrad`` was a group option (the constructor's then): on when its
        parameters' state holds ``max_exp_avg_sq``, so such a checkpoint continues with AMSGrad."""
        if key != "amsgrad" or not isinstance(saved_state, dict):
            return live
        ids = saved_group.get("params")
        if not isinstance(ids, list):
            return live
        return any(isinstance(saved_state.get(i), dict) and "max_exp_avg_sq" in saved_state[i] for i in ids
                   if isinstance(i, (int, str)))

    def _hyper_config(self) -> dict:
        d = self.defaults
        return {"beta1": d["beta1"], "beta2": d["beta2"], "epsilon": d["epsilon"], "amsgrad": self.amsgrad}

    def _pointwise_hyper(self, group: dict) -> tuple:
        return (float(group["beta1"]), float(group["beta2"]), float(group["epsilon"]), bool(group["amsgrad"]),
                float(group["weight_decay"]), self._kernel_name == "adamw")

    _pointwise = staticmethod(_adam_pointwise)

    def _prepare(self, group, plan, params, grads, lr, k) -> list:
        """``(t, decayed)`` per tensor: the update number (0-d float32, no host sync) and the decay mask."""
        t = (self._iterations + 1).to(torch.float32)
        if plan.uniform_wd is not None:  # one shared entry: the base may then step a flat buffer at once
            return [(t, plan.uniform_wd)] * len(params)
        return [(t, d) for d in plan.use_wd]

    def _update(self, group, params, grads, slots, lr, k, found_inf, aux) -> None:
        beta1, beta2, eps, amsgrad, wd, _ = self._pointwise_hyper(group)
        mask = [d for _, d in aux] if wd and not all(d for _, d in aux) else None
        lists = (params, grads) + tuple(slots[s] for s in self._active_slots(group))
        kernel = torch._fused_adamw_ if self._kernel_name == "adamw" else torch._fused_adam_
        parts = self._fused_parts("adam", group, lists, lr, k, found_inf, aux)
        for c in kernel_calls(parts, lr, k, wd, mask, step=aux[0][0]):
            p, g, m, v, *vmax = c.lists
            kernel(p, g, m, v, vmax[0] if amsgrad else [], c.state_steps, lr=c.lr, beta1=beta1, beta2=beta2,
                   weight_decay=c.weight_decay, eps=eps, amsgrad=amsgrad, maximize=False,
                   grad_scale=c.grad_scale, found_inf=c.found_inf)


class AdamW(Adam):
    """``tf.contrib.opt.AdamWOptimizer`` as used by OpenSeq2Seq: decoupled decay
    ``w ← w − lr·weight_decay·w`` before the Adam step (``torch.optim.AdamW``);
    :meth:`exclude_from_weight_decay` takes parameters out of it.

    Called as every optkit optimizer, ``params`` and then the learning rate (``AdamW(params, 3e-4)``), the
    rest keyword-only; TF's ``AdamWOptimizer(weight_decay, learning_rate, ...)`` put the decay first.
    ``weight_decay`` defaults to 0.01, ``torch.optim.AdamW``'s default (Keras 3 ``AdamW`` uses 0.004; TF
    required it): a torch user's ``AdamW(params, lr)`` decays as in torch. Other arguments as :class:`Adam`.
    """

    _kernel_name = "adamw"
    _torch_required = {"decoupled_weight_decay": True}

    def __init__(self, params: ParamsT, learning_rate: LearningRate = 0.001, *, beta1: float = 0.9,
                 beta2: float = 0.999, epsilon: float = 1e-8, weight_decay: float = 0.01,
                 amsgrad: bool = False, **kwargs: Unpack[OptimizerOptions]) -> None:
        super().__init__(params, learning_rate, beta1=beta1, beta2=beta2, epsilon=epsilon,
                         weight_decay=weight_decay, amsgrad=amsgrad, **kwargs)
