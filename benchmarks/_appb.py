"""`bench_simulate.py --appb`: the paper's probe cadence against the machine's arithmetic
floor (issue #11).

App.-B scenarios from the seed's generator (`_batches.appb_batch`), tick 5 ms, `Fast()` with
its default sub-steps, flow-grad, cells 2/5/10/20, batches 1/100/1000, float64 and float32.
Per configuration: the `layout` `simulate` ran (`default_layout`'s choice),
`scenario_ticks_per_s`, `us_per_scenario_tick`, `ops_per_scenario_tick` (floating-point
operations counted from the algorithm, `ops_per_tick`), the achieved operation rate and its
fraction of the peak of a large matmul of the same dtype timed in the same run
(`machine_peak`); then the measured scaling exponents of the cost in batch (100 to 1000),
horizon (K to 2K ticks) and cells. Timing by `_harness.timed` (compile apart, best of
`--repeats` steady calls).
"""

from __future__ import annotations

import argparse
import time

import _harness as H
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from _batches import appb_batch

import dlbfluid as dl
from dlbfluid._policies.projection import NETWORK_MAX, sorting_network

POLICY = "flow-grad"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `--appb` flags (the others, `--batches`, `--cells`, `--tick`, ..., are shared)."""
    p.add_argument(
        "--appb",
        action="store_true",
        help="the App.-B case at the probe cadence against the machine's peak (see above)",
    )
    p.add_argument(
        "--dtypes", default="float64,float32", help="--appb: comma list of float64, float32"
    )
    p.add_argument("--ticks", type=int, default=400, help="--appb: ticks per call (default 400)")
    p.add_argument(
        "--profile-horizon",
        type=float,
        default=None,
        help="--appb: seconds the arrival profiles cover (default twice the simulated "
        "span; 600 is what the paper's evaluation simulates)",
    )
    p.add_argument(
        "--chunks",
        default="default",
        help="--appb: comma list of simulate(chunk=) values to compare: 'default' (the "
        "backend's choice), 'whole' (the whole batch at once) or integers (default: default)",
    )


def finish_arguments(p: argparse.ArgumentParser, a: argparse.Namespace) -> argparse.Namespace:
    """Check the `--appb` flags and fill the App.-B defaults (tick 5 ms, step size 0.5)."""
    a.dtypes = [s.strip() for s in a.dtypes.split(",") if s.strip()]
    for d in a.dtypes:
        if d not in ("float32", "float64"):
            p.error(f"--dtypes: unknown dtype {d!r} (allowed: float64, float32)")
    if a.ticks < 2:
        p.error(f"--ticks: {a.ticks} is invalid: expected >= 2")
    if a.profile_horizon is not None and not a.profile_horizon > 0:
        p.error(f"--profile-horizon: {a.profile_horizon} is invalid: expected seconds > 0")
    a.chunks = [s.strip() for s in a.chunks.split(",") if s.strip()]
    for c in a.chunks:
        if c not in ("default", "whole") and not (c.isdigit() and int(c) >= 1):
            p.error(f"--chunks: {c!r} is invalid: expected default, whole or an integer >= 1")
    a.batches = sorted(set(a.batches or [1, 100, 1000]))
    a.cells = a.cells or [2, 5, 10, 20]
    if a.tick == 0.05:  # (the parser's default: the App.-B case runs at 5 ms)
        a.tick = 0.005
    a.step_size = 0.5 if a.step_size == 0.2 else a.step_size
    return a


def ops_per_tick(n: int, substeps: int, window: int) -> dict:
    """Floating-point operations of one flow-grad scenario-tick of `Fast`, counted from the
    algorithm (theory/discretisation.md, *Fast path*); an add, multiply, compare or select
    counts one. `window` is the number of arrival-profile breakpoints each arc integral
    visits (`_window_width`). The terms:

    * inflow pieces: two `rate_integral`s and two `rate_slope`s per arc over the window,
      about 12 and 4 operations per profile piece, plus 12 per arc for the coefficients;
    * the closed-form cumulative inflow (`_cumulative`): its coefficients (4 per arc), then
      per query a sum over the n sources of about 5 operations plus 6; two queries per
      sub-step and cell (the mid-step and end-step times) and one per arc (the observation
      offsets, O(n^3) in all);
    * service rates (softplus cells: about 14 each plus the exponential and log1p as
      arithmetic, `_elementary`: about 30 and 35; 4 per sub-step and cell) and the stage
      arithmetic (about 30 per sub-step and cell);
    * observations: the dense output, about 16 per arc and sub-step;
    * the routers' demand this tick (12 per profile piece and cell), the mass in flight
      (4 per arc) and the next tick's arrival window (about 8 per breakpoint and cell);
    * flow-grad: the marginal cost per arc (about 20 plus the exponential and log1p: the
      latency, its slope, the product), the step (3 per arc), the simplex projection (up to
      16 cells by a sorting network, per router: a mask per entry, a maximum and a minimum
      per comparator of `sorting_network(n)`, and about 8 per prefix: the sum, the
      candidate, two compares, three selects; beyond, by pairwise comparisons, about 5 n^2
      per router: compare, mask, select, two sums) and its threshold (4 per arc);
    * bookkeeping: finiteness and sign checks, ring writes, totals (about 6 per arc).
    """
    n2, M, W = n * n, substeps, max(window - 1, 1)
    elementary = 30 + 35  # exp_neg and log1p_unit as plain arithmetic
    query = 5 * n + 6
    if n <= NETWORK_MAX:
        projection = n + 2 * len(sorting_network(n)) + 8 * n
    else:
        projection = 5 * n2
    parts = {
        "inflow_pieces": n2 * (2 * 12 * W + 2 * 4 * W + 12),
        "cumulative_inflow": 4 * n2 + 2 * M * n * query + n2 * query,
        "service_and_stages": M * n * (4 * (14 + elementary) + 30),
        "observations": n2 * 16 * M,
        "demand_flight_window": n * 12 * W + 4 * n2 + 8 * n * window,
        "policy": n2 * (20 + elementary + 3 + 4) + n * projection,
        "bookkeeping": 6 * n2,
    }
    return dict(parts, total=int(sum(parts.values())))


def machine_peak(dtype, size: int = 2048, repeats: int = 5) -> dict:
    """Operations per second of a `size`-square matmul (2 size^3 operations) on the default
    device in `dtype`, best of `repeats` after compiling: the peak we compare against."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(k1, (size, size), dtype)
    b = jax.random.normal(k2, (size, size), dtype)
    f = jax.jit(jnp.matmul)
    best = H.timed(lambda: f(a, b), repeats).wall_s
    return {"size": size, "wall_s": best, "ops_per_s": 2.0 * size**3 / best}


