"""The event loop of one scenario and one trial (theory/requests.md, *Algorithm*).

Time is cut at the probe ticks $t_k = kh$. Inside a tick, `lax.while_loop` draws events
one at a time, exactly:

* the *random* events, arrivals at the root routers and completions in the cells, by
  competing exponentials: with the state fixed between events, the total rate is
  $R = \\sum_i k\\bar\\lambda_i + \\sum_j r_j$ ($\\bar\\lambda_i$ the profile's maximum, $r_j$
  the cell's completion rate); the next candidate comes after an $\\mathrm{Exp}(R)$ time,
  is a completion at $j$ with probability $r_j/R$, and an arrival at $i$ with
  probability $k\\bar\\lambda_i/R$, accepted with probability $\\lambda_i(t)/\\bar\\lambda_i$
  (thinning: the accepted arrivals are Poisson of rate $k\\lambda_i(t)$);
* the *deterministic* events: a request routed on arc $(i,j)$ reaches cell $j$ exactly
  $\\tau_{ij}$ after its arrival (per-arc FIFO rings, in order since $\\tau_{ij}$ is fixed),
  a cell's internal event (`AbstractCells.next_time`: the end of a prefill or a decode
  in the App.-B servers), and the tick's end.

The earliest wins; a random candidate beyond a deterministic event is discarded and
redrawn (memorylessness makes this exact). Router $i$'s probe of cell $j$ for the update
at $t_u$ is the request count at $t_u - \\tau_{ij}$, taken when the loop passes that time
(before the event there is applied), as the fluid simulator observes $N_j$
(`dlbfluid._simulate`). At the tick's end every router updates its routing with the
policy object itself (`AbstractPolicy.update`), from the probed counts divided by $k$.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, Int

from .._policies import AbstractPolicy, Observation, TickSetup
from .._policies.base import (
    observed_fractions,
    observed_slowdown,
    replica_fractions,
    slowdown_factors,
)
from .._scenario import Scenario
from .._scenario.arrivals import rate_at
from .cells import AbstractCells
from .histogram import LatencyHistogram

OVERFLOW_CELLS = 1
"""Overflow bit: a cell's slots (or a server's queue) were full when a request arrived."""
OVERFLOW_ARCS = 2
"""Overflow bit: an arc's ring of requests in flight was full."""
OVERFLOW_EVENTS = 4
"""Overflow bit: a tick had more events than its block of random numbers (`events`)."""
NONFINITE_ROUTING = 16
"""Flag bit of `overflow`: a router's routing was not finite (a NaN or infinite cost, an
update that diverged). A request routed by such a row would go to an arbitrary cell, so
the trial's status is `nonfinite` (`simulate._status`), never `success`."""


def routing_flag(x):
    """`NONFINITE_ROUTING` where the routing `x` `(n, n)` has a non-finite entry, else 0."""
    return jnp.where(jnp.all(jnp.isfinite(x)), 0, NONFINITE_ROUTING).astype(jnp.int32)


class Stats(eqx.Module):
    """What a trial accumulates over the statistics window $[t_w, T]$ (`warmup` $t_w$).

    **Fields:** `served` completions; `latency_sum`, `latency_sq` the sums of their
    end-to-end latencies and squares; `histogram` `(bins + 2,)` their latency histogram;
    `arrivals` `(n,)` requests arrived at each root router; `drops` `(n,)` requests
    rejected by each cell (full buffer, or an overflow); `area`, `busy` `(n,)` the time
    integrals of each cell's request count and utilisation; `received` `(n,)` the requests
    delivered to each cell since $t = 0$ (admitted or rejected; not windowed: the traffic
    each cell got, saved at the save times as `RequestSolution.received`).
    """

    served: Int[Array, ""]
    latency_sum: Float[Array, ""]
    latency_sq: Float[Array, ""]
    histogram: Int[Array, " bins"]
    arrivals: Int[Array, " n"]
    drops: Int[Array, " n"]
    area: Float[Array, " n"]
    busy: Float[Array, " n"]
    received: Int[Array, " n"]


