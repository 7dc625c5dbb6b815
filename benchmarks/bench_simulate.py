"""Throughput of `dlbfluid.simulate` against the scipy method-of-steps reference.

A *scenario-step* is one tick of one scenario, so a batch of B scenarios over a horizon of
K ticks is B*K scenario-steps. For every (cells, batch, path) this measures

* `compile_s`: time the first call spent tracing, lowering and compiling, i.e. the union
  of the `/jax/core/compile/*` time spans that `jax.monitoring` reports during it (robust to
  run-time noise); `first_call_s` minus `wall_s` is reported as well;
* `wall_s`: the best steady wall time of up to `--repeats` calls (fewer when one call
  already takes `--min-time` seconds), each ended by `jax.block_until_ready`; it includes
  the host-side work `simulate` does on every call;
* `scenario_steps_per_s` = B*K / wall_s;
* `max_abs_err`: max |N - N_ref| over the saved ticks of the first `--n-ref` scenarios of
  the batch, N_ref being the float64 scipy reference (`tests/reference.py`) at
  rtol = atol = `--ref-tol`.

The peer is the same scipy reference looping scenario by scenario, one tick at a time, at
*matched accuracy*: it is run on the first `--n-ref` scenarios with every method of
`--peer-methods` at every tolerance of `--peer-tols` (rtol = atol), and for every
configuration the fastest candidate whose error against the tight reference (on the same
scenarios) is at most the dlbfluid error is taken. If no candidate is accurate enough the
most accurate one is used and `matched` is false: the peer is then faster than it would be
at equal accuracy, so the speedup is a lower bound. (The reference integrates every tick in
pieces between routing switches, so its error is far below the tolerance and its cost is
mostly per-call Python overhead; the tolerance barely changes its speed.)
`speedup` = dlbfluid throughput / peer throughput.

Combinations whose estimated time (scaled linearly in the batch from the previous batch
measured on the same cells and path) exceeds `--budget-s` are reported as skipped, except
the batches of `--never-skip` (default 1, 100, 1000: the target batch size is always run).

`--appb` measures instead the paper's probe cadence against the machine's arithmetic floor
(issue #11): App.-B scenarios from the seed's generator (`appb_batch`), tick 5 ms,
`Fast()` with its default sub-steps, flow-grad, cells 2/5/10/20, batches 1/100/1000,
float64 and float32. Per configuration it reports the `layout` `simulate` ran
(`default_layout`'s choice), `scenario_ticks_per_s`,
`us_per_scenario_tick`, `ops_per_scenario_tick` (floating-point operations counted from
the algorithm, `ops_per_tick`), the achieved operation rate and its fraction of the peak of
a large matmul of the same dtype timed in the same run (`machine_peak`); then the measured
scaling exponents of the cost in batch (100 to 1000), horizon (K to 2K ticks) and cells.

One JSON object goes to stdout (and to `--out`), a table to stderr. Run, e.g.:

    PYTHONUNBUFFERED=1 python benchmarks/bench_simulate.py --quick
    PYTHONUNBUFFERED=1 python benchmarks/bench_simulate.py \
        --out benchmarks/results/simulate_cpu.json
    PYTHONUNBUFFERED=1 python benchmarks/bench_simulate.py --appb \
        --out benchmarks/results/simulate_appb_cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from helpers import random_scenario  # noqa: E402
from reference import reference_simulate  # noqa: E402

import dlbfluid as dl  # noqa: E402
from dlbfluid._projection import NETWORK_MAX, sorting_network  # noqa: E402

dl.enable_x64()

POLICY = "flow-grad"


def log(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def _floats(s: str) -> list[float]:
    return [float(v) for v in s.split(",") if v.strip()]


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v.strip()]


def check_out(p: argparse.ArgumentParser, path: str | None) -> None:
    """`--out`: refused before any work unless a writable file path in an existing
    directory (shared by the benchmark scripts)."""
    if path is None:
        return
    out = Path(path)
    if out.is_dir():
        p.error(f"--out {path}: is a directory (allowed: a file path)")
    parent = out.resolve().parent
    if not parent.is_dir():
        p.error(f"--out {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        p.error(f"--out {path}: not writable")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="batches 1,100 and cells 2,5")
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
    p.add_argument("--batches", type=_ints, default=None, help="default 1,100,1000,10000")
    p.add_argument("--cells", type=_ints, default=None, help="default 2,5,10")
    p.add_argument("--paths", default="fast,accurate", help="comma list of fast, accurate")
    p.add_argument("--horizon", type=float, default=5.0, help="simulated seconds (default 5)")
    p.add_argument("--tick", type=float, default=0.05)
    p.add_argument("--step-size", type=float, default=0.2)
    p.add_argument(
        "--n-save",
        type=int,
        default=20,
        help="save intervals (errors are measured at the saved ticks)",
    )
    p.add_argument(
        "--substeps", type=int, default=None, help="Fast(substeps) (default: chosen per batch)"
    )
    p.add_argument("--rtol", type=float, default=1e-8, help="Accurate(rtol)")
    p.add_argument("--atol", type=float, default=1e-10, help="Accurate(atol)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float64")
    p.add_argument(
        "--n-ref",
        type=int,
        default=5,
        help="scenarios run through scipy for the error and the peer timing",
    )
    p.add_argument("--ref-tol", type=float, default=1e-12, help="tight reference rtol=atol")
    p.add_argument(
        "--peer-tols",
        type=_floats,
        default=[1e-4, 1e-6, 1e-8],
        help="peer rtol=atol candidates for matching the accuracy",
    )
    p.add_argument(
        "--peer-methods",
        default="DOP853,RK45",
        help="solve_ivp methods tried for the peer (comma list)",
    )
    p.add_argument("--repeats", type=int, default=3, help="steady calls, best taken")
    p.add_argument(
        "--min-time",
        type=float,
        default=10.0,
        help="stop repeating once the steady calls took this long in total",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=120.0,
        help="skip a combination whose estimated time exceeds this (default 120: the "
        "default grid then takes about 12 min on a 2-core CPU, estimated from a run at 180)",
    )
    p.add_argument(
        "--never-skip",
        type=_ints,
        default=[1, 100, 1000],
        help="batch sizes measured whatever --budget-s says",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args(argv)
    if a.substeps is not None and a.substeps < 1:
        p.error(f"--substeps: {a.substeps} is invalid: expected an integer >= 1")
    check_out(p, a.out)
    if a.appb:
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
    if a.batches is None:
        a.batches = [1, 100] if a.quick else [1, 100, 1000, 10000]
    if a.cells is None:
        a.cells = [2, 5] if a.quick else [2, 5, 10]
    a.paths = [s.strip() for s in a.paths.split(",") if s.strip()]
    for s in a.paths:
        if s not in ("fast", "accurate"):
            p.error(f"--paths: unknown path {s!r} (expected fast, accurate)")
    a.batches = sorted(set(a.batches))
    a.peer_tols = sorted(set(a.peer_tols), reverse=True)  # loosest first
    a.peer_methods = [s.strip() for s in a.peer_methods.split(",") if s.strip()]
    a.peer_cands = [(m, t) for m in a.peer_methods for t in a.peer_tols]
    K = round(a.horizon / a.tick)
    if K < 1 or abs(K * a.tick - a.horizon) > 1e-9 * max(a.horizon, 1.0):
        p.error("--horizon must be a positive whole number of ticks")
    a.K = K
    a.n_save = max(1, min(a.n_save, K))
    return a


# ----------------------------------------------------------------------------------------
# Scenarios
# ----------------------------------------------------------------------------------------


def fast_stack(scenarios):
    """`dl.stack_scenarios` for scenarios of equal shape, stacking leaves with numpy.

    `stack_scenarios` pads every scenario first (about 10 ms each), which makes a batch of
    10000 take minutes; with equal shapes padding is a no-op and the result is identical
    (checked against `stack_scenarios` on the first few scenarios below)."""
    scenarios = [s.strip() for s in scenarios]
    if hasattr(scenarios[0].service, "with_laws"):
        # The service models present are static: give every table the batch's set.
        laws = tuple(dict.fromkeys(m for s in scenarios for m in s.service.laws))
        est = tuple(dict.fromkeys(m for s in scenarios for m in s.estimate.laws))
        scenarios = [
            dataclasses.replace(
                s, service=s.service.with_laws(laws), estimate=s.estimate.with_laws(est)
            )
            for s in scenarios
        ]
    parts = [eqx.partition(s, eqx.is_array) for s in scenarios]
    dyn = [d for d, _ in parts]
    treedef = jax.tree_util.tree_structure(dyn[0])
    leaves = [jax.tree_util.tree_leaves(d) for d in dyn]
    stacked = [
        jnp.asarray(np.stack([np.asarray(lv[k]) for lv in leaves])) for k in range(len(leaves[0]))
    ]
    return eqx.combine(jax.tree_util.tree_unflatten(treedef, stacked), parts[0][1])


def appb_batch(n_cells: int | None, B: int, *, seed: int = 0, horizon: float = 600.0):
    """`B` scenarios of the seed's App. B generator (`dl.generate`, stream `seed`), all with
    `n_cells` cells (`None`: the generator's own 2-10), as one padded batch; arrival
    profiles cover `horizon` seconds. Equal shapes are stacked with `fast_stack`."""
    lo, hi = (2, 10) if n_cells is None else (n_cells, n_cells)
    gen = dl.generate(seed, B, min_cells=lo, max_cells=hi)
    parsed = [
        dl.scenario_from_dict(d, allow_overload=True)
        for d in dl.scenario_dicts(gen, horizon=horizon)
    ]
    if n_cells is None:
        return dl.stack_scenarios(parsed)
    return fast_stack(parsed)


class ScenarioPool:
    """Random scenarios of `n` cells, parsed lazily, the same prefix for every batch size."""

    def __init__(self, n: int, seed: int):
        self.n = n
        self.rng = np.random.default_rng([seed, n])
        self.dicts: list[dict] = []
        self.parsed: list = []
        self.checked = False

    def dict(self, i: int) -> dict:
        while len(self.dicts) <= i:
            self.dicts.append(random_scenario(self.rng, self.n))
        return self.dicts[i]

    def batch(self, B: int):
        t0 = time.perf_counter()
        while len(self.parsed) < B:
            self.parsed.append(dl.scenario_from_dict(self.dict(len(self.parsed))))
        out = fast_stack(self.parsed[:B])
        if not self.checked:
            m = min(B, 4)
            ref = dl.stack_scenarios(self.parsed[:m])
            got = jax.tree_util.tree_map(lambda a: a[:m], eqx.filter(out, eqx.is_array))
            ok = all(
                x.dtype == y.dtype and bool(jnp.all(x == y))
                for x, y in zip(
                    jax.tree_util.tree_leaves(eqx.filter(ref, eqx.is_array)),
                    jax.tree_util.tree_leaves(got),
                )
            )
            if not ok:
                raise RuntimeError("fast_stack disagrees with dlbfluid.stack_scenarios")
            self.checked = True
        return out, time.perf_counter() - t0


# ----------------------------------------------------------------------------------------
# The scipy peer
# ----------------------------------------------------------------------------------------


def run_references(pool: ScenarioPool, args, save_ticks):
    """Tight reference and the peer candidates on the first n_ref scenarios.

    Returns dict with `ref` (list of (n_save+1, n) arrays) and `peer[(method, tol)]` =
    {"times": [...], "errs": [...]} per scenario."""
    kw = dict(step_size=args.step_size, tick=args.tick, horizon=args.horizon)
    ref, peer = [], {c: {"times": [], "errs": []} for c in args.peer_cands}
    t_start = time.perf_counter()
    for i in range(args.n_ref):
        d = pool.dict(i)
        r = reference_simulate(
            d, POLICY, rtol=args.ref_tol, atol=args.ref_tol, method="DOP853", **kw
        )
        Nref = np.asarray(r["N"])[save_ticks]
        ref.append(Nref)
        for method, tol in args.peer_cands:
            t0 = time.perf_counter()
            rp = reference_simulate(d, POLICY, rtol=tol, atol=tol, method=method, **kw)
            dt = time.perf_counter() - t0
            c = peer[(method, tol)]
            c["times"].append(dt)
            c["errs"].append(float(np.max(np.abs(np.asarray(rp["N"])[save_ticks] - Nref))))
    log(
        f"[n={pool.n}] scipy reference + peer on {args.n_ref} scenarios: "
        f"{time.perf_counter() - t_start:.1f}s"
    )
    for (method, tol), c in peer.items():
        tt = c["times"]
        log(
            f"    peer {method} rtol=atol={tol:g}: {args.K * len(tt) / sum(tt):10.1f} "
            f"scenario-steps/s, max err {max(c['errs']):.2e}"
        )
    return {"ref": ref, "peer": peer}


def peer_summary(refs, args, m: int) -> list[dict]:
    out = []
    for (method, tol), c in refs["peer"].items():
        out.append(
            {
                "method": method,
                "rtol": tol,
                "atol": tol,
                "scenario_steps_per_s": args.K * len(c["times"]) / sum(c["times"]),
                "max_abs_err": max(c["errs"][:m]),
                "n_scenarios_timed": len(c["times"]),
                "wall_s_per_scenario": sum(c["times"]) / len(c["times"]),
            }
        )
    return out


def match_peer(refs, args, m: int, err: float) -> dict:
    """The fastest peer candidate whose error on the first m scenarios is <= err."""
    cands = peer_summary(refs, args, m)
    ok = [c for c in cands if c["max_abs_err"] <= err]
    if ok:
        best = dict(max(ok, key=lambda c: c["scenario_steps_per_s"]), matched=True)
    else:
        best = dict(min(cands, key=lambda c: c["max_abs_err"]), matched=False)
    return best


# ----------------------------------------------------------------------------------------
# dlbfluid
# ----------------------------------------------------------------------------------------


def make_integrator(path: str, args):
    if path == "fast":
        return dl.Fast() if args.substeps is None else dl.Fast(args.substeps)
    return dl.Accurate(rtol=args.rtol, atol=args.atol)


_SPANS: list[tuple[str, float, float]] = []


def _on_span(name, start, end, **kw):
    _SPANS.append((name, start, end))


jax.monitoring.register_event_time_span_listener(_on_span)


def compile_seconds() -> float:
    """Union of the compile-related time spans recorded since `_SPANS` was cleared."""
    iv = sorted((s, e) for name, s, e in _SPANS if name.startswith("/jax/core/compile/"))
    total, cur_s, cur_e = 0.0, None, None
    for s, e in iv:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def run_dlbfluid(batch, path: str, args, dtype, *, horizon=None, n_save=None, chunk=None):
    """One compiling call, then the steady calls: (solution, first call, compile seconds,
    best steady wall, steady walls, recompiled). `horizon`, `n_save`: default the args'.
    `chunk`: `simulate(chunk=)`, passed only when given (a tree without it still runs)."""
    integ = make_integrator(path, args)
    horizon = args.horizon if horizon is None else horizon
    n_save = args.n_save if n_save is None else n_save
    extra = {} if chunk is None else {"chunk": chunk}

    def call():
        t0 = time.perf_counter()
        sol = dl.simulate(
            batch,
            POLICY,
            step_size=args.step_size,
            tick=args.tick,
            horizon=horizon,
            n_save=n_save,
            integrator=integ,
            dtype=dtype,
            **extra,
        )
        jax.block_until_ready(sol.N)
        return sol, time.perf_counter() - t0

    _SPANS.clear()
    sol, first = call()
    compile_s = min(compile_seconds(), first)
    _SPANS.clear()
    walls = []
    while len(walls) < args.repeats and (not walls or sum(walls) < args.min_time):
        _, w = call()
        walls.append(w)
    recompiled = compile_seconds() > 0.05
    wall = min(walls)
    return sol, first, compile_s, wall, walls, recompiled


def expected_time(compile_s: float, wall: float, args) -> float:
    """First call (compile + one run) plus the steady calls run_dlbfluid will make."""
    n_steady = 1 if wall >= args.min_time else min(args.repeats, math.ceil(args.min_time / wall))
    return compile_s + wall * (1 + max(n_steady, 1))


# ----------------------------------------------------------------------------------------


def fmt_table(results, meta) -> str:
    hdr = (
        f"{'cells':>5} {'batch':>6} {'path':>8} {'compile_s':>9} {'wall_s':>8} "
        f"{'steps/s':>10} {'max_err':>8} | {'peer':>12} {'peer steps/s':>12} "
        f"{'peer_err':>8} | {'speedup':>8}"
    )
    lines = [
        f"dlbfluid.simulate vs scipy method of steps ({'/'.join(meta['peer_methods'])}); policy "
        f"{meta['policy']}, tick {meta['tick']}, horizon {meta['horizon']} "
        f"({meta['ticks']} ticks), dtype {meta['dtype']}, backend {meta['backend']}, "
        f"devices {meta['devices']}",
        hdr,
        "-" * len(hdr),
    ]
    for r in results:
        head = f"{r['n_cells']:>5} {r['batch']:>6} {r['path']:>8} "
        if r.get("skipped"):
            lines.append(head + f"skipped: estimated {r['estimated_s']:.0f}s > budget")
            continue
        p = r["peer"]
        tol = f"{p['method']} {p['rtol']:.0e}" + ("" if p["matched"] else "*")
        lines.append(
            head + f"{r['compile_s']:>9.2f} {r['wall_s']:>8.3f} "
            f"{r['scenario_steps_per_s']:>10.4g} {r['max_abs_err']:>8.1e} | {tol:>12} "
            f"{p['scenario_steps_per_s']:>12.4g} {p['max_abs_err']:>8.1e} | "
            f"{r['speedup']:>7.1f}x"
        )
    lines.append(
        "steps/s = scenario-steps (ticks x scenarios) per second; * = no peer "
        "tolerance reached the dlbfluid error (speedup is then a lower bound)"
    )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# --appb: the probe cadence against the arithmetic floor
# ----------------------------------------------------------------------------------------


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
    jax.block_until_ready(f(a, b))
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(a, b))
        best = min(best, time.perf_counter() - t0)
    return {"size": size, "wall_s": best, "ops_per_s": 2.0 * size**3 / best}


def _time_appb(batch, args, dtype, ticks: int, chunk=None):
    """(first call, compile seconds, best steady wall, steady walls, solution) of one
    App.-B configuration of `ticks` ticks (`run_dlbfluid`, 4 saves)."""
    sol, first, comp, wall, walls, _ = run_dlbfluid(
        batch, "fast", args, dtype, horizon=ticks * args.tick, n_save=4, chunk=chunk
    )
    return first, comp, wall, walls, sol


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


def main_appb(args):
    from dlbfluid._simulate import _window_width

    t_all = time.perf_counter()
    K = args.ticks
    meta = {
        "benchmark": "simulate_appb",
        "devices": [str(d) for d in jax.devices()],
        "backend": jax.default_backend(),
        "policy": POLICY,
        "tick": args.tick,
        "ticks": K,
        "profile_horizon_s": args.profile_horizon or 2 * K * args.tick,
        "chunks": args.chunks,
        "step_size": args.step_size,
        "integrator": {"fast": {"substeps": "auto" if args.substeps is None else args.substeps}},
        "scenarios": "benchmarks/bench_simulate.py::appb_batch (dl.generate, seed App. B)",
        "seed": args.seed,
        "repeats": args.repeats,
        "jax_version": jax.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
    }
    peaks = {d: machine_peak(getattr(jnp, d)) for d in args.dtypes}
    for d, pk in peaks.items():
        log(f"peak ({d} matmul {pk['size']}^2): {pk['ops_per_s']:.3g} ops/s")
    results, scaling = [], {}
    for n in args.cells:
        span = args.profile_horizon or 2 * K * args.tick
        full = appb_batch(n, max(args.batches), seed=args.seed, horizon=span)
        fast = make_integrator("fast", args)
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
                log(
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
        log(f"scaling {key}: exponent {v['exponent']:.2f}")
    meta["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    meta["total_s"] = time.perf_counter() - t_all
    out = dict(meta, machine_peak=peaks, results=results, scaling=scaling)
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    hdr = f"{'cells':>5} {'batch':>6} {'dtype':>8} {'chunk':>12} {'layout':>11} {'M':>2} "
    hdr += f"{'compile_s':>9} "
    hdr += f"{'us/tick':>8} "
    hdr += f"{'ticks/s':>10} {'ops/tick':>9} {'%peak':>6}"
    lines = [hdr, "-" * len(hdr)]
    for r in results:
        lines.append(
            f"{r['n_cells']:>5} {r['batch']:>6} {r['dtype']:>8} "
            f"{r['chunk'] + ':' + str(r['chunk_size']):>12} {r['layout']:>11} {r['substeps']:>2} "
            f"{r['compile_s']:>9.1f} {r['us_per_scenario_tick']:>8.2f} "
            f"{r['scenario_ticks_per_s']:>10.4g} {r['ops_per_scenario_tick']:>9} "
            f"{100 * r['fraction_of_peak']:>6.2f}"
        )
    log("\n".join(lines))
    log(f"total {meta['total_s']:.0f}s")
    return out


def main(argv=None):
    args = parse_args(argv)
    # Every core a CPU device, as `dlbfluid experiment` runs (`DLBFLUID_CPU_DEVICES=1`: one);
    # a tree without `use_cpu_cores` runs as XLA_FLAGS says.
    getattr(dl, "use_cpu_cores", lambda: None)()
    if args.appb:
        return main_appb(args)
    dtype = jnp.float32 if args.dtype == "float32" else jnp.float64
    t_all = time.perf_counter()
    K = args.K
    save_ticks = (np.arange(args.n_save + 1) * K) // args.n_save
    meta = {
        "benchmark": "simulate",
        "devices": [str(d) for d in jax.devices()],
        "backend": jax.default_backend(),
        "dtype": args.dtype,
        "policy": POLICY,
        "tick": args.tick,
        "horizon": args.horizon,
        "ticks": K,
        "profile_horizon_s": args.profile_horizon or 2 * K * args.tick,
        "chunks": args.chunks,
        "step_size": args.step_size,
        "n_save": args.n_save,
        "integrators": {
            "fast": {"substeps": "auto" if args.substeps is None else args.substeps},
            "accurate": {"rtol": args.rtol, "atol": args.atol},
        },
        "peer": "tests/reference.py::reference_simulate, scenario by scenario",
        "peer_methods": args.peer_methods,
        "peer_tols": args.peer_tols,
        "ref_tol": args.ref_tol,
        "n_ref": args.n_ref,
        "repeats": args.repeats,
        "budget_s": args.budget_s,
        "never_skip": args.never_skip,
        "seed": args.seed,
        "scenarios": "tests/helpers.py::random_scenario(rng, n) (load 0.7, max_tau 0.2)",
        "jax_version": jax.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]) if argv is None else None,
    }
    log(
        f"devices {meta['devices']}, backend {meta['backend']}, dtype {args.dtype}, "
        f"{K} ticks per scenario"
    )
    results = []
    for n in args.cells:
        pool = ScenarioPool(n, args.seed)
        refs = run_references(pool, args, save_ticks)
        for path in args.paths:
            last = None  # (batch, wall, compile) of the previous measured batch
            for B in args.batches:
                if last is not None and B not in args.never_skip:
                    Bp, wp, cp = last
                    est = expected_time(cp, wp * B / Bp, args)
                    if est > args.budget_s:
                        log(
                            f"[n={n} B={B} {path}] skipped: estimated {est:.0f}s > "
                            f"--budget-s {args.budget_s:g}"
                        )
                        results.append(
                            {
                                "n_cells": n,
                                "batch": B,
                                "path": path,
                                "skipped": True,
                                "estimated_s": est,
                                "reason": "estimated time exceeds --budget-s",
                            }
                        )
                        continue
                batch, build_s = pool.batch(B)
                sol, first, compile_s, wall, walls, recompiled = run_dlbfluid(
                    batch, path, args, dtype
                )
                last = (B, wall, compile_s)
                m = min(B, args.n_ref)
                N = np.asarray(sol.N[:m], dtype=np.float64)
                err = float(max(np.max(np.abs(N[i] - refs["ref"][i])) for i in range(m)))
                n_ok = int(np.sum(np.asarray(sol.status) == dl.STATUS["success"]))
                sps = B * K / wall
                peer = match_peer(refs, args, m, err)
                res = {
                    "n_cells": n,
                    "batch": B,
                    "path": path,
                    "compile_s": compile_s,
                    "first_call_s": first,
                    "first_minus_steady_s": first - wall,
                    "recompiled_in_steady_calls": recompiled,
                    "wall_s": wall,
                    "steady_walls_s": walls,
                    "scenario_steps_per_s": sps,
                    "max_abs_err": err,
                    "err_scenarios": m,
                    "n_success": n_ok,
                    "batch_build_s": build_s,
                    "peer": peer,
                    "peer_candidates": peer_summary(refs, args, m),
                    "speedup": sps / peer["scenario_steps_per_s"],
                }
                results.append(res)
                log(
                    f"[n={n} B={B} {path}] compile {compile_s:.2f}s, wall {wall:.3f}s, "
                    f"{sps:.4g} steps/s, err {err:.1e}, {n_ok}/{B} ok; peer {peer['method']} "
                    f"rtol {peer['rtol']:g}{'' if peer['matched'] else ' (unmatched)'}: "
                    f"{peer['scenario_steps_per_s']:.4g} steps/s -> x{res['speedup']:.1f}"
                )
                del sol, batch
    meta["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    meta["total_s"] = time.perf_counter() - t_all
    out = dict(meta, results=results)
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    log(fmt_table(results, meta))
    log(f"total {meta['total_s']:.0f}s")
    return out


if __name__ == "__main__":
    main()
