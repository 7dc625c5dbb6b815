"""Theorem-1 diagnostics: drift inequality, zero-delay monotonicity, the bound's shape."""

import copy

import jax
import numpy as np
import pytest
from helpers import THREE, both_laws, random_scenario

import dlbfluid as dl
from dlbfluid._equilibrium import solve_equilibrium
from dlbfluid._theorem1.lyapunov import (
    fit_theorem1,
    loglog_slope,
    lyapunov_diagnostics,
    workload_gap,
    workload_potential,
)


@pytest.fixture(scope="module")
def three(catalogue_equilibrium):
    return catalogue_equilibrium("three", "gradient")


def _diag(s, eq, cost, policy, eta, h, T):
    sol = dl.simulate(s, policy, step_size=eta, tick=h, horizon=T, n_save=int(round(T / h)))
    return lyapunov_diagnostics(sol, s, eq, cost=cost, step_size=eta)


def test_potential_and_gap_closed_forms():
    """RIF: Phi = sum (N - N*)^2/(2k) exactly; D_j >= 0 and zero only at N*."""
    s = dl.scenario_from_dict(THREE)
    Ns = np.array([1.0, 2.0, 0.5])
    N = np.array([2.0, 0.3, 0.5])
    k = np.asarray(s.replicas)
    phi = float(workload_potential("rif", s, N, Ns))
    assert phi == pytest.approx(np.sum((N - Ns) ** 2 / (2 * k)), rel=1e-13)
    D = np.asarray(workload_gap("gradient", s, N, Ns))
    assert np.all(D[:2] > 0) and D[2] == 0.0


def test_drift_inequality_within_measured_discretisation_error(three):
    """[R + Phi]_0^t - int(-sum D - sum lam S^tau + sum lam Gamma) <= eps(h) along flow-grad
    with delays; eps(h) is first order in the tick (measured: ~1.7 h), so it halves."""
    s, eq = three
    ex = [float(_diag(s, eq, "gradient", "flow-grad", 0.3, h, 20.0).drift_excess.max())
          for h in (0.04, 0.02)]
    assert ex[1] < 0.6 * ex[0]
    assert ex[1] < 2.5 * 0.02


def test_drift_on_random_trajectories_and_slackness_sign():
    """Random 3-cell networks under flow-lat and flow-rif: the drift excess stays within the
    first-order bound and S_i >= 0 (complementary slackness of the reference point)."""
    rng = np.random.default_rng(3)
    for cost, policy in (("latency", "flow-lat"), ("rif", "flow-rif")):
        s = both_laws(random_scenario(rng, 3, load=0.7, max_tau=0.15))
        eq = solve_equilibrium(s, cost)
        d = _diag(s, eq, cost, policy, 0.2, 0.02, 20.0)
        assert float(d.drift_excess.max()) < 2.5 * 0.02 * max(1.0, float(d.R[0] + d.Phi[0]))
        assert float(d.slack.min()) >= -1e-9
        assert float(d.gap.min()) >= 0.0


def test_zero_delays_drift_is_nonpositive(three):
    """Without delays S^tau = S >= 0 and Gamma = 0, so R + Phi is non-increasing up to the
    O(h) Euler term, which vanishes with h."""
    d0 = copy.deepcopy(THREE)
    d0["latency"] = [[0.0] * 3] * 3
    s = dl.scenario_from_dict(d0)
    eq = solve_equilibrium(s, "latency")
    d = _diag(s, eq, "latency", "flow-lat", 0.3, 0.01, 20.0)
    np.testing.assert_allclose(d.mismatch, 0.0, atol=1e-12)
    np.testing.assert_allclose(d.slack_delayed, d.slack, atol=1e-12)
    V = np.asarray(d.R + d.Phi)
    assert np.max(np.diff(V)) < 1e-3 * V[0]
    assert V[-1] < 1e-3 * V[0]


def test_schedule_gives_inverse_square_root_decay(three):
    """eta = T^(-1/2) started at N(0) = N*: the time-average distance decays like T^(-1/2)
    (log-log slope within 0.1 of -0.5); the fitted A/(T eta) + B eta + C/T explains a fixed-eta
    sweep (relative rms error < 10%)."""
    s, eq = three
    d2 = copy.deepcopy(THREE)
    d2["initial"] = {"workload": np.asarray(eq.N).tolist()}
    s2 = dl.scenario_from_dict(d2)
    h, Ts = 0.05, np.array([100.0, 200.0, 400.0, 800.0])
    etas = Ts**-0.5
    sols = dl.simulate(s2, "flow-grad", step_size=etas[:, None], tick=h, horizon=Ts.max(),
                       n_save=int(Ts.max() / h))
    tad, rows = [], []
    for b, T in enumerate(Ts):
        sol = jax.tree_util.tree_map(lambda a, b=b: a[b], sols)
        d = lyapunov_diagnostics(sol, s2, eq, cost="gradient", step_size=etas[b])
        tad.append(float(d.time_average_distance[int(T / h)]))
        for T2 in Ts:
            rows.append((T2, etas[b], float(d.time_average_distance[int(T2 / h)])))
    assert abs(loglog_slope(Ts, tad) + 0.5) < 0.1
    rows = np.array(rows)
    fit = fit_theorem1(rows[:, 0], rows[:, 1], rows[:, 2])
    assert fit["rel_rmse"] < 0.1 and fit["A"] > 0


def test_fit_recovers_synthetic_constants():
    T, eta = np.meshgrid([10.0, 30.0, 100.0, 300.0], [0.03, 0.1, 0.3, 1.0])
    y = 0.7 / (T * eta) + 0.05 * eta + 2.0 / T
    fit = fit_theorem1(T, eta, y)
    assert fit["A"] == pytest.approx(0.7, rel=1e-9)
    assert fit["B"] == pytest.approx(0.05, rel=1e-9)
    assert fit["C"] == pytest.approx(2.0, rel=1e-9)


def test_requires_per_tick_saves(three):
    s, eq = three
    # 480 saves of 500 ticks (the 512-save bucket of the drift check's run at h = 0.04: its
    # compiled program)
    sol = dl.simulate(s, "flow-grad", step_size=0.3, tick=0.04, horizon=20.0, n_save=480)
    assert sol.N.shape[0] == 481
    with pytest.raises(ValueError, match="n_save equal to the number of ticks"):
        lyapunov_diagnostics(sol, s, eq, cost="gradient", step_size=0.3)
