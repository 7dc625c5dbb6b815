"""The paper's settings that several verbs share, in one place (jax-free).

`PROBE_TICK`: the tick $h$ of the simulator is at once the routers' probe period, the
period of their routing updates and the time a discrete decision is held (theory/
evaluation.md, *Why the tick matters*). The seed's root routers "probe at a pre-specified
frequency (e.g., once every few milliseconds)" (§3.1, *Probe client*); 5 ms is the default
of `simulate`, `demo`, `experiment` and `verify`, on the command line and in Python. It is
shorter than every feedback delay of the App.-B network but the self-arcs (2.5-86 ms one
way), and the tick sweep (`dlbfluid experiment tick`) shows every policy's latency settled
by then.
"""

PROBE_TICK = 0.005
"""Default tick $h$ in seconds (probe, routing-update and decision-hold period)."""

SIMULATE_HORIZON = 400.0
"""Default `--horizon` of `dlbfluid simulate` and `dlbfluid demo` (s). On the built-in scenario
flow-grad at the default step size swings by 1.92 over the last quarter of a 100-s run (a
transient still decaying), 0.18 at 200 s and 0.006 at 400 s, where its workloads sit within
0.007 of the equilibrium's (the tick's own offset) and its mean latency, 1.6113 s, is the
social optimum's 1.6105 s to 0.05%. The 300 s more cost about 4 s warm."""

STABILITY_METHODS = ("auto", "symmetric", "pseudospectral", "nyquist")
"""Methods of `critical_step_size` (theory/stability.md §2, §3, §3.6)."""
STABILITY_NODES = 16
"""Default Chebyshev nodes of the pseudospectral method (theory/stability.md §3.2)."""
FLOW_POLICIES = ("flow-grad", "flow-lat", "flow-rif")
"""The built-in flow policies (`dlbfluid._registry.flow_policy_names` lists all)."""
VERIFY_GENERATORS = ("random", "appb")
"""Scenario streams of `verify` (`draw_random`, `draw_appb`)."""
STEP_RULES = ("paper", "oracle")
"""How flow routers set their step sizes, in `experiment` and `verify`: the paper's
$\\kappa_c/\\bar\\tau_i$ (theory/evaluation.md), or a fraction of each scenario's $\\eta^*$."""
VERIFY_LADDERS = ("none", "full")
"""Theorem-1 ladders of `verify`: the certificate alone, or the fitted bound too
(`dlbfluid._theorem1`)."""
ESTIMATION_MODES = ("oracle", "online")
"""The routers' latency models at request level (`simulate_requests(estimation=...)`,
`--estimation`): the scenario's, fixed, or refitted in the loop."""

MITIGATION_FIELDS = {"background-probing": "probing", "shrinkage": "shrinkage",
                     "dithering": "dithering"}  # fmt: skip
"""The mitigations of online estimation by name (`--mitigation NAME`, the `recovery`
experiment's variants) and the field that sets each (`OnlineEstimation`,
`ExperimentConfig`)."""

MITIGATION_DEFAULTS = {"background-probing": 1.0, "shrinkage": 64.0, "dithering": 0.1}
"""A mitigation of online estimation named without a value (`--mitigation NAME`, the
`recovery` experiment's variants): a probe per cell every second, a prior worth 64
samples, log-normal noise of sigma 0.1 on the published latency. The recovery record
(docs/results.md, *Recovery after a slowdown*; 50 runs a variant) measured them: the
probes end starvation at no latency cost, the prior ends most of it, and this dithering
does not."""

DURATION_SCALES = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 10.0)
"""The duration scalings $y$ of seed App. B.2 (token time / y, arrival rate x y), of the
generator and of the `duration` experiment kind."""

STEP_BASES = ("eta-star", "eta0")
"""What `verify`'s step fraction multiplies: the linear critical step $\\eta^*$, or the proof's
$\\eta_0$ (a run at a fraction $\\le 1$ of it is inside Theorem 1's hypothesis)."""

AFFINITY_MODES = ("off", "sticky", "conditional")
"""Session affinity at request level (`simulate_requests(affinity=...)`, `--affinity`;
theory/affinity.md): none (every request routed by the policy), sticky (a session's
requests follow its first), or the paper's conditional rule."""
