"""``autoopt.patch()``: every form of ``jax.jit`` goes through ``optimize`` while it is active,
autoopt's and jax's own jits stay plain, and ``jax.jit`` is the real one again afterwards."""

from __future__ import annotations

import functools
import gc
import importlib
import sys
import textwrap
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoopt
from autoopt import OptimizedFunction
from autoopt.patch import RECENT, summary

# The patch rebinds every module-level name bound to the real jax.jit, this module's too; the
# patch module itself is left alone, so the real one is read from there.
_patch_module = importlib.import_module("autoopt.patch")


def real_jit(*args, **kwargs):
    return _patch_module.real_jit(*args, **kwargs)


def jax_jit_is_real() -> bool:
    return jax.jit is _patch_module.real_jit


def _row(name_part: str) -> dict:
    rows = [r for r in summary()["functions"] if name_part in r["name"]]
    assert len(rows) == 1, rows
    return rows[0]


def scale(x, n):
    return x * n


def test_every_jit_form_goes_through_optimize():
    x = jnp.arange(4.0)
    with autoopt.patch():
        wrapped = jax.jit(scale, static_argnums=1)
        factory = jax.jit(static_argnums=1)(scale)  # jax.jit without fun: a decorator
        partial_form = functools.partial(jax.jit, static_argnums=(1,))(scale)

        @jax.jit
        def decorated(x):
            return x + 1

        @functools.partial(jax.jit, static_argnames="n")
        def decorated_partial(x, n):
            return x - n

        forms = [wrapped, factory, partial_form, decorated, decorated_partial]
        assert all(isinstance(f, OptimizedFunction) for f in forms), forms
        np.testing.assert_array_equal(wrapped(x, 3), real_jit(scale, static_argnums=1)(x, 3))
        np.testing.assert_array_equal(factory(x, 2), x * 2)
        np.testing.assert_array_equal(partial_form(x, 2), x * 2)
        np.testing.assert_array_equal(decorated(x), x + 1)
        np.testing.assert_array_equal(decorated_partial(x, n=2), x - 2)
        assert isinstance(wrapped.lower(x, 3), jax.stages.Lowered)
        assert isinstance(wrapped.trace(x, 3), jax.stages.Traced)
    assert jax_jit_is_real()


def test_eval_shape_of_a_patched_jit():
    with autoopt.patch():
        out = jax.jit(scale, static_argnums=1).eval_shape(jnp.zeros((2, 3)), 2)
    assert (out.shape, out.dtype) == ((2, 3), jnp.float32)


def test_bad_jit_keywords_raise_jaxs_own_error():
    def f(x):
        return x

    with pytest.raises(TypeError) as plain:
        real_jit(f, no_such_option=1)
    with autoopt.patch(), pytest.raises(TypeError) as patched:
        jax.jit(f, no_such_option=1)
    assert str(patched.value) == str(plain.value)


def test_a_bad_option_to_patch_says_which_options_exist():
    with pytest.raises((TypeError, ValueError), match="donate"):
        autoopt.patch(donat="auto")
    assert jax_jit_is_real()


def test_undo_restores_jax_jit_and_undoing_twice_does_nothing():
    undo = autoopt.patch()
    assert not jax_jit_is_real() and undo.active
    undo()
    assert jax_jit_is_real() and not undo.active
    undo()
    undo.undo()
    assert jax_jit_is_real()
    assert not isinstance(jax.jit(scale, static_argnums=1), OptimizedFunction)


def test_nested_patches_end_with_the_outermost_and_apply_the_innermost_options():
    def f(x):
        return x * 2.0

    outer = autoopt.patch()
    with autoopt.patch(donate="off") as inner:
        assert jax.jit(f).inspect(jnp.ones(3)).options.donate == "off"
    assert not inner.active and outer.active and not jax_jit_is_real()
    assert jax.jit(f).inspect(jnp.ones(3)).options.donate == "safe"
    # undone out of order: the patch lasts until the last one ends
    a, b = autoopt.patch(), autoopt.patch()
    a()
    assert not jax_jit_is_real()
    b()
    outer()
    assert jax_jit_is_real()


