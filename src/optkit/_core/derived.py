"""The multi-tensor form of an update rule, derived from the rule itself.

Every optkit optimizer states its math once as a pointwise rule, ``rule(hyper, w, g, slots, lr, k, aux) ->
(new_w, new_slots)`` written with ordinary tensor arithmetic (``+ - * /``, ``sqrt``, ``torch.where``, ...;
the true gradient is ``k·g``). :func:`optkit._core.chain.chain` runs it tensor by tensor; :func:`run_rule`
runs the same function once per (device, dtype) group with every argument a :class:`TensorList` instead of a
tensor, so each operation of the rule becomes one ``torch._foreach_*`` call over the whole group.

Why: a per-tensor chain costs one Python dispatch per operation per tensor (microseconds each: hundreds of
tensors make the host the bottleneck), and on a GPU one kernel launch per operation per tensor; a foreach op
dispatches once per operation per group and launches a few kernels (torch packs many tensors into one
launch). The results are bitwise those of the per-tensor chain: a foreach op computes each tensor as the
per-tensor op does (same operation order, same type promotion: a float32 list times a float64 0-d tensor
stays float32, as a float32 tensor times it does).

Fewer passes over memory than the rule's text suggests, with the same numbers:

* **temporaries are updated in place**: the rule is written out of place (as ``torch.compile`` and the skip
  need), so each operation would allocate a new list. A list made by an operation here that nothing else
  refers to (an intermediate of an expression: ``(g * g - ms) * c`` makes ``g * g``, then subtracts and
  scales in it) takes the ``_foreach_*_`` form instead. "Nothing else refers to it" is CPython's reference
  count, compared with the count a temporary has on this interpreter, measured once at import by the same
  calls; where a named value and a temporary cannot be told apart (interpreters that borrow references on
  the stack) nothing is updated in place. float16/bfloat16 lists never are (torch's in-place foreach ops may
  round a Python scalar to the list's dtype first; the rules compute half precision in float32 anyway).
* **the true gradient goes into the gradients**: ``g * k`` on the gradients with the step's ``k``, once the
  rule has dropped every reference to the raw ``g`` (``g = g * k``), is computed in place in them, which is
  where the step leaves ``k·g`` anyway (as the fused kernels' ``grad_scale`` write-back).
* **a select against the old value is a masked write**: a new weight or slot ``torch.where(c, old, new)``
  (``c`` a 0-d flag, e.g. FTRL's "learning rate is 0") that is only written back becomes one masked
  write of ``new`` under ``c`` (or the step's skip flag), as a skipped step's is.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from .. import _multi_tensor as mt
from .chain import chain

__all__ = ["TensorList", "run_rule"]

_aten = torch.ops.aten
_NUMBER = (int, float, bool)
_HALF = (torch.float16, torch.bfloat16)
#: dtypes whose temporaries are updated in place (module doc): torch 2.13's ``_foreach_mul_(bf16, 0.7)``
#: differs from ``bf16 * 0.7``
_IN_PLACE_DTYPES = (torch.float32, torch.float64)


# ------------------------------------------------------------------------------------------------------------
# which lists are temporaries (module doc)

_refs = sys.getrefcount


class _Probe:
    """Measures (once, at import) the reference count a temporary has inside the calls :class:`TensorList`
    makes its decision in, against a named value's."""

    __slots__ = ("held",)

    def __init__(self, held: object = None) -> None:
        self.held = held

    def __add__(self, other):
        return _refs(self), _refs(other)

    def __radd__(self, other):
        return _refs(self), 0

    def __neg__(self):
        return _refs(self)

    def method(self, other=None):
        return _refs(self)

    def held_refs(self):
        return _refs(self.held)


def _temporary_counts() -> tuple[int, ...] | None:
    """The largest reference count that still means "a temporary" for: self in a binary dunder, the other
    operand in it, self in a reflected dunder, self in a method, self in a unary dunder, an object only held
    in a slot of another; or None where a named value has the same count (then nothing is updated in
    place)."""
    named, other = _Probe(), _Probe()
    tmp_self, _ = _Probe() + other
    named_self, _ = named + other
    _, tmp_other = named + _Probe()
    _, named_other = named + other
    tmp_r, _ = 1.0 + _Probe()
    named_r, _ = 1.0 + named
    tmp_m, named_m = _Probe().method(), named.method()
    tmp_u, named_u = -_Probe(), -named
    tmp_h, named_h = _Probe(_Probe()).held_refs(), _Probe(named).held_refs()
    pairs = ((tmp_self, named_self), (tmp_other, named_other), (tmp_r, named_r), (tmp_m, named_m),
             (tmp_u, named_u), (tmp_h, named_h))
    if any(t >= n for t, n in pairs):
        return None
    return tuple(t for t, _ in pairs)


_TEMP = _temporary_counts()
#: whether temporaries are updated in place (module doc)
ELIDE = _TEMP is not None
_T_SELF, _T_OTHER, _T_RSELF, _T_METHOD, _T_UNARY, _T_HELD = _TEMP if _TEMP is not None else (-1,) * 6


def _is_scalar_tensor(x: object) -> bool:
    return isinstance(x, Tensor) and x.dim() == 0


# ------------------------------------------------------------------------------------------------------------
# one foreach op


