"""The global step-size threshold eta_g as a bracket (dlbfluid/_global_threshold/,
theory/global_threshold.md) and the censored summary of `verify` (dlbfluid/_verify/summary.py).

One search over a batch of three scenarios serves the module: the symmetric pair at
tau = 0.5 (subcritical Hopf: a stable cycle of amplitude about 1.9 coexists with the stable
equilibrium from about 0.83 eta* up), the three-cell network of tests/helpers.py (no cycle
below eta*: the negative control), and the pair again with eta* = inf (nothing searched).
A second search of the same batch over a narrower range reuses its compiled programs.
"""

import dataclasses
import math

import jax.tree_util as jtu
import numpy as np
import pytest
from helpers import symmetric_pair, three

import dlbfluid as dl
from dlbfluid._cli import main
from dlbfluid._global_threshold import RECORD_KEYS, WorstCaseSearch, global_threshold
from dlbfluid._global_threshold.search import _pass, _Runs, _starts
from dlbfluid._global_threshold.stats import non_decaying
from dlbfluid._policies import policy_from_name
from dlbfluid._verify.records import step_vs_bracket
from dlbfluid._verify.summary import censored_quantiles, global_threshold_summary, summarise

POLICY = "flow-grad"
TICK = 0.05
# Rungs 0.75, 0.91, 1.10 eta*, then bisection to 1%; 8 drawn starts and 2 adversarial ones,
# 300 s at 0.05 s: one compiled program per pass (10 x 3 runs), one for the re-runs at
# 0.025 s (3 runs of 600 s) and one for the ascent.
CONFIG = WorstCaseSearch(starts=8, search_range=(0.75, 1.1), horizon=300.0, tick=TICK)


@pytest.fixture(scope="module")
def searched():
    dicts = [symmetric_pair(0.5), three(), symmetric_pair(0.5)]
    batch = dl.stack_scenarios([dl.scenario_from_dict(d) for d in dicts])
    eq = dl.solve_equilibrium(batch, policy_from_name(POLICY).cost, throw=False, check=False)
    eta_star = np.array(dl.batch_critical_step_size(batch, POLICY, eq).critical_step_size)
    eta_star[2] = math.inf
    out = global_threshold(batch, POLICY, eq, eta_star, config=CONFIG)
    return dicts, eta_star, out, (batch, eq)


def test_pair_is_bracketed_below_eta_star(searched):
    _, eta_star, out, _ = searched
    rec = out[0]
    assert set(rec) == set(RECORD_KEYS)
    lo, hi = rec["eta_global_bracket"]
    assert rec["eta_global_censoring"] == "bracketed"
    assert rec["eta_global"] == hi
    assert hi - lo <= CONFIG.bracket_tol * hi and lo < hi
    # The fold of the cycle (at the re-run's tick 0.025) lies at 0.825-0.830 eta*.
    assert 0.81 < lo / eta_star[0] < hi / eta_star[0] < 0.85
    assert rec["bistable"] is True and rec["hopf"] == "subcritical"
    w = rec["witness"]
    assert set(w) == {"workload", "routing", "amplitude", "period"}
    assert w["amplitude"] == pytest.approx(1.92, abs=0.05) == rec["cycle_amplitude"]
    assert w["period"] == pytest.approx(13.6, abs=0.3) == rec["cycle_period"]
    # The ladder's 3 rungs stop at 0.91 eta* (2 steps), then 5 bisections.
    assert rec["eta_global_search"]["steps"] == 2 + CONFIG.bisections()


