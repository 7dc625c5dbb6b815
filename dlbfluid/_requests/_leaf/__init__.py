"""The leaf rules of `servers` cells (`simulate_requests(leaf=...)`, `--leaf`): which of a
cell's servers an admitted request joins (theory/requests.md, *Leaf rules*)."""

from __future__ import annotations

from ..._validate import invalid as _bad
from .base import AbstractLeaf as AbstractLeaf
from .jsq import JoinShortestQueue as JoinShortestQueue
from .pod import PowerOfD as PowerOfD

LEAF_RULES = {rule.name: rule for rule in (JoinShortestQueue, PowerOfD)}
"""The leaf rules by name: `jsq` (default) and `pod` (d = 2 unless given)."""


def leaf_from_name(leaf) -> AbstractLeaf:
    """`leaf` as an `AbstractLeaf`: one already, or a name of `LEAF_RULES` (its default
    parameters); a `ValueError` naming the argument, its value and the allowed names
    otherwise."""
    if isinstance(leaf, AbstractLeaf):
        return leaf
    if isinstance(leaf, str) and leaf in LEAF_RULES:
        return LEAF_RULES[leaf]()
    raise _bad("leaf", leaf, f"allowed {', '.join(LEAF_RULES)} or an AbstractLeaf")
