"""The package's one set of field validators (`dlbfluid/_validate.py`; issue 31): each
accepts exactly the values its bounds allow, returns them as plain Python numbers and
refuses the rest with `FIELD = VALUE is invalid: WHAT IS ALLOWED`, as the error class the
caller names. Plain Python: no JAX is compiled."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dlbfluid._errors import ScenarioError
from dlbfluid._validate import integer, invalid, is_number, number


def _message(call) -> str:
    with pytest.raises(ValueError) as e:
        call()
    return str(e.value)


def test_invalid_names_the_field_the_value_and_what_is_allowed():
    e = invalid("cells[0].buffer", "big", "expected a number", error=ScenarioError)
    assert type(e) is ScenarioError
    assert str(e) == "cells[0].buffer = 'big' is invalid: expected a number"
    assert type(invalid("x", 1, "y")) is ValueError


def test_is_number_takes_python_and_numpy_reals_but_no_bools():
    for v in (0, 2.5, np.int64(3), np.float32(0.5), math.inf):
        assert is_number(v), v
    for v in (True, np.bool_(False), "1", None, [1.0], 1j):
        assert not is_number(v), v


@pytest.mark.parametrize(
    "value, bounds, ok",
    [
        (0.0, dict(lo=0), True),
        (0.0, dict(lo=0, lo_open=True), False),
        (1.0, dict(lo=0, hi=1), True),
        (1.0, dict(lo=0, hi=1, hi_open=True), False),
        (0.999, dict(lo=0, hi=1, hi_open=True), True),
        (-1e-300, dict(lo=0), False),
        (-5.0, {}, True),
        (math.inf, {}, False),
        (math.nan, dict(lo=0), False),
    ],
)
def test_number_bounds_are_open_or_closed_as_asked(value, bounds, ok):
    if ok:
        assert number("v", value, **bounds) == value
    else:
        with pytest.raises(ValueError, match=r"^v = .* is invalid: expected a finite number"):
            number("v", value, **bounds)


def test_number_messages_state_the_bounds():
    assert _message(lambda: number("u", 1.0, lo=0, lo_open=True, hi=1.0, hi_open=True)) == (
        "u = 1.0 is invalid: expected a finite number > 0 and < 1.0"
    )
    assert _message(lambda: number("r", -1.0, lo=0.0)) == (
        "r = -1.0 is invalid: expected a finite number >= 0.0"
    )
    assert _message(lambda: number("r", math.nan)) == "r = nan is invalid: expected a finite number"
    assert _message(lambda: number("r", True, lo=0)) == "r = True is invalid: expected a number"
    assert _message(lambda: number("r", "3")) == "r = '3' is invalid: expected a number"
    # A field's own wording replaces both texts.
    own = "expected a finite number in [0.0, 1.0)"
    assert _message(lambda: number("eps", "x", lo=0.0, hi=1.0, hi_open=True, allowed=own)) == (
        f"eps = 'x' is invalid: {own}"
    )
    assert _message(lambda: number("eps", 1.0, lo=0.0, hi=1.0, hi_open=True, allowed=own)) == (
        f"eps = 1.0 is invalid: {own}"
    )


def test_number_returns_a_python_float_and_raises_the_callers_class():
    v = number("v", np.float32(0.25), lo=0)
    assert type(v) is float and v == 0.25
    assert type(number("v", 3)) is float
    with pytest.raises(ScenarioError):
        number("v", -1.0, lo=0, error=ScenarioError)


def test_integer_counts_and_whole_floats():
    assert integer("n", 4, 1) == 4 and type(integer("n", np.int64(4), 1)) is int
    assert integer("n", 1_000_000, 1, 1_000_000) == 1_000_000
    assert _message(lambda: integer("n", 0, 1)) == "n = 0 is invalid: expected an integer >= 1"
    assert (
        _message(lambda: integer("n", 5, 1, 4)) == "n = 5 is invalid: expected an integer in [1, 4]"
    )
    for bad in (True, 2.0, "2", None, np.float64(2.0)):
        with pytest.raises(ValueError, match="expected an integer >= 1"):
            integer("n", bad, 1)
    # JSON counts: a float of integral value is a count, a fraction or infinity is not.
    assert integer("n", 4.0, 1, whole_floats=True) == 4
    assert type(integer("n", 4.0, 1, whole_floats=True)) is int
    for bad in (2.5, math.inf, math.nan, True, "4"):
        with pytest.raises(ScenarioError, match="at most 10"):
            integer("n", bad, 1, 10, whole_floats=True, allowed="at most 10", error=ScenarioError)
