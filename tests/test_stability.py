"""Stability thresholds of flow routing (theory/stability.md).

Closed form for one origin and two identical cells (theory/stability.md §2), the pseudospectral
method for any network, their agreement, the convergence in the number of Chebyshev
nodes, validation against batched simulations, herding of discrete routing and the
`dlbfluid stability` command.
"""

import contextlib
import io
import json
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize
from helpers import THREE, symmetric_pair, three

import dlbfluid as dl
from dlbfluid._stability import (
    Spectrum,
    characteristic_roots,
    critical_step_size,
    generator_matrix,
    herding,
    linearise,
    oscillation,
    spectral_abscissa,
    step_size_ratio,
    symmetric_critical_step_size,
)

# theory/stability.md §2: M/M/1 mu(N) = N/(1+N), lambda = 1, gradient cost f = (1+N)^2, so
# N* = 1, a = mu'(N*) = 1/4, f'(N*) = 2(1+N*) = 4.
TABLE = {0.25: 0.12753, 0.5: 0.06497, 1.0: 0.03359, 2.0: 0.01773}
A, FP, LAM = 0.25, 4.0, 1.0
THREE_SCALE = 10.0  # THREE's delays (0.03-0.11 s) times 10: long against the 0.01 s tick


def _pair(tau, **initial):
    d = symmetric_pair(tau)
    if initial:
        d["initial"] = initial
    return dl.scenario_from_dict(d)


@pytest.fixture(scope="module")
def three_rif():
    """THREE with delays x10 under flow-rif: every source splits over all three cells
    (9 states, 3 delays, 4 neutral routing directions)."""
    return critical_step_size(dl.scenario_from_dict(THREE), "flow-rif", tau_scale=THREE_SCALE)


# ----------------------------------------------------------------------------------------
# Closed form
# ----------------------------------------------------------------------------------------


def _reference_eta(a, fp, lam, tau):
    """Independent root find, in omega instead of K: 2 tau w = arctan(a/w) has exactly one
    root (the left side increases, the right decreases); then K = w sqrt(w^2 + a^2)."""
    w = scipy.optimize.brentq(
        lambda w: 2 * tau * w - math.atan(a / w), 1e-12, 10.0, xtol=1e-16, rtol=1e-15
    )
    return w * math.sqrt(w * w + a * a) / (lam * fp), w


@pytest.mark.parametrize("tau", sorted(TABLE))
def test_symmetric_table(tau):
    eta = symmetric_critical_step_size(A, FP, LAM, tau)
    ref, w = _reference_eta(A, FP, LAM, tau)
    assert abs(eta - ref) <= 1e-8 * ref
    # the printed table has 5 decimals: within half a unit of the last one (<< 5e-5)
    assert abs(eta - TABLE[tau]) <= 5e-6
    assert round(eta, 5) == TABLE[tau]
    # s = i w_c is a root of s(s+a) + K exp(-2 tau s) at eta*; just below, every root of
    # the closed-form equation is stable, just above a pair is unstable.
    K = eta * LAM * FP
    s = 1j * w
    assert abs(s * (s + A) + K * np.exp(-2 * tau * s)) <= 1e-12 * K


def test_symmetric_scaling_and_errors():
    # eta* = K*(a, tau)/(lam f'): inversely proportional to lam and to f'.
    e = symmetric_critical_step_size(A, FP, LAM, 0.5)
    assert symmetric_critical_step_size(A, 2 * FP, 3 * LAM, 0.5) == pytest.approx(e / 6, rel=1e-12)
    assert symmetric_critical_step_size(A, FP, LAM, 0.0) == math.inf
    for kw in ({"a": 0.0}, {"fprime": -1.0}, {"lam": 0.0}, {"tau": -0.1}):
        args = dict(a=A, fprime=FP, lam=LAM, tau=0.5) | kw
        with pytest.raises(ValueError, match=next(iter(kw))):
            symmetric_critical_step_size(**args)


