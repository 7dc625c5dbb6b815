"""`benchmarks/accelerator.py --model requests` (the request-level twin on a device, issue 32
item 4) in its CPU smoke mode: the JSON lines as it goes, the rows' arithmetic against the
simpy peer, and `--budget` stopping before a batch predicted not to fit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def accelerator():
    sys.path.insert(0, str(BENCH))
    try:
        import accelerator

        yield accelerator
    finally:
        sys.path.remove(str(BENCH))


def test_smoke_rows_peer_and_budget(accelerator, capsys):
    """One float32 batch of 2 runs, then `--budget` 1 s: the next batch (4 runs) is predicted
    from the first (its compile again plus two calls) past the budget and not started.
    Control: the stop names that batch, and no row of it exists."""
    out = accelerator.main(["--model", "requests", "--smoke", "--dtypes", "float32",
                            "--budget", "1"])  # fmt: skip
    lines = capsys.readouterr().out.strip().splitlines()
    first = json.loads(lines[0])
    assert list(first) == ["peer_simpy"] and first["peer_simpy"]["requests"] > 0
    (row,) = out["rows"]
    assert json.loads(lines[1]) == {"row": row}  # (printed as soon as measured)
    assert (row["batch"], row["scenarios"], row["trials"], row["dtype"]) == (2, 2, 1, "float32")
    assert row["statuses"] == {"success": 2} and row["requests"] > 0
    assert row["requests_per_s"] == pytest.approx(row["requests"] / row["wall_s"])
    assert row["speedup"] == pytest.approx(
        row["requests_per_s"] / out["peer_simpy"]["requests_per_s"]
    )
    assert row["compile_s"] > 0 and row["first_call_s"] >= row["compile_s"]
    assert out["stopped"].startswith("batch 4: predicted")
    assert json.loads("\n".join(lines[2:]))["rows"] == [row]  # the whole record last
