"""Issue #13 item 5: critical step sizes of a whole chunk in one call, and `verify
--ladder none`, each against today's per-scenario loop in the same run.

    python benchmarks/bench_theorem1.py [--critical 1000] [--verify 200] [--chunk 100]
        [--out FILE]

1. **Critical step sizes** of `--critical` random networks of `dlbfluid verify` (2-6
   cells, flow-grad, equilibria solved once, batched): *before*,
   `dlbfluid._stability.critical_step_size` one scenario at a time (the pseudospectral
   method with 8 Chebyshev nodes, as `verify` ran it); *after*,
   `dlbfluid._stability.batch_critical_step_size` on chunks of `--chunk` (compile
   timed separately on a warm-up chunk). Also the largest relative difference.
2. **`verify --ladder none`** on `--verify` scenarios at the settings of the earlier
   record (2-6 cells, horizon 100 s, tick 0.05 s, chunks of `--chunk`): *before*, the
   former pipeline per chunk (equilibria, the per-scenario loop above, three flow
   simulations with per-tick saves, `batch_diagnostics`); *after*, `verify` itself
   (equilibria, batched critical steps, simulations, Theorem-1 checks and projection checks). Both after a warm-up
   chunk that compiles their programs.

Prints one JSON object on stdout (and to `--out`, by `_harness.py`), a summary on stderr.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import _harness as H
import jax
import jax.numpy as jnp
import numpy as np

import dlbfluid
from dlbfluid._equilibrium import solve_equilibrium
from dlbfluid._scenario import scenario_from_dict, stack_scenarios
from dlbfluid._stability import batch_critical_step_size, critical_step_size
from dlbfluid._verify import draw_scenario, flow_policies, verify

dlbfluid.enable_x64()

CELLS = (2, 6)


def _scenarios(seed: int, count: int, start: int = 0):
    out = []
    for i in range(start, start + count):
        d = draw_scenario(seed, i, n_cells=CELLS)
        out.append(
            scenario_from_dict({k: v for k, v in d.items() if k not in ("index", "utilisation")})
        )
    return out


def _loop(scns, policy, eq) -> list:
    """The former loop of `verify` (before the batched method): `critical_step_size`
    scenario by scenario, pseudospectral with 8 Chebyshev nodes, around scenario b's slice
    of the batch's equilibria (no second solve); `None` where it fails."""
    ok = eq.status_names() == "success"
    out: list[float | None] = []
    for b, s in enumerate(scns):
        one = jax.tree_util.tree_map(lambda a, b=b: a[b], eq)
        try:
            r = critical_step_size(s, policy, nodes=8, equilibrium=one) if ok[b] else None
        except (ValueError, RuntimeError, np.linalg.LinAlgError):
            r = None
        eta = None if r is None else r.critical_step_size
        out.append(None if eta is None else float(eta))
    return out


def bench_critical(n: int, chunk: int) -> dict:
    scns = _scenarios(11, n)
    chunks = [scns[k : k + chunk] for k in range(0, n, chunk)]
    chunks[-1] = chunks[-1] + chunks[-1][-1:] * (chunk - len(chunks[-1]))
    batches = [stack_scenarios(c, n_cells=CELLS[1]) for c in chunks]
    eqs = [solve_equilibrium(b, "gradient", throw=False, check=False) for b in batches]
    warm = H.measure(lambda: batch_critical_step_size(batches[0], "flow-grad", eqs[0])).wall_s
    t0 = time.perf_counter()
    after = []
    status = []
    for b, e in zip(batches, eqs):
        r = batch_critical_step_size(b, "flow-grad", e)
        after.append(np.asarray(r.critical_step_size))
        status += list(r.status_names())
    after = np.concatenate(after)[:n]
    t_after = time.perf_counter() - t0
    t0 = time.perf_counter()
    before = []
    for c, e in zip(chunks, eqs):
        before += _loop(c, "flow-grad", e)
    before = before[:n]
    t_before = time.perf_counter() - t0
    rel = [
        abs(a - b) / b
        for a, b in zip(after, before)
        if b is not None and math.isfinite(b) and b > 0 and math.isfinite(a)
    ]
    same_inf = sum(
        1 for a, b in zip(after, before) if b is not None and math.isinf(b) and math.isinf(a)
    )
    return {
        "scenarios": n,
        "chunk": chunk,
        "before_s": t_before,
        "after_s": t_after,
        "after_compile_s": warm - t_after / len(batches),
        "speedup": t_before / t_after,
        "max_rel_diff": max(rel) if rel else None,
        "rel_diff_above_1e-9": int(sum(r > 1e-9 for r in rel)),
        "both_infinite": same_inf,
        "status": {k: int(v) for k, v in zip(*np.unique(status[:n], return_counts=True))},
    }


