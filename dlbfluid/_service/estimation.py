"""Latency-model estimation: noisy samples, softplus fits, and estimation-noise injection.

Leaf routers fit a parametric latency model $\\ell(N;\\theta)$ to observed (workload,
latency) pairs and ship $\\theta$ to the root routers (seed §3.3); the seed's simulations
test robustness by perturbing $\\theta$ multiplicatively (seed §5.4). This module gives the
three pieces, each batched over cells (theory/estimation.md):

* `sample_latency`: synthetic samples $y = \\ell(N)\\,e^{\\sigma z}$ from a true model.
* `fit_latency_model`: log-least-squares fit of the softplus model with optax (Adam, then
  L-BFGS), in the parametrisation $\\theta = (a_0, \\beta, N_0, s)$ that keeps
  $a_0 = L_0 - N_0/\\bar\\mu > 0$ by construction.
* `perturb_service`: $\\theta_j \\to (1 + \\epsilon\\xi_j)\\,\\theta_j$, $\\xi_j \\sim U[-1, 1]$.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jaxtyping import Array, Float, Int

from .._results import RESULTS, status_names, view
from .._validate import integer, number
from . import ServiceModel, code, latency_asymptotic

FIT_STATUS = view("success", "not_converged", "nonfinite", aliases={"converged": "success"})
"""The `RESULTS` codes a fit can end with (`converged` is another name of `success`)."""

_N_PARAMS = 4  # theta = (a0, beta, N0, s)
_LO_QUANTILE = 0.1  # samples below this workload quantile set the initial flat level
_HI_QUANTILE = 0.6  # samples above this workload quantile set the initial asymptote
_FTOL = 1e-15  # relative loss decrease below which an L-BFGS step counts as stalled
_POLISH_FACTOR = 1e-2  # L-BFGS continues to gtol * this while the loss still falls


def _key(seed, field: str = "seed"):
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        return jr.key(int(seed))
    if isinstance(seed, jax.Array) and (
        jnp.issubdtype(seed.dtype, jax.dtypes.prng_key)
        or (seed.shape == (2,) and seed.dtype == jnp.uint32)
    ):
        return seed
    raise ValueError(f"{field} = {seed!r} is invalid: expected an int or a jax.random key")


def _is_concrete(*xs) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def _check_number(
    name: str, value, *, lo: float, hi: float = math.inf, lo_open=False, hi_open=True
):
    """`dlbfluid._validate.number` with this module's wording, an interval `[lo, hi)`."""
    lb = "(" if lo_open else "["
    rb = ")" if hi_open else "]"
    allowed = f"expected a finite number in {lb}{lo}, {hi}{rb}"
    return number(name, value, lo=lo, hi=hi, lo_open=lo_open, hi_open=hi_open, allowed=allowed)


# --- the model in the fit's coordinates --------------------------------------------


def _latency_theta(theta, N):
    """$\\ell(N) = a_0 + \\beta N + \\beta s\\,\\mathrm{sp}((N_0 - N)/s)$ (always $> a_0$):
    the softplus law in fit coordinates (`dlbfluid._service.softplus.latency_asymptotic`)."""
    return latency_asymptotic(*theta, N)


def _theta_from_raw(r):
    # a0, beta, s > 0 and N0 >= 0 by construction; N0 >= 0 also makes L0 = a0 + beta N0 > 0,
    # so every fit is a valid scenario service (theory/estimation.md, *Parametrisation*).
    return jax.nn.softplus(r)


def _raw_from_theta(theta):
    # Inverse softplus, x + log(1 - e^{-x}), accurate for small and large x.
    theta = jnp.maximum(theta, 1e-12)
    return theta + jnp.log(-jnp.expm1(-theta))


