"""After a signature's first call, every later call takes jax's C++ dispatch, as under jax.jit.

A call whose trace raises leaves its signature's entry in jaxlib's dispatch cache marked to fall
back to Python for good; autoopt aborts first calls' traces on purpose (the fit check of
``remat="fit"``, the placer's hoisting of large constants), which put every later call of every
default-mode function on jax's Python path (``cache_miss``: 52 us a call against jax.jit's 4.3 on
a small function). Observed here by counting Python calls of jax's ``cache_miss``.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoopt

_BIG = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024)  # 2 MiB: hoisted


def _slow_dispatches(call, n: int = 20) -> int:
    """How many of ``n`` calls went through jax's Python dispatch (``cache_miss``)."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event == "call" and frame.f_code.co_name == "cache_miss":
            if frame.f_code.co_filename.endswith("pjit.py"):
                count += 1

    sys.setprofile(profile)
    try:
        for _ in range(n):
            call()
    finally:
        sys.setprofile(None)
    return count


def _small(x):
    return x * 2.0 + 1.0


def _hoisting(x):
    return x * 2.0 + _BIG[0, :16]


@pytest.mark.parametrize("fn", [_small, _hoisting])
@pytest.mark.parametrize("options", [{}, {"remat": "off"}, {"remat": "auto"}, {"donate": "off"}])
def test_later_calls_take_jaxs_fast_dispatch(fn, options):
    x = jnp.ones(16)
    plain = jax.jit(fn)
    plain(x)
    assert _slow_dispatches(lambda: plain(x)) == 0  # (the premise: jax.jit's own calls)
    fast = autoopt.optimize(fn, **options)
    fast(x)
    fast(x)
    assert _slow_dispatches(lambda: fast(x)) == 0


def test_a_donating_loop_takes_jaxs_fast_dispatch():
    step = autoopt.optimize(_small)
    x = jnp.ones(1024)
    for _ in range(3):  # the site's first calls: proven, compiled
        x = step(x)
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event == "call" and frame.f_code.co_name == "cache_miss":
            count += 1

    sys.setprofile(profile)
    try:
        for _ in range(20):
            x = step(x)
    finally:
        sys.setprofile(None)
    assert count == 0
    want = np.float32(1.0)
    for _ in range(23):
        want = want * np.float32(2.0) + np.float32(1.0)
    assert float(x[0]) == float(want)
