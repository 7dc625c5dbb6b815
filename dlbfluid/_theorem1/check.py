"""Theorem 1 checked along trajectories: the bound at every saved horizon, and each
estimate of its proof, measured against its bound (theory/lyapunov.md, *Checking the
chain*).

Along a flow-routing run saved at every tick ($x^k$ in force on $[t_k, t_{k+1})$, computed
from the observation $\\hat c^k_{ij} = f_j(N_j(t_k - \\tau_{ij})) + g_{ij}$):

| estimate | measured | bound |
|---|---|---|
| `routing_speed` (Lemma 10) | $\\max_{k,i}\\|x_i^k - x_i^{k-1}\\|_\\infty/(2\\eta_ih\\|\\hat c_i^k\\|_\\infty)$ | 1 |
| `workload_lipschitz` (the $2v\\bar\\tau$ window) | $\\max_{k,j}|N_j^{k+1} - N_j^k|/h$ | $v$ |
| `mixed_delay` (C.3.1) | $\\int_0^T\\sum_i\\lambda_i(S_i - S_i^\\tau)$ | $K_1$ |
| `cost_envelope` (Lemma 6) | $\\max_{k,i}\\|\\hat c_i^k\\|_\\infty/(\\bar F_i + \\sum_j\\frac2{\\Delta\\mu_j}D_j(N_j(t_k - \\tau_{ij})))$ | 1 |
| `tail_increment` (Lemma 7) | $\\max|e_j(N) - e_j(N')|\\,8\\Lambda_j/(D_j(N) + D_j(N'))$, $N = N_j(t_k)$, $N' = N_j(t_k - \\tau_{ij})$ | 1 |
| `bounded_part` (Lemma 8 with Lemma 6) | $\\int_0^T\\sum\\lambda_i\\Gamma^b_{ij}$ | $4\\bar\\eta\\sum\\lambda_iW_{ij}[T\\bar F_i + \\sum_k\\frac2{\\Delta\\mu_k}\\int_{-\\bar\\tau}^TD_k] + K_b$ |
| `tail` (Lemma 9) | $\\int_0^T\\sum\\lambda_i\\Gamma^e_{ij}$ | $\\frac14\\int_0^T\\sum_jD_j + K_H + \\Phi(N(T)) + K_4$ |

Every estimate holds for every step size (none needs $\\bar\\eta \\le \\eta_0$), so each is a
verdict on any run; the bound itself is a verdict only inside the hypothesis
$\\bar\\eta \\le \\eta_0$ and a reference outside it.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from .._costs import cost_from_name
from .constants import (
    StartTerms,
    Theorem1Constants,
    _Data,
    _data,
    batch_start_terms,
    batch_theorem1_constants,
)
from .lyapunov import _check_per_tick, _cumtrapz, _delayed, _tick_pairs, workload_potential

ESTIMATES = (
    "routing_speed",
    "workload_lipschitz",
    "mixed_delay",
    "cost_envelope",
    "tail_increment",
    "bounded_part",
    "tail",
)
"""The estimates of the proof's chain that `Theorem1Check` measures, in its column order."""

# Relative tolerance of each estimate's verdict: the observed costs and the delayed
# workloads are rebuilt from per-tick saves by linear interpolation (O(h^2)), and the
# integrals by the tick rules (O(h)); `mixed_delay` is computed exactly.
ESTIMATE_RTOL = {
    "routing_speed": 1e-3,
    "workload_lipschitz": 1e-3,
    "mixed_delay": 1e-9,
    "cost_envelope": 1e-3,
    "tail_increment": 1e-3,
    "bounded_part": 1e-3,
    "tail": 1e-3,
}