def _time_appb(batch, args, dtype, ticks: int, chunk=None):
    """(first call, compile seconds, best steady wall, steady walls, solution) of one
    App.-B configuration of `ticks` ticks (4 saves); `chunk`: `simulate(chunk=)`, passed
    only when given (a tree without it still runs)."""
    integ = dl.Fast() if args.substeps is None else dl.Fast(args.substeps)
    extra = {} if chunk is None else {"chunk": chunk}
    t = H.timed(
        lambda: dl.simulate(
            batch,
            POLICY,
            step_size=args.step_size,
            tick=args.tick,
            horizon=ticks * args.tick,
            n_save=4,
            integrator=integ,
            dtype=dtype,
            **extra,
        ),
        args.repeats,
        min_time=args.min_time,
    )
    return t.first_call_s, t.compile_s, t.wall_s, t.walls_s, t.result


def _chunk_arg(label: str, B: int, n: int, dtype=jnp.float64, ticks_per_save: int = 1):
    """(`simulate(chunk=)` for a `--chunks` label, the chunk size it means: None for the
    whole batch, '?' where this tree has no `default_chunk`; the layout `simulate` runs,
    `default_layout`'s choice, "batch-first" where this tree has none)."""
    share = -(-B // jax.local_device_count())
    try:
        from dlbfluid._simulate import default_layout

        layout = default_layout(dtype, n, share, dl.Fast(), ticks_per_save)
    except ImportError:
        layout = "batch-first"
    if label == "whole":
        return B, None, layout
    if label != "default":
        return int(label), min(int(label), B), layout
    try:
        from dlbfluid._simulate import _chosen_chunk

        return None, _chosen_chunk(None, n, share, layout), layout
    except ImportError:
        pass
    try:
        from dlbfluid._simulate import default_chunk
    except ImportError:
        return None, "?", layout
    size = default_chunk(n)
    return None, None if size is None or size >= B else size, layout


def _slope(xs, ys) -> float:
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def main_appb(args, argv=None):
    """The `--appb` run: one JSON record (stdout and `--out`), a table on stderr."""
    from dlbfluid._simulate import _window_width

    t_all = time.perf_counter()
    K = args.ticks
    meta = {
        "benchmark": "simulate_appb",
        **H.environment("devices", "backend"),
        "policy": POLICY,
        "tick": args.tick,
        "ticks": K,
        "profile_horizon_s": args.profile_horizon or 2 * K * args.tick,
        "chunks": args.chunks,
        "step_size": args.step_size,
        "integrator": {"fast": {"substeps": "auto" if args.substeps is None else args.substeps}},
        "scenarios": "benchmarks/_batches.py::appb_batch (dl.generate, seed App. B)",
        "seed": args.seed,
        "repeats": args.repeats,
        **H.environment("jax_version", "python", "cpu_count", "loadavg_start"),
        "command": H.command(argv),
    }
    peaks = {d: machine_peak(getattr(jnp, d)) for d in args.dtypes}
    for d, pk in peaks.items():
        H.log(f"peak ({d} matmul {pk['size']}^2): {pk['ops_per_s']:.3g} ops/s")
    results, scaling = [], {}
    for n in args.cells:
        span = args.profile_horizon or 2 * K * args.tick
        full = appb_batch(n, max(args.batches), seed=args.seed, horizon=span)
        fast = dl.Fast() if args.substeps is None else dl.Fast(args.substeps)
        # (`for_batch` picks the sub-steps; a version without it has a fixed default)
        if hasattr(fast, "for_batch"):
            M = fast.substeps or fast.for_batch(full, args.tick).max_substeps
        else:
            M = fast.substeps
        tau = np.where(np.asarray(full.allowed), np.asarray(full.latency), 0.0)
        window = _window_width(
            np.asarray(full.arrival_times),
            float(tau.max() + 2.0 * args.tick),
            np.asarray(full.arrival_rates),
        )
        ops = ops_per_tick(n, M, window)
        for d in args.dtypes:
            dtype = getattr(jnp, d)
            for B, label in [(B, c) for B in args.batches for c in args.chunks]:
                batch = jax.tree_util.tree_map(lambda a: a[:B] if eqx.is_array(a) else a, full)
                chunk, size, layout = _chunk_arg(label, B, n, dtype, K // 4)
                first, comp, wall, walls, sol = _time_appb(batch, args, dtype, K, chunk)
                n_ok = int(np.sum(np.asarray(sol.status) == dl.STATUS["success"]))
                sps = B * K / wall
                res = {
                    "n_cells": n,
                    "batch": B,
                    "dtype": d,
                    "chunk": label,
                    "chunk_size": size,
                    "layout": layout,
                    "substeps": M,
                    "compile_s": comp,
                    "first_call_s": first,
                    "wall_s": wall,
                    "steady_walls_s": walls,
                    "scenario_ticks_per_s": sps,
                    "us_per_scenario_tick": 1e6 / sps,
                    "ops_per_scenario_tick": ops["total"],
                    "ops_breakdown": ops,
                    "achieved_ops_per_s": ops["total"] * sps,
                    "fraction_of_peak": ops["total"] * sps / peaks[d]["ops_per_s"],
                    "n_success": n_ok,
                }
                results.append(res)
                H.log(
                    f"[appb n={n} B={B} {d} M={M} chunk={label}:{res['chunk_size']} {layout}] "
                    f"compile {comp:.1f}s wall {wall:.3f}s "
                    f"{sps:.4g} scenario-ticks/s ({1e6 / sps:.2f} us), "
                    f"{ops['total']} ops/tick, {100 * res['fraction_of_peak']:.2f}% of peak, "
                    f"{n_ok}/{B} ok"
                )
        if n == max(args.cells) or n == 10:
            # Horizon: twice the ticks on the largest batch, float64 (or the first dtype).
            d = args.dtypes[0]
            B = max(args.batches)
            batch = jax.tree_util.tree_map(lambda a: a[:B] if eqx.is_array(a) else a, full)
            c0 = args.chunks[0]  # (the scaling exponents are those of the first --chunks)
            _, _, w2, _, _ = _time_appb(
                batch, args, getattr(jnp, d), 2 * K, _chunk_arg(c0, B, n)[0]
            )
            w1 = next(
                r["wall_s"]
                for r in results
                if (r["n_cells"], r["batch"], r["dtype"], r["chunk"]) == (n, B, d, c0)
            )
            scaling[f"horizon_n{n}_B{B}_{d}"] = {
                "ticks": [K, 2 * K],
                "wall_s": [w1, w2],
                "exponent": _slope([K, 2 * K], [w1, w2]),
            }
        del full
    for d in args.dtypes:
        rows = [r for r in results if r["dtype"] == d and r["chunk"] == args.chunks[0]]
        big = [b for b in args.batches if b >= 100]
        if len(big) >= 2:
            for n in args.cells:
                rs = [r for r in rows if r["n_cells"] == n and r["batch"] in big]
                scaling[f"batch_n{n}_{d}"] = {
                    "batches": [r["batch"] for r in rs],
                    "wall_s": [r["wall_s"] for r in rs],
                    "exponent": _slope([r["batch"] for r in rs], [r["wall_s"] for r in rs]),
                }
        Bm = max(args.batches)
        cs = [n for n in args.cells if n >= 5]
        if len(cs) >= 2:
            us = [
                next(
                    r["us_per_scenario_tick"] for r in rows if (r["n_cells"], r["batch"]) == (n, Bm)
                )
                for n in cs
            ]
            scaling[f"cells_B{Bm}_{d}"] = {
                "cells": cs,
                "us_per_scenario_tick": us,
                "exponent": _slope(cs, us),
                "exponent_last_pair": _slope(cs[-2:], us[-2:]),
            }
    for key, v in scaling.items():
        H.log(f"scaling {key}: exponent {v['exponent']:.2f}")
    meta["loadavg_end"] = H.loadavg()
    meta["total_s"] = time.perf_counter() - t_all
    out = H.emit(dict(meta, machine_peak=peaks, results=results, scaling=scaling), args.out)
    header = ("cells", "batch", "dtype", "chunk", "layout", "M", "compile_s", "us/tick")
    header += ("ticks/s", "ops/tick", "%peak")
    rows = [
        (r["n_cells"], r["batch"], r["dtype"], f"{r['chunk']}:{r['chunk_size']}", r["layout"],
         r["substeps"], f"{r['compile_s']:.1f}", f"{r['us_per_scenario_tick']:.2f}",
         f"{r['scenario_ticks_per_s']:.4g}", r["ops_per_scenario_tick"],
         f"{100 * r['fraction_of_peak']:.2f}")
        for r in results
    ]  # fmt: skip
    H.log(H.markdown_table(header, rows, align="r" * len(header)))
    H.log(f"total {meta['total_s']:.0f}s")
    return out
