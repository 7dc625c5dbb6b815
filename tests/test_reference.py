"""Fast self-checks of the numpy/scipy reference implementation (no jax)."""

import numpy as np
import pytest
from scipy.integrate import quad, solve_ivp

try:
    from reference import (
        inverse_mu_prime_function,
        reference_simulate,
        service_functions,
        simplex_projection,
    )
except ImportError:  # tests collected as a package
    from tests.reference import (
        inverse_mu_prime_function,
        reference_simulate,
        service_functions,
        simplex_projection,
    )


def _three_cell(
    lat=((0.0, 0.03, 0.11), (0.03, 0.0, None), (0.11, 0.03, 0.0)), rates=(3.0, 1.0, 2.0)
):
    return {
        "name": "three",
        "cells": [
            {
                "name": "a",
                "arrival_rate": rates[0],
                "replicas": 4,
                "service": {
                    "model": "softplus",
                    "base_latency": 1.0,
                    "capacity": 6.0,
                    "knee": 3.0,
                    "width": 1.0,
                },
            },
            {
                "name": "b",
                "arrival_rate": rates[1],
                "replicas": 2,
                "service": {"model": "mm1", "capacity": 3.0},
            },
            {
                "name": "c",
                "arrival_rate": rates[2],
                "replicas": 3,
                "service": {
                    "model": "softplus",
                    "base_latency": 0.5,
                    "capacity": 4.0,
                    "knee": 2.0,
                    "width": 0.5,
                },
            },
        ],
        "latency": [list(r) for r in lat],
    }


@pytest.mark.parametrize(
    "policy,eta", [("flow-grad", 0.5), ("flow-rif", 1.0), ("disc-lat", 0.0), ("rand", 0.0)]
)
def test_mass_balance(policy, eta):
    sc = _three_cell()
    out = reference_simulate(sc, policy, step_size=eta, tick=0.05, horizon=3.0)
    K = 60
    assert out["t"].shape == (K + 1,)
    assert out["N"].shape == (K + 1, 3)
    assert out["x"].shape == (K + 1, 3, 3)
    assert out["departures"].shape == (K + 1, 3)
    assert out["arrivals"].shape == (K + 1, 3)
    np.testing.assert_allclose(
        out["N"] - out["N"][0], out["arrivals"] - out["departures"], rtol=0, atol=1e-9
    )
    # routing rows are distributions on allowed arcs
    x = out["x"]
    np.testing.assert_allclose(x.sum(axis=2), 1.0, atol=1e-12)
    assert np.all(x >= 0)
    assert np.all(x[:, 1, 2] == 0)


def test_rand_zero_delay_matches_single_ode():
    sc = _three_cell(lat=((0.0, 0.0, 0.0), (0.0, 0.0, None), (0.0, 0.0, 0.0)))
    sc["initial"] = {"workload": [0.5, 0.0, 1.0]}
    h, T = 0.1, 4.0
    out = reference_simulate(sc, "rand", tick=h, horizon=T)
    x0 = out["x"][0]
    lam = np.array([3.0, 1.0, 2.0])
    inflow = lam @ x0
    mus = [service_functions(c["service"])[0] for c in sc["cells"]]

    def rhs(t, N):
        return inflow - np.array([mus[j](N[j]) for j in range(3)])

    sol = solve_ivp(
        rhs, (0.0, T), [0.5, 0.0, 1.0], method="DOP853", rtol=1e-12, atol=1e-12, t_eval=out["t"]
    )
    np.testing.assert_allclose(out["N"], sol.y.T, rtol=0, atol=1e-9)
    # default weighted-random routing: proportional to replicas over allowed arcs
    np.testing.assert_allclose(x0[0], np.array([4, 2, 3]) / 9)
    np.testing.assert_allclose(x0[1], np.array([4, 2, 0]) / 6)
    assert np.all(out["x"] == x0)


def _delayed_x_integral(xh, h, tau, t_end):
    """int_0^t_end x(s - tau) ds for piecewise-constant x (x^k on [kh,(k+1)h), x^0 before 0)."""
    a, b = -tau, t_end - tau
    total = 0.0
    if a < 0:
        total += xh[0] * (min(b, 0.0) - a)
        a = 0.0
    while a < b - 1e-15:
        kk = int(np.floor(a / h + 1e-9))
        end = min((kk + 1) * h, b)
        total += xh[min(kk, len(xh) - 1)] * (end - a)
        a = end
    return total


def test_arrivals_match_delayed_routing_history():
    """Constant rates: arrivals equal sum_i lambda_i int x_ij(s - tau_ij) ds from the x history."""
    sc = _three_cell()
    h = 0.05
    out = reference_simulate(sc, "flow-grad", step_size=0.8, tick=h, horizon=2.0)
    lam = np.array([3.0, 1.0, 2.0])
    lat = sc["latency"]
    for k in (7, 23, 40):
        tk = out["t"][k]
        expect = np.zeros(3)
        for i in range(3):
            for j in range(3):
                if lat[i][j] is None:
                    continue
                expect[j] += lam[i] * _delayed_x_integral(out["x"][:, i, j], h, lat[i][j], tk)
        np.testing.assert_allclose(out["arrivals"][k], expect, rtol=0, atol=1e-10)
    assert not np.allclose(out["x"][-1], out["x"][0])  # routing actually moved


