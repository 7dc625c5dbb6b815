"""Critical step sizes of a whole batch in one jitted call (theory/stability.md §7).

The linearisation of theory/stability.md §1 in feedback form: eliminating the routing
coordinates, the non-zero characteristic roots are the zeros of the $n\\times n$
characteristic function

$$\\chi(s;\\eta) = \\det\\big(D(s) + \\eta H(s)\\big),\\quad D(s) = \\mathrm{diag}\\,s(s+\\mu_j'),
\\quad H(s) = \\sum_i c_i E_i(s)P_iE_i(s)F,$$

with $c_i = \\lambda_iw_i$ for every routing source, $P_i$ the tangent projector of its
support, $E_i(s) = \\mathrm{diag}\\,e^{-s\\tau_{ij}}$ and $F = \\mathrm{diag}\\,f_j'$.
Stability is decided by the argument principle on the imaginary axis applied to
$g(\\omega) = \\det(I + \\eta D(i\\omega)^{-1}H(i\\omega)) = \\chi/\\det D$: the number of roots in
the right half-plane is $Z = -\\varphi(\\infty)/\\pi$, $\\varphi$ the continuous phase of $g$
started at $-r\\pi/2$ at $\\omega = 0^+$ ($r = \\operatorname{rank}H(0)$;
`nyquist.roots_in_right_half_plane`, the count of the host method too). The feedback form
itself is `LoopGain` from `linearisation.local_gain`, the function `linearise` uses. The critical step
size is bracketed on a geometric ladder, bisected, then polished by Newton's method on
$g(\\omega, \\eta) = 0$. Everything is dense `jnp` on small matrices (no eigenvalue problem
but a symmetric $n\\times n$ `eigvalsh`), vmapped over the batch.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .._results import RESULTS, status_names, view
from .._validate import integer
from .linearisation import LoopGain, _flow_policy, loop_gain
from .nyquist import roots_in_right_half_plane

STATUS = view("success", "not_converged")
"""`success`: the crossing was polished by Newton's method (or $\\eta^*$ is 0 or `inf`);
`not_converged`: no Newton start converged near the bracket, and $\\eta^*$ is the
bisection's estimate (within 3.3%)."""


class BatchSearch(eqx.Module):
    """The search of `batch_critical_step_size` (theory/stability.md §7), with the values
    measured on random networks (static: one compiled program per setting).

    **Fields:**
    - `ladder`: step sizes relative to the symmetric-scaling guess, ratio 8 from 1/16 to
      2048 ($\\eta^*/$guess was 0.6 to 600 on random networks).
    - `bisections`: bisections in $\\log\\eta$ inside the first unstable rung
      ($8^{1/2^6} = 1.033$).
    - `newton`: Newton iterations of the polish.
    - `dense`: how many times finer the grid of the last test near the bracket is.
    - `refine`: local refinement of the argument principle: levels, intervals per level,
      points each.
    - `starts`: Newton starts next to the roots nearest the axis.
    - `window`: a polished crossing may lie this factor outside the bisection's bracket.
    """

    ladder: tuple = tuple(8.0**k / 16.0 for k in range(6))
    bisections: int = 6
    newton: int = 8
    dense: int = 4
    refine: tuple = (3, 6, 6)
    starts: int = 6
    window: float = 1.1


class BatchStability(eqx.Module):
    """The outcome of `batch_critical_step_size` (arrays over the batch).

    **Fields:**
    - `critical_step_size`: $\\eta^*$ (`inf`: stable on the whole ladder, i.e. for every step
      up to $4^7$ times the guess, e.g. no delay or no routing freedom; `0`: unstable at the
      ladder's lowest rung).
    - `crossing_frequency`: $\\omega_c$ of the polished crossing (`nan` without one).
    - `status`: `STATUS` codes (`success`, `not_converged`).
    - `guess`: the symmetric-scaling guess $\\eta_0 = 0.03/(\\theta_{max}\\max_{ij}c_if_j')$.
    - `routing_sources`: the number of sources with two or more support cells.
    """

    critical_step_size: Float[Array, " B"]
    crossing_frequency: Float[Array, " B"]
    status: Int[Array, " B"]
    guess: Float[Array, " B"]
    routing_sources: Int[Array, " B"]

    def status_names(self) -> np.ndarray:
        return status_names(self.status)


