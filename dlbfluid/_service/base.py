"""The service-model family: a law $\\mu_j(N)$ per cell, and the table that holds the cells.

A *service model* (`AbstractServiceModel`) is a law: the formulas of one kind of cell,
written once, as functions of a parameter mapping `p` (each entry an array over cells)
and the workload $N \\ge 0$ (theory/service.md):

| method | formula |
|---|---|
| `latency` | $\\ell(N)$, serving latency (abstract: every law defines it) |
| `rate` | $\\mu(N) = N/\\ell(N)$ |
| `latency_slope` | $\\ell'(N)$ |
| `q` | $q(N) = \\ell(N) - N\\ell'(N)$ |
| `rate_prime` | $\\mu'(N) = q/\\ell^2$ |
| `inv_rate_prime` | $1/\\mu'(N) = \\ell^2/q$ (the gradient cost) |
| `inverse_rate` | $\\mu^{-1}(z)$, $+\\infty$ at and above the capacity |
| `balance` | $h(N, z) = N - z\\ell(N)$ (flow balance $\\mu(N) = z$), $\\partial_N h$, $\\ell$ |
| `latency_potential` | $\\int_0^N \\ell\\,\\mu'\\,dn$ (the latency cost's $p_j$) |
| `rif_potential` | $\\int_0^N n\\,\\mu'\\,dn$ (the RIF cost's $p_j$ times $k_j$) |

The defaults derive everything from `latency` by automatic differentiation and
quadrature; the built-in laws (`MM1`, `Softplus`) override them with closed or
cancellation-free forms. Every law has the parameter `capacity`, $\\bar\\mu = \\sup\\mu$
(Assumption 1).

`ServiceModel` is the per-cell table a `Scenario` carries: a law code per cell (its index
in the registry, `dlbfluid._registry.SERVICE_MODELS`), the parameters of every law
present (cells of one law carry the other laws' parameters at benign defaults, so both
branches of a selection are finite), and, static, the names of the laws present, so that
only those are evaluated.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .._errors import ScenarioError
from .._registry import SERVICE_MODELS
from .._runtime.eager import eager_jit, to_device
from .._shapes import lead, like
from .._validate import number as _number

Params = Mapping[str, Array]

# Gauss-Legendre rule of the generic potentials: 64 nodes on [0, N].
_GL64_X, _GL64_W = np.polynomial.legendre.leggauss(64)


class AbstractServiceModel(eqx.Module):
    """A service-model law. Concrete laws are final, hold no arrays, and declare:

    - `name`: the word used in scenario files (`{"model": name, ...}`);
    - `parameters`: its parameter names, `"capacity"` ($\\bar\\mu$) among them;
    - `defaults`: a benign value of every parameter (used for padded cells and for cells
      of other laws in a mixed table: the law must be finite there).

    Only `latency` is abstract. Override `parse` to validate parameters beyond "a finite
    number > 0", and any formula for which a closed or cancellation-free form exists.
    """

    name: ClassVar[str]
    parameters: ClassVar[tuple[str, ...]]
    defaults: ClassVar[dict[str, float]]

    @abc.abstractmethod
    def latency(self, p: Params, N):
        """$\\ell(N)$ for $N \\ge 0$ (seconds)."""

    def rate(self, p: Params, N):
        """$\\mu(N) = N/\\ell(N)$."""
        return N / self.latency(p, N)

    def latency_slope(self, p: Params, N):
        """$\\ell'(N)$ (default: forward-mode derivative of `latency`)."""
        return jax.jvp(lambda n: self.latency(p, n), (N,), (jnp.ones_like(N),))[1]

    def q(self, p: Params, N):
        """$q(N) = \\ell(N) - N\\ell'(N) > 0$ (so that $\\mu' = q/\\ell^2$)."""
        return self.latency(p, N) - N * self.latency_slope(p, N)

    def rate_prime(self, p: Params, N):
        """$\\mu'(N) = q(N)/\\ell(N)^2$."""
        return self.q(p, N) / self.latency(p, N) ** 2

    def inv_rate_prime(self, p: Params, N):
        """$1/\\mu'(N) = \\ell(N)^2/q(N)$."""
        return self.latency(p, N) ** 2 / self.q(p, N)

    def inverse_rate(self, p: Params, z, guess=None):
        """$\\mu^{-1}(z)$ for $0 \\le z < \\bar\\mu$ (`inf` for $z \\ge \\bar\\mu$).

        Default: a bracket grown geometrically from $z\\ell_{hi}$ until $\\mu \\ge z$, 100
        bisections, then three safeguarded Newton steps (exact enough for any increasing
        $\\mu$; the built-in laws use closed forms or monotone Newton iterations).
        """
        cap = p["capacity"]
        inside = z < cap
        zc = jnp.clip(z, 0.0, jnp.where(inside, z, 0.5 * cap))
        hi0 = jnp.maximum(zc * self.latency(p, jnp.ones_like(zc)), 1.0)

        def grow(_, hi):
            return jnp.where(self.rate(p, hi) < zc, 2.0 * hi, hi)

        hi = jax.lax.fori_loop(0, 200, grow, hi0)

        def bisect(_, lohi):
            lo, hi = lohi
            mid = 0.5 * (lo + hi)
            below = self.rate(p, mid) < zc
            return jnp.where(below, mid, lo), jnp.where(below, hi, mid)

        lo, hi = jax.lax.fori_loop(0, 100, bisect, (jnp.zeros_like(hi), hi))

        def newton(_, N):
            cand = N - (self.rate(p, N) - zc) / self.rate_prime(p, N)
            return jnp.where((cand >= lo) & (cand <= hi), cand, N)

        N = jax.lax.fori_loop(0, 3, newton, 0.5 * (lo + hi))
        return jnp.where(inside, N, jnp.inf)

    def balance(self, p: Params, N, z):
        """The flow balance $\\mu(N) = z$ as $h(N, z) = N - z\\ell(N) = 0$: returns
        $(h, \\partial h/\\partial N, \\ell)$ (so $\\partial h/\\partial z = -\\ell$)."""
        ell, slope = jax.jvp(lambda n: self.latency(p, n), (N,), (jnp.ones_like(N),))
        return N - z * ell, 1.0 - z * slope, ell

    def latency_potential(self, p: Params, z, N):
        """$\\int_0^N \\ell(n)\\mu'(n)\\,dn$ (= $\\int_0^z \\ell(\\mu^{-1}(s))ds$); default:
        64-point Gauss-Legendre on $[0, N]$."""
        return _gl64(
            lambda n: self.latency(_expand(p, n), n) * self.rate_prime(_expand(p, n), n), N
        )

    def rif_potential(self, p: Params, z, N):
        """$\\int_0^N n\\,\\mu'(n)\\,dn$ (= $\\int_0^z \\mu^{-1}(s)ds$); default: 64-point
        Gauss-Legendre on $[0, N]$."""
        return _gl64(lambda n: n * self.rate_prime(_expand(p, n), n), N)

    def perturb(self, p: Params, c) -> dict:
        """Parameters after the seed's estimation noise $\\theta \\to c\\,\\theta$ (seed §5.4;
        `perturb_service`); default: every parameter times `c`."""
        return {k: c * p[k] for k in self.parameters}

    def parse(self, field: str, value: dict) -> dict[str, float]:
        """Validated parameters of one cell from its scenario-file object (`field` names it
        in messages). Default: exactly the declared parameters, each a finite number > 0."""
        unknown = set(value) - {"model", *self.parameters}
        if unknown:
            raise ScenarioError(
                f"{field} = {value!r} is invalid: unknown keys {sorted(unknown)} for model "
                f"{self.name!r}; allowed: {', '.join(self.parameters)}"
            )
        return {k: positive(f"{field}.{k}", value.get(k)) for k in self.parameters}

    def to_dict(self, p: Mapping[str, Any]) -> dict:
        """The scenario-file object of one cell's parameters (inverse of `parse`)."""
        return {"model": self.name, **{k: float(p[k]) for k in self.parameters}}


