"""The accelerator run of issue #11 item 4: 10,000 App.-B scenarios x 600 s of simulated
time at 1 ms ticks in float32 (6e9 scenario-ticks), measured on a chunk and projected.
(`--model requests`: the request-level twin's run of issue #32 item 4 instead,
accelerator_requests.py; `--model fluid`, the default, is described here.)

Goal: the full run in under `--goal-s` (60) seconds on one NVIDIA H200. The script does not
need the full run to say whether it would meet that: it simulates the first
`--horizon-fraction` of the 600 s on `--batch-fraction` of the 10,000 scenarios, measures
the steady throughput in scenario-ticks per second (one tick of one scenario) and projects
the full run as 10,000 x 600,000 / throughput. The scenarios are always drawn with arrival
profiles over the full 600 s (`dl.scenario_dicts(horizon=600)`), so the chunk simulates
exactly the first seconds of the full run's scenarios.

Protocol, per policy (`--policies`, default flow-grad: on a CPU the four policies with
latency or gradient costs tie as the most expensive, benchmarks/README.md):

1. compile: a first call on `--n-save` ticks; `compile_s` is the union of the
   `/jax/core/compile/*` spans that `jax.monitoring` reports during it. Every later call
   has the same shapes (the horizon is a traced argument), so it reuses that program
   (`recompiled` says if not).
2. probe: `--probe-ticks` ticks on the whole batch, best of `--repeats` calls, each ended
   by `jax.block_until_ready`.
3. chunk: one call of the chosen chunk of the horizon; its throughput gives the projection.
   With `--horizon-fraction auto` (the default unless `--scale` is given) the chunk is the
   whole 600 s when the probe projects that it fits in what is left of `--budget-s`
   (default 420 s, so that building the batch, compiling and the float64 comparison keep
   the command under 8 minutes), else the largest fraction (two significant digits) that
   fits: a faithful measurement (one long, real run) inside the budget.
4. float64 comparison (`--f64 chunk`, default; `off` skips): the first
   `--f64-batch-fraction` (0.1) of the batch over the same chunk, in float32 and in
   float64 (each compiled for that batch): the throughput ratio at equal batch and ticks,
   and the float32 error against float64: in N, max over scenarios, saved times and cells
   of |N32 - N64| / max(|N64|, 1e-3 max_{t,j} |N64|) (the floor is per scenario), also per
   saved time (how it grows along the horizon); in the final workload integral; in the
   mean latency of the chunk's second half (`Solution.mean_latency`). `mass_balance_residual`
   says how far each dtype's cumulative totals (arrivals, departures, drops) have drifted
   from the workload change they account for, `arrival_mass_error` how far the arrivals
   counted in each save interval are from their exact float64 integral. In auto mode the
   chunk is sized to two thirds of the budget left and the comparison is cut to the first
   ticks that fit the rest (`ticks` says how many).

`--scale F` runs F of the full run's scenario-ticks: sqrt(F) of the batch and sqrt(F) of
the horizon (e.g. `--scale 0.001`: 316 scenarios x 18.97 s, about 3 minutes on a 2-core
CPU). The projection from a part of the batch assumes throughput independent of batch
size, which holds on a CPU; on an accelerator a smaller batch uses it less well, so
projecting from one is pessimistic.

Also reported: statuses of every scenario (`success` count from `sol.status` against
`dl.STATUS["success"]`), device memory (`memory_stats()` peak bytes of device 0 where the
backend has them, else the process's peak RSS), the `Fast()` sub-steps that `simulate`
chooses for this batch and tick (`Fast.for_batch`), and metadata. One JSON object goes to
stdout (and `--out`), a Markdown table to stderr; timing, memory, the environment record and
`--out` come from `_harness.py`, the batch from `_batches.py`. No timing is asserted. Run,
e.g.:

    python benchmarks/accelerator.py                        # on the accelerator
    python benchmarks/accelerator.py --model requests       # the request-level twin
    python benchmarks/accelerator.py --scale 0.001 \\
        --out benchmarks/results/accelerator_cpu_scale.json  # on a CPU
"""

from __future__ import annotations

import argparse
import math
import time

