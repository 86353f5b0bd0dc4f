"""``autoopt.patch()``: every ``jax.jit`` in unmodified code goes through ``autoopt.optimize``.

    with autoopt.patch():              # or: undo = autoopt.patch(); ...; undo()
        run_my_existing_training()

While a patch is active, ``jax.jit`` is a function that returns ``autoopt.optimize(f, **kw)`` for
``jax.jit(f, **kw)``, ``@jax.jit``, ``partial(jax.jit, **kw)`` and the decorator factory
``jax.jit(**kw)(f)``; ``.lower``, ``.trace`` and the call are the optimized function's. Modules
that bound the name at import (``from jax import jit``, ``jit = partial(jax.jit, ...)``) get the
same function in that binding, and their binding back on undo.

What stays plain:

- jits created by jax and by autoopt itself: a ``jax.jit`` called from a module of ``jax``,
  ``jaxlib`` or ``autoopt`` reaches the real ``jax.jit`` (``real_jit``). autoopt builds its
  executables with ``jax.jit`` at run time (``_jit._function``: the jit objects per donated set,
  the eager-autodiff and nested jits, ``verify``'s reference; ``report``'s memory figures;
  ``passes.remat``'s measurements; ``passes.placement._prefetch``; ``testing``'s reference), so
  routing those through ``optimize`` would recurse.
- functions jitted before the patch: ``@jax.jit`` ran at their import and made a plain jit
  object, which no rebinding reaches. ``autoopt run`` patches before the script imports anything.
- a call site whose options ``optimize`` refuses: it gets the real ``jax.jit`` and counts as a
  fallback of pass ``"options"`` in the summary.

A wrapper made anew for each call (``jax.jit(f)(x)`` in a loop) finds the optimized function made
for the same function (by identity) and options, as jax.jit's wrappers share one trace cache;
each ``jax.jit(f)`` is a new object sharing its programs, and the cache keeps no function alive
(``_jit._reuse``).

The patch is process-global, like assigning ``jax.jit``: jits created by any thread while a patch
is active are optimized. Patches nest (the innermost active one's options apply); each undo ends
its own patch, and ``jax.jit`` is restored when the last one ends. Undoing twice does nothing.

``summary()`` reports per jitted function (by definition site): how many jit objects were asked
for, the XLA compiles made for it, the signatures traced, what the passes applied and the bytes
saved (per compiled executable: an argument its executable donates counts once, whatever its
calls did; the calls the run-time checks refused are listed under "not applied"), and the
fallbacks with their pass.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import re
import sys
import textwrap
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

import jax
from jax import monitoring

from autoopt import _compat
from autoopt._jit import RECENT as _RECENT
from autoopt._jit import WrapperCache, options_key

__all__ = ["patch", "Patch", "FunctionSummary", "summary", "real_jit", "RECENT"]

# The jax.jit this process started with. autoopt.patch is imported by ``import autoopt``, before
# any patch can be active.
real_jit: Callable = jax.jit

# Optimized functions kept alive after their wrapper is dropped (the fresh-wrapper cache).
RECENT = _RECENT

# Callers whose jax.jit stays plain (see the module docstring).
_PLAIN_CALLERS = ("jax", "jaxlib", "autoopt")

# jax.monitoring's event for one XLA compile; its listener gets ``fun_name``.
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_COPY_COMPILE = "jit(_copy_all)"  # ``_dispatch.device_copies``'s compiled copy

_NOT_GIVEN = object()


@dataclasses.dataclass
class FunctionSummary:
    """One jitted function (by name and definition site) under the patch."""

    name: str
    location: str | None
    jit_calls: int = 0  # jax.jit(...) calls that returned a wrapper of it
    compiles: int = 0  # XLA compiles made by its calls
    signatures: int = 0  # input signatures traced (most seen at once, per wrapper)
    applied: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    bytes_saved: int = 0
    fallbacks: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    fallback_reasons: dict = dataclasses.field(default_factory=dict)  # pass -> first reason
    _seen: set = dataclasses.field(default_factory=set, repr=False)
    # the optimized functions of this row, read at summary time for what was not applied
    _fns: weakref.WeakSet = dataclasses.field(default_factory=weakref.WeakSet, repr=False)

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "location": self.location,
            "jit_calls": self.jit_calls,
            "compiles": self.compiles,
            "signatures": self.signatures,
            "applied": dict(self.applied),
            "bytes_saved": self.bytes_saved,
            "fallbacks": [
                {"pass": p, "count": n, "reason": self.fallback_reasons.get(p, "")}
                for p, n in sorted(self.fallbacks.items())
            ],
            "not_applied": _not_applied(self),
        }


class _State:
    def __init__(self):
        self.lock = threading.RLock()
        self.handles: list[Patch] = []
        self.rebound: list[tuple[dict, str, Any, Any]] = []  # (namespace, name, was, now)
        self.listening = False
        # fn -> what jax.jit(fn, **options) returned (an optimized function, or the plain jit
        # of options optimize refuses), per options
        self.wrappers = WrapperCache()
        self.rows: dict[tuple, FunctionSummary] = {}
        self.row_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.other_compiles: collections.Counter = collections.Counter()


_state = _State()


# --- the patched jax.jit ---------------------------------------------------------------------


@functools.wraps(real_jit)
def _patched_jit(fun: Any = _NOT_GIVEN, /, **kwargs: Any):
    caller = sys._getframe(1).f_globals.get("__name__", "")
    try:
        options = _state.handles[-1].options  # the innermost patch's (another thread may undo)
    except IndexError:
        options = None
    if options is None or caller.split(".", 1)[0] in _PLAIN_CALLERS:
        return real_jit(**kwargs) if fun is _NOT_GIVEN else real_jit(fun, **kwargs)
    if fun is _NOT_GIVEN:  # the decorator factory: jax.jit(static_argnums=1)(f)
        real_jit(**kwargs)  # jax.jit's own checks of the keywords, and its errors
        return functools.partial(_jit_through_optimize, kwargs=kwargs, options=options)
    return _jit_through_optimize(fun, kwargs=kwargs, options=options)


def _jit_through_optimize(fun: Any, *, kwargs: dict, options: dict):
    key = _options_key(kwargs, options)
    cached = _cached(fun, key)
    if cached is not None:
        if isinstance(cached, _Refused):
            new = real_jit(fun, **kwargs)
        else:  # (a framework's jit, equinox's or nnx's, is one object, returned as it is)
            handle = getattr(cached, "_handle", None)
            new = cached if handle is None else handle()
        if new is not None:  # (None: its programs were released, ``OptimizedFunction._release``)
            row = _row(cached)
            row.jit_calls += 1
            _state.row_of[new] = row
            return new
    plain = real_jit(fun, **kwargs)  # jax.jit's own errors for bad input, unchanged
    from autoopt._jit import argnums_given, nested_call, optimize

    # ``jax.jit(g)`` of a function jax.jit wrapped before the patch began: under jax.jit, g's
    # options act inside the outer program (its donation deletes nothing), so g is traced as
    # the nested call it is, where ``optimize(g)`` would take its options over.
    subject = nested_call(fun) if _compat.is_jit_object(fun) else fun
    if options.get("donate") is not None and any(
        argnums_given(kwargs.get(k)) for k in ("donate_argnums", "donate_argnames")
    ):
        # this jit's own donation, as jax.jit donates it, over the patch's policy (optimize
        # refuses both at once)
        options = {k: v for k, v in options.items() if k != "donate"}
    try:
        result = optimize(subject, **kwargs, **options)
        refused = None
    except Exception as e:  # noqa: BLE001 - optimize refuses these options: plain jax.jit
        result, refused = plain, e
    # What the cache keeps must not refer to ``fun`` (``_reuse``): the optimized functions'
    # shared one, or for options optimize refuses a mark (each ``jax.jit`` then jax.jit's own).
    shared = _Refused() if refused is not None else getattr(result, "_shares", None) or result
    row = _row_for(fun, result, shared)
    row.jit_calls += 1
    if refused is not None:
        _count_fallback(row, "options", f"{type(refused).__name__}: {refused}")
    _remember(fun, key, shared)
    return result


class _Refused:
    """The cache's entry for a ``jax.jit`` whose options ``optimize`` refused."""

    __slots__ = ("__weakref__",)


