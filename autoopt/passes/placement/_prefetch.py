"""``autoopt.prefetch``: a bounded background pipeline that places each batch on the device
(batched, or split over a sharding) while the previous step runs.

A worker thread pulls from the user's iterator, places each batch, and hands it over through a
bounded queue (``size`` batches ahead); exceptions from the source surface in the consumer, and
the thread ends when the consumer stops early (``close``, ``with``, or garbage collection). Many
small NumPy leaves of one dtype are packed into one pooled host buffer first (one transfer, then
sliced apart on the device); a buffer goes back to its pool only when nothing else refers to it,
so a device array that may alias it (XLA:CPU aliases aligned host buffers) is never overwritten.

A batch never shares memory with a host buffer that can still change. Loaders often refill one
buffer a batch (``buf[:] = data; yield buf``): placing it directly would hand out device arrays
that alias it (XLA:CPU zero-copies an aligned buffer) or whose copy completes after the loader
wrote the next batch into it. So the worker copies every NumPy leaf into a private pooled buffer
(or the packed buffer) before it asks the source for the next batch, and places that: one host
memcpy a leaf, on the worker thread, while the consumer's step runs. Blocking until each
transfer completes instead would not stop XLA:CPU's aliasing; copying on the consumer's side
would put the copy on the step's critical path.

What prefetch keeps a batch layout is bounded whatever the number of layouts it sees: the jitted
placers (an unpacker a packed layout, an identity a layout seen twice) in a small LRU, the host
pools in an LRU bounded in count and bytes, made only for a layout seen before; a layout's first
batch compiles nothing and pools nothing (``cache_sizes``, benchmarks/prefetch_memory.py).

NB: the analogues are flax's ``jax_utils.prefetch_to_device`` and the JAX training cookbook's
double-buffered input pipeline.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np
from jax import tree_util

from autoopt.passes.placement._host_arrays import aligned_empty
from autoopt.passes.placement._packing import POOL_MAX_BYTES, Pool

__all__ = ["prefetch", "Prefetch", "place_batch"]


# A jitted identity places every host leaf of a batch in one dispatch through jit's C++ argument
# path, several times cheaper a leaf than jax.device_put(list) on XLA:CPU; one jitted unpacker
# slices a packed buffer back into its leaves. Each holds a compiled executable a layout (the
# leaves' shapes and dtypes), and an executable, once compiled, costs memory that freeing gives
# back only to later compiles: so they are jit objects a layout in one small LRU (``_PLACERS``),
# and an identity is compiled only for a layout seen before (``_seen``); a layout's first batch
# goes through jax.device_put(list), which compiles nothing. A loader of ever new layouts then
# compiles nothing, and a repeating layout keeps its executable.
_PLACERS_MAX = 16
_PLACERS: OrderedDict[tuple, Any] = OrderedDict()
# Layouts seen once (keys only: shapes and dtypes), so that the second batch of one compiles.
_SEEN_MAX = 256
_SEEN: OrderedDict[tuple, None] = OrderedDict()
# A small ring of host buffers a layout (packed, or one leaf's private copy), reused once jax has
# let go of them (Pool): a fresh buffer a batch costs page faults on every batch. A pool is made
# for a layout seen before only (a layout's first batch copies into a fresh buffer nothing
# keeps), least recently used dropped first beyond ``_PREFETCH_POOLS_MAX`` pools or beyond the
# bytes they may hold: ``_PREFETCH_POOLS_BATCHES`` times the batch being placed (a loop that
# alternates a few layouts keeps all of theirs), at least ``_PREFETCH_POOLS_MIN_BYTES``.
_PREFETCH_POOLS: OrderedDict[tuple, Pool] = OrderedDict()
_PREFETCH_POOLS_MAX = 64  # one a packed layout or a leaf shape: a batch of many shapes fits
_PREFETCH_POOL_SIZE = 4
_PREFETCH_POOLS_BATCHES = 8
_PREFETCH_POOLS_MIN_BYTES = 64 << 20
_POOL_BYTES: dict[tuple, int] = {}  # the most each pool may hold (Pool's own caps)
_CACHE_LOCK = threading.Lock()  # several prefetch threads may place at once


def _seen(key: tuple) -> bool:
    """Whether ``key`` was seen before (recently); records it. Call with ``_CACHE_LOCK`` held."""
    if key in _SEEN:
        _SEEN.move_to_end(key)
        return True
    _SEEN[key] = None
    if len(_SEEN) > _SEEN_MAX:
        _SEEN.popitem(last=False)
    return False


def _cached_placer(key: tuple, make, first_too: bool):
    """The jitted placer of layout ``key`` (``make()`` builds it), from the LRU; None for a
    layout's first batch unless ``first_too``."""
    with _CACHE_LOCK:
        fn = _PLACERS.get(key)
        if fn is not None:
            _PLACERS.move_to_end(key)
            return fn
        if not first_too and not _seen(key):
            return None
    fn = make()
    with _CACHE_LOCK:
        _PLACERS[key] = fn
        while len(_PLACERS) > _PLACERS_MAX:
            _PLACERS.popitem(last=False)  # its compiled executable goes with the jit object
    return fn