import _harness as H
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from _batches import appb_batch

import dlbfluid as dl

dl.enable_x64()

FULL_SCENARIOS = 10_000
FULL_HORIZON = 600.0
TICK = 1e-3
GENERATOR_CELLS = (2, 10)


def _fraction_or_auto(s: str):
    if s.strip() == "auto":
        return "auto"
    try:
        return float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid value {s!r} (allowed: 'auto' or a number in (0, 1])"
        ) from None


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        parents=[H.parent_parser(repeats=2, repeats_help="probe calls, best kept")],
    )
    p.add_argument(
        "--policies",
        default="flow-grad",
        help="comma list of policies or 'all' (default flow-grad; allowed: "
        + ", ".join(dl.POLICY_NAMES)
        + ")",
    )
    p.add_argument("--scenarios", type=int, default=FULL_SCENARIOS, help="full batch (10000)")
    p.add_argument(
        "--horizon", type=float, default=FULL_HORIZON, help="full simulated seconds (600)"
    )
    p.add_argument("--tick", type=float, default=TICK, help="probe tick h in s (0.001)")
    p.add_argument("--dtype", default="float32", help="float32 (default) or float64")
    p.add_argument("--step-size", type=float, default=0.5, help="eta of the flow policies")
    p.add_argument(
        "--n-cells",
        type=int,
        default=None,
        help="cells per scenario, 2..10 (default: the generator's own 2-10, padded to 10)",
    )
    p.add_argument("--seed", type=int, default=0, help="generator seed (0)")
    p.add_argument(
        "--scale",
        type=float,
        default=None,
        help="run this fraction of the full scenario-ticks: sqrt of it of the batch and of "
        "the horizon (e.g. 0.001 on a CPU)",
    )
    p.add_argument(
        "--batch-fraction",
        type=float,
        default=None,
        help="fraction of --scenarios simulated (default 1, or sqrt(--scale))",
    )
    p.add_argument(
        "--horizon-fraction",
        type=_fraction_or_auto,
        default=None,
        help="fraction of --horizon simulated in the chunk, or 'auto' (the largest that fits "
        "--budget-s; default auto, or sqrt(--scale))",
    )
    p.add_argument("--probe-ticks", type=int, default=1000, help="ticks of the steady probe (1000)")
    p.add_argument("--n-save", type=int, default=10, help="save intervals of every call (10)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="wall-time budget of the whole command that 'auto' sizes the chunk to (420)",
    )
    p.add_argument("--goal-s", type=float, default=60.0, help="full-run goal in seconds (60)")
    p.add_argument(
        "--f64", default="chunk", help="float64 comparison on the chunk (default) or off"
    )
    p.add_argument(
        "--f64-batch-fraction",
        type=float,
        default=0.1,
        help="fraction of the batch in the float64 comparison (0.1)",
    )
    p.add_argument(
        "--layout",
        default="auto",
        help="simulate(layout=...): auto (default: simulate's default_layout, batch-last only"
        " for float32 on a CPU), batch-first or batch-last",
    )
    a = H.parse(p, argv)

    if a.policies.strip() == "all":
        a.policies = list(dl.POLICY_NAMES)
    else:
        a.policies = [s.strip() for s in a.policies.split(",") if s.strip()]
        if not a.policies:
            p.error(f"--policies {a.policies!r}: empty (allowed: all or a comma list)")
        for s in a.policies:
            if s not in dl.POLICY_NAMES:
                p.error(
                    f"--policies: unknown policy {s!r} (allowed: all, "
                    + ", ".join(dl.POLICY_NAMES)
                    + ")"
                )
    if a.dtype not in ("float32", "float64"):
        p.error(f"--dtype {a.dtype!r}: allowed float32, float64")
    if a.layout not in ("auto",) + dl.LAYOUTS:
        p.error(f"--layout {a.layout!r}: allowed auto, " + ", ".join(dl.LAYOUTS))
    if a.f64 not in ("chunk", "off"):
        p.error(f"--f64 {a.f64!r}: allowed chunk, off")
    if not (0 < a.f64_batch_fraction <= 1):
        p.error(f"--f64-batch-fraction {a.f64_batch_fraction}: allowed a number in (0, 1]")
    if a.n_cells is not None and not GENERATOR_CELLS[0] <= a.n_cells <= GENERATOR_CELLS[1]:
        p.error(f"--n-cells {a.n_cells}: allowed 2..10 (the App. B generator's range)")
    for name in ("scenarios", "probe_ticks", "repeats", "n_save"):
        v = getattr(a, name)
        if v < 1:
            p.error(f"--{name.replace('_', '-')} {v}: allowed an integer >= 1")
    for name in ("horizon", "tick", "budget_s", "goal_s"):
        v = getattr(a, name)
        if not (math.isfinite(v) and v > 0):
            p.error(f"--{name.replace('_', '-')} {v}: allowed a finite number > 0")
    if not (math.isfinite(a.step_size) and a.step_size >= 0):
        p.error(f"--step-size {a.step_size}: allowed a finite number >= 0")
    if a.scale is not None and not (0 < a.scale <= 1):
        p.error(f"--scale {a.scale}: allowed a number in (0, 1]")
    root = math.sqrt(a.scale) if a.scale is not None else None
    if a.batch_fraction is None:
        a.batch_fraction = root if root is not None else 1.0
    if a.horizon_fraction is None:
        a.horizon_fraction = root if root is not None else "auto"
    if not (0 < a.batch_fraction <= 1):
        p.error(f"--batch-fraction {a.batch_fraction}: allowed a number in (0, 1]")
    if a.horizon_fraction != "auto" and not (0 < a.horizon_fraction <= 1):
        p.error(f"--horizon-fraction {a.horizon_fraction}: allowed 'auto' or a number in (0, 1]")
    K = round(a.horizon / a.tick)
    if K < 1 or abs(K * a.tick - a.horizon) > 1e-9 * max(a.horizon, 1.0):
        p.error(f"--horizon {a.horizon}: allowed a whole number of ticks of {a.tick} s")
    a.K_full = K
    if a.n_save > K:
        p.error(f"--n-save {a.n_save}: allowed 1..{K} (the ticks of the full run)")
    a.B_run = max(1, round(a.scenarios * a.batch_fraction))
    a.K_probe = max(a.n_save, min(a.probe_ticks, K))
    if a.horizon_fraction != "auto":
        a.K_chunk = max(a.n_save, round(a.horizon_fraction * K))
        a.K_probe = min(a.K_probe, a.K_chunk)
    return a


