"""Wrappers made anew for one function find the first one's programs: ``WrapperCache``.

``jax.jit(f)(x)`` in a loop compiles once: jax.jit's cache is keyed (weakly) on ``f`` and the
options. ``autoopt.optimize(f)(x)`` in the same loop must cost the same, so ``optimize`` (and
``autoopt.patch()``'s ``jax.jit``) return the optimized function already made for the same
function and options. The cache holds those weakly, so it keeps no function alive, plus the
``RECENT`` most recently asked for strongly, so that a wrapper dropped right after its one call
survives until the next loop iteration asks for it again.

NB: jax's own is ``jax._src.pjit._cpp_pjit_cache_fun_only``, a ``weakref_lru_cache`` whose
values (executables) do not refer to the function; an optimized function does (it calls it),
hence the weak values and the bounded strong ring here.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any

# Optimized functions kept alive after their wrapper is dropped.
RECENT = 256


def freeze(value: Any) -> Any:
    """A hashable stand-in for an options value (lists, tuples, dicts and sets of options)."""
    if isinstance(value, list | tuple):
        return (type(value).__name__, *map(freeze, value))
    if isinstance(value, dict):
        return ("dict", *sorted((k, freeze(v)) for k, v in value.items()))
    if isinstance(value, set | frozenset):
        return frozenset(map(freeze, value))
    return value


def options_key(*options: dict) -> tuple | None:
    """The cache key of these options, or None when one of them is unhashable (a sharding of
    some kinds): such a wrapper is not shared."""
    try:
        key = tuple(freeze(o) for o in options)
        hash(key)
    except TypeError:
        return None
    return key


class WrapperCache:
    """``fn -> {options key: weakref to its wrapper}``, plus the ``RECENT`` latest strongly."""

    def __init__(self, recent: int = RECENT):
        self._lock = threading.RLock()
        self._by_fn: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._recent: collections.deque = collections.deque(maxlen=recent)

    def get(self, fn: Any, key: tuple | None) -> Any:
        if key is None:
            return None
        with self._lock:
            try:
                ref = self._by_fn.get(fn, {}).get(key)
            except TypeError:  # not weakly referenceable, or unhashable
                return None
            wrapper = ref() if ref is not None else None
            if wrapper is not None:
                self._recent.append(wrapper)
            return wrapper

    def put(self, fn: Any, key: tuple | None, wrapper: Any) -> None:
        if key is None:
            return
        with self._lock:
            try:
                self._by_fn.setdefault(fn, {})[key] = weakref.ref(wrapper)
            except TypeError:
                return
            self._recent.append(wrapper)

    def clear(self) -> None:
        with self._lock:
            self._by_fn.clear()
            self._recent.clear()