class _Binary:
    """A binary foreach op: its out-of-place and in-place forms with a list, a number and a 0-d tensor (read
    on the device: the Tensor overloads are called by name where Python's overload resolution would read a
    0-d tensor on the host; ops without one take a list of the 0-d tensor, which torch broadcasts per
    tensor), and the per-tensor function for other operands."""

    __slots__ = ("fn", "fn_", "fn_t", "fn_t_", "per_tensor")

    def __init__(self, name: str, per_tensor: Callable, tensor: str = "list") -> None:
        self.fn = getattr(torch, f"_foreach_{name}")
        self.fn_ = getattr(torch, f"_foreach_{name}_")
        if tensor == "overload":  # (mul, div: Python's resolution already picks the Tensor overload)
            self.fn_t, self.fn_t_ = self.fn, self.fn_
        elif tensor == "by_name":
            self.fn_t = getattr(_aten, f"_foreach_{name}").Tensor
            self.fn_t_ = getattr(_aten, f"_foreach_{name}_").Tensor
        else:
            fn, fn_ = self.fn, self.fn_
            self.fn_t = lambda xs, t: fn(xs, [t] * len(xs))
            self.fn_t_ = lambda xs, t: fn_(xs, [t] * len(xs))
        self.per_tensor = per_tensor

    def __call__(self, x: TensorList, other: Any) -> Any:
        if isinstance(other, TensorList):
            _check(x, other)
            return _new(self.fn(x.tensors, other.tensors), x, other)
        if isinstance(other, _NUMBER):
            return _new(self.fn(x.tensors, other), x)
        if isinstance(other, Tensor):
            if other.dim() == 0:
                return _new(self.fn_t(x.tensors, other), x, other)
            return _map(self.per_tensor, (x, other))
        return NotImplemented

    def in_place(self, x: TensorList, other: Any) -> TensorList:
        """``x op other`` into ``x`` (``other`` passed :func:`_keeps`)."""
        if isinstance(other, TensorList):
            self.fn_(x.tensors, other.tensors)
        elif isinstance(other, Tensor):
            self.fn_t_(x.tensors, other)
        else:
            self.fn_(x.tensors, other)
        return x


_ADD = _Binary("add", torch.add, "by_name")
_MUL = _Binary("mul", torch.mul, "overload")
_DIV = _Binary("div", torch.div, "overload")
_SUB = _Binary("sub", torch.sub)
# x − t for a 0-d t: x + (−1)·t, the same number, through the device-read overload
_SUB.fn_t = lambda xs, t: _aten._foreach_add.Tensor(xs, t, alpha=-1)
_SUB.fn_t_ = lambda xs, t: _aten._foreach_add_.Tensor(xs, t, alpha=-1)
_POW = _Binary("pow", torch.pow)
_MAXIMUM = _Binary("maximum", torch.maximum)
_MINIMUM = _Binary("minimum", torch.minimum)
_CLAMP_MIN = _Binary("clamp_min", torch.clamp_min)
_CLAMP_MAX = _Binary("clamp_max", torch.clamp_max)

_UNARY = {name: (getattr(torch, f"_foreach_{name}"), getattr(torch, f"_foreach_{name}_"))
          for name in ("abs", "neg", "sign", "sqrt", "rsqrt", "exp", "log", "reciprocal")}


# ------------------------------------------------------------------------------------------------------------
# the list type


