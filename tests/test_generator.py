"""The Appendix-B scenario generator (theory/generator.md): every rule against an
independent computation in this file, with the tolerance stated."""

import math

import numpy as np
import pytest
import scipy.optimize
import scipy.stats

import dlbfluid as dl
from dlbfluid._evaluation import generator as g

BIG = 3000  # scenarios for the statistical tests (about 18000 cells)


@pytest.fixture(scope="module")
def big():
    return g.generate(11, BIG)


@pytest.fixture(scope="module")
def small():
    return g.generate(5, 40)


# --- independent references ----------------------------------------------------------


def ref_softplus_rate(N, C, L0, N0, s):
    """mu(N) = N / (L0 + s/C log(1 + exp((N - N0)/s))), written from theory/service.md."""
    u = (N - N0) / s
    sp = u + math.log1p(math.exp(-u)) if u > 0 else math.log1p(math.exp(u))
    return N / (L0 + s / C * sp)


def ref_distance_km(lat1, lon1, lat2, lon2, R=6371.0088):
    """Great-circle distance by the atan2 (Vincenty, sphere) form: a different formula
    from the haversine of the generator, equal in exact arithmetic."""
    p1, p2, dl_ = math.radians(lat1), math.radians(lat2), math.radians(lon2 - lon1)
    y = math.hypot(
        math.cos(p2) * math.sin(dl_),
        math.cos(p1) * math.sin(p2) - math.sin(p1) * math.cos(p2) * math.cos(dl_),
    )
    x = math.sin(p1) * math.sin(p2) + math.cos(p1) * math.cos(p2) * math.cos(dl_)
    return R * math.atan2(y, x)


def profile_at(rate, t):
    """Evaluate a JSON arrival_rate at t (right-continuous at jumps)."""
    if not isinstance(rate, dict):
        return rate
    ts, rs = np.array(rate["times"]), np.array(rate["rates"])
    i = np.searchsorted(ts, t, side="right")  # past any duplicate at t
    if i == 0:
        return rs[0]
    if i == len(ts):
        return rs[-1]
    return rs[i - 1] + (rs[i] - rs[i - 1]) * (t - ts[i - 1]) / (ts[i] - ts[i - 1])


def capacity_with(d, replicas):
    return sum(c["service"]["capacity"] * k / c["replicas"] for c, k in zip(d["cells"], replicas))


# --- the draw --------------------------------------------------------------------------


def test_replicas_are_poisson_10_at_least_one(big):
    k = big.replicas[big.mask]
    n = k.size
    assert n > 15000
    # mean of max(1, Poisson(10)) = 10 + e^-10; std error sqrt(10/n) ~ 0.024: 5 sigma
    assert abs(k.mean() - (10 + math.exp(-10))) < 5 * math.sqrt(10 / n)
    # variance of Poisson(10) = 10; std error of a sample variance sqrt((l + 2 l^2)/n)
    assert abs(k.var() - 10) < 5 * math.sqrt(210 / n)
    assert k.min() >= 1
    # distribution: chi-square against the Poisson pmf on the bins 3..17 (+ tails)
    edges = np.arange(3, 18)
    obs = np.array([(k < 3).sum()] + [(k == e).sum() for e in edges] + [(k > 17).sum()])
    pmf = scipy.stats.poisson(10)
    exp_ = n * np.array([pmf.cdf(2)] + [pmf.pmf(e) for e in edges] + [pmf.sf(17)])
    assert scipy.stats.chisquare(obs, exp_).pvalue > 1e-4