def test_bracket_agrees_with_direct_simulations(searched):
    """From the witness, `dlbfluid.simulate` at the re-run's tick (600 s): at hi the run
    stays on the cycle (the witness's amplitude within 2% in the last quarter), at lo it
    converges to N* = (1, 1)."""
    dicts, _, out, _ = searched
    rec = out[0]
    lo, hi = rec["eta_global_bracket"]
    w = rec["witness"]
    initial = {"workload": w["workload"], "routing": w["routing"]}
    scn = dl.scenario_from_dict({**dicts[0], "initial": initial})
    sol = dl.simulate(
        dl.stack_scenarios([scn, scn]), POLICY, step_size=np.array([[hi], [lo]]),
        tick=TICK / 2, horizon=600.0, n_save=3000,
    )  # fmt: skip
    assert list(sol.status_names()) == ["success", "success"]
    N = np.asarray(sol.N)[:, -750:, 1:]  # the last quarter, both cells of the pair
    amp = (N.max(axis=1) - N.min(axis=1)).max(axis=-1)
    assert amp[0] == pytest.approx(w["amplitude"], rel=0.02)
    assert amp[1] < 0.05
    assert np.max(np.abs(N[1, -1] - 1.0)) < 0.01


def test_negative_control_three_cells(searched):
    """No cycle below eta* on the three-cell network: the bracket closes on eta* itself,
    the cycle just above it is small (0.03 against N* = 1.5): supercritical."""
    _, eta_star, out, _ = searched
    rec = out[1]
    lo, hi = rec["eta_global_bracket"]
    assert rec["eta_global_censoring"] == "bracketed"
    assert 0.98 < lo / eta_star[1] < 1.0 <= hi / eta_star[1] < 1.02
    assert rec["bistable"] is False and rec["hopf"] == "supercritical"
    assert rec["cycle_amplitude"] < 0.25 * 1.47
    assert rec["cycle_period"] == pytest.approx(1.51, abs=0.05)


def test_slowly_decaying_start_is_rejected(searched):
    """Just below eta* on the three-cell network every start decays too slowly for the
    search's decay test (non-decaying over 300 s), but the re-run of the best one at half
    the tick for 600 s loses more than 10% of its amplitude: it is no witness."""
    _, eta_star, out, (batch, eq) = searched
    lo = out[1]["eta_global_bracket"][0]
    runs = _Runs(batch, POLICY, eq, eta_star, None, CONFIG)
    N0, x0 = _starts(runs.scn, runs.N_star, CONFIG)
    N0, x0 = np.concatenate([N0, N0[:2]]), np.concatenate([x0, x0[:2]])  # the 10 starts' shape
    step = np.where(np.isfinite(eta_star), eta_star, 1.0)
    step[1] = lo
    st = runs.stats(step[None], N0[None], x0[None], TICK, int(CONFIG.horizon / TICK))
    nd = non_decaying(st, np.broadcast_to(runs.N_star, (1, 10, 3, 3)), CONFIG)
    assert nd[0, :, 1].all()  # the decay test alone would call it a cycle
    one = _pass(runs, step[None], N0, x0)
    assert one.rejected[0, 1] and not one.cycle[0, 1] and not one.failed[0, 1]
    assert one.amplitude[0, 1] < 0.9 * np.max(np.asarray(st.amp4)[0, :, 1])


def test_below_range_is_counted_and_bounds_q10(searched):
    """Over 0.85-1.1 eta* the pair cycles at the lowest step: below_range, `[None, hi]`,
    no eta_global; in the summary the counts add up and q10 is the bound "< 0.85"."""
    _, eta_star, out, (batch, eq) = searched
    cfg = dataclasses.replace(CONFIG, search_range=(0.85, 1.1))
    narrow = global_threshold(batch, POLICY, eq, eta_star, config=cfg)
    rec = narrow[0]
    assert rec["eta_global_censoring"] == "below_range"
    assert rec["eta_global_bracket"] == [None, pytest.approx(0.85 * eta_star[0], rel=1e-12)]
    assert rec["eta_global"] is None and rec["bistable"] is True
    assert rec["witness"]["amplitude"] == pytest.approx(1.92, abs=0.05)
    assert narrow[1]["eta_global_censoring"] == "bracketed"
    thr = [{"eta_star": e if math.isfinite(e) else None, **r} for e, r in zip(eta_star, narrow)]
    g = global_threshold_summary(thr)
    assert g["with_eta_star"] == 2 == sum(g[c] for c in ("bracketed", "below_range",
                                                          "above_range", "failed"))  # fmt: skip
    assert g["below_range"] == 1 and g["bracketed"] == 1
    assert g["over_eta_star"]["q10"] == "< 0.85" and g["over_eta_star"]["min"] == "< 0.85"
    assert g["over_eta_star"]["max"] == pytest.approx(narrow[1]["eta_global"] / eta_star[1])


