"""A service model of your own: M/M/1 behind a fixed processing delay.

$\\ell(N) = D + (1+N)/\\bar\\mu$: every request first spends $D$ seconds in a stage that
never queues (tokenisation, a cold model shard), then queues in an M/M/1 server of
capacity $\\bar\\mu$. $\\mu(N) = N/\\ell(N)$ is increasing, concave and bounded by $\\bar\\mu$
(Assumption 1). Only `latency` is written here: the rate, its derivative, the gradient
cost, the inverse, the flow balance and the potentials all come from the base class by
automatic differentiation, bisection-Newton and quadrature.

Registered once, scenario files accept `{"model": "mm1-delay", "capacity": ..., "delay":
...}`, and `simulate`, `solve_equilibrium`, `critical_step_size` and `verify` (with its
`draw` hook) handle such cells, also mixed with the built-in models. Run this file:
`python examples/custom_service_model.py`.
"""

import numpy as np

import dlbfluid as dl

dl.enable_x64()  # float64, the verbs' default (importing dlbfluid leaves JAX as it is)


class MM1Delay(dl.AbstractServiceModel):
    """$\\ell(N) = D + (1 + N)/\\bar\\mu$; parameters `capacity` $\\bar\\mu$, `delay` $D$."""

    name = "mm1-delay"
    parameters = ("capacity", "delay")
    defaults = {"capacity": 1.0, "delay": 0.1}

    def latency(self, p, N):
        return p["delay"] + (1.0 + N) / p["capacity"]


def scenario(lam=(1.2, 0.4, 0.8), tau=0.03) -> dict:
    cells = [
        {"name": "a", "arrival_rate": lam[0], "replicas": 3,
         "service": {"model": "mm1-delay", "capacity": 3.0, "delay": 0.2}},
        {"name": "b", "arrival_rate": lam[1], "replicas": 2,
         "service": {"model": "mm1-delay", "capacity": 2.0, "delay": 0.05}},
        {"name": "c", "arrival_rate": lam[2], "replicas": 2,
         "service": {"model": "softplus", "base_latency": 0.5, "capacity": 2.5, "knee": 0.5,
                     "width": 0.5}},
    ]  # fmt: skip
    latency = [[0.0, tau, 2 * tau], [tau, 0.0, tau], [2 * tau, tau, 0.0]]
    return {"name": "mm1-delay-demo", "cells": cells, "latency": latency}


def draw(seed: int, index: int) -> dict:
    """`verify`'s scenario source: scenario `index` of stream `seed`."""
    rng = np.random.default_rng([seed, index])
    return scenario(lam=tuple(rng.uniform(0.3, 1.2, 3)), tau=float(rng.uniform(0.01, 0.1)))


def main(small: bool = True) -> dict:
    if "mm1-delay" not in dl.SERVICE_MODELS:
        dl.register_service_model(MM1Delay())

    scn = dl.scenario_from_dict(scenario())
    # (small: one cost, one compiled solver; the gradient cost uses the derived 1/mu')
    equilibria = {}
    for cost in ("gradient",) if small else ("rif", "latency", "gradient"):
        eq = equilibria[cost] = dl.solve_equilibrium(scn, cost)
        print(f"{cost:>8}: N* = {np.round(np.asarray(eq.N), 4)}, KKT {float(eq.kkt_residual):.1e}")
    sol = dl.simulate(scn, "flow-grad", step_size=0.2, tick=0.05, horizon=50.0, n_save=10)
    print(f"flow-grad mean latency {float(sol.mean_latency()):.4f} s, status {sol.status_names()}")
    eta = dl.critical_step_size(scn, "flow-grad").critical_step_size
    print(f"critical step size of flow-grad: {eta:.4g}")
    res = None
    if not small:  # (the test suite runs verify with a user's extension in custom_cost.py)
        res = dl.verify(2, 0, chunk=2, horizon=200.0, tick=0.1, draw=draw, policies=("flow-grad",))
        print("verify:", {k: v["failed"] for k, v in res["policies"].items()}, "failed")
    return {"equilibria": equilibria, "simulate": sol, "critical_step_size": eta, "verify": res}


if __name__ == "__main__":
    main()
