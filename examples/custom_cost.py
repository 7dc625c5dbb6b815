"""A cost family of your own: the drain time $N_j/\\bar\\mu_j$ plus the round trip.

$f_j(N) = N/\\bar\\mu_j$ is the time cell $j$ needs to serve its backlog at full speed; with
$g_{ij} = 2\\tau_{ij}$ (the default `arc`) the cost is increasing, unbounded and slowly
varying (Assumption 3), so its equilibria are the minimisers of
$\\sum_j p_j(z_j) + \\sum_{ij} 2\\tau_{ij}\\lambda_ix_{ij}$ with
$p_j = \\int_0^{N_j} (n/\\bar\\mu_j)\\mu_j'(n)\\,dn$, here in closed form through the service
models' `rif_potential` (without it the default quadrature would serve).

`register_cost` also registers its policies `disc-drain` and `flow-drain`, which then run
in `simulate`, `run_experiment` and `verify`; `solve_equilibrium(scn, "drain")` solves its
equilibria with a KKT certificate. Run this file: `python examples/custom_cost.py`.
"""

import jax.numpy as jnp
import numpy as np

import dlbfluid as dl

dl.enable_x64()  # float64, the verbs' default (importing dlbfluid leaves JAX as it is)


class Drain(dl.AbstractCost):
    """$f_j(N) = N/\\bar\\mu_j$, $g_{ij} = 2\\tau_{ij}$."""

    name = "drain"
    short = "drain"

    # `N` may carry leading axes (one row per router): broadcast the per-cell capacity
    # explicitly.
    def destination(self, scn, N):
        return N / jnp.broadcast_to(scn.service.capacity, N.shape)

    def potential(self, scn, z, N):
        return scn.service.rif_potential(z, N) / jnp.broadcast_to(scn.service.capacity, N.shape)


def main(small: bool = True) -> dict:
    if "drain" not in dl.COSTS:
        dl.register_cost(Drain())

    scn = dl.default_scenario()
    eq = dl.solve_equilibrium(scn, "drain")
    print(
        f"drain equilibrium N* = {np.round(np.asarray(eq.N), 4)}, KKT {float(eq.kkt_residual):.1e}"
    )
    eta_star = dl.critical_step_size(scn, "flow-drain").critical_step_size
    sol = dl.simulate(
        scn, "flow-drain", step_size=0.3 * eta_star, tick=0.05, horizon=200.0, n_save=20
    )
    gap = float(np.max(np.abs(np.asarray(sol.N[-1]) - np.asarray(eq.N))))
    print(
        f"flow-drain at 0.3 eta* = {0.3 * eta_star:.4g}, after 200 s: |N(T) - N*|_inf = {gap:.2e}"
    )

    res = dl.verify(
        2, 0, chunk=2, n_cells=(2, 3), horizon=10.0 if small else 200.0, tick=0.1,
        policies=("flow-drain",),
    )  # fmt: skip
    print("verify:", {k: v["failed"] for k, v in res["policies"].items()}, "failed")
    return {"equilibrium": eq, "simulate": sol, "verify": res}


if __name__ == "__main__":
    main()
