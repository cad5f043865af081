"""The Keras-style optimizer base: a ``torch.optim.Optimizer`` whose subclasses write only their update rule.

Every optkit optimizer derives from :class:`Optimizer` and states its rule over grouped tensor lists
(:meth:`Optimizer._update`), plus the same rule as out-of-place pointwise math (``_pointwise``, for
``jit_compile`` and for devices without a fused kernel). The base runs the Keras 3 pipeline
(``keras/src/optimizers/base_optimizer.py``) once per ``step()``, with the differences listed in
docs/compatibility.md:

1. gradients: ``None`` skipped; sparse COO densified (unless the optimizer has a sparse rule);
2. unscale by ``grad_scale`` (set by a loss-scale wrapper or ``torch.amp.GradScaler``);
3. clip: ``clipvalue`` (elementwise), ``clipnorm`` (each tensor: g·c/max(‖g‖, c)) or ``global_clipnorm``
   (g·c/max(N, c), all NaN for a non-finite N) — mutually exclusive;
4. decoupled weight decay ``w ← w − w·wd·lr`` on the parameters not excluded (optimizers whose
   ``weight_decay`` means something else set ``_decoupled_weight_decay = False``);
5. the optimizer's update rule with the current learning rate;
6. EMA ``avg ← μ·avg + (1−μ)·w`` over all parameters (the first applied step copies ``w``), and the optional
   overwrite ``w ← avg`` every ``ema_overwrite_frequency`` applied steps;
7. ``iterations += 1``.

When ``found_inf`` (a 0-d tensor, 1.0 = skip) is set by a wrapper, the whole pipeline is a no-op on device
(no host sync): the fused kernels take ``found_inf``, and every other factor is blended with it, so a skipped
step changes no parameter, slot, average or counter. All state exists from construction, so nothing is
created lazily on a skipped step. ``step_applied`` holds the outcome as a 0-d bool tensor.

Layering: parameters are checked and normalised by :mod:`optkit._params`; the cached per-group structure of
the dense pass is :mod:`optkit._plan`; every call of a torch fused kernel goes through the gate in
:mod:`optkit._fused` (:meth:`Optimizer._kernel_parts`); ``jit_compile`` is :mod:`optkit._compile`; the
TF/Keras methods are the :class:`optkit._tf_surface.TFSurface` mixin.

Performance: unscaling and global clipping fold into the optimizer's fused kernel as one scalar factor, so the
only extra traffic is one read-only norm pass; weight decay, the update and the EMA run block by block over
cache-sized chunks (``_multi_tensor.blocks``) so their chain costs about one sweep over memory.

Gradients: ``step()`` leaves each ``.grad`` as ``torch.optim`` does (bitwise, or ``g/S`` under a loss scale).
Update rules that use their gradients as scratch (LARS, LAMB, Nesterov SGD, the multipliers, a global clip
factor folded into a kernel) get in-cache copies of the gradient chunks in the blocked pass (no extra sweep);
``clipnorm``/``clipvalue`` transform whole copies. ``scratch_grads=True`` (the train op) skips the copies.
"""

from __future__ import annotations

import collections
import functools
import inspect
import itertools
import operator
import re
import warnings
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.optim.optimizer as _torch_optimizer
from torch import Tensor
from typing_extensions import Self

from . import _fused
from . import _multi_tensor as mt
from ._amp import AmpProtocol
from ._arguments import GROUP_ALIASES, accepted_keywords, check_call, check_nesterov, unknown_arguments_error
from ._compile import chain, compiled_chain, compiled_function, warn_compile_fallback
from ._gc import gc_paused
from ._params import normalize_param_groups
from ._plan import (
    FlatPart,
    Plan,
    PlanView,
    RowMultipliers,
    RunAux,
    _outside_stacklevel,
    check_slot_fits,
    scratch_view,
)
from ._state_dict import (
    adopt_torch_groups,
    check_group_types,
    check_loaded_slot,
    torch_required,
    validate_state_dict,
)
from ._tf_surface import TFSurface, autograd_pairs, is_schedule
from ._typing import LearningRate, OptimizerOptions, ParamsT
from ._validation import check_number, is_number
from .flat import _VIEWS_RESTORED, flat_buffer_of

__all__ = ["Optimizer", "check_number", "check_nesterov", "autograd_pairs", "ParamsT", "LearningRate",
           "OptimizerOptions"]

_GRAD = operator.attrgetter("grad")
_PARAMS = operator.itemgetter("params")

#: per-tensor multipliers fold into the kernel (one call per tensor) only for groups with at least this many
#: elements per tensor on average: below it a call per tensor costs more than the blocked pass's in-cache
#: multiply (LARC(SGD), 2,000 × 4,096: 45 vs 37 ms per step; ResNet-50 shapes: 27 vs 29 ms)
FOLD_MIN_NUMEL = 1 << 16

#: ``jit_compile=True`` warns before compiling a group of more tensors than this: torch.compile traces one
#: graph input per tensor (minutes at 10,000 tensors on this project's 2-core CPU)
COMPILE_WARN_TENSORS = 1000


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


#: constructor arguments that are not optimizer-wide options (``name`` is also a common user label of a group)
_GROUP_KEYS_ANYWHERE = frozenset({"self", "params", "learning_rate", "lr", "kwargs", "hyper", "name",
                                  "amsgrad", "weight_decay"})


@functools.cache
def _wide_options(cls: type) -> frozenset[str]:
    """The constructor arguments of ``cls`` and of the base (``clipnorm``, ``use_ema``, ...) that hold for the
    whole optimizer: a param group holding one would ignore it."""
    names = {n for c in (Optimizer, cls) for n in inspect.signature(c.__init__).parameters}
    return frozenset(names - _GROUP_KEYS_ANYWHERE)