def theta_from_service(service: ServiceModel):
    """$\\theta = (a_0, \\beta, N_0, s)$ with $a_0 = L_0 - N_0/\\bar\\mu$, $\\beta = 1/\\bar\\mu$.

    M/M/1 cells, $\\ell = (1+N)/\\bar\\mu$, are the linear member $a_0 = \\beta = 1/\\bar\\mu$
    with no knee; they are returned as $(1/\\bar\\mu, 1/\\bar\\mu, 0, 1)$ (the last two unused).
    """
    beta = 1.0 / service.capacity
    a0 = service.base_latency - service.knee * beta
    mm1 = service.model == code("mm1")
    return (
        jnp.where(mm1, beta, a0),
        beta,
        jnp.where(mm1, 0.0, service.knee),
        jnp.where(mm1, 1.0, service.width),
    )


def service_from_theta(a0, beta, knee, width) -> ServiceModel:
    """The softplus `ServiceModel` of $\\theta$: $L_0 = a_0 + \\beta N_0$, $\\bar\\mu = 1/\\beta$."""
    a0, beta, knee, width = jnp.broadcast_arrays(
        *(jnp.asarray(v, dtype=jnp.result_type(float)) for v in (a0, beta, knee, width))
    )
    return ServiceModel.of(
        "softplus", capacity=1.0 / beta, base_latency=a0 + beta * knee, knee=knee, width=width
    )


# --- 1. synthetic samples ----------------------------------------------------------


@eqx.filter_jit
def _sample(service, key, n_samples, noise, max_load):
    shape = service.capacity.shape
    flat = jax.tree.map(lambda x: x.reshape(-1), service)
    keys = jr.split(key, flat.capacity.shape[0])
    zero = jnp.zeros_like(flat.capacity)
    n_max = max_load * flat.capacity * flat.latency(zero)

    def one(k, cell, nmax):
        kn, kz = jr.split(k)
        dtype = cell.capacity.dtype
        N = jr.uniform(kn, (n_samples,), minval=0.0, maxval=nmax, dtype=dtype)
        z = jr.normal(kz, (n_samples,), dtype=dtype)
        return N, cell.latency(N) * jnp.exp(noise * z)

    N, y = jax.vmap(one)(keys, flat, n_max)
    return N.reshape(shape + (n_samples,)), y.reshape(shape + (n_samples,))


def sample_latency(
    service: ServiceModel,
    seed,
    n_samples: int,
    *,
    noise: float = 0.05,
    max_load: float = 3.0,
) -> tuple[Float[Array, "... n_samples"], Float[Array, "... n_samples"]]:
    """Synthetic noisy latency samples from each cell's true model (seed §3.3).

    Per cell $j$ and sample $k$, independently:
    $N_{jk} \\sim U[0,\\ \\kappa\\,\\bar\\mu_j\\,\\ell_j(0)]$ and
    $y_{jk} = \\ell_j(N_{jk})\\,e^{\\sigma z_{jk}}$, $z_{jk} \\sim \\mathcal N(0, 1)$.
    $\\bar\\mu_j\\ell_j(0)$ is the workload at which the queueing asymptote $N/\\bar\\mu_j$
    reaches the zero-load latency (the saturation workload; $\\approx \\bar\\mu_j L_0$ for
    softplus cells, whose knee lies below it, and 1 for M/M/1 cells). The noise is
    lognormal: $\\log y$ is Gaussian around $\\log\\ell(N)$ with standard deviation
    $\\sigma$, so $\\ell(N)$ is the median of $y$ and its mean is $e^{\\sigma^2/2}\\ell(N)$
    (theory/estimation.md, *Samples*).

    **Arguments:**
    - `service`: the true `ServiceModel` (any shape of cells, e.g. `(n,)`).
    - `seed`: an int or a `jax.random` key.
    - `n_samples`: samples per cell (>= 4, the number of softplus parameters).
    - `noise`: $\\sigma \\ge 0$, the standard deviation of $\\log y$ (0.05 = about 5%).
    - `max_load`: $\\kappa > 0$, the workload range in units of the saturation workload.

    **Returns:** `(N, latency)`, each of shape `service.capacity.shape + (n_samples,)`.

    **Raises:** `ValueError` naming the argument, its value and what is allowed.
    """
    if not isinstance(service, ServiceModel):
        raise ValueError(f"service = {type(service).__name__} is invalid: expected a ServiceModel")
    key = _key(seed)
    n_samples = integer("n_samples", n_samples, _N_PARAMS)
    noise = _check_number("noise", noise, lo=0.0)
    max_load = _check_number("max_load", max_load, lo=0.0, lo_open=True)
    return _sample(service, key, n_samples, jnp.asarray(noise), jnp.asarray(max_load))


