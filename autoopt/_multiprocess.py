"""Decisions every process of a ``jax.distributed`` job takes alike.

Under JAX's multi-controller runtime every process traces, compiles and runs the same program;
executables that differ between processes mismatch their collectives and hang. Three of
autoopt's decisions come from measurements a process takes on its own, which can differ
between processes (load, timing noise, a fault): the remat plan (compiled memory), the donated
set of a signature's executable (the first call site's proof), and the host-leaf packing of
``placement="auto"`` (timed calls). Here:

- a measured decision is taken on process 0 and read by the others through JAX's distributed
  key-value store (``shared``): the others take no measurement at all;
- packing is never tuned by timing when there are several processes (``several``; the
  placer then leaves host leaves to jit, as ``placement="pack"`` or ``"off"`` decide by rule);
- before its passes, every process checks that every other traced the same signature of the
  function (``check_signature``: a process-dependent argument structure gets an error naming
  the argument instead of a hang), and after them, that every other built the same program
  (``check_program``).

What stays per process: each process proves its own call site before donating (a process
whose call must not donate an argument of the shared executable passes a device copy, so the
executable is the same), and its own caches. Keys are ordered by a per-process counter, which
matches across processes because every process makes the same calls in the same order (the
SPMD contract jax.jit relies on too). A process that waits longer than ``timeout_s()`` raises
``ProcessMismatchError`` saying which process and key it waited for.

With one process (no ``jax.distributed.initialize()``), nothing here does anything.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
from jax.core import Tracer

from autoopt import _compat
from autoopt._errors import ProcessMismatchError

__all__ = ["ProcessMismatchError", "check_program", "check_signature", "several", "shared"]

T = TypeVar("T")

_PREFIX = "autoopt/v1"
_DEFAULT_TIMEOUT_S = 600.0
_TIMEOUT_ENV = "AUTOOPT_PROCESS_TIMEOUT_S"

_counters: dict[str, int] = {}
_lock = threading.Lock()


def several() -> bool:
    """Whether this process is one of several in a ``jax.distributed`` job and the program
    being built or called is not this process's alone (``local``). Initializes no backend
    (reads the distributed runtime's state only)."""
    return _compat.distributed_processes()[1] > 1 and not getattr(_LOCAL, "on", False)


def in_job() -> bool:
    """Whether this process is one of several in a ``jax.distributed`` job."""
    return _compat.distributed_processes()[1] > 1


# A program whose arguments, closed-over arrays and shardings are all this process's own (a
# metric on process 0's arrays, an uneven evaluation split, a warm-up call on one process) runs
# as jax.jit runs it there: on this process alone, with no other process calling. Its decisions
# are taken here, exchanged with nobody: waiting for the others' signature would wait for a
# call that never comes (a hang until ``timeout_s()``). So is a report's build (``explain``,
# ``inspect`` on one process), which nothing runs.
_LOCAL = threading.local()


@contextlib.contextmanager
def local(on: bool = True):
    """While inside (and ``on``), ``several()`` is False on this thread: decisions are this
    process's own. Nests."""
    outer = getattr(_LOCAL, "on", False)
    _LOCAL.on = outer or on
    try:
        yield
    finally:
        _LOCAL.on = outer


@contextlib.contextmanager
def call_arguments(args: tuple, kwargs: dict):
    """While inside, ``arguments_local()`` says whether this call's arguments are all this
    process's own (``process_local``): a program it builds may then be local (``local``)."""
    outer = getattr(_LOCAL, "arguments", False)
    _LOCAL.arguments = process_local((args, kwargs))
    try:
        yield
    finally:
        _LOCAL.arguments = outer


def arguments_local() -> bool:
    """(Inside ``call_arguments``.) Whether the call's arguments are all this process's own."""
    return getattr(_LOCAL, "arguments", False)


def process_local(tree: Any) -> bool:
    """Whether every jax array in ``tree`` is on one device of this process (NumPy and Python
    values are this process's). A traced value (a call inside another transformation) is not
    known to be: False. One device, not any of this process's: jax's trace cache keys a
    signature by its abstract values, whose mesh is only axis names and sizes, so a program
    traced for a mesh of this process's devices would be reused for a global mesh of the same
    shape, its decisions taken by this process alone; a single device's has no mesh, which no
    global array's (a NamedSharding's) equals."""
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, Tracer):
            return False
        if isinstance(leaf, jax.Array):
            try:
                if not leaf.is_fully_addressable or len(leaf.sharding.device_set) != 1:
                    return False
            except Exception:  # noqa: BLE001 - unknown: not this process's alone
                return False
    return True


def program_is_local(closed: Any) -> bool:
    """Whether a traced program (arguments aside) uses only this process's devices: its
    closed-over arrays, and every sharding or mesh its equations name (a sharding constraint,
    a shard_map's mesh, a nested jit's shardings)."""
    from autoopt import _jaxpr

    me = jax.process_index()

    def own(value: Any) -> bool:
        try:
            if isinstance(value, jax.sharding.Sharding):
                return bool(value.is_fully_addressable)
            if isinstance(value, jax.sharding.Mesh):
                # (a nested jit's ``ctx_mesh`` outside any mesh context: the empty mesh)
                return value.empty or all(d.process_index == me for d in value.devices.flat)
        except Exception:  # noqa: BLE001 - an unknown sharding or mesh: not known
            return False
        if isinstance(value, jax.sharding.AbstractMesh):
            return bool(value.empty)  # (else its devices are the context's: not known here)
        if isinstance(value, tuple | list):
            return all(own(v) for v in value)
        return True

    if not process_local(list(closed.consts)):
        return False
    for site in _jaxpr.iter_eqns(closed, into_opaque=True):
        if site.eqn.primitive.name in _GLOBAL_PRIMITIVES:
            return False
        if not all(own(v) for v in site.eqn.params.values()):
            return False
    return True


