"""The only module in autoopt that imports ``jax._src``.

Everything here is something the public API (``jax.extend``, ``jax.stages``, ``jax.tree_util``)
does not offer in jax 0.10.x. A JAX upgrade should touch this file and nothing else; each helper
names what it wraps so the next reader can find it in JAX's source.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax._src import api_util as _api_util
from jax._src import array as _array
from jax._src import config as _config
from jax._src import core as _core
from jax._src import distributed as _distributed
from jax._src import dtypes as _dtypes
from jax._src import effects as _effects
from jax._src import linear_util as _lu
from jax._src import source_info_util as _siu
from jax._src import traceback_util as _tbu
from jax._src import tree_util as _tree_util
from jax._src import xla_bridge as _xla_bridge
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import batching as _batching
from jax._src.interpreters import partial_eval as _pe
from jax._src.random import prng as _prng
from jax.core import Tracer

__all__ = [
    "ARRAY_IMPL",
    "KEY_ARRAY",
    "key_entry",
    "key_base_array",
    "on_clear_caches",
    "user_frame",
    "trace_closed_jaxpr",
    "stage_jaxpr",
    "jit_debug_info",
    "api_boundary",
    "filter_traceback",
    "is_tracer",
    "jit_accepts_leaf",
    "debug_nans_enabled",
    "jaxpr_effects",
    "jit_options",
    "infer_argnums_and_argnames",
    "distributed_processes",
]

# The concrete type of every jax.Array a computation returns. Named here rather than found by
# ``type(jnp.zeros(()))``, which would initialize a backend at import time (after that,
# ``jax.config.update("jax_num_cpu_devices", ...)`` and ``jax.distributed.initialize()`` fail).
ARRAY_IMPL: type = _array.ArrayImpl
# The type of a typed PRNG key array (``jax.random.key``): a jax.Array with an extended dtype,
# not an ``ArrayImpl``. Its ``aval`` is computed (equal, not identical, between two keys).
KEY_ARRAY: type = _prng.PRNGKeyArray


# The uint32 jax array holding a typed PRNG key array's data (``PRNGKeyArray._base_array``). It
# is the very object ``jax.random.key_data(key)`` returns (``random_unwrap_p``'s impl returns
# ``keys._base_array``) and the very object ``jax.random.wrap_key_data(data)`` wraps
# (``random_wrap_p``'s impl is ``PRNGKeyArray(impl, data)``: a jax array is not copied, a NumPy
# one is). A key and an array can thus share one buffer without being one object: whatever
# compares arrays by identity to keep a buffer from being donated reads a key as this too. An
# attrgetter: read on every call of an "auto" plan.
key_base_array: Callable[[Any], Any] = operator.attrgetter("_base_array")


def key_entry(key) -> tuple:
    """A typed PRNG key array's part of a call signature: its type, the stored aval of the
    uint32 array holding its data and its implementation, equal exactly when two keys' avals
    are. (``key.aval`` is computed on every read, through sharding checks: tens of us.)"""
    return (KEY_ARRAY, key._base_array.aval, key._impl)


class _ClearHook:
    """What ``jax.clear_caches()`` clears, as jax's registry of caches wants it."""

    def __init__(self, clear: Callable[[], None]):
        self._clear = clear

    def cache_clear(self) -> None:
        self._clear()

    def cache_info(self) -> None:
        return None

    def cache_keys(self) -> tuple:
        return ()


_CLEAR_HOOKS: list[_ClearHook] = []  # (held: jax's registry may hold them weakly)


def on_clear_caches(clear: Callable[[], None], for_what: str) -> None:
    """Call ``clear()`` whenever ``jax.clear_caches()`` runs."""
    from jax._src import util as _util

    hook = _ClearHook(clear)
    _CLEAR_HOOKS.append(hook)
    _util.register_cache(hook, for_what)


