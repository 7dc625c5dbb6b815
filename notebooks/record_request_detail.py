"""Record one scenario of the request-level evaluation in detail, for
notebooks/request_level_evaluation.ipynb: the request counts per cell of many trials beside
the fluid trajectory, and the latency histograms (CDFs), on the scenario and settings of
`dlbfluid experiment baseline --model requests --service servers` (the same routers, step
sizes and error aversion, via the experiment's own helpers).

    python notebooks/record_request_detail.py [--horizon 60] [--trials 16] [--index 1]

writes `notebooks/results/requests_detail.npz` and `requests_detail.json` (the settings,
the commit given by `--commit`, the wall time). Not run by the tests: the notebook reads the
recording.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np

import dlbfluid as dl
from dlbfluid._evaluation.config import ExperimentConfig
from dlbfluid._evaluation.experiment import _step_sizes, _unit_policy, _variant_batch
from dlbfluid._integrators import Fast
from dlbfluid._policies import ErrorAverse, FlowRouting
from dlbfluid._requests.histogram import LatencyHistogram

POLICIES = ("rand", "mnlb", "disc-grad", "flow-grad")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--horizon", type=float, default=60.0)
    ap.add_argument("--trials", type=int, default=16)
    ap.add_argument("--index", type=int, default=1, help="scenario index of seed 0")
    ap.add_argument("--n-save", type=int, default=120)
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    a = ap.parse_args()
    dl.enable_x64()
    t0 = time.time()
    cfg = ExperimentConfig("baseline", scenarios=a.index + 1, trials=1, horizon=a.horizon)
    nominal, batch, _ = _variant_batch(cfg, {})
    one = jax.tree_util.tree_map(lambda x: x[a.index : a.index + 1], batch)
    n = int(np.asarray(one.cell_mask).sum())
    arrays: dict[str, np.ndarray] = {}
    for p in POLICIES:
        pol, averse = _unit_policy(cfg, p)
        if isinstance(pol, FlowRouting):
            eta_s = _step_sizes(cfg, nominal, p)[a.index : a.index + 1]
            eta = np.pad(eta_s, ((0, 0), (0, one.n_cells - eta_s.shape[1])))
        else:
            eta = np.ones((1, one.n_cells))
        fl = dl.simulate(one, pol, step_size=eta, tick=cfg.tick, horizon=cfg.horizon,
                         n_save=a.n_save, integrator=Fast().for_batch(one, cfg.tick),
                         error_aversion=averse, throw=False)  # fmt: skip
        looped = pol if averse is None else ErrorAverse(pol, averse)
        rq = dl.simulate_requests(one, looped, service="servers", trials=a.trials,
                                  seed=cfg.seed, step_size=eta, tick=cfg.tick,
                                  horizon=cfg.horizon, n_save=a.n_save, throw=False)  # fmt: skip
        arrays[f"fluid_t_{p}"] = np.asarray(fl.t)[0]
        arrays[f"fluid_N_{p}"] = np.asarray(fl.N)[0, :, :n]
        arrays[f"fluid_mean_latency_{p}"] = np.asarray(fl.mean_latency(window=1.0))[0]
        arrays[f"t_{p}"] = np.asarray(rq.t)
        arrays[f"count_{p}"] = np.asarray(rq.count)[0, :, :, :n]
        arrays[f"histogram_{p}"] = np.asarray(rq.histogram)[0]
        arrays[f"mean_latency_{p}"] = np.asarray(rq.mean_latency())[0]
        arrays[f"p90_{p}"] = np.asarray(rq.percentile(0.9))[0]
        arrays[f"error_rate_{p}"] = np.asarray(rq.error_rate())[0]
        arrays[f"status_{p}"] = np.asarray(rq.status_names())[0]
        print(p, "done", round(time.time() - t0, 1), "s", flush=True)
    h = LatencyHistogram()
    out = Path(a.out)
    np.savez_compressed(out / "requests_detail.npz", **arrays)
    meta = {
        "scenario": f"generate(0, {a.index + 1})[{a.index}], baseline, trial 0",
        "cells": n,
        "replicas": [int(k) for k in np.asarray(one.replicas)[0, :n]],
        "policies": list(POLICIES),
        "horizon": a.horizon,
        "tick": cfg.tick,
        "trials": a.trials,
        "n_save": a.n_save,
        "service": "servers",
        "servers": [int(k) for k in np.asarray(one.servers.count)[0, :n]],
        "histogram": {"low": h.low, "high": h.high, "bins": h.bins},
        "commit": a.commit,
        "wall_s": round(time.time() - t0, 1),
        "command": f"python notebooks/record_request_detail.py --horizon {a.horizon:g} "
        f"--trials {a.trials} --index {a.index} --n-save {a.n_save}",
    }
    (out / "requests_detail.json").write_text(json.dumps(meta, indent=2) + "\n")


if __name__ == "__main__":
    main()
