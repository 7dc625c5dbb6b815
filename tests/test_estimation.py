"""Latency-model estimation (seed §3.3, §5.4; theory/estimation.md).

Known answers: noise-free samples are fitted back to the generating parameters; noisy fits
land on the minimiser found by an independent scipy `least_squares` (trust-region
reflective, float64, started at the truth) and within stated statistical tolerances of the
truth; the §5.4 perturbation is checked against a numpy re-implementation and its draws
against U[-1, 1].
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize
import scipy.stats

from dlbfluid._service import ServiceModel
from dlbfluid._service.estimation import (
    FIT_STATUS,
    _fit_batch,
    fit_latency_model,
    perturb_service,
    sample_latency,
)

# Four identifiable softplus cells (knee inside the sampled range, width resolvable) and one
# M/M/1 cell. a0 = L0 - knee/capacity = 0.5, 0.2, 0.08, 1.0.
CAP = np.array([10.0, 4.0, 50.0, 2.0, 5.0])
L0 = np.array([1.0, 0.5, 0.2, 3.0, 1.0])
KNEE = np.array([5.0, 1.2, 6.0, 4.0, 0.0])
WIDTH = np.array([2.0, 0.3, 1.5, 1.0, 1.0])
MODEL = np.array([1, 1, 1, 1, 0])
SP = MODEL == 1
K = 2000
NOISE = 0.05
MAX_LOAD = 3.0


def service(model=MODEL, cap=CAP, L0=L0, knee=KNEE, width=WIDTH):
    return ServiceModel(
        model=jnp.asarray(model, jnp.int32),
        capacity=jnp.asarray(cap, float),
        base_latency=jnp.asarray(L0, float),
        knee=jnp.asarray(knee, float),
        width=jnp.asarray(width, float),
    )


def np_latency(N, model, cap, L0, knee, width):
    """float64 numpy reference of l(N) for one cell."""
    if model == 0:
        return (1.0 + N) / cap
    return L0 + width / cap * np.logaddexp(0.0, (N - knee) / width)


def n_max(j):
    l0 = np_latency(0.0, MODEL[j], CAP[j], L0[j], KNEE[j], WIDTH[j])
    return MAX_LOAD * CAP[j] * l0


@pytest.fixture(scope="module")
def truth():
    return service()


@pytest.fixture(scope="module")
def clean(truth):
    return sample_latency(truth, 0, K, noise=0.0, max_load=MAX_LOAD)


@pytest.fixture(scope="module")
def noisy(truth):
    return sample_latency(truth, 1, K, noise=NOISE, max_load=MAX_LOAD)


@pytest.fixture(scope="module")
def noisy_fit(noisy):
    return fit_latency_model(*noisy)


def grid_error(fit, j, lo=0.0):
    """max relative error of the fitted l(N) against the truth over [lo, 1] * range."""
    g = np.linspace(lo, 1.0, 401) * n_max(j)
    ref = np_latency(g, MODEL[j], CAP[j], L0[j], KNEE[j], WIDTH[j])
    got = np.array([float(v) for v in _cell(fit, j).latency(jnp.asarray(g))])
    return np.max(np.abs(got / ref - 1.0))


def _cell(svc, j):
    return jax.tree.map(lambda x: jnp.full((1,), x[j]), svc)


# --- samples -----------------------------------------------------------------------


def test_sample_shapes_range_and_noise_model(truth, clean, noisy):
    N, y = noisy
    assert N.shape == y.shape == (5, K)
    Nn, yn = np.asarray(N), np.asarray(y)
    for j in range(5):
        hi = n_max(j)
        assert Nn[j].min() >= 0 and Nn[j].max() <= hi
        # U[0, hi]: mean hi/2 and variance hi^2/12, within 4 standard errors.
        u = Nn[j] / hi
        assert abs(u.mean() - 0.5) < 4 * np.sqrt(1 / 12 / K)
        assert abs(u.var() - 1 / 12) < 4 * np.sqrt(1 / 180 / K)
    ref = np.stack(
        [np_latency(Nn[j], *(v[j] for v in (MODEL, CAP, L0, KNEE, WIDTH))) for j in range(5)]
    )
    # log(y / l(N)) ~ N(0, noise^2): mean within 4 s.e., standard deviation within 4 s.e.
    z = np.log(yn / ref).ravel()
    assert abs(z.mean()) < 4 * NOISE / np.sqrt(z.size)
    assert abs(z.std() / NOISE - 1) < 4 / np.sqrt(2 * z.size)
    assert abs(scipy.stats.skew(z)) < 4 * np.sqrt(6 / z.size)
    # noise = 0 returns the model exactly; the M/M/1 range is 3 * capacity * (1/capacity) = 3.
    Nc, yc = (np.asarray(v) for v in clean)
    refc = np.stack(
        [np_latency(Nc[j], *(v[j] for v in (MODEL, CAP, L0, KNEE, WIDTH))) for j in range(5)]
    )
    np.testing.assert_allclose(yc, refc, rtol=1e-14)
    assert Nc[4].max() <= 3.0 and Nc[4].max() > 2.9
    # reproducible from the seed, different for another seed
    N2, y2 = sample_latency(truth, 1, K, noise=NOISE, max_load=MAX_LOAD)
    np.testing.assert_array_equal(np.asarray(N2), Nn)
    np.testing.assert_array_equal(np.asarray(y2), yn)
    assert not np.allclose(Nc, Nn)


# --- fits --------------------------------------------------------------------------


def test_noise_free_fit_recovers_parameters(clean):
    """Exact data: (L0, capacity, knee, width) to 1e-6 relative (measured ~1e-10) and
    l(N) to 1e-8 over the sampled range, for the identifiable softplus cells."""
    fit, info = fit_latency_model(*clean)
    assert np.all(np.asarray(info.status)[SP] == FIT_STATUS["converged"])
    for name, ref in (("base_latency", L0), ("capacity", CAP), ("knee", KNEE), ("width", WIDTH)):
        np.testing.assert_allclose(
            np.asarray(getattr(fit, name))[SP], ref[SP], rtol=1e-6, err_msg=name
        )
    for j in np.nonzero(SP)[0]:
        assert grid_error(fit, j) < 1e-8
    assert np.all(np.asarray(info.loss)[SP] < 1e-14)
    # M/M/1 data are the knee-less limit of the softplus family (N0 -> 0, s -> 0): the fit
    # approaches it, with the gap confined to the lowest workloads.
    assert grid_error(fit, 4, lo=0.1) < 2e-3
    assert abs(float(fit.capacity[4]) / CAP[4] - 1) < 2e-3
    a0 = np.asarray(fit.base_latency - fit.knee / fit.capacity)
    assert np.all(a0 > 0) and np.all(np.asarray(fit.knee) >= 0)
    assert np.all(np.asarray(fit.model) == 1)


def _scipy_fit(N, y, theta0):
    """Independent reference: the same log least squares in theta = (a0, beta, N0, s), by
    scipy's trust-region-reflective method with bounds a0, beta, s > 0, N0 >= 0."""

    def res(th):
        a0, beta, knee, width = th
        return np.log(a0 + beta * (N + width * np.logaddexp(0.0, (knee - N) / width))) - np.log(y)

    sol = scipy.optimize.least_squares(
        res,
        theta0,
        bounds=([1e-12, 1e-12, 0.0, 1e-12], np.inf),
        x_scale=np.abs(theta0),
        xtol=1e-15,
        ftol=1e-15,
        gtol=1e-15,
        max_nfev=10_000,
    )
    return sol.x, np.mean(sol.fun**2)