# --- 2. fitting --------------------------------------------------------------------


class FitInfo(eqx.Module):
    """Per-cell diagnostics of `fit_latency_model` (arrays of the cells' shape).

    **Fields:**
    - `loss`: final mean squared log-residual, $\\frac1K\\sum_k(\\log\\ell(N_k)-\\log y_k)^2$.
    - `rmse`: its square root, about the relative error of one sample.
    - `grad_norm`: $\\|\\nabla\\|_\\infty$ of the normalised loss in the raw coordinates.
    - `steps`: optimiser steps taken (Adam steps plus L-BFGS steps).
    - `status`: a `RESULTS` code: `success` (converged: `grad_norm <= gtol`),
      `not_converged` (step budget spent), `nonfinite` (the data or the loss produced
      NaN/inf).
    """

    loss: Float[Array, "..."]
    rmse: Float[Array, "..."]
    grad_norm: Float[Array, "..."]
    steps: Int[Array, "..."]
    status: Int[Array, "..."]

    def status_names(self) -> np.ndarray:
        """Per-cell status names (`RESULTS`: `"success"`, `"not_converged"`, `"nonfinite"`)."""
        return status_names(self.status)


def _normalise(N, y):
    # Fit in units where the workload range and the typical latency are 1, so that the
    # four parameters are O(1) and one learning rate and one gtol suit every cell.
    n_scale = jnp.max(N)
    y_scale = jnp.exp(jnp.mean(jnp.log(y)))
    return N / n_scale, y / y_scale, n_scale, y_scale


def _unit_theta(theta, n_scale, y_scale):
    """$\\theta = (a_0, \\beta, N_0, s)$ `(..., 4)` in the fit's normalised units (workloads
    over `n_scale`, latencies over `y_scale`; `_natural_theta` is the inverse)."""
    a0, beta, knee, width = (theta[..., i] for i in range(_N_PARAMS))
    return jnp.stack([a0 / y_scale, beta * n_scale / y_scale, knee / n_scale, width / n_scale], -1)


def _natural_theta(th, n_scale, y_scale):
    """`(a0, beta, knee, width)` back in natural units from normalised `th` `(..., 4)`."""
    return (
        th[..., 0] * y_scale,
        th[..., 1] * y_scale / n_scale,
        th[..., 2] * n_scale,
        th[..., 3] * n_scale,
    )


def _initial_theta(n, y, weight=None):
    """Data-driven start (normalised units): flat level from the lowest workloads, linear
    asymptote from a line through the highest ones, knee where the two meet. `weight`:
    samples per point (binned samples, ordered by workload; quantiles by weight)."""
    if weight is None:
        lo = n <= jnp.quantile(n, _LO_QUANTILE)
        hi = n >= jnp.quantile(n, _HI_QUANTILE)
    else:
        total = jnp.maximum(jnp.sum(weight), 1e-300)
        cum = jnp.cumsum(weight)
        has = weight > 0
        first = jnp.arange(n.shape[0]) == jnp.argmax(has)
        lo = has & ((cum <= _LO_QUANTILE * total) | first)
        hi = has & (cum - weight >= _HI_QUANTILE * total)
        hi = jnp.where(jnp.any(hi), hi, has & (cum >= total))  # (else the last point)
        lo, hi = lo * weight, hi * weight
    L0 = jnp.exp(
        jnp.sum(jnp.where(lo > 0, lo * jnp.log(y), 0.0)) / jnp.maximum(jnp.sum(lo), 1e-300)
    )
    w = hi / jnp.maximum(jnp.sum(hi), 1e-300)
    nm, ym = jnp.sum(w * n), jnp.sum(w * y)
    var = jnp.sum(w * (n - nm) ** 2)
    slope = jnp.sum(w * (n - nm) * (y - ym)) / jnp.maximum(var, 1e-30)
    beta = jnp.maximum(slope, 1e-2 * L0)
    a0 = jnp.clip(ym - beta * nm, 0.05 * L0, 0.95 * L0)
    knee = jnp.clip((L0 - a0) / beta, 1e-3, 1.0)
    width = 0.05 + 0.1 * knee
    return jnp.stack([a0, beta, knee, width])


