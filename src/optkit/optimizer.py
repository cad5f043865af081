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
   ``weight_decay`` means something else declare ``Traits(decoupled_weight_decay=False)``);
5. the optimizer's update rule with the current learning rate;
6. EMA ``avg ← μ·avg + (1−μ)·w`` over all parameters (the first applied step copies ``w``), and the optional
   overwrite ``w ← avg`` every ``ema_overwrite_frequency`` applied steps;
7. ``iterations += 1``.

When ``found_inf`` (a 0-d tensor, 1.0 = skip) is set by a wrapper, the whole pipeline is a no-op on device
(no host sync): the fused kernels take ``found_inf``, and every other factor is blended with it, so a skipped
step changes no parameter, slot, average or counter. All state exists from construction, so nothing is
created lazily on a skipped step. ``step_applied`` holds the outcome as a 0-d bool tensor.

Layering: this class is the torch- and Keras-facing surface and the pipeline above (:meth:`Optimizer._apply`);
the engine it composes is the package :mod:`optkit._core`, one concern a module (its docstring maps them):
param groups, slots, learning rate, gradients (unscale, clip), the eager passes over cached plans, the
fused-kernel gate, ``jit_compile``, EMA, checkpoints, the TF/Keras methods. An optimizer subclass is its
rule: ``_pointwise`` (with ``_pointwise_hyper`` and ``slot_names``), optionally a faster ``_update`` and
a per-tensor ``_prepare``, and one ``traits`` declaration (:class:`optkit._core.traits.Traits`);
:mod:`optkit.lion` is the shortest. Wrappers and the train op call :meth:`Optimizer.apply_step` with a
:class:`~optkit._core.context.StepContext` and ask anything else through :attr:`Optimizer.engine`.

Performance: unscaling and global clipping fold into the optimizer's fused kernel as one scalar factor, so the
only extra traffic is one read-only norm pass; weight decay, the update and the EMA run block by block over
cache-sized chunks (``_multi_tensor.blocks``) so their chain costs about one sweep over memory.

Gradients: ``step()`` leaves each ``.grad`` as ``torch.optim`` does (bitwise, or ``g/S`` under a loss scale).
Update rules that use their gradients as scratch (LARS, LAMB, Nesterov SGD, the multipliers, a global clip
factor folded into a kernel) get in-cache copies of the gradient chunks in the blocked pass (no extra sweep);
``clipnorm``/``clipvalue`` transform whole copies. ``scratch_grads=True`` (the train op) skips the copies.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.optim.optimizer as _torch_optimizer
from torch import Tensor
from typing_extensions import Self

from . import _multi_tensor as mt
from ._amp import AmpProtocol
from ._arguments import accepted_keywords, check_call, check_nesterov, unknown_arguments_error
from ._core.checkpoint import CheckpointMixin
from ._core.compiled import CompiledMixin
from ._core.context import StepContext, StepResult
from ._core.derived import run_rule
from ._core.ema import EmaMixin
from ._core.gradients import GradientsMixin
from ._core.groups import GroupsMixin
from ._core.interface import EngineInterface
from ._core.lean import LeanMixin
from ._core.learning_rate import LearningRateMixin
from ._core.params import normalize_param_groups
from ._core.passes import PassesMixin
from ._core.plan import (
    Plan,
    PlanView,
)
from ._core.slots import SlotsMixin
from ._core.state import _HostRecord, _NewSlots, _Slots, _StateVersion, _TrackedState, record_field  # noqa: F401 (pickles name them here)
from ._core.state_dict import (
    check_group_types,
)
from ._core.tf_surface import TFSurface, autograd_pairs
from ._core.traits import Traits
from ._gc import gc_paused
from ._typing import LearningRate, OptimizerOptions, ParamsT
from ._validation import check_number

__all__ = ["Optimizer", "check_number", "check_nesterov", "autograd_pairs", "ParamsT", "LearningRate",
           "OptimizerOptions"]

