"""``optimize``, ``explain`` and ``OptimizedFunction``: construction, tracing, and executing the
plan ``_dispatch`` chooses for each call.

A call: ``__call__`` finds the caller's site (under ``"safe"``), takes the plan cached for a
repeating call (the site's plan for this signature, or the plain plan of flat arguments), else
asks ``dispatch`` for a ``CallPlan`` (which jit object, what it donates, whether the placer runs,
whether to verify, or the function for the call's static leaves); then the plan runs. A decorated
method is the same call with the instance in front (``_BoundOptimized``). Where the C call path
is built (``_native.c``, CPython 3.11), it is ``__call__`` and runs a repeating call's plan for
a flat or nested signature with the same checks, calling ``_call`` (the Python path) for
everything else. ``trace``, ``lower``,
``explain`` and ``inspect`` share one preparation (``_prepare``: the static-leaf split) and one
program lookup (``_program_for_call``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax import tree_util

from autoopt import _compat, _jaxpr, _multiprocess, _trace
from autoopt._errors import AutooptWarning, FitCheck, PassError, ProcessMismatchError
from autoopt._finding import Finding
from autoopt._jit import _fit, _mutations, _plans, _reuse, _static_leaves
from autoopt._jit._dispatch import Caches, CallPlan, Policy, make_dispatch, with_copies
from autoopt._jit._inspect import Inspection, site_calls
from autoopt._jit._plans import MISS, flat_key, lookup_nested, lookup_static
from autoopt._jit._program import (
    Program,
    Site,
    call_signature,
    detach_host_consts,
    trace_signature,
    value_guards_of,
)
from autoopt._jit._static_leaves import PLAIN_TYPES, STATIC_LEAF_PLANS, run_static_leaf_plan
from autoopt._options import Options
from autoopt._reporting import REPORTING, report_tracing
from autoopt.passes import (
    PassContext,
    PipelineResult,
    make_options,
    option_names,
    run_pipeline,
    value_specialized,
)
from autoopt.passes.donation import callsite, host_callbacks

log = logging.getLogger("autoopt")

__all__ = ["optimize", "explain", "OptimizedFunction", "forget_wrappers"]


def fn_location_of(fn: Callable) -> str | None:
    try:
        code = fn.__code__
        return f"{code.co_filename}:{code.co_firstlineno}"
    except AttributeError:
        return None


# The attribute of a jax.jit object holding its ``nested_call`` (a table keyed weakly on the
# jit object could not hold it: the call refers to its jit object, which would never be freed).
_NESTED_CALL = "__autoopt_nested_call__"


def nested_call(jitted: Callable) -> Callable:
    """A plain function calling ``jitted`` (a jax.jit object), for ``optimize`` to trace as
    ``jax.jit`` traces ``jax.jit(jitted)``: the call is a nested jit in the program, whose own
    options act as they do there (its donation does nothing, its shardings constrain, a
    legacy mesh resolves its PartitionSpecs). One per jit object, held by it, so that
    ``optimize`` finds the programs of the first (``_reuse``)."""
    own = getattr(jitted, "__dict__", None)
    found = own.get(_NESTED_CALL) if own is not None else None
    if found is not None and getattr(found, "__wrapped__", None) is jitted:
        return found

    @functools.wraps(jitted)
    def call(*args, **kwargs):
        return jitted(*args, **kwargs)

    if own is not None:
        with contextlib.suppress(TypeError, AttributeError):
            own[_NESTED_CALL] = call
    return call


def _unwrap_jit(fn: Callable) -> tuple[Callable, list[dict[str, Any]]]:
    """``(function, the keywords of each jax.jit wrapping it, outermost first)``. An
    OptimizedFunction is unwrapped too; its options are not kept (the ones given now apply).
    A ``pjit``-made function is not: its PartitionSpecs need the mesh context of its call,
    which a jax.jit rebuilt from its options would not read (``nested_call``)."""
    jitted_with: list[dict[str, Any]] = []
    while isinstance(fn, jax.stages.Wrapped) or type(fn).__name__ in ("PjitFunction", "JitWrapped"):
        inner = getattr(fn, "__wrapped__", None)
        if inner is None:
            break
        if _compat.resolves_specs_in_mesh_context(fn):
            return nested_call(fn), jitted_with
        kw = _compat.jit_options(fn)
        if kw:
            jitted_with.append(kw)
        fn = inner
    if isinstance(fn, OptimizedFunction):
        fn = fn.__wrapped__
    return fn, jitted_with


# The jax.jit keywords given as (argnums, argnames) pairs, compared once completed from each other.
_ARGNUM_PAIRS = {
    "static_argnums": "static",
    "static_argnames": "static",
    "donate_argnums": "donate",
    "donate_argnames": "donate",
}


def _merge_jit_options(fn: Callable, options: dict[str, Any], jitted: dict[str, Any]) -> dict:
    """``optimize``'s keywords with those of the jax.jit it was given; the same option given both
    ways differently is an error that names both values."""

    def conflict(name: str, ours: Any, theirs: Any) -> ValueError:
        return ValueError(
            f"optimize({name}={ours!r}) conflicts with the jax.jit it wraps, which has "
            f"{name}={theirs!r}. Give it once: drop {name} from optimize(...) to keep the "
            f"jax.jit's, or from jax.jit(...) to use optimize's."
        )

    merged = dict(options)
    for kind in ("static", "donate"):
        nums, names = f"{kind}_argnums", f"{kind}_argnames"
        theirs = (jitted.get(nums), jitted.get(names))
        if theirs == (None, None):
            continue
        if options.get(nums) is None and options.get(names) is None:
            merged[nums], merged[names] = theirs
            continue
        ours = _compat.infer_argnums_and_argnames(fn, options.get(nums), options.get(names))
        if (set(ours[0]), set(ours[1])) != (set(theirs[0] or ()), set(theirs[1] or ())):
            name = nums if options.get(nums) is not None else names
            raise conflict(name, options[name], jitted.get(name, theirs))
    for name, value in jitted.items():
        if name in _ARGNUM_PAIRS:
            continue
        if name == "compiler_options" and options.get(name) is not None:
            ours = options[name]
            for k in set(ours) & set(value):
                if ours[k] != value[k]:
                    raise conflict(f"compiler_options[{k!r}]", ours[k], value[k])
            merged[name] = {**value, **ours}
        elif options.get(name) is None:
            merged[name] = value
        elif not _same_option(options[name], value):
            raise conflict(name, options[name], value)
    return merged


def _same_option(a: Any, b: Any) -> bool:
    if isinstance(a, list):
        a = tuple(a)  # jax.jit keeps in_shardings lists as tuples
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an uncomparable pair is a difference
        return False


def _with_inferred_argnums(fn: Callable, options: Options) -> Options:
    """Static argnums and argnames completed from each other by ``fn``'s signature, as jax.jit
    does before it reads anything else: ``static_argnames=("flag",)`` makes a positional
    ``flag`` static too, so ``in_shardings`` counts the remaining positions as jax.jit's do."""
    kw = options.jit_kwargs
    nums, names = kw.get("static_argnums"), kw.get("static_argnames")
    if nums is None and names is None:
        return options
    nums, names = _compat.infer_argnums_and_argnames(fn, nums, names)
    return dataclasses.replace(
        options, jit_kwargs={**kw, "static_argnums": nums, "static_argnames": names}
    )


def _check_callable(fn: Any) -> None:
    if not callable(fn):
        raise TypeError(
            f"optimize() needs a function, got {type(fn).__name__} ({fn!r:.60}). "
            "Use it as a decorator (@autoopt.optimize) or call autoopt.optimize(my_function)."
        )
    target = getattr(fn, "__func__", fn)
    if inspect.isgeneratorfunction(target) or inspect.isasyncgenfunction(target):
        raise TypeError(
            f"optimize() cannot compile the generator function {getattr(fn, '__name__', fn)!r}: "
            "a jitted function must return arrays. Optimize the per-step function it calls instead."
        )
    if inspect.iscoroutinefunction(target):
        raise TypeError(
            f"optimize() cannot compile the coroutine function {getattr(fn, '__name__', fn)!r}: "
            "make it a plain function returning arrays."
        )


def argnums_given(argnums: Any) -> bool:
    """Whether a ``donate_argnums``/``donate_argnames`` value names any argument (an int, a
    name, or a non-empty collection of them)."""
    if argnums is None or isinstance(argnums, int | str):
        return argnums is not None and argnums != ""
    try:
        return len(tuple(argnums)) > 0
    except TypeError:
        return True  # not a collection: jax.jit's own check says what is wrong


def _check_argnums(fn: Callable, options: Options) -> None:
    """donate_argnums/static_argnums must name parameters the function has (jax.jit's own
    message says what is wrong but not what to pass instead); explicit donation and another
    donate policy than the default are two answers to one question."""
    kw = options.jit_kwargs
    explicit = [k for k in ("donate_argnums", "donate_argnames") if argnums_given(kw.get(k))]
    if explicit and options.donate != "safe":
        raise ValueError(
            f"optimize(donate={options.donate!r}) conflicts with {explicit[0]}="
            f"{options.jit_kwargs[explicit[0]]!r} (given to optimize or to the jax.jit it "
            "wraps), which donate those arguments as jax.jit does. Give one: drop "
            f"{explicit[0]} to keep donate={options.donate!r}, or drop donate= to "
            "donate exactly those."
        )
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for kw in ("donate_argnums", "static_argnums"):
        value = options.jit_kwargs.get(kw)
        nums = (value,) if isinstance(value, int) else tuple(value or ())
        bad = [i for i in nums if not -len(names) <= i < len(names)]
        if bad:
            raise ValueError(
                f"{kw}={value!r}: {getattr(fn, '__name__', 'the function')} takes "
                f"{len(names)} positional argument(s) ({', '.join(names) or 'none'}), so there is "
                f"no argument {bad[0]}. Pass positions from 0 to {len(names) - 1}, or name the "
                f"arguments with {kw.replace('nums', 'names')}=."
            )


_JAX_DIR = os.path.dirname(os.path.abspath(jax.__file__)) + os.sep


def _process_independent_id(fn: Callable) -> str:
    """The function's name as every process of a jax.distributed job spells it: module,
    qualified name and first line, without the file's path (hosts may hold the code in other
    folders)."""
    fn = inspect.unwrap(fn) if callable(fn) else fn
    code = getattr(fn, "__code__", None)
    line = code.co_firstlineno if code is not None else 0
    name = getattr(fn, "__qualname__", type(fn).__name__)
    return f"{getattr(fn, '__module__', '?')}:{name}:{line}"


trace_state_clean = _compat.trace_state_clean


