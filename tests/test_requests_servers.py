"""The App.-B prefill/decode server cells of the request-level twin (theory/requests.md,
*App.-B cell*): closed forms within three standard errors of the trials, the insensitivity
of an infinite-server decode stage with its FIFO negative control, the scenario fields'
validation, and an overflow that stays a status."""

import copy
import math

import ciw
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize

import dlbfluid as dl
from dlbfluid import scenario_from_dict, simulate_requests
from dlbfluid._evaluation.generator import generate, scenario_dicts

LAM = 5.0


def law(shift, shape, scale):
    return {"shift": shift, "shape": shape, "scale": scale}


def mean_tokens(t):
    return t["shift"] + t["shape"] * t["scale"]


def cell(tp, td, prompt, output, *, slots=1, lam=LAM, buffer=None):
    """One cell of one App.-B server (one decode engine of `slots` slots), no delay; the
    fluid service is the M/M/1 law at the server's bottleneck capacity (Assumption 2)."""
    cap = min(1.0 / (tp * mean_tokens(prompt)), slots / (td * mean_tokens(output)))
    c = {
        "name": "a",
        "arrival_rate": lam,
        "replicas": 1,
        "service": {"model": "mm1", "capacity": cap},
        "servers": {
            "count": 1,
            "prefill_token_time": tp,
            "decode_token_time": td,
            "decode_engines": 1,
            "slots": slots,
        },
    }
    if buffer is not None:
        c["buffer"] = buffer
    return {
        "name": "appb",
        "cells": [c],
        "latency": [[0.0]],
        "workload": {"prompt_tokens": prompt, "output_tokens": output},
    }


def mixed():
    """The Jackson cell beside an M/M/1 cell without a `servers` object (capacity 10, its
    own arrivals at rate 5, no arc between them): the latter is one exponential FIFO
    server."""
    d = cell(**JACKSON)
    d["cells"].append(
        {
            "name": "b",
            "arrival_rate": LAM,
            "replicas": 1,
            "service": {"model": "mm1", "capacity": 10.0},
        }
    )
    d["latency"] = [[0.0, None], [None, 0.0]]
    return d


# (b) M/G/1 prefill (Gamma prompt tokens) + a decode stage of 16 slots (never full: about
# 0.5 requests in decode on average, Poisson, P(N > 16) < 1e-20).
MG1 = dict(tp=0.01, td=0.02, prompt=law(2.0, 0.5, 20.0), output=law(1.0, 1.0, 4.0), slots=16)
# (b) Jackson tandem: exponential prompt and output tokens, one slot.
JACKSON = dict(tp=0.01, td=0.02, prompt=law(0.0, 1.0, 10.0), output=law(0.0, 1.0, 5.0))
# (a) Insensitivity: a short deterministic prefill, then 0.3 s of decode on average under
# three output-token laws (deterministic, exponential, Gamma of SCV 4) with 16 slots
# (an infinite-server stage: 1.5 requests in decode on average, Poisson, P(N > 16) < 1e-11),
# and the first two again with 2 slots (FIFO: sensitive).
PREFILL_D = dict(tp=0.02, prompt=law(1.0, 1.0, 0.0), td=0.03)
OUTPUTS = {"det": law(10.0, 1.0, 0.0), "exp": law(0.0, 1.0, 10.0), "gam": law(0.0, 0.25, 40.0)}
CASES = {
    "mg1": cell(**MG1),
    "jackson": cell(**JACKSON),
    **{f"inf-{k}": cell(**PREFILL_D, output=o, slots=16) for k, o in OUTPUTS.items()},
    **{f"fifo-{k}": cell(**PREFILL_D, output=OUTPUTS[k], slots=2) for k in ("det", "exp")},
    # (c) Constant token counts on one server: an M/D/1 prefill (S = 0.12 s, rho = 0.6)
    # and a constant 0.1 s decode on 16 slots, which almost never fill (about 0.5 requests
    # in decode, Poisson: P(N > 16) < 1e-25), so the decode adds its time and no wait.
    "md1": cell(0.01, 0.02, law(12.0, 1.0, 0.0), law(5.0, 1.0, 0.0), slots=16),
    # (d) Three exponential FIFO servers of rate 25/12 under the leaf's rule (join the
    # server with the fewest requests present, the lowest index on ties), rho = 0.8:
    # against ciw (test_jsq_servers_match_ciw).
    "jsq3": {
        "name": "jsq3",
        "cells": [
            {"name": "c", "arrival_rate": LAM, "replicas": 3,
             "service": {"model": "mm1", "capacity": 6.25}},
        ],
        "latency": [[0.0]],
    },  # fmt: skip
    # A buffer of one request, exponential prefill, a negligible decode: M/M/1/1.
    "loss": cell(0.01, 1e-9, law(0.0, 1.0, 10.0), law(1.0, 1.0, 0.0), buffer=1.0),
    "mixed": mixed(),
    # One M/M/1 cell without a `servers` object: one exponential FIFO server, mu = 10.
    "mm1": {
        "name": "mm1",
        "cells": [
            {
                "name": "b",
                "arrival_rate": LAM,
                "replicas": 1,
                "service": {"model": "mm1", "capacity": 10.0},
            }
        ],
        "latency": [[0.0]],
    },
}
TRIALS = 64
# The overflow check's scenario, last in the fixture's batch (so that its run is the
# fixture's compiled program): the Jackson cell at 30 requests/s, three times the capacity
# of 10, outgrows its 64-request queue within seconds. Each scenario's trials draw their
# own keys (the batch's first ten are those of the ten cases alone, bitwise), and
# `EVENTS` is the default of the ten cases (the overloaded one alone would raise it to 256:
# another program).
OVER = cell(**JACKSON, lam=30.0)
EVENTS = 128
RUN = dict(service="servers", trials=TRIALS, horizon=40.0, warmup=4.0, tick=1.0, n_save=4,
           events=EVENTS,
           # Each server's queue: 64 requests (load <= 0.75: P(N >= 64) ~ 0.75^64 ~ 1e-8; a
           # full queue would be a status, test_all_trials_succeed) instead of the default
           # 256.
           slots=64)  # fmt: skip


