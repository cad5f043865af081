"""Flat parameter buffers: many parameters as views into one contiguous buffer per (device, dtype).

An optimizer step over thousands of small tensors is bound by per-tensor host work, not by memory: every
kernel call, norm or check costs about a microsecond per tensor (measured with torch 2.13: 10-60× the
bandwidth floor at 10,000 tensors). :func:`flat_parameters` applies the Megatron/DeepSpeed/apex
contiguous-buffer idea: each parameter's data becomes a view into one flat buffer of its (device, dtype), its
gradient a view into a matching flat gradient buffer, and optkit optimizers then keep their slots and EMA
averages as views into flat buffers too. An optimizer step then runs its kernels once per cache-sized chunk
of the flat buffer instead of once per tensor, and global reductions (the global norm, the non-finite check)
read the flat gradient once.

What stays the same: the parameters are the same ``Parameter`` objects with the same shapes (and memory
formats: a dense parameter keeps its strides inside its segment), ``named_parameters()``, ``state_dict()``
(per parameter: a saved state loads into an optimizer with or without flat buffers, and back), every contract
of the optimizers (skips, checkpoints, hooks).

Rules:

* call it before building the optimizer (the optimizer allocates flat slots for flat parameters);
* an optimizer steps a param group over the flat buffer when the group's parameters lie back to back in it,
  in the group's order; given param groups (``flat_parameters(optkit.param_groups(model, rules))``), it lays
  the buffer out that way. Groups interleaved in the buffer (a module's order, then weights and biases split
  by a ``no_decay_1d`` rule) step tensor by tensor, correct but slower, and the optimizer warns once;
* clear gradients with the optimizer's ``zero_grad()`` or :meth:`FlatParameters.zero_grad`: they zero the flat
  gradient and keep the views (so, as with torch's ``set_to_none=False``, a parameter that took no part in a
  backward has a zero gradient, not None, and momentum and decay still move it). ``model.zero_grad()`` sets
  ``.grad`` to None; the next backward then creates separate gradients and the step falls back to the
  per-tensor path (correct, slower) until views come back: the optimizer's ``zero_grad()`` (for the views it
  saw when it was built) and :meth:`FlatParameters.zero_grad` restore them, and the next step runs over the
  flat gradient again;
* ``p.data = ...`` on a flat parameter takes it out of its buffer, and ``p.grad.data = ...`` or
  ``p.grad.set_(...)`` its gradient out of the flat gradient; an alias of the same memory with other strides
  (``p.data = p.data.t()`` or ``p.t_()`` on a square weight, ``p.grad.t_()``) no longer matches the buffer's
  layout. The optimizer notices each and steps per tensor, correct but slower: call :func:`flat_parameters`
  again;
* parameters with sparse gradients stay out of the flat buffers, with their own storage and ``.grad``: a
  dense gradient view would make autograd add a sparse gradient into it, densely, and the optimizers' sparse
  rules (Ftrl, Adagrad, Momentum, RMSProp and LARS update only the touched rows) would never run. Which ones
  stay out: given a module, the weights of its ``nn.Embedding`` / ``nn.EmbeddingBag`` modules with
  ``sparse=True``; always, a parameter whose ``.grad`` is already sparse. Nothing else can be told before a
  backward, so do not pass another parameter that gets sparse gradients (given tensors instead of a module,
  an embedding's weight; ``F.embedding(..., sparse=True)``, ``index_select`` / ``gather`` with
  ``sparse_grad=True`` over a parameter; ``sparse`` turned on after the call): leave it out, or run one
  backward before the call so that its gradient is sparse. The group of a parameter kept out steps its
  other parameters over the flat buffer when the optimizer has a sparse rule (the sparse gradient is handled
  on its own); others densify the sparse gradient and step that group per tensor, so give the embedding a
  param group of its own there;
* DDP works (its reduced gradients are copied into the views), but not with ``gradient_as_bucket_view=True``
  (that replaces the views); FSDP2 / DTensor parameters are refused (FSDP2 keeps flat shards of its own).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef

from . import _multi_tensor as mt
from ._core.fused import is_dense

__all__ = ["flat_parameters", "FlatParameters", "flat_buffer_of"]

#: the storages flat_parameters made, by object: the key is the storage's ``StorageImpl`` address
#: (``_cdata``) and the value a weak reference to it. The parameters' views keep a storage alive; the weak
#: reference keeps no memory (the data is freed with the last view) but keeps the ``StorageImpl`` object
#: itself allocated (c10 ``weak_intrusive_ptr``), so no other storage can take its address while it is listed:
#: a key found is that very storage. (An address and byte size would not do: a later parameter whose storage
#: reuses a freed buffer's address and size would be taken for a flat one.) Expired entries are dropped at
#: the next :func:`flat_parameters` call.
_REGISTRY: dict[int, StorageWeakRef] = {}

#: bumped whenever :meth:`FlatParameters.zero_grad` points a ``.grad`` back at its view: a cached optimizer
#: plan made over separate gradients (no flat part) is made again after it
_VIEWS_RESTORED = [0]

#: modules whose ``sparse=True`` gives their ``weight`` sparse gradients (kept out of the flat buffers)
_SPARSE_GRAD_MODULES = (nn.Embedding, nn.EmbeddingBag)


@dataclass
class _Segment:
    param: Tensor
    offset: int
    numel: int
    shape: torch.Size
    stride: tuple[int, ...]


class FlatParameters:
    """The flat buffers that :func:`flat_parameters` made: ``buffers[(device, dtype)]`` (parameters) and
    ``grads[(device, dtype)]`` (their gradients), each parameter a view at its ``offset``; ``separate``: the
    parameters it kept out of them because their gradients are sparse (module doc)."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        self.grads: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        self._segments: dict[tuple[torch.device, torch.dtype], list[_Segment]] = {}
        self.separate: list[Tensor] = []

    def __repr__(self) -> str:
        parts = [f"{d}/{str(t).replace('torch.', '')}: {len(self._segments[(d, t)])} tensors, "
                 f"{self.buffers[(d, t)].numel():,} elements" for d, t in self.buffers]
        if self.separate:
            parts.append(f"{len(self.separate)} kept out (sparse gradients)")
        return f"FlatParameters({'; '.join(parts)})"

    @torch.no_grad()
    def zero_grad(self) -> None:
        """Zero every flat gradient (one fill per buffer) and point each ``.grad`` back at its view; the
        parameters kept out of the buffers (:attr:`separate`) get ``.grad = None``, as torch's
        ``zero_grad()`` gives them."""
        for p in self.separate:
            p.grad = None
        restored = False
        for key, gflat in self.grads.items():
            gflat.zero_()
            for seg in self._segments[key]:
                view = _segment_view(gflat, seg)
                if seg.param.grad is not view and not _is_view_of(seg.param.grad, view):
                    seg.param.grad = view
                    restored = True
        if restored:
            _VIEWS_RESTORED[0] += 1

    def views_intact(self) -> bool:
        """Whether every parameter and gradient is still its view into the flat buffers."""
        for key, flat in self.buffers.items():
            gflat = self.grads[key]
            for seg in self._segments[key]:
                if not _is_view_of(seg.param, _segment_view(flat, seg)):
                    return False
                if seg.param.grad is None or not _is_view_of(seg.param.grad, _segment_view(gflat, seg)):
                    return False
        return True