def _scales(d: LoopGain):
    """`(r, l_min, hbar)`: the rank $r$ of $H(0)$, the smallest positive eigenvalue of
    $\\mathrm{diag}(\\mu')^{-1}H(0)$ (symmetrised: $KQK$, $K = \\mathrm{diag}\\sqrt{f'/\\mu'}$,
    $Q = \\sum_ic_iP_i$) and $\\bar h = \\sum_ic_i\\max_jf_j' \\ge \\|H(i\\omega)\\|$."""
    sup = d.support.astype(d.weight.dtype)
    k = jnp.maximum(jnp.sum(sup, axis=1), 1.0)
    P = jax.vmap(jnp.diag)(sup) - sup[:, :, None] * sup[:, None, :] / k[:, None, None]
    Q = jnp.einsum("i,ijk->jk", d.weight, P)
    K = jnp.sqrt(d.cost_prime / d.rate_prime)
    ev = jnp.linalg.eigvalsh(K[:, None] * Q * K[None, :])
    top = jnp.max(jnp.abs(ev))
    pos = ev > 1e-9 * top
    r = jnp.sum(pos)
    lmin = jnp.min(jnp.where(pos, ev, jnp.inf))
    used = jnp.any(d.support, axis=0)
    hbar = jnp.sum(d.weight) * jnp.max(jnp.where(used, d.cost_prime, 0.0))
    return r, lmin, hbar


def _loop_matrix(d: LoopGain, omega):
    """$G(i\\omega) = D(i\\omega)^{-1}H(i\\omega)$ of one scenario, shape `(n, n, W)` (the
    frequency axis last, so that everything below is elementwise over it)."""
    n = d.rate_prime.shape[0]
    phase = d.delay[..., None] * omega[None, None]
    E = jnp.where(d.support[..., None], jax.lax.complex(jnp.cos(phase), -jnp.sin(phase)), 0.0)
    k = jnp.maximum(jnp.sum(d.support, axis=1), 1)
    ck = d.weight / k
    # H = sum_i c_i E_i P_i E_i F with P_i = diag(s_i) - s_i s_i^T / k_i (E_i is 0 off S_i)
    diag = jnp.sum(d.weight[:, None, None] * E * E, axis=0)  # (n, W)
    outer = sum(
        (ck[i] * E[i][:, None, :] * E[i][None, :, :] for i in range(1, n)),
        ck[0] * E[0][:, None, :] * E[0][None, :, :],
    )
    eye = jnp.eye(n)[..., None]
    H = (eye * diag[None] - outer) * d.cost_prime[None, :, None]
    s = 1j * omega
    Dinv = 1.0 / (s[None] * (s[None] + d.rate_prime[:, None]))
    return Dinv[:, None] * H


def _g(d: LoopGain, omega, eta):
    """$g = \\det(I + \\eta G(i\\omega))$ of one scenario at the frequencies `omega` `(W,)`;
    `eta` a scalar or `(W,)`."""
    n = d.rate_prime.shape[0]
    eta = jnp.asarray(eta)
    M = jnp.eye(n)[..., None] + (eta[None, None] if eta.ndim else eta) * _loop_matrix(d, omega)
    return _det(M)


