"""An optimized function frees what it holds when dropped, as a jax.jit object does.

``jax.jit(lambda a: a + params)`` made anew each step frees each step's ``params`` (the
closure, and the program's constants) as soon as the jit object and the lambda are dropped:
jax's caches hold them weakly. An optimized function's programs, jit objects and plans refer
to each other, so left alone they are a reference cycle that only the garbage collector frees;
on a device that is memory jax.jit would have freed, and an out-of-memory error it would not
raise. Checked with the collector disabled: an array the function closed over is freed the
moment the last reference goes (a weak reference to it dies), under autoopt exactly when under
jax.jit.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoopt


@pytest.fixture
def no_gc():
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _loss(params, a):
    return a + params[0][:4]


class _Model:
    def __init__(self, params):
        self.params = params

    def step(self, a):
        return a + self.params[0][:4]

    def __call__(self, a):
        return a * self.params[0][:4]


def _closure(params):
    return lambda a: a + params[0][:4]


def _nested_def(params):
    def step(a, scale=1.0):
        return a * scale + params[0][:4]

    return step


# (name, make(params) -> the function, jit keywords, call(f, x))
_KINDS = [
    ("lambda", _closure, {}, lambda f, x: f(x)),
    ("nested def, donated", _nested_def, {"donate_argnums": 0}, lambda f, x: f(x + 0.0)),
    (
        "static argument",
        lambda p: lambda a, s: a * s + p[0][:4],
        {"static_argnums": 1},
        lambda f, x: f(x, 2.0),
    ),
    ("partial", lambda p: functools.partial(_loss, p), {}, lambda f, x: f(x)),
    ("bound method", lambda p: _Model(p).step, {}, lambda f, x: f(x)),
]


def _freed(jit, make, kw, call, steps: int = 3) -> list[bool]:
    """Whether each step's closed-over array is freed once the step's function and its
    jitted function are dropped (the last step's array is still bound here)."""
    x = jnp.ones(4)
    refs = []
    for i in range(steps):
        params = [jnp.full(1000, float(i))]
        fn = make(params)
        f = jit(fn, **kw)
        np.testing.assert_array_equal(
            np.asarray(call(f, x)), np.asarray(call(jax.jit(fn, **kw), x))
        )
        refs.append(weakref.ref(params[0]))
        del f, fn
    return [r() is None for r in refs]


@pytest.mark.parametrize("name, make, kw, call", _KINDS, ids=[k[0] for k in _KINDS])
def test_a_dropped_optimized_function_frees_its_closure_at_once(no_gc, name, make, kw, call):
    expected = _freed(jax.jit, make, kw, call)
    assert expected[:-1] == [True] * (len(expected) - 1)  # jax.jit frees at once
    assert _freed(autoopt.optimize, make, kw, call) == expected


@pytest.mark.parametrize("options", [{}, {"explain": True}, {"donate": "auto"}, {"remat": "auto"}])
def test_options_that_build_more_objects_free_at_once(no_gc, options):
    got = _freed(
        lambda fn, **kw: autoopt.optimize(fn, **kw, **options),
        _closure,
        {},
        lambda f, x: f(x + 0.0),  # (a new argument each call: "auto" donates it)
    )
    assert got == [True, True, False]


def test_under_the_patch_jax_jit_frees_at_once(no_gc):
    with autoopt.patch():
        got = _freed(jax.jit, _closure, {}, lambda f, x: f(x))
        # options optimize refuses: the patch's jax.jit is jax.jit's own
        refused = _freed(jax.jit, _closure, {"keep_unused": True}, lambda f, x: f(x))
    assert got == [True, True, False]
    assert refused == [True, True, False]


def test_copies_and_inspection_keep_the_programs_until_the_last_goes(no_gc):
    params = [jnp.full(1000, 3.0)]
    fn = _closure(params)
    f = autoopt.optimize(fn)
    x = jnp.ones(4)
    f(x)
    g = copy.copy(f)
    ref = weakref.ref(params[0])
    del f, fn, params
    assert ref() is not None  # g still holds the function
    np.testing.assert_array_equal(np.asarray(g(x)), np.full(4, 4.0))
    report = g.explain(x)
    assert report is not None
    del g, report
    assert ref() is None


class _Counting:
    def __init__(self):
        self.traces = 0

    def __call__(self, a):
        self.traces += 1
        return a * 2.0


@pytest.mark.parametrize("kind", ["function", "partial", "bound method", "callable instance"])
@pytest.mark.parametrize("patched", [False, True], ids=["optimize", "patched jax.jit"])
def test_programs_stay_while_the_function_lives(kind, patched, no_gc):
    """Dropping every optimized wrapper of a callable that is still alive keeps its programs,
    as jax.jit keeps a live callable's: ``optimize(f)(x)`` in a loop traces once. (A plain
    function and a partial hold them; a bound method's and a callable instance's are found
    until the garbage collector frees them: hence ``no_gc``, which the first two do not need.)"""
    counting = _Counting()
    fn = {
        "function": lambda a: counting(a),
        "partial": functools.partial(lambda c, a: c(a), counting),
        "bound method": counting.__call__,
        "callable instance": counting,
    }[kind]
    x = jnp.ones(4)
    with autoopt.patch() if patched else contextlib.nullcontext():
        jit = jax.jit if patched else autoopt.optimize
        for _ in range(4):
            np.testing.assert_array_equal(np.asarray(jit(fn)(x)), np.full(4, 2.0))
            if kind in ("function", "partial"):
                gc.collect()
    assert counting.traces == 1


def test_a_wrapper_made_after_an_inspection_outlived_its_sibling():
    """An inspection keeps its optimized function's programs (its jit object runs new
    signatures while it lives); a wrapper made later finds them."""
    model = _Model([jnp.arange(8.0)])
    f = autoopt.optimize(model)
    x = jnp.ones(4)
    inspection = f.inspect(x)
    del f
    np.testing.assert_array_equal(np.asarray(autoopt.optimize(model)(x)), np.arange(4.0))
    del inspection


@pytest.mark.parametrize("before_a_call", [True, False])
@pytest.mark.parametrize("static", [False, True])
def test_an_inspections_jit_object_runs_after_its_function_is_dropped(before_a_call, static):
    """``optimize(f).inspect(x).jit`` is a jax.jit object: it runs and lowers new signatures
    for as long as it is held, as jax.jit's does, whatever else was dropped."""

    def make():
        params = [jnp.arange(8.0)]
        if static:
            return lambda a, s: a * s["k"] + params[0][: a.shape[0]]
        return lambda a: a + params[0][: a.shape[0]]

    fn = make()
    f = autoopt.optimize(fn)
    # (a string leaf: the arguments' non-array leaves are static, a function of their own)
    args = (jnp.ones(4), {"k": 2.0, "mode": "add"}) if static else (jnp.ones(4),)
    if not before_a_call:
        f(*args)
    inspection = f.inspect(*args)
    if not static:
        assert inspection.function is fn
    again = (jnp.ones(4, jnp.int32), *args[1:])  # a signature not traced yet
    expected = np.asarray(fn(*again))
    del f, fn
    if not static:  # (the static leaves' jit object lowers the caller's arguments; not called)
        np.testing.assert_array_equal(np.asarray(inspection.jit(*again)), expected)
    assert inspection.jit.lower(*again).compile() is not None
    assert inspection.jit.eval_shape(*again).shape == expected.shape


def test_a_function_whose_code_is_replaced_traces_the_new_code():
    """IPython's autoreload assigns a function's ``__code__``: a signature traced after it runs
    the new code under jax.jit, and under autoopt (whose programs trace a copy of the
    function, so that they do not keep it alive)."""

    def make():
        def f(a, b=1.0):
            return a + b

        return f

    def g(a, b=1.0):
        return a * b * 3.0

    results = []
    for jit in (jax.jit, autoopt.optimize):
        f = make()
        jf = jit(f)
        first = np.asarray(jf(jnp.ones(4)))
        f.__code__ = g.__code__
        f.__defaults__ = (2.0,)
        same = np.asarray(jf(jnp.ones(4)))  # a signature traced before: its program
        new = np.asarray(jf(jnp.ones(5)))  # a new one: the new code
        fresh = np.asarray(jit(f)(jnp.ones(6)))
        results.append((first, same, new, fresh))
    for got, expected in zip(results[1], results[0]):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("kind", ["function", "bound method", "partial", "callable instance"])
def test_threads_dropping_and_making_wrappers_at_once(kind):
    """Wrappers of one function made, called and dropped on several threads at once: every
    call gives jax.jit's numbers and no wrapper finds programs another thread released."""
    model = _Model([jnp.arange(8.0)])
    fns = {
        "function": _closure([jnp.arange(8.0)]),
        "bound method": None,  # a new one each time
        "partial": functools.partial(_loss, [jnp.arange(8.0)]),
        "callable instance": model,
    }
    x = jnp.ones(4)
    expected = np.asarray(jax.jit(fns[kind] or model.step)(x))
    errors: list[BaseException] = []

    def work():
        try:
            for _ in range(40):
                f = autoopt.optimize(fns[kind] or model.step)
                np.testing.assert_array_equal(np.asarray(f(x)), expected)
                del f
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_a_partials_keywords_changed_later_are_traced_as_under_jax_jit():
    """The programs trace a copy of a partial that shares its arguments and keywords: a
    keyword set in ``p.keywords`` afterwards, or a new state, reaches a new signature's trace,
    as under jax.jit."""

    def f(a, scale):
        return a * scale

    results = []
    for jit in (jax.jit, autoopt.optimize):
        p = functools.partial(f, scale=2.0)
        jp = jit(p)
        got = [np.asarray(jp(jnp.ones(4)))]
        p.keywords["scale"] = 3.0
        got.append(np.asarray(jp(jnp.ones(5))))
        p.__setstate__((f, (), {"scale": 5.0}, None))
        got.append(np.asarray(jit(p)(jnp.ones(6))))
        results.append(got)
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_under_the_patch_a_frameworks_jit_is_jitted_again_and_again():
    eqx = pytest.importorskip("equinox")
    nnx = pytest.importorskip("flax.nnx")
    x = jnp.ones(4)
    made_before = eqx.filter_jit(lambda a: a * 2.0)
    with autoopt.patch():
        for g in (made_before, nnx.jit(lambda a: a * 3.0), eqx.filter_jit(lambda a: a + 1.0)):
            expected = np.asarray(g(x))
            for _ in range(2):  # the second finds the first one's in the patch's cache
                np.testing.assert_array_equal(np.asarray(jax.jit(g)(x)), expected)


def test_under_the_patch_a_jit_object_made_before_is_freed():
    """``jax.jit(g)`` of a jit object ``g`` made before the patch traces a call of ``g``
    (``nested_call``): held by ``g`` itself, never by a table that would keep ``g`` alive."""
    x = jnp.ones(4)
    refs = []
    for i in range(3):
        params = jnp.full(1000, float(i))
        made_before = jax.jit(lambda a, p=params: a + p[:4])
        with autoopt.patch():
            jax.jit(made_before)(x)
        refs.append(weakref.ref(params))
        del made_before, params
    gc.collect()
    assert [r() is None for r in refs] == [True, True, True]
