"""Independent float64 reference implementation of the delayed DLB fluid model.

Plain numpy + scipy (no jax).  Used by the test suite to validate the JAX
solver.  The model is the *tick model*:

* ticks t_k = k*h; routing x(t) = x^k on [t_k, t_{k+1}), x(t) = x^0 for t < 0;
* for k >= 1 router i updates at t_k from observed costs
  chat_ij = f_j(N_j(t_k - tau_ij)) + g_ij  (N(t) = N(0) for t < 0);
* dN_j/dt = sum_i lambda_i(t - tau_ij) x_ij(t - tau_ij) - mu_j(N_j(t)).

The workload ODE is integrated by the method of steps with
``scipy.integrate.solve_ivp`` separately on every sub-interval of a tick on
which the right-hand side is smooth (routing switches at t_k + r_ij and rate
kinks at b_p + tau_ij), keeping the dense outputs for delayed observations.
"""

from __future__ import annotations

import bisect
import math

import numpy as np
from scipy.integrate import solve_ivp
from scipy.optimize import linprog
from scipy.special import expit

__all__ = [
    "POLICIES",
    "service_functions",
    "inverse_mu_prime_function",
    "simplex_projection",
    "parse_scenario",
    "delay_decomposition",
    "reference_simulate",
]

POLICIES = (
    "flow-rif", "flow-lat", "flow-grad", "disc-rif", "disc-lat", "disc-grad", "rand", "mnlb",
)  # fmt: skip


# ---------------------------------------------------------------------------
# service models
# ---------------------------------------------------------------------------
def _service_params(service: dict):
    model = str(service.get("model", "mm1")).lower()
    if model == "mm1":
        return ("mm1", float(service["capacity"]))
    if model == "softplus":
        return (
            "softplus",
            float(service["base_latency"]),
            1.0 / float(service["capacity"]),
            float(service["knee"]),
            float(service["width"]),
        )
    raise ValueError(f"unknown service model {model!r}")


def service_functions(service: dict):
    """Return numpy callables ``(mu, mu_prime, latency)`` of one cell's service model."""
    p = _service_params(service)
    if p[0] == "mm1":
        c = p[1]

        def mu(N):
            N = np.asarray(N, dtype=np.float64)
            return c * N / (1.0 + N)

        def mu_prime(N):
            N = np.asarray(N, dtype=np.float64)
            return c / (1.0 + N) ** 2

        def latency(N):
            N = np.asarray(N, dtype=np.float64)
            return (1.0 + N) / c

        return mu, mu_prime, latency

    _, L0, beta, N0, s = p

    def latency(N):
        N = np.asarray(N, dtype=np.float64)
        return L0 + beta * s * np.logaddexp(0.0, (N - N0) / s)

    def mu(N):
        N = np.asarray(N, dtype=np.float64)
        return N / latency(N)

    def mu_prime(N):
        N = np.asarray(N, dtype=np.float64)
        l = latency(N)
        q = l - N * beta * expit((N - N0) / s)
        return q / l**2

    return mu, mu_prime, latency


def inverse_mu_prime_function(service: dict):
    """Return a numpy callable N -> 1/mu'(N) (computed as l^2/q for softplus)."""
    p = _service_params(service)
    if p[0] == "mm1":
        c = p[1]
        return lambda N: (1.0 + np.asarray(N, dtype=np.float64)) ** 2 / c
    _, L0, beta, N0, s = p

    def inv(N):
        N = np.asarray(N, dtype=np.float64)
        u = (N - N0) / s
        l = L0 + beta * s * np.logaddexp(0.0, u)
        q = l - N * beta * expit(u)
        return l**2 / q

    return inv


