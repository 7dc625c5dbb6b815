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
"""

from __future__ import annotations

import dataclasses
import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .. import _exported as exported
from .._aversion import ErrorAversion
from .._devices import compiler_options, per_device, shard_batch, solver_jit, uses_float32
from .._integrators import AbstractIntegrator, Accurate, Fast
from .._integrators.base import arc_integrals
from .._policies import AbstractPolicy, ErrorAverse, Observation, TickSetup, policy_from_name
from .._policies.base import tree_select
from .._precision import float_dtype
from .._progress import Progress
from .._results import RESULTS
from .._scenario import Scenario, replica_scale
from .batchlast import vmap_last
from .solution import Solution

__all__ = ["Accurate", "Fast", "SimState", "Totals", "simulate"]


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


class ArrivalWindow(eqx.Module):
    """The arrival and replica profiles as tick $k$ of one scenario needs them, in time
    relative to $t_k$ (theory/discretisation.md, *One arrival window*).

    **Fields:**
    - `times`, `rates`: `(n, W)` the `W` breakpoints of each arrival profile from the last
      one at or before $t_k - \\bar\\tau$ on (all of them when the profile has at most `W`).
    - `replica_times`: `(n, R)` the replica schedules' breakpoints.
    - `found`: `(n,)` how many breakpoints of each profile lie at or before
      $t_k - \\bar\\tau$ (the next tick's search starts there).

    Times are the breakpoints less $t_k$, the difference taken in float64 and rounded once
    to the run's dtype (`_local`). The loop carries the window: it is made at the end of
    tick $k - 1$ for tick $k$, so that a tick reads it as a small array instead of
    recomputing it inside every loop over arcs that uses it.
    """

    times: Float[Array, "n W"]
    rates: Float[Array, "n W"]
    replica_times: Float[Array, "n R"]
    found: Int[Array, " n"]

    def local(self, scn):
        """`scn` with its arrival and replica profiles replaced by this window: the
        scenario in time relative to $t_k$, as a tick or a record at tick $k$ reads it."""
        return dataclasses.replace(
            scn,
            arrival_times=self.times,
            arrival_rates=self.rates,
            replica_times=self.replica_times,
        )


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


def _scale_at(scn, t):
    """Replica fraction $c_j(t)$ of every cell; `t` broadcasts against the cell axis last."""
    return jax.vmap(replica_scale, in_axes=(0, 0, 0, -1), out_axes=-1)(
        scn.replica_times, scn.replica_counts, scn.replicas, t
    )


def _local(scn, t0):
    """The scenario with its clock started at `t0` (float64): every breakpoint time less
    `t0`, the difference taken in float64 and rounded once to the scenario's dtype, so
    that times near `t0` keep their full relative precision."""
    dtype = scn.arrival_times.dtype

    def shift(ts):
        return (ts.astype(jnp.float64) - t0).astype(dtype)

    return dataclasses.replace(
        scn, arrival_times=shift(scn.arrival_times), replica_times=shift(scn.replica_times)
    )


def _found(times, t_lo):
    """How many breakpoints of each profile (rows of `times`) lie at or before `t_lo`."""
    search = functools.partial(jnp.searchsorted, side="right", method="compare_all")
    return jax.vmap(lambda ts: search(ts.astype(t_lo.dtype), t_lo))(times).astype(jnp.int32)


def _cut(times, rates, found, width: int):
    """Each profile's `width` breakpoints from the last one at or before the time that
    `found` counted (`_found`), or from the last `width` ones."""
    start = jnp.clip(found - 1, 0, times.shape[-1] - width)
    cut = functools.partial(jax.lax.dynamic_slice_in_dim, slice_size=width)
    return jax.vmap(cut)(times, start), jax.vmap(cut)(rates, start)


def _arrival_window(full, setup: TickSetup, k, width: int, found=None) -> ArrivalWindow:
    """The `ArrivalWindow` of tick `k`: the breakpoints in $[t_k - \\bar\\tau, t_k + h]$
    and before, relative to $t_k$. `found` (that of tick `k - 1`) makes the search
    incremental: since $t_k - \\bar\\tau$ advances by $h$, fewer than `width` breakpoints
    are passed in one tick (`_window_width` counts those of a longer span), so `width`
    comparisons from the last position replace the search of the whole profile. (Only a
    trailing run of identical breakpoints, which `_window_width` counts once, can be passed
    faster than that; the window then lies inside the run, a constant rate, whatever its
    start.)"""
    tk64 = k.astype(jnp.float64) * setup.h.astype(jnp.float64)
    t_lo = tk64 - jnp.max(setup.tau).astype(jnp.float64)
    ts, rs = full.arrival_times, full.arrival_rates
    P = ts.shape[-1]
    if width >= P:
        found = jnp.zeros(ts.shape[:-1], jnp.int32)
    else:
        if found is None:
            found = _found(ts, t_lo)
        else:
            ahead = found[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
            seen = jnp.take_along_axis(ts, jnp.minimum(ahead, P - 1), axis=-1)
            passed = (seen.astype(jnp.float64) <= t_lo) & (ahead < P)
            found = found + jnp.sum(passed, axis=-1, dtype=jnp.int32)
        ts, rs = _cut(ts, rs, found, width)
    loc = _local(dataclasses.replace(full, arrival_times=ts, arrival_rates=rs), tk64)
    return ArrivalWindow(loc.arrival_times, rs, loc.replica_times, found)


def _window_width(times: np.ndarray, span: float, rates: np.ndarray | None = None) -> int:
    """Breakpoints a tick can touch: 2 + the most breakpoints of one profile in any
    half-open interval of length `span` (static, from the padded batch).

    A trailing run of identical breakpoints (padding to a common `P`, or a padded cell) is
    counted once: a window that ends inside such a run still ends on the profile's last
    breakpoint, so it stays exact.

    Host side, before tracing, for every profile of the batch at once: profiles are
    sorted, so the interval from $t_p$ holds $t_{p+d}$ for every $d$ up to the largest with
    $t_{p+d} \\le t_p + $ `span`; the loop over $d$ stops at the first $d$ that no profile
    reaches, after about as many passes as the width (10,000 App.-B profiles: 0.12 s one
    profile at a time, a few milliseconds here).
    """
    t = np.asarray(times, dtype=float).reshape(-1, times.shape[-1])
    r = t * 0 if rates is None else np.asarray(rates, dtype=float).reshape(t.shape)
    P = t.shape[-1]
    if P <= 4:
        return P
    same = (t[:, 1:] == t[:, -1:]) & (r[:, 1:] == r[:, -1:])
    keep = P - np.flip(same, axis=1).cumprod(axis=1).sum(axis=1)  # drop the trailing run
    end = t + span * (1 + 1e-9)
    most = 1
    for d in range(1, P):
        kept = np.arange(d, P) < keep[:, None]  # t_{p+d} is a kept breakpoint
        if not np.any(kept & (t[:, d:] <= end[:, :-d])):
            break
        most = d + 1
    return int(min(P, most + 2))


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
    # Replica changes take effect on the tick whose midpoint has passed them.
    c = _scale_at(loc, jnp.broadcast_to(0.5 * h, (n,)))
    out = integrator.tick(loc, setup, zero, state.N, xprev, xcur, c)
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
        scale=_scale_at(loc, h - tau) if full.replica_times.shape[-1] > 1 else None,
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


def _run_ticks(scn, setup, state, k0, k1, aux, *, policy, integrator, window):
    """Advance one scenario from tick `k0` to tick `k1` (dynamic bounds)."""
    tick = functools.partial(_tick, policy=policy, integrator=integrator, window=window)
    return jax.lax.fori_loop(k0, k1, lambda k, st: tick(scn, setup, st, k, aux), state)


def _record(scn, setup: TickSetup, state: SimState, k):
    """The saved state at tick `k`, including the mass in flight on the network."""
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
    return dict(
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


def _simulate_batch_sharded(scn, eta, h, save_ticks, **static):
    # Each device runs its shard on its own (`per_device`): the adaptive integrator's
    # step loops would otherwise all-reduce their batched conditions across devices at
    # every step.
    return per_device(functools.partial(_simulate_batch_impl, **static))(scn, eta, h, save_ticks)


# The compiled batch simulation, with the solvers' XLA options (`compiler_options`: on
# one CPU device a quarter to a third less time per call).
_simulate_batch = solver_jit(_simulate_batch_sharded, jit=eqx.filter_jit)


def _chunk_count(batch: int, chunk: int | None) -> int:
    """How many chunks `_chunked` runs a batch of `batch` scenarios in (1: whole)."""
    return 1 if chunk is None or chunk >= batch else -(-batch // chunk)


def _chunked(run, chunk: int | None):
    """`run(*batched)` (every argument and output with the batch axis first) applied to
    consecutive chunks of about `chunk` scenarios one after the other (`lax.map`), the last
    scenario repeated to fill the last chunk; `None` or a chunk as large as the batch: the
    whole batch at once.

    On a CPU a tick is a few hundred small vectorised operations: over the whole batch,
    each of them streams its operands through memory (a 10-cell float64 tick of 1,000
    scenarios holds about 1 MB per intermediate), over a chunk of a few dozen they stay in
    cache, and the chunk's state with them for all of its ticks (theory/discretisation.md,
    *The loop at the probe cadence*). A scenario's arithmetic is the same whatever chunk
    it is in."""

    def call(*args):
        B = jax.tree_util.tree_leaves(args)[0].shape[0]
        C = _chunk_count(B, chunk)
        if C == 1:
            return run(*args)
        size = -(-B // C)  # C chunks of equal size, fewer than C padded scenarios
        pad = C * size - B

        def split(a):
            if pad:
                a = jnp.concatenate([a, jnp.repeat(a[-1:], pad, axis=0)])
            return a.reshape((C, size) + a.shape[1:])

        out = jax.lax.map(lambda z: run(*z), jax.tree_util.tree_map(split, args))
        return jax.tree_util.tree_map(lambda a: a.reshape((C * size,) + a.shape[2:])[:B], out)

    return call


def _batch_last(tree):
    """Every leaf's leading (batch) axis moved last."""
    return jax.tree_util.tree_map(lambda a: jnp.moveaxis(a, 0, -1), tree)


