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
from jaxtyping import Array, Bool, Float, Int

from .._policies import AbstractPolicy, Observation, TickSetup
from .._policies.base import replica_fractions
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


class Stats(eqx.Module):
    """What a trial accumulates over the statistics window $[t_w, T]$ (`warmup` $t_w$).

    **Fields:** `served` completions; `latency_sum`, `latency_sq` the sums of their
    end-to-end latencies and squares; `histogram` `(bins + 2,)` their latency histogram;
    `arrivals` `(n,)` requests arrived at each root router; `drops` `(n,)` requests
    rejected by each cell (full buffer, or an overflow); `area`, `busy` `(n,)` the time
    integrals of each cell's request count and utilisation.
    """

    served: Int[Array, ""]
    latency_sum: Float[Array, ""]
    latency_sq: Float[Array, ""]
    histogram: Int[Array, " bins"]
    arrivals: Int[Array, " n"]
    drops: Int[Array, " n"]
    area: Float[Array, " n"]
    busy: Float[Array, " n"]


class LoopState(eqx.Module):
    """The state of one trial, grouped by role.

    **Clock:** `t`, the time of the last event; `key`, the trial's PRNG key; `uniforms`
    `(E, 5)` the current tick's block of uniforms, one row per event, `used` rows so far.
    **Cells:** `cells`, the cell kind's state (`AbstractCells`).
    **Network:** `fifo` `(n, n, F)` arrival times at the root of the requests in flight on
    each arc, a ring from `head` `(n, n)` of length `size` `(n, n)`; `front` `(n, n)` the
    arrival time of each ring's head (a copy, so that an event reads no ring to find the
    next delivery).
    **Routers:** `x` `(n, n)` the routing in force; `policy_state`; `obs_ring`
    `(hist, n, n)` probed counts$/k$ by the update index they serve; `pending` `(n, n)`
    the current tick's probes, `taken` which of them are taken (each arc probes once a
    tick; they enter the ring at the tick's end); `tick_arrivals`, `tick_drops` `(n,)` the
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
    front: Float[Array, "n n"]
    x: Float[Array, "n n"]
    policy_state: object
    obs_ring: Float[Array, "hist n n"]
    pending: Float[Array, "n n"]
    taken: Bool[Array, "n n"]
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
    `lam_max` `(n,)` each profile's maximum rate; `buffer` `(n,)` the cells' buffers at
    scale $k$, $\\lfloor kB_j\\rfloor$ requests ($+\\infty$ for none); `warmup` $t_w$;
    `arc_slots` (static) $F$; `events` (static) $E$, the events a tick may hold (rows of
    its block of uniforms); `histogram` the latency bins.
    """

    scn: Scenario
    setup: TickSetup
    aux: object
    # (policies hold no arrays: static, as under `simulate`'s jit)
    policy: AbstractPolicy = eqx.field(static=True)
    cells: AbstractCells
    scale: Float[Array, ""]
    lam_max: Float[Array, " n"]
    buffer: Float[Array, " n"]
    warmup: Float[Array, ""]
    arc_slots: int = eqx.field(static=True)
    events: int = eqx.field(static=True)
    histogram: LatencyHistogram = eqx.field(static=True)


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
        front=jnp.full((n, n), jnp.inf, dtype),
        x=x0,
        policy_state=tr.policy.init_state(scn, setup, tr.aux, x0),
        # Tick k's probe of arc (i, j) serves update k + m_ij + 1: updates 1..m_ij see N(0).
        obs_ring=jnp.broadcast_to(seen[None, None, :], (setup.hist, n, n)),
        pending=jnp.zeros((n, n), dtype),
        taken=jnp.zeros((n, n), bool),
        tick_arrivals=zi,
        tick_drops=zi,
        stats=stats,
        overflow=jnp.where(over, OVERFLOW_CELLS, 0).astype(jnp.int32),
        events=jnp.zeros((), jnp.int32),
        buffer=tr.buffer,
    )


def _probe(tr: Trial, st: LoopState, local, at_end):
    """Take the probes of the current tick due by its local time `local` from the current
    counts: arc $(i,j)$ probes once a tick, at offset $h - r_{ij}$ (`TickSetup.offsets`;
    the probe serves the update $m_{ij} + 1$ ticks later), or at the tick's end
    (`at_end`). Elementwise over the arcs: no scatter."""
    due = ~st.taken & ((local >= tr.setup.offsets) | at_end)
    seen = tr.cells.count(st.cells).astype(st.x.dtype) / tr.scale
    return jnp.where(due, seen[None, :], st.pending), st.taken | due


def _onehot(j, n: int):
    return jnp.arange(n) == j


