"""Random caller programs around a donating call: the fuzzer of ``donate="safe"``'s proof.

The donation proof is about the caller's code (``callsite.py``): whether the statement that
calls an optimized function rebinds what it passes, and whether anything else can still reach
it. So the fuzzer generates callers, not callees: small Python modules whose ``main()`` runs a
random sequence of statements (aliases, containers, attributes, module globals, closures and
``nonlocal``, star calls, tuple, subscript, attribute and starred targets, comprehensions,
lambdas, generators, ``functools.partial``/``reduce`` callees, a local name bound to a builtin
calling back, methods, loops, a host callback that raises inside ``try``, a thread reading a
global while the call runs) around calls of ``step``. Each program runs twice, in modules
compiled from the same source: with ``step`` a plain ``jax.jit`` and with ``step`` an
``autoopt.optimize`` (``donate="safe"``). The check: the autoopt run raises what the jit run
raises, reads no deleted array (every value ``main`` still holds at its end is read, and every
``_read`` on the way), and every number it returns equals the jit run's, bit for bit.

The source is written to a file and executed from there, so the proof reads it as it reads a
user's file. ``CallerResult.donated`` counts the calls whose output took the donated buffer
(the instrumented ``V = step(V, W)`` statements): a fuzzer whose programs never donate would
test nothing.

    from autoopt.testing import caller_programs, check_caller_program
    @given(caller_programs())
    def test_no_caller_loses_an_array(source):
        check_caller_program(source)

``benchmarks/caller_fuzz.py --minutes N`` runs it for long.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import tempfile
import textwrap
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from hypothesis import strategies as st

__all__ = [
    "CallerResult",
    "build_program",
    "caller_programs",
    "check_caller_program",
    "run_caller_program",
]

VARS = ("x", "y", "z")
ALIASES = ("a", "b")


# --- the callees ---------------------------------------------------------------------------------


def _step(v, w):
    return v * 0.5 + w


def _step2(v, w):
    return v + w, w * 2.0


def _raise_on_host(v):
    raise ValueError("a host callback raised")


def _step_raise(v, w):
    # io_callback: its error fails the call (jax.debug.callback's is logged as well)
    from jax.experimental import io_callback

    return v * 0.5 + w + io_callback(_raise_on_host, jax.ShapeDtypeStruct(v.shape, v.dtype), v)


_CALLEES = {"step": _step, "step2": _step2, "step_raise": _step_raise}


# --- the statements ------------------------------------------------------------------------------

# Each template is a few lines of ``main``'s body; {V} and {W} are array variables (VARS), {A}
# an alias name. Every name a template reads exists from the prologue on, so any sequence of
# templates is a valid program.
TEMPLATES: dict[str, str] = {
    # the rebinding calls the proof accepts (instrumented: ``_note`` counts donations)
    "call": "_p = _ptr({V})\n{V} = step({V}, {W})\n_note(_p, {V})",
    "call_kw": "_p = _ptr({V})\n{V} = step({V}, w={W})\n_note(_p, {V})",
    "call_tuple": "{V}, {W} = step2({V}, {W})",
    "call_same_twice": "{V} = step({V}, {V})",
    "call_local_alias": "s = step\n{V} = s({V}, {W})",
    "call_attr": "ns.fn = step\n{V} = ns.fn({V}, {W})",
    "call_global": "_p = _ptr(G)\nG = step(G, {W})\n_note(_p, G)",
    "call_loop": "for _ in range(2):\n    {V} = step({V}, {W})",
    "call_if": "if _flag:\n    {V} = step({V}, {W})\nelse:\n    {V} = {V} + 1.0",
    "call_nonlocal": "def bump():\n    nonlocal {V}\n    {V} = step({V}, {W})\nbump()",
    # aliases and other holders
    "alias": "{A} = {V}",
    "alias_global": "G = {V}",
    "list": "lst.append({V})",
    "dict": "d['k'] = {V}",
    "attr": "box.v = {V}",
    "tuple": "tup = ({V},)",
    "closure": "def reader():\n    return {V}\nreaders.append(reader)",
    "lambda_holder": "readers.append(lambda: {V})",
    "fresh": "{V} = {V} + 0.0",
    "view": "{A} = {V}[...]",
    "read": "_read({V})",
    "read_alias": "_read({A})",
    "drop_alias": "{A} = None",
    # call shapes the proof must refuse (or that must not matter)
    "star_list": "{V} = step(*[{V}, {W}])",
    "star_rest": "rest = ({W},)\n{V} = step({V}, *rest)",
    "star_kw": "kw = {{'w': {W}}}\n{V} = step({V}, **kw)",
    "subscript_target": "d[_key({V})], {V} = step2({V}, {W})",
    "attr_target": "box.v, {V} = step2({V}, {W})",
    "starred_target": "{V}, *more = step2({V}, {W})",
    "comprehension": "outs = [step(v, {W}) for v in [{V}]]",
    "comprehension_rebind": "{V} = [step(v, {W}) for v in [{V}]][0]",
    "generator": "gen = (step(v, {W}) for v in [{V}])\n{V} = next(gen)",
    "lambda_callee": "f = lambda v: step(v, {W})\n{V} = f({V})",
    "partial": "p = functools.partial(step, w={W})\n{V} = p({V})",
    "reduce": "{V} = functools.reduce(step, [{W}, {W}], {V})",
    "builtin_local": "reducer = functools.reduce\n{V} = reducer(step, [{W}], {V})",
    "builtin_list": "lst = [{V}, {W}]\nreducer = functools.reduce\nlst = reducer(step, lst)",
    "expression_arg": "{V} = step({V} * 1.0, {W})",
    "discard": "_ = step({V}, {W})",
    "new_name": "{A} = step({V}, {W})",
    "raise_caught": (
        "try:\n    {V} = step_raise({V}, {W})\n    _read({V})\nexcept Exception as e:\n"
        "    caught.append(type(e).__name__)"
    ),
    "wrong_shape_caught": (
        "try:\n    {V} = step({V}, jnp.ones(3))\nexcept Exception as e:\n"
        "    caught.append(type(e).__name__)"
    ),
    "thread_reads_global": (
        "G = {V}\nstop = threading.Event()\nt = threading.Thread(target=_watch, args=(stop,))\n"
        "t.start()\nG = step(G, {W})\nstop.set()\nt.join()"
    ),
    "recursion": (
        "def rec(n, v):\n    return v if n == 0 else rec(n - 1, step(v, {W}))\n{V} = rec(2, {V})"
    ),
    "method": "m = Model()\n{V} = m.apply({V}, {W})",
}

# How often each template is drawn relative to the others: the plain rebinding calls are
# weighted up so that most programs donate somewhere.
WEIGHTS = {"call": 6, "call_kw": 2, "call_tuple": 2, "call_loop": 2, "call_global": 2}

_PROLOGUE = """\
import functools
import threading

