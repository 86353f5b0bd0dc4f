"""The placer: host inputs and transfer accounting (``autoopt.prefetch``: ``_prefetch``).

Host-to-device traffic is what autoopt exists to cut; this module removes what it can from the
call path and counts what is left. It decides, a call at a time, what happens to each argument
leaf; the mechanisms it uses live in their own modules:

* **Host inputs.** A call that passes NumPy leaves makes ``jax.jit`` transfer each one. Many
  small leaves of a dtype are packed into one host buffer: always under ``placement="pack"``,
  under ``placement="auto"`` only where the first calls measured it faster (``_packing``: the
  costs, the pools and the tuning). A call structure seen before takes a fast path: the last
  full scan's decision, checked with a few list comparisons (types of every leaf; shapes, dtypes
  and writeable flags of the host arrays) instead of a Python loop a leaf.
* **Host constants.** Only ``autoopt.constant`` (the caller's promise) is placed once and reused
  (``_host_constants``); it reaches the placer as its device copy. A read-only NumPy argument is
  transferred on every call like any other: its flag proves nothing (see ``_host_constants``).
  The shared device copy is never donated: under an explicit ``donate_argnums`` the placer
  passes a fresh copy in its place (``_unshared``).
* **Large closed-over constants** (1 MiB and up) are passed to the program as device arguments,
  placed once, instead of being embedded into the HLO (``_hoist``): the placer places them and
  calls again with them under a hidden keyword.
* **Scalars.** Python scalars are left to ``jax.jit`` (it transfers them in C++, cheaply); with
  ``canonicalize_scalars=True`` each scalar argument keeps the type of its first call when the
  value converts exactly and jax gives both one abstract value (``np.float64(2)`` after
  ``np.float32(2)`` without x64); ``2.0``, ``2``, ``True`` and ``np.float32(2)`` keep their own
  types, since each gives jax.jit's result another dtype.
* **Transfer guard.** ``transfer_guard="disallow"|"log"`` runs the jitted call under
  ``jax.transfer_guard_host_to_device`` after autoopt's own (explicit) placement, so only what
  autoopt left behind (Python scalars, or everything under ``placement="off"``) raises or logs,
  with the argument names and the caller's line. Device-to-host guards do not fire on XLA:CPU (the
  host already holds the buffer), so only host-to-device transfers are guarded.

The call path stays lean: a function whose calls have shown no host arrays is checked on its first
calls and then one call in 32 (an increment and a mask test otherwise); once host arrays are seen,
every call is scanned (a flatten and a type test a leaf, far cheaper than the transfer it saves).
What the placer counted (``TransferStats``) and saw becomes report findings in
``_placement_findings``.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax import tree_util

from autoopt import _compat, _multiprocess, _trace
from autoopt._errors import AutooptWarning, FitCheck, HostTransferError
from autoopt.passes.placement._hoist import (
    HOISTED,
    HoistConstants,
    Hoisted,
    HoistedConst,
    large_consts,
    retrying,
)
from autoopt.passes.placement._host_arrays import NDARRAY_TYPES, SCALAR_TYPES, is_aligned
from autoopt.passes.placement._host_constants import (
    CONSTANTS,
    SHARED_DEVICE_IDS,
    sweep_constants,
)
from autoopt.passes.placement._packing import PACKED, Layout, Packed, time_trial

log = logging.getLogger("autoopt")

__all__ = ["Placer", "TransferStats", "HostTransferError", "placer_for"]

# First calls always scanned; afterwards one call in (_SAMPLE_MASK + 1) until host arrays show up.
_WATCH_FIRST = 8
_SAMPLE_MASK = 31
# Once active, this many scanned calls in a row without host arrays return to the lean path.
_IDLE_CALLS = 64
# On XLA:CPU an aligned, contiguous array at least this large is left to jit's zero-copy path.
ZERO_COPY_MIN_BYTES = 256 * 1024
# A dtype group is packed when it has this many leaves or bytes; a single small leaf costs less
# through jit's own C++ path than an aligned allocation and a copy.
PACK_MIN_LEAVES = 2
_PACK_MIN_BYTES = 64 * 1024
# placement="auto" packs (after timing both ways, _packing.Layout.strategy) only a dtype group of
# at least this many leaves: with fewer, packing saves a few microseconds at most and still costs
# a second compile.
_AUTO_PACK_MIN_LEAVES = 4
# Off XLA:CPU, one large array is one DMA either way; packing it only adds a host copy.
# (Unmeasured on GPU/TPU in this repository: a conservative bound.)
_PACK_MAX_BYTES_ACCELERATOR = 1 << 20

# autoopt/ (this file is autoopt/passes/placement/_placer.py)
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_EXAMPLES_DIR = os.path.join(_PKG_DIR, "examples")


def _user_location() -> str | None:
    """``"file:line"`` of the innermost frame outside autoopt (the user's call), or None."""
    f = sys._getframe(1)
    # The bundled examples live inside the package when installed, but are user code.
    while (
        f is not None
        and f.f_code.co_filename.startswith(_PKG_DIR)
        and not f.f_code.co_filename.startswith(_EXAMPLES_DIR)
    ):
        f = f.f_back
    return None if f is None else f"{f.f_code.co_filename}:{f.f_lineno}"


# --- accounting -----------------------------------------------------------------------------------


@dataclasses.dataclass
class CallTransfers:
    """Host-to-device transfers of one scanned call.

    ``before``: host leaves the caller passed (what plain ``jax.jit`` transfers implicitly).
    ``implicit``: host values jit still transfers implicitly after autoopt's placement (packed
    buffers count here unless a transfer guard made them explicit). ``explicit``: transfers autoopt
    made itself with ``device_put``.
    """

    before: int = 0
    implicit: int = 0
    explicit: int = 0
    packed_leaves: int = 0
    packed_bytes: int = 0
    implicit_names: tuple[str, ...] = ()


@dataclasses.dataclass
class TransferStats:
    """Totals over the calls the placer scanned (every call once host arrays were seen).

    ``total`` sums their ``CallTransfers`` (``implicit_names`` stays empty there).
    ``unshared``: shared ``autoopt.constant`` copies replaced by a fresh copy because an explicit
    ``donate_argnums`` would have donated them.
    """

    calls_scanned: int = 0
    total: CallTransfers = dataclasses.field(default_factory=CallTransfers)
    last: CallTransfers | None = None
    first_host_site: str | None = None
    unshared: int = 0

    def add(self, call: CallTransfers) -> None:
        """Count one scanned call into ``total`` and keep it as ``last``."""
        t = self.total
        t.before += call.before
        t.implicit += call.implicit
        t.explicit += call.explicit
        t.packed_leaves += call.packed_leaves
        t.packed_bytes += call.packed_bytes
        self.last = call


# --- the fast path's memory of a call structure ---------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Feed:
    """What a full scan decided for one argument structure: the type of every leaf, which leaves
    were host arrays (and their shapes and dtypes), all to check the next call against; which are
    packed into which buffer."""

    arrays: tuple
    types: list
    shapes: list
    dtypes: list
    layout: Any
    pack: tuple
    group_leaves: tuple
    call_jit: CallTransfers
    call_pack: CallTransfers
    # How to rebuild each positional argument (None: the full tree, see _rebuild)
    args_jit: tuple | None = None
    args_pack: tuple | None = None


class _Miss:
    """``_plan_fast``'s answer when the call does not match the feed (take the full scan)."""


_MISS = _Miss()
_KEEP = object()  # an argument passed as the caller passed it


def _rebuild(arg_plan, args: tuple, kwargs: dict, leaves: list, treedef, statics, nargs: int):
    """The arguments to call jit with, ``leaves`` holding the placed leaves (None for packed ones).

    With an ``arg_plan`` (one entry a positional argument: ``_KEEP``, None for an argument whose
    leaves are all packed, or ``(treedef, start, end)`` to rebuild it), only the arguments that
    changed are rebuilt, and an argument packed whole is passed as None: jit then flattens and
    checks one leaf where it would check a container of many Nones, and the
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


# --- the placer -----------------------------------------------------------------------------------


class Placer:
    """Per-``OptimizedFunction`` placement of host inputs, run just before the jitted call.

    ``placer(jitted, args, kwargs)`` returns ``jitted(*args, **kwargs)`` with host arrays packed
    where that pays, large closed-over constants passed as device arguments, the shared copies of
    ``autoopt.constant`` s replaced by fresh ones where an explicit ``donate_argnums`` donates
    them, scalars canonicalized when asked, and the call guarded when asked. Any failure inside
    placement falls back to the unmodified call (one warning).
    """

    def __init__(self, fn, options, platform: Callable[[], str]):
        self._fn = fn
        self._static_argnums = options.static_argnums
        self._static_argnames = options.static_argnames
        self._has_statics = bool(self._static_argnums or self._static_argnames)
        on = options.placement in ("auto", "pack")
        # Packing many host leaves into one buffer: on every call under placement="pack"; under
        # "auto" only for a layout whose first calls measured it faster than jit's own per-leaf
        # transfer (Layout.strategy). On XLA:CPU it wins on many small leaves whose unpacking
        # slices fuse into their consumers (a feed-bound step) and loses where each slice
        # becomes its own kernel (leaves concatenated into a matmul). See benchmarks/RESULTS.md
        # and benchmarks/pack_threshold.py.
        # jit refuses keyword arguments when in_shardings is given, and in_shardings names the
        # user's leaves: packing would break both.
        self._pack = on and options.jit_kwargs.get("in_shardings") is None
        self._tune = options.placement == "auto"
        # (positions, names) an explicit donate_argnums/argnames donates (None: every argument
        # may be), or False without explicit donation.
        self._donated = explicit_donations(fn, options)
        guard = options.transfer_guard
        self._guard = guard if guard in ("log", "disallow") else None
        self._canon = options.canonicalize_scalars
        self._device = options.jit_kwargs.get("device")
        self._platform = platform  # asked on the first call that places (it starts the backend)
        self._cpu_known: bool | None = None
        self._always = bool(self._guard or self._canon)  # every call takes the full scan
        self._stay = self._always  # every call takes _call_placed (never the lean path)
        self._active = self._always
        self._calls = 0
        self._idle = 0  # scanned calls in a row with no host array, while active
        self._layouts: dict[tuple, tuple] = {}
        # Large closed-over constants passed as device arguments (see _hoist.with_hoisted_consts):
        # id(host const) -> HoistedConst (it holds the host const: the id stays its own); the node
        # every call passes, or None.
        # (not under in_shardings, which makes jit refuse the keyword they travel under)
        self._hoist_on = self._pack
        # Both only where the backend has one device (``_settle``), asked on first use.
        self._settled = False
        self._backend = options.jit_kwargs.get("backend")
        self._hoist_consts: dict[int, HoistedConst] = {}
        self._hoisted: Hoisted | None = None
        # treedef -> _Feed: what the last full scan of that argument structure decided
        self._feeds: dict[Any, _Feed] = {}
        self._scalar_types: dict[tuple, Any] = {}
        self._logged_sites: set[str | None] = set()
        self._warned = False
        self.stats = TransferStats()

    # The lean path: one attribute test, an increment and a mask test when nothing was seen.
    def _on_cpu(self) -> bool:
        if self._cpu_known is None:
            self._cpu_known = self._platform() == "cpu"
        return self._cpu_known

    def __call__(self, jitted, args: tuple, kwargs: dict):
        if self._donated is not False and SHARED_DEVICE_IDS:
            args, kwargs = self._unshared(args, kwargs)
        if not self._active:
            n = self._calls = self._calls + 1
            if n > _WATCH_FIRST and n & _SAMPLE_MASK:
                return jitted(*args, **kwargs)
        return self._call_placed(jitted, args, kwargs)

    def _settle(self) -> None:
        """Packing host leaves and hoisting large constants only where the backend has a single
        device. A packed buffer or a hoisted constant reaches jit as an uncommitted argument,
        whose sharding (and its slices') XLA chooses from the sharded arguments and constraints
        around it where jax.jit's leaves and embedded constants have their own: outputs came
        back sharded otherwise than under jax.jit, and a matmul split otherwise summed to other
        bits (a review's reproducers, tests/test_multidevice.py). Asked on first use (it
        starts the backend)."""
        if self._settled:
            return
        try:
            several = jax.device_count(self._backend) > 1
        except Exception:  # noqa: BLE001 - an unknown backend: as if several
            several = True
        if several:
            self._pack = self._hoist_on = False
        self._settled = True

    def _call_placed(self, jitted, args: tuple, kwargs: dict):
        if not self._settled:
            self._settle()
        t0 = time.perf_counter()
        plan = trial = None
        try:
            plan = self._plan(args, kwargs)
        except Exception as e:  # noqa: BLE001 - placement is an optimization; never break the call
            self._fall_back(e)
        if plan is not None:
            new_args, new_kwargs, trial = plan
            # Both None: a timed call with the arguments as they are.
            if new_args is not None and new_kwargs is not None:
                args, kwargs = new_args, new_kwargs
        check = None
        try:
            out = self._invoke(jitted, args, kwargs)
        except FitCheck as e:
            check = e
        if check is not None:
            # a signature's first call under remat="fit": the same placed arguments, through
            # the stand-in that checks the executable against the device's memory (so a
            # tuning trial is not spent on a call that did not run). Called outside the
            # handler: an error of the call names no FitCheck as its context.
            check.__traceback__ = None
            out = self._invoke(check.standin(jitted), args, kwargs)
        if trial is not None:
            time_trial(trial, out, t0)
        return out

    def _invoke(self, jitted, args: tuple, kwargs: dict):
        if self._hoist_on:
            return self._call_hoisting(jitted, args, kwargs)
        if self._guard is None:
            return jitted(*args, **kwargs)
        return self._call_guarded(jitted, args, kwargs)

    def _unshared(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``args, kwargs`` with every shared ``autoopt.constant`` device copy in an argument the
        explicit donation donates replaced by a fresh copy: donating the shared copy would delete
        it under every other holder of the constant."""
        donated = self._donated
        nums, names = donated if isinstance(donated, tuple) else (None, None)
        n = len(args)
        out_args = list(args)
        for i, a in enumerate(args):
            if nums is None or i in nums or i - n in nums:
                out_args[i] = self._fresh_copies(a)
        out_kwargs = kwargs
        for k, v in kwargs.items():
            if names is None or k in names:
                w = self._fresh_copies(v)
                if w is not v:
                    out_kwargs = dict(out_kwargs) if out_kwargs is kwargs else out_kwargs
                    out_kwargs[k] = w
        return tuple(out_args), out_kwargs

    def _fresh_copies(self, tree):
        leaves, treedef = tree_util.tree_flatten(tree)
        shared = [i for i, x in enumerate(leaves) if id(x) in SHARED_DEVICE_IDS]
        if not shared:
            return tree
        for i in shared:
            leaves[i] = jax.numpy.array(leaves[i], copy=True)
        self.stats.unshared += len(shared)
        return tree_util.tree_unflatten(treedef, leaves)

    def _call_hoisting(self, jitted, args: tuple, kwargs: dict):
        """Call with the hoisted constants passed; when the trace finds new large constants
        (``HoistConstants``), place them once and call again (the trace is cut short before
        anything is lowered or compiled)."""
        for attempt in range(4):
            call_kwargs = kwargs
            if self._hoisted is not None:
                call_kwargs = dict(kwargs)
                call_kwargs[HOISTED] = self._hoisted
            try:
                with retrying():
                    if self._guard is None:
                        out = jitted(*args, **call_kwargs)
                    else:
                        out = self._call_guarded(jitted, args, call_kwargs)
                if attempt:  # the aborted trace left the signature on jax's slow dispatch
                    _compat.reset_dispatch_cache(jitted)
                return out
            except HoistConstants as e:
                self._hoist(e.consts)
        return jitted(*args, **kwargs)  # (never reached in practice) embed, as plain jit

    def trace_only(self, jitted, args: tuple, kwargs: dict) -> None:
        """``jitted.trace(...)`` for the program alone (the caller reads it from its cache).
        A trace that stops at large constants to hoist (``HoistConstants``) is left uncached by
        jax, so the real call traces again, through ``_call_hoisting``, and passes them."""
        self._settle()
        if not self._hoist_on:
            jitted.trace(*args, **kwargs)
            return
        try:
            with retrying():
                jitted.trace(*args, **kwargs)
        except HoistConstants as e:
            self._hoist(e.consts)

    def figures(self) -> PlacementFigures:
        """What ``OptimizedFunction.inspect`` reports about this placer."""
        return PlacementFigures(
            stats=self.stats,
            active=self._active,
            hoisted=self._hoisted,
            packed_layouts=tuple(
                hit[0] for hit in list(self._layouts.values()) if hit[0] is not None
            ),
        )

    def hoists(self, program) -> bool:
        """Whether calls of ``program`` must go through the placer: it has large constants the
        placer passes as device arguments (the jit signature includes them)."""
        self._settle()
        return self._hoist_on and program is not None and bool(large_consts(program.final))

    def _hoist(self, consts: list) -> None:
        for c in consts:
            if id(c) not in self._hoist_consts:
                self._hoist_consts[id(c)] = HoistedConst.place(c, self._device)
        entries = tuple(self._hoist_consts.values())
        self._hoisted = Hoisted(entries, tuple(e.device for e in entries))
        # Every call must now pass them (the same jit signature): stay off the lean path.
        self._stay = self._active = True

    def forget_hoisted(self) -> None:
        """Drop the placed copies of large constants (``clear_cache``, ``jax.clear_caches()``):
        each holds jax's conversion of a closed-over NumPy constant, and while that lives jax
        reuses it when it traces again, so a refilled constant would keep its old bytes. The
        next trace stops at its large constants again and places what it reads then."""
        self._hoist_consts = {}
        self._hoisted = None

    def _fall_back(self, error: BaseException) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"autoopt placement skipped for {getattr(self._fn, '__name__', 'fn')}: "
                f"{type(error).__name__}: {error}. The call runs as plain jax.jit would.",
                AutooptWarning,
                stacklevel=5,
            )

    # --- planning one call ------------------------------------------------------------------------

    def _plan(self, args: tuple, kwargs: dict):
        """``(args, kwargs, trial)`` to call jit with (``trial``: a tuning call to time, or None;
        args and kwargs None for the originals), or None to call with the originals."""
        if self._has_statics:
            dyn, statics = _trace.split_args(
                args, kwargs, self._static_argnums, self._static_argnames
            )
        else:
            dyn, statics = (args, kwargs), ()
        leaves, treedef = tree_util.tree_flatten(dyn)
        # (by the positional arguments' count too: with static positions, `f(d)` and
        # `f(d, True)` share the dynamic tree, and a layout unpacks to its own count)
        feed = self._feeds.get((treedef, len(args)))
        # One call in 64 takes the full scan anyway: it sweeps the constant cache and sees a
        # leaf that became a NumPy array where the feed had none.
        if feed is not None and (self.stats.calls_scanned + 1) & 63:
            plan = self._plan_fast(feed, args, kwargs, leaves, treedef, statics, len(args))
            if not isinstance(plan, _Miss):
                return plan
        return self._plan_full(args, kwargs, dyn, statics, leaves, treedef, len(args))

    def _plan_fast(self, feed: _Feed, args, kwargs, leaves: list, treedef, statics, nargs: int):
        """The last full scan's decision, when this call's host arrays match it: a few list
        comparisons (C loops) instead of the scan's Python loop a leaf."""
        if [type(x) for x in leaves] != feed.types:  # every leaf: a new NumPy leaf is seen
            return _MISS
        xs = [leaves[i] for i in feed.arrays]
        if [x.shape for x in xs] != feed.shapes or [x.dtype for x in xs] != feed.dtypes:
            return _MISS
        layout = feed.layout
        trial = None
        strategy = "jit"
        if layout is not None:
            strategy, pos = layout.strategy()
            if pos != -1:
                trial = (layout, strategy, pos)
        self.stats.calls_scanned += 1
        packing = layout if strategy == "pack" else None  # the layout this call packs into
        if packing is not None:
            self.stats.add(feed.call_pack)
            bufs = []
            for g, idxs in enumerate(feed.group_leaves):
                buf = packing.pools[g].get()
                np.concatenate([leaves[i] for i in idxs], axis=None, out=buf)
                bufs.append(buf)
                del buf  # the pool's free test counts references
            for i in feed.pack:
                leaves[i] = None
        else:
            self.stats.add(feed.call_jit)
            if trial is None and not self._stay:
                self._active = False  # nothing to place here: back to the lean path
                self._calls = _WATCH_FIRST
                return None
            if trial is not None:  # (the tuning's first call may be one the lean path sampled)
                self._active, self._idle = True, 0
            return None if trial is None else (None, None, trial)
        new_args, new_kwargs = _rebuild(
            feed.args_pack if strategy == "pack" else feed.args_jit,
            args,
            kwargs,
            leaves,
            treedef,
            statics,
            nargs,
        )
        if packing is not None:
            new_kwargs = dict(new_kwargs)
            new_kwargs[PACKED] = Packed(packing, bufs)
        return new_args, new_kwargs, trial

    def _plan_full(self, args, kwargs, dyn, statics, leaves: list, treedef, nargs: int):
        """Scan every leaf: pack or leave host arrays, canonicalize scalars, count; remember the
        decision for ``_plan_fast``."""
        arrays: list[int] = []
        scalars: list[int] = []
        ndarray_types, scalar_types = NDARRAY_TYPES, SCALAR_TYPES
        for i, x in enumerate(leaves):
            t = type(x)
            if t in ndarray_types:
                arrays.append(i)
            elif t in scalar_types:
                scalars.append(i)
        stats = self.stats
        stats.calls_scanned += 1
        if stats.calls_scanned % 64 == 0 and CONSTANTS:
            sweep_constants()
        call = CallTransfers(before=len(arrays) + len(scalars))
        changed = False
        if scalars and self._canon:
            changed = self._canonicalize(leaves, treedef, scalars)
        implicit = list(scalars)
        layout = packing = None
        trial = None
        strategy = "jit"
        bufs: list = []
        pack: list[int] = []
        xs = [leaves[i] for i in arrays]
        types = [type(x) for x in leaves]  # before packing replaces leaves
        if not arrays and self._active and not self._stay:
            self._idle += 1
            if self._idle >= _IDLE_CALLS:  # host arrays stopped coming: back to the lean path
                self._active, self._idle, self._calls = False, 0, _WATCH_FIRST
        if arrays:
            if stats.first_host_site is None:
                stats.first_host_site = _user_location()
            pack_on = self._pack
            zero_copy_min = ZERO_COPY_MIN_BYTES if self._on_cpu() and not self._guard else None
            for i in arrays:
                x = leaves[i]
                # XLA:CPU aliases a large aligned contiguous array for free: leave it to jit.
                if pack_on and (
                    zero_copy_min is None or x.nbytes < zero_copy_min or not is_aligned(x)
                ):
                    if self._on_cpu() or self._guard or x.nbytes <= _PACK_MAX_BYTES_ACCELERATOR:
                        pack.append(i)
                        continue
                implicit.append(i)
            if pack:
                layout, pack, left = self._layout_for(leaves, treedef, pack, nargs)
                implicit.extend(left)
            if layout is not None:
                strategy, pos = layout.strategy()
                if pos != -1:
                    trial = (layout, strategy, pos)
                if strategy != "pack":
                    implicit.extend(pack)
            packing = layout if strategy == "pack" else None  # the layout this call packs into
            if packing is not None:
                for g, (_dtype, _total, members) in enumerate(packing.groups):
                    buf = packing.buffer(g)
                    np.concatenate([leaves[m[0]] for m in members], axis=None, out=buf)
                    bufs.append(buf)
                    del buf  # the pool's free test counts references
                for i in pack:
                    leaves[i] = None
                call.packed_leaves = packing.leaves_packed
                call.packed_bytes = packing.bytes_packed
                changed = True
            if trial is not None or strategy == "pack":
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
        self.stats.add(call)
        if arrays and not self._always:
            feed = self._remember(
                args, treedef, types, arrays, xs, layout, pack, call, len(scalars)
            )
        else:
            feed = None
        if not changed:
            return None if trial is None else (None, None, trial)
        # The same call structure as _plan_fast builds (one jit signature, one compile).
        arg_plan = (
            None if feed is None else (feed.args_pack if strategy == "pack" else feed.args_jit)
        )
        new_args, new_kwargs = _rebuild(arg_plan, args, kwargs, leaves, treedef, statics, nargs)
        if packing is not None:
            new_kwargs = dict(new_kwargs)
            new_kwargs[PACKED] = Packed(packing, bufs)
        return tuple(new_args), new_kwargs, trial

    def _remember(self, args, treedef, types, arrays, xs, layout, pack, call, n_scalars) -> _Feed:
        """Store this scan's decision for the next calls with the same structure (_plan_fast)."""
        if len(self._feeds) >= 64:  # a function called with ever new structures: start over
            self._feeds.clear()
        n_arrays = len(arrays)
        jit_call = CallTransfers(before=call.before, implicit=n_scalars + n_arrays)
        pack_call = jit_call
        group_leaves: tuple = ()
        if layout is not None:
            group_leaves = tuple(tuple(m[0] for m in members) for _d, _t, members in layout.groups)
            pack_call = CallTransfers(
                before=call.before,
                packed_leaves=layout.leaves_packed,
                packed_bytes=layout.bytes_packed,
                implicit=n_scalars + n_arrays - len(pack) + len(layout.groups),
            )
        args_jit = args_pack = None
        if not self._has_statics:
            n = len(types)
            args_jit = _arg_plan(args, set(), set(), n)
            args_pack = _arg_plan(args, set(pack), set(pack), n)
        feed = self._feeds[(treedef, len(args))] = _Feed(
            arrays=tuple(arrays),
            types=types,
            shapes=[x.shape for x in xs],
            dtypes=[x.dtype for x in xs],
            layout=layout,
            pack=tuple(pack),
            group_leaves=group_leaves,
            call_jit=jit_call,
            call_pack=pack_call,
            args_jit=args_jit,
            args_pack=args_pack,
        )
        return feed

    def _layout_for(self, leaves: list, treedef, pack: list[int], nargs: int):
        """``(layout or None, packed leaf indices, leaf indices left to jit)``."""
        xs = [leaves[i] for i in pack]
        key = (
            treedef,
            nargs,
            tuple(pack),
            tuple([x.shape for x in xs]),
            tuple([x.dtype for x in xs]),
        )
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
            elif not self._guard and len(idxs) < PACK_MIN_LEAVES and nbytes < _PACK_MIN_BYTES:
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
            layout = Layout(
                treedef,
                len(leaves),
                kept,
                tuple(groups),
                self._static_argnums,
                self._static_argnames,
                nargs,
                # Timed calls differ between the processes of a jax.distributed job, and
                # packing changes the executable: there, "auto" leaves host leaves to jit.
                mode=("jit" if _multiprocess.several() else "tune") if tune else "pack",
            )
        hit = (layout, packed, left)
        self._layouts[key] = hit
        return hit

    def _canonicalize(self, leaves: list, treedef, scalars: list[int]) -> bool:
        """Give each scalar leaf the type of its first call when the value converts exactly and
        jax gives both types one abstract value (``np.float64`` and ``np.float32`` without x64):
        a merge of another dtype or weak type would change the result's dtype (``f(x, 2.0)``
        then ``f(x, 3)`` is float32 then int32 under jax.jit)."""
        changed = False
        for i in scalars:
            x = leaves[i]
            t = type(x)
            first = self._scalar_types.setdefault((treedef, i), t)
            if first is t:
                continue
            try:
                y = first(x)
                if jax.typeof(y) != jax.typeof(x):
                    continue
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

    # --- the guard --------------------------------------------------------------------------------

    def _call_guarded(self, jitted, args: tuple, kwargs: dict):
        call = self.stats.last
        site = _user_location()
        if (
            self._guard == "log"
            and call is not None
            and call.implicit
            and site not in self._logged_sites
        ):
            self._logged_sites.add(site)
            log.warning(
                "autoopt: %d implicit host-to-device transfer(s) in the call at %s: %s",
                call.implicit,
                site,
                ", ".join(call.implicit_names) or "?",
            )
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
                    f"JAX said: {e}"
                ) from e