# ----------------------------------------------------------------------------------------
# Scenarios
# ----------------------------------------------------------------------------------------


def build_batch(n_cells: int | None, B: int, *, seed: int, horizon: float):
    """`B` App.-B scenarios (`_batches.appb_batch`: stream `seed`, profiles over `horizon`),
    padded to 10 cells unless `n_cells` is given; and the histogram of their cell counts."""
    hi = GENERATOR_CELLS[1] if n_cells is None else n_cells
    batch = appb_batch(n_cells, B, seed=seed, horizon=horizon, pad_cells=hi)
    cells = np.bincount(np.asarray(batch.cell_mask).sum(axis=1), minlength=hi + 1)
    return batch, {str(k): int(v) for k, v in enumerate(cells) if v}


# ----------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------


def _simulate(batch, policy, integ, dtype, ticks, args):
    return lambda: dl.simulate(
        batch,
        policy,
        step_size=args.step_size,
        tick=args.tick,
        horizon=ticks * args.tick,
        n_save=args.n_save,
        integrator=integ,
        dtype=dtype,
        layout=None if args.layout == "auto" else args.layout,
    )


def call(batch, policy, integ, dtype, ticks, args):
    """One call of `ticks` ticks: (solution, wall seconds, compile seconds inside it)."""
    c = H.measure(_simulate(batch, policy, integ, dtype, ticks, args))
    return c.result, c.wall_s, c.compile_s


def compile_call(batch, policy, integ, dtype, args):
    _, first, comp = call(batch, policy, integ, dtype, args.n_save, args)
    return comp, first


