"""Local stability of flow routing: the linearised delay equation and the critical step size.

Around an equilibrium $(N^*, x^*)$ of the cost family of a flow-routing policy
(`solve_equilibrium`), the delayed dynamics of theory/model.md linearise to the
linear delay differential equation (theory/stability.md §1)

$$\\dot y(t) = A_0 y(t) + \\sum_{k=1}^{K} A_k\\, y(t - \\theta_k),\\qquad
A_k = P_k + \\eta\\, R_k,$$

with state $y = (\\delta N, w)$: the workload deviations of the $n$ cells and, for every
source $i$ with $\\lambda_i > 0$ whose equilibrium support $S_i = \\{j: x^*_{ij} > 0\\}$ has at
least two cells, coordinates $w_i \\in \\mathbb R^{|S_i|-1}$ of the routing deviation
$\\delta x_i = B_i w_i$ in an orthonormal basis $B_i$ of the tangent space
$\\{d: \\sum_{j \\in S_i} d_j = 0\\}$. The delays $\\theta_k$ are the distinct one-way latencies
$\\tau_{ij}$ of support arcs; the step size $\\eta$ enters only the routing rows ($R_k$).

Two ways to find the critical step size $\\eta^*$ at which the rightmost characteristic
root crosses the imaginary axis:

* `symmetric_critical_step_size`: the closed form for one origin and two identical cells
  (theory/stability.md §2);
* the pseudospectral method (Breda-Maset-Vermiglio; the method of DDE-BIFTOOL): Chebyshev
  collocation of the infinitesimal generator, eigenvalues of the resulting matrix, Newton
  refinement on the characteristic matrix, and bisection of $\\eta$ on the sign of the
  spectral abscissa (theory/stability.md §3).

`herding` measures the limit cycle of discrete routing from a simulation
(theory/stability.md §5).
"""

from __future__ import annotations

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg
import scipy.optimize

from ._policies import AbstractPolicy, FlowRouting, policy_from_name
from ._registry import flow_policy_names
from ._scenario import Scenario

METHODS = ("auto", "symmetric", "pseudospectral")
FLOW_POLICIES = ("flow-grad", "flow-lat", "flow-rif")
"""The built-in flow policies (`dlbfluid._registry.flow_policy_names` lists all)."""
DEFAULT_NODES = 16
_NO_ROOT = complex(math.nan, math.nan)  # no crossing: eta* is 0 or infinite

# ----------------------------------------------------------------------------------------
# Small dense linear algebra on one BLAS thread
# ----------------------------------------------------------------------------------------


def _one_blas_thread():
    """Run the eigenvalue problems (matrices of a few hundred rows) on one BLAS thread.

    Multithreaded OpenBLAS busy-waits between the small kernels of `dgeev`; on a machine
    whose cores are shared (a busy CI runner, or JAX's own thread pool) one `eigvals` of a
    120 x 120 matrix was measured at 1.25 s instead of 17 ms. `threadpoolctl` limits every
    BLAS loaded in the process (numpy's and scipy's) and restores them on exit."""
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=1, user_api="blas")


def _on_one_blas_thread(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with _one_blas_thread():
            return fn(*args, **kwargs)

    return wrapped


# ----------------------------------------------------------------------------------------
# The symmetric closed form (theory/stability.md §2)
# ----------------------------------------------------------------------------------------


def _omega_c(a: float, K: float) -> float:
    """$\\omega_c$ with $\\omega_c^2 = (\\sqrt{a^4 + 4K^2} - a^2)/2 = 2K^2/(\\sqrt{a^4+4K^2}+a^2)$
    (the second form has no cancellation when $K \\ll a^2$)."""
    return math.sqrt(2.0 * K * K / (math.sqrt(a**4 + 4.0 * K * K) + a * a))


def symmetric_crossing_margin(a: float, K: float, tau: float) -> float:
    """$\\arctan(a/\\omega_c) - 2\\tau\\omega_c$: positive iff $s(s+a) + Ke^{-2\\tau s} = 0$ has
    all its roots in the open left half-plane (theory/stability.md §2).

    **Arguments:** `a` $= \\mu'(N^*) > 0$, `K` $= \\eta\\lambda f'(N^*) > 0$, `tau` $= \\tau \\ge 0$.
    """
    w = _omega_c(a, K)
    return math.atan2(a, w) - 2.0 * tau * w


def symmetric_critical_gain(a: float, tau: float) -> float:
    """The gain $K^*$ with $2\\tau\\omega_c(K^*) = \\arctan(a/\\omega_c(K^*))$, by Brent's method
    in $K$ to $10^{-15}$ relative; $+\\infty$ when $\\tau = 0$ (theory/stability.md §2)."""
    if not (math.isfinite(a) and a > 0):
        raise ValueError(f"a = {a!r} is invalid: expected mu'(N*) > 0")
    if not (math.isfinite(tau) and tau >= 0):
        raise ValueError(f"tau = {tau!r} is invalid: expected a finite delay >= 0")
    if tau == 0:
        return math.inf
    # The margin decreases strictly in K (omega_c increases): bracket, then Brent.
    lo = hi = a * a
    while symmetric_crossing_margin(a, hi, tau) > 0:
        hi *= 2.0
    while symmetric_crossing_margin(a, lo, tau) < 0:
        lo *= 0.5
    return scipy.optimize.brentq(
        lambda K: symmetric_crossing_margin(a, K, tau),
        lo,
        hi,
        xtol=1e-300,
        rtol=1e-15,
        maxiter=500,
    )


def symmetric_critical_step_size(a: float, fprime: float, lam: float, tau: float) -> float:
    """Critical step size of one origin routing to two identical cells (theory/stability.md §2).

    The linearisation ($u = \\delta N_1 - \\delta N_2$, $y = \\delta x_1$) has the
    characteristic equation $s(s+a) + Ke^{-2\\tau s} = 0$ with $K = \\eta\\lambda f'(N^*)$,
    $a = \\mu'(N^*)$; it is stable iff $2\\tau\\omega_c < \\arctan(a/\\omega_c)$,
    $\\omega_c^2 = (\\sqrt{a^4+4K^2} - a^2)/2$. Returns $\\eta^* = K^*/(\\lambda f'(N^*))$ with
    $K^*$ from `symmetric_critical_gain` (theory/stability.md §2).

    **Arguments:**
    - `a`: $\\mu'(N^*)$, the marginal processing rate of either cell at equilibrium.
    - `fprime`: $f'(N^*)$, the derivative of the destination cost.
    - `lam`: $\\lambda$, the arrival rate of the origin.
    - `tau`: $\\tau$, the one-way delay of both arcs (the loop delay is $2\\tau$).

    **Returns:** $\\eta^*$ (`inf` when $\\tau = 0$).

    **Raises:** `ValueError` for a non-positive `a`, `fprime`, `lam` or a negative `tau`.
    """
    for name, v in (("fprime", fprime), ("lam", lam)):
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"{name} = {v!r} is invalid: expected a finite number > 0")
    return symmetric_critical_gain(float(a), float(tau)) / (lam * fprime)


