"""The cached plan of a rebinding call site whose state is a plain dict, list or tuple of arrays
(``callsite.nested_signature``: the signature read off the containers, the reference counts
alone proving the state the call's only holder) donates exactly when the general path would:
never an array another name, container or argument still holds (issue 15 item 7 made this
path cheaper; these are the holes a cheaper check could open)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import pytest

import autoopt


def decay(s):
    return jax.tree_util.tree_map(lambda a: a * 0.5, s)


def decay_with(s, w):
    return jax.tree_util.tree_map(lambda a: a * 0.5 + w, s)


class AdamLike(NamedTuple):  # an optax state's shape: a count, then dicts of moments
    count: jax.Array
    mu: dict
    nu: dict


class Empty(NamedTuple):  # optax's EmptyState: a node without leaves
    pass


def _f(v: float) -> jax.Array:
    return jnp.full(4, v)


STATES = {
    "dict": lambda: {f"p{i}": _f(i + 1.0) for i in range(6)},
    "list": lambda: [_f(i + 1.0) for i in range(6)],
    "tuple": lambda: tuple(_f(i + 1.0) for i in range(6)),
    # Nested states: the check is the reference counts of every part (``callsite.shared_parts``,
    # and ``shared_walk`` in the C call path).
    "nested": lambda: {
        "a": {"x": _f(1), "y": _f(2)},
        "b": [_f(3), _f(4)],
        "c": (_f(5), {"z": _f(6)}),
    },
    "optax-like": lambda: (
        AdamLike(_f(1), {"p": _f(2), "q": _f(3)}, {"p": _f(4), "q": _f(5)}),
        Empty(),
        _f(6),
    ),
}


def _leaf(s, i):
    return jax.tree_util.tree_leaves(s)[i]


def _pointer(x) -> int:
    return x.unsafe_buffer_pointer()


@pytest.mark.parametrize("kind", sorted(STATES))
def test_a_warm_rebinding_site_donates_the_state(kind):
    fast = autoopt.optimize(decay, fallback="raise")
    s = STATES[kind]()
    for _ in range(4):
        before = _pointer(_leaf(s, 0))
        s = fast(s)
    assert _pointer(_leaf(s, 0)) == before  # the new state lives in the old one's buffers
    assert float(_leaf(s, 1)[0]) == 2.0 / 16


@pytest.mark.parametrize("kind", sorted(STATES))
def test_a_leaf_held_by_another_name_at_a_warm_site_is_not_deleted(kind):
    fast = autoopt.optimize(decay, fallback="raise")
    s = STATES[kind]()
    kept = []
    for i in range(6):
        kept.append(_leaf(s, i % 6))  # the site is warm by the second iteration
        s = fast(s)
    for i, k in enumerate(kept):
        assert not k.is_deleted()
        assert float(k[0]) == (i % 6 + 1) / 2.0**i


def test_a_state_list_held_by_another_name_at_a_warm_site_is_not_deleted():
    fast = autoopt.optimize(decay, fallback="raise")
    outer = [jnp.ones(4), jnp.ones(4)]
    for _ in range(3):
        outer = fast(outer)
    alias = outer
    outer = fast(outer)
    assert not alias[0].is_deleted() and float(alias[0][0]) == 0.125
    assert float(outer[0][0]) == 0.0625


def test_a_leaf_also_passed_as_another_argument_at_a_warm_site_is_not_deleted():
    fast = autoopt.optimize(decay_with, fallback="raise")
    s, w = STATES["dict"](), jnp.zeros(4)
    for _ in range(3):
        s = fast(s, w)
    w = s["p2"]  # now an array of the state is the second argument too
    s = fast(s, w)
    assert not w.is_deleted()
    assert float(w[0]) == 3.0 / 8
    assert float(s["p2"][0]) == 3.0 / 16 + 3.0 / 8


def test_an_array_twice_in_the_state_at_a_warm_site_is_not_donated():
    fast = autoopt.optimize(decay, fallback="raise")
    s = STATES["list"]()
    for _ in range(3):
        s = fast(s)
    s = [s[0], s[0], *s[2:]]  # the list holds one array twice
    s = fast(s)
    assert float(s[0][0]) == float(s[1][0]) == 1.0 / 16


def test_a_deleted_leaf_at_a_warm_site_raises_jax_error_and_deletes_nothing_else():
    fast = autoopt.optimize(decay, fallback="raise")
    s = STATES["dict"]()
    for _ in range(3):
        s = fast(s)
    others = {k: v for k, v in s.items() if k != "p3"}
    s["p3"].delete()
    with pytest.raises(RuntimeError, match="deleted"):
        s = fast(s)
    assert not any(v.is_deleted() for v in others.values())
    assert float(others["p0"][0]) == 1.0 / 8


@pytest.mark.parametrize(
    "kind, part",
    [
        ("nested", lambda s: s["a"]),
        ("nested", lambda s: s["c"]),
        ("optax-like", lambda s: s[0].mu),
        ("optax-like", lambda s: s[0]),
    ],
)
def test_a_nested_part_held_by_another_name_at_a_warm_site_is_not_deleted(kind, part):
    fast = autoopt.optimize(decay, fallback="raise")
    s = STATES[kind]()
    for _ in range(3):
        s = fast(s)  # warm: the plan of this signature is cached
    held = part(s)
    values = [float(x[0]) for x in jax.tree_util.tree_leaves(held)]
    s = fast(s)
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(held))
    assert [float(x[0]) for x in jax.tree_util.tree_leaves(held)] == values
    before = _pointer(_leaf(s, 0))
    del held
    s = fast(s)  # nothing else holds it now: donated again
    assert _pointer(_leaf(s, 0)) == before


def test_a_deleted_leaf_of_a_nested_state_at_a_warm_site_raises_and_deletes_nothing_else():
    fast = autoopt.optimize(decay, fallback="raise")
    s = STATES["optax-like"]()
    for _ in range(3):
        s = fast(s)
    s[0].mu["q"].delete()
    others = [x for x in jax.tree_util.tree_leaves(s) if not x.is_deleted()]
    with pytest.raises(RuntimeError, match="deleted"):
        s = fast(s)
    assert not any(x.is_deleted() for x in others)