class LoopState(eqx.Module):
    """The state of one trial, grouped by role.

    **Clock:** `t`, the time of the last event; `key`, the trial's PRNG key; `uniforms`
    `(E, 5)` the current tick's block of uniforms, one row per event, `used` rows so far.
    **Cells:** `cells`, the cell kind's state (`AbstractCells`).
    **Network:** `fifo` `(n, n, F)` arrival times at the root of the requests in flight on
    each arc, a ring from `head` `(n, n)` of length `size` `(n, n)`; `due` `(n, n)` the
    delivery time of each ring's head, its arrival at the root plus $\\tau_{ij}$ ($+\\infty$
    for an empty ring; a copy, so that an event reads no ring to find the next delivery).
    **Routers:** `x` `(n, n)` the routing in force, `xc` its cumulative sums over the
    allowed arcs (`_cum_routing`); `policy_state`; `obs_ring` `(hist, n, n)` probed
    counts$/k$ by the update index they serve; `probes` `(n, n)` the current tick's probes
    indexed `[cell, router]`, `last` `(n,)` the local time up to which each cell's probes
    are taken (each arc probes once a tick, `_probe`; they enter the ring at the tick's
    end); `tick_arrivals`, `tick_drops` `(n,)` the
    current tick's admissions and rejections per cell (divided by $k$ they are the
    fluid's `Observation.arrivals`/`drops`, read by error aversion).
    **Outputs:** `stats` (`Stats`), `overflow` (bits `OVERFLOW_CELLS | OVERFLOW_ARCS`),
    `events` (loop iterations). `buffer` `(n,)` the buffers in force in the current tick,
    $\\lfloor kc_jB_j\\rfloor$ at its replica fractions $c_j$ (`_draw`).
    """

    t: Float[Array, ""]
    key: Array
    uniforms: Float[Array, "E 5"]
    used: Int[Array, ""]
    cells: object
    fifo: Float[Array, "n n F"]
    head: Int[Array, "n n"]
    size: Int[Array, "n n"]
    due: Float[Array, "n n"]
    x: Float[Array, "n n"]
    xc: Float[Array, "n n"]
    policy_state: object
    obs_ring: Float[Array, "hist n n"]
    probes: Float[Array, "n n"]
    last: Float[Array, " n"]
    tick_arrivals: Int[Array, " n"]
    tick_drops: Int[Array, " n"]
    stats: Stats
    overflow: Int[Array, ""]
    events: Int[Array, ""]
    buffer: Float[Array, " n"]


class Trial(eqx.Module):
    """Everything a trial's loop reads and never changes (one scenario at scale $k$).

    **Fields:** `scn` the scenario; `setup` the routers' `TickSetup` (delays, ticks, steps);
    `aux` the policy's precomputed arrays; `policy`; `cells` the cell kind; `scale` $k$;
    `lam_max` `(n,)` each profile's maximum rate, `lam_cum` `(n,)` the cumulative sums of
    $k\\bar\\lambda_i$ (the arrival candidates' inverse CDF); `buffer` `(n,)` the cells' buffers at
    scale $k$, $\\lfloor kB_j\\rfloor$ requests ($+\\infty$ for none); `warmup` $t_w$;
    `arc_slots` (static) $F$; `events` (static) $E$, the events a tick may hold (rows of
    its block of uniforms); `histogram` the latency bins; `smoothing` (static) the probes'
    smoothing time constant $T_s$ (s; 0: none, `smooth_probes`).
    """

    scn: Scenario
    setup: TickSetup
    aux: object
    # (policies hold no arrays: static, as under `simulate`'s jit)
    policy: AbstractPolicy = eqx.field(static=True)
    cells: AbstractCells
    scale: Float[Array, ""]
    lam_max: Float[Array, " n"]
    lam_cum: Float[Array, " n"]
    buffer: Float[Array, " n"]
    warmup: Float[Array, ""]
    arc_slots: int = eqx.field(static=True)
    events: int = eqx.field(static=True)
    histogram: LatencyHistogram = eqx.field(static=True)
    smoothing: float = eqx.field(static=True, default=0.0)


