"""The critical step size of one scenario (theory/stability.md §2-§3.8): the driver that
linearises, picks the method object (`methods.py`) and reports, and the plausibility check
of a step size (`step_size_ratio`).
"""

from __future__ import annotations

import math

from .._defaults import STABILITY_NODES as DEFAULT_NODES
from .._equilibrium import solve_equilibrium
from .._scenario import Scenario
from .._validate import number
from .base import NO_ROOT, AbstractStabilityMethod
from .linearisation import _flow_policy, linearise
from .methods import Auto, stability_method
from .pseudospectral import Pseudospectral
from .search import StabilityResult, result, say
from .symmetric import symmetric_parameters


def critical_step_size(
    scenario: Scenario,
    policy,
    *,
    method: str | AbstractStabilityMethod = "auto",
    nodes: int = DEFAULT_NODES,
    tau_scale: float = 1.0,
    step_weights=None,
    equilibrium=None,
    rtol: float = 1e-13,
    progress: bool = False,
    time: float = 0.0,
) -> StabilityResult:
    """The step size $\\eta^*$ at which flow routing loses local stability.

    Below $\\eta^*$ every root of $\\det\\Delta(s) = 0$, $\\Delta(s) = sI - \\sum_k(P_k +
    \\eta R_k)e^{-s\\theta_k}$ (`linearise`) lies in the open left half-plane; at $\\eta^*$ a pair
    $\\pm i\\omega_c$ reaches the axis (theory/stability.md §2-§3). The step-size convention is
    that of `simulate(step_size=...)`: the router update is $x \\leftarrow \\Pi(x - \\eta h\\hat c)$,
    whose $h \\to 0$ limit is $\\dot x_i = \\Pi_T(-\\eta_i \\hat c_i)$.

    **Arguments:**
    - `scenario`: one unbatched `Scenario`.
    - `policy`: `"flow-grad"`, `"flow-lat"`, `"flow-rif"` or a `FlowRouting`.
    - `method`: a member of `AbstractStabilityMethod` or its name (`METHODS`):
      `"symmetric"` (`Symmetric`: closed form of theory/stability.md §2; needs one origin
      routing between two identical cells over equal delays), `"pseudospectral"`
      (`Pseudospectral`: any network; a dense eigenproblem of size $(M+1)d$ per test),
      `"nyquist"` (`Nyquist`: any network; the argument principle on the $n \\times n$
      cell characteristic matrix, §3.6), or `"auto"` (`Auto`: the closed form when the
      structure allows it, else the pseudospectral method up to $(M+1)d \\le 600$, else
      `"nyquist"`). The result's `method` is the one actually used.
    - `nodes`: Chebyshev nodes $M$ of the pseudospectral discretisation (for a `method`
      given by name; an object carries its own).
    - `tau_scale`, `step_weights`, `equilibrium`: as in `linearise`.
    - `rtol`: relative tolerance of the bisection in $\\eta$.
    - `progress`: report the stages and the stability tests on stderr.
    - `time`: arrival rates $\\lambda_i(\\texttt{time})$ (as in `linearise`).

    **Returns:** a `StabilityResult`.

    **Raises:** `ValueError` naming the field for a discrete/random policy, an unknown
    method, `method="symmetric"` on a network without the symmetric structure, bad
    `nodes`; `RuntimeError` where `"nyquist"` cannot resolve the characteristic loci
    (cells at saturation with the crossing at a large step size, §3.6).
    """
    pol = _flow_policy(policy)
    meth = stability_method(method, nodes)
    if equilibrium is None and progress:
        say(f"stability: solving the {pol.cost.name} equilibrium ({scenario.n_cells} cells)")
    lin = linearise(
        scenario,
        pol,
        tau_scale=tau_scale,
        step_weights=step_weights,
        equilibrium=equilibrium,
        time=time,
    )
    sym = symmetric_parameters(lin) if step_weights is None else None
    meth.check(lin, sym)
    if not lin.sources:
        # No routing freedom at equilibrium: the step size does not enter the linearisation.
        label, used = meth.no_crossing()
        used = nodes if isinstance(method, str) else used  # a name: the nodes asked for
        return result(lin, pol, math.inf, label, NO_ROOT, used, tau_scale)
    eta, root, label, used = meth.solve(lin, sym, rtol=rtol, progress=progress)
    return result(lin, pol, eta, label, root, used, tau_scale)


