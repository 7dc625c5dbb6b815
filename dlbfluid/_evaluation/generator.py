"""Random scenarios drawn like the paper's simulations (seed App. B; theory/generator.md).

A scenario is drawn hierarchically: a random set of geographic regions, cloud sites within
them (`data/regions.json`), Poisson replica counts, log-normal token times per cell, and
a demand split uniformly over the simplex. Each cell's disaggregated prefill/decode
servers are summarised by the softplus fluid service model of theory/service.md.

Scenario `i` of seed `s` is a function of `(s, i)` only (its key is
`fold_in(key(s), i)`), so a resumed sweep regenerates exactly the scenarios it lost, and
thousands are drawn in one vmapped call. Events (demand burst, capacity outage,
synchronised spikes) and per-trial arrival-rate fluctuations are applied on top of a
drawn batch by `scenario_dicts`, which writes the JSON format of `scenario_from_dict`.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import scipy.special
import scipy.stats

from .._defaults import DURATION_SCALES as DURATION_SCALES
from .._precision import require_x64
from .._validate import integer, number
from .events import EVENT_LEVEL as EVENT_LEVEL
from .events import EVENT_WINDOW as EVENT_WINDOW
from .events import EVENTS as EVENTS
from .events import arrival_profiles as arrival_profiles
from .events import burst_demand as burst_demand
from .events import outage_replicas as outage_replicas
from .events import replica_schedules as replica_schedules
from .generated import GeneratedScenarios as GeneratedScenarios
from .generated import _readonly
from .server_model import BUFFER_LOAD as BUFFER_LOAD
from .server_model import DECODE_ENGINES as DECODE_ENGINES
from .server_model import DECODE_SLOTS as DECODE_SLOTS
from .server_model import DECODE_TOKEN_TIME_S as DECODE_TOKEN_TIME_S
from .server_model import DECODE_TOKENS as DECODE_TOKENS
from .server_model import PREFILL_ENGINES as PREFILL_ENGINES
from .server_model import PREFILL_TOKEN_TIME_S as PREFILL_TOKEN_TIME_S
from .server_model import PREFILL_TOKENS as PREFILL_TOKENS
from .server_model import WORKLOAD as WORKLOAD
from .server_model import ShiftedGamma as ShiftedGamma
from .server_model import buffer_size as buffer_size
from .server_model import server_service as server_service
from .server_model import softplus_latency as softplus_latency
from .sites import EARTH_RADIUS_KM as EARTH_RADIUS_KM
from .sites import LATENCY_OVERHEAD_S as LATENCY_OVERHEAD_S
from .sites import SIGNAL_SPEED_KM_PER_S as SIGNAL_SPEED_KM_PER_S
from .sites import Site as Site
from .sites import _site_arrays
from .sites import haversine_km as haversine_km
from .sites import load_sites as load_sites
from .sites import network_latency as network_latency
from .uniforms import _uniforms

# The constants of the draw (theory/generator.md lists each with its reason); those of the
# sites, the servers and the events are in `sites`, `servers` and `events`, re-exported here.
# `DURATION_SCALES`, the duration scalings $y$, is in `_defaults` (imported above): the
# experiment's kinds list them without importing JAX.

MEAN_REPLICAS = 10.0
"""Replicas (inference servers) per cell ~ max(1, Poisson(10)) (seed App. B)."""
TOKEN_TIME_CV = 0.2
"""Coefficient of variation of the per-cell token times across cells (seed App. B)."""


_POISSON_CDF = scipy.stats.poisson.cdf(np.arange(200), MEAN_REPLICAS)


def _draw(u: np.ndarray, group: np.ndarray, sizes: np.ndarray, min_cells: int, max_cells: int):
    """Turn uniform rows `(B, W)` into the random part of each scenario (vectorised).

    Layout of a row: cell count, region order (R), region count, site priorities (S),
    replicas, two token-time normals, Dirichlet exponentials, outage priorities (each
    `max_cells`), burst source.
    """
    B = u.shape[0]
    S, R, M = group.shape[0], sizes.shape[0], max_cells
    cols = np.cumsum([0, 1, R, 1, S, M, 2 * M, M, M, 1])
    block = [u[:, cols[q] : cols[q + 1]] for q in range(len(cols) - 1)]
    u_n, u_reg, u_m, u_site, u_rep, u_z, u_e, u_out, u_burst = block
    n = min_cells + np.floor(u_n[:, 0] * (max_cells - min_cells + 1)).astype(np.int64)
    # Regions in a random order; keep the first m, or more when they hold fewer than n sites.
    order = np.argsort(u_reg, axis=1)
    rank = np.argsort(order, axis=1)
    m = 1 + np.floor(u_m[:, 0] * np.minimum(R, n)).astype(np.int64)
    enough = np.argmax(np.cumsum(sizes[order], axis=1) >= n[:, None], axis=1) + 1
    chosen_region = rank < np.maximum(m, enough)[:, None]  # (B, R)
    # n distinct sites uniformly among the sites of the chosen regions, listed in table order.
    prio = np.where(chosen_region[:, group], u_site, 2.0)
    picked = np.argsort(prio, axis=1)[:, :M]
    slot = np.arange(M)[None, :]
    site = np.sort(np.where(slot < n[:, None], picked, S), axis=1)
    # Poisson(10) by inversion of its distribution function, then at least one replica.
    replicas = np.maximum(np.searchsorted(_POISSON_CDF, u_rep, side="right"), 1)
    z = scipy.special.ndtri(u_z).reshape(B, 2, M)
    e = -np.log(u_e)
    burst = np.floor(u_burst[:, 0] * n).astype(np.int64)
    return n, site, replicas, z, e, burst, u_out


def _check_options(
    seed, count, start, min_cells, max_cells, utilisation, duration_scale, token_time_cv
) -> tuple[int, int, int, int, int, float, float, float]:
    """`generate`'s arguments, checked (see its **Raises**), as plain ints and floats."""
    seed = integer("seed", seed, 0)
    if seed >= 2**63:
        raise ValueError(f"seed = {seed} is invalid: expected an integer < 2**63")
    count = integer("count", count, 1)
    start = integer("start", start, 0)
    if start + count > 2**32:
        raise ValueError(f"start + count = {start + count} is invalid: indices must be < 2**32")
    n_sites = _site_arrays()[0].shape[0]
    min_cells = integer("min_cells", min_cells, 1)
    max_cells = integer("max_cells", max_cells, 1)
    if min_cells > max_cells:
        raise ValueError(
            f"min_cells = {min_cells} > max_cells = {max_cells}: expected min_cells <= max_cells"
        )
    if max_cells > n_sites:
        raise ValueError(
            f"max_cells = {max_cells} is invalid: the site table (data/regions.json) has "
            f"{n_sites} sites and cells sit at distinct sites"
        )
    rho = number("utilisation", utilisation, lo=0, lo_open=True, hi=1.0, hi_open=True)
    y = number("duration_scale", duration_scale, lo=0, lo_open=True)
    cv = number("token_time_cv", token_time_cv, lo=0)
    return seed, count, start, min_cells, max_cells, rho, y, cv


