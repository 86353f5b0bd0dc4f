"""Donation: what is provably dead after the call is donated; nothing else ever is."""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import warnings
from typing import NamedTuple

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
    return {
        "w": state["w"] * 0.5 + batch.sum(),
        "b": state["b"] - batch.mean(),
        "n": state["n"] + 1,
    }


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
    # The table says its "after" assumes a donating call (this one was not a rebinding call).
    assert "the executable a call site that rebinds its arguments runs" in " ".join(
        report.render(color=False).split()
    )


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


# --- the fast path: a call site's cached decision for flat arguments ----------------------------
# After the first call of a signature at a site, later calls take OptimizedFunction.__call__'s
# fast path, which re-checks only the run-time half of the proof. Each test below calls the same
# statement in a loop, so every iteration after the first exercises that path.


def _fast_entries(fast_fn, *args) -> int:
    return fast_fn.inspect(*args).fast_entries


def test_fast_path_keeps_donating_in_a_loop_and_values_match():
    f = autoopt.optimize(lambda x, i: x.at[i].add(1.0))
    x, expected = jnp.zeros((4, 3)), jnp.zeros((4, 3))
    pointer = None
    for i in range(12):
        x = f(x, i % 4)
        expected = jax.jit(lambda x, i: x.at[i].add(1.0))(expected, i % 4)
        pointer = pointer or x.unsafe_buffer_pointer()
        assert x.unsafe_buffer_pointer() == pointer
    assert _fast_entries(f, x, 0) == 1
    np.testing.assert_array_equal(x, expected)


def test_fast_path_refuses_when_a_later_iteration_keeps_another_reference():
    f = autoopt.optimize(lambda x: x * 2)
    x = jnp.ones(3) + 0
    kept = []
    for i in range(6):
        if i == 4:
            kept.append(x)  # from here the old x is still referenced: never donate it
        x = f(x)
    assert _fast_entries(f, x) == 1  # the decision was cached, and still the check refused
    np.testing.assert_array_equal(kept[0], 16 * np.ones(3))
    np.testing.assert_array_equal(x, 64 * np.ones(3))


def test_fast_path_follows_a_change_of_signature():
    f = autoopt.optimize(lambda x: x + 1)
    for shape in [(3,), (3,), (2, 2), (2, 2), (3,)]:
        x = jnp.zeros(shape)
        for _ in range(3):
            x = f(x)
        np.testing.assert_array_equal(x, 3 * np.ones(shape))
    assert _fast_entries(f, x) == 2


def test_fast_path_does_not_donate_an_argument_without_matching_output():
    f = autoopt.optimize(lambda x, y: (x + y).sum())  # scalar output: nothing aliases x
    x = jnp.ones(3) + 0
    for _ in range(4):
        s = f(x, x)
        x = f(x, x) + x  # x rebound in an expression, still read: fine, never donated
    assert not x.is_deleted() and float(s) > 0


def test_fast_path_never_donates_under_debug_nans_switched_on_later():
    f = autoopt.optimize(lambda x: x + 1)
    x = jnp.ones(3) + 0
    for _ in range(3):
        x = f(x)  # the site's decision is cached here
    with jax.debug_nans(True):
        for _ in range(3):
            before = x.unsafe_buffer_pointer()
            x = f(x)
            assert x.unsafe_buffer_pointer() != before
    np.testing.assert_array_equal(x, 7 * np.ones(3))


def test_fast_path_raises_jax_error_on_a_deleted_array():
    f = autoopt.optimize(lambda x: x + 1)
    x = jnp.ones(3) + 0
    for _ in range(3):
        x = f(x)
    x.delete()
    with pytest.raises(RuntimeError, match="deleted"):
        x = f(x)


def test_fast_path_auto_policy_never_donates_the_same_array_twice():
    f = autoopt.optimize(lambda a, b: (a + b, a - b), donate="auto")
    a, b = jnp.ones(3) + 0, jnp.ones(3) + 0
    for _ in range(3):
        a, b = f(a, b)  # distinct arrays: both donated, decision cached
    c = a
    del a
    c, d = f(c, c)  # the same array twice: the fast path must not donate it
    np.testing.assert_array_equal(c, 2 * np.asarray(c) / 2)
    np.testing.assert_array_equal(d, np.zeros(3))


def test_fast_path_with_python_scalar_arguments_matches_jit_and_donates():
    g = lambda x, s, k: x * s + k  # noqa: E731
    f = autoopt.optimize(g)
    x, expected = jnp.ones(4) + 0, jnp.ones(4)
    for j in range(5):
        before = x.unsafe_buffer_pointer()
        x = f(x, 0.5, j)
        expected = jax.jit(g)(expected, 0.5, j)
        assert x.unsafe_buffer_pointer() == before
    np.testing.assert_array_equal(x, expected)


# --- decorated methods ---------------------------------------------------------------------------


class _Trainer:
    """A class whose step is a decorated method; the instance is static (hashable)."""

    lr = 0.5

    @autoopt.optimize(static_argnums=0)
    def step(self, state, batch):
        return _step(state, batch * self.lr)


