"""Error types raised when a problem is set up (the first tier of errors)."""

from __future__ import annotations


class ScenarioError(ValueError):
    """A scenario is malformed: the message names the field, the value and what is allowed."""


class OverloadError(ScenarioError):
    """Demand that no routing can serve within capacity (Assumption 2 fails).

    **Attributes:**
    - `cells`: names of the cells in the overloaded cut.
    - `sources`: names of the origins whose demand must be served by those cells.
    - `demand`, `capacity`: the demand of those origins and the capacity of those cells.
    """

    def __init__(self, message: str, *, cells, sources, demand: float, capacity: float):
        super().__init__(message)
        self.cells = list(cells)
        self.sources = list(sources)
        self.demand = float(demand)
        self.capacity = float(capacity)