@dataclasses.dataclass(frozen=True)
class PlacementFigures:
    """The placer as ``OptimizedFunction.inspect`` shows it. ``stats``: the live transfer
    counts; ``active``: calls take the full scan (not the lean path); ``hoisted``: the large
    constants every call passes as device arguments, or None; ``packed_layouts``: the argument
    layouts whose host leaves are packed (or tuned for packing under placement="auto")."""

    stats: TransferStats
    active: bool
    hoisted: Any
    packed_layouts: tuple


def explicit_donations(fn, options):
    """``(positions, names)`` an explicit ``donate_argnums``/``donate_argnames`` donates, each
    completed from the other through ``fn``'s signature as ``jax.jit`` does; None when the
    signature cannot be read (any argument may be donated); False without explicit donation."""
    if not options.explicit_donation:
        return False
    given_nums = options.jit_kwargs.get("donate_argnums")
    given_names = options.jit_kwargs.get("donate_argnames")
    nums: set[int] = {given_nums} if isinstance(given_nums, int) else set(given_nums or ())
    names: set[str] = {given_names} if isinstance(given_names, str) else set(given_names or ())
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for i, p in enumerate(params):
        if p.kind in positional:
            if i in nums:
                names.add(p.name)
            if p.name in names:
                nums.add(i)
        elif p.kind is inspect.Parameter.VAR_POSITIONAL:
            return None  # positions past *args are not in the signature
    return frozenset(nums), frozenset(names)


def placer_for(fn, options, platform: Callable[[], str]) -> Placer | None:
    """The placer an ``OptimizedFunction`` of ``fn`` needs, or None when no option asks for one
    (an explicit donation always needs one: it must never donate a shared constant copy)."""
    o = options
    if (
        o.placement == "off"
        and not o.canonicalize_scalars
        and o.transfer_guard in (None, "allow")
        and not o.explicit_donation
    ):
        return None
    return Placer(fn, o, platform)
