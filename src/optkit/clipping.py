"""Gradient clipping: TF's global-norm and per-tensor primitives, OpenSeq2Seq's gradient clip, in-place forms.

Out-of-place, TF semantics (``tensorflow/python/ops/clip_ops.py``, OpenSeq2Seq ``optimizers.py``):

* :func:`global_norm` — N = sqrt(Σ_i Σ t_i²) over the non-``None`` entries (``tf.linalg.global_norm``);
* :func:`clip_by_global_norm` — t_i · c / max(N, c), plus (N − N) so that a non-finite N makes every output
  NaN (``tf.clip_by_global_norm``), returning the clipped list and the unclipped N;
* :func:`clip_by_norm` — (t · c) / max(‖t‖_dims, c) with the norm taken over ``dims`` (``tf.clip_by_norm``);
* :func:`clip_gradients_by_norm` — OpenSeq2Seq's ``_clip_gradients_by_norm``: fp32 global norm, clip, cast
  each gradient to its variable's dtype.

In place, for the training hot path (no host sync, results stay tensors on the device):
:func:`clip_grads_by_global_norm_`, :func:`clip_grads_by_norm_`, :func:`clip_grads_by_value_`, and the factor
the optimizers fold into their fused kernels, :func:`clip_coefficient`.

Norms accumulate in fp32 (fp64 for fp64 input) whatever the tensor dtype; products are formed in that
precision and rounded once to the output dtype. Sparse COO tensors take part through their raw ``values()``:
duplicate indices are not merged, as TF does with ``IndexedSlices``. Differences from the originals are
listed in ``docs/compatibility.md`` (rejecting ``clip_norm <= 0``, no shape-[1] scale, ``None`` gradients
skipped, mixed dtypes accepted, fp32 arithmetic for half inputs).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import TypeVar

import torch
from torch import Tensor

from . import _multi_tensor as mt
from ._validation import check_real

__all__ = [
    "global_norm",
    "clip_by_global_norm",
    "clip_by_norm",
    "clip_gradients_by_norm",
    "clip_coefficient",
    "clip_grads_by_global_norm_",
    "clip_grads_by_norm_",
    "clip_grads_by_value_",
]

_Grads = Tensor | Iterable[Tensor | None]
#: an entry of ``clip_by_global_norm``'s list: its output has the input's entry type (tensors in, tensors out)
_MaybeTensor = TypeVar("_MaybeTensor", bound=Tensor | None)


# ------------------------------------------------------------------------------------------------------------
# argument checks


def _tensor_list(t_list: object, name: str, where: str) -> list[Tensor | None]:
    """TF's sequence check: a list/tuple of tensors or ``None``; a string or a bare tensor is a TypeError."""
    if isinstance(t_list, (str, bytes, Tensor)) or not isinstance(t_list, Sequence):
        raise TypeError(f"{where}: `{name}` should be a sequence of tensors, got {type(t_list).__name__}")
    out = list(t_list)
    for i, t in enumerate(out):
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"{where}: `{name}[{i}]` must be a tensor or None, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{where}: `{name}[{i}]` must be a floating-point tensor, got {t.dtype}")
    return out


