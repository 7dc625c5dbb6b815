"""The family of methods for the critical step size (theory/stability.md §2-§3): the
abstract class. Its members live beside their mathematics: `Symmetric` (symmetric.py),
`Pseudospectral` (pseudospectral.py), `Nyquist` (nyquist.py) and `Auto` (methods.py,
with the registry `METHODS` of their names).
"""

from __future__ import annotations

import abc
import math

import equinox as eqx

from .linearisation import Linearisation

NO_ROOT = complex(math.nan, math.nan)
"""The crossing root when there is none ($\\eta^*$ is 0 or infinite)."""


class AbstractStabilityMethod(eqx.Module):
    """A way to find $\\eta^*$ from a `Linearisation`.

    `name` is the word of `critical_step_size(method=...)`, `--method` and the JSON's
    `method`. `solve(lin, symmetric, rtol=..., progress=...)` returns
    `(eta, root, method_used, nodes_used)` for a linearisation with routing sources, where
    `symmetric` is `symmetric_parameters(lin)` (None when the closed form does not apply);
    `no_crossing()` the `(method, nodes)` reported without routing sources ($\\eta^* =
    \\infty$, no search); `check` raises `ValueError` where the method cannot treat the
    linearisation; `named(nodes)` builds the member from its name and the `nodes` option.
    """

    name: eqx.AbstractClassVar[str]

    @classmethod
    @abc.abstractmethod
    def named(cls, nodes: int) -> AbstractStabilityMethod:
        """The member for its name, with `nodes` Chebyshev nodes where it has them."""

    @abc.abstractmethod
    def solve(self, lin: Linearisation, symmetric, *, rtol: float, progress: bool):
        """$(\\eta^*, s_c, \\text{method}, M)$."""

    @abc.abstractmethod
    def no_crossing(self) -> tuple[str, int]:
        """`(method, nodes)` of the result when no source routes."""

    def check(self, lin: Linearisation, symmetric) -> None:
        """Raise `ValueError` if the method cannot treat this linearisation (none here)."""
