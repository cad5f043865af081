"""Checkpoints of the engine: ``state_dict`` / ``load_state_dict`` in torch's format (plus ``"ema_buffers"``),
pickling, and the host's record of the update count.

A loaded state dict is validated whole before anything changes (shapes, dtypes, devices, group keys; a
``torch.optim`` checkpoint of the same rule loads with its group keys renamed): nothing is trusted."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor

from .. import _multi_tensor as mt
from ..flat import flat_buffer_of
from .state import _HostRecord, _Slots
from .state_dict import (
    adopt_torch_groups,
    run_load_pre_hooks,
    validate_state_dict,
)


class CheckpointMixin:
    """Saving and loading the optimizer: torch's state-dict format, checked before use, and pickling. A
    part of :class:`optkit.optimizer.Optimizer`."""

    def state_dict(self) -> dict:
        """torch's state dict, plus ``"ema_buffers"`` (name -> average) when buffers are averaged; the
        state-dict post-hooks see (and may change) the whole of it."""
        posts = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = OrderedDict()  # run below, on the finished dict
        try:
            sd = self._plain_state(super().state_dict())
        finally:
            self._optimizer_state_dict_post_hooks = posts
        if self._ema_buffers:
            sd = {**sd, "ema_buffers": {n: a.detach().clone() for (n, _), a in
                                        zip(self._ema_buffers, self._ema_buffer_avgs)}}
        if self.precision == "stochastic":  # (a resumed run rounds as the uninterrupted one)
            sd = {**sd, "rounding_step": self._rounding_step}
        for hook in posts.values():
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    @staticmethod
    def _plain_state(sd: Any) -> Any:
        """A state dict whose per-parameter entries are plain dicts (not the tracked ones), as torch's."""
        if isinstance(sd, dict) and isinstance(sd.get("state"), dict):
            sd = {**sd, "state": {k: dict(v) if isinstance(v, _Slots) else v for k, v in sd["state"].items()}}
        return sd

    def _mark_host_count(self) -> None:
        """Record the count tensor and its version as those the host count was taken from."""
        it = self._iterations
        self._record.seen = (it, it._version)

    def _host_count_exact(self) -> bool:
        """Whether the host count ``_host_iterations`` still equals ``iterations`` as far as the host can tell
        without reading the device: no step could have been skipped, and the count tensor's version counter
        shows no write since the host counted (``opt.iterations.zero_()``, a ``copy_`` into it). Once not,
        the device count is used from then on. (The EMA's weight and the ``ema_overwrite_frequency`` cadence
        rely on it: a write that bypasses the version counter, through ``.data`` or a collective, is not
        seen.)"""
        if not self._host_exact:
            return False
        seen = getattr(self._record, "seen", None)  # (absent in a record pickled by an earlier optkit)
        it = self._iterations
        if seen is None or seen[0] is not it or seen[1] != it._version:
            self._host_exact = False
            return False
        return True

    def __getstate__(self) -> dict:
        """Everything (torch's own version keeps only defaults, state and param_groups, which would lose the
        Keras options and the counters); cached plans are rebuilt on the next step."""
        state = dict(self.__dict__)
        state["_block"] = None
        state["_ema_swapped"] = False  # a copy taken inside ema_weights() holds the averages as its weights
        # caches keyed by group ids or storage addresses, which a copy does not keep
        for key in ("_plans", "_fold_cache", "_factor_cache", "_fp64_cache", "_fit_seen", "_slots_seen",
                    "_flat_slots", "_lr_written", "_lr_scalars", "_lean_cache", "_lean_lengths"):
            state[key] = {}
        # parameters excluded from decay by identity travel as the tensors themselves (a copy's are new)
        ids = state.pop("_wd_exclude_ids", set())
        state["_wd_exclude_params"] = [p for g in self.param_groups for p in g["params"] if id(p) in ids]
        return state

    def __setstate__(self, state: dict) -> None:
        if "_iterations" in state and "_record" not in state:  # pickled by an earlier optkit
            record = state["_record"] = _HostRecord()
            record.iterations = state.pop("_host_iterations", 0)
            record.exact = state.pop("_host_exact", False)
            record.applied = state.pop("step_applied", None)
        excluded = state.pop("_wd_exclude_params", None)
        for key in ("_zero_grads_in_pass", "_zeroed_groups", "_overflow_probe", "_gathered", "_step_inv"):
            state.pop(key, None)  # (the step protocol's attributes of an earlier optkit: now StepContext)
        super().__setstate__(state)
        if excluded is not None:
            self._wd_exclude_ids = {id(p) for p in excluded}
        if "_iterations" not in state:  # torch's load_state_dict also lands here; it re-links afterwards
            return
        if "_state_version" not in state:  # pickled by an earlier optkit
            self._adopt_state()
        if "_factor_cache" not in state:  # pickled by an earlier optkit
            self._factor_cache = {}
        for key in ("_lean_cache", "_lean_lengths"):  # (an earlier optkit's pickle has no lean options)
            if key not in state:
                setattr(self, key, {})
        if "_lr_scalars" not in state:  # pickled by an earlier optkit
            self._lr_scalars = {}
            self._applied_true = torch.ones((), dtype=torch.bool, device=self._state_device)
        for g in self.param_groups:  # (new group dicts)
            self._record_group(g)
        # a copy or unpickle: the state entries each got their own 'step' tensor, share the counter again
        for g in self.param_groups:
            for p in g["params"]:
                if p in self.state:
                    self.state[p]["step"] = self._iterations

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a :meth:`state_dict` (torch format), checked before anything changes.

        torch's load pre-hooks run first; then the structure, every slot (a tensor of the parameter's shape,
        real floating dtype, dense) and every step count are validated against this optimizer, raising
        ``ValueError`` that names the parameter and slot; then torch's loading (slots cast to the parameter's
        dtype and device), and the post-hooks last. Afterwards the names given at construction are kept,
        every parameter shares one ``iterations`` counter, slots are the optimizer's own copies in their
        parameter's memory layout, and a missing EMA average starts from the current weights.
        """
        sd = dict(run_load_pre_hooks(self, state_dict))
        buffer_avgs = self._check_ema_buffers(sd.pop("ema_buffers", None))
        rounding_step = sd.pop("rounding_step", None)
        if rounding_step is not None and (isinstance(rounding_step, bool) or not isinstance(
                rounding_step, int) or rounding_step < 0):
            raise ValueError(f"{type(self).__name__}.load_state_dict: 'rounding_step' must be a "
                             f"non-negative int, got {rounding_step!r}")
        sd = adopt_torch_groups(self, sd)
        if isinstance(sd.get("param_groups"), list):  # keys a group would ignore, as for given groups
            for saved, live in zip(sd["param_groups"], self.param_groups):
                if isinstance(saved, dict):
                    self._check_group_keys(saved, live)
        step = validate_state_dict(self, sd)
        # own copies: torch would alias the given tensors (``Tensor.to`` returns the same tensor when nothing
        # changes), so two optimizers loaded from one live state dict would update one buffer; an entry that
        # is not a parameter's state is loaded as it is (torch's rule)
        ids = {i for g in sd["param_groups"] for i in g["params"]}
        own = {key: {s: v.detach().clone() if isinstance(v, Tensor) else v for s, v in e.items()}
               if key in ids else e for key, e in sd["state"].items()}
        held = self._hold_lean_entries(sd, own)  # (torch's load would cast them to the parameter's dtype)
        sd = {**sd, "state": own}
        names = [list(g["param_names"]) for g in self.param_groups]
        pre, post = self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks
        self._optimizer_load_state_dict_pre_hooks = type(pre)()
        self._optimizer_load_state_dict_post_hooks = type(post)()
        try:
            super().load_state_dict(sd)
        finally:
            self._optimizer_load_state_dict_pre_hooks = pre
            self._optimizer_load_state_dict_post_hooks = post
        self._lr_written.clear()  # new group dicts (an old id may be reused)
        self._adopt_state()  # (torch's load put in a plain defaultdict)
        for g, ns in zip(self.param_groups, names):
            g["param_names"] = ns
            self._group_key_aliases(g, self.defaults)
            self._record_group(g)
        self._invalidate_plans()
        self._iterations = torch.as_tensor(step, dtype=torch.int64).to(self._state_device).clone()
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state[p]
                if self.use_ema and "average" not in st and self._weight_form(p) is None:
                    st["average"] = p.detach().clone(memory_format=torch.preserve_format)
                self._init_state(p, g)
                in_flat = flat_buffer_of(p) is not None
                lean = self._lean_keys(p, g)
                for key, v in st.items():
                    if key == "step" or not isinstance(v, Tensor) or mt.is_dtensor(v) or key in lean:
                        continue
                    if in_flat and v.shape == p.shape:
                        # back into this slot's flat buffer (the loaded tensor is a separate one), so that a
                        # resumed run keeps stepping the whole buffer at once
                        st[key] = self._new_slot(p, key, 0.0).copy_(v)
                    elif v.stride() != mt.local(p).stride():
                        st[key] = torch.empty_like(p, memory_format=torch.preserve_format).copy_(v)
        self._load_lean_entries(held)
        if rounding_step is not None:
            self._rounding_step = rounding_step
        self._host_iterations = int(self._iterations)
        self._host_exact = True
        self._mark_host_count()
        if buffer_avgs is None and self._ema_buffers:  # saved without them: start from the buffers now, as a
            buffer_avgs = [b for _, b in self._ema_buffers]  # missing weight average starts from the weights
        if buffer_avgs is not None:
            with torch.no_grad():
                for a, v in zip(self._ema_buffer_avgs, buffer_avgs):
                    a.copy_(v)
        if isinstance(self._learning_rate, (float, Tensor)) and self.param_groups:
            lr0 = self._default_lr()
            self._learning_rate = lr0 if isinstance(lr0, Tensor) else float(lr0)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)