# The optimized function this thread's jit traced last. A call the C path runs has no Python
# frame of ours on the stack when jit compiles, so ``autoopt run``'s summary reads this to count
# the compile against the function (``patch._attribute_compile``, after matching the name).
TRACING = threading.local()

# jax.jit options placing a program's arguments or outputs (possibly on other processes).
_SHARDING_OPTIONS = ("in_shardings", "out_shardings", "device", "backend")

# Counts of ``_fresh`` wrappers (``OptimizedFunction._handles``), changed under this lock (a
# wrapper's ``__del__`` may run on any thread).
_HANDLES_LOCK = threading.RLock()


def _refuse_unchecked(program: Program, tls: threading.local) -> None:
    """A program that drops an update to an nnx object of its arguments, traced where no call
    can check the caller's objects (``OptimizedFunction._refuse_held_lost_update``): inside
    another transformation (an outer jit, grad, vmap: those are the outer function's objects,
    which it goes on using), or for ``lower()``/``trace()`` (the compiled executable runs
    without autoopt). Raised from the trace, before anything runs."""
    if getattr(tls, "aot", False) or not _compat.top_level_trace():
        raise TypeError(program.lost_updates[0].message)


def _type_function(cls: type, name: str, kind: type | None) -> Any:
    """The function behind ``obj.name`` for instances of ``cls``: a property's getter
    (``kind=property``) or a method of a type whose instances have no dict to shadow it
    (``kind=None``); None otherwise (the C path then reads the attribute)."""
    try:
        found = inspect.getattr_static(cls, name)
    except AttributeError:
        return None
    if kind is property:  # a data descriptor: it wins over an instance's dict
        return found.fget if type(found) is property else None
    if cls.__dictoffset__ or isinstance(found, types.FunctionType) or not callable(found):
        return None
    return found


def _value_getter(state: Any) -> Any:
    return _type_function(type(state), "value", property)


def _native_call_path() -> Any:
    """The C call path (``_native.c``) when it is built for this interpreter, not turned off
    with ``AUTOOPT_NATIVE=0``, and the reference counts it sees are those measured here: a
    lone argument's in its ``tp_call`` (its own baseline), and those the Python path sees
    through it (``_call`` and a plan it calls), which must be exactly what ``callsite`` measured
    through a Python ``__call__``. Else None: the Python path, everywhere."""
    if os.environ.get("AUTOOPT_NATIVE", "1") == "0":
        return None
    try:
        import autoopt._jit._native as _native  # pyright: ignore[reportMissingImports]
    except ImportError:  # not built (a source checkout, or compiling failed): the Python path
        return None
    if not _native.SUPPORTED:
        return None
    try:
        return _configured(_native)
    except Exception:  # noqa: BLE001 - a build from other sources than these (a stale .so)
        return None


def _configured(_native: Any) -> Any:
    """``_native`` configured for this process, or None where the reference counts it sees
    differ from ``callsite``'s calibration (``_native_call_path``)."""

    class RefProbe(_native.CallPath):
        pass

    class CallProbe(_native.CallPath):
        def _call(self, *args, **kwargs):
            return callsite._measure(args, kwargs)

    def lone(probe):
        x = object()
        return probe(x)

    refs = RefProbe()
    refs._native_configure(2, None, None, None, None)
    base = min(lone(refs) for _ in range(3))
    through_python = callsite._calibrate(CallProbe())
    if through_python != (callsite._BASE_POS, callsite._BASE_POS_KW, callsite._BASE_KW):
        return None
    states = (_compat._TRACE_STATE, _compat._AXIS_ENV, *_compat.DEBUG_NANS_STATES)
    _native.configure(
        _compat._TRACE_STATE,
        _compat._EVAL_TRACE,
        _compat._AXIS_ENV,
        _compat._TOP_AXIS_ENV,
        *_compat.DEBUG_NANS_STATES,
        _compat.ARRAY_IMPL,
        PLAIN_TYPES,
        callsite.other_code_may_run,
        FitCheck,
        _fit.first_call,
        _compat.filter_traceback,
        MISS,
        base,
        tuple(map(_value_getter, states)),
        _type_function(_compat.ARRAY_IMPL, "aval", property),
        _type_function(_compat.ARRAY_IMPL, "is_deleted", None),
    )
    # The nested signatures read in C are ``callsite``'s, and a part only its container holds
    # counts one reference in the C walk (``shared_walk``: 0 unshared, 1 shared).
    _native.configure_nested(*callsite.nested_tables())
    probe = ({"a": float("1.5"), "b": [None, ()]}, (), np.float32(2), 3)
    python_key = callsite.nested_signature(probe)
    if python_key is None or _native.nested_key(probe) != python_key[0]:
        return None
    held = float("2.5")
    if _native.shared_walk({"a": float("1.5")}) != 0 or _native.shared_walk([held]) != 1:
        return None
    # A plan the C path calls with a tuple of its own counts what it counts under ``_call``.
    plan_probe = CallProbe()
    plan_probe._native_configure(
        1, None, {(object,): lambda args: sys.getrefcount(args[0])}, None, None
    )
    if min(lone(plan_probe) for _ in range(3)) != callsite.CALL_REFS:
        return None
    _fit.NATIVE_CATCHING = _native.catching
    os.register_at_fork(after_in_child=_native.after_fork)
    return _native


_NATIVE = _native_call_path()
# Whether calls take the C call path (``_native.c``); else ``OptimizedFunction._call`` is
# ``__call__`` itself.
NATIVE = _NATIVE is not None


def _twin_finding(traced: _trace.TracedProgram, ctx: PassContext, program: Program) -> Finding:
    """What the report says of a ``Program.bounded`` twin (its writes, its bounds)."""
    assert program.bounded is not None
    checks, twin = program.bounded
    names = {a: n for n, a in zip(traced.in_leaf_names, traced.in_arg_of_leaf)}
    said = " and ".join(
        f"`{names.get(arg, f'argument {arg}')}` in [{lo}, {hi}]" for arg, lo, hi in checks
    )
    bare = sum(
        1 for site in _jaxpr.iter_eqns(twin) if site.eqn.primitive.name == "dynamic_update_slice"
    )
    return Finding(
        kind="bounded_twin",
        applied=True,
        message=(
            f"a second program, for calls passing Python ints {said} (checked on the host "
            f"at each call), writes with {bare} bare dynamic_update_slice what this one must "
            "guard (a row, block, window or tile whose start is not proven); other values, and jax "
            "arrays there, run this one. Compiled when first called: a loop whose values stay "
            "in the bounds compiles one program, as jax.jit does."
        ),
        location=ctx.fn_location,
        pass_name="scatter_to_dus",
        details={
            "bounds": {names.get(arg, str(arg)): (lo, hi) for arg, lo, hi in checks},
        },
    )


def _donated_sets(jits: dict) -> frozenset:
    """The (positions, names) sets the jit objects ``Caches.jits`` keys donate (its keys'
    third item: the checks of the ``Program.bounded`` twins the object runs, or ``()``)."""
    return frozenset(key[:2] for key in list(jits))


def call_holding_signals(body: Callable[[], Any], frame: Any = None, proof: Any = None) -> Any:
    """``body()`` for a call path written in Python (``_BoundOptimized``, equinox's, nnx's), as
    the C call path runs every call under "safe" (``_native.c``): a signal handler's exception
    raised between the executable and the end of ``body`` (nnx's updates of its Variables
    included) waits until the names the statement running in ``frame`` assigns are bound to
    the result (``proof.binding``, for a call whose check passed; else ``frame`` None)."""
    if _NATIVE is None:
        return body()
    return _NATIVE.held_call(body, frame, None if proof is None else proof.binding)


if TYPE_CHECKING:  # (the checker reads the Python path)
    _CallBase = object
else:
    _CallBase = _NATIVE.CallPath if _NATIVE is not None else object


