"""Bad input: each mistake gets a clear error that says what to do, and leaves no partial state.

One row per mistake: how to make it, the exception type, and a substring of the message that
tells the user what to do next. "No partial state" means: a mistake in ``optimize(...)`` builds
nothing and leaves the function untouched; a mistake in a call caches nothing, so the same
optimized function afterwards works (one trace) and the bad call fails the same way again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoopt
from autoopt.testing import assert_trees_equivalent

X = jnp.arange(3.0)


def scale(x):
    return x * 2.0


def counts_steps(x):
    yield x


def returns_string(x):
    return {"value": x, "label": "hello"}


def power(x, n):
    return x ** len(n)


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    make: Callable[[], object]  # performs the mistake
    error: type
    says: str  # what the message tells the user to do
    at_call: bool = False  # the mistake shows at call time (else when optimize() is called)


ROWS = [
    Row(
        "non-callable",
        lambda: autoopt.optimize(3),
        TypeError,
        "Use it as a decorator (@autoopt.optimize) or call autoopt.optimize(my_function)",
    ),
    Row(
        "generator function",
        lambda: autoopt.optimize(counts_steps),
        TypeError,
        "Optimize the per-step function it calls instead",
    ),
    Row(
        "function returning strings",
        lambda: autoopt.optimize(returns_string)(X),
        TypeError,
        "Return only arrays",
        at_call=True,
    ),
    Row(
        "unhashable static argument (jax's own error)",
        lambda: autoopt.optimize(power, static_argnums=1)(X, [1, 2]),
        ValueError,
        "Non-hashable static arguments are not supported",
        at_call=True,
    ),
    Row(
        "donate argnum out of range",
        lambda: autoopt.optimize(scale, donate_argnums=3),
        ValueError,
        "Pass positions from 0 to 0, or name the arguments with donate_argnames=",
    ),
    Row(
        "donate='off' with donate_argnums",
        lambda: autoopt.optimize(scale, donate="off", donate_argnums=0),
        ValueError,
        "Give one: drop donate_argnums to keep donate='off', or drop donate= to donate exactly",
    ),
    Row(
        "donate='auto' with a wrapped jit's donate_argnames",
        lambda: autoopt.optimize(jax.jit(scale, donate_argnames="x"), donate="auto"),
        ValueError,
        "conflicts with donate_arg",
    ),
    Row(
        "memory_budget='lots'",
        lambda: autoopt.optimize(scale, memory_budget="lots"),
        ValueError,
        "Pass bytes (an int) or a string such as '2GB'",
    ),
    Row(
        "unknown remat policy",
        lambda: autoopt.optimize(scale, remat="dots_saveabel"),
        ValueError,
        "Did you mean 'dots_saveable'?",
    ),
    Row(
        "memory_budget as a fraction",
        lambda: autoopt.optimize(scale, memory_budget=0.5),
        ValueError,
        "not a fraction of the original's memory; pass bytes or a string like '2GB'",
    ),
    Row(
        "memory_budget=inf",
        lambda: autoopt.optimize(scale, memory_budget=float("inf")),
        ValueError,
        "or None for no budget",
    ),
    Row(
        "memory_budget=nan",
        lambda: autoopt.optimize(scale, memory_budget=float("nan")),
        ValueError,
        "pass bytes (a finite number)",
    ),
    Row(
        "memory_budget='0MB'",
        lambda: autoopt.optimize(scale, memory_budget="0MB"),
        ValueError,
        "must be at least one byte",
    ),
    Row(
        "memory_budget with remat='off'",
        lambda: autoopt.optimize(scale, remat="off", memory_budget="1GB"),
        ValueError,
        "drop one of the two",
    ),
    Row(
        "remat given the policy object",
        lambda: autoopt.optimize(scale, remat=jax.checkpoint_policies.dots_saveable),
        ValueError,
        "or remat='dots_saveable'",
    ),
    Row(
        "unknown option name",
        lambda: autoopt.optimize(scale, donte="auto"),
        TypeError,
        "Did you mean 'donate'?",
    ),
    Row(
        "unknown option name, decorator form",
        lambda: autoopt.optimize(remat_polcy="auto"),
        TypeError,
        "Did you mean 'remat'?",
    ),
    Row(
        "unknown donation policy",
        lambda: autoopt.optimize(scale, donate="yes"),
        ValueError,
        "Use 'safe'",
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_bad_input_gets_a_clear_error_that_says_what_to_do(row):
    with pytest.raises(row.error) as info:
        row.make()
    assert row.says in str(info.value), str(info.value)


@pytest.mark.parametrize("row", [r for r in ROWS if not r.at_call], ids=lambda r: r.name)
def test_a_bad_option_builds_nothing_and_leaves_the_function_untouched(row):
    before = dict(scale.__dict__)
    with pytest.raises(row.error):
        row.make()
    assert scale.__dict__ == before
    assert_trees_equivalent(jax.jit(scale)(X), autoopt.optimize(scale, fallback="raise")(X))


def test_a_call_returning_strings_caches_nothing_and_the_function_still_works():
    traces = []

    def sometimes_string(x, as_text):
        traces.append(as_text)
        return "text" if as_text else x + 1

    fast = autoopt.optimize(sometimes_string, static_argnums=1, fallback="raise")
    for _ in range(2):  # fails the same way each time: no broken program was cached
        with pytest.raises(TypeError, match="not a valid JAX type"):
            fast(X, True)
    traces.clear()
    assert_trees_equivalent(X + 1, fast(X, False))
    assert_trees_equivalent(X + 1, fast(X, False))
    assert traces == [False]


def test_an_unhashable_static_argument_caches_nothing_and_the_function_still_works():
    fast = autoopt.optimize(power, static_argnums=1, fallback="raise")
    for _ in range(2):
        with pytest.raises(ValueError, match="Non-hashable static arguments"):
            fast(X, [1, 2])
    assert_trees_equivalent(X**2, fast(X, (1, 2)))


def test_a_non_array_leaf_is_static_when_immutable_and_refused_clearly_when_not():
    traces = []

    def f(x, label):
        traces.append(label)
        return x * 2.0

    tag = object()
    fast = autoopt.optimize(f, fallback="raise")
    assert_trees_equivalent(X * 2.0, fast(X, {"tag": tag}))  # as equinox.filter_jit does
    assert_trees_equivalent(X * 2.0, fast(X, {"tag": tag}))
    assert len(traces) == 1
    with pytest.raises(TypeError, match="not a valid JAX type.*static_argnums"):
        fast(X, {"tag": bytearray(b"x")})  # mutable: a static copy would go stale


@pytest.mark.parametrize("budget", [np.int64(2**30), np.float32(2**30)], ids=["int64", "float32"])
def test_a_numpy_number_is_a_memory_budget_as_the_python_number_is(budget):
    # (a size computed with NumPy was refused: "got int64")
    fast = autoopt.optimize(scale, memory_budget=budget)
    np.testing.assert_array_equal(fast(X), X * 2.0)
