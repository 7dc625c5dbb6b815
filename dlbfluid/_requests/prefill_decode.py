"""`servers` cells of seed App. B: disaggregated prefill/decode servers with per-request
token counts (theory/requests.md, *App.-B cell*)."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Bool, Float, Int

from .._scenario import Workload
from .cells import AbstractCells
from .servers import running


class PrefillDecodeState(eqx.Module):
    """Requests present at the servers of every cell (`S` servers, rings of `Q`, `D` decode
    slots per server).

    **Prefill:** `p_origin`, `p_work`, `p_decode` `(n, S, Q)` a FIFO ring per server of the
    requests waiting for or in prefill (origin, prefill time $Pt_p$, decode time $Dt_d$),
    from `p_head` of length `p_size` `(n, S)`; `p_done` `(n, S)` the end of the head's
    prefill ($+\\infty$ when the engine is idle).
    **Decode:** `w_origin`, `w_work` `(n, S, Q)` a FIFO ring per server of the requests
    prefilled and waiting for a slot, from `w_head` of length `w_size`; `s_done`,
    `s_origin` `(n, S, D)` each slot's end of decode ($+\\infty$ when free) and request;
    `s_busy` `(n, S)` busy slots.
    **Per cell** (caches read by the loop every event, so that it reads no per-server
    array the event then writes): `cnt` requests present, `p_busy` busy prefill engines,
    `d_busy` busy decode slots, `(n,)` each.
    **Other:** `nxt` `(n, S)` each server's next event time (a cache of
    $\\min(p_{done}, \\min_d s_{done})$); `tokens` `(A, 3)` the tick's block of draws
    (prompt tokens, output tokens, a unit exponential), `drawn` its rows used by
    admissions; `key` the PRNG key of the draws; `read` `(3,)` the values the event's
    completion read from the prefill rings (see `admit`); `active` `(n,)` the servers
    running in the current tick (`servers.running`).
    """

    p_origin: Float[Array, "n S Q"]
    p_work: Float[Array, "n S Q"]
    p_decode: Float[Array, "n S Q"]
    p_head: Int[Array, "n S"]
    p_size: Int[Array, "n S"]
    p_done: Float[Array, "n S"]
    w_origin: Float[Array, "n S Q"]
    w_work: Float[Array, "n S Q"]
    w_head: Int[Array, "n S"]
    w_size: Int[Array, "n S"]
    s_done: Float[Array, "n S D"]
    s_origin: Float[Array, "n S D"]
    s_busy: Int[Array, "n S"]
    cnt: Int[Array, " n"]
    p_busy: Int[Array, " n"]
    d_busy: Int[Array, " n"]
    nxt: Float[Array, "n S"]
    tokens: Float[Array, "A 3"]
    drawn: Int[Array, ""]
    key: Array
    read: Float[Array, " 3"]
    active: Int[Array, " n"]


class PrefillDecodeCells(AbstractCells):
    """Cell $j$ as `servers[j]` App.-B servers (seed App. B): each has one FIFO prefill
    engine and `decode_slots[j]` decode slots (decode engines x slots per engine).

    **Law.** A request draws, at its admission, $P = \\delta_p + G_p$ prompt and
    $D = \\delta_o + G_o$ output tokens, $G \\sim \\mathrm{Gamma}(\\alpha, \\theta)$ of the
    scenario's `Workload`, independent, real-valued (not rounded). Its prefill takes
    $Pt_{p,j}$ on the server's prefill engine, in FIFO order; then its decode takes
    $Dt_{d,j}$ on one slot, the first free one (slots are identical: the per-token time
    does not depend on how many slots of an engine are busy, so the engines pool into one
    FIFO queue of `decode_slots` servers); a prefilled request that finds every slot busy
    waits, FIFO. It leaves at the end of its decode (or of its prefill when its decode
    time is 0).

    **Leaf routing:** a request that reaches cell $j$ joins the server with the fewest
    requests present (prefill queue, decode queue and busy slots together), the lowest
    index on ties.

    **Replica schedule:** as `FifoServers`: in a tick with replica fraction $c_j$ the
    servers $0 .. a_j - 1$ run ($a_j = \\max(1, \\mathrm{round}(c_j\\,$`servers[j]`$))$,
    `servers.running`), only they take new requests, and a server that goes away drains
    the requests it holds (prefill and decode). The utilisation's denominator is $a_j$,
    the busy fraction capped at 1.

    **M/M/1 cells without a `servers` object** (`exponential[j]`): one stage, an
    exponential prefill of rate `rate[j]` and no decode, i.e. `FifoServers`.

    **Events:** no completion is random (`rates` is 0); the end of a prefill and the end
    of a decode are deterministic events of the loop (`next_time`, `complete`).

    **Fields:** `servers` `(n,)` (0 for padded cells), `prefill_token_time`,
    `decode_token_time` `(n,)` $t_p$, $t_d$ (s/token), `decode_slots` `(n,)`,
    `exponential`, `rate` `(n,)`, `prefill_bound` `(n,)` (the stage whose busy fraction
    is the utilisation), `workload`; static `max_servers` $S$, `queue` $Q$ (requests a
    server holds; one more is an overflow), `max_slots` $D$, `block` $A$ (token draws per
    tick: the loop's `events`, which bounds a tick's admissions).
    """

    servers: Int[Array, " n"]
    prefill_token_time: Float[Array, " n"]
    decode_token_time: Float[Array, " n"]
    decode_slots: Int[Array, " n"]
    exponential: Bool[Array, " n"]
    rate: Float[Array, " n"]
    prefill_bound: Bool[Array, " n"]
    workload: Workload
    max_servers: int = eqx.field(static=True)
    queue: int = eqx.field(static=True)
    max_slots: int = eqx.field(static=True)
    block: int = eqx.field(static=True)

    def _draw(self, key, shape):
        """`(prompt, output, exponential)`: token counts $P$, $D$ and a unit exponential."""
        w = self.workload
        dtype = self.prefill_token_time.dtype
        kp, ko, ke = jr.split(key, 3)
        prompt = w.prompt_shift + w.prompt_scale * jr.gamma(kp, w.prompt_shape, shape, dtype)
        output = w.output_shift + w.output_scale * jr.gamma(ko, w.output_shape, shape, dtype)
        return prompt, output, jr.exponential(ke, shape, dtype)

    def _work(self, j, prompt, output, expo):
        """Prefill and decode times of requests of cell(s) `j` from their draws."""
        rate = jnp.where(self.exponential[j], self.rate[j], 1.0)
        pw = jnp.where(self.exponential[j], expo / rate, prompt * self.prefill_token_time[j])
        dw = jnp.where(self.exponential[j], 0.0, output * self.decode_token_time[j])
        return pw, dw

    def init(self, counts, dtype, key):
        n, S, Q, D = counts.shape[0], self.max_servers, self.queue, self.max_slots
        k = jnp.maximum(self.servers, 1)[:, None]
        s = jnp.arange(S)[None, :]
        # Round-robin: the first `counts % servers` servers hold one request more.
        size = jnp.where(s < self.servers[:, None], counts[:, None] // k, 0)
        size = size + ((s < counts[:, None] % k) & (s < self.servers[:, None]))
        over = jnp.any(size > Q) | jnp.any((counts > 0) & (self.servers == 0))
        size = jnp.minimum(size, Q).astype(jnp.int32)
        cell = jnp.arange(n)[:, None, None]
        key, sub = jr.split(key)
        pw, dw = self._work(cell, *self._draw(sub, (n, S, Q)))
        pw, dw = pw.astype(dtype), dw.astype(dtype)
        p_done = jnp.where(size > 0, pw[:, :, 0], jnp.inf).astype(dtype)
        zi = jnp.zeros((n, S), jnp.int32)
        zq = jnp.zeros((n, S, Q), dtype)
        state = PrefillDecodeState(
            p_origin=zq,
            p_work=pw,
            p_decode=dw,
            p_head=zi,
            p_size=size,
            p_done=p_done,
            w_origin=zq,
            w_work=zq,
            w_head=zi,
            w_size=zi,
            s_done=jnp.full((n, S, D), jnp.inf, dtype),
            s_origin=jnp.zeros((n, S, D), dtype),
            s_busy=zi,
            cnt=jnp.sum(size, axis=-1).astype(jnp.int32),
            p_busy=jnp.sum(size > 0, axis=-1).astype(jnp.int32),
            d_busy=jnp.zeros(n, jnp.int32),
            nxt=p_done,
            tokens=jnp.zeros((self.block, 3), dtype),
            drawn=jnp.zeros((), jnp.int32),
            key=key,
            read=jnp.zeros(3, dtype),
            active=self.servers,
        )
        return state, over

    def refresh(self, state, frac, cap):
        key, sub = jr.split(state.key)
        tokens = jnp.stack(self._draw(sub, (self.block,)), axis=-1).astype(state.tokens.dtype)
        active = running(self.servers, frac)
        new = dataclasses.replace(
            state, tokens=tokens, drawn=jnp.zeros_like(state.drawn), key=key, active=active
        )
        return new, jnp.zeros_like(active)

    def _load(self, state):
        return state.p_size + state.w_size + state.s_busy

    def count(self, state):
        return state.cnt

    def rates(self, state):
        return jnp.zeros(self.servers.shape, self.prefill_token_time.dtype)

    def next_time(self, state):
        return jnp.min(state.nxt, axis=-1)

    def utilisation(self, state):
        dtype = self.prefill_token_time.dtype
        k = jnp.maximum(state.active, 1).astype(dtype)
        prefill = state.p_busy.astype(dtype) / k
        decode = state.d_busy.astype(dtype) / (k * self.decode_slots)
        u = jnp.minimum(jnp.where(self.prefill_bound, prefill, decode), 1.0)
        return jnp.where(self.servers > 0, u, 0.0)

    def admit(self, state, j, origin, t, ok):
        Q = self.queue
        load = self._load(state)[j]
        valid = jnp.arange(self.max_servers) < state.active[j]
        s = jnp.argmin(jnp.where(valid, load, jnp.iinfo(jnp.int32).max))
        full = (load[s] >= Q) | ~valid[s]
        do = ok & ~full
        # The tick's next row of draws (a tick admits fewer requests than it has events; the
        # row index advances only with an admission, so that a trial's draws do not depend
        # on how many idle iterations the other trials of its batch make it run).
        row = state.tokens[jnp.minimum(state.drawn, self.block - 1)]
        pw, dw = self._work(j, row[0], row[1], row[2])
        size = state.p_size[j, s]
        # (an index past the ring drops the write)
        slot = jnp.where(do, (state.p_head[j, s] + size) % Q, Q)
        # The writes into the prefill rings must come after the event's completion read
        # them: their index depends on the values read (`read`, never NaN), so that XLA
        # updates the rings in place instead of copying them every event.
        slot = jnp.where(jnp.isnan(jnp.sum(state.read)), Q, slot)
        start = do & (size == 0)
        p_done = jnp.where(start, t + pw, state.p_done[j, s])
        return PrefillDecodeState(
            p_origin=state.p_origin.at[j, s, slot].set(origin, mode="drop"),
            p_work=state.p_work.at[j, s, slot].set(pw, mode="drop"),
            p_decode=state.p_decode.at[j, s, slot].set(dw, mode="drop"),
            p_head=state.p_head,
            p_size=state.p_size.at[j, s].add(do.astype(jnp.int32)),
            p_done=state.p_done.at[j, s].set(p_done),
            w_origin=state.w_origin,
            w_work=state.w_work,
            w_head=state.w_head,
            w_size=state.w_size,
            s_done=state.s_done,
            s_origin=state.s_origin,
            s_busy=state.s_busy,
            cnt=state.cnt.at[j].add(do.astype(jnp.int32)),
            p_busy=state.p_busy.at[j].add(start.astype(jnp.int32)),
            d_busy=state.d_busy,
            nxt=state.nxt.at[j, s].set(jnp.minimum(state.nxt[j, s], p_done)),
            tokens=state.tokens,
            drawn=state.drawn + do.astype(jnp.int32),
            key=state.key,
            read=state.read,
            active=state.active,
        ), ok & full

    def complete(self, state, j, u, t, ok):
        """The earliest event of cell `j` (`u` unused): the end of a prefill (the request
        moves to a free slot, or to the decode queue, or leaves if its decode time is 0),
        or the end of a decode (the request leaves; its slot takes the decode queue's
        head)."""
        Q = self.queue
        s = jnp.argmin(state.nxt[j])
        pd = state.p_done[j, s]
        sd_row = state.s_done[j, s]
        so_row = state.s_origin[j, s]
        d = jnp.argmin(sd_row)
        sd = sd_row[d]
        is_p = ok & (pd <= sd) & jnp.isfinite(pd)
        is_d = ok & ~is_p & jnp.isfinite(sd)

        # End of a prefill: pop the head, start the next one.
        h, ps = state.p_head[j, s], state.p_size[j, s]
        o_p, dw = state.p_origin[j, s, h], state.p_decode[j, s, h]
        nh = (h + 1) % Q
        next_work = state.p_work[j, s, nh]
        p_done = jnp.where(is_p, jnp.where(ps > 1, t + next_work, jnp.inf), pd)
        to_decode = is_p & (dw > 0)
        free = (jnp.arange(self.max_slots) < self.decode_slots[j]) & ~jnp.isfinite(sd_row)
        f = jnp.argmax(free)
        into_slot = to_decode & jnp.any(free)
        into_wait = to_decode & ~jnp.any(free)

        # End of a decode: the slot takes the decode queue's head, if any.
        wh, ws = state.w_head[j, s], state.w_size[j, s]
        take = is_d & (ws > 0)
        o_w, dw_w = state.w_origin[j, s, wh], state.w_work[j, s, wh]

        idx = jnp.arange(self.max_slots)
        at_f = (idx == f) & into_slot
        at_d = (idx == d) & is_d
        s_done = jnp.where(at_f, t + dw, sd_row)
        s_done = jnp.where(at_d, jnp.where(take, t + dw_w, jnp.inf), s_done)
        s_orig = jnp.where(at_f, o_p, so_row)
        s_orig = jnp.where(at_d & take, o_w, s_orig)
        w_slot = jnp.where(into_wait, (wh + ws) % Q, Q)
        busy = into_slot.astype(jnp.int32) - (is_d & ~take).astype(jnp.int32)
        leaving = jnp.where(is_d, so_row[d], o_p)
        left = (is_p & (dw <= 0)) | is_d
        new = PrefillDecodeState(
            p_origin=state.p_origin,
            p_work=state.p_work,
            p_decode=state.p_decode,
            p_head=state.p_head.at[j, s].set(jnp.where(is_p, nh, h)),
            p_size=state.p_size.at[j, s].add(-is_p.astype(jnp.int32)),
            p_done=state.p_done.at[j, s].set(p_done),
            # (each written value depends on the read of its ring: the write stays in place)
            w_origin=state.w_origin.at[j, s, w_slot].set(
                jnp.where(into_wait, o_p, o_w), mode="drop"
            ),
            w_work=state.w_work.at[j, s, w_slot].set(jnp.where(into_wait, dw, dw_w), mode="drop"),
            w_head=state.w_head.at[j, s].set(jnp.where(take, (wh + 1) % Q, wh)),
            w_size=state.w_size.at[j, s].add(into_wait.astype(jnp.int32) - take.astype(jnp.int32)),
            s_done=state.s_done.at[j, s].set(s_done),
            s_origin=state.s_origin.at[j, s].set(s_orig),
            s_busy=state.s_busy.at[j, s].add(busy),
            cnt=state.cnt.at[j].add(-left.astype(jnp.int32)),
            p_busy=state.p_busy.at[j].add(-(is_p & (ps == 1)).astype(jnp.int32)),
            d_busy=state.d_busy.at[j].add(busy),
            nxt=state.nxt.at[j, s].set(jnp.minimum(p_done, jnp.min(s_done))),
            tokens=state.tokens,
            drawn=state.drawn,
            key=state.key,
            read=jnp.stack([o_p, dw, next_work]),
            active=state.active,
        )
        return new, leaving, left
