"""Throughput of `dlbfluid.simulate_requests` against an event-driven simpy model.

Scenarios: App.-B 10-cell scenarios from the seed's generator (`generate(seed, B,
min_cells=10, max_cells=10)`, `scenario_dicts(horizon=H)`: piecewise-linear arrival
profiles with the generator's 10% fluctuation, softplus cells, finite buffers), `markov`
cells, policy `rand` (the peer then needs no projection; `--policy` changes ours), the
paper's 5 ms probe tick, horizon `--horizon` seconds.

For every (batch, dtype) it reports

* `compile_s`: the seconds the first call spent tracing, lowering and compiling (the
  union of the `/jax/core/compile/` time spans `jax.monitoring` reports during it, which
  run-time noise does not touch); `first_call_s` is that call's wall time;
* `wall_s`: the best of `--repeats` steady calls, each ended by `jax.block_until_ready`,
  and `cpu_s` the process's CPU seconds in that call (all threads);
* `requests_per_s`: requests that arrived at the root routers in all scenarios of the
  batch, per second of `wall_s`; `events_per_s` likewise for loop events;
  `requests_per_cpu_s` per CPU second (less sensitive to other jobs on the machine);
* `statuses`: the scenarios' status names and their counts.

The peer (`simpy_scenario`) is the same model written as an event-driven simpy program,
scenario by scenario in this process: Poisson arrivals thinned to the profile, routing by
the same weights, a delay each way, processor-sharing cells completing at
$\\mu_j(N)$ (a table of the scenario's own `ServiceModel.rate`), buffers that reject. It runs
the first `--peer-scenarios` scenarios; `speedup` = ours / peer in requests per second of
wall time, `cpu_speedup` the same in requests per CPU second.

JAX gets one CPU device per core (`dlbfluid.use_cpu_cores`; `--devices` to choose), and
`simulate_requests` runs each device's share of the batch on its own.

One JSON object goes to stdout (and to `--out`); timing and the record by `_harness.py`.
Run, e.g.:

    PYTHONUNBUFFERED=1 python benchmarks/bench_requests.py --batches 1 10 --horizon 2
    PYTHONUNBUFFERED=1 python benchmarks/bench_requests.py             # 1, 100, 1000
"""

from __future__ import annotations

import argparse
import platform
import time

import _harness as H
import jax
import jax.numpy as jnp
import numpy as np
import simpy

import dlbfluid
from dlbfluid import generate, scenario_dicts, scenario_from_dict, simulate_requests


def scenarios(batch: int, horizon: float, seed: int):
    gen = generate(seed, batch, min_cells=10, max_cells=10)
    dicts = scenario_dicts(gen, horizon=horizon)
    return [scenario_from_dict(d, allow_overload=True) for d in dicts]


def rate_table(scn) -> np.ndarray:
    r"""`(n, top)`: $\mu_j(N)$ for $N = 0..B_j+1$ (the peer looks rates up, untimed)."""
    buf = np.asarray(scn.buffer)
    top = int(np.nanmax(np.where(np.isfinite(buf), buf, 4096))) + 2
    N = jnp.arange(top, dtype=jnp.float64)[:, None] * jnp.ones((1, scn.n_cells))
    return np.asarray(scn.service.rate(N)).T


def simpy_scenario(scn, x, table, horizon: float, seed: int) -> tuple[int, int]:
    """`(arrivals, served)` of one run of the peer on one unbatched scenario."""
    rng = np.random.default_rng(seed)
    env = simpy.Environment()
    n = scn.n_cells
    times, rates = np.asarray(scn.arrival_times), np.asarray(scn.arrival_rates)
    lam_max = rates.max(axis=1)
    tau = np.asarray(scn.latency)
    buf = np.asarray(scn.buffer)
    top = table.shape[1]
    present: list[list[float]] = [[] for _ in range(n)]
    wake = [env.event() for _ in range(n)]
    counts = [0, 0]

    def cell(j):
        while True:
            rate = table[j][min(len(present[j]), top - 1)]
            waits = [wake[j]]
            if rate > 0:
                waits.append(env.timeout(rng.exponential(1.0 / rate)))
            yield simpy.AnyOf(env, waits)
            if wake[j].triggered:
                wake[j] = env.event()
                continue
            present[j].pop(rng.integers(len(present[j])))
            counts[1] += 1

    def travel(i, j, born):
        if tau[i, j] > 0:
            yield env.timeout(tau[i, j])
        if len(present[j]) < np.floor(buf[j]):
            present[j].append(born - tau[i, j])
            if not wake[j].triggered:
                wake[j].succeed()

    def source(i):
        while True:
            yield env.timeout(rng.exponential(1.0 / lam_max[i]))
            if rng.random() * lam_max[i] < np.interp(env.now, times[i], rates[i]):
                counts[0] += 1
                env.process(travel(i, rng.choice(n, p=x[i]), env.now))

    for j in range(n):
        env.process(cell(j))
    for i in range(n):
        if lam_max[i] > 0:
            env.process(source(i))
    env.run(until=horizon)
    return counts[0], counts[1]


