"""`PowerOfD`: power-of-d choices on the tokens waiting (Prequal-style)."""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr

from ..loop import _first_min
from .base import AbstractLeaf


class PowerOfD(AbstractLeaf):
    """Power-of-$d$ choices on the tokens waiting (seed §3.1): draw $d$ distinct running
    servers uniformly at random (all of them when fewer than $d$ run) and join the one with
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
    random: ClassVar[bool] = True

    def __check_init__(self):
        if isinstance(self.d, bool) or not isinstance(self.d, int) or self.d < 1:
            raise ValueError(f"PowerOfD.d = {self.d!r} is invalid: expected an integer >= 1")

    def choose(self, key, count, tokens, valid):
        S = count.shape[0]
        if self.d >= S:
            drawn = valid
        else:
            # d distinct servers, uniformly: the d smallest of S uniforms (non-running
            # servers score 2, above every running one, so they are drawn only when
            # fewer than d run, and `valid` then drops them)
            score = jnp.where(valid, jr.uniform(key, (S,), tokens.dtype), 2.0)
            _, idx = jax.lax.top_k(-score, self.d)
            drawn = jnp.zeros(S, bool).at[idx].set(True) & valid
        least = jnp.min(jnp.where(drawn, tokens, jnp.inf))
        tied = drawn & (tokens == least)
        fewest = jnp.min(jnp.where(tied, count, jnp.iinfo(jnp.int32).max))
        _, s = _first_min(jnp.where(tied & (count == fewest), 0, 1))
        return s

    def describe(self) -> dict:
        return {"rule": self.name, "d": self.d}
