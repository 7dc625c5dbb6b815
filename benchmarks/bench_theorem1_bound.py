"""What Theorem 1's explicit constants and trajectory check add to `verify --ladder none`.

    python benchmarks/bench_theorem1_bound.py [--chunk 32] [--horizon 200] [--tick 0.005]
        [--policy flow-grad] [--repeats 3] [--out FILE]

One chunk of `verify`'s random scenarios (2-6 cells, padded to 6), one flow policy, in the
order `verify` runs them: the equilibria, the batched critical steps, the simulation saved at
every tick and the projection check (what `verify --ladder none` did before the explicit
bound), then the explicit constants (`batch_theorem1_constants`), the start terms and the
Theorem-1 check (`batch_theorem1_check`). Every piece is compiled first (its compile time,
the first call's excess over the best, reported apart), then timed `--repeats` times (best
of), `block_until_ready` on its outputs (`_harness.timed`).
Prints JSON: seconds per piece, the verify part before (`baseline_s`), the added part
(`added_s`) and their ratio (`added_fraction`).
"""

from __future__ import annotations

import argparse

import _harness as H
import jax.numpy as jnp
import numpy as np

import dlbfluid as dl
from dlbfluid._equilibrium import solve_equilibrium
from dlbfluid._policies import policy_from_name
from dlbfluid._scenario import scenario_from_dict, stack_scenarios
from dlbfluid._simulate import simulate
from dlbfluid._stability import batch_critical_step_size
from dlbfluid._theorem1 import (
    batch_projection_check,
    batch_start_terms,
    batch_theorem1_check,
    batch_theorem1_constants,
)
from dlbfluid._verify import draw_scenario


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
        parents=[H.parent_parser(repeats=3)],
    )
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--horizon", type=float, default=200.0)
    p.add_argument("--tick", type=float, default=0.005)
    p.add_argument("--policy", default="flow-grad")
    p.add_argument("--seed", type=int, default=0)
    args = H.parse(p, argv)
    dl.enable_x64()
    cost = policy_from_name(args.policy).cost.name
    scns = [
        scenario_from_dict({k: v for k, v in d.items() if k not in ("index", "utilisation")})
        for d in (draw_scenario(args.seed, i) for i in range(args.chunk))
    ]
    batch = stack_scenarios(scns, n_cells=6)
    scn = batch.strip()
    K = round(args.horizon / args.tick)
    B = args.chunk
    times, compile_s = {}, {}

    def run(name, fn):
        t = H.timed(fn, args.repeats)
        times[name], compile_s[name] = t.wall_s, t.first_minus_best_s
        return t.result

    eq = run("equilibria", lambda: solve_equilibrium(batch, cost, throw=False, check=False))
    crit = run("critical_steps", lambda: batch_critical_step_size(batch, args.policy, eq))
    es = np.asarray(crit.critical_step_size)
    eta = jnp.asarray(np.where(np.isfinite(es) & (es > 0), 0.3 * es, 0.05)[:, None])
    eta_r = jnp.broadcast_to(eta, (B, 6))
    sol = run("simulate", lambda: simulate(batch, args.policy, step_size=eta, tick=args.tick,
                                           horizon=args.horizon, n_save=K, throw=False))  # fmt: skip
    ticks = jnp.full(B, args.tick)
    run("projection_check", lambda: batch_projection_check(cost, scn, eq.N, eq.x, eta_r, ticks,
                                                           sol.t, sol.N, sol.x))  # fmt: skip
    consts = run("constants", lambda: batch_theorem1_constants(cost, scn, eq.N, eq.x))
    terms = run("start_terms", lambda: batch_start_terms(cost, consts, scn, eq.N, eq.x,
                                                         sol.N[:, 0], sol.x[:, 0], eta_r))  # fmt: skip
    run("theorem1_check", lambda: batch_theorem1_check(cost, consts, terms, scn, eq.N, eq.x, eta_r,
                                                       ticks, sol.t, sol.N, sol.x))  # fmt: skip
    base = sum(times[k] for k in ("equilibria", "critical_steps", "simulate", "projection_check"))
    added = sum(times[k] for k in ("constants", "start_terms", "theorem1_check"))
    out = {
        "benchmark": "theorem1_bound",
        **H.environment("devices"),
        "policy": args.policy,
        "chunk": B,
        "horizon": args.horizon,
        "tick": args.tick,
        "ticks": K,
        "seconds": times,
        "compile_s": compile_s,
        "baseline_s": base,
        "added_s": added,
        "added_fraction": added / base,
    }
    H.emit(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
