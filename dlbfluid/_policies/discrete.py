"""Discrete routing: all of a router's flow to its cheapest cell (seed §3.2.2)."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp

from .._costs import AbstractCost, cost_from_name, short_name
from .base import AbstractCostPolicy


class DiscreteRouting(AbstractCostPolicy):
    """Discrete routing: each router sends all of its flow to the cheapest allowed cell,
    $x_i \\leftarrow e_{\\arg\\min_j \\hat c_{ij}}$ (theory/model.md, *Routing*).

    A NaN cost counts as $+\\infty$, so that every row routes to allowed cells.

    **Tie rule** (`tie`): `"split"` (default) splits the flow equally among exact
    minimisers; `"first"` sends it all to the lowest-index minimiser. Exact ties have
    measure zero along a generic trajectory, and `tests/test_policies.py` checks that the
    two rules give identical trajectories there.
    """

    cost: AbstractCost = eqx.field(converter=cost_from_name)
    tie: str = "split"

    def __check_init__(self):
        if self.tie not in ("split", "first"):
            raise ValueError(f"tie = {self.tie!r} is invalid: allowed 'split' or 'first'")

    @property
    def name(self) -> str:
        return f"disc-{short_name(self.cost)}"

    def route(self, x, costs, step, allowed):
        # (a NaN cost counts as +inf: a cell the routers cannot price gets no flow, and a
        # row whose costs are all non-finite splits over its allowed cells, never over none)
        c = jnp.where(allowed & ~jnp.isnan(costs), costs, jnp.inf)
        cmin = jnp.min(c, axis=-1, keepdims=True)
        ties = allowed & (c <= cmin)
        if self.tie == "first":
            first = jnp.argmax(ties, axis=-1)
            ties = (jnp.arange(c.shape[-1])[None, :] == first[:, None]) & allowed
        count = jnp.sum(ties, axis=-1, keepdims=True)
        return jnp.where(ties, 1.0 / jnp.maximum(count, 1), 0.0).astype(x.dtype)
