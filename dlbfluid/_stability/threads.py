"""Small dense linear algebra on one BLAS thread.

The host stability methods solve eigenvalue problems of a few hundred rows (the
pseudospectral generator, $H(i\\omega)$ of the characteristic loci). Multithreaded OpenBLAS
busy-waits between the small kernels of `dgeev`; on a machine whose cores are shared (a
busy CI runner, or JAX's own thread pool) one `eigvals` of a 120 x 120 matrix was measured
at 1.25 s instead of 17 ms. `one_blas_thread` limits every BLAS loaded in the process
(numpy's and scipy's) to one thread and restores them on exit.
"""

from __future__ import annotations

import functools

from threadpoolctl import threadpool_limits


def one_blas_thread():
    """A context manager: every BLAS of the process on one thread (`threadpoolctl`)."""
    return threadpool_limits(limits=1, user_api="blas")


def on_one_blas_thread(fn):
    """Decorator: run `fn` inside `one_blas_thread()`."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with one_blas_thread():
            return fn(*args, **kwargs)

    return wrapped