def _batch_first(tree):
    """Every leaf's last (batch) axis moved first."""
    return jax.tree_util.tree_map(lambda a: jnp.moveaxis(a, -1, 0), tree)


def _simulate_batch_impl(
    scn,
    eta,
    h,
    save_ticks,
    *,
    policy,
    integrator,
    hist,
    progress,
    horizon,
    window,
    uniform,
    chunk=None,
    layout="batch-first",
):
    kw = dict(policy=policy, integrator=integrator, window=window)
    rec = jax.vmap(_record)
    last = uniform and layout == "batch-last"
    if uniform:
        # Every scenario has the same ticks: the tick loop runs outside the vmap on scalar
        # bounds. (With batched bounds, vmap turns the loop into one whose carry, ring
        # buffers included, is selected element by element on every pass.) Every scenario
        # also saves at the same tick: one ring slot per past tick for all.
        if last:
            # The batch axis last in the loop (`vmap_last`; theory/discretisation.md,
            # *Batch axis last*): the scenario, set-up, policy arrays and state move there
            # once per chunk, and only the records move back at every save. The
            # observations' finiteness is read from their ring slot: otherwise XLA
            # computes them again inside the check's reduction over cells, a strided loop
            # in this layout (App.-B, 10 cells, 2 devices: float32 1.94 -> 1.73 us per
            # scenario-tick, float64 3.16 -> 3.04; batch-first it costs float32 7%, so the
            # vmapped loop keeps the direct check).
            tick = vmap_last(
                functools.partial(_tick, slot=True, **kw), (True, True, True, False, True)
            )
            rec_at = vmap_last(_record, (True, True, True, False))
        else:
            tick = jax.vmap(functools.partial(_tick, **kw), in_axes=(0, 0, 0, None, 0))
            rec_at = jax.vmap(_record, in_axes=(0, 0, 0, None))

        def run(scn, setup, state, k0, k1, aux):
            return jax.lax.fori_loop(
                k0[0], k1[0], lambda k, st: tick(scn, setup, st, k, aux), state
            )

        def rec_loop(scn, setup, state, k):
            out = rec_at(scn, setup, state, k[0])
            return _batch_first(out) if last else out

    else:
        run = jax.vmap(lambda s, g, st, a, b, x: _run_ticks(s, g, st, a, b, x, **kw))
        rec_loop = rec

    def whole_run(scn, eta, h, save_ticks):
        # A chunk (or the whole share) from its set-up to its last save: its state stays
        # in one place (and layout) for the whole run, however often it saves.
        setup = jax.vmap(lambda s, e, hh: _setup(s, e, hh, hist))(scn, eta, h)
        aux = jax.vmap(lambda s, hh: policy.prepare(s, hh, horizon))(scn, h)
        init = functools.partial(_init_state, policy=policy, width=window)
        state0 = jax.vmap(init)(scn, setup, aux)
        first = rec(scn, setup, state0, save_ticks[:, 0])
        loop_in = _batch_last((scn, setup, aux, state0)) if last else (scn, setup, aux, state0)
        scn_l, setup_l, aux_l, state_l = loop_in

        def segment(state, ks):
            k0, k1 = ks
            state = run(scn_l, setup_l, state, k0, k1, aux_l)
            if progress is not None:
                jax.debug.callback(progress, jnp.max(k1), ordered=False)
            return state, rec_loop(scn_l, setup_l, state, k1)

        pairs = jnp.stack([save_ticks[:, :-1].T, save_ticks[:, 1:].T], axis=1)  # (S, 2, B)
        state, recs = jax.lax.scan(segment, state_l, pairs)
        if last:
            state = _batch_first(state)
        recs = jax.tree_util.tree_map(
            lambda a, b: jnp.concatenate([a[None], b]).swapaxes(0, 1), first, recs
        )
        return recs, state.status, state.change

    return _chunked(whole_run, chunk)(scn, eta, h, save_ticks)


