"""The result of `simulate_requests`: per scenario and trial statistics and a status."""

from __future__ import annotations

import dataclasses
import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from .._results import RESULTS, raise_for_status, status_names
from .._runtime.eager import eager_jit
from .admission import OVERFLOW_CALENDAR
from .estimation import EstimationReport
from .histogram import LatencyHistogram
from .loop import NONFINITE_ROUTING, OVERFLOW_ARCS, OVERFLOW_CELLS, OVERFLOW_EVENTS


@functools.partial(eager_jit, static_argnums=0)
def _percentile(bins: LatencyHistogram, counts, q):
    """`bins.percentile(counts, q)` as one program per shape (`q` traced) with the eager
    numbers (`eager_jit`), for the host-side statistics."""
    return bins.percentile(counts, q)


class RequestSimulationError(RuntimeError):
    """A scenario of a `throw=True` request-level simulation failed."""


class RequestSolution(eqx.Module):
    """Statistics of `simulate_requests`, per scenario (`B`) and trial (`R`): arrays have
    leading axes `(B, R)` (`(R,)` for one scenario). Statistics count the window
    $[t_w, T]$ after the `warmup` $t_w$; latencies are end-to-end, $2\\tau_{ij}$ plus the
    sojourn in the cell, of the requests that completed in the window.

    **Fields:**
    - `t`: `(S+1,)` save times; `count`: `(..., S+1, n)` requests present in each cell
      there (divide by `scale` for the fluid's units: `density`); `received`: `(..., S+1, n)`
      the requests delivered to each cell by each save time (admitted or rejected; its
      differences are the traffic each cell got per save interval: `traffic_share`).
    - `served`: completions; `latency_sum`, `latency_sq`: sums of their latencies and
      squares (exact); `histogram`: `(..., bins + 2)` their log-spaced latency histogram
      (`LatencyHistogram`: percentiles within `histogram_bins.resolution` relative).
    - `arrivals`, `drops`: `(..., n)` requests that arrived at each root router, and that
      each cell rejected (full buffer or overflow).
    - `mean_requests`, `utilisation`: `(..., n)` time averages of each cell's request
      count and utilisation over the window.
    - `final_x`: `(..., n, n)` the routing at $T$.
    - `status`: `RESULTS` code per scenario and trial (`REQUEST_STATUS`); `overflow`:
      which fixed-size array overflowed (bits: 1 cell slots or server queues, 2 arcs,
      4 events of a tick, 8 far completions of `servers` cells), and bit 16 a router's
      routing that was not finite (status `nonfinite`: `loop.NONFINITE_ROUTING`).
    - `events`: event-loop iterations; `scale`: `(B,)` the scale $k$; `window`: $T - t_w$.
    - `estimation`: with online estimation, the cells' latency models at the horizon
      (`EstimationReport`: published parameters, window samples, age); None for the oracle.
    - `cache_hit_rate`, `busiest_server_share`, `session_move_rate`: with sessions
      (`affinity`), the share of the requests admitted in the window whose session prefix
      was in their server's cache, the largest share that one server admitted, and the
      share of the window's session requests with a cell to return to that were routed to
      another cell; None without sessions.
    """

    t: Float[Array, " S"]
    count: Int[Array, "... S n"]
    received: Int[Array, "... S n"]
    served: Int[Array, "..."]
    latency_sum: Float[Array, "..."]
    latency_sq: Float[Array, "..."]
    histogram: Int[Array, "... bins"]
    arrivals: Int[Array, "... n"]
    drops: Int[Array, "... n"]
    mean_requests: Float[Array, "... n"]
    utilisation: Float[Array, "... n"]
    final_x: Float[Array, "... n n"]
    status: Int[Array, "..."]
    overflow: Int[Array, "..."]
    events: Int[Array, "..."]
    scale: Float[Array, "..."]
    cell_mask: Bool[Array, "... n"]
    window: float = eqx.field(static=True)
    histogram_bins: LatencyHistogram = eqx.field(static=True)
    policy: str = eqx.field(static=True, default="")
    service: str = eqx.field(static=True, default="markov")
    estimation: EstimationReport | None = None
    cache_hit_rate: Float[Array, "..."] | None = None
    busiest_server_share: Float[Array, "..."] | None = None
    session_move_rate: Float[Array, "..."] | None = None

    def scenario(self, b: int) -> RequestSolution:
        """The trials of scenario `b` of a batched solution."""
        if self.status.ndim != 2:
            raise ValueError("scenario() needs a batched solution (axes scenarios x trials)")
        fields = [f.name for f in dataclasses.fields(self) if f.name != "t"]
        arrays = {f: getattr(self, f) for f in fields if isinstance(getattr(self, f), jax.Array)}
        est = self.estimation
        if est is not None:
            est = jax.tree_util.tree_map(lambda a: a[b], est)
        return dataclasses.replace(self, **{f: a[b] for f, a in arrays.items()}, estimation=est)

    def density(self):
        """Saved counts divided by the scale $k$: $N^k/k$, the fluid's units."""
        k = jnp.reshape(self.scale, self.scale.shape + (1,) * (self.count.ndim - self.scale.ndim))
        return self.count / k

    def traffic_share(self):
        """`(..., S, n)` each cell's share of the requests delivered in each save interval
        ($\\Delta$`received` over its sum across the cells; NaN for an interval without
        deliveries), as a numpy array."""
        d = np.diff(np.asarray(self.received), axis=-2).astype(float)
        total = d.sum(axis=-1, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(total > 0, d / total, np.nan)

    @eager_jit
    def mean_latency(self):
        """Mean end-to-end latency of the served requests (exact), per trial."""
        return self.latency_sum / jnp.maximum(self.served, 1)

    @eager_jit
    def latency_std(self):
        """Standard deviation of the served requests' latencies, per trial."""
        m = self.mean_latency()
        var = self.latency_sq / jnp.maximum(self.served, 1) - m * m
        return jnp.sqrt(jnp.maximum(var, 0.0))

    def percentile(self, q: float):
        """The `q`-quantile ($0<q<1$) of the served requests' latencies per trial, from the
        histogram (relative error below `histogram_bins.resolution`)."""
        if not (isinstance(q, (int, float)) and 0.0 < q < 1.0):
            raise ValueError(f"q = {q!r} is invalid: expected a number in (0, 1)")
        return _percentile(self.histogram_bins, self.histogram, float(q))

    @eager_jit
    def error_rate(self):
        """Rejected requests over requests arrived at the root routers, per trial."""
        return jnp.sum(self.drops, -1) / jnp.maximum(jnp.sum(self.arrivals, -1), 1)

    def status_names(self) -> np.ndarray:
        """Per-scenario-and-trial status names (`RESULTS`)."""
        return status_names(self.status)

    def raise_for_status(self) -> None:
        """Raise `RequestSimulationError` if any scenario or trial did not succeed."""
        ov = np.asarray(self.overflow).reshape(-1)

        def details(bad):
            parts = []
            if np.any(ov[bad] & OVERFLOW_CELLS):
                parts.append("cell slots full: increase `slots` (or `queue` for servers)")
            if np.any(ov[bad] & OVERFLOW_ARCS):
                parts.append("an arc's requests in flight exceeded `arc_slots`: increase it")
            if np.any(ov[bad] & OVERFLOW_EVENTS):
                parts.append("a tick had more events than `events`: increase it")
            if np.any(ov[bad] & NONFINITE_ROUTING):
                parts.append("a router's routing was not finite (a NaN or infinite cost)")
            if np.any(ov[bad] & OVERFLOW_CALENDAR):
                parts.append(
                    "a cell held more completions beyond the count calendar than its far list "
                    "(servers cells): lengthen the tick or shorten the queues (`slots`)"
                )
            return "; " + "; ".join(parts) if parts else ""

        raise_for_status(
            np.asarray(self.status).reshape(-1),
            RequestSimulationError,
            details=details,
            # (the twin's overflow: no adaptive solver is involved)
            messages={RESULTS.solver_failed: "a fixed-size array overflowed (named above)"},
        )

    def summary(self) -> dict:
        """JSON-shaped statistics of one scenario (index a batch first), pooled over its
        trials: latency mean (over all served requests), p50/p90/p99 (of the pooled
        histogram), their 90% intervals from the trials, error rate, served count and
        per-cell means (theory/requests.md, *Outputs*); with sessions, the trials' mean
        `cache_hit_rate`, `busiest_server_share` and `session_move_rate`."""
        if self.status.ndim != 1:
            raise ValueError("summary() needs the trials of one scenario; index the batch")
        R = self.status.shape[0]
        n = int(np.asarray(self.cell_mask).reshape(-1, self.cell_mask.shape[-1])[0].sum())
        pooled = jnp.sum(self.histogram, 0)
        served = int(jnp.sum(self.served))
        mean = float(jnp.sum(self.latency_sum)) / max(served, 1)
        per_mean = np.asarray(self.mean_latency())
        per_p90 = np.asarray(self.percentile(0.9))

        def ci(v):
            if R < 2:
                return None
            return 1.6448536269514722 * float(np.std(v, ddof=1)) / math.sqrt(R)

        stat = np.asarray(self.status)
        worst = int(stat[stat != RESULTS.success][0]) if np.any(stat != RESULTS.success) else 0
        return {
            "status": RESULTS.name(worst),
            "trials": R,
            "latency": {
                "mean": mean,
                **{
                    f"p{int(q * 100)}": float(_percentile(self.histogram_bins, pooled, q))
                    for q in (0.5, 0.9, 0.99)
                },
            },
            "latency_ci90": {"mean": ci(per_mean), "p90": ci(per_p90)},
            "error_rate": float(jnp.sum(self.drops)) / max(float(jnp.sum(self.arrivals)), 1.0),
            "served": served,
            "cells": [
                {
                    "mean_requests": float(np.mean(np.asarray(self.mean_requests)[:, j])),
                    "utilisation": float(np.mean(np.asarray(self.utilisation)[:, j])),
                }
                for j in range(n)
            ],
            **(
                {}
                if self.estimation is None
                else {"estimation": {"cells": self.estimation.cells(n)}}
            ),
            **(
                {}
                if self.cache_hit_rate is None or self.busiest_server_share is None
                else {
                    "cache_hit_rate": float(np.mean(np.asarray(self.cache_hit_rate))),
                    "busiest_server_share": float(np.mean(np.asarray(self.busiest_server_share))),
                    "session_move_rate": float(np.mean(np.asarray(self.session_move_rate))),
                }
            ),
        }
