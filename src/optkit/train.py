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
   (:func:`optkit._compile.norm_check_sums`), so the decision is the same on any number of ranks; with
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
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import itertools
import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from . import _multi_tensor as mt
from ._compile import norm_check_sums
from ._core.context import StepContext
from ._tf_surface import is_schedule
from ._validation import check_count, check_int, check_lr_value, check_params
from ._wrapper import OptimizerWrapper, protocol_level, refuse_inside_ema_weights, step_inner
from .clipping import clip_coefficient
from .flat import flat_buffer_of
from .larc import LARC
from .loss_scale import AutomaticLossScaler, DynamicLossScale, FixedLossScale, LossScale
from .mixed_precision import MixedPrecisionOptimizerWrapper
from .optimizer import Optimizer as _OptkitOptimizer
from .regularization import _diverting, _entries, _registered
from .summaries import SummaryLogger, validate_summaries

__all__ = ["optimize_loss", "TrainOp", "StepResult"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, "mixed")
_HALF = (torch.float16, torch.bfloat16)
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
_STATE_KEYS = ("optimizer", "scaler", "global_step", "host_step", "host_exact", "micro", "accumulators",
               "summary_attempts")


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
# argument resolution (all raise before anything is built)


def _resolve_optimizer(optimizer: Any) -> Callable[..., torch.optim.Optimizer]:
    if isinstance(optimizer, str):
        from .registry import get_optimizer

        return get_optimizer(optimizer)  # ValueError listing the valid names
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("`optimizer` must be a registry name or an optimizer class, not an instance")
    if isinstance(optimizer, type) or callable(optimizer):
        return optimizer
    raise TypeError(f"`optimizer` must be a registry name or an optimizer class, got {optimizer!r}")


def _build_scaler(loss_scaling: Any, params: Mapping[str, Any] | None) -> LossScale:
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


def _named_params(var_list: Any, model: Any, loss: Any) -> list[tuple[str, Tensor]]:
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


def _check_positive(name: str, value: Any) -> float:
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
    clip = None if clip_gradients is None else _check_positive("clip_gradients", clip_gradients)
    larc = None
    if larc_params is not None:
        check_params(larc_params, _LARC_REQUIRED, _LARC_OPTIONAL, where="larc_params")
        larc = {"larc_eta": float(larc_params["larc_eta"]), "larc_mode": larc_params.get("larc_mode", "clip"),
                "min_update": float(larc_params.get("min_update", 1e-7)),
                "epsilon": float(larc_params.get("epsilon", 1e-7))}
    if isinstance(iter_size, bool) or not isinstance(iter_size, numbers.Integral) or iter_size < 1:
        raise ValueError(f"`iter_size` must be an int >= 1, got {iter_size!r}")
    if not isinstance(on_horovod, bool):
        raise TypeError(f"`on_horovod` must be a bool, got {on_horovod!r}")
    if skip_update_ph is not None and not isinstance(skip_update_ph, bool) and not callable(skip_update_ph):
        raise TypeError(f"`skip_update_ph` must be a bool or a callable, got {skip_update_ph!r}")
    if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int) or bucket_numel < 1:
        raise ValueError(f"`bucket_numel` must be an int >= 1, got {bucket_numel!r}")
    lr_fn = _lr_function(learning_rate_decay_fn, opt_kwargs)
    cls = _resolve_optimizer(optimizer)
    scaler = _build_scaler(loss_scaling, loss_scaling_params)
    logger = SummaryLogger(summary_writer, summary_list, summary_every)
    named = _named_params(var_list, model, loss)
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
    """``step -> value`` (module level, so a train op copies and pickles)."""

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


