"""scatter_to_dus: rewrite scatters that write one contiguous window into dynamic_update_slice.

``x.at[i].set(row)``, ``x.at[i].add(v)``, ``x.at[i + jnp.arange(k)].set(block)`` and buffer fills
inside ``fori_loop`` all lower to ``scatter``; the expert writes ``lax.dynamic_update_slice``
(DUS), which XLA updates in place when the buffer is donated. Gathers that read one window
(``x[i + jnp.arange(k)]``) become ``dynamic_slice`` (DS) the same way.

Exactness, which decides every choice here:

- Out of bounds. ``FILL_OR_DROP`` (the default) drops a window that is not wholly in bounds;
  ``PROMISE_IN_BOUNDS`` lowers to the same XLA scatter and drops too, and we keep that (the
  guard costs next to nothing); ``CLIP`` clamps the window start, exactly what DUS/DS do, so a
  single clipped window needs no guard. A block ``x.at[i + arange(k)]`` is k one-row windows,
  each dropped or clamped on its own, so a block is rewritten only when its bounds are proven.
- Negative indices are normalized by jnp (``select_n(i < 0, i, i + n)``) before the scatter;
  DUS/DS are emitted with ``allow_negative_indices=False`` so nothing is normalized twice.
- dtype conversion (``int_array.at[0].set(2.7)``) happens outside the scatter, in
  ``convert_element_type`` equations we never touch.
- Combiners: set, add, mul, min, max and ``apply`` become ``DUS(x, f(DS(x), u))``, evaluated
  elementwise with the scatter's own ``update_jaxpr``, for combiners made of correctly rounded
  single ops only (a vectorized ``sin`` may round differently from the scalar one in a scatter).

Bounds: ``_ranges`` proves indices in bounds (loop counters, clamps, ``%``, ``jnp.where``); then
the DUS is bare. Otherwise a guard keeps the scatter's semantics: the cheapest exact one on
XLA:CPU (benchmarks/RESULTS.md has the figures):

- ``lax.cond(in_bounds, DUS, x)`` costs about what a bare DUS costs when it runs once per call
  and the buffer dies at the update, about half the naive scatter. A select over the window,
  ``DUS(x, select(ok, new, DS(x)), s)``, is what XLA's ScatterExpander makes of a single-index
  scatter anyway, so it costs what the scatter costs.
- Inside a scan/while body the cond is the worst choice, slower than the scatter itself,
  because XLA copies the carried buffer into the conditional every iteration. Likewise when the
  buffer is still live after the update (the compiled HLO has one more full copy than the
  scatter's). Both get the window select.
- A block partly out of bounds must write its in-bounds rows. Every exact guard tried costs as
  much as the scatter or more: ``cond(ok, DUS, scatter)`` costs a multiple of the scatter (the
  scatter branch makes XLA copy the buffer in and out), a cond whose other branch rebuilds the
  rows with DUSes likewise, DUS plus a scatter with masked indices about the scatter's cost.
  What does pay (issue 18) is the blend, ``_blend``: one window at the clamped start that
  selects, position by position, the block's rows where the scatter writes them and the values
  already there elsewhere, with no branch; only jnp's negative-index wrap (a block straddling
  row 0) needs more runs, written in a while_loop that runs no iteration otherwise. A block's
  blend beats XLA:CPU's row loop from 512 KiB, a tile's its element loop from 32 KiB
  (``window_blend_min_bytes``); smaller unproven blocks stay scatters, with a finding that says
  how to make them provable.
- Other backends get the window select (an XLA:GPU conditional reads its predicate on the
  host); no GPU figures yet, so that choice is the conservative one.
- Known cost: under an outer ``jax.vmap`` of the optimized function a cond guard is batched into
  a select over the whole buffer.

Findings: one per scatter, applied or not, with the reason; applied gathers get one too.
Decisions are taken before any re-trace, so a program with nothing to rewrite is not re-traced.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, JaxprEqn, Literal, Var
from jax.extend.core import primitives as P
from jax.lax import GatherScatterMode

from autoopt import _jaxpr
from autoopt._finding import Finding
from autoopt._options import Option, parse_bytes
from autoopt.passes._base import Pass, PassContext, PassResult
from autoopt.passes.in_place import _ranges, _rounding

_SCATTERS = (P.scatter_p, P.scatter_add_p, P.scatter_mul_p, P.scatter_min_p, P.scatter_max_p)
_METHOD = {
    P.scatter_p: "set",
    P.scatter_add_p: "add",
    P.scatter_mul_p: "multiply",
    P.scatter_min_p: "min",
    P.scatter_max_p: "max",
}

# The original scatter/gather kept as the out-of-bounds path of a guard runs under this name
# scope, so that running the pass again leaves it alone (idempotence).
_FALLBACK_SCOPE = "autoopt_scatter_fallback"

# Combiner primitives whose results are the same computed one element at a time (as a scatter's
# update computation runs) or vectorized (as DUS(x, f(DS(x), u)) runs): single, correctly
# rounded operations. A multiply feeding an add is excluded: it may be contracted to an FMA in
# one form and not the other.
_EXACT_COMBINER_OPS = frozenset(
    {
        P.add_p,
        P.sub_p,
        P.mul_p,
        P.min_p,
        P.max_p,
        P.neg_p,
        P.abs_p,
        P.select_n_p,
        P.and_p,
        P.or_p,
        P.xor_p,
        P.not_p,
        P.eq_p,
        P.ne_p,
        P.lt_p,
        P.le_p,
        P.gt_p,
        P.ge_p,
        P.copy_p,
        P.convert_element_type_p,
        P.sign_p,
    }
)

_INT32_MAX = int(np.iinfo(np.int32).max)

# A block or tile whose bounds are not proven is blended (``_blend``) only when its window holds
# at least this many bytes (``window_blend_min_bytes="auto"``). Below it XLA:CPU's scatter costs
# no more than the blend's pass over the window plus, where the start may be negative, the
# zero-trip while_loop for the negative-index wrap (a few microseconds whatever the size); from
# there up the blend won in every shape measured (benchmarks/RESULTS.md, "In-place windows"). A
# tile's scatter is a loop over its elements, a block's over its rows: tiles pay off sooner.
BLEND_MIN_BYTES = 512 * 1024
TILE_BLEND_MIN_BYTES = 32 * 1024


def _check_blend_min(value) -> int | None:
    if value is None or value == "auto":
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value == 0:
        return 0
    size = parse_bytes(value, "window_blend_min_bytes")
    assert size is not None
    return size


# Out-of-bounds behaviours handled here. PROMISE_IN_BOUNDS lowers to the same XLA scatter as
# FILL_OR_DROP (it drops) and the same XLA gather as CLIP (it clamps); both are kept exactly.
_MODES = (
    GatherScatterMode.FILL_OR_DROP,
    GatherScatterMode.CLIP,
    GatherScatterMode.PROMISE_IN_BOUNDS,
)


class _Decline(Exception):
    """Raised inside planning with the reason the op is left alone."""


@dataclasses.dataclass(frozen=True)
class _Window:
    """The box of the operand that every point of a scatter/gather together covers.

    ``sizes[d]`` is the box's extent on operand dim ``d``; ``dims[c]`` the operand dim that index
    component ``c`` addresses. ``blocks`` holds ``(point axis, component)`` for each axis along
    which the points are consecutive on one dim (``i + arange(k)``: one; a 2-D tile
    ``x.at[i + arange(k)[:, None], j + arange(m)]``: two), none for a single point.
    ``proven[c]``: range analysis shows component ``c`` in bounds at every point; ``wrapped[b]``:
    block ``b``'s component went through negative-index normalization (row by row), so its rows
    are contiguous only when checked at run time.
    """

    sizes: tuple[int, ...]
    dims: tuple[int, ...]
    n_points: int
    blocks: tuple[tuple[int, int], ...]
    proven: tuple[bool, ...]
    wrapped: tuple[bool, ...]
    exact: tuple[int | None, ...]  # a component known to be one constant (its first value)
    batch: tuple[int, ...] = ()  # the index array's point axes

    @property
    def block(self) -> tuple[int, int] | None:
        """The one block of a 1-D window, None for a single point or a tile: the forms that
        take one block only (a guarded gather) check this."""
        return self.blocks[0] if len(self.blocks) == 1 else None

    @property
    def all_proven(self) -> bool:
        return all(self.proven) and not any(self.wrapped)


def _plan(
    facts: _ranges.Facts,
    indices,
    operand_shape: Sequence[int],
    point_sizes: Sequence[int],
    dims: Sequence[int],
) -> _Window:
    """The one window the points of ``indices`` cover, or ``_Decline`` with the reason."""
    if any(n > _INT32_MAX for n in operand_shape):
        raise _Decline("the operand has an axis longer than 2**31 - 1")
    batch = tuple(indices.aval.shape[:-1])
    if any(n == 0 for n in point_sizes) or any(n == 0 for n in batch):
        raise _Decline("the update is empty")
    comps = facts.components(indices) if dims else []
    if comps is None or len(comps) != len(dims):
        raise _Decline("the structure of the index array is unknown")
    sizes = list(point_sizes)
    varying = [a for a, n in enumerate(batch) if n > 1]
    blocks: list[tuple[int, int]] = []
    for a in varying:
        k = batch[a]
        strides = [c.form.strides[a] if c.form is not None else None for c in comps]
        if None in strides:
            raise _Decline(
                f"the {k} indices are not provably contiguous (only `i + "
                "jnp.arange(k)`-shaped index arrays are; lax.dynamic_update_slice "
                "states it directly)"
            )
        moving = [c for c, s in enumerate(strides) if s != 0]
        if not moving:
            raise _Decline(
                f"all {k} indices are equal: the same window is written {k} times "
                "(duplicate indices)"
            )
        if len(moving) > 1 or strides[moving[0]] != 1:
            what = "descending" if strides[moving[0]] == -1 and len(moving) == 1 else "strided"
            raise _Decline(f"the indices are {what}, not one contiguous ascending window")
        c = moving[0]
        d = dims[c]
        if any(c == b for _, b in blocks):
            raise _Decline("one index component moves along two axes: the points are not a box")
        if sizes[d] != 1:
            raise _Decline("the windows of consecutive indices overlap")
        if k > operand_shape[d]:
            raise _Decline(
                f"the block of {k} is longer than the axis of {operand_shape[d]} "
                "it writes, so it is never wholly in bounds"
            )
        info = np.iinfo(indices.aval.dtype)
        if info.max < operand_shape[d]:
            raise _Decline(f"its {indices.aval.dtype} indices can wrap around inside the block")
        form = comps[c].form
        if form is not None and form.wrapped:
            n = operand_shape[d]
            if form.wrap_n != n:
                raise _Decline(
                    f"its indices were normalized by adding {form.wrap_n} to the negative "
                    f"ones, not the axis length {n}: not jnp's wrap, which the blend follows"
                )
            if form.may_overflow and n + int(info.min) + k - 2 >= 0:
                # Rows past the dtype's maximum overflow to its minimum; normalized (+ n) the
                # first of them land in bounds, which no window of the block covers.
                raise _Decline(
                    f"its {indices.aval.dtype} indices may overflow inside the block onto rows "
                    "in bounds once normalized"
                )
        sizes[d] = k
        blocks.append((a, c))
    block_comps = {c for _, c in blocks}
    proven = []
    for c, comp in enumerate(comps):
        d = dims[c]
        r = comp.range
        if c in block_comps:
            ok = (
                r is not None
                and comp.form is not None
                and not comp.form.wrapped
                and r.within(0, operand_shape[d] - 1)
            )
        else:
            ok = r is not None and r.within(0, operand_shape[d] - point_sizes[d])
        proven.append(ok)
    # A block component has a form (its strides made it a block).
    wrapped = tuple(bool(getattr(comps[c].form, "wrapped", False)) for _, c in blocks)
    n_points = int(np.prod(batch, dtype=np.int64)) if batch else 1
    exact = tuple(
        c.range.exact if c.range is not None and i not in block_comps else None
        for i, c in enumerate(comps)
    )
    return _Window(
        tuple(sizes), tuple(dims), n_points, tuple(blocks), tuple(proven), wrapped, exact, batch
    )


# --- emitting --------------------------------------------------------------------------------


def _scalar_at(idx, point: Sequence[int], c: int):
    """Component ``c`` of the index vector at ``point``, sliced from the index array as it is
    (flattening it first would make XLA build the whole array, a tile's indices, to read one
    value: slicing lets it fold the slice into the broadcasts that built it)."""
    start = (*point, c)
    return lax.reshape(lax.slice(idx, start, tuple(p + 1 for p in start)), ())


def _first_values(idx, w: _Window):
    """The index components of the window's first point, and for each block component
    ``{component: its value at the block's last point}`` (the other point axes at 0)."""
    k = len(w.dims)
    if all(e is not None for e in w.exact) and not w.blocks:
        return [np.asarray(e, idx.dtype) for e in w.exact], {}
    if w.n_points == 1 and k == 1:
        return [lax.reshape(idx, ())], {}
    origin = (0,) * len(w.batch)
    first = [
        _scalar_at(idx, origin, c) if w.exact[c] is None else np.asarray(w.exact[c], idx.dtype)
        for c in range(k)
    ]
    last = {}
    for a, c in w.blocks:
        end: list[int] = list(origin)
        end[a] = w.batch[a] - 1
        last[c] = _scalar_at(idx, end, c)
    return first, last


def _fill_index_dtype(shape) -> np.dtype:
    """The index dtype jax's FILL_OR_DROP gather lowering converts indices to (its
    ``int_dtype_for_shape(shape, signed=True)``): int32 unless a dimension exceeds it."""
    big = any(int(d) > np.iinfo(np.int32).max for d in shape)
    return np.dtype(jax.dtypes.canonicalize_dtype(np.int64 if big else np.int32))


def _in_bounds(first, last, w: _Window, shape, skip_blocks: bool = False):
    """Traced bool: every point's window is in bounds (and each block contiguous).
    ``skip_blocks``: the components other than the blocks' only (``_blend`` checks the blocks'
    rows itself)."""
    dtype = np.dtype(first[0].dtype) if first else np.dtype(np.int32)
    info = np.iinfo(dtype)
    wrapped = {c for (_, c), wr in zip(w.blocks, w.wrapped) if wr}
    block_comps = {c for _, c in w.blocks}
    conds = []
    for c, v in enumerate(first):
        if skip_blocks and c in block_comps:
            continue
        if w.proven[c] and c not in wrapped:
            continue
        d = w.dims[c]
        hi = shape[d] - w.sizes[d]
        if info.min < 0:
            conds.append(lax.ge(v, np.zeros((), dtype)))
        if hi < info.max:
            conds.append(lax.le(v, np.asarray(hi, dtype)))
    for a, c in w.blocks:
        if c in wrapped and not skip_blocks:
            span = np.asarray(w.batch[a] - 1, dtype)
            conds.append(lax.eq(last[c], lax.add(first[c], span)))
    if not conds:  # every check is vacuous for this index dtype
        return np.asarray(True)
    out = conds[0]
    for x in conds[1:]:
        out = lax.bitwise_and(out, x)
    return out


def _starts(first, w: _Window, rank: int, clip_to=None):
    """int32 start indices of the window, one per operand dim.

    ``clip_to`` (the operand shape) clamps each start to ``[0, n - size]`` in the index dtype
    first, as ``CLIP`` does; otherwise values are in bounds whenever they are used, or DUS/DS
    clamp them the same way on both sides of a window select.
    """
    starts: list[Any] = [np.zeros((), np.int32)] * rank
    for c, v in enumerate(first):
        d = w.dims[c]
        if clip_to is not None:
            dtype = np.dtype(v.dtype)
            hi = min(clip_to[d] - w.sizes[d], int(np.iinfo(dtype).max))
            v = lax.clamp(np.zeros((), dtype), v, np.asarray(hi, dtype))
        starts[d] = lax.convert_element_type(v, np.int32)
    return starts


def _rearrange(a, dest: Sequence[int | None], out_shape: Sequence[int]):
    """Move axis ``i`` of ``a`` to position ``dest[i]`` of ``out_shape``; None drops a size-1
    axis; output positions nobody fills get a size-1 axis."""
    moved = [t for t, n in zip(dest, a.shape) if t is not None and n != 1]
    if moved == sorted(moved):  # only size-1 axes move: one reshape
        if tuple(a.shape) != tuple(out_shape):
            a = lax.reshape(a, tuple(out_shape))
        return a
    drop = tuple(i for i, t in enumerate(dest) if t is None)
    if drop:
        a = lax.squeeze(a, drop)
    targets = [t for t in dest if t is not None]
    missing = [p for p in range(len(out_shape)) if p not in targets]
    if missing:
        a = lax.reshape(a, tuple(a.shape) + (1,) * len(missing))
    targets += missing
    perm = tuple(targets.index(p) for p in range(len(out_shape)))
    if perm != tuple(range(len(perm))):
        a = lax.transpose(a, perm)
    assert tuple(a.shape) == tuple(out_shape), (a.shape, out_shape)
    return a


def _combiner(eqn: JaxprEqn):
    """``f(current, update)`` elementwise, or None for a plain set; _Decline when inexact."""
    jaxpr = eqn.params.get("update_jaxpr")
    if jaxpr is None:
        if eqn.primitive is P.scatter_p:
            return None
        raise _Decline("the scatter has no update computation")
    consts = eqn.params.get("update_consts", ())
    fed_by_mul = set()
    for e in jaxpr.eqns:
        if e.primitive not in _EXACT_COMBINER_OPS:
            raise _Decline(
                f"its update computation uses `{e.primitive.name}`, which may round "
                "differently vectorized than in the scatter's scalar loop"
            )
        if e.primitive in (P.add_p, P.sub_p) and any(
            isinstance(v, Var) and v in fed_by_mul for v in e.invars
        ):
            raise _Decline(
                "its update computation multiplies then adds, which one form may "
                "contract to a fused multiply-add and the other not"
            )
        if e.primitive is P.mul_p and any(
            np.issubdtype(v.aval.dtype, np.complexfloating) for v in e.invars
        ):
            raise _Decline(
                "it multiplies complex numbers: four products and two sums, which one form "
                "may contract to fused multiply-adds and the other not"
            )
        if e.primitive is P.mul_p:
            fed_by_mul.update(e.outvars)

    def combine(cur, upd):
        def one(a, b):
            # Bound here rather than by eval_jaxpr, which would give each op the update
            # computation's own (empty) source location: the rewrite's ops all point at the
            # user's `.at[...]` line in explain's program diff.
            env: dict = dict(zip(jaxpr.constvars, consts))
            env.update(zip(jaxpr.invars, (a, b)))

            def read(v):
                return v.val if isinstance(v, Literal) else env[v]

            for e in jaxpr.eqns:
                outs = e.primitive.bind(*map(read, e.invars), **e.params)
                env.update(zip(e.outvars, outs if e.primitive.multiple_results else [outs]))
            return read(jaxpr.outvars[0])

        flat = jax.vmap(one)(lax.reshape(cur, (cur.size,)), lax.reshape(upd, (upd.size,)))
        return lax.reshape(flat, cur.shape)

    return combine


def opaque_window(combine):
    """``combine`` reading the window's current values through a barrier, for a write of more
    than one point. XLA:CPU expands a scatter into a loop over its points; one point's loop
    runs once and is inlined, and then, where XLA knows the operand's values (zeros, a
    reshape of them, a closed-over NumPy array, padding), it folds ``0 + u`` to ``u`` in the
    scatter as it does in ``DUS(x, DS(x) + u)``: a -0.0 update stays -0.0 either way. Over
    several points the loop stays and nothing is folded (0 + -0.0 is +0.0), so the rewrite's
    window must not be folded either: the transpose of a gather (``zeros.at[i +
    arange(k)].add(g)``) is this case. (No cost measured: XLA still fuses the read into the
    write, benchmarks/RESULTS.md.)"""
    if combine is None:
        return None

    def opaque(cur, upd):
        return combine(lax.optimization_barrier(cur), upd)

    return opaque


def _fallback(eqn: JaxprEqn, invals):
    with jax.named_scope(_FALLBACK_SCOPE):
        return _jaxpr._bind(eqn, invals)[0]


def _is_fallback(eqn: JaxprEqn) -> bool:
    return _FALLBACK_SCOPE in str(eqn.source_info.name_stack)


# --- the rules -------------------------------------------------------------------------------


def _describe_scatter(eqn: JaxprEqn) -> str:
    x = _jaxpr.shaped(eqn.invars[0])
    method = _METHOD[eqn.primitive]
    if eqn.primitive is P.scatter_p and eqn.params.get("update_jaxpr") is not None:
        method = "apply"
    return f"`.at[...].{method}` on {x.str_short()}"


def _scatter_plan(facts, eqn: JaxprEqn) -> tuple[_Window, Any]:
    x, idx, upd = (_jaxpr.shaped(v) for v in eqn.invars)
    dn = eqn.params["dimension_numbers"]
    if dn.operand_batching_dims:
        raise _Decline(
            "it is a batched scatter (vmap over the index): each batch element "
            "writes its own window"
        )
    if x.dtype != upd.dtype:
        raise _Decline("the update's dtype differs from the operand's")
    inserted = {int(d) for d in dn.inserted_window_dims}
    window_dims = [d for d in range(x.ndim) if d not in inserted]
    sizes = [1] * x.ndim
    for d, ud in zip(window_dims, dn.update_window_dims):
        sizes[d] = int(upd.shape[int(ud)])
    dims = tuple(int(d) for d in dn.scatter_dims_to_operand_dims)
    combine = _combiner(eqn)
    return _plan(facts, eqn.invars[1], x.shape, sizes, dims), combine


def _update_block(eqn: JaxprEqn, w: _Window, upd):
    """The scatter's updates arranged as the DUS update (operand dim order, box sizes)."""
    x = _jaxpr.shaped(eqn.invars[0])
    dn = eqn.params["dimension_numbers"]
    win = [int(a) for a in dn.update_window_dims]
    inserted = {int(d) for d in dn.inserted_window_dims}
    window_dims = [d for d in range(x.ndim) if d not in inserted]
    scatter_axes = [a for a in range(np.ndim(upd)) if a not in win]
    dest: list[int | None] = [None] * np.ndim(upd)
    for a, d in zip(win, window_dims):
        dest[a] = d
    for p, c in w.blocks:
        d = w.dims[c]
        if d in window_dims:  # a size-1 window axis on the block's dim gives way to the block
            dest[win[window_dims.index(d)]] = None
        dest[scatter_axes[p]] = d
    if upd.dtype != x.dtype:  # a scalar literal update
        upd = lax.convert_element_type(upd, x.dtype)
    return _rearrange(upd, dest, w.sizes)


def _consuming_scatters(closed) -> set:
    """Results of scatters whose operand dies there: not used later, not returned, and not
    coming from outside a nested body (whose caller may still hold it).

    Only these may take a ``lax.cond`` guard: when the operand is still live, XLA copies it into
    the conditional on top of the copy the scatter needed anyway (one full extra copy, seen in
    the compiled HLO on XLA:CPU), where the window select adds nothing.
    """
    out: set = set()

    def visit(jaxpr, top: bool) -> None:
        last: dict = {}
        for t, eqn in enumerate(jaxpr.eqns):
            for v in eqn.invars:
                if isinstance(v, Var):
                    last[v] = t
        live_out = {v for v in jaxpr.outvars if isinstance(v, Var)}
        outside = set() if top else set(jaxpr.invars)
        for t, eqn in enumerate(jaxpr.eqns):
            if eqn.primitive in _SCATTERS:
                x = eqn.invars[0]
                if (
                    isinstance(x, Var)
                    and last.get(x) == t
                    and x not in live_out
                    and x not in outside
                    and x not in jaxpr.constvars
                ):
                    out.add(eqn.outvars[0])
            for _, _, sub in _jaxpr.subjaxprs(eqn):
                visit(sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub, False)

    visit(closed.jaxpr, True)
    return out


@dataclasses.dataclass(frozen=True)
class _Decision:
    """What to emit for one scatter/gather: its window, combiner and guard."""

    window: _Window
    guard: str  # "none" | "clamp" | "select" | "cond"
    combine: Any = None
    # In a loop body the blend's extra runs are unrolled passes: a nested while_loop there
    # makes XLA build the update every iteration and costs its own overhead each time.
    in_loop: bool = False


_WHY = {
    "none": "bounds proven by range analysis",
    "clamp": "CLIP mode: the clamped start is exactly what DUS does",
    "select": "guarded by a select over the window (the drop when out of bounds)",
    "cond": "guarded by lax.cond (out of bounds drops the update, as the scatter does)",
    "blend": "a window at the clamped start blends the block's rows in where the scatter "
    "writes them (rows out of bounds dropped, as the scatter drops them)",
}
# Why a floating-point write is left alone (``_rounding``): with an arithmetic combiner
# (add, multiply, apply), without one (set, min, max).
_ROUNDING_WHY = {
    True: "once rewritten, its combiner would run fused with the floating-point arithmetic that "
    "produces its operand or update, or consumes its result, where XLA's scatter runs apart, "
    "which can change rounding (FMA contraction) from jax.jit's",
    False: "once rewritten, the window it writes would fuse floating-point arithmetic that "
    "produces its operand or update with arithmetic that consumes its result, which XLA's "
    "scatter keeps apart: that can change rounding (FMA contraction) from jax.jit's",
}
_GATHER_WHY = {
    "none": "bounds proven by range analysis",
    "clamp": "the gather clamps its start exactly as dynamic_slice does",
    "select": "a select supplies the fill value out of bounds, as jax's own lowering",
    "cond": "guarded by lax.cond (out of bounds keeps the original gather)",
}


def _combines_arithmetic(eqn: JaxprEqn, plan: _Decision) -> bool:
    """The rewritten write computes with the window's values: a combiner other than a plain
    set, ``.min`` or ``.max`` (which only choose one of two values, as a select does)."""
    if plan.combine is None:
        return False
    return eqn.primitive not in (P.scatter_min_p, P.scatter_max_p)


def x_shape(eqn: JaxprEqn) -> tuple[int, ...]:
    return tuple(_jaxpr.shaped(eqn.invars[0]).shape)


def _decide_scatter(
    facts: _ranges.Facts, consumes: set, backend: str, eqn: JaxprEqn, blend_min: int | None
) -> _Decision:
    """How to rewrite one scatter, or ``_Decline`` with the reason."""
    mode = eqn.params["mode"]
    if mode not in _MODES:
        raise _Decline(f"its mode {mode} is not one this pass knows")
    w, combine = _scatter_plan(facts, eqn)
    if w.all_proven:
        return _Decision(w, "none", combine)
    if mode == GatherScatterMode.CLIP and not w.blocks:
        return _Decision(w, "clamp", combine)
    if w.blocks:
        if mode == GatherScatterMode.CLIP:
            raise _Decline(
                "its bounds are not proven, and in CLIP mode every row of the block is clamped "
                "on its own: rows past an edge all land on the edge row (duplicate indices), "
                "which no single window writes"
            )
        n = max(x_shape(eqn)[w.dims[c]] for _, c in w.blocks)
        if 2 * n > _INT32_MAX:
            raise _Decline(
                f"its bounds are not proven, and its axis of {n} is too long for the blend's "
                "int32 row arithmetic"
            )
        nbytes = int(np.prod(w.sizes, dtype=np.int64)) * _jaxpr.shaped(eqn.invars[0]).dtype.itemsize
        tile = len(w.blocks) > 1
        if blend_min is None:
            blend_min = TILE_BLEND_MIN_BYTES if tile else BLEND_MIN_BYTES
        if nbytes < blend_min:
            starts = "starts" if tile else "start"
            raise _Decline(
                f"its bounds are not proven, and its window of {nbytes:,} bytes is below the "
                f"{blend_min:,} from which the branch-free blend beats XLA's scatter for a "
                f"{'tile' if tile else 'block'} (window_blend_min_bytes; "
                f"benchmarks/RESULTS.md). Clamp the {starts} (`jnp.clip(i, 0, n - k) + "
                f"jnp.arange(k)`) so range analysis proves {'them' if tile else 'it'}, or write "
                "lax.dynamic_update_slice"
            )
        return _Decision(w, "blend", combine)
    once = not facts.in_loop(eqn) and eqn.outvars[0] in consumes
    return _Decision(w, "cond" if (once and backend == "cpu") else "select", combine)


def _decide_gather(facts: _ranges.Facts, eqn: JaxprEqn) -> _Decision | None:
    """How to rewrite one gather, or None: most gathers are lookups, not windows."""
    x = _jaxpr.shaped(eqn.invars[0])
    dn = eqn.params["dimension_numbers"]
    mode = eqn.params["mode"]
    if dn.operand_batching_dims or mode not in _MODES:
        return None
    slice_sizes = tuple(int(n) for n in eqn.params["slice_sizes"])
    dims = tuple(int(d) for d in dn.start_index_map)
    try:
        w = _plan(facts, eqn.invars[1], x.shape, slice_sizes, dims)
    except _Decline:
        return None
    if len(w.blocks) > 1:  # a tile read: not rewritten (the reads here are of rows)
        return None
    fill = mode == GatherScatterMode.FILL_OR_DROP
    if w.all_proven:
        return _Decision(w, "none")
    if w.block is None:
        if fill and eqn.params.get("fill_value") is None:
            return None
        return _Decision(w, "select" if fill else "clamp")
    if facts.in_loop(eqn):
        return None
    return _Decision(w, "cond")


def _emit_scatter(eqn: JaxprEqn, invals, plan: _Decision):
    w, guard, combine = plan.window, plan.guard, plan.combine
    if w.n_points > 1:
        combine = opaque_window(combine)
    x, idx, upd = (jax.numpy.asarray(v) for v in invals)
    shape = tuple(_jaxpr.shaped(eqn.invars[0]).shape)
    first, last = _first_values(idx, w)
    upd = _update_block(eqn, w, upd)

    def write(x, upd, starts):
        new = upd
        if combine is not None:
            new = combine(lax.dynamic_slice(x, starts, w.sizes, allow_negative_indices=False), upd)
        return lax.dynamic_update_slice(x, new, starts, allow_negative_indices=False)

    if guard in ("none", "clamp"):
        return write(x, upd, _starts(first, w, len(shape), shape if guard == "clamp" else None))
    if guard == "blend":
        runs = "unrolled" if plan.in_loop else "while"
        return blend_differentiable(x, upd, first, last, w, shape, combine, runs)
    ok = _in_bounds(first, last, w, shape)
    if guard == "select":
        starts = _starts(first, w, len(shape))
        cur = lax.dynamic_slice(x, starts, w.sizes, allow_negative_indices=False)
        new = upd if combine is None else combine(cur, upd)
        new = lax.select(lax.broadcast(ok, cur.shape), new, cur)
        return lax.dynamic_update_slice(x, new, starts, allow_negative_indices=False)

    def fast(x, upd, *first):
        return write(x, upd, _starts(first, w, len(shape)))

    return lax.cond(ok, fast, lambda x, upd, *first: x, x, upd, *first)


@dataclasses.dataclass(frozen=True, eq=False)
class _BlockAxis:
    """One block of a window being blended: operand dim ``d`` of length ``n``, ``k`` points,
    the int32 start of its first run (its first index, clamped to ``[-k, n]``), and where its
    indices can continue from row 0 after the end (jnp's negative-index wrap, an unsigned
    overflow) the traced bool ``straddles``, true when they do, with the int32 start of that
    second run (``second``, negative: its rows before 0 are not written); both None otherwise."""

    d: int
    n: int
    k: int
    start: Any
    straddles: Any = None
    second: Any = None


def _block_axes(first, last, w: _Window, shape) -> list[_BlockAxis]:
    axes = []
    for (_, c), wrapped in zip(w.blocks, w.wrapped):
        d = w.dims[c]
        n, k = shape[d], w.sizes[d]
        a = first[c]
        dtype = np.dtype(a.dtype)
        info = np.iinfo(dtype)
        # Only the start's position relative to [-k, n] matters: clamped there it fits int32.
        lo = np.asarray(-k if info.min < 0 else 0, dtype)
        start = lax.convert_element_type(lax.clamp(lo, a, np.asarray(n, dtype)), np.int32)
        straddles = None
        if wrapped:
            # The raw rows i + j straddle 0 when the first went through the normalization (a =
            # i + n) and the last did not (last = i + k - 1 >= 0): the run before the wrap ends
            # at row n - 1 and the one after starts at 0. Otherwise one run at ``a``, including
            # a raw ``i + j`` that overflowed the index dtype (its rows from the overflow on
            # are negative even once normalized, and dropped).
            straddles = lax.bitwise_and(
                lax.eq(
                    last[c], lax.sub(lax.add(a, np.asarray(k - 1, dtype)), np.asarray(n, dtype))
                ),
                lax.ge(last[c], np.zeros((), dtype)),
            )
        elif info.min == 0 and k > 1:
            # Unsigned indices overflow to 0: rows ``a, ..., max, 0, 1, ...`` (the ones past
            # ``max`` are out of bounds and dropped, the ones from 0 on are written).
            straddles = lax.lt(last[c], a)
        second = None
        if straddles is not None:
            # The run from row 0 ends at ``last`` (in [0, k - 2] when it exists).
            end = lax.clamp(np.zeros((), dtype), last[c], np.asarray(k, dtype))
            second = lax.sub(lax.convert_element_type(end, np.int32), np.int32(k - 1))
        axes.append(_BlockAxis(d, n, k, start, straddles, second))
    return axes


def _blend(x, upd, first, last, w: _Window, shape, combine, extra_runs: str = "while"):
    """A block or tile ``x.at[i + arange(k)]`` (``x.at[i + arange(k)[:, None], j +
    arange(m)]``, ...) whose bounds are not proven, written exactly: a window of k rows at the
    clamped start ``s = clip(i, 0, n - k)`` (per block axis) blends the values already there
    (``dynamic_slice`` at ``s``) with the update's rows at the positions the scatter writes,
    ``i <= p < i + k`` on every block axis (a ``select``). Rows out of bounds are dropped as the
    scatter drops them: they are not in the window. A combiner (add, min, ...) is applied to the
    window's values, so positions outside the block keep their values exactly. Every other
    index component is one value for all points: out of bounds, nothing is written.

    Negative indices were normalized by jnp row by row (``-1`` is row ``n - 1``): a block whose
    raw rows straddle 0 writes two runs, the one ending at ``n - 1`` and the one starting at 0,
    so a tile with w such axes has up to 2**w runs. The first (each axis's run from its first
    index) is one fused pass that always runs; the others, only ever needed when some axis
    straddles 0, are written by a ``while_loop`` that runs no iteration otherwise
    (``extra_runs="while"``), or unrolled into passes that rewrite the first window unchanged
    when nothing straddles (``"unrolled"``: in loop bodies, and the form derivatives are taken
    of, since a while_loop has no reverse-mode rule). A ``lax.cond`` would make XLA copy the
    buffer.
    """

    def placed(first, last):
        return (
            _block_axes(first, last, w, shape),
            _in_bounds(first, last, w, shape, skip_blocks=True),
            _starts(first, w, len(shape)),
        )

    axes, others, at = placed(first, last)
    x = _blend_pass(x, upd, at, [(ax, ax.start, None) for ax in axes], others, w.sizes, combine)
    count = 2 ** sum(ax.straddles is not None for ax in axes)
    if count == 1:
        return x

    def run(x, r, axes, others, at):
        """The runs numbered ``r`` (bit b: the second run of the b-th wrapped axis); a run
        whose axis does not straddle 0 writes nothing, at the first run's window."""
        runs = []
        b = 0
        for ax in axes:
            if ax.straddles is None:
                runs.append((ax, ax.start, None))
                continue
            second = lax.eq(
                lax.bitwise_and(lax.shift_right_logical(r, np.int32(b)), np.int32(1)), np.int32(1)
            )
            b += 1
            moved = lax.bitwise_and(second, ax.straddles)
            st = lax.select(moved, ax.second, ax.start)
            runs.append((ax, st, lax.bitwise_or(lax.bitwise_not(second), ax.straddles)))
        return _blend_pass(x, upd, at, runs, others, w.sizes, combine, first_run=False)

    if extra_runs == "unrolled":
        for r in range(1, count):
            x = run(x, np.int32(r), axes, others, at)
        return x
    # The loop carries the indices packed in one array (one operation builds it) and computes
    # everything else from them inside, behind a barrier the loop counter passes through:
    # hoisted out of the loop, each scalar would be an operation of its own on every call.
    keys = list(last)

    def unpacked(r, v):
        r, v = lax.optimization_barrier((r, v))
        at = [lax.index_in_dim(v, j, keepdims=False) for j in range(len(first) + len(keys))]
        return r, at[: len(first)], dict(zip(keys, at[len(first) :]))

    def more(c):
        _, first, last = unpacked(c[0], c[2])
        axes = _block_axes(first, last, w, shape)
        straddles = functools.reduce(
            lax.bitwise_or, [ax.straddles for ax in axes if ax.straddles is not None]
        )
        return lax.bitwise_and(lax.lt(c[0], np.int32(count)), straddles)

    def body(c):
        r, first, last = unpacked(c[0], c[2])
        return (lax.add(c[0], np.int32(1)), run(c[1], r, *placed(first, last)), c[2])

    packed = jax.numpy.stack([*first, *(last[c] for c in keys)])
    return lax.while_loop(more, body, (np.int32(1), x, packed))[1]


# The runs past the first are a while_loop, which has no reverse-mode rule: an optimized function
# under jax.grad (or update_window's) is differentiated through the unrolled form, which
# computes the same numbers with every run written out.
@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5, 6, 7))
def blend_differentiable(x, upd, first, last, w: _Window, shape, combine, runs="while"):
    """``_blend`` with its loop, differentiable."""
    return _blend(x, upd, first, last, w, shape, combine, runs)


