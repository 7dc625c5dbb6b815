"""The dense 3-cell case of issue #40: the request-level twin's whole command-line call
against an event-driven simpy model of the same network.

The network (written to a scenario file): 3 cells of `--servers` exponential FIFO servers
(`servers` cells without a `servers` object: `replicas` servers of rate
`capacity / replicas` = 1 request/s each), `--rate` requests/s arriving at each cell's
root (240/s in all at the defaults: utilisation 0.8), one-way delays of 20, 30 and 40 ms
between the cells, Rand's routing (a third to each cell), the leaf's rule in each cell
(join the server with the fewest requests present, the lowest index on ties).

* **Ours**: `dlbfluid simulate FILE --model requests --service servers --policy rand
  --trials T --horizon H --json`, in a fresh subprocess, once cold (an empty compilation
  cache directory) and then warm (`--repeats` calls on the same directory, the best kept):
  the whole call, start-up, the cache's load and the JSON included. Its requests are the
  ones that arrive, $\\lambda H T$ in expectation (the command reports those served in
  its window, not those arrived; the expectation's relative error is below 1e-3 here).
* **The peer** (`simpy_run`): one process per request, in this process: Poisson arrivals
  at each root, a cell drawn by the routing, the forward delay, the server with the
  fewest requests present, a `simpy.Resource` of capacity 1 per server (FIFO), an
  exponential service, the return delay. `--peer-trials` runs of `--horizon` seconds,
  seeded 0, 1, ...; its requests are counted as they arrive.

`speedup` = ours' requests per wall second (warm) over the peer's. The latencies of both
(mean over the requests that finish in the second half of the horizon, the twin's window)
are printed beside, as a check that the two simulate the same network: `latency_z` is
their difference in combined standard errors (the peer's from its runs, ours from the
command's 90% interval); a |z| above 3 says they do not.

    python benchmarks/dense_servers.py --out benchmarks/results/dense_servers_cpu.json
    python benchmarks/dense_servers.py --trials 2 --horizon 20 --peer-trials 1   # quick
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import _harness as H
import numpy as np
import simpy

TAU = [[0.0, 0.02, 0.04], [0.02, 0.0, 0.03], [0.04, 0.03, 0.0]]
Z90 = 1.6448536269514722


def scenario(servers: int, rate: float) -> dict:
    """The dense network as a scenario dict: cell capacity = servers (1 request/s each)."""
    cells = [
        {
            "name": f"c{j}",
            "arrival_rate": rate,
            "replicas": servers,
            "service": {"model": "mm1", "capacity": float(servers)},
        }
        for j in range(3)
    ]
    return {"name": "dense3", "cells": cells, "latency": TAU}


def simpy_run(servers: int, rate: float, horizon: float, seed: int) -> dict:
    """One run of the peer: requests arrived, and the latencies (root to root) of the
    requests that finish in $[H/2, H)$."""
    rng = np.random.default_rng(seed)
    env = simpy.Environment()
    n, mu = 3, 1.0
    res = [[simpy.Resource(env, capacity=1) for _ in range(servers)] for _ in range(n)]
    present = [np.zeros(servers, np.int64) for _ in range(n)]
    cum = np.cumsum(np.full(n, 1.0 / n))  # Rand: a third to each cell
    lat: list[float] = []
    arrived = [0]

    def request(i: int, j: int, born: float):
        yield env.timeout(TAU[i][j])
        s = int(np.argmin(present[j]))  # the fewest present, the lowest index on ties
        present[j][s] += 1
        with res[j][s].request() as r:
            yield r
            yield env.timeout(rng.exponential(1.0 / mu))
        present[j][s] -= 1
        if 0.5 * horizon <= env.now < horizon:
            lat.append(env.now - born + TAU[i][j])

    def source(i: int):
        while True:
            yield env.timeout(rng.exponential(1.0 / rate))
            arrived[0] += 1
            j = min(int(np.searchsorted(cum, rng.random(), side="right")), n - 1)
            env.process(request(i, j, env.now))

    for i in range(n):
        env.process(source(i))
    env.run(until=horizon)
    return {"arrived": arrived[0], "latencies": lat}


def peer(servers: int, rate: float, horizon: float, trials: int) -> dict:
    """`trials` runs of the peer: requests per wall and CPU second, and the mean latency
    with its standard error (from the runs' means; with one run, from 20 batch means of
    its latencies in the order they finished)."""
    req = 0
    runs = []
    wall = cpu = 0.0
    for s in range(trials):
        t0, c0 = time.perf_counter(), time.process_time()
        r = simpy_run(servers, rate, horizon, seed=s)
        wall += time.perf_counter() - t0
        cpu += time.process_time() - c0
        req += r["arrived"]
        runs.append(np.asarray(r["latencies"]))
    if trials > 1:
        means = np.array([x.mean() for x in runs])
    else:
        means = np.array([b.mean() for b in np.array_split(runs[0], 20)])
    se = float(means.std(ddof=1) / math.sqrt(len(means)))
    return {
        "trials": trials,
        "requests": int(req),
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "requests_per_s": req / wall,
        "requests_per_cpu_s": req / cpu,
        "mean_latency": float(np.mean(np.concatenate(runs))),
        "mean_latency_se": se,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        parents=[H.parent_parser(repeats=2, repeats_help="warm command-line calls, best kept")],
    )
    p.add_argument("--servers", type=int, default=100, help="servers per cell (100)")
    p.add_argument("--rate", type=float, default=80.0, help="requests/s at each root (80)")
    p.add_argument("--trials", type=int, default=64, help="the twin's trials (64)")
    p.add_argument("--horizon", type=float, default=500.0, help="simulated seconds (500)")
    p.add_argument("--peer-trials", type=int, default=4, help="the peer's runs (4)")
    a = H.parse(p, argv)
    for name in ("servers", "trials", "peer_trials"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)}: expected an integer >= 1")
    for name in ("rate", "horizon"):
        if not getattr(a, name) > 0:
            p.error(f"--{name} {getattr(a, name)}: expected a number > 0")
    if a.rate >= a.servers:
        p.error(f"--rate {a.rate}: expected below --servers {a.servers} (a stable cell)")

    env = H.environment("cpu_count", "loadavg_start", "jax_version", "platform")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dense3.json"
        path.write_text(json.dumps(scenario(a.servers, a.rate)))
        argv_ = ["simulate", str(path), "--model", "requests", "--service", "servers",
                 "--policy", "rand", "--trials", str(a.trials), "--horizon", str(a.horizon),
                 "--json", "--no-progress"]  # fmt: skip
        cache = str(Path(tmp) / "cache")
        cold = H.time_cli(H.ROOT, argv_, cache)
        H.log(f"ours cold: {cold['wall_s']:.1f} s")
        warm = [H.time_cli(H.ROOT, argv_, cache) for _ in range(a.repeats)]
        best = min(warm, key=lambda r: r["wall_s"])
        H.log(f"ours warm: {best['wall_s']:.1f} s")
    out = json.loads(best["stdout"])
    pol = out["policies"]["rand"]
    requests = 3 * a.rate * a.horizon * a.trials
    ours = {
        "cold_wall_s": cold["wall_s"],
        "wall_s": best["wall_s"],
        "cpu_s": best["cpu_s"],
        "wall_s_inside": out["wall_s"],
        "requests": requests,
        "requests_per_s": requests / best["wall_s"],
        "requests_per_cpu_s": requests / best["cpu_s"],
        "status": pol["status"],
        "mean_latency": pol["latency"]["mean"],
        "mean_latency_se": pol["latency_ci90"]["mean"] / Z90,
    }
    pr = peer(a.servers, a.rate, a.horizon, a.peer_trials)
    H.log(f"peer: {pr['requests_per_s']:.3g} requests/s over {pr['trials']} runs")
    se = math.hypot(ours["mean_latency_se"], pr["mean_latency_se"])
    record = {
        "benchmark": "dense_servers",
        "network": {
            "cells": 3,
            "servers_per_cell": a.servers,
            "server_rate": 1.0,
            "rate_per_root": a.rate,
            "tau": TAU,
            "policy": "rand",
        },
        "trials": a.trials,
        "horizon_s": a.horizon,
        "ours": ours,
        "peer_simpy": pr,
        "speedup": ours["requests_per_s"] / pr["requests_per_s"],
        "cpu_speedup": ours["requests_per_cpu_s"] / pr["requests_per_cpu_s"],
        "latency_z": (ours["mean_latency"] - pr["mean_latency"]) / se if se > 0 else None,
        "environment": env,
        "loadavg_end": H.loadavg(),
        "git": H.git_state(),
        "command": H.command(argv),
    }
    H.emit(record, a.out)
    H.log(
        f"speedup {record['speedup']:.2f}x in wall time (cpu {record['cpu_speedup']:.2f}x); "
        f"latency ours {ours['mean_latency']:.4f} peer {pr['mean_latency']:.4f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