def generate(
    seed: int,
    count: int,
    *,
    min_cells: int = 2,
    max_cells: int = 10,
    utilisation: float = 0.8,
    duration_scale: float = 1.0,
    token_time_cv: float = TOKEN_TIME_CV,
    start: int = 0,
) -> GeneratedScenarios:
    """Draw scenarios `start, ..., start+count-1` of stream `seed` (seed App. B).

    Per scenario (theory/generator.md, *Draw*): $n \\sim U\\{$`min_cells`..`max_cells`$\\}$
    cells at distinct sites of a random subset of regions; $k_j = \\max(1,
    \\mathrm{Poisson}(10))$; $t_{p,j}, t_{d,j}$ log-normal with mean `PREFILL_TOKEN_TIME_S`,
    `DECODE_TOKEN_TIME_S` and coefficient of variation `token_time_cv` (default
    `TOKEN_TIME_CV` = 0.2; 0: identical hardware in every cell), divided by
    $y$ = `duration_scale`; the softplus model
    of `server_service` scaled by $k_j$; buffer `buffer_size`; demand
    $\\lambda = \\rho\\sum_j\\bar\\mu_j\\,w$, $w \\sim \\mathrm{Dirichlet}(1,\\dots,1)$ with
    $\\rho$ = `utilisation`.

    Scenario `i` depends only on `(seed, i)` and the options: the same index gives the same
    scenario in any batch. All scenarios are drawn in one jitted, vmapped call.

    **Raises:** `ValueError` naming the argument, for counts or cell numbers out of range,
    `utilisation` outside (0, 1), a non-positive `duration_scale` or a negative or
    non-finite `token_time_cv`; `X64Error` while JAX's x64 mode is off (the draws are
    float64, so that a scenario is the same in every run).
    """
    require_x64("generate")
    seed, count, start, min_cells, max_cells, rho, y, cv = _check_options(
        seed, count, start, min_cells, max_cells, utilisation, duration_scale, token_time_cv
    )
    group, sizes, tau, names, region_names = _site_arrays()
    n_sites = group.shape[0]

    indices = np.arange(start, start + count, dtype=np.int64)
    width = 1 + sizes.shape[0] + 1 + n_sites + 5 * max_cells + 1
    u = _uniforms(seed, indices, width, stream=0)
    n, site, replicas, z, e, burst, outage_u = _draw(u, group, sizes, min_cells, max_cells)
    mask = site < n_sites
    site = np.where(mask, site, -1).astype(np.int64)
    replicas = np.where(mask, replicas, 1).astype(np.int64)

    sig = math.sqrt(math.log1p(cv**2))
    lognormal = np.exp(sig * z - 0.5 * sig**2)  # mean 1, CV token_time_cv
    tp = PREFILL_TOKEN_TIME_S * lognormal[:, 0] / y
    td = DECODE_TOKEN_TIME_S * lognormal[:, 1] / y
    srv = server_service(tp, td)
    k = replicas.astype(float)
    capacity = np.where(mask, k * srv["capacity"], 1.0)
    base_latency = np.where(mask, srv["base_latency"], 1.0)
    knee = np.where(mask, k * srv["knee"], 0.0)
    width = np.where(mask, k * srv["width"], 1.0)
    a0 = base_latency - knee / capacity
    buffer = np.where(mask, buffer_size(capacity, base_latency, knee, width), 1.0)

    w = np.where(mask, e, 0.0)
    w = w / w.sum(axis=1, keepdims=True)
    total = rho * capacity.sum(axis=1, where=mask)
    demand = total[:, None] * w

    lat = tau[np.where(mask, site, 0)[:, :, None], np.where(mask, site, 0)[:, None, :]]
    lat = np.where(mask[:, :, None] & mask[:, None, :], lat, 0.0)

    cuttable = mask & (replicas > 1)
    outage_order = np.argsort(np.where(cuttable, outage_u, 2.0 + outage_u), axis=1, kind="stable")

    site_or_pad = np.where(mask, site, n_sites)
    return GeneratedScenarios(
        seed=seed,
        indices=_readonly(indices),
        utilisation=rho,
        duration_scale=y,
        token_time_cv=cv,
        mask=_readonly(mask),
        n_cells=_readonly(n.astype(np.int64)),
        site=_readonly(site),
        cell_names=_readonly(names[site_or_pad]),
        region=_readonly(region_names[site_or_pad]),
        replicas=_readonly(replicas),
        prefill_token_time=_readonly(np.where(mask, tp, 0.0)),
        decode_token_time=_readonly(np.where(mask, td, 0.0)),
        server_capacity=_readonly(np.where(mask, srv["capacity"], 1.0)),
        capacity=_readonly(capacity),
        base_latency=_readonly(base_latency),
        knee=_readonly(knee),
        width=_readonly(width),
        a0=_readonly(a0),
        buffer=_readonly(buffer),
        demand=_readonly(demand),
        latency=_readonly(lat),
        burst_cell=_readonly(burst.astype(np.int64)),
        outage_order=_readonly(outage_order.astype(np.int64)),
    )


