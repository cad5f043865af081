"""Reductions across a device mesh for DTensor inputs: whole-tensor quantities (norms, flags, maxima) of
sharded tensors, ``Partial`` gradients reduced before use, and the pipeline-stage group, with one collective
per mesh-dim process group rather than one per parameter."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from ._tensors import _dtensor_class, _stack, _unstack, is_dtensor, local

# ------------------------------------------------------------------------------------------------------------
# mesh reductions (DTensor)
#
# Placements are read by meaning, not by class: a placement that is neither Replicate nor Partial and names a
# tensor dim splits the tensor across its mesh dim (``Shard``, FSDP2's ``_StridedShard`` under tensor
# parallelism, which is not a ``Shard`` subclass); whole-tensor results combine local results over exactly
# those mesh dims. ``Replicate`` dims hold the same data and are counted once. ``Partial`` values are pending
# a reduction: they are reduced first (:func:`reduce_partial_grads_` in place for gradients, out of place
# inside the norms), never combined as if they were shards.
#
# Collectives are issued per *process group*, not per tensor and not per (mesh, dims) combination: every
# value that must be reduced over a mesh dim travels in one flat buffer for that dim's group, so a step costs
# at most one collective per distinct mesh-dim group (and dtype). Meshes that share a group (equal meshes,
# a sub-mesh and its root) share the collective. Every rank scans the same tensor list in the same order,
# so the sequence of collectives is the same on every member of a group.

#: the process group joining the pipeline stages (module-wide default; see :func:`set_pipeline_group`)
_PIPELINE_GROUP: object = None


class _Unset:
    """The "not given" marker of ``pipeline_group``: one object, kept by copies and pickles (an object
    holding it, such as a deep-copied train op, must not take a fresh marker for a process group)."""

    def __reduce__(self) -> str:
        return "_UNSET"

    def __repr__(self) -> str:
        return "<unset>"


_UNSET = _Unset()


def set_pipeline_group(group: object) -> object:
    """Make every *global* reduction (``global_norm``, ``sum_of_squares``, ``max_abs``, ``any_non_finite``,
    ``reduce_flag_``, ``non_finite_check_and_unscale_``, ``global_norm_and_found_inf``) also combine its
    result across ``group``: the ranks that hold the same position in the other pipeline stages. ``None``
    turns it off. Returns the previous setting. Per-tensor norms never cross stages (a parameter lives on one
    stage). Every stage must then call these functions in the same order (SPMD), also with no tensors.
    """
    global _PIPELINE_GROUP
    prior, _PIPELINE_GROUP = _PIPELINE_GROUP, group
    return prior


def get_pipeline_group() -> object:
    """The pipeline-stage process group set by :func:`set_pipeline_group` (None when unset)."""
    return _PIPELINE_GROUP


def _pp(group: object) -> object:
    return _PIPELINE_GROUP if group is _UNSET else group


def _split_dim(p) -> int | None:
    """The tensor dim that placement ``p`` splits over its mesh dim, or None (Replicate, Partial)."""
    if p.is_replicate() or p.is_partial():
        return None
    d = getattr(p, "dim", None)
    if isinstance(d, bool) or not isinstance(d, int):
        raise TypeError(f"unsupported DTensor placement {p!r}: not Replicate, Partial, or a split of one dim")
    return d


#: what each placement class means ("split", "replicate" or "partial"), learnt from its methods the first
#: time the class is seen (a step looks at every parameter: a dict lookup by type instead of method calls)
_KIND: dict[type, str] = {}


def _kind(p) -> str:
    k = _KIND.get(type(p))
    if k is None:
        k = "partial" if p.is_partial() else "replicate" if p.is_replicate() else "split"
        if k == "split":
            _split_dim(p)  # raises for a placement that names no dim
        _KIND[type(p)] = k
    return k


def _placement_info(placements: tuple) -> tuple[tuple[int, ...], bool]:
    """(mesh dims whose placement splits the tensor, whether any placement is Partial)."""
    split = []
    partial = False
    for i, p in enumerate(placements):
        k = _KIND.get(type(p)) or _kind(p)
        if k == "split":
            split.append(i)
        elif k == "partial":
            partial = True
    return tuple(split), partial


def _has_partial(t: Tensor) -> bool:
    return is_dtensor(t) and _placement_info(t.placements)[1]


def _mesh_reduce_dims(t: Tensor) -> tuple | None:
    """(mesh, dims) over which a whole-tensor reduction of DTensor ``t`` combines local results: the mesh
    dims whose placement splits the tensor (size-1 mesh dims are skipped when reducing). None for plain
    tensors and for DTensors that no placement splits."""
    if not is_dtensor(t):
        return None
    dims = _placement_info(t.placements)[0]
    if not dims:
        return None
    return (t.device_mesh, dims)


_PLANS: dict[tuple[int, tuple[int, ...]], tuple] = {}


def _plan(key: tuple | None) -> tuple | None:
    """``((mesh, d), ...)`` for a (mesh, dims) key; the same tuple object for the same key (cached, holding
    the mesh, so its id stays valid), which lets :func:`_group_order` bucket equal plans by identity."""
    if key is None:
        return None
    mesh, dims = key
    ck = (id(mesh), dims)
    hit = _PLANS.get(ck)
    if hit is None or hit[0][0] is not mesh:
        if len(_PLANS) >= 256:
            _PLANS.clear()
        hit = _PLANS[ck] = tuple((mesh, d) for d in dims)
    return hit


def _group_order(plans: Sequence[Sequence[tuple] | None]) -> list[tuple[object, list[int]]]:
    """[(process group, indices of the values that need it)] in order of first appearance.

    ``plans[i]`` lists pairs (mesh, mesh dim) that value ``i`` must be reduced over. Groups are told apart by
    their ranks, so equal meshes and a sub-mesh and its root share one entry; size-1 mesh dims are dropped.
    Every rank builds the same order from the same (SPMD) tensor list.
    """
    import torch.distributed as dist

    # equal plans (the same cached tuple, or equal contents) first share one index list
    same: dict[int, tuple[Sequence[tuple], list[int]]] = {}
    for i, plan in enumerate(plans):
        if not plan:
            continue
        entry = same.get(id(plan))
        if entry is None:
            entry = same[id(plan)] = (plan, [])
        entry[1].append(i)
    order: list[tuple[object, list[int]]] = []
    by_ranks: dict[tuple[int, ...], tuple[object, set[int]]] = {}
    resolved: dict[tuple[int, int], tuple[object, tuple[int, ...]] | None] = {}
    for plan, idx in same.values():
        for mesh, d in plan:
            key = (id(mesh), d)
            if key not in resolved:
                if mesh.size(d) == 1:
                    resolved[key] = None
                else:
                    pg = mesh.get_group(d)
                    resolved[key] = (pg, tuple(dist.get_process_group_ranks(pg)))
            hit = resolved[key]
            if hit is None:
                continue
            entry = by_ranks.get(hit[1])
            if entry is None:
                entry = by_ranks[hit[1]] = (hit[0], set())
                order.append(entry)  # type: ignore[arg-type]
            entry[1].update(idx)
    return [(pg, sorted(members)) for pg, members in order]


def _reduce_rows(values: list[Tensor], plans: Sequence[Sequence[tuple] | None], op) -> list[Tensor]:
    """``values[i]`` (any shapes) reduced with ``op`` over the groups of ``plans[i]``, out of place.

    One ``all_reduce`` per distinct process group and dtype: every value that needs a group is packed into
    one flat buffer for it.
    """
    import torch.distributed as dist

    out = list(values)
    for pg, idx in _group_order(plans):
        by_kind: dict = defaultdict(list)
        for i in idx:
            by_kind[(out[i].dtype, out[i].device)].append(i)
        for ids in by_kind.values():
            flat = torch.cat([out[i].reshape(-1) for i in ids])
            dist.all_reduce(flat, op=op, group=pg)
            for i, part in zip(ids, torch.split(flat, [out[i].numel() for i in ids])):
                out[i] = part.view(out[i].shape)
    return out


_INDEX_CACHE: dict[tuple, Tensor] = {}


def _index_tensor(idx: list[int], device: torch.device) -> Tensor:
    """``idx`` as an int64 tensor on ``device``, cached: the same layouts recur every step, so the host-to-
    device copy (which would wait for the device) happens once per layout, not once per step."""
    key = (device, tuple(idx))
    hit = _INDEX_CACHE.get(key)
    if hit is None:
        if len(_INDEX_CACHE) >= 64:
            _INDEX_CACHE.clear()
        hit = _INDEX_CACHE[key] = torch.tensor(idx, dtype=torch.int64, device=device)
    return hit


def _reduce_vector_(vec: Tensor, plans: Sequence[Sequence[tuple] | None], op) -> Tensor:
    """In place: entry ``i`` of the 1-D tensor ``vec`` reduced with ``op`` over the groups of ``plans[i]``.

    One ``all_reduce`` per distinct process group, on ``vec`` itself when every entry needs the group, on a
    slice when the entries are adjacent, else on a gathered copy (no per-entry kernels).
    """
    import torch.distributed as dist

    n = vec.numel()
    for pg, idx in _group_order(plans):
        if len(idx) == n:
            dist.all_reduce(vec, op=op, group=pg)
        elif idx[-1] - idx[0] + 1 == len(idx):
            part = vec[idx[0]: idx[-1] + 1]
            dist.all_reduce(part, op=op, group=pg)
        else:
            where = _index_tensor(idx, vec.device)
            buf = vec.index_select(0, where)
            dist.all_reduce(buf, op=op, group=pg)
            vec.index_copy_(0, where, buf)
    return vec


def _combine_partials(
    tensors: Sequence[Tensor], partials: Sequence[Tensor], op: str
) -> list[Tensor]:
    """Turn per-tensor local 0-d results into whole-tensor results across meshes.

    ``op`` is ``"sum"`` (e.g. sums of squares; combined in fp64, then cast back) or ``"max"``. One
    collective per distinct mesh-dim group, whatever the number of tensors.
    """
    plans = [_plan(_mesh_reduce_dims(t)) for t in tensors]
    if not any(plans):
        return list(partials)
    import torch.distributed as dist

    dtypes = [p.dtype for p in partials]
    if op == "sum":
        vec = _reduce_vector_(_stack(list(partials), torch.float64), plans, dist.ReduceOp.SUM)
    else:
        vec = _reduce_vector_(_stack(list(partials), None), plans, dist.ReduceOp.MAX)
    return _unstack(vec, dtypes)


def _pipeline_reduce(value: Tensor, op, group: object) -> Tensor:
    """``value`` all-reduced across the pipeline-stage group (``value`` itself for ``None``).

    The wire format is fixed (fp64, the same shape for every caller of one function), so stages whose
    tensors differ in dtype, or that hold no tensors at all, still match. Returned in ``value``'s dtype."""
    if group is None:
        return value
    import torch.distributed as dist

    wire = value.detach().to(torch.float64, copy=True)
    dist.all_reduce(wire, op=op, group=group)
    return wire.to(value.dtype)


