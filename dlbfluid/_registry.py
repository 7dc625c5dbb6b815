"""The registry of every interchangeable part: service models, costs, policies.

One table per family maps a name to a member. The command line, the experiment runner,
`verify`, the demo, the notebooks and the contract tests all read these tables, so a
member registered once (by dlbfluid, or by a user's own module) is available everywhere
by its name.

This module imports no JAX: `dlbfluid --help` builds its choices from the built-in names
listed here without starting a backend. Built-in members are given as `"module:attr"`
strings and imported on first use.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any


def _resolve(path: str) -> Any:
    """The object that a `"module:attr"` path names, importing its module now."""
    mod, _, attr = path.partition(":")
    return getattr(importlib.import_module(mod), attr)


class Registry:
    """Names to members of one family (`kind`), in registration order.

    A member is an object, a class or plain function called with no arguments, or a
    `"module:attr"` string naming one of those, resolved on first `get`.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, Any] = {}
        self._resolved: dict[str, Any] = {}

    def register(self, name: str, member: Any, *, replace: bool = False) -> None:
        if not isinstance(name, str) or not name or any(c.isspace() for c in name):
            raise ValueError(f"{self.kind} name = {name!r} is invalid: expected a non-empty word")
        if name in self._items and not replace:
            raise ValueError(
                f"{self.kind} name = {name!r} is already registered; pass replace=True to "
                "redefine it"
            )
        self._items[name] = member
        self._resolved.pop(name, None)

    def unregister(self, name: str) -> None:
        self._items.pop(name, None)
        self._resolved.pop(name, None)

    def names(self) -> tuple[str, ...]:
        return tuple(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def index(self, name: str) -> int:
        return self.names().index(name)

    def get(self, name: str) -> Any:
        if name not in self._items:
            raise ValueError(
                f"{self.kind} = {name!r} is invalid: allowed {self.kind}s are {list(self._items)}"
            )
        if name not in self._resolved:
            member = self._items[name]
            if isinstance(member, str):
                member = _resolve(member)
            # A class or a plain function is a factory; anything else is the member.
            if isinstance(member, type) or inspect.isfunction(member):
                member = member()
            self._resolved[name] = member
        return self._resolved[name]


SERVICE_MODELS = Registry("service model")
"""Service-model laws (`AbstractServiceModel`); a law's code in a `ServiceModel` table is
its index here."""
COSTS = Registry("cost")
"""Cost families (`AbstractCost`), by full name (`"gradient"`)."""
POLICIES = Registry("policy")
"""Routing policies (`AbstractPolicy` factories), by name (`"flow-grad"`)."""

SERVICE_MODELS.register("mm1", "dlbfluid._service.mm1:MM1")
SERVICE_MODELS.register("softplus", "dlbfluid._service.softplus:Softplus")

# Cost families with the short names of their policies (`AbstractCost.short`; the test
# `test_policy_names_round_trip` checks that these names are the classes' own).
_BUILTIN_COSTS = (
    ("rif", "rif", "dlbfluid._costs.rif:RIF"),
    ("latency", "lat", "dlbfluid._costs.latency:Latency"),
    ("gradient", "grad", "dlbfluid._costs.gradient:Gradient"),
)
for _name, _short, _path in _BUILTIN_COSTS:
    COSTS.register(_name, _path)


# The two routing mechanisms of a cost family, by module path: the registry names its
# members and never imports them (the policies import the registry).
_MECHANISMS = {
    "disc": "dlbfluid._policies.discrete:DiscreteRouting",
    "flow": "dlbfluid._policies.flow:FlowRouting",
}


def _mechanism_factory(mechanism: str, cost: str) -> Callable[[], Any]:
    def make():
        return _resolve(_MECHANISMS[mechanism])(COSTS.get(cost))

    return make


def _register_mechanisms(cost: str, short: str) -> None:
    for mech in ("disc", "flow"):
        POLICIES.register(f"{mech}-{short}", _mechanism_factory(mech, cost))


for _mech in ("disc", "flow"):
    for _name, _short, _ in _BUILTIN_COSTS:
        POLICIES.register(f"{_mech}-{_short}", _mechanism_factory(_mech, _name))
POLICIES.register("rand", "dlbfluid._policies.rand:WeightedRandom")
POLICIES.register("mnlb", "dlbfluid._policies.mnlb:MNLB")

BUILTIN_POLICIES = POLICIES.names()
"""The eight policies of the paper's evaluation, in the order of the results tables (docs/results.md)."""


def register_cost(cost, *, policies: bool = True) -> None:
    """Register a cost family (an `AbstractCost` instance) under `cost.name`, and, unless
    `policies=False`, its discrete and flow policies `disc-SHORT` and `flow-SHORT`
    (`SHORT` = `cost.short`)."""
    COSTS.register(cost.name, cost)
    if policies:
        _register_mechanisms(cost.name, cost.short)


def register_policy(name: str, factory) -> None:
    """Register a routing policy: `factory` is an `AbstractPolicy` or a zero-argument
    callable returning one."""
    POLICIES.register(name, factory)


def register_service_model(model) -> None:
    """Register a service-model law (an `AbstractServiceModel` instance) under
    `model.name`; scenario files then accept `{"model": NAME, ...}`."""
    SERVICE_MODELS.register(model.name, model)


def flow_policy_names() -> tuple[str, ...]:
    """Registered policies that route by flow (the ones Theorem 1 is about)."""
    return tuple(p for p in POLICIES.names() if p.startswith("flow-"))