@functools.lru_cache(maxsize=4)
def _generate_kept(
    seed: int, count: int, *, utilisation: float, duration_scale: float, token_time_cv: float
) -> GeneratedScenarios:
    """`generate(seed, count, ...)` kept for the next calls with the same options (the
    experiment's variants of a tick, noise or fit sweep draw the same scenarios; the
    buffers' bisection dominates a draw). The result is the same read-only object, so
    every call sees the same numbers bit for bit."""
    return generate(
        seed,
        count,
        utilisation=utilisation,
        duration_scale=duration_scale,
        token_time_cv=token_time_cv,
    )


def scenario_dicts(
    gen: GeneratedScenarios,
    *,
    event: str = "none",
    trial: int = 0,
    horizon: float = 600.0,
    fluctuation: float = 0.1,
    **profile_options,
) -> list[dict]:
    """The batch as JSON-shaped dicts of `scenario_from_dict` (docs/scenarios.md).

    Each cell carries `name`, `arrival_rate` (a number when constant, else a
    piecewise-linear `{"times", "rates"}` profile from `arrival_profiles`), `replicas`,
    the softplus `service`, `buffer` (requests), the App.-B `servers` (`count` = replicas,
    the cell's token times, `DECODE_ENGINES` engines of `DECODE_SLOTS` slots) and, for
    cells cut by an outage, `replica_schedule` `{"times": [0, t0, t1], "replicas": [k, 1,
    k]}`. `latency` is the full one-way matrix (every arc allowed); `workload` the token
    laws `WORKLOAD`. `profile_options` go to `arrival_profiles`.

    **Raises:** `ValueError` naming a bad argument (see `arrival_profiles`).
    """
    t, rates = arrival_profiles(
        gen,
        event=event,
        trial=trial,
        horizon=horizon,
        fluctuation=fluctuation,
        **profile_options,
    )
    st, sk = replica_schedules(gen, event=event, horizon=horizon)
    out = []
    for b in range(gen.count):
        n = int(gen.n_cells[b])
        cells = []
        for j in range(n):
            r = rates[b, j]
            rate = float(r[0]) if np.all(r == r[0]) else {"times": t.tolist(), "rates": r.tolist()}
            cell = {
                "name": str(gen.cell_names[b, j]),
                "arrival_rate": rate,
                "replicas": int(gen.replicas[b, j]),
                "service": {
                    "model": "softplus",
                    "base_latency": float(gen.base_latency[b, j]),
                    "capacity": float(gen.capacity[b, j]),
                    "knee": float(gen.knee[b, j]),
                    "width": float(gen.width[b, j]),
                },
                "buffer": float(gen.buffer[b, j]),
                "servers": {
                    "count": int(gen.replicas[b, j]),
                    "prefill_token_time": float(gen.prefill_token_time[b, j]),
                    "decode_token_time": float(gen.decode_token_time[b, j]),
                    "decode_engines": DECODE_ENGINES,
                    "slots": DECODE_SLOTS,
                },
            }
            if np.any(sk[b, j] != sk[b, j, 0]):
                cell["replica_schedule"] = {
                    "times": st.tolist(),
                    "replicas": [int(v) for v in sk[b, j]],
                }
            cells.append(cell)
        idx = int(gen.indices[b])
        out.append(
            {
                "name": f"gen-s{gen.seed}-i{idx}-{event}-t{trial}",
                "description": (
                    f"dlbfluid.generate(seed={gen.seed}) scenario {idx}: utilisation "
                    f"{gen.utilisation:g}, duration scale {gen.duration_scale:g}, token-time CV "
                    f"{gen.token_time_cv:g}, event "
                    f"{event!r}, trial {trial}, fluctuation {fluctuation:g}, horizon "
                    f"{horizon:g} s"
                ),
                "cells": cells,
                "latency": gen.latency[b, :n, :n].tolist(),
                "workload": WORKLOAD,
            }
        )
    return out