# ----------------------------------------------------------------------------------------
# Pseudospectral method
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("tau", sorted(TABLE))
def test_pseudospectral_matches_closed_form(tau):
    scn = _pair(tau)
    auto = critical_step_size(scn, "flow-grad")
    ps = critical_step_size(scn, "flow-grad", method="pseudospectral")
    assert auto.method == "symmetric" and ps.method == "pseudospectral"
    # N* = 1, a and f' come from the library (ServiceModel.rate_prime, jvp of the cost).
    np.testing.assert_allclose(auto.N, [0.0, 1.0, 1.0], atol=1e-9)
    assert auto.critical_step_size == pytest.approx(_reference_eta(A, FP, LAM, tau)[0], rel=1e-8)
    assert abs(ps.critical_step_size / auto.critical_step_size - 1) <= 1e-6
    assert ps.crossing_frequency == pytest.approx(auto.crossing_frequency, rel=1e-6)
    assert abs(ps.rightmost_root.real) <= 1e-9
    assert ps.linearisation.dim == 4  # 3 workloads + 1 routing coordinate, no spurious zero


def test_tau_scale_and_step_weights():
    base = critical_step_size(_pair(0.25), "flow-grad", tau_scale=2.0)
    assert base.critical_step_size == pytest.approx(TABLE[0.5], abs=5e-6)
    # Only the origin routes: doubling its relative step halves eta*.
    w = critical_step_size(_pair(0.5), "flow-grad", step_weights=[2.0, 1.0, 1.0])
    assert w.method == "pseudospectral"
    assert w.critical_step_size == pytest.approx(TABLE[0.5] / 2, rel=1e-4)


def test_no_delay_is_stable_for_every_step_size():
    scn = _pair(0.0)
    for method in ("auto", "pseudospectral"):
        r = critical_step_size(scn, "flow-grad", method=method)
        assert r.critical_step_size == math.inf and math.isnan(r.rightmost_root.real)
    rec = r.summary()
    assert rec["stable_for_every_step_size"] is True
    assert spectral_abscissa(scn, "flow-grad", 1e4) < 0


def test_node_convergence(three_rif):
    """Spectral convergence of the rightmost root (no Newton polish) in the number M of
    Chebyshev nodes, at eta*: the error falls geometrically to round-off."""
    pair = critical_step_size(_pair(0.5), "flow-grad", method="pseudospectral")
    for res in (pair, three_rif):
        lin, eta = res.linearisation, res.critical_step_size
        ref = characteristic_roots(lin, eta, nodes=40)[0]
        errs = {}
        for M in (2, 3, 4, 6, 8, 12, 16):
            ev = Spectrum(lin, M).roots(eta, refine=0)
            errs[M] = np.min(np.abs(ev - ref)) / abs(ref)
        assert errs[2] > errs[3] > errs[4] > errs[6] > errs[8]
        assert errs[2] > 1e-5 and errs[4] < 1e-4 and errs[8] < 1e-9
        assert max(errs[12], errs[16]) < 1e-12
        # the polished root solves det(Delta(s)) = 0 and sits on the imaginary axis
        D = lin.characteristic_matrix(ref, eta)
        assert np.linalg.svd(D, compute_uv=False)[-1] <= 1e-12 * np.linalg.norm(D)
        assert abs(ref.real) <= 1e-9 * abs(ref)