LAYOUTS = ("batch-first", "batch-last")
"""The values of `simulate(layout=...)`."""

CPU_CHUNK = 32
"""Scenarios per chunk on a CPU from `CPU_CHUNK_MIN_CELLS` cells up (`default_chunk`)."""
CPU_CHUNK_MIN_CELLS = 4
CPU_CHUNK_BATCH_LAST = 128
"""Scenarios per chunk on a CPU with `layout="batch-last"`: the batch axis is the vector
axis there, and longer vectors pay until about this length (App.-B, 10 cells, float32, two
devices, 1,000 scenarios: 3.16, 2.71, 2.99 us per scenario-tick at 32, 128, 256)."""


LAST_MAX_CELLS = 16
"""The most cells for which `default_layout` puts a float32 batch's axis last."""
LAST_MIN_TICKS_PER_SAVE = 4
"""The fewest ticks per save interval for which `default_layout` puts the batch axis last."""


def default_layout(
    dtype, n_cells: int, share: int, integrator: AbstractIntegrator, ticks_per_save: int
) -> str:
    """The layout of `simulate(layout=None)`: `"batch-last"` for a float32 batch on a CPU
    with the `Fast` integrator, at most `LAST_MAX_CELLS` (16) cells, a device share of at
    least `CPU_CHUNK_BATCH_LAST` (128) scenarios and at least `LAST_MIN_TICKS_PER_SAVE` (4)
    ticks per save interval; `"batch-first"` otherwise.

    Measured on App.-B batches of 1,000, 5 ms, flow-grad, two CPU devices, microseconds per
    scenario-tick batch-first against batch-last: float32 0.28 / 0.23 at 2 cells, 0.80 /
    0.49 at 5, 2.23 / 1.65 at 10, 7.86 / 4.76 at 16, 11.5 / 12.7 at 20; float64 0.30 /
    0.25, 0.85 / 0.75, 3.05 / 3.08, 6.68 / 10.6, 14.7 / 25.3 (benchmarks/README.md, *Batch
    axis last*). So float64 stays batch-first, where it is never much slower; a smaller
    share leaves too few scenarios for the vector lanes; `Accurate` and accelerators are
    not measured batch-last. A save costs more batch-last: 10 cells, 1,000 scenarios, 400
    ticks, float32 batch-first against batch-last, 2.34 / 1.64 us per scenario-tick with 4
    saves, 2.60 / 1.85 with 20, 3.06 / 2.65 with 100 (4 ticks per save), 5.26 / 6.44 with
    400 (a save every tick)."""
    if (
        ticks_per_save >= LAST_MIN_TICKS_PER_SAVE
        and jax.default_backend() == "cpu"
        and jnp.dtype(dtype) == jnp.dtype(jnp.float32)
        and n_cells <= LAST_MAX_CELLS
        and share >= CPU_CHUNK_BATCH_LAST
        and isinstance(integrator, Fast)
    ):
        return "batch-last"
    return "batch-first"


