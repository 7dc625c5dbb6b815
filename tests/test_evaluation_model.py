"""The fluid model of the paper's evaluation (seed §3.4, App. B): finite queues with drops,
replica schedules (outages), the routers' estimated service model, error aversion, and
the schedule policies Rand and MNLB. Known answers are derived in theory/evaluation.md."""

from __future__ import annotations

import copy

import jax.numpy as jnp
import numpy as np
import pytest
from scipy.optimize import brentq

import dlbfluid as dl
from dlbfluid._policies.aversion import ErrorAversion

H = 0.05


def one_cell(lam=15.0, mu=10.0, buffer=5.0, replicas=1, schedule=None):
    cell = {"name": "a", "arrival_rate": lam, "replicas": replicas,
            "service": {"model": "mm1", "capacity": mu}}
    if buffer is not None:
        cell["buffer"] = buffer
    if schedule is not None:
        cell["replica_schedule"] = schedule
    return {"name": "one", "cells": [cell], "latency": [[0.0]]}


def test_full_queue_drops_at_the_closed_form_rate():
    # M/M/1 cell, lam = 15 > mu_bar = 10, buffer B = 5: once full, the cell serves
    # mu(B) = 10*5/6 and drops lam - mu(B) = 6.6667/s, i.e. an error rate of 0.44444.
    scn = dl.scenario_from_dict(one_cell(), allow_overload=True)
    # (200 saves, as the two tests below: the three runs share one compiled program)
    sol = dl.simulate(scn, "rand", tick=H, horizon=20.0, n_save=200)
    assert float(sol.N[-1, 0]) == pytest.approx(5.0, abs=1e-12)
    assert float(sol.N.max()) <= 5.0
    expected = (15.0 - 10.0 * 5.0 / 6.0) / 15.0
    assert float(sol.error_rate(window=0.5)) == pytest.approx(expected, rel=1e-10)
    # Mass balance with the drops counted.
    bal = sol.N[:, 0] + sol.departures[:, 0] + sol.drops[:, 0] - sol.arrivals[:, 0]
    assert float(jnp.max(jnp.abs(bal))) < 1e-10
    # The served requests' latency is l(B) = (1 + B)/mu_bar = 0.6 s by Little's law.
    assert float(sol.mean_latency(window=0.5)) == pytest.approx(0.6, rel=1e-10)


def test_time_to_fill_the_queue_matches_the_ode():
    # Before the queue is full the model is the plain ODE dN/dt = lam - mu N/(1+N); the
    # first drop happens when N reaches B. Integrate the ODE by scipy to the fill time.
    from scipy.integrate import solve_ivp

    lam, mu, B = 15.0, 10.0, 5.0
    ev = lambda t, y: y[0] - B  # noqa: E731
    ev.terminal = True
    ref = solve_ivp(lambda t, y: [lam - mu * y[0] / (1 + y[0])], (0, 10), [0.0], events=ev,
                    rtol=1e-12, atol=1e-12)
    t_fill = ref.t_events[0][0]
    scn = dl.scenario_from_dict(one_cell(lam, mu, B), allow_overload=True)
    sol = dl.simulate(scn, "rand", tick=H, horizon=10.0, n_save=200)
    # Drops over [t_fill, 10] at the full-queue rate; the projection is first order in
    # the sub-step only within the one sub-step where the queue fills.
    expected = (lam - mu * B / (1 + B)) * (10.0 - t_fill)
    assert float(sol.drops[-1, 0]) == pytest.approx(expected, abs=0.05)
    assert float(sol.drops[int(t_fill / 0.05) - 1, 0]) == 0.0


def test_unlimited_buffer_changes_nothing():
    d = one_cell(lam=8.0, buffer=None)
    a = dl.simulate(dl.scenario_from_dict(d), "rand", tick=H, horizon=10.0, n_save=200)
    d["cells"][0]["buffer"] = 1e12
    b = dl.simulate(dl.scenario_from_dict(d), "rand", tick=H, horizon=10.0, n_save=200)
    np.testing.assert_array_equal(np.asarray(a.N), np.asarray(b.N))
    assert float(a.drops.max()) == 0.0


