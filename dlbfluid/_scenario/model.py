"""Scenarios: cells, arrival profiles, service models and the latency matrix.

A `Scenario` is an equinox Module of arrays. Networks of different sizes batch together
by padding to a common cell count: padded cells have zero arrivals, no arcs in or out,
and an M/M/1 service model that never sees traffic (`cell_mask` marks the real cells).
Parsing and validation happen here, in Python, before anything is traced.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from .._errors import OverloadError, ScenarioError
from .._registry import SERVICE_MODELS
from .._service import ServiceModel, law, service_from_cells
from .._shapes import lead


class ServerCells(eqx.Module):
    """The App.-B server model of each cell (seed App. B; theory/requests.md, *App.-B cell*),
    read only by the request-level twin (`simulate_requests(service="servers")`).

    **Fields** (`(n,)` each; a batch adds a leading axis):
    - `mask`: True where the cell has a `"servers"` object (False: padding, or a cell
      without one).
    - `count`: servers in the cell.
    - `prefill_token_time`, `decode_token_time`: $t_p$, $t_d$ (s per token): a request of
      $P$ prompt and $D$ output tokens is prefilled in $Pt_p$ and decoded in $Dt_d$.
    - `decode_engines`, `slots`: decode engines per server and parallel slots per engine.
    """

    mask: Bool[Array, " n"]
    count: Int[Array, " n"]
    prefill_token_time: Float[Array, " n"]
    decode_token_time: Float[Array, " n"]
    decode_engines: Int[Array, " n"]
    slots: Int[Array, " n"]


class Workload(eqx.Module):
    """Per-request token counts of a scenario: prompt tokens $P = \\delta_p + G_p$ and output
    tokens $D = \\delta_o + G_o$, $G \\sim \\mathrm{Gamma}(\\alpha, \\theta)$ (shape, scale;
    scale 0 makes the count the constant $\\delta$), independent (seed App. B; the
    generator's `ShiftedGamma`).

    **Fields:** `prompt_shift`, `prompt_shape`, `prompt_scale`, `output_shift`,
    `output_shape`, `output_scale` (scalars; a batch adds a leading axis).
    """

    prompt_shift: Float[Array, ""]
    prompt_shape: Float[Array, ""]
    prompt_scale: Float[Array, ""]
    output_shift: Float[Array, ""]
    output_shape: Float[Array, ""]
    output_scale: Float[Array, ""]


class Scenario(eqx.Module):
    """A DLB network (seed §3.2.1, theory/model.md).

    **Fields** (`n` cells, `P` arrival breakpoints; a batch adds a leading axis):
    - `arrival_times`, `arrival_rates`: `(n, P)` piecewise-linear arrival profile
      $\\lambda_i(t)$ at the root routers of cell $i$ (requests/s).
    - `replicas`: `(n,)` replica count $k_j$ (used by RIF costs and weighted random).
    - `service`: the per-cell `ServiceModel`.
    - `latency`: `(n, n)` one-way network latency $\\tau_{ij}$ (s); 0 on non-arcs.
    - `allowed`: `(n, n)` boolean arc set $\\mathcal A$.
    - `cell_mask`: `(n,)` True for real cells, False for padding.
    - `initial_workload`: `(n,)` $N(0)$, also the constant history on $[-\\bar\\tau, 0]$.
    - `initial_routing`: `(n, n)` $x(0)$, also the constant routing history.
    - `buffer`: `(n,)` queue capacity $B_j$ of each cell (requests); flow that arrives at a
      full cell is dropped and counted as errors. It scales with the running replicas,
      $B_j c_j(t)$ (servers that go offline take their queues with them). Default
      $+\\infty$ (no drops).
    - `replica_times`, `replica_counts`: `(n, Q)` piecewise-constant replica schedule
      $k_j(t)$ = `replica_counts[j, q]` for `replica_times[j, q]` $\\le t <$
      `replica_times[j, q+1]` (capacity outages). The cell's processing rate scales as
      $c\\,\\mu_j(N/c)$ with $c = k_j(t)/k_j$ (theory/evaluation.md, *Replicas*). Default: the
      constant `replicas`.
    - `estimate`: the `ServiceModel` the routers believe (latency and gradient costs are
      evaluated with it; seed §3.3, §5.4). Default: `service` itself.
    - `servers`: the App.-B server model of the cells (`ServerCells`), or None (no cell
      has a `"servers"` object); read only by `simulate_requests(service="servers")`.
    - `workload`: the per-request token counts (`Workload`), or None.
    - `name`, `cell_names`: metadata, stripped before tracing.
    """

    arrival_times: Float[Array, "n P"]
    arrival_rates: Float[Array, "n P"]
    replicas: Float[Array, " n"]
    service: ServiceModel
    latency: Float[Array, "n n"]
    allowed: Bool[Array, "n n"]
    cell_mask: Bool[Array, " n"]
    initial_workload: Float[Array, " n"]
    initial_routing: Float[Array, "n n"]
    name: str = eqx.field(static=True, default="scenario")
    cell_names: tuple[str, ...] = eqx.field(static=True, default=())
    # (optional arguments, always filled in by __post_init__)
    buffer: Float[Array, " n"] = None  # type: ignore[assignment]
    replica_times: Float[Array, "n Q"] = None  # type: ignore[assignment]
    replica_counts: Float[Array, "n Q"] = None  # type: ignore[assignment]
    estimate: ServiceModel = None  # type: ignore[assignment]
    servers: ServerCells | None = None
    workload: Workload | None = None

    def __post_init__(self):
        k = jnp.asarray(self.replicas)
        if self.buffer is None:
            self.buffer = jnp.full(k.shape, jnp.inf, dtype=jnp.result_type(float))
        if self.replica_times is None:
            self.replica_times = jnp.zeros(k.shape + (1,), dtype=jnp.result_type(float))
        if self.replica_counts is None:
            self.replica_counts = k[..., None]
        if self.estimate is None:
            self.estimate = self.service

    @property
    def n_cells(self) -> int:
        """Padded cell count (the last axis of `replicas`)."""
        return self.replicas.shape[-1]

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return self.replicas.shape[:-1]

    def arrival_rate(self, t=0.0):
        """$\\lambda_i(t)$ for every cell (unbatched scenarios)."""
        return _interp_rows(self.arrival_times, self.arrival_rates, t)

    def strip(self) -> Scenario:
        """The same arrays without metadata, so that jit caches ignore names."""
        return dataclasses.replace(self, name="", cell_names=())


def replica_scale(times, counts, replicas, t):
    """$c_j(t) = k_j(t)/k_j$ from a piecewise-constant schedule (one cell; `t` any shape).

    The count `counts[q]` holds on `[times[q], times[q+1])`; before `times[0]` the first
    count applies.
    """
    t = jnp.asarray(t)
    idx = jnp.clip(jnp.sum(lead(times, t.ndim + 1) <= t[..., None], axis=-1) - 1, 0, None)
    return counts[idx] / replicas


def _interp_rows(times, rates, t):
    import jax

    return jax.vmap(lambda ts, rs: jnp.interp(t, ts, rs))(times, rates)


# ----------------------------------------------------------------------------------------
# Parsing and validation
# ----------------------------------------------------------------------------------------


def _err(field: str, value: Any, allowed: str) -> ScenarioError:
    return ScenarioError(f"{field} = {value!r} is invalid: {allowed}")


def _finite_number(field: str, value: Any, *, minimum=None, strict=False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _err(field, value, "expected a number")
    v = float(value)
    if not math.isfinite(v):
        raise _err(field, value, "expected a finite number")
    if minimum is not None:
        if strict and not v > minimum:
            raise _err(field, value, f"expected a finite number > {minimum}")
        if not strict and not v >= minimum:
            raise _err(field, value, f"expected a finite number >= {minimum}")
    return v


PROFILE_KINDS = ("piecewise_linear", "piecewise_constant")
"""Arrival-profile kinds; a profile without `kind` is `piecewise_linear`."""

REPLICAS_MAX = 1_000_000
"""Largest replica count of a cell (`replicas`, `replica_schedule`): counts are stored as
floats and must stay exact integers in float32 (up to 2**24), and a million servers per
cell is beyond any deployment the model describes (a larger number is a unit mistake)."""


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
        ts = [_finite_number(f"{field}.times[{p}]", t) for p, t in enumerate(times)]
        rs = [_finite_number(f"{field}.rates[{p}]", r, minimum=0.0) for p, r in enumerate(rates)]
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
    rate = _finite_number(field, value, minimum=0.0)
    return [0.0], [rate]


def _parse_service(field: str, value: Any) -> tuple[str, dict[str, float]]:
    """`(law name, parameters)` of one cell's `service` object, validated by its law."""
    if not isinstance(value, dict):
        raise _err(field, value, "expected an object with a 'model' key")
    model = value.get("model")
    if not isinstance(model, str) or model not in SERVICE_MODELS:
        raise _err(f"{field}.model", model, f"allowed models: {sorted(SERVICE_MODELS.names())}")
    return model, law(model).parse(field, value)


_CELL_KEYS = (
    "name",
    "arrival_rate",
    "replicas",
    "service",
    "estimated_service",
    "buffer",
    "replica_schedule",
    "servers",
)

SERVER_KEYS = ("count", "prefill_token_time", "decode_token_time", "decode_engines", "slots")
"""Keys of a cell's `"servers"` object; `count` defaults to the cell's `replicas`,
`decode_engines` to 2 and `slots` to 4 (seed App. B)."""
DECODE_SLOTS_MAX = 1024
"""Largest `decode_engines` x `slots` of a server (a static array axis of the twin)."""
TOKEN_KEYS = ("shift", "shape", "scale")
"""Keys of a token-count law of the `"workload"` object (a shifted Gamma)."""


def _integer(field: str, value: Any, lo: int, hi: int) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value != int(value)
        or not lo <= value <= hi
    ):
        raise _err(field, value, f"expected an integer in [{lo}, {hi}]")
    return int(value)


