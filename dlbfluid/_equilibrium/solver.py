"""`EquilibriumSolver`: the two stages in order, one scenario or a compacted batch."""

from __future__ import annotations

import collections
import functools

import equinox as eqx
import jax
import jax.numpy as jnp

from .._results import RESULTS
from .._runtime.devices import per_device, solver_jit
from .interior_point import InteriorPoint
from .polish import ActiveSetPolish
from .problem import _certify, _make_problem, _Problem
from .state import Iterate, SolverState

_TINY = 1e-300

# Python-side count of traces of the batched solver, per cost (tests check recompiles).
_TRACES: collections.Counter = collections.Counter()


class EquilibriumSolver(eqx.Module):
    """The batched equilibrium solver (theory/equilibria.md §3): `interior_point` to a
    small duality gap, then `polish` to rounding level; a failed early polish resumes the
    interior point once (two rounds).

    **Fields:**
    - `interior_point`: an `InteriorPoint` (stage 1).
    - `polish`: an `ActiveSetPolish` (stage 2).
    - `compact_levels`: sub-batch sizes, as fractions of one device's batch, through which
      each stage's stragglers are compacted (`_compacted`).
    - `compact_min`: batches below this many scenarios per device are not compacted
      (compaction triples the compile time, about 5 to 15 s per cost on 2 CPU cores, which
      only pays on large batches).
    """

    interior_point: InteriorPoint = InteriorPoint()
    polish: ActiveSetPolish = ActiveSetPolish()
    compact_levels: tuple[int, ...] = (4, 16)
    compact_min: int = 128

    def init(self, pb: _Problem) -> SolverState:
        """Start: capacity-weighted routing, scaled so that every cell is at most half
        full; $N = \\mu^{-1}(z)$ exactly (stage 1 keeps it exact)."""
        A, lam, cap = pb.A, pb.lam, pb.cap
        w0 = jnp.where(A, cap[None, :], 0.0)
        x0 = w0 / jnp.maximum(jnp.sum(w0, axis=1, keepdims=True), _TINY)
        z0 = jnp.sum(lam[:, None] * x0, axis=0)
        ratio = jnp.where(z0 > 0, cap / jnp.where(z0 > 0, z0, 1.0), jnp.inf)
        t0 = jnp.minimum(1.0, 0.5 * jnp.min(ratio))
        y0 = jnp.where(A, t0 * lam[:, None] * x0, 0.0)
        zero_n = jnp.zeros_like(lam)
        N0 = jnp.where(jnp.any(A, axis=0), pb.scn.service.inverse_rate(jnp.sum(y0, axis=0)), 0.0)
        point = Iterate(y=y0, s=jnp.zeros_like(y0), nu=zero_n, N=N0, w=jnp.zeros_like(y0))
        one = jnp.asarray(1.0, lam.dtype)
        return SolverState(
            point=point,
            tau=one,
            phase=jnp.asarray(0),
            it=jnp.asarray(0),
            pol=jnp.asarray(0),
            ptot=jnp.asarray(0),
            capped=jnp.asarray(False),
            act=A,
            banned=jnp.zeros_like(A),
            best_y=y0,
            best_N=zero_n,
            best_m=jnp.asarray(jnp.inf, lam.dtype),
            fresh=jnp.asarray(True),
            converged=jnp.asarray(False),
            retry=jnp.asarray(True),
            keep=point,
            keep_tau=one,
            score=jnp.asarray(jnp.inf, lam.dtype),
            stall=jnp.asarray(0),
        )

    @property
    def stages(self):
        return (self.interior_point, self.polish)

    def postprocess(self, pb: _Problem, st: SolverState, tol) -> dict:
        """The certificate of the best point (`_certify`), the iteration count and the
        status: `success` when certified to `tol`; `nonfinite` for a converged run that
        still produced a non-finite value; `not_converged` otherwise (the interior point
        stopped early, or the certificate is above `tol`)."""
        cert = _certify(pb, st.best_y, st.best_N)
        cert["iterations"] = st.it + st.ptot
        status = jnp.where(
            cert["kkt_residual"] <= tol,
            RESULTS.success,
            jnp.where(~cert["finite"] & st.converged, RESULTS.nonfinite, RESULTS.not_converged),
        )
        cert.pop("finite")
        cert["status"] = status
        return cert

    def solve_one(self, scn, lam, tol, max_iters, cost) -> dict:
        """Interior point, then polish, then (only for scenarios whose early polish failed)
        both again, for one scenario."""
        pb = _make_problem(scn, lam, cost)

        def run(stage, st):
            return jax.lax.while_loop(
                lambda st: stage.active(st, tol), lambda st: stage.step(pb, st, tol, max_iters), st
            )

        def round_(_, st):
            for stage in self.stages:
                st = run(stage, st)
            return st

        # Two rounds, the second a no-op unless the early polish failed; one traced round
        # serves both (a `fori_loop`, as in `solve_local`), which halves the compile time.
        st = jax.lax.fori_loop(0, 2, round_, self.init(pb))
        return self.postprocess(pb, st, tol)

    def solve_local(self, scn, lam, tol, max_iters, cost) -> dict:
        """`solve_one` over a batch (one device's shard), with each stage's stragglers
        compacted (`_compacted`).

        Under `vmap` a convergence loop runs until its slowest scenario is done, and every
        pass costs the whole batch. The passes vary (on 10-cell networks, 10-21
        interior-point passes for the Wardrop cost, mean 14), so each stage runs on the full
        batch only while more than a quarter of it is still in that stage, then on a
        quarter-size sub-batch while more than a sixteenth is, then on a sixteenth-size one
        (`compact_levels`). Each scenario follows exactly the passes of `solve_one`; only
        the batch it shares a pass with changes.
        """
        B = lam.shape[0]
        if B < self.compact_min:
            return jax.vmap(lambda s, l: self.solve_one(s, l, tol, max_iters, cost))(scn, lam)
        sizes = tuple(max(B // f, 1) for f in self.compact_levels)

        def each(f):
            return jax.vmap(lambda s, l, *a: f(_make_problem(s, l, cost), *a))

        def run(stage):
            cond = lambda pb, st: stage.active(st, tol)  # noqa: E731
            step = lambda pb, st: stage.step(pb, st, tol, max_iters)  # noqa: E731
            return lambda st: _compacted(each, cond, step, (scn, lam), st, sizes)

        ipm, polish = run(self.interior_point), run(self.polish)
        st = each(lambda pb: self.init(pb))(scn, lam)
        # Two rounds, as in `solve_one`: the second only for scenarios whose early polish
        # failed (few: its loops go straight to the smallest sub-batch). One traced round
        # serves both, which halves the compile time.
        st = jax.lax.fori_loop(0, 2, lambda _, st: polish(ipm(st)), st)
        return each(lambda pb, st: self.postprocess(pb, st, tol))(scn, lam, st)


def _tree_where(on, new, old):
    return jax.tree_util.tree_map(
        lambda a, b: jnp.where(on.reshape(on.shape + (1,) * (a.ndim - 1)), a, b), new, old
    )


def _compacted(each, cond, step, args, st, sizes):
    """Run a stage (`step(pb, st)` while `cond(pb, st)`) to its end on every scenario of the
    batch `args = (scn, lam)`, compacting its stragglers.

    The batch makes passes only while more than `sizes[0]` of its scenarios are still in
    the stage; those left are gathered into a sub-batch of that size (padded with copies
    of a scenario that is not in the stage, on which no pass is made), which continues
    the same way with `sizes[1:]`, and the last one runs to the end. The results are
    scattered back. Each scenario makes exactly the passes it would make alone.
    """
    in_stage = each(cond)
    if not sizes:
        return each(
            lambda pb, st: jax.lax.while_loop(lambda s: cond(pb, s), lambda s: step(pb, s), st)
        )(*args, st)
    C = sizes[0]

    def one_pass(st):
        new = each(step)(*args, st)
        return _tree_where(in_stage(*args, st), new, st)

    st = jax.lax.while_loop(lambda st: jnp.sum(in_stage(*args, st)) > C, one_pass, st)
    todo = in_stage(*args, st)
    # at most C scenarios are left and at least one is not (C < batch): pad with that one
    idx = jnp.nonzero(todo, size=C, fill_value=jnp.argmin(todo))[0]
    sub_args, sub_st = jax.tree_util.tree_map(lambda a: a[idx], (args, st))
    sub_st = _compacted(each, cond, step, sub_args, sub_st, sizes[1:])
    return jax.tree_util.tree_map(lambda a, b: a.at[idx].set(b), st, sub_st)


def _solve_batch_impl(scn, lam, tol, max_iters, *, cost, solver):
    _TRACES[cost.name] += 1
    # tol and max_iters are closed over (replicated); only the batch is split per device,
    # so each device runs its own convergence loops (`per_device`).
    return per_device(
        functools.partial(solver.solve_local, tol=tol, max_iters=max_iters, cost=cost)
    )(scn, lam)


# The compiled batched solver, with the solvers' XLA options.
_solve_batch = solver_jit(_solve_batch_impl, certified=True, static_argnames=("cost", "solver"))
