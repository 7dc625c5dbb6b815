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
(issue #11; `_appb.py` says what it reports). Timing, the environment record, the table and
`--out` come from `_harness.py`; the App.-B batches from `_batches.py`.

One JSON object goes to stdout (and to `--out`), a Markdown table to stderr. Run, e.g.:

    PYTHONUNBUFFERED=1 python benchmarks/bench_simulate.py --quick
    PYTHONUNBUFFERED=1 python benchmarks/bench_simulate.py \
        --out benchmarks/results/simulate_cpu.json
    PYTHONUNBUFFERED=1 python benchmarks/bench_simulate.py --appb \
        --out benchmarks/results/simulate_appb_cpu.json
"""

from __future__ import annotations

import argparse
import math
import time

import _appb
import _harness as H
import jax.numpy as jnp
import numpy as np
from _batches import check_stack, fast_stack

import dlbfluid as dl

H.add_tests_to_path()
from helpers import random_scenario  # noqa: E402
from reference import reference_simulate  # noqa: E402

dl.enable_x64()

POLICY = _appb.POLICY


def _floats(s: str) -> list[float]:
    return [float(v) for v in s.split(",") if v.strip()]


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        parents=[H.parent_parser(repeats=3, repeats_help="steady calls, best taken")],
    )
    p.add_argument("--quick", action="store_true", help="batches 1,100 and cells 2,5")
    _appb.add_arguments(p)
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
    a = H.parse(p, argv)
    if a.substeps is not None and a.substeps < 1:
        p.error(f"--substeps: {a.substeps} is invalid: expected an integer >= 1")
    if a.appb:
        return _appb.finish_arguments(p, a)
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
            check_stack(out, self.parsed[:B], m=4)
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
    H.log(
        f"[n={pool.n}] scipy reference + peer on {args.n_ref} scenarios: "
        f"{time.perf_counter() - t_start:.1f}s"
    )
    for (method, tol), c in peer.items():
        tt = c["times"]
        H.log(
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


def run_dlbfluid(batch, path: str, args, dtype):
    """One compiling call, then the steady calls (`H.timed`): (solution, first call, compile
    seconds, best steady wall, steady walls, recompiled)."""
    integ = make_integrator(path, args)
    t = H.timed(
        lambda: dl.simulate(
            batch,
            POLICY,
            step_size=args.step_size,
            tick=args.tick,
            horizon=args.horizon,
            n_save=args.n_save,
            integrator=integ,
            dtype=dtype,
        ),
        args.repeats,
        min_time=args.min_time,
    )
    return t.result, t.first_call_s, t.compile_s, t.wall_s, t.walls_s, t.recompiled


def expected_time(compile_s: float, wall: float, args) -> float:
    """First call (compile + one run) plus the steady calls run_dlbfluid will make."""
    n_steady = 1 if wall >= args.min_time else min(args.repeats, math.ceil(args.min_time / wall))
    return compile_s + wall * (1 + max(n_steady, 1))


# ----------------------------------------------------------------------------------------


def fmt_table(results, meta) -> str:
    header = ("cells", "batch", "path", "compile_s", "wall_s", "steps/s", "max_err")
    header += ("peer", "peer steps/s", "peer_err", "speedup")
    rows = []
    for r in results:
        head = (r["n_cells"], r["batch"], r["path"])
        if r.get("skipped"):
            rows.append(
                head + (f"skipped: estimated {r['estimated_s']:.0f}s > budget",) + ("",) * 7
            )
            continue
        p = r["peer"]
        rows.append(head + (
            f"{r['compile_s']:.2f}", f"{r['wall_s']:.3f}", f"{r['scenario_steps_per_s']:.4g}",
            f"{r['max_abs_err']:.1e}", f"{p['method']} {p['rtol']:.0e}" + ("" if p["matched"] else "*"),
            f"{p['scenario_steps_per_s']:.4g}", f"{p['max_abs_err']:.1e}", f"{r['speedup']:.1f}x",
        ))  # fmt: skip
    return "\n".join(
        [
            f"dlbfluid.simulate vs scipy method of steps ({'/'.join(meta['peer_methods'])}); "
            f"policy {meta['policy']}, tick {meta['tick']}, horizon {meta['horizon']} "
            f"({meta['ticks']} ticks), dtype {meta['dtype']}, backend {meta['backend']}, "
            f"devices {meta['devices']}",
            H.markdown_table(header, rows, align="rrlrrrrlrrr"),
            "steps/s = scenario-steps (ticks x scenarios) per second; * = no peer "
            "tolerance reached the dlbfluid error (speedup is then a lower bound)",
        ]
    )


def main(argv=None):
    args = parse_args(argv)
    # Every core a CPU device, as `dlbfluid experiment` runs (`DLBFLUID_CPU_DEVICES=1`: one);
    # a tree without `use_cpu_cores` runs as XLA_FLAGS says.
    getattr(dl, "use_cpu_cores", lambda: None)()
    if args.appb:
        return _appb.main_appb(args, argv)
    dtype = jnp.float32 if args.dtype == "float32" else jnp.float64
    t_all = time.perf_counter()
    K = args.K
    save_ticks = (np.arange(args.n_save + 1) * K) // args.n_save
    meta = {
        "benchmark": "simulate",
        **H.environment("devices", "backend"),
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
        **H.environment("jax_version", "python", "cpu_count", "loadavg_start"),
        "command": H.command(argv),
    }
    H.log(
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
                        H.log(
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
                H.log(
                    f"[n={n} B={B} {path}] compile {compile_s:.2f}s, wall {wall:.3f}s, "
                    f"{sps:.4g} steps/s, err {err:.1e}, {n_ok}/{B} ok; peer {peer['method']} "
                    f"rtol {peer['rtol']:g}{'' if peer['matched'] else ' (unmatched)'}: "
                    f"{peer['scenario_steps_per_s']:.4g} steps/s -> x{res['speedup']:.1f}"
                )
                del sol, batch
    meta["loadavg_end"] = H.loadavg()
    meta["total_s"] = time.perf_counter() - t_all
    out = H.emit(dict(meta, results=results), args.out)
    H.log(fmt_table(results, meta))
    H.log(f"total {meta['total_s']:.0f}s")
    return out


if __name__ == "__main__":
    main()
