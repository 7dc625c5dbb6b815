"""Flow routing: one projected-gradient step per tick (seed §3.2.2)."""

from __future__ import annotations

import equinox as eqx

from .._costs import AbstractCost, cost_from_name, short_name
from .base import AbstractCostPolicy
from .projection import project_simplex


class FlowRouting(AbstractCostPolicy):
    """Flow routing: $x_i \\leftarrow \\Pi_{\\Delta_i}(x_i - \\eta_i h\\, \\hat c_i)$
    (theory/model.md, *Routing*).

    As $h \\to 0$ this is the forward-Euler discretisation of the projected dynamics
    $\\dot x_i = \\Pi_{T_{\\Delta_i}(x_i)}(-\\eta_i \\hat c_i)$ (first order in $h$).
    """

    cost: AbstractCost = eqx.field(converter=cost_from_name)

    @property
    def name(self) -> str:
        return f"flow-{short_name(self.cost)}"

    def route(self, x, costs, step, allowed):
        return project_simplex(x - step[:, None] * costs, allowed)
