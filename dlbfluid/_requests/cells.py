"""The cell family of the request-level twin: how a cell holds and serves its requests.

A cell kind (`AbstractCells`) is a Module that holds the per-cell parameters of one
scenario (arrays over the `n` cells) and a static slot capacity, and owns the state of
every request present in every cell: the request's *origin*, the time from which its
end-to-end latency is counted (its arrival at the root router less its one-way delay, so
that latency = completion time - origin = $2\\tau_{ij}$ + sojourn).

The event loop (`dlbfluid._requests.loop`) never asks which kind it holds: it reads the
per-cell completion rates and next deterministic event times, admits a request to a cell,
or completes one, through the methods below. A kind's completions are either random
(competing exponentials at `rates`; `next_time` is $+\\infty$: markov, exponential FIFO
servers) or deterministic (`rates` is 0 and `next_time` says when the cell's next internal
event is due: the App.-B prefill/decode servers). Every method acts on one cell `j`
chosen by the loop (a traced index) and touches O(1) (markov) or O(servers + queue)
(servers) entries, never a whole slot array, so that an event costs the same whatever
the capacity.
"""

from __future__ import annotations

import abc

import equinox as eqx
from jaxtyping import Array, Bool, Float, Int


class AbstractCells(eqx.Module):
    """A cell kind (module docstring). Concrete kinds are final."""

    @abc.abstractmethod
    def init(self, counts: Int[Array, " n"], dtype, key):
        """The state with `counts[j]` requests present in cell `j` at $t = 0$ (origin 0),
        and a flag that is True if they do not fit the slots. `key`: the trial's PRNG key
        of the cells (for kinds that draw per-request quantities)."""

    @abc.abstractmethod
    def refresh(
        self, state, frac: Float[Array, " n"], speed: Float[Array, " n"], cap: Float[Array, " n"]
    ):
        """`(state, dropped)`: the state at the start of a tick, once per tick and trial
        (before its events). `frac` is each cell's replica fraction $c_j$ in force during
        the tick (`replica_fractions` at the tick's midpoint, as the fluid simulator reads
        it), `speed` its service speed $1/s_j$ (`slowdown_factors`, likewise) and `cap` its
        buffer $\\lfloor kc_jB_j\\rfloor$ (theory/requests.md, *Replica
        schedules*): the kind scales its service to the running replicas here, and
        `dropped` `(n,)` counts the requests it removed (markov: those above a shrunk
        buffer). Kinds that draw per-request quantities draw a tick's block of them here,
        from their own key, so that no event calls the random generator."""

    @abc.abstractmethod
    def count(self, state) -> Int[Array, " n"]:
        """Requests present in each cell."""

    @abc.abstractmethod
    def rates(self, state) -> Float[Array, " n"]:
        """Total completion rate of each cell in the current state (requests/s)."""

    @abc.abstractmethod
    def next_time(self, state) -> Float[Array, " n"]:
        """Time of each cell's next deterministic internal event ($+\\infty$: none)."""

    @abc.abstractmethod
    def utilisation(self, state) -> Float[Array, " n"]:
        """Instantaneous utilisation of each cell in $[0, 1]$."""

    @abc.abstractmethod
    def admit(self, state, j, origin, t, ok: Bool[Array, ""]):
        """`(state, overflow)`: request of origin `origin` placed in cell `j` at time `t` if
        `ok`; `overflow` is True (and the state unchanged) when `ok` but no slot is free."""

    @abc.abstractmethod
    def complete(self, state, j, u, t, ok: Bool[Array, ""]):
        """`(state, origin, left)`: if `ok`, cell `j`'s event at time `t` happens (chosen by
        the kind's discipline, from the uniform `u` in [0, 1) for random completions);
        `left` is True when a request leaves the cell, `origin` is its origin."""