def batch(last: dict):
    """The cases then `last` (the overloaded cell, or a benign one in its place)."""
    scns = [scenario_from_dict(d) for d in CASES.values()]
    return dl.stack_scenarios([*scns, scenario_from_dict(last, allow_overload=True)])


def pk_sojourn(lam, tp, prompt):
    """Pollaczek-Khinchine: mean sojourn of the M/G/1 prefill, $S = t_p(\\delta + G)$:
    $E[S] + \\lambda E[S^2]/(2(1-\\rho))$, $E[S^2] = t_p^2((\\delta+\\alpha\\theta)^2
    + \\alpha\\theta^2)$."""
    m = tp * mean_tokens(prompt)
    m2 = tp**2 * (mean_tokens(prompt) ** 2 + prompt["shape"] * prompt["scale"] ** 2)
    return m + lam * m2 / (2.0 * (1.0 - lam * m))


def cdf_at(hist, counts, q):
    """Per-trial fraction of latencies <= q read from the histogram (log-uniform inside
    q's bin; as in tests/test_requests.py)."""
    counts = np.asarray(counts, float)
    b = int(np.asarray(hist.index(jnp.asarray(q))))
    lo = hist.low * math.exp((b - 1) * hist.log_ratio)
    frac = math.log(q / lo) / hist.log_ratio
    below = counts[..., :b].sum(-1) + frac * counts[..., b]
    return below / counts.sum(-1)


def mean_se(x):
    x = np.asarray(x, float)
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(x.size))


def within(value, target, se):
    return abs(value - target) <= 3.0 * se


@pytest.fixture(scope="module")
def sol():
    return simulate_requests(batch(OVER), "rand", **RUN)


def case(sol, name):
    return sol.scenario(list(CASES).index(name))


def test_all_trials_succeed(sol):
    cases = slice(0, len(CASES))  # (the last scenario overflows: test_overflow_...)
    assert np.all(sol.status_names()[cases] == "success"), sol.overflow[cases]
    assert int(np.min(sol.served[cases])) > 50


