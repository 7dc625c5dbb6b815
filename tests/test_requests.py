"""The request-level twin (`simulate_requests`, theory/requests.md, *Tests*).

Every check compares a statistic over independent trials with a closed form or an
independent model, within 3 standard errors of the trials. Three compiled programs serve
the whole file (module fixtures): a markov batch (one M/M/1-law cell, a 3-cell network
with static routing, an overloaded cell), the fluid-limit batch (scales 1..256), and one
FIFO server.
"""

from __future__ import annotations

import copy
import functools
import math

import equinox as eqx
import helpers
import jax.numpy as jnp
import numpy as np
import pytest
import simpy

import dlbfluid
from dlbfluid import scenario_from_dict, simulate, simulate_requests, stack_scenarios
from dlbfluid._requests import simulate as req_sim
from dlbfluid._requests.histogram import LatencyHistogram
from dlbfluid._results import RESULTS

MU, LAM = 10.0, 5.0  # the single cell: rho = 1/2
RHO = LAM / MU
SLOTS = 64


def one_cell(lam=LAM, mu=MU, **extra) -> dict:
    return {
        "name": "one",
        "cells": [
            {
                "name": "a",
                "arrival_rate": lam,
                "replicas": 1,
                "service": {"model": "mm1", "capacity": mu},
                **extra,
            }
        ],
        "latency": [[0.0]],
    }


SCHEDULE = {"times": [0.0, 0.5], "replicas": [4, 2]}  # (a cell of 4 replicas, 2 from 0.5 s)


def static_three() -> dict:
    """THREE with a fixed routing (flow-grad at step 0 never moves it)."""
    d = helpers.three()
    d["initial"] = {"routing": [[0.5, 0.3, 0.2], [0.2, 0.6, 0.2], [0.3, 0.3, 0.4]]}
    return d


def mean_se(v):
    v = np.asarray(v, dtype=float)
    return float(v.mean()), float(v.std(ddof=1) / math.sqrt(v.size))


def ratio_se(num, den):
    """Pooled ratio sum(num)/sum(den) over trials and its standard error (delta method)."""
    num, den = np.asarray(num, float), np.asarray(den, float)
    r = num.sum() / den.sum()
    R = num.size
    se = math.sqrt(np.sum((num - r * den) ** 2) * R / (R - 1)) / den.sum()
    return float(r), float(se)


def within(value, expected, se, extra=0.0):
    return abs(value - expected) <= 3.0 * se + extra


# ----------------------------------------------------------------------------------------
# The markov batch: [one M/M/1 cell, static 3-cell network, overloaded cell, a cell with a
# buffer of 3, a time-varying arrival profile] x 256 trials
# ----------------------------------------------------------------------------------------

BLOCK_LAM, BLOCK_B = 8.0, 3
PROFILE = {"times": [0.0, 10.0, 20.0], "rates": [2.0, 12.0, 4.0]}
MARKOV = dict(trials=256, horizon=20.0, warmup=5.0, tick=0.25, n_save=4, slots=SLOTS)


def markov_batch(third: dict):
    scns = [
        scenario_from_dict(one_cell()),
        scenario_from_dict(static_three()),
        scenario_from_dict(third, allow_overload=True),
        scenario_from_dict(one_cell(lam=BLOCK_LAM, buffer=BLOCK_B)),
        scenario_from_dict(one_cell(lam=PROFILE, mu=20.0)),
    ]
    return simulate_requests(stack_scenarios(scns), "flow-grad", step_size=0.0, **MARKOV)


@pytest.fixture(scope="module")
def markov():
    return markov_batch(one_cell(lam=20.0))


