"""Host inputs, host constants and transfer accounting (``autoopt.prefetch``: ``_prefetch``).

Host-to-device traffic is what autoopt exists to cut; this module removes what it can from the
call path and counts what is left.

* **Host inputs.** A call that passes NumPy leaves makes ``jax.jit`` transfer each one. On XLA:CPU
  (jax 0.10.2, this repository's CI machine) that costs ~3.6 us a leaf (~2.7 us when the buffer
  is 64-byte aligned, which XLA:CPU aliases instead of copying): 64 leaves of f32[64,64] add
  ~230 us to a call whose device-array version takes ~50 us. Packing the leaves of each dtype
  into one pooled, aligned host buffer costs one memcpy (~40 us a MiB) and one argument, and the
  program slices the leaves back apart: free where XLA fuses a slice into its consumer, but a
  slice feeding a concatenate, a dot or a reduction becomes its own kernel (~3-10 us each), which
  can cost more than the transfer it saved (a concatenate-into-matmul step: 0.4-0.9x). So
  ``placement="auto"`` measures: the first calls of each packable layout (4+ leaves of a dtype)
  alternate, in runs of 4 pipelined calls timed to completion, between packing and jit's own
  per-leaf transfer, and the layout keeps packing only when it was clearly faster (10%) than jit
  (``_Layout.strategy``); ``placement="pack"`` always packs. Measured alternatives that lost: ``jax.device_put(list)`` (~17 us a leaf),
  per-leaf ``device_put`` (~28 us), ``jnp.from_dlpack`` per leaf (~36 us), a separate jitted
  unpack (its 64 outputs cost ~4 us each). A call structure seen before takes a fast path: the
  last full scan's decision, checked with a few list comparisons (types of every leaf; shapes,
  dtypes and writeable flags of the host arrays) instead of a Python loop a leaf.
* **Host constants.** A read-only NumPy argument (``flags.writeable == False`` on it and on every
  array it views) or an ``autoopt.constant`` is placed once and reused; the cache holds the host
  array, so its ``id`` cannot be reused, and drops the device copy once nothing but the cache refers
  to the host array (checked with reference counts). A 64-byte aligned host array is copied before
  placing: XLA:CPU would alias it, and the "copy" would see later writes and keep it alive.
  Writeable arrays are never cached. On the fast path a constant costs an identity lookup.
* **Large closed-over constants** (1 MiB and up) are passed to the program as device arguments,
  placed once, instead of being embedded into the HLO (a 4 MiB constant is 8.4 M characters of
  HLO; first call 158 -> 73 ms). The wrapper's trace stops at them (``HoistConstants``), the
  placer places them and calls again with them under a hidden keyword; calls that reach jit
  without the placer (AOT ``.lower``) embed them as before.
* **Scalars.** Python scalars are left to ``jax.jit`` (it transfers them in C++ for ~1 us); with
  ``canonicalize_scalars=True`` each scalar argument keeps the type of its first call (when the
  value converts exactly), so ``f(x, 2.0)``, ``f(x, 2)``, ``f(x, np.float32(2))`` compile once.
* **Transfer guard.** ``transfer_guard="disallow"|"log"`` runs the jitted call under
  ``jax.transfer_guard_host_to_device`` after autoopt's own (explicit) placement, so only what
  autoopt left behind (Python scalars, or everything under ``placement="off"``) raises or logs,
  with the argument names and the caller's line. Device-to-host guards do not fire on XLA:CPU (the
  host already holds the buffer), so only host-to-device transfers are guarded.

The call path stays lean: a function whose calls have shown no host arrays is checked on its first
calls and then one call in 32 (an increment and a mask test otherwise); once host arrays are seen,
every call is scanned (a flatten and a type test a leaf, far cheaper than the transfer it saves).

NB: the analogue is ``torch.utils.data``'s pinned-memory collation (packing host batches into
one buffer).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
import warnings
from typing import Any

import jax
import numpy as np
from jax import tree_util

from autoopt import _trace

log = logging.getLogger("autoopt")

__all__ = [
    "constant",
    "Constant",
    "Placer",
    "TransferStats",
    "HostTransferError",
    "PACKED",
    "unpack",
    "placer_for",
    "findings_for",
    "constant_cache_size",
    "sweep_constants",
    "HOISTED",
    "HoistConstants",
    "with_hoisted_consts",
]

# The keyword under which packed host buffers travel to the jitted wrapper (never a user's name).
PACKED = "_autoopt_packed"

# XLA:CPU aliases (zero-copies) a host buffer with this alignment instead of copying it.
_ALIGN = 64
# First calls always scanned; afterwards one call in (_SAMPLE_MASK + 1) until host arrays show up.
_WATCH_FIRST = 8
_SAMPLE_MASK = 31
# Once active, this many scanned calls in a row without host arrays return to the lean path.
_IDLE_CALLS = 64
# On XLA:CPU an aligned, contiguous array at least this large is left to jit's zero-copy path.
_ZERO_COPY_MIN_BYTES = 256 * 1024
# A dtype group is packed when it has this many leaves or bytes; a single small leaf costs less
# through jit's own C++ path (~2 us) than an aligned allocation and a copy (~4 us).
_PACK_MIN_LEAVES = 2
_PACK_MIN_BYTES = 64 * 1024
# Off XLA:CPU, one large array is one DMA either way; packing it only adds a host copy.
# (Unmeasured on GPU/TPU in this repository: a conservative bound.)
_PACK_MAX_BYTES_ACCELERATOR = 1 << 20
# Closed-over constants at least this large are reported (they are embedded into the HLO).
_LARGE_CONSTANT_BYTES = 1 << 20

_NDARRAY_TYPES = frozenset({np.ndarray, np.memmap})
_SCALAR_TYPES = frozenset({bool, int, float, complex}) | frozenset(np.sctypeDict.values())
_PY_SCALARS = frozenset({bool, int, float, complex})

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_EXAMPLES_DIR = os.path.join(_PKG_DIR, "examples")


class HostTransferError(RuntimeError):
    """An implicit host-to-device transfer under ``transfer_guard="disallow"``."""


# --- small helpers ---------------------------------------------------------------------------------


def aligned_empty(n: int, dtype) -> np.ndarray:
    """A fresh 1-D array of ``n`` elements whose data is ``_ALIGN``-byte aligned.

    XLA:CPU aliases such a buffer for as long as a computation reads it, so a buffer is reused
    only once jax has let go of it (``_Layout.buffer``).
    """
    dtype = np.dtype(dtype)
    nbytes = n * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    off = (-raw.ctypes.data) % _ALIGN
    return raw[off:off + nbytes].view(dtype)


def _is_aligned(a: np.ndarray) -> bool:
    return a.flags.c_contiguous and a.__array_interface__["data"][0] % _ALIGN == 0


def _calibrate_base_refs() -> int:
    view = np.empty(2).reshape(1, 2)
    base = view.base
    return sys.getrefcount(base)


# References to a base array that only its view holds, as ``is_read_only`` counts them.
_PRIVATE_BASE_REFS = _calibrate_base_refs()


def is_read_only(a: np.ndarray) -> bool:
    """True when neither ``a`` nor any array it views can be written through NumPy.

    A read-only view of a writeable array that anything else refers to is *not* read-only: the
    base can still change. A writeable base that only the view refers to (the temporary in
    ``np.arange(n).reshape(r, c)``) can be reached only through ``a.base``, so it counts as
    read-only. Non-array bases (``bytes``, a read-only ``mmap``) are immutable buffers.
    """
    if a.flags.writeable:
        return False
    base = a.base
    while isinstance(base, np.ndarray):
        if base.flags.writeable and sys.getrefcount(base) > _PRIVATE_BASE_REFS:
            return False
        base = base.base
    return not isinstance(base, bytearray | memoryview) or (
        isinstance(base, memoryview) and base.readonly)


def _user_location() -> str | None:
    """``"file:line"`` of the innermost frame outside autoopt (the user's call), or None."""
    f = sys._getframe(1)
    # The bundled examples live inside the package when installed, but are user code.
    while (f is not None and f.f_code.co_filename.startswith(_PKG_DIR)
           and not f.f_code.co_filename.startswith(_EXAMPLES_DIR)):
        f = f.f_back
    return None if f is None else f"{f.f_code.co_filename}:{f.f_lineno}"


def _describe(x: Any) -> str:
    if isinstance(x, np.ndarray):
        return f"NumPy {x.dtype}{list(x.shape)}"
    if type(x) in _PY_SCALARS:
        return f"Python {type(x).__name__}"
    if isinstance(x, np.generic):
        return f"NumPy scalar {x.dtype}"
    return type(x).__name__


def _nbytes_str(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


# --- host constants ----------------------------------------------------------------------------------


class _Entry:
    __slots__ = ("host", "device")

    def __init__(self, host, device):
        self.host = host
        self.device = device


_CONSTANTS: dict[tuple, _Entry] = {}  # (id(host), device) -> entry
_CONSTANT_IDS: set[int] = set()  # id(host) of every entry: one set test a writeable leaf
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
        for key, e in list(_CONSTANTS.items()):
            if sys.getrefcount(e.host) <= _ENTRY_REFS:  # only the entry refers to it
                del _CONSTANTS[key]
                dropped += 1
        if dropped:
            _CONSTANT_IDS.intersection_update(k[0] for k in _CONSTANTS)
    return dropped


def constant_cache_size() -> int:
    """How many host constants have a cached device copy."""
    return len(_CONSTANTS)


def _evict(host: np.ndarray) -> None:
    with _CONSTANTS_LOCK:
        for key in [k for k, e in _CONSTANTS.items() if e.host is host]:
            del _CONSTANTS[key]
        _CONSTANT_IDS.discard(id(host))


def _cached_constant(host: np.ndarray, device) -> tuple[Any, bool]:
    """``(device copy, placed_now)`` of a read-only host array, placing it once."""
    key = (id(host), device)
    e = _CONSTANTS.get(key)
    # Deleted: an explicit donate_argnums handed the cached copy to XLA. Place it again.
    if e is not None and e.host is host and not e.device.is_deleted():
        return e.device, False
    sweep_constants()
    # XLA:CPU aliases an aligned host buffer instead of copying it (even with may_alias=False,
    # jax 0.10.2): the "device copy" would then see later writes to the host array and keep it
    # alive (the sweep could never drop it). Place a private copy instead: one copy, once.
    src = np.array(host, copy=True) if _is_aligned(host) else host
    # Concrete even when called under a transformation's trace (a cached tracer would leak).
    with jax.ensure_compile_time_eval():
        dev = jax.device_put(src, device)
    del src
    with _CONSTANTS_LOCK:
        _CONSTANTS[key] = _Entry(host, dev)
        _CONSTANT_IDS.add(id(host))
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
    is the caller's: a later change to the host array is not seen. (A read-only NumPy array,
    ``x.flags.writeable = False``, passed to an optimized function is cached the same way.)
    """
    if isinstance(host_array, Constant):
        return host_array
    if isinstance(host_array, jax.core.Tracer):
        raise TypeError("autoopt.constant() needs a concrete host array, got a traced value; "
                        "call it once outside the jitted function and pass the result in.")
    if isinstance(host_array, jax.Array):
        dev = host_array if sharding is None else jax.device_put(host_array, sharding)
        return Constant(host_array, dev)
    host = np.asarray(host_array)
    dev, _ = _cached_constant(host, sharding)
    return Constant(host, dev)


# --- packing host leaves into one buffer a dtype ----------------------------------------------------


class _Pool:
    """Reusable ``_ALIGN``-aligned host buffers of one size, for packed host leaves.

    Why a pool: a fresh 1 MiB buffer a call costs ~90 page faults (~250 us of system time on
    XLA:CPU), because jax frees the previous one from its own thread. Why reference counts:
    XLA:CPU reads a NumPy argument after the call has returned (it aliases aligned buffers and
    copies unaligned ones asynchronously), and jax keeps a reference to the array (C++ dispatch)
    or to a view of it (first-call Python path) until it is done. A buffer is handed out again
    only when the pool's references are the only ones left, to it and to its allocation.
    """

    __slots__ = ("dtype", "total", "bufs", "lock", "size")

    def __init__(self, dtype, total: int, size: int | None = None):
        self.dtype = np.dtype(dtype)
        self.total = total
        self.bufs: list[np.ndarray] = []
        self.lock = threading.Lock()
        self.size = _POOL_SIZE if size is None else size

    def get(self) -> np.ndarray:
        """A buffer no computation is reading: a pooled free one, or a fresh one (kept in the
        pool up to ``_POOL_SIZE`` buffers and ``_POOL_MAX_BYTES``)."""
        with self.lock:  # two threads never get the same free buffer
            for buf in self.bufs:
                # jax may hold the array itself (its C++ dispatch path) or a view of it, whose
                # base is the allocation (its first-call Python path): test both.
                if (sys.getrefcount(buf) <= _POOL_FREE_REFS
                        and sys.getrefcount(buf.base) <= _POOL_FREE_BASE_REFS):
                    return buf
            buf = aligned_empty(self.total, self.dtype)
            if (len(self.bufs) + 1) * buf.nbytes <= _POOL_MAX_BYTES and len(self.bufs) < self.size:
                self.bufs.append(buf)
            return buf

    def __len__(self) -> int:
        return len(self.bufs)


def _calibrate_pool_refs() -> tuple[int, int]:
    """References to a free pooled buffer and to its allocation, as ``_Pool.get`` sees them."""
    bufs = [aligned_empty(1, np.float32)]
    for buf in bufs:
        return sys.getrefcount(buf), sys.getrefcount(buf.base)
    raise AssertionError


_POOL_FREE_REFS, _POOL_FREE_BASE_REFS = _calibrate_pool_refs()
# Buffers a pool keeps: as many as steps a loop that never blocks keeps in flight (measured: a
# 64-leaf feed with 4 buffers still faulted ~60 pages a call; 16 brought it to ~10), capped in
# bytes so a large batch keeps fewer.
_POOL_SIZE = 16
_POOL_MAX_BYTES = 256 << 20

# placement="auto" times both ways of feeding a layout on its first calls (see _Layout.strategy):
# runs of _TUNE_RUN calls, alternating jit and pack; one warm-up run each (it compiles), then
# _TUNE_SAMPLES timed runs each. Calls within a run are not waited for (the host work of one
# overlaps the device work of the previous, as in the user's loop); the run's outputs are waited
# for at its end, so a run's time a call is the loop's throughput, not one call's latency.
# Packing is kept only when its fastest run beats _TUNE_MARGIN times jit's fastest (ties go to
# plain jit). The minimum, not the median: on a shared machine the noise only ever adds time.
_TUNE_RUN = 4
_TUNE_SAMPLES = 3
_TUNE_MARGIN = 0.9
# ... and only for a dtype group of at least this many leaves: with fewer, packing saves a few
# microseconds at most and still costs a second compile.
_AUTO_PACK_MIN_LEAVES = 4


class _Layout:
    """Where each packed leaf lives in the packed buffers. Interned per placer and compared by
    identity: it is the aux data of a pytree node, so jit's signature check hashes it per call.

    ``mode`` is "pack" (pack every call), "jit" (leave the leaves to jit) or "tune": under
    placement="auto" whether packing pays depends on the program (XLA fuses the unpacking slices
    into elementwise consumers, but a slice feeding a concatenate or a dot becomes its own kernel,
    ~10 us each on XLA:CPU) and on the machine, so the first calls measure both (``strategy``).
    """

    __slots__ = ("treedef", "n", "kept", "groups", "static_argnums", "static_argnames", "nargs",
                 "leaves_packed", "bytes_packed", "pools", "mode", "trials", "timings", "run",
                 "run_t0", "run_ok")

    def __init__(self, treedef, n, kept, groups, static_argnums, static_argnames, nargs,
                 mode="pack"):
        self.treedef = treedef
        self.n = n
        self.kept = kept  # leaf indices passed to jit as they are
        # ((dtype, total, ((leaf index, offset, size, shape), ...)), ...): one buffer a dtype
        self.groups = groups
        self.static_argnums = static_argnums
        self.static_argnames = static_argnames
        self.nargs = nargs
        self.leaves_packed = sum(len(g[2]) for g in groups)
        self.bytes_packed = sum(g[1] * np.dtype(g[0]).itemsize for g in groups)
        self.pools = tuple(_Pool(g[0], g[1]) for g in groups)  # reusable host buffers a group
        self.mode = mode
        self.trials = 0  # trial calls handed out while tuning
        self.timings: dict[str, list[float]] = {"jit": [], "pack": []}
        self.run: list = []  # outputs of the timed run in progress (see _time_trial)
        self.run_t0 = 0.0
        self.run_ok = False

    def buffer(self, g: int) -> np.ndarray:
        """A host buffer for group ``g`` that no computation is reading (see ``_Pool``)."""
        return self.pools[g].get()

    def strategy(self) -> tuple[str, int]:
        """``("pack" or "jit", position in the timed run or -1)`` for this call. While tuning,
        alternates runs (jit first: the plain program is usually compiled already)."""
        mode = self.mode
        if mode != "tune":
            return mode, -1
        n = self.trials
        self.trials = n + 1
        run, pos = divmod(n, _TUNE_RUN)
        if run >= 2 * (_TUNE_SAMPLES + 1) + 8:  # timings never came back (traced calls): stop
            self.mode = "jit"
            return "jit", -1
        return ("jit" if run % 2 == 0 else "pack"), pos

    def record(self, strategy: str, seconds: float) -> None:
        """One timed run's time a call (the first run of each strategy warms up: dropped)."""
        if self.mode != "tune":
            return
        t = self.timings[strategy]
        t.append(seconds)
        jit, pack = self.timings["jit"], self.timings["pack"]
        if len(jit) > _TUNE_SAMPLES and len(pack) > _TUNE_SAMPLES:
            j, p = min(jit[1:]), min(pack[1:])
            self.mode = "pack" if p < _TUNE_MARGIN * j else "jit"
            log.debug("autoopt: %s: packed %.1f us, per-leaf jit %.1f us a call: %s", self,
                      p * 1e6, j * 1e6, self.mode)

    def __repr__(self) -> str:
        return f"<packed layout: {self.leaves_packed} leaves in {len(self.groups)} buffers>"


class _Packed:
    """Pytree node carrying the packed buffers (children) and their layout (static aux data)."""

    __slots__ = ("layout", "bufs")

    def __init__(self, layout: _Layout, bufs):
        self.layout = layout
        self.bufs = tuple(bufs)


tree_util.register_pytree_node(
    _Packed, lambda p: (p.bufs, p.layout), lambda layout, bufs: _Packed(layout, bufs))


def unpack(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Inverse of the placer's packing: the arguments as the user passed them.

    Runs inside jit's trace of the wrapper (buffers are tracers: static slices that XLA fuses
    into their consumers) or, under ``jax.disable_jit``, on the host buffers (NumPy views).
    """
    kwargs = dict(kwargs)
    packed = kwargs.pop(PACKED)
    layout = packed.layout
    dyn, statics = _trace.split_args(args, kwargs, layout.static_argnums, layout.static_argnames)
    rest = tree_util.tree_leaves(dyn)
    full: list[Any] = [None] * layout.n
    for i, x in zip(layout.kept, rest):
        full[i] = x
    for (_dtype, _total, members), buf in zip(layout.groups, packed.bufs):
        host = isinstance(buf, np.ndarray)
        for idx, off, size, shape in members:
            if host:  # a copy: the pooled buffer is reused by the next call
                full[idx] = buf[off:off + size].reshape(shape).copy()
            else:
                full[idx] = jax.lax.slice(buf, (off,), (off + size,)).reshape(shape)
    return _trace.merge_args(tree_util.tree_unflatten(layout.treedef, full), statics, layout.nargs)


# --- accounting --------------------------------------------------------------------------------------


@dataclasses.dataclass
class CallTransfers:
    """Host-to-device transfers of one scanned call.

    ``before``: host leaves the caller passed (what plain ``jax.jit`` transfers implicitly).
    ``implicit``: host values jit still transfers implicitly after autoopt's placement (packed
    buffers count here unless a transfer guard made them explicit). ``explicit``: transfers autoopt
    made itself with ``device_put``. ``cached``: leaves served from the constant cache.
    """

    before: int = 0
    implicit: int = 0
    explicit: int = 0
    cached: int = 0
    packed_leaves: int = 0
    packed_bytes: int = 0
    implicit_names: tuple[str, ...] = ()


@dataclasses.dataclass
class TransferStats:
    """Totals over the calls the placer scanned (every call once host arrays were seen)."""

    calls_scanned: int = 0
    before: int = 0
    implicit: int = 0
    explicit: int = 0
    cached: int = 0
    packed_leaves: int = 0
    packed_bytes: int = 0
    constants_placed: int = 0
    last: CallTransfers | None = None
    first_host_site: str | None = None


# --- the fast path's memory of a call structure -------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Feed:
    """What a full scan decided for one argument structure: the type of every leaf, which leaves
    were host arrays (and their shapes, dtypes and writeable flags), all to check the next call
    against; which were served from the constant cache; which are packed into which buffer."""

    arrays: tuple
    types: list
    shapes: list
    dtypes: list
    writeable: list
    consts: tuple
    layout: Any
    pack: tuple
    group_leaves: tuple
    call_jit: CallTransfers
    call_pack: CallTransfers
    # How to rebuild each positional argument (None: the full tree, see _rebuild)
    args_jit: tuple | None = None
    args_pack: tuple | None = None


_MISS = object()
_KEEP = object()  # an argument passed as the caller passed it


def _rebuild(arg_plan, args: tuple, kwargs: dict, leaves: list, treedef, statics, nargs: int):
    """The arguments to call jit with, ``leaves`` holding the placed leaves (None for packed ones).

    With an ``arg_plan`` (one entry a positional argument: ``_KEEP``, None for an argument whose
    leaves are all packed, or ``(treedef, start, end)`` to rebuild it), only the arguments that
    changed are rebuilt, and an argument packed whole is passed as None: jit then flattens and
    checks one leaf where it would check a container of 64 Nones (~11 us on XLA:CPU), and the
    rebuild costs nothing for the arguments that did not change. ``unpack`` reads both forms the
    same way (None flattens to no leaves).
    """
    if arg_plan is None:
        new_dyn = tree_util.tree_unflatten(treedef, leaves)
        new_args, new_kwargs = _trace.merge_args(new_dyn, statics, nargs) if statics else new_dyn
        return tuple(new_args), new_kwargs
    out = []
    for a, step in zip(args, arg_plan):
        if step is _KEEP:
            out.append(a)
        elif step is None:
            out.append(None)
        else:
            td, start, end = step
            out.append(tree_util.tree_unflatten(td, leaves[start:end]))
    return tuple(out), kwargs


def _arg_plan(args: tuple, changed: set, packed: set, n_leaves: int):
    """The ``_rebuild`` plan for positional ``args`` when the leaves ``changed`` are replaced
    (``packed``: those passed in a packed buffer), or None when a keyword leaf changed."""
    plan, start = [], 0
    for a in args:
        td = tree_util.tree_structure(a)
        end = start + td.num_leaves
        mine = [i for i in changed if start <= i < end]
        if not mine:
            plan.append(_KEEP)
        elif len(mine) == end - start and all(i in packed for i in mine):
            plan.append(None)
        else:
            plan.append((td, start, end))
        start = end
    if any(i >= start for i in changed) or start > n_leaves:
        return None
    return tuple(plan)


def _time_trial(trial, out, t0: float) -> None:
    """Keep a tuning call's outputs; at the end of its run, wait for all of them and record the
    run's wall time a call on the layout. A run with a call under a transformation (traced
    outputs) is not recorded."""
    layout, strategy, pos = trial
    leaves = tree_util.tree_leaves(out)
    if pos == 0:
        layout.run, layout.run_t0, layout.run_ok = [], t0, True
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        layout.run_ok = False
    else:
        layout.run.append(leaves)
    if pos == _TUNE_RUN - 1:
        run, layout.run = layout.run, []
        if layout.run_ok and len(run) == _TUNE_RUN:
            jax.block_until_ready(run)
            layout.record(strategy, (time.perf_counter() - layout.run_t0) / _TUNE_RUN)


# --- the placer ----------------------------------------------------------------------------------------


class Placer:
    """Per-``OptimizedFunction`` placement of host inputs, run just before the jitted call.

    ``placer(jitted, args, kwargs)`` returns ``jitted(*args, **kwargs)`` with host arrays packed
    or served from the constant cache, scalars canonicalized when asked, and the call guarded when
    asked. Any failure inside placement falls back to the unmodified call (one warning).
    """

    def __init__(self, fn, options, backend: str):
        self._fn = fn
        self._static_argnums = options.static_argnums
        self._static_argnames = options.static_argnames
        self._has_statics = bool(self._static_argnums or self._static_argnames)
        on = options.placement in ("auto", "pack")
        # Packing many host leaves into one buffer: on every call under placement="pack"; under
        # "auto" only for a layout whose first calls measured it faster than jit's own per-leaf
        # transfer (_Layout.strategy). Measured on XLA:CPU it wins on many small leaves whose
        # unpacking slices fuse into their consumers (64 x f32[64,64] into a feed-bound step:
        # 270 -> ~100 us a call) and loses where each slice becomes its own kernel (9..64 leaves
        # of f32[256,16] concatenated into a matmul: 0.6-0.9x of plain jax.jit). See
        # benchmarks/RESULTS.md and benchmarks/pack_threshold.py.
        # jit refuses keyword arguments when in_shardings is given, and in_shardings names the
        # user's leaves: packing would break both, so only constants are cached then.
        self._pack = on and options.jit_kwargs.get("in_shardings") is None
        self._tune = options.placement == "auto"
        self._cache = on
        guard = options.transfer_guard
        self._guard = guard if guard in ("log", "disallow") else None
        self._canon = options.canonicalize_scalars
        self._device = options.jit_kwargs.get("device")
        self._cpu = backend == "cpu"
        self._always = bool(self._guard or self._canon)  # every call takes the full scan
        self._stay = self._always  # every call takes _call_placed (never the lean path)
        self._active = self._always
        self._calls = 0
        self._idle = 0  # scanned calls in a row with no host array, while active
        self._layouts: dict[tuple, tuple] = {}
        # Large closed-over constants passed as device arguments (see with_hoisted_consts):
        # id(host const) -> (host const, device copy); the node every call passes, or None.
        self._hoist_on = on
        self._hoist_consts: dict[int, tuple] = {}
        self._hoisted: _Hoisted | None = None
        # treedef -> _Feed: what the last full scan of that argument structure decided
        self._feeds: dict[Any, _Feed] = {}
        self._scalar_types: dict[tuple, Any] = {}
        self._logged_sites: set[str] = set()
        self._warned = False
        self.stats = TransferStats()

    # The lean path: one attribute test, an increment and a mask test when nothing was seen.
    def __call__(self, jitted, args: tuple, kwargs: dict):
        if not self._active:
            n = self._calls = self._calls + 1
            if n > _WATCH_FIRST and n & _SAMPLE_MASK:
                return jitted(*args, **kwargs)
        return self._call_placed(jitted, args, kwargs)

    def _call_placed(self, jitted, args: tuple, kwargs: dict):
        t0 = time.perf_counter()
        plan = trial = None
        try:
            plan = self._plan(args, kwargs)
        except Exception as e:  # noqa: BLE001 - placement is an optimization; never break the call
            self._fall_back(e)
        if plan is not None:
            new_args, new_kwargs, trial = plan
            if new_args is not None:  # None: a timed call with the arguments as they are
                args, kwargs = new_args, new_kwargs
        if self._hoist_on:
            out = self._call_hoisting(jitted, args, kwargs)
        elif self._guard is None:
            out = jitted(*args, **kwargs)
        else:
            out = self._call_guarded(jitted, args, kwargs)
        if trial is not None:
            _time_trial(trial, out, t0)
        return out

    def _call_hoisting(self, jitted, args: tuple, kwargs: dict):
        """Call with the hoisted constants passed; when the trace finds new large constants
        (``HoistConstants``), place them once and call again (the trace is cut short before
        anything is lowered or compiled)."""
        for _ in range(4):
            call_kwargs = kwargs
            if self._hoisted is not None:
                call_kwargs = dict(kwargs)
                call_kwargs[HOISTED] = self._hoisted
            outer, _TLS.retry = getattr(_TLS, "retry", False), True
            try:
                if self._guard is None:
                    return jitted(*args, **call_kwargs)
                return self._call_guarded(jitted, args, call_kwargs)
            except HoistConstants as e:
                self._hoist(e.consts)
            finally:
                _TLS.retry = outer
        return jitted(*args, **kwargs)  # (never reached in practice) embed, as plain jit

    def trace_only(self, jitted, args: tuple, kwargs: dict) -> None:
        """``jitted.trace(...)`` for the program alone (the caller reads it from its cache).
        A trace that stops at large constants to hoist (``HoistConstants``) is left uncached by
        jax, so the real call traces again, through ``_call_hoisting``, and passes them."""
        if not self._hoist_on:
            jitted.trace(*args, **kwargs)
            return
        outer, _TLS.retry = getattr(_TLS, "retry", False), True
        try:
            jitted.trace(*args, **kwargs)
        except HoistConstants as e:
            self._hoist(e.consts)
        finally:
            _TLS.retry = outer

    def hoists(self, program) -> bool:
        """Whether calls of ``program`` must go through the placer: it has large constants the
        placer passes as device arguments (the jit signature includes them)."""
        return self._hoist_on and program is not None and bool(_large_consts(program.final))

    def _hoist(self, consts: list) -> None:
        with jax.ensure_compile_time_eval():
            for c in consts:
                if id(c) not in self._hoist_consts:
                    self._hoist_consts[id(c)] = (c, jax.device_put(np.asarray(c), self._device))
        keys = tuple(self._hoist_consts)
        self._hoisted = _Hoisted(keys, tuple(self._hoist_consts[k][1] for k in keys))
        # Every call must now pass them (the same jit signature): stay off the lean path.
        self._stay = self._active = True

    def _fall_back(self, error: BaseException) -> None:
        if not self._warned:
            self._warned = True
            from autoopt._api import AutooptWarning

            warnings.warn(f"autoopt placement skipped for {getattr(self._fn, '__name__', 'fn')}: "
                          f"{type(error).__name__}: {error}. The call runs as plain jax.jit would.",
                          AutooptWarning, stacklevel=5)

    # --- planning one call -------------------------------------------------------------------------

    def _plan(self, args: tuple, kwargs: dict):
        """``(args, kwargs, trial)`` to call jit with (``trial``: a tuning call to time, or None;
        args and kwargs None for the originals), or None to call with the originals."""
        if self._has_statics:
            dyn, statics = _trace.split_args(args, kwargs, self._static_argnums, self._static_argnames)
        else:
            dyn, statics = (args, kwargs), ()
        leaves, treedef = tree_util.tree_flatten(dyn)
        feed = self._feeds.get(treedef)
        # One call in 64 takes the full scan anyway: it sweeps the constant cache and sees a
        # leaf that became a NumPy array where the feed had none.
        if feed is not None and (self.stats.calls_scanned + 1) & 63:
            plan = self._plan_fast(feed, args, kwargs, leaves, treedef, statics, len(args))
            if plan is not _MISS:
                return plan
        return self._plan_full(args, kwargs, dyn, statics, leaves, treedef, len(args))

    def _plan_fast(self, feed: _Feed, args, kwargs, leaves: list, treedef, statics, nargs: int):
        """The last full scan's decision, when this call's host arrays match it: a few list
        comparisons (C loops) instead of the scan's Python loop a leaf (~1 us a leaf)."""
        if [type(x) for x in leaves] != feed.types:  # every leaf: a new NumPy leaf is seen
            return _MISS
        xs = [leaves[i] for i in feed.arrays]
        if ([x.shape for x in xs] != feed.shapes
                or [x.dtype for x in xs] != feed.dtypes
                or [x.flags.writeable for x in xs] != feed.writeable):
            return _MISS
        device, constants = self._device, _CONSTANTS
        for i in feed.consts:  # an identity lookup a constant: the array the cache holds
            x = leaves[i]
            e = constants.get((id(x), device))
            if e is None or e.host is not x or e.device.is_deleted():
                return _MISS
            leaves[i] = e.device
        layout = feed.layout
        trial = None
        strategy = "jit"
        if layout is not None:
            strategy, pos = layout.strategy()
            if pos >= 0:
                trial = (layout, strategy, pos)
        self.stats.calls_scanned += 1
        if strategy == "pack":
            self._record(feed.call_pack)
            bufs = []
            for g, idxs in enumerate(feed.group_leaves):
                buf = layout.pools[g].get()
                np.concatenate([leaves[i] for i in idxs], axis=None, out=buf)
                bufs.append(buf)
                del buf  # the pool's free test counts references
            for i in feed.pack:
                leaves[i] = None
        else:
            self._record(feed.call_jit)
            if not feed.consts:
                if trial is None and not self._stay:
                    self._active = False  # nothing to place here: back to the lean path
                    self._calls = _WATCH_FIRST
                    return None
                return None if trial is None else (None, None, trial)
        new_args, new_kwargs = _rebuild(feed.args_pack if strategy == "pack" else feed.args_jit,
                                        args, kwargs, leaves, treedef, statics, nargs)
        if strategy == "pack":
            new_kwargs = dict(new_kwargs)
            new_kwargs[PACKED] = _Packed(layout, bufs)
        return new_args, new_kwargs, trial

    def _plan_full(self, args, kwargs, dyn, statics, leaves: list, treedef, nargs: int):
        """Scan every leaf: place constants, pack or leave host arrays, canonicalize scalars,
        count; remember the decision for ``_plan_fast``."""
        arrays: list[int] = []
        scalars: list[int] = []
        ndarray_types, scalar_types = _NDARRAY_TYPES, _SCALAR_TYPES
        for i, x in enumerate(leaves):
            t = type(x)
            if t in ndarray_types:
                arrays.append(i)
            elif t in scalar_types:
                scalars.append(i)
        stats = self.stats
        stats.calls_scanned += 1
        if stats.calls_scanned % 64 == 0 and _CONSTANTS:
            sweep_constants()
        call = CallTransfers(before=len(arrays) + len(scalars))
        changed = False
        if scalars and self._canon:
            changed = self._canonicalize(leaves, treedef, scalars)
        implicit = list(scalars)
        layout = None
        trial = None
        strategy = "jit"
        bufs: list = []
        consts: list[int] = []
        pack: list[int] = []
        xs = [leaves[i] for i in arrays]
        types = [type(x) for x in leaves]  # before constants and packing replace leaves
        if not arrays and self._active and not self._stay:
            self._idle += 1
            if self._idle >= _IDLE_CALLS:  # host arrays stopped coming: back to the lean path
                self._active, self._idle, self._calls = False, 0, _WATCH_FIRST
        if arrays:
            if stats.first_host_site is None:
                stats.first_host_site = _user_location()
            pack_on, cache_on, ids = self._pack, self._cache, _CONSTANT_IDS
            zero_copy_min = _ZERO_COPY_MIN_BYTES if self._cpu and not self._guard else None
            for i in arrays:
                x = leaves[i]
                if x.flags.writeable:
                    if id(x) in ids:
                        _evict(x)  # cached while read-only, writeable again: drop the stale copy
                elif cache_on and is_read_only(x):
                    dev, placed = _cached_constant(x, self._device)
                    leaves[i] = dev
                    consts.append(i)
                    call.cached += 1
                    stats.constants_placed += placed
                    changed = True
                    continue
                # XLA:CPU aliases a large aligned contiguous array for free: leave it to jit.
                if pack_on and (zero_copy_min is None or x.nbytes < zero_copy_min
                                or not _is_aligned(x)):
                    if self._cpu or self._guard or x.nbytes <= _PACK_MAX_BYTES_ACCELERATOR:
                        pack.append(i)
                        continue
                implicit.append(i)
            if pack:
                layout, pack, left = self._layout_for(leaves, treedef, pack, nargs)
                implicit.extend(left)
            if layout is not None:
                strategy, pos = layout.strategy()
                if pos >= 0:
                    trial = (layout, strategy, pos)
                if strategy != "pack":
                    implicit.extend(pack)
            if strategy == "pack":
                for g, (_dtype, _total, members) in enumerate(layout.groups):
                    buf = layout.buffer(g)
                    np.concatenate([leaves[m[0]] for m in members], axis=None, out=buf)
                    bufs.append(buf)
                    del buf  # the pool's free test counts references
                for i in pack:
                    leaves[i] = None
                call.packed_leaves = layout.leaves_packed
                call.packed_bytes = layout.bytes_packed
                changed = True
            if consts or trial is not None or strategy == "pack":
                self._active, self._idle = True, 0
            elif not self._stay:  # nothing to place: leave this feed to the lean path
                self._active, self._calls = False, max(self._calls, _WATCH_FIRST)
        if bufs:
            if self._guard:
                with jax.ensure_compile_time_eval():
                    bufs = jax.device_put(bufs, self._device)
                call.explicit = len(bufs)
            else:
                call.implicit += len(bufs)
        call.implicit += len(implicit)
        if implicit and (self._guard or log.isEnabledFor(logging.DEBUG)):
            call.implicit_names = self._names(dyn, statics, nargs, sorted(implicit))
        self._record(call)
        if arrays and not self._always:
            feed = self._remember(args, treedef, types, arrays, xs, consts, layout, pack, call,
                                  len(scalars))
        else:
            feed = None
        if not changed:
            return None if trial is None else (None, None, trial)
        # The same call structure as _plan_fast builds (one jit signature, one compile).
        arg_plan = None if feed is None else (
            feed.args_pack if strategy == "pack" else feed.args_jit)
        new_args, new_kwargs = _rebuild(arg_plan, args, kwargs, leaves, treedef, statics, nargs)
        if strategy == "pack":
            new_kwargs = dict(new_kwargs)
            new_kwargs[PACKED] = _Packed(layout, bufs)
        return tuple(new_args), new_kwargs, trial

    def _remember(self, args, treedef, types, arrays, xs, consts, layout, pack, call,
                  n_scalars) -> _Feed:
        """Store this scan's decision for the next calls with the same structure (_plan_fast)."""
        if len(self._feeds) >= 64:  # a function called with ever new structures: start over
            self._feeds.clear()
        n_arrays = len(arrays)
        jit_call = CallTransfers(before=call.before, cached=len(consts),
                                 implicit=n_scalars + n_arrays - len(consts))
        pack_call = jit_call
        group_leaves: tuple = ()
        if layout is not None:
            group_leaves = tuple(tuple(m[0] for m in members) for _d, _t, members in layout.groups)
            pack_call = CallTransfers(
                before=call.before, cached=len(consts), packed_leaves=layout.leaves_packed,
                packed_bytes=layout.bytes_packed,
                implicit=n_scalars + n_arrays - len(consts) - len(pack) + len(layout.groups))
        args_jit = args_pack = None
        if not self._has_statics:
            n = len(types)
            args_jit = _arg_plan(args, set(consts), set(), n)
            args_pack = _arg_plan(args, set(consts) | set(pack), set(pack), n)
        feed = self._feeds[treedef] = _Feed(
            arrays=tuple(arrays), types=types, shapes=[x.shape for x in xs],
            dtypes=[x.dtype for x in xs], writeable=[x.flags.writeable for x in xs],
            consts=tuple(consts), layout=layout, pack=tuple(pack), group_leaves=group_leaves,
            call_jit=jit_call, call_pack=pack_call, args_jit=args_jit, args_pack=args_pack)
        return feed

    def _layout_for(self, leaves: list, treedef, pack: list[int], nargs: int):
        """``(layout or None, packed leaf indices, leaf indices left to jit)``."""
        xs = [leaves[i] for i in pack]
        key = (treedef, nargs, tuple(pack), tuple([x.shape for x in xs]), tuple([x.dtype for x in xs]))
        hit = self._layouts.get(key)
        if hit is not None:
            return hit
        by_dtype: dict[Any, list[int]] = {}
        for i in pack:
            by_dtype.setdefault(leaves[i].dtype, []).append(i)
        tune = self._tune and not self._guard  # under a guard, packing makes transfers explicit
        groups, packed, left = [], [], []
        for dtype, idxs in by_dtype.items():
            nbytes = sum(leaves[i].nbytes for i in idxs)
            if tune:
                if len(idxs) < _AUTO_PACK_MIN_LEAVES:
                    left.extend(idxs)
                    continue
            elif not self._guard and len(idxs) < _PACK_MIN_LEAVES and nbytes < _PACK_MIN_BYTES:
                left.extend(idxs)
                continue
            members, off = [], 0
            for i in idxs:
                size = int(leaves[i].size)
                members.append((i, off, size, tuple(leaves[i].shape)))
                off += size
            groups.append((dtype, off, tuple(members)))
            packed.extend(idxs)
        packed_set = set(packed)
        kept = tuple(i for i in range(len(leaves)) if i not in packed_set)
        layout = None
        if groups:
            layout = _Layout(treedef, len(leaves), kept, tuple(groups), self._static_argnums,
                             self._static_argnames, nargs, mode="tune" if tune else "pack")
        hit = (layout, packed, left)
        self._layouts[key] = hit
        return hit

    def _canonicalize(self, leaves: list, treedef, scalars: list[int]) -> bool:
        """Give each scalar leaf the type of its first call when the value converts exactly."""
        changed = False
        for i in scalars:
            x = leaves[i]
            t = type(x)
            first = self._scalar_types.setdefault((treedef, i), t)
            if first is t:
                continue
            try:
                y = first(x)
            except (TypeError, ValueError, OverflowError):
                continue
            same = y == x or (y != y and x != x)  # NaN converts to NaN
            if same and not (first in (bool, np.bool_) and x not in (0, 1)):
                leaves[i] = y
                changed = True
        return changed

    def _names(self, dyn, statics, nargs: int, idxs: list[int]) -> tuple[str, ...]:
        try:
            names, _ = _trace.leaf_names_and_args(self._fn, dyn, statics, nargs)
            return tuple(names[i] for i in idxs)
        except Exception:  # noqa: BLE001 - names are for messages only
            return tuple(f"leaf {i}" for i in idxs)

    def _record(self, call: CallTransfers) -> None:
        s = self.stats
        s.before += call.before
        s.implicit += call.implicit
        s.explicit += call.explicit
        s.cached += call.cached
        s.packed_leaves += call.packed_leaves
        s.packed_bytes += call.packed_bytes
        s.last = call

    # --- the guard -----------------------------------------------------------------------------------

    def _call_guarded(self, jitted, args: tuple, kwargs: dict):
        call = self.stats.last
        site = _user_location()
        if self._guard == "log" and call is not None and call.implicit and site not in self._logged_sites:
            self._logged_sites.add(site)
            log.warning("autoopt: %d implicit host-to-device transfer(s) in the call at %s: %s",
                        call.implicit, site, ", ".join(call.implicit_names) or "?")
        with jax.transfer_guard_host_to_device(self._guard):
            try:
                return jitted(*args, **kwargs)
            except jax.errors.JaxRuntimeError as e:
                if "host-to-device transfer" not in str(e):
                    raise
                names = call.implicit_names if call is not None else ()
                what = ", ".join(f"`{n}`" for n in names) or "an argument"
                raise HostTransferError(
                    f"autoopt: implicit host-to-device transfer of {what} in the call of "
                    f"{getattr(self._fn, '__name__', 'fn')} at {site} (transfer_guard='disallow'). "
                    "Pass device arrays (jnp.asarray(...) once, outside the loop), mark arrays "
                    "that never change with autoopt.constant(...), feed batches through "
                    "autoopt.prefetch(...), or use transfer_guard='log' to only report. "
                    f"JAX said: {e}") from e


