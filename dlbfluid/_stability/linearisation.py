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

Three ways to find the critical step size $\\eta^*$ at which the rightmost characteristic
root crosses the imaginary axis:

* `symmetric_critical_step_size`: the closed form for one origin and two identical cells
  (theory/stability.md §2);
* the pseudospectral method (Breda-Maset-Vermiglio; the method of DDE-BIFTOOL): Chebyshev
  collocation of the infinitesimal generator, eigenvalues of the resulting matrix, Newton
  refinement on the characteristic matrix, and bisection of $\\eta$ on the sign of the
  spectral abscissa (theory/stability.md §3);
* for large networks, the argument principle on the $n \\times n$ cell characteristic
  matrix $T(s)$ ($\\det\\Delta = s^{d-2n}\\det T$): the number of unstable roots from the
  eigenvalues of $H(i\\omega)$ on a grid of frequencies shared by every $\\eta$, bisection,
  and Newton's method on the Hopf system (theory/stability.md §3.6-3.7).

`step_size_ratio` says how many times $\\eta^*$ a step size is (§3.8).

`herding` measures the limit cycle of discrete routing from a simulation
(theory/stability.md §5).
"""

from __future__ import annotations

import functools
import math
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg
import scipy.optimize

from .._defaults import FLOW_POLICIES
from .._defaults import STABILITY_METHODS as METHODS
from .._defaults import STABILITY_NODES as DEFAULT_NODES
from .._equilibrium import solve_equilibrium
from .._policies import AbstractPolicy, FlowRouting, policy_from_name
from .._precision import require_x64
from .._progress import Progress
from .._registry import flow_policy_names
from .._scenario import Scenario
from .._simulate import Fast, simulate

AUTO_PSEUDOSPECTRAL_SIZE = 600
"""`method="auto"` uses the pseudospectral method up to this generator size $(M+1)d$."""
NOISE = 1e-13
"""Relative rounding level of the eigenvalues of $H(i\\omega)$ (`_Loci`): smaller ones are
zeros."""
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

    It stores the structure (supports, rates, slopes, delays), not the matrices: $P_k$ and
    $R_k$ have $O(\\sum_i |S_i|^2)$ nonzeros but $(K+1)d^2$ dense entries, and RIF with full
    support has $d \\approx n^2$ and $K \\approx n^2/2$ (theory/stability.md §3.7). The dense
    forms are built on demand for small networks.

    **Fields:**
    - `delays`: `(K+1,)` $\\theta_0 = 0 < \\theta_1 < \\dots < \\theta_K$.
    - `n_cells`: the number $n$ of workload coordinates (the first $n$ of $y$).
    - `sources`, `supports`: per routing source $i$, its support $S_i$ (cell indices), in
      the order of $w$; `bases` (a property) holds their tangent bases $B_i$
      (`tangent_basis`).
    - `rate_prime`, `cost_prime`: $\\mu_j'(N^*_j)$ and $f_j'(N^*_j)$.
    - `arrival_rate`: $\\lambda_i$; `arc_delay`: $\\tau_{ij}$; `step_weights`: the relative
      step sizes $w_i$ ($\\eta_i = \\eta w_i$); `N`, `x`: the equilibrium.
    - `degenerate_arcs`: allowed arcs $(i, j)$ of sources with demand that carry no flow
      at equilibrium yet have zero reduced cost $c_{ij}(N^*) - \\min_k c_{ik}(N^*)$ (to
      $10^{-7}$ relative). The projection is not differentiable there; the analysis holds
      for deviations that keep those arcs unused (theory/stability.md §1.2).

    **Properties** (dense, built on demand): `plant` `(K+1, d, d)` the $\\eta$-independent
    part $P_k$ (service and arrival rows); `route` `(K+1, d, d)` $R_k$, the routing rows per
    unit step size; `neutral` `(d, m_0)` an orthonormal basis of the constant states
    $(0, v)$ with $v$ in the kernel of the inflow map
    $L = \\sum_k \\partial\\dot{\\delta N}/\\partial w(t-\\theta_k)$: routing changes that leave
    every cell inflow unchanged. They are equilibria (the equilibrium routing is not
    unique, e.g. RIF with full support), so $s = 0$ is a semisimple root of multiplicity
    $m_0$ for every $\\eta$; it is deflated (theory/stability.md §1.3). `n_neutral` is
    $m_0$ without the basis.
    """

    delays: np.ndarray
    n_cells: int
    sources: tuple
    supports: tuple
    rate_prime: np.ndarray
    cost_prime: np.ndarray
    arrival_rate: np.ndarray
    arc_delay: np.ndarray
    step_weights: np.ndarray
    N: np.ndarray
    x: np.ndarray
    degenerate_arcs: tuple

    @property
    def dim(self) -> int:
        """$d = n + \\sum_i (|S_i| - 1)$."""
        return self.n_cells + sum(len(S) - 1 for S in self.supports)

    @property
    def bases(self) -> tuple:
        return tuple(tangent_basis(len(S)) for S in self.supports)

    def entries(self):
        """The nonzero entries of every $P_k$ and $R_k$ as `(k, row, col, plant, route)`
        arrays (an entry is in $P_k$ or in $R_k$; the other value is 0)."""
        n, tau, lam, w, fp = (
            self.n_cells,
            self.arc_delay,
            self.arrival_rate,
            self.step_weights,
            self.cost_prime,
        )
        ks, rows, cols, pv, rv = [np.zeros(n, int)], [np.arange(n)], [np.arange(n)], [], []
        pv.append(-self.rate_prime)
        rv.append(np.zeros(n))
        off = n
        for i, S, B in zip(self.sources, self.supports, self.bases):
            S = np.asarray(S)
            m = B.shape[1]
            k = np.repeat(np.searchsorted(self.delays, tau[i, S]), m)
            wcols = np.tile(off + np.arange(m), S.size)
            cells = np.repeat(S, m)
            zero = np.zeros(S.size * m)
            # inflow: delta N_j' += lam_i delta x_ij(t - tau_ij), delta x_i = B_i w_i;
            # routing: w_i' = -eta_i B_i^T delta c_i, delta c_ij = f_j' delta N_j(t - tau_ij)
            ks += [k, k]
            rows += [cells, wcols]
            cols += [wcols, cells]
            pv += [lam[i] * B.ravel(), zero]
            rv += [zero, ((-w[i] * fp[S])[:, None] * B).ravel()]
            off += m
        return tuple(np.concatenate(a) for a in (ks, rows, cols, pv, rv))

    def _dense(self, which: int) -> np.ndarray:
        k, r, c, *vals = self.entries()
        out = np.zeros((self.delays.size, self.dim, self.dim))
        np.add.at(out, (k, r, c), vals[which])
        return out

    @property
    def plant(self) -> np.ndarray:
        return self._dense(0)

    @property
    def route(self) -> np.ndarray:
        return self._dense(1)

    def inflow_map(self) -> np.ndarray:
        """$L = \\sum_k \\partial\\dot{\\delta N}/\\partial w(t-\\theta_k)$, `(n, d - n)`: the
        columns of source $i$ are $\\lambda_i B_i$ on the rows $S_i$."""
        n = self.n_cells
        L = np.zeros((n, self.dim - n))
        off = 0
        for i, S, B in zip(self.sources, self.supports, self.bases):
            L[list(S), off : off + B.shape[1]] = self.arrival_rate[i] * B
            off += B.shape[1]
        return L

    def _inflow_rank(self) -> int:
        L = self.inflow_map()
        if not L.size:
            return 0
        sv = np.linalg.svd(L, compute_uv=False)
        return int(np.sum(sv > 1e-10 * max(sv.max(initial=0.0), 1e-300)))

    @property
    def n_neutral(self) -> int:
        """$m_0 = (d - n) - \\operatorname{rank} L$."""
        return self.dim - self.n_cells - self._inflow_rank()

    @property
    def neutral(self) -> np.ndarray:
        n, d = self.n_cells, self.dim
        L = self.inflow_map()
        if L.shape[1]:
            _, sv, Vh = np.linalg.svd(L)
            rank = int(np.sum(sv > 1e-10 * max(sv.max(initial=0.0), 1e-300)))
            kernel = Vh[rank:].T
        else:
            kernel = np.zeros((0, 0))
        E = np.zeros((d, kernel.shape[1]))
        E[n:] = kernel
        return E

    def matrices(self, eta: float) -> np.ndarray:
        """$A_k = P_k + \\eta R_k$, shape `(K+1, d, d)` (dense)."""
        k, r, c, p, q = self.entries()
        out = np.zeros((self.delays.size, self.dim, self.dim))
        np.add.at(out, (k, r, c), p + float(eta) * q)
        return out

    def characteristic_matrix(self, s: complex, eta: float) -> np.ndarray:
        """$\\Delta(s) = sI - \\sum_k A_k e^{-s\\theta_k}$ (`(d, d)`); its zeros
        $\\det\\Delta(s) = 0$ are the characteristic roots."""
        return _delta(self.entries(), self.delays, self.dim, s, eta)[0]

    def cell_characteristic_matrix(self, s: complex, eta: float) -> np.ndarray:
        """$T(s) = s\\,\\mathrm{diag}(s + \\mu'(N^*)) + \\eta\\,M(s)$, `(n, n)`, with
        $\\det\\Delta(s) = s^{d - 2n}\\det T(s)$ (theory/stability.md §3.6):
        $M(s) = \\sum_i w_i\\lambda_i E_i(s) P_i E_i(s)\\,\\mathrm{diag}(f')$,
        $E_i(s) = \\mathrm{diag}_{j \\in S_i}(e^{-s\\tau_{ij}})$."""
        loci = _Loci(self)
        T = np.zeros((self.n_cells, self.n_cells), complex)
        c = loci.cells
        s = complex(s)
        T[np.ix_(c, c)] = loci.cell_matrix(np.array([s]), eta)[0]
        off = np.setdiff1d(np.arange(self.n_cells), c)
        T[off, off] = s * (s + self.rate_prime[off])
        return T


