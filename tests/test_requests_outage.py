"""Replica schedules in the request-level twin (theory/requests.md, *Replica schedules*):
the markov cell's law at its running fraction, server cells capped by their running
servers, and the fluid limit through an outage (`experiment outage --model requests`:
tests/test_cli_requests.py)."""

from __future__ import annotations

import math

import helpers
import numpy as np
import pytest

from dlbfluid import scenario_from_dict, simulate, simulate_requests, stack_scenarios


def mean_se(v):
    v = np.asarray(v, dtype=float)
    return float(v.mean()), float(v.std(ddof=1) / math.sqrt(v.size))


def within(value, expected, se):
    return abs(value - expected) <= 3.0 * se


def cell(lam, mu, replicas, schedule=None) -> dict:
    c = {
        "name": "a",
        "arrival_rate": lam,
        "replicas": replicas,
        "service": {"model": "mm1", "capacity": mu},
    }
    if schedule is not None:
        c["replica_schedule"] = schedule
    return {"name": "one", "cells": [c], "latency": [[0.0]]}


# ----------------------------------------------------------------------------------------
# (a) markov: the M/M/1-law cell at scale k with a fraction c of its replicas completes at
# k c mu(N/(k c)) = mubar N / (1 + N/(k c)); detailed balance with births k lam gives the
# negative binomial pi(n) ~ C(n + kc, n) rho^n, rho = lam/(c mubar): mean (kc + 1) rho/(1 - rho)
# ----------------------------------------------------------------------------------------

MU, LAM, T0 = 10.0, 3.0, 20.0


def nb_mean(c, k=1.0, lam=LAM, mu=MU):
    rho = lam / (c * mu)
    return (k * c + 1.0) * rho / (1.0 - rho)


def detailed_balance_mean(c, k=1.0, lam=LAM, mu=MU, n_max=4000):
    """The same mean summed from pi(n)/pi(n-1) = k lam / rate(n) (the closed form's check)."""
    n = np.arange(1, n_max)
    rate = mu * n / (1.0 + n / (k * c))
    logp = np.concatenate([[0.0], np.cumsum(np.log(k * lam / rate))])
    p = np.exp(logp - logp.max())
    return float(np.sum(np.arange(n_max) * p) / p.sum())


def test_closed_form_is_detailed_balance():
    for c in (1.0, 0.5):
        assert nb_mean(c) == pytest.approx(detailed_balance_mean(c), rel=1e-9)


def test_markov_cell_follows_its_halved_replicas():
    """Two replicas, one from t0 = 20 s: before the drop the full cell (rho = 0.3, mean
    0.857), after it the halved one (capacity 5, rho' = 0.6, mean 1.5 rho'/(1 - rho') =
    2.25; relaxation time 1/(sqrt 5 - sqrt 3)^2 = 3.9 s, the window starts 20 s later).
    Per-trial means of the counts saved every 0.5 s, within 3 standard errors of 128
    trials; negative control: each window is far from the other regime's mean."""
    sched = {"times": [0.0, T0], "replicas": [2, 1]}
    scn = scenario_from_dict(cell(LAM, MU, 2, sched))
    sol = simulate_requests(
        scn, "rand", trials=128, horizon=80.0, tick=0.25, n_save=160, slots=64, seed=1
    )
    assert np.all(sol.status_names() == "success")
    t = np.asarray(sol.t)
    counts = np.asarray(sol.count[:, :, 0], float)  # (trials, saves)
    before = counts[:, (t >= 5.0) & (t < T0)].mean(1)
    after = counts[:, t >= T0 + 20.0].mean(1)
    m0, se0 = mean_se(before)
    m1, se1 = mean_se(after)
    assert within(m0, nb_mean(1.0), se0), (m0, se0, nb_mean(1.0))
    assert within(m1, nb_mean(0.5), se1), (m1, se1, nb_mean(0.5))
    assert not within(m1, nb_mean(1.0), se1) and not within(m0, nb_mean(0.5), se0)
    assert int(np.sum(sol.drops)) == 0  # (infinite buffer: the drop loses nothing)


def test_markov_drops_the_excess_of_a_shrunk_buffer():
    """A buffer of 8 with every request present at t = 0 (8 of them), a cut to a quarter of
    the replicas at t = 0.5 s: the buffer becomes floor(8/4) = 2 and the 6 requests above
    it are dropped at once (as the fluid drops its excess), with 0 arrivals."""
    d = cell(0.0, 1e-6, 4, {"times": [0.0, 0.5], "replicas": [4, 1]})
    d["cells"][0]["buffer"] = 8.0
    d["initial"] = {"workload": [8.0]}
    sol = simulate_requests(scenario_from_dict(d), "rand", **helpers.REQUESTS_SHORT)
    assert np.asarray(sol.count)[0, :, 0].tolist() == [8, 8, 8, 2, 2]
    assert np.asarray(sol.drops).tolist() == [[6], [6]]


