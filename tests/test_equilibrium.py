"""Equilibria (RIF, Wardrop, social optimum): closed forms, an independent cvxpy solver,
certificates, batching, recompilation, sensitivities and the long-run dynamics.

Closed forms are theory/equilibria.md §4 A, B, C, E, F, each derived there.
Every small scenario here has at most 4 cells and both service laws (`helpers.both_laws`),
so unbatched calls and batches of up to 8 share one compiled solver per cost (see `_bucket`,
`_batch_bucket`).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from cvxpy_reference import cvxpy_solve
from helpers import both_laws

import dlbfluid as dl
from dlbfluid import _equilibrium as eqm
from dlbfluid._equilibrium import (
    EQ_STATUS,
    EquilibriumError,
    price_of_anarchy,
    solve_equilibrium,
)
from dlbfluid._equilibrium.sensitivities import equilibrium_sensitivities

COSTS = ("rif", "latency", "gradient")


# ----------------------------------------------------------------------------------------
# Scenario builders (M/M/1: mu(N) = c N/(1+N), latency (1+N)/c, N = z/(c-z))
# ----------------------------------------------------------------------------------------


def mm1(c):
    return {"model": "mm1", "capacity": c}


def cell(name, lam, svc, k=1):
    return {"name": name, "arrival_rate": lam, "replicas": k, "service": svc}


def scn(cells, latency):
    """The scenario, built for both service laws (`helpers.both_laws`): the M/M/1-only
    cases share the compiled solver of the mixed ones."""
    return both_laws({"name": "t", "cells": cells, "latency": latency})


def case_a(lam=1.5, mu=(2.0, 1.0), k=(1, 1)):
    """§4 A: one origin (cell 0), two M/M/1 cells, no network latency."""
    return scn(
        [cell("fast", lam, mm1(mu[0]), k[0]), cell("slow", 0.0, mm1(mu[1]), k[1])],
        [[0.0, 0.0], [None, 0.0]],
    )


def case_b(lam=0.5, g=0.5):
    """§4 B: local cell and an identical remote cell at round trip g = 2 tau."""
    return scn(
        [cell("local", lam, mm1(1.0)), cell("remote", 0.0, mm1(1.0))], [[0.0, g / 2], [None, 0.0]]
    )


def case_c(residency=False):
    """§4 C: two origins with offload, tau = 0.1 both ways."""
    return scn(
        [cell("one", 0.9, mm1(1.0)), cell("two", 0.3, mm1(1.0))],
        [[0.0, None if residency else 0.1], [0.1, 0.0]],
    )


def case_e(lam, M=1e6):
    """§4 E: local M/M/1 (u = 1) and a huge remote M/M/1 (capacity M) whose round trip
    makes its zero-load cost equal the local Wardrop latency 1/(1 - lam)."""
    g = 1.0 / (1.0 - lam) - 1.0 / M
    return scn(
        [cell("local", lam, mm1(1.0)), cell("remote", 0.0, mm1(M))], [[0.0, g / 2], [None, 0.0]]
    )


def case_f(g):
    """§4 F: two identical M/M/1 cells, all demand (0.2) at cell 0, round trip g."""
    return scn(
        [cell("one", 0.2, mm1(1.0), 2), cell("two", 0.0, mm1(1.0), 2)], [[0.0, g / 2], [None, 0.0]]
    )


def softplus(cap, L0, knee, width):
    return {"model": "softplus", "capacity": cap, "base_latency": L0, "knee": knee, "width": width}


THREE = {
    "name": "three",
    "cells": [
        cell("a", 2.0, softplus(4.0, 1.0, 2.0, 1.0), 3),
        cell("b", 1.0, softplus(3.0, 0.6, 1.0, 0.5), 2),
        cell("c", 1.5, mm1(3.0), 2),
    ],
    "latency": [[0.0, 0.03, 0.11], [0.03, 0.0, 0.07], [0.11, 0.07, 0.0]],
}


def heavy_residency(load=0.99):
    """Four heterogeneous cells at `load` of total capacity with two forbidden arcs."""
    caps = np.array([4.0, 3.0, 2.0, 5.0])
    lam = load * caps.sum() * np.array([0.4, 0.3, 0.2, 0.1])
    cells = [
        cell("a", lam[0], softplus(4.0, 1.0, 2.0, 1.0), 3),
        cell("b", lam[1], softplus(3.0, 0.6, 1.0, 0.5), 2),
        cell("c", lam[2], mm1(2.0), 1),
        cell("d", lam[3], mm1(5.0), 4),
    ]
    lat = [
        [0.0, 0.02, 0.05, None],
        [0.02, 0.0, None, 0.04],
        [0.05, 0.08, 0.0, 0.01],
        [0.03, 0.04, 0.01, 0.0],
    ]
    return scn(cells, lat)


def random_mm1(rng, n=4, load=0.8):
    """A random M/M/1 network with some forbidden arcs (each source keeps its own cell)."""
    caps = rng.uniform(1.0, 5.0, n)
    lam = load * caps.sum() * rng.dirichlet(np.ones(n))
    cells = [
        cell(f"c{j}", float(lam[j]), mm1(float(caps[j])), int(rng.integers(1, 5))) for j in range(n)
    ]
    lat = [
        [
            0.0 if i == j else (None if rng.random() < 0.25 else float(rng.uniform(0, 0.3)))
            for j in range(n)
        ]
        for i in range(n)
    ]
    d = {"name": "r", "cells": cells, "latency": lat}
    try:
        return both_laws(d), d
    except dl.OverloadError:
        return random_mm1(rng, n, load)


# ----------------------------------------------------------------------------------------
# Closed forms (theory/equilibria.md §4)
# ----------------------------------------------------------------------------------------


def test_parallel_mm1_wardrop_and_square_root_rule():
    """§4 A: Wardrop z1 = (lam + mu1 - mu2)/2, both latencies 2/(mu1 + mu2 - lam); social
    optimum by the square-root rule; RIF with k = (2, 1) equalises N/k."""
    s = case_a()
    w = solve_equilibrium(s, "latency")
    np.testing.assert_allclose(w.z, [1.25, 0.25], rtol=1e-12)
    np.testing.assert_allclose(w.N, [5 / 3, 1 / 3], rtol=1e-12)
    assert float(w.mean_latency) == pytest.approx(4 / 3, rel=1e-12)
    np.testing.assert_allclose(w.multipliers[0], 4 / 3, rtol=1e-12)
    o = solve_equilibrium(s, "gradient")
    sq = (3.0 - 1.5) / (math.sqrt(2.0) + 1.0)
    z_opt = np.array([2.0 - math.sqrt(2.0) * sq, 1.0 - sq])
    np.testing.assert_allclose(o.z, z_opt, rtol=1e-12)
    np.testing.assert_allclose(o.N, z_opt / (np.array([2.0, 1.0]) - z_opt), rtol=1e-12)
    assert float(o.social_cost) == pytest.approx(1.8856181, abs=1e-7)
    assert float(o.multipliers[0]) == pytest.approx(2.5904121, abs=1e-7)  # marginal cost
    r = solve_equilibrium(case_a(k=(2, 1)), "rif")
    np.testing.assert_allclose(r.N, [1.2573340, 0.6286670], atol=1e-7)
    assert float(r.N[0]) == pytest.approx(2 * float(r.N[1]), rel=1e-12)
    assert float(w.social_cost / o.social_cost) == pytest.approx(1.0606602, abs=1e-7)


def test_thresholds_of_the_slow_cell():
    """§4 A thresholds: the optimum uses the slow cell iff lam > mu1 - sqrt(mu1 mu2)
    (0.5858 here), Wardrop iff lam > mu1 - mu2 = 1."""
    for lam, used_opt, used_we in ((0.5, False, False), (0.8, True, False), (1.2, True, True)):
        s = case_a(lam=lam)
        o = solve_equilibrium(s, "gradient")
        w = solve_equilibrium(s, "latency")
        assert (float(o.z[1]) > 1e-9) == used_opt
        assert (float(w.z[1]) > 1e-9) == used_we
        # An unused cell is a certificate too: its cost is at least the multiplier.
        assert float(o.slackness_min_allowed) >= -1e-12
        assert float(w.slackness_min_allowed) >= -1e-12


def test_local_versus_remote_with_network_latency():
    """§4 B: Wardrop 1/(1-z_l) = 1/(1-z_r) + g, optimum 1/(1-z_l)^2 = 1/(1-z_r)^2 + g."""
    s = case_b()
    w = solve_equilibrium(s, "latency")
    o = solve_equilibrium(s, "gradient")
    np.testing.assert_allclose(w.z, [0.3860009, 0.1139991], atol=1e-7)
    np.testing.assert_allclose(o.z, [0.3022242, 0.1977758], atol=1e-7)
    zl, zr = np.asarray(w.z)
    assert 1 / (1 - zl) == pytest.approx(1 / (1 - zr) + 0.5, rel=1e-12)
    zl, zr = np.asarray(o.z)
    assert 1 / (1 - zl) ** 2 == pytest.approx(1 / (1 - zr) ** 2 + 0.5, rel=1e-12)
    assert float(w.mean_latency) == pytest.approx(1.6286670, abs=1e-7)
    assert float(w.multipliers[0]) == pytest.approx(1.6286670, abs=1e-7)
    assert float(o.social_cost) == pytest.approx(0.7785473, abs=1e-7)
    assert float(o.multipliers[0]) == pytest.approx(2.0538477, abs=1e-7)
    assert float(w.social_cost / o.social_cost) == pytest.approx(1.0459653, abs=1e-7)


def test_two_origins_offload_and_residency():
    """§4 C, and the residency variant with arc (1, 2) removed: x12 = 0, z = (0.9, 0.3)."""
    s = case_c()
    o = solve_equilibrium(s, "gradient")
    w = solve_equilibrium(s, "latency")
    assert float(o.x[0, 1]) == pytest.approx(0.3297782, abs=1e-7)
    assert float(o.x[1, 0]) == 0.0
    np.testing.assert_allclose(o.z, [0.6031996, 0.5968004], atol=1e-7)
    assert float(o.social_cost) == pytest.approx(3.059680, abs=1e-6)
    assert float(w.x[0, 1]) == pytest.approx(0.3155839, abs=1e-7)
    np.testing.assert_allclose(w.z, [0.6159745, 0.5840255], atol=1e-7)
    assert float(w.social_cost) == pytest.approx(3.064792, abs=1e-6)
    for cost in COSTS:
        r = solve_equilibrium(case_c(residency=True), cost)
        assert float(r.x[0, 1]) == 0.0
        np.testing.assert_allclose(r.z, [0.9, 0.3], rtol=1e-13)


def test_price_of_anarchy_large_near_capacity():
    """§4 E tight instance at 99% load: Wardrop keeps everything local (total
    lam/(1-lam) = 99) while the optimum offloads, PoA -> (1 + sqrt(1/(1-lam)))/2 = 5.5
    as the remote capacity M -> infinity. The exact optimum for finite M is the root of
    the marginal-cost balance, solved here independently by bisection."""
    lam, M = 0.99, 1e6
    s = case_e(lam, M)
    poa = price_of_anarchy(s)
    we = poa["equilibria"]["latency"]
    assert float(we.z[1]) == pytest.approx(0.0, abs=1e-9)
    assert float(we.social_cost) == pytest.approx(lam / (1 - lam), rel=1e-9)
    g = 1 / (1 - lam) - 1 / M
    lo, hi = 0.0, lam  # local flow t: 1/(1-t)^2 = M/(M-(lam-t))^2 + g
    for _ in range(200):
        t = 0.5 * (lo + hi)
        if 1 / (1 - t) ** 2 > M / (M - (lam - t)) ** 2 + g:
            hi = t
        else:
            lo = t
    t = 0.5 * (lo + hi)
    opt = t / (1 - t) + (lam - t) / (M - (lam - t)) + g * (lam - t)
    assert float(poa["equilibria"]["gradient"].social_cost) == pytest.approx(opt, rel=1e-10)
    assert float(poa["latency"]) == pytest.approx(lam / (1 - lam) / opt, rel=1e-10)
    assert float(poa["latency"]) == pytest.approx(5.5, abs=2e-3)


@pytest.mark.parametrize("g, ratio", [(1.0, 1.2889), (10.0, 4.8889), (100.0, 40.889)])
def test_rif_ignores_network_latency(g, ratio):
    """§4 F: RIF equalises N, z = (0.1, 0.1), total 2(0.1/0.9) + 0.1 g; the optimum keeps
    everything local (total 0.25) once g >= 1/(1-lam)^2 - 1."""
    p = price_of_anarchy(case_f(g))
    np.testing.assert_allclose(p["equilibria"]["rif"].z, [0.1, 0.1], rtol=1e-12)
    assert float(p["equilibria"]["rif"].social_cost) == pytest.approx(2 / 9 + 0.1 * g, rel=1e-12)
    assert float(p["equilibria"]["gradient"].social_cost) == pytest.approx(0.25, rel=1e-12)
    assert float(p["rif"]) == pytest.approx((2 / 9 + 0.1 * g) / 0.25, rel=1e-12)
    assert float(p["rif"]) == pytest.approx(ratio, abs=1e-3)  # the rounded table of theory/equilibria.md §4 F


# ----------------------------------------------------------------------------------------
# Certificates
# ----------------------------------------------------------------------------------------


def catalogue():
    return [
        case_a(),
        case_a(lam=0.5),
        case_a(k=(2, 1)),
        case_b(),
        case_c(),
        case_c(True),
        case_e(0.99),
        case_e(0.37),  # Wardrop degenerate: the unused remote arc has zero reduced cost
        case_e(0.75),
        case_f(10.0),
        dl.scenario_from_dict(THREE),
        heavy_residency(0.99),
        heavy_residency(0.9),
        dl.default_scenario(),
    ]


@pytest.mark.parametrize("cost", COSTS)
def test_kkt_residual_on_the_catalogue(cost):
    """KKT residual <= 1e-10 on every catalogue entry, including 99% load with residency
    restrictions; the certificate pieces are consistent with it."""
    for s in catalogue():
        e = solve_equilibrium(s, cost)
        assert int(e.status) == EQ_STATUS["success"]
        assert float(e.kkt_residual) <= 1e-10, (s.cell_names, float(e.kkt_residual))
        cbar = float(np.max(np.abs(e.multipliers)))
        assert float(e.slackness_max_used) <= 1e-10 * cbar
        assert float(e.slackness_min_allowed) >= -1e-10 * cbar
        assert float(e.flow_residual) <= 1e-12
        assert float(e.duality_gap) <= 1e-9 * float(e.objective + 1.0)
        x = np.asarray(e.x)
        allowed = np.asarray(s.allowed)
        assert np.all(x >= 0) and np.all(x[~allowed] == 0)
        np.testing.assert_allclose(x.sum(axis=1), 1.0, rtol=1e-13)
        assert np.all(np.asarray(e.z) < np.asarray(s.service.capacity))
        np.testing.assert_allclose(s.service.rate(e.N), e.z, rtol=1e-12, atol=1e-14)


def test_certificate_rejects_a_wrong_routing():
    """The certificate of a non-equilibrium routing (weighted random) is far from zero, so
    a small residual on solver output means something."""
    s = dl.scenario_from_dict(THREE)
    pb = eqm._make_problem(s, s.arrival_rate(0.0), "latency")
    y = np.asarray(s.arrival_rate(0.0))[:, None] * dl.weighted_random_routing(s.allowed, s.replicas)
    cert = jax.jit(lambda yy: eqm._certify(pb, yy, None))(y)
    assert float(cert["kkt_residual"]) > 1e-2
    assert float(cert["duality_gap"]) > 1e-3


# ----------------------------------------------------------------------------------------
# Independent reference: cvxpy + Clarabel on M/M/1 networks (potentials: theory/equilibria.md §1.2)
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("cost", COSTS)
def test_random_networks_match_cvxpy(cost):
    rng = np.random.default_rng(11)
    pairs = [
        random_mm1(rng, n=int(rng.integers(2, 5)), load=float(rng.uniform(0.5, 0.95)))
        for _ in range(6)
    ]
    pytest.importorskip("cvxpy")
    batch = dl.stack_scenarios([p[0] for p in pairs], n_cells=4)
    sol = solve_equilibrium(batch, cost)
    assert np.all(np.asarray(sol.status) == 0)
    for b, (s, d) in enumerate(pairs):
        n = s.n_cells
        z, N, obj = cvxpy_solve(d, cost)
        # Clarabel agrees to ~1e-6 in z at its tightest settings (checked by hand on the
        # two-cell cases, where the Wardrop/marginal-cost balance shows ours is the exact
        # one); N = z/(c - z) amplifies z errors by c/(c - z).
        np.testing.assert_allclose(sol.z[b, :n], z, rtol=1e-5, atol=1e-8)
        np.testing.assert_allclose(sol.N[b, :n], N, rtol=1e-4, atol=1e-8)
        assert float(sol.objective[b]) == pytest.approx(obj, rel=1e-8, abs=1e-10)


def test_softplus_potentials_against_quadrature():
    """p_j(z) = int_0^z f_j(mu^-1(s)) ds for softplus cells, checked by adaptive quadrature
    in flow space with an independent numpy model (theory/service.md) and scipy root finding,
    for the latency and RIF costs."""
    from scipy.integrate import quad
    from scipy.optimize import brentq

    s = dl.scenario_from_dict(THREE)
    for j, (cap, L0, knee, width) in enumerate([(4.0, 1.0, 2.0, 1.0), (3.0, 0.6, 1.0, 0.5)]):
        k = float(s.replicas[j])

        def ell(N, cap=cap, L0=L0, knee=knee, width=width):
            return L0 + width / cap * np.logaddexp(0.0, (N - knee) / width)

        def inv(zz, ell=ell):
            return brentq(lambda N: N / ell(N) - zz, 0.0, 1e7, xtol=1e-15, rtol=1e-15)

        for frac in (0.3, 0.9, 0.99):
            z = frac * cap
            N = inv(z)
            zv, Nv = np.zeros(3), np.zeros(3)
            zv[j], Nv[j] = z, N
            for cost, f in (("latency", ell), ("rif", lambda M, k=k: M / k)):
                ref, _ = quad(
                    lambda t, f=f: f(inv(t)), 0.0, z, epsabs=1e-13, epsrel=1e-12, limit=200
                )
                got = float(eqm.potential(cost, s, zv, Nv)[j])
                assert got == pytest.approx(ref, rel=1e-11)


# ----------------------------------------------------------------------------------------
# Batching, recompilation, failures, overload
# ----------------------------------------------------------------------------------------


def test_batch_equals_loop_and_no_recompile():
    """A padded batch equals a loop of unpadded solves; a second call with new values of
    the same shapes does not trace again."""
    rng = np.random.default_rng(5)
    scns = [random_mm1(rng, n=int(rng.integers(2, 5)))[0] for _ in range(5)]
    batch = dl.stack_scenarios(scns, n_cells=4)
    sol = solve_equilibrium(batch, "latency")
    for b, s in enumerate(scns):
        one = solve_equilibrium(s, "latency")
        n = s.n_cells
        np.testing.assert_allclose(sol.N[b, :n], one.N, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(sol.z[b, :n], one.z, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(sol.x[b, :n, :n], one.x, rtol=1e-10, atol=1e-12)
        assert np.all(np.asarray(sol.N[b, n:]) == 0) and np.all(np.asarray(sol.x[b, n:]) == 0)
    before = eqm._TRACES["latency"]
    batch2 = eqx.tree_at(lambda s: s.arrival_rates, batch, batch.arrival_rates * 0.9)
    sol2 = solve_equilibrium(batch2, "latency")
    single2 = solve_equilibrium(case_b(lam=0.3), "latency")
    assert eqm._TRACES["latency"] == before
    assert np.all(np.asarray(sol2.z).sum(axis=1) < np.asarray(sol.z).sum(axis=1))
    assert float(single2.z.sum()) == pytest.approx(0.3, rel=1e-13)


def test_one_program_for_every_mix_of_built_in_laws():
    """An M/M/1-only scenario is solved with service tables that evaluate both built-in
    laws (`api._widen`): the program of a mixed scenario of its shape, no new trace, and
    bitwise the answer of the explicitly widened scenario."""
    from helpers import LAWS, two_mm1

    s = dl.scenario_from_dict(two_mm1(tau=0.1))
    assert s.service.laws == ("mm1",)
    ref = solve_equilibrium(dl.pad_scenario(s, 2, laws=LAWS, est_laws=LAWS), "latency")
    before = eqm._TRACES["latency"]
    one = solve_equilibrium(s, "latency")
    assert eqm._TRACES["latency"] == before  # (an M/M/1-only program would be traced here)
    for f in ("N", "z", "x", "multipliers", "kkt_residual", "iterations"):
        np.testing.assert_array_equal(np.asarray(getattr(one, f)), np.asarray(getattr(ref, f)))


def test_non_convergence_is_a_status_not_a_crash():
    rng = np.random.default_rng(6)
    batch = dl.stack_scenarios([random_mm1(rng)[0] for _ in range(3)], n_cells=4)
    sol = solve_equilibrium(batch, "gradient", max_iters=1)
    st = np.asarray(sol.status)
    assert st.shape == (3,) and np.all(st == EQ_STATUS["not_converged"])
    assert np.all(np.isfinite(np.asarray(sol.N)))
    assert list(sol.status_names()) == ["not_converged"] * 3
    with pytest.raises(EquilibriumError, match="did not reach"):
        solve_equilibrium(heavy_residency(0.99), "gradient", max_iters=1)


def test_overloaded_demand_names_cells_and_sources():
    d = {
        "name": "over",
        "cells": [cell("eu", 3.0, mm1(2.0)), cell("us", 0.5, mm1(2.0))],
        "latency": [[0.0, None], [0.1, 0.0]],
    }
    s = dl.scenario_from_dict(d, allow_overload=True)
    with pytest.raises(dl.OverloadError, match="eu") as info:
        solve_equilibrium(s, "gradient")
    assert info.value.cells == ["eu"] and info.value.sources == ["eu"]
    batch = dl.stack_scenarios([case_b(), s])
    with pytest.raises(dl.OverloadError, match="scenario 1"):
        solve_equilibrium(batch, "gradient")


def test_bad_options_raise():
    with pytest.raises(ValueError, match="cost"):
        solve_equilibrium(case_b(), "fastest")
    with pytest.raises(ValueError, match="tol"):
        solve_equilibrium(case_b(), "rif", tol=-1.0)
    with pytest.raises(ValueError, match="max_iters"):
        solve_equilibrium(case_b(), "rif", max_iters=0)


def test_summary_record():
    e = solve_equilibrium(case_c(), "latency")
    rec = e.summary()
    assert rec["cost"] == "latency" and rec["status"] == "success"
    assert rec["cells"] == ["one", "two"]
    assert len(rec["x"]) == 2 and len(rec["multipliers"]) == 2
    assert rec["social_cost"] == pytest.approx(3.064792, abs=1e-6)


# ----------------------------------------------------------------------------------------
# Sensitivities against central finite differences
# ----------------------------------------------------------------------------------------


def _fd(s, cost, edit, h):
    plus = solve_equilibrium(edit(s, +h), cost)
    minus = solve_equilibrium(edit(s, -h), cost)
    return (
        (float(plus.mean_latency) - float(minus.mean_latency)) / (2 * h),
        (np.asarray(plus.N) - np.asarray(minus.N)) / (2 * h),
    )


def test_sensitivities_social_optimum_match_finite_differences():
    s = dl.scenario_from_dict(THREE)
    S = equilibrium_sensitivities(s, "gradient")
    h = 1e-5
    for j in range(3):

        def cap(sc, d, j=j):
            return eqx.tree_at(lambda t: t.service.capacity, sc, sc.service.capacity.at[j].add(d))

        def lam(sc, d, j=j):
            return eqx.tree_at(lambda t: t.arrival_rates, sc, sc.arrival_rates.at[j].add(d))

        ml, dN = _fd(s, "gradient", cap, h)
        assert S["d_mean_latency_d_capacity"][j] == pytest.approx(ml, rel=1e-6, abs=1e-9)
        np.testing.assert_allclose(S["dN_d_capacity"][:, j], dN, rtol=1e-5, atol=1e-8)
        ml, dN = _fd(s, "gradient", lam, h)
        assert S["d_mean_latency_d_arrival_rate"][j] == pytest.approx(ml, rel=1e-6, abs=1e-9)
        np.testing.assert_allclose(S["dN_d_arrival_rate"][:, j], dN, rtol=1e-5, atol=1e-8)
    for i, j in ((0, 1), (1, 2), (0, 0)):

        def lat(sc, d, i=i, j=j):
            return eqx.tree_at(lambda t: t.latency, sc, sc.latency.at[i, j].add(d))

        ml, dN = _fd(s, "gradient", lat, h)
        assert S["d_mean_latency_d_latency"][i, j] == pytest.approx(ml, rel=1e-6, abs=1e-9)
        np.testing.assert_allclose(S["dN_d_latency"][:, i, j], dN, rtol=1e-5, atol=1e-8)
    # Envelope theorem for the optimal value V = Lambda L: dV/dlam_i = nu_i, dV/dtau = 2y.
    Lam = float(np.sum(s.arrival_rate(0.0)))
    dV = Lam * S["d_mean_latency_d_arrival_rate"] + S["mean_latency"]
    np.testing.assert_allclose(dV, S["multipliers"], rtol=1e-9)
    y = np.asarray(s.arrival_rate(0.0))[:, None] * np.asarray(S["solution"].x)
    np.testing.assert_allclose(Lam * S["d_mean_latency_d_latency"], 2 * y, rtol=1e-9, atol=1e-12)


def test_sensitivities_wardrop_and_rif():
    """Wardrop: mean latency and N against finite differences in tau and capacity. RIF:
    only N (its routing, hence the network part of the latency, is not unique)."""
    s = dl.scenario_from_dict(THREE)
    W = equilibrium_sensitivities(s, "latency")
    h = 1e-5
    for i, j in ((0, 1), (1, 2)):

        def lat(sc, d, i=i, j=j):
            return eqx.tree_at(lambda t: t.latency, sc, sc.latency.at[i, j].add(d))

        ml, dN = _fd(s, "latency", lat, h)
        assert W["d_mean_latency_d_latency"][i, j] == pytest.approx(ml, rel=1e-6)
        np.testing.assert_allclose(W["dN_d_latency"][:, i, j], dN, rtol=1e-5, atol=1e-8)
    R = equilibrium_sensitivities(s, "rif")
    for j in range(3):

        def cap(sc, d, j=j):
            return eqx.tree_at(lambda t: t.service.capacity, sc, sc.service.capacity.at[j].add(d))

        _, dN = _fd(s, "rif", cap, h)
        np.testing.assert_allclose(R["dN_d_capacity"][:, j], dN, rtol=1e-5, atol=1e-8)
        _, dNw = _fd(s, "latency", cap, h)
        np.testing.assert_allclose(W["dN_d_capacity"][:, j], dNw, rtol=1e-5, atol=1e-8)


# ----------------------------------------------------------------------------------------
# Consistency with the dynamics
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cost, policy", [("gradient", "flow-grad"), ("latency", "flow-lat"), ("rif", "flow-rif")]
)
def test_flow_routing_settles_at_the_equilibrium(cost, policy):
    """Three cells (two softplus), unequal delays: the long-run state of flow routing is
    the equilibrium of its cost (stationarity lemma, seed C.1)."""
    s = dl.scenario_from_dict(THREE)
    eq = solve_equilibrium(s, cost)
    # (the standard shape of tests/test_simulate.py: Fast() at this tick, 40 saves)
    sol = dl.simulate(s, policy, step_size=2.0, tick=0.05, horizon=150.0, n_save=40)
    assert float(sol.oscillation()) < 1e-8
    np.testing.assert_allclose(sol.N[-1], eq.N, rtol=1e-5)
    z = np.asarray(s.arrival_rate(0.0)) @ np.asarray(sol.x[-1])
    np.testing.assert_allclose(z, eq.z, rtol=1e-5)


def test_default_scenario_equilibria_ordering():
    """On the built-in network the social optimum has the smallest mean latency."""
    p = price_of_anarchy(dl.default_scenario())
    assert float(p["latency"]) >= 1.0 - 1e-12 and float(p["rif"]) >= 1.0 - 1e-12
    opt = p["equilibria"]["gradient"]
    for c in ("latency", "rif"):
        assert float(p["equilibria"][c].mean_latency) >= float(opt.mean_latency) - 1e-12


def test_profile_time_selects_the_rates():
    d = copy.deepcopy(THREE)
    d["cells"][0]["arrival_rate"] = {"times": [0.0, 10.0], "rates": [1.0, 3.0]}
    s = dl.scenario_from_dict(d)
    e5 = solve_equilibrium(s, "latency", time=5.0)
    assert float(np.sum(e5.z)) == pytest.approx(2.0 + 1.0 + 1.5, rel=1e-13)


def test_mmatrix_factor_serves_several_right_hand_sides():
    """The GTH-factored Schur M-matrix (`_mmatrix_factor`, `_mmatrix_apply`; the predictor
    and corrector of stage 1 share one factorisation) against a dense float64 solve, for
    two right-hand sides at once and one at a time."""
    rng = np.random.default_rng(11)
    n = 6
    off = -rng.uniform(0.1, 1.0, (n, n))
    off = 0.5 * (off + off.T)
    np.fill_diagonal(off, 0.0)
    excess = rng.uniform(1e-3, 1e-2, n)
    S = off + np.diag(excess - off.sum(axis=1))
    b = rng.normal(size=(n, 2))
    ref = np.linalg.solve(S, b)
    A, piv = eqm._mmatrix_factor(jax.numpy.asarray(off), jax.numpy.asarray(excess))
    both = np.asarray(eqm._mmatrix_apply(A, piv, jax.numpy.asarray(b)))
    np.testing.assert_allclose(both, ref, rtol=1e-9, atol=1e-12)
    for k in range(2):
        one = np.asarray(eqm._mmatrix_apply(A, piv, jax.numpy.asarray(b[:, k])))
        np.testing.assert_allclose(one, ref[:, k], rtol=1e-9, atol=1e-12)
    # the residual is at rounding level relative to |S||u|
    res = S @ both - b
    assert np.max(np.abs(res)) <= 1e-12 * np.max(np.abs(S) @ np.abs(both))


# ----------------------------------------------------------------------------------------
# Solvers of their own (last: the programs they add take the worker past the memory limit
# of tests/conftest.py, and the shared per-cost programs above would be traced again after)
# ----------------------------------------------------------------------------------------


def test_failed_early_polish_resumes_the_interior_point():
    """Stage 2 starts early (barrier gap `InteriorPoint.switch_gap`); when that polish fails
    the solver resumes stage 1 from the point it left and polishes again at the full
    barrier gap.

    With the switch forced to a barely centred point (gap 1) and a weak polish (8 undamped
    steps) the early polish alone ends far from the equilibrium (retry disabled:
    `ActiveSetPolish.retry` huge); with the retry the result is certified and equals the
    default solve."""
    s = heavy_residency(0.99)
    ref = solve_equilibrium(s, "gradient")

    # (`retry` an array: one compiled program serves both settings)
    @eqx.filter_jit
    def solve(solver, sc, lam):
        return solver.solve_one(sc, lam, 1e-10, 200, "gradient")

    def run(retry):
        solver = eqm.EquilibriumSolver(
            interior_point=eqm.InteriorPoint(switch_gap=1.0),
            polish=eqm.ActiveSetPolish(retry=jax.numpy.asarray(retry), iters=8, damping=0.0),
        )
        return solve(solver, s.strip(), s.arrival_rate(0.0))

    once = run(1e300)
    assert int(once["status"]) == EQ_STATUS["not_converged"]
    assert float(once["kkt_residual"]) > 1e-6
    again = run(1e-2)
    assert int(again["status"]) == EQ_STATUS["success"]
    assert float(again["kkt_residual"]) <= 1e-10
    assert int(again["iterations"]) > int(once["iterations"])
    np.testing.assert_allclose(np.asarray(again["N"]), np.asarray(ref.N), rtol=1e-10)


def test_compacted_batch_equals_scenario_by_scenario():
    """A batch of at least `compact_min` scenarios (per device) finishes each stage's
    stragglers on compacted sub-batches (`EquilibriumSolver.solve_local`). Every scenario
    must make exactly the passes it makes alone: iteration counts equal those of a plain
    `vmap` of `solve_one`, and the workloads agree to rounding. (The threshold is lowered,
    a field of the solver, so that a small batch is compacted and the solver is traced
    here. The plain `vmap` is the default solver's own program on batches of 8, below its
    threshold: the standard 4-cell program the other tests of this module compile, with
    the solver's own XLA options: other options round differently, and a last-bit
    difference can move a stopping test by one pass.)"""
    solver = eqm.EquilibriumSolver(compact_min=16)
    rng = np.random.default_rng(12)
    scns = [random_mm1(rng, load=float(rng.uniform(0.5, 0.97)))[0] for _ in range(37)]
    scns += [heavy_residency(0.99), heavy_residency(0.9), dl.scenario_from_dict(THREE)]
    batch = dl.stack_scenarios(scns, n_cells=4)
    before = eqm._TRACES["gradient"]
    sol = solve_equilibrium(batch, "gradient", solver=solver)
    assert eqm._TRACES["gradient"] == before + 1  # traced here, with the lowered threshold
    assert np.all(np.asarray(sol.status) == EQ_STATUS["success"])
    assert solver.compact_min <= 40 < eqm.EquilibriumSolver().compact_min
    parts = [
        solve_equilibrium(dl.stack_scenarios(scns[k : k + 8], n_cells=4), "gradient")
        for k in range(0, len(scns), 8)
    ]
    it = np.asarray(sol.iterations)
    np.testing.assert_array_equal(it, np.concatenate([np.asarray(p.iterations) for p in parts]))
    # the batch has stragglers: the compacted levels did run
    assert it.max() - np.median(it) >= 3
    np.testing.assert_allclose(
        np.asarray(sol.N), np.concatenate([np.asarray(p.N) for p in parts]), rtol=1e-12, atol=1e-14
    )
    assert float(np.max(sol.kkt_residual)) <= 1e-10


def test_near_capacity_social_optimum():
    """Two random 10-cell networks at 99.6% and 99.9% of total capacity
    (`benchmarks/equilibrium_near_capacity.py`, seed 7; theory/equilibria.md §3.6) whose
    social optimum the solver used to miss (KKT 7e-2 and 2e-2 after 200 iterations). The
    default solver certifies both to 1e-10; without the stall hand-over, the polish damping
    and its extra passes (the earlier settings) it does not."""
    data = Path(__file__).resolve().parent / "data"
    scns = [dl.load_scenario(data / f"near_capacity_{i}.json") for i in (233, 409)]
    batch = dl.stack_scenarios(scns)
    sol = solve_equilibrium(batch, "gradient")
    assert sol.status_names().tolist() == ["success", "success"]
    assert float(np.max(sol.kkt_residual)) <= 1e-10
    weak = eqm.EquilibriumSolver(
        interior_point=eqm.InteriorPoint(stall_passes=10**6),
        polish=eqm.ActiveSetPolish(iters=8, damping=0.0),
    )
    old = solve_equilibrium(batch, "gradient", solver=weak)
    assert "not_converged" in old.status_names().tolist()
