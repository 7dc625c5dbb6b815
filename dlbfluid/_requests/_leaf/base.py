"""The leaf rule family: which server of a `servers` cell an admitted request joins."""

from __future__ import annotations

import abc
from typing import ClassVar

import equinox as eqx
from jaxtyping import Array, Bool, Float, Int


class AbstractLeaf(eqx.Module):
    """A leaf router's rule (seed §3.1). Concrete rules are final, hold no arrays (their
    parameters are static), and declare `name` (the word of `--leaf` and the JSON) and
    `draws`, the uniforms `choose` reads per admission (0 for a deterministic rule). The
    engine draws them with the admission's other random numbers, a chunk of admissions at
    a time (`FifoCells.draw`: no random generator runs inside the admission loop), and
    only for a rule that reads them, so a deterministic rule's runs draw exactly what they
    drew before.

    `choose` sees one cell's servers at the admission time $t$ and returns the index of
    the server that the request joins. The caller checks that index against the running
    servers (`valid`) and the server's queue, so a rule may return any index when no server
    runs.
    """

    name: ClassVar[str]

    @property
    def draws(self) -> int:
        """Uniforms in $[0, 1)$ that `choose` reads per admission (default 0)."""
        return 0

    @abc.abstractmethod
    def choose(
        self,
        u: Float[Array, " draws"],
        count: Int[Array, " S"],
        tokens: Float[Array, " S"],
        valid: Bool[Array, " S"],
    ) -> Int[Array, ""]:
        """The chosen server: `count` the requests each server holds (both stages),
        `tokens` the tokens waiting at each (`FifoCells.tokens_waiting`), `valid` the
        running servers (the lowest indices: `fifo.running`), `u` this admission's
        `draws` uniforms."""

    def describe(self) -> dict:
        """The rule as JSON: `{"rule": name}` and its parameters."""
        return {"rule": self.name}
