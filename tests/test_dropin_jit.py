"""``optimize`` as a drop-in for ``jax.jit``: the options of a ``jax.jit`` it is given, argnames
mapped to positions as jax.jit maps them, ``eval_shape`` and ``clear_cache``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

import autoopt
from benchmarks._harness import Compiles


def _fn(x, scale, use_relu):
    y = x * scale
    return jax.nn.relu(y) if use_relu else y


def _sharding():
    return SingleDeviceSharding(jax.devices()[0])


# --- the options of a jax.jit given to optimize -----------------------------------------------


@pytest.mark.parametrize("static", [{"static_argnums": 2}, {"static_argnames": "use_relu"}])
def test_static_arguments_of_the_wrapped_jit_are_kept(static):
    fast = autoopt.optimize(jax.jit(_fn, **static), fallback="raise")
    x = -jnp.ones(3)
    np.testing.assert_array_equal(fast(x, 2.0, True), jax.jit(_fn, **static)(x, 2.0, True))
    np.testing.assert_array_equal(fast(x, 2.0, use_relu=False), -2 * np.ones(3))


@pytest.mark.parametrize("donate", [{"donate_argnums": 0}, {"donate_argnames": "x"}])
def test_donation_of_the_wrapped_jit_is_kept(donate):
    fast = autoopt.optimize(jax.jit(_fn, static_argnums=2, **donate), fallback="raise")
    x = jnp.ones(3) + 0
    y = fast(x, 2.0, False)  # not a rebinding statement: "safe" alone would not donate
    assert x.is_deleted()
    np.testing.assert_array_equal(y, 2 * np.ones(3))


def test_shardings_keep_unused_inline_and_compiler_options_of_the_wrapped_jit_are_kept():
    s = _sharding()
    kw = {
        "in_shardings": (s, None),
        "out_shardings": s,
        "keep_unused": True,
        "inline": True,
        "compiler_options": {"xla_cpu_enable_fast_math": False},
    }

    def f(x, unused):
        return x + 1

    fast = autoopt.optimize(jax.jit(f, **kw), fallback="raise")
    jit_kwargs = fast.inspect(jnp.ones(3), jnp.ones(2)).options.jit_kwargs
    for k, v in kw.items():
        assert jit_kwargs[k] == v, k
    lowered = fast.lower(jnp.ones(3), jnp.ones(2)).as_text()
    assert "tensor<2xf32>" in lowered  # keep_unused: the unused argument stays a parameter
    assert fast(jnp.ones(3), jnp.ones(2)).sharding == s


def _outcome(fn, *args):
    try:
        return np.asarray(fn(*args)).tobytes()
    except Exception as e:  # noqa: BLE001 - the outcome compared is the error's type
        return type(e).__name__


@pytest.mark.parametrize("options", [{"xla_cpu_enable_fast_math": True}, {"xla_no_such": True}])
def test_compiler_options_apply_under_an_eager_vmap_or_jvp_as_jax_jits_do(options):
    """jax compiles a jit called under an eager vmap or jvp on its own, with its options (an
    unknown one raises there); under an outer jit or an eager grad it refuses them, where
    autoopt's call runs inside the outer program (README, "jax.jit's keywords")."""

    def f(a):
        return jnp.sum(jnp.exp(jnp.tanh(a) / (a + 0.3)) + jnp.log1p(jnp.abs(a)) * jnp.sin(a))

    x = jax.random.normal(jax.random.key(0), (256,)) * 10
    ours = autoopt.optimize(f, compiler_options=options)
    theirs = jax.jit(f, compiler_options=options)
    for transform, arg in [
        (jax.vmap, x[:, None]),
        (lambda g: lambda a: jax.jvp(g, (a,), (a,))[1], x),
        (lambda g: lambda s: jax.vmap(lambda t: g(x) * t)(s), jnp.ones(2)),  # unbatched call
        (lambda g: g, x),
    ]:
        assert _outcome(transform(ours), arg) == _outcome(transform(theirs), arg)
    assert _outcome(jax.jit(jax.grad(ours)), x) == _outcome(jax.jit(jax.grad(f)), x)