def test_linearisation_is_the_jacobian(three_rif):
    """The assembled delay matrices equal the JAX Jacobian of the nonlinear right-hand side
    with respect to the current and the arc-delayed states, mapped to tangent coordinates."""
    lin = linearise(dl.scenario_from_dict(THREE), "flow-rif", tau_scale=THREE_SCALE)
    np.testing.assert_allclose(lin.plant, three_rif.linearisation.plant, atol=1e-9)
    scn = dl.scenario_from_dict(three(latency=(np.array(THREE["latency"]) * THREE_SCALE).tolist()))
    n, eta = 3, 0.7
    lam = jnp.asarray(lin.arrival_rate)
    tau = lin.arc_delay

    def rhs(N0, Xd, Nd):  # Xd[i,j] = x_ij(t - tau_ij), Nd[i,j] = N_j(t - tau_ij)
        dN = jnp.sum(lam[:, None] * Xd, axis=0) - scn.service.rate(N0)
        c = dl.destination_cost("rif", scn, Nd)
        P = jnp.eye(n) - 1.0 / n  # every support is {0, 1, 2}
        return dN, -eta * c @ P.T

    N, X = jnp.asarray(lin.N), jnp.asarray(lin.x)
    J = jax.jacfwd(rhs, argnums=(0, 1, 2))(N, X, jnp.broadcast_to(N, (n, n)))
    # Embedding T: (dN, w) -> (dN, dx) with dx_i = B_i w_i; T is orthonormal.
    d = lin.dim
    T = np.zeros((n + n * n, d))
    T[:n, :n] = np.eye(n)
    for k, (i, B) in enumerate(zip(lin.sources, lin.bases)):
        T[n + i * n : n + (i + 1) * n, n + 2 * k : n + 2 * k + 2] = B
    full = np.zeros((lin.delays.size, n + n * n, n + n * n))
    kidx = np.searchsorted(lin.delays, tau)
    full[0, :n, :n] = np.asarray(J[0][0])
    (_, dN_dX, _), (_, _, dx_dN) = J
    for i in range(n):
        for j in range(n):
            full[kidx[i, j], :n, n + i * n + j] += np.asarray(dN_dX)[:, i, j]
            full[kidx[i, j], n + i * n : n + (i + 1) * n, j] += np.asarray(dx_dN)[i, :, i, j]
    reduced = np.einsum("ad,kab,be->kde", T, full, T)
    np.testing.assert_allclose(lin.matrices(eta), reduced, atol=1e-12)


def test_neutral_directions_are_deflated(three_rif):
    """RIF with full support: x* is not unique, 4 routing directions leave every inflow
    unchanged (s = 0 for every eta). They are deflated, and the generator without
    deflation has exactly those 4 extra zero eigenvalues."""
    lin, eta = three_rif.linearisation, 0.5 * three_rif.critical_step_size
    assert lin.dim == 9 and lin.neutral.shape == (9, 4)
    assert len(lin.delays) == 4  # 0, 0.3, 0.7, 1.1
    roots = characteristic_roots(lin, eta)
    assert roots[0].real < 0 and np.min(np.abs(roots)) > 1e-3
    raw = np.linalg.eigvals(generator_matrix(lin, eta, 16))
    assert np.sum(np.abs(raw) < 1e-9) == 4
    assert raw.size == roots.size + 4


def test_spectral_abscissa_changes_sign(three_rif):
    scn = dl.scenario_from_dict(THREE)
    eta = three_rif.critical_step_size
    lo = spectral_abscissa(scn, "flow-rif", 0.99 * eta, tau_scale=THREE_SCALE)
    hi = spectral_abscissa(scn, "flow-rif", 1.01 * eta, tau_scale=THREE_SCALE)
    assert lo < 0 < hi
    assert three_rif.method == "pseudospectral"
    assert three_rif.crossing_frequency > 0
    assert three_rif.period == pytest.approx(2 * math.pi / three_rif.crossing_frequency)


def test_errors():
    scn = _pair(0.5)
    for pol in ("disc-grad", "rand", "nope"):
        with pytest.raises(ValueError, match=r"policy = .*allowed policies are \['flow-grad'"):
            critical_step_size(scn, pol)
    with pytest.raises(ValueError, match="policy = 'disc-lat'"):
        critical_step_size(scn, dl.DiscreteRouting("latency"))
    with pytest.raises(ValueError, match=r"method = 'exact' is invalid.*'pseudospectral'"):
        critical_step_size(scn, "flow-grad", method="exact")
    with pytest.raises(ValueError, match="nodes = 1"):
        critical_step_size(scn, "flow-grad", nodes=1)
    with pytest.raises(ValueError, match="tau_scale"):
        critical_step_size(scn, "flow-grad", tau_scale=-1.0)
    with pytest.raises(ValueError, match="method = 'symmetric' is invalid for this scenario"):
        critical_step_size(dl.scenario_from_dict(THREE), "flow-grad", method="symmetric")
    with pytest.raises(ValueError, match="window"):
        herding(scn, tick=0.1, horizon=1.0, window=0.0)
    # the batched search's tunables are one object, `BatchSearch`, checked before any work
    with pytest.raises(ValueError, match="search = 'fast' is invalid: expected a BatchSearch"):
        dl.batch_critical_step_size(dl.stack_scenarios([scn]), "flow-grad", None, search="fast")