# ----------------------------------------------------------------------------------------
# (b) servers: four exponential FIFO servers of rate 1 at lam = 3, two from t = 10 s. The
# two left are overloaded: after the other two drain, the served rate is 2 (a capped
# cell), against lam = 3 without the schedule.
# ----------------------------------------------------------------------------------------


def test_servers_cell_is_capped_by_its_remaining_servers():
    cut = scenario_from_dict(
        cell(3.0, 4.0, 4, {"times": [0.0, 10.0], "replicas": [4, 2]}), allow_overload=True
    )
    full = scenario_from_dict(cell(3.0, 4.0, 4))
    W = 90.0
    sol = simulate_requests(stack_scenarios([cut, full]), "rand", service="servers", trials=8,
                            horizon=110.0, warmup=110.0 - W, tick=0.25, n_save=4, slots=256,
                            seed=2)  # fmt: skip
    assert np.all(sol.status_names() == "success")
    rate = np.asarray(sol.served, float) / W
    m_cut, se_cut = mean_se(rate[0])
    m_full, se_full = mean_se(rate[1])
    assert within(m_cut, 2.0, se_cut), (m_cut, se_cut)
    assert within(m_full, 3.0, se_full), (m_full, se_full)
    assert not within(m_full, 2.0, se_full)  # negative control: without the cut, uncapped
    # The two running servers are always busy (utilisation 1 of the running ones), while the
    # full cell's four are busy 3/4 of the time.
    u_cut = np.asarray(sol.utilisation[0, :, 0])
    assert np.all(u_cut > 0.99), u_cut
    m_u, se_u = mean_se(sol.utilisation[1, :, 0])
    assert within(m_u, 0.75, se_u), (m_u, se_u)


def test_servers_need_integer_scheduled_counts():
    d = cell(3.0, 4.0, 4, {"times": [0.0, 10.0], "replicas": [4, 2.5]})
    with pytest.raises(ValueError, match="integer replica counts"):
        simulate_requests(scenario_from_dict(d), "rand", service="servers", horizon=1.0)


# ----------------------------------------------------------------------------------------
# (c) the fluid limit through an outage: sup_t |N^k/k - N| at k = 4 and 64
# ----------------------------------------------------------------------------------------

SCALES = (4, 64)


def outage_pair(schedule: bool) -> dict:
    """Without the outage, a schedule that keeps both replicas (the same shapes: one
    compiled fluid program for both)."""
    a = {"name": "a", "arrival_rate": 1.5, "replicas": 2,
         "service": {"model": "mm1", "capacity": 2.0},
         "replica_schedule": {"times": [0.0, 1.0], "replicas": [2, 1 if schedule else 2]}}  # fmt: skip
    b = {"name": "b", "arrival_rate": 0.0, "replicas": 1,
         "service": {"model": "mm1", "capacity": 1.0}}  # fmt: skip
    return {"name": "pair", "cells": [a, b], "latency": [[0.0, 0.03], [0.03, 0.0]],
            "initial": {"workload": [2.0, 0.0]}}  # fmt: skip


def test_fluid_limit_holds_through_an_outage():
    """Cell a loses half its replicas at t = 1 s (tick 0.02: on the grid); flow-grad moves
    load to b. The expected sup error over 12 trials falls by 16^(1/2) = 4 from k = 4 to 64
    (accepted: 16^0.35 .. 16^0.65 = 2.6 .. 6.1, the k^-1/2 law with the trials' noise).
    Negative control: the trials' mean path at k = 64 is more than 5 times further from the
    fluid without the outage than from the fluid with it (0.05 against 0.7)."""
    scn = scenario_from_dict(outage_pair(True))
    opts = dict(tick=0.02, horizon=3.0, n_save=30)
    sol = simulate_requests(stack_scenarios([scn] * len(SCALES)), "flow-grad",
                            scale=np.asarray(SCALES), trials=12, slots=1024, **opts)  # fmt: skip
    assert np.all(sol.status_names() == "success")
    fluid = np.asarray(simulate(scn, "flow-grad", **opts).N)
    dens = np.asarray(sol.density())  # (scales, trials, saves, cells)
    sup = np.max(np.abs(dens - fluid[None, None]), (-2, -1)).mean(1)
    ratio = sup[0] / sup[1]
    assert 16**0.35 <= ratio <= 16**0.65, (sup, ratio)
    # The trials' mean path at k = 64 follows the fluid with the outage (bias O(1/k)), and
    # is far from the fluid without it.
    plain = np.asarray(simulate(scenario_from_dict(outage_pair(False)), "flow-grad", **opts).N)
    path = dens[1].mean(0)
    near, off = np.max(np.abs(path - fluid)), np.max(np.abs(path - plain))
    assert off > 5.0 * near, (off, near)


# ----------------------------------------------------------------------------------------
# (d) the outage experiment at request level: tests/test_cli_requests.py,
# test_experiment_at_request_level_beside_the_fluid_model, runs `experiment outage --model
# requests` (two policies, finite p90, Rand's normalised p90 1, the fluid beside it)
# ----------------------------------------------------------------------------------------
