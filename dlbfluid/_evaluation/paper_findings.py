"""The seed paper's findings about its evaluation, as checks of a recorded summary (seed
§5.4, App. B.2-B.3, §6; theory/evaluation.md).

A summary is the `summary` list of the `summary.json` that `dlbfluid.run_experiment`
writes: rows `{"variant", "policy", "runs", "failed", *SUMMARY_FIELDS}`. Each check is a
pure function of one kind's summary and returns `Finding` rows *finding | paper | fluid
model | agrees?*; a check whose inputs are missing (a policy or variant the run did not
record, or a failed cell) says "n/a" (`agrees is None`) instead of guessing. The
tolerances that turn the paper's words into numbers are the module constants below, each
stated once. notebooks/paper_evaluation.ipynb prints these checks beside its tables and
plots; tests/test_evaluation_kinds.py checks them on synthetic summaries.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .config import KINDS, POLICIES
from .experiment import SUMMARY_FIELDS

DLB = ("disc-rif", "disc-lat", "disc-grad", "flow-rif", "flow-lat", "flow-grad")
RIF = ("disc-rif", "flow-rif")
MODEL_BASED = ("disc-lat", "disc-grad", "flow-lat", "flow-grad")
FIELDS = SUMMARY_FIELDS  # the metric keys of a summary row

# Tolerances of the checks (stated once, used everywhere).
BASELINE_BAND = (0.7, 0.9)  # "about 20% better than Rand": mean DLB normalised latency
TIE = 0.005  # "best" allows a tie within 0.5% of the best normalised latency
IMMUNE_RTOL = 1e-9  # "immune": identical across noise levels up to rounding


def variants_of(summary: list[dict]) -> list[str]:
    """The variants of a summary, in the order the run recorded them."""
    return list(dict.fromkeys(r["variant"] for r in summary))


def policies_of(summary: list[dict]) -> list[str]:
    """The policies of a summary: the default ones in `POLICIES` order, then any other."""
    present = set(r["policy"] for r in summary)
    return [p for p in POLICIES if p in present] + sorted(present - set(POLICIES))


def value(summary: list[dict], variant: str, policy: str, field: str = "normalized_latency"):
    """One number of a summary, or None when it is not recorded."""
    for r in summary:
        if r["variant"] == variant and r["policy"] == policy:
            v = r.get(field)
            return None if v is None or not math.isfinite(float(v)) else float(v)
    return None


def variant_number(variant: str) -> float | None:
    """The numeric level of a variant label such as `u=0.5`, `y=0.25` or `eps=0.1`."""
    if "=" not in variant:
        return None
    try:
        return float(variant.split("=", 1)[1])
    except ValueError:
        return None


# ----------------------------------------------------------------------------------------
# Checks against the paper
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Finding:
    """One row of a comparison: what the paper says, what the fluid run shows, and whether
    they agree (True, False, or None when the run lacks the data)."""

    finding: str
    paper: str
    fluid: str
    agrees: bool | None

    @property
    def verdict(self) -> str:
        return {True: "yes", False: "NO", None: "n/a"}[self.agrees]


def _mean(summary, variant, policies, field="normalized_latency"):
    vals = [value(summary, variant, p, field) for p in policies]
    if not vals or any(v is None for v in vals):
        return None
    return float(np.mean(vals))


def _na(finding, paper, why="not recorded") -> Finding:
    return Finding(finding, paper, why, None)


def _extreme_variants(summary) -> tuple[str, str] | None:
    """(lowest, highest) numeric variant, or None."""
    lv = [(variant_number(v), v) for v in variants_of(summary)]
    lv = sorted((x, v) for x, v in lv if x is not None)
    return (lv[0][1], lv[-1][1]) if len(lv) >= 2 else None


def check_baseline(summary: list[dict]) -> list[Finding]:
    """App. B.2: at 80% utilisation most DLB policies are about 20% better than Rand, with
    Flow-Grad best; our policies also outperform MNLB."""
    v = "baseline" if "baseline" in variants_of(summary) else variants_of(summary)[0]
    out = []
    dlb = [p for p in DLB if value(summary, v, p) is not None]
    vals = {p: value(summary, v, p) for p in dlb}
    f, paper = "most DLB policies beat Rand", ">= 4 of 6 below 1"
    if len(dlb) == len(DLB):
        k = sum(x < 1.0 for x in vals.values())
        out.append(Finding(f, paper, f"{k} of 6 below 1", k >= 4))
    else:
        out.append(_na(f, paper))
    f, paper = "improvement over Rand about 20%", "mean DLB norm. latency ~0.8"
    m = _mean(summary, v, DLB)
    lo, hi = BASELINE_BAND
    out.append(
        _na(f, paper)
        if m is None
        else Finding(f, paper + f" (band {lo}-{hi})", f"{m:.3f}", lo <= m <= hi)
    )
    f, paper = "Flow-Grad best", "flow-grad lowest"
    allp: dict[str, float] = {
        p: x for p in policies_of(summary) if (x := value(summary, v, p)) is not None
    }
    if "flow-grad" in allp and len(allp) > 1:
        best = min(allp, key=lambda p: allp[p])
        fg = allp["flow-grad"]
        ok = fg <= allp[best] * (1 + TIE)
        out.append(Finding(f, paper, f"best {best} {allp[best]:.3f}; flow-grad {fg:.3f}", bool(ok)))
    else:
        out.append(_na(f, paper))
    f, paper = "DLB policies beat MNLB", "mean DLB < MNLB"
    mn = value(summary, v, "mnlb")
    out.append(
        _na(f, paper)
        if m is None or mn is None
        else Finding(f, paper, f"DLB {m:.3f} vs MNLB {mn:.3f}", m < mn)
    )
    return out


def check_utilization(summary: list[dict]) -> list[Finding]:
    """App. B.2 / §5.4: at low utilisation RIF spills to slow cells (worse than the
    latency-aware flow policies, relatively more than at high utilisation); the
    improvement over Rand shrinks at low utilisation; at high utilisation DLB has lower
    latency and error rates than MNLB and Rand."""
    ends = _extreme_variants(summary)
    if ends is None:
        return [_na("utilisation findings", "needs two utilisation levels")]
    lo, hi = ends
    out = []

    def rif_gap(v):
        r, g = _mean(summary, v, RIF), _mean(summary, v, ("flow-grad", "flow-lat"))
        return None if r is None or g is None else r / g - 1.0

    f, paper = f"RIF worse than Flow-Grad/Lat at {lo}", "RIF / (grad,lat) - 1 > 0"
    g_lo, g_hi = rif_gap(lo), rif_gap(hi)
    out.append(_na(f, paper) if g_lo is None else Finding(f, paper, f"{g_lo:+.3f}", g_lo > 0))
    f, paper = f"RIF penalty larger at {lo} than at {hi}", "gap(low u) > gap(high u)"
    out.append(
        _na(f, paper)
        if g_lo is None or g_hi is None
        else Finding(f, paper, f"{g_lo:+.3f} vs {g_hi:+.3f}", g_lo > g_hi)
    )
    f, paper = "improvement over Rand smaller at low u", f"1 - DLB({lo}) < 1 - DLB({hi})"
    m_lo, m_hi = _mean(summary, lo, DLB), _mean(summary, hi, DLB)
    out.append(
        _na(f, paper)
        if m_lo is None or m_hi is None
        else Finding(f, paper, f"{1 - m_lo:+.3f} vs {1 - m_hi:+.3f}", 1 - m_lo < 1 - m_hi)
    )
    f, paper = f"at {hi} DLB latency below MNLB", "mean DLB < MNLB"
    mn = value(summary, hi, "mnlb")
    out.append(
        _na(f, paper)
        if m_hi is None or mn is None
        else Finding(f, paper, f"{m_hi:.3f} vs {mn:.3f}", m_hi < mn)
    )
    f, paper = f"at {hi} DLB errors <= MNLB and Rand", "mean DLB <= min(Rand, MNLB)"
    e = _mean(summary, hi, DLB, "error_rate")
    eb = [value(summary, hi, p, "error_rate") for p in ("rand", "mnlb")]
    out.append(
        _na(f, paper)
        if e is None or None in eb
        else Finding(
            f,
            paper,
            f"{100 * e:.3f}% vs {100 * eb[0]:.3f}% / {100 * eb[1]:.3f}%",
            e <= min(eb),
        )
    )
    return out


def check_duration(summary: list[dict]) -> list[Finding]:
    """App. B.2: for short requests (y = 10) RIF is poor, MNLB strong and only Flow-Grad
    beats it; for y <= 1 the DLB policies improve upon MNLB."""
    out = []
    vs = {variant_number(v): v for v in variants_of(summary)}
    short = vs.get(10.0)
    if short is None:
        out.append(_na("y = 10 findings", "needs the y=10 variant"))
    else:
        mn = value(summary, short, "mnlb")
        rif = _mean(summary, short, RIF)
        f, paper = "y=10: RIF poor (worse than MNLB)", "mean RIF > MNLB"
        out.append(
            _na(f, paper)
            if mn is None or rif is None
            else Finding(f, paper, f"{rif:.3f} vs {mn:.3f}", rif > mn)
        )
        fg = value(summary, short, "flow-grad")
        f, paper = "y=10: Flow-Grad beats MNLB", "flow-grad < MNLB"
        out.append(
            _na(f, paper)
            if mn is None or fg is None
            else Finding(f, paper, f"{fg:.3f} vs {mn:.3f}", fg < mn)
        )
        f, paper = "y=10: only Flow-Grad beats MNLB", "others >= MNLB"
        others = {p: value(summary, short, p) for p in DLB if p != "flow-grad"}
        if mn is None or any(x is None for x in others.values()):
            out.append(_na(f, paper))
        else:
            better = [p for p, x in others.items() if x < mn]
            out.append(Finding(f, paper, "beat MNLB: " + (", ".join(better) or "none"), not better))
    long = sorted((y, v) for y, v in vs.items() if y is not None and y <= 1.0)
    f, paper = "y<=1: DLB policies beat MNLB", "mean DLB < MNLB at every y<=1"
    rows: list[str] = []
    ok, complete = True, True
    for y, v in long:
        m, mn = _mean(summary, v, DLB), value(summary, v, "mnlb")
        if m is None or mn is None:
            complete = False
            break
        rows.append(f"y={y:g}: {m:.3f}/{mn:.3f}")
        ok &= m < mn
    out.append(
        _na(f, paper) if not long or not complete else Finding(f, paper, "; ".join(rows), ok)
    )
    return out


def check_events(summary: list[dict], kind: str) -> list[Finding]:
    """App. B.3 (burst, outage) and §6 (spikes): MNLB and Rand have higher error rates
    than the DLB policies; the DLB policies improve on the latency of Rand and of MNLB
    (narrowly in the outage, where MNLB is capacity-aware)."""
    v = kind if kind in variants_of(summary) else variants_of(summary)[0]
    out = []
    e = _mean(summary, v, DLB, "error_rate")
    for base in ("rand", "mnlb"):
        f, paper = f"{kind}: {base} errors above DLB", f"{base} > mean DLB"
        eb = value(summary, v, base, "error_rate")
        out.append(
            _na(f, paper)
            if e is None or eb is None
            else Finding(f, paper, f"{100 * eb:.3f}% vs {100 * e:.3f}%", eb > e)
        )
    f, paper = f"{kind}: DLB latency below Rand", "mean DLB < 1"
    m = _mean(summary, v, DLB)
    out.append(_na(f, paper) if m is None else Finding(f, paper, f"{m:.3f}", m < 1.0))
    f, paper = f"{kind}: DLB latency below MNLB", "mean DLB < MNLB"
    mn = value(summary, v, "mnlb")
    out.append(
        _na(f, paper)
        if m is None or mn is None
        else Finding(f, paper, f"{m:.3f} vs {mn:.3f}", m < mn)
    )
    return out


def check_noise(summary: list[dict]) -> list[Finding]:
    """§5.4: RIF (and Rand, MNLB) are immune to estimation noise; the latency and gradient
    policies degrade gracefully as the noise level grows."""
    levels = sorted(
        (variant_number(v), v) for v in variants_of(summary) if variant_number(v) is not None
    )
    if len(levels) < 2:
        return [_na("noise findings", "needs two noise levels")]
    out = []
    f, paper = "RIF immune to noise", f"identical across eps (rtol {IMMUNE_RTOL:g})"
    spreads: list[float] = []
    complete = True
    for p in RIF + ("mnlb",):
        vals = [value(summary, v, p) for _, v in levels]
        if any(x is None for x in vals):
            complete = False
            break
        spreads.append((max(vals) - min(vals)) / max(abs(max(vals)), 1e-300))
    out.append(
        _na(f, paper)
        if not complete
        else Finding(
            f,
            paper + "; MNLB too",
            f"max rel. spread {max(spreads):.1e}",
            max(spreads) <= IMMUNE_RTOL,
        )
    )
    (e0, v0), (e1, v1) = levels[0], levels[-1]
    m0, m1 = _mean(summary, v0, MODEL_BASED), _mean(summary, v1, MODEL_BASED)
    f, paper = f"lat/grad degrade as eps grows ({e0:g} -> {e1:g})", "mean lat/grad rises"
    out.append(
        _na(f, paper)
        if m0 is None or m1 is None
        else Finding(f, paper, f"{m0:.3f} -> {m1:.3f}", m1 >= m0)
    )
    f, paper = f"lat/grad still competitive at eps={e1:g}", "mean lat/grad < 1 (beats Rand)"
    out.append(_na(f, paper) if m1 is None else Finding(f, paper, f"{m1:.3f}", m1 < 1.0))
    return out


HOMOGENEOUS_BAND = 0.1
"""App. B.2, homogeneous cells: "none of the algorithms performs drastically better than
Rand"; read as every DLB policy within 10% of Rand."""
TICK_SETTLED = 0.02
"""The tick kind's acceptance: normalised latency at the two smallest ticks within 2%."""


