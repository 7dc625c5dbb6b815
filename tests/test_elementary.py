"""The arithmetic exponential and log1p of `dlbfluid._elementary` against numpy's float64
functions, in units of the last place of their dtype (the softplus built on them:
`tests/test_service.py::test_softplus_sigmoid_from_one_exponential`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dlbfluid  # noqa: F401  (float64 enabled)
from dlbfluid._elementary import exp_neg, log1p_unit

# Dense on [0, 1], then out to the underflow threshold of float64 and beyond.
X = -np.concatenate(
    [np.linspace(0.0, 1.0, 20001), np.linspace(1.0, 40.0, 20001), np.linspace(40.0, 760.0, 20001)]
)
FLOOR = {np.float64: -708.0, np.float32: -87.0}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_exp_neg_within_one_ulp_and_flushes_below_the_normal_range(dtype):
    x = X.astype(dtype)
    got = np.asarray(jax.jit(exp_neg)(jnp.asarray(x)))
    assert got.dtype == dtype
    ref = np.exp(x.astype(np.float64))
    normal = x >= FLOOR[dtype]
    ulps = np.abs(got[normal] / ref[normal] - 1.0) / np.finfo(dtype).eps
    assert ulps.max() <= 1.5  # measured 1.0 (float64), 0.8 (float32)
    assert got[x == 0][0] == 1.0
    assert np.all(got[~normal] == 0.0)  # e^x below the smallest normal number
    assert np.all(got[normal] >= np.finfo(dtype).tiny)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_log1p_unit_within_two_ulps_and_exact_at_zero(dtype):
    tiny = -300 if dtype == np.float64 else -37
    e = np.concatenate([np.linspace(0.0, 1.0, 40001), np.logspace(tiny, 0.0, 2001)])
    e = e.astype(dtype)
    got = np.asarray(jax.jit(log1p_unit)(jnp.asarray(e)))
    ref = np.log1p(e.astype(np.float64))
    pos = e > 0
    ulps = np.abs(got[pos] / ref[pos] - 1.0) / np.finfo(dtype).eps
    assert ulps.max() <= 2.5  # measured 2.0 (float64), 1.8 (float32)
    assert got[0] == 0.0

