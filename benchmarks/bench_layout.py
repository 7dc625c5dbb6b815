"""`simulate(layout=...)`: the batch axis first (`jax.vmap`) against last (`vmap_last`),
float64 and float32, timed in one process and interleaved.

App.-B scenarios (`_batches.appb_batch`, 600-s profiles), tick 5 ms, `Fast()`, one
policy (default flow-grad), `--n-save` save intervals per call (default 4). Each of the
four configurations (layout x dtype) is compiled first (`first_call_s`), then `--rounds`
rounds call each configuration once in turn, so
that a drift of the machine's speed (the other core's load, the clock) falls on all four
alike; `us_per_scenario_tick` is the best round, `median_us` the median. `N_max_rel_diff`
is the largest difference of the saved workloads between the layouts, per dtype, relative
to 1 + |N| (the arithmetic is the same; only rounding may differ). Each call is
`_harness.measure` (ended by `jax.block_until_ready`).

One JSON object goes to stdout (and to `--out`), a Markdown table to stderr. Run, e.g.:

    PYTHONUNBUFFERED=1 python benchmarks/bench_layout.py \
        --out benchmarks/results/layout_cpu.json
"""

from __future__ import annotations

import argparse

import _harness as H
import numpy as np
from _batches import appb_batch

import dlbfluid as dl


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], parents=[H.parent_parser()])
    p.add_argument("--cells", type=int, default=10)
    p.add_argument("--batch", type=int, default=1000)
    p.add_argument("--ticks", type=int, default=200, help="ticks per call (default 200)")
    p.add_argument("--policy", default="flow-grad")
    p.add_argument("--n-save", type=int, default=4, help="save intervals per call (default 4)")
    p.add_argument("--rounds", type=int, default=5)
    a = H.parse(p, argv)
    for name in ("cells", "batch", "ticks", "rounds", "n_save"):
        if getattr(a, name) < 1:
            flag = name.replace("_", "-")
            p.error(f"--{flag} = {getattr(a, name)} is invalid: expected an integer >= 1")
    if a.n_save > a.ticks:
        p.error(f"--n-save = {a.n_save} is invalid: expected at most --ticks = {a.ticks}")
    return a


def main(argv=None) -> dict:
    args = parse_args(argv)
    dl.use_cpu_cores()
    dl.enable_x64()
    scn = appb_batch(args.cells, args.batch, horizon=600.0)
    h = 0.005
    configs = [(lay, dt) for dt in ("float64", "float32") for lay in dl.LAYOUTS]

    def call(lay, dt):
        c = H.measure(
            lambda: dl.simulate(
                scn,
                args.policy,
                tick=h,
                horizon=args.ticks * h,
                n_save=args.n_save,
                dtype=dt,
                layout=lay,
            )
        )
        return c.wall_s, c.result

    first, walls, N = {}, {c: [] for c in configs}, {}
    for c in configs:
        first[c], sol = call(*c)
        N[c] = np.asarray(sol.N, np.float64)
        if not bool(np.all(np.asarray(sol.status) == dl.STATUS["success"])):
            raise SystemExit(f"{c}: a scenario did not succeed")
    for _ in range(args.rounds):
        for c in configs:
            walls[c].append(call(*c)[0])
    scale = 1e6 / (args.batch * args.ticks)
    rows = []
    for lay, dt in configs:
        w = np.asarray(walls[(lay, dt)])
        rows.append(
            dict(
                layout=lay,
                dtype=dt,
                us_per_scenario_tick=float(w.min() * scale),
                median_us=float(np.median(w) * scale),
                first_call_s=first[(lay, dt)],
            )
        )
    us = {(r["layout"], r["dtype"]): r["us_per_scenario_tick"] for r in rows}
    diff = {
        dt: float(
            np.max(
                np.abs(N[("batch-last", dt)] - N[("batch-first", dt)])
                / (1.0 + np.abs(N[("batch-first", dt)]))
            )
        )
        for dt in ("float64", "float32")
    }
    out = dict(
        benchmark="layout",
        machine=dict(
            H.environment("platform", "cpu_count", "devices"),
            jax=H.environment("jax_version")["jax_version"],
        ),
        cells=args.cells,
        batch=args.batch,
        n_save=args.n_save,
        ticks=args.ticks,
        tick_s=h,
        policy=args.policy,
        rounds=args.rounds,
        results=rows,
        N_max_rel_diff=diff,
        float32_over_float64=dict(
            batch_first=us[("batch-first", "float64")] / us[("batch-first", "float32")],
            batch_last=us[("batch-last", "float64")] / us[("batch-last", "float32")],
            best=min(us[(lay, "float64")] for lay in dl.LAYOUTS)
            / min(us[(lay, "float32")] for lay in dl.LAYOUTS),
        ),
    )
    H.emit(out, args.out)
    header = ("layout", "dtype", "us/scenario-tick", "median us", "first call (s)")
    table = [
        (r["layout"], r["dtype"], f"{r['us_per_scenario_tick']:.3f}", f"{r['median_us']:.3f}",
         f"{r['first_call_s']:.1f}")
        for r in rows
    ]  # fmt: skip
    H.log(H.markdown_table(header, table, align="llrrr"))
    return out


if __name__ == "__main__":
    main()