def steady(batch, policy, integ, dtype, ticks, args, repeats):
    """Best of `repeats` calls of `ticks` ticks, each net of the compile time spent inside
    it (only a policy whose program depends on the horizon, mnlb, compiles again); the
    last solution; whether any call compiled."""
    fn = _simulate(batch, policy, integ, dtype, ticks, args)
    t = H.timed(fn, repeats, warm_up=False, net_of_compile=True)
    return t.result, t.wall_s, t.walls_s, t.recompiled


def statuses(sol) -> dict:
    st = np.asarray(sol.status)
    names, counts = np.unique(np.asarray(sol.status_names()).astype(str), return_counts=True)
    return {
        "n_success": int(np.sum(st == dl.STATUS["success"])),
        "n": int(st.size),
        "counts": {str(k): int(v) for k, v in zip(names, counts)},
    }


def _rel(N, Nref, mask, floor):
    """|N - Nref| / max(|Nref|, floor * max_{t,j} |Nref_b|) on real cells, `(B, T, n)`
    (0 on padded cells, inf where not finite)."""
    N = np.asarray(N, dtype=np.float64)
    Nref = np.asarray(Nref, dtype=np.float64)
    m = np.asarray(mask)[:, None, :]
    scale = np.max(np.where(m, np.abs(Nref), 0.0), axis=(1, 2), keepdims=True)
    den = np.maximum(np.abs(Nref), floor * scale)
    rel = np.where(m, np.abs(N - Nref) / np.where(den > 0, den, 1.0), 0.0)
    return np.where(np.isfinite(rel), rel, np.inf)


def rel_diff(N, Nref, mask, floor=1e-3):
    """max_{b,t,j} of `_rel` over real cells, and how many scenarios exceed 1e-3."""
    per = _rel(N, Nref, mask, floor).max(axis=(1, 2))
    return float(per.max()), int(np.sum(per > 1e-3))


def rel_diff_vs_time(N, Nref, mask, floor=1e-3):
    """`rel_diff` at each saved time (max over scenarios and cells)."""
    return _rel(N, Nref, mask, floor).max(axis=(0, 2)).tolist()


def exact_source_arrivals(batch, t) -> np.ndarray:
    """$\\int_0^{t_s} \\sum_i \\lambda_i$ of every scenario at the times `t` `(B, S)`, in
    float64 on the host from the piecewise-linear profiles (constant outside them), as
    `dlbfluid._scenario.arrivals.rate_integral` defines it: the arrivals a simulation must count."""
    ts = np.asarray(batch.arrival_times, np.float64)[:, :, None, :]  # (B, n, 1, P)
    rs = np.asarray(batch.arrival_rates, np.float64)[:, :, None, :]
    mask = np.asarray(batch.cell_mask)
    b = np.asarray(t, np.float64)[:, None, :, None]  # (B, 1, S, 1)
    left = rs[..., 0] * np.maximum(np.minimum(b[..., 0], ts[..., 0]), 0.0)
    right = rs[..., -1] * np.maximum(b[..., 0] - np.maximum(ts[..., -1], 0.0), 0.0)
    t0, t1, r0, r1 = ts[..., :-1], ts[..., 1:], rs[..., :-1], rs[..., 1:]
    lo = np.clip(0.0, t0, t1)
    hi = np.clip(b, t0, t1)
    span = t1 - t0
    slope = np.where(span > 0, (r1 - r0) / np.where(span > 0, span, 1.0), 0.0)
    mid = np.sum(0.5 * (hi - lo) * (2.0 * r0 + slope * (lo - t0 + hi - t0)), axis=-1)
    return np.sum(np.where(mask[:, :, None], left + mid + right, 0.0), axis=1)


def arrival_mass_error(sol, batch) -> dict:
    """The simulated source arrivals (`Solution.source_arrivals`, summed over cells) against
    their exact float64 value, per save interval: the relative error of the request mass
    the run put into the network in each interval (max over scenarios, signed mean)."""
    t = np.asarray(sol.t, np.float64)
    exact = exact_source_arrivals(batch, t)
    got = np.sum(
        np.where(
            np.asarray(sol.cell_mask)[:, None], np.asarray(sol.source_arrivals, np.float64), 0
        ),
        axis=-1,
    )
    d_exact, d_got = np.diff(exact, axis=1), np.diff(got, axis=1)
    rel = (d_got - d_exact) / np.maximum(np.abs(d_exact), 1e-300)
    return {
        "interval_ends_s": t[0, 1:].tolist(),
        "mean_rel_error_per_interval": rel.mean(axis=0).tolist(),
        "max_abs_rel_error_per_interval": np.abs(rel).max(axis=0).tolist(),
        "max_abs_rel_error": float(np.abs(rel).max()),
    }


