"""The linearised delay equation of flow routing around an equilibrium (theory/stability.md §1).

Around an equilibrium $(N^*, x^*)$ of the cost family of a flow-routing policy
(`solve_equilibrium`), the delayed dynamics of theory/model.md linearise to

$$\\dot y(t) = A_0 y(t) + \\sum_{k=1}^{K} A_k\\, y(t - \\theta_k),\\qquad
A_k = P_k + \\eta\\, R_k,$$

with state $y = (\\delta N, w)$: the workload deviations of the $n$ cells and, for every
source $i$ with $\\lambda_i > 0$ whose equilibrium support $S_i = \\{j: x^*_{ij} > 0\\}$ has at
least two cells, coordinates $w_i \\in \\mathbb R^{|S_i|-1}$ of the routing deviation
$\\delta x_i = B_i w_i$ in an orthonormal basis $B_i$ of the tangent space
$\\{d: \\sum_{j \\in S_i} d_j = 0\\}$. The delays $\\theta_k$ are the distinct one-way latencies
$\\tau_{ij}$ of support arcs; the step size $\\eta$ enters only the routing rows ($R_k$).

One home for the slopes: `local_gain` computes $\\mu_j'(N^*_j)$, $f_j'(N^*_j)$, the supports
and the degenerate arcs of one scenario in `jnp`; `linearise` (host, one scenario) calls it
jitted and builds the `Linearisation`, `loop_gain` vmaps it over a batch (`LoopGain`, the
feedback form that `batch_critical_step_size` uses). `CellLoop` is the $n \\times n$ cell
characteristic matrix $T(s)$ of §3.6 on the host.
"""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from .._costs import cost_from_name
from .._defaults import FLOW_POLICIES
from .._equilibrium import solve_equilibrium
from .._policies import AbstractPolicy, FlowRouting, policy_from_name
from .._precision import require_x64
from .._registry import flow_policy_names
from .._scenario import Scenario
from .._validate import number


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
        loop = CellLoop(self)
        T = np.zeros((self.n_cells, self.n_cells), complex)
        c = loop.cells
        s = complex(s)
        T[np.ix_(c, c)] = loop.cell_matrix(np.array([s]), eta)[0]
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


class CellLoop:
    """The cell characteristic matrix $T(s) = s\\,\\mathrm{diag}(s+\\mu') + \\eta M(s)$ and
    $H(i\\omega) = -\\mathrm{diag}(1/(i\\omega(i\\omega + \\mu'_j)))\\,M(i\\omega)$ on the cells of
    some support (theory/stability.md §3.6), NumPy, for arrays of frequencies;
    $M(s) = \\sum_i w_i\\lambda_i E_i(s)P_iE_i(s)\\,\\mathrm{diag}(f')$. The other cells have
    $M$'s rows and columns zero and roots $0, -\\mu'_j$.

    **Attributes:** `cells` (the support cells, sorted), `mask` `(sources, cells)` the
    supports, `tau` their delays, `cw` $w_i\\lambda_i$, `c` $w_i\\lambda_i/|S_i|$, `a`
    $\\mu'$, `fp` $f'$ (on `cells`), `tmax` the longest support delay.
    """

    def __init__(self, lin: Linearisation):
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


class LoopGain(eqx.Module):
    """The feedback form of the linearisation at an equilibrium (`local_gain`; batched by
    `loop_gain`, with a leading axis `B`).

    **Fields:**
    - `rate_prime`: `(B, n)` $\\mu_j'(N_j^*)$ (1 on padded cells).
    - `cost_prime`: `(B, n)` $f_j'(N_j^*)$ (1 on padded cells).
    - `weight`: `(B, n)` $c_i = \\lambda_iw_i$ for routing sources (support of two or more
      cells), else 0.
    - `support`: `(B, n, n)` arcs $(i, j)$ with $j \\in S_i$ of routing sources.
    - `delay`: `(B, n, n)` $\\tau_{ij}$ on support arcs, 0 elsewhere.
    - `step_weights`: `(B, n)` the relative steps $w_i$ (already inside `weight`).
    - `arrival_rate`: `(B, n)` $\\lambda_i$ (0 on padded cells).
    - `degenerate`: `(B, n, n)` allowed arcs of sources with demand that carry no flow yet
      have zero reduced cost $c_{ij}(N^*) - \\min_k c_{ik}(N^*)$ (to $10^{-7}$ relative).
    """

    rate_prime: Float[Array, "B n"]
    cost_prime: Float[Array, "B n"]
    weight: Float[Array, "B n"]
    support: Bool[Array, "B n n"]
    delay: Float[Array, "B n n"]
    step_weights: Float[Array, "B n"]
    arrival_rate: Float[Array, "B n"]
    degenerate: Bool[Array, "B n n"]