class Theorem1Check(eqx.Module):
    """Theorem 1 checked along trajectories (arrays over the batch).

    **Fields:**
    - `measured`: $\\frac1T\\int_0^T[\\sum_jD_j + 2\\sum_i\\lambda_iS_i]$ at the final horizon.
    - `bound`: $A/(T\\underline\\eta) + G_1\\bar\\eta + C/T$ there.
    - `worst_ratio`: the largest measured / bound over every saved horizon $t_k \\ge h$.
    - `estimate_measured`, `estimate_bound`: `(B, len(ESTIMATES))`, each estimate's
      measured value and bound (module docstring); `estimate_holds` their verdicts.
    """

    measured: Float[Array, " B"]
    bound: Float[Array, " B"]
    worst_ratio: Float[Array, " B"]
    estimate_measured: Float[Array, "B E"]
    estimate_bound: Float[Array, "B E"]
    estimate_holds: Bool[Array, "B E"]


class _Run(eqx.Module):
    """One trajectory's per-tick quantities that the estimates read (each law evaluated
    once per workload: the gaps, tails and bounded parts are arithmetic on those values).

    `now` arrays are `(K+1, n)` at $N_j(t_k)$; `del` arrays `(K+1, n, n)` at
    $N_j(t_k - \\tau_{ij})$ on the arcs; `dx`, `dx_del` the current and delayed routings'
    offsets from $x^*$; `c_seen` the observed costs; `int_D`, `int_S` the running integrals
    of $\\sum_jD_j$ and $\\sum_i\\lambda_iS_i$."""

    d: _Data
    t: Array
    h: Array
    c_star: Array
    dx: Array
    dx_del: Array
    f_now: Array
    f_del: Array
    D_now: Array
    D_del: Array
    e_now: Array
    e_del: Array
    c_seen: Array
    int_D: Array
    int_S: Array


class _Gaps(eqx.Module):
    d: _Data
    f_star: Array
    mu_star: Array
    c_star: Array
    dx: Array
    f_now: Array
    D_now: Array
    int_D: Array
    int_S: Array


def _gaps(cost, scn, N_star, x_star, t, N, x) -> _Gaps:
    """The bound's integrand along one run: $D_j(N(t_k))$, $S_i$ and their running
    integrals (trapezoid for $D$, the routing's left-point rule for $S$)."""
    d = _data(cost, scn, N_star)
    f_star = cost.destination(scn, N_star)
    c_star = jnp.where(d.arc, f_star[None, :] + d.g, 0.0)
    dx = jnp.where(d.arc[None], x - x_star[None], 0.0)  # (K+1, n, n)
    mu_star = scn.service.rate(N_star)
    f_now = cost.destination(scn, N)
    D_now = (f_now - f_star[None]) * (scn.service.rate(N) - mu_star[None])
    D_now = jnp.where(d.real[None], D_now, 0.0)
    S = jnp.sum(d.lam[None] * jnp.sum(dx * c_star[None], axis=-1), axis=-1)  # (K+1,)
    int_S = jnp.concatenate([jnp.zeros(1, t.dtype), jnp.cumsum(S[:-1] * jnp.diff(t))])
    int_D = _cumtrapz(jnp.sum(D_now, axis=-1), t)
    return _Gaps(d, f_star, mu_star, c_star, dx, f_now, D_now, int_D, int_S)


def _average(gaps: _Gaps | _Run, t):
    """$\\frac1t\\int_0^t[\\sum_jD_j + 2\\sum_i\\lambda_iS_i]$ at every saved horizon (0 at
    $t = 0$)."""
    return jnp.where(t > 0, (gaps.int_D + 2.0 * gaps.int_S) / jnp.where(t > 0, t, 1.0), 0.0)


@eqx.filter_jit
def batch_time_average(cost, scn, N_star, x_star, t, N, x):
    """The bound's left-hand side at every saved horizon of a batch of runs saved at every
    tick (`(B, K+1)`; the arguments as `batch_theorem1_check`'s), one run at a time."""
    cost = cost_from_name(cost)
    return jax.lax.map(lambda a: _average(_gaps(cost, *a), a[3]), (scn, N_star, x_star, t, N, x))


