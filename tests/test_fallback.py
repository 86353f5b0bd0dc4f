"""Fallback and failure: a broken pass never breaks the user's program, and what autoopt cannot
analyse (unknown primitives, effects, Pallas, custom partitioning) runs as plain jax.jit runs it.

Each registered pass is made to fail by swapping its registry entry (``Pass`` is frozen) for one
whose ``run`` raises. With ``fallback="warn"`` the function still computes jax.jit's numbers, with
exactly one ``AutooptWarning`` naming the pass; with ``fallback="raise"`` the error is a
``PassError`` carrying the pass name and the user's ``def`` line.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import autoopt
from autoopt import passes
from autoopt.passes import PassError, PassResult, registered_pass_names, registered_passes
from autoopt.testing import assert_trees_equivalent

PASSES = registered_pass_names()


def step(x, i, u):
    """Something for every pass to look at: an in-place row update in a loop, a matmul, and an
    output that can reuse the input's buffer."""

    def body(j, acc):
        return acc.at[(i + j) % acc.shape[0]].set(jnp.tanh(acc[j] + u))

    y = lax.fori_loop(0, 3, body, x)
    return y @ y.T * 0.5 + y.sum()


STEP_LINE = f"{os.path.abspath(__file__)}:{inspect.getsourcelines(step)[1]}"


def _args(n=6):
    rng = np.random.default_rng(0)
    return (
        jnp.asarray(rng.standard_normal((n, n)).astype(np.float32)),
        jnp.int32(2),
        jnp.asarray(rng.standard_normal((n,)).astype(np.float32)),
    )


class Boom(RuntimeError):
    pass


@pytest.fixture
def break_pass():
    """``break_pass(name, run=None)`` makes pass ``name`` run (whatever the options) and fail,
    through the public registry; returns the call that puts the working pass back (also done
    when the test ends)."""
    registrations = []

    def _break(name, run=None):
        def boom(closed, ctx):
            raise Boom(f"injected failure in {name}")

        working = registered_passes()[name]
        broken = dataclasses.replace(working, run=run or boom, enabled=lambda o: True)
        registrations.append(passes.register(broken, replace=True))
        return registrations[-1]

    yield _break
    for undo in reversed(registrations):
        undo()


def _autoopt_warnings(record):
    return [w for w in record if issubclass(w.category, autoopt.AutooptWarning)]


def test_every_pass_is_covered():
    assert set(PASSES) >= {"scatter_to_dus", "remat", "donation"}


@pytest.mark.parametrize("name", PASSES)
def test_a_failing_pass_falls_back_to_jax_jit_with_exactly_one_warning_naming_it(break_pass, name):
    break_pass(name)
    fast = autoopt.optimize(step, donate="off")
    expected = jax.jit(step)(*_args())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = fast(*_args())
        fast(*_args())  # the same signature again
        fast(*_args(8))  # another signature: fails the same way, no second warning
    assert_trees_equivalent(expected, got)
    assert_trees_equivalent(jax.jit(step)(*_args(8)), fast(*_args(8)))
    ours = _autoopt_warnings(record)
    assert len(ours) == 1, [str(w.message) for w in ours]
    message = str(ours[0].message)
    assert repr(name) in message and "fell back to plain jax.jit" in message
    assert "fallback='raise'" in message  # says how to debug it


@pytest.mark.parametrize("name", PASSES)
def test_a_failing_pass_under_fallback_raise_names_the_pass_and_the_users_line(break_pass, name):
    restore = break_pass(name)
    fast = autoopt.optimize(step, donate="off", fallback="raise")
    with pytest.raises(PassError) as info:
        fast(*_args())
    err = info.value
    assert err.pass_name == name
    assert err.location == STEP_LINE
    assert f"{name!r}" in str(err) and STEP_LINE in str(err)
    assert isinstance(err.__cause__, Boom)
    # Nothing half-built was kept: once the pass works again, the same function optimizes.
    restore()
    assert_trees_equivalent(jax.jit(step)(*_args()), fast(*_args()))


def test_a_pass_that_changes_the_program_types_is_caught_and_falls_back(break_pass):
    def wrong_types(closed, ctx):
        bad = jax.make_jaxpr(lambda *a: [jnp.zeros((1,), jnp.int32)])(*closed.in_avals)
        return PassResult(jaxpr=bad, changed=True)

    break_pass(PASSES[0], run=wrong_types)
    with pytest.raises(PassError, match="input or output types"):
        autoopt.optimize(step, donate="off", fallback="raise")(*_args())
    with pytest.warns(autoopt.AutooptWarning, match=PASSES[0]):
        got = autoopt.optimize(step, donate="off")(*_args())
    assert_trees_equivalent(jax.jit(step)(*_args()), got)


def test_a_pass_that_returns_the_wrong_type_is_caught_and_falls_back(break_pass):
    break_pass(PASSES[-1], run=lambda closed, ctx: closed)
    with pytest.raises(PassError, match="not PassResult"):
        autoopt.optimize(step, donate="off", fallback="raise")(*_args())


