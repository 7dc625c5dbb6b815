"""`dlbfluid equilibrium`: the JSON contract, the table, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

import dlbfluid as dl
from dlbfluid._cli import main
from dlbfluid._equilibrium import solve_equilibrium

KEYS = {
    "cost",
    "N",
    "z",
    "x",
    "multipliers",
    "mean_latency",
    "social_cost",
    "kkt_residual",
    "status",
}

TWO = {  # theory/equilibria.md §4 B: local cell, identical remote cell at round trip 0.5
    "name": "local-remote",
    "cells": [
        {"name": "local", "arrival_rate": 0.5, "service": {"model": "mm1", "capacity": 1.0}},
        {"name": "remote", "arrival_rate": 0.0, "service": {"model": "mm1", "capacity": 1.0}},
    ],
    "latency": [[0.0, 0.25], [None, 0.0]],
}


def _json(capsys, argv):
    rc = main(argv)
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out  # exactly one JSON object on stdout
    return rc, json.loads(lines[0])


def test_json_all_costs_default_scenario(capsys):
    rc, rec = _json(capsys, ["equilibrium", "default", "--json"])
    assert rc == 0
    assert [e["cost"] for e in rec["equilibria"]] == ["rif", "latency", "gradient"]
    scn = dl.default_scenario()
    for e in rec["equilibria"]:
        assert KEYS <= set(e)
        assert e["status"] == "success" and e["kkt_residual"] <= 1e-10
        ref = solve_equilibrium(scn, e["cost"])
        np.testing.assert_allclose(e["N"], ref.N, rtol=1e-12)
        np.testing.assert_allclose(e["x"], ref.x, rtol=1e-12, atol=1e-15)
        assert e["mean_latency"] == pytest.approx(float(ref.mean_latency), rel=1e-12)
        assert len(e["multipliers"]) == 4 and len(e["x"]) == 4
    opt = rec["equilibria"][2]["social_cost"]
    poa = rec["price_of_anarchy"]
    assert poa["latency"] == pytest.approx(rec["equilibria"][1]["social_cost"] / opt, rel=1e-12)
    assert poa["rif"] == pytest.approx(rec["equilibria"][0]["social_cost"] / opt, rel=1e-12)
    assert poa["latency"] >= 1.0 and poa["rif"] >= 1.0
    # RIF's mean latency over all its equilibria (theory/equilibria.md §5.1: the default
    # network's range [1.65005, 1.78249] s, checked against scipy's linprog in
    # tests/test_rif_range.py); the solver's routing lies inside, the ratios follow.
    lo, hi = rec["rif_mean_latency_range"]
    assert lo == pytest.approx(1.65005, abs=1e-5) and hi == pytest.approx(1.78249, abs=1e-5)
    assert lo <= rec["equilibria"][0]["mean_latency"] <= hi
    plo, phi = rec["rif_price_of_anarchy_range"]
    assert plo <= poa["rif"] <= phi
    assert plo / lo == pytest.approx(poa["rif"] / rec["equilibria"][0]["mean_latency"], rel=1e-9)


def test_json_single_cost_from_file(tmp_path, capsys):
    path = tmp_path / "two.json"
    path.write_text(json.dumps(TWO))
    rc, rec = _json(capsys, ["equilibrium", str(path), "--cost", "latency", "--json"])
    assert rc == 0 and "price_of_anarchy" not in rec
    (e,) = rec["equilibria"]
    assert e["cost"] == "latency"
    np.testing.assert_allclose(e["z"], [0.3860009, 0.1139991], atol=1e-7)  # theory/equilibria.md §4 B
    assert e["mean_latency"] == pytest.approx(1.6286670, abs=1e-7)
    # (the price of anarchy of this network, 1.0459653, is checked against its closed form
    # by test_equilibrium.py::test_local_versus_remote_with_network_latency; the CLI's
    # --cost all path by the test above)


def test_table_output(capsys):
    rc = main(["equilibrium", "default", "--cost", "gradient"])
    out = capsys.readouterr().out
    assert rc == 0
    for word in ("gradient", "success", "us-east", "asia-east", "mean latency"):
        assert word in out
    assert "price of anarchy" not in out
    rc = main(["equilibrium", "default"])
    out = capsys.readouterr().out
    assert "price of anarchy" in out and "N (rif)" in out
    assert "over all RIF equilibria" in out


def test_overload_is_an_error_naming_cells(tmp_path, capsys):
    bad = {
        "name": "over",
        "cells": [
            {"name": "eu", "arrival_rate": 3.0, "service": {"model": "mm1", "capacity": 2.0}},
            {"name": "us", "arrival_rate": 0.5, "service": {"model": "mm1", "capacity": 2.0}},
        ],
        "latency": [[0.0, None], [0.1, 0.0]],
    }
    path = tmp_path / "over.json"
    path.write_text(json.dumps(bad))
    rc = main(["equilibrium", str(path), "--json"])
    cap = capsys.readouterr()
    assert rc == 2 and cap.out == ""
    assert "eu" in cap.err and "capacity" in cap.err


def test_bad_arguments(tmp_path, capsys):
    rc = main(["equilibrium", str(tmp_path / "missing.json")])
    assert rc == 2 and "cannot be read" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # (refused by argparse, exit status 2)
        main(["equilibrium", "default", "--max-iters", "0"])
    assert e.value.code == 2 and "argument --max-iters" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["equilibrium", "default", "--cost", "fastest"])
