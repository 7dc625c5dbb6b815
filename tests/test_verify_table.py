"""The text table of `dlbfluid verify`: Theorem 1's verdict first, the diagnostics labelled
as such, and a line saying why the verdict is empty when no run is inside the hypothesis.
The summaries are the recorded 1,000-scenario worst-case search's (nothing is computed)."""

import copy
import json
import pathlib
from types import SimpleNamespace

from dlbfluid._cli._verify import _print_tables

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
    assert "0.952 [0.71, 0.95]" in row  # eta_g/eta*
    # Negative control: nobody in the hypothesis -> the line says why and how to check it.
    none = copy.deepcopy(summary)
    none["policies"]["flow-grad"]["in_hypothesis_fraction"] = 0.0
    out = _printed(none, capsys)
    assert HINT in out and "--step-base eta0" in out
    assert out.index(HINT) < out.index("Diagnostics (not")
