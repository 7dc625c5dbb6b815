"""The admission-time engine of `servers` cells: the request-level twin whose cost follows
the requests, plus the ticks (theory/requests.md, *FIFO cells at admission*).

In a cell of FIFO servers a request's completion time is fixed when it is admitted
(`FifoCells`: Lindley's recursion for the prefill engine, Kiefer-Wolfowitz's for the
decode slots), so admission is the only event of a cell. A tick $[t_k, t_{k+1})$ is then a
block:

1. **Arrivals** (`start_tick`). The candidates of the tick (a Poisson process of rate
   $\\Lambda = k\\sum_i\\bar\\lambda_i$, drawn for `chunk` ticks at a time: `redraw`) pick a
   root by $k\\bar\\lambda_i/\\Lambda$, are kept with probability
   $\\lambda_i(t)/\\bar\\lambda_i$ (thinning), and are routed by the tick's fixed $x_i$. A
   request routed on arc $(i,j)$ at $s$ reaches $j$ at $s + \\tau_{ij}$, in tick
   $k + m_{ij}$ or $k + m_{ij} + 1$ ($\\tau_{ij} = m_{ij}h + r_{ij}$): it is written, with
   its cell, into the lane's inbox of that tick (a ring of ticks).
2. **Admissions** (`admit_next`, `admit`). Given their deliveries, cells are independent
   inside a tick; each lane admits its tick's deliveries in time order, one per
   iteration of a loop that runs while any lane has one left. An admission reads the
   per-server counts at its time (completion times after it), tests the buffer, joins
   the server that the leaf rule picks (`Lane.leaf`; by default the shortest queue),
   fixes the completion, and counts the request's statistics at once
   (latency, its share of the time integrals).
3. **Counts and probes** (`finish`). Each admission adds $+1$ and each completion $-1$
   to a calendar of count changes `(W ticks, n cells, n + 1 segments)`, the segment
   being the number of the cell's probe offsets at or before the change; a completion
   more than `W` ticks ahead waits in a short per-cell list (`far`) and enters the
   calendar at most `W` ticks before its tick (`far_in`). At the tick's end, arc
   $(i, j)$'s probe at offset $h - r_{ij}$ is the count at $t_k$ plus the changes of the
   segments before it, and the routers update as in the fluid simulator.

A tick without requests costs the arrivals' window, the calendar's row and the routers'
update. Everything a lane holds has a fixed size (`Sizes`); an overflow sets a bit of
`overflow` and the lane's status, never a silent truncation.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, Int

from .._policies import AbstractPolicy, TickSetup
from .._scenario import Scenario
from .._scenario.arrivals import rate_at
from . import estimation as est_
from . import sessions as sess_
from ._leaf import AbstractLeaf, JoinShortestQueue
from .fifo import FifoCells, ServiceClock, running, serve
from .histogram import LatencyHistogram
from .loop import (
    OVERFLOW_ARCS,
    OVERFLOW_CELLS,
    OVERFLOW_EVENTS,
    Stats,
    _batched,
    _cum_routing,
    _first_min,
    route,
    routing_flag,
    tick_capacity,
)

OVERFLOW_CALENDAR = 8
"""Overflow bit: a cell's list of far completions (`Sizes.far`) was full."""


class Sizes(eqx.Module):
    """The fixed sizes of a lane (static; chosen by `simulate_requests`).

    **Fields:** `servers` $S$ (server axis), `queue` $Q$ (requests a server holds),
    `slots` $D$ (decode slots per server), `calendar` $W$ (ticks of the count calendar),
    `far` $F$ (far completions per cell), `ring` $L$ (ticks of the inboxes, above
    $\\max m_{ij} + 1$), `inbox` $C$ (deliveries per lane and tick), `candidates` $A$
    (arrival candidates per tick), `chunk` $G$ (ticks per draw of random numbers), `rows`
    (candidates per chunk), `token_rows` (the table of admissions' draws: a chunk's
    admissions at most), `token_new` (draws added to the table per chunk: above a chunk's
    mean admissions, so that the table stays full; `refill`).
    """

    servers: int
    queue: int
    slots: int
    calendar: int
    far: int
    ring: int
    inbox: int
    candidates: int
    chunk: int
    rows: int
    token_rows: int
    token_new: int


