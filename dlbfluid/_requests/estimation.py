"""Online estimation of the cells' latency models inside the twin (seed §3.3, §6;
theory/estimation.md, *Estimation in the loop*).

In `oracle` mode (the default) the routers price cells with the scenario's `estimate`,
fixed for the run. In `online` mode every cell's leaf refits a softplus latency model
every `refit_period` seconds from the requests that *completed* in the last `window`
seconds, and the routers' latency and gradient costs use the last fit published:

* **Samples.** A request admitted to cell $j$ at $t$ when the cell held $N$ requests
  gives the sample $(N/(kc_j),\\ c - t)$: the workload in the fluid's units at the
  replica fraction $c_j$ of the tick, and its sojourn (the cell's part of the latency,
  which the latency cost prices as $\\ell_j(N)$). In FIFO cells the completion $c$ is fixed
  at admission, so the sample is known then; it enters the window at $c$, not at $t$.
  That is the censoring of the seed: at a refit the requests still in flight, the long
  ones most, are missing from the window.
* **The window as bins.** A sample is added, at admission, to the ring slot of the refit
  period its completion falls in, and to one of `bins` equal workload bins per cell
  (count, sum of $N$, sum of $\\log y$), equal in $u = \\log(1 + N/N_r)$ so that their
  width is about $N_r$ at low load and a fixed fraction of $N$ above. The refit at
  $t_m = mP$ sums the slots of the periods $m - W/P, \\dots, m - 1$ (completions in $[t_m - W, t_m)$, exactly), fits on
  the bins (`fit_binned`) and clears the slot that leaves the window. The ring holds
  $2W/P + 1$ periods, so a completion up to about $W$ after its admission is kept; a later
  one is counted in `late` and dropped (a request that outlives the window is censored
  anyway until it completes).
* **Refit.** Levenberg-Marquardt from the last accepted fit and from a data-driven start,
  the better kept (`fit_binned`). A fit is accepted when the window holds at least `min_samples` samples and the fit is finite;
  otherwise the cell keeps its last model, whose `age` grows (starvation: a cell deemed
  slow receives no traffic, hence no samples).
* **Mitigations** (each off at 0): `probing` $p$: every $p$ seconds each cell is probed
  by a request that measures what a real one would see (the same leaf rule and token
  draws) without loading the cell (a simplification: a real probe a second would add up to
  5% to an App.-B cell at scale 1, whose least-loaded cells receive 20-35 requests a
  second, and less at larger scales);
  `shrinkage` $n_0$: the published
  parameters are $w\\theta_{\\text{fit}} + (1 - w)\\theta_0$ with $w = n/(n + n_0)$, $n$ the
  window's samples and $\\theta_0$ the prior (the model the run starts from); `dithering`
  $\\sigma$: the published latency is multiplied by $e^{\\sigma\\xi}$, $\\xi\\sim N(0, 1)$ per
  cell and refit ($a_0$ and $\\beta$ scaled).

The routers see the published model at once (its publication delay, $\\tau_{ij} \\le
0.1$ s, is below 2% of the default refit period) and do not see the scenario's service
schedule: the fit is all they know of a slowdown.
"""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Float, Int

from .._results import RESULTS
from .._service.estimation import fit_binned, service_from_theta, theta_from_service
from .._validate import check_estimation, integer


class OnlineEstimation(eqx.Module):
    """The configuration of online estimation (module docstring; static, hashable).

    **Fields:**
    - `refit_period` $P$ (s, default 5) and `window` $W$ (s, default 60, a whole number of
      periods): a refit every $P$ over the completions of the last $W$.
    - `bins` (default 64): workload bins per cell, equal in $u = \\log(1 + N/N_r)$ on
      $[0, \\log(1 + 256)]$ with $N_r = N^{sat}_j/16$, $N^{sat}_j = \\bar\\mu_j\\ell_j(0)$ of
      the prior: they span $[0, 16N^{sat}_j]$ (the last bin also takes the workloads
      above), about $N^{sat}_j/180$ wide at low load and 9% of $N$ at high load.
    - `min_samples` (default 32): the fewest samples a refit accepts.
    - `steps` (default 50): Levenberg-Marquardt steps of each of a refit's two starts.
    - `probing` (s, default 0: off): the background probes' period per cell.
    - `shrinkage` (samples, default 0: off): the prior's weight $n_0$.
    - `dithering` (default 0: off): $\\sigma$ of the published latency's log-normal noise.
    """

    refit_period: float = 5.0
    window: float = 60.0
    bins: int = 64
    min_samples: int = 32
    steps: int = 50
    probing: float = 0.0
    shrinkage: float = 0.0
    dithering: float = 0.0

    def __check_init__(self):
        check_estimation(
            self.refit_period, self.window, self.probing, self.shrinkage, self.dithering
        )
        integer("bins", self.bins, 2)
        integer("min_samples", self.min_samples, 1)
        integer("steps", self.steps, 1)

    @property
    def lag(self) -> int:
        """$W/P$: the refit periods a window spans."""
        return int(round(self.window / self.refit_period))

    @property
    def slots(self) -> int:
        """$R = 2W/P + 1$: the ring's periods."""
        return 2 * self.lag + 1

    def describe(self) -> dict:
        """The configuration as JSON (the `estimation` object of `simulate --json`)."""
        return {
            "mode": "online",
            "refit_period": self.refit_period,
            "window": self.window,
            "bins": self.bins,
            "min_samples": self.min_samples,
            "mitigations": {
                "background-probing": {"period": self.probing} if self.probing > 0 else None,
                "shrinkage": {"prior_samples": self.shrinkage} if self.shrinkage > 0 else None,
                "dithering": {"sigma": self.dithering} if self.dithering > 0 else None,
            },
        }


