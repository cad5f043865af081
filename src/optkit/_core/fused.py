"""The fused-kernel gate: every call of one of torch's fused optimizer kernels goes through here.

torch's fused kernels (``_fused_sgd_``, ``_fused_adam_``, ``_fused_adamw_``, ``_fused_adagrad_``) run at the
memory-bandwidth floor on CPU, but they guard nothing. Measured on torch 2.13:

* they walk each tensor's storage in memory order and pair elements by position, so a parameter that is not
  dense (``torch.randn(10, 5, 2)[..., 0]``), or a gradient or slot whose strides differ from the parameter's
  (a channels_last weight with a contiguous gradient), gives a wrong update;
* the CPU ``_fused_sgd_`` kernel is wrong for float16/bfloat16 tensors longer than one vector (error ~1 after
  three steps); the CPU Adam/Adagrad kernels are right for half dtypes (fp32 arithmetic, one rounding);
* they reject sparse gradients, read state of any size, and only exist on some devices.

:func:`partition` is the one capability check: per tensor position it decides whether the kernel may run on
the tensors as they are (``native``), on contiguous float32/float64 copies that are written back afterwards
(``staged``: same arithmetic, any layout, half dtypes computed in fp32 and rounded once), or not at all on
this device (``fallback``: the optimizer's out-of-place rule). Sparse gradients and missing state never reach
a kernel: the optimizer base coalesces or densifies sparse gradients and creates every slot at construction.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from .. import _multi_tensor as mt
from .._tensors import is_dense

__all__ = [
    "KERNELS", "Call", "Part", "kernel_calls", "partition", "is_dense", "native_dtype_ok", "staged",
    "split_by_mask", "unscale_arg",
]

_FLOATS = (torch.float32, torch.float64)
_HALF_AND_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# CUDA's fused kernels read a tensor learning rate as float32 and refuse a float64 one, which a float64
# parameter needs to stay exact: float64 takes the foreach fallback there
_HALF_AND_FP32 = (torch.float16, torch.bfloat16, torch.float32)

#: kernel name -> {device type: dtypes the kernel computes exactly on that device}
KERNELS: dict[str, dict[str, tuple[torch.dtype, ...]]] = {
    # CPU fused SGD (torch 2.13) is wrong for half tensors longer than one vector
    "sgd": {"cpu": _FLOATS, "cuda": _HALF_AND_FP32},
    "adam": {"cpu": _HALF_AND_FLOATS, "cuda": _HALF_AND_FP32},
    "adagrad": {"cpu": _HALF_AND_FLOATS, "cuda": _HALF_AND_FP32},
    # no fused kernel: a chain of foreach ops (any layout); half dtypes are staged for fp32 arithmetic
    "foreach": {"cpu": _FLOATS, "cuda": _FLOATS},
}


def native_dtype_ok(kernel: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``kernel`` computes exactly on ``device`` for tensors of ``dtype`` (dense, matching
    layouts)."""
    return dtype in KERNELS[kernel].get(device.type, ())


def _available(kernel: str, device: torch.device) -> bool:
    return kernel == "foreach" or device.type in KERNELS[kernel]


def _position_ok(ts: Sequence[Tensor]) -> bool:
    first = ts[0]
    if not is_dense(first):
        return False
    shape, stride = first.shape, first.stride()
    return all(t.shape == shape and t.stride() == stride for t in ts[1:])


def _all_contiguous(lists: Sequence[Sequence[Tensor]]) -> bool:
    return all(all(map(Tensor.is_contiguous, lst)) for lst in lists)


class Part(NamedTuple):
    """One part of a (device, dtype) group: ``mode`` is ``"native"``, ``"staged"`` or ``"fallback"``;
    ``index`` are positions in the group; ``lists`` the tensors the kernel runs on (copies when staged)."""

    mode: str
    index: list[int]
    lists: tuple[list[Tensor], ...]


def partition(
    kernel: str,
    device: torch.device,
    dtype: torch.dtype,
    lists: Sequence[Sequence[Tensor]],
    *,
    static_contiguous: bool = False,
) -> list[Part]:
    """Split one (device, dtype) group of parallel tensor lists (parameters first, gradients second) by how
    ``kernel`` may run.

    ``static_contiguous``: the caller knows every list but the gradients is contiguous (the optimizer base
    caches that per block), so only the gradients are checked on the fast path. The fast path costs about
    0.15 us per tensor checked.
    """
    n = len(lists[0])
    everything = list(range(n))
    dtype_ok = native_dtype_ok(kernel, device, dtype)
    stageable = native_dtype_ok(kernel, device, staging_dtype(dtype))
    if not _available(kernel, device) or (kernel != "foreach" and not (dtype_ok or stageable)):
        # no kernel here, or none for this dtype nor for its staging dtype (float64 on CUDA); the foreach
        # chain runs anywhere and stages what it does not compute natively
        return [Part("fallback", everything, tuple(list(x) for x in lists))]
    if dtype_ok:
        checked = lists[1:2] if static_contiguous else lists
        if kernel == "foreach" or _all_contiguous(checked):  # foreach ops handle any layout
            return [Part("native", everything, tuple(list(x) for x in lists))]
        good = [i for i in everything if _position_ok([lst[i] for lst in lists])]
    else:
        good = []
    if len(good) == n:
        return [Part("native", everything, tuple(list(x) for x in lists))]
    parts = []
    if good:
        parts.append(Part("native", good, tuple([lst[i] for i in good] for lst in lists)))
    bad_set = set(good)
    bad = [i for i in everything if i not in bad_set]
    parts.append(Part("staged", bad, tuple([lst[i] for i in bad] for lst in lists)))
    return parts


