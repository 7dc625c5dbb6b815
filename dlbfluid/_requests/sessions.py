"""Sessions, prefix caches and affinity routing in the admission-time engine
(theory/affinity.md; seed §3.5).

**Sessions.** A fraction $f$ of root $i$'s requests belong to sessions. Root $i$ has
$M_i = \\max(1, \\lceil kf\\bar\\lambda_iT_{th}\\rceil)$ session slots (by Little's law, the
sessions active at once when each is a request every $T_{th}$ at the root's peak rate
$k\\bar\\lambda_i$); a session request picks slot $u$ with probability
$w_u \\propto (u+1)^{-s}$ (skew $s$; 0: uniform) and starts a new session there with
probability $\\rho_u = \\min(1, 1/(LM_iw_u))$, else continues the slot's session. Every
slot then starts sessions at the same rate and a session lasts about $LT_{th}$, so that
sessions have $L$ requests on average and, with $s > 0$, a hot slot's sessions carry many
more than a cold one's. Session ids are integers, unique in a lane: the slots' sessions
at $t = 0$ are $0 \\ldots nM - 1$, and new ones are numbered on from there.

**Prefix caches.** Each server of cell $j$ holds the prefixes of `cache_sessions[j]`
sessions, the least recently used evicted first. A session request admitted to a server
that holds its session's prefix (a *hit*) is prefilled in $1 - r$ of its time
(`prefix_reuse` $r$); every session request admitted leaves its prefix there.

**Affinity** (`Affinity.mode`): `off`, every request routed by the policy and joined by
the leaf rule; `sticky`, a session's requests go to the cell of its first request (a root
keeps a session -> cell map) and, in the cell, to the server that holds its prefix when it
runs and has room (a server keeps session -> prefix); `conditional`, a session's next
request returns to its cell $j$ while $E_{ij} - \\sigma_j < \\min_{l \\ne j}E_{il}$
(`stay_rule`), else it is routed as usual and the session moves to its new cell.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Bool, Float, Int

from .._defaults import AFFINITY_MODES
from .._scenario.parse import CACHE_SESSIONS


class Affinity(eqx.Module):
    """The static configuration of sessions in a run (`simulate_requests(affinity=...)` with
    a scenario that has sessions): `mode` (one of `AFFINITY_MODES`), `slots` $M$ the slot
    axis (the largest $M_i$), `cache` $C$ the cache axis (the largest `cache_sessions`)."""

    mode: str
    slots: int
    cache: int

    def __check_init__(self):
        if self.mode not in AFFINITY_MODES:
            raise ValueError(
                f"affinity = {self.mode!r} is invalid: allowed {', '.join(AFFINITY_MODES)}"
            )


class SessLane(eqx.Module):
    """What a lane reads about sessions (module docstring).

    **Fields:** `slot_cum` `(n, M)` each root's cumulative slot probabilities (1 past its
    $M_i$ slots); `renew` `(n, M)` $\\rho_u$; `fraction` $f$; `reuse` $r$; `saving` `(n,)`
    $\\sigma_j$, the prefill time a hit saves on average at cell $j$ (s); `cache_n` `(n,)`
    the cache entries of cell $j$'s servers.
    """

    slot_cum: Float[Array, "n M"]
    renew: Float[Array, "n M"]
    fraction: Float[Array, ""]
    reuse: Float[Array, ""]
    saving: Float[Array, " n"]
    cache_n: Int[Array, " n"]


class SessState(eqx.Module):
    """The sessions' state of one lane (a delivery's session id and slot travel with it
    in `admission.FifoState.inbox_j`).

    **Fields:** `cand` `(rows + A, 5)` per arrival candidate of the chunk (`link`): its
    session id (-1: not a session request), its slot $g = iM + u$, the row of its
    session's previous request in the chunk (-1: none, or it starts the session), the row
    of the next request of its slot in the chunk (`NONE` past the last) and whether it
    starts a new session; `current` `(n M,)` each slot's latest session id (as of the
    chunk's end); `home` `(n M,)` the cell of each slot's session (-1: none yet);
    `server` `(n M, 2)` the servers' session -> server map, one entry per slot: where a
    session of the slot was last admitted (cell x S + server) and that session's id (-1:
    none); `next_id`; `cache` `(n, S, C, 2)` the sessions whose prefixes each server holds
    (-1: empty) and their last use (the lane's admission count then, -1: never); `stay`
    `(n, n)` the conditional rule of the tick (`stay_rule`); over the statistics window:
    `hits`, `per_server` `(n, S)` the requests each server admitted, `returning` the
    session requests that had a cell to return to (a predecessor's, or a home) and `moved`
    those of them routed to another cell.
    """

    cand: Int[Array, "R 5"]
    current: Int[Array, " nM"]
    home: Int[Array, " nM"]
    server: Int[Array, "nM 2"]
    next_id: Int[Array, ""]
    cache: Int[Array, "n S C 2"]
    stay: Bool[Array, "n n"]
    hits: Int[Array, ""]
    per_server: Int[Array, "n S"]
    returning: Int[Array, ""]
    moved: Int[Array, ""]


NONE = 1 << 30
"""The `cand` row index of "no next request in the chunk" (past every row)."""


def slot_demand(xp, scale, fraction, lam_max, think_time):
    """$kf\\bar\\lambda_iT_{th}$ rounded up: the sessions active at once at a root
    (`xp`: numpy when a run is sized, `jax.numpy` in a lane; broadcast operands)."""
    return xp.ceil(scale * fraction * lam_max * think_time)


def cache_entries(xp, servers, shape):
    """`shape` each cell's prefix-cache entries per server: its `servers.cache_sessions`,
    or `CACHE_SESSIONS` for a cell without a `servers` object."""
    if servers is None:
        return xp.full(shape, CACHE_SESSIONS)
    return xp.where(xp.asarray(servers.mask), xp.asarray(servers.cache_sessions), CACHE_SESSIONS)


def session_lane(aff: Affinity, workload, lam_max, scale, cache_n, saving_unit) -> SessLane:
    """A scenario's `SessLane` at scale $k$ (`lam_max` `(n,)` the profiles' peak rates;
    `saving_unit` `(n,)` each cell's mean prefill time, $\\sigma_j/r$)."""
    w = workload
    dtype = lam_max.dtype
    f, L, T, s = w.session_fraction, w.session_length, w.think_time, w.session_skew
    m_i = jnp.clip(slot_demand(jnp, scale, f, lam_max, T), 1, aff.slots).astype(jnp.int32)
    u = jnp.arange(aff.slots)
    on = u[None, :] < m_i[:, None]
    wt = jnp.where(on, (u[None, :] + 1.0).astype(dtype) ** (-s), 0.0)
    wt = wt / jnp.sum(wt, axis=-1, keepdims=True)
    cum = jnp.where(on, jnp.cumsum(wt, axis=-1), 1.0)
    renew = jnp.minimum(1.0, 1.0 / jnp.maximum(L * m_i[:, None] * wt, 1e-300))
    return SessLane(
        slot_cum=cum.astype(dtype),
        renew=jnp.where(on, renew, 1.0).astype(dtype),
        fraction=f.astype(dtype),
        reuse=w.prefix_reuse.astype(dtype),
        saving=(w.prefix_reuse * saving_unit).astype(dtype),
        cache_n=jnp.minimum(cache_n, aff.cache).astype(jnp.int32),
    )


def init_sessions(aff: Affinity, n: int, servers: int, rows: int):
    """The sessions' state at $t = 0$ (one session per slot, nothing cached)."""
    nm = n * aff.slots
    return SessState(
        cand=jnp.broadcast_to(jnp.asarray([-1, 0, -1, NONE, 0], jnp.int32), (rows, 5)),
        current=jnp.arange(nm, dtype=jnp.int32),
        home=jnp.full((nm,), -1, jnp.int32),
        server=jnp.full((nm, 2), -1, jnp.int32),
        next_id=jnp.asarray(nm, jnp.int32),
        cache=jnp.full((n, servers, aff.cache, 2), -1, jnp.int32),
        stay=jnp.ones((n, n), bool),
        hits=jnp.zeros((), jnp.int32),
        per_server=jnp.zeros((n, servers), jnp.int32),
        returning=jnp.zeros((), jnp.int32),
        moved=jnp.zeros((), jnp.int32),
    )


def draw(sl: SessLane, ss: SessState, key, roots, keep, rows: int, pad: int) -> SessState:
    """The sessions of a chunk's candidates of roots `roots` `(rows,)` (`keep`: the real
    requests among them, those thinning keeps before the chunk's end), drawn from their own
    key (the candidates' other draws are the same with or without sessions): each one's
    slot and whether it starts a new session, linked by `link`; the `pad` rows past them
    are not session requests. Who belongs to which session depends on the draws alone, not
    on the routing, so the whole chunk is linked at once."""
    dtype = sl.slot_cum.dtype
    u = jr.uniform(key, (rows, 3), dtype)
    n, M = sl.slot_cum.shape
    # One binary search over every root's cumulative weights, shifted by the root's index
    # so that they increase across roots (root i's lie in (i, i + 1]): no (rows, M) gather.
    flat = (jnp.arange(n, dtype=dtype)[:, None] + sl.slot_cum).reshape(-1)
    pos = jnp.searchsorted(flat, roots.astype(dtype) + u[:, 1], side="right")
    slot = jnp.clip(pos - roots * M, 0, M - 1).astype(jnp.int32)
    is_s = keep & (u[:, 0] < sl.fraction)
    new = u[:, 2] < sl.renew[roots, slot]
    g = (roots * M + slot).astype(jnp.int32)
    cols, ss = link(ss, g, new, is_s)
    none = jnp.broadcast_to(jnp.asarray([-1, 0, -1, NONE, 0], jnp.int32), (pad, 5))
    return dataclasses.replace(ss, cand=jnp.concatenate([cols, none]))


def link(ss: SessState, g, new, is_s):
    """`(cols, ss)`: the `cand` columns (`SessState`) of candidates in time order, of slots
    `g`, starting a new session where `new`, session requests where `is_s`, and the state
    after them (`current`, `next_id`). New sessions are numbered in time order from
    `ss.next_id`; a request that does not start one continues its slot's latest session
    before it. One stable sort by slot groups each slot's requests in time order (no
    `(rows, rows)` comparison): a request's session is that of the latest start at or
    before it in its group, or the slot's `current` id when there is none."""
    R = g.shape[0]
    nm = ss.current.shape[0]
    key = jnp.where(is_s, g, nm)
    order = jnp.argsort(key, stable=True)
    p = jnp.arange(R)
    gs = key[order]
    starts = new & is_s
    ns = starts[order]
    step = gs[1:] != gs[:-1]
    head = jnp.concatenate([jnp.ones((1,), bool), step])
    tail = jnp.concatenate([step, jnp.ones((1,), bool)])
    first = jax.lax.cummax(jnp.where(head, p, 0))
    latest = jax.lax.cummax(jnp.where(ns, p, -1))
    nid = ss.next_id + jnp.cumsum(starts.astype(jnp.int32)) - 1
    sid = jnp.where(
        latest >= first, nid[order[jnp.maximum(latest, 0)]], ss.current[jnp.minimum(gs, nm - 1)]
    )
    pred = jnp.where(ns | head, -1, jnp.roll(order, 1))
    nxt = jnp.where(tail, NONE, jnp.roll(order, -1))
    cols = (
        jnp.zeros((R, 3), jnp.int32)
        .at[order]
        .set(jnp.stack([sid, pred, nxt], axis=-1).astype(jnp.int32))
    )
    cols = jnp.stack(
        [
            jnp.where(is_s, cols[:, 0], -1),
            jnp.where(is_s, g, 0),
            jnp.where(is_s, cols[:, 1], -1),
            jnp.where(is_s, cols[:, 2], NONE),
            starts.astype(jnp.int32),
        ],
        axis=-1,
    )
    out = jnp.where(starts, g, nm)  # (an index past the arrays: the write is dropped)
    ss = dataclasses.replace(
        ss,
        current=ss.current.at[out].max(nid, mode="drop"),
        next_id=(ss.next_id + jnp.sum(starts.astype(jnp.int32))).astype(jnp.int32),
    )
    return cols, ss


def resolve(aff: Affinity, ss: SessState, win, base, got, i, routed, accept, in_window=None):
    """The sessions of a tick's candidates `win` `(A, 5)` (`cand`'s rows from `base`, the
    first `got` of them the tick's; roots `i`, cells `routed` by the policy, `accept`: real
    requests): each one's cell under the affinity mode, its session id (-1: none) and slot
    `(A, 2)`, and the state after them (homes; the requests in the statistics window,
    `in_window` `(A,)`, counted in `returning` and `moved`).

    A request's predecessor is its session's previous request when that is in the tick,
    or else the session's home (none for a request that starts a session); `sticky`
    follows the predecessor's cell, `conditional` follows it where `ss.stay` says so,
    both route the first request of a session as the policy does. A chain of requests of
    one session inside a tick is followed to its end (a fixed point, at most `A` passes;
    none past the first where no session has two requests in the tick)."""
    A = win.shape[0]
    sid, g, pred, nxt, new = (win[:, c] for c in range(5))
    is_s = accept & (sid >= 0)
    inside = is_s & (pred >= base)
    at = jnp.clip(pred - base, 0, A - 1)
    prior = jnp.where(new > 0, -1, ss.home[g])
    routed = routed.astype(jnp.int32)

    def previous(cell):
        return jnp.where(inside, cell[at], prior)

    def decide(cell):
        prev = previous(cell)
        keep = prev >= 0
        if aff.mode == "conditional":
            keep = keep & ss.stay[i, jnp.maximum(prev, 0)]
        return jnp.where(is_s & keep, prev, routed)

    if aff.mode == "off":
        cell = routed
    else:

        def body(c):
            cell, _, n = c
            nxt_ = decide(cell)
            return nxt_, jnp.any(nxt_ != cell), n + 1

        # (one pass settles every request whose predecessor is not in the tick: the loop
        # runs only where a session has two requests in the tick)
        cell = jax.lax.while_loop(
            lambda c: c[1] & (c[2] < A), body, (decide(routed), jnp.any(inside), 0)
        )[0]
    prev = previous(cell)
    back = is_s & (prev >= 0) & (True if in_window is None else in_window)
    last = is_s & (nxt >= base + got)  # (the last of its slot in the tick)
    out = ss.home.shape[0]
    ss = dataclasses.replace(
        ss,
        home=ss.home.at[jnp.where(last, g, out)].set(cell, mode="drop"),
        returning=(ss.returning + jnp.sum(back.astype(jnp.int32))).astype(jnp.int32),
        moved=(ss.moved + jnp.sum((back & (cell != prev)).astype(jnp.int32))).astype(jnp.int32),
    )
    return cell, jnp.stack([jnp.where(is_s, sid, -1), g], axis=-1), ss


def stay_rule(saving, latency_model, workload, tau, allowed):
    """`(n, n)` the conditional rule at root $i$ for a session at cell $j$: stay while
    $E_{ij} - \\sigma_j < \\min_{l \\ne j, (i,l) \\in \\mathcal A}E_{il}$, with
    $E_{ij} = \\ell_j(\\hat N_{ij}) + 2\\tau_{ij}$ the latency the root expects (the
    routers' latency model at their observed workloads `workload` `(n, n)`) and
    $\\sigma_j$ = `saving` the prefill time a hit saves (True where $i$ has no other
    cell)."""
    lat = jax.vmap(latency_model.latency)(workload) + 2.0 * tau
    cost = jnp.where(allowed, lat, jnp.inf)
    n = cost.shape[-1]
    best = jnp.argmin(cost, axis=-1)
    first = jnp.min(cost, axis=-1)
    second = jnp.min(jnp.where(jnp.arange(n)[None, :] == best[:, None], jnp.inf, cost), axis=-1)
    alt = jnp.where(jnp.arange(n)[None, :] == best[:, None], second[:, None], first[:, None])
    return (cost - saving[None, :] < alt) | ~jnp.isfinite(alt)


def holds(row, sid):
    """Whether servers whose cache rows are `row` `(..., C, 2)` hold session `sid`'s prefix
    `(...)` (False for -1)."""
    return jnp.any(row[..., 0] == sid, axis=-1) & (sid >= 0)


class Seat(eqx.Module):
    """Where a session request is admitted (`seat`): the `server`, whether it holds the
    session's prefix (`hit`), its cache row `row` `(C, 2)` and the id in the request's
    slot's entry of the session -> server map (`owner`)."""

    server: Array
    hit: Array
    row: Array
    owner: Array


def seat(aff: Affinity, ss: SessState, j, chosen, req, free) -> Seat:
    """The server of cell `j` for a request of session `req` = (id, slot) that the leaf
    rule would send to `chosen`: under `sticky` and `conditional` the server where the
    session was last admitted (the servers' session -> server map, one entry per slot:
    the server and the id of the session it was written for) if it still holds the prefix
    and is `free` `(S,)` (running, with room), else `chosen`. The two candidates' cache
    rows are read together, so an admission reads the map once and the caches once."""
    sid, g = req[0], req[1]
    S = ss.cache.shape[1]
    entry = ss.server[g]
    w, owner = entry[0], entry[1]
    if aff.mode == "off":
        row = ss.cache[j, chosen]
        return Seat(chosen, holds(row, sid), row, owner)
    mine = (sid >= 0) & (owner == sid) & (w >= 0) & (w // S == j)
    last = jnp.where(mine, w % S, 0)
    rows = ss.cache[j, jnp.stack([last, chosen])]  # (2, C, 2)
    has = holds(rows, sid)
    back = mine & has[0] & jnp.any((jnp.arange(S) == last) & free)
    return Seat(
        jnp.where(back, last, chosen), back | has[1], jnp.where(back, rows[0], rows[1]), owner
    )


def admit(sl: SessLane, ss: SessState, j, req, place: Seat, stamp, do, in_window) -> SessState:
    """A request of session `req` = (id, slot) admitted (if `do`) at `place` in cell `j` as
    the lane's admission `stamp`: its prefix enters (or is refreshed in) the server's cache,
    evicting the least recently used, and the slot's entry of the session -> server map
    points to the server; the window's counts."""
    sid, g = req[0], req[1]
    s, row = place.server, place.row
    C = row.shape[0]
    S = ss.cache.shape[1]
    cap = sl.cache_n[j]
    # One pass: the session's own entry on a hit (key -2), else the least recently used of
    # the first `cap` entries (an empty one has stamp -1; those past `cap` are never used).
    own = place.hit & (row[:, 0] == sid)
    key = jnp.where(own, -2, jnp.where(jnp.arange(C) < cap, row[:, 1], jnp.iinfo(jnp.int32).max))
    e = jnp.argmin(key)
    put = do & (sid >= 0) & (cap > 0)
    count = (do & in_window).astype(jnp.int32)
    # (a slot's later session takes the entry; sessions are numbered in time order)
    mapped = do & (sid >= 0) & (sid >= place.owner)
    entry = jnp.stack([j * S + s, sid]).astype(jnp.int32)
    here = (jnp.arange(ss.per_server.shape[0])[:, None] == j) & (jnp.arange(S)[None, :] == s)
    return dataclasses.replace(
        ss,
        server=ss.server.at[jnp.where(mapped, g, ss.server.shape[0])].set(entry, mode="drop"),
        cache=ss.cache.at[j, jnp.where(put, s, S), e].set(
            jnp.stack([sid, stamp]).astype(jnp.int32), mode="drop"
        ),
        hits=ss.hits + (count * place.hit).astype(jnp.int32),
        per_server=ss.per_server + jnp.where(here, count, 0),
    )


def report(ss: SessState, dtype) -> dict:
    """`cache_hit_rate` (hits over the requests admitted in the window),
    `busiest_server_share` (the largest share of them that one server admitted) and
    `session_move_rate` (the session requests in the window that had a cell to return to
    and were routed to another one, over those that had one), as `dtype`; 0 where there is
    none."""
    total = jnp.sum(ss.per_server)
    denom = jnp.maximum(total, 1).astype(dtype)
    return dict(
        cache_hit_rate=ss.hits.astype(dtype) / denom,
        busiest_server_share=jnp.max(ss.per_server).astype(dtype) / denom,
        session_move_rate=ss.moved.astype(dtype) / jnp.maximum(ss.returning, 1).astype(dtype),
    )