def _run(cost, consts: Theorem1Constants, scn, N_star, x_star, h, t, N, x) -> _Run:
    gp = _gaps(cost, scn, N_star, x_star, t, N, x)
    d = gp.d
    arc = d.arc[None]
    idx = jnp.arange(t.shape[0])
    N_del = _delayed(N, h, d.tau, idx, piecewise_constant=False)  # N_j(t_k - tau_ij)
    x_del = _delayed(x, h, d.tau, idx, piecewise_constant=True)
    f_del = cost.destination(scn, N_del)
    D_del = (f_del - gp.f_star[None, None]) * (scn.service.rate(N_del) - gp.mu_star[None, None])
    return _Run(
        d=d,
        t=t,
        h=jnp.asarray(h, t.dtype),
        c_star=gp.c_star,
        dx=gp.dx,
        dx_del=jnp.where(arc, x_del - x_star[None], 0.0),
        f_now=gp.f_now,
        f_del=f_del,
        D_now=gp.D_now,
        D_del=jnp.where(arc, D_del, 0.0),
        e_now=consts.tail_of(gp.f_now),
        e_del=jnp.where(arc, consts.tail_of(f_del), 0.0),
        c_seen=jnp.where(arc, f_del + d.g[None], 0.0),
        int_D=gp.int_D,
        int_S=gp.int_S,
    )


def _ratio(num, room):
    """num / room, 0 where num is 0 and inf where only room is 0 (an estimate that allows
    nothing and sees something fails)."""
    out = jnp.where(num > 0, num / jnp.where(room > 0, room, 1.0), 0.0)
    return jnp.where((num > 0) & (room <= 0), jnp.inf, out)


def _sources(run: _Run):
    return jnp.any(run.d.arc, axis=1)[None]


def _routing_speed(run: _Run, x, eta):
    """Lemma 10: each tick's move against twice its step times its largest observed cost."""
    c_norm = jnp.max(jnp.abs(run.c_seen), axis=-1)  # (K+1, n)
    jump = jnp.max(jnp.abs(x[1:] - x[:-1]), axis=-1)  # (K, n): x^k - x^{k-1}, k = 1..K
    allow = 2.0 * eta[None] * run.h * c_norm[1:]
    return jnp.max(jnp.where(_sources(run), _ratio(jump, allow), 0.0))


def _workload_lipschitz(run: _Run, N):
    """The workloads' largest rate of change against $v$."""
    rate = jnp.abs(N[1:] - N[:-1]) / run.h
    return jnp.max(jnp.where(run.d.real[None], rate, 0.0))


def _mixed_delay(run: _Run):
    """C.3.1: the delayed routings' slackness against the current one, exactly."""
    prev, cur, r = _tick_pairs(run.dx, run.d.tau, run.h)
    lam3 = run.d.lam[None, :, None]
    delay_gap = jnp.sum(lam3 * run.c_star[None] * (prev * r + cur * (run.h - r)))
    return run.int_S[-1] - delay_gap


def _cost_envelope(run: _Run, consts: Theorem1Constants):
    """Lemma 6: the observed costs against their envelope."""
    dmu = run.d.dmu[None, None, :]
    arc = run.d.arc[None]
    env = consts.F_bar[None] + jnp.sum(jnp.where(arc, 2.0 / dmu * run.D_del, 0.0), axis=-1)
    c_norm = jnp.max(jnp.abs(run.c_seen), axis=-1)
    envelope = jnp.where(_sources(run), c_norm / jnp.where(env > 0, env, 1.0), 0.0)
    return jnp.max(envelope[1:])


def _tail_increment(run: _Run):
    """Lemma 7: the tail's change across a delay against the gaps at both ends."""
    de = jnp.where(run.d.arc[None], jnp.abs(run.e_now[:, None, :] - run.e_del), 0.0)
    Lam = run.d.Lam[None, None, :]
    room = (run.D_now[:, None, :] + run.D_del) / (8.0 * jnp.where(Lam > 0, Lam, 1.0))
    return jnp.max(_ratio(de, room))