class Lane(eqx.Module):
    """What the lanes of one scenario read and never change.

    **Fields:** `scn`; `setup` the routers' `TickSetup`; `aux` the policy's arrays;
    `policy`; `leaf` the cells' leaf rule (`AbstractLeaf`); `cells` (`FifoCells`); `scale` $k$; `lam_max` `(n,)` the profiles' maxima;
    `lam_cum` `(n,)` cumulative $k\\bar\\lambda_i$; `buffer` `(n,)` $kB_j$ floored
    ($+\\infty$: none); `warmup`, `horizon`; `sorted_offsets` `(n, n)` each cell's probe
    offsets in increasing order (row $j$); `rank` `(n, n)` $q_{ij}$, the number of cell
    $j$'s probe offsets strictly before arc $(i, j)$'s; `ticks` $K$; `sizes`;
    `histogram`; `smoothing` (static) the probes' smoothing time constant (s; 0: none);
    `clocks` every cell's `ServiceClock` (arrays `(n, S)`; None without a service schedule);
    `estimation` (static) the online estimation's configuration and `est` its arrays
    (`dlbfluid._requests.estimation`; None: the oracle, the scenario's `estimate`);
    `affinity` (static) the sessions' configuration and `sess` their arrays
    (`dlbfluid._requests.sessions`; None: no sessions).
    """

    scn: Scenario
    setup: TickSetup
    aux: object
    policy: AbstractPolicy = eqx.field(static=True)
    leaf: AbstractLeaf = eqx.field(static=True)
    cells: FifoCells
    scale: Float[Array, ""]
    lam_max: Float[Array, " n"]
    lam_cum: Float[Array, " n"]
    buffer: Float[Array, " n"]
    warmup: Float[Array, ""]
    horizon: Float[Array, ""]
    sorted_offsets: Float[Array, "n n"]
    rank: Int[Array, "n n"]
    ticks: int = eqx.field(static=True)
    sizes: Sizes = eqx.field(static=True)
    histogram: LatencyHistogram = eqx.field(static=True)
    smoothing: float = eqx.field(static=True, default=0.0)
    clocks: ServiceClock | None = None
    estimation: est_.OnlineEstimation | None = eqx.field(static=True, default=None)
    est: est_.EstLane | None = None
    affinity: sess_.Affinity | None = eqx.field(static=True, default=None)
    sess: sess_.SessLane | None = None


class FifoState(eqx.Module):
    """The state of one lane (a scenario's trial), grouped by role.

    **Random numbers:** `key`; `cand` `(rows + A, 4)` the chunk's arrival candidates
    (time, root, whether thinning keeps it, a uniform for the route; `+inf` times past
    the end), `ptr` the next one; `tokens` `(token_rows, 3 + leaf.draws)` the draws for admissions
    (`FifoCells.draw`), `tptr` the next one, `tn` the number drawn (`refill`).
    **Servers:** `srv` `(n, S, 1 + D + Q)`, per server: when its prefill engine frees,
    when each of its decode slots frees ($+\\infty$ for slots it does not have), and the
    completion times of the requests it holds (a slot whose time has passed is free);
    one row per server, so that an admission reads its cell's servers and writes one row.
    `active` `(n,)` running servers; `buffer` `(n,)` buffers of the tick.
    **Counts:** `count` `(n,)` requests present at $t_k$; `cal` `(W, n, n + 1)` count
    changes by tick and probe segment; `far` `(n, F)` completions beyond the calendar, a
    stack per cell of `far_n` `(n,)` entries ($+\\infty$ past them).
    **Network:** `inbox` `(L, C, 2)` delivery times and origins of the requests that
    reach the lane's cells in each tick of the ring, `inbox_j` `(L, C, E)` their cells
    (with sessions also their session ids, -1 for none, and slots: `E` = 3, else 1),
    `inbox_n` `(L,)` their number.
    **Routers:** `x`, `xc` (cumulative rows), `policy_state`, `obs_ring` as in the
    fluid simulator; `tick_arrivals`, `tick_drops` `(n,)` the tick's deliveries and
    rejections per cell (error aversion).
    **Outputs:** `stats` (`Stats`: `area` and `busy` are time integrals of the count and
    of the busy servers, accumulated per request), `run_area` `(n,)` the integral of the
    running servers, `overflow` bits, `events` admissions made.
    **Estimation:** `est` the online estimation's state (`EstState`; None: the oracle).
    **Sessions:** `sess` (`SessState`; None: no sessions).
    """

    key: Array
    cand: Float[Array, "R 4"]
    ptr: Int[Array, ""]
    tokens: Float[Array, "T 3"]
    tptr: Int[Array, ""]
    tn: Int[Array, ""]
    srv: Float[Array, "n S R"]
    active: Int[Array, " n"]
    buffer: Float[Array, " n"]
    count: Int[Array, " n"]
    cal: Int[Array, "W n m"]
    far: Float[Array, "n F"]
    far_n: Int[Array, " n"]
    inbox: Float[Array, "L C 2"]
    inbox_j: Int[Array, "L C E"]
    inbox_n: Int[Array, " L"]
    x: Float[Array, "n n"]
    xc: Float[Array, "n n"]
    policy_state: object
    obs_ring: Float[Array, "hist n n"]
    tick_arrivals: Int[Array, " n"]
    tick_drops: Int[Array, " n"]
    stats: Stats
    run_area: Float[Array, " n"]
    overflow: Int[Array, ""]
    events: Int[Array, ""]
    est: est_.EstState | None = None
    sess: sess_.SessState | None = None