def test_mm1_law_stationary_distribution(markov):
    """Birth rate lam, death rate mu n/(1+n): detailed balance gives
    pi(n) = (1-rho)^2 (n+1) rho^n, mean 2 rho/(1-rho), and by Little's law a mean sojourn
    2/(mu - lam) (twice the fluid's 1/(mu - lam) at k = 1)."""
    # The counts saved at t = 10, 15, 20 (5 s apart, four relaxation times 1/(sqrt(mu) -
    # sqrt(lam))^2 = 1.2 s): 768 nearly independent draws of the stationary law.
    final = np.asarray(markov.count[0, :, 2:, 0]).reshape(-1)
    for n in range(5):
        p = (1 - RHO) ** 2 * (n + 1) * RHO**n
        est = float(np.mean(final == n))
        assert within(est, p, math.sqrt(p * (1 - p) / final.size)), (n, est, p)
    m, se = mean_se(markov.mean_requests[0, :, 0])
    assert within(m, 2 * RHO / (1 - RHO), se), (m, se)
    lat, se = ratio_se(markov.latency_sum[0], markov.served[0])
    assert within(lat, 2.0 / (MU - LAM), se), (lat, se)
    # The utilisation is E[mu(N)]/mu = rho (flow balance), the error rate 0.
    u, se = mean_se(markov.utilisation[0, :, 0])
    assert within(u, RHO, se), (u, se)
    assert int(np.sum(markov.drops[0])) == 0
    assert np.all(markov.status_names()[:2] == "success")


def test_overflow_is_a_status_and_the_batch_is_unaffected(markov):
    """The overloaded cell (lam = 2 mu) outgrows its 64 slots: its status says so; the
    other scenarios' numbers equal those of a batch whose third scenario is benign."""
    assert np.all(markov.status[2] == RESULTS.solver_failed)
    assert np.all(np.asarray(markov.overflow[2]) & 1)
    benign = markov_batch(one_cell(lam=3.0))
    assert np.all(benign.status == RESULTS.success)
    for f in ("count", "served", "latency_sum", "histogram", "mean_requests", "drops"):
        for b in (0, 1, 3, 4):
            assert np.array_equal(
                np.asarray(getattr(markov, f))[b], np.asarray(getattr(benign, f))[b]
            ), (f, b)
    with pytest.raises(dlbfluid._requests.solution.RequestSimulationError, match="slots") as e:
        markov.raise_for_status()
    # (the twin's own meaning of the code, not the fluid integrator's)
    assert "a fixed-size array overflowed" in str(e.value)
    assert "adaptive solver" not in str(e.value)


def test_finite_buffer_blocking(markov):
    """A buffer of B requests truncates the chain to 0..B: pi_B(n) proportional to
    (n+1) rho^n, and by PASTA a request is rejected with probability pi_B(B)."""
    rho = BLOCK_LAM / MU
    w = np.array([(n + 1) * rho**n for n in range(BLOCK_B + 1)])
    pi = w / w.sum()
    err, se = ratio_se(np.sum(markov.drops[3], -1), np.sum(markov.arrivals[3], -1))
    assert within(err, pi[-1], se), (err, se, pi[-1])
    m, se = mean_se(markov.mean_requests[3, :, 0])
    assert within(m, float(np.sum(np.arange(BLOCK_B + 1) * pi)), se), (m, se)
    assert int(np.max(markov.count[3])) == BLOCK_B
    assert np.all(markov.status_names()[3] == "success")


def test_thinned_arrivals_are_poisson(markov):
    """Arrivals thinned from the profile's maximum rate: the count in the window [5, 20] is
    Poisson with mean int_5^20 lambda = 5 (7 + 12)/2 + 10 (12 + 4)/2 = 127.5."""
    n = np.asarray(markov.arrivals[4, :, 0], float)
    m, se = mean_se(n)
    assert within(m, 127.5, se), (m, se)
    # Poisson dispersion: the variance equals the mean (the sample variance's standard
    # error is about mean sqrt(2/R) for a Poisson count of this size).
    var = float(n.var(ddof=1))
    assert within(var, 127.5, 127.5 * math.sqrt(2.0 / n.size)), var


def test_summary_pools_the_trials(markov):
    s = markov.scenario(3).summary()
    assert s["status"] == "success" and s["trials"] == MARKOV["trials"]
    assert s["served"] == int(np.sum(markov.served[3]))
    assert s["latency"]["mean"] == pytest.approx(
        float(np.sum(markov.latency_sum[3]) / np.sum(markov.served[3]))
    )
    assert s["error_rate"] == pytest.approx(
        float(np.sum(markov.drops[3]) / np.sum(markov.arrivals[3]))
    )
    assert s["latency"]["p50"] < s["latency"]["p90"] < s["latency"]["p99"]
    assert len(s["cells"]) == 1 and 0 < s["cells"][0]["utilisation"] < 1
    assert s["latency_ci90"]["mean"] > 0


