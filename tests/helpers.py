"""A catalogue of scenarios with known answers, shared by the tests.

Closed forms are derived in theory/equilibria.md §4 and theory/stability.md §2 (cited per entry).
"""

from __future__ import annotations

import copy

import equinox as eqx
import jax.numpy as jnp
import numpy as np

import dlbfluid as dl

# Three cells, unequal delays (none a multiple of the 0.05 s tick), two softplus cells.
THREE = {
    "name": "three",
    "cells": [
        {"name": "a", "arrival_rate": 2.0, "replicas": 3,
         "service": {"model": "softplus", "base_latency": 1.0, "capacity": 4.0, "knee": 2.0,
                     "width": 1.0}},
        {"name": "b", "arrival_rate": 1.0, "replicas": 2,
         "service": {"model": "softplus", "base_latency": 0.6, "capacity": 3.0, "knee": 1.0,
                     "width": 0.5}},
        {"name": "c", "arrival_rate": 1.5, "replicas": 2,
         "service": {"model": "mm1", "capacity": 3.0}},
    ],
    "latency": [[0.0, 0.03, 0.11], [0.03, 0.0, 0.07], [0.11, 0.07, 0.0]],
}


def three(**changes) -> dict:
    d = copy.deepcopy(THREE)
    d.update(changes)
    return d


def two_mm1(mu1=2.0, mu2=1.0, lam=1.5, tau=0.0) -> dict:
    """One origin (cell 0) and two M/M/1 cells (theory/equilibria.md §4 A when tau = 0).

    Wardrop: z1 = (lam + mu1 - mu2)/2. Social optimum (square-root rule):
    z_j = mu_j - sqrt(mu_j) (mu1 + mu2 - lam)/(sqrt(mu1) + sqrt(mu2)).
    """
    return {
        "name": "two-mm1",
        "cells": [
            {"name": "fast", "arrival_rate": lam, "replicas": 2,
             "service": {"model": "mm1", "capacity": mu1}},
            {"name": "slow", "arrival_rate": 0.0, "replicas": 1,
             "service": {"model": "mm1", "capacity": mu2}},
        ],
        "latency": [[0.0, tau], [tau, 0.0]],
    }


def square_root_rule(mu1, mu2, lam):
    s = (mu1 + mu2 - lam) / (np.sqrt(mu1) + np.sqrt(mu2))
    z = np.array([mu1 - np.sqrt(mu1) * s, mu2 - np.sqrt(mu2) * s])
    mu = np.array([mu1, mu2])
    return z, z / (mu - z)


def wardrop_two(mu1, mu2, lam):
    z1 = 0.5 * (lam + mu1 - mu2)
    z = np.array([z1, lam - z1])
    mu = np.array([mu1, mu2])
    return z, z / (mu - z)


def symmetric_pair(tau: float, lam: float = 1.0) -> dict:
    """One origin (a zero-capacity-demand hub) sending to two identical M/M/1 cells
    (mubar = 1) over arcs of equal one-way delay tau (theory/stability.md §2)."""
    return {
        "name": "symmetric-pair",
        "cells": [
            {"name": "origin", "arrival_rate": lam, "replicas": 1,
             "service": {"model": "mm1", "capacity": 1.0}},
            {"name": "left", "arrival_rate": 0.0, "replicas": 1,
             "service": {"model": "mm1", "capacity": 1.0}},
            {"name": "right", "arrival_rate": 0.0, "replicas": 1,
             "service": {"model": "mm1", "capacity": 1.0}},
        ],
        "latency": [[None, tau, tau], [None, 0.0, None], [None, None, 0.0]],
    }


def random_scenario(rng: np.random.Generator, n: int, *, load=0.7, max_tau=0.2) -> dict:
    """A random strictly feasible network: softplus and M/M/1 cells, all arcs allowed."""
    cells = []
    caps = rng.uniform(2.0, 6.0, n)
    shares = rng.dirichlet(np.ones(n))
    for j in range(n):
        if rng.random() < 0.5:
            L0 = rng.uniform(0.5, 1.5)
            knee = rng.uniform(0.2, 0.8) * L0 * caps[j]
            svc = {"model": "softplus", "base_latency": L0, "capacity": caps[j], "knee": knee,
                   "width": rng.uniform(0.3, 2.0)}
        else:
            svc = {"model": "mm1", "capacity": caps[j]}
        cells.append({"name": f"c{j}", "arrival_rate": load * caps.sum() * shares[j],
                      "replicas": int(rng.integers(1, 6)), "service": svc})
    tau = rng.uniform(0.0, max_tau, (n, n))
    tau = 0.5 * (tau + tau.T)
    np.fill_diagonal(tau, 0.0)
    return {"name": f"random-{n}", "cells": cells, "latency": tau.tolist()}


