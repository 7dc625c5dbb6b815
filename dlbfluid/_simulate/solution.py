"""The result of `simulate`: saved trajectories, cumulative integrals and a status."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from .._results import RESULTS, raise_for_status, status_names, view

STATUS = view("success", "nonfinite", "solver_failed", "negative_workload", "mass_balance")
"""The `RESULTS` codes a simulation can end with."""


class SimulationError(RuntimeError):
    """A scenario of a `throw=True` simulation failed numerically."""


class Solution(eqx.Module):
    """Saved trajectories of `simulate` (batched: a leading axis `B` on every array).

    **Fields** (`S+1` save points, `n` cells):
    - `t`: `(S+1,)` save times (ticks); `N`: `(S+1, n)` workloads; `x`: `(S+1, n, n)` the
      routing in force from that time on.
    - `arrivals`, `departures`: `(S+1, n)` cumulative inflow into, and service out of, each
      cell since $t=0$; `source_arrivals`: `(S+1, n)` cumulative arrivals at the root
      routers of each cell.
    - `workload_integral`: $\\int_0^t \\sum_j N_j$; `network_integral`:
      $\\int_0^t \\sum_{ij} 2\\tau_{ij}\\lambda_i x_{ij}$; `in_flight`: the request mass on the
      network at $t$ (sent, not yet arrived).
    - `drops`: `(S+1, n)` cumulative flow dropped by each cell's full queue (errors).
    - `status`: per-scenario code (`STATUS`); `final_change`: the largest change of $N$ or
      $x$ over the last tick.
    """

    t: Float[Array, "... S"]
    N: Float[Array, "... S n"]
    x: Float[Array, "... S n n"]
    arrivals: Float[Array, "... S n"]
    departures: Float[Array, "... S n"]
    source_arrivals: Float[Array, "... S n"]
    workload_integral: Float[Array, "... S"]
    network_integral: Float[Array, "... S"]
    drops: Float[Array, "... S n"]
    in_flight: Float[Array, "... S"]
    status: Int[Array, "..."]
    final_change: Float[Array, "..."]
    cell_mask: Bool[Array, "... n"]
    tick: Float[Array, "..."]
    policy: str = eqx.field(static=True, default="")
    cell_names: tuple[str, ...] = eqx.field(static=True, default=())

    @property
    def n_save(self) -> int:
        return self.t.shape[-1] - 1

    def _start(self, window: float) -> int:
        if not (0.0 < window <= 1.0):
            raise ValueError(f"window = {window!r} is invalid: expected a fraction in (0, 1]")
        return int(round((1.0 - window) * self.n_save))

    def mean_latency(self, window: float = 0.5):
        """Mean end-to-end latency of the requests served over the last `window` fraction
        of the horizon, by Little's law:
        $\\int \\sum_j N_j\\,dt \\,/\\, (\\int\\sum_i\\lambda_i\\,dt - D)
        + \\int \\sum_{ij} 2\\tau_{ij}\\lambda_i x_{ij}\\,dt \\,/\\, \\int \\sum_i \\lambda_i\\,dt$,
        with $D$ the dropped flow (theory/model.md, *Latency*; without drops this is
        $[\\int \\sum_j N_j + \\int \\sum_{ij} 2\\tau_{ij}\\lambda_i x_{ij}]/\\int\\sum_i\\lambda_i$)."""
        s0 = self._start(window)
        work = self.workload_integral[..., -1] - self.workload_integral[..., s0]
        net = self.network_integral[..., -1] - self.network_integral[..., s0]
        den = jnp.sum(self.source_arrivals[..., -1, :] - self.source_arrivals[..., s0, :], -1)
        dropped = jnp.sum(self.drops[..., -1, :] - self.drops[..., s0, :], -1)
        return work / (den - dropped) + net / den

    def error_rate(self, window: float = 1.0):
        """Fraction of the requests that arrived at the root routers over the last
        `window` fraction of the horizon that were dropped by full queues."""
        s0 = self._start(window)
        den = jnp.sum(self.source_arrivals[..., -1, :] - self.source_arrivals[..., s0, :], -1)
        dropped = jnp.sum(self.drops[..., -1, :] - self.drops[..., s0, :], -1)
        return dropped / den

    def throughput(self, window: float = 0.5):
        """Per-cell service throughput $\\frac{1}{|W|}\\int_W \\mu_j(N_j)\\,dt$ (requests/s)."""
        s0 = self._start(window)
        dt = self.t[..., -1] - self.t[..., s0]
        return (self.departures[..., -1, :] - self.departures[..., s0, :]) / dt[..., None]

    def oscillation(self, window: float = 0.25):
        """Largest peak-to-peak swing of any $N_j$ over the saves in the last `window`."""
        s0 = self._start(window)
        seg = self.N[..., s0:, :]
        return jnp.max(jnp.max(seg, axis=-2) - jnp.min(seg, axis=-2), axis=-1)

    def status_names(self) -> np.ndarray:
        """Per-scenario status names (`RESULTS`)."""
        return status_names(self.status)

    def raise_for_status(self) -> None:
        """Raise `SimulationError` if any scenario did not end with `success`."""
        raise_for_status(self.status, SimulationError)

    def summary(self, window: float = 0.5) -> dict:
        """The JSON contract of `dlbfluid simulate --json` (one unbatched solution)."""
        if self.status.ndim != 0:
            raise ValueError("summary() needs an unbatched Solution; index it first")
        n = int(np.asarray(self.cell_mask).sum())
        return {
            "policy": self.policy,
            "horizon": float(self.t[-1]),
            "tick": float(self.tick),
            "mean_latency": float(self.mean_latency(window)),
            "error_rate": float(self.error_rate(window)),
            "window": float(window),
            "throughput": np.asarray(self.throughput(window))[:n].tolist(),
            "final": {
                "N": np.asarray(self.N[-1])[:n].tolist(),
                "x": np.asarray(self.x[-1])[:n, :n].tolist(),
            },
            "final_change": float(self.final_change),
            "oscillation": float(self.oscillation()),
            "status": RESULTS.name(int(self.status)),
            "cells": list(self.cell_names),
        }

    def to_numpy(self) -> dict:
        """Every array field as numpy (for `np.savez`)."""
        out = {}
        for f in (
            "t",
            "N",
            "x",
            "arrivals",
            "departures",
            "source_arrivals",
            "workload_integral",
            "network_integral",
            "drops",
            "in_flight",
            "status",
            "final_change",
            "cell_mask",
            "tick",
        ):
            out[f] = np.asarray(getattr(self, f))
        return out