def _overlap(a, b, lo, hi):
    """Length of $[a, b] \\cap [lo, hi]$."""
    return jnp.maximum(jnp.minimum(b, hi) - jnp.maximum(a, lo), 0.0)


def _bit(flag, bit: int):
    return jnp.where(flag, bit, 0).astype(jnp.int32)


def init_lane(ln: Lane, key) -> FifoState:
    """The state at $t = 0$ with chunk 0's candidates and a full table of admissions'
    draws; the initial requests are admitted by `admit_initial`."""
    scn, setup, z = ln.scn, ln.setup, ln.sizes
    n, dtype = scn.n_cells, scn.latency.dtype
    x0 = ln.policy.initial_routing(scn, ln.aux).astype(dtype)
    counts = jnp.where(scn.cell_mask, jnp.round(ln.scale * scn.initial_workload), 0)
    counts = counts.astype(jnp.int32)
    seen = counts.astype(dtype) / ln.scale
    slot_ok = jnp.arange(z.slots)[None, None, :] < ln.cells.decode_slots[:, None, None]
    zi = jnp.zeros(n, jnp.int32)
    zf = jnp.zeros(n, dtype)
    stats = Stats(
        served=jnp.zeros((), jnp.int32),
        latency_sum=jnp.zeros((), dtype),
        latency_sq=jnp.zeros((), dtype),
        histogram=jnp.zeros(ln.histogram.bins + 2, jnp.int32),
        arrivals=zi,
        drops=zi,
        area=zf,
        busy=zf,
        received=zi,
    )
    key, kt = jr.split(key)
    st = FifoState(
        key=key,
        cand=jnp.zeros((z.rows + z.candidates, 4), dtype),
        ptr=jnp.zeros((), jnp.int32),
        tokens=ln.cells.draw(kt, z.token_rows, dtype, ln.leaf.draws),
        tptr=jnp.zeros((), jnp.int32),
        tn=jnp.full((), z.token_rows, jnp.int32),
        srv=jnp.concatenate(
            [
                jnp.zeros((n, z.servers, 1), dtype),
                jnp.broadcast_to(jnp.where(slot_ok, 0.0, jnp.inf), (n, z.servers, z.slots)).astype(
                    dtype
                ),
                jnp.full((n, z.servers, z.queue), -1.0, dtype),
            ],
            axis=-1,
        ),
        active=ln.cells.servers,
        buffer=ln.buffer,
        count=counts,
        cal=jnp.zeros((z.calendar, n, n + 1), jnp.int32),
        far=jnp.full((n, z.far), jnp.inf, dtype),
        far_n=zi,
        inbox=jnp.full((z.ring, z.inbox, 2), jnp.inf, dtype),
        inbox_j=jnp.zeros((z.ring, z.inbox, 1 if ln.affinity is None else 3), jnp.int32),
        inbox_n=jnp.zeros((z.ring,), jnp.int32),
        x=x0,
        xc=_cum_routing(scn, x0),
        policy_state=ln.policy.init_state(scn, setup, ln.aux, x0),
        obs_ring=jnp.broadcast_to(seen[None, None, :], (setup.hist, n, n)),
        tick_arrivals=zi,
        tick_drops=zi,
        stats=stats,
        run_area=zf,
        overflow=jnp.zeros((), jnp.int32),
        events=jnp.zeros((), jnp.int32),
        # (a key of its own: the lane's stream of draws is the oracle's)
        est=None
        if ln.estimation is None or ln.est is None
        else est_.init_est(ln.estimation, ln.est, jr.fold_in(key, 7), dtype),
        sess=None
        if ln.affinity is None
        else sess_.init_sessions(ln.affinity, n, z.servers, z.rows + z.candidates),
    )
    return redraw(ln, st, jnp.zeros((), jnp.int32))


