"""The eager passes that apply the update: each group's cached plan (:mod:`optkit._core.plan`), the blocked
pass over cache-sized chunks (decoupled decay → the rule's ``_update`` → EMA, chunk by chunk, so the chain
costs about one sweep over memory), the flat buffers and their row runs, in-cache scratch copies that keep
the caller's ``.grad`` untouched, and the fused-kernel gate (:mod:`optkit._core.fused`) with its pointwise
fallback."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from .. import _multi_tensor as mt
from ..flat import _VIEWS_RESTORED, flat_buffer_of
from . import fused as _fused
from .chain import chain
from .plan import (
    FlatPart,
    Plan,
    PlanView,
    RowMultipliers,
    RunAux,
    SegmentAux,
    scratch_view,
)

#: per-tensor multipliers fold into the kernel (one call per tensor) only for groups with at least this many
#: elements per tensor on average: below it a call per tensor costs more than the blocked pass's in-cache
#: multiply (LARC(SGD), 2,000 × 4,096: 45 vs 37 ms per step; ResNet-50 shapes: 27 vs 29 ms)
FOLD_MIN_NUMEL = 1 << 16


class PassesMixin:
    """The eager update passes over each param group. A part of :class:`optkit.optimizer.Optimizer`."""

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

    def _blocked(self, group: dict, mult: list | None) -> bool:
        """Whether the group's chain of kernels runs block by block over cache-sized chunks."""
        wd = group.get("weight_decay", 0.0) if self.traits.decoupled_weight_decay else 0.0
        folds = mult is not None and not self._folds_mult(group)
        return (self.traits.blocks == "always" or bool(wd) or self.use_ema or folds
                                    or self._guards(group, mult))

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
        return self.traits.writes_grads

    def _folds_mult(self, group: dict) -> bool:
        """Whether this group's per-tensor multipliers go into the kernel (``traits.multipliers_in_kernel``
        and tensors of at least :data:`FOLD_MIN_NUMEL` elements on average; cached until the group's
        parameter list changes)."""
        if not self.traits.multipliers_in_kernel:
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
        With multipliers only for a :class:`~optkit._core.plan.RowMultipliers` that has a vector for this
        group, and only when the flat part's row runs pay."""
        plan = self._plans.get(id(group))
        rows = isinstance(multipliers, RowMultipliers) and id(group) in multipliers.rows
        if plan is None or plan.flat is None or self._lean_group(group) \
                or (multipliers is not None and not rows) or torch.compiler.is_compiling():
            return None
        key = (len(idx), self._plan_version, self._blocked(group, multipliers), self.block_numel)
        if plan.key[1:] != key[1:] or len(plan.key[0]) != key[0] or len(idx) != len(group["params"]):
            return None
        # every parameter still where the plan's views point (``p.data = ...`` on one parameter takes it out
        # of the flat buffer; a C-speed pass, about 80 ns per parameter)
        if not plan.flat.same_grads(grads) or (plan is not fit_checked and not plan.params_fit(params)):
            return None
        if rows and not (plan.flat.rows_pay or plan.flat.expands()):
            return None
        return plan

    def _flat_part(self, group: dict, seen: dict | None = None) -> FlatPart | None:
        """For a wrapper about to pass per-parameter multipliers as :class:`~optkit._core.plan.RowMultipliers`
        (LARC): the group's flat part when this step will run over it (every parameter has its flat gradient
        view, the plan is current, the row runs pay), else None. O(1) checks plus one identity scan. The
        gathered lists go into ``seen`` (keyed by the group's id) for the step to reuse, and a plan found
        current is remembered so that the step does not check its parameter storages again."""
        self._fit_seen.pop(id(group), None)
        idx, params, grads = self._gather(group)
        if seen is not None:
            seen[id(group)] = (idx, params, grads)
        if not params or self._lean_group(group):
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
        checked=None, zero=False, zeroed=None, unscale=None,
    ) -> None:
        """``plan``: a flat plan checked this step; ``checked``: the per-tensor plan :meth:`_apply` built
        for these arguments before any group was updated (:meth:`_check_group_plan`)."""
        if self._lean_group(group):  # bfloat16 weights without masters or low-precision slots
            self._run_lean(group, idx, params, grads, lr, k, found_inf, applied, mult, unscale)
            return
        if isinstance(mult, list) and all(m is None for m in mult):
            mult = None
        if plan is not None:  # a flat plan, checked this step: no sparse gradients, nothing to re-plan
            self._run_planned(group, idx, params, grads, lr, k, found_inf, applied, mult, plan, zero=zero,
                              zeroed=zeroed, unscale=unscale)
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
        self._run_planned(group, idx, params, grads, lr, k, found_inf, applied, mult, plan, tracing, flat_ok,
                          zero=zero, zeroed=zeroed, unscale=unscale)

    def _run_planned(self, group, idx, params, grads, lr, k, found_inf, applied, mult, plan, tracing=False,
                     flat_ok=True, zero=False, zeroed=None, unscale=None):
        """Decay → update → EMA of one group with its plan: the flat blocks when the plan has a flat part
        whose gradients are this step's (``flat_ok``) and nothing per tensor differs (multipliers,
        per-tensor ``_prepare`` values, a mixed decay mask), else the per-tensor blocks. ``zero``: the caller
        zeroes the gradients next (``StepContext.zero_grads``): the pass zeroes the flat gradient chunks as it
        reads them, and adds the group's id to ``zeroed``. ``unscale``: the 1/S the pass gives the caller's
        gradients while it has them in cache (None: they are scratch, or copies)."""
        wd = group.get("weight_decay", 0.0) if self.traits.decoupled_weight_decay else 0.0
        # the caller's gradients are copied chunk by chunk (in cache) for the update, and get 1/S there
        guard = self._guards(group, mult)
        inv = unscale
        row_mult = None  # per-parameter multipliers over the flat part's row runs (RowMultipliers)
        if isinstance(mult, Tensor):
            row_mult, mult = mult, None
            if self.traits.prepare_reads_grads or (wd and plan.any_wd and plan.uniform_wd is None) \
                    or self._jit_active():
                if guard:  # (not into the caller's gradients: per tensor, below)
                    mult, row_mult = list(row_mult.unbind()), None
                else:
                    self._scale_segments(plan.flat, row_mult)  # one pass; then the usual flat path
                    row_mult = None
        if mult is not None and self.traits.prepare_reads_grads:
            # _prepare reads whole-tensor quantities (norms): it must see the multiplied gradients
            sel = [(j, m) for j, m in enumerate(mult) if m is not None]
            if guard:  # the products go into copies, which the pass then owns; the caller's get 1/S now
                callers, grads = grads, mt.scaled_copies(grads, torch.ones((), device=lr.device))
                if inv is not None:
                    mt.scale_(callers, inv)
                guard, inv, flat_ok = False, None, False
            mt.scale_([grads[j] for j, _ in sel], [m for _, m in sel])
            mult = None
        if mult is not None and not tracing and not self._jit_active():
            # off the CPU: the multipliers in one multi-tensor multiply by their element vector (O(1) kernels;
            # torch's multi-tensor route takes no list of 0-d factors), into copies when the caller's
            # gradients are to be left (which get 1/S now)
            ef = mt.ElementFactors.cached(self._factor_cache, id(group), grads)
            if ef is not None:
                one = None
                if any(m is None for m in mult):
                    one = torch.ones((), dtype=torch.float32, device=grads[0].device)
                factors = [one if m is None else m for m in mult]
                if guard:
                    callers, grads = grads, ef.mul(grads, factors)
                    if inv is not None:
                        mt.scale_(callers, inv)
                    guard, inv = False, None
                else:
                    ef.mul_(grads, factors)
                mult, flat_ok = None, False
        shadow_rows = None  # the flat shadow's row chunks (a keeps_values_in_grads rule over the row runs)
        if guard and self.traits.keeps_values_in_grads and not tracing and not self._jit_active():
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
                self._scale_segments(plan.flat, row_mult)
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
        zero = zero and flat_ok and plan.flat is not None and shadow_rows is None
        if isinstance(aux, RunAux) and aux.per_run:  # jit_compile over a flat part's row runs
            self._run_compiled_rows(group, idx, flat, lr, k, found_inf, applied, aux, zero=zero)
            if zero:
                zeroed.add(id(group))
            if inv is not None:  # (the compiled rule only reads the gradients)
                mt.scale_([flat.grad], inv)
            return
        if self._jit_active() and not isinstance(aux, RunAux):
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
                    zeroed.add(id(group))
                if inv is not None:  # (the compiled chain only reads the gradients)
                    mt.scale_([flat.grad] if flat is not None else grads, inv)
                return

        # decoupled weight decay factor, 1 − lr·wd (1 on a skipped step)
        decay = None
        if decay_mask is not None:
            decay = 1.0 - lr * wd if applied is None else 1.0 - lr * wd * applied
        ema_w = self._ema_lerp_weight(applied) if self.use_ema else None

        cols = seg = None
        if row_mult is not None and aux is None and flat.expands():
            # per-tensor multipliers as one element vector over the whole flat blocks (O(1) kernels)
            blocks, glocal = flat.blocks, [flat.grad]
            seg = SegmentAux((flat.expand_segments(row_mult),), flat.blocks[0].params[0].storage_offset())
        elif isinstance(aux, RunAux) or row_mult is not None:
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
            seg_f = None if seg is None else seg.chunk(bp[0])[0]
            if scratch is not None:  # the chunk's copy (in cache) takes the multipliers and the update
                sc = scratch[id(blk)]
                if seg_f is not None:  # (the copy and the multiply in one pass)
                    torch.mul(bg[0], seg_f, out=sc[0])
                    seg_f = None
                else:
                    torch._foreach_copy_(sc, bg)
                if inv is not None:  # the caller's chunk: g/S, written back while in cache
                    mt.scale_local_(bg, inv, blk.key)
                bg = sc
            # (otherwise the update leaves g or k·g = g/S in them: see _update_writes_grads)
            if cols is not None:
                bg[0].mul_(cols[owners[0]])  # the chunk's (rows, 1) column, in cache before the update
            elif seg_f is not None:
                bg[0].mul_(seg_f)
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
            zeroed.add(id(group))

        if self.use_ema:
            self._ema_rest(group, idx, applied)

    @staticmethod
    def _scale_segments(flat: FlatPart, factors: Tensor) -> None:
        """Multiply each parameter's segment of the flat gradient by its entry of ``factors``: one
        multiply by the expanded vector where the flat part :meth:`~optkit._core.plan.FlatPart.expands`,
        else one broadcast multiply per row run."""
        if flat.expands():
            flat.grad.mul_(flat.expand_segments(factors))
        else:
            flat.scale_rows_(flat.grad, factors)

    def _shadow_rows(self, flat: FlatPart) -> bool:
        """Whether this ``keeps_values_in_grads`` rule runs over ``flat``'s row runs (its :meth:`_prepare`
        then
        returns a :class:`~optkit._core.plan.RunAux` for them): the base gives it one flat shadow of the flat
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
        """A copy of the group's (local) gradients kept with the plan, for ``keeps_values_in_grads`` rules."""
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
        """The cached :class:`~optkit._core.plan.Plan` of this group for this set of parameters with gradients
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
        """The fused-kernel gate (:func:`optkit._core.fused.partition`) over ``lists`` (parameters first,
        gradients second, then slots), grouped by (device, dtype).

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

    def _fused_parts(
        self, kernel: str, group: dict, lists: Sequence[Sequence[Tensor]], lr: Tensor, k: Tensor | None,
        found_inf: Tensor | None, aux: Sequence | None, written: Sequence[int] | None = None,
    ) -> Iterator[tuple[torch.device, torch.dtype, list[int], tuple[list[Tensor], ...], Tensor | None]]:
        """The fused-kernel loop of an :meth:`_update`: :meth:`_kernel_parts` over ``lists`` with the parts
        that have no kernel on their device run by :meth:`_pointwise_fallback` (``aux`` cut to the part, the
        slots ``lists[2:]``). Yields ``(device, dtype, index, lists, found_inf)`` for the parts a kernel runs
        on, ``found_inf`` on the part's device (:func:`optkit._core.fused.kernel_calls` turns them into kernel
        arguments). ``written`` defaults to what the kernels write: every list but the gradients, and the
        gradients too when ``k`` is set (``grad_scale`` leaves ``k·g`` there)."""
        if written is None:
            written = (0, *range(2, len(lists))) if k is None else tuple(range(len(lists)))
        for device, dtype, mode, ix, part in self._kernel_parts(kernel, lists, written):
            fi = None if found_inf is None else found_inf.to(device)
            if mode == "fallback":
                self._pointwise_fallback(group, part[0], part[1], part[2:], lr, k, fi,
                                         None if aux is None else [aux[i] for i in ix])
            else:
                yield device, dtype, ix, part, fi

    def _light_plan(self, group: dict, idx: list[int], params: list[Tensor]) -> PlanView:
        """What :meth:`_prepare` and the chain need of a plan, without storage pointers or blocks (for
        ``torch.compile`` tracing, where there is no storage)."""
        names = [group["param_names"][i] for i in idx]
        use_wd = [self._use_weight_decay(p, n) for p, n in zip(params, names)]
        slots = {s: [self.state[p][s] for p in params] for s in self._active_slots(group)}
        return PlanView(names, slots, use_wd, any(map(mt.is_dtensor, params)))