class TrainOp:
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
        #: the schedule's error for the next update (it is evaluated right after an update; the call that
        #: would make that update raises it, before anything changes)
        self._lr_error: Exception | None = None

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
        self._larc = next((o for o in _chain(self.optimizer) if isinstance(o, LARC)), None)
        self.base_optimizer = _chain(self.optimizer)[-1]
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
        lr_t = self._lr_tensor(lr_now, self._step.device)
        # (only now is a write into global_step taken into account: a schedule that raised is asked again)
        self._lr_now, self._lr_t, self._step_seen = lr_now, lr_t, self._step._version
        if not self._optkit:
            value = self._lr_now
            for g in self.optimizer.param_groups:
                if isinstance(value, Tensor) and not (self._optkit_inst or g.get("fused")):
                    value = float(value)  # non-fused torch kernels take a float lr (a host read)
                scale = g.get("lr_scale", 1.0)  # torch optimizers do not apply a group's lr_scale
                g["lr"] = value if scale == 1.0 else value * scale

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

    def _token_split(self, out: Any) -> Tensor:
        """The loss to back-propagate: ``out`` itself, or ``loss_sum`` of a ``(loss_sum, num_items)`` pair
        (``num_items`` is added to the window's count, on the device: no host sync)."""
        pair = isinstance(out, tuple)
        if self._token_weighted is not None and pair != self._token_weighted:
            raise ValueError("`loss` returned (loss_sum, num_items) on some calls and a scalar on others; "
                             "token-weighted accumulation needs the pair on every call")
        items = None
        if pair:
            if len(out) != 2:
                raise ValueError(f"`loss` must return a scalar tensor or (loss_sum, num_items), got a tuple "
                                 f"of {len(out)}")
            out, items = out
            if isinstance(items, Tensor):
                if items.numel() != 1:
                    raise ValueError(f"num_items must be a number or a one-element tensor, got shape "
                                     f"{tuple(items.shape)}")
                items = items.detach().reshape(()).to(device=self._items.device, dtype=torch.float64)
            elif isinstance(items, bool) or not isinstance(items, numbers.Real) or not items >= 0:
                raise ValueError(f"num_items must be a number >= 0 or a tensor, got {items!r}")
            else:
                items = mt.scalar(items, torch.float64, self._items.device)
        if not isinstance(out, Tensor) or out.numel() != 1:
            raise ValueError("`loss` must return a scalar tensor" + (" as loss_sum" if pair else ""))
        # all checked: the first call fixes the mode, the count joins the window
        self._token_weighted = pair
        if items is not None:
            self._items.add_(items)
            self._last_items = items
        return out

    def _is_update(self, skip_update: bool | None) -> bool:
        flag = skip_update
        if flag is None and self.skip_update_ph is not None:
            ph = self.skip_update_ph
            flag = ph() if callable(ph) else ph
        if flag is None:
            return self._micro + 1 >= self.iter_size
        return not bool(flag)

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

    def _drop_window(self) -> None:
        """Clear the window's gradients and counts (after an update that raised)."""
        self._micro = 0
        self._items = torch.zeros_like(self._items)
        self._zeroed = frozenset()
        if self._mp is not None:
            self._mp.zero_grad()  # the half gradients and the pending fp32 sum
        self._clear_grads()

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

        count = n * self._world
        sdt = self._scale_dtype
        denom: Tensor | None = None if self._unit_scale else scale.to(sdt)
        if self._token_weighted:  # Σ loss_sum / Σ num_items over the window and the ranks
            items = self._window_items()
            denom = items.to(scale.device) if denom is None else denom * items.to(scale.device)
        elif count != 1:
            denom = torch.full((), float(count), dtype=sdt, device=scale.device) if denom is None \
                else denom * count
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
            coef = clip_coefficient(norm, self.clip_gradients, nan_on_nonfinite=False)
        grad_scale = denom if coef is None else (1.0 / coef if denom is None else denom / coef)
        factor = None if grad_scale is None else torch.reciprocal(grad_scale)

        # (7) summaries of the gradients the update will use (LARC's after the step, from its own record)
        step_now = None
        if due:
            step_now = int(self._step)
            self._write_summaries(step_now, idx, qs, grads, lr_t, norm, factor, coef, scale)

        # (8) non-finite check: whether the scaler lets this update apply
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
            applied = self.scaler.would_apply(overflow, amax)
            found = (~applied).to(torch.float32)

        # (9) LARC (inside the wrapper stack), the update, p16 ← saturate(master) ("mixed"); then the scaler,
        # so an update that raises leaves the scale as it was
        refused = self._step_optimizer(grads, grad_scale, found, seen)
        if refused is not None:  # the optimizer's own clip norm overflowed: an overflow, the scale backs off
            overflow = torch.maximum(overflow, refused.to(overflow.dtype))
            applied = applied & (refused < 0.5).to(applied.device)
        if self._checks:
            self.scaler.update(overflow, amax)

        if self._host_step_exact():
            self._step.add_(1)
            self._host_step += 1
            self._step_seen = self._step._version
        else:
            self._step.add_(applied.to(torch.int64))
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
        """The compiled norm-and-check pass (:func:`optkit._compile.norm_check_sums`) under the optimizer's
        ``jit_compile`` (:meth:`optkit.Optimizer._compiled_pass`), or None for the eager passes: also over
        flat parameters whose optimizer has no plan yet (the first update reads the per-tensor gradients;
        every later one the flat gradients, a graph of its own), so as not to compile for that one update."""
        call = self.base_optimizer._compiled_pass(norm_check_sums, len(whole or grads)) \
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

    def _window_items(self) -> Tensor:
        """The divisor of token-weighted accumulation, 0-d fp32 (fp64 when a parameter is fp64; the count is
        kept and all-reduced in fp64, exact up to 2^53 items): ``Σ num_items`` over the window, summed over
        the data-parallel ranks (one scalar all-reduce) and divided by the number of ranks whose gradients
        DDP or FSDP2 averaged (their mean times W is the sum). A window without items divides by 1 (its
        loss sum, and so its gradient, is 0). Resets the window's count."""
        items, self._items = self._items, torch.zeros_like(self._items)
        group, averaged = self._items_group()
        if group is not False:
            import torch.distributed as dist

            dist.all_reduce(items, op=dist.ReduceOp.SUM, group=group)
            if averaged:
                items = items / dist.get_world_size(group)
        return torch.where(items > 0, items, torch.ones_like(items)).to(self._scale_dtype)

    def _items_group(self) -> tuple[Any, bool]:
        """(process group for the count, whether that group's gradients arrive averaged); ``False`` as the
        group when nothing is distributed."""
        if self._reduce:  # our own SUM all-reduce (on_horovod, or DDP + "mixed" accumulation)
            return self._group, self._dtensor
        if self._ddp is not None:
            return self._ddp.process_group, True
        if self._dtensor:  # FSDP2 averages over its data-parallel group
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                return self._group, True
        return False, False

    def _clear_grads(self) -> None:
        """The updated tensors' gradients after an update: None, except views into flat buffers
        (``optkit.flat_parameters``), which the optimizer zeroes in place so that the next backward
        accumulates into them (the groups whose blocked pass already zeroed them in cache are skipped)."""
        inner = _chain(self.optimizer)[-1]
        zeroed, self._zeroed = self._zeroed, frozenset()
        if isinstance(inner, _OptkitOptimizer):  # its parameters are the masters
            inner._zero_grad(True, zeroed)  # less the flat groups the update's pass zeroed in cache
        else:
            for q in self.masters:
                q.grad = None
        for i in self._half_idx:  # ("mixed": the half parameters' gradients were folded into the masters')
            self.params[i].grad = None

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

    # ---- checkpointing ------------------------------------------------------------------------------------

    def _window_group(self) -> tuple[bool, Any]:
        """(whether the ranks accumulate different, still unreduced gradients in an open window, their
        process group): ``on_horovod`` and DDP runs (``no_sync``) reduce only at the update."""
        if self._reduce:
            return True, self._group
        if self._ddp is not None:
            return True, self._ddp.process_group
        return False, None

    def __getstate__(self) -> dict[str, Any]:
        """Everything, and the open window's accumulated gradients with it: a parameter's copy or pickle
        leaves its ``.grad`` behind (torch), so a copy taken inside a window would lose what it summed."""
        state = dict(self.__dict__)
        state["_window_grads"] = [(q, q.grad) for q in self.masters if q.grad is not None]
        # the copy's count tensor has a version counter of its own: say whether the count was unwritten
        state["_step_seen"] = self._step._version == getattr(self, "_step_seen", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        pairs = state.pop("_window_grads", ())
        unwritten = state.pop("_step_seen", True) is True  # (absent from an earlier optkit's: it counted on)
        self.__dict__.update(state)
        self._step_seen = self._step._version if unwritten else None
        for q, g in pairs:
            if q.grad is None:
                q.grad = g

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
        if self._micro and self._fsdp_sync is not None:
            raise ValueError(
                "TrainOp.state_dict(): an FSDP2 model holds the open accumulation window's gradients inside "
                f"FSDP2 ({self._micro} micro-batch(es) so far); take the state at a window boundary "
                "(micro_steps == 0)"
            )
        acc = [None if q.grad is None else q.grad.detach().clone() for q in self.masters]
        out = {
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "global_step": self._step.clone(),
            "host_step": self._host_step,
            "host_exact": self._host_step_exact(),
            "micro": self._micro,
            "accumulators": acc,
            "summary_attempts": self.summaries.attempts,
            "items": self._items.clone(),
        }
        per_rank, group = self._window_group()
        if self._micro and per_rank:
            gathered = self._gather_accumulators(acc, group)
            if gathered is not None:
                out["accumulators"], out["accumulators_present"] = gathered
                out["accumulators_world_size"] = int(gathered[1].shape[1])
            rows = self._gather_items(group)
            if rows is not None:
                out["items"] = rows
        return out

    def _gather_accumulators(self, acc: list[Tensor | None], group: Any) -> tuple[list, Tensor] | None:
        """Every rank's accumulators on the group's first rank: ([None or [W, *shape]], present [n, W]);
        None on the other ranks. One gather for the presence mask and one per dtype for the values."""
        import torch.distributed as dist

        world, me = dist.get_world_size(group), dist.get_rank(group)
        dst = dist.get_global_rank(group, 0) if group is not None else 0
        device = mt.local(self.masters[0]).device
        dense = [None if a is None else (a.to_dense() if a.is_sparse else a) for a in acc]
        present = torch.tensor([a is not None for a in dense], dtype=torch.float32, device=device)
        flags = [torch.empty_like(present) for _ in range(world)] if me == 0 else None
        dist.gather(present, flags, dst=dst, group=group)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, q in enumerate(self.masters):
            by_dtype.setdefault(q.dtype, []).append(i)
        rows: dict[int, list[Tensor]] = {}
        for dtype, ids in by_dtype.items():
            flat = torch.cat([(mt.local(dense[i]) if dense[i] is not None else  # type: ignore[arg-type]
                               torch.zeros(mt.local(self.masters[i]).shape, dtype=dtype, device=device)
                               ).reshape(-1).to(device=device, dtype=dtype) for i in ids])
            bufs = [torch.empty_like(flat) for _ in range(world)] if me == 0 else None
            dist.gather(flat, bufs, dst=dst, group=group)
            if me == 0:
                sizes = [mt.local(self.masters[i]).numel() for i in ids]
                per = [torch.split(b, sizes) for b in bufs]  # type: ignore[union-attr]
                for k, i in enumerate(ids):
                    shape = mt.local(self.masters[i]).shape
                    rows[i] = [per[r][k].view(shape) for r in range(world)]
        if me != 0:
            return None
        mask = torch.stack(flags, 1).bool().cpu()  # type: ignore[arg-type]
        out = [torch.stack(rows[i]) if bool(mask[i].any()) else None for i in range(len(self.masters))]
        return out, mask

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (validated before anything changes). Load the model's own state
        (its half parameters) as well; the master copies come from here. A state holding every rank's
        accumulators (taken inside a window of a data-parallel run) must be loaded on the same number of
        ranks; each rank takes its own.

        Every entry is checked first (``TypeError`` for a wrong type, ``ValueError`` otherwise, naming the
        entry): the counters, the accumulators, the window count, and the optimizer's and scaler's states
        (loaded into deep copies first). A bad state leaves the train op, its optimizer and scaler as they
        were."""
        where = "TrainOp.load_state_dict"
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"load_state_dict: expected a dict, got {type(state_dict).__name__}")
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise ValueError(f"load_state_dict: missing keys {missing}")
        # the train op's own entries
        step = check_count("'global_step'", state_dict["global_step"], where=where)
        host_step = check_count("'host_step'", state_dict["host_step"], where=where)
        host_exact = state_dict["host_exact"]
        if not isinstance(host_exact, bool):
            raise TypeError(f"{where}: 'host_exact' must be a bool, got {type(host_exact).__name__} "
                            f"({host_exact!r})")
        if host_exact and self._checks:
            raise ValueError(f"{where}: 'host_exact' is True, but this train op's loss scaler can skip "
                             "updates (the host count cannot be exact)")
        if host_exact and host_step != step:
            raise ValueError(f"{where}: 'host_step' ({host_step}) must equal 'global_step' ({step}) when "
                             "'host_exact' is True")
        micro = check_int("'micro'", state_dict["micro"], where=where, minimum=0)
        if self.skip_update_ph is None and micro >= self.iter_size:
            raise ValueError(f"{where}: 'micro' must be < iter_size ({self.iter_size}) (micro-batches in the "
                             f"open window), got {micro}")
        attempts = check_int("'summary_attempts'", state_dict["summary_attempts"], where=where, minimum=0)
        acc = state_dict["accumulators"]
        if not isinstance(acc, (list, tuple)):
            raise TypeError(f"{where}: 'accumulators' must be a list, got {type(acc).__name__}")
        if len(acc) != len(self.masters):
            raise ValueError("load_state_dict: the state was saved for a different set of parameters")
        saved_world = state_dict.get("accumulators_world_size")
        if saved_world is not None:
            saved_world = check_int("'accumulators_world_size'", saved_world, where=where, minimum=1)
            acc = self._own_accumulators(acc, saved_world, state_dict.get("accumulators_present"))
        for i, (a, q) in enumerate(zip(acc, self.masters)):
            if a is None:
                continue
            if not isinstance(a, Tensor):
                raise TypeError(f"{where}: 'accumulators'[{i}] must be a tensor or None, "
                                f"got {type(a).__name__}")
            if tuple(a.shape) != tuple(q.shape):
                raise ValueError(f"load_state_dict: accumulator shape {tuple(a.shape)} != {tuple(q.shape)} "
                                 f"('accumulators'[{i}])")
            if not a.is_floating_point():
                raise ValueError(f"{where}: 'accumulators'[{i}] must be a floating-point tensor, "
                                 f"got {a.dtype}")
            if not self._checks:  # no loss scaler skips a non-finite window here: it would reach the update
                values = a.coalesce().values() if a.is_sparse else a
                if not bool(torch.isfinite(values).all()):
                    raise ValueError(f"{where}: 'accumulators'[{i}] holds NaN or inf values")
        items = self._saved_items(state_dict.get("items"), saved_world)
        # the optimizer's and the scaler's states, on copies (their own load_state_dict checks them)
        copy.deepcopy(self.scaler).load_state_dict(state_dict["scaler"])
        try:
            probe = copy.deepcopy(self.optimizer)
        except Exception:  # noqa: BLE001 - an optimizer that cannot be copied is only checked by its own load
            probe = None
        if probe is not None:
            probe.load_state_dict(state_dict["optimizer"])
            del probe
        # everything checked: assign
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.scaler.load_state_dict(state_dict["scaler"])
        self._step.fill_(step)
        self._host_step = host_step
        self._host_exact = host_exact
        self._step_seen = self._step._version
        self._micro = micro
        self._items.copy_(items)
        self.summaries.attempts = attempts
        pos = {id(q): j for j, q in enumerate(self.masters)}
        if self._mp is not None:
            self._mp.zero_grad(set_to_none=True)  # drops the wrapper's pending accumulation
            self._mp.accumulate_grads([acc[pos[id(m)]] for m in self._mp.master_params])
        half = {id(self.masters[i]) for i in self._half_idx}
        for a, q in zip(acc, self.masters):
            if id(q) in half:
                continue
            q.grad = None if a is None else a.clone().to(q.dtype)
        self._lr_error = None
        try:
            self._lr_now = self._lr_at_step()
            self._lr_t = self._lr_tensor(self._lr_now, self._step.device)
        except Exception as err:  # noqa: BLE001 - the state is loaded; the next update raises it first
            self._lr_error = err

    def _gather_items(self, group: Any) -> Tensor | None:
        """Every rank's window count (token-weighted accumulation) on the group's first rank as a [W]
        tensor; None on the other ranks."""
        import torch.distributed as dist

        world, me = dist.get_world_size(group), dist.get_rank(group)
        dst = dist.get_global_rank(group, 0) if group is not None else 0
        mine = self._items.reshape(1).clone()
        rows = [torch.empty_like(mine) for _ in range(world)] if me == 0 else None
        dist.gather(mine, rows, dst=dst, group=group)
        return torch.cat(rows) if me == 0 else None

    def _saved_items(self, saved: Any, world: int | None) -> Tensor:
        """The window count to restore (checked): a 0-d tensor, or this rank's entry of a per-rank [W]
        tensor; 0 for states saved before token-weighted accumulation."""
        if saved is None:
            return torch.zeros_like(self._items)
        if not isinstance(saved, Tensor) or not saved.is_floating_point() or \
                saved.numel() != (1 if world is None or saved.dim() == 0 else world):
            raise ValueError("load_state_dict: 'items' must be a floating-point tensor (one entry per rank "
                             "inside a data-parallel window)")
        if not bool(torch.isfinite(saved).all()) or bool((saved < 0).any()):
            raise ValueError("TrainOp.load_state_dict: 'items' (tokens in the open window) must be finite "
                             "and >= 0")
        if world is not None and saved.dim() == 1:
            _, group = self._window_group()
            import torch.distributed as dist

            saved = saved[dist.get_rank(group)]
        return saved.reshape(()).to(self._items.device, torch.float64)

    def _own_accumulators(self, acc: Sequence[Any], world: int, present: Any) -> list[Tensor | None]:
        """This rank's row of accumulators saved for ``world`` ranks (validated)."""
        per_rank, group = self._window_group()
        where = "load_state_dict"
        if not per_rank:
            raise ValueError(f"{where}: the state holds the accumulators of {world} data-parallel ranks; "
                             "load it into a data-parallel train op (on_horovod or DDP) on as many ranks")
        import torch.distributed as dist

        if dist.get_world_size(group) != world:
            raise ValueError(f"{where}: the state was taken inside an accumulation window on {world} ranks; "
                             f"resume on {world} ranks (this run has {dist.get_world_size(group)})")
        if not isinstance(present, Tensor) or tuple(present.shape) != (len(self.masters), world):
            raise ValueError(f"{where}: 'accumulators_present' must be a [{len(self.masters)}, {world}] "
                             "tensor")
        me = dist.get_rank(group)
        out: list[Tensor | None] = []
        for i, (a, q) in enumerate(zip(acc, self.masters)):
            if a is not None and (not isinstance(a, Tensor) or tuple(a.shape) != (world, *q.shape)):
                raise ValueError(f"{where}: per-rank accumulator {i} must have shape {(world, *q.shape)}")
            out.append(a[me] if a is not None and bool(present[i, me]) else None)
        return out


def _chain(opt: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """``[opt, its inner optimizer, ...]`` down to the innermost one."""
    out = [opt]
    while isinstance(out[-1], OptimizerWrapper):
        out.append(out[-1].optimizer)
    return out