class OptimizedFunction(_CallBase):
    """What ``optimize`` returns: call it like the ``jax.jit`` of the original function.

    ``_policy`` (frozen) is what ``optimize`` decided; ``_caches`` what calls learned. The plain
    jit object (nothing donated) and the placer are built once, here.
    """

    def __init__(
        self,
        fn: Callable,
        options: Options,
        policy: Policy | None = None,
        detached: tuple[Callable, weakref.ref] | None = None,
    ):
        self.__wrapped__ = fn
        functools.update_wrapper(self, fn, updated=())
        # The function the programs trace: ``fn``, which for the optimized function ``optimize``
        # shares between wrappers is, where one can be made, ``_reuse.detached``'s copy of the
        # caller's (``detached``: the copy and the caller's, weakly), so that nothing this
        # object holds refers to the caller's function, which only the wrappers (``_fresh``)
        # hold. Every use inside autoopt reads this; ``__wrapped__`` is the caller's.
        self._fn = fn
        self._detached = detached
        self._policy = policy = policy or Policy.build(options, fn_location_of(fn))
        self._caches = Caches(policy)
        self._wrapper = self._make_wrapper()
        # checks -> the wrapper of the jit objects running ``Program.bounded`` twins with them
        self._bounded_wrappers: dict[tuple, Callable] = {}
        from autoopt.passes.placement import placer_for

        # Host inputs (packing, cached constants), scalar canonicalization, transfer guard; None
        # when no option asks for any of them.
        self._placer = self._caches.placer = placer_for(fn, options, policy.platform)
        self._plain = self._jit_for((), ())
        self._plain_plan = CallPlan(
            self._plain, placer=self._placer, verify=policy.verify, direct=not policy.verify
        )
        self._plain_run = _plans.kept(self._plain, self._placer)  # the plain plan as a plan
        self._dispatch = make_dispatch(self)
        # What ``__call__`` reads before it looks up a plan, as attributes (each a constant of
        # the policy, or the same object as in ``_caches``): the call sites under "safe", the
        # plans under "auto" (else None), whether the plain plan runs the jit object as it is.
        self._sites = self._caches.sites if policy.donate == "safe" else None
        self._auto_fast = self._caches.auto_fast if policy.donate == "auto" else None
        self._flat_plain = not (policy.verify or policy.has_static)
        # A function with static arguments finds its plans by their values as well.
        self._static_args = (
            (policy.static_argnums, policy.static_argnames) if policy.has_static else None
        )
        self._shares: OptimizedFunction | None = None  # the one a ``_fresh`` wrapper shares
        self._handles = 0  # the live ``_fresh`` wrappers sharing this one (``_release``)
        self._cached = False  # ``optimize``'s cache holds this one while its function lives
        self._releasable = False  # built on a copy by ``_shared_for``: ``_release`` applies
        self._owner: Callable | None = None  # a ``_fresh`` wrapper's function (``_handle``)
        self._released = False
        self._configure_call_path()

    def _configure_call_path(self) -> None:
        """What the C call path reads (the same objects as the attributes above). Until a
        backend has started (``_compat.job_settled``), the C path runs no plain plan: a module
        decorating its steps before ``jax.distributed.initialize()`` may be one process of a
        job (``_planned`` configures it again)."""
        self._job_settled = _compat.job_settled()
        if NATIVE:
            self._native_configure(  # pyright: ignore[reportAttributeAccessIssue]
                # (mode 0: straight to ``_call``, for static arguments, whose plans the C path
                # cannot find: their keys hold the static values, ``_plans.static_key``)
                0 if self._static_args is not None else 1,
                self._sites,
                self._auto_fast,
                self._caches,
                # (in a jax.distributed job, calls that run the plain plan take the general
                # path, which tells a build whether the call's arguments are this process's)
                self._plain_run
                if self._flat_plain and self._job_settled and not _multiprocess.in_job()
                else None,
            )

    def _fresh(self, fn: Callable | None = None) -> OptimizedFunction:
        """A new wrapper object sharing this one's programs and call sites, as each
        ``jax.jit(f)`` is a new object sharing one cache: attributes a caller sets on it (a name,
        a flag) stay its own. It keeps the shared one alive (``_reuse``'s cache may hold it
        weakly), and ``fn`` (default: this one's ``__wrapped__``) as its ``__wrapped__``."""
        new = self._handle(fn)
        assert new is not None, "a live wrapper's programs are never released"
        return new

    def _handle(self, fn: Callable | None = None) -> OptimizedFunction | None:
        """``_fresh``, or None when the shared one's programs were released (``_release``): the
        caller builds anew."""
        with _HANDLES_LOCK:  # (``_release`` empties the shared one's ``__dict__``)
            mine = self.__dict__
            shared = mine.get("_shares") or self
            state = shared.__dict__
            if state.get("_released", True) or "_caches" not in state:
                return None
            if fn is None:
                fn = mine.get("_owner")
            if fn is None:
                detached = state["_detached"]
                fn = detached[1]() if detached is not None else state["__wrapped__"]
            if fn is None:
                return None
            shared._handles += 1
            mine = dict(mine)
        new = type(self).__new__(type(self))
        new.__dict__.update(mine)
        # what the caller's wrapper holds and the shared one does not (a plain function's
        # shared one refers to a copy of it only, ``_reuse``): kept apart from ``__wrapped__``,
        # which a caller may set
        new._owner = new.__wrapped__ = fn
        # A function's own attributes as they are now, as ``functools.wraps`` copies them
        # into each jax.jit object: its public ones (a private name could be one this class
        # sets later; ``_reuse``'s holder is one), never over this object's own. Not a callable
        # object's: its attributes are its state (a module's arrays and Variables), which a
        # copy here would hold, and which the call's proofs count as held elsewhere.
        if isinstance(new.__wrapped__, types.FunctionType):
            for name, value in new.__wrapped__.__dict__.items():
                if not name.startswith("_") and name not in new.__dict__:
                    new.__dict__[name] = value
        new._shares = shared
        new._configure_call_path()
        return new

    def __del__(self) -> None:
        # A ``_fresh`` wrapper's end: the shared one's programs go when nothing can call them
        # any more (``_release``). (The shared one itself is a reference cycle, through its jit
        # objects' wrappers: left alone, it and everything it holds, the function's closure and
        # the programs' constants, would wait for the garbage collector.)
        shared = self.__dict__.get("_shares")
        if shared is not None:
            shared._release_if_unreachable(handle_gone=True)

    def _release_if_unreachable(self, handle_gone: bool = False) -> None:
        """``_release`` this one if ``_unreachable`` (after one wrapper fewer: ``handle_gone``).
        Runs where a wrapper or a function is dropped, on any thread: never raises."""
        try:
            # (the function is looked up before the lock: dropping the last reference to it
            # runs weak-reference callbacks that take other locks)
            detached = self.__dict__.get("_detached")
            alive = detached is not None and detached[1]() is not None
            with _HANDLES_LOCK:
                if handle_gone:
                    self._handles -= 1
                gone = self._unreachable(alive)
            if gone:
                self._release()
        except Exception:  # noqa: BLE001 - at interpreter exit (module globals gone): nothing to free
            return

    def _unreachable(self, function_alive: bool) -> bool:
        """(Under ``_HANDLES_LOCK``.) Whether no wrapper is left and ``optimize`` can no longer
        find this one: one built on a copy (``_reuse.detached``) once its function is gone
        (the cache holds it while the function lives, as jax.jit's keeps its programs), or
        at once if it was not cached. Marks it released."""
        if self._released or self._handles > 0 or not self._releasable:
            return False  # (no copy: it refers to its function, freed by the collector)
        if self._cached and function_alive:
            return False
        self._released = True
        return True

    def _release(self) -> None:
        """Drop every program, jit object and plan of this one and of the functions it made
        (static leaves, the reporter), and everything it holds, so that they are freed when
        the last reference goes, not at the garbage collector's next run: nothing can call
        them any more. (jax's caches of the jit objects are keyed weakly on their wrappers,
        freed with them.) Takes no lock a caller's thread may hold: it runs when a wrapper or
        a function is dropped, anywhere."""
        caches = self.__dict__.get("_caches")
        if caches is None:
            return
        for sub in [*caches.static_leaf_fns.values(), caches.reporter]:
            if isinstance(sub, OptimizedFunction):
                sub._release()
        caches.drop_everything()
        if NATIVE:
            self._native_configure(0, None, None, None, None)  # pyright: ignore[reportAttributeAccessIssue]
        self.__dict__.clear()
        self._released = True

    def __copy__(self) -> OptimizedFunction:
        # As ``copy.copy`` of a jax.jit object: a new object sharing the caches (the C call
        # path's base type cannot be copied by ``copy``'s default protocol).
        return self._fresh()

    def __deepcopy__(self, memo: dict) -> OptimizedFunction:
        return self._fresh()

    # --- jit objects ---------------------------------------------------------------------------

    def _make_wrapper(
        self, eager_autodiff: bool = False, inlined: bool = False, bounded: tuple = ()
    ) -> Callable:
        """The function jax.jit traces: while jit traces it, it traces the user's function once
        per signature to a jaxpr, runs the passes, and evaluates the optimized jaxpr into jit's
        trace. So JAX's own C++ dispatch keeps the signature cache, and a cached call costs what
        jax.jit costs plus the dispatch. ``eager_autodiff``: the wrapper of the eager-autodiff
        jit, whose programs are planned for a caller that differentiates them eagerly.
        ``inlined``: the wrapper of calls inside another trace, which evaluates the original
        program (the signature's program is found or built as for any call, so the user's
        function is traced once per signature either way). ``bounded``: the checks a call of its jit
        objects made of its Python int arguments on the host; they evaluate the twin built with
        exactly those bounds (``Program.bounded``, ``_evaluate``)."""
        fn = self._fn

        def wrapper(*args, **kwargs):
            # (a first call's trace of the user's function: signal handlers run as under
            # jax.jit, so Ctrl-C interrupts it at once, see ``_native.suspend_deep``)
            suspended = _NATIVE is not None and _NATIVE.suspend_deep()
            try:
                return traced(*args, **kwargs)
            finally:
                if suspended:
                    _NATIVE.resume_deep(suspended)  # pyright: ignore[reportOptionalMemberAccess]

        def traced(*args, **kwargs):
            if "_caches" not in self.__dict__:
                raise RuntimeError(
                    "autoopt: this jit object belongs to an optimized function that was freed "
                    "with its function; call the function through autoopt.optimize again"
                )
            self._sync()
            # large constants the placer passes as device arguments (see _hoist)
            hoisted = kwargs.pop("_autoopt_hoisted", None) if kwargs else None
            if "_autoopt_packed" in kwargs:  # host leaves the placer packed: slice them back
                from autoopt.passes.placement import unpack

                args, kwargs = unpack(args, kwargs)
            if _compat.jit_disabled() or trace_state_clean():
                # jax.jit calls us eagerly under disable_jit, and again outside any trace to
                # find where a NaN came from (jax_debug_nans): run the original, as jit would.
                return fn(*args, **kwargs)
            if _jaxpr.opaque_input(tree_util.tree_leaves((args, kwargs))) is not None:
                return fn(*args, **kwargs)  # a hijax Variable or a jax.Ref: as plain jax.jit
            # whose compile follows (``patch``: no frame of ours); weakly, as the wrapper cache
            # holds functions: a thread-local must keep none alive
            TRACING.function = weakref.ref(self)
            program, leaves = self._program_for_trace(args, kwargs, eager_autodiff)
            if program.untouched is not None:  # a jax.Ref, a hijax type: as plain jax.jit
                return fn(*args, **kwargs)
            if inlined:
                outs = _jaxpr.stage_closed(program.traced.closed, *leaves)
            else:
                outs = self._evaluate(program, leaves, hoisted, bounded)
            return tree_util.tree_unflatten(program.traced.out_tree, outs)

        # jax.jit reads the signature (static_argnames, donate_argnames) through __wrapped__.
        functools.update_wrapper(wrapper, fn, updated=())
        return wrapper

    def _jit_for(self, positions: tuple, names: tuple, bounded: tuple = ()):
        """The jit object donating these arguments (one per donated set: donation varies per
        call, and each jit object traces the wrapper, which finds the program cached).
        ``bounded``: the checks of a ``Program.bounded`` twin: the one running the twin built
        with those bounds, which only a call whose arguments were checked against them may call
        (``_plans.bounded``, ``_dispatch.plan_for``)."""
        caches = self._caches
        key = (positions, names, bounded)
        j = caches.jits.get(key)
        if j is not None:
            return j
        with caches.lock:
            j = caches.jits.get(key)
            if j is not None:
                return j
            kw = dict(self._policy.jit_kwargs)
            if self._policy.donate != "explicit":
                kw["donate_argnums"] = positions
                kw["donate_argnames"] = names
            if bounded:
                wrapper = self._bounded_wrappers.get(bounded)
                if wrapper is None:
                    wrapper = self._bounded_wrappers[bounded] = self._make_wrapper(bounded=bounded)
            else:
                wrapper = self._wrapper
            j = jax.jit(wrapper, **kw)
            if _NATIVE is not None and self._policy.donate == "safe" and (positions or names):
                # From its call until the call site's names are bound to the result, signal
                # handlers wait (``_native.c``): one raising there would keep the statement
                # rebinding a donated name from running, leaving it bound to deleted arrays.
                j = _NATIVE.HoldsSignals(j)
            caches.jits[key] = j
        return j

    def _eager_ad_jit(self):
        """The jit object of a call differentiated eagerly (``jax.grad(f)(x)`` outside any jit):
        JAX runs the forward and the backward as two executables and keeps the forward's
        residuals alive in between, so remat plans for it are measured that way
        (``passes.remat``), in a program of its own: under an outer jit the two halves are one
        program again, where XLA:CPU merges checkpoints back (jax-ml/jax#19822). Nothing is
        donated (the arguments are traced)."""
        caches = self._caches
        j = caches.eager_ad_jit
        if j is None:
            with caches.lock:
                if caches.eager_ad_jit is None:
                    caches.eager_ad_jit = jax.jit(
                        self._make_wrapper(eager_autodiff=True), **self._policy.nested_kwargs
                    )
                j = caches.eager_ad_jit
        return j

    def _nested_jit(self, eager_forward: bool = False):
        """The jit object of a call inside another trace (see ``Policy.nested_kwargs``): it
        evaluates the original program, from the signature's one trace. ``eager_forward``: the
        one under an eager vmap or jvp, with the caller's compiler_options."""
        caches = self._caches
        name = "eager_forward_jit" if eager_forward else "nested"
        j = getattr(caches, name)
        if j is None:
            with caches.lock:
                j = getattr(caches, name)
                if j is None:
                    policy = self._policy
                    kw = policy.eager_forward_kwargs if eager_forward else policy.nested_kwargs
                    j = jax.jit(self._make_wrapper(inlined=True), **(kw or {}))
                    setattr(caches, name, j)
        return j

    # --- tracing and passes (runs inside jax.jit's trace) -------------------------------------

    def _program_for_trace(
        self, args: tuple, kwargs: dict, eager_autodiff: bool = False
    ) -> tuple[Program, list]:
        policy, caches = self._policy, self._caches
        key, leaves = trace_signature(args, kwargs, policy.static_argnums, policy.static_argnames)
        programs = caches.eager_ad_programs if eager_autodiff else caches.programs
        program = programs.get(key)
        if program is not None:
            if getattr(caches.tls, "trace_only", False):  # (read by _program_for_call)
                caches.tls.last_program = program
            if program.lost_updates:
                _refuse_unchecked(program, caches.tls)
            if program.fit in (None, "checking") and policy.fit and not eager_autodiff:
                self._check_fit(program)
            if not program.compiled and not getattr(caches.tls, "trace_only", False):
                program.compiled = True
            return program, leaves
        with caches.lock:
            lock = caches.key_locks.setdefault((key, eager_autodiff), threading.RLock())
        with lock:
            program = programs.get(key)
            if program is None:
                program = self._build(args, kwargs, eager_autodiff)
                program.key = key
                if not program.traced.captures_tracers:  # (else it belongs to that trace only)
                    if REPORTING.built_inside is None or caches.is_reporter:
                        programs[key] = program
                    else:  # built by a report's trace of another function: not kept
                        REPORTING.built_inside.append(self)
        if getattr(caches.tls, "trace_only", False):  # (read by _program_for_call)
            caches.tls.last_program = program
        if program.lost_updates:
            _refuse_unchecked(program, caches.tls)
        if program.fit in (None, "checking") and policy.fit and not eager_autodiff:
            self._check_fit(program)
        if not getattr(caches.tls, "trace_only", False):
            program.compiled = True
        return program, leaves

    def _check_fit(self, program: Program) -> None:
        """Under remat="fit", stop jit's trace of a top-level call of a signature not yet
        checked, before anything is compiled: the caller calls again through ``_fit``."""
        # A trace only for the program (``_program_for_call``) stops too, which catches it:
        # jax would keep that trace, and the call's own trace would never reach here.
        tls = self._caches.tls
        if getattr(tls, "aot", False) or getattr(tls, "fit_checking", None) is not None:
            # Ahead of time, or inside this thread's own check (``_fit.checked_call``): its
            # program, or another one of the same signature that a ``clear_cache()`` from
            # another thread made the check's compile trace anew (a FitCheck raised there would
            # reach the check's stand-in, not a catcher); that one runs as the check decides.
            return
        if program.traced.captures_tracers or program.untouched is not None:
            program.fit = "off"
            return
        if not _fit.needs_check(self, program):  # remat="auto" measured nothing to check
            program.fit = "off"
            return
        if _compat.top_level_trace() and _fit.caught_here():
            raise _fit.fit_check(self, program)

    def _sync(self) -> None:
        """Before a trace: the copy this object traces has the original's code and defaults
        (``_reuse.sync``)."""
        if self._detached is not None:
            _reuse.sync(*self._detached)

    def _build(self, args: tuple, kwargs: dict, eager_autodiff: bool = False) -> Program:
        policy, caches = self._policy, self._caches
        # The user's own errors (shape mismatches, non-array outputs) propagate unchanged, as
        # from jax.jit: they are not autoopt's to swallow.
        self._sync()
        fn = self._fn
        lost: list[_mutations.LostUpdate] = []
        if _mutations.holds_variables(args, kwargs, fn):  # an assignment to one must not be lost
            fn = _mutations.recording_lost_updates(fn, lost)
        traced = _trace.trace_program(
            fn, args, kwargs, policy.static_argnums, policy.static_argnames
        )
        if lost and policy.donate == "explicit":
            # the jit object donates what the user asked for on the first run, before a check
            # after it could refuse: refused here, before anything runs
            raise TypeError(lost[0].message)
        # In a jax.distributed job, a program of this process's own (its call's arguments, its
        # closed-over arrays and shardings: ``_multiprocess.local``), or a report's, is built
        # and decided here alone, as jax.jit runs it here alone.
        local = _multiprocess.in_job() and (
            caches.is_reporter
            or not _multiprocess.several()  # (inside another local program's build)
            or (
                _multiprocess.arguments_local()
                and not any(policy.options.jit_kwargs.get(k) for k in _SHARDING_OPTIONS)
                and _multiprocess.program_is_local(traced.closed)
            )
        )
        with _multiprocess.local(local):
            program = self._build_from(traced, eager_autodiff)
        program.local = local
        if lost:
            program.lost_updates = tuple(lost)
            caches.lost_updates = True
        if policy.donate == "safe" and not eager_autodiff:
            self._note_aliasing(program)
        if policy.options.explain and not caches.is_reporter:
            from autoopt.report import log_report

            # once per signature: _build runs once per signature. No call yet: no jit chosen.
            log_report(self._inspection(program, None, ((), ())))
        return program

    def _build_from(self, traced: _trace.TracedProgram, eager_autodiff: bool) -> Program:
        """The program of a traced signature: the passes run on it (``_build``)."""
        policy, caches, ad = self._policy, self._caches, eager_autodiff
        several = _multiprocess.several()
        if several:  # a jax.distributed job: every process must trace this signature alike
            fn_id = _process_independent_id(self._fn)
            _multiprocess.check_signature(fn_id, traced.in_leaf_names, traced.closed.in_avals)
        ctx = PassContext(
            options=policy.options,
            in_leaf_names=traced.in_leaf_names,
            in_arg_of_leaf=traced.in_arg_of_leaf,
            out_leaf_names=traced.out_leaf_names,
            backend=policy.platform(),
            fn_name=getattr(self.__wrapped__, "__name__", "fn"),
            fn_location=policy.fn_location,
            under_autodiff=eager_autodiff,
            # remat="auto" leaves measuring the original to the call's first-call check
            extra={
                "remat_defer": policy.remat_auto and not ad and _fit.call_checks_next(),
                # trace() builds a program that a later call lowers, reading closed-over NumPy
                # constants then (as jax.jit's does): no pass may rely on their values now
                "numpy_values": not getattr(caches.tls, "trace_api", False),
            },
        )
        if policy.remat_auto and not eager_autodiff:
            from autoopt.passes.remat import forward_plannable

            if forward_plannable(traced.closed):
                caches.any_plannable = True  # (never reset: one plannable program keeps it)
            caches.watch_autodiff = caches.any_plannable
        opaque = _jaxpr.opaque_type(traced.closed)
        if opaque is not None:
            program = Program(traced, None, None)
            program.untouched = opaque
            return program
        try:
            pipeline = run_pipeline(traced.closed, ctx)
        except PassError as e:
            self._fall_back(e, e.pass_name)
            program = Program(traced, None, str(e))
            program.fit = "off"  # plain jax.jit of the original: nothing to plan either
        else:
            program = Program(traced, pipeline, None)
            program.value_guards = value_guards_of(traced.closed, program.final)
            if not (several or eager_autodiff):
                program.bounded = self._bounded_program(traced, ctx, pipeline)
                if program.bounded is not None:
                    program.pipeline = dataclasses.replace(
                        pipeline,
                        findings=(*pipeline.findings, _twin_finding(traced, ctx, program)),
                    )
        program.ctx = ctx
        if several:  # and build the same program from it (_multiprocess)
            program.fingerprint = _multiprocess.check_program(fn_id, str(program.final))
        return program

    def _bounded_program(
        self, traced: _trace.TracedProgram, ctx: PassContext, pipeline: PipelineResult
    ) -> tuple[tuple[tuple[int, int, int], ...], Any] | None:
        """``Program.bounded``: ``(((argument position, lo, hi), ...), program)`` where Python
        int arguments in those bounds prove writes the program for any value blends or leaves
        a scatter (``passes.value_specialized``), for positional calls of a function without
        static arguments (the plans check them); else None. A failure here costs the second
        program only: the first is exact for every value."""
        policy = self._policy
        if policy.has_static or policy.verify or traced.captures_tracers:
            return None
        if any(isinstance(c, np.ndarray) for c in traced.closed.consts):
            # A closed-over NumPy array is read when each program is lowered, and the caller
            # may refill it in between: the signature's one set of bytes (jax.jit's, kept by
            # ``Program.frozen_host_consts`` and ``value_guards``) holds for one program only.
            return None
        try:
            found = value_specialized(traced.closed, ctx, pipeline)
        except PassError as e:
            log.debug("autoopt: no bounded program for %s: %s", ctx.fn_name, e)
            return None
        if found is None:
            return None
        bounds, special = found
        checks = []
        for leaf, lo, hi in bounds:
            arg = traced.in_arg_of_leaf[leaf]
            if not isinstance(arg, int) or traced.in_arg_of_leaf.count(arg) != 1:
                return None  # (a keyword, or a leaf of a container: never a Python int argument)
            checks.append((arg, lo, hi))
        return tuple(checks), special.jaxpr

    def _note_aliasing(self, program: Program) -> None:
        """Under "safe": whether calls that donate nothing must look up their signature's
        executable (``Caches.lookup_plain``). A program with something to donate built by a
        call's own trace (not ``_program_for_call``'s) was compiled by a call that decided
        nothing: its executable is the plain one."""
        caches = self._caches
        aliasable = program.donatable(*program.arguments())
        if aliasable[0] or aliasable[1]:
            if not caches.lookup_plain and not getattr(caches.tls, "trace_only", False):
                program.decide(((), ()))
            caches.any_aliasable = caches.lookup_plain = True
        elif not caches.any_aliasable:
            caches.lookup_plain = False

    def _guarded(self, program: Program):
        """``program.final``, or its original where a NumPy constant the passes read holds other
        bytes now (``Program.value_guards``): the original is exact for any bytes. Fixed by the
        program's first evaluation into a call's jit, as its frozen bytes are."""
        chosen = program.guarded_choice
        if chosen is not None:
            return chosen
        holds = all(
            c.dtype == seen.dtype and c.shape == seen.shape and c.tobytes() == seen.tobytes()
            for c, seen in program.value_guards
        )
        chosen = program.final if holds else program.traced.closed
        tls = self._caches.tls
        if not (getattr(tls, "trace_only", False) or getattr(tls, "aot", False)):
            if not REPORTING.active:
                program.guarded_choice = chosen
        return chosen

    def _evaluate(self, program: Program, leaves: list, hoisted=None, bounded: tuple = ()) -> list:
        final = self._guarded(program) if program.value_guards else program.final
        if bounded and final is program.final and program.bounded is not None:
            # A call checked its arguments against ``bounded``: the twin built for exactly
            # those bounds runs. Anything else (none, or one for other bounds: the program of
            # another trace context for the same site's plan, ``jax_enable_x64`` switched)
            # runs the program for any value, exact for these arguments too.
            if program.bounded[0] == bounded:
                final = program.bounded[1]
        # (outside the fallback: the placer's HoistConstants, raised while embedding, is its
        # signal to pass the large constants and call again, not a failure of the passes)
        embedded = self._embedded(program, final, hoisted)
        original = program.traced.closed
        if final is original:  # jax's own trace: its equations are copied as they are
            return _jaxpr.stage_closed(embedded, *leaves)
        try:
            # A rewritten program is bound again equation by equation, which recomputes each
            # result's type: a rewrite that left one stale fails here and falls back, where
            # copying its equations would hand the mistake to the compiler.
            return _jaxpr.eval_closed(embedded, *leaves)
        except Exception as e:  # noqa: BLE001
            self._fall_back(e, "evaluate")
            return _jaxpr.stage_closed(self._embedded(program, original, hoisted), *leaves)

    def _embedded(self, program: Program, closed, hoisted):
        """``closed`` (the program's final or original jaxpr) as this trace embeds it: large
        constants the placer passes as device arguments (``_hoist``), and NumPy constants with
        the bytes of the program's first lowering for a call (``Program.frozen_host_consts``;
        ``trace``, ``lower`` and a report's compile read them as they are and freeze nothing:
        jax.jit's call reads the bytes when it lowers)."""
        out, passed = closed, ()
        if self._placer is not None:
            from autoopt.passes.placement import large_consts, with_hoisted_consts

            out = with_hoisted_consts(closed, hoisted)
            passed = large_consts(closed)
        tls = self._caches.tls
        if getattr(tls, "trace_only", False) or getattr(tls, "aot", False) or REPORTING.active:
            return out  # (not a call: ``trace``/``lower`` or a report's compile)
        frozen = program.frozen_host_consts(closed, skip=passed)
        if not frozen:
            return out
        consts = list(out.consts)
        for i, snapshot in frozen.items():
            if consts[i] is closed.consts[i]:  # (not one the placer passes or bound)
                consts[i] = snapshot
        return out.replace(consts=consts)

    def _fall_back(self, error: BaseException, where: str) -> None:
        if self._policy.options.fallback == "raise" or isinstance(error, ProcessMismatchError):
            raise error  # (a process of a jax.distributed job falling back alone would hang it)
        if not self._caches.warned:
            self._caches.warned = True
            warnings.warn(
                f"autoopt fell back to plain jax.jit for "
                f"{getattr(self.__wrapped__, '__name__', 'fn')} ({where}): "
                f"{str(error).rstrip('.')}. Results are unaffected; pass fallback='raise' to "
                "debug.",
                AutooptWarning,
                stacklevel=4,
            )

    # --- the call path (see _dispatch) -----------------------------------------------------------

    def _call(self, *args, **kwargs):
        # One story for every call: find the call's plans (its call site's under "safe", the
        # function's under "auto"), look up the plan for the arguments' signature and run it.
        # Without a plan, or when its run-time check refuses, the general path plans the call
        # (``_dispatch``); calls inside another transformation always take it. ``__call__`` is
        # this method, or the C call path (``_native.c``), which runs the same checks for a
        # repeating call's flat signature and calls this method for everything else.
        site = None
        try:
            if trace_state_clean():
                sites, plans = self._sites, self._auto_fast
                if sites is not None:  # "safe"
                    try:
                        frame = sys._getframe(1)
                    except ValueError:  # no Python caller (a thread's entry point): no site
                        return self._planned(None, args, kwargs)
                    # The code object's identity: equal code objects in two modules compare equal.
                    site = sites.get((id(frame.f_code), frame.f_lasti))
                    if site is None:
                        site = self._prove(frame)
                    if site.donates and not site.proof.check(frame, self, args, kwargs):
                        # another callee, or a thread could read a name
                        site = site.refused_by_check()
                    del frame
                    if site.donates or self._caches.lookup_plain:
                        # (a site that donates nothing: the signature's executable may donate)
                        plans = site.plans
                if plans is not None:
                    if self._static_args is not None:
                        # (keyed by the static values too: ``_plans.static_key``)
                        plan = lookup_static(plans, args, kwargs, *self._static_args)
                        if plan is not None:
                            out = plan(args, kwargs)  # (``_plans.static_plan``)
                            if out is not MISS:
                                return out
                    elif plans and not kwargs:
                        plan = plans.get(flat_key(args))
                        if plan is None and STATIC_LEAF_PLANS in plans:
                            # (before the nested signature: with static leaves it reads
                            # the arguments' trees only to find none)
                            out = run_static_leaf_plan(plans[STATIC_LEAF_PLANS], args)
                            if out is not MISS:
                                return out
                        if plan is None:
                            plan = lookup_nested(plans, args)
                        if plan is not None:
                            out = plan(args)
                            if out is not MISS:
                                return out
                # Nothing to donate (a donating site without plans has static arguments or
                # verify=True, and so no ``_flat_plain``): flat arrays and scalars run the plain
                # plan (a static leaf would need the general path).
                elif self._flat_plain and not kwargs and not _multiprocess.in_job():
                    for a in args:
                        if type(a) not in PLAIN_TYPES:
                            # a name left bound to an argument would be one more reference to
                            # it, which the general path's reference counts would see
                            a = None
                            break
                    else:
                        if not self._job_settled:  # (the C path's plain plan: see _planned)
                            self._configure_call_path()
                        return self._plain_run(args)
            return self._planned(site, args, kwargs)
        except FitCheck as e:
            check = e  # escaped the general path's own catchers: the program fits as traced
        except Exception as e:
            # autoopt's frames and jax's left out of the traceback, as jax.jit leaves its own
            # (not a wrapper: the body reads its caller's frame)
            _compat.filter_traceback(e)
            _static_leaves.note_traced_module_fields(e, args, kwargs)
            raise
        check.__traceback__ = None  # (a cycle through this frame: see _fit.first_call)
        try:
            check.program.fit = "fits"
            return self._planned(site, args, kwargs)
        except Exception as e:
            _compat.filter_traceback(e)
            _static_leaves.note_traced_module_fields(e, args, kwargs)
            raise

    if not NATIVE:
        __call__ = _call

    def _planned(self, site: Site | None, args: tuple, kwargs: dict):
        """The general path: plan the call (``_dispatch``) and run the plan. In a jax.distributed
        job, a program it builds knows whether the call's arguments are this process's own
        (``_multiprocess.call_arguments``)."""
        if not self._job_settled:
            try:
                return self._planned_run(site, args, kwargs)
            finally:
                self._configure_call_path()  # (a backend may have started meanwhile)
        return self._planned_run(site, args, kwargs)

    def _planned_run(self, site: Site | None, args: tuple, kwargs: dict):
        if _multiprocess.in_job():
            with _multiprocess.call_arguments(args, kwargs):
                return self._run(self._dispatch(site, args, kwargs), args, kwargs)
        return self._run(self._dispatch(site, args, kwargs), args, kwargs)

    def _fit_escaped(self, check: FitCheck, site: Site | None, args: tuple):
        """``_call``'s handler of a ``FitCheck`` no catcher caught, for the C call path (which
        filters the traceback itself)."""
        check.__traceback__ = None  # (see _fit.first_call)
        check.program.fit = "fits"
        return self._planned(site, args, {})

    def _run(self, plan: CallPlan, args: tuple, kwargs: dict, bases: tuple | None = None):
        """Execute a plan (``__call__`` inlines the common case). ``args``: the tuple the call's
        ``*args`` built; ``bases``: its reference-count baselines, for a decorated method's."""
        checked = self._refuse_held_lost_update(plan, args, kwargs, bases)
        out = self._execute(plan, args, kwargs)
        if not checked:  # a signature's first call may learn of a dropped update from its trace
            self._refuse_held_lost_update(plan, args, kwargs, bases)
        return out

    def _refuse_held_lost_update(
        self, plan: CallPlan, args: tuple, kwargs: dict, bases: tuple | None
    ) -> bool:
        """Raise when the call's program assigns to an nnx object of the arguments that the
        caller can still reach (``_mutations.held_lost_update``): its update would be lost, as
        under jax.jit, and the caller would read the old value. Checked before the run once
        the function is known to drop updates (the program is found or traced first), else
        after it: a signature's first call learns of the assignment from its own trace, and
        then nothing was donated (such a program donates nothing; explicit donation raises
        from the trace). Calls inside a transformation and ahead-of-time lowering refuse in the
        trace (``_refuse_unchecked``); under ``jax.disable_jit()`` the function ran on the
        caller's objects, and nothing was lost. Returns whether the function is known to drop
        updates (so the check was made)."""
        split = plan.static
        sub = (plan.static_fn or plan.jit) if split is not None else self
        if not sub._caches.lost_updates:
            return False
        if _compat.jit_disabled() or not trace_state_clean():
            return True
        if split is not None:
            program = sub._program_for_call(split.args, split.kwargs, report_only=True)
        else:
            program = self._program_for_call(args, kwargs, report_only=True)
        if program is None or not program.lost_updates:
            return True
        caller = sys._getframe(1)
        while caller is not None and caller.f_globals.get("__name__", "").startswith("autoopt."):
            caller = caller.f_back
        try:
            update = _mutations.held_lost_update(
                program.lost_updates, args, kwargs, bases, caller, self
            )
        finally:
            del caller
        if update is not None:
            raise TypeError(update.message)
        return True

    def _execute(self, plan: CallPlan, args: tuple, kwargs: dict):
        split = plan.static
        if split is not None:
            sub = plan.static_fn
            if sub is None:  # the function for these leaves plans the call itself
                sub = plan.jit
                inner = sub._dispatch(None, split.args, split.kwargs)
            else:  # planned by the caller's site (``plan_static_leaves``)
                inner = plan._replace(static=None, static_fn=None)
            out = sub._execute(inner, split.args, split.kwargs)
            return _static_leaves.outputs_put_back(
                sub._fn,
                split,
                out,
                self._policy.static_argnums,
                self._policy.static_argnames,
            )
        if plan.verify:
            self._verify(args, kwargs)
        if plan.copies:
            args, kwargs = with_copies(args, kwargs, plan.copies)
        placer = plan.placer
        outer = _fit.calling(self, plan.jit)  # (a first trace knows what it donates)
        try:
            check = self._first_check(args, kwargs)
            if check is None:
                if placer is not None:
                    return placer(plan.jit, args, kwargs)
                return plan.jit(*args, **kwargs)
        except FitCheck as e:
            check = e  # a signature's first call under remat="fit" (``_fit``)
        finally:
            _fit.called(self, outer)
        return _fit.first_call(check, plan.jit, placer, args, kwargs)

    def _first_check(self, args: tuple, kwargs: dict) -> FitCheck | None:
        """The check ``_program_for_call`` stopped at while building this call's program, if
        the call's own trace would stop at it too (``_check_fit``, with the jit object the call
        runs: ``_fit.calling``); taken from the thread either way."""
        tls = self._caches.tls
        ref = getattr(tls, "first_check", None)
        if ref is None:
            return None
        tls.first_check = None
        program = ref()
        if (
            program is None
            or program.fit is not None
            or getattr(tls, "fit_checking", None) is not None
            or not trace_state_clean()
        ):
            return None
        policy = self._policy
        try:
            found = self._caches.by_call.get(
                call_signature(args, kwargs, policy.static_argnums, policy.static_argnames)
            )
        except TypeError:  # an unhashable static argument
            return None
        if found is not program or not _fit.needs_check(self, program):
            return None
        return _fit.fit_check(self, program)

    def _static_leaf_fn(self, key: tuple) -> OptimizedFunction:
        """The optimized function for arguments with these static leaves (one per set)."""
        fns = self._caches.static_leaf_fns
        sub = fns.get(key)
        if sub is None:
            policy = self._policy
            fn = _static_leaves.with_static_leaves(
                self._fn, key, policy.static_argnums, policy.static_argnames
            )
            sub = fns.setdefault(
                key, OptimizedFunction(fn, policy.options, policy, detached=self._detached)
            )
        return sub

    def _static_leaf_plan(self, split: _static_leaves.StaticSplit) -> CallPlan:
        # The function for these static leaves runs its own dispatch without a call site: under
        # "safe" nothing is donated (the proof's reference counts are about the caller's
        # objects, not the rebuilt trees); "auto" and explicit donation apply as usual.
        return CallPlan(self._static_leaf_fn(split.key), static=split, direct=False)

    def _prove(self, frame, shift: int = 0, key: tuple | None = None) -> Site:
        """The call site's proof, cached; ``shift`` moves positions past a bound instance."""
        policy, caches = self._policy, self._caches
        proof = callsite.prove_call_site(frame, self)
        if shift:
            proof = dataclasses.replace(
                proof,
                positions=tuple(p + shift for p in proof.positions),
                reasons=tuple(
                    (k + shift if isinstance(k, int) else k, why) for k, why in proof.reasons
                ),
            )
        if policy.has_static:
            static = set(policy.static_argnums)
            proof = dataclasses.replace(
                proof,
                positions=tuple(p for p in proof.positions if p not in static),
                names=tuple(n for n in proof.names if n not in policy.static_argnames),
            )
        # A method's fast path would need its own baselines (callsite.BOUND_BASES): none.
        site = Site(proof, policy.fast_ok and not shift)
        # Keyed by the code object's identity, which ``proof.code`` keeps from being reused.
        caches.sites[key or (id(frame.f_code), frame.f_lasti)] = site
        # A call from inside jax (jax.grad, vmap calling the function) is not the user's call
        # site: nothing is donated there (the arguments are traced), and the report should not
        # name a line of jax's own source.
        if proof.location and not frame.f_code.co_filename.startswith(_JAX_DIR):
            caches.site_proofs[proof.location] = proof
        return site

    def _program_for_call(
        self, args: tuple, kwargs: dict, report_only: bool = False
    ) -> Program | None:
        """The program for concrete arguments, tracing (not compiling) on a miss; None when it
        captured an outer tracer (never cached) or a static argument is unhashable.
        ``report_only``: for inspect()/explain()/lower(), not a call (``Program.compiled``
        stays as it is)."""
        policy, caches = self._policy, self._caches
        ckey = call_signature(args, kwargs, policy.static_argnums, policy.static_argnames)
        try:
            program = caches.by_call.get(ckey)
        except TypeError:  # an unhashable static argument: jax.jit's own call raises its error
            return None
        if program is None:
            try:
                key, leaves = trace_signature(
                    args, kwargs, policy.static_argnums, policy.static_argnames
                )
            except OverflowError:  # a Python int no dtype holds: jax.jit's call says which
                return None
            program = caches.programs.get(key)
            # a jax.Ref or a hijax leaf: the wrapper runs the function as plain jax.jit, no
            # program (traced once below, where jax.jit's cache keeps the trace for the call)
            opaque = _jaxpr.opaque_input(leaves) is not None
            if (
                program is not None
                and program.fit is None
                and policy.options.remat == "fit"
                and not report_only
            ):
                # Built without the check (``trace``/``lower``, or inside another trace): jax
                # may answer the call from the trace ``lower`` left, without running our
                # wrapper, so the call checks it here (``_first_check``). Under "fit" only:
                # "auto" planned at that build, with its budget.
                caches.tls.first_check = weakref.ref(program)
            if program is None:
                # jax.jit may answer .trace from its own cache without running our wrapper, so
                # take the program from the trace-side cache first, then from this thread's last.
                for attempt in range(2):
                    if attempt:
                        # jax answered from a trace whose program a concurrent
                        # jax.clear_caches() dropped from ours after it ran our wrapper
                        self._plain.clear_cache()  # pyright: ignore[reportAttributeAccessIssue]
                    caches.tls.last_program = None
                    caches.tls.trace_only = True  # a trace, no executable: nothing decided
                    try:
                        if self._placer is not None:  # may stop at large constants (_hoist)
                            self._placer.trace_only(self._plain, args, kwargs)
                        else:
                            self._plain.trace(*args, **kwargs)
                    except FitCheck as check:
                        # The program is built. A call checks it next (``_first_check``)
                        # instead of tracing again only to stop at the same check. Weakly: a
                        # call that fails before it gets there must leave nothing alive (jax
                        # reuses a NumPy constant's conversion while its program lives).
                        if not report_only:
                            caches.tls.first_check = weakref.ref(check.program)
                    finally:
                        caches.tls.trace_only = False
                        # (taken from the thread at once: a program jax.clear_caches() or
                        # clear_cache() dropped must die, since jax reuses a closed-over NumPy
                        # constant's conversion for as long as the converted array is alive)
                        last, caches.tls.last_program = caches.tls.last_program, None
                    program = caches.programs.get(key) or last
                    if program is not None or opaque:
                        break
            if program is not None and not program.traced.captures_tracers:
                caches.by_call[ckey] = program
        if program is not None and not report_only:
            program.compiled = True
        return program

    def _verify(self, args: tuple, kwargs: dict) -> None:
        from autoopt._compare import assert_trees_equivalent

        program = self._program_for_call(args, kwargs)
        if program is None or program.verified:
            return
        # (one jit object a function, which ``clear_cache()`` clears: a new one each call would
        # leave jax's trace of the function, and a NumPy constant's conversion, alive)
        expected = self._original_jit()(*args, **kwargs)
        try:
            got = self._plain(*args, **kwargs)
        except FitCheck as e:
            got = _fit.first_call(e, self._plain, None, args, kwargs)
        # The exactness the README promises: bit-identical, except where an applied remat plan
        # may reorder floating point (then within _compare's float tolerance).
        findings = program.pipeline.findings if program.pipeline is not None else ()
        remat = any(f.kind == "remat" and f.applied for f in findings)
        assert_trees_equivalent(
            expected,
            got,
            what=f"optimize(verify=True) of {getattr(self.__wrapped__, '__name__', 'fn')}",
            exact=not remat,
        )
        program.verified = True

    def __get__(self, instance, owner=None):
        # Decorating a method: bind like a function does (as jax.jit's wrappers do).
        if instance is None:
            return self
        return _BoundOptimized(self, instance)

    # --- AOT, explain, inspect: one preparation ------------------------------------------------

    def _prepare(self, args: tuple, kwargs: dict) -> tuple[OptimizedFunction, tuple, dict]:
        """The function and arguments a call reaches after the static-leaf split."""
        policy = self._policy
        split = _static_leaves.split_if_static(
            args, kwargs, policy.static_argnums, policy.static_argnames
        )
        if split is None:
            return self, args, kwargs
        return self._static_leaf_fn(split.key), split.args, split.kwargs

    def _aot_choice(
        self, program: Program | None, args: tuple, kwargs: dict, shift: int = 0
    ) -> tuple[Any, tuple[tuple, tuple]]:
        """``(jit object, (donated positions, names))`` of a call: under ``"auto"`` every
        aliasable argument, under ``"safe"`` what a call site rebinding every argument it passes
        would donate (never a decorated method's instance: ``shift``), else the plain jit object
        (explicit donation: the user's own)."""
        policy = self._policy
        if policy.donate == "explicit":
            jit_kwargs = policy.jit_kwargs
            nums, names = jit_kwargs.get("donate_argnums"), jit_kwargs.get("donate_argnames")
            return self._plain, (
                (nums,) if isinstance(nums, int) else tuple(nums or ()),
                (names,) if isinstance(names, str) else tuple(names or ()),
            )
        if policy.donate not in ("auto", "safe") or program is None:
            return self._plain, ((), ())
        if policy.donate == "safe" and host_callbacks(program.final):
            return self._plain, ((), ())  # see passes.donation.host_callbacks
        static = _trace.normalize_static(policy.static_argnums, len(args))
        first = shift if policy.donate == "safe" else 0
        donated = program.donatable(
            tuple(i for i in range(first, len(args)) if i not in static),
            tuple(k for k in kwargs if k not in policy.static_argnames),
        )
        return (self._jit_for(*donated) if donated[0] or donated[1] else self._plain), donated

    @contextlib.contextmanager
    def _aot(self, args: tuple, kwargs: dict):
        """While inside, jit's traces of the wrapper are for ``trace``/``lower`` (ahead of time:
        no remat="fit" check; the caller compiles what it lowered). In a jax.distributed job, a
        program they build knows whether the arguments are this process's own, as a call's does
        (``_planned``): one process lowering a metric for its own arrays waits for nobody."""
        tls = self._caches.tls
        outer, tls.aot = getattr(tls, "aot", False), True
        try:
            if _multiprocess.in_job():
                with _multiprocess.call_arguments(args, kwargs):
                    yield
            else:
                yield
        finally:
            tls.aot = outer

    def _aot_jit(self, args: tuple, kwargs: dict):
        """The jit object ``trace``/``lower`` use: the ``"auto"`` call's, else the plain one."""
        if self._policy.donate != "auto":
            return self._plain
        program = self._program_for_call(args, kwargs, report_only=True)
        return self._aot_choice(program, args, kwargs)[0]

    @_compat.api_boundary
    def trace(self, *args, **kwargs) -> jax.stages.Traced:
        """As ``jax.jit(fn).trace``: the optimized program for these arguments, donating as
        ``lower`` says."""
        of, args, kwargs = self._prepare(args, kwargs)
        tls = of._caches.tls
        outer, tls.trace_api = getattr(tls, "trace_api", False), True
        try:
            with of._aot(args, kwargs):
                return of._aot_jit(args, kwargs).trace(*args, **kwargs)
        finally:
            tls.trace_api = outer

    @_compat.api_boundary
    def lower(self, *args, **kwargs) -> jax.stages.Lowered:
        """As ``jax.jit(fn).lower``: the optimized program for these arguments.

        It donates what the caller asked for, because a compiled ``Lowered`` runs without
        autoopt's per-call checks: under ``donate="safe"`` the statement calling ``lower``
        rebinds nothing, so nothing (``compiled(state)`` never deletes ``state``); with
        ``donate_argnums``/``donate_argnames`` given to ``optimize``, those; under
        ``donate="auto"``, every argument an output can reuse. The executable that calls at a
        rebinding site run (``state = step(state, batch)``), with its aliasing, is
        ``self.inspect(*args).jit.lower(*args)``; the report's memory table shows both."""
        of, args, kwargs = self._prepare(args, kwargs)
        with of._aot(args, kwargs):
            return of._aot_jit(args, kwargs).lower(*args, **kwargs)

    @_compat.api_boundary
    def eval_shape(self, *args, **kwargs):
        """As ``jax.jit(fn).eval_shape``: the outputs' ``jax.ShapeDtypeStruct``s, from a trace of
        the original function (the passes keep every output's type, and tracing them would plan
        remat by compiling)."""
        policy = self._policy
        split = _static_leaves.split_if_static(
            args, kwargs, policy.static_argnums, policy.static_argnames
        )
        if split is None:
            known = self._known_output_shapes(args, kwargs)
            if known is not None:
                return known
            return self._original_jit().eval_shape(*args, **kwargs)
        sub = self._static_leaf_fn(split.key)
        out = sub._original_jit().eval_shape(*split.args, **split.kwargs)
        return _static_leaves.outputs_put_back(
            sub._fn, split, out, policy.static_argnums, policy.static_argnames
        )

    def _known_output_shapes(self, args: tuple, kwargs: dict):
        """``eval_shape``'s answer from the program a call of this signature already traced
        (jax.jit answers from its trace too: the user's function is not run again, nor its
        prints), or None: no such program, or outputs whose placement jax would report
        (shardings given, or an aval carrying one)."""
        policy = self._policy
        if any(k in policy.jit_kwargs for k in ("in_shardings", "out_shardings")):
            return None
        try:
            key = call_signature(args, kwargs, policy.static_argnums, policy.static_argnames)
            program = self._caches.by_call.get(key)
        except Exception:  # noqa: BLE001 - unhashable statics: jax.jit's own route says so
            return None
        if program is None or program.untouched is not None:
            return None
        avals = program.traced.closed.out_avals
        for a in avals:
            mesh = getattr(getattr(a, "sharding", None), "mesh", None)
            if mesh is not None and not getattr(mesh, "empty", True):
                return None
        try:
            structs = [
                jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))
                for a in avals
            ]
        except Exception:  # noqa: BLE001 - an aval of another kind (a token): jax's route
            return None
        return tree_util.tree_unflatten(program.traced.out_tree, structs)

    def _original_jit(self):
        caches = self._caches
        self._sync()
        if caches.original_jit is None:
            kw = self._policy.nested_kwargs
            caches.original_jit = jax.jit(self._fn, **kw)
        return caches.original_jit

    def clear_cache(self) -> None:
        """As ``jax.jit(fn).clear_cache()``: drop every compiled program and trace, so the next
        call of each signature traces, optimizes and compiles again."""
        caches = self._caches
        with caches.lock:
            for sub in list(caches.static_leaf_fns.values()):
                sub.clear_cache()
            jits = [
                *caches.jits.values(),
                caches.eager_ad_jit,
                caches.nested,
                caches.eager_forward_jit,
                caches.original_jit,
            ]
            for j in jits:
                if j is not None:
                    j.clear_cache()
            self._plain.clear_cache()  # pyright: ignore[reportAttributeAccessIssue]
        caches.forget_programs()

    def _forget_nested_traces(self) -> None:
        """Drop the traces jax keeps of calls inside other traces (a report's: see
        ``_reporting.report_tracing``)."""
        for nested in (self._caches.nested, self._caches.eager_forward_jit):
            if nested is not None:
                nested.clear_cache()

    def _cache_size(self) -> int:
        """As ``jax.jit(fn)._cache_size()``: how many signatures have a compiled program (the
        count libraries' tests read to check that a function compiles once)."""
        caches = self._caches
        with caches.lock:
            own = sum(1 for p in list(caches.programs.values()) if p.compiled)
            subs = list(caches.static_leaf_fns.values())
        return own + sum(sub._cache_size() for sub in subs)

    @_compat.api_boundary
    def explain(self, *args, **kwargs):
        """The Report for these arguments: findings, program diff, source edits, memory."""
        from autoopt.passes.placement import findings_for
        from autoopt.report import Report

        of, args, kwargs = self._prepare(args, kwargs)
        with of._reporting_on(args, kwargs) as on:
            inspection = self._sites_into(
                on._inspect_prepared(args, kwargs, calls=of, compiles=True)
            )
            placement = findings_for(inspection, args, kwargs)
            would = _fit.would_apply(inspection.program) if of._policy.fit else []
            return Report.from_program(
                inspection, args, kwargs, extra_findings=[*placement, *would]
            )

    @_compat.api_boundary
    def inspect(self, *args, **kwargs) -> Inspection:
        """The narrow view of what a call with these arguments runs (see ``Inspection``).

        Traces (never compiles) on a signature's first use. Arguments holding non-array leaves
        are described by the function made for those static leaves."""
        of, args, kwargs = self._prepare(args, kwargs)
        with of._reporting_on(args, kwargs) as on:
            return self._sites_into(on._inspect_prepared(args, kwargs, calls=of))

    def _sites_into(self, inspection: Inspection) -> Inspection:
        """``inspection`` (maybe of the function for static leaves) with this function's call
        sites: callers call this function, so their proofs are recorded here (an equinox
        module's step is donated at ``model = step(model, x)``, and its report says so). It
        keeps a wrapper of this function: its jit objects run new signatures while it lives,
        as a jax.jit object does (``_release``)."""
        own = tuple(self._caches.site_proofs.values())
        if inspection.call_sites != own and own:
            calls = site_calls(list(self._caches.sites.values()))
            inspection = dataclasses.replace(
                inspection,
                call_sites=inspection.call_sites + own,
                site_calls={**inspection.site_calls, **calls},
            )
        # (where this function's call sites' positions are its caller's: equinox's route)
        shift = getattr(self, "_site_shift", inspection.site_shift)
        return dataclasses.replace(inspection, keeps=self._handle(), site_shift=shift)

    def _reporter(self) -> OptimizedFunction:
        """The function a report traces, optimizes and compiles through when no call has built
        the signature's program: the same function and policy with caches, jit objects and
        placer of its own. A report must not change what the next call computes: jax.jit has
        no report, and its first call traces and lowers with the values of that moment (a
        closed-over NumPy constant refilled after the report, which jax converts when it
        traces, or whose value the in-place pass read to prove an index)."""
        caches = self._caches
        if caches.reporter is None:
            with caches.lock:
                if caches.reporter is None:
                    reporter = OptimizedFunction(
                        self._fn, self._policy.options, self._policy, detached=self._detached
                    )
                    reporter._caches.is_reporter = True  # (explain=True logs a call's build)
                    caches.reporter = reporter
        return caches.reporter

    def _built_by_a_call(self, args: tuple, kwargs: dict) -> bool:
        """A call (or ``trace``/``lower``, whose traces calls reuse) built the program of these
        arguments' signature, without tracing anything."""
        policy, caches = self._policy, self._caches
        try:
            ckey = call_signature(args, kwargs, policy.static_argnums, policy.static_argnames)
            if ckey in caches.by_call:
                return True
            key, _ = trace_signature(args, kwargs, policy.static_argnums, policy.static_argnames)
        except TypeError:  # an unhashable static argument: the report's trace raises jax's error
            return False
        return key in caches.programs

    @contextlib.contextmanager
    def _reporting_on(self, args: tuple, kwargs: dict):
        """The function whose program a report of these arguments describes and compiles: this
        one where a call built the signature's program (what calls run), else the reporter
        (``_reporter``), emptied when the report is done."""
        if self._built_by_a_call(args, kwargs):
            yield self
            return
        reporter = self._reporter()
        built_inside: list = []
        try:
            with report_tracing() as built_inside:
                yield reporter
        finally:
            for fn in {id(f): f for f in built_inside}.values():
                fn._forget_nested_traces()
            # Nothing of the report's trace outlives the report but what it returns: jax
            # reuses a closed-over NumPy constant's conversion for as long as an array converted
            # from it is alive, and the next call's trace must convert it anew.
            caches = reporter._caches
            with caches.lock:
                built = [*caches.programs.values(), *caches.eager_ad_programs.values()]
            for program in built:
                detach_host_consts(program)
            reporter.clear_cache()

    def _inspect_prepared(
        self,
        args: tuple,
        kwargs: dict,
        shift: int = 0,
        calls: OptimizedFunction | None = None,
        compiles: bool = False,
    ) -> Inspection:
        """The inspection of these arguments' program, built by this function (the caller's, or
        its reporter); ``calls``: the function whose calls' state it shows (this one if None).
        Its ``jit`` is the one ``calls``' call uses, unless the report ``compiles`` it (explain's
        memory figures: through the reporter, whose compile no call reuses)."""
        calls = calls or self
        program = self._program_for_call(args, kwargs, report_only=True)
        if program is None and _jaxpr.opaque_input(tree_util.tree_leaves((args, kwargs))):
            raise ValueError(
                "inspect() and explain() describe the programs autoopt builds, and a call with "
                "a jax.Ref (or another mutable or hijax) argument has none: it runs as plain "
                "jax.jit does. Inspect a call with arrays in its place."
            )
        if program is None:
            raise ValueError(
                "inspect() and explain() cannot run on arguments traced by an "
                "enclosing transformation; call them with concrete arrays."
            )
        variants = _donated_sets(calls._caches.jits)  # before inspect() itself makes one
        jit, donated = self._aot_choice(program, args, kwargs, shift)
        if calls is not self and not compiles:
            # (the jit object a call uses: lowering it traces for the caller, as lower() does)
            jit = calls._plain if jit is self._plain else calls._jit_for(*donated)
        return self._inspection(program, jit, donated, variants, calls)

    def _inspection(
        self,
        program: Program,
        jit,
        donated: tuple,
        variants: frozenset | None = None,
        calls: OptimizedFunction | None = None,
    ) -> Inspection:
        """What ``program`` is and what ``jit`` runs of it; the rest (programs, variants, call
        sites, plans, placement, eager autodiff) is the state of ``calls``' calls."""
        policy = self._policy
        calls = calls or self
        caches = calls._caches
        function = self.__wrapped__
        if self._detached is not None and function is self._detached[0]:
            function = self._detached[1]() or function  # the caller's, not the copy traced
        return Inspection(
            function=function,
            location=policy.fn_location,
            options=policy.options,
            backend=policy.platform(),
            program=program,
            traced=program.traced.closed,
            optimized=program.final,
            changed_by=tuple(name for name, result in program.pipeline.results if result.changed)
            if program.pipeline is not None
            else (),
            findings=tuple(program.pipeline.findings) if program.pipeline is not None else (),
            fallback=program.fallback_reason,
            # (jax's own jit object: what the caller calls or lowers is a plain jax.jit's)
            jit=jit if _NATIVE is None else _NATIVE.unwrap_held(jit),
            donated=donated,
            programs=types.MappingProxyType(dict(caches.programs)),
            donation_variants=_donated_sets(caches.jits) if variants is None else variants,
            call_sites=tuple(caches.site_proofs.values()),
            fast_entries=(
                sum(len(s.plans or {}) for s in list(caches.sites.values()) if s.donates)
                + len(caches.auto_fast or {})
            ),
            placement=calls._placer.figures() if calls._placer is not None else None,
            eager_autodiff_watched=caches.watch_autodiff,
            eager_autodiff_jit=caches.eager_ad_jit,
            site_calls=site_calls(list(caches.sites.values())),
            # (the equinox route's inner function: its call sites' positions are the user's)
            site_shift=getattr(calls, "_site_shift", 0),
        )

    def __repr__(self) -> str:
        fn = self.__dict__.get("__wrapped__")
        try:  # (a callable whose own repr raises: jax.jit's repr does not raise either)
            return f"<autoopt.optimize of {getattr(fn, '__qualname__', fn)!r}>"
        except Exception:  # noqa: BLE001
            return "<autoopt.optimize>"


