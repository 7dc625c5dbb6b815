"""The request-level command line (issue 32): `dlbfluid simulate --model requests` and
`dlbfluid experiment KIND --model requests` (docs/cli.md, *dlbfluid simulate --model requests* and
*experiment*'s JSON contract)."""

import csv
import json
import math

import numpy as np
import pytest
from helpers import stub_simulate_requests

from dlbfluid._cli import main

MU, LAM = 20.0, 10.0  # rho = 0.5: M/M/1 mean count rho/(1-rho) = 1
RHO = LAM / MU
# One FIFO server (replicas 1, `--service servers`), or one M/M/1-law markov cell.
# A buffer of 50 drops with probability ~ rho^50; every run here has cells of 64 slots,
# whatever the buffer (one compiled program per service).
BASE = ["--tick", "0.005", "--horizon", "20", "--window", "0.5", "--policy", "rand",
        "--model", "requests", "--trials", "8", "--seed", "3"]  # fmt: skip

POLICY_KEYS = {"status", "trials", "latency", "latency_ci90", "error_rate", "served", "cells"}
TOP_KEYS = {"model", "service", "leaf", "probe_smoothing", "estimation", "scale", "seed", "trials", "scenario",
            "cells", "horizon", "tick", "step_size", "window", "warmup", "status", "policies",
            "wall_s"}  # fmt: skip


def one_cell(buffer=50) -> dict:
    cell = {"name": "a", "arrival_rate": LAM, "replicas": 1,
            "service": {"model": "mm1", "capacity": MU}, "buffer": buffer}  # fmt: skip
    return {"name": "one", "cells": [cell], "latency": [[0.0]]}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("scenarios")
    out = {}
    for name, scn in {"b50": one_cell(50), "b2": one_cell(2), "split": split()}.items():
        out[name] = d / f"{name}.json"
        out[name].write_text(json.dumps(scn))
    return out


def split() -> dict:
    """36 req/s at cell a (capacity 20, 9 replicas) beside an idle cell b (capacity 40, one
    replica): Rand sends 9/10 of the demand to a, which grows by 12.4 requests/s past its
    128 slots (an overflow); discrete latency routing uses b and stays stable."""
    cells = [
        {"name": "a", "arrival_rate": 36.0, "replicas": 9,
         "service": {"model": "mm1", "capacity": 20.0}},
        {"name": "b", "arrival_rate": 0.0, "replicas": 1,
         "service": {"model": "mm1", "capacity": 40.0}},
    ]  # fmt: skip
    return {"name": "split", "cells": cells, "latency": [[0.0, 0.01], [0.01, 0.0]]}


def _run(capsys, argv):
    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap


def _per_trial(path, service):
    """The same run through the library: per-trial statistics for standard errors."""
    import dlbfluid as dl

    scn = dl.load_scenario(str(path))
    return dl.simulate_requests(scn, "rand", service=service, trials=8, seed=3, step_size=0.05,
                                tick=0.005, horizon=20.0, warmup=10.0, n_save=200, throw=False)  # fmt: skip


def _check_contract(res):
    assert TOP_KEYS <= set(res)
    assert res["model"] == "requests" and res["scale"] == 1 and res["seed"] == 3
    assert (res["horizon"], res["tick"], res["window"], res["warmup"]) == (20.0, 0.005, 0.5, 10.0)
    assert res["cells"] == ["a"] and res["scenario"] == "one" and res["status"] == "success"
    assert list(res["policies"]) == ["rand"]
    r = res["policies"]["rand"]
    assert set(r) == POLICY_KEYS  # exactly the issue's contract
    assert set(r["latency"]) == {"mean", "p50", "p90", "p99"}
    assert set(r["latency_ci90"]) == {"mean", "p90"}
    assert r["status"] == "success" and r["trials"] == 8 and isinstance(r["served"], int)
    assert all(isinstance(v, float) for v in [*r["latency"].values(), *r["latency_ci90"].values()])
    assert r["latency"]["p50"] < r["latency"]["p90"] < r["latency"]["p99"]
    assert len(r["cells"]) == 1 and set(r["cells"][0]) == {"mean_requests", "utilisation"}
    return r