def _make_identity():
    return jax.jit(lambda *xs: xs)


def _make_unpacker(members: tuple):
    def split(buf):
        return tuple(
            jax.lax.slice(buf, (off,), (off + size,)).reshape(shape)
            for _i, off, size, shape in members
        )

    return lambda: jax.jit(split)


def _host_buffer(members: tuple, dtype, total: int, batch_bytes: int) -> np.ndarray:
    """An aligned host buffer of ``total`` elements nothing else writes: from the layout's pool,
    or a fresh one for a layout's first batch. ``batch_bytes``: the bytes of the batch."""
    key = (members, np.dtype(dtype))
    with _CACHE_LOCK:
        pool = _PREFETCH_POOLS.get(key)
        if pool is not None:
            _PREFETCH_POOLS.move_to_end(key)
        elif _seen(key):
            pool = _new_pool(key, total, batch_bytes)
    if pool is None:
        return aligned_empty(total, dtype)
    return pool.get()


def _new_pool(key: tuple, total: int, batch_bytes: int) -> Pool:
    """A pool for ``key``, least recently used ones dropped to stay in bounds (lock held)."""
    dtype = key[1]
    nbytes = total * dtype.itemsize
    cap = nbytes * min(_PREFETCH_POOL_SIZE, POOL_MAX_BYTES // nbytes) if nbytes else 0
    budget = max(_PREFETCH_POOLS_MIN_BYTES, _PREFETCH_POOLS_BATCHES * batch_bytes)
    held = sum(_POOL_BYTES.values())
    while _PREFETCH_POOLS and (len(_PREFETCH_POOLS) >= _PREFETCH_POOLS_MAX or held + cap > budget):
        old, _ = _PREFETCH_POOLS.popitem(last=False)  # its buffers go once jax lets go of them
        held -= _POOL_BYTES.pop(old)
    pool = _PREFETCH_POOLS[key] = Pool(dtype, total, _PREFETCH_POOL_SIZE)
    _POOL_BYTES[key] = cap
    return pool


def _private_copy(x: np.ndarray, batch_bytes: int) -> np.ndarray:
    """``x`` copied into a buffer nothing else writes (aligned, so XLA:CPU aliases the copy
    instead of copying again; a pool hands it out again only once jax let go of it)."""
    buf = _host_buffer(("copy", x.shape), x.dtype, int(x.size), batch_bytes)
    out = buf.reshape(x.shape)
    del buf  # the pool's free test counts references
    np.copyto(out, x, casting="no")
    return out


def cache_sizes() -> dict[str, int]:
    """What prefetch keeps, shared by every prefetch, and the bounds: ``unpackers`` (jitted
    placers, one a batch layout: unpackers of packed layouts and identities of layouts seen
    twice), ``layouts`` (layouts remembered as seen, shapes and dtypes only), ``pools`` (host
    buffer pools, one a repeating packed layout or leaf shape) and ``pooled_bytes`` (the host
    memory they hold)."""
    with _CACHE_LOCK:
        return {
            "unpackers": len(_PLACERS),
            "unpackers_max": _PLACERS_MAX,
            "layouts": len(_SEEN),
            "layouts_max": _SEEN_MAX,
            "pools": len(_PREFETCH_POOLS),
            "pools_max": _PREFETCH_POOLS_MAX,
            "pooled_bytes": sum(
                sum(b.nbytes for b in pool.bufs) for pool in _PREFETCH_POOLS.values()
            ),
        }


# Many tiny leaves: one packed buffer and a jitted split beat one jit argument a leaf.
_PREFETCH_PACK_MIN_LEAVES = 16
_PREFETCH_PACK_MAX_MEAN_BYTES = 8 * 1024


_JAX_DTYPES: dict = {}


def _jax_dtype(dtype) -> bool:
    """A jax array can hold this dtype (numbers, bool, bfloat16 and the other ml_dtypes)."""
    known = _JAX_DTYPES.get(dtype)
    if known is None:
        try:
            jax.dtypes.canonicalize_dtype(dtype)
            known = dtype.kind in "biufc" or dtype.type.__module__.startswith("ml_dtypes")
        except Exception:  # noqa: BLE001 - strings, objects, datetimes, structured
            known = False
        _JAX_DTYPES[dtype] = known
    return known


def _may_share_host_memory(x) -> bool:
    """A jax array on XLA:CPU that is not a typed PRNG key (keys are made by jax, never from
    a host buffer)."""
    if not isinstance(x, jax.Array) or jax.numpy.issubdtype(x.dtype, jax.dtypes.extended):
        return False
    try:
        return x.is_fully_addressable and all(d.platform == "cpu" for d in x.sharding.device_set)
    except Exception:  # noqa: BLE001 - a tracer or an array whose sharding is unknown
        return False


def _sharding_for(sharding, x):
    """``sharding`` for a leaf of fewer dimensions than its partition spec names: the spec cut
    to the leaf's rank (a batch's scalar, e.g. a learning rate, or its 1-d labels beside
    ``P("data", "model")`` images), the rest replicated. jax.device_put refuses such a leaf with
    an assertion; splitting a dimension the leaf does not have has no other meaning, and where
    a value lives does not change it."""
    if isinstance(sharding, jax.sharding.NamedSharding) and len(sharding.spec) > np.ndim(x):
        spec = jax.sharding.PartitionSpec(*sharding.spec[: np.ndim(x)])
        return jax.sharding.NamedSharding(sharding.mesh, spec, memory_kind=sharding.memory_kind)
    return sharding


def place_batch(batch, sharding=None, process_local: bool = False):
    """``batch`` with every NumPy leaf on the device (or split over ``sharding``), in one batched
    placement, from host copies private to it (the caller may overwrite its arrays as soon as
    this returns). jax arrays and Python scalars are returned as they are. ``process_local``:
    each leaf is this process's part of a global array over ``sharding``
    (``jax.make_array_from_process_local_data``)."""
    leaves, treedef = tree_util.tree_flatten(batch)
    # Every NumPy array, subclasses too (jax.jit takes a loader's own array type as the array
    # it is), of a dtype jax can hold: a batch's file names (a `<U` array) or an object array
    # stay as they are, as plain iteration leaves them; so does a masked array, which jax.jit
    # refuses (a copy would drop its mask without a word).
    host = [
        i
        for i, x in enumerate(leaves)
        if isinstance(x, np.ndarray | np.generic)
        and not isinstance(x, np.ma.MaskedArray)
        and _jax_dtype(x.dtype)
    ]
    # On XLA:CPU a jax array the loader made with ``jax.device_put(buf)`` may share ``buf``'s
    # memory, which the loader refills while this runs ahead: copied (device to device).
    shared = [i for i, x in enumerate(leaves) if _may_share_host_memory(x)]
    for i in shared:
        leaves[i] = jax.device_put(leaves[i], may_alias=False)
    if shared:  # (complete before the loader runs again and refills what they read)
        jax.block_until_ready([leaves[i] for i in shared])
    if not host:
        return tree_util.tree_unflatten(treedef, leaves) if shared else batch
    # NumPy scalars are immutable; every array is copied, unless packed (the packing copies it).
    xs = [x if isinstance(x, np.generic) else np.asarray(x) for x in (leaves[i] for i in host)]
    batch_bytes = sum(x.nbytes for x in xs)

    packed = (
        sharding is None
        and len(xs) >= _PREFETCH_PACK_MIN_LEAVES
        and batch_bytes / len(xs) <= _PREFETCH_PACK_MAX_MEAN_BYTES
        and len({x.dtype for x in xs}) == 1
    )
    if packed:
        members, off = [], 0
        for i, x in enumerate(xs):
            members.append((i, off, int(x.size), tuple(x.shape)))
            off += int(x.size)
        members = tuple(members)
        buf = _host_buffer(members, xs[0].dtype, off, batch_bytes)
        np.concatenate(xs, axis=None, out=buf)
        key = ("unpack", members, buf.dtype)
        unpacker = _cached_placer(key, _make_unpacker(members), first_too=True)
        assert unpacker is not None  # first_too: made on a miss
        placed = unpacker(buf)
        del buf  # the pool's free test counts references
    else:
        xs = [x if isinstance(x, np.generic) else _private_copy(x, batch_bytes) for x in xs]
        if process_local:
            placed = [
                jax.make_array_from_process_local_data(_sharding_for(sharding, x), x) for x in xs
            ]
        elif sharding is not None:
            placed = jax.device_put(xs, [_sharding_for(sharding, x) for x in xs])
        elif len(xs) == 1:
            placed = [jax.device_put(xs[0])]
        else:
            key = ("identity", *[(x.shape, x.dtype) for x in xs])
            identity = _cached_placer(key, _make_identity, first_too=False)
            placed = jax.device_put(xs) if identity is None else identity(*xs)
    del xs  # the private copies now belong to the placed arrays (the pools count references)
    for i, p in zip(host, placed):
        leaves[i] = p
    return tree_util.tree_unflatten(treedef, leaves)


class _End:
    pass


class _Failure:
    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


_END = _End()


# The running workers and their stop events, and those placing a batch (inside jax) now. At
# exit, and at ``close()``, each is stopped, and those placing are waited for: a daemon thread
# still inside jax's runtime when the interpreter finalizes aborts the process ("terminate
# called after throwing an instance of ..."), which a loop left with ``break`` met on 3 of 6
# exits (a review). One blocked in its source's ``next`` is not waited for (a loader blocked on
# a socket would stall every exit): once stopped, it places nothing more (``_PLACING_LOCK``).
_WORKERS: dict[threading.Thread, threading.Event] = {}
_PLACING: set[threading.Thread] = set()
_PLACING_LOCK = threading.Lock()
_JOIN_AT_EXIT_S = 10.0
_JOIN_AT_CLOSE_S = 5.0


def _stop_and_wait(workers: dict[threading.Thread, threading.Event], seconds: float) -> None:
    """Stop ``workers``, and wait (up to ``seconds`` in all) for those placing a batch."""
    with _PLACING_LOCK:
        for stop in workers.values():
            stop.set()
        placing = [t for t in workers if t in _PLACING and t is not threading.current_thread()]
    deadline = time.monotonic() + seconds
    for thread in placing:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))


