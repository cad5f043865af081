"""What an optkit optimizer accepts as ``params``, checked and normalised before anything is created.

Accepted, as in ``torch.optim``: an iterable of tensors, of ``(name, tensor)`` pairs
(``model.named_parameters()``) or of param-group dicts whose ``"params"`` hold either (a dict may also carry
``"param_names"``). Every group comes back with ``"params"`` (tensors) and ``"param_names"``: the given
names, or ``param_<i>`` (position over all groups) for an optimizer built without names. As in torch, an
optimizer's parameters are either all named or all unnamed (``ValueError`` otherwise).

Refused with ``TypeError`` naming the parameter: a single tensor instead of an iterable, non-tensors, complex
parameters (optkit's update rules and norms are written for real tensors; pass ``torch.view_as_real(p)``) and
integer or boolean parameters. ``ValueError``: no parameters, or a non-leaf tensor.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from .state_dict import check_group_hyperparameters

__all__ = ["normalize_param_groups", "auto_name"]


def auto_name(index: int) -> str:
    """The name of the ``index``-th parameter of an optimizer built without names."""
    return f"param_{index}"


def _check_tensor(t: Tensor, label: str) -> None:
    if t.is_complex():
        raise TypeError(
            f"parameter {label} is complex ({t.dtype}); optkit optimizers take real parameters only: "
            "optimize torch.view_as_real(p) instead"
        )
    if not t.is_floating_point():
        raise TypeError(f"parameter {label} has dtype {t.dtype}; optimizers need floating-point parameters")
    if not t.is_leaf:
        raise ValueError(f"can't optimize a non-leaf Tensor (parameter {label})")


def normalize_param_groups(params: Any, start: int = 0) -> tuple[list[dict], bool]:
    """``(groups, named)``: the groups as dicts with ``"params"`` and ``"param_names"`` (other keys kept), and
    whether the names were given. ``start`` numbers automatic names after the optimizer's existing
    parameters (``add_param_group``)."""
    if isinstance(params, Tensor):
        raise TypeError(
            "`params` must be an iterable of tensors, (name, tensor) pairs or param-group dicts, "
            "got a single Tensor"
        )
    if isinstance(params, dict):
        params = [params]
    items = list(params)
    if not items:
        raise ValueError("`params` is empty: the optimizer got no parameters")
    if isinstance(items[0], dict):
        if not all(isinstance(g, dict) for g in items):
            raise TypeError("`params` mixes param-group dicts with other entries")
        groups = [dict(g) for g in items]
    else:
        groups = [{"params": items}]
    counter = start
    named_flags: set[bool] = set()
    for g in groups:
        if "params" not in g:
            raise TypeError("every param group must be a dict with a 'params' entry")
        ps = g["params"]
        ps = [ps] if isinstance(ps, Tensor) else list(ps)
        given = g.get("param_names")
        if given is not None and (isinstance(given, str) or len(list(given)) != len(ps)):
            raise ValueError("a param group's 'param_names' must list one name per parameter")
        given = None if given is None else list(given)
        tensors, names = [], []
        for j, item in enumerate(ps):
            if isinstance(item, tuple):
                if len(item) != 2 or not isinstance(item[0], str) or not isinstance(item[1], Tensor):
                    raise TypeError(f"named parameters must be (str, Tensor) pairs, got {item!r}")
                name, t = item
            elif isinstance(item, Tensor):
                name, t = (given[j] if given is not None else None), item
            else:
                raise TypeError(f"`params` entries must be Tensors, got {type(item).__name__}")
            named_flags.add(name is not None)
            label = repr(name) if name is not None else f"#{counter}"
            _check_tensor(t, label)
            tensors.append(t)
            names.append(str(name) if name is not None else auto_name(counter))
            counter += 1
        if len({id(t) for t in tensors}) != len(tensors):
            first: dict[int, str] = {}
            a, b = next((first[id(t)], n) for t, n in zip(tensors, names)
                        if id(t) in first or first.setdefault(id(t), n) is None)
            raise ValueError(f"`params`: one tensor appears twice in a param group (as {a!r} and {b!r}); it "
                             "would be updated twice per step")
        check_group_hyperparameters(g, "`params`")
        g["params"] = tensors
        g["param_names"] = names
    if not any(g["params"] for g in groups):
        raise ValueError("`params`: the param groups hold no parameters: the optimizer got none to update")
    if len(named_flags) > 1:
        raise ValueError(
            "all optimizer params should be with/without names; some param names are missing "
            "(pass model.named_parameters() for every group, or plain tensors for all)"
        )
    return groups, named_flags == {True}
