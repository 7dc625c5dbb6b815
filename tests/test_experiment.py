"""`dlbfluid experiment`: the runner's files, resumption, normalisation and JSON contract."""

from __future__ import annotations

import argparse
import csv
import json

import jax
import numpy as np
import pytest

import dlbfluid as dl
from dlbfluid._cli import _one_process, main
from dlbfluid._defaults import PROBE_TICK
from dlbfluid._evaluation import experiment as ex

POLS = ("rand", "mnlb", "flow-grad")


def small(**kw):
    base = dict(experiment="burst", scenarios=2, trials=1, horizon=6.0, tick=0.1, policies=POLS)
    base.update(kw)
    return ex.ExperimentConfig(**base)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("exp")
    res = ex.run_experiment(small(), out)
    return out, res


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_files_and_rows(first_run):
    out, res = first_run
    rows = _rows(out / "results.csv")
    assert len(rows) == 2 * len(POLS)
    assert [r["policy"] for r in rows[:2]] == ["rand", "rand"]  # Rand first: the reference
    assert {(r["policy"], r["scenario"]) for r in rows} == {
        (p, str(s)) for p in POLS for s in range(2)
    }
    assert all(r["status"] == "success" for r in rows)
    assert (out / "burst.png").stat().st_size > 0
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(res))
    by = {s["policy"]: s for s in res["summary"]}
    assert by["rand"]["normalized_latency"] == 1.0
    # Flow rows record the step size actually used: 0.3 eta* > 0.
    assert all(float(r["step_size"]) > 0 for r in rows if r["policy"] == "flow-grad")


def test_rand_rows_match_a_direct_simulation(first_run):
    # The runner's Rand latencies are the plain simulator's on the same generated scenarios
    # (stacked and padded to the generator's largest network, as the runner's batch: its
    # compiled program serves this run too).
    out, _ = first_run
    from dlbfluid._evaluation.generator import generate, scenario_dicts

    gen = generate(0, 2)
    ds = scenario_dicts(gen, event="burst", trial=0, horizon=6.0, fluctuation=0.1)
    batch = dl.stack_scenarios(
        [dl.scenario_from_dict(d, allow_overload=True) for d in ds], n_cells=gen.max_cells
    )
    sol = dl.simulate(
        batch, "rand", tick=0.1, horizon=6.0, n_save=10, error_aversion=dl.ErrorAversion()
    )
    rows = [r for r in _rows(out / "results.csv") if r["policy"] == "rand"]
    assert [r["scenario"] for r in rows] == ["0", "1"]
    got = [float(r["mean_latency"]) for r in rows]
    np.testing.assert_allclose(got, np.asarray(sol.mean_latency(1.0)), rtol=1e-9)
    assert abs(got[0] - got[1]) > 1e-3  # (two different scenarios)


def test_resume_after_a_kill_recomputes_only_the_torn_unit(first_run, tmp_path, monkeypatch):
    out, _ = first_run
    rows = _rows(out / "results.csv")
    # A copy killed while writing the last unit: one of its rows lost, a torn line left.
    text = (out / "results.csv").read_text().splitlines(keepends=True)
    (tmp_path / "config.json").write_text((out / "config.json").read_text())
    (tmp_path / "results.csv").write_text("".join(text[:-1]) + text[-1][:7])
    calls = []
    real = ex._simulate_unit
    monkeypatch.setattr(ex, "_simulate_unit", lambda *a: calls.append(a[2].name) or real(*a))
    ex.run_experiment(small(), tmp_path)
    assert calls == [POLS[-1]]
    again = _rows(tmp_path / "results.csv")
    key = lambda r: (r["policy"], r["scenario"])  # noqa: E731
    assert sorted(again, key=key) == sorted(rows, key=key)  # no loss, no duplicate


def test_a_different_config_in_the_same_directory_is_refused(first_run):
    out, _ = first_run
    with pytest.raises(ValueError, match="holds a different experiment"):
        ex.run_experiment(small(trials=2), out)


