"""Strict checking of parameter dictionaries, OpenSeq2Seq style.

OpenSeq2Seq configures its loss scalers, LARC and ``optimize_loss`` with plain dicts (``loss_scaling_params``,
``larc_params``) and checks them with ``utils.check_params(config, required, optional)``
(``open_seq2seq/utils/utils.py``). That check is strict in four ways, and so is :func:`check_params`:

1. every key of ``required`` must be present;
2. a declared type (a class, or a tuple of classes) is checked with ``isinstance``: an ``int`` is
   rejected where ``float`` is declared (``larc_eta: 1`` fails, ``larc_eta: 1.0`` passes);
3. a declared *list* is a set of allowed values: the value must equal one of them (and have its type);
4. any key that is in neither dict raises ``ValueError("Unknown parameter ...")``.

optkit is stricter than the original in two places (both listed in ``docs/compatibility.md``): a ``bool`` is
rejected where ``int`` or ``float`` is declared (``bool`` is an ``int`` subclass in Python), and ``None`` is
only accepted where the declaration allows it (``type(None)`` in a tuple, or ``None`` in a list). A
declaration of ``None`` accepts any value.

Errors name the offending key and the place (``where``) so that a user can find the config entry. A type
mismatch raises :class:`ParameterTypeError`, which is both a ``TypeError`` and a ``ValueError``: the original
raised ``ValueError``, while Python convention calls for ``TypeError``; catching either works.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["ParameterTypeError", "check_params", "check_real", "check_int", "check_number", "is_number"]


class ParameterTypeError(TypeError, ValueError):
    """A parameter has the wrong type. Subclasses both ``TypeError`` and ``ValueError`` (see module doc)."""


def _type_names(declared: type | tuple[type, ...]) -> str:
    if isinstance(declared, tuple):
        return " or ".join(t.__name__ for t in declared)
    return declared.__name__


def _matches_type(value: Any, declared: type | tuple[type, ...]) -> bool:
    types = declared if isinstance(declared, tuple) else (declared,)
    if isinstance(value, bool) and bool not in types:
        return False  # bool is an int subclass; never let True pass as an int or float
    return isinstance(value, types)


def _check_one(key: str, value: Any, declared: Any, where: str) -> None:
    if declared is None:
        return  # any value accepted
    if isinstance(declared, list):
        if not any(type(value) is type(opt) and value == opt for opt in declared):
            raise ValueError(f"{where}: parameter '{key}' has to be one of {declared!r}, got {value!r}")
        return
    if not (isinstance(declared, type) or isinstance(declared, tuple)):
        raise TypeError(f"{where}: the declaration of parameter '{key}' must be a type, a tuple of types, "
                        f"a list of allowed values or None, got {declared!r}")
    if _matches_type(value, declared):
        return
    names = _type_names(declared)
    hint = ""
    types = declared if isinstance(declared, tuple) else (declared,)
    if float in types and int not in types and isinstance(value, int) and not isinstance(value, bool):
        hint = (f"; write {float(value)!r}: an int is not accepted where float is declared "
                "(strict, as in OpenSeq2Seq)")
    raise ParameterTypeError(
        f"{where}: parameter '{key}' has to be of type {names}, got {type(value).__name__} ({value!r}){hint}"
    )


def check_params(
    params: Mapping[str, Any] | None,
    required: Mapping[str, Any] | None,
    optional: Mapping[str, Any] | None,
    where: str = "parameters",
) -> None:
    """Validate the dict ``params`` against ``required`` and ``optional`` declarations; return nothing.

    Each declaration maps a key to a type (or tuple of types), a list of allowed values, or ``None`` (any
    value). ``params=None`` is the empty dict. Raises ``ValueError`` for a missing required key, a value
    outside its list or an unknown key; :class:`ParameterTypeError` (a ``TypeError`` and a ``ValueError``) for
    a wrong type; ``TypeError`` when ``params`` is not a mapping. ``params`` is never modified.
    """
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise TypeError(f"{where}: parameters must be a dict, got {type(params).__name__}")
    required = {} if required is None else required
    optional = {} if optional is None else optional
    for key in params:
        if key not in required and key not in optional:
            allowed = sorted([*required, *optional])
            raise ValueError(f"Unknown parameter {key!r} in {where}; allowed parameters: {allowed}")
    for key, declared in required.items():
        if key not in params:
            raise ValueError(f"{where}: required parameter '{key}' has to be specified")
        _check_one(key, params[key], declared, where)
    for key, declared in optional.items():
        if key in params:
            _check_one(key, params[key], declared, where)


def check_real(
    name: str,
    value: Any,
    *,
    where: str,
    minimum: float | None = None,
    min_inclusive: bool = True,
    maximum: float | None = None,
    max_inclusive: bool = True,
    finite: bool = True,
) -> float:
    """Check that ``value`` is a Python real number (not a bool) within the given bounds; return it as float.

    Raises ``TypeError`` for a non-number and ``ValueError`` for a value out of range or non-finite.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        got = f"{type(value).__name__} ({value!r})"
        raise TypeError(f"{where}: {name} must be a Python int or float, got {got}")
    v = float(value)
    if math.isnan(v) or (finite and math.isinf(v)):
        raise ValueError(f"{where}: {name} must be finite, got {value!r}")
    if minimum is not None and (v < minimum or (not min_inclusive and v == minimum)):
        op = ">=" if min_inclusive else ">"
        raise ValueError(f"{where}: {name} must be {op} {minimum}, got {value!r}")
    if maximum is not None and (v > maximum or (not max_inclusive and v == maximum)):
        op = "<=" if max_inclusive else "<"
        raise ValueError(f"{where}: {name} must be {op} {maximum}, got {value!r}")
    return v


