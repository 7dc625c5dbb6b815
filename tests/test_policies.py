"""Projection and router updates."""

import jax.numpy as jnp
import numpy as np
import pytest
from reference import simplex_projection

import dlbfluid as dl


@pytest.mark.parametrize("method", ["sort", "pairwise"])
def test_projection_kkt(method):
    """Pi(v) on a masked simplex, by either method: feasible, and v - Pi(v) = theta on the
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


def test_projection_empty_row_is_zero():
    z = dl.project_simplex(jnp.ones((2, 3)), jnp.array([[False] * 3, [True, False, True]]))
    np.testing.assert_allclose(z, [[0, 0, 0], [0.5, 0, 0.5]])


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
