"""The scenario file format: `scenario_from_dict` builds a `Scenario` from the JSON-shaped
dict of a scenario file (docs/scenarios.md), checking every field first and naming
the field, the value and what is allowed in its `ScenarioError` (the checks are the
package's one set, `dlbfluid._validate`). Parsing happens in Python, before anything is
traced.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np

from .._errors import ScenarioError
from .._registry import SERVICE_MODELS
from .._runtime.eager import to_device
from .._service import law, service_from_cells
from .._validate import integer, invalid, number
from .feasibility import check_capacity
from .model import NO_SESSIONS, Scenario, Workload, _server_cells, weighted_random_routing

# The scenario's field errors are `ScenarioError`s; JSON may write a count as `4.0`.
_err = functools.partial(invalid, error=ScenarioError)
_number = functools.partial(number, error=ScenarioError)
_integer = functools.partial(integer, whole_floats=True, error=ScenarioError)

PROFILE_KINDS = ("piecewise_linear", "piecewise_constant")
"""Arrival-profile kinds; a profile without `kind` is `piecewise_linear`."""

REPLICAS_MAX = 1_000_000
"""Largest replica count of a cell (`replicas`, `replica_schedule`): counts are stored as
floats and must stay exact integers in float32 (up to 2**24), and a million servers per
cell is beyond any deployment the model describes (a larger number is a unit mistake)."""


_CELL_KEYS = (
    "name",
    "arrival_rate",
    "replicas",
    "service",
    "estimated_service",
    "buffer",
    "replica_schedule",
    "service_schedule",
    "servers",
)

SERVER_KEYS = (
    "count",
    "prefill_token_time",
    "decode_token_time",
    "decode_engines",
    "slots",
    "cache_sessions",
)
"""Keys of a cell's `"servers"` object; `count` defaults to the cell's `replicas`,
`decode_engines` to 2 and `slots` to 4 (seed App. B), `cache_sessions` to
`CACHE_SESSIONS`."""
CACHE_SESSIONS = 64
"""Sessions a server's prefix cache holds by default (theory/affinity.md, *Prefix caches*)."""
CACHE_SESSIONS_MAX = 4096
"""Largest `cache_sessions` (a static array axis of the twin)."""
SESSION_KEYS = ("fraction", "mean_length", "think_time", "prefix_reuse", "skew")
"""Keys of `workload.sessions` (`skew` optional, default 0)."""
DECODE_SLOTS_MAX = 1024
"""Largest `decode_engines` x `slots` of a server (a static array axis of the twin)."""
TOKEN_KEYS = ("shift", "shape", "scale")
"""Keys of a token-count law of the `"workload"` object (a shifted Gamma)."""


def _shape(value: Any) -> str:
    """What a value that should be a matrix is, for messages: "2 rows of lengths [3, 3]"."""
    if not isinstance(value, list):
        return "null" if value is None else f"a {type(value).__name__}"
    lengths = [len(r) if isinstance(r, list) else type(r).__name__ for r in value]
    return f"{len(value)} rows of lengths {lengths}"


def _matrix_error(field: str, value: Any, n: int, what: str) -> ScenarioError:
    return ScenarioError(
        f"{field} is invalid: expected a {n} x {n} matrix (one row per cell, one entry per "
        f"cell) of {what}, got {_shape(value)}"
    )