def _group_device(group: object) -> torch.device:
    """Where a stage without tensors puts its share of a pipeline reduction (the backend's device)."""
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_flag_(flag: Tensor, tensors: Sequence[Tensor], *, pipeline_group: object = _UNSET) -> Tensor:
    """Make a 0-d 0/1 flag (e.g. ``found_inf``) agree on every rank holding a shard of ``tensors``.

    Takes the maximum over every dim of every mesh that a DTensor in ``tensors`` lives on (replicated ranks
    agree too): one ``all_reduce`` over the whole world when one of the meshes spans it, else one per
    distinct mesh-dim group; then across the pipeline stages when a pipeline group is set. Plain tensors
    need no reduction. In place; returns ``flag``.
    """
    meshes = {}
    for t in tensors:
        if is_dtensor(t):
            meshes.setdefault(id(t.device_mesh), t.device_mesh)
    group = _pp(pipeline_group)
    if not meshes and group is None:
        return flag
    import torch.distributed as dist

    if meshes:
        world = dist.get_world_size()
        if any(m.size() == world for m in meshes.values()):
            if world > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        else:
            plan = [(m, d) for m in meshes.values() for d in range(m.ndim)]
            flag.copy_(_reduce_rows([flag.clone()], [plan], dist.ReduceOp.MAX)[0])
    if group is not None:
        flag.copy_(_pipeline_reduce(flag, dist.ReduceOp.MAX, group))
    return flag


