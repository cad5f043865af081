"""Learning-rate schedule objects, a builder, and the adapter that drives any ``torch.optim`` optimizer.

* :class:`LearningRateSchedule`: a callable ``schedule(step) -> lr`` with ``get_config()`` /
  ``from_config(config)`` (the Keras contract). A python-number step gives a python float, a 0-d tensor step a
  0-d tensor on its device (no host sync), exactly like the policies in :mod:`optkit.lr_policies`.
* :class:`PolicySchedule`: any OpenSeq2Seq policy (by name or function) with its parameters bound. Parameters
  are checked against the policy's signature *and* evaluated once at construction, so a bad config fails
  before training starts. Its config is ``{"policy": name, **params}``.
* :func:`build_schedule`: one entry point for a name, a config dict, a policy function or a schedule.
* :class:`ScheduleLR`: a ``torch.optim.lr_scheduler.LRScheduler`` that sets each param group's ``lr`` from a
  schedule, as a closed form of the step (so resuming never drifts; see pytorch/pytorch#162591). A group's
  ``lr_scale`` (layer-wise decay, :func:`optkit.param_groups`) multiplies its learning rate: optimizers that
  declare ``applies_lr_scale = True`` (optkit's) apply it themselves, for other optimizers ``ScheduleLR``
  does (:func:`applies_lr_scale`). It knows optimizers only by the ``torch.optim`` interface and that
  declaration, so this module imports none of optkit's optimizers or wrappers.

Step counting: the step is the number of *applied* updates, as in OpenSeq2Seq (whose ``global_step``
advances only when an update is applied).
Call ``scheduler.step()`` once after every optimizer update that was applied, and not after skipped ones
(overflow, accumulation micro-steps); update ``k`` (0-based) then runs with ``schedule(k)``.
"""

from __future__ import annotations

import copy
import inspect
import numbers
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from . import lr_policies as _lr_policies
from ._validation import ParameterTypeError, check_count, check_lr_value, check_real
from .lr_policies import LR, LR_POLICIES, Step, get_policy

__all__ = ["LearningRateSchedule", "PolicySchedule", "build_schedule", "ScheduleLR", "applies_lr_scale"]


