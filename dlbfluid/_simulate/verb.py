"""The verb: `simulate`, the delayed fluid model of a batch of scenarios under one policy.

It checks the options and the time grid (host side), pads and shards the batch over the
devices, runs the compiled program (`strategy.py`), checks conservation and returns a
`Solution`.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._integrators import AbstractIntegrator, Fast
from .._policies import AbstractPolicy
from .._policies.aversion import ErrorAversion
from .._precision import float_dtype
from .._results import RESULTS
from .._runtime import exported
from .._runtime.devices import compiler_options, shard_batch, uses_float32
from .._runtime.progress import Progress
from .._scenario import Scenario
from .loop import _hist_len
from .options import DEFAULTS, LAYOUTS, SimulateOptions, _chosen_chunk, default_layout
from .single import check_options, floats_as, looped_policy
from .solution import Solution
from .strategy import _chunk_count, _sharded, _simulate_batch
from .window import _window_width

__all__ = ["simulate"]


def _mass_balance_status(rec, status, mask, allowance):
    """`mass_balance` for a run that succeeded but does not conserve requests beyond
    rounding: per cell, $N_j(T) - N_j(0) = A_j - S_j - D_j$ (arrivals, services and drops
    integrated over $[0, T]$), and over the network, requests that reached the routers
    equal those that reached a cell plus the change of those in flight. Both residuals
    must stay within `allowance` $= u\\,\\epsilon\\,K$ (`_allowance`) times the requests
    counted.

    Both identities hold to rounding whatever the tick (each tick's totals are the
    integrals of the rates that moved $N$): measured $10^{-14}$ relative in float64 and
    $4\\times10^{-7}$ in float32 over 1,000 ticks of every policy. The tolerance is
    $u$ = `SimulateOptions.mass_balance_ulps` epsilons $\\epsilon$ of the run's dtype per
    tick over the $K$ ticks, relative to the requests counted; beyond it something lost
    or created requests (an integrator that does not conserve them, an invalid state the
    other checks let through) and the numbers must not be labelled `success`."""
    N, a, d, dr = rec["N"], rec["arrivals"], rec["departures"], rec["drops"]
    src, fly = rec["source_arrivals"], rec["in_flight"]
    m = mask.astype(N.dtype)
    cell = jnp.abs((N[:, -1] - N[:, 0]) - (a[:, -1] - d[:, -1] - dr[:, -1])) * m
    net = jnp.abs(
        jnp.sum(src[:, -1] * m, -1) - jnp.sum(a[:, -1] * m, -1) - (fly[:, -1] - fly[:, 0])
    )
    scale = 1.0 + jnp.sum((jnp.abs(a[:, -1]) + jnp.abs(N[:, 0]) + jnp.abs(N[:, -1])) * m, -1)
    tol = allowance * scale
    bad = (jnp.max(cell, -1) > tol) | (net > tol) | ~jnp.isfinite(net)
    return jnp.where((status == RESULTS.success) & bad, RESULTS.mass_balance, status)


def _allowance(dtype, ticks: int, ulps: float) -> float:
    """The conservation residual allowed per request counted (`_mass_balance_status`):
    `ulps` epsilons of `dtype` per tick over `ticks` ticks (host side, a value: a new
    horizon reuses the compiled `_finish`)."""
    return ulps * float(jnp.finfo(dtype).eps) * max(ticks, 1)


@functools.partial(jax.jit, static_argnames=("batch", "saves", "unbatch"))
def _finish(rec, status, change, mask, tick, allowance, *, batch: int, saves: int, unbatch: bool):
    """The `Solution`'s arrays from the compiled program's outputs, as one small compiled
    program per shape: the padding of the batch (to `batch` scenarios) and of the save
    bucket (to `saves` save points) sliced off, the status after `_mass_balance_status`,
    and with `unbatch` the batch axis of one scenario dropped. Done operation by
    operation, these compiled some forty small programs per new shape."""
    rec = {k: v[:batch, :saves] for k, v in rec.items()}
    status = _mass_balance_status(rec, status[:batch], mask, allowance)
    out = dict(rec, status=status, final_change=change[:batch], cell_mask=mask, tick=tick)
    if unbatch:
        out = {k: v[0] for k, v in out.items()}
    return out


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
    chunk: int | None = None,
    layout: str | None = None,
    options: SimulateOptions = DEFAULTS,
) -> Solution:
    """Simulate the delayed fluid model under one routing policy, batched.

    $\\dot N_j = \\sum_i \\lambda_i(t-\\tau_{ij})x_{ij}(t-\\tau_{ij}) - \\mu_j(N_j)$, routers
    updating at every tick $t_k = kh$ from delayed observations (module docstring; seed
    §3.2, §4; theory/model.md).

    **Arguments:**
    - `scenario`: a `Scenario`, or a batch from `stack_scenarios` (leading axis `B`).
    - `policy`: a registered policy name (`"flow-grad"`, `"disc-lat"`, `"rand"`, ...) or an
      `AbstractPolicy`.
    - `step_size`: $\\eta$, broadcast against `(B, n)`: a scalar, `(n,)` per router, `(B, 1)`
      one per batch element (a step-size sweep), or `(B, n)`.
    - `tick`: the probe period $h$, a scalar or `(B,)`.
    - `horizon`: $T$; must be a whole number of ticks for every batch element.
    - `n_save`: number of save intervals; state is saved at ticks $\\lfloor sK/n_{save}\\rfloor$.
    - `integrator`: `Fast(substeps)` (default), `Accurate(rtol, atol)`, or any
      `AbstractIntegrator`.
    - `progress`: print a progress line on stderr.
    - `throw`: raise on a per-scenario failure; default True for one scenario, False for
      a batch (failures are then reported in `Solution.status`).
    - `dtype`: `jnp.float64` (default) or `jnp.float32` for throughput; either needs JAX's
      x64 mode (`dlbfluid.enable_x64`): the clock and the totals are float64 in both.
    - `error_aversion`: an `ErrorAversion` to let the roots shift traffic away from cells
      that drop requests (seed §3.4; cells drop only with a finite `Scenario.buffer`), or
      `None` (default) for none: the policy runs wrapped in `ErrorAverse`.
    - `chunk`: how many scenarios of a device's share advance through the ticks together
      (an integer >= 1), or `None` (default) for the backend's choice (`default_chunk`:
      on a CPU as many as keep a tick in cache, for a share of at least four chunks;
      elsewhere the whole share). It changes the
      speed only: a scenario's arithmetic does not depend on its chunk.
    - `layout`: where the batch axis lies in the tick loop: `"batch-first"` (`jax.vmap`),
      `"batch-last"` (`vmap_last`: every elementwise loop runs over the scenarios of a
      chunk, which fill the vector lanes; chunks of `SimulateOptions.batch_last_chunk` on a CPU), or
      `None` (default) for `default_layout`'s choice: batch-last for float32 on a CPU
      with `Fast`, up to 16 cells, from 128 scenarios per device and 4 ticks per save,
      where it runs 1.2-1.6x faster than batch-first; batch-first otherwise. The same
      arithmetic in either (N equal to rounding); speed only. Batches whose scenarios
      have different tick counts run batch-first.
    - `options`: `SimulateOptions`, the execution's tunables with their measured defaults
      (chunk sizes, the layout's thresholds, the conservation tolerance, the save bucket).

    **Returns:** a `Solution`; unbatched when the inputs are.
    """
    pol = check_options(scenario, policy, integrator, error_aversion)
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
        raise ValueError(f"chunk = {chunk!r} is invalid: expected an integer >= 1 or None")
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"layout = {layout!r} is invalid: allowed {', '.join(LAYOUTS)} or None")
    if not isinstance(options, SimulateOptions):
        raise ValueError(f"options = {options!r} is invalid: expected a SimulateOptions")
    dtype = float_dtype(dtype, "simulate")
    grid = _grid(scenario, step_size, tick, horizon, n_save)
    scn = scenario.strip()
    B = scenario.batch_shape[0] if scenario.batch_shape else 0
    if B != grid.B:  # (on the host: a copy, with no program compiled for it)
        lead = 1 if B else 0
        scn = jax.tree_util.tree_map(
            lambda a: np.broadcast_to(np.asarray(a), (grid.B,) + a.shape[lead:]), scn
        )
    # The run's floats in its dtype, converted by one program (`floats_as`).
    scn, eta, h = floats_as((scn, grid.eta, grid.h), dtype)
    looped = looped_policy(pol, error_aversion)
    integrator = integrator.for_batch(scn, float(grid.h.max())).prepared(dtype)
    run = _Run(looped, integrator, dtype, progress, chunk, layout, options)
    rec, status, change = _run(scn, eta, h, grid, run)
    out = _finish(
        rec,
        status,
        change,
        scn.cell_mask,
        grid.h,
        _allowance(rec["N"].dtype, int(grid.K.max()), options.mass_balance_ulps),
        batch=grid.B,
        saves=grid.n_save + 1,
        unbatch=not grid.batched,
    )
    sol = Solution(
        **out,
        policy=pol.name,
        cell_names=tuple(scenario.cell_names) if not scenario.batch_shape else (),
    )
    if throw is None:
        throw = not grid.batched
    if throw:
        sol.raise_for_status()
    return sol


class _Grid(NamedTuple):
    """The time grid of a batch of `B` scenarios (host side): `eta` `(B, n)`, `h` `(B,)`,
    `K` `(B,)` ticks, `save_ticks` `(B, n_save + 1)`; `batched`: whether the inputs were."""

    B: int
    eta: np.ndarray
    h: np.ndarray
    T: float
    K: np.ndarray
    n_save: int
    save_ticks: np.ndarray
    batched: bool


def _grid(scenario: Scenario, step_size, tick, horizon, n_save) -> _Grid:
    """The batch size that `scenario`, `step_size` and `tick` broadcast to, and the ticks
    and saves of each scenario: $K = T/h$ ticks, saves at $\\lfloor sK/n_{save}\\rfloor$.

    **Raises:** `ValueError` naming the argument whose value or shape is invalid."""
    if len(scenario.batch_shape) > 1:
        raise ValueError(f"scenario batch shape {scenario.batch_shape}: expected at most one axis")
    batched = len(scenario.batch_shape) > 0
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
    off = np.abs(K * h_b - T) > 1e-9 * max(T, 1.0)
    if np.any(off) or np.any(K < 1):
        raise ValueError(
            f"horizon = {T} is not a whole number of ticks for tick = {h_b[off][:3]}: "
            "choose a horizon that is a multiple of every tick"
        )
    if not isinstance(n_save, int) or n_save < 1 or n_save > int(K.min()):
        raise ValueError(
            f"n_save = {n_save!r} is invalid: expected an integer in [1, "
            f"{int(K.min())}] (the number of ticks)"
        )
    save_ticks = (np.arange(n_save + 1)[None, :] * K[:, None]) // n_save
    was_batched = batched or Bb > 1 or hs.ndim == 1 or eta.ndim == 2
    return _Grid(Bb, eta_b, h_b, T, K, n_save, save_ticks, was_batched)


class _Run(NamedTuple):
    """What `_run` runs besides the batch and its grid: the looped policy, the prepared
    integrator and `simulate`'s execution options."""

    policy: AbstractPolicy
    integrator: AbstractIntegrator
    dtype: Any
    progress: bool
    chunk: int | None
    layout: str | None
    options: SimulateOptions


def _run(scn: Scenario, eta, h, grid: _Grid, run: _Run):
    """`(records, status, change)` of the batch `scn` (already `grid.B` scenarios, step
    sizes `eta` and ticks `h` in the run's dtype): the static configuration (ring length,
    window width, layout, chunk), the batch padded to a multiple of the device count (on
    the host) and sharded, the save schedule padded to its bucket
    (`SimulateOptions.save_bucket`: the extra saves repeat the last one), and the compiled
    program called (through a kept export when the command line keeps them). The outputs
    keep the padding (`_finish` slices it off)."""
    Bb, n, dtype = grid.B, scn.n_cells, run.dtype
    tau = np.where(np.asarray(scn.allowed), np.asarray(scn.latency), 0.0)
    hist = _hist_len(float((tau.reshape(Bb, -1).max(axis=1) / grid.h).max()))
    window = _window_width(
        np.asarray(scn.arrival_times),
        float(tau.max() + 2.0 * grid.h.max()),
        np.asarray(scn.arrival_rates),
    )
    S = run.options.save_bucket(grid.n_save)
    save_ticks = np.concatenate(
        [grid.save_ticks, np.repeat(grid.save_ticks[:, -1:], S - grid.n_save, axis=1)], axis=1
    )
    # Shard the batch over every device; pad the batch to a multiple of the device count.
    ndev = jax.local_device_count()
    pad = (-Bb) % ndev
    args = (scn, eta, h, save_ticks)
    if pad:  # (copies: on the host, with no program compiled for them)
        args = jax.tree_util.tree_map(
            lambda a: np.concatenate([np.asarray(a), np.repeat(np.asarray(a)[-1:], pad, axis=0)]),
            args,
        )
    args = jax.device_put(args)
    share = (Bb + pad) // ndev
    uniform = bool(np.all(save_ticks == save_ticks[:1]))
    layout = run.layout
    if layout is None:
        per_save = int(grid.K.min()) // grid.n_save
        layout = default_layout(dtype, n, share, run.integrator, per_save, run.options)
    if not uniform:
        layout = "batch-first"  # per-scenario tick counts: the vmapped loop's batched bounds
    chunk = _chosen_chunk(run.chunk, n, share, layout, run.options)
    # (the progress callback runs once per save interval of every chunk on every device)
    prog = None
    if run.progress:
        prog = Progress("simulating", grid.n_save * _chunk_count(share, chunk) * ndev)
    static = dict(
        hist=hist,
        uniform=uniform,
        progress=prog,
        # Only a policy that precomputes a schedule depends on the horizon at trace time.
        horizon=grid.T if run.policy.uses_horizon else None,
        window=window,
        chunk=chunk,
        layout=layout,
    )
    return _call(shard_batch(args), run.policy, run.integrator, static)


def _call(args, policy, integrator, static):
    """The compiled program on `args`. The policy's and integrator's arrays are
    arguments, the rest of them static (as `filter_jit` splits them), so that the command
    line can keep the traced program (`_runtime.exported`; not with a progress callback, which
    cannot be exported)."""
    dyn, fixed = eqx.partition((policy, integrator), eqx.is_array)

    def run(jit):
        def f(scn, eta, h, st, dyn):
            pol, integ = eqx.combine(dyn, fixed)
            return jit(scn, eta, h, st, policy=pol, integrator=integ, **static)

        return f

    run_args = (*args, dyn)
    if static["progress"] is not None:
        return run(_simulate_batch)(*run_args)
    return exported.call(
        "simulate",
        run(_simulate_batch),
        run_args,
        (fixed, static),
        trace=run(_sharded),
        compiler_options=compiler_options(uses_float32(run_args)),
    )
