"""The benchmarks' scenario batches: the seed paper's App.-B generator as one padded batch
(`appb_batch`), and `fast_stack`, which stacks equal-shaped scenarios with numpy.

`dl.stack_scenarios` pads every scenario first (about 10 ms each), which makes a batch of
10,000 take minutes; padded to a common shape beforehand, stacking the leaves is the same
thing in seconds. Both functions check themselves against `dl.stack_scenarios` on the
first scenarios of the batch and raise `RuntimeError` where they disagree.
"""

from __future__ import annotations

import dataclasses

import _harness  # noqa: F401  (the checkout's dlbfluid first on sys.path)
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import dlbfluid as dl


def fast_stack(scenarios):
    """`dl.stack_scenarios` for scenarios of equal shape, stacking leaves with numpy (the
    service laws present are static: every table gets the batch's set)."""
    scenarios = [s.strip() for s in scenarios]
    if hasattr(scenarios[0].service, "with_laws"):
        laws = tuple(dict.fromkeys(m for s in scenarios for m in s.service.laws))
        est = tuple(dict.fromkeys(m for s in scenarios for m in s.estimate.laws))
        scenarios = [
            dataclasses.replace(
                s, service=s.service.with_laws(laws), estimate=s.estimate.with_laws(est)
            )
            for s in scenarios
        ]
    parts = [eqx.partition(s, eqx.is_array) for s in scenarios]
    dyn = [d for d, _ in parts]
    treedef = jax.tree_util.tree_structure(dyn[0])
    leaves = [jax.tree_util.tree_leaves(d) for d in dyn]
    stacked = [
        jnp.asarray(np.stack([np.asarray(lv[k]) for lv in leaves])) for k in range(len(leaves[0]))
    ]
    return eqx.combine(jax.tree_util.tree_unflatten(treedef, stacked), parts[0][1])


def check_stack(batch, parsed, n_cells: int | None = None, m: int = 8) -> None:
    """Raise `RuntimeError` unless the first `m` scenarios of `batch` equal
    `dl.stack_scenarios(parsed[:m], n_cells=n_cells)` leaf by leaf (dtype, shape, value)."""
    m = min(m, len(parsed))
    want = eqx.filter(dl.stack_scenarios(parsed[:m], n_cells=n_cells), eqx.is_array)
    got = jax.tree_util.tree_map(lambda a: a[:m], eqx.filter(batch, eqx.is_array))
    same = jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want) and all(
        x.dtype == y.dtype and x.shape == y.shape and bool(jnp.all(x == y))
        for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want))
    )
    if not same:
        raise RuntimeError("the fast stack disagrees with dlbfluid.stack_scenarios")


def appb_batch(
    n_cells: int | None,
    B: int,
    *,
    seed: int = 0,
    horizon: float = 600.0,
    pad_cells: int | None = None,
):
    """`B` scenarios of the seed's App.-B generator (`dl.generate`, stream `seed`) with
    `n_cells` cells each (`None`: the generator's own 2-10), arrival profiles over
    `horizon` seconds, as one batch padded to `pad_cells` cells (default: the most cells
    present, as `dl.stack_scenarios` pads) and to common profile lengths."""
    lo, hi = (2, 10) if n_cells is None else (n_cells, n_cells)
    gen = dl.generate(seed, B, min_cells=lo, max_cells=hi)
    parsed = [
        dl.scenario_from_dict(d, allow_overload=True)
        for d in dl.scenario_dicts(gen, horizon=horizon)
    ]
    n = pad_cells or max(s.n_cells for s in parsed)
    P = max(s.arrival_times.shape[-1] for s in parsed)
    Q = max(s.replica_times.shape[-1] for s in parsed)
    laws = tuple(dict.fromkeys(m for s in parsed for m in s.service.laws))
    est = tuple(dict.fromkeys(m for s in parsed for m in s.estimate.laws))
    batch = fast_stack([dl.pad_scenario(s, n, P, Q, laws=laws, est_laws=est) for s in parsed])
    check_stack(batch, parsed, n_cells=n)
    return batch
