"""Comparison helpers for the distributed tests (nested dicts / lists of arrays)."""

from __future__ import annotations

from typing import Any

import numpy as np


def assert_close(
    actual: Any, expected: Any, *, rtol: float = 1e-5, atol: float = 1e-6, path: str = ""
) -> None:
    """Recursive ``np.testing.assert_allclose`` over dicts, lists and arrays; keys must match exactly."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path}: expected a dict, got {type(actual).__name__}"
        assert set(actual) == set(expected), f"{path}: keys {sorted(actual)} != {sorted(expected)}"
        for k in expected:
            assert_close(actual[k], expected[k], rtol=rtol, atol=atol, path=f"{path}/{k}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_close(a, e, rtol=rtol, atol=atol, path=f"{path}[{i}]")
    elif expected is None:
        assert actual is None, f"{path}: expected None, got {actual!r}"
    else:
        np.testing.assert_allclose(np.asarray(actual, dtype=np.float64),
                                   np.asarray(expected, dtype=np.float64), rtol=rtol, atol=atol, err_msg=path)


def assert_equal(actual: Any, expected: Any) -> None:
    """Bit-identical (resume must continue exactly)."""
    assert_close(actual, expected, rtol=0.0, atol=0.0)


def ok(result: Any) -> Any:
    """The scenario result, failing the test with the rank's traceback if the scenario raised."""
    if isinstance(result, dict) and isinstance(result.get("error"), str) and "Traceback" in result["error"]:
        raise AssertionError("scenario raised on a rank:\n" + result["error"])
    return result