def test_mg1_prefill_pollaczek_khinchine(sol):
    s = case(sol, "mg1")
    expect = pk_sojourn(LAM, MG1["tp"], MG1["prompt"]) + MG1["td"] * mean_tokens(MG1["output"])
    m, se = mean_se(s.mean_latency())
    assert within(m, expect, se), (m, se, expect)  # 0.34125 s
    # Utilisation: the prefill engine (the bottleneck stage) is busy a fraction rho.
    u, se_u = mean_se(s.utilisation[:, 0])
    assert within(u, LAM * MG1["tp"] * mean_tokens(MG1["prompt"]), se_u), (u, se_u)
    # Little's law on the time-average count.
    n, se_n = mean_se(s.mean_requests[:, 0])
    assert within(n, LAM * expect, se_n), (n, se_n, LAM * expect)


def test_wrong_token_time_fails_the_closed_form(sol):
    """Negative control: the Pollaczek-Khinchine mean at a prefill token time 15% off, or
    with the prompt tokens' variance left out (M/D/1 at the same mean), is rejected."""
    s = case(sol, "mg1")
    m, se = mean_se(s.mean_latency())
    decode = MG1["td"] * mean_tokens(MG1["output"])
    wrong_tp = pk_sojourn(LAM, 1.15 * MG1["tp"], MG1["prompt"]) + decode
    no_var = pk_sojourn(LAM, MG1["tp"], law(mean_tokens(MG1["prompt"]), 1.0, 0.0)) + decode
    assert not within(m, wrong_tp, se), (m, se, wrong_tp)
    assert not within(m, no_var, se), (m, se, no_var)


def test_jackson_tandem(sol):
    """Exponential prefill then one exponential decode slot, Poisson arrivals: two M/M/1
    queues in tandem (Burke), sojourn Exp(mu_p - lam) + Exp(mu_d - lam)."""
    s = case(sol, "jackson")
    mu_p = 1.0 / (JACKSON["tp"] * mean_tokens(JACKSON["prompt"]))
    mu_d = 1.0 / (JACKSON["td"] * mean_tokens(JACKSON["output"]))
    assert mu_p == mu_d == 10.0
    theta = mu_p - LAM
    m, se = mean_se(s.mean_latency())
    assert within(m, 2.0 / theta, se), (m, se)  # 0.4 s
    # Erlang(2, theta): P(T > t) = exp(-theta t)(1 + theta t); its 0.9-quantile 0.778 s.
    q90 = scipy.optimize.brentq(lambda t: math.exp(-theta * t) * (1 + theta * t) - 0.1, 0, 5)
    F, seF = mean_se(cdf_at(s.histogram_bins, s.histogram, q90))
    assert within(F, 0.9, seF), (F, seF)
    # The pooled p90, its error by the delta method: se(F)/f(q), f = theta^2 q e^{-theta q}.
    pooled = np.asarray(s.histogram).sum(0)
    est = float(s.histogram_bins.percentile(jnp.asarray(pooled), 0.9))
    f = theta**2 * q90 * math.exp(-theta * q90)
    assert abs(est - q90) <= 3.0 * seF / f + s.histogram_bins.resolution * q90, (est, q90)
    # Negative control: the p90 of one M/M/1 stage (ln 10/theta = 0.46 s) is rejected.
    assert abs(est - math.log(10) / theta) > 3.0 * seF / f + s.histogram_bins.resolution * q90


def test_infinite_server_decode_is_insensitive(sol):
    """(a) With more decode slots than requests, the decode stage is an infinite-server
    station: its sojourn is the request's own decode time, so the mean end-to-end latency
    depends on the output tokens' law only through its mean (here 0.3 s for the
    deterministic, exponential and SCV-4 Gamma laws); the deterministic prefill is an
    M/D/1 queue (Pollaczek-Khinchine)."""
    decode = PREFILL_D["td"] * 10.0
    expect = pk_sojourn(LAM, PREFILL_D["tp"], PREFILL_D["prompt"]) + decode
    means = {}
    for k in OUTPUTS:
        s = case(sol, f"inf-{k}")
        means[k] = m, se = mean_se(s.mean_latency())
        assert within(m, expect, se), (k, m, se, expect)  # 0.3211 s
        n, se_n = mean_se(s.mean_requests[:, 0])
        assert within(n, LAM * expect, se_n), (k, n, se_n)