def local_gain(cost, s: Scenario, N, x, w, tol, time) -> LoopGain:
    """The linearisation of one unbatched scenario at its equilibrium `N`, `x` (`jnp`,
    traceable; theory/stability.md §1): $\\mu_j' =$ `ServiceModel.rate_prime`,
    $f_j' =$ `AbstractCost.derivative` (`jax.jvp` of the destination cost), the supports
    $S_i = \\{j: x^*_{ij} > \\text{tol}\\}$ of sources with $\\lambda_i(\\text{time}) > 0$ (routing
    sources: two or more cells), and the degenerate arcs. `linearise` and `loop_gain` both
    call this function."""
    mask = s.cell_mask
    N = jnp.where(mask, N, 0.0)
    lam = jnp.where(mask, s.arrival_rate(time), 0.0)
    F, fp = jax.jvp(lambda M: cost.destination(s, M), (N,), (jnp.ones_like(N),))
    mp = s.service.rate_prime(N)
    allowed = s.allowed & mask[:, None] & mask[None, :]
    sup = allowed & (x > tol) & (lam[:, None] > 0)
    routing = jnp.sum(sup, axis=1) >= 2
    sup = sup & routing[:, None]
    # Reduced costs c_ij - min_k c_ik at N*: zero on the support; an allowed arc with zero
    # flow *and* zero reduced cost is degenerate (the projection is not smooth there).
    c = jnp.where(allowed, F[None, :] + cost.arc(s), jnp.inf)
    cmin = jnp.min(c, axis=1, keepdims=True)
    finite = jnp.isfinite(cmin)
    reduced = jnp.where(allowed, c - jnp.where(finite, cmin, 0.0), jnp.inf)
    scale = jnp.maximum(jnp.abs(jnp.where(finite, cmin, 1.0)), 1.0)
    degenerate = allowed & (lam[:, None] > 0) & (x <= tol) & (reduced <= 1e-7 * scale)
    return LoopGain(
        rate_prime=jnp.where(mask, mp, 1.0),
        cost_prime=jnp.where(mask, fp, 1.0),
        weight=jnp.where(routing, lam * w, 0.0),
        support=sup,
        delay=jnp.where(sup, s.latency, 0.0),
        step_weights=w,
        arrival_rate=lam,
        degenerate=degenerate,
    )


_one_gain = eqx.filter_jit(local_gain)


@eqx.filter_jit
def _batch_gain(cost, scn, N, x, w, tol, time):
    return jax.vmap(local_gain, in_axes=(None, 0, 0, 0, 0, None, None))(
        cost, scn, N, x, w, tol, time
    )


def loop_gain(
    scenario, cost, equilibrium, *, step_weights=None, support_tol: float = 1e-9, time=0.0
) -> LoopGain:
    """`LoopGain` of a batch (`stack_scenarios`) at its equilibria (`N`, `x` of shape
    `(B, n)`, `(B, n, n)`): `local_gain` vmapped, the quantities `linearise` uses."""
    cost = cost_from_name(cost)
    N = jnp.asarray(equilibrium.N)
    x = jnp.asarray(equilibrium.x)
    w = jnp.ones_like(N) if step_weights is None else jnp.asarray(step_weights, N.dtype)
    w = jnp.broadcast_to(w, N.shape)
    tol = jnp.asarray(support_tol, N.dtype)
    return _batch_gain(cost, scenario.strip(), N, x, w, tol, jnp.asarray(time, N.dtype))


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
    so the projection keeps them at 0 for small deviations. The slopes, supports and
    degenerate arcs come from `local_gain`, the same compiled function that `loop_gain`
    vmaps for the batched critical step size (one linearisation for both).

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
    number("tau_scale", tau_scale, lo=0)
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
    w = np.ones(n) if step_weights is None else np.asarray(step_weights, dtype=float)
    if w.shape != (n,) or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"step_weights = {step_weights!r} is invalid: expected {n} numbers > 0")

    wfull = np.ones(scn.n_cells)
    wfull[:n] = w
    tol, t = jnp.asarray(support_tol, jnp.float64), jnp.asarray(time, jnp.float64)
    gain = _one_gain(pol.cost, scn.strip(), equilibrium.N, equilibrium.x, wfull, tol, t)
    gain = jax.tree_util.tree_map(np.asarray, gain)
    support = gain.support[:n, :n]
    sources = [int(i) for i in np.nonzero(support.any(axis=1))[0]]
    supports = [tuple(int(j) for j in np.nonzero(support[i])[0]) for i in sources]
    degenerate = tuple((int(i), int(j)) for i, j in zip(*np.nonzero(gain.degenerate[:n, :n])))
    arcs = [(i, j) for i, Si in zip(sources, supports) for j in Si]
    delays = np.unique(np.array([0.0] + [tau[i, j] for i, j in arcs]))
    return Linearisation(
        delays=delays,
        n_cells=n,
        sources=tuple(sources),
        supports=tuple(supports),
        rate_prime=gain.rate_prime[:n],
        cost_prime=gain.cost_prime[:n],
        arrival_rate=gain.arrival_rate[:n],
        arc_delay=tau,
        step_weights=w,
        N=Nstar,
        x=xstar,
        degenerate_arcs=degenerate,
    )


def scale_delays(scenario: Scenario, tau_scale: float) -> Scenario:
    """The scenario with every latency $\\tau_{ij}$ multiplied by `tau_scale`."""
    if tau_scale == 1.0:
        return scenario
    return dataclasses.replace(scenario, latency=scenario.latency * float(tau_scale))
