"""Wrappers made anew for one function find the first one's programs: ``WrapperCache``.

``jax.jit(f)(x)`` in a loop compiles once: jax.jit's cache is keyed weakly on ``f`` and the
options. ``autoopt.optimize(f)(x)`` in the same loop must cost the same, so ``optimize`` (and
``autoopt.patch()``'s ``jax.jit``) find the optimized function already made for the same function
and options, and hand out a fresh wrapper object sharing its programs (``OptimizedFunction.
_fresh``), as each ``jax.jit(f)`` is a new object sharing one cache.

The cache must keep no function alive, and match a function by identity only: two callables that
compare equal (``t.step == t.step``, two layers equal by name, ``Affine(2) == Affine(2.0)``) may
compute differently. An optimized function refers to its function (it calls it), so a cache
holding it strongly from a global table would keep the function alive (jax's caches hold
executables, which do not). Hence:

- a plain Python function (``types.FunctionType``: ``def`` and ``lambda``) holds its own entries,
  in an attribute (``HOLDER``): the entries live exactly as long as the function. They must not
  refer to the function, or a function and its optimized function would be a reference cycle,
  freed only when the garbage collector runs: ``jax.jit(lambda a: a + params)`` made anew each
  step would keep every step's ``params`` alive until then (on a device, out of memory where
  jax.jit frees each at once). So the cached optimized function is built on ``detached(fn)``, a
  copy sharing the function's code, globals, closure cells and defaults (every analysis reads
  the same objects, and the calls compute the same), and only the wrapper handed to the caller
  (``OptimizedFunction._fresh``) holds the function itself. ``sync`` brings a later assignment
  to the function's code or defaults (IPython's autoreload) to the copy before it is traced
  again. The holder records its function (weakly) so that a copy of the attribute
  (``functools.wraps`` copies ``__dict__``) is never taken as the other function's, and pickles
  to an empty dict (cloudpickle pickles a lambda's ``__dict__``).
- a ``functools.partial`` is held the same way (its copy shares its arguments and keywords).
- any other callable (a bound method, a callable instance, a builtin) is found by identity while
  its optimized function is alive elsewhere (weak values): a bound method is a new object on
  each attribute access, so ``optimize(t.step)`` after ``t.lr = 0.5`` traces again, as jax.jit
  does (its weak entry dies with the bound method), and a callable instance is never mutated by
  autoopt. A bound method's optimized function is built on a copy too (released when the bound
  method goes); a callable instance's refers to the instance (its state), and is freed by the
  garbage collector. (No global table may hold an optimized function strongly: its copy may
  reach the callable, through an instance holding its own bound method, and nothing would ever
  free them.)

NB: jax's own is ``jax._src.pjit._cpp_pjit_cache_fun_only``, a ``weakref_lru_cache``.
"""

from __future__ import annotations

import functools
import threading
import types
import weakref
from typing import Any

# Optimized functions kept alive beyond their functions' lifetime: none (kept as a name for
# callers of the earlier strongly held ring).
RECENT = 0

# The attribute of a plain function (or a partial) that holds its optimized functions.
HOLDER = "__autoopt_optimized__"
HOLDS_ITS_OWN = (types.FunctionType, functools.partial)

# Options whose spellings jax.jit takes as the same: an int or a sequence of ints, a str or a
# sequence of strs.
_INDEX_OPTIONS = ("static_argnums", "donate_argnums")
_NAME_OPTIONS = ("static_argnames", "donate_argnames")


def freeze(value: Any) -> Any:
    """A hashable stand-in for an options value (lists, tuples, dicts and sets of options)."""
    if isinstance(value, list | tuple):
        return (type(value).__name__, *map(freeze, value))
    if isinstance(value, dict):
        return ("dict", *sorted((k, freeze(v)) for k, v in value.items()))
    if isinstance(value, set | frozenset):
        return frozenset(map(freeze, value))
    return value


def _normalized(options: dict) -> dict:
    """``static_argnums=1``, ``(1,)`` and ``[1]`` (and the like for the other argnums and
    argnames options) as one spelling, so they share one entry as jax.jit's do."""
    out = dict(options)
    for name in _INDEX_OPTIONS + _NAME_OPTIONS:
        v = out.get(name)
        if v is None:
            continue
        single = str if name in _NAME_OPTIONS else int
        if isinstance(v, single) and not isinstance(v, bool):
            out[name] = (v,)
        elif isinstance(v, list | tuple) and all(
            isinstance(i, single) and not isinstance(i, bool) for i in v
        ):
            out[name] = tuple(sorted(set(v)))
    return out


def options_key(*options: dict) -> tuple | None:
    """The cache key of these options, or None when one of them is unhashable (a sharding of
    some kinds): such a wrapper is not shared."""
    try:
        key = tuple(freeze(_normalized(o)) for o in options)
        hash(key)
    except TypeError:
        return None
    return key