@blend_differentiable.defjvp
def _blend_jvp(w, shape, combine, runs, primals, tangents):
    x, upd, first, last = primals
    out = blend_differentiable(x, upd, first, last, w, shape, combine, runs)
    _, dout = jax.jvp(
        lambda x, u: _blend(x, u, first, last, w, shape, combine, "unrolled"),
        (x, upd),
        tuple(tangents[:2]),
    )
    return out, dout


def _blend_pass(x, upd, at, runs, others, box, combine, first_run: bool = True):
    """One read-select-write of the window at the clamped starts of ``runs`` (``(axis, int32
    start, traced bool or None: write only if)`` per block axis). Window position ``t`` on a
    block axis takes the update's row ``t + s - start``; the first run, which always runs, takes
    the update as it is when no start was clamped, so XLA reads no shifted copy then."""
    at = list(at)
    box = tuple(box)
    valid: Any = None
    ok: Any = None
    shifts = {}
    for ax, st, only_if in runs:
        s = lax.clamp(np.int32(0), st, np.int32(ax.n - ax.k))
        at[ax.d] = s
        pos = lax.add(s, lax.iota(np.int32, ax.k))
        # st <= pos < st + k, without forming st + k
        v = lax.bitwise_and(lax.ge(pos, st), lax.lt(lax.sub(pos, np.int32(ax.k)), st))
        if only_if is not None:
            v = lax.bitwise_and(v, lax.broadcast(only_if, (ax.k,)))
        v = lax.broadcast_in_dim(v, box, (ax.d,))
        valid = v if valid is None else lax.bitwise_and(valid, v)
        same = lax.eq(s, st)
        ok = same if ok is None else lax.bitwise_and(ok, same)
        shifts[ax] = lax.sub(s, st)
    if not isinstance(others, np.ndarray):  # a traced check (np.asarray(True): none)
        valid = lax.bitwise_and(valid, lax.broadcast(others, box))
        ok = lax.bitwise_and(ok, others)
    cur = lax.dynamic_slice(x, at, box, allow_negative_indices=False)
    rows = _shifted(upd, shifts, concatenated=first_run)

    def combined(u):
        return u if combine is None else combine(cur, u)

    new = lax.select(valid, combined(rows), cur)
    if first_run:
        new = lax.select(lax.broadcast(ok, box), combined(upd), new)
    return lax.dynamic_update_slice(x, new, at, allow_negative_indices=False)