# ----------------------------------------------------------------------------------------
# Linearisation
# ----------------------------------------------------------------------------------------


def _flow_names() -> list[str]:
    """The flow policies a stability analysis takes: the built-in ones, then any others."""
    return list(FLOW_POLICIES) + [p for p in flow_policy_names() if p not in FLOW_POLICIES]


def _flow_policy(policy) -> FlowRouting:
    allowed = _flow_names()
    if isinstance(policy, str):
        pol = policy_from_name(policy) if policy in allowed else None
        if not isinstance(pol, FlowRouting):
            raise ValueError(
                f"policy = {policy!r} is invalid for a stability analysis: allowed policies "
                f"are {allowed} (discrete and random routing have no step size "
                "and no linearisation; see `herding` for discrete routing)"
            )
        return pol
    if isinstance(policy, FlowRouting):
        return policy
    if isinstance(policy, AbstractPolicy):
        raise ValueError(
            f"policy = {policy.name!r} is invalid for a stability analysis: allowed policies "
            f"are {allowed}"
        )
    raise ValueError(f"policy = {policy!r} is invalid: expected one of {allowed}")


def tangent_basis(m: int) -> np.ndarray:
    """Orthonormal basis $B \\in \\mathbb R^{m \\times (m-1)}$ of $\\{d: \\sum_j d_j = 0\\}$ (the
    Helmert columns $(1,\\dots,1,-k,0,\\dots)/\\sqrt{k(k+1)}$), so $BB^\\top = I - \\mathbf 1
    \\mathbf 1^\\top/m$ is the tangent projector $P_i$."""
    B = np.zeros((m, m - 1))
    for k in range(1, m):
        B[:k, k - 1] = 1.0
        B[k, k - 1] = -float(k)
        B[:, k - 1] /= math.sqrt(k * (k + 1))
    return B


class Linearisation(eqx.Module):
    """The linear delay equation $\\dot y = \\sum_{k=0}^K (P_k + \\eta R_k)\\,y(t-\\theta_k)$,
    $\\theta_0 = 0$ (module docstring; theory/stability.md §1). NumPy arrays throughout.

    **Fields:**
    - `delays`: `(K+1,)` $\\theta_0 = 0 < \\theta_1 < \\dots < \\theta_K$.
    - `plant`: `(K+1, d, d)` the $\\eta$-independent part $P_k$ (service and arrival rows).
    - `route`: `(K+1, d, d)` $R_k$, the routing rows per unit step size.
    - `n_cells`: the number $n$ of workload coordinates (the first $n$ of $y$).
    - `sources`, `supports`, `bases`: per routing source $i$, its support $S_i$ (cell
      indices) and tangent basis $B_i$ (`tangent_basis`), in the order of $w$.
    - `rate_prime`, `cost_prime`: $\\mu_j'(N^*_j)$ and $f_j'(N^*_j)$.
    - `arrival_rate`: $\\lambda_i$; `arc_delay`: $\\tau_{ij}$; `N`, `x`: the equilibrium.
    - `neutral`: `(d, m_0)` orthonormal basis of the constant states $(0, v)$ with $v$ in the
      kernel of the inflow map $L = \\sum_k \\partial\\dot{\\delta N}/\\partial w(t-\\theta_k)$:
      routing changes that leave every cell inflow unchanged. They are equilibria (the
      equilibrium routing is not unique, e.g. RIF with full support), so $s = 0$ is a
      semisimple root of multiplicity $m_0$ for every $\\eta$; it is deflated
      (theory/stability.md §1.3).
    - `degenerate_arcs`: allowed arcs $(i, j)$ of sources with demand that carry no flow
      at equilibrium yet have zero reduced cost $c_{ij}(N^*) - \\min_k c_{ik}(N^*)$ (to
      $10^{-7}$ relative). The projection is not differentiable there; the analysis holds
      for deviations that keep those arcs unused (theory/stability.md §1.2).
    """

    delays: np.ndarray
    plant: np.ndarray
    route: np.ndarray
    n_cells: int
    sources: tuple
    supports: tuple
    bases: tuple
    rate_prime: np.ndarray
    cost_prime: np.ndarray
    arrival_rate: np.ndarray
    arc_delay: np.ndarray
    N: np.ndarray
    x: np.ndarray
    neutral: np.ndarray
    degenerate_arcs: tuple

    @property
    def dim(self) -> int:
        return self.plant.shape[-1]

    def matrices(self, eta: float) -> np.ndarray:
        """$A_k = P_k + \\eta R_k$, shape `(K+1, d, d)`."""
        return self.plant + float(eta) * self.route

    def characteristic_matrix(self, s: complex, eta: float) -> np.ndarray:
        """$\\Delta(s) = sI - \\sum_k A_k e^{-s\\theta_k}$; its zeros $\\det\\Delta(s) = 0$ are the
        characteristic roots."""
        A = self.matrices(eta)
        e = np.exp(-s * self.delays)
        return s * np.eye(self.dim) - np.einsum("k,kij->ij", e, A)


