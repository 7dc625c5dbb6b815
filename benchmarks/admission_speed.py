"""The admission-time engine's cost on App.-B scenarios, beside the fluid fast path (issue 40).

`simulate_requests(service="servers")` on `--scenarios` generated 10-cell App.-B scenarios
x `--trials` trials (one batch, one policy, 5 ms probes), timed warm; in the same run the
fluid simulator (`dlbfluid.simulate`, the default fast integrator) on the same scenarios,
tick and horizon, and the request-level engine again on the same scenarios with every
arrival rate scaled by 1e-9 (the ticks' fixed cost: no requests). Reports wall seconds,
the cost per request (wall, and CPU over the requests) and per scenario-tick, the ratio of
the request-level and the fluid costs per scenario-tick (issue 40 asks at most 3; the
fluid batch holds each scenario `--trials` times, as many as the request level's lanes),
and the compile seconds separately.

    python benchmarks/admission_speed.py --out benchmarks/results/admission_speed_cpu.json
"""

from __future__ import annotations

import argparse

import _harness as H
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from _batches import appb_batch

import dlbfluid
from dlbfluid import simulate, simulate_requests


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[H.parent_parser(repeats=2)])
    ap.add_argument("--scenarios", type=int, default=10)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--horizon", type=float, default=20.0)
    ap.add_argument("--policy", default="flow-grad")
    ap.add_argument("--tick", type=float, default=0.005)
    args = H.parse(ap, argv)
    dlbfluid.enable_x64()
    env = H.environment()
    kw = dict(service="servers", trials=args.trials, horizon=args.horizon, n_save=4, seed=0)
    kw["tick"] = args.tick
    full = appb_batch(10, args.scenarios, horizon=args.horizon)
    empty = eqx.tree_at(lambda s: s.arrival_rates, full, full.arrival_rates * 1e-9)
    # (the fluid peer on as many scenarios as the request level has lanes)
    fluid_batch = jax.tree.map(lambda x: jnp.concatenate([x] * args.trials), full)

    def requests(scn):
        return lambda: simulate_requests(scn, args.policy, **kw).served

    t_req = H.timed(requests(full), args.repeats)
    t_empty = H.timed(requests(empty), args.repeats)
    sol = simulate_requests(full, args.policy, **kw)
    served, events = int(np.sum(sol.served)), int(np.sum(sol.events))
    statuses = sorted(set(np.asarray(sol.status_names()).ravel().tolist()))
    t_fluid = H.timed(
        lambda: simulate(fluid_batch, args.policy, tick=args.tick, horizon=args.horizon, n_save=4).N,
        args.repeats,
    )
    ticks = round(args.horizon / args.tick)
    lanes = args.scenarios * args.trials
    per_tick_req = t_req.wall_s / (lanes * ticks)
    per_tick_fluid = t_fluid.wall_s / (lanes * ticks)
    record = {
        **H.header("admission_speed", args, env, argv),
        "requests": {
            "wall_s": t_req.wall_s,
            "cpu_s": min(t_req.cpus_s),
            "first_call_s": t_req.first_call_s,
            "compile_s": t_req.compile_s,
            "admissions": events,
            "served": served,
            "status": statuses,
            "us_per_request_wall": 1e6 * t_req.wall_s / max(events, 1),
            "us_per_request_cpu": 1e6 * min(t_req.cpus_s) / max(events, 1),
            "us_per_lane_tick": 1e6 * per_tick_req,
        },
        "empty_ticks": {
            "wall_s": t_empty.wall_s,
            "compile_s": t_empty.compile_s,
            "us_per_lane_tick": 1e6 * t_empty.wall_s / (lanes * ticks),
        },
        "fluid": {
            "wall_s": t_fluid.wall_s,
            "compile_s": t_fluid.compile_s,
            "us_per_scenario_tick": 1e6 * per_tick_fluid,
        },
        "ratio_per_scenario_tick": per_tick_req / per_tick_fluid,
    }
    H.log(
        H.markdown_table(
            ["run", "wall s", "compile s", "us per lane-tick", "us per request"],
            [
                ["requests", f"{t_req.wall_s:.2f}", f"{t_req.compile_s:.1f}",
                 f"{1e6 * per_tick_req:.2f}", f"{record['requests']['us_per_request_wall']:.2f}"],
                ["empty ticks", f"{t_empty.wall_s:.2f}", f"{t_empty.compile_s:.1f}",
                 f"{record['empty_ticks']['us_per_lane_tick']:.2f}", ""],
                ["fluid", f"{t_fluid.wall_s:.2f}", f"{t_fluid.compile_s:.1f}",
                 f"{1e6 * per_tick_fluid:.2f}", ""],
            ],
        )  # fmt: skip
    )
    H.emit(record, args.out)
    return record


if __name__ == "__main__":
    main()
