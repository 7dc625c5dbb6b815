"""The command line's caches (docs/cli.md, *Compilation cache*): where the persistent compilation
cache lives (`_runtime.cache`), and the traced solvers kept beside it (`_runtime.exported`), which must give
the plain call's numbers bit for bit, never trace again for the same shapes, and fall back
to tracing whenever an artefact cannot be used."""

import json
import os

import jax
import numpy as np
import pytest
from helpers import THREE, two_mm1

import dlbfluid as dl
from dlbfluid import _equilibrium as eqm
from dlbfluid._cli import main
from dlbfluid._runtime import cache as _cache
from dlbfluid._runtime import exported as _exported


@pytest.mark.parametrize(
    "env, want",
    [
        ({"DLBFLUID_CACHE_DIR": "/x/y", "JAX_COMPILATION_CACHE_DIR": "/z"}, "/x/y"),
        ({"DLBFLUID_CACHE_DIR": "off"}, None),
        ({"DLBFLUID_CACHE_DIR": " 0 "}, None),
        ({"DLBFLUID_CACHE_DIR": ""}, None),
        ({"JAX_COMPILATION_CACHE_DIR": "/z"}, "/z"),
        ({"XDG_CACHE_HOME": "/c"}, "/c/dlbfluid/jax"),
    ],
)
def test_cache_dir_precedence(env, want):
    got = _cache.cache_dir(env)
    assert (None if got is None else str(got)) == want


