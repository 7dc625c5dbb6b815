"""Does `verify`'s verdict move with the tick? The first scenarios of one record against a
recorded summary of the same networks at another tick.

`verify`'s networks are drawn from the seed alone (scenario `k` of `--seed S` is the same
network whatever `--scenarios`, `--tick` or `--chunk`), so the first `--first` records of a
long run (its `results.jsonl`) and a shorter run of `--first` scenarios at another tick
judge the same networks. The records are summarised by the library's own
`dlbfluid._verify.summary.summarise`; for each policy the script prints the two summaries'
verdict fractions and quantiles side by side, and the largest relative difference of the
quantiles.

    python benchmarks/verify_tick_invariance.py --records RUN/results.jsonl \\
        --reference benchmarks/results/verify_1000_eta0_cpu.json --first 1000

One JSON object on stdout (and `--out`). A record file with a gap or a repeated index in
`[0, first)` is refused before anything is compared.
"""

from __future__ import annotations

import argparse
import json
import math

import _harness as H

from dlbfluid._verify.summary import summarise

FRACTIONS = ("in_hypothesis_fraction", "theorem1_holds_fraction", "converged_fraction")
QUANTILES = ("tightness", "eta0_over_eta_star", "time_average_distance", "final_distance")


def _first_records(path: str, first: int) -> list[dict]:
    records: dict[int, dict] = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            k = rec["index"]
            if k < first:
                if k in records:
                    raise SystemExit(f"--records: index {k} appears twice in {path}")
                records[k] = rec
    missing = sorted(set(range(first)) - set(records))
    if missing:
        raise SystemExit(f"--records: {len(missing)} of the first {first} indices are missing")
    return [records[k] for k in range(first)]


def _rel(a, b) -> float | None:
    if a is None or b is None:
        return None
    scale = max(abs(a), abs(b))
    return 0.0 if scale == 0 else abs(a - b) / scale


def compare(ours: dict, ref: dict) -> dict:
    out = {}
    for policy, r in ref.items():
        o = ours[policy]
        row: dict = {k: {"records": o.get(k), "reference": r.get(k)} for k in FRACTIONS}
        worst = 0.0
        for k in QUANTILES:
            row[k] = {"records": o.get(k), "reference": r.get(k)}
            for q in ("q10", "q50", "q90", "max"):
                d = _rel((o.get(k) or {}).get(q), (r.get(k) or {}).get(q))
                if d is not None and math.isfinite(d):
                    worst = max(worst, d)
        row["max_relative_difference"] = worst
        out[policy] = row
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, parents=[H.parent_parser()])
    p.add_argument("--records", required=True, help="a verify run's results.jsonl")
    p.add_argument("--reference", required=True, help="a verify summary (JSON) of the same seed")
    p.add_argument("--first", type=int, default=1000, help="how many leading scenarios")
    args = H.parse(p, argv)
    ref = json.load(open(args.reference))
    ours = summarise(_first_records(args.records, args.first))
    record = {
        "benchmark": "verify_tick_invariance",
        "first": args.first,
        "records": args.records,
        "reference": args.reference,
        "reference_tick": ref.get("tick"),
        "policies": compare(ours["policies"], ref["policies"]),
    }
    H.emit(record, args.out)


if __name__ == "__main__":
    main()
