"""The command-line contract: `dlbfluid simulate` and `dlbfluid demo` (README, *Commands*)."""

import json

import numpy as np
import pytest
from helpers import THREE

from dlbfluid._cli import main

SIM_KEYS = {"policy", "horizon", "tick", "mean_latency", "error_rate", "window", "throughput", "final",
            "final_change", "oscillation", "status", "cells", "scenario", "step_size", "wall_s"}


@pytest.fixture
def scenario_file(tmp_path):
    p = tmp_path / "three.json"
    p.write_text(json.dumps(THREE))
    return p


def test_simulate_json_contract(scenario_file, capsys, tmp_path):
    rc = main(["simulate", str(scenario_file), "--policy", "flow-grad", "--step-size", "0.3",
               "--tick", "0.05", "--horizon", "10", "--n-save", "200", "--json",
               "--out", str(tmp_path / "run")])
    assert rc == 0
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1  # exactly one JSON object
    res = json.loads(out)
    assert SIM_KEYS <= set(res)
    assert res["policy"] == "flow-grad" and res["horizon"] == 10.0 and res["status"] == "success"
    assert len(res["final"]["N"]) == 3 and np.shape(res["final"]["x"]) == (3, 3)
    np.testing.assert_allclose(np.sum(res["final"]["x"], axis=1), 1.0, atol=1e-12)
    # The written trajectory reproduces the printed summary.
    npz = np.load(tmp_path / "run" / "trajectory.npz")
    np.testing.assert_allclose(npz["N"][-1], res["final"]["N"])
    wl, net, src = npz["workload_integral"], npz["network_integral"], npz["source_arrivals"]
    lat = ((wl[-1] - wl[100]) + (net[-1] - net[100])) / (src[-1] - src[100]).sum()
    assert res["mean_latency"] == pytest.approx(lat, rel=1e-12)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["policy"] == "flow-grad"
    assert (tmp_path / "run" / "trajectory.png").stat().st_size > 10_000


def test_simulate_text_and_errors(scenario_file, capsys):
    assert main(["simulate", str(scenario_file), "--policy", "rand", "--horizon", "2",
                 "--tick", "0.1", "--n-save", "10"]) == 0
    assert "mean end-to-end latency" in capsys.readouterr().out
    assert main(["simulate", str(scenario_file), "--horizon", "1", "--tick", "0.3"]) == 2
    assert "whole number of ticks" in capsys.readouterr().err
    bad = scenario_file.parent / "bad.json"
    d = json.loads(scenario_file.read_text())
    d["cells"][0]["service"]["width"] = -1
    bad.write_text(json.dumps(d))
    assert main(["simulate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "cells[0].service.width" in err and "> 0" in err
    with pytest.raises(SystemExit):
        main(["simulate", str(scenario_file), "--step-size", "-2"])


def test_demo_runs_all_policies(tmp_path, capsys):
    rc = main(["demo", "--horizon", "20", "--tick", "0.1", "--out", str(tmp_path), "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    pols = [p["policy"] for p in res["policies"]]
    assert pols == ["disc-rif", "disc-lat", "disc-grad", "flow-rif", "flow-lat", "flow-grad",
                    "rand"]
    assert all(p["status"] == "success" for p in res["policies"])
    # Nothing beats the social optimum's steady-state latency by more than transients allow.
    assert res["optimal_mean_latency"] > 0
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "demo.json").read_text())["scenario"] == "default-4cell"