def test_the_users_own_error_is_not_swallowed_by_fallback():
    def wrong(x):
        return x @ jnp.ones((3, 5))  # shape mismatch: the user's bug

    with warnings.catch_warnings():
        warnings.simplefilter("error", autoopt.AutooptWarning)
        with pytest.raises(TypeError) as ours:
            autoopt.optimize(wrong)(jnp.ones((4, 4)))
    with pytest.raises(TypeError) as theirs:
        jax.jit(wrong)(jnp.ones((4, 4)))
    assert str(ours.value).splitlines()[0] == str(theirs.value).splitlines()[0]


# --- programs autoopt cannot analyse run as jax.jit runs them ------------------------------------


def _same_as_jit(fn, *args):
    """optimize(fn) under fallback="raise" (no fallback taken) and under the default (no
    warning) both compute what jax.jit computes."""
    expected = jax.jit(fn)(*args)
    assert_trees_equivalent(expected, autoopt.optimize(fn, fallback="raise", donate="off")(*args))
    with warnings.catch_warnings():
        warnings.simplefilter("error", autoopt.AutooptWarning)
        assert_trees_equivalent(expected, autoopt.optimize(fn)(*args))
    return expected


def _make_unknown_primitive():
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    p = Primitive("autoopt_test_triple")
    p.def_impl(lambda x: x * 3)
    p.def_abstract_eval(lambda x: x)
    mlir.register_lowering(p, mlir.lower_fun(lambda x: x * 3, multiple_results=False))
    return p


triple_p = _make_unknown_primitive()


def test_an_unknown_primitive_is_left_alone_at_top_level_and_inside_loops():
    def f(x, i):
        y = triple_p.bind(x)
        y = y.at[i].set(triple_p.bind(y[0]))

        def body(c, row):
            return c + triple_p.bind(row), triple_p.bind(c)

        c, ys = lax.scan(body, y[0], y)
        return lax.cond(i > 1, triple_p.bind, lambda v: -v, ys), c

    _same_as_jit(f, jnp.arange(12.0).reshape(4, 3), jnp.int32(2))


def test_debug_print_prints_exactly_what_jax_jit_prints(capfd):
    def f(x):
        jax.debug.print("start {x}", x=x[0])

        def body(i, acc):
            jax.debug.print("iter {i}", i=i, ordered=True)
            return acc.at[i].add(1.0)

        return lax.fori_loop(0, 3, body, x)

    x = jnp.zeros(4)
    jax.jit(f)(x).block_until_ready()
    jax.effects_barrier()
    expected = capfd.readouterr().out
    autoopt.optimize(f, fallback="raise", donate="off")(x).block_until_ready()
    jax.effects_barrier()
    assert capfd.readouterr().out == expected
    assert expected.count("iter") == 3


def test_io_callback_runs_as_often_and_in_the_same_order_as_under_jax_jit():
    from jax.experimental import io_callback

    def run(compile_):
        seen = []

        def host(v):
            seen.append(float(np.asarray(v).sum()))
            return np.asarray(v) + 1

        def f(x):
            def body(c, row):
                out = io_callback(
                    host, jax.ShapeDtypeStruct(row.shape, row.dtype), row + c, ordered=True
                )
                return c + 1.0, out

            return lax.scan(body, jnp.float32(0), x)

        out = compile_(f)(jnp.arange(6.0).reshape(3, 2))
        jax.effects_barrier()
        return out, seen

    expected, seen_jit = run(jax.jit)
    got, seen_opt = run(lambda f: autoopt.optimize(f, fallback="raise", donate="off"))
    assert_trees_equivalent(expected, got)
    assert seen_opt == seen_jit and len(seen_jit) == 3


def test_pure_callback_and_debug_callback_run_as_under_jax_jit():
    calls = []

    def f(x):
        y = jax.pure_callback(
            lambda v: np.sort(np.asarray(v)), jax.ShapeDtypeStruct(x.shape, x.dtype), x
        )
        jax.debug.callback(lambda v: calls.append(float(v)), y[0])
        return y.at[0].set(-1.0)

    x = jnp.array([3.0, 1.0, 2.0])
    _same_as_jit(f, x)
    jax.effects_barrier()
    assert len(calls) == 3 and len(set(calls)) == 1  # once per compiled call, same value


def test_pallas_call_in_interpret_mode_runs_as_under_jax_jit():
    pl = pytest.importorskip("jax.experimental.pallas")

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0 + 1.0

    def f(x):
        y = pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True
        )(x)
        return y.at[1].set(0.0)

    _same_as_jit(f, jnp.arange(8.0))


def test_custom_partitioning_runs_as_under_jax_jit():
    from jax.experimental.custom_partitioning import custom_partitioning

    @custom_partitioning
    def sin2(x):
        return jnp.sin(x) * 2

    def partition(mesh, arg_shapes, result_shape):
        return mesh, lambda x: jnp.sin(x) * 2, result_shape.sharding, (arg_shapes[0].sharding,)

    sin2.def_partition(
        partition=partition,
        infer_sharding_from_operands=lambda mesh, args, res: args[0].sharding,
        sharding_rule="i -> i",
    )

    def f(x):
        return sin2(x).at[2].add(1.0)

    _same_as_jit(f, jnp.arange(8.0))