class TensorList:
    """One (device, dtype) group's tensors, standing where a rule expects one tensor.

    Arithmetic (``+ - * / **``, unary ``-``, ``abs()``), the methods below and torch functions (through the
    ``__torch_function__`` protocol: ``torch.where``, ``torch.maximum``, ``torch.sqrt``, ``torch.pow``, ...)
    run as one ``torch._foreach_*`` op over the whole list where torch has one, and as a loop of the
    per-tensor op otherwise (comparisons, ``torch.where``, any other torch function or tensor method). The
    other operand may be a list of the same length (element by element), a 0-d tensor or a Python number
    (the same for every tensor; a tensor of more dimensions goes to the per-tensor op, which broadcasts it).
    Each result is bitwise the per-tensor op's (module doc): one dispatch per op per group instead of one
    per tensor, and on a GPU a few kernel launches per op instead of one per tensor.

    ``dtype`` and ``device`` are the group's; a list has no truth value (a rule must not branch on data).
    """

    __slots__ = ("_tensors", "_uniform", "_fresh", "_aliased", "_ctx")

    def __init__(self, tensors: Sequence[Tensor], _uniform: bool | None = None) -> None:
        self._tensors = tensors if type(tensors) is list else list(tensors)
        # every tensor of one dtype (a 0-d tensor of another dtype can make a list mixed: 0-d float32 times
        # 0-d float64 is float64, a float32 vector times it stays float32)
        if _uniform is None:
            dtype = self._tensors[0].dtype if self._tensors else None
            _uniform = all(t.dtype == dtype for t in self._tensors)
        self._uniform = _uniform
        # new tensors made by an op here, of one in-place dtype: may be updated in place while a temporary
        self._fresh = False
        # its tensors were handed out (iteration, a per-tensor op): something may hold views of them
        self._aliased = False
        # the raw gradients of a run (_Run), whose g·k may go into them
        self._ctx = None

    @property
    def tensors(self) -> list[Tensor]:
        """The tensors (a list of them, not to be changed)."""
        return self._tensors

    # -------------------------------------------------------------------------------------------- container

    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self) -> Iterator[Tensor]:
        self._hand_out()
        return iter(self.tensors)

    def __getitem__(self, i: int) -> Tensor:
        self._hand_out()
        return self.tensors[i]

    def _hand_out(self) -> None:
        """Its tensors leave the list (something may keep them, or views of them): never updated in place
        from now on."""
        self._aliased = True
        self._fresh = False

    def __repr__(self) -> str:
        return f"TensorList({len(self)} tensors, {self.dtype}, {self.device})"

    def __bool__(self) -> bool:
        raise TypeError("a TensorList has no truth value: an update rule must not branch on tensor data "
                        "(use torch.where)")

    __hash__ = None  # type: ignore[assignment]  (== is elementwise)

    @property
    def dtype(self) -> torch.dtype:
        return self.tensors[0].dtype

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    def __getattr__(self, name: str) -> Any:
        # any other tensor method: the per-tensor loop (``.float()``, ``.to(...)``, ``.square()``, ...)
        attr = getattr(Tensor, name, None)
        if name.startswith("_") or not callable(attr):
            raise AttributeError(f"TensorList has no attribute {name!r} (a per-tensor value that may differ "
                                 "from tensor to tensor)")
        return lambda *args, **kwargs: _map(attr, (self, *args), kwargs)

    # ----------------------------------------------------------------------------------- binary arithmetic

    def __add__(self, other: Any) -> Any:
        if ELIDE:
            if self._fresh and _refs(self) <= _T_SELF and _keeps(self, other):
                return _ADD.in_place(self, other)
            if isinstance(other, TensorList) and other._fresh and _refs(other) <= _T_OTHER \
                    and _keeps(other, self):
                return _ADD.in_place(other, self)  # (a + b and b + a are the same number)
        return _ADD(self, other)

    def __radd__(self, other: Any) -> Any:
        if ELIDE and self._fresh and _refs(self) <= _T_RSELF and _keeps(self, other):
            return _ADD.in_place(self, other)
        return _ADD(self, other)

    def __sub__(self, other: Any) -> Any:
        if ELIDE and self._fresh and _refs(self) <= _T_SELF and _keeps(self, other):
            return _SUB.in_place(self, other)
        return _SUB(self, other)

    def __rsub__(self, other: Any) -> Any:
        if ELIDE and self._fresh and _refs(self) <= _T_RSELF and _keeps(self, other):
            _UNARY["neg"][1](self.tensors)
            return _ADD.in_place(self, other)
        return _rsub(self, other)

    def __mul__(self, other: Any) -> Any:
        if self._ctx is not None and other is self._ctx.k:
            return _Scaled(self)  # the raw gradients times the step's k (module doc)
        if ELIDE:
            if self._fresh and _refs(self) <= _T_SELF and _keeps(self, other):
                return _MUL.in_place(self, other)
            if isinstance(other, TensorList) and other._fresh and _refs(other) <= _T_OTHER \
                    and _keeps(other, self):
                return _MUL.in_place(other, self)
        return _MUL(self, other)

    def __rmul__(self, other: Any) -> Any:
        if ELIDE and self._fresh and _refs(self) <= _T_RSELF and _keeps(self, other):
            return _MUL.in_place(self, other)
        return _MUL(self, other)

    def __truediv__(self, other: Any) -> Any:
        if ELIDE and self._fresh and _refs(self) <= _T_SELF and _keeps(self, other):
            return _DIV.in_place(self, other)
        return _DIV(self, other)

    def __rtruediv__(self, other: Any) -> Any:
        return _rdiv(self, other)

    def __pow__(self, other: Any) -> Any:
        if ELIDE and self._fresh and _refs(self) <= _T_SELF and _keeps(self, other):
            return _POW.in_place(self, other)
        return _POW(self, other)

    def __rpow__(self, other: Any) -> Any:
        return _rpow(self, other)

    # comparisons: the per-tensor loop (bool lists, for torch.where)
    def __lt__(self, other: Any) -> Any:
        return _map(Tensor.__lt__, (self, other))

    def __le__(self, other: Any) -> Any:
        return _map(Tensor.__le__, (self, other))

    def __gt__(self, other: Any) -> Any:
        return _map(Tensor.__gt__, (self, other))

    def __ge__(self, other: Any) -> Any:
        return _map(Tensor.__ge__, (self, other))

    def __eq__(self, other: Any) -> Any:  # type: ignore[override]
        return _map(Tensor.__eq__, (self, other))

    def __ne__(self, other: Any) -> Any:  # type: ignore[override]
        return _map(Tensor.__ne__, (self, other))

    # --------------------------------------------------------------------------------------------- unary

    def __neg__(self) -> TensorList:
        if ELIDE and self._fresh and _refs(self) <= _T_UNARY:
            _UNARY["neg"][1](self.tensors)
            return self
        return _new(_UNARY["neg"][0](self.tensors), self)

    def __abs__(self) -> TensorList:
        return _new(_UNARY["abs"][0](self.tensors), self)

    def _unary_method(name: str):  # noqa: N805  (builds the methods below)
        out_of_place, in_place = _UNARY[name]

        def method(self: TensorList) -> TensorList:
            if ELIDE and self._fresh and _refs(self) <= _T_METHOD:
                in_place(self.tensors)
                return self
            return _new(out_of_place(self.tensors), self)

        method.__name__ = name
        method.__doc__ = f"``{name}`` of every tensor (``torch._foreach_{name}``)."
        return method

    abs = _unary_method("abs")
    neg = _unary_method("neg")
    sign = _unary_method("sign")
    sqrt = _unary_method("sqrt")
    rsqrt = _unary_method("rsqrt")
    exp = _unary_method("exp")
    log = _unary_method("log")
    reciprocal = _unary_method("reciprocal")
    del _unary_method

    # ------------------------------------------------------------------------------------ other methods

    def add(self, other: Any, *, alpha: float = 1) -> Any:
        """``torch.add``: ``x + alpha·other``."""
        return _with_alpha(_ADD, Tensor.add, self, other, alpha)

    def sub(self, other: Any, *, alpha: float = 1) -> Any:
        """``torch.sub``: ``x − alpha·other``."""
        return _with_alpha(_SUB, Tensor.sub, self, other, alpha)

    def mul(self, other: Any) -> Any:
        """``torch.mul``."""
        return _or_map(_MUL(self, other), Tensor.mul, (self, other))

    def div(self, other: Any) -> Any:
        """``torch.div`` (true division)."""
        return _or_map(_DIV(self, other), Tensor.div, (self, other))

    def clamp_min(self, min: Any) -> TensorList:  # noqa: A002  (torch's name)
        """``max(x, min)`` with NaN kept (``torch.clamp_min``)."""
        if ELIDE and self._fresh and _refs(self) <= _T_METHOD and _keeps(self, min):
            return _CLAMP_MIN.in_place(self, min)
        return _or_map(_CLAMP_MIN(self, min), Tensor.clamp_min, (self, min))

    def clamp_max(self, max: Any) -> TensorList:  # noqa: A002
        """``min(x, max)`` with NaN kept (``torch.clamp_max``)."""
        if ELIDE and self._fresh and _refs(self) <= _T_METHOD and _keeps(self, max):
            return _CLAMP_MAX.in_place(self, max)
        return _or_map(_CLAMP_MAX(self, max), Tensor.clamp_max, (self, max))

    def clamp(self, min: Any = None, max: Any = None) -> TensorList:  # noqa: A002
        """``torch.clamp``: ``min(max(x, min), max)`` (either bound may be None)."""
        return _clamp(self, min, max)

    def maximum(self, other: Any) -> TensorList:
        """``torch.maximum`` (NaN propagates)."""
        return _or_map(_MAXIMUM(self, other), Tensor.maximum, (self, other))

    def minimum(self, other: Any) -> TensorList:
        """``torch.minimum`` (NaN propagates)."""
        return _or_map(_MINIMUM(self, other), Tensor.minimum, (self, other))

    def lerp(self, end: Any, weight: Any) -> TensorList:
        """``torch.lerp``: ``x + weight·(end − x)`` in torch's formulation."""
        return _lerp(self, end, weight)

    def addcmul(self, tensor1: Any, tensor2: Any, *, value: float = 1) -> TensorList:
        """``torch.addcmul``: ``x + value·t1·t2`` (one fused multiply-add on CPUs that have one)."""
        if ELIDE and self._fresh and _refs(self) <= _T_METHOD and _keeps(self, tensor1) \
                and _keeps(self, tensor2) and isinstance(value, _NUMBER):
            return _addc_(torch._foreach_addcmul_, self, tensor1, tensor2, value)
        return _addc(torch._foreach_addcmul, Tensor.addcmul, self, tensor1, tensor2, value)

    def addcdiv(self, tensor1: Any, tensor2: Any, *, value: float = 1) -> TensorList:
        """``torch.addcdiv``: ``x + value·t1/t2``."""
        if ELIDE and self._fresh and _refs(self) <= _T_METHOD and _keeps(self, tensor1) \
                and _keeps(self, tensor2) and isinstance(value, _NUMBER):
            return _addc_(torch._foreach_addcdiv_, self, tensor1, tensor2, value)
        return _addc(torch._foreach_addcdiv, Tensor.addcdiv, self, tensor1, tensor2, value)

    # --------------------------------------------------------------------------------------- torch funcs

    @classmethod
    def __torch_function__(cls, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None):
        if not kwargs and len(args) == 2 and isinstance(args[1], TensorList) \
                and not isinstance(args[0], TensorList):
            impl = _LIST_RIGHT.get(func)  # a tensor method with the tensor first: ``lr * g``, ``lr - g``, ...
            if impl is not None:
                return impl(args[1], args[0])
        impl = _TORCH.get(func)
        if impl is not None:
            out = impl(*args, **(kwargs or {}))
            if out is not NotImplemented:
                return out
        return _map(func, args, kwargs)


