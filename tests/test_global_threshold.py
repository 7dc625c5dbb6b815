"""The global step-size threshold eta_g (dlbfluid/_global_threshold/, theory/global_threshold.md).

One search over a batch of three scenarios serves the module: the symmetric pair at
tau = 0.5 (subcritical Hopf: a stable cycle of amplitude about 1.9 coexists with the stable
equilibrium from about 0.82 eta* up), the three-cell network of tests/helpers.py (no cycle
below eta*: the negative control), and the pair again with eta* = inf (no ladder).
Numbers measured at tick 0.05 and 0.01 agree (theory/global_threshold.md, *Measured*).
"""

import dataclasses
import math

import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from helpers import symmetric_pair, three

import dlbfluid as dl
from dlbfluid._global_threshold import (
    WorstCaseSearch,
    _ascend,
    _flat,
    _starts,
    global_threshold,
)
from dlbfluid._integrators import Fast
from dlbfluid._policies import policy_from_name
from dlbfluid._simulate import _hist_len, _window_width

POLICY = "flow-grad"
RATIO = 1.05
# Rungs 0.82, 0.86, 0.91, 0.95 eta* below and 1.05, 1.10 eta* above; 8 starts, 300 s at
# 0.05 s: 48 runs per scenario, one compiled call.
CONFIG = WorstCaseSearch(
    starts=8, ladder_ratio=RATIO, rungs_below=4, rungs_above=2, horizon=300.0, tick=0.05
)
KEYS = {"eta_global", "bistable", "hopf", "witness", "cycle_amplitude", "cycle_period"}


@pytest.fixture(scope="module")
def searched():
    dicts = [symmetric_pair(0.5), three(), symmetric_pair(0.5)]
    batch = dl.stack_scenarios([dl.scenario_from_dict(d) for d in dicts])
    eq = dl.solve_equilibrium(batch, policy_from_name(POLICY).cost, throw=False, check=False)
    eta_star = np.array(dl.batch_critical_step_size(batch, POLICY, eq).critical_step_size)
    eta_star[2] = math.inf
    out = global_threshold(batch, POLICY, eq, eta_star, config=CONFIG)
    return dicts, eta_star, out, (batch, eq)


def test_pair_is_bistable(searched):
    dicts, eta_star, out, _ = searched
    rec = out[0]
    assert set(rec) == KEYS
    # The cycle is found at 0.864 eta* (rung -3) and no start is non-decaying at 0.823.
    assert rec["eta_global"] == pytest.approx(eta_star[0] * RATIO**-4, rel=1e-12)
    assert rec["eta_global"] < eta_star[0]
    assert rec["bistable"] is True
    assert rec["hopf"] == "subcritical"
    assert rec["cycle_amplitude"] == pytest.approx(1.90, abs=0.05)
    assert rec["cycle_period"] == pytest.approx(13.4, abs=0.3)
    w = rec["witness"]
    assert len(w["workload"]) == 3 and len(w["routing"]) == 3
    assert all(isinstance(v, float) for v in w["workload"])


def test_witness_cycles_above_and_converges_at_eta_global(searched):
    """The witness, re-simulated alone by `dlbfluid.simulate` from a scenario file's
    `initial`, stays on the cycle at the first rung above eta_g and converges at eta_g."""
    dicts, eta_star, out, _ = searched
    rec = out[0]
    scn = dl.scenario_from_dict({**dicts[0], "initial": rec["witness"]})
    batch = dl.stack_scenarios([scn, scn])
    eta_above = rec["eta_global"] * RATIO
    sol = dl.simulate(
        batch, POLICY, step_size=np.array([[eta_above], [rec["eta_global"]]]), tick=0.05,
        horizon=600.0, n_save=3000,
    )  # fmt: skip
    assert list(sol.status_names()) == ["success", "success"]
    N = np.asarray(sol.N)[:, -750:, 1:]  # the last quarter, both cells of the pair
    amp = (N.max(axis=1) - N.min(axis=1)).max(axis=-1)
    assert amp[0] > 1.5  # on the cycle (amplitude 1.9)
    assert amp[1] < 0.05  # converged to N* = (1, 1)
    assert np.max(np.abs(N[1, -1] - 1.0)) < 0.01


