from __future__ import annotations

import jax.numpy as jnp

from .._costs import check_cost
from .base import AbstractPolicy

_SHORT = {"rif": "rif", "latency": "lat", "gradient": "grad"}


class DiscreteRouting(AbstractPolicy):
    """Discrete routing: each router sends all of its flow to the cheapest allowed cell
    (theory-notes §2.1).

    **Tie rule** (`tie`): `"split"` (default) splits the flow equally among exact
    minimisers; `"first"` sends it all to the lowest-index minimiser. Exact ties have
    measure zero along a generic trajectory, and `tests/test_policies.py` checks that the
    two rules give identical trajectories there.
    """

    cost: str
    tie: str = "split"

    def __check_init__(self):
        check_cost(self.cost)
        if self.tie not in ("split", "first"):
            raise ValueError(f"tie = {self.tie!r} is invalid: allowed 'split' or 'first'")

    @property
    def name(self) -> str:
        return f"disc-{_SHORT[self.cost]}"

    def update(self, x, costs, step, allowed):
        c = jnp.where(allowed, costs, jnp.inf)
        cmin = jnp.min(c, axis=-1, keepdims=True)
        ties = allowed & (c <= cmin)
        if self.tie == "first":
            first = jnp.argmax(ties, axis=-1)
            ties = (jnp.arange(c.shape[-1]) == first[:, None]) & allowed
        count = jnp.sum(ties, axis=-1, keepdims=True)
        return jnp.where(ties, 1.0 / jnp.maximum(count, 1), 0.0).astype(x.dtype)
