"""The three extension examples (examples/): a user's own policy, cost family and service
model, each defined in one file outside the package, registered, and run through the
verbs. Each test runs the example's `main` in this process (the registry is restored
afterwards) and checks its numbers against independent closed forms."""

import importlib.util
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import LAWS
from scipy.optimize import brentq

import dlbfluid as dl
from dlbfluid import _registry

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def registry():
    """Leave the registries as they were (examples register members globally)."""
    saved = [
        (r, dict(r._items), dict(r._resolved))
        for r in (_registry.POLICIES, _registry.COSTS, _registry.SERVICE_MODELS)
    ]
    yield
    for r, items, resolved in saved:
        r._items, r._resolved = items, resolved


def test_custom_service_model(registry):
    """`MM1Delay` defines only l(N) = D + (1+N)/mubar; the base class derives mu', 1/mu',
    the inverse and the flow balance. Against the closed forms mu = mubar N/(mubar D + 1 + N),
    mu' = mubar (mubar D + 1)/(mubar D + 1 + N)^2 and mu^{-1}(z) = z(D + 1/mubar)/(1 - z/mubar)
    to 1e-12; the gradient cost's equilibrium (through the derived 1/mu') certified to 1e-10
    in a table mixed with softplus cells (small mode: one cost, one compiled solver; a
    certificate is self-consistency, the closed forms above are the correctness)."""
    ex = _load("custom_service_model")
    out = ex.main(small=True)
    sv = dl.ServiceModel.of("mm1-delay", capacity=jnp.array([3.0, 2.0]), delay=jnp.array([0.2, 0.05]))
    cap, D = np.array([3.0, 2.0]), np.array([0.2, 0.05])
    N = jnp.array([0.7, 4.0])
    a = cap * D + 1.0
    np.testing.assert_allclose(sv.rate(N), cap * N / (a + N), rtol=1e-13)
    np.testing.assert_allclose(sv.rate_prime(N), cap * a / (a + N) ** 2, rtol=1e-12)
    np.testing.assert_allclose(sv.inv_rate_prime(N), (a + N) ** 2 / (cap * a), rtol=1e-12)
    z = jnp.array([1.1, 1.9])
    np.testing.assert_allclose(sv.inverse_rate(z), z * (D + 1 / cap) / (1 - z / cap), rtol=1e-12)
    assert np.isinf(np.asarray(sv.inverse_rate(jnp.array([3.0, 2.5])))).all()
    scn = dl.scenario_from_dict(ex.scenario())
    assert scn.service.laws == ("softplus", "mm1-delay")
    assert set(out["equilibria"]) == {"gradient"}
    eq = out["equilibria"]["gradient"]
    assert float(eq.kkt_residual) <= 1e-10 and eq.status_names() == "success"
    assert out["simulate"].status_names() == "success"
    assert math.isfinite(out["critical_step_size"]) and out["critical_step_size"] > 0
    assert out["verify"] is None  # (small: verify with a user's extension runs in test_custom_cost)


def test_custom_cost(registry):
    """`Drain` (f = N/mubar, g = 2 tau) registers flow-drain and disc-drain. On one origin
    and two M/M/1 cells without delays its equilibrium equalises N_j/mubar_j = t, with
    sum_j mubar_j^2 t/(1 + mubar_j t) = lambda (scipy's brentq), to 1e-10."""
    ex = _load("custom_cost")
    out = ex.main(small=True)
    assert {"flow-drain", "disc-drain"} <= set(dl.POLICIES.names())
    assert float(out["equilibrium"].kkt_residual) <= 1e-10
    assert out["verify"]["policies"]["flow-drain"]["failed"] == 0
    mu, lam = np.array([2.0, 1.0]), 1.5
    d = {
        "name": "pair",
        "cells": [
            {"name": "a", "arrival_rate": lam, "service": {"model": "mm1", "capacity": 2.0}},
            {"name": "b", "arrival_rate": 0.0, "service": {"model": "mm1", "capacity": 1.0}},
        ],
        "latency": [[0.0, 0.0], [0.0, 0.0]],
    }
    t = brentq(lambda t: np.sum(mu * mu * t / (1 + mu * t)) - lam, 0.0, 100.0, xtol=1e-15)
    # (padded to the default scenario's 4 cells and laws: the solver `main` compiled)
    scn = dl.pad_scenario(dl.scenario_from_dict(d), 4, laws=LAWS, est_laws=LAWS)
    eq = dl.solve_equilibrium(scn, "drain")
    np.testing.assert_allclose(np.asarray(eq.N)[:2], mu * t, rtol=1e-10)
    assert np.all(np.asarray(eq.N)[2:] == 0.0)


def test_custom_policy(registry):
    """`SoftminRouting.route` is the logit rule x_ij = exp(-(c_ij - min c)/T)/sum (numpy
    reference, 1e-14); it runs by name in `simulate` (mass balance to 1e-9) and in
    `run_experiment` (one summary row per policy, Rand's normalised latency exactly 1)."""
    ex = _load("custom_policy")
    out = ex.main(small=True)
    pol = dl.policy_from_name("softmin-lat")
    c = np.array([[1.0, 1.3, 2.0], [0.5, 0.1, 9.0]])
    allowed = np.array([[True, True, False], [True, True, True]])
    x = np.asarray(pol.route(None, jnp.asarray(c), None, jnp.asarray(allowed)))
    w = np.where(allowed, np.exp(-(c - np.where(allowed, c, np.inf).min(1, keepdims=True)) / 0.2), 0)
    np.testing.assert_allclose(x, w / w.sum(1, keepdims=True), rtol=1e-14)
    sol = out["simulate"]
    lhs = np.asarray(sol.source_arrivals[-1]).sum() - np.asarray(sol.departures[-1]).sum()
    rhs = np.asarray(sol.N[-1] - sol.N[0]).sum() + float(sol.in_flight[-1] - sol.in_flight[0])
    assert abs(lhs - rhs) <= 1e-9 * np.asarray(sol.source_arrivals[-1]).sum()
    rows = {r["policy"]: r for r in out["experiment"]["summary"]}
    assert set(rows) == {"rand", "softmin-lat"}  # (small: the reference and the new policy)
    assert rows["rand"]["normalized_latency"] == 1.0
    assert 0.5 < rows["softmin-lat"]["normalized_latency"] < 1.5