@dataclasses.dataclass
class _Params:
    """An instance that is itself a pytree of arrays (as equinox modules are)."""

    w: jax.Array

    @autoopt.optimize
    def apply(self, x):
        return x * self.w


jax.tree_util.register_dataclass(_Params, data_fields=["w"], meta_fields=[])


def test_decorated_method_donates_the_state_its_caller_rebinds():
    t = _Trainer()
    batch = jnp.ones((2, 2))
    expected = _state()
    for _ in range(3):
        expected = jax.jit(_step)(expected, batch * 0.5)
    state = t.step(_state(), batch)
    pointers = _pointers(state)
    for _ in range(2):
        state = t.step(state, batch)
        assert _pointers(state) == pointers
    assert_trees_equivalent(expected, state, exact=True)
    state = t.step(state=state, batch=batch)  # by keyword too
    assert _pointers(state) == pointers


def test_decorated_method_keeps_state_that_is_used_again():
    t = _Trainer()
    state = t.step(_state(), jnp.ones((2, 2)))
    new = t.step(state, jnp.ones((2, 2)))  # not rebound
    kept = state
    state = t.step(state, jnp.ones((2, 2)))  # rebound, but `kept` refers to it
    assert not any(x.is_deleted() for x in _leaves(kept))
    assert_trees_equivalent(new, state, exact=True)


def test_method_instance_that_is_a_pytree_is_never_donated():
    p = _Params(jnp.full(3, 2.0))
    x = jnp.ones(3) + 0
    for _ in range(3):
        before = x.unsafe_buffer_pointer()
        x = p.apply(x)
        assert x.unsafe_buffer_pointer() == before  # x, which the caller rebinds, is donated
    assert not p.w.is_deleted()
    np.testing.assert_array_equal(x, 8 * np.ones(3))


# --- the fast path with pytree arguments --------------------------------------------------------


class _Carry(NamedTuple):  # a registered node that is not a plain dict/list/tuple (as optax's)
    w: jax.Array
    n: jax.Array


def test_pytree_fast_path_keeps_donating_and_values_match():
    step = autoopt.optimize(_step)
    batch = jnp.ones((2, 2))
    expected = _state()
    state = step(_state(), batch)
    expected = jax.jit(_step)(expected, batch)
    pointers = _pointers(state)
    for _ in range(6):
        state = step(state, batch)
        expected = jax.jit(_step)(expected, batch)
        assert _pointers(state) == pointers
    assert _fast_entries(step, state, batch) == 1
    assert_trees_equivalent(expected, state, exact=True)


def test_pytree_fast_path_refuses_when_one_leaf_is_held_elsewhere():
    step = autoopt.optimize(_step)
    state = step(_state(), jnp.ones((2, 2)))
    for i in range(5):
        if i == 3:
            w = state["w"]  # one leaf is referenced from outside: keep the whole argument
        state = step(state, jnp.ones((2, 2)))
    assert not w.is_deleted()
    assert _fast_entries(step, state, jnp.ones((2, 2))) == 1


def test_state_with_a_none_entry_is_donated():
    f = autoopt.optimize(lambda s: {"w": s["w"] * 2, "aux": None})
    state = {"w": jnp.ones(3) + 0, "aux": None}
    pointer = state["w"].unsafe_buffer_pointer()
    for _ in range(3):
        state = f(state)
        assert state["w"].unsafe_buffer_pointer() == pointer
    np.testing.assert_array_equal(state["w"], 8 * np.ones(3))


def test_named_tuple_state_is_donated_through_the_registry_path():
    f = autoopt.optimize(lambda c, x: _Carry(c.w + x, c.n + 1))
    carry = _Carry(jnp.zeros(3), jnp.int32(0))
    carry = f(carry, jnp.ones(3))
    pointers = _pointers(carry)
    for _ in range(3):
        carry = f(carry, jnp.ones(3))
        assert _pointers(carry) == pointers
    np.testing.assert_array_equal(carry.w, 4 * np.ones(3))
    assert int(carry.n) == 4


@pytest.mark.parametrize("held", ["field", "dict_in_field", "none"])
def test_a_named_tuple_part_held_elsewhere_is_never_donated(held):
    # an optax state's shape: a tuple of NamedTuples holding dicts of arrays
    class Adam(NamedTuple):
        count: jax.Array
        mu: dict

    f = autoopt.optimize(lambda s: (Adam(s[0].count + 1, {"w": s[0].mu["w"] * 2}), s[1]))
    state = (Adam(jnp.int32(0), {"w": jnp.ones(3) + 0}), ())
    for _ in range(3):
        state = f(state)  # donated: the plan for this signature is cached
    kept = {"field": lambda s: s[0].mu, "dict_in_field": lambda s: s[0].mu["w"]}.get(held)
    outside = kept(state) if kept else None
    pointer = state[0].mu["w"].unsafe_buffer_pointer()
    state = f(state)
    if kept is None:  # nothing else holds it: donated
        assert state[0].mu["w"].unsafe_buffer_pointer() == pointer
    else:
        np.testing.assert_array_equal(jax.tree.leaves(outside)[0], 8 * np.ones(3))
    np.testing.assert_array_equal(state[0].mu["w"], 16 * np.ones(3))


