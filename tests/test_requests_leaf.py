"""The leaf rules of `servers` cells (theory/requests.md, *Leaf rules*): join the shortest
queue (`jsq`, the default) and power-of-d choices on the tokens waiting (`pod`).

Known answers: with every server drawn, `pod` is the least-tokens rule (the choice itself,
key by key), which on exponential FIFO servers is one FCFS queue in front of c servers, so
a cell is M/M/c (Erlang C); with d = 1 a request joins a uniformly random server, so the
cell is c independent M/M/1 queues of rate lambda/c. Each is checked against its closed
form within 3 standard errors of the trials, and each is the other's negative control."""

import math

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import dlbfluid as dl
from dlbfluid._requests._leaf import JoinShortestQueue, PowerOfD, leaf_from_name
from dlbfluid._requests.fifo import FifoCells

# ----------------------------------------------------------------------------------------
# The choice itself
# ----------------------------------------------------------------------------------------

COUNT = jnp.array([3, 1, 2, 1, 0, 5], jnp.int32)
TOKENS = jnp.array([40.0, 12.0, 12.0, 30.0, 55.0, 0.0])
VALID = jnp.array([True, True, True, True, True, False])  # the last server is not running


def _choices(leaf, n_draws=4000):
    # (each admission's `leaf.draws` uniforms, as the engine's table holds them)
    u = jr.uniform(jr.PRNGKey(7), (n_draws, max(leaf.draws, 1)), jnp.float64)
    return np.asarray(jax.jit(jax.vmap(lambda v: leaf.choose(v, COUNT, TOKENS, VALID)))(u))


def test_pod_with_every_server_drawn_is_the_least_tokens_rule():
    """d >= the running servers: every draw picks the fewest tokens among the running servers
    (12 at servers 1 and 2), the tie going to the fewer requests (server 1); the stopped
    server 5, with 0 tokens, never. jsq picks the fewest requests instead (server 4)."""
    for d in (5, 6):
        assert set(_choices(PowerOfD(d)).tolist()) == {1}
    assert set(_choices(JoinShortestQueue(), 4).tolist()) == {4}


def test_pod_draws_d_distinct_running_servers_uniformly():
    """d = 1: uniform over the 5 running servers. d = 2: each of the 10 pairs of running
    servers equally likely, won by the fewer tokens, then the fewer requests: server 1
    wins whenever it is drawn (4/10), server 4 (the most tokens) never, server 0 only
    beside server 4 (1/10). Frequencies within 4 standard errors of 4,000 draws (Floyd's
    algorithm on each admission's uniforms)."""
    n = 4000
    one = np.bincount(_choices(PowerOfD(1), n), minlength=6) / n
    two = np.bincount(_choices(PowerOfD(2), n), minlength=6) / n
    expect_one = np.array([0.2, 0.2, 0.2, 0.2, 0.2, 0.0])
    # pairs of {0..4} (10, equally likely); the winner of each by (tokens, count, index):
    # 1 beats all; 2 beats 0, 3, 4; 3 beats 0, 4; 0 beats 4.
    expect_two = np.array([1, 4, 3, 2, 0, 0]) / 10
    for got, want in ((one, expect_one), (two, expect_two)):
        se = np.sqrt(want * (1 - want) / n) + 1e-12
        assert np.all(np.abs(got - want) <= 4 * se + 1e-12), (got, want)
    assert np.abs(two - expect_one).max() > 0.1  # (negative control: d = 2 is not uniform)


def test_tokens_waiting_counts_both_stages():
    """One App.-B cell (prefill 0.002 s/token, decode 0.05 s/token, 2 of 3 decode slots)
    and one exponential cell, at t = 1: server rows [F, V1, V2, V3, completions...]."""
    cells = FifoCells(
        servers=jnp.array([2, 2], jnp.int32),
        prefill_token_time=jnp.array([0.002, 0.0]),
        decode_token_time=jnp.array([0.05, 0.0]),
        decode_slots=jnp.array([2, 0], jnp.int32),
        exponential=jnp.array([False, True]),
        rate=jnp.array([1.0, 4.0]),
        prefill_bound=jnp.array([False, True]),
        workload=None,
        tokens=True,
    )
    block = jnp.array([[1.4, 3.0, 0.5, 9.0, 3.0], [0.2, 1.1, 1.6, jnp.inf, 1.6]])
    got = np.asarray(cells.tokens_waiting(0, block, 1.0, 3))
    # server 0: 0.4/0.002 = 200 prompt tokens + (2.0 + 0)/0.05 = 40 output tokens (the
    # third slot is not the cell's); server 1: 0 + (0.1 + 0.6)/0.05 = 14
    np.testing.assert_allclose(got, [240.0, 14.0], rtol=1e-12)
    np.testing.assert_allclose(np.asarray(cells.tokens_waiting(1, block, 1.0, 3)), [0.4, 0.0])


