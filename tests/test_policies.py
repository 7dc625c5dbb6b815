"""Projection and router updates."""

import jax.numpy as jnp
import numpy as np
import pytest
from reference import simplex_projection

import dlbfluid as dl


@pytest.mark.parametrize("method", ["network", "sort", "pairwise"])
def test_projection_kkt(method):
    """Pi(v) on a masked simplex, by every method: feasible, and v - Pi(v) = theta on the
    support and <= theta off it (the KKT conditions of min ||z - v||^2); equals the numpy
    reference. A quarter of the rows carry exact ties (the pairwise method's tie groups)."""
    rng = np.random.default_rng(1)
    v = rng.normal(scale=2.0, size=(200, 6))
    v[::4, 1:3] = v[::4, :1]  # three equal entries
    mask = rng.random((200, 6)) < 0.7
    mask[:, 0] |= ~mask.any(axis=1)
    z = np.asarray(dl.project_simplex(jnp.asarray(v), jnp.asarray(mask), method=method))
    assert np.all(z >= 0) and np.all(z[~mask] == 0)
    np.testing.assert_allclose(z.sum(axis=1), 1.0, atol=1e-12)
    for row in range(200):
        support = z[row] > 0
        theta = (v[row] - z[row])[support]
        assert np.ptp(theta) < 1e-12
        off = mask[row] & ~support
        assert np.all(v[row][off] - theta[0] <= 1e-12)
        np.testing.assert_allclose(z[row], simplex_projection(v[row], mask[row]), atol=1e-12)


@pytest.mark.parametrize("method", ["network", "sort", "pairwise"])
def test_projection_empty_row_is_zero(method):
    mask = jnp.array([[False] * 3, [True, False, True]])
    z = dl.project_simplex(jnp.ones((2, 3)), mask, method=method)
    np.testing.assert_array_equal(z, [[0, 0, 0], [0.5, 0, 0.5]])


def test_sorting_network_sorts():
    """`sorting_network(n)` sorts every 0-1 input for n <= 14 (so, by the 0-1 principle,
    every input), and random inputs with ties up to 40; its sizes are Batcher's (0, 1, 3,
    5, 9, 12, 16, 19, 28, 32 comparators for n = 1..10)."""
    from dlbfluid._policies.projection import sorting_network

    def run(n, a):
        a = a.copy()
        for i, j in sorting_network(n):
            a[:, i], a[:, j] = np.maximum(a[:, i], a[:, j]), np.minimum(a[:, i], a[:, j])
        return a

    assert [len(sorting_network(n)) for n in range(1, 11)] == [0, 1, 3, 5, 9, 12, 16, 19, 28, 32]
    for n in range(1, 15):
        bits = (np.arange(2**n)[:, None] >> np.arange(n)) & 1
        out = run(n, bits)
        assert np.all(np.diff(out, axis=1) <= 0), n
    rng = np.random.default_rng(3)
    for n in range(15, 41):
        a = rng.integers(0, 5, size=(300, n)).astype(float) + rng.normal(size=(300, n)) * (n % 2)
        np.testing.assert_array_equal(run(n, a), -np.sort(-a, axis=1))
    assert all(i < j for n in range(1, 41) for i, j in sorting_network(n))


@pytest.mark.parametrize("n", [1, 2, 3, 7, 10, 16, 17, 32, 33])
def test_projection_methods_agree(n):
    """The network, the pairwise sums and the sort give the same projection, to 4 ulps of
    the entries, for every row width the routers use; "auto" is the network up to 16
    entries, the pairwise sums to 32, the sort beyond. Rows mix single allowed entries,
    empty rows, ties and wide ranges."""
    rng = np.random.default_rng(n)
    v = rng.normal(scale=rng.choice([0.01, 1.0, 100.0], size=(400, 1)), size=(400, n))
    v[::5, : n // 2] = v[::5, :1]
    mask = rng.random((400, n)) < 0.6
    mask[::7] = False
    mask[::7, rng.integers(n)] = True
    mask[::11] = False
    z = {
        m: np.asarray(dl.project_simplex(jnp.asarray(v), jnp.asarray(mask), method=m))
        for m in ("network", "pairwise", "sort", "auto")
    }
    scale = 4 * np.finfo(np.float64).eps * np.maximum(1.0, np.abs(v).max(axis=1, keepdims=True))
    for m in ("pairwise", "sort"):
        assert np.all(np.abs(z["network"] - z[m]) <= scale), m
    auto = "network" if n <= 16 else "pairwise" if n <= 32 else "sort"
    np.testing.assert_array_equal(z["auto"], z[auto])
    np.testing.assert_array_equal(z["network"][::11], 0.0)


def test_projection_bad_method():
    with pytest.raises(ValueError, match="method = 'heap' is invalid: allowed 'auto', 'network'"):
        dl.project_simplex(jnp.ones(3), jnp.ones(3, bool), method="heap")


def test_discrete_update_and_ties():
    allowed = jnp.array([[True, True, True], [True, False, True]])
    c = jnp.array([[2.0, 1.0, 1.0], [3.0, 0.0, 1.0]])
    x = jnp.zeros((2, 3))
    split = dl.DiscreteRouting("latency").route(x, c, None, allowed)
    first = dl.DiscreteRouting("latency", tie="first").route(x, c, None, allowed)
    np.testing.assert_allclose(split, [[0, 0.5, 0.5], [0, 0, 1]])  # forbidden arc ignored
    np.testing.assert_allclose(first, [[0, 1, 0], [0, 0, 1]])


def test_flow_update_is_projected_step():
    allowed = jnp.array([[True, True, False]])
    x = jnp.array([[0.5, 0.5, 0.0]])
    c = jnp.array([[1.0, 3.0, -100.0]])
    new = dl.FlowRouting("gradient").route(x, c, jnp.array([0.1]), allowed)
    np.testing.assert_allclose(new, [[0.6, 0.4, 0.0]])


@pytest.mark.parametrize("name", dl.POLICY_NAMES)
def test_policy_names_round_trip(name):
    assert dl.policy_from_name(name).name == name


def test_unknown_policy_and_cost():
    with pytest.raises(ValueError, match="allowed policies"):
        dl.policy_from_name("flow-speed")
    with pytest.raises(ValueError, match="allowed costs"):
        dl.FlowRouting("speed")
    with pytest.raises(ValueError, match="tie"):
        dl.DiscreteRouting("rif", tie="random")