@pytest.mark.parametrize("body", ["sin", "row set"])
def test_a_shape_polymorphic_export_is_jax_jits_without_a_fallback(body):
    """jax.export with a symbolic dimension (and ``lower`` of one): the passes read concrete
    sizes, so such a program runs none (it fell back to jax.jit with a warning, or raised under
    fallback="raise")."""
    from jax import export

    def f(a):
        return jnp.sin(a) * 2 if body == "sin" else a.at[0].set(1.0) * 2

    spec = jax.ShapeDtypeStruct(export.symbolic_shape("b"), jnp.float32)
    ours = autoopt.optimize(f, fallback="raise")
    exported = export.export(ours)(spec)
    theirs = export.export(jax.jit(f))(spec)
    assert ours.lower(spec).as_text() == jax.jit(f).lower(spec).as_text()
    for n in (1, 5):
        x = jnp.arange(n, dtype=jnp.float32)
        np.testing.assert_array_equal(exported.call(x), theirs.call(x))


@pytest.mark.parametrize("donate", ["safe", "auto", "off"])
@pytest.mark.parametrize("by_name", [False, True])
def test_a_python_int_no_dtype_holds_raises_jax_jits_error(donate, by_name):
    """A first call with ``2**40`` (no int32 holds it): jax.jit's OverflowError naming the
    argument, not the one autoopt's signature met first (a review)."""

    def f(a, b):
        return a + b

    def message(g):
        with pytest.raises(OverflowError) as info:
            g(jnp.ones(2), b=2**40) if by_name else g(jnp.ones(2), 2**40)
        return str(info.value).splitlines()[0]

    assert message(autoopt.optimize(f, donate=donate)) == message(jax.jit(f))


def test_options_given_both_ways_merge_when_they_agree():
    fast = autoopt.optimize(
        jax.jit(_fn, static_argnums=2, compiler_options={"xla_cpu_enable_fast_math": False}),
        static_argnames="use_relu",  # the same argument, by name
        compiler_options={"xla_cpu_use_thunk_runtime": True},
        fallback="raise",
    )
    options = fast.inspect(jnp.ones(3), 2.0, True).options.jit_kwargs
    assert options["static_argnums"] == (2,) and options["static_argnames"] == ("use_relu",)
    assert options["compiler_options"] == {
        "xla_cpu_enable_fast_math": False,
        "xla_cpu_use_thunk_runtime": True,
    }


@pytest.mark.parametrize(
    ("jit_kw", "ours", "shown"),
    [
        ({"static_argnums": 2}, {"static_argnums": 1}, ("static_argnums=1", "(2,)")),
        ({"donate_argnums": 0}, {"donate_argnames": "scale"}, ("donate_argnames='scale'", "x")),
        ({"keep_unused": True}, {"keep_unused": False}, ("keep_unused=False", "True")),
        (
            {"compiler_options": {"xla_cpu_enable_fast_math": False}},
            {"compiler_options": {"xla_cpu_enable_fast_math": True}},
            ("xla_cpu_enable_fast_math", "False"),
        ),
    ],
)
def test_an_option_given_both_ways_differently_is_an_error_naming_both(jit_kw, ours, shown):
    jitted = jax.jit(_fn, **{"static_argnums": 2, **jit_kw})
    with pytest.raises(ValueError, match="conflicts with the jax.jit it wraps") as info:
        autoopt.optimize(jitted, **ours)
    message = str(info.value)
    assert all(s in message for s in shown)
    assert "drop" in message


def test_static_argnames_are_positions_before_in_shardings_are_read():
    # jax.jit maps static_argnames to positions first: in_shardings covers (x, scale) only.
    kw = {"in_shardings": (_sharding(), None), "static_argnames": ("use_relu",)}
    fast = autoopt.optimize(_fn, fallback="raise", **kw)
    x = -jnp.ones(3)
    np.testing.assert_array_equal(fast(x, 2.0, True), jax.jit(_fn, **kw)(x, 2.0, True))
    np.testing.assert_array_equal(fast(x, 2.0, False), jax.jit(_fn, **kw)(x, 2.0, False))