def _shifted(upd, shifts, concatenated: bool):
    """``upd`` moved along each block axis: position ``t`` holds row ``t + shift`` (``shift``
    in ``[-k, k]`` wherever the result is used; other positions hold some row). The first run
    slices the update padded by k on each side (XLA fuses the pad into the window's pass; a
    concatenation of three copies, which extended dtypes such as PRNG keys need, XLA builds on
    its own when the update is computed in a loop body: 4.5 MiB for a 128x1024 tile); the
    other runs, in a while_loop, gather (a padding of loop-invariant values would be hoisted
    out of the loop and built on every call)."""
    if concatenated:
        box = tuple(upd.shape)
        starts = [np.int32(0)] * upd.ndim
        if jax.numpy.issubdtype(upd.dtype, jax.dtypes.extended):
            for ax, shift in shifts.items():
                upd = lax.concatenate([upd, upd, upd], ax.d)
                starts[ax.d] = lax.add(np.int32(ax.k), shift)
        else:
            config = [(0, 0, 0)] * upd.ndim
            for ax, shift in shifts.items():
                config[ax.d] = (ax.k, ax.k, 0)
                starts[ax.d] = lax.add(np.int32(ax.k), shift)
            upd = lax.pad(upd, np.zeros((), upd.dtype), config)
        return lax.dynamic_slice(upd, starts, box, allow_negative_indices=False)
    for ax, shift in shifts.items():
        take = lax.clamp(np.int32(0), lax.add(shift, lax.iota(np.int32, ax.k)), np.int32(ax.k - 1))
        upd = jax.numpy.take(upd, take, axis=ax.d, mode="clip")
    return upd


