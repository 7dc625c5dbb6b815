"""What the leaf rule `pod` costs beside `jsq` at request level (issue 42: with a new option
on, the twin costs at most 1.5x its time without it).

`simulate_requests(service="servers")` on `--scenarios` generated 10-cell App.-B scenarios x
`--trials` trials (one batch, one policy, 5 ms probes), timed warm with `--leaf jsq` and
with power-of-d (`PowerOfD(d)` for each `--d`; each server's queue `--pod-slots`, default
`simulate_requests`'), in the same run. Reports per rule the wall
seconds (best steady call), compile seconds, admissions, the mean and p90 latency pooled
over the lanes (what the rule changes), and the ratio of its wall time to jsq's.

    python benchmarks/leaf_cost.py --out benchmarks/results/leaf_cost_cpu.json
"""

from __future__ import annotations

import argparse

import _harness as H
import numpy as np
from _batches import appb_batch

import dlbfluid
from dlbfluid import simulate_requests
from dlbfluid._requests._leaf import JoinShortestQueue, PowerOfD


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], parents=[H.parent_parser(repeats=2)]
    )
    ap.add_argument("--scenarios", type=int, default=10)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--horizon", type=float, default=20.0)
    ap.add_argument("--policy", default="flow-grad")
    ap.add_argument("--d", type=int, nargs="+", default=[2])
    ap.add_argument("--pod-slots", type=int, default=None,
                    help="each server's queue in the pod runs (default: simulate_requests')")  # fmt: skip
    args = H.parse(ap, argv)
    if min(args.d) < 1:
        ap.error(f"--d = {args.d} is invalid: expected integers >= 1")
    if args.pod_slots is not None and args.pod_slots < 1:
        ap.error(f"--pod-slots = {args.pod_slots} is invalid: expected an integer >= 1")
    dlbfluid.enable_x64()
    env = H.environment()
    batch = appb_batch(10, args.scenarios, horizon=args.horizon)
    kw = dict(service="servers", trials=args.trials, horizon=args.horizon,
              warmup=0.25 * args.horizon, n_save=4, seed=0, throw=False)  # fmt: skip
    rules = [JoinShortestQueue()] + [PowerOfD(d) for d in args.d]
    out, rows = {}, []
    for leaf in rules:
        slots = None if leaf.name == "jsq" else args.pod_slots

        def run(leaf=leaf, slots=slots):
            return simulate_requests(batch, args.policy, leaf=leaf, slots=slots, **kw)

        t = H.timed(lambda: run().served, args.repeats)
        sol = run()
        lat = np.asarray(sol.mean_latency())
        name = leaf.name if leaf.name == "jsq" else f"pod d={leaf.d}"
        out[name] = {
            "leaf": leaf.describe(),
            "wall_s": t.wall_s,
            "compile_s": t.compile_s,
            "admissions": int(np.sum(sol.events)),
            "status": sorted(set(np.asarray(sol.status_names()).ravel().tolist())),
            "mean_latency": float(np.mean(lat)),
            "mean_latency_per_scenario": np.mean(lat, axis=-1).tolist(),
        }
    base = out["jsq"]["wall_s"]
    for name, r in out.items():
        r["ratio_to_jsq"] = r["wall_s"] / base
        rows.append([name, f"{r['wall_s']:.2f}", f"{r['compile_s']:.1f}", f"{r['ratio_to_jsq']:.2f}",
                     f"{r['mean_latency']:.4f}", ", ".join(r["status"])])  # fmt: skip
    record = {
        **H.header("leaf_cost", args, env, argv),
        "rules": out,
    }
    H.log(
        H.markdown_table(["leaf", "wall s", "compile s", "x jsq", "mean latency s", "status"], rows)
    )
    H.emit(record, args.out)
    return record


if __name__ == "__main__":
    main()
