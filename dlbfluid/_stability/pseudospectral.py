"""The pseudospectral method (Breda-Maset-Vermiglio; the method of DDE-BIFTOOL;
theory/stability.md §3.1-3.5).

Chebyshev collocation of the infinitesimal generator of the delay equation
(`generator_matrix`), eigenvalues of the resulting matrix with the neutral constant states
deflated (`Spectrum`), Newton refinement on the characteristic matrix $\\Delta(s)$, and
Brent's method in $\\eta$ on the spectral abscissa (`bisect_eta`). A dense eigenproblem of
size $(M+1)d$ per test: the reference method for small networks (`Pseudospectral`, the
member of the method family).
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import scipy.linalg
import scipy.optimize

from .._defaults import STABILITY_NODES as DEFAULT_NODES
from .._scenario import Scenario
from .._validate import integer
from .base import NO_ROOT, AbstractStabilityMethod
from .linearisation import Linearisation, _delta, linearise
from .search import Steps, begin, bracket
from .threads import on_one_blas_thread


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


class Spectrum:
    """`generator_matrix` as $G_0 + \\eta G_1$, deflated of the neutral constant states:
    with $X = \\mathbf 1 \\otimes E$ (`Linearisation.neutral`, $GX = 0$ exactly because
    $D\\mathbf 1 = 0$ and $\\sum_k A_k E = 0$) and $Y$ an orthonormal basis of $X^\\perp$,
    the other eigenvalues are those of $Y^\\top G Y$ (block triangular form)."""

    @on_one_blas_thread
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

    @on_one_blas_thread
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
    return Spectrum(lin, check_nodes(nodes)).roots(float(eta), refine)


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
    return Spectrum(lin, check_nodes(nodes)).abscissa(float(step_size))


def check_nodes(nodes) -> int:
    """The pseudospectral nodes, an integer >= 2."""
    return integer("nodes", nodes, 2)


def bisect_eta(spec: Spectrum, eta0: float, rtol: float, steps: Steps):
    """The first sign change of $\\alpha(\\eta)$: bracket by doubling/halving from `eta0`,
    then Brent's method on $\\alpha$ (a bisection on its sign with superlinear steps).
    Returns `inf` if still stable at $2^{80}\\eta_0$, `0` if unstable at $2^{-80}\\eta_0$."""

    def f(eta):
        a = spec.abscissa(eta)
        steps(f"eta {eta:.6g}: abscissa {a:.3g}")
        return a

    lo, hi = bracket(lambda eta: f(eta) >= 0, eta0)
    if lo == hi:
        return lo
    steps.expect(12)
    return scipy.optimize.brentq(f, lo, hi, xtol=1e-300, rtol=rtol, maxiter=200)


class Pseudospectral(AbstractStabilityMethod):
    """Chebyshev collocation with `nodes` $= M$ nodes and Brent's method on the spectral
    abscissa (theory/stability.md §3.1-3.5; `Spectrum`, `bisect_eta`)."""

    name: ClassVar[str] = "pseudospectral"
    nodes: int = DEFAULT_NODES

    def __check_init__(self):
        check_nodes(self.nodes)

    @classmethod
    def named(cls, nodes: int) -> Pseudospectral:
        return cls(nodes=nodes)

    def solve(self, lin: Linearisation, symmetric, *, rtol: float, progress: bool):
        eta0, steps = begin(lin, self.name, progress)
        spec = Spectrum(lin, self.nodes)
        eta = bisect_eta(spec, eta0, rtol, steps)
        root = NO_ROOT
        if math.isfinite(eta) and eta > 0:
            ev = spec.roots(eta)
            top = ev[np.abs(ev.real - ev[0].real) <= 1e-8 * (1.0 + abs(ev[0]))]
            root = complex(top[np.argmax(top.imag)])
        steps.finish()
        return eta, root, self.name, self.nodes

    def no_crossing(self) -> tuple[str, int]:
        return self.name, self.nodes
