"""`VerifyConfig`: the settings of a `verify` run, checked when made, and the manifest
they write (a resumed run must match it)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math

from .._defaults import PROBE_TICK, STEP_BASES, STEP_RULES, VERIFY_GENERATORS, VERIFY_LADDERS
from .._evaluation.config import STEP_RULE_KAPPA
from .._global_threshold import WorstCaseSearch
from .._policies import FlowRouting, policy_from_name
from .._registry import flow_policy_names
from .._validate import check_search_range, integer, invalid, number

DEFAULT_CHUNK = 32
"""Scenarios per compiled batch of `verify` unless a run of fewer than 128 asks for less."""


def flow_policies(names=None) -> tuple[tuple[str, str], ...]:
    """`(policy name, cost name)` of the registered flow policies (or of `names`)."""
    out = []
    for p in flow_policy_names() if names is None else names:
        pol = policy_from_name(p)
        if not isinstance(pol, FlowRouting):
            raise ValueError(
                f"policy = {p!r} is invalid: allowed flow policies are {list(flow_policy_names())}"
            )
        out.append((p, pol.cost.name))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class VerifyConfig:
    """How `verify` runs each scenario (what it runs: `n_scenarios`, `seed` and the scenario
    source are `verify`'s arguments).

    **Fields:**
    - `n_cells`: `(fewest, most)` cells of the random networks.
    - `horizon`, `tick`: simulated seconds (a whole number of ticks) and the probe tick
      (the paper's 5 ms, `PROBE_TICK`, as on the command line).
    - `step_fraction`, `step_base`: the oracle step is `step_fraction` times `step_base`'s
      threshold (`"eta-star"`, the linear critical step; `"eta0"`, the proof's, so that a
      fraction $\\le 1$ runs inside Theorem 1's hypothesis).
    - `step_rule`: `"oracle"` or `"paper"` ($\\eta_i = \\kappa_c/\\bar\\tau_i$).
    - `conv_tol`: converged when $\\max_j|N_j(T)-N_j^*| \\le$ `conv_tol`
      $\\max(1, \\max_jN_j^*)$.
    - `nodes`: kept in the manifest only (the former per-scenario critical steps' nodes).
    - `policies`: flow policy names (`None`: every registered one).
    - `generator`: `"random"` or `"appb"` (when no scenario or `draw` is given).
    - `ladder`, `tau_scales`: `"none"` or `"full"` (the descriptive ladder, with its delay
      scales; 1 is always included).
    - `worst_case`, `starts`: the global-threshold search and its drawn starts per step.
    - `search_range`: `(LO, HI)`, the steps searched in units of $\\eta^*$, $0 < LO < HI$;
      `bracket_tol`: the bracket's relative width, in $(0, 0.5)$ (`WorstCaseSearch`).
    - `chunk`: scenarios per compiled batch (`None`: `DEFAULT_CHUNK`, or a quarter of a
      short run); not in the manifest (records do not depend on it).

    **Raises:** `ValueError` naming the field, the value and what is allowed.
    """

    n_cells: tuple[int, int] = (2, 6)
    horizon: float = 200.0
    tick: float = PROBE_TICK
    step_fraction: float = 0.3
    conv_tol: float = 1e-3
    nodes: int = 8
    policies: tuple[str, ...] | None = None
    generator: str = "random"
    step_rule: str = "oracle"
    ladder: str = "none"
    tau_scales: tuple[float, ...] = (1.0, 2.0, 4.0)
    step_base: str = "eta-star"
    worst_case: bool = False
    starts: int = 16
    search_range: tuple[float, float] = WorstCaseSearch.search_range
    bracket_tol: float = WorstCaseSearch.bracket_tol
    chunk: int | None = None

    def __post_init__(self):
        for key, choices in (("generator", VERIFY_GENERATORS), ("step_rule", STEP_RULES),
                             ("ladder", VERIFY_LADDERS), ("step_base", STEP_BASES)):  # fmt: skip
            if getattr(self, key) not in choices:
                raise invalid(key, getattr(self, key), f"allowed values are {list(choices)}")
        scales = tuple(float(v) for v in self.tau_scales)
        if not scales or any(not (math.isfinite(v) and v > 0) for v in scales):
            raise invalid("tau_scales", self.tau_scales, "expected scales > 0")
        object.__setattr__(self, "tau_scales", scales if 1.0 in scales else (1.0, *scales))
        if self.policies is not None:
            object.__setattr__(self, "policies", tuple(self.policies))
        object.__setattr__(self, "n_cells", tuple(int(v) for v in self.n_cells))
        if self.chunk is not None:
            object.__setattr__(self, "chunk", integer("chunk", self.chunk, 1))
        object.__setattr__(self, "starts", integer("starts", self.starts, 1))
        object.__setattr__(self, "search_range", check_search_range(self.search_range,
                                                                    "search_range"))  # fmt: skip
        number("bracket_tol", self.bracket_tol, lo=0, hi=0.5, lo_open=True, hi_open=True)
        for name in ("step_fraction", "conv_tol", "horizon", "tick"):
            number(name, getattr(self, name), lo=0, lo_open=True)
        K = round(self.horizon / self.tick)
        if abs(K * self.tick - self.horizon) > 1e-9 * self.horizon:
            raise invalid(
                "horizon", self.horizon, f"expected a whole number of ticks of {self.tick}"
            )
        if self.step_rule == "paper":
            for p, c in flow_policies(self.policies):
                if c not in STEP_RULE_KAPPA:
                    raise ValueError(
                        f"step_rule = 'paper' is invalid for policy {p!r}: kappa is calibrated "
                        f"for the costs {list(STEP_RULE_KAPPA)} only; use step_rule = 'oracle'"
                    )

    @property
    def ticks(self) -> int:
        """Ticks per run (`horizon / tick`)."""
        return round(self.horizon / self.tick)

    def search(self) -> WorstCaseSearch | None:
        """The worst-case search of each chunk (`None` without `worst_case`)."""
        if not self.worst_case:
            return None
        return WorstCaseSearch(
            starts=self.starts, vertex_starts=min(2, self.starts),
            ascent_starts=min(WorstCaseSearch.ascent_starts, self.starts),
            search_range=self.search_range, bracket_tol=self.bracket_tol,
        )  # fmt: skip

    def manifest(self, n_scenarios: int, seed: int, *, draw=None, scenario=None) -> dict:
        """The settings that change a number, as the directory's manifest records them.

        Settings added after the first release are recorded only where they differ from
        their defaults, so a run with the defaults keeps the manifest it always had."""
        config = {
            "n_scenarios": n_scenarios,
            "seed": seed,
            "n_cells": list(self.n_cells),
            "horizon": self.horizon,
            "tick": self.tick,
            "step_fraction": self.step_fraction,
            "conv_tol": self.conv_tol,
            "nodes": self.nodes,
            "policies": [p for p, _ in flow_policies(self.policies)],
            "draw": None if draw is None else _qualified_name(draw),
        }
        for key, value, default in (
            ("generator", self.generator, "random"),
            ("scenario", None if scenario is None else _digest(scenario), None),
            ("step_rule", self.step_rule, "oracle"),
            ("ladder", self.ladder, "none"),
            ("tau_scales", list(self.tau_scales) if self.ladder == "full" else None, None),
            ("step_base", self.step_base, "eta-star"),
            ("worst_case", self.worst_case, False),
            ("starts", self.starts if self.worst_case else None, None),
            ("search_range", list(self.search_range) if self.worst_case else None, None),
            ("bracket_tol", self.bracket_tol if self.worst_case else None, None),
        ):
            if value != default:
                config[key] = value
        return config


def _digest(d: dict) -> str:
    """A short fingerprint of a given scenario (the manifest records it, not the file)."""
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _qualified_name(fn) -> str:
    """`module.qualname` of a scenario source (of its type for a callable object): the
    identity the manifest records (a changed body under the same name goes unnoticed)."""
    obj = fn if hasattr(fn, "__qualname__") else type(fn)
    return f"{getattr(obj, '__module__', '?')}.{obj.__qualname__}"