def redraw(ln: Lane, st: FifoState, k0) -> FifoState:
    """The arrival candidates of the chunk of ticks $[k_0, k_0 + G)$: a Poisson process of
    rate $\\Lambda$ (cumulative exponential gaps; too few to pass the chunk's end is an
    `OVERFLOW_EVENTS`), each one's root $i$ (inverse CDF of $k\\bar\\lambda_i/\\Lambda$) and
    whether thinning keeps it (probability $\\lambda_i(t)/\\bar\\lambda_i$), decided here
    for the whole chunk since neither depends on the routing, and a uniform for its route."""
    z, h = ln.sizes, ln.setup.h
    dtype = st.cand.dtype
    key, kg, ku = jr.split(st.key, 3)
    lam = ln.lam_cum[-1]
    t0 = k0.astype(dtype) * h
    gaps = jr.exponential(kg, (z.rows,), dtype) / jnp.where(lam > 0, lam, 1.0)
    times = jnp.where(lam > 0, t0 + jnp.cumsum(gaps), jnp.inf)
    short = jnp.isfinite(times[-1]) & (times[-1] < t0 + z.chunk * h)
    u = jr.uniform(ku, (z.rows, 3), dtype)
    scn, n = ln.scn, ln.scn.n_cells
    i = jnp.minimum(jnp.sum(ln.lam_cum[None, :] <= (u[:, 0] * lam)[:, None], -1), n - 1)
    lam_i = jax.vmap(rate_at)(scn.arrival_times[i], scn.arrival_rates[i], times)
    keep = u[:, 1] * ln.lam_max[i] < lam_i
    cols = [times, i.astype(dtype), keep.astype(dtype), u[:, 2]]
    cand = jnp.stack(cols, axis=1)
    pad = jnp.concatenate(
        [jnp.full((z.candidates, 1), jnp.inf, dtype), jnp.zeros((z.candidates, 3), dtype)],
        axis=1,
    )
    sess = st.sess
    if sess is not None:  # (a key of its own: the other draws are those without sessions)
        assert ln.sess is not None
        real = keep & (times < t0 + z.chunk * h)  # (the later rows are never used)
        sess = sess_.draw(ln.sess, sess, jr.fold_in(st.key, 11), i, real, z.rows, z.candidates)
    return dataclasses.replace(
        st,
        sess=sess,
        key=key,
        cand=jnp.concatenate([cand, pad]),
        ptr=jnp.zeros_like(st.ptr),
        overflow=st.overflow | _bit(short, OVERFLOW_EVENTS),
    )


def refill(ln: Lane, st: FifoState) -> FifoState:
    """The admissions' draws for the next chunk: the unused ones moved to the front of the
    table, then `token_new` fresh ones behind them (those past the table dropped). Every
    row is used at most once and in order, so the draws stay independent; the table runs
    short (`OVERFLOW_EVENTS` at the admission) only if a chunk admits more than it holds."""
    z = ln.sizes
    key, kt = jr.split(st.key)
    left = st.tn - st.tptr
    idx = jnp.arange(z.token_rows)
    old = st.tokens[jnp.minimum(idx + st.tptr, z.token_rows - 1)]
    new = ln.cells.draw(kt, z.token_new, st.tokens.dtype, ln.leaf.draws)
    fresh = new[jnp.clip(idx - left, 0, z.token_new - 1)]
    return dataclasses.replace(
        st,
        key=key,
        tokens=jnp.where((idx < left)[:, None], old, fresh),
        tptr=jnp.zeros_like(st.tptr),
        tn=jnp.minimum(left + z.token_new, z.token_rows).astype(jnp.int32),
    )