def _parse_servers(field: str, value: Any, replicas: float) -> tuple:
    """`(count, t_p, t_d, engines, slots)` of a cell's `"servers"` object (seed App. B)."""
    if not isinstance(value, dict):
        raise _err(field, value, f"expected an object with keys {', '.join(SERVER_KEYS)}")
    unknown = set(value) - set(SERVER_KEYS)
    if unknown:
        raise _err(field, sorted(unknown), f"unknown keys; allowed: {', '.join(SERVER_KEYS)}")
    for key in ("prefill_token_time", "decode_token_time"):
        if key not in value:
            raise _err(f"{field}.{key}", None, "required: seconds per token, a number > 0")
    count = _integer(f"{field}.count", value.get("count", int(replicas)), 1, REPLICAS_MAX)
    tp = _finite_number(
        f"{field}.prefill_token_time", value["prefill_token_time"], minimum=0.0, strict=True
    )
    td = _finite_number(
        f"{field}.decode_token_time", value["decode_token_time"], minimum=0.0, strict=True
    )
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
    return count, tp, td, engines, slots


def _parse_tokens(field: str, value: Any) -> tuple[float, float, float]:
    """`(shift, shape, scale)` of a shifted-Gamma token law: shift >= 0, shape > 0,
    scale >= 0 (0: the constant `shift`), mean shift + shape * scale > 0."""
    if not isinstance(value, dict) or set(value) != set(TOKEN_KEYS):
        raise _err(field, value, "expected an object with exactly the keys shift, shape, scale")
    shift = _finite_number(f"{field}.shift", value["shift"], minimum=0.0)
    shape = _finite_number(f"{field}.shape", value["shape"], minimum=0.0, strict=True)
    scale = _finite_number(f"{field}.scale", value["scale"], minimum=0.0)
    if not shift + shape * scale > 0:
        raise _err(field, value, "expected a positive mean shift + shape * scale")
    return shift, shape, scale