def test_summary_normalises_per_scenario_and_trial():
    rows = []
    lat = {"rand": [2.0, 4.0, 1.0], "flow-grad": [1.0, 3.0, 1.5]}
    err = {"rand": [0.1, 0.0, 0.0], "flow-grad": [0.0, 0.0, 0.3]}
    for p in lat:
        for s in range(3):
            rows.append(
                {
                    "variant": "v",
                    "policy": p,
                    "scenario": str(s),
                    "trial": "0",
                    "mean_latency": str(lat[p][s]),
                    "error_rate": str(err[p][s]),
                    "status": "success",
                }
            )
    rows.append(dict(rows[-1], scenario="3", status="nonfinite", mean_latency=""))
    summ = {s["policy"]: s for s in ex.summarise(rows)}
    ratio = np.array([0.5, 0.75, 1.5])
    g = summ["flow-grad"]
    assert g["normalized_latency"] == pytest.approx(ratio.mean(), rel=1e-15)
    assert g["normalized_latency_p90"] == pytest.approx(np.percentile(ratio, 90), rel=1e-15)
    assert g["error_rate"] == pytest.approx(0.1, rel=1e-15)
    assert (g["runs"], g["failed"]) == (4, 1)
    assert summ["rand"]["normalized_latency"] == 1.0


def test_bad_configs_name_the_field():
    with pytest.raises(ValueError, match="experiment = 'nope'"):
        ex.ExperimentConfig("nope")
    with pytest.raises(ValueError, match="'rand' is required"):
        ex.ExperimentConfig("baseline", policies=("flow-grad",))
    with pytest.raises(ValueError, match="horizon = 1.03"):
        ex.ExperimentConfig("baseline", horizon=1.03, tick=0.05)
    with pytest.raises(ValueError, match="scenarios = 0"):
        ex.ExperimentConfig("baseline", scenarios=0)
    with pytest.raises(ValueError, match="scale = 2 is invalid with model = 'fluid'"):
        ex.ExperimentConfig("baseline", scale=2)
    with pytest.raises(ValueError, match="leaf = 'pod' is invalid with service = 'markov'"):
        ex.ExperimentConfig("baseline", model="requests", leaf="pod")
    with pytest.raises(ValueError, match="leaf = 'podd' is invalid: allowed rules"):
        ex.ExperimentConfig("baseline", model="requests", service="servers", leaf="podd")
    with pytest.raises(ValueError, match="probe_smoothing = -1"):
        ex.ExperimentConfig("baseline", model="requests", probe_smoothing=-1)


def test_cli_json_contract(first_run, capsys):
    out, res = first_run
    code = main(
        [
            "experiment",
            "burst",
            "--scenarios",
            "2",
            "--trials",
            "1",
            "--horizon",
            "6",
            "--tick",
            "0.1",
            "--policies",
            *POLS,
            "--out",
            str(out),
            "--json",
        ]
    )
    assert code == 0
    got = json.loads(capsys.readouterr().out)
    assert set(got) == {"experiment", "config", "summary", "out"}
    # issue #12: the config names the cadence and the step rule; the rule defaults to the
    # paper's, the tick (given here) to the probe cadence
    assert (got["config"]["tick"], got["config"]["step_rule"]) == (0.1, "paper")
    default = ex.ExperimentConfig("burst")
    assert (default.tick, default.step_rule) == (PROBE_TICK, "paper")
    assert got["summary"] == res["summary"]  # resumed: nothing recomputed, same numbers
    assert set(got["summary"][0]) == {
        "variant",
        "policy",
        "runs",
        "failed",
        "normalized_latency",
        "normalized_latency_p10",
        "normalized_latency_p50",
        "normalized_latency_p90",
        "mean_latency",
        "error_rate",
        "error_rate_p90",
        "p90",  # issue 32: null in the fluid model (no latency distribution)
        "model",
    }
    assert all(s["model"] == "fluid" and s["p90"] is None for s in got["summary"])
    assert set(ex.SUMMARY_FIELDS) < set(got["summary"][0])  # the constant the notebook reads


