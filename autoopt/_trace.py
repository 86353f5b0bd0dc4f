"""Function + arguments -> ClosedJaxpr, with the pytree structure, static values and user names.

One ``TracedProgram`` per input signature (``Signature``; ``autoopt._jit._program`` computes it
from tracers inside jax.jit's trace of the wrapper and from concrete arguments on the call path).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
from jax import tree_util
from jax.extend.core import ClosedJaxpr, valid_jaxtype

from autoopt import _compat


def normalize_static(argnums: Sequence[int], nargs: int) -> frozenset[int]:
    """The static positions of a call of ``nargs`` positional arguments: a negative index
    counts from the end, one past the arguments is ignored (an optional argument not passed),
    one before the first raises jax.jit's error."""
    out = []
    for i in argnums:
        if i < -nargs:
            raise ValueError(  # (jax's api_util._ensure_inbounds, word for word)
                "Positional argument indices, e.g. for `static_argnums`, must have value "
                "greater than or equal to -len(args) and less than len(args), but got value "
                f"{i} for len(args) == {nargs}."
            )
        out.append(i + nargs if i < 0 else i)
    return frozenset(out)


def split_args(
    args: tuple, kwargs: dict, static_argnums: Sequence[int], static_argnames: Sequence[str]
):
    """``(dyn_tree, statics)``: the dynamic part as ``(args, kwargs)`` (the pytree jax.jit flattens)
    and a hashable description of the static values."""
    static_pos = normalize_static(static_argnums, len(args))
    if not static_pos and not static_argnames:
        return (args, kwargs), ()
    dyn_args = tuple(a for i, a in enumerate(args) if i not in static_pos)
    dyn_kwargs = {k: v for k, v in kwargs.items() if k not in static_argnames}
    statics = (
        tuple((i, args[i]) for i in sorted(static_pos) if i < len(args)),
        tuple(sorted((k, v) for k, v in kwargs.items() if k in static_argnames)),
    )
    return (dyn_args, dyn_kwargs), statics


def strict_statics(statics):
    """``split_args``'s static values each with its type, for a ``Signature``: jax.jit's cache
    compares static arguments by type as well as by ``==`` (``True`` and ``1``, ``2`` and
    ``2.0`` are two programs there, as their results' dtypes can differ)."""
    if not statics:
        return statics
    pos, kw = statics
    return (
        tuple([(i, type(v), v) for i, v in pos]),
        tuple([(k, type(v), v) for k, v in kw]),
    )


def merge_args(dyn_tree, statics, nargs: int):
    """Inverse of ``split_args``."""
    dyn_args, dyn_kwargs = dyn_tree
    if not statics:
        return tuple(dyn_args), dict(dyn_kwargs)
    pos_statics, kw_statics = statics
    args: list[Any] = []
    it = iter(dyn_args)
    static_at = dict(pos_statics)
    for i in range(nargs):
        args.append(static_at[i] if i in static_at else next(it))
    kwargs = dict(dyn_kwargs)
    kwargs.update(dict(kw_statics))
    return tuple(args), kwargs


def leaf_type(x: Any):
    """The abstract value of a leaf, identical for a concrete array and a tracer of it."""
    return jax.typeof(x)


class Signature(NamedTuple):
    """What one traced program is for: the one notion of signature (``autoopt._jit._program``
    says where it is computed, and how)."""

    in_tree: Any
    statics: tuple
    nargs: int
    types: tuple  # one ShapedArray (or Python scalar type) a dynamic leaf
    # The trace context as jax.jit's own cache key has it: enable_x64 or a dtype-promotion mode
    # switched after a call changes the program, so it must find a new one.
    context: Any


def signature_key(dyn_leaves: Sequence[Any], in_tree, statics, nargs: int) -> Signature:
    return Signature(
        in_tree,
        strict_statics(statics),
        nargs,
        tuple(leaf_type(x) for x in dyn_leaves),
        _compat.trace_context(),
    )


# A function traced in place of the user's (equinox's route: ``_jit._equinox``) names its
# parameters as the user's function does, so the findings read the user's names, never the
# wrapper's own (``dynamic_args``): ``(positional parameter names, *args' name or None)``.
PARAM_NAMES = "__autoopt_param_names__"


def _param_names(fn: Callable) -> tuple[list[str], str | None]:
    given = getattr(fn, PARAM_NAMES, None)
    if given is not None:
        return list(given[0]), given[1]
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return [], None
    names, varargs = [], None
    for p in sig.parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
        elif p.kind == p.VAR_POSITIONAL:
            varargs = p.name
    return names, varargs