# ----------------------------------------------------------------------------------------
# The static network against an independent event-driven model (simpy)
# ----------------------------------------------------------------------------------------


def simpy_network(scn, x, *, horizon, warmup, seed, rate_table):
    """THREE as an event-driven simpy model: Poisson roots, routing by `x`, a delay tau_ij
    each way, processor-sharing cells completing at mu_j(N) (`rate_table[j][N]`). Returns
    the end-to-end latencies of the requests completed in [warmup, horizon]."""
    rng = np.random.default_rng(seed)
    env = simpy.Environment()
    n = scn.n_cells
    lam = np.asarray(scn.arrival_rates)[:, 0]
    tau = np.asarray(scn.latency)
    present = [[] for _ in range(n)]
    wake = [env.event() for _ in range(n)]
    out = []

    def cell(j):
        while True:
            rate = rate_table[j][len(present[j])]
            waits = [wake[j]]
            if rate > 0:
                waits.append(env.timeout(rng.exponential(1.0 / rate)))
            yield simpy.AnyOf(env, waits)
            if wake[j].triggered:
                wake[j] = env.event()
                continue
            origin = present[j].pop(rng.integers(len(present[j])))
            if env.now >= warmup:
                out.append(env.now - origin)

    def travel(i, j, born):
        yield env.timeout(tau[i, j])
        present[j].append(born - tau[i, j])
        if not wake[j].triggered:
            wake[j].succeed()

    def source(i):
        while True:
            yield env.timeout(rng.exponential(1.0 / lam[i]))
            j = rng.choice(n, p=x[i])
            env.process(travel(i, j, env.now))

    for j in range(n):
        env.process(cell(j))
    for i in range(n):
        env.process(source(i))
    env.run(until=horizon)
    return np.asarray(out)


def test_static_network_matches_simpy(markov):
    scn = scenario_from_dict(static_three())
    x = np.asarray(scn.initial_routing)
    N = jnp.arange(SLOTS + 1, dtype=jnp.float64)[:, None] * jnp.ones((1, scn.n_cells))
    table = np.asarray(scn.service.rate(N)).T
    runs = [
        simpy_network(
            scn, x, horizon=MARKOV["horizon"], warmup=MARKOV["warmup"], seed=s, rate_table=table
        )
        for s in range(96)
    ]
    ref_mean = mean_se([r.mean() for r in runs])
    # Per-run p90 by the same estimator on both sides (the histogram's): with ~70 requests
    # a run, estimators of a quantile differ by O(1/n) in probability (np.quantile's
    # interpolation between order statistics sits 0.1 s lower here).
    hist = markov.histogram_bins
    bins = np.split(
        np.asarray(hist.index(jnp.asarray(np.concatenate(runs)))),
        np.cumsum([r.size for r in runs])[:-1],
    )  # one call: one compiled shape
    counts = np.stack([np.bincount(b, minlength=hist.bins + 2) for b in bins])
    ref_p90 = mean_se(hist.percentile(jnp.asarray(counts), 0.9))
    ours_mean = mean_se(markov.mean_latency()[1])
    ours_p90 = mean_se(markov.percentile(0.9)[1])
    for ours, ref in ((ours_mean, ref_mean), (ours_p90, ref_p90)):
        assert within(ours[0], ref[0], math.hypot(ours[1], ref[1])), (ours, ref)
    assert np.array_equal(np.asarray(markov.final_x[1, 0]), x)  # static routing held


# ----------------------------------------------------------------------------------------
# FIFO servers: one exponential server is the M/M/1 queue, sojourn Exp(mu - lam)
# ----------------------------------------------------------------------------------------


