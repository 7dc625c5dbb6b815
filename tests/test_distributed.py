"""One run across processes (`jax.distributed`; docs/cli.md, *On a cluster*): two CPU processes on
localhost give the merged `--json` output and files of a one-process run."""

import csv
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from dlbfluid._cli import main
from dlbfluid._runtime.distributed import Processes, resolve

ROOT = Path(__file__).resolve().parent.parent
ENV_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")

# Runs a list of steps in one process: CLI commands through `main` (stdout and stderr
# captured per command; `{out}` in an argument is this process's output root, `argvI`
# replaces `argv` on process I; `fail: I` makes process I's share fail) and, on process 0
# only, `truncate` (keep the first lines of a file and append a torn line: a run killed
# while writing). `verify`'s per-chunk numerics are replaced by records computed from each
# scenario's own draw, and each process logs the chunks it computes: that chunk function is
# the one-process one on the same chunk (the split is by whole chunks), and leaving out its
# compilations keeps this test short; `simulate` and `experiment` run for real. The
# one-process run calls `run_steps` in the test's own process (`_run_here`).
DRIVER = r"""
import contextlib, io, json, math, os, sys, time
from pathlib import Path
import dlbfluid._verify.records
from dlbfluid._cli import main

chunks = []

def records(idx, seed, source, pols, chunk, *rest, **kw):
    assert 1 <= len(idx) <= chunk
    chunks.append(list(idx))
    out = []
    for i in idx:
        d = source(seed, i)
        u = d["utilisation"]
        out.append({"index": i, "n_cells": len(d["cells"]), "utilisation": u, "policies": {
            p: {"step_size": u / 7, "critical_step_size": None if i == 1 else u / 3,
                "eta_over_eta_star": None if i == 1 else 3 / 7,
                "time_average_distance": math.sqrt(u) / (i + 1), "final_distance": u**3 / 3,
                "oscillation": math.exp(-i), "converged": i % 2 == 0, "status": "success",
                "equilibrium_status": "success", "kkt_residual": 1e-12 * i}
            for p, _ in pols}})
    return out

def boom(*args, **kw):
    raise RuntimeError("injected")

def run_steps(steps, extra, out, me):
    done = []
    real = dlbfluid._verify.records._chunk_records
    try:
        for step in steps:
            if "truncate" in step:
                if me == 0:
                    path = Path(out) / step["truncate"]
                    lines = path.read_text().splitlines(keepends=True)
                    path.write_text("".join(lines[: step["keep"]]) + step["torn"])
                continue
            argv = [a.replace("{out}", out) for a in step.get(f"argv{me}", step["argv"])] + extra
            dlbfluid._verify.records._chunk_records = boom if step.get("fail") == me else records
            chunks.clear()
            so, se, t = io.StringIO(), io.StringIO(), time.perf_counter()
            with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
                try:
                    code = main(argv)
                except Exception as e:
                    code = f"{type(e).__name__}: {e}"
            done.append({"code": code, "stdout": so.getvalue(), "stderr": se.getvalue(),
                         "chunks": list(chunks), "wall_s": time.perf_counter() - t})
    finally:
        dlbfluid._verify.records._chunk_records = real
    return done

if __name__ == "__main__":
    steps, extra = json.loads(Path(sys.argv[1]).read_text()), json.loads(sys.argv[2])
    me = int(os.environ.get("DRIVER_PROCESS", "0"))
    Path(sys.argv[4]).write_text(json.dumps(run_steps(steps, extra, sys.argv[3], me)))
"""

SIMULATE = ["simulate", "default", "--policy", "rand", "--horizon", "2", "--tick", "0.1",
            "--n-save", "10", "--json", "--no-progress", "--out", "{out}/sim"]
VERIFY = ["verify", "--scenarios", "4", "--chunk", "2", "--seed", "3", "--min-cells", "2",
          "--max-cells", "2", "--horizon", "2", "--tick", "0.1", "--json", "--no-progress",
          "--policy", "flow-grad",  # (one flow policy: the merge is the same for each)
          "--out", "{out}/ver"]
