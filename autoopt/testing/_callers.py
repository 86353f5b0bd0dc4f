"""Random caller programs around a donating call: the fuzzer of ``donate="safe"``'s proof.

The donation proof is about the caller's code (``callsite.py``): whether the statement that
calls an optimized function rebinds what it passes, and whether anything else can still reach
it. So the fuzzer generates callers, not callees: small Python modules that run a random
sequence of statements (aliases, containers, attributes, module globals, closures and
``nonlocal``, star calls, tuple, subscript, attribute and starred targets, comprehensions,
lambdas, generators, ``functools.partial``/``reduce`` callees, a local name bound to a builtin
calling back, methods, loops, a host callback that raises inside ``try``, a thread reading a
global while the call runs) around calls of ``step``. Besides those:

* nested and starred targets that may fail to unpack after the call (``(x, y), z = f(x, y,
  z)`` where ``f``'s first output has three elements; outputs that are lists, dicts, arrays
  whose leading axis has the wrong length, 0-d arrays): the caller catches the error and
  checks that every argument is still alive and holds its value from before the call;
* argument expressions that run code: a helper that moves the argument's array into another
  name and rebinds the argument's name (``global`` at module level, ``nonlocal`` on a closure
  cell in a function), one that raises, a nested call of ``step``, a walrus;
* ``locals()``/``vars()`` snapshots taken before the call, which must hold afterwards what they
  held under jax.jit (same names, same values, nothing deleted);
* an optimized method whose ``self`` changes between calls, and plain mutable objects passed as
  arguments (jax.jit refuses both with TypeError: autoopt must refuse them too, or compute with
  their current state, never with the first one);
* flax nnx modules mutated inside an optimized function that does not return them (jax.jit
  drops the mutation silently: autoopt must carry it back as nnx.jit does, or raise saying to
  use nnx.jit or to return the state).

A program's statements run either in a function ``main`` (``mode="function"``: locals, cells)
or at module level (``mode="module"``: every name a global). Each program runs twice, in
modules compiled from the same source: with every callee a plain ``jax.jit`` (the reference
run) and with every callee an ``autoopt.optimize`` (``donate="safe"``). The check: the autoopt
run raises what the jit run raises (and never an error about a deleted array that the jit run
did not raise), reads no deleted array (every value the program still holds at its end is read,
and every ``_read`` on the way), every number it holds equals the jit run's, bit for bit, and
the statements that check autoopt against another reference than jax.jit (``_expect``,
``_nnx_check``: the current state of a mutable argument, nnx.jit's mutation) hold. Such
statements leave the same state in both runs (what the correct behaviour leaves), so that
everything after them is still compared with the jit run.

The source is written to a file and executed from there, so the proof reads it as it reads a
user's file. Each statement is preceded by a ``# [template]`` comment naming the template it
came from. ``CallerResult.donated`` counts the calls whose output took the donated buffer
(the instrumented ``V = step(V, W)`` statements): a fuzzer whose programs never donate would
test nothing.

    from autoopt.testing import caller_programs, check_caller_program
    @given(caller_programs())
    def test_no_caller_loses_an_array(source):
        check_caller_program(source)

``caller_programs(templates=GROUPS["unpack"])`` draws from one group of templates (plus the
plain rebinding call every program has). ``benchmarks/caller_fuzz.py --minutes N`` runs it for
long; each program there is built from its own seed (``build_program(random.Random(seed)
.choice)``), which a counterexample prints.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import re
import tempfile
import textwrap
import threading
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

__all__ = [
    "GROUPS",
    "CallerMismatch",
    "CallerResult",
    "build_program",
    "caller_programs",
    "check_caller_program",
    "run_caller_program",
]

VARS = ("x", "y", "z")
ALIASES = ("a", "b")
MODES = ("function", "module")
# Learning rates and gains: powers of two, so that ``v - lr * g`` rounds the same computed by
# NumPy in the program as by XLA (fused or not).
FACTORS = ("0.5", "0.25", "2.0")


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


def _step_flag(v, w, training=False):
    return v * 0.5 + w if training else v - w


_CALLEES = {"step": _step, "step2": _step2, "step_raise": _step_raise}
# Callees with a static argument (as a training step takes its flag): their plans are keyed by
# its value (``_plans.static_key``).
_STATIC_CALLEES = {"step_flag": (_step_flag, "training")}

# The outputs of the ``unpack_<kind>`` callees (defined in the program's source, so each is a
# function of its own), of ``s``, the sum of the arguments: tuples, nested tuples, lists and
# dicts of several lengths, arrays whose leading axis has several lengths, a 0-d array.
UNPACK_KINDS: dict[str, str] = {
    "pair": "(s + 1.0, s * 2.0)",
    "triple": "(s + 1.0, s * 2.0, s - 1.0)",
    "nested21": "((s + 1.0, s + 2.0), s * 2.0)",
    "nested31": "((s + 1.0, s + 2.0, s + 3.0), s * 2.0)",
    "nested12": "(s + 1.0, (s * 2.0, s - 1.0))",
    "nested13": "(s + 1.0, (s * 2.0, s - 1.0, s + 3.0))",
    "list1": "[s + 1.0]",
    "list2": "[s + 1.0, s * 2.0]",
    "dict2": "{'p': s + 1.0, 'q': s * 2.0}",
    "dict3": "{'p': s + 1.0, 'q': s * 2.0, 'r': s - 1.0}",
    "rows2": "jnp.stack([s + 1.0, s * 2.0])",
    "rows3": "jnp.stack([s + 1.0, s * 2.0, s - 1.0])",
    "rows0": "jnp.zeros((0, 4)) + s[:0]",
    "flat": "s + 1.0",
    "scalar": "s.sum()",
}

# The targets of an unpacking call, with the arguments it passes: the plain names among the
# targets are passed, so the proof sees a statement that rebinds the very names it passed.
UNPACK_TARGETS: tuple[tuple[str, str], ...] = (
    ("({V}, {W}), {U}", "{V}, {W}, {U}"),
    ("[{V}, ({W}, {U})]", "{V}, {W}, {U}"),
    ("{V}, *rest", "{V}, {W}"),
    ("*rest, {V}", "{V}"),
    ("{V}, {W}, *rest", "{V}, {W}"),
    ("({V}, *rest), {W}", "{V}, {W}"),
    ("{V}, {W}", "{V}, {W}"),
    ("{V}, {W}, {U}", "{V}, {W}, {U}"),
    ("[{V}, {W}]", "{V}, {W}"),
    ("{V},", "{V}"),
    ("{V}, {W} = {U}", "{V}, {W}, {U}"),
)


def unpack_template(targets: str, args: str, kind: str) -> str:
    """A call of ``unpack_<kind>(args)`` unpacked into ``targets``, inside ``try``: an error
    (the unpacking's ValueError or TypeError) is caught and every argument read and compared
    with its value before the call (``_same``: raises when one was deleted). Afterwards every
    target name is made a float32[4] array again (``_arr``), so later statements can use it."""
    names = sorted(set(re.findall(r"\{[VWU]\}", targets)))
    fix = "".join(f"{n} = _arr({n})\n" for n in names)
    return (
        f"_b = _vals({args})\n"
        f"try:\n    {targets} = unpack_{kind}({args})\n"
        "except (ValueError, TypeError) as e:\n"
        f"    caught.append(type(e).__name__ + ' ' + _same(_b, {args}))\n" + fix
    )


def _unpack_family(choose: Callable[[Any], Any]) -> tuple[str, str]:
    targets, args = choose(UNPACK_TARGETS)
    kind = choose(sorted(UNPACK_KINDS))
    return f"unpack[{targets} <- {kind}]", unpack_template(targets, args, kind)


# Templates built by a function of the choices (their label names the choices).
FAMILIES: dict[str, Callable[[Callable[[Any], Any]], tuple[str, str]]] = {
    "unpack": _unpack_family,
}


# --- the statements ------------------------------------------------------------------------------


def _mutable_call(setup: str, call: str, want: str, what: str) -> str:
    """``{V} = call`` where jax.jit refuses an argument (TypeError): autoopt must refuse it too
    (then ``{V}`` becomes the value computed in NumPy, as the correct result would be) or
    return the value computed with the argument's current state (``_expect``)."""
    return (
        f"{setup}\n_want = {want}\n"
        f"try:\n    {{V}} = {call}\nexcept TypeError:\n    {{V}} = jnp.asarray(_want)\n"
        f"_expect(_equal({{V}}, _want), {what!r})\n"
    )


def _nnx_call(call: str, before: str, changed: str, reset: str, what: str) -> str:
    """``{V} = call`` on an nnx module the callee mutates and does not return: autoopt must
    leave the mutation nnx.jit leaves (``changed``) or raise saying how (``_nnx_check``). Then
    both runs are given nnx.jit's state (``reset``) and result (``{V} * 2.0``: every nnx
    callee returns that)."""
    return (
        f"{before}\n"
        f"try:\n    {{V}} = {call}\n    _r = None\n"
        "except Exception as e:\n    _r = _error_text(e)\n"
        f"_nnx_check(_r, {changed}, {what!r})\n"
        "if _r is not None:\n    {V} = {V} * 2.0\n"
        f"{reset}\n"
    )


_TAKE = "def take():\n    {SCOPE} {V}, keep\n    keep = {V}\n    {V} = {W} + 1.0\n    return {W}\n"
_TAKE_RAISES = (
    "def take_r():\n    {SCOPE} {V}, keep\n    keep = {V}\n    {V} = {W} + 1.0\n"
    "    raise ZeroDivisionError('an argument expression raised')\n"
)
_TAKE_G = "def take_g():\n    global G, KEEP\n    KEEP = G\n    G = {W} + 1.0\n    return {W}\n"
_COUNT = "_c = _np(model.count.value)"
_COUNT_CHANGED = "_equal(model.count.value, _c + 1)"
_COUNT_RESET = "model.count.value = jnp.asarray(_c + 1)"

# Each template is a few lines of the program's body; {V}, {W} and {U} are array variables
# (VARS), {A} an alias name, {SCOPE} ``nonlocal`` in a function and ``global`` at module level,
# {LR} and {LR2} two different factors (FACTORS). Every name a template reads exists from the
# prologue on, so any sequence of templates is a valid program. A template that says
# ``nonlocal`` literally runs in a function only.
TEMPLATES: dict[str, str] = {
    # the rebinding calls the proof accepts (instrumented: ``_note`` counts donations)
    "call": "_p = _ptr({V})\n{V} = step({V}, {W})\n_note(_p, {V})",
    "call_kw": "_p = _ptr({V})\n{V} = step({V}, w={W})\n_note(_p, {V})",
    "call_flag": "_p = _ptr({V})\n{V} = step_flag({V}, {W}, training=_flag)\n_note(_p, {V})",
    "call_flag_pos": "_p = _ptr({V})\n{V} = step_flag({V}, {W}, not _flag)\n_note(_p, {V})",
    "call_flag_w": "{V} = step_flag({V}, w={W}, training=True)",
    "flag_flip": "_flag = not _flag",
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
    # XLA:CPU runs a call inline (its callback's error raised by the call) only when no other
    # work is in flight, else later, at the first read: under jax.jit as under autoopt. Settling
    # first makes where the error surfaces the same in both runs; the template still checks that
    # a call that raised deleted nothing.
    "raise_caught": (
        "_settle()\ntry:\n    {V} = step_raise({V}, {W})\n    _read({V})\nexcept Exception as e:\n"
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
    # 1. targets that may fail to unpack after the call (more: the "unpack" family)
    "unpack_nested_fails": unpack_template("({V}, {W}), {U}", "{V}, {W}, {U}", "nested31"),
    "unpack_inner_fails": unpack_template("[{V}, ({W}, {U})]", "{V}, {W}, {U}", "nested13"),
    "unpack_starred_short": unpack_template("{V}, {W}, *rest", "{V}, {W}", "list1"),
    "unpack_dict_keys": unpack_template("{V}, {W}", "{V}, {W}", "dict3"),
    "unpack_rows": unpack_template("{V}, {W}", "{V}, {W}", "rows3"),
    "unpack_scalar": unpack_template("{V}, *rest", "{V}", "scalar"),
    # 2. argument expressions that run code
    "arg_take": _TAKE + "_b = _vals({V})\n{V} = step({V}, take())\ncaught.append(_same(_b, keep))",
    "arg_take_kw": (
        _TAKE + "_b = _vals({V})\n{V} = step({V}, w=take())\ncaught.append(_same(_b, keep))"
    ),
    "arg_take_raises": (
        _TAKE_RAISES + "_b = _vals({V})\ntry:\n    {V} = step({V}, take_r())\n"
        "except ZeroDivisionError:\n    caught.append('raised')\n"
        "caught.append(_same(_b, keep))\n_read({V})"
    ),
    "arg_take_global": (
        _TAKE_G + "_b = _vals(G)\nG = step(G, take_g())\ncaught.append(_same(_b, KEEP))"
    ),
    "arg_raises": (
        "_b = _vals({V})\ntry:\n    {V} = step({V}, _boom())\nexcept ZeroDivisionError:\n"
        "    caught.append('raised')\ncaught.append(_same(_b, {V}))"
    ),
    "arg_nested_call": "{V} = step({V}, step({V}, {W}))",
    "arg_nested_first": "{V} = step(step({V}, {W}), {V})",
    "arg_nested_raises": (
        "_b = _vals({V})\ntry:\n    {V} = step(step({V}, {W}), _boom())\n"
        "except ZeroDivisionError:\n    caught.append('raised')\ncaught.append(_same(_b, {V}))"
    ),
    "arg_walrus": "{V} = step({V}, (keep := {V}) * 0.0 + {W})\n_read(keep)",
    "arg_stash": "holder = []\n{V} = step({V}, _stash(holder, {V}, {W}))\n_read(holder)",
    # 3. snapshots of the namespace taken before the call
    "locals_call": (
        "snap = locals()\n_p = _ptr({V})\n{V} = step({V}, {W})\n_note(_p, {V})\n"
        "caught.append(_snapshot(snap))"
    ),
    "locals_local_callee": (
        "s = step\nsnap = locals()\n{V} = s({V}, {W})\ncaught.append(_snapshot(snap))"
    ),
    "vars_attr_callee": (
        "ns.fn = step\nsnap = vars()\n{V} = ns.fn({V}, {W})\ncaught.append(_snapshot(snap))"
    ),
    "locals_copy": "snap = dict(locals())\n{V} = step({V}, {W})\ncaught.append(_snapshot(snap))",
    "locals_take": "snap = locals()",
    "locals_read": "caught.append(_snapshot(snap))",
    # 4. an optimized method whose self changes; plain mutable objects as arguments
    "method_lr": "".join(
        _mutable_call(
            f"opt.lr = {{{lr}}}",
            "opt.step({V}, {W})",
            "_np({V}) - np.float32(opt.lr) * _np({W})",
            "opt.step(w, g) computed with a stale self.lr",
        )
        for lr in ("LR", "LR2")
    ),
    "method_fresh_self": "".join(
        _mutable_call(
            "",
            f"Opt({{{lr}}}).step({{V}}, {{W}})",
            f"_np({{V}}) - np.float32({{{lr}}}) * _np({{W}})",
            "Opt(lr).step(w, g) computed with another instance's lr",
        )
        for lr in ("LR", "LR2")
    ),
    "cfg_gain": "".join(
        _mutable_call(
            f"cfg.gain = {{{g}}}",
            "scale(cfg, {V})",
            "_np({V}) * np.float32(cfg.gain)",
            "scale(cfg, v) computed with a stale cfg.gain",
        )
        for g in ("LR", "LR2")
    ),
    "cfg_in_tuple": "".join(
        _mutable_call(
            f"cfg.gain = {{{g}}}",
            "scale_t((cfg, {V}))",
            "_np({V}) * np.float32(cfg.gain)",
            "scale_t((cfg, v)) computed with a stale cfg.gain",
        )
        for g in ("LR", "LR2")
    ),
    "cfg_kw": "".join(
        _mutable_call(
            f"cfg.gain = {{{g}}}",
            "scale(v={V}, cfg=cfg)",
            "_np({V}) * np.float32(cfg.gain)",
            "scale(v=v, cfg=cfg) computed with a stale cfg.gain",
        )
        for g in ("LR", "LR2")
    ),
    "cls_gain": "".join(
        _mutable_call(
            f"Cfg.gain = {{{g}}}",
            "scale(Cfg, {V})",
            "_np({V}) * np.float32(Cfg.gain)",
            "scale(Cfg, v), the class itself, computed with a stale Cfg.gain",
        )
        for g in ("LR", "LR2")
    ),
    "dict_get": "".join(
        _mutable_call(
            f"d['gain'] = {{{g}}}",
            "scale_get(d.get, {V})",
            "_np({V}) * np.float32(d['gain'])",
            "scale_get(d.get, v) computed with a stale d['gain']",
        )
        for g in ("LR", "LR2")
    ),
    "fresh_wrapper_method": "".join(
        _mutable_call(
            f"plain.lr = {{{lr}}}",
            "_wrap(plain.step)({V}, {W})",
            "_np({V}) - np.float32(plain.lr) * _np({W})",
            "_wrap(plain.step)(w, g), a new wrapper per call, computed with a stale self.lr",
        )
        for lr in ("LR", "LR2")
    ),
    # 5. nnx modules mutated inside, not returned
    "nnx_count": _nnx_call(
        "nnx_bump(model, {V})",
        _COUNT,
        _COUNT_CHANGED,
        _COUNT_RESET,
        "nnx_bump(model, v) does model.count.value += 1",
    ),
    "nnx_assign": _nnx_call(
        "nnx_set_w(model, {V})",
        "_want = _np(model.w.value) * np.float32(0.5) + _np({V})",
        "_equal(model.w.value, _want)",
        "model.w.value = jnp.asarray(_want)",
        "nnx_set_w(model, v) does model.w.value = model.w.value * 0.5 + v",
    ),
    "nnx_method": _nnx_call(
        "model({V})",
        _COUNT,
        _COUNT_CHANGED,
        _COUNT_RESET,
        "model(v), an optimized __call__, does self.count.value += 1",
    ),
}

# The templates of each kind of hole the fuzzer looks for; ``caller_programs(templates=...)``
# draws from one group.
GROUPS: dict[str, tuple[str, ...]] = {
    "unpack": (
        "unpack",
        "unpack_nested_fails",
        "unpack_inner_fails",
        "unpack_starred_short",
        "unpack_dict_keys",
        "unpack_rows",
        "unpack_scalar",
        "starred_target",
        "call_tuple",
        "alias",
        "read_alias",
    ),
    "argument_code": (
        "arg_take",
        "arg_take_kw",
        "arg_take_raises",
        "arg_take_global",
        "arg_raises",
        "arg_nested_call",
        "arg_nested_first",
        "arg_nested_raises",
        "arg_walrus",
        "arg_stash",
        "closure",
        "call_nonlocal",
        "call_global",
    ),
    "locals": (
        "locals_call",
        "locals_local_callee",
        "vars_attr_callee",
        "locals_copy",
        "locals_take",
        "locals_read",
        "call_local_alias",
        "call_attr",
        "closure",
        "alias",
    ),
    "mutable_self": (
        "method_lr",
        "method_fresh_self",
        "cfg_gain",
        "cfg_in_tuple",
        "cfg_kw",
        "cls_gain",
        "dict_get",
        "fresh_wrapper_method",
        "alias",
    ),
    "nnx": ("nnx_count", "nnx_assign", "nnx_method", "alias", "read_alias"),
}

# How often each template is drawn relative to the others: the plain rebinding calls are
# weighted up so that most programs donate somewhere, and the unpacking family (many programs
# in one name) too.
WEIGHTS = {"call": 6, "call_kw": 2, "call_tuple": 2, "call_loop": 2, "call_global": 2, "unpack": 4}

_HEADER = """\
import functools
import operator
import threading

import jax.numpy as jnp
import numpy as np

G = None
KEEP = None
_watch_errors = []


def _watch(stop):
    # another thread reading the global while the call runs
    while not stop.is_set():
        try:
            _read(G)
        except Exception as e:
            _watch_errors.append(repr(e))
            return


def _boom(*_):
    raise ZeroDivisionError("an argument expression raised")


def _stash(holder, v, w):
    holder.append(v)
    return w


def _add(*vs):
    return functools.reduce(operator.add, [v for v in vs if v is not None])


class Box:
    pass


class Model:
    def apply(self, v, w):
        return step(v, w)
"""

_SETUP = """\
G = jnp.zeros(4)
x = jnp.arange(4.0) + 1.0
y = jnp.full(4, 0.5)
z = jnp.linspace(0.0, 1.0, 4)
a = b = None
lst, d, box, tup, readers, caught = [], {}, Box(), (), [], []
ns = Box()
_flag = True
keep = None
rest = more = ()
snap = {}
"""

# Parts of the header (and of the setup) a program has only when its statements use them:
# ``(pattern found in the statements, module source, setup lines)``.
_PARTS: tuple[tuple[str, str, str], ...] = (
    (
        r"\b(opt|Opt)\b",
        """
class Opt:
    def __init__(self, lr):
        self.lr = lr

    @_wrap
    def step(self, w, g):
        return w - self.lr * g
""",
        "opt = Opt(0.5)\n",
    ),
    (
        r"\bplain\b",
        """
class PlainOpt:
    def __init__(self, lr):
        self.lr = lr

    def step(self, w, g):
        return w - self.lr * g
""",
        "plain = PlainOpt(0.5)\n",
    ),
    (
        r"\bscale_get\b",
        """
@_wrap
def scale_get(get, v):
    return v * get("gain")
""",
        "",
    ),
    (
        r"\b(cfg|Cfg)\b",
        """
class Cfg:
    gain = 1.0


@_wrap
def scale(cfg, v):
    return v * cfg.gain


@_wrap
def scale_t(t):
    return t[1] * t[0].gain
""",
        "cfg = Cfg()\n",
    ),
    (
        r"\bmodel\b",
        """
from flax import nnx


class Counter(nnx.Module):
    def __init__(self):
        self.count = nnx.Variable(jnp.zeros((), jnp.int32))
        self.w = nnx.Param(jnp.ones(4))

    @_wrap
    def __call__(self, v):
        self.count.value += 1
        return v * 2.0


@_wrap
def nnx_bump(model, v):
    model.count.value += 1
    return v * 2.0


@_wrap
def nnx_set_w(model, v):
    model.w.value = model.w.value * 0.5 + v
    return v * 2.0
""",
        "model = Counter()\n",
    ),
)

_EPILOGUE = """\
    held = dict(locals())
    held["G"] = G
    held["KEEP"] = KEEP
    held["readers"] = [r() for r in readers]
    held["box"] = getattr(box, "v", None)
    held["snap"] = _snapshot(snap)
    return _keep(held)
"""

_MODULE_EPILOGUE = """\


def main():
    held = dict(globals())
    held["readers"] = [r() for r in readers]
    held["box"] = getattr(box, "v", None)
    held["snap"] = _snapshot(snap)
    return _keep(held)
"""


def _unpack_part(kind: str) -> str:
    return (
        f"\n\n@_wrap\ndef unpack_{kind}(v, w=None, u=None):\n"
        f"    s = _add(v, w, u)\n    return {UNPACK_KINDS[kind]}\n"
    )


def render(statements: list[str], mode: str = "function") -> str:
    """The module source of a program: the header (with the parts the statements use), then
    the statements in ``main`` (``mode="function"``) or at module level (``"module"``), and
    ``main`` returning what the program holds."""
    if mode not in MODES:
        raise ValueError(f"mode is one of {MODES}, not {mode!r}")
    body = "".join(s.rstrip("\n") + "\n" for s in statements)
    header, setup = _HEADER, _SETUP
    for pattern, part, part_setup in _PARTS:
        if re.search(pattern, body):
            header += part
            setup += part_setup
    for kind in sorted(set(re.findall(r"\bunpack_(\w+)\(", body))):
        header += _unpack_part(kind)
    if mode == "module":
        return header + "\n\n" + setup + body + _MODULE_EPILOGUE
    lines = "global G, KEEP\n" + setup + body
    return header + "\n\ndef main():\n" + textwrap.indent(lines, "    ") + _EPILOGUE


def _allowed(template: str, mode: str) -> bool:
    return mode == "function" or "nonlocal" not in TEMPLATES.get(template, "")


def build_program(
    choose: Callable[[Any], Any],
    max_statements: int = 8,
    mode: str | None = None,
    templates: Iterable[str] | None = None,
) -> str:
    """A caller module's source, each choice made by ``choose(sequence) -> element`` (a
    hypothesis draw, or ``random.Random(seed).choice`` for the long run). ``mode``: where the
    statements run (drawn when None); ``templates``: the names (of TEMPLATES and FAMILIES) to
    draw from, all when None."""
    mode = str(choose(MODES)) if mode is None else mode
    pool = sorted(set(TEMPLATES) | set(FAMILIES)) if templates is None else sorted(set(templates))
    unknown = [n for n in pool if n not in TEMPLATES and n not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown templates: {unknown}")
    names = [n for n in pool if _allowed(n, mode) for _ in range(WEIGHTS.get(n, 1))]
    if not names:
        names = ["call"]
    n = choose(range(max_statements + 1))
    # One plain rebinding call at a random place in every program: the statements around it
    # decide whether it may donate, and most programs then exercise a donation or a refusal.
    at = choose(range(n + 1))
    statements = []
    for i in range(n + 1):
        name = "call" if i == at else choose(names)
        v, w, u, a = choose(VARS), choose(VARS), choose(VARS), choose(ALIASES)
        lr = choose(FACTORS)
        lr2 = FACTORS[(FACTORS.index(lr) + 1) % len(FACTORS)]
        if name in FAMILIES:
            label, template = FAMILIES[name](choose)
        else:
            label, template = name, TEMPLATES[name]
        scope = "nonlocal" if mode == "function" else "global"
        text = template.format(V=v, W=w, U=u, A=a, SCOPE=scope, LR=lr, LR2=lr2)
        statements.append(f"# [{label}]\n{text}")
    return render(statements, mode)


def caller_programs(
    max_statements: int = 8,
    mode: str | None = None,
    templates: Iterable[str] | None = None,
):
    """A hypothesis strategy of caller modules' sources (see the module docstring and
    ``build_program``). hypothesis is imported here, when a strategy is asked for: the rest of
    ``autoopt.testing`` works without it."""
    from autoopt.testing._fuzz import hypothesis_modules

    st, _ = hypothesis_modules()

    @st.composite
    def sources(draw) -> str:
        return build_program(
            lambda seq: draw(st.sampled_from(seq)), max_statements, mode, templates
        )

    return sources()


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


class CallerMismatch(Exception):
    """Raised inside a program's autoopt run by a statement that checks autoopt against another
    reference than jax.jit (``_expect``, ``_nnx_check``)."""


def _read(value):
    """Read every array in ``value`` (raises on a deleted one, as any use would)."""
    for leaf in jax.tree_util.tree_leaves(value):
        if isinstance(leaf, jax.Array):
            np.asarray(leaf)


def _settle() -> None:
    """Wait for every computation in flight (a poisoned array's error is not this call's)."""
    for array in jax.live_arrays():
        try:
            array.block_until_ready()
        except Exception:  # noqa: BLE001 - an earlier call's error, already compared
            pass


def _np(value) -> np.ndarray:
    """A NumPy copy of an array (raises on a deleted one)."""
    return np.array(value, copy=True)


def _vals(*values) -> tuple:
    """NumPy copies of the arguments of a call about to be made: holding them keeps no
    reference to the arrays, so the proof sees the references the caller's statement holds."""
    return tuple(_np(v) if isinstance(v, jax.Array) else v for v in values)


def _same(before: tuple, *now) -> str:
    """For each value (an argument after a failed call, or the array a helper moved it to): "="
    when it equals its copy from before the call, "!" when the caller has rebound it. Raises
    when one is a deleted array: jax.jit deletes nothing, so the caller lost it."""
    out = ""
    for i, (was, value) in enumerate(zip(before, now)):
        if isinstance(value, jax.Array) and value.is_deleted():
            raise RuntimeError(
                f"Array has been deleted: value {i} of {len(now)} checked after the call "
                "(an argument, or the name a helper moved it to) is reachable and deleted"
            )
        same = (
            isinstance(value, jax.Array | np.ndarray)
            and isinstance(was, np.ndarray)
            and was.shape == value.shape
            and np.array_equal(was, np.asarray(value))
        )
        out += "=" if same else "!"
    return out


def _arr(value):
    """``value`` when it is a float32[4] array (deleted or not: a later read tells), else a
    fresh one: after an unpacking, a name may hold a key, a tuple, a row."""
    if isinstance(value, jax.Array) and value.shape == (4,) and value.dtype == np.float32:
        return value
    return jax.numpy.full(4, 3.0)


def _equal(got, want) -> bool:
    return bool(np.array_equal(np.asarray(got), np.asarray(want)))


def _describe(value, seen: tuple, depth: int = 0) -> str:
    if any(value is s for s in seen):
        return "<self>"
    if isinstance(value, jax.Array | np.ndarray):
        # a deleted array raises here: the snapshot held it, and it was lost
        return f"{np.asarray(value).dtype}{np.asarray(value).tolist()!r}"
    if value is None or isinstance(value, int | float | str | bool):
        return repr(value)
    if isinstance(value, list | tuple) and depth < 3:
        inner = ", ".join(_describe(v, seen, depth + 1) for v in value)
        return f"{type(value).__name__}[{inner}]"
    if isinstance(value, dict) and depth < 3:
        inner = ", ".join(
            f"{k!r}: {_describe(value[k], (*seen, value), depth + 1)}"
            for k in sorted(value, key=repr)
            if not (isinstance(k, str) and k.startswith("_"))
        )
        return "{" + inner + "}"
    if callable(value):
        return "callable"  # jax.jit's and autoopt's callees are of different types
    return type(value).__name__


def _snapshot(snap: dict) -> str:
    """What a ``locals()``/``vars()`` snapshot holds: its names (dunder and ``_`` names left
    out: module paths, device addresses) and their values, arrays read (a deleted one raises)."""
    names = sorted(k for k in snap if isinstance(k, str) and not k.startswith("_"))
    return "; ".join(f"{k}={_describe(snap[k], (snap,))}" for k in names)


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _expect(reference: bool, ok: bool, what: str) -> None:
    """In autoopt's run (not the reference's), raise CallerMismatch(what) unless ``ok``."""
    if not reference and not ok:
        raise CallerMismatch(what)


def _nnx_check(reference: bool, error: str | None, changed: bool, what: str) -> None:
    """In autoopt's run: the call raised saying to use nnx.jit or to return the state, or it
    left the mutation nnx.jit leaves. (jax.jit's run drops the mutation silently: no check.)"""
    if reference:
        return
    if error is None and not changed:
        raise CallerMismatch(
            f"{what}: the mutation was silently dropped (nnx.jit carries it back; autoopt "
            "must too, or raise saying to use nnx.jit or to return the state)"
        )
    if error is not None and "nnx.jit" not in error and "return" not in error:
        raise CallerMismatch(
            f"{what}: raised {error.splitlines()[0]!r}, which says neither to use nnx.jit nor "
            "to return the state"
        )


def _leaves(value) -> list:
    """``value``'s pytree leaves, a dict's in the order of its keys' reprs (jax's flattening
    raises on a dict whose keys do not compare: ``d['k']`` and ``d[1.5]`` both set)."""
    if isinstance(value, dict):
        return [leaf for k in sorted(value, key=repr) for leaf in _leaves(value[k])]
    if isinstance(value, list | tuple):
        return [leaf for v in value for leaf in _leaves(v)]
    return jax.tree_util.tree_leaves(value)


def _keep(held: dict) -> dict:
    """NumPy copies of every array the program still holds, by name (containers flattened)."""
    out = {}
    for name in sorted(held):
        value = held[name]
        if name.startswith("_") or callable(value):
            continue
        if isinstance(value, threading.Thread | threading.Event):
            continue
        if name in ("box", "ns") and not isinstance(value, jax.Array):
            continue
        for i, leaf in enumerate(_leaves(value)):
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


def run_caller_program(
    source: str, wrap: Callable[..., Callable], reference: bool = False
) -> CallerResult:
    """Run ``source`` in a fresh module whose callees are ``wrap(callee)`` (the ones it defines
    itself too: ``@_wrap``), then its ``main``. ``reference``: this is the jax.jit run, whose
    ``_expect``/``_nnx_check`` statements check nothing."""
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
        "_settle": _settle,
        "_keep": _keep,
        "_ptr": _ptr,
        "_note": note,
        "_key": lambda v: float(np.asarray(v).sum()),
        "_np": _np,
        "_vals": _vals,
        "_same": _same,
        "_arr": _arr,
        "_equal": _equal,
        "_snapshot": _snapshot,
        "_error_text": _error_text,
        "_expect": functools.partial(_expect, reference),
        "_nnx_check": functools.partial(_nnx_check, reference),
        "_wrap": wrap,
        **{name: wrap(fn) for name, fn in _CALLEES.items()},
        # (only where the program calls them: a ``wrap`` may take no options)
        **{
            name: wrap(fn, static_argnames=s)
            for name, (fn, s) in _STATIC_CALLEES.items()
            if name in source
        },
    }
    # jax logs a failing callback's traceback before raising: the raise is what is compared
    quiet = logging.getLogger("jax._src.callback")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            # flax 0.12 deprecates ``Variable.value``, which is what the programs spell
            warnings.filterwarnings(
                "ignore", message=r".*'\.value' .*deprecated", category=DeprecationWarning
            )
            exec(compile(source, path, "exec"), namespace)
            values, error = namespace["main"](), None
    except Exception as e:  # noqa: BLE001 - compared with the jit run's error
        values, error = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        quiet.setLevel(level)
        os.unlink(path)
    return CallerResult(values, error, donated[0], list(namespace.get("_watch_errors", [])))


def _autoopt(fn: Callable, **options: Any) -> Callable:
    from autoopt._jit import optimize

    return optimize(fn, donate="safe", fallback="raise", **options)


def _deleted(error: str | None) -> bool:
    return error is not None and "deleted" in error.lower()


def check_caller_program(source: str, seed: int | None = None) -> CallerResult:
    """Run ``source`` under ``jax.jit`` and under ``autoopt.optimize``; raise AssertionError
    (with the source, and ``seed`` when given: the seed it was built from) unless autoopt's run
    raised what jit's raised, lost no array, held the same numbers and met every ``_expect``.
    Returns autoopt's run."""
    plain = run_caller_program(source, jax.jit, reference=True)
    fast = run_caller_program(source, _autoopt)

    def fail(why: str) -> AssertionError:
        where = "" if seed is None else f" (seed {seed})"
        return AssertionError(f"{why}\n--- caller program{where} ---\n{source}")

    if fast.watch_errors:
        raise fail(f"a thread reading the global hit {fast.watch_errors[0]}")
    if (plain.error is None) != (fast.error is None):
        raise fail(f"jax.jit: {plain.error or 'no error'}; autoopt: {fast.error or 'no error'}")
    if plain.error is not None and plain.error.split(":")[0] != (fast.error or "").split(":")[0]:
        raise fail(f"jax.jit raised {plain.error}; autoopt raised {fast.error}")
    if _deleted(fast.error) and not _deleted(plain.error):
        # the same type (RuntimeError) for another reason under jax.jit
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