def test_an_exception_inside_the_block_restores_jax_jit():
    with pytest.raises(ZeroDivisionError):
        with autoopt.patch():
            assert not jax_jit_is_real()
            1 / 0  # noqa: B018
    assert jax_jit_is_real()


def test_the_patch_is_process_global_jits_made_by_other_threads_are_optimized():
    made = []

    def worker():
        made.append(jax.jit(lambda x: x + 1))

    with autoopt.patch():
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    assert isinstance(made[0], OptimizedFunction)


def test_fresh_wrappers_of_one_function_trace_it_once():
    traces = []

    def f(x):
        traces.append(1)
        return x * 3.0

    x = jnp.ones(8)
    with autoopt.patch():
        for _ in range(20):
            jax.jit(f)(x)  # a new wrapper per call, as in chex or optax's MultiSteps
        assert jax.jit(f) is not jax.jit(f)  # a new object each, as jax.jit's, sharing programs
    assert len(traces) == 1
    row = _row("test_fresh_wrappers_of_one_function_trace_it_once.<locals>.f")
    assert row["compiles"] == 1
    assert row["jit_calls"] == 22


def test_the_wrapper_cache_does_not_keep_functions_alive():
    def make():
        def f(x):
            return x + 1

        return f

    f = make()
    alive = weakref.ref(f)
    with autoopt.patch():
        jax.jit(f)
        del f
        for _ in range(RECENT):  # newer wrappers push it out of the strongly held ones
            jax.jit(make())
    gc.collect()
    assert alive() is None


def test_autoopts_own_jits_stay_plain_under_the_patch():
    def f(x):
        return x.at[1:3].set(0.0)

    x = jnp.arange(6.0)
    with autoopt.patch():
        fast = autoopt.optimize(f, verify=True)  # verify calls jax.jit for its reference
        np.testing.assert_array_equal(fast(x), f(x))
        inspection = fast.inspect(x)
        assert not isinstance(inspection.jit, OptimizedFunction)
        report = autoopt.explain(f, x)  # compiles both programs with jax.jit for the memory
        assert report.memory
        # a module of autoopt calling jax.jit by name gets the real one
        namespace = {"__name__": "autoopt._calls_jit", "jax": jax}
        exec("made = jax.jit(lambda x: x)", namespace)
        assert not isinstance(namespace["made"], OptimizedFunction)


LIBRARY = """
import functools
import jax
from jax import jit

jit_static = functools.partial(jax.jit, static_argnums=1)

def make(f):
    return jit(f)
"""


def test_a_module_that_bound_jit_at_import_gets_the_patch_and_its_binding_back(tmp_path):
    (tmp_path / "boundjit_library.py").write_text(textwrap.dedent(LIBRARY))
    sys.path.insert(0, str(tmp_path))
    try:
        lib = importlib.import_module("boundjit_library")
    finally:
        sys.path.remove(str(tmp_path))
    original_partial = lib.jit_static
    with autoopt.patch():
        assert isinstance(lib.make(lambda x: x + 1), OptimizedFunction)
        made = lib.jit_static(scale)
        assert isinstance(made, OptimizedFunction)
        np.testing.assert_array_equal(made(jnp.ones(2), 4), jnp.full(2, 4.0))
    assert lib.jit is _patch_module.real_jit and lib.jit_static is original_partial
    assert not isinstance(lib.make(lambda x: x + 1), OptimizedFunction)


def test_a_function_optimize_refuses_gets_jax_jit_and_counts_as_a_fallback():
    async def refused(x):  # jax.jit accepts it; optimize does not compile coroutine functions
        return x

    with autoopt.patch():
        made = jax.jit(refused)
    assert not isinstance(made, OptimizedFunction)
    row = _row("refused")
    assert [f["pass"] for f in row["fallbacks"]] == ["options"]
    assert "coroutine" in row["fallbacks"][0]["reason"]


