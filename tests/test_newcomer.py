"""What a newcomer met on a fresh clone, mended (issue 31, item 8): the compilation cache in
one public call, a `simulate` default that settles (and a warning when a run does not),
MNLB's latency on the demo explained, one-line option errors for every verb, labelled and
singular-aware output, and a compile note that does not claim to compile on warm runs."""

import json
import math
import os
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest
from helpers import THREE

import dlbfluid as dl
from dlbfluid._cli import _common, _demo, build_parser, main
from dlbfluid._cli import _simulate as cli_simulate
from dlbfluid._defaults import PROBE_TICK, SIMULATE_HORIZON

# ---------------------------------------------------------------------------------------
# The persistent compilation cache, one public call
# ---------------------------------------------------------------------------------------

_CACHE_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import jax, jax.numpy as jnp
    import dlbfluid as dl
    d = sys.argv[1]
    def files():
        return sum(len(f) for _, _, f in os.walk(d)) if os.path.isdir(d) else 0
    jax.jit(lambda x: jnp.sin(x) * 3)(jnp.ones(7)).block_until_ready()   # cache still off
    before = files()
    got = dl.enable_compilation_cache(d)
    jax.jit(lambda x: jnp.cos(x) + 5)(jnp.ones(9)).block_until_ready()
    print(json.dumps({"before": before, "after": files(), "got": str(got),
                      "dir": jax.config.jax_compilation_cache_dir}))
    """
)


def test_enable_compilation_cache_keeps_programs_on_disk(tmp_path):
    """In a fresh process whose JAX has already compiled once with no cache: nothing is
    written before the call (the control), compiled programs are written after it."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}  # fmt: skip
    d = tmp_path / "cache"
    run = subprocess.run([sys.executable, "-c", _CACHE_SCRIPT, str(d)], env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["before"] == 0 and out["after"] >= 1
    assert out["got"] == str(d) == out["dir"]


def test_enable_compilation_cache_default_and_errors(tmp_path, monkeypatch):
    assert "enable_compilation_cache" in dir(dl)
    monkeypatch.setenv("DLBFLUID_CACHE_DIR", "off")
    assert dl.enable_compilation_cache() is None  # the command line's "off" is respected
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"path = '.*file/sub' is invalid: .*cannot be created"):
        dl.enable_compilation_cache(blocker / "sub")


# ---------------------------------------------------------------------------------------
# simulate's default horizon, and the warning when a run ends before it settles
# ---------------------------------------------------------------------------------------


def test_simulate_and_demo_default_to_a_horizon_that_settles():
    p = build_parser()
    assert p.parse_args(["simulate", "default"]).horizon == SIMULATE_HORIZON == 400.0
    assert p.parse_args(["demo"]).horizon == SIMULATE_HORIZON
    assert abs(SIMULATE_HORIZON / PROBE_TICK - round(SIMULATE_HORIZON / PROBE_TICK)) < 1e-9


def test_unsettled_note_threshold():
    # The 100-s default of before: a swing of 1.92 against workloads up to ~30.
    note = cli_simulate.unsettled_note(1.92, [30.0, 5.0, 12.0, 3.0])
    assert note is not None and "1.92" in note and "6.4%" in note and "--horizon" in note
    assert cli_simulate.unsettled_note(0.0058, [30.0, 5.0]) is None  # the 400-s default
    assert cli_simulate.unsettled_note(0.011, [0.2]) is not None  # scale at least 1 request
    assert cli_simulate.unsettled_note(0.009, [0.2]) is None
    assert cli_simulate.unsettled_note(math.nan, [1.0]) is None  # the status says it


def test_simulate_warns_exactly_when_unsettled(tmp_path, capsys):
    f = tmp_path / "three.json"
    f.write_text(json.dumps(THREE))
    base = ["simulate", str(f), "--tick", "0.05", "--horizon", "1", "--json"]
    assert main(base + ["--no-step-check"]) == 0
    cap = capsys.readouterr()
    res = json.loads(cap.out)
    swing = res["oscillation"] / max(1.0, max(abs(v) for v in res["final"]["N"]))
    assert ("not settled" in cap.err) == (swing > cli_simulate.SETTLED)
    assert swing > cli_simulate.SETTLED  # 1 s is mid-transient for this scenario


# ---------------------------------------------------------------------------------------
# The demo says why MNLB trails Rand on the built-in scenario
# ---------------------------------------------------------------------------------------


def test_mnlb_note_reports_local_share_and_utilisation():
    scn = dl.default_scenario()
    n = scn.n_cells
    local = types.SimpleNamespace(x=np.eye(n)[None])  # MNLB's LP on this scenario: all local
    note = _demo._mnlb_note(scn, local, SIMULATE_HORIZON)
    assert "100% of the traffic" in note and "0.70, 0.38, 0.83, 0.90" in note
    assert "0.943 x rand" in note
    # Control: everything to the first cell (demand 36 req/s, its capacity 20).
    first = types.SimpleNamespace(x=np.eye(n)[[0] * n][None])
    note = _demo._mnlb_note(scn, first, SIMULATE_HORIZON)
    assert "39% of the traffic" in note and "1.80, 0.00, 0.00, 0.00" in note


# ---------------------------------------------------------------------------------------
# Option errors: one line, for every verb
# ---------------------------------------------------------------------------------------

