"""The shape of Theorem 1 on the 3-cell catalogue network, as all delays are scaled.

    python benchmarks/theorem1_shape.py [--scales 1 4 16] [--out FILE]

For each delay scale: the flow-grad critical step size eta*, then a batched sweep over
eta in {0.05, 0.1, 0.2, 0.4} and T in {100, 200, 400} started at N(0) = N*, and the fit of
the time-average distance to A/(T eta) + B eta + C/T (B is the empirical G1(tau)).
Prints one JSON object (and writes it to `--out`, by `_harness.py`). Not a timing
benchmark: a measurement script for theory/lyapunov.md.
"""

from __future__ import annotations

import argparse
import copy

import _harness as H
import jax
import numpy as np

H.add_tests_to_path()
from helpers import THREE  # noqa: E402

import dlbfluid as dl  # noqa: E402

dl.enable_x64()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
        parents=[H.parent_parser()],
    )
    p.add_argument("--scales", type=float, nargs="+", default=[1.0, 4.0, 16.0])
    args = H.parse(p, argv)
    base = dl.scenario_from_dict(THREE)
    eq = dl.solve_equilibrium(base, "gradient")
    h, Ts, etas = 0.05, np.array([100.0, 200.0, 400.0]), np.array([0.05, 0.1, 0.2, 0.4])
    K = int(Ts.max() / h)
    out = []
    for scale in args.scales:
        d = copy.deepcopy(THREE)
        d["latency"] = (np.asarray(THREE["latency"]) * scale).tolist()
        d["initial"] = {"workload": np.asarray(eq.N).tolist()}
        scn = dl.scenario_from_dict(d)
        eta_star = dl.critical_step_size(scn, "flow-grad").critical_step_size
        sols = dl.simulate(
            scn, "flow-grad", step_size=etas[:, None], tick=h, horizon=float(Ts.max()), n_save=K
        )
        rows = []
        for b, e in enumerate(etas):
            one = jax.tree_util.tree_map(lambda a, b=b: a[b], sols)
            dd = dl.lyapunov_diagnostics(one, scn, eq, cost="gradient", step_size=float(e))
            rows += [(T, e, float(dd.time_average_distance[int(T / h)])) for T in Ts]
        rows = np.array(rows)
        fit = dl.fit_theorem1(rows[:, 0], rows[:, 1], rows[:, 2])
        out.append({"delay_scale": scale, "critical_step_size": eta_star, **fit})
        H.log(
            f"scale {scale:5.1f}: eta* {eta_star:.4g}  A {fit['A']:.4g}  B {fit['B']:.4g}  "
            f"C {fit['C']:.4g}  rel rmse {fit['rel_rmse']:.3f}"
        )
    H.emit(
        {
            "scenario": "tests/helpers.py::THREE",
            "policy": "flow-grad",
            "tick": h,
            "etas": etas.tolist(),
            "horizons": Ts.tolist(),
            "fits": out,
        },
        args.out,
        indent=None,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
