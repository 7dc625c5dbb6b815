"""Execute every notebook in notebooks/ top to bottom at small size (DLBFLUID_SMALL=1)."""

import os
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("DLBFLUID_SMALL", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    assert os.environ["DLBFLUID_SMALL"] == "1"
    if path.stem in CHECKS:
        CHECKS[path.stem](nb)


def _request_level_numbers(nb):
    """request_level_evaluation: the numbers its tagged `check` cell prints, the notebook's
    own normalisation of the recorded results.csv, equal the recorded summary.json."""
    import json

    out = [o["text"] for c in nb.cells if "check" in c.metadata.get("tags", [])
           for o in c.get("outputs", []) if o.get("output_type") == "stream"]  # fmt: skip
    line = next(ln for t in out for ln in t.splitlines() if ln.startswith("CHECK "))
    got = json.loads(line[len("CHECK "):])
    assert "baseline/baseline/flow-grad" in got and "baseline/baseline/mnlb" in got
    results = Path(__file__).parent.parent / "notebooks" / "results"
    for key, value in got.items():
        kind, variant, policy = key.split("/")
        summary = json.loads((results / f"requests_{kind}" / "summary.json").read_text())
        row = next(r for r in summary["summary"] if (r["variant"], r["policy"]) == (variant, policy))
        assert value == pytest.approx(row["normalized_latency"], rel=1e-9), key
        assert value != pytest.approx(row["fluid_normalized_latency"], rel=1e-6), key


CHECKS = {"request_level_evaluation": _request_level_numbers}