def test_fifo_decode_is_sensitive(sol):
    """Negative control of the insensitivity: with two slots the decode stage queues
    (FIFO, load 0.75) and the exponential output law waits longer than the deterministic
    one, by many standard errors."""
    det = mean_se(case(sol, "fifo-det").mean_latency())
    exp = mean_se(case(sol, "fifo-exp").mean_latency())
    assert exp[0] - det[0] > 3 * math.hypot(det[1], exp[1]), (det, exp)
    # both are above the infinite-server value: the queueing is real
    inf = mean_se(case(sol, "inf-det").mean_latency())
    assert det[0] - inf[0] > 3 * math.hypot(det[1], inf[1]), (det, inf)


def test_mm1_cell_without_servers_is_an_exponential_fifo_server(sol):
    """In a scenario with App.-B cells, an M/M/1 cell without a `servers` object is one
    exponential FIFO server: M/M/1, mean count rho/(1-rho) = 1 and busy fraction 0.5, while
    the App.-B cell beside it holds 2 (two M/M/1 stages); the pooled mean latency is
    (0.4 + 0.2)/2."""
    s = case(sol, "mixed")
    n_a, se_a = mean_se(s.mean_requests[:, 0])
    n_b, se_b = mean_se(s.mean_requests[:, 1])
    u_b, se_u = mean_se(s.utilisation[:, 1])
    assert within(n_a, 2.0, se_a) and within(n_b, 1.0, se_b), (n_a, se_a, n_b, se_b)
    assert within(u_b, 0.5, se_u), (u_b, se_u)
    assert not within(n_b, 2.0, se_b)  # not a second stage
    m, se = mean_se(s.mean_latency())
    assert within(m, 0.3, se), (m, se)


def test_full_buffer_rejects_and_counts_errors(sol):
    """A buffer of one request at the cell: a request that finds one present is rejected
    and counted as an error. With exponential prefill and a negligible decode this is
    M/M/1/1, blocking probability rho/(1+rho) (Erlang's loss formula; PASTA)."""
    s = case(sol, "loss")
    rho = LAM * 0.1
    e, se = mean_se(s.error_rate())
    assert within(e, rho / (1 + rho), se), (e, se)  # 1/3
    assert not within(e, rho, se)  # the M/M/1 P(busy), without the blocking


def test_mm1_fifo_p90(sol):
    """One exponential FIFO server (mu = 10, lambda = 5): sojourn Exp(5), p90 = ln 10/5
    = 0.4605 s. Tolerance: the pooled p90 of the 64 trials (about 11,500 requests) within
    three delta-method standard errors, 3 se(F)/f(p90) with se(F) from the trials' CDFs at
    p90 (about 0.04 s, 9%), plus the histogram's resolution (0.9%); at 10^6 requests
    (benchmarks/mm1_p90.py, results/requests_mm1_p90_cpu.json) the p90 is within 2%. The
    negative control: the service time's own p90, ln 10/mu = 0.23 s (what a server without
    a queue would give), is rejected."""
    s = case(sol, "mm1")
    theta, q = 10.0 - LAM, math.log(10.0) / (10.0 - LAM)
    F, seF = mean_se(cdf_at(s.histogram_bins, s.histogram, q))
    assert within(F, 0.9, seF), (F, seF)
    est = float(s.histogram_bins.percentile(jnp.asarray(np.asarray(s.histogram).sum(0)), 0.9))
    tol = 3.0 * seF / (theta * 0.1) + s.histogram_bins.resolution * q
    assert abs(est - q) <= tol, (est, q, tol)
    assert abs(est - math.log(10.0) / 10.0) > tol, (est, tol)  # the negative control


# ----------------------------------------------------------------------------------------
# M/D/1: constant token counts (tests/test_requests_servers.py, case "md1")
# ----------------------------------------------------------------------------------------


def test_md1_prefill_pollaczek_khinchine(sol):
    """Prefill S = 12 tokens x 10 ms = 0.12 s on one server at 5 requests/s (rho = 0.6):
    M/D/1, mean wait lambda S^2 / (2 (1 - rho)) = 0.09 s; the decode (5 tokens x 20 ms on
    16 slots that almost never fill) adds 0.1 s: mean 0.31 s. The negative control, the
    M/M/1 sojourn at the same mean service S/(1 - rho) + 0.1 = 0.4 s, is rejected."""
    s = case(sol, "md1")
    S, d = 0.12, 0.1
    rho = LAM * S
    expect = S + LAM * S * S / (2.0 * (1.0 - rho)) + d
    m, se = mean_se(s.mean_latency())
    assert within(m, expect, se), (m, se, expect)
    assert not within(m, S / (1.0 - rho) + d, se)
    u, se_u = mean_se(s.utilisation[:, 0])
    assert within(u, rho, se_u), (u, se_u)


