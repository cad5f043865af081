"""``LossScaleOptimizer``: loss scaling around any optimizer (TF1
``tf.train.experimental.MixedPrecisionLossScaleOptimizer``, ``tensorflow/python/training/experimental/``).

Loss scaling multiplies the loss by ``S`` before ``backward`` and divides every gradient by ``S``; with a
dynamic scale a step whose gradients hold a NaN or an inf is skipped and ``S`` shrinks (the rules live in
:mod:`optkit.loss_scale`). One step, with ``S`` the scale the gradients carry::

    found_inf = any(!isfinite(g))                  # one pass (max|g| for LogMax)
    skip = scaler.skip_flag(found_inf)             # not would_apply: found_inf (a fixed scale: 0)
    inner step with grad_scale = S, found_inf = skip
    scaler.update(found_inf)                       # the state machine; S changes for the NEXT backward

When the inner optimizer takes ``grad_scale``/``found_inf`` (optkit optimizers, other optkit wrappers, torch
fused optimizers) the unscale and the skip are folded into its own pass: one extra read of the gradients and
no host sync. Any other optimizer gets the gradients unscaled in place with the fused non-finite check and
the skip decided by one host read of ``found_inf`` per step (see :mod:`optkit._wrapper`). A skipped step
changes no parameter and no optimizer state: ``iterations`` does not advance, so a learning-rate schedule
driven by ``iterations`` does not tick either. ``step_applied`` (0-d bool) reports the outcome.

Two ways to train:

* ``opt.scale_loss(loss).backward(); opt.step(); opt.zero_grad()`` — gradients carry ``S``;
* ``opt.step(closure)`` — the closure computes and **returns the unscaled loss without calling
  backward** (zero the gradients inside it as usual); the wrapper calls ``(loss·S).backward()`` and steps.
  ``step`` returns the unscaled loss.

Stacking: wrappers see the gradients as their outer wrapper hands them on, so put ``LossScaleOptimizer``
outside gradient-processing wrappers such as ``LARC`` (``LossScaleOptimizer(LARC(opt))``): LARC then
receives ``grad_scale`` and computes its trust ratios on the unscaled gradients.

TF1 surface: ``compute_gradients`` returns **unscaled** gradients, ``apply_gradients`` takes unscaled
gradients (TF1 and tf.keras 2 semantics, not Keras 3's scaled ones), ``minimize`` combines them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from . import _multi_tensor as mt
from ._core.context import StepContext, StepResult
from ._gc import gc_paused
from ._wrapper import (
    OptimizerWrapper,
    ScaledGradsFlag,
    _autograd_pairs,
    _check_pairs,
    may_hold_dtensors,
    protocol_level,
    refuse_inside_ema_weights,
)
from .loss_scale import FixedLossScale, LossScale, get_loss_scale

__all__ = ["LossScaleOptimizer", "MixedPrecisionLossScaleOptimizer"]


def _checks(scaler: LossScale) -> bool:
    return bool(scaler.dynamic or getattr(scaler, "skip_non_finite", False) or scaler.needs_amax)


def _times(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    if a is None:
        return b
    if b is None:
        return a
    # (an outer float64 scale, a float64 train op's window divisor, stays float64)
    return a * b.to(a.device, torch.float64 if b.dtype == torch.float64 else torch.float32).reshape(())


def loss_scaled_step(
    wrapper: OptimizerWrapper,
    scaler: LossScale,
    check_grads: Sequence[Tensor],
    scale: Tensor | None,
    context: StepContext,
    step_grads: Sequence[Tensor] | None = None,
    gathered: dict | None = None,
) -> StepResult:
    """Check, update the scaler and step ``wrapper.optimizer`` (the algorithm of the module doc).

    ``check_grads``: the gradients to check (they carry ``scale·outer_scale``); ``scale``: the loss scale the
    gradients carry, ``None`` when they are already unscaled; ``step_grads``: the gradients the inner
    optimizer will read (default ``check_grads``; they differ for fp32 master gradients), unscaled in place
    when the inner optimizer cannot take ``grad_scale``; ``gathered``: what the innermost optimizer's
    ``whole_grads`` read for ``check_grads``, handed to its step (``StepContext.gathered``); ``context``: the
    outer caller's (its loss scale multiplies the wrapper's). Returns the step's result.
    """
    outer_scale, outer_found = context.grad_scale, context.found_inf
    step_grads = check_grads if step_grads is None else step_grads
    unscaled = False  # whether step_grads were unscaled in place (undone if the inner step raises)
    dev = wrapper._device()
    total = _times(scale, outer_scale)
    check = _checks(scaler)
    level = protocol_level(wrapper.optimizer)
    amax = None
    if level in ("full", "amp"):
        found = None
        if scaler.needs_amax:
            raw = mt.max_abs(check_grads).to(dev)
            found = (~torch.isfinite(raw)).to(torch.float32)
            amax = raw if total is None else raw / total.to(dev)
        elif check:
            found = mt.any_non_finite(check_grads).to(dev)
        grad_scale = total
    else:
        found = torch.zeros((), dtype=torch.float32, device=dev)
        if total is not None:
            inv = mt.inverse_scale(total, step_grads, dev)  # (float64 for float64 gradients)
            mt.non_finite_check_and_unscale_(step_grads, found, inv)
            unscaled = True
        elif check:
            found = mt.any_non_finite(step_grads).to(dev)
        if scaler.needs_amax:
            amax = mt.max_abs(step_grads).to(dev)
        grad_scale = None
    skip = outer_found
    if check:
        skip = _max(skip, scaler.skip_flag(found, amax).to(dev))
    # an innermost optkit optimizer may refuse the step by itself when a clip norm of the scaled gradients
    # overflows float32 (the scale is too large): it reports that as the result's overflow, counted here so
    # that a scale that can back off does (a fixed scale cannot: not asked, as before)
    backs_off = check and not isinstance(scaler, FixedLossScale)
    try:
        inner = context.inward(grad_scale=grad_scale, found_inf=skip, gathered=gathered or None,
                               report_overflow=backs_off or context.report_overflow)
        result = wrapper._delegate(inner)
    except BaseException:
        if unscaled:  # the gradients carry the scale again, so a retried step unscales them once, as
            # GradScaler's does (exact for the power-of-two scales of a dynamic scaler)
            mt.scale_(list(step_grads), total.to(device=dev))
        raise
    if check:  # after the inner step: a step that raises (bad input) leaves the scale as it was
        probe = result.overflow if backs_off else None
        if probe is not None:
            found = torch.maximum(found, probe.to(found.device)) if found is not None else probe
        scaler.update(found, amax)
    return result


_UNSCALED_HELP = (
    "Call opt.scale_loss(loss).backward() before step(), or step(closure) with a closure that returns the "
    "loss without calling backward; if you scaled the loss by opt.loss_scale yourself, set "
    "opt.grads_scaled = True. Training frameworks (Lightning, the Hugging Face Trainer) call backward "
    "themselves: use their mixed precision (precision='16-mixed', fp16=True), which drives any optkit "
    "optimizer through torch.amp.GradScaler, instead of a loss-scale wrapper."
)


def scaled_backward_step(wrapper: Any, closure: Callable[[], Any] | None) -> Any:
    """``step(closure)`` of a loss-scale wrapper, which divides the gradients by ``S``: they must come from
    ``loss·S``. A closure's loss is back-propagated as ``loss·S``; without a closure, ``scale_loss`` must have
    been called since the last step (``grads_scaled``). Gradients from an unscaled backward, the pattern of
    training frameworks, would be divided by ``S`` and training would stall silently: ``RuntimeError``.
    Which gradients count is the wrapper's ``_unscaled_grads_present()`` (the model's, not fp32 masters').
    With no gradient at all there is nothing to divide: the step is a no-op as in ``torch.optim`` (the
    wrapper's ``_wrapped_step`` leaves the parameters, the inner state, ``iterations`` and the scale alone
    and sets ``step_applied`` to False)."""
    refuse_inside_ema_weights(wrapper)
    loss = None
    scaler = wrapper.loss_scaler
    matters = not (isinstance(scaler, FixedLossScale) and scaler.loss_scale_value == 1)
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
            if isinstance(loss, Tensor) and loss.requires_grad:
                wrapper.scale_loss(loss).backward()
                if matters and getattr(wrapper, "_unscaled_fold", False):  # (the closure did not clear it)
                    raise RuntimeError(
                        f"{type(wrapper).__name__}.step(closure): gradients folded with accumulate_grads "
                        "before it did not come from scale_loss(loss) (loss·S); dividing them by the loss "
                        f"scale would stall training. {_UNSCALED_HELP}")
            elif matters and not wrapper.grads_scaled and wrapper._unscaled_grads_present():
                raise RuntimeError(
                    f"{type(wrapper).__name__}.step(closure): the closure returned a loss that does not "
                    "require grad, so it back-propagated by itself, unscaled; dividing those gradients by "
                    f"the loss scale would stall training. {_UNSCALED_HELP}")
    else:
        _check_scaled(wrapper, matters)
    _scaled_step(wrapper, StepContext.from_attributes(wrapper))
    return loss


def scaled_apply_step(wrapper: Any, context: StepContext) -> StepResult:
    """``apply_step(context)`` of a loss-scale wrapper: :func:`scaled_backward_step` without a closure, under
    the caller's context."""
    refuse_inside_ema_weights(wrapper)
    scaler = wrapper.loss_scaler
    _check_scaled(wrapper, not (isinstance(scaler, FixedLossScale) and scaler.loss_scale_value == 1))
    return _scaled_step(wrapper, context)