def _fit_one(n, y, r_init, use_init, steps, polish_steps, learning_rate, gtol):
    logy = jnp.log(y)

    def loss_fn(r):
        th = _theta_from_raw(r)
        return jnp.mean((jnp.log(_latency_theta(th, n)) - logy) ** 2)

    r0 = jnp.where(use_init, r_init, _raw_from_theta(_initial_theta(n, y)))
    value_and_grad = jax.value_and_grad(loss_fn)

    # Stage 1: Adam for `steps` steps, keeping the best iterate (the loss is non-convex in
    # theta and Adam's last step need not be its best). The step counts are traced values
    # (fori_loop lowers to a while_loop), so changing them does not recompile.
    adam = optax.adam(learning_rate)

    def adam_step(_, carry):
        r, state, best_r, best_f = carry
        f, g = value_and_grad(r)
        better = jnp.isfinite(f) & (f < best_f)
        best_r = jnp.where(better, r, best_r)
        best_f = jnp.where(better, f, best_f)
        upd, state = adam.update(g, state, r)
        return optax.apply_updates(r, upd), state, best_r, best_f

    carry = (r0, adam.init(r0), r0, jnp.asarray(jnp.inf, r0.dtype))
    r, _, best_r, best_f = jax.lax.fori_loop(0, steps, adam_step, carry)
    f_last = loss_fn(r)
    r = jnp.where(jnp.isfinite(f_last) & (f_last < best_f), r, best_r)

    # Stage 2: L-BFGS with a zoom line search until the gradient is below gtol, the step
    # budget is spent, or a non-finite value appears (then the last finite iterate stays).
    lbfgs = optax.lbfgs()
    vg_state = optax.value_and_grad_from_state(loss_fn)

    def cond(c):
        _, _, f, g, k, stop = c
        # Polish past the convergence test (to gtol/100) while steps still lower the loss:
        # on noise-free data this buys several digits at no risk.
        return (k < polish_steps) & (jnp.max(jnp.abs(g)) > _POLISH_FACTOR * gtol) & ~stop

    def body(c):
        r, state, f, g, k, _ = c
        upd, state2 = lbfgs.update(g, state, r, value=f, grad=g, value_fn=loss_fn)
        r2 = optax.apply_updates(r, upd)
        f2, g2 = vg_state(r2, state=state2)
        bad = ~(jnp.isfinite(f2) & jnp.all(jnp.isfinite(g2)) & jnp.all(jnp.isfinite(r2)))
        # A step that no longer lowers the loss (line search exhausted, or a parameter
        # drifting to a boundary of the parametrisation) ends the polish; the status then
        # still reports whether the gradient test passed.
        stalled = ~(f - f2 > _FTOL * jnp.abs(f))
        keep = lambda new, old: jnp.where(bad, old, new)  # noqa: E731
        return (
            keep(r2, r),
            jax.tree.map(keep, state2, state),
            keep(f2, f),
            keep(g2, g),
            k + 1,
            bad | stalled,
        )

    f, g = value_and_grad(r)
    init = (r, lbfgs.init(r), f, g, jnp.asarray(0, jnp.int32), ~jnp.isfinite(f))
    r, _, f, g, k, _ = jax.lax.while_loop(cond, body, init)
    gnorm = jnp.max(jnp.abs(g))
    finite = jnp.isfinite(f) & jnp.isfinite(gnorm) & jnp.all(jnp.isfinite(r))
    status = jnp.where(
        ~finite,
        RESULTS.nonfinite,
        jnp.where(gnorm <= gtol, RESULTS.success, RESULTS.not_converged),
    )
    return _theta_from_raw(r), f, gnorm, steps + k, status