def cdf_at(hist: LatencyHistogram, counts, q):
    """Per-trial fraction of latencies <= q read from the histogram (log-uniform inside
    q's bin)."""
    counts = np.asarray(counts, float)
    b = int(np.asarray(hist.index(jnp.asarray(q))))
    lo = hist.low * math.exp((b - 1) * hist.log_ratio)
    frac = math.log(q / lo) / hist.log_ratio
    below = counts[..., :b].sum(-1) + frac * counts[..., b]
    return below / counts.sum(-1)


def test_fifo_server_sojourn_is_exponential():
    sol = simulate_requests(
        scenario_from_dict(one_cell()),
        "rand",
        service="servers",
        trials=256,
        horizon=20.0,
        warmup=5.0,
        tick=0.25,
        n_save=4,
    )
    theta = MU - LAM
    lat, se = ratio_se(sol.latency_sum, sol.served)
    assert within(lat, 1.0 / theta, se), (lat, se)
    res = sol.histogram_bins.resolution
    pooled = np.asarray(sol.histogram).sum(0)
    for p, q in ((0.5, math.log(2) / theta), (0.9, math.log(10) / theta)):
        F, seF = mean_se(cdf_at(sol.histogram_bins, sol.histogram, q))
        assert within(F, p, seF), (p, F, seF)
        # The pooled percentile, its error by the delta method: se(F)/f(q), f = theta(1-p).
        est = float(sol.histogram_bins.percentile(jnp.asarray(pooled), p))
        assert within(est, q, seF / (theta * (1 - p)), res * q), (p, est, q)
    m, se = mean_se(sol.mean_requests[:, 0])
    assert within(m, RHO / (1 - RHO), se), (m, se)  # M/M/1 mean count
    assert np.all(sol.status_names() == "success")


# ----------------------------------------------------------------------------------------
# The fluid limit: N^k/k -> N at rate k^(-1/2)
# ----------------------------------------------------------------------------------------

SCALES = (1, 4, 16, 64, 256)


@pytest.fixture(scope="module")
def fluid_limit():
    d = helpers.three()
    d["initial"] = {"workload": [4.0, 0.0, 1.0]}
    scn = scenario_from_dict(d)
    opts = dict(tick=0.02, horizon=3.0, n_save=30)
    batch = stack_scenarios([scn] * len(SCALES))
    sol = simulate_requests(
        batch, "flow-grad", scale=np.asarray(SCALES), trials=12, slots=2048, **opts
    )
    fluid = simulate(scn, "flow-grad", **opts)
    return sol, fluid


def test_fluid_limit_rate(fluid_limit):
    sol, fluid = fluid_limit
    assert np.all(sol.status_names() == "success")
    err = np.max(np.abs(np.asarray(sol.density()) - np.asarray(fluid.N)[None, None]), (-2, -1))
    sup = err.mean(1)  # E sup_t |N^k/k - N| per scale
    slope = np.polyfit(np.log(SCALES[1:]), np.log(sup[1:]), 1)[0]
    assert -0.6 <= slope <= -0.4, (sup, slope)
    assert sup[-1] < 0.1 * sup[0]


# ----------------------------------------------------------------------------------------
# Percentile resolution and bad inputs
# ----------------------------------------------------------------------------------------


def test_histogram_percentiles_within_resolution():
    hist = LatencyHistogram()
    rng = np.random.default_rng(3)
    x = rng.lognormal(-1.0, 1.5, 200_000)
    counts = np.bincount(np.asarray(hist.index(jnp.asarray(x))), minlength=hist.bins + 2)
    for q in (0.5, 0.9, 0.99):
        est = float(hist.percentile(jnp.asarray(counts), q))
        assert abs(est / np.quantile(x, q) - 1) <= hist.resolution, q
    assert 0.0089 < hist.resolution < 0.0091
    assert np.isnan(float(hist.percentile(jnp.zeros(hist.bins + 2, jnp.int32), 0.5)))


