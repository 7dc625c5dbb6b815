"""Floating-point precision: dlbfluid follows JAX's `jax_enable_x64` setting.

Importing dlbfluid changes no global configuration (as equinox, diffrax and optimistix
leave it to the user). float64 is the default of the verbs that verify (`simulate`'s
`dtype`, whose clock and mass-balance totals are float64 in a float32 run too, the
equilibrium solver, the linearisation behind the critical step sizes, the scenario
generator, and `run_experiment`, which uses them), and JAX has float64 arrays only with
x64 on: such a verb raises `X64Error` while it is off (`require_x64`, `float_dtype`),
rather than computing in float32 unasked. `enable_x64` turns it on; the command line
calls it at start, and tests/conftest.py does for the tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FLOAT_DTYPES = (jnp.dtype(jnp.float64), jnp.dtype(jnp.float32))
"""The floating dtypes a verb with a `dtype` option computes in (float64 first: the default)."""


class X64Error(ValueError):
    """float64 asked for while JAX's `jax_enable_x64` is off."""


def enable_x64() -> None:
    """Enable float64 in JAX for this process: `jax.config.update("jax_enable_x64", True)`.

    Call it once, before building scenarios: arrays made while x64 was off are float32.
    The verbs that compute in float64 need it (`X64Error` otherwise).
    """
    jax.config.update("jax_enable_x64", True)


def require_x64(verb: str) -> None:
    """Raise `X64Error` unless JAX's x64 mode is on: `verb` computes in float64.

    **Raises:** `X64Error`, one line that says how to turn x64 on.
    """
    if not jax.config.read("jax_enable_x64"):
        raise X64Error(
            f"{verb} computes in float64, which needs JAX's x64 mode, and it is off: call "
            'dlbfluid.enable_x64() or jax.config.update("jax_enable_x64", True) first'
        )


def float_dtype(dtype, verb: str) -> jnp.dtype:
    """The dtype of `verb`'s state: `dtype`, float64 when `None`, after `require_x64`.

    float32 needs x64 as well: the clock and the mass-balance totals stay float64 in a
    float32 run (theory/discretisation.md), so float32 is the state's arithmetic only.

    **Raises:** `ValueError` for a dtype other than float64 or float32; `X64Error` while
    x64 is off.
    """
    out = jnp.dtype(jnp.float64 if dtype is None else dtype)
    if out not in FLOAT_DTYPES:
        raise ValueError(f"dtype = {out} is invalid: allowed float64 or float32")
    require_x64(verb)
    return out