def test_a_named_tuple_registered_with_its_own_flatten_keeps_its_rule():
    # a registration of its own (a field kept as aux data) is the registry's rule, not the
    # tuple's items: read as items, the interned tag would look shared and refuse donation
    class Tagged(NamedTuple):
        w: jax.Array
        tag: str

    jax.tree_util.register_pytree_node(
        Tagged, lambda t: ((t.w,), t.tag), lambda tag, kids: Tagged(kids[0], tag)
    )
    f = autoopt.optimize(lambda t: Tagged(t.w * 2, t.tag))
    t = f(Tagged(jnp.ones(3) + 0, "tag"))
    pointer = t.w.unsafe_buffer_pointer()
    for _ in range(3):
        t = f(t)
        assert t.w.unsafe_buffer_pointer() == pointer
    np.testing.assert_array_equal(t.w, 16 * np.ones(3))


def test_pytree_fast_path_auto_never_donates_a_leaf_shared_between_arguments():
    f = autoopt.optimize(
        lambda s, t: ({"v": s["v"] + t["v"]}, {"v": s["v"] - t["v"]}), donate="auto"
    )
    s, t = {"v": jnp.ones(3) + 0}, {"v": jnp.ones(3) + 0}
    for _ in range(3):
        s, t = f(s, t)  # distinct leaves: donated, decision cached
    shared = {"v": s["v"]}
    s, t = f(s, shared)  # the same array in both arguments
    np.testing.assert_array_equal(t["v"], np.zeros(3))


# --- the call must be to this function, with the arguments as written ---------------------------

_GLOBAL_STEP = autoopt.optimize(lambda x, k: x + k)


def test_star_arguments_are_not_donated_even_when_the_called_name_is_a_global():
    # ``*rest`` builds a tuple for the call: one reference more than the calibrated shapes, so
    # an alias would be invisible (tests/test_safety_donation.py). Refused, with the reason.
    rest = (1.0,)
    x = jnp.zeros(3) + 0
    kept = [x]
    x = _GLOBAL_STEP(x, *rest)
    assert not kept[0].is_deleted()
    [proof] = _GLOBAL_STEP.inspect(x, *rest).call_sites
    assert not proof.any
    assert "`*` or `**` unpacking" in proof.reasons[0][1]


def test_star_arguments_with_a_local_name_are_not_donated_and_say_why():
    step = autoopt.optimize(lambda x, k: x + k)
    rest = (1.0,)
    x = jnp.zeros(3) + 0
    kept = [x]
    x = step(x, *rest)
    assert not kept[0].is_deleted()
    [proof] = step.inspect(x, *rest).call_sites
    assert not proof.any
    assert "`*` or `**` unpacking" in proof.reasons[0][1]


def test_a_call_with_another_shape_than_written_is_not_donated():
    f = autoopt.optimize(lambda w, x: x + w)
    g = functools.partial(f, jnp.ones(3))  # local: unresolvable, so the shape check decides
    x = jnp.zeros(3) + 0
    for _ in range(3):
        x = g(x)  # f receives (w, x): two positional arguments where one was written
    assert not g.args[0].is_deleted()
    np.testing.assert_array_equal(x, 3 * np.ones(3))


def test_fast_path_with_numpy_batches_donates_the_state_and_keeps_placing():
    f = autoopt.optimize(lambda w, b, table: w + b["x"].sum() + table.sum())
    table = np.ones((8, 8), np.float32)
    table.flags.writeable = False  # read-only: still a host array, transferred every call
    w = jnp.zeros(3) + 0
    pointer = w.unsafe_buffer_pointer()
    for i in range(6):
        b = {"x": np.full((4,), float(i), np.float32)}
        w = f(w, b, table)
        assert w.unsafe_buffer_pointer() == pointer
    assert _fast_entries(f, w, b, table) == 1
    np.testing.assert_allclose(w, (4 * sum(range(6)) + 6 * 64) * np.ones(3))


def test_calls_from_inside_jax_are_not_reported_as_call_sites():
    # jax.grad calls the function from jax's own source: no call site of the user's to report.
    opt = autoopt.optimize(lambda w: jnp.sum(w**2))
    w = jnp.ones(4) + 0
    jax.grad(opt)(w)
    jax.vmap(opt)(jnp.ones((2, 4)))
    y = opt(w)  # a user's call site is still recorded
    report = opt.explain(w)
    jax_dir = os.path.dirname(os.path.abspath(jax.__file__))
    sites = [f.location for f in report.findings if f.location]
    assert sites and not any(loc.startswith(jax_dir) for loc in sites), sites
    assert float(y) == 4.0