def user_frame(source_info) -> tuple[str, int] | None:
    """``(file, line)`` of the user's code that produced an equation, or None.

    NB: JAX's own ``source_info_util.user_frame`` skips jax-internal frames; we also skip
    autoopt's own frames (registered once below) so rewritten equations keep the user's line.
    """
    if source_info is None:
        return None
    frame = _siu.user_frame(source_info.traceback)
    if frame is None:
        return None
    return frame.file_name, frame.start_line


def trace_closed_jaxpr(
    fn: Callable, in_avals: Sequence[Any], name: str = "autoopt", debug_info: Any = None
):
    """Trace ``fn(*flat_args)`` at abstract values ``in_avals`` to a ClosedJaxpr.

    As ``jax.make_jaxpr``, but takes avals directly, so weak types, tokens and extended dtypes
    round-trip exactly (``ShapeDtypeStruct`` loses some of them).

    ``debug_info`` (from ``jit_debug_info``) is what JAX's errors raised while tracing name: the
    function, its location and each flat argument. Without one they name ``fn`` itself, traced
    for ``name``, and its arguments ``flat[i]``: right for autoopt's own re-traces of a jaxpr,
    not for the user's function.
    """
    dbg = debug_info
    if dbg is None:
        dbg = _api_util.debug_info(name, fn, tuple(in_avals), {})
    else:
        dbg.assert_arg_names(len(in_avals))
    wrapped = _lu.wrap_init(fn, debug_info=dbg)
    jaxpr, _out_avals, consts = _pe.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
    return _core.ClosedJaxpr(jaxpr, consts)


def stage_jaxpr(jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any] | None:
    """Copy ``jaxpr``'s equations into the jit trace ``args`` belong to; None where that is not
    the case (then the caller binds each primitive again, as ``jax.core.eval_jaxpr``).

    What ``jax.jit(inline=True)`` does when it is staged (``pjit_staging_rule`` calls
    ``partial_eval.inline_jaxpr_into_trace``): each equation is emitted as traced, with no
    abstract evaluation or staging rule run again, so staging a traced program into jit costs a
    small part of tracing it. Unlike that function, each equation keeps its own traceback (as
    ``eval_jaxpr`` under ``source_info_util.user_context``), so the compiled program's
    locations still name the user's lines."""
    trace = _core.trace_ctx.trace
    if type(trace) is not _pe.DynamicJaxprTrace or jaxpr.is_high:
        return None
    tracer_type = _pe.DynamicJaxprTracer
    for a in args:
        if type(a) is not tracer_type or a._trace is not trace:
            return None
    for c in consts:
        if isinstance(c, Tracer) or isinstance(c, _core.Ref):
            return None
    src = _siu.current()
    env: dict[Any, Any] = {
        v: trace.to_jaxpr_tracer(_dtypes.canonicalize_value(c), src)
        for v, c in zip(jaxpr.constvars, consts)
    }
    env.update(zip(jaxpr.invars, args))
    literal = _core.Literal
    name_stack = src.name_stack
    for eqn in jaxpr.eqns:
        eqn_src = eqn.source_info.replace(name_stack=name_stack + eqn.source_info.name_stack)
        ins = [
            tracer_type(trace, x.aval, x, eqn_src) if type(x) is literal else env[x]
            for x in eqn.invars
        ]
        out_avals = [v.aval for v in eqn.outvars]
        folded = _pe.try_constant_folding(eqn.primitive, ins, eqn.params, out_avals)
        if folded is not None:
            outs = [
                trace.new_const(c, source_info=eqn_src, aval=aval)
                for c, aval in zip(folded, out_avals)
            ]
        else:
            effs = (
                {
                    e.replace(env[e.input].val) if isinstance(e, _effects.JaxprInputEffect) else e
                    for e in eqn.effects
                }
                if eqn.effects
                else eqn.effects
            )
            outs = trace.emit_eqn(ins, out_avals, eqn.primitive, eqn.params, effs, eqn_src, eqn.ctx)
        for v, t in zip(eqn.outvars, outs):
            env.setdefault(v, t)
    return [
        trace.to_jaxpr_tracer(tracer_type(trace, x.aval, x, src), src)
        if type(x) is literal
        else env[x]
        for x in jaxpr.outvars
    ]


