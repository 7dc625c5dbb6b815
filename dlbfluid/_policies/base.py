"""The routing-policy family: what a root router does at each probe tick (seed §3.2.2).

A policy is a Module with a stateful update (jax-md style `init`/`step` pair):

* `prepare(scn, h, horizon)`: arrays precomputed per scenario before the tick loop
  (MNLB's weight schedule); `None` for state-feedback policies;
* `initial_routing(scn, aux)`: $x^0$, also the routing history on $[-\\bar\\tau, 0]$;
* `init_state(scn, setup, aux, x0)`: the policy's own state (default: the routing it
  holds);
* `update(scn, setup, state, obs, aux)`: the routing $x^{k+1}$ sent on
  $[t_{k+1}, t_{k+2})$ and the new state, from what the routers observe at $t_{k+1}$
  (`Observation`).

The simulator never asks which policy it holds. Optional behaviour is a wrapper
(`ErrorAverse`), not a flag of the loop.
"""

from __future__ import annotations

import abc

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._costs import route_costs
from .._registry import BUILTIN_POLICIES, POLICIES
from .._scenario import piecewise_constant, replica_scale

POLICY_NAMES = BUILTIN_POLICIES
"""The eight built-in policies (`dlbfluid._registry.POLICIES` also lists registered ones)."""


def replica_fractions(scn, t):
    """Every cell's replica fraction $c_j(t) = k_j(t)/k_j$ (`replica_scale` of its
    schedule), `(..., n)`: `t` broadcasts against the cell axis last, so a scalar or
    `t[..., None]` gives every cell at the same times, and `(..., n)` cell $j$ at
    `t[..., j]` (e.g. $t - \\tau_{ij}$, what router $i$ observes). The one home of the
    fraction that the simulator's `Observation.scale`, `Rand` and `MNLB` use."""
    n = scn.replicas.shape[-1]
    t = jnp.broadcast_to(t, jnp.broadcast_shapes(jnp.shape(t), (n,)))
    return jax.vmap(replica_scale, in_axes=(0, 0, 0, -1), out_axes=-1)(
        scn.replica_times, scn.replica_counts, scn.replicas, t
    )


def slowdown_factors(scn, t):
    """Every cell's service slowdown $s_j(t)$ (its `service_schedule`), `(..., n)`, with
    `t` broadcast as in `replica_fractions`. The one home of the factor that the
    simulators' processing rates, `Observation.slowdown` and `MNLB` use."""
    n = scn.replicas.shape[-1]
    t = jnp.broadcast_to(t, jnp.broadcast_shapes(jnp.shape(t), (n,)))
    return jax.vmap(piecewise_constant, in_axes=(0, 0, -1), out_axes=-1)(
        scn.slowdown_times, scn.slowdown_factors, t
    )


def observed_fractions(scn, t_obs):
    """`Observation.scale`: $c_j(t_{k+1} - \\tau_{ij})$ `(n, n)` at the observation times
    `t_obs` `(n, n)`, or None when the scenario (or batch) has no replica schedule (a
    static test of the schedule's width, as in `observed_slowdown`)."""
    return replica_fractions(scn, t_obs) if scn.replica_times.shape[-1] > 1 else None


def observed_slowdown(scn, t_obs):
    """`Observation.slowdown`: $s_j(t_{k+1} - \\tau_{ij})$ `(n, n)` at the observation
    times `t_obs` `(n, n)`, or None when the scenario (or batch) has no service schedule
    (a static test of the schedule's width: the parser stores every schedule given with
    two columns at least)."""
    return slowdown_factors(scn, t_obs) if scn.slowdown_times.shape[-1] > 1 else None


class TickSetup(eqx.Module):
    """What every tick of one scenario shares (computed once, inside the compiled loop).

    **Fields:**
    - `tau`: `(n, n)` one-way delays $\\tau_{ij}$ (0 on forbidden arcs).
    - `m`, `r`: `(n, n)` $\\tau_{ij} = m_{ij}h + r_{ij}$, $0 \\le r_{ij} < h$.
    - `offsets`: `(n, n)` $h - r_{ij}$, where inside a tick $N_j$ is observed.
    - `step`: `(n,)` per-router step $\\eta_i h$.
    - `h`: the tick.
    - `hist`: (static) length of the ring buffers, more than $\\max m + 1$ ticks.
    """

    tau: Float[Array, "n n"]
    m: Int[Array, "n n"]
    r: Float[Array, "n n"]
    offsets: Float[Array, "n n"]
    step: Float[Array, " n"]
    h: Float[Array, ""]
    hist: int = eqx.field(static=True)


