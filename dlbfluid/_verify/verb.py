"""`verify`: Theorem 1 checked over a batch of scenarios, resumable (theory/lyapunov.md,
*Batch verification*).

For every scenario: solve the equilibria, compute every flow policy's critical step size
for the whole chunk at once, Theorem 1's constants, one run per flow policy, Theorem 1's
check and the projection check along it (`records`). Results are appended to a JSON-lines
file chunk by chunk, so that a killed run resumes where it stopped without losing or
duplicating a scenario; the directory's manifest (`dlbfluid._runtime.manifest`) refuses a rerun
with other settings (`VerifyConfig.manifest`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import jax

from .._runtime import JsonLines, Sweep
from .._runtime.distributed import Processes
from .._runtime.manifest import open_manifest, resume_note
from .._runtime.progress import Progress
from . import records as _records
from .config import DEFAULT_CHUNK, VerifyConfig, flow_policies
from .networks import _AppB, draw_scenario
from .summary import summarise


def verify(
    n_scenarios: int,
    seed: int = 0,
    *,
    config: VerifyConfig | None = None,
    out_dir: str | Path | None = None,
    progress: bool | Callable = False,
    draw: Callable[[int, int], dict] | None = None,
    processes: Processes | None = None,
    scenario: dict | None = None,
    labels: Mapping[str, str] | None = None,
    **settings,
) -> dict | None:
    """Verify Theorem 1 on `n_scenarios` random scenarios; returns the summary dict.

    The settings are a `VerifyConfig` (`config`), or its fields as keywords
    (`verify(8, horizon=100.0)`), or both (the keywords replace the config's fields).

    `policies`: the flow policies to run (default: every registered one). `draw`: a
    scenario source `draw(seed, index) -> dict` in the scenario-file format (default
    `draw_scenario` with `n_cells`), e.g. networks of a user's own service model; scenario
    `index` must depend on `(seed, index)` only, so that a resumed run redraws what it lost.

    Each flow policy runs with $\\eta = $ `step_fraction` $\\times\\,\\eta^*$, its critical
    step size from the pseudospectral stability analysis (`critical_step_size`), so
    $\\eta/\\eta^* = $ `step_fraction` unless $\\eta^*$ is unavailable (then $\\eta = 0.05$ and
    the ratio is null). A scenario has converged when
    $\\max_j|N_j(T)-N_j^*| \\le$ `conv_tol` $\\max(1, \\max_j N_j^*)$ and its run succeeded.

    `generator`: the scenario source when `draw` is not given: `"random"` (`draw_scenario`,
    with `n_cells`) or `"appb"` (the App.-B generator, `draw_appb`). `scenario`: verify this
    one scenario dict (scenario-file format) instead; `n_scenarios` must then be 1.

    `step_rule`: `"oracle"` ($\\eta = $ `step_fraction` $\\times\\,\\eta^*$) or `"paper"`
    (router $i$ takes $\\eta_i = \\kappa_c/\\bar\\tau_i$, `dlbfluid._evaluation.experiment.paper_step_sizes`;
    $\\eta^*$ is then the critical scaling of that profile, so `eta_over_eta_star` is how far
    below it the rule runs, and `step_size` is the largest router step).

    `ladder`: `"none"` (the run above and its certificate only) or `"full"`: the Theorem-1
    ladder of `dlbfluid._theorem1.theorem1_ladder` per scenario and policy (the bound's
    constants, the $T^{-1/2}$ schedule's slope, $G_1$ against the delay scales
    `tau_scales`, the empirical $\\eta_0$), about thirty further runs per scenario and
    policy, batched.

    `step_base`: what `step_fraction` multiplies with the oracle rule: `"eta-star"` (the
    linear critical step) or `"eta0"` (the proof's threshold, `batch_theorem1_constants`;
    a fraction $\\le 1$ runs inside Theorem 1's hypothesis). Every record carries Theorem 1's
    explicit constants and its check along the run (`theorem1`, theory/lyapunov.md) and the
    three thresholds (`thresholds`).

    `worst_case`: also bracket each scenario's global threshold $\\eta_g$ over
    `search_range` (in units of $\\eta^*$) to `bracket_tol`, with `starts` drawn starts per
    scenario and step and 2 adversarial ones (`dlbfluid._global_threshold.global_threshold`,
    one batch per pass, chunk and policy; its own horizon and tick, `WorstCaseSearch`'s
    defaults; with `step_rule="paper"` at the rule's router profile), filling
    `thresholds`' `eta_global_bracket`, `eta_global_censoring`, `eta_global`, `bistable`,
    `hopf`, `witness`, `cycle_amplitude`, `cycle_period`, `eta_global_search` and
    `step_vs_bracket` (null without it).

    `nodes`: the Chebyshev nodes of the former per-scenario critical step sizes, kept in
    the manifest only: `batch_critical_step_size` solves the exact characteristic
    equation (theory/stability.md §7).

    `processes`: the processes sharing the run (`dlbfluid._runtime.distributed`, the command
    line's `--coordinator`...; default this one alone). Every process calls `verify` with
    the same arguments and computes whole chunks; process 0 alone reads and writes
    `out_dir`, shows progress and returns the summary (the others return `None`), equal
    to a one-process run's.

    `out_dir`: where the records are appended (`results.jsonl`, chunk by chunk) and the
    summary written (`summary.json`); a rerun with the same `out_dir` resumes, computing
    only the scenarios not yet there. The directory's manifest (`dlbfluid._runtime.manifest`,
    `manifest.json`) records every argument that changes a number (`n_scenarios`,
    `seed`, `n_cells`, `horizon`, `tick`, `step_fraction`, `conv_tol`, `nodes`, the
    policies and the name of a custom `draw`; `generator`, a fingerprint of a given
    `scenario`, `step_rule`, `ladder`, `tau_scales`, `step_base` and `worst_case` where
    they differ from their defaults, and with `worst_case` also `starts`, `search_range`
    and `bracket_tol`) and the package version; `chunk` is not among them (a scenario's record does not depend on its chunk, up to rounding: chunks
    of 2, 3 and 4 gave identical records, a chunk of 1 differed by one ulp), so a resumed
    run may use another.

    `labels`: another name of each argument and field in the directory's refusals
    (`{"out_dir": "--out", "seed": "--seed"}`: the command line's options, from
    `dlbfluid._cli._flags`); by default they name the Python arguments and fields
    (`out_dir = '...' is invalid: ... (changed: seed: 0 -> 1)`).

    **Raises:** `ValueError` when `out_dir` holds a run with other settings (naming each
    changed field with its old and new value) or of another dlbfluid version, or
    `results.jsonl` without a manifest (a run whose settings were not recorded); `out_dir`
    is left untouched then.
    """
    cfg = _config(config, settings)
    procs = Processes() if processes is None else processes
    if scenario is not None and n_scenarios != 1:
        raise ValueError(
            f"n_scenarios = {n_scenarios!r} is invalid with a given scenario: expected 1"
        )
    if not (isinstance(n_scenarios, int) and n_scenarios >= 1):
        raise ValueError(f"n_scenarios = {n_scenarios!r} is invalid: expected a positive value")
    pols = flow_policies(cfg.policies)
    sweep, done = _open(procs, out_dir, cfg, n_scenarios, seed, draw, scenario, labels or {})
    source = _source(cfg, draw, scenario)
    t_start = time.perf_counter()
    bar, report = _progress(procs, progress, n_scenarios, len(done))
    if report:
        report(len(done), n_scenarios, t_start)
    chunk_size = _chunk_size(cfg, n_scenarios)
    chunks = _chunks(cfg, n_scenarios, done)
    opts = _records._Options(cfg.step_fraction, cfg.conv_tol, cfg.nodes, cfg.step_rule,
                             cfg.ladder, cfg.tau_scales, cfg.step_base, cfg.search())  # fmt: skip

    def compute(idx: list[int], c: int) -> list[dict]:
        # (a line between the policies of a chunk, so that a long chunk shows progress)
        note = None
        if bar is not None:
            note = lambda what: bar.update(  # noqa: E731
                len(done), note=f"chunk {c + 1}/{len(chunks)}: {what}"
            )
        return _records._chunk_records(
            idx, seed, source, pols, chunk_size, cfg.n_cells, cfg.tick, cfg.horizon,
            cfg.ticks, opts, on_stage=note,
        )  # fmt: skip

    def stored(_chunks, recs: list[dict]) -> None:
        for rec in recs:
            done[rec["index"]] = rec
        if report:
            report(len(done), n_scenarios, t_start)

    # Each process computes whole chunks, the next `procs.count` of them at a time (one
    # each), so every scenario is computed in the chunk a one-process run gives it, and
    # the results file grows in the same order.
    sweep.run(chunks, compute, stored, whole_units=True)
    if not procs.main:
        return None
    return _finish(cfg, done, n_scenarios, seed, out_dir, t_start,
                   generated=scenario is None and draw is None)  # fmt: skip


def _progress(procs: Processes, progress, n_scenarios: int, n_done: int):
    """`(bar or None, report(done, total, t0) or None)`: process 0's progress."""
    if not procs.main:
        return None, None
    if callable(progress):
        return None, progress
    if progress:
        bar = Progress("verifying", n_scenarios, unit="scenarios")
        return bar, lambda d, total, t0: bar.update(d, start=n_done)
    return None, None


def _chunk_size(cfg: VerifyConfig, n_scenarios: int) -> int:
    """`cfg.chunk`, at most the run: a chunk wider than the run would only simulate
    padding; by default a short run gets at least four chunks, so that it shows progress
    before its end (records do not depend on the chunk)."""
    chunk = cfg.chunk
    chunk = min(DEFAULT_CHUNK, max(1, -(-n_scenarios // 4))) if chunk is None else chunk
    return min(chunk, n_scenarios)


def _chunks(cfg: VerifyConfig, n_scenarios: int, done) -> list[list[int]]:
    """The scenarios left to compute, in chunks of `_chunk_size`."""
    chunk = _chunk_size(cfg, n_scenarios)
    todo = [i for i in range(n_scenarios) if i not in done]
    return [todo[c0 : c0 + chunk] for c0 in range(0, len(todo), chunk)]


def _config(config: VerifyConfig | None, settings: dict) -> VerifyConfig:
    """`config` with the keyword settings applied (a `TypeError` names an unknown one)."""
    cfg = VerifyConfig() if config is None else config
    if not isinstance(cfg, VerifyConfig):
        raise ValueError(f"config = {config!r} is invalid: expected a VerifyConfig")
    known = {f.name for f in dataclasses.fields(VerifyConfig)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise TypeError(
            f"verify() got unexpected keyword arguments {unknown}: allowed are the "
            f"VerifyConfig fields {sorted(known)}"
        )
    if "policies" in settings and settings["policies"] is not None:
        settings = {**settings, "policies": tuple(settings["policies"])}
    return dataclasses.replace(cfg, **settings) if settings else cfg


def _open(procs, out_dir, cfg: VerifyConfig, n_scenarios, seed, draw, scenario, labels):
    """`(the sweep, records already done)`: process 0 checks `out_dir`'s manifest (its
    refusals name the fields by `labels`) and reads what is done (`JsonLines`); the others
    learn from it which scenarios are done (their records are empty there)."""
    path = None if out_dir is None or not procs.main else Path(out_dir) / "results.jsonl"
    results = None if path is None else JsonLines(path)
    sweep: Sweep[list[int]] = Sweep(procs, "verify/todo", "verify/chunk", results)

    def read_done():
        if results is None:
            return {}, []
        config = cfg.manifest(n_scenarios, seed, draw=draw, scenario=scenario)
        flag = labels.get("out_dir", "out_dir")
        resumed = open_manifest(
            out_dir, "verify", config, flag=flag, labels=labels, results=("results.jsonl",)
        )
        done = results.read()
        if resumed:
            resume_note(out_dir, len(done), n_scenarios, "scenarios")
        return done, sorted(done)

    done, keys = sweep.open(read_done)
    if not procs.main:  # (only which scenarios are done matters on the others)
        done = {i: {} for i in keys}
    return sweep, done


def _source(cfg: VerifyConfig, draw, scenario):
    if scenario is not None:
        given = dict(scenario)
        return lambda sd, i: {**given, "index": i}
    if draw is not None:
        return draw
    if cfg.generator == "appb":
        return _AppB(cfg.n_cells)
    n_cells = cfg.n_cells
    return lambda sd, i: draw_scenario(sd, i, n_cells=n_cells)


def _finish(cfg: VerifyConfig, done, n_scenarios, seed, out_dir, t_start, *, generated):
    records = [done[i] for i in range(n_scenarios)]
    summary = summarise(records)
    summary.update(
        seed=seed,
        horizon=cfg.horizon,
        tick=cfg.tick,
        step_fraction=cfg.step_fraction,
        conv_tol=cfg.conv_tol,
        generator=cfg.generator if generated else None,
        step_rule=cfg.step_rule,
        step_base=cfg.step_base,
        worst_case=cfg.worst_case,
        starts=cfg.starts if cfg.worst_case else None,
        search_range=list(cfg.search_range) if cfg.worst_case else None,
        bracket_tol=cfg.bracket_tol if cfg.worst_case else None,
        ladder=cfg.ladder,
        tau_scales=list(cfg.tau_scales) if cfg.ladder == "full" else None,
        devices=[str(d) for d in jax.devices()],
        wall_s=time.perf_counter() - t_start,
    )
    if out_dir is not None:
        (Path(out_dir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    summary["records"] = records
    return summary
