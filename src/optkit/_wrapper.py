"""The common base of optkit's optimizer wrappers: proxying, the step protocol, checkpoints.

A wrapper holds an inner ``torch.optim.Optimizer`` (optkit's, torch's, or another wrapper) and is itself a
``torch.optim.Optimizer`` instance (it subclasses it without running its ``__init__``), so
``torch.optim.lr_scheduler`` schedulers, ``torch.amp.GradScaler`` and step hooks accept it.
``param_groups``, ``state`` and ``defaults`` are the inner optimizer's objects (a scheduler that edits a
group's ``lr`` edits the inner optimizer's group).

**The step protocol.** A step takes a :class:`~optkit._core.context.StepContext`: ``grad_scale`` (gradients
are divided by it), ``found_inf`` (0-d float, 1.0 = skip: nothing changes) and ``multipliers``
(``{id(param): 0-d tensor}`` multiplying that gradient inside the optimizer's own pass), plus what the caller
already read and whether it zeroes the gradients next. ``step()`` builds it from the attributes
``grad_scale``, ``found_inf`` and ``grad_multipliers`` (so ``GradScaler`` can set them), as optkit optimizers
do. A wrapper combines it with its own work and hands the result to the inner optimizer
(:meth:`OptimizerWrapper._delegate`) according to what that supports:

* ``"full"`` (optkit optimizers and wrappers): the inner ``apply_step(context)``, between the inner
  optimizer's own step hooks — no extra memory pass and no host sync;
* ``"amp"`` (torch fused optimizers, ``_step_supports_amp_scaling``): multipliers are applied to the
  gradients in place, ``grad_scale``/``found_inf`` are passed on. torch creates state lazily with
  ``empty_like`` even on a skipped step (``_fused_sgd`` in torch 2.13), so on a step where a parameter
  with a gradient has no state yet and a ``found_inf`` is given, ``found_inf`` is read on the host once and
  a skipped step does not call the inner optimizer at all;
* ``"none"`` (any other optimizer): gradients are unscaled in place with the fused non-finite check,
  multipliers applied in place, and when a ``found_inf`` is given it is read on the host (one sync per step,
  only for such optimizers) to skip the call.

A wrapper's ``step_applied`` (0-d bool tensor) tells whether its last step changed anything.

**Checkpoints.** ``state_dict()`` is ``{"optimizer": inner.state_dict(), "wrapper": {"type": <class
name>, **own state}}``; stacked wrappers nest. ``load_state_dict`` checks the wrapper type and its own part
before loading anything.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.optim.optimizer as _torch_optimizer
from torch import Tensor
from typing_extensions import Self

from . import _multi_tensor as mt
from ._amp import AmpProtocol
from ._arguments import accepted_keywords, check_call
from ._core.context import StepContext, StepResult
from ._core.interface import EngineInterface
from ._core.state_dict import run_load_pre_hooks, validate_torch_state_dict
from ._core.tf_surface import autograd_pairs as _autograd_pairs
from ._core.tf_surface import check_pairs as _check_pairs
from ._core.tf_surface import gradients_installed
from ._gc import gc_paused
from .optimizer import Optimizer, record_field
from .schedules import applies_lr_scale

__all__ = ["OptimizerWrapper", "protocol_level", "step_inner"]



def _engine(opt: torch.optim.Optimizer) -> EngineInterface | None:
    """The engine interface of an optkit optimizer (``opt.engine``); None for any other optimizer."""
    return opt.engine if isinstance(opt, Optimizer) else None


def may_hold_dtensors(opt: torch.optim.Optimizer) -> bool:
    """Whether the innermost optimizer of ``opt`` may hold DTensor parameters (an optkit one knows; any other
    may), whose ``Partial`` gradients are reduced before anything reads them."""
    engine = _engine(_innermost(opt))
    return True if engine is None else engine.any_dtensor


def protocol_level(opt: torch.optim.Optimizer) -> str:
    """``"full"``, ``"amp"`` or ``"none"``: how much of the step protocol ``opt`` honours (module doc)."""
    from .optimizer import Optimizer as OptkitOptimizer

    if isinstance(opt, (OptimizerWrapper, OptkitOptimizer)):
        return "full"
    if getattr(opt, "_step_supports_amp_scaling", False):
        return "amp"
    return "none"


def step_inner(opt: torch.optim.Optimizer, context: StepContext | None = None, *, global_hooks: bool = False
               ) -> Any:
    """``opt.step()`` as a wrapper calls it: ``opt``'s own step hooks run, the global ones
    (``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``..._post_hook``) do not — they already
    ran around the outermost ``step()``, and must fire once per training step, not once per wrapper level.
    A torch LR scheduler's per-instance patch of ``opt.step`` (which only records the call) is honoured
    without going through the hooked class ``step`` again.

    With ``context`` (for an ``opt`` that honours the whole protocol, :func:`protocol_level` ``"full"``):
    ``opt.apply_step(context)`` between those hooks (which get it as the keyword argument ``context``),
    returning its :class:`~optkit._core.context.StepResult`.
    A pre-hook may replace gradients, so ``context.gathered`` does not reach an ``opt`` that has one. A step
    patched per instance by something else is called as it is, with the context's loss scale, skip flag and
    multipliers set as the attributes ``step()`` reads (the rest of the context is an optimisation, or the
    overflow report, which such a step then does not give). ``global_hooks``: the global hooks run too
    (the outermost step of a caller that is not itself a ``step()``: the train op)."""
    fn = type(opt).step
    raw = getattr(fn, "__wrapped__", None)
    hooked = raw is not None and getattr(fn, "hooked", False)
    patched = opt.__dict__.get("step")
    if patched is not None:
        by_scheduler = hooked and getattr(patched, "_wrapped_by_lr_sched", False) and getattr(
            patched, "__wrapped__", None) is fn
        if not by_scheduler:  # some other per-instance patch: call it as it is
            return opt.step() if context is None else _step_by_attributes(opt, context)
        opt._opt_called = True  # what the scheduler's patch does (it warns on lr_scheduler.step() first)
    if context is None:
        return _run_step_hooks(opt, raw, (opt,), {}, global_hooks=global_hooks) if hooked else opt.step()
    if not hooked:
        return opt.apply_step(context)
    if context.gathered and (opt._optimizer_step_pre_hooks or (
            global_hooks and _torch_optimizer._global_optimizer_pre_hooks)):
        context = context.inward(gathered=None)
    results: list[StepResult] = []

    def run(_opt: Any, closure: Callable[[], Any] | None = None, context: StepContext = context) -> None:
        if closure is not None:  # (a pre-hook returned arguments with a closure)
            with torch.enable_grad():
                closure()
        results.append(opt.apply_step(context))

    # the hooks see the context as the keyword ``context`` (a pre-hook may return a changed one)
    _run_step_hooks(opt, run, (opt,), {"context": context}, global_hooks=global_hooks)
    return results[0]


def _step_by_attributes(opt: torch.optim.Optimizer, context: StepContext) -> StepResult:
    """``opt.step()`` with the context's loss scale, skip flag and multipliers set as the protocol's
    attributes for the call (``torch.amp.GradScaler``'s way)."""
    values = {"grad_scale": context.grad_scale, "found_inf": context.found_inf,
              "grad_multipliers": context.multipliers}
    for k, v in values.items():
        if v is not None:
            setattr(opt, k, v)
    try:
        opt.step()
    finally:
        for k, v in values.items():
            if v is not None and k in opt.__dict__:
                delattr(opt, k)
    return StepResult(getattr(opt, "step_applied", None))


def _run_step_hooks(
    opt: torch.optim.Optimizer, fn: Callable[..., Any], args: tuple, kwargs: dict, *, global_hooks: bool
) -> Any:
    """``fn(*args, **kwargs)`` between ``opt``'s step pre- and post-hooks (torch's order: global pre, own pre,
    own post, global post; a pre-hook may return new ``(args, kwargs)``), the global ones only with
    ``global_hooks``."""
    pre = list(opt._optimizer_step_pre_hooks.values())
    post = list(opt._optimizer_step_post_hooks.values())
    if global_hooks:
        pre = list(_torch_optimizer._global_optimizer_pre_hooks.values()) + pre
        post += list(_torch_optimizer._global_optimizer_post_hooks.values())
    for pre_hook in pre:
        result = pre_hook(opt, args, kwargs)
        if result is not None:
            if not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(f"a step pre-hook must return None or a tuple of (new_args, new_kwargs), "
                                   f"but got {result}.")
            args, kwargs = result
    out = fn(*args, **kwargs)
    for post_hook in post:
        post_hook(opt, args, kwargs)
    return out


def _wrapper_hooks(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` or a wrapper inside it (above the innermost optimizer) has a step pre-hook."""
    while isinstance(opt, OptimizerWrapper):
        if opt._optimizer_step_pre_hooks:
            return True
        opt = opt.optimizer
    return False


def _innermost(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    while isinstance(opt, OptimizerWrapper):
        opt = opt.optimizer
    return opt


def refuse_inside_ema_weights(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``RuntimeError`` when the innermost optkit optimizer of ``opt`` is inside an ``ema_weights()`` block
    (asked at the top of a wrapper's step, before anything changes); returns that innermost optimizer."""
    inner = _innermost(opt)
    engine = _engine(inner)
    if engine is not None:
        engine.refuse_inside_ema_weights()
    return inner


class _WrapperRecord:
    """A wrapper's step bookkeeping: the last step's outcome, whether the gradients came from ``scale_loss``
    (loss-scale wrappers) and the mixed-precision window's fold flags. An object of its own because
    ``torch.compile`` replays the mutations of plain objects but drops attribute assignments on an optimizer
    (``scale_loss`` inside a compiled training step would not mark the gradients scaled)."""

    __slots__ = ("applied", "grads_scaled", "unscaled_fold", "scaled_fold")

    def __init__(self) -> None:
        self.applied: Tensor | None = None
        self.grads_scaled = False
        self.unscaled_fold = False
        self.scaled_fold = False


class ScaledGradsFlag:
    """``grads_scaled`` of a loss-scale wrapper, kept in its :class:`_WrapperRecord`."""

    _record: _WrapperRecord
    grads_scaled = record_field(
        "grads_scaled", "Whether the gradients came from ``scale_loss(loss)`` since the last step (set it "
                        "yourself when you scaled the loss by the loss scale yourself).")


@contextlib.contextmanager
def grads_swapped(pairs: Sequence[tuple[Tensor, Tensor]]) -> Iterator[None]:
    """Inside the block each parameter's ``.grad`` is the given tensor (a wrapper's transformed copy of it,
    for an inner step); on exit, also after an exception, the caller's gradient objects are back, as they
    were."""
    saved = [(p, p.grad) for p, _ in pairs]
    try:
        for p, g in pairs:
            p.grad = g
        yield
    finally:
        for p, g in saved:
            p.grad = g


class OptimizerWrapper(AmpProtocol, torch.optim.Optimizer):
    """Base of optkit wrappers: holds ``self.optimizer`` and proxies the ``torch.optim`` and TF surfaces.

    Subclasses implement :meth:`_wrapped_step` (and optionally :meth:`_own_state`, :meth:`_load_own_state`,
    :meth:`_own_config`, :meth:`_remap_params`).
    """

    #: a wrapper that must not be wrapped by another optkit wrapper (it changes which tensors hold gradients)
    _outermost_only = False

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        # before Python binds the arguments: apex's LARC(opt, trust_coefficient=...) gets the hint to
        # larc_eta (optkit._arguments.HINTS), not "missing required argument 'larc_eta'"
        check_call(cls.__name__, len(args), kwargs, accepted_keywords(cls, OptimizerWrapper))
        return super().__new__(cls)

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"`opt` must be a torch.optim.Optimizer, got {type(opt).__name__}")
        if getattr(opt, "_outermost_only", False):
            raise TypeError(
                f"{type(opt).__name__} must be the outermost wrapper: wrap the other wrappers inside it "
                f"(e.g. MixedPrecisionOptimizerWrapper({type(self).__name__}(opt)))"
            )
        self.optimizer = opt
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._patch_step_function()
        self._stateless_ids: set[int] = set()
        self._record = _WrapperRecord()
        self.step_applied = torch.ones((), dtype=torch.bool, device=self._device())

    # step bookkeeping kept in self._record (see _WrapperRecord)
    step_applied = record_field("applied", "Whether this wrapper's last step changed anything (0-d bool "
                                           "tensor).")

    # ------------------------------------------------------------------------------------ proxies

    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        """The inner optimizer's param groups (the same list and dicts)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self):  # type: ignore[override]
        """The inner optimizer's per-parameter state."""
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict:  # type: ignore[override]
        """The inner optimizer's defaults."""
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict) -> None:
        self.optimizer.defaults = value

    @property
    def applies_lr_scale(self) -> bool:
        """Whether the inner optimizer multiplies each param group's ``lr_scale`` into its learning rate
        itself (:func:`optkit.schedules.applies_lr_scale`: an optkit optimizer does, a ``torch.optim`` one
        does not)."""
        return applies_lr_scale(self.optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's ``zero_grad``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group to the inner optimizer."""
        self.optimizer.add_param_group(param_group)

    def __getstate__(self) -> dict:
        return dict(self.__dict__)

    def __setstate__(self, state: dict) -> None:
        if "_record" not in state:  # pickled by an earlier optkit: the flags were attributes
            record = state["_record"] = _WrapperRecord()
            record.applied = state.pop("step_applied", None)
            record.grads_scaled = state.pop("grads_scaled", False)
            record.unscaled_fold = state.pop("_unscaled_fold", False)
            record.scaled_fold = state.pop("_scaled_fold", False)
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"

    def _inner_attr(self, name: str) -> Any:
        inner = self.optimizer
        if not hasattr(inner, name):
            raise AttributeError(f"{type(inner).__name__} (inside {type(self).__name__}) has no {name!r}")
        return getattr(inner, name)

    @property
    def iterations(self) -> Tensor:
        """The inner optimizer's count of applied updates (optkit optimizers; skipped steps do not count)."""
        return self._inner_attr("iterations")

    def finalize_variable_values(self, var_list: Sequence[Tensor] | None = None) -> None:
        """Pass-through: swap in the inner optimizer's moving averages (optkit optimizers with EMA)."""
        self._inner_attr("finalize_variable_values")(var_list)

    def ema_weights(self, var_list: Sequence[Tensor] | None = None) -> Any:
        """Pass-through: the inner optimizer's :meth:`optkit.Optimizer.ema_weights` context manager."""
        return self._inner_attr("ema_weights")(var_list)

    @property
    def learning_rate(self) -> Any:
        """The inner optimizer's learning rate (optkit optimizers), else the first group's ``lr``."""
        if hasattr(self.optimizer, "learning_rate"):
            return self.optimizer.learning_rate
        return self.param_groups[0]["lr"]

    @learning_rate.setter
    def learning_rate(self, value: Any) -> None:
        if hasattr(self.optimizer, "learning_rate"):
            self.optimizer.learning_rate = value
        else:
            for g in self.param_groups:
                g["lr"] = value

    def _device(self) -> torch.device:
        for g in self.param_groups:
            for p in g["params"]:
                return mt.local(p).device
        return torch.device("cpu")

    def _current_lr(self, group: dict, commit: bool = False, found_inf: Tensor | None = None) -> Tensor:
        """This step's learning rate of ``group`` as a 0-d fp32 tensor (the inner optimizer's own rule)."""
        inner = self.optimizer
        if isinstance(inner, OptimizerWrapper):
            return inner._current_lr(group, commit, found_inf)
        engine = _engine(inner)
        if engine is not None:
            return engine.current_lr(group, commit, found_inf)
        lr = group["lr"]
        if isinstance(lr, Tensor):
            return lr.detach().to(device=self._device(), dtype=torch.float32).reshape(())
        return mt.scalar(lr, torch.float32, self._device())

    def _remap_params(self, mapping: dict[int, Tensor]) -> None:
        """Parameters were replaced (``id(old) -> new``, e.g. by fp32 masters): update id-keyed records."""
        inner = self.optimizer
        if isinstance(inner, OptimizerWrapper):
            inner._remap_params(mapping)
        elif _engine(inner) is not None:  # its decay exclusions by identity and its records of names
            _engine(inner).remap_params(mapping)

    # --------------------------------------------------------------------------------------- step

    def whole_grads(self, seen: dict | None = None) -> list[Tensor] | None:
        """The inner optimizer's :meth:`optkit.Optimizer.whole_grads` (flat gradients), or None."""
        whole = getattr(self.optimizer, "whole_grads", None)
        return None if whole is None else whole(seen)

    def _params_with_grads(self) -> tuple[list[Tensor], list[Tensor]]:
        params, grads = [], []
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    params.append(p)
                    grads.append(p.grad)
        return params, grads

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run the closure (if any, under ``enable_grad``), then the wrapper's step; returns the closure's
        value (torch semantics). ``step_applied`` tells whether anything changed."""
        refuse_inside_ema_weights(self)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.apply_step(StepContext.from_attributes(self))
        return loss

    @torch.no_grad()
    def apply_step(self, context: StepContext) -> StepResult:
        """One step of this wrapper under ``context`` (the step protocol as a value, module doc); returns
        what the step did. The caller runs the step hooks (``step()`` is this, between them, with the
        context its attributes set)."""
        refuse_inside_ema_weights(self)
        if may_hold_dtensors(self):  # before any wrapper reads a gradient
            mt.reduce_partial_grads_(self._all_params())
        with gc_paused(sum(len(g["params"]) for g in self.param_groups)):
            return self._wrapped_step(context)

    def _wrapped_step(self, context: StepContext) -> StepResult:
        """The wrapper's own work around :meth:`_delegate` (subclasses); returns the step's result."""
        return self._delegate(context)

    def _delegate(self, context: StepContext) -> StepResult:
        """Step the inner optimizer under ``context`` (the wrapper's own scale, skip flag and multipliers
        already in it; see the module doc for the three levels). Sets ``self.step_applied`` and returns the
        step's result."""
        grad_scale, found_inf, multipliers = context.grad_scale, context.found_inf, context.multipliers
        inner = self.optimizer
        level = protocol_level(inner)
        dev = self._device()
        if level == "full":
            result = step_inner(inner, context)
            applied = result.applied
            if applied is None:
                applied = self._applied_from(found_inf, dev)
            self.step_applied = applied
            return StepResult(applied, result.zeroed_groups, result.overflow)

        params, grads = self._params_with_grads()
        if level == "none" and grad_scale is not None:
            fi = torch.zeros((), dtype=torch.float32, device=dev)
            inv = mt.inverse_scale(grad_scale, grads, dev)  # (float64 for float64 gradients)
            mt.non_finite_check_and_unscale_(grads, fi, inv)
            found_inf = fi if found_inf is None else torch.maximum(fi, found_inf.to(dev, torch.float32))
            grad_scale = None
        swapped: list[tuple[Tensor, Tensor]] = []  # (parameter, the copy its .grad is for the inner step)
        if multipliers:
            factors = [multipliers.get(id(p)) for p in params]
            sel = [j for j, f in enumerate(factors) if f is not None]
            if sel:
                # the multipliers (LARC's ratios) are this step's math, not the caller's gradients (which
                # torch.optim leaves as they are, or unscaled): the inner optimizer steps on products in
                # copies, put in place of .grad for its step only
                if grad_scale is not None:  # ("amp": unscaled first, as GradScaler.unscale_ would)
                    mt.scale_(grads, mt.inverse_scale(grad_scale, grads, dev))
                    grad_scale = None
                copies = mt.scaled_copies([grads[j] for j in sel], torch.ones((), device=dev))
                mt.scale_(copies, [factors[j] for j in sel])
                swapped = list(zip([params[j] for j in sel], copies))
        with grads_swapped(swapped):
            return StepResult(self._step_level(inner, level, params, grad_scale, found_inf, dev))

    def _step_level(self, inner: torch.optim.Optimizer, level: str, params: list[Tensor],
                    grad_scale: Tensor | None, found_inf: Tensor | None, dev: torch.device) -> Tensor:
        """The inner step of the ``"amp"`` and ``"none"`` levels (module doc); sets ``step_applied``."""
        if level == "amp" and found_inf is not None and self._missing_state(params):
            # torch would create uninitialised state on a skipped step: decide on the host, once.
            if bool(found_inf.detach().reshape(()).cpu() != 0):
                self.step_applied = torch.zeros((), dtype=torch.bool, device=dev)
                return self.step_applied
            self._call_amp(inner, grad_scale, found_inf)
            self._stateless_ids.update(id(p) for p in params if not inner.state.get(p))
        elif level == "amp":
            self._call_amp(inner, grad_scale, found_inf)
        else:
            if found_inf is not None and bool(found_inf.detach().reshape(()).cpu() != 0):
                # generic optimizers cannot skip on the device: one host read per step (documented)
                self.step_applied = torch.zeros((), dtype=torch.bool, device=dev)
                return self.step_applied
            step_inner(inner)
            found_inf = None
        self.step_applied = self._applied_from(found_inf, dev)
        return self.step_applied

    @staticmethod
    def _applied_from(found_inf: Tensor | None, dev: torch.device) -> Tensor:
        if found_inf is None:
            return torch.ones((), dtype=torch.bool, device=dev)
        return found_inf.detach().to(dev).reshape(()) == 0

    def _missing_state(self, params: list[Tensor]) -> bool:
        st = self.optimizer.state
        return any(not st.get(p) and id(p) not in self._stateless_ids for p in params)

    @staticmethod
    def _call_amp(inner: torch.optim.Optimizer, grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        if grad_scale is not None:
            inner.grad_scale = grad_scale
        if found_inf is not None:
            inner.found_inf = found_inf
        try:
            step_inner(inner)
        finally:
            for k in ("grad_scale", "found_inf"):
                if k in inner.__dict__:
                    delattr(inner, k)

    # --------------------------------------------------------------------------------- TF surface

    def _all_params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def compute_gradients(
        self, loss: Tensor | Callable[[], Tensor], var_list: Sequence[Tensor] | None = None
    ) -> list[tuple[Tensor | None, Tensor]]:
        """``(gradient, variable)`` pairs of ``loss`` (a scalar tensor or zero-argument callable); the inner
        optimizer's ``compute_gradients`` when it has one, else ``torch.autograd.grad``."""
        if hasattr(self.optimizer, "compute_gradients"):
            return self.optimizer.compute_gradients(loss, var_list)
        return _autograd_pairs(loss, self._all_params() if var_list is None else list(var_list))

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Tensor | None, Tensor]]) -> Any:
        """Apply ``(gradient, variable)`` pairs as one step of this wrapper (variables not listed keep their
        ``.grad`` untouched and are not updated this step); its own and the global step hooks fire once
        around it, as around ``step()``. Returns ``iterations`` when the inner optimizer counts them, else
        ``step_applied``."""
        pairs = _check_pairs(grads_and_vars, self._all_params())
        self._with_grads(pairs, lambda: self._wrapped_step(StepContext.from_attributes(self)))
        return self._result()

    def _with_grads(self, pairs: list[tuple[Tensor | None, Tensor]], fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (the step of an ``apply_gradients``) with copies of the given gradients installed
        (``_tf_surface.gradients_installed``) as a ``step()`` of this wrapper: the global and this wrapper's
        step hooks fire around it (with ``args == (self,)``; what a pre-hook returns reaches the post-hooks
        only), and a torch LR scheduler on this wrapper sees the call."""
        if getattr(self.__dict__.get("step"), "_wrapped_by_lr_sched", False):
            self._opt_called = True  # (what the scheduler's patch of step() records)

        def run(*_args: Any, **_kwargs: Any) -> Any:
            with torch.no_grad():
                return fn()

        with gradients_installed(pairs, self._all_params()):
            return _run_step_hooks(self, run, (self,), {}, global_hooks=True)

    def _result(self) -> Any:
        return self.optimizer.iterations if hasattr(self.optimizer, "iterations") else self.step_applied

    def minimize(self, loss: Tensor | Callable[[], Tensor], var_list: Sequence[Tensor] | None = None) -> Any:
        """``apply_gradients(compute_gradients(loss, var_list))``."""
        return self.apply_gradients(self.compute_gradients(loss, var_list))

    def get_slot(self, var: Tensor, name: str) -> Tensor:
        """The inner optimizer's slot ``name`` of ``var``."""
        return self._inner_attr("get_slot")(var, name)

    def get_slot_names(self) -> list[str]:
        """The inner optimizer's slot names."""
        return self._inner_attr("get_slot_names")()

    def variables(self) -> list[Tensor]:
        """The inner optimizer's variables followed by this wrapper's own (e.g. loss-scale state)."""
        inner = self._inner_attr("variables")()
        return list(inner) + self._own_variables()

    def _own_variables(self) -> list[Tensor]:
        return []

    def get_config(self) -> dict:
        """This wrapper's hyperparameters plus ``"inner_optimizer"`` (the inner ``get_config()`` when it has
        one, else its class name and defaults)."""
        inner = self.optimizer
        inner_cfg = inner.get_config() if hasattr(inner, "get_config") else {
            "class_name": type(inner).__name__, "defaults": dict(inner.defaults)}
        return {"name": type(self).__name__, **self._own_config(), "inner_optimizer": inner_cfg}

    def _own_config(self) -> dict:
        return {}

    # --------------------------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """``{"optimizer": inner state_dict, "wrapper": {"type": class name, **own state}}``; the wrapper's
        ``register_state_dict_pre_hook``/``post_hook`` hooks run around it (torch semantics)."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state_dict = {"optimizer": self.optimizer.state_dict(),
                      "wrapper": {"type": type(self).__name__, **self._own_state()}}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a :meth:`state_dict`; the wrapper part is validated before anything changes. The load
        pre-hooks run first (on a shallow copy; they may return a replacement), the post-hooks last (torch
        semantics)."""
        self._load_checked(run_load_pre_hooks(self, state_dict))
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_checked(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict) or set(state_dict) != {"optimizer", "wrapper"}:
            raise ValueError(f"{type(self).__name__}.load_state_dict: expected a dict with keys "
                             "'optimizer' and 'wrapper' (from a wrapper's state_dict())")
        own = state_dict["wrapper"]
        if not isinstance(own, dict) or own.get("type") != type(self).__name__:
            got = own.get("type") if isinstance(own, dict) else type(own).__name__
            raise ValueError(f"{type(self).__name__}.load_state_dict: state is for {got!r}")
        own = {k: v for k, v in own.items() if k != "type"}
        self._check_own_state(own)
        inner = self.optimizer
        if not isinstance(inner, (OptimizerWrapper, Optimizer)):
            validate_torch_state_dict(inner, state_dict["optimizer"])  # optkit optimizers check their own
        inner.load_state_dict(state_dict["optimizer"])
        self._load_own_state(own)

    def _own_state(self) -> dict[str, Any]:
        return {}

    def _check_own_state(self, own: dict[str, Any]) -> None:
        if own:
            raise ValueError(f"{type(self).__name__}.load_state_dict: unexpected wrapper keys {sorted(own)}")

    def _load_own_state(self, own: dict[str, Any]) -> None:
        pass
