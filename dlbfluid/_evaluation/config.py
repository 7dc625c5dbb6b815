"""What an experiment is (seed App. B; theory/evaluation.md): its kinds and their variants,
the step-size rules and the `ExperimentConfig` an experiment directory records. jax-free,
so that the command line's `--help` lists the kinds without starting a backend; the runner
is `dlbfluid._evaluation.experiment`.
"""

from __future__ import annotations

import dataclasses

from .._defaults import (
    AFFINITY_MODES,
    DURATION_SCALES,
    ESTIMATION_MODES,
    MITIGATION_DEFAULTS,
    MITIGATION_FIELDS,
    PROBE_TICK,
    STEP_RULES,
)
from .._registry import BUILTIN_POLICIES
from .._registry import POLICIES as _REGISTRY
from .._validate import check_estimation, integer, number, period_ticks

POLICIES = ("rand", "mnlb") + tuple(p for p in BUILTIN_POLICIES if p not in ("rand", "mnlb"))
"""The default policies, baselines first (any registered policy may be named)."""
UTILISATIONS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
"""Utilisations of the `utilization` kind (seed App. B.2, Figure 10(b))."""
NOISE_LEVELS = (0.0, 0.1, 0.25, 0.5)
"""Maximum multiplicative perturbations $\\epsilon$ of the `noise` kind (seed §5.4)."""
HETEROGENEITY_CVS = (0.0, 0.1, 0.2, 0.4, 0.8)
"""Coefficients of variation of the cells' token times in the `heterogeneity` kind (the
generator's default, 0.2, is the seed's "20% standard deviation across cells"; 0 is the
`homogeneous` kind)."""
TICKS = (0.1, 0.05, 0.02, 0.01, 0.005, 0.002)
"""Ticks $h$ (s) of the `tick` kind, on the baseline and on $y = 10$ scenarios."""
TICK_DURATION_SCALE = 10.0
"""The short-request ("sand") duration scaling of the `tick` kind's second family."""

KINDS = (
    "baseline",
    "utilization",
    "duration",
    "burst",
    "outage",
    "spikes",
    "noise",
    "homogeneous",
    "heterogeneity",
    "tick",
    "recovery",
    "affinity",
)
"""Experiment kinds (`dlbfluid experiment KIND`)."""

REQUEST_ONLY_KINDS = ("recovery", "affinity")
"""The kinds that run at request level only, in `servers` cells: `recovery` compares
routers' models estimated from requests, `affinity` sessions and prefix caches, neither of
which the fluid model has."""
FLUID_KINDS = tuple(k for k in KINDS if k not in REQUEST_ONLY_KINDS)
"""The kinds the fluid model runs (every kind but `REQUEST_ONLY_KINDS`)."""

AFFINITY_SESSIONS = {
    "fraction": 0.65,
    "mean_length": 8.0,
    "think_time": 10.0,
    "prefix_reuse": 0.45,
    "skew": 1.2,
}
"""The `affinity` kind's `workload.sessions` (theory/affinity.md): 65% of requests in
sessions and 45% of a hit's prefill saved (the middles of the seed's 60-70% and 40-50%,
§3.5), sessions of 8 requests 10 s apart, and a hot-session skew (Zipf exponent 1.2: the
hottest of a root's hundreds of active sessions carries about a quarter of its session
traffic)."""

RECOVERY_SLOWDOWN = (3.0, 0.3, 0.5)
"""The `recovery` kind's slowdown: one cell of each scenario serves 3x slower from 30% to
50% of the horizon (issue 42, item 3)."""
RECOVERY_SAVE = 10.0
"""Seconds per interval of the `recovery` kind's traffic shares."""
RECOVERY_TOLERANCE = 0.1
"""The `recovery` kind: a run has recovered once the slowed cell's traffic share stays
within this fraction of the oracle run's."""

