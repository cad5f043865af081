"""Param groups: building and checking a group (aliases such as ``lr``/``betas``, options that hold for the
whole optimizer refused in a group, the mesh), recording its parameters' names, and the weight-decay
exclusions (``exclude_from_weight_decay``, Keras)."""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Iterable
from typing import Any

from torch import Tensor

from .. import _multi_tensor as mt
from .._arguments import GROUP_ALIASES
from .._validation import check_number
from ..flat import flat_buffer_of
from .params import normalize_param_groups
from .state_dict import (
    torch_required,
)

#: constructor arguments that are not optimizer-wide options (``name`` is also a common user label of a group)
_GROUP_KEYS_ANYWHERE = frozenset({"self", "params", "learning_rate", "lr", "kwargs", "hyper", "name",
                                  "amsgrad", "weight_decay"})


@functools.cache
def _wide_options(cls: type) -> frozenset[str]:
    """The constructor arguments of ``cls`` and of the base (``clipnorm``, ``use_ema``, ...) that hold for the
    whole optimizer: a param group holding one would ignore it."""
    base = [c for c in cls.__mro__ if issubclass(c, GroupsMixin) and "__init__" in vars(c)][-1]
    names = {n for c in (base, cls) for n in inspect.signature(c.__init__).parameters}
    return frozenset(names - _GROUP_KEYS_ANYWHERE)


