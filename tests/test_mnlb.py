"""MNLB routing-weight optimiser (`dlbfluid._policies.mnlb_weights`, theory/mnlb.md).

References: `scipy.optimize.linprog` (HiGHS) for the capped LP, and a three-stage HiGHS
lexicographic solve (smallest common overflow, then total overflow, then latency) for the
elastic program; closed forms worked out by hand in each test's docstring.
"""

import numpy as np
import pytest
from scipy.optimize import linprog

from dlbfluid._policies.mnlb_weights import MNLB_STATUS, mnlb_weights

HIGHS = dict(primal_feasibility_tolerance=1e-10, dual_feasibility_tolerance=1e-10)
N = 8  # the size of the random batches (one compiled shape)
B = 12


# ----------------------------------------------------------------------------------------
# Independent references (HiGHS)
# ----------------------------------------------------------------------------------------


def _arcs(al):
    n = al.shape[0]
    return [(i, j) for i in range(n) for j in range(n) if al[i, j]]


def highs_capped(lam, tau, al, mu, cap):
    """min sum tau y s.t. row sums lam, column sums <= cap mu, y >= 0 on allowed arcs."""
    n, idx = len(lam), _arcs(al)
    Aeq, Aub = np.zeros((n, len(idx))), np.zeros((n, len(idx)))
    for k, (i, j) in enumerate(idx):
        Aeq[i, k] = Aub[j, k] = 1.0
    c = np.array([tau[i, j] for i, j in idx])
    r = linprog(c, A_ub=Aub, b_ub=cap * mu, A_eq=Aeq, b_eq=lam, method="highs", options=HIGHS)
    return r


def highs_lexicographic(lam, tau, al, mu, cap):
    """(s*, O*, L*): smallest common relative overflow, then total overflow, then latency.

    Variables (y on arcs, o per cell, s): sum_i y_ij - o_j <= cap mu_j, o_j <= s mu_j.
    Each stage fixes the previous optimum with a 1e-10 relative allowance.
    """
    n, idx = len(lam), _arcs(al)
    m = len(idx)
    nv = m + n + 1
    Aeq, Aub = np.zeros((n, nv)), np.zeros((2 * n, nv))
    for k, (i, j) in enumerate(idx):
        Aeq[i, k] = Aub[j, k] = 1.0
    for j in range(n):
        Aub[j, m + j] = -1.0
        Aub[n + j, m + j] = 1.0
        Aub[n + j, nv - 1] = -mu[j]
    bub = np.r_[cap * mu, np.zeros(n)]
    c1 = np.zeros(nv)
    c1[-1] = 1.0
    r1 = linprog(c1, A_ub=Aub, b_ub=bub, A_eq=Aeq, b_eq=lam, method="highs", options=HIGHS)
    s = r1.fun
    bounds = [(0, None)] * (nv - 1) + [(0, s + 1e-10)]
    c2 = np.zeros(nv)
    c2[m : m + n] = 1.0
    r2 = linprog(c2, Aub, bub, Aeq, lam, bounds=bounds, method="highs", options=HIGHS)
    c3 = np.zeros(nv)
    c3[:m] = [tau[i, j] for i, j in idx]
    r3 = linprog(
        c3,
        np.vstack([Aub, c2]),
        np.r_[bub, r2.fun + 1e-10 * lam.sum()],
        Aeq,
        lam,
        bounds=bounds,
        method="highs",
        options=HIGHS,
    )
    assert r1.status == r2.status == r3.status == 0
    return s, r2.fun, r3.fun


def random_batch(seed, util_lo, util_hi, p_allowed=0.6, n=N, b=B):
    rng = np.random.default_rng(seed)
    lam = rng.uniform(0.0, 10.0, (b, n))
    lam[:, 1] *= rng.uniform(size=b) < 0.5  # some sources without demand
    mu = rng.uniform(5.0, 20.0, (b, n))
    tau = rng.uniform(0.001, 0.1, (b, n, n))
    al = rng.uniform(size=(b, n, n)) < p_allowed
    al[:, np.arange(n), np.arange(n)] = True
    util = rng.uniform(util_lo, util_hi, b)
    lam = lam / lam.sum(1, keepdims=True) * (util * mu.sum(1))[:, None]
    return lam, tau, al, mu


def check_routing(x, lam, al, tol=1e-12):
    """Rows on the simplex over allowed arcs (rows of zero-rate sources included)."""
    x = np.asarray(x)
    assert np.all(x >= 0)
    assert np.all(x[~al] == 0)
    np.testing.assert_allclose(x.sum(-1), 1.0, atol=tol)