def default_chunk(n_cells: int) -> int | None:
    """The scenarios a device advances together by default (`simulate(chunk=None)`).

    On a CPU, `CPU_CHUNK` (32) from `CPU_CHUNK_MIN_CELLS` (4) cells up, so that a tick's
    intermediates (a few hundred `(n, n)` and `(n,)` arrays per scenario) stay in the
    core's cache; below, the whole share (a 2-cell tick is small enough, and the chunks'
    loop would cost more than it saves). Measured on App.-B batches of 1,000 at 5 ms
    ticks, flow-grad, float64, microseconds per scenario-tick against the whole batch:
    2 cells 2.1 (chunks of 32), 1.7 (128), 1.5 (whole); 5 cells 6.3 (32), 7.6 (128), 8.1;
    10 cells 17.4 (16), 18.0 (32), 22.5 (64), 37.1; 20 cells 87.3 (16), 87.5 (32), 105
    (128), 151 (benchmarks/bench_simulate.py `--appb --chunks`). Elsewhere `None`: an
    accelerator wants the whole share in each operation."""
    if jax.default_backend() != "cpu" or n_cells < CPU_CHUNK_MIN_CELLS:
        return None
    return CPU_CHUNK


def _chosen_chunk(
    chunk: int | None, n_cells: int, share: int, layout: str = "batch-first"
) -> int | None:
    """`chunk` as given, else `default_chunk` for a device share of at least four such
    chunks (a smaller batch runs whole: the chunks' loop costs compile time, about 1.5 s
    at 10 cells, for a gain that only a large batch repays); with the batch axis last,
    `CPU_CHUNK_BATCH_LAST` on a CPU."""
    if chunk is not None:
        return chunk
    if layout == "batch-last":
        return CPU_CHUNK_BATCH_LAST if jax.default_backend() == "cpu" else None
    size = default_chunk(n_cells)
    return size if size is not None and share >= 4 * size else None


