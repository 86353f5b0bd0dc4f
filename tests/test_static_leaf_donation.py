"""Pytrees with non-array leaves (an equinox module's activation function, a config string)
are donated at a rebinding call site exactly as the same call with array leaves only
(issue 15 item 6), and not where another holder exists."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoopt
from autoopt.testing import assert_trees_equivalent
from benchmarks._harness import Compiles


def _pointers(tree) -> list[int]:
    """Device addresses of the array leaves (ints: holding them keeps nothing alive)."""
    leaves = jax.tree_util.tree_leaves(tree)
    return [x.unsafe_buffer_pointer() for x in leaves if isinstance(x, jax.Array)]


class State(NamedTuple):
    w: jax.Array
    b: jax.Array
    act: Any  # a function: a static leaf
    name: str  # a static leaf


def sgd(state: State, x):
    def loss(w, b):
        return jnp.mean(state.act(x @ w + b) ** 2)

    gw, gb = jax.grad(loss, argnums=(0, 1))(state.w, state.b)
    return state._replace(w=state.w - 0.1 * gw, b=state.b - 0.1 * gb)


def _state():
    return State(jnp.full((4, 4), 0.5, jnp.float32), jnp.zeros(4), jnp.tanh, "layer")


def test_a_pytree_with_static_leaves_is_donated_at_a_rebinding_call():
    fast = autoopt.optimize(sgd, fallback="raise")
    state, ref, x = _state(), _state(), jnp.ones((8, 4))
    for _ in range(3):
        before = _pointers(state)
        state = fast(state, x)
        ref = _plain_sgd(ref, x)
        assert _pointers(state) == before  # the new state lives in the old one's buffers
        assert state.act is jnp.tanh and state.name == "layer"
    assert_trees_equivalent((ref.w, ref.b), (state.w, state.b), exact=True)


def _plain_sgd(state: State, x):
    arrays = jax.jit(lambda w, b: sgd(state._replace(w=w, b=b), x)[:2])(state.w, state.b)
    return state._replace(w=arrays[0], b=arrays[1])


def test_an_alias_of_the_pytree_keeps_it_from_being_donated():
    fast = autoopt.optimize(sgd, fallback="raise")
    state, x = _state(), jnp.ones((8, 4))
    kept = state
    state = fast(state, x)
    np.testing.assert_array_equal(kept.w, np.full((4, 4), 0.5))  # not deleted
    held = [_state()]
    state = held[0]
    state = fast(state, x)
    np.testing.assert_array_equal(held[0].w, np.full((4, 4), 0.5))


def test_one_executable_per_signature_whatever_each_call_donates():
    fast = autoopt.optimize(sgd, fallback="raise")
    state, x = _state(), jnp.ones((8, 4))
    jax.clear_caches()
    with Compiles("sgd") as compiles:
        state = fast(state, x)  # donates: the signature's executable donates the state
        other = fast(_state(), x)  # passes a fresh state: donated too
        kept = state
        state = fast(state, x)  # an alias: runs the same executable on copies
    assert compiles.own == 1
    assert not kept.w.is_deleted() and other.name == "layer"


def test_an_equinox_model_and_its_optax_state_are_donated():
    eqx = pytest.importorskip("equinox")
    optax = pytest.importorskip("optax")
    model = eqx.nn.MLP(8, 8, 32, 2, key=jax.random.key(0))
    tx = optax.adam(1e-3)
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    x, y = jnp.ones((16, 8)), jnp.zeros((16, 8))

    def step(model, opt_state, x, y):
        def loss(m):
            return jnp.mean((jax.vmap(m)(x) - y) ** 2)

        value, g = eqx.filter_value_and_grad(loss)(model)
        updates, opt_state = tx.update(g, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, value

    fast = autoopt.optimize(step, fallback="raise")
    ref = eqx.filter_jit(step)
    ref_model, ref_state, _ = ref(model, opt_state, x, y)
    model, opt_state, loss = fast(model, opt_state, x, y)
    for _ in range(2):
        before = _pointers((model, opt_state))
        model, opt_state, loss = fast(model, opt_state, x, y)
        ref_model, ref_state, ref_loss = ref(ref_model, ref_state, x, y)
        assert _pointers((model, opt_state)) == before
        assert float(loss) == float(ref_loss)
    assert_trees_equivalent(
        eqx.filter(ref_model, eqx.is_array), eqx.filter(model, eqx.is_array), exact=True
    )