# ------------------------------------------------------------------------------------------------------------
# the operations


def _new(tensors: list[Tensor], *operands: Any) -> TensorList:
    """The list of new tensors a foreach op made from ``operands`` (a temporary candidate, module doc): of
    one dtype when its list and tensor operands were all of one dtype."""
    dtype = None
    uniform = True
    for o in operands:
        if isinstance(o, TensorList):
            if not o._uniform:
                uniform = False
                break
        elif not isinstance(o, Tensor):
            continue
        if dtype is None:
            dtype = o.dtype
        elif o.dtype != dtype:
            uniform = False
            break
    out = TensorList(tensors, uniform)
    out._fresh = uniform and bool(tensors) and tensors[0].dtype in _IN_PLACE_DTYPES
    return out


def _keeps(x: TensorList, other: Any) -> bool:
    """Whether ``x op other`` has ``x``'s dtype and shapes, so that it may be computed in place in ``x`` (a
    temporary: of one dtype)."""
    if isinstance(other, TensorList):
        return other._uniform and other.dtype == x.dtype and len(other) == len(x)
    if isinstance(other, Tensor):
        # (a 0-d tensor of another dtype promotes a 0-d tensor of the list: both 0-d, float32·float64 is
        # float64)
        return other.dim() == 0 and other.dtype == x.dtype
    return isinstance(other, _NUMBER)


