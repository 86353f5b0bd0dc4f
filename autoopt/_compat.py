"""The only module in autoopt that imports ``jax._src``.

Everything here is something the public API (``jax.extend``, ``jax.stages``, ``jax.tree_util``)
does not offer in jax 0.10.x. A JAX upgrade should touch this file and nothing else; each helper
names what it wraps so the next reader can find it in JAX's source.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax._src import api_util as _api_util
from jax._src import array as _array
from jax._src import config as _config
from jax._src import core as _core
from jax._src import distributed as _distributed
from jax._src import linear_util as _lu
from jax._src import source_info_util as _siu
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import partial_eval as _pe
from jax.core import Tracer

__all__ = [
    "ARRAY_IMPL",
    "user_frame",
    "trace_closed_jaxpr",
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


def trace_closed_jaxpr(fn: Callable, in_avals: Sequence[Any], name: str = "autoopt"):
    """Trace ``fn(*flat_args)`` at abstract values ``in_avals`` to a ClosedJaxpr.

    As ``jax.make_jaxpr``, but takes avals directly, so weak types, tokens and extended dtypes
    round-trip exactly (``ShapeDtypeStruct`` loses some of them).
    """
    dbg = _api_util.debug_info(name, fn, tuple(in_avals), {})
    wrapped = _lu.wrap_init(fn, debug_info=dbg)
    jaxpr, _out_avals, consts = _pe.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
    return _core.ClosedJaxpr(jaxpr, consts)


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


def flatten_one_level(tree):
    """``(children, aux)`` of one pytree node; ValueError for a leaf.

    Wraps ``jax._src.tree_util.flatten_one_level``: the public API flattens whole trees only, and
    donation's reference checks need each node's direct children.
    """
    from jax._src.tree_util import flatten_one_level as _f

    return _f(tree)


def in_transpose(source_info) -> bool:
    """True when an equation was emitted by JAX's transpose (the backward of ``jax.grad``,
    ``vjp``, ``value_and_grad``): its name stack holds a ``transpose`` transform.

    Reads ``source_info.name_stack.stack`` (``jax._src.source_info_util.NameStack``), whose
    ``Transform`` entries are what print as ``transpose(jvp(f))`` in HLO op names.
    """
    stack = getattr(getattr(source_info, "name_stack", None), "stack", ())
    return any(type(e).__name__ == "Transform" and e.name == "transpose" for e in stack)


def trace_state_clean() -> bool:
    """True outside every JAX transformation (no jit, grad, vmap trace is active).

    Wraps ``jax._src.core.trace_state_clean``: ``compiler_options`` are accepted by jax.jit only
    when it is called at the top level.
    """
    return _core.trace_state_clean()


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


def jit_options(fn: Any) -> dict[str, Any] | None:
    """The keywords ``jax.jit`` was given for ``fn`` (one of its wrappers), as ``jax.jit`` keeps
    them, or None for anything else: only what differs from jax.jit's defaults.

    Reads ``fn._jit_info`` (``jax._src.pjit.PjitInfo``, built by ``_parse_jit_arguments``): jax
    offers no public way to ask a jitted function for its options. Argnums and argnames come
    back completed from each other as jax.jit completes them (``static_argnums=1`` -> also
    ``static_argnames=("n",)``). Layouts given through ``in_shardings``/``out_shardings``
    (``jax.sharding.Format``) raise ValueError: they cannot be passed back as shardings.
    """
    info = getattr(fn, "_jit_info", None)
    if info is None or not hasattr(info, "in_shardings_leaves"):
        return None
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
