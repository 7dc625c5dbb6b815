"""`servers` cells: FIFO servers whose requests' completions are fixed at admission
(theory/requests.md, *FIFO cells at admission*).

Cell $j$ is `servers[j]` identical servers. Each server has one FIFO prefill engine and
`decode_slots[j]` decode slots ($E_jL_j$: engines x slots of seed App. B; 0 for a one-stage
exponential server). A request admitted at time $t$ to server $s$ with prefill work $p$ and
decode work $d$ completes at

$$f = \\max(t, F_s) + p,\\qquad F_s \\leftarrow f \\quad\\text{(Lindley)},$$
$$c = \\max(f, \\min_m V_{s,m}) + d,\\qquad V_{s,m^*} \\leftarrow c\\quad\\text{(Kiefer-Wolfowitz)}$$

($c = f$ when $d = 0$), with $F_s$ the time the prefill engine frees and $V_{s,m}$ the time
decode slot $m$ frees. Later arrivals never overtake a request in either FIFO stage, so
$c$ is final at admission: the cell needs no completion event. `FifoCells` holds the
per-cell parameters of one scenario; the engine is `dlbfluid._requests.admission`.
"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Bool, Float, Int

from .._scenario import Workload
from .._shapes import lead
from .gamma import gamma


def running(servers: Int[Array, " n"], frac: Float[Array, " n"]) -> Int[Array, " n"]:
    """Servers running at replica fraction $c_j$: $\\max(1, \\mathrm{round}(c_jS_j))$ of
    the $S_j$ = `servers` (0 for a padded cell), the lowest indices."""
    a = jnp.round(servers.astype(frac.dtype) * frac).astype(jnp.int32)
    return jnp.where(servers > 0, jnp.clip(a, 1, servers), 0)


class FifoCells(eqx.Module):
    """The FIFO servers of every cell of one scenario (module docstring).

    **Law.** A request draws, at its admission, $P = \\delta_p + G_p$ prompt and
    $D = \\delta_o + G_o$ output tokens ($G \\sim \\mathrm{Gamma}(\\alpha, \\theta)$ of the
    scenario's `Workload`, independent, real-valued): prefill work $Pt_{p,j}$, decode work
    $Dt_{d,j}$ on one of the server's `decode_slots[j]` slots (the slots are identical,
    so the decode stage is one FIFO queue of that many servers). An `exponential` cell (an
    M/M/1 cell without a `servers` object) is one stage: prefill work
    $\\mathrm{Exp}(\\bar\\mu_j/k_j)$ and no decode.

    **Leaf routing:** a request that reaches cell $j$ joins the server that the lane's leaf
    rule picks (`dlbfluid._requests._leaf`): by default the running server with the fewest
    requests present (both stages), the lowest index on ties.

    **Fields:** `servers` `(n,)` (0 for padded cells), `prefill_token_time`,
    `decode_token_time` `(n,)`, `decode_slots` `(n,)`, `exponential` `(n,)`, `rate` `(n,)`
    the exponential server's rate, `prefill_bound` `(n,)` whether the prefill stage is the
    bottleneck (its busy fraction is the utilisation), `workload`; static `tokens`: whether
    any cell draws token counts (App.-B), so that a batch of exponential cells draws no
    Gamma variates.
    """

    servers: Int[Array, " n"]
    prefill_token_time: Float[Array, " n"]
    decode_token_time: Float[Array, " n"]
    decode_slots: Int[Array, " n"]
    exponential: Bool[Array, " n"]
    rate: Float[Array, " n"]
    prefill_bound: Bool[Array, " n"]
    workload: Workload
    tokens: bool = eqx.field(static=True)

    def draw(self, key, rows: int, dtype, extra: int = 0):
        """`(rows, 3 + extra)` draws: prompt tokens $P$, output tokens $D$ (Gamma variates
        by `dlbfluid._requests.gamma.gamma`), a unit exponential, then `extra` uniforms in
        $[0, 1)$ (the leaf rule's: `AbstractLeaf.draws`; from a key of their own, so that
        the first three columns are the same whatever `extra`)."""
        w = self.workload
        kp, ko, ke = jr.split(key, 3)
        expo = jr.exponential(ke, (rows,), dtype)
        if not self.tokens:
            zero = jnp.zeros((rows,), dtype)
            cols = [zero, zero, expo]
        else:
            prompt = w.prompt_shift + w.prompt_scale * gamma(kp, w.prompt_shape, rows, dtype)
            output = w.output_shift + w.output_scale * gamma(ko, w.output_shape, rows, dtype)
            cols = [prompt.astype(dtype), output.astype(dtype), expo]
        out = jnp.stack(cols, axis=-1)
        if extra:
            u = jr.uniform(jr.fold_in(key, 1), (rows, extra), dtype)
            out = jnp.concatenate([out, u], axis=-1)
        return out

    def tokens_waiting(self, j, block, t, slots: int):
        """`(S,)` the tokens waiting at each server of cell `j` at time `t` (the leaf rule
        `pod`'s load), from the servers' rows `block` `(S, 1 + slots)` (their first
        columns: `admission.FifoState.srv`): the prompt
        tokens its prefill engine has yet to process, $(F_s - t)^+/t_{p,j}$, plus the
        output tokens its decode slots have yet to produce,
        $\\sum_{m < D_j}(V_{s,m} - t)^+/t_{d,j}$ (each slot's committed time; it counts a
        slot's wait for a request still in prefill as work, a few prefill times at most).
        An exponential cell's load is its unfinished work $(F_s - t)^+$ (seconds: one
        cell's servers are compared with each other only)."""
        expo = self.exponential[j]
        prefill = jnp.maximum(block[:, 0] - t, 0.0)
        slot_ok = jnp.arange(slots) < self.decode_slots[j]
        decode = jnp.sum(jnp.where(slot_ok, jnp.maximum(block[:, 1 : 1 + slots] - t, 0.0), 0.0), -1)
        tp = jnp.where(expo, 1.0, self.prefill_token_time[j])
        td = jnp.where(expo | (self.decode_token_time[j] <= 0), 1.0, self.decode_token_time[j])
        return prefill / tp + jnp.where(expo, 0.0, decode / td)

    def work(self, j, row):
        """Prefill and decode work of a request of cell `j` from its draws `row`."""
        expo = self.exponential[j]
        rate = jnp.where(expo, self.rate[j], 1.0)
        pw = jnp.where(expo, row[2] / rate, row[0] * self.prefill_token_time[j])
        dw = jnp.where(expo, 0.0, row[1] * self.decode_token_time[j])
        return pw, dw


class ServiceClock(eqx.Module):
    """The work a server of one cell can do by time $t$ under its service schedule:
    $\\Phi(t) = \\int_0^t v$, $v = 1/s_j$ piecewise constant (theory/requests.md, *Service
    schedules*). In $\\Phi$'s units every server runs at unit speed, so a stage that starts
    a request of work $w$ at $a$ ends at $\\Phi^{-1}(\\Phi(a) + w)$ (`advance`): the schedule
    is known in advance, and a completion is still fixed at admission. The engine keeps a
    cell's server rows in $\\Phi$'s units (`admission.admit`).

    **Fields:** `times` `(S,)` the schedule's breakpoints $T_q$, `speed` `(S,)` $v_q$ from
    $T_q$ on (also before $T_0$), `work` `(S,)` $\\Phi(T_q)$, with $\\Phi(0) = 0$.
    """

    times: Float[Array, " S"]
    speed: Float[Array, " S"]
    work: Float[Array, " S"]

    @classmethod
    def of(cls, times, factors, dtype):
        """The clock of a cell from its `service_schedule` breakpoints and factors."""
        times = times.astype(dtype)
        speed = (1.0 / factors).astype(dtype)
        steps = speed[:-1] * (times[1:] - times[:-1])
        start = speed[:1] * times[:1]  # Phi(T_0), the speed before T_0 being v_0
        return cls(
            times, speed, start + jnp.concatenate([jnp.zeros((1,), dtype), jnp.cumsum(steps)])
        )

    def forward(self, t):
        """$\\Phi(t)$ (`t` any shape; $+\\infty$ stays $+\\infty$)."""
        t = jnp.asarray(t)
        q = jnp.clip(jnp.sum(lead(self.times, t.ndim + 1) <= t[..., None], -1) - 1, 0, None)
        return self.work[q] + self.speed[q] * (t - self.times[q])

    def inverse(self, w):
        """$\\Phi^{-1}(w)$."""
        w = jnp.asarray(w)
        q = jnp.clip(jnp.sum(lead(self.work, w.ndim + 1) <= w[..., None], -1) - 1, 0, None)
        return self.times[q] + (w - self.work[q]) / self.speed[q]

    def advance(self, a, w):
        """The time at which work `w` started at `a` ends."""
        return self.inverse(self.forward(a) + w)


def serve(row, t, pw, dw, slots: int):
    """One server's admission (module docstring): `row` `(1 + slots + Q,)` holds when its
    prefill engine frees, when each decode slot frees ($+\\infty$ for slots it lacks) and
    the completion times of its requests; a request of prefill work `pw` and decode work
    `dw` arrives at `t`. Returns `(new_row, c, f, start)`: the row after the admission,
    the request's completion $c$, the end $f$ of its prefill and the start of its decode
    (Lindley, then Kiefer-Wolfowitz; $c = f$ when `dw` is 0). The request takes the first
    free entry of the completion times (one whose time has passed: the caller checks that
    the server holds fewer than Q). Under a service schedule the row, `t` and the results
    are in the `ServiceClock`'s units."""
    f = jnp.maximum(t, row[0]) + pw
    v = row[1 : 1 + slots]
    m = jnp.argmin(v)
    start = jnp.maximum(f, v[m])
    decode = dw > 0
    c = jnp.where(decode, start + dw, f)
    q = jnp.argmin(row[1 + slots :])
    idx = jnp.arange(row.shape[0])
    new = jnp.where(idx == 0, f, row)
    new = jnp.where(decode & (idx == 1 + m), c, new)
    new = jnp.where(idx == 1 + slots + q, c, new)
    return new, c, f, start
