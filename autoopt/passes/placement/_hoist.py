"""Large closed-over constants: device arguments, placed once, instead of HLO constants.

Closed-over constants of 1 MiB and up are passed to the program as device arguments, placed once,
instead of being embedded into the HLO, whose text, size and first compile grow with every
embedded byte. The wrapper's trace stops at them (``HoistConstants``), the placer
(``_placement``) places them and calls again with them under a hidden keyword (``HOISTED``);
calls that reach jit without the placer (AOT ``.lower``) embed them as jax.jit does.

Same numbers as ``jax.jit``, which bakes a closed-over NumPy array's bytes into each signature's
executable when that signature is first traced, while the host array may change later. So each
program (one a signature) is bound once, at its first trace under the placer, to what it reads:
the placed copy when its bytes equal the host's then (compared once a program, not a call), else
a private snapshot of the host bytes, embedded. Later traces of the same program (another
strategy, a new hoisted constant) reuse the binding, so every call of a signature sees the bytes
of its first trace, as under ``jax.jit``; a placed copy is never written again.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import jax
import numpy as np
from jax import tree_util
from jax.core import Tracer

from autoopt import _compat
from autoopt._errors import ControlSignal
from autoopt.passes.placement._host_arrays import is_aligned

__all__ = ["HOISTED", "HoistConstants", "HoistedConst", "retrying", "with_hoisted_consts"]

# The keyword under which hoisted constants travel to the jitted wrapper (never a user's name).
HOISTED = "_autoopt_hoisted"
# Top-level consts of the optimized program at least this large are passed as device arguments,
# placed once, instead of being embedded in the HLO (an embedded constant is printed into the
# HLO text and copied into every executable). jax 0.10.2's own hoisting
# (jax_use_simplified_jaxpr_constants) still embeds them when lowering.
HOIST_MIN_BYTES = 1 << 20
_TLS = threading.local()  # .retry: the placer will retry a call whose trace asks to hoist


@contextlib.contextmanager
def retrying():
    """While inside, a trace that meets large constants the call did not pass raises
    ``HoistConstants`` (the placer will place them and call again) instead of embedding them.
    Nests: the outer state is restored on exit."""
    outer, _TLS.retry = getattr(_TLS, "retry", False), True
    try:
        yield
    finally:
        _TLS.retry = outer


class HoistConstants(ControlSignal):
    """Raised out of jit's trace of the wrapper when the program has large constants the call
    did not pass as arguments; the placer places them and calls again. Never reaches the user."""

    def __init__(self, consts: list):
        super().__init__("autoopt: large constants to pass as arguments")
        self.consts = consts


class HoistedConst:
    """One placed large constant: the program's host constant (held, so its ``id`` stays its
    own) and its device copy, made from the host bytes at placing time and never written again.
    Compared and hashed by identity (it is static aux data of ``Hoisted``)."""

    __slots__ = ("host", "device", "__weakref__")

    def __init__(self, host, device):
        self.host = host
        self.device = device

    @classmethod
    def place(cls, host, device) -> HoistedConst:
        src = host
        impl = None  # a typed PRNG key array's: ``src`` is a copy of its data
        if isinstance(host, np.ndarray):
            src = np.asarray(host)  # a jax TypedNdArray: a view of the user's array
            # XLA:CPU aliases an aligned host buffer instead of copying it: the "copy" would
            # then see the user's later writes. Place a private copy instead.
            if is_aligned(src):
                src = np.array(src, copy=True)
        elif isinstance(host, jax.Array) and host.is_fully_addressable:
            # jax.jit embeds a closed-over array's value: its executable holds neither the
            # array's buffer (another jit may donate it, or the user delete it) nor its
            # sharding or device (the outputs land where jax puts uncommitted values). A
            # private host copy placed uncommitted does the same; a typed PRNG key array's
            # is a copy of its data, wrapped again.
            if jax.numpy.issubdtype(host.dtype, jax.dtypes.extended):
                impl = jax.random.key_impl(host)
                src = np.array(jax.random.key_data(host), copy=True)
            else:
                src = np.array(host, copy=True)
        # (jax.jit loads an embedded constant with its executable, which no transfer guard
        # sees: nor does this placement, made in its stead)
        with jax.ensure_compile_time_eval(), jax.transfer_guard("allow"):
            dev = jax.device_put(src, device)
            if impl is not None:
                dev = jax.random.wrap_key_data(dev, impl=impl)
        dev.block_until_ready()  # the transfer reads the host bytes: complete it now
        return cls(host, dev)

    def holds_bytes_of(self, c) -> bool:
        """Whether the device copy holds ``c``'s current bytes (a jax array never changes)."""
        if c is not self.host:
            return False
        if isinstance(c, jax.Array):
            return True
        host = np.ascontiguousarray(np.asarray(c))
        dev = np.asarray(self.device)
        if host.dtype != dev.dtype:
            host = host.astype(dev.dtype)  # as jax canonicalizes it (float64 -> float32)
        if host.shape != dev.shape:
            return False
        return bool(np.array_equal(host.reshape(-1).view(np.uint8), dev.reshape(-1).view(np.uint8)))