import jax.numpy as jnp

G = None
_watch_errors = []


def _watch(stop):
    # another thread reading the global while the call runs
    while not stop.is_set():
        try:
            _read(G)
        except Exception as e:
            _watch_errors.append(repr(e))
            return


class Box:
    pass


class Model:
    def apply(self, v, w):
        return step(v, w)


def main():
    global G
    G = jnp.zeros(4)
    x = jnp.arange(4.0) + 1.0
    y = jnp.full(4, 0.5)
    z = jnp.linspace(0.0, 1.0, 4)
    a = b = None
    lst, d, box, tup, readers, caught = [], {}, Box(), (), [], []
    ns = Box()
    _flag = True
"""

_EPILOGUE = """\
    held = dict(locals())
    held["G"] = G
    held["readers"] = [r() for r in readers]
    held["box"] = getattr(box, "v", None)
    return _keep(held)
"""


def render(statements: list[str]) -> str:
    """The module source of a program: the prologue, the statements in ``main``, the epilogue."""
    body = "".join(textwrap.indent(s.rstrip("\n") + "\n", "    ") for s in statements)
    return _PROLOGUE + body + _EPILOGUE


def build_program(choose: Callable[[Any], Any], max_statements: int = 8) -> str:
    """A caller module's source, each choice made by ``choose(sequence) -> element`` (a
    hypothesis draw, or ``random.Random.choice`` for the long run)."""
    names = [n for n, w in sorted(TEMPLATES.items()) for _ in range(WEIGHTS.get(n, 1))]
    n = choose(range(max_statements + 1))
    # One plain rebinding call at a random place in every program: the statements around it
    # decide whether it may donate, and most programs then exercise a donation or a refusal.
    at = choose(range(n + 1))
    statements = []
    for i in range(n + 1):
        name = "call" if i == at else choose(names)
        v, w, a = choose(VARS), choose(VARS), choose(ALIASES)
        statements.append(TEMPLATES[name].format(V=v, W=w, A=a))
    return render(statements)


@st.composite
def caller_programs(draw, max_statements: int = 8) -> str:
    """A caller module's source (see the module docstring)."""
    return build_program(lambda seq: draw(st.sampled_from(seq)), max_statements)


# --- running and checking ------------------------------------------------------------------------


