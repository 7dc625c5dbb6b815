"""Events and trials on a generated batch (seed App. B.3; theory/generator.md, *Events*,
*Trials*): the demand burst, the capacity outage and the synchronised minute spikes, and
the per-trial multiplicative fluctuation of the arrival rates, as piecewise-linear arrival
profiles and piecewise-constant replica schedules.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.special

from .._validate import integer, number
from .generated import GeneratedScenarios
from .uniforms import _uniforms

EVENT_LEVEL = 0.95
"""Total utilisation reached by the burst and exceeded by the outage (seed App. B.3)."""
EVENT_WINDOW = (0.3, 0.7)
"""Burst/outage window as fractions of the horizon: minutes 3 to 7 of 10 (seed App. B.3)."""

EVENTS = ("none", "burst", "outage", "spikes")


def burst_demand(gen: GeneratedScenarios, *, level: float = EVENT_LEVEL) -> np.ndarray:
    """Arrival rates `(B, n)` during a burst: the source `burst_cell` gains
    $\\Delta = \\rho_E\\sum_j\\bar\\mu_j - \\sum_i\\lambda_i$, so total utilisation is
    exactly $\\rho_E$ = `level` (theory/generator.md, *Burst*).

    **Raises:** `ValueError` if `level` is not above the batch's utilisation.
    """
    level = number("level", level, lo=0, lo_open=True, hi=1.0, hi_open=True)
    if not level > gen.utilisation:
        raise ValueError(
            f"level = {level} is invalid for a burst: expected a level above the "
            f"utilisation {gen.utilisation}"
        )
    total_cap = np.where(gen.mask, gen.capacity, 0.0).sum(1)
    extra = level * total_cap - gen.demand.sum(1)
    onehot = np.arange(gen.max_cells)[None, :] == gen.burst_cell[:, None]
    return gen.demand + np.where(onehot, extra[:, None], 0.0)


def outage_replicas(gen: GeneratedScenarios, *, level: float = EVENT_LEVEL) -> np.ndarray:
    """Replica counts `(B, n)` during an outage (theory/generator.md, *Outage*).

    Cells are cut to one replica in the order `outage_order` until the total utilisation
    $\\sum\\lambda/\\sum_j\\bar\\mu_j k'_j/k_j$ exceeds `level` (fewest cuts $m$ with
    $U_m > $ `level`; every cuttable cell when even that is not enough).
    """
    level = number("level", level, lo=0, lo_open=True)
    mask = gen.mask
    k = gen.replicas
    cap = np.where(mask, gen.capacity, 0.0)
    cuttable = mask & (k > 1)
    loss = np.where(cuttable, cap - cap / k, 0.0)
    loss_in_order = np.take_along_axis(loss, gen.outage_order, axis=1)
    remaining = cap.sum(1, keepdims=True) - np.concatenate(
        [np.zeros((gen.count, 1)), np.cumsum(loss_in_order, axis=1)], axis=1
    )  # (B, n+1): capacity after m = 0..n cuts
    over = gen.demand.sum(1, keepdims=True) / remaining > level
    n_cuttable = cuttable.sum(1)
    cuts = np.where(over.any(1), np.argmax(over, axis=1), n_cuttable)
    cuts = np.minimum(cuts, n_cuttable)
    in_order_cut = np.arange(gen.max_cells)[None, :] < cuts[:, None]
    cut = np.zeros_like(mask)
    np.put_along_axis(cut, gen.outage_order, in_order_cut, axis=1)
    return np.where(cut, 1, k)


def _window(horizon: float) -> tuple[float, float]:
    return EVENT_WINDOW[0] * horizon, EVENT_WINDOW[1] * horizon


def arrival_profiles(
    gen: GeneratedScenarios,
    *,
    event: str = "none",
    trial: int = 0,
    horizon: float = 600.0,
    fluctuation: float = 0.1,
    knot_spacing: float = 10.0,
    spike_fraction: float = 0.2,
    spike_width: float = 1.0,
    spike_period: float = 60.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Piecewise-linear arrival profiles: a time grid `(P,)` shared by all cells (repeated
    times are jumps) and rates `(B, n, P)` (theory/generator.md, *Events*, *Trials*).

    The event rate $\\lambda^E_i(t)$ (constant, burst step, or minute spikes carrying a
    fraction `spike_fraction` of each minute's requests in a triangle of width
    `spike_width`) is multiplied by the trial factor $\\max(0, 1+\\sigma\\zeta_i(t))$,
    $\\zeta_i$ linear between i.i.d. standard normal knots every `knot_spacing` seconds,
    drawn from `(seed, index, trial)`; the profile is the linear interpolant of the product
    on the union of event breakpoints and knots.
    """
    if event not in EVENTS:
        raise ValueError(f"event = {event!r} is invalid: allowed events are {list(EVENTS)}")
    trial = integer("trial", trial, 0)
    if trial >= 2**32:
        raise ValueError(f"trial = {trial} is invalid: expected an integer < 2**32")
    horizon = number("horizon", horizon, lo=0, lo_open=True)
    fluctuation = number("fluctuation", fluctuation, lo=0)
    knot_spacing = number("knot_spacing", knot_spacing, lo=0, lo_open=True)
    spike_fraction = number("spike_fraction", spike_fraction, lo=0, lo_open=True, hi=1.0)
    spike_period = number("spike_period", spike_period, lo=0, lo_open=True)
    spike_width = number("spike_width", spike_width, lo=0, lo_open=True, hi=spike_period)

    # Event breakpoints as (time, side): side -1/+1 are the left/right values of a jump.
    points: list[tuple[float, int]] = [(0.0, 0)]
    if event == "burst":
        t0, t1 = _window(horizon)
        points += [(t0, -1), (t0, 1), (t1, -1), (t1, 1)]
    elif event == "spikes":
        m = 0
        while m * spike_period + spike_width <= horizon:
            tm = m * spike_period
            points += [(tm, 0), (tm + 0.5 * spike_width, 0), (tm + spike_width, 0)]
            m += 1
    knots: np.ndarray = np.zeros(0)
    if fluctuation > 0:
        n_k = int(math.floor(horizon / knot_spacing + 1e-9)) + 1
        knots = knot_spacing * np.arange(n_k)
        if knots[-1] < horizon:
            knots = np.append(knots, horizon)
        event_times = {t for t, _ in points}
        points += [(float(t), 0) for t in knots if float(t) not in event_times]
    points = sorted(set(points))
    t = np.array([p[0] for p in points])
    side = np.array([p[1] for p in points])

    lam = np.where(gen.mask, gen.demand, 0.0)[:, :, None]  # (B, n, 1)
    if event == "burst":
        t0, t1 = _window(horizon)
        active = ((t > t0) | ((t == t0) & (side > 0))) & ((t < t1) | ((t == t1) & (side < 0)))
        rates = np.where(active[None, None, :], burst_demand(gen)[:, :, None], lam)
    elif event == "spikes":
        phase = np.zeros_like(t)
        m = 0
        while m * spike_period + spike_width <= horizon:
            centre = m * spike_period + 0.5 * spike_width
            tri = np.maximum(0.0, 1.0 - np.abs(t - centre) / (0.5 * spike_width))
            phase = phase + tri * 2.0 / spike_width  # unit-mass triangle
            m += 1
        shape = (1.0 - spike_fraction) + spike_fraction * spike_period * phase
        rates = lam * shape[None, None, :]
    else:
        rates = np.broadcast_to(lam, lam.shape[:2] + t.shape).copy()

    if fluctuation > 0:
        u = _uniforms(gen.seed, gen.indices, gen.max_cells * knots.shape[0], stream=1, trial=trial)
        zeta = scipy.special.ndtri(u).reshape(gen.count, gen.max_cells, knots.shape[0])
        # Knots are shared by all cells, so the interpolation weights are too.
        i1 = np.clip(np.searchsorted(knots, t, side="right"), 1, knots.shape[0] - 1)
        frac = np.clip((t - knots[i1 - 1]) / (knots[i1] - knots[i1 - 1]), 0.0, 1.0)
        z_at = zeta[:, :, i1 - 1] * (1.0 - frac) + zeta[:, :, i1] * frac  # (B, n, P)
        rates = rates * np.maximum(0.0, 1.0 + fluctuation * z_at)
    rates = np.where(gen.mask[:, :, None], rates, 0.0)
    return t, rates


def replica_schedules(
    gen: GeneratedScenarios, *, event: str = "none", horizon: float = 600.0
) -> tuple[np.ndarray, np.ndarray]:
    """Piecewise-constant replica counts: times `(3,)` $= (0, t_0, t_1)$ and counts
    `(B, n, 3)` $= (k, k', k)$, with $k'$ from `outage_replicas` for the outage and
    $k' = k$ otherwise."""
    if event not in EVENTS:
        raise ValueError(f"event = {event!r} is invalid: allowed events are {list(EVENTS)}")
    horizon = number("horizon", horizon, lo=0, lo_open=True)
    t0, t1 = _window(horizon)
    k = gen.replicas
    kd = outage_replicas(gen) if event == "outage" else k
    return np.array([0.0, t0, t1]), np.stack([k, kd, k], axis=-1)
