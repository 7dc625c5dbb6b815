"""The routers' projection check, the descriptive fit of Theorem 1's shape (constants with
the right signs, the empirical eta0), critical step sizes of a whole batch, and verify's
records (theory/lyapunov.md, *The projection check*, *A descriptive fit*; theory/stability.md
§7). Theorem 1's own constants and verdict: tests/test_theorem1_bound.py.

Every batch here has the shape of tests/test_verify.py's chunks (2 scenarios, 3 cells),
so the compiled programs are shared through the run's compilation cache."""

import copy
import json
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import LAWS, THREE, random_scenario, symmetric_pair

import dlbfluid as dl
from dlbfluid._cli import main
from dlbfluid._equilibrium import solve_equilibrium
from dlbfluid._scenario import pad_scenario, scenario_from_dict, stack_scenarios
from dlbfluid._stability import batch_critical_step_size, critical_step_size
from dlbfluid._theorem1 import (
    ESTIMATES,
    delay_share,
    empirical_eta0,
    fit_bound,
    growth_exponent,
    projection_check,
    schedule_constant,
    schedule_slope,
    window_ratio,
)
from dlbfluid._theorem1.lyapunov import fit_theorem1
from dlbfluid._verify import SEARCH_KEYS, verify

KW = dict(chunk=2, n_cells=(2, 3), horizon=20.0, tick=0.1)


def _pairs(dicts, cost):
    """The scenarios two at a time, padded to 3 cells and both laws, with their equilibria
    (each solved alone with both laws: the catalogue's compiled solver of the cost)."""
    out = []
    for k in range(0, len(dicts), 2):
        scns = [scenario_from_dict(d) for d in dicts[k : k + 2]]
        scns += scns[-1:] * (2 - len(scns))
        b = stack_scenarios(scns, n_cells=3, laws=LAWS)
        eqs = [solve_equilibrium(pad_scenario(s, 3, laws=LAWS, est_laws=LAWS), cost)
               for s in scns]  # fmt: skip
        eq = SimpleNamespace(N=np.stack([np.asarray(e.N) for e in eqs]),
                             x=np.stack([np.asarray(e.x) for e in eqs]))  # fmt: skip
        out.append((scns, b, eq))
    return out


@pytest.mark.parametrize(
    "policy, cost, dicts",
    [
        ("flow-grad", "gradient", [THREE, random_scenario(np.random.default_rng(3), 3)]),
        (
            "flow-rif",
            "rif",
            [
                dict(THREE, latency=(np.asarray(THREE["latency"]) * 10).tolist()),
                random_scenario(np.random.default_rng(4), 3, load=0.7, max_tau=0.3),
            ],
        ),
    ],
)
def test_batched_critical_step_size_matches_the_pseudospectral_loop(policy, cost, dicts):
    """The argument-principle bisection polished by Newton (one compiled call per batch)
    against `critical_step_size` (pseudospectral, 16 nodes, 1e-13 bisection), one scenario
    at a time: 1e-9 relative in eta*, 1e-6 in the crossing frequency."""
    ((scns, batch, eq),) = _pairs(dicts, cost)
    got = batch_critical_step_size(batch, policy, eq)
    assert list(got.status_names()) == ["success"] * 2
    for b, s in enumerate(scns):
        n = s.n_cells
        ref = critical_step_size(
            s,
            policy,
            method="pseudospectral",
            equilibrium=SimpleNamespace(N=np.asarray(eq.N)[b, :n], x=np.asarray(eq.x)[b, :n, :n]),
        )
        assert float(got.critical_step_size[b]) == pytest.approx(ref.critical_step_size, rel=1e-9)
        w = float(got.crossing_frequency[b])
        assert w == pytest.approx(ref.crossing_frequency, rel=1e-6)


