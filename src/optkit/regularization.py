"""Regularization losses registered on parameters or modules, and their sum (OpenSeq2Seq
``get_regularization_loss``, ``open_seq2seq/optimizers/optimizers.py``).

TensorFlow collects regularization losses in a graph collection when a layer is built with a regularizer. The
PyTorch-native equivalent here is a registry keyed by the parameter itself (weakly, so a dropped model frees
its entries):

* :func:`add_regularizer(target, fn, name=None)` attaches ``fn`` (``fn(param) -> scalar tensor``) to one
  parameter, or to every parameter of a module (optionally filtered by a regex on the parameter's name inside
  the module). Each entry has a name (``name`` or the module-relative parameter name, TF-scope style);
* :func:`get_regularization_loss(scope=None, name=...)` evaluates every registered regularizer whose name
  matches ``scope`` (``re.match``, a prefix match, as TF filters collections), casts each loss to float32 and
  sums them. With nothing registered (or nothing matching) it returns the constant fp32 scalar 0.0;
* :func:`l2_regularizer(scale)` / :func:`l1_regularizer(scale)`: ``tf.contrib.layers`` forms,
  ``scale·Σw²/2`` (gradient ``scale·w``) and ``scale·Σ|w|``.

Mixed precision (OpenSeq2Seq ``mp_regularizer_wrapper``): in ``dtype="mixed"`` training,
:func:`optkit.optimize_loss` *diverts* the regularizers of half-precision parameters (those registered when
it is built, while they stay registered): the train op adds their gradient computed on the fp32 master copy,
where small weights do not underflow, and while it runs its loss function :func:`get_regularization_loss`
skips them (so the loss it reports excludes them, as in the original). Everywhere else they count, so call
:func:`get_regularization_loss` inside the loss function given to ``optimize_loss``: a loss computed outside
it would count them twice.

Why the sum is taken in fp32: TF's own version failed to add fp16 and fp32 losses; this one supports pure
half-precision models.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "add_regularizer",
    "clear_regularizers",
    "get_regularization_loss",
    "l1_regularizer",
    "l2_regularizer",
    "regularized_parameters",
]

Regularizer = Callable[[Tensor], Tensor]


@dataclass(eq=False)
class _Entry:
    fn: Regularizer
    name: str


#: per thread: the entries (ids) that the ``optimize_loss(dtype="mixed")`` train ops now running their loss
#: functions add on fp32 masters themselves (a stack: train ops may nest)
_LOCAL = threading.local()


def _active() -> list[frozenset[int]]:
    stack = getattr(_LOCAL, "diverting", None)
    if stack is None:
        stack = _LOCAL.diverting = []
    return stack


@contextmanager
def _diverting(ids: frozenset[int]) -> Iterator[None]:
    """While a train op runs its loss function (this thread): the entries ``ids`` (``id`` of each), the
    regularizers whose gradient it adds on fp32 masters itself (none unless it is a mixed one), are left out
    of :func:`get_regularization_loss`; a train op called inside that loss function sees only its own."""
    stack = _active()
    stack.append(ids)
    try:
        yield
    finally:
        stack.pop()  # (``with`` blocks nest: this call's own set is on top)


def _is_diverted(e: _Entry) -> bool:
    """Whether the train op running its loss function now (the innermost one, this thread) adds ``e`` on a
    master itself."""
    stack = getattr(_LOCAL, "diverting", None)
    return bool(stack) and id(e) in stack[-1]


def _entries(params: Iterable[Tensor]) -> list[tuple[Tensor, _Entry]]:
    """``(param, entry)`` for every regularizer registered on ``params`` now."""
    return [(p, e) for p in params for e in _REGISTRY.get(p, ())]


def _registered(p: Tensor, e: _Entry) -> bool:
    """Whether entry ``e`` is still registered on ``p`` (not removed by :func:`clear_regularizers`)."""
    return any(x is e for x in _REGISTRY.get(p, ()))


# parameter -> its regularizer entries (weak: entries die with the parameter)
_REGISTRY: WeakIdKeyDictionary = WeakIdKeyDictionary()
_counter = [0]


def l2_regularizer(scale: float) -> Regularizer:
    """``tf.contrib.layers.l2_regularizer(scale)``: ``w ↦ scale·Σw²/2`` (gradient ``scale·w``).

    ``scale`` must be a real number ``>= 0``; 0 gives a regularizer that contributes nothing.
    """
    s = _check_scale(scale, "l2_regularizer")

    def l2(w: Tensor) -> Tensor:
        return s * 0.5 * torch.sum(w * w)

    return l2


def l1_regularizer(scale: float) -> Regularizer:
    """``tf.contrib.layers.l1_regularizer(scale)``: ``w ↦ scale·Σ|w|``."""
    s = _check_scale(scale, "l1_regularizer")

    def l1(w: Tensor) -> Tensor:
        return s * torch.sum(torch.abs(w))

    return l1


def _check_scale(scale: object, where: str) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{where}: scale must be a real number, got {scale!r}")
    if not scale >= 0:
        raise ValueError(f"{where}: scale must be >= 0, got {scale!r}")
    return float(scale)


def add_regularizer(
    target: Tensor | nn.Module,
    fn: Regularizer,
    name: str | None = None,
    *,
    param_regex: str | None = None,
) -> list[str]:
    """Register the regularizer ``fn`` on a parameter or on the parameters of a module; returns the names.

    Args:
        target: a leaf tensor (parameter) or an ``nn.Module`` (every parameter of it, recursively).
        fn: ``fn(param) -> scalar tensor`` (any dtype; it is summed in fp32).
        name: the entry name for a parameter (default ``"regularizer_<n>"``), or the scope prefix for a module
            (default: none); module entries are named ``"<name>.<param name>"``, like ``named_parameters``.
        param_regex: for a module, register only parameters whose module-relative name matches this regex
            (``re.search``), e.g. ``"weight$"`` to leave biases alone.

    Raises ``TypeError`` for a bad ``target``/``fn``/``name`` and ``ValueError`` when a module selection is
    empty. Nothing is registered when an argument is bad.
    """
    if not callable(fn):
        raise TypeError(f"add_regularizer: fn must be callable, got {fn!r}")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"add_regularizer: name must be a str, got {name!r}")
    if isinstance(target, nn.Module):
        if param_regex is not None and not isinstance(param_regex, str):
            raise TypeError(f"add_regularizer: param_regex must be a str, got {param_regex!r}")
        pattern = None if param_regex is None else re.compile(param_regex)
        pairs = [(n, p) for n, p in target.named_parameters() if pattern is None or pattern.search(n)]
        if not pairs:
            raise ValueError(f"add_regularizer: no module parameter matches param_regex={param_regex!r}")
        prefix = f"{name}." if name else ""
        items = [(p, prefix + n) for n, p in pairs]
    elif isinstance(target, Tensor):
        if param_regex is not None:
            raise ValueError("add_regularizer: param_regex applies to modules only")
        if not target.is_leaf:
            raise ValueError("add_regularizer: target must be a leaf tensor (a parameter)")
        if name is None:
            name = f"regularizer_{_counter[0]}"
            _counter[0] += 1
        items = [(target, name)]
    else:
        raise TypeError(f"add_regularizer: target must be a Tensor or nn.Module, got {type(target).__name__}")
    for p, n in items:
        _REGISTRY.setdefault(p, []).append(_Entry(fn, n))
    return [n for _, n in items]


def clear_regularizers(target: Tensor | nn.Module | None = None) -> None:
    """Remove the regularizers of ``target`` (a parameter or every parameter of a module), or all of them."""
    if target is None:
        _REGISTRY.clear()
        return
    if isinstance(target, nn.Module):
        for p in target.parameters():
            _REGISTRY.pop(p, None)
    elif isinstance(target, Tensor):
        _REGISTRY.pop(target, None)
    else:
        raise TypeError(f"clear_regularizers: target must be a Tensor, nn.Module or None, got {target!r}")


def _scope_filter(scope: str | None) -> Callable[[str], bool]:
    if scope is None:
        return lambda _n: True
    if not isinstance(scope, str):
        raise TypeError(f"get_regularization_loss: scope must be a str or None, got {scope!r}")
    pattern = re.compile(scope)
    return lambda n: pattern.match(n) is not None


def regularized_parameters(
    params: Iterable[Tensor] | None = None, scope: str | None = None, *, include_diverted: bool = True
) -> list[tuple[Tensor, Regularizer, str]]:
    """``(param, fn, name)`` for every registered regularizer (restricted to ``params`` when given) whose name
    matches ``scope``; in registration order per parameter."""
    keep = _scope_filter(scope)
    if params is None:
        items = list(_REGISTRY.items())
    else:
        items = [(p, _REGISTRY[p]) for p in params if p in _REGISTRY]
    return [
        (p, e.fn, e.name)
        for p, entries in items
        for e in entries
        if keep(e.name) and (include_diverted or not _is_diverted(e))
    ]


def get_regularization_loss(scope: str | None = None, name: str = "total_regularization_loss") -> Tensor:
    """Σ fp32(R(w)) over the registered regularizers whose name matches ``scope`` (``re.match``).

    Diverted entries (module doc: the half-precision parameters' regularizers, while an
    ``optimize_loss(dtype="mixed")`` train op that adds them on fp32 masters runs its loss function) are
    left out. With no matching entry the result is the constant 0.0 (fp32, CPU), as in the original's
    empty-collection branch. ``name`` is kept for the original's signature (TF names the tensor; a PyTorch
    tensor has no name) and must be a str.
    """
    if not isinstance(name, str):
        raise TypeError(f"get_regularization_loss: name must be a str, got {name!r}")
    terms = [fn(p) for p, fn, _ in regularized_parameters(scope=scope, include_diverted=False)]
    if not terms:
        return torch.zeros((), dtype=torch.float32)
    total = terms[0].to(torch.float32)
    for t in terms[1:]:
        total = total + t.to(device=total.device, dtype=torch.float32)
    return total