# ----------------------------------------------------------------------------------------
# Validation against simulation (tick small against the delays)
# ----------------------------------------------------------------------------------------


def _rates(sol, Nstar, T):
    """Exponential rate of max_j |N_j - N*_j| between the windows [T/4, T/2) and
    [3T/4, T] (for an envelope e^{st} both window maxima sit T/2 apart)."""
    t, N = np.asarray(sol.t), np.asarray(sol.N)
    dev = np.abs(N - Nstar).max(-1)
    w1 = (t >= T / 4) & (t < T / 2)
    w2 = t >= 3 * T / 4
    A1 = np.where(w1, dev, 0).max(-1)
    A2 = np.where(w2, dev, 0).max(-1)
    return np.log(A2 / A1) / (T / 2), A1, A2


def test_simulation_symmetric_pair():
    """Decay at 0.9 eta*, growth at 1.1 eta* at the rates of the rightmost roots, and a
    sustained oscillation at 1.1 eta* from a large perturbation (theory/stability.md §4)."""
    res = critical_step_size(_pair(0.5), "flow-grad")
    eta = res.critical_step_size
    near = dict(workload=[0.0, 1.0, 1.0], routing=[[0, 0.505, 0.495], [0, 1, 0], [0, 0, 1]])
    far = dict(workload=[0.0, 1.0, 1.0], routing=[[0, 0.75, 0.25], [0, 1, 0], [0, 0, 1]])
    batch = dl.stack_scenarios([_pair(0.5, **near), _pair(0.5, **near), _pair(0.5, **far)])
    T = 240.0
    sol = dl.simulate(
        batch,
        "flow-grad",
        step_size=np.array([[0.9], [1.1], [1.1]]) * eta,
        tick=0.01,
        horizon=T,
        n_save=960,
    )
    assert np.all(np.asarray(sol.status) == 0)
    rate, A1, A2 = _rates(sol, res.N, T)
    pred = [characteristic_roots(res.linearisation, f * eta)[0] for f in (0.9, 1.1)]
    assert rate[0] < 0 < rate[1]
    assert rate[0] == pytest.approx(pred[0].real, rel=0.2)
    assert rate[1] == pytest.approx(pred[1].real, rel=0.2)
    # the large perturbation keeps oscillating at about the crossing period
    assert A2[2] > 0.2 and A2[2] >= 0.9 * A1[2]
    t = np.asarray(sol.t[2])
    u = np.asarray(sol.N[2, :, 1] - sol.N[2, :, 2])
    _, period, count = oscillation(t[t >= T / 2], u[t >= T / 2])
    assert count >= 10
    assert period == pytest.approx(2 * math.pi / pred[1].imag, rel=0.1)


def test_simulation_three_cells(three_rif):
    """The same on THREE (softplus cells, delays 0.3/0.7/1.1 s, every arc used): the
    general method's eta* separates decay from growth."""
    res = three_rif
    eta = res.critical_step_size
    d = three(latency=(np.array(THREE["latency"]) * THREE_SCALE).tolist())
    x0 = res.x / res.x.sum(axis=1, keepdims=True)
    d["initial"] = {"workload": (res.N + [0.02, -0.01, -0.01]).tolist(), "routing": x0.tolist()}
    scn = dl.scenario_from_dict(d)
    T = 200.0
    sol = dl.simulate(
        scn,
        "flow-rif",
        step_size=np.array([[0.9], [1.1]]) * eta,
        tick=0.01,
        horizon=T,
        n_save=800,
    )
    assert np.all(np.asarray(sol.status) == 0)
    rate, _, _ = _rates(sol, res.N, T)
    pred = [characteristic_roots(res.linearisation, f * eta)[0].real for f in (0.9, 1.1)]
    assert rate[0] < 0 < rate[1]
    assert rate[0] == pytest.approx(pred[0], rel=0.2)
    assert rate[1] == pytest.approx(pred[1], rel=0.2)


