"""Packing host leaves into one pooled, aligned host buffer a dtype, and timing whether it pays.

A call that passes NumPy leaves makes ``jax.jit`` transfer each one, at a fixed cost a leaf
(less when the buffer is 64-byte aligned, which XLA:CPU aliases instead of copying): with many
small leaves the transfers cost more than the step itself. Packing the leaves of each dtype into
one pooled, aligned host buffer (``Pool``) costs one memcpy and one argument, and the program
slices the leaves back apart (``unpack``): free where XLA fuses a slice into its consumer, but a
slice feeding a concatenate, a dot or a reduction becomes its own kernel, which can cost more
than the transfer it saved (benchmarks/pack_threshold.py). So ``placement="auto"`` measures:
the first calls of each packable layout (4+ leaves of a dtype) alternate, in runs of 4
pipelined calls timed to completion, between packing and jit's own per-leaf transfer, and the
layout keeps packing only when it was clearly faster (10%) than jit (``Layout.strategy``);
``placement="pack"`` always packs. Alternatives that were slower than jit's own per-leaf
transfer: ``jax.device_put(list)``, per-leaf ``device_put``, ``jnp.from_dlpack`` per leaf, a
separate jitted unpack (each of its outputs costs a transfer).

The placer (``_placement``) decides which leaves to pack and builds the ``Layout``;
``autoopt.prefetch`` (``_prefetch``) reuses ``Pool`` for its batches.

NB: the analogue is ``torch.utils.data``'s pinned-memory collation (packing host batches into
one buffer).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

import jax
import numpy as np
from jax import tree_util
from jax.core import Tracer

from autoopt import _trace
from autoopt.passes.placement._host_arrays import aligned_empty

log = logging.getLogger("autoopt")

__all__ = ["PACKED", "unpack"]

# The keyword under which packed host buffers travel to the jitted wrapper (never a user's name).
PACKED = "_autoopt_packed"


class Pool:
    """Reusable ``_ALIGN``-aligned host buffers of one size, for packed host leaves.

    Why a pool: a fresh buffer a call page-faults in every page of it, in system time that
    grows with its size, because jax frees the previous one from its own thread. Why reference
    counts: XLA:CPU reads a NumPy argument after the call has returned (it aliases aligned
    buffers and copies unaligned ones asynchronously), and jax keeps a reference to the array
    (C++ dispatch) or to a view of it (first-call Python path) until it is done. A buffer is
    handed out again only when the pool's references are the only ones left, to it and to its
    allocation.
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
        pool up to ``_POOL_SIZE`` buffers and ``POOL_MAX_BYTES``)."""
        with self.lock:  # two threads never get the same free buffer
            for buf in self.bufs:
                # jax may hold the array itself (its C++ dispatch path) or a view of it, whose
                # base is the allocation (its first-call Python path): test both.
                if (
                    sys.getrefcount(buf) <= _POOL_FREE_REFS
                    and sys.getrefcount(buf.base) <= _POOL_FREE_BASE_REFS
                ):
                    return buf
            buf = aligned_empty(self.total, self.dtype)
            if (len(self.bufs) + 1) * buf.nbytes <= POOL_MAX_BYTES and len(self.bufs) < self.size:
                self.bufs.append(buf)
            return buf

    def __len__(self) -> int:
        return len(self.bufs)


def _calibrate_pool_refs() -> tuple[int, int]:
    """References to a free pooled buffer and to its allocation, as ``Pool.get`` sees them."""
    bufs = [aligned_empty(1, np.float32)]
    for buf in bufs:
        return sys.getrefcount(buf), sys.getrefcount(buf.base)
    raise AssertionError


_POOL_FREE_REFS, _POOL_FREE_BASE_REFS = _calibrate_pool_refs()
# Buffers a pool keeps: as many as steps a loop that never blocks keeps in flight (with fewer, a
# 64-leaf feed still page-faults on most calls), capped in bytes so a large batch keeps fewer.
_POOL_SIZE = 16
POOL_MAX_BYTES = 256 << 20

# placement="auto" times both ways of feeding a layout on its first calls (see Layout.strategy):
# runs of _TUNE_RUN calls, alternating jit and pack; one warm-up run each (it compiles), then
# _TUNE_SAMPLES timed runs each. Calls within a run are not waited for (the host work of one
# overlaps the device work of the previous, as in the user's loop); the run's outputs are waited
# for at its end, so a run's time a call is the loop's throughput, not one call's latency.
# Packing is kept only when its fastest run beats _TUNE_MARGIN times jit's fastest (ties go to
# plain jit). The minimum, not the median: on a shared machine the noise only ever adds time.
_TUNE_RUN = 4
_TUNE_SAMPLES = 3
_TUNE_MARGIN = 0.9
# A "pack" decision is timed again after this many packed calls, then after twice as many each
# time it holds: the loop's own timings confirm it (a program recompiled, another process taking
# the cores, batches that stopped fitting the cache can each turn it into a loss). A re-check
# costs 2 * (_TUNE_SAMPLES + 1) * _TUNE_RUN calls, half of them fed the other way. A "jit"
# decision is not re-timed: its calls are jax.jit's own (the placer goes lean).
_RETUNE_AFTER = 1024
# The first tuning compiles the program a second time (fed packed), which a loop only pays back
# over many calls: it starts once the layout's calls have run this many times as long as its
# first call took (that call's compile, most often), so the extra compile costs at most about
# a tenth of the loop's time so far, and a short loop runs as under jax.jit, compiling once.
# (A first call that compiled nothing counts as _FIRST_CALL_MIN_S.)
_TUNE_AFTER_FIRST_CALLS = 10.0
_FIRST_CALL_MIN_S = 0.05
FIRST_CALL = -2  # ``Layout.strategy``'s position of the call it times as the first


class Layout:
    """Where each packed leaf lives in the packed buffers. Interned per placer and compared by
    identity: it is the aux data of a pytree node, so jit's signature check hashes it per call.

    ``mode`` is "pack" (pack every call), "jit" (leave the leaves to jit) or "tune": under
    placement="auto" whether packing pays depends on the program (XLA fuses the unpacking slices
    into elementwise consumers, but a slice feeding a concatenate or a dot becomes its own
    kernel) and on the machine, so the first calls measure both (``strategy``).
    """

    __slots__ = (
        "treedef",
        "n",
        "kept",
        "groups",
        "static_argnums",
        "static_argnames",
        "nargs",
        "leaves_packed",
        "bytes_packed",
        "pools",
        "mode",
        "trials",
        "timings",
        "run",
        "run_t0",
        "run_ok",
        "packed_calls",
        "retune_after",
        "decisions",
        "born",
        "first_s",
    )

    def __init__(
        self, treedef, n, kept, groups, static_argnums, static_argnames, nargs, mode="pack"
    ):
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
        self.pools = tuple(Pool(g[0], g[1]) for g in groups)  # reusable host buffers a group
        self.mode = mode
        self.trials = 0  # trial calls handed out while tuning
        self.timings: dict[str, list[float]] = {"jit": [], "pack": []}
        self.run: list = []  # outputs of the timed run in progress (see time_trial)
        self.run_t0 = 0.0
        self.run_ok = False
        self.packed_calls = 0  # packed calls since the last "pack" decision
        self.retune_after = _RETUNE_AFTER
        self.decisions: list[str] = []  # every tuning's outcome, in order
        self.born = 0.0  # when its first call began
        self.first_s: float | None = None  # how long that call took

    def buffer(self, g: int) -> np.ndarray:
        """A host buffer for group ``g`` that no computation is reading (see ``Pool``)."""
        return self.pools[g].get()

    def strategy(self) -> tuple[str, int]:
        """``("pack" or "jit", position in the timed run or -1)`` for this call. While tuning,
        alternates runs (jit first: the plain program is usually compiled already)."""
        mode = self.mode
        if mode == "pack" and self.decisions:  # decided by tuning (not placement="pack")
            self.packed_calls += 1
            if self.packed_calls > self.retune_after:
                self.retune()
                mode = "tune"
        if mode != "tune":
            return mode, -1
        if not self.decisions and _TUNE_AFTER_FIRST_CALLS > 0:
            if self.first_s is None:
                return "jit", FIRST_CALL  # timed: ``first_call``
            if time.perf_counter() - self.born < _TUNE_AFTER_FIRST_CALLS * self.first_s:
                return "jit", -1
        n = self.trials
        self.trials = n + 1
        run, pos = divmod(n, _TUNE_RUN)
        if run >= 2 * (_TUNE_SAMPLES + 1) + 8:  # timings never came back (traced calls): stop
            self.mode = "jit"
            return "jit", -1
        return ("jit" if run % 2 == 0 else "pack"), pos

    def first_call(self, t0: float) -> None:
        """(After the layout's first call, begun at ``t0``.) How long it took: the tuning
        waits for ``_TUNE_AFTER_FIRST_CALLS`` of it."""
        self.born = t0
        self.first_s = max(time.perf_counter() - t0, _FIRST_CALL_MIN_S)

    def retune(self) -> None:
        """Time both ways again (a "pack" decision's re-check, ``_RETUNE_AFTER``)."""
        self.mode, self.trials, self.packed_calls = "tune", 0, 0
        self.timings = {"jit": [], "pack": []}
        self.retune_after *= 2

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
            self.decisions.append(self.mode)
            log.debug(
                "autoopt: %s: packed %.1f us, per-leaf jit %.1f us a call: %s",
                self,
                p * 1e6,
                j * 1e6,
                self.mode,
            )

    def __repr__(self) -> str:
        return f"<packed layout: {self.leaves_packed} leaves in {len(self.groups)} buffers>"


def time_trial(trial, out, t0: float) -> None:
    """Keep a tuning call's outputs; at the end of its run, wait for all of them and record the
    run's wall time a call on the layout. A run with a call under a transformation (traced
    outputs) is not recorded."""
    layout, strategy, pos = trial
    if pos == FIRST_CALL:
        layout.first_call(t0)
        return
    leaves = tree_util.tree_leaves(out)
    if pos == 0:
        layout.run, layout.run_t0, layout.run_ok = [], t0, True
    if any(isinstance(x, Tracer) for x in leaves):
        layout.run_ok = False
    else:
        layout.run.append(leaves)
    if pos == _TUNE_RUN - 1:
        run, layout.run = layout.run, []
        if layout.run_ok and len(run) == _TUNE_RUN:
            jax.block_until_ready(run)
            layout.record(strategy, (time.perf_counter() - layout.run_t0) / _TUNE_RUN)


class Packed:
    """Pytree node carrying the packed buffers (children) and their layout (static aux data)."""

    __slots__ = ("layout", "bufs")

    def __init__(self, layout: Layout, bufs):
        self.layout = layout
        self.bufs = tuple(bufs)


tree_util.register_pytree_node(
    Packed, lambda p: (p.bufs, p.layout), lambda layout, bufs: Packed(layout, bufs)
)


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
                full[idx] = buf[off : off + size].reshape(shape).copy()
            else:
                full[idx] = jax.lax.slice(buf, (off,), (off + size,)).reshape(shape)
    return _trace.merge_args(tree_util.tree_unflatten(layout.treedef, full), statics, layout.nargs)