def _event(tr: Trial, k, t_end, st: LoopState):
    """One event of tick `k` (or the tick's end, then `running` is False)."""
    scn, setup = tr.scn, tr.setup
    n, F = scn.n_cells, tr.arc_slots
    dtype = st.x.dtype
    u = st.uniforms[jnp.minimum(st.used, tr.events - 1)]

    lam = tr.scale * tr.lam_max
    comp = tr.cells.rates(st.cells)
    w = jnp.concatenate([lam, comp])
    cw = jnp.cumsum(w)
    total = cw[-1]
    gap = -jnp.log1p(-u[0]) / total
    t_rand = jnp.where(total > 0, st.t + gap, jnp.inf)

    due = jnp.where(st.size > 0, st.front + setup.tau, jnp.inf)
    a = jnp.argmin(due.reshape(-1))
    t_del = due.reshape(-1)[a]
    # A cell's deterministic internal event (App.-B servers; +inf for the other kinds).
    nxt = tr.cells.next_time(st.cells)
    jn = jnp.argmin(nxt)
    t_cell = nxt[jn]

    t_ev = jnp.minimum(jnp.minimum(t_rand, t_del), t_cell)
    stop = t_ev >= t_end
    t_new = jnp.where(stop, t_end, t_ev)

    # Integrals over [t, t_new] (the part inside the statistics window), before the event.
    dt = jnp.maximum(t_new - jnp.maximum(st.t, tr.warmup), 0.0)
    count = tr.cells.count(st.cells)
    stats = st.stats
    area = stats.area + count.astype(dtype) * dt
    busy = stats.busy + tr.cells.utilisation(st.cells) * dt
    pending, taken = _probe(tr, st, t_new - k * setup.h, stop)

    is_del = ~stop & (t_del <= t_rand) & (t_del <= t_cell)
    is_int = ~stop & ~is_del & (t_cell <= t_rand)
    is_rnd = ~stop & ~is_del & ~is_int
    pick = jnp.minimum(
        jnp.searchsorted(cw, u[1] * total, side="right", method="compare_all"), 2 * n - 1
    )
    is_arr = is_rnd & (pick < n)
    is_cmp = is_rnd & (pick >= n)
    i = jnp.clip(pick, 0, n - 1)
    jc = jnp.clip(pick - n, 0, n - 1)

    # An arrival at root i: thinned to rate k lambda_i(t), routed by x_i.
    lam_i = rate_at(scn.arrival_times[i], scn.arrival_rates[i], t_new)
    accept = is_arr & (u[2] * tr.lam_max[i] < lam_i)
    xi = st.x[i]
    cx = jnp.cumsum(jnp.where(scn.allowed[i], jnp.maximum(xi, 0.0), 0.0))
    ja = jnp.clip(jnp.searchsorted(cx, u[3] * cx[-1], side="right", method="compare_all"), 0, n - 1)
    tau_a = setup.tau[i, ja]
    direct = accept & (tau_a <= 0)
    push = accept & (tau_a > 0)

    # A delivery: the head of arc (id, jd) reaches its cell.
    i_d, j_d = a // n, a % n
    born = st.front.reshape(-1)[a]

    admit = direct | is_del
    j_in = jnp.where(is_del, j_d, ja)
    origin = jnp.where(is_del, born - setup.tau[i_d, j_d], t_new)
    reject = admit & (count[j_in].astype(dtype) >= st.buffer[j_in])
    # An event admits or completes, never both; completing first lets every read of the
    # cells' arrays come before any write, so that the writes stay in place in the loop.
    j_out = jnp.where(is_int, jn, jc)
    cells, leaving, left = tr.cells.complete(st.cells, j_out, u[4], t_new, is_cmp | is_int)
    cells, over_cell = tr.cells.admit(cells, j_in, origin, t_new, admit & ~reject)
    latency = t_new - leaving

    slot_len = st.size[i, ja]
    arc_full = push & (slot_len >= F)
    do_push = push & ~arc_full
    slot = jnp.where(do_push, (st.head[i, ja] + slot_len) % F, F)  # past the ring: dropped
    fifo = st.fifo.at[i, ja, slot].set(t_new, mode="drop")
    # A delivery pops its ring and reads the next head's arrival time, the one read of the
    # rings, after the push (an event pushes or pops, never both), so that the write
    # comes first and stays in place.
    nxt = (st.head[i_d, j_d] + 1) % F
    following = fifo[i_d, j_d, nxt]
    at_push = _onehot(i, n)[:, None] & _onehot(ja, n)[None, :] & do_push
    at_pop = _onehot(i_d, n)[:, None] & _onehot(j_d, n)[None, :] & is_del
    size = st.size + at_push.astype(jnp.int32) - at_pop.astype(jnp.int32)
    head = jnp.where(at_pop, nxt, st.head)
    front = jnp.where(at_push & (st.size == 0), t_new, st.front)
    front = jnp.where(at_pop, jnp.where(size > 0, following, jnp.inf), front)

    lost = reject | over_cell
    win = t_new >= tr.warmup
    served = left & win
    bin_ = tr.histogram.index(latency)
    stats = Stats(
        served=stats.served + served.astype(jnp.int32),
        latency_sum=stats.latency_sum + jnp.where(served, latency, 0.0),
        latency_sq=stats.latency_sq + jnp.where(served, latency * latency, 0.0),
        histogram=stats.histogram.at[bin_].add(served.astype(jnp.int32)),
        arrivals=stats.arrivals + (_onehot(i, n) & accept & win).astype(jnp.int32),
        drops=stats.drops + (_onehot(j_in, n) & (lost | arc_full) & win).astype(jnp.int32),
        area=area,
        busy=busy,
    )
    exhausted = ~stop & (st.used >= tr.events)
    overflow = (
        st.overflow
        | jnp.where(exhausted, OVERFLOW_EVENTS, 0).astype(jnp.int32)
        | jnp.where(over_cell, OVERFLOW_CELLS, 0).astype(jnp.int32)
        | jnp.where(arc_full, OVERFLOW_ARCS, 0).astype(jnp.int32)
    )
    new = LoopState(
        t=t_new,
        key=st.key,
        uniforms=st.uniforms,
        used=st.used + (~stop).astype(jnp.int32),
        cells=cells,
        fifo=fifo,
        front=front,
        head=head,
        size=size,
        x=st.x,
        policy_state=st.policy_state,
        obs_ring=st.obs_ring,
        pending=pending,
        taken=taken,
        tick_arrivals=st.tick_arrivals + (_onehot(j_in, n) & admit).astype(jnp.int32),
        tick_drops=st.tick_drops + (_onehot(j_in, n) & lost).astype(jnp.int32),
        stats=stats,
        overflow=overflow,
        events=st.events + (~stop).astype(jnp.int32),
        buffer=st.buffer,
    )
    return new, ~stop


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
    $c_j$ = `replica_fractions` at the tick's midpoint (as the fluid simulator reads them,
    so that a change on the tick grid takes effect exactly at its time) with the buffers
    $\\lfloor kc_jB_j\\rfloor$; the requests a cell drops there count as the tick's drops."""
    key, sub = jr.split(st.key)
    u = jr.uniform(sub, (tr.events, 5), st.uniforms.dtype)
    scn, h = tr.scn, tr.setup.h
    frac = replica_fractions(scn, st.t + 0.5 * h)
    frac = jnp.where(scn.cell_mask & (frac > 0), frac, 1.0).astype(st.x.dtype)
    b = jnp.floor(tr.scale * frac * scn.buffer)
    buffer = jnp.where(jnp.isfinite(scn.buffer), b, jnp.inf).astype(st.buffer.dtype)
    cells, dropped = tr.cells.refresh(st.cells, frac, buffer)
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


