"""The cached structure of the optimizer base's dense pass (one :class:`Plan` per param group).

Building a plan costs Python work per parameter (names, slot lists, the weight-decay mask, the cut into
cache-sized blocks, the layout facts the fused-kernel gate needs); reusing it costs O(1) per step plus one
check
per chunked gradient. A plan is rebuilt when the set of parameters with gradients, the optimizer state or the
exclusions change, when a parameter's storage moves (``p.data = ...``, a device move) or when a gradient no
longer fits the chunking. Building one checks every slot against its parameter (shape, dtype, device): torch's
fused kernels read whatever memory a slot points at, so a slot that does not fit raises ``ValueError`` here
instead of corrupting memory in a kernel.
"""

from __future__ import annotations

import operator
import os
import sys
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .. import _multi_tensor as mt
from ..flat import _VIEWS_RESTORED, flat_buffer_of
from . import fused as _fused

__all__ = ["Plan", "PlanView", "Block", "FlatPart", "RunAux", "SegmentAux", "RowMultipliers",
           "check_slot_fits", "scratch_view"]


def _data_ptrs(params: list[Tensor], dtensor: bool) -> list[int]:
    return [mt.local(p).data_ptr() for p in params] if dtensor else list(map(Tensor.data_ptr, params))


def _permutable(ts: list[Tensor]) -> list[int]:
    """Positions of the tensors whose strides can change while their address and shape stay (two equal
    dimensions of size > 1: ``p.data = p.data.t()`` on a square weight, ``p.t_()``), which a pointer check
    misses; their strides are compared too (others cannot be re-strided in place without ``as_strided``)."""
    out = []
    for i, t in enumerate(ts):
        dims = [d for d in t.shape if d > 1]
        if len(dims) != len(set(dims)):
            out.append(i)
    return out


def _strides(ts: list[Tensor], idx: list[int]) -> list[tuple[int, ...]]:
    return [mt.local(ts[i]).stride() for i in idx]


def _outside_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in this function's caller that points the warning at the
    first frame outside optkit and torch (the user's ``step()`` or train-op call)."""
    roots = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, mt) if m.__file__)
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(roots):
        frame, level = frame.f_back, level + 1
    return level


def _warn_interleaved(opt: Any, group: dict, params: list[Tensor]) -> None:
    """Warn once per optimizer when a group's parameters all lie in one flat buffer
    (:func:`optkit.flat_parameters`) but not back to back in the group's order, so that the group steps
    tensor by tensor: typically a module flattened in its own order, then split into groups by rules."""
    if getattr(opt, "_warned_interleaved", False) or len(params) != len(group["params"]) \
            or not all(type(p) in (Tensor, torch.nn.Parameter) for p in params):
        return  # (a parameter without a gradient this step, or a subclass, is not a layout matter)
    bufs = [flat_buffer_of(p) for p in params]
    if bufs[0] is None or any(b is None or b.data_ptr() != bufs[0].data_ptr() for b in bufs):
        return
    opt._warned_interleaved = True
    i = next((k for k, g in enumerate(opt.param_groups) if g is group), "?")
    warnings.warn(
        f"{type(opt).__name__}: the {len(params)} parameters of param group {i} lie in one flat buffer but "
        "not back to back in the group's order (the buffer interleaves groups), so this group steps tensor "
        "by tensor instead of over the flat buffer: lay the buffer out by groups with "
        "optkit.flat_parameters(optkit.param_groups(model, rules)) (or the groups you pass to the optimizer) "
        "before building the optimizer", UserWarning, stacklevel=_outside_stacklevel())


def check_slot_fits(name: str, slot: str, p: Tensor, t: object) -> None:
    """Raise ``ValueError`` naming the parameter and slot unless ``t`` is a tensor with ``p``'s shape, dtype
    and device (local shards compared for DTensors)."""
    if not isinstance(t, Tensor):
        raise ValueError(f"optimizer state of parameter {name!r}: slot {slot!r} is not a tensor "
                         f"({type(t).__name__})")
    lp, lt = mt.local(p), mt.local(t)
    if lt.shape != lp.shape:
        raise ValueError(
            f"optimizer state of parameter {name!r}: slot {slot!r} has shape {tuple(lt.shape)}, "
            f"the parameter {tuple(lp.shape)} (a state dict from another model, or a replaced parameter)"
        )
    if lt.dtype != lp.dtype or lt.device != lp.device:
        raise ValueError(
            f"optimizer state of parameter {name!r}: slot {slot!r} is {lt.dtype} on {lt.device}, "
            f"the parameter {lp.dtype} on {lp.device}"
        )
    if lt.is_sparse or lt.layout != torch.strided:
        raise ValueError(f"optimizer state of parameter {name!r}: slot {slot!r} must be a dense tensor")