def _expand(p: Params, n):
    """Parameters broadcast against quadrature nodes on a new last axis (`n` unused: the
    cell axis of the parameters is the nodes' second to last)."""
    return {k: jnp.asarray(v)[..., None] for k, v in p.items()}


def _gl64(fun, N):
    Nf = jnp.where(jnp.isfinite(N), N, 0.0)
    x, w = (lead(jnp.asarray(v), Nf.ndim + 1) for v in (_GL64_X, _GL64_W))
    nodes = 0.5 * Nf[..., None] * (x + 1.0)
    return 0.5 * Nf * jnp.sum(fun(nodes) * w, axis=-1)


# ----------------------------------------------------------------------------------------
# Parsing helpers shared by the laws
# ----------------------------------------------------------------------------------------


def number(field: str, value: Any) -> float:
    """A finite number (not a bool), or `ScenarioError` naming the field (the package's
    validator, `dlbfluid._validate.number`, for a law's parameter)."""
    return _number(field, value, error=ScenarioError)


def positive(field: str, value: Any) -> float:
    """A finite number > 0, or `ScenarioError` naming the field."""
    return _number(field, value, lo=0, lo_open=True, error=ScenarioError)


# ----------------------------------------------------------------------------------------
# The per-cell table
# ----------------------------------------------------------------------------------------


def law(name: str) -> AbstractServiceModel:
    """The registered law `name`."""
    return SERVICE_MODELS.get(name)


