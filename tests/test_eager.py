"""`eager_jit` (dlbfluid/_runtime/eager.py): one compiled program per shape whose numbers are
the eager evaluation's, bit for bit, and no change inside a caller's trace."""

import jax
import jax.numpy as jnp
import numpy as np

from dlbfluid._evaluation.server_model import _softplus_latency, buffer_size
from dlbfluid._runtime.eager import eager_jit, to_device
from dlbfluid._service import Softplus


def _softplus_params(rng, n):
    cap = rng.uniform(0.5, 50.0, n)
    L0 = rng.uniform(0.01, 3.0, n)
    p = {
        "capacity": cap,
        "base_latency": L0,
        "knee": rng.uniform(-5.0, 0.9, n) * cap * L0,
        "width": rng.uniform(0.1, 20.0, n),
    }
    return {k: jnp.asarray(v) for k, v in p.items()}


def _bits(a):
    return np.asarray(a).view(np.int64)


def test_eager_jit_is_bitwise_eager_and_plain_jit_is_not():
    rng = np.random.default_rng(0)
    p = _softplus_params(rng, 64)
    N = jnp.asarray(rng.uniform(0.0, 1.0, 64) * 10.0 ** rng.uniform(-6.0, 4.0, 64))
    eager = Softplus().latency(p, N)
    np.testing.assert_array_equal(_bits(_softplus_latency(p, N)), _bits(eager))
    # Negative control: with XLA's fusion, LLVM contracts multiply-adds (one rounding
    # instead of two), so a plain jit of the same law moves some entries by an ulp.
    fused = jax.jit(lambda p, N: Softplus().latency(p, N))(p, N)
    assert np.any(_bits(fused) != _bits(eager))
    np.testing.assert_allclose(np.asarray(fused), np.asarray(eager), rtol=1e-15)


def test_eager_jit_compiles_once_per_shape_and_inlines_under_a_trace():
    calls = []

    def f(a, b, c):
        calls.append(1)
        return a * b + c

    g = eager_jit(f)
    rng = np.random.default_rng(1)
    a, b, c = (jnp.asarray(rng.standard_normal(257)) for _ in range(3))
    np.testing.assert_array_equal(_bits(g(a, b, c)), _bits(a * b + c))
    g(c, a, b)  # same shapes: the program is reused (traced once)
    assert len(calls) == 1
    g(a[:3], b[:3], 2.0)  # a new shape (and a Python number, traced): one more
    assert len(calls) == 2
    # Inside a trace the function is inlined: the caller's program has no inner call,
    # where a plain jit leaves a nested one (negative control).
    inner = jax.make_jaxpr(lambda x: g(x, x, x))(a)
    nested = jax.make_jaxpr(lambda x: jax.jit(f)(x, x, x))(a)
    assert [e.primitive.name for e in inner.eqns] == ["mul", "add"]
    assert "pjit" in {e.primitive.name for e in nested.eqns} or "jit" in {
        e.primitive.name for e in nested.eqns
    }


def test_buffer_size_equals_its_eager_bisection():
    # The generator's buffers bisect on the eager-exact latency: recomputed with the law
    # evaluated operation by operation, every buffer has the same bits.
    rng = np.random.default_rng(2)
    p = {k: np.asarray(v) for k, v in _softplus_params(rng, 12).items()}
    got = buffer_size(p["capacity"], p["base_latency"], p["knee"], p["width"])
    C, L0, N0, s = p["capacity"], p["base_latency"], p["knee"], p["width"]
    a0 = L0 - N0 / C
    lo = np.zeros(12)
    hi = (
        1.01
        * 0.98
        * np.maximum(C * L0 + s * np.log(2.0), (C * a0 + s * np.log(2.0)) / (1.0 - 0.98))
        + 1.0
    )
    law = {k: jnp.asarray(v) for k, v in p.items()}
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        below = mid < 0.98 * C * np.asarray(Softplus().latency(law, jnp.asarray(mid)))
        new_lo, new_hi = np.where(below, mid, lo), np.where(below, hi, mid)
        if np.array_equal(new_lo, lo) and np.array_equal(new_hi, hi):
            break
        lo, hi = new_lo, new_hi
    np.testing.assert_array_equal(_bits(got), _bits(0.5 * (lo + hi)))
    assert np.all(got > 0)


def _compiles(fn):
    """(result of fn(), backend compilations it made)."""
    n = [0]

    def count(event, duration, **kwargs):
        n[0] += event.endswith("backend_compile_duration")

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        out = fn()
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    return out, n[0]


def test_to_device_copies_without_compiling():
    # A shape no other test uses: jnp.asarray compiles a copy program for it (negative
    # control), to_device none, and both give the same array.
    host = np.arange(3 * 29, dtype=np.float64).reshape(3, 29)
    ref, n_ref = _compiles(lambda: jnp.asarray(host))
    got, n_got = _compiles(lambda: to_device(host))
    assert n_ref >= 1 and n_got == 0
    assert got.dtype == ref.dtype and got.weak_type == ref.weak_type == False  # noqa: E712
    assert got.sharding == ref.sharding and got.committed == ref.committed
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    # A copy, never a view of the host buffer (jax.device_put alone shares some aligned
    # buffers on CPU: a third of these sizes in jax 0.10).
    hosts = [np.arange(8.0 + i) for i in range(48)]
    devs = [to_device(h) for h in hosts]
    for h in hosts:
        h[0] = -1.0
    assert [float(np.asarray(d)[0]) for d in devs] == [0.0] * 48


def test_eager_jit_inside_a_callers_jit_with_concrete_arguments():
    """A caller's `jit` whose function closes over concrete arrays passes them to an
    `eager_jit` function: not tracers, yet inside a trace, where a compiled program with
    options cannot be nested (JAX raises). The function is inlined instead, and the result
    is the caller's program's."""
    g = eager_jit(lambda a, b: a * b + 1.0)
    const = jnp.arange(4.0)

    @jax.jit
    def h(x):
        return x + g(const, const)  # g's arguments are concrete here

    np.testing.assert_array_equal(np.asarray(h(jnp.ones(4))), np.asarray(const * const + 2.0))
    assert "pjit" not in str(jax.make_jaxpr(h)(jnp.ones(4)))


def test_floats_as_copies_host_leaves():
    """`floats_as` (the simulator's dtype conversion) puts host leaves already in the run's
    dtype on the device as private copies (`to_device`): a later write to the caller's
    numpy array never reaches them (a bare `jax.device_put` shares some aligned buffers)."""
    from dlbfluid._simulate.single import floats_as

    hosts = [np.arange(8.0 + i) for i in range(48)]
    ints = [np.arange(8 + i, dtype=np.int32) for i in range(48)]
    devs, idevs = floats_as((hosts, ints), np.float64)
    for h, k in zip(hosts, ints):
        h[0], k[0] = -1.0, -1
    assert [float(np.asarray(d)[0]) for d in devs] == [0.0] * 48
    assert [int(np.asarray(d)[0]) for d in idevs] == [0] * 48
