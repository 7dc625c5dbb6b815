"""Importing dlbfluid changes no global JAX configuration, and the verbs follow JAX's x64
setting (issue 31, item 6; dlbfluid/_precision.py). Each check runs in a fresh Python
process: this one has x64 on (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str) -> dict:
    """Run `code` in a fresh interpreter (no x64 from the environment); it prints JSON."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_import_leaves_x64_off():
    out = _run(
        "import importlib, json, dlbfluid, jax\n"
        "first = jax.config.jax_enable_x64\n"
        "for module in set(dlbfluid._NAMES.values()):\n"  # every module behind the public names
        "    importlib.import_module(module, 'dlbfluid')\n"
        "print(json.dumps([first, jax.config.jax_enable_x64]))\n"
    )
    assert out == [False, False]


def test_float64_verbs_say_how_to_enable_x64_then_work(tmp_path):
    out_dir = str(tmp_path / "run")
    out = _run(
        f"OUT = {out_dir!r}\n"
        "import json, jax, jax.numpy as jnp\n"
        "import dlbfluid as dl\n"
        "scn = dl.default_scenario()\n"
        "calls = {\n"
        "    'simulate': lambda: dl.simulate(scn, 'flow-grad', step_size=0.05, tick=0.05,\n"
        "                                    horizon=1.0, n_save=4),\n"
        "    'simulate32': lambda: dl.simulate(scn, 'flow-grad', step_size=0.05, tick=0.05,\n"
        "                                      horizon=1.0, n_save=4, dtype=jnp.float32),\n"
        "    'solve_equilibrium': lambda: dl.solve_equilibrium(scn, 'gradient'),\n"
        "    'critical_step_size': lambda: dl.critical_step_size(scn, 'flow-grad'),\n"
        "    'generate': lambda: dl.generate(0, 1),\n"
        "    'run_experiment': lambda: dl.run_experiment(\n"
        "        dl.ExperimentConfig('baseline', scenarios=1, trials=1), OUT),\n"
        "}\n"
        "errors = {}\n"
        "for name, call in calls.items():\n"
        "    try:\n"
        "        call()\n"
        "        errors[name] = None\n"
        "    except ValueError as e:\n"
        "        errors[name] = [type(e).__name__, str(e)]\n"
        "import os\n"
        "written = os.path.exists(OUT)\n"
        "dl.enable_x64()\n"
        "scn = dl.default_scenario()\n"  # (arrays made before are float32)
        "sol = dl.simulate(scn, 'flow-grad', step_size=0.05, tick=0.05, horizon=1.0, n_save=4)\n"
        "eq = dl.solve_equilibrium(scn, 'gradient')\n"
        "print(json.dumps({'errors': errors, 'written': written, 'x64': jax.config.jax_enable_x64,\n"
        "                  'dtype': str(sol.N.dtype), 'status': list(sol.status_names().ravel()),\n"
        "                  'eq': str(eq.status_names())}))\n"
    )
    for name, err in out["errors"].items():
        assert err is not None, f"{name} ran in float32 with x64 off"
        kind, msg = err
        assert kind == "X64Error" and "\n" not in msg, (name, msg)
        assert "dlbfluid.enable_x64()" in msg and 'jax.config.update("jax_enable_x64", True)' in msg
    assert out["errors"]["simulate"][1].startswith("simulate computes in float64")
    assert not out["written"]  # run_experiment refused before writing anything
    assert out["x64"] and out["dtype"] == "float64"
    assert out["status"] == ["success"] and out["eq"] == "success"


def test_enable_x64_is_public():
    import dlbfluid
    from dlbfluid import _precision

    assert "enable_x64" in dlbfluid.__all__ and dlbfluid.enable_x64 is _precision.enable_x64