def admit(ln: Lane, st: FifoState, k, j, t, origin, ok, initial, sid=None) -> FifoState:
    """Admit (if `ok`) a request of origin `origin` delivered to cell `j` at time `t` in
    tick `k` (module docstring, step 2). `initial`: one of the requests present at
    $t = 0$ (no buffer test; it is in the count at $t_0$ already). `sid`: its session's
    id and slot `(2,)` (id -1: none; with sessions only, `dlbfluid._requests.sessions`).

    Cell $j$'s servers are read as one block and the chosen server's row written back
    whole: each array is read and written once per admission, the fewest kernels."""
    z, cells, h = ln.sizes, ln.cells, ln.setup.h
    S = z.servers
    dtype = t.dtype
    tok = st.tokens[jnp.minimum(st.tptr, z.token_rows - 1)]
    p = _place(ln, st, j, t, tok, initial, sid)
    per, total, valid, pick = p.per, p.total, p.valid, p.pick
    s, new_row, c, p0, pf, vstart, dw = p.server, p.new_row, p.c, p.p0, p.pf, p.vstart, p.dw
    reject = ok & ~initial & (total.astype(dtype) >= st.buffer[j])
    per_s = jnp.sum(jnp.where(pick, per, 0))
    full = ok & ~reject & ((per_s >= z.queue) | ~jnp.any(pick & valid))
    do = ok & ~reject & ~full
    no_row = do & (st.tptr >= st.tn)
    decode = dw > 0
    # (an index past an array drops the write; the row written depends on the block read)
    srv = st.srv.at[j, jnp.where(do, s, S)].set(new_row, mode="drop")

    # Count changes: +1 at the admission, -1 at the completion (if before the horizon);
    # a completion beyond the calendar waits in `far`.
    tk = k.astype(dtype) * h
    kc = jnp.maximum(jnp.floor(c / h).astype(jnp.int32), k)
    ends = do & (kc < ln.ticks)
    near = kc < k + z.calendar
    offs = ln.sorted_offsets[j]
    local = jnp.stack([t - tk, c - kc.astype(dtype) * h])
    seg = jnp.sum(offs[None, :] <= local[:, None], axis=-1).astype(jnp.int32)
    ticks = jnp.stack(
        [
            jnp.where(do & ~initial, k % z.calendar, z.calendar),
            jnp.where(ends & near, kc % z.calendar, z.calendar),
        ]
    )
    cal = st.cal.at[ticks, j, seg].add(jnp.array([1, -1], jnp.int32), mode="drop")
    # (a stack per cell: the admission reads its length, not the list; `far_in` compacts)
    top = st.far_n[j]
    into_far = ends & ~near
    far_full = into_far & (top >= z.far)
    put = into_far & ~far_full
    far = st.far.at[j, jnp.where(put, top, z.far)].set(c, mode="drop")
    far_n = st.far_n.at[j].add(put.astype(jnp.int32))

    # Statistics, at once: the request's latency and its share of the time integrals.
    w0, T = ln.warmup, ln.horizon
    s_ = st.stats
    served = do & (c >= w0) & (c < T)
    lat = c - origin
    busy = jnp.where(
        cells.prefill_bound[j],
        _overlap(p0, pf, w0, T),
        jnp.where(decode, _overlap(vstart, c, w0, T), 0.0)
        / jnp.maximum(cells.decode_slots[j], 1).astype(dtype),
    )
    onehot = (jnp.arange(ln.scn.n_cells) == j).astype(jnp.int32)
    lost = (reject | full).astype(jnp.int32) * onehot
    win = (t >= w0).astype(jnp.int32)
    stats = Stats(
        served=s_.served + served.astype(jnp.int32),
        latency_sum=s_.latency_sum + jnp.where(served, lat, 0.0),
        latency_sq=s_.latency_sq + jnp.where(served, lat * lat, 0.0),
        histogram=s_.histogram.at[
            jnp.where(served, ln.histogram.index(lat), ln.histogram.bins + 2)
        ].add(1, mode="drop"),
        arrivals=s_.arrivals,
        drops=s_.drops + win * lost,
        area=s_.area + jnp.where(do, _overlap(t, c, w0, T), 0.0) * onehot,
        busy=s_.busy + jnp.where(do, busy, 0.0) * onehot,
        received=s_.received,
    )
    deliv = (ok & ~initial).astype(jnp.int32) * onehot
    est = st.est
    if est is not None:
        assert ln.estimation is not None and ln.est is not None
        est = est_.record(ln.estimation, ln.est, est, j, total, ln.scale, t, c, do)
    sess = st.sess
    if sess is not None:
        assert ln.sess is not None and sid is not None
        in_win = (t >= w0) & (t < T) & ~initial
        assert p.seat is not None
        sess = sess_.admit(ln.sess, sess, j, sid, p.seat, st.events, do, in_win)
    return dataclasses.replace(
        st,
        est=est,
        sess=sess,
        tptr=(st.tptr + do).astype(jnp.int32),
        srv=srv,
        cal=cal,
        far=far,
        far_n=far_n,
        tick_arrivals=st.tick_arrivals + deliv,
        tick_drops=st.tick_drops + (~initial).astype(jnp.int32) * lost,
        stats=stats,
        overflow=st.overflow
        | _bit(full, OVERFLOW_CELLS)
        | _bit(no_row, OVERFLOW_EVENTS)
        | _bit(far_full, OVERFLOW_CALENDAR),
        events=(st.events + ok).astype(jnp.int32),
    )


class _Placement(eqx.Module):
    """Where and when a request delivered to cell `j` at `t` would be served (`_place`):
    `per` `(S,)` requests per server and `total`, `valid` the running servers, the chosen
    `server` (`pick` one-hot), its row after the admission `new_row`, the completion `c`,
    the prefill's start `p0` and end `pf`, the decode's start `vstart` (in seconds), the
    decode work `dw`, whether the server held the request's session prefix `hit` and, with
    sessions, the `sessions.Seat` it was given (else None)."""

    per: Array
    total: Array
    valid: Array
    server: Array
    pick: Array
    new_row: Array
    c: Array
    p0: Array
    pf: Array
    vstart: Array
    dw: Array
    hit: Array
    seat: sess_.Seat | None


