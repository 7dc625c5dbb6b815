"""The recorded evaluation (notebooks/results/*.json) and the results tables built from it
(docs/results.md, the Results page of the documentation).

Issue #12's contract: every experiment kind recorded at the faithful defaults (600 s, the
probe cadence, the paper's step rule, 10 scenarios; 5 trials for the single-setting kinds,
at least 2 for the sweeps), each variant x policy present and without failed runs, and
every number of the results tables equal to the recording it quotes. No
simulation runs here: these are checks of committed artefacts against the code's
defaults, so a stale recording or a hand-edited table fails."""

import json
import re
from pathlib import Path

import pytest

from dlbfluid._defaults import PROBE_TICK
from dlbfluid._evaluation.config import FLUID_KINDS, ExperimentConfig, variants

ROOT = Path(__file__).parent.parent
RESULTS = ROOT / "notebooks" / "results"
SWEEPS = {"utilization", "duration", "noise", "heterogeneity", "tick"}
POLICIES = ExperimentConfig("baseline").policies


def _recorded(kind):
    path = RESULTS / f"{kind}.json"
    assert path.is_file(), f"{kind} is not recorded in {RESULTS}"
    return json.loads(path.read_text())


@pytest.mark.parametrize("kind", FLUID_KINDS)
def test_every_kind_is_recorded_at_the_faithful_defaults(kind):
    d = _recorded(kind)
    c = d["config"]
    assert d["experiment"] == c["experiment"] == kind
    assert (c["scenarios"], c["horizon"], c["tick"], c["step_rule"]) == (
        10,
        600.0,
        PROBE_TICK,
        "paper",
    )
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
    """(kind, variant) of a results-table row label, e.g. 'tick: y = 10, h = 20 ms' ->
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


def test_results_table_quotes_the_recordings():
    text = (ROOT / "docs" / "results.md").read_text()
    section = text.split("## The paper's evaluation in the fluid model: recorded results")[1]
    lines = [ln for ln in section.split("\n## ")[0].splitlines() if ln.startswith("| ")]
    header = [h.strip() for h in lines[0].strip("|").split("|")]
    assert tuple(header[1:]) == POLICIES
    recorded = {k: {(r["variant"], r["policy"]): r for r in _recorded(k)["summary"]}
                for k in FLUID_KINDS}  # fmt: skip
    seen = set()
    for line in lines[1:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if set(cells[0]) <= {"-"}:
            continue
        key = _row_key(cells[0])
        assert key is not None, f"docs/results.md row {cells[0]!r} names no recorded variant"
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
    assert seen == set(FLUID_KINDS)


# ----------------------------------------------------------------------------------------
# The request-level twin's evaluation (issue 32): notebooks/results/requests_KIND/
# ----------------------------------------------------------------------------------------

REQUEST_KINDS = ("baseline", "burst", "outage", "utilization", "duration")
"""The kinds recorded at request level (`dlbfluid experiment KIND --model requests
--service servers`), each in `notebooks/results/requests_KIND/` with `record.json` (the
commit and wall time of the run)."""

REQUIRED_VARIANTS = {"duration": ("y=10",)}
"""A kind recorded for some of its variants (`--variants`) must hold at least these (issue
40: `duration` at least at $y = 10$); the others hold every variant."""


def _recorded_variants(kind, config) -> list[str]:
    """The variants a record's configuration ran (`config.variants`, or every one)."""
    chosen = config.get("variants")
    return [v for v, _ in variants(kind) if chosen is None or v in chosen]