def test_simulate_requests_fifo_server_json_contract_and_mm1_mean(files, capsys):
    rc, cap = _run(capsys, ["simulate", str(files["b50"]), *BASE, "--service", "servers",
                            "--json"])  # fmt: skip
    assert rc == 0 and len(cap.out.strip().splitlines()) == 1
    res = json.loads(cap.out)
    assert res["service"] == "servers" and res["leaf"] == {"rule": "jsq"}
    assert res["probe_smoothing"] == 0.0 and res["estimation"] == {"mode": "oracle"}
    r = _check_contract(res)
    sol = _per_trial(files["b50"], "servers")
    m = np.asarray(sol.mean_requests)[:, 0]
    # The command prints the library's numbers (the same run: same seed, same streams).
    assert r["cells"][0]["mean_requests"] == pytest.approx(float(m.mean()), rel=1e-12)
    assert r["served"] == int(np.sum(sol.served))
    # One exponential FIFO server at rho = 0.5: E[N] = rho/(1-rho) = 1 within 3 standard
    # errors of the trials; not the M/M/1-law markov cell's 2 rho/(1-rho) = 2.
    se = float(m.std(ddof=1)) / math.sqrt(len(m))
    assert se < 0.2
    assert abs(m.mean() - RHO / (1 - RHO)) < 3 * se
    assert abs(m.mean() - 2 * RHO / (1 - RHO)) > 3 * se
    # Sojourn Exp(mu - lam): mean 0.1 s; utilisation rho. No drops with a buffer of 50.
    lat = np.asarray(sol.mean_latency())
    assert abs(r["latency"]["mean"] - 1 / (MU - LAM)) < 3 * lat.std(ddof=1) / math.sqrt(8) + 1e-3
    # Utilisation rho within 3 standard errors of the trials (control: not the mean count,
    # which a utilisation that counted waiting requests would give).
    u = np.asarray(sol.utilisation)[:, 0]
    assert r["cells"][0]["utilisation"] == pytest.approx(float(u.mean()), rel=1e-12)
    se_u = float(u.std(ddof=1)) / math.sqrt(len(u))
    assert abs(u.mean() - RHO) < 3 * se_u
    assert abs(u.mean() - RHO / (1 - RHO)) > 3 * se_u
    assert r["error_rate"] == 0.0
    # p90 = ln 10/(mu - lam) = 0.23 s, within 3 standard errors of the run's own 90%
    # interval of the p90 (1.645 standard errors) plus the histogram's 0.9% resolution;
    # the negative control: the mean, 0.1 s, is outside.
    p90_se = r["latency_ci90"]["p90"] / 1.645
    p90, tol = math.log(10) / (MU - LAM), 3 * p90_se + 0.009 * math.log(10) / (MU - LAM)
    assert abs(r["latency"]["p90"] - p90) < tol, (r["latency"], p90_se)
    assert abs(r["latency"]["p90"] - 1 / (MU - LAM)) > tol


