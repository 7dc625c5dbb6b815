"""Plots for newcomers: simulated trajectories (`plot_trajectories`, used by `dlbfluid demo`
and `dlbfluid simulate --out`) and an experiment's summary (`plot_summary`, used by
`run_experiment`).

Figures are bare `matplotlib.figure.Figure`s: no pyplot state, so the caller's backend
(e.g. a notebook's inline one) is left alone. `trajectory_figure` and `summary_figure`
build them (tests read their axes back); the `plot_*` functions save them as PNG.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

_DPI = 110


def _as_list(obj) -> list:
    return list(obj) if isinstance(obj, (list, tuple)) else [obj]


def _fmt_latency(v: float) -> str:
    return f"{v:.3f} s" if math.isfinite(v) else "n/a"


def trajectory_figure(
    solutions,
    *,
    title: str = "",
    equilibria=None,
    window: float = 0.5,
    ncols: int | None = None,
):
    """The figure of `plot_trajectories` (same arguments, without `path`).

    Each panel's axes carry a label, `"workload:POLICY"` or `"routing:POLICY"`
    (`Axes.get_label()`), so callers and tests can find them in `fig.axes`.
    """
    from matplotlib.figure import Figure

    sols, eqs, ncols = _trajectory_inputs(solutions, equilibria, window, ncols)
    k = len(sols)
    groups = -(-k // ncols)
    # Everything the panels show, first, so that the y-scales can be shared.
    panels = [_panel(sol, eq, window) for sol, eq in zip(sols, eqs)]

    def top(values, floor):
        finite = [float(np.nanmax(v)) for v in values if v is not None and np.isfinite(v).any()]
        return max([floor] + finite)

    N_top = 1.05 * top([p["N"] for p in panels] + [p["N_star"] for p in panels], 1e-12)
    share_top = min(
        1.02, 1.1 * top([p["share"] for p in panels] + [p["z_star"] for p in panels], 0.1)
    )

    width = 3.4 * ncols + (0.9 if ncols >= 3 else 2.4)
    fig = Figure(figsize=(width, 2.35 * 2 * groups + 1.1), layout="constrained")
    axes = fig.subplots(2 * groups, ncols, squeeze=False)
    heading = title or (sols[0].policy if k == 1 else "")
    n_max = max(p["n"] for p in panels)
    names = list(sols[0].cell_names) or [f"cell{j}" for j in range(n_max)]
    colours = [f"C{j % 10}" for j in range(n_max)]
    any_star = any(p["N_star"] is not None for p in panels)
    for c, p in enumerate(panels):
        g, col = divmod(c, ncols)
        ax_N, ax_x = axes[2 * g, col], axes[2 * g + 1, col]
        _draw_panel(ax_N, ax_x, p, colours, (N_top, share_top), first_column=col == 0)
        sol = p["sol"]
        # The policy's name once: in the panel, unless a single panel's heading has it.
        lat = f"mean latency {_fmt_latency(p['latency'])}"
        name = "" if (k == 1 and sol.policy and sol.policy in heading) else sol.policy
        if p["N_star"] is None and any_star:
            name += " (no cost: no $N^*$)"
        head = f"{name}: {lat}" if name else lat
        if p["status"] != "success":
            head += f" [{p['status']}]"
        ax_N.set_title(head, fontsize=9, color="k" if p["status"] == "success" else "C3")
    for c in range(k, groups * ncols):
        g, col = divmod(c, ncols)
        fig.delaxes(axes[2 * g, col])
        fig.delaxes(axes[2 * g + 1, col])
    _trajectory_legend(fig, [names[j] for j in range(n_max)], colours, any_star, window, ncols)
    if heading:
        fig.suptitle(heading, fontsize=11)
    return fig


def _trajectory_inputs(solutions, equilibria, window: float, ncols: int | None):
    """`(solutions, equilibria, ncols)` as lists and a column count, checked: unbatched
    solutions, one equilibrium (or `None`) each, `window` in (0, 1], `ncols` >= 1 (at most
    the number of solutions)."""
    sols = _as_list(solutions)
    if not sols:
        raise ValueError("solutions = [] is invalid: expected at least one Solution")
    for i, sol in enumerate(sols):
        if np.ndim(np.asarray(sol.status)) != 0:
            raise ValueError(
                f"solutions[{i}] is batched (status shape {np.shape(sol.status)}): expected "
                "unbatched Solutions; index the batch first"
            )
    k = len(sols)
    eqs: list[Any] = [None] * k if equilibria is None else _as_list(equilibria)
    if len(eqs) != k:
        raise ValueError(
            f"equilibria has {len(eqs)} entries: expected one per solution ({k}), each an "
            "EquilibriumSolution or None"
        )
    if not (0.0 < window <= 1.0):
        raise ValueError(f"window = {window!r} is invalid: expected a fraction in (0, 1]")
    ncols = k if ncols is None else ncols
    if isinstance(ncols, bool) or not isinstance(ncols, int) or ncols < 1:
        raise ValueError(f"ncols = {ncols!r} is invalid: expected an integer >= 1")
    return sols, eqs, min(ncols, k)


def _panel(sol, eq, window: float) -> dict:
    """What one solution's panel shows: its workloads, the share of arrivals per save
    interval, the equilibrium's $N^*$ and $z^*/\\sum z^*$ (or `None`), the mean-latency
    window's start, the mean latency and the status."""
    n = int(np.asarray(sol.cell_mask).sum())
    t = np.asarray(sol.t)
    # Share of all traffic arriving at each cell, averaged over each save interval
    # (from the exact cumulative arrivals): readable for bang-bang discrete routing too.
    arr = np.diff(np.asarray(sol.arrivals)[:, :n], axis=0)
    share = arr / np.maximum(arr.sum(axis=1, keepdims=True), 1e-300)
    N_star = z_star = None
    if eq is not None:
        N_star = np.asarray(eq.N)[:n]
        z = np.asarray(eq.z)[:n]
        z_star = z / max(float(z.sum()), 1e-300)
    s0 = sol._start(window)  # the first save of `mean_latency`'s window
    return {
        "sol": sol,
        "n": n,
        "t": t,
        "N": np.asarray(sol.N)[:, :n],
        "tm": 0.5 * (t[1:] + t[:-1]),
        "share": share,
        "N_star": N_star,
        "z_star": z_star,
        "t_window": float(t[s0]),
        "latency": float(sol.mean_latency(window)),
        "status": str(sol.status_names()),
    }


