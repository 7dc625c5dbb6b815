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

import dataclasses
import functools
import json
import math
from importlib import resources

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import scipy.special
import scipy.stats

from .._defaults import DURATION_SCALES as DURATION_SCALES
from .._precision import require_x64
from .._service import Softplus

# ----------------------------------------------------------------------------------------
# Constants (theory/generator.md lists each with its reason)
# ----------------------------------------------------------------------------------------

EARTH_RADIUS_KM = 6371.0088
"""Mean Earth radius (IUGG), the sphere of the haversine distance."""
SIGNAL_SPEED_KM_PER_S = 2.0 / 3.0 * 299_792.458
"""Light in optical fibre: two thirds of its speed in vacuum (about 200 km/ms)."""
LATENCY_OVERHEAD_S = 1.0e-3
"""Fixed one-way overhead between distinct sites (switching, serialisation, routers)."""

MEAN_REPLICAS = 10.0
"""Replicas (inference servers) per cell ~ max(1, Poisson(10)) (seed App. B)."""
PREFILL_ENGINES = 1
DECODE_ENGINES = 2
DECODE_SLOTS = 4
"""One server: 1 prefill engine and 2 decode engines of 4 parallel slots (seed App. B)."""

PREFILL_TOKEN_TIME_S = 1.25e-4
"""Mean prefill time per token (8000 prompt tokens/s per prefill engine)."""
DECODE_TOKEN_TIME_S = 4.0e-3
"""Mean decode time per output token and slot (250 tokens/s per slot)."""
TOKEN_TIME_CV = 0.2
"""Coefficient of variation of the per-cell token times across cells (seed App. B)."""

BUFFER_LOAD = 0.98
"""A cell's buffer holds the steady-state workload of that cell at 98% of its capacity."""
EVENT_LEVEL = 0.95
"""Total utilisation reached by the burst and exceeded by the outage (seed App. B.3)."""
EVENT_WINDOW = (0.3, 0.7)
"""Burst/outage window as fractions of the horizon: minutes 3 to 7 of 10 (seed App. B.3)."""

EVENTS = ("none", "burst", "outage", "spikes")
# `DURATION_SCALES`, the duration scalings $y$, is in `_defaults` (imported above): the
# experiment's kinds list them without importing JAX.


@dataclasses.dataclass(frozen=True)
class ShiftedGamma:
    """Token count $X = \\delta + G$, $G \\sim \\mathrm{Gamma}(\\alpha, \\theta)$ (shape, scale).

    Mean $\\delta + \\alpha\\theta$, variance $\\alpha\\theta^2$, squared coefficient of
    variation $\\alpha\\theta^2/(\\delta+\\alpha\\theta)^2$ (theory/generator.md, *Workload*).
    """

    shift: float
    shape: float
    scale: float

    @property
    def mean(self) -> float:
        return self.shift + self.shape * self.scale

    @property
    def scv(self) -> float:
        return self.shape * self.scale**2 / self.mean**2

    def sample(self, rng: np.random.Generator, size=None) -> np.ndarray:
        """Draw token counts (real-valued; the fluid model needs only the moments)."""
        return self.shift + rng.gamma(self.shape, self.scale, size)


PREFILL_TOKENS = ShiftedGamma(shift=100.0, shape=1.5, scale=600.0)
"""Prompt tokens per request: mean 1000, SCV 0.54."""
DECODE_TOKENS = ShiftedGamma(shift=10.0, shape=1.2, scale=200.0)
"""Output tokens per request: mean 250, SCV 0.768."""
WORKLOAD = {
    "prompt_tokens": dataclasses.asdict(PREFILL_TOKENS),
    "output_tokens": dataclasses.asdict(DECODE_TOKENS),
}
"""The scenario files' `"workload"` of the generated scenarios (the two laws above)."""


# ----------------------------------------------------------------------------------------
# Sites and network latency
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Site:
    """One cloud site of `data/regions.json`."""

    name: str
    city: str
    region: str
    latitude: float
    longitude: float


