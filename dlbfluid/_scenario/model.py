"""The scenario Modules: `Scenario` (cells, arrival profiles, service laws, latency matrix),
the App.-B `ServerCells` and the `Workload` of token counts, and the routings a scenario
starts from (weighted random, proportional).

A `Scenario` is an equinox Module of arrays. Networks of different sizes batch together
by padding to a common cell count (`batching`): padded cells have zero arrivals, no arcs in
or out, and an M/M/1 service model that never sees traffic (`cell_mask` marks the real
cells). Files are parsed and validated in Python, before anything is traced (`parse`).
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from .._runtime.eager import to_device
from .._service import ServiceModel
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
    - `cache_sessions`: sessions whose prompt prefix each server's cache holds (least
      recently used evicted first; 0: no cache; theory/affinity.md).
    """

    mask: Bool[Array, " n"]
    count: Int[Array, " n"]
    prefill_token_time: Float[Array, " n"]
    decode_token_time: Float[Array, " n"]
    decode_engines: Int[Array, " n"]
    slots: Int[Array, " n"]
    cache_sessions: Int[Array, " n"]


class Workload(eqx.Module):
    """Per-request token counts of a scenario: prompt tokens $P = \\delta_p + G_p$ and output
    tokens $D = \\delta_o + G_o$, $G \\sim \\mathrm{Gamma}(\\alpha, \\theta)$ (shape, scale;
    scale 0 makes the count the constant $\\delta$), independent (seed App. B; the
    generator's `ShiftedGamma`).

    **Sessions** (theory/affinity.md, *Sessions*): a fraction `session_fraction` of the
    requests belong to sessions of mean `session_length` requests whose requests come
    `think_time` apart on average (at the root's peak rate), with Zipf exponent
    `session_skew` over the sessions active at a root (0: equally active; larger: a few
    hot sessions carry most requests); a request whose session's prefix is in its server's
    cache is prefilled in `1 - prefix_reuse` of its time. `session_fraction` 0 (the
    default): no sessions.

    **Fields:** `prompt_shift`, `prompt_shape`, `prompt_scale`, `output_shift`,
    `output_shape`, `output_scale`, `session_fraction`, `session_length`, `think_time`,
    `prefix_reuse`, `session_skew` (scalars; a batch adds a leading axis).
    """

    prompt_shift: Float[Array, ""]
    prompt_shape: Float[Array, ""]
    prompt_scale: Float[Array, ""]
    output_shift: Float[Array, ""]
    output_shape: Float[Array, ""]
    output_scale: Float[Array, ""]
    session_fraction: Float[Array, ""]
    session_length: Float[Array, ""]
    think_time: Float[Array, ""]
    prefix_reuse: Float[Array, ""]
    session_skew: Float[Array, ""]


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
    - `slowdown_times`, `slowdown_factors`: `(n, S)` piecewise-constant service slowdown
      $s_j(t) \\ge 1$ = `slowdown_factors[j, q]` from `slowdown_times[j, q]` on (a cell's
      `service_schedule`): the cell's service times are multiplied, and its processing
      rate divided, by $s_j(t)$, so that it processes $c\\,\\mu_j(N/c)/s_j$
      (theory/evaluation.md, *Service schedules*). Default: 1 (no slowdown).
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
    slowdown_times: Float[Array, "n S"] = None  # type: ignore[assignment]
    slowdown_factors: Float[Array, "n S"] = None  # type: ignore[assignment]
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
        if self.slowdown_times is None:
            self.slowdown_times = jnp.zeros(k.shape + (1,), dtype=jnp.result_type(float))
        if self.slowdown_factors is None:
            self.slowdown_factors = jnp.ones(k.shape + (1,), dtype=jnp.result_type(float))

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


def piecewise_constant(times, values, t):
    """A piecewise-constant schedule of one cell at times `t` (any shape): `values[q]`
    holds on `[times[q], times[q+1])`; before `times[0]` the first value applies."""
    t = jnp.asarray(t)
    idx = jnp.clip(jnp.sum(lead(times, t.ndim + 1) <= t[..., None], axis=-1) - 1, 0, None)
    return values[idx]


def replica_scale(times, counts, replicas, t):
    """$c_j(t) = k_j(t)/k_j$ from a piecewise-constant schedule (one cell; `t` any shape;
    `piecewise_constant`)."""
    return piecewise_constant(times, counts, t) / replicas


def _interp_rows(times, rates, t):
    return jax.vmap(lambda ts, rs: jnp.interp(t, ts, rs))(times, rates)


def _server_cells(rows: list) -> ServerCells:
    """`ServerCells` from per-cell `_parse_servers` tuples (None: a cell without one)."""
    filler = (0, 1.0, 1.0, 1, 1, 0)
    vals = [r if r is not None else filler for r in rows]
    col = [np.array([v[q] for v in vals]) for q in range(6)]
    return ServerCells(
        mask=to_device(np.array([r is not None for r in rows])),
        count=to_device(col[0].astype(np.int32)),
        prefill_token_time=to_device(col[1].astype(float)),
        decode_token_time=to_device(col[2].astype(float)),
        decode_engines=to_device(col[3].astype(np.int32)),
        slots=to_device(col[4].astype(np.int32)),
        cache_sessions=to_device(col[5].astype(np.int32)),
    )


NO_SESSIONS = (0.0, 1.0, 1.0, 0.0, 0.0)
"""`Workload`'s session fields without sessions (fraction, length, think time, reuse, skew)."""


def proportional_routing(allowed, weights, xp=np):
    """$x_{ij} = w_j/\\sum_{l \\in C^+(i)} w_l$ on allowed arcs, 0 on rows without an arc;
    `xp` is `numpy` (parsing) or `jax.numpy` (inside the compiled loop)."""
    w = xp.where(allowed, weights[..., None, :], 0.0)
    tot = xp.sum(w, axis=-1, keepdims=True)
    return xp.where(tot > 0, w / xp.where(tot > 0, tot, 1.0), 0.0)


def weighted_random_routing(allowed, replicas) -> np.ndarray:
    """$x_{ij} = k_j/\\sum_{l \\in C^+(i)} k_l$ on allowed arcs (the `rand` policy)."""
    return proportional_routing(np.asarray(allowed, dtype=bool), np.asarray(replicas, dtype=float))