def placer_for(optimized) -> Placer | None:
    """The placer an ``OptimizedFunction`` needs, or None when no option asks for one."""
    o = optimized._options
    if o.placement == "off" and not o.canonicalize_scalars and o.transfer_guard in (None, "allow"):
        return None
    return Placer(optimized.__wrapped__, o, optimized._backend)


# --- findings for the report ----------------------------------------------------------------------------


def findings_for(optimized, program, args: tuple, kwargs: dict) -> list:
    """Placement findings for one call's concrete arguments: host arrays and scalars (with the
    argument name and the caller's line), recompile triggers, large closed-over constants, and
    the transfer counts the placer measured."""
    from autoopt.explain._finding import Finding

    out: list[Finding] = []
    o = optimized._options
    placer = getattr(optimized, "_placer", None)
    stats = placer.stats if placer is not None else None
    site = (stats.first_host_site if stats is not None else None) or optimized._fn_location
    fn = optimized.__wrapped__
    dyn, statics = _trace.split_args(args, kwargs, optimized._static_argnums, optimized._static_argnames)
    leaves = tree_util.tree_leaves(dyn)
    names, _ = _trace.leaf_names_and_args(fn, dyn, statics, len(args))
    on = o.placement in ("auto", "pack")
    # placement="auto" packs a layout only where its first calls measured packing faster
    pack_on = o.placement == "pack" or bool(
        stats is not None and stats.last is not None and stats.last.packed_leaves)
    cpu = optimized._backend == "cpu"

    arrays = [i for i, x in enumerate(leaves) if isinstance(x, np.ndarray)]
    scalars = [i for i, x in enumerate(leaves) if type(x) in _SCALAR_TYPES]
    read_only = [i for i in arrays if is_read_only(leaves[i])]
    writeable = [i for i in arrays if i not in read_only]
    for i in read_only:
        x = leaves[i]
        out.append(Finding(
            kind="placement", applied=on, location=site, bytes_saved=None,
            transfers_avoided=1 if on else 0,
            message=(f"`{names[i]}` ({_describe(x)}, {_nbytes_str(x.nbytes)}) is read-only: "
                     + ("placed on the device once and reused by every call (the copy is dropped "
                        "when the host array is freed)." if on else
                        "it would be placed once and reused with placement='auto'.")),
            details={"leaf": names[i], "strategy": "constant", "bytes": int(x.nbytes)}))
    if writeable:
        small = [i for i in writeable if not (cpu and leaves[i].nbytes >= _ZERO_COPY_MIN_BYTES
                                              and _is_aligned(leaves[i]))]
        nbytes = sum(int(leaves[i].nbytes) for i in writeable)
        shown = ", ".join(f"`{names[i]}`" for i in writeable[:4]) + (" ..." if len(writeable) > 4 else "")
        if pack_on and len(small) >= _PACK_MIN_LEAVES:
            msg = (f"{len(writeable)} NumPy argument leaves ({shown}; {_nbytes_str(nbytes)}) are "
                   f"transferred on every call: packed into one aligned host buffer per dtype, "
                   f"one transfer instead of {len(small)}.")
            avoided = len(small) - len({leaves[i].dtype for i in small})
        else:
            msg = (f"NumPy argument leaves {shown} ({_nbytes_str(nbytes)}) are transferred on "
                   "every call by jit" + ("" if on else " (placement='off')") + ". Place them "
                   "ahead with autoopt.prefetch(batches) in the loop that feeds this call. "
                   "placement='auto' packs 4+ small leaves of a dtype into one transfer where "
                   "its first calls measure that faster (it was not, or not yet measured, here); "
                   "placement='pack' always packs.")
            avoided = 0
        big = [i for i in writeable if leaves[i].nbytes >= _LARGE_CONSTANT_BYTES]
        if big:
            msg += (f" `{names[big[0]]}` is large: if it never changes, mark it read-only "
                    "(`x.flags.writeable = False`) or wrap it in autoopt.constant(x) to place it once.")
        out.append(Finding(kind="placement", applied=pack_on and avoided > 0, location=site,
                           transfers_avoided=avoided, message=msg,
                           details={"leaves": [names[i] for i in writeable], "strategy": "pack"}))
    if scalars:
        shown = ", ".join(f"`{names[i]}` ({_describe(leaves[i])})" for i in scalars[:4])
        out.append(Finding(
            kind="placement", applied=o.canonicalize_scalars, location=site,
            message=(f"scalar arguments {shown} are transferred by jit on every call, and each "
                     "distinct scalar type (2.0, 2, True, np.float32(2)) compiles a new program"
                     + (": canonicalize_scalars=True keeps the first call's type." if
                        o.canonicalize_scalars else
                        "; pass canonicalize_scalars=True (each keeps its first call's type) or "
                        "pass jax arrays.")),
            details={"leaves": [names[i] for i in scalars], "strategy": "scalar"}))
    out.extend(_recompile_findings(optimized, site))
    out.extend(_closed_constant_findings(program, hoist=on))
    if stats is not None and stats.last is not None:
        last = stats.last
        out.append(Finding(
            # transfers_avoided stays None: the placement findings above already count them.
            kind="transfer", applied=last.implicit < last.before, location=site,
            message=(f"host-to-device transfers in the last scanned call: {last.before} host "
                     f"values passed, {last.implicit} transferred implicitly by jit, "
                     f"{last.explicit} placed explicitly, {last.cached} served from the constant "
                     f"cache ({stats.calls_scanned} calls scanned)."),
            details=dataclasses.asdict(last)))
    return out


