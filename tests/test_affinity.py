"""Sessions, prefix caches and affinity routing in the twin (`dlbfluid._requests.sessions`;
theory/affinity.md).

Known answers: the session slots and renewals drawn at the rates of their formulas (hand
numbers for a Zipf skew of 1); a tick's sessions resolved by hand (a chain inside a tick,
a home from an earlier tick, a new session, a request outside any session), per mode; the
conditional rule on hand latencies; with one FIFO server and sticky affinity every
continuing session request hits, so the hit rate is f(1 - 1/L) (binomial) and the mean
latency is the M/G/1 Pollaczek-Khinchine mean of the mixed service law; the negative
control: without affinity, two servers halve the hits. Without sessions every mode is
`off`, and sessions that save nothing leave the run as it was, bit for bit.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import stub_simulate_requests

import dlbfluid as dl
from dlbfluid._cli import main
from dlbfluid._requests import sessions as S

UNIT = {"shift": 1, "shape": 1, "scale": 0}
SESSIONS = {"fraction": 0.65, "mean_length": 8, "think_time": 2.0, "prefix_reuse": 0.5}
F, L, R = 0.65, 8.0, 0.5


def cell(replicas: int, capacity: float, rate: float) -> dict:
    return {"name": "c", "arrival_rate": rate, "replicas": replicas,
            "service": {"model": "mm1", "capacity": capacity}}  # fmt: skip


def scenario(c: dict, sessions: dict | None = SESSIONS) -> dict:
    workload: dict = {"prompt_tokens": UNIT, "output_tokens": UNIT}
    if sessions is not None:
        workload["sessions"] = sessions
    return {"name": "one", "cells": [c], "latency": [[0.005]], "workload": workload}


# ----------------------------------------------------------------------------------------
# The scenario's fields
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, message",
    [
        ({"fraction": 1.5}, "workload.sessions.fraction"),
        ({"mean_length": 0.5}, "workload.sessions.mean_length"),
        ({"think_time": 0}, "workload.sessions.think_time"),
        ({"prefix_reuse": -0.1}, "workload.sessions.prefix_reuse"),
        ({"skew": -1}, "workload.sessions.skew"),
        ({"bogus": 1}, "workload.sessions"),
    ],
)
def test_bad_sessions_name_the_field(change, message):
    d = scenario(cell(1, 10.0, 5.0), {**SESSIONS, **change})
    with pytest.raises(dl.ScenarioError, match=message.replace(".", r"\.")):
        dl.scenario_from_dict(d)


def test_sessions_and_caches_round_trip_and_bad_cache_is_refused():
    d = scenario(cell(1, 10.0, 5.0), {**SESSIONS, "skew": 1.0})
    d["cells"][0] = {
        **d["cells"][0],
        "servers": {"count": 2, "prefill_token_time": 1e-3, "decode_token_time": 1e-3,
                    "cache_sessions": 7},
    }  # fmt: skip
    back = dl.scenario_to_dict(dl.scenario_from_dict(d))
    assert back["workload"]["sessions"] == {**SESSIONS, "skew": 1.0}
    assert back["cells"][0]["servers"]["cache_sessions"] == 7
    d["cells"][0]["servers"]["cache_sessions"] = -1
    with pytest.raises(dl.ScenarioError, match=r"cells\[0\]\.servers\.cache_sessions"):
        dl.scenario_from_dict(d)


# ----------------------------------------------------------------------------------------
# Slots, renewals, a tick's resolution and the conditional rule, by hand
# ----------------------------------------------------------------------------------------


def test_slots_and_renewals_follow_their_formulas():
    """Skew 1 over M_i = ceil(f lam T) = 4 slots (f = 1, lam = 2, T = 2): weights
    (12, 6, 4, 3)/25; with L = 2 a request starts a new session with probability
    min(1, 1/(L M w_u)) = (0.2604, 0.5208, 0.78125, 1). 200,000 draws agree within 5
    standard errors; the negative control, uniform slots, is rejected."""
    wl = dl.scenario_from_dict(
        scenario(
            cell(1, 10.0, 2.0),
            {
                "fraction": 1.0,
                "mean_length": 2.0,
                "think_time": 2.0,
                "prefix_reuse": 0.5,
                "skew": 1.0,
            },
        )  # fmt: skip
    ).workload
    aff = S.Affinity("off", 8, 4)
    lam = jnp.asarray([2.0])
    sl = S.session_lane(aff, wl, lam, jnp.asarray(1.0), jnp.asarray([4]), jnp.asarray([0.1]))
    rows = 200_000
    st = S.init_sessions(aff, 1, 1, rows + 3)
    roots, keep = jnp.zeros(rows, jnp.int32), jnp.ones(rows, bool)
    cols = np.asarray(S.draw(sl, st, jax.random.PRNGKey(0), roots, keep, rows, 3).cand)
    assert np.all(cols[rows:, 0] == -1)
    slot, new = cols[:rows, 1], cols[:rows, 4]
    w = np.array([12, 6, 4, 3]) / 25
    freq = np.bincount(slot, minlength=8) / rows
    se = np.sqrt(w * (1 - w) / rows)
    assert np.all(np.abs(freq[:4] - w) < 5 * se) and np.all(freq[4:] == 0)
    assert np.max(np.abs(freq[:4] - 0.25) / se) > 50  # (uniform slots would pass here)
    rho = np.array([0.2604167, 0.5208333, 0.78125, 1.0])
    for u in range(4):
        got = new[slot == u]
        assert abs(got.mean() - rho[u]) < 5 * np.sqrt(rho[u] * (1 - rho[u]) / got.size + 1e-12)


def _state(n=2, M=4):
    st = S.init_sessions(S.Affinity("sticky", M, 2), n, 1, 8)
    home = np.full(n * M, -1)
    home[0] = 1  # slot 0 of root 0: session 0 was last routed to cell 1
    return dataclasses.replace(st, home=jnp.asarray(home, jnp.int32))


@pytest.mark.parametrize("mode", ["off", "sticky", "conditional"])
def test_a_ticks_sessions_by_hand(mode):
    """Root 0, five candidates in time order: a) slot 0's session (home cell 1), routed 0;
    b) a new session in slot 1, routed 1; c) slot 1 again, routed 0; d) no session, routed
    1; e) slot 0 again, routed 0. The ids: a and e continue session 0, b and c are the new
    session 8 (n M = 8 ids exist at t = 0). `sticky`: a and e go home to 1, c follows b to
    1. `conditional` with stay[0, 1] False: nobody stays, every request is routed; with it
    True, as sticky. `off`: as routed."""
    g = jnp.asarray([0, 1, 1, 0, 0], jnp.int32)
    new = jnp.asarray([False, True, False, False, False])
    win, st = S.link(_state(), g, new, jnp.asarray([True, True, True, False, True]))
    i = jnp.zeros(5, jnp.int32)
    routed = jnp.asarray([0, 1, 0, 1, 0])
    accept = jnp.ones(5, bool)
    cases = [(st, None)]
    if mode == "conditional":
        leave = dataclasses.replace(st, stay=jnp.asarray([[True, False], [True, True]]))
        cases = [(st, [1, 1, 1, 1, 1]), (leave, [0, 1, 0, 1, 0])]
    expect = {"off": [0, 1, 0, 1, 0], "sticky": [1, 1, 1, 1, 1]}
    for s0, want in cases:
        cell, req, s1 = S.resolve(S.Affinity(mode, 4, 2), s0, win, 0, 5, i, routed, accept)
        assert np.asarray(req[:, 0]).tolist() == [0, 8, 8, -1, 0]  # session ids
        assert np.asarray(req[[0, 1, 2, 4], 1]).tolist() == [0, 1, 1, 0]  # their slots
        assert int(s1.server[1, 1]) == -1  # (a new session: not yet mapped to a server)
        assert np.asarray(cell).tolist() == (want or expect[mode])
        assert int(s1.next_id) == 9 and int(s1.current[1]) == 8 and int(s1.current[0]) == 0
        # each slot's home is the cell of its last request of the tick
        assert int(s1.home[0]) == int(cell[4]) and int(s1.home[1]) == int(cell[2])
        # a, c and e had a cell to return to (home 1, b's, a's); those routed elsewhere moved
        c = np.asarray(cell)
        assert int(s1.returning) == 3
        assert int(s1.moved) == int(c[0] != 1) + int(c[2] != c[1]) + int(c[4] != c[0])
        assert int(s1.moved) == (0 if c.tolist() == [1] * 5 else 2)



def _link_by_loop(current, next_id, g, new, is_s):
    """The sessions of a chunk's candidates, one at a time (the reference of `link`)."""
    cur, nid = list(current), next_id
    sid, pred, nxt, seen = [-1] * len(g), [-1] * len(g), [S.NONE] * len(g), {}
    for a, (u, fresh, real) in enumerate(zip(g, new, is_s)):
        if not real:
            continue
        if fresh:
            cur[u], nid = nid, nid + 1
        sid[a] = cur[u]
        if u in seen:
            nxt[seen[u]] = a
            if not fresh:
                pred[a] = seen[u]
        seen[u] = a
    return sid, pred, nxt, cur, nid