# --- equinox.filter_jit ----------------------------------------------------------------------
# ``eqx.filter_jit`` calls ``jax.jit`` from its own frame, so the donation proof of a jax.jit
# routed through optimize would read equinox's statement, never the user's. Under the patch,
# ``filter_jit`` itself returns ``_jit._equinox.EquinoxJit``, whose call is the user's
# statement. A ``filter_jit`` with ``donate=`` other than "none", or with jax.jit keywords,
# stays equinox's own (the user chose its donation); so does one called from equinox itself.

_EQX_PLAIN_CALLERS = (*_PLAIN_CALLERS, "equinox")


def _real_filter_jit() -> Callable | None:
    mod = sys.modules.get("equinox._jit")
    return getattr(mod, "filter_jit", None) if mod is not None else None


_real_filter_jit_fn: Callable | None = None


def _patched_filter_jit(fun: Any = _NOT_GIVEN, /, *, donate: Any = "none", **jitkwargs: Any):
    real = _real_filter_jit_fn
    assert real is not None  # installed only once equinox is imported
    if fun is _NOT_GIVEN:  # @eqx.filter_jit(donate=...)
        return functools.partial(_patched_filter_jit, donate=donate, **jitkwargs)
    caller = sys._getframe(1).f_globals.get("__name__", "")
    try:
        options = _state.handles[-1].options
    except IndexError:
        options = None
    if (
        options is None
        or caller.split(".", 1)[0] in _EQX_PLAIN_CALLERS
        or donate != "none"
        or jitkwargs
    ):
        return real(fun, donate=donate, **jitkwargs)
    okey = _options_key({}, options)
    key = ("equinox.filter_jit", okey) if okey is not None else None
    cached = _cached(fun, key)
    if cached is not None:
        _row(getattr(cached, "_inner", cached)).jit_calls += 1
        return cached
    from autoopt._jit import EquinoxJit

    try:
        result = EquinoxJit(fun, _LazyFilterJit(real, fun), options)
        refused = None
    except Exception as e:  # noqa: BLE001 - autoopt cannot route it: equinox's own
        result, refused = real(fun), e
    row = _row_for(fun, getattr(result, "_inner", result))
    row.jit_calls += 1
    if refused is not None:
        _count_fallback(row, "options", f"{type(refused).__name__}: {refused}")
    _remember(fun, key, result)
    return result


