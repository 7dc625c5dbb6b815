"""Two request-level experiment runs, paired over the same scenarios (issue 40's
acceptance of a new twin: mean, p90 and errors per policy agree in distribution).

Each argument is an experiment directory made by `dlbfluid experiment KIND --model requests`
(its `results.csv`). The two runs must hold the same policies, scenarios and trials and
every row must be `success`; their random streams may differ (two implementations draw
differently). Per policy and measure (`mean_latency`, `p90_latency`, `error_rate`) it
averages each scenario's trials in each run, then reports the two runs' means over the
scenarios, the mean paired difference (B - A) and its 90% half-width,
$t_{0.95, S-1}\\,s_d/\\sqrt{S}$ over the S scenarios, and `agrees`: |difference| <= the
half-width. One JSON object goes to stdout (and to `--out`):

    python benchmarks/paired_requests.py OLD_DIR NEW_DIR --out benchmarks/results/x.json
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import math
import sys
from pathlib import Path

import numpy as np

MEASURES = ("mean_latency", "p90_latency", "error_rate")
# Student's t, 95th percentile, by degrees of freedom (a two-sided 90% interval).
T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860,
       9: 1.833, 10: 1.812, 14: 1.761, 19: 1.729, 29: 1.699}  # fmt: skip


def t95(df: int) -> float:
    known = [k for k in T95 if k <= df]
    return T95[max(known)] if known else T95[1]


def load(directory: Path) -> dict:
    path = directory / "results.csv"
    if not path.is_file():
        sys.exit(f"paired_requests.py: error: {path} is not a file (an experiment's results)")
    rows = collections.defaultdict(list)
    with path.open() as f:
        for r in csv.DictReader(f):
            if "p90_latency" not in r:
                sys.exit(f"paired_requests.py: error: {path} is a fluid run (no p90_latency)")
            if r["status"] != "success":
                sys.exit(f"paired_requests.py: error: {path}: {r['policy']} scenario "
                         f"{r['scenario']} trial {r['trial']} is {r['status']!r}")  # fmt: skip
            key = (r["variant"], r["policy"], int(r["scenario"]))
            rows[key].append([float(r[m]) for m in MEASURES])
    return rows


def paired(a: dict, b: dict) -> dict:
    if set(a) != set(b):
        sys.exit(f"paired_requests.py: error: the runs differ in (variant, policy, scenario): "
                 f"{sorted(set(a) ^ set(b))[:4]}")  # fmt: skip
    out: dict = {}
    for variant, policy in sorted({k[:2] for k in a}):
        scen = sorted(k[2] for k in a if k[:2] == (variant, policy))
        x = np.array([np.mean(a[(variant, policy, s)], axis=0) for s in scen])
        y = np.array([np.mean(b[(variant, policy, s)], axis=0) for s in scen])
        d = y - x
        half = t95(len(scen) - 1) * d.std(axis=0, ddof=1) / math.sqrt(len(scen))
        out.setdefault(variant, {})[policy] = {
            m: dict(a=float(x[:, i].mean()), b=float(y[:, i].mean()), diff=float(d[:, i].mean()),
                    ci90=float(half[i]), agrees=bool(abs(d[:, i].mean()) <= half[i]))
            for i, m in enumerate(MEASURES)
        }  # fmt: skip
        out[variant][policy]["scenarios"] = len(scen)
        out[variant][policy]["trials"] = len(a[(variant, policy, scen[0])])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path, help="experiment directory A (e.g. the old twin)")
    ap.add_argument("b", type=Path, help="experiment directory B (e.g. the new twin)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    if args.out is not None and not args.out.parent.is_dir():
        ap.error(f"--out = {str(args.out)!r} is invalid: its folder does not exist")
    res = {"a": str(args.a), "b": str(args.b), "policies": paired(load(args.a), load(args.b))}
    res["agrees"] = all(v["agrees"] for var in res["policies"].values() for p in var.values()
                        for v in p.values() if isinstance(v, dict))  # fmt: skip
    text = json.dumps(res, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