def test_replica_outage_scales_the_cell_and_recovers():
    # M/M/1 cell of 4 replicas, mu_bar = 10, lam = 4; during [20, 60) it runs 2 of them:
    # rate c*mu(N/c) = mu_bar N/(1 + N/c), so N* = lam/(mu_bar - lam/c): 0.6667 -> 2.
    sch = {"times": [0.0, 20.0, 60.0], "replicas": [4, 2, 4]}
    scn = dl.scenario_from_dict(one_cell(lam=4.0, buffer=None, replicas=4, schedule=sch))
    # (100 saves: test_an_outage_shrinks_the_queue_with_the_servers runs this program)
    sol = dl.simulate(scn, "rand", tick=H, horizon=100.0, n_save=100)
    N = np.asarray(sol.N[:, 0])
    assert N[20] == pytest.approx(4.0 / 6.0, rel=1e-6)
    assert N[60] == pytest.approx(4.0 / (10.0 - 8.0), rel=1e-6)
    assert N[100] == pytest.approx(4.0 / 6.0, rel=1e-6)


def test_rand_follows_the_replica_schedule():
    d = {"name": "r", "cells": [
        {"name": "a", "arrival_rate": 3.0, "replicas": 3,
         "service": {"model": "mm1", "capacity": 10.0},
         "replica_schedule": {"times": [0.0, 2.0, 4.0], "replicas": [3, 1, 3]}},
        {"name": "b", "arrival_rate": 0.0, "replicas": 1,
         "service": {"model": "mm1", "capacity": 10.0}}],
        "latency": [[0.0, 0.01], [0.01, 0.0]]}
    sol = dl.simulate(dl.scenario_from_dict(d), "rand", tick=H, horizon=6.0, n_save=6)
    x = np.asarray(sol.x[:, 0, 0])
    np.testing.assert_allclose(x, [0.75, 0.75, 0.5, 0.5, 0.75, 0.75, 0.75], atol=1e-15)


def test_routers_use_their_estimated_model():
    # Two parallel M/M/1 cells of true capacity 10 each, no network latency; the routers
    # believe cell 2 has capacity 5. flow-lat settles where the *believed* latencies are
    # equal, (1 + N1)/10 = (1 + N2)/5, with the true workloads N_j = z_j/(10 - z_j).
    lam = 12.0
    d = {"name": "est", "cells": [
        {"name": "a", "arrival_rate": lam, "service": {"model": "mm1", "capacity": 10.0}},
        {"name": "b", "arrival_rate": 0.0, "service": {"model": "mm1", "capacity": 10.0},
         "estimated_service": {"model": "mm1", "capacity": 5.0}}],
        "latency": [[0.0, 0.0], [0.0, 0.0]]}
    scn = dl.scenario_from_dict(d)

    def gap(z1):
        N1, N2 = z1 / (10 - z1), (lam - z1) / (10 - lam + z1)
        return (1 + N1) / 10 - (1 + N2) / 5

    z1 = brentq(gap, lam - 10 + 1e-9, 10 - 1e-9, xtol=1e-14)
    sol = dl.simulate(scn, "flow-lat", step_size=2.0, tick=H, horizon=200.0, n_save=10)
    assert float(sol.x[-1, 0, 0]) * lam == pytest.approx(z1, rel=1e-6)
    # The true-model run splits evenly.
    d2 = copy.deepcopy(d)
    del d2["cells"][1]["estimated_service"]
    sol2 = dl.simulate(dl.scenario_from_dict(d2), "flow-lat", step_size=2.0, tick=H,
                       horizon=200.0, n_save=10)
    assert float(sol2.x[-1, 0, 0]) == pytest.approx(0.5, abs=1e-6)


def test_route_costs_scale_with_the_observed_replica_fraction():
    scn = dl.scenario_from_dict(one_cell(lam=1.0, buffer=None, replicas=4))
    N = jnp.array([[3.0]])
    for cost in ("rif", "latency", "gradient"):
        half = dl.route_costs(cost, scn, N, jnp.array([[0.5]]))
        full = dl.route_costs(cost, scn, 2.0 * N)
        assert float(half[0, 0]) == pytest.approx(float(full[0, 0]), rel=1e-15)
    # RIF: N/k(t) = 3/(0.5*4).
    assert float(dl.route_costs("rif", scn, N, jnp.array([[0.5]]))[0, 0]) == 1.5


def _burst_pair():
    # Rand splits 1:1 (equal replicas) whatever the capacities. Cell a (capacity 6, queue 3)
    # overflows while the source bursts to 16/s on [10, 40); before and after, 8/s is fine.
    prof = {"times": [0.0, 10.0, 10.0, 40.0, 40.0], "rates": [8.0, 8.0, 16.0, 16.0, 8.0]}
    return dl.scenario_from_dict({"name": "burst", "cells": [
        {"name": "a", "arrival_rate": prof, "buffer": 3.0,
         "service": {"model": "mm1", "capacity": 6.0}},
        {"name": "b", "arrival_rate": 0.0, "buffer": 50.0,
         "service": {"model": "mm1", "capacity": 20.0}}],
        "latency": [[0.0, 0.02], [0.02, 0.0]]})