def jit_debug_info(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    static_argnums: Sequence[int],
    static_argnames: Sequence[str],
    leaf_names: Sequence[str],
) -> Any:
    """The ``DebugInfo`` jax.jit builds for ``fn(*args, **kwargs)`` (``jax._src.pjit._infer_params``
    calls ``jax._src.api_util.debug_info("jit", ...)``): JAX's tracing errors then read "while
    tracing the function f at file.py:12 for jit ... the argument state['w']", as jax.jit's do.

    ``args``/``kwargs`` hold the static arguments too; ``leaf_names`` (one per dynamic leaf, in
    flattening order) replace JAX's names when JAX finds another number of leaves (a tree its
    tracing registry flattens otherwise), so the names always line up with the leaves.
    """
    try:
        dbg = _api_util.debug_info(
            "jit",
            fn,
            args,
            kwargs,
            static_argnums=tuple(static_argnums),
            static_argnames=tuple(static_argnames),
        )
    except Exception:  # noqa: BLE001 - names for error messages must never fail a trace
        dbg = _core.DebugInfo("jit", _api_util.fun_sourceinfo(fn), None, None)
    if dbg.arg_names is None or len(dbg.arg_names) != len(leaf_names):
        dbg = dbg._replace(arg_names=tuple(leaf_names))
    return dbg


# A decorator for a public entry point: an exception raised below it carries a traceback
# without JAX's frames and autoopt's (registered below), as jax.jit's do, under
# JAX_TRACEBACK_FILTERING as for jax.jit. Nested boundaries (autoopt's, then jax.jit's inside)
# filter once, at the outermost. It adds a frame: an entry point that reads its caller's frame
# (``sys._getframe(1)``) uses ``filter_traceback`` in an ``except`` clause instead.
api_boundary = _tbu.api_boundary


def filter_traceback(e: BaseException) -> None:
    """Remove JAX's and autoopt's frames from ``e``'s traceback as ``api_boundary`` would, for
    an entry point that cannot be wrapped (it reads its caller's frame)::

        def __call__(self, *args, **kwargs):
            try:
                ...
            except Exception as e:
                _compat.filter_traceback(e)
                raise  # a bare raise: it adds no frame of ours back

    As ``jax._src.traceback_util.api_boundary``'s ``reraise_with_filtered_traceback``: nothing
    under an outer JAX boundary (that one filters) or under ``JAX_TRACEBACK_FILTERING=off``;
    ``tracebackhide`` marks the frames for IPython; the default ``quiet_remove_frames`` filters
    and adds JAX's note once (a jax.jit boundary inside may have added it already);
    ``remove_frames`` keeps the whole traceback in an ``UnfilteredStackTrace`` cause.
    """
    tb = e.__traceback__
    if tb is None or _tbu._is_under_reraiser(e):
        return
    mode = _tbu._filtering_mode()
    if mode == "off":
        return
    if mode == "tracebackhide":
        _tbu._add_tracebackhide_to_hidden_frames(tb)
        return
    if mode not in ("quiet_remove_frames", "remove_frames"):
        return  # jax.jit raises its ValueError for it; ours is not the place
    e.with_traceback(_tbu.filter_traceback(tb))
    if mode == "quiet_remove_frames":
        note = "--------------------\n" + _tbu._simplified_tb_msg
        if note not in getattr(e, "__notes__", ()):
            e.add_note(note)
    elif not isinstance(e.__cause__, _tbu.UnfilteredStackTrace):
        msg = f"{_tbu.format_exception_only(e)}\n\n{_tbu._jax_message_append}"
        unfiltered = _tbu.UnfilteredStackTrace(msg)
        unfiltered.with_traceback(_tbu._add_call_stack_frames(tb))
        unfiltered.__cause__ = e.__cause__
        unfiltered.__context__ = e.__context__
        unfiltered.__suppress_context__ = e.__suppress_context__
        e.__cause__ = unfiltered
        e.__context__ = None


def is_tracer(x: Any) -> bool:
    return isinstance(x, Tracer)


