"""The accumulation window of the train op (:class:`optkit.train.TrainOp`), as the mixin
:class:`TrainOpWindow`.

A window is the micro-batches summed into the gradients between two updates. This module holds whether a call
ends the window (``iter_size``, ``skip_update_ph``, ``skip_update=``); the token counts of token-weighted
accumulation (``loss`` returning ``(loss_sum, num_items)``: the counts are summed on the device per window and
over the data-parallel ranks at the update); the divisor of the window's summed scaled gradients, ``S·n·W``
(loss scale ``S``, ``n`` micro-batches, ``W`` ranks) or ``S·Σ num_items``; which ranks hold a window of their
own (still unreduced); and the clearing of the window's gradients after an update, or after a micro-step or an
update that raised.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch
from torch import Tensor

from . import _multi_tensor as mt
from ._train_build import optimizer_chain
from .optimizer import Optimizer as _OptkitOptimizer

__all__ = ["TrainOpWindow"]


class TrainOpWindow:
    """The accumulation window of a :class:`~optkit.train.TrainOp` (its state: ``_micro``, ``_items``,
    ``_token_weighted``, ``_last_items``)."""

    def _is_update(self, skip_update: bool | None) -> bool:
        """Whether this call ends the window: ``skip_update`` (this call's), else ``skip_update_ph``, else
        every ``iter_size``-th micro-batch."""
        flag = skip_update
        if flag is None and self.skip_update_ph is not None:
            ph = self.skip_update_ph
            flag = ph() if callable(ph) else ph
        if flag is None:
            return self._micro + 1 >= self.iter_size
        return not bool(flag)

    def _token_split(self, out: Any) -> Tensor:
        """The loss to back-propagate: ``out`` itself, or ``loss_sum`` of a ``(loss_sum, num_items)`` pair
        (``num_items`` is added to the window's count, on the device: no host sync)."""
        pair = isinstance(out, tuple)
        if self._token_weighted is not None and pair != self._token_weighted:
            raise ValueError("`loss` returned (loss_sum, num_items) on some calls and a scalar on others; "
                             "token-weighted accumulation needs the pair on every call")
        items = None
        if pair:
            if len(out) != 2:
                raise ValueError(f"`loss` must return a scalar tensor or (loss_sum, num_items), got a tuple "
                                 f"of {len(out)}")
            out, items = out
            if isinstance(items, Tensor):
                if items.numel() != 1:
                    raise ValueError(f"num_items must be a number or a one-element tensor, got shape "
                                     f"{tuple(items.shape)}")
                items = items.detach().reshape(()).to(device=self._items.device, dtype=torch.float64)
            elif isinstance(items, bool) or not isinstance(items, numbers.Real) or not items >= 0:
                raise ValueError(f"num_items must be a number >= 0 or a tensor, got {items!r}")
            else:
                items = mt.scalar(items, torch.float64, self._items.device)
        if not isinstance(out, Tensor) or out.numel() != 1:
            raise ValueError("`loss` must return a scalar tensor" + (" as loss_sum" if pair else ""))
        # all checked: the first call fixes the mode, the count joins the window
        self._token_weighted = pair
        if items is not None:
            self._items.add_(items)
            self._last_items = items
        return out

    def _window_divisor(self, n: int, scale: Tensor) -> Tensor | None:
        """The divisor of the window's summed scaled gradients: ``S·n·W`` (``S`` the loss scale, ``n`` the
        window's micro-batches, ``W`` the ranks whose gradients the train op summed itself), or
        ``S·Σ num_items`` with token-weighted accumulation (:meth:`_window_items`, which resets the window's
        count); in the train op's scale dtype (float64 when a parameter is float64). None when it is 1 (a unit
        loss scale and one micro-batch on one rank, without token weighting)."""
        count = n * self._world
        sdt = self._scale_dtype
        denom: Tensor | None = None if self._unit_scale else scale.to(sdt)
        if self._token_weighted:  # Σ loss_sum / Σ num_items over the window and the ranks
            items = self._window_items()
            denom = items.to(scale.device) if denom is None else denom * items.to(scale.device)
        elif count != 1:
            denom = torch.full((), float(count), dtype=sdt, device=scale.device) if denom is None \
                else denom * count
        return denom

    def _window_items(self) -> Tensor:
        """The divisor of token-weighted accumulation, 0-d fp32 (fp64 when a parameter is fp64; the count is
        kept and all-reduced in fp64, exact up to 2^53 items): ``Σ num_items`` over the window, summed over
        the data-parallel ranks (one scalar all-reduce) and divided by the number of ranks whose gradients
        DDP or FSDP2 averaged (their mean times W is the sum). A window without items divides by 1 (its
        loss sum, and so its gradient, is 0). Resets the window's count."""
        items, self._items = self._items, torch.zeros_like(self._items)
        group, averaged = self._items_group()
        if group is not False:
            import torch.distributed as dist

            dist.all_reduce(items, op=dist.ReduceOp.SUM, group=group)
            if averaged:
                items = items / dist.get_world_size(group)
        return torch.where(items > 0, items, torch.ones_like(items)).to(self._scale_dtype)

    def _items_group(self) -> tuple[Any, bool]:
        """(process group for the count, whether that group's gradients arrive averaged); ``False`` as the
        group when nothing is distributed."""
        if self._reduce:  # our own SUM all-reduce (on_horovod, or DDP + "mixed" accumulation)
            return self._group, self._dtensor
        if self._ddp is not None:
            return self._ddp.process_group, True
        if self._dtensor:  # FSDP2 averages over its data-parallel group
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                return self._group, True
        return False, False

    def _window_group(self) -> tuple[bool, Any]:
        """(whether the ranks accumulate different, still unreduced gradients in an open window, their
        process group): ``on_horovod`` and DDP runs (``no_sync``) reduce only at the update."""
        if self._reduce:
            return True, self._group
        if self._ddp is not None:
            return True, self._ddp.process_group
        return False, None

    def _drop_window(self) -> None:
        """Clear the window's gradients and counts (after an update that raised)."""
        self._micro = 0
        self._items = torch.zeros_like(self._items)
        self._zeroed = frozenset()
        if self._mp is not None:
            self._mp.zero_grad()  # the half gradients and the pending fp32 sum
        self._clear_grads()

    def _clear_grads(self) -> None:
        """The updated tensors' gradients after an update: None, except views into flat buffers
        (``optkit.flat_parameters``), which the optimizer zeroes in place so that the next backward
        accumulates into them (the groups whose blocked pass already zeroed them in cache are skipped)."""
        inner = optimizer_chain(self.optimizer)[-1]
        zeroed, self._zeroed = self._zeroed, frozenset()
        if isinstance(inner, _OptkitOptimizer):  # its parameters are the masters
            inner.engine.zero_grad(True, zeroed)  # less the flat groups the update's pass zeroed in cache
        else:
            for q in self.masters:
                q.grad = None
        for i in self._half_idx:  # ("mixed": the half parameters' gradients were folded into the masters')
            self.params[i].grad = None
