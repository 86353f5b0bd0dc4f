"""``autoopt.update_window``: ``x.at[start + jnp.arange(size)].op(values)`` without a scatter.

The source form of the scatter_to_dus pass's branch-free block rewrite (``_pass._blend``), for
code that stays under plain ``jax.jit``: the codemod suggests it where the pass blended a block
whose bounds it could not prove. It runs the pass's own emitter, so the two cannot drift apart.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from autoopt.passes.in_place import _pass

__all__ = ["update_window", "OPS"]

# ``.at[...]``'s methods and the elementwise combiner each one's scatter applies.
OPS = {
    "set": None,
    "add": lax.add,
    "subtract": lax.sub,
    "multiply": lax.mul,
    "min": lax.min,
    "max": lax.max,
}


def update_window(x: Any, start: Any, values: Any, *, size: Any, op: str = "set") -> jax.Array:
    """``x.at[start + jnp.arange(size)].<op>(values)``, with the same numbers, without a scatter;
    with a tuple, the tile ``x.at[i + jnp.arange(k)[:, None], j + jnp.arange(m)].<op>(values)``
    is ``update_window(x, (i, j), values, size=(k, m))``.

    One ``dynamic_update_slice`` of the window at the clamped start, blending the rows already
    there with the new ones where the scatter writes them. XLA updates a donated buffer in place
    either way, but on CPU a scatter is a loop over its points (a tile's, one element each); the
    window is one pass (``benchmarks/RESULTS.md``). Exactly as ``.at`` with its default mode
    (``"drop"``): rows out of bounds are dropped, a negative row counts from the end (``-1`` is
    the last row, so a window starting at ``-2`` writes the last two rows and the first ``size -
    2``), ``values`` is promoted with ``x`` and broadcast to the window, the result has ``x``'s
    dtype. Differentiable (forward and reverse) and batchable as ``.at`` is.

    ``size``: the number of rows, a Python int from 1 to ``x.shape[0]``; or a tuple of them, one
    per leading axis, with ``start`` a tuple as long. ``op``: ``"set"``, ``"add"``,
    ``"subtract"``, ``"multiply"``, ``"min"`` or ``"max"``.
    """
    x = jnp.asarray(x)
    if op not in OPS:
        raise ValueError(f"op={op!r}: expected one of {', '.join(map(repr, OPS))}")
    tile = isinstance(size, tuple | list)
    sizes = tuple(size) if tile else (size,)
    starts = tuple(start) if isinstance(start, tuple | list) else (start,)
    if len(starts) != len(sizes):
        raise ValueError(
            f"start has {len(starts)} component(s) and size {len(sizes)}: give one start per "
            "size, e.g. update_window(x, (i, j), v, size=(k, m)) for a tile"
        )
    if not sizes:
        raise ValueError("size=(): give at least one window length")
    if x.ndim < len(sizes):
        need = "one axis" if len(sizes) == 1 else f"{len(sizes)} axes"
        what = "a scalar" if x.ndim == 0 else f"{x.ndim}-D"
        raise ValueError(
            f"update_window needs an array with at least {need} for size={size!r}; x is {what}"
        )
    for ax, k in enumerate(sizes):
        n = x.shape[ax]
        if not isinstance(k, int | np.integer) or isinstance(k, bool) or not 1 <= k <= n:
            raise ValueError(
                f"size={size!r}: expected a Python int from 1 to x.shape[{ax}] = {n}; for a "
                "longer window, or a traced size, write x.at[start + jnp.arange(size)] instead"
            )
        if 2 * n > np.iinfo(np.int32).max:
            raise ValueError(
                f"x.shape[{ax}] = {n} is too long for the window's int32 row arithmetic"
            )
    sizes = tuple(int(k) for k in sizes)
    firsts, lasts, wrapped = [], [], False
    for ax, (i, k) in enumerate(zip(starts, sizes)):
        i = jnp.asarray(i)
        if i.ndim != 0 or not jnp.issubdtype(i.dtype, jnp.integer):
            raise ValueError(f"start must be an integer scalar, got {i.dtype}{list(i.shape)}")
        # The rows as ``.at`` computes them (its index dtype, its wraparound), then normalized
        # row by row as jnp normalizes negative indices.
        rows = i + jnp.arange(k)
        wrapped = bool(jnp.issubdtype(rows.dtype, jnp.signedinteger))
        if wrapped:
            rows = jnp.where(rows < 0, rows + x.shape[ax], rows)
        firsts.append(rows[0])
        lasts.append(rows[-1])
    values = jnp.asarray(values)
    promoted = jnp.result_type(x, values)
    if op == "multiply" and jnp.issubdtype(promoted, jnp.complexfloating):
        # A complex product is four products and two sums: written elementwise it may be
        # contracted into fused multiply-adds where the scatter's is not, so `.at` does it.
        index = tuple(
            jnp.asarray(i) + jnp.arange(k).reshape((k,) + (1,) * (len(sizes) - 1 - a))
            for a, (i, k) in enumerate(zip(starts, sizes))
        )
        return x.at[index].multiply(values)
    if promoted != x.dtype:
        # `.at` computes in the promoted dtype over the whole array and casts back, so values
        # it does not write round-trip too (int32 16777217 through float32 is 16777216).
        x = lax.convert_element_type(lax.convert_element_type(x, promoted), x.dtype)
    box = (*sizes, *x.shape[len(sizes) :])
    upd = lax.convert_element_type(jnp.broadcast_to(values, box), promoted)
    window = _pass.window_of_block(x.shape, sizes, wrapped)
    return _emit(x, upd, tuple(firsts), tuple(lasts), window, op)


def _combiner(op: str, dtype, promoted):
    fn = OPS[op]

    def combine(cur, new):  # in the promoted dtype, then back to x's, as .at's scatter
        if fn is not None:
            new = fn(lax.convert_element_type(cur, promoted), new)
        return lax.convert_element_type(new, dtype)

    return combine


def _emit(x, upd, firsts, lasts, window, op):
    combine = _combiner(op, x.dtype, upd.dtype)
    if window.n_points > 1:  # as ``.at``'s scatter of several points (``opaque_window``)
        combine = _pass.opaque_window(combine)
    return _pass.blend_block(x, upd, firsts, lasts, window, combine)