def test_no_search_without_eta_star(searched):
    _, _, out, _ = searched
    assert out[2] == dict.fromkeys(RECORD_KEYS)


def test_witness_is_a_valid_initial_block(searched):
    dicts, _, out, _ = searched
    for d, rec in zip(dicts[:2], out[:2]):
        w = rec["witness"]
        scn = dl.scenario_from_dict(
            {**d, "initial": {"workload": w["workload"], "routing": w["routing"]}}
        )
        x = np.asarray(scn.initial_routing)
        assert np.all(x >= 0) and np.allclose(x.sum(axis=-1), 1.0, atol=1e-12)


def test_adversarial_starts_raise_the_gap_and_stay_feasible(searched):
    """The ascent at the top of the range (the search's own program): finite objectives
    at every iterate, the pair's cold start's late gap raised by more than 5% in 4 steps,
    and the refined starts feasible (N >= 0, routing on each simplex, 0 on forbidden
    arcs)."""
    _, eta_star, _, (batch, eq) = searched
    runs = _Runs(batch, POLICY, eq, eta_star, None, CONFIG)
    N0, x0 = _starts(runs.scn, runs.N_star, CONFIG)
    N1, x1, history = runs.adversarial(N0, x0)
    assert history.shape == (CONFIG.ascent_steps, CONFIG.ascent_starts, 3)
    assert np.all(np.isfinite(history[:, :, :2]))
    assert history[:, 0, 0].max() > 1.05 * history[0, 0, 0]
    assert np.all(N1 >= 0)
    allowed = np.asarray(runs.scn.allowed)
    assert np.all(x1[:, ~allowed] == 0)
    rows = allowed.any(axis=-1)
    assert np.allclose(x1.sum(axis=-1)[:, rows], 1.0, atol=1e-12)


def test_censored_quantiles():
    """Order statistics, never interpolated: a rank among the censored members is a
    bound, a rank that a failed search could move is null with its reason."""
    q = censored_quantiles([0.9, 0.95, 0.8, 1.0, 0.85, 0.9, 0.7], below=[0.25] * 2, above=[1.1])
    assert q["n"] == 10
    assert q["q10"] == "< 0.25" and q["min"] == "< 0.25"  # rank 1 of 10: censored below
    assert q["q50"] == 0.85  # rank 5: 2 below, then 0.7, 0.8, 0.85
    assert q["q90"] == 1.0 and q["max"] == "> 1.1"
    q = censored_quantiles([0.7, 0.8, 0.9], below=[], above=[], unknown=1)
    assert q["q50"] is None and "1 failed" in q["reason"]
    q = censored_quantiles([0.7, 0.9, 0.9, 0.9, 0.9], below=[], above=[], unknown=1)
    assert q["q50"] == 0.9 and q["q90"] is None  # the same member either way; the top: not
    assert censored_quantiles([], [], [])["reason"] == "no scenario with a search verdict"


def _record(thm=None, thr=None) -> dict:
    one = {"theorem1": thm, "thresholds": thr or {}, "converged": True, "status": "success",
           "time_average_distance": 0.1, "final_distance": 0.1, "eta_over_eta_star": None}  # fmt: skip
    return {"policies": {POLICY: one}}