def _check_scaled(wrapper: Any, matters: bool) -> None:
    """``RuntimeError`` when the loss scale ``matters`` and the gradients did not come from ``loss·S``."""
    if matters and (getattr(wrapper, "_unscaled_fold", False)
                    or (not wrapper.grads_scaled and wrapper._unscaled_grads_present())):
        # (_unscaled_fold: a micro-batch of the window was folded unscaled, whatever the later ones were)
        raise RuntimeError(
            f"{type(wrapper).__name__}.step(): the gradients did not come from scale_loss(loss) (loss·S); "
            f"dividing them by the loss scale would stall training. {_UNSCALED_HELP}")


def _scaled_step(wrapper: Any, context: StepContext) -> StepResult:
    if may_hold_dtensors(wrapper):  # before the non-finite check reads them
        mt.reduce_partial_grads_(wrapper._all_params())
    with gc_paused(sum(len(g["params"]) for g in wrapper.param_groups)):
        result = wrapper._wrapped_step(context)
    wrapper.grads_scaled = False
    return result


def _max(a: Tensor | None, b: Tensor) -> Tensor:
    if a is None:
        return b
    return torch.maximum(a.detach().to(b.device, torch.float32).reshape(()), b)


class LossScaleOptimizer(ScaledGradsFlag, OptimizerWrapper):
    """Loss scaling around any ``torch.optim.Optimizer`` (TF1 ``MixedPrecisionLossScaleOptimizer``).

    Args:
        opt: the optimizer to wrap (optkit's, torch's or another wrapper).
        loss_scale: a number (``FixedLossScale``: as in TF, non-finite gradients are applied), ``"dynamic"``
            (``DynamicLossScale()``: 2^15, period 2000, ×2), ``"backoff"``/``"logmax"`` (OpenSeq2Seq), or any
            :class:`~optkit.loss_scale.LossScale` object. ``None`` raises ``ValueError`` (TF).

    Attributes: ``loss_scaler`` (the scale object), ``loss_scale`` (current ``S``, 0-d fp32 tensor),
    ``step_applied`` (0-d bool), ``iterations`` (the inner optimizer's applied updates).
    """

    def __init__(self, opt: torch.optim.Optimizer, loss_scale: Any = "dynamic") -> None:
        if loss_scale is None:
            raise ValueError("`loss_scale` cannot be None")
        scaler = get_loss_scale(loss_scale)
        super().__init__(opt)
        self.loss_scaler: LossScale = scaler.to(self._device())

    @property
    def loss_scale(self) -> Tensor:
        """The current loss scale ``S`` (0-d float32 tensor, a snapshot)."""
        return self.loss_scaler()

    def scale_loss(self, loss: Tensor) -> Tensor:
        """``loss · S``: call ``backward()`` on this (it marks ``grads_scaled`` for the next ``step()``)."""
        self.grads_scaled = True
        return self.loss_scaler.scale_loss(loss)

    get_scaled_loss = scale_loss

    def _unscaled_grads_present(self) -> bool:
        """Whether a ``step()`` without ``grads_scaled`` would divide gradients by ``S``
        (:func:`scaled_backward_step`): any parameter has a gradient."""
        return bool(self._params_with_grads()[0])

    def get_unscaled_gradients(self, grads: Sequence[Tensor | None]) -> list[Tensor | None]:
        """``g / S`` for every non-``None`` gradient (new tensors; tf.keras 2 name)."""
        grads = list(grads)
        return mt.scaled_copies(grads, mt.inverse_scale(self.loss_scaler(), grads))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One loss-scaled step. With a closure: the closure returns the unscaled loss and does not call
        ``backward``; the wrapper back-propagates ``loss·S``. Returns the closure's loss. Gradients that did
        not come from ``loss·S`` raise ``RuntimeError`` (:func:`scaled_backward_step`). When no parameter has
        a gradient the step changes nothing (torch's contract): not the parameters, the inner optimizer
        (which is not called) or the scale; ``step_applied`` is False."""
        return scaled_backward_step(self, closure)

    @torch.no_grad()
    def apply_step(self, context: StepContext) -> StepResult:
        """One loss-scaled step under ``context`` (the step protocol as a value); as :meth:`step` without a
        closure."""
        return scaled_apply_step(self, context)

    def _wrapped_step(self, context: StepContext, *, scaled: bool = True) -> StepResult:
        whole = getattr(self.optimizer, "whole_grads", None)
        seen: dict = {}
        grads = whole(seen) if whole is not None else None  # flat buffers: one check over each flat gradient
        if grads is None:
            _, grads = self._params_with_grads()
        if not grads:  # no parameter has a gradient: a no-op (torch.optim), the scale is not updated either
            self.step_applied = torch.zeros((), dtype=torch.bool, device=self._device())
            return StepResult(self.step_applied)
        scale = self.loss_scaler.scale_tensor if scaled else None  # (read by the step, before the update)
        return loss_scaled_step(self, self.loss_scaler, grads, scale, context, gathered=seen)

    # ---- TF1 surface ---------------------------------------------------------------------------------------

    def compute_gradients(
        self, loss: Tensor | Callable[[], Tensor], var_list: Sequence[Tensor] | None = None
    ) -> list[tuple[Tensor | None, Tensor]]:
        """Gradients of ``loss·S``, divided by ``S``: the **unscaled** gradients (TF1)."""
        scale = self.loss_scaler()

        def scaled_loss() -> Tensor:
            value = loss() if callable(loss) else loss
            if not isinstance(value, Tensor):
                raise ValueError("`loss` must be (or return) a scalar tensor")
            return value * scale.to(value.device, value.dtype if value.is_floating_point() else torch.float32)

        if hasattr(self.optimizer, "compute_gradients"):
            pairs = self.optimizer.compute_gradients(scaled_loss, var_list)
        else:
            pairs = _autograd_pairs(scaled_loss, self._all_params() if var_list is None else list(var_list))
        raw = [g for g, _ in pairs]
        grads = mt.scaled_copies(raw, mt.inverse_scale(scale, raw))
        return [(g, v) for g, (_, v) in zip(grads, pairs)]

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Tensor | None, Tensor]]) -> Any:
        """Apply **unscaled** gradients if they are finite (dynamic scale); the scale is updated either way.
        Returns the inner ``iterations`` (optkit) or ``step_applied``."""
        pairs = _check_pairs(grads_and_vars, self._all_params())
        self._with_grads(pairs, lambda: self._wrapped_step(StepContext.from_attributes(self), scaled=False))
        return self._result()

    # ---- state ---------------------------------------------------------------------------------------------

    def _own_variables(self) -> list[Tensor]:
        sc = getattr(self.loss_scaler, "scaler", self.loss_scaler)
        return list(sc._state.values())

    def _own_config(self) -> dict:
        return {"loss_scale": {"class_name": type(self.loss_scaler).__name__,
                               "config": self.loss_scaler.get_config()}}

    def _own_state(self) -> dict[str, Any]:
        return {"loss_scale": self.loss_scaler.state_dict()}

    def _check_own_state(self, own: dict[str, Any]) -> None:
        if set(own) != {"loss_scale"} or not isinstance(own["loss_scale"], dict):
            raise ValueError(f"{type(self).__name__}.load_state_dict: wrapper part must hold 'loss_scale'")
        copy.deepcopy(self.loss_scaler).load_state_dict(own["loss_scale"])  # validate before any change

    def _load_own_state(self, own: dict[str, Any]) -> None:
        self.loss_scaler.load_state_dict(own["loss_scale"])


#: TF1 name (``tf.train.experimental.MixedPrecisionLossScaleOptimizer``).
MixedPrecisionLossScaleOptimizer = LossScaleOptimizer