def linearise(
    scenario: Scenario,
    policy,
    *,
    tau_scale: float = 1.0,
    step_weights=None,
    equilibrium=None,
    support_tol: float = 1e-9,
    time: float = 0.0,
) -> Linearisation:
    """Linearise flow routing around the equilibrium of its cost (theory/stability.md §1).

    $\\frac{d}{dt}\\delta N_j = \\sum_i \\lambda_i\\,\\delta x_{ij}(t-\\tau_{ij}) - \\mu_j'(N_j^*)\\,
    \\delta N_j$, $\\frac{d}{dt}\\delta x_i = -\\eta_i P_i\\,\\delta c_i$,
    $\\delta c_{ij}(t) = f_j'(N_j^*)\\,\\delta N_j(t-\\tau_{ij})$, on the support
    $S_i = \\{j: x^*_{ij} > \\text{support\\_tol}\\}$ of each source with $\\lambda_i > 0$. Arcs
    off the support carry a strictly positive reduced cost at a non-degenerate equilibrium,
    so the projection keeps them at 0 for small deviations. $f_j'$ is `jax.jvp` of
    `AbstractCost.destination`; $\\mu_j'$ is `ServiceModel.rate_prime`.

    **Arguments:**
    - `scenario`: one unbatched `Scenario`.
    - `policy`: `"flow-grad"`, `"flow-lat"`, `"flow-rif"` or a `FlowRouting`.
    - `tau_scale`: multiply every latency $\\tau_{ij}$ (delays *and* the arc costs
      $g_{ij} = 2\\tau_{ij}$, so the equilibrium is recomputed) by this factor.
    - `step_weights`: optional `(n,)` relative step sizes, $\\eta_i = \\eta\\,w_i$ (default 1).
    - `equilibrium`: a precomputed `EquilibriumSolution` of this (scaled) scenario and cost.
    - `support_tol`: equilibrium flows at or below this count as off the support.
    - `time`: arrival rates $\\lambda_i(\\texttt{time})$.

    **Returns:** a `Linearisation`.

    **Raises:** `ValueError` for a discrete or random policy, a batched scenario, or bad
    options.
    """
    from ._equilibrium import solve_equilibrium

    pol = _flow_policy(policy)
    if len(scenario.batch_shape) != 0:
        raise ValueError(
            f"scenario batch shape {scenario.batch_shape}: the stability analysis takes one "
            "unbatched scenario"
        )
    if not (isinstance(tau_scale, (int, float)) and math.isfinite(tau_scale) and tau_scale >= 0):
        raise ValueError(f"tau_scale = {tau_scale!r} is invalid: expected a finite number >= 0")
    scn = scale_delays(scenario, tau_scale)
    if equilibrium is None:
        equilibrium = solve_equilibrium(scn, pol.cost, time=time)
    mask = np.asarray(scn.cell_mask)
    n = int(mask.sum())
    if not np.all(mask[:n]):
        raise ValueError("cell_mask: padded cells must come last")
    Nstar = np.asarray(equilibrium.N, dtype=float)[:n]
    xstar = np.asarray(equilibrium.x, dtype=float)[:n, :n]
    allowed = np.asarray(scn.allowed)[:n, :n]
    tau = np.where(allowed, np.asarray(scn.latency, dtype=float)[:n, :n], 0.0)
    lam = np.asarray(scn.arrival_rate(time), dtype=float)[:n]
    w = np.ones(n) if step_weights is None else np.asarray(step_weights, dtype=float)
    if w.shape != (n,) or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"step_weights = {step_weights!r} is invalid: expected {n} numbers > 0")

    Nfull = jnp.zeros(scn.n_cells, jnp.float64).at[:n].set(jnp.asarray(Nstar))
    _, fp = jax.jvp(lambda M: pol.cost.destination(scn, M), (Nfull,), (jnp.ones_like(Nfull),))
    fp = np.asarray(fp, dtype=float)[:n]
    mp = np.asarray(scn.service.rate_prime(Nfull), dtype=float)[:n]

    # Reduced costs c_ij - min_k c_ik at N*: zero on the support; an allowed arc with zero
    # flow *and* zero reduced cost is degenerate (the projection is not smooth there).
    F = np.asarray(pol.cost.destination(scn, Nfull), dtype=float)[:n]
    c = F[None, :] + np.asarray(pol.cost.arc(scn), dtype=float)[:n, :n]
    c = np.where(allowed, c, np.inf)
    cmin = np.min(c, axis=1, keepdims=True)
    reduced = np.where(allowed, c - np.where(np.isfinite(cmin), cmin, 0.0), np.inf)
    scale = np.maximum(np.abs(np.where(np.isfinite(cmin), cmin, 1.0)), 1.0)
    degenerate = tuple(
        (int(i), int(j))
        for i, j in zip(
            *np.nonzero(
                allowed & (lam[:, None] > 0) & (xstar <= support_tol) & (reduced <= 1e-7 * scale)
            )
        )
    )

    sources, supports, bases = [], [], []
    for i in range(n):
        if lam[i] <= 0:
            continue
        S = np.nonzero(allowed[i] & (xstar[i] > support_tol))[0]
        if S.size >= 2:
            sources.append(i)
            supports.append(tuple(int(j) for j in S))
            bases.append(tangent_basis(S.size))
    arcs = [(i, j) for i, Si in zip(sources, supports) for j in Si]
    delays = np.unique(np.array([0.0] + [tau[i, j] for i, j in arcs]))
    d = n + sum(len(Si) - 1 for Si in supports)
    plant = np.zeros((delays.size, d, d))
    route = np.zeros((delays.size, d, d))
    plant[0, np.arange(n), np.arange(n)] = -mp
    off = n
    for i, Si, B in zip(sources, supports, bases):
        cols = slice(off, off + B.shape[1])
        for r, j in enumerate(Si):
            k = int(np.searchsorted(delays, tau[i, j]))
            # inflow: delta N_j' += lam_i delta x_ij(t - tau_ij), delta x_i = B_i w_i
            plant[k, j, cols] += lam[i] * B[r]
            # routing: w_i' = -eta_i B_i^T delta c_i, delta c_ij = f_j' delta N_j(t - tau_ij)
            route[k, cols, j] += -w[i] * fp[j] * B[r]
        off += B.shape[1]
    L = plant.sum(axis=0)[:n, n:]
    if L.shape[1]:
        _, sv, Vh = np.linalg.svd(L)
        rank = int(np.sum(sv > 1e-10 * max(sv.max(initial=0.0), 1e-300)))
        kernel = Vh[rank:].T
    else:
        kernel = np.zeros((0, 0))
    neutral = np.zeros((d, kernel.shape[1]))
    neutral[n:] = kernel
    return Linearisation(
        delays=delays,
        plant=plant,
        route=route,
        n_cells=n,
        sources=tuple(sources),
        supports=tuple(supports),
        bases=tuple(bases),
        rate_prime=mp,
        cost_prime=fp,
        arrival_rate=lam,
        arc_delay=tau,
        N=Nstar,
        x=xstar,
        neutral=neutral,
        degenerate_arcs=degenerate,
    )


