"""A router whose routing is not finite is a per-trial status at request level, in both
engines (`loop.NONFINITE_ROUTING`): a request routed by such a row would land on an
arbitrary cell, so the trial is `nonfinite`, never `success`, and the other scenario of
the batch is unaffected."""

from __future__ import annotations

from typing import ClassVar

import jax.numpy as jnp
import numpy as np
import pytest

import dlbfluid as dl
from dlbfluid._policies import AbstractPolicy
from dlbfluid._requests.loop import NONFINITE_ROUTING
from dlbfluid._requests.solution import RequestSimulationError


class Poisoned(AbstractPolicy):
    """The scenario's own routing, turned NaN after tick 20 in scenarios whose first root
    has demand above 1.5 requests/s."""

    cost: ClassVar[None] = None

    @property
    def name(self) -> str:
        return "poisoned"

    def update(self, scn, setup, state, obs, aux):
        bad = (obs.k >= 20) & (scn.arrival_rates[0, 0] > 1.5)
        return jnp.where(bad, jnp.nan, scn.initial_routing), state


def scenario(rate: float) -> dl.Scenario:
    cells = [{"name": f"c{j}", "arrival_rate": rate, "replicas": 1,
              "service": {"model": "mm1", "capacity": 4.0}} for j in range(2)]  # fmt: skip
    return dl.scenario_from_dict(
        {"name": "pair", "cells": cells, "latency": [[0.01, 0.02], [0.02, 0.01]]}
    )


@pytest.mark.parametrize("service", ["markov", "servers"])
def test_a_nonfinite_routing_is_the_trials_status(service):
    batch = dl.stack_scenarios([scenario(1.0), scenario(2.0)])
    sol = dl.simulate_requests(batch, Poisoned(), service=service, trials=2, horizon=1.0,
                               throw=False)  # fmt: skip
    assert sol.status_names().tolist() == [["success"] * 2, ["nonfinite"] * 2]
    assert np.all(np.asarray(sol.overflow)[1] & NONFINITE_ROUTING)
    assert not np.any(np.asarray(sol.overflow)[0])
    with pytest.raises(RequestSimulationError, match="routing was not finite"):
        sol.raise_for_status()
