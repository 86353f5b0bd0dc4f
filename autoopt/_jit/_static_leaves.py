"""Non-array leaves made static, as ``equinox.filter_jit`` does.

Equinox modules carry activation functions, flags and other Python objects as pytree leaves;
jax.jit refuses them. Each argument holding such leaves is passed as the same tree with those
leaves set to None, and a function per set of static leaves (``with_static_leaves``) puts them
back (and takes non-array leaves out of the output the same way).

The leaves are inspected before jax.jit is called (``split_if_static``), so a TypeError raised by
the user's own function is never mistaken for jax.jit refusing a leaf, and the function body
runs once per call as under jax.jit.

NB: the analogous code in Equinox is ``equinox._jit`` (``hashable_partition`` of the arguments
into dynamic and static parts, ``hashable_combine`` inside the traced function).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import numpy as np
from jax import tree_util

from autoopt import _compat, _trace

# The leaves jax.jit accepts as arguments. ``ShapeDtypeStruct`` is accepted by ``trace``/``lower``.
_ARRAY_LEAF_TYPES = (
    jax.Array,
    np.ndarray,
    np.generic,
    bool,
    int,
    float,
    complex,
    jax.ShapeDtypeStruct,
)
# Exact types checked first: ``isinstance(x, jax.Array)`` goes through an ABC check.
PLAIN_TYPES = frozenset({_compat.ARRAY_IMPL, int, float, bool, complex, np.ndarray})


def is_array_leaf(x: Any) -> bool:
    """A leaf jax.jit traces (everything else becomes static). The cheap tests first; the last
    asks jax itself, so a ``jax.Ref``, a token or a new extended type is never made static
    (a static leaf is a constant of its own program: a Ref baked in would be read at trace
    time, and a fresh token each call would compile a program each call)."""
    return (
        type(x) in PLAIN_TYPES
        or isinstance(x, _ARRAY_LEAF_TYPES)
        or hasattr(x, "__jax_array__")
        or _compat.jit_accepts_leaf(x)
    )


class StaticSplit(NamedTuple):
    """The arguments with their non-array leaves taken out. ``key`` (hashable) holds, for each
    argument that had some, ``(position or name, treedef, ((leaf index, leaf), ...))``."""

    key: tuple
    args: tuple
    kwargs: dict


def split_tree(where, value) -> tuple[Any, tuple | None]:
    """``(value with its non-array leaves set to None, (where, treedef, ((index, leaf), ...)))``;
    the second is None when every leaf is an array."""
    leaves, treedef = tree_util.tree_flatten(value)
    fixed = tuple((j, x) for j, x in enumerate(leaves) if not is_array_leaf(x))
    if not fixed:
        return value, None
    at = dict(fixed)
    return tree_util.tree_unflatten(
        treedef, [None if j in at else x for j, x in enumerate(leaves)]
    ), (where, treedef, fixed)


def put_back(part: tuple | None, value):
    """Inverse of ``split_tree``."""
    if part is None:
        return value
    _, treedef, fixed = part
    at, arrays = dict(fixed), iter(tree_util.tree_leaves(value))
    return tree_util.tree_unflatten(
        treedef, [at[j] if j in at else next(arrays) for j in range(treedef.num_leaves)]
    )


def split_if_static(
    args: tuple, kwargs: dict, static_argnums: tuple, static_argnames: tuple
) -> StaticSplit | None:
    """The split of a call whose dynamic arguments hold non-array leaves, else None.

    Every name bound here to an argument or a leaf is gone when this returns, so the reference
    counts the donation checks read afterwards are those of the calibrated call shape."""
    if not static_argnums and not static_argnames:
        for a in args:  # flat arrays and scalars: nothing to flatten
            if type(a) not in PLAIN_TYPES:
                break
        else:
            if not kwargs:
                return None
        dyn = (args, kwargs)
    else:
        dyn = _trace.split_args(args, kwargs, static_argnums, static_argnames)[0]
    for x in tree_util.tree_leaves(dyn):
        if not is_array_leaf(x):
            return _split(args, kwargs, static_argnums, static_argnames)
    return None


def _split(args: tuple, kwargs: dict, static_argnums, static_argnames) -> StaticSplit:
    static_pos = _trace.normalize_static(static_argnums, len(args))
    parts: list = []

    def split(where, value):
        dyn, part = split_tree(where, value)
        if part is not None:
            try:
                hash(part)
            except TypeError:
                bad = next(x for _, x in part[2] if not isinstance(x, Hashable))
                raise TypeError(
                    f"Argument {where!r} holds a {type(bad).__name__}, which is neither an array "
                    "nor hashable, so it can be neither traced nor made static. Make it hashable, "
                    "or pass the argument with static_argnums/static_argnames."
                ) from None
            parts.append(part)
        return dyn

    dyn_args = tuple(a if i in static_pos else split(i, a) for i, a in enumerate(args))
    dyn_kwargs = {k: v if k in static_argnames else split(k, v) for k, v in kwargs.items()}
    return StaticSplit(tuple(parts), dyn_args, dyn_kwargs)


def with_static_leaves(
    fn: Callable, key: tuple, static_argnums: tuple, static_argnames: tuple
) -> Callable:
    """``fn`` taking the arguments ``split_if_static`` made, with the static leaves put back.

    Its output's non-array leaves are kept in ``.output_parts``, keyed by the signature of the
    arguments (``_program.trace_signature``: ``jax.typeof`` of each leaf, the same for the
    tracers inside the trace and the concrete arguments after the call), for
    ``outputs_put_back``."""
    by_arg = {part[0]: part for part in key}
    output_parts: dict = {}

    @functools.wraps(fn)  # jax.jit reads the signature (static_argnames) through __wrapped__
    def with_static_leaves(*args, **kwargs):
        sig = _signature(args, kwargs, static_argnums, static_argnames)
        args = tuple(put_back(by_arg.get(i), a) for i, a in enumerate(args))
        out = fn(*args, **{k: put_back(by_arg.get(k), v) for k, v in kwargs.items()})
        out, part = split_tree("output", out)
        output_parts[sig] = part
        return out

    # functools.wraps' _Wrapped type declares no attributes of its own
    with_static_leaves.output_parts = output_parts  # pyright: ignore[reportAttributeAccessIssue]
    return with_static_leaves


def outputs_put_back(
    fn: Callable, split: StaticSplit, out, static_argnums: tuple, static_argnames: tuple
):
    """The output of ``fn`` (made by ``with_static_leaves``) with its non-array leaves back."""
    sig = _signature(split.args, split.kwargs, static_argnums, static_argnames)
    return put_back(fn.output_parts.get(sig), out)


def _signature(args: tuple, kwargs: dict, static_argnums, static_argnames):
    from autoopt._jit._program import trace_signature

    return trace_signature(args, kwargs, static_argnums, static_argnames)[0]
