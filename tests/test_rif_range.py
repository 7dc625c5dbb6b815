"""The range of mean latency over the RIF equilibria (theory/equilibria.md §5.1).

RIF's workloads are unique, its routing is not: `rif_latency_range` gives the least and the
greatest social cost over the routings that deliver the equilibrium flows on tight arcs.
Checked against `scipy.optimize.linprog` (HiGHS) on the same transportation programs, and
against a `flow-rif` simulation that reaches another point of the equilibrium set.
"""

import dataclasses
import json
import math

import numpy as np
import pytest
import scipy.optimize
from helpers import THREE, three

import dlbfluid as dl
from dlbfluid._equilibrium import rif_latency_range


def _default():
    with open(dl.__path__[0] + "/data/default.json") as f:
        return json.load(f)


def _linprog_range(d: dict, N, z):
    """Independent min/max of sum 2 tau y over y >= 0 on the tight arcs (RIF cost N_j/k_j
    within 1e-7 of the source's least) with row sums lambda and column sums z."""
    n = len(d["cells"])
    lam = np.array([c["arrival_rate"] for c in d["cells"]], dtype=float)
    k = np.array([c["replicas"] for c in d["cells"]], dtype=float)
    allowed = np.array([[v is not None for v in row] for row in d["latency"]])
    tau = np.array([[0.0 if v is None else v for v in row] for row in d["latency"]])
    f = np.asarray(N) / k
    arcs = [
        (i, j)
        for i in range(n)
        for j in range(n)
        if lam[i] > 0 and allowed[i, j] and f[j] <= f[allowed[i]].min() + 1e-7
    ]
    A = np.zeros((2 * n, len(arcs)))
    for a, (i, j) in enumerate(arcs):
        A[i, a] = A[n + j, a] = 1.0
    b = np.concatenate([lam, z])
    cost = np.array([2.0 * tau[i, j] for i, j in arcs])
    out = []
    for sign in (1.0, -1.0):
        res = scipy.optimize.linprog(sign * cost, A_eq=A, b_eq=b, bounds=(0, None), method="highs")
        assert res.status == 0
        out.append((np.sum(N) + sign * res.fun) / lam.sum())
    return out


@pytest.fixture(scope="module")
def default_range():
    return rif_latency_range(dl.scenario_from_dict(_default()))


def test_default_range_contains_solver_and_flow_rif(default_range):
    """The solver's routing (every source split alike) and the routing `flow-rif` reaches
    from all-local traffic are two RIF equilibria of the default scenario with different
    mean latencies; both lie in the range, which matches linprog."""
    r = default_range
    d = _default()
    assert int(r.status) == 0
    lo, hi = float(r.mean_latency_low), float(r.mean_latency_high)
    solver = float(r.equilibrium.mean_latency)
    assert lo < solver < hi
    ref = _linprog_range(d, np.asarray(r.equilibrium.N), np.asarray(r.equilibrium.z))
    np.testing.assert_allclose([lo, hi], ref, rtol=1e-8)
    # the extreme routings are RIF equilibria: rows on the simplex, only tight arcs, and
    # they deliver z*
    lam = np.array([c["arrival_rate"] for c in d["cells"]])
    tau = np.array([[0.0 if v is None else v for v in row] for row in d["latency"]])
    for x, C in ((r.x_low, r.social_cost_low), (r.x_high, r.social_cost_high)):
        x = np.asarray(x)
        np.testing.assert_allclose(x.sum(axis=1), 1.0, atol=1e-12)
        assert np.all(x[~np.asarray(r.tight)] == 0) and np.all(x >= 0)
        np.testing.assert_allclose(lam @ x, np.asarray(r.equilibrium.z), rtol=1e-8)
        net = np.sum(2 * tau * lam[:, None] * x)
        assert float(C) == pytest.approx(float(np.sum(r.equilibrium.N)) + net, rel=1e-12)

    # flow-rif from all-local routing keeps most traffic local: same N*, lower latency
    d["initial"] = {"routing": np.eye(4).tolist()}
    sol = dl.simulate(
        dl.scenario_from_dict(d), "flow-rif", step_size=0.05, tick=0.02, horizon=400.0, n_save=8
    )
    assert float(sol.final_change) < 1e-4
    np.testing.assert_allclose(np.asarray(sol.N[-1]), np.asarray(r.equilibrium.N), rtol=1e-4)
    x = np.asarray(sol.x[-1])
    local = float(np.sum(r.equilibrium.N) + np.sum(2 * tau * lam[:, None] * x)) / lam.sum()
    assert lo <= local <= hi
    assert local < solver - 0.05  # 1.6568 against 1.7285 (and lo = 1.6500)
    assert float(sol.mean_latency()) == pytest.approx(local, rel=1e-4)


def test_batch_matches_linprog_and_unbatched(default_range):
    """A padded batch: the default scenario (as unbatched), THREE, THREE with an isolated
    busy cell (allowed arcs into it are not tight) and THREE without demand (NaN)."""
    iso = three(latency=[[0.0, 0.03, 0.11], [0.03, 0.0, 0.07], [None, None, 0.0]])
    iso["cells"][2]["arrival_rate"] = 2.5
    idle = three()
    for c in idle["cells"]:
        c["arrival_rate"] = 0.0
    dicts = [_default(), THREE, iso, idle]
    r = rif_latency_range(dl.stack_scenarios([dl.scenario_from_dict(d) for d in dicts]))
    lo, hi = np.asarray(r.mean_latency_low), np.asarray(r.mean_latency_high)
    np.testing.assert_allclose(
        [lo[0], hi[0]],
        [float(default_range.mean_latency_low), float(default_range.mean_latency_high)],
        rtol=1e-10,
    )
    for b in range(3):
        n = len(dicts[b]["cells"])
        ref = _linprog_range(dicts[b], np.asarray(r.equilibrium.N[b, :n]), r.equilibrium.z[b, :n])
        np.testing.assert_allclose([lo[b], hi[b]], ref, rtol=1e-8)
        assert lo[b] <= float(r.equilibrium.mean_latency[b]) <= hi[b]
    tight = np.asarray(r.tight[2, :3, :3])
    assert not tight[0, 2] and not tight[1, 2] and tight[2, 2]  # the busy cell's RIF is higher
    assert math.isnan(lo[3]) and math.isnan(hi[3])
    np.testing.assert_array_equal(np.asarray(r.status), 0)


def test_rejects_other_equilibria(default_range):
    other = dataclasses.replace(default_range.equilibrium, cost="gradient")
    with pytest.raises(ValueError, match="equilibrium.cost = 'gradient' is invalid"):
        rif_latency_range(dl.scenario_from_dict(_default()), equilibrium=other)
