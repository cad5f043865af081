"""Tests for optkit._validation: the strict OpenSeq2Seq-style ``check_params`` (spec/openseq2seq.md §0)."""

from __future__ import annotations

import math

import pytest

from optkit._validation import ParameterTypeError, check_int, check_params, check_real

REQ = {"larc_eta": float}
OPT = {"larc_mode": ["clip", "scale"], "min_update": float, "steps": int, "anything": None,
       "maybe": (float, type(None)), "num": (int, float)}
WHERE = "larc_params"


def test_valid_params_pass_and_are_not_mutated():
    params = {"larc_eta": 0.001, "larc_mode": "scale", "min_update": 1e-7, "steps": 3, "anything": [1],
              "maybe": None, "num": 2}
    copy = dict(params)
    assert check_params(params, REQ, OPT, WHERE) is None
    assert params == copy
    check_params({"larc_eta": 1.0, "num": 2.5, "maybe": 0.5}, REQ, OPT, WHERE)
    check_params(None, {}, OPT, WHERE)
    check_params({}, None, None, WHERE)


def test_missing_required_key():
    with pytest.raises(ValueError, match=r"larc_params: required parameter 'larc_eta'"):
        check_params({"larc_mode": "clip"}, REQ, OPT, WHERE)
    with pytest.raises(ValueError, match="larc_eta"):
        check_params(None, REQ, OPT, WHERE)


def test_unknown_key_names_key_and_place():
    with pytest.raises(ValueError, match=r"Unknown parameter 'larc_etta' in larc_params"):
        check_params({"larc_eta": 1.0, "larc_etta": 1.0}, REQ, OPT, WHERE)


def test_int_rejected_where_float_declared():
    with pytest.raises(ParameterTypeError, match=r"'larc_eta'.*float.*int.*write 1\.0.*not accepted") as info:
        check_params({"larc_eta": 1}, REQ, OPT, WHERE)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
    assert "larc_params" in str(info.value)


@pytest.mark.parametrize(
    ("params", "key"),
    [
        ({"larc_eta": "0.1"}, "larc_eta"),
        ({"larc_eta": None}, "larc_eta"),
        ({"larc_eta": True}, "larc_eta"),  # bool is not a float (nor an int) here
        ({"larc_eta": 1.0, "steps": 2.0}, "steps"),
        ({"larc_eta": 1.0, "steps": False}, "steps"),
        ({"larc_eta": 1.0, "maybe": "x"}, "maybe"),
        ({"larc_eta": 1.0, "num": True}, "num"),
    ],
)
def test_type_errors(params, key):
    with pytest.raises(ParameterTypeError, match=f"'{key}'"):
        check_params(params, REQ, OPT, WHERE)
    with pytest.raises(ValueError):  # the original raised ValueError: still catchable as one
        check_params(params, REQ, OPT, WHERE)


def test_bool_accepted_where_declared():
    check_params({"flag": True}, {}, {"flag": bool}, WHERE)
    check_params({"flag": 0}, {}, {"flag": (bool, int)}, WHERE)


@pytest.mark.parametrize("value", ["Clip", "lars", 1, None])
def test_one_of_list(value):
    with pytest.raises(ValueError, match=r"'larc_mode' has to be one of \['clip', 'scale'\]"):
        check_params({"larc_eta": 1.0, "larc_mode": value}, REQ, OPT, WHERE)


def test_one_of_list_is_type_strict():
    check_params({"k": 1.0}, {}, {"k": [1.0, 2.0]}, WHERE)
    with pytest.raises(ValueError, match="one of"):
        check_params({"k": 1}, {}, {"k": [1.0, 2.0]}, WHERE)
    with pytest.raises(ValueError, match="one of"):
        check_params({"k": True}, {}, {"k": [1, 2]}, WHERE)
    check_params({"k": None}, {}, {"k": [None, "a"]}, WHERE)


def test_bad_arguments():
    with pytest.raises(TypeError, match="larc_params: parameters must be a dict"):
        check_params([("larc_eta", 1.0)], REQ, OPT, WHERE)
    with pytest.raises(TypeError, match="declaration of parameter 'k'"):
        check_params({"k": 1}, {}, {"k": 3}, WHERE)


def test_check_real():
    assert check_real("x", 3, where="w") == 3.0 and isinstance(check_real("x", 3, where="w"), float)
    assert check_real("x", 0.5, where="w", minimum=0.5) == 0.5
    assert check_real("x", math.inf, where="w", finite=False) == math.inf
    for bad, exc in (("1", TypeError), (True, TypeError), (None, TypeError), (math.nan, ValueError),
                     (math.inf, ValueError)):
        with pytest.raises(exc, match="w: x"):
            check_real("x", bad, where="w")
    with pytest.raises(ValueError, match="x must be > 0"):
        check_real("x", 0.0, where="w", minimum=0.0, min_inclusive=False)
    with pytest.raises(ValueError, match="x must be >= 1"):
        check_real("x", 0.5, where="w", minimum=1)
    with pytest.raises(ValueError, match="x must be < 1"):
        check_real("x", 1.0, where="w", maximum=1.0, max_inclusive=False)
    with pytest.raises(ValueError, match="x must be <= 2"):
        check_real("x", 3.0, where="w", maximum=2)


def test_check_int():
    assert check_int("n", 5, where="w", minimum=1) == 5
    for bad in (5.0, True, "5", None):
        with pytest.raises(TypeError, match="w: n must be a Python int"):
            check_int("n", bad, where="w")
    with pytest.raises(ValueError, match="n must be >= 1"):
        check_int("n", 0, where="w", minimum=1)
