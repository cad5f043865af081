"""Construction of the train op (:func:`optkit.train.optimize_loss`, :class:`optkit.train.TrainOp`).

The resolution of ``optimize_loss``'s arguments into the objects it builds from (the optimizer class, the loss
scaler, the named parameters, LARC's settings; each raises ``ValueError``/``TypeError`` naming the argument
before anything is built), and the wiring of a new train op (:class:`TrainOpBuild`, a mixin of
:class:`~optkit.train.TrainOp`): its optimizer stack ``MixedPrecisionOptimizerWrapper(LARC(cls(params)))``
with the parts not asked for left out, the fp32 masters and the regularizers diverted to them, and its
distribution (DDP, FSDP2, ``on_horovod``, pipeline stages).
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from . import _multi_tensor as mt
from ._validation import check_params
from ._wrapper import OptimizerWrapper, protocol_level
from .larc import LARC
from .loss_scale import AutomaticLossScaler, DynamicLossScale, FixedLossScale, LossScale
from .mixed_precision import MixedPrecisionOptimizerWrapper
from .optimizer import Optimizer as _OptkitOptimizer
from .regularization import _entries

__all__ = ["TrainOpBuild", "build_scaler", "check_positive", "larc_settings", "named_params",
           "optimizer_chain", "resolve_optimizer"]

_LARC_REQUIRED = {"larc_eta": float}
_LARC_OPTIONAL = {"larc_mode": ["clip", "scale"], "min_update": float, "epsilon": float}
_DYNAMIC_OPTIONAL = {
    "initial_loss_scale": (int, float),
    "increment_period": int,
    "multiplier": (int, float),
    "hysteresis": int,
    "min_loss_scale": (int, float),
    "max_loss_scale": (int, float, type(None)),
}


def resolve_optimizer(optimizer: Any) -> Callable[..., torch.optim.Optimizer]:
    if isinstance(optimizer, str):
        from .registry import get_optimizer

        return get_optimizer(optimizer)  # ValueError listing the valid names
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("`optimizer` must be a registry name or an optimizer class, not an instance")
    if isinstance(optimizer, type) or callable(optimizer):
        return optimizer
    raise TypeError(f"`optimizer` must be a registry name or an optimizer class, got {optimizer!r}")


def build_scaler(loss_scaling: Any, params: Mapping[str, Any] | None) -> LossScale:
    if params is not None and not isinstance(params, Mapping):
        raise TypeError(f"`loss_scaling_params` must be a dict of the scaler's parameters or None, got "
                        f"{type(params).__name__}")
    if isinstance(loss_scaling, LossScale):
        if params is not None:
            raise ValueError("`loss_scaling_params` cannot be given with a LossScale object")
        return loss_scaling
    if isinstance(loss_scaling, bool):
        raise TypeError(f"`loss_scaling` must be a number or an algorithm name, got {loss_scaling!r}")
    if isinstance(loss_scaling, numbers.Real):
        if params is not None:
            raise ValueError("`loss_scaling_params` only applies to automatic loss scaling (a string)")
        return FixedLossScale(float(loss_scaling))
    if isinstance(loss_scaling, str):
        name = loss_scaling.strip().lower()
        if name == "dynamic":
            check_params(params, None, _DYNAMIC_OPTIONAL, where="loss_scaling_params")
            return DynamicLossScale(**dict(params or {}))
        if name in AutomaticLossScaler.SUPPORTED_ALGOS:
            return AutomaticLossScaler(name, None if params is None else dict(params))
        raise ValueError(
            f"`loss_scaling` must be a float, 'Backoff', 'LogMax' or 'dynamic', got {loss_scaling!r}"
        )
    raise TypeError(f"`loss_scaling` must be a number or an algorithm name, got {loss_scaling!r}")


def named_params(var_list: Any, model: Any, loss: Any) -> list[tuple[str, Tensor]]:
    if var_list is not None:
        if isinstance(var_list, Tensor):
            raise TypeError("`var_list` must be a list of parameters, not a single Tensor")
        items = list(var_list)
        out = []
        for i, item in enumerate(items):
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], Tensor):
                out.append((str(item[0]), item[1]))
            elif isinstance(item, Tensor):
                out.append((f"var_{i}", item))
            else:
                raise TypeError(f"`var_list` entries must be tensors or (name, tensor) pairs, got {item!r}")
    else:
        source = model if isinstance(model, nn.Module) else loss if isinstance(loss, nn.Module) else None
        if source is None:
            raise ValueError("`var_list` is required unless `model` (or `loss`) is an nn.Module")
        if isinstance(source, nn.parallel.DistributedDataParallel):
            source = source.module
        out = [(n, p) for n, p in source.named_parameters() if p.requires_grad]
    if not out:
        raise ValueError("`var_list` is empty: nothing to optimize")
    seen = set()
    for name, p in out:
        if not p.is_leaf:
            raise ValueError(f"`var_list`: {name!r} is not a leaf tensor")
        if not p.is_floating_point():
            raise TypeError(f"`var_list`: {name!r} is not floating point ({p.dtype})")
        if id(p) in seen:
            raise ValueError(f"`var_list`: {name!r} is listed twice")
        seen.add(id(p))
    return out


def check_positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a positive float, got {value!r}")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"`{name}` must be a finite number > 0, got {value!r}")
    return float(value)


def _accepts(cls: Any, kw: str) -> bool:
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        return False
    return kw in sig.parameters or any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())


def larc_settings(larc_params: Mapping[str, Any]) -> dict[str, Any]:
    """``larc_params`` checked (``larc_eta`` required; ``larc_mode``, ``min_update``, ``epsilon``), with the
    defaults filled in: the keyword arguments of :class:`~optkit.LARC`."""
    check_params(larc_params, _LARC_REQUIRED, _LARC_OPTIONAL, where="larc_params")
    return {"larc_eta": float(larc_params["larc_eta"]), "larc_mode": larc_params.get("larc_mode", "clip"),
            "min_update": float(larc_params.get("min_update", 1e-7)),
            "epsilon": float(larc_params.get("epsilon", 1e-7))}


def optimizer_chain(opt: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """``[opt, its inner optimizer, ...]`` down to the innermost one."""
    out = [opt]
    while isinstance(out[-1], OptimizerWrapper):
        out.append(out[-1].optimizer)
    return out


class TrainOpBuild:
    """The wiring of a new :class:`~optkit.train.TrainOp` (called once, from its ``__init__``)."""

    def _build_stack(self, cls, opt_kwargs, larc, dtype, groups) -> None:
        """The optimizer stack (``optimizer``, ``base_optimizer`` and the wrappers in it), the masters and
        the regularizers diverted to them, from ``optimize_loss``'s resolved arguments."""
        # the optimizer stack: [MixedPrecisionOptimizerWrapper(] [LARC(] cls(...) [)] [)]
        self._optkit = isinstance(cls, type) and issubclass(cls, _OptkitOptimizer)
        key = "learning_rate" if self._optkit or _accepts(cls, "learning_rate") else "lr"
        lr0 = self._current_lr if self._optkit else float(self._lr_now)
        if self._optkit:  # this op clears the gradients after every update: the step may use them as scratch
            opt_kwargs = {"scratch_grads": True, **opt_kwargs}

        def build(ps: list) -> torch.optim.Optimizer:
            if groups is not None:  # param groups by name (optkit.create_optimizer's construction)
                from .param_rules import build_optimizer

                opt = build_optimizer(cls, ps, lr0, **opt_kwargs)
            else:
                opt = cls(ps, **{key: lr0}, **opt_kwargs)
            return opt if larc is None else LARC(opt, **larc)

        opt_params: list = list(zip(self.names, self.params)) if self._optkit else list(self.params)
        if groups is not None:
            opt_params = list(groups)
        if dtype == "mixed":
            self.optimizer = MixedPrecisionOptimizerWrapper.wrap(build, opt_params, loss_scale=None)
        else:
            self.optimizer = build(opt_params)
        self._mp = self.optimizer if isinstance(self.optimizer, MixedPrecisionOptimizerWrapper) else None
        self._larc = next((o for o in optimizer_chain(self.optimizer) if isinstance(o, LARC)), None)
        self.base_optimizer = optimizer_chain(self.optimizer)[-1]
        self._optkit_inst = isinstance(self.base_optimizer, _OptkitOptimizer)
        self._zeroed: frozenset[int] = frozenset()  # groups whose flat gradients the last update zeroed
        self._params_key: tuple[tuple[int, int], ...] | None = None  # (see _match_params)
        self._masters_are_params = False
        self._group_params: list[Tensor] = []
        self._group_idx: list[int] = []
        self._level = protocol_level(self.optimizer)

        # masters ("mixed"): the wrapper's fp32 copies of the half parameters
        master_of: dict[int, Tensor] = {}
        if self._mp is not None:
            master_of = {id(p): m for p, m in zip(self._mp.model_params, self._mp.master_params)}
        self.masters = [master_of.get(id(p), p) for p in self.params]
        self._half_idx = [i for i, p in enumerate(self.params) if id(p) in master_of]
        self._name_of = {id(q): n for n, q in zip(self.names, self.masters)}
        half_params = [self.params[i] for i in self._half_idx]
        #: (half parameter, regularizer entry) registered now: their gradient is added on the masters
        self._diverted = _entries(half_params)
        self._diverted_masters = [master_of[id(p)] for p, _ in self._diverted]
        self._diverted_ids = frozenset(id(e) for _, e in self._diverted)  # left out of its loss call

    def _build_distribution(self, model, on_horovod, process_group, bucket_numel, pipeline_group, iter_size,
                            skip_update_ph, logger) -> None:
        """How the gradients are reduced: by DDP, by FSDP2, by the train op's own all-reduce
        (``on_horovod``, or DDP with ``"mixed"`` accumulation) or not at all; and the pipeline stages'
        group."""
        # distribution. DTensor (FSDP2) parameters: FSDP2's post-backward hooks reduce-scatter and average
        # the gradients, so they need a plain backward() and no second reduction.
        ddp = model if isinstance(model, nn.parallel.DistributedDataParallel) else None
        self._ddp = ddp
        self._dtensor = any(mt.is_dtensor(p) for p in self.params)
        self._plain_backward = ddp is not None or self._dtensor
        self._frozen: list[Tensor] = []
        # FSDP2's no_sync(): accumulate unsharded gradients, reduce-scatter once on the update micro-step
        self._fsdp_sync = getattr(model, "set_requires_gradient_sync", None) if self._dtensor else None
        if self._dtensor and isinstance(model, nn.Module):
            ids = {id(p) for p in self.params}
            self._frozen = [p for p in model.parameters() if p.requires_grad and id(p) not in ids]
        # DDP + "mixed" + accumulation: accumulate_grads moves every micro-batch's half gradients into the
        # fp32 window sums, so DDP's reduction (of the last micro-batch's .grad) would miss the earlier ones.
        # DDP then stays in no_sync() throughout and the fp32 sums are reduced once per update over its group.
        self._ddp_own = (ddp is not None and self._mp is not None
                         and (iter_size > 1 or skip_update_ph is not None))
        self._group = ddp.process_group if self._ddp_own else process_group
        self._world = 1
        self._reduce = (on_horovod and ddp is None and not all(mt.is_dtensor(p) for p in self.params)) \
            or self._ddp_own
        if self._reduce:
            import torch.distributed as dist

            self._reduce = dist.get_world_size(self._group) > 1
            if self._reduce and not self._dtensor:  # the 1/W of the average is folded into grad_scale
                self._world = dist.get_world_size(self._group)
        self._bucket_numel = bucket_numel
        self._pp = mt._UNSET if pipeline_group is None else pipeline_group
        # every rank must take the same summary decisions when they need collectives (writer on rank 0 only)
        logger.collective = self._dtensor or (mt._pp(self._pp) is not None)