def init_state(tr: Trial, key) -> LoopState:
    """The state at $t = 0$: $\\mathrm{round}(kN_j(0))$ requests of origin 0 in each cell,
    no request in flight, the routing $x^0$ and the probe history $N(0)$."""
    scn, setup = tr.scn, tr.setup
    n, dtype = scn.n_cells, scn.latency.dtype
    counts = jnp.round(tr.scale * scn.initial_workload).astype(jnp.int32)
    counts = jnp.where(scn.cell_mask, counts, 0)
    # (the cells' own key: the loop's stream of uniforms stays that of `key`)
    cells, over = tr.cells.init(counts, dtype, jr.fold_in(key, 1))
    x0 = tr.policy.initial_routing(scn, tr.aux).astype(dtype)
    seen = counts.astype(dtype) / tr.scale
    zi = jnp.zeros(n, jnp.int32)
    zf = jnp.zeros(n, dtype)
    stats = Stats(
        served=jnp.zeros((), jnp.int32),
        latency_sum=jnp.zeros((), dtype),
        latency_sq=jnp.zeros((), dtype),
        histogram=jnp.zeros(tr.histogram.bins + 2, jnp.int32),
        arrivals=zi,
        drops=zi,
        area=zf,
        busy=zf,
        received=zi,
    )
    return LoopState(
        t=jnp.zeros((), dtype),
        key=key,
        uniforms=jnp.zeros((tr.events, 5), dtype),
        used=jnp.zeros((), jnp.int32),
        cells=cells,
        fifo=jnp.zeros((n, n, tr.arc_slots), dtype),
        head=jnp.zeros((n, n), jnp.int32),
        size=jnp.zeros((n, n), jnp.int32),
        due=jnp.full((n, n), jnp.inf, dtype),
        x=x0,
        xc=_cum_routing(scn, x0),
        policy_state=tr.policy.init_state(scn, setup, tr.aux, x0),
        # Tick k's probe of arc (i, j) serves update k + m_ij + 1: updates 1..m_ij see N(0).
        obs_ring=jnp.broadcast_to(seen[None, None, :], (setup.hist, n, n)),
        probes=jnp.zeros((n, n), dtype),
        last=jnp.full(n, -1.0, dtype),
        tick_arrivals=zi,
        tick_drops=zi,
        stats=stats,
        overflow=jnp.where(over, OVERFLOW_CELLS, 0).astype(jnp.int32),
        events=jnp.zeros((), jnp.int32),
        buffer=tr.buffer,
    )


def _cum_routing(scn: Scenario, x):
    """`(n, n)` each router's cumulative routing over the allowed arcs (its inverse CDF is
    the destination of a request): fixed between two updates, so computed once a tick."""
    return jnp.cumsum(jnp.where(scn.allowed, jnp.maximum(x, 0.0), 0.0), axis=-1)


def _first_min(v):
    """`(min, index)` of the first minimum of a flat array: two plain reductions, which
    vectorise (a variadic `argmin` reduction does not, and it cost a third of an event)."""
    m = jnp.min(v)
    return m, jnp.min(jnp.where(v == m, jnp.arange(v.shape[0]), v.shape[0] - 1))


class _When(eqx.Module):
    """The next event of a trial (`_when`): its time `t`, `stop` at the tick's end, its
    kind (`is_del` a delivery, `is_int` a cell's internal event, `is_arr` an arrival
    candidate, `is_cmp` a random completion), the root `i`, completing cell `j_out`,
    and the arc `(i_d, j_d)` whose head is delivered."""

    t: Array
    stop: Array
    is_del: Array
    is_int: Array
    is_arr: Array
    is_cmp: Array
    i: Array
    j_out: Array
    i_d: Array
    j_d: Array