def check_homogeneous(summary: list[dict]) -> list[Finding]:
    """App. B.2: with identical hardware (and small network latencies) routing by replicas
    is good and no algorithm is drastically better than Rand."""
    v = variants_of(summary)[0]
    vals = [value(summary, v, p) for p in DLB]
    f, paper = "no policy drastically better than Rand", "every DLB policy near 1"
    if any(x is None for x in vals):
        return [_na(f, paper)]
    lo = min(vals)
    return [
        Finding(
            f,
            paper + f" (within {HOMOGENEOUS_BAND:.0%})",
            f"DLB {lo:.3f}-{max(vals):.3f}",
            lo >= 1 - HOMOGENEOUS_BAND,
        )
    ]


def check_heterogeneity(summary: list[dict]) -> list[Finding]:
    """App. B.2: the stateful policies' gain over Rand comes from heterogeneity, so it grows
    with the spread of the cells' hardware (lowest to highest coefficient of variation)."""
    ends = _extreme_variants(summary)
    f, paper = "gain over Rand grows with heterogeneity", "mean DLB falls as the CV rises"
    if ends is None:
        return [_na(f, paper, "needs two levels")]
    m0, m1 = _mean(summary, ends[0], DLB), _mean(summary, ends[1], DLB)
    if m0 is None or m1 is None:
        return [_na(f, paper)]
    return [Finding(f, paper, f"{ends[0]} {m0:.3f} -> {ends[1]} {m1:.3f}", m1 < m0)]