def test_token_times_lognormal_with_20_percent_spread(big):
    sig = math.sqrt(math.log(1.04))  # log-std of a lognormal with CV 0.2
    for x, mean in (
        (big.prefill_token_time[big.mask], g.PREFILL_TOKEN_TIME_S),
        (big.decode_token_time[big.mask], g.DECODE_TOKEN_TIME_S),
    ):
        n = x.size
        assert abs(x.std() / x.mean() - 0.2) < 0.01  # std error of the CV ~ 0.0012
        assert abs(x.mean() / mean - 1) < 5 * 0.2 / math.sqrt(n)
        assert abs(np.log(x).std() - sig) < 0.005
        assert (
            scipy.stats.kstest(np.log(x / mean) + sig**2 / 2, "norm", args=(0, sig)).pvalue > 1e-4
        )
    # prefill and decode times are drawn independently
    r = np.corrcoef(big.prefill_token_time[big.mask], big.decode_token_time[big.mask])[0, 1]
    assert abs(r) < 0.04


def test_cell_counts_sites_and_padding(big):
    assert big.n_cells.min() == 2 and big.n_cells.max() == 10
    counts = np.bincount(big.n_cells, minlength=11)[2:]
    assert scipy.stats.chisquare(counts).pvalue > 1e-4  # uniform on 2..10
    np.testing.assert_array_equal(big.mask.sum(1), big.n_cells)
    np.testing.assert_array_equal(big.mask, np.arange(10)[None] < big.n_cells[:, None])
    sites = g.load_sites()
    for b in range(200):
        s = big.site[b, big.mask[b]]
        assert len(set(s)) == len(s) and np.all(np.diff(s) > 0)  # distinct, table order
        assert [sites[i].name for i in s] == list(big.cell_names[b, : len(s)])
    assert np.all(big.site[~big.mask] == -1)
    assert np.all(big.demand[~big.mask] == 0) and np.all(big.capacity[~big.mask] == 1)


def test_regions_are_a_subset_then_sites_within():
    """Two cells: one region (m = 1) or two regions (m = 2), each with probability 1/2,
    then two distinct sites uniformly among the chosen regions' sites."""
    gen = g.generate(3, 4000, min_cells=2, max_cells=2)
    sizes = {}
    for s in g.load_sites():
        sizes[s.region] = sizes.get(s.region, 0) + 1
    a = list(sizes.values())
    pairs = [(a[i], a[j]) for i in range(len(a)) for j in range(i + 1, len(a))]
    two = np.mean([(x * (x - 1) + y * (y - 1)) / ((x + y) * (x + y - 1)) for x, y in pairs])
    p_same = 0.5 * 1.0 + 0.5 * two
    same = (gen.region[:, 0] == gen.region[:, 1]).mean()
    assert abs(same - p_same) < 4 * math.sqrt(p_same * (1 - p_same) / 4000)


def test_utilisation_exact_and_dirichlet_split(big):
    for rho in (0.3, 0.8, 0.97):
        gen = g.generate(2, 50, utilisation=rho)
        lam = np.where(gen.mask, gen.demand, 0).sum(1)
        cap = np.where(gen.mask, gen.capacity, 0).sum(1)
        np.testing.assert_allclose(lam / cap, rho, rtol=0, atol=1e-12)
    w = big.demand / big.demand.sum(1, keepdims=True)
    np.testing.assert_allclose(w.sum(1), 1.0, atol=1e-14)
    assert np.all(w[big.mask] > 0)
    # Dirichlet(1,..,1) on n cells: each share is Beta(1, n-1)
    for n in (3, 6):
        shares = w[big.n_cells == n, 0]
        assert scipy.stats.kstest(shares, "beta", args=(1, n - 1)).pvalue > 1e-4