def _when(tr: Trial, st: LoopState, u, t_end) -> _When:
    """Competing exponentials against the deterministic events (module docstring)."""
    n = tr.scn.n_cells
    comp = tr.cells.rates(st.cells)
    lam_total = tr.lam_cum[-1]
    total = lam_total + jnp.sum(comp)
    gap = -jnp.log1p(-u[0]) / total
    t_rand = jnp.where(total > 0, st.t + gap, jnp.inf)
    t_del, a = _first_min(st.due.reshape(-1))
    # A cell's deterministic internal event (App.-B servers; +inf for the other kinds).
    t_cell, jn = _first_min(tr.cells.next_time(st.cells))
    t_ev = jnp.minimum(jnp.minimum(t_rand, t_del), t_cell)
    stop = t_ev >= t_end
    is_del = ~stop & (t_del <= t_rand) & (t_del <= t_cell)
    is_int = ~stop & ~is_del & (t_cell <= t_rand)
    is_rnd = ~stop & ~is_del & ~is_int
    # The candidate's kind: the inverse CDF of the rates (k lam_max, then completions) at
    # u[1] total; the cumulative completion rates by a product with a triangular matrix.
    v = u[1] * total
    is_arr = is_rnd & (v < lam_total)
    cum = comp @ jnp.triu(jnp.ones((n, n), comp.dtype))
    jc = jnp.minimum(jnp.sum(cum <= v - lam_total), n - 1)
    return _When(
        t=jnp.where(stop, t_end, t_ev),
        stop=stop,
        is_del=is_del,
        is_int=is_int,
        is_arr=is_arr,
        is_cmp=is_rnd & ~is_arr,
        i=jnp.minimum(jnp.sum(tr.lam_cum <= v), n - 1),
        j_out=jnp.where(is_int, jn, jc),
        i_d=a // n,
        j_d=a % n,
    )


def _arrival(tr: Trial, st: LoopState, ev: _When, u):
    """`(accept, ja)`: an arrival candidate at root `i` kept with probability
    $\\lambda_i(t)/\\bar\\lambda_i$ (thinning), routed to `ja` by the inverse CDF of $x_i$."""
    scn, n, i = tr.scn, tr.scn.n_cells, ev.i
    lam_i = rate_at(scn.arrival_times[i], scn.arrival_rates[i], ev.t)
    accept = ev.is_arr & (u[2] * tr.lam_max[i] < lam_i)
    cx = st.xc[i]
    ja = jnp.minimum(jnp.sum(cx <= u[3] * cx[-1]), n - 1)
    return accept, ja


def _network(tr: Trial, st: LoopState, ev: _When, i, ja, push):
    """`(fifo, head, size, due, arc_full)`: push a request routed at `ev.t` on arc
    `(i, ja)`, or pop the head of arc `(i_d, j_d)` for a delivery (an event does one or
    neither). Every write is a one-element scatter (an index past the array drops it);
    the ring's one read, the next head, comes after the push so that the writes stay in
    place."""
    n, F = tr.scn.n_cells, tr.arc_slots
    slot_len = st.size[i, ja]
    arc_full = push & (slot_len >= F)
    do_push = push & ~arc_full
    slot = jnp.where(do_push, (st.head[i, ja] + slot_len) % F, F)  # past the ring: dropped
    fifo = st.fifo.at[i, ja, slot].set(ev.t, mode="drop")
    i_d, j_d = ev.i_d, ev.j_d
    nxt = (st.head[i_d, j_d] + 1) % F
    following = fifo[i_d, j_d, nxt]
    # The one arc this event changes (the push's or the pop's).
    ii = jnp.where(do_push, i, jnp.where(ev.is_del, i_d, n))  # n: no arc, dropped
    jj = jnp.where(do_push, ja, j_d)
    delta = do_push.astype(jnp.int32) - ev.is_del.astype(jnp.int32)
    size = st.size.at[ii, jj].add(delta, mode="drop")
    head = st.head.at[jnp.where(ev.is_del, i_d, n), j_d].set(nxt, mode="drop")
    left = st.size[i_d, j_d] - 1
    tau = tr.setup.tau[jnp.minimum(ii, n - 1), jj]
    new_due = jnp.where(do_push, ev.t, jnp.where(left > 0, following, jnp.inf)) + tau
    write = (do_push & (slot_len == 0)) | ev.is_del
    due = st.due.at[jnp.where(write, ii, n), jj].set(new_due, mode="drop")
    return fifo, head, size, due, arc_full


def _probe(tr: Trial, st: LoopState, c, count_c, local, ok):
    """Take the probes of cell `c` due by the tick's local time `local`, from its count
    `count_c` before the event: arc $(i, c)$ probes once a tick at offset $h - r_{ic}$
    (`TickSetup.offsets`; it serves the update $m_{ic} + 1$ ticks later). A cell's count
    is constant between the events that touch it, so its probes are taken only there,
    $O(n)$ per event (those left at the tick's end by `_update`): every probe at an offset
    in `(last[c], local]` reads `count_c`. `probes` is `(n, n)` indexed `[cell, router]`."""
    offsets = tr.setup.offsets[:, c]
    take = ok & (offsets > st.last[c]) & (offsets <= local)
    row = jnp.where(take, count_c.astype(st.probes.dtype) / tr.scale, st.probes[c])
    probes = st.probes.at[c].set(row)
    last = st.last.at[c].set(jnp.where(ok, local, st.last[c]))
    return probes, last