def scale_delays(scenario: Scenario, tau_scale: float) -> Scenario:
    """The scenario with every latency $\\tau_{ij}$ multiplied by `tau_scale`."""
    if tau_scale == 1.0:
        return scenario
    import dataclasses

    return dataclasses.replace(scenario, latency=scenario.latency * float(tau_scale))


# ----------------------------------------------------------------------------------------
# Pseudospectral discretisation of the infinitesimal generator
# ----------------------------------------------------------------------------------------


def chebyshev_nodes(M: int, tau_max: float) -> np.ndarray:
    """Chebyshev extremal nodes on $[-\\tau_{max}, 0]$:
    $\\vartheta_m = \\frac{\\tau_{max}}{2}(\\cos(m\\pi/M) - 1)$, $m = 0..M$ ($\\vartheta_0 = 0$)."""
    return 0.5 * tau_max * (np.cos(np.pi * np.arange(M + 1) / M) - 1.0)


def chebyshev_differentiation(M: int, tau_max: float) -> np.ndarray:
    """The $(M+1)\\times(M+1)$ differentiation matrix of the polynomial interpolant on
    `chebyshev_nodes` (Trefethen's `cheb`, scaled by $2/\\tau_{max}$; diagonal by the
    negative-sum trick)."""
    x = np.cos(np.pi * np.arange(M + 1) / M)
    c = np.ones(M + 1)
    c[0] = c[-1] = 2.0
    c *= (-1.0) ** np.arange(M + 1)
    X = x[:, None] - x[None, :]
    D = np.outer(c, 1.0 / c) / (X + np.eye(M + 1))
    D -= np.diag(D.sum(axis=1))
    return D * (2.0 / tau_max)


def lagrange_row(M: int, tau_max: float, theta: float) -> np.ndarray:
    """Values $\\ell_m(\\theta)$ of the Lagrange basis on `chebyshev_nodes` at $\\theta$
    (barycentric formula with the Chebyshev weights $(-1)^m$, halved at the ends)."""
    nodes = chebyshev_nodes(M, tau_max)
    wts = (-1.0) ** np.arange(M + 1)
    wts[0] *= 0.5
    wts[-1] *= 0.5
    diff = theta - nodes
    hit = np.isclose(diff, 0.0, rtol=0.0, atol=1e-14 * max(tau_max, 1e-300))
    if hit.any():
        row = np.zeros(M + 1)
        row[np.argmax(hit)] = 1.0
        return row
    q = wts / diff
    return q / q.sum()