# ----------------------------------------------------------------------------------------
# Herding of discrete routing
# ----------------------------------------------------------------------------------------


def test_herding_matches_notes():
    """theory/stability.md §5: tau 0.1/0.5/1.0 -> amplitude 0.195/0.886/1.579, period
    0.78/3.6/6.7, mean N1 + N2 2.003/2.066/2.215 (Euler, dt = 1e-3)."""
    taus = [0.1, 0.5, 1.0]
    batch = dl.stack_scenarios([_pair(t, workload=[0.0, 1.2, 0.8]) for t in taus])
    r = herding(batch, "disc-grad", tick=0.01, horizon=60.0)
    np.testing.assert_array_equal(r.cells, [[1, 2]] * 3)
    assert np.all(np.diff(r.amplitude) > 0) and np.all(np.diff(r.period) > 0)
    np.testing.assert_allclose(r.amplitude, [0.195, 0.886, 1.579], rtol=0.15)
    np.testing.assert_allclose(r.period, [0.78, 3.6, 6.7], rtol=0.15)
    np.testing.assert_allclose(r.mean_total, [2.003, 2.066, 2.215], rtol=0.01)
    assert np.all(r.crossings >= 8)


def test_oscillation_estimator():
    t = np.linspace(0, 50, 5001)
    amp, period, count = oscillation(t, 3.0 + 0.7 * np.sin(2 * np.pi * t / 4.2 + 0.3))
    assert amp == pytest.approx(0.7, rel=1e-4)
    assert period == pytest.approx(4.2, rel=1e-3)
    assert count >= 20
    _, period, count = oscillation(t, np.exp(-t))  # no oscillation
    assert np.isnan(period)


# ----------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------


def _cli(argv):
    from dlbfluid._cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(argv)
    return rc, out.getvalue()


def test_cli_json(tmp_path):
    from dlbfluid._cli import _stability as mod

    assert callable(mod.register) and callable(mod.run)
    path = tmp_path / "pair.json"
    path.write_text(json.dumps(symmetric_pair(0.5)))
    rc, out = _cli(["stability", str(path), "--policy", "flow-grad", "--json"])
    assert rc == 0
    rec = json.loads(out)  # exactly one JSON object
    assert out.count("\n") == 1
    assert rec["policy"] == "flow-grad" and rec["method"] == "symmetric"
    assert round(rec["critical_step_size"], 5) == TABLE[0.5]
    np.testing.assert_allclose(rec["equilibrium"]["N"], [0, 1, 1], atol=1e-9)
    assert rec["period"] == pytest.approx(2 * math.pi / rec["crossing_frequency"])
    rc, out = _cli(
        ["stability", str(path), "--method", "pseudospectral", "--nodes", "12", "--json"]
    )
    rec2 = json.loads(out)
    assert rec2["nodes"] == 12 and rec2["method"] == "pseudospectral"
    assert rec2["critical_step_size"] == pytest.approx(rec["critical_step_size"], rel=1e-6)
    assert rec2["rightmost_root"]["imag"] == pytest.approx(rec["crossing_frequency"], rel=1e-6)


def test_cli_default_and_errors(capsys):
    rc, out = _cli(["stability", "default", "--json"])
    rec = json.loads(out)
    assert rc == 0 and rec["method"] == "pseudospectral" and len(rec["equilibrium"]["N"]) == 4
    assert 0 < rec["critical_step_size"] < math.inf
    assert rec["nodes"] == 16 and abs(rec["rightmost_root"]["real"]) < 1e-9
    rc, out = _cli(["stability", "default"])
    assert rc == 0 and "critical step size eta* =" in out
    with pytest.raises(SystemExit) as e:
        _cli(["stability", "default", "--policy", "disc-grad"])
    assert e.value.code == 2
    assert "invalid choice: 'disc-grad'" in capsys.readouterr().err
    rc, _ = _cli(["stability", "default", "--nodes", "1"])
    assert rc == 2 and "--nodes = 1 is invalid" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------