def _recompile_findings(optimized, site) -> list:
    """Programs of this function that differ only in the type of scalar leaves."""
    from autoopt.explain._finding import Finding

    groups: dict[tuple, list] = {}
    for key, program in list(optimized._programs.items()):
        shapes = tuple(getattr(t, "shape", None) for t in key.types)  # key: _trace.Signature
        groups.setdefault(key._replace(types=shapes), []).append((key.types, program))
    out = []
    for members in groups.values():
        if len(members) < 2:
            continue
        types0, program = members[0]
        differ = [i for i in range(len(types0))
                  if len({(str(getattr(t[i], "dtype", t[i])), getattr(t[i], "weak_type", False))
                          for t, _ in members}) > 1]
        names = program.traced.in_leaf_names
        shown = ", ".join(f"`{names[i]}`" if i < len(names) else f"leaf {i}" for i in differ[:4])
        out.append(Finding(
            kind="placement", applied=False, location=site,
            message=(f"compiled {len(members)} programs that differ only in the dtype or weak type "
                     f"of {shown}: a recompile trigger (Python scalars of different types, or "
                     "NumPy scalars). Pass canonicalize_scalars=True or jax arrays of one dtype."),
            details={"leaves": [names[i] for i in differ if i < len(names)], "programs": len(members),
                     "strategy": "recompile"}))
    return out


