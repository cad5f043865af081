"""Gradients on their way into the update: gathering each group's gradients (one ``.grad`` read each, the flat
gradient when they are still its views), ``zero_grad``, sparse gradients (densified, or coalesced for a rule
with a sparse form), per-tensor multipliers, and the overflow refusal of a clip norm under a loss scale."""

from __future__ import annotations

import operator
from collections.abc import Collection
from typing import Any

import torch
from torch import Tensor

from .. import _multi_tensor as mt
from ..flat import _VIEWS_RESTORED, flat_buffer_of
from .plan import (
    check_slot_fits,
)

_GRAD = operator.attrgetter("grad")


class GradientsMixin:
    """Reading, zeroing and preparing the gradients a step updates with. A part of
    :class:`optkit.optimizer.Optimizer`."""

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
        by the step that just ran, see ``StepContext.zero_grads``)."""
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

    @staticmethod
    def _group_mult(group: dict, params: list[Tensor], fp: Any, multipliers: Any) -> Any:
        """The group's per-tensor multipliers: None, the flat part's ``RowMultipliers`` rows (checked by
        ``_flat_plan``) or one entry per parameter with a gradient."""
        if multipliers is None:
            return None
        if fp is not None:
            return multipliers.rows[id(group)]
        return [multipliers.get(id(p)) for p in params]

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
        (``Traits(sparse=True)``) get their sparse gradients coalesced instead (duplicates summed, as TF1
        de-duplicates ``IndexedSlices``); those stay sparse through unscaling and clipping and are updated by
        :meth:`_sparse_update`. Returns the ids of the parameters handled by the sparse rule.
        """
        if self.traits.sparse:
            for group, (_, _, grads) in zip(self.param_groups, gathered):
                if any(g.is_sparse for g in grads):
                    self._check_sparse(group)
        handled: set[int] = set()
        for _, params, grads in gathered:
            for j, g in enumerate(grads):
                if g.is_sparse:
                    if originals is not None:  # (the caller's sparse gradients, unscaled after the step)
                        originals.append(g)
                    if self.traits.sparse:
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
        raise TypeError(f"{type(self).__name__} declares Traits(sparse=True) but does not implement "
                        "_sparse_update()")

    def _clips_copy(self) -> bool:
        """Whether this step's pass runs on copies of the caller's gradients: ``clipnorm``/``clipvalue``
        transform every gradient (the optimizer's math, not the caller's; see ``scratch_grads``)."""
        return not self.scratch_grads and (self.clipvalue is not None or self.clipnorm is not None)

    @staticmethod
    def _refuse_overflowed_norm(found_inf: Tensor, norms: Tensor, inv: Tensor,
                                overflow: list | None) -> Tensor:
        """Under a loss scale that backs off (``StepContext.report_overflow``; ``overflow`` a list): the skip
        flag, also set when a clip norm of the *scaled* gradients is not finite and the scale is above 1.
        The elements are finite (else the flag is set already), so the scale is so large that ``‖S·g‖²``
        overflows float32 (S·|g| beyond about 1.8e19) and the clip would be NaN or 0: the step is skipped and
        the flag goes into ``overflow``, which the caller counts as an overflow (the scale backs off). Other
        callers (``torch.amp.GradScaler``, which would not back off) get the flag unchanged."""
        if overflow is None:
            return found_inf
        bad = ((~torch.isfinite(norms)).any() & (inv.to(found_inf.device) < 1)).to(
            device=found_inf.device, dtype=found_inf.dtype)
        overflow.append(bad)
        return torch.maximum(found_inf, bad)

    def _scale_per_tensor(self, gathered: list, flat_plans: list, factors: Tensor) -> None:
        """Each gathered gradient times its entry of ``factors`` (one vector over them, in order, or a list
        of 0-d tensors). A flat part whose per-parameter values go as element vectors
        (:meth:`~optkit._core.plan.FlatPart.expands`: off the CPU) takes one multiply of its flat gradient
        by the expanded vector; off the CPU a group's
        separate float32/float64 gradients take one multi-tensor multiply by the factors expanded over
        their elements (:class:`optkit._multi_tensor.ElementFactors`, kept per group): a fixed number of
        kernels whatever the number of parameters. The other gradients (the CPU, half precision) take one
        multiply per tensor by its 0-d factor. The products are the same: each element times its tensor's
        factor, rounded once."""
        rest: tuple[list, list] = ([], [])
        at = 0
        for group, (_, _, gs), fp in zip(self.param_groups, gathered, flat_plans):
            part = factors[at:at + len(gs)]
            at += len(gs)
            if fp is not None and fp.flat.expands() and len(gs) == len(fp.flat.numels):
                fp.flat.grad.mul_(fp.flat.expand_segments(part if isinstance(part, Tensor)
                                                          else mt.stack_scalars(part)))
                continue
            ef = mt.ElementFactors.cached(self._factor_cache, id(group), gs)
            if ef is not None:
                ef.mul_(gs, part)
            else:
                rest[0].extend(gs)
                rest[1].extend(part.unbind() if isinstance(part, Tensor) else part)
        mt.scale_(rest[0], rest[1])

    def _unscale_and_clip(self, gathered: list, flat_plans: list, grad_scale: Tensor | None,
                          found_inf: Tensor | None, overflow: list | None) -> tuple:
        """Steps 2 and 3 of the pipeline (module doc of :mod:`optkit.optimizer`): ``1/grad_scale`` and the
        clip options. Returns ``(k, k64, inv, inv64, found_inf)``: the factor of the raw gradients folded
        into the kernels (``k64`` for float64 groups; None when ``clipnorm``/``clipvalue`` applied it here),
        ``1/grad_scale`` in float32 and float64 (None without a scale or float64 groups), and the skip flag
        (also set when a clip norm of the scaled gradients overflowed, :meth:`_refuse_overflowed_norm`)."""
        dev = self._state_device
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
                n_all = mt.stack_scalars(ns).to(device=dev)  # (off the CPU: one launch)
            c = self.clipnorm
            if inv is not None and found_inf is not None:
                found_inf = self._refuse_overflowed_norm(found_inf, n_all, inv, overflow)
            coef_vec = mt.clip_factor(n_all, c, inv=inv)  # g·c/max(‖g‖, c), per tensor
            if inv64 is not None:  # float64 gradients: the factor with the float64 1/grad_scale
                c64 = mt.clip_factor(n_all.to(torch.float64), c, inv=inv64).unbind()
                coefs = [b if x.dtype == torch.float64 else a
                         for a, b, x in zip(coef_vec.unbind(), c64, ns)]
                self._scale_per_tensor(gathered, flat_plans, coefs)
            else:
                self._scale_per_tensor(gathered, flat_plans, coef_vec)
            k = k64 = None
        elif self.global_clipnorm is not None:
            n = mt.global_norm(whole_grads).to(device=dev)  # fp32, or fp64 for fp64 gradients
            if inv is not None and found_inf is not None:
                found_inf = self._refuse_overflowed_norm(found_inf, n, inv, overflow)
            c = self.global_clipnorm
            if inv64 is not None:  # (n is float64: float64 gradients are among them)
                k64 = mt.clip_factor(n, c, inv=inv64, nan_on_nonfinite=True)
            k = mt.clip_factor(n, c, inv=inv, nan_on_nonfinite=True)  # (a non-finite norm: NaN, as Keras)
        return k, k64, inv, inv64, found_inf
