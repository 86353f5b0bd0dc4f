"""Pytrees with non-array leaves (an equinox module's activation function, a config string)
are donated at a rebinding call site exactly as the same call with array leaves only
(issue 15 item 6), and not where another holder exists."""

from __future__ import annotations

import dataclasses
import sys
import textwrap
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


# --- a repeating call: the plan its call site keeps for the signature (issue: equinox direct) --


def _mlp_step():
    """``test_equinox_plans``' loop: an equinox MLP (its activation functions are static leaves)
    + adam, ``model, opt_state, loss = step(model, opt_state, x, y)``: its step and init."""
    pytest.importorskip("equinox")
    pytest.importorskip("optax")
    from tests.test_equinox_plans import _init, _step

    return _step, _init


_X, _Y = jnp.linspace(-1.0, 1.0, 64).reshape(16, 4), jnp.linspace(1.0, 0.0, 64).reshape(16, 4)


def _loop(fn, init, steps: int, at=None):
    """``steps`` steps of the MLP loop, from one call site; ``at(i, model)`` runs before step
    ``i`` and returns the model to go on with and anything to keep (held while the step runs);
    returns the final state, the loss, what was kept and each step's donation (whether the new
    model lives in the old one's buffers)."""
    model, opt_state = init()
    kept, reused = [], []
    for i in range(steps):
        held = None
        if at is not None:
            model, held = at(i, model)
        before = _pointers((model, opt_state))
        model, opt_state, loss = fn(model, opt_state, _X, _Y)
        reused.append(_pointers((model, opt_state)) == before)
        kept.append(held)
        del held
    return (model, opt_state), loss, kept, reused


def _same_as_filter_jit(step, init, steps, at=None):
    """The loop under ``autoopt.optimize`` and under ``eqx.filter_jit``: bit-identical final
    states and losses; returns the optimized loop's kept values and donations."""
    eqx = pytest.importorskip("equinox")
    fast = autoopt.optimize(step, fallback="raise")
    state, loss, kept, reused = _loop(fast, init, steps, at)
    ref_state, ref_loss, _, _ = _loop(eqx.filter_jit(step), init, steps, at)
    assert_trees_equivalent(
        eqx.filter(ref_state, eqx.is_array), eqx.filter(state, eqx.is_array), exact=True
    )
    np.testing.assert_array_equal(np.asarray(loss), np.asarray(ref_loss))
    return state, kept, reused


def test_a_repeating_equinox_step_donates_on_every_call_and_matches_filter_jit():
    step, init = _mlp_step()
    (model, _), _, reused = _same_as_filter_jit(step, init, 6)
    assert reused == [True] * 6
    assert model.activation is jax.nn.relu


def test_a_held_reference_to_the_old_model_is_never_deleted_in_a_repeating_loop():
    step, init = _mlp_step()
    eqx = pytest.importorskip("equinox")

    def hold(i, model):
        # after the site has a plan: the loop holds the model it passes (as ``old = model``)
        return model, (model, eqx.filter(model, eqx.is_array)) if i in (3, 4) else None

    _, kept, reused = _same_as_filter_jit(step, init, 6, hold)
    assert reused == [True, True, True, False, False, True]
    for model, values in (kept[3], kept[4]):
        leaves = jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))
        assert not any(x.is_deleted() for x in leaves)
        assert_trees_equivalent(jax.tree_util.tree_leaves(values), leaves, exact=True)


def test_an_alias_of_one_leaf_is_never_deleted_in_a_repeating_loop():
    step, init = _mlp_step()

    def alias(i, model):
        return model, model.layers[1].bias if i == 3 else None

    _, kept, reused = _same_as_filter_jit(step, init, 6, alias)
    assert not kept[3].is_deleted()
    assert reused[3] is False and reused[4] is True
    np.asarray(kept[3])  # still readable


def test_a_changed_activation_between_calls_runs_its_own_program():
    step, init = _mlp_step()
    eqx = pytest.importorskip("equinox")

    def swap(i, model):
        if i == 3:  # a site with a plan for relu now passes tanh, then relu again
            model = eqx.tree_at(lambda m: m.activation, model, jnp.tanh)
        if i == 5:
            model = eqx.tree_at(lambda m: m.activation, model, jax.nn.relu)
        return model, None

    (model, _), _, reused = _same_as_filter_jit(step, init, 7, swap)
    assert model.activation is jax.nn.relu
    assert reused[4] is True and reused[6] is True