def test_the_summary_counts_compiles_and_what_was_applied():
    with autoopt.patch():

        @jax.jit
        def step(s, x):
            return s + x

        s = jnp.zeros(1000)
        for _ in range(3):
            s = step(s, jnp.ones(1000))
    row = _row("test_the_summary_counts_compiles_and_what_was_applied.<locals>.step")
    assert row["compiles"] == 1 and row["signatures"] == 1
    assert row["applied"] == {"donate": 1}
    assert row["bytes_saved"] == 4000


def test_the_summary_says_a_jit_called_only_inside_another_trace_was_inlined_there():
    # optax's ``tree_bias_correction`` is a jax.jit called inside the user's training step: its
    # arguments are the outer trace's tracers, XLA inlines it into the outer program, and what
    # the outer call donates covers it. The summary must say so, not "traced for a report".
    with autoopt.patch():

        @jax.jit
        def helper(m, c):
            return m / (1 - 0.9**c)

        @jax.jit
        def outer_step(m, c):
            return helper(m, c), c + 1

        m, c = jnp.ones(100), jnp.ones(())
        for _ in range(2):
            m, c = outer_step(m, c)
    row = _row("inside_another_trace_was_inlined_there.<locals>.helper")
    assert row["compiles"] == 0 and row["applied"] == {}
    reasons = {n["what"]: n["reason"] for n in row["not_applied"] if n["kind"] == "donate"}
    assert reasons, row
    for reason in reasons.values():
        assert "inside another jit" in reason and "report only" not in reason, reason


def test_a_rebinding_loop_after_a_warm_up_call_says_why_it_donates_nothing():
    # The warm-up `f(x)` (x kept) is the signature's first call: it fixes the executable that
    # donates nothing, and the loop's `x = step(x)` then runs it (one executable per signature).
    def body(x):
        return x * 0.5 + 1.0

    with autoopt.patch():
        step = jax.jit(body)
        x = jnp.ones(64)
        warm = step(x)
        for _ in range(3):
            before = x.unsafe_buffer_pointer()
            x = step(x)
        data = summary()
    assert x.unsafe_buffer_pointer() != before  # no call donated
    assert not warm.is_deleted()
    (row,) = [r for r in data["functions"] if r["name"].endswith("body")]
    (why,) = [n["reason"] for n in row["not_applied"] if n["what"] == "`x`"]
    assert "fixed by an earlier call that could not donate it" in why
    assert "make the rebinding call first" in why


def test_jit_of_a_function_jitted_before_the_patch_nests_it_as_jax_jit_does():
    """Found running jax's own tests under ``autoopt run`` (the fifth review): ``jax.jit(g)`` of
    a g jitted with ``donate_argnums`` before the patch began took g's options over, so the
    caller's array was deleted, where jax.jit nests g and its donation deletes nothing."""

    def f(x):
        return x * 2

    donating = jax.jit(f, donate_argnums=0)
    with autoopt.patch():
        x = jnp.arange(4.0)
        y = jax.jit(donating)(x)
        assert not x.is_deleted()
        np.testing.assert_array_equal(y, np.arange(4.0) * 2)
        x = jnp.arange(4.0)
        x = jax.jit(donating)(x)  # a rebinding call may donate: autoopt's own proof decides
        np.testing.assert_array_equal(x, np.arange(4.0) * 2)
    # optimize() of a jitted function runs it as calling it would (documented): its donation
    x = jnp.arange(4.0)
    autoopt.optimize(donating)(x)
    assert x.is_deleted()


@pytest.mark.parametrize("donate", ["auto", "off"])
def test_a_jits_own_donate_argnums_under_a_patch_with_a_donate_policy_are_jax_jits(donate):
    """optimize() refuses donate= with donate_argnums; under ``autoopt.patch(donate=...)`` a
    ``jax.jit(f, donate_argnums=...)`` keeps its own donation, as jax.jit's, and is still
    optimized (not left to plain jax.jit)."""

    def f(x, y):
        return x * 2 + y

    with autoopt.patch(donate=donate):
        g = jax.jit(f, donate_argnums=0)
        x, y = jnp.arange(4.0), jnp.ones(4)
        out = g(x, y)
        assert x.is_deleted() and not y.is_deleted()
        np.testing.assert_array_equal(out, np.arange(4.0) * 2 + 1)
        assert isinstance(g, autoopt.OptimizedFunction)