def _hist_len(tau_max_over_h: float) -> int:
    need = int(math.floor(tau_max_over_h + 1e-9)) + 2
    return 1 << max(need - 1, 1).bit_length()


MASS_BALANCE_ULPS = 64.0
"""A run's conservation residual may reach this many machine epsilons per tick (relative to
the requests it counts) before its status becomes `mass_balance` (`_mass_balance_status`)."""


def _mass_balance_status(rec, status, mask, ticks: int):
    """`mass_balance` for a run that succeeded but does not conserve requests beyond
    rounding: per cell, $N_j(T) - N_j(0) = A_j - S_j - D_j$ (arrivals, services and drops
    integrated over $[0, T]$), and over the network, requests that reached the routers
    equal those that reached a cell plus the change of those in flight.

    Both identities hold to rounding whatever the tick (each tick's totals are the
    integrals of the rates that moved $N$): measured $10^{-14}$ relative in float64 and
    $4\times10^{-7}$ in float32 over 1,000 ticks of every policy. The tolerance is
    `MASS_BALANCE_ULPS` epsilons of the run's dtype per tick, relative to the requests
    counted; beyond it something lost or created requests (an integrator that does not
    conserve them, an invalid state the other checks let through) and the numbers must
    not be labelled `success`."""
    N, a, d, dr = rec["N"], rec["arrivals"], rec["departures"], rec["drops"]
    src, fly = rec["source_arrivals"], rec["in_flight"]
    m = mask.astype(N.dtype)
    cell = jnp.abs((N[:, -1] - N[:, 0]) - (a[:, -1] - d[:, -1] - dr[:, -1])) * m
    net = jnp.abs(
        jnp.sum(src[:, -1] * m, -1) - jnp.sum(a[:, -1] * m, -1) - (fly[:, -1] - fly[:, 0])
    )
    scale = 1.0 + jnp.sum((jnp.abs(a[:, -1]) + jnp.abs(N[:, 0]) + jnp.abs(N[:, -1])) * m, -1)
    tol = MASS_BALANCE_ULPS * float(jnp.finfo(N.dtype).eps) * max(ticks, 1) * scale
    bad = (jnp.max(cell, -1) > tol) | (net > tol) | ~jnp.isfinite(net)
    return jnp.where((status == RESULTS.success) & bad, RESULTS.mass_balance, status)