def fmt_bytes(b) -> str:
    return "-" if b is None else f"{b / 2**30:.2f} GiB"


# ----------------------------------------------------------------------------------------


def run_policy(policy, batch, integ, dtype, args, t_all, n_left):
    B, K_full = args.B_run, args.K_full
    full_ticks = args.scenarios * K_full
    res = {"policy": policy}
    compile_s, first = compile_call(batch, policy, integ, dtype, args)
    res.update(compile_s=compile_s, first_call_s=first)
    H.log(f"[{policy}] compile {compile_s:.1f}s (first call {first:.1f}s)")

    K_probe = args.K_probe
    if args.horizon_fraction == "auto":
        # A rough rate from one short call, so that the probe itself fits the budget.
        _, w0, _ = call(batch, policy, integ, dtype, args.n_save, args)
        rate0 = B * args.n_save / w0
        left = args.budget_s - (time.perf_counter() - t_all)
        per_policy = left / n_left
        K_probe = max(args.n_save, min(K_probe, int(0.05 * per_policy * rate0 / B)))
    sol_p, wall_p, walls_p, rec_p = steady(batch, policy, integ, dtype, K_probe, args, args.repeats)
    rate_p = B * K_probe / wall_p
    res["probe"] = {
        "ticks": K_probe,
        "simulated_s": K_probe * args.tick,
        "wall_s": wall_p,
        "walls_s": walls_p,
        "scenario_ticks_per_s": rate_p,
        "recompiled": rec_p,
        "statuses": statuses(sol_p),
    }
    H.log(
        f"[{policy}] probe {K_probe} ticks x {B}: {wall_p:.2f}s, {rate_p:.4g} scenario-ticks/s "
        f"-> full run {full_ticks / rate_p:.4g}s"
    )

    if args.horizon_fraction == "auto":
        # The chunk: the whole horizon if it fits what this policy may still spend (keeping
        # room for the float64 comparison), else the largest fraction that does.
        left = args.budget_s - (time.perf_counter() - t_all)
        avail = left / n_left
        if args.f64 == "chunk":
            # Keep a third for the float64 comparison (two compilations, two runs of the
            # sub-batch, which `compare_f64` shortens to fit what is left).
            avail = (avail - 2.5 * compile_s) * (2.0 / 3.0)
        K_fit = int(0.9 * avail * rate_p / B)
        if K_fit >= K_full:
            K_chunk, why = K_full, "the whole horizon: projected to fit --budget-s"
        else:
            frac = max(K_fit, K_probe) / K_full
            digits = 10 ** (math.floor(math.log10(frac)) - 1)
            frac = max(math.floor(frac / digits) * digits, K_probe / K_full)
            K_chunk = max(K_probe, round(frac * K_full))
            why = "the largest fraction of the horizon that fits --budget-s"
    else:
        K_chunk, why = args.K_chunk, "--horizon-fraction (or --scale)"
    sol_c, wall_raw, comp_c = call(batch, policy, integ, dtype, K_chunk, args)
    wall_c, rec_c = wall_raw - comp_c, comp_c > 0.05
    rate_c = B * K_chunk / wall_c
    projected = full_ticks / rate_c
    res["chunk"] = {
        "ticks": K_chunk,
        "simulated_s": K_chunk * args.tick,
        "horizon_fraction": K_chunk / K_full,
        "batch": B,
        "batch_fraction": B / args.scenarios,
        "fraction_of_full_run": B * K_chunk / full_ticks,
        "chosen_by": why,
        "wall_s": wall_c,
        "compile_in_call_s": comp_c,
        "wall_including_compile_s": wall_raw,
        "scenario_ticks_per_s": rate_c,
        "us_per_tick_of_batch": 1e6 * wall_c / K_chunk,
        "recompiled": rec_c,
        "statuses": statuses(sol_c),
        "mass_balance_residual": mass_residual(sol_c),
        "arrival_mass_error": arrival_mass_error(sol_c, batch),
        "memory_after": H.memory(),
    }
    res["projected_full_run_s"] = projected
    res["projected_full_run_with_compile_s"] = projected + compile_s
    res["measured_full_run"] = B == args.scenarios and K_chunk == K_full
    res["meets_goal"] = projected <= args.goal_s
    res["meets_goal_with_compile"] = projected + compile_s <= args.goal_s
    st = res["chunk"]["statuses"]
    am = res["chunk"]["arrival_mass_error"]
    H.log(
        f"[{policy}] arrivals counted vs exact, per save interval (mean rel error): "
        + " ".join(f"{e:+.1e}" for e in am["mean_rel_error_per_interval"])
    )
    H.log(
        f"[{policy}] chunk {K_chunk} ticks ({K_chunk * args.tick:.4g} s simulated) x {B}: "
        f"{wall_c:.2f}s, {rate_c:.4g} scenario-ticks/s; {st['n_success']}/{st['n']} success "
        f"{st['counts']}; projected full run {projected:.4g}s "
        f"({'meets' if res['meets_goal'] else 'misses'} the {args.goal_s:g}s goal)"
    )

    if args.f64 == "chunk" and args.dtype == "float32":
        budget = None
        if args.horizon_fraction == "auto":
            budget = (args.budget_s - (time.perf_counter() - t_all)) / n_left
        f = res["float64"] = compare_f64(batch, policy, integ, K_chunk, args, budget_s=budget)
        m, N32 = f["batch"], np.asarray(f.pop("_N32"), np.float64)
        f["sub_batch_max_abs_diff_vs_chunk_rows"] = (
            float(np.max(np.abs(N32 - np.asarray(sol_c.N[:m])))) if f["ticks"] == K_chunk else None
        )
        H.log(
            f"[{policy}] float64 comparison, {m} scenarios x {f['ticks']} ticks: float32 "
            f"x{f['float32_speedup']:.2f} faster; float32 vs float64: N {f['max_rel_diff_N']:.2e} "
            f"({f['scenarios_over_1e-3']} scenarios over 1e-3), workload integral "
            f"{f['max_rel_diff_workload_integral']:.2e}, mean latency "
            f"{f['max_rel_diff_mean_latency']:.2e}; mass-balance residual f32 "
            f"{f['float32']['mass_balance_residual']:.1e}, f64 "
            f"{f['float64']['mass_balance_residual']:.1e}"
        )
    return res


