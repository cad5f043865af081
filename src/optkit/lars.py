"""LARS: layer-wise adaptive rate scaling (``tf.contrib.opt.LARSOptimizer``; You et al. 2017).

For each parameter ``w`` with gradient ``g`` (``‖·‖`` the L2 norm of all elements)::

    trust = eeta·‖w‖ / (‖g‖ + weight_decay·‖w‖ + epsilon)   if ‖w‖ > 0 and ‖g‖ > 0, else 1
    s     = learning_rate · trust

TF 1.15 (``variant="tf1.15"``, the default; "classic" momentum, the slot holds lr-scaled velocities)::

    u = s·(g + weight_decay·w);   a ← m·a + u;   w ← w − a          (Nesterov: w ← w − u − m·a)

TF 1.11–1.14 (``variant="tf1.14"``; weight decay only enters the trust ratio)::

    a ← m·a + g;   w ← w − s·a                                     (Nesterov: w ← w − s·g − s·m·a)

A parameter whose name contains one of the ``skip_list`` strings (plain substring, as TF) — or, with
``exclude_1d=True``, any parameter with at most one dimension (biases, norm scales) — uses ``trust = 1`` and
no weight decay. Sparse gradients take plain momentum with the base learning rate on the de-duplicated
touched rows (no trust ratio, no decay, untouched rows keep their accumulators), in both variants.

Implementation (the point is speed): all per-tensor norms come from two read-only grouped passes
(``_multi_tensor.norms``) in :meth:`LARS._prepare`; the trust ratios and every per-tensor factor are formed on
stacked vectors (no host sync, no per-parameter Python arithmetic). The elementwise part then runs block by
block over cache-sized chunks (the base's blocked pass): for TF 1.15 ``g ← s·k·g + s·wd·w`` (two in-cache
foreach kernels) and torch's fused SGD kernel with ``lr = 1`` (``a ← m·a + u; w ← w − a``) which also takes
``found_inf``, so a skipped step changes nothing. Blocks of at most four chunks (large tensors) write
``u = s·k·(g + (wd/k)·w)`` instead: one in-cache pass adds the decay, and the kernel takes ``s·k`` as
``grad_scale = 1/(s·k)`` (it divides the gradient first); float32 and narrower only, since the kernel's
``grad_scale`` is float32. Main memory sees the two norm passes plus one update sweep. These kernels use the
gradient chunks as scratch; unless ``scratch_grads=True`` (the train op) the base hands them in-cache copies
of the chunks, so ``p.grad`` is left as ``torch.optim`` leaves it at no extra traffic.

Off the CPU (CUDA) nothing is in cache and every launch counts. Over a flat buffer
(:func:`optkit.flat_parameters`) the per-tensor factors go over the buffer as element vectors
(:meth:`optkit._core.plan.FlatPart.expand_segments`: ``torch.repeat_interleave`` of the factor vector by the
parameters' sizes), so a step is a fixed number of kernels whatever the number and sizes of the parameters:
the norms (one grouped norm call and one stack, or one row norm per run of equal sizes), the trust ratios as
vector arithmetic, one expansion of ``s``, ``u = (k·g + wd·w)·S`` in two elementwise kernels into a new buffer
(a second expansion, of ``s·wd``, when some parameters skip the decay) and the fused momentum kernel. Over
separate tensors the decay is one multi-tensor call and the factor ``s`` one multi-tensor multiply by ``s``
expanded into an element vector kept with the group, whose views have the tensors' shapes and strides
(:class:`optkit._multi_tensor.ElementFactors`: torch's multi-tensor route takes no list of 0-d factors in one
launch; about 16 B per element more than over a flat buffer). Half-precision tensors keep one multiply per
tensor there (their factor stays float32). Either way the
gradients only take ``k·g`` (what the fused kernels' ``grad_scale`` leaves), so no copies of them are made.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from typing_extensions import Unpack

from . import _multi_tensor as mt
from ._core.chain import norm_sums
from ._core.compiled import COMPILE_WARN_TENSORS
from ._core.plan import RunAux, SegmentAux
from ._core.traits import Traits
from .momentum import sparse_momentum_rows_
from .optimizer import (
    LearningRate,
    Optimizer,
    OptimizerOptions,
    ParamsT,
    check_nesterov,
    check_number,
)

__all__ = ["LARS"]

_VARIANTS = ("tf1.15", "tf1.14")
_SCALE_IN_KERNEL = 4  # blocks of at most this many chunks pass s·k to the fused kernel as 1/grad_scale


def _cat(ts: list[Tensor]) -> Tensor:
    """``torch.cat`` (no copy of a single tensor)."""
    return ts[0] if len(ts) == 1 else torch.cat(ts)


def _cpu_forms(device: torch.device) -> bool:
    """Whether a block of whole tensors with per-tensor factors takes the CPU's forms (two multi-tensor calls
    with per-tensor 0-d factors, each chunk in cache) rather than the device forms (one per-tensor call, the
    rest multi-tensor calls that take one launch): on the CPU. Tests route CPU tensors through the device
    forms by patching this function."""
    return device.type == "cpu"


def _fused(params, grads, bufs, *, weight_decay, momentum, lr, nesterov, found_inf, grad_scale=None) -> None:
    """``torch._fused_sgd_`` with dampening 0 (``bufs`` empty: no momentum buffer); callers are inside the
    optimizer's fused-kernel gate. The kernel divides the gradient by ``grad_scale`` before anything else."""
    torch._fused_sgd_(
        params, grads, bufs,
        weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=0.0, nesterov=nesterov,
        maximize=False, is_first_step=False, grad_scale=grad_scale, found_inf=found_inf,
    )