EXPERIMENT = ["experiment", "burst", "--scenarios", "2", "--trials", "1", "--horizon", "6",
              "--tick", "0.1", "--policies", "rand", "--no-error-aversion", "--json",
              "--no-progress",
              "--out", "{out}/exp"]
DISTRIBUTED = [
    {"argv": SIMULATE},
    {"argv": VERIFY},  # chunk [0, 1] on process 0, [2, 3] on process 1
    {"argv": EXPERIMENT},  # scenario 0 on process 0, 1 on process 1
    # Killed runs, resumed across the two processes: process 0 reads what is done (verify:
    # chunk [0, 1]; its chunk [2, 3] is then all that is left, and process 1 idles).
    {"truncate": "ver/results.jsonl", "keep": 2, "torn": '{"index": 2, "n_ce'},
    {"argv": VERIFY},
    {"truncate": "exp/results.csv", "keep": 2, "torn": "burst,burst,rand,1,0,"},
    {"argv": EXPERIMENT},
    # Errors found by process 0 alone, or by comparing the processes' options, stop both.
    {"argv": [a if a != "1" else "2" for a in EXPERIMENT]},  # --trials 2 in the same --out
    {"argv": VERIFY, "argv1": [a if a != "4" else "5" for a in VERIFY]},  # --scenarios 5
    # An unexpected failure in process 1 stops process 0 too (no wait for the timeouts).
    {"argv": [a.replace("/ver", "/ver2") for a in VERIFY], "fail": 1},
]

