"""Issue 42, item 6: why Flow-Grad loses its lead at request level. Flow-Grad's normalised
mean and p90 latency (over Rand's on the same scenario and trial) on the plane of its step
fraction and the probe noise, with and without smoothing of the probed counts.

The README's hypothesis: the routers probe request *counts*, whose noise (about $k^{-1/2}$
of the fluid's workload at the twin's scale $k$) a step rule calibrated on noise-free
workloads amplifies. If it holds, Flow-Grad's normalised latency falls towards the fluid
model's as $k$ grows, as the step shrinks, or as the probes are smoothed.

Each grid point `(step fraction f, scale k, smoothing T)` is one `dlbfluid experiment
baseline --model requests --service servers --policies rand flow-grad disc-grad
--step-rule oracle --step-fraction f --scale k --probe-smoothing T` (Disc-Grad, the
request level's best at the baseline, for reference) into its own directory under `--runs` (each resumes after a
kill; a directory made with other settings is refused), and the record, rewritten after
every point, holds the summaries with the fluid model's normalised latency on the same
scenarios beside them (the negative control: the fluid has no probe noise, so it must not
move with $k$ or $T$).

    python benchmarks/flowgrad_noise.py --runs benchmarks/results/flowgrad_noise_runs \\
        --out benchmarks/results/flowgrad_noise_cpu.json

(the defaults: 4 baseline scenarios x 2 trials x 120 s, App.-B `servers` cells, f in
{0.1, 0.3, 1}, k in {1, 4}, T in {0, 0.02, 0.1} s: 18 points, about 25 minutes on 2 cores;
the directories' plots are not kept in git)
"""

from __future__ import annotations

import argparse
import csv
import itertools
import time
from pathlib import Path

import _harness as H

import dlbfluid
from dlbfluid._evaluation.config import ExperimentConfig
from dlbfluid._evaluation.experiment import run_experiment

KEYS = ("runs", "failed", "normalized_latency", "normalized_latency_p10",
        "normalized_latency_p90", "p90", "fluid_normalized_latency", "mean_latency",
        "error_rate")  # fmt: skip


def _point_name(f: float, k: int, t: float) -> str:
    return f"f={f:g}_k={k}_T={t:g}"


def paired_runs(path: Path) -> dict:
    """Per policy but Rand, its runs' mean and p90 latency over Rand's on the same
    scenario and trial (`results.csv` of one grid point; failed runs left out), and the
    fluid model's normalised mean on the same runs: `{policy: {"mean": [...], "p90":
    [...], "fluid": [...], "runs": [[scenario, trial], ...]}}`, in the file's order."""
    with open(path / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    rand = {(r["scenario"], r["trial"]): r for r in rows if r["policy"] == "rand"}
    out: dict = {}
    for r in rows:
        base = rand.get((r["scenario"], r["trial"]))
        if r["policy"] == "rand" or base is None:
            continue
        if not (r["status"] == base["status"] == "success"):
            continue
        d = out.setdefault(r["policy"], {"mean": [], "p90": [], "fluid": [], "runs": []})
        d["mean"].append(float(r["mean_latency"]) / float(base["mean_latency"]))
        d["p90"].append(float(r["p90_latency"]) / float(base["p90_latency"]))
        ok = r["fluid_status"] == base["fluid_status"] == "success"
        fl = float(r["fluid_mean_latency"]) / float(base["fluid_mean_latency"]) if ok else None
        d["fluid"].append(fl)
        d["runs"].append([int(r["scenario"]), int(r["trial"])])
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[H.parent_parser()])
    ap.add_argument("--runs", required=True, metavar="DIR",
                    help="a directory of experiment directories, one per grid point")  # fmt: skip
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.3, 1.0])
    ap.add_argument("--scales", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--smoothing", type=float, nargs="+", default=[0.0, 0.02, 0.1])
    ap.add_argument("--scenarios", type=int, default=4)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--horizon", type=float, default=120.0)
    ap.add_argument("--service", default="servers", choices=["markov", "servers"])
    ap.add_argument("--seed", type=int, default=0)
    args = H.parse(ap, argv)
    runs = Path(args.runs)
    if runs.exists() and not runs.is_dir():
        ap.error(f"--runs {args.runs}: is not a directory")
    grid = list(itertools.product(args.fractions, args.scales, args.smoothing))
    # Every configuration is built (and so checked) before the first run.
    cfgs = [
        ExperimentConfig(
            "baseline",
            scenarios=args.scenarios,
            trials=args.trials,
            seed=args.seed,
            horizon=args.horizon,
            step_rule="oracle",
            step_fraction=f,
            policies=("rand", "flow-grad", "disc-grad"),
            model="requests",
            service=args.service,
            scale=k,
            probe_smoothing=t,
        )  # fmt: skip
        for f, k, t in grid
    ]
    dlbfluid.enable_x64()
    runs.mkdir(parents=True, exist_ok=True)
    record = H.header("flowgrad_noise", args, H.environment(), argv)
    record["points"] = []
    for (f, k, t), cfg in zip(grid, cfgs):
        t0 = time.perf_counter()
        summary = run_experiment(cfg, runs / _point_name(f, k, t))
        wall = time.perf_counter() - t0
        assert summary is not None  # (one process)
        by = {s["policy"]: s for s in summary["summary"]}
        row = {"step_fraction": f, "scale": k, "probe_smoothing": t, "wall_s": round(wall, 1)}
        row.update({key: by["flow-grad"].get(key) for key in KEYS})
        row["rand_mean_latency"] = by["rand"]["mean_latency"]
        # (Disc-Grad, the request level's best at the baseline: no step, the same probes)
        row["disc_grad"] = {key: by["disc-grad"].get(key) for key in KEYS}
        row["paired"] = paired_runs(runs / _point_name(f, k, t))
        record["points"].append(row)
        H.log(f"{_point_name(f, k, t)}: flow-grad {row['normalized_latency']} "
              f"(p90 {row['p90']}, fluid {row['fluid_normalized_latency']}) in {wall:.0f} s")  # fmt: skip
        if args.out:
            H.write_json(record, args.out)
    H.emit(record, None)


if __name__ == "__main__":
    main()