def _momentum_step(p, u, a, m, nesterov, found_inf, grad_scale=None) -> None:
    """``a ← m·a + u``; ``p ← p − a`` (Nesterov ``p ← p − u − m·a``), with ``u`` the given gradient divided
    by ``grad_scale``; nothing changes when found_inf is 1."""
    if m != 0.0:
        _fused(p, u, a, weight_decay=0.0, momentum=m, lr=1.0, nesterov=nesterov, found_inf=found_inf,
               grad_scale=grad_scale)
        return
    # m == 0: a ← u (TF keeps the slot) and p ← p − u
    if grad_scale is not None:  # (whether a kernel stores the divided gradient back differs by device)
        torch._foreach_div_(u, grad_scale)
    _fused(a, u, [], weight_decay=-1.0, momentum=0.0, lr=-1.0, nesterov=False, found_inf=found_inf)
    _fused(p, u, [], weight_decay=0.0, momentum=0.0, lr=1.0, nesterov=False, found_inf=found_inf)


def _accumulate(a, g, m, found_inf) -> None:
    """``a ← m·a + g`` (as ``a + (g + (m − 1)·a)``); unchanged when found_inf is 1."""
    _fused(a, g, [], weight_decay=m - 1.0, momentum=0.0, lr=-1.0, nesterov=False, found_inf=found_inf)


def _subtract(p, d, found_inf) -> None:
    """``p ← p − d``; unchanged when found_inf is 1."""
    _fused(p, d, [], weight_decay=0.0, momentum=0.0, lr=1.0, nesterov=False, found_inf=found_inf)


def _lars_pointwise(hyper, w, g, slots, lr, k, aux):
    """Out-of-place LARS step for ``jit_compile`` (``aux`` as in ``LARS._prepare``; true gradient k·g)."""
    momentum, nesterov, variant = hyper
    a = slots[0]
    if len(aux) == 3:  # element vectors over a flat part (LARS._segment_aux, cut to this chunk), for k·g
        f, f2, c = aux
        if variant == "tf1.15":
            gk = g if k is None else g * k
            if c is not None:
                u = (gk + w * c) * f
            else:
                u = gk * f if f2 is None else gk * f + w * f2
            a_new = a * momentum + u
            return w - (u + a_new * momentum if nesterov else a_new), [a_new]
        aux = (f, f * momentum)
    if variant == "tf1.15":
        sk, sw = aux
        u = g * sk + w * sw
        a_new = a * momentum + u
        step = u + a_new * momentum if nesterov else a_new
        return w - step, [a_new]
    s, sm = aux
    gk = g if k is None else g * k
    a_new = a * momentum + gk
    step = gk * s + a_new * sm if nesterov else a_new * s
    return w - step, [a_new]


