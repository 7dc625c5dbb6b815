"""`Accurate`: adaptive diffrax Tsit5 across each tick (theory/discretisation.md)."""

from __future__ import annotations

import math
from typing import ClassVar

import diffrax as dfx
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._results import RESULTS
from .._runtime.eager import to_device
from .base import AbstractIntegrator, TickResult


class Accurate(AbstractIntegrator):
    """Adaptive Tsit5 with a PID step-size controller (diffrax), restarted at every tick and
    stepping exactly onto every inflow discontinuity (`jump_ts`); observations come from
    `SaveAt(ts=...)` at the observation offsets. Finite queues are not implemented (their
    projection onto $N \\le B$ is a non-smooth event)."""

    rtol: float = 1e-8
    atol: float = 1e-10
    max_steps: int = 4096
    supports_buffers: ClassVar[bool] = False

    def __check_init__(self):
        for f in ("rtol", "atol"):
            v = getattr(self, f)
            if isinstance(v, jax.Array):
                continue  # the traced copy made by `prepared`
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{f} = {v!r} is invalid: expected a finite number > 0")

    def prepared(self, dtype):
        # Tolerances travel as arrays so that a tolerance sweep reuses one compilation
        # (converted on the host: `jnp.asarray(v, dtype)` compiles a conversion).
        tol = [to_device(np.asarray(v, dtype)) for v in (self.rtol, self.atol)]
        return eqx.tree_at(lambda a: (a.rtol, a.atol), self, tuple(tol))

    def tick(self, scn, setup, tk, N, xprev, xcur, c, speed) -> TickResult:
        """One tick, one cell at a time.

        Given the routing history the cells are decoupled: cell $j$ sees only the $n$ inflow
        jumps $t_k + r_{ij}$ of its own in-arcs and is observed at the $n$ offsets
        $h - r_{ij}$. Solving each cell separately (vmapped) keeps every solve's jump and save
        lists of length $n$ instead of $n^2$.
        """
        tau, r, offsets, h = setup.tau, setup.r, setup.offsets, setup.h
        times, rates = scn.arrival_times, scn.arrival_rates
        rate_fn = jax.vmap(jnp.interp, in_axes=(0, 0, 0))

        def one_cell(N_j, tau_j, r_j, xp_j, xc_j, off_j, sv_j, c_j, v_j):
            cell = jax.tree_util.tree_map(lambda a: a[None], sv_j)

            def field(t, y, args):
                lam = rate_fn(t - tau_j, times, rates)  # (n,) over sources
                inflow = jnp.sum(lam * jnp.where(t - tk < r_j, xp_j, xc_j))
                out = v_j * c_j * cell.rate(y[0][None] / c_j)[0]
                return (inflow - out, out, inflow, y[0])

            jumps = tk + r_j
            if times.shape[-1] > 1:
                jumps = jnp.concatenate([jumps, (times + tau_j[:, None]).reshape(-1)])
            order = jnp.argsort(off_j)
            ts = tk + jnp.concatenate([off_j[order], h[None]])
            zero = jnp.zeros((), N_j.dtype)
            sol = dfx.diffeqsolve(
                dfx.ODETerm(field),
                dfx.Tsit5(),
                t0=tk,
                t1=tk + h,
                dt0=None,
                y0=(N_j, zero, zero, zero),
                saveat=dfx.SaveAt(ts=ts),
                stepsize_controller=dfx.PIDController(
                    rtol=self.rtol, atol=self.atol, jump_ts=jumps
                ),
                max_steps=self.max_steps,
                throw=False,
            )
            Ns = sol.ys[0]
            obs_j = Ns[:-1][jnp.argsort(order)]  # N_j at offset h - r_ij, for every router i
            ok = sol.result == dfx.RESULTS.successful
            return Ns[-1], obs_j, sol.ys[2][-1], sol.ys[1][-1], sol.ys[3][-1], ok

        N1, obs_t, arr, dep, q, ok = jax.vmap(one_cell, in_axes=(0, 1, 1, 1, 1, 1, 0, 0, 0))(
            N, tau, r, xprev, xcur, offsets, scn.service, c, speed
        )
        status = jnp.where(jnp.all(ok), RESULTS.success, RESULTS.solver_failed)
        return TickResult(
            N=N1,
            observed=obs_t.T,
            arrivals=arr,
            departures=dep,
            workload_integral=jnp.sum(q),
            drops=jnp.zeros_like(N1),
            status=status,
        )
