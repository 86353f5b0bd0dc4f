"""Donation under the default ("safe") where the caller keeps a way to the arrays that no
reference count of the donated node or of its arrays shows (hostile review, 2026-12-07).

- A registered node whose flatten reads its arrays through a holder of another kind than a
  plain dict, list or tuple (an object of the user's, a deque, an OrderedDict, a
  SimpleNamespace), with the caller keeping the holder: ``pool = state.pool``.
- A result unpacked by the class's own ``__iter__`` (``a, b = g(a, b)`` returning a NamedTuple
  that defines one): user code between the call and the store, which may raise.

Each failed before the fix, with the caller's arrays deleted; jax.jit keeps them.
"""

from __future__ import annotations

import collections
import functools
import types
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoopt


class Pool:  # a plain holder, not a pytree
    def __init__(self, arrays):
        self.arrays = arrays

    def get(self):
        return self.arrays


class Slotted:  # a slot and a __dict__: both are attributes
    __slots__ = ("arrays", "__dict__")

    def __init__(self, arrays):
        self.arrays = arrays


HOLDERS = {
    "object": (lambda arrs: Pool(list(arrs)), lambda h: list(h.arrays)),
    "OrderedDict": (
        lambda arrs: collections.OrderedDict((str(i), a) for i, a in enumerate(arrs)),
        lambda h: list(h.values()),
    ),
    "defaultdict": (
        lambda arrs: collections.defaultdict(int, {str(i): a for i, a in enumerate(arrs)}),
        lambda h: list(h.values()),
    ),
    "deque": (collections.deque, list),
    "SimpleNamespace": (lambda arrs: types.SimpleNamespace(items=list(arrs)), lambda h: h.items),
    # the flatten hands back the holder's own list: stored, but not by the node
    "object, its list": (lambda arrs: Pool(list(arrs)), lambda h: h.arrays),
    # holders the first fix missed (the second review)
    "slots and a dict": (lambda arrs: Slotted(list(arrs)), lambda h: list(h.arrays)),
    "closure": (lambda arrs: lambda kept=list(arrs): kept, lambda h: list(h())),
    "bound method": (lambda arrs: Pool(list(arrs)).get, lambda h: list(h())),
    "functools.partial": (
        lambda arrs: functools.partial(lambda kept: kept, list(arrs)),
        lambda h: list(h()),
    ),
    "mapping proxy": (
        lambda arrs: types.MappingProxyType({str(i): a for i, a in enumerate(arrs)}),
        lambda h: list(h.values()),
    ),
}


@pytest.mark.parametrize("kind", list(HOLDERS))
@pytest.mark.parametrize("wrap", ["jit", "optimize"])
def test_a_holder_the_caller_keeps_is_not_deleted(kind, wrap):
    make, values = HOLDERS[kind]

    class State:
        def __init__(self, arrays):
            self.held = make(arrays)

    jax.tree_util.register_pytree_node(
        State, lambda s: (values(s.held), None), lambda _, kids: State(list(kids))
    )
    fn = lambda s: State([a * 2 + 1 for a in values(s.held)])  # noqa: E731
    step = jax.jit(fn) if wrap == "jit" else autoopt.optimize(fn)

    def loop():
        state = State([jnp.zeros(256), jnp.ones(256)])
        kept = state.held  # the caller keeps a way to the old arrays
        state = step(state)
        state = step(state)
        return kept, state

    kept, state = loop()
    assert [np.asarray(a)[0].item() for a in values(kept)] == [0.0, 1.0]
    assert [np.asarray(a)[0].item() for a in values(state.held)] == [3.0, 7.0]


class Pair(NamedTuple):
    a: jax.Array
    b: jax.Array

    def __iter__(self):  # a logging or validating __iter__: it runs after the call
        raise RuntimeError("Pair is not iterable")


@pytest.mark.parametrize("wrap", ["jit", "optimize"])
def test_a_result_unpacked_by_its_own_iter_keeps_the_arguments(wrap):
    fn = lambda a, b: Pair(a + 1, b + 1)  # noqa: E731
    g = jax.jit(fn) if wrap == "jit" else autoopt.optimize(fn)

    def loop():
        a = jnp.zeros(256)
        b = jnp.full(256, 2.0)
        for _ in range(2):  # the first call and a cached one
            try:
                a, b = g(a, b)
            except RuntimeError:
                pass
        return a, b

    a, b = loop()
    assert not a.is_deleted() and not b.is_deleted()
    assert np.asarray(a)[0] == 0.0 and np.asarray(b)[0] == 2.0


def test_a_plain_tuple_result_is_still_donated():
    """The control: builtin unpacking runs no user code, and the rebound names are donated."""
    g = autoopt.optimize(lambda a, b: (a + 1, b + 1))

    def loop():
        a = jnp.zeros(256)
        b = jnp.zeros(256)
        pointers = (a.unsafe_buffer_pointer(), b.unsafe_buffer_pointer())
        a, b = g(a, b)
        return pointers, (a.unsafe_buffer_pointer(), b.unsafe_buffer_pointer())

    before, after = loop()
    assert before == after  # the outputs reuse the donated buffers
