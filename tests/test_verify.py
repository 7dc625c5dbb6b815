"""Batch verification: generator, resumable results, summary (issue: Theorem 1 §4)."""

import json

import numpy as np
import pytest

import dlbfluid as dl
import dlbfluid._verify.records
from dlbfluid._cli import main
from dlbfluid._verify import draw_scenario, random_network, summarise, verify

KW = dict(chunk=2, n_cells=(2, 3), horizon=20.0, tick=0.1)


def test_generator_satisfies_assumptions():
    rng = np.random.default_rng(0)
    utils = []
    for _ in range(30):
        d = random_network(rng, int(rng.integers(2, 7)))
        s = dl.scenario_from_dict({k: v for k, v in d.items() if k != "utilisation"})
        dl.check_capacity(s)  # Assumption 2, strictly
        sv = s.service
        soft = np.asarray(sv.model) == 1
        a0 = np.asarray(sv.base_latency - sv.knee / sv.capacity)[soft]
        assert np.all(a0 > 0)  # Assumptions 1 and 3 for every cost
        assert np.all(np.diag(np.asarray(s.allowed)))
        lam = np.asarray(s.arrival_rate(0.0))
        utils.append(lam.sum() / np.asarray(sv.capacity).sum())
        assert utils[-1] == pytest.approx(d["utilisation"], rel=1e-12)
    assert 0.4 <= min(utils) and max(utils) <= 0.85
    # Scenario i of a stream does not depend on how the stream is chunked.
    assert draw_scenario(5, 3) == draw_scenario(5, 3)
    assert draw_scenario(5, 3) != draw_scenario(5, 4)


def test_resume_after_kill_loses_and_duplicates_nothing(tmp_path):
    # (one flow policy: resuming is the same for each; test_verify_cli_json runs all three)
    kw = dict(KW, policies=("flow-grad",))
    out = tmp_path / "run"
    full = verify(4, 7, out_dir=out, **kw)
    # A run killed after its first chunk, in the middle of writing the next line (a rerun
    # with other settings is refused: tests/test_resume.py).
    lines = (out / "results.jsonl").read_text().splitlines(keepends=True)
    (out / "results.jsonl").write_text("".join(lines[:2]) + '{"index": 2, "n_cel')
    resumed = verify(4, 7, out_dir=out, **kw)
    lines = (out / "results.jsonl").read_text().splitlines()
    idx = [json.loads(line)["index"] for line in lines]
    assert sorted(idx) == [0, 1, 2, 3] and len(idx) == 4
    for a, b in zip(full["records"], resumed["records"]):
        assert a["index"] == b["index"]
        for pol in a["policies"]:
            for key in ("time_average_distance", "final_distance", "step_size"):
                assert a["policies"][pol][key] == pytest.approx(b["policies"][pol][key],
                                                                rel=1e-9, abs=1e-12)
    assert json.loads((out / "summary.json").read_text())["scenarios"] == 4
    r = full["records"][0]["policies"]["flow-grad"]
    assert r["eta_over_eta_star"] == pytest.approx(0.3, rel=1e-12)
    assert r["kkt_residual"] <= 1e-9


def test_summary_fractions():
    recs = [{"policies": {p: {"converged": c, "status": "success", "time_average_distance": t,
                              "final_distance": t, "eta_over_eta_star": 0.3}
                          for p in ("flow-rif", "flow-lat", "flow-grad")}}
            for c, t in ((True, 0.1), (False, 0.3), (True, 0.2), (True, 0.4))]
    s = summarise(recs)
    assert s["policies"]["flow-lat"]["converged_fraction"] == 0.75
    assert s["policies"]["flow-lat"]["time_average_distance"]["q50"] == pytest.approx(0.25)


def test_verify_cli_json(tmp_path, capsys, monkeypatch):
    """The --json object of a real run (flow-grad: the shapes and policy of
    test_resume_after_kill_loses_and_duplicates_nothing, whose compiled chunk it reuses),
    then the policies a run without --policy computes (records faked, as in
    tests/test_resume.py: nothing compiles): the three flow policies."""
    argv = ["verify", "--scenarios", "2", "--seed", "7", "--chunk", "2", "--min-cells", "2",
            "--max-cells", "3", "--horizon", "20", "--tick", "0.1", "--json"]
    rc = main(argv + ["--policy", "flow-grad", "--out", str(tmp_path / "real")])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert set(res) == {"summary", "scenarios"}
    assert res["summary"]["scenarios"] == 2
    assert set(res["summary"]["policies"]) == {"flow-grad"}
    rec = res["scenarios"][0]["policies"]["flow-grad"]
    for key in ("converged", "time_average_distance", "final_distance", "eta_over_eta_star"):
        assert key in rec
    assert rec["eta_over_eta_star"] == pytest.approx(0.3, rel=1e-12)

    def records(idx, seed, source, pols, *rest, **kw):
        return [{"index": i, "n_cells": 2, "utilisation": 0.5,
                 "policies": {p: {"converged": True, "status": "success",
                                  "time_average_distance": 0.1, "final_distance": 0.1,
                                  "eta_over_eta_star": 0.3} for p, _ in pols}}
                for i in idx]  # fmt: skip

    monkeypatch.setattr(dlbfluid._verify.records, "_chunk_records", records)
    assert main(argv + ["--out", str(tmp_path / "default")]) == 0
    res = json.loads(capsys.readouterr().out)
    assert set(res["summary"]["policies"]) == {"flow-rif", "flow-lat", "flow-grad"}
    assert set(res["scenarios"][0]["policies"]) == {"flow-rif", "flow-lat", "flow-grad"}