def scratch_view(pool: Tensor, offset: int, like: Tensor) -> Tensor:
    """A view of the 1-D ``pool`` from ``offset`` with ``like``'s shape and, when ``like`` is dense, its
    strides (so that the fused kernels see matching layouts)."""
    n = like.numel()
    if not like.is_contiguous() and _fused.is_dense(like):
        return pool.as_strided(like.shape, like.stride(), offset)
    return pool[offset:offset + n].view(like.shape)


class PlanView:
    """What an optimizer's ``_prepare`` reads of a plan (names, slot lists, weight-decay mask), built without
    storage pointers or blocks: for one parameter (``update_step``), for ``torch.compile`` tracing and for the
    lean pass's bunches (:mod:`optkit._core.lean`). ``any_dtensor``: whether a parameter is a DTensor."""

    def __init__(self, names: list[str], slots: dict[str, list[Tensor]], use_wd: list[bool],
                 any_dtensor: bool = False) -> None:
        self.names = names
        self.any_dtensor = any_dtensor
        self.slots = slots
        self.use_wd = use_wd
        self.any_wd = any(use_wd)
        self.uniform_wd = use_wd[0] if all(w == use_wd[0] for w in use_wd) else None
        self.flat = None
        self.flat_active = False


class Block:
    """One block of the dense pass: owner indices, the chunks of params/slots/averages (static views), how to
    cut each owner's gradient (``split[j]`` = (start, stop) of the flat gradient, or None for the whole
    tensor; ``split`` None when nothing is cut), the block's (device, dtype) when homogeneous, and whether
    every parameter and slot chunk is contiguous (the fused-kernel gate then checks only the gradients)."""

    __slots__ = ("owners", "params", "slots", "averages", "split", "key", "identity", "all_wd",
                 "static_contiguous")


def _build_blocks(lists: list[list[Tensor]], slot_keys: list[str], use_wd: list[bool], has_avg: bool,
                  cut: bool, block_numel: int) -> tuple[list[Block], list[tuple[int, torch.Size]]]:
    """The blocks over parallel lists ``[params, grads, *slots, (averages)]``; cut into cache-sized chunks
    when ``cut`` (:func:`optkit._multi_tensor.blocks`). Also returns the owners whose gradients are cut."""
    n = len(lists[0])
    raw = mt.blocks(lists, block_numel) if cut else [(list(range(n)), tuple(lists))]
    blocks: list[Block] = []
    split_owners: list[tuple[int, torch.Size]] = []
    for owners, chunk_lists in raw:
        b = Block()
        b.owners = owners
        b.params = chunk_lists[0]
        b.slots = {s: chunk_lists[2 + j] for j, s in enumerate(slot_keys)}
        b.averages = chunk_lists[-1] if has_avg else None
        split = []
        for o, chunk in zip(owners, chunk_lists[1]):
            g = lists[1][o]
            if chunk.numel() == g.numel() and chunk.data_ptr() == g.data_ptr():
                split.append(None)
            else:
                start = chunk.storage_offset() - g.storage_offset()
                split.append((start, start + chunk.numel()))
                split_owners.append((o, g.shape))
        b.split = None if all(r is None for r in split) else split
        kinds = {(t.device, t.dtype) for t in b.params}
        b.key = next(iter(kinds)) if len(kinds) == 1 else None
        b.identity = len(owners) == n and owners == list(range(n))
        b.all_wd = all(use_wd[o] for o in owners)
        b.static_contiguous = all(t.is_contiguous() for t in b.params) and all(
            t.is_contiguous() for s in slot_keys for t in b.slots[s])
        blocks.append(b)
    return blocks, list(dict(split_owners).items())


