"""A batch of generated scenarios (`GeneratedScenarios`): the read-only numpy arrays that
`generate` draws and that the events and `scenario_dicts` read.
"""

from __future__ import annotations

import dataclasses

import numpy as np


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
