"""Donation: what is provably dead after the call is donated; nothing else ever is."""

from __future__ import annotations

import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoopt
from autoopt.passes.donation import donatable_args, match_donations
from autoopt.testing import assert_trees_equivalent

# autoopt must never trigger jax's "Some donated buffers were not usable" warning.
pytestmark = pytest.mark.filterwarnings("error:Some donated buffers")


def _state():
    return {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(4), "n": jnp.int32(0)}


def _step(state, batch):
    return {"w": state["w"] * 0.5 + batch.sum(), "b": state["b"] - batch.mean(), "n": state["n"] + 1}


def _leaves(tree):
    return jax.tree_util.tree_leaves(tree)


def _pointers(tree):
    return [x.unsafe_buffer_pointer() for x in _leaves(tree)]


def test_rebinding_loop_donates_and_gives_the_same_values():
    step = autoopt.optimize(_step)
    batches = [jnp.full((2, 2), float(i)) for i in range(4)]
    expected = _state()
    for b in batches:
        expected = jax.jit(_step)(expected, b)

    state = _state()
    state = step(state, batches[0])
    # Holding the old leaves would (rightly) block donation, so watch their buffers instead:
    # donated buffers are reused in place by the outputs.
    pointers = _pointers(state)
    for b in batches[1:]:
        state = step(state, b)
        assert _pointers(state) == pointers
    assert_trees_equivalent(expected, state, exact=True)


def test_result_bound_to_another_name_is_not_donated():
    step = autoopt.optimize(_step)
    state = step(_state(), jnp.ones((2, 2)))
    new = step(state, jnp.ones((2, 2)))
    assert not any(x.is_deleted() for x in _leaves(state))
    assert float(state["w"].sum()) != float(new["w"].sum())


def test_argument_kept_in_a_list_is_not_donated():
    step = autoopt.optimize(_step)
    state = step(_state(), jnp.ones((2, 2)))
    history = []
    history.append(state)
    state = step(state, jnp.ones((2, 2)))
    assert not any(x.is_deleted() for x in _leaves(history[0]))


def test_leaf_referenced_elsewhere_keeps_the_whole_argument():
    step = autoopt.optimize(_step)
    state = step(_state(), jnp.ones((2, 2)))
    w = state["w"]
    state = step(state, jnp.ones((2, 2)))
    assert not w.is_deleted()


def test_inner_container_referenced_elsewhere_is_not_donated():
    def f(s):
        return {"p": {"a": s["p"]["a"] + 1}}

    fast = autoopt.optimize(f)
    s = fast({"p": {"a": jnp.ones(3)}})
    p = s["p"]
    s = fast(s)
    assert not p["a"].is_deleted()


def test_tuple_unpacking_donates_every_rebound_name():
    def update(params, opt, g):
        return params - 0.1 * opt, opt * 0.9 + g

    fast = autoopt.optimize(update)
    g = jnp.ones(5)
    params, opt = fast(jnp.ones(5), jnp.zeros(5), g)
    before = _pointers((params, opt))
    params, opt = fast(params, opt, g)
    # The old arrays were donated: their buffers now back the new outputs (aliased in place).
    assert sorted(before) == sorted(_pointers((params, opt)))
    assert not g.is_deleted()  # g is not rebound


def test_keyword_arguments_are_donated_by_name():
    step = autoopt.optimize(_step)
    state = step(_state(), jnp.ones((2, 2)))
    pointer = state["w"].unsafe_buffer_pointer()
    b = jnp.ones((2, 2))
    state = step(state=state, batch=b)
    assert state["w"].unsafe_buffer_pointer() == pointer
    assert not b.is_deleted()


def test_same_array_twice_is_never_donated():
    def f(a, b):
        return a + b, a - b

    fast = autoopt.optimize(f)
    x = fast(jnp.ones(3), jnp.ones(3))[0]
    a = x
    del x
    a, b = fast(a, a)
    np.testing.assert_array_equal(a, 4 * np.ones(3))
    np.testing.assert_array_equal(b, np.zeros(3))


def test_shared_leaf_across_arguments_is_not_donated():
    def f(s, t):
        return {"x": s["x"] * 2}, t["x"] + 1

    fast = autoopt.optimize(f)
    shared = jnp.ones(3) + 0
    s, t = {"x": shared}, {"x": shared}
    del shared
    s, out = fast(s, t)
    assert not t["x"].is_deleted()
    np.testing.assert_array_equal(out, 2 * np.ones(3))


def test_inline_expression_arguments_are_not_donated():
    step = autoopt.optimize(lambda x: x + 1)
    x = jnp.ones(3) + 0
    y = x
    x = step(x * 1)
    assert not y.is_deleted()


def test_calls_from_lambdas_and_comprehensions_do_not_donate():
    step = autoopt.optimize(lambda x: x + 1)
    xs = [jnp.ones(2) + i for i in range(3)]
    ys = [step(x) for x in xs]
    assert not any(x.is_deleted() for x in xs)
    f = lambda x: step(x)  # noqa: E731
    z = xs[0]
    z2 = f(z)
    assert not z.is_deleted() and z2 is not None and ys


