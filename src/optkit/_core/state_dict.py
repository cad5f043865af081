"""Validation of a state dict before an optkit optimizer loads it (nothing in a file is trusted).

torch's ``Optimizer.load_state_dict`` checks only the number of groups and of parameters per group, casts
the slots to the parameter's dtype and device, and trusts the rest. torch's fused kernels then read as many
elements as the parameter has, whatever the slot holds: a truncated or foreign slot corrupts memory. Here
every part is checked first, and the error names the parameter and the slot:

* structure: ``{"state": dict, "param_groups": list}``, as many groups and parameters per group as the
  optimizer has, parameter ids (positions, or names from ``torch.distributed.checkpoint``) each once; a
  state key of another kind is not a parameter's (torch's contract lets hooks store anything there) and is
  loaded as it is;
* hyperparameters: a saved value has the type of the live one (no string learning rate, no list momentum);
* slots: only the ones the optimizer keeps (``"average"`` only with EMA on), each a dense real floating tensor
  of the parameter's global shape, a DTensor exactly when the parameter is one;
* steps: non-negative integers (a Python number or a scalar tensor), one value for every parameter (an optkit
  optimizer keeps one count of applied updates).

A ``torch.optim`` optimizer inside an optkit wrapper gets the same structure and step checks and the shape
check of its parameter-shaped slots (:func:`validate_torch_state_dict`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .. import _multi_tensor as mt
from .._arguments import GROUP_ALIASES
from .._validation import check_count, is_number
from .lean import LEAN_EXTRAS, scales_key
from .lowp import scales_shape

__all__ = ["TORCH_PARAM_SHAPED", "adopt_torch_groups", "check_group_hyperparameters", "check_loaded_slot",
           "run_load_pre_hooks", "torch_required", "validate_state_dict", "validate_torch_state_dict"]


def run_load_pre_hooks(opt: torch.optim.Optimizer, state_dict: Any) -> dict:
    """The start of a ``load_state_dict`` (torch semantics): ``TypeError`` unless ``state_dict`` is a dict,
    then the load pre-hooks run on a shallow copy, each may return a replacement; returns the result."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    sd = state_dict.copy()
    for pre_hook in opt._optimizer_load_state_dict_pre_hooks.values():
        result = pre_hook(opt, sd)
        if result is not None:
            sd = result
    return sd


def validate_state_dict(opt: Any, sd: dict) -> int:
    """Check the state dict ``sd`` against the optimizer ``opt`` before anything is loaded (see
    :meth:`optkit.Optimizer.load_state_dict`); return its step count."""
    where = f"{type(opt).__name__}.load_state_dict"
    id_to_param = _check_structure(where, opt, sd)
    allowed = set(opt.slot_names) | {"step"} | ({"average"} if opt.use_ema else set())
    # the lean forms' entries (optkit._core.lean): 8-bit block scales, split-master low halves, Kahan sums
    lean_keys = {scales_key(s) for s in opt.slot_names} | set(LEAN_EXTRAS.values())
    allowed |= lean_keys
    steps = set()
    for key, entry in sd["state"].items():
        if key not in id_to_param:  # not a parameter's state (torch's contract): loaded as it is
            continue
        p, name = id_to_param[key]
        extra = sorted(str(k) for k in entry if k not in allowed)
        if extra:
            hint = " (saved with use_ema=True?)" if "average" in extra else \
                " (a state dict of another optimizer?)"
            raise ValueError(f"{where}: state of parameter {name!r} has unexpected slot(s) "
                             f"{extra}{hint}; {type(opt).__name__} keeps {sorted(allowed)}")
        for slot, value in entry.items():
            if slot == "step":
                steps.add(_check_step(where, name, value))
                continue
            if slot in lean_keys or (isinstance(value, Tensor) and value.dtype == torch.uint8):
                check_lean_entry(where, name, slot, p, value, entry)
                continue
            check_loaded_slot(where, name, slot, p, value)
    if len(steps) > 1:
        raise ValueError(f"{where}: parameters hold different step counts {sorted(steps)}; an optkit "
                         "optimizer keeps one count of applied updates")
    return steps.pop() if steps else 0


