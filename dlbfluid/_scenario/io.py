"""Scenario files: read one (`load_scenario`), the built-in demo scenario
(`default_scenario`), and write one back (`scenario_to_dict`, the inverse of
`scenario_from_dict`).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import ScenarioError
from .model import Scenario
from .parse import TOKEN_KEYS, scenario_from_dict


def load_scenario(path: str | Path, *, allow_overload: bool = False) -> Scenario:
    """Read a scenario JSON file (see `scenario_from_dict`)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ScenarioError(f"scenario file {str(path)!r} cannot be read: {e.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ScenarioError(f"scenario file {str(path)!r} is not valid JSON: {e}") from None
    return scenario_from_dict(data, allow_overload=allow_overload)


def default_scenario() -> Scenario:
    """The built-in heterogeneous 4-cell scenario used by `dlbfluid demo`."""
    text = resources.files("dlbfluid").joinpath("data/default.json").read_text()
    return scenario_from_dict(json.loads(text))


def _schedule(times, values, key: str) -> dict:
    """A piecewise-constant schedule as the file writes it: of the entries that share a time
    (padding, or a one-entry schedule stored twice) the last, the one in force, is kept."""
    keep = np.append(times[1:] > times[:-1], True)
    return {"times": times[keep].tolist(), key: values[keep].tolist()}


def scenario_to_dict(scn: Scenario) -> dict:
    """Inverse of `scenario_from_dict` for one unpadded scenario (profiles as breakpoints)."""
    mask = np.asarray(scn.cell_mask)
    n = int(mask.sum())
    names = list(scn.cell_names) or [f"cell{j}" for j in range(n)]
    s = scn.service
    cells = []
    for j in range(n):
        ts = np.asarray(scn.arrival_times[j])
        rs = np.asarray(scn.arrival_rates[j])
        if np.all(ts == ts[0]) and np.all(rs == rs[0]):
            rate: Any = float(rs[0])
        else:
            rate = {"times": ts.tolist(), "rates": rs.tolist()}
        cell = {
            "name": names[j],
            "arrival_rate": rate,
            "replicas": int(scn.replicas[j]),
            "service": s.cell_dict(j),
        }
        est = scn.estimate.cell_dict(j)
        if est != cell["service"]:
            cell["estimated_service"] = est
        if np.isfinite(float(scn.buffer[j])):
            cell["buffer"] = float(scn.buffer[j])
        rt = np.asarray(scn.replica_times[j])
        rk = np.asarray(scn.replica_counts[j])
        if np.any(rk != float(scn.replicas[j])):
            cell["replica_schedule"] = _schedule(rt, rk, "replicas")
        st, sf = np.asarray(scn.slowdown_times[j]), np.asarray(scn.slowdown_factors[j])
        if np.any(sf != 1.0):
            cell["service_schedule"] = _schedule(st, sf, "factors")
        sv = scn.servers
        if sv is not None and bool(sv.mask[j]):
            cell["servers"] = {
                "count": int(sv.count[j]),
                "prefill_token_time": float(sv.prefill_token_time[j]),
                "decode_token_time": float(sv.decode_token_time[j]),
                "decode_engines": int(sv.decode_engines[j]),
                "slots": int(sv.slots[j]),
                "cache_sessions": int(sv.cache_sessions[j]),
            }
        cells.append(cell)
    tau = np.asarray(scn.latency)
    allowed = np.asarray(scn.allowed)
    latency = [[float(tau[i, j]) if allowed[i, j] else None for j in range(n)] for i in range(n)]
    out = {
        "name": scn.name,
        "cells": cells,
        "latency": latency,
        "initial": {
            "workload": np.asarray(scn.initial_workload)[:n].tolist(),
            "routing": np.asarray(scn.initial_routing)[:n, :n].tolist(),
        },
    }
    w = scn.workload
    if w is not None:
        wl: dict[str, Any] = {
            f"{part}_tokens": {key: float(getattr(w, f"{part}_{key}")) for key in TOKEN_KEYS}
            for part in ("prompt", "output")
        }
        if float(w.session_fraction) > 0:
            wl["sessions"] = {
                "fraction": float(w.session_fraction),
                "mean_length": float(w.session_length),
                "think_time": float(w.think_time),
                "prefix_reuse": float(w.prefix_reuse),
                "skew": float(w.session_skew),
            }
        out["workload"] = wl
    return out