def generator_matrix(lin: Linearisation, eta: float, nodes: int = DEFAULT_NODES) -> np.ndarray:
    """Pseudospectral discretisation $\\mathcal A_M$ of the infinitesimal generator
    (Breda, Maset, Vermiglio 2005; theory/stability.md §3).

    The state $\\phi \\in C([-\\tau_{max}, 0], \\mathbb R^d)$ is represented by its values
    $\\phi(\\vartheta_m)$ at $M+1$ Chebyshev nodes. Rows $m = 1..M$ differentiate the
    interpolant, $(D \\otimes I_d)$; row $m = 0$ is the right-hand side
    $\\sum_k A_k\\,p(-\\theta_k)$ with the interpolant $p$ evaluated by `lagrange_row`.
    Size $d(M+1)$; without delays this is just $A_0$. Affine in $\\eta$.
    """
    A = lin.matrices(eta)
    d = lin.dim
    tmax = float(lin.delays[-1])
    if tmax == 0.0:
        return A[0].copy()
    M = int(nodes)
    D = chebyshev_differentiation(M, tmax)
    L = np.stack([lagrange_row(M, tmax, -t) for t in lin.delays])  # (K+1, M+1)
    G = np.kron(D, np.eye(d))
    G[:d] = np.einsum("km,kij->imj", L, A).reshape(d, (M + 1) * d)
    return G


class _Spectrum:
    """`generator_matrix` as $G_0 + \\eta G_1$, deflated of the neutral constant states:
    with $X = \\mathbf 1 \\otimes E$ (`Linearisation.neutral`, $GX = 0$ exactly because
    $D\\mathbf 1 = 0$ and $\\sum_k A_k E = 0$) and $Y$ an orthonormal basis of $X^\\perp$,
    the other eigenvalues are those of $Y^\\top G Y$ (block triangular form)."""

    @_on_one_blas_thread
    def __init__(self, lin: Linearisation, nodes: int):
        self.lin = lin
        self.nodes = nodes
        G0 = generator_matrix(lin, 0.0, nodes)
        G1 = generator_matrix(lin, 1.0, nodes) - G0
        E = lin.neutral
        if E.shape[1]:
            reps = G0.shape[0] // lin.dim
            X = np.kron(np.ones((reps, 1)) / math.sqrt(reps), E)
            Y = scipy.linalg.null_space(X.T)
            G0, G1 = Y.T @ G0 @ Y, Y.T @ G1 @ Y
        self.G0, self.G1 = G0, G1

    @_on_one_blas_thread
    def roots(self, eta: float, refine: int = 6) -> np.ndarray:
        lin = self.lin
        ev = scipy.linalg.eigvals(self.G0 + eta * self.G1, check_finite=False)
        ev = ev[np.argsort(-ev.real, kind="stable")]
        if not refine or lin.delays[-1] == 0:
            return ev
        done = 0
        for m in range(ev.size):
            if done >= refine:
                break
            if ev[m].imag < -1e-12 * max(abs(ev[m]), 1.0):
                continue  # refined through its conjugate
            s, ok = _newton_root(lin, ev[m], eta)
            if ok and abs(s - ev[m]) <= 1e-3 * (1.0 + abs(ev[m])):
                conj = np.nonzero(np.abs(ev - np.conj(ev[m])) <= 1e-6 * (1 + abs(ev[m])))[0]
                ev[m] = s if ev[m].imag != 0 else complex(s.real, 0.0)
                for c in conj:
                    if c != m and ev[c].imag < 0:
                        ev[c] = np.conj(s)
            done += 1
        return ev[np.argsort(-ev.real, kind="stable")]

    def abscissa(self, eta: float) -> float:
        return float(self.roots(eta)[0].real)


def _newton_root(lin: Linearisation, s0: complex, eta: float, *, iters: int = 30):
    """Newton on $\\Delta(s)v = 0$, $v_0^H v = 1$ from $s_0$ (bordered system); returns the
    refined root and whether it converged."""
    d = lin.dim
    A = lin.matrices(eta)
    th = lin.delays
    _, _, Vh = np.linalg.svd(lin.characteristic_matrix(s0, eta))
    v = Vh[-1].conj()
    c = v.conj()
    s = complex(s0)
    eye = np.eye(d)
    J = np.zeros((d + 1, d + 1), dtype=complex)
    J[d, :d] = c
    step = np.full(d + 1, np.inf, dtype=complex)
    # A step that strays far left overflows exp(-s theta); that is detected just below
    # (non-finite s) and the unrefined root is kept, so the warnings carry no information.
    with np.errstate(over="ignore", invalid="ignore"):
        return _newton_loop(lin, A, th, eye, J, v, c, s, s0, step, iters)


def _newton_loop(lin, A, th, eye, J, v, c, s, s0, step, iters):
    d = lin.dim
    for _ in range(iters):
        e = np.exp(-s * th)
        Delta = s * eye - np.einsum("k,kij->ij", e, A)
        dDelta = eye + np.einsum("k,kij->ij", th * e, A)
        J[:d, :d] = Delta
        J[:d, d] = dDelta @ v
        F = np.concatenate([Delta @ v, [c @ v - 1.0]])
        try:
            step = np.linalg.solve(J, -F)
        except np.linalg.LinAlgError:
            return s0, False
        v = v + step[:d]
        s = s + step[d]
        if not np.isfinite(s):
            return s0, False
        if abs(step[d]) <= 4e-16 * max(abs(s), 1.0):
            return s, True
    return s, bool(abs(step[d]) <= 1e-10 * max(abs(s), 1.0))