def test_cli_rejects_bad_policy(capsys, tmp_path):
    code = main(["experiment", "baseline", "--policies", "flow-grad", "--out", str(tmp_path)])
    assert code == 2
    assert "'rand' is required" in capsys.readouterr().err


def test_cli_experiment_takes_every_core(capsys, monkeypatch, tmp_path):
    """`experiment` asks for a CPU device per core before any work (one process only);
    the other commands do not, and a bad `DLBFLUID_CPU_DEVICES` stops the command."""
    from dlbfluid._runtime import devices as _devices

    calls = []
    monkeypatch.setattr(_devices, "use_cpu_cores", lambda: calls.append(1))
    bad = ["--policies", "flow-grad", "--out", str(tmp_path)]  # refused before any work
    assert main(["experiment", "baseline", *bad]) == 2
    assert calls == [1]
    assert main(["simulate", "default", "--horizon", "1", "--tick", "0.3"]) == 2
    assert calls == [1]
    one = dict(coordinator=None, num_processes=None, process_id=None, detect_cluster=False)
    assert _one_process(argparse.Namespace(**one))
    two = dict(one, coordinator="localhost:1234", num_processes=2, process_id=0)
    assert not _one_process(argparse.Namespace(**two))  # each process keeps one device
    assert _one_process(argparse.Namespace(**dict(two, num_processes=1)))
    monkeypatch.undo()
    monkeypatch.setenv("DLBFLUID_CPU_DEVICES", "0")
    assert main(["experiment", "baseline", *bad]) == 2
    err = capsys.readouterr().err
    assert "DLBFLUID_CPU_DEVICES = '0' is invalid: expected an integer >= 1 or 'auto'" in err
    assert not (tmp_path / "results.csv").exists()


def test_cpu_devices_wanted():
    """The device count `use_cpu_cores` asks for, from the environment."""
    from dlbfluid._runtime.devices import _cores, cpu_devices_wanted

    assert cpu_devices_wanted({}) == _cores() >= 1
    assert cpu_devices_wanted({"DLBFLUID_CPU_DEVICES": "auto"}) == _cores()
    assert cpu_devices_wanted({"DLBFLUID_CPU_DEVICES": " 3 "}) == 3
    flags = "--xla_cpu_foo=1 --xla_force_host_platform_device_count=4"
    assert cpu_devices_wanted({"XLA_FLAGS": flags, "DLBFLUID_CPU_DEVICES": "3"}) is None
    assert cpu_devices_wanted({"JAX_NUM_CPU_DEVICES": "2"}) is None
    for bad in ("0", "-2", "1.5", "many"):
        with pytest.raises(ValueError, match=f"DLBFLUID_CPU_DEVICES = '{bad}' is invalid"):
            cpu_devices_wanted({"DLBFLUID_CPU_DEVICES": bad})
    jax.numpy.zeros(1).block_until_ready()  # (the backend starts here at the latest)
    assert dl.use_cpu_cores({}) is None  # too late: nothing changes


