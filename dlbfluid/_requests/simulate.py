"""`simulate_requests`: the batched driver of the request-level twin."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from .._defaults import AFFINITY_MODES, ESTIMATION_MODES
from .._policies import AbstractPolicy, policy_from_name
from .._precision import require_x64
from .._results import RESULTS, view
from .._runtime.devices import accepted_options, per_device
from .._runtime.progress import Progress
from .._scenario import Scenario
from .._service.base import code as law_code
from .._simulate import _hist_len, _setup
from .._validate import integer, number, period_ticks
from .._validate import invalid as _bad
from . import admission as adm
from . import estimation as est_
from . import sessions as sess_
from ._leaf import AbstractLeaf, JoinShortestQueue, PowerOfD, leaf_from_name
from .fifo import FifoCells, ServiceClock
from .histogram import LatencyHistogram
from .loop import NONFINITE_ROUTING, Trial, _batched, init_state, run_tick
from .markov import MarkovCells
from .solution import RequestSolution

REQUEST_STATUS = view("success", "nonfinite", aliases={"overflow": "solver_failed"})
"""The `RESULTS` codes of `simulate_requests`. An overflow of a fixed-size array (cell
slots, server queues, arcs in flight) is reported as `solver_failed` (the solver's budget
was too small; `RequestSolution.overflow` says which array, `raise_for_status` what to
increase)."""

SESSION_SLOTS_MAX = 1 << 16
"""Largest number of session slots at a root (`dlbfluid._requests.sessions`)."""

SERVICES = ("markov", "servers")
"""The cell kinds of `simulate_requests(service=...)`."""


class _Config(eqx.Module):
    """The static configuration of one compiled run (hashable)."""

    service: str
    tick: float
    horizon: float
    warmup: float
    save_ticks: tuple[int, ...]
    hist: int
    slots: int
    arc_slots: int
    events: int
    max_servers: int
    histogram: LatencyHistogram
    # App.-B prefill/decode servers (`service="servers"` with a cell's `servers` object)
    prefill_decode: bool = False
    max_slots: int = 1
    # `service="servers"`: the admission-time engine's fixed sizes and the leaf rule
    sizes: adm.Sizes | None = None
    leaf: AbstractLeaf = JoinShortestQueue()
    # the probes' smoothing time constant (s; 0: none)
    smoothing: float = 0.0
    # online estimation (None: the oracle) and its refit and probe periods in ticks
    estimation: est_.OnlineEstimation | None = None
    refit_ticks: int = 0
    probe_ticks: int = 0
    # sessions and affinity (None: no sessions)
    affinity: sess_.Affinity | None = None


def _count(field: str, value, minimum: int = 1) -> int:
    return integer(field, value, minimum)


def _pow2(x: float) -> int:
    return 1 << max(int(math.ceil(x)) - 1, 1).bit_length()


def _shared(scn, scale, eta, policy: AbstractPolicy, cfg: _Config) -> dict:
    """The fields that every trial of one scenario reads, whichever kind of cell (`Trial`
    and `admission.Lane` both hold them): delays, policy arrays, scaled rates and buffers."""
    dtype = scn.latency.dtype
    h = jnp.asarray(cfg.tick, dtype)
    buffer = jnp.where(jnp.isfinite(scn.buffer), jnp.floor(scale * scn.buffer), jnp.inf)
    lam_max = jnp.where(scn.cell_mask, jnp.max(scn.arrival_rates, axis=-1), 0.0)
    return dict(
        scn=scn,
        setup=_setup(scn, eta, h, cfg.hist),
        aux=policy.prepare(scn, h, cfg.horizon),
        policy=policy,
        scale=scale,
        lam_max=lam_max,
        lam_cum=jnp.cumsum(scale * lam_max),
        buffer=buffer.astype(dtype),
        warmup=jnp.asarray(cfg.warmup, dtype),
        histogram=cfg.histogram,
        smoothing=cfg.smoothing,
    )


def _trial(scn, scale, eta, *, policy: AbstractPolicy, cfg: _Config) -> Trial:
    """What every trial of one scenario reads (`markov` cells): `_shared` and the cells."""
    return Trial(
        **_shared(scn, scale, eta, policy, cfg),
        cells=MarkovCells(scn.service, scale, cfg.slots),
        arc_slots=cfg.arc_slots,
        events=cfg.events,
    )


def _fifo_cells(scn, scale, cfg: _Config) -> FifoCells:
    """The FIFO servers of one scenario at scale $k$: $kk_j$ App.-B servers in a cell with a
    `servers` object (`servers.count`), $kk_j$ exponential FIFO servers of rate
    $\\bar\\mu_j/k_j$ in an M/M/1 cell without one."""
    mask = scn.cell_mask
    rate = scn.service.capacity / scn.replicas
    if not cfg.prefill_decode:
        n = mask.shape[0]
        servers = jnp.where(mask, jnp.round(scn.replicas * scale), 0).astype(jnp.int32)
        zero = jnp.zeros(n, rate.dtype)
        return FifoCells(
            servers=servers,
            prefill_token_time=zero,
            decode_token_time=zero,
            decode_slots=jnp.zeros(n, jnp.int32),
            exponential=jnp.ones(n, bool),
            rate=rate,
            prefill_bound=jnp.ones(n, bool),
            workload=scn.workload,
            tokens=False,
        )
    sv, w = scn.servers, scn.workload
    has = mask & sv.mask
    count = jnp.where(has, sv.count.astype(scale.dtype), scn.replicas)
    servers = jnp.where(mask, jnp.round(count * scale), 0).astype(jnp.int32)
    slots = jnp.where(has, sv.decode_engines * sv.slots, 0).astype(jnp.int32)
    prompt = w.prompt_shift + w.prompt_shape * w.prompt_scale
    output = w.output_shift + w.output_shape * w.output_scale
    prefill = sv.prefill_token_time * prompt
    decode = sv.decode_token_time * output / jnp.maximum(slots, 1)
    return FifoCells(
        servers=servers,
        prefill_token_time=sv.prefill_token_time,
        decode_token_time=sv.decode_token_time,
        decode_slots=slots,
        exponential=~has,
        rate=rate,
        prefill_bound=~has | (prefill >= decode),
        workload=w,
        tokens=True,
    )


def _lane(scn, scale, eta, *, policy: AbstractPolicy, cfg: _Config) -> adm.Lane:
    """What every lane of one scenario reads (`servers` cells, `dlbfluid._requests.admission`):
    `_shared`, the cells and each cell's probe offsets in order."""
    shared = _shared(scn, scale, eta, policy, cfg)
    off = shared["setup"].offsets  # [i, j]
    assert cfg.sizes is not None
    return adm.Lane(
        **shared,
        leaf=cfg.leaf,
        cells=_fifo_cells(scn, scale, cfg),
        horizon=jnp.asarray(cfg.horizon, scn.latency.dtype),
        sorted_offsets=jnp.sort(off.T, axis=-1),
        rank=jnp.sum(off[None, :, :] < off[:, None, :], axis=1).astype(jnp.int32),
        ticks=cfg.save_ticks[-1],
        sizes=cfg.sizes,
        clocks=(
            jax.vmap(lambda t, f: ServiceClock.of(t, f, scn.latency.dtype))(
                scn.slowdown_times, scn.slowdown_factors
            )
            if scn.slowdown_times.shape[-1] > 1
            else None
        ),
        estimation=cfg.estimation,
        est=None if cfg.estimation is None else est_.est_lane(cfg.estimation, scn.estimate),
        affinity=cfg.affinity,
        sess=None if cfg.affinity is None else _session_lane(scn, scale, shared, cfg.affinity),
    )