def test_simulate_requests_markov_cell_and_blocking(files, capsys):
    # The M/M/1-law markov cell, mu(N) = mu N/(1+N): pi(n) = (1-rho)^2 (n+1) rho^n, mean
    # 2 rho/(1-rho) = 2 (theory/requests.md), not the FIFO server's 1.
    rc, cap = _run(capsys, ["simulate", str(files["b50"]), *BASE, "--json"])
    assert rc == 0
    res = json.loads(cap.out)
    assert res["service"] == "markov"
    r = _check_contract(res)
    m = np.asarray(_per_trial(files["b50"], "markov").mean_requests)[:, 0]
    assert r["cells"][0]["mean_requests"] == pytest.approx(float(m.mean()), rel=1e-12)
    se = float(m.std(ddof=1)) / math.sqrt(len(m))
    assert abs(m.mean() - 2 * RHO / (1 - RHO)) < 3 * se
    assert abs(m.mean() - RHO / (1 - RHO)) > 3 * se
    assert r["error_rate"] == 0.0
    # A buffer of 2 (the same compiled program): blocking pi_2(2) of the truncated chain,
    # (n+1) rho^n normalised over n = 0..2: 0.75/(1 + 1 + 0.75) = 0.273 (PASTA).
    rc, cap = _run(capsys, ["simulate", str(files["b2"]), *BASE, "--json"])
    assert rc == 0
    small = json.loads(cap.out)["policies"]["rand"]
    err = np.asarray(_per_trial(files["b2"], "markov").error_rate())
    se = float(err.std(ddof=1)) / math.sqrt(len(err))
    assert small["status"] == "success"
    assert small["error_rate"] == pytest.approx(0.75 / 2.75, abs=3 * se + 0.01)
    assert small["error_rate"] > 0.2
    # The text output: one row per policy, the cells' averages.
    rc, cap = _run(capsys, ["simulate", str(files["b2"]), *BASE])
    assert rc == 0
    assert "request level (markov cells, scale 1), 8 trials" in cap.out
    row = next(line for line in cap.out.splitlines() if line.startswith("rand "))
    assert "success" in row and f"{100 * small['error_rate']:.4g}" in row
    assert "requests present / utilisation" in cap.out


def test_an_overflow_is_the_policys_status_and_the_exit_status(files, capsys):
    argv = ["simulate", str(files["split"]), "--model", "requests", "--trials", "2",
            "--horizon", "20", "--policy", "rand", "--policy", "disc-lat", "--json"]  # fmt: skip
    rc, cap = _run(capsys, argv)
    assert rc == 1  # a numerical failure, as the fluid command's
    res = json.loads(cap.out)
    assert list(res["policies"]) == ["rand", "disc-lat"]
    assert res["policies"]["rand"]["status"] == "solver_failed" == res["status"]
    ok = res["policies"]["disc-lat"]
    assert ok["status"] == "success" and ok["error_rate"] == 0.0
    # Discrete latency routing keeps both cells below capacity: cell a's utilisation < 1.
    assert all(c["utilisation"] < 0.99 for c in ok["cells"])