def check_tick(summary: list[dict]) -> list[Finding]:
    """Issue #12: a finding must not move with the tick. For each family (baseline, y = 10)
    and policy, the normalised latency at the two smallest ticks differs by < 2%."""
    out = []
    fams: dict[str, list[tuple[float, str]]] = {}
    for v in variants_of(summary):
        fam, _, h = v.rpartition("h=")
        fams.setdefault(fam.rstrip(",") or "baseline", []).append((float(h.rstrip("ms")), v))
    for fam, vs in fams.items():
        vs.sort()
        if len(vs) < 2:
            out.append(_na(f"{fam}: settled in h", "two ticks needed"))
            continue
        (_, a), (_, b) = vs[0], vs[1]
        for p in policies_of(summary):
            x, y = value(summary, a, p), value(summary, b, p)
            f = f"{fam} {p}: settled at the two smallest ticks"
            if x is None or y is None:
                out.append(_na(f, f"< {TICK_SETTLED:.0%} apart"))
                continue
            d = abs(x / y - 1)
            out.append(
                Finding(f, f"< {TICK_SETTLED:.0%} apart", f"{y:.3f} -> {x:.3f}", d < TICK_SETTLED)
            )
    return out


def check(kind: str, summary: list[dict]) -> list[Finding]:
    """The paper's findings for one experiment kind, checked on its summary."""
    if kind == "baseline":
        return check_baseline(summary)
    if kind == "utilization":
        return check_utilization(summary)
    if kind == "duration":
        return check_duration(summary)
    if kind in ("burst", "outage", "spikes"):
        return check_events(summary, kind)
    if kind == "noise":
        return check_noise(summary)
    if kind == "homogeneous":
        return check_homogeneous(summary)
    if kind == "heterogeneity":
        return check_heterogeneity(summary)
    if kind == "tick":
        return check_tick(summary)
    raise ValueError(f"kind = {kind!r} is invalid: allowed kinds are {list(KINDS)}")


def format_findings(rows: list[Finding]) -> str:
    """A fixed-width table: finding | paper | fluid model | agrees?"""
    head = ("finding", "paper", "fluid model", "agrees?")
    body = [(r.finding, r.paper, r.fluid, r.verdict) for r in rows]
    w = [max(len(str(x[k])) for x in [head, *body]) for k in range(4)]
    line = lambda x: " | ".join(f"{str(c):<{w[k]}}" for k, c in enumerate(x))  # noqa: E731
    return "\n".join([line(head), "-+-".join("-" * k for k in w), *map(line, body)])