def _positive_clip(name: str, value: object, where: str) -> float | Tensor:
    """A positive finite Python number, or a tensor taken on trust (checking it would cost a host sync)."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise TypeError(f"{where}: {name} must be a number or a 0-d floating-point tensor, "
                            f"got a {value.dtype} tensor of shape {tuple(value.shape)}")
        return value.reshape(())
    return check_real(name, value, where=where, minimum=0.0, min_inclusive=False)


def _grads_of(tensors_or_params: _Grads, name: str, where: str) -> list[Tensor]:
    """The tensors an in-place clip acts on: ``p.grad`` for parameters (``None`` skipped), else the tensor.

    An ``nn.Parameter`` or a leaf tensor with ``requires_grad=True`` stands for its gradient; any other tensor
    is clipped itself. A single tensor is shorthand for a one-element list.
    """
    if isinstance(tensors_or_params, Tensor):
        items: list = [tensors_or_params]
    elif isinstance(tensors_or_params, (str, bytes)) or not isinstance(tensors_or_params, Iterable):
        raise TypeError(f"{where}: `{name}` must be an iterable of tensors or parameters, "
                        f"got {type(tensors_or_params).__name__}")
    else:
        items = list(tensors_or_params)
    if all(type(x) is torch.nn.Parameter for x in items):  # the common case: model.parameters()
        return [g for g in [p.grad for p in items] if g is not None]
    out: list[Tensor] = []
    for x in items:
        if x is None:
            continue
        if not isinstance(x, Tensor):
            raise TypeError(f"{where}: `{name}` must hold tensors or parameters, got {type(x).__name__}")
        if isinstance(x, torch.nn.Parameter) or (x.requires_grad and x.is_leaf):
            x = x.grad
            if x is None:
                continue
        if not x.is_floating_point():
            raise TypeError(f"{where}: `{name}` must hold floating-point tensors, got {x.dtype}")
        out.append(x)
    return out


# ------------------------------------------------------------------------------------------------------------
# the clip factor


def clip_coefficient(
    norm: Tensor, clip_norm: float | Tensor, *, nan_on_nonfinite: bool = True
) -> Tensor:
    """The global clip factor s = c / max(N, c) + (N − N), as a 0-d fp32 tensor (fp64 for an fp64 ``norm``).

    This is ``tf.clip_by_global_norm``'s scale (TF writes it c·min(1/N, 1/c) + (N − N)): 1 when N <= c,
    c/N above; N == 0 gives 1. The (N − N) term is 0 for a finite N and NaN otherwise, so a non-finite norm
    turns every clipped value into NaN (TF >= 1.11, Keras 3 ``global_clipnorm``). With
    ``nan_on_nonfinite=False`` the term is left out: N = inf then gives s = 0 and N = NaN gives NaN, the
    behaviour of ``torch.nn.utils.clip_grad_norm_`` (without its 1e-6) and of OpenSeq2Seq on CPU.

    No host sync: ``norm`` and the result stay on ``norm``'s device. Multiply gradients by the result, or pass
    it to a fused kernel as part of its ``grad_scale``.
    """
    where = "clip_coefficient"
    if not isinstance(norm, Tensor):
        raise TypeError(f"{where}: norm must be a tensor, got {type(norm).__name__}")
    c = _positive_clip("clip_norm", clip_norm, where)
    dtype = torch.float64 if norm.dtype == torch.float64 else torch.float32
    n = norm.reshape(()).to(dtype)
    # (a tensor clip stays on the device: reading it would be a host sync)
    c_t = c.to(device=n.device, dtype=dtype) if isinstance(c, Tensor) else mt.scalar(c, dtype, n.device)
    return mt.clip_factor(n, c_t, nan_on_nonfinite=nan_on_nonfinite)


# ------------------------------------------------------------------------------------------------------------
# out of place (TF / OpenSeq2Seq)


def global_norm(tensors: Sequence[Tensor | None]) -> Tensor:
    """N = sqrt(Σ_i Σ_elements t_i²) over the non-``None`` entries, as one vector (``tf.linalg.global_norm``).

    Accumulates in fp32 (fp64 when any entry is fp64) and returns a 0-d tensor of that dtype; dtypes may be
    mixed. Sparse COO entries count their raw values, duplicates included. An empty or all-``None`` list gives
    0.0. Raises ``TypeError`` when ``tensors`` is not a sequence, is a string or a bare tensor, or holds
    something other than floating-point tensors and ``None``.
    """
    ts = _tensor_list(tensors, "t_list", "global_norm")
    return mt.global_norm(ts)


def clip_by_global_norm(
    t_list: Sequence[_MaybeTensor],
    clip_norm: float | Tensor,
    use_norm: float | Tensor | None = None,
) -> tuple[list[_MaybeTensor], Tensor]:
    """Scale every tensor by c / max(N, c): ``tf.clip_by_global_norm``, out of place.

    N = ``use_norm`` when given (taken on trust, e.g. a norm reduced across replicas), else
    :func:`global_norm` of ``t_list``. Each output is t_i · s with s = :func:`clip_coefficient` (N, c),
    formed in fp32 (fp64 for fp64 entries) and cast back to t_i's dtype. ``None`` stays ``None``; a 0-d tensor
    stays 0-d (OpenSeq2Seq's shape-[1] scale is not reproduced); sparse COO entries keep their indices with
    their values scaled. N == 0 leaves the values unchanged; a non-finite N makes every non-``None`` output
    NaN. Returns ``(clipped_list, N)`` where N is the norm *before* clipping (or ``use_norm``).

    Raises ``TypeError`` for a non-sequence ``t_list`` and ``ValueError`` for ``clip_norm <= 0`` or a
    non-finite ``clip_norm`` (TF accepts 0 and returns zeros; see ``docs/compatibility.md``). A tensor
    ``clip_norm`` is not checked, to avoid a host sync.
    """
    where = "clip_by_global_norm"
    ts = _tensor_list(t_list, "t_list", where)
    c = _positive_clip("clip_norm", clip_norm, where)
    if use_norm is None:
        norm = mt.global_norm(ts)
    elif isinstance(use_norm, Tensor):
        if use_norm.numel() != 1 or not use_norm.is_floating_point():
            raise TypeError(f"{where}: use_norm must be a number or a 0-d floating-point tensor, "
                            f"got a {use_norm.dtype} tensor of shape {tuple(use_norm.shape)}")
        norm = use_norm
    elif isinstance(use_norm, numbers.Real) and not isinstance(use_norm, bool):
        # float64 when an entry is (its factor is then formed in float64, as for a computed norm)
        f64 = any(isinstance(t, Tensor) and t.dtype == torch.float64 for t in ts)
        norm = torch.tensor(float(use_norm), dtype=torch.float64 if f64 else torch.float32)
    else:
        raise TypeError(f"{where}: use_norm must be None, a number or a 0-d tensor, "
                        f"got {type(use_norm).__name__}")
    coef = clip_coefficient(norm, c)
    return mt.scaled_copies(ts, coef), norm


def clip_by_norm(t: Tensor, clip_norm: float | Tensor, dims: int | Sequence[int] | None = None) -> Tensor:
    """``tf.clip_by_norm``: (t · c) / max(n, c) with n = sqrt(Σ_dims t²) (keepdims), out of place.

    ``dims=None`` takes the norm over all dims. A zero slice has n = 0 through a where-trick (no NaN in the
    gradient of this function), so it stays zero for c > 0. A negative ``clip_norm`` is raised to 0 as in TF:
    a non-zero slice then becomes zeros and a zero slice 0/0 = NaN. An inf element makes its slice's norm inf:
    that element becomes NaN and the others 0. The multiply comes before the divide, as in TF. Arithmetic is
    in fp32 (fp64 for fp64 input) and the result has ``t``'s dtype. A sparse COO ``t`` is clipped over its
    raw values (duplicates counted; ``dims`` then index the values tensor, as for TF's ``IndexedSlices``) and
    stays sparse with the same indices.

    Raises ``TypeError`` for a non-tensor or non-floating ``t`` or ill-typed ``dims``; ``ValueError`` for a
    dim out of range or repeated.
    """
    where = "clip_by_norm"
    if not isinstance(t, Tensor) or not t.is_floating_point():
        raise TypeError(f"{where}: t must be a floating-point tensor, got "
                        f"{t.dtype if isinstance(t, Tensor) else type(t).__name__}")
    vals = t._values() if t.is_sparse else t
    axes = _check_dims(dims, vals.dim(), where)
    acc = mt.acc_dtype(vals.dtype)
    x = vals.to(acc)
    if isinstance(clip_norm, Tensor):
        if clip_norm.numel() != 1:
            raise TypeError(f"{where}: clip_norm must be a number or a 0-d tensor, got shape "
                            f"{tuple(clip_norm.shape)}")
        c: float | Tensor = torch.clamp_min(clip_norm.reshape(()).to(device=x.device, dtype=acc), 0.0)
    else:
        c = max(check_real("clip_norm", clip_norm, where=where, finite=False), 0.0)
    sq = x * x
    s = sq.sum(dim=axes, keepdim=True) if axes else sq
    pos = s > 0
    n = torch.where(pos, torch.sqrt(torch.where(pos, s, torch.ones_like(s))), s)
    den = torch.maximum(n, c) if isinstance(c, Tensor) else torch.clamp_min(n, c)
    out = ((x * c) / den).to(vals.dtype)
    if t.is_sparse:
        return torch.sparse_coo_tensor(t._indices(), out, t.shape, is_coalesced=t.is_coalesced())
    return out


def _check_dims(dims: int | Sequence[int] | None, ndim: int, where: str) -> tuple[int, ...]:
    if dims is None:
        return tuple(range(ndim))
    seq = [dims] if isinstance(dims, numbers.Integral) else dims
    if isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence):
        raise TypeError(f"{where}: dims must be None, an int or a sequence of ints, "
                        f"got {type(dims).__name__}")
    out = []
    for d in seq:
        if isinstance(d, bool) or not isinstance(d, numbers.Integral):
            raise TypeError(f"{where}: dims must hold ints, got {type(d).__name__} ({d!r})")
        if not -max(ndim, 1) <= d < max(ndim, 1):
            raise ValueError(f"{where}: dims entry {d} is out of range for a tensor with {ndim} dims")
        out.append(int(d) % max(ndim, 1))
    if len(set(out)) != len(out):
        raise ValueError(f"{where}: dims has repeated entries: {list(seq)}")
    if ndim == 0:
        return ()
    return tuple(out)


def clip_gradients_by_norm(
    grads_and_vars: Iterable[tuple[Tensor | None, Tensor]], clip_gradients: float | Tensor
) -> list[tuple[Tensor | None, Tensor]]:
    """OpenSeq2Seq ``_clip_gradients_by_norm``: clip the gradients by their fp32 global norm.

    N = sqrt(Σ g²) over every non-``None`` gradient, accumulated in fp32; each gradient becomes
    g · c / max(N, c) (:func:`clip_coefficient`, so a non-finite N gives NaN everywhere), formed in fp32 and
    cast to its **variable's** dtype (fp32 master weights keep fp32 gradients; fp16 variables get fp16).
    Returns new ``(grad, var)`` pairs in input order. ``None`` gradients stay ``None`` (the original crashed
    on them). Raises ``TypeError`` for malformed pairs and ``ValueError`` for ``clip_gradients <= 0``.
    """
    where = "clip_gradients_by_norm"
    if isinstance(grads_and_vars, (str, bytes, Tensor)) or not isinstance(grads_and_vars, Iterable):
        raise TypeError(f"{where}: grads_and_vars must be an iterable of (gradient, variable) pairs, "
                        f"got {type(grads_and_vars).__name__}")
    pairs = list(grads_and_vars)
    for i, pair in enumerate(pairs):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"{where}: grads_and_vars[{i}] must be a (gradient, variable) pair, got {pair!r}")
        if not isinstance(pair[1], Tensor):
            raise TypeError(f"{where}: grads_and_vars[{i}] variable must be a tensor, "
                            f"got {type(pair[1]).__name__}")
    grads = _tensor_list([g for g, _ in pairs], "grads_and_vars gradients", where)
    c = _positive_clip("clip_gradients", clip_gradients, where)
    variables = [v for _, v in pairs]
    norm = mt.global_norm(grads).to(torch.float32)
    coef = clip_coefficient(norm, c)
    clipped = mt.scaled_copies(grads, coef, out_dtypes=[v.dtype for v in variables])
    return list(zip(clipped, variables))


# ------------------------------------------------------------------------------------------------------------
# in place (hot path)


def clip_grads_by_global_norm_(
    tensors_or_params: _Grads,
    clip_norm: float | Tensor,
    *,
    error_if_nonfinite: bool = False,
    nan_on_nonfinite: bool = True,
) -> Tensor:
    """In place g ← g · c / max(N, c) over all gradients; returns N (0-d fp32, fp64 for fp64 gradients).

    ``tensors_or_params``: parameters (their ``.grad`` is clipped, ``None`` skipped) or tensors. One norm pass
    (``_foreach_norm`` per (device, dtype) group, fp32 accumulation) and one scale pass with the 0-d factor of
    :func:`clip_coefficient`; no host sync and no branch on the norm. A non-finite N makes every gradient NaN
    (TF semantics); ``nan_on_nonfinite=False`` gives ``torch.nn.utils.clip_grad_norm_``'s behaviour instead
    (inf N zeroes the finite gradients). ``error_if_nonfinite=True`` reads N on the host (one sync) and raises
    ``RuntimeError`` before touching anything. Compared with ``clip_grad_norm_``, the factor has no 1e-6 in
    the denominator and is exactly 1 for N <= c.
    """
    where = "clip_grads_by_global_norm_"
    grads = _grads_of(tensors_or_params, "tensors_or_params", where)
    c = _positive_clip("clip_norm", clip_norm, where)
    norm = mt.global_norm(grads)
    if error_if_nonfinite and not bool(torch.isfinite(norm)):
        raise RuntimeError(f"{where}: the total norm of the gradients is {norm.item()}, so they cannot be "
                           "clipped; set error_if_nonfinite=False to clip anyway (the result is NaN)")
    mt.scale_(grads, clip_coefficient(norm, c, nan_on_nonfinite=nan_on_nonfinite))
    return norm


def clip_grads_by_norm_(tensors_or_params: _Grads, clip_norm: float) -> list[Tensor]:
    """In place g_i ← g_i · c / max(‖g_i‖, c) for each tensor separately (Keras ``clipnorm``); returns norms.

    The per-tensor form of :func:`clip_by_norm` with ``dims=None``: zero tensors stay zero, an inf element
    makes its tensor's other elements 0 and itself NaN. Norms accumulate in fp32 (fp64 for fp64). Returns
    the list of per-tensor norms before clipping (0-d tensors, in input order, ``None`` gradients skipped).
    Raises ``ValueError`` unless ``clip_norm`` is a positive finite number.
    """
    where = "clip_grads_by_norm_"
    grads = _grads_of(tensors_or_params, "tensors_or_params", where)
    c = check_real("clip_norm", clip_norm, where=where, minimum=0.0, min_inclusive=False)
    if not grads:
        return []
    norms = mt.norms(grads)
    mt.scale_(grads, mt.clip_factor(norms, c))
    return norms


def clip_grads_by_value_(tensors_or_params: _Grads, clip_value: float) -> None:
    """In place g ← clamp(g, −v, v) elementwise (``tf.clip_by_value``, Keras ``clipvalue``); NaN stays NaN.

    Raises ``ValueError`` unless ``clip_value`` is a positive number (``inf`` allowed: nothing is clipped).
    """
    where = "clip_grads_by_value_"
    grads = _grads_of(tensors_or_params, "tensors_or_params", where)
    v = check_real("clip_value", clip_value, where=where, minimum=0.0, min_inclusive=False, finite=False)
    mt.clamp_(grads, -v, v)