def _session_lane(scn, scale, shared: dict, aff: sess_.Affinity) -> sess_.SessLane:
    """The sessions' arrays of one scenario (`dlbfluid._requests.sessions`): a cell without
    a `servers` object caches `CACHE_SESSIONS` sessions per server; a hit saves the prefill
    time, the mean prompt's (App.-B) or the whole mean service (an exponential server)."""
    w, sv = scn.workload, scn.servers
    rate = scn.service.capacity / scn.replicas
    unit = 1.0 / rate
    cache = sess_.cache_entries(jnp, sv, rate.shape).astype(jnp.int32)
    if sv is not None:
        prompt = w.prompt_shift + w.prompt_shape * w.prompt_scale
        unit = jnp.where(sv.mask, sv.prefill_token_time * prompt, unit)
    return sess_.session_lane(aff, w, shared["lam_max"], scale, cache, unit)


def _outputs(st, counts, received, window: float, utilisation, horizon=None) -> dict:
    """The statistics of one trial from its final state (either kind of cell: `utilisation`
    is the kind's own), `counts` and `received` at the save times; with online estimation
    (`servers` cells) its report at `horizon`."""
    s = st.stats
    finite = jnp.isfinite(s.latency_sum) & jnp.all(jnp.isfinite(s.area))
    extra = {}
    if getattr(st, "est", None) is not None:
        extra["estimation"] = est_.report(st.est, horizon)
    if getattr(st, "sess", None) is not None:
        extra.update(sess_.report(st.sess, s.latency_sum.dtype))
    return dict(
        **extra,
        count=counts,
        received=received,
        served=s.served,
        latency_sum=s.latency_sum,
        latency_sq=s.latency_sq,
        histogram=s.histogram,
        arrivals=s.arrivals,
        drops=s.drops,
        mean_requests=s.area / window,
        utilisation=utilisation,
        final_x=st.x,
        status=_status(st.overflow, finite),
        overflow=st.overflow,
        events=st.events,
    )


def _progress(report, real, before, after) -> None:
    """Send `report` the requests arrived and the events run between the states `before`
    and `after` of a batch, counting only its real scenarios (`real`; all when None)."""
    w = jnp.ones(after.events.shape[0], bool) if real is None else real
    arrived = jnp.sum(jnp.where(w[:, None, None], after.stats.arrivals - before.stats.arrivals, 0))
    events = jnp.sum(jnp.where(w[:, None], after.events - before.events, 0))
    jax.debug.callback(report, arrived, events, ordered=False)


class _Report:
    """The progress of a run (`simulate_requests(progress=True)`): one `Progress` unit per
    save interval of each device's share, with the requests arrived and the events run so
    far (summed over the devices' shares from each segment's increments) as its note."""

    def __init__(self, total: int):
        self.progress = Progress("simulating requests", total, unit="segments")
        self.requests = 0
        self.events = 0

    def __call__(self, requests, events) -> None:
        self.requests += int(requests)
        self.events += int(events)
        note = f"{self.requests:,} requests, {self.events:,} events"
        self.progress.update(self.progress.done + 1, note)


# XLA's backend optimisation level 1 (the default is 2): the event loop's program compiles
# in about 0.7 of the time (a batch of App.-B cells: 7.5 -> 5.5 s on 2 cores; the test
# files' compilations are most of their time) and runs as fast, to within the run-to-run
# spread (10 scenarios x 64 trials x 40 s: 10.2 against 10.6 CPU-s). Level 0 halves the
# compilation but runs the loop 3-4 times slower.
_COMPILER_OPTIONS = {"xla_backend_optimization_level": 1}
# XLA:CPU's copy insertion with region analysis: without it the loop's state is copied
# where an in-place update is safe (bench_requests' batch 100 x 5 s, float32: 1.55 against
# 1.73-1.92 CPU-s, the same results). An option this XLA build does not know is dropped
# (`accepted_options`), so that it can only make the program faster, never stop it compiling.
_CPU_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}