def _parse_workload(value: Any) -> Workload:
    """The top-level `"workload"`: `{"prompt_tokens": LAW, "output_tokens": LAW}`."""
    keys = {"prompt_tokens", "output_tokens"}
    if not isinstance(value, dict) or set(value) != keys:
        raise _err(
            "workload",
            value,
            "expected an object with exactly the keys prompt_tokens, output_tokens",
        )
    p = _parse_tokens("workload.prompt_tokens", value["prompt_tokens"])
    o = _parse_tokens("workload.output_tokens", value["output_tokens"])
    return Workload(*(jnp.asarray(v, dtype=jnp.result_type(float)) for v in (*p, *o)))


def _parse_replica_schedule(field: str, cell: dict, k: float) -> tuple[list, list]:
    """`{"times": [...], "replicas": [...]}`: piecewise-constant replica count (outages)."""
    value = cell.get("replica_schedule")
    if value is None:
        return [0.0], [k]
    if not isinstance(value, dict) or set(value) != {"times", "replicas"}:
        raise _err(field, value, "expected an object with exactly the keys 'times' and 'replicas'")
    times, counts = value["times"], value["replicas"]
    if not isinstance(times, list) or not isinstance(counts, list) or not times:
        raise _err(field, value, "expected non-empty lists 'times' and 'replicas'")
    if len(times) != len(counts):
        raise _err(field, value, f"'times' has {len(times)} entries, 'replicas' {len(counts)}")
    ts = [_finite_number(f"{field}.times[{q}]", t) for q, t in enumerate(times)]
    ks = [
        _finite_number(f"{field}.replicas[{q}]", c, minimum=0.0, strict=True)
        for q, c in enumerate(counts)
    ]
    for q, c in enumerate(ks):
        if c > REPLICAS_MAX:
            raise _err(
                f"{field}.replicas[{q}]", counts[q], f"expected a number in (0, {REPLICAS_MAX}]"
            )
    if any(b <= a for a, b in zip(ts, ts[1:])):
        raise _err(
            f"{field}.times",
            times,
            "times must be strictly increasing (replicas[q] holds from times[q] to times[q+1])",
        )
    return ts, ks