def characteristic_roots(
    lin: Linearisation,
    eta: float,
    *,
    nodes: int = DEFAULT_NODES,
    refine: int = 6,
) -> np.ndarray:
    """Approximate characteristic roots, rightmost first, excluding the $m_0$ neutral roots
    $s = 0$ (`Linearisation.neutral`): the eigenvalues of `generator_matrix`; the `refine`
    rightmost (one per conjugate pair) are polished by Newton's method on
    $\\Delta(s)v = 0$ (kept unrefined if Newton strays further than $10^{-3}(1+|s|)$)."""
    return _Spectrum(lin, _check_nodes(nodes)).roots(float(eta), refine)


def spectral_abscissa(
    scenario: Scenario,
    policy,
    step_size: float,
    *,
    nodes: int = DEFAULT_NODES,
    tau_scale: float = 1.0,
    equilibrium=None,
) -> float:
    """$\\alpha(\\eta) = \\max\\{\\operatorname{Re} s: \\det\\Delta(s) = 0\\}$ of the linearised
    delay equation at step size $\\eta$ (`linearise`, `characteristic_roots`). Negative:
    the equilibrium is locally exponentially stable; positive: unstable.
    """
    lin = linearise(scenario, policy, tau_scale=tau_scale, equilibrium=equilibrium)
    return _Spectrum(lin, _check_nodes(nodes)).abscissa(float(step_size))


def _check_nodes(nodes) -> int:
    if isinstance(nodes, bool) or not isinstance(nodes, (int, np.integer)) or nodes < 2:
        raise ValueError(f"nodes = {nodes!r} is invalid: expected an integer >= 2")
    return int(nodes)


# ----------------------------------------------------------------------------------------
# Critical step size
# ----------------------------------------------------------------------------------------


class StabilityResult(eqx.Module):
    """The outcome of `critical_step_size`.

    **Fields:**
    - `critical_step_size`: $\\eta^*$ (`inf`: stable for every step size; `0`: unstable even
      for vanishing steps).
    - `method`: `"symmetric"` or `"pseudospectral"`.
    - `rightmost_root`: the rightmost characteristic root at $\\eta^*$ ($\\approx i\\omega_c$;
      `nan` when there is no crossing).
    - `crossing_frequency`: $\\omega_c$ (rad/s); `period`: $2\\pi/\\omega_c$ (s).
    - `nodes`: Chebyshev nodes $M$ used (0 for the closed form).
    - `N`, `x`: the equilibrium; `policy`, `tau_scale`.
    - `linearisation`: the `Linearisation` it was computed from.
    """

    critical_step_size: float
    method: str
    rightmost_root: complex
    crossing_frequency: float
    period: float
    nodes: int
    N: np.ndarray
    x: np.ndarray
    policy: str
    tau_scale: float
    linearisation: Linearisation

    def summary(self) -> dict:
        """The JSON record of `dlbfluid stability --json`."""
        lin = self.linearisation
        s = self.rightmost_root
        return {
            "policy": self.policy,
            "critical_step_size": self.critical_step_size,
            "stable_for_every_step_size": bool(self.critical_step_size == math.inf),
            "method": self.method,
            "nodes": self.nodes,
            "tau_scale": self.tau_scale,
            "rightmost_root": {"real": s.real, "imag": s.imag},
            "crossing_frequency": self.crossing_frequency,
            "period": self.period,
            "equilibrium": {"N": np.asarray(self.N).tolist(), "x": np.asarray(self.x).tolist()},
            "delays": np.asarray(lin.delays).tolist(),
            "state_dimension": lin.dim,
            "routing_sources": list(lin.sources),
            "supports": [list(S) for S in lin.supports],
            "neutral_directions": int(lin.neutral.shape[1]),
            "degenerate_arcs": [list(a) for a in lin.degenerate_arcs],
        }


def _symmetric_parameters(lin: Linearisation, rtol: float = 1e-10):
    """`(a, fprime, lam, tau)` when the linearisation is one origin routing between two
    identical cells over equal delays (the §6.1 structure), else None."""
    if len(lin.sources) != 1 or len(lin.supports[0]) != 2:
        return None
    i = lin.sources[0]
    j, k = lin.supports[0]
    a, fp, tau = lin.rate_prime, lin.cost_prime, lin.arc_delay

    def close(u, v):
        return abs(u - v) <= rtol * max(abs(u), abs(v))

    if close(a[j], a[k]) and close(fp[j], fp[k]) and close(tau[i, j], tau[i, k]):
        return float(a[j]), float(fp[j]), float(lin.arrival_rate[i]), float(tau[i, j])
    return None


def _bisect_eta(spec: _Spectrum, eta0: float, rtol: float):
    """The first sign change of $\\alpha(\\eta)$: bracket by doubling/halving from `eta0`,
    then Brent's method on $\\alpha$ (a bisection on its sign with superlinear steps).
    Returns `inf` if still stable at $2^{80}\\eta_0$, `0` if unstable at $2^{-80}\\eta_0$."""
    f = spec.abscissa
    lo, hi = eta0, eta0
    if f(eta0) < 0:
        for _ in range(80):
            hi = 2.0 * lo
            if f(hi) >= 0:
                break
            lo = hi
        else:
            return math.inf
    else:
        for _ in range(80):
            lo = 0.5 * hi
            if f(lo) < 0:
                break
            hi = lo
        else:
            return 0.0
    return scipy.optimize.brentq(f, lo, hi, xtol=1e-300, rtol=rtol, maxiter=200)