def test_error_aversion_shifts_traffic_away_and_back():
    scn = _burst_pair()
    plain = dl.simulate(scn, "rand", tick=H, horizon=100.0, n_save=100)
    averse = dl.simulate(scn, "rand", tick=H, horizon=100.0, n_save=100,
                         error_aversion=ErrorAversion())
    # Without aversion: during the burst cell a gets 8/s and drops 8 - mu(3) = 3.5/s.
    d_plain = float(plain.drops[40, 0] - plain.drops[20, 0]) / 20.0
    assert d_plain == pytest.approx(8.0 - 6.0 * 3.0 / 4.0, rel=1e-9)
    # With aversion traffic moves to b during the burst, so far fewer drops ...
    d_av = float(averse.drops[40, 0] - averse.drops[20, 0]) / 20.0
    assert d_av < 0.1 * d_plain
    assert float(averse.x[35, 0, 0]) < 0.45
    # ... and it returns to the 1:1 split once the cell is healthy again (aversion decays
    # at `recovery` = 0.05/s, so it is gone 20 s after the burst at the latest).
    assert float(averse.x[-1, 0, 0]) == pytest.approx(0.5, abs=1e-12)
    assert float(averse.drops[-1, 0] - averse.drops[60, 0]) == 0.0
    assert float(averse.error_rate()) < 0.2 * float(plain.error_rate())


def test_bad_inputs_are_named():
    with pytest.raises(dl.ScenarioError, match=r"cells\[0\].buffer"):
        dl.scenario_from_dict(one_cell(buffer=-1.0), allow_overload=True)
    with pytest.raises(dl.ScenarioError, match=r"replica_schedule.times"):
        dl.scenario_from_dict(one_cell(schedule={"times": [0, 5, 2], "replicas": [1, 1, 1]}),
                              allow_overload=True)
    with pytest.raises(dl.ScenarioError, match=r"replica_schedule.replicas\[1\]"):
        dl.scenario_from_dict(one_cell(schedule={"times": [0, 5], "replicas": [1, 0]}),
                              allow_overload=True)
    with pytest.raises(ValueError, match="max_aversion"):
        ErrorAversion(max_aversion=1.0)
    scn = dl.scenario_from_dict(one_cell(), allow_overload=True)
    with pytest.raises(ValueError, match="Accurate"):
        dl.simulate(scn, "rand", tick=H, horizon=1.0, integrator=dl.Accurate())


def test_scenario_round_trip_keeps_the_new_fields():
    d = one_cell(schedule={"times": [0.0, 5.0], "replicas": [1, 0.5]})
    d["cells"][0]["estimated_service"] = {"model": "mm1", "capacity": 12.0}
    back = dl.scenario_to_dict(dl.scenario_from_dict(d, allow_overload=True))
    c = back["cells"][0]
    assert c["buffer"] == 5.0
    assert c["replica_schedule"] == {"times": [0.0, 5.0], "replicas": [1.0, 0.5]}
    assert c["estimated_service"] == {"model": "mm1", "capacity": 12.0}


def test_an_outage_shrinks_the_queue_with_the_servers():
    # 2 replicas, buffer 4, lam = 2 < mu_bar: N* = 2/(10-2) = 0.25 before the outage. At
    # t = 10 one replica is left: the queue holds 2 and the capacity is 5 > lam, no drops;
    # cut the buffer below N*: buffer 0.4 -> 0.2 < N(10^-) = 0.25 drops 0.05 at once.
    # (The schedule's third point, at the horizon, changes nothing: with it and 100 saves,
    # a save every 0.2 s, the run is test_replica_outage_scales_the_cell_and_recovers'
    # compiled program.)
    sch = {"times": [0.0, 10.0, 20.0], "replicas": [2, 1, 1]}
    d = one_cell(lam=2.0, buffer=0.4, replicas=2, schedule=sch)
    sol = dl.simulate(dl.scenario_from_dict(d), "rand", tick=H, horizon=20.0, n_save=100)
    assert float(sol.t[50]) == pytest.approx(10.0) and float(sol.t[75]) == pytest.approx(15.0)
    assert float(sol.drops[50, 0]) == 0.0
    assert float(sol.N[50, 0]) == pytest.approx(0.25, rel=1e-9)
    assert float(sol.N.max()) <= 0.4
    assert float(sol.N[-1, 0]) == pytest.approx(0.2, abs=1e-12)
    # Once full at 0.2, the cell serves mu(0.2) = 10*0.2/(1 + 0.2/0.5) and drops the rest.
    mu_full = 10 * 0.2 / (1 + 0.4)
    rate = float(sol.drops[-1, 0] - sol.drops[75, 0]) / 5.0
    assert rate == pytest.approx(2.0 - mu_full, rel=1e-9)