@pytest.mark.parametrize("policy", ["disc-lat", "mnlb", "flow-rif", "error-averse"])
def test_policies_trace(policy, monkeypatch):
    """Every kind of policy object goes through the loop (traced, not compiled: the run
    is replaced by zeros of its output shapes): a tie rule held as a string
    (`DiscreteRouting`), a precomputed schedule (MNLB), a wrapper with state
    (`ErrorAverse`)."""
    def shapes_only(*args):
        out = eqx.filter_eval_shape(req_sim._run_program, *args)
        return {k: jnp.zeros(v.shape, v.dtype) for k, v in out.items()}

    monkeypatch.setattr(req_sim, "_run", shapes_only)
    pol = (
        dlbfluid.ErrorAverse(dlbfluid.policy_from_name("flow-lat"))
        if policy == "error-averse"
        else policy
    )
    d = helpers.three()
    for c in d["cells"]:
        c["buffer"] = 3.0
    sol = simulate_requests(scenario_from_dict(d), pol, trials=2, horizon=0.2, n_save=2)
    assert sol.count.shape == (2, 3, 3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(service="prefill"), "service = 'prefill'"),
        (dict(scale=0), "scale"),
        (dict(scale=1.5), "scale"),
        (dict(trials=0), "trials = 0"),
        (dict(tick=-1.0), "tick = -1.0"),
        (dict(horizon=1.003), "horizon = 1.003"),
        (dict(warmup=1.0, horizon=1.0), "warmup = 1.0"),
        (dict(n_save=0), "n_save = 0"),
        (dict(slots=0), "slots = 0"),
        (dict(dtype=jnp.int32), "dtype"),
        (dict(policy="nope"), "policy = 'nope'"),
        (dict(step_size=-1.0), "step_size"),
    ],
)
def test_bad_inputs_are_named(kwargs, match):
    kwargs = dict(kwargs)
    policy = kwargs.pop("policy", "rand")
    kwargs.setdefault("horizon", 1.0)
    with pytest.raises(ValueError, match=match):
        simulate_requests(scenario_from_dict(one_cell()), policy, **kwargs)


def test_servers_needs_mm1_cells():
    with pytest.raises(ValueError, match=r"needs a 'servers' object on cells\[0\]"):
        simulate_requests(scenario_from_dict(helpers.three()), "rand", service="servers")
    d = copy.deepcopy(one_cell())
    d["cells"][0]["replica_schedule"] = {"times": [0.0, 0.5], "replicas": [1, 1.5]}
    with pytest.raises(ValueError, match="integer replica counts"):
        simulate_requests(scenario_from_dict(d), "rand", service="servers", horizon=1.0)


# ----------------------------------------------------------------------------------------
# Progress on long runs
# ----------------------------------------------------------------------------------------


def test_progress_lines_and_bitwise_equal_results(monkeypatch, capsys):
    """`progress=True` writes a line per save interval once the interval between lines is
    0 (a run long enough for the 10 s default), each with the segments done, the requests
    arrived so far and the events; the results are bitwise those without progress. Control:
    without it, nothing on stderr."""
    monkeypatch.setattr(req_sim, "Progress", functools.partial(req_sim.Progress, interval=0.0))
    kw = helpers.REQUESTS_SHORT  # (without progress: the program of the outage tests' short run)
    scn = scenario_from_dict(one_cell(replicas=4, replica_schedule=SCHEDULE, buffer=8.0))
    plain = simulate_requests(scn, "rand", **kw)
    assert capsys.readouterr().err == ""
    shown = simulate_requests(scn, "rand", progress=True, **kw)
    lines = capsys.readouterr().err.strip().splitlines()
    assert [ln.split(":")[1].split()[0] for ln in lines] == ["1/4", "2/4", "3/4", "4/4"], lines
    arrived = int(np.sum(plain.arrivals))
    assert arrived > 0 and f"{arrived:,} requests" in lines[-1], (arrived, lines[-1])
    assert f"{int(np.sum(plain.events)):,} events" in lines[-1]
    fields = ("count", "served", "latency_sum", "latency_sq", "histogram", "arrivals", "drops",
              "mean_requests", "utilisation", "final_x", "status", "events")  # fmt: skip
    for f in fields:
        assert np.array_equal(np.asarray(getattr(plain, f)), np.asarray(getattr(shown, f))), f