MODELS = ("fluid", "requests")
"""What an experiment simulates: the fluid model (`simulate`), or the request-level twin
(`simulate_requests`) beside it on the same scenarios and step sizes."""
SERVICES = ("markov", "servers")
"""The request-level cell kinds (`simulate_requests(service=...)`)."""
LEAVES = ("jsq", "pod")
"""The leaf rules of `servers` cells (`dlbfluid._requests._leaf.LEAF_RULES`)."""
REQUEST_KINDS = KINDS
"""The kinds the request-level twin runs: all of them (`simulate_requests` follows the
outage's replica schedule); `recovery` runs at request level only, in `servers` cells."""


STEP_RULE_KAPPA = {"rif": 10**-4.25, "latency": 10**-1.75, "gradient": 10**-2.5}
"""$\\kappa$ of the paper's step-size rule per cost family, calibrated once on scenarios
disjoint from the evaluation's (notebooks/calibrate_step_rule.py: seed 1000, 10 baseline
scenarios, 120 s; the smallest point of the ladder $10^{-5}..1$ within 0.25% of the best mean
normalised latency; the numbers are in notebooks/results/calibration.json and
theory/evaluation.md, *Step sizes*). Units: per (cost unit x second) x seconds of delay, so
RIF's (requests per replica) is far smaller than latency's and gradient's (seconds)."""


