"""The delayed fluid simulator against independent references (issue: core §7).

Tolerances are stated per test; `reference.py` is an independent float64 scipy
method-of-steps implementation of the same tick model.
"""

import diffrax as dfx
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    LAWS,
    THREE,
    random_scenario,
    square_root_rule,
    symmetric_pair,
    two_mm1,
    wardrop_two,
)
from reference import reference_simulate

import dlbfluid as dl
import dlbfluid._simulate as sim

H, T = 0.05, 10.0
ACC = dl.Accurate(rtol=1e-10, atol=1e-12)
# The standard shapes (compiled once, shared by the tests below and test_contracts.py): THREE
# alone (unbatched) or in a batch of 3 three-cell scenarios, Fast(), 33-64 saves (N_SAVE)
# and a tick of 0.05 or 0.1 (four ring slots either way).
N_SAVE = 40


def traces() -> int:
    """How many programs `simulate` has traced in this process (`simulate_program` is
    wrapped in `eqx.debug.assert_max_traces`; the positive control:
    `test_n_save_is_bucketed_and_the_trace_counter_fires`)."""
    return eqx.debug.get_num_traces(sim.simulate_program)


@pytest.fixture(scope="module")
def three():
    return dl.scenario_from_dict(THREE)


# The accurate path against the scipy reference, for every registered policy: in
# test_contracts.py.