def test_noisy_fit_matches_scipy_and_truth(noisy, noisy_fit):
    """5% lognormal noise, 2000 samples per cell.

    Against scipy on the same data: the same minimiser (parameters to 1e-5 relative, loss
    to 1e-9). Against the truth: tolerances of about 4 standard deviations of a 100-replicate
    Monte Carlo of these cells (theory/estimation.md, *Accuracy*): capacity 3%, L0 4%, knee
    8%, width 30%, and l(N) within 2.5% over the sampled range."""
    fit, info = noisy_fit
    N, y = (np.asarray(v) for v in noisy)
    assert np.all(np.asarray(info.status) == FIT_STATUS["converged"])
    for j in np.nonzero(SP)[0]:
        beta = 1 / CAP[j]
        th0 = np.array([L0[j] - KNEE[j] * beta, beta, KNEE[j], WIDTH[j]])
        th_ref, loss_ref = _scipy_fit(N[j], y[j], th0)
        fj = _cell(fit, j)
        th = np.array(
            [
                float(fj.base_latency[0] - fj.knee[0] / fj.capacity[0]),
                float(1 / fj.capacity[0]),
                float(fj.knee[0]),
                float(fj.width[0]),
            ]
        )
        np.testing.assert_allclose(th, th_ref, rtol=1e-5)
        np.testing.assert_allclose(float(info.loss[j]), loss_ref, rtol=1e-9)
        assert float(info.loss[j]) <= loss_ref * (1 + 1e-12)
        # statistical accuracy against the truth
        assert abs(float(fj.capacity[0]) / CAP[j] - 1) < 0.03
        assert abs(float(fj.base_latency[0]) / L0[j] - 1) < 0.04
        assert abs(float(fj.knee[0]) / KNEE[j] - 1) < 0.08
        assert abs(float(fj.width[0]) / WIDTH[j] - 1) < 0.30
        assert grid_error(fit, j) < 0.025
    # the residual RMS estimates the noise level
    np.testing.assert_allclose(np.asarray(info.rmse)[SP], NOISE, rtol=0.1)


