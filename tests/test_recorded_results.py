"""The recorded evaluation (notebooks/results/*.json) and the README table built from it.

Issue #12's contract: every experiment kind recorded at the faithful defaults (600 s, the
probe cadence, the paper's step rule, 10 scenarios; 5 trials for the single-setting kinds,
at least 2 for the sweeps), each variant x policy present and without failed runs, and
every number of the README's results table equal to the recording it quotes. No
simulation runs here: these are checks of committed artefacts against the code's
defaults, so a stale recording or a hand-edited table fails."""

import json
import re
from pathlib import Path

import pytest

from dlbfluid._defaults import PROBE_TICK
from dlbfluid._evaluation.config import KINDS, ExperimentConfig, variants

ROOT = Path(__file__).parent.parent
RESULTS = ROOT / "notebooks" / "results"
SWEEPS = {"utilization", "duration", "noise", "heterogeneity", "tick"}
POLICIES = ExperimentConfig("baseline").policies


def _recorded(kind):
    path = RESULTS / f"{kind}.json"
    assert path.is_file(), f"{kind} is not recorded in {RESULTS}"
    return json.loads(path.read_text())


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_is_recorded_at_the_faithful_defaults(kind):
    d = _recorded(kind)
    c = d["config"]
    assert d["experiment"] == c["experiment"] == kind
    assert (c["scenarios"], c["horizon"], c["tick"], c["step_rule"]) == (10, 600.0, PROBE_TICK,
                                                                        "paper")
    assert c["trials"] >= 2 if kind in SWEEPS else c["trials"] == 5
    assert c["mnlb_error_aversion"] is False and tuple(c["policies"]) == POLICIES
    rows = {(r["variant"], r["policy"]): r for r in d["summary"]}
    want = {(v, p) for v, _ in variants(kind) for p in POLICIES}
    assert set(rows) == want
    for r in rows.values():
        assert r["runs"] == c["scenarios"] * c["trials"] and r["failed"] == 0
        if r["policy"] == "rand":
            assert r["normalized_latency"] == 1.0


def _row_key(label):
    """(kind, variant) of a README row label, e.g. 'tick: y = 10, h = 20 ms' ->
    ('tick', 'y=10,h=20ms'); None for a label this table does not use."""
    label = re.sub(r"\s*\(.*\)\s*$", "", label).replace("$\\epsilon$", "eps").strip()
    fixed = {"baseline, u = 0.8": ("baseline", "baseline"),
             "noise: fitted models": ("noise", "fitted")}  # fmt: skip
    if label in fixed:
        return fixed[label]
    if label in ("homogeneous", "spikes", "burst", "outage"):
        return label, label
    m = re.fullmatch(r"tick: (baseline|y = 10), h = (\d+) ms", label)
    if m:
        return "tick", ("" if m[1] == "baseline" else "y=10,") + f"h={m[2]}ms"
    m = re.fullmatch(r"(utilisation|duration|heterogeneity|noise) (u|y|cv|eps) = ([\d.]+)", label)
    if m:
        kind = "utilization" if m[1] == "utilisation" else m[1]
        return kind, f"{m[2]}={m[3]}"
    return None


def _cell(text):
    """'**0.807** (0.11%)' -> (0.807, 0.0011); '1' -> (1.0, None)."""
    m = re.fullmatch(r"\*{0,2}([\d.]+)\*{0,2}(?: \(([\d.]+)%\))?", text.strip())
    assert m, f"unreadable table cell {text!r}"
    return float(m[1]), None if m[2] is None else float(m[2]) / 100


def test_readme_table_quotes_the_recordings():
    text = (ROOT / "README.md").read_text()
    section = text.split("## The paper's evaluation in the fluid model: recorded results")[1]
    lines = [ln for ln in section.split("\n## ")[0].splitlines() if ln.startswith("| ")]
    header = [h.strip() for h in lines[0].strip("|").split("|")]
    assert tuple(header[1:]) == POLICIES
    recorded = {k: {(r["variant"], r["policy"]): r for r in _recorded(k)["summary"]}
                for k in KINDS}  # fmt: skip
    seen = set()
    for line in lines[1:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if set(cells[0]) <= {"-"}:
            continue
        key = _row_key(cells[0])
        assert key is not None, f"README row {cells[0]!r} names no recorded variant"
        kind, variant = key
        seen.add(kind)
        vals = {p: _cell(c) for p, c in zip(POLICIES, cells[1:], strict=True)}
        for p, (lat, err) in vals.items():
            r = recorded[kind][(variant, p)]
            assert lat == pytest.approx(r["normalized_latency"], abs=5e-4), (cells[0], p)
            if err is None:  # no bracket: the error rate is below 0.005%
                assert r["error_rate"] < 5e-5, (cells[0], p)
            else:  # two significant digits
                assert err == pytest.approx(r["error_rate"], rel=0.05), (cells[0], p)
        best = [p for p, c in zip(POLICIES, cells[1:], strict=True) if c.startswith("**")]
        assert best == [min(POLICIES[1:], key=lambda p: recorded[kind][(variant, p)]
                            ["normalized_latency"])], cells[0]  # fmt: skip
    assert seen == set(KINDS)