class _VectorService:
    """All cells' service functions, vectorised over the cell axis."""

    def __init__(self, services):
        n = len(services)
        params = [_service_params(s) for s in services]
        self.is_mm1 = np.array([p[0] == "mm1" for p in params])
        self.all_mm1 = bool(self.is_mm1.all())
        self.all_sp = bool((~self.is_mm1).all())
        self.c = np.ones(n)
        self.L0 = np.ones(n)
        self.beta = np.ones(n)
        self.N0 = np.zeros(n)
        self.s = np.ones(n)
        for j, p in enumerate(params):
            if p[0] == "mm1":
                self.c[j] = p[1]
            else:
                _, self.L0[j], self.beta[j], self.N0[j], self.s[j] = p

    def mu(self, N):
        if self.all_mm1:
            return self.c * N / (1.0 + N)
        l = self.L0 + self.beta * self.s * np.logaddexp(0.0, (N - self.N0) / self.s)
        sp = N / l
        if self.all_sp:
            return sp
        return np.where(self.is_mm1, self.c * N / (1.0 + N), sp)

    def latency(self, N):
        sp = self.L0 + self.beta * self.s * np.logaddexp(0.0, (N - self.N0) / self.s)
        return np.where(self.is_mm1, (1.0 + N) / self.c, sp)

    def inv_mu_prime(self, N):
        u = (N - self.N0) / self.s
        l = self.L0 + self.beta * self.s * np.logaddexp(0.0, u)
        q = l - N * self.beta * expit(u)
        return np.where(self.is_mm1, (1.0 + N) ** 2 / self.c, l**2 / q)


# ---------------------------------------------------------------------------
# simplex projection
# ---------------------------------------------------------------------------
def _project_row(v, mask):
    out = np.zeros_like(v)
    idx = np.flatnonzero(mask)
    if idx.size == 0:
        return out
    w = v[idx]
    u = np.sort(w)[::-1]
    css = np.cumsum(u) - 1.0
    ks = np.arange(1, u.size + 1)
    cond = u - css / ks > 0
    rho = np.flatnonzero(cond)[-1]
    theta = css[rho] / (rho + 1.0)
    out[idx] = np.maximum(w - theta, 0.0)
    return out


def simplex_projection(v, mask=None):
    """Euclidean projection of ``v`` onto {x >= 0, sum x = 1, x_j = 0 where ~mask}.

    ``v`` may be 1-D or 2-D (row-wise projection).  Rows with no allowed entry
    are returned as all zeros.
    """
    v = np.asarray(v, dtype=np.float64)
    mask = (
        np.ones(v.shape, dtype=bool)
        if mask is None
        else np.broadcast_to(np.asarray(mask, dtype=bool), v.shape)
    )
    if v.ndim == 1:
        return _project_row(v, mask)
    if v.ndim == 2:
        return np.stack([_project_row(v[i], mask[i]) for i in range(v.shape[0])])
    raise ValueError("simplex_projection expects a 1-D or 2-D array")


# ---------------------------------------------------------------------------
# scenario parsing
# ---------------------------------------------------------------------------
class _Rate:
    """lambda(t): constant, or piecewise linear through (times, rates)."""

    def __init__(self, spec):
        if isinstance(spec, dict):
            T = np.asarray(spec["times"], dtype=np.float64).ravel()
            R = np.asarray(spec["rates"], dtype=np.float64).ravel()
            if T.size != R.size or T.size == 0:
                raise ValueError("arrival_rate times/rates must be non-empty and of equal length")
            if np.any(np.diff(T) < 0):
                raise ValueError("arrival_rate times must be non-decreasing")
            self.T, self.R = T, R
            self.constant = T.size == 1 or bool(np.all(R == R[0]))
            self.value = float(R[0])
        else:
            self.T = np.zeros(0)
            self.R = np.zeros(0)
            self.constant = True
            self.value = float(spec)

    def segment(self, s):
        """Linear piece containing s (right-continuous): rate(s') = c0 + slope*(s' - t0)."""
        if self.constant:
            return self.value, 0.0, 0.0
        T, R = self.T, self.R
        if s < T[0]:
            return float(R[0]), 0.0, 0.0
        if s >= T[-1]:
            return float(R[-1]), 0.0, 0.0
        p = int(np.searchsorted(T, s, side="right")) - 1  # T[p] <= s < T[p+1]
        slope = (R[p + 1] - R[p]) / (T[p + 1] - T[p])
        return float(R[p]), float(slope), float(T[p])

    def __call__(self, s):
        c0, slope, t0 = self.segment(float(s))
        return c0 + slope * (float(s) - t0)

    def integral(self, a, b):
        """int_a^b rate (exact for the piecewise-linear profile)."""
        if self.constant:
            return self.value * (b - a)
        pts = sorted({a, b, *[t for t in self.T if a < t < b]})
        return sum(0.5 * (q - p) * (self(p) + self(q)) for p, q in zip(pts[:-1], pts[1:]))