@functools.cache
def _jitted():
    """`_run_program` compiled by `eqx.filter_jit` with `_COMPILER_OPTIONS` and the accepted
    `_CPU_OPTIONS` (built on first use: the probe starts the backend)."""
    options = {**_COMPILER_OPTIONS, **accepted_options(tuple(_CPU_OPTIONS.items()))}
    return eqx.filter_jit(_run_program, compiler_options=options)


def _run(scn, scale, eta, keys, policy, cfg, report=None):
    """`_run_program`, compiled (`_jitted`)."""
    return _jitted()(scn, scale, eta, keys, policy, cfg, report)


def _run_program(scn, scale, eta, keys, policy, cfg, report=None):
    """`_program` on each device's share of the batch (`per_device`: every device runs its
    own loops, to the slowest trial of its share, without communication), the batch
    padded to a multiple of the device count with copies of its last scenario. `report`
    (static): a `_Report` called after every save interval, or None."""
    B, d = keys.shape[0], jax.local_device_count()
    pad = -B % d

    def padded(a):
        return jnp.concatenate([a, jnp.repeat(a[-1:], pad, axis=0)]) if pad else a

    real = jnp.arange(B + pad) < B  # (the padding's runs are not reported)
    args = (*jax.tree_util.tree_map(padded, (scn, scale, eta, keys)), real)
    prog = _program if cfg.sizes is None else _fifo_program
    out = per_device(lambda s, k, e, r, m: prog(s, k, e, r, policy, cfg, report, m))(*args)
    return jax.tree_util.tree_map(lambda a: a[:B], out)


def _program(scn, scale, eta, keys, policy, cfg, report=None, real=None):
    """The batch: trials `(B,)` of the scenarios, states `(B, R)`, one tick loop for all
    (`run_tick`), the counts saved at `cfg.save_ticks`; `report(requests, events)` after
    each save interval with its arrivals (in the statistics window) and events, when
    given (a host callback: the loop's arithmetic is unchanged), counting the scenarios
    where `real` `(B,)` is True (default all)."""
    tr = jax.vmap(lambda s, k, e: _trial(s, k, e, policy=policy, cfg=cfg))(scn, scale, eta)
    st = _batched(init_state)(tr, keys)
    running = jnp.ones(keys.shape[:2], bool)
    ticks = jnp.asarray(cfg.save_ticks, jnp.int32)
    count = _batched(lambda t, s: t.cells.count(s.cells))

    def segment(st, s):
        new = jax.lax.fori_loop(
            ticks[s], ticks[s + 1], lambda k, x: run_tick(tr, k, x, running), st
        )
        if report is not None:
            _progress(report, real, st, new)
        return new, (count(tr, new), new.stats.received)

    count0 = count(tr, st)
    st, (counts, recv) = jax.lax.scan(segment, st, jnp.arange(len(cfg.save_ticks) - 1))
    counts = jnp.concatenate([count0[:, :, None], jnp.moveaxis(counts, 0, 2)], axis=2)
    recv = jnp.concatenate([jnp.zeros_like(count0)[:, :, None], jnp.moveaxis(recv, 0, 2)], axis=2)
    window = cfg.horizon - cfg.warmup
    return jax.vmap(
        jax.vmap(lambda s, c, r: _outputs(s, c, r, window, s.stats.busy / window)),
    )(st, counts, recv)


def _status(overflow, finite):
    """The `RESULTS` code of a trial: a non-finite routing (`NONFINITE_ROUTING`) or
    statistic is `nonfinite`, an overflow of a fixed-size array `solver_failed`."""
    status = jnp.where(
        (overflow & NONFINITE_ROUTING) != 0,
        RESULTS.nonfinite,
        jnp.where(
            overflow != 0,
            RESULTS.solver_failed,
            jnp.where(finite, RESULTS.success, RESULTS.nonfinite),
        ),
    )
    return status.astype(jnp.int32)