def window_of_block(shape: Sequence[int], sizes: Sequence[int], wrapped: bool) -> _Window:
    """The window of ``x.at[i + arange(k)[:, None], j + arange(m)]`` (one block per leading
    axis, ``sizes`` their lengths) in an array of ``shape`` (``window.update_window``'s)."""
    r = len(sizes)
    return _Window(
        (*sizes, *shape[r:]),
        tuple(range(r)),
        int(np.prod(sizes)),
        tuple((a, a) for a in range(r)),
        (False,) * r,
        (wrapped,) * r,
        (None,) * r,
        tuple(sizes),
    )


def blend_block(x, upd, first, last, w: _Window, combine):
    """``blend_differentiable`` of one block per leading axis, from each one's first and last
    (normalized) index."""
    return blend_differentiable(
        x, upd, list(first), dict(enumerate(last)), w, tuple(x.shape), combine
    )


def _emit_gather(eqn: JaxprEqn, invals, plan: _Decision):
    w, guard = plan.window, plan.guard
    x = _jaxpr.shaped(eqn.invars[0])
    dn = eqn.params["dimension_numbers"]
    operand, idx = jax.numpy.asarray(invals[0]), jax.numpy.asarray(invals[1])
    out_shape = _jaxpr.shaped(eqn.outvars[0]).shape
    first, last = _first_values(idx, w)
    # Where each operand dim of the DS result goes in the gather's output.
    collapsed = {int(d) for d in dn.collapsed_slice_dims}
    offset = [int(a) for a in dn.offset_dims]
    batch_pos = [p for p in range(len(out_shape)) if p not in offset]
    dest: list[int | None] = [None] * x.ndim
    for j, d in enumerate(d for d in range(x.ndim) if d not in collapsed):
        dest[d] = offset[j]
    if w.block is not None:
        p, c = w.block
        dest[w.dims[c]] = batch_pos[p]

    def read(operand, starts):
        got = lax.dynamic_slice(operand, starts, w.sizes, allow_negative_indices=False)
        return _rearrange(got, dest, out_shape)

    if guard == "none":
        return read(operand, _starts(first, w, x.ndim))
    if guard == "clamp":  # DS clamps int32 starts itself; other index dtypes clamp first
        clip = None if np.dtype(idx.dtype) == np.int32 else x.shape
        return read(operand, _starts(first, w, x.ndim, clip))
    if guard == "select":  # as jax lowers a FILL_OR_DROP gather, with DS for the gather
        # jax's lowering converts the indices to the operand's index dtype first (wrapping:
        # an int64 2**32 + 2 reads row 2), then masks; the mask must see the same values.
        index_dtype = _fill_index_dtype(x.shape)
        first = [lax.convert_element_type(f, index_dtype) for f in first]
        ok = _in_bounds(first, None, w, x.shape)
        got = read(operand, _starts(first, w, x.ndim))
        fill = lax.full_like(got, eqn.params["fill_value"])
        return lax.select(lax.broadcast(ok, got.shape), got, fill)
    ok = _in_bounds(first, last, w, x.shape)
    return lax.cond(
        ok,
        lambda o, i, *f: read(o, _starts(f, w, x.ndim)),
        lambda o, i, *f: _fallback(eqn, [o, i]),
        operand,
        idx,
        *first,
    )