def test_batched_critical_step_size_special_cases():
    """The symmetric pair against its closed form (theory/stability.md §2) at two delays;
    per-router weights scale eta* as `step_weights` do; no delay on any support arc:
    stable for every step (inf)."""
    ((_, batch, eq),) = _pairs([symmetric_pair(0.5), symmetric_pair(2.0)], "gradient")
    w = np.ones((2, 3))
    w[1, 0] = 2.0  # the second pair's only router steps twice as fast
    got = batch_critical_step_size(batch, "flow-grad", eq, step_weights=w)
    for b, tau in enumerate((0.5, 2.0)):
        closed = dl.symmetric_critical_step_size(0.25, 4.0, 1.0, tau) / (1 + b)
        assert float(got.critical_step_size[b]) == pytest.approx(closed, rel=1e-10)
    d0 = copy.deepcopy(THREE)
    d0["latency"] = [[0.0] * 3] * 3
    ((_, batch, eq),) = _pairs([d0, d0], "gradient")
    assert np.all(np.isinf(np.asarray(batch_critical_step_size(batch, "flow-grad", eq)
                                      .critical_step_size)))  # fmt: skip
    with pytest.raises(ValueError, match="one batch axis"):
        batch_critical_step_size(scenario_from_dict(THREE), "flow-grad", eq)


@pytest.fixture(scope="module")
def three_runs(catalogue_equilibrium):
    s, eq = catalogue_equilibrium("three", "gradient")
    out = {}
    for h in (0.04, 0.02):  # (the runs of tests/test_lyapunov.py: shared compilations)
        sol = dl.simulate(s, "flow-grad", step_size=0.3, tick=h, horizon=20.0, n_save=round(20 / h))
        out[h] = projection_check(sol, s, eq, cost="gradient", step_size=0.3)
    return out


def test_projection_check_holds_and_its_terms_add_up(three_runs):
    """lhs <= rhs + tolerance along flow-grad on the 3-cell network with unequal delays;
    rhs is exactly the sum of its reported terms; the tolerance (the quadrature defect of
    the workload identity) is second order in the tick."""
    for c in three_runs.values():
        assert bool(c.holds)
        t = {k: float(getattr(c, k)) for k in ("routing_start", "workload_start",
             "routing_end", "workload_end", "delay_gap", "mismatch")}  # fmt: skip
        rhs = (t["routing_start"] + t["workload_start"] - t["routing_end"] - t["workload_end"]
               - t["delay_gap"] + t["mismatch"])  # fmt: skip
        assert float(c.rhs) == pytest.approx(rhs, rel=1e-12)
        assert float(c.lhs) > 0 and t["routing_start"] > 0
    tol = [float(three_runs[h].tolerance) for h in (0.04, 0.02)]
    assert np.log(tol[0] / tol[1]) / np.log(2.0) > 1.7


def test_projection_check_discretisation_excess_is_first_order(three_runs):
    """The excess over the continuous-time inequality shrinks like h (measured 0.0129,
    0.0057, 0.0025 at h = 0.04, 0.02, 0.01: order 1.2)."""
    hs = np.array([0.04, 0.02])
    ex = np.array([float(three_runs[h].discretisation_excess) for h in hs])
    assert np.all(ex > 0)
    order = np.log(ex[0] / ex[1]) / np.log(2.0)
    assert 0.8 < order < 1.5
    assert ex[-1] < 0.5 * hs[-1]


def test_projection_check_requires_per_tick_saves(catalogue_equilibrium):
    s, eq = catalogue_equilibrium("three", "gradient")
    # 480 saves of 500 ticks (the 512-save bucket of three_runs' run at h = 0.04: its
    # compiled program)
    sol = dl.simulate(s, "flow-grad", step_size=0.3, tick=0.04, horizon=20.0, n_save=480)
    assert sol.N.shape[0] == 481
    with pytest.raises(ValueError, match="n_save equal to the number of ticks"):
        projection_check(sol, s, eq, cost="gradient", step_size=0.3)