def test_latency_great_circle_at_two_thirds_c(big):
    sites = {s.name: s for s in g.load_sites()}
    lon, fra = sites["europe-west2"], sites["europe-west3"]
    d = ref_distance_km(lon.latitude, lon.longitude, fra.latitude, fra.longitude)
    assert 630 < d < 645  # London-Frankfurt, city centres, about 637 km
    tau = d / (2 / 3 * 299792.458) + 1e-3
    assert abs(tau - 4.19e-3) < 0.05e-3  # about 3.2 ms of fibre plus 1 ms
    tab = g.network_latency([lon.latitude, fra.latitude], [lon.longitude, fra.longitude])
    np.testing.assert_allclose(tab, [[0, tau], [tau, 0]], rtol=1e-12, atol=0)
    # every pair in the batch against the reference
    table = g.load_sites()
    for b in range(100):
        n = big.n_cells[b]
        for i in range(n):
            for j in range(n):
                si, sj = table[big.site[b, i]], table[big.site[b, j]]
                want = (
                    0.0
                    if i == j
                    else ref_distance_km(si.latitude, si.longitude, sj.latitude, sj.longitude)
                    / (2 / 3 * 299792.458)
                    + 1e-3
                )
                assert abs(big.latency[b, i, j] - want) < 1e-12
    assert np.all(big.latency[~(big.mask[:, :, None] & big.mask[:, None, :])] == 0)


def test_scenario_depends_only_on_seed_and_index():
    a = g.generate(7, 50)
    b = g.generate(7, 5)
    c = g.generate(7, 5, start=20)
    other = g.generate(8, 5)
    for f in ("site", "replicas", "capacity", "demand", "latency", "buffer", "burst_cell"):
        np.testing.assert_array_equal(getattr(a, f)[:5], getattr(b, f))
        np.testing.assert_array_equal(getattr(a, f)[20:25], getattr(c, f))
    assert not np.array_equal(a.demand[:5], other.demand)
    np.testing.assert_array_equal(c.indices, np.arange(20, 25))
    # trial fluctuations too
    _, ra = g.arrival_profiles(a, trial=3)
    _, rc = g.arrival_profiles(c, trial=3)
    np.testing.assert_array_equal(ra[20:25], rc)
    _, rc4 = g.arrival_profiles(c, trial=4)
    assert not np.array_equal(rc, rc4)


# --- the service model -----------------------------------------------------------------


def test_server_model_at_the_mean_token_times():
    # T_p = 1000 * 1.25e-4 = 0.125 s, T_d = 250 * 4e-3 = 1 s: c_p = 1/0.125 = 8 = 8/1 = c_d.
    srv = g.server_service(1.25e-4, 4e-3)
    scv = 1.5 * 600**2 / 1000**2  # prefill bottleneck at the tie: 0.54
    assert float(srv["capacity"]) == pytest.approx(8.0, rel=1e-14)
    assert float(srv["base_latency"]) == pytest.approx(1.125, rel=1e-14)
    assert float(srv["a0"]) == pytest.approx((1 + scv) / 16, rel=1e-14)
    assert float(srv["knee"]) == pytest.approx(9 - (1 + scv) / 2, rel=1e-14)
    assert float(srv["width"]) == pytest.approx(3.0, rel=1e-14)
    # decode-bound when decode is slower: c = 8/(250 * 5e-3) = 6.4, SCV of D
    srv = g.server_service(1.25e-4, 5e-3)
    scv_d = 1.2 * 200**2 / 250**2
    assert float(srv["capacity"]) == pytest.approx(6.4, rel=1e-14)
    assert float(srv["a0"]) == pytest.approx((1 + scv_d) / 12.8, rel=1e-14)
    assert not bool(srv["prefill_bound"])


def test_token_count_moments():
    rng = np.random.default_rng(0)
    for dist in (g.PREFILL_TOKENS, g.DECODE_TOKENS):
        x = dist.sample(rng, 400_000)
        assert abs(x.mean() / dist.mean - 1) < 0.005
        assert abs(x.var() / x.mean() ** 2 / dist.scv - 1) < 0.02
        assert x.min() >= dist.shift
    assert g.PREFILL_TOKENS.mean == 1000 and g.DECODE_TOKENS.mean == 250


