"""`JoinShortestQueue`: the fewest requests present."""

from __future__ import annotations

from typing import ClassVar

import jax.numpy as jnp

from ..loop import _first_min
from .base import AbstractLeaf


class JoinShortestQueue(AbstractLeaf):
    """Join the running server with the fewest requests present (both stages), the lowest
    index on ties: $s = \\min\\,\\arg\\min_{s < a_j} n_s(t)$ with $a_j$ the running
    servers. The twin's default leaf rule."""

    name: ClassVar[str] = "jsq"

    def choose(self, u, count, tokens, valid):
        _, s = _first_min(jnp.where(valid, count, jnp.iinfo(jnp.int32).max))
        return s
