"""Contracts every registered policy keeps (parametrised over the registry, as optax tests
its optimisers): exact mass balance, a padded batch equal to each scenario alone, no new
trace for new values, a numerical failure reported as one scenario's status, and agreement
with the independent scipy reference (`reference.py`, which implements every built-in
policy, MNLB's linear program included): every policy on the default path in its contract
run, the adaptive integrator on a flow and a discrete policy."""

import functools

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import THREE, two_mm1
from reference import POLICIES as REFERENCE_POLICIES
from reference import reference_simulate

import dlbfluid as dl
import dlbfluid._simulate as sim

H = 0.05
REGISTERED = dl.POLICIES.names()


@functools.cache
def _reference(policy, horizon):
    """The scipy method of steps on THREE at step 0.3 (computed once per policy)."""
    return reference_simulate(THREE, policy, step_size=0.3, tick=H, horizon=horizon)


def test_reference_covers_every_builtin_policy():
    assert set(dl.POLICY_NAMES) <= set(REFERENCE_POLICIES)
    assert set(dl.POLICY_NAMES) <= set(REGISTERED)


def _scenarios():
    good = dl.scenario_from_dict(THREE)
    other = dl.scenario_from_dict(two_mm1(tau=0.07))
    # A NaN base latency (validation bypassed) poisons the first cell's rate from t = 0.
    bad = eqx.tree_at(lambda s: s.service.base_latency, good, jnp.array([jnp.nan, 0.6, 1.0]))
    return good, other, bad


@pytest.mark.parametrize("policy", REGISTERED)
def test_policy_contract(policy):
    """One compiled shape per policy (3 scenarios of 3 cells, 2 s, 40 ticks):

    * mass balance: arrivals at the roots minus departures = change of workload plus
      change of in-flight mass, to 1e-9, with N >= 0 and routing rows on their simplices;
    * batch equals loop: each scenario's row of the mixed batch equals its row in a batch
      of copies of itself (to 1e-12): no cross-talk between scenarios, padding inert;
    * no retrace: the second and third calls (new values, same shapes) trace nothing;
    * failure as status: the poisoned scenario ends `nonfinite` with finite, frozen values
      while the other two end `success`;
    * built-in policies: the 3-cell row against the scipy reference (`reference.py`, method
      of steps, DOP853 at 1e-12) on the default path: N and departures to 5e-4, x and
      arrivals to 1e-5 (observed at most 1.3e-4 and 1.2e-6), while Rand's reference (Flow-RIF's
      for Rand) is at least 5e-2 away in N (observed >= 8e-2; a 5% step error moves
      Flow-RIF by 3.8e-3)."""
    good, other, bad = _scenarios()
    kw = dict(step_size=0.3, tick=H, horizon=2.0, n_save=40)
    laws = ("mm1", "softplus")  # (the models present are static: keep one set)
    mixed = dl.simulate(dl.stack_scenarios([good, other, bad], laws=laws), policy, **kw)
    # (`simulate_program` counts its traces, `eqx.debug.assert_max_traces`; the counter's
    # positive control: test_simulate.py::test_n_save_is_bucketed_and_the_trace_counter_fires)
    before = eqx.debug.get_num_traces(sim.simulate_program)
    alone = [
        dl.simulate(dl.stack_scenarios([s, s, s], n_cells=3, laws=laws), policy, **kw)
        for s in (good, other)
    ]
    assert eqx.debug.get_num_traces(sim.simulate_program) == before
    assert mixed.status_names().tolist() == ["success", "success", "nonfinite"]
    assert np.all(np.isfinite(np.asarray(mixed.N)))
    for b, one in enumerate(alone):
        for field in ("N", "x", "departures", "workload_integral", "in_flight"):
            np.testing.assert_allclose(
                np.asarray(getattr(mixed, field)[b]), np.asarray(getattr(one, field)[0]), atol=1e-12
            )
    src = np.asarray(mixed.source_arrivals)[:2].sum(-1)
    dep = np.asarray(mixed.departures)[:2].sum(-1)
    N = np.asarray(mixed.N)[:2]
    flight = np.asarray(mixed.in_flight)[:2]
    rhs = (N.sum(-1) - N[:, :1].sum(-1)) + (flight - flight[:, :1])
    assert np.max(np.abs(src - dep - rhs)) <= 1e-9
    assert np.all(N >= 0)
    x = np.asarray(mixed.x)[:2]
    np.testing.assert_allclose(x.sum(-1)[:, :, :2], 1.0, atol=1e-12)  # both real origins
    assert np.all(x >= 0)
    if policy in REFERENCE_POLICIES:
        ref = _reference(policy, 2.0)
        np.testing.assert_allclose(np.asarray(mixed.N[0]), ref["N"], rtol=0, atol=5e-4)
        np.testing.assert_allclose(np.asarray(mixed.departures[0]), ref["departures"], rtol=0,
                                   atol=5e-4)  # fmt: skip
        np.testing.assert_allclose(np.asarray(mixed.x[0]), ref["x"], rtol=0, atol=1e-5)
        np.testing.assert_allclose(np.asarray(mixed.arrivals[0]), ref["arrivals"], rtol=0,
                                   atol=1e-5)  # fmt: skip
        control = _reference("flow-rif" if policy == "rand" else "rand", 2.0)
        assert np.max(np.abs(np.asarray(mixed.N[0]) - control["N"])) > 5e-2


# (one flow and one discrete policy: the adaptive integrator is the same for every policy
# and compiles once per policy; every built-in policy meets the reference in its contract)
@pytest.mark.parametrize("policy", ["flow-grad", "disc-lat"])
def test_accurate_path_matches_scipy_reference(policy):
    """A flow and a discrete policy through the accurate path against the scipy method of
    steps on 3 cells with unequal, non-tick-aligned delays: max error <= 1e-6 in N and x,
    and in the cumulative arrivals and departures (observed ~1e-11)."""
    T = 10.0
    ref = _reference(policy, T)
    sol = dl.simulate(
        dl.scenario_from_dict(THREE), policy, step_size=0.3, tick=H, horizon=T, n_save=200,
        integrator=dl.Accurate(rtol=1e-10, atol=1e-12),
    )  # fmt: skip
    assert np.max(np.abs(np.asarray(sol.N) - ref["N"])) <= 1e-6
    assert np.max(np.abs(np.asarray(sol.x) - ref["x"])) <= 1e-6
    np.testing.assert_allclose(sol.departures, ref["departures"], atol=1e-6)
    np.testing.assert_allclose(sol.arrivals, ref["arrivals"], atol=1e-6)