class _LazyFilterJit:
    """Equinox's own wrapper of ``fun``, made on first use (``lower``): making it builds a
    jax.jit, which under the patch would be one more function in the summary."""

    def __init__(self, real: Callable, fun: Any):
        self._real, self._fun, self._made = real, fun, None

    def __getattr__(self, name: str) -> Any:
        if self._made is None:
            self._made = self._real(self._fun)
        return getattr(self._made, name)


# --- flax nnx.jit ---------------------------------------------------------------------------
# As for filter_jit: ``nnx.jit`` calls ``jax.jit`` from its own frame, so under the patch
# ``nnx.jit`` itself returns ``_jit._nnx.NnxJit``, whose call is the user's statement. nnx
# options NnxJit cannot keep exactly (shardings, the user's own donation, device, tree mode)
# keep nnx's own wrapper; so does an nnx.jit called from flax itself.

_NNX_PLAIN_CALLERS = (*_PLAIN_CALLERS, "flax")
_real_nnx_jit_fn: Callable | None = None


def _real_nnx_jit() -> Callable | None:
    mod = sys.modules.get("flax.nnx.transforms.compilation")
    return getattr(mod, "jit", None) if mod is not None else None


def _patched_nnx_jit(fun: Any = _NOT_GIVEN, /, **kwargs: Any):
    real = _real_nnx_jit_fn
    assert real is not None  # installed only once flax.nnx is imported
    if fun is _NOT_GIVEN or type(fun).__name__ == "Missing":  # @nnx.jit(static_argnums=...)
        return functools.partial(_patched_nnx_jit, **kwargs)
    caller = sys._getframe(1).f_globals.get("__name__", "")
    try:
        options = _state.handles[-1].options
    except IndexError:
        options = None
    from autoopt._jit import NnxJit, nnx_routable

    if (
        options is None
        or caller.split(".", 1)[0] in _NNX_PLAIN_CALLERS
        or isinstance(fun, types.MethodType)  # nnx's own error for a bound method
        or not nnx_routable(kwargs)
    ):
        return real(fun, **kwargs)
    statics = {k: kwargs[k] for k in ("static_argnums", "static_argnames") if kwargs.get(k)}
    okey = _options_key(statics, options)
    key = ("flax.nnx.jit", okey) if okey is not None else None
    cached = _cached(fun, key)
    if cached is not None:
        _row(getattr(cached, "_inner", cached)).jit_calls += 1
        return cached
    try:
        plain = _LazyFilterJit(functools.partial(real, **kwargs), fun)
        result = NnxJit(fun, plain, options, **statics)
        refused = None
    except Exception as e:  # noqa: BLE001 - autoopt cannot route it: nnx's own
        result, refused = real(fun, **kwargs), e
    row = _row_for(fun, getattr(result, "_inner", result))
    row.jit_calls += 1
    if refused is not None:
        _count_fallback(row, "options", f"{type(refused).__name__}: {refused}")
    _remember(fun, key, result)
    return result