def test_cells_scale_servers_by_replicas_and_a0_positive(big):
    m = big.mask
    srv = g.server_service(big.prefill_token_time[m], big.decode_token_time[m])
    k = big.replicas[m]
    np.testing.assert_allclose(big.capacity[m], k * srv["capacity"], rtol=1e-14)
    np.testing.assert_allclose(big.knee[m], k * srv["knee"], rtol=1e-14)
    np.testing.assert_allclose(big.width[m], k * srv["width"], rtol=1e-14)
    np.testing.assert_allclose(big.base_latency[m], srv["base_latency"], rtol=1e-14)
    a0 = big.base_latency - big.knee / big.capacity
    assert np.all(a0[m] > 0.05 * big.base_latency[m])  # far from the a0 = 0 edge
    np.testing.assert_allclose(a0[m], srv["a0"], rtol=1e-12)
    # baseline latencies: hundreds of ms to seconds (seed App. B.2)
    assert 0.3 < big.base_latency[m].min() and big.base_latency[m].max() < 3.0
    # the knee keeps l(0) within 11% of L0
    l0 = g.softplus_latency(0.0, big.capacity, big.base_latency, big.knee, big.width)
    assert np.all((l0 / big.base_latency - 1)[m] < 0.11)


def test_heavy_traffic_matches_pollaczek_khinchine():
    """(1 - rho) N(rho) -> k (1 + c_s^2)/2 as rho -> 1 for the softplus cell."""
    k = 7
    srv = g.server_service(1.1e-4, 4.5e-3)
    C, L0, N0, s = (
        k * float(srv["capacity"]),
        float(srv["base_latency"]),
        k * float(srv["knee"]),
        k * float(srv["width"]),
    )
    scv = g.PREFILL_TOKENS.scv if bool(srv["prefill_bound"]) else g.DECODE_TOKENS.scv
    for rho in (0.999, 0.9999):
        N = scipy.optimize.brentq(
            lambda N: ref_softplus_rate(N, C, L0, N0, s) - rho * C, 0.0, 1e9, xtol=1e-12, rtol=1e-14
        )
        assert (1 - rho) * N / rho == pytest.approx(k * (1 + scv) / 2, rel=1e-9)


def test_buffer_is_the_98_percent_workload(small):
    m = small.mask
    for b, j in zip(*np.nonzero(m)):
        C, L0, N0, s = (
            small.capacity[b, j],
            small.base_latency[b, j],
            small.knee[b, j],
            small.width[b, j],
        )
        B = scipy.optimize.brentq(
            lambda N: ref_softplus_rate(N, C, L0, N0, s) - 0.98 * C,
            0.0,
            1e7,
            xtol=1e-13,
            rtol=1e-15,
        )
        assert small.buffer[b, j] == pytest.approx(B, rel=1e-10)
        # 95% steady state fits; an overload of 1.2 C from the 80% state overflows inside
        # the 240 s event window (dN/dt >= 1.2 C - C)
        N95 = scipy.optimize.brentq(
            lambda N: ref_softplus_rate(N, C, L0, N0, s) - 0.95 * C, 0.0, 1e7
        )
        N80 = scipy.optimize.brentq(
            lambda N: ref_softplus_rate(N, C, L0, N0, s) - 0.80 * C, 0.0, 1e7
        )
        assert N95 < 0.75 * small.buffer[b, j]
        assert (small.buffer[b, j] - N80) / (0.2 * C) < 60.0