class GroupsMixin:
    """Param groups and the weight-decay exclusions. A part of :class:`optkit.optimizer.Optimizer`."""

    @staticmethod
    def _group_key_aliases(group: dict, own: Any) -> None:
        """A param group may say ``"learning_rate"`` (the TF/Keras name) instead of torch's ``"lr"``, and
        ``"use_nesterov"`` (TF1's) for ``"nesterov"`` where the optimizer has it (``own``: its group keys)."""
        for alias, key in GROUP_ALIASES.items():
            if alias in group and key in own:
                if key in group:
                    raise ValueError(f"a param group sets both {key!r} and {alias!r}; keep one")
                group[key] = group.pop(alias)
        if "learning_rate" in group:
            if "lr" in group:
                raise ValueError("a param group sets both 'lr' and 'learning_rate'; keep one")
            value = group.pop("learning_rate")
            if isinstance(value, Tensor):
                if value.numel() != 1:
                    raise ValueError("a param group's 'learning_rate' tensor must have one element")
            else:
                check_number("learning_rate", value, low=0.0)
            group["lr"] = value

    @staticmethod
    def _check_mesh(mesh: Any, groups: list[dict]) -> None:
        """Every parameter must be a DTensor on ``mesh`` or a sub-mesh of it (``optkit._mesh.check_mesh``)."""
        from .._mesh import check_mesh

        check_mesh(((n, p) for g in groups for n, p in zip(g["param_names"], g["params"])), mesh)

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group (torch API); its parameters get their optimizer state right away. Its parameters
        must be named if and only if the optimizer's are."""
        if not hasattr(self, "_named"):  # torch's __init__ adding the constructor's groups
            super().add_param_group(param_group)
            self._build_group(self.param_groups[-1])
            return
        start = sum(len(g["params"]) for g in self.param_groups)
        (group,), named = normalize_param_groups([param_group], start=start)
        self._group_key_aliases(group, self.defaults)
        self._check_group_keys(group, self.defaults)
        if named != self._named:
            raise ValueError(
                "all optimizer params should be with/without names: this optimizer's parameters are "
                + ("named; pass (name, tensor) pairs" if self._named else "unnamed; pass plain tensors")
            )
        if self.mesh is not None:
            self._check_mesh(self.mesh, [group])
        defaulted = "lr" not in group
        super().add_param_group(group)
        self._lr_defaulted = [*getattr(self, "_lr_defaulted", []), defaulted]
        self._invalidate_plans()
        self._build_group(self.param_groups[-1])

    def _check_group_keys(self, group: dict, own: Any) -> None:
        """A param group must not hold what this optimizer would silently ignore there: an optimizer-wide
        option (``clipnorm``, ``use_ema``, ...: constructor arguments) or torch's name of a hyperparameter
        that optkit spells otherwise (``betas``, ``eps``, ``nesterov``; ``own``: this optimizer's group keys),
        or a torch switch at a value this rule does not compute (``maximize=True``); ``ValueError`` naming
        the key."""
        cls = type(self).__name__
        wide = _wide_options(type(self))
        for key in group:
            if key in wide and key not in own:
                raise ValueError(f"{cls}: param group key {key!r} is an optimizer-wide option; pass it to "
                                 "the constructor (a group would ignore it)")
        for key, value in group.items():
            if isinstance(own.get(key), bool) and not isinstance(value, bool):
                raise TypeError(f"{cls}: param group key {key!r} must be a bool, got {value!r}")
        aliases = getattr(self, "_torch_group_keys", {})
        for key, ours in aliases.items():
            if key in group and key not in own:
                raise ValueError(f"{cls}: param group key {key!r} is torch's name; {cls} takes "
                                 f"{' and '.join(map(repr, ours))}")
        for key, want in torch_required(self).items():
            if key in group and key not in own and group[key] != want:
                raise ValueError(f"{cls}: param group key {key!r}={group[key]!r} is not supported (the rule "
                                 f"computes with {key}={want!r})")

    def _build_group(self, group: dict) -> None:
        views = self.__dict__.setdefault("_flat_grad_views", {})
        for p in group["params"]:
            self._init_state(p, group)
            g = p.grad
            if g is not None and not g.is_sparse and g.shape == p.shape and flat_buffer_of(p) is not None:
                # its gradient view in the flat gradient (optkit.flat_parameters), which zero_grad points
                # .grad back at after a model.zero_grad() or a replacement (see _zero_grad)
                views[id(p)] = (g, g.data_ptr(), p.untyped_storage().data_ptr())
        self._any_dtensor = self._any_dtensor or any(mt.is_dtensor(p) for p in group["params"])
        self._record_group(group)

    def _record_group(self, group: dict) -> None:
        """Remember the group's parameters and names: what :meth:`_ensure_slots` compares the group's list
        with (the names follow their parameters when its length changes). Made again when the groups are
        new dicts (a copy, a load) or their tensors were replaced (fp32 masters)."""
        self.__dict__.setdefault("_slots_seen", {})[id(group)] = (
            (self._active_slots(group), len(group["params"])), list(group["params"]),
            list(group.get("param_names", ())))

    def exclude_from_weight_decay(
        self, var_list: Iterable[Tensor] | None = None, var_names: Iterable[str] | None = None
    ) -> None:
        """Exclude parameters from weight decay: ``var_list`` by identity, ``var_names`` as regexes searched
        (``re.search``) in each parameter's name (from ``named_parameters()``)."""
        if var_list is not None:
            vl = list(var_list)
            if not all(isinstance(v, Tensor) for v in vl):
                raise TypeError("`var_list` must contain Tensors")
            self._wd_exclude_ids.update(id(v) for v in vl)
            self._invalidate_plans()
        if var_names is not None:
            if isinstance(var_names, str):
                raise TypeError("`var_names` must be a list of strings, not a single string")
            names = sorted(set(var_names))
            if not all(isinstance(n, str) for n in names):
                raise TypeError("`var_names` must contain strings")
            if names and not self._named:
                raise ValueError(
                    "exclude_from_weight_decay(var_names=...) matches parameter names, but this optimizer "
                    "got its parameters without names (param_<i>), so nothing would match; build it from "
                    "model.named_parameters(), or pass var_list=[...] instead"
                )
            if names:
                pattern = "|".join(names)
                if self._wd_exclude_regex is not None:
                    pattern = self._wd_exclude_regex.pattern + "|" + pattern
                self._wd_exclude_regex = re.compile(pattern)
                self._invalidate_plans()

    def _use_weight_decay(self, p: Tensor, name: str) -> bool:
        if id(p) in self._wd_exclude_ids:
            return False
        if self._wd_exclude_regex is not None and self._wd_exclude_regex.search(name):
            return False
        return True
