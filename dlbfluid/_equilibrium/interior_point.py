"""Stage 1 of the equilibrium solver: a primal-dual barrier method (theory/equilibria.md §3.1)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .base import _TINY, AbstractStage, linearise
from .linalg import _schur, _step_to_boundary, _step_to_boundary_inv
from .problem import _Problem
from .state import Iterate, SolverState


class InteriorPoint(AbstractStage):
    """Stage 1: a primal barrier method with primal-dual Hessians.

    For a barrier weight $\\tau$ it minimises $\\phi_\\tau(y) = \\Psi(y) - \\tau\\sum_{(i,j)\\in A}
    w_{ij}\\ln y_{ij}$ subject to $\\sum_j y_{ij} = \\lambda_i$, with weights $w_{ij} =
    \\lambda_i\\bar c_i$ (demand times the cost level $\\bar c_i = \\min_j c_{ij}$ of the source,
    so that every source approaches its support at the same relative rate). The workloads
    are always exact, $N = \\mu^{-1}(z)$, so $F_j(z_j)$ is itself a barrier at
    $z_j \\to \\bar\\mu_j$. Each iteration solves the Newton system $(\\nabla^2\\Psi + SY^{-1})
    \\Delta y - R^T\\Delta\\nu = -(\\nabla\\phi_\\tau - R^T\\nu)$, $R\\Delta y = -r^p$
    (`_newton_direction` with $E = y/s$; the duals start at $s = \\tau w/y$ and then take
    their own Newton step $\\Delta s = \\tau w/y - s - s\\Delta y/y$, at most 0.995 of the
    way to $s = 0$). For any $s > 0$ this is a descent direction of the merit
    $\\psi(\\alpha) = \\phi_\\tau(y + \\alpha\\Delta y) + \\rho(1-\\alpha)\\|r^p\\|_1$,
    $\\rho > \\|\\nu + \\Delta\\nu\\|_\\infty$; the step is at most 0.995 of the way to the
    boundary of $y \\ge 0$ and `capacity_fraction` of the way to $z \\le \\bar\\mu$ and halves
    until the trapezoid estimate of the decrease of $\\psi$ (from its slope alone, so no
    potential values are needed) passes Armijo's test. The weight $\\tau$ is chosen per
    iteration by a Mehrotra-type predictor: the affine-scaling direction (same factored
    Schur system) gives $\\mu_{aff}$, and $\\tau = \\sigma\\mu$ with $\\mu = \\sum ys/\\sum w$ and
    $\\sigma = (\\mu_{aff}/\\mu)^3$, floored at `kappa` times the relative demand residual.

    The stage ends when the point is feasible (relative demand residual below
    `feasibility`) with per-source duality gap $\\mu\\deg(i)$ and relative dual residual
    $|c - \\nu - s|/\\bar c$ (times `1/dual_factor`) below `switch_gap` on the first try and
    `gap` on the second, or when the line search fails, or after `max_iters` iterations.

    In the resumed round it also ends when it stalls: at feasible points, its convergence
    score (the larger of gap and dual residual, each over its target) has not halved for
    `stall_passes` passes.

    **Fields:** `switch_gap` (1e-6), `gap` (1e-10), `feasibility` (1e-8), `kappa` (0.1),
    `dual_factor` (1), `capacity_fraction` (0.8), `max_backtracks` (30), `stall_passes`
    (3).
    """

    switch_gap: float = 1e-6
    gap: float = 1e-10
    feasibility: float = 1e-8
    kappa: float = 0.1
    dual_factor: float = 1.0
    capacity_fraction: float = 0.8
    max_backtracks: int = 30
    stall_passes: int = 3

    def active(self, st: SolverState, tol):
        return st.phase == 0

    def step(self, pb: _Problem, st: SolverState, tol, max_iters) -> SolverState:
        A, src, lsrc = pb.A, pb.src, pb.lsrc
        L = linearise(pb, st, interior=True)
        y, nu, N = st.point.y, st.point.nu, L.N
        c, w, iy, s, i_s = L.c, L.w, L.iy, L.s, L.i_s
        E = jnp.where(A, L.ysafe * i_s, 0.0)
        sch = _schur(E, L.Pt, src)
        tau = self._barrier_weight(pb, L, y, sch)
        # Corrector: the barrier step at weight tau, same factors (the right-hand side
        # red - tau w / y is formed first: combining two solves would cancel).
        dy, dnu = sch.solve(jnp.where(A, L.red - tau * w * iy, 0.0), L.rp)
        bw = jnp.where(A, tau * w, 0.0)
        nun = nu + dnu
        a, Nt, ct, good, flat = self._line_search(pb, L, y, N, dy, bw, nun)
        y1 = jnp.where(good, jnp.where(A, y + a * dy, 0.0), y)
        N1 = jnp.where(good, Nt, N)
        rp_new = jnp.where(good, (1.0 - a) * L.rp, L.rp)
        feas = jnp.max(jnp.abs(rp_new) / lsrc) <= self.feasibility
        cbar1, _ = pb.levels(jnp.where(good, ct, c))
        w1 = jnp.where(A, (lsrc * cbar1)[:, None], 0.0)
        # Dual step of the primal-dual system: S dy + Y ds = tau w - Y S, at most 0.995 of
        # the way to s = 0 (also taken when the primal step is flat).
        ds = jnp.where(A, (bw - s * dy) * iy - s, 0.0)
        a_s = jnp.minimum(1.0, 0.995 * _step_to_boundary_inv(i_s, ds, A))
        s1 = jnp.where(good | flat, jnp.where(A, s + a_s * ds, 0.0), s)
        # Complementarity gap of the new point, per unit weight.
        tau1 = jnp.sum(jnp.where(A, y1 * s1, 0.0)) / (jnp.sum(w1) + _TINY)
        # Dual residual of the new point: its costs against the multipliers and duals.
        rd = jnp.max(jnp.where(A, jnp.abs(ct - nun[:, None] - s1), 0.0) * (1.0 / cbar1)[:, None])
        conv, better, score, stall = self._progress(pb, st, feas, tau1, rd)
        end = conv | ~(good | flat) | (st.it + 1 >= max_iters) | (stall >= self.stall_passes)
        sup = _support(A, y1, tau1, lsrc)
        nu1 = jnp.where(good, nun, nu)
        new = Iterate(y=y1, s=s1, nu=nu1, N=N1, w=w1)
        keep_now = end & conv
        keep = jax.tree_util.tree_map(lambda a, b: jnp.where(keep_now, a, b), new, st.keep)
        return dataclasses.replace(
            st,
            point=dataclasses.replace(new, y=jnp.where(end, jnp.where(sup, y1, 0.0), y1)),
            tau=tau1,
            it=st.it + 1,
            phase=jnp.where(end, 1, st.phase),
            # A stage 1 stopped by `max_iters` gets only the scoring pass of stage 2.
            capped=end & ~conv & (st.it + 1 >= max_iters),
            act=sup,
            fresh=jnp.asarray(False),
            converged=st.converged | conv,
            retry=st.retry & ~(end & ~conv),
            keep=keep,
            keep_tau=jnp.where(keep_now, tau1, st.keep_tau),
            score=jnp.where(better, score, st.score),
            stall=stall,
        )

    def _barrier_weight(self, pb: _Problem, L, y, sch):
        """The barrier weight $\\tau$ of this iteration, by a Mehrotra-type predictor: the
        affine-scaling direction (barrier weight 0) on the factored Schur system `sch`;
        $\\tau = \\sigma\\mu$ with $\\sigma = (\\mu_{aff}/\\mu)^3$ (theory/equilibria.md
        §3.1), floored at `kappa` times the relative demand residual."""
        A, cap, s, iy, z, fed = pb.A, pb.cap, L.s, L.iy, L.z, L.fed
        sw = jnp.sum(L.w) + _TINY
        mu = jnp.sum(jnp.where(A, y * s, 0.0)) / sw
        dy_a, _ = sch.solve(jnp.where(A, L.red, 0.0), L.rp)
        ds_a = jnp.where(A, -s - s * dy_a * iy, 0.0)
        ap = jnp.minimum(
            1.0,
            jnp.minimum(
                _step_to_boundary_inv(iy, dy_a, A),
                _step_to_boundary(cap - z, -jnp.sum(dy_a, axis=0), fed),
            ),
        )
        ad = jnp.minimum(1.0, _step_to_boundary_inv(L.i_s, ds_a, A))
        mu_a = jnp.sum(jnp.where(A, (y + ap * dy_a) * (s + ad * ds_a), 0.0)) / sw
        sigma = jnp.clip((jnp.maximum(mu_a, 0.0) / jnp.maximum(mu, _TINY)) ** 3, 0.0, 1.0)
        # Safeguard: the weight stays above a fraction of the relative demand residual, so
        # that complementarity cannot reach zero long before feasibility does.
        infeas = jnp.max(jnp.abs(L.rp) / pb.lsrc)
        return jnp.maximum(sigma * mu, jnp.minimum(mu, self.kappa * infeas))

    def _line_search(self, pb: _Problem, L, y, N, dy, bw, nun):
        """The barrier step along `dy` with a slope-only backtracking line search:
        `(step, workloads and costs there, whether it passed, whether no descent was left)`.
        The step starts at most 0.995 of the way to $y = 0$ and `capacity_fraction` of the
        way to $z = \\bar\\mu$ and halves until the trapezoid estimate of the merit's decrease
        passes Armijo's test (with room for the slope's rounding)."""
        A, src, g, lam, cap = pb.A, pb.src, pb.g, pb.lam, pb.cap
        z, fed, c, iy = L.z, L.fed, L.c, L.iy
        dz = jnp.sum(dy, axis=0)
        amax = jnp.minimum(
            1.0,
            jnp.minimum(
                0.995 * _step_to_boundary_inv(iy, dy, A),
                self.capacity_fraction * _step_to_boundary(cap - z, -dz, fed),
            ),
        )
        rho = 2.0 * jnp.max(jnp.where(src, jnp.abs(nun), 0.0)) + L.cs
        rp1 = jnp.sum(jnp.abs(L.rp))
        d0 = jnp.minimum(jnp.sum(jnp.where(A, (c - bw * iy) * dy, 0.0)) - rho * rp1, 0.0)
        # Armijo through the trapezoid rule, with room for the rounding error of the slope
        # (near the barrier minimiser the slope is at the level of its own rounding).
        noise = 1e-12 * jnp.sum(jnp.where(A, jnp.abs(c * dy) + jnp.abs(bw * iy * dy), 0.0))
        thresh = -(1.0 - 4e-4) * d0 + noise
        # No descent left above the rounding level: the barrier problem is solved, so the
        # primal step is skipped (the duals still move).
        flat = d0 >= -noise

        def bt_cond(cr):
            _, da, _, _, k = cr
            return ~flat & (da > thresh) & (k < self.max_backtracks)

        # First-order prediction of the workloads along the step (warm start of the
        # inverse): dN = dz / mu'(N) on the flow balance.
        dN_lin = jnp.where(fed, L.ell * dz / jnp.maximum(L.hN, _TINY), 0.0)

        def bt_body(cr):
            a, _, _, _, k = cr
            a = jnp.where(k == 0, amax, 0.5 * a)
            yt = jnp.where(A, y + a * dy, 1.0)
            zt = jnp.sum(jnp.where(A, yt, 0.0), axis=0)
            Nt = jnp.where(fed, pb.scn.service.inverse_rate(zt, N + a * dN_lin), 0.0)
            ct = pb.cost.destination(pb.scn, Nt)[None, :] + g
            da = jnp.sum(jnp.where(A, (ct - bw / yt) * dy, 0.0)) - rho * rp1
            return a, jnp.where(jnp.isfinite(da), da, jnp.inf), Nt, ct, k + 1

        a, da, Nt, ct, _ = jax.lax.while_loop(
            bt_cond, bt_body, (amax, jnp.asarray(jnp.inf, lam.dtype), N, c, jnp.asarray(0))
        )
        return a, Nt, ct, (da <= thresh) & ~flat, flat

    def _progress(self, pb: _Problem, st: SolverState, feas, tau1, rd):
        """`(converged, better, score, stall count)` of the new point.

        Converged: feasible with per-source gap and dual residual below the target
        (`switch_gap` on the first try, `gap` on the second). Stall: near capacity the
        attainable dual residual can sit above the target (the costs of nearly saturated
        cells are steep in the flows), and the iterates then drift. In the resumed round
        (after a failed early polish), once the point is feasible its score (1 at
        convergence) must halve every `stall_passes` passes, or the stage hands over to
        the polish."""
        gap_tol = jnp.where(st.retry, self.switch_gap, self.gap)
        conv = feas & (tau1 * pb.deg <= gap_tol) & (rd <= self.dual_factor * gap_tol)
        watch = feas & ~st.retry
        score = jnp.where(
            watch,
            jnp.maximum(tau1 * pb.deg / gap_tol, rd / (self.dual_factor * gap_tol)),
            jnp.inf,
        )
        better = watch & (score < 0.5 * st.score)
        return conv, better, score, jnp.where(watch & ~better, st.stall + 1, 0)


def _support(A, y1, tau1, lsrc):
    """Support for stage 2: $y_{ij}/\\lambda_i$ against $s_{ij}/\\bar c_i$ (with
    $w = \\lambda_i\\bar c_i$ on $A$ this reads $y_{ij} \\ge \\sqrt{\\tau}\\lambda_i$), plus
    the largest arc of every source; everything else is switched off."""
    sup = A & (y1 >= jnp.sqrt(tau1) * lsrc[:, None])
    top = jnp.max(jnp.where(A, y1, -jnp.inf), axis=1)
    return sup | (A & (y1 >= top[:, None]))