def test_duration_scaling_keeps_utilisation_and_scales_rates():
    base = g.generate(4, 30)
    for y in g.DURATION_SCALES:
        gy = g.generate(4, 30, duration_scale=y)
        m = base.mask
        np.testing.assert_allclose(gy.demand[m], y * base.demand[m], rtol=1e-13)
        np.testing.assert_allclose(gy.capacity[m], y * base.capacity[m], rtol=1e-13)
        np.testing.assert_allclose(gy.base_latency[m], base.base_latency[m] / y, rtol=1e-13)
        np.testing.assert_allclose(
            gy.prefill_token_time[m], base.prefill_token_time[m] / y, rtol=1e-15
        )
        np.testing.assert_allclose(gy.knee[m], base.knee[m], rtol=1e-12)
        np.testing.assert_allclose(gy.width[m], base.width[m], rtol=1e-12)
        np.testing.assert_allclose(gy.buffer[m], base.buffer[m], rtol=1e-9)
        np.testing.assert_allclose(gy.total_utilisation(), 0.8, atol=1e-12)
        np.testing.assert_array_equal(gy.latency, base.latency)


# --- events ----------------------------------------------------------------------------


def test_burst_raises_one_cell_to_exactly_95_percent(small):
    ds = g.scenario_dicts(small, event="burst", fluctuation=0.0)
    for b, d in enumerate(ds):
        cap = sum(c["service"]["capacity"] for c in d["cells"])
        for t, want in (
            (0.0, 0.8),
            (179.9, 0.8),
            (180.0, 0.95),
            (300.0, 0.95),
            (419.9, 0.95),
            (420.0, 0.8),
            (599.0, 0.8),
        ):
            lam = sum(profile_at(c["arrival_rate"], t) for c in d["cells"])
            assert abs(lam / cap - want) < 1e-12
        changed = [j for j, c in enumerate(d["cells"]) if isinstance(c["arrival_rate"], dict)]
        assert changed == [small.burst_cell[b]]
    sources = g.generate(5, 2000).burst_cell
    n = g.generate(5, 2000).n_cells
    assert np.all(sources < n)
    assert abs((sources / n).mean() - ((n - 1) / (2 * n)).mean()) < 0.02  # uniform slot


def test_outage_cuts_cells_to_one_until_above_95_percent(small):
    ds = g.scenario_dicts(small, event="outage", fluctuation=0.0)
    for b, d in enumerate(ds):
        k = [c["replicas"] for c in d["cells"]]
        lam = sum(c["arrival_rate"] for c in d["cells"])
        cut = {
            j: c["replica_schedule"] for j, c in enumerate(d["cells"]) if "replica_schedule" in c
        }
        for j, sch in cut.items():
            assert sch == {"times": [0.0, 180.0, 420.0], "replicas": [k[j], 1, k[j]]}
        # independent replay: cut in the drawn order, cells with one replica skipped
        order = [j for j in small.outage_order[b] if small.mask[b, j] and k[j] > 1]
        during, replay = list(k), []
        for j in order:
            if lam / capacity_with(d, during) > 0.95:
                break
            during[j] = 1
            replay.append(j)
        assert set(replay) == set(cut)
        util = lam / capacity_with(d, during)
        assert util > 0.95 or len(cut) == len(order)
        if cut:  # the last cut was needed
            undo = list(during)
            undo[replay[-1]] = k[replay[-1]]
            assert lam / capacity_with(d, undo) <= 0.95


def test_spikes_carry_a_fifth_of_each_minute(small):
    ds = g.scenario_dicts(small, event="spikes", fluctuation=0.0)
    d = ds[0]
    for j, c in enumerate(d["cells"]):
        lam = small.demand[0, j]
        ts, rs = np.array(c["arrival_rate"]["times"]), np.array(c["arrival_rate"]["rates"])
        for m in range(10):
            sel = (ts >= 60 * m) & (ts <= 60 * m + 60)
            t_m, r_m = ts[sel], rs[sel]
            if t_m[-1] < 60 * m + 60:
                t_m, r_m = np.append(t_m, 60 * m + 60), np.append(r_m, rs[-1])
            assert np.trapezoid(r_m, t_m) == pytest.approx(60 * lam, rel=1e-12)
            # triangle of width 1 s: peak (0.8 + 0.2 * 60 * 2) lambda at t = 60 m + 0.5
            assert profile_at(c["arrival_rate"], 60 * m + 0.5) == pytest.approx(24.8 * lam)
            assert profile_at(c["arrival_rate"], 60 * m + 30) == pytest.approx(0.8 * lam)


