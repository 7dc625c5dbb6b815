"""The bad-input catalogue: every input rule of docs/scenarios.md and docs/cli.md
refused with exit status 2 and a message naming the field, before any computation.

Every case runs in-process through `dlbfluid._cli.main`; the verbs that compute
(`simulate`, `solve_equilibrium`, `critical_step_size`, `verify`, `run_experiment`) are
replaced by a function that raises, so a case that reached them fails loudly instead of
compiling. The whole catalogue takes a few seconds.
"""

import copy
import json
import math
import sys
import types

import numpy as np
import pytest
from helpers import THREE

import dlbfluid as dl
from dlbfluid._cli import main


class ComputationStarted(Exception):
    """A bad input reached a verb that computes."""


_VERBS = [
    ("dlbfluid._simulate", "simulate"),
    ("dlbfluid._equilibrium", "solve_equilibrium"),
    ("dlbfluid._stability", "critical_step_size"),
    ("dlbfluid._verify", "verify"),
    ("dlbfluid._evaluation.experiment", "run_experiment"),
]


@pytest.fixture
def no_work(monkeypatch):
    """Every computing verb raises `ComputationStarted`, in every module that imported it;
    no JAX_* process variables."""
    import importlib

    # Import them all before patching any: a module imported later would keep a stub.
    reals = [getattr(importlib.import_module(mod), name) for mod, name in _VERBS]
    for (_, name), real in zip(_VERBS, reals):

        def refuse(*args, _name=name, **kwargs):
            raise ComputationStarted(_name)

        for m in [m for k, m in sys.modules.items() if k.startswith("dlbfluid")]:
            if getattr(m, name, None) is real:
                monkeypatch.setattr(m, name, refuse)
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(k, raising=False)