def _closed_constant_findings(program, hoist: bool = False) -> list:
    """Large constants closed over by the function: passed as device arguments placed once
    (``hoist``: placement on, and at least ``_HOIST_MIN_BYTES``) or embedded into the program."""
    from autoopt import _jaxpr
    from autoopt.explain._finding import Finding

    closed = program.traced.closed
    out = []
    for var, c in zip(closed.jaxpr.constvars, closed.consts):
        nbytes = int(getattr(c, "nbytes", 0) or 0)
        if nbytes < _LARGE_CONSTANT_BYTES:
            continue
        where = None
        for site in _jaxpr.iter_eqns(closed):
            if any(v is var for v in site.eqn.invars):
                where = _jaxpr.user_location(site.eqn)
                break
        what = f"a closed-over constant {getattr(c, 'dtype', '')}{list(getattr(c, 'shape', ()))}"
        hoisted = hoist and nbytes >= _HOIST_MIN_BYTES
        out.append(Finding(
            kind="placement", applied=hoisted, location=where, bytes_saved=None,
            message=(f"{what} ({_nbytes_str(nbytes)}) is passed to the compiled program as a "
                     "device argument, placed once, instead of being embedded into it (calls "
                     "that reach jit without autoopt's placer still embed it)." if hoisted else
                     f"{what} ({_nbytes_str(nbytes)}) is embedded into the compiled program: it "
                     "slows compilation and is copied into every executable. Pass it as an "
                     "argument (wrapped in autoopt.constant(...) so it is placed once)."),
            details={"bytes": nbytes, "strategy": "closed_constant"}))
    return out