@eqx.filter_jit
def _fit_batch(N, y, r_init, use_init, steps, polish_steps, learning_rate, gtol):
    n, ys, n_scale, y_scale = jax.vmap(_normalise)(N, y)
    th, f, gnorm, k, status = jax.vmap(
        lambda a, b, c: _fit_one(a, b, c, use_init, steps, polish_steps, learning_rate, gtol)
    )(n, ys, r_init)
    return _natural_theta(th, n_scale, y_scale), f, gnorm, k, status


def fit_latency_model(
    N: Float[Array, "... n_samples"],
    latency: Float[Array, "... n_samples"],
    *,
    steps: int = 300,
    polish_steps: int = 300,
    learning_rate: float = 0.05,
    gtol: float = 1e-8,
    init: ServiceModel | None = None,
) -> tuple[ServiceModel, FitInfo]:
    """Fit the softplus latency model to (workload, latency) samples, one fit per cell.

    Minimises, per cell, the mean squared log-residual
    $$\\mathcal L(\\theta) = \\frac1K\\sum_{k=1}^K\\big(\\log\\ell(N_k;\\theta) - \\log y_k\\big)^2,
    \\quad \\ell(N;\\theta) = a_0 + \\beta N + \\beta s\\,\\mathrm{sp}\\big((N_0-N)/s\\big),$$
    over $\\theta = (a_0, \\beta, N_0, s) = \\mathrm{sp}(r)$ elementwise, so $a_0, \\beta,
    s > 0$ and $N_0 \\ge 0$ for every raw $r \\in \\mathbb R^4$ (hence $a_0 > 0$ and
    $L_0 = a_0 + \\beta N_0 > 0$: every fit is a valid scenario service). Log residuals make
    the least-squares fit the maximum-likelihood fit under the multiplicative noise of
    `sample_latency` and weight the flat low-load region like the steep queueing region.
    Data are scaled per cell to a unit workload range and unit geometric-mean latency;
    `steps` Adam steps (in a `lax.fori_loop`) then at most `polish_steps` L-BFGS steps with a zoom
    line search (in a `lax.while_loop`), all under one `vmap` over cells (seed §3.3,
    theory/estimation.md).

    **Arguments:**
    - `N`, `latency`: samples of shape `(..., K)` (leading axes are cells), $N \\ge 0$ with
      $\\max_k N_k > 0$ per cell, latency $> 0$, all finite, $K \\ge 4$.
    - `steps`, `learning_rate`: Adam steps (>= 0) and step size (normalised units).
    - `polish_steps`: maximum L-BFGS steps (>= 0).
    - `gtol`: convergence threshold on $\\|\\nabla_r\\mathcal L\\|_\\infty$ (normalised units).
    - `init`: optional softplus `ServiceModel` of the cells' shape to start from (e.g. the
      previous fit); default: a data-driven start (flat level of the lowest workloads,
      line through the highest, knee where they meet).

    **Returns:** `(service, info)`: a softplus `ServiceModel` of the cells' shape, and a
    `FitInfo` (loss, rmse, gradient norm, steps, status per cell; a non-finite fit is
    flagged `nonfinite`, never returned silently).

    **Raises:** `ValueError` naming the argument, the value and what is allowed.
    """
    steps = integer("steps", steps, 0)
    polish_steps = integer("polish_steps", polish_steps, 0)
    learning_rate = _check_number("learning_rate", learning_rate, lo=0.0, lo_open=True)
    gtol = _check_number("gtol", gtol, lo=0.0)
    N = jnp.asarray(N, dtype=jnp.result_type(float))
    y = jnp.asarray(latency, dtype=jnp.result_type(float))
    if N.shape != y.shape or N.ndim < 2:
        raise ValueError(
            f"N, latency shapes = {N.shape}, {y.shape} are invalid: expected equal shapes "
            "(..., n_samples) with at least one cell axis"
        )
    K = N.shape[-1]
    if K < _N_PARAMS:
        raise ValueError(f"n_samples = {K} is invalid: expected >= {_N_PARAMS} samples per cell")
    _check_samples(N, y)
    cells = N.shape[:-1]
    Nf, yf = N.reshape(-1, K), y.reshape(-1, K)
    if init is None:
        r_init = jnp.zeros((Nf.shape[0], _N_PARAMS), Nf.dtype)
    else:
        r_init = _raw_init(init, cells, Nf, yf)
    # Every option travels as an array: one compilation per data shape.
    theta, f, gnorm, k, status = _fit_batch(
        Nf,
        yf,
        r_init,
        jnp.asarray(init is not None),
        jnp.asarray(steps, jnp.int32),
        jnp.asarray(polish_steps, jnp.int32),
        jnp.asarray(learning_rate),
        jnp.asarray(gtol),
    )
    service = service_from_theta(*(v.reshape(cells) for v in theta))
    info = FitInfo(
        loss=f.reshape(cells),
        rmse=jnp.sqrt(f).reshape(cells),
        grad_norm=gnorm.reshape(cells),
        steps=k.reshape(cells),
        status=status.reshape(cells),
    )
    return service, info


