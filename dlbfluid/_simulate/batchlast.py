"""`vmap_last`: a function of one scenario applied to a batch whose axis is the *last* one
of every batched array (theory/discretisation.md, *Batch axis last*).

`jax.vmap` puts the batch axis first: a 10-cell scenario's `(n, n)` arrays become
`(B, n, n)`, whose innermost axis has ten elements, too few for the CPU's vector lanes
(eight float64 or sixteen float32 under AVX-512, with a scalar tail). With the batch last,
`(n, n, B)`, every elementwise loop runs over the scenarios of a chunk, which fill the
lanes whatever the number of cells, and float32 fills twice as many as float64.

`vmap_last` traces the one-scenario function to a jaxpr and evaluates it equation by
equation on the batch-last arrays. An axis of the scenario keeps its position (the batch
axis is appended), so most primitives keep their parameters, with the trailing axis added
where a shape is named (`broadcast_in_dim`, `reshape`, `slice`, ...). A gather of single
elements (`x[i, j]` with index arrays: the routing and observation rings) reads the flat
array at `index * B + b`, with no transposition. Any other primitive is batched by
`jax.vmap` with `in_axes=-1`, `out_axes=-1`: always correct, at the price of the
transpositions `vmap` may add. Every operation is the one `jax.vmap` would do; a result
can still differ from `jax.vmap`'s in the last bit or two, where XLA vectorises a
transcendental or contracts a multiply-add in one layout and not the other.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

_ELEMENTWISE = frozenset(
    """abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type
    copy copy_p cos cosh div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow
    is_finite le lgamma digamma log log1p logistic lt max min mul ne neg nextafter not or pow
    real reduce_precision rem round rsqrt select_n shift_left shift_right_arithmetic
    shift_right_logical sign sin sinh sqrt square sub tan tanh xor population_count
    """.split()
)
_REDUCE = frozenset(
    "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin".split()
)
_CUMULATIVE = frozenset("cumsum cumprod cummax cummin cumlogsumexp".split())
_CALLS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}


def _as_list(prim, res) -> list:
    """The outputs of `prim.bind` as a list, whether it has one result or several."""
    return list(res) if prim.multiple_results else [res]


FALLBACKS: dict[str, int] = {}
"""How often each primitive was batched by `jax.vmap` (the fallback) since import."""


def _full(x, batched: bool, shape: tuple, B: int):
    """`x` (one scenario's value, broadcastable to `shape` as lax allows: a scalar or axes of
    size 1) as a batch-last `shape + (B,)`."""
    x = jnp.asarray(x)
    per = x.shape[:-1] if batched else x.shape
    if batched and per == shape:
        return x
    dims = tuple(range(len(shape) - len(per), len(shape)))
    return lax.broadcast_in_dim(x, shape + (B,), dims + ((len(shape),) if batched else ()))


def _default_fill(dt):
    """The value `lax.gather` fills out-of-bounds reads with when none is given."""
    if jnp.issubdtype(dt, jnp.inexact):
        return jnp.nan
    if jnp.issubdtype(dt, jnp.bool_):
        return True
    info = jnp.iinfo(dt)
    return info.min if jnp.issubdtype(dt, jnp.signedinteger) else info.max


def _point_gather(eqn, vals, flags, B):
    """`operand[idx[..., 0], idx[..., 1], ...]` (every operand axis indexed, one element
    each) for a batch-last operand and/or indices: a flat read at `lin * B + b`."""
    (op, idx), (bop, bidx) = vals, flags
    p = eqn.params
    dn = p["dimension_numbers"]
    shape = eqn.invars[0].aval.shape
    idx_shape = eqn.invars[1].aval.shape
    out_shape = eqn.outvars[0].aval.shape
    idx = _full(idx, bidx, idx_shape, B)  # (..., r, B)
    lin = jnp.zeros(out_shape + (B,), idx.dtype)
    strides = np.cumprod((1,) + shape[::-1])[::-1][1:]
    fill = p["mode"] == lax.GatherScatterMode.FILL_OR_DROP
    inside = jnp.ones(out_shape + (B,), bool) if fill else None
    for k, axis in enumerate(dn.start_index_map):
        c = idx[..., k, :]
        if fill:
            inside = inside & (c >= 0) & (c < shape[axis])
        c = jnp.clip(c, 0, shape[axis] - 1)
        lin = lin + c * int(strides[axis])
    if bop:
        b = lax.broadcasted_iota(lin.dtype, lin.shape, lin.ndim - 1)
        out = jnp.take(op.reshape(-1), lin * B + b, mode="clip")
    else:
        out = jnp.take(op.reshape(-1), lin, mode="clip")
    if fill:
        fv = p["fill_value"]
        if fv is None:
            fv = _default_fill(out.dtype)
        out = jnp.where(inside, out, jnp.asarray(fv, out.dtype))
    return out


def _gather(eqn, vals, flags, B):
    """Any other gather: the batch axis becomes one more batch dimension of the indices
    (moved before their index-vector axis), and of the operand if it is batched, so that
    it comes out last."""
    (op, idx), (bop, bidx) = vals, flags
    p = dict(eqn.params)
    dn = p["dimension_numbers"]
    idx_shape = eqn.invars[1].aval.shape
    idx = jnp.moveaxis(_full(idx, bidx, idx_shape, B), -1, -2)  # (..., B, r)
    dn = dn._replace(
        start_indices_batching_dims=tuple(dn.start_indices_batching_dims)
        + ((len(idx_shape) - 1,) if bop else ())
    )
    if bop:
        dn = dn._replace(
            operand_batching_dims=tuple(dn.operand_batching_dims) + (len(eqn.invars[0].aval.shape),)
        )
        p["slice_sizes"] = tuple(p["slice_sizes"]) + (1,)
    p["dimension_numbers"] = dn
    return eqn.primitive.bind(op, idx, **p)


def _is_point_gather(eqn) -> bool:
    p = eqn.params
    dn = p["dimension_numbers"]
    r = len(eqn.invars[0].aval.shape)
    return (
        dn.offset_dims == ()
        and not dn.operand_batching_dims
        and sorted(dn.collapsed_slice_dims) == list(range(r))
        and sorted(dn.start_index_map) == list(range(r))
        and tuple(p["slice_sizes"]) == (1,) * r
        and eqn.invars[1].aval.shape[-1:] == (r,)
    )


def _apply_slicing(prim, params, vals, flags, ins, B):
    """The slicing and joining primitives (`slice`, `dynamic_slice`,
    `dynamic_update_slice`, `concatenate`, `pad`) with a batch-last input, the batch axis
    kept last; `None` for any other primitive, or for batched slice offsets."""
    name = prim.name
    if name == "slice":
        params.update(
            start_indices=tuple(params["start_indices"]) + (0,),
            limit_indices=tuple(params["limit_indices"]) + (B,),
        )
        if params.get("strides") is not None:
            params["strides"] = tuple(params["strides"]) + (1,)
        return [prim.bind(vals[0], **params)], [True]
    if name == "dynamic_slice" and not any(flags[1:]):
        zero = jnp.zeros((), jnp.asarray(vals[1]).dtype) if len(vals) > 1 else jnp.int32(0)
        params["slice_sizes"] = tuple(params["slice_sizes"]) + (B,)
        return [prim.bind(vals[0], *vals[1:], zero, **params)], [True]
    if name == "dynamic_update_slice" and not any(flags[2:]):
        op = _full(vals[0], flags[0], ins[0], B)
        up = _full(vals[1], flags[1], ins[1], B)
        zero = jnp.zeros((), jnp.asarray(vals[2]).dtype) if len(vals) > 2 else jnp.int32(0)
        return [prim.bind(op, up, *vals[2:], zero, **params)], [True]
    if name == "concatenate":
        args = [_full(v, f, s, B) for v, f, s in zip(vals, flags, ins)]
        return [prim.bind(*args, **params)], [True]
    if name == "pad" and not flags[1]:
        params["padding_config"] = tuple(params["padding_config"]) + ((0, 0, 0),)
        return [prim.bind(vals[0], vals[1], **params)], [True]
    return None


def _apply(eqn, vals, flags, B):
    """One equation with at least one batch-last input: `(outputs, batched flags)`."""
    prim, params = eqn.primitive, dict(eqn.params)
    name = prim.name
    ins = [v.aval.shape for v in eqn.invars]
    outs = [v.aval.shape for v in eqn.outvars]
    if name in _CALLS:
        sub = params[_CALLS[name]]
        if isinstance(sub, jcore.ClosedJaxpr):
            return _eval(sub.jaxpr, sub.consts, vals, flags, B)
        return _eval(sub, (), vals, flags, B)
    if name in _ELEMENTWISE:
        shape = outs[0]
        args = [_full(v, f, shape, B) for v, f in zip(vals, flags)]
        return [prim.bind(*args, **params)], [True]
    if name in _REDUCE or name in _CUMULATIVE or name in ("squeeze", "rev", "split"):
        res = _as_list(prim, prim.bind(vals[0], **params))
        return res, [True] * len(res)
    if name == "broadcast_in_dim":
        params.update(
            shape=tuple(params["shape"]) + (B,),
            sharding=None,
            broadcast_dimensions=tuple(params["broadcast_dimensions"]) + (len(params["shape"]),),
        )
        return [prim.bind(vals[0], **params)], [True]
    if name == "reshape" and params.get("dimensions") is None:
        params.update(new_sizes=tuple(params["new_sizes"]) + (B,), sharding=None)
        return [prim.bind(vals[0], **params)], [True]
    if name == "transpose":
        perm = tuple(params["permutation"])
        return [prim.bind(vals[0], permutation=perm + (len(perm),))], [True]
    sliced = _apply_slicing(prim, params, vals, flags, ins, B)
    if sliced is not None:
        return sliced
    if name == "sort":
        args = [_full(v, f, s, B) for v, f, s in zip(vals, flags, ins)]
        res = prim.bind(*args, **params)
        return list(res), [True] * len(res)
    if name == "gather" and _is_point_gather(eqn):
        return [_point_gather(eqn, vals, flags, B)], [True]
    if name == "gather":
        return [_gather(eqn, vals, flags, B)], [True]
    if name == "scatter" and not flags[1]:
        dn = params["dimension_numbers"]
        op = _full(vals[0], flags[0], ins[0], B)
        up = _full(vals[2], flags[2], ins[2], B)
        params["dimension_numbers"] = dn._replace(
            update_window_dims=tuple(dn.update_window_dims) + (len(ins[2]),)
        )
        return [prim.bind(op, vals[1], up, **params)], [True]
    if name == "stack":
        args = [_full(v, f, s, B) for v, f, s in zip(vals, flags, ins)]
        return [prim.bind(*args, **params)], [True]
    if name == "bitcast_convert_type" and outs[0] == ins[0]:
        return [prim.bind(vals[0], **params)], [True]
    # Anything else: jax.vmap over the trailing axis.
    FALLBACKS[name] = FALLBACKS.get(name, 0) + 1
    fn = jax.vmap(
        lambda *a: prim.bind(*a, **params),
        in_axes=[-1 if f else None for f in flags],
        out_axes=-1,
        axis_size=B,
    )
    res = _as_list(prim, fn(*vals))
    return res, [True] * len(res)


def _eval(jaxpr, consts, args, flags, B):
    env: dict = {}

    def read(v):
        if isinstance(v, jcore.Literal):
            return np.asarray(v.val, v.aval.dtype), False
        return env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = (c, False)
    for v, a, f in zip(jaxpr.invars, args, flags):
        env[v] = (a, f)
    for eqn in jaxpr.eqns:
        vals, fl = zip(*(read(v) for v in eqn.invars)) if eqn.invars else ((), ())
        if any(fl):
            outs, oflags = _apply(eqn, list(vals), list(fl), B)
        else:
            outs = _as_list(eqn.primitive, eqn.primitive.bind(*vals, **eqn.params))
            oflags = [False] * len(outs)
        for v, o, f in zip(eqn.outvars, outs, oflags):
            if not isinstance(v, jcore.DropVar):
                env[v] = (o, f)
    got = [read(v) for v in jaxpr.outvars]
    return [g[0] for g in got], [g[1] for g in got]


def vmap_last(fun, in_batched):
    """`fun` (of one scenario) applied to a batch whose axis is the last of every leaf of
    the arguments marked `True` in `in_batched` (one flag per positional argument); every
    output leaf comes back with the batch axis last."""

    def batched(*args):
        leaves, trees = [], []
        for a, b in zip(args, in_batched):
            ls, tree = jax.tree_util.tree_flatten(a)
            leaves.append([(x, b) for x in ls])
            trees.append(tree)
        flat = [x for ls in leaves for x in ls]
        B = next(jnp.shape(x)[-1] for x, b in flat if b)

        def one(*xs):
            it = iter(xs)
            parts = [
                jax.tree_util.tree_unflatten(t, [next(it) for _ in ls])
                for t, ls in zip(trees, leaves)
            ]
            return fun(*parts)

        specs = [
            jax.ShapeDtypeStruct(jnp.shape(x)[:-1] if b else jnp.shape(x), jnp.result_type(x))
            for x, b in flat
        ]
        closed, out_shape = jax.make_jaxpr(one, return_shape=True)(*specs)
        outs, oflags = _eval(
            closed.jaxpr, closed.consts, [x for x, _ in flat], [b for _, b in flat], B
        )
        outs = [o if f else _full(o, False, tuple(jnp.shape(o)), B) for o, f in zip(outs, oflags)]
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

    return batched