class _BoundOptimized:
    """An OptimizedFunction bound to an instance (a decorated method): the same dispatch, with
    the instance prepended and positions shifted by one.

    Under ``donate="safe"`` the call site's proof is about the arguments the caller wrote
    (``state = trainer.step(state, batch)``), and the reference counts are checked against the
    baselines of this call shape (``callsite.BOUND_BASES``). The instance itself is never
    proven dead.
    """

    __slots__ = ("_owner", "_instance")

    def __init__(self, owner: OptimizedFunction, instance: Any):
        self._owner = owner
        self._instance = instance

    def __call__(self, *args, **kwargs):
        try:
            owner = self._owner
            # A new name, so the caller's tuple stays alive exactly as in the calibrated probe.
            full = (self._instance, *args)
            try:
                frame = sys._getframe(1) if owner._policy.donate == "safe" else None
            except ValueError:  # no Python caller (a thread's entry point): no site
                frame = None
            if frame is not None:
                key = ("bound", id(frame.f_code), frame.f_lasti)
                site = owner._caches.sites.get(key)
                if site is None:
                    site = owner._prove(frame, shift=1, key=key)
                if site.donates and not site.proof.check(frame, owner, args, kwargs):
                    site = site.refused_by_check()
                if site.donates:  # (the statement's names bound before a signal's exception)
                    plan = owner._dispatch(site, full, kwargs, 1)
                    return call_holding_signals(
                        lambda: owner._run(plan, full, kwargs, callsite.BOUND_BASES),
                        frame,
                        site.proof,
                    )
                del frame
            else:
                site = None
            plan = owner._dispatch(site, full, kwargs, 1)
            return owner._run(plan, full, kwargs, callsite.BOUND_BASES)
        except Exception as e:
            # autoopt's frames and jax's left out of the traceback, as jax.jit leaves its own
            # (not a wrapper: the body reads its caller's frame)
            _compat.filter_traceback(e)
            _static_leaves.note_traced_module_fields(e, (self._instance, *args), kwargs)
            raise

    @_compat.api_boundary
    def inspect(self, *args, **kwargs) -> Inspection:
        """As ``OptimizedFunction.inspect``, with the instance in front."""
        of, full, kwargs = self._owner._prepare((self._instance, *args), kwargs)
        with of._reporting_on(full, kwargs) as on:
            inspection = on._inspect_prepared(full, kwargs, shift=1, calls=of)
        return dataclasses.replace(inspection, keeps=self._owner._handle())

    def __getattr__(self, name):
        attr = getattr(self._owner, name)
        if name in ("lower", "trace", "explain", "eval_shape"):
            return functools.partial(attr, self._instance)
        return attr