def sub_batch(batch, m):
    return jax.tree_util.tree_map(lambda a: a[:m] if eqx.is_array(a) else a, batch)


def compare_f64(batch, policy, integ, ticks, args, *, budget_s=None):
    """The first `--f64-batch-fraction` of the batch over the chunk, in float32 and float64
    (each compiled for that batch): throughput ratio at equal batch and ticks, and the
    float32 error against float64 in N, in the final workload integral and in the mean
    latency over the second half of the chunk (`Solution.mean_latency`).

    With `budget_s` (auto mode) the comparison is cut to the first ticks that fit it, from
    the cost per tick of one probe-length call in each dtype."""
    t0 = time.perf_counter()
    m = max(1, round(args.f64_batch_fraction * args.B_run))
    sub = sub_batch(batch, m)
    mask = np.asarray(sub.cell_mask)
    comp = {}
    for name, dt in (("float32", jnp.float32), ("float64", jnp.float64)):
        comp[name] = compile_call(sub, policy, integ, dt, args)
    if budget_s is not None:
        k = min(ticks, args.K_probe)
        per_tick = 0.0
        for dt in (jnp.float32, jnp.float64):
            _, w, c = call(sub, policy, integ, dt, k, args)
            per_tick += (w - c) / k
        left = budget_s - (time.perf_counter() - t0)
        ticks = max(args.n_save, min(ticks, int(0.9 * left / per_tick)))
    out = {"batch": m, "ticks": ticks, "cut_to_budget": budget_s is not None}
    sols = {}
    for name, dt in (("float32", jnp.float32), ("float64", jnp.float64)):
        sol, wall, cc = call(sub, policy, integ, dt, ticks, args)
        wall -= cc
        sols[name] = sol
        out[name] = {
            "compile_s": comp[name][0],
            "wall_s": wall,
            "scenario_ticks_per_s": m * ticks / wall,
            "recompiled": cc > 0.05,
            "statuses": statuses(sol),
            "mass_balance_residual": mass_residual(sol),
            "arrival_mass_error": arrival_mass_error(sol, sub),
        }
    s32, s64 = sols["float32"], sols["float64"]
    out["float32_speedup"] = out["float64"]["wall_s"] / out["float32"]["wall_s"]
    out["max_rel_diff_N"], out["scenarios_over_1e-3"] = rel_diff(s32.N, s64.N, mask)
    out["rel_diff_N_vs_time"] = rel_diff_vs_time(s32.N, s64.N, mask)
    out["save_times_s"] = np.asarray(s64.t[0], dtype=np.float64).tolist()

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-300)))

    out["max_rel_diff_workload_integral"] = rel(
        s32.workload_integral[:, -1], s64.workload_integral[:, -1]
    )
    out["max_rel_diff_mean_latency"] = rel(s32.mean_latency(0.5), s64.mean_latency(0.5))
    out["_N32"] = s32.N
    return out