def _parse_profile(field: str, value: Any) -> tuple[list[float], list[float]]:
    """`(times, rates)` of a piecewise-linear interpolant from a rate or a profile.

    A number is a constant rate. A profile `{"times", "rates", "kind"?}` is constant before
    its first and after its last breakpoint; `kind` defaults to `"piecewise_linear"`
    (linear between breakpoints; a time given twice is a jump, the first rate just before
    it and the second just after), and `"piecewise_constant"` holds `rates[p]` on
    `[times[p], times[p+1])` (times strictly increasing)."""
    if isinstance(value, dict):
        unknown = set(value) - {"times", "rates", "kind"}
        if unknown:
            raise _err(field, value, f"unknown keys {sorted(unknown)}; allowed: times, rates, kind")
        kind = value.get("kind", "piecewise_linear")
        if kind not in PROFILE_KINDS:
            raise _err(
                f"{field}.kind",
                kind,
                "expected 'piecewise_linear' (the default) or 'piecewise_constant'",
            )
        times, rates = value.get("times"), value.get("rates")
        if not isinstance(times, list) or not isinstance(rates, list) or len(times) == 0:
            raise _err(field, value, "expected non-empty lists 'times' and 'rates'")
        if len(times) != len(rates):
            raise _err(field, value, f"'times' has {len(times)} entries, 'rates' {len(rates)}")
        ts = [_number(f"{field}.times[{p}]", t) for p, t in enumerate(times)]
        rs = [_number(f"{field}.rates[{p}]", r, lo=0.0) for p, r in enumerate(rates)]
        for p in range(1, len(ts)):
            if ts[p] < ts[p - 1]:
                raise _err(f"{field}.times", times, "times must be non-decreasing")
            if kind == "piecewise_constant" and ts[p] == ts[p - 1]:
                raise _err(
                    f"{field}.times",
                    times,
                    f"time {ts[p]:g} is repeated: a piecewise_constant profile holds rates[p] "
                    "from times[p] to times[p+1], so its times must be strictly increasing",
                )
            if p >= 2 and ts[p] == ts[p - 2]:
                raise _err(
                    f"{field}.times",
                    times,
                    f"time {ts[p]:g} appears more than twice: a piecewise_linear profile may "
                    "repeat a time once, for a jump (the rate just before, then just after)",
                )
        if kind == "piecewise_constant":
            # rate r_p on [t_p, t_{p+1}): duplicate each interior breakpoint into a jump.
            t2, r2 = [ts[0]], [rs[0]]
            for p in range(1, len(ts)):
                t2 += [ts[p], ts[p]]
                r2 += [rs[p - 1], rs[p]]
            ts, rs = t2, r2
        return ts, rs
    rate = _number(field, value, lo=0.0)
    return [0.0], [rate]


def _parse_service(field: str, value: Any) -> tuple[str, dict[str, float]]:
    """`(law name, parameters)` of one cell's `service` object, validated by its law."""
    if not isinstance(value, dict):
        raise _err(field, value, "expected an object with a 'model' key")
    model = value.get("model")
    if not isinstance(model, str) or model not in SERVICE_MODELS:
        raise _err(f"{field}.model", model, f"allowed models: {sorted(SERVICE_MODELS.names())}")
    return model, law(model).parse(field, value)


def _parse_servers(field: str, value: Any, replicas: float) -> tuple:
    """`(count, t_p, t_d, engines, slots, cache_sessions)` of a cell's `"servers"` object
    (seed App. B; theory/affinity.md)."""
    if not isinstance(value, dict):
        raise _err(field, value, f"expected an object with keys {', '.join(SERVER_KEYS)}")
    unknown = set(value) - set(SERVER_KEYS)
    if unknown:
        raise _err(field, sorted(unknown), f"unknown keys; allowed: {', '.join(SERVER_KEYS)}")
    for key in ("prefill_token_time", "decode_token_time"):
        if key not in value:
            raise _err(f"{field}.{key}", None, "required: seconds per token, a number > 0")
    count = _integer(f"{field}.count", value.get("count", int(replicas)), 1, REPLICAS_MAX)
    tp = _number(f"{field}.prefill_token_time", value["prefill_token_time"], lo=0.0, lo_open=True)
    td = _number(f"{field}.decode_token_time", value["decode_token_time"], lo=0.0, lo_open=True)
    engines = _integer(
        f"{field}.decode_engines", value.get("decode_engines", 2), 1, DECODE_SLOTS_MAX
    )
    slots = _integer(f"{field}.slots", value.get("slots", 4), 1, DECODE_SLOTS_MAX)
    if engines * slots > DECODE_SLOTS_MAX:
        raise _err(
            field,
            value,
            f"decode_engines x slots = {engines * slots}: expected at most {DECODE_SLOTS_MAX}",
        )
    cache = _integer(
        f"{field}.cache_sessions",
        value.get("cache_sessions", CACHE_SESSIONS),
        0,
        CACHE_SESSIONS_MAX,
    )
    return count, tp, td, engines, slots, cache


