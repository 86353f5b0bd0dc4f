"""Run-time safety: what a call returns and what it deletes, compared with ``jax.jit``.

Scalar canonicalization never changes a result's dtype or value, and nothing is donated while an
argument is a tracer of an outer transformation (``jax.grad``, ``vmap``, ``jvp``, an outer jit).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import autoopt

# --- canonicalize_scalars ---------------------------------------------------------------------

_SCALARS = st.one_of(
    st.integers(-(2**31), 2**31 - 1),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.booleans(),
    st.complex_numbers(allow_nan=False, allow_infinity=False, max_magnitude=1e6, width=64),
)

_FUNCTIONS = {
    "scale": lambda x, s: x * s,
    "scalar_alone": lambda x, s: s * 1,
    "mixed": lambda x, s: (x + s, s // 2 if not isinstance(s, complex) else s),
}


def _assert_same_as_jit(expected, got) -> None:
    for e, g in zip(jax.tree_util.tree_leaves(expected), jax.tree_util.tree_leaves(got)):
        assert (g.dtype, g.weak_type) == (e.dtype, e.weak_type)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))


@pytest.mark.parametrize("x_dtype", ["int32", "float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(_FUNCTIONS))
@given(scalars=st.lists(_SCALARS, min_size=2, max_size=5))
def test_canonicalized_scalars_give_jax_jits_dtypes_and_values(name, x_dtype, scalars):
    fn = _FUNCTIONS[name]
    jitted = jax.jit(fn)
    fast = autoopt.optimize(fn, canonicalize_scalars=True, fallback="raise")
    x = jnp.arange(3).astype(x_dtype)
    for s in scalars:
        try:
            expected = jitted(x, s)
        except (TypeError, OverflowError):
            continue  # jax.jit refuses it too (a bool with //, say)
        _assert_same_as_jit(expected, fast(x, s))


def test_a_float_then_an_int_scalar_keeps_the_ints_dtype():
    fast = autoopt.optimize(lambda x, s: x * s, canonicalize_scalars=True, fallback="raise")
    x = jnp.arange(3)
    assert fast(x, 2.0).dtype == jnp.float32
    got = fast(x, 3)
    assert got.dtype == jax.jit(lambda x, s: x * s)(x, 3).dtype == jnp.int32
    np.testing.assert_array_equal(got, [0, 3, 6])


# --- nothing donated under an outer transformation ----------------------------------------------


def _step(w, x):
    return w * x, x + 1.0


_TRANSFORMS = {
    "grad": lambda f, w, x: jax.grad(lambda w: f(w, x)[0].sum())(w),
    "value_and_grad": lambda f, w, x: jax.value_and_grad(lambda w: f(w, x)[0].sum())(w),
    "vmap": lambda f, w, x: jax.vmap(lambda w: f(w, x)[0])(jnp.stack([w, w])),
    "jvp": lambda f, w, x: jax.jvp(lambda w: f(w, x)[0], (w,), (w,)),
    "outer_jit": lambda f, w, x: jax.jit(lambda w: f(w, x)[0])(w),
}
_OPTIONS = {
    "auto": {"donate": "auto"},
    "auto_remat_off": {"donate": "auto", "remat": "off"},
    "safe": {},
    "explicit": {"donate_argnums": (0, 1)},
    "explicit_compiler_options": {
        "donate_argnums": 1,
        "compiler_options": {"xla_cpu_enable_fast_math": False},
    },
}


@pytest.mark.parametrize("options", sorted(_OPTIONS))
@pytest.mark.parametrize("transform", sorted(_TRANSFORMS))
def test_an_array_next_to_a_tracer_is_never_donated(transform, options):
    fast = autoopt.optimize(_step, fallback="raise", **_OPTIONS[options])
    for _ in range(2):  # the first calls teach the caches (fast paths, remat's watch)
        fast(jnp.ones(4), jnp.arange(4.0))
    w, x = jnp.ones(4), jnp.arange(4.0)
    got = _TRANSFORMS[transform](fast, w, x)
    assert not x.is_deleted() and not w.is_deleted()
    expected = _TRANSFORMS[transform](jax.jit(_step), jnp.ones(4), jnp.arange(4.0))
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, expected)


@pytest.mark.parametrize("options", ["auto", "explicit"])
def test_a_concrete_call_after_a_transformed_one_still_donates(options):
    fast = autoopt.optimize(_step, fallback="raise", **_OPTIONS[options])
    w, x = jnp.ones(4), jnp.arange(4.0)
    jax.grad(lambda w: fast(w, x)[0].sum())(w)
    assert not x.is_deleted()
    fast(w, x)
    assert x.is_deleted()
