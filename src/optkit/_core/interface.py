"""The engine's interface for optkit's own layers.

Wrappers, the train op and the distributed checkpoint helpers need a few things of an optkit optimizer
beyond its torch and Keras surface: the learning rate it will use, its flat-buffer probe, a compiled
read-only pass, zeroing gradients with exceptions, its EMA buffer averages. They ask through
``opt.engine`` (an :class:`EngineInterface`), never through the optimizer's private names, so the engine's
inside can change without touching them. The step itself goes through
:meth:`optkit.Optimizer.apply_step` and its :class:`~optkit._core.context.StepContext`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["EngineInterface"]


class EngineInterface:
    """``opt.engine``: what optkit's wrappers, train op and checkpoint helpers may ask of optimizer ``opt``
    (module doc). Not needed to train."""

    __slots__ = ("_opt",)

    def __init__(self, opt: Any) -> None:
        self._opt = opt

    @property
    def any_dtensor(self) -> bool:
        """Whether a parameter is a DTensor (their ``Partial`` gradients are reduced before anything)."""
        return self._opt._any_dtensor

    def current_lr(self, group: dict, commit: bool = False, found_inf: Tensor | None = None) -> Tensor:
        """This step's learning rate of ``group`` (0-d tensor on device, times the group's ``lr_scale``);
        ``commit``: as the step takes it (a schedule's value is written into the group)."""
        return self._opt._current_lr(group, commit, found_inf)

    def refuse_inside_ema_weights(self) -> None:
        """``RuntimeError`` inside an ``ema_weights()`` block (a step there would train the averages)."""
        self._opt._refuse_inside_ema_weights()

    def zero_grad(self, set_to_none: bool, skip: Collection[int]) -> None:
        """``zero_grad(set_to_none)`` except the param groups whose ids are in ``skip`` (their flat
        gradients were zeroed by the step's pass: ``StepResult.zeroed_groups``)."""
        self._opt._zero_grad(set_to_none, skip)

    def flat_part(self, group: dict, seen: dict | None = None) -> Any:
        """The group's flat part (:class:`optkit._core.plan.FlatPart`) when this step will run over it, else
        None; what it read of the gradients goes into ``seen`` for the step (``StepContext.gathered``)."""
        return self._opt._flat_part(group, seen)

    def compiled_pass(self, fn: Callable, n_tensors: int) -> Callable | None:
        """``fn`` (a read-only pass over ``n_tensors`` tensors) compiled as the optimizer's own passes are,
        when ``jit_compile`` is on and has not failed; else None (take the eager pass)."""
        return self._opt._compiled_pass(fn, n_tensors)

    def refill_initial_slots(self, replaced: Sequence[tuple[Tensor, Tensor, dict]]) -> bool:
        """Slots built on parameters since replaced (``(old, new, group)``, e.g. by fp32 masters), built
        again on the new ones while nothing has written them; whether it did."""
        return self._opt._refill_initial_slots(replaced)

    def set_lean(self, precision: Any, state_dtype: Any) -> None:
        """Switch the optimizer to ``precision`` (None or a master-free bfloat16 format) and ``state_dtype``,
        converting the state it holds (``ValueError`` before anything changes on a bad option)."""
        self._opt._set_lean(precision, state_dtype)

    def remap_params(self, mapping: dict[int, Tensor]) -> None:
        """Parameters were replaced (``id(old) -> new``): the weight-decay exclusions by identity and the
        groups' records of names follow them."""
        opt = self._opt
        opt._wd_exclude_ids = {id(mapping[i]) if i in mapping else i for i in opt._wd_exclude_ids}
        for g in opt.param_groups:
            opt._record_group(g)

    def ema_buffer_state(self) -> dict[str, Tensor] | None:
        """The averages of the module buffers (``ema_buffers``) by name, copied; None without them."""
        pairs = self._opt._ema_buffers
        if not pairs:
            return None
        return {n: a.detach().clone() for (n, _), a in zip(pairs, self._opt._ema_buffer_avgs)}

    def check_ema_buffers(self, saved: Any) -> list[Tensor] | None:
        """The saved buffer averages checked against the live ones (``ValueError`` on a mismatch), in
        their order; None when there are none."""
        return self._opt._check_ema_buffers(saved)

    @torch.no_grad()
    def load_ema_buffers(self, values: Sequence[Tensor]) -> None:
        """Copy checked buffer averages (:meth:`check_ema_buffers`) into the live ones."""
        for a, v in zip(self._opt._ema_buffer_avgs, values):
            a.copy_(v)