class LARS(Optimizer):
    """Layer-wise adaptive rate scaling with the TF1 contrib semantics (TF 1.15 by default).

    Args:
        params: tensors, ``model.named_parameters()`` (needed for ``skip_list``) or param groups.
        learning_rate: the base learning rate (number, schedule or callable; required, or torch's ``lr=``).
        momentum: momentum ``m >= 0`` (default 0.9).
        weight_decay: LARS's own weight decay (``>= 0``, default 1e-4): in the trust-ratio denominator,
            and for TF 1.15 added to the gradient. It is not the base class's decoupled decay.
        eeta: the LARS coefficient (default 0.001); ``eeta/weight_decay`` bounds the trust ratio. TF's name,
            kept: timm's ``trust_coeff`` and apex's ``trust_coefficient`` are refused with a hint to it.
        epsilon: added to the trust-ratio denominator (default 0.0).
        skip_list: strings; a parameter whose name contains one of them gets no trust scaling and no decay.
        nesterov: Nesterov momentum (torch's and Keras's name; TF1's ``use_nesterov`` is accepted for it).
        variant: ``"tf1.15"`` (classic momentum, decay on the gradient) or ``"tf1.14"`` (the earlier form).
        exclude_1d: also skip every parameter with ``ndim <= 1`` (biases and normalisation scales).
        **kwargs: base options (``lr``, clipnorm, clipvalue, global_clipnorm, use_ema, ema_momentum,
            ema_overwrite_frequency, jit_compile, mesh, name): :class:`~optkit.optimizer.OptimizerOptions`.

    ``params`` and the learning rate are the only positional arguments: ``LARS(params, 0.1, momentum=0.9)``.

    Raises:
        ValueError: negative ``momentum`` or ``weight_decay``, or an unknown ``variant``.

    References: You, Gitman, Ginsburg, "Large Batch Training of Convolutional Networks" (arXiv:1708.03888);
    ``tf.contrib.opt.LARSOptimizer`` (TF 1.14 and 1.15).
    """

    slot_names = ("momentum",)
    #: torch's name of this option: refused in a param group, which would ignore it
    _torch_group_keys = {"eps": ("epsilon",)}
    traits = Traits(decoupled_weight_decay=False, blocks="always", sparse=True, prepare_reads_grads=True)

    def __init__(
        self,
        params: ParamsT,
        learning_rate: LearningRate | None = None,
        *,
        momentum: float = 0.9,
        weight_decay: float = 0.0001,
        eeta: float = 0.001,
        epsilon: float = 0.0,
        skip_list: Sequence[str] | None = None,
        nesterov: bool = False,
        use_nesterov: bool | None = None,
        variant: str = "tf1.15",
        exclude_1d: bool = False,
        **kwargs: Unpack[OptimizerOptions],
    ) -> None:
        check_number("momentum", momentum)
        if momentum < 0.0:
            raise ValueError(f"momentum should be positive: {momentum}")
        check_number("weight_decay", weight_decay)
        if weight_decay < 0.0:
            raise ValueError(f"weight_decay should be positive: {weight_decay}")
        check_number("eeta", eeta, low=0.0)
        check_number("epsilon", epsilon, low=0.0)
        if skip_list is not None:
            if isinstance(skip_list, str) or not all(isinstance(x, str) for x in skip_list):
                raise TypeError(f"`skip_list` must be a list of strings, got {skip_list!r}")
            skip_list = list(skip_list)
        nesterov = check_nesterov(nesterov, use_nesterov)
        if variant not in _VARIANTS:
            raise ValueError(f"`variant` must be one of {_VARIANTS}, got {variant!r}")
        if not isinstance(exclude_1d, bool):
            raise TypeError(f"`exclude_1d` must be a bool, got {exclude_1d!r}")
        if "weight_decay" in kwargs:  # pragma: no cover - guarded by the signature
            raise TypeError("`weight_decay` given twice")
        self._static_cache: dict = {}
        self._inv_cache: dict = {}  # id(s·k) -> (s·k, 1/(s·k)) within one step (see _update)
        super().__init__(
            params, learning_rate, weight_decay=float(weight_decay), momentum=float(momentum),
            eeta=float(eeta), epsilon=float(epsilon), skip_list=skip_list, nesterov=nesterov,
            variant=variant, exclude_1d=exclude_1d, **kwargs,
        )
        if not self._named and any(g["skip_list"] for g in self.param_groups):
            raise ValueError(
                "LARS: `skip_list` matches parameter names, but the parameters came without names (they "
                "would all be called param_<i> and nothing would be skipped); pass model.named_parameters()"
            )

    # ------------------------------------------------------------------------------------------------ config

    def _hyper_config(self) -> dict:
        d = self.defaults
        return {
            "momentum": d["momentum"], "eeta": d["eeta"], "epsilon": d["epsilon"],
            "skip_list": None if d["skip_list"] is None else list(d["skip_list"]),
            "nesterov": d["nesterov"], "variant": d["variant"], "exclude_1d": d["exclude_1d"],
        }

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_static_cache"] = {}
        state["_inv_cache"] = {}
        return state

    def _pointwise_hyper(self, group: dict) -> tuple:
        return (float(group["momentum"]), bool(group["nesterov"]), group["variant"])

    _pointwise = staticmethod(_lars_pointwise)

    # ------------------------------------------------------------------------------------------------ rule

    def _skipped(self, group: dict, name: str, p: Tensor) -> bool:
        if group["exclude_1d"] and p.ndim <= 1:
            return True
        skip_list = group["skip_list"]
        return skip_list is not None and any(s in name for s in skip_list)

    def _static(self, group: dict, plan, params: list[Tensor], dev, dtype) -> tuple:
        """Per-group facts that only change with the plan (the parameter set) or the options: which tensors
        skip LARS, their indices and mask, and the per-tensor weight-decay vector (cached per plan)."""
        skip_list = group["skip_list"]
        key = (id(plan), None if skip_list is None else tuple(skip_list), group["exclude_1d"],
               group["weight_decay"], dev, dtype)
        hit = self._static_cache.get(id(group))
        if hit is not None and hit[0] == key and hit[2] is plan:
            return hit[1]
        skipped = [self._skipped(group, nm, p) for nm, p in zip(plan.names, params)]
        adapt = [i for i, sk in enumerate(skipped) if not sk]
        wd = float(group["weight_decay"])
        wd_vec = torch.tensor([0.0 if sk else wd for sk in skipped], dtype=dtype, device=dev)
        index = torch.tensor(adapt, dtype=torch.long, device=dev)
        mask = torch.tensor([not sk for sk in skipped], dtype=torch.bool, device=dev)
        value = (adapt, len(adapt) == len(params), index, wd_vec, mask, [0.0 if sk else wd for sk in skipped])
        self._static_cache[id(group)] = (key, value, plan)
        return value


    def _prepare(self, group, plan, params, grads, lr, k) -> list:
        """Per-tensor factors as 0-d tensors: ``(s·k, s·wd)`` for TF 1.15, ``(s, s·m)`` for TF 1.14, with
        ``s = lr·trust``. One grouped norm call (two read-only passes: weights and gradients), stacked
        vector arithmetic, no host sync."""
        n = len(params)
        self._inv_cache.clear()
        dev = mt.local(params[0]).device
        dtype = torch.float64 if mt.local(params[0]).dtype == torch.float64 else torch.float32
        if not plan.flat_active:
            dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
        adapt, all_adapt, index, wd_vec, mask, _ = self._static(group, plan, params, dev, dtype)
        lr = lr.to(device=dev, dtype=dtype)
        # off the CPU a flat part takes its factors as element vectors (O(1) kernels for any sizes)
        segments = plan.flat_active and plan.flat.expands() and not self._jit_active()
        if plan.flat_active and plan.flat.rows_pay:
            if segments:
                s = self._row_scales(group, plan.flat, lr, k, dtype, adapt, all_adapt, mask)
                return self._segment_aux(group, plan.flat, s, all_adapt, wd_vec)
            return self._prepare_rows(group, plan.flat, lr, k, dtype, adapt, all_adapt, wd_vec, mask)
        if adapt:
            sel_p = params if all_adapt else [params[i] for i in adapt]
            sel_g = grads if all_adapt else [grads[i] for i in adapt]
            # (jit_compile's compiled norm pass; update_step's light plan has no any_dtensor: eager norms)
            call = None if getattr(plan, "any_dtensor", True) else self._compiled_pass(norm_sums, len(sel_p))
            sums = None if call is None else call(sel_p, sel_g)
            if sums is not None:  # (‖w_1‖, …, ‖w_m‖, ‖g_1‖, …, ‖g_m‖)
                v = sums.sqrt().to(device=dev, dtype=dtype).t().reshape(-1)
            else:
                ns = mt.norms(sel_p + sel_g)
                if len({(x.device, x.dtype) for x in ns}) == 1:
                    v = mt.stack_scalars(ns).to(device=dev, dtype=dtype)
                else:
                    v = torch.stack([x.to(device=dev, dtype=dtype) for x in ns])
            m = len(sel_p)
            w_n, g_n = v[:m], v[m:]
            if k is not None:
                g_n = g_n * k.to(device=dev, dtype=dtype).abs()
            wd = float(group["weight_decay"])
            ratio = group["eeta"] * w_n / (g_n + wd * w_n + group["epsilon"])
            t = torch.where((w_n > 0) & (g_n > 0), ratio, torch.ones_like(ratio))
            trust = t if all_adapt else torch.ones(n, dtype=dtype, device=dev).index_copy_(0, index, t)
            s = lr * trust
        else:
            s = lr.expand(n)
        if segments:
            return self._segment_aux(group, plan.flat, s, all_adapt, wd_vec)
        if group["variant"] == "tf1.15":
            sk = s if k is None else s * k.to(device=dev, dtype=dtype)
            return list(zip(sk.unbind(), (s * wd_vec).unbind()))
        return list(zip(s.unbind(), (s * float(group["momentum"])).unbind()))

    def _segment_aux(self, group, flat, s, all_adapt, wd_vec) -> list:
        """The factors over a flat part as element vectors (:meth:`optkit._core.plan.FlatPart.
        expand_segments`), one :class:`~optkit._core.plan.SegmentAux` for every parameter, so that the base
        steps the flat part as one tensor; they apply to the true gradient ``k·g``. TF 1.15: ``(S, None,
        wd)`` with ``S`` the expanded ``s`` and ``u = (k·g + wd·w)·S`` when every parameter is decayed alike
        (one vector expanded), else ``(S, F2, None)`` with ``F2`` the expanded ``s·wd``
        (``u = S·k·g + F2·w``); TF 1.14: ``(S, None, None)``. Extra memory traffic per element, fp32: the
        expansion (about 12 bytes on CUDA: an int32 index, read again, and the vector) plus one read of it
        per use."""
        base = flat.blocks[0].params[0].storage_offset()
        f, f2, c = flat.expand_segments(s), None, None
        wd = float(group["weight_decay"])
        if group["variant"] == "tf1.15" and wd != 0.0:
            if all_adapt:
                c = wd
            else:
                f2 = flat.expand_segments(s * wd_vec)
        return [SegmentAux((f, f2, c), base)] * len(flat.numels)

    def _row_scales(self, group, flat, lr, k, dtype, adapt, all_adapt, mask) -> Tensor:
        """``s = lr·trust`` for every parameter of a flat part from the row norms of its runs (one kernel
        per run and list)."""
        if not adapt:
            return lr.expand(len(flat.numels))
        w_n = _cat([torch.linalg.vector_norm(m, dim=1, dtype=dtype) for m in flat.params_rows()])
        g_n = _cat([torch.linalg.vector_norm(m, dim=1, dtype=dtype) for m in flat.row_views(flat.grad)])
        if k is not None:
            g_n = g_n * k.to(device=lr.device, dtype=dtype).abs()
        wd = float(group["weight_decay"])
        ratio = group["eeta"] * w_n / (g_n + wd * w_n + group["epsilon"])
        ok = (w_n > 0) & (g_n > 0)
        if not all_adapt:
            ok = ok & mask
        return lr * torch.where(ok, ratio, torch.ones_like(ratio))

    def _prepare_rows(self, group, flat, lr, k, dtype, adapt, all_adapt, wd_vec, mask) -> RunAux:
        """:meth:`_prepare` over a flat buffer's runs (:class:`optkit._core.plan.FlatPart`): per-parameter
        norms as row norms of the run matrices (one kernel per run, no per-parameter work), the factors as
        ``(rows, 1)`` columns per row chunk, or per whole run under ``jit_compile`` (the compiled rule then
        steps each run matrix in one loop)."""
        dev = lr.device
        s = self._row_scales(group, flat, lr, k, dtype, adapt, all_adapt, mask)
        if group["variant"] == "tf1.15":
            c1 = s if k is None else s * k.to(device=dev, dtype=dtype)
            c2 = s * wd_vec
        else:
            c1, c2 = s, s * float(group["momentum"])
        c1, c2 = c1.unsqueeze(1), c2.unsqueeze(1)
        if self._jit_active() and len(flat.runs) <= COMPILE_WARN_TENSORS:
            # the compiled rule over whole runs (past that many runs, compiling would take minutes: the
            # eager row chunks below)
            return RunAux([(c1[a:a + m], c2[a:a + m]) for a, m in flat.run_segments()], per_run=True)
        return RunAux([(c1[lo:hi], c2[lo:hi]) for lo, hi in flat.chunk_segments])

    def _update(self, group, params, grads, slots, lr, k, found_inf, aux) -> None:
        m = float(group["momentum"])
        nesterov = bool(group["nesterov"])
        b15 = group["variant"] == "tf1.15"
        lists = (params, grads, slots["momentum"])
        if aux and isinstance(aux[0], SegmentAux):  # element vectors over a flat part: whole-chunk kernels
            self._update_segments(group, lists, lr, k, found_inf, [x.chunk(t) for x, t in zip(aux, params)])
            return
        for device, dtype, ix, (p, g, a), fi in self._fused_parts("sgd", group, lists, lr, k, found_inf, aux,
                                                                  (0, 2)):
            part_aux = aux if len(ix) == len(params) else [aux[i] for i in ix]
            f1, f2 = (list(x) for x in zip(*part_aux))  # (s·k, s·wd) for TF 1.15, (s, s·m) for TF 1.14
            if b15 and len(p) <= _SCALE_IN_KERNEL and self._block is not None and dtype != torch.float64 \
                    and f1[0].dim() == 0 and _cpu_forms(device):  # (not a flat buffer's (rows, 1) columns)
                # chunks of a few large tensors: u = s·k·(g + (wd/k)·w), the decay added in cache and s·k
                # taken by the kernel as 1/grad_scale (one in-cache pass fewer than the form below)
                wd_of = self._static_cache[id(group)][1][5]
                kinv = None if k is None else torch.reciprocal(k.to(device=device, dtype=torch.float32))
                for j, o in enumerate(self._block.owners if len(ix) == len(params) else
                                      [self._block.owners[i] for i in ix]):
                    wd = wd_of[o]
                    if wd != 0.0:
                        if kinv is None:
                            g[j].add_(p[j], alpha=wd)
                        else:
                            g[j].addcmul_(p[j], (kinv * wd).to(g[j].dtype))
                    inv = self._inv_cache.get(id(f1[j]))  # (a tensor's chunks share its factor)
                    if inv is None or inv[0] is not f1[j]:
                        inv = (f1[j], torch.reciprocal(f1[j].to(device=device, dtype=torch.float32)))
                        self._inv_cache[id(f1[j])] = inv
                    _momentum_step(p[j:j + 1], g[j:j + 1], a[j:j + 1], m, nesterov, fi, inv[1])
            elif b15 and not _cpu_forms(device):
                # off the CPU (one block of whole tensors; the gradients only take k·g): u = s·(k·g + wd·w),
                # the decay in one multi-tensor call over the decayed tensors into new buffers, then one
                # multiply by s expanded to the elements (mt.ElementFactors; per tensor for half precision),
                # then the fused momentum pass
                s_ = f1
                if k is not None:
                    kd = k.to(device=device, dtype=dtype)
                    torch._foreach_mul_(g, kd)
                    s_ = torch._foreach_div(f1, k.to(device=device, dtype=f1[0].dtype))  # (one launch)
                wd_of = self._static_cache[id(group)][1][5]
                owners = self._block.owners if self._block is not None else list(range(len(params)))
                if len(ix) != len(params):
                    owners = [owners[i] for i in ix]
                dec = [j for j, o in enumerate(owners) if wd_of[o] != 0.0]
                h = list(g)
                if dec:
                    hd = torch._foreach_add([g[j] for j in dec], [p[j] for j in dec],
                                            alpha=float(group["weight_decay"]))
                    for j, t in zip(dec, hd):
                        h[j] = t
                ef = mt.ElementFactors.cached(self._factor_cache, id(group), h)
                u = ef.mul(h, s_) if ef is not None else torch._foreach_mul(h, s_)
                _momentum_step(p, u, a, m, nesterov, fi)
            elif b15:
                # u = s·k·g + s·wd·w (in cache), then a ← m·a + u; w ← w − a (or − u − m·a) in one fused pass
                torch._foreach_mul_(g, f1)
                torch._foreach_addcmul_(g, p, f2)
                _momentum_step(p, g, a, m, nesterov, fi)
            elif not _cpu_forms(device):
                # off the CPU (the gradients only take k·g): one per-tensor call, into new buffers
                if k is not None:
                    torch._foreach_mul_(g, k.to(device=device, dtype=dtype))
                _accumulate(a, g, m, fi)
                ef = mt.ElementFactors.cached(self._factor_cache, id(group), a)
                if nesterov:  # step = (k·g + m·a)·s
                    step = torch._foreach_add(g, a, alpha=m)
                    if ef is not None:
                        ef.mul_(step, f1)
                    else:
                        torch._foreach_mul_(step, f1)
                else:  # step = s·a
                    step = ef.mul(a, f1) if ef is not None else torch._foreach_mul(a, f1)
                _subtract(p, step, fi)
            else:
                if k is not None:
                    torch._foreach_mul_(g, k.to(device))
                _accumulate(a, g, m, fi)
                if nesterov:  # step = s·g + s·m·a
                    torch._foreach_mul_(g, f1)
                    torch._foreach_addcmul_(g, a, f2)
                else:  # step = s·a
                    torch._foreach_copy_(g, a)
                    torch._foreach_mul_(g, f1)
                _subtract(p, g, fi)

    def _update_segments(self, group, lists, lr, k, found_inf, aux) -> None:
        """:meth:`_update` with :meth:`_segment_aux`'s element vectors cut to the chunks (one chunk of the
        flat buffer off the CPU). The gradient only takes ``k·g`` (what the fused kernels leave); TF 1.15
        ``u = (k·g + wd·w)·S`` (or ``S·k·g + F2·w``) in two elementwise kernels into a new buffer, then the
        fused momentum kernel; TF 1.14 ``a ← m·a + k·g`` (fused), ``step = S·a`` in one kernel (Nesterov
        ``(k·g + m·a)·S`` in two), ``w ← w − step`` (fused)."""
        m = float(group["momentum"])
        nesterov = bool(group["nesterov"])
        for device, dtype, ix, (p, g, a), fi in self._fused_parts("sgd", group, lists, lr, k, found_inf, aux,
                                                                  (0, 2)):
            part = [aux[i] for i in ix]
            if k is not None:  # k·g, as the fused kernels' grad_scale leaves it
                torch._foreach_mul_(g, k.to(device=device, dtype=dtype))
            if group["variant"] == "tf1.15":
                u = []
                for pj, gj, (f, f2, c) in zip(p, g, part):
                    if c is not None:
                        uj = torch.add(gj, pj, alpha=c).mul_(f)
                    else:
                        uj = gj * f
                        if f2 is not None:
                            uj.addcmul_(pj, f2)
                    u.append(uj)
                _momentum_step(p, u, a, m, nesterov, fi)
                continue
            _accumulate(a, g, m, fi)
            step = [torch.add(gj, aj, alpha=m).mul_(f) if nesterov else aj * f  # (k·g + m·a)·S, or S·a
                    for aj, gj, (f, _, _) in zip(a, g, part)]
            _subtract(p, step, fi)

    def _update_writes_grads(self, group: dict) -> bool:
        """Off the CPU (:func:`_cpu_forms`) the rule writes nothing but ``k·g`` into the gradients (its
        ``u`` goes into new buffers), so the base makes no copies of them (a whole extra pass there); on
        the CPU it runs in in-cache copies of the gradient chunks."""
        ps = group["params"]
        return not ps or _cpu_forms(mt.local(ps[0]).device)

    def _sparse_update(self, group, params, grads, slots, lr, k, found_inf) -> None:
        """Plain momentum with the base learning rate on the touched rows of coalesced sparse gradients
        (``a[r] ← m·a[r] + g[r]``; ``w[r] ← w[r] − lr·a[r]``, Nesterov
        ``w[r] ← w[r] − lr·g[r] − lr·m·a[r]``)."""
        m = float(group["momentum"])
        nesterov = bool(group["nesterov"])
        skip = None if found_inf is None else found_inf > 0.5
        for p, g, a in zip(params, grads, slots["momentum"]):
            sparse_momentum_rows_(p, g, a, m, nesterov, lr, k, skip)