def critical_step_size(
    scenario: Scenario,
    policy,
    *,
    method: str = "auto",
    nodes: int = DEFAULT_NODES,
    tau_scale: float = 1.0,
    step_weights=None,
    equilibrium=None,
    rtol: float = 1e-13,
) -> StabilityResult:
    """The step size $\\eta^*$ at which flow routing loses local stability.

    Below $\\eta^*$ every root of $\\det\\Delta(s) = 0$, $\\Delta(s) = sI - \\sum_k(P_k +
    \\eta R_k)e^{-s\\theta_k}$ (`linearise`) lies in the open left half-plane; at $\\eta^*$ a pair
    $\\pm i\\omega_c$ reaches the axis (theory/stability.md §2-§3). The step-size convention is
    that of `simulate(step_size=...)`: the router update is $x \\leftarrow \\Pi(x - \\eta h\\hat c)$,
    whose $h \\to 0$ limit is $\\dot x_i = \\Pi_T(-\\eta_i \\hat c_i)$.

    **Arguments:**
    - `scenario`: one unbatched `Scenario`.
    - `policy`: `"flow-grad"`, `"flow-lat"`, `"flow-rif"` or a `FlowRouting`.
    - `method`: `"symmetric"` (closed form of theory/stability.md §2; needs one origin routing
      between two identical cells over equal delays), `"pseudospectral"` (any network), or
      `"auto"` (the closed form when the structure allows it).
    - `nodes`: Chebyshev nodes $M$ of the pseudospectral discretisation.
    - `tau_scale`, `step_weights`, `equilibrium`: as in `linearise`.
    - `rtol`: relative tolerance of the bisection in $\\eta$.

    **Returns:** a `StabilityResult`.

    **Raises:** `ValueError` naming the field for a discrete/random policy, an unknown
    method, `method="symmetric"` on a network without the symmetric structure, bad
    `nodes`.
    """
    pol = _flow_policy(policy)
    if method not in METHODS:
        raise ValueError(f"method = {method!r} is invalid: allowed methods are {list(METHODS)}")
    nodes = _check_nodes(nodes)
    lin = linearise(
        scenario, pol, tau_scale=tau_scale, step_weights=step_weights, equilibrium=equilibrium
    )
    sym = _symmetric_parameters(lin) if step_weights is None else None
    if method == "symmetric" and sym is None:
        raise ValueError(
            "method = 'symmetric' is invalid for this scenario: the closed form needs exactly "
            "one origin routing between two cells with equal mu'(N*), f'(N*) and one-way "
            "delay (found routing sources "
            f"{list(lin.sources)} with supports {[list(S) for S in lin.supports]}); "
            "use method='pseudospectral'"
        )
    if not lin.sources:
        # No routing freedom at equilibrium: the step size does not enter the linearisation.
        return _result(lin, pol, math.inf, "pseudospectral", _NO_ROOT, nodes, tau_scale)
    if sym is not None and method in ("auto", "symmetric"):
        a, fp, lam, tau = sym
        eta = symmetric_critical_step_size(a, fp, lam, tau)
        root = complex(0.0, _omega_c(a, eta * lam * fp)) if math.isfinite(eta) else _NO_ROOT
        return _result(lin, pol, eta, "symmetric", root, 0, tau_scale)
    # Initial guess from the symmetric formula's scaling eta* ~ 1/(tau lam f').
    tmax = float(lin.delays[-1])
    gain = max(
        float(lin.arrival_rate[i] * lin.cost_prime[list(S)].max())
        for i, S in zip(lin.sources, lin.supports)
    )
    eta0 = 0.03 / (max(tmax, 1e-3) * max(gain, 1e-12))
    spec = _Spectrum(lin, nodes)
    eta = _bisect_eta(spec, eta0, rtol)
    root = _NO_ROOT
    if math.isfinite(eta) and eta > 0:
        ev = spec.roots(eta)
        top = ev[np.abs(ev.real - ev[0].real) <= 1e-8 * (1.0 + abs(ev[0]))]
        root = complex(top[np.argmax(top.imag)])
    return _result(lin, pol, eta, "pseudospectral", root, nodes, tau_scale)


def _result(lin, pol, eta, method, root, nodes, tau_scale) -> StabilityResult:
    w = abs(root.imag) if math.isfinite(eta) and eta > 0 else math.nan
    return StabilityResult(
        critical_step_size=float(eta),
        method=method,
        rightmost_root=complex(root),
        crossing_frequency=float(w),
        period=float(2.0 * math.pi / w) if w and math.isfinite(w) and w > 0 else math.nan,
        nodes=int(nodes),
        N=lin.N,
        x=lin.x,
        policy=pol.name,
        tau_scale=float(tau_scale),
        linearisation=lin,
    )


# ----------------------------------------------------------------------------------------
# Herding of discrete routing (measured from a simulation)
# ----------------------------------------------------------------------------------------


class HerdingResult(eqx.Module):
    """Late-time oscillation of $u = N_a - N_b$ measured by `herding` (batched: arrays).

    **Fields:**
    - `amplitude`: half the peak-to-peak range of $u$ over the window.
    - `period`: twice the mean spacing of the zero crossings of $u - \\bar u$ (`nan` with
      fewer than three crossings: no sustained oscillation).
    - `mean_total`: the window mean of $\\sum_j N_j$.
    - `cells`: `(a, b)`, the pair of cells whose difference oscillates most.
    - `crossings`: the number of zero crossings found.
    - `solution`: the `Solution` of the simulation.
    """

    amplitude: np.ndarray
    period: np.ndarray
    mean_total: np.ndarray
    cells: np.ndarray
    crossings: np.ndarray
    solution: object


