"""Stage 2 of the equilibrium solver: an active-set Newton polish (theory/equilibria.md §3.2)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from .base import _TINY, AbstractStage, linearise
from .linalg import _newton_direction, _step_to_boundary
from .problem import _Problem
from .state import SolverState


class ActiveSetPolish(AbstractStage):
    """Stage 2: Newton steps on the equality optimality system on the identified support.

    The support (set by the interior point) holds the arcs with $y_{ij}/\\lambda_i \\ge
    s_{ij}/\\bar c_i$ and the largest arc of every source. Each pass solves
    $f_j(N_j) + g_{ij} = \\nu_i$ (support), $\\sum_j y_{ij} = \\lambda_i$, $h_j(N_j, z_j) = 0$
    (the flow balance in the form of `ServiceModel.balance`, so no inverse is needed)
    through the same Schur system with $E_{ij} = 1/(\\epsilon\\tilde P_j)$, $\\epsilon$ = `reg`
    (a proximal term that only selects among equivalent flows on cycles of the support).
    Small flows that a step would drive negative leave the support without a step;
    otherwise a ratio test drops the first arc to reach zero; arcs with a clearly negative
    reduced cost join, except those dropped on the pass before (a support that cannot
    hold an arc would otherwise drop and re-add it for ever). The best point seen (smallest scaled residual) is kept; the stage
    stops after `iters` steps (plus one pass that scores the last point) or once that
    residual is below `done`. If the first polish, started at the interior point's
    `switch_gap`, ends above `retry * tol`, stage 1 resumes from the point it left, down to
    its full `gap` (theory/equilibria.md §3.1).

    Near capacity the identified support can hold more arcs than the equality system can
    satisfy (cycles whose round-trip costs do not cancel); the proximal weight of arc
    $(i,j)$ is then $\\epsilon\\tilde P_j + $ `damping` $|q_{ij}|/y_{ij}$, so such arcs move by
    about their own flow instead of by huge circulations (theory/equilibria.md §3.6).

    **Fields:** `iters` (24), `reg` (1e-9), `done` (1e-14), `retry` (1e-2), `damping` (1).
    """

    iters: int = 24
    reg: float = 1e-9
    done: float = 1e-14
    retry: float = 1e-2
    damping: float = 1.0

    def _pol(self, st: SolverState):
        # A stage 1 stopped by its iteration cap enters at the last pass: it only scores.
        return jnp.where(st.capped, jnp.maximum(st.pol, self.iters), st.pol)

    def active(self, st: SolverState, tol):
        # One more pass than there are polish steps: the last pass only scores its point.
        # Under vmap the loop runs until every scenario is done: a scenario whose polish
        # has reached rounding level stops early.
        return (st.phase == 1) & (self._pol(st) <= self.iters) & (st.best_m > self.done)

    def step(self, pb: _Problem, st: SolverState, tol, max_iters) -> SolverState:
        A, src, cap, lsrc = pb.A, pb.src, pb.cap, pb.lsrc
        L = linearise(pb, st, interior=False)
        p = st.point
        y, nu = p.y, p.nu
        N, z, fed, act, red, rp, h, hN, ell, dF, Pt, cbar = (
            L.N, L.z, L.fed, L.act, L.red, L.rp, L.h, L.hN, L.ell, L.dF, L.Pt, L.cbar
        )  # fmt: skip
        # (the proximal weight uses the curvature floored at 1e-6 of the largest, so that a
        # nearly flat cell, e.g. one of huge capacity, does not make E explode)
        q = jnp.where(act, red, 0.0)
        prox = self.reg * jnp.maximum(Pt, 1e-6 * L.Pmax)[None, :]
        if self.damping:
            prox = prox + self.damping * jnp.abs(q) / jnp.maximum(y, _TINY)
        E = jnp.where(act, 1.0 / prox, 0.0)
        shift = jnp.where(fed, -dF * h / jnp.maximum(hN, _TINY), 0.0)
        dy, dnu = _newton_direction(E, q + jnp.where(A, shift[None, :], 0.0), rp, Pt, src)
        dz = jnp.sum(dy, axis=0)
        dN = jnp.where(fed, (ell * dz - h) / jnp.maximum(hN, _TINY), 0.0)

        # Scaled residual of the current point, to keep the best one.
        m_cur = jnp.maximum(
            jnp.maximum(
                jnp.max(jnp.abs(jnp.where(act, red, 0.0)) / cbar[:, None]),
                jnp.max(jnp.abs(rp) / lsrc),
            ),
            jnp.maximum(
                jnp.max(jnp.where(fed, jnp.abs(h) / (N + z * ell + _TINY), 0.0)),
                jnp.max(jnp.where(A & ~act, -red / cbar[:, None], 0.0)),
            ),
        )
        better = m_cur < st.best_m
        neg = act & (y + dy < 0.0)
        small = neg & (y <= 1e-4 * lsrc[:, None])
        drop = jnp.any(small)
        a_dom = 0.9 * jnp.minimum(
            _step_to_boundary(cap - z, -dz, fed), _step_to_boundary(N, dN, fed)
        )
        a2 = jnp.where(
            drop, 0.0, jnp.minimum(1.0, jnp.minimum(_step_to_boundary(y, dy, act), a_dom))
        )
        y2 = jnp.where(act & ~small, y + a2 * dy, 0.0)
        act2 = act & ~small & (y2 > 0.0)
        y2 = jnp.where(act2, y2, 0.0)

        # Early polish that failed: resume stage 1 from the point it left (once).
        pol = self._pol(st)
        best_m = jnp.where(better, m_cur, st.best_m)
        back = st.retry & (pol >= self.iters) & (best_m > self.retry * tol)
        out = dataclasses.replace(
            st,
            point=dataclasses.replace(
                p, y=y2, nu=nu + a2 * dnu, N=jnp.where(fed, N + a2 * dN, 0.0)
            ),
            pol=pol + 1,
            ptot=st.ptot + 1,
            act=act2,
            banned=small,
            best_y=jnp.where(better, y, st.best_y),
            best_N=jnp.where(better, N, st.best_N),
            best_m=best_m,
            fresh=jnp.asarray(False),
            retry=st.retry & ~back,
        )
        resume = dataclasses.replace(
            out,
            point=st.keep,
            tau=st.keep_tau,
            phase=jnp.asarray(0),
            pol=jnp.asarray(0),
            act=A,
            score=jnp.asarray(jnp.inf, st.score.dtype),
            stall=jnp.asarray(0),
        )
        return _select(back, resume, out)


def _select(on, a, b):
    import jax

    return jax.tree_util.tree_map(lambda u, v: jnp.where(on, u, v), a, b)
