"""The `recovery` experiment (issue 42, item 3): one cell of each scenario serves 3x
slower from 30% to 50% of the horizon; per policy and estimation variant, the time from
the slowdown's end until the slowed cell's traffic share stays within 10% of the oracle
run's (`recovery_time`), censored (a bound, not a number) when it never does.

Known answers: `recovery_time` on hand-made share series; the summary pairs runs with the
oracle variant's and reports censored quantiles as null; the variants and the refusals;
the slowed cell's schedule in the variant's batch; the twin's `received` counts and
`traffic_share` against the arrivals and Rand's weights.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

import dlbfluid as dl
from dlbfluid._evaluation import experiment as ex
from dlbfluid._evaluation.config import RECOVERY_SLOWDOWN, variants

T = 100.0  # 10 intervals of 10 s; the slowdown ends at 50 s (interval 5)


def test_recovery_time_on_hand_series():
    o = np.full(10, 0.2)
    s = o.copy()
    assert ex.recovery_time(s, o, T) == 0.0  # identical: recovered at once
    s[5:7] = 0.1  # outside 10% in [50, 70) s, inside after: recovered 20 s after 50 s
    assert ex.recovery_time(s, o, T) == 20.0
    s[7] = 0.179  # 10.5% below: still outside in [70, 80)
    assert ex.recovery_time(s, o, T) == 30.0
    s[7] = 0.181  # 9.5% below: inside
    assert ex.recovery_time(s, o, T) == 20.0
    s[2:4] = 0.0  # before the slowdown's end: not counted
    assert ex.recovery_time(s, o, T) == 20.0
    s[9] = 0.3  # the last interval outside: censored
    assert ex.recovery_time(s, o, T) is None
    s[9] = 0.2
    s[8] = np.nan  # an interval without deliveries counts as outside
    assert ex.recovery_time(s, o, T) == 40.0


def _rows(variant, policy, shares):
    return [
        {"variant": variant, "policy": policy, "scenario": k, "trial": 0, "status": "success",
         "mean_latency": "1.0", "error_rate": "0", "p90_latency": "2.0",
         "fluid_status": "success", "fluid_mean_latency": "1.0", "fluid_error_rate": "0",
         "estimate_age_max": "" if variant == "oracle" else "0",
         "estimate_samples_min": "" if variant == "oracle" else "10",
         "estimate_stale_cells": "" if variant == "oracle" else "0",
         "slowed_cell": "0", "slowed_share": " ".join(f"{x:.6g}" for x in s)}
        for k, s in enumerate(shares)
    ]  # fmt: skip


def test_summary_pairs_with_the_oracle_and_bounds_censored_runs():
    o = np.full(10, 0.2)
    late = o.copy()
    late[5:8] = 0.05  # recovered 30 s after the slowdown's end
    never = o.copy()
    never[5:] = 0.05  # censored: more than 100 (1 - 0.5) - 10 = 40 s
    rows = []
    for v in ("oracle", "online"):
        rows += _rows(v, "rand", [o, o, o])
        rows += _rows(v, "flow-lat", [o, o, o] if v == "oracle" else [o, late, never])
    out = {(r["variant"], r["policy"]): r for r in ex.summarise(rows, ("rand", "flow-lat"), "requests", T)}
    assert out[("oracle", "flow-lat")]["recovery_time"] is None
    # negative control: rand does not read the latency models, its shares are the oracle's
    assert out[("online", "rand")]["recovery_time"] == {
        "runs": 3, "recovered": 3, "censored": 0, "censored_above_s": 40.0,
        "mean_recovered_s": 0.0, "p50_s": 0.0, "p90_s": 0.0}  # fmt: skip
    # times 0, 30, inf: the median 30 s, the p90 censored (null), the mean of the two
    assert out[("online", "flow-lat")]["recovery_time"] == {
        "runs": 3, "recovered": 2, "censored": 1, "censored_above_s": 40.0,
        "mean_recovered_s": 15.0, "p50_s": 30.0, "p90_s": None}  # fmt: skip
    # A run whose oracle partner failed is not paired.
    rows[3 + 1]["status"] = "solver_failed"  # (oracle, flow-lat, scenario 1)
    rows_again = [dict(r) for r in rows]
    res = {(r["variant"], r["policy"]): r for r in ex.summarise(rows_again, ("rand", "flow-lat"), "requests", T)}
    assert res[("online", "flow-lat")]["recovery_time"]["runs"] == 2


def test_variants_and_refusals():
    labels = [label for label, _ in variants("recovery")]
    assert labels == ["oracle", "online", "background-probing", "shrinkage", "dithering"]
    opts = dict(variants("recovery"))
    assert all(o["slowdown"] == RECOVERY_SLOWDOWN == (3.0, 0.3, 0.5) for o in opts.values())
    assert "estimation" not in opts["oracle"] and opts["online"]["estimation"] == {}
    assert opts["shrinkage"]["estimation"] == {"shrinkage": 64.0}
    cfg = ex.ExperimentConfig("recovery", model="requests", service="servers", horizon=100.0)
    assert ex.online_estimation(cfg, opts["background-probing"]["estimation"]).probing == 1.0
    assert ex.fields(cfg)[-2:] == ("slowed_cell", "slowed_share")
    for bad in (dict(), dict(model="requests"), dict(model="requests", service="servers",
                                                     estimation="online")):  # fmt: skip
        with pytest.raises(ValueError, match="^experiment = 'recovery' is invalid with"):
            ex.ExperimentConfig("recovery", horizon=100.0, **bad)


def test_the_variant_batch_slows_one_real_cell():
    cfg = ex.ExperimentConfig("recovery", model="requests", service="servers", horizon=100.0,
                              scenarios=3, trials=2)  # fmt: skip
    _, batch, _ = ex._variant_batch(cfg, dict(variants("recovery"))["online"])
    f = np.asarray(batch.slowdown_factors)
    t = np.asarray(batch.slowdown_times)
    mask = np.asarray(batch.cell_mask)
    slowed = f.max(axis=-1) > 1.0
    np.testing.assert_array_equal(slowed.sum(axis=-1), 1)  # one cell per run
    assert np.all(mask[slowed])
    j = np.argmax(slowed, axis=-1)
    np.testing.assert_array_equal(j[0::2], j[1::2])  # the same cell in every trial
    np.testing.assert_allclose(t[slowed], [[0.0, 30.0, 50.0]] * 6)
    np.testing.assert_allclose(f[slowed], [[1.0, 3.0, 1.0]] * 6)


def test_received_counts_and_traffic_shares():
    # Rand splits each root's requests by the cells' replicas (3/5 and 2/5 from both
    # roots); the deliveries by the horizon are
    # the arrivals less those still in flight (at most a few: delays 10-30 ms).
    d = {"name": "two", "cells": [
        {"name": "a", "arrival_rate": 3.0, "replicas": 3, "service": {"model": "mm1", "capacity": 12.0}},
        {"name": "b", "arrival_rate": 5.0, "replicas": 2, "service": {"model": "mm1", "capacity": 10.0}}],
        "latency": [[0.01, 0.03], [0.03, 0.01]]}  # fmt: skip
    scn = dl.scenario_from_dict(copy.deepcopy(d))
    sol = dl.simulate_requests(scn, "rand", service="servers", scale=5, trials=2, horizon=20.0,
                               tick=0.05, n_save=4)  # fmt: skip
    rec = np.asarray(sol.received)
    assert rec.shape == (2, 5, 2) and np.all(rec[:, 0] == 0) and np.all(np.diff(rec, axis=1) >= 0)
    arrived = np.asarray(sol.arrivals).sum(-1)
    assert np.all(arrived - rec[:, -1].sum(-1) >= 0) and np.all(arrived - rec[:, -1].sum(-1) <= 5)
    x = np.asarray(dl.weighted_random_routing(scn.allowed, scn.replicas))
    lam = np.array([3.0, 5.0])
    expect = lam @ x / lam.sum()
    share = sol.traffic_share()
    assert share.shape == (2, 4, 2)
    pooled = np.diff(rec, axis=1).sum((0, 1)) / np.diff(rec, axis=1).sum()
    n = np.diff(rec, axis=1).sum()
    se = math.sqrt(expect[0] * (1 - expect[0]) / n)
    assert abs(pooled[0] - expect[0]) < 4 * se
    # negative control: an even split is rejected
    assert abs(pooled[0] - 0.5) > 4 * se