# ----------------------------------------------------------------------------------------
# Three exponential FIFO servers under the leaf's rule, against ciw (case "jsq3")
# ----------------------------------------------------------------------------------------


class _FewestPresent(ciw.routing.JoinShortestQueue):
    """ciw's JoinShortestQueue counts the requests waiting; the leaf counts every request
    present, in service included."""

    def get_queue_size(self, node_index):
        return self.simulation.nodes[node_index].number_of_individuals


def _ciw_sojourns(rate, mu, servers, horizon, warmup, seed):
    """Arrivals at a dispatcher (no service) routed to `servers` one-server FIFO nodes by
    the leaf's rule, lowest index on ties. Returns (arrival dates, sojourns)."""
    dests = list(range(2, servers + 2))
    network = ciw.create_network(
        arrival_distributions=[ciw.dists.Exponential(rate)] + [None] * servers,
        service_distributions=[ciw.dists.Deterministic(0.0)]
        + [ciw.dists.Exponential(mu)] * servers,
        number_of_servers=[float("inf")] + [1] * servers,
        routing=ciw.routing.NetworkRouting(
            routers=[_FewestPresent(dests, tie_break="order")]
            + [ciw.routing.Leave()] * servers
        ),
    )
    ciw.seed(seed)
    sim = ciw.Simulation(network)
    sim.simulate_until_max_time(horizon)
    recs = [r for r in sim.get_all_records() if r.node >= 2 and r.arrival_date > warmup]
    arr = np.array([r.arrival_date for r in recs])
    soj = np.array([r.exit_date - r.arrival_date for r in recs])
    return arr, soj


def test_jsq_servers_match_ciw(sol):
    """Mean and p90 sojourn of three exponential FIFO servers (rate 25/12 each, 5
    requests/s, rho = 0.8) under the leaf's rule: the twin's 64 trials against one long
    ciw run (5,000 s, standard errors from 20 batches), within three combined standard
    errors; for the p90, the twin's per-trial fraction of latencies below ciw's p90 is
    0.9 within three combined standard errors of the two fractions. The negative control:
    routing at random (three independent M/M/1 queues at 5/3 requests/s, mean
    1/(25/12 - 5/3) = 2.4 s) is rejected."""
    s = case(sol, "jsq3")
    mu = 6.25 / 3
    arr, soj = _ciw_sojourns(LAM, mu, 3, 5000.0, 50.0, seed=3)
    groups = np.array_split(np.argsort(arr), 20)
    c_means = np.array([soj[g].mean() for g in groups])
    c_mean, c_se = c_means.mean(), c_means.std(ddof=1) / math.sqrt(len(groups))
    q90 = float(np.quantile(soj, 0.9))
    c_F = np.array([np.mean(soj[g] <= q90) for g in groups])
    c_Fse = c_F.std(ddof=1) / math.sqrt(len(groups))

    m, se = mean_se(s.mean_latency())
    assert abs(m - c_mean) <= 3.0 * math.hypot(se, c_se), (m, se, c_mean, c_se)
    assert abs(m - 1.0 / (mu - LAM / 3)) > 3.0 * math.hypot(se, c_se)
    F, seF = mean_se(cdf_at(s.histogram_bins, s.histogram, q90))
    tol = 3.0 * math.hypot(seF, c_Fse) + s.histogram_bins.resolution
    assert abs(F - 0.9) <= tol, (F, seF, c_Fse, q90)


# ----------------------------------------------------------------------------------------
# Overflow: a status, and the rest of the batch unaffected
# ----------------------------------------------------------------------------------------