def _window_width_by_profile(times, span, rates):
    """The window width one profile at a time: the largest count of kept breakpoints in
    [t_p, t_p + span], plus 2; the trailing run of breakpoints identical to the last
    (from the second breakpoint on) is not kept, the 2 covering its end."""
    t = np.asarray(times, float).reshape(-1, times.shape[-1])
    r = np.asarray(rates, float).reshape(t.shape)
    P = t.shape[-1]
    if P <= 4:
        return P
    most = 0
    for row, rr in zip(t, r):
        keep = P
        while keep > 1 and row[keep - 1] == row[-1] and rr[keep - 1] == rr[-1]:
            keep -= 1
        for p in range(keep):
            most = max(most, sum(1 for q in range(p, keep) if row[q] <= row[p] + span * (1 + 1e-9)))
    return min(P, most + 2)


def test_window_width_against_profile_loop():
    """`_window_width` (all profiles at once) against a loop over profiles and pairs, on
    random sorted profiles with ties, jumps and trailing runs of padding."""
    from dlbfluid._simulate import verb as sim

    rng = np.random.default_rng(3)
    seen = set()
    for _ in range(200):
        M, P = int(rng.integers(1, 12)), int(rng.integers(1, 20))
        t = np.sort(np.round(rng.uniform(0, 4, (M, P)), int(rng.integers(0, 3))), axis=1)
        if rng.random() < 0.5:
            k = int(rng.integers(1, P + 1))
            t[:, k:] = t[:, k - 1 : k]
        r = np.round(rng.uniform(0, 3, (M, P)))
        span = float(rng.choice([0.1, 0.5, 1.0, 2.0]))
        want = _window_width_by_profile(t, span, r)
        assert sim._window_width(t, span, r) == want, (t, r, span)
        seen.add(want)
    assert len(seen) > 8  # widths from small to the whole profile were exercised


def test_profile_window_is_exact(monkeypatch):
    # Generated scenarios carry ~60 arrival breakpoints; each tick integrates over a window
    # of a few of them. Forcing the full profile must give the same trajectory.
    from dlbfluid._evaluation.generator import generate, scenario_dicts
    from dlbfluid._simulate import verb as sim

    d = scenario_dicts(generate(3, 1, max_cells=4), event="spikes", trial=1, horizon=120.0)[0]
    scn = dl.scenario_from_dict(d, allow_overload=True)
    P = scn.arrival_times.shape[-1]
    assert P > 12
    assert sim._window_width(np.asarray(scn.arrival_times), 0.3) < P / 2
    # Padding (a repeated last breakpoint, or a padded cell of zeros) does not widen it.
    batch = dl.stack_scenarios([scn, dl.scenario_from_dict(one_cell(lam=2.0, buffer=None))],
                               n_cells=6)
    assert sim._window_width(np.asarray(batch.arrival_times), 0.3,
                             np.asarray(batch.arrival_rates)) < P / 2
    kw = dict(step_size=0.5, tick=0.2, horizon=120.0, n_save=12)
    a = dl.simulate(scn, "flow-grad", **kw)
    monkeypatch.setattr(sim, "_window_width", lambda t, span, r=None: t.shape[-1])
    b = dl.simulate(scn, "flow-grad", **kw)
    np.testing.assert_allclose(np.asarray(a.N), np.asarray(b.N), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(a.arrivals), np.asarray(b.arrivals), rtol=1e-12)
    # The saved mass in flight integrates the carried window of the next tick.
    assert float(np.max(np.asarray(b.in_flight))) > 0.1
    np.testing.assert_allclose(np.asarray(a.in_flight), np.asarray(b.in_flight), rtol=1e-12)
    # And in a padded batch with a constant-rate scenario.
    c = dl.simulate(batch, "flow-grad", **kw)
    np.testing.assert_allclose(np.asarray(c.N[0])[:, : scn.n_cells], np.asarray(b.N),
                               rtol=1e-12, atol=1e-12)