def code(name: str) -> int:
    """The integer code of the registered law `name` (its registry index)."""
    if name not in SERVICE_MODELS:
        raise ValueError(
            f"service model = {name!r} is invalid: allowed models are {list(SERVICE_MODELS.names())}"
        )
    return SERVICE_MODELS.index(name)


def _present(model, laws) -> tuple[str, ...]:
    names = SERVICE_MODELS.names()
    if laws is not None:
        out = tuple(laws)
        for n in out:
            code(n)
        return tuple(sorted(out, key=names.index))
    try:
        codes = np.unique(np.asarray(model))
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return names
    bad = [int(c) for c in codes if not 0 <= int(c) < len(names)]
    if bad:
        raise ValueError(
            f"model = {bad} is invalid: registered service-model codes are 0..{len(names) - 1}"
        )
    return tuple(names[int(c)] for c in codes) or names[:1]


class ServiceModel(eqx.Module):
    """The service models of `n` cells: a law and its parameters per cell (arrays `(n,)`).

    **Fields:**
    - `model`: integer code per cell (registry index: `mm1` = 0, `softplus` = 1, then
      user-registered laws).
    - `params`: `{name: (n,)}`, the parameters of every law in `laws`; a parameter reads as
      an attribute (`service.capacity` is $\\bar\\mu_j$, `service.knee` $N_0$, ...).
    - `laws`: (static) the names of the laws whose formulas are evaluated.

    Built as `ServiceModel(model=codes, capacity=..., base_latency=..., ...)` (parameters
    by keyword; missing ones take the laws' defaults) or `ServiceModel.of("softplus",
    capacity=..., ...)`.
    """

    model: Int[Array, "... n"]
    params: dict[str, Float[Array, "... n"]]
    laws: tuple[str, ...] = eqx.field(static=True)

    def __init__(self, model, params: dict | None = None, laws=None, **named):
        model = jnp.asarray(model)
        names = _present(model, laws)
        given = dict(params or {})
        given.update(named)
        ref = next(iter(given.values()), None)
        shape = (
            jnp.shape(model)
            if ref is None
            else jnp.broadcast_shapes(jnp.shape(model), jnp.shape(ref))
        )
        dtype = jnp.result_type(*given.values()) if given else jnp.result_type(float)
        full = {}
        for n in names:
            lw = law(n)
            for k in lw.parameters:
                if k in given:
                    full[k] = jnp.asarray(given[k])
                elif k not in full:
                    full[k] = jnp.full(shape, lw.defaults[k], dtype)
        for k, v in given.items():
            full.setdefault(k, jnp.asarray(v))
        self.model = model
        self.params = full
        self.laws = names

    def __check_init__(self):
        shapes = {k: jnp.shape(v) for k, v in self.params.items()}
        shapes["model"] = jnp.shape(self.model)
        if len(set(shapes.values())) != 1:
            raise ValueError(f"ServiceModel fields must share one shape, got {shapes}")

    def __getattr__(self, name: str):
        params = self.__dict__.get("params")
        if params is not None and name in params:
            return params[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def of(cls, name: str, **params) -> ServiceModel:
        """A table of cells that all follow the registered law `name`."""
        ref = jnp.asarray(params["capacity"])
        return cls(jnp.full(ref.shape, code(name), jnp.int32), params, laws=(name,))

    def with_laws(self, laws) -> ServiceModel:
        """The same cells in a table that evaluates `laws` (a superset of its own), with
        the added laws' parameters at their defaults (for stacking tables together)."""
        names = _present(self.model, tuple(set(laws) | set(self.laws)))
        if names == self.laws:
            return self
        return ServiceModel(self.model, self.params, laws=names)

    # --- evaluation: every law present, then a selection by code -------------------
    # (`latency`, `rate`, `rate_prime` and `inv_rate_prime` called outside a trace run as
    # one compiled program per shape with the eager numbers, `eager_jit`: evaluated
    # operation by operation they compiled some twenty small programs per new shape.)

    def _ranked(self, ref) -> dict:
        """The parameters with singleton axes prepended to the rank of `ref` (e.g. a leading
        router axis of observed workloads)."""
        return {k: like(v, ref) for k, v in self.params.items()}

    def _each(self, method: str, x, *args, **kwargs):
        # (`x`, the first data argument, sets the rank the parameters are expanded to)
        p = self._ranked(x)
        model = like(self.model, x)
        outs = [(code(n), getattr(law(n), method)(p, x, *args, **kwargs)) for n in self.laws]
        out = outs[0][1]
        for c, o in outs[1:]:
            out = jax.tree_util.tree_map(
                lambda a, b, c=c: jnp.where(like(model, a) == c, a, b), o, out
            )
        return out

    @eager_jit
    def latency(self, N: Float[Array, "... n"]) -> Float[Array, "... n"]:
        """Serving latency $\\ell_j(N_j)$ (seconds); $N$ is clipped at 0."""
        return self._each("latency", jnp.maximum(N, 0.0))

    @eager_jit
    def rate(self, N: Float[Array, "... n"]) -> Float[Array, "... n"]:
        """Processing rate $\\mu_j(N_j) = N_j/\\ell_j(N_j)$ (requests/s); $\\mu_j(0)=0$."""
        return self._each("rate", jnp.maximum(N, 0.0))

    @eager_jit
    def rate_prime(self, N: Float[Array, "... n"]) -> Float[Array, "... n"]:
        """Marginal processing rate $\\mu_j'(N_j) = q_j/\\ell_j^2$, $q = \\ell - N\\ell'$."""
        return self._each("rate_prime", jnp.maximum(N, 0.0))

    @eager_jit
    def inv_rate_prime(self, N: Float[Array, "... n"]) -> Float[Array, "... n"]:
        """Gradient cost $1/\\mu_j'(N_j) = \\ell_j^2/q_j$, evaluated without cancellation."""
        return self._each("inv_rate_prime", jnp.maximum(N, 0.0))

    def inverse_rate(self, z: Float[Array, "... n"], guess=None) -> Float[Array, "... n"]:
        """$\\mu_j^{-1}(z_j)$ for $0 \\le z_j < \\bar\\mu_j$; $+\\infty$ for $z_j \\ge \\bar\\mu_j$.
        `guess` (optional, `inf` entries ignored) is a warm start for iterative laws.

        In a mixed table each law iterates only on its own cells (the others see $z = 0$),
        so that one law's iterations never run on, or wait for, another law's cells."""
        p = self._ranked(z)
        if len(self.laws) == 1:
            return law(self.laws[0]).inverse_rate(p, z, guess)
        outs = []
        for n in self.laws:
            mine = like(self.model, z) == code(n)
            outs.append((mine, law(n).inverse_rate(p, jnp.where(mine, z, 0.0), guess)))
        out = outs[0][1]
        for mine, o in outs[1:]:
            out = jnp.where(mine, o, out)
        return out

    def balance(self, N, z):
        """`(h, dh/dN, l)` of the flow balance $h_j = N_j - z_j\\ell_j(N_j) = 0$."""
        return self._each("balance", N, z)

    def latency_potential(self, z, N):
        """$\\int_0^{N_j}\\ell_j\\mu_j'\\,dn$ per cell (`inf` where $N_j$ is)."""
        out = self._each("latency_potential", z, jnp.where(jnp.isfinite(N), N, 0.0))
        return jnp.where(jnp.isfinite(N), out, jnp.inf)

    def rif_potential(self, z, N):
        """$\\int_0^{N_j}n\\,\\mu_j'\\,dn$ per cell (`inf` where $N_j$ is)."""
        out = self._each("rif_potential", z, jnp.where(jnp.isfinite(N), N, 0.0))
        return jnp.where(jnp.isfinite(N), out, jnp.inf)

    def perturb(self, c) -> ServiceModel:
        """Every cell's parameters after $\\theta \\to c\\,\\theta$ by its law's rule."""
        params = dict(self.params)
        for n in self.laws:
            mine = self.model == code(n)
            for k, v in law(n).perturb(self.params, c).items():
                params[k] = jnp.where(mine, v, params[k]) if len(self.laws) > 1 else v
        return ServiceModel(self.model, params, laws=self.laws)

    # --- host-side helpers ---------------------------------------------------------

    def law_of(self, j: int) -> AbstractServiceModel:
        """The law of cell `j` (unbatched tables)."""
        return law(SERVICE_MODELS.names()[int(np.asarray(self.model)[j])])

    def cell_dict(self, j: int) -> dict:
        """The scenario-file object of cell `j` (unbatched tables)."""
        lw = self.law_of(j)
        return lw.to_dict({k: np.asarray(self.params[k])[j] for k in lw.parameters})


def service_from_cells(cells: list[tuple[str, dict[str, float]]]) -> ServiceModel:
    """A table from `(law name, parameters)` per cell (the output of the laws' `parse`)."""
    names = tuple(dict.fromkeys(n for n, _ in cells))
    keys: dict[str, float] = {}
    for n in names:
        lw = law(n)
        for k in lw.parameters:
            keys.setdefault(k, lw.defaults[k])
    cols = {k: np.array([p.get(k, d) for _, p in cells], dtype=float) for k, d in keys.items()}
    model = np.array([code(n) for n, _ in cells], dtype=np.int32)
    return ServiceModel(to_device(model), {k: to_device(v) for k, v in cols.items()}, laws=names)