def _run_view(ts: list[Tensor], layout: list[Tensor] | None = None) -> Tensor | None:
    """One 1-D view over ``ts`` when they lie back to back, in order, in one storage (each dense, with the
    shape and strides of the matching tensor of ``layout``, so that element pairs line up across lists);
    else None. :mod:`optkit.flat` lays parameters, gradients, slots and averages out this way."""
    first = ts[0]
    if not all(type(t) in (Tensor, torch.nn.Parameter) for t in ts):
        return None
    storage = first.untyped_storage().data_ptr()
    start = pos = first.storage_offset()
    for i, t in enumerate(ts):
        if t.untyped_storage().data_ptr() != storage or t.storage_offset() != pos or t.dtype != first.dtype \
                or t.device != first.device or t.is_sparse:
            return None
        ref = t if layout is None else layout[i]
        if t.shape != ref.shape or t.stride() != ref.stride() or not _fused.is_dense(t):
            return None
        pos += t.numel()
    if len(ts) == 1 and first.is_contiguous():
        return first.view(-1)
    view = torch.empty(0, dtype=first.dtype, device=first.device)
    return view.set_(first.untyped_storage(), start, (pos - start,), (1,))


class RunAux:
    """Per-tensor values for the row blocks of a :class:`FlatPart` (what ``_prepare`` returns there): one
    entry per row chunk, e.g. LARS's ``(s·k, s·wd)`` as ``(rows, 1)`` column tensors; with ``per_run``
    (``jit_compile``), one entry per whole run matrix instead, for the compiled rule over
    :meth:`FlatPart.run_lists`."""

    __slots__ = ("items", "per_run")

    def __init__(self, items: list, per_run: bool = False) -> None:
        self.items = items
        self.per_run = per_run


class SegmentAux:
    """Per-parameter values over a :class:`FlatPart` given as element vectors (one value per element of the
    flat buffer, :meth:`FlatPart.expand_segments`): what ``_prepare`` returns as the one entry of every
    parameter (``[aux] * n``), so that the base steps the flat part as one tensor. ``values`` holds the
    vectors (or anything else, passed through as is), ``base`` the flat parameters' storage offset;
    :meth:`chunk` cuts each vector to a chunk of the flat parameters (the whole buffer off the CPU,
    cache-sized chunks on it, or one parameter's view)."""

    __slots__ = ("values", "base")

    def __init__(self, values: tuple, base: int) -> None:
        self.values = values
        self.base = base

    def chunk(self, p: Tensor) -> tuple:
        """``values`` over the elements of ``p`` (a contiguous view of the flat parameters)."""
        lo = p.storage_offset() - self.base
        hi = lo + p.numel()
        return tuple(v[lo:hi].view(p.shape) if isinstance(v, Tensor) and v.dim() == 1 else v
                     for v in self.values)


class RowMultipliers(Mapping):
    """The step protocol's ``grad_multipliers`` (``{id(param): 0-d tensor}``) given as one vector per param
    group: ``rows[id(group)]`` holds the multipliers of all the group's parameters in order (a wrapper such as
    LARC computes them over the group's flat part). An optkit optimizer whose group still runs over that
    flat part applies each vector as ``(rows, 1)`` columns over the row runs, with no per-parameter work;
    anything else reads it as the mapping, built from the vectors on first use."""

    def __init__(self, groups: list[tuple[dict, Tensor]], gathered: dict | None = None) -> None:
        self.rows = {id(g): v for g, v in groups}
        #: ``{id(group): (indices, params, grads)}`` as the wrapper read them this step (reused by the step
        #: when no step pre-hook ran in between)
        self.gathered = gathered
        self._groups = groups
        self._map: dict[int, Tensor] | None = None

    def _mapping(self) -> dict[int, Tensor]:
        if self._map is None:
            self._map = {id(p): m for g, v in self._groups for p, m in zip(g["params"], v.unbind())}
        return self._map

    def __getitem__(self, key: int) -> Tensor:
        return self._mapping()[key]

    def __iter__(self):
        return iter(self._mapping())

    def __len__(self) -> int:
        return sum(len(g["params"]) for g, _ in self._groups)


