"""Helpers of notebooks/paper_evaluation.ipynb: reading recorded experiment summaries,
tabulating and plotting them, and the live runs' per-cell views.

A recorded run is the `summary.json` that `dlbfluid.run_experiment` writes:
`{"experiment", "config", "summary": [{"variant", "policy", "runs", "failed",
"normalized_latency", "normalized_latency_p10", "normalized_latency_p50",
"normalized_latency_p90", "mean_latency", "error_rate", "error_rate_p90"}, ...]}`.

The paper's findings, checked on such a summary, live in the package
(`dlbfluid._evaluation.paper_findings`, which the tests import); their names are re-exported here
for the notebook.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from dlbfluid._evaluation.config import KINDS as KINDS
from dlbfluid._evaluation.config import POLICIES as POLICIES
from dlbfluid._evaluation.paper_findings import DLB as DLB
from dlbfluid._evaluation.paper_findings import FIELDS as FIELDS
from dlbfluid._evaluation.paper_findings import Finding as Finding
from dlbfluid._evaluation.paper_findings import check as check
from dlbfluid._evaluation.paper_findings import format_findings as format_findings
from dlbfluid._evaluation.paper_findings import policies_of as policies_of
from dlbfluid._evaluation.paper_findings import value as value
from dlbfluid._evaluation.paper_findings import variant_number as variant_number
from dlbfluid._evaluation.paper_findings import variants_of as variants_of

# ----------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------


def results_dir() -> Path:
    """`$DLBFLUID_RESULTS`, or `results/` next to this file (the notebook's folder)."""
    env = os.environ.get("DLBFLUID_RESULTS")
    return Path(env) if env else Path(__file__).resolve().parent / "results"


def load_recorded(directory=None) -> dict[str, dict]:
    """The recorded summaries `<directory>/<kind>.json` that exist, by kind.

    **Raises:** `ValueError` naming the file when a file exists but is not a summary.
    """
    d = results_dir() if directory is None else Path(directory)
    out = {}
    for kind in KINDS:
        path = d / f"{kind}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("summary"), list):
            raise ValueError(f"{path}: expected a run_experiment summary with a 'summary' list")
        for row in data["summary"]:
            missing = {"variant", "policy", *FIELDS} - set(row)
            if missing:
                raise ValueError(f"{path}: summary row {row!r} lacks {sorted(missing)}")
        exp = data.get("experiment", kind)
        if exp != kind:
            raise ValueError(f"{path}: holds experiment {exp!r}, expected {kind!r}")
        out[kind] = data
    return out


# ----------------------------------------------------------------------------------------
# Tables and plots
# ----------------------------------------------------------------------------------------


def _fmt(v, pct=False) -> str:
    if v is None:
        return "-"
    return f"{100 * v:.3f}%" if pct else f"{v:.3f}"


def format_table(summary: list[dict]) -> str:
    """Policy x variant table of normalised latency, its 90th percentile across
    scenarios x trials, and the error rate."""
    variants, policies = variants_of(summary), policies_of(summary)
    blocks = []
    for field, title, pct in (
        ("normalized_latency", "mean latency / Rand's (mean over scenarios x trials)", False),
        ("normalized_latency_p90", "mean latency / Rand's, 90th percentile", False),
        ("error_rate", "error rate (dropped / arrived)", True),
    ):
        w = max(10, *(len(v) + 2 for v in variants))
        lines = [title, f"{'policy':<10}" + "".join(f"{v:>{w}}" for v in variants)]
        for p in policies:
            cells = "".join(f"{_fmt(value(summary, v, p, field), pct):>{w}}" for v in variants)
            lines.append(f"{p:<10}" + cells)
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def plot_recorded(kind: str, summary: list[dict], title: str = ""):
    """Normalised latency and error rate per variant: lines over the variant's level for
    `utilization` and `duration` (log axis for the duration scale), bars otherwise."""
    import matplotlib.pyplot as plt

    variants, policies = variants_of(summary), policies_of(summary)
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    levels = [variant_number(v) for v in variants]
    as_lines = kind in ("utilization", "duration") and all(x is not None for x in levels)
    width = 0.8 / max(len(policies), 1)
    xs = np.arange(len(variants))
    for k, p in enumerate(policies):
        m = np.array([np.nan if (v := value(summary, x, p)) is None else v for x in variants])
        e = [value(summary, x, p, "error_rate") for x in variants]
        e = 100 * np.array([np.nan if v is None else v for v in e])
        style = dict(color=f"C{k}", label=p, lw=2.2 if p in ("rand", "mnlb") else 1.4)
        if as_lines:
            ls = "--" if p in ("rand", "mnlb") else "-"
            axes[0].plot(levels, m, "o" + ls, ms=3, **style)
            axes[1].plot(levels, e, "o" + ls, ms=3, **style)
        else:
            off = xs + (k - (len(policies) - 1) / 2) * width
            axes[0].bar(off, m, width, color=f"C{k}", label=p)
            axes[1].bar(off, e, width, color=f"C{k}", label=p)
    for ax, lab in zip(axes, ("mean latency / Rand's", "errors (% of requests)")):
        if as_lines:
            ax.set_xlabel("utilisation" if kind == "utilization" else "duration scale y")
            if kind == "duration":
                ax.set_xscale("log")
                ax.set_xticks(levels, [f"{x:g}" for x in levels])
                ax.minorticks_off()
        else:
            ax.set_xticks(xs, variants)
        ax.set_ylabel(lab)
        ax.grid(alpha=0.3)
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle(title or f"recorded experiment: {kind}")
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------
# Live runs (notebook sections 2 and 3)
# ----------------------------------------------------------------------------------------


def replica_fraction(scn, t) -> np.ndarray:
    """$c_j(t) = k_j(t)/k_j$ of an unbatched scenario at times `t` `(S,)`: `(S, n)`."""
    times = np.asarray(scn.replica_times)  # (n, Q)
    counts = np.asarray(scn.replica_counts)
    k = np.asarray(scn.replicas)
    t = np.asarray(t, dtype=float)
    idx = np.clip((times[None, :, :] <= t[:, None, None]).sum(-1) - 1, 0, None)  # (S, n)
    return np.take_along_axis(counts[None].repeat(t.size, 0), idx[..., None], -1)[..., 0] / k


def cell_utilisation(sol, scn):
    """Per-cell utilisation over each save interval: the service rate
    $\\Delta D_j/\\Delta t$ over the running capacity $c_j(t)\\bar\\mu_j$, at the interval
    midpoints. Returns `(t_mid (S,), util (S, n))` for the real cells."""
    t = np.asarray(sol.t)
    dep = np.asarray(sol.departures)
    n = int(np.asarray(scn.cell_mask).sum())
    mid = 0.5 * (t[1:] + t[:-1])
    rate = np.diff(dep, axis=0) / np.diff(t)[:, None]
    cap = np.asarray(scn.service.capacity)[None] * replica_fraction(scn, mid)
    return mid, (rate / cap)[:, :n]


def show_recorded(recorded: dict, kind: str) -> list[Finding]:
    """Notebook section 4 for one kind: the table, the plot and the findings table; a
    printed note when the kind has not been recorded. Returns the findings."""
    import matplotlib.pyplot as plt

    if kind not in recorded:
        print(f"no recorded run {results_dir() / (kind + '.json')}: section skipped")
        return []
    data = recorded[kind]
    c = data.get("config", {})
    print(
        f"{kind}: {c.get('scenarios')} scenarios x {c.get('trials')} trials, "
        f"horizon {c.get('horizon')} s, tick {c.get('tick')} s, policies {c.get('policies')}\n"
    )
    failed = [r for r in data["summary"] if r.get("failed")]
    for r in failed:
        print(f"note: {r['variant']} {r['policy']}: {r['failed']} of {r['runs']} runs failed")
    print(format_table(data["summary"]))
    plot_recorded(kind, data["summary"])
    plt.show()
    rows = check(kind, data["summary"])
    print(format_findings(rows))
    return rows