def test_piecewise_linear_rate_arrivals():
    times = [0.0, 0.5, 0.5, 1.2, 2.0]
    rates = [1.0, 3.0, 0.5, 2.5, 1.5]
    sc = _three_cell(
        rates=({"times": times, "rates": rates}, 1.0, {"times": [0.3, 1.0], "rates": [2.0, 0.0]})
    )
    h = 0.1
    out = reference_simulate(sc, "rand", tick=h, horizon=3.0)
    x0 = out["x"][0]
    np.testing.assert_allclose(
        out["N"] - out["N"][0], out["arrivals"] - out["departures"], atol=1e-9
    )

    def lam_fn(spec):
        if not isinstance(spec, dict):
            return lambda s: float(spec), []
        T, R = np.array(spec["times"]), np.array(spec["rates"])

        def f(s):
            if s < T[0]:
                return R[0]
            if s >= T[-1]:
                return R[-1]
            p = np.searchsorted(T, s, side="right") - 1
            return R[p] + (R[p + 1] - R[p]) * (s - T[p]) / (T[p + 1] - T[p])

        return f, list(T)

    lat = sc["latency"]
    for k in (4, 13, 30):
        tk = out["t"][k]
        expect = np.zeros(3)
        for i in range(3):
            f, pts = lam_fn(sc["cells"][i]["arrival_rate"])
            for j in range(3):
                if lat[i][j] is None:
                    continue
                tau = lat[i][j]
                brk = [p + tau for p in pts if 0 < p + tau < tk]
                val, _ = quad(
                    lambda t, f=f, tau=tau: f(t - tau),
                    0.0,
                    tk,
                    points=brk or None,
                    epsabs=1e-13,
                    epsrel=1e-13,
                    limit=200,
                )
                expect[j] += x0[i, j] * val
        np.testing.assert_allclose(out["arrivals"][k], expect, rtol=0, atol=1e-9)


def test_simplex_projection_kkt():
    rng = np.random.default_rng(0)
    for _ in range(300):
        d = int(rng.integers(1, 8))
        v = rng.normal(scale=rng.choice([0.1, 1.0, 10.0]), size=d)
        mask = rng.random(d) < 0.7
        x = simplex_projection(v, mask)
        if not mask.any():
            assert np.all(x == 0)
            continue
        assert np.all(x[~mask] == 0)
        assert np.all(x >= 0)
        assert abs(x.sum() - 1) < 1e-12
        # KKT: x_j = max(v_j - theta, 0) for a common theta on allowed entries
        vm, xm = v[mask], x[mask]
        pos = xm > 0
        theta = np.mean(vm[pos] - xm[pos])
        np.testing.assert_allclose(vm[pos] - xm[pos], theta, atol=1e-12)
        assert np.all(vm[~pos] <= theta + 1e-12)
        # brute-force optimality vs random feasible points
        for _ in range(5):
            y = np.zeros(d)
            y[mask] = rng.dirichlet(np.ones(mask.sum()))
            assert np.sum((x - v)[mask] ** 2) <= np.sum((y - v)[mask] ** 2) + 1e-12
    # 2-D row-wise with an empty row
    V = rng.normal(size=(3, 4))
    M = np.array([[1, 1, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=bool)
    X = simplex_projection(V, M)
    np.testing.assert_allclose(X[[0, 2]].sum(axis=1), 1.0)
    assert np.all(X[1] == 0)


def test_softplus_values():
    svc = {"model": "softplus", "base_latency": 1.0, "capacity": 10.0, "knee": 5.0, "width": 2.0}
    mu, mu_prime, latency = service_functions(svc)
    inv = inverse_mu_prime_function(svc)
    N = np.array([0, 1, 5, 10, 20, 50, 100], dtype=float)
    l_exp = [1.015778, 1.025386, 1.138629, 1.515778, 2.500111, 5.500000, 10.500000]
    g_exp = [1.015778, 1.037446, 1.458962, 3.883439, 12.470773, 60.5, 220.5]
    np.testing.assert_allclose(latency(N), l_exp, rtol=1e-6)
    np.testing.assert_allclose(inv(N), g_exp, rtol=1e-6)
    np.testing.assert_allclose(1.0 / mu_prime(N), g_exp, rtol=1e-6)
    np.testing.assert_allclose(mu(N), N / latency(N))
    # mu' against a finite difference
    e = 1e-6
    np.testing.assert_allclose(
        mu_prime(N + 1.0), (mu(N + 1.0 + e) - mu(N + 1.0 - e)) / (2 * e), rtol=1e-6
    )


def test_mm1_values():
    mu, mu_prime, latency = service_functions({"model": "mm1", "capacity": 3.0})
    N = np.array([0.0, 1.0, 4.0])
    np.testing.assert_allclose(mu(N), 3 * N / (1 + N))
    np.testing.assert_allclose(latency(N), (1 + N) / 3)
    np.testing.assert_allclose(1 / mu_prime(N), (1 + N) ** 2 / 3)


def test_disc_ties_and_unreachable_row():
    sc = {
        "name": "ties",
        "cells": [
            {
                "name": "a",
                "arrival_rate": 1.0,
                "replicas": 1,
                "service": {"model": "mm1", "capacity": 5.0},
            },
            {
                "name": "b",
                "arrival_rate": 1.0,
                "replicas": 1,
                "service": {"model": "mm1", "capacity": 5.0},
            },
            {
                "name": "c",
                "arrival_rate": 0.0,
                "replicas": 1,
                "service": {"model": "mm1", "capacity": 5.0},
            },
        ],
        "latency": [[0.0, 0.0, None], [0.0, 0.0, None], [None, None, None]],
    }
    out = reference_simulate(sc, "disc-rif", tick=0.1, horizon=0.5)
    # symmetric: both cells have equal N -> exact tie split 1/2, 1/2
    np.testing.assert_allclose(out["x"][1, 0], [0.5, 0.5, 0.0])
    assert np.all(out["x"][:, 2] == 0)
    np.testing.assert_allclose(out["N"][:, 2], 0.0)