# Standard compiled shapes. The service laws of a scenario are static (each set of laws
# compiles its own programs), so the catalogue scenarios below are built for both built-in
# laws: the symmetric pair (M/M/1 only) and THREE (softplus and M/M/1), both 3 cells, then
# share one compiled equilibrium solver per cost, one simulate per policy and tick, one
# Theorem 1 check (`stack_scenarios(..., laws=LAWS)` does the same for a batch).
LAWS = ("mm1", "softplus")


def both_laws(d: dict, **kwargs):
    """`scenario_from_dict(d, **kwargs)` with a service table that evaluates both built-in
    laws (the cells' own laws are unchanged: a law a cell does not use is only selected
    away)."""
    s = dl.scenario_from_dict(d, **kwargs)
    return dl.pad_scenario(s, s.n_cells, laws=LAWS, est_laws=LAWS)


# The request-level tests' short runs of one M/M/1 cell with a replica schedule share one
# compiled program (`simulate_requests`' static configuration: these sizes, the policy and
# the scenario's shapes; tests/test_requests.py and tests/test_requests_outage.py).
REQUESTS_SHORT = dict(trials=2, horizon=1.0, tick=0.25, n_save=4, slots=16, events=64)


def contract_batch():
    """The contract batch of tests/test_contracts.py (`test_policy_contract`'s `mixed`):
    THREE, the two-M/M/1 network (tau = 0.07, padded to 3 cells) and THREE with a NaN base
    latency (validation bypassed: it ends `nonfinite` from t = 0), both service laws. With
    `CONTRACT_RUN` (step 0.3, tick 0.05, 2 s, 40 saves) a policy's batch-first run is the
    contract's compiled program: other tests that run this batch share it."""
    good = dl.scenario_from_dict(THREE)
    other = dl.scenario_from_dict(two_mm1(tau=0.07))
    bad = eqx.tree_at(lambda s: s.service.base_latency, good, jnp.array([jnp.nan, 0.6, 1.0]))
    return dl.stack_scenarios([good, other, bad], laws=LAWS)


CONTRACT_RUN = dict(step_size=0.3, tick=0.05, horizon=2.0, n_save=40)
"""`simulate`'s options in the contract run (40 ticks, a save at each).

The simulate programs most tests share (per policy, dtype and integrator): THREE alone
(unbatched) or a batch of 3 three-cell scenarios with both laws, `Fast()`, 33-64 saves
(`n_save` is compiled in buckets: 40 is the tests' choice) and delays below 3 ticks (four
ring slots: THREE at a tick of 0.05 or 0.1). The step size, tick and horizon are values,
not shapes (the horizon is static only for MNLB's schedule)."""


def stub_simulate_requests(monkeypatch, ex, runs: int = 1, **fields) -> dict:
    """Replace the experiment module `ex`'s `simulate_requests` by a stand-in for `runs`
    runs of one trial each (mean latency 1, p90 2, no errors, `success`); `fields` set its
    other attributes (`estimation`, `cell_mask` and the session fields, None unless
    given). Returns the dict its keyword arguments are recorded in."""
    seen: dict = {}
    shape = (runs, 1)
    attrs = dict(
        served=np.ones(shape),
        latency_sum=np.ones(shape),
        percentile=staticmethod(lambda q: np.full(shape, 2.0)),
        error_rate=staticmethod(lambda: np.zeros(shape)),
        status_names=staticmethod(lambda: np.full(shape, "success")),
        estimation=None,
        cell_mask=None,
        cache_hit_rate=None,
        busiest_server_share=None,
        session_move_rate=None,
    )
    attrs.update(fields)
    stub_solution = type("StubSolution", (), attrs)

    def stub(batch, policy, **kw):
        seen.update(kw)
        return stub_solution()

    monkeypatch.setattr(ex, "simulate_requests", stub)
    return seen