class _PostImport:
    """A ``sys.meta_path`` finder that patches a framework when it is imported after the patch
    began (``autoopt run`` patches before the script imports anything)."""

    names = ("equinox", "flax.nnx")

    def find_spec(self, name, path=None, target=None):
        if name not in self.names:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module):
            original(module)
            with _state.lock:
                if _state.handles:
                    _state.rebound += _rebind_modules()

        spec.loader = _ExecThen(loader, exec_module)  # pyright: ignore[reportAttributeAccessIssue]
        return spec


class _ExecThen:
    def __init__(self, loader, exec_module):
        self._loader, self.exec_module = loader, exec_module

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def __getattr__(self, name):
        return getattr(self._loader, name)


_post_import = _PostImport()


def _options_key(kwargs: dict, options: dict) -> tuple | None:
    return options_key(kwargs, options)


def _cached(fun: Any, key: tuple | None):
    return _state.wrappers.get(fun, key)


def _remember(fun: Any, key: tuple | None, result: Any) -> None:
    _state.wrappers.put(fun, key, result)


# --- rebinding the name in modules that took it at import ------------------------------------


def _replacement(value: Any) -> Any:
    """What a module's binding of ``value`` becomes under the patch, or None to keep it."""
    if value is real_jit:
        return _patched_jit
    if value is not None and value is _real_filter_jit_fn:
        return _patched_filter_jit
    if value is not None and value is _real_nnx_jit_fn:
        return _patched_nnx_jit
    if isinstance(value, functools.partial) and value.func is real_jit:
        return functools.partial(_patched_jit, *value.args, **value.keywords)
    return None


def _rebind_modules() -> list[tuple[dict, str, Any, Any]]:
    global _real_filter_jit_fn, _real_nnx_jit_fn
    if _real_filter_jit_fn is None:
        _real_filter_jit_fn = _real_filter_jit()
    if _real_nnx_jit_fn is None:
        _real_nnx_jit_fn = _real_nnx_jit()
    done = []
    for name, module in list(sys.modules.items()):
        if not isinstance(module, types.ModuleType) or name.split(".", 1)[0] in _PLAIN_CALLERS:
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            try:
                replacement = _replacement(value)
            except Exception:  # noqa: BLE001 - an object whose comparison raises: not jit
                continue
            if replacement is None:
                continue
            namespace[attr] = replacement
            done.append((namespace, attr, value, replacement))
    return done


# --- install / undo ---------------------------------------------------------------------------


class Patch:
    """An active ``autoopt.patch()``: call it, or leave its ``with`` block, to end it."""

    def __init__(self, options: dict):
        self.options = options
        self._active = False

    @property
    def active(self) -> bool:
        return self._active

    def undo(self) -> None:
        """End this patch; ``jax.jit`` is the real one again when no other patch is active.
        Undoing twice does nothing."""
        with _state.lock:
            if not self._active:
                return
            self._active = False
            _state.handles.remove(self)
            if not _state.handles:
                _uninstall()

    __call__ = undo

    def __enter__(self) -> Patch:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "active" if self._active else "undone"
        return f"<autoopt.patch {state} options={self.options!r}>"


def patch(**options: Any) -> Patch:
    """Route every ``jax.jit`` through ``autoopt.optimize(f, **jit_keywords, **options)``.

    A context manager, and a call that returns the undo handle. ``options`` are optimize's
    (``donate="auto"``, ``fallback="raise"``...), checked now."""
    from autoopt.passes import make_options

    make_options(**options)  # a bad option fails here, not at the first jit
    handle = Patch(dict(options))
    with _state.lock:
        if not _state.handles:
            _install()
        _state.handles.append(handle)
        handle._active = True
    return handle


