"""LAMB: layer-wise adaptive moments for large batches (registry name ``"LAMB"``).

You, Li, Reddi, Hseu, Kumar, Bhojanapalli, Song, Demmel, Keutzer, Hsieh: "Large Batch Optimization for Deep
Learning: Training BERT in 76 minutes" (arXiv:1904.00962), Algorithm 2. With ``g`` the processed gradient
(unscaled, clipped), ``t`` the number of this update (``iterations + 1``: skipped steps do not count),
``lr`` the current learning rate and ``‖·‖`` the L2 norm of a whole tensor::

    m ← β1·m + (1 − β1)·g
    v ← β2·v + (1 − β2)·g²
    m̂ = m / (1 − β1^t),  v̂ = v / (1 − β2^t)            (bias_correction=False: m̂ = m, v̂ = v)
    u = m̂ / (√v̂ + ε) + wd·w                             (decoupled weight decay inside the direction)
    r = ‖w‖ / ‖u‖   if ‖w‖ > 0 and ‖u‖ > 0, else 1       (per tensor: the layer-wise trust ratio)
    r ← clamp(r, min_coeff, max_coeff)   if ‖w‖ > 0 and ‖u‖ > 0   (DeepSpeed's clamp, None: no bound; as
                                                          in its fused kernel the 1 of a zero norm stays 1)
    r ← min(r, 1)                                        (lambc=True: timm's LAMBC)
    w ← w − lr·r·u

Which tensors adapt (timm's ``Lamb`` rule, ``always_adapt``): the trust ratio applies to a tensor whose
weight decay is non-zero, or to every tensor with ``always_adapt=True``; the others take ``r = 1`` (a plain
Adam step with ``u = m̂/(√v̂ + ε)``). A tensor excluded from weight decay (``exclude_from_weight_decay``, a
group with ``weight_decay`` 0) is therefore also excluded from adaptation unless ``always_adapt``. With the
defaults (``weight_decay=0.0``, ``always_adapt=False``) no tensor adapts: pass a weight decay (timm's default
is 0.01) or ``always_adapt=True`` (Keras 3 ``Lamb``, the paper) to get LAMB. A name in ``skip_list``
(substring, as LARS) or, with ``exclude_1d=True``, a tensor with ``ndim <= 1`` gets neither weight decay nor
adaptation; so does every tensor of a param group with ``"exclude_from_adaptation": True`` (adaptation only,
its decay is kept; :func:`optkit.param_groups` writes that key).

NVLAMB's pre-normalisation by the global gradient norm (apex ``FusedLAMB(max_grad_norm=c)``, timm
``Lamb(max_grad_norm=c)``): ``g ← g / max(1, ‖g‖_global / c)`` over all parameters before the moments
is ``g·c / max(‖g‖_global, c)``, exactly the base class's ``global_clipnorm``; ``global_grad_norm_clip=c``
sets it (mutually exclusive with the other clip options). timm's ``Lamb`` enables it by default
(``c = 1.0``); optkit does not (the paper has no clip).

Implementation (two sweeps over memory, no host sync, no per-parameter Python arithmetic). The trust ratio
needs the norm of ``u`` over the whole tensor before any weight changes, so a step is two passes:

1. :meth:`LAMB._prepare`, block by block over the base's cache-sized chunks. float32/float64 on the CPU:
   torch's fused AdamW kernel, called with the gradient chunk as its own "parameter" and ``lr = wd = −1``,
   updates ``m`` and ``v`` in place and leaves ``g·(1 − 1) + m̂/(√v̂ + ε)`` = the Adam direction in the
   gradient chunk (the kernel loads both operands before it stores: bit-identical to the direction written
   into a zeroed buffer; ``found_inf`` skips it); ``wd·w`` is added for the decayed tensors (times 0 on a
   skipped step, so the gradient stays as it was) and ``‖u‖``, ``‖w‖`` are taken on the chunk while it is
   in cache. Elsewhere (and for half precision) the direction goes into an in-cache scratch chunk instead.
   Chunk sums of squares are summed per tensor with one ``index_add_`` (and across the mesh for DTensors);
   trust ratios and the per-tensor factors are formed on stacked vectors.
2. :meth:`LAMB._update` (the base's blocked pass). CPU: the gradient chunks hold ``u``, and torch's fused
   SGD kernel applies ``w ← w − s·u`` (``s = lr·r``) with ``found_inf``: ``s`` as the kernel's tensor
   learning rate, one call per chunk, for blocks of up to four tensors; for blocks of many small tensors
   ``s`` is multiplied into ``u`` in cache first (1 on a skipped step) and one call takes the block.
   Elsewhere the direction is rebuilt in cache from the new moments: ``d = c·m/(√v + e) + s·wd·w`` with
   ``c = s·√(1−β2^t)/(1−β1^t)``, ``e = ε·√(1−β2^t)``, and the fused SGD kernel applies ``w ← w − d``.

Off the CPU, float32/float64 tensors on one device take both passes in :meth:`LAMB._device_step`, in a
number of kernel launches that does not depend on the number of tensors (about 20 per step) and with no host
read: ``U ← wd·w``, the fused Adam kernel adds the direction into ``U`` (``U = u``), one
``torch._foreach_norm`` gives every ``‖u‖`` and ``‖w‖``, the trust ratios and step sizes are vector
arithmetic, and ``w ← w − s·u`` runs as one ``addcmul`` with ``s`` expanded from tensors to elements
(:func:`optkit._multi_tensor.segment_expand`): over a flat buffer to blocks of the segment sizes' common
divisor, broadcast over rows; per tensor into a vector kept with the plan whose views have the weights'
shapes (one ``torch._foreach_addcmul_``). The caller's gradients are only read there (or get ``k·g``, the
kernel's unscaling write-back), so flat buffers keep their flat path. Half precision, DTensors, gradients
the engine protects from ``k·g`` (``global_grad_norm_clip``, multipliers) and non-contiguous tensors take
the per-chunk passes above.

A block of whole float32/float64 CPU tensors (every block but the pieces of tensors larger than a block)
takes both passes at once, while it is in cache (:meth:`LAMB._fused_block`): pass 1 writes ``u`` into the
block's in-cache scratch (the fused Adam kernel on the zeroed scratch chunk: ``0 + direction``, the same
``u``), the block's trust ratios come from its own norms (the tensors
are whole), and pass 2 applies ``w ← w − s·u`` from the scratch; the gradients are only read (under an
unscaling factor with the caller's gradients, the kernel's write-back of ``k·g`` goes into a copy in the
scratch). The pieces of larger tensors keep ``u`` in their gradient chunks from pass 1 to pass 2: with
``scratch_grads=True`` (the train op) in ``p.grad``; by default, so that ``p.grad`` is left as
``torch.optim`` leaves it, in a buffer of the gradients' size kept with the base's plan (memory, not state),
each chunk copied into it just before the fused kernel reads it (in cache: no separate copy pass); over flat
buffers' row runs that buffer is one flat copy of the flat gradient, filled row chunk by row chunk the same
way (:meth:`optkit.optimizer.Optimizer._shadow_rows`). Both modes give bit for bit the same weights and
moments. Where that buffer is not used (inside ``torch.compile``, or
the step whose compilation failed) pass 1 leaves the caller's gradients alone by taking every chunk the way
of the half-precision ones (below): ``u`` from copies of the moments, and pass 2 updates the moments with the
same kernel on its in-cache copies of the gradients, so the applied direction is still the one whose norm
set the trust ratio.

Over flat buffers (:func:`optkit.flat_parameters`, float32/float64 on the CPU) both passes run on the
buffer's row runs instead (consecutive parameters of one size are the rows of a ``(count, size)`` matrix,
cut into cache-sized row chunks): one fused AdamW call, two row norms and an in-cache multiply per chunk,
with ``s`` as a ``(rows, 1)`` column, so the host work no longer grows with the number of parameters
(:meth:`LAMB._prepare_rows`, then :func:`_step_along_` as for the tensors' chunks).

With ``jit_compile=True`` both passes are compiled (``torch.compile``, one loop per tensor each) and pass 1
writes nothing: :func:`_lamb_sums` forms the new moments and ``u`` from ``k·g`` and returns only ``Σu²``
and ``Σw²`` (read ``w, g, m, v``: 16 B/param), then the compiled rule (:func:`_lamb_pointwise`, ``fresh ==
"raw"``) forms them again and writes ``m, v, w`` (28 B/param): 44 B/param against the eager passes' fused
kernels plus their separate decay and norm kernels (about 15-30% faster here on large tensors; the first step
compiles, 13 s for ResNet-50 shapes with inductor's on-disk cache warm, about a minute cold). The gradients
are left as they were. Over flat buffers whose row runs are in use, both compiled passes take the run
matrices whole (:func:`_lamb_row_sums`, row reductions; the rule with ``(count, 1)`` columns): a few graph
inputs per run of consecutive equal-size parameters, not per parameter (past
:data:`optkit.optimizer.COMPILE_WARN_TENSORS` runs, the eager row pass).

Each formula is written once, as a function of tensors: :func:`_moments` (:func:`_new_moments` with the
true gradient ``k·g``, half precision in float32), :func:`_corrections` (the bias corrections),
:func:`_direction` (``u``), :meth:`LAMB._trust_ratio` and :func:`_step_sizes` (``s = lr·r``). The pointwise
rule (:func:`_lamb_pointwise`: ``jit_compile``, tracing, devices without a fused kernel), the compiled pass 1
(:func:`_lamb_sums`, :func:`_lamb_row_sums`) and the eager out-of-place pass 1 (:meth:`LAMB._pass1_math`)
are built from them; the eager fast path runs the same rule through two torch kernels,
:func:`_adam_direction_` (the moments and ``m̂/(√v̂ + ε)``) and :func:`_sgd_` (``w ← w − s·u``,
:func:`_step_along_`).

Main memory sees: read ``w, g, m, v`` and write ``m, v, g`` (pass 1, 28 B/param in fp32), read ``w, g``
and write ``w`` (pass 2, 12 B/param): 40 B/param, the floor of any two-pass LAMB (+4 in pass 2 for blocks of
many small tensors, whose gradient chunks are written again; about +4 for the default mode's buffer); a
block taking both passes at once reads ``w, g, m, v`` and writes ``m, v, w`` as far as it stays in cache
(28 B/param at best). Half-precision parameters keep half moments,
updated in pass 2 by the fused Adam kernel (fp32 arithmetic, rounded once) after pass 1 ran it on copies:
the applied direction is then the one whose norm set the trust ratio (rebuilding it from rounded half
moments would not be); their pass 2 runs on fp32 staged copies. Sparse gradients are densified (duplicates
summed).

State: ``exp_avg`` and ``exp_avg_sq`` (torch/timm names).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from typing_extensions import Unpack

from . import _multi_tensor as mt
from ._core import fused as _fused
from ._core.compiled import COMPILE_WARN_TENSORS
from ._core.plan import RunAux, scratch_view
from ._core.traits import Traits
from .optimizer import LearningRate, Optimizer, OptimizerOptions, ParamsT, check_number

__all__ = ["LAMB"]

_HALF = (torch.float16, torch.bfloat16)


# ------------------------------------------------------------------------------- the rule, out of place
# (each formula once: the pointwise rule, the compiled pass 1 and the eager out-of-place pass 1 are built
# from these; the fused-kernel forms are _adam_direction_ and _sgd_ below)


def _moments(g: Tensor, m: Tensor, v: Tensor, beta1: float, beta2: float) -> tuple[Tensor, Tensor]:
    """The new moments, out of place (``m + (1−β1)(g − m)`` as torch's ``lerp``)."""
    return m + (g - m) * (1.0 - beta1), v * beta2 + g * g * (1.0 - beta2)


def _new_moments(hyper: tuple, w: Tensor, g: Tensor, m: Tensor, v: Tensor,
                 k: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(w, m', v')``: the moments after the true gradient ``k·g`` (``k`` None: ``g``), out of place, for
    ``hyper = (β1, β2)``; half-precision tensors are computed in float32 (``w`` too)."""
    if w.dtype in _HALF:
        w, g, m, v = w.float(), g.float(), m.float(), v.float()
    if k is not None:
        g = g * k
    return (w, *_moments(g, m, v, *hyper))


def _corrections(beta1: float, beta2: float, t: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The bias corrections as ``(ratio, e) = (√(1−β2^t)/(1−β1^t), ε·√(1−β2^t))`` in ``t``'s dtype and
    device, so that ``m/(√v + e)·ratio = m̂/(√v̂ + ε)`` (``t = inf``: no bias correction)."""
    bc2 = (1.0 - torch.pow(beta2, t)).sqrt()
    return bc2 / (1.0 - torch.pow(beta1, t)), eps * bc2


def _direction(m: Tensor, v: Tensor, ratio: Any, e: Any, w: Tensor | None = None, wd: Any = None) -> Tensor:
    """``m/(√v + e)·ratio``, plus ``wd·w`` unless ``wd`` is None: the direction ``u = m̂/(√v̂ + ε) + wd·w``
    (with ``ratio``, ``e`` of :func:`_corrections`), or pass 2's ``c·m/(√v + e)`` with ``ratio = c``."""
    u = m / (v.sqrt() + e) * ratio
    return u if wd is None else u + w * wd


def _lamb_pointwise(hyper, w, g, slots, lr, k, aux):
    """The rule as out-of-place pointwise math (``jit_compile``, ``torch.compile`` tracing, devices without a
    fused kernel), pass 2: ``w ← w − c·m/(√v + e) − s·wd·w`` with the moments :meth:`LAMB._prepare` already
    updated, or, for a ``fresh`` (half-precision) tensor, with the moments updated here from ``g`` (unscaled
    in pass 1, so ``k`` is not applied again), or, ``fresh == "raw"`` (the compiled pass 1,
    :func:`_lamb_sums`, left everything as it was), from the true gradient ``k·g`` in float32 or float64
    exactly as pass 1 formed the direction whose norm set ``s``; ``aux = (c, s·wd, e, s, fresh, direct)``
    (``direct`` is the eager CPU pass 2's, unused here; for ``"raw"``, ``c``, ``s·wd`` and ``s`` are the
    group's whole vectors and the last field is the tensor's position in them)."""
    m, v = slots
    c, swd, e, _, fresh, i = aux
    if fresh == "raw":
        if i is not None:  # (None: a run matrix of a flat buffer, c and s·wd are its (count, 1) columns)
            c, swd = c[i], swd[i]
        w, m, v = _new_moments(hyper, w, g, m, v, k)
    elif fresh:
        m, v = _moments(g, m, v, *hyper)
    return w - _direction(m, v, c, e) - w * swd, [m, v]


def _lamb_sums(hyper, ws, gs, ms, vs, k, ratio, e, decayed):
    """Pass 1 of ``jit_compile`` as one compiled function (read only, one loop per tensor): per tensor the
    sums of squares ``Σu²`` and ``Σw²`` of the direction ``u`` (:func:`_direction`) with the moments formed
    from the true gradient ``k·g`` (:func:`_new_moments`) as :func:`_lamb_pointwise` forms them in pass 2
    (which writes them), ``ratio``, ``e`` of :func:`_corrections`, ``decayed[i]`` = ``wd`` or None.
    Half-precision tensors are computed in float32. Returns an ``(n, 2)`` matrix in the sums' dtype: row
    ``i`` is ``(Σu², Σw²)`` of tensor ``i``. (Stacking the two sums of each tensor together keeps them in
    one loop: with two separate stacks, inductor's horizontal fusion grouped the ``Σw²`` of all tensors into
    a second kernel that read every weight again, 20-25% of the pass on ResNet-50 shapes.)"""
    rows = []
    for i in range(len(ws)):
        w, m, v = _new_moments(hyper, ws[i], gs[i], ms[i], vs[i], k)
        u = _direction(m, v, ratio, e, w, decayed[i])
        rows.append(torch.stack(((u * u).sum(), (w * w).sum())))
    return torch.stack(rows)


def _lamb_row_sums(hyper, ws, gs, ms, vs, k, ratio, e, wds):
    """:func:`_lamb_sums` over a flat buffer's run matrices (``jit_compile``; rows are parameters): the
    ``(rows, 2)`` matrix of each row's ``(Σu², Σw²)``, all runs stacked. ``wds``: each run's ``(count, 1)``
    column of weight decays (0 for the tensors without), or None when no tensor is decayed."""
    out = []
    for i in range(len(ws)):
        w, m, v = _new_moments(hyper, ws[i], gs[i], ms[i], vs[i], k)
        u = _direction(m, v, ratio, e, w, None if wds is None else wds[i])
        out.append(torch.stack(((u * u).sum(1), (w * w).sum(1)), 1))
    return torch.cat(out)


def _step_sizes(r: Tensor | None, lr: Tensor, n: int, at: Tensor | None = None,
                skip: Tensor | None = None) -> Tensor:
    """``s = lr·r`` for ``n`` tensors: ``r`` holds the trust ratios of the tensors at the positions ``at``
    (None: of all ``n``; a boolean mask: ``r`` holds all ``n`` and the others' are dropped), the others take
    ``r = 1`` (``r`` None: none adapts); ``s = 1`` exactly (NaN included) on a skipped step (``skip``, the
    ``found_inf`` flag), so that pass 2 then leaves the gradient as it is."""
    if r is None:
        s = lr.expand(n)
    elif at is None:
        s = lr * r
    elif at.dtype == torch.bool:
        s = lr * torch.where(at, r, torch.ones_like(r))
    else:
        s = torch.ones(n, dtype=lr.dtype, device=lr.device).index_copy_(0, at, r) * lr
    if skip is not None:
        s = torch.where(skip.to(s.device) > 0, torch.ones_like(s), s)
    return s


# ------------------------------------------------------------------------------- the rule, fused kernels


def _adam_direction_(u: list[Tensor], g: list[Tensor], m: list[Tensor], v: list[Tensor], t: Tensor,
                     hyper: tuple, scale: Tensor | None, found_inf: Tensor | None,
                     zeroed: bool = False) -> None:
    """Torch's fused Adam kernel: ``m``, ``v`` updated in place from ``scale·g`` (skipped with
    ``found_inf``) and ``u ← m̂/(√v̂ + ε)``, ``hyper = (β1, β2, ε)``. ``u`` is the gradient list itself (AdamW
    with ``lr = wd = −1`` on the gradient as its own "parameter" gives ``g·(1 − 1) + direction``: the kernel
    loads both operands before it stores, bit-identical to the direction written into a zeroed buffer) or
    scratch chunks (zeroed, then ``0 + direction``; ``zeroed``: ``u`` holds what the direction is added to,
    ``u ← u + direction``)."""
    beta1, beta2, eps = hyper
    ts = [t] * len(g)
    if u is g:
        torch._fused_adamw_(g, g, m, v, [], ts, lr=-1.0, beta1=beta1, beta2=beta2, weight_decay=-1.0, eps=eps,
                            amsgrad=False, maximize=False, grad_scale=scale, found_inf=found_inf)
        return
    if not zeroed:
        torch._foreach_zero_(u)
    torch._fused_adam_(u, g, m, v, [], ts, lr=-1.0, beta1=beta1, beta2=beta2, weight_decay=0.0, eps=eps,
                       amsgrad=False, maximize=False, grad_scale=scale, found_inf=found_inf)


def _sgd_(w: list[Tensor], d: list[Tensor], lr: Any, found_inf: Tensor | None) -> None:
    """``w ← w − lr·d`` by torch's fused SGD kernel (skipped with ``found_inf``)."""
    torch._fused_sgd_(w, d, [], weight_decay=0.0, momentum=0.0, lr=lr, dampening=0.0, nesterov=False,
                      maximize=False, is_first_step=False, grad_scale=None, found_inf=found_inf)


def _step_along_(w: list[Tensor], u: list[Tensor], s: list[Tensor], found_inf: Tensor | None) -> None:
    """``w ← w − s·u`` with the direction ``u`` that pass 1 left in the gradient chunks and ``s = lr·r`` per
    chunk (0-d tensors, or ``(rows, 1)`` columns over a flat buffer's row chunk): for up to four chunks ``s``
    is the fused SGD kernel's tensor learning rate (one call per chunk: ``u`` is not written), else it is
    multiplied into ``u`` first (one in-cache multiply, one call; ``s`` is 1 on a skipped step, see
    :func:`_step_sizes`: the gradient is then left as it was)."""
    if len(w) <= 4 and s[0].dim() == 0:
        for wi, ui, si in zip(w, u, s):
            _sgd_([wi], [ui], si, found_inf)
    else:
        torch._foreach_mul_(u, s)
        _sgd_(w, u, 1.0, found_inf)


class _Static:
    """Per-group facts that change only with the parameter set and the options (cached)."""

    __slots__ = ("adapt_of", "n_adapt", "index", "at", "mask", "decayed", "wd_vec", "any_decayed", "wd",
                 "wd_scalars")

    def wd_scalar(self, device: torch.device, dtype: torch.dtype) -> Tensor:
        """``wd`` as a 0-d tensor in ``dtype``'s accumulation dtype on ``device`` (made once)."""
        key = (device, mt.acc_dtype(dtype))
        hit = self.wd_scalars.get(key)
        if hit is None:
            hit = self.wd_scalars[key] = mt.scalar(self.wd, key[1], device)
        return hit


def _select(st: _Static, owners: list[int], chunks: list[Tensor]) -> tuple[list[int], ...]:
    """Of a chunk list (chunk ``j`` is a piece of tensor ``owners[j]``): the positions of the adapting chunks,
    their tensors' positions among the adapting tensors, the positions of the adapting decayed chunks, of the
    half-precision chunks and of every decayed chunk."""
    sel = [j for j, o in enumerate(owners) if st.adapt_of[o] >= 0]
    return (sel, [st.adapt_of[owners[j]] for j in sel], [j for j in sel if st.decayed[owners[j]]],
            [j for j, c in enumerate(chunks) if c.dtype in _HALF],
            [j for j, o in enumerate(owners) if st.decayed[o]])


class _BlockInfo:
    """Per block of a plan: the scratch chunks, copies of the moments, and :func:`_select`'s positions."""

    __slots__ = ("scratch", "sel", "own", "dec", "halves", "dec_all", "moments", "sel_t")


#: :meth:`LAMB._prepare`'s per-tensor entry when it applied both passes itself (:meth:`LAMB._device_step`)
_DONE = (None, None, None, None, False, "done")


class _DeviceInfo:
    """Per plan, for :meth:`LAMB._device_step` (made once; memory, not state): the segment sizes in blocks of
    ``B``, their greatest common divisor, as an int32 device vector (int64 from 2^31 elements; ``counts_b``,
    ``nb`` blocks), the norms' output vector and its 0-d views, the weight decay as
    a host number or list (per tensor) or a per-block vector (flat), and per form the scratch: flat, ``U``
    (the direction) and its segment views with the weights' (per tensor, the expanded step sizes are a
    :class:`optkit._multi_tensor.ElementFactors` kept per group)."""

    __slots__ = ("n", "total", "block", "nb", "counts_b", "sel", "vec", "vec_views", "wd_arg",
                 "wd_b", "flat", "u_flat", "segs")


class LAMB(Optimizer):
    """LAMB (module doc), with the options of timm ``Lamb``, DeepSpeed ``FusedLamb`` and apex ``FusedLAMB``.

    Args:
        params: tensors, ``model.named_parameters()`` (needed for ``skip_list``) or param groups (e.g. from
            :func:`optkit.param_groups`).
        learning_rate: number, 0-d tensor, schedule or callable (default 0.001).
        beta1, beta2: moment decay rates (``0 <= beta < 1``; defaults 0.9, 0.999).
        epsilon: added to ``√v̂`` (``> 0``; default 1e-6, as timm and apex; Keras uses 1e-7).
        weight_decay: ``wd`` in ``u = m̂/(√v̂+ε) + wd·w`` (``>= 0``, default 0.0), honouring
            :meth:`exclude_from_weight_decay`. Not the base class's Keras decay.
        bias_correction: divide the moments by ``1 − β^t`` (default True).
        always_adapt: apply the trust ratio also to tensors without weight decay (default False: timm's rule).
        max_coeff, min_coeff: clamp the trust ratio into ``[min_coeff, max_coeff]`` (DeepSpeed; None: no
            bound); the ratio 1 that a zero ``‖w‖`` or ``‖u‖`` gives is not clamped (DeepSpeed's kernel).
        lambc: clip the trust ratio at 1 (timm ``trust_clip``, the LAMBC variant).
        exclude_1d: no adaptation and no weight decay for tensors with ``ndim <= 1`` (biases, norm scales).
        skip_list: strings; a tensor whose name contains one gets no adaptation and no weight decay.
        global_grad_norm_clip: NVLAMB's ``g ← g / max(1, ‖g‖_global / c)`` before the moments (apex
            ``max_grad_norm``); the base class's ``global_clipnorm`` under its LAMB name.
        **kwargs: base options (``lr``, clipnorm, clipvalue, global_clipnorm, use_ema, ema_momentum, ...,
            jit_compile, mesh, name): :class:`~optkit.optimizer.OptimizerOptions`.

    ``params`` and the learning rate are the only positional arguments: ``LAMB(params, 1e-3,
    weight_decay=0.01)``. Raises ``ValueError``/``TypeError`` naming the argument (nothing is created).
    """

    slot_names = ("exp_avg", "exp_avg_sq")
    #: torch's (and timm's) names of these hyperparameters: refused in a param group, which would ignore them
    _torch_group_keys = {"betas": ("beta1", "beta2"), "eps": ("epsilon",)}
    traits = Traits(decoupled_weight_decay=False, blocks="always", prepare_reads_grads=True,
                    keeps_values_in_grads=True, unsigned_slots=("exp_avg_sq",))
    #: the direction kept in the gradient chunks on CPU (module doc); False runs the forms of other devices
    #: (:meth:`_device_step`, the scratch-and-rebuild chain) on the CPU too (for tests)
    _cpu_direct = True

    def __init__(
        self,
        params: ParamsT,
        learning_rate: LearningRate = 0.001,
        *,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-6,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        always_adapt: bool = False,
        max_coeff: float | None = None,
        min_coeff: float | None = None,
        lambc: bool = False,
        exclude_1d: bool = False,
        skip_list: Sequence[str] | None = None,
        global_grad_norm_clip: float | None = None,
        **kwargs: Unpack[OptimizerOptions],
    ) -> None:
        check_number("beta1", beta1, low=0.0, high=1.0)
        check_number("beta2", beta2, low=0.0, high=1.0)
        if beta1 >= 1.0 or beta2 >= 1.0:
            raise ValueError(f"`beta1` and `beta2` must be < 1, got {beta1!r}, {beta2!r}")
        check_number("epsilon", epsilon, low=0.0, low_open=True)
        check_number("weight_decay", weight_decay, low=0.0)
        for flag, value in (("bias_correction", bias_correction), ("always_adapt", always_adapt),
                            ("lambc", lambc), ("exclude_1d", exclude_1d)):
            if not isinstance(value, bool):
                raise TypeError(f"`{flag}` must be a bool, got {value!r}")
        check_number("max_coeff", max_coeff, low=0.0, low_open=True, allow_none=True)
        check_number("min_coeff", min_coeff, low=0.0, allow_none=True)
        if max_coeff is not None and min_coeff is not None and min_coeff > max_coeff:
            raise ValueError(f"`min_coeff` ({min_coeff!r}) must be <= `max_coeff` ({max_coeff!r})")
        if skip_list is not None:
            if isinstance(skip_list, str) or not all(isinstance(x, str) for x in skip_list):
                raise TypeError(f"`skip_list` must be a list of strings, got {skip_list!r}")
            skip_list = list(skip_list)
        check_number("global_grad_norm_clip", global_grad_norm_clip, low=0.0, low_open=True, allow_none=True)
        if global_grad_norm_clip is not None:
            others = [n for n in ("clipnorm", "clipvalue", "global_clipnorm") if kwargs.get(n) is not None]
            if others:
                raise ValueError(f"`global_grad_norm_clip` (NVLAMB's pre-normalisation, the base class's "
                                 f"global_clipnorm) cannot be combined with {others}")
            kwargs["global_clipnorm"] = float(global_grad_norm_clip)
        self._global_grad_norm_clip = None if global_grad_norm_clip is None else float(global_grad_norm_clip)
        self._static_cache: dict[int, tuple] = {}
        self._block_cache: dict[int, tuple] = {}
        self._direct_cache: dict[int, tuple] = {}  # id(group) -> (plan, (flags, all)): see _direct_flags
        self._device_cache: dict[int, tuple] = {}  # id(group) -> (plan, static, _DeviceInfo | None)
        self._writes_cache: dict[int, tuple] = {}  # id(group) -> (params, len, value): _update_writes_grads
        self._skip: Tensor | None = None
        self._fused_blocks: set[int] = set()  # blocks of this step whose pass 2 ran in pass 1 (_fused_block)
        self._halves_unscaled = True  # whether pass 1 unscaled the half-precision gradients in place
        super().__init__(
            params, learning_rate, weight_decay=float(weight_decay), beta1=float(beta1), beta2=float(beta2),
            epsilon=float(epsilon), bias_correction=bias_correction, always_adapt=always_adapt,
            max_coeff=None if max_coeff is None else float(max_coeff),
            min_coeff=None if min_coeff is None else float(min_coeff), lambc=lambc, exclude_1d=exclude_1d,
            skip_list=skip_list, **kwargs,
        )
        if not self._named and any(g["skip_list"] for g in self.param_groups):
            raise ValueError(
                "LAMB: `skip_list` matches parameter names, but the parameters came without names (they "
                "would all be called param_<i> and nothing would be skipped); pass model.named_parameters()"
            )

    # ------------------------------------------------------------------------------------------------ config

    def _hyper_config(self) -> dict:
        d = self.defaults
        return {
            "beta1": d["beta1"], "beta2": d["beta2"], "epsilon": d["epsilon"],
            "bias_correction": d["bias_correction"], "always_adapt": d["always_adapt"],
            "max_coeff": d["max_coeff"], "min_coeff": d["min_coeff"], "lambc": d["lambc"],
            "exclude_1d": d["exclude_1d"],
            "skip_list": None if d["skip_list"] is None else list(d["skip_list"]),
            "global_grad_norm_clip": self._global_grad_norm_clip,
        }

    def get_config(self) -> dict:
        cfg = super().get_config()
        if self._global_grad_norm_clip is not None:
            cfg["global_clipnorm"] = None  # stated once, under its LAMB name
        return cfg

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_static_cache"] = {}
        state["_block_cache"] = {}  # scratch buffers and views of the cached plans
        state["_direct_cache"] = {}
        state["_device_cache"] = {}
        state["_writes_cache"] = {}
        return state

    def _pointwise_hyper(self, group: dict) -> tuple:
        return (float(group["beta1"]), float(group["beta2"]))

    _pointwise = staticmethod(_lamb_pointwise)

    # ------------------------------------------------------------------------------------------------ rule

    def _apply(self, context):
        """The base pipeline, with the skip flag kept for :meth:`_prepare` (which updates the moments)."""
        found_inf = context.found_inf
        self._skip = None if found_inf is None else found_inf.detach().to(
            device=self._state_device, dtype=torch.float32).reshape(())
        try:
            return super()._apply(context)
        finally:
            self._skip = None

    def _skipped(self, group: dict, name: str, p: Tensor) -> bool:
        if group["exclude_1d"] and p.ndim <= 1:
            return True
        skip_list = group["skip_list"]
        return skip_list is not None and any(s in name for s in skip_list)

    def _static(self, group: dict, plan: Any, params: list[Tensor], dev, dtype) -> _Static:
        """Which tensors adapt and decay, and the weight-decay vector (cached per group; the key is built at
        C speed)."""
        skip_list = group["skip_list"]
        key = (tuple(plan.names), tuple(plan.use_wd), None if skip_list is None else tuple(skip_list),
               group["exclude_1d"], bool(group.get("exclude_from_adaptation", False)), group["always_adapt"],
               float(group["weight_decay"]), dev, dtype)
        hit = self._static_cache.get(id(group))
        if hit is not None and hit[0] == key:
            return hit[1]
        wd = float(group["weight_decay"])
        no_adapt = bool(group.get("exclude_from_adaptation", False))
        st = _Static()
        skipped = [self._skipped(group, nm, p) for nm, p in zip(plan.names, params)]
        st.decayed = [wd > 0.0 and u and not s for u, s in zip(plan.use_wd, skipped)]
        adapt = [not s and not no_adapt and (d or group["always_adapt"]) for s, d in zip(skipped, st.decayed)]
        st.adapt_of = []
        n_adapt = 0
        for a in adapt:
            st.adapt_of.append(n_adapt if a else -1)
            n_adapt += a
        st.n_adapt = n_adapt
        st.index = torch.tensor([i for i, a in enumerate(adapt) if a], dtype=torch.long, device=dev)
        st.at = None if n_adapt == len(adapt) else st.index
        st.mask = torch.tensor(adapt, dtype=torch.bool, device=dev)
        st.wd_vec = torch.tensor([wd if d else 0.0 for d in st.decayed], dtype=dtype, device=dev)
        st.any_decayed = any(st.decayed)
        st.wd = wd
        st.wd_scalars = {}
        self._static_cache[id(group)] = (key, st)
        return st

    def _block_infos(self, group: dict, plan: Any, st: _Static) -> dict[int, _BlockInfo] | None:
        """Per-block scratch and selections of a CPU plan (cached with the plan); None for plans without
        blocks (``update_step``, tracing) or off the CPU (scratch is then allocated per step)."""
        blocks = getattr(plan, "blocks", None)
        if not blocks or blocks[0].params[0].device.type != "cpu":
            return None
        hit = self._block_cache.get(id(group))
        if hit is not None and hit[0] is plan and hit[1] is st:
            return hit[2]
        sizes: dict[tuple, int] = {}
        for blk in blocks:
            for key in {(c.device, c.dtype) for c in blk.params}:
                need = sum(c.numel() for c in blk.params if (c.device, c.dtype) == key)
                sizes[key] = max(sizes.get(key, 0), need)
        pools = {key: torch.empty(n, dtype=key[1], device=key[0]) for key, n in sizes.items()}
        # (copies of the moments for a pass 1 that leaves them to pass 2: see _pass1)
        m_pools = {key: torch.empty(n, dtype=key[1], device=key[0]) for key, n in sizes.items()}
        v_pools = {key: torch.empty(n, dtype=key[1], device=key[0]) for key, n in sizes.items()}
        infos: dict[int, _BlockInfo] = {}
        for blk in blocks:
            info = _BlockInfo()
            offsets = dict.fromkeys(pools, 0)
            info.scratch, info.moments = [], ([], [])
            for c in blk.params:
                key = (c.device, c.dtype)
                info.scratch.append(scratch_view(pools[key], offsets[key], c))
                info.moments[0].append(scratch_view(m_pools[key], offsets[key], c))
                info.moments[1].append(scratch_view(v_pools[key], offsets[key], c))
                offsets[key] += c.numel()
            info.sel, info.own, info.dec, info.halves, info.dec_all = _select(st, blk.owners, blk.params)
            info.sel_t = torch.tensor(info.sel, dtype=torch.long, device=st.index.device)
            infos[id(blk)] = info
        self._block_cache[id(group)] = (plan, st, infos)
        return infos

    def _chunks(self, plan: Any, params: list[Tensor], grads: list[Tensor]):
        """``(block, owners, w, g, m, v)`` chunk lists: the plan's blocks, or the whole local tensors."""
        loc = mt.local
        blocks = getattr(plan, "blocks", None)
        if blocks is None:
            slots = plan.slots
            yield (None, list(range(len(params))), [loc(p) for p in params], [loc(g) for g in grads],
                   [loc(t) for t in slots["exp_avg"]], [loc(t) for t in slots["exp_avg_sq"]])
            return
        glocal = grads if not plan.any_dtensor else [loc(g) for g in grads]
        for blk in blocks:
            if blk.split is None:
                bg = [glocal[o] for o in blk.owners]
            else:
                bg = [glocal[o] if rng is None else glocal[o].view(-1)[rng[0]:rng[1]]
                      for o, rng in zip(blk.owners, blk.split)]
            yield blk, blk.owners, blk.params, bg, blk.slots["exp_avg"], blk.slots["exp_avg_sq"]

    def _t(self, group: dict) -> Tensor:
        """The number ``t`` of this update as a float32 0-d tensor, or ``inf`` without bias correction
        (``β^inf = 0``: the corrections become 1)."""
        if group["bias_correction"]:
            return (self._iterations + 1).to(torch.float32)
        return torch.full((), float("inf"), dtype=torch.float32, device=self._state_device)

    def _prepare(self, group, plan, params, grads, lr, k) -> list:
        """Pass 1 (module doc): update the moments (skipped with ``found_inf``), take ``‖w‖`` and ``‖u‖`` of
        the adapting tensors, and return per tensor ``(c, s·wd, e, s, fresh, direct)`` with ``s = lr·r``,
        ``c = s·√(1−β2^t)/(1−β1^t)`` and ``e = ε·√(1−β2^t)`` (0-d tensors); ``fresh`` (half-precision
        tensors) means the moments are left for pass 2 (see :meth:`_pass1`), ``direct`` that the gradient
        chunks hold ``u`` (module doc; when every tensor's do, pass 2 reads only ``s``: ``(None, None, e or
        None, s, False, True)``)."""
        n = len(params)
        self._fused_blocks = set()
        dev = mt.local(params[0]).device
        if plan.flat_active:  # one flat buffer: one dtype (no scan over the parameters)
            dtype = torch.float64 if mt.local(params[0]).dtype == torch.float64 else torch.float32
        else:
            dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
        st = self._static(group, plan, params, dev, dtype)
        beta1, beta2, eps = float(group["beta1"]), float(group["beta2"]), float(group["epsilon"])
        t = self._t(group)
        hyper = (beta1, beta2, eps, t, k, self._skip)
        jit = self._jit_active()
        # the caller's gradients (Optimizer._guards; the eager passes run on the base's copy instead): pass 1
        # leaves them as they are, every chunk taking the half-precision form (moments on copies, pass 2
        # updates them with the same kernel on its in-cache copies of the gradients: the applied direction
        # is bit for bit the one whose norm set the ratio)
        protected = self._grads_protected
        self._halves_unscaled = not protected
        lr = lr.to(device=dev, dtype=dtype)
        if not jit and not protected and not (dev.type == "cpu" and self._cpu_direct) \
                and not torch.compiler.is_compiling() \
                and self._device_step(group, plan, params, grads, st, hyper, lr, dev, dtype):
            return [_DONE] * n  # (one entry for all: the base then runs over the flat part whole)
        if plan.flat_active and self._shadow_rows(plan.flat):
            if jit and len(plan.flat.runs) <= COMPILE_WARN_TENSORS:  # (more runs: minutes of compiling)
                aux = self._prepare_rows_compiled(group, plan.flat, st, hyper, lr, dev, dtype)
                if aux is not None:
                    return aux
            if not protected:  # (the row runs keep u in the gradient rows; else the per-tensor chunks)
                return self._prepare_rows(group, plan.flat, st, hyper, lr, dev, dtype)
        tracing = torch.compiler.is_compiling()
        direct = None  # per tensor: whether pass 2 finds u in the gradient chunk, and whether all do
        if self._cpu_direct and not tracing and not protected:
            direct = self._direct_flags(group, plan, params)
        ratio = e = None  # (the bias corrections: pass 2 of the direct form reads only s)
        if jit or direct is None or not direct[1]:
            ratio, e = _corrections(beta1, beta2, t.to(device=dev, dtype=dtype), eps)
        if jit and not tracing:
            aux = self._prepare_compiled(group, params, grads, plan, st, hyper, lr, ratio, e, dev, dtype)
            if aux is not None:
                return aux
        infos = None if tracing else self._block_infos(group, plan, st)
        acc: tuple[list, list, list] = ([], [], [])  # ‖w‖ and ‖u‖ of adapting chunks, their tensors
        # grads: the base's buffer kept with the plan (keeps_values_in_grads), filled here block by block
        src = getattr(self, "_shadow_src", None)
        callers = (itertools.repeat(None) if src is None
                   else (c[3] for c in self._chunks(plan, params, src[0])))
        # blocks of whole float32/float64 tensors on the CPU take both passes at once (module doc)
        fuse = infos is not None and direct is not None and direct[1] and not plan.any_dtensor
        for (blk, own, ws, gs, ms, vs), cgs in zip(self._chunks(plan, params, grads), callers):
            info = None if infos is None else infos[id(blk)]
            if fuse and blk.split is None:
                mine = cgs is None
                self._fused_block(group, blk, info, ws, gs if mine else cgs, not mine, ms, vs, st, hyper, lr,
                                  e, dev, dtype)
                if cgs is not None and src[1] is not None:  # the caller's chunk: g/S, while in cache
                    mt.scale_(cgs, src[1])
                continue
            if cgs is not None:  # the caller's chunk into the buffer, and its 1/S, while in cache
                torch._foreach_copy_(gs, cgs)
                if src[1] is not None:
                    mt.scale_(cgs, src[1])
            self._pass1(blk, info, own, ws, gs, ms, vs, st, hyper, tracing, acc)
        trust = self._trust(group, st, *acc, params, dev, dtype) if st.n_adapt and acc[0] else None
        s = _step_sizes(trust, lr, n, st.at, self._skip)  # (s = 1 on a skipped step: g is left as it is)
        # (a compiled pass 2 reads c and s·wd: the jit_compile rule, _lamb_pointwise)
        compiled = self._jit_active()
        if direct is not None and direct[1] and not compiled:  # pass 2 reads only s (no c, s·wd lists)
            return [(None, None, e, si, False, True) for si in s.unbind()]
        c = (s * ratio).unbind()
        swd = (s * st.wd_vec).unbind()
        flags = direct[0] if direct is not None else [False] * n
        return [(ci, wi, e, si, protected or p.dtype in _HALF, d)
                for ci, wi, si, p, d in zip(c, swd, s.unbind(), params, flags)]

    def _fused_block(self, group, blk, info, ws, gs, callers, ms, vs, st, hyper, lr, e, dev, dtype) -> None:
        """Both passes on one block of whole float32/float64 CPU tensors while it is in cache: pass 1
        (:meth:`_pass1`, the direct form) writes ``u`` into the block's in-cache scratch and takes the norms,
        the block's trust ratios and ``s = lr·r`` (1 on a skipped step) are formed from them (:meth:`_trust`,
        :func:`_step_sizes`), and pass 2 (:meth:`_update`) applies ``w ← w − s·u`` from the scratch. The
        gradients are only read (the caller's, ``callers``, under an unscaling factor ``k``: a copy in the
        scratch takes it, since the fused kernel writes ``k·g`` back). :meth:`_update` then skips the
        block."""
        d = info.scratch
        into = hyper[4] is None or not callers
        if not into:
            torch._foreach_copy_(d, gs)
        acc: tuple[list, list, list] = ([], [], [])
        self._pass1(blk, info, blk.owners, ws, gs if into else d, ms, vs, st, hyper, False, acc, into)
        n = len(ws)
        r = at = None
        if acc[0]:  # (whole tensors: one norm each)
            r = self._trust(group, st, acc[0], acc[1], None, (), dev, dtype)
            if acc[2] == info.own:  # (the chunks in block order; the kernel gate may have split the block)
                at = None if len(acc[0]) == n else info.sel_t
            else:
                pos = dict(zip(info.own, info.sel))
                at = torch.tensor([pos[a] for a in acc[2]], dtype=torch.long, device=dev)
        s = _step_sizes(r, lr, n, at, hyper[5])
        aux = [(None, None, e, si, False, True) for si in s.unbind()]
        slots = {"exp_avg": ms, "exp_avg_sq": vs}
        self._block = blk
        try:
            self._update(group, ws, d, slots, lr, hyper[4], hyper[5], aux)
        finally:
            self._block = None
        self._fused_blocks.add(id(blk))

    def _prepare_compiled(self, group, params, grads, plan, st, hyper, lr, ratio, e, dev,
                          dtype) -> list | None:
        """Pass 1 for ``jit_compile``: the sums of squares of the adapting tensors by the compiled
        :func:`_lamb_sums`, which writes nothing (the compiled pass 2 updates the moments and the weights
        in one loop per tensor: 16 + 28 B/param in fp32, against the eager passes' separate norm and decay
        kernels). Returns the per-tensor ``aux`` with ``fresh == "raw"``, or None (after one
        ``RuntimeWarning``, eager from then on) when compiling fails."""
        lists = decays = None
        if st.n_adapt:
            sel = [i for i, a in enumerate(st.adapt_of) if a >= 0]
            m_l, v_l = plan.slots["exp_avg"], plan.slots["exp_avg_sq"]
            lists = [[mt.local(x[i]) for i in sel] for x in (params, grads, m_l, v_l)]
            decays = tuple(st.wd if st.decayed[i] else None for i in sel)
        out = self._compiled_factors(group, st, _lamb_sums, lists, decays, hyper, lr, ratio, e, params, dev,
                                     dtype, st.at)
        # whole vectors and each tensor's position: three graph inputs instead of three per tensor
        return None if out is None else [(*out, "raw", i) for i in range(len(params))]

    def _prepare_rows_compiled(self, group, flat, st, hyper, lr, dev, dtype) -> RunAux | None:
        """Pass 1 for ``jit_compile`` over a flat buffer's run matrices: the compiled :func:`_lamb_row_sums`
        (read only, row reductions), then per run the ``(count, 1)`` columns of ``c``, ``s·wd`` and ``s``
        for the compiled rule over the whole runs (``fresh == "raw"``: it forms the moments again and
        writes them with the weights). None (after one ``RuntimeWarning``, eager from then on) when
        compiling fails."""
        ratio, e = _corrections(hyper[0], hyper[1], hyper[3].to(device=dev, dtype=dtype), hyper[2])
        segs = flat.run_segments()
        lists = wds = None
        if st.n_adapt:
            w_r, g_r, slots, _ = flat.run_lists()
            wd = st.wd_vec.to(device=w_r[0].device, dtype=w_r[0].dtype)
            wds = [wd[a:a + c].unsqueeze(1) for a, c in segs] if st.any_decayed else None
            lists = [w_r, g_r, slots["exp_avg"], slots["exp_avg_sq"]]
        # (every row's ratio, the others' then dropped by the mask; no DTensor here)
        at = None if st.n_adapt == len(st.decayed) else st.mask
        out = self._compiled_factors(group, st, _lamb_row_sums, lists, wds, hyper, lr, ratio, e, [], dev,
                                     dtype, at)
        if out is None:
            return None
        c, swd, s = (x.unsqueeze(1) for x in (out[0], out[1], out[3]))
        return RunAux([(c[a:a + m], swd[a:a + m], e, s[a:a + m], "raw", None) for a, m in segs], per_run=True)

    def _compiled_factors(self, group, st, fn, lists, decays, hyper, lr, ratio, e, params, dev, dtype, at):
        """``(c, s·wd, e, s)`` vectors for the compiled rule, from the sums of squares ``(Σu², Σw²)`` that
        ``fn`` (:func:`_lamb_sums` or :func:`_lamb_row_sums`), compiled, gives on ``lists`` (w, g, m, v; None:
        no tensor adapts); ``at``: see :func:`_step_sizes`. None when compiling failed."""
        trust = None
        if lists is not None:
            k, tdev = hyper[4], lists[0][0].device
            sums = self._call_compiled(fn, hyper[:2], *lists, None if k is None else k.to(tdev),
                                       ratio.to(tdev), e.to(tdev), decays)
            if sums is None:
                return None
            u_sq, w_sq = sums.to(device=dev, dtype=dtype).unbind(1)
            trust = self._trust_from_squares(group, st, w_sq, u_sq, params, dev, dtype)
        s = _step_sizes(trust, lr, len(st.decayed), at)
        return s * ratio, s * st.wd_vec, e, s

    def _direct_flags(self, group: dict, plan: Any, params: list[Tensor]) -> tuple[list[bool], bool]:
        """Per tensor: whether pass 2 finds ``u`` in the gradient chunk (float32/float64 on the CPU, where the
        fused SGD kernel exists), and whether all do; cached per plan (a dtype or device change replaces
        the storage, and so the plan)."""
        hit = self._direct_cache.get(id(group))
        if hit is not None and hit[0] is plan:
            return hit[1]
        loc = [mt.local(p) for p in params]
        flags = [t.device.type == "cpu" and t.dtype not in _HALF
                 and _fused.native_dtype_ok("sgd", t.device, t.dtype) for t in loc]
        value = (flags, all(flags))
        self._direct_cache[id(group)] = (plan, value)
        return value

    def _update_writes_grads(self, group: dict) -> bool:
        """Only the CPU's direct form (module doc) leaves ``u`` in the gradients; every other form only reads
        them or leaves ``k·g`` (the fused kernels' ``grad_scale`` write-back, the half-precision unscaling),
        so off the CPU the base passes the caller's gradients (and flat buffers keep their flat path).
        Cached until the group's parameter list changes."""
        if not self._cpu_direct:
            return False
        ps = group["params"]
        hit = self._writes_cache.get(id(group))
        if hit is not None and hit[0] is ps and hit[1] == len(ps):
            return hit[2]
        value = any(mt.local(p).device.type == "cpu" for p in ps) and super()._update_writes_grads(group)
        self._writes_cache[id(group)] = (ps, len(ps), value)
        return value

    # --------------------------------------------------------------------- off the CPU: O(1) kernel launches

    def _device_info(self, group: dict, plan: Any, params: list[Tensor], st: _Static,
                     dev: torch.device) -> _DeviceInfo | None:
        """:class:`_DeviceInfo` of a plan whose tensors are all of one floating dtype on one device with
        torch's fused Adam kernel, not DTensors (None otherwise: the per-chunk passes; half precision only
        over a flat buffer, see :meth:`_device_step`); cached per plan."""
        hit = self._device_cache.get(id(group))
        if hit is not None and hit[0] is plan and hit[1] is st:
            return hit[2]
        info = None
        dtype = params[0].dtype
        if not plan.any_dtensor and (dtype in (torch.float32, torch.float64)
                                     or (dtype in _HALF and plan.flat is not None)) \
                and all(p.dtype == dtype and p.device == dev for p in params) \
                and _fused.native_dtype_ok("adam", dev, dtype):
            info = _DeviceInfo()
            numels = [p.numel() for p in params]
            info.n, info.total = len(numels), sum(numels)
            info.block = functools.reduce(math.gcd, numels, 0) or 1
            info.nb = info.total // info.block
            index = torch.int32 if info.total < 2**31 else torch.int64  # (the expansion's index dtype)
            info.counts_b = torch.tensor([c // info.block for c in numels], dtype=index, device=dev)
            info.sel = [i for i, a in enumerate(st.adapt_of) if a >= 0]
            acc = mt.acc_dtype(dtype)
            info.vec = torch.empty(2 * st.n_adapt, dtype=acc, device=dev)
            info.vec_views = list(info.vec.unbind())
            wds = [st.wd if d else 0.0 for d in st.decayed]
            uniform = all(w == wds[0] for w in wds)
            info.wd_arg = wds[0] if uniform else wds
            info.wd_b = None if uniform else mt.segment_expand(st.wd_vec.to(device=dev, dtype=acc),
                                                               info.counts_b, info.nb)
            info.flat = info.u_flat = info.segs = None
            if info.total == 0:
                info = None
        self._device_cache[id(group)] = (plan, st, info)
        return info

    def _device_step(self, group, plan, params, grads, st, hyper, lr, dev, dtype) -> bool:
        """Both passes off the CPU (float32/float64 on one device), in a number of kernel launches that does
        not grow with the number of tensors and with no host read:

        1. ``U ← wd·w`` (0 for the tensors without decay: ``0·w``), then torch's fused Adam kernel with
           ``lr = −1`` on ``U`` as its "parameter" updates ``m, v`` (from ``k·g``; skipped with ``found_inf``)
           and leaves ``U = wd·w + m̂/(√v̂ + ε) = u`` (:func:`_direction`'s ``u``, one rounding of the sum);
        2. ``‖u‖`` and ``‖w‖`` of the adapting tensors by one ``torch._foreach_norm`` over their segments, one
           copy into a vector, the trust ratios (:meth:`_trust_ratio`) and ``s = lr·r`` (:func:`_step_sizes`)
           as vector arithmetic;
        3. ``w ← w + (−s)·u`` with the per-tensor ``−s`` expanded to elements
           (:func:`optkit._multi_tensor.segment_expand`): over a flat buffer (:func:`optkit.flat_parameters`)
           to blocks of ``B`` elements (the segment sizes' greatest common divisor: 8 for ResNet-50) broadcast
           over the ``(nb, B)`` view of the flat ``U`` and weights, one ``addcmul_``; per tensor into a
           vector ``S`` kept with the plan whose views have the weights' shapes, one
           ``torch._foreach_addcmul_``.

        A skipped step (``found_inf``) leaves everything as it was: the kernel writes nothing, ``U = wd·w``
        stays finite and the expanded factor is +0, so each weight gets ``+0·(wd·w)``, a zero of its own sign.
        Traffic, float32: 44 B/param in 1-2 (the fused kernel 28, ``wd·w`` 8, the norms 8), 12 B/param plus
        16/B for the expansion in 3 over a flat buffer (56 + 2 B/param on ResNet-50 shapes: 1.45× the 40 B
        floor); per tensor 16 more (``S`` written and read, its index). Returns False (nothing done) for plans
        this form does not take (:meth:`_device_info`), or tensors that are not contiguous.

        Half precision (flat buffers only): the kernel forms ``u`` in float32 from the unrounded moments and
        rounds it once into ``U``; the norms are those of the rounded ``U`` that pass 2 applies (so ``‖u‖``
        is the norm of the applied direction), and ``w + (−s)·U`` is formed in float32 with the float32
        ``s`` and rounded once. (Per tensor ``torch._foreach_addcmul_`` would need ``s`` in the weights'
        half dtype, so those keep the per-chunk passes.)"""
        info = self._device_info(group, plan, params, st, dev)
        if info is None:
            return False
        flat = plan.flat if plan.flat_active else None
        ef = None
        if flat is None:
            if not (info.vec.dtype == params[0].dtype and all(map(Tensor.is_contiguous, params))
                    and all(map(Tensor.is_contiguous, grads))
                    and all(t.is_contiguous() for s in ("exp_avg", "exp_avg_sq") for t in plan.slots[s])):
                return False
            ef = mt.ElementFactors.cached(self._factor_cache, id(group), params)
            if ef is None:
                return False
        beta1, beta2, eps, t, k, skip = hyper
        fi = None if skip is None else skip.to(dev)
        nb, b = info.nb, info.block
        if flat is not None:
            ws, gs, slots, _ = flat.whole_lists()
            w = ws[0]
            if info.u_flat is None:
                info.u_flat = torch.empty_like(w)
                n = [p.numel() for p in params]
                u_segs, w_segs = info.u_flat.split(n), w.split(n)
                info.segs = ([u_segs[i] for i in info.sel], [w_segs[i] for i in info.sel])
            u_l = [info.u_flat]
            if info.wd_b is None:
                torch.mul(w, info.wd_arg, out=info.u_flat)
            else:
                torch.mul(w.view(nb, b), info.wd_b.unsqueeze(1), out=info.u_flat.view(nb, b))
            norm_in = info.segs[0] + info.segs[1]
        else:
            ws, gs, slots = params, grads, plan.slots
            u_l = list(torch._foreach_mul(ws, info.wd_arg))
            sel = info.sel
            norm_in = (u_l + list(ws)) if len(sel) == info.n else [u_l[i] for i in sel] + [ws[i] for i in sel]
        _adam_direction_(u_l, gs, slots["exp_avg"], slots["exp_avg_sq"], t.to(dev), (beta1, beta2, eps),
                         _fused.unscale_arg(k, gs, dev, dtype), fi, zeroed=True)
        r = None
        if st.n_adapt:
            torch._foreach_copy_(info.vec_views, mt._foreach_norm(norm_in, 2.0, info.vec.dtype))
            r = self._trust_ratio(group, info.vec[st.n_adapt:], info.vec[:st.n_adapt])
        neg = -_step_sizes(r, lr, info.n, st.at)
        if fi is not None:
            neg = torch.where(fi > 0, 0.0, neg)
        if flat is not None:
            factor = mt.segment_expand(neg, info.counts_b, nb).unsqueeze(1)
            w.view(nb, b).addcmul_(factor, info.u_flat.view(nb, b))
            return True
        ef.addcmul_(ws, u_l, neg)  # (the expanded −s: mt.ElementFactors)
        return True

    # ------------------------------------------------------------------------------ flat buffers: row runs

    @staticmethod
    def _rows_ok(flat: Any) -> bool:
        """Whether a flat part takes the row-run path: float32/float64 on the CPU (half-precision buffers keep
        the per-tensor path, whose moments handling they need; the path is tested on the CPU only). This is
        the fused-kernel gate's check for these tensors: row matrices are contiguous views of the flat runs
        (dense, equal strides in every list by construction), so :func:`optkit._core.fused.partition` would
        return them whole as ``native`` exactly when ``native_dtype_ok`` holds."""
        w = flat.row_blocks[0].params[0] if flat.row_blocks else None
        return (w is not None and w.device.type == "cpu" and w.dtype in (torch.float32, torch.float64)
                and _fused.native_dtype_ok("adam", w.device, w.dtype))

    def _shadow_rows(self, flat: Any) -> bool:
        """Whether the eager passes run over ``flat``'s row runs: when they pay and :meth:`_rows_ok`."""
        return flat.rows_pay and self._rows_ok(flat)

    def _prepare_rows(self, group, flat, st, hyper, lr, dev, dtype) -> RunAux:
        """Pass 1 over a flat buffer's row runs (:class:`optkit._core.plan.FlatPart`: consecutive parameters
        of one size form a ``(count, size)`` matrix): the fused Adam kernel runs once per row chunk, ``‖w‖``
        and
        ``‖u‖`` are row norms, and the factors are ``(rows, 1)`` columns, so a step costs O(#chunks) kernel
        calls instead of O(#parameters). Same rule and factors as :meth:`_prepare`. With the caller's
        gradients (``_shadow_src``) the rows hold ``u`` in the base's flat shadow (:meth:`_grad_shadow_rows`):
        each caller's chunk is copied into it, and scaled by 1/S, just before the kernel reads it."""
        t, k, skip = hyper[3:]
        wd_col = st.wd_vec.unsqueeze(1) if st.any_decayed else None
        w_parts, u_parts = [], []
        if wd_col is not None and skip is not None:  # times 0 on a skipped step: g is left as it was
            wd_col = wd_col * (1.0 - skip.to(device=dev, dtype=wd_col.dtype))
        # with the caller's gradients (Optimizer._shadow_rows) the rows run on the base's flat shadow: each
        # caller's chunk is copied into it, then gets its 1/S, while in cache
        src = getattr(self, "_shadow_src", None)
        grads = flat.row_grads if src is None else self._grad_shadow_rows(flat)
        for j, (blk, g, (lo, hi)) in enumerate(zip(flat.row_blocks, grads, flat.chunk_segments)):
            w, m, v = blk.params[0], blk.slots["exp_avg"][0], blk.slots["exp_avg_sq"][0]
            if src is not None:
                cg = src[0][j]
                g.copy_(cg)
                if src[1] is not None:
                    mt.scale_([cg], src[1])
            gl = [g]  # g ← m̂/(√v̂ + ε) in place (as the per-tensor pass), then u = that + wd·w
            scale = _fused.unscale_arg(k, gl, w.device, w.dtype)
            _adam_direction_(gl, gl, [m], [v], t.to(w.device), hyper[:3], scale,
                             None if skip is None else skip.to(w.device))
            if wd_col is not None:
                g.addcmul_(w, wd_col[lo:hi].to(w.dtype))
            w_parts.append(torch.linalg.vector_norm(w, dim=1, dtype=dtype))
            u_parts.append(torch.linalg.vector_norm(g, dim=1, dtype=dtype))
        n = len(st.decayed)
        r = self._trust_ratio(group, torch.cat(w_parts), torch.cat(u_parts)) if st.n_adapt else None
        # (every row's ratio, the others' then dropped by the mask; s = 1 on a skipped step: g is left)
        s = _step_sizes(r, lr, n, None if st.n_adapt == n else st.mask, skip)
        col = s.unsqueeze(1)
        return RunAux([(None, None, None, col[lo:hi], False, True) for lo, hi in flat.chunk_segments])

    def _pass1(self, blk, info, own, ws, gs, ms, vs, st, hyper, tracing, acc, into=False) -> None:
        """Pass 1 on one chunk list. float32/float64 chunks: the fused Adam kernel updates ``m, v`` in place
        and writes the direction into scratch. Half-precision chunks keep their moments for pass 2 (the
        kernel on copies): the kernel forms the direction from the unrounded fp32 moments, and pass 2 must
        use the same ones or ``‖u‖`` would not be the norm of the applied direction (a ``v`` that rounds to
        0 in half precision would blow the update up); their gradients are unscaled here, once."""
        n = len(ws)
        if info is not None:
            scratch, sel, own_pos, dec, halves, dec_all = (info.scratch, info.sel, info.own, info.dec,
                                                           info.halves, info.dec_all)
        else:
            scratch = None if tracing else [torch.empty_like(w, memory_format=torch.preserve_format)
                                            for w in ws]
            sel, own_pos, dec, halves, dec_all = _select(st, own, ws)
        k = hyper[4]
        protected = self._grads_protected
        if k is not None and protected:  # unscaled copies (pass 2 unscales its copies of the gradients alike)
            gs = mt.scaled_copies(gs, k)
        elif k is not None and halves:  # unscaled in place once (fp32 product, rounded once)
            hg = [gs[j] for j in halves]
            for (device, _), (_, (grp,)) in mt.group_by_device_dtype(hg).items():
                torch._foreach_mul_(grp, k.to(device=device, dtype=torch.float32))
        sel_of = dict(zip(sel, own_pos))
        dec_set, dec_all_set = set(dec), set(dec_all)
        if protected:  # the caller's gradients: every chunk as the half ones (module doc)
            subsets = [(list(range(n)), True)]
        elif len(halves) == n or not halves:
            subsets = [(list(range(n)), bool(halves))]
        else:
            hs = set(halves)
            subsets = [([j for j in range(n) if j not in hs], False), (halves, True)]
        for pos, fresh in subsets:
            whole = len(pos) == n
            sub = [ws, gs, ms, vs] if whole else [[x[j] for j in pos] for x in (ws, gs, ms, vs)]
            p_sel = [q for q, j in enumerate(pos) if j in sel_of]
            p_own = [sel_of[pos[q]] for q in p_sel]
            p_dec = [q for q in p_sel if pos[q] in dec_set]
            if tracing:
                self._pass1_math(*sub, range(len(pos)), st, hyper, fresh, p_sel, p_own, p_dec, acc)
                continue
            p_dec_all = [q for q in range(len(pos)) if pos[q] in dec_all_set] if not fresh else []
            d = scratch if whole else [scratch[j] for j in pos]
            copies = info.moments if protected and info is not None else None  # (protected: pos is whole)
            self._block = blk  # the gate's per-block fast path (layouts and dtype known)
            try:
                self._pass1_fused(d, *sub, st, hyper, fresh, p_sel, p_own, p_dec, acc, p_dec_all, copies,
                                  into)
            finally:
                self._block = None

    def _pass1_fused(self, scratch, ws, gs, ms, vs, st, hyper, fresh, sel, own_pos, dec, acc,
                     dec_all=(), copies=None, into=False) -> None:
        """:meth:`_pass1` through the fused-kernel gate (``sel``: the positions of the adapting chunks, at
        ``own_pos`` among the adapting tensors; ``dec``: of the adapting decayed chunks; ``dec_all``: of every
        decayed chunk). The fused Adam kernel gives ``m̂/(√v̂ + ε)`` (:func:`_adam_direction_`) and ``u`` is
        that plus ``wd·w``: on the CPU, float32/float64 (``direct``), ``u`` goes into the gradient chunk
        itself (or, ``into``, the block's zeroed scratch) for every chunk, since pass 2 reads it (module doc);
        elsewhere into the scratch, for the norms only (pass 2 forms it again from the moments)."""
        t, k, skip = hyper[3:]
        n = len(ws)
        lists = (scratch, gs, ms, vs, ws) + (() if copies is None else copies)  # (copies: for m and v)
        direct_ok = not fresh and self._cpu_direct
        written = (0,) if fresh else ((0, 1, 2, 3) if direct_ok and not into else (0, 2, 3))
        own_of = dict(zip(sel, own_pos))
        for device, dtype, mode, ix, (d, g, m, v, w, *mv) in self._kernel_parts("adam", lists, written):
            if mode == "fallback":
                self._pass1_math(w, g, m, v, ix, st, hyper, fresh, sel, own_pos, dec, acc)
                continue
            fi = None if skip is None or fresh else skip.to(device)
            direct = direct_ok and device.type == "cpu"
            if mv and mode == "native":  # the moments into the block's copies (kept for pass 2)
                torch._foreach_copy_(mv[0], m)
                torch._foreach_copy_(mv[1], v)
                m, v = mv
            elif fresh and (m[0].dtype in _HALF or self._grads_protected) and mode == "native":
                # native lists are the moments themselves (kept for pass 2): use copies
                m, v = [x.clone() for x in m], [x.clone() for x in v]
            u = g if direct and not into else d
            _adam_direction_(u, g, m, v, t.to(device), hyper[:3],
                             None if fresh else _fused.unscale_arg(k, g, device, dtype), fi)
            # u += wd·w: for every decayed chunk where pass 2 reads u (times 0 on a skipped step: the gradient
            # is then left as it was), else for the adapting ones (their norms)
            wanted = dec_all if direct else dec
            if len(ix) != n:
                wanted = set(wanted)
                wanted = [q for q, i in enumerate(ix) if i in wanted]
            if wanted:
                wd_a = st.wd_scalar(device, dtype)
                if direct and fi is not None:
                    wd_a = wd_a * (1.0 - fi)
                torch._foreach_addcmul_([u[q] for q in wanted], [w[q] for q in wanted], [wd_a] * len(wanted))
            q_sel = sel if len(ix) == n else [q for q, i in enumerate(ix) if i in own_of]
            if q_sel:
                a = mt.acc_dtype(dtype)
                acc[1].extend(mt._foreach_norm([u[q] for q in q_sel], 2.0, a))
                acc[0].extend(mt._foreach_norm([w[q] for q in q_sel], 2.0, a))
                acc[2].extend(own_of[q if len(ix) == n else ix[q]] for q in q_sel)

    @staticmethod
    def _pass1_math(ws, gs, ms, vs, ix, st, hyper, fresh, sel, own_pos, dec, acc) -> None:
        """:meth:`_pass1` as out-of-place math (tracing; devices without the fused Adam kernel):
        :func:`_new_moments`, :func:`_direction`; chunk ``j`` of the lists is at position ``ix[j]`` of the
        chunk list ``sel``/``dec`` refer to."""
        beta1, beta2, eps, t, k, skip = hyper
        adapting, dec = dict(zip(sel, own_pos)), set(dec)
        for j, i in enumerate(ix):
            w, m, v = ws[j], ms[j], vs[j]
            kf = None if k is None or fresh else k.to(device=w.device, dtype=mt.acc_dtype(w.dtype))
            wf, m2, v2 = _new_moments((beta1, beta2), w, gs[j], m, v, kf)
            if not fresh:
                if skip is not None:
                    s = skip.to(w.device) > 0.5
                    m2, v2 = torch.where(s, m, m2), torch.where(s, v, v2)
                m.copy_(m2)
                v.copy_(v2)
            if i not in adapting:
                continue
            ratio, e = _corrections(beta1, beta2, t.to(device=wf.device, dtype=wf.dtype), eps)
            u = _direction(m2, v2, ratio, e, wf, st.wd if i in dec else None)
            acc[1].append(torch.linalg.vector_norm(u))
            acc[0].append(torch.linalg.vector_norm(wf))
            acc[2].append(adapting[i])

    def _trust(self, group, st, w_parts, u_parts, owners, params, dev, dtype) -> Tensor:
        """Trust ratios from chunk norms: their sums of squares summed per tensor (``owners``: each chunk's
        position among the adapting tensors; None: one whole tensor each, in order), across the mesh for
        DTensors."""
        if len({(x.device, x.dtype) for x in w_parts}) == 1:
            wv = torch.stack(w_parts).to(device=dev, dtype=dtype)
            uv = torch.stack(u_parts).to(device=dev, dtype=dtype)
        else:
            wv = torch.stack([x.to(device=dev, dtype=dtype) for x in w_parts])
            uv = torch.stack([x.to(device=dev, dtype=dtype) for x in u_parts])
        m = st.n_adapt
        if owners is None or (len(owners) == m and owners == list(range(m))):
            w_sq, u_sq = wv * wv, uv * uv
        else:
            index = mt._index_tensor(owners, dev)
            w_sq = torch.zeros(m, dtype=dtype, device=dev).index_add_(0, index, wv * wv)
            u_sq = torch.zeros(m, dtype=dtype, device=dev).index_add_(0, index, uv * uv)
        return self._trust_from_squares(group, st, w_sq, u_sq, params, dev, dtype)

    def _trust_from_squares(self, group, st, w_sq, u_sq, params, dev, dtype) -> Tensor:
        """Trust ratios from the adapting tensors' local sums of squares (summed across the mesh for
        DTensors)."""
        m = st.n_adapt
        if not mt._all_plain(params) and any(mt.is_dtensor(p) for p in params):
            import torch.distributed as dist

            adapting = [p for p, a in zip(params, st.adapt_of) if a >= 0]
            plans = [mt._plan(mt._mesh_reduce_dims(p)) for p in adapting]
            if any(plans):
                both = torch.cat([w_sq, u_sq])
                mt._reduce_vector_(both, plans + plans, dist.ReduceOp.SUM)
                w_sq, u_sq = both[:m], both[m:]
        return self._trust_ratio(group, w_sq.sqrt(), u_sq.sqrt())

    @staticmethod
    def _trust_ratio(group: dict, w_n: Tensor, u_n: Tensor) -> Tensor:
        """The trust ratio from the norms ``‖w‖``, ``‖u‖`` (every form of the rule computes it here):
        ``clamp(‖w‖/‖u‖, min_coeff, max_coeff)`` where both norms are positive, else 1 unclamped (DeepSpeed's
        fused LAMB kernel, ``csrc/lamb/fused_lamb_cuda_kernel.cu``, clamps only the quotient), then LAMBC's
        ``min(r, 1)``."""
        r = w_n / u_n
        if group["min_coeff"] is not None or group["max_coeff"] is not None:
            r = r.clamp(min=group["min_coeff"], max=group["max_coeff"])
        r = torch.where((w_n > 0) & (u_n > 0), r, torch.ones_like(r))
        if group["lambc"]:
            r = r.clamp(max=1.0)
        return r

    def _update(self, group, params, grads, slots, lr, k, found_inf, aux) -> None:
        """Pass 2 (module doc) on one block: where the gradient chunks hold ``u`` (``direct``),
        ``w ← w − s·u``; elsewhere ``d = c·m/(√v + e) + s·wd·w`` in cache (half-precision chunks: the fused
        Adam kernel updates their moments and gives ``m̂/(√v̂ + ε)``, then ``d = s·(that) + s·wd·w``), and
        ``w ← w − d``; both by the fused SGD kernel with ``found_inf``."""
        if aux and aux[0] is _DONE:
            return  # both passes ran in _prepare (_device_step)
        if aux and aux[0][5] and aux[0][3].dim() == 2:  # a flat buffer's row chunk: s is a (rows, 1) column
            _step_along_(params, grads, [aux[0][3]], found_inf)
            return
        m_l, v_l = slots["exp_avg"], slots["exp_avg_sq"]
        if aux and aux[0][4] == "raw":  # compiled pass 1, eager pass 2 (its compile failed): the rule
            self._pointwise_fallback(group, params, grads, [m_l, v_l], lr, k, found_inf, aux)
            return
        blk = self._block
        if blk is not None and id(blk) in self._fused_blocks:
            return  # both passes ran in pass 1 (_fused_block)
        hit = self._block_cache.get(id(group))
        info = None if (blk is None or hit is None) else hit[2].get(id(blk))
        if info is not None and len(info.scratch) == len(params):
            scratch = info.scratch
        else:
            scratch = [torch.empty_like(p, memory_format=torch.preserve_format) for p in params]
        fresh = [j for j, a in enumerate(aux) if a[4]]
        done: set[int] = set()
        if fresh and k is not None and not getattr(self, "_halves_unscaled", True):
            mt.scale_([grads[j] for j in fresh], k)  # (copies of the caller's: pass 1 left those scaled)
        if fresh:
            done = self._fresh_moments(group, fresh, params, grads, scratch, m_l, v_l, lr, found_inf, aux)
        any_wd = float(group["weight_decay"]) > 0.0
        e = aux[0][2]
        lists = (params, grads, scratch, m_l, v_l)  # (the gate checks the gradients' layout at position 1)
        for device, dtype, mode, ix, (p, g, d, m, v) in self._kernel_parts("sgd", lists, (0,)):
            part_aux = aux if len(ix) == len(params) else [aux[i] for i in ix]
            if done and ix[0] in done:
                continue  # updated by the pointwise rule already
            fi = None if found_inf is None else found_inf.to(device)
            if mode == "fallback":
                self._pointwise_fallback(group, p, [grads[i] for i in ix], [m, v], lr, None, fi, part_aux)
                continue
            acc = mt.acc_dtype(dtype)
            if part_aux[0][5]:  # the gradient chunks hold u (pass 1)
                _step_along_(p, g, [a[3] for a in part_aux], fi)
                continue
            if part_aux[0][4]:  # d holds m̂/(√v̂ + ε) from the fused Adam kernel
                torch._foreach_mul_(d, [a[3] for a in part_aux])
            else:
                torch._foreach_copy_(d, v)
                torch._foreach_sqrt_(d)
                mt.add_tensor_(d, e.to(device=device, dtype=acc))
                torch._foreach_reciprocal_(d)
                torch._foreach_mul_(d, m)
                torch._foreach_mul_(d, [a[0] for a in part_aux])  # c·m/(√v + e)
            if any_wd:
                torch._foreach_addcmul_(d, p, [a[1] for a in part_aux])  # + s·wd·w
            _sgd_(p, d, 1.0, fi)

    def _fresh_moments(self, group, fresh, params, grads, scratch, m_l, v_l, lr, found_inf, aux) -> set[int]:
        """Half-precision chunks of pass 2 (every chunk when pass 1 left the caller's gradients alone): the
        fused Adam kernel updates ``m, v`` (``found_inf`` skips it) and writes ``m̂/(√v̂ + ε)`` into the scratch
        chunks (:func:`_adam_direction_`). Returns the chunk positions that a device without the kernel
        updated completely through the pointwise rule."""
        hyper, t = (float(group["beta1"]), float(group["beta2"]), float(group["epsilon"])), self._t(group)
        whole = len(fresh) == len(params)
        pick = (lambda x: x) if whole else (lambda x: [x[j] for j in fresh])
        lists = (pick(scratch), pick(grads), pick(m_l), pick(v_l), pick(params))
        done: set[int] = set()
        for device, _, mode, ix, (d, g, m, v, w) in self._kernel_parts("adam", lists, (0, 2, 3)):
            fi = None if found_inf is None else found_inf.to(device)
            if mode == "fallback":
                self._pointwise_fallback(group, w, g, [m, v], lr, None, fi, [aux[fresh[i]] for i in ix])
                done.update(fresh[i] for i in ix)
                continue
            _adam_direction_(d, g, m, v, t.to(device), hyper, None, fi)
        return done
