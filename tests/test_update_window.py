"""``autoopt.update_window(x, i, v, size=k, op=...)`` is ``x.at[i + jnp.arange(k)].op(v)``,
bit for bit, at every start (in bounds, partly out at either end, straddling 0 through the
negative-index wrap, wholly out, past an index dtype's overflow), for every op, index dtype and
value form; and it is what the codemod offers for a blended block (issue 18)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import autoopt

OPS = ("set", "add", "subtract", "multiply", "min", "max")
N, K = 9, 4


@functools.partial(jax.jit, static_argnames=("op", "k"))
def _scatter(x, i, v, op, k):
    return getattr(x.at[i + jnp.arange(k)], op)(v)


@functools.partial(jax.jit, static_argnames=("op", "k"))
def _window(x, i, v, op, k):
    return autoopt.update_window(x, i, v, size=k, op=op)


def _same(a, b) -> bool:
    return a.dtype == b.dtype and np.array_equal(
        np.asarray(a, np.float64), np.asarray(b, np.float64), equal_nan=True
    )


@given(
    op=st.sampled_from(OPS),
    index_dtype=st.sampled_from(["int32", "int8", "uint8", "int16"]),
    start=st.integers(-2 * N - 3, 2 * N + 3),
    k=st.integers(1, N),
    value=st.sampled_from(["block", "row", "scalar"]),
)
def test_update_window_is_the_scatter_at_every_start(op, index_dtype, start, k, value):
    if index_dtype == "uint8" and start < 0:
        start = -start
    x = jnp.arange(N * 3, dtype=jnp.float32).reshape(N, 3) * 0.7 - 4.0
    v = {
        "block": -jnp.arange(k * 3, dtype=jnp.float32).reshape(k, 3) * 1.3 + 2.0,
        "row": jnp.array([1.5, -2.5, jnp.nan], jnp.float32),
        "scalar": jnp.float32(3.25),
    }[value]
    i = jnp.asarray(start, index_dtype)
    assert _same(_scatter(x, i, v, op, k), _window(x, i, v, op, k))


@pytest.mark.parametrize(
    "dtype, value",
    [("bfloat16", 1.37), ("int32", np.int32(-3)), ("float32", np.int8(5))],
)
@pytest.mark.parametrize("op", OPS)
def test_update_window_promotes_and_casts_as_at_does(dtype, value, op):
    x = (jnp.arange(N * 2).reshape(N, 2) - 7).astype(dtype)
    for start in (-6, -2, 0, 3, 7, 12):
        i = jnp.int32(start)
        assert _same(_scatter(x, i, value, op, K), _window(x, i, value, op, K)), (op, start)


@pytest.mark.parametrize("start", [2**31 - 1, 2**31 - 3, -(2**31), -(2**31) + 2])
def test_update_window_matches_at_where_the_rows_overflow_int32(start):
    x = jnp.zeros((N, 2))
    i, v = jnp.int32(start), jnp.ones((K, 2))
    assert _same(_scatter(x, i, v, "add", K), _window(x, i, v, "add", K))


def test_update_window_runs_inside_scan_with_a_donated_buffer():
    def step(x, i):
        return autoopt.update_window(x, i, jnp.full((K, 3), 1.0), size=K, op="add"), None

    def naive(x, i):
        return x.at[i + jnp.arange(K)].add(jnp.full((K, 3), 1.0)), None

    starts = jnp.array([-11, -3, -1, 0, 5, 7, 9, 30], jnp.int32)
    x = jnp.zeros((N, 3))
    got = jax.jit(lambda x: jax.lax.scan(step, x, starts)[0], donate_argnums=0)(x.copy())
    want = jax.jit(lambda x: jax.lax.scan(naive, x, starts)[0])(x)
    assert _same(want, got)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"size": 0}, "size=0: expected a Python int from 1 to x.shape"),
        ({"size": N + 1}, "for a longer window"),
        ({"size": 2, "op": "divide"}, "op='divide': expected one of"),
    ],
)
def test_bad_arguments_say_what_to_do(kwargs, match):
    with pytest.raises(ValueError, match=match):
        autoopt.update_window(jnp.zeros((N, 2)), 0, 1.0, **kwargs)


def test_a_scalar_array_or_a_float_start_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="at least one axis"):
        autoopt.update_window(jnp.float32(1.0), 0, 1.0, size=1)
    with pytest.raises(ValueError, match="start must be an integer scalar"):
        autoopt.update_window(jnp.zeros((N, 2)), 1.5, 1.0, size=2)