def _parse_tokens(field: str, value: Any) -> tuple[float, float, float]:
    """`(shift, shape, scale)` of a shifted-Gamma token law: shift >= 0, shape > 0,
    scale >= 0 (0: the constant `shift`), mean shift + shape * scale > 0."""
    if not isinstance(value, dict) or set(value) != set(TOKEN_KEYS):
        raise _err(field, value, "expected an object with exactly the keys shift, shape, scale")
    shift = _number(f"{field}.shift", value["shift"], lo=0.0)
    shape = _number(f"{field}.shape", value["shape"], lo=0.0, lo_open=True)
    scale = _number(f"{field}.scale", value["scale"], lo=0.0)
    if not shift + shape * scale > 0:
        raise _err(field, value, "expected a positive mean shift + shape * scale")
    return shift, shape, scale


def _parse_sessions(field: str, value: Any) -> tuple[float, ...]:
    """`(fraction, mean_length, think_time, prefix_reuse, skew)` of `workload.sessions`
    (theory/affinity.md, *Sessions*)."""
    required = set(SESSION_KEYS) - {"skew"}
    if not isinstance(value, dict) or not required <= set(value) <= set(SESSION_KEYS):
        raise _err(
            field,
            value,
            "expected an object with the keys fraction, mean_length, think_time, "
            "prefix_reuse and optionally skew",
        )
    return (
        _number(f"{field}.fraction", value["fraction"], lo=0.0, hi=1.0),
        _number(f"{field}.mean_length", value["mean_length"], lo=1.0),
        _number(f"{field}.think_time", value["think_time"], lo=0.0, lo_open=True),
        _number(f"{field}.prefix_reuse", value["prefix_reuse"], lo=0.0, hi=1.0),
        _number(f"{field}.skew", value.get("skew", 0.0), lo=0.0, hi=8.0),
    )


def _parse_workload(value: Any) -> Workload:
    """The top-level `"workload"`: `{"prompt_tokens": LAW, "output_tokens": LAW,
    "sessions"?: SESSIONS}`."""
    keys = {"prompt_tokens", "output_tokens"}
    if not isinstance(value, dict) or not keys <= set(value) <= keys | {"sessions"}:
        raise _err(
            "workload",
            value,
            "expected an object with the keys prompt_tokens, output_tokens and optionally sessions",
        )
    p = _parse_tokens("workload.prompt_tokens", value["prompt_tokens"])
    o = _parse_tokens("workload.output_tokens", value["output_tokens"])
    sess = (
        _parse_sessions("workload.sessions", value["sessions"])
        if "sessions" in value
        else NO_SESSIONS
    )
    return Workload(*(to_device(np.asarray(v, dtype=float)) for v in (*p, *o, *sess)))


SLOWDOWN_MAX = 1e6
"""Largest factor of a `service_schedule` (a cell a million times slower is stopped; a
larger number is a unit mistake)."""