def _batched(f):
    """`f(trial, state)` over a batch: trials `(B,)`, states `(B, R)`."""
    return jax.vmap(jax.vmap(f, in_axes=(None, 0)), in_axes=(0, 0))


def _update(tr: Trial, k, t_end, st: LoopState) -> LoopState:
    """Every router's update at $t_{k+1}$ = `t_end` (`AbstractPolicy.update`), with the
    replica fractions observed $\\tau_{ij}$ late when the scenario has a schedule."""
    setup = tr.setup
    dtype = st.x.dtype
    n = tr.scn.n_cells
    rows = jnp.broadcast_to(jnp.arange(n)[:, None], (n, n))
    cols = jnp.broadcast_to(jnp.arange(n)[None, :], (n, n))
    ring = st.obs_ring.at[(k + setup.m + 1) & (setup.hist - 1), rows, cols].set(st.pending)
    obs = Observation(
        k=k,
        t=t_end,
        workload=ring[(k + 1) & (setup.hist - 1)],
        # The observed replica fractions c_j(t_{k+1} - tau_ij), as the fluid's routers see
        # them (`dlbfluid._simulate.loop`); None without a schedule.
        scale=(
            replica_fractions(tr.scn, t_end - setup.tau).astype(dtype)
            if tr.scn.replica_times.shape[-1] > 1
            else None
        ),
        drops=st.tick_drops.astype(dtype) / tr.scale,
        arrivals=st.tick_arrivals.astype(dtype) / tr.scale,
    )
    x, pstate = tr.policy.update(tr.scn, setup, st.policy_state, obs, tr.aux)
    zi = jnp.zeros_like(st.tick_drops)
    return dataclasses.replace(
        st,
        x=x.astype(dtype),
        policy_state=pstate,
        obs_ring=ring,
        taken=jnp.zeros_like(st.taken),
        tick_arrivals=zi,
        tick_drops=zi,
    )