def _det(M):
    """Determinants of the matrices `M[:, :, w]` (shape `(n, n, W)`) by Gaussian
    elimination with partial pivoting, in `jnp` on the frequency axis.

    Not `jnp.linalg.det`: its LAPACK call inside the vmapped scans of `_one` deadlocked
    the XLA CPU runtime (jax 0.10, batches of 250: every thread parked on a futex, on
    the second call or the first); elimination is elementwise over the frequencies, so the
    program has no custom call at all, and for the few cells of a scenario it costs
    about as much."""
    n = M.shape[0]
    rows = jnp.arange(n)

    def column(k, state):
        A, det = state
        mag = jnp.where((rows >= k)[:, None], jnp.abs(A[:, k]), -1.0)  # (n, W)
        p = jnp.argmax(mag, axis=0)  # pivot row per frequency
        W = jnp.arange(A.shape[2])
        rk, rp = A[k], A[p, :, W].T  # (n, W): row k and the pivot rows
        A = A.at[k].set(rp)
        A = A.at[p, :, W].set(rk.T)
        det = det * jnp.where(p == k, 1.0, -1.0) * A[k, k]
        piv = jnp.where(A[k, k] == 0, 1.0, A[k, k])
        f = jnp.where((rows > k)[:, None], A[:, k] / piv[None], 0.0)  # (n, W)
        A = A - f[:, None, :] * A[k][None]
        return A, det

    _, det = jax.lax.fori_loop(0, n, column, (M, jnp.ones(M.shape[2], M.dtype)))
    return det


def _grid(d: LoopGain, eta, scales, n_log: int, n_lin: int):
    """The base frequencies of the argument principle at step size `eta`: `n_log`
    logarithmic on $[\\omega_{lo}, \\omega_{hi}]$ and `n_lin` linear on $(0, \\omega_{hi}]$.

    $\\omega_{lo} = 10^{-2}\\min(\\eta\\ell_{min}, \\mu'_{min}, 1/2\\theta_{max})$ lies below every
    scale of the low-frequency expansion $g \\approx (i\\omega)^{-r}\\times$ a positive number;
    above $\\omega_{hi} = (20\\eta\\bar h)^{1/2}$, $\\|\\eta G\\| \\le \\eta\\bar h/\\omega^2 \\le 0.05$,
    so $g$ stays within 0.3 rad of 1 and cannot wind. The linear part resolves the delay
    rotations $e^{-i\\omega\\theta}$ at high frequency."""
    r, lmin, hbar = scales
    used = jnp.any(d.support, axis=0)
    mu_min = jnp.min(jnp.where(used, d.rate_prime, jnp.inf))
    tmax = jnp.max(d.delay)
    low = 1e-2 * jnp.minimum(jnp.minimum(eta * lmin, mu_min), 1.0 / jnp.maximum(2 * tmax, 1e-300))
    high = jnp.maximum(jnp.sqrt(eta * hbar / 0.05), 10.0 * low)
    logs = jnp.exp(jnp.linspace(jnp.log(low), jnp.log(high), n_log))
    lins = high * jnp.arange(1, n_lin + 1) / n_lin
    return jnp.sort(jnp.concatenate([logs, lins]))