def _parse_schedule(field: str, value: Any, key: str, check) -> tuple[list, list]:
    """`{"times": [...], key: [...]}`: a piecewise-constant schedule, `value[key][q]` from
    `times[q]` on; `check(field, v)` validates and returns each value. A one-entry schedule
    is stored twice over (a second breakpoint at the same time), so that a scenario with a
    schedule has at least two columns: the simulators test the width, not the values, to
    know whether the routers must observe it."""
    if not isinstance(value, dict) or set(value) != {"times", key}:
        raise _err(field, value, f"expected an object with exactly the keys 'times' and '{key}'")
    times, vals = value["times"], value[key]
    if not isinstance(times, list) or not isinstance(vals, list) or not times:
        raise _err(field, value, f"expected non-empty lists 'times' and '{key}'")
    if len(times) != len(vals):
        raise _err(field, value, f"'times' has {len(times)} entries, '{key}' {len(vals)}")
    ts = [_number(f"{field}.times[{q}]", t) for q, t in enumerate(times)]
    vs = [check(f"{field}.{key}[{q}]", v) for q, v in enumerate(vals)]
    if any(b <= a for a, b in zip(ts, ts[1:])):
        raise _err(
            f"{field}.times",
            times,
            f"times must be strictly increasing ({key}[q] holds from times[q] to times[q+1])",
        )
    if len(ts) == 1:
        ts, vs = ts * 2, vs * 2
    return ts, vs


def _parse_replica_schedule(field: str, cell: dict, k: float) -> tuple[list, list]:
    """`{"times": [...], "replicas": [...]}`: piecewise-constant replica count (outages)."""
    value = cell.get("replica_schedule")
    if value is None:
        return [0.0], [k]

    def count(f, c):
        c = _number(f, c, lo=0.0, lo_open=True)
        if c > REPLICAS_MAX:
            raise _err(f, c, f"expected a number in (0, {REPLICAS_MAX}]")
        return c

    return _parse_schedule(field, value, "replicas", count)


def _parse_service_schedule(field: str, cell: dict) -> tuple[list, list]:
    """`{"times": [...], "factors": [...]}`: piecewise-constant service slowdown $s_j(t)$
    (service times multiplied, capacity divided, by the factor)."""
    value = cell.get("service_schedule")
    if value is None:
        return [0.0], [1.0]

    def factor(f, v):
        return _number(
            f,
            v,
            lo=1.0,
            hi=SLOWDOWN_MAX,
            allowed=f"expected a slowdown factor in [1, {SLOWDOWN_MAX:g}] (service times "
            "are multiplied by it; a cell that is faster at times takes its fastest service "
            "and is slowed at the others)",
        )

    return _parse_schedule(field, value, "factors", factor)


@dataclasses.dataclass
class _Cells:
    """The per-cell fields of a file, parsed, in cell order."""

    names: list[str] = dataclasses.field(default_factory=list)
    profiles: list[tuple[list[float], list[float]]] = dataclasses.field(default_factory=list)
    replicas: list[float] = dataclasses.field(default_factory=list)
    services: list[tuple[str, dict[str, float]]] = dataclasses.field(default_factory=list)
    estimates: list[tuple[str, dict[str, float]]] = dataclasses.field(default_factory=list)
    buffers: list[float] = dataclasses.field(default_factory=list)
    schedules: list[tuple[list, list]] = dataclasses.field(default_factory=list)
    slowdowns: list[tuple[list, list]] = dataclasses.field(default_factory=list)
    servers: list[tuple | None] = dataclasses.field(default_factory=list)


def _parse_top(data: Any) -> tuple[str, list]:
    """`(name, cells)` of the top-level object, its keys checked."""
    if not isinstance(data, dict):
        raise _err("scenario", type(data).__name__, "expected a JSON object")
    unknown = set(data) - {"name", "cells", "latency", "initial", "description", "workload"}
    if unknown:
        raise _err(
            "scenario",
            sorted(unknown),
            "unknown top-level keys; allowed: name, description, cells, latency, initial, workload",
        )
    name = data.get("name", "scenario")
    if not isinstance(name, str):
        raise _err("name", name, "expected a string")
    if not isinstance(data.get("description", ""), str):
        raise _err("description", data["description"], "expected a string")
    cells = data.get("cells")
    if not isinstance(cells, list) or len(cells) == 0:
        raise _err("cells", cells, "expected a non-empty list of cell objects")
    return name, cells