def test_numpy_and_scalar_arguments_are_never_donated():
    step = autoopt.optimize(lambda x, s: (x + s, s * 2))
    x = np.ones(3, np.float32)
    s = 2.0
    x, s = step(x, s)
    np.testing.assert_array_equal(x, 3 * np.ones(3))


def test_argument_without_matching_output_is_not_donated_and_jax_does_not_warn():
    def f(x, y):
        return x.sum(), y * 2  # x has no output of its shape

    fast = autoopt.optimize(f)
    x, y = jnp.ones((4, 4)) + 0, jnp.ones(3) + 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x, y = fast(x, y)
    assert float(x) == 16.0


def test_partially_aliasable_argument_is_not_donated():
    def f(s):
        return {"a": s["a"] + 1}, s["b"].sum()  # s["b"] has no output of its shape

    fast = autoopt.optimize(f)
    s = {"a": jnp.ones(3) + 0, "b": jnp.ones(5) + 0}
    b = s["b"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s, total = fast(s)
    assert not b.is_deleted() and float(total) == 5.0


def test_nothing_is_donated_under_grad_vmap_or_outer_jit():
    def f(x):
        return x * 2.0

    fast = autoopt.optimize(f)

    def under_grad(x):
        x = fast(x)
        return x.sum()

    x = jnp.ones(3) + 0
    jax.grad(under_grad)(x)
    jax.vmap(under_grad)(jnp.stack([x, x]))
    jax.jit(under_grad)(x)
    assert not x.is_deleted()


def test_debug_nans_disables_donation():
    fast = autoopt.optimize(lambda x: x + 1)
    x = jnp.ones(3) + 0
    keep = [x.unsafe_buffer_pointer()]
    with jax.debug_nans(True):
        y = x
        del x
        y = fast(y)
    assert y.unsafe_buffer_pointer() != keep[0]


def test_calls_from_threads_donate_independently():
    fast = autoopt.optimize(lambda x: x + 1)
    errors = []

    def worker(seed):
        try:
            x = jnp.full(4, float(seed))
            for _ in range(20):
                x = fast(x)
            np.testing.assert_array_equal(x, np.full(4, seed + 20.0))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors


def test_auto_policy_donates_every_aliasable_argument_and_only_those():
    def f(x, y):
        return x + 1, y.sum()

    fast = autoopt.optimize(f, donate="auto")
    x, y = jnp.ones(3) + 0, jnp.ones(4) + 0
    xs, ys = x, y
    fast(x, y)
    assert xs.is_deleted() and not ys.is_deleted()


def test_off_policy_never_donates():
    fast = autoopt.optimize(lambda x: x + 1, donate="off")
    x = jnp.ones(3) + 0
    pointer = x.unsafe_buffer_pointer()
    x = fast(x)
    assert x.unsafe_buffer_pointer() != pointer


def test_explicit_donate_argnums_mean_what_jax_jit_means():
    fast = autoopt.optimize(lambda x, y: (x + 1, y + 1), donate_argnums=(1,))
    x, y = jnp.ones(3) + 0, jnp.ones(3) + 0
    fast(x, y)
    assert not x.is_deleted() and y.is_deleted()


def test_explain_confirms_aliasing_with_memory_analysis():
    step = autoopt.optimize(_step)
    report = step.explain(_state(), jnp.ones((2, 2)))
    donate = [f for f in report.by_kind("donate") if f.details.get("aliasable")]
    assert donate and donate[0].bytes_saved == 12 * 4 + 4 * 4 + 4
    assert report.memory["after"]["alias_bytes"] == donate[0].bytes_saved
    assert report.memory["before"]["alias_bytes"] == 0


def test_report_says_why_an_argument_was_not_donated():
    step = autoopt.optimize(_step)
    state = step(_state(), jnp.ones((2, 2)))
    new = step(state, jnp.ones((2, 2)))
    print(state["w"].sum(), new)
    report = step.explain(state, jnp.ones((2, 2)))
    msgs = [f.message for f in report.by_kind("donate") if not f.applied]
    assert any("`state` is used again on line" in m for m in msgs), msgs


def test_matching_follows_jax_order_one_input_per_output():
    f32 = jax.ShapeDtypeStruct((3,), jnp.float32)
    i32 = jax.ShapeDtypeStruct((3,), jnp.int32)
    assert match_donations([f32, f32, i32], [f32, i32], [True, True, True]) == {0: 0, 2: 1}
    chosen, _ = donatable_args([f32, f32, i32], [f32, i32], ["a", "a", "b"], ["a", "b"])
    assert chosen == {"b"}
    chosen, _ = donatable_args([f32, f32], [f32, f32], [0, 1], [0, 1])
    assert chosen == {0, 1}


def test_auto_policy_donates_containers_whose_parts_are_referenced_elsewhere():
    # Under "auto" the caller promised not to reuse donated arguments: only "safe" counts refs.
    fast = autoopt.optimize(lambda s: {"w": s["w"] + 1}, donate="auto")
    w = jnp.ones(3) + 0
    fast({"w": w})
    assert w.is_deleted()