def _check(x: TensorList, other: TensorList) -> None:
    if len(x) != len(other):
        raise ValueError(f"TensorList lengths differ: {len(x)} and {len(other)}")


def _map(func: Callable, args: Sequence, kwargs: dict | None = None) -> Any:
    """``func`` per tensor: every list argument (positional or keyword) contributes its i-th tensor, every
    other argument is passed as it is. Tensor results come back as a list (not known to be new tensors: never
    updated in place); other results as a Python list."""
    kwargs = kwargs or {}
    n = None
    for a in (*args, *kwargs.values()):
        if isinstance(a, TensorList):
            if n is not None and len(a) != n:
                raise ValueError(f"TensorList lengths differ: {n} and {len(a)}")
            n = len(a)
            a._hand_out()  # (the results may be views of its tensors)
    if n is None:  # pragma: no cover - torch dispatches here only with a list argument
        return func(*args, **kwargs)
    out = [func(*[a.tensors[i] if isinstance(a, TensorList) else a for a in args],
                **{k: v.tensors[i] if isinstance(v, TensorList) else v for k, v in kwargs.items()})
           for i in range(n)]
    return TensorList(out) if all(isinstance(t, Tensor) for t in out) else out


def _or_map(result: Any, func: Callable, args: tuple) -> Any:
    """A method's foreach ``result``, or the per-tensor loop where the arguments have no foreach form."""
    return _map(func, args) if result is NotImplemented else result


def _with_alpha(op: _Binary, method: Callable, x: TensorList, other: Any, alpha: float) -> Any:
    """``x.add(other, alpha=a)`` / ``x.sub(...)``: foreach for a list or a 0-d tensor ``other``."""
    if alpha == 1:
        return _or_map(op(x, other), method, (x, other))
    if isinstance(other, TensorList) and isinstance(alpha, _NUMBER):
        _check(x, other)
        return _new(op.fn(x.tensors, other.tensors, alpha=alpha), x, other)
    if _is_scalar_tensor(other) and isinstance(alpha, _NUMBER):
        a = alpha if op is _ADD else -alpha  # (x − a·t = x + (−a)·t)
        return _new(_aten._foreach_add.Tensor(x.tensors, other, alpha=a), x, other)
    return _map(method, (x, other), {"alpha": alpha})


def _rsub(x: TensorList, other: Any) -> Any:
    """``other − x`` as ``(−x) + other`` (the same number in IEEE arithmetic; torch's ``Tensor.__rsub__``)."""
    if isinstance(other, Tensor) and other.dim() > 0:
        return _map(torch.sub, (other, x))
    if not isinstance(other, (Tensor, *_NUMBER)):
        return NotImplemented
    neg = _new(_UNARY["neg"][0](x.tensors), x)
    return _ADD.in_place(neg, other) if neg._fresh and _keeps(neg, other) else _ADD(neg, other)


def _rdiv(x: TensorList, other: Any) -> Any:
    """``other / x``: torch's ``Tensor.__rtruediv__`` for a number is ``x.reciprocal() * other``; a tensor
    divided by the list is true division."""
    if isinstance(other, _NUMBER):
        r = _new(_UNARY["reciprocal"][0](x.tensors), x)
        return _MUL.in_place(r, other) if r._fresh else _MUL(r, other)
    if _is_scalar_tensor(other):
        return _new(torch._foreach_div([other] * len(x), x.tensors), other, x)
    if isinstance(other, Tensor):
        return _map(torch.div, (other, x))
    return NotImplemented


def _rpow(x: TensorList, other: Any) -> Any:
    """``other ** x`` (``torch.pow(other, x)``)."""
    if isinstance(other, _NUMBER):
        return _new(torch._foreach_pow(other, x.tensors), x)
    if _is_scalar_tensor(other):
        return _new(torch._foreach_pow([other] * len(x), x.tensors), other, x)
    if isinstance(other, Tensor):
        return _map(torch.pow, (other, x))
    return NotImplemented


def _clamp(x: TensorList, lo: Any = None, hi: Any = None) -> Any:
    """``torch.clamp(x, lo, hi)`` = ``min(max(x, lo), hi)`` elementwise (NaN kept), as two foreach ops."""
    if lo is None and hi is None:
        raise ValueError("clamp: at least one of `min` and `max` must be given")
    if not all(b is None or isinstance(b, (TensorList, *_NUMBER)) or _is_scalar_tensor(b) for b in (lo, hi)):
        return _map(torch.clamp, (x, lo, hi))
    out = x if lo is None else _CLAMP_MIN(x, lo)
    if hi is not None:
        out = _CLAMP_MAX.in_place(out, hi) if out is not x and out._fresh and _keeps(out, hi) \
            else _CLAMP_MAX(out, hi)
    return out