def _check_structure(where: str, opt: Any, sd: Any) -> dict[Any, tuple[Tensor, str]]:
    """The structure shared by optkit and torch state dicts; returns {parameter id: (parameter, name)}."""
    if not isinstance(sd, dict) or not isinstance(sd.get("state"), dict) \
            or not isinstance(sd.get("param_groups"), list):
        raise ValueError(f"{where}: expected a dict with 'state' (dict) and 'param_groups' (list)")
    saved_groups = sd["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(f"{where}: the state dict has {len(saved_groups)} param groups, this optimizer "
                         f"{len(opt.param_groups)}")
    id_to_param: dict[Any, tuple[Tensor, str]] = {}
    for gi, (sg, g) in enumerate(zip(saved_groups, opt.param_groups)):
        # ids are positions (torch) or parameter names (torch.distributed.checkpoint)
        if not isinstance(sg, dict) or not isinstance(sg.get("params"), list) or not all(
                isinstance(i, (int, str)) and not isinstance(i, bool) for i in sg["params"]):
            raise ValueError(f"{where}: param group {gi} must be a dict whose 'params' lists ints or "
                             "names")
        if len(sg["params"]) != len(g["params"]):
            raise ValueError(f"{where}: param group {gi} holds {len(sg['params'])} parameters in the "
                             f"state dict and {len(g['params'])} in this optimizer")
        _check_group_values(where, gi, sg, g)
        names = g.get("param_names") or [f"group {gi} #{j}" for j in range(len(g["params"]))]
        for i, p, n in zip(sg["params"], g["params"], names):
            if i in id_to_param:
                raise ValueError(f"{where}: parameter id {i} appears twice in 'param_groups'")
            id_to_param[i] = (p, n)
    id_kinds = {type(i) for i in id_to_param}
    for key, entry in sd["state"].items():
        if key not in id_to_param:
            # torch's contract: state under a key that is not a parameter (a hook's ``state["note"] = 1``) is
            # loaded as it is; a key of the kind the parameter ids are (a position, or a name under
            # torch.distributed.checkpoint) must be one of them
            if type(key) in id_kinds:
                raise ValueError(f"{where}: state for unknown parameter id {key!r}")
            continue
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: state of parameter {id_to_param[key][1]!r} must be a dict")
    return id_to_param


#: torch.optim group keys that only choose an implementation (nothing in the math): dropped on load
_TORCH_IMPLEMENTATION_KEYS = frozenset({"foreach", "fused", "capturable", "differentiable"})


def torch_required(opt: Any) -> dict[str, Any]:
    """torch.optim group switches that change the math, with the value ``opt``'s rule computes with:
    ``maximize`` False, and the class's own (``opt._torch_required``: SGD's ``dampening`` 0, Adam's
    ``decoupled_weight_decay``)."""
    return {"maximize": False, **getattr(opt, "_torch_required", {})}


def adopt_torch_groups(opt: Any, sd: Any) -> Any:
    """``sd`` with the param groups of a ``torch.optim`` checkpoint in ``opt``'s own keys (the others are
    returned as they are; anything malformed is left for :func:`validate_state_dict` to refuse).

    For each saved group of an optimizer with torch's rule (``opt._loads_torch_checkpoints``): torch's name
    of a hyperparameter (``opt._torch_group_keys``: ``betas`` → ``beta1``, ``beta2``; ``eps`` → ``epsilon``)
    gives the optkit key when that is missing. For every optimizer, a key optkit spelled otherwise before
    (``GROUP_ALIASES``: ``use_nesterov`` → ``nesterov``) is renamed likewise. A torch switch that changes
    the math must hold the value optkit computes with (``opt._torch_required``: ``maximize`` False, SGD's
    ``dampening`` 0, Adam's ``decoupled_weight_decay``), else ``ValueError`` naming it; torch's
    implementation switches (``foreach``, ``fused``, ...) are dropped. A key of ``opt``'s groups the file
    lacks (an option added since, or one torch does not have) takes the live group's value, as torch's
    ``__setstate__`` fills new options, unless ``opt._missing_group_key(key, live_value, saved_group,
    saved_state)`` tells it from the saved state (Adam: ``amsgrad`` from ``max_exp_avg_sq`` slots)."""
    if not isinstance(sd, dict) or not isinstance(sd.get("param_groups"), list) \
            or len(sd["param_groups"]) != len(opt.param_groups):
        return sd
    where = f"{type(opt).__name__}.load_state_dict"
    # only optimizers whose rule is torch's translate torch's names (RMSProp, LAMB, LARS keep them, so that
    # the group check refuses such a file)
    aliases: dict[str, tuple[str, ...]] = (getattr(opt, "_torch_group_keys", {})
                                           if getattr(opt, "_loads_torch_checkpoints", False) else {})
    required = torch_required(opt)
    groups = []
    for gi, (saved, live) in enumerate(zip(sd["param_groups"], opt.param_groups)):
        if not isinstance(saved, dict):
            return sd
        g = dict(saved)
        for old, key in GROUP_ALIASES.items():  # optkit's earlier spelling (files of optkit <= 0.3)
            if old in g and key in live and old not in live:
                value = g.pop(old)
                g.setdefault(key, value)
        for tk, keys in aliases.items():
            if tk not in g or tk in live or all(k in g for k in keys):
                continue
            value = g.pop(tk)
            if len(keys) > 1:
                if not isinstance(value, (list, tuple)) or len(value) != len(keys):
                    raise ValueError(f"{where}: param group {gi} key {tk!r} must hold {len(keys)} values, "
                                     f"got {value!r}")
                g.update({k: v for k, v in zip(keys, value) if k not in g})
            else:
                g.setdefault(keys[0], value)
        for key, want in required.items():
            if key in g and key not in live:
                value = g.pop(key)
                if value != want:
                    raise ValueError(f"{where}: param group {gi} has {key}={value!r} (a torch.optim "
                                     f"setting); {type(opt).__name__} computes with {key}={want!r}")
        for key in _TORCH_IMPLEMENTATION_KEYS:
            if key not in live:
                g.pop(key, None)
        infer = getattr(opt, "_missing_group_key", None)
        for key, value in live.items():
            if key not in g and key not in ("params", "param_names"):
                g[key] = value if infer is None else infer(key, value, g, sd.get("state"))
        groups.append(g)
    return {**sd, "param_groups": groups}