# Any network, large: the argument principle on the cell characteristic matrix (§3.6)
# ----------------------------------------------------------------------------------------


def test_nyquist_matches_pseudospectral(three_rif):
    """The argument-principle method finds the same eta* and crossing as the pseudospectral
    method (THREE under RIF, 4 neutral directions) and as the closed form (the pair)."""
    ny = critical_step_size(
        dl.scenario_from_dict(THREE), "flow-rif", tau_scale=THREE_SCALE, method="nyquist"
    )
    assert ny.method == "nyquist" and ny.rightmost_root.real == 0.0
    assert ny.critical_step_size == pytest.approx(three_rif.critical_step_size, rel=1e-10)
    assert ny.crossing_frequency == pytest.approx(three_rif.crossing_frequency, rel=1e-8)
    assert ny.summary()["neutral_directions"] == 4
    pair = critical_step_size(_pair(0.5), "flow-grad", method="nyquist")
    assert pair.critical_step_size == pytest.approx(_reference_eta(A, FP, LAM, 0.5)[0], rel=1e-10)
    assert critical_step_size(_pair(0.0), "flow-grad", method="nyquist").critical_step_size == (
        math.inf
    )


@pytest.mark.parametrize("seed, n, max_latency", [(1, 4, 0.15), (3, 4, 1.5)])
def test_nyquist_random_networks(seed, n, max_latency):
    """Seeded random networks (theory/lyapunov.md, *Generator*; delays x10 in the last one,
    where the loci wind several times): both general methods agree to 1e-9."""
    from dlbfluid._verify import random_network

    d = random_network(np.random.default_rng(seed), n, max_latency=max_latency)
    d.pop("utilisation")
    scn = dl.scenario_from_dict(d)
    for pol in ("flow-grad", "flow-lat", "flow-rif"):
        eq = dl.solve_equilibrium(scn, dl.policy_from_name(pol).cost)
        ps = critical_step_size(scn, pol, equilibrium=eq, method="pseudospectral")
        ny = critical_step_size(scn, pol, equilibrium=eq, method="nyquist")
        assert ny.critical_step_size == pytest.approx(ps.critical_step_size, rel=1e-9), pol
        assert ny.crossing_frequency == pytest.approx(ps.crossing_frequency, rel=1e-7), pol


def test_cell_characteristic_matrix(three_rif):
    """det Delta(s) = s^(d - 2n) det T(s): the n x n matrix has the same nonzero roots."""
    lin, eta = three_rif.linearisation, three_rif.critical_step_size
    n, d = lin.n_cells, lin.dim
    for s in (0.3 + 0.7j, -0.2 + 2.0j, 1.5 - 0.1j):
        lhs = np.linalg.det(lin.characteristic_matrix(s, eta))
        rhs = s ** (d - 2 * n) * np.linalg.det(lin.cell_characteristic_matrix(s, eta))
        assert abs(lhs - rhs) <= 1e-10 * abs(lhs)
    root = three_rif.rightmost_root
    T = lin.cell_characteristic_matrix(root, eta)
    assert np.linalg.svd(T, compute_uv=False)[-1] <= 1e-10 * np.linalg.norm(T)