def detached(fn: Any) -> Any:
    """A copy of ``fn`` that refers to nothing of it but what it is made of, computing what it
    computes, or None where none can be made (a callable instance: its state is itself). A
    plain function's: the same code, globals, closure cells, defaults and attributes (but its
    ``HOLDER``); a partial's: the same function, arguments and keywords; a bound method's: the
    same function and instance."""
    if type(fn) is functools.partial:
        # (its arguments tuple and keywords dict themselves, not copies: a keyword the caller
        # sets later in ``p.keywords`` is the copy's too)
        copy = functools.partial.__new__(functools.partial, fn.func)
        copy.__setstate__((fn.func, fn.args, fn.keywords, None))  # pyright: ignore[reportAttributeAccessIssue]
        return copy
    if type(fn) is types.MethodType:
        return types.MethodType(fn.__func__, fn.__self__)
    if type(fn) is not types.FunctionType:
        return None
    copy = types.FunctionType(
        fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    copy.__module__ = fn.__module__
    copy.__doc__ = fn.__doc__
    copy.__annotations__ = fn.__annotations__
    copy.__dict__.update((k, v) for k, v in fn.__dict__.items() if k != HOLDER)
    return copy


def sync(copy: Any, origin: weakref.ref) -> None:
    """Bring an assignment to a plain function's code or defaults, or a partial's new state
    (``__setstate__``), since ``detached`` to ``copy``, so that a trace after it runs what a
    trace of the original runs (as under jax.jit). (A bound method cannot change.)"""
    fn = origin()
    if fn is None:
        return
    if type(copy) is functools.partial:
        if copy.func is not fn.func or copy.args is not fn.args or copy.keywords is not fn.keywords:
            copy.__setstate__((fn.func, fn.args, fn.keywords, None))  # pyright: ignore[reportAttributeAccessIssue]
        return
    if type(copy) is not types.FunctionType:
        return
    if copy.__code__ is not fn.__code__:
        copy.__code__ = fn.__code__
    if copy.__defaults__ is not fn.__defaults__:
        copy.__defaults__ = fn.__defaults__
    if copy.__kwdefaults__ is not fn.__kwdefaults__:
        copy.__kwdefaults__ = fn.__kwdefaults__


class _Holder:
    """A plain function's entries: ``{(cache tag, generation, options key): wrapper}``."""

    __slots__ = ("owner", "entries", "__weakref__")

    def __init__(self, owner: Any = None):
        self.owner = weakref.ref(owner) if owner is not None else None
        self.entries: dict = {}

    def __reduce__(self):
        # The programs are this process's: never pickled (cloudpickle pickles a lambda's
        # ``__dict__``); an empty dict, so unpickling needs no autoopt.
        return (dict, ())


class WrapperCache:
    """Optimized functions by (function identity, options key), keeping no function alive."""

    def __init__(self):
        self._lock = threading.RLock()
        self._tag = object()
        self._generation = 0
        # id(fn) -> (weakref to fn, {options key: its wrapper, or a weakref to it}), for other
        # callables: held strongly only where the wrapper refers to nothing of fn (``put``)
        self._by_id: dict = {}

    def _holder(self, fn: Any, create: bool) -> _Holder | None:
        d = getattr(fn, "__dict__", None)
        if d is None:
            return None
        holder = d.get(HOLDER)
        if type(holder) is _Holder and holder.owner is not None and holder.owner() is fn:
            return holder
        if not create:
            return None
        holder = _Holder(fn)
        d[HOLDER] = holder
        return holder

    def get(self, fn: Any, key: tuple | None) -> Any:
        if key is None:
            return None
        with self._lock:
            if type(fn) in HOLDS_ITS_OWN:
                holder = self._holder(fn, create=False)
                if holder is None:
                    return None
                return holder.entries.get((self._tag, self._generation, key))
            entry = self._by_id.get(id(fn))
            if entry is None or entry[0]() is not fn:
                return None
            ref = entry[1].get(key)
            return ref() if ref is not None else None

    def put(self, fn: Any, key: tuple | None, wrapper: Any) -> None:
        if key is None:
            return
        with self._lock:
            if type(fn) in HOLDS_ITS_OWN:
                holder = self._holder(fn, create=True)
                if holder is not None:
                    entries = holder.entries
                    for k in [k for k in entries if k[0] is self._tag and k[1] != self._generation]:
                        del entries[k]  # entries of before a ``clear``
                    entries[(self._tag, self._generation, key)] = wrapper
                return
            i = id(fn)
            entry = self._by_id.get(i)
            if entry is None or entry[0]() is not fn:
                try:
                    ref = weakref.ref(fn, self._forget(i))
                except TypeError:  # not weakly referenceable: not shared
                    return
                entry = self._by_id[i] = (ref, {})
            try:
                entry[1][key] = weakref.ref(wrapper)
            except TypeError:
                return

    def _forget(self, i: int):
        self_ref = weakref.ref(self)

        def forget(ref):
            cache = self_ref()
            if cache is None:
                return
            with cache._lock:
                entry = cache._by_id.get(i)
                if entry is not None and entry[0] is ref:
                    del cache._by_id[i]

        return forget

    def clear(self) -> None:
        """Later ``get``s find nothing made before (plain functions' entries are dropped as
        they are next written)."""
        with self._lock:
            self._generation += 1
            self._by_id.clear()