def scenario_from_dict(data: dict, *, allow_overload: bool = False) -> Scenario:
    """Build and validate a `Scenario` from the JSON-shaped dict of the file format.

    **Arguments:**
    - `data`: `{"name", "cells": [{"name", "arrival_rate", "replicas", "service",
      "estimated_service"?, "buffer"?, "replica_schedule"?}], "latency": [[tau or null]],
      "initial": {"workload", "routing"}}` (README, *Scenario files*).
    - `allow_overload`: skip the Assumption-2 capacity check (simulate overload on purpose).

    **Raises:** `ScenarioError` naming the field, the value and what is allowed;
    `OverloadError` (a subclass) when no routing serves the demand within capacity.
    """
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
    n = len(cells)
    names, profiles, replicas, services = [], [], [], []
    estimates, buffers, schedules = [], [], []
    servers: list[tuple | None] = []
    for j, cell in enumerate(cells):
        f = f"cells[{j}]"
        if not isinstance(cell, dict):
            raise _err(f, cell, "expected an object")
        unknown = set(cell) - set(_CELL_KEYS)
        if unknown:
            raise _err(f, sorted(unknown), f"unknown keys; allowed: {', '.join(_CELL_KEYS)}")
        cname = cell.get("name", f"cell{j}")
        if not isinstance(cname, str) or not cname:
            raise _err(f"{f}.name", cname, "expected a non-empty string")
        names.append(cname)
        if "arrival_rate" not in cell:
            raise _err(f"{f}.arrival_rate", None, "required: a rate >= 0 or a profile")
        profiles.append(_parse_profile(f"{f}.arrival_rate", cell["arrival_rate"]))
        k = cell.get("replicas", 1)
        if (
            isinstance(k, bool)
            or not isinstance(k, (int, float))
            or not math.isfinite(k)
            or k != int(k)
            or not 1 <= k <= REPLICAS_MAX
        ):
            raise _err(f"{f}.replicas", k, f"expected an integer >= 1 (at most {REPLICAS_MAX})")
        replicas.append(float(k))
        services.append(_parse_service(f"{f}.service", cell.get("service")))
        if "estimated_service" in cell:
            estimates.append(_parse_service(f"{f}.estimated_service", cell["estimated_service"]))
        else:
            estimates.append(services[-1])
        buffers.append(
            _finite_number(f"{f}.buffer", cell["buffer"], minimum=0.0, strict=True)
            if cell.get("buffer") is not None
            else math.inf
        )
        schedules.append(_parse_replica_schedule(f"{f}.replica_schedule", cell, replicas[-1]))
        if "servers" in cell:
            servers.append(_parse_servers(f"{f}.servers", cell["servers"], replicas[-1]))
        else:
            servers.append(None)
    if len(set(names)) != n:
        raise _err("cells[].name", names, "cell names must be unique")
    workload = _parse_workload(data["workload"]) if "workload" in data else None
    with_servers = [j for j in range(n) if servers[j] is not None]
    if with_servers and workload is None:
        raise _err(
            "workload",
            None,
            f"required when a cell has a 'servers' object (cells {with_servers}): "
            "{'prompt_tokens': {shift, shape, scale}, 'output_tokens': {...}}",
        )

    lat = data.get("latency")
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
            tau[i, j] = _finite_number(f"latency[{i}][{j}]", v, minimum=0.0)
            allowed[i, j] = True

    P = max(len(p[0]) for p in profiles)
    times = np.array([p[0] + [p[0][-1]] * (P - len(p[0])) for p in profiles])
    rates = np.array([p[1] + [p[1][-1]] * (P - len(p[1])) for p in profiles])
    for i in range(n):
        if rates[i].max() > 0 and not allowed[i].any():
            raise ScenarioError(
                f"cells[{i}] ({names[i]!r}) has arrivals (arrival_rate up to {rates[i].max()}) "
                f"but latency[{i}] allows no arc: every cell with demand needs at least one "
                "non-null entry in its latency row"
            )

    initial = data.get("initial", {}) or {}
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
        N0 = np.array(
            [_finite_number(f"initial.workload[{j}]", v, minimum=0.0) for j, v in enumerate(w)]
        )
    else:
        N0 = np.zeros(n)
    k = np.array(replicas)
    if "routing" in initial:
        r = initial["routing"]
        if (
            not isinstance(r, list)
            or len(r) != n
            or any(not isinstance(row, list) or len(row) != n for row in r)
        ):
            raise _matrix_error(
                "initial.routing", r, n, "routing probabilities (each row sums to 1)"
            )
        x0 = np.array(
            [
                [
                    _finite_number(f"initial.routing[{i}][{j}]", v, minimum=0.0)
                    for j, v in enumerate(row)
                ]
                for i, row in enumerate(r)
            ]
        )
        for i in range(n):
            if np.any(x0[i][~allowed[i]] > 0):
                raise _err(
                    f"initial.routing[{i}]", r[i], "must be 0 on forbidden arcs (null latency)"
                )
            if allowed[i].any() and abs(x0[i].sum() - 1.0) > 1e-9:
                raise _err(
                    f"initial.routing[{i}]",
                    r[i],
                    "each row must sum to 1 (a probability vector over the allowed arcs)",
                )
    else:
        x0 = weighted_random_routing(allowed, k)

    service = service_from_cells(services)
    Q = max(len(sch[0]) for sch in schedules)
    rep_t = np.array([sch[0] + [sch[0][-1]] * (Q - len(sch[0])) for sch in schedules])
    rep_k = np.array([sch[1] + [sch[1][-1]] * (Q - len(sch[1])) for sch in schedules])
    scn = Scenario(
        arrival_times=jnp.asarray(times),
        arrival_rates=jnp.asarray(rates),
        replicas=jnp.asarray(k),
        service=service,
        latency=jnp.asarray(tau),
        allowed=jnp.asarray(allowed),
        cell_mask=jnp.ones(n, dtype=bool),
        initial_workload=jnp.asarray(N0),
        initial_routing=jnp.asarray(x0),
        name=name,
        cell_names=tuple(names),
        buffer=jnp.asarray(np.array(buffers)),
        replica_times=jnp.asarray(rep_t),
        replica_counts=jnp.asarray(rep_k),
        estimate=service_from_cells(estimates),
        servers=_server_cells(servers) if with_servers else None,
        workload=workload,
    )
    if not allow_overload:
        check_capacity(scn)
    return scn