def _old_chunk(scns, chunk, horizon, tick):
    """The former `verify._chunk_records` numerics (records are not assembled)."""
    from dlbfluid._simulate import simulate
    from dlbfluid._theorem1.lyapunov import batch_diagnostics

    fill = scns + [scns[-1]] * (chunk - len(scns))
    batch = stack_scenarios(fill, n_cells=CELLS[1])
    K = int(round(horizon / tick))
    for pol, cost in flow_policies():
        eq = solve_equilibrium(batch, cost, throw=False, check=False)
        es = _loop(scns, pol, eq)
        eta = [0.3 * e if e is not None and math.isfinite(e) else 0.05 for e in es]
        eta = np.asarray(eta + [eta[-1]] * (chunk - len(eta)))
        sol = simulate(
            batch, pol, step_size=eta[:, None], tick=tick, horizon=horizon, n_save=K, throw=False
        )
        d = batch_diagnostics(
            cost,
            batch.strip(),
            eq.N,
            eq.x,
            jnp.broadcast_to(jnp.asarray(eta)[:, None], (chunk, batch.n_cells)),
            jnp.full(chunk, tick),
            sol.t,
            sol.N,
            sol.x,
        )
        jax.block_until_ready(d.time_average_distance)


def bench_verify(n: int, chunk: int, horizon: float, tick: float) -> dict:
    kw = dict(chunk=chunk, n_cells=CELLS, horizon=horizon, tick=tick, ladder="none")
    warm_after = H.measure(lambda: verify(chunk, 12345, **kw)).wall_s  # compiles this shape
    t0 = time.perf_counter()
    res = verify(n, 1, **kw)
    t_after = time.perf_counter() - t0
    scns = _scenarios(1, n)
    t0 = time.perf_counter()
    _old_chunk(_scenarios(12345, chunk), chunk, horizon, tick)
    warm_before = time.perf_counter() - t0
    t0 = time.perf_counter()
    for k in range(0, n, chunk):
        _old_chunk(scns[k : k + chunk], chunk, horizon, tick)
    t_before = time.perf_counter() - t0
    cert = {p: s["projection_check_holds_fraction"] for p, s in res["policies"].items()}
    return {
        "scenarios": n,
        "chunk": chunk,
        "horizon": horizon,
        "tick": tick,
        "before_s": t_before,
        "after_s": t_after,
        "before_scenarios_per_s": n / t_before,
        "after_scenarios_per_s": n / t_after,
        "speedup": t_before / t_after,
        "warm_up_chunk_s": {"before": warm_before, "after": warm_after},
        "projection_check_holds_fraction": cert,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
        parents=[H.parent_parser()],
    )
    p.add_argument("--critical", type=int, default=1000, help="scenarios of part 1 (0: skip)")
    p.add_argument("--verify", type=int, default=200, help="scenarios of part 2 (0: skip)")
    p.add_argument("--chunk", type=int, default=100)
    p.add_argument("--horizon", type=float, default=100.0)
    p.add_argument("--tick", type=float, default=0.05)
    args = H.parse(p, argv)
    out = {
        "benchmark": "theorem1",
        **H.environment("devices", "backend"),
        "dtype": "float64",
    }
    if args.critical:
        out["critical_step_sizes"] = r = bench_critical(args.critical, args.chunk)
        H.log(
            f"critical step sizes of {r['scenarios']}: loop {r['before_s']:.1f} s, batched "
            f"{r['after_s']:.2f} s ({r['speedup']:.1f}x), max rel diff {r['max_rel_diff']}"
        )
    if args.verify:
        out["verify_ladder_none"] = r = bench_verify(
            args.verify, args.chunk, args.horizon, args.tick
        )
        H.log(
            f"verify --ladder none, {r['scenarios']} scenarios: before "
            f"{r['before_scenarios_per_s']:.2f}/s, after {r['after_scenarios_per_s']:.2f}/s "
            f"({r['speedup']:.1f}x)"
        )
    H.emit(out, args.out, indent=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