def _count(d: LoopGain, eta, scales, n_log: int, n_lin: int, search: BatchSearch):
    """Roots in the right half-plane at step size `eta` (module docstring), the sampled
    frequencies (sorted) and the centres of the intervals of largest |phase increment|
    (next to the roots nearest the axis).

    The phase increments between consecutive samples are principal values, exact while
    each true increment is below $\\pi$ in magnitude; a root at distance $\\epsilon$ from the
    axis turns the phase by nearly $\\pi$ over an interval of width $\\sim\\epsilon$. So the
    `search.refine[1]` intervals of largest |increment| are split into `search.refine[2]`
    + 1 geometric sub-intervals, `search.refine[0]` times over. The count itself is
    `roots_in_right_half_plane`, the one the host method uses."""
    omega = _grid(d, eta, scales, n_log, n_lin)
    g = _g(d, omega, eta)
    levels, m, q = search.refine
    W = omega.shape[0] - 1
    pad = levels * m * (q + 1)
    a = jnp.concatenate([omega[:-1], jnp.ones(pad)])
    b = jnp.concatenate([omega[1:], jnp.ones(pad)])
    ga = jnp.concatenate([g[:-1], jnp.ones(pad, g.dtype)])
    gb = jnp.concatenate([g[1:], jnp.ones(pad, g.dtype)])
    inc = jnp.concatenate([jnp.angle(g[1:] / g[:-1]), jnp.zeros(pad)])
    t = jnp.arange(1, q + 1) / (q + 1)

    def refine(level, state):
        a, b, ga, gb, inc = state
        _, idx = jax.lax.top_k(jnp.abs(inc), m)
        A, Bw, GA, GB = a[idx], b[idx], ga[idx], gb[idx]
        pts = A[:, None] * (Bw / A)[:, None] ** t[None, :]
        gp = _g(d, pts.reshape(-1), eta).reshape(m, q)
        at = W + level * m * (q + 1)

        def put(arr, new):
            return jax.lax.dynamic_update_slice(arr, new.reshape(-1), (at,))

        inc = inc.at[idx].set(0.0)  # replaced by its sub-intervals
        sga = jnp.concatenate([GA[:, None], gp], axis=1)
        sgb = jnp.concatenate([gp, GB[:, None]], axis=1)
        return (
            put(a, jnp.concatenate([A[:, None], pts], axis=1)),
            put(b, jnp.concatenate([pts, Bw[:, None]], axis=1)),
            put(ga, sga),
            put(gb, sgb),
            put(inc, jnp.angle(sgb / sga)),
        )

    a, b, ga, gb, inc = jax.lax.fori_loop(0, levels, refine, (a, b, ga, gb, inc))
    Z = roots_in_right_half_plane(
        jnp.angle(g[0]), jnp.sum(inc), jnp.angle(g[-1]), scales[0], xp=jnp
    ).astype(jnp.int32)
    # (padding entries are 1, inside the base grid's range; a duplicate frequency does no
    # harm to a phase profile)
    points = jnp.sort(jnp.concatenate([a, b[-1:]]))
    _, top = jax.lax.top_k(jnp.abs(inc), search.starts)
    return Z, points, jnp.sqrt(a[top] * b[top])


def _lagged(d: LoopGain, scales, lo, hi, n_log: int, n_lin: int):
    """Where roots cross the axis between the step sizes `lo` (stable) and `hi`
    (unstable), on the base grid of their geometric mean: there the continuous phase of
    $g$ at `hi` falls $\\pi$ (first root pair) and $3\\pi$ (second) behind that at `lo` (a root
    passing just right of the axis turns the phase by $-\\pi$, just left by $+\\pi$)."""
    points = _grid(d, jnp.sqrt(lo * hi), scales, n_log, n_lin)
    W = points.shape[0]
    g = _g(
        d, jnp.concatenate([points, points]), jnp.concatenate([jnp.full(W, lo), jnp.full(W, hi)])
    )
    gl, gh = g[:W], g[W:]
    lag = jnp.cumsum(jnp.angle(gh[1:] / gh[:-1]) - jnp.angle(gl[1:] / gl[:-1]))
    k = jnp.stack([jnp.argmax(lag < -jnp.pi), jnp.argmax(lag < -3 * jnp.pi)])
    return jnp.sqrt(points[k] * points[k + 1])