def test_leaf_arguments_are_checked():
    with pytest.raises(ValueError, match=r"PowerOfD.d = 0 is invalid: expected an integer >= 1"):
        PowerOfD(0)
    with pytest.raises(ValueError, match=r"leaf = 'jiq' is invalid: allowed jsq, pod"):
        leaf_from_name("jiq")
    assert leaf_from_name("pod") == PowerOfD(2)
    scn = dl.scenario_from_dict(_cell(3))
    with pytest.raises(ValueError, match=r"leaf = 'pod' is invalid: markov cells have no servers"):
        dl.simulate_requests(scn, "rand", leaf="pod", horizon=1.0, tick=0.5)


# ----------------------------------------------------------------------------------------
# Whole runs: one cell of c = 3 exponential FIFO servers of rate 1 at lambda = 2.4
# ----------------------------------------------------------------------------------------

C, MU, LAM = 3, 1.0, 2.4
TRIALS, HORIZON, WARMUP = 8, 1000.0, 100.0


def _cell(c):
    return {"name": "mmc", "latency": [[0.0]],
            "cells": [{"name": "a", "arrival_rate": LAM, "replicas": c,
                       "service": {"model": "mm1", "capacity": c * MU}}]}  # fmt: skip


def erlang_c_sojourn(c, lam, mu):
    """The mean sojourn of M/M/c FCFS: C(c, a)/(c mu - lam) + 1/mu, a = lam/mu."""
    a = lam / mu
    rho = a / c
    tail = a**c / math.factorial(c) / (1 - rho)
    p_wait = tail / (sum(a**k / math.factorial(k) for k in range(c)) + tail)
    return p_wait / (c * mu - lam) + 1 / mu


def _run(leaf):
    sol = dl.simulate_requests(dl.scenario_from_dict(_cell(C)), "rand", service="servers",
                               leaf=leaf, trials=TRIALS, seed=11, tick=0.1, horizon=HORIZON,
                               warmup=WARMUP, n_save=4)  # fmt: skip
    lat = np.asarray(sol.mean_latency())
    return sol, float(lat.mean()), float(lat.std(ddof=1)) / math.sqrt(TRIALS)


@pytest.fixture(scope="module")
def runs():
    return {d: _run(PowerOfD(d)) for d in (1, C)}


def test_pod_with_d_equal_to_the_servers_is_mmc(runs):
    """Least tokens (d = c) on exponential servers: Erlang C's mean sojourn, 2.079 s; the
    negative control: the random split's 5 s is far outside."""
    _, mean, se = runs[C]
    assert se < 0.2
    assert abs(mean - erlang_c_sojourn(C, LAM, MU)) < 3 * se, (mean, se)
    assert abs(mean - 1 / (MU - LAM / C)) > 3 * se


def test_pod_with_one_draw_is_a_random_split(runs):
    """d = 1: three M/M/1 queues at rate 0.8 each: sojourn Exp(0.2), mean 5 s and p90
    ln 10/0.2 = 11.5 s (within 3 standard errors of the run's own 90% interval plus the
    histogram's 0.9% resolution); the negative control: Erlang C's mean is far outside."""
    sol, mean, se = runs[1]
    assert se < 0.7
    rate = MU - LAM / C
    assert abs(mean - 1 / rate) < 3 * se, (mean, se)
    assert abs(mean - erlang_c_sojourn(C, LAM, MU)) > 3 * se
    s = sol.summary()
    p90, p90_se = math.log(10) / rate, s["latency_ci90"]["p90"] / 1.645
    assert abs(s["latency"]["p90"] - p90) < 3 * p90_se + 0.009 * p90, (s["latency"], p90_se)