def _install() -> None:
    jax.jit = _patched_jit
    _state.rebound = _rebind_modules()
    if _post_import not in sys.meta_path:
        sys.meta_path.insert(0, _post_import)
    if not _state.listening:
        monitoring.register_event_duration_secs_listener(_on_duration)
        _state.listening = True


def _uninstall() -> None:
    if jax.jit is _patched_jit:
        jax.jit = real_jit
    if _post_import in sys.meta_path:
        sys.meta_path.remove(_post_import)
    for namespace, attr, original, replacement in _state.rebound:
        if namespace.get(attr) is replacement:  # not rebound by someone else since
            namespace[attr] = original
    _state.rebound = []


# --- the summary ------------------------------------------------------------------------------


def _row_for(fun: Any, result: Any, shared: Any = None) -> FunctionSummary:
    inner = fun
    while isinstance(inner, functools.partial):
        inner = inner.func
    inner = getattr(inner, "__func__", inner)  # a bound method: its function
    name = getattr(inner, "__qualname__", None) or getattr(inner, "__name__", None)
    name = name or type(inner).__name__
    code = getattr(inner, "__code__", None)
    location = f"{code.co_filename}:{code.co_firstlineno}" if code is not None else None
    with _state.lock:
        row = _state.rows.get((name, location))
        if row is None:
            row = _state.rows[(name, location)] = FunctionSummary(name, location)
        for obj in (result, shared) if shared is not None else (result,):
            try:
                _state.row_of[obj] = row
                row._fns.add(obj)
            except TypeError:
                pass
    return row


def _row(result: Any) -> FunctionSummary:
    row = _state.row_of.get(result)
    return row if row is not None else FunctionSummary("?", None)


_PASS_IN_MESSAGE = re.compile(r"autoopt pass '([^']+)' failed")


def _count_fallback(row: FunctionSummary, pass_name: str, reason: str) -> None:
    row.fallbacks[pass_name] += 1
    row.fallback_reasons.setdefault(pass_name, reason.splitlines()[0][:300] if reason else "")


def _on_duration(event: str, duration_secs: float, **kwargs: Any) -> None:
    if event != _COMPILE_EVENT or not _state.handles:
        return
    try:
        _attribute_compile(str(kwargs.get("fun_name", "?")))
    except Exception:  # noqa: BLE001 - the summary must never break the user's compile
        _state.other_compiles["(summary error)"] += 1


def _attribute_compile(fun_name: str) -> None:
    """Count a compile against the optimized function whose call made it (found on the stack),
    and record what its passes did for that call's signature.

    Only autoopt's own call frames are read (``OptimizedFunction._call`` and ``_run``, by
    code object): reading ``f_locals`` of a user's frame would, on Python 3.11, rewrite the dict
    a ``locals()`` snapshot of that frame holds."""
    frame = sys._getframe(2)
    from autoopt._jit import OptimizedFunction

    if fun_name == _COPY_COMPILE:
        # (the compiled copy of arguments a donating executable must not delete: autoopt's
        # own program, not one of the function's; JAX_LOG_COMPILES names it so too)
        _state.other_compiles[fun_name] += 1
        return
    own = _own_call_codes(OptimizedFunction)
    by_autoopt = _compiled_by_autoopt(frame)
    while frame is not None:
        if frame.f_code in own:
            local = frame.f_locals
            owner = local.get("self")
            row = _state.row_of.get(owner) if isinstance(owner, OptimizedFunction) else None
            if row is not None:
                if fun_name in _compiled_names(owner):
                    row.compiles += 1
                    args, kwargs = local.get("args"), local.get("kwargs")
                    if isinstance(args, tuple) and isinstance(kwargs, dict):
                        _record_program(row, owner, args, kwargs)
                    return
                if by_autoopt:  # (remat's candidates, measured for this function's program)
                    row.compiles += 1
                    return
                # Made while the call traced the user's function: an eager op of the user's
                # code or a library's (``jax.ensure_compile_time_eval``), which plain jax.jit
                # compiles as well; not the function's program, whose report must not be made
                # here either: its trace has not finished, and a report's trace would run the
                # user's function again inside this one (each eager op of it compiling again).
                break
        frame = frame.f_back
    # A call the C path ran (no frame of ours): the function jit traced last on this thread,
    # when the compile is of its name.
    from autoopt._jit import TRACING

    traced = getattr(TRACING, "function", None)
    owner = traced() if traced is not None else None
    name = getattr(getattr(owner, "__wrapped__", None), "__name__", None)
    row = None
    if isinstance(owner, OptimizedFunction) and fun_name in (name, f"jit({name})"):
        # the row of the object the user called: the traced one, or a ``_fresh`` wrapper of it
        row = _state.row_of.get(owner) or next(
            (r for k, r in _state.row_of.items() if getattr(k, "_shares", None) is owner), None
        )
    if row is not None:
        row.compiles += 1
        return
    _state.other_compiles[fun_name] += 1


