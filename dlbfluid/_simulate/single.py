"""One scenario as a simulator object: `init`, `step` and `record`, in the spirit of
diffrax's `AbstractSolver.init/step` and jax-md's `init_fn/step_fn`.

`simulator(scenario, policy, ...)` checks the options and precomputes, host side, what
the loop of one scenario needs (the ring length, the arrival window's width, the
integrator for this tick, the tick set-up, the policy's precomputed arrays); the
`Simulator` it returns is a Module whose three methods are pure and jittable:

$$s_0 = \\mathrm{init}(),\\qquad s_{k+1} = \\mathrm{step}(s_k, k),\\qquad
\\mathrm{record}(s_k, k) = (t_k, N(t_k), x^k, \\text{totals}, \\text{in flight}),$$

$s_k$ the `SimState` at $t_k = kh$ (the model: `loop.py`, theory/discretisation.md).
`simulate` runs these same methods, vmapped over a batch (`strategy.py`), so a user's own
`lax.scan` over `step` gives `simulate`'s saved trajectory.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._integrators import AbstractIntegrator, Fast
from .._policies import AbstractPolicy, ErrorAverse, TickSetup, policy_from_name
from .._policies.aversion import ErrorAversion
from .._precision import float_dtype
from .._runtime.eager import to_device
from .._scenario import Scenario
from .loop import SavePoint, SimState, _hist_len, _init_state, _record, _setup, _tick
from .window import _window_width

__all__ = ["Simulator", "simulator"]


class Simulator(eqx.Module):
    """The delayed fluid model of one scenario under one policy, one tick at a time.

    **Fields:** `scenario` (metadata stripped, floats in the run's dtype), `setup` (the
    `TickSetup`: delays split into whole ticks and remainders, $\\eta h$, the ring length),
    `aux` (the policy's precomputed arrays, `AbstractPolicy.prepare`), `policy` (wrapped in
    `ErrorAverse` when asked), `integrator` (prepared for this tick and dtype), `width`
    (static: arrival breakpoints a tick reads, `window._window_width`).

    Build it with `dlbfluid.simulator`. Every method is pure: jit, vmap or scan it.
    """

    scenario: Scenario
    setup: TickSetup
    aux: object
    policy: AbstractPolicy
    integrator: AbstractIntegrator
    width: int = eqx.field(static=True)

    def init(self) -> SimState:
        """The `SimState` at $t = 0$: $N(0)$, the policy's initial routing $x^0$, histories
        constant before $t = 0$."""
        return _init_state(
            self.scenario, self.setup, self.aux, policy=self.policy, width=self.width
        )

    def step(self, state: SimState, k) -> SimState:
        """The state at $t_{k+1}$ from that at $t_k$: integrate the tick, then let the
        routers update from their delayed observations. `k` is the tick index (an integer
        scalar, traced or not); a failed scenario keeps its last good state and its
        status."""
        return self._step(state, k)

    def _step(self, state: SimState, k, slot: bool = False) -> SimState:
        return _tick(
            self.scenario,
            self.setup,
            state,
            jnp.asarray(k),
            self.aux,
            policy=self.policy,
            integrator=self.integrator,
            window=self.width,
            slot=slot,
        )

    def record(self, state: SimState, k) -> SavePoint:
        """What a save keeps of the state at $t_k$ (`SavePoint`), the mass in flight on the
        network included."""
        return _record(self.scenario, self.setup, state, jnp.asarray(k))


def check_options(scenario, policy, integrator, error_aversion) -> AbstractPolicy:
    """The policy object for `policy` (a name or an `AbstractPolicy`), after the checks that
    `simulate` and `simulator` share.

    **Raises:** `ValueError` naming the argument, its value and what is allowed."""
    pol = policy_from_name(policy) if isinstance(policy, str) else policy
    if not isinstance(pol, AbstractPolicy):
        raise ValueError(f"policy = {policy!r} is invalid: expected a policy name or object")
    if not isinstance(integrator, AbstractIntegrator):
        raise ValueError(f"integrator = {integrator!r} is invalid: expected Fast() or Accurate()")
    if error_aversion is not None and not isinstance(error_aversion, ErrorAversion):
        raise ValueError(
            f"error_aversion = {error_aversion!r} is invalid: expected an ErrorAversion or None"
        )
    if not integrator.supports_buffers and bool(np.any(np.isfinite(np.asarray(scenario.buffer)))):
        raise ValueError(
            f"integrator = {type(integrator).__name__}() is invalid for a scenario with finite "
            "buffers: the queue-overflow projection is implemented by the Fast integrator only"
        )
    return pol


def looped_policy(pol: AbstractPolicy, error_aversion: ErrorAversion | None) -> AbstractPolicy:
    """The policy the loop runs: `pol`, wrapped in `ErrorAverse` when aversion is asked."""
    return pol if error_aversion is None else ErrorAverse(pol, error_aversion)


def cast(scn: Scenario, dtype) -> Scenario:
    """`scn` with its metadata stripped and every float array in `dtype`."""
    return floats_as(scn.strip(), dtype)


@functools.partial(jax.jit, static_argnames="dtype")
def _converted(leaves: list, dtype) -> list:
    return [a.astype(dtype) for a in leaves]


def floats_as(tree, dtype):
    """`tree` with every floating array leaf in `dtype` and every leaf a JAX array: the
    conversions in one compiled program (none when every float is in `dtype` already),
    host arrays otherwise put on the device as they are (`to_device`: a private copy, so
    that a caller's numpy buffer is never shared). Converted one by one, each leaf
    shape compiled a program of its own."""
    dtype = jnp.dtype(dtype)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    todo = [
        i
        for i, a in enumerate(leaves)
        if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype != dtype
    ]
    out = [a if isinstance(a, jax.Array) else to_device(a) for a in leaves]
    if todo:
        for i, a in zip(todo, _converted([leaves[i] for i in todo], dtype=dtype)):
            out[i] = a
    return jax.tree_util.tree_unflatten(treedef, out)


@eqx.filter_jit
def _set_up(scn: Scenario, eta, h, policy: AbstractPolicy, horizon: float, hist: int):
    """`simulator`'s `TickSetup` (step sizes `eta`, a scalar or `(n,)`, in the dtype of the
    tick `h`) and the policy's precomputed arrays, as one compiled program (as `simulate`
    computes them inside its own); operation by operation they compiled a few dozen."""
    eta = jnp.broadcast_to(jnp.asarray(eta, h.dtype), (scn.n_cells,))
    return _setup(scn, eta, h, hist), policy.prepare(scn, h, horizon)


def simulator(
    scenario: Scenario,
    policy: str | AbstractPolicy,
    *,
    step_size=1.0,
    tick: float = 0.05,
    horizon: float | None = None,
    integrator: AbstractIntegrator = Fast(),
    dtype=None,
    error_aversion: ErrorAversion | None = None,
) -> Simulator:
    """The single-scenario simulator under `simulate`: `init()`, `step(state, k)` and
    `record(state, k)` for a loop of your own.

    **Arguments** (as in `simulate`, for one scenario):
    - `scenario`: an unbatched `Scenario`.
    - `policy`: a registered policy name or an `AbstractPolicy`.
    - `step_size`: $\\eta$, a scalar or `(n,)` per router.
    - `tick`: the probe period $h > 0$, a scalar.
    - `horizon`: $T$, needed only by a policy that precomputes a schedule over the horizon
      (`AbstractPolicy.uses_horizon`); `None` otherwise.
    - `integrator`, `dtype`, `error_aversion`: as in `simulate`.

    **Returns:** a `Simulator`. `step(state, k)` advances from $t_k = kh$ to $t_{k+1}$;
    a `lax.scan` of it over $k = 0, \\ldots, K-1$, recording after each step, reproduces
    `simulate(..., horizon=K h, n_save=K)`.

    **Raises:** `ValueError` for a batched scenario or an invalid option.
    """
    pol = check_options(scenario, policy, integrator, error_aversion)
    if scenario.batch_shape:
        raise ValueError(
            f"scenario batch shape {scenario.batch_shape} is invalid: simulator takes one "
            "scenario (vmap its methods, or call simulate, for a batch)"
        )
    dtype = float_dtype(dtype, "simulator")
    n = scenario.n_cells
    h = float(tick)
    if not np.isfinite(h) or h <= 0:
        raise ValueError(f"tick = {tick!r} is invalid: expected a finite number > 0")
    eta = np.asarray(step_size, dtype=float)
    if eta.ndim > 1 or (eta.ndim == 1 and eta.shape[0] not in (1, n)):
        raise ValueError(f"step_size has shape {eta.shape}: expected a scalar or (n,) = ({n},)")
    if not np.all(np.isfinite(eta)) or np.any(eta < 0):
        raise ValueError(f"step_size = {step_size!r} is invalid: expected finite values >= 0")
    looped = looped_policy(pol, error_aversion)
    if looped.uses_horizon and horizon is None:
        raise ValueError(
            f"horizon = None is invalid for policy {pol.name!r}, which precomputes a "
            "schedule over the horizon: give the horizon T"
        )
    scn = cast(scenario, dtype)
    tau = np.where(np.asarray(scn.allowed), np.asarray(scn.latency), 0.0)
    hist = _hist_len(float(tau.max() / h))
    width = _window_width(
        np.asarray(scn.arrival_times), float(tau.max() + 2.0 * h), np.asarray(scn.arrival_rates)
    )
    hh = to_device(np.asarray(h, dtype))
    # (without a horizon the policy's `prepare` is the base one, which ignores it)
    setup, aux = _set_up(scn, eta, hh, looped, 0.0 if horizon is None else float(horizon), hist)
    integ = integrator.for_batch(scn, h).prepared(dtype)
    return Simulator(scn, setup, aux, looped, integ, width)