def _levenberg_marquardt(n, logy, w, r0, iters):
    """Levenberg-Marquardt on the weighted log residuals $\\sqrt{w_b}(\\log\\ell(n_b;
    \\mathrm{sp}(r)) - \\log y_b)$ in the raw coordinates $r$ (normalised units): `iters`
    steps $(J^TJ + \\lambda\\,\\mathrm{diag}(J^TJ))\\delta = -J^Tr$, a step kept only if it
    lowers the loss ($\\lambda/3$, else $2\\lambda$). Returns `(r, loss, gradient norm)`."""
    sw = jnp.sqrt(w)

    def resid(r):
        return sw * (jnp.log(_latency_theta(_theta_from_raw(r), n)) - logy)

    eye = jnp.eye(_N_PARAMS, dtype=r0.dtype)

    def body(_, c):
        r, res, f, lam = c
        J = jax.jacfwd(resid)(r)
        A = J.T @ J
        g = J.T @ res
        step = jnp.linalg.solve(A + lam * (A * eye + 1e-12 * eye), -g)
        r2 = r + step
        res2 = resid(r2)
        f2 = jnp.sum(res2 * res2)
        ok = jnp.isfinite(f2) & jnp.all(jnp.isfinite(r2)) & (f2 < f)
        keep = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
        return keep(r2, r), keep(res2, res), keep(f2, f), jnp.where(ok, lam / 3.0, 2.0 * lam)

    res0 = resid(r0)
    init = (r0, res0, jnp.sum(res0 * res0), jnp.asarray(1e-3, r0.dtype))
    r, res, f, _ = jax.lax.fori_loop(0, iters, body, init)
    g = jax.jacfwd(resid)(r).T @ res
    return r, f, 2.0 * jnp.max(jnp.abs(g))


_THETA_LO = (1e-6, 1e-6, 0.0, 1e-3)  # (a0, beta, knee, width), normalised units
_THETA_HI = (1e6, 1e6, 1e3, 1e3)