# (the placer, which catches it too, is only ever called from these)
_fit.CATCHERS.update(
    f.__code__
    for f in (
        OptimizedFunction._call,
        OptimizedFunction._run,
        OptimizedFunction._verify,
        OptimizedFunction._program_for_call,
    )
)


def optimize(fn: Callable | None = None, /, **options: Any):
    """As ``jax.jit``, but the program is optimized first (donation, in-place updates, remat,
    placement), computing the same numbers.

    Three forms: ``@optimize``, ``@optimize(donate="auto", ...)``, ``optimize(fn, ...)``. Every
    ``jax.jit`` keyword passes through. A function already wrapped by ``jax.jit`` is unwrapped
    and its jax.jit keywords kept, merged with the ones given here (the same keyword given both
    ways differently is an error).
    """
    opts = make_options(**options)  # validate before anything is built
    if fn is None:
        return lambda f: optimize(f, **options)
    _check_callable(fn)
    route = _framework_route(fn)
    if route is not None and not opts.jit_kwargs:
        # a framework's jit (equinox's filter_jit): its semantics, the proof at the caller's
        # statement (``_jit._equinox``). Cached on what the framework's wrapper is made of (its
        # function, by identity, and its settings): a new ``filter_jit(f)`` per call finds the
        # first one's programs, as equinox's own cache does.
        name, make, subject_of = route
        subject, settings = subject_of(fn)
        okey = _reuse.options_key(options)
        key = (name, settings, okey) if okey is not None else None
        made = _WRAPPERS.get(subject, key)
        if made is None:
            made = make(fn, options)
            if made is not None:
                _WRAPPERS.put(subject, key, made)
        if made is not None:
            return made
    fn, jitted_with = _unwrap_jit(fn)
    if jitted_with:
        for kw in jitted_with:
            options = _merge_jit_options(fn, options, kw)
        opts = make_options(**options)
    key = _reuse.options_key(options)
    made = _WRAPPERS.get(fn, key)
    fresh = made._handle(fn) if made is not None else None
    if fresh is None:
        opts = _with_inferred_argnums(fn, opts)
        _check_argnums(fn, opts)
        made = _shared_for(fn, opts)  # kept unseen: each caller gets a fresh wrapper
        if key is not None:
            made._cached = True
            _WRAPPERS.put(fn, key, made)
        fresh = made._fresh(fn)
    return fresh