def _stop_workers_at_exit() -> None:
    _stop_and_wait(dict(_WORKERS), _JOIN_AT_EXIT_S)


atexit.register(_stop_workers_at_exit)


def _placed(batch, stop: threading.Event, sharding, process_local: bool):
    """``place_batch(batch, ...)``, or None when the worker was stopped first."""
    me = threading.current_thread()
    with _PLACING_LOCK:
        if stop.is_set():
            return None
        _PLACING.add(me)
    try:
        return place_batch(batch, sharding, process_local)
    finally:
        _PLACING.discard(me)


def _prefetch_worker(
    source: Iterator, q: queue.Queue, stop: threading.Event, sharding, process_local: bool
) -> None:
    """Pull, place, enqueue; never holds a reference to the consumer's iterator object, so the
    consumer can be garbage-collected (which stops this thread)."""

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    try:
        while not stop.is_set():
            try:
                batch = next(source)
            except StopIteration:
                put(_END)
                return
            placed = _placed(batch, stop, sharding, process_local)
            if placed is None or not put(placed):
                return
    except BaseException as e:  # noqa: BLE001 - surfaces in the consumer, with its traceback
        put(_Failure(e))
    finally:
        close = getattr(source, "close", None)
        if stop.is_set() and callable(close):
            try:
                close()
            except Exception:  # noqa: BLE001 - the consumer is gone; nothing to report to
                pass
        _WORKERS.pop(threading.current_thread(), None)


