"""The descriptive fit of Theorem 1's shape on a ladder of runs (theory/lyapunov.md,
*A descriptive fit*).

Time-average distances at several horizons and step sizes are fitted to
$A/(T\\eta) + B\\eta + C/T$ with $A, B, C \\ge 0$ (`fit_bound`), beside the slope of the
$\\eta = cT^{-1/2}$ schedule (`schedule_slope`), the growth of the fitted $B$ with the
delays (`growth_exponent`) and the largest step on a ladder at which the distance still
falls (`empirical_eta0`). These describe the data: an upper bound's constants cannot be
recovered by regression from trajectories that lie below it, so nothing here is Theorem
1's verdict. The theorem's own constants and its verdict are `dlbfluid._theorem1.constants`
and `dlbfluid._theorem1.check`.
"""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._costs import cost_from_name
from .._policies import policy_from_name
from .._simulate import simulate
from .._stability import scale_delays
from .lyapunov import _cumtrapz, fit_theorem1, loglog_slope, workload_gap

# A ladder point lies under the fitted bound when distance <= (1 + BOUND_TOLERANCE) bound.
BOUND_TOLERANCE = 0.25
# The delay term matters at a schedule point when B eta >= DELAY_SHARE x the bound.
DELAY_SHARE = 0.1
# The distance "still falls" when its mean over [T/2, T] is below this fraction of its
# mean over [T/4, T/2] (`window_ratio`; about 1 on a limit cycle, above 1 when it grows).
FALLING = 0.9


# ----------------------------------------------------------------------------------------
# The bound's constants
# ----------------------------------------------------------------------------------------


def bound(fit: dict, T, eta):
    """$A/(T\\eta) + B\\eta + C/T$ with the constants of `fit`."""
    T, eta = np.asarray(T, float), np.asarray(eta, float)
    return fit["A"] / (T * eta) + fit["B"] * eta + fit["C"] / T


def fit_bound(T, eta, distance, *, tolerance: float = BOUND_TOLERANCE) -> dict:
    """Fit the time-average distances of a ladder to $A/(T\\eta) + B\\eta + C/T$ with
    $A, B, C \\ge 0$ (relative non-negative least squares, `fit_theorem1(nonneg=True)`).

    **Returns:** `dict(A, B, C, fit_rel_rms, max_ratio, holds)`: `fit_rel_rms` the rms of
    the relative residuals, `max_ratio` the largest distance / bound, `holds` whether every
    point lies under the bound within `tolerance` (`max_ratio <= 1 + tolerance`). Points
    with a zero or non-finite distance are left out; fewer than three leave every value
    `None`.
    """
    T, eta, y = (np.asarray(v, float).ravel() for v in (T, eta, distance))
    ok = np.isfinite(T) & np.isfinite(eta) & np.isfinite(y) & (y > 0) & (eta > 0) & (T > 0)
    if ok.sum() < 3:
        return {k: None for k in ("A", "B", "C", "fit_rel_rms", "max_ratio", "holds")}
    fit = fit_theorem1(T[ok], eta[ok], y[ok], nonneg=True)
    ratio = y[ok] / np.maximum(bound(fit, T[ok], eta[ok]), 1e-300)
    return {
        "A": fit["A"],
        "B": fit["B"],
        "C": fit["C"],
        "fit_rel_rms": fit["rel_rmse"],
        "max_ratio": float(ratio.max()),
        "holds": bool(ratio.max() <= 1.0 + tolerance),
    }


def delay_share(fit: dict, T, eta) -> np.ndarray:
    """$B\\eta$ / bound at each point: the delay term's share of the bound."""
    b = bound(fit, T, eta)
    return np.where(b > 0, fit["B"] * np.asarray(eta, float) / np.where(b > 0, b, 1.0), 0.0)


def schedule_constant(fit: dict, share: float, cap: float) -> float:
    """$c$ of the schedule $\\eta = cT^{-1/2}$: along it the delay term's share of the bound
    $B\\eta/(A/(T\\eta) + B\\eta)$ is $Bc^2/(A + Bc^2)$, constant, and equal to `share` for
    $c^2 = \\frac{\\text{share}}{1 - \\text{share}}\\frac AB$; at most `cap`. `cap` when the fit
    resolves only one of the two terms ($A = 0$ or $B = 0$): with $A = 0$ the formula would
    give $c = 0$, a schedule that never moves."""
    A, B = fit["A"], fit["B"]
    if not (A > 0 and B > 0):
        return float(cap)
    return float(min(math.sqrt(share / (1 - share) * A / B), cap))