def oscillation(t: np.ndarray, u: np.ndarray):
    """Amplitude $(\\max u - \\min u)/2$ and period $2\\,\\overline{\\Delta t}$ between zero
    crossings of $u - \\bar u$ (crossing times by linear interpolation), over the last axis;
    returns `(amplitude, period, crossings)` (period `nan` below three crossings)."""
    u = np.asarray(u, dtype=float)
    t = np.broadcast_to(np.asarray(t, dtype=float), u.shape)
    amp = 0.5 * (u.max(axis=-1) - u.min(axis=-1))
    v = u - u.mean(axis=-1, keepdims=True)
    a, b = v[..., :-1], v[..., 1:]
    cross = (a < 0) & (b >= 0) | (a >= 0) & (b < 0)
    frac = np.where(cross, a / np.where(cross, a - b, 1.0), 0.0)
    tc = t[..., :-1] + frac * (t[..., 1:] - t[..., :-1])
    count = cross.sum(axis=-1)
    first = np.where(
        cross.any(-1), np.take_along_axis(tc, np.argmax(cross, -1)[..., None], -1)[..., 0], np.nan
    )
    last_idx = cross.shape[-1] - 1 - np.argmax(cross[..., ::-1], -1)
    last = np.take_along_axis(tc, last_idx[..., None], -1)[..., 0]
    period = np.where(count >= 3, 2.0 * (last - first) / np.maximum(count - 1, 1), np.nan)
    return amp, period, count


def herding(
    scenario: Scenario,
    policy="disc-grad",
    *,
    tick: float,
    horizon: float,
    window: float = 0.5,
    cells=None,
    n_save: int | None = None,
    step_size=1.0,
    integrator=None,
) -> HerdingResult:
    """Amplitude and period of the herding limit cycle of discrete routing
    (theory/stability.md §5), measured on the late trajectory of `simulate`.

    The signal is $u(t) = N_a(t) - N_b(t)$ over the last `window` fraction of the horizon;
    amplitude $= (\\max u - \\min u)/2$, period $= 2\\times$ the mean spacing of the zero
    crossings of $u - \\bar u$ (`oscillation`). Bang-bang routing with loop delay $2\\tau$
    switches about $2\\tau$ after each crossing, so both grow roughly linearly in $\\tau$.

    **Arguments:**
    - `scenario`: a `Scenario` or a batch (`stack_scenarios`). Its initial state must break
      any symmetry (a symmetric start stays on the symmetric tie for ever).
    - `policy`: any policy name (default `"disc-grad"`).
    - `tick`, `horizon`: as in `simulate`; `n_save` defaults to one save per tick (capped
      at 20000 saves).
    - `window`: the late fraction of the horizon analysed.
    - `cells`: `(a, b)`; default: per scenario, the pair of real cells whose difference
      has the largest late range.
    - `step_size`, `integrator`: passed to `simulate`.

    **Returns:** a `HerdingResult` (arrays with a leading batch axis for a batch).
    """
    from ._simulate import Fast, simulate

    if not (0.0 < window <= 1.0):
        raise ValueError(f"window = {window!r} is invalid: expected a fraction in (0, 1]")
    K = int(round(float(horizon) / float(np.max(tick))))
    if n_save is None:
        n_save = max(1, min(K, 20000))
    sol = simulate(
        scenario,
        policy,
        step_size=step_size,
        tick=tick,
        horizon=horizon,
        n_save=n_save,
        integrator=Fast() if integrator is None else integrator,
        throw=False,
    )
    t = np.asarray(sol.t)
    N = np.asarray(sol.N)
    mask = np.asarray(sol.cell_mask)
    batched = N.ndim == 3
    if not batched:
        t, N, mask = t[None], N[None], mask[None]
    s0 = int(round((1.0 - window) * (t.shape[-1] - 1)))
    t, N = t[:, s0:], N[:, s0:]
    n = N.shape[-1]
    if cells is None:
        U = N[:, :, :, None] - N[:, :, None, :]  # (B, S, n, n)
        rng = U.max(axis=1) - U.min(axis=1)
        ok = mask[:, :, None] & mask[:, None, :] & ~np.eye(n, dtype=bool)[None]
        rng = np.where(ok, rng, -np.inf)
        flat = rng.reshape(rng.shape[0], -1).argmax(-1)
        a, b = np.unravel_index(flat, (n, n))
        a, b = np.minimum(a, b), np.maximum(a, b)
    else:
        a_, b_ = (int(c) for c in cells)
        for c in (a_, b_):
            if not 0 <= c < n:
                raise ValueError(f"cells = {cells!r} is invalid: expected two indices in [0, {n})")
        a = np.full(N.shape[0], a_)
        b = np.full(N.shape[0], b_)
    rows = np.arange(N.shape[0])
    u = N[rows, :, a] - N[rows, :, b]
    amp, period, count = oscillation(t, u)
    total = np.where(mask[:, None, :], N, 0.0).sum(-1).mean(-1)
    out = dict(
        amplitude=amp, period=period, mean_total=total, cells=np.stack([a, b], -1), crossings=count
    )
    if not batched:
        out = {k: v[0] for k, v in out.items()}
    return HerdingResult(solution=sol, **out)