def test_link_agrees_with_a_loop():
    """`link` (one sort per chunk) against a request-by-request loop on 300 random
    candidates over 6 slots: ids, previous requests, next requests of the slot, the slots'
    latest ids and the next id. A version that forgot the slot's current id, or chained a
    request to a session before a new start, disagrees here."""
    rng = np.random.default_rng(3)
    R, nm = 300, 6
    g = rng.integers(0, nm, R)
    new, is_s = rng.random(R) < 0.2, rng.random(R) < 0.7
    st = S.init_sessions(S.Affinity("sticky", 3, 2), 2, 1, R)
    cols, s1 = S.link(st, jnp.asarray(g, jnp.int32), jnp.asarray(new), jnp.asarray(is_s))
    sid, pred, nxt, cur, nid = _link_by_loop(range(nm), nm, g, new, is_s)
    cols = np.asarray(cols)
    assert cols[:, 0].tolist() == sid and cols[:, 2].tolist() == pred
    assert cols[:, 3].tolist() == nxt and np.asarray(s1.current).tolist() == cur
    assert int(s1.next_id) == nid and np.all(cols[is_s, 1] == g[is_s])
    assert len(set(sid) - {-1}) > 30  # (many sessions, several per slot)

def test_conditional_rule_by_hand():
    """Three M/M/1 cells (latency (1 + N)/mu), root 0 sees workloads (1, 0, 3) with
    mu = (2, 1, 4) and one-way delays (0, 0.1, 0.05): E = (1.0, 1.2, 1.1). A session at
    cell 1 stays when its saving exceeds 0.2 (1.2 - s < 1.0): 0.15 leaves, 0.25 stays; at
    cell 2 when it exceeds 0.1: 0.15 stays, 0.05 leaves; at the best cell always
    (1.0 < 1.1)."""
    model = dl.ServiceModel.of("mm1", capacity=jnp.asarray([2.0, 1.0, 4.0]))
    np.testing.assert_allclose(model.latency(jnp.asarray([1.0, 0.0, 3.0])), [1.0, 1.0, 1.0])
    N = jnp.asarray([[1.0, 0.0, 3.0]] * 3)
    tau = jnp.asarray([[0.0, 0.1, 0.05]] * 3)
    allowed = jnp.ones((3, 3), bool)
    for saving, want in [((0.0, 0.15, 0.15), [True, False, True]),
                         ((0.0, 0.25, 0.05), [True, True, False])]:  # fmt: skip
        stay = S.stay_rule(jnp.asarray(saving), model, N, tau, allowed)
        assert np.asarray(stay)[0].tolist() == want
    # a root with one allowed cell always stays
    only = jnp.eye(3, dtype=bool)
    assert bool(jnp.all(S.stay_rule(jnp.zeros(3), model, N, tau, only)[jnp.eye(3, dtype=bool)]))