class FlatPart:
    """The group as one flat run per list (parameters, gradients, slots, averages all back to back in their
    own storages, as :func:`optkit.flat.flat_parameters` lays them out): its blocks are chunks of single
    tensors, so a step costs O(#chunks) kernel calls, not O(#parameters). ``grad_objs`` are this plan's
    gradient tensors: the same objects next step means the same flat gradient.

    For per-tensor quantities (LARS trust ratios) the same memory is also cut into *runs* of consecutive
    parameters of equal size, each a ``(count, size)`` matrix whose rows are the parameters: a per-parameter
    norm is a row norm, a per-parameter factor a ``(count, 1)`` column that broadcasts. ``runs`` holds
    ``(first segment, count, size)``; ``row_blocks`` are cache-sized row chunks of those matrices (one chunk
    per block), ``row_grads`` the matching gradient chunks, ``chunk_segments[j]`` the segment range of chunk
    ``j``, and ``row_views(lst)`` the run matrices of another list over the same segments."""

    def __init__(self, blocks: list[Block], runs_views: list[Tensor], grad_objs: list[Tensor],
                 uniform_wd: bool, numels: list[int], slot_keys: list[str], has_avg: bool,
                 block_numel: int) -> None:
        self.blocks = blocks
        self.grad = runs_views[1]
        self.grad_objs = grad_objs
        #: where each gradient view points (``p.grad.data = ...`` or ``p.grad.set_(...)`` keeps the object
        #: but moves its storage out of the flat gradient)
        self.grad_ptrs = list(map(Tensor.data_ptr, grad_objs))
        self._grad_layout = [(g.shape, g.stride()) for g in grad_objs]  # each view's shape and strides
        self._grad_perm = _permutable(grad_objs)
        self._grad_perm_strides = _strides(grad_objs, self._grad_perm)
        self.all_idx = list(range(len(grad_objs)))  # the gather's indices when every gradient is a view
        self.all_wd = uniform_wd
        self.numels = list(numels)  # each parameter's number of elements (its segment of the flat buffer)
        self.numel = sum(self.numels)
        self._counts: dict = {}  # device -> the segment sizes there (expand_segments)
        self.runs: list[tuple[int, int, int]] = []
        for i, n in enumerate(numels):
            if self.runs and self.runs[-1][2] == n:
                first, count, _ = self.runs[-1]
                self.runs[-1] = (first, count + 1, n)
            else:
                self.runs.append((i, 1, n))
        self._flats = runs_views
        self._slot_keys = list(slot_keys)
        self._has_avg = has_avg
        self._run_lists: tuple | None = None
        total = sum(count * n for _, count, n in self.runs)
        oversized = sum(count * n for _, count, n in self.runs if n > block_numel)
        #: whether per-tensor quantities (LARS, LAMB) use the row runs: not when over a quarter of the
        #: elements sit in parameters larger than a block (a row is never cut, so it would leave the cache;
        #: the per-tensor pass cuts them and sums partial norms instead)
        self.rows_pay = 4 * oversized <= total
        self.row_blocks: list[Block] = []
        self.row_grads: list[Tensor] = []
        self.chunk_segments: list[tuple[int, int]] = []
        mats = [self.row_views(f) for f in runs_views]
        key = (runs_views[0].device, runs_views[0].dtype)
        for r, (first, count, n) in enumerate(self.runs):
            rows = max(1, block_numel // max(n, 1))
            for lo in range(0, count, rows):
                hi = min(count, lo + rows)
                chunk = [m[r][lo:hi] for m in mats]
                b = Block()
                b.owners = [len(self.row_blocks)]
                b.params = [chunk[0]]
                b.slots = {s: [chunk[2 + j]] for j, s in enumerate(slot_keys)}
                b.averages = [chunk[-1]] if has_avg else None
                b.split, b.key, b.identity, b.all_wd = None, key, False, uniform_wd
                b.static_contiguous = True
                self.row_blocks.append(b)
                self.row_grads.append(chunk[1])
                self.chunk_segments.append((first + lo, first + hi))

    def row_views(self, flat: Tensor) -> list[Tensor]:
        """The ``(count, size)`` run matrices of a flat run laid out like the parameters."""
        out, offset = [], 0
        for _, count, n in self.runs:
            out.append(flat[offset:offset + count * n].view(count, n))
            offset += count * n
        return out

    def row_chunks(self, flat: Tensor) -> list[Tensor]:
        """The row chunks (``row_grads``' layout: the same shapes at the same offsets) of another contiguous
        flat run of the gradient's size."""
        base = self.grad.storage_offset()
        return [flat[g.storage_offset() - base:g.storage_offset() - base + g.numel()].view(g.shape)
                for g in self.row_grads]

    def scale_rows_(self, flat: Tensor, factors: Tensor) -> None:
        """Multiply each parameter's segment of ``flat`` by its entry of ``factors`` (one vector over the
        segments): one broadcast multiply per run."""
        for (first, count, _), m in zip(self.runs, self.row_views(flat)):
            m.mul_(factors[first:first + count].unsqueeze(1))

    def expands(self) -> bool:
        """Whether per-parameter values go over this flat part as element vectors
        (:meth:`expand_segments`, whole-buffer kernels: O(1) launches whatever the sizes) rather than as the
        row runs' ``(rows, 1)`` columns per cache-sized chunk (O(#runs) kernels that keep each chunk in
        cache): everywhere but on the CPU. (Tests route the CPU through it by patching this method.)"""
        return self.grad.device.type != "cpu"

    def expand_segments(self, values: Tensor) -> Tensor:
        """One value per parameter -> one per element of the flat buffer: ``values[i]`` repeated over
        parameter ``i``'s elements (:func:`optkit._multi_tensor.segment_expand`, with the segment sizes kept
        per device: no host sync, a fixed number of kernels whatever the number of parameters; on CUDA it
        writes an int32 index and the expanded vector, about 12 bytes per element)."""
        dev = values.device
        counts = self._counts.get(dev)
        if counts is None:
            counts = torch.tensor(self.numels, dtype=torch.int32 if self.numel < 2**31 else torch.int64,
                                  device=dev)
            self._counts[dev] = counts
        return mt.segment_expand(values, counts, self.numel)

    def run_segments(self) -> list[tuple[int, int]]:
        """Each run's ``(first segment, count)``: its rows' positions among the parameters."""
        return [(first, count) for first, count, _ in self.runs]

    def run_lists(self) -> tuple[list[Tensor], list[Tensor], dict[str, list[Tensor]], list[Tensor] | None]:
        """The run matrices of the parameters, the gradients, each slot and the averages (None without
        EMA): whole runs, for a compiled rule that broadcasts ``(count, 1)`` columns over them."""
        if self._run_lists is None:  # (views of the plan's own buffers: made once per plan)
            mats = [self.row_views(f) for f in self._flats]
            slots = {s: mats[2 + j] for j, s in enumerate(self._slot_keys)}
            self._run_lists = (mats[0], mats[1], slots, mats[-1] if self._has_avg else None)
        return self._run_lists

    def whole_lists(self) -> tuple[list[Tensor], list[Tensor], dict[str, list[Tensor]], list[Tensor] | None]:
        """:meth:`run_lists` as one tensor each (the whole flat runs), for a rule with nothing per tensor."""
        f = self._flats
        return [f[0]], [f[1]], {s: [f[2 + j]] for j, s in enumerate(self._slot_keys)}, \
            [f[-1]] if self._has_avg else None

    def params_rows(self) -> list[Tensor]:
        """The parameters' run matrices."""
        return self.row_views(self._flats[0])

    def grads_in_place(self) -> bool:
        """Whether every gradient view still points into the flat gradient (a C-speed pointer scan, about
        70 ns per parameter)."""
        return list(map(Tensor.data_ptr, self.grad_objs)) == self.grad_ptrs and (
            not self._grad_perm or _strides(self.grad_objs, self._grad_perm) == self._grad_perm_strides)

    def same_grads(self, grads: list[Tensor]) -> bool:
        """Whether ``grads`` are this plan's gradient objects, still in the flat gradient (C-speed identity
        and pointer scans)."""
        if grads is self.grad_objs:  # handed out by the optimizer's gather after the same checks
            return True
        if len(grads) != len(self.grad_objs):
            return False
        if all(map(operator.is_, grads, self.grad_objs)):
            return self.grads_in_place()
        return self._adopt(grads)

    def _adopt(self, grads: list[Tensor]) -> bool:
        """Take ``grads`` as this plan's gradient objects when they are new objects for the same views (each
        at the old one's address, with its shape and strides), as :meth:`optkit.FlatParameters.zero_grad`
        makes after a gradient was replaced: the flat part then serves again without a new plan. False
        (nothing changed) otherwise: separate gradients step per tensor."""
        try:
            if list(map(Tensor.data_ptr, grads)) != self.grad_ptrs:
                return False
        except (TypeError, RuntimeError):  # a None or a sparse gradient
            return False
        if [(g.shape, g.stride()) for g in grads] != self._grad_layout:
            return False
        self.grad_objs = list(grads)
        return True


class Plan:
    """Per-group structure of the dense pass, cached across steps (module doc)."""

    def __init__(self, opt: Any, group: dict, idx, params, grads, blocked: bool, key) -> None:
        self.key = key
        self.views_restored = _VIEWS_RESTORED[0]  # (see Optimizer._plan_for)
        self.names = [group["param_names"][i] for i in idx]
        st = opt.state
        for name, p in zip(self.names, params):
            state = st[p]
            for s in opt._active_slots(group):
                check_slot_fits(name, s, p, state.get(s))
            if opt.use_ema:
                check_slot_fits(name, "average", p, state.get("average"))
        slot_keys = list(opt._active_slots(group))
        self.slots = {s: [st[p][s] for p in params] for s in slot_keys}
        self.averages = [st[p]["average"] for p in params] if opt.use_ema else None
        self.use_wd = [opt._use_weight_decay(p, n) for p, n in zip(params, self.names)]
        self.any_wd = any(self.use_wd)
        #: True / False when every parameter is / is not decayed, None when it differs
        self.uniform_wd = self.use_wd[0] if all(w == self.use_wd[0] for w in self.use_wd) else None
        self.any_dtensor = any(mt.is_dtensor(t) for t in params) or any(mt.is_dtensor(g) for g in grads)
        self._ptrs = _data_ptrs(params, self.any_dtensor)
        self._perm = _permutable(params)
        self._perm_strides = _strides(params, self._perm)
        loc = mt.local
        lists = [[loc(p) for p in params], [loc(g) for g in grads]]
        lists += [[loc(t) for t in self.slots[s]] for s in slot_keys]
        if self.averages is not None:
            lists.append([loc(a) for a in self.averages])
        cut = blocked and lists[0][0].device.type == "cpu"
        self.blocks, self._split_owners = _build_blocks(lists, slot_keys, self.use_wd,
                                                        self.averages is not None, cut, opt.block_numel)
        self.flat: FlatPart | None = None
        if not self.any_dtensor and len(params) > 1:
            runs = [_run_view(lst, lists[0]) for lst in lists]
            if all(r is not None for r in runs):
                fblocks, _ = _build_blocks([[r] for r in runs], slot_keys, [bool(self.uniform_wd)],
                                           self.averages is not None, cut, opt.block_numel)
                self.flat = FlatPart(fblocks, runs, list(grads), bool(self.uniform_wd),
                                     [p.numel() for p in lists[0]], slot_keys, self.averages is not None,
                                     opt.block_numel)
            elif runs[0] is None:
                _warn_interleaved(opt, group, lists[0])
        #: set by the optimizer before ``_prepare`` each step: whether this step may use the flat part
        self.flat_active = False

    def params_fit(self, params: list[Tensor]) -> bool:
        """Whether the parameters still live where the plan's chunk views point (``p.data = ...`` or a move
        to another device replaces the storage), with the same strides (an alias of the same memory with
        other strides, such as ``p.data = p.data.t()`` on a square weight)."""
        return self._ptrs == _data_ptrs(params, self.any_dtensor) and (
            not self._perm or _strides(params, self._perm) == self._perm_strides)

    def grads_fit(self, grads: list[Tensor]) -> bool:
        """Whether this step's gradients can be cut like the plan's (contiguous, same shape)."""
        for o, shape in self._split_owners:
            g = mt.local(grads[o])
            if not g.is_contiguous() or g.shape != shape:
                return False
        return True
