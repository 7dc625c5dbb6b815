"""`vmap_last` against `jax.vmap` (a catalogue of the primitives it rewrites and one it
hands back to vmap), and `simulate(layout="batch-last")` against the default layout.

The simulations run the contract batch of tests/test_contracts.py (`helpers.contract_batch`,
`CONTRACT_RUN`): each policy's batch-first run is the contract's compiled program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CONTRACT_RUN, contract_batch

import dlbfluid as dl
from dlbfluid._elementary import exp_neg, log1p_unit
from dlbfluid._simulate import batchlast as _batchlast
from dlbfluid._simulate import default_layout, verb
from dlbfluid._simulate.batchlast import vmap_last

B = 5
rng = np.random.default_rng(7)
X = jnp.asarray(rng.normal(size=(B, 4, 3)))  # per scenario (4, 3)
V = jnp.asarray(rng.normal(size=(B, 3)))  # per scenario (3,)
IDX = jnp.asarray(rng.integers(-1, 5, size=(B, 2, 3)))  # some out of range on purpose
K = jnp.asarray(2)  # unbatched
W = jnp.asarray(rng.normal(size=(4, 3)))  # unbatched matrix


def _last(a):
    return jnp.moveaxis(a, 0, -1)


def _check(f):
    """f(x, v, idx, k, w) per scenario: vmap_last on batch-last arrays equals jax.vmap, to
    the last bit or two (the loops vectorise over another axis: XLA may contract a
    multiply-add or vectorise a transcendental in one layout and not the other)."""
    want = jax.vmap(f, in_axes=(0, 0, 0, None, None))(X, V, IDX, K, W)
    got = vmap_last(f, (True, True, True, False, False))(_last(X), _last(V), _last(IDX), K, W)
    jax.tree_util.tree_map(
        lambda w, g: np.testing.assert_allclose(
            np.moveaxis(np.asarray(g), -1, 0), np.asarray(w), rtol=1e-15, atol=1e-15
        ),
        want,
        got,
    )


CATALOGUE = {
    # elementwise, with a scalar, an unbatched operand and lax's size-1 broadcasting
    "elementwise": lambda x, v, i, k, w: jnp.where(x > 0, x * v[None, :] - w, jnp.exp(x)) / 3.0,
    "size1": lambda x, v, i, k, w: x[:1, :] - x[:, :1],
    "scalar_per_scenario": lambda x, v, i, k, w: x * jnp.sum(v),
    "integer_and_bits": lambda x, v, i, k, w: (i & 3) + (i >> 1) * k,
    "elementary": lambda x, v, i, k, w: log1p_unit(exp_neg(-jnp.abs(x))),  # bitcasts
    "reductions": lambda x, v, i, k, w: (
        jnp.sum(x, axis=0), jnp.max(x, axis=1), jnp.argmax(x, axis=0), jnp.all(x > -3.0)
    ),
    "cumsum_sort": lambda x, v, i, k, w: (jnp.cumsum(x, axis=0), jnp.sort(x, axis=0)),
    "shapes": lambda x, v, i, k, w: (x.T, x.reshape(2, 6), x[1:3, ::2], x[::-1]),
    "stack_concat_pad": lambda x, v, i, k, w: (
        jnp.stack([x, w]), jnp.concatenate([x, w], axis=1), jnp.pad(x, ((1, 0), (0, 2)))
    ),
    "dynamic_slices": lambda x, v, i, k, w: (
        jax.lax.dynamic_slice_in_dim(x, k, 2, axis=0),
        jax.lax.dynamic_update_index_in_dim(x, v, k, 0),
        x.at[k].set(v),  # a scatter at an unbatched index
    ),
    "point_gather": lambda x, v, i, k, w: x[i & 3, jnp.arange(3)[None, :]],
    "point_gather_unbatched_operand": lambda x, v, i, k, w: w[i & 3, jnp.arange(3)[None, :]],
    "point_gather_fill": lambda x, v, i, k, w: x.at[i, 1].get(mode="fill", fill_value=-7.0),
    "point_gather_clip": lambda x, v, i, k, w: x.at[i, 2].get(mode="clip"),
    "take_along_axis": lambda x, v, i, k, w: jnp.take_along_axis(x, (i & 3)[:1], axis=0),
    "slice_gather": lambda x, v, i, k, w: jax.vmap(
        lambda row, s: jax.lax.dynamic_slice_in_dim(row, s, 2)
    )(x.T, (i[0] & 1)),
    "nested_jit_custom_jvp": lambda x, v, i, k, w: jax.jit(jax.nn.relu)(x) + jax.nn.softplus(v)[None],
}


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_vmap_last_matches_vmap(name):
    _check(CATALOGUE[name])


def test_fallback_is_vmap():
    """A primitive without a batch-last rule (a while loop) is batched by jax.vmap, and is
    counted."""

    def f(x, v, i, k, w):
        return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 0.5 + v), (0, v))[1]

    before = _batchlast.FALLBACKS.get("while", 0)
    _check(f)
    assert _batchlast.FALLBACKS.get("while", 0) == before + 1


STATUSES = ["success", "success", "nonfinite"]  # of the contract batch


@pytest.mark.parametrize("policy", ["flow-grad", "disc-lat", "flow-rif", "rand", "mnlb"])
def test_simulate_batch_last_equals_batch_first(policy):
    """The same arithmetic in either layout: float64 workloads, routings and totals to
    rounding, statuses equal (the poisoned scenario `nonfinite` in both)."""
    scn = contract_batch()
    kw = CONTRACT_RUN
    a = dl.simulate(scn, policy, **kw)
    _batchlast.FALLBACKS.clear()
    b = dl.simulate(scn, policy, layout="batch-last", **kw)
    np.testing.assert_array_equal(np.asarray(a.status), np.asarray(b.status))
    assert a.status_names().tolist() == STATUSES
    assert float(np.max(np.abs(np.asarray(a.N[:2, -1] - a.N[:2, 0])))) > 0.1  # it moved
    for field in ("N", "x", "arrivals", "departures", "in_flight", "workload_integral"):
        got, want = np.asarray(getattr(b, field)), np.asarray(getattr(a, field))
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13, err_msg=field)
    if policy == "flow-grad":
        # the rings are read by the flat point gather, not by vmap's transposing gather
        assert "gather" not in _batchlast.FALLBACKS and "scatter" not in _batchlast.FALLBACKS


def test_simulate_batch_last_float32():
    """float32 batch-last in two chunks equals batch-first to 1e-5 at the saves both make
    (the first and the last: the runs' save counts are those of
    `test_default_layout_is_used`, whose programs they share)."""
    scn = contract_batch()
    kw = dict(CONTRACT_RUN, dtype=jnp.float32)
    a = dl.simulate(scn, "flow-grad", **dict(kw, n_save=20))
    b = dl.simulate(scn, "flow-grad", layout="batch-last", chunk=2, **dict(kw, n_save=1))
    assert a.status_names().tolist() == b.status_names().tolist() == STATUSES
    np.testing.assert_allclose(np.asarray(b.N), np.asarray(a.N)[:, [0, -1]], rtol=1e-5, atol=1e-5)
    assert float(np.max(np.abs(np.asarray(a.N[:2, -1] - a.N[:2, 0])))) > 0.1  # it moved


def test_batch_last_failure_is_a_status():
    """A poisoned scenario (NaN base latency, validation bypassed: the contract batch's
    third) ends `nonfinite` with finite, frozen values in the batch-last loop too (which
    checks the observations' finiteness from their ring slot), equal to the batch-first
    run; the others succeed."""
    bad = contract_batch()
    assert np.isnan(np.asarray(bad.service.params["base_latency"])[2, 0])
    a = dl.simulate(bad, "flow-grad", **CONTRACT_RUN)
    b = dl.simulate(bad, "flow-grad", layout="batch-last", **CONTRACT_RUN)
    assert b.status_names().tolist() == STATUSES
    assert a.status_names().tolist() == b.status_names().tolist()
    assert np.all(np.isfinite(np.asarray(b.N)))
    np.testing.assert_allclose(np.asarray(b.N), np.asarray(a.N), rtol=1e-13, atol=1e-13)


def test_layout_is_checked():
    with pytest.raises(ValueError, match=r"layout = 'sideways' is invalid: allowed batch-first"):
        dl.simulate(contract_batch(), "rand", tick=0.01, horizon=0.1, n_save=1, layout="sideways")


def test_default_layout_rules():
    """`layout=None` puts the batch last for float32 on a CPU with `Fast`, up to 16 cells,
    from 128 scenarios per device and 4 ticks per save; anything else stays batch-first."""
    assert jax.default_backend() == "cpu"
    f32, f64 = jnp.float32, jnp.float64
    fast = dl.Fast()
    assert default_layout(f32, 10, 500, fast, 100) == "batch-last"
    assert default_layout(f32, 16, 128, dl.Fast(2), 32) == "batch-last"
    assert default_layout(f64, 10, 500, fast, 100) == "batch-first"
    assert default_layout(f32, 17, 500, fast, 100) == "batch-first"
    assert default_layout(f32, 10, 127, fast, 100) == "batch-first"
    assert default_layout(f32, 10, 500, fast, 4) == "batch-last"
    assert default_layout(f32, 10, 500, fast, 3) == "batch-first"
    assert default_layout(f32, 10, 500, dl.Accurate(), 100) == "batch-first"


def test_default_layout_is_used(monkeypatch):
    """`simulate` without a layout runs the layout `default_layout` names (here with the
    share threshold lowered to 2 scenarios, `SimulateOptions(batch_last_chunk=2)`): float32
    with 40 ticks per save batch-last, equal to the bit to an explicit
    `layout="batch-last"` run; float64, and float32 with 2 ticks per save, batch-first."""
    chosen = []
    real = verb._chosen_chunk

    def spy(chunk, n, share, layout="batch-first", options=None):
        chosen.append(layout)
        return real(chunk, n, share, layout, options)

    monkeypatch.setattr(verb, "_chosen_chunk", spy)  # (a spy: it changes nothing)
    scn = contract_batch()
    opts = dl.SimulateOptions(batch_last_chunk=2)
    assert default_layout(jnp.float32, 3, 3, dl.Fast(), 40, opts) == "batch-last"
    assert default_layout(jnp.float32, 3, 3, dl.Fast(), 40) == "batch-first"  # 3 < 128
    kw = dict(CONTRACT_RUN, n_save=1, options=opts)  # 40 ticks per save
    got = dl.simulate(scn, "flow-grad", dtype=jnp.float32, **kw)
    last = dl.simulate(scn, "flow-grad", dtype=jnp.float32, layout="batch-last", **kw)
    dl.simulate(scn, "flow-grad", **dict(kw, n_save=40))  # (the contract's program)
    dl.simulate(scn, "flow-grad", dtype=jnp.float32, **dict(kw, n_save=20))  # 2 per save
    assert chosen == ["batch-last", "batch-last", "batch-first", "batch-first"]
    np.testing.assert_array_equal(np.asarray(got.N), np.asarray(last.N))


def test_batch_last_with_buffers_and_error_aversion():
    """Finite buffers that overflow during a burst, with error aversion shifting the random
    split away (the queue-overflow projection and the aversion state in the loop): the same
    workloads, drops and routings in either layout (float64, 1e-12), and drops happen."""

    def burst(buffer):
        prof = {"times": [0.0, 2.0, 2.0, 8.0, 8.0], "rates": [8.0, 8.0, 16.0, 16.0, 8.0]}
        return dl.scenario_from_dict({"name": "burst", "cells": [
            {"name": "a", "arrival_rate": prof, "buffer": buffer,
             "service": {"model": "mm1", "capacity": 6.0}},
            {"name": "b", "arrival_rate": 0.0, "buffer": 50.0,
             "service": {"model": "mm1", "capacity": 20.0}}],
            "latency": [[0.0, 0.02], [0.02, 0.0]]})  # fmt: skip

    scn = dl.stack_scenarios([burst(3.0), burst(4.0)])
    kw = dict(tick=0.05, horizon=10.0, n_save=4, error_aversion=dl.ErrorAversion())
    a = dl.simulate(scn, "rand", **kw)
    b = dl.simulate(scn, "rand", layout="batch-last", **kw)
    assert a.status_names().tolist() == b.status_names().tolist() == ["success"] * 2
    assert float(np.min(np.asarray(a.drops)[:, -1, 0])) > 0.1
    for field in ("N", "x", "drops", "arrivals"):
        got, want = np.asarray(getattr(b, field)), np.asarray(getattr(a, field))
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=field)
