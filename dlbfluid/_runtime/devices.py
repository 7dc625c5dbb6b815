"""Placing a batch on every device of this process, and compiling for it.

In a run across processes (`dlbfluid._runtime.distributed`) each process computes its own share
of the scenarios, so a batch is placed on this process's devices only
(`jax.local_devices()`, all devices in a one-process run): no array spans processes.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

# XLA's CPU backend hands some fused dots and reductions to YNNPACK. On the solvers' tiny
# per-scenario (n, n) contractions, batched over thousands of scenarios, the plain XLA
# loops are faster: about 15% off the equilibrium benchmark
# (`benchmarks/bench_equilibrium.py`). The option only concerns CPU compilation.
_SOLVER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}
# In float64, XLA's earlier CPU fusion emitters (LLVM IR built directly, not through its
# MLIR fusion pipeline) compile the simulator in 0.5-0.7 of the time and run it as fast, to
# within the run-to-run spread (+-15%); N differs from the default emitters' in the last
# bits only (<= 7e-14; `benchmarks/compile_options.py`, results/compile_options_cpu.json).
# Most of the test suite's time is these compilations. In float32 the default emitters
# stay: they vectorise float32 better (measured up to 1.6x faster ticks at 5 cells).
_FLOAT64_OPTIONS = {"xla_cpu_use_fusion_emitters": False}


@functools.cache
def accepted_options(options: tuple) -> dict:
    """`options` if this XLA build compiles a probe with them, else `{}` (an older or newer
    jaxlib that does not know one), so that an option can only make a program faster,
    never stop it from compiling."""
    try:
        jax.jit(lambda x: x + 1, compiler_options=dict(options)).lower(1.0).compile()
    except Exception:  # noqa: BLE001 - any rejection means: do without the options
        return {}
    return dict(options)


FAST_COMPILE_ENV = "DLBFLUID_FAST_COMPILE"
"""The environment variable that turns XLA's backend optimisation off for the equilibrium
solver (`fast_compile`)."""

# XLA's backend optimisation off: the equilibrium solver of 64 generated scenarios compiles
# in 6.4 s instead of 13.6 s and then solves in 0.114 s instead of 0.030 s (2 cores, beside
# another job; docs/cli.md, *Compilation*). It pays where compiling is most of the work: the
# test suite and short interactive runs. Only for the equilibrium solver, whose every
# answer carries its own certificate (a KKT residual checked against `tol`), so that a
# program compiled otherwise cannot pass a worse answer as `success`. The simulator's
# rounding differs at level 0 (an accurate-path run of disc-lat then failed its mass-balance
# check, and a kept program differed from the traced one in the last bits), so it keeps
# XLA's default.
_FAST_COMPILE_OPTIONS = {"xla_backend_optimization_level": 0}


def fast_compile(environ: Mapping[str, str] | None = None) -> bool:
    """Whether `$DLBFLUID_FAST_COMPILE` asks for the batched solvers to compile fast: `1`
    (yes) or `0`, empty or unset (no); any other value is a `ValueError` naming the
    variable, its value and what is allowed."""
    env = os.environ if environ is None else environ
    text = env.get(FAST_COMPILE_ENV, "").strip()
    if text not in ("", "0", "1"):
        raise ValueError(f"{FAST_COMPILE_ENV} = {text!r} is invalid: expected 1 (on) or 0 (off)")
    return text == "1"


def compiler_options(float32: bool = False, certified: bool = False) -> dict:
    """XLA compiler options for the batched solvers (`jax.jit(..., compiler_options=...)`),
    for a program whose floating-point arrays are float64 (default) or include float32;
    for a `certified` program (the equilibrium solver, whose answers carry their own
    certificate) with `$DLBFLUID_FAST_COMPILE=1` (`fast_compile`), XLA's backend
    optimisation off too.

    Each group of options is kept only where this XLA build accepts it. Evaluated on first
    use (not at import, which would start the backend).
    """
    opts = accepted_options(tuple(_SOLVER_OPTIONS.items()))
    if not float32:
        opts = {**opts, **accepted_options(tuple(_FLOAT64_OPTIONS.items()))}
    if certified and fast_compile():
        opts = {**opts, **accepted_options(tuple(_FAST_COMPILE_OPTIONS.items()))}
    return opts


def uses_float32(tree) -> bool:
    """Whether any array leaf of `tree` has a floating dtype narrower than float64 (the
    choice between `compiler_options`' two sets)."""
    return any(
        jnp.issubdtype(d, jnp.floating) and jnp.finfo(d).bits < 64
        for d in (getattr(leaf, "dtype", None) for leaf in jax.tree_util.tree_leaves(tree))
        if d is not None
    )


def solver_jit(fn, *, jit=jax.jit, certified: bool = False, **jit_kwargs):
    """`jit(fn, compiler_options=compiler_options(float32, certified), **jit_kwargs)`, with
    `float32` decided per call from the arguments' dtypes (`uses_float32`) and the fast
    compile read then; each variant is built on its first call (so that importing the
    package does not start the backend)."""

    @functools.cache
    def build(float32: bool, fast: bool):
        return jit(fn, compiler_options=compiler_options(float32, certified), **jit_kwargs)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return build(uses_float32((args, kwargs)), certified and fast_compile())(*args, **kwargs)

    return call


CPU_DEVICES_ENV = "DLBFLUID_CPU_DEVICES"
"""The environment variable that sets how many CPU devices `use_cpu_cores` makes."""


def _cores() -> int:
    try:  # the cores this process may run on (a container's or `taskset`'s share)
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):
        return max(os.cpu_count() or 1, 1)