class Prefetch(Iterator):
    """The iterator ``prefetch`` returns. Iterate it; ``close()`` (or leaving a ``with`` block,
    or dropping it) stops the background thread."""

    def __init__(self, source: Iterator, size: int, sharding, process_local: bool = False):
        self._queue: queue.Queue = queue.Queue(maxsize=size)
        self._stop = threading.Event()
        self._done = False
        self.thread = threading.Thread(
            target=_prefetch_worker,
            args=(source, self._queue, self._stop, sharding, process_local),
            name="autoopt-prefetch",
            daemon=True,
        )
        _WORKERS[self.thread] = self._stop
        self.thread.start()

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._done = True
            self.close()
            raise item.error
        return item

    @staticmethod
    def cache_sizes() -> dict[str, int]:
        """What every prefetch keeps compiled and pooled, shared by all of them (the module's
        ``cache_sizes``): ``unpackers`` (jitted placers, one a batch layout, least recently used
        dropped beyond ``unpackers_max``), ``layouts`` (layouts remembered as seen), ``pools``
        (host buffer pools, at most ``pools_max``) and ``pooled_bytes``."""
        return cache_sizes()

    def close(self) -> None:
        """Stop the background thread, and wait for it if it is placing a batch (up to 5 s;
        one blocked in its source's ``next`` places nothing more); pending placed batches are
        dropped."""
        self._done = True
        self._stop.set()
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass
        _stop_and_wait({self.thread: self._stop}, _JOIN_AT_CLOSE_S)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()