class Worked(Exception):
    """Raised by a stand-in for the simulation."""


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--model", "requests", "--service", "fifo"],
         "--service = 'fifo' is invalid: allowed markov, servers"),
        (["--model", "requests", "--scale", "0"], "--scale = '0' is invalid: expected an integer >= 1"),
        (["--model", "requests", "--trials", "1.5"],
         "--trials = '1.5' is invalid: expected an integer >= 1"),
        (["--model", "requests", "--seed", "-1"], "--seed = '-1' is invalid: expected an integer in [0, 2**63)"),
        (["--model", "request"], "--model = 'request' is invalid: allowed fluid, requests"),
        (["--trials", "3"], "--trials = '3' is invalid with --model fluid"),
        (["--policy", "rand", "--policy", "mnlb"], "is invalid with --model fluid: expected one policy"),
        (["--model", "requests", "--policy", "rand", "--policy", "rand"], "named twice"),
        (["--model", "requests", "--horizon", "1", "--tick", "0.3"], "--horizon = 1 is invalid"),
        (["--model", "requests", "--service", "servers", "--leaf", "jiq"],
         "--leaf = 'jiq' is invalid: allowed jsq, pod"),
        (["--model", "requests", "--leaf", "pod"], "--leaf = 'pod' is invalid with --service markov"),
        (["--model", "requests", "--service", "servers", "--leaf", "pod", "--pod-d", "0"],
         "--pod-d = '0' is invalid: expected an integer >= 1"),
        (["--model", "requests", "--service", "servers", "--pod-d", "2"],
         "--pod-d = '2' is invalid without --leaf pod"),
        (["--leaf", "pod"], "--leaf = 'pod' is invalid with --model fluid"),
        (["--model", "requests", "--probe-smoothing", "-1"],
         "--probe-smoothing = '-1' is invalid: expected a finite number >= 0 (seconds)"),
        (["--probe-smoothing", "1"], "--probe-smoothing = '1' is invalid with --model fluid"),
        (["--model", "requests", "--service", "servers", "--estimation", "bogus"],
         "--estimation = 'bogus' is invalid: allowed oracle, online"),
        (["--model", "requests", "--estimation", "online"],
         "--estimation = 'online' is invalid with --service markov"),
        (["--model", "requests", "--service", "servers", "--refit-period", "5"],
         "--refit-period = '5' is invalid without --estimation online"),
        (["--model", "requests", "--service", "servers", "--estimation", "online",
          "--estimation-window", "12"],
         "--estimation-window = 12.0 is invalid: expected a whole number (>= 1) of refit periods"),
        (["--model", "requests", "--service", "servers", "--estimation", "online",
          "--refit-period", "0.0071", "--estimation-window", "0.0071"],
         "--refit-period = 0.0071 is invalid: expected a whole number of ticks (tick = 0.005)"),
        (["--model", "requests", "--service", "servers", "--estimation", "online",
          "--refit-period", "-1"], "--refit-period = "),
        (["--model", "requests", "--service", "servers", "--estimation", "online",
          "--mitigation", "probing"], "--mitigation = 'probing' is invalid: allowed "
         "background-probing, shrinkage, dithering"),
        (["--model", "requests", "--service", "servers", "--estimation", "online",
          "--mitigation", "dithering=3"], "dithering's sigma must be in (0, 2]"),
        (["--model", "requests", "--service", "servers", "--estimation", "online",
          "--mitigation", "shrinkage", "--mitigation", "shrinkage=8"], "shrinkage is named twice"),
        (["--model", "requests", "--service", "servers", "--estimation", "online",
          "--mitigation", "background-probing=0.0123"],
         "--mitigation background-probing = 0.0123 is invalid: expected a whole number of ticks"),
        (["--estimation", "online"], "--estimation = 'online' is invalid with --model fluid"),
    ],
)  # fmt: skip
def test_bad_options_name_the_flag_in_one_line_before_any_work(
    files, capsys, monkeypatch, extra, message
):
    import dlbfluid._requests
    import dlbfluid._simulate

    def no_work(*args, **kwargs):
        raise Worked

    monkeypatch.setattr(dlbfluid._requests, "simulate_requests", no_work)
    monkeypatch.setattr(dlbfluid._simulate, "simulate", no_work)
    rc, cap = _run(capsys, ["simulate", str(files["b50"]), *extra])
    assert rc == 2
    assert message in cap.err and "usage:" not in cap.err
    assert len(cap.err.strip().splitlines()) == 1
    # Valid options reach the work (here the stand-in).
    with pytest.raises(Worked):
        main(["simulate", str(files["b50"]), "--model", "requests", "--service", "servers",
              "--scale", "2", "--trials", "3", "--seed", "5", "--leaf", "pod", "--pod-d", "3",
              "--probe-smoothing", "0.5"])  # fmt: skip


def test_servers_on_a_non_mm1_cell_is_refused(tmp_path, capsys):
    from helpers import THREE

    path = tmp_path / "three.json"
    path.write_text(json.dumps(THREE))
    rc, cap = _run(capsys, ["simulate", str(path), "--model", "requests", "--service", "servers",
                            "--horizon", "1"])  # fmt: skip
    assert rc == 2 and "servers" in cap.err and "usage:" not in cap.err