def test_fast_path_matches_reference_and_is_second_order(three):
    """Fixed-step RK4 path: error <= 1e-5 at 4 sub-steps; observed order >= 1.8 in the
    sub-step over 1, 2 and 4 sub-steps (routing jumps inside sub-steps make it second
    order; fourth when aligned). One sub-step is the default `Fast()` at this tick (the
    standard program). Observed: 4.7e-6, 1.2e-6, 2.9e-7, slope -2.00."""
    ref = reference_simulate(THREE, "flow-grad", step_size=0.3, tick=H, horizon=T)
    assert int(dl.Fast().steps_per_tick(three, H, xp=np)) == 1
    errs = []
    for integrator in (dl.Fast(), dl.Fast(2), dl.Fast(4)):
        sol = dl.simulate(three, "flow-grad", step_size=0.3, tick=H, horizon=T, n_save=N_SAVE,
                          integrator=integrator)
        errs.append(np.max(np.abs(np.asarray(sol.N) - ref["N"][:: 200 // N_SAVE])))
    assert errs[2] <= 1e-5
    slope = np.polyfit(np.log([1, 2, 4]), np.log(errs), 1)[0]
    assert slope <= -1.8, errs


def test_coarse_tick_picks_substeps_or_reports_negative_workload():
    """Two fast M/M/1 cells at low load with a 0.1 s tick: mu'(0) h = 4 is outside RK4's
    stability interval. `Fast()` takes ceil(h max mu'(0) / 0.5) = ceil(0.1 * 40 / 0.5) = 8
    steps per tick and matches the scipy reference; one step per tick oscillates below
    zero, which is the status `negative_workload`, never a `success`."""
    d = two_mm1(mu1=40.0, mu2=30.0, lam=5.0, tau=0.013)
    s = dl.scenario_from_dict(d)
    assert int(dl.Fast().steps_per_tick(s, 0.1, xp=np)) == 8
    assert int(dl.Fast().steps_per_tick(s, 0.005, xp=np)) == 1
    assert dl.Fast().for_batch(s, 0.1).max_substeps == 8
    ref = reference_simulate(d, "flow-grad", step_size=0.3, tick=0.1, horizon=4.0)
    kw = dict(step_size=0.3, tick=0.1, horizon=4.0, n_save=N_SAVE, throw=False)
    # Each scenario takes its own steps: in a batch with these cells the three-cell network
    # (one step per tick) gives what it gives alone.
    t = dl.scenario_from_dict(THREE)
    batch = dl.stack_scenarios([s, t])
    both = dl.simulate(batch, "flow-grad", **kw)
    assert both.status_names().tolist() == ["success", "success"]
    assert np.max(np.abs(np.asarray(both.N[0, :, :2]) - ref["N"])) <= 2e-5
    alone = dl.simulate(t, "flow-grad", **kw)
    np.testing.assert_allclose(both.N[1], alone.N, rtol=1e-12, atol=1e-12)
    one = dl.simulate(batch, "flow-grad", integrator=dl.Fast(1), **kw)
    assert one.status_names().tolist() == ["negative_workload", "success"]


def test_accurate_error_shrinks_with_tolerance(three):
    """With a long tick (1 s) the adaptive solver's error is visible: it falls about as
    fast as the tolerance (log-log slope in [0.8, 1.3]) and one compilation serves all."""
    ref = reference_simulate(THREE, "flow-lat", step_size=0.2, tick=1.0, horizon=20.0)
    tols = [1e-5, 1e-6, 1e-7, 1e-8]
    errs = []
    for tol in tols:
        sol = dl.simulate(three, "flow-lat", step_size=0.2, tick=1.0, horizon=20.0, n_save=20,
                          integrator=dl.Accurate(rtol=tol, atol=tol))
        errs.append(np.max(np.abs(np.asarray(sol.N) - ref["N"])))
    slope = np.polyfit(np.log(tols), np.log(errs), 1)[0]
    assert 0.8 <= slope <= 1.3, errs
    assert errs[-1] < 1e-7


def test_mass_balance_and_invariants():
    """Arrivals at the roots minus departures = change of workload + change of in-flight
    mass, to 1e-9 in float64; N >= 0 and every routing row on its simplex at all saves; the
    in-flight mass agrees with an independent sum over the saved routing history."""
    rng = np.random.default_rng(0)
    # (delays below 3 ticks, both laws, 40 saves: test_contracts' Disc-Grad program)
    scns = [dl.scenario_from_dict(random_scenario(rng, 3, load=0.8, max_tau=0.12))
            for _ in range(3)]
    batch = dl.stack_scenarios(scns, laws=LAWS)
    K = int(round(2.0 / H))
    assert K == N_SAVE
    sol = dl.simulate(batch, "disc-grad", tick=H, horizon=2.0, n_save=K)
    src = np.asarray(sol.source_arrivals).sum(-1)
    dep = np.asarray(sol.departures).sum(-1)
    N = np.asarray(sol.N)
    flight = np.asarray(sol.in_flight)
    lhs = src - dep
    rhs = (N.sum(-1) - N[:, :1].sum(-1)) + (flight - flight[:, :1])
    assert np.max(np.abs(lhs - rhs)) <= 1e-9
    assert np.all(N >= 0)
    x = np.asarray(sol.x)
    allowed = np.asarray(batch.allowed)[:, None]
    assert np.all(x >= 0) and np.all(x[~np.broadcast_to(allowed, x.shape)] == 0)
    np.testing.assert_allclose(x.sum(-1), 1.0, atol=1e-12)
    # Independent in-flight mass: sum_ij lambda_i * integral over [t - tau_ij, t] of x_ij.
    for b, s in enumerate(scns):
        lam = np.asarray(s.arrival_rate(0.0))
        tau = np.asarray(s.latency)
        xs = x[b]  # x[k] = routing on [t_k, t_{k+1}); history before 0 is x[0]
        for k in (0, 1, 3, 20, K):
            t = k * H
            total = 0.0
            for i in range(3):
                for j in range(3):
                    lo = t - tau[i, j]
                    q = np.arange(int(np.floor(lo / H)) - 1, k)
                    a = np.clip(q * H, lo, t)
                    bnd = np.clip((q + 1) * H, lo, t)
                    xv = xs[np.clip(q, 0, None), i, j]
                    total += lam[i] * np.sum(xv * (bnd - a))
            assert abs(total - flight[b, k]) <= 1e-12


def test_zero_delays_equal_plain_diffrax_ode():
    """With every delay zero and fixed (weighted random) routing the model is the ODE
    dN/dt = lambda x - mu(N); agreement with one plain diffrax solve to 1e-8. (Flow-Lat
    with step size 0 keeps the scenario's initial routing, the weighted random one: the
    compiled program of test_accurate_error_shrinks_with_tolerance.)"""
    d = dict(THREE, latency=[[0.0] * 3] * 3)
    s = dl.scenario_from_dict(d)
    sol = dl.simulate(s, "flow-lat", step_size=0.0, tick=0.1, horizon=10.0, n_save=20,
                      integrator=ACC)
    lam = np.asarray(s.arrival_rate(0.0))
    x0 = dl.weighted_random_routing(np.asarray(s.allowed), np.asarray(s.replicas))
    np.testing.assert_array_equal(np.asarray(s.initial_routing), x0)
    np.testing.assert_allclose(np.asarray(sol.x), np.broadcast_to(x0, sol.x.shape), atol=1e-15)
    inflow = jnp.asarray(lam @ x0)
    term = dfx.ODETerm(lambda t, N, a: inflow - s.service.rate(N))
    ts = jnp.linspace(0.0, 10.0, 21)
    plain = dfx.diffeqsolve(term, dfx.Tsit5(), 0.0, 10.0, None, jnp.zeros(3),
                            saveat=dfx.SaveAt(ts=ts),
                            stepsize_controller=dfx.PIDController(rtol=1e-12, atol=1e-12),
                            max_steps=100000)
    np.testing.assert_allclose(sol.N, plain.ys, atol=1e-8)


def test_flow_routing_tends_to_continuous_projected_dynamics():
    """As h -> 0, flow routing (forward Euler of the projected dynamics) converges to the
    continuous-time projected gradient flow; with zero delays and an interior trajectory
    that flow is the plain ODE dx_i/dt = -eta (c_i - mean_j c_ij), solved here by diffrax.
    Observed order in h: 1 (slope within 0.15)."""
    d = dict(THREE, latency=[[0.0] * 3] * 3)
    s = dl.scenario_from_dict(d)
    eta, Tl = 0.05, 4.0
    lam = jnp.asarray(s.arrival_rate(0.0))

    def field(t, y, a):
        N, x = y
        c = dl.route_costs("latency", s, jnp.broadcast_to(N, (3, 3)))
        dx = -eta * (c - c.mean(axis=1, keepdims=True))
        return lam @ x - s.service.rate(N), dx

    x0 = jnp.asarray(s.initial_routing)
    plain = dfx.diffeqsolve(dfx.ODETerm(field), dfx.Tsit5(), 0.0, Tl, None,
                            (jnp.zeros(3), x0), saveat=dfx.SaveAt(t1=True),
                            stepsize_controller=dfx.PIDController(rtol=1e-12, atol=1e-12))
    assert float(plain.ys[1].min()) > 0.05  # stays interior: the plain ODE is the limit
    hs = np.array([0.04, 0.02, 0.01])
    # (the default integrator: inside a tick RK4's error is far below the routing's O(h);
    # the adaptive one gives the same errors to 2e-10 relative and compiles longer)
    sols = dl.simulate(s, "flow-lat", step_size=eta, tick=hs, horizon=Tl, n_save=1)
    errs = np.max(np.abs(np.asarray(sols.x[:, -1]) - np.asarray(plain.ys[1][0])), axis=(1, 2))
    slope = np.polyfit(np.log(hs), np.log(errs), 1)[0]
    assert abs(slope - 1.0) < 0.15, errs
    assert errs[-1] < 1e-3


def test_padded_batch_equals_loop_and_does_not_recompile(three):
    a, b = THREE, two_mm1(tau=0.02)
    scns = [dl.scenario_from_dict(a), dl.scenario_from_dict(b), dl.scenario_from_dict(a)]
    batch = dl.stack_scenarios(scns)
    etas = np.array([[0.3], [0.7], [0.1]])
    sol = dl.simulate(batch, "flow-grad", step_size=etas, tick=H, horizon=5.0, n_save=50)
    for k, s in enumerate(scns):
        one = dl.simulate(s, "flow-grad", step_size=float(etas[k, 0]), tick=H, horizon=5.0,
                          n_save=50)
        n = s.n_cells
        np.testing.assert_allclose(np.asarray(sol.N[k])[:, :n], one.N, atol=1e-12)
        np.testing.assert_allclose(np.asarray(sol.x[k])[:, :n, :n], one.x, atol=1e-12)
        assert np.all(np.asarray(sol.N[k])[:, n:] == 0)
    before = traces()
    other = dl.stack_scenarios([dl.scenario_from_dict(two_mm1(mu1=3.0, tau=0.03)),
                                dl.scenario_from_dict(THREE), dl.scenario_from_dict(THREE)])
    dl.simulate(other, "flow-grad", step_size=np.array([[0.1], [0.2], [0.4]]), tick=H,
                horizon=7.0, n_save=50)
    assert traces() == before  # new values, same shapes and static options: no new trace


def test_failure_is_a_status_not_a_crash():
    good = dl.scenario_from_dict(THREE)
    # Bypass validation: a NaN base latency poisons the first cell's rate from t = 0.
    bad = eqx.tree_at(lambda s: s.service.base_latency, good, jnp.array([jnp.nan, 0.6, 1.0]))
    batch = dl.stack_scenarios([good, bad, good])
    kw = dict(step_size=0.3, tick=H, horizon=2.0, n_save=N_SAVE)
    sol = dl.simulate(batch, "flow-grad", **kw)
    assert sol.status_names().tolist() == ["success", "nonfinite", "success"]
    assert np.all(np.isfinite(np.asarray(sol.N)))  # frozen, never NaN
    one = dl.simulate(good, "flow-grad", **kw)
    np.testing.assert_allclose(np.asarray(sol.N[0]), one.N, atol=1e-12)
    with pytest.raises(dl.SimulationError, match="non-finite"):
        dl.simulate(bad, "flow-grad", **kw)


def test_long_run_reaches_square_root_rule_and_wardrop():
    """Two M/M/1 cells, no delay (theory/equilibria.md §4 A): flow-grad -> square-root rule and
    flow-lat -> equal-latency Wardrop split, both to 1e-6 in N and z."""
    s = dl.scenario_from_dict(two_mm1())
    for pol, (z, N) in (("flow-grad", square_root_rule(2.0, 1.0, 1.5)),
                        ("flow-lat", wardrop_two(2.0, 1.0, 1.5))):
        sol = dl.simulate(s, pol, step_size=0.5, tick=0.1, horizon=400.0, n_save=40)
        np.testing.assert_allclose(sol.N[-1], N, atol=1e-6)
        zT = 1.5 * np.asarray(sol.x[-1][0])
        np.testing.assert_allclose(zT, z, atol=1e-6)
        assert float(sol.mean_latency(0.1)) == pytest.approx(N.sum() / 1.5, rel=1e-6)


def test_discrete_routing_herds_while_flow_converges():
    """One origin, two identical cells, one-way delay 1 s (theory/stability.md §2, §5): discrete
    routing oscillates for ever (swing of N1 - N2 about 1.6), flow routing with a step
    below the critical 0.0336 settles at the equilibrium N* = (1, 1)."""
    d = symmetric_pair(1.0)
    d["initial"] = {"workload": [0.0, 0.3, 0.0]}  # break the exact symmetry
    s = dl.scenario_from_dict(d)
    disc = dl.simulate(s, "disc-grad", tick=0.01, horizon=300.0, n_save=300)
    gap = np.asarray(disc.N[:, 1] - disc.N[:, 2])[-100:]
    assert gap.max() - gap.min() > 2.0  # peak to peak of an amplitude ~1.6 oscillation
    flow = dl.simulate(s, "flow-grad", step_size=0.01, tick=0.05, horizon=600.0, n_save=60)
    assert float(flow.oscillation(0.2)) < 1e-3
    np.testing.assert_allclose(np.asarray(flow.N[-1])[1:], [1.0, 1.0], atol=1e-3)


def test_tie_rule_does_not_matter_generically(three):
    # (a batch of three copies: "split", Disc-Lat's default, runs test_contracts' program)
    batch = dl.stack_scenarios([three] * 3)
    split = dl.simulate(batch, dl.DiscreteRouting("latency", tie="split"), tick=H, horizon=T,
                        n_save=N_SAVE)
    first = dl.simulate(batch, dl.DiscreteRouting("latency", tie="first"), tick=H, horizon=T,
                        n_save=N_SAVE)
    assert float(np.max(np.abs(np.asarray(split.N[0, -1] - split.N[0, 0])))) > 0.1  # it moved
    np.testing.assert_array_equal(split.N, first.N)
    np.testing.assert_array_equal(split.x, first.x)


def test_float32_opt_in(three):
    s64 = dl.simulate(three, "flow-grad", step_size=0.3, tick=H, horizon=T, n_save=N_SAVE)
    s32 = dl.simulate(three, "flow-grad", step_size=0.3, tick=H, horizon=T, n_save=N_SAVE,
                      dtype=jnp.float32)
    assert s32.N.dtype == jnp.float32
    np.testing.assert_allclose(s32.N, s64.N, rtol=1e-4, atol=1e-4)


def test_float32_long_run_keeps_time_and_totals():
    """30,000 float32 ticks to t = 300 s: the arrivals total equals the closed form
    lambda T (relative 1e-6) and N agrees with float64 to 1e-4. (Times taken in float32
    made every tick's arrival integral 3e-3 too long or short near 300 s, and float32 totals
    of equal increments drift by 1e-3.)"""
    # (a delay inside one tick and 40 saves: the float64 run is the two-cell program of
    # the padded-batch and long-run checks)
    d = two_mm1(mu1=2.0, mu2=1.0, lam=1.5, tau=0.007)
    s = dl.scenario_from_dict(d)
    kw = dict(step_size=0.3, tick=0.01, horizon=300.0, n_save=N_SAVE)
    s32 = dl.simulate(s, "flow-grad", dtype=jnp.float32, **kw)
    s64 = dl.simulate(s, "flow-grad", **kw)
    total = np.asarray(s32.source_arrivals[-1], float).sum()
    np.testing.assert_allclose(total, 1.5 * 300.0, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(s32.N, float), s64.N, rtol=1e-4, atol=1e-4)
    # (and the conservation check raises no false `mass_balance` over 30,000 float32 ticks)
    assert s32.status_names() == "success" and s64.status_names() == "success"


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(tick=0.0), "tick"),
        (dict(tick=0.03, horizon=1.0), "whole number of ticks"),
        (dict(step_size=-1.0), "step_size"),
        (dict(step_size=np.ones(5)), "step_size has shape"),
        (dict(n_save=10_000), "n_save"),
        (dict(horizon=float("nan")), "horizon"),
    ],
)
def test_bad_simulation_options(three, kwargs, needle):
    base = dict(step_size=0.1, tick=0.05, horizon=1.0, n_save=10)
    base.update(kwargs)
    with pytest.raises(ValueError, match=needle):
        dl.simulate(three, "flow-grad", **base)
    with pytest.raises(ValueError, match="allowed policies"):
        dl.simulate(three, "flow-fast", tick=0.05, horizon=1.0)


def test_sharded_over_two_cpu_devices(tmp_path):
    """The batch axis is split over every device: two CPU devices (`use_cpu_cores`) give
    the same answer."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import json, sys, numpy as np
        sys.path.insert(0, 'tests')
        import jax, dlbfluid as dl
        from helpers import THREE, two_mm1
        dl.enable_x64()
        assert dl.use_cpu_cores() == 2  # (from DLBFLUID_CPU_DEVICES, before any JAX work)
        assert jax.device_count() == 2, jax.devices()
        b = dl.stack_scenarios([dl.scenario_from_dict(THREE), dl.scenario_from_dict(two_mm1()),
                                dl.scenario_from_dict(THREE)])
        sol = dl.simulate(b, 'flow-grad', step_size=0.2, tick=0.05, horizon=2.0, n_save=40)
        print(json.dumps(np.asarray(sol.N).tolist()))
        """
    )
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env["DLBFLUID_CPU_DEVICES"] = "2"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=str(__import__("pathlib").Path(__file__).parent.parent), check=True)
    sharded = np.array(__import__("json").loads(out.stdout.strip().splitlines()[-1]))
    b = dl.stack_scenarios([dl.scenario_from_dict(THREE), dl.scenario_from_dict(two_mm1()),
                            dl.scenario_from_dict(THREE)])
    local = dl.simulate(b, "flow-grad", step_size=0.2, tick=0.05, horizon=2.0, n_save=N_SAVE)
    np.testing.assert_allclose(sharded, local.N, atol=1e-12)