def simpy_peer(scns, horizon: float) -> dict:
    """The simpy peer on `scns` (host, in this process, Rand's routing; scenario `s` seeded
    `s`): requests arrived, and per wall and per CPU second."""
    req = wall = cpu = 0.0
    for s, scn in enumerate(scns):
        x = np.asarray(dlbfluid.policy_from_name("rand").initial_routing(scn))
        table = rate_table(scn)
        t0, c0 = time.perf_counter(), time.process_time()
        arrived, _ = simpy_scenario(scn, x, table, horizon, seed=s)
        wall += time.perf_counter() - t0
        cpu += time.process_time() - c0
        req += arrived
    return {
        "scenarios": len(scns),
        "requests": int(req),
        "wall_s": wall,
        "requests_per_s": req / wall,
        "requests_per_cpu_s": req / cpu,
    }


def ours(scns, policy, horizon, dtype, repeats, trials=1):
    """`simulate_requests` on `scns` (a list, or a batch already stacked) with `trials`
    runs per scenario: the first call's compile seconds and the best steady call."""
    batch = scns if isinstance(scns, dlbfluid.Scenario) else dlbfluid.stack_scenarios(scns)
    kw = dict(horizon=horizon, n_save=10, dtype=dtype, trials=trials)
    t = H.timed(lambda: simulate_requests(batch, policy, **kw), repeats)
    sol, first, compile_s, best = t.result, t.first_call_s, t.compile_s, t.wall_s
    cpu = t.cpus_s[t.walls_s.index(best)]
    arrivals = int(np.sum(np.asarray(sol.arrivals)))
    events = int(np.sum(np.asarray(sol.events)))
    names, freq = np.unique(sol.status_names(), return_counts=True)
    return {
        "compile_s": compile_s,
        "first_call_s": first,
        "wall_s": best,
        "cpu_s": cpu,
        "requests": arrivals,
        "requests_per_s": arrivals / best,
        "requests_per_cpu_s": arrivals / cpu,
        "events_per_s": events / best,
        "statuses": {str(a): int(b) for a, b in zip(names, freq)},
    }


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], parents=[H.parent_parser(repeats=2)]
    )
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 100, 1000])
    ap.add_argument("--horizon", type=float, default=2.0)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    ap.add_argument("--policy", default="rand")
    ap.add_argument("--peer-scenarios", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--devices", type=int, default=None, help="CPU devices (default: cores)")
    args = H.parse(ap, argv)
    if args.devices is None:
        dlbfluid.use_cpu_cores()
    else:
        jax.config.update("jax_num_cpu_devices", args.devices)
    jax.config.update("jax_enable_x64", True)  # the generator and the float64 rows need it
    env = H.environment("devices", "cpu_count", "loadavg_start", "jax_version", "platform")

    pool = scenarios(max(args.batches), args.horizon, args.seed)
    rows = []
    for B in args.batches:
        for dt in args.dtypes:
            r = ours(pool[:B], args.policy, args.horizon, jnp.dtype(dt), args.repeats)
            r.update(batch=B, dtype=dt)
            rows.append(r)
            H.log(
                f"batch {B:5d} {dt}: {r['requests_per_s']:.3g} requests/s "
                f"({r['requests_per_cpu_s']:.3g} per CPU s), compile {r['compile_s']:.1f} s"
            )

    peer = simpy_peer(pool[: args.peer_scenarios], args.horizon)
    for r in rows:
        r["speedup"] = r["requests_per_s"] / peer["requests_per_s"]
        r["cpu_speedup"] = r["requests_per_cpu_s"] / peer["requests_per_cpu_s"]
    out = {
        "benchmark": "bench_requests",
        "scenarios": "App. B, 10 cells, markov cells, tick 0.005 s",
        "policy": args.policy,
        "horizon_s": args.horizon,
        "device": str(jax.devices()[0]),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "rows": rows,
        "peer_simpy": peer,
        "environment": env,
        "loadavg_end": H.loadavg(),
        "memory": H.memory(),
        "git": H.git_state(),
        "command": H.command(argv),
    }
    H.emit(out, args.out)


if __name__ == "__main__":
    main()