def _draw_panel(ax_N, ax_x, p: dict, colours, tops, *, first_column: bool) -> None:
    """One solution's two axes: workloads over time and the share of arrivals, each
    cell's equilibrium as a dotted line, the mean-latency window shaded; `tops` the
    shared y-limits."""
    sol = p["sol"]
    ax_N.set_label(f"workload:{sol.policy}")
    ax_x.set_label(f"routing:{sol.policy}")
    for ax in (ax_N, ax_x):
        ax.axvspan(p["t_window"], p["t"][-1], color="0.92", lw=0, zorder=0)
        ax.set_xlim(p["t"][0], p["t"][-1])
        ax.grid(alpha=0.25, lw=0.5)
        ax.tick_params(labelsize=8)
    for j in range(p["n"]):
        ax_N.plot(p["t"], p["N"][:, j], lw=1.1, color=colours[j])
        ax_x.plot(p["tm"], p["share"][:, j], lw=1.1, color=colours[j])
        if p["N_star"] is not None:
            # Above the trajectory, which converges onto it when the policy does.
            for ax, v in ((ax_N, p["N_star"][j]), (ax_x, p["z_star"][j])):
                ax.axhline(v, color="k", ls=(0, (1.5, 1.5)), lw=1.9, zorder=3)
                ax.axhline(v, color=colours[j], ls=(0, (1.5, 1.5)), lw=1.1, zorder=3)
    ax_N.set_ylim(0.0, tops[0])
    ax_x.set_ylim(0.0, tops[1])
    ax_N.tick_params(labelbottom=False)
    ax_x.set_xlabel("time (s)", fontsize=8)
    if first_column:
        ax_N.set_ylabel("workload $N_j$ (requests)", fontsize=8)
        ax_x.set_ylabel("share of arrivals", fontsize=8)