@dataclasses.dataclass
class CallerResult:
    """One run of a program: what ``main`` returned (name -> NumPy value), or the exception it
    raised (``error``: type name and message), the donations counted, the watch thread's
    errors."""

    values: dict[str, Any] | None
    error: str | None
    donated: int
    watch_errors: list[str]


_DELETED = "deleted"


def _read(value):
    """Read every array in ``value`` (raises on a deleted one, as any use would)."""
    for leaf in jax.tree_util.tree_leaves(value):
        if isinstance(leaf, jax.Array):
            np.asarray(leaf)


def _keep(held: dict) -> dict:
    """NumPy copies of every array ``main`` still holds, by name (containers flattened)."""
    out = {}
    for name in sorted(held):
        value = held[name]
        if name.startswith("_") or callable(value):
            continue
        if isinstance(value, threading.Thread | threading.Event):
            continue
        if name in ("box", "ns") and not isinstance(value, jax.Array):
            continue
        leaves, _ = jax.tree_util.tree_flatten(value)
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, jax.Array):
                # a deleted array raises here, as the caller's next use would
                out[f"{name}[{i}]"] = np.asarray(leaf)
            elif isinstance(leaf, int | float | str | bool):
                out[f"{name}[{i}]"] = leaf
    return out


def _ptr(value) -> int | None:
    """The device address of an array (an int: holding it keeps nothing alive)."""
    return value.unsafe_buffer_pointer() if isinstance(value, jax.Array) else None


_files = itertools.count()
_dir: str | None = None


def _module_path() -> str:
    global _dir
    if _dir is None:
        _dir = tempfile.mkdtemp(prefix="autoopt_callers_")
    return os.path.join(_dir, f"caller_{next(_files)}.py")


def run_caller_program(source: str, wrap: Callable[[Callable], Callable]) -> CallerResult:
    """Run ``source``'s ``main`` in a fresh module whose callees are ``wrap(callee)``."""
    donated = [0]

    def note(before, after) -> None:
        if before is not None and before == _ptr(after):
            donated[0] += 1

    path = _module_path()
    with open(path, "w") as f:
        f.write(source)
    namespace: dict[str, Any] = {
        "__name__": f"autoopt_caller_{os.path.basename(path)[:-3]}",
        "__file__": path,
        "_read": _read,
        "_keep": _keep,
        "_ptr": _ptr,
        "_note": note,
        "_key": lambda v: float(np.asarray(v).sum()),
        **{name: wrap(fn) for name, fn in _CALLEES.items()},
    }
    # jax logs a failing callback's traceback before raising: the raise is what is compared
    quiet = logging.getLogger("jax._src.callback")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        exec(compile(source, path, "exec"), namespace)
        values, error = namespace["main"](), None
    except Exception as e:  # noqa: BLE001 - compared with the jit run's error
        values, error = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        quiet.setLevel(level)
        os.unlink(path)
    return CallerResult(values, error, donated[0], list(namespace.get("_watch_errors", [])))


def _autoopt(fn: Callable) -> Callable:
    from autoopt._jit import optimize

    return optimize(fn, donate="safe", fallback="raise")


def check_caller_program(source: str) -> CallerResult:
    """Run ``source`` under ``jax.jit`` and under ``autoopt.optimize``; raise AssertionError
    (with the source) unless autoopt's run raised what jit's raised, lost no array and returned
    the same numbers. Returns autoopt's run."""
    plain = run_caller_program(source, jax.jit)
    fast = run_caller_program(source, _autoopt)

    def fail(why: str) -> AssertionError:
        return AssertionError(f"{why}\n--- caller program ---\n{source}")

    if fast.watch_errors:
        raise fail(f"a thread reading the global hit {fast.watch_errors[0]}")
    if (plain.error is None) != (fast.error is None):
        raise fail(f"jax.jit: {plain.error or 'no error'}; autoopt: {fast.error or 'no error'}")
    if plain.error is not None and plain.error.split(":")[0] != (fast.error or "").split(":")[0]:
        raise fail(f"jax.jit raised {plain.error}; autoopt raised {fast.error}")
    if plain.values is not None and fast.values is not None:
        if plain.values.keys() != fast.values.keys():
            raise fail(f"held values differ: {sorted(plain.values)} vs {sorted(fast.values)}")
        for name, want in plain.values.items():
            got = fast.values[name]
            same = (
                np.asarray(want).dtype == np.asarray(got).dtype
                and np.array_equal(want, got, equal_nan=True)
                if isinstance(want, np.ndarray)
                else want == got
            )
            if not same:
                raise fail(f"{name}: jax.jit gave {want!r}, autoopt gave {got!r}")
    return fast
