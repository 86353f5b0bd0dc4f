"""Equivalence of two results, dtype-aware: what ``verify=True`` and ``autoopt.testing`` check.

Integers and booleans must be bit-identical; floating outputs may differ only by a few ulps
(XLA's fusion choices, or remat's reassociation), scaled by the largest finite magnitude.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["assert_trees_equivalent", "tolerance"]

# Relative tolerance per float dtype: a few ulps after fusion reorders a reduction.
_RTOL = {"bfloat16": 2e-2, "float16": 2e-3, "float32": 2e-5, "float64": 1e-12}


def tolerance(dtype) -> float:
    """0 for integers/booleans (bit-identical); a few ulps, scaled, for floats."""
    d = np.dtype(dtype)
    # jnp.issubdtype knows ml_dtypes' int4/float8/bfloat16, which NumPy files under kind "V";
    # float0 (the gradient of an integer input) holds no values: compared as bytes.
    if jnp.issubdtype(d, jnp.integer) or jnp.issubdtype(d, jnp.bool_) or d == jax.dtypes.float0:
        return 0.0
    return _RTOL.get(d.name, 0.25 if d.name.startswith("float8") else 2e-5)


def _is_key(x) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _dtype_of(x) -> str:
    return str(getattr(x, "dtype", type(x).__name__))


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
        where = f"{what}: output leaf {i}"
        if _is_key(e) or _is_key(g):
            # PRNG keys have no NumPy form: same implementation, bit-identical key data.
            if not (_is_key(e) and _is_key(g) and e.dtype == g.dtype):
                raise AssertionError(f"{where}: {_dtype_of(g)} instead of {_dtype_of(e)}")
            e, g, exact_leaf = jax.random.key_data(e), jax.random.key_data(g), True
        else:
            exact_leaf = exact
        e_arr, g_arr = np.asarray(e), np.asarray(g)
        if e_arr.shape != g_arr.shape or e_arr.dtype != g_arr.dtype:
            raise AssertionError(
                f"{where}: {g_arr.dtype}{list(g_arr.shape)} instead of "
                f"{e_arr.dtype}{list(e_arr.shape)}"
            )
        rtol = 0.0 if exact_leaf else tolerance(e_arr.dtype)
        if rtol == 0.0:
            same = e_arr.tobytes() == g_arr.tobytes()
            if not same and jnp.issubdtype(e_arr.dtype, jnp.floating):
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
                e_arr.astype(np.float64)
                if jnp.issubdtype(e_arr.dtype, jnp.floating)
                else e_arr.astype(np.complex128)
            )
            g64 = (
                g_arr.astype(np.float64)
                if jnp.issubdtype(g_arr.dtype, jnp.floating)
                else g_arr.astype(np.complex128)
            )
            # Scale by the largest finite magnitude: an inf would make atol inf and pass anything.
            finite = np.abs(e64[np.isfinite(e64)])
            scale = max(1.0, float(finite.max())) if finite.size else 1.0
            np.testing.assert_allclose(
                g64, e64, rtol=rtol, atol=rtol * scale, equal_nan=True, err_msg=where
            )