def jit_accepts_leaf(x: Any) -> bool:
    """jax.jit takes ``x`` as an argument leaf: it has an abstract value (arrays, scalars, typed
    PRNG keys, ``jax.Ref``, tokens, and whatever else registers one). Only a TypeError means
    no; any other error (a Python int too large for int64) is jit's to raise at the call."""
    try:
        _core.shaped_abstractify(x)
    except TypeError:
        return False
    except Exception:  # noqa: BLE001
        return True
    return True


# The states behind ``jax.config.jax_debug_nans`` etc.: ``.value`` is a C++ property, where
# ``jax.config.<name>`` goes through a Python property first. Read on every call, so the cheaper
# one.
_DEBUG_NANS, _DEBUG_INFS, _DISABLE_JIT = _config.debug_nans, _config.debug_infs, _config.disable_jit


def debug_nans_enabled() -> bool:
    return _DEBUG_NANS.value or _DEBUG_INFS.value


# ``jax_debug_nans`` and ``jax_debug_infs`` as jax's config states, for a cached call plan to
# read their ``.value`` inline (a Python call costs more than both reads).
DEBUG_NANS_STATES: tuple[Any, Any] = (_DEBUG_NANS, _DEBUG_INFS)


def jit_disabled() -> bool:
    return _DISABLE_JIT.value


def trace_context() -> Any:
    """The configuration jax.jit keys its own caches on (x64, dtype promotion, ...): a program
    traced under one context must not serve another. Cheap enough to read on every call."""
    return _config.trace_context()


def jaxpr_effects(closed) -> Any:
    return closed.jaxpr.effects


def _register_own_frames() -> None:
    """autoopt's own frames must never be reported as the user's line.

    JAX excludes by path prefix. We exclude the private modules and subpackages, but not
    ``autoopt/examples`` (the bundled demos are user code as far as reports go).
    """
    import os

    pkg = os.path.dirname(os.path.abspath(__file__))
    for prefix in ("_", "passes", "report", "codemod", "testing", "cli.py", "__"):
        _siu.register_exclusion(os.path.join(pkg, prefix))


_register_own_frames()


def _register_traceback_exclusion() -> None:
    """Remove autoopt's frames from the tracebacks of errors that cross a JAX API boundary
    (``jax._src.traceback_util.api_boundary``: jax.jit's, autoopt's own entry points), as JAX
    removes its own. The whole package directory: the user's code never lives in it. Appends
    a path to two lists (Python's and jaxlib's); no backend starts. Once per process."""
    import os

    pkg = os.path.dirname(os.path.abspath(__file__))
    if pkg not in _tbu._exclude_paths:  # not again on a reload of this module
        _tbu.register_exclusion(pkg)


_register_traceback_exclusion()


_FLATTEN_ONE_LEVEL = _tree_util.default_registry.flatten_one_level


def is_plain_namedtuple(t: type) -> bool:
    """Whether jax flattens instances of ``t`` by its default NamedTuple rule (a tuple with
    ``_fields``, whose children are its items), not by a registration of its own: those are
    recorded in ``jax._src.tree_util._registry``, which every public ``register_pytree_node*``
    fills."""
    return issubclass(t, tuple) and hasattr(t, "_fields") and t not in _tree_util._registry


def flatten_one_level(tree):
    """``(children, aux)`` of one pytree node; ValueError for a leaf.

    ``jax._src.tree_util.flatten_one_level`` (its registry's C++ method, bound once): the public
    API flattens whole trees only, and donation's reference checks need each node's direct
    children, on every call of a step whose state holds registered nodes (an optax state's
    NamedTuples, an equinox module).
    """
    out = _FLATTEN_ONE_LEVEL(tree)
    if out is None:
        raise ValueError(f"can't tree-flatten type: {type(tree)}")
    return out


def in_transpose(source_info) -> bool:
    """True when an equation was emitted by JAX's transpose (the backward of ``jax.grad``,
    ``vjp``, ``value_and_grad``): its name stack holds a ``transpose`` transform.

    Reads ``source_info.name_stack.stack`` (``jax._src.source_info_util.NameStack``), whose
    ``Transform`` entries are what print as ``transpose(jvp(f))`` in HLO op names.
    """
    for e in getattr(getattr(source_info, "name_stack", None), "stack", ()):
        if type(e) is _TRANSFORM and e.name == "transpose":
            return True
    return False


