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


def update_window(x: Any, start: Any, values: Any, *, size: int, op: str = "set") -> jax.Array:
    """``x.at[start + jnp.arange(size)].<op>(values)``, with the same numbers, as one or two
    ``dynamic_update_slice``s of a ``size``-row window instead of a scatter.

    XLA updates a donated buffer in place either way, but on CPU a scatter of ``size`` rows is a
    loop over them, each row bounds-checked; the window is one copy of the rows
    (``benchmarks/RESULTS.md``). Exactly as ``.at`` with its default mode (``"drop"``): rows
    out of bounds are dropped, a negative row counts from the end (``-1`` is the last row, so a
    window starting at ``-2`` writes the last two rows and the first ``size - 2``), ``values``
    is promoted with ``x`` and broadcast to the window, the result has ``x``'s dtype.

    ``size``: the number of rows, a Python int from 1 to ``x.shape[0]``. ``op``: ``"set"``,
    ``"add"``, ``"subtract"``, ``"multiply"``, ``"min"`` or ``"max"``.
    """
    from autoopt.passes.in_place import _pass

    x = jnp.asarray(x)
    if op not in OPS:
        raise ValueError(f"op={op!r}: expected one of {', '.join(map(repr, OPS))}")
    if x.ndim == 0:
        raise ValueError("update_window needs an array with at least one axis; x is a scalar")
    n = x.shape[0]
    if not isinstance(size, int | np.integer) or not 1 <= size <= n:
        raise ValueError(
            f"size={size!r}: expected a Python int from 1 to x.shape[0] = {n}; for a longer "
            "window, or a traced size, write x.at[start + jnp.arange(size)] instead"
        )
    size = int(size)
    if 2 * n > np.iinfo(np.int32).max:
        raise ValueError(f"x.shape[0] = {n} is too long for the window's int32 row arithmetic")
    start = jnp.asarray(start)
    if start.ndim != 0 or not jnp.issubdtype(start.dtype, jnp.integer):
        raise ValueError(f"start must be an integer scalar, got {start.dtype}{list(start.shape)}")
    # The rows as ``.at`` computes them (its index dtype, its wraparound), then normalized row by
    # row as jnp normalizes negative indices.
    rows = start + jnp.arange(size)
    if jnp.issubdtype(rows.dtype, jnp.signedinteger):
        rows = jnp.where(rows < 0, rows + n, rows)
    values = jnp.asarray(values)
    promoted = jnp.result_type(x, values)
    box = (size, *x.shape[1:])
    upd = lax.convert_element_type(jnp.broadcast_to(values, box), promoted)
    fn = OPS[op]

    def combine(cur, new):  # in the promoted dtype, then back to x's, as .at's scatter
        if fn is not None:
            new = fn(lax.convert_element_type(cur, promoted), new)
        return lax.convert_element_type(new, x.dtype)

    wrapped = bool(jnp.issubdtype(rows.dtype, jnp.signedinteger))
    window = _pass.window_of_rows(x.shape, size, wrapped)
    return _pass.blend_rows(x, upd, rows[0], rows[-1], window, combine)