def schedule_slope(T, distance) -> float | None:
    """Log-log slope of the time-average distance along $\\eta = cT^{-1/2}$ (theorem: $-1/2$);
    `None` with fewer than two positive finite points."""
    T, y = np.asarray(T, float), np.asarray(distance, float)
    ok = np.isfinite(y) & (y > 0)
    return loglog_slope(T[ok], y[ok]) if ok.sum() >= 2 else None


def growth_exponent(scales, B) -> float | None:
    """Log-log slope of the fitted $B$ against the delay scale (the growth of $G_1(\\tau)$);
    `None` unless at least two scales have $B > 0$."""
    s = np.asarray(scales, float)
    b = np.asarray([np.nan if v is None else v for v in B], float)
    ok = np.isfinite(b) & (b > 0)
    return loglog_slope(s[ok], b[ok]) if ok.sum() >= 2 else None


def window_ratio(horizons, tad) -> np.ndarray:
    """Mean of $\\sum_jD_j$ over $[T_{-2}, T_{-1}]$ divided by its mean over
    $[T_{-3}, T_{-2}]$, from time-average distances `tad` (last axis) at increasing
    `horizons` $(\\dots, T_{-3}, T_{-2}, T_{-1})$: below 1 when the distance still falls,
    about 1 on a limit cycle, above 1 when it grows. Windows, not averages from 0, so that
    the initial transient does not make an unstable run look as if it fell."""
    H = np.asarray(horizons, float)
    I = np.asarray(tad, float) * H  # integral of D from 0
    late = (I[..., -1] - I[..., -2]) / (H[-1] - H[-2])
    early = (I[..., -2] - I[..., -3]) / (H[-2] - H[-3])
    return late / np.where(early > 0, early, np.nan)


def empirical_eta0(etas, ratio, *, falling: float = FALLING) -> float | None:
    """The largest step size of an increasing ladder `etas` up to which the distance
    still falls (`window_ratio` below `falling`) at that rung and every rung below it;
    `None` when it does not fall even at the lowest rung."""
    etas = np.asarray(etas, float)
    ok = np.asarray(ratio, float) < falling  # (nan: no distance left, counts as not falling)
    if not ok[0]:
        return None
    bad = np.nonzero(~ok)[0]
    return float(etas[-1] if bad.size == 0 else etas[bad[0] - 1])


# ----------------------------------------------------------------------------------------
# The ladder of runs (one batch per policy and chunk)
# ----------------------------------------------------------------------------------------