#: per-parameter state of torch.optim optimizers that has the parameter's shape (SGD, Adam, AdamW, Adamax,
#: NAdam, RAdam, Adagrad, Adadelta, RMSprop, Rprop, ASGD, SparseAdam); other entries are scalars or, as
#: Adafactor's factored moments, shaped by their own rule, and are left to torch
TORCH_PARAM_SHAPED = frozenset({
    "momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_inf", "sum", "square_avg", "grad_avg",
    "acc_delta", "prev", "step_size", "ax",
})


def validate_torch_state_dict(opt: torch.optim.Optimizer, sd: Any) -> None:
    """Check a state dict for a ``torch.optim`` optimizer inside an optkit wrapper before it is loaded:
    torch checks only the group and parameter counts, and its kernels read as many elements as the parameter
    has whatever a slot holds. Checked here: the structure (as :func:`validate_state_dict`), each ``step`` a
    non-negative integer, and every :data:`TORCH_PARAM_SHAPED` slot a dense tensor of the parameter's shape
    (complex exactly when the parameter is)."""
    where = f"{type(opt).__name__}.load_state_dict"
    id_to_param = _check_structure(where, opt, sd)
    for key, entry in sd["state"].items():
        if key not in id_to_param:  # not a parameter's state: torch loads it as it is
            continue
        p, name = id_to_param[key]
        for slot, value in entry.items():
            if slot == "step":
                _check_step(where, name, value)
            elif slot in TORCH_PARAM_SHAPED:
                check_loaded_slot(where, name, slot, p, value)


def _check_step(where: str, name: str, value: Any) -> int:
    return check_count(f"'step' of parameter {name!r}", value, where=where, whole_floats=True)


#: bounds of the numeric hyperparameters optkit's optimizers keep in their param groups (the constructors'
#: own ranges): a loaded value outside them (a NaN, a negative learning rate) is refused, not trained with
_RANGES: dict[str, tuple[float | None, float | None]] = {
    "lr": (0.0, None), "learning_rate": (0.0, None), "weight_decay": (0.0, None), "momentum": (0.0, None),
    "beta1": (0.0, 1.0), "beta2": (0.0, 1.0), "beta": (0.0, None), "rho": (0.0, None),
    "epsilon": (0.0, None), "eps": (0.0, None), "eeta": (0.0, None), "lr_scale": (0.0, None),
    "initial_accumulator_value": (0.0, None), "learning_rate_power": (None, 0.0),
    "l1_regularization_strength": (0.0, None), "l2_regularization_strength": (0.0, None),
    "l2_shrinkage_regularization_strength": (0.0, None), "max_coeff": (0.0, None), "min_coeff": (0.0, None),
}
#: string hyperparameters with a fixed set of values
_CHOICES: dict[str, frozenset[str]] = {"variant": frozenset({"tf1.15", "tf1.14"})}