# Primitives that run over every process's devices whatever their arguments: a pmap spans the
# global devices (each process passes its local shards).
_GLOBAL_PRIMITIVES = frozenset({"xla_pmap"})


def timeout_s() -> float:
    """How long a process waits for another's decision or signature (``AUTOOPT_PROCESS_TIMEOUT_S``,
    default 600 s: process 0 may be compiling remat candidates of a big model meanwhile)."""
    raw = os.environ.get(_TIMEOUT_ENV)
    try:
        return float(raw) if raw else _DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None


def _next_key(kind: str, scope: str) -> str:
    base = f"{_PREFIX}/{kind}/{hashlib.sha1(scope.encode()).hexdigest()[:20]}"
    with _lock:
        n = _counters.get(base, 0)
        _counters[base] = n + 1
    return f"{base}/{n}"


def _get(client, key: str, who: int, what: str) -> str:
    try:
        return client.blocking_key_value_get(key, int(timeout_s() * 1000))
    except Exception as e:  # noqa: BLE001 - jax raises its runtime's own error types
        raise ProcessMismatchError(
            f"autoopt waited {timeout_s():g} s for process {who}'s {what} and got none "
            f"({type(e).__name__}: {str(e)[:200]}). Every process of a jax.distributed job must "
            "call an optimized function with the same argument structure, in the same order, as "
            f"jax.jit requires; if process {who} is only slower (compiling a big model), raise "
            f"{_TIMEOUT_ENV}."
        ) from e


def shared(
    kind: str,
    scope: str,
    decide: Callable[[], T],
    encode: Callable[[T], Any],
    decode: Callable[[Any], T],
) -> T:
    """``decide()`` on process 0, its ``encode``d value read by every other process and
    ``decode``d there (the others never call ``decide``). ``scope`` names what is decided (a
    program's fingerprint): two processes deciding in different scopes wait for keys the other
    never writes, and time out with ``ProcessMismatchError``. With one process, ``decide()``."""
    client, n, me = _compat.distributed_processes()
    if n <= 1:
        return decide()
    key = _next_key(kind, scope)
    if me == 0:
        try:
            value = decide()
        except BaseException as e:
            # the others fail alike (and fall back alike) instead of waiting for a decision
            client.key_value_set(key, json.dumps({"failed": f"{type(e).__name__}: {e}"}))
            raise
        client.key_value_set(key, json.dumps({"value": encode(value)}))
        return value
    got = json.loads(_get(client, key, 0, f"{kind} decision"))
    if "failed" in got:
        raise RuntimeError(f"process 0 failed to take the {kind} decision: {got['failed']}")
    return decode(got["value"])


def _exchange(kind: str, scope: str, mine: Any) -> list[Any]:
    """Every process's ``mine`` for this key, in process order (an all-gather over the store)."""
    client, n, me = _compat.distributed_processes()
    key = _next_key(kind, scope)
    client.key_value_set(f"{key}/{me}", json.dumps(mine))
    return [mine if p == me else json.loads(_get(client, f"{key}/{p}", p, kind)) for p in range(n)]


def check_signature(fn_id: str, leaf_names: Sequence[str], avals: Sequence[Any]) -> None:
    """Raise ``ProcessMismatchError`` on every process unless all traced ``fn_id`` at the same
    argument leaves (paths and abstract values), naming the first that differs."""
    if not several():
        return
    mine = [[str(n), str(a)] for n, a in zip(leaf_names, avals)]
    everyone = _exchange("signature", fn_id, mine)
    for p, theirs in enumerate(everyone):
        if theirs == mine:
            continue
        for i in range(max(len(mine), len(theirs))):
            a = mine[i] if i < len(mine) else ["(none)", "(none)"]
            b = theirs[i] if i < len(theirs) else ["(none)", "(none)"]
            if a != b:
                raise ProcessMismatchError(
                    f"{fn_id}: process {_compat.distributed_processes()[2]} was called with "
                    f"argument {a[0]} {a[1]} where process {p} has {b[0]} {b[1]}. Every process "
                    "of a jax.distributed job must pass the same argument structure (build "
                    "global arrays with jax.make_array_from_process_local_data, or "
                    "autoopt.prefetch(..., process_local=True))."
                )


def check_program(fn_id: str, text: str) -> str:
    """The program's fingerprint (``fn_id`` and a digest of ``text``, its printed jaxpr), once
    every process built the same; raises ``ProcessMismatchError`` on every process otherwise."""
    mine = hashlib.sha1(text.encode()).hexdigest()
    if not several():
        return f"{fn_id}:{mine}"
    everyone = _exchange("program", fn_id, mine)
    differ = [p for p, h in enumerate(everyone) if h != mine]
    if differ:
        raise ProcessMismatchError(
            f"{fn_id}: process {_compat.distributed_processes()[2]} built a different optimized "
            f"program than process(es) {differ}, which would mismatch their collectives. Either "
            "the processes traced different values (a static argument, a closed-over Python "
            "number or NumPy array that differs per process: jax.jit would run a different "
            "program on each, and give different numbers), or an autoopt decision differed per "
            "process, which is autoopt's bug: please report it."
        )
    return f"{fn_id}:{mine}"
