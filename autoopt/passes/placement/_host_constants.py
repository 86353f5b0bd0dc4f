"""Host constants: ``autoopt.constant(x)``, a host array placed on the device once and reused.

Only the caller's explicit promise makes a host array a constant. A read-only NumPy argument is
not one: ``flags.writeable`` can be switched back on (an array that owns its data), a base can be
written through another view, and the file under ``np.memmap(mode="r")`` can change, so nothing
cheap proves its bytes are those a cached copy holds; such arguments are transferred on every
call, as ``jax.jit`` does (the placement finding suggests ``autoopt.constant``).

The cache holds the host array, so its ``id`` cannot be reused, and drops the device copy once
nothing but the cache refers to the host array (checked with reference counts). A 64-byte
aligned host array is copied before placing: XLA:CPU would alias it, and the "copy" would see
later writes and keep it alive. The device copy is shared by every ``Constant`` of that host
array, so it is never donated: the placer hands a fresh copy to an explicit ``donate_argnums``
(``SHARED_DEVICE_IDS``).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import jax
import numpy as np
from jax import tree_util
from jax.core import Tracer

from autoopt.passes.placement._host_arrays import is_aligned

__all__ = [
    "constant",
    "Constant",
    "constant_cache_size",
    "sweep_constants",
]


class _Entry:
    __slots__ = ("host", "device")

    def __init__(self, host, device):
        self.host = host
        self.device = device


CONSTANTS: dict[tuple, _Entry] = {}  # (id(host), device) -> entry
# id(device copy) of every entry, for the placer's identity test: the entries hold the copies,
# so no other object can have one of these ids.
SHARED_DEVICE_IDS: set[int] = set()
_CONSTANTS_LOCK = threading.Lock()


def _calibrate_entry_refs() -> int:
    e = _Entry(np.empty(1), None)
    return sys.getrefcount(e.host)


# References to a cached host array held by the cache itself, as ``sweep_constants`` sees them.
_ENTRY_REFS = _calibrate_entry_refs()


def sweep_constants() -> int:
    """Drop cached device copies whose host array nothing but the cache refers to. Returns how
    many were dropped. Runs on every insertion and every 64 scanned calls; call it to free device
    memory at once."""
    dropped = 0
    with _CONSTANTS_LOCK:
        for key, e in list(CONSTANTS.items()):
            if sys.getrefcount(e.host) <= _ENTRY_REFS:  # only the entry refers to it
                del CONSTANTS[key]
                dropped += 1
        if dropped:
            SHARED_DEVICE_IDS.intersection_update(id(e.device) for e in CONSTANTS.values())
    return dropped


def constant_cache_size() -> int:
    """How many host constants have a cached device copy."""
    return len(CONSTANTS)


def cached_constant(host: np.ndarray, device) -> tuple[Any, bool]:
    """``(device copy, placed_now)`` of a host array the caller promised never changes."""
    key = (id(host), device)
    e = CONSTANTS.get(key)
    # Deleted: someone donated it outside autoopt (jax.jit with donate_argnums). Place it again.
    if e is not None and e.host is host and not e.device.is_deleted():
        return e.device, False
    sweep_constants()
    # XLA:CPU aliases an aligned host buffer instead of copying it (even with may_alias=False,
    # jax 0.10.2): the "device copy" would then see later writes to the host array and keep it
    # alive (the sweep could never drop it). Place a private copy instead: one copy, once.
    src = np.array(host, copy=True) if is_aligned(host) else host
    # Concrete even when called under a transformation's trace (a cached tracer would leak).
    with jax.ensure_compile_time_eval():
        dev = jax.device_put(src, device)
    # The transfer may still read ``src`` after device_put returns: complete it before the
    # caller can write the host array again.
    dev.block_until_ready()
    del src
    with _CONSTANTS_LOCK:
        old = CONSTANTS.get(key)
        if old is not None:
            SHARED_DEVICE_IDS.discard(id(old.device))
        CONSTANTS[key] = _Entry(host, dev)
        SHARED_DEVICE_IDS.add(id(dev))
    return dev, True


class Constant:
    """A host array marked as never changing: placed once, reused by every call.

    What ``autoopt.constant(x)`` returns. It is a pytree node whose only leaf is the device copy,
    so any jitted function (``jax.jit`` or ``autoopt.optimize``) receives the device array and
    nothing is transferred per call. ``np.asarray(c)`` returns the host array (no device-to-host
    copy); ``c.device_array`` the placed one.
    """

    # Never donated, whatever the policy: the device copy is shared by every call (and cached).
    _autoopt_never_donate = True

    __slots__ = ("host", "device_array", "__weakref__")

    def __init__(self, host, device_array):
        self.host = host
        self.device_array = device_array

    shape = property(lambda self: self.device_array.shape)
    dtype = property(lambda self: self.device_array.dtype)
    ndim = property(lambda self: self.device_array.ndim)
    size = property(lambda self: self.device_array.size)
    nbytes = property(lambda self: self.device_array.nbytes)
    sharding = property(lambda self: self.device_array.sharding)

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.host, dtype=dtype)

    def __jax_array__(self):
        return self.device_array

    def __len__(self):
        return len(self.device_array)

    def __repr__(self) -> str:
        return f"autoopt.constant({self.dtype}{list(self.shape)}, sharding={self.sharding})"


tree_util.register_pytree_node(
    Constant,
    lambda c: ((c.device_array,), None),
    # Inside a traced function the user sees the array itself, not the wrapper.
    lambda _aux, children: children[0],
)


def constant(host_array, *, sharding=None) -> Constant:
    """Mark ``host_array`` as never changing: place it once (on ``sharding``, a ``jax.Device`` or
    ``jax.sharding.Sharding``; default device otherwise) and reuse the device copy on every call.

    Calling it twice on the same array returns wrappers that share one device copy. The promise
    is the caller's: a later change to the host array is not seen. The shared copy is never
    donated by an optimized function (an explicit ``donate_argnums`` gets a fresh copy). A
    read-only NumPy array is not a constant (its flag can be switched back on, or its base
    written): it is transferred on every call, as ``jax.jit`` does.
    """
    if isinstance(host_array, Constant):
        return host_array
    if isinstance(host_array, Tracer):
        raise TypeError(
            "autoopt.constant() needs a concrete host array, got a traced value; "
            "call it once outside the jitted function and pass the result in."
        )
    if isinstance(host_array, jax.Array):
        dev = host_array if sharding is None else jax.device_put(host_array, sharding)
        return Constant(host_array, dev)
    host = np.asarray(host_array)
    dev, _ = cached_constant(host, sharding)
    return Constant(host, dev)