def simulate(
    scenario: Scenario,
    policy: str | AbstractPolicy,
    *,
    step_size=1.0,
    tick=0.05,
    horizon: float = 50.0,
    n_save: int = 100,
    integrator: AbstractIntegrator = Fast(),
    progress: bool = False,
    throw: bool | None = None,
    dtype=None,
    error_aversion: ErrorAversion | None = None,
    chunk: int | None = None,
    layout: str | None = None,
) -> Solution:
    """Simulate the delayed fluid model under one routing policy, batched.

    $\\dot N_j = \\sum_i \\lambda_i(t-\\tau_{ij})x_{ij}(t-\\tau_{ij}) - \\mu_j(N_j)$, routers
    updating at every tick $t_k = kh$ from delayed observations (module docstring; seed
    §3.2, §4; theory/model.md).

    **Arguments:**
    - `scenario`: a `Scenario`, or a batch from `stack_scenarios` (leading axis `B`).
    - `policy`: a registered policy name (`"flow-grad"`, `"disc-lat"`, `"rand"`, ...) or an
      `AbstractPolicy`.
    - `step_size`: $\\eta$, broadcast against `(B, n)`: a scalar, `(n,)` per router, `(B, 1)`
      one per batch element (a step-size sweep), or `(B, n)`.
    - `tick`: the probe period $h$, a scalar or `(B,)`.
    - `horizon`: $T$; must be a whole number of ticks for every batch element.
    - `n_save`: number of save intervals; state is saved at ticks $\\lfloor sK/n_{save}\\rfloor$.
    - `integrator`: `Fast(substeps)` (default), `Accurate(rtol, atol)`, or any
      `AbstractIntegrator`.
    - `progress`: print a progress line on stderr.
    - `throw`: raise on a per-scenario failure; default True for one scenario, False for
      a batch (failures are then reported in `Solution.status`).
    - `dtype`: `jnp.float64` (default) or `jnp.float32` for throughput; either needs JAX's
      x64 mode (`dlbfluid.enable_x64`): the clock and the totals are float64 in both.
    - `error_aversion`: an `ErrorAversion` to let the roots shift traffic away from cells
      that drop requests (seed §3.4; cells drop only with a finite `Scenario.buffer`), or
      `None` (default) for none: the policy runs wrapped in `ErrorAverse`.
    - `chunk`: how many scenarios of a device's share advance through the ticks together
      (an integer >= 1), or `None` (default) for the backend's choice (`default_chunk`:
      on a CPU as many as keep a tick in cache, for a share of at least four chunks;
      elsewhere the whole share). It changes the
      speed only: a scenario's arithmetic does not depend on its chunk.
    - `layout`: where the batch axis lies in the tick loop: `"batch-first"` (`jax.vmap`),
      `"batch-last"` (`vmap_last`: every elementwise loop runs over the scenarios of a
      chunk, which fill the vector lanes; chunks of `CPU_CHUNK_BATCH_LAST` on a CPU), or
      `None` (default) for `default_layout`'s choice: batch-last for float32 on a CPU
      with `Fast`, up to 16 cells, from 128 scenarios per device and 4 ticks per save,
      where it runs 1.2-1.6x faster than batch-first; batch-first otherwise. The same
      arithmetic in either (N equal to rounding); speed only. Batches whose scenarios
      have different tick counts run batch-first.

    **Returns:** a `Solution`; unbatched when the inputs are.
    """
    pol = policy_from_name(policy) if isinstance(policy, str) else policy
    if not isinstance(pol, AbstractPolicy):
        raise ValueError(f"policy = {policy!r} is invalid: expected a policy name or object")
    if not isinstance(integrator, AbstractIntegrator):
        raise ValueError(f"integrator = {integrator!r} is invalid: expected Fast() or Accurate()")
    if error_aversion is not None and not isinstance(error_aversion, ErrorAversion):
        raise ValueError(
            f"error_aversion = {error_aversion!r} is invalid: expected an ErrorAversion or None"
        )
    if not integrator.supports_buffers and bool(np.any(np.isfinite(np.asarray(scenario.buffer)))):
        raise ValueError(
            f"integrator = {type(integrator).__name__}() is invalid for a scenario with finite "
            "buffers: the queue-overflow projection is implemented by the Fast integrator only"
        )
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
        raise ValueError(f"chunk = {chunk!r} is invalid: expected an integer >= 1 or None")
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"layout = {layout!r} is invalid: allowed {', '.join(LAYOUTS)} or None")
    dtype = float_dtype(dtype, "simulate")

    batched = len(scenario.batch_shape) > 0
    if len(scenario.batch_shape) > 1:
        raise ValueError(f"scenario batch shape {scenario.batch_shape}: expected at most one axis")
    n = scenario.n_cells
    eta = np.asarray(step_size, dtype=float)
    hs = np.asarray(tick, dtype=float)
    if hs.ndim > 1:
        raise ValueError(f"tick has shape {hs.shape}: expected a scalar or (B,)")
    if eta.ndim > 2 or (eta.ndim >= 1 and eta.shape[-1] not in (1, n)):
        raise ValueError(
            f"step_size has shape {eta.shape}: expected a scalar, (n,) = ({n},), (B, 1) or (B, {n})"
        )
    B = scenario.batch_shape[0] if batched else 1
    cands = (
        [B] + ([hs.shape[0]] if hs.ndim == 1 else []) + ([eta.shape[0]] if eta.ndim == 2 else [])
    )
    Bb = max(cands)
    for c in cands:
        if c not in (1, Bb):
            raise ValueError(
                f"batch sizes do not broadcast: scenario {B}, tick {hs.shape}, "
                f"step_size {eta.shape}"
            )
    was_batched = batched or Bb > 1 or hs.ndim == 1 or eta.ndim == 2
    eta_b = np.broadcast_to(eta, (Bb, n)).copy()
    h_b = np.broadcast_to(hs, (Bb,)).copy()
    if not np.all(np.isfinite(h_b)) or np.any(h_b <= 0):
        raise ValueError(f"tick = {tick!r} is invalid: expected finite values > 0")
    if not np.all(np.isfinite(eta_b)) or np.any(eta_b < 0):
        raise ValueError(f"step_size = {step_size!r} is invalid: expected finite values >= 0")
    T = float(horizon)
    if not math.isfinite(T) or T <= 0:
        raise ValueError(f"horizon = {horizon!r} is invalid: expected a finite number > 0")
    K = np.rint(T / h_b).astype(np.int64)
    if np.any(np.abs(K * h_b - T) > 1e-9 * max(T, 1.0)) or np.any(K < 1):
        bad = h_b[np.abs(K * h_b - T) > 1e-9 * max(T, 1.0)]
        raise ValueError(
            f"horizon = {T} is not a whole number of ticks for tick = {bad[:3]}: "
            "choose a horizon that is a multiple of every tick"
        )
    if not isinstance(n_save, int) or n_save < 1 or n_save > int(K.min()):
        raise ValueError(
            f"n_save = {n_save!r} is invalid: expected an integer in [1, "
            f"{int(K.min())}] (the number of ticks)"
        )
    save_ticks = (np.arange(n_save + 1)[None, :] * K[:, None]) // n_save

    scn = scenario.strip()
    if not batched:
        scn = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (Bb,) + a.shape), scn)
    elif B != Bb:
        scn = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (Bb,) + a.shape[1:]), scn)
    scn = jax.tree_util.tree_map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, scn
    )
    tau = np.where(np.asarray(scn.allowed), np.asarray(scn.latency), 0.0)
    hist = _hist_len(float((tau.reshape(Bb, -1).max(axis=1) / h_b).max()))
    window = _window_width(
        np.asarray(scn.arrival_times),
        float(tau.max() + 2.0 * h_b.max()),
        np.asarray(scn.arrival_rates),
    )

    # Shard the batch over every device; pad the batch to a multiple of the device count.
    ndev = jax.local_device_count()
    pad = (-Bb) % ndev
    args = (
        scn,
        jnp.asarray(eta_b, dtype),
        jnp.asarray(h_b, dtype),
        jnp.asarray(K),
        jnp.asarray(save_ticks),
    )
    if pad:
        args = jax.tree_util.tree_map(
            lambda a: jnp.concatenate([a, jnp.repeat(a[-1:], pad, axis=0)]), args
        )
    args = shard_batch(args)
    integrator = integrator.for_batch(scn, float(h_b.max())).prepared(dtype)
    looped = pol if error_aversion is None else ErrorAverse(pol, error_aversion)
    share = (Bb + pad) // ndev
    uniform = bool(np.all(save_ticks == save_ticks[:1]))
    if layout is None:
        layout = default_layout(dtype, n, share, integrator, int(K.min()) // n_save)
    if not uniform:
        layout = "batch-first"  # per-scenario tick counts: the vmapped loop's batched bounds
    chunk = _chosen_chunk(chunk, n, share, layout)
    # (the progress callback runs once per save interval of every chunk on every device)
    chunks = _chunk_count(share, chunk)
    prog = Progress("simulating", n_save * chunks * ndev) if progress else None
    scn_a, eta_a, h_a, _, st_a = args
    static = dict(
        hist=hist,
        uniform=uniform,
        progress=prog,
        # Only a policy that precomputes a schedule depends on the horizon at trace time.
        horizon=T if looped.uses_horizon else None,
        window=window,
        chunk=chunk,
        layout=layout,
    )
    # The policy's and integrator's arrays are arguments, the rest of them static (as
    # `filter_jit` splits them), so that the command line can keep the traced program
    # (`_exported`; not with a progress callback, which cannot be exported).
    dyn, fixed = eqx.partition((looped, integrator), eqx.is_array)

    def run(jit):
        def f(scn, eta, h, st, dyn):
            pol, integ = eqx.combine(dyn, fixed)
            return jit(scn, eta, h, st, policy=pol, integrator=integ, **static)

        return f

    run_args = (scn_a, eta_a, h_a, st_a, dyn)
    if prog is None:
        rec, status, change = exported.call(
            "simulate",
            run(_simulate_batch),
            run_args,
            (fixed, static),
            trace=run(_simulate_batch_sharded),
            compiler_options=compiler_options(uses_float32(run_args)),
        )
    else:
        rec, status, change = run(_simulate_batch)(*run_args)
    if pad:
        rec, status, change = jax.tree_util.tree_map(lambda a: a[:Bb], (rec, status, change))
    status = _mass_balance_status(rec, status, jnp.asarray(scn.cell_mask[:Bb]), int(K.max()))
    sol = Solution(
        t=rec["t"],
        N=rec["N"],
        x=rec["x"],
        arrivals=rec["arrivals"],
        departures=rec["departures"],
        source_arrivals=rec["source_arrivals"],
        workload_integral=rec["workload_integral"],
        network_integral=rec["network_integral"],
        drops=rec["drops"],
        in_flight=rec["in_flight"],
        status=status,
        final_change=change,
        cell_mask=jnp.asarray(scn.cell_mask[:Bb]),
        tick=jnp.asarray(h_b),
        policy=pol.name,
        cell_names=tuple(scenario.cell_names) if not batched else (),
    )
    if throw is None:
        throw = not was_batched
    if throw:
        sol.raise_for_status()
    if not was_batched:
        sol = jax.tree_util.tree_map(lambda a: a[0], sol)
    return sol