class _Leaky(dl.AbstractIntegrator):
    """`Fast` that loses a fraction `leak` of every workload each tick without counting it
    as a departure or a drop: a non-conserving integrator, for the `mass_balance` status.
    (`leak` is an array, so that one compilation serves every value.)"""

    inner: dl.Fast
    leak: jnp.ndarray

    def tick(self, scn, setup, tk, N, xprev, xcur, c, speed):
        out = self.inner.tick(scn, setup, tk, N, xprev, xcur, c, speed)
        return eqx.tree_at(lambda r: r.N, out, out.N * (1.0 - self.leak))

    def for_batch(self, scn, tick):
        return _Leaky(self.inner.for_batch(scn, tick), self.leak)

    def prepared(self, dtype):
        return _Leaky(self.inner.prepared(dtype), self.leak)


def test_mass_balance_status_flags_lost_requests_only():
    """A run that loses requests is `mass_balance`, not `success` (and raises), while the
    same run that conserves them (leak 0) stays `success`; float32 runs are covered by
    `test_float32_long_run_keeps_time_and_totals`."""
    batch = dl.stack_scenarios([dl.scenario_from_dict(THREE)] * 2)
    kw = dict(step_size=0.3, tick=H, horizon=2.0, n_save=10)
    ok = dl.simulate(batch, "flow-grad", integrator=_Leaky(dl.Fast(), jnp.asarray(0.0)), **kw)
    assert list(ok.status_names()) == ["success"] * 2
    sol = dl.simulate(batch, "flow-grad", integrator=_Leaky(dl.Fast(), jnp.asarray(1e-9)), **kw)
    assert list(sol.status_names()) == ["mass_balance"] * 2  # 1e-9 per tick is far beyond rounding
    with pytest.raises(dl.SimulationError, match="mass_balance"):
        sol.raise_for_status()


