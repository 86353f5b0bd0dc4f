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