class Hoisted:
    """Pytree node: the device copies of a function's large constants (children), keyed by their
    ``HoistedConst`` s (static aux data, so a new constant is a new signature)."""

    __slots__ = ("keys", "devs")

    def __init__(self, keys: tuple, devs: tuple):
        self.keys = keys
        self.devs = devs


def _flatten(h: Hoisted):
    # The aux data holds the constants weakly: jax keeps treedefs in caches of its own (strong,
    # LRU), which must not keep a function's closed-over arrays alive after the function and its
    # optimized function are gone, as jax.jit keeps none. A weak reference hashes and compares
    # as its constant does (by identity) while that is alive; every trace that unflattens it runs
    # within a call whose placer holds its constants.
    return h.devs, tuple(weakref.ref(k) for k in h.keys)


def _unflatten(refs: tuple, devs) -> Hoisted:
    pairs = [(k, d) for k, d in zip((r() for r in refs), devs, strict=True) if k is not None]
    return Hoisted(tuple(k for k, _ in pairs), tuple(d for _, d in pairs))


tree_util.register_pytree_node(Hoisted, _flatten, _unflatten)


def large_consts(closed) -> list:
    """The constants of ``closed`` passed as device arguments: at least ``HOIST_MIN_BYTES``,
    and not one value repeated (``is_splat``). Decided once a program, on its first look: a
    host constant refilled later changes neither this choice nor the numbers (an embedded
    constant holds the bytes of the program's first lowering, ``Program.frozen_host_consts``,
    as under jax.jit; a passed one is bound by ``_bind``)."""
    return [closed.consts[i] for i in _large_and_splat(closed)[0]]


def splat_consts(closed) -> list:
    """The constants of at least ``HOIST_MIN_BYTES`` that ``large_consts`` keeps embedded
    because every element has the same bytes (read on the same first look)."""
    return [closed.consts[i] for i in _large_and_splat(closed)[1]]


def _large_and_splat(closed) -> tuple[tuple[int, ...], tuple[int, ...]]:
    with _BINDINGS_LOCK:
        decided = _LARGE.get(closed)
    if decided is None:
        large, splat = [], []
        for i, c in enumerate(closed.consts):
            if (
                getattr(c, "ndim", 0) > 0
                and int(getattr(c, "nbytes", 0) or 0) >= HOIST_MIN_BYTES
                and not isinstance(c, Tracer)
                and not _spans_devices(c)
            ):
                (splat if is_splat(c) else large).append(i)
        with _BINDINGS_LOCK:
            decided = _LARGE.setdefault(closed, (tuple(large), tuple(splat)))
    return decided


def _spans_devices(c) -> bool:
    """A jax array sharded over several devices: stays embedded, as jax.jit embeds it. Passed
    as an argument it took part in sharding propagation, which gave an output computed from it
    alone the input's sharding where jax.jit's (from a constant) is replicated."""
    if not isinstance(c, jax.Array):
        return False
    try:
        return len(c.sharding.device_set) > 1
    except Exception:  # noqa: BLE001 - unknown: embedded, as jax.jit does
        return True


