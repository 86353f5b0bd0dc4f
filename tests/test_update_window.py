"""``autoopt.update_window(x, i, v, size=k, op=...)`` is ``x.at[i + jnp.arange(k)].op(v)``,
bit for bit, at every start (in bounds, partly out at either end, straddling 0 through the
negative-index wrap, wholly out, past an index dtype's overflow), for every op, index dtype and
value form; and it is what the codemod offers for a blended block (issue 18)."""

from __future__ import annotations

import functools
import warnings

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
    [
        ("bfloat16", 1.37),
        ("int32", np.int32(-3)),
        ("float32", np.int8(5)),
        ("int32", np.float32(1.5)),  # found in review: .at rounds the rows it keeps too
        ("int8", np.int32(300)),
        ("bool", np.float32(0.5)),
    ],
)
@pytest.mark.parametrize("op", OPS)
def test_update_window_promotes_and_casts_as_at_does(dtype, value, op):
    x = (jnp.arange(N * 2).reshape(N, 2) - 7 + 16777210).astype(dtype)
    for start in (-6, -2, 0, 3, 7, 12):
        i = jnp.int32(start)
        with warnings.catch_warnings():  # .at warns of a cast it will refuse in a later jax
            warnings.simplefilter("ignore", FutureWarning)
            want = _scatter(x, i, value, op, K)
        assert _same(want, _window(x, i, value, op, K)), (op, start)


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


@functools.partial(jax.jit, static_argnames=("op", "k", "m"))
def _tile_scatter(x, i, j, v, op, k, m):
    return getattr(x.at[i + jnp.arange(k)[:, None], j + jnp.arange(m)], op)(v)


@functools.partial(jax.jit, static_argnames=("op", "k", "m"))
def _tile_window(x, i, j, v, op, k, m):
    return autoopt.update_window(x, (i, j), v, size=(k, m), op=op)


@given(
    op=st.sampled_from(OPS),
    i=st.integers(-2 * N - 3, 2 * N + 3),
    j=st.integers(-13, 13),
    k=st.integers(1, N),
    m=st.integers(1, 6),
    value=st.sampled_from(["block", "row", "scalar"]),
    trailing=st.booleans(),
)
def test_a_tile_is_the_scatter_at_every_pair_of_starts(op, i, j, k, m, value, trailing):
    shape = (N, 6, 2) if trailing else (N, 6)
    x = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) * 0.7 - 4.0
    box = (k, m, *shape[2:])
    v = {
        "block": -jnp.arange(np.prod(box), dtype=jnp.float32).reshape(box) * 1.3 + 2.0,
        "row": jnp.linspace(-1.0, 1.0, box[-1], dtype=jnp.float32),
        "scalar": jnp.float32(3.25),
    }[value]
    i, j = jnp.int32(i), jnp.int32(j)
    assert _same(_tile_scatter(x, i, j, v, op, k, m), _tile_window(x, i, j, v, op, k, m))


@pytest.mark.parametrize("op", ["set", "add", "max"])  # .at.multiply has no gradient
@pytest.mark.parametrize("tile", [False, True])
def test_update_window_differentiates_and_batches_as_at_does(op, tile):
    """Forward and reverse mode (the runs past the wrap are a while_loop in the primal, which
    has no reverse rule: the derivative is taken of the unrolled form) and vmap."""
    x = jnp.arange(N * 4, dtype=jnp.float32).reshape(N, 4) * 0.3 - 1.0
    v = jnp.linspace(-2.0, 2.0, K * (2 if tile else 4)).reshape(K, 2 if tile else 4)

    def at(x, v, i):
        if tile:
            return getattr(x.at[i + jnp.arange(K)[:, None], i + 1 + jnp.arange(2)], op)(v)
        return getattr(x.at[i + jnp.arange(K)], op)(v)

    def window(x, v, i):
        if tile:
            return autoopt.update_window(x, (i, i + 1), v, size=(K, 2), op=op)
        return autoopt.update_window(x, i, v, size=K, op=op)

    for start in (-K - 1, -2, 0, 3, N - 2, N + 1):
        i = jnp.int32(start)

        def loss(f, i=i):
            return lambda x, v: jnp.sum(jnp.sin(f(x, v, i)))

        want = jax.jit(jax.grad(loss(at), argnums=(0, 1)))(x, v)
        got = jax.jit(jax.grad(loss(window), argnums=(0, 1)))(x, v)
        for a, b in zip(want, got):
            assert _same(a, b), (op, start)
        tangents = (jnp.ones_like(x), jnp.full_like(v, 0.5))
        _, want = jax.jvp(lambda x, v, i=i: at(x, v, i), (x, v), tangents)
        _, got = jax.jvp(lambda x, v, i=i: window(x, v, i), (x, v), tangents)
        assert _same(want, got)
    starts = jnp.array([-K - 1, -2, 0, 3, N + 1], jnp.int32)
    want = jax.vmap(at, in_axes=(None, None, 0))(x, v, starts)
    got = jax.jit(jax.vmap(window, in_axes=(None, None, 0)))(x, v, starts)
    assert _same(want, got)


@pytest.mark.parametrize(
    "start, size, match",
    [
        ((0, 0), 2, "start has 2 component"),
        (0, (2, 2), "start has 1 component"),
        ((0, 0), (2, 7), r"x.shape\[1\] = 6"),
        ((0, 0, 0), (1, 1, 1), "at least 3 axes"),
        ((0, 0), (), "start has 2"),
    ],
)
def test_bad_tile_arguments_say_what_to_do(start, size, match):
    with pytest.raises(ValueError, match=match):
        autoopt.update_window(jnp.zeros((N, 6)), start, 1.0, size=size)


@pytest.mark.parametrize("tile", [False, True])
def test_a_complex_multiply_is_the_scatter_bit_for_bit(tile):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(N, 4)) + 1j * rng.normal(size=(N, 4)), jnp.complex64)
    v = jnp.asarray(rng.normal(size=(K, 4)) + 1j * rng.normal(size=(K, 4)), jnp.complex64)
    for start in (-K - 1, -2, 0, 3, N - 2):
        i = jnp.int32(start)
        if tile:
            want = x.at[i + jnp.arange(K)[:, None], jnp.arange(4)].multiply(v)
            got = jax.jit(
                lambda x, v, i: autoopt.update_window(x, (i, 0), v, size=(K, 4), op="multiply")
            )(x, v, i)
        else:
            want = _scatter(x, i, v, "multiply", K)
            got = _window(x, i, v, "multiply", K)
        assert want.dtype == got.dtype and np.array_equal(
            np.asarray(want).view(np.float32), np.asarray(got).view(np.float32)
        ), start
