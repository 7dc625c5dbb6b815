"""Resumable output directories (`dlbfluid._runtime.manifest`): a rerun resumes only the same run.

`verify`'s per-chunk numerics are replaced by records computed from each scenario's own
draw and the run's settings (as in tests/test_distributed.py), and the experiment's
directory is opened with `_open_results` directly, so nothing here compiles.
"""

import csv
import io
import json
import math

import pytest

import dlbfluid
import dlbfluid._verify.records
from dlbfluid._cli import main
from dlbfluid._cli._flags import EXPERIMENT
from dlbfluid._cli._flags import VERIFY as VERIFY_FLAGS
from dlbfluid._evaluation import experiment as ex
from dlbfluid._runtime.manifest import MANIFEST

VERIFY = [
    "verify",
    "--scenarios",
    "4",
    "--chunk",
    "2",
    "--seed",
    "0",
    "--min-cells",
    "2",
    "--max-cells",
    "3",
    "--horizon",
    "2",
    "--tick",
    "0.1",
    "--json",
    "--no-progress",
]


@pytest.fixture
def chunks(monkeypatch):
    """Fake per-chunk records (depending on the seed, horizon and scenario); the list of
    chunks computed."""
    log = []

    def records(idx, seed, source, pols, chunk, n_cells, tick, horizon, *rest, **kw):
        assert 1 <= len(idx) <= chunk
        log.append(list(idx))
        out = []
        for i in idx:
            d = source(seed, i)
            u = d["utilisation"]
            out.append(
                {
                    "index": i,
                    "n_cells": len(d["cells"]),
                    "utilisation": u,
                    "policies": {
                        p: {
                            "step_size": u / 7,
                            "critical_step_size": u / 3,
                            "eta_over_eta_star": 3 / 7,
                            "time_average_distance": math.sqrt(u) / horizon,
                            "final_distance": u**3 / 3,
                            "oscillation": 0.0,
                            "converged": i % 2 == 0,
                            "status": "success",
                            "equilibrium_status": "success",
                            "kkt_residual": 0.0,
                        }
                        for p, _ in pols
                    },
                }
            )
        return out

    monkeypatch.setattr(dlbfluid._verify.records, "_chunk_records", records)
    return log


def _verify(capsys, out, *changes):
    argv = list(VERIFY)
    for flag, value in changes:
        argv[argv.index(flag) + 1] = value
    code = main(argv + ["--out", str(out)])
    got = capsys.readouterr()
    return code, got.out, got.err


