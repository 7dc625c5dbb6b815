"""What the solvers' float64 XLA option (`dlbfluid._devices._FLOAT64_OPTIONS`: XLA's
earlier CPU fusion emitters) costs and saves, against XLA's default emitters, in one run.

Each variant runs in a fresh subprocess (compiler options are fixed when a solver is first
compiled): the simulator on App.-B scenarios (`flow-grad`, `Fast()`, tick 5 ms, 400 ticks)
at 5 and 10 cells, batch 100 and 1000, float64 and float32, and the equilibrium solver
(`gradient`) on a batch of App.-B networks. Per case: compile seconds (first call minus a
steady call), the best steady wall of `--repeats`, and the largest difference in N between
the two variants (0.0: the same to the last bit).

    python benchmarks/compile_options.py [--repeats 3] [--out FILE]

Prints one JSON object: `variants.{package,xla_default}.cases[]` and `ratios[]` (package /
xla_default, per case: compile and steady wall). The package's choice applies the option
in float64 only; `xla_default` removes it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = [(5, 100), (5, 1000), (10, 100), (10, 1000)]
EQ_BATCH = 200


def _child(variant: str, repeats: int, out: str) -> None:
    import jax
    import numpy as np

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_simulate import appb_batch

    import dlbfluid as dl
    from dlbfluid import _devices
    from dlbfluid._equilibrium import solve_equilibrium

    dl.enable_x64()

    if variant == "xla_default":
        _devices._FLOAT64_OPTIONS = {}
    cases, arrays = [], {}

    def timed(f):
        t = time.perf_counter()
        r = jax.block_until_ready(f())
        first = time.perf_counter() - t
        walls = []
        for _ in range(repeats):
            t = time.perf_counter()
            r = jax.block_until_ready(f())
            walls.append(time.perf_counter() - t)
        return r, first - min(walls), min(walls)

    for n, B in CASES:
        base = appb_batch(n, B, horizon=2.0)
        for dtype in ("float64", "float32"):
            sol, comp, wall = timed(
                lambda dtype=dtype: (
                    dl.simulate(
                        base,
                        "flow-grad",
                        step_size=0.5,
                        tick=0.005,
                        horizon=2.0,
                        n_save=4,
                        dtype=getattr(jax.numpy, dtype),
                    ).N
                )
            )
            key = f"simulate-{n}-{B}-{dtype}"
            arrays[key] = np.asarray(sol)
            cases.append({"case": key, "compile_s": round(comp, 3), "wall_s": round(wall, 4)})
    eqb = appb_batch(None, EQ_BATCH, horizon=1.0)
    sol, comp, wall = timed(lambda: solve_equilibrium(eqb, "gradient").N)
    arrays[f"equilibrium-{EQ_BATCH}"] = np.asarray(sol)
    cases.append(
        {"case": f"equilibrium-{EQ_BATCH}", "compile_s": round(comp, 3), "wall_s": round(wall, 4)}
    )
    np.savez(out, **arrays)
    print(
        json.dumps(
            {
                "options_float64": _devices.compiler_options(False),
                "options_float32": _devices.compiler_options(True),
                "cases": cases,
            }
        )
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="steady calls per case (best kept)")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error(f"--repeats = {a.repeats} is invalid: expected an integer >= 1")
    if a.child:
        _child(a.child[0], a.repeats, a.child[1])
        return 0
    if a.out and not Path(a.out).parent.exists():
        p.error(f"--out = {a.out!r} is invalid: its directory does not exist")
    import numpy as np

    record = {
        "benchmark": "compile_options",
        "cpu_count": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "variants": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("package", "xla_default"):
            npz = str(Path(tmp) / f"{variant}.npz")
            r = subprocess.run(
                [sys.executable, __file__, "--repeats", str(a.repeats), "--child", variant, npz],
                capture_output=True,
                text=True,
                cwd=ROOT,
                env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
            )
            if r.returncode != 0:
                raise RuntimeError(f"{variant} failed: {r.stderr[-3000:]}")
            record["variants"][variant] = json.loads(r.stdout.strip().splitlines()[-1])
        pk, xd = (np.load(str(Path(tmp) / f"{v}.npz")) for v in ("package", "xla_default"))
        diffs = {k: float(np.max(np.abs(pk[k] - xd[k]))) for k in pk.files}
    record["ratios"] = [
        {
            "case": c["case"],
            "max_abs_diff_N": diffs[c["case"]],
            "compile": round(c["compile_s"] / max(d["compile_s"], 1e-9), 3),
            "wall": round(c["wall_s"] / max(d["wall_s"], 1e-9), 3),
        }
        for c, d in zip(
            record["variants"]["package"]["cases"], record["variants"]["xla_default"]["cases"]
        )
    ]
    record["loadavg_end"] = os.getloadavg()
    text = json.dumps(record, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