def _stats(tr: Trial, st: LoopState, ev: _When, count, dt, latency, left, accept, lost):
    """The statistics after the event (`Stats`): integrals over `dt` before it, the
    served request's latency, the arrival and the rejection."""
    n, dtype, s = tr.scn.n_cells, st.x.dtype, st.stats
    win = ev.t >= tr.warmup
    served = left & win
    return Stats(
        served=s.served + served.astype(jnp.int32),
        latency_sum=s.latency_sum + jnp.where(served, latency, 0.0),
        latency_sq=s.latency_sq + jnp.where(served, latency * latency, 0.0),
        histogram=s.histogram.at[tr.histogram.index(latency)].add(served.astype(jnp.int32)),
        arrivals=s.arrivals + (_onehot(ev.i, n) & accept & win).astype(jnp.int32),
        drops=s.drops + (lost & win).astype(jnp.int32),
        area=s.area + count.astype(dtype) * dt,
        busy=s.busy + tr.cells.utilisation(st.cells) * dt,
        received=s.received,
    )


def _onehot(j, n: int):
    return jnp.arange(n) == j


def _event(tr: Trial, k, t_end, st: LoopState):
    """One event of tick `k` (or the tick's end, then `running` is False): when and what
    (`_when`), the arrival's thinning and routing (`_arrival`), the cells' completion and
    admission (`AbstractCells`), the arcs (`_network`), the probes (`_probe`), the
    statistics (`_stats`)."""
    n, setup = tr.scn.n_cells, tr.setup
    u = st.uniforms[jnp.minimum(st.used, tr.events - 1)]
    ev = _when(tr, st, u, t_end)
    # Integrals over [t, t_new] (the part inside the statistics window), before the event.
    dt = jnp.maximum(ev.t - jnp.maximum(st.t, tr.warmup), 0.0)
    count = tr.cells.count(st.cells)

    accept, ja = _arrival(tr, st, ev, u)
    tau_a = setup.tau[ev.i, ja]
    direct = accept & (tau_a <= 0)
    admit = direct | ev.is_del
    j_in = jnp.where(ev.is_del, ev.j_d, ja)
    # The head's origin: its arrival at the root (due - tau) less tau.
    origin = jnp.where(ev.is_del, st.due[ev.i_d, ev.j_d] - 2 * setup.tau[ev.i_d, ev.j_d], ev.t)
    reject = admit & (count[j_in].astype(st.x.dtype) >= st.buffer[j_in])
    # An event admits or completes, never both; completing first lets every read of the
    # cells' arrays come before any write, so that the writes stay in place in the loop.
    do_cmp = ev.is_cmp | ev.is_int
    cells, leaving, left = tr.cells.complete(st.cells, ev.j_out, u[4], ev.t, do_cmp)
    cells, over_cell = tr.cells.admit(cells, j_in, origin, ev.t, admit & ~reject)
    fifo, head, size, due, arc_full = _network(tr, st, ev, ev.i, ja, accept & (tau_a > 0))
    c = jnp.where(admit, j_in, ev.j_out)
    probes, last = _probe(tr, st, c, count[c], ev.t - k * setup.h, ~ev.stop)

    lost = reject | over_cell
    into = _onehot(j_in, n)
    stats = _stats(tr, st, ev, count, dt, ev.t - leaving, left, accept, into & (lost | arc_full))
    exhausted = ~ev.stop & (st.used >= tr.events)
    overflow = (
        st.overflow
        | jnp.where(exhausted, OVERFLOW_EVENTS, 0).astype(jnp.int32)
        | jnp.where(over_cell, OVERFLOW_CELLS, 0).astype(jnp.int32)
        | jnp.where(arc_full, OVERFLOW_ARCS, 0).astype(jnp.int32)
    )
    step = (~ev.stop).astype(jnp.int32)
    new = dataclasses.replace(
        st,
        t=ev.t,
        used=st.used + step,
        cells=cells,
        fifo=fifo,
        due=due,
        head=head,
        size=size,
        probes=probes,
        last=last,
        tick_arrivals=st.tick_arrivals + (into & admit).astype(jnp.int32),
        tick_drops=st.tick_drops + (into & lost).astype(jnp.int32),
        stats=stats,
        overflow=overflow,
        events=st.events + step,
    )
    return new, ~ev.stop