class _StateVersion:
    """A counter the optimizer's state dicts bump on every change of an entry (see :class:`_TrackedState`)."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


_ABSENT = object()


class _CountsChanges:
    """What a change of a state mapping does besides changing it: count it in ``self._version`` (the
    optimizer's :class:`_StateVersion`), so that cached plans holding the old slot tensors are rebuilt."""

    __slots__ = ()
    _version: _StateVersion

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(key)  # type: ignore[misc]
        self._version.n += 1

    def pop(self, *args: Any) -> Any:
        self._version.n += 1
        return super().pop(*args)  # type: ignore[misc]

    def popitem(self) -> Any:
        self._version.n += 1
        return super().popitem()  # type: ignore[misc]

    def clear(self) -> None:
        self._version.n += 1
        super().clear()  # type: ignore[misc]

    def __ior__(self, other: Any) -> Any:
        self.update(other)  # type: ignore[attr-defined]
        return self


class _Slots(_CountsChanges, dict):
    """One parameter's state (slot name -> tensor) that counts its changes: cached plans hold the slot
    tensors, so a slot replaced, reset or deleted by the user (torch.optim reads ``state`` afresh each step)
    must rebuild them. In-place changes of a slot tensor need nothing. A plain dict in the optimizer's
    ``state_dict()``."""

    __slots__ = ("_version",)

    def __init__(self, version: _StateVersion, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._version = version

    def __setitem__(self, key: Any, value: Any) -> None:
        if dict.get(self, key, _ABSENT) is not value:
            self._version.n += 1
        super().__setitem__(key, value)

    def update(self, *args: Any, **kwargs: Any) -> None:
        self._version.n += 1
        super().update(*args, **kwargs)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self._version.n += 1
        return super().setdefault(key, default)

    def __reduce__(self) -> Any:
        return (_Slots, (self._version, dict(self)))


class _NewSlots:
    """The default factory of :class:`_TrackedState` (a class, so the state pickles)."""

    __slots__ = ("version",)

    def __init__(self, version: _StateVersion) -> None:
        self.version = version

    def __call__(self) -> _Slots:
        return _Slots(self.version)


class _TrackedState(_CountsChanges, collections.defaultdict):
    """``optimizer.state`` (parameter -> :class:`_Slots`) counting the changes of its entries and theirs;
    copies (``copy()``, ``|``) are plain ``defaultdict(dict)`` of the same entries.

    torch's optimizer contract lets a state-dict hook or the user keep anything under a key that is not a
    parameter (``opt.state["note"] = 1``): such entries are stored as they are (not tracked: no step reads
    them) and round-trip through ``state_dict()`` / ``load_state_dict()`` untouched, as in ``torch.optim``.
    A parameter's entry must be a dict of slots (``TypeError`` otherwise, nothing changed)."""

    def __init__(self, version: _StateVersion, items: Any = ()) -> None:
        super().__init__(_NewSlots(version))
        self._version = version
        for key, value in dict(items).items():
            dict.__setitem__(self, key, self._tracked(key, value))

    def _tracked(self, key: Any, value: Any) -> Any:
        if not isinstance(key, Tensor):  # not a parameter's state: kept as it is (torch's contract)
            return value
        if isinstance(value, _Slots) and value._version is self._version:
            return value
        if not isinstance(value, dict):
            raise TypeError(f"optimizer.state: the state of a parameter must be a dict (slot name -> "
                            f"tensor), got {type(value).__name__}")
        return _Slots(self._version, value)

    def __setitem__(self, key: Any, value: Any) -> None:
        value = self._tracked(key, value)
        self._version.n += 1
        super().__setitem__(key, value)

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = {} if default is None and isinstance(key, Tensor) else default
        return self[key]

    def copy(self) -> collections.defaultdict:
        """A plain ``defaultdict(dict)`` holding the same entries (shallow, as ``dict.copy``)."""
        return collections.defaultdict(dict, self)

    __copy__ = copy

    def __or__(self, other: Any) -> collections.defaultdict:
        out = self.copy()
        out.update(other)
        return out

    def __ror__(self, other: Any) -> collections.defaultdict:
        out = collections.defaultdict(dict, other)
        out.update(self)
        return out

    def __reduce__(self) -> Any:
        return (_TrackedState, (self._version, dict(self)))


def record_field(name: str, doc: str | None = None) -> property:
    """A property kept as ``self._record.<name>``: step bookkeeping of optimizers and wrappers lives in a
    record object (:class:`_HostRecord`, ``_wrapper._WrapperRecord``) because ``torch.compile`` replays the
    mutations of plain objects but drops attribute assignments on an optimizer."""

    def get(self: Any) -> Any:
        return getattr(self._record, name)

    def set_(self: Any, value: Any) -> None:
        setattr(self._record, name, value)

    return property(get, set_, doc=doc)


class _HostRecord:
    """An optimizer's host-side step bookkeeping: the count of applied updates while it is exact (no step
    could have been skipped since it was last read from the device), and the last step's outcome. It is an
    object of its own because ``torch.compile(opt.step)`` replays the mutations of plain objects but drops
    attribute assignments on the optimizer itself."""

    __slots__ = ("iterations", "exact", "applied", "seen")

    def __init__(self) -> None:
        self.iterations = 0
        self.exact = True
        self.applied: Tensor | None = None
        #: (the count tensor, its version counter) when the host last counted: a write from outside
        # (``opt.iterations.zero_()``) changes the version, and the host count is no longer the count
        self.seen: tuple[Tensor, int] | None = None


class Optimizer(AmpProtocol, TFSurface, torch.optim.Optimizer):
    """Base class of optkit optimizers (Keras 3 semantics on a ``torch.optim.Optimizer``).

    Args:
        params: tensors, ``model.named_parameters()`` or param-group dicts (all named or all unnamed). Names
            are used by :meth:`exclude_from_weight_decay` and by name-based options such as LARS
            ``skip_list``; names given here win over names stored in a loaded state dict.
        learning_rate: a number, a 0-d tensor (kept as the groups' ``lr``, as torch does), a
            :class:`~optkit.schedules.LearningRateSchedule` (called with ``iterations``, the count of applied
            updates) or a callable (zero arguments, or one: the step).
        lr: torch's name of ``learning_rate``, accepted by every optkit optimizer (``TypeError`` when both
            are given).
        weight_decay: decoupled decay, ``w ← w − w·weight_decay·lr`` before the update (Keras form).
        clipnorm / clipvalue / global_clipnorm: gradient clipping; at most one may be set.
        use_ema, ema_momentum, ema_overwrite_frequency: exponential moving average of the weights
            (Keras 3: the first applied step copies the weights; ``finalize_variable_values()`` swaps in).
        ema_warmup: the EMA decay of the update after ``k`` applied ones is ``min(ema_momentum,
            (1 + k)/(10 + k))`` (``tf.train.ExponentialMovingAverage(num_updates=k)``'s warm-up), so early
            averages are not dominated by the initial weights.
        ema_buffers: an ``nn.Module`` (its floating-point buffers, e.g. BatchNorm running statistics) or
            ``(name, tensor)`` pairs whose values are averaged with the same decay after every applied step;
            :meth:`ema_weights` and :meth:`finalize_variable_values` swap them too, and their averages are
            in :meth:`state_dict` (``"ema_buffers"``). Needs ``use_ema=True``; not part of
            :meth:`get_config` (it names live tensors: give it to ``from_config`` again).
        jit_compile: compile the grouped update with ``torch.compile`` (falls back to eager with a warning).
        mesh: a ``DeviceMesh`` all DTensor parameters must live on (scalar state is kept on its device type).
        name: the optimizer's name (defaults to the class name).
        amsgrad: accepted and ignored, as in tf.keras's DTensor ``SGD`` (``Adam`` has its own).
        scratch_grads: let ``step()`` use the gradients as scratch (default False). By default ``step()``
            leaves every ``.grad`` as ``torch.optim`` does: bitwise as it was, or, when the step unscales a
            loss scale ``S`` (``grad_scale``: a loss-scale wrapper, ``torch.amp.GradScaler``), holding the
            unscaled ``g/S`` as ``GradScaler.unscale_`` leaves it (a skipped step may leave it scaled);
            clipping, multipliers, decay and the update never reach it. With ``scratch_grads=True`` the
            gradients hold unspecified values after ``step()`` (clear them before the next backward), which
            spares the in-cache copies some update rules (LARS, LAMB, Nesterov SGD) otherwise work on; the
            train op (:func:`optkit.optimize_loss`), which clears the gradients after each update, sets it.

    Every optimizer takes ``params`` and then the learning rate positionally; everything else is keyword-only.
    A keyword of torch.optim, timm, apex or Keras that optkit spells otherwise (``betas``, ``eps``,
    ``maximize``, ``trust_coefficient``, ...) is refused before anything is built, with the optkit spelling
    (``optkit._arguments.HINTS``); ``use_nesterov`` (TF1) is accepted for ``nesterov``.

    Subclasses set ``slot_names``, implement :meth:`_update` and ``_pointwise`` (and optionally
    :meth:`_prepare`, :meth:`_slot_fill`, :meth:`_sparse_update`).
    """

    slot_names: tuple[str, ...] = ()
    #: whether the group key ``weight_decay`` means Keras decoupled decay (LARS uses it for its own rule)
    _decoupled_weight_decay = True
    #: whether _update is purely elementwise given per-tensor aux values (may run on chunk views)
    _blockable = True
    #: run the blocked pass even for a one-kernel chain (update rules made of several in-cache kernels)
    _always_block = False
    #: whether the optimizer has its own rule for sparse gradients (:meth:`_sparse_update`)
    _sparse_rule = False
    #: whether :meth:`_prepare` reads the gradients (then per-tensor multipliers are applied before it)
    _prepare_reads_grads = False
    #: whether :meth:`_update` can fold per-tensor gradient multipliers into its kernel (they then arrive as
    #: ``aux``, one 0-d tensor or None per tensor, instead of an in-cache multiply; needs no ``_prepare``);
    #: used for groups whose tensors are large on average (:data:`FOLD_MIN_NUMEL`, :meth:`_folds_mult`)
    _mult_in_kernel = False

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        # before Python binds the arguments (optkit._arguments): Momentum(params, betas=...) gets its hint,
        # not "missing required argument 'momentum'", and `lr` given with `learning_rate` is seen here
        check_call(cls.__name__, len(args), kwargs, accepted_keywords(cls, Optimizer))
        return super().__new__(cls)

    def __init__(
        self,
        params: ParamsT,
        learning_rate: LearningRate | None = 0.01,
        *,
        lr: LearningRate | None = None,
        weight_decay: float | None = None,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
        use_ema: bool = False,
        ema_momentum: float = 0.99,
        ema_overwrite_frequency: int | None = None,
        ema_warmup: bool = False,
        ema_buffers: Any = None,
        jit_compile: bool = False,
        mesh: Any = None,
        name: str | None = None,
        amsgrad: bool = False,
        block_numel: int = 1 << 20,
        scratch_grads: bool = False,
        **hyper: Any,
    ) -> None:
        # ---- validation first: nothing is created if an argument is bad (aliases and hints: see __new__)
        if lr is not None:  # torch's name (given with `learning_rate`: refused by __new__)
            learning_rate = lr
        if learning_rate is None:
            raise TypeError(f"{type(self).__name__}: missing the learning rate: give `learning_rate` (or "
                            "torch's `lr`)")
        lr_value = self._validate_learning_rate(learning_rate)
        check_number("weight_decay", weight_decay, low=0.0, allow_none=True)
        check_number("clipnorm", clipnorm, low=0.0, low_open=True, allow_none=True)
        check_number("clipvalue", clipvalue, low=0.0, low_open=True, allow_none=True)
        check_number("global_clipnorm", global_clipnorm, low=0.0, low_open=True, allow_none=True)
        set_clips = [n for n, v in (("clipnorm", clipnorm), ("clipvalue", clipvalue),
                                    ("global_clipnorm", global_clipnorm)) if v is not None]
        if len(set_clips) > 1:
            raise ValueError(
                f"Only one of `clipnorm`, `clipvalue` and `global_clipnorm` can be set, got {set_clips}"
            )
        if not isinstance(use_ema, bool):
            raise TypeError(f"`use_ema` must be a bool, got {use_ema!r}")
        check_number("ema_momentum", ema_momentum, low=0.0, high=1.0)
        if ema_overwrite_frequency is not None:
            check_number("ema_overwrite_frequency", ema_overwrite_frequency, low=1, integer=True)
        if not isinstance(ema_warmup, bool):
            raise TypeError(f"`ema_warmup` must be a bool, got {ema_warmup!r}")
        ema_buffer_list = self._collect_ema_buffers(ema_buffers, use_ema)
        if not isinstance(jit_compile, bool):
            raise TypeError(f"`jit_compile` must be a bool, got {jit_compile!r}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"`name` must be a str, got {name!r}")
        check_number("block_numel", block_numel, low=1, integer=True)
        if not isinstance(scratch_grads, bool):
            raise TypeError(f"`scratch_grads` must be a bool, got {scratch_grads!r}")
        declared = accepted_keywords(type(self), Optimizer)
        unknown = sorted(k for k in hyper if k not in declared)
        if unknown:  # a typo such as LARS(eta=...) must not train silently with the default
            raise unknown_arguments_error(type(self).__name__, unknown, declared)
        groups, named = normalize_param_groups(params)
        for g in groups:
            self._group_key_aliases(g, hyper)
            self._check_group_keys(g, hyper)
        if mesh is not None:
            self._check_mesh(mesh, groups)

        self.name = name or type(self).__name__
        self.clipnorm = clipnorm
        self.clipvalue = clipvalue
        self.global_clipnorm = global_clipnorm
        self.use_ema = use_ema
        self.ema_momentum = float(ema_momentum)
        self.ema_overwrite_frequency = ema_overwrite_frequency
        self.ema_warmup = ema_warmup
        self._ema_buffers = ema_buffer_list  # [(name, buffer)]: floating buffers averaged with the weights
        self._ema_buffer_avgs = [b.detach().clone(memory_format=torch.preserve_format)
                                 for _, b in ema_buffer_list]
        self.jit_compile = jit_compile
        self.mesh = mesh
        self.amsgrad = amsgrad
        self.block_numel = int(block_numel)
        self.scratch_grads = scratch_grads
        self._learning_rate = learning_rate if lr_value is None else lr_value
        self._wd_exclude_ids: set[int] = set()
        self._wd_exclude_regex: re.Pattern | None = None
        self._extra_variables: list[Tensor] = []
        self._compile_state = "untried"  # "ok" once a compiled step ran, "failed" after a fallback
        self._plans: dict[int, Plan] = {}  # id(group) -> cached structure of the dense pass
        self._fold_cache: dict[int, tuple] = {}  # id(group) -> (params list, its length, _folds_mult)
        self._plan_version = 0
        self._fp64_cache: dict[int, tuple] = {}
        self._block = None  # the Block of the blocked pass being run (kernel-gate and grouping hints)
        #: set by optimize_loss around its step, whose gradients it clears right after: the blocked pass then
        #: zeroes flat gradient chunks while they are in cache and records the groups it zeroed (ids), which
        #: optimize_loss takes and hands to _zero_grad to skip
        self._zero_grads_in_pass = False
        self._zeroed_groups: set[int] = set()
        self._step_inv: Tensor | None = None  # 1/S for the caller's gradients of the group being stepped
        self._grads_protected = False  # (_prepare: the gradients it gets are the caller's; see _guards)
        self._shadow_src: tuple | None = None  # (a _shadow_grads rule's _prepare copies these)
        #: plans whose parameter storages a wrapper's probe (_flat_part) just checked, by group id: the step
        #: right after (which takes the probe's gathered lists) does not check them again
        self._fit_seen: dict[int, Plan] = {}
        self._ema_swapped = False  # inside an ema_weights() block
        #: id(group) -> (the lr object a schedule learning rate wrote last, its version): a change from
        #: outside (a torch lr scheduler) that the next value overwrites is warned about once
        #: (_check_lr_untouched)
        self._lr_written: dict[int, tuple[Any, int | None]] = {}
        self._lr_override_warned = False
        self._any_dtensor = False  # whether a parameter is a DTensor (set as groups are added)
        #: id(group) -> ((its active slots, its length), its parameters and their names then)
        self._slots_seen: dict[int, tuple] = {}
        self._flat_slots: dict[tuple[int, str], Tensor] = {}  # (flat parameter storage, slot) -> flat slot
        self._record = _HostRecord()

        first = next(p for g in groups for p in g["params"])
        self._state_device = mt.local(first).device
        self._iterations = torch.zeros((), dtype=torch.int64, device=self._state_device)
        self._mark_host_count()
        self.step_applied = torch.ones((), dtype=torch.bool, device=self._state_device)

        initial_lr = lr_value if lr_value is not None else self._evaluate_lr_host(0)
        defaults = dict(lr=initial_lr, weight_decay=0.0 if weight_decay is None else float(weight_decay))
        defaults.update(hyper)
        self._weight_decay_arg = weight_decay
        self._hyper_keys = tuple(hyper)  # a subclass's own options (get_config's default _hyper_config)
        #: per param group: whether its lr is the optimizer's (no "lr" of its own): the learning rate
        #: get_config records and a load restores is such a group's
        self._lr_defaulted = ["lr" not in g for g in groups]
        super().__init__(groups, defaults)
        self._adopt_state()
        self._named = named  # set last: torch's __init__ adds the constructor's groups without the name check

    # step bookkeeping kept in self._record (see _HostRecord)
    step_applied = record_field("applied", "Whether the last step applied an update (0-d bool tensor on the "
                                           "state device).")
    _host_iterations = record_field("iterations")
    _host_exact = record_field("exact")

    # ------------------------------------------------------------------------------------------------ set-up

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

    @staticmethod
    def _group_key_aliases(group: dict, own: Any) -> None:
        """A param group may say ``"learning_rate"`` (the TF/Keras name) instead of torch's ``"lr"``, and
        ``"use_nesterov"`` (TF1's) for ``"nesterov"`` where the optimizer has it (``own``: its group keys)."""
        for alias, key in GROUP_ALIASES.items():
            if alias in group and key in own:
                if key in group:
                    raise ValueError(f"a param group sets both {key!r} and {alias!r}; keep one")
                group[key] = group.pop(alias)
        if "learning_rate" in group:
            if "lr" in group:
                raise ValueError("a param group sets both 'lr' and 'learning_rate'; keep one")
            value = group.pop("learning_rate")
            if isinstance(value, Tensor):
                if value.numel() != 1:
                    raise ValueError("a param group's 'learning_rate' tensor must have one element")
            else:
                check_number("learning_rate", value, low=0.0)
            group["lr"] = value

    @staticmethod
    def _check_mesh(mesh: Any, groups: list[dict]) -> None:
        """Every parameter must be a DTensor on ``mesh`` or a sub-mesh of it (``optkit._mesh.check_mesh``)."""
        from ._mesh import check_mesh

        check_mesh(((n, p) for g in groups for n, p in zip(g["param_names"], g["params"])), mesh)

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group (torch API); its parameters get their optimizer state right away. Its parameters
        must be named if and only if the optimizer's are."""
        if not hasattr(self, "_named"):  # torch's __init__ adding the constructor's groups
            super().add_param_group(param_group)
            self._build_group(self.param_groups[-1])
            return
        start = sum(len(g["params"]) for g in self.param_groups)
        (group,), named = normalize_param_groups([param_group], start=start)
        self._group_key_aliases(group, self.defaults)
        self._check_group_keys(group, self.defaults)
        if named != self._named:
            raise ValueError(
                "all optimizer params should be with/without names: this optimizer's parameters are "
                + ("named; pass (name, tensor) pairs" if self._named else "unnamed; pass plain tensors")
            )
        if self.mesh is not None:
            self._check_mesh(self.mesh, [group])
        defaulted = "lr" not in group
        super().add_param_group(group)
        self._lr_defaulted = [*getattr(self, "_lr_defaulted", []), defaulted]
        self._invalidate_plans()
        self._build_group(self.param_groups[-1])

    def _check_group_keys(self, group: dict, own: Any) -> None:
        """A param group must not hold what this optimizer would silently ignore there: an optimizer-wide
        option (``clipnorm``, ``use_ema``, ...: constructor arguments) or torch's name of a hyperparameter
        that optkit spells otherwise (``betas``, ``eps``, ``nesterov``; ``own``: this optimizer's group keys),
        or a torch switch at a value this rule does not compute (``maximize=True``); ``ValueError`` naming
        the key."""
        cls = type(self).__name__
        wide = _wide_options(type(self))
        for key in group:
            if key in wide and key not in own:
                raise ValueError(f"{cls}: param group key {key!r} is an optimizer-wide option; pass it to "
                                 "the constructor (a group would ignore it)")
        for key, value in group.items():
            if isinstance(own.get(key), bool) and not isinstance(value, bool):
                raise TypeError(f"{cls}: param group key {key!r} must be a bool, got {value!r}")
        aliases = getattr(self, "_torch_group_keys", {})
        for key, ours in aliases.items():
            if key in group and key not in own:
                raise ValueError(f"{cls}: param group key {key!r} is torch's name; {cls} takes "
                                 f"{' and '.join(map(repr, ours))}")
        for key, want in torch_required(self).items():
            if key in group and key not in own and group[key] != want:
                raise ValueError(f"{cls}: param group key {key!r}={group[key]!r} is not supported (the rule "
                                 f"computes with {key}={want!r})")

    def _build_group(self, group: dict) -> None:
        views = self.__dict__.setdefault("_flat_grad_views", {})
        for p in group["params"]:
            self._init_state(p, group)
            g = p.grad
            if g is not None and not g.is_sparse and g.shape == p.shape and flat_buffer_of(p) is not None:
                # its gradient view in the flat gradient (optkit.flat_parameters), which zero_grad points
                # .grad back at after a model.zero_grad() or a replacement (see _zero_grad)
                views[id(p)] = (g, g.data_ptr(), p.untyped_storage().data_ptr())
        self._any_dtensor = self._any_dtensor or any(mt.is_dtensor(p) for p in group["params"])
        self._record_group(group)

    def _record_group(self, group: dict) -> None:
        """Remember the group's parameters and names: what :meth:`_ensure_slots` compares the group's list
        with (the names follow their parameters when its length changes). Made again when the groups are
        new dicts (a copy, a load) or their tensors were replaced (fp32 masters)."""
        self.__dict__.setdefault("_slots_seen", {})[id(group)] = (
            (self._active_slots(group), len(group["params"])), list(group["params"]),
            list(group.get("param_names", ())))

    def _active_slots(self, group: dict) -> tuple[str, ...]:
        """The slots ``group`` uses (default: all of ``slot_names``; SGD keeps no momentum buffer for a
        group whose momentum is 0)."""
        return self.slot_names

    def _ensure_slots(self) -> None:
        """Create the slots a group started to use since the last step (a scheduler such as ``OneCycleLR``
        turning momentum on): zeros, which is what the rule would start from; O(groups) per step."""
        state = self.state
        if type(state) is not _TrackedState or state._version is not self._state_version:
            self._adopt_state()  # (``opt.state = defaultdict(dict)``, or torch's load put a plain one)
        if self._state_seen != self._state_version.n:  # an entry was replaced, reset or deleted since
            for g in self.param_groups:  # (missing slots come back as a new parameter's, like torch's)
                for p in g["params"]:
                    self._init_state(p, g)
            self._invalidate_plans()
            self._state_seen = self._state_version.n
        start = 0
        for g in self.param_groups:
            # (the count too: a parameter appended to or removed from a group's list gets its state, as
            # torch's lazily, and the names follow their parameters)
            seen = (self._active_slots(g), len(g["params"]))
            record = self._slots_seen.get(id(g))
            if record is None or record[0] != seen:
                self._pair_names(g, record, start)
                for p in g["params"]:
                    self._init_state(p, g)
                self._record_group(g)
                self._invalidate_plans()
                self._state_seen = self._state_version.n
            start += len(g["params"])

    @staticmethod
    def _pair_names(group: dict, record: tuple | None, start: int) -> None:
        """``param_names`` after the group's list changed without its names (torch's idiom): each parameter
        keeps the name it had when last seen (``record``), a new one gets ``param_<position>`` (as unnamed
        parameters are named). Names kept in step with the list (as many as parameters) are left alone."""
        params = group["params"]
        names = group.setdefault("param_names", [])
        if len(names) == len(params):
            return
        if record is not None:
            by_id = {id(p): n for p, n in zip(record[1], record[2])}
            new = [by_id.get(id(p)) for p in params]
        else:
            new = list(names[:len(params)]) + [None] * (len(params) - len(names))
        names[:] = [n if n is not None else f"param_{start + j}" for j, n in enumerate(new)]

    def _init_missing_state(self, group: dict, params: Sequence[Tensor]) -> None:
        """State for parameters that lack some (one put into a group's list in place of another), as torch
        creates it lazily."""
        for p in params:
            st = self.state.get(p)
            if st is None or any(s not in st for s in self._active_slots(group)) or (
                    self.use_ema and "average" not in st):
                self._init_state(p, group)

    def _adopt_state(self) -> None:
        """Make ``self.state`` a :class:`_TrackedState` (entries kept) with a new version counter."""
        version = _StateVersion()
        self.state = _TrackedState(version, self.state)
        self._state_version = version
        self._state_seen = -1  # (checked, and missing slots made, on the next step)

    def _init_state(self, p: Tensor, group: dict) -> None:
        st = self.state[p]
        st["step"] = self._iterations
        for slot in self._active_slots(group):
            if slot not in st:
                st[slot] = self._new_slot(p, slot, self._slot_fill(slot, group))
        if self.use_ema and "average" not in st:  # from the weights: a group added later has no first step
            with torch.no_grad():
                st["average"] = self._new_slot(p, "average", 0.0).copy_(p.detach())

    def _slot_fill(self, slot: str, group: dict) -> float:
        """The initial value of ``slot`` (0; RMSProp's ``rms`` starts at 1, Adagrad's and Ftrl's accumulators
        at ``initial_accumulator_value``). Subclasses override."""
        return 0.0

    def _new_slot(self, p: Tensor, slot: str, fill: float) -> Tensor:
        """A slot for ``p`` filled with ``fill``: like ``p`` (its placement and memory format), or, for a
        parameter in a flat buffer (:func:`optkit.flat_parameters`), a view at the same place in a flat buffer
        of this slot, so that the optimizer can step the whole buffer at once."""
        flat = flat_buffer_of(p)
        if flat is None:
            return torch.full_like(p, fill, memory_format=torch.preserve_format)
        key = (flat.untyped_storage().data_ptr(), slot)
        buf = self._flat_slots.get(key)
        if buf is None or buf.numel() != flat.numel():
            buf = self._flat_slots[key] = torch.empty_like(flat)
        view = buf.as_strided(p.shape, p.stride(), p.storage_offset() - flat.storage_offset())
        return view.fill_(fill)

    def _refill_initial_slots(self, replaced: Sequence[tuple[Tensor, Tensor, dict]]) -> bool:
        """Each ``(old, new, group)``: ``new`` took ``old``'s place in ``group`` and holds its state, cast to
        ``new``'s dtype (a mixed-precision wrapper's fp32 master of a half parameter). When that state is
        still what construction built for ``old``, rebuild ``new``'s slots as construction builds them
        (:meth:`_init_state`: ``_slot_fill`` in ``new``'s precision; a half fill such as fp16(0.1) =
        0.0999755859375 cast up would make the run drift from the one built on ``new``). Returns whether it
        did.

        "Still what construction built" is decided from the values, for all of ``replaced`` at once (one host
        read, at construction time): no update applied (``iterations`` is 0) and every slot of
        ``_active_slots(group)`` equal, everywhere, to its fill rounded to ``old``'s dtype. State written by a
        step, a loaded checkpoint or the user (unless it holds exactly those values) is kept as it is; the
        EMA ``average`` (a copy of the weights) and any other entry are never rebuilt."""
        if not replaced:
            return False
        dev = self._iterations.device
        touched = [self._iterations.ne(0)]
        for old, new, group in replaced:
            st = self.state.get(new)
            for slot in self._active_slots(group):
                v = None if st is None else st.get(slot)
                if v is None:  # (made at the first step, in new's precision)
                    continue
                if not isinstance(v, Tensor) or v.shape != new.shape:
                    return False
                fill = torch.tensor(self._slot_fill(slot, group), dtype=old.dtype).to(v.dtype)
                touched.append(mt.local(v).ne(fill.to(mt.local(v).device)).any().to(dev))
        if bool(torch.stack(touched).any()):
            return False
        for _, new, group in replaced:
            st = self.state[new]
            for slot in self._active_slots(group):
                st.pop(slot, None)
            self._init_state(new, group)
        return True

    def build(self, var_list: Iterable[Tensor] | None = None) -> None:
        """Create missing optimizer state for ``var_list`` (default: every parameter). Idempotent.

        optkit builds state at construction so a skipped first step creates nothing; this exists
        for the Keras API and for parameters whose state was removed.
        """
        known = {id(p): g for g in self.param_groups for p in g["params"]}
        vs = [p for g in self.param_groups for p in g["params"]] if var_list is None else list(var_list)
        for v in vs:
            if id(v) not in known:
                raise ValueError("build(): variable is not one of the optimizer's parameters")
            self._init_state(v, known[id(v)])
        self._invalidate_plans()

    def add_variable(
        self,
        shape: Sequence[int] | int = (),
        dtype: torch.dtype | None = None,
        initializer: str | Callable = "zeros",
        name: str | None = None,
    ) -> Tensor:
        """Create an extra optimizer variable (kept in :meth:`variables`); ``initializer`` is
        ``"zeros"``, ``"ones"`` or a callable ``(shape, dtype) -> Tensor``."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        dtype = dtype or torch.get_default_dtype()
        if initializer == "zeros":
            v = torch.zeros(shape, dtype=dtype, device=self._state_device)
        elif initializer == "ones":
            v = torch.ones(shape, dtype=dtype, device=self._state_device)
        elif callable(initializer):
            v = torch.as_tensor(initializer(shape, dtype), dtype=dtype, device=self._state_device)
        else:
            raise ValueError(f"`initializer` must be 'zeros', 'ones' or a callable, got {initializer!r}")
        v._optkit_name = name  # type: ignore[attr-defined]
        self._extra_variables.append(v)
        return v

    # ------------------------------------------------------------------------------------------------ lr

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
        out = mt.scalar(value, dtype, self._state_device)
        out.host_value = value  # the number itself, for kernels that take a Python float (no device read)
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

    @property
    def iterations(self) -> Tensor:
        """Number of applied updates (0-d int64 tensor; skipped steps do not count). The live count: written
        in place (``opt.iterations.zero_()``), schedules, the EMA and its overwrite cadence follow it; a
        write that bypasses the tensor's version counter (through ``.data`` or a collective) is followed by
        schedules and the EMA, but the ``ema_overwrite_frequency`` cadence keeps its own count until
        :meth:`load_state_dict`."""
        return self._iterations

    # ------------------------------------------------------------------------------------------------ decay

    def exclude_from_weight_decay(
        self, var_list: Iterable[Tensor] | None = None, var_names: Iterable[str] | None = None
    ) -> None:
        """Exclude parameters from weight decay: ``var_list`` by identity, ``var_names`` as regexes searched
        (``re.search``) in each parameter's name (from ``named_parameters()``)."""
        if var_list is not None:
            vl = list(var_list)
            if not all(isinstance(v, Tensor) for v in vl):
                raise TypeError("`var_list` must contain Tensors")
            self._wd_exclude_ids.update(id(v) for v in vl)
            self._invalidate_plans()
        if var_names is not None:
            if isinstance(var_names, str):
                raise TypeError("`var_names` must be a list of strings, not a single string")
            names = sorted(set(var_names))
            if not all(isinstance(n, str) for n in names):
                raise TypeError("`var_names` must contain strings")
            if names and not self._named:
                raise ValueError(
                    "exclude_from_weight_decay(var_names=...) matches parameter names, but this optimizer "
                    "got its parameters without names (param_<i>), so nothing would match; build it from "
                    "model.named_parameters(), or pass var_list=[...] instead"
                )
            if names:
                pattern = "|".join(names)
                if self._wd_exclude_regex is not None:
                    pattern = self._wd_exclude_regex.pattern + "|" + pattern
                self._wd_exclude_regex = re.compile(pattern)
                self._invalidate_plans()

    def _use_weight_decay(self, p: Tensor, name: str) -> bool:
        if id(p) in self._wd_exclude_ids:
            return False
        if self._wd_exclude_regex is not None and self._wd_exclude_regex.search(name):
            return False
        return True

    # ------------------------------------------------------------------------------------------------ step

    def whole_grads(self, seen: dict | None = None) -> list[Tensor] | None:
        """The gradients as few tensors, for reductions over all of them (wrappers' non-finite checks):
        each group's flat gradient when every group's cached plan is flat (:func:`optkit.flat_parameters`) and
        this step's gradients are its views; None otherwise (then use the per-parameter gradients).

        ``seen``: a dict that receives what was read of each group (keyed by the group's id) when the result
        is not None; optkit's wrappers and ``optimize_loss`` hand it to the step that follows, which then
        does not read the gradients again."""
        out, got = [], {}
        for group in self.param_groups:
            plan = self._plans.get(id(group))
            flat = None if plan is None else plan.flat
            if flat is None:
                return None
            idx, ps, gs = self._gather(group)
            if gs is not flat.grad_objs:  # new objects for the same views are adopted, else per tensor
                if len(ps) != len(group["params"]) or not flat.same_grads(gs):
                    return None
                idx, gs = flat.all_idx, flat.grad_objs
            got[id(group)] = (idx, ps, gs)
            out.append(flat.grad)
        if seen is not None:
            seen.update(got)
        return out

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch semantics, except for parameters in flat buffers (:func:`optkit.flat_parameters`): their
        gradients are zeroed in place, keeping the views (one fill per group whose plan holds them flat)."""
        self._zero_grad(set_to_none, ())

    def _zero_grad(self, set_to_none: bool, skip: Collection[int]) -> None:
        """:meth:`zero_grad` except for the groups whose ids are in ``skip`` (their flat gradients were zeroed
        by the step that just ran, see ``_zero_grads_in_pass``)."""
        rest: list[list[Tensor]] = []
        for group in self.param_groups:
            plan = self._plans.get(id(group))
            flat = None if plan is None else plan.flat
            if id(group) in skip:
                if flat is not None and len(flat.grad_objs) != len(group["params"]):
                    # the pass zeroed the flat part only: the others (a sparse embedding kept out of the
                    # buffer) are cleared here
                    held = {id(g) for g in flat.grad_objs}
                    rest.append([p for p in group["params"] if id(p.grad) not in held])
                continue
            if flat is not None and len(flat.grad_objs) == len(group["params"]) \
                    and flat.same_grads([p.grad for p in group["params"]]):
                flat.grad.zero_()
            else:
                rest.append(group["params"])
        zero = []
        views = self._flat_grad_views
        for params in rest:
            restored = False
            for p in params:
                g = p.grad
                rec = views.get(id(p)) if views else None
                if rec is not None and g is not rec[0]:
                    if self._restore_flat_grad(p, *rec):
                        restored = True
                        continue
                    del views[id(p)]  # p left that buffer (or the view moved): forget it
                if g is None:
                    continue
                if set_to_none and flat_buffer_of(p) is None:
                    p.grad = None
                    continue
                if g.grad_fn is not None:
                    g.detach_()
                else:
                    g.requires_grad_(False)
                zero.append(g)
            if restored:  # a plan made over separate gradients is made again (see _plan_for)
                _VIEWS_RESTORED[0] += 1
        for _, (_, (ts,)) in mt.group_by_device_dtype(zero).items() if zero else ():
            torch._foreach_zero_(ts)

    @staticmethod
    def _restore_flat_grad(p: Tensor, view: Tensor, ptr: int, storage: int) -> bool:
        """Point ``p.grad`` back at its zeroed view of the flat gradient, recorded when the optimizer was
        built (``model.zero_grad()`` set it to None, or the backward after it made a separate tensor): the
        flat path then serves again. False, changing nothing, when the view moved or ``p`` is no longer in
        the buffer it was in then (``p.data = ...``, ``flat_parameters`` again)."""
        if view.data_ptr() != ptr or view.shape != p.shape or view.dtype != p.dtype \
                or p.untyped_storage().data_ptr() != storage or flat_buffer_of(p) is None:
            return False
        view.zero_()
        p.grad = view
        return True

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update over every parameter with a gradient; returns the closure's loss (torch semantics).

        ``grad_scale`` / ``found_inf`` attributes (set by a loss-scale wrapper or ``torch.amp.GradScaler``)
        are honoured: gradients are divided by ``grad_scale`` and the step is a no-op when ``found_inf`` is 1.
        Afterwards each ``.grad`` is as it was, or ``g/grad_scale`` (see ``scratch_grads``).
        """
        self._refuse_inside_ema_weights()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        multipliers = getattr(self, "grad_multipliers", None)
        with gc_paused(sum(map(len, map(_PARAMS, self.param_groups)))):
            self._apply(grad_scale, found_inf, multipliers)
        return loss

    def _gather(self, group: dict) -> tuple[list[int], list[Tensor], list[Tensor]]:
        """(indices, parameters, gradients) of the group's parameters that have a gradient. One read of
        ``.grad`` per parameter (about 0.25 us each, the floor of torch's Python API) when all have one."""
        ps = group["params"]
        plan = self._plans.get(id(group))
        flat = None if plan is None else plan.flat
        if flat is not None and len(flat.grad_objs) == len(ps) and all(
                map(operator.is_, map(_GRAD, ps), flat.grad_objs)) and flat.grads_in_place():
            # still the flat part's gradient views, still in the flat gradient: C-speed passes, no new list
            return flat.all_idx, list(ps), flat.grad_objs
        return mt.with_grads(ps)
    def _apply(
        self, grad_scale: Tensor | None, found_inf: Tensor | None, multipliers: dict | None = None
    ) -> None:
        """The pipeline. ``multipliers`` maps ``id(param)`` to a 0-d tensor that multiplies that parameter's
        gradient before clipping (used by wrappers such as LARC to fold a per-tensor factor into the blocked
        pass instead of a separate sweep)."""
        dev = self._state_device
        # every group's numeric hyperparameters are numbers before anything is written (a None momentum in
        # the second group raised from float() after the first was updated)
        for gi, group in enumerate(self.param_groups):
            check_group_types(group, f"{type(self).__name__}.step (param group {gi})")
        self._ensure_slots()
        if self._any_dtensor:  # tensor + sequence parallel: Partial gradients are reduced before anything
            mt.reduce_partial_grads_(p for g in self.param_groups for p in g["params"])
        # what a wrapper's _flat_part (or whole_grads, handed over as ``_gathered``) read this step
        probed = getattr(multipliers, "gathered", None)
        seen = probed or self.__dict__.get("_gathered")
        fit_seen, self._fit_seen = self._fit_seen, {}  # this step's only
        hooks = self._optimizer_step_pre_hooks or _torch_optimizer._global_optimizer_pre_hooks
        if seen and not hooks:
            gathered = [seen.get(id(g)) or self._gather(g) for g in self.param_groups]
        else:  # (a step pre-hook may have replaced gradients since)
            gathered = [self._gather(g) for g in self.param_groups]
        if found_inf is not None:
            found_inf = found_inf.detach().to(device=dev, dtype=torch.float32).reshape(())
            self._host_exact = False
        if not any(gs for _, _, gs in gathered):
            self.step_applied = torch.zeros((), dtype=torch.bool, device=dev)
            return
        # the caller's gradients (see ``scratch_grads``): the pass runs on copies when clipnorm/clipvalue (the
        # optimizer's math, Keras) transform them, and those the pass does not unscale in place itself (all
        # of them then, else the sparse ones) are unscaled at the end under a loss scale
        callers: list[Tensor] = []
        own = self._clips_copy()
        if own:
            if grad_scale is not None:
                callers = [g for _, _, gs in gathered for g in gs]
            one = torch.ones((), dtype=torch.float32, device=dev)
            gathered = [(idx, ps, mt.scaled_copies(gs, one)) for idx, ps, gs in gathered]
        sparse_callers: list[Tensor] | None = None
        if grad_scale is not None and not self.scratch_grads and not own:
            callers = sparse_callers = []  # (the sparse ones: _handle_sparse collects them)

        # groups whose gradients are still the views of a flat buffer (optkit.flat_parameters): their cached
        # plan holds one flat gradient, so the reductions below read it once instead of tensor by tensor
        if hooks or not probed:
            fit_seen = {}  # storages checked by a probe count only for the probe's own gathered lists
        flat_plans = [self._flat_plan(group, *gath, multipliers, fit_seen.get(id(group)))
                      for group, gath in zip(self.param_groups, gathered)]
        # dense fallback for sparse gradients (subclasses with a sparse rule handle them in _sparse_update)
        sparse_handled = self._handle_sparse(
            [gath for gath, fp in zip(gathered, flat_plans) if fp is None], found_inf, sparse_callers)

        mults = [self._group_mult(group, params, fp, multipliers)
                 for group, (_, params, _), fp in zip(self.param_groups, gathered, flat_plans)]
        # every group's plan (and its checks: a misfit slot raises ValueError) before anything is written
        pre_plans: list[Any] = [None] * len(self.param_groups)
        if not torch.compiler.is_compiling():
            for i, (group, (idx, params, grads), fp, mult) in enumerate(
                    zip(self.param_groups, gathered, flat_plans, mults)):
                if fp is None and params:
                    pre_plans[i] = self._check_group_plan(group, idx, params, grads, sparse_handled, mult)

        # 1/grad_scale in the groups' precision: float32 (what the fused kernels take), and float64 for the
        # groups holding float64 parameters (a float32 1/3 would be off by 3e-8 relative in a float64 run)
        inv = inv64 = None
        if grad_scale is not None:
            s = grad_scale.detach().reshape(())
            inv = torch.reciprocal(s.to(device=dev, dtype=torch.float32))
            if any(map(self._has_fp64, self.param_groups)):
                inv64 = torch.reciprocal(s.to(device=dev, dtype=torch.float64))
        k = inv  # factor applied to raw gradients (unscale and global clip), folded into the kernels
        k64 = inv64  # the same for float64 groups (None: k)

        whole_grads = [t for (_, _, gs), fp in zip(gathered, flat_plans)
                       for t in ([fp.flat.grad] if fp is not None else gs)]  # the same memory, fewer tensors
        if self.clipvalue is not None:
            if inv is not None:
                mt.scale_(whole_grads, inv, scale64=inv64)
                k = k64 = None
            mt.clamp_(whole_grads, -self.clipvalue, self.clipvalue)
        elif self.clipnorm is not None:
            dense_grads = [g for (_, _, gs) in gathered for g in gs]
            ns = mt.norms(dense_grads)
            if len({(x.device, x.dtype) for x in ns}) > 1:
                n_all = torch.stack([x.to(device=dev, dtype=torch.float64) for x in ns])
            else:
                n_all = torch.stack(ns).to(device=dev)
            c = self.clipnorm
            if inv is not None and found_inf is not None:
                found_inf = self._refuse_overflowed_norm(found_inf, n_all, inv)
            n_true = n_all if inv is None else n_all * inv
            coef = c / torch.clamp(n_true, min=c)  # g·c/max(‖g‖, c), per tensor
            if inv is not None:
                coef = coef * inv
            coefs = list(coef.unbind())
            if inv64 is not None:  # float64 gradients: the factor with the float64 1/grad_scale
                n64 = n_all.to(torch.float64) * inv64
                c64 = (c / torch.clamp(n64, min=c) * inv64).unbind()
                coefs = [b if x.dtype == torch.float64 else a for a, b, x in zip(coefs, c64, ns)]
            mt.scale_(dense_grads, coefs)
            k = k64 = None
        elif self.global_clipnorm is not None:
            n = mt.global_norm(whole_grads).to(device=dev)  # fp32, or fp64 for fp64 gradients
            if inv is not None and found_inf is not None:
                found_inf = self._refuse_overflowed_norm(found_inf, n, inv)
            c = self.global_clipnorm
            if inv64 is not None:  # (n is float64: float64 gradients are among them)
                n64 = n * inv64
                k64 = (c / torch.clamp(n64, min=c) + (n64 - n64)) * inv64
            if inv is not None:
                n = n * inv
            coef = c / torch.clamp(n, min=c) + (n - n)  # non-finite norm -> NaN everywhere (Keras)
            k = coef if k is None else k * coef

        applied = None if found_inf is None else (1.0 - found_inf)
        for group, (idx, params, grads), fp, mult, pre in zip(self.param_groups, gathered, flat_plans, mults,
                                                              pre_plans):
            if not params:
                if self.use_ema:
                    self._ema_group(group, list(range(len(group["params"]))), applied)
                continue
            lr = self._current_lr(group, commit=True, found_inf=found_inf)
            fp64 = inv64 is not None and self._has_fp64(group)
            kg = k64 if k64 is not None and fp64 else k
            # 1/grad_scale for the caller's dense gradients of this group (the pass unscales them in place)
            self._step_inv = None if own or self.scratch_grads else (inv64 if fp64 else inv)
            self._run_group(group, idx, params, grads, lr, kg, found_inf, applied, sparse_handled, mult,
                            plan=fp, checked=pre)
        self._step_inv = None
        if callers:  # g/S, as GradScaler.unscale_ leaves them (float64 ones with the float64 1/S)
            mt.scale_(callers, inv, scale64=inv64)

        self._after_update(found_inf, applied)

    @staticmethod
    def _group_mult(group: dict, params: list[Tensor], fp: Any, multipliers: Any) -> Any:
        """The group's per-tensor multipliers: None, the flat part's ``RowMultipliers`` rows (checked by
        ``_flat_plan``) or one entry per parameter with a gradient."""
        if multipliers is None:
            return None
        if fp is not None:
            return multipliers.rows[id(group)]
        return [multipliers.get(id(p)) for p in params]

    def _check_group_plan(self, group, idx, params, grads, sparse_handled, mult) -> Plan | None:
        """Build (or find cached) the plan :meth:`_run_group` will use (returned; None when every gradient
        is sparse), and check the sparse rule's slots: the ``ValueError`` of a misfit slot then comes before
        any group is updated."""
        if isinstance(mult, list) and all(m is None for m in mult):
            mult = None
        if sparse_handled and any(id(p) in sparse_handled for p in params):
            self._sparse_part(group, idx, params, sparse_handled)
            keep = [j for j, p in enumerate(params) if id(p) not in sparse_handled]
            if not keep:
                return None
            idx, params, grads = [idx[j] for j in keep], [params[j] for j in keep], [grads[j] for j in keep]
            mult = None if mult is None else [mult[j] for j in keep]
        return self._plan_for(group, idx, params, grads, self._blocked(group, mult))

    def _sparse_part(self, group: dict, idx: list[int], params: list[Tensor],
                     sparse_handled: set[int]) -> list[int]:
        """Positions in ``params`` of those the sparse rule updates, with their state made if missing (a
        parameter put in place of another) and every slot checked (``ValueError`` naming it)."""
        sp = [j for j, p in enumerate(params) if id(p) in sparse_handled]
        self._init_missing_state(group, [params[j] for j in sp])
        names = group["param_names"]
        for j in sp:
            for s in self._active_slots(group):
                check_slot_fits(names[idx[j]], s, params[j], self.state[params[j]].get(s))
        return sp

    def _handle_sparse(self, gathered, found_inf, originals: list | None = None) -> set[int]:
        """Prepare sparse COO gradients before clipping.

        Default (the dense fallback): densify, which sums duplicate indices. Optimizers with a sparse rule
        (``_sparse_rule = True``) get their sparse gradients coalesced instead (duplicates summed, as TF1
        de-duplicates ``IndexedSlices``); those stay sparse through unscaling and clipping and are updated by
        :meth:`_sparse_update`. Returns the ids of the parameters handled by the sparse rule.
        """
        if self._sparse_rule:
            for group, (_, _, grads) in zip(self.param_groups, gathered):
                if any(g.is_sparse for g in grads):
                    self._check_sparse(group)
        handled: set[int] = set()
        for _, params, grads in gathered:
            for j, g in enumerate(grads):
                if g.is_sparse:
                    if originals is not None:  # (the caller's sparse gradients, unscaled after the step)
                        originals.append(g)
                    if self._sparse_rule:
                        c = g.coalesce()  # (the caller's tensor itself when coalesced: a copy unless scratch)
                        grads[j] = c if c is not g or self.scratch_grads else c.clone()
                        handled.add(id(params[j]))
                    else:
                        grads[j] = g.to_dense()
        return handled

    def _check_sparse(self, group: dict) -> None:
        """Raise (before anything changes) when the group's options do not combine with sparse gradients."""

    def _sparse_update(self, group, params, grads, slots, lr, k, found_inf) -> None:
        """The update rule for coalesced sparse gradients (only called when ``_sparse_rule`` is True)."""
        raise TypeError(f"{type(self).__name__} sets _sparse_rule but does not implement _sparse_update()")

    def _blocked(self, group: dict, mult: list | None) -> bool:
        """Whether the group's chain of kernels runs block by block over cache-sized chunks."""
        wd = group.get("weight_decay", 0.0) if self._decoupled_weight_decay else 0.0
        folds = mult is not None and not self._folds_mult(group)
        return self._blockable and (self._always_block or bool(wd) or self.use_ema or folds
                                    or self._guards(group, mult))

    def _clips_copy(self) -> bool:
        """Whether this step's pass runs on copies of the caller's gradients: ``clipnorm``/``clipvalue``
        transform every gradient (the optimizer's math, not the caller's; see ``scratch_grads``)."""
        return not self.scratch_grads and (self.clipvalue is not None or self.clipnorm is not None)

    def _guards(self, group: dict, mult: Any) -> bool:
        """Whether the group's blocked pass copies each gradient chunk into an in-cache scratch chunk and runs
        the multipliers and the update there, leaving the caller's gradient as it was (``g/S`` under a loss
        scale, written while the chunk is in cache): when the update may write its gradients otherwise
        (:meth:`_update_writes_grads`), when multipliers (LARC) or a global clip factor would go into them,
        unless the gradients are scratch (``scratch_grads``) or copies already (:meth:`_clips_copy`)."""
        if self.scratch_grads or self._clips_copy():
            return False
        return mult is not None or self.global_clipnorm is not None or self._update_writes_grads(group)

    def _update_writes_grads(self, group: dict) -> bool:
        """Whether :meth:`_prepare` and :meth:`_update` may leave in the gradients they are given anything
        but the gradient itself or ``k·g`` (the fused kernels' ``grad_scale`` write-back, which is the
        unscaled gradient wherever the base passes the caller's gradients: ``k`` is then the loss scale's
        1/S alone). True (the safe default) makes the base hand the update in-cache copies (:meth:`_guards`);
        optimizers whose rule only reads the gradient, or writes ``k·g`` on every kernel path (staged copies
        written back, the pointwise fallback), return False."""
        return self._writes_grads

    #: the default of :meth:`_update_writes_grads`
    _writes_grads = True
    #: whether the rule keeps values in its gradients from :meth:`_prepare` to :meth:`_update` (LAMB's
    #: direction): with the caller's gradients (:meth:`_guards`) the eager pass then runs on a buffer kept
    #: with the plan (:meth:`_grad_shadow`) instead of in-cache chunk copies. Its :meth:`_prepare` gets that
    #: buffer as ``grads`` and must first fill it from :attr:`_shadow_src`, ``(caller's local gradients, 1/S
    #: or None)``: copy each chunk, then scale the caller's chunk by 1/S, while it is in cache (no separate
    #: copy pass over memory)
    _shadow_grads = False

    def _folds_mult(self, group: dict) -> bool:
        """Whether this group's per-tensor multipliers go into the kernel (``_mult_in_kernel`` and tensors of
        at least :data:`FOLD_MIN_NUMEL` elements on average; cached until the group's parameter list
        changes)."""
        if not self._mult_in_kernel:
            return False
        ps = group["params"]
        hit = self._fold_cache.get(id(group))
        if hit is not None and hit[0] is ps and hit[1] == len(ps):
            return hit[2]
        folds = sum(mt.local(p).numel() for p in ps) >= FOLD_MIN_NUMEL * max(len(ps), 1)
        self._fold_cache[id(group)] = (ps, len(ps), folds)
        return folds

    def _flat_plan(self, group: dict, idx: list[int], params: list[Tensor], grads: list[Tensor],
                   multipliers: Any, fit_checked: Plan | None = None) -> Plan | None:
        """The group's cached plan when it has a flat part whose gradients are this step's (O(1) checks plus
        one identity scan of the gradients); None otherwise (then :meth:`_run_group` plans per tensor).
        With multipliers only for a :class:`~optkit._plan.RowMultipliers` that has a vector for this group,
        and only when the flat part's row runs pay."""
        plan = self._plans.get(id(group))
        rows = isinstance(multipliers, RowMultipliers) and id(group) in multipliers.rows
        if plan is None or plan.flat is None or (multipliers is not None and not rows) \
                or torch.compiler.is_compiling():
            return None
        key = (len(idx), self._plan_version, self._blocked(group, multipliers), self.block_numel)
        if plan.key[1:] != key[1:] or len(plan.key[0]) != key[0] or len(idx) != len(group["params"]):
            return None
        # every parameter still where the plan's views point (``p.data = ...`` on one parameter takes it out
        # of the flat buffer; a C-speed pass, about 80 ns per parameter)
        if not plan.flat.same_grads(grads) or (plan is not fit_checked and not plan.params_fit(params)):
            return None
        if rows and not plan.flat.rows_pay:
            return None
        return plan

    def _flat_part(self, group: dict, seen: dict | None = None) -> FlatPart | None:
        """For a wrapper about to pass per-parameter multipliers as :class:`~optkit._plan.RowMultipliers`
        (LARC): the group's flat part when this step will run over it (every parameter has its flat gradient
        view, the plan is current, the row runs pay), else None. O(1) checks plus one identity scan. The
        gathered lists go into ``seen`` (keyed by the group's id) for the step to reuse, and a plan found
        current is remembered so that the step does not check its parameter storages again."""
        self._fit_seen.pop(id(group), None)
        idx, params, grads = self._gather(group)
        if seen is not None:
            seen[id(group)] = (idx, params, grads)
        if not params:
            return None
        probe = RowMultipliers([(group, torch.empty(0))])
        plan = self._flat_plan(group, idx, params, grads, probe)
        if plan is None and flat_buffer_of(params[0]) is not None and not torch.compiler.is_compiling():
            # no current plan yet (first step, new state): build it now, as the step would, so that the
            # first update already runs over the flat part (every update then rounds the same way)
            self._ensure_slots()
            if any(g is not None and g.is_sparse for g in grads):
                return None
            self._plan_for(group, idx, params, grads, self._blocked(group, probe))
            plan = self._flat_plan(group, idx, params, grads, probe)
        if plan is not None:
            self._fit_seen[id(group)] = plan
        return None if plan is None else plan.flat

    def _run_group(
        self, group, idx, params, grads, lr, k, found_inf, applied, sparse_handled, mult=None, plan=None,
        checked=None,
    ) -> None:
        """``plan``: a flat plan checked this step; ``checked``: the per-tensor plan :meth:`_apply` built
        for these arguments before any group was updated (:meth:`_check_group_plan`)."""
        if isinstance(mult, list) and all(m is None for m in mult):
            mult = None
        if plan is not None:  # a flat plan, checked this step: no sparse gradients, nothing to re-plan
            self._run_planned(group, idx, params, grads, lr, k, found_inf, applied, mult, plan)
            return
        if sparse_handled and any(id(p) in sparse_handled for p in params):
            sp = self._sparse_part(group, idx, params, sparse_handled)
            sp_grads = [grads[j] for j in sp]
            if mult is not None:
                sel = [(sp_grads[n], mult[j]) for n, j in enumerate(sp) if mult[j] is not None]
                if sel:
                    mt.scale_([t for t, _ in sel], [m for _, m in sel])
            sp_params = [params[j] for j in sp]
            self._sparse_update(group, sp_params, sp_grads,
                                {s: [self.state[p][s] for p in sp_params] for s in self._active_slots(group)},
                                lr, k, found_inf)
            keep = [j for j, p in enumerate(params) if id(p) not in sparse_handled]
            idx, params, grads = [idx[j] for j in keep], [params[j] for j in keep], [grads[j] for j in keep]
            mult = None if mult is None else [mult[j] for j in keep]
            if not params:
                if self.use_ema:
                    self._ema_group(group, list(range(len(group["params"]))), applied)
                return
        tracing = torch.compiler.is_compiling()  # inside torch.compile(opt.step): no fused kernels, no plans
        plan = self._light_plan(group, idx, params) if tracing else checked if checked is not None else (
            self._plan_for(group, idx, params, grads, self._blocked(group, mult)))
        # a cached plan's flat part is this step's only while the gradients are still its views (after
        # model.zero_grad() the backward makes separate gradients: the flat gradient buffer is stale then)
        flat_ok = not tracing and plan.flat is not None and plan.flat.same_grads(grads)
        self._run_planned(group, idx, params, grads, lr, k, found_inf, applied, mult, plan, tracing, flat_ok)

    def _run_planned(self, group, idx, params, grads, lr, k, found_inf, applied, mult, plan, tracing=False,
                     flat_ok=True):
        """Decay → update → EMA of one group with its plan: the flat blocks when the plan has a flat part
        whose gradients are this step's (``flat_ok``) and nothing per tensor differs (multipliers,
        per-tensor ``_prepare`` values, a mixed decay mask), else the per-tensor blocks."""
        wd = group.get("weight_decay", 0.0) if self._decoupled_weight_decay else 0.0
        # the caller's gradients are copied chunk by chunk (in cache) for the update, and get 1/S there
        guard = self._guards(group, mult)
        inv = getattr(self, "_step_inv", None)
        row_mult = None  # per-parameter multipliers over the flat part's row runs (RowMultipliers)
        if isinstance(mult, Tensor):
            row_mult, mult = mult, None
            if self._prepare_reads_grads or (wd and plan.any_wd and plan.uniform_wd is None) or (
                    self.jit_compile and self._compile_state != "failed"):
                if guard:  # (not into the caller's gradients: per tensor, below)
                    mult, row_mult = list(row_mult.unbind()), None
                else:
                    plan.flat.scale_rows_(plan.flat.grad, row_mult)  # one pass; then the usual flat path
                    row_mult = None
        if mult is not None and self._prepare_reads_grads:
            # _prepare reads whole-tensor quantities (norms): it must see the multiplied gradients
            sel = [(j, m) for j, m in enumerate(mult) if m is not None]
            if guard:  # the products go into copies, which the pass then owns; the caller's get 1/S now
                callers, grads = grads, mt.scaled_copies(grads, torch.ones((), device=lr.device))
                if inv is not None:
                    mt.scale_(callers, inv)
                guard, inv, flat_ok = False, None, False
            mt.scale_([grads[j] for j, _ in sel], [m for _, m in sel])
            mult = None
        shadow_rows = None  # the flat shadow's row chunks (a _shadow_grads rule over the row runs)
        if guard and self._shadow_grads and not tracing and not (
                self.jit_compile and self._compile_state != "failed"):
            # a rule that keeps values in its gradients from one pass to the next (LAMB's u) runs on a buffer
            # kept with the plan; its _prepare copies the caller's gradients into it chunk by chunk and gives
            # those their 1/S while each chunk is in cache (_shadow_src)
            if flat_ok and plan.flat is not None and mult is None and self._shadow_rows(plan.flat):
                # over a current flat part's row runs: one flat buffer of the flat gradient's size, its row
                # chunks filled the same way by the row pass (the flat path stays, .grad is not written)
                shadow_rows = self._grad_shadow_rows(plan.flat)
                self._shadow_src = (plan.flat.row_grads, inv)
                guard, inv = False, None
            else:
                shadow = self._grad_shadow(plan, grads)
                self._shadow_src = ([mt.local(g) for g in grads] if plan.any_dtensor else grads, inv)
                grads, guard, inv, flat_ok = shadow, False, None, False
        flat = getattr(plan, "flat", None) if flat_ok else None
        plan.flat_active = flat is not None and mult is None and not tracing
        self._grads_protected = guard  # (_prepare: the gradients are the caller's, leave them)
        try:
            aux = self._prepare(group, plan, params, grads, lr, k)
        finally:
            self._grads_protected = False
            self._shadow_src = None
        if row_mult is not None and not (aux is None or isinstance(aux, RunAux)):
            if guard:  # per-tensor values and multipliers: the per-tensor blocks (in-cache copies)
                mult, row_mult = list(row_mult.unbind()), None
                plan.flat_active = False
            else:
                plan.flat.scale_rows_(plan.flat.grad, row_mult)
                row_mult = None

        decay_mask = plan.use_wd if (wd and plan.any_wd) else None

        if tracing:  # the pointwise chain, which inductor fuses (torch's fused kernels have no fake impl)
            self._run_chain(chain, group, idx, params, grads, plan.slots, lr, k, wd, decay_mask, found_inf,
                            applied, mult, aux)
            if inv is not None:  # (the chain only reads the gradients)
                mt.scale_(grads, inv)
            return
        # every gradient is a view of the flat gradient, cleared after this step: the pass zeroes it (each
        # chunk in cache, or in the compiled loop that reads it)
        zero = self._zero_grads_in_pass and flat_ok and plan.flat is not None and shadow_rows is None
        if isinstance(aux, RunAux) and aux.per_run:  # jit_compile over a flat part's row runs
            self._run_compiled_rows(group, idx, flat, lr, k, found_inf, applied, aux, zero=zero)
            if zero:
                self._zeroed_groups.add(id(group))
            if inv is not None:  # (the compiled rule only reads the gradients)
                mt.scale_([flat.grad], inv)
            return
        if self.jit_compile and self._compile_state != "failed" and not isinstance(aux, RunAux):
            if self._flat_whole(plan, aux, decay_mask):
                # nothing differs per tensor: the compiled chain over the whole flat buffers (one graph of a
                # few inputs); if compiling fails, the eager pass below steps them (nothing was written)
                w, g, slots, avgs = plan.flat.whole_lists()
                done = self._run_compiled(group, idx, w, g, slots, lr, k, wd,
                                          None if decay_mask is None else (bool(plan.uniform_wd),), found_inf,
                                          applied, None, None if aux is None else aux[:1], avgs=avgs,
                                          zero=zero)
            else:
                done = self._run_compiled(group, idx, params, grads, plan.slots, lr, k, wd, decay_mask,
                                          found_inf, applied, mult, aux, zero=zero)
            if done:
                if zero:
                    self._zeroed_groups.add(id(group))
                if inv is not None:  # (the compiled chain only reads the gradients)
                    mt.scale_([flat.grad] if flat is not None else grads, inv)
                return

        # decoupled weight decay factor, 1 − lr·wd (1 on a skipped step)
        decay = None
        if decay_mask is not None:
            decay = 1.0 - lr * wd if applied is None else 1.0 - lr * wd * applied
        ema_w = self._ema_weight(applied) if self.use_ema else None

        cols = None
        if isinstance(aux, RunAux) or row_mult is not None:
            # per-tensor values over the flat part's row chunks (LARS's factors, LARC's multipliers)
            blocks, glocal = flat.row_blocks, flat.row_grads if shadow_rows is None else shadow_rows
            aux = aux.items if isinstance(aux, RunAux) else None
            if row_mult is not None:
                cols = [row_mult[lo:hi].unsqueeze(1) for lo, hi in flat.chunk_segments]
        elif self._flat_whole(plan, aux, decay_mask):
            blocks, glocal, aux = flat.blocks, [flat.grad], None if aux is None else aux[:1]
        else:
            blocks = plan.blocks
            glocal = grads if not plan.any_dtensor else [mt.local(g) for g in grads]
        folds = mult is not None and self._folds_mult(group)
        scratch = self._grad_scratch(plan, blocks) if guard else None
        for blk in blocks:
            owners, bp, bslots, bavg = blk.owners, blk.params, blk.slots, blk.averages
            if blk.split is None:
                bg = [glocal[o] for o in owners]
            else:
                bg = [glocal[o] if rng is None else glocal[o].view(-1)[rng[0]:rng[1]]
                      for o, rng in zip(owners, blk.split)]
            real = bg
            if scratch is not None:  # the chunk's copy (in cache) takes the multipliers and the update
                sc = scratch[id(blk)]
                torch._foreach_copy_(sc, bg)
                if inv is not None:  # the caller's chunk: g/S, written back while in cache
                    mt.scale_local_(bg, inv, blk.key)
                bg = sc
            # (otherwise the update leaves g or k·g = g/S in them: see _update_writes_grads)
            if cols is not None:
                bg[0].mul_(cols[owners[0]])  # the chunk's (rows, 1) column, in cache before the update
            if mult is not None:
                if folds:
                    baux = [mult[o] for o in owners]
                else:
                    sel = [(t, mult[o]) for t, o in zip(bg, owners) if mult[o] is not None]
                    if sel:
                        mt.scale_([t for t, _ in sel], [m for _, m in sel])
            if decay is not None:
                dp = bp if blk.all_wd else [t for t, o in zip(bp, owners) if plan.use_wd[o]]
                if dp:
                    mt.scale_local_(dp, decay, blk.key)
            if mult is None or not folds:
                baux = None if aux is None else (aux if blk.identity else [aux[o] for o in owners])
            self._block = blk
            try:
                self._update(group, bp, bg, bslots, lr, k, found_inf, baux)
            finally:
                self._block = None
            if ema_w is not None:
                mt.lerp_local_(bavg, bp, ema_w, blk.key)
            if zero:
                torch._foreach_zero_(real)
        if zero:
            self._zeroed_groups.add(id(group))

        if self.use_ema:
            self._ema_rest(group, idx, applied)

    def _shadow_rows(self, flat: FlatPart) -> bool:
        """Whether this :attr:`_shadow_grads` rule runs over ``flat``'s row runs (its :meth:`_prepare` then
        returns a :class:`~optkit._plan.RunAux` for them): the base gives it one flat shadow of the flat
        gradient instead of per-tensor copies (:meth:`_grad_shadow_rows`), and :attr:`_shadow_src` holds the
        caller's row chunks (``flat.row_grads``) and the 1/S for them. Its row pass must copy each caller's
        chunk into the shadow's chunk, then scale the caller's chunk by 1/S, while it is in cache."""
        return False

    @staticmethod
    def _grad_shadow_rows(flat: FlatPart) -> list[Tensor]:
        """The row chunks (laid out as ``flat.row_grads``) of one buffer of the flat gradient's size, kept
        with the flat part, for :meth:`_shadow_rows` (memory, not state)."""
        hit = flat.__dict__.get("_grad_shadow_rows")
        if hit is None:
            hit = flat.row_chunks(torch.empty_like(flat.grad, memory_format=torch.contiguous_format))
            flat.__dict__["_grad_shadow_rows"] = hit
        return hit

    @staticmethod
    def _grad_shadow(plan: Plan, grads: list[Tensor]) -> list[Tensor]:
        """A copy of the group's (local) gradients kept with the plan, for :attr:`_shadow_grads` rules."""
        shadow = plan.__dict__.get("_grad_shadow")
        if shadow is None or len(shadow) != len(grads):
            shadow = [torch.empty_like(mt.local(g), memory_format=torch.preserve_format) for g in grads]
            plan.__dict__["_grad_shadow"] = shadow
        return shadow

    @staticmethod
    def _grad_scratch(plan: Plan, blocks: list) -> dict[int, list[Tensor]]:
        """Scratch chunks for the gradient chunks of ``blocks`` (see :meth:`_guards`), by block id: views of
        one pool per (device, dtype), as large as the largest block, each laid out like the block's parameter
        chunk (so the fused-kernel gate finds matching layouts). Kept with the plan on the CPU, where blocks
        are cache-sized; elsewhere a block is the whole group and its pool is made per step."""
        cache = plan.__dict__.setdefault("_grad_scratch", {})
        hit = cache.get(id(blocks))
        if hit is not None and hit[0] is blocks:
            return hit[1]
        sizes: dict[tuple, int] = {}
        for blk in blocks:
            need: dict[tuple, int] = {}
            for c in blk.params:
                key = (c.device, c.dtype)
                need[key] = need.get(key, 0) + c.numel()
            for key, n in need.items():
                sizes[key] = max(sizes.get(key, 0), n)
        pools = {key: torch.empty(n, dtype=key[1], device=key[0]) for key, n in sizes.items()}
        views: dict[int, list[Tensor]] = {}
        for blk in blocks:
            offsets = dict.fromkeys(pools, 0)
            out = []
            for c in blk.params:
                key = (c.device, c.dtype)
                out.append(scratch_view(pools[key], offsets[key], c))
                offsets[key] += c.numel()
            views[id(blk)] = out
        if all(key[0].type == "cpu" for key in pools):
            cache[id(blocks)] = (blocks, views)
        return views

    def _plan_for(self, group: dict, idx: list[int], params: list[Tensor], grads: list[Tensor],
                  blocked: bool) -> Plan:
        """The cached :class:`~optkit._plan.Plan` of this group for this set of parameters with gradients
        (rebuilt when the set, the optimizer state or the exclusions change, a parameter's storage moves, or a
        gradient no longer fits a chunking)."""
        key = (tuple(idx), self._plan_version, blocked, self.block_numel)
        plan = self._plans.get(id(group))
        if plan is not None and plan.key == key and plan.grads_fit(grads) and plan.params_fit(params) \
                and not (plan.flat is None and plan.views_restored != _VIEWS_RESTORED[0]
                         and flat_buffer_of(params[0]) is not None):
            # (a plan without a flat part over flat parameters is made again once gradient views were
            # restored: FlatParameters.zero_grad or this optimizer's zero_grad)
            return plan
        self._init_missing_state(group, params)  # (a parameter put in place of another in the group's list)
        plan = Plan(self, group, idx, params, grads, blocked, key)
        self._plans[id(group)] = plan
        return plan

    def _invalidate_plans(self) -> None:
        self._plan_version += 1
        self._plans.clear()

    def _by_device_dtype(self, *lists: Sequence[Tensor]) -> dict:
        """``_multi_tensor.group_by_device_dtype`` with a fast path: inside the base's blocked pass the
        block's (device, dtype) is known when it is homogeneous, and the lists come back as they are."""
        blk = self._block
        if blk is not None and blk.key is not None:
            return {blk.key: (list(range(len(lists[0]))), tuple(lists))}
        return mt.group_by_device_dtype(*lists)

    def _kernel_parts(
        self, kernel: str, lists: Sequence[Sequence[Tensor]], written: Sequence[int]
    ) -> Iterator[tuple[torch.device, torch.dtype, str, list[int], tuple[list[Tensor], ...]]]:
        """The fused-kernel gate (:func:`optkit._fused.partition`) over ``lists`` (parameters first, gradients
        second, then slots), grouped by (device, dtype).

        Yields ``(device, dtype, mode, index, lists)``: ``index`` are positions in the input lists; ``mode``
        ``"native"`` (run the kernel on ``lists`` as they are), ``"staged"`` (``lists`` are contiguous
        float32/float64 copies, ``dtype`` is their dtype; the lists at positions ``written`` are copied back
        after the consumer's loop body) or ``"fallback"`` (no kernel on this device: use
        :meth:`_pointwise_fallback`).
        """
        blk = self._block
        static_contiguous = blk is not None and blk.static_contiguous
        for (device, dtype), (gidx, grouped) in self._by_device_dtype(*lists).items():
            parts = _fused.partition(kernel, device, dtype, grouped, static_contiguous=static_contiguous)
            for part in parts:
                index = [gidx[i] for i in part.index]
                if part.mode == "staged":
                    for copies in _fused.staged(part, written):
                        yield device, copies[0][0].dtype, "staged", index, copies
                else:
                    yield device, dtype, part.mode, index, part.lists

    def _pointwise_fallback(self, group, params, grads, slot_lists, lr, k, found_inf, aux) -> None:
        """The rule as out-of-place pointwise math (``_pointwise``), for devices without the fused kernel."""
        rule = type(self)._pointwise
        if rule is None:  # pragma: no cover - every optkit optimizer defines one
            raise TypeError(f"{type(self).__name__} has no pointwise update rule for device "
                            f"{mt.local(params[0]).device}")
        chain(rule, self._pointwise_hyper(group), params, grads, tuple(slot_lists), None, lr, k, None, None,
              None, found_inf, None, aux, upcast=True)
        if k is not None:  # k·g left in the gradients, as the fused kernels' grad_scale leaves it
            mt.scale_(grads, k)

    def _ema_rest(self, group: dict, idx: list[int], applied: Tensor | None) -> None:
        """EMA over the group's parameters that took no part in this step's dense pass (Keras averages every
        variable, with or without a gradient)."""
        if len(idx) == len(group["params"]):  # every parameter took part (indices are distinct)
            return
        have = set(idx)
        rest = [i for i in range(len(group["params"])) if i not in have]
        if rest:
            self._ema_group(group, rest, applied)

    # ------------------------------------------------------------------------------------------------ jit

    def _pointwise_hyper(self, group: dict) -> tuple:
        """The group's static hyperparameters for :meth:`_pointwise` (Python constants; compile guards)."""
        return ()

    #: the update rule as out-of-place pointwise math for ``jit_compile`` and the no-kernel fallback (a
    #: staticmethod ``(hyper, w, g, slots, lr, k, aux) -> (new_w, new_slots)``; ``g`` is the raw gradient,
    #: the true gradient is ``k·g``); None means the optimizer has no compilable form and runs eagerly.
    _pointwise: Callable | None = None

    def _run_compiled(self, group, idx, params, grads, slots, lr, k, wd, decay_mask, found_inf, applied,
                      mult, aux, avgs=None, zero=False) -> bool:
        """Run decay → update → EMA of one group as one ``torch.compile``-d function. Hyperparameters that
        change during training (learning rate, clip/unscale factor, skip flag, EMA weight) are tensor inputs,
        so they never trigger a recompile. Returns False (after a RuntimeWarning) if compilation fails."""
        rule = type(self)._pointwise
        if rule is None:
            self._compile_state = "failed"
            warn_compile_fallback(TypeError(f"{type(self).__name__} has no pointwise update rule"))
            return False
        fn = compiled_chain()
        if fn is None:
            self._compile_state = "failed"
            warn_compile_fallback(RuntimeError("torch.compile is not available"))
            return False
        if self._compile_state == "untried" and len(params) > COMPILE_WARN_TENSORS:
            warnings.warn(
                f"jit_compile=True over {len(params)} tensors in one param group: torch.compile traces one "
                "graph input per tensor, so the first step may take minutes; for thousands of small "
                "tensors the eager step over optkit.flat_parameters() buffers is the fast path",
                RuntimeWarning, stacklevel=5)
        try:
            self._run_chain(fn, group, idx, params, grads, slots, lr, k, wd, decay_mask, found_inf, applied,
                            mult, aux, avgs=avgs, zero=zero)
        except Exception as err:  # compilation unavailable or failed: eager from now on
            self._compile_state = "failed"
            warn_compile_fallback(err)
            return False
        self._compile_state = "ok"
        return True

    def _compiled_pass(self, fn: Callable, n_tensors: int) -> Callable | None:
        """For a wrapper or the train op around this optimizer: ``fn`` (a read-only pass over ``n_tensors``
        plain tensors) compiled as this optimizer's own passes are, as a callable that gives None once
        compiling failed (:meth:`_call_compiled`), when ``jit_compile`` is on and has not failed, outside a
        compiled region, without DTensor parameters and for at most :data:`COMPILE_WARN_TENSORS` tensors
        (one graph input each: more would take minutes to compile); else None (take the eager pass)."""
        if not self.jit_compile or self._compile_state == "failed" or self._any_dtensor \
                or n_tensors > COMPILE_WARN_TENSORS or torch.compiler.is_compiling():
            return None
        return functools.partial(self._call_compiled, fn)

    def _call_compiled(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)`` compiled as the chain is (:func:`optkit._compile.compiled_function`), for an
        optimizer's own read-only compiled pass; None, after one ``RuntimeWarning`` and eager from then on,
        when compiling fails (such a pass writes nothing, so the eager step can follow)."""
        compiled = compiled_function(fn)
        if compiled is None:  # pragma: no cover - torch without a working compile stack
            return None
        try:
            return compiled(*args)
        except Exception as err:
            self._compile_state = "failed"
            warn_compile_fallback(err)
            return None

    @staticmethod
    def _flat_whole(plan, aux, decay_mask) -> bool:
        """Whether this step may treat the flat part as one tensor: it is active, ``_prepare`` gave every
        tensor the same entry (or none) and the decoupled decay applies to all of them or to none."""
        return plan.flat_active and (aux is None or all(map(operator.is_, aux, itertools.repeat(aux[0])))) \
            and (decay_mask is None or plan.uniform_wd is not None)

    def _run_compiled_rows(self, group, idx, flat, lr, k, found_inf, applied, aux, zero=False) -> None:
        """The compiled rule over a flat part's whole run matrices (``aux.per_run``: one ``(count, 1)``
        column entry per run, as LARS's and LAMB's :meth:`_prepare` give under ``jit_compile``): one graph
        of a few inputs whatever the number of parameters. If compiling fails, the same chain runs eagerly
        on the same runs (nothing was written) and the optimizer is eager from the next step on."""
        w, g, slots, avgs = flat.run_lists()
        if self._run_compiled(group, idx, w, g, slots, lr, k, 0.0, None, found_inf, applied, None, aux.items,
                              avgs=avgs, zero=zero):
            return
        self._run_chain(chain, group, idx, w, g, slots, lr, k, 0.0, None, found_inf, applied, None, aux.items,
                        avgs=avgs, upcast=True, zero=zero)

    def _run_chain(self, fn, group, idx, params, grads, slots, lr, k, wd, decay_mask, found_inf, applied,
                   mult, aux, avgs=None, upcast=False, zero=False) -> None:
        """decay → rule → EMA of one group through :func:`optkit._compile.chain` (``fn``: it, or its
        ``torch.compile``-d form), with every changing hyperparameter as a tensor input. ``avgs``: the
        averages when ``params`` are not the group's tensors (a flat part's run matrices); ``zero``: the
        chain zeroes the gradients after reading them (flat gradients that the train op clears next)."""
        rule = type(self)._pointwise

        def loc(t: Tensor) -> Tensor:
            # a 0-d tensor goes in as a (1,) view of itself: inductor drops the in-place writes to 0-d float64
            # CPU inputs (torch 2.13), so their slots and weights would never change
            t = mt.local(t)
            return t.view(1) if t.dim() == 0 else t

        slot_lists = tuple([loc(t) for t in slots[s]] for s in self._active_slots(group))
        if self.use_ema and avgs is None:
            avgs = [loc(self.state[p]["average"]) for p in params]
        dev = loc(params[0]).device
        ema_w = self._ema_weight(None).to(dev) if self.use_ema else None
        # (in the lr's dtype: float64 for a group holding float64 parameters)
        wd_t = None if decay_mask is None else mt.scalar(wd, lr.dtype, dev)
        fn(rule, self._pointwise_hyper(group), [loc(p) for p in params], [loc(g) for g in grads],
           slot_lists, avgs, lr.to(dev), None if k is None else k.to(dev), wd_t,
           None if decay_mask is None else tuple(decay_mask), ema_w,
           None if found_inf is None else found_inf.to(dev),
           None if mult is None else tuple(mult), aux, **({"upcast": True} if upcast else {}),
           **({"zero_grads": True} if zero else {}))
        if self.use_ema:
            self._ema_rest(group, idx, applied)

    def _light_plan(self, group: dict, idx: list[int], params: list[Tensor]) -> PlanView:
        """What :meth:`_prepare` and the chain need of a plan, without storage pointers or blocks (for
        ``torch.compile`` tracing, where there is no storage)."""
        names = [group["param_names"][i] for i in idx]
        use_wd = [self._use_weight_decay(p, n) for p, n in zip(params, names)]
        slots = {s: [self.state[p][s] for p in params] for s in self._active_slots(group)}
        return PlanView(names, slots, use_wd)

    # ------------------------------------------------------------------------------------------------ EMA

    @staticmethod
    def _collect_ema_buffers(source: Any, use_ema: bool) -> list[tuple[str, Tensor]]:
        """``ema_buffers`` as ``[(name, buffer)]``: a module's floating-point buffers, or the given pairs."""
        if source is None:
            return []
        if not use_ema:
            raise ValueError("`ema_buffers` needs `use_ema=True`")
        if isinstance(source, torch.nn.Module):
            pairs = [(n, b) for n, b in source.named_buffers() if b.is_floating_point()]
        elif isinstance(source, Tensor) or isinstance(source, (str, bytes)):
            raise TypeError("`ema_buffers` must be an nn.Module or (name, tensor) pairs")
        else:
            pairs = list(source)
            for item in pairs:
                if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                        and isinstance(item[1], Tensor) and item[1].is_floating_point()):
                    raise TypeError(f"`ema_buffers` entries must be (name, floating-point tensor) pairs, "
                                    f"got {item!r}")
        names = [n for n, _ in pairs]
        if len(set(names)) != len(names):
            raise ValueError("`ema_buffers`: duplicate names")
        return pairs

    def state_dict(self) -> dict:
        """torch's state dict, plus ``"ema_buffers"`` (name -> average) when buffers are averaged; the
        state-dict post-hooks see (and may change) the whole of it."""
        posts = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = OrderedDict()  # run below, on the finished dict
        try:
            sd = self._plain_state(super().state_dict())
        finally:
            self._optimizer_state_dict_post_hooks = posts
        if self._ema_buffers:
            sd = {**sd, "ema_buffers": {n: a.detach().clone() for (n, _), a in
                                        zip(self._ema_buffers, self._ema_buffer_avgs)}}
        for hook in posts.values():
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    @staticmethod
    def _plain_state(sd: Any) -> Any:
        """A state dict whose per-parameter entries are plain dicts (not the tracked ones), as torch's."""
        if isinstance(sd, dict) and isinstance(sd.get("state"), dict):
            sd = {**sd, "state": {k: dict(v) if isinstance(v, _Slots) else v for k, v in sd["state"].items()}}
        return sd

    def _mark_host_count(self) -> None:
        """Record the count tensor and its version as those the host count was taken from."""
        it = self._iterations
        self._record.seen = (it, it._version)

    def _host_count_exact(self) -> bool:
        """Whether the host count ``_host_iterations`` still equals ``iterations`` as far as the host can tell
        without reading the device: no step could have been skipped, and the count tensor's version counter
        shows no write since the host counted (``opt.iterations.zero_()``, a ``copy_`` into it). Once not,
        the device count is used from then on. (Only the ``ema_overwrite_frequency`` cadence relies on it:
        a write that bypasses the version counter, through ``.data`` or a collective, is not seen.)"""
        if not self._host_exact:
            return False
        seen = getattr(self._record, "seen", None)  # (absent in a record pickled by an earlier optkit)
        it = self._iterations
        if seen is None or seen[0] is not it or seen[1] != it._version:
            self._host_exact = False
            return False
        return True

    def _ema_weight(self, applied: Tensor | None) -> Tensor:
        hp = torch.float64 if self._state_device.type in ("cpu", "cuda") else torch.float32
        first = (self._iterations == 0).to(hp)
        if self.ema_warmup:  # min(μ, (1 + k)/(10 + k)) with k = updates applied before this one
            k = self._iterations.to(hp)
            mu = torch.clamp((1.0 + k) / (10.0 + k), max=self.ema_momentum)
            w = first + (1.0 - first) * (1.0 - mu)
        else:
            w = first + (1.0 - first) * (1.0 - self.ema_momentum)
        return w if applied is None else w * applied

    def _ema_group(self, group: dict, indices: list[int], applied: Tensor | None) -> None:
        ps = [group["params"][i] for i in indices]
        avgs = [self.state[p]["average"] for p in ps]
        mt.lerp_([mt.local(a) for a in avgs], [mt.local(p) for p in ps], self._ema_weight(applied))

    def _after_update(self, found_inf: Tensor | None, applied: Tensor | None) -> None:
        if self._ema_buffers:
            mt.lerp_([mt.local(a) for a in self._ema_buffer_avgs],
                     [mt.local(b) for _, b in self._ema_buffers], self._ema_weight(applied))
        # a host count would specialise a traced step on its value and be baked into a CUDA graph's
        # replays: count on the device only from then on
        tracing = torch.compiler.is_compiling() or mt.capturing(self._state_device)
        if tracing:
            self._host_exact = False
        exact = not tracing and self._host_count_exact()
        f = self.ema_overwrite_frequency
        if self.use_ema and f:
            if exact:
                if (self._host_iterations + 1) % f == 0:
                    self._overwrite_with_averages(None)
            else:
                cond = (((self._iterations + 1) % f) == 0).to(torch.float32)
                self._overwrite_with_averages(cond if applied is None else cond * applied)
        if applied is None:
            self._iterations.add_(1)
            if exact:  # (a count written from outside is not counted on: the host stops counting)
                self._host_iterations += 1
                self._mark_host_count()
            self.step_applied = torch.ones((), dtype=torch.bool, device=self._state_device)
        else:
            self._iterations.add_(applied.to(torch.int64))
            self.step_applied = applied > 0.5

    def _overwrite_with_averages(self, weight: Tensor | None) -> None:
        ps = [p for g in self.param_groups for p in g["params"]]
        avgs = [self.state[p]["average"] for p in ps] + self._ema_buffer_avgs
        ps += [b for _, b in self._ema_buffers]
        lp, la = [mt.local(p) for p in ps], [mt.local(a) for a in avgs]
        if weight is None:
            torch._foreach_copy_(lp, la)
        else:
            mt.lerp_(lp, la, weight)

    # ------------------------------------------------------------------------------------------------ hooks

    def finalize_variable_values(self, var_list: Sequence[Tensor] | None = None) -> None:
        """With EMA on, set every parameter (or those in ``var_list``) to its moving average (one way: see
        :meth:`ema_weights` to evaluate with the averages and continue training)."""
        if not self.use_ema:
            return
        ps = self._with_averages(var_list, "finalize_variable_values")
        with torch.no_grad():
            if ps:
                torch._foreach_copy_([mt.local(p) for p in ps],
                                     [mt.local(self.state[p]["average"]) for p in ps])
            if var_list is None and self._ema_buffers:
                torch._foreach_copy_([mt.local(b) for _, b in self._ema_buffers],
                                     [mt.local(a) for a in self._ema_buffer_avgs])

    def _refuse_overflowed_norm(self, found_inf: Tensor, norms: Tensor, inv: Tensor) -> Tensor:
        """Under an optkit loss-scale wrapper that backs off (it sets ``_overflow_probe``, a list): the skip
        flag, also set when a clip norm of the *scaled* gradients is not finite and the scale is above 1.
        The elements are finite (else the flag is set already), so the scale is so large that ``‖S·g‖²``
        overflows float32 (S·|g| beyond about 1.8e19) and the clip would be NaN or 0: the step is skipped and
        the flag goes into the probe, which the wrapper counts as an overflow (the scale backs off). Other
        callers (``torch.amp.GradScaler``, which would not back off) get the flag unchanged."""
        probe = self.__dict__.get("_overflow_probe")
        if probe is None:
            return found_inf
        bad = ((~torch.isfinite(norms)).any() & (inv.to(found_inf.device) < 1)).to(
            device=found_inf.device, dtype=found_inf.dtype)
        probe.append(bad)
        return torch.maximum(found_inf, bad)

    def _refuse_inside_ema_weights(self) -> None:
        """``RuntimeError`` inside an :meth:`ema_weights` block (a step there would train the averages); the
        steps of wrappers and train ops over this optimizer ask first, before they change anything."""
        if self._ema_swapped:
            raise RuntimeError("step() inside ema_weights(): the parameters hold their moving averages; "
                               "leave the block before training on")

    def _with_averages(self, var_list: Sequence[Tensor] | None, where: str) -> list[Tensor]:
        ps = self._all_params() if var_list is None else list(var_list)
        for p in ps:
            if p not in self.state or "average" not in self.state[p]:
                raise ValueError(f"{where}(): variable has no moving average")
        return ps

    @contextmanager
    def ema_weights(self, var_list: Sequence[Tensor] | None = None) -> Iterator[None]:
        """Inside the ``with`` block every parameter (or those in ``var_list``) holds its moving average; on
        exit, also after an exception, the training weights come back bit for bit. For evaluation and
        checkpoints of the averaged model in the middle of training; ``step()`` inside the block raises.

        Costs one copy of the parameters. The ``ema_buffers`` are swapped as well (without ``var_list``).
        ``ValueError`` without ``use_ema=True``."""
        if not self.use_ema:
            raise ValueError("ema_weights(): the optimizer keeps no moving averages (use_ema=False)")
        if self._ema_swapped:
            raise RuntimeError("ema_weights(): already inside an ema_weights() block")
        chosen = self._with_averages(var_list, "ema_weights")  # (a generator is read once)
        ps = [mt.local(p) for p in chosen]
        avgs = [mt.local(self.state[p]["average"]) for p in chosen]
        if var_list is None:  # the registered buffers (BatchNorm statistics) too
            ps += [mt.local(b) for _, b in self._ema_buffers]
            avgs += [mt.local(a) for a in self._ema_buffer_avgs]
        with torch.no_grad():
            saved = [p.detach().clone(memory_format=torch.preserve_format) for p in ps]
            if ps:
                torch._foreach_copy_(ps, avgs)
        self._ema_swapped = True
        try:
            yield
        finally:
            with torch.no_grad():
                if ps:
                    torch._foreach_copy_(ps, saved)
            self._ema_swapped = False

    # ------------------------------------------------------------------------------------------------ hooks

    def _prepare(self, group: dict, plan: Any, params: list[Tensor], grads: list[Tensor], lr: Tensor,
                 k: Tensor | None) -> list | None:
        """Per-tensor values the update needs (e.g. LARS trust ratios), computed on whole tensors before the
        blocked elementwise pass; ``plan`` holds ``names``, ``slots`` and ``use_wd`` (the weight-decay mask)
        for ``params``. Default: none."""
        return None

    def _update(
        self,
        group: dict,
        params: list[Tensor],
        grads: list[Tensor],
        slots: dict[str, list[Tensor]],
        lr: Tensor,
        k: Tensor | None,
        found_inf: Tensor | None,
        aux: list | None,
    ) -> None:
        """The update rule over (chunks of) local tensors. The true gradient is ``k·grads`` (``k`` None
        means 1); when ``found_inf`` is 1 nothing may change. Subclasses implement this."""
        raise TypeError(f"{type(self).__name__} must implement _update()")

    def _update_one(self, group: dict, index: int, p: Tensor, g: Tensor, lr: Tensor) -> None:
        """The rule on one parameter with gradient ``g`` (Keras ``update_step``)."""
        name = group["param_names"][index]
        slots = {s: [self.state[p][s]] for s in self._active_slots(group)}
        plan = PlanView([name], slots, [self._use_weight_decay(p, name)])
        aux = self._prepare(group, plan, [p], [g], lr, None)
        self._update(group, [mt.local(p)], [mt.local(g)],
                     {s: [mt.local(t) for t in v] for s, v in slots.items()}, lr, None, None, aux)

    # --------------------------------------------------------------------------------------------- checkpoint

    def __getstate__(self) -> dict:
        """Everything (torch's own version keeps only defaults, state and param_groups, which would lose the
        Keras options and the counters); cached plans are rebuilt on the next step."""
        state = dict(self.__dict__)
        state["_block"] = None
        state["_ema_swapped"] = False  # a copy taken inside ema_weights() holds the averages as its weights
        # caches keyed by group ids or storage addresses, which a copy does not keep
        for key in ("_plans", "_fold_cache", "_fp64_cache", "_fit_seen", "_slots_seen", "_flat_slots",
                    "_lr_written"):
            state[key] = {}
        state["_zeroed_groups"] = set()
        # parameters excluded from decay by identity travel as the tensors themselves (a copy's are new)
        ids = state.pop("_wd_exclude_ids", set())
        state["_wd_exclude_params"] = [p for g in self.param_groups for p in g["params"] if id(p) in ids]
        return state

    def __setstate__(self, state: dict) -> None:
        if "_iterations" in state and "_record" not in state:  # pickled by an earlier optkit
            record = state["_record"] = _HostRecord()
            record.iterations = state.pop("_host_iterations", 0)
            record.exact = state.pop("_host_exact", False)
            record.applied = state.pop("step_applied", None)
        excluded = state.pop("_wd_exclude_params", None)
        super().__setstate__(state)
        if excluded is not None:
            self._wd_exclude_ids = {id(p) for p in excluded}
        if "_iterations" not in state:  # torch's load_state_dict also lands here; it re-links afterwards
            return
        if "_state_version" not in state:  # pickled by an earlier optkit
            self._adopt_state()
        for g in self.param_groups:  # (new group dicts)
            self._record_group(g)
        # a copy or unpickle: the state entries each got their own 'step' tensor, share the counter again
        for g in self.param_groups:
            for p in g["params"]:
                if p in self.state:
                    self.state[p]["step"] = self._iterations

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a :meth:`state_dict` (torch format), checked before anything changes.

        torch's load pre-hooks run first; then the structure, every slot (a tensor of the parameter's shape,
        real floating dtype, dense) and every step count are validated against this optimizer, raising
        ``ValueError`` that names the parameter and slot; then torch's loading (slots cast to the parameter's
        dtype and device), and the post-hooks last. Afterwards the names given at construction are kept,
        every parameter shares one ``iterations`` counter, slots are the optimizer's own copies in their
        parameter's memory layout, and a missing EMA average starts from the current weights.
        """
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        sd = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, sd)
            if result is not None:
                sd = result
        sd = dict(sd)
        buffer_avgs = self._check_ema_buffers(sd.pop("ema_buffers", None))
        sd = adopt_torch_groups(self, sd)
        if isinstance(sd.get("param_groups"), list):  # keys a group would ignore, as for given groups
            for saved, live in zip(sd["param_groups"], self.param_groups):
                if isinstance(saved, dict):
                    self._check_group_keys(saved, live)
        step = validate_state_dict(self, sd)
        # own copies: torch would alias the given tensors (``Tensor.to`` returns the same tensor when nothing
        # changes), so two optimizers loaded from one live state dict would update one buffer; an entry that
        # is not a parameter's state is loaded as it is (torch's rule)
        ids = {i for g in sd["param_groups"] for i in g["params"]}
        own = {key: {s: v.detach().clone() if isinstance(v, Tensor) else v for s, v in e.items()}
               if key in ids else e for key, e in sd["state"].items()}
        sd = {**sd, "state": own}
        names = [list(g["param_names"]) for g in self.param_groups]
        pre, post = self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks
        self._optimizer_load_state_dict_pre_hooks = type(pre)()
        self._optimizer_load_state_dict_post_hooks = type(post)()
        try:
            super().load_state_dict(sd)
        finally:
            self._optimizer_load_state_dict_pre_hooks = pre
            self._optimizer_load_state_dict_post_hooks = post
        self._lr_written.clear()  # new group dicts (an old id may be reused)
        self._adopt_state()  # (torch's load put in a plain defaultdict)
        for g, ns in zip(self.param_groups, names):
            g["param_names"] = ns
            self._group_key_aliases(g, self.defaults)
            self._record_group(g)
        self._invalidate_plans()
        self._iterations = torch.as_tensor(step, dtype=torch.int64).to(self._state_device).clone()
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state[p]
                if self.use_ema and "average" not in st:
                    st["average"] = p.detach().clone(memory_format=torch.preserve_format)
                self._init_state(p, g)
                in_flat = flat_buffer_of(p) is not None
                for key, v in st.items():
                    if key == "step" or not isinstance(v, Tensor) or mt.is_dtensor(v):
                        continue
                    if in_flat and v.shape == p.shape:
                        # back into this slot's flat buffer (the loaded tensor is a separate one), so that a
                        # resumed run keeps stepping the whole buffer at once
                        st[key] = self._new_slot(p, key, 0.0).copy_(v)
                    elif v.stride() != mt.local(p).stride():
                        st[key] = torch.empty_like(p, memory_format=torch.preserve_format).copy_(v)
        self._host_iterations = int(self._iterations)
        self._host_exact = True
        self._mark_host_count()
        if buffer_avgs is None and self._ema_buffers:  # saved without them: start from the buffers now, as a
            buffer_avgs = [b for _, b in self._ema_buffers]  # missing weight average starts from the weights
        if buffer_avgs is not None:
            with torch.no_grad():
                for a, v in zip(self._ema_buffer_avgs, buffer_avgs):
                    a.copy_(v)
        if isinstance(self._learning_rate, (float, Tensor)) and self.param_groups:
            lr0 = self._default_lr()
            self._learning_rate = lr0 if isinstance(lr0, Tensor) else float(lr0)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _check_ema_buffers(self, saved: Any) -> list[Tensor] | None:
        """The saved buffer averages in this optimizer's order, checked (``ValueError`` naming the buffer);
        None when there are none to load (saved without them: the averages restart from the buffers)."""
        if saved is None:
            return None
        if not self._ema_buffers:
            raise ValueError("load_state_dict: the state holds 'ema_buffers' but this optimizer averages no "
                             "buffers (pass ema_buffers=...)")
        if not isinstance(saved, dict) or set(saved) != {n for n, _ in self._ema_buffers}:
            got = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
            want = sorted(n for n, _ in self._ema_buffers)
            raise ValueError(f"load_state_dict: 'ema_buffers' must hold {want}, got {got}")
        out = []
        for n, b in self._ema_buffers:  # (the checks of a loaded slot: dense, real floating, data, shape)
            check_loaded_slot(f"{type(self).__name__}.load_state_dict", n, "average", b, saved[n])
            out.append(saved[n])
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, config={self.get_config()!r})"
