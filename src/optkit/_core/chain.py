"""Out-of-place per-tensor update chains: the ``jit_compile`` path and the fallback for devices without a
fused kernel.

Every optkit optimizer states its update rule once more as pointwise math on one tensor (its ``_pointwise``
staticmethod ``(hyper, w, g, slots, lr, k, aux) -> (new_w, new_slots)``, with the true gradient ``k·g``).
:func:`chain` runs decay → rule → EMA with it, out of place, and writes the results back; with ``found_inf``
set
to 1 every result is replaced by its old value with ``torch.where``, so non-finite gradients leave no trace.

* ``jit_compile=True`` hands :func:`chain` to ``torch.compile`` (:func:`compiled_chain`, built once per
  process); inductor fuses each tensor's chain into one loop, and the learning rate, clip/unscale factor, skip
  flag and EMA weight are tensor inputs, so changing them never recompiles. Each param group's shapes and
  its other hyperparameters (momentum, betas, ...: Python numbers) make one graph; a new value of those is a
  new compile (:data:`RECOMPILE_LIMIT` graphs in all, then eager with a warning).
* The fused-kernel gate (:mod:`optkit._core.fused`) sends tensors on devices that have no fused kernel here,
with
  half-precision inputs upcast to float32 so that each stored value is rounded once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

__all__ = ["chain", "compiled_chain", "compiled_function", "norm_check_sums", "norm_sums", "sum_sq",
           "warn_compile_fallback"]


def warn_compile_fallback(err: Exception) -> None:
    """One ``RuntimeWarning``: ``jit_compile`` falls back to eager execution."""
    warnings.warn(
        f"jit_compile=True: the update could not be compiled ({type(err).__name__}: {err}); running eagerly "
        "from now on",
        RuntimeWarning, stacklevel=4,
    )


def chain(rule, hyper, params, grads, slots, avgs, lr, k, wd, decay_mask, ema_w, found_inf, mult, aux,
          upcast: bool = False, zero_grads: bool = False) -> None:
    """decay → update → EMA for each tensor, out of place, then written back (module doc).

    Keras order: ``w ← w − w·wd·lr`` (where ``decay_mask``), the rule, ``avg ← avg + ema_w·(w − avg)``.
    ``slots`` is a tuple of per-slot lists; ``avgs``, ``decay_mask``, ``mult`` and ``aux`` may be None.
    ``upcast``: compute half-precision tensors in float32 (eager fallback; inductor does this itself).
    ``zero_grads``: then set every gradient to zero (in the same loop once compiled: the gradient was just
    read, so this is one store instead of a separate pass), skipped step or not.
    """
    skip = None if found_inf is None else found_inf > 0.5
    for i in range(len(params)):
        p = params[i]
        g = grads[i]
        old_slots = [s[i] for s in slots]
        w, olds = p, old_slots
        if upcast and p.dtype in (torch.float16, torch.bfloat16):
            w, g, olds = p.float(), g.float(), [s.float() for s in old_slots]
        if mult is not None and mult[i] is not None:
            g = g * mult[i]
        w0 = w
        if decay_mask is not None and decay_mask[i]:
            w = w - w * (wd * lr)
        new_w, new_slots = rule(hyper, w, g, olds, lr, k, None if aux is None else aux[i])
        if skip is not None:
            new_w = torch.where(skip, w0, new_w)
            new_slots = [torch.where(skip, o, n) for o, n in zip(olds, new_slots)]
        for o, n in zip(old_slots, new_slots):
            o.copy_(n)
        if avgs is not None:
            a = avgs[i]
            w_ = ema_w if skip is None else torch.where(skip, torch.zeros_like(ema_w), ema_w)
            a.copy_(a + w_ * (new_w.to(a.dtype) - a))
        p.copy_(new_w)
        if zero_grads:
            grads[i].zero_()


_COMPILED: list = []

#: graphs the compiled chain may hold: one per param group's shapes and constant hyperparameters (momentum,
#: betas, ... are Python numbers in the rules, so a new value is a new graph), over every optimizer in the
#: process. torch's own limit of 8 per function sent a model with more than 8 param groups (layer-wise decay)
#: back to eager; it is raised for this function's calls only.
RECOMPILE_LIMIT = 256


def compiled_chain() -> Callable | None:
    """The ``torch.compile``-d :func:`chain` (built once per process; None where unavailable), called with
    dynamo's recompile limit raised to :data:`RECOMPILE_LIMIT`."""
    if not _COMPILED:
        try:
            _COMPILED.append(_make_compiled())
        except Exception:  # pragma: no cover - torch without a working compile stack
            _COMPILED.append(None)
    return _COMPILED[0]