class Observation(eqx.Module):
    """What the routers see at the update time $t_{k+1}$ (end of tick `k`).

    **Fields:**
    - `k`: the tick just integrated; `t`: $t_{k+1}$.
    - `workload`: `(n, n)` $N_j(t_{k+1} - \\tau_{ij})$, the probed workloads.
    - `scale`: `(n, n)` observed replica fraction $k_j(t_{k+1}-\\tau_{ij})/k_j$
      (`replica_fractions`), or `None` when no scenario has a replica schedule.
    - `slowdown`: `(n, n)` observed service slowdown $s_j(t_{k+1}-\\tau_{ij})$
      (`slowdown_factors`), or `None` when no scenario has a service schedule.
    - `drops`, `arrivals`: `(n,)` flow dropped by, and arriving at, each cell during tick
      `k` (the cells' own counters, seen by the routers only through the probe).
    """

    k: Int[Array, ""]
    t: Float[Array, ""]
    workload: Float[Array, "n n"]
    scale: Float[Array, "n n"] | None
    drops: Float[Array, " n"]
    arrivals: Float[Array, " n"]
    slowdown: Float[Array, "n n"] | None = None


class AbstractPolicy(eqx.Module):
    """A root-router policy (module docstring). Concrete policies are final and hold no
    arrays, so they are static under jit; `cost` is the cost family they route on
    (`None` for policies that ignore costs)."""

    cost: eqx.AbstractVar

    @property
    @abc.abstractmethod
    def name(self) -> str: ...

    def prepare(self, scn, h, horizon: float):
        """Arrays the policy precomputes per scenario before the tick loop (inside jit);
        `None` for state-feedback policies. `horizon` is a static Python float."""
        return None

    @property
    def uses_horizon(self) -> bool:
        """Whether `prepare` depends on the horizon (then it is part of the compiled key)."""
        return type(self).prepare is not AbstractPolicy.prepare

    def initial_routing(self, scn, aux=None) -> Float[Array, "n n"]:
        """$x^0$, also the routing history on $[-\\bar\\tau, 0]$: the scenario's own."""
        return scn.initial_routing

    def init_state(self, scn, setup: TickSetup, aux, x0):
        """The policy's state at $t = 0$; default: the routing $x^0$ it holds."""
        return x0

    @abc.abstractmethod
    def update(self, scn, setup: TickSetup, state, obs: Observation, aux):
        """`(x_next, state)`: the routing sent from $t_{k+1}$ on, and the new state."""


class AbstractCostPolicy(AbstractPolicy):
    """A policy that routes on observed route costs $\\hat c_{ij}$ of its `cost` family by a
    rule `route(x, costs, step, allowed)`; its state is the routing it holds."""

    @abc.abstractmethod
    def route(
        self,
        x: Float[Array, "n n"],
        costs: Float[Array, "n n"],
        step: Float[Array, " n"],
        allowed: Bool[Array, "n n"],
    ) -> Float[Array, "n n"]:
        """The new routing from the current one, the observed route costs and the
        per-router step $\\eta_i h$."""

    def update(self, scn, setup, state, obs, aux):
        costs = route_costs(self.cost, scn, obs.workload, obs.scale, obs.slowdown)
        x = self.route(state, costs, setup.step, scn.allowed)
        return x, x


def policy_from_name(name) -> AbstractPolicy:
    """`"flow-grad"` -> `FlowRouting(Gradient())`, ..., `"rand"` -> `WeightedRandom()`;
    any name in the registry (`dlbfluid._registry.POLICIES`); a policy object is returned
    as it is."""
    if isinstance(name, AbstractPolicy):
        return name
    if not isinstance(name, str) or name not in POLICIES:
        raise ValueError(
            f"policy = {name!r} is invalid: allowed policies are {list(POLICIES.names())}"
        )
    pol = POLICIES.get(name)
    if not isinstance(pol, AbstractPolicy):
        raise ValueError(f"policy {name!r} is registered as {pol!r}, which is not a policy")
    return pol


def tree_select(keep, new, old):
    """`new` where `keep` else `old`, leaf by leaf (`keep` a scalar)."""
    import jax.numpy as jnp

    return jax.tree_util.tree_map(lambda a, b: jnp.where(keep, a, b), new, old)