def test_a_static_argnum_passed_by_name_is_static_as_under_jit():
    calls = []

    def f(x, n):
        calls.append(n)
        return x * n

    fast = autoopt.optimize(f, static_argnums=1, fallback="raise")
    for n in (2, 3):
        np.testing.assert_array_equal(
            fast(jnp.ones(2), n=n), jax.jit(f, static_argnums=1)(jnp.ones(2), n=n)
        )
    assert all(isinstance(n, int) for n in calls)  # never a tracer


# --- eval_shape and clear_cache ---------------------------------------------------------------


def _model(params, x, act):
    return {"y": act(params["w"] * x), "n": 2}, x.sum()


def test_eval_shape_is_jax_jits_and_compiles_nothing():
    params, x = {"w": jnp.ones(3)}, jnp.arange(3)
    fast = autoopt.optimize(_model, static_argnums=2, fallback="raise")
    with Compiles("_model") as compiles:
        got = fast.eval_shape(params, x, jnp.tanh)
    assert compiles.own == 0
    assert got == jax.jit(_model, static_argnums=2).eval_shape(params, x, jnp.tanh)
    assert all(isinstance(s, jax.ShapeDtypeStruct) for s in jax.tree_util.tree_leaves(got))


def test_eval_shape_after_a_call_does_not_run_the_function_again():
    # (as jax.jit answers from its trace: a print in the function ran twice)
    runs = []

    def counted(x, i):
        runs.append(1)
        return {"a": x * 2, "b": i + 1}

    def same(x, i):  # (jax.jit's trace cache is per function: another one, for the answer)
        return {"a": x * 2, "b": i + 1}

    fast = autoopt.optimize(counted, fallback="raise")
    fast(jnp.ones(3), 2)
    runs.clear()
    want = jax.jit(same).eval_shape(jnp.ones(3), 2)
    assert fast.eval_shape(jnp.ones(3), 2) == want and runs == []
    # another signature is traced, as jax.jit traces it
    assert fast.eval_shape(jnp.ones(4), 2)["a"] == jax.ShapeDtypeStruct((4,), jnp.float32)


def test_eval_shape_puts_back_non_array_leaves():
    def f(config, x):
        return {**_model(config, x, config["act"])[0], "act": config["act"]}

    fast = autoopt.optimize(f, fallback="raise")
    config = {"w": jnp.ones(3), "act": jnp.tanh}  # a function leaf: static
    out = fast.eval_shape(config, jnp.arange(3.0))
    assert out["act"] is jnp.tanh
    assert out["n"] == jax.ShapeDtypeStruct((), jnp.int32, weak_type=True)
    assert out["y"] == jax.ShapeDtypeStruct((3,), jnp.float32)


@pytest.mark.parametrize("donate", ["safe", "auto", "off"])
def test_clear_cache_recompiles_as_jax_jit_does(donate):
    def step(w, x):
        return w * 2 + x

    counts = []
    for fn in (jax.jit(step), autoopt.optimize(step, donate=donate, fallback="raise")):
        with Compiles("step") as compiles:
            fn(jnp.ones(3), jnp.ones(3))
            fn(jnp.ones(3), jnp.ones(3))
            fn.clear_cache()
            out = fn(jnp.ones(3), jnp.ones(3))
        np.testing.assert_array_equal(out, 3 * np.ones(3))
        counts.append(compiles.own)
    assert counts[1] == counts[0] == 2


# --- one executable per signature, whatever each call donates ------------------------------------


def _train_step(params, state):
    return params * 0.9 + state, state + 1.0


def _held_fresh_discarded(step):
    """FINDINGS.md: a first call whose ``params`` is still held elsewhere, the same call with
    fresh arrays, then a call whose result is discarded."""
    params, state = jnp.ones(8), jnp.zeros(8)
    held = params
    params, state = step(params, state)
    held = held if held.is_deleted() else np.asarray(held)  # "auto" donates it
    params, state = jnp.ones(8), jnp.zeros(8)
    pointer = params.unsafe_buffer_pointer()
    params, state = step(params, state)
    donated = params.unsafe_buffer_pointer() == pointer  # the output took the buffer
    out = step(jnp.ones(8), jnp.zeros(8))
    _ = step(params, state)
    return held, donated, out, (params, state)