def check_group_hyperparameters(group: dict, where: str) -> None:
    """The numeric hyperparameters a user puts into a param group (``{"params": ..., "lr": 0.1, ...}``, given
    to the constructor or ``add_param_group``): a real number or a one-element real floating tensor, finite
    and within :data:`_RANGES`; ``TypeError`` / ``ValueError`` naming the key, before anything changes."""
    for key, value in check_group_types(group, where):
        _check_number_value(where, None, key, value)


def check_group_types(group: dict, where: str) -> list[tuple[str, Any]]:
    """The kinds of a param group's numeric hyperparameters (a number, or a one-element tensor; ``None`` only
    for LAMB's ``max_coeff`` / ``min_coeff``), without reading a tensor's value (no host sync: a step runs
    it over every group before it writes any); returns the ``(key, value)`` pairs checked."""
    out = []
    for key, value in group.items():
        if key not in _RANGES:
            continue
        if value is None and key in ("max_coeff", "min_coeff"):
            continue
        if isinstance(value, bool) or not (is_number(value) or isinstance(value, Tensor)):
            raise TypeError(f"{where}: param group key {key!r} must be a number, got "
                            f"{type(value).__name__} ({value!r})")
        if isinstance(value, Tensor) and value.numel() != 1:
            raise ValueError(f"{where}: param group key {key!r} must be a single number, got a tensor of "
                             f"shape {tuple(value.shape)}")
        out.append((key, value))
    return out


def _check_number_value(where: str, gi: int | None, key: str, value: Any) -> None:
    """A numeric hyperparameter (a number or a one-element real floating tensor holding data) of param group
    ``gi`` (None: a group being added): finite and within :data:`_RANGES`."""
    group = "param group" if gi is None else f"param group {gi}"
    if isinstance(value, Tensor):
        if value.is_meta or value.layout != torch.strided or value.is_complex() \
                or not value.is_floating_point():
            raise ValueError(f"{where}: {group} key {key!r} must be a real number or a real "
                             "floating-point scalar tensor holding data")
        v = float(value.detach().reshape(()).cpu())
    else:
        try:
            v = float(value)
        except OverflowError:
            v = math.inf
    if not math.isfinite(v):
        raise ValueError(f"{where}: {group} key {key!r} must be finite, got {str(value)[:40]}")
    low, high = _RANGES.get(key, (None, None))
    if (low is not None and v < low) or (high is not None and v > high):
        raise ValueError(f"{where}: {group} key {key!r} must be in [{low}, {high}], got {value!r}")


def _check_group_values(where: str, gi: int, saved: dict, live: dict) -> None:
    """A saved hyperparameter must have the type of the live one (a hostile or foreign file must not put
    a string learning rate or a list momentum into a group)."""
    for key, value in saved.items():
        if key in ("params", "param_names"):
            continue
        if key not in live:  # (a key this optimizer's groups lack: a known hyperparameter is still checked)
            try:
                checked = check_group_types({key: value}, f"{where} (param group {gi})")
            except TypeError as err:
                raise ValueError(str(err)) from None
            for k, v in checked:
                _check_number_value(where, gi, k, v)
            continue
        cur = live[key]
        ok = True
        numeric = False
        if isinstance(cur, bool):
            ok = isinstance(value, bool)
        elif is_number(cur) or (isinstance(cur, Tensor) and cur.numel() == 1):
            ok = numeric = is_number(value) or (isinstance(value, Tensor) and value.numel() == 1
                                                and value.is_floating_point())
        elif isinstance(cur, str):
            ok = isinstance(value, str) and (key not in _CHOICES or value in _CHOICES[key])
        elif isinstance(cur, (list, tuple)):
            ok = isinstance(value, (list, tuple)) and len(value) == len(cur)
        elif cur is None:  # an option that is off (LAMB's max_coeff, LARS's skip_list): off or its kind
            if key in _RANGES:
                ok = value is None or is_number(value)
                numeric = ok and value is not None
            else:
                ok = value is None or (isinstance(value, (list, tuple))
                                       and all(isinstance(x, str) for x in value))
        if not ok:
            raise ValueError(f"{where}: param group {gi} key {key!r} is {type(value).__name__} "
                             f"({value!r}), expected {type(cur).__name__}"
                             + (f" (one of {sorted(_CHOICES[key])})" if key in _CHOICES else ""))
        if numeric:
            _check_number_value(where, gi, key, value)
    names = saved.get("param_names")
    if names is not None and (not isinstance(names, list) or len(names) != len(live["params"])
                              or not all(isinstance(n, str) for n in names)):
        raise ValueError(f"{where}: param group {gi} 'param_names' must list one string per parameter")