def _bounded_part(run: _Run, consts: Theorem1Constants, terms: StartTerms):
    """Lemma 8 with Lemma 6: the bounded part's mismatch (left-point rule on ticks) and its
    bound."""
    d, arc = run.d, run.d.arc[None]
    b_now = jnp.where(arc, consts.bounded_of(run.f_now)[:, None, :] + d.g[None], 0.0)
    b_del = jnp.where(arc, consts.bounded_of(run.f_del) + d.g[None], 0.0)
    gam_b = jnp.sum(d.lam[None, :, None] * (run.dx_del * b_now - run.dx * b_del), axis=(-2, -1))
    measured = jnp.sum(gam_b[:-1] * jnp.diff(run.t))
    int_Dk = jnp.sum(0.5 * (run.D_now[1:] + run.D_now[:-1]) * jnp.diff(run.t)[:, None], axis=0)
    int_Dk = int_Dk + consts.tau_bar * run.D_now[0]  # int_{-tau}^T D_k
    per_router = run.t[-1] * consts.F_bar + jnp.sum(
        jnp.where(d.arc, (2.0 / d.dmu * int_Dk)[None, :], 0.0), axis=1
    )
    bound = 4.0 * terms.eta_bar * jnp.sum(d.lam[:, None] * consts.W * per_router[:, None])
    return measured, bound + consts.Kb


def _tail(run: _Run, consts: Theorem1Constants, terms: StartTerms, Phi_T):
    """Lemma 9: the tail's mismatch and its bound."""
    e_now3 = jnp.where(run.d.arc[None], run.e_now[:, None, :], 0.0)
    lam3 = run.d.lam[None, :, None]
    gam_e = jnp.sum(lam3 * (run.dx_del * e_now3 - run.dx * run.e_del), axis=(-2, -1))
    measured = jnp.sum(gam_e[:-1] * jnp.diff(run.t))
    return measured, 0.25 * run.int_D[-1] + terms.KH + Phi_T + consts.K4


def _check_impl(cost, consts: Theorem1Constants, terms: StartTerms, scn, N_star, x_star, eta,
                h, t, N, x):  # fmt: skip
    cost = cost_from_name(cost)
    run = _run(cost, consts, scn, N_star, x_star, h, t, N, x)
    # The bound at every saved horizon.
    tk = jnp.where(t > 0, t, 1.0)
    measured = _average(run, t)
    bound = terms.A / (tk * terms.eta_min) + consts.G1 * terms.eta_bar + terms.C / tk
    ratio = jnp.where(t > 0, measured / bound, 0.0)

    b_meas, b_bound = _bounded_part(run, consts, terms)
    e_meas, e_bound = _tail(run, consts, terms, workload_potential(cost, scn, N[-1], N_star))
    one = jnp.ones_like(measured[-1])
    vals = jnp.stack([_routing_speed(run, x, eta), _workload_lipschitz(run, N),
                      _mixed_delay(run), _cost_envelope(run, consts), _tail_increment(run),
                      b_meas, e_meas])  # fmt: skip
    lims = jnp.stack([one, consts.v, consts.K1, one, one, b_bound, e_bound])
    rtol = jnp.asarray([ESTIMATE_RTOL[k] for k in ESTIMATES], t.dtype)
    holds = vals <= lims + rtol * jnp.abs(lims) + 1e-12
    return Theorem1Check(
        measured=measured[-1],
        bound=bound[-1],
        worst_ratio=jnp.max(ratio[1:]),
        estimate_measured=vals,
        estimate_bound=lims,
        estimate_holds=holds,
    )


@eqx.filter_jit
def batch_theorem1_check(cost, consts, terms, scn, N_star, x_star, eta, h, t, N, x):
    """`Theorem1Check` of a batch of runs saved at every tick (leading axis on every
    argument but `cost`: `batch_theorem1_constants`, `batch_start_terms`, the stripped
    scenarios, $N^*$, $x^*$, the per-router steps, the tick, `Solution.t`, `.N`, `.x`).

    The runs are checked one after another (`jax.lax.map`), so the per-tick temporaries
    of one run, not of the batch, are alive at a time."""

    def one(a):
        return _check_impl(cost, *a)

    return jax.lax.map(one, (consts, terms, scn, N_star, x_star, eta, h, t, N, x))