def _server_cells(rows: list) -> ServerCells:
    """`ServerCells` from per-cell `_parse_servers` tuples (None: a cell without one)."""
    filler = (0, 1.0, 1.0, 1, 1)
    vals = [r if r is not None else filler for r in rows]
    col = [np.array([v[q] for v in vals]) for q in range(5)]
    return ServerCells(
        mask=jnp.asarray(np.array([r is not None for r in rows])),
        count=jnp.asarray(col[0].astype(np.int32)),
        prefill_token_time=jnp.asarray(col[1].astype(float)),
        decode_token_time=jnp.asarray(col[2].astype(float)),
        decode_engines=jnp.asarray(col[3].astype(np.int32)),
        slots=jnp.asarray(col[4].astype(np.int32)),
    )


def proportional_routing(allowed, weights, xp=np):
    """$x_{ij} = w_j/\\sum_{l \\in C^+(i)} w_l$ on allowed arcs, 0 on rows without an arc;
    `xp` is `numpy` (parsing) or `jax.numpy` (inside the compiled loop)."""
    w = xp.where(allowed, weights[..., None, :], 0.0)
    tot = xp.sum(w, axis=-1, keepdims=True)
    return xp.where(tot > 0, w / xp.where(tot > 0, tot, 1.0), 0.0)


def weighted_random_routing(allowed, replicas) -> np.ndarray:
    """$x_{ij} = k_j/\\sum_{l \\in C^+(i)} k_l$ on allowed arcs (the `rand` policy)."""
    return proportional_routing(np.asarray(allowed, dtype=bool), np.asarray(replicas, dtype=float))


