"""The scenario sources of `verify`: random networks that satisfy Assumptions 1-3
(`random_network`, `draw_scenario`) and the App.-B generator's scenarios as the theorem
takes them (`draw_appb`)."""

from __future__ import annotations

import math

import numpy as np

from .._evaluation.generator import generate, scenario_dicts
from .._scenario import check_capacity, scenario_from_dict


def random_network(
    rng: np.random.Generator,
    n: int,
    *,
    load: tuple[float, float] = (0.4, 0.85),
    residency: float = 0.15,
    max_latency: float = 0.15,
) -> dict:
    """A random scenario that satisfies Assumptions 1-3 (theory/lyapunov.md, *Generator*).

    * cells on the unit square; one-way latency $\\tau_{ij}$ = `max_latency` $\\times$
      distance $/\\sqrt2$, $\\tau_{ii} = 0$;
    * capacities $\\bar\\mu_j \\sim$ LogNormal(log 4, 0.4); half the cells M/M/1, half softplus
      with $L_0 \\sim U[0.5, 1.5]$, knee $N_0 = u L_0\\bar\\mu$, $u \\sim U[0.1, 0.8]$ (so
      $a_0 = L_0(1-u) > 0$: Assumptions 1 and 3 for all three costs), width $\\sim U[0.3, 2]$;
    * replicas $\\sim$ 1 + Poisson(3);
    * each off-diagonal arc is removed with probability `residency` (self-arcs stay, so
      every cell keeps an in-neighbour and an allowed arc);
    * total demand $\\rho\\sum_j\\bar\\mu_j$ with $\\rho \\sim U[\\text{load}]$, split by a
      Dirichlet(1) draw; redrawn until Assumption 2 (strict feasibility) holds.
    """
    pos = rng.random((n, 2))
    dist = np.linalg.norm(pos[:, None] - pos[None], axis=-1) / math.sqrt(2.0)
    tau = max_latency * dist
    keep = (rng.random((n, n)) >= residency) | np.eye(n, dtype=bool)
    caps = np.exp(rng.normal(math.log(4.0), 0.4, n))
    cells = []
    for j in range(n):
        if j % 2 == 0:
            svc = {"model": "mm1", "capacity": float(caps[j])}
        else:
            L0 = rng.uniform(0.5, 1.5)
            svc = {
                "model": "softplus",
                "base_latency": L0,
                "capacity": float(caps[j]),
                "knee": rng.uniform(0.1, 0.8) * L0 * caps[j],
                "width": rng.uniform(0.3, 2.0),
            }
        cells.append(
            {
                "name": f"c{j}",
                "replicas": int(1 + rng.poisson(3)),
                "service": svc,
                "arrival_rate": 0.0,
            }
        )
    latency = [[float(tau[i, j]) if keep[i, j] else None for j in range(n)] for i in range(n)]
    for _ in range(100):
        rho = rng.uniform(*load)
        lam = rho * caps.sum() * rng.dirichlet(np.ones(n))
        for j in range(n):
            cells[j]["arrival_rate"] = float(lam[j])
        d: dict = {"name": f"random-{n}", "cells": cells, "latency": latency}
        try:
            check_capacity(scenario_from_dict(d, allow_overload=True))
            d["utilisation"] = float(rho)
            return d
        except ValueError:
            continue
    raise RuntimeError("could not draw a feasible demand split in 100 tries")  # pragma: no cover


def draw_scenario(seed: int, index: int, *, n_cells=(2, 6), **kwargs) -> dict:
    """Scenario `index` of the stream `seed`: independent of chunking and of resumption."""
    rng = np.random.default_rng([seed, index])
    n = int(rng.integers(n_cells[0], n_cells[1] + 1))
    d = random_network(rng, n, **kwargs)
    d["index"] = index
    return d


def draw_appb(seed: int, index: int, *, n_cells=(2, 6)) -> dict:
    """Scenario `index` of the App.-B generator's stream `seed` (`dlbfluid.generate`,
    theory/generator.md) as Theorem 1 takes it: constant demand (no event, no
    fluctuation) and unbounded queues (the seed's finite buffers drop flow, which the
    fluid model of the theorem does not)."""
    return draw_appb_many(seed, [index], n_cells=n_cells)[0]


def draw_appb_many(seed: int, indices, *, n_cells=(2, 6)) -> list[dict]:
    """`draw_appb` for several indices, one `generate` call per contiguous run of them
    (each call compiles nothing new and costs about as much as one scenario)."""
    indices = [int(i) for i in indices]
    out: dict[int, dict] = {}
    k = 0
    while k < len(indices):
        j = k
        while j + 1 < len(indices) and indices[j + 1] == indices[j] + 1:
            j += 1
        gen = generate(seed, j - k + 1, min_cells=n_cells[0], max_cells=n_cells[1],
                       start=indices[k])  # fmt: skip
        for i, d in zip(indices[k : j + 1], scenario_dicts(gen, horizon=1.0, fluctuation=0.0)):
            for cell in d["cells"]:
                cell.pop("buffer", None)
            d["index"] = i
            out[i] = d
        k = j + 1
    return [out[i] for i in indices]


class _AppB:
    """The App.-B source of `verify`: `draw_appb` per index, `many` per chunk."""

    def __init__(self, n_cells):
        self.n_cells = n_cells

    def __call__(self, seed: int, index: int) -> dict:
        return draw_appb(seed, index, n_cells=self.n_cells)

    def many(self, seed: int, indices) -> list[dict]:
        return draw_appb_many(seed, indices, n_cells=self.n_cells)
