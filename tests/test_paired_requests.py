"""`benchmarks/paired_requests.py`: two request-level experiment runs paired over their
scenarios, against numbers worked by hand (the acceptance tool of issue 40)."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
COLUMNS = ["experiment", "variant", "policy", "scenario", "trial", "n_cells", "utilisation",
           "step_size", "mean_latency", "error_rate", "status", "p90_latency",
           "fluid_mean_latency", "fluid_error_rate", "fluid_status"]  # fmt: skip


@pytest.fixture(scope="module")
def paired():
    sys.path.insert(0, str(BENCH))
    try:
        import paired_requests

        yield paired_requests
    finally:
        sys.path.remove(str(BENCH))


def write(directory: Path, means: dict, status="success"):
    """`means[(scenario, trial)] = mean latency`; p90 = 2 x mean, errors = mean / 100."""
    directory.mkdir()
    with (directory / "results.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for (s, t), m in means.items():
            w.writerow(["baseline", "baseline", "rand", s, t, 3, 0.8, 0.1, m, m / 100, status,
                        2 * m, m, 0.0, "success"])  # fmt: skip


def test_paired_difference_and_interval_by_hand(paired, tmp_path, capsys):
    """Scenario means (trials averaged): A = 1, 2, 3; B = 1.1, 2.3, 3.2 (differences 0.1,
    0.3, 0.2: mean 0.2, sample standard deviation 0.1, half-width t(0.95, 2) 0.1/sqrt 3 =
    0.16859). |0.2| > 0.169: it does not agree; the p90 doubles both."""
    a = {(0, 0): 0.5, (0, 1): 1.5, (1, 0): 2.0, (1, 1): 2.0, (2, 0): 3.0, (2, 1): 3.0}
    b = {(0, 0): 1.1, (0, 1): 1.1, (1, 0): 2.2, (1, 1): 2.4, (2, 0): 3.2, (2, 1): 3.2}
    write(tmp_path / "a", a)
    write(tmp_path / "b", b)
    out_path = tmp_path / "p.json"
    assert paired.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out_path)]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res == json.loads(out_path.read_text())
    r = res["policies"]["baseline"]["rand"]
    assert (r["scenarios"], r["trials"]) == (3, 2)
    m = r["mean_latency"]
    assert (m["a"], m["b"], m["diff"]) == pytest.approx((2.0, 2.2, 0.2), abs=1e-12)
    assert m["ci90"] == pytest.approx(2.920 * 0.1 / 3**0.5, rel=1e-9)
    assert m["agrees"] is False and res["agrees"] is False
    assert r["p90_latency"]["diff"] == pytest.approx(0.4) and r["p90_latency"]["ci90"] == (
        pytest.approx(2 * m["ci90"]))
    # The negative control: a run paired with itself agrees, every difference 0.
    assert paired.main([str(tmp_path / "a"), str(tmp_path / "a")]) == 0
    same = json.loads(capsys.readouterr().out)
    assert same["agrees"] is True
    assert same["policies"]["baseline"]["rand"]["error_rate"]["diff"] == 0.0


def test_refuses_failed_runs_and_unmatched_runs(paired, tmp_path):
    write(tmp_path / "a", {(0, 0): 1.0, (1, 0): 2.0})
    write(tmp_path / "bad", {(0, 0): 1.0, (1, 0): 2.0}, status="solver_failed")
    write(tmp_path / "short", {(0, 0): 1.0})
    with pytest.raises(SystemExit, match="'solver_failed'"):
        paired.main([str(tmp_path / "a"), str(tmp_path / "bad")])
    with pytest.raises(SystemExit, match="differ in"):
        paired.main([str(tmp_path / "a"), str(tmp_path / "short")])
    with pytest.raises(SystemExit, match="is not a file"):
        paired.main([str(tmp_path / "a"), str(tmp_path / "nowhere")])