def prefetch(
    iterable: Iterable, size: int = 2, sharding=None, *, process_local: bool = False
) -> Prefetch:
    """Iterate ``iterable`` with its batches placed on the device ``size`` batches ahead.

    A background thread pulls each batch (any pytree), places its NumPy leaves in one batched
    placement (on the default device, or split over ``sharding``, a ``jax.sharding.Sharding`` or
    ``jax.Device``, e.g. ``NamedSharding(mesh, P("data"))`` to split the batch dimension across a
    mesh), and queues it, while the consumer's previous step runs. Order is preserved; an
    exception raised by the source iterator (or by placement) is raised in the consumer at the
    batch where it happened; the thread ends when the source is exhausted, when the consumer calls
    ``close()`` or leaves a ``with`` block, or when the iterator is garbage-collected (a ``break``
    out of a ``for`` loop over it). jax arrays and Python scalars in a batch pass through as they
    are. A NumPy leaf of fewer dimensions than ``sharding``'s partition spec names (a scalar
    beside ``P("data")``) is split over the dimensions it has and replicated over the rest.

    As flax's ``jax_utils.prefetch_to_device`` and the JAX training cookbook's input pipeline, in
    a thread: the source's own Python work (decoding, augmentation) also overlaps the step.
    Transfer guards apply as usual; note that device-to-host guards do not fire on XLA:CPU.

    In a ``jax.distributed`` job, ``process_local=True`` makes each NumPy leaf this process's
    part of a global array split over ``sharding`` (``jax.make_array_from_process_local_data``:
    each process loads its own shard of the batch). Without it, a leaf is the whole global
    value, identical on every process, as ``jax.device_put`` takes it.
    """
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(
            f"prefetch(size={size!r}): size is how many batches to place ahead; "
            "pass an int >= 1 (2 double-buffers)."
        )
    if sharding is not None and not isinstance(sharding, jax.sharding.Sharding | jax.Device):
        raise TypeError(
            f"prefetch(sharding={sharding!r}): pass a jax.sharding.Sharding (e.g. "
            "NamedSharding(mesh, P('data'))), a jax.Device, or None."
        )
    if process_local and not isinstance(sharding, jax.sharding.Sharding):
        raise TypeError(
            "prefetch(process_local=True) needs the global arrays' sharding: pass "
            "sharding=NamedSharding(mesh, P('data')) over the job's global mesh."
        )
    return Prefetch(iter(iterable), size, sharding, process_local)
