"""Theorem 1's $T^{-1/2}$ schedule, run where the theorem covers it (theory/lyapunov.md,
*The schedule*).

With a fixed step $\\eta \\le \\eta_0$ the bound is $A/(T\\eta) + G_1\\eta + C/T$; the step
$\\eta(T) = cT^{-1/2}$ turns it into

$$\\frac1T\\int_0^T\\Big[\\sum_jD_j + 2\\sum_i\\lambda_iS_i\\Big] \\le
\\Big(\\frac Ac + G_1c\\Big)T^{-1/2} + \\frac CT,$$

whose $T^{-1/2}$ coefficient is smallest at $c^* = \\sqrt{A/G_1}$. The theorem covers the
schedule only where its step is inside the hypothesis, $cT^{-1/2} \\le \\eta_0$, that is
$T \\ge T_0 = (c/\\eta_0)^2$. `theorem1_schedule` runs one batch of runs at the horizons
$T_0r^k$ ($k = 0..$`rungs`$-1$), run $k$ at $\\eta_k = cT_k^{-1/2}$ and saved at every
tick, checks each with `Theorem1Check` (the bound at every saved horizon, every estimate)
and reads its time average at its own horizon $T_k$.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._costs import cost_from_name
from .._policies import policy_from_name
from .._simulate import simulate
from .._validate import integer, invalid, number
from .check import batch_theorem1_check, batch_time_average
from .constants import batch_start_terms, batch_theorem1_constants


class Theorem1Schedule(eqx.Module):
    """The schedule's settings.

    **Fields:**
    - `rungs`: horizons $T_0, T_0r, \\dots, T_0r^{\\text{rungs}-1}$ (at least 2).
    - `ratio`: $r > 1$.
    - `c_scale`: $s$ in $c = s\\sqrt{A/G_1}$ (1: the $c$ that minimises the bound's
      $T^{-1/2}$ coefficient). Where $A = 0$ (a start on $x^*$),
      $c = \\eta_0\\sqrt{T_{\\min}}$.
    - `min_horizon`: $T_0 = \\max(T_{\\min}, (c/\\eta_0)^2)$; a `c_scale` above 1 with a
      `min_horizon` below $(c/\\eta_0)^2$ still starts at $(c/\\eta_0)^2$: the schedule is
      only run inside the hypothesis.
    - `tick`: the routers' tick (every run is saved at every tick).
    - `max_ticks`: the longest run allowed ($T_0r^{\\text{rungs}-1}/h$); a schedule that
      needs more is refused before any run (raise it, or the tick).
    """

    rungs: int = 4
    ratio: float = 2.0
    c_scale: float = 1.0
    min_horizon: float = 0.0
    tick: float = 0.05
    max_ticks: int = 400_000

    def __check_init__(self):
        integer("rungs", self.rungs, 2)
        for name, lo in (("ratio", 1), ("c_scale", 0), ("tick", 0)):
            number(name, getattr(self, name), lo=lo, lo_open=True)
        number("min_horizon", self.min_horizon, lo=0)
        integer("max_ticks", self.max_ticks, 1, whole_floats=True)


class Theorem1ScheduleResult(eqx.Module):
    """One scenario's schedule (host arrays over the rungs).

    **Fields:** `c`; `horizons` $T_k$; `eta` $\\eta_k = cT_k^{-1/2}$; `eta0`;
    `in_hypothesis` ($\\eta_k \\le \\eta_0$, true on every rung by construction);
    `measured` the time average at $T_k$ of run $k$; `bound` its bound there,
    $(A/c + G_1c)T_k^{-1/2} + C/T_k$ with run $k$'s own start terms;
    `worst_ratio` the largest measured / bound of run $k$ (at its fixed step $\\eta_k$)
    over every saved horizon up to the longest (the bound holds at every horizon for a
    fixed step inside the hypothesis, so this is stricter than $T_k$ alone); `estimates_hold` whether every estimate held on run $k$; `holds`: every rung's
    `worst_ratio` <= 1 and every estimate held; `bound_slope`, `measured_slope`: the
    log-log slopes over the rungs (the bound's lies in $[-1, -1/2]$; the measured one is
    descriptive).
    """

    c: float
    horizons: np.ndarray
    eta: np.ndarray
    eta0: float
    in_hypothesis: np.ndarray
    measured: np.ndarray
    bound: np.ndarray
    worst_ratio: np.ndarray
    estimates_hold: np.ndarray
    holds: bool
    bound_slope: float
    measured_slope: float | None

    def record(self) -> dict:
        """A JSON-ready record."""
        lst = lambda a: [float(v) for v in np.asarray(a)]  # noqa: E731
        return {
            "c": self.c,
            "eta0": self.eta0,
            "horizons": lst(self.horizons),
            "eta": lst(self.eta),
            "in_hypothesis": [bool(v) for v in self.in_hypothesis],
            "measured": lst(self.measured),
            "bound": lst(self.bound),
            "worst_ratio": lst(self.worst_ratio),
            "estimates_hold": [bool(v) for v in self.estimates_hold],
            "holds": self.holds,
            "bound_slope": self.bound_slope,
            "measured_slope": self.measured_slope,
        }


def _slope(T, y) -> float | None:
    ok = np.asarray(y) > 0
    if ok.sum() < 2:
        return None
    return float(np.polyfit(np.log(np.asarray(T)[ok]), np.log(np.asarray(y)[ok]), 1)[0])


def theorem1_schedule(
    scenario, equilibrium, *, cost, schedule: Theorem1Schedule = Theorem1Schedule(), constants=None
) -> Theorem1ScheduleResult:
    """Run Theorem 1's $T^{-1/2}$ schedule on one scenario where its steps stay below
    $\\eta_0$ (module docstring).

    **Arguments:** a `Scenario` (constant arrival rates; its `initial_workload` and
    `initial_routing` are the start of every run), the equilibrium (`N`, `x`) of the flow
    cost `cost` (`"rif"`, `"latency"` or `"gradient"`), the `Theorem1Schedule`, and optionally
    `Theorem1Constants` to use instead of the computed ones (a negative control).

    **Returns:** a `Theorem1ScheduleResult`.

    **Raises:** `ValueError` when the constants were not found ($\\eta_0$ undefined) or the
    schedule needs more than `schedule.max_ticks` ticks.
    """
    cost_ = cost_from_name(cost)
    policy = policy_from_name("flow-" + cost_.short)
    n = scenario.n_cells
    add = lambda a: jnp.asarray(a)[None]  # noqa: E731
    scn = jax.tree_util.tree_map(add, scenario.strip())
    Ns = add(jnp.asarray(equilibrium.N)[..., :n])
    xs = add(jnp.asarray(equilibrium.x)[..., :n, :n])
    consts = (batch_theorem1_constants(cost_, scn, Ns, xs) if constants is None
              else jax.tree_util.tree_map(add, constants))  # fmt: skip
    eta0, G1 = float(consts.eta0[0]), float(consts.G1[0])
    if not (bool(consts.ok[0]) and math.isfinite(eta0) and eta0 > 0):
        raise ValueError(
            f"eta0 = {eta0!r}: Theorem 1's constants were not found for this scenario "
            "(no threshold N_bar in range, or no delay); the schedule needs a finite eta0 > 0"
        )
    N0 = add(jnp.asarray(scenario.initial_workload)[:n])
    x0 = add(jnp.asarray(scenario.initial_routing)[:n, :n])
    probe = batch_start_terms(cost_, consts, scn, Ns, xs, N0, x0, add(jnp.full(n, eta0)))
    A = float(probe.A[0])
    h = float(schedule.tick)
    c = schedule.c_scale * math.sqrt(A / G1) if A > 0 else eta0 * math.sqrt(
        max(schedule.min_horizon, h))  # fmt: skip
    T0 = max(schedule.min_horizon, (c / eta0) ** 2, h)
    T0 = math.ceil(T0 / h - 1e-9) * h  # whole ticks, so that eta(T0) <= eta0 still
    Ts = T0 * schedule.ratio ** np.arange(schedule.rungs)
    Ks = np.rint(Ts / h).astype(int)
    if Ks[-1] > schedule.max_ticks:
        raise invalid("max_ticks", schedule.max_ticks,
                   f"the schedule's longest run needs {Ks[-1]} ticks (T = {Ks[-1] * h:g} s at "
                   f"tick {h:g} s, from T0 = (c/eta0)^2 = {(c / eta0) ** 2:.4g} s); raise "
                   "max_ticks or the tick, or lower rungs or ratio")  # fmt: skip
    Ts = Ks * h
    eta = np.minimum(c / np.sqrt(Ts), eta0)  # (R,); the min only absorbs rounding
    R, K = len(Ts), int(Ks[-1])

    def rep(tree):
        return jax.tree_util.tree_map(lambda a: jnp.repeat(a, R, axis=0), tree)

    steps = jnp.broadcast_to(jnp.asarray(eta)[:, None], (R, n))
    batch = jax.tree_util.tree_map(lambda a: jnp.repeat(jnp.asarray(a)[None], R, axis=0),
                                   scenario)  # fmt: skip
    sol = simulate(batch, policy, step_size=steps, tick=h, horizon=K * h, n_save=K)
    cs, sc, Nr, xr = rep(consts), rep(scn), rep(Ns), rep(xs)
    terms = batch_start_terms(cost_, cs, sc, Nr, xr, sol.N[:, 0], sol.x[:, 0], steps)
    # Every run is integrated to the longest horizon (one compiled program) and checked
    # there (the bound holds at every horizon for a fixed step in the hypothesis); run k's
    # schedule point is its time average at its own horizon T_k.
    chk = batch_theorem1_check(cost_, cs, terms, sc, Nr, xr, steps, jnp.full(R, h), sol.t,
                               sol.N, sol.x)  # fmt: skip
    series = np.asarray(batch_time_average(cost_, sc, Nr, xr, sol.t, sol.N, sol.x))
    t = np.asarray(sol.t)
    tk = np.where(t > 0, t, 1.0)
    every = np.asarray(terms.bound(cs, jnp.asarray(tk)))  # (R, K+1)
    measured = series[np.arange(R), Ks]
    bound = every[np.arange(R), Ks]
    worst = np.asarray(chk.worst_ratio)  # over every saved horizon up to the longest
    est = np.all(np.asarray(chk.estimate_holds), axis=-1)
    in_hyp = np.asarray(terms.in_hypothesis)
    return Theorem1ScheduleResult(
        c=float(c),
        horizons=Ts,
        eta=eta,
        eta0=eta0,
        in_hypothesis=in_hyp,
        measured=measured,
        bound=bound,
        worst_ratio=worst,
        estimates_hold=est,
        holds=bool(np.all(worst <= 1.0) and np.all(est) and np.all(in_hyp)),
        bound_slope=float(_slope(Ts, bound)),  # type: ignore[arg-type]
        measured_slope=_slope(Ts, measured),
    )
