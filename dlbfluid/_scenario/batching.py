"""Padding and batching: one scenario padded to a larger cell count (`pad_scenario`), and
scenarios of different sizes and service laws stacked along a leading batch axis
(`stack_scenarios`). Padded cells have zero arrivals, no arcs and inert service laws;
padding happens in Python, before anything is traced.
"""

from __future__ import annotations

from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._registry import SERVICE_MODELS
from .._runtime.eager import to_device
from .._service import ServiceModel, law
from .model import NO_SESSIONS, Scenario, ServerCells, Workload, _server_cells


def _param_default(sv: ServiceModel, key: str) -> float:
    for name in sv.laws:
        if key in law(name).defaults:
            return law(name).defaults[key]
    return 1.0


def _repeat_last(width: int | None, *rows, what: str = "columns") -> list[np.ndarray]:
    """Each `(n, W)` array of `rows` widened to `width` columns (None: as it is) by
    repeating its last column: a profile or schedule that holds its last entry."""
    arrays = [np.asarray(r) for r in rows]
    W = arrays[0].shape[-1]
    width = W if width is None else width
    if width < W:
        raise ValueError(f"cannot pad {W} {what} to {width}")
    return [np.concatenate([a, np.repeat(a[:, -1:], width - W, axis=1)], axis=1) for a in arrays]


def pad_scenario(
    scn: Scenario,
    n: int,
    n_breakpoints: int | None = None,
    n_schedule: int | None = None,
    n_slowdown: int | None = None,
    *,
    laws: tuple[str, ...] | None = None,
    est_laws: tuple[str, ...] | None = None,
    with_servers: bool = False,
) -> Scenario:
    """Pad one scenario to `n` cells (`n_breakpoints` arrival breakpoints, `n_schedule`
    replica-schedule entries, `n_slowdown` service-schedule entries); `laws`, `est_laws`
    widen the service tables of `service` and `estimate` to those laws (for stacking
    scenarios of different laws);
    `with_servers` gives a scenario without `servers`/`workload` inert ones (no cell has
    servers; a unit workload), so that it stacks with scenarios that have them."""
    m = scn.n_cells
    if n < m:
        raise ValueError(f"cannot pad a {m}-cell scenario to n = {n} cells")
    extra = n - m

    def cells(a, fill):
        a = np.asarray(a)
        return np.concatenate([a, np.full((extra,) + a.shape[1:], fill, dtype=a.dtype)])

    def square(a, fill):
        a = np.asarray(a)
        out = np.full((n, n), fill, dtype=a.dtype)
        out[:m, :m] = a
        return out

    times, rates = _repeat_last(
        n_breakpoints, scn.arrival_times, scn.arrival_rates, what="arrival breakpoints"
    )
    rep_t, rep_k = _repeat_last(
        n_schedule, scn.replica_times, scn.replica_counts, what="replica-schedule entries"
    )
    slow_t, slow_s = _repeat_last(
        n_slowdown, scn.slowdown_times, scn.slowdown_factors, what="service-schedule entries"
    )

    def service(sv: ServiceModel, laws) -> ServiceModel:
        # Padded cells follow the table's first law at its default parameters: they never
        # see traffic, and a table of one law evaluates one law.
        sv = sv.with_laws(laws)
        first = law(sv.laws[0])
        params = {
            k: to_device(cells(v, first.defaults.get(k, _param_default(sv, k))))
            for k, v in sv.params.items()
        }
        return ServiceModel(
            to_device(cells(sv.model, SERVICE_MODELS.index(sv.laws[0]))), params, laws=sv.laws
        )

    sv = scn.servers
    if sv is None and with_servers:
        sv = _server_cells([None] * m)
    if sv is not None:
        sv = ServerCells(
            mask=to_device(cells(sv.mask, False)),
            count=to_device(cells(sv.count, 0)),
            prefill_token_time=to_device(cells(sv.prefill_token_time, 1.0)),
            decode_token_time=to_device(cells(sv.decode_token_time, 1.0)),
            decode_engines=to_device(cells(sv.decode_engines, 1)),
            slots=to_device(cells(sv.slots, 1)),
            cache_sessions=to_device(cells(sv.cache_sessions, 0)),
        )
    wl = scn.workload
    if wl is None and (with_servers or sv is not None):
        wl = Workload(
            *(to_device(np.asarray(v, dtype=float)) for v in (1, 1, 0, 1, 1, 0, *NO_SESSIONS))
        )
    return Scenario(
        arrival_times=to_device(cells(times, 0.0)),
        arrival_rates=to_device(cells(rates, 0.0)),
        replicas=to_device(cells(scn.replicas, 1.0)),
        service=service(scn.service, laws if laws is not None else scn.service.laws),
        estimate=service(scn.estimate, est_laws if est_laws is not None else scn.estimate.laws),
        buffer=to_device(cells(scn.buffer, np.inf)),
        replica_times=to_device(cells(rep_t, 0.0)),
        replica_counts=to_device(cells(rep_k, 1.0)),
        slowdown_times=to_device(cells(slow_t, 0.0)),
        slowdown_factors=to_device(cells(slow_s, 1.0)),
        latency=to_device(square(scn.latency, 0.0)),
        allowed=to_device(square(scn.allowed, False)),
        cell_mask=to_device(cells(scn.cell_mask, False)),
        initial_workload=to_device(cells(scn.initial_workload, 0.0)),
        initial_routing=to_device(square(scn.initial_routing, 0.0)),
        name=scn.name,
        cell_names=scn.cell_names,
        servers=sv,
        workload=wl,
    )


def stack_scenarios(
    scenarios: Sequence[Scenario], n_cells: int | None = None, *, laws: Sequence[str] = ()
) -> Scenario:
    """Pad scenarios to a common cell count and stack them along a new leading axis.

    The service models present in a batch are static: only their formulas are compiled
    and evaluated, so two batches of the same shape but different sets of models compile
    separately. `laws` adds models to the set (e.g. `("mm1", "softplus")` for batches that
    should share one compiled program whichever of the two they contain)."""
    scenarios = list(scenarios)
    if not scenarios:
        raise ValueError("stack_scenarios needs at least one scenario")
    n = max(s.n_cells for s in scenarios) if n_cells is None else n_cells
    P = max(s.arrival_times.shape[-1] for s in scenarios)
    Q = max(s.replica_times.shape[-1] for s in scenarios)
    S = max(s.slowdown_times.shape[-1] for s in scenarios)
    svc = tuple(dict.fromkeys([*laws, *(m for s in scenarios for m in s.service.laws)]))
    est = tuple(dict.fromkeys([*laws, *(m for s in scenarios for m in s.estimate.laws)]))
    with_servers = any(s.servers is not None or s.workload is not None for s in scenarios)
    padded = [
        pad_scenario(s, n, P, Q, S, laws=svc, est_laws=est, with_servers=with_servers).strip()
        for s in scenarios
    ]
    leaves = [eqx.filter(p, eqx.is_array) for p in padded]
    stacked = jax.tree_util.tree_map(_stack, *leaves)
    return eqx.combine(stacked, padded[0])


def _stack(*xs):
    """`jnp.stack(xs)`, stacked on the host (copies only: the same values and dtype) so
    that each new leaf shape does not compile a program of its own; weakly typed leaves
    keep `jnp.stack` (numpy would drop the weak type)."""
    if any(getattr(x, "weak_type", False) for x in xs):
        return jnp.stack(xs)
    return to_device(np.stack([np.asarray(x) for x in xs]))
