"""autoopt's control signals (``FitCheck``, the placer's ``HoistConstants``) stop jax's trace of
the wrapper and reach autoopt's own catcher without jax's traceback filtering, which runs on
every ``Exception`` crossing one of jax's API boundaries and stats files for each frame (about
8 ms per boundary measured where jax sits on a slow filesystem, benchmarks/RESULTS.md). The
user's own errors are still filtered as jax.jit filters them."""

from __future__ import annotations

import importlib
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoopt
from autoopt.testing import assert_trees_equivalent

_tb = importlib.import_module("jax._src.traceback_util")


@pytest.fixture
def filtered(monkeypatch):
    """The exceptions jax's API boundaries filtered while the test ran."""
    seen: list[BaseException] = []
    original = _tb.filter_traceback

    def counting(tb):
        seen.append(tb)
        return original(tb)

    monkeypatch.setattr(_tb, "filter_traceback", counting)
    return seen


def _step(w, x):
    def loss(w):
        h = x
        for _ in range(3):
            h = jnp.tanh(h @ w)
        return (h**2).mean()

    g = jax.grad(loss)(w)
    return w - 0.1 * g, loss(w)


@pytest.mark.parametrize("remat", ["fit", "auto", "off"])
def test_a_first_call_passes_no_exception_through_jax(filtered, remat):
    # residuals of 3 MiB: above remat's gate, so that "auto" measures on the first call too
    w = jax.random.normal(jax.random.key(0), (256, 256)) / 16
    x = jax.random.normal(jax.random.key(1), (1024, 256))
    ref = jax.jit(_step)(w, x)
    opt = autoopt.optimize(_step, remat=remat)
    for _ in range(2):
        assert_trees_equivalent(ref, opt(w, x), exact=True)
    assert filtered == []


def test_hoisting_large_constants_passes_no_exception_through_jax(filtered):
    big = np.random.default_rng(3).standard_normal((512, 1024)).astype(np.float32)  # 2 MiB

    def f(x):
        return jnp.tanh(x @ big).sum(0)

    x = jnp.ones((2, 512))
    ref = jax.jit(f)(x)
    opt = autoopt.optimize(f)
    for _ in range(2):
        assert_trees_equivalent(ref, opt(x), exact=True)
    assert opt.inspect(x).placement.hoisted is not None  # the trace did stop to hoist
    assert filtered == []


def test_the_users_error_is_still_filtered_as_under_jax_jit(filtered):
    def f(x):
        return x + jnp.ones(3)

    with pytest.raises(TypeError) as ours:
        autoopt.optimize(f)(jnp.ones(4))
    assert filtered  # jax's boundary filtered it, as under jax.jit
    files = {fr.filename for fr in traceback.extract_tb(ours.value.__traceback__)}
    assert not any("/autoopt/_jit/" in name for name in files)