def test_uncreatable_cache_dir_leaves_the_cache_off(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    lines = []

    class Stream:
        def write(self, s):
            lines.append(s)

    got = _cache.enable_from_environment({"DLBFLUID_CACHE_DIR": str(blocker / "sub")}, Stream())
    assert got is None
    text = "".join(lines)
    assert "compilation cache off" in text and "DLBFLUID_CACHE_DIR" in text and str(blocker) in text


@pytest.fixture
def fresh(monkeypatch):
    """No artefact loaded in this process yet (as in a new command-line call)."""
    monkeypatch.setattr(_exported, "_LOADED", {})


def test_kept_equilibrium_solver_is_not_traced_again(tmp_path, fresh):
    scn = dl.scenario_from_dict(THREE)
    plain = dl.solve_equilibrium(scn, "latency")
    before = eqm._TRACES["latency"]
    with _exported.exporting(tmp_path):
        first = dl.solve_equilibrium(scn, "latency")
    files = sorted((tmp_path / "exported").glob("equilibrium-*.jaxexport"))
    assert len(files) == 1 and eqm._TRACES["latency"] == before + 1  # traced to export
    _exported._LOADED.clear()  # a new process: the program comes from the file
    with _exported.exporting(tmp_path):
        again = dl.solve_equilibrium(scn, "latency")
    assert eqm._TRACES["latency"] == before + 1
    for a in (first, again):
        np.testing.assert_array_equal(np.asarray(a.N), np.asarray(plain.N))
        np.testing.assert_array_equal(np.asarray(a.x), np.asarray(plain.x))
        assert int(a.iterations) == int(plain.iterations)
    # Outside `exporting` nothing is read or written.
    dl.solve_equilibrium(dl.scenario_from_dict(two_mm1()), "latency")
    assert sorted((tmp_path / "exported").glob("*.jaxexport")) == files


def test_kept_simulation_equals_the_plain_one(tmp_path, fresh):
    scn = dl.scenario_from_dict(THREE)
    # (the standard shape of tests/test_simulate.py: THREE alone, Fast(), 40 saves)
    kw = dict(step_size=0.2, tick=0.1, horizon=4.0, n_save=40)
    plain = dl.simulate(scn, "flow-grad", **kw)
    with _exported.exporting(tmp_path):
        kept = dl.simulate(scn, "flow-grad", **kw)
        # a progress callback cannot be exported: that call is traced as usual
        shown = dl.simulate(scn, "flow-grad", progress=True, **kw)
    assert len(list((tmp_path / "exported").glob("simulate-*.jaxexport"))) == 1
    for s in (kept, shown):
        assert s.status_names() == "success"
        for f in ("N", "x", "arrivals", "in_flight"):
            np.testing.assert_array_equal(np.asarray(getattr(s, f)), np.asarray(getattr(plain, f)))


def test_unstable_static_configuration_is_not_kept_and_a_torn_file_is_replaced(
    tmp_path, fresh, monkeypatch
):
    def f(a):
        return a + 1

    traced = []

    def g(a):
        traced.append(1)
        return a + 1

    x = jax.numpy.ones(3)
    with _exported.exporting(tmp_path):
        np.testing.assert_array_equal(np.asarray(_exported.call("probe", jax.jit(f), (x,), (f,))), 2.0)
        assert not (tmp_path / "exported").exists()  # a repr with an address: not kept
        out = _exported.call("probe", jax.jit(f), (x,), ("stable",), trace=g)
    (path,) = (tmp_path / "exported").iterdir()
    assert path.name.startswith("probe-") and traced == [1]
    np.testing.assert_array_equal(np.asarray(out), 2.0)
    # A torn file (a full disk, a foreign writer) is traced again and replaced.
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[: size // 3])
    _exported._LOADED.clear()
    with _exported.exporting(tmp_path):
        out = _exported.call("probe", jax.jit(f), (x,), ("stable",), trace=g)
    assert traced == [1, 1] and path.stat().st_size == size
    np.testing.assert_array_equal(np.asarray(out), 2.0)
    _exported._LOADED.clear()
    with _exported.exporting(tmp_path):  # and loaded, not traced, from then on
        _exported.call("probe", jax.jit(f), (x,), ("stable",), trace=g)
    assert traced == [1, 1]
    # Other package source under the same version (a git checkout, an editable install):
    # traced again, into a file of its own.
    monkeypatch.setattr(_exported, "_source_digest", lambda: "edited")
    _exported._LOADED.clear()
    with _exported.exporting(tmp_path):
        _exported.call("probe", jax.jit(f), (x,), ("stable",), trace=g)
    assert traced == [1, 1, 1] and len(list((tmp_path / "exported").iterdir())) == 2


def test_command_line_keeps_its_solvers_unless_the_cache_is_off(tmp_path, monkeypatch, capsys):
    d = tmp_path / "scn.json"
    d.write_text(json.dumps(THREE))
    argv = ["equilibrium", str(d), "--cost", "latency", "--json"]
    monkeypatch.setenv("DLBFLUID_CACHE_DIR", "off")
    assert main(argv) == 0
    off = json.loads(capsys.readouterr().out)
    monkeypatch.setenv("DLBFLUID_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(_exported, "_LOADED", {})
    try:
        assert main(argv) == 0
    finally:  # the CLI pointed this process's JAX cache at tmp_path: point it back
        jax.config.update("jax_compilation_cache_dir", _conftest_cache())
    on = json.loads(capsys.readouterr().out)
    assert [p.name.split("-")[0] for p in (tmp_path / "cache" / "exported").iterdir()] == [
        "equilibrium"
    ]
    assert _exported._DIR[0] is None  # only for the length of the call
    on.pop("wall_s", None), off.pop("wall_s", None)
    assert on == off


def _conftest_cache() -> str:
    return os.environ["JAX_COMPILATION_CACHE_DIR"]



def test_solver_options_follow_the_arguments_dtype():
    """float64 programs compile with `_FLOAT64_OPTIONS` (XLA's earlier CPU fusion emitters,
    benchmarks/compile_options.py), float32 ones without them; `solver_jit` decides per
    call from the arguments, so one function serves both dtypes with one program each."""
    from dlbfluid._runtime import devices as _devices

    f32 = jax.numpy.ones(2, jax.numpy.float32)
    assert _devices.uses_float32({"a": f32, "b": 1.0, "c": "text"})
    assert _devices.uses_float32([jax.numpy.ones(2), jax.numpy.ones(1, jax.numpy.bfloat16)])
    assert not _devices.uses_float32((jax.numpy.ones(2), np.arange(3), 1.0, None))
    lo, hi = _devices.compiler_options(True), _devices.compiler_options(False)
    assert not set(_devices._FLOAT64_OPTIONS) & set(lo)
    assert set(hi) == set(lo) | set(_devices._FLOAT64_OPTIONS)  # (this jaxlib knows it)
    built = []

    def fake_jit(fn, compiler_options):
        built.append(compiler_options)
        return fn

    call = _devices.solver_jit(lambda x: x * 2, jit=fake_jit)
    assert float(call(jax.numpy.float32(1.5))) == 3.0
    assert float(call(jax.numpy.float64(1.5))) == 3.0
    call(jax.numpy.float64(2.0))
    assert built == [lo, hi]


def test_fast_compile_adds_the_optimisation_level_and_checks_its_value(monkeypatch, capsys):
    """`DLBFLUID_FAST_COMPILE=1` adds XLA's backend optimisation level 0 to the options of
    a certified program (the equilibrium solver) of either dtype, never to the simulator's;
    `0` or unset leaves the options as they are; another value is refused naming the
    variable."""
    from dlbfluid._runtime import devices as _devices

    key = "xla_backend_optimization_level"
    monkeypatch.setenv(_devices.FAST_COMPILE_ENV, "1")
    on = [_devices.compiler_options(f32, certified=True) for f32 in (False, True)]
    assert all(o[key] == 0 for o in on)
    assert key not in _devices.compiler_options(False)  # (the simulator's)
    for off in ("0", ""):
        monkeypatch.setenv(_devices.FAST_COMPILE_ENV, off)
        plain = _devices.compiler_options(False, certified=True)
        assert plain == {k: v for k, v in on[0].items() if k != key}
    monkeypatch.delenv(_devices.FAST_COMPILE_ENV)
    assert key not in _devices.compiler_options(True, certified=True)
    monkeypatch.setenv(_devices.FAST_COMPILE_ENV, "yes")
    with pytest.raises(ValueError, match=r"DLBFLUID_FAST_COMPILE = 'yes' is invalid: expected 1"):
        _devices.compiler_options(False, certified=True)
    # The command line refuses it before any work, in one line (exit status 2).
    from dlbfluid._cli import main

    assert main(["equilibrium", "default", "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["dlbfluid equilibrium: error: DLBFLUID_FAST_COMPILE = 'yes' is invalid: "
                   "expected 1 (on) or 0 (off)"]  # fmt: skip
