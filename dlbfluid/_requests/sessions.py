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
    """The sessions' state of one lane.

    **Fields:** `cand` `(rows + A, 2)` per arrival candidate of the chunk its slot (-1: not
    a session request) and whether it starts a new session; `current` `(n M,)` each slot's
    session id; `home` `(n M,)` the cell of each slot's session (-1: none yet); `server`
    `(n M,)` where the slot's session was last admitted, cell x S + server (-1: not yet:
    the servers' session -> server map); `next_id`; `inbox` `(L, C_in, 2)` the session id
    of each delivery (-1: none) and its slot; `tag` `(n, S, C)` the
    sessions whose prefixes each server holds (-1: empty) and `used` their last use;
    `stay` `(n, n)` the conditional rule of the tick (`stay_rule`); over the statistics
    window: `hits`, `per_server` `(n, S)` the requests each server admitted, `returning`
    the session requests that had a cell to return to (a predecessor's, or a home) and
    `moved` those of them routed to another cell.
    """

    cand: Int[Array, "R 2"]
    current: Int[Array, " nM"]
    home: Int[Array, " nM"]
    server: Int[Array, " nM"]
    next_id: Int[Array, ""]
    inbox: Int[Array, "L C 2"]
    tag: Int[Array, "n S C"]
    used: Float[Array, "n S C"]
    stay: Bool[Array, "n n"]
    hits: Int[Array, ""]
    per_server: Int[Array, "n S"]
    returning: Int[Array, ""]
    moved: Int[Array, ""]


def session_lane(aff: Affinity, workload, lam_max, scale, cache_n, saving_unit) -> SessLane:
    """A scenario's `SessLane` at scale $k$ (`lam_max` `(n,)` the profiles' peak rates;
    `saving_unit` `(n,)` each cell's mean prefill time, $\\sigma_j/r$)."""
    w = workload
    dtype = lam_max.dtype
    f, L, T, s = w.session_fraction, w.session_length, w.think_time, w.session_skew
    m_i = jnp.clip(jnp.ceil(scale * f * lam_max * T), 1, aff.slots).astype(jnp.int32)
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


def init_sessions(aff: Affinity, n: int, servers: int, rows: int, ring: int, inbox: int, dtype):
    """The sessions' state at $t = 0$ (one session per slot, nothing cached)."""
    nm = n * aff.slots
    return SessState(
        cand=jnp.full((rows, 2), -1, jnp.int32),
        current=jnp.arange(nm, dtype=jnp.int32),
        home=jnp.full((nm,), -1, jnp.int32),
        server=jnp.full((nm,), -1, jnp.int32),
        next_id=jnp.asarray(nm, jnp.int32),
        inbox=jnp.full((ring, inbox, 2), -1, jnp.int32),
        tag=jnp.full((n, servers, aff.cache), -1, jnp.int32),
        used=jnp.full((n, servers, aff.cache), -jnp.inf, dtype),
        stay=jnp.ones((n, n), bool),
        hits=jnp.zeros((), jnp.int32),
        per_server=jnp.zeros((n, servers), jnp.int32),
        returning=jnp.zeros((), jnp.int32),
        moved=jnp.zeros((), jnp.int32),
    )


def draw(sl: SessLane, key, roots, rows: int, pad: int):
    """`(rows + pad, 2)` the session columns of a chunk's candidates of roots `roots`
    `(rows,)` (their own key: the candidates' other draws are the same with or without
    sessions); the `pad` rows past them are not session requests."""
    dtype = sl.slot_cum.dtype
    u = jr.uniform(key, (rows, 3), dtype)
    n, M = sl.slot_cum.shape
    # One binary search over every root's cumulative weights, shifted by the root's index
    # so that they increase across roots (root i's lie in (i, i + 1]): no (rows, M) gather.
    flat = (jnp.arange(n, dtype=dtype)[:, None] + sl.slot_cum).reshape(-1)
    pos = jnp.searchsorted(flat, roots.astype(dtype) + u[:, 1], side="right")
    slot = jnp.clip(pos - roots * M, 0, M - 1).astype(jnp.int32)
    session = u[:, 0] < sl.fraction
    new = u[:, 2] < sl.renew[roots, slot]
    cols = jnp.stack([jnp.where(session, slot, -1), new.astype(jnp.int32)], axis=-1)
    return jnp.concatenate([cols, jnp.full((pad, 2), -1, jnp.int32)])