def _files(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _half_finished(out):
    """Keep the first chunk's two records of a finished run, plus a torn line (killed
    while writing), and drop the summary."""
    path = out / "results.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:2]) + '{"index": 2, "n_ce')
    (out / "summary.json").unlink()


@pytest.mark.parametrize("state", ["finished", "half-finished"])
@pytest.mark.parametrize(
    "flag, value, shown",
    [
        ("--seed", "1", "seed (--seed): 0 -> 1"),
        ("--horizon", "1", "horizon (--horizon): 2.0 -> 1.0"),
        ("--scenarios", "2", "n_scenarios (--scenarios): 4 -> 2"),
        ("--max-cells", "4", "n_cells (--min-cells, --max-cells): [2, 3] -> [2, 4]"),
        ("--tick", "0.05", "tick (--tick): 0.1 -> 0.05"),
    ],
)
def test_verify_refuses_other_settings(chunks, capsys, tmp_path, state, flag, value, shown):
    out = tmp_path / "run"
    assert _verify(capsys, out)[0] == 0
    if state == "half-finished":
        _half_finished(out)
    before = _files(out)
    chunks.clear()
    code, stdout, err = _verify(capsys, out, (flag, value))
    assert code == 2 and stdout == "" and chunks == []
    assert f"--out = {str(out)!r} is invalid: it holds a different verify run" in err
    assert shown in err and "resume with the same options or choose a new --out" in err
    assert _files(out) == before  # not even the torn line is cleaned up


@pytest.mark.parametrize("chunk", ["2", "1", "3"])
def test_verify_resumes_the_same_run_with_any_chunk(chunks, capsys, tmp_path, chunk):
    ref = tmp_path / "ref"
    code, stdout, _ = _verify(capsys, ref)
    assert code == 0
    full = json.loads(stdout)
    out = tmp_path / "run"
    _verify(capsys, out)
    _half_finished(out)
    chunks.clear()
    code, stdout, err = _verify(capsys, out, ("--chunk", chunk))
    assert code == 0
    assert f"resuming 2 of 4 scenarios done in {out}" in err
    assert chunks == {"2": [[2, 3]], "1": [[2], [3]], "3": [[2, 3]]}[chunk]
    got = json.loads(stdout)
    assert got["scenarios"] == full["scenarios"]
    lines = (out / "results.jsonl").read_text().splitlines()
    assert [json.loads(x)["index"] for x in lines] == [0, 1, 2, 3]
    assert (out / "results.jsonl").read_bytes() == (ref / "results.jsonl").read_bytes()
    assert (out / MANIFEST).read_bytes() == (ref / MANIFEST).read_bytes()
    # A finished run reruns without computing anything.
    chunks.clear()
    code, _, err = _verify(capsys, out)
    assert code == 0 and chunks == [] and "resuming 4 of 4 scenarios done" in err


def test_verify_manifest_and_a_new_directory_says_nothing(chunks, capsys, tmp_path):
    code, _, err = _verify(capsys, tmp_path / "run")
    assert code == 0 and "resuming" not in err
    m = json.loads((tmp_path / "run" / MANIFEST).read_text())
    assert m == {
        "command": "verify",
        "version": dlbfluid.__version__,
        "config": {
            "n_scenarios": 4,
            "seed": 0,
            "n_cells": [2, 3],
            "horizon": 2.0,
            "tick": 0.1,
            "step_fraction": 0.3,
            "conv_tol": 1e-3,
            "nodes": 8,
            "policies": ["flow-rif", "flow-lat", "flow-grad"],
            "draw": None,
        },
    }


def test_verify_refuses_another_version(chunks, capsys, tmp_path, monkeypatch):
    out = tmp_path / "run"
    _verify(capsys, out)
    _half_finished(out)
    before = _files(out)
    monkeypatch.setattr(dlbfluid, "__version__", "9.9.9")
    code, _, err = _verify(capsys, out)
    assert code == 2
    old = before[MANIFEST].decode()
    v = json.loads(old)["version"]
    assert f"dlbfluid version: {v!r} -> '9.9.9' (results may differ between versions)" in err
    assert f"resume with the same options and dlbfluid {v} or choose a new --out" in err
    assert _files(out) == before


def test_verify_refuses_results_without_a_manifest(chunks, capsys, tmp_path):
    # A directory of a version that recorded no settings: nothing says which seed, horizon...
    out = tmp_path / "run"
    _verify(capsys, out)
    (out / MANIFEST).unlink()
    before = _files(out)
    code, _, err = _verify(capsys, out)
    assert code == 2
    assert "it holds results.jsonl but no manifest.json" in err and "choose a new --out" in err
    assert _files(out) == before


def test_verify_refuses_another_command_and_a_broken_manifest(chunks, capsys, tmp_path):
    out = tmp_path / "run"
    ex._open_results(ex.ExperimentConfig("burst", scenarios=1, trials=1), out)
    code, _, err = _verify(capsys, out)
    assert code == 2 and "it holds the results of dlbfluid 'experiment', not of 'verify'" in err
    (out / MANIFEST).write_text("{")
    code, _, err = _verify(capsys, out)
    assert code == 2 and "its manifest.json is not a dlbfluid manifest" in err


def test_verify_records_a_custom_source(chunks, tmp_path):
    from dlbfluid._verify import draw_scenario, verify

    def mine(seed, i):
        return draw_scenario(seed, i, n_cells=(2, 2))

    verify(2, out_dir=tmp_path, chunk=2, horizon=2.0, tick=0.1, draw=mine)
    m = json.loads((tmp_path / MANIFEST).read_text())
    assert m["config"]["draw"].endswith("test_verify_records_a_custom_source.<locals>.mine")
    with pytest.raises(ValueError, match=r"draw: '.*mine' -> None"):
        verify(2, out_dir=tmp_path, chunk=2, horizon=2.0, tick=0.1)


def test_verify_refusals_name_the_fields_or_the_given_labels(chunks, tmp_path):
    """The Python API names its own arguments and fields (`out_dir`, `tick`); the
    command line's options (`--out`, `--tick`) only where `labels=` gives them."""
    from dlbfluid._verify import verify

    out = tmp_path / "run"
    kw = dict(out_dir=out, chunk=2, n_cells=(2, 3), horizon=2.0, tick=0.1)
    verify(4, **kw)
    before = _files(out)
    with pytest.raises(ValueError) as e:
        verify(4, **{**kw, "tick": 0.05})
    msg = str(e.value)
    assert msg.startswith(f"out_dir = {str(out)!r} is invalid: it holds a different verify run")
    assert "(changed: tick: 0.1 -> 0.05)" in msg and "choose a new out_dir" in msg
    assert "--tick" not in msg and "--out" not in msg
    with pytest.raises(ValueError) as e:
        verify(4, **{**kw, "tick": 0.05}, labels=VERIFY_FLAGS)
    msg = str(e.value)
    assert msg.startswith(f"--out = {str(out)!r} is invalid: it holds a different verify run")
    assert "(changed: tick (--tick): 0.1 -> 0.05)" in msg and "choose a new --out" in msg
    assert "out_dir" not in msg
    assert _files(out) == before


# ----------------------------------------------------------------------------------------
# experiment
# ----------------------------------------------------------------------------------------

POLS = ("rand", "mnlb", "flow-grad")


def small(**kw):
    base = dict(experiment="burst", scenarios=2, trials=1, horizon=6.0, tick=0.1, policies=POLS)
    base.update(kw)
    return ex.ExperimentConfig(**base)


def _row(policy, scenario, latency="1.5"):
    return {
        "experiment": "burst",
        "variant": "burst",
        "policy": policy,
        "scenario": scenario,
        "trial": 0,
        "n_cells": 3,
        "utilisation": "0.8",
        "step_size": "",
        "mean_latency": latency,
        "error_rate": "0",
        "status": "success",
    }


def _csv_text(rows):
    f = io.StringIO(newline="")
    w = csv.DictWriter(f, fieldnames=ex.FIELDS, lineterminator="\r\n")
    w.writeheader()
    w.writerows(rows)
    return f.getvalue()


def test_experiment_refuses_another_config_through_the_cli(tmp_path, capsys):
    out = tmp_path / "exp"
    ex._open_results(small(policies=("rand", "flow-grad")), out)
    before = _files(out)
    argv = [
        "experiment",
        "burst",
        "--scenarios",
        "3",
        "--trials",
        "1",
        "--horizon",
        "6",
        "--tick",
        "0.1",
        "--policies",
        "rand",
        "flow-grad",
        "--no-progress",
        "--out",
        str(out),
    ]
    assert main(argv) == 2  # refused before anything is drawn or simulated
    err = capsys.readouterr().err
    assert "it holds a different experiment run" in err
    assert "scenarios (--scenarios): 2 -> 3" in err and "choose a new --out" in err
    assert _files(out) == before


def test_experiment_bad_value_names_the_field_or_the_option(tmp_path, capsys):
    """`ExperimentConfig` names its field; `dlbfluid experiment` the option, before `--out`
    is made."""
    with pytest.raises(ValueError, match=r"^horizon = 1.0 is invalid: expected a multiple"):
        small(horizon=1.0, tick=0.3)
    out = tmp_path / "exp"
    argv = ["experiment", "burst", "--horizon", "1", "--tick", "0.3", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("dlbfluid experiment: error: --horizon = 1.0 is invalid: expected a ")
    assert not out.exists()


def test_experiment_refuses_another_config_or_version(tmp_path, monkeypatch):
    out = tmp_path / "exp"
    assert ex._open_results(small(), out) == {}
    (out / "results.csv").write_text(_csv_text([_row("rand", 0), _row("rand", 1)]))
    before = _files(out)
    with pytest.raises(ValueError) as e:  # the Python API: the fields' own names
        ex._open_results(small(trials=2, seed=3), out)
    msg = str(e.value)
    assert msg.startswith(f"out_dir = {str(out)!r} is invalid: it holds a different experiment")
    assert "seed: 0 -> 3" in msg and "trials: 1 -> 2" in msg and "a new out_dir" in msg
    assert "(--" not in msg and "--out" not in msg
    with pytest.raises(ValueError) as e:  # the command line's labels: its options
        ex._open_results(small(trials=2, seed=3), out, EXPERIMENT)
    msg = str(e.value)
    assert msg.startswith(f"--out = {str(out)!r} is invalid: it holds a different experiment")
    assert "seed (--seed): 0 -> 3" in msg and "trials (--trials): 1 -> 2" in msg
    assert "choose a new --out" in msg and "out_dir" not in msg
    with pytest.raises(ValueError, match=r"policies \(--policies\): \['rand', 'mnlb', "):
        ex._open_results(small(policies=("rand", "mnlb")), out, EXPERIMENT)
    with pytest.raises(ValueError, match=r"step_rule \(--step-rule\): 'paper' -> 'oracle'"):
        ex._open_results(small(step_rule="oracle"), out, EXPERIMENT)
    monkeypatch.setattr(dlbfluid, "__version__", "9.9.9")
    with pytest.raises(ValueError, match=r"dlbfluid version: '.*' -> '9.9.9'"):
        ex._open_results(small(), out)
    assert _files(out) == before
    monkeypatch.undo()
    assert list(ex._open_results(small(), out)) == [("burst", "rand")]


def test_experiment_adopts_a_directory_without_a_manifest(tmp_path, capsys):
    # A directory of a version without manifests: config.json and results.csv only.
    out = tmp_path / "exp"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(small().to_json(), indent=2) + "\n")
    (out / "results.csv").write_text(_csv_text([_row("rand", 0), _row("rand", 1)]))
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text((out / "config.json").read_text())
    before = _files(other)
    with pytest.raises(ValueError, match=r"^out_dir = .*\(changed: trials: 1 -> 2\)"):
        ex._open_results(small(trials=2), other)
    with pytest.raises(ValueError, match=r"^--out = .*\(changed: trials \(--trials\): 1 -> 2\)"):
        ex._open_results(small(trials=2), other, EXPERIMENT)
    assert _files(other) == before
    assert list(ex._open_results(small(), out)) == [("burst", "rand")]
    assert "resuming 1 of 3 units done in" in capsys.readouterr().err
    m = json.loads((out / MANIFEST).read_text())
    assert m == {
        "command": "experiment",
        "version": dlbfluid.__version__,
        "config": small().to_json(),
    }
    assert json.loads((out / "config.json").read_text()) == small().to_json()


def test_experiment_drops_a_torn_first_row_and_appends_after_it(tmp_path):
    # Killed while writing the first row of the second unit: the complete first unit
    # stays, the torn row goes, and the next rows start on a line of their own.
    out = tmp_path / "exp"
    ex._open_results(small(), out)
    rand = [_row("rand", 0), _row("rand", 1)]
    (out / "results.csv").write_text(_csv_text(rand) + "burst,burst,mnlb,0,0,")
    done = ex._open_results(small(), out)
    assert list(done) == [("burst", "rand")]
    assert (out / "results.csv").read_text().endswith("\n")
    mnlb = [_row("mnlb", 0, "1.25"), _row("mnlb", 1, "1.75")]
    ex._append(out / "results.csv", mnlb)
    rows = ex._read_rows(out / "results.csv")
    assert [(r["policy"], r["scenario"], r["mean_latency"]) for r in rows] == [
        ("rand", "0", "1.5"),
        ("rand", "1", "1.5"),
        ("mnlb", "0", "1.25"),
        ("mnlb", "1", "1.75"),
    ]
    assert list(ex._open_results(small(), out)) == [("burst", "rand"), ("burst", "mnlb")]
