"""Fuzzer find: scatter_to_dus fails on a program that closes over an outer transformation's value.

When the optimized function is built inside ``jax.jit``/``jax.grad``/``jax.vmap`` and closes over
one of its values (a model's forward closing over parameters), the traced program's constants
are tracers. The range analysis behind scatter_to_dus (``autoopt/_ranges.py``: ``_walk`` calls
``_values_interval(c)``, which calls ``np.asarray`` on every constant; ``Facts`` also keeps the
constant for ``np.asarray`` later) raises ``TracerArrayConversionError``. Under
``fallback="warn"`` this silently costs the optimization (one warning); under ``"raise"`` it is a
``PassError``. Fix: treat a constant for which ``autoopt._compat.is_tracer`` is true as unknown
(no interval, not recorded as a constant). Fixed in the pass.

Shrunk from ``tests/test_fuzz.py::test_random_programs_closing_over_outer_tracers_match_jax_jit``.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

import autoopt
from autoopt.testing import assert_trees_equivalent


def program(x0):
    v1 = x0
    v2 = jnp.sin(v1)
    return v2


def _outer(compile_):
    def inner(first):
        return compile_(lambda: program(first))()

    return jax.jit(inner)(jnp.float32(0.5))


def test_a_program_closing_over_an_outer_tracer_optimizes_without_error():
    expected = _outer(jax.jit)
    got = _outer(lambda f: autoopt.optimize(f, fallback="raise", donate="off"))
    assert_trees_equivalent(expected, got)


def test_a_program_closing_over_an_outer_tracer_computes_the_same_with_fallback():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autoopt.AutooptWarning)
        got = _outer(lambda f: autoopt.optimize(f, donate="off"))
    assert_trees_equivalent(_outer(jax.jit), got)