def test_nonnegative_fit_and_verdict():
    """Synthetic data: both fits recover the constants; where the unconstrained fit goes
    negative (no delay term in the data), the non-negative one gives B = 0, and the
    verdict flags a point above the bound."""
    T, eta = np.meshgrid([10.0, 30.0, 100.0, 300.0], [0.03, 0.1, 0.3, 1.0])
    y = 0.7 / (T * eta) + 0.05 * eta + 2.0 / T
    f = fit_bound(T, eta, y)
    assert (f["A"], f["B"], f["C"]) == pytest.approx((0.7, 0.05, 2.0), rel=1e-9)
    assert f["holds"] and f["fit_rel_rms"] < 1e-9
    y2 = (0.7 / (T * eta) + 2.0 / T) * (1 - 0.02 * eta)
    assert fit_theorem1(T, eta, y2)["B"] < 0
    g = fit_theorem1(T, eta, y2, nonneg=True)
    assert g["B"] == 0.0 and g["A"] > 0 and g["C"] > 0
    y3 = y.copy()
    y3[0, 0] *= 2.0
    assert not fit_bound(T, eta, y3)["holds"]
    assert fit_bound([1.0, 2.0], [0.1, 0.1], [1.0, 0.5])["A"] is None


def test_schedule_constant_gives_the_delay_term_its_share_and_never_a_zero_step():
    """Along eta = c T^(-1/2) the delay share B eta / bound is B c^2 / (A + B c^2) (C = 0):
    the constant must give it the asked share at every T; with A = 0 or B = 0 it is the cap
    (A = 0 used to give c = 0, a schedule that never moves, and a 0/0 in the bound)."""
    fit = {"A": 0.8, "B": 3.0, "C": 0.0}
    c = schedule_constant(fit, 0.25, cap=10.0)
    assert c == pytest.approx((0.25 / 0.75 * 0.8 / 3.0) ** 0.5, rel=1e-15)
    T = np.array([10.0, 40.0, 160.0])
    np.testing.assert_allclose(delay_share(fit, T, c / np.sqrt(T)), 0.25, rtol=1e-13)
    assert schedule_constant(fit, 0.25, cap=0.1) == 0.1
    for A, B in ((0.0, 3.0), (0.8, 0.0), (0.0, 0.0)):
        assert schedule_constant({"A": A, "B": B, "C": 1.0}, 0.25, cap=0.4) == 0.4
    with np.errstate(all="raise"):
        share = delay_share({"A": 0.0, "B": 3.0, "C": 1.0}, T, 0.4 / np.sqrt(T))
    assert np.all((share > 0) & (share < 1))


def test_slopes_exponents_and_eta0_on_synthetic_data():
    T = np.array([25.0, 50.0, 100.0, 200.0])
    assert schedule_slope(T, 3.0 * T**-0.5) == pytest.approx(-0.5, rel=1e-12)
    assert growth_exponent([1.0, 2.0, 4.0], [0.1, 0.4, 1.6]) == pytest.approx(2.0, rel=1e-12)
    assert growth_exponent([1.0, 2.0, 4.0], [0.0, 0.0, 1.0]) is None

    # D = e^{2 alpha t}: the window ratio is e^{2 alpha (3T/8)}-like, < 1 iff alpha < 0.
    def tad(alpha):
        cum = (np.exp(2 * alpha * T) - 1) / (2 * alpha)
        return cum / T

    r = window_ratio(T, np.stack([tad(a) for a in (-0.02, -0.0002, 0.001, 0.01)]))
    assert r[0] < 0.9 < r[1] and r[1] < 1.0 < r[2] < r[3]
    assert empirical_eta0([1.0, 2.0, 3.0, 4.0], r) == 1.0
    assert empirical_eta0([1.0, 2.0], [1.0, 0.5]) is None


def _catalogue(seed, i):
    d = [symmetric_pair(0.5), THREE][i]
    return {**copy.deepcopy(d), "index": i}


@pytest.fixture(scope="module")
def catalogue_ladder():
    return verify(2, 0, draw=_catalogue, chunk=2, n_cells=(2, 3), horizon=160.0, tick=0.1,
                  policies=["flow-grad"], ladder="full", tau_scales=(1.0, 2.0))  # fmt: skip


