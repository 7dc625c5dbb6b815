"""The methods of the critical step size as one family of objects, and their registry
(theory/stability.md §2-§3).

`critical_step_size(method=...)` takes a member of `AbstractStabilityMethod` (base.py) or
its name; `METHODS` is the one list of the members (the command line's `--method` choices
are its names):

* `Symmetric()` (symmetric.py): the closed form for one origin routing between two
  identical cells (§2);
* `Pseudospectral(nodes=16)` (pseudospectral.py): Chebyshev collocation of the generator,
  any network, a dense eigenproblem of size $(M+1)d$ per test (§3.1-3.5);
* `Nyquist(per_decade=24, noise=1e-13)` (nyquist.py): the argument principle on the
  $n \\times n$ cell characteristic matrix, any network, large ones included (§3.6);
* `Auto(nodes=16, pseudospectral_size=600)` (here): the closed form where the structure
  allows it, else the pseudospectral method up to a generator of `pseudospectral_size`
  rows, else the argument principle.
"""

from __future__ import annotations

from typing import ClassVar

from .._defaults import STABILITY_NODES as DEFAULT_NODES
from .base import AbstractStabilityMethod
from .linearisation import Linearisation
from .nyquist import Nyquist
from .pseudospectral import Pseudospectral, check_nodes
from .symmetric import Symmetric


class Auto(AbstractStabilityMethod):
    """The closed form where it applies, else `Pseudospectral(nodes)` up to a generator of
    `pseudospectral_size` $\\ge (M+1)d$ rows, else `nyquist` (the default 600: a dense
    eigenproblem costs $((M+1)d)^3$, measured 15 ms per test for the networks of §2 and §4
    and 1-3.6 s at 50 cells; theory/stability.md §3.5)."""

    name: ClassVar[str] = "auto"
    nodes: int = DEFAULT_NODES
    pseudospectral_size: int = 600
    nyquist: Nyquist = Nyquist()

    def __check_init__(self):
        check_nodes(self.nodes)

    @classmethod
    def named(cls, nodes: int) -> Auto:
        return cls(nodes=nodes)

    def pick(self, lin: Linearisation, symmetric) -> AbstractStabilityMethod:
        """The member that `solve` delegates to."""
        if symmetric is not None:
            return Symmetric()
        if (self.nodes + 1) * lin.dim <= self.pseudospectral_size:
            return Pseudospectral(self.nodes)
        return self.nyquist

    def solve(self, lin: Linearisation, symmetric, *, rtol: float, progress: bool):
        return self.pick(lin, symmetric).solve(lin, symmetric, rtol=rtol, progress=progress)

    def no_crossing(self) -> tuple[str, int]:
        return "pseudospectral", self.nodes


METHODS: dict[str, type[AbstractStabilityMethod]] = {
    cls.name: cls for cls in (Auto, Symmetric, Pseudospectral, Nyquist)
}
"""The registry: name -> member class (the names of `_defaults.STABILITY_METHODS`, which
the command line reads without importing JAX)."""


def stability_method(method, nodes: int = DEFAULT_NODES) -> AbstractStabilityMethod:
    """`method` as an object: a member is returned as it is; a name of `METHODS` becomes
    `METHODS[name].named(nodes)` (`nodes` is checked for every name)."""
    if isinstance(method, AbstractStabilityMethod):
        return method
    if not (isinstance(method, str) and method in METHODS):
        raise ValueError(f"method = {method!r} is invalid: allowed methods are {list(METHODS)}")
    return METHODS[method].named(check_nodes(nodes))
