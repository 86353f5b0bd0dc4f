"""Cached plans for functions with static arguments (``static_argnums``/``static_argnames``).

``state = step(state, batch, training=True)`` is how a training step takes its flags. Such a
call had no cached plan: every call ran the general path (17 us against jax.jit's 3 us for a
tiny step, 33 us with the flag as a keyword once plans were tried and missed). A plan's key now
holds the static values as the general path's signature holds them (``_plans.static_key``:
compared by ``==``, as jax.jit's cache compares them), and static keywords are passed by the
plan. These tests pin what the plan must keep: the program of each static value, the
run-time checks of donation, and jax.jit's numbers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoopt


def _body(x, training=False, scale=1.0):
    return x * (2.0 * scale) + 1.0 if training else x - 1.0


def _plans_of(f, *args, **kwargs) -> int:
    return f.inspect(*args, **kwargs).fast_entries


@pytest.mark.parametrize("by", ["keyword", "position"])
def test_a_repeating_call_with_a_static_flag_takes_a_plan_and_donates(by):
    f = autoopt.optimize(_body, static_argnames="training")
    x = jnp.ones(8)
    same = []
    for _ in range(4):
        before = x.unsafe_buffer_pointer()
        if by == "keyword":
            x = f(x, training=True)
        else:
            x = f(x, True)
        same.append(x.unsafe_buffer_pointer() == before)
    assert same == [True] * 4
    assert _plans_of(f, x, training=True) >= 1
    np.testing.assert_array_equal(x, np.full(8, 31.0, np.float32))


def test_each_static_value_runs_its_own_program():
    f = autoopt.optimize(_body, static_argnames=("training", "scale"))
    g = jax.jit(_body, static_argnames=("training", "scale"))
    x, y = jnp.ones(8), jnp.ones(8)
    flags = [True, False, True, True, False, 1, 0, True]
    scales = [1.0, 1.0, 2.0, 2.0, 0.5, 1.0, 3.0, 1]
    for t, s in zip(flags, scales):
        x = f(x, training=t, scale=s)
        y = g(y, training=t, scale=s)
        np.testing.assert_array_equal(x, y)


def test_a_kept_alias_is_not_deleted_by_a_planned_call():
    f = autoopt.optimize(_body, static_argnames="training")
    x = jnp.ones(8)
    for _ in range(3):
        x = f(x, training=True)  # the plan exists now
    kept = x
    x = f(x, training=True)  # refused at run time: `kept` holds the array
    assert not kept.is_deleted()
    np.testing.assert_array_equal(kept, np.full(8, 15.0, np.float32))
    for _ in range(2):
        x = f(x, training=True)
    assert not kept.is_deleted()


def test_a_dynamic_keyword_argument_takes_no_plan_and_is_correct():
    def step(x, training=False, *, bias):
        return x * 2.0 + bias if training else x

    f = autoopt.optimize(step, static_argnames="training")
    g = jax.jit(step, static_argnames="training")
    x = y = jnp.ones(4)
    b = jnp.full(4, 0.5)
    for _ in range(3):
        x = f(x, training=True, bias=b)
        y = g(y, training=True, bias=b)
    np.testing.assert_array_equal(x, y)
    assert not b.is_deleted()


def test_static_argnums_and_a_non_donating_call_site():
    f = autoopt.optimize(lambda n, x: x * n, static_argnums=0)
    x = jnp.arange(4.0)
    outs = [f(3, x) for _ in range(3)]  # `x` kept: nothing donated
    assert not x.is_deleted()
    for o in outs:
        np.testing.assert_array_equal(o, np.arange(4.0) * 3)
    np.testing.assert_array_equal(f(2, x), np.arange(4.0) * 2)  # another value: its program


def test_an_unhashable_static_value_raises_jax_jits_error():
    f = autoopt.optimize(_body, static_argnames="training")
    g = jax.jit(_body, static_argnames="training")
    x = jnp.ones(2)
    with pytest.raises(ValueError) as want:
        g(x, training=[True])
    with pytest.raises(ValueError) as got:
        f(x, training=[True])
    assert str(got.value).split("\n")[0] == str(want.value).split("\n")[0]


def test_donate_auto_with_a_static_flag_plans_by_its_value():
    f = autoopt.optimize(_body, static_argnames="training", donate="auto")
    g = jax.jit(_body, static_argnames="training")
    x, y = jnp.ones(8), jnp.ones(8)  # (two arrays: "auto" donates without asking)
    for t in [True, True, False, True, False, False]:
        x = f(x, training=t)
        y = g(y, training=t)
        np.testing.assert_array_equal(x, y)
    assert _plans_of(f, x, training=True) >= 2


# --- from the review of this change (2026-12-07) ---------------------------------------------


def _by_type(x, flag=False):
    # a result that depends on the static value's type: jax.jit's cache tells them apart
    return x + 100.0 if isinstance(flag, bool) else x + float(flag)


@pytest.mark.parametrize("by", ["keyword", "position"])
def test_equal_static_values_of_other_types_run_their_own_programs(by):
    # True == 1 == 1.0: jax.jit traces each type again, and so does autoopt now (it shared one
    # program by `==` alone, before this change too: a silent wrong number, or dtype)
    f = autoopt.optimize(_by_type, static_argnames="flag")
    g = jax.jit(_by_type, static_argnames="flag")
    x, y = jnp.zeros(4), jnp.zeros(4)
    for v in [True, True, True, 1, 1, 1.0, np.int32(1)]:
        x = f(x, flag=v) if by == "keyword" else f(x, v)
        y = g(y, flag=v) if by == "keyword" else g(y, v)
        np.testing.assert_array_equal(x, y)


def test_an_int_and_a_float_static_scale_give_jax_jits_dtype():
    f = autoopt.optimize(lambda x, scale: x * scale, static_argnames="scale")
    g = jax.jit(lambda x, scale: x * scale, static_argnames="scale")
    x = jnp.arange(4, dtype=jnp.int32)
    for s in [2, 2, 2.0]:
        got, want = f(x, scale=s), g(x, scale=s)
        assert got.dtype == want.dtype, (s, got.dtype, want.dtype)
        np.testing.assert_array_equal(got, want)


def _signed(x, s=0.0):
    return x + jnp.copysign(1.0, s)


def test_a_plan_passes_the_calls_own_static_values():
    # 0.0 == -0.0 (same type, same hash) finds the plan of 0.0; under jax.disable_jit() the
    # function runs with the values passed, which the plan must hand on (it passed the first
    # call's)
    f = autoopt.optimize(_signed, static_argnames="s")
    g = jax.jit(_signed, static_argnames="s")
    x, y = jnp.zeros(2), jnp.zeros(2)
    for i, s in enumerate([0.0, 0.0, 0.0, -0.0, -0.0]):
        if i >= 3:
            with jax.disable_jit():
                x, y = f(x, s=s), g(y, s=s)
        else:
            x, y = f(x, s=s), g(y, s=s)
        np.testing.assert_array_equal(x, y)


def test_packed_host_arguments_keep_a_static_position_added_later():
    # (the same review, outside this change) the placer's decision per argument structure was
    # keyed by the dynamic tree alone: `f(d)` then `f(d, True)` reused a layout that unpacks to
    # one positional argument, and the call ran with training=False
    def step(d, training=False):
        s = d["a"] + d["b"] + d["c"]
        return s * 2.0 if training else s

    f = autoopt.optimize(step, static_argnums=1, placement="pack")
    g = jax.jit(step, static_argnums=1)

    def batch():
        return {k: np.ones(3, np.float32) for k in "abc"}

    calls = [((), {})] * 3 + [((True,), {})] * 3 + [((), {"training": True})] * 2
    for extra, kw in calls:
        np.testing.assert_array_equal(f(batch(), *extra, **kw), g(batch(), *extra, **kw))


def test_a_negative_static_position_before_the_first_argument_raises_jax_jits_error():
    def step(x, a=1.0, b=2.0):
        return x + a + b

    f = autoopt.optimize(step, static_argnums=-3)
    g = jax.jit(step, static_argnums=-3)
    x = jnp.ones(2)
    for args in [(x,), (x, 1.0)]:  # (b6538a5 raised IndexError)
        with pytest.raises(ValueError) as want:
            g(*args)
        with pytest.raises(ValueError) as got:
            f(*args)
        assert str(got.value) == str(want.value)