def test_the_optimized_function_has_the_functions_attributes_and_a_safe_repr():
    """jax's own jit tests (``test_jit_wrapped_attributes``, ``test_jit_repr_errors``):
    jax.jit copies the function's attributes (``functools.wraps``), and its repr does not
    raise for a callable whose repr raises."""

    def f(x):
        return x + 1

    f.some_value = 4
    assert autoopt.optimize(f).some_value == 4
    f.some_value = 5  # as each jax.jit(f) copies them then
    assert autoopt.optimize(f).some_value == 5

    class Loud:
        def __call__(self, x):
            return x

        def __repr__(self):
            raise ValueError("no repr")

    assert repr(autoopt.optimize(Loud())) == "<autoopt.optimize>"


def test_an_eager_op_compiled_while_the_call_traces_is_not_the_functions_compile():
    # diffrax and equinox compute some values at trace time (``jax.ensure_compile_time_eval``):
    # each such op compiles once, as under jax.jit. The summary's listener counted that compile
    # as the traced function's and made its report there, mid-trace: the report traced the
    # user's function again inside the trace (a diffrax solve's first call took 4x jax.jit's,
    # with 40 compiles for jax.jit's 4).
    traces = []
    with autoopt.patch():

        @jax.jit
        def eager_inside(x):
            traces.append(1)
            with jax.ensure_compile_time_eval():
                k = jnp.arange(3.0) * 7.0  # eager: compiles outside the traced program
            return x + k

        out = eager_inside(jnp.ones(3))
    np.testing.assert_array_equal(out, np.ones(3) + np.arange(3.0) * 7.0)
    assert len(traces) == 1  # (a report made mid-trace traced it again)
    row = _row("is_not_the_functions_compile.<locals>.eager_inside")
    assert row["compiles"] == 1 and row["signatures"] == 1
    assert summary()["other_compiles"]


def test_the_summary_says_a_program_calling_back_into_python_is_not_donated_and_why():
    # (it said the executable "was fixed by an earlier call", and to make the rebinding call
    # first: an equinox program with runtime error checks, which call back, never donates)
    with autoopt.patch():

        @jax.jit
        def checked_step(s):
            jax.debug.callback(lambda v: None, s[0])
            return s * 2.0

        s = jnp.ones(256)
        for _ in range(2):
            s = checked_step(s)
    row = _row("calling_back_into_python_is_not_donated_and_why.<locals>.checked_step")
    reasons = [n["reason"] for n in row["not_applied"] if n["kind"] == "donate"]
    assert reasons and all("calls back into Python" in r for r in reasons), row
    assert not any("fixed by an earlier call" in r for r in reasons)


def test_the_frameworks_wrappers_keep_their_public_attributes_under_the_patch():
    # (equinox's `.fn`, `.donate_first`; nnx's `.jitted_fn`, `.static_argnums` raised
    # AttributeError: code reading them broke under `autoopt run`)
    eqx = pytest.importorskip("equinox")
    nnx = pytest.importorskip("flax.nnx")

    def f(x):
        return x * 2

    plain_e, plain_n = eqx.filter_jit(f), nnx.jit(f, static_argnums=())
    with autoopt.patch():
        e, n = eqx.filter_jit(f), nnx.jit(f, static_argnums=())
    assert type(e).__name__ == "EquinoxJit" and type(n).__name__ == "NnxJit"
    for name in ("fn", "donate_first", "filter_warning"):
        assert getattr(e, name) == getattr(plain_e, name), name
    assert n.static_argnums == plain_n.static_argnums and n.in_shardings == plain_n.in_shardings
    with pytest.raises(AttributeError):
        e.no_such_attribute  # noqa: B018
    np.testing.assert_array_equal(e(jnp.ones(3)), plain_e(jnp.ones(3)))
