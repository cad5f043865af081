"""``optimize_loss``: OpenSeq2Seq's one-call training step, as an eager PyTorch train op
(``optimize_loss`` in ``open_seq2seq/optimizers/optimizers.py``).

``train_op = optimize_loss(loss, "Momentum", {"momentum": 0.9}, lambda k: poly_decay(k, 0.1, 1000), ...)``
returns a :class:`TrainOp`; ``train_op(*inputs)`` runs one micro-step and returns a :class:`StepResult`.
One update (``n`` micro-batches, ``W`` ranks, loss scale ``S``) does, in the original's order:

1. forward ``L = fp32(loss(*inputs))``; backward of ``L·S`` into the parameters' ``.grad`` (``"mixed"``:
   :meth:`MixedPrecisionOptimizerWrapper.accumulate_grads` folds the half gradients into the fp32 gradient
   buffers of its master copies after every micro-batch, so the window is summed in fp32);
2. accumulation: PyTorch's own ``.grad`` accumulation sums the ``n`` scaled micro-batch gradients; the scale
   ``S`` stays fixed inside the window (the scaler only moves at update attempts);
3. distributed: one bucketed ``all_reduce`` (SUM) of the accumulated gradients per update, or, with a
   ``DistributedDataParallel`` model, DDP's own reduction with ``no_sync()`` on accumulation micro-steps;
   FSDP2 (DTensor) parameters are reduce-scattered and averaged by FSDP2 itself (no second reduction; with
   an FSDP2 ``model``, ``set_requires_gradient_sync(False)`` on accumulation micro-steps);
4. ``"mixed"``: diverted regularizers of half parameters add ``S·n·W·∂R/∂master`` (they are evaluated on the
   fp32 master, as OpenSeq2Seq's ``mp_regularizer_wrapper`` does);
5. global norm ``N = ‖Σ grads‖ / (S·n·W)`` (fp32) — the true norm of the *mean* gradient — logged as
   ``global_gradient_norm``;
6. clip (``clip_gradients = c``): ``s = min(1, c/N)`` (no epsilon, as the original);
7. summaries of the learning rate, the norms and the variables (due steps only);
8. non-finite check (any NaN/inf element in any gradient of the window, from a max-abs pass next to the norm
   pass, or in the same compiled read as the norm when the optimizer was built with ``jit_compile=True``
   (:func:`optkit._core.chain.norm_check_sums`), so the decision is the same on any number of ranks; with
   ``clip_gradients`` and a scaler that backs off, also a non-finite ``‖Σ grads‖`` of finite elements under
   a scale above 1, which is then too large for a float32 norm) decides whether the scaler lets the update
   apply (the scaler itself advances after step 9, so an update that raises leaves the scale as it was);
9. the optimizer stack's step with ``lr(k)``, ``k`` = applied updates so far (a skipped update changes
   nothing): ``LARC`` (``larc_params``, :mod:`optkit.larc`) computes per parameter
   ``r = min(max(η‖w‖/(lr(‖g‖+ε)), min_update), 1)`` (clip mode) or ``max(η‖w‖/(‖g‖+ε), min_update)``
   (scale mode) on the mean unscaled gradient and hands ``r`` inward; LARC summaries are written from
   the ratios it used; ``"mixed"``: the :class:`~optkit.mixed_precision.MixedPrecisionOptimizerWrapper`
   steps the fp32 masters and copies back ``p16 ← saturate(master)``;
10. gradients cleared for the next window. An update that raises before it is committed (a summary writer's
    I/O error, an optimizer refusing its state) changes no weight, slot, scale or step and drops its window:
    the window's gradients are cleared too, so the next window starts afresh. So does a micro-step whose
    backward (or fp32 fold) raises, out of memory or in a hook: part of its gradient may have landed and
    cannot be told apart from the window's. A loss function that raises changes nothing.

The optimizer stack is ``MixedPrecisionOptimizerWrapper(LARC(cls(params)))`` with the parts not asked for left
out. The wrappers get no loss scale of their own (``loss_scale=None``: a fixed scale of 1, no check); the
train op drives the scaler and talks to the outermost optimizer through the step protocol
(:mod:`optkit._wrapper`). LARC therefore runs after the skip decision (the spec puts it before): only
``LogMax`` depends on that order (its ``max|g|`` is taken after LARC), and for it the ratios are computed
ahead with :meth:`LARC.trust_ratios`.

Folding (performance): steps 2, 5, 6 and 8 never rewrite the gradients. The mean, the unscale and the clip
factor form one 0-d factor ``s/(S·n·W)`` handed to the optimizer stack as ``grad_scale`` (the innermost fused
kernel divides by it), LARC ratios go in as ``grad_multipliers``, the skip decision as ``found_inf``: every
optkit optimizer and wrapper and torch's fused optimizers (``_step_supports_amp_scaling``) take these in their
update pass. So an update costs one read-only norm pass over the gradients (two with a dynamic scaler: the
norm and the per-element overflow check, one collective per mesh-dim group for both) plus the optimizer's own
pass (LARC adds its own norm pass over weights and gradients); nothing reads a tensor on the host unless
summaries are due (or a non-fused torch optimizer must be skipped, as GradScaler does). Distributed layouts,
collectives and memory: ``docs/distributed.md``.

Deliberate differences from the original (also in ``docs/compatibility.md``):

* ``iter_size`` works without ``on_horovod``, and an update uses the exact mean of the micro-batches
  accumulated since the last update (the original divided by ``iter_size`` always, so its first window — one
  micro-batch — and any early update were scaled down). Automatic windows: without ``skip_update_ph`` an
  update happens on every ``iter_size``-th call, the first one included. A window holding a non-finite
  micro-batch is dropped whole and the scaler backs off once.
* ``loss_scaling`` is honoured for every dtype (the original used it only for ``"mixed"``); ints are accepted
  as static scales; ``"dynamic"`` (TF's rule) joins ``"Backoff"`` and ``"LogMax"``.
* AdamW: the original multiplied ``weight_decay`` by lr(k) because TF's contrib AdamW decays by
  ``weight_decay·w`` only. optkit's and torch's AdamW already decay by ``lr·weight_decay·w``, so the value is
  passed through unchanged (same effective decay, no mutation of ``optimizer_params``).
* ``clip_gradients`` together with ``larc_params`` raises ``ValueError`` (``AttributeError`` in the original).
* LARC clip mode with ``lr == 0`` uses ``r = 1`` instead of the original's 0/0 = NaN for a zero-norm weight.
* ``None`` gradients (unused parameters) are skipped everywhere instead of crashing.

This module holds the public surface (:func:`optimize_loss`, :class:`TrainOp`, :class:`StepResult`) and the
train op's micro-step and update; its construction (argument resolution, the optimizer stack, distribution) is
in :mod:`optkit._train_build`, its accumulation window (token counts, the window's divisor) in
:mod:`optkit._train_window`, its checkpoint (``state_dict``, the cross-rank gather, pickling) in
:mod:`optkit._train_checkpoint`.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from . import _multi_tensor as mt
from ._core.chain import norm_check_sums
from ._core.context import StepContext
from ._core.lean import normalize_state_dtype
from ._core.tf_surface import is_schedule
from ._train_build import (
    TrainOpBuild,
    build_scaler,
    check_positive,
    larc_settings,
    named_params,
    resolve_optimizer,
)
from ._train_checkpoint import TrainOpCheckpoint
from ._train_window import TrainOpWindow
from ._validation import check_lr_value
from ._wrapper import OptimizerWrapper, refuse_inside_ema_weights, step_inner
from .clipping import clip_coefficient
from .flat import flat_buffer_of
from .loss_scale import FixedLossScale, LossScale
from .optimizer import Optimizer as _OptkitOptimizer
from .regularization import _diverting, _registered
from .summaries import SummaryLogger, validate_summaries

__all__ = ["optimize_loss", "TrainOp", "StepResult"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, "mixed")
_PRECISIONS = ("fp32-masters", "split", "kahan", "stochastic")
_HALF = (torch.float16, torch.bfloat16)


class StepResult(NamedTuple):
    """What one call of the train op did. Every field is a tensor on the device (no host sync).

    ``loss``: this micro-batch's loss (fp32, unscaled, detached; ``loss_sum / num_items`` when the loss
    function returns that pair). ``applied``: 0-d bool, True when this call
    ended with an applied update (False for accumulation micro-steps and skipped updates). ``global_step``:
    applied updates so far (0-d int64). ``lr``: the learning rate of the update of this window (0-d fp32).
    ``loss_scale``: the scale this micro-batch's backward used. ``grad_norm``: the global norm of the
    averaged, unscaled gradient before clipping; ``None`` on accumulation micro-steps and when nothing
    needed it (no clipping, no dynamic scaling, no due summary).
    """

    loss: Tensor
    applied: Tensor
    global_step: Tensor
    lr: Tensor
    loss_scale: Tensor
    grad_norm: Tensor | None


# ------------------------------------------------------------------------------------------------------------


def optimize_loss(
    loss: Callable[..., Tensor | tuple[Tensor, float | Tensor]],
    optimizer: str | Callable[..., torch.optim.Optimizer],
    optimizer_params: Mapping[str, Any] | None = None,
    learning_rate_decay_fn: Callable[[Any], Any] | float | None = None,
    var_list: Iterable[Tensor] | Iterable[tuple[str, Tensor]] | None = None,
    dtype: torch.dtype | str = torch.float32,
    clip_gradients: float | None = None,
    summaries: Sequence[str] | None = None,
    larc_params: Mapping[str, Any] | None = None,
    loss_scaling: float | str | LossScale = 1.0,
    loss_scaling_params: Mapping[str, Any] | None = None,
    on_horovod: bool = False,
    iter_size: int = 1,
    skip_update_ph: bool | Callable[[], bool] | None = None,
    model: nn.Module | None = None,
    *,
    summary_writer: Any = None,
    summary_every: int = 100,
    process_group: Any = None,
    bucket_numel: int = 1 << 22,
    pipeline_group: Any = None,
    rules: Sequence[tuple[Any, Mapping[str, Any]]] | None = None,
    layer_decay: float | None = None,
    num_layers: int | None = None,
    no_decay_1d: bool = True,
    layer_regex: str | None = None,
    final_norm: str | None = None,
    precision: str | None = None,
    state_dtype: str | torch.dtype | None = None,
) -> TrainOp:
    """Build the train op for ``loss`` (OpenSeq2Seq ``optimize_loss``; see the module docstring for the
    per-update order and the differences from the original).

    Args:
        loss: callable ``loss(*inputs) -> scalar tensor`` (e.g. ``fp32(model loss) +
            get_regularization_loss()``); ``train_op(*inputs)`` calls it once per micro-step. It may return
            ``(loss_sum, num_items)`` instead (token-weighted accumulation, as Hugging Face since
            transformers#34242): the update then uses ``Σ loss_sum / Σ num_items`` over the window's
            micro-batches and the ranks, so micro-batches with more items (tokens) weigh more and a partial
            window stays exact; ``num_items`` (a number or 0-d tensor, summed with one extra scalar
            all-reduce per update when distributed) must be given on every call. A regularization loss
            ``R`` goes in as ``(loss_sum + num_items * R, num_items)`` so that it weighs once per update (as
            in an averaged window, and as ``"mixed"`` weighs the regularizers it diverts to the masters).
        optimizer: a registry name (``OPTIMIZER_CLS_NAMES``) or an optimizer class; built as
            ``cls(params, learning_rate=lr, **optimizer_params)`` (``lr=`` for torch classes).
        optimizer_params: constructor arguments (not mutated).
        learning_rate_decay_fn: ``step -> lr`` (a policy, a ``LearningRateSchedule`` or any callable; the step
            is the number of applied updates), or a number for a constant lr. ``None``: ``learning_rate`` (or
            ``lr``) from ``optimizer_params``.
        var_list: the parameters (tensors or ``(name, tensor)`` pairs) to train; default: ``model``'s (or an
            ``nn.Module`` ``loss``'s) parameters with ``requires_grad``. Others are frozen.
        dtype: ``torch.float32``, ``torch.float16``, ``torch.bfloat16`` (the model's own precision) or
            ``"mixed"``: fp16/bf16 parameters get fp32 master copies that the optimizer updates.
        clip_gradients: max global norm (float); ``larc_params``: LARC (``larc_eta`` required, ``larc_mode``
            ``"clip"``/``"scale"``, ``min_update``, ``epsilon``). Not both.
        summaries: names from ``OPTIMIZER_SUMMARIES`` (default learning_rate, global_gradient_norm,
            loss_scale), written to ``summary_writer`` every ``summary_every`` update attempts.
        loss_scaling: a number (static), ``"Backoff"``, ``"LogMax"``, ``"dynamic"`` or a ``LossScale``;
            ``loss_scaling_params``: its parameters (strictly checked).
        on_horovod: average gradients over ``torch.distributed`` (``process_group`` or the default group),
            once per update in buckets of ``bucket_numel`` elements; a ``DistributedDataParallel`` ``model``
            reduces by itself (``"mixed"`` with accumulation: the fp32 window sums are reduced once per
            update over the DDP group instead, see the module doc).
        pipeline_group: the process group joining the pipeline stages (each stage trains its own
            ``var_list``): the global norm, the overflow decision and LogMax's ``max|g|`` are reduced across
            it too, so every stage clips by the same factor and skips the same updates. Default: the
            module-wide setting of :func:`optkit.distributed.set_pipeline_group` (None: no stages).
        iter_size: micro-batches per update; ``skip_update_ph``: a bool or zero-argument callable; when given,
            a true value makes the call accumulate only and a false value updates with the micro-batches
            accumulated so far (``train_op(..., skip_update=...)`` overrides it per call).
        model: the model (its parameters and names; DDP detection).
        rules, layer_decay, num_layers, no_decay_1d, layer_regex, final_norm: param groups by name
            (:func:`optkit.param_groups`: per-group ``lr_scale``, ``weight_decay``,
            ``exclude_from_adaptation``, ``clip``; BEiT layer-wise decay, or timm's with
            ``final_norm="last_block"``), built as :func:`optkit.create_optimizer` does. Grouping happens
            when ``rules`` (``[]`` for no rules) or ``layer_decay`` is given; then ``no_decay_1d`` (default
            True) takes weight decay off biases and normalisation scales.
        precision: ``None`` (as ``dtype`` says), ``"fp32-masters"`` (the same as ``dtype="mixed"``, which
            it needs), or a master-free bfloat16 format, ``"split"``, ``"kahan"`` or ``"stochastic"``
            (needs ``dtype=torch.bfloat16``, a bfloat16 model, and an optkit optimizer): the optimizer is
            built with ``precision=`` and updates the bfloat16 weights without fp32 copies
            (:class:`optkit.Optimizer`; split follows the fp32 trajectory bit for bit at 2 B/param).
        state_dtype: ``None`` (the optimizer's default), ``"float32"``, ``"bfloat16"`` or ``"int8"`` (also
            ``"fp32"``, ``"bf16"``): how the optkit optimizer stores its slots (under ``"mixed"``: the
            masters' slots). Passed as the optimizer's ``state_dtype=``; neither may also be given in
            ``optimizer_params``.

    Raises ``ValueError``/``TypeError`` naming the argument; nothing is built when an argument is bad.
    """
    # A. validation (summaries first, as the original), then the rest; nothing is created before this passes
    summary_list = validate_summaries(summaries)
    if clip_gradients is not None and larc_params is not None:
        raise ValueError("LARC and gradient norm clipping should not be used together "
                         "(`clip_gradients` and `larc_params` are both set)")
    if not callable(loss):
        raise TypeError(f"`loss` must be a callable returning the scalar loss, got {type(loss).__name__}")
    if dtype not in _DTYPES:
        raise ValueError(
            f"`dtype` must be torch.float32, torch.float16, torch.bfloat16 or 'mixed', got {dtype!r}"
        )
    if optimizer_params is not None and not isinstance(optimizer_params, Mapping):
        raise TypeError(f"`optimizer_params` must be a dict, got {type(optimizer_params).__name__}")
    opt_kwargs = dict(optimizer_params or {})
    opt_kwargs.update(_lean_arguments(precision, state_dtype, dtype, optimizer, opt_kwargs))
    clip = None if clip_gradients is None else check_positive("clip_gradients", clip_gradients)
    larc = None if larc_params is None else larc_settings(larc_params)
    if isinstance(iter_size, bool) or not isinstance(iter_size, numbers.Integral) or iter_size < 1:
        raise ValueError(f"`iter_size` must be an int >= 1, got {iter_size!r}")
    if not isinstance(on_horovod, bool):
        raise TypeError(f"`on_horovod` must be a bool, got {on_horovod!r}")
    if skip_update_ph is not None and not isinstance(skip_update_ph, bool) and not callable(skip_update_ph):
        raise TypeError(f"`skip_update_ph` must be a bool or a callable, got {skip_update_ph!r}")
    if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int) or bucket_numel < 1:
        raise ValueError(f"`bucket_numel` must be an int >= 1, got {bucket_numel!r}")
    lr_fn = _lr_function(learning_rate_decay_fn, opt_kwargs)
    cls = resolve_optimizer(optimizer)
    scaler = build_scaler(loss_scaling, loss_scaling_params)
    logger = SummaryLogger(summary_writer, summary_list, summary_every)
    named = named_params(var_list, model, loss)
    groups = None
    if rules is not None or layer_decay is not None:
        from .param_rules import DEFAULT_LAYER_REGEX, param_groups

        groups = param_groups(named, rules, no_decay_1d=no_decay_1d, layer_decay=layer_decay,
                              num_layers=num_layers,
                              layer_regex=DEFAULT_LAYER_REGEX if layer_regex is None else layer_regex,
                              final_norm="head" if final_norm is None else final_norm)
    elif num_layers is not None or layer_regex is not None or final_norm is not None:
        raise ValueError("`num_layers`, `layer_regex` and `final_norm` only apply with `layer_decay`")
    if on_horovod:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("`on_horovod=True` needs an initialised torch.distributed process group")
    if pipeline_group is not None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("`pipeline_group` needs an initialised torch.distributed process group")
    return TrainOp(loss, cls, opt_kwargs, lr_fn, named, dtype, clip, larc, scaler, logger, on_horovod,
                   int(iter_size), skip_update_ph, model, process_group, bucket_numel, pipeline_group,
                   groups=groups)


def _lean_arguments(precision: Any, state_dtype: Any, dtype: Any, optimizer: Any,
                    opt_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The optimizer arguments ``precision`` and ``state_dtype`` of :func:`optimize_loss` stand for,
    validated against ``dtype`` and the optimizer (see its docstring)."""
    if precision is None and state_dtype is None:
        return {}
    if precision is not None and (not isinstance(precision, str) or precision not in _PRECISIONS):
        raise ValueError(f"`precision` must be None or one of {list(_PRECISIONS)}, got {precision!r}")
    state = normalize_state_dtype(state_dtype)
    both = [k for k in ("precision", "state_dtype") if k in opt_kwargs]
    if both:
        raise ValueError(f"give {both[0]!r} as optimize_loss's `{both[0]}`, not in `optimizer_params` too")
    if precision == "fp32-masters" and dtype != "mixed":
        raise ValueError(f"`precision`='fp32-masters' is dtype='mixed' (fp32 master weights), got "
                         f"dtype={dtype!r}")
    if precision not in (None, "fp32-masters") and dtype != torch.bfloat16:
        raise ValueError(f"`precision`={precision!r} (master-free bfloat16 weights) needs "
                         f"dtype=torch.bfloat16 (a bfloat16 model), got dtype={dtype!r}")
    cls = resolve_optimizer(optimizer)
    if not (isinstance(cls, type) and issubclass(cls, _OptkitOptimizer)):
        name = getattr(cls, "__name__", type(cls).__name__)
        what = "precision" if precision not in (None, "fp32-masters") else "state_dtype"
        if what == "precision" or state is not None:
            raise TypeError(f"`{what}` needs an optkit optimizer, got {name}")
    out: dict[str, Any] = {}
    if precision not in (None, "fp32-masters"):
        out["precision"] = precision
    if state is not None:
        out["state_dtype"] = state
    return out


def _lr_function(fn: Any, opt_kwargs: dict[str, Any]) -> Callable[[Any], Any]:
    for key in ("learning_rate", "lr"):
        if key in opt_kwargs:
            if fn is not None:
                raise ValueError(
                    f"`optimizer_params` must not hold {key!r} when `learning_rate_decay_fn` is set"
                )
            fn = opt_kwargs.pop(key)
    if fn is None:
        raise ValueError("`learning_rate_decay_fn` is required (a callable step -> lr, or a number)")
    if isinstance(fn, bool):
        raise TypeError(f"`learning_rate_decay_fn` must be a callable or a number, got {fn!r}")
    if isinstance(fn, numbers.Real):
        if not (math.isfinite(fn) and fn >= 0):
            raise ValueError(f"`learning_rate_decay_fn`: the learning rate must be a finite number >= 0, "
                             f"got {fn!r}")
        return _ConstantLR(float(fn))
    if not callable(fn):
        raise TypeError(f"`learning_rate_decay_fn` must be a callable or a number, got {fn!r}")
    return _CheckedLR(fn)


class _ConstantLR:
    """``step -> value`` (module level, so a train op copies and pickles; here, so that pickles find it)."""

    def __init__(self, value: float) -> None:
        self.value = value

    def __call__(self, step: Any, dtype: torch.dtype | None = None) -> float:
        return self.value


class _CheckedLR:
    """``fn(step)``, checked by :func:`~optkit._validation.check_lr_value` (tensor values not read)."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn

    def __call__(self, step: Any, dtype: torch.dtype | None = None) -> Any:
        """``dtype``: the parameters' (a schedule gives float64 ones its float64 value: ``value``)."""
        fn = self.fn
        lr = fn.value(step, dtype) if dtype is not None and is_schedule(fn) else fn(step)  # type: ignore[union-attr]
        return check_lr_value("`learning_rate_decay_fn`", lr, step)


# ------------------------------------------------------------------------------------------------------------


#: (indices, masters, gradients, flat gradients) of one update (see TrainOp._whole_first)
_Gathered = tuple[list[int], list[Tensor], list[Tensor], list[Tensor]]


class TrainOp(TrainOpBuild, TrainOpWindow, TrainOpCheckpoint):
    """The train op built by :func:`optimize_loss`; call it once per micro-batch.

    Attributes: ``optimizer`` — the **outermost** optimizer, the one the train op steps:
    ``MixedPrecisionOptimizerWrapper`` (``"mixed"``) around ``LARC`` (``larc_params``) around the optimizer
    class; its ``param_groups``/``state`` are the inner optimizer's (keyed by the fp32 masters in
    ``"mixed"``).
    ``base_optimizer``: the innermost one (the class asked for). ``scaler`` (the :class:`~optkit.LossScale`;
    the wrappers get none of their own), ``global_step`` (applied updates, 0-d int64 tensor), ``params`` (the
    model tensors trained), ``masters`` (their fp32 copies in ``"mixed"``, else ``params``).
    ``state_dict()``/``load_state_dict()`` cover the optimizer (with the wrappers' parts: the masters),
    scaler, the gradients accumulated in an open window, the step and the summary counter; with the model's
    own ``state_dict`` this resumes bit-identically.
    """

    _scale_dtype = torch.float32  # (a train op pickled by an earlier optkit: its float32 divisor)
    #: the outermost optimizer (class doc), typed as optkit's so that ``train_op.optimizer.ema_weights()``
    #: type-checks; with a ``torch.optim`` class (and no wrapper) it is that class's instance, which lacks
    #: optkit's own methods (``ema_weights``, ``iterations``, ...)
    optimizer: _OptkitOptimizer | OptimizerWrapper

    def __init__(self, loss_fn, cls, opt_kwargs, lr_fn, named, dtype, clip, larc, scaler, logger, on_horovod,
                 iter_size, skip_update_ph, model, process_group, bucket_numel, pipeline_group=None,
                 groups=None) -> None:
        self._loss_fn = loss_fn
        self._lr_fn = lr_fn
        self.dtype = dtype
        self.clip_gradients = clip
        self.larc_params = larc
        self.iter_size = iter_size
        self.skip_update_ph = skip_update_ph
        self.summaries = logger
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        device = mt.local(self.params[0]).device

        # loss scaling (driven here; the wrappers run with a fixed scale of 1 and take it as grad_scale)
        self.scaler = scaler.to(device)
        self._unit_scale = isinstance(scaler, FixedLossScale) and scaler.loss_scale_value == 1.0
        self._checks = bool(scaler.dynamic or getattr(scaler, "skip_non_finite", False))
        self._one = torch.ones((), dtype=torch.float32, device=device)
        #: the dtype of the window divisor, the token count and the grad_scale handed to the optimizer:
        #: float64 when a parameter is float64 (its update is then unscaled exactly), else float32
        self._scale_dtype = torch.float64 if any(mt.local(p).dtype == torch.float64 for p in self.params) \
            else torch.float32
        self._false = torch.zeros((), dtype=torch.bool, device=device)
        self._true = torch.ones((), dtype=torch.bool, device=device)

        # step counter and learning rate (lr(k) of the k-th applied update)
        self._step = torch.zeros((), dtype=torch.int64, device=device)
        self._host_step = 0
        self._host_exact = not self._checks  # host count is exact while no update can be skipped
        self._step_seen = self._step._version  # (a write into global_step from outside changes it)
        self._lr_now: Any = self._lr_fn(0)
        if isinstance(self._lr_now, Tensor):  # a tensor's value is checked once, here (no reads per step)
            check_lr_value("`learning_rate_decay_fn`", float(self._lr_now.detach().reshape(())), 0)
        self._lr_t = self._lr_tensor(self._lr_now, device)
        self._lr_t_version = self._lr_t._version  # (a write into it since: made anew, see _same_lr_tensor)
        #: the schedule's error for the next update (it is evaluated right after an update; the call that
        #: would make that update raises it, before anything changes)
        self._lr_error: Exception | None = None

        # the optimizer stack: [MixedPrecisionOptimizerWrapper(] [LARC(] cls(...) [)] [)], the masters, and
        # how the gradients are reduced (optkit._train_build)
        self._build_stack(cls, opt_kwargs, larc, dtype, groups)
        self._build_distribution(model, on_horovod, process_group, bucket_numel, pipeline_group, iter_size,
                                 skip_update_ph, logger)
        self._micro = 0
        self._token_weighted: bool | None = None  # decided by the first call's return value
        self._items = torch.zeros((), dtype=torch.float64, device=device)  # Σ num_items of the open window

    # ---- public surface ------------------------------------------------------------------------------------

    @property
    def global_step(self) -> Tensor:
        """Applied updates so far (0-d int64 tensor, live). Written in place (``op.global_step.zero_()``),
        the next update takes its learning rate from the written count; a write that bypasses the tensor's
        version counter (through ``.data`` or a collective) is not seen: use :meth:`load_state_dict`."""
        return self._step

    @property
    def learning_rate(self) -> Tensor:
        """The learning rate the next update will use (0-d fp32 tensor)."""
        return self._lr_t

    @property
    def micro_steps(self) -> int:
        """Micro-batches accumulated in the open window."""
        return self._micro

    def _current_lr(self) -> Any:
        return self._lr_now

    @staticmethod
    def _lr_tensor(lr: Any, device: torch.device) -> Tensor:
        if isinstance(lr, Tensor):
            return lr.detach().to(device=device, dtype=torch.float32).reshape(())
        return mt.scalar(lr, torch.float32, device)

    def _same_lr_tensor(self, lr: Any) -> Tensor | None:
        """The current learning-rate tensor when ``lr`` is the same host number it holds and nothing wrote
        into it since it was made (its version counter): a constant learning rate costs no fill kernel per
        update. None otherwise."""
        prev, t = self._lr_now, self._lr_t
        if isinstance(lr, Tensor) or isinstance(prev, Tensor) or not isinstance(lr, numbers.Real) \
                or not isinstance(prev, numbers.Real) or float(lr) != float(prev) \
                or math.copysign(1.0, lr) != math.copysign(1.0, prev) \
                or t._version != getattr(self, "_lr_t_version", None) or t.device != self._step.device:
            return None
        return t

    def _clip_tensor(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        """``clip_gradients`` as a 0-d tensor of ``dtype`` on ``device`` (what :func:`~optkit.clipping.
        clip_coefficient` makes of the number), made once; not kept when made inside a CUDA graph capture."""
        cache = self.__dict__.setdefault("_clip_t", {})
        t = cache.get((dtype, device))
        if t is None:
            t = mt.scalar(self.clip_gradients, dtype, device)
            if not mt.capturing(device) and not torch.compiler.is_compiling():
                cache[(dtype, device)] = t
        return t

    def _host_step_exact(self) -> bool:
        """Whether the host's count still equals ``global_step`` as far as the host can tell without reading
        the device: no update could have been skipped, and the count tensor's version counter shows no write
        since the host counted (``op.global_step.zero_()``). Once not, the device count is used."""
        if self._host_exact and self._step._version != getattr(self, "_step_seen", None):
            self._host_exact = False
        return self._host_exact

    def _lr_at_step(self) -> Any:
        """The learning rate at the current step (the host count while exact, else the device one); a
        schedule gives a float64 model its float64 value (``LearningRateSchedule.value``)."""
        step = self._host_step if self._host_step_exact() else self._step
        wide = isinstance(step, Tensor) and self._scale_dtype == torch.float64 and self._optkit
        return self._lr_fn(step, torch.float64 if wide else None)

    def _refresh_lr(self) -> None:
        lr_now = self._lr_at_step()
        lr_t = self._same_lr_tensor(lr_now)
        if lr_t is None:
            lr_t = self._lr_tensor(lr_now, self._step.device)
            self._lr_t_version = lr_t._version
        # (only now is a write into global_step taken into account: a schedule that raised is asked again)
        self._lr_now, self._lr_t, self._step_seen = lr_now, lr_t, self._step._version
        if not self._optkit:
            value = self._lr_now
            for g in self.optimizer.param_groups:
                if isinstance(value, Tensor) and not (self._optkit_inst or g.get("fused")):
                    value = float(value)  # non-fused torch kernels take a float lr (a host read)
                scale = g.get("lr_scale", 1.0)  # torch optimizers do not apply a group's lr_scale
                g["lr"] = value if scale == 1.0 else value * scale

    # ---- checkpoint (its parts: optkit._train_checkpoint) ------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Optimizer stack (the wrappers' parts hold the fp32 masters), scaler, open-window accumulators,
        step counters and summary counter.

        Inside an accumulation window of a data-parallel run (``on_horovod`` or DDP) every rank holds its
        own unreduced sums, so this is a collective then: **every rank must call it**. The group's first
        rank (rank 0 of the world by default) gets every rank's accumulators stacked (``[world, *shape]``
        per parameter, ``"accumulators_world_size"`` set) and is the one to save; the others get their own
        part. Loading it on the same number of ranks restores each rank's sums, so the run continues exactly.
        At a window boundary (``micro_steps == 0``) there is nothing to gather and no collective. FSDP2
        models accumulate inside FSDP2 until the update micro-step: their state can be taken at a window
        boundary only (``ValueError`` otherwise).
        """
        return self._state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (validated before anything changes). Load the model's own state
        (its half parameters) as well; the master copies come from here. A state holding every rank's
        accumulators (taken inside a window of a data-parallel run) must be loaded on the same number of
        ranks; each rank takes its own.

        Every entry is checked first (``TypeError`` for a wrong type, ``ValueError`` otherwise, naming the
        entry): the counters, the accumulators, the window count, and the optimizer's and scaler's states
        (loaded into deep copies first). A bad state leaves the train op, its optimizer and scaler as they
        were."""
        self._load_state_dict(state_dict)

    # ---- one micro-step -----------------------------------------------------------------------------------

    def __call__(self, *inputs: Any, skip_update: bool | None = None, **kw_inputs: Any) -> StepResult:
        """Run one micro-step on ``inputs``: forward, backward, and (at the end of a window) the update."""
        refuse_inside_ema_weights(self.optimizer)  # before the forward adds gradients
        update = self._is_update(skip_update)
        written = self._step._version != getattr(self, "_step_seen", None)  # (absent: an earlier optkit's)
        if update and (self._lr_error is not None or written):
            # the schedule failed for this update after the previous one, or global_step was written since:
            # ask again, before anything changes
            self._refresh_lr()
            self._lr_error = None
        sync_off = self._ddp is not None and (self._ddp_own or not update)
        ctx = self._ddp.no_sync() if sync_off else contextlib.nullcontext()
        if self._fsdp_sync is not None:
            self._fsdp_sync(update)
        with ctx:
            with _diverting(self._diverted_ids):  # those added on the masters leave the loss
                out = self._loss_fn(*inputs, **kw_inputs)
            loss = self._token_split(out)
            loss32 = loss.reshape(())
            if loss32.dtype in _HALF:
                loss32 = loss32.float()
            scale = self._one if self._unit_scale else self.scaler.loss_scale
            target = loss32 if self._unit_scale else loss32 * scale.to(loss32.device)
            try:
                if self._plain_backward:
                    # DDP / FSDP2 reduce in hooks that backward(inputs=...) would bypass
                    target.backward()
                    for p in self._frozen:  # parameters left out of var_list get no gradient
                        p.grad = None
                else:
                    self._backward(target)
            except BaseException:  # (out of memory, a hook): part of this backward may have landed
                self._drop_window()
                raise
        if self._mp is not None:
            try:
                if self._dtensor:  # Partial (tensor-parallel) half gradients are reduced before the fold
                    mt.reduce_partial_grads_(self.params)
                self._mp.accumulate_grads()  # the window's half gradients are summed in fp32
            except BaseException:
                self._drop_window()
                raise
        self._micro += 1
        shown = loss32.detach()
        if self._token_weighted:  # report the micro-batch's mean per item
            li = self._last_items.to(device=shown.device, dtype=torch.float32)
            shown = shown / torch.where(li > 0, li, torch.ones_like(li))
        if not update:
            return StepResult(shown, self._false, self._step.clone(), self._lr_t, scale, None)
        return self._update(shown, scale)

    def _backward(self, target: Tensor) -> None:
        """Backward of ``target`` into the parameters' ``.grad`` only (``inputs=``, so leaves outside
        ``var_list`` get nothing). A parameter frozen since the op was built (``requires_grad_(False)``)
        gets no gradient, as with a plain ``backward()``: torch refuses it as an input, so it is left out
        then (the check costs nothing while no parameter is frozen)."""
        try:
            torch.autograd.backward(target, inputs=self.params)
        except RuntimeError:
            live = [p for p in self.params if p.requires_grad]
            if len(live) == len(self.params):
                raise
            if not live:
                raise ValueError("every parameter in `var_list` has requires_grad=False: nothing to "
                                 "train") from None
            torch.autograd.backward(target, inputs=live)

    # ---- the update ---------------------------------------------------------------------------------------

    def _with_grads(self) -> tuple[list[int], list[Tensor], list[Tensor]]:
        """(indices, masters, gradients) of the masters that have a gradient."""
        return mt.with_grads(self.masters)

    def _update(self, loss: Tensor, scale: Tensor) -> StepResult:
        """The update that ends a window (:meth:`_apply_window`). One that raises before it is committed
        (the step counter moved) changes no parameter, slot, scale or step, and drops its window: the
        window's gradients are cleared, so the next call starts a new window instead of adding to gradients
        that the reset micro-batch count no longer covers."""
        version = self._step._version
        try:
            return self._apply_window(loss, scale)
        except BaseException:
            if self._step._version == version:
                self._drop_window()
            raise

    def _apply_window(self, loss: Tensor, scale: Tensor) -> StepResult:
        if self._dtensor:  # Partial (tensor-parallel) gradients: reduced before any norm or update
            mt.reduce_partial_grads_(self.masters)
        seen: dict = {}  # what the optimizer's whole_grads read of its groups, handed to its step
        first, tried = self._whole_first(seen)
        if first is not None:  # one read of every gradient, by the optimizer's gather
            idx, qs, grads, whole_pre = first
        else:
            idx, qs, grads = self._with_grads()
            whole_pre = None
        if not grads:
            self._micro = 0
            raise ValueError("No gradients provided for any variable: the loss does not depend on `var_list`")
        n, self._micro = self._micro, 0
        log = self.summaries
        due = log.due()
        log.advance()
        lr_t = self._lr_t
        if self._reduce:
            self._all_reduce_()
            grads = [q.grad for q in qs]

        denom = self._window_divisor(n, scale)
        if self._diverted:
            self._add_diverted_grads(denom)
            idx, qs, grads = self._with_grads()

        # (5) global norm of the mean unscaled gradient (clip, summary) and, with a dynamic scaler, the
        # overflow flag: any NaN/inf element (a max-abs pass beside the norm pass), never the norm's overflow;
        # over flat buffers both read each group's flat gradient once instead of tensor by tensor.
        norm = found_raw = inf_norms = None
        pp = self._pp

        def whole_grads() -> list[Tensor] | None:
            if first is not None or tried:  # (asked already: not flat this update)
                return whole_pre
            return self._whole_grads(idx, seen)

        if self._checks and self.scaler.needs_amax:  # LogMax: whole-tensor max|g| per tensor, flag from it
            inf_norms = torch.stack([x.float() for x in mt.norms(grads, float("inf"))])
            raw = mt.global_norm(whole_grads() or grads, pipeline_group=pp)
            norm = raw if denom is None else raw / denom
        elif self._checks:
            whole = whole_grads()
            raw, found_raw = mt.global_norm_and_found_inf(whole or grads, pipeline_group=pp,
                                                          compiled=self._compiled_check(whole, grads))
            norm = raw if denom is None else raw / denom
        elif self.clip_gradients is not None or (due and log.wants("global_gradient_norm")):
            raw = mt.global_norm(whole_grads() or grads, pipeline_group=pp)
            norm = raw if denom is None else raw / denom

        # (6) the raw gradients are divided by grad_scale = denom / coef (mean, unscale, clip in one factor)
        coef = None
        if self.clip_gradients is not None:
            clip_t = self._clip_tensor(torch.float64 if norm.dtype == torch.float64 else torch.float32,
                                       norm.device)
            coef = clip_coefficient(norm, clip_t, nan_on_nonfinite=False)
        # (reciprocal(coef) is 1.0 / coef: torch's 1 / t is reciprocal(t)·1, exact)
        grad_scale = denom if coef is None else (torch.reciprocal(coef) if denom is None else denom / coef)
        # (1/grad_scale: only the summaries and LogMax's max|g| read it)
        factor = None if grad_scale is None or not (due or (self._checks and self.scaler.needs_amax)) \
            else torch.reciprocal(grad_scale)

        # (7) summaries of the gradients the update will use (LARC's after the step, from its own record)
        step_now = None
        if due:
            step_now = int(self._step)
            self._write_summaries(step_now, idx, qs, grads, lr_t, norm, factor, coef, scale)

        # (8) non-finite check: whether the scaler lets this update apply (the skip flag the step takes;
        # ``applied`` is the scaler's update's own answer, below: what would_apply gives, with no kernel)
        found = None
        applied = self._true
        if self._checks:
            amax = None
            overflow = found_raw
            if self.scaler.needs_amax:
                overflow, amax = self._amax(qs, inf_norms, grad_scale, factor)
            # finite elements whose scaled norm overflows float32 (S·|g| beyond about 1.8e19) under a clip
            # and a scale above 1 that can back off: the scale is too large for the clip (its factor would
            # be 0); an overflow too, so the scale backs off (at 1 the gradient itself is that large)
            if self.clip_gradients is not None and not isinstance(self.scaler, FixedLossScale):
                too_large = ~torch.isfinite(raw) & (scale.to(raw.device) > 1)
                overflow = torch.maximum(overflow, too_large.to(overflow.dtype))
            found = self.scaler.skip_flag(overflow, amax)

        # (9) LARC (inside the wrapper stack), the update, p16 ← saturate(master) ("mixed"); then the scaler,
        # so an update that raises leaves the scale as it was
        refused = self._step_optimizer(grads, grad_scale, found, seen)
        if refused is not None:  # the optimizer's own clip norm overflowed: an overflow, the scale backs off
            overflow = torch.maximum(overflow, refused.to(overflow.dtype))
        if self._checks:  # should_apply: not an overflow (nor a refused step)
            applied = self.scaler.update(overflow, amax)

        if self._host_step_exact():
            self._step.add_(1)
            self._host_step += 1
            self._step_seen = self._step._version
        else:
            self._step.add_(applied)  # (int64 plus bool: no cast kernel)
            self._step_seen = self._step._version
        self._clear_grads()
        try:
            self._refresh_lr()  # lr(k) for the next update, k = applied updates so far
        except Exception as err:  # noqa: BLE001 - raised by the next update's call, before it changes anything
            self._lr_error = err
        if due and self._larc is not None and log.wants("larc_summaries"):
            self._write_larc(step_now, lr_t)  # (after the commit: a writer that raises loses only these)
        return StepResult(loss, applied, self._step.clone(), lr_t, scale, norm)

    def _compiled_check(self, whole: list[Tensor] | None, grads: list[Tensor]):
        """The compiled norm-and-check pass (:func:`optkit._core.chain.norm_check_sums`) under the optimizer's
        ``jit_compile`` (``engine.compiled_pass``), or None for the eager passes: also over
        flat parameters whose optimizer has no plan yet (the first update reads the per-tensor gradients;
        every later one the flat gradients, a graph of its own), so as not to compile for that one update."""
        call = self.base_optimizer.engine.compiled_pass(norm_check_sums, len(whole or grads)) \
            if self._optkit_inst else None
        if call is None or (whole is None and self.masters and flat_buffer_of(self.masters[0]) is not None):
            return None
        return call

    def _whole_grads(self, idx: list[int], seen: dict) -> list[Tensor] | None:
        """The optimizer's flat gradients (:meth:`optkit.Optimizer.whole_grads`) when they hold exactly this
        update's gradients: every master has one, the masters are the optimizer's parameters and each group's
        gradients are still the views of its flat gradient (what was read goes into ``seen``). None
        otherwise."""
        if not self._optkit_inst or len(idx) != len(self.masters):
            return None
        self._match_params()
        return self.base_optimizer.whole_grads(seen) if self._masters_are_params else None

    def _match_params(self) -> None:
        """Whether the masters are the optimizer's parameters (``_masters_are_params``), and if so, their
        indices in its groups' order (``_group_idx``) and that order (``_group_params``): decided again only
        when its groups' lists change."""
        groups = self.base_optimizer.param_groups
        key = tuple((id(g["params"]), len(g["params"])) for g in groups)
        if key != self._params_key:
            self._params_key = key
            ordered = [p for g in groups for p in g["params"]]
            pos = {id(q): i for i, q in enumerate(self.masters)}
            self._masters_are_params = (len(ordered) == len(self.masters)
                                        and {id(p) for p in ordered} == set(pos))
            self._group_params = ordered if self._masters_are_params else []
            self._group_idx = [pos[id(p)] for p in self._group_params]

    def _whole_first(self, seen: dict) -> tuple[_Gathered | None, bool]:
        """``((indices, masters, gradients, flat gradients), True)`` from the optimizer's own read of its
        gradients (:meth:`optkit.Optimizer.whole_grads`), when its flat plans hold every one of them and the
        masters are its parameters; the train op then does not read each master's ``.grad`` itself (about
        1.4 ms per update on 10,000 tensors). The three lists run in the optimizer's groups' order (the
        indices say which master each entry is). ``(None, asked)`` otherwise, ``asked`` telling whether
        ``whole_grads`` was asked (and said no); nothing is changed then."""
        if not self._optkit_inst or self._reduce or self._diverted or self._dtensor:
            return None, False
        self._match_params()
        if not self._masters_are_params:
            return None, False
        got: dict = {}
        whole = self.base_optimizer.whole_grads(got)
        if whole is None:
            return None, True
        seen.update(got)
        groups = self.base_optimizer.param_groups
        if len(groups) == 1:
            grads = got[id(groups[0])][2]
        else:
            grads = list(itertools.chain.from_iterable(got[id(group)][2] for group in groups))
        return (self._group_idx, self._group_params, grads, whole), True

    def _amax(self, qs: list[Tensor], inf_norms: Tensor, grad_scale: Tensor | None,
              factor: Tensor | None) -> tuple[Tensor, Tensor]:
        """(overflow flag, ``max|g|``) for LogMax from the per-tensor whole-tensor max-abs of the raw
        gradients: the flag is any non-finite element; ``max|g|`` is of the gradients the update applies
        (after mean, unscale, clip and LARC). With LARC this needs the trust ratios before the step: a
        look-ahead (one extra norm pass). Both are reduced across the pipeline stages in one collective."""
        raw_max = inf_norms.amax()
        if self._larc is not None:
            params, ratios = self._larc.trust_ratios(grad_scale)
            pos = {id(q): j for j, q in enumerate(qs)}
            r = torch.ones_like(inf_norms)
            if params:
                r[torch.tensor([pos[id(p)] for p in params], device=r.device)] = ratios.to(r.dtype)
            inf_norms = inf_norms * r
        amax = inf_norms.amax() if factor is None else inf_norms.amax() * factor
        both = torch.stack([raw_max, amax.to(raw_max.dtype).reshape(())])
        group = mt._pp(self._pp)
        if group is not None:
            import torch.distributed as dist

            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        return (~torch.isfinite(both[0])).to(torch.float32), both[1]

    def _step_optimizer(self, grads: list[Tensor], grad_scale: Tensor | None, found: Tensor | None,
                        seen: dict | None = None) -> Tensor | None:
        """Step the optimizer stack with the step protocol (``grad_scale``, ``found_inf``); the wrappers
        forward them inward (LARC adds its ratios as ``grad_multipliers``). ``seen``: what the base
        optimizer's ``whole_grads`` read this update (nothing since replaced a gradient), handed over.
        Returns the flag of a step the base optimizer refused because its own clip norm of the scaled
        gradients overflowed (:func:`optkit._wrapper.overflow_probe`; only with a scaler that backs off),
        else None."""
        opt = self.optimizer
        if self._level == "full":  # an optkit optimizer or wrapper: the step protocol as a value
            if grad_scale is not None:  # (float64 for float64 parameters)
                grad_scale = grad_scale.reshape(()).to(self._scale_dtype)
            backs_off = self._checks and not isinstance(self.scaler, FixedLossScale)
            # _clear_grads follows: flat gradients may be zeroed in the update's pass
            context = StepContext(grad_scale=grad_scale, found_inf=found, gathered=seen or None,
                                  zero_grads=self._optkit_inst, report_overflow=backs_off)
            result = step_inner(opt, context, global_hooks=True)
            self._zeroed = result.zeroed_groups  # only when the step returned: _clear_grads takes it next
            return result.overflow if backs_off else None
        if self._level == "amp":  # a torch optimizer with GradScaler's protocol: its attributes
            if grad_scale is not None:
                opt.grad_scale = grad_scale.reshape(()).to(torch.float32)
            if found is not None:
                opt.found_inf = found
            try:
                opt.step()
            finally:
                for attr in ("grad_scale", "found_inf"):
                    if attr in opt.__dict__:
                        delattr(opt, attr)
            self._zeroed = frozenset()
            return None
        # a bare optimizer without grad_scale/found_inf support: scale the gradients, skip on the host
        if grad_scale is not None:
            mt.scale_(grads, torch.reciprocal(grad_scale))
        if found is None or not bool(found):  # host read, as torch.amp.GradScaler does for such optimizers
            opt.step()
        return None

    def _add_diverted_grads(self, denom: Tensor | None) -> None:
        """``master.grad += S·n·W·∂R/∂master`` for the regularizers of half parameters."""
        live = [(p, e, m) for (p, e), m in zip(self._diverted, self._diverted_masters) if _registered(p, e)]
        if not live:  # (every one removed by clear_regularizers since)
            return
        masters = [m for _, _, m in live]
        missing = [p for p, _, m in live if m.grad is None]
        if missing:  # start those masters' accumulation at zero (exact in fp16)
            for p in missing:
                p.grad = torch.zeros_like(p)
            self._mp.accumulate_grads()
        with torch.enable_grad():
            leaves = [m.detach().requires_grad_(True) for m in masters]
            total = sum(e.fn(x).float() for x, (_, e, _) in zip(leaves, live))
            rgrads = torch.autograd.grad(total, leaves, allow_unused=True)
        pairs = [(m, g) for m, g in zip(masters, rgrads) if g is not None]
        if not pairs:
            return
        rg = [g for _, g in pairs]
        if denom is not None:
            rg = torch._foreach_mul(rg, denom)
        torch._foreach_add_([m.grad for m, _ in pairs], rg)

    def _all_reduce_(self) -> None:
        """Sum the accumulated gradients over the process group in flat buckets
        (:func:`optkit.distributed.all_reduce_gradients_`); the 1/W of the average is folded into the update
        factor. DTensor (FSDP2) gradients are already averaged and skipped; plain gradients next to them are
        averaged in place. Sparse gradients are densified first (the original's ``shared_embed`` path)."""
        from .distributed import all_reduce_gradients_

        for q in self.masters:
            if q.grad is not None and q.grad.is_sparse:
                q.grad = q.grad.to_dense()
        dense = [q.grad for q in self.masters if q.grad is not None]
        all_reduce_gradients_(dense, self._group, average=self._dtensor, bucket_numel=self._bucket_numel)

    # ---- summaries ----------------------------------------------------------------------------------------

    def _write_summaries(self, step, idx, qs, grads, lr, norm, factor, coef, scale) -> None:
        log = self.summaries
        if log.wants("learning_rate"):
            log.scalar("learning_rate", lr, step)
        if log.wants("global_gradient_norm") and norm is not None:
            log.scalar("global_gradient_norm", norm, step)
        names = [self.names[i] for i in idx]
        f = factor if factor is not None else self._one
        if any(log.wants(s) for s in ("gradients", "gradient_norm", "variables", "variable_norm")):
            log.write_per_variable(names, qs, grads, f, step)
        if coef is not None and log.wants("global_gradient_norm") and norm is not None:
            log.scalar("global_clipped_gradient_norm", norm * coef, step)
        if log.wants("loss_scale"):
            log.scalar("loss_scale", scale, step)

    def _write_larc(self, step: int, lr: Tensor) -> None:
        """LARC summaries from the ratios the LARC wrapper just used (computed before the update)."""
        larc = self._larc
        if larc.last_ratios is None or self.summaries.writer is None:
            return
        names = [self._name_of[id(p)] for p in larc.last_params]
        self.summaries.write_larc(names, larc.last_clip_on, larc.last_ratios, lr, step)
