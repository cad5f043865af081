"""The optimizer's state mappings: ``state`` and each parameter's slot dict count every change (a version
number), so that cached plans holding the old slot tensors are rebuilt; and the host's record of counters."""

from __future__ import annotations

import collections
from typing import Any

from torch import Tensor


class _StateVersion:
    """A counter the optimizer's state dicts bump on every change of an entry (see :class:`_TrackedState`)."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


_ABSENT = object()


class _CountsChanges:
    """What a change of a state mapping does besides changing it: count it in ``self._version`` (the
    optimizer's :class:`_StateVersion`), so that cached plans holding the old slot tensors are rebuilt."""

    __slots__ = ()
    _version: _StateVersion

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(key)  # type: ignore[misc]
        self._version.n += 1

    def pop(self, *args: Any) -> Any:
        self._version.n += 1
        return super().pop(*args)  # type: ignore[misc]

    def popitem(self) -> Any:
        self._version.n += 1
        return super().popitem()  # type: ignore[misc]

    def clear(self) -> None:
        self._version.n += 1
        super().clear()  # type: ignore[misc]

    def __ior__(self, other: Any) -> Any:
        self.update(other)  # type: ignore[attr-defined]
        return self


class _Slots(_CountsChanges, dict):
    """One parameter's state (slot name -> tensor) that counts its changes: cached plans hold the slot
    tensors, so a slot replaced, reset or deleted by the user (torch.optim reads ``state`` afresh each step)
    must rebuild them. In-place changes of a slot tensor need nothing. A plain dict in the optimizer's
    ``state_dict()``."""

    __slots__ = ("_version",)

    def __init__(self, version: _StateVersion, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._version = version

    def __setitem__(self, key: Any, value: Any) -> None:
        if dict.get(self, key, _ABSENT) is not value:
            self._version.n += 1
        super().__setitem__(key, value)

    def update(self, *args: Any, **kwargs: Any) -> None:
        self._version.n += 1
        super().update(*args, **kwargs)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self._version.n += 1
        return super().setdefault(key, default)

    def __reduce__(self) -> Any:
        return (_Slots, (self._version, dict(self)))


class _NewSlots:
    """The default factory of :class:`_TrackedState` (a class, so the state pickles)."""

    __slots__ = ("version",)

    def __init__(self, version: _StateVersion) -> None:
        self.version = version

    def __call__(self) -> _Slots:
        return _Slots(self.version)


class _TrackedState(_CountsChanges, collections.defaultdict):
    """``optimizer.state`` (parameter -> :class:`_Slots`) counting the changes of its entries and theirs;
    copies (``copy()``, ``|``) are plain ``defaultdict(dict)`` of the same entries.

    torch's optimizer contract lets a state-dict hook or the user keep anything under a key that is not a
    parameter (``opt.state["note"] = 1``): such entries are stored as they are (not tracked: no step reads
    them) and round-trip through ``state_dict()`` / ``load_state_dict()`` untouched, as in ``torch.optim``.
    A parameter's entry must be a dict of slots (``TypeError`` otherwise, nothing changed)."""

    def __init__(self, version: _StateVersion, items: Any = ()) -> None:
        super().__init__(_NewSlots(version))
        self._version = version
        for key, value in dict(items).items():
            dict.__setitem__(self, key, self._tracked(key, value))

    def _tracked(self, key: Any, value: Any) -> Any:
        if not isinstance(key, Tensor):  # not a parameter's state: kept as it is (torch's contract)
            return value
        if isinstance(value, _Slots) and value._version is self._version:
            return value
        if not isinstance(value, dict):
            raise TypeError(f"optimizer.state: the state of a parameter must be a dict (slot name -> "
                            f"tensor), got {type(value).__name__}")
        return _Slots(self._version, value)

    def __setitem__(self, key: Any, value: Any) -> None:
        value = self._tracked(key, value)
        self._version.n += 1
        super().__setitem__(key, value)

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = {} if default is None and isinstance(key, Tensor) else default
        return self[key]

    def copy(self) -> collections.defaultdict:
        """A plain ``defaultdict(dict)`` holding the same entries (shallow, as ``dict.copy``)."""
        return collections.defaultdict(dict, self)

    __copy__ = copy

    def __or__(self, other: Any) -> collections.defaultdict:
        out = self.copy()
        out.update(other)
        return out

    def __ror__(self, other: Any) -> collections.defaultdict:
        out = collections.defaultdict(dict, other)
        out.update(self)
        return out

    def __reduce__(self) -> Any:
        return (_TrackedState, (self._version, dict(self)))


def record_field(name: str, doc: str | None = None) -> property:
    """A property kept as ``self._record.<name>``: step bookkeeping of optimizers and wrappers lives in a
    record object (:class:`_HostRecord`, ``_wrapper._WrapperRecord``) because ``torch.compile`` replays the
    mutations of plain objects but drops attribute assignments on an optimizer."""

    def get(self: Any) -> Any:
        return getattr(self._record, name)

    def set_(self: Any, value: Any) -> None:
        setattr(self._record, name, value)

    return property(get, set_, doc=doc)


class _HostRecord:
    """An optimizer's host-side step bookkeeping: the count of applied updates while it is exact (no step
    could have been skipped since it was last read from the device), and the last step's outcome. It is an
    object of its own because ``torch.compile(opt.step)`` replays the mutations of plain objects but drops
    attribute assignments on the optimizer itself."""

    __slots__ = ("iterations", "exact", "applied", "seen")

    def __init__(self) -> None:
        self.iterations = 0
        self.exact = True
        self.applied: Tensor | None = None
        #: (the count tensor, its version counter) when the host last counted: a write from outside
        # (``opt.iterations.zero_()``) changes the version, and the host count is no longer the count
        self.seen: tuple[Tensor, int] | None = None