def test_negative_control_three_cells(searched):
    """No start is non-decaying below eta* on the three-cell network: eta_g is the rung
    just below eta*, the cycle above eta* is small (0.04 against N* = 1.5)."""
    dicts, eta_star, out, _ = searched
    rec = out[1]
    assert rec["bistable"] is False
    assert rec["eta_global"] == pytest.approx(eta_star[1] / RATIO, rel=1e-12)
    assert rec["hopf"] == "supercritical"
    assert rec["cycle_amplitude"] < 0.25 * 1.47
    assert rec["cycle_period"] == pytest.approx(1.47, abs=0.05)


def test_no_ladder_without_eta_star(searched):
    _, _, out, _ = searched
    assert out[2] == dict.fromkeys(KEYS)


def test_witness_is_a_valid_initial_block(searched):
    dicts, _, out, _ = searched
    for d, rec in zip(dicts[:2], out[:2]):
        scn = dl.scenario_from_dict({**d, "initial": rec["witness"]})
        x = np.asarray(scn.initial_routing)
        assert np.all(x >= 0) and np.allclose(x.sum(axis=-1), 1.0, atol=1e-12)


def test_ascent_raises_the_gap_and_stays_feasible(searched):
    """Gradient ascent through the tick: finite objectives at every iterate, the cold
    start's late gap on the pair at 0.864 eta* raised by more than 5%, and the refined
    starts feasible (N >= 0, routing on each simplex, 0 on forbidden arcs)."""
    _, eta_star, _, (batch, eq) = searched
    pair = jtu.tree_map(lambda a: a[:1], batch.strip())  # the pair, as a batch of one
    N_star = np.asarray(eq.N)[:1]
    es = float(eta_star[0])
    pol = policy_from_name(POLICY)
    cfg = dataclasses.replace(CONFIG, starts=4, vertex_starts=1)
    scn = pair
    N0, x0 = _starts(scn, N_star, cfg)
    S, n = 4, scn.n_cells
    h = 0.05
    tau = float(np.max(np.asarray(scn.latency)))
    kw = dict(
        K=400, hist=_hist_len(tau / h),
        window=_window_width(np.asarray(scn.arrival_times), tau + 2 * h),
    )  # fmt: skip
    args = (
        _flat(scn, 1, S),
        jnp.full((S, n), es * RATIO**-3),
        jnp.asarray(h),
        _flat(jnp.asarray(N_star), 1, S),
        jnp.asarray(N0.reshape(S, n)),
        jnp.asarray(x0.reshape(S, n, n)),
        pol,
        Fast().for_batch(scn, h).prepared(jnp.float64),
        jnp.asarray(0.25),
    )
    N1, x1, history = _ascend(*args, steps=4, **kw)
    history, N1, x1 = map(np.asarray, (history, N1, x1))
    J0, J1 = history[0], history.max(axis=0)  # the starts' own objective, the best one
    assert np.all(np.isfinite(history))
    assert J1[0] > 1.05 * J0[0]
    assert np.all(N1 >= 0)
    allowed = np.asarray(scn.allowed[0])
    assert np.all(x1[:, ~allowed] == 0)
    assert np.allclose(x1.sum(axis=-1)[:, allowed.any(axis=-1)], 1.0, atol=1e-12)


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(ladder_ratio=1.1), "ladder_ratio"),
        (dict(starts=0), "starts"),
        (dict(vertex_starts=9, starts=8), "vertex_starts"),
        (dict(horizon=10.01), "horizon"),
        (dict(decay_ratio=1.0), "decay_ratio"),
        (dict(tick=-0.05), "tick"),
        (dict(late_window=0.0), "late_window"),
    ],
)
def test_bad_config(change, field):
    with pytest.raises(ValueError, match=rf"WorstCaseSearch\.{field} = .* is invalid: expected"):
        WorstCaseSearch(**change)


def test_bad_arguments(searched):
    _, _, _, (batch, eq) = searched
    with pytest.raises(ValueError, match=r"eta_star has shape \(2,\): expected \(3,\)"):
        global_threshold(batch, POLICY, eq, np.ones(2), config=CONFIG)
    with pytest.raises(ValueError, match="disc-grad"):
        global_threshold(batch, "disc-grad", eq, np.ones(3), config=CONFIG)
    with pytest.raises(ValueError, match="config = "):
        global_threshold(batch, POLICY, eq, np.ones(3), config={"starts": 8})
    one = jtu.tree_map(lambda a: a[0], batch)
    with pytest.raises(ValueError, match="expected one batch axis"):
        global_threshold(one, POLICY, eq, np.ones(3), config=CONFIG)