@functools.cache
def _own_call_codes(cls: type) -> frozenset:
    return frozenset({cls._call.__code__, cls._run.__code__})


def _compiled_names(fn: Any) -> tuple[str, ...]:
    """The names jax's compile events give ``fn``'s own programs: its jit objects trace a
    wrapper named as the user's function (``functools.update_wrapper``; equinox's route names
    its ``fun_wrapped`` so), whose name jax reports bare or as ``jit(name)``."""
    names = []
    for f in (getattr(fn, "_wrapper", None), getattr(fn, "__wrapped__", None)):
        name = getattr(f, "__name__", None)
        if isinstance(name, str):
            names += [name, f"jit({name})"]
    return tuple(names)


# Where jax's and autoopt's own code lives: a compile event's first frame outside jax (and
# outside this module's listener) says who asked for the compile.
_JAX_DIRS = tuple(
    os.path.dirname(os.path.abspath(file)) + os.sep
    for m in (jax, sys.modules.get("jaxlib"))
    if isinstance(file := getattr(m, "__file__", None), str)
)
_AUTOOPT_DIR = os.path.dirname(os.path.abspath(_compat.__file__)) + os.sep


def _compiled_by_autoopt(frame: Any) -> bool:
    """Whether the compile whose event listener runs above ``frame`` was asked for by autoopt's
    own code (remat's measured candidates, a report's compile), not by the user's code or a
    library's: the first frame outside jax and jaxlib is autoopt's (its bundled examples are
    user code)."""
    while frame is not None:
        file = frame.f_code.co_filename
        if not file.startswith(_JAX_DIRS):
            return file.startswith(_AUTOOPT_DIR) and not file.startswith(
                os.path.join(_AUTOOPT_DIR, "examples")
            )
        frame = frame.f_back
    return False


def _record_program(row: FunctionSummary, fn: Any, args: tuple, kwargs: dict) -> None:
    try:
        inspection = fn.inspect(*args, **kwargs)
    except Exception:  # noqa: BLE001 - arguments traced by an outer transformation
        return
    row.signatures = max(row.signatures, len(inspection.programs))
    program = inspection.program
    if id(program) in row._seen:
        return
    row._seen.add(id(program))
    if inspection.fallback:
        m = _PASS_IN_MESSAGE.search(inspection.fallback)
        _count_fallback(row, m.group(1) if m else "unknown", inspection.fallback)
    donated_args = {p for v in inspection.donation_variants for p in v[0]}
    donated_names = {n for v in inspection.donation_variants for n in v[1]}
    for f in inspection.findings:
        if f.kind == "donate":
            d = f.details
            applied = d.get("arg") in donated_args or d.get("name") in donated_names
        else:
            applied = f.applied
        if applied:
            row.applied[f.kind] += 1
            row.bytes_saved += f.bytes_saved or 0


# Per function, at most this many "not applied" lines in the exit summary (the JSON has all).
NOT_APPLIED_LINES = 4


def _not_applied(row: FunctionSummary) -> list[dict]:
    """What the passes considered for this row's programs and did not apply, each with why:
    a finding not applied (its message), or an argument a program could donate that its
    executable does not (the call sites' reasons, or why the executable was fixed without it).
    Read from the functions' caches when the summary is made, so call sites seen after the
    compile count too. Never raises."""
    out: dict[tuple, dict] = {}
    try:
        for fn in list(row._fns):
            _not_applied_of(fn, out)
    except Exception as e:  # noqa: BLE001 - the summary must never break the exit
        out[("?", "?")] = {"kind": "?", "what": "?", "reason": f"(summary error: {e})"}
    return list(out.values())


