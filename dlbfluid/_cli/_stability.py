"""`dlbfluid stability SCENARIO --policy {flow-grad,flow-lat,flow-rif} [--json]`."""

from __future__ import annotations

import math
import sys

from ._common import emit_json, integer, load_scenario_arg, positive_float


def register(sub) -> None:
    from .._defaults import FLOW_POLICIES
    from .._defaults import STABILITY_METHODS as METHODS
    from .._defaults import STABILITY_NODES as DEFAULT_NODES
    from .._registry import flow_policy_names

    # names only (no JAX): the built-in flow policies, then any other registered ones
    flows = list(FLOW_POLICIES) + [p for p in flow_policy_names() if p not in FLOW_POLICIES]

    p = sub.add_parser(
        "stability",
        help="critical flow-routing step size from the linearised delay equation",
        description="Linearise the delayed fluid model around the equilibrium of the "
        "policy's cost and report the critical step size eta* at which flow routing "
        "loses local stability (a pair of characteristic roots crosses the imaginary "
        "axis). The step size uses the convention of `dlbfluid simulate --step-size`: "
        "x <- Proj(x - eta*h*c). SCENARIO is a JSON scenario file, or 'default'.",
    )
    p.add_argument("scenario", metavar="SCENARIO", help="scenario JSON file, or 'default'")
    p.add_argument(
        "--policy",
        choices=flows,
        default="flow-grad",
        help="flow-routing policy (default flow-grad)",
    )
    p.add_argument(
        "--method",
        choices=METHODS,
        default="auto",
        help="symmetric: closed form for one origin and two identical cells; "
        "pseudospectral: Chebyshev collocation of the delay equation (small networks); "
        "nyquist: the argument principle on the n x n cell characteristic matrix (large "
        "networks); auto: the closed form when it applies, else pseudospectral up to a "
        "600-row generator, else nyquist (default)",
    )
    p.add_argument(
        "--nodes",
        type=integer("nodes"),
        default=DEFAULT_NODES,
        help=f"Chebyshev nodes of the pseudospectral method (default {DEFAULT_NODES})",
    )
    p.add_argument(
        "--tau-scale",
        type=positive_float("tau-scale"),
        default=1.0,
        help="multiply every network latency by this factor first (default 1)",
    )
    p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="never show progress (shown on stderr on a terminal or above 20 cells)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from .._stability import critical_step_size

    if args.nodes < 2:
        raise ValueError(f"--nodes = {args.nodes} is invalid: expected an integer >= 2")
    scn = load_scenario_arg(args.scenario, command="stability")
    show = not args.no_progress and (sys.stderr.isatty() or scn.n_cells > 20)
    # --method is a name of `dlbfluid._stability.METHODS`; `critical_step_size` maps it to
    # its method object (with --nodes), as it does for every caller that passes a name
    res = critical_step_size(
        scn,
        args.policy,
        method=args.method,
        nodes=args.nodes,
        tau_scale=args.tau_scale,
        progress=show,
    )
    summary = res.summary()
    summary["scenario"] = scn.name
    summary["cells"] = list(scn.cell_names)
    if args.json:
        emit_json(summary)
        return 0
    names = list(scn.cell_names) or [f"cell{j}" for j in range(len(res.N))]
    eta = res.critical_step_size
    print(f"scenario {scn.name!r}, policy {res.policy}, method {res.method}")
    print("equilibrium N*: " + ", ".join(f"{n}={v:.6g}" for n, v in zip(names, res.N)))
    lin = res.linearisation
    print(
        f"linearisation: {lin.dim} states, {len(lin.sources)} routing source(s), delays "
        f"{[round(float(d), 6) for d in lin.delays]}"
    )
    if math.isinf(eta):
        print("critical step size: none (stable for every step size)")
    elif eta == 0:
        print("critical step size: 0 (unstable for every step size)")
    else:
        s = res.rightmost_root
        print(f"critical step size eta* = {eta:.10g}")
        print(
            f"rightmost root at eta*: {s.real:.3g} {'+' if s.imag >= 0 else '-'} "
            f"{abs(s.imag):.10g}i; oscillation period 2*pi/omega = {res.period:.6g} s"
        )
    return 0