def staging_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype staged copies are computed in: float64 stays float64, everything else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def staged(part: Part, written: Sequence[int]) -> Iterator[tuple[list[Tensor], ...]]:
    """Yield contiguous ``staging_dtype`` copies of ``part.lists``; after the consumer's body, copy the lists
    at positions ``written`` back into the originals (one rounding for half dtypes).

    Use as ``for lists in staged(part, written=(0, 2)): kernel(*lists)``. A skipped step (``found_inf``)
    leaves the copies untouched, and copying unchanged values back is exact, so a skip still changes nothing.
    """
    originals = part.lists
    sdtype = staging_dtype(originals[0][0].dtype)
    copies = tuple(
        [torch.empty(t.shape, dtype=sdtype, device=t.device) for t in lst] for lst in originals
    )
    for dst, src in zip(copies, originals):
        torch._foreach_copy_(dst, src)
    yield copies
    for j in written:
        torch._foreach_copy_(list(originals[j]), copies[j])


def unscale_arg(
    k: Tensor | None, grads: list[Tensor], device: torch.device, dtype: torch.dtype
) -> Tensor | None:
    """The ``grad_scale`` argument that applies the step's gradient multiplier ``k`` inside a fused kernel.

    The kernels compute ``g / grad_scale`` with a float32 ``grad_scale``, so for float32 and narrower
    tensors this returns ``1/k`` as float32. For float64 a float32 ``1/k`` would round the unscaling, so
    ``grads`` (the step's gradients or their staged copies) are multiplied by the float64 ``k`` in place and
    None is returned. ``k`` None (nothing to unscale or clip) returns None.
    """
    if k is None:
        return None
    if dtype == torch.float64:
        torch._foreach_mul_(grads, k.to(device=device, dtype=dtype))
        return None
    return torch.reciprocal(k.to(device=device, dtype=torch.float32))


def split_by_mask(
    mask: Sequence[bool] | None, index: Sequence[int], lists: tuple[list[Tensor], ...]
) -> list[tuple[bool, tuple[list[Tensor], ...]]]:
    """``[(flag, lists)]``: parallel ``lists`` (whose entries are at positions ``index`` of ``mask``) cut by a
    per-tensor boolean ``mask`` (None: all True), for kernels that take one scalar per call (e.g. the weight
    decay of tensors not excluded from it)."""
    if mask is None:
        return [(True, lists)]
    flags = [bool(mask[i]) for i in index]
    if all(flags) or not any(flags):
        return [(flags[0] if flags else True, lists)]
    out = []
    for flag in (True, False):
        sel = [j for j, f in enumerate(flags) if f == flag]
        out.append((flag, tuple([lst[j] for j in sel] for lst in lists)))
    return out


class Call(NamedTuple):
    """The arguments one fused-kernel call shares with every optimizer: ``lists`` (parameters, gradients,
    slots), and the keywords ``lr``, ``weight_decay``, ``grad_scale`` and ``found_inf``; ``state_steps`` is
    the kernel's per-tensor step list (None without a ``step``)."""

    lists: tuple[list[Tensor], ...]
    lr: Tensor
    weight_decay: float
    grad_scale: Tensor | None
    found_inf: Tensor | None
    state_steps: list[Tensor] | None


def kernel_calls(
    parts: Iterable[tuple[torch.device, torch.dtype, list[int], tuple[list[Tensor], ...], Tensor | None]],
    lr: Tensor,
    k: Tensor | None,
    weight_decay: float = 0.0,
    mask: Sequence[bool] | None = None,
    step: Tensor | None = None,
) -> Iterator[Call]:
    """The kernel calls of ``parts`` (``(device, dtype, index, lists, found_inf)``, as the optimizer base's
    fused-kernel loop yields them) for a kernel that takes the learning rate as a tensor: per part the
    gradient multiplier ``k`` as ``grad_scale`` (:func:`unscale_arg`), ``lr`` in the part's accumulation
    dtype on its device and ``step`` on its device; then one call per side of the weight-decay ``mask``
    (:func:`split_by_mask`; ``weight_decay`` where True, 0 where False)."""
    for device, dtype, index, lists, fi in parts:
        scale = unscale_arg(k, lists[1], device, dtype)
        lr_ = lr.to(device=device, dtype=mt.acc_dtype(dtype))
        t = None if step is None else step.to(device)
        for decayed, sub in split_by_mask(mask, index, lists):
            yield Call(sub, lr_, weight_decay if decayed else 0.0, scale, fi,
                       None if t is None else [t] * len(sub[0]))