# ----------------------------------------------------------------------------------------
# End to end: hit rates, the M/G/1 mean, the negative control
# ----------------------------------------------------------------------------------------


def _batch(sessions=SESSIONS):
    """One FIFO server of rate 10 at 5 req/s, and two servers of rate 10 at 10 req/s."""
    return dl.stack_scenarios(
        [
            dl.scenario_from_dict(scenario(cell(1, 10.0, 5.0), sessions)),
            dl.scenario_from_dict(scenario(cell(2, 20.0, 10.0), sessions)),
        ]  # fmt: skip
    )


def _run(batch, affinity, **kw):
    args = dict(service="servers", trials=4, horizon=400.0, warmup=20.0, tick=0.01, throw=True)
    return dl.simulate_requests(batch, "rand", affinity=affinity, **{**args, **kw})


@pytest.fixture(scope="module")
def runs():
    return {mode: _run(_batch(), mode) for mode in ("sticky", "off")}


def test_one_server_hit_rate_and_pollaczek_khinchine_mean(runs):
    """One server, sticky (and off: one server is the same): a session request that does
    not start its session hits, so the hit rate is p = f(1 - 1/L) = 0.56875 within 4
    binomial standard errors, and the service is X(1 - rH), H ~ Bernoulli(p) independent of
    X ~ Exp(10) and of the Poisson arrivals: the M/G/1 mean sojourn E[S] + lam E[S^2] /
    (2(1 - lam E[S])) plus the round trip 0.01 s, within 4 standard errors across trials.
    Negative controls: prefill saved on every session request (p = f) is outside both."""
    p, mu, lam = F * (1 - 1 / L), 10.0, 5.0

    def pk(p):
        es, es2 = (1 - R * p) / mu, 2 * (1 - p + p * (1 - R) ** 2) / mu**2
        return es + lam * es2 / (2 * (1 - lam * es)) + 0.01

    for mode in ("sticky", "off"):
        sol = runs[mode].scenario(0)
        hits = np.asarray(sol.cache_hit_rate)
        n = float(np.sum(sol.served))
        se = np.sqrt(p * (1 - p) / n)
        assert abs(hits.mean() - p) < 4 * se and abs(hits.mean() - F) > 10 * se
        lat = np.asarray(sol.mean_latency())
        se_lat = lat.std(ddof=1) / np.sqrt(lat.size)
        assert abs(lat.mean() - pk(p)) < 4 * se_lat, (lat.mean(), pk(p), se_lat)
        assert abs(lat.mean() - pk(F)) > 4 * se_lat
        assert np.all(np.asarray(sol.busiest_server_share) == 1.0)