def check_int(name: str, value: Any, *, where: str, minimum: int | None = None) -> int:
    """Check that ``value`` is a Python int (not a bool) and ``>= minimum``; return it.

    Raises ``TypeError`` for a non-int and ``ValueError`` for a value below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: {name} must be a Python int, got {type(value).__name__} ({value!r})")
    v = int(value)
    if minimum is not None and v < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}, got {value!r}")
    return v


def is_number(x: object) -> bool:
    """A real Python/NumPy number that is not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_number(
    name: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    allow_none: bool = False,
    integer: bool = False,
    allow_inf: bool = False,
) -> None:
    """Raise ``TypeError``/``ValueError`` naming ``name`` unless ``value`` is a number in ``[low, high]``
    (``(low, high]`` with ``low_open``); the optimizers' hyperparameter check (nothing is created before
    it)."""
    if value is None and allow_none:
        return
    if integer:
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise TypeError(f"`{name}` must be an int, got {value!r} ({type(value).__name__})")
    elif not is_number(value):
        raise TypeError(f"`{name}` must be a number, got {value!r} ({type(value).__name__})")
    try:
        v = float(value)  # type: ignore[arg-type]
    except OverflowError:
        v = math.inf
    if math.isnan(v):
        raise ValueError(f"`{name}` must not be NaN")
    if math.isinf(v) and not allow_inf:
        raise ValueError(f"`{name}` must be finite, got {value!r}")
    if low is not None and (v < low or (low_open and v == low)):
        op = ">" if low_open else ">="
        raise ValueError(f"`{name}` must be {op} {low}, got {value!r}")
    if high is not None and v > high:
        raise ValueError(f"`{name}` must be <= {high}, got {value!r}")


def check_lr_value(who: str, lr: Any, step: Any) -> Any:
    """``lr`` (what a schedule ``who`` returned for ``step``) as it is, refused with a ``TypeError`` when it
    is not a real number or a tensor and a ``ValueError`` when it is a Python number that is NaN, infinite
    or negative (the weights would turn NaN). Tensor values are not read (no host sync)."""
    if isinstance(lr, bool) or not isinstance(lr, (numbers.Real, torch.Tensor)):
        raise TypeError(f"{who} returned {type(lr).__name__} ({lr!r}); it must return a number or a 0-d "
                        "tensor")
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or lr.is_complex() or lr.dtype == torch.bool:
            raise TypeError(f"{who} returned a tensor of shape {tuple(lr.shape)} and dtype {lr.dtype}; it "
                            "must return a one-element real tensor")
        return lr
    try:
        finite = math.isfinite(lr)
    except OverflowError:  # an int too large for a float
        finite = False
    if not (finite and lr >= 0):
        at = f" at step {step}" if not isinstance(step, torch.Tensor) else ""
        raise ValueError(f"{who} returned {lr!r}{at}; a learning rate must be a finite number >= 0")
    return lr


#: the largest count (steps, iterations, counters) a loaded state may hold: beyond it int64 arithmetic and
#: float32 step counts lose meaning
COUNT_LIMIT = 2**62


def check_count(name: str, value: Any, *, where: str, minimum: int = 0, tensors: bool = True,
                whole_floats: bool = False) -> int:
    """A loaded count as a Python int in ``[minimum, 2**62)``: a Python int, a one-element real tensor holding
    data (``tensors``), or a float with a whole value (``whole_floats``: older checkpoints). Without a float
    conversion of huge ints, so 10**400 and inf are a ``ValueError`` too. Wrong types raise
    :class:`ParameterTypeError` (a ``TypeError`` and a ``ValueError``), bad values ``ValueError``, naming
    ``name``."""
    if isinstance(value, Tensor) and tensors:
        if value.dtype == torch.bool or value.is_complex():
            raise ParameterTypeError(f"{where}: {name} must be a whole number, got a {value.dtype} tensor")
        if value.is_meta or value.layout != torch.strided or value.numel() != 1:
            raise ValueError(f"{where}: {name} must be a single number in a dense tensor holding data, got "
                             f"shape {tuple(value.shape)}, layout {value.layout}, device {value.device}")
        v: Any = value.detach().reshape(()).cpu().item()
    elif isinstance(value, bool) or not (isinstance(value, numbers.Integral)
                                         or (whole_floats and isinstance(value, numbers.Real))):
        raise ParameterTypeError(f"{where}: {name} must be a Python int{' or a tensor' if tensors else ''}, "
                                 f"got {type(value).__name__} ({str(value)[:40]})")
    else:
        v = value
    if not isinstance(v, numbers.Integral):
        f = float(v)
        if not (math.isfinite(f) and f == math.floor(f)):
            raise ValueError(f"{where}: {name} must be a whole number in [{minimum}, 2**62), got {v!r}")
        v = int(f)
    v = int(v)
    if not minimum <= v < COUNT_LIMIT:
        raise ValueError(f"{where}: {name} must be a whole number in [{minimum}, 2**62), got {str(v)[:40]}")
    return v