def test_catalogue_ladder(catalogue_ladder):
    """The symmetric pair of theory/stability.md and the non-symmetric 3-cell network:
    the projection check holds at 0.3 eta*, the empirical eta0/eta* lies in [0.75, 1.33]
    (ladder ratio 1.15), and the fitted constants are non-negative; the proof's eta0 is
    orders of magnitude below eta*, so the run at 0.3 eta* is outside the hypothesis and
    its bound is a reference, not a verdict."""
    for rec in catalogue_ladder["records"]:
        p = rec["policies"]["flow-grad"]
        assert p["eta_over_eta_star"] == pytest.approx(0.3, rel=1e-12)
        assert p["projection_check"]["holds"]
        assert 0.75 <= p["empirical_eta0_over_eta_star"] <= 1.33
        th = p["theorem1"]
        assert th["in_hypothesis"] is False and th["holds"] is None and th["eta0"] > 0
        assert p["thresholds"]["eta0"] < 1e-2 * p["thresholds"]["eta_star"]
        b = p["bound"]
        assert min(b["A"], b["B"], b["C"]) >= 0 and b["fit_rel_rms"] >= 0
        assert isinstance(b["holds"], bool)
        assert set(p["g1_by_tau_scale"]) == {"1.0", "2.0"}
        assert p["schedule_slope"] < 0
    s = catalogue_ladder["policies"]["flow-grad"]
    assert s["projection_check_holds_fraction"] == 1.0
    assert s["in_hypothesis_fraction"] == 0.0 and s["theorem1_holds_fraction"] is None
    for key in ("bound_holds_fraction", "A", "B", "C", "schedule_slope", "eta0_over_eta_star",
                "empirical_eta0_over_eta_star"):  # fmt: skip
        assert key in s


def _fake_records(idx, seed, source, pols, chunk, *rest, **kw):
    """`_chunk_records` without computing: each record's cell count from its source."""
    return [{"index": i, "n_cells": len(source(seed, i)["cells"]), "utilisation": 0.5,
             "policies": {p: {"converged": True, "status": "success",
                              "time_average_distance": 0.1, "final_distance": 0.1,
                              "eta_over_eta_star": 0.3} for p, _ in pols}}
            for i in idx]  # fmt: skip