class Ladder(eqx.Module):
    """The runs of `theorem1_ladder`, relative to each scenario's $\\eta^*$ and horizon $T$.

    **Fields:**
    - `fractions`: the fixed steps of the bound fit, as fractions of
      $\\eta^*_{ref} = \\min_s\\eta^*(s)$ over the delay scales $s$ (so every scale runs the
      same steps, all below its own $\\eta^*$); each run is read at the horizons
      `horizons` $\\times T$.
    - `horizons`: increasing fractions of $T$, ending at 1.
    - `eta0_ratio`, `eta0_rungs`: the $\\eta_0$ ladder $\\eta^*\\,$`eta0_ratio`$^k$ (ratio
      at most 1.2), each run's `window_ratio` over the last three horizons.
    - `schedule_share`: the delay term's target share $B\\eta/\\text{bound}$ along the
      schedule $\\eta = cT^{-1/2}$; with the fitted $A$, $B$ it fixes
      $c^2 = \\frac{\\text{share}}{1 - \\text{share}}\\frac AB$ (capped so that the schedule's
      largest step is `schedule_cap` $\\eta^*$; $c$ = `schedule_cap` $\\times\\,\\eta^*T_0^{1/2}$
      when $A = 0$ or $B = 0$: `schedule_constant`).
    - `tau_scales`: delay scales at which the bound is refitted (1 = the scenario); each
      scaled scenario gets its own equilibrium.
    """

    fractions: tuple[float, ...] = (0.05, 0.1, 0.2, 0.4, 0.7)
    horizons: tuple[float, ...] = (0.125, 0.25, 0.5, 1.0)
    eta0_ratio: float = 1.15
    eta0_rungs: tuple[int, ...] = (-4, -3, -2, -1, 0, 1, 2, 3)
    schedule_share: float = 0.25
    schedule_cap: float = 0.7
    tau_scales: tuple[float, ...] = (1.0, 2.0, 4.0)

    def __check_init__(self):
        if not 1.0 < self.eta0_ratio <= 1.2:
            raise ValueError(
                f"eta0_ratio = {self.eta0_ratio!r} is invalid: expected a ratio in (1, 1.2]"
            )
        if list(self.horizons) != sorted(self.horizons) or self.horizons[-1] != 1.0:
            raise ValueError(
                f"horizons = {self.horizons!r} is invalid: expected increasing fractions of "
                "the horizon ending at 1"
            )
        if 1.0 not in self.tau_scales or any(not (s > 0) for s in self.tau_scales):
            raise ValueError(
                f"tau_scales = {self.tau_scales!r} is invalid: expected scales > 0 including 1"
            )
        if not 0.0 < self.schedule_share < 1.0:
            raise ValueError(
                f"schedule_share = {self.schedule_share!r} is invalid: expected a share in (0, 1)"
            )

    def eta0_ladder(self) -> np.ndarray:
        return self.eta0_ratio ** np.asarray(self.eta0_rungs, float)

    def config(self) -> dict:
        """The settings as JSON (for a manifest)."""
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
                for f in dataclasses.fields(self)}  # fmt: skip


def ladder_start(batch, cost, equilibrium):
    """The batch started at $N(0) = N^*$ and $x_i(0) = (x_i^* + e_{w(i)})/2$, halfway from
    the equilibrium routing to the vertex of router $i$'s costliest allowed arc
    $w(i) = \\arg\\max_j c^*_{ij}$: a start whose routing part $R(0)$ carries the bound and
    that is never the equilibrium itself (unless the router has a single arc)."""
    cost = cost_from_name(cost)
    N = jnp.asarray(equilibrium.N)
    x = jnp.asarray(equilibrium.x)
    scn = batch.strip()
    c = jax.vmap(lambda s, N: cost.destination(s, N)[None, :] + cost.arc(s))(scn, N)
    c = jnp.where(batch.allowed, c, -jnp.inf)
    worst = jax.nn.one_hot(jnp.argmax(c, axis=-1), c.shape[-1], dtype=x.dtype)
    x0 = jnp.where(batch.allowed, 0.5 * (x + worst), 0.0)
    x0 = x0 / jnp.maximum(jnp.sum(x0, axis=-1, keepdims=True), 1e-300)
    x0 = jnp.where(jnp.any(batch.allowed, axis=-1, keepdims=True), x0, batch.initial_routing)
    return dataclasses.replace(batch, initial_workload=N, initial_routing=x0)


