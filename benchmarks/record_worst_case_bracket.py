"""Issue #41 item 5: the record of the bracketed worst-case search, compared with the ladder's.

    python benchmarks/record_worst_case_bracket.py RUN_DIR [--ladder FILE] [--log FILE]
        [--out FILE]

Reads the records a `dlbfluid verify --worst-case ... --out RUN_DIR` run has written so far
(`RUN_DIR/results.jsonl`: a finished run or the part of a resumable one that finished) and
the ladder's record of the same scenarios (`--ladder`, default
benchmarks/results/worst_case_1000_cpu.json, whose `per_scenario` holds each scenario's
`eta_global` and `bistable` from the ladder 0.68-1.05 eta* of issue #30), and writes one
JSON object (stdout, and `--out`): the run's settings (`RUN_DIR/manifest.json`), how many
scenarios finished, `verify`'s summary of them (`summarise`: the censoring counts, the
censored quantiles, Theorem 1's counts, the audit), the Hopf directions, the witnesses'
amplitude and period quantiles, the steps and rejections of the search, and a table of the
ladder's verdict against the bracket's censoring over the same indices, with the ratio of
the bracket's top to the ladder's eta_g where both found one. With `--log`, the peak RSS,
user CPU and wall time that `/usr/bin/time -v` wrote there.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np

from dlbfluid._verify.summary import summarise

ROOT = Path(__file__).resolve().parent


def _ladder_verdict(old: dict) -> str:
    """The ladder's verdict on one scenario: no eta*, below the ladder (a cycle at its
    lowest rung), on it (eta_g a rung below the first cycle), or no cycle on it (eta_g
    set to the top rung)."""
    if old["eta_star"] is None:
        return "no eta*"
    if old["eta_global"] is None:
        return "below ladder" if old["bistable"] else "no eta*"
    if old["eta_global"] >= 1.05 * old["eta_star"] * (1 - 1e-9):
        return "no cycle on ladder"
    return "on ladder"


def _time_log(path: Path) -> dict:
    """Wall, user CPU and peak RSS from `/usr/bin/time -v`'s lines in `path`."""
    text = path.read_text()
    out = {}
    for key, pat in (("user_cpu_s", r"User time \(seconds\): ([\d.]+)"),
                     ("peak_rss_gb", r"Maximum resident set size \(kbytes\): (\d+)"),
                     ("wall", r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)")):  # fmt: skip
        m = re.search(pat, text)
        if m:
            out[key] = m.group(1)
    if "peak_rss_gb" in out:
        out["peak_rss_gb"] = round(int(out["peak_rss_gb"]) / 1024**2, 2)
    return out


def _q(v) -> dict | None:
    v = np.asarray([x for x in v if x is not None], float)
    if v.size == 0:
        return None
    q = np.quantile(v, [0.1, 0.5, 0.9])
    return {"q10": float(q[0]), "q50": float(q[1]), "q90": float(q[2]), "n": int(v.size)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--ladder", type=Path, default=ROOT / "results/worst_case_1000_cpu.json")
    ap.add_argument("--log", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    recs = [json.loads(line) for line in (args.run / "results.jsonl").read_text().splitlines()
            if line.strip()]  # fmt: skip
    recs.sort(key=lambda r: r["index"])
    manifest = json.loads((args.run / "manifest.json").read_text())
    pol = manifest["config"]["policies"][0] if "config" in manifest else "flow-grad"
    old = {r["index"]: r for r in json.loads(args.ladder.read_text())["per_scenario"]}
    thr = [r["policies"][pol]["thresholds"] for r in recs]
    cens = [t["eta_global_censoring"] or "no eta*" for t in thr]
    table: dict = {}
    ratio = []
    for r, t, c in zip(recs, thr, cens):
        o = old.get(r["index"])
        v = "not in the ladder's record" if o is None else _ladder_verdict(o)
        table.setdefault(v, {}).setdefault(c, 0)
        table[v][c] += 1
        if c == "bracketed" and v == "on ladder":
            ratio.append(t["eta_global"] / o["eta_global"])
    witnesses = [t["witness"] for t in thr if t.get("witness")]
    searched = [t["eta_global_search"] for t in thr if t.get("eta_global_search")]
    result = {
        "benchmark": "worst_case_search_bracket_verify",
        "manifest": manifest,
        "finished_scenarios": len(recs),
        "indices": [recs[0]["index"], recs[-1]["index"]] if recs else None,
        "summary": summarise(recs)["policies"][pol],
        "hopf": {str(k): sum(t["hopf"] == k for t in thr) for k in
                 ("subcritical", "supercritical", None)},  # fmt: skip
        "bistable": sum(bool(t["bistable"]) for t in thr),
        "witness_amplitude": _q([w["amplitude"] for w in witnesses]),
        "witness_period": _q([w["period"] for w in witnesses]),
        "steps_per_scenario": _q([s["steps"] for s in searched]),
        "scenarios_with_a_rejected_step": sum(s["rejected"] > 0 for s in searched),
        "ladder_vs_bracket": table,
        "bracket_hi_over_ladder_eta_g": _q(ratio),
        "time": _time_log(args.log) if args.log else None,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