def resolve(aff: Affinity, ss: SessState, win, i, routed, accept, in_window=None):
    """The sessions of a tick's candidates `win` `(A, 2)` (roots `i`, cells `routed` by the
    policy, `accept`: real requests): each one's cell under the affinity mode, its session
    id (-1: none) and slot `(A, 2)`, and the state after them (slots' sessions and homes; the requests in
    the statistics window, `in_window` `(A,)`, counted in `returning` and `moved`).

    Candidates are in time order. A request's predecessor is the latest earlier one of its
    session in the tick, or else the session's home; `sticky` follows the predecessor's
    cell, `conditional` follows it where `ss.stay` says so, both route the first request
    of a session as the policy does. A chain of requests of one session inside a tick is
    followed to its end (a fixed point, at most `A` passes; in practice one or two)."""
    A = win.shape[0]
    M = aff.slots
    idx = jnp.arange(A)
    is_s = accept & (win[:, 0] >= 0)
    g = i * M + jnp.maximum(win[:, 0], 0)
    new = is_s & (win[:, 1] > 0)
    nid = ss.next_id + jnp.cumsum(new.astype(jnp.int32)) - 1
    same = (g[:, None] == g[None, :]) & is_s[:, None] & is_s[None, :]  # [a, b]
    upto = idx[None, :] <= idx[:, None]
    starts = same & upto & new[None, :]
    last_new = jnp.max(jnp.where(starts, idx[None, :], -1), axis=-1)
    fresh = last_new >= 0
    sid = jnp.where(is_s, jnp.where(fresh, nid[jnp.maximum(last_new, 0)], ss.current[g]), -1)
    chain = same & (idx[None, :] < idx[:, None]) & (idx[None, :] >= last_new[:, None])
    pred = jnp.max(jnp.where(chain, idx[None, :], -1), axis=-1)
    prior = jnp.where(fresh, -1, ss.home[g])
    routed = routed.astype(jnp.int32)

    def decide(cell):
        prev = jnp.where(pred >= 0, cell[jnp.maximum(pred, 0)], prior)
        keep = prev >= 0
        if aff.mode == "conditional":
            keep = keep & ss.stay[i, jnp.maximum(prev, 0)]
        return jnp.where(is_s & keep, prev, routed)

    if aff.mode == "off":
        cell = routed
    else:

        def body(c):
            cell, _, n = c
            nxt = decide(cell)
            return nxt, jnp.any(nxt != cell), n + 1

        cell = jax.lax.while_loop(
            lambda c: c[1] & (c[2] < A), body, (decide(routed), jnp.ones((), bool), 0)
        )[0]
    prev = jnp.where(pred >= 0, cell[jnp.maximum(pred, 0)], prior)
    back = is_s & (prev >= 0) & (True if in_window is None else in_window)
    later = jnp.any(same & (idx[None, :] > idx[:, None]), axis=-1)
    last = is_s & ~later
    out = ss.current.shape[0]  # (an index past the arrays: the write is dropped)
    current = ss.current.at[jnp.where(new, g, out)].max(nid, mode="drop")
    server = ss.server.at[jnp.where(new, g, out)].set(-1, mode="drop")
    home = ss.home.at[jnp.where(last, g, out)].set(cell, mode="drop")
    ss = dataclasses.replace(
        ss,
        current=current,
        home=home,
        server=server,
        next_id=(ss.next_id + jnp.sum(new.astype(jnp.int32))).astype(jnp.int32),
        returning=(ss.returning + jnp.sum(back.astype(jnp.int32))).astype(jnp.int32),
        moved=(ss.moved + jnp.sum((back & (cell != prev)).astype(jnp.int32))).astype(jnp.int32),
    )
    return cell, jnp.stack([sid, g.astype(jnp.int32)], axis=-1), ss


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


def holds(ss: SessState, j, s, sid):
    """Whether server `s` of cell `j` holds session `sid`'s prefix (False for -1)."""
    return jnp.any(ss.tag[j, s] == sid) & (sid >= 0)


def last_server(ss: SessState, j, req):
    """`(server, found)`: the server of cell `j` where the session of `req` = (id, slot)
    was last admitted, and whether it is there and still holds its prefix (the servers'
    session -> server map: one cache row read, not the cell's)."""
    sid, g = req[0], req[1]
    S = ss.tag.shape[1]
    w = ss.server[g]
    mine = (sid >= 0) & (ss.current[g] == sid) & (w >= 0) & (w // S == j)
    s = jnp.where(mine, w % S, 0)
    return s, mine & holds(ss, j, s, sid)


def admit(sl: SessLane, ss: SessState, j, s, req, hit, t, do, in_window) -> SessState:
    """A request of session `req` = (id, slot) admitted (if `do`) to server `s` of cell `j`
    at `t`: its prefix enters (or is refreshed in) the server's cache, evicting the least
    recently used, and the slot's session is mapped to the server; the window's counts."""
    sid, g = req[0], req[1]
    C = ss.tag.shape[-1]
    tags, used = ss.tag[j, s], ss.used[j, s]
    room = jnp.arange(C) < sl.cache_n[j]
    match = jnp.argmax(tags == sid)
    lru = jnp.argmin(jnp.where(room, used, jnp.inf))
    e = jnp.where(hit, match, lru)
    put = do & (sid >= 0) & (sl.cache_n[j] > 0)
    S = ss.tag.shape[1]
    row = jnp.where(put, s, S)
    count = (do & in_window).astype(jnp.int32)
    mapped = do & (sid >= 0) & (ss.current[g] == sid)
    return dataclasses.replace(
        ss,
        server=ss.server.at[jnp.where(mapped, g, ss.server.shape[0])].set(
            (j * S + s).astype(jnp.int32), mode="drop"
        ),
        tag=ss.tag.at[j, row, e].set(sid, mode="drop"),
        used=ss.used.at[j, row, e].set(t, mode="drop"),
        hits=ss.hits + (count * hit).astype(jnp.int32),
        per_server=ss.per_server.at[j, s].add(count),
    )


def report(ss: SessState) -> dict:
    """`cache_hit_rate` (hits over the requests admitted in the window),
    `busiest_server_share` (the largest share of them that one server admitted) and
    `session_move_rate` (the session requests in the window that had a cell to return to
    and were routed to another one, over those that had one); 0 where there is none."""
    total = jnp.sum(ss.per_server)
    dtype = ss.used.dtype
    denom = jnp.maximum(total, 1).astype(dtype)
    return dict(
        cache_hit_rate=ss.hits.astype(dtype) / denom,
        busiest_server_share=jnp.max(ss.per_server).astype(dtype) / denom,
        session_move_rate=ss.moved.astype(dtype) / jnp.maximum(ss.returning, 1).astype(dtype),
    )
