from __future__ import annotations

from .._costs import check_cost
from .._projection import project_simplex
from .base import AbstractPolicy

_SHORT = {"rif": "rif", "latency": "lat", "gradient": "grad"}


class FlowRouting(AbstractPolicy):
    """Flow routing: one projected-gradient step per tick,
    $x_i \\leftarrow \\Pi_{\\Delta_i}(x_i - \\eta_i h\\, \\hat c_i)$ (theory-notes §2.2).

    As $h \\to 0$ this is the forward-Euler discretisation of the projected dynamics
    $\\dot x_i = \\Pi_{T_{\\Delta_i}(x_i)}(-\\eta_i \\hat c_i)$ (first order in $h$).
    """

    cost: str

    def __check_init__(self):
        check_cost(self.cost)

    @property
    def name(self) -> str:
        return f"flow-{_SHORT[self.cost]}"

    def update(self, x, costs, step, allowed):
        return project_simplex(x - step[:, None] * costs, allowed)