def _parse_cell(out: _Cells, j: int, cell: Any) -> None:
    """Append cell `j`'s fields to `out`."""
    f = f"cells[{j}]"
    if not isinstance(cell, dict):
        raise _err(f, cell, "expected an object")
    unknown = set(cell) - set(_CELL_KEYS)
    if unknown:
        raise _err(f, sorted(unknown), f"unknown keys; allowed: {', '.join(_CELL_KEYS)}")
    cname = cell.get("name", f"cell{j}")
    if not isinstance(cname, str) or not cname:
        raise _err(f"{f}.name", cname, "expected a non-empty string")
    out.names.append(cname)
    if "arrival_rate" not in cell:
        raise _err(f"{f}.arrival_rate", None, "required: a rate >= 0 or a profile")
    out.profiles.append(_parse_profile(f"{f}.arrival_rate", cell["arrival_rate"]))
    k = _integer(
        f"{f}.replicas",
        cell.get("replicas", 1),
        1,
        REPLICAS_MAX,
        allowed=f"expected an integer >= 1 (at most {REPLICAS_MAX})",
    )
    out.replicas.append(float(k))
    out.services.append(_parse_service(f"{f}.service", cell.get("service")))
    if "estimated_service" in cell:
        out.estimates.append(_parse_service(f"{f}.estimated_service", cell["estimated_service"]))
    else:
        out.estimates.append(out.services[-1])
    out.buffers.append(
        _number(f"{f}.buffer", cell["buffer"], lo=0.0, lo_open=True)
        if cell.get("buffer") is not None
        else math.inf
    )
    out.schedules.append(_parse_replica_schedule(f"{f}.replica_schedule", cell, float(k)))
    out.slowdowns.append(_parse_service_schedule(f"{f}.service_schedule", cell))
    if "servers" in cell:
        out.servers.append(_parse_servers(f"{f}.servers", cell["servers"], float(k)))
    else:
        out.servers.append(None)