def mass_residual(sol) -> float:
    """max over scenarios of |sum_j (N_T - N_0) - sum_j (arrivals - departures - drops)|
    relative to sum_j (N_0 + arrivals): how far the cumulative totals have drifted from the
    workload they account for (0 in exact arithmetic)."""
    N = np.asarray(sol.N, np.float64)
    mask = np.asarray(sol.cell_mask)
    tot = lambda a: np.sum(np.where(mask, np.asarray(a, np.float64)[:, -1], 0.0), -1)  # noqa: E731
    dN = np.sum(np.where(mask, N[:, -1] - N[:, 0], 0.0), -1)
    flow = tot(sol.arrivals) - tot(sol.departures) - tot(sol.drops)
    scale = np.sum(np.where(mask, N[:, 0], 0.0), -1) + tot(sol.arrivals)
    return float(np.max(np.abs(dN - flow) / np.maximum(scale, 1e-300)))


def main(argv=None):
    # `--model requests`: the request-level twin (accelerator_requests.py); `fluid` (default)
    # the fluid model below.
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model", default="fluid", choices=("fluid", "requests"))
    model, rest = pre.parse_known_args(argv)
    if model.model == "requests":
        import accelerator_requests

        dl.use_cpu_cores()
        return accelerator_requests.main(rest)
    args = parse_args(rest)
    # Every core a CPU device (simulate shards the batch over them), as `dlbfluid experiment`
    # runs; nothing changes on an accelerator or where XLA_FLAGS already chose.
    dl.use_cpu_cores()
    t_all = time.perf_counter()
    dtype = jnp.float32 if args.dtype == "float32" else jnp.float64
    meta = {
        "benchmark": "accelerator",
        **H.environment("devices", "device_kind", "backend"),
        "dtype": args.dtype,
        "layout": args.layout,
        **H.environment("jax_version", "python", "cpu_count", "loadavg_start"),
        "git": H.git_state(),
        "command": H.command(argv),
        "full_run": {
            "scenarios": args.scenarios,
            "horizon_s": args.horizon,
            "tick_s": args.tick,
            "ticks": args.K_full,
            "scenario_ticks": args.scenarios * args.K_full,
        },
        "scenarios": (
            "dl.generate(seed) App. B, "
            + (
                "the generator's own 2-10 cells padded to 10"
                if args.n_cells is None
                else f"{args.n_cells} cells"
            )
            + f"; arrival profiles over {args.horizon:g} s (scenario_dicts(horizon=...))"
        ),
        "seed": args.seed,
        "step_size": args.step_size,
        "n_save": args.n_save,
        "scale": args.scale,
        "batch_fraction": args.batch_fraction,
        "horizon_fraction": args.horizon_fraction,
        "budget_s": args.budget_s,
        "goal_s": args.goal_s,
        "policies": args.policies,
        "f64": args.f64,
        "f64_batch_fraction": args.f64_batch_fraction,
    }
    H.log(
        f"devices {meta['devices']} ({meta['device_kind']}), backend {meta['backend']}, "
        f"{args.dtype}; full run {args.scenarios} x {args.horizon:g}s at {args.tick:g}s ticks "
        f"= {args.scenarios * args.K_full:.3g} scenario-ticks; this run: {args.B_run} "
        f"scenarios, horizon fraction {args.horizon_fraction}"
    )
    t0 = time.perf_counter()
    batch, cells = build_batch(args.n_cells, args.B_run, seed=args.seed, horizon=args.horizon)
    meta["build_s"] = time.perf_counter() - t0
    meta["cells_histogram"] = cells
    meta["batch_input_bytes"] = int(
        sum(a.nbytes for a in jax.tree_util.tree_leaves(eqx.filter(batch, eqx.is_array)))
    )
    integ = dl.Fast()  # sub-steps chosen by simulate, per scenario / batch
    try:
        meta["fast_for_batch"] = str(integ.for_batch(batch.strip(), args.tick))
    except Exception as e:  # noqa: BLE001 - informational only
        meta["fast_for_batch"] = f"unavailable ({type(e).__name__})"
    H.log(
        f"built {args.B_run} scenarios in {meta['build_s']:.1f}s (cells {cells}); "
        f"{meta['fast_for_batch']}"
    )

    results = []
    for i, pol in enumerate(args.policies):
        results.append(run_policy(pol, batch, integ, dtype, args, t_all, len(args.policies) - i))
    meta["memory"] = H.memory()
    meta["loadavg_end"] = H.loadavg()
    meta["total_s"] = time.perf_counter() - t_all
    worst = max(results, key=lambda r: r["projected_full_run_s"])
    meta["summary"] = {
        "slowest_policy": worst["policy"],
        "projected_full_run_s": worst["projected_full_run_s"],
        "meets_goal": all(r["meets_goal"] for r in results),
        "all_success": all(
            r["chunk"]["statuses"]["n_success"] == r["chunk"]["statuses"]["n"] for r in results
        ),
    }
    out = H.emit(dict(meta, results=results), args.out, indent=1)
    H.log(fmt_table(out, args))
    return out