def test_summary_counts_behind_every_fraction():
    """Theorem 1's fractions come with the runs behind them; the estimates sit under
    `audit` with their counts (and the old fraction keys stay)."""
    est = {"tail": {"holds": True}, "mixed_delay": {"holds": False}}
    recs = [
        _record({"in_hypothesis": True, "holds": True, "tightness": 2.0, "estimates": est},
                {"eta_star": None}),
        _record({"in_hypothesis": False, "holds": None, "tightness": 3.0, "estimates": est},
                {"eta_star": 0.1}),
        _record(None, {"eta_star": 0.1}),
    ]  # fmt: skip
    s = summarise(recs)["policies"][POLICY]
    t = s["theorem1"]
    assert t["n"] == 2
    assert t["in_hypothesis"] == {"count": 1, "of": 2, "fraction": 0.5}
    assert t["holds"] == {"count": 1, "of": 1, "fraction": 1.0}
    assert t["fallback_step"] == 1 and t["tightness"]["n"] == 1
    audit = s["audit"]["estimates"]
    assert audit["mixed_delay"] == {"count": 0, "of": 2, "fraction": 0.0}
    assert s["estimates_hold_fraction"] == {"mixed_delay": 0.0, "tail": 1.0}
    assert s["eta_global"] is None and s["step_vs_bracket"] is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--search-range", "1", "0.5"], "--search-range = [1.0, 0.5] is invalid: expected two"),
        (["--bracket-tol", "0.5"], "--bracket-tol = 0.5 is invalid: expected a number in (0, 0.5)"),
    ],
)
def test_search_options_checked_before_any_work(argv, message, capsys):
    assert main(["verify", "--worst-case", "--scenarios", "2", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(ladder_ratio=2.5), "ladder_ratio"),
        (dict(starts=0), "starts"),
        (dict(vertex_starts=9, starts=8), "vertex_starts"),
        (dict(horizon=10.01), "horizon"),
        (dict(decay_ratio=1.0), "decay_ratio"),
        (dict(tick=-0.05), "tick"),
        (dict(late_window=0.0), "late_window"),
        (dict(bracket_tol=0.5), "bracket_tol"),
        (dict(search_range=(1.0, 0.5)), "search_range"),
        (dict(search_range=(0.0, 0.5)), "search_range"),
        (dict(ascent_starts=9, starts=8), "ascent_starts"),
    ],
)
def test_bad_config(change, field):
    with pytest.raises(ValueError, match=rf"WorstCaseSearch\.{field} = .* is invalid: expected"):
        WorstCaseSearch(**change)


def test_bad_arguments(searched):
    _, _, _, (batch, eq) = searched
    with pytest.raises(ValueError, match=r"eta_star has shape \(2,\): expected \(3,\)"):
        global_threshold(batch, POLICY, eq, np.ones(2), config=CONFIG)
    with pytest.raises(ValueError, match="disc-grad"):
        global_threshold(batch, "disc-grad", eq, np.ones(3), config=CONFIG)
    with pytest.raises(ValueError, match="config = "):
        global_threshold(batch, POLICY, eq, np.ones(3), config={"starts": 8})
    with pytest.raises(ValueError, match=r"step_weights = .* is invalid: expected \(3, 3\)"):
        global_threshold(batch, POLICY, eq, np.ones(3), config=CONFIG, step_weights=np.ones(3))
    one = jtu.tree_map(lambda a: a[0], batch)
    with pytest.raises(ValueError, match="expected one batch axis"):
        global_threshold(one, POLICY, eq, np.ones(3), config=CONFIG)


def test_step_weights_scale_each_router(searched):
    """With `step_weights` (the paper's rule's profile) router i of every run steps at
    eta w_i: the bracket, eta* and the rule's largest step share one scale."""
    _, eta_star, _, (batch, eq) = searched
    w = np.array([[1.0, 0.5, 0.25]] * 3)
    runs = _Runs(batch, POLICY, eq, eta_star, w, CONFIG)
    steps = np.array([[0.1, 0.2, 0.3]])
    eta = np.asarray(runs._eta(steps, 2)).reshape(1, 2, 3, 3)
    assert np.array_equal(eta[0, 1], steps[0][:, None] * w)


def test_step_vs_bracket():
    assert step_vs_bracket(0.1, [0.2, 0.21]) == "below_lo"
    assert step_vs_bracket(0.205, [0.2, 0.21]) == "inside"
    assert step_vs_bracket(0.3, [0.2, 0.21]) == "above_hi"
    assert step_vs_bracket(0.3, [None, 0.21]) == "above_hi"
    assert step_vs_bracket(0.1, [None, 0.21]) == "undetermined"  # below a censored top
    assert step_vs_bracket(0.1, [0.2, None]) == "below_lo"
    assert step_vs_bracket(0.3, [0.2, None]) == "undetermined"
    assert step_vs_bracket(0.1, None) is None