def _place(ln: Lane, st: FifoState, j, t, tok, initial, sid=None) -> _Placement:
    """The leaf rule's choice and the FIFO recursions for a request of draws `tok`
    delivered to cell `j` at `t` (`initial`: present at $t = 0$, round-robin; `sid` its
    session's id and slot, None or id -1 for none), without writing anything: `admit`
    writes the row, a background probe only reads `c`. With affinity a session's request
    joins the running server where its session was last admitted, if that server still
    holds its prefix and has room; a hit's prefill is $1 - r$ of its work
    (`dlbfluid._requests.sessions`)."""
    D, S = ln.sizes.slots, ln.sizes.servers
    cells = ln.cells
    # A service schedule: cell j's rows are kept in its clock's units, where the servers
    # run at unit speed (theory/requests.md, *Service schedules*); `now` is t there.
    clock = None if ln.clocks is None else jax.tree_util.tree_map(lambda a: a[j], ln.clocks)
    now = t if clock is None else clock.forward(t)
    comp = st.srv[j, :, 1 + D :]  # (S, Q)
    per = jnp.sum(comp > now, axis=-1, dtype=jnp.int32)
    total = jnp.sum(per)
    valid = jnp.arange(S) < st.active[j]
    s = JoinShortestQueue().choose(None, per, None, valid)
    if not isinstance(ln.leaf, JoinShortestQueue):
        # (the requests present at t = 0 still go round-robin: the same start for every
        # rule; the rule's uniforms are the admission's row's last columns)
        # (in the clock's units, the tokens still to process are the work still to do)
        tokens = cells.tokens_waiting(j, st.srv[j, :, : 1 + D], now, D)
        s = jnp.where(initial, s, ln.leaf.choose(tok[3:], per, tokens, valid))
    hit, seat = jnp.zeros((), bool), None
    if st.sess is not None and sid is not None:
        assert ln.affinity is not None and ln.sess is not None
        free = valid & (per < ln.sizes.queue) & ~initial
        seat = sess_.seat(ln.affinity, st.sess, j, s, sid, free)
        s, hit = seat.server, seat.hit
    pick = jnp.arange(S) == s
    row = st.srv[j, s]  # (the chosen server's row alone: a one-hot sum reads the block)
    pw, dw = cells.work(j, tok)
    if ln.sess is not None and sid is not None:
        pw = jnp.where(hit, (1.0 - ln.sess.reuse) * pw, pw)
    new_row, c, pf, vstart = serve(row, now, pw, dw, D)
    if clock is None:
        p0 = pf - pw  # (the prefill's start)
    else:  # (back to seconds: the completion, the prefill's start and end, the decode's start)
        c, p0, pf, vstart = clock.inverse(jnp.stack([c, jnp.maximum(now, row[0]), pf, vstart]))
    return _Placement(per, total, valid, s, pick, new_row, c, p0, pf, vstart, dw, hit, seat)


def probe_cells(ln: Lane, st: FifoState, t) -> FifoState:
    """Background probing at `t` (`OnlineEstimation.probing`): each real cell's sample of a
    request delivered at `t`, with fresh draws, that is not admitted (the probe measures,
    it does not load: `dlbfluid._requests.estimation`)."""
    assert st.est is not None and ln.estimation is not None and ln.est is not None
    n = ln.scn.n_cells
    key, sub = jr.split(st.est.key)
    toks = ln.cells.draw(sub, n, st.cand.dtype, ln.leaf.draws)
    no = jnp.zeros((), bool)

    def one(j, tok):
        p = _place(ln, st, j, t, tok, no)
        per_s = jnp.sum(jnp.where(p.pick, p.per, 0))
        ok = (ln.cells.servers[j] > 0) & jnp.any(p.pick & p.valid) & (per_s < ln.sizes.queue)
        return p.total, p.c, ok

    total, c, ok = jax.vmap(one)(jnp.arange(n), toks)
    est = dataclasses.replace(st.est, key=key)
    cfg, el = ln.estimation, ln.est

    def add(j, e):
        return est_.record(cfg, el, e, j, total[j], ln.scale, t, c[j], ok[j])

    return dataclasses.replace(st, est=jax.lax.fori_loop(0, n, add, est))


def start_tick(ln: Lane, st: FifoState, k) -> FifoState:
    """The tick's replica fractions (running servers, buffers, the running servers'
    integral) and its arrivals (module docstring, step 1)."""
    scn, setup, z = ln.scn, ln.setup, ln.sizes
    n, dtype, h = scn.n_cells, st.cand.dtype, setup.h
    t0 = k.astype(dtype) * h
    t1 = t0 + h
    frac, buffer = tick_capacity(scn, ln.scale, t0 + 0.5 * h, dtype)
    active = running(ln.cells.servers, frac)
    run_area = st.run_area + active.astype(dtype) * _overlap(t0, t1, ln.warmup, ln.horizon)

    win = jax.lax.dynamic_slice_in_dim(st.cand, st.ptr, z.candidates, axis=0)
    time = win[:, 0]
    valid = time < t1
    got = jnp.sum(valid.astype(jnp.int32)).astype(jnp.int32)
    too_many = got >= z.candidates
    i = win[:, 1].astype(jnp.int32)
    accept = valid & (win[:, 2] > 0)
    xc = st.xc[i]
    j = jnp.minimum(jnp.sum(xc <= (win[:, 3] * xc[:, -1])[:, None], -1), n - 1)
    sess = st.sess
    if sess is not None:
        assert ln.affinity is not None
        win_s = jax.lax.dynamic_slice_in_dim(sess.cand, st.ptr, z.candidates, axis=0)
        in_window = (time >= ln.warmup) & (time < ln.horizon)
        j, req, sess = sess_.resolve(ln.affinity, sess, win_s, st.ptr, got, i, j, accept, in_window)
    tau, m, r = setup.tau[i, j], setup.m[i, j], setup.r[i, j]
    v = k + m + (time - t0 + r >= h).astype(jnp.int32)
    slot = v % z.ring
    A = z.candidates
    before = jnp.arange(A)[None, :] < jnp.arange(A)[:, None]
    rank = jnp.sum((slot[:, None] == slot[None, :]) & accept[None, :] & before, -1)
    pos = st.inbox_n[slot] + rank.astype(jnp.int32)
    arc_full = accept & (pos >= z.inbox)
    put = accept & ~arc_full
    rows = jnp.where(put, slot, z.ring)
    inbox = st.inbox.at[rows, pos].set(jnp.stack([time + tau, time - tau], -1), mode="drop")
    to = j.astype(jnp.int32)[:, None] if sess is None else jnp.concatenate([j[:, None], req], -1)
    inbox_j = st.inbox_j.at[rows, pos].set(to.astype(jnp.int32), mode="drop")
    inbox_n = st.inbox_n.at[rows].add(1, mode="drop")
    s_ = st.stats
    in_win = time >= ln.warmup
    cells_ = jnp.arange(n)[None, :]
    arrivals = s_.arrivals + jnp.sum((i[:, None] == cells_) & (accept & in_win)[:, None], 0)
    drops = s_.drops + jnp.sum((j[:, None] == cells_) & (arc_full & in_win)[:, None], 0)
    est = st.est if st.est is None else dataclasses.replace(st.est, frac=frac)
    return dataclasses.replace(
        st,
        est=est,
        sess=sess,
        ptr=st.ptr + got,
        active=active,
        buffer=buffer,
        run_area=run_area,
        inbox=inbox,
        inbox_j=inbox_j,
        inbox_n=inbox_n,
        stats=dataclasses.replace(
            s_, arrivals=arrivals.astype(jnp.int32), drops=drops.astype(jnp.int32)
        ),
        overflow=st.overflow
        | _bit(too_many, OVERFLOW_EVENTS)
        | _bit(jnp.any(arc_full), OVERFLOW_ARCS),
    )


