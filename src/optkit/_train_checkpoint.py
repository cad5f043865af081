"""The train op's checkpoint (:class:`optkit.train.TrainOp`), as the mixin :class:`TrainOpCheckpoint`.

``state_dict()`` / ``load_state_dict()``: the optimizer stack (with the wrappers' parts: the fp32 masters),
the loss scaler, the step counters, the summary counter and the open window's accumulated gradients and token
count; a load checks every entry before anything changes. Inside an accumulation window of a data-parallel run
each rank holds its own unreduced sums: ``state_dict`` then gathers every rank's on the group's first rank,
and ``load_state_dict`` gives each rank its own row back. ``__getstate__`` / ``__setstate__``: a copy or a
pickle keeps the open window's gradients (torch leaves a parameter's ``.grad`` behind).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from . import _multi_tensor as mt
from ._validation import check_count, check_int

__all__ = ["TrainOpCheckpoint"]

_STATE_KEYS = ("optimizer", "scaler", "global_step", "host_step", "host_exact", "micro", "accumulators",
               "summary_attempts")


class TrainOpCheckpoint:
    """The bodies of ``state_dict``/``load_state_dict`` and the copy/pickle state of a
    :class:`~optkit.train.TrainOp`."""

    def __getstate__(self) -> dict[str, Any]:
        """Everything, and the open window's accumulated gradients with it: a parameter's copy or pickle
        leaves its ``.grad`` behind (torch), so a copy taken inside a window would lose what it summed."""
        state = dict(self.__dict__)
        state["_window_grads"] = [(q, q.grad) for q in self.masters if q.grad is not None]
        # the copy's count tensor has a version counter of its own: say whether the count was unwritten
        state["_step_seen"] = self._step._version == getattr(self, "_step_seen", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        pairs = state.pop("_window_grads", ())
        unwritten = state.pop("_step_seen", True) is True  # (absent from an earlier optkit's: it counted on)
        self.__dict__.update(state)
        self._step_seen = self._step._version if unwritten else None
        for q, g in pairs:
            if q.grad is None:
                q.grad = g

    def _state_dict(self) -> dict[str, Any]:
        """:meth:`TrainOp.state_dict <optkit.train.TrainOp.state_dict>`."""
        if self._micro and self._fsdp_sync is not None:
            raise ValueError(
                "TrainOp.state_dict(): an FSDP2 model holds the open accumulation window's gradients inside "
                f"FSDP2 ({self._micro} micro-batch(es) so far); take the state at a window boundary "
                "(micro_steps == 0)"
            )
        acc = [None if q.grad is None else q.grad.detach().clone() for q in self.masters]
        out = {
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "global_step": self._step.clone(),
            "host_step": self._host_step,
            "host_exact": self._host_step_exact(),
            "micro": self._micro,
            "accumulators": acc,
            "summary_attempts": self.summaries.attempts,
            "items": self._items.clone(),
        }
        per_rank, group = self._window_group()
        if self._micro and per_rank:
            gathered = self._gather_accumulators(acc, group)
            if gathered is not None:
                out["accumulators"], out["accumulators_present"] = gathered
                out["accumulators_world_size"] = int(gathered[1].shape[1])
            rows = self._gather_items(group)
            if rows is not None:
                out["items"] = rows
        return out

    def _gather_accumulators(self, acc: list[Tensor | None], group: Any) -> tuple[list, Tensor] | None:
        """Every rank's accumulators on the group's first rank: ([None or [W, *shape]], present [n, W]);
        None on the other ranks. One gather for the presence mask and one per dtype for the values."""
        import torch.distributed as dist

        world, me = dist.get_world_size(group), dist.get_rank(group)
        dst = dist.get_global_rank(group, 0) if group is not None else 0
        device = mt.local(self.masters[0]).device
        dense = [None if a is None else (a.to_dense() if a.is_sparse else a) for a in acc]
        present = torch.tensor([a is not None for a in dense], dtype=torch.float32, device=device)
        flags = [torch.empty_like(present) for _ in range(world)] if me == 0 else None
        dist.gather(present, flags, dst=dst, group=group)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, q in enumerate(self.masters):
            by_dtype.setdefault(q.dtype, []).append(i)
        rows: dict[int, list[Tensor]] = {}
        for dtype, ids in by_dtype.items():
            flat = torch.cat([(mt.local(dense[i]) if dense[i] is not None else  # type: ignore[arg-type]
                               torch.zeros(mt.local(self.masters[i]).shape, dtype=dtype, device=device)
                               ).reshape(-1).to(device=device, dtype=dtype) for i in ids])
            bufs = [torch.empty_like(flat) for _ in range(world)] if me == 0 else None
            dist.gather(flat, bufs, dst=dst, group=group)
            if me == 0:
                sizes = [mt.local(self.masters[i]).numel() for i in ids]
                per = [torch.split(b, sizes) for b in bufs]  # type: ignore[union-attr]
                for k, i in enumerate(ids):
                    shape = mt.local(self.masters[i]).shape
                    rows[i] = [per[r][k].view(shape) for r in range(world)]
        if me != 0:
            return None
        mask = torch.stack(flags, 1).bool().cpu()  # type: ignore[arg-type]
        out = [torch.stack(rows[i]) if bool(mask[i].any()) else None for i in range(len(self.masters))]
        return out, mask

    def _load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """:meth:`TrainOp.load_state_dict <optkit.train.TrainOp.load_state_dict>`."""
        where = "TrainOp.load_state_dict"
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"load_state_dict: expected a dict, got {type(state_dict).__name__}")
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise ValueError(f"load_state_dict: missing keys {missing}")
        # the train op's own entries
        step = check_count("'global_step'", state_dict["global_step"], where=where)
        host_step = check_count("'host_step'", state_dict["host_step"], where=where)
        host_exact = state_dict["host_exact"]
        if not isinstance(host_exact, bool):
            raise TypeError(f"{where}: 'host_exact' must be a bool, got {type(host_exact).__name__} "
                            f"({host_exact!r})")
        if host_exact and self._checks:
            raise ValueError(f"{where}: 'host_exact' is True, but this train op's loss scaler can skip "
                             "updates (the host count cannot be exact)")
        if host_exact and host_step != step:
            raise ValueError(f"{where}: 'host_step' ({host_step}) must equal 'global_step' ({step}) when "
                             "'host_exact' is True")
        micro = check_int("'micro'", state_dict["micro"], where=where, minimum=0)
        if self.skip_update_ph is None and micro >= self.iter_size:
            raise ValueError(f"{where}: 'micro' must be < iter_size ({self.iter_size}) (micro-batches in the "
                             f"open window), got {micro}")
        attempts = check_int("'summary_attempts'", state_dict["summary_attempts"], where=where, minimum=0)
        acc = state_dict["accumulators"]
        if not isinstance(acc, (list, tuple)):
            raise TypeError(f"{where}: 'accumulators' must be a list, got {type(acc).__name__}")
        if len(acc) != len(self.masters):
            raise ValueError("load_state_dict: the state was saved for a different set of parameters")
        saved_world = state_dict.get("accumulators_world_size")
        if saved_world is not None:
            saved_world = check_int("'accumulators_world_size'", saved_world, where=where, minimum=1)
            acc = self._own_accumulators(acc, saved_world, state_dict.get("accumulators_present"))
        for i, (a, q) in enumerate(zip(acc, self.masters)):
            if a is None:
                continue
            if not isinstance(a, Tensor):
                raise TypeError(f"{where}: 'accumulators'[{i}] must be a tensor or None, "
                                f"got {type(a).__name__}")
            if tuple(a.shape) != tuple(q.shape):
                raise ValueError(f"load_state_dict: accumulator shape {tuple(a.shape)} != {tuple(q.shape)} "
                                 f"('accumulators'[{i}])")
            if not a.is_floating_point():
                raise ValueError(f"{where}: 'accumulators'[{i}] must be a floating-point tensor, "
                                 f"got {a.dtype}")
            if not self._checks:  # no loss scaler skips a non-finite window here: it would reach the update
                values = a.coalesce().values() if a.is_sparse else a
                if not bool(torch.isfinite(values).all()):
                    raise ValueError(f"{where}: 'accumulators'[{i}] holds NaN or inf values")
        items = self._saved_items(state_dict.get("items"), saved_world)
        # the optimizer's and the scaler's states, on copies (their own load_state_dict checks them)
        copy.deepcopy(self.scaler).load_state_dict(state_dict["scaler"])
        try:
            probe = copy.deepcopy(self.optimizer)
        except Exception:  # noqa: BLE001 - an optimizer that cannot be copied is only checked by its own load
            probe = None
        if probe is not None:
            probe.load_state_dict(state_dict["optimizer"])
            del probe
        # everything checked: assign
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.scaler.load_state_dict(state_dict["scaler"])
        self._step.fill_(step)
        self._host_step = host_step
        self._host_exact = host_exact
        self._step_seen = self._step._version
        self._micro = micro
        self._items.copy_(items)
        self.summaries.attempts = attempts
        pos = {id(q): j for j, q in enumerate(self.masters)}
        if self._mp is not None:
            self._mp.zero_grad(set_to_none=True)  # drops the wrapper's pending accumulation
            self._mp.accumulate_grads([acc[pos[id(m)]] for m in self._mp.master_params])
        half = {id(self.masters[i]) for i in self._half_idx}
        for a, q in zip(acc, self.masters):
            if id(q) in half:
                continue
            q.grad = None if a is None else a.clone().to(q.dtype)
        self._lr_error = None
        try:
            self._lr_now = self._lr_at_step()
            self._lr_t = self._lr_tensor(self._lr_now, self._step.device)
        except Exception as err:  # noqa: BLE001 - the state is loaded; the next update raises it first
            self._lr_error = err

    def _gather_items(self, group: Any) -> Tensor | None:
        """Every rank's window count (token-weighted accumulation) on the group's first rank as a [W]
        tensor; None on the other ranks."""
        import torch.distributed as dist

        world, me = dist.get_world_size(group), dist.get_rank(group)
        dst = dist.get_global_rank(group, 0) if group is not None else 0
        mine = self._items.reshape(1).clone()
        rows = [torch.empty_like(mine) for _ in range(world)] if me == 0 else None
        dist.gather(mine, rows, dst=dst, group=group)
        return torch.cat(rows) if me == 0 else None

    def _saved_items(self, saved: Any, world: int | None) -> Tensor:
        """The window count to restore (checked): a 0-d tensor, or this rank's entry of a per-rank [W]
        tensor; 0 for states saved before token-weighted accumulation."""
        if saved is None:
            return torch.zeros_like(self._items)
        if not isinstance(saved, Tensor) or not saved.is_floating_point() or \
                saved.numel() != (1 if world is None or saved.dim() == 0 else world):
            raise ValueError("load_state_dict: 'items' must be a floating-point tensor (one entry per rank "
                             "inside a data-parallel window)")
        if not bool(torch.isfinite(saved).all()) or bool((saved < 0).any()):
            raise ValueError("TrainOp.load_state_dict: 'items' (tokens in the open window) must be finite "
                             "and >= 0")
        if world is not None and saved.dim() == 1:
            _, group = self._window_group()
            import torch.distributed as dist

            saved = saved[dist.get_rank(group)]
        return saved.reshape(()).to(self._items.device, torch.float64)

    def _own_accumulators(self, acc: Sequence[Any], world: int, present: Any) -> list[Tensor | None]:
        """This rank's row of accumulators saved for ``world`` ranks (validated)."""
        per_rank, group = self._window_group()
        where = "load_state_dict"
        if not per_rank:
            raise ValueError(f"{where}: the state holds the accumulators of {world} data-parallel ranks; "
                             "load it into a data-parallel train op (on_horovod or DDP) on as many ranks")
        import torch.distributed as dist

        if dist.get_world_size(group) != world:
            raise ValueError(f"{where}: the state was taken inside an accumulation window on {world} ranks; "
                             f"resume on {world} ranks (this run has {dist.get_world_size(group)})")
        if not isinstance(present, Tensor) or tuple(present.shape) != (len(self.masters), world):
            raise ValueError(f"{where}: 'accumulators_present' must be a [{len(self.masters)}, {world}] "
                             "tensor")
        me = dist.get_rank(group)
        out: list[Tensor | None] = []
        for i, (a, q) in enumerate(zip(acc, self.masters)):
            if a is not None and (not isinstance(a, Tensor) or tuple(a.shape) != (world, *q.shape)):
                raise ValueError(f"{where}: per-rank accumulator {i} must have shape {(world, *q.shape)}")
            out.append(a[me] if a is not None and bool(present[i, me]) else None)
        return out