# The outage kind (a replica schedule in every scenario): this test also holds the check of
# `experiment outage --model requests` (the request-level runs through an outage).
EXP = ["outage", "--scenarios", "1", "--trials", "2", "--horizon", "2", "--tick", "0.05",
       "--policies", "rand", "disc-lat", "--no-progress", "--json"]  # fmt: skip


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_experiment_at_request_level_beside_the_fluid_model(tmp_path, capsys):
    req = tmp_path / "req"
    rc, cap = _run(capsys, ["experiment", *EXP, "--model", "requests", "--out", str(req)])
    assert rc == 0
    res = json.loads(cap.out)
    assert res["config"]["model"] == "requests" and res["config"]["service"] == "markov"
    summ = {s["policy"]: s for s in res["summary"]}
    assert set(summ) == {"rand", "disc-lat"}
    for s in summ.values():
        assert s["model"] == "requests" and s["failed"] == 0
        assert {"p90", "p90_latency", "fluid_normalized_latency", "fluid_mean_latency",
                "fluid_error_rate"} <= set(s)  # fmt: skip
        assert s["p90"] is not None and math.isfinite(s["p90"]) and s["p90"] > 0
    assert summ["rand"]["p90"] == 1.0 == summ["rand"]["normalized_latency"]
    # The summary is the rows' normalised p90: each run's p90 over Rand's on the same trial.
    rows = _rows(req / "results.csv")
    by = {(r["policy"], r["trial"]): r for r in rows}
    ratio = [float(by["disc-lat", t]["p90_latency"]) / float(by["rand", t]["p90_latency"])
             for t in ("0", "1")]  # fmt: skip
    assert summ["disc-lat"]["p90"] == pytest.approx(np.mean(ratio), rel=1e-9)
    assert summ["disc-lat"]["p90"] != 1.0
    for r in rows:  # a latency distribution: p90 above the mean
        assert float(r["p90_latency"]) > float(r["mean_latency"]) > 0
    # The fluid experiment on the same settings: its summary has model "fluid", p90 null,
    # and its means are the ones reported beside the request-level ones.
    fl = tmp_path / "fluid"
    rc, cap = _run(capsys, ["experiment", *EXP, "--out", str(fl)])
    assert rc == 0
    fres = json.loads(cap.out)
    assert "model" not in fres["config"]  # (a fluid run's fingerprint, unchanged)
    for s in fres["summary"]:
        assert s["model"] == "fluid" and s["p90"] is None
        assert s["mean_latency"] == pytest.approx(summ[s["policy"]]["fluid_mean_latency"],
                                                  rel=1e-9)  # fmt: skip
        assert s["normalized_latency"] == pytest.approx(
            summ[s["policy"]]["fluid_normalized_latency"], rel=1e-9
        )
    # The model is part of the directory's settings: neither resumes into the other.
    rc, cap = _run(capsys, ["experiment", *EXP, "--out", str(req)])
    assert rc == 2 and "model (--model): 'requests' -> (not recorded)" in cap.err
    rc, cap = _run(capsys, ["experiment", *EXP, "--model", "requests", "--service", "servers",
                            "--out", str(req)])  # fmt: skip
    assert rc == 2 and "service (--service): 'markov' -> 'servers'" in cap.err
    # A rerun with the same settings resumes: nothing recomputed, the same summary.
    rc, cap = _run(capsys, ["experiment", *EXP, "--model", "requests", "--out", str(req)])
    assert rc == 0 and json.loads(cap.out)["summary"] == res["summary"]
    assert "resuming 2 of 2 units done" in cap.err


