"""`SimulateOptions`: the tunables of `simulate`'s execution, as fields with their measured
defaults, and the choices made from them (chunk, layout, save bucket).

None of them changes a number `simulate` returns beyond rounding: they choose how the
batch runs (chunks that stay in cache, where the batch axis lies, how many save slots the
compiled program has) and how strict the conservation check is.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from .._integrators import AbstractIntegrator, Fast
from .._validate import integer, invalid

__all__ = ["LAYOUTS", "SimulateOptions", "default_chunk", "default_layout"]

LAYOUTS = ("batch-first", "batch-last")
"""The values of `simulate(layout=...)`."""


class SimulateOptions(eqx.Module):
    """Tunables of `simulate`, with their measured defaults (`simulate(options=...)`).

    **Fields:**
    - `cpu_chunk` (32): scenarios per chunk on a CPU from `cpu_chunk_min_cells` (4) cells
      up (`default_chunk`).
    - `cpu_chunk_min_cells` (4): below it a CPU runs a device's share whole.
    - `batch_last_chunk` (128): scenarios per chunk on a CPU with the batch axis last, and
      the smallest device share `default_layout` puts last: the batch axis is the vector
      axis there, and longer vectors pay until about this length (App.-B, 10 cells,
      float32, two devices, 1,000 scenarios: 3.16, 2.71, 2.99 us per scenario-tick at 32,
      128, 256).
    - `batch_last_max_cells` (16): the most cells for which `default_layout` puts a
      float32 batch's axis last.
    - `batch_last_min_ticks_per_save` (4): the fewest ticks per save interval for which
      `default_layout` puts the batch axis last.
    - `mass_balance_ulps` (64): a run's conservation residual may reach this many machine
      epsilons per tick, relative to the requests it counts, before its status becomes
      `mass_balance` (`verb._mass_balance_status`).
    - `bucket_saves` (True): compile for `save_bucket(n_save)` save intervals (the extra
      ones repeat the last save and are sliced off), so that nearby `n_save` share one
      program, as the equilibrium solver buckets cells and batch sizes.
    """

    cpu_chunk: int = 32
    cpu_chunk_min_cells: int = 4
    batch_last_chunk: int = 128
    batch_last_max_cells: int = 16
    batch_last_min_ticks_per_save: int = 4
    mass_balance_ulps: float = 64.0
    bucket_saves: bool = True

    def __check_init__(self):
        for name in ("cpu_chunk", "cpu_chunk_min_cells", "batch_last_chunk"):
            integer(name, getattr(self, name), 1)
        if not self.mass_balance_ulps > 0:
            raise invalid("mass_balance_ulps", self.mass_balance_ulps, "expected > 0")

    def save_bucket(self, n_save: int) -> int:
        """The save intervals the compiled program has for `n_save`: the next power of two
        up to 64, then the next multiple of 64 (a save costs about a tick, so at most 64
        extra records, and fewer than `n_save` of them); `n_save` itself when
        `bucket_saves` is off."""
        if not self.bucket_saves:
            return n_save
        if n_save <= 64:
            return 1 << max(n_save - 1, 0).bit_length()
        return -(-n_save // 64) * 64


DEFAULTS = SimulateOptions()


def default_layout(
    dtype,
    n_cells: int,
    share: int,
    integrator: AbstractIntegrator,
    ticks_per_save: int,
    options: SimulateOptions = DEFAULTS,
) -> str:
    """The layout of `simulate(layout=None)`: `"batch-last"` for a float32 batch on a CPU
    with the `Fast` integrator, at most `batch_last_max_cells` (16) cells, a device share
    of at least `batch_last_chunk` (128) scenarios and at least
    `batch_last_min_ticks_per_save` (4) ticks per save interval; `"batch-first"` otherwise.

    Measured on App.-B batches of 1,000, 5 ms, flow-grad, two CPU devices, microseconds per
    scenario-tick batch-first against batch-last: float32 0.28 / 0.23 at 2 cells, 0.80 /
    0.49 at 5, 2.23 / 1.65 at 10, 7.86 / 4.76 at 16, 11.5 / 12.7 at 20; float64 0.30 /
    0.25, 0.85 / 0.75, 3.05 / 3.08, 6.68 / 10.6, 14.7 / 25.3 (theory/discretisation.md,
    *Batch axis last*; benchmarks/README.md, *Recorded: `bench_layout.py`*). So float64
    stays batch-first, where it is never much slower; a smaller share leaves too few
    scenarios for the vector lanes; `Accurate` and accelerators are not measured
    batch-last. A save costs more batch-last: 10 cells, 1,000 scenarios, 400
    ticks, float32 batch-first against batch-last, 2.34 / 1.64 us per scenario-tick with 4
    saves, 2.60 / 1.85 with 20, 3.06 / 2.65 with 100 (4 ticks per save), 5.26 / 6.44 with
    400 (a save every tick)."""
    if (
        ticks_per_save >= options.batch_last_min_ticks_per_save
        and jax.default_backend() == "cpu"
        and jnp.dtype(dtype) == jnp.dtype(jnp.float32)
        and n_cells <= options.batch_last_max_cells
        and share >= options.batch_last_chunk
        and isinstance(integrator, Fast)
    ):
        return "batch-last"
    return "batch-first"


def default_chunk(n_cells: int, options: SimulateOptions = DEFAULTS) -> int | None:
    """The scenarios a device advances together by default (`simulate(chunk=None)`).

    On a CPU, `cpu_chunk` (32) from `cpu_chunk_min_cells` (4) cells up, so that a tick's
    intermediates (a few hundred `(n, n)` and `(n,)` arrays per scenario) stay in the
    core's cache; below, the whole share (a 2-cell tick is small enough, and the chunks'
    loop would cost more than it saves). Measured on App.-B batches of 1,000 at 5 ms
    ticks, flow-grad, float64, microseconds per scenario-tick against the whole batch:
    2 cells 2.1 (chunks of 32), 1.7 (128), 1.5 (whole); 5 cells 6.3 (32), 7.6 (128), 8.1;
    10 cells 17.4 (16), 18.0 (32), 22.5 (64), 37.1; 20 cells 87.3 (16), 87.5 (32), 105
    (128), 151 (benchmarks/bench_simulate.py `--appb --chunks`). Elsewhere `None`: an
    accelerator wants the whole share in each operation."""
    if jax.default_backend() != "cpu" or n_cells < options.cpu_chunk_min_cells:
        return None
    return options.cpu_chunk


def _chosen_chunk(
    chunk: int | None,
    n_cells: int,
    share: int,
    layout: str = "batch-first",
    options: SimulateOptions = DEFAULTS,
) -> int | None:
    """`chunk` as given, else `default_chunk` for a device share of at least four such
    chunks (a smaller batch runs whole: the chunks' loop costs compile time, about 1.5 s
    at 10 cells, for a gain that only a large batch repays); with the batch axis last,
    `batch_last_chunk` on a CPU."""
    if chunk is not None:
        return chunk
    if layout == "batch-last":
        return options.batch_last_chunk if jax.default_backend() == "cpu" else None
    size = default_chunk(n_cells, options)
    return size if size is not None and share >= 4 * size else None
