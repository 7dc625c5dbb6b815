"""The delayed fluid model on a probe tick, integrated by a method of steps.

The model (theory/dynamics.md, theory-notes §1.3-§2):

* routing is piecewise constant on the tick grid $t_k = kh$: $x(t) = x^k$ on
  $[t_k, t_{k+1})$, and $x(t) = x^0$ for $t < 0$;
* at $t_{k+1}$ router $i$ observes $N_j(t_{k+1} - \\tau_{ij})$ and sets
  $x_i^{k+1} = U(x_i^k, \\hat c_i, \\eta_i h)$ (the policy);
* $\\dot N_j(t) = \\sum_i \\lambda_i(t-\\tau_{ij})\\, x_{ij}(t-\\tau_{ij}) - \\mu_j(N_j(t))$,
  $N(t) = N(0)$ for $t < 0$.

With $\\tau_{ij} = m_{ij}h + r_{ij}$, $0 \\le r_{ij} < h$, the inflow of arc $(i,j)$ during
tick $k$ is $x^{k-m_{ij}-1}_{ij}$ before $t_k + r_{ij}$ and $x^{k-m_{ij}}_{ij}$ after, and the
observation at $t_{k+1}$ is $N_j$ at offset $h - r_{ij}$ inside tick $k - m_{ij}$. So each tick
is an ODE with a known, piecewise-constant input: the method of steps needs only ring
buffers of past routings and of the workloads at those offsets. Two integrators:

* `Accurate` (diffrax Tsit5, PID error control; the solver steps exactly onto every inflow
  jump through `jump_ts` and saves the observation offsets from dense output);
* `Fast` (fixed-step RK4 on `substeps` sub-intervals, with the inflow integrated exactly
  over each sub-interval and cubic Hermite interpolation for the observations).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time

import diffrax as dfx
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._arrivals import rate_integral
from ._aversion import ErrorAversion, apply_aversion, aversion_update, ema_update
from ._costs import route_costs
from ._devices import per_device, shard_batch, solver_jit
from ._policies import AbstractPolicy, policy_from_name
from ._scenario import Scenario, replica_scale
from ._solution import STATUS, Solution

# ----------------------------------------------------------------------------------------
# Integrator configuration
# ----------------------------------------------------------------------------------------


class AbstractIntegrator(eqx.Module):
    """How the workload ODE is integrated across one tick."""


class Fast(AbstractIntegrator):
    """Fixed-step RK4 with `substeps` steps per tick; the arrival term is integrated exactly
    over each step (theory/discretisation.md). Global error $O((h/\\text{substeps})^2)$ where
    routing jumps, $O((h/\\text{substeps})^4)$ elsewhere."""

    substeps: int = 4

    def __check_init__(self):
        if not isinstance(self.substeps, int) or self.substeps < 1:
            raise ValueError(f"substeps = {self.substeps!r} is invalid: expected an integer >= 1")


class Accurate(AbstractIntegrator):
    """Adaptive Tsit5 with a PID step-size controller (diffrax), restarted at every tick and
    stepping exactly onto every inflow discontinuity."""

    rtol: float = 1e-8
    atol: float = 1e-10
    max_steps: int = 4096

    def __check_init__(self):
        for f in ("rtol", "atol"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{f} = {v!r} is invalid: expected a finite number > 0")


# ----------------------------------------------------------------------------------------
# One scenario (vmapped over the batch)
# ----------------------------------------------------------------------------------------


def _arc_integrals(scn: Scenario, a, b):
    """$\\int_a^b \\lambda_i$ for arrays `a`, `b` whose axis -2 is the source cell $i$."""
    fn = jax.vmap(rate_integral, in_axes=(0, 0, -2, -2), out_axes=-2)
    return fn(scn.arrival_times, scn.arrival_rates, a, b)


def _inflow_cumulative(scn, tk, s, m_r, xprev, xcur):
    """Inflow into each arc accumulated from $t_k$ to $t_k + s$; `s` has shape `(S,)`.

    $\\int_{t_k}^{t_k+s}\\lambda_i(u-\\tau)x_{ij}(u-\\tau)du$ = `xprev` over $[0, \\min(s,r)]$
    plus `xcur` over $[r, \\max(s, r)]$ (local time). Returns `(S, n, n)`.
    """
    tau, r = m_r
    base = tk - tau  # (n, n)
    s = s[:, None, None]
    lo1, hi1 = base, base + jnp.minimum(s, r)
    lo2, hi2 = base + r, base + jnp.maximum(s, r)
    lo1 = jnp.broadcast_to(lo1, hi1.shape)
    lo2 = jnp.broadcast_to(lo2, hi2.shape)
    return xprev * _arc_integrals(scn, lo1, hi1) + xcur * _arc_integrals(scn, lo2, hi2)


def _cell_inflow_between(scn, tk, s0, s1, m_r, xprev, xcur):
    """Inflow into cell $j$ over local times $[s0_{ij}, s1_{ij}]$ for every `(i, j)`.

    Entry `[i, j]` sums the arcs $(i', j)$ over sources $i'$; shape `(n, n)` (work $n^3$).
    """
    tau, r = m_r
    base = (tk - tau)[None]  # (1, i', j)
    r3 = r[None]
    a, b = s0[:, None, :], s1[:, None, :]  # (i, 1, j)

    def cum(s):
        lo1, hi1 = base, base + jnp.minimum(s, r3)
        lo2, hi2 = base + r3, base + jnp.maximum(s, r3)
        shape = jnp.broadcast_shapes(hi1.shape, hi2.shape)
        lo1, hi1, lo2, hi2 = (jnp.broadcast_to(v, shape) for v in (lo1, hi1, lo2, hi2))
        return xprev[None] * _arc_integrals(scn, lo1, hi1) + xcur[None] * _arc_integrals(
            scn, lo2, hi2
        )

    return jnp.sum(cum(b) - cum(a), axis=1)


def _rk4_cell_step(rate, N, A, dt, cap=None):
    """One RK4 step of $\\dot N = A/dt - \\mu(N)$ over a step of length `dt` with inflow
    mass `A` (elementwise; `dt` may be 0). Returns the new state, the departures of the step
    (so that $N_{new} = N + A - D$ exactly) and the RK4 quadrature of $\\int N\\,dt$.

    With a finite queue `cap` the stage states are clipped to it, so that a full queue
    serves at exactly $\\mu(B)$ (the caller drops the excess of the new state)."""
    safe = jnp.where(dt > 0, dt, 1.0)
    abar = jnp.where(dt > 0, A / safe, 0.0)
    clip = (lambda v: v) if cap is None else (lambda v: jnp.minimum(v, cap))
    m1 = rate(N)
    N2 = clip(N + 0.5 * dt * (abar - m1))
    m2 = rate(N2)
    N3 = clip(N + 0.5 * dt * (abar - m2))
    m3 = rate(N3)
    N4 = clip(N + dt * (abar - m3))
    m4 = rate(N4)
    dep = dt / 6.0 * (m1 + 2.0 * m2 + 2.0 * m3 + m4)
    area = dt / 6.0 * (N + 2.0 * N2 + 2.0 * N3 + N4)
    return N + A - dep, dep, area


def _scaled_rate(service, c):
    """$\\mu_j^{(c)}(N) = c_j\\,\\mu_j(N/c_j)$: a cell running $c_j k_j$ of its $k_j$ replicas
    with the load spread evenly (theory/evaluation.md, *Replicas*)."""
    return lambda N: c * service.rate(N / c)


def _tick_fast(scn, tk, h, N, xprev, xcur, m_r, offsets, substeps, c):
    M = substeps
    dt = h / M
    s = jnp.arange(M + 1, dtype=h.dtype) * dt
    G = _inflow_cumulative(scn, tk, s, m_r, xprev, xcur)  # (M+1, n, n)
    A = jnp.sum(G[1:] - G[:-1], axis=-2)  # (M, n): exact inflow per substep
    rate = _scaled_rate(scn.service, c)
    buffer = scn.buffer * c  # one queue per server: a cell running c k_j servers holds c B_j

    def step(N, A_p):
        N_next, dep, area = _rk4_cell_step(rate, N, A_p, dt, buffer)
        # A full queue drops what it cannot hold (a projection onto N <= B, exact in mass).
        drop = jnp.maximum(N_next - buffer, 0.0)
        N_next = N_next - drop
        return N_next, (N_next, dep, jnp.sum(area), drop)

    N_end, (Ns, deps, qs, drops) = jax.lax.scan(step, N, A)
    grid = jnp.concatenate([N[None], Ns], axis=0)  # (M+1, n)
    # Observations N_j(t_k + o_ij): one more RK4 step of cell j from the grid point before
    # o_ij, with the inflow integrated exactly up to o_ij. Interpolating instead would be
    # only first order where a routing jump falls inside the sub-step.
    idx = jnp.clip(jnp.floor(offsets / dt).astype(jnp.int32), 0, M - 1)
    sp = idx.astype(h.dtype) * dt
    j = jnp.arange(N.shape[0])[None, :]
    A_obs = _cell_inflow_between(scn, tk, sp, offsets, m_r, xprev, xcur)
    obs = jnp.minimum(_rk4_cell_step(rate, grid[idx, j], A_obs, offsets - sp, buffer)[0], buffer)
    arrivals = jnp.sum(A, axis=0)
    departures = jnp.sum(deps, axis=0)
    return (
        N_end,
        obs,
        arrivals,
        departures,
        jnp.sum(qs),
        jnp.sum(drops, axis=0),
        jnp.asarray(STATUS["success"]),
    )


def _tick_accurate(scn, tk, h, N, xprev, xcur, m_r, offsets, solver: Accurate, c):
    """One tick by adaptive Tsit5, one cell at a time.

    Given the routing history the cells are decoupled: cell $j$ sees only the $n$ inflow
    jumps $t_k + r_{ij}$ of its own in-arcs and is observed at the $n$ offsets
    $h - r_{ij}$. Solving each cell separately (vmapped) keeps every solve's jump and save
    lists of length $n$ instead of $n^2$.
    """
    tau, r = m_r
    times, rates = scn.arrival_times, scn.arrival_rates
    rate_fn = jax.vmap(jnp.interp, in_axes=(0, 0, 0))
    sv = scn.service

    def one_cell(N_j, tau_j, r_j, xp_j, xc_j, off_j, model, cap, L0, knee, width, c_j):
        cell = type(sv)(
            model=model[None],
            capacity=cap[None],
            base_latency=L0[None],
            knee=knee[None],
            width=width[None],
        )

        def field(t, y, args):
            lam = rate_fn(t - tau_j, times, rates)  # (n,) over sources
            inflow = jnp.sum(lam * jnp.where(t - tk < r_j, xp_j, xc_j))
            out = c_j * cell.rate(y[0][None] / c_j)[0]
            return (inflow - out, out, inflow, y[0])

        jumps = tk + r_j
        if times.shape[-1] > 1:
            jumps = jnp.concatenate([jumps, (times + tau_j[:, None]).reshape(-1)])
        order = jnp.argsort(off_j)
        ts = tk + jnp.concatenate([off_j[order], h[None]])
        zero = jnp.zeros((), N_j.dtype)
        sol = dfx.diffeqsolve(
            dfx.ODETerm(field),
            dfx.Tsit5(),
            t0=tk,
            t1=tk + h,
            dt0=None,
            y0=(N_j, zero, zero, zero),
            saveat=dfx.SaveAt(ts=ts),
            stepsize_controller=dfx.PIDController(
                rtol=solver.rtol, atol=solver.atol, jump_ts=jumps
            ),
            max_steps=solver.max_steps,
            throw=False,
        )
        Ns = sol.ys[0]
        obs_j = Ns[:-1][jnp.argsort(order)]  # N_j at offset h - r_ij, for every router i
        ok = sol.result == dfx.RESULTS.successful
        return Ns[-1], obs_j, sol.ys[2][-1], sol.ys[1][-1], sol.ys[3][-1], ok

    N1, obs_t, arr, dep, q, ok = jax.vmap(one_cell, in_axes=(0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0))(
        N,
        tau,
        r,
        xprev,
        xcur,
        offsets,
        sv.model,
        sv.capacity,
        sv.base_latency,
        sv.knee,
        sv.width,
        c,
    )
    status = jnp.where(jnp.all(ok), STATUS["success"], STATUS["solver_failed"])
    return N1, obs_t.T, arr, dep, jnp.sum(q), jnp.zeros_like(N1), status


def _setup(scn, eta, h, policy, hist):
    dtype = scn.latency.dtype
    tau = jnp.where(scn.allowed, scn.latency, 0.0)
    m = jnp.floor(tau / h + 1e-9).astype(jnp.int32)
    r = jnp.maximum(tau - m.astype(dtype) * h, 0.0)
    return dict(tau=tau, m=m, r=r, offsets=h - r, step=(eta * h).astype(dtype))


def _init_carry(scn, eta, h, aux, *, policy, hist, aversion):
    """`(N, x_ring, obs_ring, acc, status, change, extra)`. With error aversion, `extra`
    holds the policy's own routing state (before aversion), the cells' error-rate
    averages, their ring buffer and the roots' aversion; without, it is empty (the
    policy's routing is then the one in the ring)."""
    n = scn.n_cells
    dtype = scn.latency.dtype
    x0 = policy.initial_routing(scn, aux).astype(dtype)
    N0 = scn.initial_workload.astype(dtype)
    zeros = jnp.zeros(n, dtype)
    acc0 = (zeros, zeros, zeros, jnp.zeros((), dtype), jnp.zeros((), dtype), zeros)
    extra = {}
    if aversion is not None:
        extra = dict(
            xpol=x0,
            ema=zeros,
            err_ring=jnp.zeros((hist, n), dtype),
            aversion=jnp.zeros((n, n), dtype),
        )
    return (
        N0,
        jnp.broadcast_to(x0, (hist, n, n)),
        jnp.broadcast_to(N0[None, :], (hist, n, n)),
        acc0,
        jnp.asarray(STATUS["success"]),
        jnp.asarray(jnp.inf, dtype),
        extra,
    )


def _scale_at(scn, t):
    """Replica fraction $c_j(t)$ of every cell; `t` broadcasts against the cell axis last."""
    return jax.vmap(replica_scale, in_axes=(0, 0, 0, -1), out_axes=-1)(
        scn.replica_times, scn.replica_counts, scn.replicas, t
    )


def _profile_window(scn, t_lo, width: int):
    """The scenario with each arrival profile cut to the `width` breakpoints starting at the
    last one at or before `t_lo`: exact for every integral inside `[t_lo, t_lo + span]` when
    `width` counts the breakpoints of any such span (`_window_width`)."""
    P = scn.arrival_times.shape[-1]
    if width >= P:
        return scn

    def cut(ts, rs):
        start = jnp.clip(jnp.searchsorted(ts, t_lo, side="right") - 1, 0, P - width)
        return (
            jax.lax.dynamic_slice_in_dim(ts, start, width),
            jax.lax.dynamic_slice_in_dim(rs, start, width),
        )

    ts, rs = jax.vmap(cut)(scn.arrival_times, scn.arrival_rates)
    return dataclasses.replace(scn, arrival_times=ts, arrival_rates=rs)


def _window_width(times: np.ndarray, span: float, rates: np.ndarray | None = None) -> int:
    """Breakpoints a tick can touch: 2 + the most breakpoints of one profile in any
    half-open interval of length `span` (static, from the padded batch).

    A trailing run of identical breakpoints (padding to a common `P`, or a padded cell) is
    counted once: a window that ends inside such a run still ends on the profile's last
    breakpoint, so it stays exact.
    """
    t = np.asarray(times, dtype=float).reshape(-1, times.shape[-1])
    r = t * 0 if rates is None else np.asarray(rates, dtype=float).reshape(t.shape)
    P = t.shape[-1]
    if P <= 4:
        return P
    most = 0
    for row, rr in zip(t, r):  # Python over profiles, before tracing: not a hot path
        same = (row[1:] == row[-1]) & (rr[1:] == rr[-1])
        keep = P - int(np.flip(same).cumprod().sum())  # drop the trailing identical run
        row = row[:keep]
        ends = np.searchsorted(row, row + span * (1 + 1e-9), side="right")
        most = max(most, int((ends - np.arange(keep)).max()))
    return int(min(P, most + 2))


def _run_ticks(scn, eta, h, carry, k0, k1, aux, *, policy, integrator, hist, aversion, window):
    """Advance one scenario from tick `k0` to tick `k1` (dynamic bounds)."""
    n = scn.n_cells
    dtype = scn.latency.dtype
    full = scn
    g = _setup(scn, eta, h, policy, hist)
    tau, m, r, offsets, step = g["tau"], g["m"], g["r"], g["offsets"], g["step"]
    allowed = scn.allowed
    I, J = jnp.meshgrid(jnp.arange(n), jnp.arange(n), indexing="ij")
    cost = policy.cost

    def tick(k, carry):
        (N, x_ring, obs_ring, acc, status, change, extra) = carry
        tk = k.astype(dtype) * h
        # Only the breakpoints in [t_k - max tau, t_k + h] matter inside this tick.
        scn = _profile_window(full, tk - jnp.max(tau), window)
        xprev = x_ring[(k - m - 1) % hist, I, J]
        xcur = x_ring[(k - m) % hist, I, J]
        # Replica changes take effect on the tick whose midpoint has passed them.
        c = _scale_at(scn, jnp.broadcast_to(tk + 0.5 * h, (n,)))
        if isinstance(integrator, Fast):
            out = _tick_fast(scn, tk, h, N, xprev, xcur, (tau, r), offsets, integrator.substeps, c)
        else:
            out = _tick_accurate(scn, tk, h, N, xprev, xcur, (tau, r), offsets, integrator, c)
        N1, obs, d_arr, d_dep, d_q, d_drop, st = out
        lam_tick = _arc_integrals(scn, jnp.full((n, 1), tk), jnp.full((n, 1), tk + h))[:, 0]
        x_k = x_ring[k % hist]
        d_net = jnp.sum(2.0 * tau * x_k * lam_tick[:, None])
        obs_ring1 = obs_ring.at[k % hist].set(obs)
        # Router update at t_{k+1} from N_j(t_{k+1} - tau_ij) = obs of tick k - m_ij.
        xpol = x_k if aversion is None else extra["xpol"]
        t_next = tk + h
        if cost is None:
            xpol_next = policy.scheduled(scn, xpol, t_next + 0.5 * h, aux)
        else:
            seen = obs_ring1[(k - m) % hist, I, J]
            seen_scale = _scale_at(scn, t_next - tau) if scn.replica_times.shape[-1] > 1 else None
            xpol_next = policy.update(xpol, route_costs(cost, scn, seen, seen_scale), step, allowed)
        if aversion is None:
            x_next, new_extra = xpol_next, extra
        else:
            ema = ema_update(aversion, extra["ema"], d_drop, d_arr, h)
            err_ring = extra["err_ring"].at[k % hist].set(ema)
            seen_err = err_ring[(k - m) % hist, J]
            a = aversion_update(aversion, extra["aversion"], seen_err, allowed, h)
            x_next = apply_aversion(xpol_next, a)
            new_extra = dict(xpol=xpol_next, ema=ema, err_ring=err_ring, aversion=a)
        x_ring1 = x_ring.at[(k + 1) % hist].set(x_next)
        new_acc = tuple(a + d for a, d in zip(acc, (d_arr, d_dep, lam_tick, d_q, d_net, d_drop)))
        finite = (
            jnp.all(jnp.isfinite(N1)) & jnp.all(jnp.isfinite(x_next)) & jnp.all(jnp.isfinite(obs))
        )
        ok_now = finite & (st == STATUS["success"])
        alive = status == STATUS["success"]
        new_status = jnp.where(alive, jnp.where(finite, st, STATUS["nonfinite"]), status)
        # A failed scenario freezes at its last good state instead of spreading NaNs.
        keep = alive & ok_now
        new_change = jnp.maximum(jnp.max(jnp.abs(N1 - N)), jnp.max(jnp.abs(x_next - x_k)))
        new = (N1, x_ring1, obs_ring1, new_acc, new_change, new_extra)
        old = (N, x_ring, obs_ring, acc, change, extra)
        N_o, xr_o, or_o, acc_o, ch_o, ex_o = jax.tree_util.tree_map(
            lambda a, b: jnp.where(keep, a, b), new, old
        )
        return (N_o, xr_o, or_o, acc_o, new_status, ch_o, ex_o)

    return jax.lax.fori_loop(k0, k1, tick, carry)


def _record(scn, eta, h, carry, k, *, policy, hist):
    """The saved state at tick `k`, including the mass in flight on the network."""
    N, x_ring, _, acc, _, _, _ = carry
    dtype = scn.latency.dtype
    tau = jnp.where(scn.allowed, scn.latency, 0.0)
    t = k.astype(dtype) * h
    # F(t_k) = sum_ij int_{t_k - tau_ij}^{t_k} lambda_i(s) x_ij(s) ds over the past ticks.
    q = k - 1 - jnp.arange(hist - 1)
    lo = jnp.maximum(q.astype(dtype)[:, None, None] * h, t - tau[None])
    hi = jnp.maximum((q.astype(dtype) + 1.0)[:, None, None] * h, lo)
    flight = jnp.sum(x_ring[q % hist] * _arc_integrals(scn, lo, hi))
    return dict(
        t=t,
        N=N,
        x=x_ring[k % hist],
        arrivals=acc[0],
        departures=acc[1],
        source_arrivals=acc[2],
        workload_integral=acc[3],
        network_integral=acc[4],
        drops=acc[5],
        in_flight=flight,
    )


def _simulate_batch_sharded(scn, eta, h, save_ticks, **static):
    # Each device runs its shard on its own (`per_device`): the adaptive integrator's
    # step loops would otherwise all-reduce their batched conditions across devices at
    # every step.
    return per_device(functools.partial(_simulate_batch_impl, **static))(scn, eta, h, save_ticks)


# The compiled batch simulation, with the solvers' XLA options (`compiler_options`: on
# one CPU device a quarter to a third less time per call).
_simulate_batch = solver_jit(_simulate_batch_sharded, jit=eqx.filter_jit)


def _simulate_batch_impl(
    scn, eta, h, save_ticks, *, policy, integrator, hist, progress, horizon, aversion, window
):
    kw = dict(policy=policy, hist=hist)
    aux = jax.vmap(lambda s, hh: policy.prepare(s, hh, horizon))(scn, h)
    carry0 = jax.vmap(lambda s, e, hh, a: _init_carry(s, e, hh, a, aversion=aversion, **kw))(
        scn, eta, h, aux
    )
    run = jax.vmap(
        lambda s, e, hh, c, a, b, x: _run_ticks(
            s, e, hh, c, a, b, x, integrator=integrator, aversion=aversion, window=window, **kw
        )
    )
    rec = jax.vmap(lambda s, e, hh, c, k: _record(s, e, hh, c, k, **kw))

    def segment(carry, ks):
        k0, k1 = ks
        carry = run(scn, eta, h, carry, k0, k1, aux)
        if progress is not None:
            jax.debug.callback(progress, jnp.max(k1), ordered=False)
        return carry, rec(scn, eta, h, carry, k1)

    pairs = jnp.stack([save_ticks[:, :-1].T, save_ticks[:, 1:].T], axis=1)  # (S, 2, B)
    carry, recs = jax.lax.scan(segment, carry0, pairs)
    first = rec(scn, eta, h, carry0, save_ticks[:, 0])
    recs = jax.tree_util.tree_map(
        lambda a, b: jnp.concatenate([a[None], b]).swapaxes(0, 1), first, recs
    )
    return recs, carry[4], carry[5]


class _Progress:
    """A small stderr progress line driven from inside the compiled loop."""

    def __init__(self, total_segments: int, enabled: bool):
        self.enabled = enabled
        self.total = total_segments
        self.count = 0
        self.start = time.perf_counter()

    def __call__(self, k):
        if not self.enabled:
            return
        self.count += 1
        frac = min(self.count / self.total, 1.0)
        el = time.perf_counter() - self.start
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\rsimulating [{bar:<30}] {100 * frac:5.1f}%  {el:6.1f}s")
        if self.count >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _hist_len(tau_max_over_h: float) -> int:
    need = int(math.floor(tau_max_over_h + 1e-9)) + 2
    return 1 << max(need - 1, 1).bit_length()


def simulate(
    scenario: Scenario,
    policy: str | AbstractPolicy,
    *,
    step_size=1.0,
    tick=0.05,
    horizon: float = 50.0,
    n_save: int = 100,
    integrator: AbstractIntegrator = Fast(),
    progress: bool = False,
    throw: bool | None = None,
    dtype=None,
    error_aversion: ErrorAversion | None = None,
) -> Solution:
    """Simulate the delayed fluid model under one routing policy, batched.

    $\\dot N_j = \\sum_i \\lambda_i(t-\\tau_{ij})x_{ij}(t-\\tau_{ij}) - \\mu_j(N_j)$, routers
    updating at every tick $t_k = kh$ from delayed observations (module docstring; seed
    §3.2, §4; theory/dynamics.md).

    **Arguments:**
    - `scenario`: a `Scenario`, or a batch from `stack_scenarios` (leading axis `B`).
    - `policy`: `"flow-grad"`, `"disc-lat"`, `"rand"`, ... or an `AbstractPolicy`.
    - `step_size`: $\\eta$, broadcast against `(B, n)`: a scalar, `(n,)` per router, `(B, 1)`
      one per batch element (a step-size sweep), or `(B, n)`.
    - `tick`: the probe period $h$, a scalar or `(B,)`.
    - `horizon`: $T$; must be a whole number of ticks for every batch element.
    - `n_save`: number of save intervals; state is saved at ticks $\\lfloor sK/n_{save}\\rfloor$.
    - `integrator`: `Fast(substeps)` (default) or `Accurate(rtol, atol)`.
    - `progress`: print a progress line on stderr.
    - `throw`: raise on a per-scenario failure; default True for one scenario, False for
      a batch (failures are then reported in `Solution.status`).
    - `dtype`: `jnp.float64` (default) or `jnp.float32` for throughput.
    - `error_aversion`: an `ErrorAversion` to let the roots shift traffic away from cells
      that drop requests (seed §3.4; cells drop only with a finite `Scenario.buffer`), or
      `None` (default) for none.

    **Returns:** a `Solution`; unbatched when the inputs are.
    """
    pol = policy_from_name(policy) if isinstance(policy, str) else policy
    if not isinstance(pol, AbstractPolicy):
        raise ValueError(f"policy = {policy!r} is invalid: expected a policy name or object")
    if not isinstance(integrator, AbstractIntegrator):
        raise ValueError(f"integrator = {integrator!r} is invalid: expected Fast() or Accurate()")
    if error_aversion is not None and not isinstance(error_aversion, ErrorAversion):
        raise ValueError(
            f"error_aversion = {error_aversion!r} is invalid: expected an ErrorAversion or None"
        )
    if isinstance(integrator, Accurate) and bool(np.any(np.isfinite(np.asarray(scenario.buffer)))):
        raise ValueError(
            "integrator = Accurate() is invalid for a scenario with finite buffers: the "
            "queue-overflow projection is implemented by the Fast integrator only"
        )
    dtype = jnp.dtype(jnp.float64 if dtype is None else dtype)
    if dtype not in (jnp.dtype(jnp.float64), jnp.dtype(jnp.float32)):
        raise ValueError(f"dtype = {dtype} is invalid: allowed float64 or float32")
    if dtype == jnp.float64 and not jax.config.jax_enable_x64:
        raise ValueError("dtype = float64 needs jax_enable_x64 (dlbfluid enables it on import)")

    batched = len(scenario.batch_shape) > 0
    if len(scenario.batch_shape) > 1:
        raise ValueError(f"scenario batch shape {scenario.batch_shape}: expected at most one axis")
    n = scenario.n_cells
    eta = np.asarray(step_size, dtype=float)
    hs = np.asarray(tick, dtype=float)
    if hs.ndim > 1:
        raise ValueError(f"tick has shape {hs.shape}: expected a scalar or (B,)")
    if eta.ndim > 2 or (eta.ndim >= 1 and eta.shape[-1] not in (1, n)):
        raise ValueError(
            f"step_size has shape {eta.shape}: expected a scalar, (n,) = ({n},), (B, 1) or (B, {n})"
        )
    B = scenario.batch_shape[0] if batched else 1
    cands = (
        [B] + ([hs.shape[0]] if hs.ndim == 1 else []) + ([eta.shape[0]] if eta.ndim == 2 else [])
    )
    Bb = max(cands)
    for c in cands:
        if c not in (1, Bb):
            raise ValueError(
                f"batch sizes do not broadcast: scenario {B}, tick {hs.shape}, "
                f"step_size {eta.shape}"
            )
    was_batched = batched or Bb > 1 or hs.ndim == 1 or eta.ndim == 2
    eta_b = np.broadcast_to(eta, (Bb, n)).copy()
    h_b = np.broadcast_to(hs, (Bb,)).copy()
    if not np.all(np.isfinite(h_b)) or np.any(h_b <= 0):
        raise ValueError(f"tick = {tick!r} is invalid: expected finite values > 0")
    if not np.all(np.isfinite(eta_b)) or np.any(eta_b < 0):
        raise ValueError(f"step_size = {step_size!r} is invalid: expected finite values >= 0")
    T = float(horizon)
    if not math.isfinite(T) or T <= 0:
        raise ValueError(f"horizon = {horizon!r} is invalid: expected a finite number > 0")
    K = np.rint(T / h_b).astype(np.int64)
    if np.any(np.abs(K * h_b - T) > 1e-9 * max(T, 1.0)) or np.any(K < 1):
        bad = h_b[np.abs(K * h_b - T) > 1e-9 * max(T, 1.0)]
        raise ValueError(
            f"horizon = {T} is not a whole number of ticks for tick = {bad[:3]}: "
            "choose a horizon that is a multiple of every tick"
        )
    if not isinstance(n_save, int) or n_save < 1 or n_save > int(K.min()):
        raise ValueError(
            f"n_save = {n_save!r} is invalid: expected an integer in [1, "
            f"{int(K.min())}] (the number of ticks)"
        )
    save_ticks = (np.arange(n_save + 1)[None, :] * K[:, None]) // n_save

    scn = scenario.strip()
    if not batched:
        scn = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (Bb,) + a.shape), scn)
    elif B != Bb:
        scn = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (Bb,) + a.shape[1:]), scn)
    scn = jax.tree_util.tree_map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, scn
    )
    tau = np.where(np.asarray(scn.allowed), np.asarray(scn.latency), 0.0)
    hist = _hist_len(float((tau.reshape(Bb, -1).max(axis=1) / h_b).max()))
    window = _window_width(
        np.asarray(scn.arrival_times),
        float(tau.max() + 2.0 * h_b.max()),
        np.asarray(scn.arrival_rates),
    )

    # Shard the batch over every device; pad the batch to a multiple of the device count.
    ndev = jax.device_count()
    pad = (-Bb) % ndev
    args = (
        scn,
        jnp.asarray(eta_b, dtype),
        jnp.asarray(h_b, dtype),
        jnp.asarray(K),
        jnp.asarray(save_ticks),
    )
    if pad:
        args = jax.tree_util.tree_map(
            lambda a: jnp.concatenate([a, jnp.repeat(a[-1:], pad, axis=0)]), args
        )
    args = shard_batch(args)
    if isinstance(integrator, Accurate):
        # Tolerances travel as arrays so that a tolerance sweep reuses one compilation.
        integrator = eqx.tree_at(
            lambda a: (a.rtol, a.atol),
            integrator,
            (jnp.asarray(integrator.rtol, dtype), jnp.asarray(integrator.atol, dtype)),
        )
    # (the progress callback runs once per segment on every device)
    prog = _Progress(n_save * jax.device_count(), progress) if progress else None
    scn_a, eta_a, h_a, _, st_a = args
    rec, status, change = _simulate_batch(
        scn_a,
        eta_a,
        h_a,
        st_a,
        policy=pol,
        integrator=integrator,
        hist=hist,
        progress=prog,
        # Only a policy that precomputes a schedule depends on the horizon at trace time.
        horizon=T if type(pol).prepare is not AbstractPolicy.prepare else None,
        aversion=error_aversion,
        window=window,
    )
    if pad:
        rec, status, change = jax.tree_util.tree_map(lambda a: a[:Bb], (rec, status, change))
    sol = Solution(
        t=rec["t"],
        N=rec["N"],
        x=rec["x"],
        arrivals=rec["arrivals"],
        departures=rec["departures"],
        source_arrivals=rec["source_arrivals"],
        workload_integral=rec["workload_integral"],
        network_integral=rec["network_integral"],
        drops=rec["drops"],
        in_flight=rec["in_flight"],
        status=status,
        final_change=change,
        cell_mask=jnp.asarray(scn.cell_mask[:Bb]),
        tick=jnp.asarray(h_b),
        policy=pol.name,
        cell_names=tuple(scenario.cell_names) if not batched else (),
    )
    if throw is None:
        throw = not was_batched
    if throw:
        sol.raise_for_status()
    if not was_batched:
        sol = jax.tree_util.tree_map(lambda a: a[0], sol)
    return sol