def theorem1_check(solution, scenario, equilibrium, *, cost, step_size, constants=None):
    """Theorem 1 along one flow-routing trajectory saved at every tick.

    **Arguments:** an unbatched `Solution` from `simulate(..., n_save=K)` with one save per
    tick, its `Scenario` (constant arrival rates), the equilibrium (`N`, `x`) of `cost`,
    the step size $\\eta$ (scalar or per router), and optionally the `Theorem1Constants`
    to check against (default: `theorem1_constants(scenario, equilibrium, cost=cost)`;
    pass others, e.g. a wrong $\\bar N$, to see which estimate they break).

    **Returns:** `(constants, terms, check)`: `Theorem1Constants`, `StartTerms` of the
    run's start, and a `Theorem1Check` of 0-d and `(len(ESTIMATES),)` arrays.

    **Raises:** `ValueError` for a batched solution or one not saved at every tick.
    """
    t, h = _check_per_tick(solution)
    n = scenario.n_cells
    cost_ = cost_from_name(cost)
    eta = jnp.broadcast_to(jnp.asarray(step_size, t.dtype), (n,))
    add = lambda a: jnp.asarray(a)[None]  # noqa: E731
    scn = jax.tree_util.tree_map(add, scenario.strip())
    Ns = add(jnp.asarray(equilibrium.N)[..., :n])
    xs = add(jnp.asarray(equilibrium.x)[..., :n, :n])
    if constants is None:
        consts = batch_theorem1_constants(cost_, scn, Ns, xs)
    else:
        consts = jax.tree_util.tree_map(add, constants)
    N, x = jnp.asarray(solution.N), jnp.asarray(solution.x)
    terms = batch_start_terms(cost_, consts, scn, Ns, xs, add(N[0]), add(x[0]), add(eta))
    chk = batch_theorem1_check(cost_, consts, terms, scn, Ns, xs, add(eta),
                               add(jnp.asarray(h, t.dtype)), add(t), add(N), add(x))  # fmt: skip
    first = lambda a: a[0]  # noqa: E731
    return tuple(jax.tree_util.tree_map(first, v) for v in (consts, terms, chk))


def _num(v) -> float | None:
    v = float(v)
    return v if math.isfinite(v) else None


def theorem1_record(consts, terms, check, b: int, n_cells: int) -> dict:
    """The JSON record of run `b` of a batch (`verify`'s `theorem1`): the constants, the
    bound and its verdict (`holds` is null outside the hypothesis), the tightness
    bound / measured at the final horizon, and every estimate."""
    g = lambda tree, k: np.asarray(getattr(tree, k))[b]  # noqa: E731
    in_hyp = bool(g(terms, "in_hypothesis"))
    eta0 = _num(g(consts, "eta0"))
    measured = float(g(check, "measured"))
    bnd = float(g(check, "bound"))
    em = np.asarray(check.estimate_measured)[b]
    eb = np.asarray(check.estimate_bound)[b]
    eh = np.asarray(check.estimate_holds)[b]
    return {
        "eta0": eta0,
        "G1": _num(g(consts, "G1")),
        "A": float(g(terms, "A")),
        "C": _num(g(terms, "C")),
        "C_parts": {
            "Phi0": float(g(terms, "Phi0")),
            "K1": float(g(consts, "K1")),
            "Kb": _num(g(consts, "Kb")),
            "KH": _num(g(terms, "KH")),
            "K4": _num(g(consts, "K4")),
            "history": float(g(terms, "history")),
        },
        "N_bar": [_num(v) for v in np.asarray(consts.N_bar)[b, :n_cells]],
        "eta_over_eta0": _num(float(g(terms, "eta_bar")) / eta0) if eta0 else None,
        "in_hypothesis": in_hyp,
        "bound": _num(bnd),
        "measured": measured,
        "holds": bool(g(check, "worst_ratio") <= 1.0) if in_hyp else None,
        "tightness": _num(bnd / measured) if measured > 0 else None,
        "estimates": {
            k: {"measured": _num(em[e]), "bound": _num(eb[e]), "holds": bool(eh[e])}
            for e, k in enumerate(ESTIMATES)
        },
    }