def test_affinity_keeps_the_hits_that_two_servers_lose_without_it(runs):
    """Two servers: sticky affinity sends a session to the server holding its prefix, so
    its hit rate stays p; without affinity the shortest queue ignores the caches and a
    session's request that it sends to the other server misses (0.50 against 0.57 when
    this was written: the lowest index wins JSQ's ties, so that most requests still land
    on server 0, whose share of the admissions is above a half)."""
    p = F * (1 - 1 / L)
    sticky, off = (runs[m].scenario(1) for m in ("sticky", "off"))
    n = float(np.sum(off.served))
    se = np.sqrt(p * (1 - p) / n)
    assert abs(np.asarray(sticky.cache_hit_rate).mean() - p) < 4 * se
    hits = np.asarray(off.cache_hit_rate).mean()
    assert 0.3 * p < hits < p - 8 * se
    share = np.asarray(off.busiest_server_share)
    assert np.all((share > 0.5) & (share < 0.8))


def test_without_sessions_every_mode_is_off_and_zero_reuse_changes_nothing():
    """A scenario without sessions runs the same program in every mode (no session state),
    bit for bit; sessions with no prefix reuse draw their columns from a key of their own,
    so that the run's latencies are those without sessions, bit for bit."""
    plain = _batch(sessions=None)
    base = _run(plain, "off", horizon=40.0, warmup=4.0)
    assert base.cache_hit_rate is None
    for mode in ("sticky", "conditional"):
        other = _run(plain, mode, horizon=40.0, warmup=4.0)
        for f in ("served", "latency_sum", "histogram", "count", "final_x"):
            np.testing.assert_array_equal(getattr(other, f), getattr(base, f))
    idle = _run(_batch({**SESSIONS, "prefix_reuse": 0.0}), "off", horizon=40.0, warmup=4.0)
    for f in ("served", "latency_sum", "histogram", "count", "final_x"):
        np.testing.assert_array_equal(getattr(idle, f), getattr(base, f))
    assert np.all(np.asarray(idle.cache_hit_rate) > 0.1)  # (hits that save nothing)


# ----------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------