def _newton(d: LoopGain, omega0, eta0, iters: int):
    """Newton's method on $g(\\omega, \\eta) = 0$ in $(\\log\\omega, \\log\\eta)$, with a
    forward-difference Jacobian (relative step $10^{-7}$: near the root the iteration still
    contracts by about $10^{-7}$ per step), $g$ evaluated directly (not from coefficients)."""
    h = 1e-7

    def step(v, _):
        vs = v[None, :] + jnp.asarray([[0.0, 0.0], [h, 0.0], [0.0, h]])
        g = _g(d, jnp.exp(vs[:, 0]), jnp.exp(vs[:, 1]))
        f = jnp.stack([g[0].real, g[0].imag])
        J = jnp.stack([(g[1:] - g[0]).real, (g[1:] - g[0]).imag]) / h  # (2, 2)
        det = J[0, 0] * J[1, 1] - J[0, 1] * J[1, 0]
        safe = jnp.where(det == 0, 1.0, det)
        dv = -jnp.stack([J[1, 1] * f[0] - J[0, 1] * f[1], -J[1, 0] * f[0] + J[0, 0] * f[1]]) / safe
        dv = jnp.where((det == 0) | ~jnp.all(jnp.isfinite(dv)), 0.0, jnp.clip(dv, -0.5, 0.5))
        return v + dv, jnp.abs(g[0])

    v0 = jnp.stack([jnp.log(omega0), jnp.log(eta0)])
    v, res = jax.lax.scan(step, v0, None, length=iters)
    # `res[-1]` is |g| before the last step, which is below the tolerance once converged.
    return jnp.exp(v[0]), jnp.exp(v[1]), res[-1]


def _one(d: LoopGain, n_log: int, n_lin: int, search: BatchSearch):
    """`batch_critical_step_size` of one scenario (vmapped by `_critical`)."""
    scales = _scales(d)
    routing = jnp.sum(d.weight > 0)
    tmax = jnp.max(d.delay)
    gain = jnp.max(jnp.where(d.support, d.weight[:, None] * d.cost_prime[None, :], 0.0))
    guess = 0.03 / (jnp.maximum(tmax, 1e-3) * jnp.maximum(gain, 1e-12))
    ladder = guess * jnp.asarray(search.ladder)
    L = len(search.ladder)
    B = search.bisections

    # One loop, so the stability test is compiled once: steps 0..L-1 climb the ladder
    # (remembering the first unstable rung), the next `bisections` halve that rung's bracket
    # in log(eta), and the last tests the bracket's unstable end again for Newton's starts.
    def body(carry, k):
        first, lo, hi, _ = carry
        climbing = k < L
        eta = jnp.where(climbing, ladder[jnp.minimum(k, L - 1)], jnp.sqrt(lo * hi))
        eta = jnp.where(k == L + B, hi, eta)
        Z, _, near = _count(d, eta, scales, n_log, n_lin, search)
        bad = Z != 0
        found = climbing & bad & (first < 0)
        first = jnp.where(found, k, first)
        bis = ~climbing & (k < L + B)
        lo = jnp.where(found, ladder[jnp.maximum(k - 1, 0)], jnp.where(bis & ~bad, eta, lo))
        hi = jnp.where(found, eta, jnp.where(bis & bad, eta, hi))
        return (first, lo, hi, near), None

    init = (jnp.asarray(-1), guess, guess, jnp.ones(search.starts))
    steps = jnp.arange(L + B + 1)
    (first, lo, hi, near), _ = jax.lax.scan(body, init, steps)
    mid = jnp.sqrt(lo * hi)
    # A test on a grid `dense` times finer near the bracket: two roots near the axis within
    # one base interval turn the phase by about 2 pi there, which the base test cannot see.
    fine = search.dense
    _, _, near_mid = _count(d, mid, scales, fine * n_log, fine * n_lin, search)
    starts = jnp.concatenate([_lagged(d, scales, lo, hi, n_log, n_lin), near, near_mid])
    ws, etas, res = jax.vmap(lambda w: _newton(d, w, mid, search.newton))(starts)
    # Next to a crossing the test can misjudge (a root within the frequency resolution of
    # the axis), so any converged crossing near the bracket is accepted, and of several
    # (two pairs crossing close together) the first.
    good = jnp.isfinite(etas) & (res <= 1e-8) & (ws > 0)
    good = good & (etas >= lo / search.window) & (etas <= hi * search.window)
    pick = jnp.argmin(jnp.where(good, etas, jnp.inf))
    ok = jnp.any(good)
    eta_star = jnp.where(ok, etas[pick], mid)
    w_star = jnp.where(ok, ws[pick], jnp.nan)
    status = jnp.where(ok, RESULTS.success, RESULTS.not_converged)
    stable_all = (first < 0) | (routing == 0) | (tmax == 0)
    at_bottom = (first == 0) & ~stable_all
    eta_star = jnp.where(stable_all, jnp.inf, jnp.where(at_bottom, 0.0, eta_star))
    w_star = jnp.where(stable_all | at_bottom, jnp.nan, w_star)
    status = jnp.where(stable_all | at_bottom, RESULTS.success, status)
    return BatchStability(eta_star, w_star, status.astype(jnp.int32), guess, routing)