def is_splat(c, chunk: int = 1 << 20) -> bool:
    """Whether every element of ``c`` has the same bytes (``jnp.ones``, a mask of zeros).

    Such a constant stays embedded, as jax.jit embeds it: XLA knows its value, so the program
    compiles as fast as with an argument and runs faster (a DUS of a splat writes without
    reading; benchmarks/RESULTS.md). Read only where reading is free: host arrays and jax
    arrays on CPU; a device array elsewhere would be copied to the host, so it is not read
    and counts as not a splat (hoisted, as before)."""
    if isinstance(c, jax.Array):
        try:
            if not c.is_fully_addressable or any(d.platform != "cpu" for d in c.devices()):
                return False
        except Exception:  # noqa: BLE001 - a deleted or exotic array: not read
            return False
    try:
        a = np.asarray(c)
    except Exception:  # noqa: BLE001 - typed PRNG keys and the like have no host bytes
        return False
    if a.dtype == object or a.size < 2 or a.ndim == 0:
        return False
    width = a.dtype.itemsize
    as_words = (lambda b: b.view(f"u{width}")) if width in (1, 2, 4, 8) else _as_byte_rows
    first = as_words(np.ascontiguousarray(a[(0,) * a.ndim]).reshape(1))
    # A few elements first, read in place: most arrays that are not splats stop here, without
    # a copy of a non-contiguous array.
    for flat in (a.size - 1, a.size // 2, a.size // 3, 1):
        element = np.ascontiguousarray(a[np.unravel_index(flat, a.shape)]).reshape(1)
        if not (as_words(element) == first).all():
            return False
    rows = max(1, chunk // max(1, a[0].nbytes))
    for start in range(0, a.shape[0], rows):  # in chunks of about ``chunk`` bytes
        block = np.ascontiguousarray(a[start : start + rows]).reshape(-1)
        if not (as_words(block) == first).all():
            return False
    return True


def _as_byte_rows(b: np.ndarray) -> np.ndarray:
    return b.view(np.uint8).reshape(b.size, b.dtype.itemsize)


# closed jaxpr (a program, one a signature) -> {const index: HoistedConst to pass, or a private
# snapshot of the host bytes to embed}: what its first trace under the placer read.
_BINDINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BINDINGS_LOCK = threading.Lock()
# closed jaxpr -> (indices of the constants it passes as arguments, of its large splats)
_LARGE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _forget_bindings() -> None:
    # jax.clear_caches() drops jax.jit's lowerings: the next trace binds the constants again
    # (from their bytes then), as jax.jit's next lowering reads them.
    with _BINDINGS_LOCK:
        _BINDINGS.clear()


_compat.on_clear_caches(_forget_bindings, "autoopt: hoisted constants' bindings")


def _bind(closed, large_idx: list, passed: dict) -> dict:
    """The binding of ``closed``'s large constants, made on its first trace with all of them
    passed: the placed copy where it holds the host's current bytes, else a snapshot."""
    with _BINDINGS_LOCK:
        binding = _BINDINGS.get(closed)
        if binding is None:
            binding = {}
            for i in large_idx:
                c = closed.consts[i]
                entry = passed[id(c)]
                # Once a program: the proof that passing the copy gives jax.jit's numbers.
                binding[i] = entry if entry.holds_bytes_of(c) else np.array(c, copy=True)
            _BINDINGS[closed] = binding
    return binding


def with_hoisted_consts(closed, hoisted: Hoisted | None):
    """``closed`` with each large constant replaced by the argument ``hoisted`` carries for it,
    or by the snapshot its binding holds (see the module docstring).

    Runs inside jit's trace of the wrapper. When a large constant was not passed: raises
    ``HoistConstants`` if the placer is waiting to retry this call, else embeds it as before.
    """
    large = large_consts(closed)
    if not large:
        return closed
    large_ids = {id(c) for c in large}
    large_idx = [i for i, c in enumerate(closed.consts) if id(c) in large_ids]
    passed = {} if hoisted is None else {id(e.host): e for e in hoisted.keys}
    devs = {} if hoisted is None else {id(e): d for e, d in zip(hoisted.keys, hoisted.devs)}
    binding = _BINDINGS.get(closed)
    if binding is None:
        missing = [c for c in large if id(c) not in passed]
        if missing:
            if getattr(_TLS, "retry", False):
                raise HoistConstants(missing)
            if not passed:
                return closed
        else:
            binding = _bind(closed, large_idx, passed)
    consts = list(closed.consts)
    if binding is None:  # some passed, not all, and no retry (AOT): embed the rest
        for i in large_idx:
            e = passed.get(id(consts[i]))
            if e is not None:
                consts[i] = devs[id(e)]
        return closed.replace(consts=consts)
    for i, b in binding.items():
        if isinstance(b, HoistedConst):
            # Passed: its argument; not passed (AOT): its bytes, embedded.
            consts[i] = devs.get(id(b), b.device)
        else:
            consts[i] = b
    return closed.replace(consts=consts)
