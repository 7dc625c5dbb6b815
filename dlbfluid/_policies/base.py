"""The routing-policy family: what a root router does at each probe tick (seed §3.2.2)."""

from __future__ import annotations

import abc

import equinox as eqx
from jaxtyping import Array, Bool, Float

POLICY_NAMES = (
    "disc-rif",
    "disc-lat",
    "disc-grad",
    "flow-rif",
    "flow-lat",
    "flow-grad",
    "rand",
    "mnlb",
)
_COST_OF = {"rif": "rif", "lat": "latency", "grad": "gradient"}


class AbstractPolicy(eqx.Module):
    """A router update $x_i^{k} = U(x_i^{k-1}, \\hat c_i, \\eta_i h)$ applied at every tick.

    Concrete policies are final and hold no arrays, so they are static under jit.
    """

    cost: eqx.AbstractVar[str | None]

    @property
    @abc.abstractmethod
    def name(self) -> str: ...

    def initial_routing(self, scn, aux=None) -> Float[Array, "n n"]:
        """$x^0$, also the routing history on $[-\\bar\\tau, 0]$: the scenario's own.
        `aux` is what `prepare` returned (`None` for state-feedback policies)."""
        return scn.initial_routing

    def prepare(self, scn, h, horizon: float):
        """Arrays the policy precomputes per scenario before the tick loop (inside jit);
        `None` for state-feedback policies. `horizon` is a static Python float."""
        return None

    def scheduled(self, scn, x, t_next, aux):
        """Routing of a policy that ignores costs (`cost is None`) for the tick starting at
        `t_next`; the default keeps `x`."""
        return x

    @abc.abstractmethod
    def update(
        self,
        x: Float[Array, "n n"],
        costs: Float[Array, "n n"],
        step: Float[Array, " n"],
        allowed: Bool[Array, "n n"],
    ) -> Float[Array, "n n"]:
        """New routing from the current routing, the observed route costs and the
        per-router step $\\eta_i h$."""


def policy_from_name(name: str) -> AbstractPolicy:
    """`"flow-grad"` -> `FlowRouting("gradient")`, ..., `"rand"` -> `WeightedRandom()`."""
    from .discrete import DiscreteRouting
    from .flow import FlowRouting
    from .rand import WeightedRandom

    if isinstance(name, AbstractPolicy):
        return name
    if name == "rand":
        return WeightedRandom()
    if name == "mnlb":
        from .mnlb import MNLB

        return MNLB()
    mech, _, cost = str(name).partition("-")
    if mech in ("flow", "disc") and cost in _COST_OF:
        cls = FlowRouting if mech == "flow" else DiscreteRouting
        return cls(_COST_OF[cost])
    raise ValueError(f"policy = {name!r} is invalid: allowed policies are {list(POLICY_NAMES)}")
