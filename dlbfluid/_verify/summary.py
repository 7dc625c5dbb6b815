"""`verify`'s summary: per policy Theorem 1's verdict with the run counts behind it, the
global threshold's censored counts and quantiles, the proof's audit, the thresholds and the
diagnostics (the results file is `dlbfluid._runtime.JsonLines`)."""

from __future__ import annotations

import math

import numpy as np


def _quantiles(v) -> dict:
    v = np.asarray([x for x in v if x is not None and math.isfinite(x)], float)
    if v.size == 0:
        return {"q10": None, "q50": None, "q90": None, "max": None}
    q = np.quantile(v, [0.1, 0.5, 0.9])
    return {"q10": float(q[0]), "q50": float(q[1]), "q90": float(q[2]), "max": float(v.max())}


def _fraction(v) -> float | None:
    v = [x for x in v if x is not None]
    return float(np.mean(v)) if v else None


def summarise(records: list[dict]) -> dict:
    """Per policy: Theorem 1's verdict first (`theorem1`: the runs inside its hypothesis
    and those under the explicit bound, as counts of counts, and the tightness bound /
    measured; also as the fractions `in_hypothesis_fraction`, `theorem1_holds_fraction`),
    the global threshold (`eta_global`, `global_threshold_summary`), the proof's audit
    (`audit`; `estimates_hold_fraction` as before), the three step-size thresholds, then
    the diagnostics (converged, the projection check, the descriptive fit; null where a
    record lacks them, e.g. without the ladder)."""
    out: dict = {"scenarios": len(records), "policies": {}}
    names = list(dict.fromkeys(p for r in records for p in r["policies"]))
    for pol in names:
        rs = [r["policies"][pol] for r in records]
        thm = [r.get("theorem1") or {} for r in rs]
        thr = [r.get("thresholds") or {} for r in rs]
        proj = [r.get("projection_check") or {} for r in rs]
        bound = [r.get("bound") or {} for r in rs]
        inside = [t for t in thm if t.get("in_hypothesis")]
        estimates = {k for t in thm for k in (t.get("estimates") or {})}
        out["policies"][pol] = {
            "theorem1": _theorem1(thm, thr),
            "eta_global": global_threshold_summary(thr),
            "step_vs_bracket": _tally([t.get("step_vs_bracket") for t in thr], STEP_PLACES),
            "audit": _audit(thm),
            "in_hypothesis_fraction": _fraction([t.get("in_hypothesis") for t in thm]),
            "theorem1_holds_fraction": _fraction([t.get("holds") for t in inside]),
            "tightness": _quantiles([t.get("tightness") for t in inside]),
            "estimates_hold_fraction": {
                k: _fraction([(t.get("estimates") or {}).get(k, {}).get("holds") for t in thm])
                for k in sorted(estimates)
            },
            "eta0_over_eta_star": _quantiles(
                [_ratio(t.get("eta0"), t.get("eta_star")) for t in thr]
            ),  # fmt: skip
            "eta_global_over_eta_star": (global_threshold_summary(thr) or {}).get(
                "over_eta_star", _quantiles([])
            ),
            "bistable_fraction": _fraction([t.get("bistable") for t in thr]),
            "converged_fraction": float(np.mean([r["converged"] for r in rs])) if rs else None,
            "failed": int(sum(r["status"] != "success" for r in rs)),
            "time_average_distance": _quantiles([r["time_average_distance"] for r in rs]),
            "final_distance": _quantiles([r["final_distance"] for r in rs]),
            "eta_over_eta_star": _quantiles([r["eta_over_eta_star"] for r in rs]),
            "projection_check_holds_fraction": _fraction([c.get("holds") for c in proj]),
            "discretisation_excess": _quantiles([c.get("discretisation_excess") for c in proj]),
            "bound_holds_fraction": _fraction([b.get("holds") for b in bound]),
            "A": _quantiles([b.get("A") for b in bound]),
            "B": _quantiles([b.get("B") for b in bound]),
            "C": _quantiles([b.get("C") for b in bound]),
            "fit_rel_rms": _quantiles([b.get("fit_rel_rms") for b in bound]),
            "schedule_slope": _quantiles([r.get("schedule_slope") for r in rs]),
            "g1_growth_exponent": _quantiles([r.get("g1_growth_exponent") for r in rs]),
            "empirical_eta0_over_eta_star": _quantiles(
                [r.get("empirical_eta0_over_eta_star") for r in rs]
            ),
        }
    return out


def _ratio(a, b) -> float | None:
    return None if a is None or b is None or not b else float(a) / float(b)


STEP_PLACES = ("below_lo", "inside", "above_hi", "undetermined")
"""The values of a record's `thresholds.step_vs_bracket`."""

CENSORING = ("bracketed", "below_range", "above_range", "failed")
QUANTILES = (("q10", 0.1), ("q50", 0.5), ("q90", 0.9))


def _tally(values, keys) -> dict | None:
    """`{key: count}` over the non-null `values` (`None` when all are null)."""
    seen = [v for v in values if v is not None]
    return {k: sum(v == k for v in seen) for k in keys} if seen else None