def _trajectory_legend(fig, names, colours, any_star: bool, window: float, ncols: int) -> None:
    """The cells' colours, the equilibrium's line (where a panel has one) and the window."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles: list[Any] = [
        Line2D([], [], color=colours[j], lw=1.5, label=name) for j, name in enumerate(names)
    ]
    if any_star:
        handles.append(
            Line2D(
                [],
                [],
                color="k",
                ls=(0, (1.5, 1.5)),
                lw=1.5,
                label="equilibrium $N^*$, $z^*$\nof the policy's cost",
            )
        )
    handles.append(
        Patch(color="0.92", label=f"mean-latency window\n(last {window:.0%} of the horizon)")
    )
    # Below a wide grid; beside a narrow one (one or two columns), which it would overflow.
    wide = ncols >= 3
    fig.legend(
        handles=handles,
        loc="outside lower center" if wide else "outside right center",
        ncols=len(handles) if wide else 1,
        fontsize=8,
        frameon=False,
    )


def plot_trajectories(
    solutions,
    path: str | Path,
    *,
    title: str = "",
    equilibria=None,
    window: float = 0.5,
    ncols: int | None = None,
) -> Path:
    """Workloads $N_j(t)$ and the share of traffic arriving at each cell (the routed flow
    $z_j = \\sum_i\\lambda_i x_{ij}$ averaged over each save interval, over
    $\\sum_k z_k$) of one or more unbatched `Solution`s, written to `path` (PNG).

    Each policy gets a workload panel above a routing panel, `ncols` policies to a row
    (default: all in one row). All workload panels share one y-scale and all routing
    panels another, so policies compare at a glance. Each panel's title gives the
    policy's mean end-to-end latency over the last `window` of the horizon
    (`Solution.mean_latency(window)`, shaded); with `equilibria`, dashed lines mark the
    equilibrium $N^*_j$ and $z^*_j/\\sum_k z^*_k$ of the policy's cost
    (theory/equilibria.md). The title is printed once: for a single solution whose
    `title` names the policy, the panel does not repeat it.

    **Arguments:**
    - `solutions`: a `Solution` or a list of them (unbatched).
    - `path`: the PNG to write (parent directories are created).
    - `title`: the figure's title (default: the policy's name for a single solution).
    - `equilibria`: `None`, or one entry per solution (a single one for a single
      solution): an `EquilibriumSolution` of the policy's cost, or `None` for a policy
      without one (weighted random, MNLB).
    - `window`: fraction of the horizon, at its end, of the mean latency (default 0.5,
      `dlbfluid simulate`'s default `--window`).
    - `ncols`: policies per row.

    **Returns:** `path` as a `Path`.

    **Raises:** `ValueError` for no solutions, a batched one, a count of `equilibria` that
    does not match, or a `window` outside $(0, 1]$.
    """
    fig = trajectory_figure(
        solutions, title=title, equilibria=equilibria, window=window, ncols=ncols
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=_DPI)
    return path


def _column(rows: dict, variants: Sequence, key: str) -> np.ndarray:
    vals = [rows.get(v, {}).get(key) for v in variants]
    return np.array([np.nan if x is None else float(x) for x in vals], dtype=float)


def summary_figure(summary: list[dict], title: str = ""):
    """The figure of `plot_summary`. Its axes are labelled `"latency"` and `"errors"`
    (`Axes.get_label()`)."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    variants = list(dict.fromkeys(s["variant"] for s in summary))
    policies = list(dict.fromkeys(s["policy"] for s in summary))
    fig = Figure(figsize=(max(8.0, 3.0 + 1.1 * len(variants) * 2), 4.4), layout="constrained")
    ax_l, ax_e = fig.subplots(1, 2)
    ax_l.set_label("latency")
    ax_e.set_label("errors")
    xs = np.arange(len(variants), dtype=float)
    width = 0.8 / max(len(policies), 1)
    lat_vals, err_vals, handles, failed = [], [], [], []
    for k, p in enumerate(policies):
        rows = {s["variant"]: s for s in summary if s["policy"] == p}
        colour = f"C{k % 10}"
        m = _column(rows, variants, "normalized_latency")
        lo = _column(rows, variants, "normalized_latency_p10")
        hi = _column(rows, variants, "normalized_latency_p90")
        e = 100.0 * _column(rows, variants, "error_rate")
        e90 = 100.0 * _column(rows, variants, "error_rate_p90")
        off = xs + (k - (len(policies) - 1) / 2) * width
        # Dot: the mean over scenarios x trials; bar: its 10-90% spread (exact, even where
        # the mean lies outside it).
        ax_l.vlines(off, lo, hi, color=colour, lw=1.6, alpha=0.8)
        ax_l.plot(off, m, "o", color=colour, ms=5, zorder=3)
        ax_e.bar(off, e, width * 0.9, color=colour)
        ok = np.isfinite(e) & np.isfinite(e90)
        if ok.any():
            ax_e.vlines(off[ok], e[ok], np.maximum(e90[ok], e[ok]), color="k", lw=0.8)
        lat_vals += [m, lo, hi]
        err_vals += [e, e90]
        handles.append(Line2D([], [], color=colour, marker="o", lw=1.6, label=p))
        for v in variants:
            f = rows.get(v, {}).get("failed") or 0
            if f:
                failed.append(f"{p} at {v}: {f} of {rows[v].get('runs', '?')}")
    ax_l.axhline(1.0, color="k", ls="--", lw=0.9, zorder=1)
    handles.append(Line2D([], [], color="k", ls="--", lw=0.9, label="Rand = 1"))
    lat = np.concatenate(lat_vals) if lat_vals else np.array([])
    lat = lat[np.isfinite(lat)]
    if lat.size:
        lo_y, hi_y = min(float(lat.min()), 1.0), max(float(lat.max()), 1.0)
        pad = 0.08 * max(hi_y - lo_y, 0.05)
        ax_l.set_ylim(max(0.0, lo_y - pad), hi_y + pad)
    else:
        ax_l.set_ylim(0.0, 2.0)
        ax_l.text(0.5, 0.5, "no successful runs", transform=ax_l.transAxes, ha="center")
    err = np.concatenate(err_vals) if err_vals else np.array([])
    err = err[np.isfinite(err)]
    if err.size and float(err.max()) > 0:
        ax_e.set_ylim(0.0, 1.15 * float(err.max()))
    else:
        # All zero: a small fixed axis and a note, instead of matplotlib's -0.04..0.04.
        ax_e.set_ylim(0.0, 0.1)
        ax_e.text(
            0.5,
            0.5,
            "no dropped requests in any run" if err.size else "no successful runs",
            transform=ax_e.transAxes,
            ha="center",
            va="center",
            fontsize=9,
            color="0.35",
        )
    rotation = 30 if max((len(str(v)) for v in variants), default=0) > 8 else 0
    for ax, lab in (
        (ax_l, "mean latency / Rand's\n(dot: mean, bar: 10-90% of runs)"),
        (ax_e, "dropped requests (% of requests)\n(bar: mean, line: to the 90th percentile)"),
    ):
        ax.set_xticks(xs, [str(v) for v in variants], rotation=rotation)
        ax.set_xlim(-0.5, len(variants) - 0.5)
        for x in xs[1:] - 0.5:  # between the variants' groups
            ax.axvline(x, color="0.85", lw=0.8, zorder=0)
        ax.set_ylabel(lab, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.legend(handles=handles, loc="outside right center", fontsize=8, frameon=False)
    if failed:
        fig.supxlabel("failed runs (not averaged): " + "; ".join(failed), fontsize=7, color="C3")
    if title:
        fig.suptitle(title)
    return fig


def plot_summary(summary: list[dict], path, title: str = "") -> None:
    """Normalised mean latency and error rate per policy and variant (the rows of
    `dlbfluid._evaluation.experiment.summarise`), two panels, written to `path` (PNG).

    Left: each policy's mean latency divided by Rand's on the same scenario and trial,
    its mean (dot) and 10-90% spread across scenarios x trials (bar), with the reference
    line 1 = Rand. Right: the percentage of requests dropped (mean, with a line to the
    90th percentile); an all-zero panel says so on a fixed $[0, 0.1]\\%$ axis. The legend
    sits outside the panels; failed runs (which are not averaged) are listed below them.
    """
    fig = summary_figure(summary, title)
    fig.savefig(path, dpi=_DPI)