# ----------------------------------------------------------------------------------------
# Feasible demand: the capped LP
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def feasible():
    rng_batches = []
    for seed in range(40):
        lam, tau, al, mu = random_batch(seed, 0.3, 0.85, b=1)
        if highs_capped(lam[0], tau[0], al[0], mu[0], 0.9).status == 0:
            rng_batches.append((lam, tau, al, mu))
        if len(rng_batches) == B:
            break
    lam, tau, al, mu = (np.concatenate(a) for a in zip(*rng_batches))
    x, info = mnlb_weights(lam, tau, al, mu)
    return lam, tau, al, mu, np.asarray(x), info


def test_feasible_matches_highs(feasible):
    """Objective within 1e-7 relative of HiGHS; constraints to 1e-9; no overflow."""
    lam, tau, al, mu, x, info = feasible
    assert np.all(np.asarray(info.status) == MNLB_STATUS["success"])
    assert not np.any(np.asarray(info.overloaded))
    np.testing.assert_array_equal(np.asarray(info.theta), 0.9)
    for b in range(B):
        r = highs_capped(lam[b], tau[b], al[b], mu[b], 0.9)
        lat = np.sum(tau[b] * lam[b][:, None] * x[b])
        assert abs(lat - r.fun) <= 1e-7 * r.fun, (b, lat, r.fun)
        assert abs(float(info.latency[b]) - lat) <= 1e-12 * lat
        # HiGHS's own point has the same objective
        load = (lam[b][:, None] * x[b]).sum(0)
        assert np.all(load <= 0.9 * mu[b] * (1 + 1e-9))
        np.testing.assert_allclose(np.asarray(info.load[b]), load, rtol=1e-12)
    check_routing(x, lam, al)
    # zero-rate sources: all weight on the nearest allowed cell
    for b in np.nonzero(lam[:, 1] == 0)[0]:
        near = np.argmin(np.where(al[b, 1], tau[b, 1], np.inf))
        np.testing.assert_array_equal(x[b, 1], np.eye(N)[near])


def test_binding_cap_somewhere(feasible):
    """The random set exercises binding caps (otherwise nearest-cell routing would do)."""
    lam, tau, al, mu, x, info = feasible
    load = np.asarray(info.load)
    assert np.sum(np.isclose(load, 0.9 * mu, rtol=1e-8)) >= B
    nearest = np.zeros_like(x)
    for b in range(B):
        nearest[b][np.arange(N), np.argmin(np.where(al[b], tau[b], np.inf), 1)] = 1.0
    assert np.abs(x - nearest).max() > 0.1


def test_two_by_two_closed_forms():
    """Problem 0: source 0 (100/s) is near cell 0 (cap 0.9 * 80 = 72): 72 stay, 28 spill
    to cell 1; source 1 (10/s) stays local. Latency 72(.01) + 28(.05) + 10(.01) = 2.22.

    Problem 1: both sources prefer cell 0; source 0 loses .04 s per spilled request,
    source 1 only .01, so source 1 spills: x = [[1, 0], [22/50, 28/50]], latency
    50(.01) + 22(.02) + 28(.03) = 1.78 (a greedy first-come rule would get this wrong).

    Problem 2: cap 1, cell 0 takes its full 80/s; source 1 may not use cell 0
    (disallowed) although it is nearer: x = [[0.8, 0.2], [0, 1]].
    """
    lam = np.array([[100.0, 10.0], [50.0, 50.0], [100.0, 10.0]])
    mu = np.array([[80.0, 100.0], [80.0, 1000.0], [80.0, 100.0]])
    tau = np.array(
        [
            [[0.01, 0.05], [0.05, 0.01]],
            [[0.01, 0.05], [0.02, 0.03]],
            [[0.01, 0.05], [0.001, 0.01]],
        ]
    )
    al = np.ones((3, 2, 2), bool)
    al[2, 1, 0] = False
    x, info = mnlb_weights(lam, tau, al, mu, utilisation_cap=np.array([0.9, 0.9, 1.0]))
    want = np.array(
        [[[0.72, 0.28], [0.0, 1.0]], [[1.0, 0.0], [0.44, 0.56]], [[0.8, 0.2], [0.0, 1.0]]]
    )
    np.testing.assert_allclose(np.asarray(x), want, atol=1e-10)
    np.testing.assert_allclose(np.asarray(info.latency)[:2], [2.22, 1.78], rtol=1e-10)
    np.testing.assert_allclose(np.asarray(info.load)[:2], [[72.0, 38.0], [72.0, 28.0]], rtol=1e-10)
    np.testing.assert_array_equal(np.asarray(info.theta), [0.9, 0.9, 1.0])
    assert not np.any(np.asarray(info.overloaded))
    assert np.all(np.asarray(info.status) == 0)