def _request_record(kind):
    import csv

    d = RESULTS / f"requests_{kind}"
    assert (d / "summary.json").is_file(), f"{kind} is not recorded at request level in {d}"
    summary = json.loads((d / "summary.json").read_text())
    with open(d / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return summary, rows, json.loads((d / "record.json").read_text())


def _request_problems(kind, summary, rows):
    """What is wrong with a request-level record: an empty list for a consistent one."""
    from dlbfluid._evaluation.experiment import summarise

    bad = []
    c = summary["config"]
    if (c["experiment"], c["model"], c["service"]) != (kind, "requests", "servers"):
        bad.append(f"config {c['experiment']}, {c['model']}, {c['service']}")
    if (c["tick"], c["step_rule"], tuple(c["policies"])) != (PROBE_TICK, "paper", POLICIES):
        bad.append("not the paper's tick, step rule and policies")
    ran = _recorded_variants(kind, c)
    if not set(REQUIRED_VARIANTS.get(kind, [v for v, _ in variants(kind)])) <= set(ran):
        bad.append(f"variants {ran}: expected at least {REQUIRED_VARIANTS.get(kind, 'all')}")
    want = {(v, p) for v in ran for p in POLICIES}
    runs = c["scenarios"] * c["trials"]
    if len(rows) != len(want) * runs or {(r["variant"], r["policy"]) for r in rows} != want:
        bad.append(f"{len(rows)} rows, expected {len(want)} x {runs}")
    for r in rows:
        if r["status"] != "success" or r["fluid_status"] != "success":
            bad.append(f"status {r['status']}/{r['fluid_status']} in {r['variant']} {r['policy']}")
        # latency is right-skewed: the p90 lies above the mean (a swapped column fails)
        if not 0 < float(r["mean_latency"]) < float(r["p90_latency"]) < 100:
            bad.append(f"mean {r['mean_latency']}, p90 {r['p90_latency']} in {r['policy']}")
        if not 0 <= float(r["error_rate"]) < 1:
            bad.append(f"error rate {r['error_rate']}")
    # the request-level and fluid columns are different models, not copies
    if all(r["mean_latency"] == r["fluid_mean_latency"] for r in rows):
        bad.append("request-level mean latencies equal the fluid ones")
    recomputed = {(s["variant"], s["policy"]): s for s in summarise(rows, POLICIES, "requests")}
    for s in summary["summary"]:
        if s["runs"] != runs or s["failed"] != 0:
            bad.append(f"{s['variant']} {s['policy']}: {s['runs']} runs, {s['failed']} failed")
        mine = recomputed[(s["variant"], s["policy"])]
        for key in ("normalized_latency", "p90", "error_rate", "fluid_normalized_latency"):
            if mine[key] != pytest.approx(s[key], rel=1e-9, abs=1e-15):
                bad.append(f"{s['variant']} {s['policy']} {key}: {s[key]} vs rows {mine[key]}")
    if {(s["variant"], s["policy"]) for s in summary["summary"]} != want:
        bad.append("summary rows differ from the variants x policies")
    return bad


@pytest.mark.parametrize("kind", REQUEST_KINDS)
def test_request_level_record_is_consistent(kind):
    summary, rows, record = _request_record(kind)
    assert len(record["commit"]) >= 7 and record["rc"] == 0 and record["wall_s"] > 0
    assert _request_problems(kind, summary, rows) == []
    for s in summary["summary"]:
        if s["policy"] == "rand":
            assert s["normalized_latency"] == s["p90"] == s["fluid_normalized_latency"] == 1.0


def test_request_level_consistency_check_fails_on_a_wrong_record():
    """Negative controls: swapped mean and p90 columns, a failed run, an edited summary."""
    summary, rows, _ = _request_record("baseline")
    swapped = [dict(r, mean_latency=r["p90_latency"], p90_latency=r["mean_latency"]) for r in rows]
    assert any("p90" in b for b in _request_problems("baseline", summary, swapped))
    failed = [dict(rows[0], status="solver_failed"), *rows[1:]]
    assert any("status" in b for b in _request_problems("baseline", summary, failed))
    edited = json.loads(json.dumps(summary))
    edited["summary"][-1]["normalized_latency"] *= 1.01
    assert any("normalized_latency" in b for b in _request_problems("baseline", edited, rows))
    fluid_copy = [dict(r, mean_latency=r["fluid_mean_latency"]) for r in rows]
    assert any("fluid" in b for b in _request_problems("baseline", summary, fluid_copy))
    # A duration record without y = 10, and a baseline-like kind recorded for a subset.
    dur, dur_rows, _ = _request_record("duration")
    assert _request_problems("duration", dur, dur_rows) == []
    other = json.loads(json.dumps(dur))
    other["config"]["variants"] = ["y=4"]
    assert any("expected at least" in b for b in _request_problems("duration", other, dur_rows))
    util, util_rows, _ = _request_record("utilization")
    some = json.loads(json.dumps(util))
    some["config"]["variants"] = ["u=0.8"]
    assert any("expected at least" in b for b in _request_problems("utilization", some, util_rows))


def _request_row_key(label):
    """('baseline', 'baseline', 'requests') of 'baseline (10 x 1, 60 s), requests';
    ('utilization', 'u=0.5', 'fluid') of 'utilisation u = 0.5, fluid'; ('duration',
    'y=10', 'requests') of 'duration y = 10 (10 x 2, 600 s), requests'."""
    m = re.fullmatch(r"(baseline|burst|outage|utilisation u = ([\d.]+)|duration y = ([\d.]+))"
                     r"(?: \(.*\))?, (requests|fluid)", label.strip())  # fmt: skip
    assert m, f"unreadable request-level row label {label!r}"
    if m[2] is not None:
        return "utilization", f"u={m[2]}", m[4]
    if m[3] is not None:
        return "duration", f"y={m[3]}", m[4]
    return m[1], m[1], m[4]


def test_request_level_table_quotes_the_records():
    text = (ROOT / "docs" / "results.md").read_text()
    section = text.split("## The paper's evaluation at request level: recorded results")[1]
    table = section.split("\n| experiment")[1].split("\n\n")[0]  # the first table only
    lines = ["| experiment" + table.splitlines()[0]] + table.splitlines()[1:]
    header = [h.strip() for h in lines[0].strip("|").split("|")]
    assert tuple(header[1:]) == POLICIES
    recorded = {k: {(s["variant"], s["policy"]): s for s in _request_record(k)[0]["summary"]}
                for k in REQUEST_KINDS}  # fmt: skip
    seen = set()
    for line in lines[1:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if set(cells[0]) <= {"-"}:
            continue
        kind, variant, model = _request_row_key(cells[0])
        seen.add((kind, variant, model))
        for p, cell in zip(POLICIES, cells[1:], strict=True):
            r = recorded[kind][(variant, p)]
            if model == "requests":
                m = re.fullmatch(r"\*{0,2}([\d.]+)\*{0,2} / ([\d.]+)(?: \(([\d.]+)%\))?", cell)
                assert m, f"unreadable cell {cell!r}"
                lat, p90, err = float(m[1]), float(m[2]), m[3]
                assert p90 == pytest.approx(r["p90"], abs=5e-4), (cells[0], p)
                rate = r["error_rate"]
            else:
                lat, err = _cell(cell)
                err = None if err is None else str(err * 100)
                rate = r["fluid_error_rate"]
            key = "normalized_latency" if model == "requests" else "fluid_normalized_latency"
            assert lat == pytest.approx(r[key], abs=5e-4), (cells[0], p)
            if err is None:
                assert rate < 5e-5, (cells[0], p)
            else:
                assert float(err) / 100 == pytest.approx(rate, rel=0.05), (cells[0], p)
        key = "normalized_latency" if model == "requests" else "fluid_normalized_latency"
        best = [p for p, c in zip(POLICIES, cells[1:], strict=True) if c.startswith("**")]
        assert best == [min(POLICIES[1:], key=lambda p: recorded[kind][(variant, p)][key])]
    ran = {k: _recorded_variants(k, _request_record(k)[0]["config"]) for k in REQUEST_KINDS}
    want = {(k, v, m) for k in REQUEST_KINDS for v in ran[k] for m in ("requests", "fluid")}
    assert seen == want


# ----------------------------------------------------------------------------------------
# The request-level-only kinds (issue 42): recovery and affinity
# ----------------------------------------------------------------------------------------

ONLY_KINDS = ("recovery", "affinity")
"""Kinds recorded at request level only, for a subset of the policies, each in
`notebooks/results/requests_KIND/` with its `record.json`."""


def _only_problems(kind, summary, rows):
    """What is wrong with a recovery or affinity record: an empty list for a consistent one
    (every variant x policy present for every run, the summary recomputed from the rows)."""
    from dlbfluid._evaluation.experiment import summarise

    bad = []
    c = summary["config"]
    if (c["experiment"], c["model"], c["service"]) != (kind, "requests", "servers"):
        bad.append(f"config {c['experiment']}, {c['model']}, {c['service']}")
    if (c["tick"], c["step_rule"]) != (PROBE_TICK, "paper") or "rand" not in c["policies"]:
        bad.append("not the paper's tick and step rule, or no Rand")
    want = {(v, p) for v, _ in variants(kind) for p in c["policies"]}
    runs = c["scenarios"] * c["trials"]
    if len(rows) != len(want) * runs or {(r["variant"], r["policy"]) for r in rows} != want:
        bad.append(f"{len(rows)} rows, expected {len(want)} x {runs}")
    for r in rows:
        if r["status"] != "success":
            bad.append(f"status {r['status']} in {r['variant']} {r['policy']}")
    again = summarise(rows, tuple(c["policies"]), "requests", c["horizon"])
    if json.loads(json.dumps(again)) != summary["summary"]:
        bad.append("the summary is not the rows' (summarise)")
    return bad


@pytest.mark.parametrize("kind", ONLY_KINDS)
def test_request_only_record_is_consistent(kind):
    summary, rows, record = _request_record(kind)
    assert len(record["commit"]) >= 7 and record["rc"] == 0 and record["wall_s"] > 0
    assert _only_problems(kind, summary, rows) == []
    edited = json.loads(json.dumps(summary))
    edited["summary"][-1]["normalized_latency"] *= 1.01
    assert _only_problems(kind, edited, rows) != []  # (the negative control)
    for s in summary["summary"]:
        if kind == "recovery" and s["variant"] != "oracle":
            rt = s["recovery_time"]
            assert rt["recovered"] + rt["censored"] == rt["runs"] == s["runs"]
            if s["policy"] == "rand":  # reads no latency model: the oracle's shares
                assert rt["recovered"] == rt["runs"] and rt["p90_s"] == 0.0
        if kind == "affinity":
            assert s["sessions"]["runs"] == s["runs"] - s["failed"]


def _only_table(kind):
    """The rows of docs/results.md's table of `kind` (the first table after its heading)."""
    text = (ROOT / "docs" / "results.md").read_text()
    heading = {"recovery": "### Recovery after a slowdown", "affinity": "### Sessions and affinity"}
    section = text.split(heading[kind])[1]
    table = "| variant" + section.split("\n| variant")[1].split("\n\n")[0]
    lines = table.strip().splitlines()
    header = [h.strip() for h in lines[0].strip("|").split("|")]
    return header, [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines[2:]]


def _number(cell):
    return None if cell == "-" else float(cell.strip("*"))


@pytest.mark.parametrize("kind", ONLY_KINDS)
def test_request_only_tables_quote_the_records(kind):
    summary, _, _ = _request_record(kind)
    recorded = {(s["variant"], s["policy"]): s for s in summary["summary"]}
    header, rows = _only_table(kind)
    assert header[:5] == ["variant", "policy", "lat/rand", "p90/rand", "errors %"]
    seen = set()
    for cells in rows:
        s = recorded[(cells[0], cells[1])]
        seen.add((cells[0], cells[1]))
        assert _number(cells[2]) == pytest.approx(s["normalized_latency"], abs=5e-4)
        assert _number(cells[3]) == pytest.approx(s["p90"], abs=5e-4)
        assert _number(cells[4]) == pytest.approx(100 * s["error_rate"], abs=5.1e-3)
        if kind == "recovery":
            stale, recovered, p50, p90 = cells[5:9]
            est, rt = s.get("estimation"), s["recovery_time"]
            assert stale == ("-" if est is None else f"{est['stale_runs']}/{est['runs']}")
            if rt is None:
                assert recovered == p50 == p90 == "-"
                continue
            assert recovered == f"{rt['recovered']}/{rt['runs']}"
            for cell, key in ((p50, "p50_s"), (p90, "p90_s")):
                want = f"> {rt['censored_above_s']:g}" if rt[key] is None else f"{rt[key]:g}"
                assert cell == want, (cells[:2], key)
        else:
            hits, busiest, moved, lat = cells[5:9]
            sess = s["sessions"]
            assert _number(hits) == pytest.approx(100 * sess["cache_hit_rate"], abs=0.05)
            assert _number(busiest) == pytest.approx(100 * sess["busiest_server_share"], abs=0.05)
            assert _number(moved) == pytest.approx(100 * sess["session_move_rate"], abs=0.05)
            assert _number(lat) == pytest.approx(s["mean_latency"], abs=5e-4)
    assert seen == set(recorded)