# --- large closed-over constants: device arguments instead of HLO constants ---------------------------

# The keyword under which hoisted constants travel to the jitted wrapper (never a user's name).
HOISTED = "_autoopt_hoisted"
# Top-level consts of the optimized program at least this large are passed as device arguments,
# placed once, instead of being embedded in the HLO (a 4 MiB constant is 8.4 M characters of HLO
# text and is copied into every executable). jax 0.10.2's own hoisting
# (jax_use_simplified_jaxpr_constants) still embeds them when lowering.
_HOIST_MIN_BYTES = 1 << 20
_TLS = threading.local()  # .retry: the placer will retry a call whose trace asks to hoist


class HoistConstants(Exception):
    """Raised out of jit's trace of the wrapper when the program has large constants the call
    did not pass as arguments; the placer places them and calls again. Never reaches the user."""

    def __init__(self, consts: list):
        super().__init__("autoopt: large constants to pass as arguments")
        self.consts = consts


class _Hoisted:
    """Pytree node: the device copies of a function's large constants (children), keyed by the
    ``id`` of the program's host constant (static aux data, so a new constant is a new signature).
    """

    __slots__ = ("keys", "devs")

    def __init__(self, keys: tuple, devs: tuple):
        self.keys = keys
        self.devs = devs


tree_util.register_pytree_node(
    _Hoisted, lambda h: (h.devs, h.keys), lambda keys, devs: _Hoisted(keys, tuple(devs)))


def _large_consts(closed) -> list:
    return [c for c in closed.consts
            if getattr(c, "ndim", 0) > 0 and int(getattr(c, "nbytes", 0) or 0) >= _HOIST_MIN_BYTES
            and not isinstance(c, jax.core.Tracer)]


def with_hoisted_consts(closed, hoisted: _Hoisted | None):
    """``closed`` with each large constant replaced by the argument ``hoisted`` carries for it.

    Runs inside jit's trace of the wrapper. When a large constant was not passed: raises
    ``HoistConstants`` if the placer is waiting to retry this call, else embeds it as before.
    """
    large = _large_consts(closed)
    if not large:
        return closed
    passed = {} if hoisted is None else dict(zip(hoisted.keys, hoisted.devs))
    missing = [c for c in large if id(c) not in passed]
    if missing:
        if getattr(_TLS, "retry", False):
            raise HoistConstants(missing)
        if not passed:
            return closed
    consts = [passed.get(id(c), c) for c in closed.consts]
    return closed.replace(consts=consts)