def scatter_to_dus(closed, ctx: PassContext) -> PassResult:
    """Rewrite every scatter (and gather) of one contiguous window, exactly; report the rest.

    Decisions are made up front from the facts, so a program with nothing to rewrite costs the
    analysis and no re-trace, and one with no scatter or gather not even the analysis.
    """
    if not any(
        site.eqn.primitive in _SCATTERS or site.eqn.primitive is P.gather_p
        for site in _jaxpr.iter_eqns(closed)
    ):
        return PassResult.unchanged(closed, ())
    # (the key is set by autoopt's ``trace()``: see ``_ranges.analyze``; ``assume_ranges`` by
    # the build of a program run only on inputs in those ranges, ``value_bounds``)
    facts = _ranges.analyze(
        closed,
        numpy_values=ctx.extra.get("numpy_values", True),
        assume=ctx.extra.get("assume_ranges", {}),
    )
    consumes = _consuming_scatters(closed)
    plans: dict[Var, _Decision] = {}
    findings: dict[Var, Finding] = {}

    def note(eqn, applied, message, **details):
        # `op` tells the codemods a read (gather) from a write (scatter) without reading text.
        details.setdefault("op", "gather" if eqn.primitive is P.gather_p else "scatter")
        findings.setdefault(
            eqn.outvars[0],
            Finding(
                kind="scatter_to_dus",
                applied=applied,
                message=message,
                location=_jaxpr.user_location(eqn),
                pass_name="scatter_to_dus",
                details=details,
            ),
        )

    graph: _rounding.Graph | None = None

    def rounding_graph() -> _rounding.Graph:
        nonlocal graph
        if graph is None:
            graph = _rounding.Graph(closed)
        return graph

    for site in _jaxpr.iter_eqns(closed):
        eqn = site.eqn
        if eqn.primitive not in _SCATTERS and eqn.primitive is not P.gather_p:
            continue
        if _is_fallback(eqn) or eqn.outvars[0] in plans:
            continue
        if eqn.primitive in _SCATTERS:
            try:
                plan = _decide_scatter(
                    facts, consumes, ctx.backend, eqn, ctx.options.window_blend_min_bytes
                )
                arith = _combines_arithmetic(eqn, plan)
                if _rounding.floating_window(eqn) and _rounding.write_risk(
                    rounding_graph(), eqn, arith
                ):
                    raise _Decline(_ROUNDING_WHY[arith])
                if plan.guard == "blend" and facts.in_loop(eqn):
                    plan = dataclasses.replace(plan, in_loop=True)
                plans[eqn.outvars[0]] = plan
            except _Decline as why:
                extra = {"reason": "rounding"} if str(why) in _ROUNDING_WHY.values() else {}
                note(eqn, False, f"{_describe_scatter(eqn)} left as scatter: {why}.", **extra)
        elif eqn.primitive is P.gather_p:
            plan = _decide_gather(facts, eqn)
            if plan is not None and _rounding.read_risk(rounding_graph(), eqn):
                why = (
                    "its bounds are not proven, and a guarded window read (lax.cond) would put "
                    "a fusion boundary between the floating-point arithmetic around it"
                    if plan.guard == "cond"
                    else "a dynamic_slice fuses with the floating-point arithmetic around it "
                    "otherwise than XLA's gather (measured under jax.grad)"
                )
                note(
                    eqn,
                    False,
                    f"gather on {eqn.invars[0].aval.str_short()} left as a gather: {why}, which "
                    "can change rounding (FMA contraction) from jax.jit's",
                    reason="rounding",
                )
                plan = None
            if plan is not None:
                plans[eqn.outvars[0]] = plan
    if not plans:
        return PassResult.unchanged(closed, tuple(findings.values()))

    def rule_for(emit, describe):
        """A rule applying the precomputed plan of an equation (declining where there is none)."""

        def rule(eqn: JaxprEqn, invals):
            plan = plans.get(eqn.outvars[0])
            if plan is None:
                return None
            out = emit(eqn, invals, plan)
            w = plan.window
            note(
                eqn,
                True,
                describe(eqn, plan, "x".join(map(str, w.sizes))),
                guard=plan.guard,
                window=w.sizes,
                block=bool(w.blocks),
            )
            return [out]

        return rule

    scatter_rule = rule_for(
        _emit_scatter,
        lambda eqn, plan, size: (
            f"{_describe_scatter(eqn)} rewritten to dynamic_update_slice of one {size} window; "
            f"{_WHY[plan.guard]}."
        ),
    )
    gather_rule = rule_for(
        _emit_gather,
        lambda eqn, plan, size: (
            f"gather on {eqn.invars[0].aval.str_short()} rewritten to dynamic_slice of one {size} "
            f"window; {_GATHER_WHY[plan.guard]}."
        ),
    )

    rules = {p: scatter_rule for p in _SCATTERS}
    rules[P.gather_p] = gather_rule
    new, changed = _jaxpr.rewrite(closed, rules)
    return PassResult(jaxpr=new, changed=changed, findings=tuple(findings.values()))