def _fifo_program(scn, scale, eta, keys, policy, cfg, report=None, real=None):
    """`_program` for `servers` cells: the admission-time engine
    (`dlbfluid._requests.admission`), one tick loop for the batch, the counts at
    `cfg.save_ticks`, `report` as in `_program`."""
    ln = jax.vmap(lambda s, k, e: _lane(s, k, e, policy=policy, cfg=cfg))(scn, scale, eta)
    st = adm.initial_state(ln, keys)
    assert cfg.sizes is not None
    G, K = cfg.sizes.chunk, cfg.save_ticks[-1]
    n_save = len(cfg.save_ticks) - 1
    marks = jnp.asarray(cfg.save_ticks, jnp.int32)
    saves = jnp.zeros(st.count.shape[:2] + (n_save + 1,) + st.count.shape[2:], jnp.int32)
    # (the counts and the cumulative deliveries at the save times)
    saves = (saves.at[:, :, 0].set(st.count), saves)

    def tick(k, carry):
        s, saved = carry
        s = adm.run_tick(ln, k, s)
        at = jnp.searchsorted(marks, k + 1)
        hit = marks[jnp.minimum(at, n_save)] == k + 1
        where = jnp.where(hit, at, n_save + 1)
        saved = (
            saved[0].at[:, :, where].set(s.count, mode="drop"),
            saved[1].at[:, :, where].set(s.stats.received, mode="drop"),
        )
        return s, saved

    def chunk(c, carry):
        s0, _ = carry
        a = c * G
        end = jnp.minimum(a + G, K)
        if cfg.estimation is None:
            s, saved = jax.lax.fori_loop(a, end, tick, carry)
        else:
            s, saved = _estimated_ticks(ln, a, end, tick, carry, cfg)
        if report is not None:
            _progress(report, real, s0, s)
        return adm.next_chunk(ln, a + G, s), saved

    st, (counts, recv) = jax.lax.fori_loop(0, -(-K // G), chunk, (st, saves))
    window = cfg.horizon - cfg.warmup

    def one(ln1, s1, c1, r1):
        return _outputs(s1, c1, r1, window, adm.utilisation(ln1, s1), ln1.horizon)

    return jax.vmap(jax.vmap(one, in_axes=(None, 0, 0, 0)), in_axes=(0, 0, 0, 0))(
        ln, st, counts, recv
    )


def _estimated_ticks(ln, a, end, tick, carry, cfg: _Config):
    """The ticks `[a, end)` of a chunk with online estimation: cut at every refit and
    background probe (`dlbfluid._requests.estimation`), which run between ticks as
    conditionals whose predicate is the same for every lane (no per-lane selection). The
    chunks, hence the random streams, are the oracle's: a run whose fits are never accepted
    routes as the oracle's does."""
    periods = [p for p in (cfg.refit_ticks, cfg.probe_ticks) if p]

    def body(c):
        pos, inner = c
        nxt = functools.reduce(jnp.minimum, [(pos // p + 1) * p for p in periods])
        b = jnp.minimum(nxt, end)
        s, saved = jax.lax.fori_loop(pos, b, tick, inner)
        return b, (_estimate(ln, s, b, cfg), saved)

    return jax.lax.while_loop(lambda c: c[0] < end, body, (a, carry))[1]


def _estimate(ln, st, b, cfg: _Config):
    """The background probes and the refit due at tick `b` (conditionals)."""
    est_cfg = cfg.estimation
    assert est_cfg is not None
    t = b.astype(st.cand.dtype) * cfg.tick

    def keep(s):
        return s.est

    if cfg.probe_ticks:
        probe = _batched(lambda a, s1: adm.probe_cells(a, s1, t).est)
        due = b % cfg.probe_ticks == 0
        st = dataclasses.replace(st, est=jax.lax.cond(due, lambda s: probe(ln, s), keep, st))

    def fit(s):
        m = b // cfg.refit_ticks
        return _batched(lambda a, s1: est_.refit(est_cfg, a.est, s1.est, m))(ln, s)

    due = b % cfg.refit_ticks == 0
    return dataclasses.replace(st, est=jax.lax.cond(due, fit, keep, st))


def _estimation_option(estimation, service: str) -> est_.OnlineEstimation | None:
    """`simulate_requests(estimation=...)` checked: None for the oracle."""
    if isinstance(estimation, est_.OnlineEstimation):
        online = estimation
    elif estimation == "oracle":
        return None
    elif estimation == "online":
        online = est_.OnlineEstimation()
    else:
        raise _bad(
            "estimation",
            estimation,
            f"allowed {', '.join(ESTIMATION_MODES)} or an OnlineEstimation",
        )
    if service != "servers":
        raise _bad(
            "estimation",
            "online",
            "online estimation needs service='servers' (markov "
            "cells do not fix a request's latency at its admission)",
        )
    return online


def _affinity_option(affinity, scn, service: str, k_b) -> sess_.Affinity | None:
    """`simulate_requests(affinity=...)` checked against the scenario's sessions: None when
    no scenario has sessions (every mode is then `off`, today's program)."""
    if affinity not in AFFINITY_MODES:
        raise _bad("affinity", affinity, f"allowed {', '.join(AFFINITY_MODES)}")
    w = scn.workload
    frac = np.zeros(1) if w is None else np.asarray(w.session_fraction)
    if not np.any(frac > 0):
        return None
    if service != "servers":
        raise _bad(
            "service",
            service,
            "a scenario with workload.sessions needs service='servers' (sessions, prefix "
            "caches and affinity live in the FIFO servers' admission engine)",
        )
    lam = np.where(np.asarray(scn.cell_mask), np.asarray(scn.arrival_rates).max(-1), 0.0)
    slots = sess_.slot_demand(
        np, k_b[:, None], frac[:, None], lam, np.asarray(w.think_time)[:, None]
    )
    M = int(max(1.0, float(slots.max())))
    if M > SESSION_SLOTS_MAX:
        raise _bad(
            "workload.sessions",
            f"{M} active sessions at a root",
            f"at most {SESSION_SLOTS_MAX:,} (scale x fraction x peak rate x think_time): "
            "shorten think_time",
        )
    per = sess_.cache_entries(np, scn.servers, lam.shape)
    C = int(max(1, per[np.asarray(scn.cell_mask)].max()))
    return sess_.Affinity(str(affinity), _pow2(M), C)


def _batch(scenario, scale):
    """`(scn, k_b, batched)`: the scenario with a leading batch axis `(B,)` (broadcast to
    the scales when one scenario is run at several), the scales `(B,)` as floats, and
    whether the caller passed a batch."""
    if not isinstance(scenario, Scenario):
        raise _bad("scenario", type(scenario).__name__, "expected a Scenario")
    batched = len(scenario.batch_shape) == 1
    if len(scenario.batch_shape) > 1:
        raise _bad("scenario batch shape", scenario.batch_shape, "expected at most one axis")
    scn = scenario.strip()
    if not batched:
        scn = jax.tree_util.tree_map(lambda a: jnp.asarray(a)[None], scn)
    B = scn.replicas.shape[0]
    k = np.asarray(scale)
    if k.ndim > 1 or (k.ndim == 1 and k.shape[0] not in (1, B)):
        raise _bad("scale", scale, f"expected a positive integer or one per scenario ({B},)")
    if k.dtype == bool or not np.all(np.isfinite(k)) or np.any(k < 1) or np.any(k != np.round(k)):
        raise _bad("scale", scale, "expected positive integers")
    if k.ndim == 1 and not batched and k.shape[0] > 1:
        B = k.shape[0]
        scn = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (B,) + a.shape[1:]), scn)
        batched = True
    return scn, np.broadcast_to(k.astype(float), (B,)).copy(), batched


def _times(tick, horizon, warmup, n_save):
    """`(h, T, w, K, n_save)`: the checked tick, horizon, warm-up, tick count and saves."""
    h = tick
    if isinstance(h, bool) or not isinstance(h, (int, float)) or not (0 < h < math.inf):
        raise _bad("tick", tick, "expected a finite number > 0")
    T = horizon
    if isinstance(T, bool) or not isinstance(T, (int, float)) or not (0 < T < math.inf):
        raise _bad("horizon", horizon, "expected a finite number > 0")
    K = int(round(T / h))
    if K < 1 or abs(K * h - T) > 1e-9 * max(T, 1.0):
        raise _bad("horizon", horizon, f"expected a whole number of ticks (tick = {h})")
    w = warmup
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not (0 <= w < T):
        raise _bad("warmup", warmup, f"expected a number in [0, horizon = {T})")
    n_save = _count("n_save", n_save)
    if n_save > K:
        raise _bad("n_save", n_save, f"expected an integer in [1, {K}] (the number of ticks)")
    return h, T, w, K, n_save


def _step_sizes(step_size, B: int, n: int) -> np.ndarray:
    """The routers' step sizes `(B, n)`."""
    eta = np.asarray(step_size, dtype=float)
    if eta.ndim > 2 or (eta.ndim >= 1 and eta.shape[-1] not in (1, n)):
        raise _bad("step_size", step_size, f"expected a scalar, (n,) = ({n},) or (B, n)")
    if not np.all(np.isfinite(eta)) or np.any(eta < 0):
        raise _bad("step_size", step_size, "expected finite values >= 0")
    try:
        return np.broadcast_to(eta, (B, n)).copy()
    except ValueError:
        raise _bad("step_size", step_size, f"expected a scalar, (n,) or ({B}, {n})") from None


class _Plan(NamedTuple):
    """The server axis of a batch (`_servers_plan`): `servers` `(B, n)` servers per cell at
    scale $k$, the largest count and decode-slot count, whether any cell is an App.-B
    cell, and `pd_caps` `(B, n)` the App.-B cells' stage capacities (requests/s)."""

    servers: np.ndarray
    max_servers: int
    max_slots: int
    prefill_decode: bool
    pd_caps: np.ndarray


def _servers_plan(scenario, scn, service: str, k_b, batched: bool) -> _Plan:
    """Check that `servers` mode fits every cell and size its arrays (theory/requests.md,
    *App.-B cell*)."""
    mask = np.asarray(scn.cell_mask)
    B, n = mask.shape
    rc, reps = np.asarray(scn.replica_counts), np.asarray(scn.replicas)
    count = reps * k_b[:, None]
    if service != "servers":
        return _Plan(count, 1, 1, False, np.zeros((B, n)))
    models = np.asarray(scn.service.model)
    has = np.zeros((B, n), bool) if scn.servers is None else mask & np.asarray(scn.servers.mask)
    bad = mask & ~has & (models != law_code("mm1"))
    if np.any(bad):
        b, j = (int(v[0]) for v in np.nonzero(bad))
        names = scenario.cell_names
        cell = f"cells[{j}]" + (f" ({names[j]!r})" if not batched and names else "")
        raise _bad(
            "service",
            service,
            f"'servers' needs a 'servers' object on {cell}"
            + (f" of scenario {b}" if batched else "")
            + " (the App.-B prefill/decode servers: docs/scenarios.md) or an M/M/1 "
            "cell (k_j exponential FIFO servers); use service='markov' for other laws",
        )
    if np.any(mask & ~has & (np.abs(count - np.round(count)) > 1e-9)):
        raise _bad("scenario.replicas", reps.tolist(), "'servers' needs integer replicas")
    sched = rc * k_b[:, None, None]
    if np.any((mask & ~has)[..., None] & (np.abs(sched - np.round(sched)) > 1e-9)):
        raise _bad(
            "scenario.replica_counts",
            rc.tolist(),
            "'servers' needs integer replica counts in a replica schedule",
        )
    max_slots, pd_caps = 1, np.zeros((B, n))
    if np.any(has):
        sv, wl = scn.servers, scn.workload
        assert sv is not None and wl is not None  # (stack_scenarios fills both)
        count = np.where(has, np.asarray(sv.count) * k_b[:, None], count)
        engines = np.asarray(sv.decode_engines) * np.asarray(sv.slots)
        max_slots = int(np.max(np.where(has, engines, 1)))
        # Stage capacities (requests/s): prefill S/(t_p E[P]), decode S D/(t_d E[D]).
        mean_p = np.asarray(wl.prompt_shift + wl.prompt_shape * wl.prompt_scale)[:, None]
        mean_o = np.asarray(wl.output_shift + wl.output_shape * wl.output_scale)[:, None]
        tp, td = np.asarray(sv.prefill_token_time), np.asarray(sv.decode_token_time)
        pd_caps = np.where(has, count * (1 / (tp * mean_p) + engines / (td * mean_o)), 0.0)
    max_servers = int(np.max(np.where(mask, np.round(count), 1)))
    return _Plan(count, max_servers, max_slots, bool(np.any(has)), pd_caps)


def _default_slots(scn, service: str, k_b, plan: _Plan, leaf: AbstractLeaf) -> int:
    """`slots` by default (the docstring of `simulate_requests`)."""
    finite = _finite_buffers(scn)
    need = _default_need(scn, service, k_b, plan, finite)
    if service != "servers":
        return _pow2(max(64.0, need))
    if isinstance(leaf, PowerOfD) and leaf.d == 1:
        # Join-the-shortest-queue's bound on a server's count does not hold for a random
        # split, where a server's count is geometric: four times JSQ's need, never above
        # the cell's own bound. (Power-of-d with d >= 2 keeps JSQ's queue: on 10 App.-B
        # scenarios x 5 trials x 20 s, pod(2) never filled it, and a four-times queue cost
        # 2.3x jsq's time against 1.2x, every admission reading S Q entries.)
        need = 4.0 * need
        if finite:
            need = min(need, _cell_bound(scn, k_b))
    return _pow2(max(64.0 if finite else 16.0, need))


def _finite_buffers(scn) -> bool:
    """Whether every real cell of the batch has a finite buffer."""
    return bool(np.all(np.isfinite(np.asarray(scn.buffer)[np.asarray(scn.cell_mask)])))


def _cell_bound(scn, k_b) -> float:
    """The most requests a cell can hold with finite buffers: the largest $\\lfloor
    kB_j\\rfloor + 1$."""
    mask, buf = np.asarray(scn.cell_mask), np.asarray(scn.buffer)
    return float(np.max(np.floor(k_b[:, None] * np.where(mask, buf, 0.0)))) + 1


def _default_need(scn, service: str, k_b, plan: _Plan, finite: bool) -> float:
    """The requests a cell (`markov`) or a server (`servers`, join-the-shortest-queue)
    must hold, before rounding (`_default_slots`; `finite`: `_finite_buffers`)."""
    mask = np.asarray(scn.cell_mask)
    if finite:
        if plan.prefill_decode:
            # Join the shortest queue: a server holds at most floor(kB_j / S_j) + 1.
            S_j = np.maximum(np.round(plan.servers), 1)
            buf = np.where(mask, np.asarray(scn.buffer), 0.0)
            return float(np.max(np.floor(k_b[:, None] * buf) / S_j)) + 2
        return _cell_bound(scn, k_b)
    cap = jnp.asarray(np.asarray(scn.service.capacity))
    work = np.asarray(scn.service.inverse_rate(0.95 * cap))
    n0 = np.asarray(scn.initial_workload)
    load = k_b[:, None] * np.where(mask, np.maximum(work, n0), 0.0)
    if service != "servers":
        return 4 * float(np.max(load))
    # Join the shortest queue: a server receives only while it holds the fewest, so it
    # never holds more than (the cell's count) / S_j + 1; a small per-server floor (16)
    # instead of the cells' 64 keeps many-server cells' admissions, which read S Q
    # entries, cheap (benchmarks/README.md, *The dense 3-cell case*).
    S_j = np.maximum(np.round(plan.servers), 1)
    need = 4 * float(np.max(load / S_j)) + 2
    if plan.prefill_decode:
        need = need + 2 * plan.max_slots
    return need


def _default_events(scn, k_b, h: float, plan: _Plan) -> int:
    """`events` by default: Poisson candidates of rate at most 2 k sum(lambda_max)
    (arrivals and deliveries) + k sum(capacity) (completions), plus the tick's end; six
    standard deviations above the mean."""
    mask, lam = np.asarray(scn.cell_mask), np.asarray(scn.arrival_rates)
    rc, reps = np.asarray(scn.replica_counts), np.asarray(scn.replicas)
    caps = np.where(mask, np.asarray(scn.service.capacity), 0.0)
    # (a replica schedule above the nominal count raises the capacity with it)
    caps = caps * np.maximum(np.max(rc, axis=-1) / np.maximum(reps, 1e-300), 1.0)
    # App.-B cells: two deterministic events per request, at most the stage capacities,
    # and in the long run the arrival rate: their sum is capped at 4 sum(lambda_max)
    # (a stage that drains a backlog faster may exceed `events`: a status).
    lam_tot = np.where(mask, lam.max(-1), 0.0).sum(-1)
    pd_rate = np.minimum(plan.pd_caps.sum(-1) / k_b, 4.0 * lam_tot)
    caps = np.where(plan.pd_caps > 0, 0.0, caps)
    rate = np.max(k_b * (2.0 * lam_tot + caps.sum(-1) + pd_rate))
    m = float(rate) * h
    return _pow2(16.0 + m + 6.0 * math.sqrt(m))


def _poisson_cap(mean: float, floor: float = 8.0) -> int:
    """A power of two above `floor` + `mean` + six standard deviations of a Poisson count."""
    return _pow2(floor + mean + 6.0 * math.sqrt(mean))


def _fifo_sizes(scn, k_b, h: float, K: int, plan: _Plan, queue: int, inbox, candidates, ring):
    """`(Sizes, inbox, candidates)`: the fixed sizes of the admission-time engine
    (`dlbfluid._requests.admission.Sizes`; theory/requests.md, *Sizes*). The candidates of
    a tick are Poisson of mean $m = h\\Lambda$, $\\Lambda = k\\sum_i\\bar\\lambda_i$; a
    lane's deliveries in a tick come from the arrivals of the ticks $\\tau_{ij}$ earlier,
    of mean $m$ while the routing holds, at most $2m$ when it moves traffic between arcs of
    different delays; a chunk holds about 256 candidates."""
    mask, lam = np.asarray(scn.cell_mask), np.asarray(scn.arrival_rates)
    total = np.max(k_b * np.where(mask, lam.max(-1), 0.0).sum(-1))
    m = float(total) * h
    inbox = _count("arc_slots", _poisson_cap(2.0 * m) if inbox is None else inbox)
    candidates = _count("events", _poisson_cap(m) if candidates is None else candidates)
    chunk = 1 << int(np.clip(np.floor(np.log2(256.0 / max(m, 1e-9))), 4, 12))
    calendar = 1 << int(np.clip(np.ceil(np.log2(2.5 / h)), 6, 12))
    chunk = min(chunk, 1 << max(int(K) - 1, 1).bit_length(), calendar // 2)
    rows = _poisson_cap(m * chunk, 16.0)
    init = np.where(mask, np.round(k_b[:, None] * np.asarray(scn.initial_workload)), 0)
    token_rows = _poisson_cap(m * (chunk + ring), 16.0) + _pow2(float(init.sum(-1).max()) + 1)
    # (a chunk admits m G on average; a quarter more keeps the table topped up)
    token_new = min(_pow2(1.25 * m * chunk + 16.0), token_rows)
    sizes = adm.Sizes(
        servers=plan.max_servers,
        queue=queue,
        slots=max(plan.max_slots, 1),
        calendar=calendar,
        # (a cell holds at most S Q requests: the far list needs no more)
        far=int(np.clip(_pow2(plan.max_servers * queue), 64, 1024)),
        ring=ring,
        inbox=inbox,
        candidates=candidates,
        chunk=chunk,
        rows=rows,
        token_rows=token_rows,
        token_new=token_new,
    )
    return sizes, inbox, candidates


def simulate_requests(
    scenario: Scenario,
    policy: str | AbstractPolicy,
    *,
    service: str = "markov",
    scale=1,
    trials: int = 1,
    seed: int = 0,
    step_size=1.0,
    tick: float = 0.005,
    horizon: float = 10.0,
    warmup: float = 0.0,
    n_save: int = 100,
    slots: int | None = None,
    arc_slots: int | None = None,
    events: int | None = None,
    histogram: LatencyHistogram = LatencyHistogram(),
    leaf: str | AbstractLeaf = "jsq",
    probe_smoothing: float = 0.0,
    estimation: str | est_.OnlineEstimation = "oracle",
    affinity: str = "off",
    dtype=None,
    throw: bool | None = None,
    progress: bool = False,
) -> RequestSolution:
    """Simulate the scenario request by request, batched over scenarios and trials.

    Requests arrive at root router $i$ as a Poisson process of rate $k\\lambda_i(t)$, are
    routed to cell $j$ with probability $x_{ij}$ (the policy's routing, updated every
    `tick` from the request counts $N_j(t-\\tau_{ij})/k$, by the same policy objects as
    `simulate`), reach $j$ after $\\tau_{ij}$, are served, and return after $\\tau_{ij}$:
    latency $= 2\\tau_{ij} +$ sojourn. The event loop is exact (theory/requests.md;
    `dlbfluid._requests.loop`).

    **Arguments:**
    - `scenario`: a `Scenario`, or a batch from `stack_scenarios` (leading axis `B`).
      A replica schedule $k_j(t)$ (the outage) scales each cell by its fraction
      $c_j = k_j(t)/k_j$ of the tick (`replica_fractions` at the tick's midpoint, as in
      `simulate`): markov cells complete at $kc_j\\mu_j(N/(kc_j))$ and drop requests above
      the buffer $\\lfloor kc_jB_j\\rfloor$; server cells run
      $\\max(1, \\mathrm{round}(c_jS_j))$ of their $S_j$ servers, the others draining the
      requests they hold (theory/requests.md, *Replica schedules*). A service schedule
      $s_j(t)$ (`Scenario.slowdown_factors`) divides a markov cell's rate by the tick's
      $s_j$, and server cells work at speed $1/s_j(t)$ while they serve (their rows kept
      in the schedule's work clock: *Service schedules*).
    - `policy`: a registered policy name or an `AbstractPolicy` (`ErrorAverse` included).
    - `service`: `"markov"` (default): cell $j$ with $N$ requests completes at rate
      $k\\mu_j(N/k)$, each present request equally likely (`MarkovCells`); `"servers"`:
      a cell with a `servers` object is $k$ times its count of App.-B prefill/decode
      servers, requests drawing their token counts from the scenario's `workload`
      (`FifoCells`); an M/M/1 cell without one is $kk_j$ exponential FIFO servers
      of rate $\\bar\\mu_j/k_j$ each;
      a request joins the least-loaded server. Other cells need `"markov"`.
    - `scale`: $k$, a positive integer or one per scenario `(B,)`: arrival rates,
      replicas and buffers times $k$, service $k\\mu_j(N/k)$. $N^k/k \\to$ the fluid $N$.
    - `trials`: independent trials per scenario (each its own PRNG key from `seed`).
    - `step_size`, `tick`, `horizon`, `n_save`: as in `simulate` (`tick` defaults to the
      paper's 5 ms probe period); `horizon` must be a whole number of ticks.
    - `warmup`: statistics count only $[$`warmup`$, T]$ (the saved counts cover all).
    - `slots`: requests a cell can hold (`markov`), or each server's queue (`servers`);
      default: the largest scaled buffer + 1 when every buffer is finite (App.-B servers:
      the largest $\\lfloor kB_j/S_j\\rfloor + 2$, which join-the-shortest-queue cannot
      exceed), else four times the fluid workload at 95% of capacity, at least 64
      (`servers`: four times that workload per server $+ 2$, at least 16).
      `arc_slots`: requests in flight per arc (`markov`), or requests a trial's cells
      receive in one tick (`servers`); default from the arrival rates and delays. `events`: events
      per tick (`markov`), or arrival candidates per tick (`servers`); default six
      standard deviations above the largest Poisson mean. Exceeding any of them (and,
      for `servers`, a cell's list of completions beyond the count calendar) is a status,
      never a silent truncation.
    - `histogram`: the latency bins of the percentiles (`LatencyHistogram`).
    - `leaf`: the `servers` cells' leaf rule: `"jsq"` (default; the fewest requests
      present), `"pod"` (power-of-2 choices on the tokens waiting) or an `AbstractLeaf`
      such as `PowerOfD(d)` (`dlbfluid._requests._leaf`; theory/requests.md, *Leaf rules*).
      `markov` cells have no servers and take `"jsq"` only.
    - `probe_smoothing`: $T_s \\ge 0$ (s): the routers see each arc's probes through an
      exponential filter of time constant $T_s$ (`dlbfluid._requests.loop.smooth_probes`;
      theory/requests.md, *Probe smoothing*); 0 (default): the raw probes, bit for bit.
    - `estimation`: the routers' latency models. `"oracle"` (default): the scenario's
      `estimate`, fixed. `"online"` or an `OnlineEstimation` (its defaults for
      `"online"`; `servers` cells only): each cell's model refitted every
      `refit_period` seconds from the requests completed in the last `window` seconds,
      with the mitigations it names (`dlbfluid._requests.estimation`; theory/estimation.md,
      *Estimation in the loop*). The refit and probe periods must be whole numbers of
      ticks. The result's `estimation` reports the models at the horizon.
    - `affinity`: with a scenario whose `workload` has `sessions` (`servers` cells only):
      `"off"` (default; requests routed by the policy, prefix caches hit by chance),
      `"sticky"` (a session's requests follow its first request's cell, and its prefix's
      server there) or `"conditional"` (the paper's rule: stay while the expected latency
      there minus the prefill a hit saves beats the best other cell's;
      `dlbfluid._requests.sessions`, theory/affinity.md). The result's `cache_hit_rate`
      and `busiest_server_share` report the caches. Without sessions every mode is `off`.
    - `dtype`: `jnp.float64` (default; needs JAX's x64 mode, `dlbfluid.enable_x64()`) or
      `jnp.float32`.
    - `throw`: raise on a failed scenario or trial; default True for one scenario.
    - `progress`: a line on stderr (`dlbfluid._runtime.progress.Progress`, as `simulate`'s)
      after the first save interval, then at least every 10 s (on a terminal, redrawn at
      every interval) and at the end: save intervals done of all, elapsed and estimated
      time left, the requests arrived in the statistics window and the events so far.
      The results are bitwise those without it; a long run with few saves reports
      seldom (`n_save` sets how often it can).

    **Returns:** a `RequestSolution` with axes `(B, trials)` (`(trials,)` for one scenario).

    **Raises:** `ValueError` naming the argument, its value and what is allowed;
    `X64Error` (a `ValueError`) for float64 while JAX's x64 mode is off (float32 runs
    without it).
    """
    pol = policy_from_name(policy)
    if service not in SERVICES:
        raise _bad("service", service, f"allowed {', '.join(SERVICES)}")
    leaf = leaf_from_name(leaf)
    smoothing = number("probe_smoothing", probe_smoothing, lo=0.0)
    if service != "servers" and not isinstance(leaf, JoinShortestQueue):
        raise _bad(
            "leaf",
            leaf.name,
            "markov cells have no servers to choose from: use service='servers' or leaf='jsq'",
        )
    if not isinstance(histogram, LatencyHistogram):
        raise _bad("histogram", histogram, "expected a LatencyHistogram")
    online = _estimation_option(estimation, service)
    trials = _count("trials", trials)
    seed = _count("seed", seed, 0)
    dtype = jnp.dtype(jnp.float64 if dtype is None else dtype)
    if dtype not in (jnp.dtype(jnp.float64), jnp.dtype(jnp.float32)):
        raise _bad("dtype", str(dtype), "allowed float64 or float32")
    if dtype == jnp.float64:
        require_x64("simulate_requests(dtype=float64)")  # (float32 runs without x64)
    scn, k_b, batched = _batch(scenario, scale)
    aff = _affinity_option(affinity, scn, service, k_b)
    B, n = scn.replicas.shape
    h, T, w, K, n_save = _times(tick, horizon, warmup, n_save)
    eta_b = _step_sizes(step_size, B, n)
    lam = np.asarray(scn.arrival_rates)
    if not np.all(np.isfinite(lam)):
        raise _bad("scenario.arrival_rates", "non-finite rates", "expected finite rates")
    plan = _servers_plan(scenario, scn, service, k_b, batched)
    if slots is None:
        slots = _default_slots(scn, service, k_b, plan, leaf)
    slots = _count("slots", slots)
    tau = np.where(np.asarray(scn.allowed), np.asarray(scn.latency), 0.0)
    hist = _hist_len(float(tau.max()) / h)
    sizes = None
    refit_ticks = probe_ticks = 0
    if online is not None:
        refit_ticks = period_ticks(online.refit_period, h, "refit_period")
        if online.probing > 0:
            probe_ticks = period_ticks(online.probing, h, "probing")
    if service == "servers":
        sizes, arc_slots, events = _fifo_sizes(scn, k_b, h, K, plan, slots, arc_slots, events, hist)
    else:
        if arc_slots is None:
            mean = float(k_b.max()) * float(np.max(lam)) * float(tau.max())
            arc_slots = _pow2(32.0 + 4.0 * mean + 8.0 * math.sqrt(mean))
        arc_slots = _count("arc_slots", arc_slots)
        events = _count("events", _default_events(scn, k_b, h, plan) if events is None else events)

    save_ticks = tuple(int(s) for s in (np.arange(n_save + 1) * K) // n_save)
    cfg = _Config(
        service=service,
        tick=float(h),
        horizon=float(T),
        warmup=float(w),
        save_ticks=save_ticks,
        hist=hist,
        slots=slots,
        arc_slots=arc_slots,
        events=events,
        max_servers=plan.max_servers,
        histogram=histogram,
        prefill_decode=plan.prefill_decode,
        max_slots=plan.max_slots,
        sizes=sizes,
        leaf=leaf,
        smoothing=smoothing,
        estimation=online,
        refit_ticks=refit_ticks,
        probe_ticks=probe_ticks,
        affinity=aff,
    )
    scn = jax.tree_util.tree_map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, scn
    )
    keys = jr.split(jr.PRNGKey(seed), B * trials).reshape(B, trials, -1)
    units = n_save if sizes is None else -(-K // sizes.chunk)  # (save intervals, or chunks)
    report = _Report(units * jax.local_device_count()) if progress else None
    out = _run(scn, jnp.asarray(k_b, dtype), jnp.asarray(eta_b, dtype), keys, pol, cfg, report)
    per = dict(out, scale=jnp.asarray(k_b, dtype), cell_mask=jnp.asarray(scn.cell_mask))
    if not batched:
        per = jax.tree_util.tree_map(lambda a: a[0], per)
    sol = RequestSolution(
        t=jnp.asarray(np.asarray(save_ticks) * h, dtype),
        **per,
        window=float(T - w),
        histogram_bins=histogram,
        policy=pol.name,
        service=service,
    )
    if throw is None:
        throw = not batched
    if throw:
        sol.raise_for_status()
    return sol