def test_experiment_request_options_are_checked_first(tmp_path, capsys):
    for extra, message in [
        (["--model", "requests", "--service", "fifo"], "--service = 'fifo' is invalid"),
        (["--service", "servers"], "--service = 'servers' is invalid with --model fluid"),
        (["--model", "request"], "--model = 'request' is invalid: allowed fluid, requests"),
        (["--scale", "2"], "--scale = '2' is invalid with --model fluid"),
        (["--model", "requests", "--scale", "0"], "--scale"),
        (["--model", "requests", "--probe-smoothing", "-1"], "--probe-smoothing"),
        (["--model", "requests", "--leaf", "pod"], "--leaf = 'pod' is invalid with --service"),
        (["--model", "requests", "--service", "servers", "--leaf", "pod", "--pod-d", "0"],
         "--pod-d"),
        (["--model", "requests", "--pod-d", "3"], "--pod-d = '3' is invalid without --leaf"),
        (["--estimation", "online"], "--estimation = 'online' is invalid with --model fluid"),
        (["--model", "requests", "--estimation", "online"], "--estimation = 'online' is invalid "
         "with --service markov"),
        (["--model", "requests", "--service", "servers", "--estimation", "online",
          "--mitigation", "x"], "--mitigation = 'x' is invalid"),
        (["--model", "requests", "--service", "servers", "--estimation", "online",
          "--estimation-window", "7"], "--estimation-window = 7.0 is invalid"),
    ]:
        rc, cap = _run(capsys, ["experiment", *EXP, *extra, "--out", str(tmp_path / "x")])
        assert rc == 2 and message in cap.err and "usage:" not in cap.err
    assert not (tmp_path / "x").exists()


def test_simulate_requests_passes_progress_as_the_fluid_run_does(files, monkeypatch, capsys):
    """`--model requests` shows progress where the fluid run does: on a terminal or above
    20,000 ticks, never with `--no-progress` (the run itself is stubbed: only the flag
    that reaches `simulate_requests` is checked)."""
    import dlbfluid._requests as req

    seen = []

    def stub(*args, progress=False, **kw):
        seen.append(progress)
        raise ValueError("stub")

    monkeypatch.setattr(req, "simulate_requests", stub)
    long = ["--tick", "0.001", "--horizon", "30", "--model", "requests", "--trials", "2"]
    short = ["--tick", "0.005", "--horizon", "20", "--model", "requests", "--trials", "2"]
    for argv in (long, long + ["--no-progress"], short):
        assert main(["simulate", str(files["b50"]), *argv, "--json"]) == 2  # (the stub's error)
        assert "error: stub" in capsys.readouterr().err
    assert seen == [True, False, False]


def test_experiment_passes_the_twins_options_and_fingerprints_them(monkeypatch):
    """`--scale`, `--probe-smoothing`, `--leaf`/`--pod-d` reach `simulate_requests` (a
    stub records its arguments) and the directory's fingerprint, where they differ from
    their defaults only (older request-level directories keep resuming)."""
    import argparse

    from dlbfluid._cli._experiment import _config
    from dlbfluid._evaluation import experiment as ex

    args = argparse.Namespace(
        kind="baseline", scenarios=1, trials=1, seed=0, horizon=1.0, tick=0.005,
        step_rule="paper", step_fraction=0.3, policies=["rand"], variants=None,
        no_error_aversion=False, mnlb_error_aversion=False, model="requests",
        service="servers", scale="4", probe_smoothing="0.2", leaf="pod", pod_d="3")  # fmt: skip
    cfg = _config(args)
    assert (cfg.scale, cfg.probe_smoothing, cfg.leaf, cfg.pod_d) == (4, 0.2, "pod", 3)
    fp = cfg.to_json()
    assert (fp["scale"], fp["probe_smoothing"], fp["leaf"], fp["pod_d"]) == (4, 0.2, "pod", 3)
    plain = ex.ExperimentConfig("baseline", model="requests").to_json()
    assert not {"scale", "probe_smoothing", "leaf", "pod_d"} & set(plain)

    seen = stub_simulate_requests(monkeypatch, ex)
    lat, p90, err, status, est = ex._simulate_requests_unit(cfg, None, "rand", None, None, 0.005)
    assert (lat[0], p90[0], status[0], est) == (1.0, 2.0, "success", {})
    assert seen["scale"] == 4 and seen["probe_smoothing"] == 0.2
    assert seen["leaf"].name == "pod" and seen["leaf"].d == 3


