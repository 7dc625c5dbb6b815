"""The delayed fluid model on a probe tick, integrated by a method of steps.

The model (theory/model.md, theory/discretisation.md):

* routing is piecewise constant on the tick grid $t_k = kh$: $x(t) = x^k$ on
  $[t_k, t_{k+1})$, and $x(t) = x^0$ for $t < 0$;
* at $t_{k+1}$ router $i$ observes $N_j(t_{k+1} - \\tau_{ij})$ and sets
  $x_i^{k+1}$ (the policy, `dlbfluid._policies`);
* $\\dot N_j(t) = \\sum_i \\lambda_i(t-\\tau_{ij})\\, x_{ij}(t-\\tau_{ij}) - \\mu_j(N_j(t))$,
  $N(t) = N(0)$ for $t < 0$.

With $\\tau_{ij} = m_{ij}h + r_{ij}$, $0 \\le r_{ij} < h$, the inflow of arc $(i,j)$ during
tick $k$ is $x^{k-m_{ij}-1}_{ij}$ before $t_k + r_{ij}$ and $x^{k-m_{ij}}_{ij}$ after, and the
observation at $t_{k+1}$ is $N_j$ at offset $h - r_{ij}$ inside tick $k - m_{ij}$. So each tick
is an ODE with a known, piecewise-constant input: the method of steps needs only ring
buffers of past routings and of the workloads at those offsets (`SimState`). The tick
itself is the integrator's (`dlbfluid._integrators`: `Fast`, `Accurate`).

This module is the loop of one scenario: its state (`SimState`), the state at $t = 0$
(`_init_state`), one tick (`_tick`) and the saved quantities at a tick (`_record`).
`Simulator` (`single.py`) offers them as `init`, `step` and `record`; `simulate` vmaps
them over a batch (`strategy.py`).
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._integrators.base import arc_integrals
from .._policies import AbstractPolicy, Observation, TickSetup
from .._policies.base import (
    observed_fractions,
    observed_slowdown,
    replica_fractions,
    slowdown_factors,
    tree_select,
)
from .._results import RESULTS
from .window import ArrivalWindow, _arrival_window

__all__ = ["SavePoint", "SimState", "Totals"]


class Totals(eqx.Module):
    """Cumulative quantities of one scenario since $t = 0$.

    **Fields:** `arrivals`, `departures`, `source_arrivals`, `drops` (`(n,)`: inflow into,
    service out of, arrivals at the root routers of, and flow dropped by each cell);
    `workload_integral` $\\int_0^t\\sum_jN_j$; `network_integral`
    $\\int_0^t\\sum_{ij}2\\tau_{ij}\\lambda_ix_{ij}$. Always float64: a float32 sum of
    $10^5$ equal increments drifts by $10^{-3}$ relative (every addition rounds the same
    way); the record rounds them once to the run's dtype.
    """

    arrivals: Float[Array, " n"]
    departures: Float[Array, " n"]
    source_arrivals: Float[Array, " n"]
    workload_integral: Float[Array, ""]
    network_integral: Float[Array, ""]
    drops: Float[Array, " n"]


class SimState(eqx.Module):
    """The loop state of one scenario at the start of tick $k$.

    **Attributes:**
    - `N`: `(n,)` workloads $N(t_k)$.
    - `x`: `(n, n)` the routing $x^k$ in force from $t_k$ (the last one sent).
    - `x_ring`: `(hist, n, n)` the routings sent, $x^q$ at slot $q \\bmod$ `hist`.
    - `obs_ring`: `(hist, n, n)` the observations made inside tick $q$,
      $N_j(t_q + h - r_{ij})$ at slot $q \\bmod$ `hist`.
    - `totals`: the cumulative `Totals`.
    - `policy_state`: the policy's own state (`AbstractPolicy.init_state`).
    - `status`: a `RESULTS` code; a failed scenario freezes at its last good state.
    - `change`: the largest change of $N$ or $x$ over the last tick.
    - `window`: the `ArrivalWindow` of tick $k$.
    """

    N: Float[Array, " n"]
    x: Float[Array, "n n"]
    x_ring: Float[Array, "hist n n"]
    obs_ring: Float[Array, "hist n n"]
    totals: Totals
    policy_state: object
    status: Int[Array, ""]
    change: Float[Array, ""]
    window: ArrivalWindow


class SavePoint(eqx.Module):
    """What a save records of one scenario at tick $k$ (`Simulator.record`; a `Solution`
    holds these along its save axis).

    **Fields:** `t` $= kh$; `N` `(n,)`; `x` `(n, n)` the routing in force from $t$ on;
    `arrivals`, `departures`, `source_arrivals`, `drops` `(n,)` and `workload_integral`,
    `network_integral` (the `Totals`, rounded to the run's dtype); `in_flight` the request
    mass on the network at $t$, $\\sum_{ij}\\int_{t-\\tau_{ij}}^{t}\\lambda_i(s)x_{ij}(s)\\,ds$.
    """

    t: Float[Array, ""]
    N: Float[Array, " n"]
    x: Float[Array, "n n"]
    arrivals: Float[Array, " n"]
    departures: Float[Array, " n"]
    source_arrivals: Float[Array, " n"]
    workload_integral: Float[Array, ""]
    network_integral: Float[Array, ""]
    drops: Float[Array, " n"]
    in_flight: Float[Array, ""]


# ----------------------------------------------------------------------------------------
# One scenario (vmapped over the batch)
# ----------------------------------------------------------------------------------------


def _setup(scn, eta, h, hist: int) -> TickSetup:
    dtype = scn.latency.dtype
    tau = jnp.where(scn.allowed, scn.latency, 0.0)
    m = jnp.floor(tau / h + 1e-9).astype(jnp.int32)
    r = jnp.maximum(tau - m.astype(dtype) * h, 0.0)
    offsets = h - r
    return TickSetup(
        tau=tau,
        m=m,
        r=r,
        offsets=offsets,
        step=(eta * h).astype(dtype),
        h=h,
        hist=hist,
    )


def _init_state(scn, setup: TickSetup, aux, *, policy: AbstractPolicy, width: int) -> SimState:
    """The state at $t = 0$: constant histories $N(0)$ and $x^0$; the arrival window of
    tick 0 (`width` breakpoints, `_window_width`)."""
    n = scn.n_cells
    hist = setup.hist
    dtype = scn.latency.dtype
    x0 = policy.initial_routing(scn, aux).astype(dtype)
    N0 = scn.initial_workload.astype(dtype)
    z64 = jnp.zeros(n, jnp.float64)
    totals = Totals(z64, z64, z64, jnp.zeros((), jnp.float64), jnp.zeros((), jnp.float64), z64)
    return SimState(
        N=N0,
        x=x0,
        x_ring=jnp.broadcast_to(x0, (hist, n, n)),
        obs_ring=jnp.broadcast_to(N0[None, :], (hist, n, n)),
        totals=totals,
        policy_state=policy.init_state(scn, setup, aux, x0),
        status=jnp.asarray(RESULTS.success),
        change=jnp.asarray(jnp.inf, dtype),
        window=_arrival_window(scn, setup, jnp.zeros((), jnp.int32), width),
    )


def _hist_len(tau_max_over_h: float) -> int:
    """Slots of the routing and observation rings: a power of two (so that `& (hist - 1)`
    is the slot) above $\\lfloor\\bar\\tau/h\\rfloor + 1$, the ticks a delayed read reaches
    back (host side, static)."""
    need = int(math.floor(tau_max_over_h + 1e-9)) + 2
    return 1 << max(need - 1, 1).bit_length()


def _tick(
    full, setup: TickSetup, state: SimState, k, aux, *, policy, integrator, window, slot=False
):
    """One tick of one scenario: integrate $[t_k, t_{k+1}]$, then let the routers update.
    `slot`: check the observations for finiteness where they were written into their ring
    (the batch-last loop), not as the integrator returned them."""
    n = full.n_cells
    dtype = full.latency.dtype
    h, hist, tau, m = setup.h, setup.hist, setup.tau, setup.m
    wrap = hist - 1  # (hist is a power of two: `& wrap` is `% hist`, negatives included)
    I, J = jnp.meshgrid(jnp.arange(n), jnp.arange(n), indexing="ij")
    # Time in float64 whatever the dtype, and inside the tick relative to t_k (`_local`):
    # in float32, t_k = k h itself is off by up to half a spacing (6e-5 s at 600 s), and so
    # would be the length of every tick's arrival integral, with the same sign for long runs.
    tk64 = k.astype(jnp.float64) * h.astype(jnp.float64)
    # Only the breakpoints in [t_k - max tau, t_k + h] matter inside this tick: the window
    # that the last tick made (`ArrivalWindow`).
    win = state.window
    loc = win.local(full)
    zero = jnp.zeros((), dtype)
    # The routing ring is read here (both delayed routings in one gather) and written once
    # below; the routing in force is carried in the state.
    back = jnp.arange(2, dtype=m.dtype)[:, None, None]
    xprev, xcur = state.x_ring[(k - m[None] - back) & wrap, I[None], J[None]][::-1]
    x_k = state.x
    # Replica and service changes take effect on the tick whose midpoint has passed them.
    c = replica_fractions(loc, 0.5 * h)
    speed = 1.0 / slowdown_factors(loc, 0.5 * h)
    out = integrator.tick(loc, setup, zero, state.N, xprev, xcur, c, speed)
    lam_tick = arc_integrals(loc, jnp.zeros((n, 1), dtype), jnp.full((n, 1), h))[:, 0]
    d_net = jnp.sum(2.0 * tau * x_k * lam_tick[:, None])
    # Router update at t_{k+1} from N_j(t_{k+1} - tau_ij) = the observation of tick k - m_ij:
    # this tick's observations go into the ring first (a failed scenario's as 0), so that one
    # gather reads them all, this tick's own for the arcs with m_ij = 0.
    alive = state.status == RESULTS.success
    obs_ring = state.obs_ring.at[k & wrap].set(jnp.where(alive, out.observed, 0.0))
    t_next = (tk64 + h.astype(jnp.float64)).astype(dtype)
    obs = Observation(
        k=k,
        t=t_next,
        workload=obs_ring[(k - m) & wrap, I, J],
        scale=observed_fractions(loc, h - tau),
        slowdown=observed_slowdown(loc, h - tau),
        drops=out.drops,
        arrivals=out.arrivals,
    )
    x_next, pstate = policy.update(full, setup, state.policy_state, obs, aux)
    t = state.totals
    totals = Totals(
        arrivals=t.arrivals + out.arrivals,
        departures=t.departures + out.departures,
        source_arrivals=t.source_arrivals + lam_tick,
        workload_integral=t.workload_integral + out.workload_integral,
        network_integral=t.network_integral + d_net,
        drops=t.drops + out.drops,
    )
    finite = (
        jnp.all(jnp.isfinite(out.N))
        & jnp.all(jnp.isfinite(x_next))
        & jnp.all(jnp.isfinite(obs_ring[k & wrap] if slot else out.observed))
    )
    # A workload below zero beyond rounding: the tick was integrated too coarsely.
    negative = jnp.min(out.N) < -1e-12 * (1.0 + jnp.max(jnp.abs(out.N)))
    step_status = jnp.where(negative, RESULTS.negative_workload, out.status)
    status = jnp.where(alive, jnp.where(finite, step_status, RESULTS.nonfinite), state.status)
    # A failed scenario freezes at its last good state instead of spreading NaNs.
    keep = alive & finite & (step_status == RESULTS.success)
    change = jnp.maximum(jnp.max(jnp.abs(out.N - state.N)), jnp.max(jnp.abs(x_next - x_k)))
    # The rings change in one slot each (a select over whole rings would cost hist times
    # more than the tick's own writes); a frozen scenario keeps sending its last routing.
    N, x, totals, pstate, change = tree_select(
        keep,
        (out.N, x_next, totals, pstate, change),
        (state.N, x_k, state.totals, state.policy_state, state.change),
    )
    x_ring = state.x_ring.at[(k + 1) & wrap].set(x)
    win = _arrival_window(full, setup, k + 1, window, win.found)
    return SimState(N, x, x_ring, obs_ring, totals, pstate, status, change, win)


def _record(scn, setup: TickSetup, state: SimState, k) -> SavePoint:
    """The `SavePoint` of tick `k`, including the mass in flight on the network."""
    hist, h = setup.hist, setup.h
    dtype = scn.latency.dtype
    tau = setup.tau
    t64 = k.astype(jnp.float64) * h.astype(jnp.float64)
    t = t64.astype(dtype)
    # F(t_k) = sum_ij int_{t_k - tau_ij}^{t_k} lambda_i(s) x_ij(s) ds over the past ticks,
    # in time relative to t_k (see `_tick`). The tick s ticks back, [-s h, (1 - s) h],
    # lies wholly inside arc ij's delay when s h <= tau_ij: its integral is the source's
    # alone, one per source and tick; the one tick with (s - 1) h < tau_ij < s h counts
    # from -tau_ij, one integral per arc.
    n_back = hist - 1
    back = (jnp.arange(n_back) + 1).astype(dtype)[:, None, None]  # ticks before t_k
    xq = state.x_ring[(k - 1 - jnp.arange(n_back)) & (hist - 1)]  # (hist - 1, n, n)
    # The state's arrival window is that of tick k, relative to t_k, and covers
    # [t_k - max tau, t_k + h]: the integrals need [t_k - max tau, t_k].
    loc = state.window.local(scn)
    n = tau.shape[-1]
    whole = back * h <= tau[None]
    lam = arc_integrals(
        loc,
        jnp.broadcast_to(-back * h, (n_back, n, 1)),
        jnp.broadcast_to((1.0 - back) * h, (n_back, n, 1)),
    )
    part = ((back - 1.0) * h < tau[None]) & jnp.logical_not(whole)
    x_part = jnp.sum(jnp.where(part, xq, 0.0), axis=0)
    hi_part = jnp.sum(jnp.where(part, (1.0 - back) * h, 0.0), axis=0)
    lo_part = jnp.where(jnp.any(part, axis=0), -tau, 0.0)
    flight = jnp.sum(jnp.where(whole, xq, 0.0) * lam) + jnp.sum(
        x_part * arc_integrals(loc, lo_part, jnp.maximum(hi_part, lo_part))
    )
    tot = jax.tree_util.tree_map(lambda a: a.astype(dtype), state.totals)
    return SavePoint(
        t=t,
        N=state.N,
        x=state.x,
        arrivals=tot.arrivals,
        departures=tot.departures,
        source_arrivals=tot.source_arrivals,
        workload_integral=tot.workload_integral,
        network_integral=tot.network_integral,
        drops=tot.drops,
        in_flight=flight,
    )
