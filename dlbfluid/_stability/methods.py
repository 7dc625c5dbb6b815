"""The methods of the critical step size, one family of objects (theory/stability.md §2-§3).

`critical_step_size(method=...)` takes a member of `AbstractStabilityMethod` or its name
(`METHODS`, the one registry; the command line's `--method` maps to it):

* `Symmetric()`: the closed form for one origin routing between two identical cells (§2);
* `Pseudospectral(nodes=16)`: Chebyshev collocation of the generator, any network, a dense
  eigenproblem of size $(M+1)d$ per test (§3.1-3.5);
* `Nyquist(per_decade=24, noise=1e-13)`: the argument principle on the $n \\times n$ cell
  characteristic matrix, any network, large ones included (§3.6);
* `Auto(nodes=16, pseudospectral_size=600)`: the closed form where the structure allows
  it, else the pseudospectral method up to a generator of `pseudospectral_size` rows, else
  the argument principle.

Each `solve` returns $\\eta^*$, the crossing root, the name of the method actually used and
the Chebyshev nodes it used (0 for the closed form and the argument principle).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import ClassVar

import equinox as eqx
import numpy as np

from .._defaults import STABILITY_NODES as DEFAULT_NODES
from .linearisation import Linearisation
from .nyquist import nyquist_eta
from .pseudospectral import Spectrum, bisect_eta, check_nodes
from .search import NO_ROOT, Steps, initial_guess, say
from .symmetric import omega_c, symmetric_critical_step_size


def _search(lin: Linearisation, name: str, progress: bool) -> tuple[float, Steps]:
    """The progress line of a crossing search, its `Steps` and the initial guess."""
    if progress:
        say(
            f"stability: linearised, {lin.dim} states, {len(lin.sources)} routing sources, "
            f"{lin.delays.size} delays; {name} crossing search"
        )
    return initial_guess(lin), Steps(progress, f"stability ({name})", 8)


class AbstractStabilityMethod(eqx.Module):
    """A way to find $\\eta^*$ from a `Linearisation` (module docstring).

    `name` is the word of `critical_step_size(method=...)`, `--method` and the JSON's
    `method`; `solve(lin, symmetric, rtol=..., progress=...)` returns
    `(eta, root, name_used, nodes_used)`, where `symmetric` is `symmetric_parameters(lin)`
    (None when the closed form does not apply)."""

    name: ClassVar[str]

    @abc.abstractmethod
    def solve(self, lin: Linearisation, symmetric, *, rtol: float, progress: bool):
        """$(\\eta^*, s_c, \\text{method}, M)$ for a linearisation with routing sources."""

    def check(self, lin: Linearisation, symmetric) -> None:
        """Raise `ValueError` if the method cannot treat this linearisation."""


class Symmetric(AbstractStabilityMethod):
    """The closed form of theory/stability.md §2 (`symmetric_critical_step_size`)."""

    name: ClassVar[str] = "symmetric"

    def check(self, lin: Linearisation, symmetric) -> None:
        if symmetric is None:
            raise ValueError(
                "method = 'symmetric' is invalid for this scenario: the closed form needs "
                "exactly one origin routing between two cells with equal mu'(N*), f'(N*) and "
                "one-way delay (found routing sources "
                f"{list(lin.sources)} with supports {[list(S) for S in lin.supports]}); "
                "use method='pseudospectral'"
            )

    def solve(self, lin: Linearisation, symmetric, *, rtol: float, progress: bool):
        self.check(lin, symmetric)
        a, fp, lam, tau = symmetric
        eta = symmetric_critical_step_size(a, fp, lam, tau)
        root = complex(0.0, omega_c(a, eta * lam * fp)) if math.isfinite(eta) else NO_ROOT
        return eta, root, self.name, 0


class Pseudospectral(AbstractStabilityMethod):
    """Chebyshev collocation with `nodes` $= M$ nodes, Brent's method on the spectral
    abscissa (theory/stability.md §3.1-3.5; `Spectrum`, `bisect_eta`)."""

    name: ClassVar[str] = "pseudospectral"
    nodes: int = DEFAULT_NODES

    def __check_init__(self):
        check_nodes(self.nodes)

    def solve(self, lin: Linearisation, symmetric, *, rtol: float, progress: bool):
        eta0, steps = _search(lin, self.name, progress)
        spec = Spectrum(lin, self.nodes)
        eta = bisect_eta(spec, eta0, rtol, steps)
        root = NO_ROOT
        if math.isfinite(eta) and eta > 0:
            ev = spec.roots(eta)
            top = ev[np.abs(ev.real - ev[0].real) <= 1e-8 * (1.0 + abs(ev[0]))]
            root = complex(top[np.argmax(top.imag)])
        steps.finish()
        return eta, root, self.name, self.nodes


class Nyquist(AbstractStabilityMethod):
    """The argument principle on the cell characteristic matrix (theory/stability.md §3.6;
    `nyquist_eta`). `per_decade`: logarithmic frequencies per decade of the first grid;
    `noise`: the relative rounding level of the eigenvalues of $H(i\\omega)$, below which
    they count as zeros (measured: $10^{-13}$ separates the cells' own modes from the loci
    on the catalogue networks)."""

    name: ClassVar[str] = "nyquist"
    per_decade: int = 24
    noise: float = 1e-13

    def solve(self, lin: Linearisation, symmetric, *, rtol: float, progress: bool):
        eta0, steps = _search(lin, self.name, progress)
        eta, root = nyquist_eta(
            lin, eta0, rtol, steps, per_decade=self.per_decade, noise=self.noise
        )
        steps.finish()
        return eta, root, self.name, 0


class Auto(AbstractStabilityMethod):
    """The closed form where it applies, else `Pseudospectral(nodes)` up to a generator of
    `pseudospectral_size` $\\ge (M+1)d$ rows (measured: below 600 rows its dense
    eigenproblem is faster than the loci), else `nyquist`."""

    name: ClassVar[str] = "auto"
    nodes: int = DEFAULT_NODES
    pseudospectral_size: int = 600
    nyquist: Nyquist = Nyquist()

    def __check_init__(self):
        check_nodes(self.nodes)

    def pick(self, lin: Linearisation, symmetric) -> AbstractStabilityMethod:
        """The member that `solve` delegates to."""
        if symmetric is not None:
            return Symmetric()
        if (self.nodes + 1) * lin.dim <= self.pseudospectral_size:
            return Pseudospectral(self.nodes)
        return self.nyquist

    def solve(self, lin: Linearisation, symmetric, *, rtol: float, progress: bool):
        return self.pick(lin, symmetric).solve(lin, symmetric, rtol=rtol, progress=progress)


METHODS: dict[str, type[AbstractStabilityMethod]] = {
    cls.name: cls for cls in (Auto, Symmetric, Pseudospectral, Nyquist)
}
"""The registry: name -> member class (the names of `_defaults.STABILITY_METHODS`)."""


def stability_method(method, nodes: int = DEFAULT_NODES) -> AbstractStabilityMethod:
    """`method` as an object: a member is returned as it is; a name of `METHODS` becomes
    its class with `nodes` where it has that field (`nodes` is checked for every name)."""
    if isinstance(method, AbstractStabilityMethod):
        return method
    if not (isinstance(method, str) and method in METHODS):
        raise ValueError(f"method = {method!r} is invalid: allowed methods are {list(METHODS)}")
    nodes = check_nodes(nodes)
    cls = METHODS[method]
    if any(f.name == "nodes" for f in dataclasses.fields(cls)):
        return cls(nodes=nodes)
    return cls()