def test_overflow_is_a_status_and_the_batch_is_unaffected(sol):
    """The overloaded cell (the fixture's last scenario) outgrows its queue: its status
    says so, and every other scenario's numbers equal those of the same batch with a benign
    Jackson cell in its place (the same compiled program)."""
    benign = simulate_requests(batch(cell(**JACKSON)), "rand", **RUN)
    names = sol.status_names()
    assert np.all(names[-1] == "solver_failed") and np.all(np.asarray(sol.overflow[-1]) & 1)
    assert np.all(names[:-1] == "success") and np.all(benign.status_names() == "success")
    for field in ("served", "latency_sum", "histogram", "count", "mean_requests", "events"):
        a, b = np.asarray(getattr(sol, field)), np.asarray(getattr(benign, field))
        assert np.array_equal(a[:-1], b[:-1]), field
        assert not np.array_equal(a[-1], b[-1]), field  # (the comparison can fail)
    with pytest.raises(RuntimeError, match="slots"):
        sol.raise_for_status()


# ----------------------------------------------------------------------------------------
# Scenario fields
# ----------------------------------------------------------------------------------------


def _mutated(mutate):
    d = copy.deepcopy(cell(**JACKSON))
    mutate(d)
    return d


def _srv(d):
    return d["cells"][0]["servers"]


BAD = [
    (lambda d: d["cells"][0].__setitem__("servers", 3), ["cells[0].servers", "3", "object"]),
    (lambda d: _srv(d).__setitem__("engines", 2), ["cells[0].servers", "engines", "allowed"]),
    (
        lambda d: _srv(d).__setitem__("prefill_token_time", 0.0),
        ["cells[0].servers.prefill_token_time", "0.0", "> 0"],
    ),
    (
        lambda d: _srv(d).__setitem__("decode_token_time", -1e-3),
        ["cells[0].servers.decode_token_time", "-0.001", "> 0"],
    ),
    (
        lambda d: _srv(d).pop("decode_token_time"),
        ["cells[0].servers.decode_token_time", "required"],
    ),
    (lambda d: _srv(d).__setitem__("count", 0), ["cells[0].servers.count", "0", "integer in [1"]),
    (
        lambda d: _srv(d).__setitem__("decode_engines", 1.5),
        ["cells[0].servers.decode_engines", "1.5", "integer"],
    ),
    (lambda d: _srv(d).__setitem__("slots", True), ["cells[0].servers.slots", "True", "integer"]),
    (lambda d: _srv(d).update(decode_engines=64, slots=64), ["cells[0].servers", "4096", "1024"]),
    (lambda d: d.pop("workload"), ["workload", "required", "servers"]),
    (lambda d: d.__setitem__("workload", []), ["workload", "prompt_tokens", "output_tokens"]),
    (
        lambda d: d["workload"]["prompt_tokens"].__setitem__("shape", 0.0),
        ["workload.prompt_tokens.shape", "0.0", "> 0"],
    ),
    (
        lambda d: d["workload"]["output_tokens"].__setitem__("scale", -1.0),
        ["workload.output_tokens.scale", "-1.0", ">= 0"],
    ),
    (
        lambda d: d["workload"]["output_tokens"].__setitem__("mean", 3.0),
        ["workload.output_tokens", "shift, shape, scale"],
    ),
    (
        lambda d: d["workload"].__setitem__("prompt_tokens", law(0.0, 1.0, 0.0)),
        ["workload.prompt_tokens", "positive mean"],
    ),
    (
        lambda d: d["workload"]["prompt_tokens"].__setitem__("shift", float("nan")),
        ["workload.prompt_tokens.shift", "finite"],
    ),
]


@pytest.mark.parametrize("mutate,needles", BAD)
def test_bad_servers_and_workload_fields_are_named(mutate, needles):
    with pytest.raises(dl.ScenarioError) as e:
        scenario_from_dict(_mutated(mutate))
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_fields_round_trip_and_defaults():
    d = _mutated(lambda d: [_srv(d).pop(k) for k in ("count", "decode_engines", "slots")])
    d["cells"][0]["replicas"] = 3
    s = scenario_from_dict(d)
    assert int(s.servers.count[0]) == 3  # count defaults to the replicas
    assert (int(s.servers.decode_engines[0]), int(s.servers.slots[0])) == (2, 4)  # App. B
    back = dl.scenario_to_dict(s)
    assert back["cells"][0]["servers"]["count"] == 3 and back["workload"] == d["workload"]
    again = scenario_from_dict(back)
    assert float(again.servers.prefill_token_time[0]) == JACKSON["tp"]
    # A scenario without servers keeps none (existing files parse unchanged), and stacks
    # with one that has them: its cells are marked without.
    plain = dl.default_scenario()
    assert plain.servers is None and plain.workload is None
    batch = dl.stack_scenarios([s, plain])
    assert batch.servers.mask.tolist() == [[True, False, False, False], [False] * 4]