def parse_scenario(scenario: dict) -> dict:
    cells = scenario["cells"]
    n = len(cells)
    rates = [_Rate(c["arrival_rate"]) for c in cells]
    replicas = np.array([float(c.get("replicas", 1)) for c in cells])
    services = [c["service"] for c in cells]
    lat = scenario["latency"]
    tau = np.zeros((n, n))
    allowed = np.zeros((n, n), dtype=bool)
    for i in range(n):
        for j in range(n):
            v = lat[i][j]
            if v is None:
                continue
            v = float(v)
            if not math.isfinite(v):
                continue
            if v < 0:
                raise ValueError("negative latency")
            tau[i, j] = v
            allowed[i, j] = True
    init = scenario.get("initial") or {}
    if init.get("workload") is not None:
        N0 = np.asarray(init["workload"], dtype=np.float64).reshape(n)
    else:
        N0 = np.zeros(n)
    if init.get("routing") is not None:
        x0 = np.asarray(init["routing"], dtype=np.float64).reshape(n, n).copy()
        x0[~allowed] = 0.0
    else:
        w = np.where(allowed, replicas[None, :], 0.0)
        tot = w.sum(axis=1, keepdims=True)
        x0 = np.divide(w, tot, out=np.zeros_like(w), where=tot > 0)
    return dict(
        n=n,
        rates=rates,
        replicas=replicas,
        services=services,
        tau=tau,
        allowed=allowed,
        N0=N0,
        x0=x0,
    )


def mnlb_routing(lam, tau, allowed, capacity, cap=0.9):
    """MNLB's routing weights (seed §1.1): the transportation LP min sum tau_ij y_ij s.t.
    sum_j y_ij = lam_i, sum_i y_ij <= cap * capacity_j, y >= 0 on allowed arcs, by HiGHS.
    Rows without demand route to their nearest allowed cell. Only the feasible case (the
    demand fits under the cap); the elastic overload rule is not reproduced here."""
    n = len(lam)
    arcs = [(i, j) for i in range(n) for j in range(n) if allowed[i, j] and lam[i] > 0]
    c = np.array([tau[i, j] for i, j in arcs])
    A_eq = np.zeros((n, len(arcs)))
    A_ub = np.zeros((n, len(arcs)))
    for k, (i, j) in enumerate(arcs):
        A_eq[i, k] = 1.0
        A_ub[j, k] = 1.0
    keep = lam > 0
    res = linprog(c, A_ub=A_ub, b_ub=cap * np.asarray(capacity), A_eq=A_eq[keep],
                  b_eq=np.asarray(lam)[keep], method="highs")  # fmt: skip
    if res.status != 0:
        raise ValueError(f"MNLB LP not solved ({res.message}); the reference needs feasible demand")
    x = np.zeros((n, n))
    for k, (i, j) in enumerate(arcs):
        x[i, j] = res.x[k] / lam[i]
    for i in range(n):
        if lam[i] <= 0 and allowed[i].any():
            j = int(np.argmin(np.where(allowed[i], tau[i], np.inf)))
            x[i, j] = 1.0
    return x