_SPAN = 256.0  # the bins reach N_r * _SPAN


class EstLane(eqx.Module):
    """What online estimation reads per scenario: `prior` `(n, 4)` $\\theta_0$ per cell,
    `ref` `(n,)` its bins' scale $N_r$ (workload units)."""

    prior: Float[Array, "n 4"]
    ref: Float[Array, " n"]


def _du(cfg: OnlineEstimation) -> float:
    return math.log1p(_SPAN) / cfg.bins


def est_lane(cfg: OnlineEstimation, estimate) -> EstLane:
    """The prior $\\theta_0$ (the scenario's `estimate` in fit coordinates) and the bins."""
    theta = jnp.stack(theta_from_service(estimate.with_laws(("softplus",))), axis=-1)
    sat = estimate.capacity * estimate.latency(jnp.zeros_like(estimate.capacity))
    return EstLane(prior=theta, ref=sat / 16.0)


class EstState(eqx.Module):
    """A lane's online estimation.

    **Fields:** `sums` `(R, n, bins, 3)` per ring slot, cell and bin: samples, sum of $N$,
    sum of $\\log y$; `theta` `(n, 4)` the last accepted fit (or the prior);
    `published` `(n, 4)` what the routers use (after shrinkage and dithering); `fitted`
    `(n,)` when `theta` was last accepted (0: the prior); `samples` `(n,)` the samples of
    the last refit's window; `late` `(n,)` samples dropped beyond the ring; `frac` `(n,)`
    the tick's replica fractions; `key` for probes and dithering; `window` `(n, bins, 3)`
    the last refit's bins (what its fits saw).
    """

    sums: Float[Array, "R n B 3"]
    theta: Float[Array, "n 4"]
    published: Float[Array, "n 4"]
    fitted: Float[Array, " n"]
    samples: Int[Array, " n"]
    late: Int[Array, " n"]
    frac: Float[Array, " n"]
    key: Array
    window: Float[Array, "n B 3"]


def init_est(cfg: OnlineEstimation, el: EstLane, key, dtype) -> EstState:
    n = el.prior.shape[0]
    return EstState(
        sums=jnp.zeros((cfg.slots, n, cfg.bins, 3), dtype),
        theta=el.prior.astype(dtype),
        published=el.prior.astype(dtype),
        fitted=jnp.zeros(n, dtype),
        samples=jnp.zeros(n, jnp.int32),
        late=jnp.zeros(n, jnp.int32),
        frac=jnp.ones(n, dtype),
        key=key,
        window=jnp.zeros((n, cfg.bins, 3), dtype),
    )


def record(cfg: OnlineEstimation, el: EstLane, est: EstState, j, count, scale, t, c, ok):
    """Add the sample of a request admitted to cell `j` at `t` (holding `count` requests
    then) that completes at `c`, if `ok` (module docstring)."""
    dtype = est.sums.dtype
    P = cfg.refit_period
    N = count.astype(dtype) / (scale * est.frac[j])
    q = jnp.floor(c / P).astype(jnp.int32)
    m = jnp.floor(t / P).astype(jnp.int32)
    keep = ok & (q <= m - cfg.lag + cfg.slots) & jnp.isfinite(c)
    b = jnp.clip(jnp.floor(jnp.log1p(N / el.ref[j]) / _du(cfg)), 0, cfg.bins - 1)
    b = b.astype(jnp.int32)
    y = jnp.log(jnp.maximum(c - t, jnp.finfo(dtype).tiny))
    slot = jnp.where(keep, q % cfg.slots, cfg.slots)  # past the ring: dropped
    sums = est.sums.at[slot, j, b].add(jnp.stack([jnp.ones((), dtype), N, y]), mode="drop")
    late = est.late.at[j].add((ok & ~keep).astype(jnp.int32))
    return dataclasses.replace(est, sums=sums, late=late)


