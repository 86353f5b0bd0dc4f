"""Errors JAX raises while autoopt traces the user's function read as jax.jit's.

They name the user's function, its ``file:line`` and the argument (``state['w']``) as jax.jit's
do, never autoopt's ``flat_fn`` or ``flat[0]`` (``_trace.trace_program`` passes the debug info
jax.jit builds), and their tracebacks show no autoopt frame: the package directory is excluded
as JAX excludes its own (``_compat``), under JAX's own switch ``JAX_TRACEBACK_FILTERING``.

Each message is compared with jax.jit's for the same function object, computed here.
"""

from __future__ import annotations

import os
import re
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoopt

PKG = os.path.dirname(os.path.abspath(autoopt.__file__))
HERE = os.path.abspath(__file__)


# --- the user's functions (one error each, from a value that depends on one argument) --------


def named(g, x):
    return x if g > 0 else -x


def step(state, batch):
    if state["w"].sum() > 0:  # bool of state['w']
        return batch
    return -batch


def keywords(a, *, scale, bias):
    return a * scale if bias > 0 else a


def with_static(n, g, x):
    return x * n if g > 0 else x


def with_static_last(g, x, n=1):
    return x * n if g > 0 else x


def star(*args):
    return args[0] if args[2] > 0 else args[1]


def int_of(x, k):
    return x[: int(k)]  # ConcretizationTypeError naming k


def numpy_of(x, y):
    return np.asarray(y) + x  # TracerArrayConversionError naming y


X = jnp.arange(3.0)

# (function, args, kwargs, jit keywords, the argument jax.jit names)
CASES = {
    "lambda": (lambda g, x: x if g > 0 else -x, (1.0, X), {}, {}, "g"),
    "function": (named, (1.0, X), {}, {}, "g"),
    "pytree": (step, ({"w": X, "b": X}, X), {}, {}, "state['w']"),
    "keywords": (keywords, (X,), {"scale": 2.0, "bias": 1.0}, {}, "bias"),
    "passed_by_keyword": (named, (), {"g": 1.0, "x": X}, {}, "g"),
    "static_argnums": (with_static, (3, 1.0, X), {}, {"static_argnums": (0,)}, "g"),
    "static_argnames": (with_static_last, (1.0, X), {"n": 3}, {"static_argnames": "n"}, "g"),
    "varargs": (star, (X, X, 1.0), {}, {}, "args[2]"),
    "int": (int_of, (X, 2), {}, {}, "k"),
    "numpy": (numpy_of, (X, X), {}, {}, "y"),
}


def _error(call) -> Exception:
    with pytest.raises(Exception) as info:  # noqa: B017 - compared with jax.jit's below
        call()
    return info.value


def _frames(e: BaseException) -> list[str]:
    """The file of each frame ``traceback.format_exception`` prints (chained ones too)."""
    text = "".join(traceback.format_exception(e))
    return re.findall(r'^  File "([^"]+)", line \d+', text, flags=re.M)


def _ours(files: list[str]) -> list[str]:
    return [f for f in files if os.path.abspath(f).startswith(PKG + os.sep)]


def _check_message(ours: Exception, theirs: Exception, arg: str) -> None:
    assert type(ours) is type(theirs)
    assert "flat_fn" not in str(ours) and "flat[" not in str(ours), str(ours)
    assert f"the argument {arg}" in str(theirs)  # the case is what it says
    assert str(ours) == str(theirs)


def _check_user_frames(e: BaseException, fn_name: str) -> None:
    """The user's frames stay: the test's call, and the user's function's line that raised."""
    text = "".join(traceback.format_exception(e))
    assert re.search(rf'File "{re.escape(HERE)}", line \d+, in _error\n', text), text
    assert re.search(rf'File "{re.escape(HERE)}", line \d+, in {re.escape(fn_name)}\n', text)


def _call(wrap, name: str):
    fn, args, kwargs, jit_kw, _ = CASES[name]
    return lambda: wrap(fn, **jit_kw)(*args, **kwargs)


def _optimize_jitted(fn, **jit_kw):
    return autoopt.optimize(jax.jit(fn, **jit_kw))


@pytest.mark.parametrize("wrap", [autoopt.optimize, _optimize_jitted], ids=["plain", "of_jit"])
@pytest.mark.parametrize("name", list(CASES))
def test_message_as_jax_jit(name, wrap):
    theirs = _error(_call(jax.jit, name))
    ours = _error(_call(wrap, name))
    _check_message(ours, theirs, CASES[name][-1])
    # No frame of autoopt's tracing (below jax.jit's boundary) is left, and the user's are.
    files = _frames(ours)
    assert not [f for f in _ours(files) if f.endswith(("_trace.py", "_compat.py"))], files
    _check_user_frames(ours, CASES[name][0].__name__)


def _method_error(wrap):
    """The error of a decorated method; its instance is static (``static_argnums=0``)."""

    class M:
        @wrap
        def method(self, g, x):
            return x if g > 0 else -x

    return _error(lambda: M().method(1.0, X))


