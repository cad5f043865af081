"""Lion, EvoLved Sign Momentum (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms",
arXiv:2302.06675, Algorithm 2; registry name ``"Lion"``).

With ``g`` the processed gradient, ``m`` the moment (slot ``exp_avg``, from 0) and ``lr`` the learning rate::

    w ← w − lr·wd·w                  (the base class's decoupled decay)
    c ← β1·m + (1 − β1)·g
    w ← w − lr·sign(c)
    m ← β2·m + (1 − β2)·g

Every element moves by ``lr``, so the paper takes a learning rate 3-10x smaller than AdamW's and a decay
3-10x larger. Arguments and defaults as timm's ``Lion``, optax's ``lion`` and Keras 3's ``Lion``.
"""

from __future__ import annotations

import torch
from typing_extensions import Unpack

from .optimizer import LearningRate, Optimizer, OptimizerOptions, ParamsT, check_number

__all__ = ["Lion"]


class Lion(Optimizer):
    """Lion (module doc for the rule), with every base option.

    Args:
        params: tensors, named parameters or param groups.
        learning_rate: number, schedule or callable (default 1e-4).
        beta1: weight of the moment in the update direction ``c``, in [0, 1) (default 0.9).
        beta2: decay of the moment ``m``, in [0, 1) (default 0.99). timm's ``betas=(b1, b2)`` is
            ``beta1=b1, beta2=b2``.
        weight_decay: decoupled decay ``w ← w − lr·wd·w`` (default 0), honouring
            :meth:`exclude_from_weight_decay`.
        **kwargs: base options (clipnorm, clipvalue, global_clipnorm, use_ema, jit_compile, mesh, ...):
            :class:`~optkit.optimizer.OptimizerOptions`.
    """

    slot_names = ("exp_avg",)
    _torch_group_keys = {"betas": ("beta1", "beta2")}  # timm's group key: refused, naming optkit's

    def __init__(self, params: ParamsT, learning_rate: LearningRate = 1e-4, *, beta1: float = 0.9,
                 beta2: float = 0.99, weight_decay: float = 0.0, **kwargs: Unpack[OptimizerOptions]) -> None:
        for name, beta in (("beta1", beta1), ("beta2", beta2)):
            check_number(name, beta, low=0.0, high=1.0)
            if beta == 1.0:
                raise ValueError(f"`{name}` must be < 1, got {beta!r}")
        super().__init__(params, learning_rate, weight_decay=weight_decay, beta1=float(beta1),
                         beta2=float(beta2), **kwargs)

    def _pointwise_hyper(self, group: dict) -> tuple:
        return (float(group["beta1"]), float(group["beta2"]))

    @staticmethod
    def _pointwise(hyper, w, g, slots, lr, k, aux):
        """One tensor, out of place: ``(new w, [new m])``; the true gradient is ``k·g``."""
        beta1, beta2 = hyper
        if k is not None:
            g = g * k
        m = slots[0]
        return w - lr * torch.sign(m * beta1 + g * (1.0 - beta1)), [m * beta2 + g * (1.0 - beta2)]