def _run(argv, capsys) -> tuple[int, str, str]:
    """`main(argv)` as the shell sees it: (exit status, stdout, stderr)."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's refusals
        code = e.code
    cap = capsys.readouterr()
    return code, cap.out, cap.err


# ----------------------------------------------------------------------------------------
# Scenario files: a mutation of THREE (tests/helpers.py), written to a file
# ----------------------------------------------------------------------------------------


def _set(path, value):
    """A mutation setting `d[path[0]][path[1]]... = value`."""

    def mutate(d):
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value

    return mutate


def _del(path):
    def mutate(d):
        for k in path[:-1]:
            d = d[k]
        del d[path[-1]]

    return mutate


def _both(*mutations):
    def mutate(d):
        for m in mutations:
            m(d)

    return mutate


C0, C1, C2 = ("cells", 0), ("cells", 1), ("cells", 2)
PROFILE = {"times": [0, 10], "rates": [1.0, 2.0]}
SCHEDULE = {"times": [0, 5], "replicas": [3, 1]}
# b may only serve itself, and its demand exceeds its capacity (3).
OVERLOAD = _both(_set((*C1, "arrival_rate"), 3.5), _set(("latency", 1), [None, 0.0, None]))

# (id, mutation of the scenario dict or raw file text, needles that stderr must contain)
SCENARIO_CASES = [
    ("top-not-object", "[1, 2]", ["scenario", "expected a JSON object"]),
    ("not-json", "{not json", ["not valid JSON"]),
    ("top-unknown-key", _set(("colour",), "red"), ["unknown top-level keys", "colour"]),
    ("name-not-string", _set(("name",), 5), ["name = 5", "expected a string"]),
    ("description-not-string", _set(("description",), ["x"]), ["description", "a string"]),
    ("cells-missing", _del(("cells",)), ["cells = None", "non-empty list"]),
    ("cells-empty", _set(("cells",), []), ["cells = []", "non-empty list"]),
    ("cell-not-object", _set(C0, 3), ["cells[0] = 3", "expected an object"]),
    ("cell-unknown-key", _set((*C0, "colour"), "red"), ["cells[0]", "colour", "unknown keys"]),
    ("cell-name-empty", _set((*C0, "name"), ""), ["cells[0].name", "non-empty string"]),
    ("cell-names-duplicate", _set((*C1, "name"), "a"), ["cells[].name", "unique"]),
    ("arrival-missing", _del((*C0, "arrival_rate")), ["cells[0].arrival_rate", "required"]),
    ("arrival-negative", _set((*C0, "arrival_rate"), -1.0), ["cells[0].arrival_rate", ">= 0"]),
    ("arrival-nan", _set((*C0, "arrival_rate"), math.nan), ["cells[0].arrival_rate", "finite"]),
    ("arrival-string", _set((*C0, "arrival_rate"), "3"), ["cells[0].arrival_rate", "a number"]),
    ("arrival-bool", _set((*C0, "arrival_rate"), True), ["cells[0].arrival_rate", "a number"]),
    ("profile-unknown-key", _set((*C0, "arrival_rate"), {**PROFILE, "shape": 1}),
     ["cells[0].arrival_rate", "unknown keys", "shape"]),
    ("profile-kind", _set((*C0, "arrival_rate"), {**PROFILE, "kind": "spline"}),
     ["cells[0].arrival_rate.kind", "piecewise_linear", "piecewise_constant"]),
    ("profile-empty", _set((*C0, "arrival_rate"), {"times": [], "rates": []}),
     ["cells[0].arrival_rate", "non-empty lists"]),
    ("profile-lengths", _set((*C0, "arrival_rate"), {"times": [0, 1], "rates": [1.0]}),
     ["cells[0].arrival_rate", "'times' has 2 entries, 'rates' 1"]),
    ("profile-decreasing", _set((*C0, "arrival_rate"), {"times": [2, 1], "rates": [1, 1]}),
     ["cells[0].arrival_rate.times", "non-decreasing"]),
    ("profile-time-thrice", _set((*C0, "arrival_rate"),
                                 {"times": [0, 5, 5, 5], "rates": [1, 1, 2, 1]}),
     ["cells[0].arrival_rate.times", "more than twice"]),
    ("profile-constant-duplicate",
     _set((*C0, "arrival_rate"),
          {"kind": "piecewise_constant", "times": [0, 5, 5], "rates": [1, 2, 1]}),
     ["cells[0].arrival_rate.times", "strictly increasing"]),
    ("profile-rate-negative", _set((*C0, "arrival_rate"), {"times": [0, 1], "rates": [1, -2]}),
     ["cells[0].arrival_rate.rates[1]", ">= 0"]),
    ("profile-time-inf", _set((*C0, "arrival_rate"),
                              {"times": [0, math.inf], "rates": [1, 1]}),
     ["cells[0].arrival_rate.times[1]", "finite"]),
    ("replicas-zero", _set((*C0, "replicas"), 0), ["cells[0].replicas", "integer >= 1"]),
    ("replicas-fraction", _set((*C0, "replicas"), 2.5), ["cells[0].replicas", "integer"]),
    ("replicas-huge", _set((*C0, "replicas"), 1e30), ["cells[0].replicas", "at most 1000000"]),
    ("replicas-string", _set((*C0, "replicas"), "4"), ["cells[0].replicas", "integer"]),
    ("service-missing", _del((*C2, "service")), ["cells[2].service", "'model' key"]),
    ("service-model", _set((*C1, "service", "model"), "gg1"),
     ["cells[1].service.model", "gg1", "mm1", "softplus"]),
    ("service-capacity-zero", _set((*C2, "service", "capacity"), 0.0),
     ["cells[2].service.capacity", "> 0"]),
    ("service-capacity-inf", _set((*C2, "service", "capacity"), math.inf),
     ["cells[2].service.capacity", "finite"]),
    ("service-unknown-key", _set((*C2, "service", "knee"), 1.0),
     ["cells[2].service", "unknown keys", "knee"]),
    ("softplus-width", _set((*C0, "service", "width"), -0.5), ["cells[0].service.width", "> 0"]),
    ("softplus-a0", _set((*C0, "service", "knee"), 5.0), ["a0"]),
    ("estimated-service", _set((*C0, "estimated_service"), {"model": "mm1"}),
     ["cells[0].estimated_service.capacity"]),
    ("buffer-zero", _set((*C0, "buffer"), 0), ["cells[0].buffer", "> 0"]),
    ("buffer-string", _set((*C0, "buffer"), "big"), ["cells[0].buffer", "a number"]),
    ("schedule-keys", _set((*C0, "replica_schedule"), {"times": [0]}),
     ["cells[0].replica_schedule", "exactly the keys"]),
    ("schedule-lengths", _set((*C0, "replica_schedule"), {"times": [0, 5], "replicas": [3]}),
     ["cells[0].replica_schedule", "'times' has 2 entries"]),
    ("schedule-zero", _set((*C0, "replica_schedule"), {"times": [0, 5], "replicas": [3, 0]}),
     ["cells[0].replica_schedule.replicas[1]", "> 0"]),
    ("schedule-huge", _set((*C0, "replica_schedule"), {"times": [0, 5], "replicas": [3, 1e30]}),
     ["cells[0].replica_schedule.replicas[1]", "1000000"]),
    ("schedule-duplicate-time",
     _set((*C0, "replica_schedule"), {"times": [0, 5, 5], "replicas": [3, 1, 2]}),
     ["cells[0].replica_schedule.times", "strictly increasing"]),
    ("slowdown-keys", _set((*C0, "service_schedule"), {"times": [0], "replicas": [2]}),
     ["cells[0].service_schedule", "exactly the keys 'times' and 'factors'"]),
    ("slowdown-below-one",
     _set((*C0, "service_schedule"), {"times": [0, 5], "factors": [1, 0.5]}),
     ["cells[0].service_schedule.factors[1]", "0.5", "[1, 1e+06]"]),
    ("slowdown-lengths", _set((*C0, "service_schedule"), {"times": [0, 5], "factors": [2]}),
     ["cells[0].service_schedule", "'times' has 2 entries, 'factors' 1"]),
    ("latency-missing", _del(("latency",)), ["latency", "3 x 3", "got null"]),
    ("latency-shape", _set(("latency",), [[0.0, 0.1, 0.2], [0.1, 0.0, 0.2]]),
     ["latency", "a 3 x 3 matrix (one row per cell, one entry per cell)",
      "got 2 rows of lengths [3, 3]"]),
    ("latency-row", _set(("latency", 1), [0.03, 0.0]), ["latency", "lengths [3, 2, 3]"]),
    ("latency-negative", _set(("latency", 0, 1), -0.01), ["latency[0][1]", ">= 0"]),
    ("latency-inf", _set(("latency", 2, 0), math.inf), ["latency[2][0]", "finite"]),
    ("latency-string", _set(("latency", 0, 1), "fast"), ["latency[0][1]", "a number"]),
    ("demand-without-arc", _set(("latency", 0), [None, None, None]), ["cells[0]", "no arc"]),
    ("initial-not-object", _set(("initial",), [0, 0, 0]), ["initial", "'workload'"]),
    ("initial-unknown-key", _set(("initial",), {"queue": [0, 0, 0]}),
     ["initial", "unknown keys", "queue"]),
    ("workload-length", _set(("initial",), {"workload": [0, 0]}),
     ["initial.workload", "3 workloads", "got 2 entries"]),
    ("workload-negative", _set(("initial",), {"workload": [0, -1, 0]}),
     ["initial.workload[1]", ">= 0"]),
    ("routing-shape", _set(("initial",), {"routing": [[1, 0, 0]]}),
     ["initial.routing", "3 x 3", "got 1 rows"]),
    ("routing-sum", _set(("initial",), {"routing": [[0.5, 0.6, 0], [0, 1, 0], [0, 0, 1]]}),
     ["initial.routing[0]", "sum to 1"]),
    ("routing-negative", _set(("initial",), {"routing": [[1.5, -0.5, 0], [0, 1, 0], [0, 0, 1]]}),
     ["initial.routing[0][1]", ">= 0"]),
    ("routing-forbidden-arc",
     _both(_set(("latency", 0, 2), None),
           _set(("initial",), {"routing": [[0.5, 0, 0.5], [0, 1, 0], [0, 0, 1]]})),
     ["initial.routing[0]", "forbidden arcs"]),
    ("overload", OVERLOAD, ["Assumption 2", "['b']", "capacity 3", "pass --allow-overload"]),
    ("overload-at-jump",
     _set((*C0, "arrival_rate"), {"times": [0, 10, 10, 20], "rates": [2, 9, 2, 2]}),
     ["Assumption 2", "t = 10"]),
    ("overload-next-to-huge-capacity",
     _both(OVERLOAD, _set((*C0, "service"), {"model": "mm1", "capacity": 1e14})),
     ["Assumption 2", "['b']", "capacity 3"]),
]


def _scenario_file(tmp_path, mutation) -> str:
    path = tmp_path / "scenario.json"
    if isinstance(mutation, str):
        path.write_text(mutation)
    else:
        d = copy.deepcopy(THREE)
        mutation(d)
        path.write_text(json.dumps(d))
    return str(path)


@pytest.mark.parametrize(
    "mutation,needles", [c[1:] for c in SCENARIO_CASES], ids=[c[0] for c in SCENARIO_CASES]
)
def test_bad_scenario_file(mutation, needles, tmp_path, capsys, no_work):
    code, out, err = _run(["simulate", _scenario_file(tmp_path, mutation)], capsys)
    assert code == 2 and out == ""
    assert err.startswith("dlbfluid simulate: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


def test_missing_scenario_file(tmp_path, capsys, no_work):
    code, _, err = _run(["stability", str(tmp_path / "missing.json")], capsys)
    assert code == 2 and "cannot be read" in err and "missing.json" in err


@pytest.mark.parametrize("command", ["equilibrium", "stability"])
def test_overload_remedy_fits_the_command(command, tmp_path, capsys, no_work):
    # equilibrium and stability have no --allow-overload: the message points to simulate.
    code, _, err = _run([command, _scenario_file(tmp_path, OVERLOAD)], capsys)
    assert code == 2 and "['b']" in err
    assert f"`dlbfluid {command}` needs demand strictly within capacity" in err
    assert "`dlbfluid simulate --allow-overload`" in err and "pass --allow-overload" not in err
    assert "allow_overload=True" not in err


# ----------------------------------------------------------------------------------------
# Command options (argparse refusals say "argument --FLAG: ..."; the others "--FLAG = ...")
# ----------------------------------------------------------------------------------------

SIM = ["simulate", "default"]
EQ = ["equilibrium", "default"]
STAB = ["stability", "default"]
VER = ["verify"]
EXP = ["experiment", "baseline"]

OPTION_CASES = [
    ("sim-step-size-negative", SIM + ["--step-size", "-2"], ["argument --step-size", "> 0"]),
    ("sim-step-size-zero", SIM + ["--step-size", "0"], ["argument --step-size", "> 0"]),
    ("sim-step-size-nan", SIM + ["--step-size", "nan"], ["argument --step-size", "finite"]),
    ("sim-step-size-word", SIM + ["--step-size", "big"], ["argument --step-size", "a number"]),
    ("sim-tick-zero", SIM + ["--tick", "0"], ["argument --tick", "> 0"]),
    ("sim-tick-inf", SIM + ["--tick", "inf"], ["argument --tick", "finite"]),
    ("sim-horizon-negative", SIM + ["--horizon", "-1"], ["argument --horizon", "> 0"]),
    ("sim-horizon-ticks", SIM + ["--horizon", "1", "--tick", "0.3"],
     ["--horizon = 1 is invalid", "whole number of ticks", "--tick = 0.3"]),
    ("sim-tick-above-horizon", SIM + ["--horizon", "1", "--tick", "10"],
     ["--horizon = 1 is invalid", "whole number of ticks"]),
    ("sim-window-zero", SIM + ["--window", "0"], ["argument --window", "(0, 1]"]),
    ("sim-window-above-one", SIM + ["--window", "1.5"], ["argument --window", "(0, 1]"]),
    ("sim-n-save-zero", SIM + ["--n-save", "0"], ["argument --n-save", "integer >= 1"]),
    ("sim-n-save-fraction", SIM + ["--n-save", "2.5"], ["argument --n-save", "integer"]),
    ("sim-substeps-zero", SIM + ["--substeps", "0"], ["argument --substeps", "integer >= 1"]),
    ("sim-rtol-zero", SIM + ["--rtol", "0"], ["argument --rtol", "> 0"]),
    ("sim-atol-negative", SIM + ["--atol=-1e-9"], ["argument --atol", "> 0"]),
    ("sim-policy", SIM + ["--policy", "fastest"], ["argument --policy", "invalid choice"]),
    ("sim-integrator", SIM + ["--integrator", "slow"], ["argument --integrator"]),
    ("sim-coordinator-alone", SIM + ["--coordinator", "h:1"], ["--num-processes"]),
    ("sim-process-id", SIM + ["--coordinator", "h:1", "--num-processes", "2",
                               "--process-id", "2"], ["--process-id = 2 is invalid"]),
    ("eq-tol-zero", EQ + ["--tol", "0"], ["argument --tol", "> 0"]),
    ("eq-max-iters-zero", EQ + ["--max-iters", "0"], ["argument --max-iters", "integer >= 1"]),
    ("eq-max-iters-fraction", EQ + ["--max-iters", "1.5"], ["argument --max-iters", "integer"]),
    ("eq-time-negative", EQ + ["--time", "-5"], ["argument --time", ">= 0"]),
    ("eq-time-inf", EQ + ["--time", "inf"], ["argument --time", "finite"]),
    ("eq-cost", EQ + ["--cost", "fastest"], ["argument --cost", "invalid choice"]),
    ("stab-nodes", STAB + ["--nodes", "1"], ["--nodes = 1 is invalid", "integer >= 2"]),
    ("stab-nodes-word", STAB + ["--nodes", "many"], ["argument --nodes", "an integer"]),
    ("stab-tau-scale", STAB + ["--tau-scale", "0"], ["argument --tau-scale", "> 0"]),
    ("stab-method", STAB + ["--method", "newton"], ["argument --method", "invalid choice"]),
    ("stab-policy", STAB + ["--policy", "rand"], ["argument --policy", "invalid choice"]),
    ("ver-scenarios-zero", VER + ["--scenarios", "0"], ["argument --scenarios", "integer >= 1"]),
    ("ver-scenarios-float", VER + ["--scenarios", "1e3"], ["argument --scenarios", "integer"]),
    ("ver-seed-negative", VER + ["--seed", "-1"], ["argument --seed", "[0, 2**63)"]),
    ("ver-seed-huge", VER + ["--seed", str(2**63)], ["argument --seed", "[0, 2**63)"]),
    ("ver-chunk-zero", VER + ["--chunk", "0"], ["argument --chunk", "integer >= 1"]),
    ("ver-min-cells", VER + ["--min-cells", "1"], ["argument --min-cells", "integer >= 2"]),
    ("ver-max-cells", VER + ["--max-cells", "1"], ["argument --max-cells", "integer >= 2"]),
    ("ver-min-above-max", VER + ["--min-cells", "5", "--max-cells", "3"],
     ["--min-cells = 5, --max-cells = 3 is invalid", "--min-cells <= --max-cells"]),
    ("ver-horizon-ticks", VER + ["--horizon", "1", "--tick", "0.3"],
     ["--horizon = 1 is invalid", "whole number of ticks"]),
    ("ver-step-fraction", VER + ["--step-fraction", "0"], ["argument --step-fraction", "> 0"]),
    ("ver-conv-tol", VER + ["--conv-tol", "-1"], ["argument --conv-tol", "> 0"]),
    ("ver-num-processes", VER + ["--coordinator", "h:1", "--num-processes", "zero",
                                 "--process-id", "0"], ["--num-processes = 'zero' is invalid"]),
    ("exp-kind", ["experiment", "everything"], ["argument kind", "invalid choice"]),
    ("exp-scenarios-zero", EXP + ["--scenarios", "0"], ["argument --scenarios", "integer >= 1"]),
    ("exp-trials-zero", EXP + ["--trials", "0"], ["argument --trials", "integer >= 1"]),
    ("exp-seed-negative", EXP + ["--seed", "-1"], ["argument --seed", "[0, 2**63)"]),
    ("exp-horizon-zero", EXP + ["--horizon", "0"], ["argument --horizon", "> 0"]),
    ("exp-tick-word", EXP + ["--tick", "fast"], ["argument --tick", "a number"]),
    ("exp-horizon-ticks", EXP + ["--horizon", "1", "--tick", "0.3"],
     ["--horizon = 1", "multiple of tick"]),
    ("exp-step-fraction-above-one", EXP + ["--step-fraction", "1.5"],
     ["argument --step-fraction", "(0, 1]"]),
    ("exp-policies-no-rand", EXP + ["--policies", "flow-grad"], ["--policies", "'rand'"]),
    ("exp-policies-twice", EXP + ["--policies", "rand", "rand"], ["--policies", "twice"]),
    ("exp-policies-unknown", EXP + ["--policies", "rand", "best"],
     ["argument --policies", "invalid choice"]),
]


@pytest.mark.parametrize(
    "argv,needles", [c[1:] for c in OPTION_CASES], ids=[c[0] for c in OPTION_CASES]
)
def test_bad_option(argv, needles, capsys, no_work):
    code, out, err = _run(argv, capsys)
    assert code == 2 and out == ""
    assert "error: " in err and "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


# ----------------------------------------------------------------------------------------
# Output paths: refused before any work (the verbs that compute raise if reached)
# ----------------------------------------------------------------------------------------

OUT_COMMANDS = {
    "simulate": SIM,
    "verify": VER,
    "experiment": EXP,
}


@pytest.mark.parametrize("where", ["existing-file", "under-a-file"])
@pytest.mark.parametrize("command", list(OUT_COMMANDS))
def test_bad_out_refused_before_work(command, where, tmp_path, capsys, no_work):
    blocker = tmp_path / "taken"
    blocker.write_text("not a directory")
    out = blocker if where == "existing-file" else blocker / "run"
    code, stdout, err = _run(OUT_COMMANDS[command] + ["--out", str(out)], capsys)
    assert code == 2 and stdout == "" and "Traceback" not in err
    assert f"dlbfluid {command}: error: --out = {str(out)!r} is invalid" in err
    assert ("existing file" if where == "existing-file" else "cannot be created") in err


def test_good_out_reaches_the_work(tmp_path, capsys, no_work):
    # (the guard above is not vacuous: a usable --out goes on to the computation)
    # (the first computation is the step-size check's equilibrium, then the simulation)
    argv = SIM + ["--horizon", "1", "--tick", "0.5", "--out", str(tmp_path / "new" / "run")]
    with pytest.raises(ComputationStarted, match="^solve_equilibrium$"):
        main(argv)
    assert (tmp_path / "new" / "run").is_dir()
    with pytest.raises(ComputationStarted, match="^simulate$"):
        main(argv + ["--no-step-check"])


# ----------------------------------------------------------------------------------------
# Capacities: large but finite capacities are feasible (the max-flow test is scale-free)
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("capacity", [1e12, 1e14, 1e16, 1e20, 1e300])
def test_large_capacity_is_feasible(capacity):
    d = copy.deepcopy(THREE)
    for c in d["cells"]:
        c["service"] = {"model": "mm1", "capacity": capacity}
    dl.scenario_from_dict(d)  # no OverloadError
    # ... and a cell that is honestly overloaded next to them is still found.
    OVERLOAD(d)
    d["cells"][1]["service"] = {"model": "mm1", "capacity": 3.0}
    with pytest.raises(dl.OverloadError) as e:
        dl.scenario_from_dict(d)
    assert e.value.cells == ["b"] and e.value.sources == ["b"]
    assert e.value.demand == pytest.approx(3.5) and e.value.capacity == pytest.approx(3.0)


def test_overload_scale_free_in_demand():
    # Tiny and huge rates alike: feasibility depends on ratios only.
    for scale in (1e-12, 1e12):
        d = copy.deepcopy(THREE)
        for c in d["cells"]:
            c["arrival_rate"] *= scale
            c["service"] = {"model": "mm1", "capacity": 3.0 * scale}
        dl.scenario_from_dict(d)
        OVERLOAD(d)
        d["cells"][1]["arrival_rate"] = 3.5 * scale
        with pytest.raises(dl.OverloadError) as e:
            dl.scenario_from_dict(d)
        assert e.value.cells == ["b"]


def test_jump_in_a_linear_profile():
    # One repeated time is a jump (the generator's bursts): accepted, and the peak just
    # before the jump is checked against capacity (it was not: interp takes the right side).
    d = copy.deepcopy(THREE)
    d["cells"][0]["arrival_rate"] = {"times": [0, 10, 10, 20], "rates": [2, 3, 2, 2]}
    s = dl.scenario_from_dict(d)
    np.testing.assert_allclose(s.arrival_rate(9.999)[0], 3.0, rtol=1e-3)
    np.testing.assert_allclose(s.arrival_rate(10.001)[0], 2.0)
    d["cells"][0]["arrival_rate"] = {"times": [0, 10, 10, 20], "rates": [2, 9, 2, 2]}
    with pytest.raises(dl.OverloadError, match="t = 10"):
        dl.scenario_from_dict(d)


def test_profile_kind_defaults_to_piecewise_linear():
    d = copy.deepcopy(THREE)
    d["cells"][0]["arrival_rate"] = {"times": [0, 10], "rates": [1.0, 3.0]}
    np.testing.assert_allclose(dl.scenario_from_dict(d).arrival_rate(5.0)[0], 2.0)


# ----------------------------------------------------------------------------------------
# Zero demand: answered honestly, not a division error (fakes stand in for the solvers)
# ----------------------------------------------------------------------------------------

ZERO = {"name": "idle",
        "cells": [{"name": "a", "arrival_rate": 0, "service": {"model": "mm1", "capacity": 5}},
                  {"name": "b", "arrival_rate": 0.0, "service": {"model": "mm1", "capacity": 5}}],
        "latency": [[0.0, 0.01], [0.01, 0.0]]}


def _fake_equilibrium(scn, cost, **kwargs):
    n = scn.n_cells
    return types.SimpleNamespace(
        # (what the solver returns without demand: N = 0, costs 0, a mean latency of 0)
        status=0, social_cost=0.0, mean_latency=0.0, kkt_residual=0.0, iterations=3,
        N=np.zeros(n), z=np.zeros(n),
        summary=lambda: {"cost": cost, "N": [0.0] * n, "mean_latency": 0.0},
    )


@pytest.mark.parametrize("as_json", [True, False])
def test_zero_demand_equilibrium(as_json, tmp_path, capsys, monkeypatch):
    import dlbfluid._equilibrium

    monkeypatch.setattr(dlbfluid._equilibrium, "solve_equilibrium", _fake_equilibrium)
    path = tmp_path / "idle.json"
    path.write_text(json.dumps(ZERO))
    code, out, err = _run(["equilibrium", str(path)] + (["--json"] if as_json else []), capsys)
    assert code == 0 and "Traceback" not in err
    if as_json:
        res = json.loads(out)
        assert res["price_of_anarchy"] == {"latency": None, "rif": None}
        assert res["rif_mean_latency_range"] is None and res["rif_price_of_anarchy_range"] is None
        assert all(r["mean_latency"] is None for r in res["equilibria"])
    else:
        assert "price of anarchy: undefined" in out and "no demand at t = 0 s" in out
        assert "n/a" in out and "nan" not in out


def test_zero_demand_price_of_anarchy_is_nan(monkeypatch):
    from dlbfluid._equilibrium import anarchy

    monkeypatch.setattr(anarchy, "solve_equilibrium", _fake_equilibrium)
    # (what rif_latency_range gives without demand, tests/test_rif_range.py: costs 0, NaN latencies)
    monkeypatch.setattr(anarchy, "rif_latency_range", lambda scn, **kw: types.SimpleNamespace(
        mean_latency_low=math.nan, mean_latency_high=math.nan, social_cost_low=0.0,
        social_cost_high=0.0))  # fmt: skip
    poa = anarchy.price_of_anarchy(dl.scenario_from_dict(ZERO))
    assert math.isnan(float(poa["latency"])) and math.isnan(float(poa["rif"]))
    assert np.all(np.isnan(np.asarray(poa["rif_price_of_anarchy_range"])))
    assert np.all(np.isnan(np.asarray(poa["rif_mean_latency_range"])))


def _fake_solution(lat, err):
    summary = {"policy": "flow-grad", "horizon": 1.0, "tick": 0.5, "mean_latency": lat,
               "error_rate": err, "window": 0.5, "throughput": [0.0, 0.0],
               "final": {"N": [0.0, 0.0], "x": [[1.0, 0.0], [0.0, 1.0]]}, "final_change": 0.0,
               "oscillation": 0.0, "status": "success", "cells": ["a", "b"]}
    return types.SimpleNamespace(summary=lambda window: dict(summary))


@pytest.mark.parametrize("err,text", [(math.nan, "n/a (no arrivals in the window)"),
                                      (1.0, "n/a (every arrival in the window was dropped)")])
def test_undefined_mean_latency_is_said(err, text, tmp_path, capsys, monkeypatch):
    import dlbfluid._simulate

    monkeypatch.setattr(dlbfluid._simulate, "simulate", lambda *a, **k: _fake_solution(math.nan, err))
    path = tmp_path / "idle.json"
    path.write_text(json.dumps(ZERO))
    code, out, _ = _run(["simulate", str(path), "--horizon", "1", "--tick", "0.5"], capsys)
    assert code == 0 and text in out and "nan" not in out
    code, out, _ = _run(["simulate", str(path), "--horizon", "1", "--tick", "0.5", "--json"], capsys)
    assert json.loads(out)["mean_latency"] is None


# ----------------------------------------------------------------------------------------
# Warnings and progress
# ----------------------------------------------------------------------------------------


def test_huge_step_size_warns(capsys, no_work):
    with pytest.raises(ComputationStarted):
        main(SIM + ["--step-size", "1e6"])
    err = capsys.readouterr().err
    assert "dlbfluid simulate: warning: --step-size = 1e+06" in err and "eta*h" in err
    with pytest.raises(ComputationStarted):  # no warning for a routing without a step
        main(SIM + ["--step-size", "1e6", "--policy", "rand"])
    with pytest.raises(ComputationStarted):
        main(SIM)
    assert "warning" not in capsys.readouterr().err


def test_experiment_progress_without_a_terminal(tmp_path, monkeypatch, capsys, no_work):
    import dlbfluid._evaluation.experiment

    seen = {}

    def fake(cfg, out, *, progress, processes=None, labels=None):
        seen["progress"], seen["labels"] = progress, labels
        return {"experiment": cfg.experiment, "config": {}, "summary": []}

    monkeypatch.setattr(dlbfluid._evaluation.experiment, "run_experiment", fake)
    assert not __import__("sys").stderr.isatty()  # (capsys: not a terminal)
    assert main(EXP + ["--out", str(tmp_path / "e"), "--json"]) == 0
    assert seen["progress"] is True  # Progress writes a line every 10 s to a log
    assert seen["labels"]["out_dir"] == "--out"  # the command line's own option names
    assert main(EXP + ["--out", str(tmp_path / "e"), "--json", "--no-progress"]) == 0
    assert seen["progress"] is False