@functools.cache
def load_sites() -> tuple[Site, ...]:
    """The site table, grouped by region (sites of one region are contiguous)."""
    text = resources.files("dlbfluid").joinpath("data/regions.json").read_text()
    data = json.loads(text)
    sites = []
    for region, rows in data["regions"].items():
        for row in rows:
            sites.append(
                Site(row["name"], row["city"], region, float(row["latitude"]), row["longitude"])
            )
    return tuple(sites)


def haversine_km(lat1, lon1, lat2, lon2) -> np.ndarray:
    """Great-circle distance (km) on a sphere of radius `EARTH_RADIUS_KM`.

    $d = 2R\\arcsin\\sqrt{\\sin^2\\frac{\\Delta\\varphi}{2} + \\cos\\varphi_1\\cos\\varphi_2
    \\sin^2\\frac{\\Delta\\lambda}{2}}$ with latitudes $\\varphi$ and longitudes $\\lambda$
    in degrees (broadcasting).
    """
    p1, p2 = np.radians(lat1), np.radians(lat2)
    dp = p2 - p1
    dl = np.radians(np.asarray(lon2) - np.asarray(lon1))
    h = np.sin(dp / 2) ** 2 + np.cos(p1) * np.cos(p2) * np.sin(dl / 2) ** 2
    return 2.0 * EARTH_RADIUS_KM * np.arcsin(np.sqrt(np.clip(h, 0.0, 1.0)))


def network_latency(latitude, longitude) -> np.ndarray:
    """One-way latency matrix (s) between sites: $\\tau_{ij} = d_{ij}/v + \\tau_0$, $\\tau_{ii}=0$.

    $v$ = `SIGNAL_SPEED_KM_PER_S` (2/3 of c), $\\tau_0$ = `LATENCY_OVERHEAD_S`
    (theory/generator.md, *Network*). Distinct entries of the inputs are distinct sites.
    """
    lat = np.asarray(latitude, dtype=float)
    lon = np.asarray(longitude, dtype=float)
    d = haversine_km(lat[:, None], lon[:, None], lat[None, :], lon[None, :])
    tau = d / SIGNAL_SPEED_KM_PER_S + LATENCY_OVERHEAD_S
    np.fill_diagonal(tau, 0.0)
    return tau


@functools.cache
def _site_arrays():
    sites = load_sites()
    regions = list(dict.fromkeys(s.region for s in sites))
    group = np.array([regions.index(s.region) for s in sites], dtype=np.int32)
    sizes = np.bincount(group, minlength=len(regions)).astype(np.int32)
    tau = network_latency([s.latitude for s in sites], [s.longitude for s in sites])
    names = np.array([s.name for s in sites] + [""], dtype=object)
    region_names = np.array([s.region for s in sites] + [""], dtype=object)
    return group, sizes, tau, names, region_names


# ----------------------------------------------------------------------------------------
# Server model -> softplus fluid model
# ----------------------------------------------------------------------------------------


def server_service(
    prefill_token_time,
    decode_token_time,
    *,
    prefill_tokens: ShiftedGamma = PREFILL_TOKENS,
    decode_tokens: ShiftedGamma = DECODE_TOKENS,
) -> dict[str, np.ndarray]:
    """Softplus parameters of one disaggregated server (theory/generator.md, *Server*).

    With $T_p = \\bar P t_p$ and $T_d = \\bar D t_d$ the mean prefill and decode work of a
    request ($\\bar P$, $\\bar D$ mean token counts; $t_p$, $t_d$ token times):
    - stage capacities $c_p = 1/T_p$ (one prefill engine), $c_d = 8/T_d$ (2 x 4 slots);
      server capacity $c = \\min(c_p, c_d)$;
    - unloaded latency $L_0 = T_p + T_d$;
    - asymptote offset $a_0 = (1 + c_s^2)/(2c)$, $c_s^2$ the SCV of the bottleneck stage's
      token count (heavy-traffic match of the $1/(1-\\rho)$ pole, Pollaczek-Khinchine);
    - saturation concurrency $n^* = cL_0$, knee $n_0 = n^* - c\\,a_0$ (so
      $a_0 = L_0 - n_0/c > 0$), width $s = \\sqrt{n^*}$ (square-root staffing scale).

    **Returns:** a dict of arrays `capacity`, `base_latency`, `knee`, `width`, `a0`,
    `prefill_bound` (True where prefill is the bottleneck).
    """
    tp = np.asarray(prefill_token_time, dtype=float)
    td = np.asarray(decode_token_time, dtype=float)
    Tp = prefill_tokens.mean * tp
    Td = decode_tokens.mean * td
    cp = PREFILL_ENGINES / Tp
    cd = DECODE_ENGINES * DECODE_SLOTS / Td
    prefill_bound = cp <= cd
    c = np.minimum(cp, cd)
    scv = np.where(prefill_bound, prefill_tokens.scv, decode_tokens.scv)
    L0 = Tp + Td
    a0 = (1.0 + scv) / (2.0 * c)
    nstar = c * L0
    return {
        "capacity": c,
        "base_latency": L0,
        "knee": nstar - c * a0,
        "width": np.sqrt(nstar),
        "a0": a0,
        "prefill_bound": prefill_bound,
    }


