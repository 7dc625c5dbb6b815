"""The argument principle on the cell characteristic matrix (theory/stability.md §3.6-3.7).

The non-zero characteristic roots are those of $T(s) = s\\,\\mathrm{diag}(s+\\mu')\\,
(I - \\eta H(s))$ (`CellLoop`). Along the positive imaginary axis
$g(\\omega) = \\det(I - \\eta H(i\\omega))$ starts as $(i\\omega)^{-r}$ times a positive number
($r$ the rank of the inflow map) and ends at 1, and the number of roots in the open right
half-plane is $Z = -\\varphi(\\infty)/\\pi$ with $\\varphi$ the continuous phase of $g$ started
at $-r\\pi/2$: `roots_in_right_half_plane`, the one count that both the host method here
and the batched one (`batched.py`) use. They differ only in how they sample the phase: on
the host the eigenvalues $\\nu_k(\\omega)$ of $H(i\\omega)$ on an adaptive grid shared by every
$\\eta$ (`Loci`; $\\arg g = \\sum_k \\arg(1/\\eta - \\nu_k)$ up to a constant), in the batch
$\\det$ itself on a refined fixed grid. `nyquist_eta` brackets and bisects $\\eta$ on $Z > 0$
and polishes the crossing by Newton's method on the Hopf system; `Nyquist` is the member
of the method family.
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np

from .base import NO_ROOT, AbstractStabilityMethod
from .linearisation import CellLoop, Linearisation
from .search import Steps, begin, bracket
from .threads import on_one_blas_thread, one_blas_thread


def roots_in_right_half_plane(phase0, winding, phase_end, rank, xp=np):
    """$Z = -\\varphi(\\infty)/\\pi$, rounded: the number of characteristic roots in the open
    right half-plane by the argument principle (module docstring; theory/stability.md §3.6,
    §7).

    **Arguments:** `phase0` the principal phase of $g$ at the lowest sampled frequency,
    `winding` the sum of the true phase increments of $g$ over the sampled frequencies,
    `phase_end` the principal phase at the highest one ($g \\to 1$: its residual is
    removed), `rank` $r$ (the phase starts at $-r\\pi/2$; `phase0` is taken on the branch
    nearest to it), `xp` `numpy` on the host or `jax.numpy` inside a compiled batch.
    """
    start = -0.5 * xp.pi * rank
    phi = start + xp.angle(xp.exp(1j * (phase0 - start))) + winding - phase_end
    return xp.round(-phi / xp.pi)


class Unreliable(RuntimeError):
    """`Loci.count` cannot tell the eigenvalues of $H$ from rounding errors near $1/\\eta$."""


class Loci(CellLoop):
    """Eigenvalues $\\nu_k(\\omega)$ of $H(i\\omega) = -\\mathrm{diag}(1/(i\\omega(i\\omega +
    \\mu'_j)))\\,M(i\\omega)$ on a growing grid of frequencies (theory/stability.md §3.6).

    $T(s) = s\\,\\mathrm{diag}(s+\\mu')\\,(I - \\eta H(s))$, so $s = i\\omega$ is a root at step
    size $\\eta$ iff $1/\\eta$ is an eigenvalue of $H(i\\omega)$. Only the cells of some support
    enter (the others have $M$'s rows and columns zero and roots $0, -\\mu'_j$). The grid is
    a cache: the eigenvalues do not depend on $\\eta$, every count reuses them and only adds
    frequencies where a count needs a finer grid.
    """

    def __init__(self, lin: Linearisation, *, per_decade: int = 24, noise: float = 1e-13):
        super().__init__(lin)
        mask = self.mask
        cells = self.cells
        self.noise = float(noise)
        # rank of the inflow map = the number of loci that start at +i*infinity (§3.6)
        self.rank = lin._inflow_rank()
        # |H(iw)|_inf <= max_j R_j / (w sqrt(w^2 + a_j^2)), R = |G| f', |G| >= |M| / f'
        # entrywise with G = sum_i w_i lam_i |E_i P_i E_i| (independent of w)
        absG = (mask.T * self.c) @ mask
        absG[np.diag_indices_from(absG)] += (self.cw * (1.0 - 2.0 / mask.sum(1))) @ mask
        self.R = absG @ self.fp
        self.per_decade = int(per_decade)
        self.omega = np.zeros(0)
        self.nu = np.zeros((0, cells.size), complex)
        self.floor = np.zeros(0)
        self.links = [np.zeros((0, cells.size), t) for t in (int, float, int, float) * 2]
        # the lowest frequency: well below the scales 1/tau and mu' of the loci (a count
        # lowers it if the loci are not yet in their asymptotic regime there)
        self.eps = 1e-3 * min(1.0 / max(self.tmax, 1e-300), float(np.min(self.a)))

    # -- the grid ----------------------------------------------------------------------
    @on_one_blas_thread
    def add(self, omega) -> None:
        """Eigenvalues at the new frequencies `omega`, merged into the grid, and the
        nearest-neighbour links of every new interval (`_link`)."""
        omega = np.setdiff1d(np.asarray(omega, float), self.omega)
        if not omega.size:
            return
        out = np.empty((omega.size, self.cells.size), complex)
        floor = np.empty(omega.size)
        chunk = max(1, int(2**22 // max(self.cells.size**2 + self.mask.size, 1)))
        for a in range(0, omega.size, chunk):
            H = self.H(omega[a : a + chunk])
            ev = np.linalg.eigvals(H)
            # eigenvalues below the rounding level of |H| are zeros (the cells' own modes)
            fl = self.noise * np.linalg.norm(H, axis=(1, 2))
            out[a : a + chunk] = np.where(np.abs(ev) < fl[:, None], 0.0, ev)
            floor[a : a + chunk] = fl
        old = self.omega
        allw = np.concatenate([old, omega])
        order = np.argsort(allw)
        self.omega = allw[order]
        self.nu = np.concatenate([self.nu, out])[order]
        self.floor = np.concatenate([self.floor, floor])[order]
        new = order >= old.size
        G, m = self.omega.size, self.cells.size
        links = [np.zeros((G - 1, m), t) for t in (int, float, int, float) * 2]
        fresh = new[:-1] | new[1:]
        keep = np.nonzero(~fresh)[0]
        if keep.size:
            src = np.searchsorted(old, self.omega[keep])
            for dst, prev in zip(links, self.links):
                dst[keep] = prev[src]
        redo = np.nonzero(fresh)[0]
        for a in range(0, redo.size, 64):
            g = redo[a : a + 64]
            for dst, val in zip(links, self._link(self.nu[g], self.nu[g + 1])):
                dst[g] = val
        self.links = links

    @staticmethod
    def _link(A, B):
        """Nearest and second-nearest neighbours between the eigenvalues `A` at one end of
        an interval and `B` at the other: `(nn_b, gap_b, nn2_b, gap2_b, nn_a, gap_a, nn2_a,
        gap2_a)`, `nn_b[k]` the index in `A` nearest to `B[k]` and `gap_b[k]` its distance,
        `nn2_b`, `gap2_b` the runner-up (and the converse for `A`)."""
        out = []
        for D in (np.abs(B[:, :, None] - A[:, None, :]), np.abs(A[:, :, None] - B[:, None, :])):
            if D.shape[2] < 2:
                idx = np.zeros(D.shape[:2] + (2,), int)
            else:
                idx = np.argpartition(D, 1, axis=2)[:, :, :2]
            gap = np.take_along_axis(D, idx, axis=2)
            swap = gap[:, :, 1] < gap[:, :, 0]
            first = np.where(swap, idx[:, :, 1], idx[:, :, 0])
            second = np.where(swap, idx[:, :, 0], idx[:, :, 1])
            g1, g2 = np.min(gap, axis=2), np.max(gap, axis=2)
            if D.shape[2] < 2:
                g2 = np.full_like(g1, np.inf)
            out += [first, g1, second, g2]
        return out

    def top(self, nu0: float) -> float:
        """A frequency above which every $|\\nu_k(\\omega)| < \\nu_0/2$."""
        return float(np.max(np.sqrt(2.0 * self.R / nu0)))

    def cover(self, top: float) -> None:
        """Extend the grid to $[\\varepsilon, \\text{top}]$: `per_decade` logarithmic points,
        and steps of at most $0.25/\\tau_{max}$ (the phase $e^{-2i\\omega\\tau}$ turns by at
        most half a radian between neighbours)."""
        lo = self.eps if not self.omega.size else self.omega[-1]
        if self.omega.size and lo >= top:
            return
        k = max(2, int(math.ceil(self.per_decade * math.log10(top / lo))) + 1)
        grid = np.geomspace(lo, top, k)
        h = 0.25 / self.tmax
        fine = grid[np.nonzero(np.diff(grid) > h)[0]]
        if fine.size:
            grid = np.union1d(grid, np.arange(fine[0], top, h))
        self.add(grid)

    def count(self, eta: float):
        """The number $Z$ of characteristic roots in the open right half-plane at step size
        `eta`, and the grid intervals where a locus crosses the ray $(1/\\eta, \\infty)$
        (argument principle, theory/stability.md §3.6). Raises `RuntimeError` if the grid
        does not start in the asymptotic regime."""
        nu0 = 1.0 / float(eta)
        top = self.top(nu0)
        self.cover(top)
        while True:
            g = int(np.searchsorted(self.omega, top)) + 1
            nn_b, gap_b, nn2_b, gap2_b, nn_a, gap_a, nn2_a, gap2_a = (
                v[: g - 1] for v in self.links
            )
            f = nu0 - self.nu[:g]
            arg, dist = np.angle(f), np.abs(f)
            rows = np.arange(g - 1)[:, None]
            # every locus moves less than half its distance to nu0 (its phase by < pi/6)...
            loose = np.maximum(np.max(gap_b / dist[1:], axis=1), np.max(gap_a / dist[:-1], axis=1))
            # ...and the crossings of the ray counted from either end agree (they can
            # differ only where nearest neighbours do not pair up one to one)
            jump_b = np.round((arg[1:] - arg[:-1][rows, nn_b]) / (2.0 * math.pi))
            jump_a = np.round((arg[1:][rows, nn_a] - arg[:-1]) / (2.0 * math.pi))
            per = jump_b.sum(axis=1).astype(int)
            odd = per != jump_a.sum(axis=1)
            # ...and no pairing is in doubt (a runner-up within twice the distance of the
            # nearest neighbour) where the two candidates would count differently
            alt_b = np.round((arg[1:] - arg[:-1][rows, nn2_b]) / (2.0 * math.pi))
            alt_a = np.round((arg[1:][rows, nn2_a] - arg[:-1]) / (2.0 * math.pi))
            doubt = ((gap2_b < 2.0 * gap_b) & (alt_b != jump_b)).any(1)
            doubt |= ((gap2_a < 2.0 * gap_a) & (alt_a != jump_a)).any(1)
            bad = np.nonzero((loose > 0.5) | odd | doubt)[0]
            wa, wb = self.omega[bad], self.omega[bad + 1]
            bad = bad[wb - wa > 1e-13 * wb]
            if not bad.size:
                break
            self.add(0.5 * (self.omega[bad] + self.omega[bad + 1]))
        if np.max(self.floor[:g]) > 0.05 * nu0:
            raise Unreliable(
                f"characteristic loci: eigenvalues of H(i omega) carry rounding errors up to "
                f"{np.max(self.floor[:g]):.3g}, not small against 1/eta = {nu0:.3g} (cells "
                "near saturation, mu' ~ 0); use method='pseudospectral'"
            )
        start = np.sum(arg[0]) + 0.5 * math.pi * self.rank
        if abs(start) > 0.25 * math.pi:
            if self.eps > 1e-9 * self.omega[-1]:
                lower = self.eps
                self.eps *= 1e-2
                self.add(np.geomspace(self.eps, lower, 2 * self.per_decade + 1)[:-1])
                return self.count(eta)
            raise RuntimeError(
                f"characteristic loci at omega = {self.omega[0]:.3g} are not in the "
                f"asymptotic regime (phase offset {start:.3g}); use method='pseudospectral'"
            )
        # arg g = sum_k arg(nu0 - nu_k) + const; a locus crossing the ray (nu0, inf) jumps
        # by 2 pi in the principal argument of nu0 - nu_k, which the true increment is not
        total = np.sum(arg, axis=1)
        winding = total[-1] - total[0] - 2.0 * math.pi * per.sum()
        Z = roots_in_right_half_plane(total[0], winding, total[-1], self.rank)
        return int(Z), np.nonzero(per)[0]

    def crossing_guess(self, eta: float, intervals):
        """$(\\omega_0, v_0)$: the mid frequency of the crossing interval whose locus is
        closest to $1/\\eta$, and that eigenvector of $H(i\\omega_0)$."""
        nu0 = 1.0 / eta
        best = None
        for g in intervals:
            w = 0.5 * (self.omega[g] + self.omega[g + 1])
            with one_blas_thread():
                ev, V = np.linalg.eig(self.H(np.array([w]))[0])
            k = int(np.argmin(np.abs(ev - nu0)))
            dist = abs(ev[k] - nu0)
            if best is None or dist < best[0]:
                best = (dist, w, V[:, k])
        if best is None:
            raise ValueError("crossing_guess needs at least one crossing interval")
        return best[1], best[2]

    @on_one_blas_thread
    def hopf(self, eta0: float, omega0: float, v0: np.ndarray, iters: int = 40):
        """Newton's method on $T(i\\omega; \\eta)v = 0$, $c^Hv = 1$ in the real unknowns
        $(\\mathrm{Re}\\,v, \\mathrm{Im}\\,v, \\omega, \\eta)$; returns `(eta, omega, ok)`."""
        m = self.cells.size
        v = v0 / np.vdot(v0, v0) ** 0.5
        cH = v.conj()
        w, eta = float(omega0), float(eta0)
        A = np.zeros((2 * m + 2, 2 * m + 2))
        A[2 * m, :m], A[2 * m, m : 2 * m] = cH.real, -cH.imag
        A[2 * m + 1, :m], A[2 * m + 1, m : 2 * m] = cH.imag, cH.real
        for _ in range(iters):
            T, dT, M = (a[0] for a in self.cell_matrix(np.array([1j * w]), eta, derivatives=True))
            F = T @ v
            g = cH @ v - 1.0
            col_w = 1j * (dT @ v)
            col_e = M @ v
            A[:m, :m], A[:m, m : 2 * m] = T.real, -T.imag
            A[m : 2 * m, :m], A[m : 2 * m, m : 2 * m] = T.imag, T.real
            A[:m, 2 * m], A[m : 2 * m, 2 * m] = col_w.real, col_w.imag
            A[:m, 2 * m + 1], A[m : 2 * m, 2 * m + 1] = col_e.real, col_e.imag
            rhs = -np.concatenate([F.real, F.imag, [g.real, g.imag]])
            try:
                step = np.linalg.solve(A, rhs)
            except np.linalg.LinAlgError:
                return eta, w, False
            v = v + step[:m] + 1j * step[m : 2 * m]
            w, eta = w + step[2 * m], eta + step[2 * m + 1]
            if not (math.isfinite(w) and math.isfinite(eta) and w > 0 and eta > 0):
                return eta0, omega0, False
            if abs(step[2 * m]) <= 1e-15 * w and abs(step[2 * m + 1]) <= 1e-15 * eta:
                return eta, w, True
        return eta, w, bool(abs(step[2 * m + 1]) <= 1e-11 * eta)


def nyquist_eta(
    lin: Linearisation,
    eta0: float,
    rtol: float,
    steps: Steps,
    *,
    per_decade: int = 24,
    noise: float = 1e-13,
):
    """$\\eta^*$ and the crossing root by the argument principle on the cell characteristic
    matrix (theory/stability.md §3.6): bracket as `bisect_eta` on "some root in the right
    half-plane" (`Loci.count`), bisect to $10^{-7}$, then Newton's method on the Hopf
    system $T(i\\omega;\\eta)v = 0$; bisection continues to `rtol` if Newton leaves the
    bracket."""
    if float(lin.delays[-1]) == 0.0:
        # Without delays V = sum_j f'_j dN_j^2/2 + sum_i lam_i |w_i|^2/(2 eta_i) has
        # V' = -sum_j f'_j mu'_j dN_j^2 <= 0: stable for every step size (§3.6).
        return math.inf, NO_ROOT
    loci = Loci(lin, per_decade=per_decade, noise=noise)
    last: dict = {}

    def unstable(eta):
        # Rounding hides the loci near 1/eta only above some eta (1/eta small against the
        # loci at low frequency): such a step size counts as unstable, so that the bracket
        # moves down, and an answer that rests on it is refused below.
        try:
            Z, where = loci.count(eta)
        except Unreliable as e:
            last[eta] = e
            steps(f"eta {eta:.6g}: unresolved")
            return True
        last[eta] = where
        steps(f"eta {eta:.6g}: {Z} unstable roots, {loci.omega.size} frequencies")
        return Z > 0

    lo, hi = bracket(unstable, eta0)
    if lo == hi:
        return lo, NO_ROOT
    rough = max(rtol, 1e-7)
    steps.expect(math.ceil(math.log2(math.log(hi / lo) / math.log1p(rough))) + 1)
    while hi / lo - 1.0 > rough:
        mid = math.sqrt(lo * hi)
        if unstable(mid):
            hi = mid
        else:
            lo = mid
    if isinstance(last[hi], Unreliable):
        raise RuntimeError(f"{last[hi]} (the crossing lies above eta = {lo:.6g})")
    w0, v0 = loci.crossing_guess(hi, last[hi])
    eta, w, ok = loci.hopf(hi, w0, v0)
    if ok and lo * (1.0 - 1e-9) <= eta <= hi * (1.0 + 1e-9):
        return eta, complex(0.0, w)
    while hi / lo - 1.0 > rtol:
        mid = math.sqrt(lo * hi)
        if unstable(mid):
            hi = mid
        else:
            lo = mid
    w, _ = loci.crossing_guess(hi, last[hi])
    return hi, complex(0.0, w)


class Nyquist(AbstractStabilityMethod):
    """The argument principle on the cell characteristic matrix (theory/stability.md §3.6;
    `nyquist_eta`). `per_decade`: logarithmic frequencies per decade of the first grid;
    `noise`: the relative rounding level of the eigenvalues of $H(i\\omega)$ below which
    they count as zeros (the cells' own modes)."""

    name: ClassVar[str] = "nyquist"
    per_decade: int = 24
    noise: float = 1e-13

    @classmethod
    def named(cls, nodes: int) -> Nyquist:
        return cls()

    def solve(self, lin: Linearisation, symmetric, *, rtol: float, progress: bool):
        eta0, steps = begin(lin, self.name, progress)
        eta, root = nyquist_eta(
            lin, eta0, rtol, steps, per_decade=self.per_decade, noise=self.noise
        )
        steps.finish()
        return eta, root, self.name, 0

    def no_crossing(self) -> tuple[str, int]:
        return self.name, 0