def check_loaded_slot(where: str, name: str, slot: str, p: Tensor, value: Any) -> None:
    """A slot from a state dict must be a dense real floating tensor of the parameter's (global) shape, a
    DTensor exactly when the parameter is one."""
    if not isinstance(value, Tensor):
        raise ValueError(f"{where}: slot {slot!r} of parameter {name!r} is {type(value).__name__}, "
                         "not a tensor")
    if value.is_sparse or value.layout != torch.strided:
        raise ValueError(f"{where}: slot {slot!r} of parameter {name!r} must be a dense tensor")
    if value.is_meta:
        raise ValueError(f"{where}: slot {slot!r} of parameter {name!r} is a meta tensor (it holds no data)")
    if value.is_complex() != p.is_complex() or not (value.is_floating_point() or value.is_complex()):
        kind = "complex" if p.is_complex() else "floating-point"
        raise ValueError(f"{where}: slot {slot!r} of parameter {name!r} has dtype {value.dtype}; expected a "
                         f"{kind} tensor")
    if mt.is_dtensor(value) != mt.is_dtensor(p):
        kind = "a DTensor" if mt.is_dtensor(p) else "a plain tensor"
        raise ValueError(f"{where}: slot {slot!r} of parameter {name!r} must be {kind}, like the parameter")
    if tuple(value.shape) != tuple(p.shape):
        raise ValueError(f"{where}: slot {slot!r} of parameter {name!r} has shape {tuple(value.shape)}, the "
                         f"parameter {tuple(p.shape)}")


def check_lean_entry(where: str, name: str, key: str, p: Tensor, value: Any, entry: dict) -> None:
    """An entry of a lean form (:mod:`optkit._core.lean`): an 8-bit slot (uint8 codes of the parameter's
    shape with float32 block scales, finite and non-negative, under ``<slot>_absmax``), a split master's
    low halves (16-bit raw bits, bfloat16 or int16, of the parameter's shape) or a Kahan compensation
    (floating, the parameter's shape);
    each a DTensor exactly when the parameter is one."""
    if not isinstance(value, Tensor) or value.is_sparse or value.layout != torch.strided or value.is_meta:
        raise ValueError(f"{where}: {key!r} of parameter {name!r} must be a dense tensor with data")
    if mt.is_dtensor(value) != mt.is_dtensor(p):
        kind = "a DTensor" if mt.is_dtensor(p) else "a plain tensor"
        raise ValueError(f"{where}: {key!r} of parameter {name!r} must be {kind}, like the parameter")
    if key.endswith("_absmax"):
        codes = entry.get(key[:-len("_absmax")])
        if not isinstance(codes, Tensor) or codes.dtype != torch.uint8:
            raise ValueError(f"{where}: {key!r} of parameter {name!r} has no 8-bit slot (uint8 codes) "
                             "beside it")
        expect = scales_shape(tuple(p.shape))
        if value.dtype != torch.float32 or tuple(value.shape) != expect:
            raise ValueError(f"{where}: {key!r} of parameter {name!r} must be float32 of shape {expect}, got "
                             f"{value.dtype} {tuple(value.shape)}")
        local = mt.local(value)
        if not bool(torch.isfinite(local).all()) or bool((local < 0).any()):
            raise ValueError(f"{where}: {key!r} of parameter {name!r} holds negative or non-finite scales")
        return
    if tuple(value.shape) != tuple(p.shape):
        raise ValueError(f"{where}: {key!r} of parameter {name!r} has shape {tuple(value.shape)}, the "
                         f"parameter {tuple(p.shape)}")
    if key == LEAN_EXTRAS["split"]:
        if value.dtype not in (torch.bfloat16, torch.int16):
            raise ValueError(f"{where}: {key!r} of parameter {name!r} must hold 16-bit raw bits (bfloat16 "
                             f"or int16), got {value.dtype}")
    elif key == LEAN_EXTRAS["kahan"]:
        if not value.is_floating_point():
            raise ValueError(f"{where}: {key!r} of parameter {name!r} must be floating, got {value.dtype}")
    elif scales_key(key) not in entry:  # uint8 codes of a slot
        raise ValueError(f"{where}: 8-bit slot {key!r} of parameter {name!r} has no block scales "
                         f"{scales_key(key)!r} beside it")
