"""Probe smoothing at request level (`simulate_requests(probe_smoothing=T)`,
`--probe-smoothing`; theory/requests.md, *Probe smoothing*): the filter against its closed
forms, and whole runs whose routers provably see only the filtered probes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dlbfluid as dl
from dlbfluid._requests.loop import smooth_probes


def _filter(y, y0, h, T):
    def step(prev, yk):
        out = smooth_probes(prev, yk, h, T)
        return out, out

    return np.asarray(jax.jit(lambda y: jax.lax.scan(step, jnp.asarray(y0), y)[1])(y))


def test_step_response_is_the_first_order_filters():
    """A probe that jumps from y0 = 3 to y = 1 at k = 0: y_hat_k = y + (y0 - y) e^{-(k+1)h/T}
    exactly (the filter is the exact discretisation at the tick), to 1e-13."""
    h, T = 0.005, 0.2
    k = np.arange(200)
    got = _filter(np.ones(200), 3.0, h, T)
    np.testing.assert_allclose(got, 1.0 + 2.0 * np.exp(-(k + 1) * h / T), rtol=1e-13)


def test_white_noise_variance_shrinks_by_alpha_over_two_minus_alpha():
    """Unit white noise through the filter (alpha = 1 - e^{-h/T} = 0.0952): stationary
    variance alpha/(2 - alpha) = 0.0500, within 4 standard errors of 200,000 samples
    (batches of 2,000 for the correlation); the negative control: the raw variance, 1."""
    h, T = 0.01, 0.1
    alpha = -np.expm1(-h / T)
    y = np.random.default_rng(3).standard_normal(200_000)
    out = _filter(y, 0.0, h, T)[1000:]
    batches = out[: len(out) // 2000 * 2000].reshape(-1, 2000).var(axis=1)
    want = alpha / (2 - alpha)
    se = batches.std(ddof=1) / np.sqrt(len(batches))
    assert abs(batches.mean() - want) < 4 * se
    assert abs(batches.mean() - 1.0) > 100 * se


# Two M/M/1 cells of capacity 2, the only demand (1/s) at cell a's router, cell a starting
# with 3 requests and b empty: disc-rif sends everything to the cell of the least probed
# RIF. With the probes smoothed over 10^9 s the routers see N(0) = (3, 0) for the whole run,
# so after its first 3 requests cell a never holds one again; with raw probes both cells
# get traffic.
PAIR = {
    "name": "pair",
    "cells": [
        {"name": "a", "arrival_rate": 1.0, "service": {"model": "mm1", "capacity": 2.0}},
        {"name": "b", "arrival_rate": 0.0, "service": {"model": "mm1", "capacity": 2.0}},
    ],
    "latency": [[0.0, 0.05], [0.05, 0.0]],
    "initial": {"workload": [3.0, 0.0]},
}


@pytest.mark.parametrize("smoothing", [0.0, 1e9])
def test_routers_see_the_smoothed_probes(smoothing):
    scn = dl.scenario_from_dict(PAIR)
    sol = dl.simulate_requests(scn, "disc-rif", trials=4, seed=2, tick=0.05, horizon=60.0,
                               warmup=30.0, n_save=4, probe_smoothing=smoothing)  # fmt: skip
    a = np.asarray(sol.mean_requests)[:, 0]
    if smoothing:
        assert np.all(a == 0.0)  # (the frozen view: no request reaches a after t = 30 s)
    else:
        assert np.all(a > 0.05)


def test_probe_smoothing_is_checked():
    scn = dl.scenario_from_dict(PAIR)
    for bad in (-1.0, float("inf"), "1"):
        with pytest.raises(ValueError, match=r"probe_smoothing = .* is invalid"):
            dl.simulate_requests(scn, "rand", probe_smoothing=bad, horizon=1.0, tick=0.5)
