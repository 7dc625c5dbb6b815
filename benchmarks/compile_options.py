"""What the solvers' float64 XLA option (`dlbfluid._runtime.devices._FLOAT64_OPTIONS`: XLA's
earlier CPU fusion emitters) costs and saves, against XLA's default emitters, in one run.

Each variant runs in a fresh subprocess (compiler options are fixed when a solver is first
compiled): the simulator on App.-B scenarios (`flow-grad`, `Fast()`, tick 5 ms, 400 ticks)
at 5 and 10 cells, batch 100 and 1000, float64 and float32, and the equilibrium solver
(`gradient`) on a batch of App.-B networks. Per case: compile seconds (first call minus a
steady call, `_harness.timed`), the best steady wall of `--repeats`, and the largest
difference in N between the two variants (0.0: the same to the last bit).

    python benchmarks/compile_options.py [--repeats 3] [--out FILE]
        [--cases 5:100,5:1000,10:100,10:1000] [--eq-batch 200]

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
from pathlib import Path

import _harness as H

ROOT = H.ROOT
CASES = [(5, 100), (5, 1000), (10, 100), (10, 1000)]
EQ_BATCH = 200


def _cases(text: str) -> list[tuple[int, int]]:
    try:
        cases = [tuple(int(v) for v in c.split(":")) for c in text.split(",") if c.strip()]
    except ValueError:
        cases = []
    if not cases or any(len(c) != 2 or not 2 <= c[0] <= 10 or c[1] < 1 for c in cases):
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid: expected a comma list of CELLS:BATCH, cells 2..10, batch >= 1"
        )
    return cases  # type: ignore[return-value]


def _child(variant: str, repeats: int, out: str, sim_cases, eq_batch: int) -> None:
    import jax
    import numpy as np
    from _batches import appb_batch

    import dlbfluid as dl
    from dlbfluid._equilibrium import solve_equilibrium
    from dlbfluid._runtime import devices as _devices

    dl.enable_x64()

    if variant == "xla_default":
        _devices._FLOAT64_OPTIONS = {}
    cases, arrays = [], {}

    def timed(f):
        t = H.timed(f, repeats)
        return t.result, t.first_minus_best_s, t.wall_s

    for n, B in sim_cases:
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
    eqb = appb_batch(None, eq_batch, horizon=1.0)
    sol, comp, wall = timed(lambda: solve_equilibrium(eqb, "gradient").N)
    arrays[f"equilibrium-{eq_batch}"] = np.asarray(sol)
    cases.append(
        {"case": f"equilibrium-{eq_batch}", "compile_s": round(comp, 3), "wall_s": round(wall, 4)}
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
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        parents=[H.parent_parser(repeats=3, repeats_help="steady calls per case (best kept)")],
    )
    p.add_argument(
        "--cases",
        type=_cases,
        default=CASES,
        help="simulator cases as CELLS:BATCH (default 5:100,5:1000,10:100,10:1000)",
    )
    p.add_argument("--eq-batch", type=int, default=EQ_BATCH, help="equilibrium batch (200)")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = H.parse(p, argv)
    if a.eq_batch < 1:
        p.error(f"--eq-batch {a.eq_batch}: is invalid: expected an integer >= 1")
    if a.child:
        _child(a.child[0], a.repeats, a.child[1], a.cases, a.eq_batch)
        return 0
    import numpy as np

    record = {
        "benchmark": "compile_options",
        **H.environment("cpu_count", "loadavg_start"),
        "variants": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("package", "xla_default"):
            npz = str(Path(tmp) / f"{variant}.npz")
            r = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--repeats",
                    str(a.repeats),
                    "--child",
                    variant,
                    npz,
                    "--cases",
                    ",".join(f"{n}:{B}" for n, B in a.cases),
                    "--eq-batch",
                    str(a.eq_batch),
                ],  # fmt: skip
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
    record["loadavg_end"] = H.loadavg()
    H.emit(record, a.out)
    header = ("case", "compile ratio", "wall ratio", "max abs dN")
    rows = [
        (r["case"], r["compile"], r["wall"], f"{r['max_abs_diff_N']:.1e}") for r in record["ratios"]
    ]
    H.log("package / xla_default:\n" + H.markdown_table(header, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