def fit_binned(N, logy, weight, theta0, steps, gtol=1e-8):
    """One cell's softplus fit to binned samples (traceable; the online estimation's refit,
    `dlbfluid._requests.estimation`).

    Minimises $\\sum_b w_b(\\log\\ell(\\bar N_b;\\theta) - \\bar y_b)^2/\\sum_b w_b$: bin $b$
    holds $w_b$ samples of mean workload $\\bar N_b$ and mean log-latency $\\bar y_b$. Up to a
    constant (the spread of $\\log y$ inside each bin) this is `fit_latency_model`'s loss
    with each sample's workload moved to its bin's mean, which changes $\\log\\ell$ by a
    second-order term in the bin's width (theory/estimation.md, *Binned samples*). The
    data are normalised as `fit_latency_model`'s. Two starts of `steps` Levenberg-Marquardt
    steps each (`_levenberg_marquardt`), the lower loss kept: from $\\theta_0 = (a_0,
    \\beta, N_0, s)$ (the last fit), and from `fit_latency_model`'s data-driven start
    (quantiles by weight). The loss is not convex, and a start far from the data (a cell
    that has slowed) can end on the boundary $a_0 \\to 0$ of the parametrisation.

    **Returns:** `(theta, loss, status)`: $\\theta$ `(4,)` in natural units, the loss and
    a `FIT_STATUS` code (`success` when the gradient's norm is at most `gtol` in
    normalised units, `not_converged` otherwise, `nonfinite` where no bin holds a sample or
    the fit is not finite).
    """
    wsum = jnp.sum(weight)
    wn = weight / jnp.where(wsum > 0, wsum, 1.0)
    has = weight > 0
    n_max = jnp.max(jnp.where(has, N, 0.0))
    n_scale = jnp.where(n_max > 0, n_max, 1.0)
    log_scale = jnp.sum(wn * jnp.where(has, logy, 0.0))
    ly = jnp.where(has, logy - log_scale, 0.0)
    y_scale = jnp.exp(log_scale)
    n = N / n_scale
    th_n = _unit_theta(theta0, n_scale, y_scale)
    starts = jnp.stack([_raw_from_theta(th_n), _raw_from_theta(_initial_theta(n, jnp.exp(ly), wn))])
    r, f, g = jax.vmap(lambda r0: _levenberg_marquardt(n, ly, wn, r0, steps))(starts)
    best = jnp.argmin(jnp.where(jnp.isfinite(f), f, jnp.inf))
    # Keep the fit inside the range the data can speak for (normalised units: workloads and
    # latencies of order 1): a width or a level driven to 0 or a knee far past the data
    # makes the softplus overflow (an infinite latency at low load, which routes every
    # request to the first cell whatever the routers' allowed arcs).
    th = jnp.clip(_theta_from_raw(r[best]), jnp.array(_THETA_LO), jnp.array(_THETA_HI))
    f, g = f[best], g[best]
    theta = jnp.stack(_natural_theta(th, n_scale, y_scale))
    lat = _latency_theta(th, n)
    finite = (
        jnp.isfinite(f)
        & jnp.all(jnp.isfinite(theta))
        & (wsum > 0)
        & jnp.all(jnp.where(has, jnp.isfinite(lat) & (lat > 0), True))
    )
    status = jnp.where(
        ~finite, RESULTS.nonfinite, jnp.where(g <= gtol, RESULTS.success, RESULTS.not_converged)
    )
    return theta, f, status


# --- 3. estimation-noise injection -------------------------------------------------


@eqx.filter_jit
def _perturb(service, key, eps):
    xi = jr.uniform(
        key, service.capacity.shape, minval=-1.0, maxval=1.0, dtype=service.capacity.dtype
    )
    return service.perturb(1.0 + eps * xi), xi