def _lerp(x: TensorList, end: Any, weight: Any) -> Any:
    if isinstance(end, TensorList) and (isinstance(weight, (TensorList, *_NUMBER))
                                        or _is_scalar_tensor(weight)):
        _check(x, end)
        w = weight.tensors if isinstance(weight, TensorList) else (
            [weight] * len(x) if isinstance(weight, Tensor) else weight)
        return _new(torch._foreach_lerp(x.tensors, end.tensors, w), x, end, weight)
    return _map(torch.lerp, (x, end, weight))


def _addc(fn: Callable, method: Callable, x: TensorList, t1: Any, t2: Any, value: Any) -> Any:
    if isinstance(t1, TensorList) and isinstance(t2, TensorList) and isinstance(value, _NUMBER):
        _check(x, t1)
        _check(x, t2)
        return _new(fn(x.tensors, t1.tensors, t2.tensors, value=value), x, t1, t2)
    return _map(method, (x, t1, t2), {"value": value})


def _addc_(fn_: Callable, x: TensorList, t1: Any, t2: Any, value: Any) -> Any:
    """In place in the temporary ``x`` (both factors passed :func:`_keeps`)."""
    if isinstance(t1, TensorList) and isinstance(t2, TensorList):
        _check(x, t1)
        _check(x, t2)
        fn_(x.tensors, t1.tensors, t2.tensors, value=value)
        return x
    return _map(Tensor.addcmul if fn_ is torch._foreach_addcmul_ else Tensor.addcdiv, (x, t1, t2),
                {"value": value})


def _where(cond: Any, a: Any, b: Any) -> Any:
    """``torch.where``: per tensor (torch has no foreach select), new tensors; with a 0-d condition and two
    lists, a :class:`_Select` (computed when first read; written back as a masked write, module doc)."""
    if _is_scalar_tensor(cond) and isinstance(a, TensorList) and isinstance(b, TensorList) \
            and len(a) == len(b):
        return _Select(cond, a, b)
    out = _map(torch.where, (cond, a, b))
    if isinstance(out, TensorList):  # (new tensors: a temporary candidate)
        out._fresh = out._uniform and bool(out.tensors) and out.dtype in _IN_PLACE_DTYPES
    return out


def _first_list(fn: Callable) -> Callable:
    """A torch function whose first argument is the list (``torch.sqrt(x)``, ``torch.clamp_min(x, m)``)."""
    def impl(*args, **kwargs):
        if not args or not isinstance(args[0], TensorList):
            return NotImplemented
        return fn(*args, **kwargs)
    return impl


def _either_side(op: _Binary, reflected: Callable) -> Callable:
    """``torch.add(a, b)`` and its kind with the list on either side."""
    def impl(a, b, **kwargs):
        if kwargs:
            return NotImplemented
        return op(a, b) if isinstance(a, TensorList) else reflected(b, a)
    return impl


def _tensor_left(op: _Binary, commutative: bool = False) -> Callable:
    """``t op x`` for a tensor ``t`` on the left of the list: the foreach op over ``[t, t, ...]`` and the list
    (per tensor ``t op x_i``, operands in order: for float16/bfloat16 ``t * x`` and ``x * t`` differ in
    torch 2.13); for a commutative op on float32/float64 the list's own op with ``t`` (``x · t``, the same
    number; the form with a device-read fast path)."""
    def impl(x: TensorList, t: Any) -> Any:
        if _is_scalar_tensor(t):
            if commutative and x.dtype in _IN_PLACE_DTYPES:
                return op(x, t)
            return _new(op.fn([t] * len(x), x.tensors), t, x)
        if isinstance(t, Tensor):
            return _map(op.per_tensor, (t, x))
        return NotImplemented
    return impl


def _rsub_tensor(x: TensorList, t: Any) -> Any:
    """``t − x`` for a tensor ``t``: ``(−x) + t`` for float32/float64 (the same number), else in order."""
    if _is_scalar_tensor(t) and x.dtype in _IN_PLACE_DTYPES:
        return _rsub(x, t)
    return _tensor_left(_SUB)(x, t)


#: tensor methods torch routes here as ``method(tensor, list)`` (an operator with a tensor on the left):
#: ``method(t, x)``, computed as per tensor
_LIST_RIGHT: dict[Callable, Callable] = {}
for _fns, _impl in (
    ((Tensor.add, Tensor.__add__), _tensor_left(_ADD, commutative=True)),
    ((Tensor.__radd__,), _ADD),  # (Tensor.__radd__(t, x) is x + t)
    ((Tensor.mul, Tensor.__mul__), _tensor_left(_MUL, commutative=True)),
    ((Tensor.__rmul__,), _MUL),
    ((Tensor.sub, Tensor.__sub__), _rsub_tensor),
    ((Tensor.__rsub__,), _SUB),
    ((Tensor.div, Tensor.true_divide, Tensor.__truediv__, Tensor.__div__), _tensor_left(_DIV)),
    ((Tensor.__rtruediv__, Tensor.__rdiv__), _DIV),
    ((Tensor.pow, Tensor.__pow__), _rpow),
    ((Tensor.__rpow__,), _POW),
    ((Tensor.maximum,), _tensor_left(_MAXIMUM)),
    ((Tensor.minimum,), _tensor_left(_MINIMUM)),
):
    for _f in _fns:
        _LIST_RIGHT[_f] = _impl