def test_fit_is_per_cell_and_shape_agnostic(noisy, noisy_fit):
    """Permuting cells permutes the fits (no cross-cell coupling, e.g. a shared
    normalisation), and a (5, 1, K) batch gives the (5, K) answer reshaped."""
    fit, _ = noisy_fit
    N, y = noisy
    perm = np.array([3, 0, 4, 1, 2])
    fit_p, _ = fit_latency_model(N[perm], y[perm])
    for name in ("capacity", "base_latency", "knee", "width"):
        np.testing.assert_allclose(
            np.asarray(getattr(fit_p, name)), np.asarray(getattr(fit, name))[perm], rtol=1e-10
        )
    fit_3, info_3 = fit_latency_model(N[:, None, :], y[:, None, :])
    assert fit_3.capacity.shape == (5, 1) and info_3.status.shape == (5, 1)
    np.testing.assert_allclose(np.asarray(fit_3.knee)[:, 0], np.asarray(fit.knee), rtol=1e-10)


def test_warm_start_reaches_the_same_fit(noisy, noisy_fit):
    """Starting from a perturbed copy of the fit (the `init` path, same compiled function)
    returns to the same minimiser."""
    fit, info = noisy_fit
    init = perturb_service(fit, 0.2, 5)
    fit_w, info_w = fit_latency_model(*noisy, init=init)
    assert np.all(np.asarray(info_w.status)[SP] == FIT_STATUS["converged"])
    for name in ("capacity", "base_latency", "knee", "width"):
        np.testing.assert_allclose(
            np.asarray(getattr(fit_w, name))[SP], np.asarray(getattr(fit, name))[SP], rtol=1e-5
        )
    np.testing.assert_allclose(np.asarray(info_w.loss), np.asarray(info.loss), rtol=1e-6)


def test_status_flags_unfinished_and_nonfinite_fits(noisy):
    N, y = noisy
    _, info = fit_latency_model(N, y, steps=1, polish_steps=0)
    assert np.all(np.asarray(info.status) == FIT_STATUS["not_converged"])
    assert list(info.status_names()) == ["not_converged"] * 5
    assert np.all(np.asarray(info.steps) == 1)
    # The public entry rejects NaN samples up front; the jitted core (as used under a
    # caller's jit, where those checks cannot run) must flag them, not return a silent NaN.
    y_bad = y.at[1, 3].set(jnp.nan)
    r0 = jnp.zeros((5, 4))
    one = lambda v, dt=None: jnp.asarray(v, dt)  # noqa: E731
    out = _fit_batch(
        N, y_bad, r0, one(False), one(10, jnp.int32), one(10, jnp.int32), one(0.05), one(1e-8)
    )
    status = np.asarray(out[-1])
    assert status[1] == FIT_STATUS["nonfinite"]
    assert np.all(status[[0, 2, 3, 4]] != FIT_STATUS["nonfinite"])


# --- perturbation (seed §5.4) ------------------------------------------------------


def random_service(n, seed):
    rng = np.random.default_rng(seed)
    cap = 10 ** rng.uniform(0, 2, n)
    L0 = 10 ** rng.uniform(-1, 0.5, n)
    knee = rng.uniform(0.0, 1.0, n) * cap * L0 * (1 - 1e-9)  # a0 down to ~1e-9 L0
    width = 10 ** rng.uniform(-1, 1, n)
    model = (rng.uniform(size=n) < 0.8).astype(int)
    return service(model, cap, L0, knee, width)


