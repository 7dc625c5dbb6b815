"""Service models against closed forms and the softplus table of theory/service.md."""

import jax.numpy as jnp
import numpy as np
import pytest

import dlbfluid as dl

N_TABLE = np.array([0.0, 1.0, 5.0, 10.0, 20.0, 50.0, 100.0])
# theory/service.md unit-test values for L0 = 1, mubar = 10, N0 = 5, s = 2 (a0 = 0.5).
ELL = [1.015778, 1.025386, 1.138629, 1.515778, 2.500111, 5.500000, 10.500000]
MU = [0.0, 0.975243, 4.391244, 6.597272, 7.999646, 9.090909, 9.523810]
MUP = [0.9844671, 0.9639055, 0.6854186, 0.2575037, 0.08018749, 0.01652893, 0.004535147]
INV = [1.015778, 1.037446, 1.458962, 3.883439, 12.470773, 60.5, 220.5]


def softplus_model(n, dtype=jnp.float64, L0=1.0, cap=10.0, knee=5.0, width=2.0):
    f = lambda v: jnp.full(n, v, dtype)
    return dl.ServiceModel(
        model=jnp.ones(n, jnp.int32),
        capacity=f(cap),
        base_latency=f(L0),
        knee=f(knee),
        width=f(width),
    )


def test_softplus_table():
    s = softplus_model(len(N_TABLE))
    N = jnp.asarray(N_TABLE)
    np.testing.assert_allclose(s.latency(N), ELL, rtol=1e-6)
    np.testing.assert_allclose(s.rate(N), MU, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(s.rate_prime(N), MUP, rtol=1e-6)
    np.testing.assert_allclose(s.inv_rate_prime(N), INV, rtol=1e-6)


def test_mm1_closed_forms():
    cap = 3.0
    s = dl.ServiceModel(
        model=jnp.zeros(4, jnp.int32),
        capacity=jnp.full(4, cap),
        base_latency=jnp.ones(4),
        knee=jnp.zeros(4),
        width=jnp.ones(4),
    )
    N = jnp.array([0.0, 0.5, 2.0, 40.0])
    np.testing.assert_allclose(s.rate(N), cap * N / (1 + N), rtol=1e-15)
    np.testing.assert_allclose(s.latency(N), (1 + N) / cap, rtol=1e-15)
    np.testing.assert_allclose(s.inv_rate_prime(N), (1 + N) ** 2 / cap, rtol=1e-15)
    z = jnp.array([0.0, 1.0, 2.9, 3.5])
    np.testing.assert_allclose(
        s.inverse_rate(z)[:3], np.array([0, 1, 2.9]) / (cap - np.array([0, 1, 2.9])), rtol=1e-14
    )
    assert np.isinf(s.inverse_rate(z)[3])


def test_rate_prime_matches_finite_differences():
    s = softplus_model(5, L0=0.8, cap=7.0, knee=3.0, width=0.7)
    N = jnp.array([0.1, 2.0, 3.0, 8.0, 60.0])
    h = 1e-6 * (1 + N)
    fd = (s.rate(N + h) - s.rate(N - h)) / (2 * h)
    np.testing.assert_allclose(s.rate_prime(N), fd, rtol=1e-7)


@pytest.mark.parametrize("N", [1234.567, 23456.71, 345678.9])
def test_float32_without_cancellation(N):
    """q = l - N l' is evaluated in a cancellation-free form: in float32 it keeps ~1e-6
    relative accuracy deep in the linear regime, where l and N l' agree to 4-6 digits."""
    s64, s32 = softplus_model(1), softplus_model(1, jnp.float32)
    n32 = jnp.array([N], jnp.float32)
    ref = float(s64.inv_rate_prime(n32.astype(jnp.float64))[0])
    got = float(s32.inv_rate_prime(n32)[0])
    stable_err = abs(got / ref - 1)
    assert stable_err < 1e-5
    np.testing.assert_allclose(
        float(s32.rate(n32)[0]), float(s64.rate(n32.astype(float))[0]), rtol=1e-6
    )


def test_inverse_rate_softplus_roundtrip():
    s = softplus_model(4)
    z = jnp.array([0.5, 4.0, 9.0, 9.99])
    N = s.inverse_rate(z)
    np.testing.assert_allclose(s.rate(N), z, rtol=1e-12)


def test_softplus_rate_is_increasing_and_concave():
    s = softplus_model(1)
    N = jnp.linspace(0, 200, 4001)[:, None]
    mu = np.asarray(s.rate(N))[:, 0]
    assert np.all(np.diff(mu) > 0)
    assert np.all(np.diff(mu, 2) < 1e-12)
    assert mu[-1] < 10.0


def test_softplus_sigmoid_from_one_exponential():
    """`softplus_sigmoid` (one exponential for sp(+-u), sigma(+-u)) against float64 numpy
    references (`np.logaddexp`, `scipy.special.expit`), and its derivative (a custom rule)
    against sp' = sigma and sigma' = sigma(u) sigma(-u), also at u = 0. Tolerance: a few
    ulps."""
    import jax
    from scipy.special import expit

    from dlbfluid._service import softplus_sigmoid

    u = np.concatenate([np.linspace(-60.0, 60.0, 2401), [0.0, -1e-300, 1e-300, 700.0, -700.0]])
    sp, sm, gp, gm = (np.asarray(a) for a in softplus_sigmoid(jnp.asarray(u)))
    ref_sp = np.logaddexp(u, 0.0)
    ref_sm = np.logaddexp(-u, 0.0)
    ref_gp = expit(u)
    ref_gm = expit(-u)
    for got, ref in ((sp, ref_sp), (sm, ref_sm), (gp, ref_gp), (gm, ref_gm)):
        np.testing.assert_allclose(got, ref, rtol=1e-15, atol=0.0)
    # derivative: sp' = sigma, sigma' = sigma(u) sigma(-u) (relative accuracy both ways)
    _, tangents = jax.jvp(softplus_sigmoid, (jnp.asarray(u),), (jnp.ones_like(jnp.asarray(u)),))
    dsp, dsm, dgp, dgm = (np.asarray(a) for a in tangents)
    np.testing.assert_allclose(dsp, ref_gp, rtol=1e-15)
    np.testing.assert_allclose(dsm, -ref_gm, rtol=1e-15)
    np.testing.assert_allclose(dgp, ref_gp * ref_gm, rtol=2e-15)
    np.testing.assert_allclose(dgm, -ref_gp * ref_gm, rtol=2e-15)
    assert float(dgp[u.size - 5]) == 0.25  # u = 0
