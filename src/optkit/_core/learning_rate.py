"""The learning rate: a number, a 0-d tensor, a schedule or a callable, per optimizer and per group (times
the group's ``lr_scale``), evaluated on device each step without a host sync; a float64 group gets its
schedule's float64 value."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .. import _multi_tensor as mt
from .._validation import check_number, is_number
from .plan import (
    _outside_stacklevel,
)
from .tf_surface import is_schedule


def _callable_arity(fn: Callable) -> int:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return 0
    required = [
        p
        for p in sig.parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return len(required)


class LearningRateMixin:
    """The current learning rate of each group, on device. A part of
    :class:`optkit.optimizer.Optimizer`."""

    @staticmethod
    def _validate_learning_rate(lr: Any) -> float | Tensor | None:
        """The constant learning rate (a float, or the 0-d tensor itself), or None for a schedule/callable."""
        if is_schedule(lr) or (callable(lr) and not isinstance(lr, Tensor)):
            return None
        if isinstance(lr, Tensor):
            if lr.numel() != 1 or not lr.is_floating_point():
                raise ValueError(
                    f"`learning_rate` tensor must be a floating-point scalar, got shape {tuple(lr.shape)} "
                    f"{lr.dtype}")
            check_number("learning_rate", float(lr.detach().cpu()), low=0.0)
            return lr
        if not is_number(lr):
            raise TypeError(
                "`learning_rate` must be a number, a 0-d tensor, a LearningRateSchedule or a callable, "
                f"got {lr!r} ({type(lr).__name__})"
            )
        check_number("learning_rate", lr, low=0.0)
        return float(lr)

    @property
    def learning_rate(self) -> float | Tensor | Callable:
        """The learning rate as given: a number, a 0-d tensor, a schedule or a callable."""
        return self._learning_rate

    @learning_rate.setter
    def learning_rate(self, value: Any) -> None:
        lr = self._validate_learning_rate(value)
        self._learning_rate = value if lr is None else lr
        self._lr_written.clear()  # the lr is set here, not from outside
        if lr is not None:
            self.defaults["lr"] = lr  # a group added later takes it too
            for g in self.param_groups:
                g["lr"] = lr

    def _default_lr(self) -> float | Tensor:
        """The constant learning rate now: the ``lr`` of the first group that took the optimizer's (a torch
        scheduler may have moved it), else the one given."""
        flags = getattr(self, "_lr_defaulted", None)
        if flags is None:  # pickled by an earlier optkit
            flags = [True] * len(self.param_groups)
        for flag, g in zip(flags, self.param_groups):
            if flag:
                return g["lr"]
        return self._learning_rate

    def _evaluate_lr_host(self, step: int) -> float:
        fn = self._learning_rate
        v = fn(step) if (is_schedule(fn) or _callable_arity(fn) >= 1) else fn()
        return float(v)

    def _current_lr(self, group: dict, commit: bool = False, found_inf: Tensor | None = None) -> Tensor:
        """The learning rate of this step as a 0-d fp32 tensor on the state device (fp64 when the group holds
        fp64 parameters): the group's ``lr`` (or the schedule's value) times the group's ``lr_scale`` when
        it has one (layer-wise decay, :func:`optkit.param_groups`). A group holding fp64 parameters calls a
        :class:`~optkit.schedules.LearningRateSchedule` with a float64 step tensor, so optkit's schedules
        return their float64 value (an int64 step gives float32). ``commit`` (the step itself) writes a
        schedule's value to the group's ``lr``; a skipped step (``found_inf`` 1) keeps the old tensor (a
        device-side select, no host read; see :meth:`_commit_lr`)."""
        fn = self._learning_rate
        dtype = torch.float64 if self._has_fp64(group) else torch.float32
        if isinstance(fn, (float, Tensor)):
            lr = group["lr"]
        else:
            before = group.get("lr")
            version = getattr(before, "_version", None)
            if is_schedule(fn):
                lr = fn.value(self._iterations, dtype)  # type: ignore[union-attr]
            else:
                lr = fn(self._iterations) if _callable_arity(fn) >= 1 else fn()
            if commit:
                self._check_lr_untouched(group, lr, before, version)
                self._commit_lr(group, lr, found_inf)
                written = group["lr"]
                self._lr_written[id(group)] = (written, getattr(written, "_version", None))
        scale = group.get("lr_scale", 1.0)  # layer-wise decay (optkit.param_groups)
        if isinstance(lr, Tensor) or isinstance(scale, Tensor):
            if isinstance(lr, Tensor):
                out = lr.detach().to(device=self._state_device, dtype=dtype).reshape(())
            else:
                out = mt.scalar(lr, dtype, self._state_device)
            return out if not isinstance(scale, Tensor) and scale == 1.0 else out * scale
        value = float(lr) * float(scale)
        # the same number as last step: the same tensor (a fill kernel fewer per group and step on a GPU;
        # the engine and the rules only read it)
        key = (value, dtype, self._state_device)
        hit = self._lr_scalars.get(id(group))
        if hit is not None and hit[0] == key:
            return hit[1]
        out = mt.scalar(value, dtype, self._state_device)
        out.host_value = value  # the number itself, for kernels that take a Python float (no device read)
        self._lr_scalars[id(group)] = (key, out)
        return out

    def _check_lr_untouched(self, group: dict, lr: Any, before: Any, version: int | None) -> None:
        """With a schedule or callable ``learning_rate`` the optimizer writes each step's value (``lr``) to
        the group's ``lr``; a value put there from outside since the last step (a torch lr scheduler, a
        hand-set lr) is overwritten without effect: warn once per optimizer. Host-side only: object identity
        and the tensor's version counter (``before`` and ``version``: the group's lr and its version before
        the callable ran). A tensor changed in place keeps its effect only when the callable returns that
        very tensor without writing it (TF's variable learning rate); a callable that rewrites it (a cached
        schedule value) or returns another object loses the change."""
        seen = self._lr_written.get(id(group))
        if seen is None or self._lr_override_warned:
            return
        touched = version != seen[1]
        kept = lr is before and getattr(before, "_version", None) == version
        if before is not seen[0] or (touched and not kept):
            self._lr_override_warned = True
            warnings.warn(
                f"{type(self).__name__}: learning_rate is a schedule or callable, so the optimizer sets each "
                "group's 'lr' from it every step; the 'lr' set from outside since the last step (a torch lr "
                "scheduler? it has no effect and its get_last_lr() is not the rate used) is overwritten. "
                "Give a number or a tensor as learning_rate to drive it with a scheduler.", UserWarning,
                stacklevel=_outside_stacklevel())  # the user's step() or train-op call, through any wrapper

    def _commit_lr(self, group: dict, lr: Any, found_inf: Tensor | None) -> None:
        """``group["lr"] = lr``; when ``found_inf`` is given and both values are tensors (a schedule's value
        after the first step), ``lr`` where it is 0 and the old value where it is 1. A Python number (a
        callable that returns one, or the constructor's value before the first step) is written as it is:
        choosing would need a host read of ``found_inf``."""
        old = group.get("lr")
        if found_inf is None or not isinstance(lr, Tensor) or not isinstance(old, Tensor):
            group["lr"] = lr
            return
        prev = old.detach().to(device=lr.device, dtype=lr.dtype).reshape(lr.shape)
        group["lr"] = torch.where(found_inf.to(lr.device) > 0, prev, lr)

    def _has_fp64(self, group: dict) -> bool:
        """Whether ``group`` holds float64 parameters (they get float64 hyperparameters); cached per group
        until the plans are invalidated."""
        key = (self._plan_version, len(group["params"]))
        hit = self._fp64_cache.get(id(group))
        if hit is not None and hit[0] == key:
            return hit[1]
        value = self._state_device.type in ("cpu", "cuda") and any(
            mt.local(p).dtype == torch.float64 for p in group["params"]
        )
        self._fp64_cache[id(group)] = (key, value)
        return value