def test_perturbation_matches_reference_and_is_uniform():
    n, eps = 20_000, 0.3
    svc = random_service(n, 0)
    out, xi = perturb_service(svc, eps, 7, return_xi=True)
    xi = np.asarray(xi)
    # xi ~ U[-1, 1]: support, Kolmogorov-Smirnov, first two moments
    assert xi.min() >= -1 and xi.max() <= 1
    assert scipy.stats.kstest(xi, scipy.stats.uniform(loc=-1, scale=2).cdf).pvalue > 1e-3
    assert abs(xi.mean()) < 4 * np.sqrt(1 / 3 / n)
    # numpy reference: theta = (a0, beta, N0, s) scaled by c = 1 + eps xi, one c per cell
    m, cap, L0, knee, width = (
        np.asarray(v) for v in (svc.model, svc.capacity, svc.base_latency, svc.knee, svc.width)
    )
    c = 1 + eps * xi
    beta, a0 = 1 / cap, L0 - knee / cap
    sp = m == 1
    ref_cap = np.where(sp, 1 / (c * beta), c * cap)
    ref_L0 = np.where(sp, c * a0 + (c * beta) * (c * knee), L0)
    np.testing.assert_allclose(np.asarray(out.capacity), ref_cap, rtol=1e-13)
    np.testing.assert_allclose(np.asarray(out.knee), np.where(sp, c * knee, knee), rtol=1e-13)
    np.testing.assert_allclose(np.asarray(out.width), np.where(sp, c * width, width), rtol=1e-13)
    np.testing.assert_allclose(np.asarray(out.base_latency), ref_L0, rtol=1e-12)
    np.testing.assert_array_equal(np.asarray(out.model), m)
    # the same xi scales every parameter of a cell: recover c from each one
    a0_new = np.asarray(out.base_latency - out.knee / out.capacity)
    ratios = [a0_new / a0, cap / np.asarray(out.capacity), np.asarray(out.width) / width]
    for r in ratios:
        np.testing.assert_allclose(r[sp], c[sp], rtol=1e-6)
    # seeds: reproducible, and different seeds give different draws
    _, xi2 = perturb_service(svc, eps, 7, return_xi=True)
    np.testing.assert_array_equal(np.asarray(xi2), xi)
    _, xi3 = perturb_service(svc, eps, 8, return_xi=True)
    assert not np.allclose(np.asarray(xi3), xi)


def test_perturbation_keeps_a0_positive_and_eps0_is_identity():
    svc = random_service(5_000, 1)
    sp = np.asarray(svc.model) == 1
    for eps in (0.5, 0.99):
        out = perturb_service(svc, eps, 3)
        a0 = np.asarray(out.base_latency - out.knee / out.capacity)
        assert np.all(a0[sp] > 0)
        assert np.all(np.asarray(out.capacity) > 0) and np.all(np.asarray(out.width) > 0)
        assert np.all(np.asarray(out.base_latency) > 0)
    same = perturb_service(svc, 0.0, 3)
    for name in ("model", "capacity", "base_latency", "knee", "width"):
        np.testing.assert_array_equal(
            np.asarray(getattr(same, name)), np.asarray(getattr(svc, name))
        )


# --- bad input ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda s, N, y: perturb_service(s, 1.0, 0), r"eps = 1\.0 .*\[0\.0, 1\.0\)"),
        (lambda s, N, y: perturb_service(s, -0.1, 0), r"eps = -0\.1"),
        (lambda s, N, y: perturb_service(s, float("nan"), 0), r"eps = nan"),
        (lambda s, N, y: perturb_service(s, "0.1", 0), r"eps = '0\.1'"),
        (lambda s, N, y: perturb_service(s, 0.1, "x"), r"seed = 'x'"),
        (lambda s, N, y: sample_latency(s, 0, 3), r"n_samples = 3 .*>= 4"),
        (lambda s, N, y: sample_latency(s, 0, 10, noise=-0.1), r"noise = -0\.1"),
        (lambda s, N, y: sample_latency(s, 0, 10, max_load=0.0), r"max_load = 0\.0"),
        (lambda s, N, y: fit_latency_model(N, y[:, :-1]), r"shapes"),
        (lambda s, N, y: fit_latency_model(N[:, :3], y[:, :3]), r"n_samples = 3"),
        (lambda s, N, y: fit_latency_model(N.at[0, 0].set(-1.0), y), r"N contains -1\.0"),
        (
            lambda s, N, y: fit_latency_model(N, y.at[1, 2].set(0.0), steps=1),
            r"latency contains 0\.0",
        ),
        (lambda s, N, y: fit_latency_model(N * 0, y), r"max\(N\) > 0"),
        (lambda s, N, y: fit_latency_model(N, y, steps=-1), r"steps = -1"),
        (lambda s, N, y: fit_latency_model(N, y, learning_rate=0.0), r"learning_rate = 0\.0"),
        (lambda s, N, y: fit_latency_model(N, y, init=s), r"init\.model"),
        (lambda s, N, y: fit_latency_model(N, y, init="a"), r"init = str"),
    ],
)
def test_bad_input_raises(call, match, noisy, truth):
    N, y = (v[:, :8] for v in noisy)
    with pytest.raises(ValueError, match=match):
        call(truth, N, y)
