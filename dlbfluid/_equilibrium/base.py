"""The stage family of the equilibrium solver and what its two members share."""

from __future__ import annotations

import abc

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .problem import _Problem
from .state import SolverState

_TINY = 1e-300
_HUGE = 1e300


class AbstractStage(eqx.Module):
    """A stage of `EquilibriumSolver`: a loop that runs `step` while `active`. Tunables are
    fields (static: a solver with other values is another compiled program)."""

    @abc.abstractmethod
    def active(self, st: SolverState, tol) -> Array:
        """Whether the scenario is (still) in this stage."""

    @abc.abstractmethod
    def step(self, pb: _Problem, st: SolverState, tol, max_iters) -> SolverState:
        """One pass of the stage."""


class Linearised(eqx.Module):
    """The optimality system at the current point, shared by both stages' Newton steps
    (theory/equilibria.md §3.2).

    **Fields:** `z` cell flows; `act` the arcs of the system; `fed` cells with an arc in
    it; `N` workloads (0 on cells without one); `F`, `dF` the destination cost and its
    slope; `h`, `hN`, `ell` the flow balance $h(N, z)$, $\\partial_N h$ and $\\ell$; `c` route
    costs; `cbar`, `cs` cost levels (`_Problem.levels`); `ysafe` the flows (1 off `A`)
    and `iy` their reciprocals; `s` the duals (estimated on the first pass); `red` the
    reduced costs $c_{ij} - \\nu_i$; `rp` the demand residual; `Pt` each cell's curvature
    $f'\\ell/\\partial_Nh$ (clipped) and `Pmax` the largest on `fed`; `i_s` $1/s$.
    """

    z: Float[Array, " n"]
    act: Bool[Array, "n n"]
    fed: Bool[Array, " n"]
    N: Float[Array, " n"]
    F: Float[Array, " n"]
    dF: Float[Array, " n"]
    h: Float[Array, " n"]
    hN: Float[Array, " n"]
    ell: Float[Array, " n"]
    c: Float[Array, "n n"]
    cbar: Float[Array, " n"]
    cs: Float[Array, ""]
    w: Float[Array, "n n"]
    ysafe: Float[Array, "n n"]
    iy: Float[Array, "n n"]
    s: Float[Array, "n n"]
    red: Float[Array, "n n"]
    rp: Float[Array, " n"]
    Pt: Float[Array, " n"]
    Pmax: Float[Array, ""]
    i_s: Float[Array, "n n"]


def linearise(pb: _Problem, st: SolverState, *, interior: bool) -> Linearised:
    """`Linearised` at the state's point. The interior point keeps $N = \\mu^{-1}(z)$ exact
    and works on every arc of `A`, with barrier weights from the current cost levels;
    the polish carries $N$ as an unknown on its support `st.act`, to which arcs of
    clearly negative reduced cost are added."""
    A, src, g, lam = pb.A, pb.src, pb.g, pb.lam
    p = st.point
    y, s, nu, N, w, tau = p.y, p.s, p.nu, p.N, p.w, st.tau
    z = jnp.sum(jnp.where(A, y, 0.0), axis=0)
    # (cells left without active arcs have z = 0 and so N = 0 exactly)
    act = A if interior else st.act
    fed = jnp.any(act, axis=0)
    N = jnp.where(fed, N, 0.0)
    Fc, h, hN, ell, dF = pb.cells(N, z)
    c = Fc[None, :] + g
    cbar, cs = pb.levels(c)
    if interior:
        w = jnp.where(A, (pb.lsrc * cbar)[:, None], 0.0)
    ysafe = jnp.where(A, y, 1.0)
    # Reciprocals of the flows (and below of the duals), formed once per pass: the
    # divisions over the (n, n) arcs are the most expensive elementwise work.
    iy = 1.0 / ysafe
    # First pass: dual estimates from the starting point.
    s = jnp.where(st.fresh, jnp.where(A, tau * w * iy, 0.0), s)
    red = c - nu[:, None]
    if not interior:
        # (an arc the last pass dropped may not rejoin at once: a support that cannot
        # keep it would otherwise drop and re-add it for ever)
        act = act | (A & (red < -1e-9 * cbar[:, None]) & ~st.banned)
    rp = jnp.where(src, jnp.sum(jnp.where(act, y, 0.0), axis=1) - lam, 0.0)
    Pt = jnp.clip(dF * ell / jnp.maximum(hN, _TINY), _TINY, _HUGE)
    Pmax = jnp.max(jnp.where(fed, Pt, 0.0))
    i_s = 1.0 / jnp.where(A, s, 1.0)
    return Linearised(
        z=z, act=act, fed=fed, N=N, F=Fc, dF=dF, h=h, hN=hN, ell=ell, c=c, cbar=cbar, cs=cs,
        w=w, ysafe=ysafe, iy=iy, s=s, red=red, rp=rp, Pt=Pt, Pmax=Pmax, i_s=i_s,
    )  # fmt: skip