def refit(cfg: OnlineEstimation, el: EstLane, est: EstState, m) -> EstState:
    """The refit at $t_m = mP$ (module docstring): the window's bins, one warm-started fit
    per cell, acceptance, shrinkage and dithering; the slot leaving the window cleared."""
    dtype = est.sums.dtype
    R, lag = cfg.slots, cfg.lag
    r = jnp.arange(R)
    base = m - lag
    q = base + (r - base) % R  # the period each slot holds now
    inside = (q <= m - 1).astype(dtype)
    w = jnp.tensordot(inside, est.sums, axes=(0, 0))  # (n, B, 3)
    cnt = w[..., 0]
    u = (jnp.arange(cfg.bins, dtype=dtype) + 0.5) * _du(cfg)
    centre = jnp.expm1(u)[None, :] * el.ref[:, None]
    N = jnp.where(cnt > 0, w[..., 1] / jnp.maximum(cnt, 1.0), centre)
    logy = jnp.where(cnt > 0, w[..., 2] / jnp.maximum(cnt, 1.0), 0.0)
    theta, _, status = jax.vmap(lambda a, b_, c, d: fit_binned(a, b_, c, d, cfg.steps))(
        N, logy, cnt, est.theta
    )
    samples = jnp.sum(cnt, axis=-1)
    ok = (
        (samples >= cfg.min_samples)
        & (status != RESULTS.nonfinite)
        & jnp.all(jnp.isfinite(theta) & (theta >= 0), axis=-1)
    )
    t_m = m.astype(dtype) * cfg.refit_period
    theta = jnp.where(ok[:, None], theta, est.theta)
    fitted = jnp.where(ok, t_m, est.fitted)
    pub = theta
    if cfg.shrinkage > 0:
        wt = (samples / (samples + cfg.shrinkage))[:, None]
        pub = wt * pub + (1.0 - wt) * el.prior.astype(dtype)
    key = est.key
    if cfg.dithering > 0:
        key, sub = jr.split(key)
        xi = jr.normal(sub, samples.shape, dtype)
        f = jnp.exp(cfg.dithering * xi)
        pub = pub * jnp.stack([f, f, jnp.ones_like(f), jnp.ones_like(f)], axis=-1)
    sums = est.sums.at[base % R].set(0.0)
    return dataclasses.replace(
        est,
        sums=sums,
        theta=theta,
        published=pub,
        fitted=fitted,
        samples=samples.astype(jnp.int32),
        key=key,
        window=w,
    )


def published_model(est: EstState):
    """The softplus `ServiceModel` the routers use (`published`)."""
    p = est.published
    return service_from_theta(p[:, 0], p[:, 1], p[:, 2], p[:, 3])


class EstimationReport(eqx.Module):
    """What online estimation ends with, per run (`RequestSolution.estimation`): arrays
    with the runs' leading axes.

    **Fields:** `params` `(..., n, 4)` the published $(a_0, \\beta, N_0, s)$ at the
    horizon; `samples` `(..., n)` the last refit's window; `age` `(..., n)` seconds from
    the last accepted fit to the horizon (the horizon itself for a cell never refitted);
    `late` `(..., n)` samples dropped beyond the ring; `window` `(..., n, bins, 3)` the
    last refit's bins: samples, sum of $N$, sum of $\\log y$ per workload bin.
    """

    params: Float[Array, "... n 4"]
    samples: Int[Array, "... n"]
    age: Float[Array, "... n"]
    late: Int[Array, "... n"]
    window: Float[Array, "... n B 3"]

    def cells(self, n: int) -> list[dict]:
        """The JSON of one scenario's trials (arrays `(R, ...)`), its first `n` (real)
        cells: `[{"params", "samples", "age", "late"}]`, `params` in the scenario format's
        words (`capacity`, `base_latency`, `knee`, `width`), each the median over the
        trials; `samples` the median; `age` the largest (the stalest trial); `late` the
        sum."""
        p = np.median(np.asarray(self.params), axis=0)
        model = service_from_theta(p[:, 0], p[:, 1], p[:, 2], p[:, 3])
        samples = np.median(np.asarray(self.samples), axis=0)
        age = np.max(np.asarray(self.age), axis=0)
        late = np.sum(np.asarray(self.late), axis=0)
        return [
            {
                "params": {
                    "capacity": float(model.capacity[j]),
                    "base_latency": float(model.base_latency[j]),
                    "knee": float(model.knee[j]),
                    "width": float(model.width[j]),
                },
                "samples": float(samples[j]),
                "age": float(age[j]),
                "late": int(late[j]),
            }
            for j in range(n)
        ]


def report(est: EstState, horizon) -> EstimationReport:
    return EstimationReport(
        params=est.published,
        samples=est.samples,
        age=horizon - est.fitted,
        late=est.late,
        window=est.window,
    )