#: torch functions with a foreach form
_TORCH: dict[Callable, Callable] = {
    torch.add: _either_side(_ADD, _tensor_left(_ADD, commutative=True)),
    torch.mul: _either_side(_MUL, _tensor_left(_MUL, commutative=True)),
    torch.sub: _either_side(_SUB, _rsub_tensor),
    torch.div: _either_side(_DIV, _tensor_left(_DIV)),
    torch.true_divide: _either_side(_DIV, _tensor_left(_DIV)),
    torch.pow: _either_side(_POW, _rpow),
    torch.maximum: _either_side(_MAXIMUM, _tensor_left(_MAXIMUM)),
    torch.minimum: _either_side(_MINIMUM, _tensor_left(_MINIMUM)),
    torch.clamp: _first_list(_clamp),
    torch.clamp_min: _first_list(_CLAMP_MIN),
    torch.clamp_max: _first_list(_CLAMP_MAX),
    torch.lerp: _first_list(_lerp),
    torch.addcmul: _first_list(lambda x, t1, t2, *, value=1: _addc(torch._foreach_addcmul, torch.addcmul, x,
                                                                   t1, t2, value)),
    torch.addcdiv: _first_list(lambda x, t1, t2, *, value=1: _addc(torch._foreach_addcdiv, torch.addcdiv, x,
                                                                   t1, t2, value)),
    torch.where: _where,
}


def _torch_unary(fn: Callable) -> Callable:
    def impl(*args, **kwargs):
        if kwargs or len(args) != 1 or not isinstance(args[0], TensorList):
            return NotImplemented
        return _new(fn(args[0].tensors), args[0])
    return impl


for _name, (_out, _) in _UNARY.items():
    _TORCH[getattr(torch, _name)] = _torch_unary(_out)
del _fns, _impl, _f, _name, _out


# ------------------------------------------------------------------------------------------------------------
# values computed when first read


class _Lazy(TensorList):
    """A list whose tensors are computed when first read (its ``tensors``, by any operation); until then it
    counts as of mixed dtypes (never the operand of an in-place update)."""

    __slots__ = ("_length",)

    def __init__(self, length: int) -> None:
        super().__init__([], False)
        self._tensors = None  # type: ignore[assignment]
        self._length = length

    @property
    def tensors(self) -> list[Tensor]:
        if self._tensors is None:
            out = self._compute()
            self._tensors, self._uniform, self._fresh = out._tensors, out._uniform, out._fresh
        return self._tensors

    def _compute(self) -> TensorList:  # pragma: no cover - abstract
        raise NotImplementedError

    def __len__(self) -> int:
        return self._length


class _Scaled(_Lazy):
    """``g * k`` for the raw gradients ``g`` of a run and its ``k``: in place in them when, at the first
    read, nothing refers to the raw list any more and none of its tensors was handed out (then nothing can
    read ``g`` again); a new list otherwise."""

    __slots__ = ("_raw",)

    def __init__(self, raw: TensorList) -> None:
        super().__init__(len(raw._tensors))
        self._raw = raw

    def _compute(self) -> TensorList:
        ctx = self._raw._ctx
        if ELIDE and _refs(self._raw) <= _T_HELD and not self._raw._aliased and self._raw._uniform \
                and _keeps(self._raw, ctx.k):
            out = TensorList(self._raw._tensors, True)  # (the gradients: never a temporary)
            _MUL.in_place(out, ctx.k)
            ctx.grads_scaled = ctx.writes_grads
        else:
            out = _MUL(self._raw, ctx.k)
        self._raw = None  # type: ignore[assignment]
        return out

    @property
    def dtype(self) -> torch.dtype:
        return self._raw.dtype if self._tensors is None else self._tensors[0].dtype


class _Select(_Lazy):
    """``torch.where(cond, a, b)`` for a 0-d ``cond`` and two lists; :func:`run_rule` writes a result that
    selects against the old value as a masked write of ``b``."""

    __slots__ = ("cond", "a", "b")

    def __init__(self, cond: Tensor, a: TensorList, b: TensorList) -> None:
        super().__init__(len(b))
        self.cond, self.a, self.b = cond, a, b

    def _compute(self) -> TensorList:
        out = _new([torch.where(self.cond, x, y) for x, y in zip(self.a.tensors, self.b.tensors)],
                   self.a, self.b)
        self.a = self.b = None  # type: ignore[assignment]
        return out

    @property
    def dtype(self) -> torch.dtype:
        return torch.result_type(self.a.tensors[0], self.b.tensors[0]) if self._tensors is None \
            else self._tensors[0].dtype


# ------------------------------------------------------------------------------------------------------------
# running a rule over lists


class _Run:
    """What one group's run shares with its raw gradient list: the step's ``k``, whether the list's tensors
    are the gradients themselves (``writes_grads``), and whether ``k·g`` went into them."""

    __slots__ = ("k", "writes_grads", "grads_scaled")

    def __init__(self, k: Tensor | None, writes_grads: bool) -> None:
        self.k, self.writes_grads, self.grads_scaled = k, writes_grads, False


def _raw_grads(tensors: list[Tensor], ctx: _Run) -> TensorList:
    g = TensorList(tensors, True)
    g._ctx = ctx
    return g


