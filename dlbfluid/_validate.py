"""Field validators: the one set of checks for a value a user gives (a scenario file's
field, a keyword argument, a configuration field).

Every check raises one message, `FIELD = VALUE is invalid: WHAT IS ALLOWED` (the field, the
value and what is allowed), as the error class the caller names: `ValueError` by default,
`ScenarioError` for the scenario parser and the service laws. Plain Python and numpy, no
JAX, so that the jax-free modules (the experiment's configuration) use it as well; every
layer of the package may import it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def invalid(field: str, value: Any, allowed: str, *, error: type[Exception] = ValueError):
    """The error `FIELD = VALUE is invalid: ALLOWED`, returned for the caller to raise
    (`raise invalid(...)`), so that type checkers see the raise."""
    return error(f"{field} = {value!r} is invalid: {allowed}")


def is_number(value: Any) -> bool:
    """A real number: a Python or numpy int or float, not a bool."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


def _bounds(lo, hi, lo_open: bool, hi_open: bool) -> str:
    parts = []
    if lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {lo}")
    if hi is not None:
        parts.append(f"{'<' if hi_open else '<='} {hi}")
    return (" " + " and ".join(parts)) if parts else ""


def number(
    field: str,
    value: Any,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
    allowed: str | None = None,
    error: type[Exception] = ValueError,
) -> float:
    """`value` as a float: a finite real number with $lo \\le v$ ($lo < v$ with `lo_open`)
    and $v \\le hi$ ($v < hi$ with `hi_open`); a bound of None is no bound.

    **Raises:** `error` with `"expected a number"` for anything else than a number (a bool
    is not one), and `"expected a finite number"` followed by the bounds (`">= 0.0"`,
    `"> 0 and < 1.0"`) for a non-finite value or one out of bounds. `allowed` replaces both
    texts where a field keeps wording of its own.
    """
    if not is_number(value):
        raise invalid(field, value, allowed or "expected a number", error=error)
    v = float(value)
    ok = math.isfinite(v)
    if ok and lo is not None:
        ok = v > lo if lo_open else v >= lo
    if ok and hi is not None:
        ok = v < hi if hi_open else v <= hi
    if not ok:
        text = allowed or "expected a finite number" + _bounds(lo, hi, lo_open, hi_open)
        raise invalid(field, value, text, error=error)
    return v


def integer(
    field: str,
    value: Any,
    lo: int,
    hi: int | None = None,
    *,
    whole_floats: bool = False,
    allowed: str | None = None,
    error: type[Exception] = ValueError,
) -> int:
    """`value` as an int with $lo \\le v$ (and $v \\le hi$ when `hi` is given).

    An int or a numpy integer (not a bool); with `whole_floats`, also a float of integral
    value (JSON files write counts as `4.0` too).

    **Raises:** `error` with `"expected an integer >= LO"` or `"expected an integer in
    [LO, HI]"` (or `allowed`).
    """
    if whole_floats:
        ok = is_number(value) and math.isfinite(value) and value == int(value)
    else:
        ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if ok:
        ok = lo <= value and (hi is None or value <= hi)
    if not ok:
        text = (
            f"expected an integer >= {lo}" if hi is None else f"expected an integer in [{lo}, {hi}]"
        )
        raise invalid(field, value, allowed or text, error=error)
    return int(value)


def check_search_range(value, field: str) -> tuple[float, float]:
    """`value` as `(L, H)` with $0 < L < H$, both finite.

    **Raises:** `ValueError` naming `field`, the value and what is allowed."""
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise invalid(field, value, "expected two numbers LO HI with 0 < LO < HI") from None
    if not (math.isfinite(lo) and math.isfinite(hi) and 0 < lo < hi):
        raise invalid(field, value, "expected two numbers LO HI with 0 < LO < HI")
    return lo, hi


def period_ticks(period: float, tick: float, field: str) -> int:
    """`period` (s) as a whole number (>= 1) of ticks, or `ValueError` naming `field`."""
    m = period / tick
    if round(m) < 1 or abs(m - round(m)) > 1e-9 * m:
        raise ValueError(
            f"{field} = {period!r} is invalid: expected a whole number of ticks (tick = {tick})"
        )
    return int(round(m))


def check_estimation(refit_period, window, probing=0.0, shrinkage=0.0, dithering=0.0) -> None:
    """Online estimation's numbers (`dlbfluid._requests.estimation.OnlineEstimation`, the
    experiment's configuration): `refit_period` and `window` > 0, the window a whole number
    of refit periods, `probing` and `shrinkage` >= 0, `dithering` in [0, 2]."""
    number("refit_period", refit_period, lo=0.0, lo_open=True)
    number("window", window, lo=0.0, lo_open=True)
    lag = window / refit_period
    if abs(lag - round(lag)) > 1e-9 * lag or round(lag) < 1:
        raise ValueError(
            f"window = {window!r} is invalid: expected a whole number "
            f"(>= 1) of refit periods (refit_period = {refit_period})"
        )
    number("probing", probing, lo=0.0)
    number("shrinkage", shrinkage, lo=0.0)
    number("dithering", dithering, lo=0.0, hi=2.0)
