"""Assumption 2 (theory/model.md): some routing serves the demand strictly within capacity,
checked as a max-flow problem at every breakpoint of the arrival profiles (`check_capacity`);
a minimum cut names the overloaded cells in the `OverloadError`.
"""

from __future__ import annotations

import numpy as np

from .._errors import OverloadError
from .model import Scenario


def _max_flow(cap: np.ndarray, s: int, t: int) -> tuple[float, np.ndarray]:
    """Edmonds-Karp on a small dense graph; returns the flow value and the source side."""
    n = cap.shape[0]
    residual = cap.astype(float).copy()
    total = 0.0
    scale = max(float(cap[np.isfinite(cap)].max(initial=0.0)), 1.0)
    while True:
        parent = -np.ones(n, dtype=int)
        parent[s] = s
        queue = [s]
        while queue and parent[t] < 0:
            u = queue.pop(0)
            for v in (int(w) for w in np.nonzero((residual[u] > 1e-12 * scale) & (parent < 0))[0]):
                parent[v] = u
                queue.append(v)
        if parent[t] < 0:
            break
        v, bottleneck = t, float(np.inf)
        while v != s:
            bottleneck = min(bottleneck, float(residual[parent[v], v]))
            v = int(parent[v])
        v = t
        while v != s:
            residual[parent[v], v] -= bottleneck
            residual[v, parent[v]] += bottleneck
            v = int(parent[v])
        total += bottleneck
    return total, parent >= 0


def _limits(times: np.ndarray, rates: np.ndarray, t: float) -> tuple[float, float]:
    """The rate of one piecewise-linear profile just before and just after `t` (they
    differ at a jump: a time given twice, first with the rate before it)."""
    at = np.nonzero(times == t)[0]
    if at.size:
        return float(rates[at[0]]), float(rates[at[-1]])
    v = float(np.interp(t, times, rates))
    return v, v


def check_capacity(scn: Scenario, *, rel_margin: float = 1e-9) -> None:
    """Raise `OverloadError` unless some routing serves every arrival profile's demand
    strictly within capacity (Assumption 2), at every breakpoint of the profiles.

    Max-flow from the origins (capacity $\\lambda_i$) over allowed arcs to the cells
    (capacity $\\bar\\mu_j(1-\\epsilon)$, $\\epsilon$ = `rel_margin`); a minimum cut names
    the overloaded cells. The demand is piecewise linear between the breakpoints of all
    profiles and the feasible demands are a convex set, so checking the rates just before
    and just after every breakpoint checks every time. Rates are scaled by the largest
    arrival rate first (and capacities capped at the total demand, which no cut can
    exceed), so the test's tolerances are relative to the demand whatever the capacities:
    a capacity of 1e20 next to an arrival rate of 1 is feasible. Zero demand is feasible.
    """
    _check_capacity(scn, rel_margin=rel_margin)


def _check_capacity(scn: Scenario, *, rel_margin: float = 1e-9, remedy: str | None = None):
    """`check_capacity` whose message ends with `remedy` (what the caller can do instead;
    default: the Python API's `allow_overload=True`)."""
    if remedy is None:
        remedy = (
            "or pass allow_overload=True (scenario_from_dict, load_scenario) to simulate "
            "overload on purpose."
        )
    mask = np.asarray(scn.cell_mask)
    n = int(mask.sum())
    names = list(scn.cell_names) or [f"cell{j}" for j in range(n)]
    allowed = np.asarray(scn.allowed)[:n, :n]
    mubar = np.asarray(scn.service.capacity, dtype=float)[:n]
    at = np.asarray(scn.arrival_times, dtype=float)[:n]
    ar = np.asarray(scn.arrival_rates, dtype=float)[:n]
    times = np.unique(at.ravel())
    for t in times:
        sides = np.array([_limits(at[i], ar[i], t) for i in range(n)]).T  # (before, after)
        for lam in sides if not np.array_equal(sides[0], sides[1]) else sides[:1]:
            _check_cut(lam, mubar, allowed, names, rel_margin, t, len(times) > 1, remedy)


def _check_cut(lam, mubar, allowed, names, rel_margin, t, timed, remedy) -> None:
    """Assumption 2 for one demand vector `lam` (see `check_capacity`)."""
    n = lam.shape[0]
    top = float(lam.max(initial=0.0))
    if not top > 0:
        return  # no demand: every routing serves it
    # In units of the largest rate; a cell's capacity beyond the whole demand cannot bind.
    lam_u = lam / top
    demand = float(lam_u.sum())
    served = np.minimum(mubar * (1.0 - rel_margin) / top, 2.0 * demand)
    V = 2 * n + 2
    s, sink = 0, 2 * n + 1
    cap = np.zeros((V, V))
    cap[s, 1 : n + 1] = lam_u
    cap[1 : n + 1, n + 1 : 2 * n + 1] = np.where(allowed, 2.0 * demand + 1.0, 0.0)
    cap[n + 1 : 2 * n + 1, sink] = served
    flow, source_side = _max_flow(cap, s, sink)
    if flow >= demand * (1.0 - 1e-12):
        return
    # Min cut: origins still reachable from s whose reachable cells are saturated.
    origins = [i for i in range(n) if source_side[1 + i] and lam[i] > 0]
    cells = [j for j in range(n) if source_side[n + 1 + j]]
    if not origins:  # (a shortfall within the tolerances: report the whole network)
        origins = [i for i in range(n) if lam[i] > 0]
        cells = sorted({int(j) for i in origins for j in np.nonzero(allowed[i])[0]})
    cut_demand = float(lam[origins].sum())
    cut_cap = float(mubar[cells].sum())
    when = f" at t = {t:g} s" if timed else ""
    raise OverloadError(
        "demand exceeds what any routing can serve within capacity (Assumption 2)"
        f"{when}: origins {[names[i] for i in origins]} with total arrival rate "
        f"{cut_demand:.6g} can only reach cells {[names[j] for j in cells]} with total "
        f"capacity {cut_cap:.6g} (every cell must stay strictly below its capacity). "
        f"Lower the arrival rates, raise capacities or allow more arcs; {remedy}",
        cells=[names[j] for j in cells],
        sources=[names[i] for i in origins],
        demand=cut_demand,
        capacity=cut_cap,
    )
