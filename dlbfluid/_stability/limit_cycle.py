"""Herding of discrete routing (theory/stability.md §5): the late-time oscillation of
$u = N_a - N_b$ measured from a simulation (`herding`, `oscillation`).

Discrete (bang-bang) routing has no step size and no linearisation; with loop delay
$2\\tau$ it switches about $2\\tau$ after each crossing of the tie, so it settles on a limit
cycle whose amplitude and period grow roughly linearly in $\\tau$.
"""

from __future__ import annotations

import equinox as eqx
import numpy as np

from .._integrators import Fast
from .._scenario import Scenario
from .._simulate import simulate


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
