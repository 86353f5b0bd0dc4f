"""Nested signatures: a call whose arguments are plain dicts, lists, tuples and NamedTuples of jax
arrays, scalars, NumPy leaves and None (a model's parameters, an optax state, a batch of NumPy
columns) finds its cached plan by ``callsite.nested_signature``, and the C call path
(``_native.c``) reads the same key and the same reference counts itself.

The C copy must agree with the Python one on every input (else a plan is found for arguments
it was not made for, or a shared part looks unshared): checked here over generated pytrees, and
end to end on the loops where a wrong answer would delete an array the caller still holds."""

from __future__ import annotations

import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import autoopt
from autoopt._jit import _function
from autoopt.passes.donation import callsite

needs_native = pytest.mark.skipif(
    not _function.NATIVE, reason="the C call path is off (not built, or AUTOOPT_NATIVE=0)"
)


class Moments(NamedTuple):  # an optax state's shape: a count, then dicts of moments
    count: jax.Array
    mu: dict
    nu: dict


class Nothing(NamedTuple):  # optax's EmptyState: a node without leaves
    pass


class Registered:  # a node of jax's registry (an equinox module's kind): not a nested signature
    def __init__(self, a):
        self.a = a


jax.tree_util.register_pytree_node(Registered, lambda n: ([n.a], None), lambda _, k: Registered(*k))


class RegisteredTuple(NamedTuple):  # a NamedTuple with a flatten rule of its own
    a: jax.Array


jax.tree_util.register_pytree_node(
    RegisteredTuple, lambda n: ([n.a], None), lambda _, k: RegisteredTuple(*k)
)

ARRAYS = [jnp.zeros(3), jnp.ones((2, 2)), jnp.arange(4, dtype=jnp.int32), jnp.zeros((), bool)]
HOST = [np.zeros(3, np.float32), np.ones((2,), np.int64), np.float32(2.0), np.bool_(True)]

EMPTY = ()  # the empty tuple: one object every holder shares
nested_leaves = st.one_of(
    st.sampled_from(ARRAYS), st.sampled_from(HOST), st.sampled_from([1, 2.5, True, 1j, None, ()])
)
leaves = st.one_of(
    nested_leaves,
    st.sampled_from([object(), "text", Registered(ARRAYS[0]), RegisteredTuple(ARRAYS[1])]),
)


def _nested_nodes(kids):
    return st.one_of(
        st.lists(kids, max_size=4),
        st.lists(kids, max_size=4).map(tuple),
        st.dictionaries(st.sampled_from(["a", "b", "c", "zz"]), kids, max_size=4),
        st.tuples(kids, kids, kids).map(lambda t: Moments(*t)),
        st.just(Nothing()),
    )


def _nodes(kids):  # and dicts whose keys are not all strings: the tree signature's
    return st.one_of(
        _nested_nodes(kids), st.dictionaries(st.sampled_from([1, 2]), kids, max_size=2)
    )


trees = st.recursive(leaves, _nodes, max_leaves=12)
# Only what a nested signature holds, nested at least once (the walk reads nodes).
nested_trees = st.recursive(nested_leaves, _nested_nodes, max_leaves=16).filter(
    lambda t: type(t) in (dict, list, tuple, Moments, Nothing)
)


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.lists(trees, min_size=1, max_size=4).map(tuple))
def test_the_c_key_is_the_python_key(args):
    from autoopt._jit import _native  # pyright: ignore[reportAttributeAccessIssue]

    python = callsite.nested_signature(args)  # (meets the NamedTuple types first, as calls do)
    c = _native.nested_key(args)
    if python is None:
        assert c is None
    else:
        assert c == python[0]
        assert hash(c) == hash(python[0])


def _copy_tree(tree):
    """A fresh copy of every node and array of ``tree`` (leaves other than arrays kept)."""
    return jax.tree_util.tree_map(
        lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x, tree
    )


@needs_native
@settings(max_examples=200, deadline=None)
@given(nested_trees, st.data())
def test_the_c_walk_finds_the_shared_parts_the_python_walk_finds(tree, data):
    from autoopt._jit import _native  # pyright: ignore[reportAttributeAccessIssue]

    state = _copy_tree(tree)
    assert callsite.nested_signature((state,)) is not None
    parts = [p for p in _parts(state) if p is not None and p is not EMPTY and p is not state]
    held = data.draw(st.lists(st.sampled_from(parts), max_size=2)) if parts else []
    python = callsite.shared_parts(state)
    c = _native.shared_walk(state)
    assert c in (0, 1)
    assert c == int(python)
    if any(not isinstance(p, (int, float, complex, bool)) for p in held):
        assert python  # a held container or array is a shared part
    del held


@needs_native
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", ["array", "dict", "list", "moments"])
def test_the_c_walk_finds_a_held_part_at_any_depth(depth, kind):
    from autoopt._jit import _native  # pyright: ignore[reportAttributeAccessIssue]

    def part():
        x = jnp.zeros(2)
        return {
            "array": x,
            "dict": {"x": x},
            "list": [x, None],
            "moments": Moments(x, {}, {"y": jnp.ones(1)}),
        }[kind]

    inner = held = part()
    state = inner
    for level in range(depth):
        state = [state, jnp.ones(1)] if level % 2 else {"s": state, "n": None}
    assert _native.shared_walk(state) == int(callsite.shared_parts(state)) == 1
    del held, inner
    assert _native.shared_walk(state) == int(callsite.shared_parts(state)) == 0


