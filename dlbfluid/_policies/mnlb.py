from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .._scenario.arrivals import rate_integral
from .base import AbstractPolicy, replica_fractions, slowdown_factors
from .mnlb_weights import mnlb_weights


class MNLB(AbstractPolicy):
    """The legacy centralised balancer (seed §1.1, App. B): every `update_period` seconds a
    central optimiser recomputes the routing that minimises network latency subject to
    a utilisation cap per cell, and traffic follows those weights until the next update.

    At the update time $t_p = pT_u$ it uses the arrival rates measured over the last
    period, $\\bar\\lambda_i = T_u^{-1}\\int_{t_p-T_u}^{t_p}\\lambda_i$ (the rates are
    extrapolated as constant before $t=0$), and the cells' capacities at $t_p$ (MNLB is
    capacity-aware: it sees an outage or a service slowdown at its next update), and solves the linear program
    of `dlbfluid._policies.mnlb_weights.mnlb_weights` (theory/mnlb.md). It does not use the latency models,
    so it is immune to estimation noise.
    """

    update_period: float = 10.0
    utilisation_cap: float = 0.9
    cost: None = None

    def __check_init__(self):
        T = self.update_period
        if not (isinstance(T, (int, float)) and math.isfinite(T) and T > 0):
            raise ValueError(f"update_period = {T!r} is invalid: expected a finite number > 0")
        u = self.utilisation_cap
        if not (isinstance(u, (int, float)) and 0 < u <= 1):
            raise ValueError(f"utilisation_cap = {u!r} is invalid: expected 0 < value <= 1")

    @property
    def name(self) -> str:
        return "mnlb"

    def initial_routing(self, scn, aux=None):
        """The weights of the first period, $t_0 = 0$ (from the schedule when given)."""
        if aux is None:
            aux = self.prepare(scn, None, self.update_period)
        return aux[0]

    def prepare(self, scn, h, horizon: float):
        T = self.update_period
        n_periods = int(math.floor(horizon / T + 1e-9)) + 1
        dtype = scn.latency.dtype
        tp = jnp.arange(n_periods, dtype=dtype) * T  # (P,)
        lam = (
            jax.vmap(rate_integral, in_axes=(0, 0, None, None), out_axes=-1)(
                scn.arrival_times, scn.arrival_rates, tp - T, tp
            )
            / T
        )  # (P, n)
        at = (tp + 1e-9 * T)[:, None]
        scale = replica_fractions(scn, at)  # (P, n)
        # (a centralised balancer knows every cell's capacity, slowed ones included)
        cap = scale * scn.service.capacity[None, :] / slowdown_factors(scn, at)
        x, _ = jax.vmap(
            lambda lm, cp: mnlb_weights(
                lm,
                scn.latency,
                scn.allowed,
                cp,
                utilisation_cap=self.utilisation_cap,
                cell_mask=scn.cell_mask,
            )
        )(lam, cap)
        return x.astype(dtype)

    def update(self, scn, setup, state, obs, aux):
        # The weights in force on the tick [t_{k+1}, t_{k+2}): those of its midpoint's period.
        t = obs.t + 0.5 * setup.h
        p = jnp.floor(t / self.update_period + 1e-9).astype(jnp.int32)
        x = aux[jnp.clip(p, 0, aux.shape[0] - 1)]
        return x, x
