"""Fuzzer find: scatter_to_dus crashes on an equation with no outputs.

``scatter_to_dus`` (``autoopt/passes/scatter_to_dus.py``, the loop over ``iter_eqns``) reads
``eqn.outvars[0]`` of every equation before looking at its primitive; an equation with no outputs
raises ``IndexError: list index out of range``. Such equations are common: ``jax.debug.print`` and
``jax.debug.callback`` (``debug_callback`` has no outputs), and a ``cond`` whose branches return
their operand unchanged (JAX forwards those outputs and leaves a ``cond`` with no outputs). Under
the default ``fallback="warn"`` every such program silently loses all optimization. Fix: test
the primitive first, or guard with ``eqn.outvars and ...`` (fixed: the loop now tests the
primitive first).

Shrunk from ``tests/test_fuzz.py::test_random_programs_compute_what_jax_jit_computes``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import autoopt
from autoopt.testing import assert_trees_equivalent


def program(x):
    return lax.cond(x > 0, lambda a: a, lambda a: lax.fori_loop(0, a, lambda i, c: c, a), x)


def with_debug_print(x):
    jax.debug.print("x={x}", x=x)
    return x.at[0].set(1.0)


def test_a_cond_with_forwarded_outputs_optimizes_without_error():
    x = jnp.int32(3)
    assert_trees_equivalent(
        jax.jit(program)(x), autoopt.optimize(program, fallback="raise", donate="off")(x)
    )


def test_a_program_with_debug_print_optimizes_without_error():
    x = jnp.zeros(3)
    assert_trees_equivalent(
        jax.jit(with_debug_print)(x),
        autoopt.optimize(with_debug_print, fallback="raise", donate="off")(x),
    )