def _parts(tree):
    """Every node and leaf inside ``tree``, itself included."""
    out = [tree]
    if isinstance(tree, dict):
        for v in tree.values():
            out += _parts(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            out += _parts(v)
    return out


def _pointers(tree) -> set[int]:
    return {x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(tree)}


def _adam_state():
    p = {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}
    return p, (Moments(jnp.zeros((), jnp.int32), _copy_tree(p), _copy_tree(p)), Nothing())


def _update(params, opt, batch):
    m, empty = opt
    grads = jax.tree_util.tree_map(lambda w: w * 0.0 + jnp.sum(batch), params)
    mu = jax.tree_util.tree_map(lambda a, g: 0.9 * a + g, m.mu, grads)
    nu = jax.tree_util.tree_map(lambda a, g: 0.99 * a + g * g, m.nu, grads)
    new = jax.tree_util.tree_map(lambda w, a, b: w - 0.1 * a / (1.0 + b), params, mu, nu)
    return new, (Moments(m.count + 1, mu, nu), empty)


@needs_native
def test_an_optax_like_loop_runs_no_python_frame_of_autoopt_and_donates():
    fast = autoopt.optimize(_update)
    expected = jax.jit(_update)

    def loop(n, batch, trace=None):
        params, opt = _adam_state()
        reused = []
        for i in range(n):
            if i == 2 and trace is not None:
                sys.setprofile(trace)
            before = _pointers((params, opt))
            params, opt = fast(params, opt, batch)
            reused.append(len(before & _pointers((params, opt))))
        sys.setprofile(None)
        return params, opt, reused

    batch = jnp.ones(3)
    loop(3, batch)  # the site is proved and its plan made by the Python path
    frames: list[str] = []

    def profile(frame, event, arg):
        if event == "call" and "autoopt" in frame.f_code.co_filename:
            frames.append(frame.f_code.co_name)

    params, opt, reused = loop(6, batch, profile)
    assert frames == [], frames
    # every step's new state lives in the old one's buffers
    assert reused == [len(jax.tree_util.tree_leaves((params, opt)))] * 6
    want = _adam_state()
    for _ in range(6):
        want = expected(*want, batch)
    for got, exp in zip(jax.tree_util.tree_leaves((params, opt)), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(exp))


@pytest.mark.parametrize("part", ["leaf", "moments", "dict", "empty"])
@pytest.mark.parametrize("batch_kind", ["jax", "numpy"])
def test_a_part_held_by_a_name_at_a_warm_site_is_not_deleted(part, batch_kind):
    fast = autoopt.optimize(_update)
    batch = jnp.ones(3) if batch_kind == "jax" else np.ones(3, np.float32)
    params, opt = _adam_state()
    kept = None
    before = []
    for i in range(8):
        if i == 5:  # (no closure over ``opt``: the site stays provable)
            if part == "leaf":
                kept = opt[0].mu["w"]
            elif part == "moments":
                kept = opt[0]
            elif part == "dict":
                kept = opt[0].nu
            else:
                kept = opt[1]
            # copies: a NumPy view of a jax array on CPU would hold the array itself
            before = [np.array(x) for x in jax.tree_util.tree_leaves(kept)]
        params, opt = fast(params, opt, batch)
        if kept is not None:
            after = [np.array(x) for x in jax.tree_util.tree_leaves(kept)]  # raises if deleted
            for a, b in zip(before, after):
                np.testing.assert_array_equal(a, b)
    assert not jax.tree_util.tree_leaves(params)[0].is_deleted()
    assert _reuses_state(fast, batch)  # the site donates when nothing else holds a part


def _reuses_state(fast, batch) -> bool:
    params, opt = _adam_state()
    for _ in range(4):
        before = _pointers((params, opt))
        params, opt = fast(params, opt, batch)
    return before == _pointers((params, opt))


def test_a_numpy_batch_beside_a_donated_state_gives_jax_jits_numbers():
    fast = autoopt.optimize(_update)
    params, opt = _adam_state()
    want = _adam_state()
    rng = np.random.default_rng(0)
    for _ in range(6):
        batch = {"x": rng.standard_normal(3).astype(np.float32), "y": np.float32(1.0)}
        before = _pointers((params, opt))
        params, opt = fast(params, opt, batch["x"] * batch["y"])
        want = jax.jit(_update)(*want, batch["x"] * batch["y"])
    assert before <= _pointers((params, opt))  # the last step donated the whole state
    for got, exp in zip(jax.tree_util.tree_leaves((params, opt)), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(exp))


def test_a_registered_node_in_the_state_still_donates_by_its_tree_signature():
    fast = autoopt.optimize(lambda s: jax.tree_util.tree_map(lambda a: a + 1.0, s))
    state = {"r": Registered(jnp.zeros(3)), "x": jnp.ones(2)}
    for _ in range(4):
        before = _pointers(state)
        state = fast(state)
    assert before == _pointers(state)
    np.testing.assert_array_equal(np.asarray(state["r"].a), np.full(3, 4.0))


def test_dicts_built_in_another_key_order_share_the_executable_and_both_donate():
    fast = autoopt.optimize(lambda s: {k: v * 2.0 for k, v in s.items()})
    for order in (("a", "b"), ("b", "a"), ("a", "b")):
        state = {k: jnp.ones(2) for k in order}
        for _ in range(3):
            before = _pointers(state)
            state = fast(state)
        assert before == _pointers(state)
        np.testing.assert_array_equal(np.asarray(state["a"]), np.full(2, 8.0))
