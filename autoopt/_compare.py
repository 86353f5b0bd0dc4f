"""Equivalence of two results, dtype-aware: what ``verify=True`` and ``autoopt.testing`` check.

Integers and booleans must be bit-identical; floating outputs may differ only by a few ulps
(XLA's fusion choices, or remat's reassociation), scaled by the largest finite magnitude.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["assert_trees_equivalent", "tolerance"]

# Relative tolerance per float dtype: a few ulps after fusion reorders a reduction.
_RTOL = {"bfloat16": 2e-2, "float16": 2e-3, "float32": 2e-5, "float64": 1e-12}


def tolerance(dtype) -> float:
    """0 for integers/booleans (bit-identical); a few ulps, scaled, for floats."""
    d = np.dtype(dtype)
    if d.kind in "biu":
        return 0.0
    return _RTOL.get(d.name, 2e-5)


def assert_trees_equivalent(
    expected: Any, got: Any, *, what: str = "optimized result", exact: bool = False
) -> None:
    """Same pytree structure, shapes, dtypes; values equal (exactly for ints/bools, or when
    ``exact``; within ``tolerance(dtype)`` for floats). NaNs must match NaNs."""
    e_leaves, e_tree = jax.tree_util.tree_flatten(expected)
    g_leaves, g_tree = jax.tree_util.tree_flatten(got)
    if e_tree != g_tree:
        raise AssertionError(
            f"{what}: output structure differs:\n  expected {e_tree}\n  got      {g_tree}"
        )
    for i, (e, g) in enumerate(zip(e_leaves, g_leaves)):
        e_arr, g_arr = np.asarray(e), np.asarray(g)
        where = f"{what}: output leaf {i}"
        if e_arr.shape != g_arr.shape or e_arr.dtype != g_arr.dtype:
            raise AssertionError(
                f"{where}: {g_arr.dtype}{list(g_arr.shape)} instead of "
                f"{e_arr.dtype}{list(e_arr.shape)}"
            )
        rtol = 0.0 if exact else tolerance(e_arr.dtype)
        if rtol == 0.0:
            same = e_arr.tobytes() == g_arr.tobytes()
            if not same and e_arr.dtype.kind == "f":
                # -0.0 vs 0.0 and NaN payloads are equal numbers for users.
                same = np.array_equal(e_arr, g_arr, equal_nan=True)
            if not same:
                bad = np.argwhere(e_arr != g_arr)
                raise AssertionError(
                    f"{where} not bit-identical; first difference at index "
                    f"{tuple(bad[0]) if len(bad) else '?'}: expected "
                    f"{e_arr[tuple(bad[0])] if len(bad) else e_arr}, got "
                    f"{g_arr[tuple(bad[0])] if len(bad) else g_arr}"
                )
        else:
            e64 = (
                e_arr.astype(np.float64) if e_arr.dtype.kind == "f" else e_arr.astype(np.complex128)
            )
            g64 = (
                g_arr.astype(np.float64) if g_arr.dtype.kind == "f" else g_arr.astype(np.complex128)
            )
            # Scale by the largest finite magnitude: an inf would make atol inf and pass anything.
            finite = np.abs(e64[np.isfinite(e64)])
            scale = max(1.0, float(finite.max())) if finite.size else 1.0
            np.testing.assert_allclose(
                g64, e64, rtol=rtol, atol=rtol * scale, equal_nan=True, err_msg=where
            )