# ----------------------------------------------------------------------------------------
# Infeasible demand: the elastic program
# ----------------------------------------------------------------------------------------


def test_overload_spreads_in_proportion_to_capacity():
    """All arcs allowed, demand 40 > 0.9 * 40: every cell ends at utilisation
    40/40 = 1 (theta = 1), overflow 40 - 36 = 4, split (1, 2, 1) as the capacities."""
    lam = np.array([[30.0, 5.0, 5.0]])
    mu = np.array([[10.0, 20.0, 10.0]])
    tau = np.array([[[0.01, 0.02, 0.03], [0.02, 0.01, 0.02], [0.03, 0.02, 0.01]]])
    al = np.ones((1, 3, 3), bool)
    x, info = mnlb_weights(lam, tau, al, mu)
    np.testing.assert_allclose(np.asarray(info.load)[0], [10.0, 20.0, 10.0], rtol=1e-10)
    np.testing.assert_allclose(float(info.theta[0]), 1.0, rtol=1e-10)
    np.testing.assert_allclose(float(info.overflow[0]), 4.0, rtol=1e-9)
    np.testing.assert_allclose(np.asarray(info.cell_overflow)[0], [1.0, 2.0, 1.0], rtol=1e-9)
    assert bool(info.overloaded[0]) and int(info.status[0]) == 0
    s, O, L = highs_lexicographic(lam[0], tau[0], al[0], mu[0], 0.9)
    assert abs(float(info.latency[0]) - L) <= 1e-7 * L
    check_routing(x, lam, al)


def test_overload_keeps_other_cells_under_the_cap():
    """Source 0 (12/s) may only use cell 0 (capacity 10): theta = 1.2, overflow 3 there.
    Source 1 (15/s) reaches cells 1 (near, capacity 10) and 2 (far, capacity 100): the
    total-overflow level keeps cell 1 at its cap 9 and sends 6 to cell 2, x_1 = (0, .6, .4)
    (a single raised cap of 1.2 would have put 12 on cell 1). Source 2 has no demand:
    its row is its nearest allowed cell, cell 1."""
    lam = np.array([[12.0, 15.0, 0.0]])
    mu = np.array([[10.0, 10.0, 100.0]])
    tau = np.array([[[0.01, 0.0, 0.0], [0.0, 0.01, 0.05], [0.03, 0.02, 0.04]]])
    al = np.array([[[True, False, False], [False, True, True], [True, True, True]]])
    x, info = mnlb_weights(lam, tau, al, mu)
    want = np.array([[1.0, 0.0, 0.0], [0.0, 0.6, 0.4], [0.0, 1.0, 0.0]])
    np.testing.assert_allclose(np.asarray(x)[0], want, atol=1e-9)
    np.testing.assert_allclose(float(info.theta[0]), 1.2, rtol=1e-10)
    np.testing.assert_allclose(np.asarray(info.cell_overflow)[0], [3.0, 0.0, 0.0], atol=1e-8)


def test_overload_matches_lexicographic_highs():
    """Random restricted networks at utilisation 0.8-1.3 of capacity: (s*, total
    overflow, latency) equal the three-stage HiGHS reference; loads stay under theta."""
    lam, tau, al, mu = random_batch(100, 0.8, 1.3, p_allowed=0.4)
    x, info = mnlb_weights(lam, tau, al, mu)
    x = np.asarray(x)
    assert np.all(np.asarray(info.status) == 0)
    assert np.sum(np.asarray(info.overloaded)) >= B // 2
    for b in range(B):
        s, O, L = highs_lexicographic(lam[b], tau[b], al[b], mu[b], 0.9)
        assert abs(float(info.theta[b]) - (0.9 + s)) <= 1e-9
        assert abs(float(info.overflow[b]) - O) <= 1e-9 * lam[b].sum()
        assert abs(float(info.latency[b]) - L) <= 1e-7 * L
        load = (lam[b][:, None] * x[b]).sum(0)
        assert np.all(load <= float(info.theta[b]) * mu[b] * (1 + 1e-9))
    check_routing(x, lam, al)


# ----------------------------------------------------------------------------------------
# Batching and padding
# ----------------------------------------------------------------------------------------