def test_full_support_network_is_not_densified():
    """40 identical cells, every source splitting over all of them (RIF-like full support:
    d = 1600 states, 781 distinct delays, so the dense delay matrices would take 16 GB).
    With all delays within 1e-8 of tau the nonzero modes obey the closed form of §2 with
    K = eta Lambda f' (M(s) = e^(-2 s tau) Lambda f' P), so eta* is known."""
    from dlbfluid._stability import Linearisation, Steps, initial_guess, nyquist_eta

    n, tau, a, fp = 40, 0.5, 0.25, 4.0
    rng = np.random.default_rng(0)
    lam = rng.uniform(0.5, 1.5, n)
    jitter = np.round(rng.uniform(0, 1, (n, n)), 6)
    lin = Linearisation(
        delays=np.unique(np.concatenate([[0.0], (tau * (1 + 1e-8 * jitter)).ravel()])),
        n_cells=n,
        sources=tuple(range(n)),
        supports=tuple(tuple(range(n)) for _ in range(n)),
        rate_prime=np.full(n, a),
        cost_prime=np.full(n, fp),
        arrival_rate=lam,
        arc_delay=tau * (1 + 1e-8 * jitter),
        step_weights=np.ones(n),
        N=np.ones(n),
        x=np.full((n, n), 1.0 / n),
        degenerate_arcs=(),
    )
    assert lin.dim == 1600 and lin.delays.size > 700
    eta, root = nyquist_eta(lin, initial_guess(lin), 1e-12, Steps(False, "", 1))
    ref = symmetric_critical_step_size(a, fp, float(lam.sum()), tau)
    assert eta == pytest.approx(ref, rel=1e-6)
    assert lin.n_neutral == n * (n - 1) - (n - 1)  # m - rank L, rank L = n - 1


def test_progress_and_step_size_ratio(capsys):
    """`progress=True` reports on stderr; `step_size_ratio` is eta/eta* (the plausibility
    check of `simulate`), also at 99.9% load, where eta* is tiny and rounding hides part of
    the characteristic loci."""
    r = critical_step_size(_pair(0.5), "flow-grad", method="nyquist", progress=True)
    err = capsys.readouterr().err
    assert "stability (nyquist)" in err and "unstable roots" in err and "done" in err
    rec = step_size_ratio(_pair(0.5), "flow-grad", 10 * r.critical_step_size)
    # the method actually used: the closed form, as `critical_step_size` by default
    assert rec["ratio"] == pytest.approx(10.0, rel=1e-5) and rec["method"] == "symmetric"
    assert step_size_ratio(_pair(0.0), "flow-grad", 1.0)["critical_step_size"] is None
    with pytest.raises(ValueError, match="policy = 'disc-grad'"):
        step_size_ratio(_pair(0.5), "disc-grad", 1.0)
    with pytest.raises(ValueError, match="step_size = -1"):
        step_size_ratio(_pair(0.5), "flow-grad", -1)
    # the default network at 99.9% of its capacity
    with open(dl.__path__[0] + "/data/default.json") as f:
        d = json.load(f)
    cap = sum(c["service"]["capacity"] for c in d["cells"])
    lam = sum(c["arrival_rate"] for c in d["cells"])
    for c in d["cells"]:
        c["arrival_rate"] *= 0.999 * cap / lam
    scn = dl.scenario_from_dict(d)
    eq = dl.solve_equilibrium(scn, "gradient")
    rec = step_size_ratio(scn, "flow-grad", 0.05, equilibrium=eq)
    ps = critical_step_size(scn, "flow-grad", equilibrium=eq, method="pseudospectral")
    assert rec["critical_step_size"] == pytest.approx(ps.critical_step_size, rel=1e-6)
    assert rec["ratio"] > 1e6 and rec["method"] == "pseudospectral"


def test_step_size_ratio_reports_the_method_stability_uses():
    """Issue 31 item 8: `simulate`'s step-size check (`step_size_ratio`) and `stability`
    report one method for one scenario, the one actually used (`Auto`): before, the check
    always ran the argument principle and said "nyquist" where `stability` said
    "pseudospectral". Negative control: asked for "nyquist", the label follows."""
    scn = dl.scenario_from_dict(THREE)
    eq = dl.solve_equilibrium(scn, "gradient")
    auto = critical_step_size(scn, "flow-grad", equilibrium=eq)
    rec = step_size_ratio(scn, "flow-grad", 0.3, equilibrium=eq)
    assert auto.method == rec["method"] == "pseudospectral"
    assert rec["critical_step_size"] == pytest.approx(auto.critical_step_size, rel=1e-6)
    ny = critical_step_size(scn, "flow-grad", equilibrium=eq, method="nyquist")
    assert ny.method == "nyquist" != rec["method"]
    assert ny.critical_step_size == pytest.approx(auto.critical_step_size, rel=1e-10)