def _compiles_of(name: str, run):
    jax.clear_caches()  # jax shares executables between jit objects of one program
    with Compiles(name) as compiles:
        result = run()
    return compiles.own, result


@pytest.mark.parametrize("donate", ["safe", "auto", "off"])
def test_each_donation_outcome_runs_the_one_executable_jax_jit_compiles(donate):
    reference, expected = _compiles_of(
        "_train_step", lambda: _held_fresh_discarded(jax.jit(_train_step))
    )
    fast = autoopt.optimize(_train_step, donate=donate, fallback="raise")
    compiles, got = _compiles_of("_train_step", lambda: _held_fresh_discarded(fast))
    assert compiles == reference == 1
    assert got[1] == (donate != "off")  # the fresh arrays were donated
    if donate != "auto":
        np.testing.assert_array_equal(got[0], np.ones(8))  # still held: never donated
    last = 3 if donate == "auto" else 4  # "auto" donated the arrays the last call passed
    for e, g in zip(*(jax.tree_util.tree_leaves(r[2:last]) for r in (expected, got))):
        np.testing.assert_array_equal(e, g)


def _counter_step(params, count):
    return params * 2, count + 1


@pytest.mark.parametrize("donate", ["safe", "auto", "off"])
@pytest.mark.parametrize("start", [0, 0.5, True])
def test_a_python_scalar_that_becomes_an_array_compiles_as_under_jax_jit(donate, start):
    def run(step):
        params, count = jnp.ones(4), start
        for _ in range(3):
            params, count = step(params, count)
        return params, count

    reference, expected = _compiles_of("_counter_step", lambda: run(jax.jit(_counter_step)))
    fast = autoopt.optimize(_counter_step, donate=donate, fallback="raise")
    compiles, got = _compiles_of("_counter_step", lambda: run(fast))
    assert compiles == reference
    for e, g in zip(expected, got):
        assert (e.dtype, e.weak_type) == (g.dtype, g.weak_type)
        np.testing.assert_array_equal(e, g)


def test_a_call_that_must_not_donate_passes_copies_and_keeps_its_arguments():
    fast = autoopt.optimize(_train_step, fallback="raise")
    params, state = jnp.ones(8), jnp.zeros(8)
    params, state = fast(params, state)  # decides the executable: it donates both
    keep_p, keep_s = jnp.ones(8), jnp.zeros(8)
    with Compiles("_train_step") as compiles:
        out = fast(keep_p, keep_s)  # not rebound: copies are donated instead
    assert compiles.own == 0
    assert not keep_p.is_deleted() and not keep_s.is_deleted()
    np.testing.assert_array_equal(out[0], jnp.ones(8) * 0.9)


def _keyed_step(state):
    return {
        "w": state["w"] * 0.5,
        "n": state["n"] + 1.0,
        "key": jax.random.split(state["key"])[0],
        "pinned": state["pinned"] - 1,
    }


def _keyed_state():
    return {
        "w": jnp.ones(8),
        "n": jax.device_put(1.0),  # weak-typed
        "key": jax.random.key(0),
        "pinned": jax.device_put(jnp.arange(4), jax.devices()[0]),  # committed
    }


def test_many_calls_that_must_not_donate_keep_their_arguments_and_the_one_executable():
    # Past autoopt._jit._dispatch.COPIES_BEFORE_COMPILING, the copies are made by a compiled
    # copy instead of device_put: same values, avals, committedness, no recompile of the step.
    fast = autoopt.optimize(_keyed_step, fallback="raise")
    state = fast(_keyed_state())  # decides the executable: it donates the state
    kept = _keyed_state()
    expected = jax.jit(_keyed_step)(_keyed_state())
    with Compiles("_keyed_step") as compiles:
        outs = [fast(kept) for _ in range(40)]
    assert compiles.own == 0
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(kept))
    for out in (outs[0], outs[-1]):
        for k in expected:
            e, g = expected[k], out[k]
            assert (e.aval, e.committed) == (g.aval, g.committed), k
            np.testing.assert_array_equal(
                jax.random.key_data(e) if k == "key" else e,
                jax.random.key_data(g) if k == "key" else g,
            )
    state = fast(state)  # the rebinding site still donates
    assert float(state["w"][0]) == 0.25