def run_rule(rule: Callable, hyper: tuple, params: Sequence[Tensor], grads: Sequence[Tensor],
             slot_lists: Sequence[Sequence[Tensor]], lr: Tensor, k: Tensor | None, found_inf: Tensor | None,
             aux: Sequence | None, *, group_by: Callable = mt.group_by_device_dtype) -> None:
    """Run the pointwise ``rule`` over the tensors as multi-tensor ops, updating weights and slots in place.

    The result is bitwise :func:`optkit._core.chain.chain`'s with ``upcast=True`` and no decay, EMA or
    multipliers (the optimizer base applies those around its update): per (device, dtype) group (``group_by``:
    :func:`~optkit._multi_tensor.group_by_device_dtype` or the base's faster form of it) the rule runs once
    with :class:`TensorList` arguments; float16/bfloat16 tensors are computed on float32 copies and each
    stored value is rounded once; the results are written back with one foreach copy, or, with ``found_inf``
    given, a per-tensor ``torch.where`` that leaves every weight and slot bitwise as it was when it is 1 (no
    host read). ``k·g`` is left in the gradients when ``k`` is given, as the fused kernels' ``grad_scale``
    leaves it.

    ``aux`` holds one value per tensor (or is None): tensors sharing one object run together with it;
    tensors with a value of their own run through :func:`~optkit._core.chain.chain`, one by one.
    """
    if len(params) == 0:
        return
    slot_lists = [list(s) for s in slot_lists]
    if aux is None or all(a is aux[0] for a in aux):
        parts: list[tuple[list[int] | None, Any]] = [(None, None if aux is None else aux[0])]
        single: list[int] = []
    else:
        shared: dict[int, tuple[Any, list[int]]] = {}
        for i, a in enumerate(aux):
            shared.setdefault(id(a), (a, []))[1].append(i)
        parts = [(ix, a) for a, ix in shared.values() if len(ix) > 1]
        single = sorted(ix[0] for _, ix in shared.values() if len(ix) == 1)
    for index, value in parts:
        lists = (params, grads, *slot_lists)
        if index is not None:
            lists = tuple([lst[i] for i in index] for lst in lists)
        for (device, dtype), (_, grouped) in group_by(*lists).items():
            _run_group(rule, hyper, grouped, lr, k, found_inf, value, device, dtype)
    if single:
        ps, gs = [params[i] for i in single], [grads[i] for i in single]
        chain(rule, hyper, ps, gs, tuple([s[i] for i in single] for s in slot_lists), None, lr, k, None, None,
              None, found_inf, None, [aux[i] for i in single], upcast=True)  # type: ignore[index]
        if k is not None:
            mt.scale_(gs, k)


def _run_group(rule, hyper, lists, lr, k, found_inf, aux, device, dtype) -> None:
    ws, gs, *slots = lists
    half = dtype in _HALF
    ctx = _Run(None if k is None else k.to(device), writes_grads=not half)
    # (a group's gradients and slots have its parameters' dtype: torch keeps ``.grad`` in it, slots are made
    # and loaded in it; the lists are of one dtype without a check per tensor)
    if half:  # computed in float32, rounded once on the way back (as chain's upcast)
        w = TensorList([t.float() for t in ws], True)
        olds = [TensorList([t.float() for t in s], True) for s in slots]
        g = [t.float() for t in gs]
    else:
        w, olds, g = TensorList(ws, True), [TensorList(s, True) for s in slots], gs
    # (the raw gradient list is made in the call: the rule holds the only reference to it, see _Scaled)
    new_w, new_slots = rule(hyper, w, _raw_grads(g, ctx), olds, lr.to(device), ctx.k, aux)
    if len(new_slots) != len(slots):
        raise ValueError(f"the update rule returned {len(new_slots)} slots for {len(slots)}")
    skip = None if found_inf is None else found_inf.to(device) > 0.5
    # results written as they are (or skipped), and selects against the old value, by condition
    plain: tuple[list[Tensor], list[Tensor]] = ([], [])
    masked: dict[int, tuple[Tensor, list[Tensor], list[Tensor]]] = {}
    for tgt, old, new in zip((ws, *slots), (w, *olds), (new_w, *new_slots)):
        if new is old:  # (a slot the rule left as it was)
            continue
        if type(new) is _Select and new._tensors is None and new.a is old:
            entry = masked.get(id(new.cond))
            if entry is None:
                cond = new.cond if skip is None else skip | new.cond
                entry = masked[id(new.cond)] = (cond, [], [])
            entry[1].extend(tgt)
            entry[2].extend(new.b.tensors)
            continue
        plain[0].extend(tgt)
        plain[1].extend(_as_tensors(new, tgt))
    del new_w, new_slots
    mt.commit_(plain[0], plain[1], skip)
    for cond, targets, values in masked.values():
        mt.commit_(targets, values, cond)
    if ctx.k is not None and not ctx.grads_scaled:  # k·g left in the gradients (the grad_scale write-back)
        mt.scale_(gs, ctx.k)


def _as_tensors(new: Any, like: list[Tensor]) -> list[Tensor]:
    """A rule's result for one list as its tensors (a 0-d tensor or number: the same value for each)."""
    if isinstance(new, TensorList):
        if len(new) != len(like):
            raise ValueError(f"the update rule returned {len(new)} tensors for {len(like)}")
        return new.tensors
    if isinstance(new, Tensor) and new.dim() == 0:
        return [new.expand_as(t) for t in like]
    if isinstance(new, _NUMBER):
        return [torch.full_like(t, new) for t in like]
    raise TypeError(f"the update rule returned {type(new).__name__} where a TensorList was expected")