@dataclasses.dataclass(frozen=True)
class _Scale:
    """A frozen dataclass static leaf whose own ``__eq__`` and ``__hash__`` see no field."""

    factor: float

    def __call__(self, x):
        return self.factor * x

    def __eq__(self, other):
        return isinstance(other, _Scale)

    def __hash__(self):
        return 0


def test_a_mutated_static_leaf_equal_by_its_own_eq_is_not_the_cached_one():
    def f(state: State, x):
        return state._replace(w=state.act(state.w) + x)

    fast = autoopt.optimize(f, fallback="raise")
    scale = _Scale(2.0)
    state = State(jnp.ones(4), jnp.zeros(4), scale, "s")
    expected = np.ones(4, np.float32)
    for i in range(6):
        if i == 3:
            object.__setattr__(scale, "factor", 3.0)  # the same object, a new value
        if i == 4:
            state = state._replace(act=_Scale(5.0))  # equal to the last by its own __eq__
        state = fast(state, jnp.ones(4))
        expected = state.act.factor * expected + 1.0
        np.testing.assert_array_equal(np.asarray(state.w), expected)


def test_a_result_that_does_not_unpack_into_the_targets_donates_nothing():
    def f(state: State, x):
        return sgd(state, x), jnp.sum(state.w), 1.0  # three values

    fast = autoopt.optimize(f, fallback="raise")
    state, x = _state(), jnp.ones((8, 4))
    for _ in range(3):
        with pytest.raises(ValueError, match="too many values to unpack"):
            state, loss = fast(state, x)  # the names keep the old state: it must stay alive
        assert not state.w.is_deleted()
    np.testing.assert_array_equal(np.asarray(state.w), np.full((4, 4), 0.5))


def test_a_repeating_call_with_static_leaves_takes_the_site_plan_not_the_general_path():
    step, init = _mlp_step()
    fast = autoopt.optimize(step, fallback="raise")
    model, opt_state = init()
    frames: list[str] = []

    def profile(frame, event, arg):
        if event == "call" and "autoopt" in frame.f_code.co_filename:
            frames.append(frame.f_code.co_name)

    for i in range(4):
        if i == 3:
            sys.setprofile(profile)
        try:
            model, opt_state, loss = fast(model, opt_state, _X, _Y)
        finally:
            sys.setprofile(None)
    assert "split_if_static" not in frames and "dispatch" not in frames, frames
    assert "run_static_leaf_plan" in frames, frames


_BOTH_PATHS_LOOP = """
    import jax, jax.numpy as jnp, numpy as np
    import equinox as eqx

    import autoopt
    from tests.test_equinox_plans import X, Y, _init, _step

    def loop(fn):
        model, opt_state = _init()
        held, alias, out = None, None, []
        for i in range(8):
            if i == 3:
                held = model
            if i == 4:
                alias = model.layers[0].weight
            if i == 5:
                model = eqx.tree_at(lambda m: m.activation, model, jnp.tanh)
            model, opt_state, loss = fn(model, opt_state, X, Y)
            out.append(float(loss))
        alive = not any(a.is_deleted() for a in array_leaves((held, alias)))
        return out, alive, [np.asarray(a) for a in array_leaves((model, held))]

    def array_leaves(tree):
        return jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array))

    got, alive, arrays = loop(autoopt.optimize(_step))
    want, _, ref = loop(eqx.filter_jit(_step))
    same = got == want and all(np.array_equal(a, b) for a, b in zip(arrays, ref))
    print(alive, same)
"""


@pytest.mark.parametrize("native", [True, False], ids=["c-path", "python-path"])
def test_a_repeating_equinox_loop_on_the_c_and_python_call_paths(native, tmp_path):
    pytest.importorskip("equinox")
    pytest.importorskip("optax")
    from tests.test_native_call_path import _run

    # run from a file: the call site's proof reads the statement's source
    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent(_BOTH_PATHS_LOOP))
    assert _run(f"import runpy; runpy.run_path({str(script)!r})", native).split() == [
        "True",
        "True",
    ]