def test_servers_mode_needs_a_servers_object_or_mm1():
    d = _mutated(lambda d: d["cells"][0].pop("servers"))
    d["cells"][0]["service"] = {
        "model": "softplus",
        "base_latency": 0.2,
        "capacity": 10.0,
        "knee": 1.0,
        "width": 1.0,
    }
    d["cells"][0]["name"] = "slowcell"
    with pytest.raises(ValueError, match=r"cells\[0\] \('slowcell'\).*servers"):
        simulate_requests(scenario_from_dict(d), "rand", service="servers", horizon=1.0)


def test_generator_writes_servers_and_workload():
    gen = generate(0, 2, max_cells=4)
    for b, d in enumerate(scenario_dicts(gen, horizon=60.0, fluctuation=0.0)):
        s = scenario_from_dict(d)
        n = int(gen.n_cells[b])
        np.testing.assert_array_equal(s.servers.count, gen.replicas[b, :n])
        np.testing.assert_array_equal(s.servers.prefill_token_time, gen.prefill_token_time[b, :n])
        np.testing.assert_array_equal(s.servers.decode_token_time, gen.decode_token_time[b, :n])
        assert s.servers.decode_engines.tolist() == [2] * n and s.servers.slots.tolist() == [4] * n
        assert float(s.workload.prompt_shift) == 100.0 and float(s.workload.output_scale) == 200.0


def test_default_queue_is_per_server_for_cells_without_buffers():
    """`slots` by default for `servers` cells without finite buffers: four times the fluid
    workload at 95% of capacity per server (M/M/1 law: 19 requests) + 2, at least 16,
    taken over the cells, not the cell's workload over the largest server count: one
    server gets 4 x 19 + 2 -> 128; 100 servers 16; a scenario with both 128 (the
    one-server cell's), where dividing by the largest count (100) would give 64 and
    overflow sooner. With finite buffers the default is unchanged (App.-B, below). The
    leaf rule `pod` with d = 1, a random split that JSQ's bound does not cover, gets four
    times JSQ's need, never above the cell's buffer + 1; with d >= 2 JSQ's."""
    from dlbfluid._requests import simulate as sm
    from dlbfluid._requests._leaf import JoinShortestQueue, PowerOfD

    def default(cells, leaf=JoinShortestQueue()):
        n = len(cells)
        d = {"name": "q", "cells": cells, "latency": [[0.0] * n for _ in range(n)]}
        scn = dl.stack_scenarios([scenario_from_dict(d)])
        k_b = np.ones(1)
        plan = sm._servers_plan(scn, scn, "servers", k_b, True)
        return sm._default_slots(scn, "servers", k_b, plan, leaf)

    def mm1(reps, cap):
        return {"name": f"c{reps}", "arrival_rate": 0.5 * cap, "replicas": reps,
                "service": {"model": "mm1", "capacity": cap}}  # fmt: skip

    assert default([mm1(1, 1.0)]) == 128
    assert default([mm1(100, 100.0)]) == 16
    assert default([mm1(1, 1.0), mm1(100, 100.0)]) == 128
    assert default([mm1(1, 1.0)], PowerOfD(1)) == 512  # (4 x 78 -> 512)
    assert default([mm1(1, 1.0)], PowerOfD(2)) == 128  # (JSQ's)
    assert default([{**mm1(4, 4.0), "buffer": 40.0}], PowerOfD(1)) == 64  # (min(4 x 41, 41))
    d = scenario_dicts(generate(0, 2), horizon=10.0)
    scn = dl.stack_scenarios([scenario_from_dict(x, allow_overload=True) for x in d])
    plan = sm._servers_plan(scn, scn, "servers", np.ones(2), True)
    buf, S = np.asarray(scn.buffer), np.maximum(np.round(plan.servers), 1)
    want = np.max(np.floor(np.where(np.asarray(scn.cell_mask), buf, 0.0)) / S) + 2
    assert sm._default_slots(scn, "servers", np.ones(2), plan, JoinShortestQueue()) == sm._pow2(
        max(64.0, want)
    )
