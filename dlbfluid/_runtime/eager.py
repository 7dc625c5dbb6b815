"""Host-side `jax.numpy` work compiled as one program per argument shape, with the numbers
of operation-by-operation execution (`eager_jit`).

Evaluated eagerly, every distinct `jnp` operation and shape compiles a program of its own
(some 20-30 ms each with its tracing and lowering): a softplus latency is about twenty of
them per new shape. One `jax.jit` program per shape costs one compilation, but XLA's CPU
fusion lets LLVM contract `a * b + c` into a fused multiply-add, which rounds once instead
of twice, so that numbers users see (a generated buffer, a CLI's latency) would move by an
ulp. With the `fusion` pass disabled, every operation stays a kernel of its own, rounded
as it is eagerly: the program's results are those of the eager evaluation, bit for bit
(`tests/test_eager.py` checks it on the softplus law, and that a plain `jax.jit` differs).

The algebraic simplifier still runs, and a few of its rewrites across operations change
rounding (`a / (1 / b)` becomes `a * b`); `eager_jit` is for code free of them, checked
bitwise against its eager evaluation where it is applied.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from .devices import accepted_options

EAGER_OPTIONS = (("xla_disable_hlo_passes", "fusion"),)
"""XLA options of `eager_jit`: no operator fusion (each operation rounds on its own)."""


def traced(tree) -> bool:
    """Whether the call is inside a transformation: any leaf of `tree` is a JAX tracer, or
    JAX is tracing at all (a caller's `jit` whose function closes over concrete arrays
    and passes them here: its arguments are not tracers, yet a compiled program with
    options cannot be nested in the caller's). JAX has no public test for the second;
    `jax._src.core.trace_state_clean` is used where this JAX has it."""
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(tree)):
        return True
    clean = getattr(getattr(getattr(jax, "_src", None), "core", None), "trace_state_clean", None)
    return clean is not None and not clean()


def eager_jit(fn, **jit_kwargs):
    """`fn` as one compiled program per argument shape whose results equal `fn`'s eager
    evaluation bit for bit (`EAGER_OPTIONS`); called inside `jit`, `vmap` or `grad`
    (`traced`: with tracers, or with concrete arrays a traced function closes over), it runs
    `fn` itself, so that the caller's program is unchanged. Arguments are
    pytrees of arrays and Python numbers (numbers are traced, not static). Built on the
    first call, so that importing a module that uses it does not start the backend; where
    this XLA build rejects the options, a plain `jax.jit` (results within rounding).
    `jit_kwargs` go to `jax.jit` (e.g. `static_argnums`)."""

    @functools.cache
    def build():
        return jax.jit(fn, compiler_options=accepted_options(EAGER_OPTIONS), **jit_kwargs)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if traced((args, kwargs)):
            return fn(*args, **kwargs)
        return build()(*args, **kwargs)

    return call


def to_device(x) -> jax.Array:
    """A host array as a JAX array without compiling anything: `jnp.asarray` of a numpy
    array compiles a copy program per new shape and dtype, `jax.device_put` needs none.
    Same values, dtype (canonicalised as `jnp.asarray` does), placement (the default
    device, uncommitted) and weak type (none: for numpy arrays only; a Python number would
    lose `jnp.asarray`'s weak type). On CPU `device_put` may share a suitably aligned
    numpy buffer instead of copying it (even with `may_alias=False`, in jax 0.10), so it is
    handed a private copy: a later write to `x` never reaches the result."""
    return jax.device_put(np.array(x, copy=True))
