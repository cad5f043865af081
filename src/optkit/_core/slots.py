"""Optimizer slots (Keras's name for per-parameter state such as ``momentum``): made for every parameter at
construction (so a skipped step never creates state), refilled for parameters put in place of others, and
Keras's ``build`` / ``add_variable``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor

from .. import _multi_tensor as mt
from ..flat import flat_buffer_of
from .state import _StateVersion, _TrackedState


class SlotsMixin:
    """The optimizer's per-parameter state (slots). A part of :class:`optkit.optimizer.Optimizer`."""

    def _active_slots(self, group: dict) -> tuple[str, ...]:
        """The slots ``group`` uses (default: all of ``slot_names``; SGD keeps no momentum buffer for a
        group whose momentum is 0)."""
        return self.slot_names

    def _ensure_slots(self) -> None:
        """Create the slots a group started to use since the last step (a scheduler such as ``OneCycleLR``
        turning momentum on): zeros, which is what the rule would start from; O(groups) per step."""
        state = self.state
        if type(state) is not _TrackedState or state._version is not self._state_version:
            self._adopt_state()  # (``opt.state = defaultdict(dict)``, or torch's load put a plain one)
        if self._state_seen != self._state_version.n:  # an entry was replaced, reset or deleted since
            for g in self.param_groups:  # (missing slots come back as a new parameter's, like torch's)
                for p in g["params"]:
                    self._init_state(p, g)
            self._invalidate_plans()
            self._state_seen = self._state_version.n
        start = 0
        for g in self.param_groups:
            # (the count too: a parameter appended to or removed from a group's list gets its state, as
            # torch's lazily, and the names follow their parameters)
            seen = (self._active_slots(g), len(g["params"]))
            record = self._slots_seen.get(id(g))
            if record is None or record[0] != seen:
                self._pair_names(g, record, start)
                for p in g["params"]:
                    self._init_state(p, g)
                self._record_group(g)
                self._invalidate_plans()
                self._state_seen = self._state_version.n
            start += len(g["params"])

    @staticmethod
    def _pair_names(group: dict, record: tuple | None, start: int) -> None:
        """``param_names`` after the group's list changed without its names (torch's idiom): each parameter
        keeps the name it had when last seen (``record``), a new one gets ``param_<position>`` (as unnamed
        parameters are named). Names kept in step with the list (as many as parameters) are left alone."""
        params = group["params"]
        names = group.setdefault("param_names", [])
        if len(names) == len(params):
            return
        if record is not None:
            by_id = {id(p): n for p, n in zip(record[1], record[2])}
            new = [by_id.get(id(p)) for p in params]
        else:
            new = list(names[:len(params)]) + [None] * (len(params) - len(names))
        names[:] = [n if n is not None else f"param_{start + j}" for j, n in enumerate(new)]

    def _init_missing_state(self, group: dict, params: Sequence[Tensor]) -> None:
        """State for parameters that lack some (one put into a group's list in place of another), as torch
        creates it lazily."""
        for p in params:
            st = self.state.get(p)
            if st is None or any(s not in st for s in self._active_slots(group)) or (
                    self.use_ema and "average" not in st):
                self._init_state(p, group)

    def _adopt_state(self) -> None:
        """Make ``self.state`` a :class:`_TrackedState` (entries kept) with a new version counter."""
        version = _StateVersion()
        self.state = _TrackedState(version, self.state)
        self._state_version = version
        self._state_seen = -1  # (checked, and missing slots made, on the next step)

    def _init_state(self, p: Tensor, group: dict) -> None:
        st = self.state[p]
        st["step"] = self._iterations
        for slot in self._active_slots(group):
            if slot not in st:
                form = self._slot_form(p, slot)
                if form is None:
                    st[slot] = self._new_slot(p, slot, self._slot_fill(slot, group))
                else:
                    self._lean_new_slot(st, p, slot, form, self._slot_fill(slot, group))
        self._lean_init_extras(st, p)
        if self.use_ema and "average" not in st:  # from the weights: a group added later has no first step
            with torch.no_grad():
                if self._weight_form(p) is not None:  # (a master-free weight's average: float32, lean pass)
                    st["average"] = self._lean_new_average(p)
                else:
                    st["average"] = self._new_slot(p, "average", 0.0).copy_(p.detach())

    def _slot_fill(self, slot: str, group: dict) -> float:
        """The initial value of ``slot`` (0; RMSProp's ``rms`` starts at 1, Adagrad's and Ftrl's accumulators
        at ``initial_accumulator_value``). Subclasses override."""
        return 0.0

    def _new_slot(self, p: Tensor, slot: str, fill: float) -> Tensor:
        """A slot for ``p`` filled with ``fill``: like ``p`` (its placement and memory format), or, for a
        parameter in a flat buffer (:func:`optkit.flat_parameters`), a view at the same place in a flat buffer
        of this slot, so that the optimizer can step the whole buffer at once."""
        flat = flat_buffer_of(p)
        if flat is None:
            return torch.full_like(p, fill, memory_format=torch.preserve_format)
        key = (flat.untyped_storage().data_ptr(), slot)
        buf = self._flat_slots.get(key)
        if buf is None or buf.numel() != flat.numel():
            buf = self._flat_slots[key] = torch.empty_like(flat)
        view = buf.as_strided(p.shape, p.stride(), p.storage_offset() - flat.storage_offset())
        return view.fill_(fill)

    def _refill_initial_slots(self, replaced: Sequence[tuple[Tensor, Tensor, dict]]) -> bool:
        """Each ``(old, new, group)``: ``new`` took ``old``'s place in ``group`` and holds its state, cast to
        ``new``'s dtype (a mixed-precision wrapper's fp32 master of a half parameter). When that state is
        still what construction built for ``old``, rebuild ``new``'s slots as construction builds them
        (:meth:`_init_state`: ``_slot_fill`` in ``new``'s precision; a half fill such as fp16(0.1) =
        0.0999755859375 cast up would make the run drift from the one built on ``new``). Returns whether it
        did.

        "Still what construction built" is decided from the values, for all of ``replaced`` at once (one host
        read, at construction time): no update applied (``iterations`` is 0) and every slot of
        ``_active_slots(group)`` equal, everywhere, to its fill rounded to ``old``'s dtype. State written by a
        step, a loaded checkpoint or the user (unless it holds exactly those values) is kept as it is; the
        EMA ``average`` (a copy of the weights) and any other entry are never rebuilt."""
        if not replaced:
            return False
        dev = self._iterations.device
        touched = [self._iterations.ne(0)]
        for old, new, group in replaced:
            st = self.state.get(new)
            for slot in self._active_slots(group):
                v = None if st is None else st.get(slot)
                if v is None:  # (made at the first step, in new's precision)
                    continue
                if not isinstance(v, Tensor) or v.shape != new.shape:
                    return False
                fill = torch.tensor(self._slot_fill(slot, group), dtype=old.dtype).to(v.dtype)
                touched.append(mt.local(v).ne(fill.to(mt.local(v).device)).any().to(dev))
        if bool(torch.stack(touched).any()):
            return False
        for _, new, group in replaced:
            st = self.state[new]
            for slot in self._active_slots(group):
                st.pop(slot, None)
            self._init_state(new, group)
        return True

    def build(self, var_list: Iterable[Tensor] | None = None) -> None:
        """Create missing optimizer state for ``var_list`` (default: every parameter). Idempotent.

        optkit builds state at construction so a skipped first step creates nothing; this exists
        for the Keras API and for parameters whose state was removed.
        """
        known = {id(p): g for g in self.param_groups for p in g["params"]}
        vs = [p for g in self.param_groups for p in g["params"]] if var_list is None else list(var_list)
        for v in vs:
            if id(v) not in known:
                raise ValueError("build(): variable is not one of the optimizer's parameters")
            self._init_state(v, known[id(v)])
        self._invalidate_plans()

    def add_variable(
        self,
        shape: Sequence[int] | int = (),
        dtype: torch.dtype | None = None,
        initializer: str | Callable = "zeros",
        name: str | None = None,
    ) -> Tensor:
        """Create an extra optimizer variable (kept in :meth:`variables`); ``initializer`` is
        ``"zeros"``, ``"ones"`` or a callable ``(shape, dtype) -> Tensor``."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        dtype = dtype or torch.get_default_dtype()
        if initializer == "zeros":
            v = torch.zeros(shape, dtype=dtype, device=self._state_device)
        elif initializer == "ones":
            v = torch.ones(shape, dtype=dtype, device=self._state_device)
        elif callable(initializer):
            v = torch.as_tensor(initializer(shape, dtype), dtype=dtype, device=self._state_device)
        else:
            raise ValueError(f"`initializer` must be 'zeros', 'ones' or a callable, got {initializer!r}")
        v._optkit_name = name  # type: ignore[attr-defined]
        self._extra_variables.append(v)
        return v
