"""Placing a batch on every device of this process, and compiling for it.

In a run across processes (`dlbfluid._distributed`) each process computes its own share
of the scenarios, so a batch is placed on this process's devices only
(`jax.local_devices()`, all devices in a one-process run): no array spans processes.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

# XLA's CPU backend hands some fused dots and reductions to YNNPACK. On the solvers' tiny
# per-scenario (n, n) contractions, batched over thousands of scenarios, the plain XLA
# loops are faster: about 15% off the equilibrium benchmark
# (`benchmarks/bench_equilibrium.py`). The option only concerns CPU compilation.
_SOLVER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


@functools.cache
def compiler_options() -> dict:
    """XLA compiler options for the batched solvers (`jax.jit(..., compiler_options=...)`).

    Returns `{}` where this XLA build does not know an option (older or newer jaxlib), so
    the options can only make a program faster, never stop it from compiling. Evaluated
    on first use (not at import, which would start the backend).
    """
    try:
        jax.jit(lambda x: x + 1, compiler_options=_SOLVER_OPTIONS).lower(1.0).compile()
    except Exception:  # noqa: BLE001 - any rejection means: do without the options
        return {}
    return dict(_SOLVER_OPTIONS)


def solver_jit(fn, *, jit=jax.jit, **jit_kwargs):
    """`jit(fn, compiler_options=compiler_options(), **jit_kwargs)`, built on the first
    call (so that importing the package does not start the backend)."""

    @functools.cache
    def build():
        return jit(fn, compiler_options=compiler_options(), **jit_kwargs)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return build()(*args, **kwargs)

    return call


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
