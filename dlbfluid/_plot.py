"""Plots of simulated trajectories (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def plot_trajectories(solutions, path: str | Path, *, title: str = "") -> Path:
    """Workloads $N_j(t)$ and the share of traffic arriving at each cell (the routed flow
    $z_j = \\sum_i\\lambda_i x_{ij}$ averaged over each save interval) of one or more unbatched
    `Solution`s, one column per policy, written to `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sols = list(solutions) if isinstance(solutions, (list, tuple)) else [solutions]
    k = len(sols)
    fig, axes = plt.subplots(2, k, figsize=(3.2 * k + 1, 5.5), squeeze=False, sharex="col")
    for c, sol in enumerate(sols):
        n = int(np.asarray(sol.cell_mask).sum())
        names = list(sol.cell_names) or [f"cell{j}" for j in range(n)]
        t = np.asarray(sol.t)
        N = np.asarray(sol.N)[:, :n]
        ax = axes[0, c]
        for j in range(n):
            ax.plot(t, N[:, j], lw=1.2, label=names[j])
        ax.set_title(sol.policy, fontsize=10)
        if c == 0:
            ax.set_ylabel("workload $N_j$")
        ax = axes[1, c]
        # Share of all traffic arriving at each cell, averaged over each save interval
        # (from the exact cumulative arrivals): readable for bang-bang discrete routing too.
        arr = np.diff(np.asarray(sol.arrivals)[:, :n], axis=0)
        share = arr / np.maximum(arr.sum(axis=1, keepdims=True), 1e-300)
        tm = 0.5 * (t[1:] + t[:-1])
        for j in range(n):
            ax.plot(tm, share[:, j], lw=1.2, label=names[j])
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("time (s)")
        if c == 0:
            ax.set_ylabel("share of arrivals $z_j/\\sum_k z_k$")
    axes[0, -1].legend(fontsize=7, loc="upper right")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