def leaf_names_and_args(
    fn: Callable, dyn_tree, statics, nargs: int
) -> tuple[tuple[str, ...], tuple]:
    """Readable name of each dynamic leaf (``"state['w']"``) and its top-level argument
    (position or keyword)."""
    names, varargs = _param_names(fn)
    static_pos = {i for i, _ in statics[0]} if statics else set()
    dyn_positions = [i for i in range(nargs) if i not in static_pos]
    paths, _ = tree_util.tree_flatten_with_path(dyn_tree)
    out_names, out_args = [], []
    for path, _leaf in paths:
        first, second, rest = path[0], path[1], path[2:]
        if first.idx == 0:  # positional
            pos = dyn_positions[second.idx]
            if pos < len(names):
                base = names[pos]
            else:
                base = f"{varargs or 'args'}[{pos - len(names)}]"
            arg: int | str = pos
        else:
            base = second.key
            arg = second.key
        out_names.append(base + tree_util.keystr(rest))
        out_args.append(arg)
    return tuple(out_names), tuple(out_args)


@dataclasses.dataclass(frozen=True)
class TracedProgram:
    """The user's function traced at one signature."""

    closed: ClosedJaxpr
    in_tree: Any
    out_tree: Any
    statics: tuple
    nargs: int
    in_leaf_names: tuple[str, ...]
    in_arg_of_leaf: tuple
    out_leaf_names: tuple[str, ...]
    # True when the program closes over tracers of an enclosing transformation; such a program
    # belongs to that trace only and must not be cached.
    captures_tracers: bool


def _bad_output(fn: Callable, out_tree, index: int, value: Any) -> TypeError:
    """As jax.jit's error for a non-array output (which JAX's own path crashes on when the
    function is traced to a flat jaxpr, as here), naming the output."""
    paths = tree_util.tree_flatten_with_path(
        tree_util.tree_unflatten(out_tree, [0] * out_tree.num_leaves)
    )[0]
    where = "output" + tree_util.keystr(paths[index][0])
    code = getattr(fn, "__code__", None)
    at = f" at {code.co_filename}:{code.co_firstlineno}" if code else ""
    return TypeError(
        f"function {getattr(fn, '__name__', fn)}{at} traced for jit returned a value of type "
        f"{type(value)} at {where}, which is not a valid JAX type. Return only arrays (and "
        "pytrees of them); compute non-array results outside the optimized function."
    )


def trace_program(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    static_argnums: Sequence[int] = (),
    static_argnames: Sequence[str] = (),
) -> TracedProgram:
    """Trace ``fn(*args, **kwargs)`` once. ``args`` may be concrete or tracers of an outer trace."""
    dyn_tree, statics = split_args(args, kwargs, static_argnums, static_argnames)
    leaves, in_tree = tree_util.tree_flatten(dyn_tree)
    nargs = len(args)
    out_tree_box: list[Any] = []

    def flat_fn(*flat):
        a, kw = merge_args(tree_util.tree_unflatten(in_tree, flat), statics, nargs)
        out = fn(*a, **kw)
        out_leaves, out_tree = tree_util.tree_flatten(out)
        for i, x in enumerate(out_leaves):
            if not valid_jaxtype(x):
                raise _bad_output(fn, out_tree, i, x)
        out_tree_box.append(out_tree)
        return out_leaves

    names, arg_of = leaf_names_and_args(fn, dyn_tree, statics, nargs)
    # JAX's errors raised while tracing (a tracer converted to bool, a shape mismatch) name the
    # function and argument of this debug info: the user's, as under jax.jit, not flat_fn's.
    dbg = _compat.jit_debug_info(fn, args, kwargs, static_argnums, static_argnames, names)
    closed = _compat.trace_closed_jaxpr(flat_fn, [leaf_type(x) for x in leaves], debug_info=dbg)
    out_tree = out_tree_box[-1]
    out_paths = tree_util.tree_flatten_with_path(
        tree_util.tree_unflatten(out_tree, [0] * out_tree.num_leaves)
    )[0]
    out_names = tuple("out" + tree_util.keystr(p) for p, _ in out_paths)
    captures = any(_compat.is_tracer(c) for c in closed.consts)
    return TracedProgram(
        closed, in_tree, out_tree, statics, nargs, names, arg_of, out_names, captures
    )