def fmt_table(out, args) -> str:
    header = ("policy", "compile_s", "probe/s", "chunk ticks", "chunk/s", "full run (s)")
    header += ("goal", "success", "memory", "f32/f64", "f32-f64 N")
    rows = []
    for r in out["results"]:
        c, f = r["chunk"], r.get("float64")
        mem = c["memory_after"]
        b = mem["device_peak_bytes"] or mem["host_peak_rss_bytes"]
        rows.append((
            r["policy"], f"{r['compile_s']:.1f}", f"{r['probe']['scenario_ticks_per_s']:.3g}",
            c["ticks"], f"{c['scenario_ticks_per_s']:.3g}", f"{r['projected_full_run_s']:.4g}",
            "yes" if r["meets_goal"] else "no",
            f"{c['statuses']['n_success']}/{c['statuses']['n']}", fmt_bytes(b),
            f"{f['float32_speedup']:.2f}x" if f else "-", f"{f['max_rel_diff_N']:.1e}" if f else "-",
        ))  # fmt: skip
    s = out["summary"]
    return "\n".join(
        [
            f"{out['devices']} {args.dtype}: {args.B_run} of {args.scenarios} scenarios; full "
            f"run {args.scenarios} x {args.K_full} ticks; rates in scenario-ticks/s",
            H.markdown_table(header, rows),
            f"projected full run ({s['slowest_policy']}, slowest): "
            f"{s['projected_full_run_s']:.4g}s (+ compile), goal {args.goal_s:g}s: "
            + ("met" if s["meets_goal"] else "NOT met")
            + ("" if out["backend"] != "cpu" else " (a CPU: the goal is for one H200)")
            + f"; total {out['total_s']:.0f}s",
        ]
    )


if __name__ == "__main__":
    main()