# (compared by identity: remat's gate asks it of every equation)
_TRANSFORM = _siu.Transform


def reset_dispatch_cache(jitted: Any) -> None:
    """Drop the C++ dispatch entries of a ``jax.jit`` object (not its traces, lowerings or
    executables). A call whose trace raised leaves its signature's entry marked to fall back
    to Python for good (jaxlib's ``PjitFunction``: ``fall_back_to_python``), so every later
    call of that signature goes through ``cache_miss``: about 50 us instead of 4 for a small
    function on CPU. autoopt aborts a first call's trace on purpose (``FitCheck``,
    ``HoistConstants``); after the call made again, this lets the next call fill a fast
    entry from the caches jax already holds (no trace, no compile)."""
    clear = getattr(jitted, "_clear_cache", None)
    if clear is not None:
        clear()


_TRACE_STATE, _AXIS_ENV = _core.trace_state_strong_ref, _core.axis_env_state
_EVAL_TRACE, _TOP_AXIS_ENV = _core.eval_trace, _core.top_axis_env


def trace_state_clean() -> bool:
    """True outside every JAX transformation (no jit, grad, vmap trace is active).

    ``jax._src.core.trace_state_clean`` (``trace_ctx.is_top_level()``) with its two reads
    inlined: every call of an optimized function asks (three Python calls cost as much as the
    rest of a cached call's checks). ``compiler_options`` are accepted by jax.jit only when it
    is called at the top level.
    """
    return _TRACE_STATE.value is _EVAL_TRACE and _AXIS_ENV.value is _TOP_AXIS_ENV


def top_level_trace() -> bool:
    """Inside a function jax.jit is tracing: whether that trace is jit's own at the top level
    (its parent is eager evaluation), not one nested in another jit, vmap or grad. Reads
    ``parent_trace`` of jax's current ``DynamicJaxprTrace`` (jax._src.core.trace_ctx)."""
    trace = _core.trace_ctx.trace
    return isinstance(getattr(trace, "parent_trace", None), _core.EvalTrace)


def eager_autodiff(tree) -> bool:
    """Whether ``tree`` holds autodiff tracers (``jax.grad``, ``vjp``, ``jvp``) over concrete
    arrays and nothing else traced: a transformation applied eagerly, outside any jit or vmap.
    Reads ``.primal`` of jax's JVP and linearize tracers (jax._src.interpreters.ad)."""
    found = False
    for leaf in jax.tree_util.tree_leaves(tree):
        if not isinstance(leaf, Tracer):
            continue
        x = leaf
        while isinstance(x, Tracer):
            if not isinstance(x, _ad.JVPTracer | _ad.LinearizeTracer):
                return False
            x = x.primal
        found = True
    return found


def eager_forward() -> bool:
    """Whether the current trace is an eager ``vmap`` or ``jvp`` (jax's batching and JVP traces,
    nested, over the evaluation trace): a transformation jax evaluates at once, compiling a
    jit called under it on its own, with its compiler_options, whatever its arguments.
    Reads ``jax._src.core.trace_ctx`` and each trace's ``parent_trace``."""
    t = _core.trace_ctx.trace
    found = False
    while isinstance(t, _batching.BatchTrace | _ad.JVPTrace):
        t = getattr(t, "parent_trace", None)
        found = True
    return found and isinstance(t, _core.EvalTrace)


def is_jit_object(fn: Any) -> bool:
    """``fn`` is a function ``jax.jit`` (or ``pjit``) returned, whose options ``jit_options``
    reads."""
    info = getattr(fn, "_jit_info", None)
    return info is not None and hasattr(info, "in_shardings_leaves")