def _count(flags) -> dict:
    """`{"count", "of", "fraction"}` of the true ones among the non-null `flags`."""
    v = [bool(x) for x in flags if x is not None]
    return {"count": sum(v), "of": len(v), "fraction": float(np.mean(v)) if v else None}


def _theorem1(thm: list[dict], thr: list[dict]) -> dict:
    """Theorem 1's verdict with the runs behind every fraction: `n` runs with constants,
    `in_hypothesis` of those, `holds` of those inside, `fallback_step` (inside, but run at
    the fallback step for want of an $\\eta^*$), `tightness` quantiles with their `n`."""
    have = [t for t in thm if t]
    inside = [(t, h) for t, h in zip(thm, thr) if t.get("in_hypothesis")]
    tight = [t.get("tightness") for t, _ in inside]
    return {
        "n": len(have),
        "in_hypothesis": _count([t.get("in_hypothesis") for t in have]),
        "holds": _count([t.get("holds") for t, _ in inside]),
        "fallback_step": sum(h.get("eta_star") is None for _, h in inside),
        "tightness": {**_quantiles(tight), "n": sum(v is not None for v in tight)},
    }


AUDIT_NOTE = (
    "the proof's estimates checked along each run: they audit the proof's algebra and the "
    "code (a wrong constant or a bug fails them, as their negative controls show) and hold "
    "at any step size on a correct run, so they say nothing about convergence"
)


def _audit(thm: list[dict]) -> dict:
    """Each estimate of the proof's chain: `{"count", "of", "fraction"}` of the runs where
    it holds, under `estimates`, with `note` (`AUDIT_NOTE`)."""
    names = sorted({k for t in thm for k in (t.get("estimates") or {})})
    est = {
        k: _count([(t.get("estimates") or {}).get(k, {}).get("holds") for t in thm]) for k in names
    }
    return {"estimates": est, "note": AUDIT_NOTE}


def global_threshold_summary(thr: list[dict]) -> dict | None:
    """The global threshold over the scenarios with an $\\eta^*$ and a search verdict:
    `{"bracketed", "below_range", "above_range", "failed"}` counts (they add up to
    `with_eta_star`) and `over_eta_star`, the quantiles of $\\eta_g/\\eta^*$ that the
    censored values leave determined (`censored_quantiles`). `None` when no record was
    searched."""
    got = [t for t in thr if t.get("eta_global_censoring") is not None and t.get("eta_star")]
    if not got:
        return None
    counts = {c: sum(t["eta_global_censoring"] == c for t in got) for c in CENSORING}
    known, below, above = [], [], []
    for t in got:
        lo, hi = t["eta_global_bracket"]
        es, c = float(t["eta_star"]), t["eta_global_censoring"]
        if c == "bracketed":
            known.append(hi / es)
        elif c == "below_range":
            below.append(hi / es)
        elif c == "above_range":
            above.append(lo / es)
    return {
        "with_eta_star": len(got),
        **counts,
        "over_eta_star": censored_quantiles(known, below, above, counts["failed"]),
    }


def censored_quantiles(known, below, above, unknown: int = 0) -> dict:
    """Quantiles of a sample with censored members, as far as the censoring leaves them
    determined.

    `known`: exact values; `below`: members known only to lie below their bound;
    `above`: above theirs; `unknown`: members that could lie anywhere. The censored
    members lie outside the range of the known ones (a search range's ends), so the
    sample's order is known but for the `unknown`. The $q$-quantile is the order
    statistic of rank $\\lceil qN\\rceil$ (no interpolation, which a censored neighbour
    could move), taken with the unknown members all lowest and all highest: when both
    give the same known member it is that number; when both fall among the `below`
    members it is the string `"< b"` (`b` the largest of their bounds), among the `above`
    members `"> b"` (the smallest); otherwise `None`, and `reason` says why. `max` and
    `min` likewise; `n` the members behind them.
    """
    known = sorted(float(v) for v in known)
    nb, na, nk = len(below), len(above), len(known)
    N = nb + na + nk + unknown
    out: dict = {"q10": None, "q50": None, "q90": None, "min": None, "max": None, "n": N}
    if N == 0:
        out["reason"] = "no scenario with a search verdict"
        return out
    lo_b = f"< {max(below):.3g}" if below else None
    hi_b = f"> {min(above):.3g}" if above else None

    def at(rank: int, low: int):
        """The member of 1-based `rank` with `low` unknowns below the others."""
        r = rank - low
        if r <= 0 or r > nb + nk + na:
            return ("unknown",)
        if r <= nb:
            return ("below",)
        if r <= nb + nk:
            return ("known", known[r - nb - 1])
        return ("above",)

    def value(rank: int):
        a, b = at(rank, 0), at(rank, unknown)
        if a != b:
            return None
        return {"below": lo_b, "above": hi_b, "unknown": None}.get(a[0], a[-1])

    reasons = set()
    for key, q in QUANTILES + (("min", 0.0), ("max", 1.0)):
        rank = min(max(int(np.ceil(q * N - 1e-9)), 1), N)
        out[key] = value(rank)
        if out[key] is None:
            reasons.add(key)
    if reasons:
        out["reason"] = (
            f"{', '.join(sorted(reasons))}: {unknown} failed search(es) could lie on either side"
        )
    return out
