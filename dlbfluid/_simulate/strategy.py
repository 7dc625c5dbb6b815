"""How `simulate` runs a batch: one scenario's `Simulator` methods vmapped (the batch axis
first) or evaluated on batch-last arrays (`vmap_last`), in chunks that stay in cache, each
device running its own share (theory/discretisation.md, *The loop at the probe cadence*
and *Batch axis last*).

`simulate_program` is the traced body of the compiled program: it is wrapped in
`eqx.debug.assert_max_traces` (no limit), so `eqx.debug.get_num_traces(simulate_program)`
counts the programs `simulate` has traced in this process.
"""

from __future__ import annotations

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp

from .._runtime.devices import per_device, solver_jit
from .batchlast import vmap_last
from .loop import _setup
from .single import Simulator

__all__ = ["simulate_program"]


def _chunk_count(batch: int, chunk: int | None) -> int:
    """How many chunks `_chunked` runs a batch of `batch` scenarios in (1: whole)."""
    return 1 if chunk is None or chunk >= batch else -(-batch // chunk)


def _chunked(run, chunk: int | None):
    """`run(*batched)` (every argument and output with the batch axis first) applied to
    consecutive chunks of about `chunk` scenarios one after the other (`lax.map`), the last
    scenario repeated to fill the last chunk; `None` or a chunk as large as the batch: the
    whole batch at once.

    On a CPU a tick is a few hundred small vectorised operations: over the whole batch,
    each of them streams its operands through memory (a 10-cell float64 tick of 1,000
    scenarios holds about 1 MB per intermediate), over a chunk of a few dozen they stay in
    cache, and the chunk's state with them for all of its ticks (theory/discretisation.md,
    *The loop at the probe cadence*). A scenario's arithmetic is the same whatever chunk
    it is in."""

    def call(*args):
        B = jax.tree_util.tree_leaves(args)[0].shape[0]
        C = _chunk_count(B, chunk)
        if C == 1:
            return run(*args)
        size = -(-B // C)  # C chunks of equal size, fewer than C padded scenarios
        pad = C * size - B

        def split(a):
            if pad:
                a = jnp.concatenate([a, jnp.repeat(a[-1:], pad, axis=0)])
            return a.reshape((C, size) + a.shape[1:])

        out = jax.lax.map(lambda z: run(*z), jax.tree_util.tree_map(split, args))
        return jax.tree_util.tree_map(lambda a: a.reshape((C * size,) + a.shape[2:])[:B], out)

    return call


def _batch_last(tree):
    """Every leaf's leading (batch) axis moved last."""
    return jax.tree_util.tree_map(lambda a: jnp.moveaxis(a, 0, -1), tree)


def _batch_first(tree):
    """Every leaf's last (batch) axis moved first."""
    return jax.tree_util.tree_map(lambda a: jnp.moveaxis(a, -1, 0), tree)


def _program(
    scn,
    eta,
    h,
    save_ticks,
    *,
    policy,
    integrator,
    hist,
    progress,
    horizon,
    window,
    uniform,
    chunk=None,
    layout="batch-first",
):
    """The records at `save_ticks` (`(B, S + 1)`), the final statuses and changes of a
    batch: per scenario a `Simulator`, its `init`, `step` and `record` vmapped (or, batch
    last, evaluated by `vmap_last`), chunk after chunk (`_chunked`).

    With `uniform` (every scenario saves at the same ticks), the tick loop runs outside the
    vmap on scalar bounds: with batched bounds, vmap turns the loop into one whose carry,
    ring buffers included, is selected element by element on every pass. A save interval
    with no tick (`k0 == k1`: the save bucket's padding) records the last state again and
    is not counted by `progress`."""

    def sim(s, g, a):
        return Simulator(s, g, a, policy, integrator, window)

    def step(s, g, a, st, k):
        return sim(s, g, a).step(st, k)

    def slot_step(s, g, a, st, k):
        return sim(s, g, a)._step(st, k, slot=True)

    def record(s, g, a, st, k):
        return sim(s, g, a).record(st, k)

    def ticks(s, g, a, st, k0, k1):
        return jax.lax.fori_loop(k0, k1, lambda k, x: step(s, g, a, x, k), st)

    rec = jax.vmap(record)
    last = uniform and layout == "batch-last"
    if uniform:
        run, rec_loop = _uniform_loop(step, slot_step, record, last)
    else:
        run, rec_loop = jax.vmap(ticks), rec

    def counted(real):
        if real:
            progress()

    def whole_run(scn, eta, h, save_ticks):
        # A chunk (or the whole share) from its set-up to its last save: its state stays
        # in one place (and layout) for the whole run, however often it saves.
        setup = jax.vmap(lambda s, e, hh: _setup(s, e, hh, hist))(scn, eta, h)
        aux = jax.vmap(lambda s, hh: policy.prepare(s, hh, horizon))(scn, h)
        state0 = jax.vmap(lambda s, g, a: sim(s, g, a).init())(scn, setup, aux)
        first = rec(scn, setup, aux, state0, save_ticks[:, 0])
        fixed = _batch_last((scn, setup, aux)) if last else (scn, setup, aux)
        state_l = _batch_last(state0) if last else state0

        def segment(state, ks):
            k0, k1 = ks
            state = run(*fixed, state, k0, k1)
            if progress is not None:
                jax.debug.callback(counted, jnp.any(k1 > k0), ordered=False)
            return state, rec_loop(*fixed, state, k1)

        pairs = jnp.stack([save_ticks[:, :-1].T, save_ticks[:, 1:].T], axis=1)  # (S, 2, B)
        state, recs = jax.lax.scan(segment, state_l, pairs)
        if last:
            state = _batch_first(state)
        recs = jax.tree_util.tree_map(
            lambda a, b: jnp.concatenate([a[None], b]).swapaxes(0, 1), first, recs
        )
        # (a dict: the exported program's outputs are containers JAX serialises)
        out = {f.name: getattr(recs, f.name) for f in dataclasses.fields(recs)}
        return out, state.status, state.change

    return _chunked(whole_run, chunk)(scn, eta, h, save_ticks)


def _uniform_loop(step, slot_step, record, last: bool):
    """`(run, rec_loop)` for a batch that saves at the same ticks: the tick loop on the
    first scenario's (scalar) bounds around a vmapped `step` (batch last: `slot_step`), and
    the record at a scalar tick.

    Batch last (`vmap_last`; theory/discretisation.md, *Batch axis last*): the scenario,
    set-up, policy arrays and state move there once per chunk, and only the records move
    back at every save. The observations' finiteness is read from their ring slot:
    otherwise XLA computes them again inside the check's reduction over cells, a strided
    loop in this layout (App.-B, 10 cells, 2 devices: float32 1.94 -> 1.73 us per
    scenario-tick, float64 3.16 -> 3.04; batch-first it costs float32 7%, so the vmapped
    loop keeps the direct check)."""
    if last:
        tick = vmap_last(slot_step, (True,) * 4 + (False,))
        rec_at = vmap_last(record, (True,) * 4 + (False,))
    else:
        tick = jax.vmap(step, in_axes=(0, 0, 0, 0, None))
        rec_at = jax.vmap(record, in_axes=(0, 0, 0, 0, None))

    def run(s, g, a, state, k0, k1):
        return jax.lax.fori_loop(k0[0], k1[0], lambda k, st: tick(s, g, a, st, k), state)

    def rec_loop(s, g, a, state, k):
        out = rec_at(s, g, a, state, k[0])
        return _batch_first(out) if last else out

    return run, rec_loop


def _sharded(scn, eta, h, save_ticks, **static):
    # Each device runs its shard on its own (`per_device`): the adaptive integrator's
    # step loops would otherwise all-reduce their batched conditions across devices at
    # every step.
    return per_device(functools.partial(simulate_program, **static))(scn, eta, h, save_ticks)


simulate_program = eqx.debug.assert_max_traces(_program, max_traces=None)
"""`_program`, counting its traces (`eqx.debug.get_num_traces`)."""

# The compiled batch simulation, with the solvers' XLA options (`compiler_options`: on
# one CPU device a quarter to a third less time per call).
_simulate_batch = solver_jit(_sharded, jit=eqx.filter_jit)