@eqx.filter_jit
def _critical(d: LoopGain, n_log: int, n_lin: int, search: BatchSearch) -> BatchStability:
    return jax.vmap(lambda dd: _one(dd, n_log, n_lin, search))(d)


def batch_critical_step_size(
    scenario,
    policy,
    equilibrium,
    *,
    step_weights=None,
    n_log: int | None = None,
    n_lin: int | None = None,
    support_tol: float = 1e-9,
    search: BatchSearch = BatchSearch(),
) -> BatchStability:
    """Critical step sizes $\\eta^*$ of a batch of scenarios in one compiled call.

    $\\eta^*$ is the smallest step size at which a root of
    $\\chi(s;\\eta) = \\det(\\mathrm{diag}\\,s(s+\\mu_j') + \\eta\\sum_ic_iE_i(s)P_iE_i(s)F)$
    reaches the imaginary axis (module docstring; theory/stability.md §7). The stability
    test at a given $\\eta$ counts the roots in the right half-plane by the argument
    principle on `n_log` logarithmically and `n_lin` linearly spaced frequencies, refined
    next to the roots nearest the axis; the ladder $\\eta_0 8^k/16$, $k = 0..5$
    (`BatchSearch.ladder`, $\\eta_0$ the symmetric scaling of §3.5) brackets the first
    unstable rung, `BatchSearch.bisections` bisections narrow it to 3.3%, and Newton's method on
    $\\chi(i\\omega;\\eta) = 0$ polishes it to the exact crossing.

    **Arguments:**
    - `scenario`: a batch (`stack_scenarios`), constant arrival rates.
    - `policy`: a flow policy name or `FlowRouting` (its cost family is used).
    - `equilibrium`: batched `N`, `x` of that cost (`solve_equilibrium(batch, cost)`).
    - `step_weights`: optional `(B, n)` relative step sizes $w_i$ ($\\eta_i = \\eta w_i$).
    - `n_log`, `n_lin`: frequency samples of the argument principle (default $16n$ and $8n$
      for $n$ cells: more cells, more roots to resolve).
    - `support_tol`: equilibrium flows at or below this count as off the support.
    - `search`: the ladder, bisections, Newton iterations and refinement (`BatchSearch`).

    **Returns:** a `BatchStability`.
    """
    pol = _flow_policy(policy)
    if len(scenario.batch_shape) != 1:
        raise ValueError(
            f"scenario batch shape {scenario.batch_shape}: expected one batch axis "
            "(stack_scenarios); use critical_step_size for one scenario"
        )
    n = scenario.n_cells
    n_log = 16 * n if n_log is None else n_log
    n_lin = 8 * n if n_lin is None else n_lin
    if not isinstance(search, BatchSearch):
        raise ValueError(f"search = {search!r} is invalid: expected a BatchSearch")
    n_log, n_lin = integer("n_log", n_log, 8), integer("n_lin", n_lin, 8)
    d = loop_gain(scenario, pol.cost, equilibrium, step_weights=step_weights,
                  support_tol=support_tol)  # fmt: skip
    return _critical(d, n_log, n_lin, search)


__all__ = [
    "STATUS",
    "BatchSearch",
    "BatchStability",
    "batch_critical_step_size",
]
