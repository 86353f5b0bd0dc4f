"""Extended dtypes through every pass (issue 15 item 1): typed PRNG keys of each implementation,
float0, int4/uint4, float8 and bfloat16. Each program runs under ``fallback="raise"`` with
warnings as errors, so a pass that cannot read a dtype fails the test rather than falling back
to plain jax.jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import autoopt
from autoopt._memory import aval_bytes
from autoopt.testing import assert_trees_equivalent

KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
NARROW = ("bfloat16", "int4", "uint4", "float8_e4m3fn", "float8_e5m2")


def _values(kind: str):
    """``(array of 8, one element)`` of a dtype or key implementation."""
    if kind in KEY_IMPLS:
        return jax.random.split(jax.random.key(0, impl=kind), 8), jax.random.key(5, impl=kind)
    x = jnp.arange(8).astype(kind)
    return x, x[1]


def scatter(x, i, v):
    return x.at[i].set(v)


def gather(x, i):
    return x[i]


def window(x, i):
    return lax.dynamic_slice_in_dim(x, i, 3)


def scan_carry(x, i, v):
    def body(c, _):
        return c.at[i].set(v), None

    return lax.scan(body, x, None, length=3)[0]


def fill_loop(x, i, v):
    return lax.fori_loop(0, 3, lambda j, c: c.at[(i + j) % 8].set(v), x)


PROGRAMS = {
    "scatter": (scatter, lambda x, v: (x, 3, v)),
    "scatter out of bounds": (scatter, lambda x, v: (x, 11, v)),
    "gather": (gather, lambda x, v: (x, 3)),
    "window": (window, lambda x, v: (x, 6)),
    "scan carry": (scan_carry, lambda x, v: (x, 2, v)),
    "fill loop": (fill_loop, lambda x, v: (x, 5, v)),
}


@pytest.mark.parametrize("program", PROGRAMS, ids=str)
@pytest.mark.parametrize("kind", KEY_IMPLS + NARROW)
def test_every_pass_runs_on_the_dtype_and_matches_jax_jit(kind, program):
    fn, make = PROGRAMS[program]
    args = make(*_values(kind))
    fast = autoopt.optimize(fn, fallback="raise", verify=True)  # verify compares keys too
    assert_trees_equivalent(jax.jit(fn)(*args), fast(*args), exact=True, what=program)
    report = fast.explain(*args)
    assert report.render(color=False).strip()
    assert report.fallback is None


@pytest.mark.parametrize("kind", KEY_IMPLS + NARROW)
def test_a_constant_of_the_dtype_the_program_closes_over_passes_through(kind):
    # optax's inject_hyperparams(...).init returning the key it was built with (its own
    # test_prng_key_not_hyperparameter): the range analysis read every constant with NumPy,
    # which cannot convert a key array
    const, _ = _values(kind)

    def init(p):
        return const, const[2], p * 2

    fast = autoopt.optimize(init, fallback="raise", verify=True)
    x = jnp.ones(3)
    assert_trees_equivalent(jax.jit(init)(x), fast(x), exact=True)


@pytest.mark.parametrize("impl", KEY_IMPLS)
def test_a_key_state_is_donated_at_a_rebinding_call(impl):
    def step(key, x):
        key, sub = jax.random.split(key)
        return key, x + jax.random.normal(sub, x.shape)

    fast = autoopt.optimize(step, fallback="raise")
    key, x = jax.random.key(0, impl=impl), jnp.zeros(4)
    ref_key, ref_x = jax.random.key(0, impl=impl), jnp.zeros(4)
    for _ in range(3):
        key, x = fast(key, x)
        ref_key, ref_x = jax.jit(step)(ref_key, ref_x)
    assert_trees_equivalent((ref_key, ref_x), (key, x), exact=True)
    # (a key array has no buffer pointer of its own: key_data copies; the report says it)
    donated = [f for f in fast.explain(key, x).findings if f.kind == "donate" and f.applied]
    assert any("`key`" in f.message for f in donated), [f.message for f in donated]
    can = [f for f in fast.inspect(key, x).findings if "`key`" in f.message]
    assert can[0].bytes_saved == jax.random.key_data(key).nbytes


def test_a_training_step_with_dropout_keys_matches_jax_jit():
    def loss(w, x, key):
        h = jnp.tanh(x @ w)
        h = jnp.where(jax.random.bernoulli(key, 0.9, h.shape), h / 0.9, 0.0)
        for _ in range(4):
            h = jnp.tanh(h @ w)
        return jnp.mean(h**2)

    def step(w, key, x):
        key, sub = jax.random.split(key)
        value, g = jax.value_and_grad(loss)(w, x, sub)
        return w - 0.1 * g, key, value

    w, x = jnp.full((32, 32), 0.01), jnp.ones((16, 32))
    fast = autoopt.optimize(step, fallback="raise")
    expected = jax.jit(step)(w, jax.random.key(1), x)
    got = fast(w, jax.random.key(1), x)
    assert_trees_equivalent(expected, got)
    assert fast.inspect(w, jax.random.key(1), x).fallback is None


def test_a_float0_gradient_of_an_integer_input_is_returned_as_jax_jit_returns_it():
    def f(x, n):
        return jnp.sum(x * n)

    grad = jax.grad(f, argnums=(0, 1), allow_int=True)
    fast = autoopt.optimize(grad, fallback="raise")
    x, n = jnp.ones(3), jnp.arange(3)
    expected, got = jax.jit(grad)(x, n), fast(x, n)
    assert got[1].dtype == expected[1].dtype == jax.dtypes.float0
    np.testing.assert_array_equal(got[0], expected[0])
    assert fast.explain(x, n).render(color=False).strip()
    # The comparison the fuzzer and verify= use takes float0 leaves within a tolerance as well
    # (they hold no values: bytes).
    assert_trees_equivalent(expected, got)


def test_key_bytes_are_counted_by_their_itemsize():
    key = jax.random.split(jax.random.key(0), 6)
    assert aval_bytes(jax.typeof(key)) == jax.random.key_data(key).nbytes == 48


def test_keys_compare_by_implementation_and_key_data():
    a = jax.random.split(jax.random.key(0), 2)
    assert_trees_equivalent(a, jax.random.split(jax.random.key(0), 2))
    with pytest.raises(AssertionError, match="not bit-identical"):
        assert_trees_equivalent(a, jax.random.split(jax.random.key(1), 2))
    with pytest.raises(AssertionError, match="instead of"):
        assert_trees_equivalent(a, jax.random.split(jax.random.key(0, impl="rbg"), 2))


@pytest.mark.skipif(not hasattr(jax, "new_ref"), reason="this jax has no jax.new_ref")
def test_a_program_with_a_mutable_ref_runs_as_under_jax_jit():
    def f(x):
        ref = jax.new_ref(x)
        ref[...] = ref[...] * 2.0
        return ref[...] + 1.0

    fast = autoopt.optimize(f, fallback="raise")
    np.testing.assert_array_equal(fast(jnp.ones(3)), jax.jit(f)(jnp.ones(3)))
