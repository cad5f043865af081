"""Test helpers for the compiled read-only passes (:mod:`optkit._core.chain`): count or fail one of them, or
run every compiled function as plain Python (under a dispatch mode, where compiled code cannot run)."""

from __future__ import annotations

from collections.abc import Callable

import optkit._core.compiled
from optkit._core import chain as _compile

#: the variants the tests cross: eager, compiled (counted), compiling fails, more tensors than allowed
VARIANTS = ("eager", "jit", "jit-fails", "jit-capped")

_REAL: dict[Callable, Callable | None] = {}


def set_variant(monkeypatch, fn: Callable, variant: str, calls: list[int]) -> None:
    """Make the compiled ``fn`` for ``variant``: counted (``calls`` gets the number of tensors of each call,
    emptied here), raising as a failed compile (``"jit-fails"``), or left out because every call has more
    tensors than ``COMPILE_WARN_TENSORS`` (``"jit-capped"``: the limit is set to 0)."""
    if fn not in _REAL:  # (before any patch: compiled_function returns what the dict holds)
        _REAL[fn] = _compile.compiled_function(fn)
    compiled = _REAL[fn]

    def counted(*args):
        calls.append(len(args[0]))
        return compiled(*args)

    def fail(*args):
        raise RuntimeError("simulated compiler failure")

    calls.clear()
    monkeypatch.setitem(_compile._COMPILED_OTHER, fn, fail if variant == "jit-fails" else counted)
    monkeypatch.setattr(optkit._core.compiled, "COMPILE_WARN_TENSORS", 0 if variant == "jit-capped" else 1000)


def run_uncompiled(monkeypatch) -> None:
    """Every compiled function of :mod:`optkit._core.chain` runs as plain Python (the same tensor math)."""

    class _Uncompiled(dict):
        def __contains__(self, fn: object) -> bool:
            return True

        def __missing__(self, fn):  # type: ignore[no-untyped-def]
            return fn

    monkeypatch.setattr(_compile, "_COMPILED", [_compile.chain])
    monkeypatch.setattr(_compile, "_COMPILED_OTHER", _Uncompiled())
