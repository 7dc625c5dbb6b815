"""`verify`'s summary: per policy Theorem 1's verdict, the thresholds and the
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
    """Per policy: Theorem 1's verdict first (the fraction of runs inside its hypothesis,
    the fraction of those under the explicit bound, the tightness bound / measured, each
    estimate's holds fraction), the three step-size thresholds, then the diagnostics
    (converged, the projection check, the descriptive fit; null where a record lacks
    them, e.g. without the ladder)."""
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
            "eta_global_over_eta_star": _quantiles(
                [_ratio(t.get("eta_global"), t.get("eta_star")) for t in thr]
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
