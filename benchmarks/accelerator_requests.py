"""`accelerator.py --model requests`: the request-level twin's throughput on a device (issue
32 item 4), against the simpy peer measured in the same run on the host.

Scenarios: App.-B 10-cell scenarios (`bench_requests.scenarios`: `generate(seed, P,
min_cells=10, max_cells=10)`, `scenario_dicts(horizon=H)`), `markov` cells, policy `rand`
(`--policy`), the paper's 5 ms probe tick, `--horizon` seconds. A batch of `B` runs is
`P = min(B, --pool)` distinct scenarios (one padded batch, `_batches.appb_batch`, the same
generator call as `bench_requests.scenarios`) times `B / P` trials each, every run its own
PRNG key: building 10^5 distinct scenarios would take the host minutes, and the loop's
cost does not depend on which scenarios a batch holds beyond their rates.

Protocol:

1. the peer (`bench_requests.simpy_peer`) on the first
   `--peer-scenarios` scenarios, on the host, first (so that it is in the record whatever
   happens to the device rows);
2. for each batch in `--batches` (ascending) and each dtype in `--dtypes`: a first call
   (`compile_s`: the `/jax/core/compile/` spans inside it, `first_call_s` its wall), then
   the best of `--repeats` steady calls (`bench_requests.ours`): `requests_per_s`
   (requests arrived at the root routers in all runs, per wall second), `events_per_s`,
   `speedup` over the peer, the statuses and the device's peak memory;
3. before each batch, its time is predicted from the last batch of each dtype (compile
   plus `repeats + 1` calls, the call's time scaled by the batch): a batch after the
   first that would end past `--budget` seconds from the start is not started (`stopped`
   says why). A batch
   that fails (e.g. out of device memory) is a row with its `error`, and no larger batch
   of that dtype runs.

Output: one JSON line per row on stdout as soon as it is measured (`{"row": ...}`, and
`{"peer_simpy": ...}` first), then the whole record as one JSON object (and `--out`).
`--smoke`: a CPU check of the script (batches 2 and 4, 0.05 s, a pool of 2, one peer
scenario, one repeat). Run, e.g.:

    python benchmarks/accelerator.py --model requests                   # on the device
    python benchmarks/accelerator.py --model requests --smoke           # on a CPU
"""

from __future__ import annotations

import argparse
import json
import math
import time

import _harness as H
import bench_requests as R
import jax
import jax.numpy as jnp
from _batches import appb_batch

DEFAULT_BATCHES = (100, 1_000, 10_000, 100_000)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="accelerator.py --model requests",
        description=__doc__.splitlines()[0],
        parents=[H.parent_parser(repeats=2)],
    )
    p.add_argument("--batches", type=int, nargs="+", default=list(DEFAULT_BATCHES))
    p.add_argument("--horizon", type=float, default=2.0, help="simulated seconds (2)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    p.add_argument("--policy", default="rand")
    p.add_argument("--pool", type=int, default=1000, help="distinct scenarios at most (1000)")
    p.add_argument("--peer-scenarios", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=float, default=480.0, help="seconds from the start (480)")
    p.add_argument("--smoke", action="store_true", help="a tiny CPU check of the script")
    a = H.parse(p, argv)
    if a.smoke:
        a.batches, a.horizon, a.pool, a.peer_scenarios, a.repeats = [2, 4], 0.05, 2, 1, 1
    for name in ("pool", "peer_scenarios"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)}: allowed an integer >= 1")
    if any(b < 1 for b in a.batches):
        p.error(f"--batches {a.batches}: allowed integers >= 1")
    a.batches = sorted(set(a.batches))
    for b in a.batches:
        if b > a.pool and b % a.pool:
            p.error(f"--batches {b}: allowed at most --pool = {a.pool} or a multiple of it")
    bad = [d for d in a.dtypes if d not in ("float32", "float64")]
    if bad:
        p.error(f"--dtypes {bad}: allowed float32, float64")
    for name in ("horizon", "budget"):
        v = getattr(a, name)
        if not (math.isfinite(v) and v > 0):
            p.error(f"--{name} {v}: allowed a finite number > 0")
    return a


def _emit_line(key: str, value) -> None:
    print(json.dumps({key: value}), flush=True)


def predicted_s(last: dict | None, B: int, repeats: int) -> float:
    """The seconds a batch `B` would take after `last` (the same dtype's previous row):
    its compile time again plus `repeats + 1` calls scaled by the batch."""
    if last is None or "wall_s" not in last:
        return 0.0
    return last["compile_s"] + (repeats + 1) * last["wall_s"] * B / last["batch"]


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()
    jax.config.update("jax_enable_x64", True)  # the generator and the float64 rows need it
    meta = {
        "benchmark": "accelerator_requests",
        **H.environment("devices", "device_kind", "backend", "jax_version", "python"),
        "scenarios": "App. B, 10 cells, markov cells, tick 0.005 s",
        "policy": args.policy,
        "horizon_s": args.horizon,
        "pool": args.pool,
        "budget_s": args.budget,
        "git": H.git_state(),
        "command": H.command(argv),
    }
    H.log(f"{meta['devices']} ({meta['device_kind']}); batches {args.batches}, {args.dtypes}")
    P = min(args.pool, max(args.batches))
    t0 = time.perf_counter()
    pool = R.scenarios(min(P, args.peer_scenarios), args.horizon, args.seed)
    meta["peer_simpy"] = R.simpy_peer(pool[: args.peer_scenarios], args.horizon)
    _emit_line("peer_simpy", meta["peer_simpy"])
    batch = appb_batch(10, P, seed=args.seed, horizon=args.horizon)
    meta["build_s"] = time.perf_counter() - t0
    rows: list[dict] = []
    last: dict[str, dict | None] = {d: None for d in args.dtypes}
    meta["stopped"] = None
    for B in args.batches:
        m = min(B, P)
        need = sum(predicted_s(last[d], B, args.repeats) for d in args.dtypes if last[d])
        left = args.budget - (time.perf_counter() - t_start)
        if rows and need > left:  # (the first batch always runs)
            meta["stopped"] = f"batch {B}: predicted {need:.0f} s, {left:.0f} s left of --budget"
            H.log(meta["stopped"])
            break
        sub = jax.tree_util.tree_map(lambda a: a[:m], batch)
        for dt in args.dtypes:
            if last[dt] is not None and "error" in last[dt]:
                continue
            row = {"batch": B, "scenarios": m, "trials": B // m, "dtype": dt}
            try:
                row.update(R.ours(sub, args.policy, args.horizon, jnp.dtype(dt), args.repeats,
                                  trials=B // m))  # fmt: skip
                row["speedup"] = row["requests_per_s"] / meta["peer_simpy"]["requests_per_s"]
            except Exception as e:  # noqa: BLE001 - e.g. out of device memory: a row
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            row["memory"] = H.memory()
            row["elapsed_s"] = time.perf_counter() - t_start
            rows.append(row)
            last[dt] = row
            _emit_line("row", row)
            H.log(
                f"batch {B:6d} {dt}: "
                + (
                    row["error"]
                    if "error" in row
                    else f"{row['requests_per_s']:.3g} requests/s ({row['speedup']:.3g}x "
                    f"simpy), compile {row['compile_s']:.1f} s, call {row['wall_s']:.2f} s"
                )
            )
    meta["rows"] = rows
    meta["total_s"] = time.perf_counter() - t_start
    return H.emit(meta, args.out)


if __name__ == "__main__":
    main()