def pending(ln: Lane, st: FifoState, k):
    """`(C,)` the delivery times of tick `k` not yet admitted ($+\\infty$ past the
    tick's count)."""
    z = ln.sizes
    slot = k % z.ring
    keep = jnp.arange(z.inbox) < st.inbox_n[slot]
    return jnp.where(keep, st.inbox[slot, :, 0], jnp.inf)


def admit_next(ln: Lane, st: FifoState, todo, k):
    """Admit the lane's earliest delivery of tick `k` left in `todo` (a no-op when none)."""
    z = ln.sizes
    _, a = _first_min(todo)
    t = todo[a]
    ok = jnp.isfinite(t)
    slot = k % z.ring
    to, origin = st.inbox_j[slot, a], st.inbox[slot, a, 1]
    j, sid = to[0], None if st.sess is None else to[1:]
    st = admit(ln, st, k, j, jnp.where(ok, t, 0.0), origin, ok, jnp.zeros((), bool), sid)
    return st, todo.at[a].set(jnp.inf)


def finish(ln: Lane, st: FifoState, k) -> FifoState:
    """The end of tick `k`: the probes from the calendar's row (module docstring, step
    3), the counts at $t_{k+1}$, and every router's update (`dlbfluid._requests.loop.route`,
    shared with the event loop)."""
    scn, setup, z = ln.scn, ln.setup, ln.sizes
    n, dtype = scn.n_cells, st.x.dtype
    row = st.cal[k % z.calendar]  # (n, n + 1)
    # probes[i, j] = count_j(t_k) + the changes of cell j in segments 0 .. rank[i, j]
    before = jnp.arange(n + 1)[None, None, :] <= ln.rank[:, :, None]
    probes = st.count[None, :] + jnp.sum(jnp.where(before, row[None, :, :], 0), axis=-1)
    t_end = (k + 1).astype(dtype) * setup.h
    published = None if st.est is None else est_.published_model(st.est)
    x, xc, pstate, ring = route(
        ln,
        st.policy_state,
        st.obs_ring,
        probes.astype(dtype) / ln.scale,
        k,
        t_end,
        st.tick_drops,
        st.tick_arrivals,
        estimate=published,
    )
    slot = k % z.ring
    zi = jnp.zeros_like(st.tick_drops)
    stats = dataclasses.replace(st.stats, received=st.stats.received + st.tick_arrivals)
    sess = st.sess
    if sess is not None and ln.affinity is not None and ln.affinity.mode == "conditional":
        assert ln.sess is not None
        model = scn.estimate if published is None else published
        seen = ring[(k + 1) & (setup.hist - 1)]  # (what the routers read at t_{k+1})
        stay = sess_.stay_rule(ln.sess.saving, model, seen, setup.tau, scn.allowed)
        sess = dataclasses.replace(sess, stay=stay)
    return dataclasses.replace(
        st,
        sess=sess,
        stats=stats,
        overflow=st.overflow | routing_flag(x),
        count=(st.count + jnp.sum(row, axis=-1)).astype(jnp.int32),
        cal=st.cal.at[k % z.calendar].set(0),
        inbox_n=st.inbox_n.at[slot].set(0),
        x=x,
        xc=xc,
        policy_state=pstate,
        obs_ring=ring,
        tick_arrivals=zi,
        tick_drops=zi,
    )


