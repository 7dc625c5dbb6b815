"""A routing policy of your own: logit ("softmin") routing on the latency cost.

Each root router spreads its flow over the allowed cells with weights
$x_{ij} \\propto \\exp(-(\\hat c_{ij} - \\min_l \\hat c_{il})/T)$: a smoothed discrete routing
that still sends most traffic to the cheapest cell but never all of it. It is a stateless
rule on observed route costs, so it subclasses `AbstractCostPolicy` and defines `route`.

Registered once, the policy runs by name in `simulate`, `run_experiment` and the command
line of the same process. Run this file: `python examples/custom_policy.py`.
"""

import tempfile

import jax.numpy as jnp

import dlbfluid as dl

dl.enable_x64()  # float64, the verbs' default (importing dlbfluid leaves JAX as it is)


class SoftminRouting(dl.AbstractCostPolicy):
    """Logit routing with temperature `temperature` (seconds of cost)."""

    cost: dl.AbstractCost = dl.Latency()
    temperature: float = 0.2

    @property
    def name(self) -> str:
        return "softmin-lat"

    def route(self, x, costs, step, allowed):
        c = jnp.where(allowed, costs, jnp.inf)
        best = jnp.min(c, axis=-1, keepdims=True)
        w = jnp.where(allowed, jnp.exp(-(c - best) / self.temperature), 0.0)
        return w / jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), 1e-300)


def main(small: bool = True) -> dict:
    if "softmin-lat" not in dl.POLICIES:
        dl.register_policy("softmin-lat", SoftminRouting)

    scn = dl.default_scenario()
    sol = dl.simulate(scn, "softmin-lat", tick=0.05, horizon=20.0, n_save=20)
    ref = dl.simulate(scn, "disc-lat", tick=0.05, horizon=20.0, n_save=20)
    print(
        f"softmin-lat: mean latency {float(sol.mean_latency()):.4f} s, status {sol.status_names()}"
    )
    print(f"disc-lat:    mean latency {float(ref.mean_latency()):.4f} s")

    cfg = dl.ExperimentConfig(
        "baseline",
        scenarios=2,
        trials=1,
        horizon=10.0 if small else 600.0,
        tick=0.05,
        # (small: Rand, the reference, and the new policy: one compilation each)
        policies=("rand", "softmin-lat") if small else ("rand", "disc-lat", "softmin-lat"),
    )
    with tempfile.TemporaryDirectory() as out:
        res = dl.run_experiment(cfg, out)
    for row in res["summary"]:
        print(f"  {row['policy']:<12} latency / Rand's {row['normalized_latency']:.4f}")
    return {"simulate": sol, "experiment": res}


if __name__ == "__main__":
    main()