def _not_applied_of(fn: Any, out: dict) -> None:
    from autoopt._jit import REFUSALS_BEFORE_NARROWING, site_calls

    caches = getattr(fn, "_caches", None)
    if caches is None:
        return
    subs = list(caches.static_leaf_fns.values())
    shift = getattr(fn, "_proof_shift", 0)  # positions of the caller's arguments (equinox)
    proofs = list(caches.site_proofs.values())
    # called inside another trace (an outer jit, grad, vmap): its programs were inlined there
    nested = any(
        j is not None for j in (caches.nested, caches.eager_forward_jit, caches.eager_ad_jit)
    )
    for program in list(caches.programs.values()):
        if program.pipeline is None:
            continue
        donates = program.donates or ((), ())
        for f in program.pipeline.findings:
            d = f.details or {}
            if f.kind == "donate":
                arg, name = d.get("arg"), d.get("name")
                if arg in donates[0] or arg in donates[1]:
                    continue
                names = getattr(fn, "_proof_names", None)
                if shift and names and isinstance(arg, int) and 0 <= arg - shift < len(names):
                    name = names[arg - shift]
                what = f"`{name}`" if name else f"argument {arg}"
                if d.get("host_callbacks"):  # never donated under "safe"
                    reason = (
                        f"the program calls back into Python ({', '.join(d['host_callbacks'])}"
                        "), so donate='safe' donates nothing: a callback that raises would "
                        "leave the caller's variable bound to a deleted array (jax.jit keeps "
                        "it); donate explicitly (donate_argnums, or equinox's donate=) if no "
                        "call raises"
                    )
                else:
                    reason = _donation_reason(proofs, arg, shift, program.donates is None, nested)
            elif f.applied:
                continue
            else:
                what, reason = (f.location or ""), f.message
            out.setdefault((f.kind, what, reason), {"kind": f.kind, "what": what, "reason": reason})
    in_a_row: set = set()  # (site, argument) said by a line of refusals in a row
    for site in list(caches.sites.values()):
        for refused in list(getattr(site, "refusals", {}).values()):
            if refused.count < REFUSALS_BEFORE_NARROWING:
                continue
            in_a_row.update((site.proof.location, p) for p in refused.positions)
            what = "argument " + ", ".join(str(p) for p in refused.positions)
            then = (
                "this site runs an executable that does not donate it (no copies)"
                if refused.narrowed
                else "each call passes a device copy of it (until the calls have taken ten "
                "compiles' time: then an executable that does not donate it)"
            )
            if site.donates:
                reason = (
                    f"{site.proof.location}: refused at run time on {refused.count} calls in a "
                    "row (what it passes is also held elsewhere: a container it was unpacked "
                    f"from, a list it was appended to): {then}"
                )
            else:  # (``_dispatch._copies_paid_for``)
                why = "; ".join(dict.fromkeys(r for _, r in site.proof.reasons)) or "not proven"
                reason = (
                    f"{site.proof.location}: this site donates nothing ({why}) on "
                    f"{refused.count} calls, and the executable of its signature, chosen by a "
                    f"call elsewhere, donates: {then}"
                )
            entry = {"kind": "donate", "what": what, "reason": reason}
            out.setdefault(("donate", what, reason), entry)
    # Every site's refused calls (the executables above donate; these calls did not), from the
    # record the run-time checks keep where a call takes the general path (``SiteCalls``).
    for location, calls in site_calls(list(caches.sites.values())).items():
        for key, count in calls.refused.items():
            if (location, key) in in_a_row:
                continue
            why = calls.why.get(key, "")
            times = f"{count} call{'s' if count != 1 else ''}"
            if key in calls.narrowed:
                then = (
                    f"on {times} ({why}): this site now runs an executable that does not donate it"
                )
            elif not calls.donated.get(key) and calls.exact:
                then = f"on every call so far ({times}): {why}; each passed a device copy of it"
            else:
                then = f"on {times} ({why}), each passing a device copy of it"
            what = f"argument {key}"
            reason = f"{location}: refused at run time {then}"
            out.setdefault(
                ("donate", what, reason), {"kind": "donate", "what": what, "reason": reason}
            )
    for sub in subs:
        _not_applied_of(sub, out)