def run_tick(tr: Trial, k, st: LoopState, running):
    """Tick `k` of a batch of trials: `tr` with axes `(B,)` and `st` with axes `(B, R)`.

    The events up to $t_{k+1}$ run in one `lax.while_loop` over the whole batch, as long
    as any trial still has an event before $t_{k+1}$: the predicate is not batched, so the
    loop carries no per-trial selection of the whole state (a trial that has reached
    $t_{k+1}$ stays there, its `_event` a no-op but for its key). Then every router
    updates its routing by the policy at $t_{k+1}$, from the counts probed for update
    $k + 1$ (divided by $k$ = `scale`). `running` is a `(B, R)` array of True.
    """
    h = tr.setup.h  # (B,), all equal
    t_end = (k + 1).astype(h.dtype) * h[0]
    event = _batched(lambda t, s: _event(t, k, t_end, s))
    st = _batched(_draw)(tr, st)

    def body(carry):
        return event(tr, carry[0])

    st, _ = jax.lax.while_loop(lambda c: jnp.any(c[1]), body, (st, running))
    return _batched(lambda t, s: _update(t, k, t_end, s))(tr, st)


def _draw(tr: Trial, st: LoopState) -> LoopState:
    """A fresh block of uniforms for the tick's events (drawn at once: one call of the
    generator per tick instead of one per event), and the cells' refresh
    (`AbstractCells.refresh`): their own block, and the tick's replica fractions
    $c_j$ = `replica_fractions` and service speeds $1/s_j$ (`slowdown_factors`) at the tick's
    midpoint (as the fluid simulator reads them, so that a change on the tick grid takes
    effect exactly at its time) with the buffers
    $\\lfloor kc_jB_j\\rfloor$; the requests a cell drops there count as the tick's drops."""
    key, sub = jr.split(st.key)
    u = jr.uniform(sub, (tr.events, 5), st.uniforms.dtype)
    t_mid = st.t + 0.5 * tr.setup.h
    frac, buffer = tick_capacity(tr.scn, tr.scale, t_mid, st.x.dtype)
    speed = (1.0 / slowdown_factors(tr.scn, t_mid)).astype(st.x.dtype)
    cells, dropped = tr.cells.refresh(st.cells, frac, speed, buffer)
    dropped = dropped.astype(jnp.int32)
    win = (st.t >= tr.warmup).astype(jnp.int32)
    stats = dataclasses.replace(st.stats, drops=st.stats.drops + win * dropped)
    return dataclasses.replace(
        st,
        key=key,
        uniforms=u,
        used=jnp.zeros_like(st.used),
        cells=cells,
        buffer=buffer,
        stats=stats,
        tick_drops=st.tick_drops + dropped,
    )


def tick_capacity(scn: Scenario, scale, t_mid, dtype):
    """`(frac, buffer)` `(n,)`: the replica fractions $c_j$ at the tick's midpoint `t_mid`
    (1 for a padded cell or a cell at 0) and the buffers $\\lfloor kc_jB_j\\rfloor$
    ($+\\infty$ for none). One reading for both kinds of cell."""
    frac = replica_fractions(scn, t_mid)
    frac = jnp.where(scn.cell_mask & (frac > 0), frac, 1.0).astype(dtype)
    b = jnp.floor(scale * frac * scn.buffer)
    return frac, jnp.where(jnp.isfinite(scn.buffer), b, jnp.inf).astype(dtype)