def delay_decomposition(tau, h):
    """m_ij = floor(tau_ij/h + 1e-9), r_ij = max(tau_ij - m_ij*h, 0)."""
    tau = np.asarray(tau, dtype=np.float64)
    m = np.floor(tau / h + 1e-9).astype(np.int64)
    r = np.maximum(tau - m * h, 0.0)
    return m, r


# ---------------------------------------------------------------------------
# simulation
# ---------------------------------------------------------------------------
def reference_simulate(
    scenario: dict,
    policy: str,
    *,
    step_size=0.0,
    tick: float,
    horizon: float,
    rtol=1e-12,
    atol=1e-12,
    method="DOP853",
) -> dict:
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")
    sc = parse_scenario(scenario)
    n, tau, allowed, rates = sc["n"], sc["tau"], sc["allowed"], sc["rates"]
    h = float(tick)
    K = int(round(float(horizon) / h))
    svc = _VectorService(sc["services"])
    kinv = 1.0 / sc["replicas"]
    eta = np.broadcast_to(np.asarray(step_size, dtype=np.float64), (n,)).astype(np.float64)
    m, r = delay_decomposition(tau, h)
    has_row = allowed.any(axis=1)

    kind, _, cost_name = policy.partition("-")
    if cost_name == "rif":
        g = np.zeros((n, n))
    else:
        g = 2.0 * tau

    def cell_cost(Nobs):  # Nobs: (n, n) observed N_j per arc (i, j)
        if cost_name == "rif":
            return Nobs * kinv[None, :]
        if cost_name == "lat":
            return svc.latency(Nobs)
        return svc.inv_mu_prime(Nobs)

    # routing history
    X = np.zeros((K + 1, n, n))
    X[0] = sc["x0"]

    # rate kinks b_p + tau_ij (as times t), for arcs with non-constant rate
    kinks = sorted(
        {
            float(b) + tau[i, j]
            for i in range(n)
            if not rates[i].constant
            for j in range(n)
            if allowed[i, j]
            for b in rates[i].T
        }
    )
    r_in = sorted({float(v) for v in r[allowed] if 0.0 < v < h})
    all_const = all(rt.constant for rt in rates)
    lam_const = np.array([rt.value for rt in rates]) if all_const else None

    # dense-output storage
    p_start: list[float] = []
    p_end: list[float] = []
    p_sol: list = []
    p_yend: list[np.ndarray] = []
    N0 = sc["N0"]

    def N_at(s):
        if s <= 0.0 or not p_start:
            return N0
        idx = bisect.bisect_right(p_start, s) - 1
        if idx < 0:
            return N0
        if s >= p_end[idx]:
            return p_yend[idx][:n]
        return p_sol[idx](s)[:n]

    def observe(tk):
        Nobs = np.zeros((n, n))
        for d in np.unique(tau[allowed]):
            Nv = N_at(tk - d)
            sel = allowed & (tau == d)
            Nobs[sel] = np.broadcast_to(Nv[None, :], (n, n))[sel]
        return Nobs

    period = 10.0  # MNLB's update period (the MNLB policy's default)

    def mnlb_at(t):
        """The weights MNLB uses on the tick whose midpoint is t: those of the last update
        p*period <= t, computed from the rates measured over the period before it."""
        p = math.floor(t / period + 1e-9)
        tp = p * period
        lam = np.array([rt.integral(tp - period, tp) / period for rt in rates])
        cap = np.array([float(svc_caps[j]) for j in range(n)])
        return mnlb_routing(lam, tau, allowed, cap)

    svc_caps = [float(sv["capacity"]) for sv in sc["services"]]
    if kind == "mnlb":
        X[0] = mnlb_at(0.0)

    def update(k):
        tk = k * h
        if kind == "rand":
            return X[0].copy()
        if kind == "mnlb":
            return mnlb_at(tk + 0.5 * h)
        chat = cell_cost(observe(tk)) + g
        if kind == "flow":
            v = X[k - 1] - (eta * h)[:, None] * chat
            v = np.where(allowed, v, 0.0)
            return simplex_projection(v, allowed)
        # disc: indicator of argmin with exact ties split equally
        xn = np.zeros((n, n))
        c = np.where(allowed, chat, np.inf)
        for i in range(n):
            if not has_row[i]:
                continue
            ties = allowed[i] & (c[i] == c[i].min())
            xn[i, ties] = 1.0 / ties.sum()
        return xn

    def rate_coeffs(tm):
        """inflow_j(t) = A_j + B_j t on the piece containing tm, per-arc (alpha, beta)."""
        alpha = np.zeros((n, n))
        beta = np.zeros((n, n))
        for i in range(n):
            for j in range(n):
                if not allowed[i, j]:
                    continue
                c0, slope, t0 = rates[i].segment(tm - tau[i, j])
                alpha[i, j] = c0 - slope * (tau[i, j] + t0)
                beta[i, j] = slope
        return alpha, beta

    Nrec = np.zeros((K + 1, n))
    dep = np.zeros((K + 1, n))
    arr = np.zeros((K + 1, n))
    Nrec[0] = N0
    y = np.concatenate([N0, np.zeros(n), np.zeros(n)])
    mu_vec = svc.mu

    for k in range(K + 1):
        tk = k * h
        if k >= 1:
            X[k] = update(k)
        if k == K:
            break
        tk1 = (k + 1) * h
        # breakpoints inside the tick
        bps = [tk] + [tk + v for v in r_in]
        if kinks:
            lo = bisect.bisect_right(kinks, tk)
            hi = bisect.bisect_left(kinks, tk1)
            bps.extend(kinks[lo:hi])
        bps.append(tk1)
        bps = sorted(set(bps))
        # routing levels (clamped at 0) before / after t_k + r_ij
        old_idx = np.maximum(k - m - 1, 0)
        new_idx = np.maximum(k - m, 0)
        rows = np.arange(n)[:, None]
        cols = np.arange(n)[None, :]
        X_old = np.where(allowed, X[old_idx, rows, cols], 0.0)
        X_new = np.where(allowed, X[new_idx, rows, cols], 0.0)
        for a, b in zip(bps[:-1], bps[1:], strict=True):
            if b - a <= 1e-12 * max(1.0, abs(b)):
                continue
            tm = 0.5 * (a + b)
            Xd = np.where(tm < tk + r, X_old, X_new)
            if all_const:
                A = lam_const @ Xd
                B = np.zeros(n)
            else:
                alpha, beta = rate_coeffs(tm)
                A = (Xd * alpha).sum(axis=0)
                B = (Xd * beta).sum(axis=0)

            if all_const:

                def rhs(t, yy, A=A):
                    mm = mu_vec(yy[:n])
                    return np.concatenate((A - mm, mm, A))
            else:

                def rhs(t, yy, A=A, B=B):
                    mm = mu_vec(yy[:n])
                    inflow = A + B * t
                    return np.concatenate((inflow - mm, mm, inflow))

            sol = solve_ivp(rhs, (a, b), y, method=method, rtol=rtol, atol=atol, dense_output=True)
            if not sol.success:
                raise RuntimeError(f"solve_ivp failed on [{a}, {b}]: {sol.message}")
            y = sol.y[:, -1].copy()
            p_start.append(a)
            p_end.append(b)
            p_sol.append(sol.sol)
            p_yend.append(y)
        Nrec[k + 1] = y[:n]
        dep[k + 1] = y[n : 2 * n]
        arr[k + 1] = y[2 * n :]

    t = np.arange(K + 1) * h
    return {"t": t, "N": Nrec, "x": X, "departures": dep, "arrivals": arr}