def value_bounds(closed, ctx: PassContext) -> tuple[tuple[int, int, int], ...] | None:
    """``((input index, lo, hi), ...)``: scalar integer inputs (Python int arguments, weakly
    typed) whose values, when each lies in its ``[lo, hi]``, prove every write of ``closed``
    that is guarded, blended or left a scatter only because its bounds are not proven
    (``_decide_scatter``): a program built assuming them (``scatter_to_dus`` with
    ``assume_ranges``) writes those with a bare ``dynamic_update_slice``, and a call whose
    arguments the caller checks on the host runs it (``autoopt._jit``). None where no such
    write exists or the inputs cannot prove them all.

    Each ``lo`` is 0. An input the proof does not need is left out; each ``hi`` is found by
    bisection, one input after the other, the others at their bounds found so far (interval
    analysis is monotone: narrower input ranges never prove less), so the bounds returned
    were proven together."""
    numpy_values = ctx.extra.get("numpy_values", True)
    blend_min = ctx.options.window_blend_min_bytes
    facts = _ranges.analyze(closed, numpy_values=numpy_values)
    consumes = _consuming_scatters(closed)
    graph = None
    costly = []
    for site in _jaxpr.iter_eqns(closed):
        eqn = site.eqn
        if eqn.primitive not in _SCATTERS or _is_fallback(eqn):
            continue
        try:
            plan = _decide_scatter(facts, consumes, ctx.backend, eqn, blend_min)
        except _Decline as why:
            if "bounds are not proven" not in str(why):
                continue
        else:
            if plan.guard in ("none", "clamp"):
                continue  # (proven already)
        if _rounding.floating_window(eqn):
            graph = graph or _rounding.Graph(closed)
            arith = eqn.primitive in (P.scatter_add_p, P.scatter_mul_p)
            if _rounding.write_risk(graph, eqn, arith):
                continue  # (left a scatter either way)
        costly.append(eqn)
    if not costly:
        return None
    inputs = [
        k
        for k, v in enumerate(closed.jaxpr.invars)
        if getattr(v.aval, "shape", None) == ()
        and getattr(v.aval, "weak_type", False)
        and np.issubdtype(v.aval.dtype, np.integer)
    ][:_TWIN_INPUTS]
    top = max(max(x_shape(eqn)) for eqn in costly) - 1

    def proves(bounds: dict[int, int]) -> bool:
        f = _ranges.analyze(
            closed, numpy_values=numpy_values, assume={k: (0, hi) for k, hi in bounds.items()}
        )
        for eqn in costly:
            try:
                if _decide_scatter(f, consumes, ctx.backend, eqn, blend_min).guard != "none":
                    return False
            except _Decline:
                return False
        return True

    bounds = dict.fromkeys(inputs, 0)
    if top < 0 or not bounds or not proves(bounds):
        return None
    for k in list(bounds):  # (an input the proof does not need is never checked)
        without = {j: hi for j, hi in bounds.items() if j != k}
        if proves(without):
            bounds = without
    for k in bounds:
        lo, hi = bounds[k], top  # proves(bounds) holds with bounds[k] == lo
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if proves({**bounds, k: mid}):
                lo = mid
            else:
                hi = mid - 1
        bounds[k] = lo
    return tuple((k, 0, hi) for k, hi in bounds.items())


# At most this many Python int inputs are considered for a bounded twin (a tile's starts).
_TWIN_INPUTS = 4


PASS = Pass(
    name="scatter_to_dus",
    run=scatter_to_dus,
    # ("bounded_twin": the second program the call path builds from ``value_bounds``)
    kinds=("scatter_to_dus", "bounded_twin"),
    options=(
        Option(
            "window_blend_min_bytes",
            None,  # "auto"
            _check_blend_min,
            "bytes (or '512KiB'); a block or tile whose bounds are not proven is rewritten to "
            "the branch-free window blend from this size up (0: always; 'auto': 512 KiB for a "
            "block, 32 KiB for a tile)",
        ),
    ),
    codemod="autoopt.passes.in_place.codemod:ScatterToDUSCommand",
)