class LearningRateSchedule(ABC):
    """Base class: a learning rate as a function of the (applied-update) step.

    Subclasses implement ``__call__(step)`` and ``get_config()``; ``cls.from_config(s.get_config())``
    rebuilds an equivalent schedule. A subclass that sets ``config_tag`` (a key its configs always contain)
    can be rebuilt from ``LearningRateSchedule.from_config``, which dispatches on that key.
    """

    config_tag: ClassVar[str | None] = None
    _by_tag: ClassVar[dict[str, type[LearningRateSchedule]]] = {}
    #: every subclass by class name (None where two classes share a name), for the ``class_name`` entry an
    #: optimizer's config records (:meth:`optkit.Optimizer.from_config`)
    _by_name: ClassVar[dict[str, type[LearningRateSchedule] | None]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        tag = cls.__dict__.get("config_tag")
        if tag is not None:
            LearningRateSchedule._by_tag[tag] = cls
        known = LearningRateSchedule._by_name
        same = known.get(cls.__name__, cls)
        where = (cls.__module__, cls.__qualname__)
        redefined = same is not None and (same.__module__, same.__qualname__) == where
        known[cls.__name__] = cls if redefined else None  # (a re-run cell redefines, not duplicates)

    @staticmethod
    def _from_named_config(entry: Mapping[str, Any],
                           custom_objects: Mapping[str, Any] | None = None) -> LearningRateSchedule:
        """The schedule an optimizer config's ``{"class_name": ..., "config": ...}`` entry names: the class
        from ``custom_objects``, else the one subclass of that name, else the base's tag dispatch."""
        name = entry.get("class_name")
        cls = (custom_objects or {}).get(name) or LearningRateSchedule._by_name.get(name)
        if cls is not None:
            return cls.from_config(entry["config"])
        try:
            schedule = LearningRateSchedule.from_config(entry["config"])
        except ValueError:
            schedule = None
        if schedule is None or (name is not None and type(schedule).__name__ != name):
            raise ValueError(f"from_config: cannot rebuild the schedule {name!r}: no unique class of that "
                             f"name is defined (pass custom_objects={{{name!r}: cls}})")
        return schedule

    @abstractmethod
    def __call__(self, step: Step) -> LR:
        """The learning rate at ``step`` (python float for a number, 0-d tensor for a tensor)."""

    def value(self, step: Tensor, dtype: torch.dtype) -> LR:
        """The learning rate at the integer step tensor ``step`` for parameters of ``dtype`` (how an optimizer
        asks). By default ``self(step)``; optkit's policy schedules give float64 parameters their float64
        value (``self(step)`` rounds it to float32, as TF's float32 learning-rate variable did). A subclass
        that computes in float64 may override it likewise."""
        return self(step)

    @abstractmethod
    def get_config(self) -> dict[str, Any]:
        """The constructor arguments that rebuild this schedule through :meth:`from_config`."""

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> LearningRateSchedule:
        """Rebuild a schedule from :meth:`get_config`'s output (the base class dispatches on the tag)."""
        if not isinstance(config, Mapping):
            raise TypeError(f"from_config: config must be a mapping, got {config!r}")
        if cls is LearningRateSchedule:
            for tag, sub in LearningRateSchedule._by_tag.items():
                if tag in config:
                    return sub.from_config(config)
            raise ValueError(
                f"from_config: config names no schedule type (expected one of the keys "
                f"{sorted(LearningRateSchedule._by_tag)}), got keys {sorted(config)}"
            )
        return cls(**config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={getattr(v, '__name__', v)!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


def _resolve(policy: str | Callable[..., LR]) -> tuple[Callable[..., LR], str | Callable[..., LR]]:
    """(function, config entry): a registered policy is named in configs, others are kept as is."""
    if isinstance(policy, str):
        fn = get_policy(policy)
    elif callable(policy):
        fn = policy
    else:
        raise TypeError(f"PolicySchedule: policy must be a policy name or function, got {policy!r}")
    for name, registered in LR_POLICIES.items():
        if registered is fn:
            return fn, name
    return fn, fn


def _check_params(fn: Callable[..., LR], params: Mapping[str, Any]) -> None:
    """Unknown or missing keyword arguments for ``fn(global_step, **params)`` raise ``ValueError``."""
    label = getattr(fn, "__name__", repr(fn))
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: rely on the trial call
        return
    ps = list(sig.parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if not ps or ps[0].kind not in positional:
        raise TypeError(f"PolicySchedule: policy {label} must take global_step as its first argument")
    named = {
        p.name: p
        for p in ps[1:]
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    if ps[0].name in params:
        raise ValueError(f"PolicySchedule: {ps[0].name} is supplied by the schedule, not a parameter")
    if not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in ps):
        unknown = sorted(set(params) - set(named))
        if unknown:
            raise ValueError(
                f"PolicySchedule: unknown parameter(s) {unknown} for policy {label}; "
                f"accepted: {sorted(named)}"
            )
    missing = [n for n, p in named.items() if p.default is inspect.Parameter.empty and n not in params]
    if missing:
        raise ValueError(f"PolicySchedule: missing required parameter(s) {missing} for policy {label}")


class PolicySchedule(LearningRateSchedule):
    """A learning-rate policy with its parameters bound: ``schedule(step) = policy(step, **params)``.

    ``policy`` is a name from :data:`~optkit.lr_policies.LR_POLICIES` (case-insensitive) or any function
    ``policy(global_step, **params)``. The parameters are matched against the policy's signature (an unknown
    or missing one raises ``ValueError`` naming it) and the policy is evaluated at step 0, so invalid values
    raise here rather than in the middle of training.

    ``get_config()`` is ``{"policy": name, **params}``; for an unregistered function the ``"policy"`` entry is
    the function itself (register it in ``LR_POLICIES`` to get a serialisable name).
    """

    config_tag = "policy"

    def __init__(self, policy: str | Callable[..., LR], **params: Any) -> None:
        fn, entry = _resolve(policy)
        _check_params(fn, params)
        params = copy.deepcopy(params)
        fn(0, **params)
        self.policy = fn
        self._entry = entry
        self.params = params

    def __call__(self, step: Step) -> LR:
        return self.policy(step, **self.params)

    def value(self, step: Tensor, dtype: torch.dtype) -> LR:
        """optkit's own policies, given a float64 step tensor, compute and return their float64 value; a
        user's policy function gets the integer step as always (it may index a table with it)."""
        if dtype == torch.float64 and getattr(self.policy, "__module__", None) == _lr_policies.__name__:
            return self.policy(step.to(torch.float64), **self.params)
        return self.policy(step, **self.params)

    def get_config(self) -> dict[str, Any]:
        return {"policy": self._entry, **copy.deepcopy(self.params)}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> PolicySchedule:
        if not isinstance(config, Mapping):
            raise TypeError(f"from_config: config must be a mapping, got {config!r}")
        if "policy" not in config:
            raise ValueError(f"from_config: a PolicySchedule config needs a 'policy' key, got {list(config)}")
        params = dict(config)
        return cls(params.pop("policy"), **params)


def build_schedule(
    name_or_config: str | Mapping[str, Any] | Callable[..., LR] | LearningRateSchedule, **params: Any
) -> LearningRateSchedule:
    """A schedule from a policy name or function plus ``params``, a config dict (``params`` override its
    entries), or an existing schedule (returned unchanged; ``params`` must then be empty)."""
    if isinstance(name_or_config, LearningRateSchedule):
        if params:
            raise ValueError(f"build_schedule: params {sorted(params)} given with a ready schedule")
        return name_or_config
    if isinstance(name_or_config, Mapping):
        return LearningRateSchedule.from_config({**name_or_config, **params})
    if isinstance(name_or_config, str) or callable(name_or_config):
        return PolicySchedule(name_or_config, **params)
    raise TypeError(
        f"build_schedule: name_or_config must be a policy name, config dict, function or schedule, "
        f"got {name_or_config!r}"
    )


def applies_lr_scale(optimizer: Any) -> bool:
    """Whether ``optimizer`` (an optimizer, or an optimizer class) multiplies each param group's ``lr_scale``
    into its learning rate itself: its declared ``applies_lr_scale`` attribute, ``True`` for optkit
    optimizers (:attr:`optkit.Optimizer.applies_lr_scale`) and for optkit wrappers around one, absent (so
    ``False``) for ``torch.optim`` optimizers, which leave ``lr_scale`` to whoever sets their ``lr``
    (:class:`ScheduleLR`, :func:`optkit.create_optimizer`). On a wrapper *class* the attribute is a property
    (the answer depends on the optimizer it wraps), which counts as ``False``: only ``True`` itself does."""
    return getattr(optimizer, "applies_lr_scale", False) is True


class ScheduleLR(LRScheduler):
    """Drive a ``torch.optim`` optimizer's learning rate from a schedule.

    After construction and after every ``step()``, with ``t = last_step``:

    * ``mode="absolute"`` (default): every param group gets ``lr = schedule(t)``, times the group's
      ``lr_scale`` for optimizers that do not apply it themselves;
    * ``mode="multiplier"``: group ``g`` gets ``lr = initial_lr_g·schedule(t)`` (``LambdaLR``'s form; build
      the schedule with ``learning_rate=1.0`` to use a policy as a per-group multiplier), times the group's
      ``lr_scale`` for optimizers that do not apply it themselves unless their ``lr`` already holds it
      (groups that :func:`~optkit.create_optimizer` built, marked ``lr_scale_in_lr``), as timm's schedulers
      do.

    An optimizer applies ``lr_scale`` itself when it declares ``applies_lr_scale = True``
    (:func:`~optkit.schedules.applies_lr_scale`): optkit optimizers do, and optkit wrappers around one;
    ``torch.optim`` optimizers do not.

    Groups that share one tensor ``lr`` (torch puts the default tensor ``lr`` itself into every group without
    its own) each get their own copy before the first write, so each group keeps its value.

    Call ``step()`` once per *applied* optimizer update: update ``k`` (0-based) then uses ``schedule(k)``.
    Tensor ``lr`` entries are updated in place (``fill_``), so a compiled step does not recompile.

    ``state_dict()`` holds the position (``last_epoch``, i.e. ``last_step``) and the base lrs, not the
    schedule (that is configuration: rebuild it). ``load_state_dict`` re-applies the closed-form lr for the
    loaded position to every group, so the resumed lr sequence is identical whatever order optimizer and
    scheduler states are loaded in.
    """

    _MODES = ("absolute", "multiplier")

    def __init__(
        self,
        optimizer: Optimizer,
        schedule: LearningRateSchedule | Callable[[Step], LR],
        last_step: int = -1,
        *,
        mode: str = "absolute",
    ) -> None:
        if not callable(schedule):
            raise TypeError(f"ScheduleLR: schedule must be a schedule or callable, got {schedule!r}")
        if mode not in self._MODES:
            raise ValueError(f"ScheduleLR: mode must be one of {self._MODES}, got {mode!r}")
        if isinstance(last_step, bool) or not isinstance(last_step, numbers.Integral):
            raise TypeError(f"ScheduleLR: last_step must be an int, got {last_step!r}")
        if last_step < -1:
            raise ValueError(f"ScheduleLR: last_step must be >= -1, got {last_step!r}")
        if last_step != -1 and any("initial_lr" not in g for g in optimizer.param_groups):
            raise ValueError(
                f"ScheduleLR: last_step={last_step} resumes a schedule, which needs each param group's "
                "'initial_lr' (set by a scheduler attached before, and restored with the optimizer's "
                "state_dict); build it with last_step=-1 and load the scheduler's state_dict instead")
        self.schedule = schedule
        self.mode = mode
        self._scales_itself = applies_lr_scale(optimizer)
        super().__init__(optimizer, last_epoch=int(last_step))

    @property
    def last_step(self) -> int:
        """The step whose learning rate the optimizer holds now (torch's ``last_epoch``)."""
        return self.last_epoch

    def _closed_form(self, step: int | None = None, bases: list | None = None) -> list[float | Tensor]:
        """Every group's lr at ``step`` (default ``last_epoch``) with ``bases`` (default ``base_lrs``)."""
        at = self.last_epoch if step is None else step
        lr = check_lr_value("ScheduleLR: the schedule", self.schedule(at), at)
        if self.mode == "absolute":
            if self._scales_itself:  # the optimizer multiplies the group's lr_scale in itself
                return [lr for _ in self.optimizer.param_groups]
            return [lr if g.get("lr_scale", 1.0) == 1.0 else lr * g["lr_scale"]
                    for g in self.optimizer.param_groups]
        bases = self.base_lrs if bases is None else bases
        if self._scales_itself:
            return [base * lr for base in bases]
        # a torch optimizer's group carries its lr_scale in its lr only when create_optimizer built it
        return [base * lr if g.get("lr_scale", 1.0) == 1.0 or g.get("lr_scale_in_lr", False)
                else base * lr * g["lr_scale"] for base, g in zip(bases, self.optimizer.param_groups)]

    def get_lr(self) -> list[float | Tensor]:
        return self._closed_form()

    def _own_lr_tensors(self) -> None:
        """Give every group its own ``lr`` tensor. torch's ``add_param_group`` puts the default tensor ``lr``
        itself into every group that does not set one, and the lrs are written in place (``fill_``): groups
        with different lrs (``lr_scale``, multiplier mode) would all get the last group's value."""
        seen: set[int] = set()
        for group in self.optimizer.param_groups:
            lr = group.get("lr")
            if isinstance(lr, Tensor):
                if id(lr) in seen:
                    group["lr"] = lr = lr.clone()
                seen.add(id(lr))

    def step(self, epoch: int | None = None) -> None:
        """torch's ``step``; when the schedule's value is refused (a NaN, infinite or negative Python number,
        or not a number: :func:`~optkit._validation.check_lr_value`), the error is raised with the position
        (``last_epoch``, ``_step_count``) as it was and no group's ``lr`` changed."""
        position = (self.last_epoch, self._step_count)
        self._own_lr_tensors()
        try:
            super().step(epoch)
        except (TypeError, ValueError):
            self.last_epoch, self._step_count = position
            raise

    def _get_closed_form_lr(self) -> list[float | Tensor]:
        return self._closed_form()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.pop("schedule", None)
        state.pop("mode", None)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` and re-apply the closed-form lr of the loaded position to every group.

        Nothing in ``state_dict`` is trusted; everything is checked before anything changes (a failed load
        leaves scheduler and optimizer as they were): only the keys of :meth:`state_dict` are accepted
        (``'schedule'``, ``'mode'`` and ``'optimizer'`` are ignored; any other key raises ``ValueError``
        naming it, so a loaded dict cannot replace methods or attributes); ``last_epoch`` (required) an int
        in ``[-1, 2^62)``; ``_step_count`` an int in ``[0, 2^62)``; ``base_lrs`` and ``_last_lr`` one entry
        per param group, each a finite real number ``>= 0`` or a dense, real, non-meta one-element tensor
        holding one; ``_is_initial`` and ``_get_lr_called_within_step`` bools; ``_scales_itself`` a bool
        (not loaded: it is a property of the optimizer); ``verbose`` (older torch) a bool. Wrong types raise
        :class:`~optkit._validation.ParameterTypeError` (a ``TypeError`` and a ``ValueError``), bad values
        ``ValueError``. ``_last_lr`` is recomputed from the loaded position.
        """
        where = "ScheduleLR.load_state_dict"
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"{where}: state_dict must be a dict, got {type(state_dict).__name__}")
        unknown = [k for k in state_dict if k not in _SCHED_KEYS and k not in _SCHED_IGNORED]
        if unknown:
            raise ValueError(f"{where}: unknown keys {', '.join(sorted(map(repr, unknown)))}; "
                             f"allowed: {sorted(_SCHED_KEYS)}")
        if "last_epoch" not in state_dict:
            raise ValueError(f"{where}: last_epoch is missing")
        loaded: dict[str, Any] = {}
        for key in ("last_epoch", "_step_count"):
            if key in state_dict:
                loaded[key] = check_count(key, state_dict[key], where=where, tensors=False,
                                          minimum=-1 if key == "last_epoch" else 0)
        for key in ("_is_initial", "_get_lr_called_within_step", "_scales_itself", "verbose"):
            if key in state_dict and not isinstance(state_dict[key], bool):
                value = state_dict[key]
                raise ParameterTypeError(f"{where}: {key} must be a bool, got {type(value).__name__} "
                                         f"({value!r})")
            if key in state_dict and key in ("_is_initial", "_get_lr_called_within_step"):
                loaded[key] = state_dict[key]
        n = len(self.optimizer.param_groups)
        for key in ("base_lrs", "_last_lr"):
            if key in state_dict:
                lrs = _sched_lrs(key, state_dict[key], n, where)
                if key == "base_lrs":
                    loaded[key] = lrs
        # the lrs of the loaded position, computed before anything is assigned
        lrs_now = self._closed_form(loaded["last_epoch"], loaded.get("base_lrs", self.base_lrs))
        # everything is valid: assign
        self.__dict__.update(loaded)
        self._own_lr_tensors()
        for group, lr in zip(self.optimizer.param_groups, lrs_now):
            if isinstance(group["lr"], Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = [
            g["lr"].clone() if isinstance(g["lr"], Tensor) else g["lr"] for g in self.optimizer.param_groups
        ]


# ScheduleLR.load_state_dict: the keys it loads or checks, and those it ignores (configuration, not state)
_SCHED_KEYS = frozenset({"last_epoch", "_step_count", "base_lrs", "_last_lr", "_is_initial",
                         "_get_lr_called_within_step", "_scales_itself", "verbose"})
_SCHED_IGNORED = frozenset({"schedule", "mode", "optimizer"})


def _sched_lrs(key: str, value: Any, n: int, where: str) -> list[float | Tensor]:
    """``value`` checked as ``base_lrs``/``_last_lr``: a list of ``n`` finite reals >= 0 or one-element
    tensors holding one (returned as given, tensors detached and cloned)."""
    if not isinstance(value, (list, tuple)):
        raise ParameterTypeError(f"{where}: {key} must be a list, got {type(value).__name__}")
    if len(value) != n:
        raise ValueError(f"{where}: {key} has {len(value)} entries for {n} param groups")
    out: list[float | Tensor] = []
    for i, lr in enumerate(value):
        name = f"{key}[{i}]"
        if isinstance(lr, Tensor):
            if lr.numel() != 1 or lr.layout != torch.strided or lr.is_meta:
                raise ValueError(f"{where}: {name} must be a dense one-element tensor with data, got "
                                 f"shape {tuple(lr.shape)}, layout {lr.layout}, device {lr.device}")
            if lr.is_complex() or lr.dtype == torch.bool:
                raise ParameterTypeError(f"{where}: {name} must have a real dtype, got {lr.dtype}")
            x = lr.detach().reshape(()).item()
        else:
            x = lr
        try:
            check_real(name, x, where=where, minimum=0.0)
        except TypeError as e:
            raise ParameterTypeError(str(e)) from None
        except OverflowError:  # float() of a huge int
            raise ValueError(f"{where}: {name} must be finite, got an int of {x.bit_length()} bits") from None
        out.append(lr.detach().clone() if isinstance(lr, Tensor) else lr)
    return out
