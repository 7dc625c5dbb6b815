"""The text table of `dlbfluid verify`: Theorem 1's verdict first, the diagnostics labelled
as such, and a line saying why the verdict is empty when no run is inside the hypothesis.
The summaries are the recorded 1,000-scenario worst-case search's (nothing is computed)."""

import copy
import json
import pathlib
from types import SimpleNamespace

from dlbfluid._cli._verify import _print_tables
from dlbfluid._verify.summary import summarise

RECORD = pathlib.Path(__file__).parents[1] / "benchmarks/results/worst_case_1000_cpu.json"
ARGS = SimpleNamespace(step_base="eta-star", step_fraction=0.3, step_rule="oracle", seed=0,
                       horizon=200.0, tick=0.05, ladder="none")  # fmt: skip
HINT = "no run is inside the hypothesis"


def _printed(summary, capsys) -> str:
    _print_tables(summary, ARGS)
    return capsys.readouterr().out


def test_verdict_leads_and_the_empty_verdict_says_why(capsys):
    summary = json.loads(RECORD.read_text())["summary"]
    out = _printed(summary, capsys)
    # 0.4% of the runs were in the hypothesis: the verdict's columns are filled, no hint.
    assert HINT not in out
    lines = out.splitlines()
    verdict = next(i for i, s in enumerate(lines) if s.startswith("Theorem 1 (the verdict"))
    diag = next(i for i, s in enumerate(lines) if s.startswith("Diagnostics (not"))
    assert 0 < verdict < diag
    row = next(s for s in lines[verdict:diag] if s.startswith("flow-grad"))
    assert row.split()[1:3] == ["0.004", "1.000"]  # in hypothesis, bound holds
    # The ladder's record has no bracket: no global-threshold table, no plain eta_g/eta*.
    assert "Global threshold" not in out and "0.952 [0.71, 0.95]" not in out
    # Negative control: nobody in the hypothesis -> the line says why and how to check it.
    none = copy.deepcopy(summary)
    none["policies"]["flow-grad"]["in_hypothesis_fraction"] = 0.0
    out = _printed(none, capsys)
    assert HINT in out and "--step-base eta0" in out
    assert out.index(HINT) < out.index("Diagnostics (not")


def test_global_threshold_table_says_the_censoring_in_words(capsys):
    """With brackets, the global threshold gets its own table: the censoring counts, a
    q10 that a below-range scenario could move printed as its bound, and the run's step
    against the brackets; the audit has its own heading after the verdict."""
    def rec(cens, lo, hi, place):
        thr = {"eta_star": 1.0, "eta_global_censoring": cens, "eta_global_bracket": [lo, hi],
               "bistable": hi is not None and hi < 1.0, "step_vs_bracket": place}  # fmt: skip
        one = {"theorem1": {"in_hypothesis": False, "estimates": {"tail": {"holds": True}}},
               "thresholds": thr, "converged": True, "status": "success",
               "time_average_distance": 0.1, "final_distance": 0.1, "eta_over_eta_star": 0.3}  # fmt: skip
        return {"policies": {"flow-grad": one}}

    recs = [rec("below_range", None, 0.25, "undetermined"), rec("above_range", 1.1, None,
            "below_lo")] + [rec("bracketed", v * 0.99, v, "below_lo") for v in (0.8, 0.9, 0.95)]  # fmt: skip
    summary = summarise(recs)
    summary["devices"] = ["cpu:0"]
    out = _printed(summary, capsys)
    lines = out.splitlines()
    head = next(i for i, s in enumerate(lines) if s.startswith("Global threshold"))
    audit = next(i for i, s in enumerate(lines) if s.startswith("Audit ("))
    assert head < audit < next(i for i, s in enumerate(lines) if s.startswith("Diagnostics"))
    row = next(s for s in lines[head:audit] if s.startswith("flow-grad"))
    assert row.split()[1:5] == ["3/5", "1", "1", "0"]  # bracketed/with eta*, below, above, failed
    assert "0.9 [< 0.25, > 1.1]" in row  # q50 a number, q10 and q90 bounds
    assert "4 / 0 / 0 / 1" in row
