"""The step protocol as values: what a caller hands an optkit optimizer's step, and what the step reports.

``torch.amp.GradScaler`` talks to an optimizer through attributes (``opt.grad_scale``, ``opt.found_inf``) set
before ``step()``; optkit's public ``step()`` still honours them (and ``grad_multipliers``). Inside optkit,
wrappers and the train op call :meth:`optkit.Optimizer.apply_step` (or a wrapper's) with a
:class:`StepContext` instead and get a :class:`StepResult` back: nothing is set on the optimizer for the
step, and nothing is read back from it afterwards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from torch import Tensor

__all__ = ["StepContext", "StepResult"]


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What a step is given besides the gradients.

    Attributes:
        grad_scale: the loss scale ``S`` (0-d tensor): the true gradient is ``g/S``.
        found_inf: 0-d float tensor; 1 skips the step on device (nothing changes).
        multipliers: per-parameter factors of the gradient (``{id(param): 0-d tensor}``, LARC's trust
            ratios), or :class:`optkit._core.plan.RowMultipliers` over flat buffers.
        gathered: what the caller already read of the innermost optimizer's gradients this step (its
            ``whole_grads(seen)``), by param group id, so that the step does not read ``.grad`` again. Only
            valid when nothing replaced a gradient since: a step pre-hook drops it.
        zero_grads: the caller zeroes the gradients right after the step (the train op): the pass may zero
            the flat gradient chunks it reads while they are in cache, and reports the groups it zeroed.
        report_overflow: the caller's loss scale backs off: a clip norm of the scaled gradients that
            overflows float32 skips the step and is reported as an overflow (:attr:`StepResult.overflow`).
    """

    grad_scale: Tensor | None = None
    found_inf: Tensor | None = None
    multipliers: Mapping[int, Any] | None = None
    gathered: dict | None = None
    zero_grads: bool = False
    report_overflow: bool = False

    @classmethod
    def from_attributes(cls, opt: Any) -> StepContext:
        """The protocol attributes set on ``opt`` (``grad_scale`` and ``found_inf`` by
        ``torch.amp.GradScaler`` or a caller that speaks its protocol, ``grad_multipliers``)."""
        d = opt.__dict__
        return cls(d.get("grad_scale"), d.get("found_inf"), d.get("grad_multipliers"))

    def inward(self, **changes: Any) -> StepContext:
        """This context with ``changes`` (a wrapper's own scale, skip flag or multipliers) for the optimizer
        it wraps."""
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What a step reports.

    Attributes:
        applied: 0-d bool tensor, whether the update was applied (False for a skipped step); on device.
        zeroed_groups: ids of the innermost optimizer's param groups whose gradients the pass zeroed
            (:attr:`StepContext.zero_grads`).
        overflow: with :attr:`StepContext.report_overflow`, the 0-d flag of a step refused because a clip
            norm of the scaled gradients overflowed; None otherwise.
    """

    applied: Tensor | None
    zeroed_groups: frozenset[int] = frozenset()
    overflow: Tensor | None = None
