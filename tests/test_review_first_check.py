"""Review of 48577b8 (``OptimizedFunction._first_check``): the FitCheck that
``_program_for_call``'s trace stopped at is kept on the thread until the call takes it. A first
call that raises before ``_execute`` reaches ``_first_check`` (under verify=True, ``_verify``
runs first: its jax.jit reference run raises the user's error) leaves it there, and it keeps
the dropped program alive after ``jax.clear_caches()`` / ``clear_cache()``. jax reuses a
float64 NumPy constant's conversion while an array converted from it lives, so the next
call's trace computes with the bytes from before the refill, where jax.jit reads them anew.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoopt


def _run(make, clear: str) -> float:
    c = np.zeros(16, np.float64)
    fail = [True]

    def cb():
        if fail[0]:
            raise RuntimeError("the user's callback fails on the first call")

    def f(x):
        jax.debug.callback(cb)
        return x * 2 + c

    g = make(f)
    x = jnp.ones(16)
    raised = False
    # (jax logs the callback's error with its traceback: pytest's log capture would keep the
    # failed call's frames, and so the old conversion, alive for jax.jit too)
    logger = logging.getLogger("jax._src.debugging")
    logger.disabled = True
    try:  # (not pytest.raises: its ExceptionInfo would keep the failed call's frames alive)
        jax.block_until_ready(g(x))
    except Exception:  # noqa: BLE001 - jax wraps the callback's error
        raised = True
    finally:
        logger.disabled = False
    assert raised
    fail[0] = False
    c[:] = 100
    if clear == "jax":
        jax.clear_caches()
    else:
        g.clear_cache()
    return float(g(x)[1])


@pytest.mark.parametrize("clear", ["jax", "own"])
def test_a_failed_first_call_under_verify_leaves_no_program_alive(clear):
    # (``clear_cache()`` failed on 8de0502 too: ``_verify`` built a new jax.jit for its
    # reference run each call, whose trace no ``clear_cache()`` reached)
    expected = _run(jax.jit, clear)
    assert expected == 102.0
    assert _run(lambda f: autoopt.optimize(f, verify=True), clear) == expected


def test_a_first_call_that_fails_after_its_trace_leaves_no_program_alive():
    """Without verify=True the check is taken by the call (``_execute``); a call whose
    callback fails there still leaves nothing that decides the next call's constant."""
    expected = _run(jax.jit, "jax")
    assert _run(autoopt.optimize, "jax") == expected