#: other functions compiled the same way (an optimizer's own compiled pass), by function
_COMPILED_OTHER: dict[Callable, Callable | None] = {}


def compiled_function(fn: Callable) -> Callable | None:
    """``fn`` compiled as :func:`compiled_chain` compiles the chain (full graph, static shapes, the raised
    recompile limit), built once per process; None where ``torch.compile`` is unavailable."""
    if fn not in _COMPILED_OTHER:
        try:
            _COMPILED_OTHER[fn] = _make_compiled(fn=fn)
        except Exception:  # pragma: no cover - torch without a working compile stack
            _COMPILED_OTHER[fn] = None
    return _COMPILED_OTHER[fn]


def _make_compiled(backend: str = "inductor", fn: Callable = chain) -> Callable:
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)
    import torch._dynamo.config as dynamo_config

    # (torch < 2.7 spells them cache_size_limit / accumulated_cache_size_limit)
    names = (("recompile_limit", "accumulated_recompile_limit") if hasattr(dynamo_config, "recompile_limit")
             else ("cache_size_limit", "accumulated_cache_size_limit"))
    limits = {k: v for k, v in ((names[0], RECOMPILE_LIMIT),
                                (names[1], max(RECOMPILE_LIMIT, getattr(dynamo_config, names[1], 0))))
              if hasattr(dynamo_config, k)}

    def run(*args, **kwargs):  # type: ignore[no-untyped-def]
        with dynamo_config.patch(limits):
            return compiled(*args, **kwargs)

    return run


#: row length of :func:`sum_sq`'s row split: inductor's CPU sum over more than 4,096 float32 elements goes
#: through a cascade-summation helper kept in memory, which limits a read-only pass to about 13 GB/s here;
#: rows of 4,096 sum in registers (then the row sums are summed)
SUM_ROW = 4096


def _row_split(x: torch.Tensor) -> list[torch.Tensor]:
    """``x`` flattened (float32 for half precision) as at most two pieces: a ``(rows, SUM_ROW)`` matrix and
    the tail (one piece when either is empty)."""
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    x = x.reshape(-1)
    n = x.numel()
    r = n // SUM_ROW
    if r == 0:
        return [x]
    m = x[: r * SUM_ROW].view(r, SUM_ROW)
    return [m] if r * SUM_ROW == n else [m, x[r * SUM_ROW:]]


def _sum_all(x: torch.Tensor) -> torch.Tensor:
    return x.sum(1).sum() if x.dim() == 2 else x.sum()


def _total(parts: list[torch.Tensor]) -> torch.Tensor:
    """The sum over the pieces of :func:`_row_split` of a per-piece sum."""
    return parts[0] if len(parts) == 1 else parts[0] + parts[1]


def sum_sq(x: torch.Tensor) -> torch.Tensor:
    """``Σx²`` of a whole tensor (float32 for half precision), for compiled read-only passes: row sums of
    :data:`SUM_ROW` elements, then their sum, plus the tail (a two-level sum, also more accurate than one)."""
    return _total([_sum_all(p * p) for p in _row_split(x)])


def norm_sums(ws, gs):
    """The compiled norm pass of LARS's and LARC's ``jit_compile`` (read only, for
    :func:`compiled_function`): the ``(n, 2)`` float64 matrix of each pair's ``(Σw², Σg²)``, one loop per pair
    reading both tensors."""
    return torch.stack([torch.stack((sum_sq(w).double(), sum_sq(g).double())) for w, g in zip(ws, gs)])


def norm_check_sums(ts):
    """The compiled norm-and-check pass of ``optimize_loss`` over an optimizer built with ``jit_compile``
    (read only, for :func:`compiled_function`): the ``(n, 2)`` float64 matrix of each tensor's ``Σx²`` (summed
    in the tensor's accumulation dtype, as the eager norms: float32 overflows to inf alike) and ``Σ 0·x``
    (0, or NaN when an element is NaN or ±inf: the flag, whatever the squares did), from one loop over the
    tensor (the flag costs about 10% over the sum of squares alone; a count of non-finite elements 45%)."""
    out = []
    for t in ts:
        parts = _row_split(t)
        out.append(torch.stack((_total([_sum_all(p * p) for p in parts]).double(),
                                _total([_sum_all(p * 0.0) for p in parts]).double())))
    return torch.stack(out)