def _shared_for(fn: Callable, opts: Options) -> OptimizedFunction:
    """The optimized function ``optimize``'s wrappers of ``fn`` share. Where it can, it refers
    to nothing of ``fn`` (``_reuse``): it traces a copy, and its programs are released when
    ``fn`` goes (``_release``), as jax.jit's caches drop theirs."""
    copy = _reuse.detached(fn)
    if copy is None:
        return OptimizedFunction(fn, opts)
    made = OptimizedFunction(copy, opts)
    made._releasable = True
    made_ref = weakref.ref(made)

    def function_gone(_ref: weakref.ref) -> None:
        of = made_ref()
        if of is not None:
            of._release_if_unreachable()

    made._detached = (copy, weakref.ref(fn, function_gone))
    return made


# The frameworks' jit wrappers ``optimize`` takes apart itself: ``(name, is_theirs(fn),
# make(fn, options) -> wrapper or None, subject_of(fn) -> (function, hashable settings))``,
# registered by their modules (``_jit._equinox``) so that this module imports none of them.
FRAMEWORK_ROUTES: list[
    tuple[
        str,
        Callable[[Any], bool],
        Callable[[Any, dict], Any],
        Callable[[Any], tuple[Any, Any]],
    ]
] = []


def _framework_route(
    fn: Any,
) -> tuple[str, Callable[[Any, dict], Any], Callable[[Any], tuple[Any, Any]]] | None:
    for name, is_theirs, make, subject_of in FRAMEWORK_ROUTES:
        if is_theirs(fn):
            return name, make, subject_of
    return None


# ``optimize(f)`` called again for the same function and options returns the function made the
# first time, with its programs (``_reuse``): ``autoopt.optimize(f)(x)`` in a loop traces and
# compiles once, as ``jax.jit(f)(x)`` does.
_WRAPPERS = _reuse.WrapperCache()


def forget_wrappers() -> None:
    """Later ``optimize`` calls build new optimized functions (those already made keep their
    programs): for tests that need a wrapper's first call, as ``jax.clear_caches()`` gives."""
    _WRAPPERS.clear()
    equinox_route = sys.modules.get("autoopt._jit._equinox")
    if equinox_route is not None:  # its inner functions, shared by name (``EquinoxJit``)
        equinox_route.forget_inner_functions()


@_compat.api_boundary
def explain(fn: Callable, *args: Any, **kwargs: Any):
    """``Report`` of what ``optimize`` finds and changes for ``fn(*args, **kwargs)``.

    Options of ``optimize`` may be given as keywords too; a keyword that is both an option and
    an argument of ``fn`` is taken as an option.
    """
    opts = {k: kwargs.pop(k) for k in list(kwargs) if k in option_names()}
    return optimize(fn, **opts).explain(*args, **kwargs)
