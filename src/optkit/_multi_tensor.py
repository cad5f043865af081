"""The one multi-tensor layer: every per-parameter computation in optkit goes through here.

Design (measured with torch 2.13): on CPU every ``torch._foreach_*`` op is one full pass over
memory, while torch's fused kernels (``_fused_sgd_``, ``_amp_foreach_non_finite_check_and_unscale_``) run at
the memory-bandwidth floor. So this module

* groups tensors by (device, dtype) once, so each kernel sees homogeneous lists (:mod:`optkit._tensors`);
* offers a handful of grouped kernels (norms, scale, clamp, lerp, max-abs, the fused non-finite check);
* handles ``None`` entries and sparse COO gradients in one place (sparse tensors contribute their raw
  ``values()``, duplicates included, exactly as TF's ``IndexedSlices`` do);
* reduces whole-tensor quantities of ``DTensor`` inputs across their device mesh, with one collective per
  mesh-dim process group rather than one per parameter, so a norm is the norm of the *whole* tensor even
  when every rank holds a shard, and parameters living on several meshes combine into one global value
  (the reductions are :mod:`optkit._mesh_reduce`).

The names of those two modules that other modules use are also this module's (``mt.local``,
``mt.reduce_partial_grads_``).

Nothing here calls ``.item()`` or branches on a tensor value: results stay on the device.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from ._mesh_reduce import (  # noqa: F401 (reduce_partial_grads_, set/get_pipeline_group: mt's API)
    _UNSET,
    _combine_partials,
    _group_device,
    _group_order,
    _has_partial,
    _index_tensor,
    _mesh_reduce_dims,
    _pipeline_reduce,
    _plan,
    _pp,
    _reduce_partials,
    _reduce_rows,
    _reduce_vector_,
    _split_dim,
    get_pipeline_group,
    reduce_flag_,
    reduce_partial_grads_,
    set_pipeline_group,
)
from ._tensors import (  # noqa: F401 (capturing, with_grads: mt's API)
    _all_plain,
    _dtensor_class,
    _stack,
    _unstack,
    _values_list,
    acc_dtype,
    capturing,
    group_by_device_dtype,
    is_dense,
    is_dtensor,
    local,
    present,
    scalar,
    values_of,
    with_grads,
)

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
    "inverse_scale",
    "clip_factor",
    "clamp_",
    "lerp_",
    "non_finite_check_and_unscale_",
    "any_non_finite",
    "reduce_flag_",
    "reduce_partial_grads_",
    "global_norm_and_found_inf",
    "set_pipeline_group",
    "get_pipeline_group",
    "blocks",
    "norms_along",
    "segment_expand",
    "ElementFactors",
    "stack_scalars",
]

# ------------------------------------------------------------------------------------------------------------
# reductions


#: L2 norms of contiguous CPU tensors at least this large are taken as norms of row norms (see
#: :func:`_row_norms`); smaller ones go through one ``torch._foreach_norm`` call.
ROW_NORM_MIN = 1 << 16
_ROW = 1024


def _row_norms(ts: list[Tensor], dtype: torch.dtype) -> list[Tensor] | None:
    """L2 norms of large contiguous CPU tensors as the norm of their 1024-element row norms, plus the tail:
    torch's CPU kernel reduces rows of a matrix about 1.7× faster than one long vector (4.8 vs 8.2 ms for
    23 tensors of 2^20 floats, read at memory speed), and the two-level sum is at least as accurate. None
    when no tensor qualifies; others get ``torch._foreach_norm``."""
    big = [i for i, t in enumerate(ts) if t.numel() >= ROW_NORM_MIN and t.device.type == "cpu"
           and t.is_contiguous()]
    if not big:
        return None
    out: list[Tensor | None] = [None] * len(ts)
    row_norms = []
    for i in big:
        flat = ts[i].view(-1)
        main = flat.numel() - flat.numel() % _ROW
        rows = torch.linalg.vector_norm(flat[:main].view(-1, _ROW), dim=1, dtype=dtype)
        if main < flat.numel():
            rows = torch.cat([rows, torch.linalg.vector_norm(flat[main:], dtype=dtype).reshape(1)])
        row_norms.append(rows)
    # the second level for all of them in one grouped call (one 2-thread kernel per tensor cost ~10 us each)
    for i, r in zip(big, torch._foreach_norm(row_norms)):
        out[i] = r
    rest = [i for i in range(len(ts)) if out[i] is None]
    if rest:
        for i, r in zip(rest, _foreach_norm([ts[i] for i in rest], 2.0, dtype, rows=False)):
            out[i] = r
    return out  # type: ignore[return-value]


def _foreach_norm(ts: list[Tensor], ord: float, dtype: torch.dtype, rows: bool = True) -> list[Tensor]:
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
    if rows and ord == 2:
        res = _row_norms(ts, dtype)
        if res is not None:
            return res
    if ts[0].dtype == dtype:
        return list(torch._foreach_norm(ts, ord))
    try:
        return list(torch._foreach_norm(ts, ord, dtype=dtype))
    except (TypeError, RuntimeError):  # pragma: no cover - older torch without the dtype argument
        return [torch.linalg.vector_norm(t, ord, dtype=dtype) for t in ts]


def norms(tensors: Sequence[Tensor], ord: float = 2.0) -> list[Tensor]:
    """Per-tensor norms of every element, accumulated in fp32 (fp64 for fp64 input).

    ``ord`` is 2 (L2) or ``inf`` (max-abs). Sparse tensors use their raw values. DTensors give the norm of
    the whole tensor: ``Partial`` values are reduced first, then local results are combined over the mesh
    dims that split the tensor (squares in fp64). Empty input gives an empty list.
    """
    if len(tensors) == 0:
        return []
    if _all_plain(tensors) or not any(is_dtensor(t) for t in tensors):
        return _local_norms(tensors, ord)
    import torch.distributed as dist

    if ord == 2:
        sq, _ = _global_squares(tensors)
        res = sq.sqrt()
    else:
        ts = _reduce_partials(tensors)
        local_res = _local_norms(ts, ord)
        res = _reduce_vector_(_stack(local_res, None), [_plan(_mesh_reduce_dims(t)) for t in ts],
                              dist.ReduceOp.MAX)
        return _unstack(res, [r.dtype for r in local_res])
    return _unstack(res, [acc_dtype(local(t).dtype) for t in tensors])


def _local_norms(tensors: Sequence[Tensor], ord: float) -> list[Tensor]:
    """Per-tensor norms of the local values (no mesh reduction), one kernel per (device, dtype) group."""
    vals = _values_list(tensors)
    out: list[Tensor | None] = [None] * len(vals)
    for (_, dtype), (idx, (group,)) in group_by_device_dtype(vals).items():
        res = _foreach_norm(group, ord, acc_dtype(dtype))
        for i, r in zip(idx, res):
            out[i] = r
    return out  # type: ignore[return-value]


def _global_squares(tensors: Sequence[Tensor]) -> tuple[Tensor, torch.dtype]:
    """(fp64 vector of each tensor's whole-tensor Σx², result dtype). ``Partial`` DTensors are reduced first;
    shards are summed over the mesh dims that split them (one collective per distinct mesh-dim group)."""
    import torch.distributed as dist

    ts = _reduce_partials(tensors) if not _all_plain(tensors) else list(tensors)
    local_res = _local_norms(ts, 2.0)
    dtype, _ = _common_result(local_res)
    v = _stack(local_res, torch.float64)
    v = v * v
    if not _all_plain(ts):
        plans = [_plan(_mesh_reduce_dims(t)) for t in ts]
        if any(plans):
            _reduce_vector_(v, plans, dist.ReduceOp.SUM)
    return v, dtype


def _common_result(parts: list[Tensor]) -> tuple[torch.dtype, torch.device]:
    dtype = torch.float64 if any(p.dtype == torch.float64 for p in parts) else torch.float32
    return dtype, parts[0].device


def _empty_total(group: object, op: str = "sum", n: int = 1) -> Tensor:
    """The fp64 total (shape ``()`` or ``(n,)``) of a stage with no tensors: zeros, still taking part in the
    pipeline reduction when one is set (same wire format as the stages with tensors)."""
    import torch.distributed as dist

    shape = () if n == 1 else (n,)
    if group is None:
        return torch.zeros(shape, dtype=torch.float64)
    zero = torch.zeros(shape, dtype=torch.float64, device=_group_device(group))
    return _pipeline_reduce(zero, dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group)


def sum_of_squares(tensors: Sequence[Tensor | None], *, pipeline_group: object = _UNSET) -> Tensor:
    """Σ over tensors and elements of x², as a 0-d fp32 (fp64 if any input is fp64) tensor.

    ``None`` entries are skipped; an empty or all-``None`` list gives 0.0 (TF's ``global_norm`` of ``[]``).
    Per-tensor results are combined in fp64; across the pipeline stages too when a pipeline group is set.
    """
    group = _pp(pipeline_group)
    ts = present(tensors)
    if not ts:
        return _empty_total(group).to(torch.float32)
    import torch.distributed as dist

    sq, dtype = _global_squares(ts)
    total = _pipeline_reduce(sq.sum(), dist.ReduceOp.SUM, group)
    return total.to(dtype)


def global_norm(tensors: Sequence[Tensor | None], *, pipeline_group: object = _UNSET) -> Tensor:
    """sqrt(Σ_i ‖t_i‖²) over the non-``None`` entries, fp32 accumulation (fp64 for fp64 input).

    The norm over all tensors as one vector (TF ``tf.linalg.global_norm``); DTensor shards are combined
    across their meshes, several meshes included (per-tensor squares summed in fp64, so the combination
    itself cannot overflow), and across the pipeline stages when a pipeline group is set. Plain tensors only:
    each (device, dtype) group is reduced as ``vector_norm(stack(_foreach_norm(group)))``
    (``torch.nn.utils.get_total_norm``'s arithmetic, without its per-tensor ``.to``), and the group results
    are combined the same way.
    """
    group = _pp(pipeline_group)
    ts = present(tensors)
    if not ts:
        return _empty_total(group).sqrt().to(torch.float32)
    if _all_plain(ts) and group is None:
        parts = []
        for (_, dtype), (_, (grp,)) in group_by_device_dtype(_values_list(ts)).items():
            res = _foreach_norm(grp, 2.0, acc_dtype(dtype))
            parts.append(res[0] if len(res) == 1 else torch.linalg.vector_norm(torch.stack(res)))
        dtype, device = _common_result(parts)
        if len(parts) == 1:
            return parts[0].to(dtype)
        return torch.linalg.vector_norm(torch.stack([x.to(device=device, dtype=dtype) for x in parts]))
    import torch.distributed as dist

    sq, dtype = _global_squares(ts)
    total = _pipeline_reduce(sq.sum(), dist.ReduceOp.SUM, group)
    return total.sqrt().to(dtype)


def max_abs(tensors: Sequence[Tensor | None], *, pipeline_group: object = _UNSET) -> Tensor:
    """max over tensors and elements of |x| (NaN if any element is NaN), 0-d fp32; 0.0 for no tensors.
    Across the pipeline stages too when a pipeline group is set."""
    group = _pp(pipeline_group)
    ts = present(tensors)
    if not ts:
        return _empty_total(group, "max").to(torch.float32)
    import torch.distributed as dist

    n = norms(ts, math.inf)
    dtype, device = _common_result(n)
    out = torch.stack([x.to(device=device, dtype=dtype) for x in n]).amax()
    return _pipeline_reduce(out, dist.ReduceOp.MAX, group)


_AMP_CHECK_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: contiguous CPU tensors at least this large are checked by a read-only pass (float32: scaled row sums;
#: other dtypes: ``torch.aminmax``), smaller ones by the AMP check kernel
CHECK_READ_MIN = 1 << 16
#: row length and scale of the float32 row-sum check: every row sums ``2^-12·x`` over 1024 elements, so a
#: row of finite values sums to at most ``FLT_MAX / 4`` (no finite overflow), and ``2^-12·x`` is exact
#: for every normal ``x`` above ``2^-114``
_FINITE_ROW = 1024
_FINITE_SCALE = 2.0 ** -12
_finite_weights: dict[torch.device, Tensor] = {}


def _finite_rows(t: Tensor) -> tuple[Tensor, Tensor | None]:
    """Row sums of ``2^-12·t`` over 1024-element rows of a contiguous float32 CPU tensor (one BLAS
    matrix-vector product: a read-only pass at memory speed, about 2.5 ms for 25M values here against 7 ms
    for ``aminmax``), and the tail that does not fill a row (None if none). Each sum is finite exactly when
    its row is: a NaN or ±inf propagates through the products and the additions (``+inf + −inf`` is NaN),
    and a finite row cannot overflow (:data:`_FINITE_SCALE`)."""
    w = _finite_weights.get(t.device)
    if w is None:
        w = _finite_weights[t.device] = torch.full((_FINITE_ROW,), _FINITE_SCALE, dtype=torch.float32,
                                                   device=t.device)
    flat = t.view(-1)
    main = flat.numel() - flat.numel() % _FINITE_ROW
    rows = torch.mv(flat[:main].view(-1, _FINITE_ROW), w)
    return rows, (flat[main:] if main < flat.numel() else None)


def _exact_cpu_matmul() -> bool:
    """Whether float32 matrix products on the CPU run in float32 (torch's default). With
    ``torch.set_float32_matmul_precision("medium")`` or ``torch.backends.mkldnn.matmul.fp32_precision =
    "bf16"`` oneDNN rounds the inputs to bfloat16, whose range ends below ``FLT_MAX``: a finite row could
    then sum to inf, so the row-sum check is not used."""
    try:
        return torch.backends.mkldnn.matmul.fp32_precision in ("none", "ieee")
    except (AttributeError, RuntimeError):  # pragma: no cover - torch without the per-backend setting
        try:
            return torch.get_float32_matmul_precision() == "highest"
        except RuntimeError:
            return False


def _device_one(device: torch.device) -> Tensor:
    """A 0-d float32 1.0 on ``device`` (the AMP check kernel's inverse scale), made once per device; not kept
    when made inside a CUDA graph capture (its memory would be the graph's)."""
    one = _ones.get(device)
    if one is None:
        one = torch.ones((), dtype=torch.float32, device=device)
        if not capturing(device) and not torch.compiler.is_compiling():
            _ones[device] = one
    return one


_ones: dict[torch.device, Tensor] = {}


def _local_non_finite(vals: list[Tensor], read_only: bool | None = None) -> Tensor | None:
    """0-d fp32 flag, 1.0 when an element of the local dense values ``vals`` is NaN or ±inf, all on one
    device. Small tensors go through torch's AMP check kernel (``_amp_foreach_non_finite_check_and_unscale_``
    with an inverse scale of 1: the values are rewritten unchanged, ``x·1 = x`` exactly in every float dtype),
    one kernel call per dtype group, ~0.5 µs instead of ~10 µs of dispatch per tensor. On the CPU
    (``read_only``: default, whether the device is the CPU) contiguous tensors of at least
    :data:`CHECK_READ_MIN` elements take a read-only pass (the AMP kernel writes every value back): float32
    ones scaled row sums (:func:`_finite_rows`, their tails the AMP kernel; not when float32 matrix products
    are set to run in lower precision, :func:`_exact_cpu_matmul`), others ``torch.aminmax`` (the extremes
    are finite exactly when every element is; NaN propagates). On an accelerator every tensor goes through
    the AMP kernel, as ``torch.amp.GradScaler.unscale_`` does: one launch per dtype group whatever the
    number of tensors (a read-only max-abs would be a chain of reductions, one launch per 128 tensors).

    None when the kernel cannot take the values: groups on several devices or not floating point, under
    ``torch.compile``, or a tensor the kernel refuses (one whose elements share memory, such as an expanded
    tensor: it raises before writing that tensor, and the values it already rewrote are unchanged); callers
    then take the per-tensor max-abs.
    """
    if torch.compiler.is_compiling():
        return None
    groups = group_by_device_dtype(vals)
    devices = {device for device, _ in groups}
    if len(devices) != 1 or any(dtype not in _AMP_CHECK_DTYPES for _, dtype in groups):
        return None
    device = devices.pop()
    if read_only is None:
        read_only = device.type == "cpu"
    found = torch.zeros((), dtype=torch.float32, device=device)
    one = torch.ones((), dtype=torch.float32) if device.type == "cpu" else _device_one(device)
    rows, big = [], []
    row_sums = read_only and _exact_cpu_matmul()
    try:
        for (_, dtype), (_, (group,)) in groups.items():
            small = []
            for t in group:
                if not read_only or t.numel() < CHECK_READ_MIN or not t.is_contiguous():
                    small.append(t)
                elif dtype == torch.float32 and row_sums:
                    r, tail = _finite_rows(t)
                    rows.append(r)
                    if tail is not None:
                        small.append(tail)
                else:
                    big.append(t)
            if small:
                torch._amp_foreach_non_finite_check_and_unscale_(small, found, one)
    except RuntimeError:
        return None
    if rows:
        big.append(rows[0] if len(rows) == 1 else torch.cat(rows))
    if big:
        mm = [torch.aminmax(t) for t in big]
        ends = torch.stack([x.to(torch.float64) for m in mm for x in m])
        found = torch.maximum(found, (~torch.isfinite(ends).all()).to(torch.float32))
    return found


def any_non_finite(tensors: Sequence[Tensor | None], *, pipeline_group: object = _UNSET) -> Tensor:
    """0-d fp32 flag: 1.0 if any element of any tensor is NaN or ±inf, else 0.0 (values unchanged).

    Decided from the elements only (torch's AMP check kernel on CPU, see :func:`_local_non_finite`, else a
    per-tensor max-abs, which is finite exactly when every element is): large finite values never count,
    whatever the number of ranks. The flag agrees on every rank of the tensors' meshes (and pipeline stages,
    when a pipeline group is set).
    """
    group = _pp(pipeline_group)
    ts = present(tensors)
    if not ts:
        return reduce_flag_(torch.zeros((), dtype=torch.float32), ts, pipeline_group=group)
    flag = _local_non_finite(_values_list(ts))
    if flag is None:
        worst = _local_norms(ts, math.inf)
        flag = (~torch.isfinite(_stack(worst, torch.float64).amax())).to(torch.float32)
    return reduce_flag_(flag, ts, pipeline_group=group)


def global_norm_and_found_inf(
    tensors: Sequence[Tensor | None], *, pipeline_group: object = _UNSET,
    compiled: Callable[[list[Tensor]], Tensor | None] | None = None,
) -> tuple[Tensor, Tensor]:
    """(:func:`global_norm`, :func:`any_non_finite`) with one collective per mesh-dim group for both.

    The overflow flag is decided from the elements (a per-tensor max-abs pass next to the L2 pass), never
    from the norm: a norm whose square overflows does not count as overflow, and the decision is the same on
    any number of ranks. Each tensor contributes ``0·max|t|`` (0, or NaN when it holds a NaN/inf) to the
    same fp64 sum as its squares, so the flag travels with the norm; replicated copies are identical, so
    summing over the splitting mesh dims is enough for every rank to agree.

    ``compiled``: for plain dense tensors on one device, a callable giving both sums per tensor in one read
    (:func:`optkit._core.chain.norm_check_sums` compiled), or None when it cannot (then the eager passes).
    """
    group = _pp(pipeline_group)
    ts = present(tensors)
    if not ts:
        totals = _empty_total(group, "sum", 2)
        return totals[0].sqrt().to(torch.float32), torch.isnan(totals[1]).to(torch.float32)
    import torch.distributed as dist

    if compiled is not None and _all_plain(ts) and not any(t.is_sparse for t in ts) \
            and len({t.device for t in ts}) == 1:
        v = compiled(ts)
        if v is not None:
            dtype = torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32
            totals = _pipeline_reduce(v.sum(0), dist.ReduceOp.SUM, group)
            return totals[0].sqrt().to(dtype), torch.isnan(totals[1]).to(torch.float32)

    ts = _reduce_partials(ts) if not _all_plain(ts) else ts
    l2 = _local_norms(ts, 2.0)
    dtype, _ = _common_result(l2)
    sq = _stack(l2, torch.float64)
    flag = _local_non_finite(_values_list(ts)) if _all_plain(ts) else None  # plain: no mesh sums below
    if flag is not None and group is None:
        # nothing to reduce: the same fp64 sum of squares as below, and the 0/1 flag is its own
        # isnan(Σ z) (a few one-element kernels fewer: they are the cost on a GPU)
        return (sq * sq).sum().sqrt().to(dtype), flag
    if flag is None:
        z = _stack(_local_norms(ts, math.inf), torch.float64) * 0.0
    else:  # NaN in one entry when some element is non-finite, as the per-tensor 0·max|t| would give
        z = torch.zeros(len(ts), dtype=torch.float64, device=sq.device)
        z[0] = torch.where(flag > 0, math.nan, 0.0)
    v = torch.cat([sq * sq, z])
    if not _all_plain(ts):
        plans = [_plan(_mesh_reduce_dims(t)) for t in ts]
        if any(plans):
            _reduce_vector_(v, plans + plans, dist.ReduceOp.SUM)
    n = len(ts)
    totals = _pipeline_reduce(torch.stack([v[:n].sum(), v[n:].sum()]), dist.ReduceOp.SUM, group)
    return totals[0].sqrt().to(dtype), torch.isnan(totals[1]).to(torch.float32)


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
# the clip factor


def clip_factor(norm: Tensor | Sequence[Tensor], c: float | Tensor, *, inv: Tensor | None = None,
                nan_on_nonfinite: bool = False) -> Tensor | list[Tensor]:
    """The factor ``c / max(N, c)`` that clips a gradient of norm ``N`` to norm ``c``: 1 for ``N <= c``,
    ``c/N`` above (``tf.clip_by_norm``, ``tf.clip_by_global_norm``; Keras ``clipnorm``, ``global_clipnorm``).

    ``norm``: a tensor of norms (one factor per element), or a list of 0-d norms on any devices and dtypes
    (one foreach op each over the list; no ``inv`` and no NaN rule then). ``inv``: the norms are those of
    scaled gradients ``S·g`` and ``inv = 1/S``; the factor is then ``inv · c / max(N·inv, c)``, unscaling and
    clipping in one multiplier. ``nan_on_nonfinite`` adds ``N − N`` (0 for a finite N, NaN otherwise) to the
    factor, so that a non-finite norm makes every clipped value NaN (``tf.clip_by_global_norm`` since TF
    1.11, Keras 3 ``global_clipnorm``); without it ``N = inf`` gives 0 (``tf.clip_by_norm``).

    With a Python ``c`` the quotient is torch's ``c / t``, which is ``reciprocal(t)·c``; with a tensor ``c``
    it is the correctly rounded quotient. The two differ by at most a unit in the last place.
    """
    if not isinstance(norm, Tensor):
        coefs = torch._foreach_clamp_min(list(norm), c)
        torch._foreach_reciprocal_(coefs)
        torch._foreach_mul_(coefs, c)
        return coefs
    n = norm if inv is None else norm * inv
    coef = c / torch.clamp(n, min=c)
    if nan_on_nonfinite:
        coef = coef + (n - n)
    return coef if inv is None else coef * inv


# ------------------------------------------------------------------------------------------------------------
# in-place kernels


def scale_(tensors: Sequence[Tensor | None], scale: float | Tensor | Sequence[Tensor],
           scale64: Tensor | None = None) -> None:
    """t ← t·s for every non-``None`` tensor (sparse: values scaled). ``scale`` is a number, a 0-d tensor
    shared by all, or one 0-d tensor per tensor; ``scale64`` (a 0-d float64 tensor, with a tensor ``scale``)
    is the factor float64 tensors take instead (``scale`` rounded to float32 would round their product)."""
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
            s = scale64 if scale64 is not None and dtype == torch.float64 else scale
            torch._foreach_mul_(group, s.to(device=device, dtype=acc_dtype(dtype)))
        elif acc_dtype(dtype) != dtype:  # a Python scalar would be rounded to fp16/bf16 first
            torch._foreach_mul_(group, scalar(scale, torch.float32, device))
        else:
            torch._foreach_mul_(group, float(scale))


def inverse_scale(
    scale: Tensor, tensors: Iterable[Tensor | None] = (), device: torch.device | str | None = None
) -> Tensor:
    """``1/scale`` as a 0-d tensor on ``device`` (default: the scale's) for unscaling ``tensors``: float64
    when one of them is float64, so that they are unscaled in their own precision, else float32 (the dtype
    of the AMP and fused kernels' factor). For a float32 ``scale`` the float64 reciprocal rounded to float32
    is the float32 reciprocal (a quotient rounded to 53 and then to 24 bits is rounded correctly: Figueroa,
    "When is double rounding innocuous?", SIGNUM 1995), so float32 tensors beside float64 ones get the
    factor they would get alone."""
    s = scale.detach().reshape(())
    wide = any(t is not None and t.dtype == torch.float64 for t in tensors)
    return torch.reciprocal(s.to(device=s.device if device is None else device,
                                 dtype=torch.float64 if wide else torch.float32))


def clamp_(tensors: Sequence[Tensor | None], min_value: float, max_value: float) -> None:
    """t ← clamp(t, min, max) elementwise for every non-``None`` tensor (sparse: values)."""
    ts = present(tensors)
    if not ts:
        return
    vals = _values_list(ts)
    for _, (_, (group,)) in group_by_device_dtype(vals).items():
        torch._foreach_clamp_min_(group, min_value)
        torch._foreach_clamp_max_(group, max_value)


def add_tensor_(tensors: list[Tensor], value: Tensor) -> None:
    """``t ← t + value`` for every tensor, ``value`` a 0-d tensor on their device, read by the kernel.

    (``torch._foreach_add_(ts, value)`` would not do: Python's overload resolution takes a 0-d tensor for
    the Scalar overload, a host read of the device; the Tensor overload is called by name.)"""
    torch.ops.aten._foreach_add_.Tensor(tensors, value)


def lerp_(targets: Sequence[Tensor], sources: Sequence[Tensor], weight: float | Tensor) -> None:
    """target ← lerp(target, source, w) = target + w·(source − target) (torch's ``lerp``, in the tensors'
    opmath type), one pass per (device, dtype) group, ``w`` first rounded to the group's dtype (a float as a
    tensor is).

    ``weight`` is a float, or a 0-d tensor (e.g. zero on a skipped step) that the kernels read: no host sync.
    Both forms give the same bits (see :func:`lerp_group_`)."""
    if len(targets) == 0:
        return
    for (device, dtype), (_, (tg, src)) in group_by_device_dtype(targets, sources).items():
        lerp_group_(tg, src, weight, device, dtype)


def lerp_group_(targets: list[Tensor], sources: list[Tensor], weight: float | Tensor, device: torch.device,
                dtype: torch.dtype, broadcast: bool | None = None) -> None:
    """:func:`lerp_` over local tensors of one ``(device, dtype)``, one launch on CUDA however many tensors.

    A float weight goes to torch's Scalar overload (one multi-tensor kernel), rounded to ``dtype`` first
    (:func:`rounded`). torch has no overload with one tensor weight, and a list of 0-d weights leaves its
    multi-tensor fast route (the weights' sizes are not the tensors'): the kernel then runs tensor by tensor.
    So off the CPU (``broadcast`` None: ``device.type != "cpu"``, over more than one tensor) a tensor weight
    is rounded to ``dtype`` on the device and handed over as :func:`weights_like` (one tensor per target, of
    its sizes and strides): one fill and one fast-route kernel. On the CPU, where the multi-tensor ops loop
    tensor by tensor anyway, the 0-d weight is passed as it is. Every form computes the same
    ``lerp(t, s, w)`` with the same ``w`` in the same opmath type (torch's ``lerp`` kernels read a tensor
    weight in ``dtype`` and a Scalar weight as the opmath value of the rounded float, the same number), so
    they give the same bits."""
    if not isinstance(weight, Tensor):
        torch._foreach_lerp_(targets, sources, rounded(float(weight), dtype))
        return
    if broadcast is None:  # (one tensor with a 0-d weight is one kernel as it is)
        broadcast = device.type != "cpu" and len(targets) > 1
    if broadcast:
        weights = weights_like(weight.to(device), targets, dtype)
    else:
        weights = [weight.to(device=device, dtype=dtype)] * len(targets)
    torch._foreach_lerp_(targets, sources, weights)


def weights_like(weight: Tensor, targets: Sequence[Tensor], dtype: torch.dtype) -> list[Tensor]:
    """One tensor per target holding the 0-d ``weight`` rounded to ``dtype`` everywhere, each of its target's
    sizes and strides: views of one buffer of the largest target's extent, filled by one kernel, so that a
    multi-tensor op given them as its per-element weights keeps torch's fast route (equal sizes and strides
    at each position). The buffer is scratch of the largest target's size, not of their sum: the views
    overlap."""
    keys = [(t.shape, t.stride()) for t in targets]
    shapes = dict.fromkeys(keys)
    extent = max(1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else 0
                 for shape, stride in shapes)
    buf = torch.empty(extent, device=weight.device, dtype=dtype)
    buf.copy_(weight)  # (the conversion of ``weight.to(dtype)``)
    for key in shapes:
        shapes[key] = buf.as_strided(*key)
    return [shapes[key] for key in keys]


@functools.lru_cache(maxsize=1024)
def rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` as a tensor conversion rounds it (``tensor.to(dtype)`` from float64),
    back as a float (exact: every value of a floating dtype is a double)."""
    return torch.tensor(value, dtype=torch.float64).to(dtype).item()


def segment_expand(values: Tensor, counts: Tensor, total: int, out: Tensor | None = None) -> Tensor:
    """Per-segment values expanded to elements: ``values[i]`` repeated ``counts[i]`` times, a vector of
    ``total = Σ counts`` elements (``torch.repeat_interleave(values, counts, output_size=total)``: given
    ``output_size``, torch needs no host read of the counts, so it runs without a sync and inside a CUDA
    graph). With ``out`` (a vector of ``total`` elements in ``values``' dtype) the result is written there
    (``index_select`` on the repeated positions), so views of ``out`` made once stay valid across steps.
    Cost: the index vector (``counts``' dtype; int32 keeps it at 4 B per element) is written and read once,
    the result written once: 12 B per element in int32, float32. Over a flat buffer whose segment sizes
    share a factor ``B``, expanding to blocks of ``B`` elements (``counts // B``) and broadcasting each
    block's value over its ``(nb, B)`` row divides that by ``B``."""
    if out is None:
        return torch.repeat_interleave(values, counts, output_size=total)
    return torch.index_select(values, 0, torch.repeat_interleave(counts, output_size=total), out=out)


def stack_scalars(values: Sequence[Tensor]) -> Tensor:
    """0-d tensors as one vector, like ``torch.stack``: off the CPU, values of one device and dtype are
    copied into the 0-d views of a new vector by one ``torch._foreach_copy_`` (one launch however many;
    ``torch.stack`` takes one per 128 inputs on CUDA). The values are copied, not rounded."""
    first = values[0]
    if first.device.type == "cpu" or any(v.dim() != 0 or v.dtype != first.dtype or v.device != first.device
                                         for v in values):
        return torch.stack(list(values))
    out = torch.empty(len(values), dtype=first.dtype, device=first.device)
    torch._foreach_copy_(list(out.unbind()), list(values))
    return out


class ElementFactors:
    """Per-tensor factors applied to separate tensors in O(1) kernel launches (off the CPU).

    ``t_i ← t_i·f_i`` for tensors ``t_1 … t_n`` (one device, one float32/float64 dtype) and a vector ``f``
    of their factors, in a fixed number of kernels whatever ``n`` and the sizes: ``f`` is expanded to the
    elements into a vector ``S`` of ``Σ numel(t_i)`` elements (:func:`segment_expand` with ``out=S``), whose
    views ``S_i`` have the tensors' shapes *and strides* (a channels-last tensor gets a channels-last view
    over its segment), and one multi-tensor op takes the views as its per-tensor operand
    (``torch._foreach_mul_(ts, [S_1, …, S_n])``): torch's one-launch route needs equal sizes and strides at
    each position and one dtype, which a list of 0-d factors (``_foreach_mul_(ts, [f_1, …, f_n])``) does not
    have, so CUDA runs that one tensor by tensor. Each element gets ``t·f_i`` rounded once: bit for bit the
    product of the per-tensor multiply by the 0-d factor. LAMB's per-tensor update (``w ← w + S·u``) is the
    same construction.

    Cost per step: the expansion writes an index (4 B per element, int32; int64 from 2^31 elements) and
    reads it, and writes ``S`` (4 B float32); the op reads ``S`` once more: about 16 B per element on top of
    the op itself, in 2 + 1 launches. Memory: ``S`` (one factor per element, in the tensors' dtype) and the
    segment sizes, kept by the owner per group (:meth:`cached`) while the tensors' layout stays.
    Not for the CPU (its per-tensor forms run in cache): :meth:`cached` returns None there, and for half
    precision (the factor stays float32 there, :func:`acc_dtype`, and a multi-tensor op needs one dtype
    across its lists: those keep the per-tensor multiply), empty, sparse or non-dense tensors, and DTensors.
    """

    __slots__ = ("counts", "total", "vec", "views")

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        first = tensors[0]
        numels = [t.numel() for t in tensors]
        self.total = sum(numels)
        index = torch.int32 if self.total < 2**31 else torch.int64
        self.counts = torch.tensor(numels, dtype=index, device=first.device)
        self.vec = torch.empty(self.total, dtype=first.dtype, device=first.device)
        self.views, at = [], 0
        for t, n in zip(tensors, numels):
            self.views.append(self.vec.as_strided(t.shape, t.stride(), at))
            at += n

    @staticmethod
    def applies(device: torch.device, dtype: torch.dtype) -> bool:
        """Whether tensors of this device and dtype take this form: float32/float64 off the CPU."""
        return device.type != "cpu" and dtype in (torch.float32, torch.float64)

    @classmethod
    def cached(cls, cache: dict, key: Any, tensors: Sequence[Tensor]) -> ElementFactors | None:
        """The instance for ``tensors`` kept in ``cache[(key, dtype)]`` (made there, or remade when their
        layout changed), or None where this form does not apply (see the class doc: the CPU, half
        precision, ...; then the caller keeps its per-tensor form)."""
        if not tensors:
            return None
        first = tensors[0]
        dev, dtype = first.device, first.dtype
        if not cls.applies(dev, dtype):
            return None
        key = (key, dtype)  # (a group holding float32 and float64 tensors keeps one per dtype)
        hit = cache.get(key)
        if hit is not None and hit.vec.device == dev and len(hit.views) == len(tensors) \
                and all(t.dtype == dtype and t.shape == v.shape and t.stride() == v.stride()
                        for t, v in zip(tensors, hit.views)):
            return hit
        if any(map(is_dtensor, tensors)) \
                or not all(t.layout == torch.strided and t.device == dev and t.dtype == dtype and is_dense(t)
                           for t in tensors) \
                or any(t.numel() == 0 for t in tensors):
            cache.pop(key, None)
            return None
        made = cls(tensors)
        cache[key] = made
        return made

    def expand(self, factors: Tensor) -> list[Tensor]:
        """The views of ``S`` after ``S ← factors`` expanded (``factors``: one per tensor, a vector or
        0-d tensors; converted to the tensors' dtype, exact for a float32 factor of float64 tensors)."""
        if not isinstance(factors, Tensor):
            factors = stack_scalars(list(factors))
        f = factors.to(device=self.vec.device, dtype=self.vec.dtype).reshape(-1)
        segment_expand(f, self.counts, self.total, out=self.vec)
        return self.views

    def mul_(self, tensors: Sequence[Tensor], factors: Tensor) -> None:
        """``t_i ← t_i·f_i`` (one expansion, one ``torch._foreach_mul_``)."""
        torch._foreach_mul_(list(tensors), self.expand(factors))

    def mul(self, tensors: Sequence[Tensor], factors: Tensor) -> list[Tensor]:
        """New tensors ``t_i·f_i`` (one expansion, one ``torch._foreach_mul``)."""
        return list(torch._foreach_mul(list(tensors), self.expand(factors)))

    def addcmul_(self, targets: Sequence[Tensor], tensors: Sequence[Tensor], factors: Tensor) -> None:
        """``x_i ← x_i + f_i·t_i`` (one expansion, one ``torch._foreach_addcmul_``: the product and the sum
        rounded as by ``x_i.addcmul_(f_i, t_i)``)."""
        torch._foreach_addcmul_(list(targets), self.expand(factors), list(tensors))


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
    grads: Sequence[Tensor | None], found_inf: Tensor, inv_scale: Tensor, *, pipeline_group: object = _UNSET
) -> Tensor:
    """g ← g·inv_scale in place and found_inf ← 1 if any element is NaN/±inf (one fused pass per group).

    Uses ``torch._amp_foreach_non_finite_check_and_unscale_``, falling back to a norm-based check for dtypes
    the fused kernel does not take. The kernel takes a float32 factor; a float64 ``inv_scale``
    (:func:`inverse_scale` for float64 gradients) unscales the float64 gradients in float64 instead (a
    max-norm check, then the multiply). ``found_inf`` is a 0-d fp32 tensor that is OR-ed into, so a caller
    can accumulate over several calls. DTensor shards: the flag is made to agree across their meshes (and the
    pipeline stages, when a pipeline group is set).
    """
    ts = present(grads)
    if not ts:
        return reduce_flag_(found_inf, ts, pipeline_group=pipeline_group)
    vals = _values_list(ts)
    for (device, dtype), (_, (group,)) in group_by_device_dtype(vals).items():
        fi = found_inf if found_inf.device == device else torch.zeros((), device=device)
        inv = inv_scale.to(device=device, dtype=torch.float32)
        fused = not (dtype == torch.float64 and inv_scale.dtype == torch.float64)  # (its factor is float32)
        if fused:
            try:
                torch._amp_foreach_non_finite_check_and_unscale_(group, fi, inv)
            except RuntimeError:  # pragma: no cover - dtype not supported by the fused kernel
                fused = False
        if not fused:
            worst = _stack(_foreach_norm(group, math.inf, acc_dtype(dtype)), torch.float64).amax()
            flag = (~torch.isfinite(worst)).to(torch.float32)
            fi.copy_(torch.maximum(fi, flag))
            factor = inv_scale if dtype == torch.float64 else inv
            torch._foreach_mul_(group, factor.to(device=device, dtype=dtype))
        if fi is not found_inf:
            found_inf.copy_(torch.maximum(found_inf, fi.to(found_inf.device)))
    return reduce_flag_(found_inf, ts, pipeline_group=pipeline_group)


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


#: the integer type of each floating dtype's width, for :func:`commit_`'s exact select on the bits
_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
         torch.float64: torch.int64}


def commit_(targets: Sequence[Tensor], new_values: Sequence[Tensor], skip: Tensor | None = None, *,
            per_tensor: bool | None = None) -> None:
    """target ← new value, or (``skip`` a 0-d bool tensor that is True) leave every target unchanged.

    For update rules without a fused kernel that takes ``found_inf``: the new values are computed out of
    place, then written back here. With ``skip`` given, non-finite new values (from the gradients that caused
    the skip) leave no trace, unlike a blend ``t + 0·(new − t)``, and no host sync is needed:

    * on the CPU (``per_tensor``, its default there) one ``torch.where`` per tensor;
    * elsewhere three multi-tensor ops per (device, dtype) group whatever the number of tensors, on the bits:
      with ``T``, ``N`` the target's and the new value's bits as integers of their width and ``c`` = 1 to
      write, 0 to keep, ``T ← T + c·(N − T)`` in two's-complement (wrap-around) integer arithmetic, which
      is ``N`` or ``T`` exactly, for every bit pattern (NaN payloads, infinities, signed zeros included).
      A per-tensor ``torch.where`` would be one kernel launch per tensor on a GPU.
    """
    if len(targets) == 0:
        return
    if skip is None:
        torch._foreach_copy_(list(targets), list(new_values))
        return
    if per_tensor is None:
        per_tensor = targets[0].device.type == "cpu"
    if not per_tensor:
        for (device, dtype), (_, (tg, vs)) in group_by_device_dtype(list(targets), list(new_values)).items():
            bits = _BITS.get(dtype)
            if bits is None:
                _where_(tg, vs, skip)
                continue
            tb = [t.view(bits) for t in tg]
            d = torch._foreach_sub([(v if v.dtype == dtype else v.to(dtype)).view(bits) for v in vs], tb)
            torch._foreach_mul_(d, torch.logical_not(skip.to(device)).to(bits))
            torch._foreach_add_(tb, d)
        return
    _where_(targets, new_values, skip)


def _where_(targets: Sequence[Tensor], new_values: Sequence[Tensor], skip: Tensor) -> None:
    for t, n in zip(targets, new_values):
        torch.where(skip.to(t.device), t, n.to(t.dtype), out=t)


# ------------------------------------------------------------------------------------------------------------
# norms along dims (variable clipping), mesh-aware


def _crossing_mesh_dims(t: Tensor, dims: tuple[int, ...]) -> tuple | None:
    """(mesh, mesh dims whose placement splits one of ``dims``) for DTensor ``t``, or None if no reduction.

    Any splitting placement counts (``Shard`` and ``_StridedShard``)."""
    if not is_dtensor(t):
        return None
    cross = []
    for i, p in enumerate(t.placements):
        d = _split_dim(p)
        if d is not None and d % max(t.ndim, 1) in dims:
            cross.append(i)
    return (t.device_mesh, tuple(cross)) if cross else None


def norms_along(tensors: Sequence[Tensor], dims: Sequence[Sequence[int]]) -> list[Tensor]:
    """Per-tensor L2 norms over ``dims[i]`` with ``keepdim=True``: sqrt(Σ_{dims} x²), fp32 accumulation
    (fp64 for fp64 input); TF ``clip_by_norm(axes=...)``'s norm.

    DTensors give the local-shard-shaped slice of the whole tensor's norms: ``Partial`` values are reduced
    first; when a reduced dim is split by a placement (``Shard``, ``_StridedShard``), local sums of squares
    are summed across that mesh dim (one collective per distinct mesh-dim group and dtype, all such tensors
    flattened into one buffer); a dim not reduced keeps its sharding.
    """
    if any(_has_partial(t) for t in tensors):
        tensors = _reduce_partials(tensors)
    sq: list[Tensor] = []
    plans: list = []
    for t, d in zip(tensors, dims):
        lt = local(t)
        red = tuple(sorted({k % max(t.ndim, 1) for k in d}))
        acc = acc_dtype(lt.dtype)
        sq.append(lt.to(acc).square().sum(dim=red, keepdim=True) if red else lt.to(acc).square())
        plans.append(_plan(_crossing_mesh_dims(t, red)))
    if any(plans):
        import torch.distributed as dist

        sq = _reduce_rows(sq, plans, dist.ReduceOp.SUM)
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
    targets: Sequence[Tensor], sources: Sequence[Tensor], weight: float | Tensor, key: tuple | None
) -> None:
    """:func:`lerp_` for plain local tensors of one known (device, dtype) ``key`` (else the general path)."""
    if key is None:
        lerp_(targets, sources, weight)
        return
    device, dtype = key
    lerp_group_(list(targets), list(sources), weight, device, dtype)
