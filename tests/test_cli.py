"""The command-line contract: `dlbfluid simulate` and `dlbfluid demo` (docs/cli.md)."""

import json

import numpy as np
import pytest
from helpers import THREE

from dlbfluid._cli import main

SIM_KEYS = {"policy", "horizon", "tick", "mean_latency", "error_rate", "window", "throughput", "final",
            "final_change", "oscillation", "status", "cells", "scenario", "step_size", "wall_s",
            "step_size_check"}


@pytest.fixture
def scenario_file(tmp_path):
    p = tmp_path / "three.json"
    p.write_text(json.dumps(THREE))
    return p


# The runs below share two compiled simulations (Flow-Grad and Rand on THREE alone, 40
# saves: the standard shape of tests/test_simulate.py; the tick, 0.05 or 0.1, is not part of
# the program).


def test_simulate_json_contract(scenario_file, capsys, tmp_path):
    rc = main(["simulate", str(scenario_file), "--policy", "flow-grad", "--step-size", "0.3",
               "--tick", "0.05", "--horizon", "10", "--n-save", "40", "--json",
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
    assert len(wl) == 41  # the last half of the horizon is the summary's window
    lat = ((wl[-1] - wl[20]) + (net[-1] - net[20])) / (src[-1] - src[20]).sum()
    assert res["mean_latency"] == pytest.approx(lat, rel=1e-12)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["policy"] == "flow-grad"
    assert (tmp_path / "run" / "trajectory.png").stat().st_size > 10_000
    # The step size against the critical one, by the reference (pseudospectral) method.
    from dlbfluid import critical_step_size, scenario_from_dict

    ref = critical_step_size(scenario_from_dict(THREE), "flow-grad", method="pseudospectral")
    chk = res["step_size_check"]
    assert chk["critical_step_size"] == pytest.approx(ref.critical_step_size, rel=1e-6)
    assert chk["ratio"] == pytest.approx(0.3 / ref.critical_step_size, rel=1e-6)


def test_simulate_warns_about_a_step_size_beyond_the_critical_one(scenario_file, capsys):
    base = ["simulate", str(scenario_file), "--tick", "0.05", "--horizon", "2", "--n-save", "40",
            "--json"]
    assert main(base + ["--step-size", "5000"]) == 0
    cap = capsys.readouterr()
    chk = json.loads(cap.out)["step_size_check"]
    assert chk["ratio"] > 100 and chk["method"] == "pseudospectral"  # as `stability` reports
    assert f"is {chk['ratio']:.3g} times the critical step size" in cap.err
    for extra in (["--policy", "rand"], ["--step-size", "5000", "--no-step-check"]):
        assert main(base + extra) == 0
        cap = capsys.readouterr()
        assert json.loads(cap.out)["step_size_check"] is None
        assert "times the critical step size" not in cap.err


def test_simulate_text_and_errors(scenario_file, capsys):
    assert main(["simulate", str(scenario_file), "--policy", "rand", "--horizon", "4",
                 "--tick", "0.1", "--n-save", "40"]) == 0
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


# docs/cli.md's contract of `dlbfluid demo --json`: keys are added, never renamed.
DEMO_KEYS = {"scenario", "cells", "step_size", "tick", "horizon", "optimal_mean_latency",
             "policies", "png", "wall_s"}
DEMO_POLICY_KEYS = {"policy", "mean_latency", "distance", "distance_to", "oscillation",
                    "status", "final"}


def test_demo_defaults_to_every_policy(tmp_path):
    from dlbfluid._cli import build_parser
    from dlbfluid._cli._demo import _check_args

    names, _, out = _check_args(build_parser().parse_args(["demo", "--out", str(tmp_path)]))
    assert names == ("disc-rif", "disc-lat", "disc-grad", "flow-rif", "flow-lat", "flow-grad",
                     "rand", "mnlb")
    assert out == tmp_path


def test_demo_runs_both_mechanisms_and_the_baselines(tmp_path, capsys):
    # A discrete and a flow policy of one cost (one equilibrium to solve), Rand and MNLB:
    # every kind of row and panel of the default run at half its compiling (the default
    # list of policies is checked above). At a tick of 0.05 one RK4 step per tick is
    # enough for the default network (two at 0.1: a longer program to compile).
    rc = main(["demo", "--horizon", "20", "--tick", "0.05", "--out", str(tmp_path), "--json",
               "--policies", "disc-grad", "flow-grad", "rand", "mnlb"])
    assert rc == 0
    captured = capsys.readouterr()
    res = json.loads(captured.out)
    assert DEMO_KEYS <= set(res) and all(DEMO_POLICY_KEYS <= set(p) for p in res["policies"])
    assert [p["policy"] for p in res["policies"]] == ["disc-grad", "flow-grad", "rand", "mnlb"]
    assert all(p["status"] == "success" for p in res["policies"])
    assert res["mnlb"] == {"update_period": 10.0, "utilisation_cap": 0.9}
    # Each policy with a cost is measured from that cost's equilibrium, which the JSON holds.
    for p in res["policies"]:
        if p["cost"] is None:
            assert p["distance_to"] == "previous tick"
        else:
            assert p["distance_to"] == f"N* ({p['cost']})"
            assert len(res["equilibria"][p["cost"]]["N"]) == 4
    assert res["optimal_mean_latency"] == res["equilibria"]["gradient"]["mean_latency"] > 0
    assert "[5/5] simulating mnlb" in captured.err  # progress: a line per equilibrium, policy
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "demo.json").read_text())["scenario"] == "default-4cell"


class Worked(Exception):
    """Raised by a stand-in for the demo's first piece of work."""


def test_demo_checks_its_arguments_before_any_work(tmp_path, capsys, monkeypatch):
    import dlbfluid._equilibrium
    import dlbfluid._simulate

    def no_work(*args, **kwargs):
        raise Worked

    monkeypatch.setattr(dlbfluid._simulate, "simulate", no_work)
    monkeypatch.setattr(dlbfluid._equilibrium, "solve_equilibrium", no_work)
    out = tmp_path / "new"
    assert main(["demo", "--tick", "0.1", "--horizon", "10.03", "--out", str(out)]) == 2
    assert "--horizon = 10.03 is invalid" in capsys.readouterr().err
    assert not out.exists()
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["demo", "--out", str(afile)]) == 2
    assert "existing file" in capsys.readouterr().err
    (tmp_path / "taken" / "demo.json").mkdir(parents=True)
    assert main(["demo", "--out", str(tmp_path / "taken")]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert main(["demo", "--out", str(out), "--policies", "rand", "rand"]) == 2
    assert "named twice" in capsys.readouterr().err
    # Valid arguments reach the work (here the stand-in), after the step-size warning.
    with pytest.raises(Worked):
        main(["demo", "--out", str(out), "--step-size", "100", "--tick", "0.05"])
    assert "warning: --step-size = 100" in capsys.readouterr().err


def test_import_and_help_load_no_jax():
    """`import dlbfluid` and every `--help` stay jax-free (answers in a fraction of a
    second; issue 14): run in a fresh interpreter, since this one has JAX loaded."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import dlbfluid\n"
        "assert 'jax' not in sys.modules, 'import dlbfluid'\n"
        "from dlbfluid._cli import main\n"
        "for cmd in ([], ['simulate'], ['demo'], ['equilibrium'], ['stability'], ['verify'],"
        " ['experiment']):\n"
        "    try:\n"
        "        main(cmd + ['--help'])\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, cmd\n"
        "    loaded = sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.'))\n"
        "    assert not loaded, (cmd, loaded[:3])\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().endswith("ok")