def _segment_view(flat: Tensor, seg: _Segment) -> Tensor:
    return flat.as_strided(seg.shape, seg.stride, flat.storage_offset() + seg.offset)


def _is_view_of(t: Tensor | None, view: Tensor) -> bool:
    return (t is not None and t.data_ptr() == view.data_ptr() and t.shape == view.shape
            and t.stride() == view.stride())


def _segment_stride(p: Tensor) -> tuple[int, ...]:
    """A dense parameter keeps its strides (channels_last stays channels_last); others become contiguous."""
    if is_dense(p) and p.numel() > 0:
        return tuple(p.stride())
    return tuple(torch.empty(p.shape, device="meta").stride())


@torch.no_grad()
def flat_parameters(
    params: nn.Module | Iterable[Tensor] | Iterable[tuple[str, Tensor]] | Iterable[Mapping[str, Any]],
) -> FlatParameters:
    """Move the parameters (a module's, or an iterable of tensors / ``(name, tensor)`` pairs / param-group
    dicts) that require grad into one flat buffer per (device, dtype), in order, and give each a zero gradient
    that is a view into a matching flat gradient buffer (existing gradients are copied in). Returns the
    :class:`FlatParameters`.

    Param groups (dicts with ``"params"``, such as :func:`optkit.param_groups` returns) are laid out group
    after group, so that each group's parameters lie back to back: an optimizer steps a group over the flat
    buffer only then. A module's parameters in module order, grouped afterwards by rules that split weights
    from biases (``no_decay_1d``), interleave the groups, and each group steps tensor by tensor (the optimizer
    warns once): pass the same groups here, ``flat_parameters(optkit.param_groups(model, rules))``, and build
    the optimizer (or ``optimize_loss(..., rules=rules)``) with those rules. Groups from
    :func:`optkit.param_groups` of a module also tell which weights get sparse gradients (its sparse
    embeddings), as the module does; a group's ``"params"`` must be a list or tuple, not a generator (the
    optimizer reads it again).

    Parameters with sparse gradients stay out, with their own storage and ``.grad``, so that the optimizer's
    sparse rule sees their sparse gradients (``FlatParameters.separate`` lists them): given a module, the
    weights of its ``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True``; always, a parameter whose
    gradient is already sparse. Do not pass any other parameter that gets sparse gradients (an embedding's
    weight among plain tensors, a parameter under ``F.embedding(..., sparse=True)``): nothing tells it before
    a backward, and its gradient would be a dense view (module doc).

    Raises ``TypeError`` for DTensor (FSDP2 / tensor parallel) or sparse parameters, ``ValueError`` for a
    non-leaf tensor or no parameters. Call it before building the optimizer (module doc for the rules).
    """
    sparse_grad: set[int] = set()
    if isinstance(params, nn.Module):
        items = list(params.parameters())
        sparse_grad = {id(m.weight) for m in params.modules()
                       if isinstance(m, _SPARSE_GRAD_MODULES) and m.sparse and isinstance(m.weight, Tensor)}
    elif isinstance(params, (Tensor, str, bytes)) or not isinstance(params, Iterable):
        raise TypeError("flat_parameters: `params` must be an nn.Module or an iterable of tensors or (name, "
                        f"tensor) pairs, got {type(params).__name__}")
    else:
        items = []
        # (optkit.param_groups records the weights of a module's sparse embeddings)
        sparse_grad = set(getattr(params, "sparse_grad_ids", ()))
        for i, x in enumerate(params):
            if isinstance(x, Mapping):  # a param group: its parameters, in order
                if "params" not in x:
                    raise TypeError("flat_parameters: a param group (dict) needs a 'params' entry")
                ps = x["params"]
                if not isinstance(ps, Tensor) and iter(ps) is ps:
                    raise TypeError(f"flat_parameters: param group {i}'s 'params' is a one-shot iterator "
                                    "(a generator): reading it here would leave it empty for the optimizer "
                                    "built from the same groups; pass a list")
                ps = [ps] if isinstance(ps, Tensor) else list(ps)
                items += [y[1] if isinstance(y, tuple) else y for y in ps]
            else:
                items.append(x[1] if isinstance(x, tuple) else x)
    seen: set[int] = set()
    by_key: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    out = FlatParameters()
    for p in items:
        if not isinstance(p, Tensor):
            raise TypeError(f"flat_parameters: expected tensors, got {type(p).__name__}")
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        if mt.is_dtensor(p):
            raise TypeError("flat_parameters: DTensor parameters (FSDP2, tensor parallel) keep their own "
                            "sharded layout and cannot become views into one local buffer")
        if p.is_sparse or p.layout != torch.strided:
            raise TypeError("flat_parameters: parameters must be dense strided tensors")
        if not p.is_leaf:
            raise ValueError("flat_parameters: can't move a non-leaf tensor into a flat buffer")
        if id(p) in sparse_grad or (p.grad is not None and p.grad.layout != torch.strided):
            out.separate.append(p)  # its sparse gradients stay sparse: its own storage and .grad
            continue
        by_key.setdefault((p.device, p.dtype), []).append(p)
    if not by_key and not out.separate:
        raise ValueError("flat_parameters: no parameter that requires grad")
    _forget_freed()
    for key, ps in by_key.items():
        device, dtype = key
        total = sum(p.numel() for p in ps)
        flat = torch.empty(total, device=device, dtype=dtype)
        gflat = torch.zeros(total, device=device, dtype=dtype)
        segs, offset = [], 0
        for p in ps:
            seg = _Segment(p, offset, p.numel(), p.shape, _segment_stride(p))
            view = _segment_view(flat, seg)
            view.copy_(p.detach())
            gview = _segment_view(gflat, seg)
            if p.grad is not None:
                gview.copy_(p.grad)
            p.data = view
            p.grad = gview
            segs.append(seg)
            offset += p.numel()
        out.buffers[key], out.grads[key], out._segments[key] = flat, gflat, segs
        storage = flat.untyped_storage()
        _REGISTRY[storage._cdata] = StorageWeakRef(storage)
    return out


def _forget_freed() -> None:
    """Drop the registry's entries whose storage was freed (their weak references release the
    ``StorageImpl`` objects, whose addresses may then be reused)."""
    for key in [k for k, ref in _REGISTRY.items() if ref.expired()]:
        del _REGISTRY[key]


def flat_buffer_of(p: Tensor) -> Tensor | None:
    """A 1-D view of the whole flat parameter buffer ``p`` lies in (made by :func:`flat_parameters`), else
    None. The buffer is recognised by its storage object, not by address (a parameter whose storage reuses
    a freed buffer's memory is not flat)."""
    if mt.is_dtensor(p) or p.layout != torch.strided or p.is_sparse:
        return None
    storage = p.untyped_storage()
    if storage._cdata not in _REGISTRY:
        return None
    n = storage.nbytes() // p.element_size()
    return torch.empty(0, dtype=p.dtype, device=p.device).set_(storage, 0, (n,), (1,))