def _partial_plan(t: Tensor) -> list[tuple[str, object, int]]:
    """[(reduce op, mesh, mesh dim)] for the Partial placements of DTensor ``t``."""
    mesh = t.device_mesh
    return [(str(p.reduce_op), mesh, i) for i, p in enumerate(t.placements) if p.is_partial()]


_PARTIAL_OPS = ("sum", "avg", "max", "min", "product")


def _reduce_partials(
    tensors: Sequence[Tensor], targets: Sequence[Tensor | None] | None = None
) -> list[Tensor]:
    """Out of place: every DTensor with ``Partial`` placements reduced over those mesh dims (batched: one
    all-reduce per reduce op, distinct mesh-dim group and dtype), laid out like ``targets[i]`` when given
    (a Replicate→Shard step is a local cut), else with Replicate on the reduced dims. Others pass through."""
    import torch.distributed as dist

    out = list(tensors)
    todo = [i for i, t in enumerate(tensors) if _has_partial(t)]
    if not todo:
        return out
    rops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
            "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}
    plans = {i: _partial_plan(tensors[i]) for i in todo}
    unknown = sorted({op for pl in plans.values() for op, _, _ in pl} - set(_PARTIAL_OPS))
    if unknown:
        raise TypeError(f"Partial placement with reduce op {unknown[0]!r} cannot be reduced")
    vals = {i: local(tensors[i]) for i in todo}
    for op in _PARTIAL_OPS:
        ids = [i for i in todo if any(o == op for o, _, _ in plans[i])]
        if not ids:
            continue
        red = _reduce_rows([vals[i] for i in ids], [[(m, d) for o, m, d in plans[i] if o == op] for i in ids],
                           rops[op])
        for i, r in zip(ids, red):
            if op == "avg":
                n = math.prod(m.size(d) for o, m, d in plans[i] if o == "avg")
                r = r / n
            vals[i] = r
    from torch.distributed.tensor import Replicate

    for i in todo:
        t = tensors[i]
        placements = [Replicate() if p.is_partial() else p for p in t.placements]
        new = _dtensor_class().from_local(  # type: ignore[union-attr]
            vals[i].contiguous(), t.device_mesh, placements, run_check=False, shape=t.shape, stride=t.stride()
        )
        target = None if targets is None else targets[i]
        if target is not None and is_dtensor(target) and tuple(target.placements) != tuple(placements):
            want = [tp if p.is_partial() else p for p, tp in zip(t.placements, target.placements)]
            new = new.redistribute(t.device_mesh, want)
        out[i] = new
    return out


def reduce_partial_grads_(params: Iterable[Tensor]) -> int:
    """Reduce the ``Partial`` placements of the parameters' DTensor gradients, in place (``p.grad`` is
    replaced by the reduced DTensor laid out like ``p`` on those mesh dims); returns how many were reduced.

    Tensor parallelism leaves the gradient of a replicated parameter used on sharded activations (a
    LayerNorm weight under sequence parallelism) ``Partial``: every rank holds a partial sum. Applying it
    shard-locally lets the replicas diverge and gives wrong norms, so call this before any norm or update
    (``torch.optim`` gets the same reduction through DTensor dispatch). Batched: one all-reduce per reduce op,
    distinct mesh-dim group and dtype. Plain and non-``Partial`` gradients cost one type check each.
    """
    if _dtensor_class() is None:  # no DTensor can exist: nothing to do, no per-parameter work
        return 0
    ps = [p for p in params if p.grad is not None and _has_partial(p.grad)]
    if not ps:
        return 0
    new = _reduce_partials([p.grad for p in ps], ps)
    for p, g in zip(ps, new):
        p.grad = g
    return len(ps)
