import ctypes
import gc
import os
import shutil
import sys
import tempfile

import jax
import pytest

# Reference comparisons run in float64, and importing dlbfluid leaves JAX's configuration
# alone (tests/test_import_side_effects.py checks both in fresh processes).
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("MPLBACKEND", "Agg")

# One persistent compilation cache per test run, shared by the xdist workers: the same
# catalogue programs are compiled by every worker otherwise. The process that starts the
# run (the xdist controller, or the only process) makes the directory and removes it when
# the run ends (`pytest_unconfigure`); the workers it starts inherit its path. (A
# directory per run, never removed, left 3.2 GB of them in /tmp over 518 runs.) A directory
# named in DLBFLUID_TEST_CACHE before the run is used and kept: programs then carry over
# between runs, which is handy while editing tests but says nothing of a fresh clone's time.
_CACHE_ENV = "DLBFLUID_TEST_CACHE"
_own_cache = _CACHE_ENV not in os.environ
if _own_cache:
    os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="dlbfluid-test-cache-")
_cache = os.environ[_CACHE_ENV]
# Every program goes in, however quickly it compiled: a notebook kernel or command-line
# subprocess compiles hundreds of small ones (one per eager operation and shape, 20-100 ms
# each) that a test process compiled already, and a worker reloads them after
# `jax.clear_caches` below; reading one back takes a few milliseconds.
jax.config.update("jax_compilation_cache_dir", _cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# (and by the notebook kernels and command-line subprocesses the tests start: set, not
# defaulted, since a value inherited from the shell, or from the process that started this
# one, would send their programs to another directory than this process's)
os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
# The command line's own cache settings and kept traced solvers (`dlbfluid._runtime.exported`) stay
# off in the tests' in-process CLI calls, which use the run's cache above and trace as the
# API does; tests/test_cache.py turns them on where it checks them.
os.environ.setdefault("DLBFLUID_CACHE_DIR", "off")
# The equilibrium solver compiles with XLA's backend optimisation off
# (`dlbfluid._runtime.devices.fast_compile`): most of a test is compiling, its runs are
# short, and every equilibrium carries its own certificate. (With the fluid simulator at
# level 0 as well, same day, beside another job, one process: test_equilibrium,
# test_simulate and test_theorem1_bound took 284 s against 329 s, but an accurate-path
# disc-lat run failed its mass-balance check and a kept simulation differed from the
# traced one in the last bits, so the simulator keeps XLA's default.)
os.environ.setdefault("DLBFLUID_FAST_COMPILE", "1")
# One CPU device per test process (the xdist workers share the cores already): an in-process
# `experiment` call would otherwise give a worker that has not started JAX yet a device per
# core for all of its later tests (`dlbfluid.use_cpu_cores`; tests/test_simulate.py runs two
# devices in a subprocess of its own).
os.environ.setdefault("DLBFLUID_CPU_DEVICES", "1")

# pyproject's `--dist loadfile` gives each file to one worker, so that a module's fixtures
# are set up once in the run, not once per worker (clean clone, idle: 397 s -> 375 s, 754 ->
# 729 worker-seconds). xdist hands the files out most tests first (its scope reorder). A
# list here that put the longest files first had no effect under that reorder; with the
# reorder off (`--no-loadscope-reorder`) so that it did, the suite took 396.26 s against
# 394.78 s (clean clone, idle, same day): no gain, so the order is xdist's.


def pytest_unconfigure(config):
    if _own_cache:
        shutil.rmtree(_cache, ignore_errors=True)


# A worker keeps every program it compiles, and over the suite that grew to 6 GB. After a
# module that leaves the worker above this resident size, its in-memory compiled programs
# are dropped (`jax.clear_caches`); a later module that needs one again loads it from the
# run's persistent cache above instead of compiling it. Inside a module the same is done
# after a test that leaves the worker above the second limit (one module grows a worker
# by up to 1 GB: test_equilibrium, 0.48 -> 1.52 GB). The freed memory goes back to the
# system (glibc's `malloc_trim`): without it the resident size stayed where it was
# (100 programs of the 3-cell network: 0.70 GB compiled, 0.63 GB cleared, 0.33 GB
# trimmed), so that once above the limit a worker dropped its programs after every module.
_RESIDENT_LIMIT_MB = 900
_TEST_RESIDENT_LIMIT_MB = 1500
try:
    _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
except (OSError, AttributeError):  # not glibc
    _malloc_trim = None


def _resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _drop_programs_above(limit_mb: float) -> None:
    if os.path.exists("/proc/self/statm") and _resident_mb() > limit_mb:
        jax.clear_caches()
        gc.collect()
        if _malloc_trim is not None:
            _malloc_trim(0)


@pytest.fixture(autouse=True, scope="module")
def _bounded_worker_memory():
    yield
    _drop_programs_above(_RESIDENT_LIMIT_MB)


@pytest.fixture(autouse=True)
def _bounded_test_memory():
    yield
    _drop_programs_above(_TEST_RESIDENT_LIMIT_MB)


@pytest.fixture(scope="session")
def catalogue_equilibrium():
    """`get(name, cost) -> (scenario, equilibrium)` for the catalogue's symmetric pair
    ("pair", tau = 0.5) and 3-cell network ("three") of tests/helpers.py, built for both
    service laws (`helpers.both_laws`: one compiled solver per cost for both) and solved
    once per session (per xdist worker)."""
    from helpers import THREE, both_laws, symmetric_pair

    from dlbfluid import solve_equilibrium

    done: dict = {}

    def get(name: str, cost: str):
        if (name, cost) not in done:
            s = both_laws({"pair": symmetric_pair(0.5), "three": THREE}[name])
            done[name, cost] = (s, solve_equilibrium(s, cost))
        return done[name, cost]

    return get
