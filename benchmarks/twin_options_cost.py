"""What the twin's options of issue 42 cost at request level (the issue: with a new option
on, the twin costs at most 1.5x its time without it, on the baseline, measured in one run).

`simulate_requests(service="servers")` on `--scenarios` generated 10-cell App.-B scenarios x
`--trials` trials (one batch, one policy, 5 ms probes), timed warm in the same run: plain
(`jsq`, raw probes, no schedule), then each option alone, then all of them together:
power-of-d leaf routing (`PowerOfD(d)` for each `--d`; each server's queue `--pod-slots`,
default `simulate_requests'`), probe smoothing (`--smoothing` s) and a service schedule
(each scenario's first cell 3x slower from 30% to 50% of the horizon, the recovery
experiment's slowdown), online estimation (`OnlineEstimation()`: a refit every 5 s over
60 s) and online estimation with its three mitigations (a probe per cell every second,
shrinkage toward the prior worth 64 samples, dithering 0.1), and sessions with each
affinity mode (the `affinity` experiment's `AFFINITY_SESSIONS` on every scenario: prefix
caches of 64 sessions per server; `off`, `sticky`, `conditional`). Reports per variant the
wall seconds (best steady call), compile seconds, admissions, the mean latency pooled over
the lanes (what the option changes), and the ratio of its wall time to plain's. The steady
calls are timed in interleaved rounds (every variant once per round, `--repeats` rounds),
so that a slow phase of the machine weighs on every variant alike.

    python benchmarks/twin_options_cost.py --out benchmarks/results/twin_options_cost_cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses

import _harness as H
import jax.numpy as jnp
import numpy as np
from _batches import appb_batch

import dlbfluid
from dlbfluid import simulate_requests
from dlbfluid._defaults import AFFINITY_MODES
from dlbfluid._evaluation.config import AFFINITY_SESSIONS
from dlbfluid._requests._leaf import JoinShortestQueue, PowerOfD
from dlbfluid._requests.estimation import OnlineEstimation

MITIGATED = OnlineEstimation(probing=1.0, shrinkage=64.0, dithering=0.1)


def _with_sessions(batch):
    """`batch` whose workloads have the `affinity` experiment's sessions."""
    w = batch.workload
    fields = {"session_fraction": "fraction", "session_length": "mean_length",
              "think_time": "think_time", "prefix_reuse": "prefix_reuse",
              "session_skew": "skew"}  # fmt: skip
    new = {f: jnp.full_like(getattr(w, f), AFFINITY_SESSIONS[k]) for f, k in fields.items()}
    return dataclasses.replace(batch, workload=dataclasses.replace(w, **new))


def _slowed(batch, horizon: float):
    """`batch` with its first cell slowed 3x on [0.3, 0.5) x `horizon` (a service schedule
    of three entries for every cell; the others' factors are 1)."""
    times = np.broadcast_to([0.0, 0.3 * horizon, 0.5 * horizon], batch.replicas.shape + (3,))
    factors = np.ones(batch.replicas.shape + (3,))
    factors[:, 0, 1] = 3.0
    return dataclasses.replace(
        batch, slowdown_times=jnp.asarray(times), slowdown_factors=jnp.asarray(factors)
    )


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], parents=[H.parent_parser(repeats=3)]
    )
    ap.add_argument("--scenarios", type=int, default=10)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--horizon", type=float, default=20.0)
    ap.add_argument("--policy", default="flow-grad")
    ap.add_argument("--d", type=int, nargs="+", default=[2])
    ap.add_argument("--pod-slots", type=int, default=None,
                    help="each server's queue in the pod runs (default: simulate_requests')")  # fmt: skip
    ap.add_argument("--smoothing", type=float, default=0.1,
                    help="the probe smoothing's time constant, s (default 0.1)")  # fmt: skip
    args = H.parse(ap, argv)
    if min(args.d) < 1:
        ap.error(f"--d = {args.d} is invalid: expected integers >= 1")
    if args.pod_slots is not None and args.pod_slots < 1:
        ap.error(f"--pod-slots = {args.pod_slots} is invalid: expected an integer >= 1")
    if not args.smoothing > 0:
        ap.error(f"--smoothing = {args.smoothing} is invalid: expected a number > 0")
    dlbfluid.enable_x64()
    env = H.environment()
    plain = appb_batch(10, args.scenarios, horizon=args.horizon)
    slowed = _slowed(plain, args.horizon)
    sessions = _with_sessions(plain)
    kw = dict(service="servers", trials=args.trials, horizon=args.horizon,
              warmup=0.25 * args.horizon, n_save=4, seed=0, throw=False)  # fmt: skip
    pods = [PowerOfD(d) for d in args.d]
    variants = [("plain", plain, {})]
    variants += [(f"pod d={p.d}", plain, {"leaf": p, "slots": args.pod_slots}) for p in pods]
    variants += [
        (f"smoothing {args.smoothing:g} s", plain, {"probe_smoothing": args.smoothing}),
        ("service schedule", slowed, {}),
        ("online estimation", plain, {"estimation": "online"}),
        ("online, mitigated", plain, {"estimation": MITIGATED}),
    ]
    variants += [(f"sessions, {m}", sessions, {"affinity": m}) for m in AFFINITY_MODES]
    variants += [
        ("all", _with_sessions(slowed), {"leaf": pods[-1], "slots": args.pod_slots,
                                         "probe_smoothing": args.smoothing,
                                         "estimation": MITIGATED, "affinity": "conditional"}),
    ]  # fmt: skip
    out, rows = {}, []

    def run(batch, opts):
        return simulate_requests(batch, args.policy, **opts, **kw)

    timings = H.timed_rounds(
        {name: (lambda b=batch, o=opts: run(b, o)) for name, batch, opts in variants},
        args.repeats,
    )
    for name, _, opts in variants:
        t = timings[name]
        sol = t.result  # (the last timed call's solution: no run again)
        lat = np.asarray(sol.mean_latency())
        leaf = opts.get("leaf", JoinShortestQueue())
        out[name] = {
            "leaf": leaf.describe(),
            "probe_smoothing": opts.get("probe_smoothing", 0.0),
            "service_schedule": name == "service schedule" or name == "all",
            "affinity": opts.get("affinity"),
            "estimation": (
                {"mode": "oracle"}
                if "estimation" not in opts
                else (
                    OnlineEstimation() if opts["estimation"] == "online" else opts["estimation"]
                ).describe()
            ),  # fmt: skip
            "wall_s": t.wall_s,
            "compile_s": t.compile_s,
            "admissions": int(np.sum(sol.events)),
            "status": sorted(set(np.asarray(sol.status_names()).ravel().tolist())),
            "mean_latency": float(np.mean(lat)),
            "mean_latency_per_scenario": np.mean(lat, axis=-1).tolist(),
        }
    base = out["plain"]["wall_s"]
    for name, r in out.items():
        r["ratio_to_plain"] = r["wall_s"] / base
        rows.append([name, f"{r['wall_s']:.2f}", f"{r['compile_s']:.1f}",
                     f"{r['ratio_to_plain']:.2f}", f"{r['mean_latency']:.4f}",
                     ", ".join(r["status"])])  # fmt: skip
    record = {**H.header("twin_options_cost", args, env, argv), "variants": out}
    H.log(H.markdown_table(
        ["variant", "wall s", "compile s", "x plain", "mean latency s", "status"], rows))  # fmt: skip
    H.emit(record, args.out)
    return record


if __name__ == "__main__":
    main()