def _delta(entries, delays, d, s, eta):
    """$\\Delta(s)$ and $\\Delta'(s) = I + \\sum_k \\theta_k A_k e^{-s\\theta_k}$ from `entries`."""
    k, r, c, p, q = entries
    val = p + float(eta) * q
    e = np.exp(-s * delays)[k] * val
    D = s * np.eye(d, dtype=complex)
    np.add.at(D, (r, c), -e)
    dD = np.eye(d, dtype=complex)
    np.add.at(dD, (r, c), delays[k] * e)
    return D, dD


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
    options; `X64Error` while JAX's x64 mode is off (the slopes are float64).
    """
    require_x64("linearise (the stability analysis)")
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

    Nfull = np.zeros(scn.n_cells)
    Nfull[:n] = Nstar
    F, fp, mp, g = (np.asarray(a, dtype=float) for a in _slopes(scn, pol.cost, Nfull))
    F, fp, mp, g = F[:n], fp[:n], mp[:n], g[:n, :n]

    # Reduced costs c_ij - min_k c_ik at N*: zero on the support; an allowed arc with zero
    # flow *and* zero reduced cost is degenerate (the projection is not smooth there).
    c = F[None, :] + g
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

    sources, supports = [], []
    for i in range(n):
        if lam[i] <= 0:
            continue
        S = np.nonzero(allowed[i] & (xstar[i] > support_tol))[0]
        if S.size >= 2:
            sources.append(i)
            supports.append(tuple(int(j) for j in S))
    arcs = [(i, j) for i, Si in zip(sources, supports) for j in Si]
    delays = np.unique(np.array([0.0] + [tau[i, j] for i, j in arcs]))
    return Linearisation(
        delays=delays,
        n_cells=n,
        sources=tuple(sources),
        supports=tuple(supports),
        rate_prime=mp,
        cost_prime=fp,
        arrival_rate=lam,
        arc_delay=tau,
        step_weights=w,
        N=Nstar,
        x=xstar,
        degenerate_arcs=degenerate,
    )


@eqx.filter_jit
def _slopes(scn: Scenario, cost, N):
    """$f_j(N_j)$, $f_j'(N_j)$ (`jax.jvp` of `AbstractCost.destination`), $\\mu_j'(N_j)$
    (`ServiceModel.rate_prime`) and $g_{ij}$: one compiled call instead of dozens of small
    dispatches (each compiled on first use)."""
    N = jnp.asarray(N, jnp.float64)
    F, fp = jax.jvp(lambda M: cost.destination(scn, M), (N,), (jnp.ones_like(N),))
    return F, fp, scn.service.rate_prime(N), cost.arc(scn)


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
    d = lin.dim
    k, r, c, p, q = lin.entries()
    val = p + float(eta) * q
    tmax = float(lin.delays[-1])
    if tmax == 0.0:
        A = np.zeros((d, d))
        np.add.at(A, (r, c), val)
        return A
    M = int(nodes)
    D = chebyshev_differentiation(M, tmax)
    L = np.stack([lagrange_row(M, tmax, -t) for t in lin.delays])  # (K+1, M+1)
    G = np.kron(D, np.eye(d))
    G[:d] = 0.0
    # row block 0: G[i, m d + j] = sum_k L[k, m] A_k[i, j], from the nonzeros of the A_k
    cols = np.arange(M + 1)[None, :] * d + c[:, None]
    np.add.at(G, (np.repeat(r, M + 1), cols.ravel()), (L[k] * val[:, None]).ravel())
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
        self.entries = lin.entries()
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
            s, ok = _newton_root(lin, ev[m], eta, entries=self.entries)
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


def _newton_root(lin: Linearisation, s0: complex, eta: float, *, iters: int = 30, entries=None):
    """Newton on $\\Delta(s)v = 0$, $v_0^H v = 1$ from $s_0$ (bordered system); returns the
    refined root and whether it converged."""
    d = lin.dim
    ent = lin.entries() if entries is None else entries
    _, _, Vh = np.linalg.svd(_delta(ent, lin.delays, d, s0, eta)[0])
    v = Vh[-1].conj()
    c = v.conj()
    s = complex(s0)
    J = np.zeros((d + 1, d + 1), dtype=complex)
    J[d, :d] = c
    step = np.full(d + 1, np.inf, dtype=complex)
    # A step that strays far left overflows exp(-s theta); that is detected just below
    # (non-finite s) and the unrefined root is kept, so the warnings carry no information.
    with np.errstate(over="ignore", invalid="ignore"):
        for _ in range(iters):
            Delta, dDelta = _delta(ent, lin.delays, d, s, eta)
            J[:d, :d] = Delta
            J[:d, d] = dDelta @ v
            F = np.concatenate([Delta @ v, [c @ v - 1.0]])
            if not np.all(np.isfinite(J)):
                return s0, False
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
# Any network, large: characteristic loci of the cell characteristic matrix
# ----------------------------------------------------------------------------------------


class _Unreliable(RuntimeError):
    """`_Loci.count` cannot tell the eigenvalues of $H$ from rounding errors near $1/\\eta$."""


class _Loci:
    """Eigenvalues $\\nu_k(\\omega)$ of $H(i\\omega) = -\\mathrm{diag}(1/(i\\omega(i\\omega +
    \\mu'_j)))\\,M(i\\omega)$ on a growing grid of frequencies (theory/stability.md §3.6).

    $T(s) = s\\,\\mathrm{diag}(s+\\mu')\\,(I - \\eta H(s))$, so $s = i\\omega$ is a root at step
    size $\\eta$ iff $1/\\eta$ is an eigenvalue of $H(i\\omega)$. Only the cells of some support
    enter (the others have $M$'s rows and columns zero and roots $0, -\\mu'_j$). The grid is
    a cache: the eigenvalues do not depend on $\\eta$, every count reuses them and only adds
    frequencies where a count needs a finer grid.
    """

    def __init__(self, lin: Linearisation, *, per_decade: int = 24):
        cells = np.unique(np.concatenate([np.asarray(S, int) for S in lin.supports]))
        pos = np.full(lin.n_cells, -1)
        pos[cells] = np.arange(cells.size)
        src = np.asarray(lin.sources, int)
        mask = np.zeros((src.size, cells.size), bool)
        for r, S in enumerate(lin.supports):
            mask[r, pos[np.asarray(S)]] = True
        self.cells = cells
        self.mask = mask
        self.tau = np.where(mask, lin.arc_delay[np.ix_(src, cells)], 0.0)
        self.cw = lin.step_weights[src] * lin.arrival_rate[src]  # w_i lam_i
        self.c = self.cw / mask.sum(axis=1)  # w_i lam_i / |S_i|
        self.a = lin.rate_prime[cells]
        self.fp = lin.cost_prime[cells]
        self.tmax = float(self.tau.max(initial=0.0))
        # rank of the inflow map = the number of loci that start at +i*infinity (§3.6)
        self.rank = lin._inflow_rank()
        # |H(iw)|_inf <= max_j R_j / (w sqrt(w^2 + a_j^2)), R = |G| f', |G| >= |M| / f'
        # entrywise with G = sum_i w_i lam_i |E_i P_i E_i| (independent of w)
        absG = (mask.T * self.c) @ mask
        absG[np.diag_indices_from(absG)] += (self.cw * (1.0 - 2.0 / mask.sum(1))) @ mask
        self.R = absG @ self.fp
        self.per_decade = int(per_decade)
        self.omega = np.zeros(0)
        self.nu = np.zeros((0, cells.size), complex)
        self.floor = np.zeros(0)
        self.links = [np.zeros((0, cells.size), t) for t in (int, float, int, float) * 2]
        # the lowest frequency: well below the scales 1/tau and mu' of the loci (a count
        # lowers it if the loci are not yet in their asymptotic regime there)
        self.eps = 1e-3 * min(1.0 / max(self.tmax, 1e-300), float(np.min(self.a)))

    # -- the matrices ------------------------------------------------------------------
    def _E(self, s):
        return np.where(self.mask[None], np.exp(-s[:, None, None] * self.tau[None]), 0.0)

    def cell_matrix(self, s, eta, *, derivatives: bool = False):
        """$T(s)$ for an array `s` of `(G,)` complex frequencies (`(G, m, m)` on the support
        cells); with `derivatives`, also $T'(s)$ and $M(s)$."""
        s = np.asarray(s, complex)
        M = self._M(s)
        T = float(eta) * M
        idx = np.arange(self.cells.size)
        T[:, idx, idx] += s[:, None] * (s[:, None] + self.a)
        if not derivatives:
            return T
        E = self._E(s)
        dE = -self.tau[None] * E
        dq = np.einsum("i,gij->gj", 2.0 * self.cw, E * dE)
        CE = self.c[None, :, None] * E
        dU = np.swapaxes(dE, 1, 2) @ CE + np.swapaxes(CE, 1, 2) @ dE
        dM = -dU
        dM[:, idx, idx] += dq
        dT = float(eta) * dM * self.fp
        dT[:, idx, idx] += 2.0 * s[:, None] + self.a
        return T, dT, M

    def _M(self, s):
        E = self._E(s)
        q = np.einsum("i,gij->gj", self.cw, E * E)
        M = -(np.swapaxes(E, 1, 2) @ (self.c[None, :, None] * E))
        idx = np.arange(self.cells.size)
        M[:, idx, idx] += q
        return M * self.fp

    def H(self, omega):
        s = 1j * np.asarray(omega, float)
        return -self._M(s) / (s[:, None] * (s[:, None] + self.a))[:, :, None]

    # -- the grid ----------------------------------------------------------------------
    @_on_one_blas_thread
    def add(self, omega) -> None:
        """Eigenvalues at the new frequencies `omega`, merged into the grid, and the
        nearest-neighbour links of every new interval (`_link`)."""
        omega = np.setdiff1d(np.asarray(omega, float), self.omega)
        if not omega.size:
            return
        out = np.empty((omega.size, self.cells.size), complex)
        floor = np.empty(omega.size)
        chunk = max(1, int(2**22 // max(self.cells.size**2 + self.mask.size, 1)))
        for a in range(0, omega.size, chunk):
            H = self.H(omega[a : a + chunk])
            ev = np.linalg.eigvals(H)
            # eigenvalues below the rounding level of |H| are zeros (the cells' own modes)
            fl = NOISE * np.linalg.norm(H, axis=(1, 2))
            out[a : a + chunk] = np.where(np.abs(ev) < fl[:, None], 0.0, ev)
            floor[a : a + chunk] = fl
        old = self.omega
        allw = np.concatenate([old, omega])
        order = np.argsort(allw)
        self.omega = allw[order]
        self.nu = np.concatenate([self.nu, out])[order]
        self.floor = np.concatenate([self.floor, floor])[order]
        new = order >= old.size
        G, m = self.omega.size, self.cells.size
        links = [np.zeros((G - 1, m), t) for t in (int, float, int, float) * 2]
        fresh = new[:-1] | new[1:]
        keep = np.nonzero(~fresh)[0]
        if keep.size:
            src = np.searchsorted(old, self.omega[keep])
            for dst, prev in zip(links, self.links):
                dst[keep] = prev[src]
        redo = np.nonzero(fresh)[0]
        for a in range(0, redo.size, 64):
            g = redo[a : a + 64]
            for dst, val in zip(links, self._link(self.nu[g], self.nu[g + 1])):
                dst[g] = val
        self.links = links

    @staticmethod
    def _link(A, B):
        """Nearest and second-nearest neighbours between the eigenvalues `A` at one end of
        an interval and `B` at the other: `(nn_b, gap_b, nn2_b, gap2_b, nn_a, gap_a, nn2_a,
        gap2_a)`, `nn_b[k]` the index in `A` nearest to `B[k]` and `gap_b[k]` its distance,
        `nn2_b`, `gap2_b` the runner-up (and the converse for `A`)."""
        out = []
        for D in (np.abs(B[:, :, None] - A[:, None, :]), np.abs(A[:, :, None] - B[:, None, :])):
            if D.shape[2] < 2:
                idx = np.zeros(D.shape[:2] + (2,), int)
            else:
                idx = np.argpartition(D, 1, axis=2)[:, :, :2]
            gap = np.take_along_axis(D, idx, axis=2)
            swap = gap[:, :, 1] < gap[:, :, 0]
            first = np.where(swap, idx[:, :, 1], idx[:, :, 0])
            second = np.where(swap, idx[:, :, 0], idx[:, :, 1])
            g1, g2 = np.min(gap, axis=2), np.max(gap, axis=2)
            if D.shape[2] < 2:
                g2 = np.full_like(g1, np.inf)
            out += [first, g1, second, g2]
        return out

    def top(self, nu0: float) -> float:
        """A frequency above which every $|\\nu_k(\\omega)| < \\nu_0/2$."""
        return float(np.max(np.sqrt(2.0 * self.R / nu0)))

    def cover(self, top: float) -> None:
        """Extend the grid to $[\\varepsilon, \\text{top}]$: `per_decade` logarithmic points,
        and steps of at most $0.25/\\tau_{max}$ (the phase $e^{-2i\\omega\\tau}$ turns by at
        most half a radian between neighbours)."""
        lo = self.eps if not self.omega.size else self.omega[-1]
        if self.omega.size and lo >= top:
            return
        k = max(2, int(math.ceil(self.per_decade * math.log10(top / lo))) + 1)
        grid = np.geomspace(lo, top, k)
        h = 0.25 / self.tmax
        fine = grid[np.nonzero(np.diff(grid) > h)[0]]
        if fine.size:
            grid = np.union1d(grid, np.arange(fine[0], top, h))
        self.add(grid)

    def count(self, eta: float):
        """The number $Z$ of characteristic roots in the open right half-plane at step size
        `eta`, and the grid intervals where a locus crosses the ray $(1/\\eta, \\infty)$
        (argument principle, theory/stability.md §3.6). Raises `RuntimeError` if the grid
        does not start in the asymptotic regime."""
        nu0 = 1.0 / float(eta)
        top = self.top(nu0)
        self.cover(top)
        while True:
            g = int(np.searchsorted(self.omega, top)) + 1
            nn_b, gap_b, nn2_b, gap2_b, nn_a, gap_a, nn2_a, gap2_a = (
                v[: g - 1] for v in self.links
            )
            f = nu0 - self.nu[:g]
            arg, dist = np.angle(f), np.abs(f)
            rows = np.arange(g - 1)[:, None]
            # every locus moves less than half its distance to nu0 (its phase by < pi/6)...
            loose = np.maximum(np.max(gap_b / dist[1:], axis=1), np.max(gap_a / dist[:-1], axis=1))
            # ...and the crossings of the ray counted from either end agree (they can
            # differ only where nearest neighbours do not pair up one to one)
            jump_b = np.round((arg[1:] - arg[:-1][rows, nn_b]) / (2.0 * math.pi))
            jump_a = np.round((arg[1:][rows, nn_a] - arg[:-1]) / (2.0 * math.pi))
            per = jump_b.sum(axis=1).astype(int)
            odd = per != jump_a.sum(axis=1)
            # ...and no pairing is in doubt (a runner-up within twice the distance of the
            # nearest neighbour) where the two candidates would count differently
            alt_b = np.round((arg[1:] - arg[:-1][rows, nn2_b]) / (2.0 * math.pi))
            alt_a = np.round((arg[1:][rows, nn2_a] - arg[:-1]) / (2.0 * math.pi))
            doubt = ((gap2_b < 2.0 * gap_b) & (alt_b != jump_b)).any(1)
            doubt |= ((gap2_a < 2.0 * gap_a) & (alt_a != jump_a)).any(1)
            bad = np.nonzero((loose > 0.5) | odd | doubt)[0]
            wa, wb = self.omega[bad], self.omega[bad + 1]
            bad = bad[wb - wa > 1e-13 * wb]
            if not bad.size:
                break
            self.add(0.5 * (self.omega[bad] + self.omega[bad + 1]))
        if np.max(self.floor[:g]) > 0.05 * nu0:
            raise _Unreliable(
                f"characteristic loci: eigenvalues of H(i omega) carry rounding errors up to "
                f"{np.max(self.floor[:g]):.3g}, not small against 1/eta = {nu0:.3g} (cells "
                "near saturation, mu' ~ 0); use method='pseudospectral'"
            )
        start = np.sum(arg[0]) + 0.5 * math.pi * self.rank
        if abs(start) > 0.25 * math.pi:
            if self.eps > 1e-9 * self.omega[-1]:
                lower = self.eps
                self.eps *= 1e-2
                self.add(np.geomspace(self.eps, lower, 2 * self.per_decade + 1)[:-1])
                return self.count(eta)
            raise RuntimeError(
                f"characteristic loci at omega = {self.omega[0]:.3g} are not in the "
                f"asymptotic regime (phase offset {start:.3g}); use method='pseudospectral'"
            )
        # a locus crossing the ray jumps by 2 pi in the principal argument of nu0 - nu
        return int(2 * per.sum()), np.nonzero(per)[0]

    def crossing_guess(self, eta: float, intervals):
        """$(\\omega_0, v_0)$: the mid frequency of the crossing interval whose locus is
        closest to $1/\\eta$, and that eigenvector of $H(i\\omega_0)$."""
        nu0 = 1.0 / eta
        best = None
        for g in intervals:
            w = 0.5 * (self.omega[g] + self.omega[g + 1])
            with _one_blas_thread():
                ev, V = np.linalg.eig(self.H(np.array([w]))[0])
            k = int(np.argmin(np.abs(ev - nu0)))
            dist = abs(ev[k] - nu0)
            if best is None or dist < best[0]:
                best = (dist, w, V[:, k])
        if best is None:
            raise ValueError("crossing_guess needs at least one crossing interval")
        return best[1], best[2]

    @_on_one_blas_thread
    def hopf(self, eta0: float, omega0: float, v0: np.ndarray, iters: int = 40):
        """Newton's method on $T(i\\omega; \\eta)v = 0$, $c^Hv = 1$ in the real unknowns
        $(\\mathrm{Re}\\,v, \\mathrm{Im}\\,v, \\omega, \\eta)$; returns `(eta, omega, ok)`."""
        m = self.cells.size
        v = v0 / np.vdot(v0, v0) ** 0.5
        cH = v.conj()
        w, eta = float(omega0), float(eta0)
        A = np.zeros((2 * m + 2, 2 * m + 2))
        A[2 * m, :m], A[2 * m, m : 2 * m] = cH.real, -cH.imag
        A[2 * m + 1, :m], A[2 * m + 1, m : 2 * m] = cH.imag, cH.real
        for _ in range(iters):
            T, dT, M = (a[0] for a in self.cell_matrix(np.array([1j * w]), eta, derivatives=True))
            F = T @ v
            g = cH @ v - 1.0
            col_w = 1j * (dT @ v)
            col_e = M @ v
            A[:m, :m], A[:m, m : 2 * m] = T.real, -T.imag
            A[m : 2 * m, :m], A[m : 2 * m, m : 2 * m] = T.imag, T.real
            A[:m, 2 * m], A[m : 2 * m, 2 * m] = col_w.real, col_w.imag
            A[:m, 2 * m + 1], A[m : 2 * m, 2 * m + 1] = col_e.real, col_e.imag
            rhs = -np.concatenate([F.real, F.imag, [g.real, g.imag]])
            try:
                step = np.linalg.solve(A, rhs)
            except np.linalg.LinAlgError:
                return eta, w, False
            v = v + step[:m] + 1j * step[m : 2 * m]
            w, eta = w + step[2 * m], eta + step[2 * m + 1]
            if not (math.isfinite(w) and math.isfinite(eta) and w > 0 and eta > 0):
                return eta0, omega0, False
            if abs(step[2 * m]) <= 1e-15 * w and abs(step[2 * m + 1]) <= 1e-15 * eta:
                return eta, w, True
        return eta, w, bool(abs(step[2 * m + 1]) <= 1e-11 * eta)


# ----------------------------------------------------------------------------------------
# Critical step size
# ----------------------------------------------------------------------------------------


class StabilityResult(eqx.Module):
    """The outcome of `critical_step_size`.

    **Fields:**
    - `critical_step_size`: $\\eta^*$ (`inf`: stable for every step size; `0`: unstable even
      for vanishing steps).
    - `method`: `"symmetric"`, `"pseudospectral"` or `"nyquist"`.
    - `rightmost_root`: the rightmost characteristic root at $\\eta^*$ ($\\approx i\\omega_c$;
      `nan` when there is no crossing).
    - `crossing_frequency`: $\\omega_c$ (rad/s); `period`: $2\\pi/\\omega_c$ (s).
    - `nodes`: Chebyshev nodes $M$ used (0 for the closed form and for `"nyquist"`).
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
            "neutral_directions": lin.n_neutral,
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


class _Steps:
    """Progress of the crossing search on stderr (`dlbfluid._progress.Progress`): one unit
    per stability test; the total is re-estimated once the bracket is known."""

    def __init__(self, enabled: bool, label: str, total: int):
        self.bar = Progress(label, total, enabled=enabled, unit="tests") if enabled else None
        self.done = 0

    def __call__(self, note: str = "") -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.total = max(self.bar.total, self.done + 1)
            self.bar.update(self.done, note)

    def expect(self, more: int) -> None:
        if self.bar is not None:
            self.bar.total = self.done + max(int(more), 1)

    def finish(self) -> None:
        if self.bar is not None:
            self.bar.total = self.done
            self.bar.update(self.done, "done")


def _initial_guess(lin: Linearisation) -> float:
    """$\\eta_0 = K^*(a, \\tau)/(\\lambda f')$ of the closed form (§2) with the smallest
    $a = \\mu'_j$, half the longest delay and the largest gain $\\lambda_i f'_j$ of the
    supports: the symmetric scaling, right to a small factor where one pair dominates."""
    tmax = float(lin.delays[-1])
    gain = max(
        float(lin.arrival_rate[i] * lin.cost_prime[list(S)].max())
        for i, S in zip(lin.sources, lin.supports)
    )
    a = min(float(lin.rate_prime[list(S)].min()) for S in lin.supports)
    if not (tmax > 0 and a > 0 and gain > 0 and math.isfinite(gain)):
        return 0.03 / (max(tmax, 1e-3) * max(gain, 1e-12))
    return symmetric_critical_gain(a, 0.5 * tmax) / gain


def _bracket(unstable, eta0: float):
    """`(lo, hi)` with `unstable(lo)` False and `unstable(hi)` True, by doubling/halving
    from `eta0`; `(inf, inf)` if still stable at $2^{80}\\eta_0$, `(0, 0)` if unstable at
    $2^{-80}\\eta_0$."""
    lo = hi = eta0
    if not unstable(eta0):
        for _ in range(80):
            hi = 2.0 * lo
            if unstable(hi):
                return lo, hi
            lo = hi
        return math.inf, math.inf
    for _ in range(80):
        lo = 0.5 * hi
        if not unstable(lo):
            return lo, hi
        hi = lo
    return 0.0, 0.0


def _bisect_eta(spec: _Spectrum, eta0: float, rtol: float, steps: _Steps):
    """The first sign change of $\\alpha(\\eta)$: bracket by doubling/halving from `eta0`,
    then Brent's method on $\\alpha$ (a bisection on its sign with superlinear steps).
    Returns `inf` if still stable at $2^{80}\\eta_0$, `0` if unstable at $2^{-80}\\eta_0$."""

    def f(eta):
        a = spec.abscissa(eta)
        steps(f"eta {eta:.6g}: abscissa {a:.3g}")
        return a

    lo, hi = _bracket(lambda eta: f(eta) >= 0, eta0)
    if lo == hi:
        return lo
    steps.expect(12)
    return scipy.optimize.brentq(f, lo, hi, xtol=1e-300, rtol=rtol, maxiter=200)


def _nyquist_eta(lin: Linearisation, eta0: float, rtol: float, steps: _Steps):
    """$\\eta^*$ and the crossing root by the argument principle on the cell characteristic
    matrix (theory/stability.md §3.6): bracket as `_bisect_eta` on "some root in the right
    half-plane" (`_Loci.count`), bisect to $10^{-7}$, then Newton's method on the Hopf
    system $T(i\\omega;\\eta)v = 0$; bisection continues to `rtol` if Newton leaves the
    bracket."""
    if float(lin.delays[-1]) == 0.0:
        # Without delays V = sum_j f'_j dN_j^2/2 + sum_i lam_i |w_i|^2/(2 eta_i) has
        # V' = -sum_j f'_j mu'_j dN_j^2 <= 0: stable for every step size (§3.6).
        return math.inf, _NO_ROOT
    loci = _Loci(lin)
    last: dict = {}

    def unstable(eta):
        # Rounding hides the loci near 1/eta only above some eta (1/eta small against the
        # loci at low frequency): such a step size counts as unstable, so that the bracket
        # moves down, and an answer that rests on it is refused below.
        try:
            Z, where = loci.count(eta)
        except _Unreliable as e:
            last[eta] = e
            steps(f"eta {eta:.6g}: unresolved")
            return True
        last[eta] = where
        steps(f"eta {eta:.6g}: {Z} unstable roots, {loci.omega.size} frequencies")
        return Z > 0

    lo, hi = _bracket(unstable, eta0)
    if lo == hi:
        return lo, _NO_ROOT
    rough = max(rtol, 1e-7)
    steps.expect(math.ceil(math.log2(math.log(hi / lo) / math.log1p(rough))) + 1)
    while hi / lo - 1.0 > rough:
        mid = math.sqrt(lo * hi)
        if unstable(mid):
            hi = mid
        else:
            lo = mid
    if isinstance(last[hi], _Unreliable):
        raise RuntimeError(f"{last[hi]} (the crossing lies above eta = {lo:.6g})")
    w0, v0 = loci.crossing_guess(hi, last[hi])
    eta, w, ok = loci.hopf(hi, w0, v0)
    if ok and lo * (1.0 - 1e-9) <= eta <= hi * (1.0 + 1e-9):
        return eta, complex(0.0, w)
    while hi / lo - 1.0 > rtol:
        mid = math.sqrt(lo * hi)
        if unstable(mid):
            hi = mid
        else:
            lo = mid
    w, _ = loci.crossing_guess(hi, last[hi])
    return hi, complex(0.0, w)


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
    progress: bool = False,
    time: float = 0.0,
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
      between two identical cells over equal delays), `"pseudospectral"` (any network; a
      dense eigenproblem of size $(M+1)d$ per test), `"nyquist"` (any network; the
      argument principle on the $n \\times n$ cell characteristic matrix, §3.6), or
      `"auto"`: the closed form when the structure allows it, else the pseudospectral
      method up to $(M+1)d \\le$ `AUTO_PSEUDOSPECTRAL_SIZE`, else `"nyquist"`.
    - `nodes`: Chebyshev nodes $M$ of the pseudospectral discretisation.
    - `tau_scale`, `step_weights`, `equilibrium`: as in `linearise`.
    - `rtol`: relative tolerance of the bisection in $\\eta$.
    - `progress`: report the stages and the stability tests on stderr.
    - `time`: arrival rates $\\lambda_i(\\texttt{time})$ (as in `linearise`).

    **Returns:** a `StabilityResult`.

    **Raises:** `ValueError` naming the field for a discrete/random policy, an unknown
    method, `method="symmetric"` on a network without the symmetric structure, bad
    `nodes`; `RuntimeError` where `"nyquist"` cannot resolve the characteristic loci
    (cells at saturation with the crossing at a large step size, §3.6).
    """
    pol = _flow_policy(policy)
    if method not in METHODS:
        raise ValueError(f"method = {method!r} is invalid: allowed methods are {list(METHODS)}")
    nodes = _check_nodes(nodes)
    say = _say if progress else (lambda msg: None)
    if equilibrium is None:
        say(f"stability: solving the {pol.cost.name} equilibrium ({scenario.n_cells} cells)")
    lin = linearise(
        scenario,
        pol,
        tau_scale=tau_scale,
        step_weights=step_weights,
        equilibrium=equilibrium,
        time=time,
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
        label = "nyquist" if method == "nyquist" else "pseudospectral"
        return _result(lin, pol, math.inf, label, _NO_ROOT, nodes, tau_scale)
    if sym is not None and method in ("auto", "symmetric"):
        a, fp, lam, tau = sym
        eta = symmetric_critical_step_size(a, fp, lam, tau)
        root = complex(0.0, _omega_c(a, eta * lam * fp)) if math.isfinite(eta) else _NO_ROOT
        return _result(lin, pol, eta, "symmetric", root, 0, tau_scale)
    if method == "auto":
        small = (nodes + 1) * lin.dim <= AUTO_PSEUDOSPECTRAL_SIZE
        method = "pseudospectral" if small else "nyquist"
    say(
        f"stability: linearised, {lin.dim} states, {len(lin.sources)} routing sources, "
        f"{lin.delays.size} delays; {method} crossing search"
    )
    eta0 = _initial_guess(lin)
    steps = _Steps(progress, f"stability ({method})", 8)
    if method == "nyquist":
        eta, root = _nyquist_eta(lin, eta0, rtol, steps)
        steps.finish()
        return _result(lin, pol, eta, "nyquist", root, 0, tau_scale)
    spec = _Spectrum(lin, nodes)
    eta = _bisect_eta(spec, eta0, rtol, steps)
    root = _NO_ROOT
    if math.isfinite(eta) and eta > 0:
        ev = spec.roots(eta)
        top = ev[np.abs(ev.real - ev[0].real) <= 1e-8 * (1.0 + abs(ev[0]))]
        root = complex(top[np.argmax(top.imag)])
    steps.finish()
    return _result(lin, pol, eta, "pseudospectral", root, nodes, tau_scale)


def step_size_ratio(
    scenario: Scenario, policy, step_size: float, *, equilibrium=None, time: float = 0.0
) -> dict:
    """How many times the critical step size a flow-routing step size is: the plausibility
    check of `simulate` (a step size far beyond $\\eta^*$ gives an oscillating run).

    $X = \\eta/\\eta^*$ with $\\eta^*$ the exact critical step size of the linearised delay
    equation (`critical_step_size(..., method="nyquist", rtol=1e-6)`, theory/stability.md
    §3.6), at the equilibrium of the policy's cost. Accuracy: $\\eta^*$ to $10^{-6}$
    relative for the continuous-time model ($h \\to 0$); the tick model with
    $\\eta h \\ll 1$ changes stability within a few per cent of it (§4). It says nothing
    about $X < 1$ beyond local stability.

    **Cost:** one `solve_equilibrium` (a compile of about 12 s on first use per cost and
    cell bucket, cached by the command line's persistent compilation cache; milliseconds
    when `equilibrium` is given), one compiled call for the slopes, then NumPy: about
    0.2 s for 4 cells, 1 s for 25, 20-60 s for 200 (dense $n \\times n$ eigenvalues on a
    few hundred frequencies).

    **Arguments:** `scenario` (one unbatched `Scenario`), `policy` (a flow policy: a name of
    `_flow_names()` or a `FlowRouting`), `step_size` $\\eta > 0$ (the `simulate` convention),
    `equilibrium` (a precomputed `EquilibriumSolution` of the policy's cost), `time` (the
    arrival rates of the equilibrium).

    **Returns:** `{"step_size": eta, "critical_step_size": eta* (None when stable for every
    step size), "ratio": eta/eta* (0.0 then), "method": "nyquist" (or "pseudospectral"
    where rounding hides the characteristic loci, `_Loci.count`)}`.

    **Raises:** `ValueError` for a policy without a step size (discrete, random, MNLB) or a
    bad `step_size`; `OverloadError` when the demand has no equilibrium within capacity.
    """
    pol = _flow_policy(policy)
    eta = float(step_size) if isinstance(step_size, (int, float, np.floating)) else math.nan
    if not (math.isfinite(eta) and eta > 0):
        raise ValueError(f"step_size = {step_size!r} is invalid: expected a finite number > 0")
    if equilibrium is None:
        equilibrium = solve_equilibrium(scenario, pol.cost, time=time)
    kw = dict(equilibrium=equilibrium, rtol=1e-6, time=time)
    try:
        res = critical_step_size(scenario, pol, method="nyquist", **kw)
    except RuntimeError:
        # loci that rounding hides (cells at saturation): the pseudospectral method, if small
        lin = linearise(scenario, pol, equilibrium=equilibrium, time=time)
        if (DEFAULT_NODES + 1) * lin.dim > 10 * AUTO_PSEUDOSPECTRAL_SIZE:
            raise
        res = critical_step_size(scenario, pol, method="pseudospectral", **kw)
    star = res.critical_step_size
    return {
        "step_size": eta,
        "critical_step_size": star if math.isfinite(star) else None,
        "ratio": eta / star if math.isfinite(star) else 0.0,
        "method": res.method,
    }


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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