def far_in(ln: Lane, st: FifoState, k) -> FifoState:
    """Move the far completions due before tick $k + W$ into the calendar (called every
    `chunk` ticks, at most $W/2$, so each enters at least $W/2$ ticks before its own)."""
    z, h = ln.sizes, ln.setup.h
    c = st.far
    kc = jnp.floor(c / h)
    due = jnp.isfinite(c) & (kc < (k + z.calendar).astype(c.dtype))
    kci = jnp.where(due, kc, 0).astype(jnp.int32)
    local = c - kci.astype(c.dtype) * h
    seg = jnp.sum(ln.sorted_offsets[:, None, :] <= local[:, :, None], -1).astype(jnp.int32)
    cells = jnp.broadcast_to(jnp.arange(c.shape[0])[:, None], c.shape)
    cal = st.cal.at[jnp.where(due, kci % z.calendar, z.calendar), cells, seg].add(-1, mode="drop")
    # The rest, compacted to the front of each cell's stack in their order (once per chunk).
    keep = jnp.isfinite(c) & ~due
    pos = jnp.where(keep, jnp.cumsum(keep, axis=-1, dtype=jnp.int32) - 1, z.far)
    left = jnp.full_like(c, jnp.inf).at[cells, pos].set(c, mode="drop")
    far_n = jnp.sum(keep, axis=-1, dtype=jnp.int32)
    return dataclasses.replace(st, cal=cal, far=left, far_n=far_n)


def initial_requests(ln: Lane):
    """`(cum,)` the cumulative initial counts $\\mathrm{round}(kN_j(0))$ by cell."""
    scn = ln.scn
    counts = jnp.where(scn.cell_mask, jnp.round(ln.scale * scn.initial_workload), 0)
    return jnp.cumsum(counts.astype(jnp.int32))


def admit_initial(ln: Lane, st: FifoState, r) -> FifoState:
    """Admit the `r`-th request present at $t = 0$ (in cell order; a no-op past the last):
    origin 0, joined to the shortest queue, so that cell $j$'s requests go round-robin."""
    cum = initial_requests(ln)
    ok = r < cum[-1]
    j = jnp.minimum(jnp.sum(cum <= r), ln.scn.n_cells - 1)
    zero = jnp.zeros((), st.cand.dtype)
    sid = None if st.sess is None else jnp.full((2,), -1, jnp.int32)
    return admit(ln, st, jnp.zeros((), jnp.int32), j, zero, zero, ok, jnp.ones((), bool), sid)


def run_tick(ln: Lane, k, st: FifoState) -> FifoState:
    """Tick `k` of a batch (`ln` `(B,)`, `st` `(B, R)`): arrivals, admissions in time order
    (one per lane per pass, while any lane has one left) and the end of the tick."""
    st = _batched(lambda a, s: start_tick(a, s, k))(ln, st)
    todo = _batched(lambda a, s: pending(a, s, k))(ln, st)

    def body(carry):
        s, t = carry
        return jax.vmap(jax.vmap(lambda a, s1, t1: admit_next(a, s1, t1, k), (None, 0, 0)))(
            ln, s, t
        )

    st, _ = jax.lax.while_loop(lambda c: jnp.any(jnp.isfinite(c[1])), body, (st, todo))
    return _batched(lambda a, s: finish(a, s, k))(ln, st)


def next_chunk(ln: Lane, k0, st: FifoState) -> FifoState:
    """The draws of the chunk that starts at tick `k0`, and the far completions due
    (`redraw`, `refill`, `far_in`): called between chunks, so that no tick carries a
    conditional over the whole state (XLA copies a conditional's operands)."""
    st = _batched(lambda a, s1: redraw(a, s1, k0))(ln, st)
    st = _batched(refill)(ln, st)
    return _batched(lambda a, s1: far_in(a, s1, k0))(ln, st)


def initial_state(ln: Lane, keys) -> FifoState:
    """The batch's state at $t = 0$: chunk 0 drawn and the requests present at $t = 0$
    admitted (one per lane per pass)."""
    st = _batched(init_lane)(ln, keys)
    total = jnp.max(jax.vmap(lambda a: initial_requests(a)[-1])(ln))

    def body(r, s):
        return _batched(lambda a, s1: admit_initial(a, s1, r))(ln, s)

    return jax.lax.fori_loop(0, total, body, st)


def utilisation(ln: Lane, st: FifoState):
    """`(n,)` each cell's utilisation over the window: the busy servers' time integral over
    the running servers' (theory/requests.md, *Utilisation*; 0 for a padded cell)."""
    frac_busy = jnp.where(st.run_area > 0, st.stats.busy / jnp.maximum(st.run_area, 1e-300), 0.0)
    return jnp.where(ln.cells.servers > 0, frac_busy, 0.0)