def step_size_ratio(
    scenario: Scenario, policy, step_size: float, *, equilibrium=None, time: float = 0.0
) -> dict:
    """How many times the critical step size a flow-routing step size is: the plausibility
    check of `simulate` (a step size far beyond $\\eta^*$ gives an oscillating run).

    $X = \\eta/\\eta^*$ with $\\eta^*$ the exact critical step size of the linearised delay
    equation (`critical_step_size(..., method=Auto(), rtol=1e-6)`, theory/stability.md
    §3.8), at the equilibrium of the policy's cost: the method that `critical_step_size`
    and `dlbfluid stability` use by default, so that `simulate`'s step-size check and
    `stability` report the same `method` for the same scenario. Accuracy: $\\eta^*$ to $10^{-6}$
    relative for the continuous-time model ($h \\to 0$); the tick model with
    $\\eta h \\ll 1$ changes stability within a few per cent of it (§4). It says nothing
    about $X < 1$ beyond local stability.

    **Cost:** one `solve_equilibrium` (a compile of about 12 s on first use per cost and
    cell bucket, cached by the command line's persistent compilation cache; milliseconds
    when `equilibrium` is given), one compiled call for the slopes, then NumPy: about
    0.2 s for 4 cells, 1 s for 25, 20-60 s for 200 (dense $n \\times n$ eigenvalues on a
    few hundred frequencies).

    **Arguments:** `scenario` (one unbatched `Scenario`), `policy` (a flow policy: a name of
    `_flow_names()` or a `FlowRouting`), `step_size` $\\eta > 0$ (the `simulate` convention),
    `equilibrium` (a precomputed `EquilibriumSolution` of the policy's cost), `time` (the
    arrival rates of the equilibrium).

    **Returns:** `{"step_size": eta, "critical_step_size": eta* (None when stable for every
    step size), "ratio": eta/eta* (0.0 then), "method": the method actually used
    (`"symmetric"`, `"pseudospectral"` or `"nyquist"`; `"pseudospectral"` also where
    `"nyquist"` was chosen but rounding hides the characteristic loci, `Loci.count`)}`.

    **Raises:** `ValueError` for a policy without a step size (discrete, random, MNLB) or a
    bad `step_size`; `OverloadError` when the demand has no equilibrium within capacity.
    """
    pol = _flow_policy(policy)
    eta = number("step_size", step_size, lo=0, lo_open=True)
    if equilibrium is None:
        equilibrium = solve_equilibrium(scenario, pol.cost, time=time)
    kw = dict(equilibrium=equilibrium, rtol=1e-6, time=time)
    auto = Auto()
    try:
        res = critical_step_size(scenario, pol, method=auto, **kw)
    except RuntimeError:
        # `Auto` chose the argument principle (a large network) and rounding hides the loci
        # (cells at saturation): the pseudospectral method, if its generator is not too large
        lin = linearise(scenario, pol, equilibrium=equilibrium, time=time)
        if (auto.nodes + 1) * lin.dim > 10 * auto.pseudospectral_size:
            raise
        res = critical_step_size(scenario, pol, method=Pseudospectral(auto.nodes), **kw)
    star = res.critical_step_size
    return {
        "step_size": eta,
        "critical_step_size": star if math.isfinite(star) else None,
        "ratio": eta / star if math.isfinite(star) else 0.0,
        "method": res.method,
    }