def _parse_latency(lat: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
    """`(tau, allowed)` from the `latency` matrix (null: no arc)."""
    if (
        not isinstance(lat, list)
        or len(lat) != n
        or any(not isinstance(row, list) or len(row) != n for row in lat)
    ):
        raise _matrix_error(
            "latency", lat, n, "one-way latencies in seconds, null for a forbidden arc"
        )
    tau = np.zeros((n, n))
    allowed = np.zeros((n, n), dtype=bool)
    for i in range(n):
        for j in range(n):
            v = lat[i][j]
            if v is None:
                continue
            tau[i, j] = _number(f"latency[{i}][{j}]", v, lo=0.0)
            allowed[i, j] = True
    return tau, allowed


def _padded_rows(rows: list[list[float]]) -> np.ndarray:
    """Rows of different lengths as one array, each row repeating its last entry."""
    width = max(len(row) for row in rows)
    return np.array([row + [row[-1]] * (width - len(row)) for row in rows])


def _parse_initial(initial: Any, allowed: np.ndarray, k: np.ndarray):
    """`(N0, x0)` from the `initial` object (default: empty queues, weighted random)."""
    n = allowed.shape[0]
    if not isinstance(initial, dict):
        raise _err("initial", initial, "expected an object with 'workload' and/or 'routing'")
    unknown = set(initial) - {"workload", "routing"}
    if unknown:
        raise _err("initial", sorted(unknown), "unknown keys; allowed: workload, routing")
    if "workload" in initial:
        w = initial["workload"]
        if not isinstance(w, list) or len(w) != n:
            got = f"{len(w)} entries" if isinstance(w, list) else _shape(w)
            raise ScenarioError(
                f"initial.workload is invalid: expected a list of {n} workloads >= 0 (one per "
                f"cell), got {got}"
            )
        N0 = np.array([_number(f"initial.workload[{j}]", v, lo=0.0) for j, v in enumerate(w)])
    else:
        N0 = np.zeros(n)
    if "routing" not in initial:
        return N0, weighted_random_routing(allowed, k)
    r = initial["routing"]
    if (
        not isinstance(r, list)
        or len(r) != n
        or any(not isinstance(row, list) or len(row) != n for row in r)
    ):
        raise _matrix_error("initial.routing", r, n, "routing probabilities (each row sums to 1)")
    x0 = np.array(
        [
            [_number(f"initial.routing[{i}][{j}]", v, lo=0.0) for j, v in enumerate(row)]
            for i, row in enumerate(r)
        ]
    )
    for i in range(n):
        if np.any(x0[i][~allowed[i]] > 0):
            raise _err(f"initial.routing[{i}]", r[i], "must be 0 on forbidden arcs (null latency)")
        if allowed[i].any() and abs(x0[i].sum() - 1.0) > 1e-9:
            raise _err(
                f"initial.routing[{i}]",
                r[i],
                "each row must sum to 1 (a probability vector over the allowed arcs)",
            )
    return N0, x0


def scenario_from_dict(data: dict, *, allow_overload: bool = False) -> Scenario:
    """Build and validate a `Scenario` from the JSON-shaped dict of the file format.

    **Arguments:**
    - `data`: `{"name", "cells": [{"name", "arrival_rate", "replicas", "service",
      "estimated_service"?, "buffer"?, "replica_schedule"?,
      "service_schedule"?, "servers"?}], "latency": [[tau or null]],
      "initial": {"workload", "routing"}}` (docs/scenarios.md).
    - `allow_overload`: skip the Assumption-2 capacity check (simulate overload on purpose).

    **Raises:** `ScenarioError` naming the field, the value and what is allowed;
    `OverloadError` (a subclass) when no routing serves the demand within capacity.
    """
    name, cell_list = _parse_top(data)
    n = len(cell_list)
    cells = _Cells()
    for j, cell in enumerate(cell_list):
        _parse_cell(cells, j, cell)
    if len(set(cells.names)) != n:
        raise _err("cells[].name", cells.names, "cell names must be unique")
    workload = _parse_workload(data["workload"]) if "workload" in data else None
    with_servers = [j for j in range(n) if cells.servers[j] is not None]
    if with_servers and workload is None:
        raise _err(
            "workload",
            None,
            f"required when a cell has a 'servers' object (cells {with_servers}): "
            "{'prompt_tokens': {shift, shape, scale}, 'output_tokens': {...}}",
        )
    tau, allowed = _parse_latency(data.get("latency"), n)
    times = _padded_rows([p[0] for p in cells.profiles])
    rates = _padded_rows([p[1] for p in cells.profiles])
    for i in range(n):
        if rates[i].max() > 0 and not allowed[i].any():
            raise ScenarioError(
                f"cells[{i}] ({cells.names[i]!r}) has arrivals (arrival_rate up to "
                f"{rates[i].max()}) but latency[{i}] allows no arc: every cell with demand "
                "needs at least one non-null entry in its latency row"
            )
    k = np.array(cells.replicas)
    N0, x0 = _parse_initial(data.get("initial", {}) or {}, allowed, k)
    scn = Scenario(
        arrival_times=to_device(times),
        arrival_rates=to_device(rates),
        replicas=to_device(k),
        service=service_from_cells(cells.services),
        latency=to_device(tau),
        allowed=to_device(allowed),
        cell_mask=to_device(np.ones(n, dtype=bool)),
        initial_workload=to_device(N0),
        initial_routing=to_device(x0),
        name=name,
        cell_names=tuple(cells.names),
        buffer=to_device(np.array(cells.buffers)),
        replica_times=to_device(_padded_rows([s[0] for s in cells.schedules])),
        replica_counts=to_device(_padded_rows([s[1] for s in cells.schedules])),
        slowdown_times=to_device(_padded_rows([s[0] for s in cells.slowdowns])),
        slowdown_factors=to_device(_padded_rows([s[1] for s in cells.slowdowns])),
        estimate=service_from_cells(cells.estimates),
        servers=_server_cells(cells.servers) if with_servers else None,
        workload=workload,
    )
    if not allow_overload:
        check_capacity(scn)
    return scn
