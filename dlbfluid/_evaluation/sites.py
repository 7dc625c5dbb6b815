"""The generator's geography (seed App. B; theory/generator.md, *Network*): the cloud sites
of `data/regions.json`, grouped by region, and the one-way latency between two sites, the
great-circle distance at the speed of light in fibre plus a fixed overhead.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from importlib import resources

import numpy as np

EARTH_RADIUS_KM = 6371.0088
"""Mean Earth radius (IUGG), the sphere of the haversine distance."""
SIGNAL_SPEED_KM_PER_S = 2.0 / 3.0 * 299_792.458
"""Light in optical fibre: two thirds of its speed in vacuum (about 200 km/ms)."""
LATENCY_OVERHEAD_S = 1.0e-3
"""Fixed one-way overhead between distinct sites (switching, serialisation, routers)."""


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
