"""One status enumeration for every numerical verb (simulate, equilibria, MNLB, fits).

Every batched verb reports one integer code per scenario (or per cell, for fits) instead
of raising, so that one bad scenario never sinks a batch; `RESULTS` names the codes and
says what each means and what to try. `status_names` turns codes into names and
`raise_for_status` raises the verb's error type when any code is not `success` (the
`throw=True` behaviour of single-scenario calls).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np


class _Result:
    __slots__ = ("name", "code", "message")

    def __init__(self, name: str, code: int, message: str):
        self.name, self.code, self.message = name, code, message

    def __repr__(self) -> str:
        return f"RESULTS.{self.name} ({self.code})"


class Results(Mapping):
    """The status enumeration: `RESULTS.success == 0`, `RESULTS["not_converged"] == 3`,
    `RESULTS.message(code)`, `RESULTS.name(code)`; iterating yields the names.

    Codes are stable (they are written into result files), so new members only ever
    append.
    """

    # The members, declared for type checkers (set from the member list in __init__).
    success: int
    nonfinite: int
    solver_failed: int
    not_converged: int
    negative_workload: int
    mass_balance: int

    def __init__(self, members: list[tuple[str, str]]):
        self._by_name = {name: _Result(name, k, msg) for k, (name, msg) in enumerate(members)}
        self._by_code = {r.code: r for r in self._by_name.values()}
        for r in self._by_name.values():
            object.__setattr__(self, r.name, r.code)

    def __getitem__(self, name: str) -> int:
        return self._by_name[name].code

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def name(self, code: int) -> str:
        return self._by_code[int(code)].name

    def message(self, code: int) -> str:
        return self._by_code[int(code)].message

    def __repr__(self) -> str:
        return "RESULTS(" + ", ".join(f"{n}={r.code}" for n, r in self._by_name.items()) + ")"


RESULTS = Results(
    [
        ("success", "success"),
        (
            "nonfinite",
            "a non-finite value appeared; the scenario was frozen at its last finite state",
        ),
        (
            "solver_failed",
            "the adaptive solver failed inside a tick (max_steps reached or step size "
            "underflow); try a larger `max_steps` or looser tolerances",
        ),
        (
            "not_converged",
            "the iteration did not reach its tolerance within its iteration budget; try a "
            "larger `max_iters` (or, for an equilibrium near capacity, check Assumption 2)",
        ),
        (
            "negative_workload",
            "a workload went negative beyond rounding: the tick is too coarse for the "
            "service rates (the integrator's sub-steps do not resolve them); use a smaller "
            "tick, more sub-steps or the Accurate integrator",
        ),
        (
            "mass_balance",
            "arrivals minus departures and drops no longer equal the change of workload "
            "plus the flow in flight (beyond rounding): the result is not trustworthy",
        ),
    ]
)


def view(*names: str, aliases: dict[str, str] | None = None) -> dict[str, int]:
    """`{name: code}` for a subset of `RESULTS` (the status table of one verb)."""
    out = {n: RESULTS[n] for n in names}
    for alias, target in (aliases or {}).items():
        out[alias] = RESULTS[target]
    return out


def status_names(status) -> np.ndarray:
    """The names of an array of status codes (same shape; a 0-d array for a scalar)."""
    codes = np.asarray(status)
    return (
        np.vectorize(RESULTS.name, otypes=[object])(codes) if codes.size else codes.astype(object)
    )


def raise_for_status(
    status, error: type[Exception], what: str = "", details=None, messages=None
) -> None:
    """Raise `error` naming the failed indices and what their codes mean, if any code of
    `status` is not `success`. `details(bad)` may add per-failure values to the message;
    `messages` `{code: text}` replaces a code's meaning where a verb gives it its own
    (the request-level twin's overflow is `solver_failed`)."""
    st = np.atleast_1d(np.asarray(status))
    bad = np.nonzero(st != RESULTS.success)[0]
    if not bad.size:
        return
    codes = sorted(set(st[bad].tolist()))
    extra = details(bad) if details is not None else ""
    prefix = f"{what}: " if what else ""
    raise error(
        f"{prefix}{bad.size} scenario(s) failed (indices {bad[:10].tolist()}{extra}): "
        + "; ".join(
            f"{RESULTS.name(c)}: {(messages or {}).get(c, RESULTS.message(c))}" for c in codes
        )
    )
