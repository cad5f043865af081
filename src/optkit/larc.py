"""``LARC``: layer-wise adaptive rate control around any optimizer (OpenSeq2Seq ``larc_params``).

The original is ``post_process_gradients`` in OpenSeq2Seq's ``open_seq2seq/optimizers/optimizers.py``, after
You, Gitman & Ginsburg, "Large Batch Training of Convolutional Networks" (2017, arXiv:1708.03888).

Before the inner step every gradient ``g`` of a parameter ``v`` is multiplied by a trust ratio ``r`` computed
from whole-tensor L2 norms (fp32) and the inner optimizer's **current** learning rate ``lr`` of its group:

* ``larc_mode="clip"``:  ``r = min(max(η‖v‖ / (lr·(‖g‖ + ε)), min_update), 1)`` — the effective rate
  ``lr·r = min(lr, η‖v‖/(‖g‖+ε))``, floored at ``lr·min_update``; with ``lr == 0`` (a warm-up step) ``r = 1``
  (the original divided by zero and produced NaN for zero-norm variables);
* ``larc_mode="scale"``: ``r = max(η‖v‖ / (‖g‖ + ε), min_update)`` (LARS, no lr and no upper bound).

Options beyond the original (see docs/compatibility.md):

* ``exclude(name, param) -> bool``: parameters for which it returns True keep ``r = 1`` (e.g. biases and
  normalisation weights: ``exclude=lambda n, p: p.ndim <= 1``). Evaluated once per parameter (tensor
  identity, not position: when a group's parameter list changes, only the parameters new to it are
  evaluated); names come from ``named_parameters()`` groups (``param_names``), else ``"param_<i>"``.
* ``wd_in_denominator=wd`` (the apex ``LARC`` / timm ``Lars`` form): the gradient becomes
  ``r·(g + wd·v)`` with ``r`` computed as above but with ``‖g‖ + wd·‖v‖`` in place of ``‖g‖``, and ``r = 1``
  where ``‖v‖ = 0`` or ``‖g‖ = 0`` (timm). Give the inner optimizer no weight decay of its own then.

Performance: one grouped norm pass over the parameters and one over the gradients, the ratios computed as one
vector (no host sync, no per-parameter Python arithmetic). With an optkit inner optimizer built with
``jit_compile=True`` the norms come from one compiled read-only pass that reads each weight and its gradient
in the same loop (:func:`optkit._core.chain.norm_sums`, as LARS's ``jit_compile``; the eager norms if it fails
to compile). optkit inner optimizers receive the ratios as ``grad_multipliers`` and fold them into their own
pass (optkit ``SGD`` into its fused kernel's ``grad_scale``, one call per tensor; others as an in-cache
multiply per block; off the CPU, float32/float64 tensors as one multi-tensor multiply by the ratios expanded
to the elements, :class:`optkit._multi_tensor.ElementFactors`, into copies of the gradients unless they are
scratch: a fixed number of kernels per step); other optimizers get the gradients scaled in place. Over flat
buffers (:func:`optkit.flat_parameters`, an optkit inner optimizer whose groups all run over their flat part)
the norms are row norms of the buffer's runs of equal-sized parameters and the ratios go in as one vector per
group (:class:`optkit._core.plan.RowMultipliers`): O(#runs) kernels per step, not O(#params). Off the CPU
(CUDA) the norms of a flat part whose sizes vary come from one grouped norm call, and the inner optimizer
multiplies the flat gradient by the ratios expanded to the elements
(:meth:`optkit._core.plan.FlatPart.expand_segments`) while copying it: a fixed number of kernels per step
whatever the number and sizes of the parameters.
A ``grad_scale`` from an outer loss-scale wrapper is taken into account (``‖g‖`` is the unscaled norm) and
passed on; ``found_inf`` is passed on unchanged.

After each step ``last_params``, ``last_ratios`` and ``last_clip_on`` hold what the step used (device tensors,
for summaries); :meth:`LARC.trust_ratios` computes the ratios for the current gradients without stepping.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from itertools import compress
from typing import Any

import torch
from torch import Tensor

from . import _multi_tensor as mt
from ._core.chain import norm_sums
from ._core.context import StepContext, StepResult
from ._core.plan import FlatPart, RowMultipliers
from ._validation import check_params, check_real
from ._wrapper import OptimizerWrapper, grads_swapped, protocol_level
from .optimizer import Optimizer

__all__ = ["LARC"]

_REQUIRED = {"larc_eta": float}
_OPTIONAL = {"larc_mode": ["clip", "scale"], "min_update": float, "epsilon": float}


class LARC(OptimizerWrapper):
    """OpenSeq2Seq LARC as a wrapper (module doc for the formulas).

    Args:
        opt: the optimizer to wrap.
        larc_eta: trust coefficient η (float, required; strict types as in OpenSeq2Seq: ``1`` is rejected,
            ``1.0`` accepted), ``> 0``.
        larc_mode: ``"clip"`` (default) or ``"scale"``.
        min_update: lower bound of the ratio, float ``>= 0`` (default 1e-7).
        epsilon: added to ``‖g‖``, float ``> 0`` (default 1e-7).
        exclude: optional predicate ``(name, param) -> bool``; True keeps the gradient unscaled.
        wd_in_denominator: ``None`` (OpenSeq2Seq) or a float ``>= 0`` (apex/timm variant).
    """

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        larc_eta: float,
        larc_mode: str = "clip",
        min_update: float = 1e-7,
        epsilon: float = 1e-7,
        *,
        exclude: Callable[[str, Tensor], bool] | None = None,
        wd_in_denominator: float | None = None,
    ) -> None:
        where = "LARC larc_params"
        params = {"larc_eta": larc_eta, "larc_mode": larc_mode, "min_update": min_update, "epsilon": epsilon}
        check_params(params, _REQUIRED, _OPTIONAL, where)
        check_real("larc_eta", larc_eta, where=where, minimum=0.0, min_inclusive=False)
        check_real("min_update", min_update, where=where, minimum=0.0)
        check_real("epsilon", epsilon, where=where, minimum=0.0, min_inclusive=False)
        if exclude is not None and not callable(exclude):
            raise TypeError(f"LARC: `exclude` must be a callable (name, param) -> bool, got {exclude!r}")
        if wd_in_denominator is not None:
            check_real("wd_in_denominator", wd_in_denominator, where="LARC", minimum=0.0)
        super().__init__(opt)
        self.larc_eta = float(larc_eta)
        self.larc_mode = larc_mode
        self.min_update = float(min_update)
        self.epsilon = float(epsilon)
        self.exclude = exclude
        self.wd_in_denominator = None if wd_in_denominator is None else float(wd_in_denominator)
        # set by every step (for summaries): the rescaled parameters, their ratios r (one vector) and, in clip
        # mode, clip_on (1.0 where η‖v‖ < lr·(‖g‖+ε), else 0.0; None in scale mode)
        self.last_params: list[Tensor] = []
        self.last_ratios: Tensor | None = None
        self.last_clip_on: Tensor | None = None
        # per group: (the group's parameters when scanned, keep flags or None when nothing is excluded); the
        # tensors themselves, not positions or ids (a parameter removed from a group shifts the positions; a
        # copy or unpickle has new ids)
        self._scan: list[tuple[list[Tensor], list[bool] | None]] = []
        self._flat_cache: dict[int, tuple] = {}
        self._scan_exclusions()

    @classmethod
    def from_params(cls, opt: torch.optim.Optimizer, larc_params: Mapping[str, Any]) -> LARC:
        """Build from an OpenSeq2Seq ``larc_params`` dict (unknown keys raise ``ValueError``)."""
        check_params(larc_params, _REQUIRED, _OPTIONAL, "LARC larc_params")
        return cls(opt, **dict(larc_params))

    def _scan_exclusions(self) -> None:
        """(Re)build ``_scan`` for the current groups; ``exclude`` is asked only about parameters that were
        in no group at the last scan."""
        if self.exclude is None:
            return
        known = {id(p): k for snap, keep in self._scan  # (alive: the snapshots hold them, ids are unique)
                 for p, k in zip(snap, keep if keep is not None else [True] * len(snap))}
        scan, counter = [], 0
        for g in self.param_groups:
            names = g.get("param_names")
            ps = list(g["params"])
            keep = []
            for pi, p in enumerate(ps):
                name = names[pi] if names is not None and pi < len(names) else f"param_{counter}"
                counter += 1
                k = known.get(id(p))
                keep.append(not self.exclude(name, p) if k is None else k)
            scan.append((ps, None if all(keep) else keep))
        self._scan = scan
        self._flat_cache = {}

    def _exclusions(self) -> list[tuple[list[Tensor], list[bool] | None]] | None:
        """``_scan``, rescanned first when a group's parameter list changed since (one identity comparison
        per parameter at C speed); None without ``exclude``."""
        if self.exclude is None:
            return None
        groups, scan = self.param_groups, self._scan
        if len(scan) != len(groups) or not all(
                len(snap) == len(g["params"]) and all(map(operator.is_, snap, g["params"]))
                for (snap, _), g in zip(scan, groups)):
            self._scan_exclusions()
        return self._scan

    def _remap_params(self, mapping: dict[int, Tensor]) -> None:
        self._scan = [([mapping.get(id(p), p) for p in snap], keep) for snap, keep in self._scan]
        self._flat_cache = {}
        super()._remap_params(mapping)

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_flat_cache"] = {}  # (keyed by list ids)
        return state

    def __setstate__(self, state: dict) -> None:
        excluded = state.pop("_excluded", None)  # pickled by an earlier optkit: (group, position) pairs
        state.pop("_scanned", None)
        super().__setstate__(state)
        if "_scan" not in state:
            self._scan = []
            if self.exclude is not None:
                excluded = excluded or set()
                for gi, g in enumerate(self.param_groups):
                    keep = [(gi, pi) not in excluded for pi in range(len(g["params"]))]
                    self._scan.append((list(g["params"]), None if all(keep) else keep))
            self._flat_cache = {}

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._scan_exclusions()

    # ------------------------------------------------------------------------------------------------ step

    def _select(self, dev: torch.device) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """The parameters LARC rescales this step (with a gradient, not excluded), their gradients
        (sparse ones densified in place) and the per-group learning-rate vectors."""
        params, grads, lrs = [], [], []
        scan = self._exclusions()
        for gi, group in enumerate(self.param_groups):
            sel = []
            keep = None if scan is None else scan[gi][1]
            for p in group["params"] if keep is None else compress(group["params"], keep):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:  # OpenSeq2Seq densifies: duplicates are summed
                    p.grad = p.grad.coalesce().to_dense()
                sel.append(p)
            if sel:
                lr = self._group_lr(group, dev)
                params += sel
                grads += [p.grad for p in sel]
                lrs.append(lr.expand(len(sel)))
        return params, grads, lrs

    @torch.no_grad()
    def trust_ratios(
        self, grad_scale: Tensor | None = None, multipliers: dict | None = None
    ) -> tuple[list[Tensor], Tensor]:
        """Look-ahead: ``(params, r)``, the parameters the next step would rescale and their trust ratios
        for the current gradients (``grad_scale``/``multipliers`` as the step protocol's). Read-only (one norm
        pass); the step computes the same values again."""
        dev = self._device()
        params, grads, lrs = self._select(dev)
        if not params:
            return [], torch.ones(0, dtype=torch.float32, device=dev)
        return params, self._ratios(params, grads, torch.cat(lrs), grad_scale, multipliers, dev)

    def _wrapped_step(self, context: StepContext) -> StepResult:
        grad_scale, multipliers = context.grad_scale, context.multipliers
        dev = self._device()
        found = None if multipliers else self._flat_parts()
        if found is not None:
            return self._flat_step(*found, context, dev)
        params, grads, lrs = self._select(dev)
        if not params:
            return self._delegate(context)
        ratios = self._ratios(params, grads, torch.cat(lrs), grad_scale, multipliers, dev)
        self.last_params, self.last_ratios = params, ratios
        ids = {id(p) for p in params}
        rest = {i: m for i, m in (multipliers or {}).items() if i not in ids}  # excluded parameters
        outer = self._mult_vector(params, multipliers, dev)
        swapped: list[tuple[Tensor, Tensor]] = []
        if self.wd_in_denominator is not None:
            # apex/timm: the gradient becomes r·(g + wd·v); g + wd·v is materialised in copies that stand in
            # for .grad during the inner step (the caller's gradients are left, unscaled: see the base's
            # ``scratch_grads``)
            if grad_scale is not None:
                _, all_grads = self._params_with_grads()
                mt.scale_(all_grads, mt.inverse_scale(grad_scale, all_grads, dev))
                grad_scale = None
            copies = mt.scaled_copies(grads, torch.ones((), device=dev))
            if outer is not None:
                mt.scale_(copies, list(outer.unbind()))
            mt.add_scaled_(copies, params, self.wd_in_denominator)
            swapped = list(zip(params, copies))
            factors = ratios
        else:
            factors = ratios if outer is None else ratios * outer
        # the ratios reach the inner optimizer as multipliers (an optkit one folds them into its pass, any
        # other steps on multiplied copies: _delegate), never the caller's gradients
        mult = {**rest, **dict(zip((id(p) for p in params), factors.unbind()))}
        with grads_swapped(swapped):
            return self._delegate(context.inward(grad_scale=grad_scale, multipliers=mult or None))

    # -------------------------------------------------------------------------------------- flat buffers

    def _flat_parts(self) -> tuple[list[tuple[int, dict, FlatPart]], dict] | None:
        """``([(group index, group, flat part)], gathered)`` for every group with parameters when the inner
        optimizer is an optkit optimizer whose groups all run over flat buffers this step
        (:func:`optkit.flat_parameters`, every parameter with its gradient view), with what it read of the
        groups (for the step to reuse); else None (the per-tensor path)."""
        inner = self.optimizer
        if not isinstance(inner, Optimizer):
            return None
        if self.wd_in_denominator is not None and not inner.scratch_grads:
            return None  # (g + wd·v would go into the caller's flat gradient: the per-tensor path's copies)
        out, seen = [], {}
        for gi, group in enumerate(self.param_groups):
            if not group["params"]:
                continue
            fp = inner.engine.flat_part(group, seen)
            if fp is None:
                return None
            out.append((gi, group, fp))
        return (out, seen) if out else None

    def _flat_keep(self, gi: int, group: dict, dev: torch.device) -> tuple:
        """Per group (cached until the parameters or exclusions change): ``(mask, params, index)``, the
        boolean keep mask over the group's parameters (None when nothing is excluded), the parameters LARC
        rescales, and their indices."""
        ps = group["params"]
        entry = None if self.exclude is None else self._scan[gi]  # (current: _flat_step checked it)
        key = (id(ps), len(ps), dev)
        hit = self._flat_cache.get(gi)
        if hit is not None and hit[0] == key and hit[1] is entry:
            return hit[2]
        keep = [True] * len(ps) if entry is None or entry[1] is None else entry[1]
        mask = None if all(keep) else torch.tensor(keep, device=dev)
        index = torch.tensor([i for i, kp in enumerate(keep) if kp], dtype=torch.long, device=dev)
        value = (mask, [p for p, kp in zip(ps, keep) if kp], index)
        self._flat_cache[gi] = (key, entry, value)
        return value

    def _flat_step(self, parts, seen, context: StepContext, dev) -> StepResult:
        """The step over flat buffers: per-parameter norms as row norms of the flat part's runs (one kernel
        per run), the ratios as one vector per group, handed to the inner optimizer as
        :class:`~optkit._core.plan.RowMultipliers` (it multiplies each cache-sized row chunk by its column
        just before its update)."""
        grad_scale = context.grad_scale
        wd = self.wd_in_denominator
        self._exclusions()  # (rescanned here when the groups changed: _flat_keep reads _scan)
        # 1/grad_scale (float64 when a flat gradient is float64)
        k = None if grad_scale is None else mt.inverse_scale(grad_scale, [fp.grad for _, _, fp in parts], dev)
        if wd is not None and k is not None:
            for _, _, fp in parts:
                fp.grad.mul_(k.to(fp.grad.dtype))
            grad_scale = k = None
        vectors, kept, ratios, clips = [], [], [], []
        for gi, group, fp in parts:
            mask, kept_params, index = self._flat_keep(gi, group, dev)
            dtype = torch.float64 if fp.grad.dtype == torch.float64 else torch.float32
            if fp.rows_pay:
                w_norm = torch.cat([torch.linalg.vector_norm(m, dim=1, dtype=dtype)
                                    for m in fp.params_rows()])
                g_norm = torch.cat([torch.linalg.vector_norm(m, dim=1, dtype=dtype)
                                    for m in fp.row_views(fp.grad)])
            else:  # (sizes vary: one grouped norm call over the parameters' views, one stack)
                _, ps, gs = seen[id(group)]
                v = mt.stack_scalars(mt.norms(list(ps) + list(gs))).to(dtype)
                w_norm, g_norm = v[:len(ps)], v[len(ps):]
            r = self._ratios_from_norms(w_norm, g_norm, self._group_lr(group, dev).to(dtype), k)
            clip = self.last_clip_on
            if mask is not None:
                r = torch.where(mask, r, torch.ones_like(r))
            if wd is not None:  # apex/timm: g ← g + wd·v for the rescaled parameters, one pass per run
                f = wd if mask is None else mask.to(dtype) * wd
                if fp.expands():  # one pass over the whole flat buffer (an element vector with a mask)
                    fw = fp.whole_lists()[0][0]
                    if mask is None:
                        fp.grad.add_(fw, alpha=wd)
                    else:
                        fp.grad.addcmul_(fw, fp.expand_segments(f).to(fp.grad.dtype))
                else:
                    for (first, count, _), mg, mw in zip(fp.runs, fp.row_views(fp.grad), fp.params_rows()):
                        if mask is None:
                            mg.add_(mw, alpha=wd)
                        else:
                            mg.addcmul_(mw, f[first:first + count].unsqueeze(1).to(mg.dtype))
            vectors.append((group, r))
            kept += kept_params
            whole = mask is None
            ratios.append(r if whole else r.index_select(0, index))
            if clip is not None:
                clips.append(clip if whole else clip.index_select(0, index))
        self.last_params = kept
        self.last_ratios = torch.cat(ratios) if len(ratios) > 1 else ratios[0]
        self.last_clip_on = None if not clips else torch.cat(clips)
        rows = RowMultipliers(vectors, seen)
        return self._delegate(context.inward(grad_scale=grad_scale, multipliers=rows))

    def _group_lr(self, group: dict, dev: torch.device) -> Tensor:
        """The learning rate the inner optimizer will use for ``group`` this step (0-d tensor; a Python
        float stays exact in float64)."""
        if protocol_level(self.optimizer) == "full":
            return self._current_lr(group).to(dev)
        lr = group["lr"]
        if isinstance(lr, Tensor):
            return lr.detach().to(dev).reshape(())
        return mt.scalar(lr, torch.float64, dev)

    @staticmethod
    def _mult_vector(params: list[Tensor], multipliers: dict | None, dev: torch.device) -> Tensor | None:
        if not multipliers:
            return None
        one = torch.ones((), dtype=torch.float32, device=dev)
        return torch.stack([multipliers.get(id(p), one).to(dev, torch.float32).reshape(()) for p in params])

    def _outer_factors(self, params, grad_scale, multipliers, dev) -> Tensor | None:
        """Per-parameter factor between the raw gradients and the gradients this wrapper should see."""
        k = self._mult_vector(params, multipliers, dev)
        if grad_scale is not None:
            inv = mt.inverse_scale(grad_scale, params, dev)  # (float64 for float64 parameters)
            k = inv if k is None else k * inv
        return k

    def _ratios(self, params, grads, lr: Tensor, grad_scale, multipliers, dev) -> Tensor:
        """The trust ratio of every parameter as one fp32 vector (module doc)."""
        v = self._compiled_norms(params, grads, dev)
        if v is not None:
            k = self._outer_factors(params, grad_scale, multipliers, dev)
            return self._ratios_from_norms(v[:, 0], v[:, 1], lr.to(v.dtype), k)
        both = mt.norms(list(params) + list(grads))  # one batched mesh reduction for weights and gradients
        wn, gn = both[: len(params)], both[len(params):]
        if len({(n.device, n.dtype) for n in both}) == 1:  # one stack, one conversion
            v = mt.stack_scalars(both)
            v = v.to(dev, torch.float64 if v.dtype == torch.float64 else torch.float32)
            w_norm, g_norm = v[: len(params)], v[len(params):]
        else:
            dtype = torch.float64 if any(n.dtype == torch.float64 for n in both) else torch.float32
            w_norm = torch.stack([n.to(dev, dtype) for n in wn])
            g_norm = torch.stack([n.to(dev, dtype) for n in gn])
        k = self._outer_factors(params, grad_scale, multipliers, dev)
        return self._ratios_from_norms(w_norm, g_norm, lr.to(w_norm.dtype), k)

    def _compiled_norms(self, params: list[Tensor], grads: list[Tensor], dev: torch.device) -> Tensor | None:
        """With an optkit inner optimizer built with ``jit_compile=True`` (plain tensors, outside a compiled
        region): the ``(n, 2)`` matrix of each parameter's ``(‖v‖, ‖g‖)`` from the compiled read-only pass
        :func:`optkit._core.chain.norm_sums` (as LARS's ``jit_compile``: each weight and gradient read once in
        one loop, row sums in registers), float64 for float64 parameters, else float32. None otherwise (also
        past ``COMPILE_WARN_TENSORS`` parameters), or when compiling fails (the inner optimizer warns once
        and is eager from then on)."""
        inner = self.optimizer
        call = inner.engine.compiled_pass(norm_sums, len(params)) if isinstance(inner, Optimizer) else None
        if call is None or any(t.device != dev for t in params):
            return None
        sums = call(params, grads)
        if sums is None:
            return None
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
        return sums.sqrt().to(dtype)

    def _ratios_from_norms(self, w_norm: Tensor, g_norm: Tensor, lr: Tensor, k: Tensor | None) -> Tensor:
        """The ratios from the norms of the weights and the raw gradients (``k``: the factor between the raw
        and the true gradients, or None); sets ``last_clip_on``."""
        dtype = w_norm.dtype
        if k is not None:
            g_norm = g_norm * k.abs().to(dtype)
        eta, eps = self.larc_eta, self.epsilon
        wd = self.wd_in_denominator
        denom = g_norm + eps if wd is None else g_norm + wd * w_norm + eps
        raw = eta * w_norm / denom
        self.last_clip_on = None
        if self.larc_mode == "clip":
            self.last_clip_on = (raw < lr).to(torch.float32)  # η‖v‖ < lr·(‖g‖+ε): the rate was clipped
            positive = lr > 0
            safe_lr = torch.where(positive, lr, torch.ones_like(lr))
            r = torch.clamp(torch.clamp_min(raw / safe_lr, self.min_update), max=1.0)
            r = torch.where(positive, r, torch.ones_like(r))
        else:
            r = torch.clamp_min(raw, self.min_update)
        if wd is not None:
            r = torch.where((w_norm > 0) & (g_norm > 0), r, torch.ones_like(r))
        return r

    def _own_config(self) -> dict:
        return {"larc_eta": self.larc_eta, "larc_mode": self.larc_mode, "min_update": self.min_update,
                "epsilon": self.epsilon, "wd_in_denominator": self.wd_in_denominator}