def variants(kind: str) -> list[tuple[str, dict]]:
    """The `(label, options)` variants of an experiment kind. Options: `utilisation`,
    `duration_scale`, `token_time_cv` (generator), `event` (App. B.3), `noise` or `fit`
    (routers' models), `tick` (the variant's own tick), `slowdown` (factor, start and end
    as fractions of the horizon: a service schedule on one cell, `RECOVERY_SLOWDOWN`) and
    `estimation` (online estimation's fields beside the configuration's refit period and
    window: the `recovery` kind's oracle, online and mitigated variants) and `affinity`
    (the `affinity` kind's modes, on scenarios with `AFFINITY_SESSIONS`)."""
    if kind == "baseline":
        return [("baseline", {})]
    if kind == "utilization":
        return [(f"u={u:g}", {"utilisation": u}) for u in UTILISATIONS]
    if kind == "duration":
        return [(f"y={y:g}", {"duration_scale": y}) for y in DURATION_SCALES]
    if kind in ("burst", "outage", "spikes"):
        return [(kind, {"event": kind})]
    if kind == "noise":
        return [(f"eps={e:g}", {"noise": e}) for e in NOISE_LEVELS] + [("fitted", {"fit": True})]
    if kind == "homogeneous":
        return [("homogeneous", {"token_time_cv": 0.0})]
    if kind == "heterogeneity":
        return [(f"cv={c:g}", {"token_time_cv": c}) for c in HETEROGENEITY_CVS]
    if kind == "recovery":
        slow: dict = {"slowdown": RECOVERY_SLOWDOWN}
        return [("oracle", slow), ("online", {**slow, "estimation": {}})] + [
            (m, {**slow, "estimation": {MITIGATION_FIELDS[m]: v}})
            for m, v in MITIGATION_DEFAULTS.items()
        ]
    if kind == "affinity":
        return [(mode, {"affinity": mode}) for mode in AFFINITY_MODES]
    if kind == "tick":
        y = TICK_DURATION_SCALE
        return [(f"h={1e3 * h:g}ms", {"tick": h}) for h in TICKS] + [
            (f"y={y:g},h={1e3 * h:g}ms", {"tick": h, "duration_scale": y}) for h in TICKS
        ]
    raise ValueError(f"experiment = {kind!r} is invalid: allowed experiments are {list(KINDS)}")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """What an experiment directory holds; a resumed run must match it exactly.

    **Fields:** `experiment` (one of `KINDS`), `scenarios`, `trials`, `seed`, `horizon` (s),
    `tick` (s; the paper's probe cadence `PROBE_TICK` by default; the `tick` kind's variants
    set their own), `step_rule` (`"paper"`: router $i$ of a flow policy with cost $c$ takes
    $\\eta_i = \\kappa_c/\\bar\\tau_i$, $\\bar\\tau_i$ the mean one-way delay to the cells it
    may route to, $\\kappa_c$ = `STEP_RULE_KAPPA`; `"oracle"`: `step_fraction` times each
    scenario's critical step size $\\eta^*$ linearised at the routers' model's equilibrium),
    `step_fraction`, `policies`, `variants` (`None`: every variant of the kind; otherwise
    the labels of `variants(experiment)` to run, a subset kept in the kind's order, so that
    one level of a sweep can be run alone), `error_aversion` (every policy but MNLB uses
    `ErrorAversion()`), `mnlb_error_aversion` (MNLB too; off by default: the paper's MNLB is
    a separate, centralised system), `mnlb_period` (s) and `mnlb_cap` (MNLB's utilisation
    cap), `fluctuation` (trial noise $\\sigma$), `utilisation` (of the base scenarios),
    `model` (`MODELS`: `"fluid"`, or `"requests"`: every unit is also simulated request by
    request, one request-level run per scenario and trial, seeded by `seed`) and `service`
    (`SERVICES`, the request-level cells; `"markov"` for the fluid model), and, for a
    request-level run only: `scale` (the twin's $k$: rates, replicas and buffers times $k$,
    probe noise about $k^{-1/2}$ of the fluid's counts), `probe_smoothing` (the routers'
    filter time constant in s, 0 for the raw probes), `leaf` and `pod_d` (the `servers`
    cells' leaf rule, `"jsq"` or `"pod"` with its $d$), `estimation` (`"oracle"`, or
    `"online"` with `servers` cells: the latency models refitted in the loop every
    `refit_period` s over `estimation_window` s, with the mitigations `probing` (s between
    background probes), `shrinkage` (the prior's weight in samples) and `dithering`
    ($\\sigma$), each off at 0; `mitigations`).

    `to_json` (the directory's fingerprint) leaves `model` and `service` out for a fluid
    run, so that a fluid experiment's configuration is the one recorded before the
    request-level twin existed (its directories keep resuming), and holds both for a
    request-level run (which therefore never resumes into a fluid run's directory, nor into
    one of another service). It leaves `variants` out when it is `None` (every variant), so
    that the directories recorded before the option existed keep resuming, and a run of a
    subset never resumes into one of another subset or of all. `scale`, `probe_smoothing`,
    `leaf`, `pod_d` and the estimation's fields enter it only where they differ from their
    defaults, for the same reason.
    """

    experiment: str
    scenarios: int = 10
    trials: int = 5
    seed: int = 0
    horizon: float = 600.0
    tick: float = PROBE_TICK
    step_rule: str = "paper"
    step_fraction: float = 0.3
    policies: tuple[str, ...] = POLICIES
    variants: tuple[str, ...] | None = None
    error_aversion: bool = True
    mnlb_error_aversion: bool = False
    mnlb_period: float = 10.0
    mnlb_cap: float = 0.9
    fluctuation: float = 0.1
    utilisation: float = 0.8
    model: str = "fluid"
    service: str = "markov"
    scale: int = 1
    probe_smoothing: float = 0.0
    leaf: str = "jsq"
    pod_d: int = 2
    estimation: str = "oracle"
    refit_period: float = 5.0
    estimation_window: float = 60.0
    probing: float = 0.0
    shrinkage: float = 0.0
    dithering: float = 0.0

    def __post_init__(self):
        vs = variants(self.experiment)
        if self.variants is not None:
            chosen = _chosen_variants(self.experiment, vs, self.variants)
            object.__setattr__(self, "variants", chosen)
            vs = self.run_variants()
        for f in ("scenarios", "trials"):
            object.__setattr__(self, f, integer(f, getattr(self, f), 1))
        for f in ("horizon", "tick", "mnlb_period"):
            number(f, getattr(self, f), lo=0, lo_open=True)
        for label, opts in vs:
            h = opts.get("tick", self.tick)
            K = round(self.horizon / h)
            if abs(K * h - self.horizon) > 1e-9 * self.horizon:
                where = f" (variant {label})" if "tick" in opts else ""
                raise ValueError(
                    f"horizon = {self.horizon} is invalid: expected a multiple of tick = {h}{where}"
                )
        if self.step_rule not in STEP_RULES:
            raise ValueError(
                f"step_rule = {self.step_rule!r} is invalid: allowed rules are {list(STEP_RULES)}"
            )
        if not (0 < self.step_fraction <= 1):
            raise ValueError(
                f"step_fraction = {self.step_fraction!r} is invalid: expected 0 < value <= 1"
            )
        if not (0 < self.mnlb_cap <= 1):
            raise ValueError(f"mnlb_cap = {self.mnlb_cap!r} is invalid: expected 0 < value <= 1")
        if not (0 <= self.fluctuation < 1):
            raise ValueError(
                f"fluctuation = {self.fluctuation!r} is invalid: expected 0 <= value < 1"
            )
        if not (0 < self.utilisation < 1):
            raise ValueError(
                f"utilisation = {self.utilisation!r} is invalid: expected 0 < value < 1"
            )
        if self.model not in MODELS:
            raise ValueError(
                f"model = {self.model!r} is invalid: allowed models are {list(MODELS)}"
            )
        if self.service not in SERVICES:
            raise ValueError(
                f"service = {self.service!r} is invalid: allowed services are {list(SERVICES)}"
            )
        if self.model == "fluid" and self.service != "markov":
            raise ValueError(
                f"service = {self.service!r} is invalid with model = 'fluid': the service kind "
                "is the request-level cells' (model 'requests')"
            )
        object.__setattr__(self, "scale", integer("scale", self.scale, 1))
        number("probe_smoothing", self.probe_smoothing, lo=0.0)
        if self.leaf not in LEAVES:
            raise ValueError(f"leaf = {self.leaf!r} is invalid: allowed rules are {list(LEAVES)}")
        object.__setattr__(self, "pod_d", integer("pod_d", self.pod_d, 1))
        twin = {f: getattr(self, f) for f, v in _TWIN_DEFAULTS.items() if getattr(self, f) != v}
        if self.model == "fluid" and twin:
            name = next(iter(twin))
            raise ValueError(
                f"{name} = {twin[name]!r} is invalid with model = 'fluid': it sets the "
                "request-level twin (model 'requests')"
            )
        self._check_estimation()
        if self.leaf != "jsq" and self.service != "servers":
            raise ValueError(
                f"leaf = {self.leaf!r} is invalid with service = {self.service!r}: leaf rules "
                "choose among a cell's servers (service 'servers')"
            )
        if self.experiment == "recovery" and (
            self.model != "requests" or self.service != "servers" or self.estimation != "oracle"
        ):
            raise ValueError(
                "experiment = 'recovery' is invalid with "
                f"model = {self.model!r}, service = {self.service!r}, estimation = "
                f"{self.estimation!r}: it runs at request level in servers cells (model "
                "'requests', service 'servers'), its variants setting the estimation"
            )
        if self.experiment == "affinity" and (
            self.model != "requests" or self.service != "servers"
        ):
            raise ValueError(
                f"experiment = 'affinity' is invalid with model = {self.model!r}, service = "
                f"{self.service!r}: sessions and prefix caches run at request level in servers "
                "cells (model 'requests', service 'servers')"
            )
        if self.model == "requests" and self.experiment not in REQUEST_KINDS:
            raise ValueError(
                f"model = 'requests' is invalid for experiment = {self.experiment!r}: "
                f"allowed experiments are {list(REQUEST_KINDS)}"
            )
        pols = tuple(self.policies)
        for p in pols:
            if p not in _REGISTRY:
                raise ValueError(
                    f"policies: {p!r} is invalid: allowed policies are {list(_REGISTRY.names())}"
                )
        if "rand" not in pols:
            raise ValueError(
                f"policies = {list(pols)} is invalid: 'rand' is required (latencies are "
                "normalised by Rand's)"
            )
        if len(set(pols)) != len(pols):
            raise ValueError(f"policies = {list(pols)} is invalid: duplicates")
        object.__setattr__(self, "policies", pols)

    def _check_estimation(self) -> None:
        if self.estimation not in ESTIMATION_MODES:
            raise ValueError(
                f"estimation = {self.estimation!r} is invalid: allowed {list(ESTIMATION_MODES)}"
            )
        if self.estimation == "oracle":
            for f in _ESTIMATION_FIELDS:
                if getattr(self, f) != _TWIN_DEFAULTS[f]:
                    raise ValueError(
                        f"{f} = {getattr(self, f)!r} is invalid with estimation = 'oracle': "
                        "it sets online estimation"
                    )
        elif self.service != "servers":
            raise ValueError(
                f"estimation = 'online' is invalid with service = {self.service!r}: markov "
                "cells do not fix a request's latency at its admission (service 'servers')"
            )
        for _, opts in self.run_variants():
            # (the configuration's online estimation, or a recovery variant's)
            if self.estimation == "oracle" and "estimation" not in opts:
                continue
            mit = self.mitigations(opts.get("estimation"))
            try:
                check_estimation(self.refit_period, self.estimation_window, **mit)
            except ValueError as e:
                raise ValueError(str(e).replace("window =", "estimation_window =", 1)) from None
            h = opts.get("tick", self.tick)
            period_ticks(self.refit_period, h, "refit_period")
            if mit["probing"] > 0:
                period_ticks(mit["probing"], h, "probing")

    def mitigations(self, variant: dict | None = None) -> dict:
        """`{"probing", "shrinkage", "dithering"}` of an online run: the configuration's,
        or those a variant's `estimation` options set (the `recovery` kind's; the others
        0)."""
        if variant is None:
            return {f: getattr(self, f) for f in ("probing", "shrinkage", "dithering")}
        return {"probing": 0.0, "shrinkage": 0.0, "dithering": 0.0, **variant}

    def run_variants(self) -> list[tuple[str, dict]]:
        """The `(label, options)` variants this configuration runs: the kind's
        (`variants`), or the chosen subset of them in the kind's order."""
        vs = variants(self.experiment)
        return vs if self.variants is None else [v for v in vs if v[0] in self.variants]

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["policies"] = list(self.policies)
        if self.variants is None:
            del d["variants"]  # (every variant: the fingerprint recorded before the option)
        else:
            d["variants"] = list(self.variants)
        if self.model == "fluid":
            del d["model"], d["service"]  # (the fingerprint of a fluid run, unchanged)
        for f, v in _TWIN_DEFAULTS.items():
            if d[f] == v:
                del d[f]  # (the fingerprint recorded before the option)
        if self.leaf != "pod":
            d.pop("pod_d", None)
        return d