def resolves_specs_in_mesh_context(fn: Any) -> bool:
    """``fn`` is a ``pjit``-made function (``PjitInfo.use_resource_env``): its PartitionSpecs
    are resolved against the legacy ``with Mesh(...)`` context when called, which a ``jax.jit``
    rebuilt from its options does not do."""
    info = getattr(fn, "_jit_info", None)
    return bool(getattr(info, "use_resource_env", False))


def jit_options(fn: Any) -> dict[str, Any] | None:
    """The keywords ``jax.jit`` was given for ``fn`` (one of its wrappers), as ``jax.jit`` keeps
    them, or None for anything else: only what differs from jax.jit's defaults.

    Reads ``fn._jit_info`` (``jax._src.pjit.PjitInfo``, built by ``_parse_jit_arguments``): jax
    offers no public way to ask a jitted function for its options. Argnums and argnames come
    back completed from each other as jax.jit completes them (``static_argnums=1`` -> also
    ``static_argnames=("n",)``). Layouts given through ``in_shardings``/``out_shardings``
    (``jax.sharding.Format``) raise ValueError: they cannot be passed back as shardings.
    """
    if not is_jit_object(fn):
        return None
    info = fn._jit_info
    from jax._src import sharding_impls

    def given(leaves) -> bool:
        unspecified = sharding_impls.UnspecifiedValue  # pyright: ignore[reportPrivateImportUsage]
        return not all(isinstance(x, unspecified) for x in leaves)

    if any(x is not None for x in (*info.in_layouts_leaves, *info.out_layouts_leaves)):
        raise ValueError(
            f"optimize() cannot take over the layouts {fn!r} was jitted with "
            "(jax.sharding.Format in in_shardings/out_shardings). Pass the function itself: "
            "autoopt.optimize(f.__wrapped__, in_shardings=..., out_shardings=...)."
        )
    out: dict[str, Any] = {}
    if info.user_specified_in_shardings and given(info.in_shardings_leaves):
        out["in_shardings"] = info.in_shardings_treedef.unflatten(info.in_shardings_leaves)
    if given(info.out_shardings_leaves):
        out["out_shardings"] = info.out_shardings_treedef.unflatten(info.out_shardings_leaves)
    for name in ("static_argnums", "static_argnames", "donate_argnums", "donate_argnames"):
        value = tuple(getattr(info, name))
        if value:
            out[name] = value
    for name, default in (("keep_unused", False), ("inline", False)):
        if getattr(info, name) != default:
            out[name] = getattr(info, name)
    for name in ("device", "backend"):
        if getattr(info, name) is not None:
            out[name] = getattr(info, name)
    if info.compiler_options_kvs:
        out["compiler_options"] = dict(info.compiler_options_kvs)
    return out


def infer_argnums_and_argnames(fn: Callable, argnums: Any, argnames: Any) -> tuple[tuple, tuple]:
    """``(argnums, argnames)`` completed from each other by ``fn``'s signature, as jax.jit does
    (``jax._src.api_util.infer_argnums_and_argnames``); as given when ``fn`` has no signature."""
    sig = _api_util.fun_signature(fn)
    if sig is None:
        nums = () if argnums is None else (argnums,) if isinstance(argnums, int) else argnums
        names = () if argnames is None else (argnames,) if isinstance(argnames, str) else argnames
        return tuple(nums), tuple(names)
    return _api_util.infer_argnums_and_argnames(sig, argnums, argnames)


def distributed_processes() -> tuple[Any, int, int]:
    """``(key-value client, number of processes, this process's index)`` of the
    ``jax.distributed`` job, or ``(None, 1, 0)`` outside one. Reads
    ``jax._src.distributed.global_state`` (jax has no public accessor for its key-value store);
    initializes no backend, unlike ``jax.process_count()``."""
    state = _distributed.global_state
    client = state.client
    n = state.num_processes
    if client is None or not n or n <= 1:
        return None, 1, 0
    return client, int(n), int(state.process_id or 0)


def job_settled() -> bool:
    """Whether ``distributed_processes()`` can no longer change: a backend has started, after
    which ``jax.distributed.initialize()`` raises (``xla_bridge.backends_are_initialized``)."""
    return bool(_xla_bridge.backends_are_initialized())
