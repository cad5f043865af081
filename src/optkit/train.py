"""``optimize_loss``: OpenSeq2Seq's one-call training step, as an eager PyTorch train op (seed 000,
``spec/openseq2seq.md`` §2–§4, §11; DESIGN §2.3).

``train_op = optimize_loss(loss, "Momentum", {"momentum": 0.9}, lambda k: poly_decay(k, 0.1, 1000), ...)``
returns a :class:`TrainOp`; ``train_op(*inputs)`` runs one micro-step and returns a :class:`StepResult`.
One update (``n`` micro-batches, ``W`` ranks, loss scale ``S``) does, in the original's order (§3.3, §11):

1. forward ``L = fp32(loss(*inputs))``; backward of ``L·S`` into the parameters' ``.grad`` (``"mixed"``:
   the half-precision gradients are folded into fp32 accumulators next to the fp32 master copies);
2. accumulation: PyTorch's own ``.grad`` accumulation sums the ``n`` scaled micro-batch gradients; the scale
   ``S`` stays fixed inside the window (the scaler only moves at update attempts);
3. distributed: one bucketed ``all_reduce`` (SUM) of the accumulated gradients per update, or, with a
   ``DistributedDataParallel`` model, DDP's own reduction with ``no_sync()`` on accumulation micro-steps;
4. ``"mixed"``: diverted regularizers of half parameters add ``S·n·W·∂R/∂master`` (they are evaluated on the
   fp32 master, §5.2);
5. global norm ``N = ‖Σ grads‖ / (S·n·W)`` (fp32) — the true norm of the *mean* gradient — logged as
   ``global_gradient_norm``;
6. clip (``clip_gradients = c``): ``s = min(1, c/N)`` (no epsilon, as the original), or LARC (``larc_params``)
   per parameter ``r = min(max(η‖w‖/(lr(‖g‖+ε)), min_update), 1)`` (clip mode) or ``max(η‖w‖/(‖g‖+ε),
   min_update)`` (scale mode), §4;
7. per-variable summaries, clipped-norm summary, LARC summaries (due steps only);
8. non-finite check (a non-finite ``N``: any NaN/inf in any gradient of the window) and the scaler update;
9. the optimizer step with ``lr(k)``, ``k`` = applied updates so far; a skipped update changes nothing;
10. ``"mixed"``: ``p16 ← saturate(master)``; gradients cleared for the next window.

Folding (performance): steps 2, 5, 6 and 8 never rewrite the gradients. The mean, the unscale and the clip
factor form one 0-d factor ``s/(S·n·W)`` handed to the optimizer as ``grad_scale`` (its fused kernel divides
by it), LARC ratios go in as ``grad_multipliers``, and the skip decision as ``found_inf``: every optkit
optimizer and torch's fused optimizers (``_step_supports_amp_scaling``) take these in their update pass. So an
update costs one read-only norm pass over the gradients plus the optimizer's own pass; nothing reads a tensor
on the host unless summaries are due (or a non-fused torch optimizer must be skipped, as GradScaler does).

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
import inspect
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from . import _multi_tensor as mt
from ._validation import check_params
from .clipping import clip_coefficient
from .loss_scale import AutomaticLossScaler, DynamicLossScale, FixedLossScale, LossScale
from .optimizer import Optimizer as _OptkitOptimizer
from .regularization import _set_diverted, regularized_parameters
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
_STATE_KEYS = ("optimizer", "scaler", "global_step", "host_step", "host_exact", "micro", "touched",
               "accumulators", "masters", "summary_attempts")


class StepResult(NamedTuple):
    """What one call of the train op did. Every field is a tensor on the device (no host sync).

    ``loss``: this micro-batch's loss (fp32, unscaled, detached). ``applied``: 0-d bool, True when this call
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
    loss: Callable[..., Tensor],
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
) -> TrainOp:
    """Build the train op for ``loss`` (OpenSeq2Seq ``optimize_loss``; see the module docstring for the
    per-update order and the differences from the original).

    Args:
        loss: callable ``loss(*inputs) -> scalar tensor`` (e.g. ``fp32(model loss) +
            get_regularization_loss()``); ``train_op(*inputs)`` calls it once per micro-step.
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
            reduces by itself.
        iter_size: micro-batches per update; ``skip_update_ph``: a bool or zero-argument callable; when given,
            a true value makes the call accumulate only and a false value updates with the micro-batches
            accumulated so far (``train_op(..., skip_update=...)`` overrides it per call).
        model: the model (its parameters and names; DDP detection).

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
    if on_horovod:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("`on_horovod=True` needs an initialised torch.distributed process group")
    return TrainOp(loss, cls, opt_kwargs, lr_fn, named, dtype, clip, larc, scaler, logger, on_horovod,
                   int(iter_size), skip_update_ph, model, process_group, bucket_numel)


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
        if not fn >= 0:
            raise ValueError(f"the learning rate must be >= 0, got {fn!r}")
        value = float(fn)
        return lambda _step: value
    if not callable(fn):
        raise TypeError(f"`learning_rate_decay_fn` must be a callable or a number, got {fn!r}")
    return fn


# ------------------------------------------------------------------------------------------------------------


class TrainOp:
    """The train op built by :func:`optimize_loss`; call it once per micro-batch.

    Attributes: ``optimizer`` (the optimizer over the trained tensors: the fp32 masters in ``"mixed"``),
    ``scaler`` (the :class:`~optkit.LossScale`), ``global_step`` (applied updates, 0-d int64 tensor),
    ``params`` (the model tensors trained), ``masters`` (their fp32 copies in ``"mixed"``, else ``params``).
    ``state_dict()``/``load_state_dict()`` cover optimizer, scaler, master copies, the gradients accumulated
    in an open window, the step and the summary counter; with the model's own ``state_dict`` this resumes
    bit-identically.
    """

    def __init__(self, loss_fn, cls, opt_kwargs, lr_fn, named, dtype, clip, larc, scaler, logger, on_horovod,
                 iter_size, skip_update_ph, model, process_group, bucket_numel) -> None:
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
        self._mixed = dtype == "mixed"
        device = mt.local(self.params[0]).device

        # masters ("mixed"): fp32 copies of the half parameters, trained by the optimizer
        self._half_idx = [i for i, p in enumerate(self.params) if self._mixed and p.dtype in _HALF]
        self.masters = list(self.params)
        for i in self._half_idx:
            self.masters[i] = self.params[i].detach().to(torch.float32).clone()
        self._bufs = [torch.zeros_like(self.masters[i]) for i in self._half_idx]
        self._touched = [False] * len(self._half_idx)
        half_params = [self.params[i] for i in self._half_idx]
        self._diverted = regularized_parameters(half_params)
        master_of = {id(self.params[i]): self.masters[i] for i in self._half_idx}
        self._diverted_masters = [master_of[id(p)] for p, _, _ in self._diverted]

        # loss scaling
        self.scaler = scaler.to(device)
        self._unit_scale = isinstance(scaler, FixedLossScale) and scaler.loss_scale_value == 1.0
        self._checks = bool(scaler.dynamic or getattr(scaler, "skip_non_finite", False))
        self._one = torch.ones((), dtype=torch.float32, device=device)
        self._false = torch.zeros((), dtype=torch.bool, device=device)
        self._true = torch.ones((), dtype=torch.bool, device=device)

        # step counter and learning rate (lr(k) of the k-th applied update)
        self._step = torch.zeros((), dtype=torch.int64, device=device)
        self._host_step = 0
        self._host_exact = not self._checks  # host count is exact while no update can be skipped
        self._lr_now: Any = self._lr_fn(0)
        self._lr_t = self._lr_tensor(self._lr_now, device)

        # the optimizer
        self._optkit = isinstance(cls, type) and issubclass(cls, _OptkitOptimizer)
        opt_params: list = list(zip(self.names, self.masters)) if self._optkit else list(self.masters)
        if self._optkit:
            self.optimizer = cls(opt_params, learning_rate=self._current_lr, **opt_kwargs)
        else:
            key = "learning_rate" if _accepts(cls, "learning_rate") else "lr"
            self.optimizer = cls(opt_params, **{key: float(self._lr_now)}, **opt_kwargs)
        self._optkit_inst = isinstance(self.optimizer, _OptkitOptimizer)
        self._amp = self._optkit_inst or bool(getattr(self.optimizer, "_step_supports_amp_scaling", False))

        # distribution
        ddp = model if isinstance(model, nn.parallel.DistributedDataParallel) else None
        self._ddp = ddp
        self._group = process_group
        self._world = 1
        self._reduce = on_horovod and ddp is None
        if self._reduce:
            import torch.distributed as dist

            self._world = dist.get_world_size(process_group)
            self._reduce = self._world > 1
        self._bucket_numel = bucket_numel
        self._micro = 0
        if self._diverted:
            _set_diverted(half_params, True)

    # ---- public surface ------------------------------------------------------------------------------------

    @property
    def global_step(self) -> Tensor:
        """Applied updates so far (0-d int64 tensor, live)."""
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
        return torch.tensor(float(lr), dtype=torch.float32, device=device)

    def _refresh_lr(self) -> None:
        step = self._host_step if self._host_exact else self._step
        self._lr_now = self._lr_fn(step)
        self._lr_t = self._lr_tensor(self._lr_now, self._step.device)
        if not self._optkit:
            value = self._lr_now
            for g in self.optimizer.param_groups:
                if isinstance(value, Tensor) and not (self._optkit_inst or g.get("fused")):
                    value = float(value)  # non-fused torch kernels take a float lr (a host read)
                g["lr"] = value

    # ---- one micro-step -----------------------------------------------------------------------------------

    def __call__(self, *inputs: Any, skip_update: bool | None = None, **kw_inputs: Any) -> StepResult:
        """Run one micro-step on ``inputs``: forward, backward, and (at the end of a window) the update."""
        update = self._is_update(skip_update)
        ctx = self._ddp.no_sync() if (self._ddp is not None and not update) else contextlib.nullcontext()
        with ctx:
            loss = self._loss_fn(*inputs, **kw_inputs)
            if not isinstance(loss, Tensor) or loss.numel() != 1:
                raise ValueError("`loss` must return a scalar tensor")
            loss32 = loss.reshape(())
            if loss32.dtype in _HALF:
                loss32 = loss32.float()
            scale = self._one if self._unit_scale else self.scaler.loss_scale
            target = loss32 if self._unit_scale else loss32 * scale.to(loss32.device)
            if self._ddp is not None:
                target.backward()
            else:
                torch.autograd.backward(target, inputs=self.params)
        if self._half_idx:
            self._fold_half_grads()
        self._micro += 1
        if not update:
            return StepResult(loss32.detach(), self._false, self._step.clone(), self._lr_t, scale, None)
        return self._update(loss32.detach(), scale)

    def _is_update(self, skip_update: bool | None) -> bool:
        flag = skip_update
        if flag is None and self.skip_update_ph is not None:
            ph = self.skip_update_ph
            flag = ph() if callable(ph) else ph
        if flag is None:
            return self._micro + 1 >= self.iter_size
        return not bool(flag)

    def _fold_half_grads(self) -> None:
        """Move the half gradients of this micro-batch into the fp32 accumulators (copy, or add within a
        window) and point each master's ``.grad`` at its accumulator."""
        copy_dst, copy_src, add_dst, add_src = [], [], [], []
        for j, i in enumerate(self._half_idx):
            p = self.params[i]
            g = p.grad
            if g is None:
                continue
            g = g.to_dense() if g.is_sparse else g
            if self._touched[j]:
                add_dst.append(self._bufs[j])
                add_src.append(g)
            else:
                copy_dst.append(self._bufs[j])
                copy_src.append(g)
                self._touched[j] = True
                self.masters[i].grad = self._bufs[j]
            p.grad = None
        if copy_dst:
            torch._foreach_copy_(copy_dst, copy_src)
        if add_dst:
            torch._foreach_add_(add_dst, add_src)

    # ---- the update ---------------------------------------------------------------------------------------

    def _with_grads(self) -> tuple[list[int], list[Tensor], list[Tensor]]:
        idx, qs, grads = [], [], []
        for i, q in enumerate(self.masters):
            g = q.grad
            if g is not None:
                idx.append(i)
                qs.append(q)
                grads.append(g)
        return idx, qs, grads

    def _update(self, loss: Tensor, scale: Tensor) -> StepResult:
        idx, qs, grads = self._with_grads()
        if not grads:
            self._micro = 0
            raise ValueError("No gradients provided for any variable: the loss does not depend on `var_list`")
        n, self._micro = self._micro, 0
        log = self.summaries
        due = log.due()
        log.advance()
        lr_t = self._lr_t
        if self._reduce:
            self._all_reduce_(grads)
            grads = [q.grad for q in qs]

        count = n * self._world
        denom: Tensor | None = None if self._unit_scale else scale
        if count != 1:
            denom = torch.full((), float(count), device=scale.device) if denom is None else denom * count
        if self._diverted:
            self._add_diverted_grads(denom)
            idx, qs, grads = self._with_grads()

        larc = self.larc_params
        need_norm = (self.clip_gradients is not None or self._checks or larc is not None
                     or (due and log.wants("global_gradient_norm")))
        raw_norms = None
        norm = None
        if need_norm:
            if larc is not None:
                raw_norms = torch.stack(mt.norms(grads))
                raw = torch.linalg.vector_norm(raw_norms)
            else:
                raw = mt.global_norm(grads)
            norm = raw if denom is None else raw / denom

        # the raw gradients are divided by grad_scale = denom / coef (mean, unscale, clip in one factor)
        coef = None
        if self.clip_gradients is not None and norm is not None:
            coef = clip_coefficient(norm, self.clip_gradients, nan_on_nonfinite=False)
        grad_scale = denom if coef is None else (1.0 / coef if denom is None else denom / coef)
        factor = None if grad_scale is None else torch.reciprocal(grad_scale)

        ratios = clip_on = None
        if larc is not None:
            ratios, clip_on = self._larc_ratios(qs, raw_norms, denom, lr_t)

        step_now = None
        if due:
            step_now = int(self._step)
            self._write_summaries(step_now, idx, qs, grads, lr_t, norm, factor, coef, scale, ratios, clip_on)

        found = None
        applied = self._true
        if self._checks:
            overflow = (~torch.isfinite(norm)).to(torch.float32)
            amax = None
            if self.scaler.needs_amax:
                inf_norms = torch.stack([x.float() for x in mt.norms(grads, float("inf"))])
                if ratios is not None:
                    inf_norms = inf_norms * ratios
                amax = inf_norms.amax() if factor is None else inf_norms.amax() * factor
            applied = self.scaler.update(overflow, amax)
            found = (~applied).to(torch.float32)

        self._step_optimizer(qs, grads, grad_scale, ratios, found)

        if self._host_exact:
            self._step.add_(1)
            self._host_step += 1
        else:
            self._step.add_(applied.to(torch.int64))
        if self._half_idx:
            self._copy_masters_back()
        for q in self.masters:
            q.grad = None
        if self._half_idx:
            for p in self.params:
                p.grad = None
        self._touched = [False] * len(self._half_idx)
        self._refresh_lr()  # lr(k) for the next update, k = applied updates so far
        return StepResult(loss, applied, self._step.clone(), lr_t, scale, norm)

    def _step_optimizer(self, qs, grads, grad_scale, ratios, found) -> None:
        opt = self.optimizer
        if self._amp:
            if grad_scale is not None:
                opt.grad_scale = grad_scale.reshape(()).to(torch.float32)  # GradScaler's dtype
            if found is not None:
                opt.found_inf = found
            if ratios is not None:
                rs = ratios.unbind(0)
                if self._optkit_inst:
                    opt.grad_multipliers = {id(q): r for q, r in zip(qs, rs)}
                else:
                    mt.scale_(grads, list(rs))
            try:
                opt.step()
            finally:
                for attr in ("grad_scale", "found_inf", "grad_multipliers"):
                    if hasattr(opt, attr):
                        delattr(opt, attr)
            return
        # an optimizer without grad_scale/found_inf support: scale the gradients, skip on the host
        if grad_scale is not None:
            mt.scale_(grads, torch.reciprocal(grad_scale))
        if ratios is not None:
            mt.scale_(grads, list(ratios.unbind(0)))
        if found is None or not bool(found):  # host read, as torch.amp.GradScaler does for such optimizers
            opt.step()

    def _larc_ratios(self, qs, raw_norms, denom, lr) -> tuple[Tensor, Tensor | None]:
        """Per-parameter LARC factors (§4) as one fp32 vector; ``clip_on`` (clip mode) for the summaries."""
        p = self.larc_params
        eta, eps, floor = p["larc_eta"], p["epsilon"], p["min_update"]
        w_norms = torch.stack([x.float() for x in mt.norms(qs)])
        g_norms = raw_norms if denom is None else raw_norms / denom
        num = eta * w_norms
        clip_on = None
        if p["larc_mode"] == "clip":
            den = lr * (g_norms + eps)
            clip_on = (num < den).to(torch.float32)
            # r = min(max(num/den, floor), 1), with num >= den (lr == 0 included) giving 1 without 0/0
            one = torch.ones_like(num)
            r = torch.where(num >= den, one, num / torch.where(den > 0, den, one))
            r = torch.clamp(r, min=floor)
        else:
            r = torch.clamp(num / (g_norms + eps), min=floor)
        half = [q.dtype == torch.float16 for q in qs]
        if any(half):  # saturate-cast to the variable dtype (pure float16 mode)
            lim = torch.tensor([65504.0 if h else float("inf") for h in half], device=r.device)
            r = torch.minimum(r, lim)
        return r, clip_on

    def _add_diverted_grads(self, denom: Tensor | None) -> None:
        """``master.grad += S·n·W·∂R/∂master`` for the regularizers of half parameters (§5.2)."""
        masters = self._diverted_masters
        with torch.enable_grad():
            leaves = [m.detach().requires_grad_(True) for m in masters]
            total = sum(fn(x).float() for x, (_, fn, _) in zip(leaves, self._diverted))
            rgrads = torch.autograd.grad(total, leaves, allow_unused=True)
        pairs = [(m, g) for m, g in zip(masters, rgrads) if g is not None]
        if denom is not None:
            rg = torch._foreach_mul([g for _, g in pairs], denom)
        else:
            rg = [g for _, g in pairs]
        for m, _ in pairs:
            if m.grad is None:
                j = next(j for j, i in enumerate(self._half_idx) if self.masters[i] is m)
                self._bufs[j].zero_()
                m.grad = self._bufs[j]
                self._touched[j] = True
        torch._foreach_add_([m.grad for m, _ in pairs], rg)

    def _copy_masters_back(self) -> None:
        """``p16 ← saturate(master)``: cast, then clamp ±inf to the half type's largest finite value."""
        halves = [self.params[i] for i in self._half_idx]
        masters = [self.masters[i] for i in self._half_idx]
        with torch.no_grad():
            torch._foreach_copy_(halves, masters)
            for dtype in {h.dtype for h in halves}:
                group = [h for h in halves if h.dtype == dtype]
                big = float(torch.finfo(dtype).max)
                mt.clamp_(group, -big, big)

    def _all_reduce_(self, grads: list[Tensor]) -> None:
        """Sum the accumulated gradients over the process group in flat buckets
        (:func:`optkit.distributed.all_reduce_gradients_`); the 1/W of the average is folded into the update
        factor. Sparse gradients are densified first (the original's ``shared_embed`` path)."""
        from .distributed import all_reduce_gradients_

        for q in self.masters:
            if q.grad is not None and q.grad.is_sparse:
                q.grad = q.grad.to_dense()
        dense = [q.grad for q in self.masters if q.grad is not None]
        all_reduce_gradients_(dense, self._group, average=False, bucket_numel=self._bucket_numel)

    # ---- summaries ----------------------------------------------------------------------------------------

    def _write_summaries(self, step, idx, qs, grads, lr, norm, factor, coef, scale, ratios, clip_on) -> None:
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
        if ratios is not None and log.wants("larc_summaries"):
            log.write_larc(names, clip_on, ratios, lr, step)
        if log.wants("loss_scale"):
            log.scalar("loss_scale", scale, step)

    # ---- checkpointing ------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Optimizer, scaler, master copies, open-window accumulators, step counters and summary counter."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "global_step": self._step.clone(),
            "host_step": self._host_step,
            "host_exact": self._host_exact,
            "micro": self._micro,
            "touched": list(self._touched),
            "accumulators": [None if q.grad is None else q.grad.detach().clone() for q in self.masters],
            "masters": [self.masters[i].detach().clone() for i in self._half_idx],
            "summary_attempts": self.summaries.attempts,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (validated before anything changes). Load the model's own state
        (its half parameters) as well; the master copies come from here."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"load_state_dict: expected a dict, got {type(state_dict).__name__}")
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise ValueError(f"load_state_dict: missing keys {missing}")
        acc = state_dict["accumulators"]
        masters = state_dict["masters"]
        if len(acc) != len(self.masters) or len(masters) != len(self._half_idx):
            raise ValueError("load_state_dict: the state was saved for a different set of parameters")
        for a, q in zip(acc, self.masters):
            if a is not None and tuple(a.shape) != tuple(q.shape):
                raise ValueError(f"load_state_dict: accumulator shape {tuple(a.shape)} != {tuple(q.shape)}")
        for m, i in zip(masters, self._half_idx):
            if tuple(m.shape) != tuple(self.masters[i].shape):
                raise ValueError("load_state_dict: master copy shapes do not match")
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.scaler.load_state_dict(state_dict["scaler"])
        self._step.copy_(state_dict["global_step"])
        self._host_step = int(state_dict["host_step"])
        self._host_exact = bool(state_dict["host_exact"])
        self._micro = int(state_dict["micro"])
        self._touched = list(state_dict["touched"])
        self.summaries.attempts = int(state_dict["summary_attempts"])
        with torch.no_grad():
            for m, i in zip(masters, self._half_idx):
                self.masters[i].copy_(m)
        bufs = {id(self.masters[i]): self._bufs[j] for j, i in enumerate(self._half_idx)}
        for a, q in zip(acc, self.masters):
            if a is None:
                q.grad = None
            elif id(q) in bufs:
                bufs[id(q)].copy_(a)
                q.grad = bufs[id(q)]
            else:
                q.grad = a.clone().to(q.dtype)
        self._lr_now = self._lr_fn(self._host_step if self._host_exact else self._step)
        self._lr_t = self._lr_tensor(self._lr_now, self._step.device)