def test_chunks_change_the_speed_not_the_numbers(capsys):
    """`chunk` (scenarios advanced together on a device) is a speed knob: chunks of 2 of a
    batch of 3 (two chunks, the last padded) give the whole batch's numbers to rounding,
    with equal ticks (one tick loop per chunk) and with a tick per scenario (a loop per
    scenario). Each chunk runs all of its saves, and the progress line counts the save
    intervals of every chunk (20 x 2 on one device), ending at its total. (The batch with
    equal ticks run whole is the standard one: test_contracts' Flow-Grad program.)"""
    scns = [dl.scenario_from_dict(d) for d in (THREE, two_mm1(tau=0.07), THREE)]
    batch = dl.stack_scenarios(scns, laws=LAWS)
    assert sim.default_chunk(3) is None  # so it runs whole
    ticks = np.array([0.05, 0.1, 0.05])
    for tick, n_save in ((0.05, N_SAVE), (ticks, 20)):
        kw = dict(step_size=0.5, tick=tick, horizon=2.0, n_save=n_save)
        whole = dl.simulate(batch, "flow-grad", **kw)
        parts = dl.simulate(batch, "flow-grad", chunk=2, progress=tick is ticks, **kw)
        assert list(whole.status_names()) == list(parts.status_names()) == ["success"] * 3
        for f in ("N", "x", "arrivals", "departures", "workload_integral", "in_flight"):
            a, b = np.asarray(getattr(whole, f)), np.asarray(getattr(parts, f))
            np.testing.assert_allclose(b, a, rtol=1e-13, atol=1e-13, err_msg=f)
        assert float(np.max(np.abs(np.asarray(whole.N[:, -1] - whole.N[:, 0])))) > 1e-3
    ndev = jax.local_device_count()
    share = -(-3 // ndev)  # scenarios per device
    total = 20 * -(-share // 2) * ndev  # saves x chunks of a share x devices
    err = capsys.readouterr().err
    assert f" {total}/{total} " in err and f"{total + 1}/" not in err, err[-300:]
    with pytest.raises(ValueError, match="chunk = 0 is invalid"):
        dl.simulate(batch, "flow-grad", chunk=0, tick=0.05, horizon=2.0, n_save=N_SAVE)


def test_own_scan_over_step_reproduces_simulate(three):
    """The public single-scenario simulator: a `lax.scan` of `step` over K ticks, recording
    after each, gives `simulate(n_save=K)`'s saved trajectory (every field to 1e-12, the
    same final status); the state is a `SimState` that jit and vmap take whole."""
    K = 40
    sol = dl.simulate(three, "flow-grad", step_size=0.3, tick=H, horizon=K * H, n_save=K)
    s = dl.simulator(three, "flow-grad", step_size=0.3, tick=H)
    assert isinstance(s, dl.Simulator)

    # (one compiled scan for both simulators below: their arrays are arguments)
    @eqx.filter_jit
    @eqx.debug.assert_max_traces(max_traces=1)
    def run(sim, st):
        def body(state, k):
            state = sim.step(state, k)
            return state, sim.record(state, k + 1)

        return jax.lax.scan(body, st, jnp.arange(K))

    state0 = s.init()
    assert isinstance(state0, dl.SimState)
    state, recs = run(s, state0)
    first = s.record(state0, 0)
    assert isinstance(first, dl.SavePoint)
    for f in ("t", "N", "x", "arrivals", "departures", "source_arrivals", "workload_integral",
              "network_integral", "drops", "in_flight"):
        mine = np.concatenate([np.asarray(getattr(first, f))[None], np.asarray(getattr(recs, f))])
        np.testing.assert_allclose(mine, np.asarray(getattr(sol, f)), rtol=1e-12, atol=1e-12,
                                   err_msg=f)
    assert int(state.status) == int(sol.status) == dl.RESULTS.success
    assert float(np.max(np.abs(np.asarray(recs.N[-1] - first.N)))) > 0.1  # it moved
    # A different step size is a different trajectory (the comparison can fail).
    other = dl.simulator(three, "flow-grad", step_size=0.1, tick=H)
    moved, _ = run(other, other.init())
    assert float(np.max(np.abs(np.asarray(moved.N) - np.asarray(sol.N[-1])))) > 1e-4


def test_simulator_options_are_checked(three):
    with pytest.raises(ValueError, match="simulator takes one scenario"):
        dl.simulator(dl.stack_scenarios([three, three]), "rand")
    with pytest.raises(ValueError, match=r"horizon = None is invalid for policy 'mnlb'"):
        dl.simulator(three, "mnlb", tick=H)
    with pytest.raises(ValueError, match="tick = 0.0 is invalid"):
        dl.simulator(three, "rand", tick=0.0)
    with pytest.raises(ValueError, match="step_size has shape"):
        dl.simulator(three, "rand", step_size=np.ones(5))
    assert dl.simulator(three, "rand", tick=H).width >= 1  # (no horizon needed for rand)


def test_n_save_is_bucketed_and_the_trace_counter_fires():
    """`n_save` is compiled in buckets (powers of two up to 64): 3 and 4 share one program,
    8 traces a second one, which the counter sees (the positive control of the no-retrace
    checks). The bucketed run's saves equal an unbucketed run's bit for bit, and the save
    points of a run that saves every tick."""
    s = dl.scenario_from_dict(two_mm1(tau=0.07))
    kw = dict(step_size=0.5, tick=0.1, horizon=0.8, integrator=dl.Fast(3))  # Fast(3): unique
    assert [dl.SimulateOptions().save_bucket(n) for n in (1, 3, 4, 5, 64, 65, 200)] == [
        1, 4, 4, 8, 64, 128, 256]
    c0 = traces()
    a = dl.simulate(s, "flow-grad", n_save=3, **kw)
    assert traces() == c0 + 1
    dl.simulate(s, "flow-grad", n_save=4, **kw)
    assert traces() == c0 + 1  # the same bucket: no new trace
    every = dl.simulate(s, "flow-grad", n_save=8, **kw)
    assert traces() == c0 + 2  # a second trace is counted
    plain = dl.simulate(s, "flow-grad", n_save=3, options=dl.SimulateOptions(bucket_saves=False),
                        **kw)
    assert traces() == c0 + 3
    assert a.N.shape == plain.N.shape == (4, 2)
    np.testing.assert_allclose(np.asarray(a.t), [0.0, 0.2, 0.5, 0.8], atol=1e-12)
    for f in ("t", "N", "x", "arrivals", "in_flight", "workload_integral"):
        np.testing.assert_array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(plain, f)))
        np.testing.assert_allclose(np.asarray(getattr(a, f)),
                                   np.asarray(getattr(every, f))[np.array([0, 2, 5, 8])],
                                   rtol=1e-13, atol=1e-13, err_msg=f)
    assert float(np.max(np.abs(np.asarray(a.N[-1] - a.N[0])))) > 1e-2  # it moved
    with pytest.raises(ValueError, match="cpu_chunk = 0 is invalid"):
        dl.SimulateOptions(cpu_chunk=0)
