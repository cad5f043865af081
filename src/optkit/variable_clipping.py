"""``VariableClippingOptimizer``: clip chosen parameters to a maximum L2 norm after each update.

TF1 ``tf.contrib.opt.VariableClippingOptimizer``. After the inner optimizer's update, every listed parameter
that had a gradient this step is projected onto the norm ball along its dims (TF ``clip_by_norm`` axes
semantics)::

    n = sqrt(Σ_dims w²)  (keepdims)        w ← w · c / max(n, c)

so with ``dims=[1]`` on an ``[N, D]`` embedding each row is clipped, ``dims=[0]`` each column, ``dims=[0, 1]``
the whole matrix. This clips the *variables*, not the gradients.

* A listed parameter whose ``.grad`` is ``None`` when ``step()`` starts is not clipped (decided before the
  inner step: optkit SGD writes ``−lr·g`` into ``.grad`` during its step).
* Sparse (COO) gradients with 0 not in ``dims``: only the touched rows are clipped, each row **once** — the
  original gathered duplicated indices and scatter-subtracted one delta per duplicate, pulling an over-norm
  row ``k`` times (vector V4); optkit de-duplicates the row indices first. With 0 in ``dims`` the whole
  parameter is clipped (dense fallback; TF logs a warning, optkit warns once).
* A skipped inner step (``step_applied`` false, e.g. an overflow under loss scaling) clips nothing: the factor
  is blended with the outcome on the device, no host sync.
* Chaining wrappers clips inner first (the outer clip runs after the whole inner step).

Whole-tensor clips (dims covering every dim) share one grouped norm pass and one grouped scale pass; a clip
along some dims costs one norm and one scale per listed parameter. DTensor parameters: whole-tensor norms are
reduced across the mesh; a clip along some dims works on the local shard, which is exact when the parameter
is sharded along a dim that is not clipped (e.g. a row-sharded embedding with ``dims=[1]``).
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from . import _multi_tensor as mt
from ._core.context import StepContext, StepResult
from ._validation import check_real
from ._wrapper import OptimizerWrapper

__all__ = ["VariableClippingOptimizer"]


def _normalize_dims(dims: Any, ndim: int, index: int) -> tuple[int, ...]:
    where = f"vars_to_clip_dims[{index}]"
    if isinstance(dims, numbers.Integral) and not isinstance(dims, bool):
        dims = [dims]
    if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence):
        raise TypeError(f"{where}: dims must be a list of ints, got {type(dims).__name__}")
    if ndim == 0:
        raise ValueError(f"{where}: cannot clip a 0-d parameter along dims")
    out = []
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, numbers.Integral):
            raise TypeError(f"{where}: dims must hold ints, got {d!r}")
        if not -ndim <= d < ndim:
            raise ValueError(f"{where}: dim {d} is out of range for a parameter of rank {ndim}")
        out.append(int(d) % ndim)
    if not out:
        raise ValueError(f"{where}: dims is empty")
    if len(set(out)) != len(out):
        raise ValueError(f"{where}: dims has repeated entries {list(dims)}")
    return tuple(sorted(out))


class VariableClippingOptimizer(OptimizerWrapper):
    """Clip listed parameters to ``max_norm`` along dims after each inner update (TF contrib).

    Args:
        opt: the optimizer that computes and applies the updates.
        vars_to_clip_dims: ``{parameter: [dims]}``; parameters matched by identity (a copy is kept). Every key
            must be one of ``opt``'s parameters and the dims valid for its rank (``ValueError``).
        max_norm: the L2 norm to clip to, ``> 0`` (``ValueError``; the original did not check).
        use_locking, colocate_clip_ops_with_vars: accepted for signature parity; no effect in PyTorch.
        name: kept for the TF surface.
    """

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        vars_to_clip_dims: Mapping[Tensor, Sequence[int]],
        max_norm: float,
        use_locking: bool = False,
        colocate_clip_ops_with_vars: bool = False,
        name: str = "VariableClipping",
    ) -> None:
        where = "VariableClippingOptimizer"
        c = check_real("max_norm", max_norm, where=where, minimum=0.0, min_inclusive=False)
        if not isinstance(vars_to_clip_dims, Mapping):
            raise TypeError(f"{where}: vars_to_clip_dims must be a dict {{parameter: dims}}, "
                            f"got {type(vars_to_clip_dims).__name__}")
        # the wrapper base's checks first (a torch.optim.Optimizer, not an outermost-only wrapper such as
        # MixedPrecisionOptimizerWrapper: TypeError), before the keys are looked up among its parameters
        super().__init__(opt)
        known = {id(p) for g in opt.param_groups for p in g["params"]}
        clips: list[tuple[Tensor, tuple[int, ...]]] = []
        for i, (v, dims) in enumerate(vars_to_clip_dims.items()):
            if not isinstance(v, Tensor):
                raise TypeError(f"{where}: keys of vars_to_clip_dims must be parameters, "
                                f"got {type(v).__name__}")
            if id(v) not in known:
                raise ValueError(f"{where}: vars_to_clip_dims[{i}] is not one of the optimizer's parameters")
            clips.append((v, _normalize_dims(dims, mt.local(v).dim(), i)))
        self.max_norm = c
        self.name = name
        self._clips = clips
        self._warned_sparse_dense = False

    @property
    def vars_to_clip_dims(self) -> dict[Tensor, list[int]]:
        """A copy of the clip table."""
        return {v: list(d) for v, d in self._clips}

    def _remap_params(self, mapping: dict[int, Tensor]) -> None:
        self._clips = [(mapping.get(id(v), v), d) for v, d in self._clips]
        super()._remap_params(mapping)

    def _wrapped_step(self, context: StepContext) -> StepResult:
        todo = []  # (param, dims, unique rows or None) for listed params with a gradient, before the update
        for v, dims in self._clips:
            g = v.grad
            if g is None:
                continue
            rows = None
            if g.is_sparse and 0 not in dims:
                rows = torch.unique(mt.local(g)._indices()[0])
            elif g.is_sparse and not self._warned_sparse_dense:
                self._warned_sparse_dense = True
                warnings.warn("VariableClippingOptimizer: clipping a parameter with a sparse gradient along "
                              "dims that include 0 clips the whole parameter (dense fallback)", stacklevel=3)
            todo.append((v, dims, rows))
        result = self._delegate(context)
        if todo:
            self._clip(todo, result.applied)
        return result

    def _clip(self, todo: list, applied: Tensor) -> None:
        c = self.max_norm
        gate = applied.detach().reshape(()).to(torch.bool)
        whole = [v for v, dims, rows in todo if rows is None and len(dims) == mt.local(v).dim()]
        if whole:
            ns = mt.norms(whole)
            factors = [self._factor(n, c, gate) for n in ns]
            mt.scale_(whole, factors)
        partial = [(v, dims) for v, dims, rows in todo if rows is None and len(dims) != mt.local(v).dim()]
        if partial:
            # norms along dims, reduced across the mesh when a clipped dim is sharded (one collective
            # per group)
            ns = mt.norms_along([v for v, _ in partial], [d for _, d in partial])
            for (v, _), n in zip(partial, ns):
                lv = mt.local(v)
                lv.mul_(self._factor(n, c, gate).to(lv.device))
        for v, dims, rows in todo:
            lv = mt.local(v)
            if rows is None:
                continue
            acc = mt.acc_dtype(lv.dtype)
            block = lv.index_select(0, rows)
            n = torch.linalg.vector_norm(block, dim=dims, keepdim=True, dtype=acc)
            f = self._factor(n, c, gate).to(lv.device)
            lv.index_copy_(0, rows, (block.to(acc) * f).to(lv.dtype))

    @staticmethod
    def _factor(n: Tensor, c: float, gate: Tensor) -> Tensor:
        """c / max(n, c), or 1 where the step was skipped."""
        f = mt.clip_factor(n, c)
        return torch.where(gate.to(f.device), f, torch.ones_like(f))

    def _own_config(self) -> dict:
        return {"max_norm": self.max_norm, "clip_dims": [list(d) for _, d in self._clips]}
