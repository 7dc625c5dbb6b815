"""`PowerOfD`: power-of-d choices on the tokens waiting (Prequal-style)."""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp

from ..loop import _first_min
from .base import AbstractLeaf


class PowerOfD(AbstractLeaf):
    """Power-of-$d$ choices on the tokens waiting (seed §3.1): draw $d$ distinct running
    servers uniformly at random (Floyd's algorithm on $d$ pre-drawn uniforms; all of them
    when fewer than $d$ run) and join the one with
    the fewest tokens waiting $w_s(t)$ (`FifoCells.tokens_waiting`); ties go to the fewest
    requests present, then to the lowest index.

    With $d \\ge a_j$ (every running server drawn) it is the least-tokens rule; on
    exponential FIFO servers, whose tokens waiting is their unfinished work, that rule is
    exactly one FCFS queue in front of $a_j$ servers (each request starts as soon as the
    first server frees: Kiefer-Wolfowitz), so a cell at Poisson rate $\\lambda$ is M/M/c.
    With $d = 1$ a request joins a uniformly random server: $c$ independent M/M/1 queues
    of rate $\\lambda/c$ each (tests/test_requests_leaf.py checks both).

    **Fields:** `d` (static), at least 1.
    """

    d: int = eqx.field(static=True, default=2)
    name: ClassVar[str] = "pod"

    def __check_init__(self):
        if isinstance(self.d, bool) or not isinstance(self.d, int) or self.d < 1:
            raise ValueError(f"PowerOfD.d = {self.d!r} is invalid: expected an integer >= 1")

    @property
    def draws(self) -> int:
        return self.d

    def choose(self, u, count, tokens, valid):
        S = count.shape[0]
        if self.d >= S:
            drawn = valid
        else:
            # d distinct servers of the a running ones (the lowest indices), uniformly, by
            # Floyd's algorithm: for m = a - d, ..., a - 1 draw r uniform in {0, ..., m}
            # and take r, or m if r is taken already. Fewer than d running: all of them.
            a = jnp.sum(valid.astype(jnp.int32))
            drawn = jnp.zeros(S, bool)
            for i in range(self.d):  # (static and small)
                m = a - self.d + i
                r = jnp.minimum(jnp.floor(u[i] * (m + 1)).astype(jnp.int32), m)
                pick = jnp.where(drawn[jnp.clip(r, 0, S - 1)], m, r)
                drawn = drawn | (jnp.arange(S) == pick)
            drawn = jnp.where(a > self.d, drawn, valid) & valid
        least = jnp.min(jnp.where(drawn, tokens, jnp.inf))
        tied = drawn & (tokens == least)
        fewest = jnp.min(jnp.where(tied, count, jnp.iinfo(jnp.int32).max))
        _, s = _first_min(jnp.where(tied & (count == fewest), 0, 1))
        return s

    def describe(self) -> dict:
        return {"rule": self.name, "d": self.d}