def cpu_devices_wanted(environ: Mapping[str, str] | None = None) -> int | None:
    """The number of CPU devices `use_cpu_cores` would ask JAX for, from the environment:
    `$DLBFLUID_CPU_DEVICES` (a count >= 1, or `auto`, the default: one per core this
    process may use); `None` where the user already chose (`XLA_FLAGS` with
    `--xla_force_host_platform_device_count`, or `$JAX_NUM_CPU_DEVICES`)."""
    env = os.environ if environ is None else environ
    if "xla_force_host_platform_device_count" in env.get("XLA_FLAGS", ""):
        return None
    if env.get("JAX_NUM_CPU_DEVICES"):
        return None
    text = env.get(CPU_DEVICES_ENV, "auto").strip()
    if text in ("", "auto"):
        return _cores()
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(
            f"{CPU_DEVICES_ENV} = {text!r} is invalid: expected an integer >= 1 or 'auto'"
        )
    return count


def use_cpu_cores(environ: Mapping[str, str] | None = None) -> int | None:
    """Give JAX's CPU backend one device per core (`cpu_devices_wanted`), so that batched
    solvers, which split their batch over this process's devices (`shard_batch`,
    `per_device`), run on every core; returns the count set, or `None` where nothing was
    changed (the user chose, or JAX has already started its backends: the setting is read
    once, at their start).

    A device's program runs on one thread for most of its operations, so that one CPU
    device leaves the other cores nearly idle: on the 2-core machine of
    benchmarks/HISTORY.md (*Every core a device*) two devices run the App.-B simulation 1.7x
    faster and `dlbfluid experiment` 1.6x, with the same results. The `experiment`
    command calls it before any work; call it right after importing JAX (e.g. at the top
    of a notebook) to do the same from Python. Accelerators are not affected. Raises
    `ValueError` for a bad `$DLBFLUID_CPU_DEVICES`.
    """
    count = cpu_devices_wanted(environ)
    if count is None:
        return None
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # JAX refuses the setting once its backends have started
        return None
    return count


def _batch_mesh():
    return jax.sharding.Mesh(np.array(jax.local_devices()), ("batch",))


def shard_batch(tree):
    """Split the leading (batch) axis of every array in `tree` over this process's devices.

    The batch must already be padded to a multiple of `jax.local_device_count()` (a
    multiple of `jax.device_count()` is one); with one device the tree is returned
    unchanged. Jitted code then runs each shard where it lives.
    """
    if jax.local_device_count() == 1:
        return tree
    spec = jax.sharding.NamedSharding(_batch_mesh(), jax.sharding.PartitionSpec("batch"))
    return jax.device_put(tree, spec)


def per_device(fn):
    """`fn` (a function of batched arrays whose every output has the batch axis first) run
    independently on each device's shard of the batch (`jax.shard_map`).

    Under plain sharding, a `while_loop` whose condition depends on the batch (a
    convergence test under `vmap`) needs an all-reduce of that condition across devices at
    every pass, and every device then runs until the slowest scenario of the whole batch
    is done. Mapped per device, each shard runs its own loops, with no communication, to
    its own slowest scenario. With one device `fn` is returned unchanged. Call the result
    inside `jit`, on arguments padded to a multiple of `jax.local_device_count()` (the
    devices of this process, `shard_batch`).
    """
    if jax.local_device_count() == 1:
        return fn
    spec = jax.sharding.PartitionSpec("batch")
    return jax.shard_map(fn, mesh=_batch_mesh(), in_specs=spec, out_specs=spec, check_vma=False)