def test_affinity_on_the_command_line(tmp_path, capsys):
    """`--affinity conditional` on two cells: the JSON's `affinity` and per policy
    `cache_hit_rate` and `busiest_server_share`; bad values are refused in one line."""
    two = copy.deepcopy(scenario(cell(2, 20.0, 8.0)))
    two["cells"] = [dict(two["cells"][0], name="a"), dict(two["cells"][0], name="b")]
    two["latency"] = [[0.005, 0.02], [0.02, 0.005]]
    path = tmp_path / "two.json"
    path.write_text(json.dumps(two))
    argv = ["simulate", str(path), "--model", "requests", "--service", "servers", "--horizon",
            "20", "--tick", "0.01", "--trials", "2", "--policy", "flow-lat"]  # fmt: skip
    assert main([*argv, "--affinity", "conditional", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["affinity"] == "conditional"
    r = res["policies"]["flow-lat"]
    assert 0.2 < r["cache_hit_rate"] < F and 0.2 < r["busiest_server_share"] < 0.4
    assert 0 <= r["session_move_rate"] < 0.5
    for extra, message in [
        (["--affinity", "always"], "--affinity = 'always' is invalid: allowed off, sticky, "),
        (["--service", "markov", "--affinity", "sticky"], "--affinity = 'sticky' is invalid"),
        (["--service", "markov"], "the scenario's workload has sessions"),
    ]:
        assert main([*argv, *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1


# ----------------------------------------------------------------------------------------
# The `affinity` experiment
# ----------------------------------------------------------------------------------------


def test_affinity_experiment_variants_batch_rows_and_summary(monkeypatch):
    """The kind's variants are the three modes on scenarios whose workload has
    `AFFINITY_SESSIONS`; its results add `AFFINITY_FIELDS`, filled from the twin's
    `cache_hit_rate` and `busiest_server_share` (a stand-in records what the experiment
    passes); the summary's `sessions` counts its runs. The fluid model refuses the kind."""
    from dlbfluid._evaluation import experiment as ex
    from dlbfluid._evaluation.config import AFFINITY_SESSIONS, FLUID_KINDS, variants

    assert [label for label, _ in variants("affinity")] == ["off", "sticky", "conditional"]
    assert "affinity" not in FLUID_KINDS
    for bad in (dict(), dict(model="requests")):
        with pytest.raises(ValueError, match="^experiment = 'affinity' is invalid with"):
            ex.ExperimentConfig("affinity", horizon=20.0, **bad)
    cfg = ex.ExperimentConfig("affinity", model="requests", service="servers", horizon=20.0,
                              scenarios=2, trials=1, policies=("rand",))  # fmt: skip
    assert ex.fields(cfg)[-3:] == ("cache_hit_rate", "busiest_server_share", "session_move_rate")
    opts = dict(variants("affinity"))["sticky"]
    _, batch, _ = ex._variant_batch(cfg, opts)
    w = batch.workload
    np.testing.assert_allclose(w.session_fraction, AFFINITY_SESSIONS["fraction"])
    np.testing.assert_allclose(w.session_skew, AFFINITY_SESSIONS["skew"])
    assert np.all(np.asarray(batch.servers.cache_sessions)[np.asarray(batch.servers.mask)] == 64)

    seen = stub_simulate_requests(
        monkeypatch,
        ex,
        runs=2,
        cache_hit_rate=np.array([[0.4], [0.3]]),
        busiest_server_share=np.array([[0.05], [0.1]]),
        session_move_rate=np.array([[0.2], [0.0]]),
    )
    *_, est = ex._simulate_requests_unit(cfg, batch, dl.policy_from_name("rand"), 1.0, None,
                                         0.005, opts)  # fmt: skip
    assert seen["affinity"] == "sticky"
    np.testing.assert_allclose(est["hits"], [0.4, 0.3])
    base = {"status": "success", "lat": 1.0, "err": 0.0, "p90": 2.0, "f_lat": 1.0,
            "f_err": 0.0, "f_status": "success"}  # fmt: skip
    rows = []
    for k in range(2):
        run = {**base, "hits": est["hits"][k], "busiest": est["busiest"][k],
               "moves": est["moves"][k]}  # fmt: skip
        rows.append(ex._row(cfg, {"experiment": "affinity", "variant": "sticky",
                                  "policy": "rand"}, (k, 0), run, 3, [0.8, 0.8], ""))  # fmt: skip
    assert rows[1]["cache_hit_rate"] == "0.3" and rows[1]["busiest_server_share"] == "0.1"
    (summary,) = ex.summarise(rows, ("rand",), model="requests")
    assert summary["sessions"]["runs"] == 2
    assert summary["sessions"]["cache_hit_rate"] == pytest.approx(0.35)
    assert summary["sessions"]["busiest_server_share"] == pytest.approx(0.075)
    assert summary["sessions"]["session_move_rate"] == pytest.approx(0.1)