def test_decorated_method():
    theirs = _method_error(lambda f: jax.jit(f, static_argnums=0))
    ours = _method_error(lambda f: autoopt.optimize(f, static_argnums=0))
    _check_message(ours, theirs, "g")
    _check_user_frames(ours, "method")


@pytest.mark.parametrize("entry", ["trace", "lower"])
def test_aot_message_as_jax_jit(entry):
    fn, args, kwargs, jit_kw, arg = CASES["pytree"]
    theirs = _error(lambda: getattr(jax.jit(fn, **jit_kw), entry)(*args, **kwargs))
    ours = _error(lambda: getattr(autoopt.optimize(fn, **jit_kw), entry)(*args, **kwargs))
    _check_message(ours, theirs, arg)


@pytest.fixture
def filtering():
    """Set ``jax_traceback_filtering`` (JAX_TRACEBACK_FILTERING) for one test."""
    before = jax.config.jax_traceback_filtering  # pyright: ignore[reportAttributeAccessIssue]
    yield lambda mode: jax.config.update("jax_traceback_filtering", mode)
    jax.config.update("jax_traceback_filtering", before)


def test_filtering_off_shows_every_frame(filtering):
    """JAX's own switch: with filtering off, autoopt's frames (and JAX's) are all printed, and
    the message still names the user's function."""
    filtering("off")
    theirs = _error(_call(jax.jit, "pytree"))
    ours = _error(_call(autoopt.optimize, "pytree"))
    _check_message(ours, theirs, "state['w']")
    files = _frames(ours)
    assert any(f.endswith(os.path.join("autoopt", "_trace.py")) for f in files), files
    assert any(os.sep + os.path.join("jax", "_src") + os.sep in f for f in files), files
    _check_user_frames(ours, "step")


def test_remove_frames_mode(filtering):
    """``remove_frames``: the filtered traceback, with the whole one kept as its cause."""
    filtering("remove_frames")
    ours = _error(_call(autoopt.optimize, "lambda"))
    assert type(ours.__cause__).__name__ == "UnfilteredStackTrace"
    assert "for jit" in str(ours) and "argument g" in str(ours)
    assert "flat_fn" not in str(ours)


# --- no autoopt frame at all -----------------------------------------------------------------
# The frames above jax.jit's boundary (``OptimizedFunction.__call__``, ``_dispatch``, the
# placer) are filtered at autoopt's own entry points (``_jit/_function.py``).


@pytest.mark.parametrize("wrap", [autoopt.optimize, _optimize_jitted], ids=["plain", "of_jit"])
@pytest.mark.parametrize("name", list(CASES))
def test_no_autoopt_frames(name, wrap):
    ours = _error(_call(wrap, name))
    assert _ours(_frames(ours)) == []
    _check_user_frames(ours, CASES[name][0].__name__)


def test_no_autoopt_frames_method():
    ours = _method_error(lambda f: autoopt.optimize(f, static_argnums=0))
    assert _ours(_frames(ours)) == []
    _check_user_frames(ours, "method")


@pytest.mark.parametrize("entry", ["trace", "lower"])
def test_no_autoopt_frames_aot(entry):
    fn, args, kwargs, jit_kw, _ = CASES["pytree"]
    ours = _error(lambda: getattr(autoopt.optimize(fn, **jit_kw), entry)(*args, **kwargs))
    assert _ours(_frames(ours)) == []
    _check_user_frames(ours, "step")


# --- an equinox Module's traced flag -----------------------------------------------------------


def test_a_traced_equinox_flag_raises_jax_jits_error_with_what_to_do():
    """``autoopt.optimize(loss)(model, ...)`` with a Dropout in the model: jax.jit traces its
    Python ``inference`` flag and raises TracerBoolConversionError, and so does autoopt (the
    drop-in's semantics); eqx.filter_jit makes the flag static. autoopt's error is jax.jit's,
    with a note saying what to do (a new user read the error as autoopt's bug)."""
    eqx = pytest.importorskip("equinox")

    class Model(eqx.Module):
        lin: eqx.nn.Linear
        drop: eqx.nn.Dropout

    def loss(m, x, key):
        return jnp.sum(m.drop(jax.nn.relu(m.lin(x)), key=key))

    m = Model(eqx.nn.Linear(4, 4, key=jax.random.key(0)), eqx.nn.Dropout(0.1))
    args = (m, jnp.ones(4), jax.random.key(1))
    with pytest.raises(jax.errors.TracerBoolConversionError) as want:
        jax.jit(loss)(*args)
    with pytest.raises(jax.errors.TracerBoolConversionError) as got:
        autoopt.optimize(loss)(*args)
    assert str(got.value) == str(want.value)
    notes = " ".join(getattr(got.value, "__notes__", ()))
    assert "eqx.filter_jit" in notes and "eqx.field(static=True)" in notes, notes
    assert float(eqx.filter_jit(loss)(*args)) == float(eqx.filter_jit(loss)(*args))

    def plain(x, flag):  # no Module among the arguments: jax.jit's error as it is
        return x * 2 if flag else x

    with pytest.raises(jax.errors.TracerBoolConversionError) as bare:
        autoopt.optimize(plain)(jnp.ones(2), True)
    assert not any("equinox" in n for n in getattr(bare.value, "__notes__", ()))