# ----------------------------------------------------------------------------------------
# Methods as objects, one linearisation, one root count
# ----------------------------------------------------------------------------------------


def test_methods_are_objects_and_names_map_to_them(three_rif):
    """`METHODS` is the registry behind `--method`; an object carries its own fields: a
    pseudospectral method with 12 nodes is `nodes=12`, and `Auto` with a generator limit
    of 0 rows hands THREE to the argument principle (same eta*, reported as "nyquist")."""
    from dlbfluid._defaults import STABILITY_METHODS
    from dlbfluid._stability import (
        METHODS,
        Auto,
        Nyquist,
        Pseudospectral,
        Symmetric,
        stability_method,
    )

    assert tuple(METHODS) == STABILITY_METHODS
    assert stability_method("pseudospectral", 12) == Pseudospectral(nodes=12)
    assert stability_method("nyquist") == Nyquist() and stability_method("auto") == Auto()
    assert isinstance(stability_method("symmetric"), Symmetric)
    with pytest.raises(ValueError, match="nodes = 1 is invalid"):
        Pseudospectral(nodes=1)
    pair = _pair(0.5)
    by_name = critical_step_size(pair, "flow-grad", method="pseudospectral", nodes=12)
    by_obj = critical_step_size(pair, "flow-grad", method=Pseudospectral(nodes=12))
    assert by_obj.nodes == by_name.nodes == 12
    assert by_obj.critical_step_size == by_name.critical_step_size
    scn = dl.scenario_from_dict(THREE)
    big = critical_step_size(
        scn, "flow-rif", tau_scale=THREE_SCALE, method=Auto(pseudospectral_size=0)
    )
    assert three_rif.method == "pseudospectral" and big.method == "nyquist"
    assert big.critical_step_size == pytest.approx(three_rif.critical_step_size, rel=1e-10)


def test_host_and_batch_share_the_linearisation(three_rif):
    """`loop_gain` (the batched feedback form) is `local_gain` vmapped, the function that
    `linearise` calls: the same slopes, supports and weights for THREE under flow-rif."""
    from dlbfluid._stability import loop_gain, scale_delays

    lin = three_rif.linearisation
    batch = dl.stack_scenarios([scale_delays(dl.scenario_from_dict(THREE), THREE_SCALE)])
    eq = types.SimpleNamespace(N=lin.N[None], x=lin.x[None])  # the same equilibrium
    g = jax.tree_util.tree_map(lambda a: np.asarray(a)[0], loop_gain(batch, "rif", eq))
    np.testing.assert_allclose(g.rate_prime, lin.rate_prime, rtol=1e-12)
    np.testing.assert_allclose(g.cost_prime, lin.cost_prime, rtol=1e-12)
    assert [tuple(np.nonzero(r)[0]) for r in g.support if r.any()] == list(lin.supports)
    np.testing.assert_allclose(g.weight, lin.arrival_rate * lin.step_weights, rtol=1e-12)
    assert lin.supports == ((0, 1, 2),) * 3  # negative control: a real support, not empty


def test_root_count_by_the_argument_principle():
    """`roots_in_right_half_plane` on g(s) = (s - a)^2 + b^2 over (s + 1)^2 sampled on the
    positive imaginary axis: two roots for a > 0, none for a < 0 (the control)."""
    from dlbfluid._stability import roots_in_right_half_plane

    w = np.geomspace(1e-4, 1e4, 4001)
    for a, want in ((0.3, 2), (-0.3, 0)):
        s = 1j * w
        g = ((s - a) ** 2 + 4.0) / (s + 1.0) ** 2
        inc = np.angle(g[1:] / g[:-1])
        phase = np.angle(g)
        assert roots_in_right_half_plane(phase[0], inc.sum(), phase[-1], 0) == want