def route(tr, policy_state, obs_ring, probes, k, t_end, tick_drops, tick_arrivals, estimate=None):
    """Every router's update at $t_{k+1}$ = `t_end` (`AbstractPolicy.update`) from the
    tick's probes `(n, n)` $[i, j]$ (in workload units), written into the ring of the update
    they serve, with the replica fractions observed $\\tau_{ij}$ late when the scenario
    has a schedule. `tr`: a `Trial` or an admission `Lane` (the fields both hold).
    `estimate`: the routers' service model when estimated online (`dlbfluid._requests.
    estimation`; the routers then see no service schedule, only the fit); None: the
    scenario's. Returns `(x, xc, policy_state, obs_ring)`."""
    setup, scn = tr.setup, tr.scn
    if estimate is not None:
        scn = dataclasses.replace(scn, estimate=estimate)
    dtype = probes.dtype
    n = scn.n_cells
    rows = jnp.broadcast_to(jnp.arange(n)[:, None], (n, n))
    cols = jnp.broadcast_to(jnp.arange(n)[None, :], (n, n))
    if tr.smoothing > 0:
        # arc (i, j)'s previous (smoothed) probe is the one the last tick wrote
        prev = obs_ring[(k + setup.m) & (setup.hist - 1), rows, cols]
        probes = smooth_probes(prev, probes, setup.h, tr.smoothing)
    ring = obs_ring.at[(k + setup.m + 1) & (setup.hist - 1), rows, cols].set(probes)
    obs = Observation(
        k=k,
        t=t_end,
        workload=ring[(k + 1) & (setup.hist - 1)],
        # The observed replica fractions c_j(t_{k+1} - tau_ij) and slowdowns, as the fluid's
        # routers see them (`dlbfluid._simulate.loop`); None without a schedule.
        scale=_cast(observed_fractions(scn, t_end - setup.tau), dtype),
        slowdown=None
        if estimate is not None
        else _cast(observed_slowdown(scn, t_end - setup.tau), dtype),
        drops=tick_drops.astype(dtype) / tr.scale,
        arrivals=tick_arrivals.astype(dtype) / tr.scale,
    )
    x, pstate = tr.policy.update(scn, setup, policy_state, obs, tr.aux)
    x = x.astype(dtype)
    return x, _cum_routing(scn, x), pstate, ring


def _cast(x, dtype):
    return None if x is None else x.astype(dtype)


def smooth_probes(prev, probes, h, smoothing: float):
    """One tick of the probes' exponential smoothing (`simulate_requests(probe_smoothing=...)`;
    theory/requests.md, *Probe smoothing*): $\\hat y_k = \\hat y_{k-1} + \\alpha(y_k -
    \\hat y_{k-1})$ with $\\alpha = 1 - e^{-h/T_s}$, the exact discretisation at the tick
    $h$ of the first-order filter $\\dot{\\hat y} = (y - \\hat y)/T_s$ of a probe held over
    the tick; $\\hat y_{-1}$ is the initial count's probe. The filter's mean lag is about $T_s$ and
    it divides the variance of uncorrelated probe noise by $(2 - \\alpha)/\\alpha$."""
    alpha = -jnp.expm1(-h / smoothing)
    return prev + alpha * (probes - prev)


def _batched(f):
    """`f(trial, state)` over a batch: trials `(B,)`, states `(B, R)`."""
    return jax.vmap(jax.vmap(f, in_axes=(None, 0)), in_axes=(0, 0))


def _update(tr: Trial, k, t_end, st: LoopState) -> LoopState:
    """Every router's update at $t_{k+1}$ = `t_end` (`AbstractPolicy.update`), with the
    replica fractions observed $\\tau_{ij}$ late when the scenario has a schedule."""
    dtype = st.x.dtype
    # The probes not taken inside the tick (`_probe`) read the counts at its end.
    seen = tr.cells.count(st.cells).astype(dtype) / tr.scale
    probes = jnp.where(tr.setup.offsets.T > st.last[:, None], seen[:, None], st.probes)
    x, xc, pstate, ring = route(
        tr, st.policy_state, st.obs_ring, probes.T, k, t_end, st.tick_drops, st.tick_arrivals
    )
    zi = jnp.zeros_like(st.tick_drops)
    stats = dataclasses.replace(st.stats, received=st.stats.received + st.tick_arrivals)
    return dataclasses.replace(
        st,
        stats=stats,
        overflow=st.overflow | routing_flag(x),
        x=x,
        xc=xc,
        policy_state=pstate,
        obs_ring=ring,
        last=jnp.full_like(st.last, -1.0),
        tick_arrivals=zi,
        tick_drops=zi,
    )