_PARAMS = operator.itemgetter("params")




class Optimizer(GroupsMixin, SlotsMixin, LearningRateMixin, GradientsMixin, LeanMixin, PassesMixin,
                CompiledMixin, EmaMixin, CheckpointMixin, AmpProtocol, TFSurface, torch.optim.Optimizer):
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
        precision: bfloat16 parameters without fp32 master copies (default None: updated in bfloat16):
            ``"split"`` keeps each weight's low 16 bits (2 B/param) so the fp32 trajectory is exactly an fp32
            master's; ``"kahan"`` keeps a bfloat16 compensation (2 B/param); ``"stochastic"`` rounds
            stochastically (0 B). Other parameters step as usual (:mod:`optkit._core.lowp`).
        state_dtype: the slots' storage: None (float32 under a ``precision``, else the parameter's dtype),
            ``"float32"``, ``"bfloat16"`` or
            ``"int8"`` (block-wise 8-bit, tensors of 4,096 elements or more; the rest float32). The rule
            computes in float32 either way; state dicts keep the stored form and load into any other.
        rounding_seed: seed of the stochastic rounding (``precision="stochastic"``); with the step count
            saved in the state dict, a resumed run rounds bit for bit as the uninterrupted one.

    Every optimizer takes ``params`` and then the learning rate positionally; everything else is keyword-only.
    A keyword of torch.optim, timm, apex or Keras that optkit spells otherwise (``betas``, ``eps``,
    ``maximize``, ``trust_coefficient``, ...) is refused before anything is built, with the optkit spelling
    (``optkit._arguments.HINTS``); ``use_nesterov`` (TF1) is accepted for ``nesterov``.

    Subclasses set ``slot_names`` and ``_pointwise`` with :meth:`_pointwise_hyper` (and optionally a faster
    :meth:`_update`, :meth:`_prepare`, :meth:`_slot_fill`, :meth:`_sparse_update`).
    """

    slot_names: tuple[str, ...] = ()
    #: multiplies each param group's ``lr_scale`` into its learning rate itself (so ``ScheduleLR`` and
    #: ``create_optimizer`` leave the group's ``lr`` unscaled; read by ``optkit.schedules.applies_lr_scale``)
    applies_lr_scale = True
    #: how the engine runs this rule (decoupled decay, blocks, sparse form, what it does with its gradients):
    #: one declaration per class, :class:`optkit._core.traits.Traits`
    traits: ClassVar[Traits] = Traits()

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
        precision: str | None = None,
        state_dtype: str | torch.dtype | None = None,
        rounding_seed: int = 0,
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
        self._lean_setup(precision, state_dtype, rounding_seed)
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
        self._check_lean_params(self.precision, groups)

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
        # (id(group), dtype) -> mt.ElementFactors: per-tensor factors over separate tensors off the CPU
        # (clipnorm, LARS, LARC's multipliers), one element vector per group while its tensors' layout stays
        self._factor_cache: dict[tuple, Any] = {}
        self._plan_version = 0
        self._fp64_cache: dict[int, tuple] = {}
        #: id(group) -> ((lr value, dtype, device), its 0-d tensor): a constant lr is filled once
        self._lr_scalars: dict[int, tuple] = {}
        self._block = None  # the Block of the blocked pass being run (kernel-gate and grouping hints)
        self._grads_protected = False  # (_prepare: the gradients it gets are the caller's; see _guards)
        self._shadow_src: tuple | None = None  # (a keeps_values_in_grads rule's _prepare copies these)
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
        #: the constant "applied" flag of an unskipped step (one tensor, not a fill per step)
        self._applied_true = torch.ones((), dtype=torch.bool, device=self._state_device)
        self.step_applied = self._applied_true

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

    # ------------------------------------------------------------------------------------------------ lr

    @property
    def iterations(self) -> Tensor:
        """Number of applied updates (0-d int64 tensor; skipped steps do not count). The live count: written
        in place (``opt.iterations.zero_()``), schedules, the EMA and its overwrite cadence follow it; a
        write that bypasses the tensor's version counter (through ``.data`` or a collective) is followed by
        schedules, but the EMA's weight (while no step could have been skipped) and the
        ``ema_overwrite_frequency`` cadence keep the host's own count until :meth:`load_state_dict`."""
        return self._iterations

    # ------------------------------------------------------------------------------------------------ decay

    # ------------------------------------------------------------------------------------------------ step

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
        self.apply_step(StepContext.from_attributes(self))
        return loss

    @property
    def engine(self) -> EngineInterface:
        """What optkit's wrappers, train op and checkpoint helpers may ask of this optimizer beyond its torch
        and Keras surface (:class:`~optkit._core.interface.EngineInterface`); not needed to train."""
        return EngineInterface(self)

    @torch.no_grad()
    def apply_step(self, context: StepContext) -> StepResult:
        """One update under ``context``: the step protocol as a value (:class:`~optkit._core.context.
        StepContext`: loss scale, skip flag, per-parameter multipliers, what the caller already read, whether
        it zeroes the gradients next), for optkit's wrappers and train op; returns what the step did. The
        caller runs the step hooks (``step()`` is this, between them, with the context its attributes set)."""
        self._refuse_inside_ema_weights()
        with gc_paused(sum(map(len, map(_PARAMS, self.param_groups)))):
            return self._apply(context)

    def _apply(self, context: StepContext) -> StepResult:
        """The pipeline of the module doc under ``context``. Its ``multipliers`` map ``id(param)`` to a 0-d
        tensor that multiplies that parameter's gradient before clipping (LARC folds its per-tensor factor
        into the blocked pass this way instead of a separate sweep)."""
        grad_scale, found_inf, multipliers = context.grad_scale, context.found_inf, context.multipliers
        overflow: list[Tensor] | None = [] if context.report_overflow else None
        zeroed: set[int] = set()
        dev = self._state_device
        # every group's numeric hyperparameters are numbers before anything is written (a None momentum in
        # the second group raised from float() after the first was updated)
        for gi, group in enumerate(self.param_groups):
            check_group_types(group, f"{type(self).__name__}.step (param group {gi})")
        self._ensure_slots()
        if self._any_dtensor:  # tensor + sequence parallel: Partial gradients are reduced before anything
            mt.reduce_partial_grads_(p for g in self.param_groups for p in g["params"])
        # what a wrapper's _flat_part (or whole_grads, handed over as ``context.gathered``) read this step
        probed = getattr(multipliers, "gathered", None)
        seen = probed or context.gathered
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
            return StepResult(self.step_applied)
        # the caller's gradients (see ``scratch_grads``): the pass runs on copies when clipnorm/clipvalue (the
        # optimizer's math, Keras) transform them, and those the pass does not unscale in place itself (all
        # of them then, else the sparse ones) are unscaled at the end under a loss scale
        callers: list[Tensor] = []
        own = self._clips_copy()
        if own:
            if grad_scale is not None:
                callers = [g for _, _, gs in gathered for g in gs]
            one = torch.ones((), dtype=torch.float32, device=dev)
            # (a master-free bfloat16 weight's copy is float32: the clip factor is applied as on its fp32
            # master's gradient, not rounded to bfloat16 again)
            gathered = [(idx, ps, mt.scaled_copies(gs, one, [
                torch.float32 if self._weight_form(p) is not None and not g.is_sparse else g.dtype
                for p, g in zip(ps, gs)])) for idx, ps, gs in gathered]
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
                if fp is None and params and not self._lean_group(group):
                    pre_plans[i] = self._check_group_plan(group, idx, params, grads, sparse_handled, mult)

        # unscale and clip: the factor k (k64 for float64 groups) folded into the kernels, or applied here
        k, k64, inv, inv64, found_inf = self._unscale_and_clip(gathered, flat_plans, grad_scale, found_inf,
                                                               overflow)

        applied = None if found_inf is None else (1.0 - found_inf)
        self._rounding_step += 1  # (stochastic rounding's seed: one per step call, skipped or not)
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
            unscale = None if own or self.scratch_grads else (inv64 if fp64 else inv)
            self._run_group(group, idx, params, grads, lr, kg, found_inf, applied, sparse_handled, mult,
                            plan=fp, checked=pre, zero=context.zero_grads, zeroed=zeroed, unscale=unscale)
        if callers:  # g/S, as GradScaler.unscale_ leaves them (float64 ones with the float64 1/S)
            mt.scale_(callers, inv, scale64=inv64)

        self._after_update(found_inf, applied)
        return StepResult(self.step_applied, frozenset(zeroed), overflow[0] if overflow else None)

    # ------------------------------------------------------------------------------------------------ jit

    def _pointwise_hyper(self, group: dict) -> tuple:
        """The group's static hyperparameters for :meth:`_pointwise` (Python constants; compile guards)."""
        return ()

    #: the update rule as out-of-place pointwise math for ``jit_compile`` and the no-kernel fallback (a
    #: staticmethod ``(hyper, w, g, slots, lr, k, aux) -> (new_w, new_slots)``; ``g`` is the raw gradient,
    #: the true gradient is ``k·g``); None means the optimizer has no compilable form and runs eagerly.
    _pointwise: Callable | None = None

    # ------------------------------------------------------------------------------------------------ EMA

    def _after_update(self, found_inf: Tensor | None, applied: Tensor | None) -> None:
        if self._ema_buffers:
            mt.lerp_([mt.local(a) for a in self._ema_buffer_avgs],
                     [mt.local(b) for _, b in self._ema_buffers], self._ema_lerp_weight(applied))
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
            true = self._applied_true
            if true.device != self._state_device:
                true = self._applied_true = torch.ones((), dtype=torch.bool, device=self._state_device)
            self.step_applied = true
        else:
            self.step_applied = applied > 0.5
            self._iterations.add_(self.step_applied)  # (int64 plus bool: no cast kernel)

    # ------------------------------------------------------------------------------------------------ hooks

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
        means 1); when ``found_inf`` is 1 nothing may change. Default: the class's ``_pointwise`` rule run
        as multi-tensor ops (:func:`optkit._core.derived.run_rule`), which leave ``k·g`` in the gradients; a
        subclass may implement a faster form."""
        if type(self)._pointwise is None:
            raise TypeError(f"{type(self).__name__} must implement _update() or _pointwise")
        run_rule(type(self)._pointwise, self._pointwise_hyper(group), params, grads,
                 [slots[s] for s in self._active_slots(group)], lr, k, found_inf, aux,
                 group_by=self._by_device_dtype)

    def _update_writes_grads(self, group: dict) -> bool:
        """The class's ``traits.writes_grads``; False with the default :meth:`_update` (only ``k·g``)."""
        return type(self)._update is not Optimizer._update and super()._update_writes_grads(group)

    def _update_one(self, group: dict, index: int, p: Tensor, g: Tensor, lr: Tensor) -> None:
        """The rule on one parameter with gradient ``g`` (Keras ``update_step``)."""
        name = group["param_names"][index]
        if self._lean_group(group):  # (decoded into fp32 scratch, the rule, encoded back: optkit._core.lean)
            self._lean_update_one(group, index, p, g, lr)
            return
        slots = {s: [self.state[p][s]] for s in self._active_slots(group)}
        plan = PlanView([name], slots, [self._use_weight_decay(p, name)], mt.is_dtensor(p))
        aux = self._prepare(group, plan, [p], [g], lr, None)
        self._update(group, [mt.local(p)], [mt.local(g)],
                     {s: [mt.local(t) for t in v] for s, v in slots.items()}, lr, None, None, aux)

    # --------------------------------------------------------------------------------------------- checkpoint

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, config={self.get_config()!r})"