def _donation_reason(
    proofs: list, arg: Any, shift: int, undecided: bool, nested: bool = False
) -> str:
    """Why an argument an output can alias is not donated, from the call sites' proofs."""
    if undecided and nested:
        return (
            "no top-level call of this signature has run: it was called inside another jit's "
            "trace (or a transformation's), where its arguments are the outer program's values "
            "and XLA inlines it; the outer call's donation covers them"
        )
    if undecided:
        return "no call of this signature has run (traced for a report only)"
    key = arg - shift if isinstance(arg, int) else arg
    why = [f"{p.location}: {r}" for p in proofs for k, r in p.reasons if k == key or k == "*"]
    proven = any(key in p.positions or key in p.names for p in proofs)
    if why and not proven:
        return "; ".join(dict.fromkeys(why))
    if proven:
        return "; ".join(
            [
                *dict.fromkeys(why),
                "a call site rebinds it, but the signature's one executable was fixed by an "
                "earlier call that could not donate it, so no call donates it (one executable "
                "per signature, as jax.jit compiles: make the rebinding call first)",
            ]
        )
    return "no call site proved it dead (a call from inside a transformation or a framework)"


def summary() -> dict:
    """The per-function figures so far: ``{"functions": [...], "other_compiles": {...}}``."""
    with _state.lock:
        rows = [r.as_dict() for r in _state.rows.values()]
        other = dict(_state.other_compiles)
    rows.sort(key=lambda r: (-r["compiles"], -r["jit_calls"], r["name"]))
    return {"functions": rows, "other_compiles": other}


def _clip(text: str, width: int) -> str:
    """``text`` cut at a word to ``width`` characters, marked when cut (--report has it all)."""
    return textwrap.shorten(text, width, placeholder=" [...]")


def format_summary(data: dict, limit: int = 40) -> str:
    """``summary()`` as text, at most ``limit`` functions (the most compiled first)."""
    rows = data["functions"]
    falls = sum(f["count"] for r in rows for f in r["fallbacks"])
    applied = collections.Counter()
    for r in rows:
        applied.update(r["applied"])
    lines = [
        f"autoopt: {len(rows)} jitted functions, {sum(r['compiles'] for r in rows)} compiles, "
        # (per executable: counting what each call donated would cost every call; the calls
        # the run-time checks refused are the "not applied" lines)
        f"applied {dict(applied) or 'nothing'} (per compiled executable, not per call), "
        f"{sum(r['bytes_saved'] for r in rows):,} bytes saved (the applied findings' sum, "
        f"not a measured peak: explain measures it), {falls} fallbacks"
    ]
    if rows:
        lines.append(
            f"  {'function':<32} {'jit()':>6} {'compiles':>8} {'sigs':>5}  "
            f"{'saved':>12}  applied (per executable) / fallbacks"
        )
    for r in rows[:limit]:
        what = ", ".join(f"{k} x{n}" for k, n in sorted(r["applied"].items())) or "-"
        if r["fallbacks"]:
            what += "; fell back: " + ", ".join(
                f"{f['pass']} x{f['count']} ({_clip(f['reason'], 80)})" for f in r["fallbacks"]
            )
        lines.append(
            f"  {r['name'][:32]:<32} {r['jit_calls']:>6} {r['compiles']:>8} {r['signatures']:>5}  "
            f"{r['bytes_saved']:>12,}  {what}"
        )
        for n in r.get("not_applied", [])[:NOT_APPLIED_LINES]:
            lines.append(f"      not applied: {n['kind']} {n['what']}: {_clip(n['reason'], 110)}")
        if len(r.get("not_applied", [])) > NOT_APPLIED_LINES:
            lines.append(f"      ... {len(r['not_applied']) - NOT_APPLIED_LINES} more not applied")
    if len(rows) > limit:
        lines.append(f"  ... {len(rows) - limit} more (--report FILE.json has them all)")
    other = data["other_compiles"]
    if other:
        lines.append(
            f"  plus {sum(other.values())} compiles of jits made outside the patch "
            "(jax's own, autoopt's copies of arguments it could not donate "
            f"({_COPY_COMPILE}), or jits created before it)"
        )
    return "\n".join(lines) + "\n"