def test_verify_json_contract_and_options(tmp_path, capsys, monkeypatch):
    """--ladder none (the default): every record gains theorem1, thresholds, the
    projection check and null ladder keys beside the old ones; --policy, --generator appb,
    --step-rule paper and --scenario run; --step-base eta0 runs inside the hypothesis and
    the bound holds there; a bad --policy names the allowed ones.

    The real runs are batches of two 2-3-cell scenarios, the shapes of test_verify's and
    the theorem1 notebook's chunks (a --scenario run is a batch of one, whose programs
    nothing else compiles: its file and count are checked on faked records)."""
    rc = main(["verify", "--scenarios", "2", "--seed", "3", "--chunk", "2", "--min-cells", "2",
               "--max-cells", "3", "--horizon", "20", "--tick", "0.1", "--json", "--policy",
               "flow-grad", "--generator", "appb", "--step-rule", "paper"])  # fmt: skip
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert set(res["summary"]["policies"]) == {"flow-grad"}
    rec = res["scenarios"][0]["policies"]["flow-grad"]
    old = {"step_size", "critical_step_size", "eta_over_eta_star", "time_average_distance",
           "final_distance", "oscillation", "converged", "status", "equilibrium_status",
           "kkt_residual"}  # fmt: skip
    new = {"theorem1", "thresholds", "projection_check", "bound", "schedule_slope",
           "g1_growth_exponent", "empirical_eta0", "empirical_eta0_over_eta_star"}  # fmt: skip
    assert old | new <= set(rec)
    assert set(rec["theorem1"]) >= {"eta0", "G1", "A", "C", "N_bar", "in_hypothesis", "bound",
                                    "measured", "holds", "tightness", "estimates"}  # fmt: skip
    assert set(rec["theorem1"]["C_parts"]) >= {"K1", "Kb", "KH", "K4"}
    assert set(rec["theorem1"]["estimates"]) == set(ESTIMATES)
    for e in rec["theorem1"]["estimates"].values():
        assert set(e) == {"measured", "bound", "holds"} and e["holds"] is True
    assert set(rec["thresholds"]) == {"eta0", "eta_star", *SEARCH_KEYS}
    assert {"eta_global", "bistable", "hopf", "witness", "cycle_amplitude",
            "cycle_period", "eta_global_bracket", "eta_global_censoring"} <= set(SEARCH_KEYS)  # fmt: skip
    assert set(rec["projection_check"]) >= {"holds", "lhs", "rhs", "discretisation_excess",
                                            "terms"}  # fmt: skip
    assert set(rec["projection_check"]["terms"]) == {"routing_start", "workload_start",
                                                "routing_end", "workload_end", "delay_gap",
                                                "mismatch"}  # fmt: skip
    assert rec["bound"] is None and len(rec["step_sizes"]) == res["scenarios"][0]["n_cells"]
    assert rec["eta_over_eta_star"] > 0
    summ = res["summary"]["policies"]["flow-grad"]
    for key in ("in_hypothesis_fraction", "theorem1_holds_fraction", "tightness",
                "eta0_over_eta_star", "eta_global_over_eta_star", "bistable_fraction",
                "estimates_hold_fraction", "theorem1", "eta_global", "audit",
                "step_vs_bracket"):  # fmt: skip
        assert key in summ
    rc = main(["verify", "--scenarios", "2", "--seed", "3", "--chunk", "2", "--min-cells", "2",
               "--max-cells", "3", "--horizon", "20", "--tick", "0.1", "--json", "--policy",
               "flow-grad", "--step-base", "eta0", "--step-fraction", "1"])  # fmt: skip
    assert rc == 0
    at0 = json.loads(capsys.readouterr().out)
    for one in at0["scenarios"]:
        th = one["policies"]["flow-grad"]["theorem1"]
        assert th["in_hypothesis"] is True and th["holds"] is True
        assert th["eta_over_eta0"] == pytest.approx(1.0, rel=1e-12)
    assert at0["summary"]["policies"]["flow-grad"]["theorem1_holds_fraction"] == 1.0
    import dlbfluid._verify.records

    monkeypatch.setattr(dlbfluid._verify.records, "_chunk_records", _fake_records)
    f = tmp_path / "three.json"
    f.write_text(json.dumps(THREE))
    rc = main(["verify", "--scenario", str(f), "--chunk", "2", "--max-cells", "3", "--horizon",
               "20", "--tick", "0.1", "--json", "--policy", "flow-grad"])  # fmt: skip
    assert rc == 0
    one = json.loads(capsys.readouterr().out)
    assert one["summary"]["scenarios"] == 1 and one["scenarios"][0]["n_cells"] == 3
    assert main(["verify", "--policy", "disc-grad", "--scenarios", "1"]) == 2
    assert "--policy = 'disc-grad' is invalid" in capsys.readouterr().err


def test_manifest_records_the_new_settings(tmp_path, monkeypatch):
    """Settings that change results are in the manifest when not at their defaults (a
    default run keeps its earlier manifest), and a rerun with another is refused naming
    the field (the Python API; the command line names its option); nothing is computed
    (records are faked)."""
    import dlbfluid._verify.records

    def records(idx, seed, source, pols, chunk, *rest, **kw):
        return [{"index": i, "n_cells": 2, "utilisation": 0.5,
                 "policies": {p: {"converged": True, "status": "success",
                                  "time_average_distance": 0.1, "final_distance": 0.1,
                                  "eta_over_eta_star": 0.3} for p, _ in pols}}
                for i in idx]  # fmt: skip

    monkeypatch.setattr(dlbfluid._verify.records, "_chunk_records", records)
    out = tmp_path / "run"
    verify(2, out_dir=out, ladder="full", step_rule="paper", generator="appb", **KW)
    config = json.loads((out / "manifest.json").read_text())["config"]
    assert config["ladder"] == "full" and config["tau_scales"] == [1.0, 2.0, 4.0]
    assert config["step_rule"] == "paper" and config["generator"] == "appb"
    with pytest.raises(ValueError, match=r"\(changed: ladder: 'full' -> \(not recorded\)"):
        verify(2, out_dir=out, step_rule="paper", generator="appb", **KW)
    default = tmp_path / "default"
    verify(2, out_dir=default, **KW)
    assert "ladder" not in json.loads((default / "manifest.json").read_text())["config"]
    with pytest.raises(ValueError, match="ladder = 'some' is invalid"):
        verify(2, ladder="some", **KW)