def test_trial_fluctuations():
    gen = g.generate(9, 200)
    t, r0 = g.arrival_profiles(gen, fluctuation=0.0)
    assert t.tolist() == [0.0]
    t, r = g.arrival_profiles(gen, trial=2, fluctuation=0.1)
    np.testing.assert_allclose(t, np.arange(61) * 10.0)
    f = r[gen.mask] / gen.demand[gen.mask][:, None]
    assert abs(f.mean() - 1) < 0.002 and abs(f.std() - 0.1) < 0.002  # N(1, 0.1^2) knots
    # lag-one knots are independent
    assert abs(np.corrcoef(f[:, :-1].ravel(), f[:, 1:].ravel())[0, 1]) < 0.02
    _, rbig = g.arrival_profiles(gen, trial=2, fluctuation=3.0)
    assert rbig.min() == 0.0 and (rbig[gen.mask] == 0).mean() > 0.3  # clipped, not negative
    # burst with noise: the event profile times the same trial factor
    tb, rb = g.arrival_profiles(gen, event="burst", trial=2, fluctuation=0.1)
    burst = g.burst_demand(gen)
    i = np.searchsorted(tb, 300.0)
    np.testing.assert_allclose(
        rb[:, :, i], burst * r[:, :, 30] / np.where(gen.mask, gen.demand, 1), rtol=1e-12
    )


def test_dicts_parse_through_scenario_from_dict(small):
    for event in g.EVENTS:
        ds = g.scenario_dicts(small, event=event, trial=1, fluctuation=0.05)
        for b, d in enumerate(ds[:8]):
            scn = dl.scenario_from_dict(d, allow_overload=True)
            n = small.n_cells[b]
            assert scn.cell_names == tuple(small.cell_names[b, :n])
            np.testing.assert_array_equal(scn.service.capacity, small.capacity[b, :n])
            np.testing.assert_array_equal(scn.service.knee, small.knee[b, :n])
            np.testing.assert_array_equal(scn.latency, small.latency[b, :n, :n])
            np.testing.assert_array_equal(scn.buffer, small.buffer[b, :n])
            if event == "outage":
                k_out = g.outage_replicas(small)[b, :n]
                np.testing.assert_array_equal(scn.replica_counts[:, 1], k_out)
    # the nominal scenario satisfies Assumption 2 without allow_overload
    for d in g.scenario_dicts(small, fluctuation=0.0)[:10]:
        dl.scenario_from_dict(d)


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: g.generate(0, 5, max_cells=40), ["max_cells", "40", "25 sites"]),
        (lambda: g.generate(0, 5, min_cells=6, max_cells=4), ["min_cells", "max_cells"]),
        (lambda: g.generate(0, 5, utilisation=1.0), ["utilisation", "< 1.0"]),
        (lambda: g.generate(0, 5, duration_scale=0.0), ["duration_scale", "> 0"]),
        (lambda: g.generate(-1, 5), ["seed", ">= 0"]),
        (lambda: g.generate(0, 0), ["count", ">= 1"]),
        (lambda: g.scenario_dicts(g.generate(0, 2), event="quake"), ["event", "quake", "burst"]),
        (lambda: g.scenario_dicts(g.generate(0, 2), trial=-1), ["trial", ">= 0"]),
        (lambda: g.scenario_dicts(g.generate(0, 2), fluctuation=-0.1), ["fluctuation", ">= 0"]),
        (
            lambda: g.scenario_dicts(g.generate(0, 2, utilisation=0.96), event="burst"),
            ["level", "utilisation"],
        ),
    ],
)
def test_bad_input_names_the_argument(call, words):
    with pytest.raises(ValueError) as e:
        call()
    for w in words:
        assert w in str(e.value)