BAD = [
    (["simulate", "default", "--tick", "-1"], "argument --tick: '-1' is invalid"),
    (["demo", "--horizon", "x"], "argument --horizon: 'x' is invalid"),
    (["equilibrium", "default", "--cost", "foo"], "argument --cost: invalid choice: 'foo'"),
    (["stability"], "the following arguments are required: SCENARIO"),
    (["verify", "--scenarios", "0"], "argument --scenarios: '0' is invalid"),
    (["experiment", "tick", "--trials", "0"], "argument --trials: '0' is invalid"),
]


@pytest.mark.parametrize("argv, message", BAD, ids=[b[0][0] for b in BAD])
def test_option_errors_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.count("\n") == 1 and "usage:" not in err
    assert err.startswith(f"dlbfluid {argv[0]}: error: {message}")
    assert f"`dlbfluid {argv[0]} --help` lists the options" in err


def test_the_top_level_parser_still_shows_its_usage(capsys):
    """Control: the check above sees a usage block where one is printed."""
    with pytest.raises(SystemExit):
        main([])
    err = capsys.readouterr().err
    assert "usage: dlbfluid" in err and err.count("\n") >= 2


# ---------------------------------------------------------------------------------------
# Output wording
# ---------------------------------------------------------------------------------------


def test_plural():
    assert _common.plural(1, "trial") == "1 trial"
    assert _common.plural(2, "trial") == "2 trials"
    assert _common.plural(0, "tick") == "0 ticks"
    assert _common.plural(1, "policy", "policies") == "1 policy"
    assert _common.plural(8, "policy", "policies") == "8 policies"


def test_compile_note_says_compile_only_when_the_cache_cannot_hold_the_programs(tmp_path):
    assert _common.compile_note(None) == "compiles first: the compilation cache is off"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _common.compile_note(str(empty)).startswith("compiles first; a second run loads")
    warm = tmp_path / "warm"
    warm.mkdir()
    (warm / "jit_f-abc-cache").write_bytes(b"x")
    assert _common.compile_note(str(warm)).startswith("programs loaded from the cache in")
    assert _common.compile_note(str(tmp_path / "missing")).startswith("compiles first")


def _fake_verify_summary():
    est = {"q50": None, "q10": None, "q90": None}
    pol = {
        "in_hypothesis_fraction": 1.0, "theorem1_holds_fraction": 1.0, "tightness": est,
        "estimates_hold_fraction": {}, "eta0_over_eta_star": est,
        "eta_global_over_eta_star": est, "bistable_fraction": None,
        "projection_check_holds_fraction": 1.0, "converged_fraction": 1.0, "failed": 0,
        "time_average_distance": est, "eta_over_eta_star": est, "bound_holds_fraction": None,
        "empirical_eta0_over_eta_star": est,
    }  # fmt: skip
    return {"scenarios": 1, "devices": ["cpu:0"], "wall_s": 0.04, "records": [],
            "policies": {"flow-grad": pol}}  # fmt: skip


def test_verify_closes_with_a_labelled_wall_time(monkeypatch, capsys):
    import dlbfluid._verify as verify_mod

    monkeypatch.setattr(verify_mod, "verify", lambda *a, **k: _fake_verify_summary())
    assert main(["verify", "--scenarios", "1", "--policy", "flow-grad"]) == 0
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert err_lines[-1] == "dlbfluid verify: wall time 0.0 s"


# ---------------------------------------------------------------------------------------
# One CLI-flag table per verb, in dlbfluid/_cli/_flags.py (issue 31, item 3)
# ---------------------------------------------------------------------------------------


def _options(verb: str) -> set[str]:
    sub = next(a for a in build_parser()._actions if hasattr(a, "choices") and a.choices)
    return {s for a in sub.choices[verb]._actions for s in (*a.option_strings, a.metavar) if s}


def test_flag_tables_name_options_the_verbs_have():
    from dlbfluid._cli import _flags

    assert set(_flags.SIMULATE_REQUESTS.values()) <= _options("simulate")
    assert set(_flags.EXPERIMENT.values()) - {"KIND"} <= _options("experiment")
    flags = {f for v in _flags.VERIFY.values() for f in v.split(", ")}
    assert flags <= _options("verify")
    assert "--no-such-flag" not in _options("verify")  # control


def _option_tables(path) -> list[dict]:
    """The dict literals of `path` that map names to command-line options (`"--x"`)."""
    import ast

    tree = ast.parse(path.read_text())
    tables = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict) and len(node.values) >= 2:
            values = [getattr(v, "value", None) for v in node.values]
            if sum(isinstance(v, str) and v.startswith("--") for v in values) >= 2:
                tables.append(node)
    return tables


def test_the_library_holds_no_option_table():
    """The command line's labels live in `dlbfluid/_cli/_flags.py` only; the library names
    its own fields and takes the table as `labels=`."""
    import pathlib

    import dlbfluid

    root = pathlib.Path(dlbfluid.__file__).parent
    assert len(_option_tables(root / "_cli" / "_flags.py")) >= 3  # control: the detector sees them
    found = {str(p.relative_to(root)): len(_option_tables(p)) for p in root.rglob("*.py")
             if "_cli" not in p.parts}  # fmt: skip
    assert {p: n for p, n in found.items() if n} == {}


def test_relabel_names_the_option():
    from dlbfluid._cli._flags import EXPERIMENT, SIMULATE_REQUESTS, relabel

    assert str(relabel(ValueError("scenarios = 0 is invalid: x"), EXPERIMENT)) == (
        "--scenarios = 0 is invalid: x"
    )
    assert str(relabel(ValueError("warmup: too long"), SIMULATE_REQUESTS)) == "--window: too long"
    assert str(relabel(ValueError("other = 1 is invalid"), EXPERIMENT)) == "other = 1 is invalid"
