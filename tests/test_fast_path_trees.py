"""The cached plan of a rebinding call site whose state is a plain dict, list or tuple of arrays
(``callsite.shallow_signature``: the signature read off the containers, the reference counts
alone proving the state the call's only holder) donates exactly when the general path would:
never an array another name, container or argument still holds (issue 15 item 7 made this
path cheaper; these are the holes a cheaper check could open)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import autoopt


def decay(s):
    return jax.tree_util.tree_map(lambda a: a * 0.5, s)


def decay_with(s, w):
    return jax.tree_util.tree_map(lambda a: a * 0.5 + w, s)


STATES = {
    "dict": lambda: {f"p{i}": jnp.full(4, float(i + 1)) for i in range(6)},
    "list": lambda: [jnp.full(4, float(i + 1)) for i in range(6)],
    "tuple": lambda: tuple(jnp.full(4, float(i + 1)) for i in range(6)),
}


def _leaf(s, i):
    return list(s.values())[i] if isinstance(s, dict) else s[i]


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