_TWIN_DEFAULTS = {
    f.name: f.default
    for f in dataclasses.fields(ExperimentConfig)
    if f.name in ("scale", "probe_smoothing", "leaf", "pod_d", "estimation", "refit_period",
                  "estimation_window", "probing", "shrinkage", "dithering")
}  # fmt: skip
"""The request-level options of `ExperimentConfig` and their defaults (the fields')."""

_ESTIMATION_FIELDS = ("refit_period", "estimation_window", "probing", "shrinkage", "dithering")
"""The fields that set online estimation (refused with `estimation = "oracle"`)."""


def _chosen_variants(kind: str, vs: list[tuple[str, dict]], chosen) -> tuple[str, ...]:
    """`chosen` checked against the kind's labels and put in the kind's order; a refusal
    names the field, the value and the labels allowed."""
    labels = [label for label, _ in vs]
    if isinstance(chosen, str) or not all(isinstance(c, str) for c in chosen):
        raise ValueError(
            f"variants = {chosen!r} is invalid: expected a list of labels of {kind}'s "
            f"variants {labels}"
        )
    chosen = list(chosen)
    if not chosen:
        raise ValueError(f"variants = [] is invalid: expected at least one of {labels}")
    for c in chosen:
        if c not in labels:
            raise ValueError(f"variants: {c!r} is invalid: allowed variants of {kind} are {labels}")
    dup = sorted({c for c in chosen if chosen.count(c) > 1})
    if dup:
        raise ValueError(f"variants = {chosen} is invalid: {dup} named twice; expected each once")
    return tuple(label for label in labels if label in chosen)
