"""A block or window written at a Python int start (``buf.at[i + jnp.arange(k)].set(b)`` in a
loop over ``i``): the program for any ``i`` must blend the block or keep the scatter, since
``.at`` drops rows out of bounds where ``dynamic_update_slice`` clamps; a second program, built
assuming ``i`` in the bounds that prove the write, runs it as a bare ``dynamic_update_slice``
for calls whose ``i`` the call path checks on the host (``Program.bounded``, ``_plans.bounded``).
Every call gives jax.jit's numbers, whatever ``i`` is."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import monitoring

import autoopt


def block_set(x, i, b):
    return x.at[i + jnp.arange(b.shape[0])].set(b)


def window_add(x, i, b):
    return x.at[i + jnp.arange(b.shape[0])].add(b)


def strided_max(x, i, b):  # the start is 2i: bounds for i, not for the start
    return x.at[2 * i + jnp.arange(b.shape[0])].max(b)


def row_after_block(x, i, b):  # one guarded row besides the block, both proven by i's bounds
    return x.at[i + jnp.arange(b.shape[0])].set(b).at[i].multiply(3.0)


def row_set(x, i, b):  # (a lone row: its cond guard is the exact form for any i)
    return x.at[i].set(b[0])


FUNCTIONS = [block_set, window_add, strided_max, row_after_block, row_set]


def _twin(fn, *args):
    found = [f for f in autoopt.optimize(fn).inspect(*args).findings if f.kind == "bounded_twin"]
    return found[0] if found else None


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
def test_the_twin_is_built_with_the_bounds_that_prove_the_write(fn):
    x, b = jnp.zeros((64, 4)), jnp.ones((8, 4))
    twin = _twin(fn, x, 3, b)
    assert twin is not None and twin.applied
    top = (64 - 8) // 2 if fn is strided_max else 63 if fn is row_set else 64 - 8
    assert twin.details["bounds"] == {"i": (0, top)}, twin.details
    assert f"`i` in [0, {top}]" in twin.message


@settings(max_examples=60, deadline=None)
@given(
    fn=st.sampled_from(FUNCTIONS),
    rows=st.integers(1, 40),
    k=st.integers(1, 12),
    starts=st.lists(
        st.one_of(st.integers(-60, 60), st.sampled_from([2**31 - 1, -(2**31), 10**6])),
        min_size=1,
        max_size=6,
    ),
    rebind=st.booleans(),
)
def test_every_start_gives_jax_jits_numbers(fn, rows, k, starts, rebind):
    x0 = jnp.arange(rows * 3, dtype=jnp.float32).reshape(rows, 3) - 7.0
    b = jnp.linspace(-2.0, 5.0, k * 3, dtype=jnp.float32).reshape(k, 3)
    ref, fast = jax.jit(fn), autoopt.optimize(fn)
    want, got = x0, x0 + 0.0
    for i in starts:
        want = ref(want, i, b)
        if rebind:
            got = fast(got, i, b)  # (donated: the call site rebinds it)
        else:
            out = fast(got, i, b)
            assert not got.is_deleted()
            got = out
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"i={i}")


def test_a_start_that_is_not_a_python_int_runs_the_program_for_any_value():
    x, b = jnp.arange(48.0).reshape(16, 3), jnp.ones((4, 3))
    fast, ref = autoopt.optimize(block_set), jax.jit(block_set)
    for i in (jnp.int32(14), np.int32(14), 14, jnp.asarray(-3), True):
        np.testing.assert_array_equal(fast(x, i, b), ref(x, i, b), err_msg=repr(i))


def _compiles_of(name: str):
    seen: list[str] = []

    def listen(event, duration, fun_name=None, **kw):
        if event == "/jax/core/compile/backend_compile_duration" and fun_name == f"jit({name})":
            seen.append(fun_name)

    monitoring.register_event_duration_secs_listener(listen)
    return seen


def test_a_loop_whose_starts_stay_in_the_bounds_compiles_one_program():
    def ring_write(buf, i, rows):
        return buf.at[i + jnp.arange(rows.shape[0])].set(rows)

    seen = _compiles_of("ring_write")
    fast = autoopt.optimize(ring_write)
    buf, rows = jnp.zeros((128, 8)), jnp.ones((8, 8))
    for i in range(0, 120, 5):
        buf = fast(buf, i, rows)
    assert len(seen) == 1  # the twin, as jax.jit compiles its one program
    buf = fast(buf, 125, rows)  # past the bounds: the program for any start
    buf = fast(buf, 3, rows)
    assert len(seen) == 2
    want = jnp.zeros((128, 8))
    for i in [*range(0, 120, 5), 125, 3]:
        want = want.at[i + jnp.arange(8)].set(rows)
    np.testing.assert_array_equal(buf, want)


def tile_add(x, i, j, t):
    return x.at[i + jnp.arange(t.shape[0])[:, None], j + jnp.arange(t.shape[1])].add(t)


def test_a_tiles_two_starts_are_both_checked():
    x, t = jnp.zeros((40, 48)), jnp.ones((8, 16))
    twin = _twin(tile_add, x, 1, 2, t)
    assert twin is not None and twin.details["bounds"] == {"i": (0, 32), "j": (0, 32)}
    ref, fast = jax.jit(tile_add), autoopt.optimize(tile_add)
    want, got = x, x + 0.0
    for i, j in [(0, 0), (32, 32), (33, 0), (0, 33), (-1, 5), (5, -1), (31, 2), (2, 31)]:
        want, got = ref(want, i, j, t), fast(got, i, j, t)
        np.testing.assert_array_equal(got, want, err_msg=f"{i}, {j}")


def test_no_twin_where_nothing_would_be_proven():
    x, b = jnp.zeros((64, 4)), jnp.ones((8, 4))

    def clipped(x, i, b):  # (proven for any i already)
        return x.at[jnp.clip(i, 0, 56) + jnp.arange(8)].set(b)

    def a_step_counter_too(x, step, i, b):  # (an int the writes do not need: never checked)
        return x.at[i + jnp.arange(8)].set(b * step)

    assert _twin(clipped, x, 1, b) is None
    twin = _twin(a_step_counter_too, x, 7, 1, b)
    assert twin is not None and twin.details["bounds"] == {"i": (0, 56)}
    assert _twin(block_set, x, jnp.int32(1), b) is None  # a jax array: not weakly typed


def test_the_codemod_makes_no_source_edit_of_the_twin():
    from autoopt.codemod import COMMANDS

    twin = _twin(block_set, jnp.zeros((64, 4)), 3, jnp.ones((8, 4)))
    assert twin is not None
    assert not any(c.KIND == twin.kind and c.wants(twin) for c in COMMANDS)


def test_no_twin_for_a_program_reading_a_closed_over_numpy_array():
    # (its bytes are read when each program is lowered: refilled between the two lowerings,
    # the twin wrote rows 16-19 where jax.jit, which read the array once, writes rows 5-8)
    off = np.array([0], np.int32)

    def shifted(x, i, b):
        return x.at[i + jnp.asarray(off)[0] + jnp.arange(4)].set(b)

    x, b = jnp.zeros((20, 2)), jnp.ones((4, 2))
    assert _twin(shifted, x, 3, b) is None
    ref, fast = jax.jit(shifted), autoopt.optimize(shifted)
    np.testing.assert_array_equal(fast(x, 30, b), ref(x, 30, b))
    off[0] = 100
    np.testing.assert_array_equal(fast(x, 5, b), ref(x, 5, b))


def test_a_twin_runs_only_for_the_bounds_its_call_checked():
    # (a site's plan keys on the arguments' types, not on the trace context: a call under
    # another context, jax_enable_x64 switched, finds the plan that checked the first
    # program's bounds and traces its jit object again; that trace must not run a twin built
    # for other bounds)
    fast, ref = autoopt.optimize(block_set), jax.jit(block_set)
    b = jnp.ones((8, 4))
    x = jnp.zeros((64, 4))
    for i in (3, 50, 56, 57):
        x = fast(x, i, b)
    want = jnp.zeros((64, 4))
    for i in (3, 50, 56, 57):
        want = ref(want, i, b)
    np.testing.assert_array_equal(x, want)
    with jax.enable_x64(True):
        x64, w64 = jnp.zeros((64, 4)), jnp.zeros((64, 4))
        for i in (3, 56, 57, -1):
            x64, w64 = fast(x64, i, b), ref(w64, i, b)
        np.testing.assert_array_equal(x64, w64)