# Floats equal to this relative tolerance (observed: identical); the experiment's files hold
# 10 significant digits, so its numbers are compared to that precision.
REL = 1e-12
REL_CSV = 1e-9


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _same(a, b, rel, where="") -> None:
    """`a` equals `b`: the same keys, lengths and strings, floats to `rel`."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {set(a) ^ set(b)}"
        for k in a:
            _same(a[k], b[k], rel, f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), f"{where}: lengths"
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, rel, f"{where}[{i}]")
    elif isinstance(a, float) and not isinstance(b, bool) and isinstance(b, (int, float)):
        assert a == b or math.isclose(a, b, rel_tol=rel, abs_tol=1e-300), f"{where}: {a} != {b}"
    elif isinstance(a, str) and isinstance(b, str) and a != b:
        x, y = _number(a), _number(b)
        assert x is not None and y is not None and math.isclose(x, y, rel_tol=rel), \
            f"{where}: {a!r} != {b!r}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _number(text):
    try:
        return float(text)
    except ValueError:
        return None


def _without(d, *keys):
    return {k: v for k, v in d.items() if k not in keys}


def _csv(path):
    with open(path, newline="") as f:
        return [dict(r) for r in csv.DictReader(f)]


def _run_here(steps, out):
    """The driver's steps as one process, in this one (its compilations go to the run's
    persistent cache, and a process start is saved)."""
    namespace = {"__name__": "driver"}
    exec(compile(DRIVER, "driver.py", "exec"), namespace)
    return json.loads(json.dumps(namespace["run_steps"](steps, [], str(out), 0)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A one-process run of the commands the two-process run starts with (in this
    process), then the two-process run (whose processes load the one-process run's
    compilations from JAX's persistent cache: the same programs, compiled once instead of
    once per process)."""
    tmp = tmp_path_factory.mktemp("distributed")
    (tmp / "driver.py").write_text(DRIVER)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    # (the run's persistent cache of tests/conftest.py, every program: the one-process
    # stage also loads what the in-process command-line tests compiled)
    env.update(JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir or str(tmp / "cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    one = [{"argv": SIMULATE}, {"argv": VERIFY}, {"argv": EXPERIMENT}]
    address = f"127.0.0.1:{port}"
    stages = [
        # Process 0 from the options, process 1 from the environment variables.
        [("p0", DISTRIBUTED, ["--coordinator", address, "--num-processes", "2",
                              "--process-id", "0"], {"DRIVER_PROCESS": "0"}),
         ("p1", DISTRIBUTED, [], {"JAX_COORDINATOR_ADDRESS": address, "JAX_NUM_PROCESSES": "2",
                                  "JAX_PROCESS_ID": "1", "DRIVER_PROCESS": "1"})],
    ]
    stdout, res = {}, {"one": _run_here(one, tmp / "one")}
    t0 = time.perf_counter()
    for stage in stages:
        procs = {}
        for name, steps, extra, more in stage:
            (tmp / f"{name}.steps.json").write_text(json.dumps(steps))
            args = [sys.executable, str(tmp / "driver.py"), str(tmp / f"{name}.steps.json"),
                    json.dumps(extra), str(tmp / name), str(tmp / f"{name}.result.json")]
            procs[name] = subprocess.Popen(args, cwd=ROOT, env=dict(env, **more), text=True,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            outs = {n: p.communicate(timeout=max(1.0, 300 - (time.perf_counter() - t0)))
                    for n, p in procs.items()}
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.communicate()
        for name, p in procs.items():
            assert p.returncode == 0, f"{name}: {outs[name][1][-3000:]}"
            stdout[name] = outs[name][0]
            res[name] = json.loads((tmp / f"{name}.result.json").read_text())
    return tmp, res, stdout


def test_two_processes_merge_to_a_one_process_run(runs):
    tmp, res, stdout = runs
    one, p0, p1 = res["one"], res["p0"], res["p1"]
    # Every process exits with process 0's status; only process 0 prints, and nothing
    # else reaches stdout (not even from JAX's runtime).
    assert [r["code"] for r in p0[:7]] == [r["code"] for r in p1[:7]] == [0, 0, 0, 0, 0, 2, 2]
    assert p1[7]["code"] == "RuntimeError: injected"
    assert p0[7]["code"] == "RuntimeError: stopped because process 1 failed: RuntimeError: injected"
    assert all(r["stdout"] == "" for r in p1) and stdout == {"p0": "", "p1": ""}
    assert not (tmp / "p1").exists()  # process 1 writes nothing
    js = lambda r: json.loads(r["stdout"])  # noqa: E731
    assert all(len(r["stdout"].splitlines()) == 1 for r in one + p0[:5])

    # simulate: the --json object and the files.
    _same(_without(js(p0[0]), "wall_s"), _without(js(one[0]), "wall_s"), REL, "simulate")
    a, b = tmp / "p0" / "sim", tmp / "one" / "sim"
    _same(_without(json.loads((a / "summary.json").read_text()), "wall_s"),
          _without(json.loads((b / "summary.json").read_text()), "wall_s"), REL, "sim/summary")
    za, zb = np.load(a / "trajectory.npz"), np.load(b / "trajectory.npz")
    assert set(za.files) == set(zb.files)
    for k in za.files:
        np.testing.assert_allclose(za[k], zb[k], rtol=REL, atol=0, err_msg=k)
    assert (a / "trajectory.png").stat().st_size > 10_000

    # verify, fresh and resumed after a kill: records, summary, results.jsonl, summary.json.
    ref = js(one[1])
    assert ref["summary"]["scenarios"] == 4
    for got in (js(p0[1]), js(p0[3])):  # fresh, resumed
        _same(got["scenarios"], ref["scenarios"], REL, "verify.scenarios")
        _same(_without(got["summary"], "wall_s", "devices"),
              _without(ref["summary"], "wall_s", "devices"), REL, "verify.summary")
    a, b = tmp / "p0" / "ver", tmp / "one" / "ver"
    lines = lambda p: [json.loads(x) for x in (p / "results.jsonl").read_text().splitlines()]  # noqa: E731
    assert [r["index"] for r in lines(a)] == [0, 1, 2, 3]
    # Whole chunks, the next two at a time: fresh, [0, 1] | [2, 3]; resumed after chunk
    # [0, 1] was written, [2, 3] | nothing. One process computes them all.
    assert (p0[1]["chunks"], p1[1]["chunks"]) == ([[0, 1]], [[2, 3]])
    assert (p0[3]["chunks"], p1[3]["chunks"]) == ([[2, 3]], [])
    assert one[1]["chunks"] == [[0, 1], [2, 3]]
    _same(lines(a), lines(b), REL, "results.jsonl")
    _same(_without(json.loads((a / "summary.json").read_text()), "wall_s", "devices"),
          _without(json.loads((b / "summary.json").read_text()), "wall_s", "devices"), REL,
          "ver/summary.json")
    assert len(js(p0[1])["summary"]["devices"]) == 2  # the devices of both processes

    # experiment, fresh and resumed: the --json object and every file but the plot.
    ref = _without(js(one[2]), "out")
    for got in (js(p0[2]), js(p0[4])):  # fresh, resumed
        _same(_without(got, "out"), ref, REL_CSV, "experiment")
    a, b = tmp / "p0" / "exp", tmp / "one" / "exp"
    rows = _csv(a / "results.csv")
    assert [(r["policy"], r["scenario"]) for r in rows] == [
        ("rand", str(s)) for s in range(2)]
    assert all(r["status"] == "success" for r in rows)
    _same(rows, _csv(b / "results.csv"), REL_CSV, "results.csv")
    _same(_csv(a / "summary.csv"), _csv(b / "summary.csv"), REL_CSV, "summary.csv")
    for f in ("summary.json", "config.json"):
        _same(json.loads((a / f).read_text()), json.loads((b / f).read_text()), REL_CSV, f)
    assert (a / "burst.png").exists()

    # Errors: process 0's (a different experiment in --out) and mismatched options.
    for r in (p0[5], p1[5]):
        assert "holds a different experiment" in r["stderr"]
    for r in (p0[6], p1[6]):
        assert "every process must run the same command" in r["stderr"]
        assert "--scenarios = 5 on process 1 is invalid: process 0 runs with 4" in r["stderr"]


def test_bad_process_options_name_the_option(monkeypatch, capsys):
    for k in ENV_VARS:
        monkeypatch.delenv(k, raising=False)
    run = ["verify", "--scenarios", "1", "--no-progress"]
    for extra, needle in [
        (["--coordinator", "nohost", "--num-processes", "2", "--process-id", "0"],
         "--coordinator = 'nohost' is invalid: expected HOST:PORT"),
        (["--coordinator", "h:99999", "--num-processes", "2", "--process-id", "0"],
         "--coordinator = 'h:99999' is invalid"),
        (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"],
         "--process-id = 2 is invalid: expected an integer in [0, 2) (--num-processes = 2)"),
        (["--coordinator", "h:1", "--num-processes", "zero", "--process-id", "0"],
         "--num-processes = 'zero' is invalid: expected an integer >= 1"),
        (["--num-processes", "2"], "--num-processes given without --coordinator (or "
         "JAX_COORDINATOR_ADDRESS) and --process-id (or JAX_PROCESS_ID)"),
    ]:
        assert main(run + extra) == 2
        assert needle in capsys.readouterr().err
    monkeypatch.setenv("JAX_PROCESS_ID", "-1")
    assert main(run + ["--coordinator", "h:1", "--num-processes", "3"]) == 2
    assert "JAX_PROCESS_ID = -1 is invalid: expected an integer in [0, 3)" in capsys.readouterr().err
    monkeypatch.setenv("JAX_PROCESS_ID", "0")
    assert main(["simulate", "default", "--coordinator", "h:1"]) == 2
    assert "--num-processes (or JAX_NUM_PROCESSES)" in capsys.readouterr().err


def test_shares_and_one_process():
    for n in range(8):
        for count in (1, 2, 3, 5):
            parts = [Processes(count, i).share(n) for i in range(count)]
            assert [k for p in parts for k in p] == list(range(n))  # contiguous, in order
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert resolve(environ={}) is None
    assert resolve("h:1", "1", "0", environ={}) is None  # one process: nothing to start
    assert resolve(environ={"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
                            "JAX_PROCESS_ID": "3"}) == {
        "coordinator": "10.0.0.1:1234", "num_processes": 4, "process_id": 3}
    one = Processes()
    assert one.main and one.gather({"a": 1}, "t") == [{"a": 1}] and one.broadcast(5, "t") == 5
    assert one.allgather([1.5], "t") == [[1.5]] and one.finish(2) == 2