def softplus_latency(N, capacity, base_latency, knee, width) -> np.ndarray:
    """$\\ell(N) = L_0 + (s/\\bar\\mu)\\,\\mathrm{sp}((N-N_0)/s)$, float64 (the softplus law,
    `dlbfluid._service.Softplus.latency`), as numpy."""
    p = {
        "capacity": jnp.asarray(capacity, jnp.float64),
        "base_latency": jnp.asarray(base_latency, jnp.float64),
        "knee": jnp.asarray(knee, jnp.float64),
        "width": jnp.asarray(width, jnp.float64),
    }
    return np.asarray(Softplus().latency(p, jnp.asarray(N, jnp.float64)))


def buffer_size(capacity, base_latency, knee, width, *, load: float = BUFFER_LOAD) -> np.ndarray:
    """Workload $B$ with $\\mu(B) = \\rho_B\\bar\\mu$: the steady state at load $\\rho_B$.

    Solved by bisection on $[0, B_{hi}]$ with the bound (theory/generator.md, *Buffer*)
    $B \\le \\rho_B\\max\\{\\bar\\mu L_0 + s\\ln 2,\\ (\\bar\\mu a_0 + s\\ln2)/(1-\\rho_B)\\}$;
    at most 200 halvings, stopped once one changes neither end (float64 resolution, about
    56 halvings: the ends are then fixed, so the result is that of all 200).
    """
    if not 0.0 < load < 1.0:
        raise ValueError(f"load = {load!r} is invalid: expected 0 < load < 1")
    C, L0, N0, s = (np.asarray(v, dtype=float) for v in (capacity, base_latency, knee, width))
    a0 = L0 - N0 / C
    lo = np.zeros(np.broadcast_shapes(C.shape, L0.shape, N0.shape, s.shape))
    hi = (
        1.01
        * load
        * np.maximum(C * L0 + s * math.log(2.0), (C * a0 + s * math.log(2.0)) / (1.0 - load))
        + 1.0
    )
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        below = mid < load * C * softplus_latency(mid, C, L0, N0, s)  # mu(mid) < load * C
        new_lo, new_hi = np.where(below, mid, lo), np.where(below, hi, mid)
        if np.array_equal(new_lo, lo, equal_nan=True) and np.array_equal(
            new_hi, hi, equal_nan=True
        ):
            break
        lo, hi = new_lo, new_hi
    return 0.5 * (lo + hi)


# ----------------------------------------------------------------------------------------
# The vectorised draw
# ----------------------------------------------------------------------------------------


_BLOCK = 64


@jax.jit
def _uniform_blocks(seed, rows):
    """Row `r` of the result holds 64 uniforms keyed by `(seed, *rows[r])` only.

    `rows[r] = (index, stream, trial, block)`. Uniforms are multiples of $2^{-52}$ shifted
    by $2^{-53}$, so they lie in the open interval (0, 1) and every transform below
    (logarithm, normal quantile) is finite.
    """

    def one(row):
        key = jr.key(seed, impl="threefry2x32")
        for q in range(4):
            key = jr.fold_in(key, row[q])
        return jr.uniform(key, (_BLOCK,), dtype=jnp.float64) + 2.0**-53

    return jax.vmap(one)(rows)


