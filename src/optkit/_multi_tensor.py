"""The one multi-tensor layer: every per-parameter computation in optkit goes through here.

Design (see ``shared/spec/perf_baseline.md``): on CPU every ``torch._foreach_*`` op is one full pass over
memory, while torch's fused kernels (``_fused_sgd_``, ``_amp_foreach_non_finite_check_and_unscale_``) run at
the memory-bandwidth floor. So this module

* groups tensors by (device, dtype) once, so each kernel sees homogeneous lists;
* offers a handful of grouped kernels (norms, scale, clamp, lerp, max-abs, the fused non-finite check);
* handles ``None`` entries and sparse COO gradients in one place (sparse tensors contribute their raw
  ``values()``, duplicates included, exactly as TF's ``IndexedSlices`` do);
* reduces whole-tensor quantities of ``DTensor`` inputs across their device mesh, with one collective per
  (mesh, mesh-dim) group rather than one per parameter, so a norm is the norm of the *whole* tensor even
  when every rank holds a shard, and parameters living on several meshes combine into one global value.

Nothing here calls ``.item()`` or branches on a tensor value: results stay on the device.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

__all__ = [
    "is_dtensor",
    "local",
    "values_of",
    "present",
    "group_by_device_dtype",
    "acc_dtype",
    "norms",
    "sum_of_squares",
    "global_norm",
    "max_abs",
    "scale_",
    "clamp_",
    "lerp_",
    "non_finite_check_and_unscale_",
    "any_non_finite",
    "reduce_flag_",
    "blocks",
    "norms_along",
]

# ------------------------------------------------------------------------------------------------------------
# tensor views


def _dtensor_class() -> type | None:
    """``torch.distributed.tensor.DTensor`` if that module is loaded, else None. Not importing it here keeps
    ``import optkit`` light (it costs about as much as ``import torch``); no DTensor can exist before it is
    imported, so a tensor cannot be one while this returns None."""
    mod = sys.modules.get("torch.distributed.tensor")
    return None if mod is None else getattr(mod, "DTensor", None)


def is_dtensor(t: object) -> bool:
    """True when ``t`` is a ``torch.distributed.tensor.DTensor``."""
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def local(t: Tensor) -> Tensor:
    """The tensor a kernel can operate on: the local shard of a DTensor, else ``t`` itself."""
    if is_dtensor(t):
        return t._local_tensor  # type: ignore[attr-defined]
    return t


def values_of(t: Tensor) -> Tensor:
    """The dense values a kernel sees: local shard for DTensors, raw ``values()`` for sparse COO tensors.

    Raw values of an uncoalesced sparse tensor keep duplicate rows, matching TF's treatment of
    ``IndexedSlices`` in ``global_norm`` and ``clip_by_global_norm``.
    """
    t = local(t)
    if t.is_sparse:
        return t._values()
    return t


def present(tensors: Iterable[Tensor | None]) -> list[Tensor]:
    """The non-``None`` entries of ``tensors``, in order."""
    return [t for t in tensors if t is not None]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for reductions: fp64 for fp64 input, fp32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


_PLAIN_TYPES = (Tensor, torch.nn.Parameter)


def _all_plain(tensors: Sequence[Tensor]) -> bool:
    """True when every entry is exactly a ``Tensor`` or ``nn.Parameter`` (no DTensor, no other subclass).

    A type check costs ~50 ns per tensor, much less than :func:`local` on each; it gates the fast paths.
    """
    return all(type(t) in _PLAIN_TYPES for t in tensors)


def _values_list(tensors: Sequence[Tensor]) -> list[Tensor]:
    """``[values_of(t) for t in tensors]``, without the per-tensor calls when all are plain dense tensors."""
    if all(type(t) in _PLAIN_TYPES and not t.is_sparse for t in tensors):
        return list(tensors)
    return [values_of(t) for t in tensors]


def group_by_device_dtype(
    *tensor_lists: Sequence[Tensor],
) -> dict[tuple[torch.device, torch.dtype], tuple[list[int], tuple[list[Tensor], ...]]]:
    """Group parallel tensor lists by the (device, dtype) of the first list.

    Returns ``{(device, dtype): (indices, (list0, list1, ...))}`` where ``listK`` holds the local views
    (DTensor shards) of ``tensor_lists[K]`` at ``indices``. Lists must have equal length. Indices within a
    group are increasing. Plain tensors take torch's C++ grouping (about 0.3 us per tensor instead of ~1 us).
    """
    if all(_all_plain(lst) for lst in tensor_lists):
        try:
            grouped = torch._C._group_tensors_by_device_and_dtype([list(x) for x in tensor_lists], True)
        except RuntimeError:  # e.g. parallel lists that disagree on device or dtype: Python grouping below
            pass
        else:
            return {key: (list(idx), tuple(list(x) for x in lists)) for key, (lists, idx) in grouped.items()}
    first = tensor_lists[0]
    out: dict = {}
    for i, t in enumerate(first):
        lt = local(t)
        key = (lt.device, lt.dtype)
        entry = out.get(key)
        if entry is None:
            entry = ([], tuple([] for _ in tensor_lists))
            out[key] = entry
        entry[0].append(i)
        for k, lst in enumerate(tensor_lists):
            entry[1][k].append(local(lst[i]))
    return out


# ------------------------------------------------------------------------------------------------------------
# mesh reductions (DTensor)


def _mesh_reduce_dims(t: Tensor) -> tuple | None:
    """(mesh, dims) over which a whole-tensor reduction of DTensor ``t`` must combine local results."""
    if not is_dtensor(t):
        return None
    dims = tuple(i for i, p in enumerate(t.placements) if p.is_shard() or p.is_partial())
    if not dims:
        return None
    return (t.device_mesh, dims)


def _all_reduce_over(mesh, dims: tuple[int, ...], value: Tensor, op) -> Tensor:
    import torch.distributed as dist

    for d in dims:
        dist.all_reduce(value, op=op, group=mesh.get_group(d))
    return value


def _combine_partials(
    tensors: Sequence[Tensor], partials: Sequence[Tensor], op: str
) -> list[Tensor]:
    """Turn per-tensor local partial results into whole-tensor results across meshes.

    ``op`` is ``"sum"`` (partials are sums of squares) or ``"max"``. Batched: one collective per
    (mesh, dims) group.
    """
    buckets: dict = defaultdict(list)
    for i, t in enumerate(tensors):
        key = _mesh_reduce_dims(t)
        if key is not None:
            buckets[key].append(i)
    if not buckets:
        return list(partials)
    import torch.distributed as dist

    out = list(partials)
    rop = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
    for (mesh, dims), idx in buckets.items():
        stacked = torch.stack([partials[i] for i in idx])
        _all_reduce_over(mesh, dims, stacked, rop)
        for j, i in enumerate(idx):
            out[i] = stacked[j]
    return out


def reduce_flag_(flag: Tensor, tensors: Sequence[Tensor]) -> Tensor:
    """Make a 0-d 0/1 flag (e.g. ``found_inf``) agree on every rank holding a shard of ``tensors``.

    Takes the maximum over every mesh that any DTensor in ``tensors`` lives on (all of its dims, so replicated
    ranks agree too). Plain tensors need no reduction. In place; returns ``flag``.
    """
    meshes = {}
    for t in tensors:
        if is_dtensor(t):
            meshes[id(t.device_mesh)] = t.device_mesh
    if not meshes:
        return flag
    import torch.distributed as dist

    for mesh in meshes.values():
        _all_reduce_over(mesh, tuple(range(mesh.ndim)), flag, dist.ReduceOp.MAX)
    return flag


# ------------------------------------------------------------------------------------------------------------
# reductions


def _foreach_norm(ts: list[Tensor], ord: float, dtype: torch.dtype) -> list[Tensor]:
    if ord != 2 and any(t.numel() == 0 for t in ts):
        # torch's inf-norm has no identity for empty tensors; their max-abs is 0 by convention.
        full = [i for i, t in enumerate(ts) if t.numel() > 0]
        out = [torch.zeros((), dtype=dtype, device=t.device) for t in ts]
        if full:
            for i, r in zip(full, _foreach_norm([ts[i] for i in full], ord, dtype)):
                out[i] = r
        return out
    if ord == math.inf and ts[0].device.type == "cpu":
        # torch's CPU inf-norm kernel is ~10x slower than its L2 norm; aminmax is a vectorised single read
        # pass at L2-norm speed. max(|min|, |max|) is the max-abs; NaN propagates through aminmax/maximum.
        mm = [torch.aminmax(t) for t in ts]
        mins = torch.stack([m[0] for m in mm]).to(dtype)
        maxs = torch.stack([m[1] for m in mm]).to(dtype)
        return list(torch.maximum(maxs.abs(), mins.abs()).unbind(0))
    if ts[0].dtype == dtype:
        return list(torch._foreach_norm(ts, ord))
    try:
        return list(torch._foreach_norm(ts, ord, dtype=dtype))
    except (TypeError, RuntimeError):  # pragma: no cover - older torch without the dtype argument
        return [torch.linalg.vector_norm(t, ord, dtype=dtype) for t in ts]


def norms(tensors: Sequence[Tensor], ord: float = 2.0) -> list[Tensor]:
    """Per-tensor norms of every element, accumulated in fp32 (fp64 for fp64 input).

    ``ord`` is 2 (L2) or ``inf`` (max-abs). Sparse tensors use their raw values. DTensors give the norm of
    the whole tensor: local partials are combined across the mesh. Empty input gives an empty list.
    """
    if len(tensors) == 0:
        return []
    vals = _values_list(tensors)
    out: list[Tensor | None] = [None] * len(vals)
    for (_, dtype), (idx, (group,)) in group_by_device_dtype(vals).items():
        res = _foreach_norm(group, ord, acc_dtype(dtype))
        for i, r in zip(idx, res):
            out[i] = r
    if not _all_plain(tensors) and any(is_dtensor(t) for t in tensors):
        if ord == 2:
            sq = _combine_partials(tensors, [r * r for r in out], "sum")
            out = [s.sqrt() for s in sq]
        else:
            out = _combine_partials(tensors, out, "max")
    return out  # type: ignore[return-value]


def _common_result(parts: list[Tensor]) -> tuple[torch.dtype, torch.device]:
    dtype = torch.float64 if any(p.dtype == torch.float64 for p in parts) else torch.float32
    return dtype, parts[0].device


def sum_of_squares(tensors: Sequence[Tensor | None]) -> Tensor:
    """Σ over tensors and elements of x², as a 0-d fp32 (fp64 if any input is fp64) tensor.

    ``None`` entries are skipped; an empty or all-``None`` list gives 0.0 (TF's ``global_norm`` of ``[]``).
    """
    ts = present(tensors)
    if not ts:
        return torch.zeros((), dtype=torch.float32)
    n = norms(ts, 2.0)
    dtype, device = _common_result(n)
    stacked = torch.stack([x.to(device=device, dtype=dtype) for x in n])
    return (stacked * stacked).sum()


def global_norm(tensors: Sequence[Tensor | None]) -> Tensor:
    """sqrt(Σ_i ‖t_i‖²) over the non-``None`` entries, fp32 accumulation (fp64 for fp64 input).

    The norm over all tensors as one vector (TF ``tf.linalg.global_norm``); DTensor shards are combined
    across their meshes, several meshes included. Without DTensors, each (device, dtype) group is reduced
    as ``vector_norm(stack(_foreach_norm(group)))`` (``torch.nn.utils.get_total_norm``'s arithmetic, without
    its per-tensor ``.to``), and the group results are combined the same way.
    """
    ts = present(tensors)
    if not ts:
        return torch.zeros((), dtype=torch.float32)
    if _all_plain(ts):
        parts = []
        for (_, dtype), (_, (group,)) in group_by_device_dtype(_values_list(ts)).items():
            res = _foreach_norm(group, 2.0, acc_dtype(dtype))
            parts.append(res[0] if len(res) == 1 else torch.linalg.vector_norm(torch.stack(res)))
        dtype, device = _common_result(parts)
        if len(parts) == 1:
            return parts[0].to(dtype)
        return torch.linalg.vector_norm(torch.stack([x.to(device=device, dtype=dtype) for x in parts]))
    n = norms(ts, 2.0)
    dtype, device = _common_result(n)
    if len(n) == 1:
        return n[0].to(dtype)
    return torch.linalg.vector_norm(torch.stack([x.to(device=device, dtype=dtype) for x in n]))


def max_abs(tensors: Sequence[Tensor | None]) -> Tensor:
    """max over tensors and elements of |x| (NaN if any element is NaN), 0-d fp32; 0.0 for no tensors."""
    ts = present(tensors)
    if not ts:
        return torch.zeros((), dtype=torch.float32)
    n = norms(ts, math.inf)
    dtype, device = _common_result(n)
    return torch.stack([x.to(device=device, dtype=dtype) for x in n]).amax()


def any_non_finite(tensors: Sequence[Tensor | None]) -> Tensor:
    """0-d fp32 flag: 1.0 if any element of any tensor is NaN or ±inf, else 0.0 (read-only pass)."""
    ts = present(tensors)
    if not ts:
        return torch.zeros((), dtype=torch.float32)
    vals = [values_of(t) for t in ts]
    worst = []
    for (_, dtype), (_, (group,)) in group_by_device_dtype(vals).items():
        # the largest per-tensor norm is finite iff every element is finite (NaN propagates through amax);
        # no squaring, so large finite gradients are not mistaken for overflow
        worst.append(torch.stack(_foreach_norm(group, 2.0, acc_dtype(dtype))).amax().to(torch.float64))
    flag = (~torch.isfinite(torch.stack(worst).amax())).to(torch.float32)
    return reduce_flag_(flag, ts)


def sum_of_squares_raw(ts: Sequence[Tensor]) -> Tensor:
    """Like :func:`sum_of_squares` but without mesh reduction (local shards only)."""
    vals = _values_list(ts)
    parts = []
    for (_, dtype), (_, (group,)) in group_by_device_dtype(vals).items():
        res = _foreach_norm(group, 2.0, acc_dtype(dtype))
        s = torch.stack(res)
        parts.append((s * s).sum())
    dtype = torch.float64 if any(p.dtype == torch.float64 for p in parts) else torch.float32
    return torch.stack([p.to(dtype=dtype, device=parts[0].device) for p in parts]).sum()


# ------------------------------------------------------------------------------------------------------------
# in-place kernels


def scale_(tensors: Sequence[Tensor | None], scale: float | Tensor | Sequence[Tensor]) -> None:
    """t ← t·s for every non-``None`` tensor (sparse: values scaled). ``scale`` is a number, a 0-d tensor
    shared by all, or one 0-d tensor per tensor."""
    ts = present(tensors)
    if not ts:
        return
    per_tensor = isinstance(scale, (list, tuple))
    if per_tensor:
        scales = [s for t, s in zip(tensors, scale) if t is not None]
    vals = _values_list(ts)
    for (device, dtype), (idx, (group,)) in group_by_device_dtype(vals).items():
        if per_tensor:
            s = [scales[i].to(device=device, dtype=acc_dtype(dtype)) for i in idx]
            torch._foreach_mul_(group, s)
        elif isinstance(scale, Tensor):
            # Keep the factor in fp32 for half groups: the product is then rounded once (exact-product
            # rounding); casting the factor to fp16/bf16 first adds a second, larger rounding error.
            torch._foreach_mul_(group, scale.to(device=device, dtype=acc_dtype(dtype)))
        elif acc_dtype(dtype) != dtype:  # a Python scalar would be rounded to fp16/bf16 first
            torch._foreach_mul_(group, torch.tensor(float(scale), dtype=torch.float32, device=device))
        else:
            torch._foreach_mul_(group, float(scale))


def clamp_(tensors: Sequence[Tensor | None], min_value: float, max_value: float) -> None:
    """t ← clamp(t, min, max) elementwise for every non-``None`` tensor (sparse: values)."""
    ts = present(tensors)
    if not ts:
        return
    vals = _values_list(ts)
    for _, (_, (group,)) in group_by_device_dtype(vals).items():
        torch._foreach_clamp_min_(group, min_value)
        torch._foreach_clamp_max_(group, max_value)


def lerp_(targets: Sequence[Tensor], sources: Sequence[Tensor], weight: float | Tensor) -> None:
    """target ← target + w·(source − target), one pass per (device, dtype) group.

    ``weight`` may be a 0-d tensor (e.g. zero on a skipped step), so no host sync is needed.
    """
    if len(targets) == 0:
        return
    for (device, dtype), (_, (tg, src)) in group_by_device_dtype(targets, sources).items():
        if isinstance(weight, Tensor):
            w = weight.to(device=device, dtype=dtype)
            torch._foreach_lerp_(tg, src, [w] * len(tg))
        else:
            torch._foreach_lerp_(tg, src, float(weight))


def blocks(
    lists: Sequence[Sequence[Tensor]], block_numel: int = 1 << 20
) -> list[tuple[list[int], tuple[list[Tensor], ...]]]:
    """Cut parallel tensor lists into cache-sized blocks for a chain of elementwise kernels.

    On CPU each kernel of a chain is a full sweep over memory; running the whole chain block by block keeps
    the block in cache between kernels, so the chain costs about one sweep. Returns a list of
    ``(owner_indices, (list0_chunks, list1_chunks, ...))`` where ``owner_indices[j]`` is the index of the
    tensor chunk ``j`` came from. Tensors larger than ``block_numel`` are split into flat chunk views when
    every tensor at that position is contiguous with the same shape; otherwise they stay whole. Small tensors
    are packed together until a block holds about ``block_numel`` elements.
    """
    out: list = []
    cur_idx: list[int] = []
    cur: tuple[list[Tensor], ...] = tuple([] for _ in lists)
    cur_n = 0

    def flush():
        nonlocal cur_idx, cur, cur_n
        if cur_idx:
            out.append((cur_idx, cur))
        cur_idx, cur, cur_n = [], tuple([] for _ in lists), 0

    first = lists[0]
    for i in range(len(first)):
        ts = [lst[i] for lst in lists]
        n = ts[0].numel()
        splittable = n > block_numel and all(t.is_contiguous() and t.shape == ts[0].shape for t in ts)
        if not splittable:
            cur_idx.append(i)
            for k, t in enumerate(ts):
                cur[k].append(t)
            cur_n += n
            if cur_n >= block_numel:
                flush()
            continue
        flush()
        flats = [t.view(-1) for t in ts]
        for start in range(0, n, block_numel):
            stop = min(start + block_numel, n)
            out.append(([i], tuple([f[start:stop]] for f in flats)))
    flush()
    return out


def non_finite_check_and_unscale_(
    grads: Sequence[Tensor | None], found_inf: Tensor, inv_scale: Tensor
) -> Tensor:
    """g ← g·inv_scale in place and found_inf ← 1 if any element is NaN/±inf (one fused pass per group).

    Uses ``torch._amp_foreach_non_finite_check_and_unscale_``, falling back to a norm-based check for dtypes
    the fused kernel does not take. ``found_inf`` is a 0-d fp32 tensor that is OR-ed into, so a caller can
    accumulate over several calls. DTensor shards: the flag is made to agree across their meshes.
    """
    ts = present(grads)
    if not ts:
        return found_inf
    vals = _values_list(ts)
    for (device, dtype), (_, (group,)) in group_by_device_dtype(vals).items():
        fi = found_inf if found_inf.device == device else torch.zeros((), device=device)
        inv = inv_scale.to(device=device, dtype=torch.float32)
        try:
            torch._amp_foreach_non_finite_check_and_unscale_(group, fi, inv)
        except RuntimeError:  # pragma: no cover - dtype not supported by the fused kernel
            flag = (~torch.isfinite(sum_of_squares_raw(group))).to(torch.float32)
            fi.copy_(torch.maximum(fi, flag))
            torch._foreach_mul_(group, inv.to(dtype))
        if fi is not found_inf:
            found_inf.copy_(torch.maximum(found_inf, fi.to(found_inf.device)))
    return reduce_flag_(found_inf, ts)


# ------------------------------------------------------------------------------------------------------------
# out-of-place kernels (out-of-place clipping, ``clipping.clip_by_global_norm``)


def _rebuild_like(orig: Tensor, new_values: Tensor) -> Tensor:
    """A tensor shaped like ``orig`` (sparse COO layout, DTensor placement) holding ``new_values``."""
    lt = local(orig)
    out = new_values
    if lt.is_sparse:
        out = torch.sparse_coo_tensor(
            lt._indices(), new_values, lt.shape, is_coalesced=lt.is_coalesced()
        )
    if is_dtensor(orig):
        out = _dtensor_class().from_local(  # type: ignore[union-attr]
            out, orig.device_mesh, orig.placements, run_check=False, shape=orig.shape, stride=orig.stride()
        )
    return out


def scaled_copies(
    tensors: Sequence[Tensor | None],
    scale: Tensor,
    out_dtypes: Sequence[torch.dtype] | None = None,
) -> list[Tensor | None]:
    """New tensors out_i = cast(t_i · s, out_dtypes[i]); ``None`` stays ``None``; inputs are not modified.

    The product is formed in fp32 (fp64 for fp64 input) and rounded once to the output dtype, so a half
    tensor comes back as round(fp32(t)·s). ``scale`` is a 0-d tensor shared by all entries; ``out_dtypes``
    defaults to each input's own dtype (OpenSeq2Seq casts to the *variable's* dtype instead). One foreach
    multiply per (device, dtype) group. Sparse COO entries keep their indices, size and coalesced flag with
    their raw values scaled; DTensor entries keep their mesh and placements.
    """
    out: list[Tensor | None] = [None] * len(tensors)
    where = [i for i, t in enumerate(tensors) if t is not None]
    if not where:
        return out
    vals = [values_of(tensors[i]) for i in where]
    for (device, dtype), (idx, (group,)) in group_by_device_dtype(vals).items():
        acc = acc_dtype(dtype)
        s = scale.to(device=device, dtype=acc)
        want = [dtype if out_dtypes is None else out_dtypes[where[j]] for j in idx]
        same = [k for k, w in enumerate(want) if w == dtype]
        other = [k for k, w in enumerate(want) if w != dtype]
        results: dict[int, Tensor] = {}
        if same:
            for k, r in zip(same, torch._foreach_mul([group[k] for k in same], s)):
                results[k] = r if r.dtype == dtype else r.to(dtype)  # a 0-d half input promotes to fp32
        if other:
            wide = [group[k].to(acc) for k in other]
            for k, r in zip(other, torch._foreach_mul(wide, s)):
                results[k] = r.to(want[k])
        for k, j in enumerate(idx):
            i = where[j]
            out[i] = _rebuild_like(tensors[i], results[k])  # type: ignore[arg-type]
    return out


def add_scaled_(targets: Sequence[Tensor | None], sources: Sequence[Tensor], alpha: float) -> None:
    """t ← t + alpha·s for every non-``None`` target (dense), one foreach pass per (device, dtype) group.

    Used by wrappers that add a multiple of the parameters to the gradients (e.g. LARC's apex/timm form
    ``g + wd·w``). ``sources`` are cast to the target's dtype per group when they differ.
    """
    pairs = [(t, s) for t, s in zip(targets, sources) if t is not None]
    if not pairs:
        return
    tg = [local(t) for t, _ in pairs]
    src = [local(s) for _, s in pairs]
    for (_, dtype), (_, (g_t, g_s)) in group_by_device_dtype(tg, src).items():
        g_s = [s if s.dtype == dtype else s.to(dtype) for s in g_s]
        torch._foreach_add_(g_t, g_s, alpha=float(alpha))


def commit_(targets: Sequence[Tensor], new_values: Sequence[Tensor], skip: Tensor | None = None) -> None:
    """target ← new value, or (``skip`` a 0-d bool tensor that is True) leave every target unchanged.

    For update rules without a fused kernel that takes ``found_inf``: the new values are computed out of
    place, then written back here. With ``skip`` given, non-finite new values (from the gradients that caused
    the skip) leave no trace, unlike a blend ``t + 0·(new − t)``; that path costs one ``torch.where`` per
    tensor, without a host sync.
    """
    if len(targets) == 0:
        return
    if skip is None:
        torch._foreach_copy_(list(targets), list(new_values))
        return
    for t, n in zip(targets, new_values):
        torch.where(skip.to(t.device), t, n.to(t.dtype), out=t)


# ------------------------------------------------------------------------------------------------------------
# norms along dims (variable clipping), mesh-aware


def _crossing_mesh_dims(t: Tensor, dims: tuple[int, ...]) -> tuple | None:
    """(mesh, mesh dims whose Shard splits one of ``dims``) for DTensor ``t``, or None if no reduction."""
    if not is_dtensor(t):
        return None
    cross = tuple(i for i, p in enumerate(t.placements) if p.is_shard() and p.dim % t.ndim in dims)
    return (t.device_mesh, cross) if cross else None


def norms_along(tensors: Sequence[Tensor], dims: Sequence[Sequence[int]]) -> list[Tensor]:
    """Per-tensor L2 norms over ``dims[i]`` with ``keepdim=True``: sqrt(Σ_{dims} x²), fp32 accumulation
    (fp64 for fp64 input); TF ``clip_by_norm(axes=...)``'s norm.

    DTensors give the local-shard-shaped slice of the whole tensor's norms: when a reduced dim is split by a
    ``Shard`` placement, local sums of squares are summed across that mesh dim (one collective per (mesh,
    mesh-dims) group, all such tensors flattened into one buffer); a dim not reduced keeps its sharding.
    """
    sq: list[Tensor] = []
    buckets: dict = defaultdict(list)
    for i, (t, d) in enumerate(zip(tensors, dims)):
        lt = local(t)
        red = tuple(sorted({k % max(t.ndim, 1) for k in d}))
        acc = acc_dtype(lt.dtype)
        sq.append(lt.to(acc).square().sum(dim=red, keepdim=True) if red else lt.to(acc).square())
        key = _crossing_mesh_dims(t, red)
        if key is not None:
            buckets[key].append(i)
    if buckets:
        import torch.distributed as dist

        for (mesh, mdims), idx in buckets.items():
            by_dtype: dict = defaultdict(list)
            for i in idx:
                by_dtype[sq[i].dtype].append(i)
            for ids in by_dtype.values():
                flat = torch.cat([sq[i].reshape(-1) for i in ids])
                _all_reduce_over(mesh, mdims, flat, dist.ReduceOp.SUM)
                for i, part in zip(ids, torch.split(flat, [sq[i].numel() for i in ids])):
                    sq[i] = part.view(sq[i].shape)
    return [s.sqrt() for s in sq]


def scale_local_(tensors: Sequence[Tensor], scale: Tensor, key: tuple | None) -> None:
    """:func:`scale_` for plain local tensors; ``key`` = their common (device, dtype) when the caller knows
    it (one foreach kernel, no per-tensor Python work), else None (the general path)."""
    if key is None:
        scale_(tensors, scale)
        return
    device, dtype = key
    torch._foreach_mul_(list(tensors), scale.to(device=device, dtype=acc_dtype(dtype)))


def lerp_local_(
    targets: Sequence[Tensor], sources: Sequence[Tensor], weight: Tensor, key: tuple | None
) -> None:
    """:func:`lerp_` for plain local tensors of one known (device, dtype) ``key`` (else the general path)."""
    if key is None:
        lerp_(targets, sources, weight)
        return
    device, dtype = key
    w = weight.to(device=device, dtype=dtype)
    torch._foreach_lerp_(list(targets), list(sources), [w] * len(targets))
