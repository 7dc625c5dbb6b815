"""`Fast`: RK4 across the segments of each tick (theory/discretisation.md, *Fast path*)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .._results import RESULTS
from .._scenario.arrivals import rate_slope
from .._shapes import lead
from .base import AbstractIntegrator, TickResult, arc_integrals, scaled_rate


def _arc_pieces(scn, tk, tau, r, h, xprev, xcur):
    """The inflow of every arc during the tick as two linear pieces in local time $s$.

    Arc $(i,j)$ delivers $x^{prev}_{ij}\\lambda_i(t_k - \\tau_{ij} + s)$ for $s < r_{ij}$ and
    $x^{cur}_{ij}\\lambda_i(\\cdot)$ after. Each piece is the linear function with the exact
    mass of its half ($\\int\\lambda_i$ over it, `arc_integrals`) and the slope of
    $\\lambda_i$ at its midpoint: exact wherever $\\lambda_i$ is linear across the half, and
    exact in mass always. Returns the coefficients $(\\alpha, \\beta)$ of
    $\\alpha + \\beta s$ before and after the switch, each stacked `(2, n, n)`.

    Stacked, the pieces are two arrays that XLA materialises; as four elementwise results
    it fused their arithmetic into `_cumulative`'s $O(n^3)$ loop over the observation
    queries and redid it for every router (App.-B, 20 cells, batch 200: 21.5 -> 14.8 us
    per scenario-tick in float64, 23.8 -> 10.9 in float32; 10 cells 3.68 -> 3.47 and
    2.83 -> 2.74).
    """
    base = tk - tau
    P = arc_integrals(scn, base, base + r)
    Q = arc_integrals(scn, base + r, base + h)
    slope = jax.vmap(rate_slope, in_axes=(0, 0, -2), out_axes=-2)
    sp = slope(scn.arrival_times, scn.arrival_rates, base + 0.5 * r)
    sq = slope(scn.arrival_times, scn.arrival_rates, base + 0.5 * (r + h))
    lp = jnp.where(r > 0, P / jnp.where(r > 0, r, 1.0), 0.0)  # mean rate of the first half
    lq = Q / (h - r)
    before = jnp.stack([xprev * (lp - sp * 0.5 * r), xprev * sp])
    after = jnp.stack([xcur * (lq - sq * 0.5 * (r + h)), xcur * sq])
    return before, after


def _inflow(before, after):
    """The coefficients of every cell's cumulative inflow (`_cumulative`) from its arcs'
    pieces (`_arc_pieces`, `(2, n, n)` each): the sums over sources of the pieces after the
    switch, and the differences before less after, `(n,)`, `(n,)`, `(n, n)`, `(n, n)`."""
    S, d = jnp.sum(after, axis=-2), before - after
    return S[0], S[1], d[0], d[1]


def _cumulative(coef, r, s):
    """The cumulative inflow $A_j(s) = \\int_0^s a_j$ of every cell at local times `s`
    `(..., n)` (the cell axis last), in closed form: by time $s$ arc $(i,j)$ has delivered
    $\\alpha^{cur} s + \\beta^{cur} s^2/2 + \\Delta\\alpha\\,m + \\Delta\\beta\\,m^2/2$
    with $m = \\min(s, r_{ij})$ and $\\Delta = $ before less after the switch. A sum over
    sources for each query, $O(n)$, with no sorting or gathering: compares, multiplies and
    one reduction, which vectorise."""
    Sa, Sb, da, db = (lead(v, s.ndim + v.ndim - 1) for v in coef)
    m = jnp.minimum(s[..., None, :], lead(r, s.ndim + 1))  # [..., source, cell]
    return Sa * s + 0.5 * Sb * s * s + jnp.sum(m * (da + 0.5 * db * m), axis=-2)


class Fast(AbstractIntegrator):
    """RK4 across each tick with the inflow integrated exactly (theory/discretisation.md,
    *Fast path*).

    Inside a tick the inflow of cell $j$ changes only where one of its arcs switches
    routing, at $t_k + r_{ij}$, and is linear between switches (`_arc_pieces`). Its
    integral $A_j(s)$ is therefore a piecewise quadratic that the sorted switch times give
    exactly (`_cumulative`). Each of the `substeps` equal steps of a tick is an RK4 step
    whose stage states use that exact inflow, $N + A(s) - s\\,\\mu$, so jumps of the routing
    inside the step cost no accuracy of the inflow; the departures are the RK4 sum of the
    stage rates, and $N_{k+1} = N_k + A - D$ holds to rounding. The observation
    $N_j(t_k + h - r_{ij})$ is $N$ at the step start plus the exact inflow minus the integral
    of the quadratic through the step's service rates (at the start, the mean of the two
    midpoint stages, and the end), which reproduces the step's departures at its end.

    **Fields:** `substeps`, the RK4 steps per tick (`None`, the default: chosen per
    scenario from its cells' time scale, `steps_per_tick`); `max_rate_step` (0.5), the
    largest $\\mu'_{max}h/M$ allowed then; `max_substeps`, set by `for_batch` (the most any
    scenario of the batch needs: the compiled loop's length; a scenario needing fewer steps
    skips the rest, so its result does not depend on the batch it is in).

    Work per tick and cell: four service-rate evaluations per sub-step and the $O(n)$
    inflow sweep; errors (measured in tests/test_simulate.py and
    benchmarks/bench_simulate.py) are those of RK4 where the routing is smooth and of
    order $h^3$ where it jumps.
    """

    substeps: int | None = None
    max_rate_step: float = 0.5
    max_substeps: int = 1

    def __check_init__(self):
        M = self.substeps
        if M is not None and (not isinstance(M, int) or isinstance(M, bool) or M < 1):
            raise ValueError(f"substeps = {M!r} is invalid: expected an integer >= 1 or None")
        v = self.max_rate_step
        if isinstance(v, bool) or not (isinstance(v, (int, float)) and 0 < v <= 2.0):
            raise ValueError(f"max_rate_step = {v!r} is invalid: expected 0 < value <= 2")
        K = self.max_substeps
        if not isinstance(K, int) or isinstance(K, bool) or K < 1:
            raise ValueError(f"max_substeps = {K!r} is invalid: expected an integer >= 1")

    def steps_per_tick(self, scn, h, xp=jnp):
        """$M = \\lceil h\\,\\mu'_{max}/$ `max_rate_step` $\\rceil$ (at least 1) with
        $\\mu'_{max} = \\max_j\\mu_j'(0)$ the fastest relaxation rate of the scenario's cells
        (concave $\\mu$: $\\mu'$ is largest at 0), so that a coarse tick is still integrated
        stably and accurately; one step at the paper's probe cadence. Leading axes of `scn`
        (a batch) are kept; `xp=np` evaluates on the host."""
        mask = scn.cell_mask
        # (on the host, `rate_prime` is one compiled program with the eager numbers)
        fastest = scn.service.rate_prime(xp.zeros(np.shape(mask), scn.latency.dtype))
        if xp is np:
            fastest, mask = np.asarray(fastest), np.asarray(mask)
        rho = xp.max(xp.where(mask, fastest, 0.0), axis=-1)
        rho = xp.where(xp.isfinite(rho), rho, 0.0)
        # (the small guard keeps an exact ratio, e.g. 8.0, from rounding up to 9)
        return xp.maximum(xp.ceil(h * rho / self.max_rate_step - 1e-9), 1.0).astype(xp.int32)

    def for_batch(self, scn, tick: float) -> Fast:
        """`substeps=None`: the compiled loop's length, the most steps per tick any scenario
        of the batch needs (`steps_per_tick`, host side)."""
        if self.substeps is not None:
            return self
        M = int(np.max(self.steps_per_tick(scn, tick, xp=np), initial=1))
        return Fast(max_rate_step=self.max_rate_step, max_substeps=max(M, 1))

    def tick(self, scn, setup, tk, N, xprev, xcur, c, speed) -> TickResult:
        h, tau, r, offsets = setup.h, setup.tau, setup.r, setup.offsets
        n = N.shape[0]
        dtype = N.dtype
        coef = _inflow(*_arc_pieces(scn, tk, tau, r, h, xprev, xcur))
        A = lambda t: _cumulative(coef, r, t)  # noqa: E731
        total = A(jnp.full((n,), h, dtype))
        rate = scaled_rate(scn.service, c, speed)
        cap = scn.buffer * c  # a cell running c k_j servers holds c B_j
        clip = lambda v: jnp.minimum(v, cap)  # noqa: E731
        # Steps: a fixed number, or this scenario's own M <= max_substeps (then the steps
        # past M leave the state as it is).
        M: int | jax.Array
        if self.substeps is not None:
            M, loop = self.substeps, self.substeps
        elif self.max_substeps == 1:
            M, loop = 1, 1
        else:
            M = jnp.minimum(self.steps_per_tick(scn, h), self.max_substeps)
            loop = self.max_substeps
        static = isinstance(M, int)
        sel = (lambda on, a, b: a) if static else jnp.where  # noqa: E731
        dt = h / (M if isinstance(M, int) else M.astype(dtype))
        Ns, m1, A0 = N, rate(N), jnp.zeros_like(N)
        arrs = deps = drops = jnp.zeros_like(N)
        area = jnp.zeros((), dtype)
        knots = []  # per sub-step: start time, start state, inflow before, three rates
        for p in range(loop):  # (static and small)
            on = True if static else p < M
            s0 = jnp.full((n,), p * dt, dtype)
            last = p + 1 == M
            if static:
                A1 = total if last else A(s0 + dt)
            else:
                A1 = jnp.where(last, total, A(s0 + dt))
            Am = A(s0 + 0.5 * dt)
            N2 = clip(Ns + (Am - A0) - 0.5 * dt * m1)
            m2 = rate(N2)
            N3 = clip(Ns + (Am - A0) - 0.5 * dt * m2)
            m3 = rate(N3)
            N4 = clip(Ns + (A1 - A0) - dt * m3)
            m4 = rate(N4)
            D = dt / 6.0 * (m1 + 2.0 * m2 + 2.0 * m3 + m4)
            Nn = Ns + (A1 - A0) - D
            # A full queue drops what it cannot hold (a projection onto N <= B, exact in mass).
            drop = jnp.maximum(Nn - cap, 0.0)
            Nn = Nn - drop
            knots.append((p * dt, Ns, A0, m1, 0.5 * (m2 + m3), m4))
            area = sel(on, area + jnp.sum(dt / 6.0 * (Ns + 2.0 * N2 + 2.0 * N3 + N4)), area)
            arrs = sel(on, arrs + (A1 - A0), arrs)
            deps = sel(on, deps + D, deps)
            drops = sel(on, drops + drop, drops)
            Ns, A0 = sel(on, Nn, Ns), sel(on, A1, A0)
            if p + 1 < loop:
                m1 = sel(on, rate(Ns), m1)
        # Observations: the sub-step holding o (static M: a select over the sub-steps).
        o = offsets  # (n routers, n cells)
        A_obs = A(o)
        p_of = jnp.clip(jnp.floor(o / dt).astype(jnp.int32), 0, M - 1)  # (M: this scenario's)
        obs = jnp.zeros_like(o)
        for p, (t0, N0, A0, r0, rm, r1) in enumerate(knots):
            u = jnp.clip((o - t0) / dt, 0.0, 1.0)  # local time in units of dt
            # departures: the integral from 0 to u of the quadratic through (0, r0),
            # (1/2, rm), (1, r1), times dt
            q0, q1 = r0[None, :], (-3.0 * r0 + 4.0 * rm - r1)[None, :]
            q2 = (2.0 * r0 - 4.0 * rm + 2.0 * r1)[None, :]
            dep = dt * (q0 * u + 0.5 * q1 * u * u + q2 * u * u * u / 3.0)
            val = N0[None, :] + (A_obs - A0[None, :]) - dep
            obs = jnp.where(p_of == p, val, obs)
        obs = jnp.clip(obs, 0.0, cap[None, :])
        return TickResult(
            N=Ns,
            observed=obs,
            arrivals=arrs,
            departures=deps,
            workload_integral=area,
            drops=drops,
            status=jnp.asarray(RESULTS.success),
        )