def test_experiment_passes_online_estimation_and_fingerprints_it(monkeypatch):
    """`--estimation online` and its options reach `simulate_requests` as an
    `OnlineEstimation` and the directory's fingerprint (where they differ from their
    defaults); the oracle's fingerprint is the one recorded before them."""
    import argparse

    from dlbfluid._cli._experiment import _config
    from dlbfluid._evaluation import experiment as ex
    from dlbfluid._requests.estimation import OnlineEstimation

    args = argparse.Namespace(
        kind="baseline", scenarios=1, trials=1, seed=0, horizon=10.0, tick=0.005,
        step_rule="paper", step_fraction=0.3, policies=["rand"], variants=None,
        no_error_aversion=False, mnlb_error_aversion=False, model="requests",
        service="servers", scale=None, probe_smoothing=None, leaf=None, pod_d=None,
        estimation="online", refit_period="2.5", estimation_window=None,
        mitigation=["shrinkage=32", "background-probing"])  # fmt: skip
    cfg = _config(args)
    assert ex.online_estimation(cfg) == OnlineEstimation(
        refit_period=2.5, window=60.0, probing=1.0, shrinkage=32.0
    )
    fp = cfg.to_json()
    assert {k: fp[k] for k in ("estimation", "refit_period", "probing", "shrinkage")} == {
        "estimation": "online", "refit_period": 2.5, "probing": 1.0, "shrinkage": 32.0}
    assert "estimation_window" not in fp and "dithering" not in fp
    assert ex.fields(cfg)[-3:] == ex.ESTIMATION_FIELDS
    plain = ex.ExperimentConfig("baseline", model="requests")
    assert not {"estimation", "refit_period", "estimation_window"} & set(plain.to_json())
    assert ex.ESTIMATION_FIELDS[0] not in ex.fields(plain)
    with pytest.raises(ValueError, match="^shrinkage = 4.0 is invalid with estimation = 'oracle'"):
        ex.ExperimentConfig("baseline", model="requests", service="servers", shrinkage=4.0)

    class Report:
        age = np.array([[[0.0, 60.0, 5.0]]])
        samples = np.array([[[100, 0, 7]]])

    seen = stub_simulate_requests(
        monkeypatch, ex, estimation=Report(), cell_mask=np.array([[True, True, False]])
    )
    *_, est = ex._simulate_requests_unit(cfg, None, "rand", None, None, 0.005)
    assert seen["estimation"] == ex.online_estimation(cfg)
    # (the padded third cell is left out: the oldest real model is 60 s, one of them stale)
    assert (est["age_max"][0], est["samples_min"][0], est["stale"][0]) == (60.0, 0, 1)


def test_simulate_requests_online_estimation_json(files, capsys):
    """`--estimation online`: the `estimation` objects of the JSON contract. One FIFO server
    at 10 req/s, a window of 10 s: a refit at the horizon sees about 100 samples (those
    completed in [10, 20) s), none late; shrinkage leaves a fit of 100 samples mostly
    the data's."""
    rc, cap = _run(capsys, ["simulate", str(files["b50"]), *BASE, "--service", "servers",
                            "--estimation", "online", "--estimation-window", "10",
                            "--mitigation", "shrinkage=8", "--json"])  # fmt: skip
    assert rc == 0
    res = json.loads(cap.out)
    assert res["estimation"] == {
        "mode": "online", "refit_period": 5.0, "window": 10.0, "bins": 64, "min_samples": 32,
        "mitigations": {"background-probing": None, "shrinkage": {"prior_samples": 8.0},
                        "dithering": None},
    }  # fmt: skip
    r = res["policies"]["rand"]
    assert set(r) == POLICY_KEYS | {"estimation"}
    (cell,) = r["estimation"]["cells"]
    assert set(cell) == {"params", "samples", "age", "late"}
    assert set(cell["params"]) == {"capacity", "base_latency", "knee", "width"}
    assert 60 <= cell["samples"] <= 140 and cell["age"] == 0.0 and cell["late"] == 0
    # The fitted latency at no load is near the service's geometric mean e^-gamma/mu = 0.028 s
    # (log least squares), far from the prior's (1 + ln 2)/mu = 0.085 s.
    assert 0.015 < cell["params"]["base_latency"] < 0.06