def _runs(starts, equilibria, cost, policy, table, horizon, tick, hidx):
    """Simulate the run `table` (`(scenario index, delay scale, step)`) as one batch from
    the `starts` (`{scale: batch}`); time-average distances at the save indices `hidx`
    (ticks), `(len(table), len(hidx))` (`nan` for failed runs or missing steps)."""
    if not table:
        return np.zeros((0, len(hidx)))
    bs = np.asarray([b for b, _, _ in table])
    sc = [s for _, s, _ in table]
    big = jax.tree_util.tree_map(
        lambda *a: jnp.stack(a),
        *[jax.tree_util.tree_map(lambda v, b=b: v[b], starts[s]) for b, s in zip(bs, sc)],
    )
    eqN = jnp.stack([jnp.asarray(equilibria[s].N)[b] for b, s in zip(bs, sc)])
    eta = np.asarray([e for _, _, e in table], float)
    valid = np.isfinite(eta) & (eta > 0)
    K = int(round(horizon / tick))
    # Saves every `stride` <= 10 ticks (the trapezoid rule on them resolves D's
    # transients), the ladder's horizons among them.
    stride = math.gcd(10, *[int(v) for v in hidx])
    sol = simulate(
        big,
        policy,
        step_size=np.where(valid, eta, 1e-3)[:, None],
        tick=tick,
        horizon=horizon,
        n_save=K // stride,
        throw=False,
    )
    tad = np.asarray(
        _time_average(cost, big.strip(), eqN, sol.t, sol.N, np.asarray(hidx) // stride)
    )
    ok = (np.asarray(sol.status) == 0) & valid
    return np.where(ok[:, None], tad, np.nan)


def _after_peak(tad):
    """Time-average distances from each run's largest one on (`nan` before it): before
    that the trajectory is still in its initial transient (from $N(0) = N^*$ the distance
    first grows), where the bound is far from tight and its $1/T$ terms are not yet the
    shape of the data."""
    tad = np.asarray(tad, float)
    peak = np.argmax(np.where(np.isfinite(tad), tad, -np.inf), axis=-1)
    j = np.arange(tad.shape[-1])
    return np.where(j[None, :] >= peak[:, None], tad, np.nan)


def _describe(rec: dict, b, table, kinds, tad, Hs, scales, e1, ladder: Ladder, keep_points):
    """Fill scenario `b`'s record from its ladder runs (`empirical_eta0`, the fits per delay
    scale, the growth exponent, the points); returns the schedule's $c$, or `None` when
    there is no schedule to run ($\\eta^*$ unavailable, or no fit)."""
    if not math.isfinite(e1):
        return None
    mine = [k for k, (bb, _, _) in enumerate(table) if bb == b]
    e0 = [k for k in mine if kinds[k] == "eta0"]
    eta0 = empirical_eta0([table[k][2] for k in e0], window_ratio(Hs, tad[e0]))
    rec["empirical_eta0"] = eta0
    rec["empirical_eta0_over_eta_star"] = None if eta0 is None else eta0 / e1
    Bs: dict = {}
    for s in scales:
        use = [k for k in mine if kinds[k] == "fixed" and table[k][1] == s]
        if s == 1.0 and eta0 is not None:
            use += [k for k in e0 if table[k][2] <= eta0 * (1 + 1e-12)]
        T = np.repeat(Hs[None], len(use), axis=0)
        eta = np.repeat(np.asarray([table[k][2] for k in use])[:, None], len(Hs), axis=1)
        fit = fit_bound(T, eta, _after_peak(tad[use]))
        Bs[s] = fit["B"]
        if s == 1.0:
            if fit["A"] is not None:
                fit["delay_share"] = float(np.max(delay_share(fit, T, eta)))
            rec["bound"] = fit
    rec["g1_by_tau_scale"] = {str(s): Bs[s] for s in scales}
    rec["g1_growth_exponent"] = growth_exponent(scales, [Bs[s] for s in scales])
    if keep_points:
        rec["points"] = [
            {"kind": kinds[k], "tau_scale": table[k][1], "eta": table[k][2],
             "T": Hs.tolist(), "distance": tad[k].tolist()}
            for k in mine
        ]  # fmt: skip
    fit = rec["bound"]
    if fit["A"] is None:
        return None
    # eta(T0) = c T0^(-1/2) at most schedule_cap eta*.
    cap = ladder.schedule_cap * e1 * math.sqrt(Hs[0])
    c = schedule_constant(fit, ladder.schedule_share, cap)
    rec["schedule_c"] = c
    return c


def theorem1_ladder(
    scenario,
    policy: str,
    equilibria,
    eta_star,
    *,
    horizon: float,
    tick: float,
    ladder: Ladder = Ladder(),
    n_real: int | None = None,
    keep_points: bool = False,
) -> list[dict]:
    """The Theorem-1 ladder of a batch of scenarios under one flow policy.

    For scenario $b$ (theory/lyapunov.md, *Theorem 1, checked*): runs started by
    `ladder_start` at the fixed steps and the $\\eta_0$ rungs of `ladder`, all stacked into
    one `simulate` call; their time-average distances $\\frac1T\\int_0^T\\sum_jD_j$ at the
    ladder's horizons; `empirical_eta0`; `fit_bound` per delay scale on the fixed steps
    (at scale 1 also the stable rungs, up to $\\eta_0$), and `growth_exponent` of the
    fitted $B$; then a second batch, the schedule $\\eta = cT^{-1/2}$ with $c$ from the
    fit (`Ladder.schedule_share`), and its `schedule_slope`.

    **Arguments:**
    - `scenario`: a batch (`stack_scenarios`); `n_real`: how many leading entries are
      real (the rest padding, skipped in the output).
    - `policy`: a flow policy name.
    - `equilibria`: `{scale: equilibrium}` of the policy's cost for every `tau_scales`
      entry (scale 1: that of `scenario`); `eta_star`: `{scale: (B,) array}`.
    - `horizon`, `tick`: $T$ and $h$ of every run.

    **Returns:** one dict per real scenario: `bound` (`fit_bound`, plus `delay_share`, the
    largest $B\\eta$/bound over its points), `schedule_slope`, `schedule_delay_share` (the
    smallest $B\\eta$/bound along the schedule), `schedule_c`, `g1_growth_exponent`,
    `g1_by_tau_scale` (`{scale: B}`), `empirical_eta0`, `empirical_eta0_over_eta_star`; with
    `keep_points`, also `points`: every run's `kind`, `tau_scale`, `eta` and its `distance`
    at the horizons `T`.
    """
    cost = policy_from_name(policy).cost
    Bn = scenario.batch_shape[0]
    n_real = Bn if n_real is None else n_real
    Hs = np.asarray(ladder.horizons) * horizon
    hidx = np.rint(Hs / tick).astype(int)
    if np.any(hidx < 1):
        raise ValueError(f"horizon = {horizon} is too short for the ladder's horizons {Hs}")
    scales = sorted(ladder.tau_scales)
    starts = {
        s: ladder_start(scale_delays(scenario, s) if s != 1.0 else scenario, cost, equilibria[s])
        for s in scales
    }
    es = {s: np.asarray(eta_star[s], float) for s in scales}
    es = {s: np.where(np.isfinite(v) & (v > 0), v, np.nan) for s, v in es.items()}
    ref = np.min(np.stack([es[s] for s in scales]), axis=0)
    table, kinds = [], []
    for b in range(n_real):
        for s in scales:
            for f in ladder.fractions:
                table.append((b, s, f * ref[b]))
                kinds.append("fixed")
        for q in ladder.eta0_ladder():
            table.append((b, 1.0, q * es[1.0][b]))
            kinds.append("eta0")
    tad = _runs(starts, equilibria, cost, policy, table, horizon, tick, hidx)
    results: list[dict] = []
    sched_table: list[tuple[int, float, float]] = []
    sched_of: dict[int, list[int]] = {}
    for b in range(n_real):
        e1 = es[1.0][b]
        rec: dict = {
            "bound": None,
            "schedule_slope": None,
            "schedule_delay_share": None,
            "schedule_c": None,
            "g1_growth_exponent": None,
            "g1_by_tau_scale": {},
            "empirical_eta0": None,
            "empirical_eta0_over_eta_star": None,
        }
        results.append(rec)
        c = _describe(rec, b, table, kinds, tad, Hs, scales, e1, ladder, keep_points)
        if c is None:
            continue
        sched_of[b] = []
        for j in range(len(Hs)):
            sched_of[b].append(len(sched_table))
            sched_table.append((b, 1.0, c / math.sqrt(Hs[j])))
    sched = _runs(starts, equilibria, cost, policy, sched_table, horizon, tick, hidx)
    for b, rows in sched_of.items():
        rec = results[b]
        y = np.asarray([sched[k, j] for j, k in enumerate(rows)])
        eta = np.asarray([sched_table[k][2] for k in rows])
        rec["schedule_slope"] = schedule_slope(Hs, y)
        rec["schedule_delay_share"] = float(np.min(delay_share(rec["bound"], Hs, eta)))
        if keep_points:
            rec["points"] += [
                {"kind": "schedule", "tau_scale": 1.0, "eta": float(eta[j]),
                 "T": Hs.tolist(), "distance": sched[k].tolist()}
                for j, k in enumerate(rows)
            ]  # fmt: skip
    return results


@eqx.filter_jit
def _time_average(cost, scn, N_star, t, N, idx):
    """$\\frac1{t_k}\\int_0^{t_k}\\sum_jD_j$ at the save indices `idx`, batched."""
    cost = cost_from_name(cost)

    def one(s, Ns, t, N):
        gap = jnp.sum(workload_gap(cost, s, N, Ns[None]), axis=-1)
        cum = _cumtrapz(gap, t)
        return cum[idx] / t[idx]

    return jax.vmap(one)(scn, N_star, t, N)