def perturb_service(service: ServiceModel, eps: float, seed, *, return_xi: bool = False):
    """Inject the seed's estimation noise (seed §5.4): $\\theta_j \\to (1+\\epsilon\\xi_j)\\theta_j$.

    One $\\xi_j \\sim U[-1, 1]$ per cell scales the cell's whole parameter vector. Softplus
    cells use $\\theta = (a_0, \\beta, N_0, s)$ with $a_0 = L_0 - N_0/\\bar\\mu$,
    $\\beta = 1/\\bar\\mu$, so for $\\epsilon < 1$ the factor $c_j = 1 + \\epsilon\\xi_j > 0$
    keeps $a_0, \\beta, s > 0$ and the sign of $N_0$: the perturbed model still satisfies
    Assumptions 1 and 3 (theory/estimation.md, *Noise injection*). The result has
    $\\bar\\mu' = \\bar\\mu/c$, $N_0' = cN_0$, $s' = cs$, $L_0' = c a_0 + c^2\\beta N_0$.
    M/M/1 cells, whose one parameter is the capacity, get $\\bar\\mu' = c\\,\\bar\\mu$.

    **Arguments:**
    - `service`: the estimated (or true) `ServiceModel`, any shape of cells.
    - `eps`: $\\epsilon \\in [0, 1)$; 0 returns the parameters unchanged.
    - `seed`: an int or a `jax.random` key.
    - `return_xi`: also return the draws $\\xi$ (the cells' shape).

    **Returns:** the perturbed `ServiceModel` (and $\\xi$ if `return_xi`). Use it as a
    scenario's `estimate` to route on wrong models.

    **Raises:** `ValueError` if `eps` is not a finite number in $[0, 1)$, or `seed` is not
    an int or a key.
    """
    if not isinstance(service, ServiceModel):
        raise ValueError(f"service = {type(service).__name__} is invalid: expected a ServiceModel")
    eps = _check_number("eps", eps, lo=0.0, hi=1.0)
    out, xi = _perturb(service, _key(seed), jnp.asarray(eps))
    return (out, xi) if return_xi else out


def _check_samples(N, y) -> None:
    """`ValueError` unless the (concrete) samples are finite, the workloads >= 0 with a
    positive one per cell, and the latencies > 0 (traced samples are not checked)."""
    if not _is_concrete(N, y):
        return
    Nn, yn = np.asarray(N), np.asarray(y)
    if not (np.all(np.isfinite(Nn)) and np.all(Nn >= 0)):
        idx = np.argwhere(~(np.isfinite(Nn) & (Nn >= 0)))[0]
        raise ValueError(
            f"N contains {float(Nn[tuple(idx)])!r} at index {tuple(idx.tolist())}: "
            "expected finite workloads >= 0"
        )
    if not np.all(Nn.max(axis=-1) > 0):
        raise ValueError(
            "N is invalid: a cell has all workloads 0; expected max(N) > 0 per cell "
            "(the knee and slope are not identifiable from one workload)"
        )
    if not (np.all(np.isfinite(yn)) and np.all(yn > 0)):
        idx = np.argwhere(~(np.isfinite(yn) & (yn > 0)))[0]
        raise ValueError(
            f"latency contains {float(yn[tuple(idx)])!r} at index {tuple(idx.tolist())}: "
            "expected finite latencies > 0"
        )


def _raw_init(init, cells: tuple, Nf, yf):
    """The raw parameters `(cells, 4)` of a given start `init` (a softplus `ServiceModel`
    of shape `cells`, checked), in the normalised units of the flattened samples `Nf`,
    `yf` (unit workload range, unit geometric-mean latency)."""
    if not isinstance(init, ServiceModel) or init.capacity.shape != cells:
        raise ValueError(
            f"init = {type(init).__name__} of shape "
            f"{getattr(getattr(init, 'capacity', None), 'shape', None)} is invalid: "
            f"expected a softplus ServiceModel of the cells' shape {cells}"
        )
    if _is_concrete(init.model) and not bool(jnp.all(init.model == code("softplus"))):
        raise ValueError(
            f"init.model = {np.asarray(init.model).tolist()} is invalid: expected softplus "
            f"cells (code {code('softplus')}) only"
        )
    th = jnp.stack([v.reshape(-1) for v in theta_from_service(init)], axis=-1)
    positive = jnp.all(th[:, 0] > 0) & jnp.all(th[:, 1] > 0) & jnp.all(th[:, 3] > 0)
    if _is_concrete(positive) and not bool(positive):
        raise ValueError(
            "init is invalid: expected a0 = base_latency - knee/capacity > 0, capacity > 0 "
            "and width > 0 in every cell"
        )
    n_scale = jnp.max(Nf, axis=-1)
    y_scale = jnp.exp(jnp.mean(jnp.log(yf), axis=-1))
    th = th.at[:, 2].set(jnp.maximum(th[:, 2], 0.0))
    return _raw_from_theta(_unit_theta(th, n_scale, y_scale))