def _uniforms(seed: int, indices: np.ndarray, width: int, *, stream: int, trial: int = 0):
    """`(B, width)` uniforms, row `b` a function of `(seed, indices[b], stream, trial)`.

    Drawn in blocks of 64 per row; the number of rows is padded to a power of two so that
    batches of any size share a few compiled shapes.
    """
    nb = -(-width // _BLOCK)
    B = indices.shape[0]
    rows = np.zeros((B, nb, 4), dtype=np.uint32)
    rows[:, :, 0] = np.asarray(indices, dtype=np.uint32)[:, None]
    rows[:, :, 1] = stream
    rows[:, :, 2] = trial
    rows[:, :, 3] = np.arange(nb, dtype=np.uint32)[None, :]
    flat = rows.reshape(B * nb, 4)
    padded = max(4096, 1 << (flat.shape[0] - 1).bit_length())
    flat = np.concatenate([flat, np.zeros((padded - flat.shape[0], 4), dtype=np.uint32)])
    u = np.asarray(_uniform_blocks(seed, jnp.asarray(flat)))[: B * nb]
    return u.reshape(B, nb * _BLOCK)[:, :width]


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


def _readonly(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    a.setflags(write=False)
    return a


@dataclasses.dataclass(frozen=True, eq=False)
class GeneratedScenarios:
    """A batch of `B` generated scenarios, padded to `n = max_cells` (theory/generator.md).

    Arrays are read-only numpy; padded cells carry the values `pad_scenario` uses
    (replicas 1, capacity 1, base latency 1, knee 0, width 1), zero demand and latency.

    **Fields:**
    - `seed`, `indices` `(B,)`: scenario `b` is draw `indices[b]` of stream `seed`.
    - `utilisation`, `duration_scale`, `token_time_cv`: the options of `generate`.
    - `mask` `(B, n)`: real cells; `n_cells` `(B,)`.
    - `site` `(B, n)`: row of `load_sites()` (-1 for padding); `cell_names`, `region`
      `(B, n)`: object arrays of strings ("" for padding).
    - `replicas` `(B, n)`: servers $k_j$.
    - `prefill_token_time`, `decode_token_time` `(B, n)`: $t_p, t_d$ (s/token, already
      divided by the duration scale).
    - `server_capacity` `(B, n)`: $c_j$; `capacity` $\\bar\\mu_j = k_jc_j$,
      `base_latency` $L_{0j}$, `knee` $N_{0j}$, `width` $s_j$ (softplus model of the cell),
      `buffer` $B_j$ (requests), `a0` $a_{0j} = L_{0j} - N_{0j}/\\bar\\mu_j$.
    - `demand` `(B, n)`: $\\lambda_i$ at the root routers (requests/s).
    - `latency` `(B, n, n)`: one-way $\\tau_{ij}$ (s).
    - `burst_cell` `(B,)`: slot of the burst's source cell.
    - `outage_order` `(B, n)`: slots in the order the outage cuts them (cells with one
      replica and padding last).
    """

    seed: int
    indices: np.ndarray
    utilisation: float
    duration_scale: float
    token_time_cv: float
    mask: np.ndarray
    n_cells: np.ndarray
    site: np.ndarray
    cell_names: np.ndarray
    region: np.ndarray
    replicas: np.ndarray
    prefill_token_time: np.ndarray
    decode_token_time: np.ndarray
    server_capacity: np.ndarray
    capacity: np.ndarray
    base_latency: np.ndarray
    knee: np.ndarray
    width: np.ndarray
    a0: np.ndarray
    buffer: np.ndarray
    demand: np.ndarray
    latency: np.ndarray
    burst_cell: np.ndarray
    outage_order: np.ndarray

    @property
    def count(self) -> int:
        return int(self.mask.shape[0])

    @property
    def max_cells(self) -> int:
        return int(self.mask.shape[1])

    def total_utilisation(self, demand=None, capacity=None) -> np.ndarray:
        """$\\sum_i\\lambda_i/\\sum_j\\bar\\mu_j$ per scenario (masked)."""
        lam = self.demand if demand is None else demand
        cap = self.capacity if capacity is None else capacity
        return np.where(self.mask, lam, 0.0).sum(1) / np.where(self.mask, cap, 0.0).sum(1)


def _check_int(field: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{field} = {value!r} is invalid: expected an integer >= {minimum}")
    return int(value)


def _check_positive(field: str, value, *, upper=None, upper_open=False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ValueError(f"{field} = {value!r} is invalid: expected a number")
    v = float(value)
    ok = math.isfinite(v) and v > 0
    if ok and upper is not None:
        ok = v < upper if upper_open else v <= upper
    if not ok:
        bound = "" if upper is None else f" and {'<' if upper_open else '<='} {upper}"
        raise ValueError(f"{field} = {value!r} is invalid: expected a finite number > 0{bound}")
    return v


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
    seed = _check_int("seed", seed, 0)
    if seed >= 2**63:
        raise ValueError(f"seed = {seed} is invalid: expected an integer < 2**63")
    count = _check_int("count", count, 1)
    start = _check_int("start", start, 0)
    if start + count > 2**32:
        raise ValueError(f"start + count = {start + count} is invalid: indices must be < 2**32")
    group, sizes, tau, names, region_names = _site_arrays()
    n_sites = group.shape[0]
    min_cells = _check_int("min_cells", min_cells, 1)
    max_cells = _check_int("max_cells", max_cells, 1)
    if min_cells > max_cells:
        raise ValueError(
            f"min_cells = {min_cells} > max_cells = {max_cells}: expected min_cells <= max_cells"
        )
    if max_cells > n_sites:
        raise ValueError(
            f"max_cells = {max_cells} is invalid: the site table (data/regions.json) has "
            f"{n_sites} sites and cells sit at distinct sites"
        )
    rho = _check_positive("utilisation", utilisation, upper=1.0, upper_open=True)
    y = _check_positive("duration_scale", duration_scale)
    if isinstance(token_time_cv, bool) or not (
        isinstance(token_time_cv, (int, float))
        and math.isfinite(token_time_cv)
        and token_time_cv >= 0
    ):
        raise ValueError(
            f"token_time_cv = {token_time_cv!r} is invalid: expected a finite number >= 0"
        )
    cv = float(token_time_cv)

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


# ----------------------------------------------------------------------------------------
# Events (seed App. B.3) and trial fluctuations
# ----------------------------------------------------------------------------------------


def burst_demand(gen: GeneratedScenarios, *, level: float = EVENT_LEVEL) -> np.ndarray:
    """Arrival rates `(B, n)` during a burst: the source `burst_cell` gains
    $\\Delta = \\rho_E\\sum_j\\bar\\mu_j - \\sum_i\\lambda_i$, so total utilisation is
    exactly $\\rho_E$ = `level` (theory/generator.md, *Burst*).

    **Raises:** `ValueError` if `level` is not above the batch's utilisation.
    """
    level = _check_positive("level", level, upper=1.0, upper_open=True)
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
    level = _check_positive("level", level)
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
    trial = _check_int("trial", trial, 0)
    if trial >= 2**32:
        raise ValueError(f"trial = {trial} is invalid: expected an integer < 2**32")
    horizon = _check_positive("horizon", horizon)
    if isinstance(fluctuation, bool) or not (
        isinstance(fluctuation, (int, float)) and math.isfinite(fluctuation) and fluctuation >= 0
    ):
        raise ValueError(f"fluctuation = {fluctuation!r} is invalid: expected a number >= 0")
    knot_spacing = _check_positive("knot_spacing", knot_spacing)
    spike_fraction = _check_positive("spike_fraction", spike_fraction, upper=1.0)
    spike_period = _check_positive("spike_period", spike_period)
    spike_width = _check_positive("spike_width", spike_width, upper=spike_period)

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
    horizon = _check_positive("horizon", horizon)
    t0, t1 = _window(horizon)
    k = gen.replicas
    kd = outage_replicas(gen) if event == "outage" else k
    return np.array([0.0, t0, t1]), np.stack([k, kd, k], axis=-1)


def scenario_dicts(
    gen: GeneratedScenarios,
    *,
    event: str = "none",
    trial: int = 0,
    horizon: float = 600.0,
    fluctuation: float = 0.1,
    **profile_options,
) -> list[dict]:
    """The batch as JSON-shaped dicts of `scenario_from_dict` (README, *Scenario files*).

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
