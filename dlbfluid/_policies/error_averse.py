"""Error aversion as a wrapper policy (seed §3.4; theory/evaluation.md, *Error aversion*)."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from .aversion import ErrorAversion, apply_aversion, aversion_update, ema_update
from .base import AbstractPolicy


class AversionState(eqx.Module):
    """State of `ErrorAverse`.

    **Fields:**
    - `inner`: the wrapped policy's own state (its routing before aversion).
    - `ema`: `(n,)` each cell's moving average $e_j$ of its drop fraction.
    - `ema_ring`: `(hist, n)` past values of `ema`, so that root $i$ sees $e_j$ a delay
      $\\tau_{ij}$ late (the probe carries it).
    - `aversion`: `(n, n)` the roots' aversion $a_{ij} \\in [0, a_{\\max}]$.
    """

    inner: object
    ema: Float[Array, " n"]
    ema_ring: Float[Array, "hist n"]
    aversion: Float[Array, "n n"]


class ErrorAverse(AbstractPolicy):
    """`policy` with error aversion: the routing sent is the policy's, thinned by the
    roots' aversion to cells that drop requests and renormalised,
    $\\tilde x_{ij} = x_{ij}(1-a_{ij})/\\sum_l x_{il}(1-a_{il})$ (`dlbfluid._policies.aversion`).

    The wrapped policy keeps routing on its own, unthinned, state; its `name` and `cost`
    are the wrapper's.
    """

    policy: AbstractPolicy
    config: ErrorAversion = ErrorAversion()
    cost: object = eqx.field(init=False)

    def __post_init__(self):
        self.cost = self.policy.cost

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def uses_horizon(self) -> bool:
        return self.policy.uses_horizon

    def prepare(self, scn, h, horizon):
        return self.policy.prepare(scn, h, horizon)

    def initial_routing(self, scn, aux=None):
        return self.policy.initial_routing(scn, aux)

    def init_state(self, scn, setup, aux, x0):
        n = scn.n_cells
        zeros = jnp.zeros(n, x0.dtype)
        return AversionState(
            inner=self.policy.init_state(scn, setup, aux, x0),
            ema=zeros,
            ema_ring=jnp.zeros((setup.hist, n), x0.dtype),
            aversion=jnp.zeros((n, n), x0.dtype),
        )

    def update(self, scn, setup, state, obs, aux):
        x, inner = self.policy.update(scn, setup, state.inner, obs, aux)
        cfg = self.config
        ema = ema_update(cfg, state.ema, obs.drops, obs.arrivals, setup.h)
        wrap = setup.hist - 1  # (a power of two)
        ring = state.ema_ring.at[obs.k & wrap].set(ema)
        seen = ring[(obs.k - setup.m) & wrap, jnp.arange(scn.n_cells)[None, :]]
        a = aversion_update(cfg, state.aversion, seen, scn.allowed, setup.h)
        return apply_aversion(x, a), AversionState(inner=inner, ema=ema, ema_ring=ring, aversion=a)
