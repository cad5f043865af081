"""Tensors as the multi-tensor layer sees them: DTensors and their local shards, sparse values, optional
entries, and lists grouped by (device, dtype) so that every kernel gets homogeneous lists."""

from __future__ import annotations

import itertools
import operator
import sys
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

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


_FINITE_MAX: dict[torch.dtype, float] = {}


def scalar(value: float, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """A 0-d tensor of ``value`` rounded to ``dtype`` as ``torch.tensor`` rounds it (a finite number beyond
    the dtype's range becomes ±inf), made by a fill kernel: ``torch.tensor(x, device=...)`` copies from the
    host, which blocks on a GPU and fails inside a CUDA graph capture."""
    v = float(value)
    top = _FINITE_MAX.get(dtype)
    if top is None:
        top = _FINITE_MAX[dtype] = float(torch.finfo(dtype).max)
    if abs(v) > top and v == v:  # (the fill refuses what the dtype cannot hold: round on the host first)
        v = float(torch.tensor(v, dtype=dtype))
    return torch.full((), v, dtype=dtype, device=device)


def capturing(device: torch.device) -> bool:
    """Whether work queued for ``device`` is being captured into a CUDA graph (``torch.cuda.graph``): a
    decision taken on the host then would be baked into every replay, so callers take the device-side path
    (as under ``torch.compile``) and read nothing back."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


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


_GRAD = operator.attrgetter("grad")


def with_grads(params: Sequence[Tensor]) -> tuple[list[int], list[Tensor], list[Tensor]]:
    """(indices, parameters, gradients) of the entries of ``params`` that have a ``.grad``: one C-speed read
    of every ``.grad`` and one ``None`` scan when all have one (the common case), a filter otherwise."""
    grads = list(map(_GRAD, params))
    if not any(map(operator.is_, grads, itertools.repeat(None))):
        return list(range(len(params))), list(params), grads
    idx = [i for i, g in enumerate(grads) if g is not None]
    return idx, [params[i] for i in idx], [grads[i] for i in idx]


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


def _stack(values: list[Tensor], dtype: torch.dtype | None) -> Tensor:
    """0-d tensors stacked into one vector (cast to ``dtype`` when given), one kernel when they agree."""
    device = values[0].device
    if all(v.dtype == values[0].dtype and v.device == device for v in values):
        out = torch.stack(values)
        return out if dtype is None else out.to(dtype)
    dtype = dtype or torch.float64
    return torch.stack([v.to(device=device, dtype=dtype) for v in values])


def _unstack(vec: Tensor, dtypes: list[torch.dtype]) -> list[Tensor]:
    if all(d == dtypes[0] for d in dtypes):
        return list(vec.to(dtypes[0]).unbind(0))
    return [v.to(d) for v, d in zip(vec.unbind(0), dtypes)]


def is_dense(t: Tensor) -> bool:
    """Whether ``t`` covers its storage span exactly once (non-overlapping and dense: contiguous,
    channels_last, a transpose of a contiguous tensor, ...), so memory order is a permutation of its
    elements and a view with its strides fits over ``numel`` consecutive places."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True
