"""Service schedules (`cells[].service_schedule`): a cell's service times multiplied, and
its processing rate divided, by a piecewise-constant factor $s_j(t)$, in the fluid model
and in the request-level twin (theory/evaluation.md and theory/requests.md, *Service
schedules*). Known answers: the fluid ODE integrated by scipy, the M/M/1 plateau
$N^* = \\lambda/(\\bar\\mu/s - \\lambda)$, hand-computed FIFO completions, and the
identity "a cell slowed by $s$ for all time is the cell of capacity $\\bar\\mu/s$"."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.integrate import solve_ivp

import dlbfluid as dl
from dlbfluid._requests.fifo import ServiceClock, serve
from dlbfluid._scenario.io import scenario_to_dict

H = 0.05
SLOW = {"times": [0.0, 20.0, 60.0], "factors": [1.0, 2.0, 1.0]}


def one_cell(lam=4.0, mu=10.0, schedule=None):
    cell = {"name": "a", "arrival_rate": lam, "replicas": 1,
            "service": {"model": "mm1", "capacity": mu}}
    if schedule is not None:
        cell["service_schedule"] = schedule
    return {"name": "one", "cells": [cell], "latency": [[0.0]]}


def two_cells(slow=None, mu_b=10.0):
    b = {"name": "b", "arrival_rate": 5.0, "replicas": 2,
         "service": {"model": "mm1", "capacity": mu_b}}
    if slow is not None:
        b["service_schedule"] = {"times": [0.0], "factors": [slow]}
    return {"name": "two", "cells": [
        {"name": "a", "arrival_rate": 3.0, "replicas": 3,
         "service": {"model": "mm1", "capacity": 12.0}}, b],
        "latency": [[0.01, 0.03], [0.03, 0.01]],
        "initial": {"workload": [2.0, 6.0]}}


# -- the file format --------------------------------------------------------------------


def test_schedule_is_parsed_padded_and_written_back():
    scn = dl.scenario_from_dict(one_cell(schedule=SLOW))
    np.testing.assert_array_equal(np.asarray(scn.slowdown_times), [[0.0, 20.0, 60.0]])
    np.testing.assert_array_equal(np.asarray(scn.slowdown_factors), [[1.0, 2.0, 1.0]])
    assert scenario_to_dict(scn)["cells"][0]["service_schedule"] == SLOW
    # Without a schedule: one column of factor 1, and the file says nothing.
    plain = dl.scenario_from_dict(one_cell())
    assert np.asarray(plain.slowdown_factors).tolist() == [[1.0]]
    assert "service_schedule" not in scenario_to_dict(plain)["cells"][0]
    # A one-entry schedule is stored twice (so that the routers observe it) and written once.
    const = dl.scenario_from_dict(two_cells(slow=3.0))
    assert np.asarray(const.slowdown_factors).tolist() == [[1.0, 1.0], [3.0, 3.0]]
    assert scenario_to_dict(const)["cells"][1]["service_schedule"] == {
        "times": [0.0], "factors": [3.0]}
    # Stacking pads every scenario's schedule with its last entry.
    batch = dl.stack_scenarios([plain, dl.scenario_from_dict(one_cell(schedule=SLOW))])
    np.testing.assert_array_equal(np.asarray(batch.slowdown_factors),
                                  [[[1.0, 1.0, 1.0]], [[1.0, 2.0, 1.0]]])
    # Padding never drops entries.
    with pytest.raises(ValueError, match="cannot pad 3 service-schedule entries to 2"):
        dl.pad_scenario(dl.scenario_from_dict(one_cell(schedule=SLOW)), 1, n_slowdown=2)


# -- the fluid model --------------------------------------------------------------------


def test_fluid_follows_the_slowdown_against_scipy():
    # One M/M/1 cell, lam = 4, mu_bar = 10, slowed 2x on [20, 60): dN/dt = lam - mu(N)/s(t)
    # with mu(N) = 10 N/(1 + N); plateaus N* = lam/(mu_bar/s - lam): 2/3, then 4, then 2/3.
    scn = dl.scenario_from_dict(one_cell(schedule=SLOW))
    sol = dl.simulate(scn, "rand", tick=H, horizon=100.0, n_save=100)
    N = np.asarray(sol.N[:, 0])

    def s(t):
        return 2.0 if 20.0 <= t < 60.0 else 1.0

    ref = solve_ivp(lambda t, y: [4.0 - 10.0 * y[0] / (1.0 + y[0]) / s(t)], (0.0, 100.0),
                    [0.0], t_eval=np.arange(101.0), rtol=1e-11, atol=1e-12,
                    method="DOP853", max_step=0.05)
    # (Fast is RK4 per 50 ms tick; the breakpoints lie on the tick grid)
    np.testing.assert_allclose(N, ref.y[0], rtol=1e-6, atol=1e-9)
    assert N[20] == pytest.approx(2.0 / 3.0, rel=1e-6)
    assert N[60] == pytest.approx(4.0, rel=1e-3)  # (relaxing at rate (1 - 0.8)^2 mu/s)
    assert N[100] == pytest.approx(2.0 / 3.0, rel=1e-6)


def test_constant_slowdown_is_a_slower_cell():
    # mm1's rate is proportional to its capacity, so a cell slowed by s for all time is
    # the cell of capacity mu_bar/s, for the cells and for the routers (latency and
    # gradient costs both scale; RIF does not see it either way).
    # (one batch, one compilation: the nominal cell is given a schedule of factor 1)
    batch = dl.stack_scenarios([dl.scenario_from_dict(two_cells(slow=2.5)),
                                dl.scenario_from_dict(two_cells(mu_b=4.0)),
                                dl.scenario_from_dict(two_cells(slow=1.0))])
    sol = dl.simulate(batch, "flow-grad", tick=H, horizon=10.0, n_save=20)
    N, x = np.asarray(sol.N), np.asarray(sol.x)
    np.testing.assert_allclose(N[0], N[1], rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(x[0], x[1], rtol=1e-11, atol=1e-12)
    # Negative control: the nominal cell routes differently.
    assert float(np.max(np.abs(x[2] - x[1]))) > 1e-2
    # MNLB's schedule of weights: its capacities are divided by the slowdown (the same
    # weights as the smaller cell's, not the nominal one's).
    mnlb = dl.MNLB()
    weights = jax.jit(jax.vmap(lambda s: mnlb.prepare(s, None, 30.0)))
    w = np.asarray(weights(batch))
    np.testing.assert_allclose(w[0], w[1], rtol=1e-9, atol=1e-12)
    assert float(np.max(np.abs(w[2] - w[1]))) > 1e-2


def test_route_costs_scale_with_the_observed_slowdown():
    # mm1, mu_bar = 10, N = 3: latency (1 + N)/mu_bar = 0.4, gradient (1 + N)^2/mu_bar = 1.6;
    # observed at s = 2.5 they are 1.0 and 4.0; RIF N/k = 3 stays; the arc parts 2 tau stay.
    scn = dl.scenario_from_dict(one_cell(lam=0.0))
    N, s = jnp.array([[3.0]]), jnp.array([[2.5]])
    assert float(dl.route_costs("latency", scn, N, None, s)[0, 0]) == pytest.approx(1.0)
    assert float(dl.route_costs("gradient", scn, N, None, s)[0, 0]) == pytest.approx(4.0)
    assert float(dl.route_costs("rif", scn, N, None, s)[0, 0]) == pytest.approx(3.0)
    assert float(dl.route_costs("latency", scn, N)[0, 0]) == pytest.approx(0.4)


def test_bad_factors_are_named():
    for factors, words in (([1.0, 0.5], "[1, 1e+06]"), ([1.0, 1e7], "[1, 1e+06]"),
                           ([1.0, "x"], "slowdown factor")):
        d = one_cell(schedule={"times": [0.0, 5.0], "factors": factors})
        with pytest.raises(dl.ScenarioError, match=r"cells\[0\].service_schedule.factors\[1\]")\
                as err:
            dl.scenario_from_dict(d)
        assert words in str(err.value)
    d = one_cell(schedule={"times": [5.0, 5.0], "factors": [1.0, 2.0]})
    with pytest.raises(dl.ScenarioError, match=r"service_schedule.times.*strictly increasing"):
        dl.scenario_from_dict(d)


# -- the request-level twin -------------------------------------------------------------


def test_clock_advances_across_breakpoints():
    # Speed 1 before t = 10, 1/4 from 10 to 30, 1 again after: work 2 started at 9 does 1
    # by 10 and the rest at 1/4, ending at 14; work 6 started at 9 ends at 9 + 1 + 4*5 = 30;
    # work 7 ends at 31; a start inside the slow span at 12 with work 1 ends at 16.
    @jax.jit
    def run(starts, work, t):
        clock = ServiceClock.of(jnp.array([0.0, 10.0, 30.0]), jnp.array([1.0, 4.0, 1.0]),
                                jnp.float64)
        return (clock.advance(starts, work), clock.inverse(clock.forward(t)),
                clock.forward(jnp.array(jnp.inf)))

    t = jnp.linspace(-5.0, 50.0, 111)
    ends, back, inf = run(jnp.array([9.0, 9.0, 9.0, 12.0, -3.0]),
                          jnp.array([2.0, 6.0, 7.0, 1.0, 1.0]), t)
    np.testing.assert_allclose(np.asarray(ends), [14.0, 30.0, 31.0, 16.0, -2.0], rtol=1e-14)
    np.testing.assert_allclose(np.asarray(back), np.asarray(t), atol=1e-12)
    assert float(inf) == np.inf


def test_serve_in_the_clocks_units():
    # The engine keeps a slowed cell's server rows in its clock's units, where Lindley's and
    # Kiefer-Wolfowitz's sums hold as they are. A server whose prefill engine frees at 9.5
    # and whose one decode slot frees at 12 (clock units 9.5 and 10.5, under the clock
    # above); a request arrives at 9 with prefill work 1 and decode work 2: prefill runs
    # 9.5 -> 10 (0.5 work) -> 12 (0.5 work at 1/4); decode starts at 12 and ends at
    # 12 + 4*2 = 20.
    @jax.jit
    def run(row, t, pw, dw):
        clock = ServiceClock.of(jnp.array([0.0, 10.0, 30.0]), jnp.array([1.0, 4.0, 1.0]),
                                jnp.float64)
        new, c, f, start = serve(clock.forward(row), clock.forward(t), pw, dw, 1)
        return clock.inverse(jnp.stack([f, start, c])), clock.inverse(new[:3])

    row = jnp.array([9.5, 12.0, 0.0, 0.0])
    ends, new = run(row, jnp.array(9.0), jnp.array(1.0), jnp.array(2.0))
    np.testing.assert_allclose(np.asarray(ends), [12.0, 12.0, 20.0], rtol=1e-14)
    np.testing.assert_allclose(np.asarray(new), [12.0, 20.0, 20.0], rtol=1e-14)
    # Negative control: in seconds (no clock), prefill ends at 10.5 and decode runs 12 -> 14.
    assert float(serve(row, jnp.array(9.0), jnp.array(1.0), jnp.array(2.0), 1)[1]) == 14.0


def test_twin_constant_slowdown_is_a_slower_cell():
    # The same identity request by request in FIFO servers: the same draws give the same
    # requests, whose service takes s times as long (the clock at constant speed 1/s).
    # (Markov cells divide their rate by s: test_twin_follows_the_slowdown_and_recovers.)
    # (the same seed: two calls of one compiled program, the smaller cell given a schedule
    # of factor 1 so that the shapes agree)
    slowed = dl.scenario_from_dict(two_cells(slow=2.5))
    smaller = dl.scenario_from_dict(two_cells(mu_b=4.0, slow=1.0))
    kw = dict(service="servers", scale=2, trials=2, horizon=4.0, n_save=4, tick=H)
    a = dl.simulate_requests(slowed, "flow-lat", **kw)
    b = dl.simulate_requests(smaller, "flow-lat", **kw)
    assert int(np.sum(a.served)) > 50
    np.testing.assert_array_equal(np.asarray(a.served), np.asarray(b.served))
    np.testing.assert_allclose(np.asarray(a.latency_sum), np.asarray(b.latency_sum),
                               rtol=1e-9)
    np.testing.assert_allclose(np.asarray(a.final_x), np.asarray(b.final_x), rtol=1e-9)


def test_twin_follows_the_slowdown_and_recovers():
    # Two M/M/1 cells under rand, cell b slowed 3x on [10, 25): its rate mu_bar/3 = 3.33
    # is below its arrivals 5, so a backlog builds at about 1.67/s and drains after 25 at
    # about 5/s, in the fluid, in markov cells (its fluid limit) and in FIFO servers.
    d = copy.deepcopy(two_cells())
    d["cells"][0]["service"]["capacity"] = 10.0
    d["cells"][0]["replicas"] = 1
    d["cells"][1]["replicas"] = 1
    d["cells"][1]["service_schedule"] = {"times": [0.0, 10.0, 25.0], "factors": [1, 3, 1]}
    d["latency"] = [[0.01, None], [None, 0.01]]
    d.pop("initial")
    scn = dl.scenario_from_dict(d)
    fluid = np.asarray(dl.simulate(scn, "rand", tick=H, horizon=40.0, n_save=8).N[:, 1])
    # (t = 0, 5, ..., 40: plateau 1, then the build-up to ~30 at t = 25, then the drain)
    assert fluid[2] == pytest.approx(1.0, rel=1e-3) and fluid[5] > 25.0 and fluid[8] < 1.5
    kw = dict(scale=20, trials=2, horizon=40.0, n_save=8, tick=H)
    markov = dl.simulate_requests(scn, "rand", service="markov", **kw)
    N = np.asarray(markov.count[..., 1]).mean(0) / 20.0
    np.testing.assert_allclose(N[3:6], fluid[3:6], rtol=0.15)
    # FIFO servers (20 exponential servers of rate 10 at this scale: not the fluid's mm1
    # law, but while overloaded all of them are busy): the backlog grows at
    # lam - mu_bar/3 = 1.67/s (Poisson noise: about 0.14 on the two trials' mean) ...
    servers = dl.simulate_requests(scn, "rand", service="servers", **kw)
    N = np.asarray(servers.count[..., 1]).mean(0) / 20.0
    assert 1.25 < (N[5] - N[3]) / 10.0 < 2.1
    # ... and drains once the slowdown ends (a request's work is done at the speed in force
    # while it is served; slowing the work of the requests admitted during the slowdown
    # instead left this backlog still growing at t = 55).
    assert N[7] < 3.0 and N[8] < 3.0