def test_noise_variants_change_only_the_routers_models():
    cfg = ex.ExperimentConfig("noise", scenarios=2, trials=2, horizon=6.0, tick=0.1)
    _, clean, _ = ex._variant_batch(cfg, {"noise": 0.0})
    _, noisy, _ = ex._variant_batch(cfg, {"noise": 0.25})
    np.testing.assert_array_equal(np.asarray(noisy.service.capacity),
                                  np.asarray(clean.service.capacity))
    np.testing.assert_array_equal(np.asarray(clean.estimate.capacity),
                                  np.asarray(clean.service.capacity))
    # capacity = 1/beta and beta is scaled by 1 + eps*xi: the ratio lies in 1/[0.75, 1.25],
    # one draw per scenario, shared by its trials.
    mask = np.asarray(noisy.cell_mask)
    r = np.asarray(noisy.estimate.capacity / noisy.service.capacity)[mask]
    assert np.all((r >= 1 / 1.25 - 1e-12) & (r <= 1 / 0.75 + 1e-12)) and np.std(r) > 0.01
    np.testing.assert_array_equal(np.asarray(noisy.estimate.capacity[0]),
                                  np.asarray(noisy.estimate.capacity[1]))
    _, fitted, _ = ex._variant_batch(cfg, {"fit": True})
    r = np.asarray(fitted.estimate.capacity / fitted.service.capacity)[mask]
    assert np.all(np.abs(r - 1) < 0.1)  # fits from 500 samples at 5% noise


def test_a_chosen_subset_of_variants_runs_alone_with_the_same_numbers(tmp_path):
    """`variants` runs the chosen levels only, in the kind's order whatever the order given,
    with the numbers a run of another subset gets for the same level (a level's scenarios
    do not depend on which other levels run); the fingerprint records the choice, so a
    directory never resumes with another one, and leaves it out when every variant runs
    (the directories recorded before the option keep resuming)."""
    kw = dict(scenarios=1, trials=1, horizon=6.0, tick=0.1, policies=("rand", "flow-grad"))
    two = ex.ExperimentConfig("utilization", variants=("u=0.9", "u=0.5"), **kw)
    assert two.variants == ("u=0.5", "u=0.9")
    assert [label for label, _ in two.run_variants()] == ["u=0.5", "u=0.9"]
    assert two.to_json()["variants"] == ["u=0.5", "u=0.9"]
    assert "variants" not in ex.ExperimentConfig("utilization", **kw).to_json()
    assert len(ex.ExperimentConfig("utilization", **kw).run_variants()) == 6

    ex.run_experiment(two, tmp_path / "two")
    ex.run_experiment(ex.ExperimentConfig("utilization", variants=("u=0.9",), **kw), tmp_path / "one")
    both, one = _rows(tmp_path / "two" / "results.csv"), _rows(tmp_path / "one" / "results.csv")
    assert [(r["variant"], r["policy"]) for r in both] == [
        ("u=0.5", "rand"), ("u=0.5", "flow-grad"), ("u=0.9", "rand"), ("u=0.9", "flow-grad")
    ]  # fmt: skip
    assert [r["mean_latency"] for r in both[2:]] == [r["mean_latency"] for r in one]
    assert both[0]["mean_latency"] != both[2]["mean_latency"]  # (the levels differ)
    with pytest.raises(ValueError, match=r"variants.*\['u=0.5', 'u=0.9'\] -> \['u=0.9'\]"):
        ex.run_experiment(
            ex.ExperimentConfig("utilization", variants=("u=0.9",), **kw), tmp_path / "two"
        )


@pytest.mark.parametrize(
    "chosen, message",
    [
        (("y=3",), "variants: 'y=3' is invalid: allowed variants of duration are ['y=0.1',"),
        (("y=10", "y=10"), "variants = ['y=10', 'y=10'] is invalid: ['y=10'] named twice"),
        ((), "variants = [] is invalid: expected at least one of"),
        ("y=10", "variants = 'y=10' is invalid: expected a list of labels"),
    ],
)
def test_bad_variants_name_the_field_and_the_labels_allowed(chosen, message):
    with pytest.raises(ValueError) as e:
        ex.ExperimentConfig("duration", variants=chosen)
    assert message in str(e.value)


def test_cli_variants_are_checked_before_any_work(capsys, tmp_path):
    out = tmp_path / "d"
    code = main(["experiment", "duration", "--variants", "y=10", "y=3", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--variants: 'y=3' is invalid: allowed variants of duration are" in err
    assert not out.exists()