def test_padded_equals_unpadded():
    """Problems of 3 cells solved one by one, and embedded at random positions of 8 cells
    (padding filled with junk rates, capacities and arcs) in one batch, agree; padded
    rows and columns of x are zero."""
    n = 3
    lam, tau, al, mu = random_batch(7, 0.5, 1.1, p_allowed=0.6, n=n, b=B)
    rng = np.random.default_rng(8)
    P = np.zeros((B, n), int)
    lamP, muP = rng.uniform(1, 50, (B, N)), rng.uniform(0, 50, (B, N))
    tauP, alP = rng.uniform(0, 1, (B, N, N)), np.ones((B, N, N), bool)
    mask = np.zeros((B, N), bool)
    for b in range(B):
        pos = np.sort(rng.choice(N, n, replace=False))
        P[b] = pos
        mask[b, pos] = True
        lamP[b, pos], muP[b, pos] = lam[b], mu[b]
        tauP[b][np.ix_(pos, pos)], alP[b][np.ix_(pos, pos)] = tau[b], al[b]
    x8, info8 = mnlb_weights(lamP, tauP, alP, muP, cell_mask=mask)
    x8 = np.asarray(x8)
    for b in range(B):
        x3, info3 = mnlb_weights(lam[b : b + 1], tau[b : b + 1], al[b : b + 1], mu[b : b + 1])
        pos = P[b]
        np.testing.assert_allclose(x8[b][np.ix_(pos, pos)], np.asarray(x3)[0], atol=1e-8)
        assert np.all(x8[b][~mask[b]] == 0) and np.all(x8[b][:, ~mask[b]] == 0)
        np.testing.assert_allclose(float(info8.latency[b]), float(info3.latency[0]), rtol=1e-10)
        np.testing.assert_allclose(float(info8.theta[b]), float(info3.theta[0]), rtol=1e-10)
    assert np.sum(np.asarray(info8.overloaded)) >= 2  # both regimes are exercised


def test_batch_axes_and_vmap(feasible):
    """Leading axes (3, 4) give the flat answers; an outer jax.vmap gives the same."""
    import jax

    lam, tau, al, mu, x, info = feasible
    r = lambda a: a.reshape((3, 4) + a.shape[1:])
    x2, info2 = mnlb_weights(r(lam), r(tau), r(al), r(mu))
    assert x2.shape == (3, 4, N, N) and info2.theta.shape == (3, 4)
    np.testing.assert_allclose(np.asarray(x2).reshape(x.shape), x, atol=1e-13)
    xv, _ = jax.vmap(mnlb_weights)(lam, tau, al, mu)
    np.testing.assert_allclose(np.asarray(xv), x, atol=1e-10)


def test_no_demand_and_zero_capacity_cell():
    """No demand at all: every row is its nearest allowed cell with capacity (cell 1 has
    none, so source 1 goes to its next nearest); nothing overflows."""
    tau = np.array([[0.01, 0.02, 0.05], [0.03, 0.01, 0.02], [0.05, 0.02, 0.01]])
    x, info = mnlb_weights(np.zeros(3), tau, np.ones((3, 3), bool), np.array([5.0, 0.0, 5.0]))
    np.testing.assert_array_equal(np.asarray(x), [[1, 0, 0], [0, 0, 1], [0, 0, 1]])
    assert float(info.overflow) == 0.0 and int(info.status) == 0


# ----------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------


def _ok():
    return np.ones(2), np.full((2, 2), 0.01), np.ones((2, 2), bool), np.full(2, 3.0)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: (np.array([1.0, -1.0]),) + a[1:], r"arrival_rates\[1\] = -1.0 .*>= 0"),
        (lambda a: a[:3] + (np.array([3.0, np.nan]),), r"capacity\[1\] = nan .*finite"),
        (lambda a: (a[0], np.array([[0.01, -2.0], [0.0, 0.0]])) + a[2:], r"latency\[0, 1\]"),
        (
            lambda a: (a[0], np.ones((2, 3))) + a[2:],
            r"latency has shape \(2, 3\).*\(\.\.\., 2, 2\)",
        ),
        (lambda a: a[:3] + (np.ones(3),), r"capacity has shape \(3,\)"),
        (lambda a: a[:2] + (np.ones((2, 2)),) + a[3:], r"allowed has dtype float64.*bool"),
        (
            lambda a: a[:2] + (np.array([[False, False], [True, True]]),) + a[3:],
            r"arrival_rates\[0\] = 1.0 .*no allowed arc",
        ),
    ],
)
def test_bad_input(change, match):
    with pytest.raises(ValueError, match=match):
        mnlb_weights(*change(_ok()))


@pytest.mark.parametrize("cap", [0.0, 1.5, -0.2])
def test_bad_cap(cap):
    with pytest.raises(ValueError, match=rf"utilisation_cap = {cap!r} is invalid.*\(0, 1\]"):
        mnlb_weights(*_ok(), utilisation_cap=cap)


def test_batch_shapes_must_broadcast():
    lam, tau, al, mu = _ok()
    with pytest.raises(ValueError, match="do not broadcast"):
        mnlb_weights(np.ones((3, 2)), np.ones((4, 2, 2)) * 0.01, al, mu)