def load_scenario(path: str | Path, *, allow_overload: bool = False) -> Scenario:
    """Read a scenario JSON file (see `scenario_from_dict`)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ScenarioError(f"scenario file {str(path)!r} cannot be read: {e.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ScenarioError(f"scenario file {str(path)!r} is not valid JSON: {e}") from None
    return scenario_from_dict(data, allow_overload=allow_overload)


def default_scenario() -> Scenario:
    """The built-in heterogeneous 4-cell scenario used by `dlbfluid demo`."""
    text = resources.files("dlbfluid").joinpath("data/default.json").read_text()
    return scenario_from_dict(json.loads(text))


def scenario_to_dict(scn: Scenario) -> dict:
    """Inverse of `scenario_from_dict` for one unpadded scenario (profiles as breakpoints)."""
    mask = np.asarray(scn.cell_mask)
    n = int(mask.sum())
    names = list(scn.cell_names) or [f"cell{j}" for j in range(n)]
    s = scn.service
    cells = []
    for j in range(n):
        ts = np.asarray(scn.arrival_times[j])
        rs = np.asarray(scn.arrival_rates[j])
        if np.all(ts == ts[0]) and np.all(rs == rs[0]):
            rate: Any = float(rs[0])
        else:
            rate = {"times": ts.tolist(), "rates": rs.tolist()}
        cell = {
            "name": names[j],
            "arrival_rate": rate,
            "replicas": int(scn.replicas[j]),
            "service": s.cell_dict(j),
        }
        est = scn.estimate.cell_dict(j)
        if est != cell["service"]:
            cell["estimated_service"] = est
        if np.isfinite(float(scn.buffer[j])):
            cell["buffer"] = float(scn.buffer[j])
        rt = np.asarray(scn.replica_times[j])
        rk = np.asarray(scn.replica_counts[j])
        if np.any(rk != float(scn.replicas[j])):
            cell["replica_schedule"] = {"times": rt.tolist(), "replicas": rk.tolist()}
        sv = scn.servers
        if sv is not None and bool(sv.mask[j]):
            cell["servers"] = {
                "count": int(sv.count[j]),
                "prefill_token_time": float(sv.prefill_token_time[j]),
                "decode_token_time": float(sv.decode_token_time[j]),
                "decode_engines": int(sv.decode_engines[j]),
                "slots": int(sv.slots[j]),
            }
        cells.append(cell)
    tau = np.asarray(scn.latency)
    allowed = np.asarray(scn.allowed)
    latency = [[float(tau[i, j]) if allowed[i, j] else None for j in range(n)] for i in range(n)]
    out = {
        "name": scn.name,
        "cells": cells,
        "latency": latency,
        "initial": {
            "workload": np.asarray(scn.initial_workload)[:n].tolist(),
            "routing": np.asarray(scn.initial_routing)[:n, :n].tolist(),
        },
    }
    w = scn.workload
    if w is not None:
        out["workload"] = {
            f"{part}_tokens": {key: float(getattr(w, f"{part}_{key}")) for key in TOKEN_KEYS}
            for part in ("prompt", "output")
        }
    return out


# ----------------------------------------------------------------------------------------
# Assumption 2: a strictly feasible routing exists (checked as a max-flow problem)
# ----------------------------------------------------------------------------------------


def _max_flow(cap: np.ndarray, s: int, t: int) -> tuple[float, np.ndarray]:
    """Edmonds-Karp on a small dense graph; returns the flow value and the source side."""
    n = cap.shape[0]
    residual = cap.astype(float).copy()
    total = 0.0
    scale = max(float(cap[np.isfinite(cap)].max(initial=0.0)), 1.0)
    while True:
        parent = -np.ones(n, dtype=int)
        parent[s] = s
        queue = [s]
        while queue and parent[t] < 0:
            u = queue.pop(0)
            for v in (int(w) for w in np.nonzero((residual[u] > 1e-12 * scale) & (parent < 0))[0]):
                parent[v] = u
                queue.append(v)
        if parent[t] < 0:
            break
        v, bottleneck = t, float(np.inf)
        while v != s:
            bottleneck = min(bottleneck, float(residual[parent[v], v]))
            v = int(parent[v])
        v = t
        while v != s:
            residual[parent[v], v] -= bottleneck
            residual[v, parent[v]] += bottleneck
            v = int(parent[v])
        total += bottleneck
    return total, parent >= 0


def _limits(times: np.ndarray, rates: np.ndarray, t: float) -> tuple[float, float]:
    """The rate of one piecewise-linear profile just before and just after `t` (they
    differ at a jump: a time given twice, first with the rate before it)."""
    at = np.nonzero(times == t)[0]
    if at.size:
        return float(rates[at[0]]), float(rates[at[-1]])
    v = float(np.interp(t, times, rates))
    return v, v


def check_capacity(scn: Scenario, *, rel_margin: float = 1e-9) -> None:
    """Raise `OverloadError` unless some routing serves every arrival profile's demand
    strictly within capacity (Assumption 2), at every breakpoint of the profiles.

    Max-flow from the origins (capacity $\\lambda_i$) over allowed arcs to the cells
    (capacity $\\bar\\mu_j(1-\\epsilon)$, $\\epsilon$ = `rel_margin`); a minimum cut names
    the overloaded cells. The demand is piecewise linear between the breakpoints of all
    profiles and the feasible demands are a convex set, so checking the rates just before
    and just after every breakpoint checks every time. Rates are scaled by the largest
    arrival rate first (and capacities capped at the total demand, which no cut can
    exceed), so the test's tolerances are relative to the demand whatever the capacities:
    a capacity of 1e20 next to an arrival rate of 1 is feasible. Zero demand is feasible.
    """
    _check_capacity(scn, rel_margin=rel_margin)


def _check_capacity(scn: Scenario, *, rel_margin: float = 1e-9, remedy: str | None = None):
    """`check_capacity` whose message ends with `remedy` (what the caller can do instead;
    default: the Python API's `allow_overload=True`)."""
    if remedy is None:
        remedy = (
            "or pass allow_overload=True (scenario_from_dict, load_scenario) to simulate "
            "overload on purpose."
        )
    mask = np.asarray(scn.cell_mask)
    n = int(mask.sum())
    names = list(scn.cell_names) or [f"cell{j}" for j in range(n)]
    allowed = np.asarray(scn.allowed)[:n, :n]
    mubar = np.asarray(scn.service.capacity, dtype=float)[:n]
    at = np.asarray(scn.arrival_times, dtype=float)[:n]
    ar = np.asarray(scn.arrival_rates, dtype=float)[:n]
    times = np.unique(at.ravel())
    for t in times:
        sides = np.array([_limits(at[i], ar[i], t) for i in range(n)]).T  # (before, after)
        for lam in sides if not np.array_equal(sides[0], sides[1]) else sides[:1]:
            _check_cut(lam, mubar, allowed, names, rel_margin, t, len(times) > 1, remedy)


def _check_cut(lam, mubar, allowed, names, rel_margin, t, timed, remedy) -> None:
    """Assumption 2 for one demand vector `lam` (see `check_capacity`)."""
    n = lam.shape[0]
    top = float(lam.max(initial=0.0))
    if not top > 0:
        return  # no demand: every routing serves it
    # In units of the largest rate; a cell's capacity beyond the whole demand cannot bind.
    lam_u = lam / top
    demand = float(lam_u.sum())
    served = np.minimum(mubar * (1.0 - rel_margin) / top, 2.0 * demand)
    V = 2 * n + 2
    s, sink = 0, 2 * n + 1
    cap = np.zeros((V, V))
    cap[s, 1 : n + 1] = lam_u
    cap[1 : n + 1, n + 1 : 2 * n + 1] = np.where(allowed, 2.0 * demand + 1.0, 0.0)
    cap[n + 1 : 2 * n + 1, sink] = served
    flow, source_side = _max_flow(cap, s, sink)
    if flow >= demand * (1.0 - 1e-12):
        return
    # Min cut: origins still reachable from s whose reachable cells are saturated.
    origins = [i for i in range(n) if source_side[1 + i] and lam[i] > 0]
    cells = [j for j in range(n) if source_side[n + 1 + j]]
    if not origins:  # (a shortfall within the tolerances: report the whole network)
        origins = [i for i in range(n) if lam[i] > 0]
        cells = sorted({int(j) for i in origins for j in np.nonzero(allowed[i])[0]})
    cut_demand = float(lam[origins].sum())
    cut_cap = float(mubar[cells].sum())
    when = f" at t = {t:g} s" if timed else ""
    raise OverloadError(
        "demand exceeds what any routing can serve within capacity (Assumption 2)"
        f"{when}: origins {[names[i] for i in origins]} with total arrival rate "
        f"{cut_demand:.6g} can only reach cells {[names[j] for j in cells]} with total "
        f"capacity {cut_cap:.6g} (every cell must stay strictly below its capacity). "
        f"Lower the arrival rates, raise capacities or allow more arcs; {remedy}",
        cells=[names[j] for j in cells],
        sources=[names[i] for i in origins],
        demand=cut_demand,
        capacity=cut_cap,
    )


# ----------------------------------------------------------------------------------------
# Padding and batching
# ----------------------------------------------------------------------------------------


def _param_default(sv: ServiceModel, key: str) -> float:
    for name in sv.laws:
        if key in law(name).defaults:
            return law(name).defaults[key]
    return 1.0


def pad_scenario(
    scn: Scenario,
    n: int,
    n_breakpoints: int | None = None,
    n_schedule: int | None = None,
    *,
    laws: tuple[str, ...] | None = None,
    est_laws: tuple[str, ...] | None = None,
    with_servers: bool = False,
) -> Scenario:
    """Pad one scenario to `n` cells (`n_breakpoints` arrival breakpoints, `n_schedule`
    replica-schedule entries); `laws`, `est_laws` widen the service tables of `service`
    and `estimate` to those laws (for stacking scenarios of different laws);
    `with_servers` gives a scenario without `servers`/`workload` inert ones (no cell has
    servers; a unit workload), so that it stacks with scenarios that have them."""
    m = scn.n_cells
    if n < m:
        raise ValueError(f"cannot pad a {m}-cell scenario to n = {n} cells")
    P = scn.arrival_times.shape[-1]
    Pn = P if n_breakpoints is None else n_breakpoints
    if Pn < P:
        raise ValueError(f"cannot pad {P} arrival breakpoints to {Pn}")
    extra = n - m

    def cells(a, fill):
        a = np.asarray(a)
        return np.concatenate([a, np.full((extra,) + a.shape[1:], fill, dtype=a.dtype)])

    def square(a, fill):
        a = np.asarray(a)
        out = np.full((n, n), fill, dtype=a.dtype)
        out[:m, :m] = a
        return out

    times = np.asarray(scn.arrival_times)
    rates = np.asarray(scn.arrival_rates)
    times = np.concatenate([times, np.repeat(times[:, -1:], Pn - P, axis=1)], axis=1)
    rates = np.concatenate([rates, np.repeat(rates[:, -1:], Pn - P, axis=1)], axis=1)
    rep_t = np.asarray(scn.replica_times)
    rep_k = np.asarray(scn.replica_counts)
    Q = rep_t.shape[-1]
    Qn = Q if n_schedule is None else n_schedule
    if Qn < Q:
        raise ValueError(f"cannot pad {Q} replica-schedule entries to {Qn}")
    rep_t = np.concatenate([rep_t, np.repeat(rep_t[:, -1:], Qn - Q, axis=1)], axis=1)
    rep_k = np.concatenate([rep_k, np.repeat(rep_k[:, -1:], Qn - Q, axis=1)], axis=1)

    def service(sv: ServiceModel, laws) -> ServiceModel:
        # Padded cells follow the table's first law at its default parameters: they never
        # see traffic, and a table of one law evaluates one law.
        sv = sv.with_laws(laws)
        first = law(sv.laws[0])
        params = {
            k: jnp.asarray(cells(v, first.defaults.get(k, _param_default(sv, k))))
            for k, v in sv.params.items()
        }
        return ServiceModel(
            jnp.asarray(cells(sv.model, SERVICE_MODELS.index(sv.laws[0]))), params, laws=sv.laws
        )

    sv = scn.servers
    if sv is None and with_servers:
        sv = _server_cells([None] * m)
    if sv is not None:
        sv = ServerCells(
            mask=jnp.asarray(cells(sv.mask, False)),
            count=jnp.asarray(cells(sv.count, 0)),
            prefill_token_time=jnp.asarray(cells(sv.prefill_token_time, 1.0)),
            decode_token_time=jnp.asarray(cells(sv.decode_token_time, 1.0)),
            decode_engines=jnp.asarray(cells(sv.decode_engines, 1)),
            slots=jnp.asarray(cells(sv.slots, 1)),
        )
    wl = scn.workload
    if wl is None and (with_servers or sv is not None):
        wl = Workload(*(jnp.asarray(v, dtype=jnp.result_type(float)) for v in (1, 1, 0, 1, 1, 0)))
    return Scenario(
        arrival_times=jnp.asarray(cells(times, 0.0)),
        arrival_rates=jnp.asarray(cells(rates, 0.0)),
        replicas=jnp.asarray(cells(scn.replicas, 1.0)),
        service=service(scn.service, laws if laws is not None else scn.service.laws),
        estimate=service(scn.estimate, est_laws if est_laws is not None else scn.estimate.laws),
        buffer=jnp.asarray(cells(scn.buffer, np.inf)),
        replica_times=jnp.asarray(cells(rep_t, 0.0)),
        replica_counts=jnp.asarray(cells(rep_k, 1.0)),
        latency=jnp.asarray(square(scn.latency, 0.0)),
        allowed=jnp.asarray(square(scn.allowed, False)),
        cell_mask=jnp.asarray(cells(scn.cell_mask, False)),
        initial_workload=jnp.asarray(cells(scn.initial_workload, 0.0)),
        initial_routing=jnp.asarray(square(scn.initial_routing, 0.0)),
        name=scn.name,
        cell_names=scn.cell_names,
        servers=sv,
        workload=wl,
    )


def stack_scenarios(
    scenarios: Sequence[Scenario], n_cells: int | None = None, *, laws: Sequence[str] = ()
) -> Scenario:
    """Pad scenarios to a common cell count and stack them along a new leading axis.

    The service models present in a batch are static: only their formulas are compiled
    and evaluated, so two batches of the same shape but different sets of models compile
    separately. `laws` adds models to the set (e.g. `("mm1", "softplus")` for batches that
    should share one compiled program whichever of the two they contain)."""
    scenarios = list(scenarios)
    if not scenarios:
        raise ValueError("stack_scenarios needs at least one scenario")
    n = max(s.n_cells for s in scenarios) if n_cells is None else n_cells
    P = max(s.arrival_times.shape[-1] for s in scenarios)
    Q = max(s.replica_times.shape[-1] for s in scenarios)
    svc = tuple(dict.fromkeys([*laws, *(m for s in scenarios for m in s.service.laws)]))
    est = tuple(dict.fromkeys([*laws, *(m for s in scenarios for m in s.estimate.laws)]))
    with_servers = any(s.servers is not None or s.workload is not None for s in scenarios)
    padded = [
        pad_scenario(s, n, P, Q, laws=svc, est_laws=est, with_servers=with_servers).strip()
        for s in scenarios
    ]
    leaves = [eqx.filter(p, eqx.is_array) for p in padded]
    import jax

    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *leaves)
    return eqx.combine(stacked, padded[0])
