"""Non-array leaves made static, as ``equinox.filter_jit`` does, when their value cannot change.

Equinox modules carry activation functions, flags and other Python objects as pytree leaves;
jax.jit refuses them. Each argument holding such leaves is passed as the same tree with those
leaves set to None, and a function per set of static leaves (``with_static_leaves``) puts them
back (and takes non-array leaves out of the output the same way).

A static leaf is a constant of its program: only a value that cannot change under the same
identity may be one (``immutable_leaf``: numbers, strings, None, enums, functions and partials of
such, frozen dataclasses and tuples of such, classes that cannot be changed: C types and jax/NumPy
scalar types, built-in functions bound to nothing, a module or such a value). Anything else (a
plain object, a list, a user's class, a bound method of one, ``d.get``, ``random.random``) could
change between two calls and the program would compute with its first state: it is refused as
jax.jit refuses it (``refusal``), with what to do instead.

The program of a set of static leaves is found again by autoopt's own key of each leaf
(``Static``, ``structural_key``: the exact type, a float's bits, frozen dataclasses' fields and
tuples' items, else identity), never by the leaf's own ``__eq__``/``__hash__``, for which
``2 == 2.0``, ``0.0 == -0.0`` and a class comparing a name only would share a program.

A non-array leaf of the output is handed back only when it is one of the call's own static leaves
passed through (each call gets its own); anything else is refused as jax.jit refuses it: a later
call runs no Python, so a value read at trace time would be stale.

The leaves are inspected before jax.jit is called (``split_if_static``), so a TypeError raised by
the user's own function is never mistaken for jax.jit refusing a leaf, and the function body
runs once per call as under jax.jit.

A repeating call at a call site under ``"safe"`` takes the plan its site keeps for the
arguments' signature (``StaticLeafPlan``, recorded by ``_dispatch.plan_static_leaves``): the
static leaves in that signature by ``Static`` too, so a new activation function, or a value
changed under the same identity, misses and takes the general path. Its run-time check
(``donated_unshared``) is also the one of ``eqx.filter_jit``'s plans (``_equinox``).

NB: the analogous code in Equinox is ``equinox._jit`` (``hashable_partition`` of the arguments
into dynamic and static parts, ``hashable_combine`` inside the traced function).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import operator
import struct
import sys
import types
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import numpy as np
from jax import tree_util

from autoopt import _compat, _trace
from autoopt._jit import _plans
from autoopt.passes.donation import callsite

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
PLAIN_TYPES = frozenset(
    {_compat.ARRAY_IMPL, _compat.KEY_ARRAY, int, float, bool, complex, np.ndarray}
)


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


# Values that cannot change under the same identity. Functions are taken as jax.jit takes a
# static function argument (by identity: its code and closure are the user's to keep fixed).
_IMMUTABLE_TYPES = (
    str,
    bytes,
    type(None),
    type(Ellipsis),
    range,
    enum.Enum,
    np.dtype,
    types.FunctionType,
    types.WrapperDescriptorType,
    types.MethodDescriptorType,
    np.ufunc,
    jax.Array,  # a concrete array nested in a partial or a frozen dataclass: immutable
    np.generic,
    bool,
    int,
    float,
    complex,
)
# Callable objects of these packages' own types (``jax.custom_jvp`` activations such as
# ``jax.nn.relu``, ``jax.jit`` wrappers such as ``jax.nn.gelu``, autoopt's own functions): what
# jax.jit takes as static function arguments.
_FUNCTION_MODULES = ("jax.", "jaxlib.", "autoopt.", "numpy.")


# ``type.__flags__`` bit of a class whose attributes cannot be set (Py_TPFLAGS_IMMUTABLETYPE:
# ``int``, ``np.float32``, every static C type).
_IMMUTABLE_TYPE_FLAG = 1 << 8
# Built-in functions and methods, bound (``d.get``, ``random.random``) or not (``len``).
_BUILTIN_CALLABLES = (types.BuiltinFunctionType, types.MethodWrapperType)


def _immutable_class(x: type) -> bool:
    """A class whose attributes cannot change: a C type marked immutable (``int``,
    ``np.float32``), a NumPy or ml_dtypes scalar type, or a jax scalar type (``jnp.float32``,
    whose metaclass is jax's). A
    user's class can be changed (``Config.gain = 0.5``): a static copy would keep its first
    state, so it is refused as jax.jit refuses it."""
    if x.__flags__ & _IMMUTABLE_TYPE_FLAG:
        return True
    if issubclass(x, np.generic) and (x.__module__ or "").startswith(("numpy", "ml_dtypes")):
        return True  # ``ml_dtypes.bfloat16``, ``jnp.bfloat16.dtype.type``: heap types
    return (type(x).__module__ or "").startswith(_FUNCTION_MODULES) and type(x) is not type


def immutable_leaf(x: Any, _depth: int = 0) -> bool:
    """``x`` may be a static leaf: its value cannot change while its identity stays the same."""
    if _depth > 16:
        return False
    if isinstance(x, type):
        return _immutable_class(x)
    if isinstance(x, _BUILTIN_CALLABLES):
        # ``len``, ``math.sin``: bound to nothing or to a module; ``d.get``, ``lst.__getitem__``,
        # ``random.random`` read their instance, which may change
        owner = getattr(x, "__self__", None)
        return (
            owner is None
            or isinstance(owner, types.ModuleType)
            or immutable_leaf(owner, _depth + 1)
        )
    if isinstance(x, _IMMUTABLE_TYPES):
        return True
    t = type(x)
    if t is object:  # a bare sentinel: it has no state to change
        return True
    if t is tuple or t is frozenset:
        return all(immutable_leaf(v, _depth + 1) for v in x)
    if t is slice:
        return all(immutable_leaf(v, _depth + 1) for v in (x.start, x.stop, x.step))
    if t is functools.partial:
        return (
            immutable_leaf(x.func, _depth + 1)
            and all(immutable_leaf(v, _depth + 1) for v in x.args)
            and all(immutable_leaf(v, _depth + 1) for v in x.keywords.values())
        )
    if t is types.MethodType:  # a bound method reads its instance, which may change
        return immutable_leaf(x.__self__, _depth + 1) and immutable_leaf(x.__func__, _depth + 1)
    if dataclasses.is_dataclass(x):
        params = getattr(t, "__dataclass_params__", None)
        return (
            bool(params is not None and params.frozen)
            and all(
                immutable_leaf(getattr(x, f.name, None), _depth + 1) for f in dataclasses.fields(x)
            )
            and not _has_instance_dict_extras(x)
        )
    if callable(x) and (t.__module__ or "").startswith(_FUNCTION_MODULES):
        return True
    return False


def _has_instance_dict_extras(x: Any) -> bool:
    """A frozen dataclass's instance holds attributes besides its fields (set through
    ``object.__setattr__``), which its equality and hash do not see."""
    d = getattr(x, "__dict__", None)
    if d is None:
        return False
    names = {f.name for f in dataclasses.fields(x)}
    return any(k not in names for k in d)


def refusal(where: Any, path: str, x: Any) -> TypeError:
    """jax.jit's refusal of a non-array leaf, saying what to do instead."""
    what = f"positional argument {where}" if isinstance(where, int) else f"argument {where!r}"
    at = what if path == "" else f"{what} at {path}"
    if where == "output":
        at = f"the output at {path}" if path else "the output"
        return TypeError(
            f"The function returned a {type(x).__name__} ({x!r:.60}) in {at}, which is not a "
            "valid JAX type: jax.jit refuses it too. A later call runs the compiled program, "
            "not the Python function, so autoopt hands back a non-array output only when it is "
            "one of the call's own static arguments passed through (an equinox model's "
            "activation function); this one is not, and it could differ on the next call. "
            "Return arrays, or pytrees of them (register the class with "
            "jax.tree_util.register_dataclass, or make it an equinox Module), and compute the "
            "other values outside the optimized function."
        )
    method_hint = (
        " For a decorated method whose instance holds no arrays, mark it static with "
        "static_argnums=0 (its hash then decides when to recompile)."
        if where == 0
        else ""
    )
    return TypeError(
        f"Error interpreting {at} as an abstract array: it is a {type(x).__name__} "
        f"({x!r:.60}), which is not a valid JAX type. jax.jit refuses it too. autoopt makes a "
        "non-array leaf static only when its value cannot change under the same identity "
        "(numbers, strings, None, enums, functions and partials, frozen dataclasses and tuples "
        "of such); this one can (its attributes or items may change between calls), and a "
        "static copy would compute with its first state forever. Pass its arrays as a pytree "
        "(jax.tree_util.register_dataclass, a NamedTuple, an equinox Module), make it a frozen "
        "dataclass, or mark the argument with static_argnums/static_argnames." + method_hint
    )


class StaticSplit(NamedTuple):
    """The arguments with their non-array leaves taken out. ``key`` (hashable) holds, for each
    argument that had some, ``(position or name, treedef, ((leaf index, leaf), ...))``."""

    key: tuple
    args: tuple
    kwargs: dict


class Static:
    """A static leaf in a ``StaticSplit.key``: compared and hashed by ``structural_key`` of its
    value, never by the value's own ``__eq__``/``__hash__`` (``Cfg(2) == Cfg(2.0)``,
    ``0.0 == -0.0``, a class comparing a name only: equal, yet they compute differently)."""

    __slots__ = ("value", "key", "_hash")

    def __init__(self, value: Any):
        self.value = value
        self.key = structural_key(value)
        self._hash = hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Static) and (self.value is other.value or self.key == other.key)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"Static({self.value!r:.60})"


def structural_key(x: Any, _depth: int = 0) -> Hashable:
    """A key equal for two values only when they compute the same: the exact type, a float's
    bits, the fields of a frozen dataclass and the items of a tuple recursively; any other value
    by identity (a function, an enum member, a class: as jax.jit keys a static function). Only
    for values ``immutable_leaf`` accepted (the identity stays valid while the key holds it)."""
    t = type(x)
    if t is float:
        return (t, struct.pack("<d", x))  # -0.0 and 0.0, NaN payloads
    if t is complex:
        return (t, struct.pack("<dd", x.real, x.imag))
    if t in (int, bool, str, bytes) or x is None:
        return (t, x)
    if _depth > 16:
        return ("id", id(x))
    if t is tuple or t is slice:
        items = x if t is tuple else (x.start, x.stop, x.step)
        return (t, tuple(structural_key(v, _depth + 1) for v in items))
    if t is frozenset:
        return (t, frozenset(structural_key(v, _depth + 1) for v in x))
    if t is range:
        return (t, x.start, x.stop, x.step)
    if isinstance(x, np.generic) and x.dtype.kind != "O":
        return ("np", t, x.dtype.str, x.tobytes())
    if isinstance(x, np.dtype):
        return ("dtype", x)
    if isinstance(x, types.MethodType):  # a new object on each attribute access
        return ("method", structural_key(x.__self__, _depth + 1), structural_key(x.__func__))
    if isinstance(x, _BUILTIN_CALLABLES) and not isinstance(
        getattr(x, "__self__", None), types.ModuleType | type(None)
    ):  # ``(2.0).__mul__``: a new object on each attribute access
        return ("builtin", structural_key(x.__self__, _depth + 1), x.__name__)
    if t is functools.partial and isinstance(x, functools.partial):
        return (
            t,
            structural_key(x.func, _depth + 1),
            structural_key(x.args, _depth + 1),
            tuple(sorted((k, structural_key(v, _depth + 1)) for k, v in x.keywords.items())),
        )
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (
            "dataclass",
            id(t),
            tuple(
                structural_key(getattr(x, f.name, None), _depth + 1) for f in dataclasses.fields(x)
            ),
            # attributes besides its fields (``immutable_leaf`` refuses such a value): never the
            # key of a value it accepted, so a cached plan never takes one
            _has_instance_dict_extras(x),
        )
    return ("id", id(x))


# What a traced Python flag or number raises when the function branches on it or uses it as a
# size (``if self.inference:``, ``range(self.depth)``).
_CONCRETE_ERRORS = (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError)
_EQX_NOTE = (
    "autoopt: an argument is an equinox Module. autoopt.optimize traces its Python bool and "
    "number fields as jax.jit does (a Dropout's or BatchNorm's `inference`), where "
    "eqx.filter_jit makes them static: decorate the function with eqx.filter_jit (which "
    "autoopt.patch() routes through autoopt), mark the field static (eqx.field(static=True)), "
    "or pass the flag as a static argument (static_argnames)."
)


def note_traced_module_fields(error: BaseException, args: tuple, kwargs: dict) -> None:
    """Add to a trace error from a traced flag (``_CONCRETE_ERRORS``) what to do when an
    argument holds an equinox Module (whose users expect eqx.filter_jit's static fields).
    Never raises; the error's type and message stay jax's."""
    eqx = sys.modules.get("equinox")
    if eqx is None or not isinstance(error, _CONCRETE_ERRORS):
        return
    try:
        if _EQX_NOTE in getattr(error, "__notes__", ()):
            return
        module = eqx.Module
        leaves = tree_util.tree_leaves((args, kwargs), is_leaf=lambda x: isinstance(x, module))
        if any(isinstance(x, module) for x in leaves):
            error.add_note(_EQX_NOTE)
    except Exception:  # noqa: BLE001 - a hint, never a second error
        pass


def split_tree(where, value) -> tuple[Any, tuple | None]:
    """``(value with its non-array leaves set to None, (where, treedef, ((index, Static), ...)))``;
    the second is None when every leaf is an array. A non-array leaf that may change under the
    same identity raises ``refusal``'s TypeError."""
    leaves, treedef = tree_util.tree_flatten(value)
    fixed = tuple((j, x) for j, x in enumerate(leaves) if not is_array_leaf(x))
    if not fixed:
        return value, None
    for j, x in fixed:
        if not immutable_leaf(x):
            raise refusal(where, _leaf_path(value, j), x)
    at = dict(fixed)
    return tree_util.tree_unflatten(
        treedef, [None if j in at else x for j, x in enumerate(leaves)]
    ), (where, treedef, tuple((j, Static(x)) for j, x in fixed))


def _leaf_path(value: Any, index: int) -> str:
    """The path of leaf ``index`` of ``value``, as jax.jit's errors write it (``['w']``)."""
    try:
        paths = tree_util.tree_flatten_with_path(value)[0]
        return tree_util.keystr(paths[index][0])
    except Exception:  # noqa: BLE001 - only for the message
        return f"leaf {index}"


def put_back(part: tuple | None, value):
    """Inverse of ``split_tree``."""
    if part is None:
        return value
    _, treedef, fixed = part
    at, arrays = {j: leaf.value for j, leaf in fixed}, iter(tree_util.tree_leaves(value))
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
            parts.append(part)
        return dyn

    dyn_args = tuple(a if i in static_pos else split(i, a) for i, a in enumerate(args))
    dyn_kwargs = {k: v if k in static_argnames else split(k, v) for k, v in kwargs.items()}
    return StaticSplit(tuple(parts), dyn_args, dyn_kwargs)


def with_static_leaves(
    fn: Callable, key: tuple, static_argnums: tuple, static_argnames: tuple
) -> Callable:
    """``fn`` taking the arguments ``split_if_static`` made, with the static leaves put back.

    A non-array leaf of its output must be one of the call's own static leaves passed through
    (an equinox model's activation function, returned in the updated model): it is recorded as
    where it came from, in ``.output_parts``, keyed by the signature of the arguments
    (``_program.trace_signature``: ``jax.typeof`` of each leaf, the same for the tracers inside
    the trace and the concrete arguments after the call), and ``outputs_put_back`` takes it from
    each later call's own arguments. Any other non-array output (a string read from a global, a
    new object) could differ on the next call, which runs no Python: it is refused as jax.jit
    refuses it."""
    by_arg = {part[0]: part for part in key}
    inputs = {id(leaf.value): (part[0], j) for part in key for j, leaf in part[2]}
    output_parts: dict = {}

    @functools.wraps(fn)  # jax.jit reads the signature (static_argnames) through __wrapped__
    def with_static_leaves(*args, **kwargs):
        sig = _signature(args, kwargs, static_argnums, static_argnames)
        args = tuple(put_back(by_arg.get(i), a) for i, a in enumerate(args))
        out = fn(*args, **{k: put_back(by_arg.get(k), v) for k, v in kwargs.items()})
        leaves, treedef = tree_util.tree_flatten(out)
        passed: list = []
        for j, x in enumerate(leaves):
            if is_array_leaf(x):
                continue
            source = inputs.get(id(x))
            if source is None:
                raise refusal("output", _leaf_path(out, j), x)
            passed.append((j, source))
        if not passed:
            output_parts[sig] = None
            return out
        at = dict(passed)
        output_parts[sig] = (treedef, at)
        return tree_util.tree_unflatten(
            treedef, [None if j in at else x for j, x in enumerate(leaves)]
        )

    # functools.wraps' _Wrapped type declares no attributes of its own
    with_static_leaves.output_parts = output_parts  # pyright: ignore[reportAttributeAccessIssue]
    # Which split it takes: ``Inspection.jit`` splits the user's arguments to this key.
    with_static_leaves.static_key = key  # pyright: ignore[reportAttributeAccessIssue]
    return with_static_leaves


def outputs_put_back(
    fn: Callable, split: StaticSplit, out, static_argnums: tuple, static_argnames: tuple
):
    """The output of ``fn`` (made by ``with_static_leaves``) with its non-array leaves back,
    each taken from this call's own static leaves (``split``) where the trace found it."""
    sig = _signature(split.args, split.kwargs, static_argnums, static_argnames)
    part = fn.output_parts.get(sig)
    if part is None:
        return out
    mine = {p[0]: dict(p[2]) for p in split.key}
    return _merged_output(part, out, lambda where, j: mine[where][j].value)


def _merged_output(part: tuple, out, static_leaf: Callable):
    """``out`` with the static leaves ``part`` (``output_parts``' entry) says it has put back,
    each ``static_leaf(argument, leaf index)`` of the call."""
    treedef, at = part
    arrays = iter(tree_util.tree_leaves(out))
    return tree_util.tree_unflatten(
        treedef,
        [static_leaf(*at[j]) if j in at else next(arrays) for j in range(treedef.num_leaves)],
    )


def _signature(args: tuple, kwargs: dict, static_argnums, static_argnames):
    from autoopt._jit._program import trace_signature

    return trace_signature(args, kwargs, static_argnums, static_argnames)[0]


# --- the reference check of a donated tree with static leaves ------------------------------------
#
# A cached plan's run-time check (``donated_unshared``), shared by the plans of a call's static
# leaves (``StaticLeafPlan``) and of ``eqx.filter_jit``'s route (``_equinox``): the reference
# counts of a donated argument and of every node and array inside it, with static leaves
# skipped (constants of the program, never buffers).

_ARRAY_IMPL = _compat.ARRAY_IMPL
_HOST_ARRAYS = (np.ndarray, np.generic)

_BUILTIN_NODES = (dict, list, tuple)
_getrefcount = sys.getrefcount
_object_getattribute = object.__getattribute__


@dataclasses.dataclass(frozen=True)
class _ModuleLayout:
    """An equinox Module type's fields as its flatten reads them from ``__dict__``."""

    dynamic: tuple[str, ...]  # the children, in order
    static: tuple[str, ...]  # node data
    nfields: int


# per type: its _ModuleLayout, or None (not an equinox Module, or one whose flatten did not
# match its fields: ``callsite.kid_refcounts`` reads it)
_LAYOUTS: dict[type, _ModuleLayout | None] = {}
# per kid type that is a pytree leaf: True if static (never donated, skipped), False if a host
# scalar or a leaf jax.jit accepts (the general path refuses the argument)
_STATIC_KIDS: dict[type, bool | None] = {}  # None: a pytree node
_UNKNOWN: Any = object()
_MODULE_KID_BASE = -1  # calibrated when the first Module's layout is read (``_layout_of``)


def _module_kids(d: dict, names: tuple) -> tuple[list, list]:
    """A Module's children (``None`` for a missing field, as equinox's ``MISSING``: no buffer)
    and their reference counts."""
    get = d.get
    kids = [get(n) for n in names]
    return kids, list(map(_getrefcount, kids))


def _calibrate_module_kids() -> int:
    """The count ``_module_kids`` reads for a child only its Module holds."""
    import equinox as eqx

    class Probe(eqx.Module):
        held: Any

    return min(
        _module_kids(_object_getattribute(Probe(object()), "__dict__"), ("held",))[1][0]
        for _ in range(3)
    )


def _layout_of(obj: Any) -> _ModuleLayout | None:
    global _MODULE_KID_BASE
    t = type(obj)
    if t in _LAYOUTS:
        return _LAYOUTS[t]
    layout = None
    eqx = sys.modules.get("equinox")
    if eqx is not None and isinstance(obj, eqx.Module) and dataclasses.is_dataclass(t):
        fields = dataclasses.fields(t)
        dynamic = tuple(f.name for f in fields if not f.metadata.get("static", False))
        static = tuple(f.name for f in fields if f.metadata.get("static", False))
        layout = _ModuleLayout(dynamic, static, len(dynamic) + len(static))
        if _MODULE_KID_BASE < 0:
            _MODULE_KID_BASE = _calibrate_module_kids()
        # Read as equinox's generated flatten reads them, or not at all.
        try:
            kids, _ = _compat.flatten_one_level(obj)
            d = _object_getattribute(obj, "__dict__")
            theirs = [None if type(k).__name__ == "_Missing" else k for k in kids]
            if len(theirs) != len(dynamic) or any(
                a is not d.get(n) for a, n in zip(theirs, dynamic)
            ):
                layout = None
        except Exception:  # noqa: BLE001 - an unreadable module: the registry path reads it
            layout = None
    _LAYOUTS[t] = layout
    return layout


def static_kid(kid: Any) -> bool | None:
    """True: a static leaf, skipped (equinox's split makes every leaf that is not an array
    static: a function, a Python scalar, a string; it reaches the program as a constant of its
    static argument, never as a buffer, so other references to it do not matter); False: a jax
    array of another type than jax's own (a tracer) or a NumPy array or scalar (transferred
    afresh by every call: ``callsite.leaf_problem`` refuses such an argument); None: a pytree
    node, walked. Each a fact about the kid's type (jax's registry, a NamedTuple's fields)."""
    t = type(kid)
    known = _STATIC_KIDS.get(t, _UNKNOWN)
    if known is not _UNKNOWN:
        return known
    if t in _BUILTIN_NODES or not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(kid)):
        kind = None
    else:
        kind = not isinstance(kid, (jax.Array, *_HOST_ARRAYS))
    _STATIC_KIDS[t] = kind
    return kind


def held_elsewhere(obj: Any, array_base: int, depth: int = 0) -> bool:
    """Whether a part of ``obj`` (whose own count was checked) may be read after the call: a
    node or array inside it also referenced from elsewhere, a deleted array, a leaf the general
    path refuses (``callsite.leaf_problem``'s rules, with ``check_refs``). ``array_base``: the
    count of an array nothing else holds, while the plan's leaf list holds one reference.
    An equinox Module's children are read from its ``__dict__`` (its flatten reads them there
    too, through the Module's ``__getattribute__``); other nodes through
    ``callsite.kid_refcounts``."""
    if depth > 64:
        return True
    t = type(obj)
    if t not in _BUILTIN_NODES and callsite.keeps_itself(t):
        return True  # its __del__ can keep it (and its arrays) after the call drops it
    if callsite.weakly_held(obj):
        return True  # (``callsite.WEAKLY_HELD``)
    layout = _LAYOUTS[t] if t in _LAYOUTS else _layout_of(obj)
    d = None
    if layout is not None:
        d = _object_getattribute(obj, "__dict__")
        if len(d) != layout.nfields:  # wrapper fields (``functools.wraps``): the registry path
            d = None
        else:
            for n in layout.static:  # a container of arrays held as node data
                v = d.get(n)
                if type(v) in _BUILTIN_NODES and any(
                    isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(v)
                ):
                    return True
    if d is not None:
        assert layout is not None
        kids, counts = _module_kids(d, layout.dynamic)
        base = _MODULE_KID_BASE
    else:
        if t not in _BUILTIN_NODES and getattr(t, "_autoopt_never_donate", False):
            return True  # an autoopt.constant: its device copy is every call's
        try:
            kids, counts, base = callsite.kid_refcounts(obj)
        except ValueError:  # a leaf: not something a donated argument may hold
            return True
    for kid, count in zip(kids, counts):
        if kid is None:
            continue
        if type(kid) is _ARRAY_IMPL:
            if count > base + array_base or callsite.weakly_held(kid) or kid.is_deleted():
                return True
            continue
        static = static_kid(kid)
        if static:
            continue
        if static is False or count > base or held_elsewhere(kid, array_base, depth + 1):
            return True
    return False


def donated_unshared(args: tuple, positions: tuple, base: int, array_base: int) -> bool:
    """Whether each donated argument (``positions``) is held by the call alone (``base``: its
    count when nothing else holds it), not deleted, and every node and array inside it by its
    parent alone (``held_elsewhere``): the rules of ``callsite.donation_checks`` with
    ``check_refs``, whose identity checks (an array passed twice, or inside another argument
    too) the counts cover, since each holder counts one more. ``array_base``: the references
    the caller's own lists of the leaves hold to each array (an argument that is an array
    included)."""
    for p in positions:
        # Counted before binding a local name, exactly as ``callsite._measure`` does.
        if type(args[p]) is _ARRAY_IMPL:
            if (
                _getrefcount(args[p]) > base + array_base
                or callsite.weakly_held(args[p])
                or args[p].is_deleted()
            ):
                return False
        elif (
            _getrefcount(args[p]) > base
            or static_kid(args[p]) is not None
            or held_elsewhere(args[p], array_base)
        ):
            return False
    return True


# --- a call site's plans for arguments with static leaves ----------------------------------------
#
# As ``_jit._plans`` for arrays only, and ``_equinox``'s plans for ``eqx.filter_jit``: a
# repeating call (``model, opt_state, loss = step(model, opt_state, x, y)`` with an equinox
# model holding its activation functions) finds the plan of its signature at its call site,
# which re-checks what the general path's decision left to run time, rebuilds the arguments
# with their static leaves taken out and runs the executable of the function for those leaves.

# The key, in a call site's plans (``Site.plans``), of the dict of its static-leaf plans by
# ``static_leaf_signature``: an object no signature equals, so the C call path, which looks up
# flat and nested signatures only, never finds it.
STATIC_LEAF_PLANS: Any = object()

_KEY_ARRAY = _compat.KEY_ARRAY
_ONLY_ARRAYS = {_ARRAY_IMPL}
_AVAL = operator.attrgetter("aval")
# Leaves read by type (Python scalars) or by shape and dtype (NumPy), as ``callsite``'s tree
# signature reads them: jax.jit traces them, so they are never static.
_SCALAR_TYPES = frozenset({int, float, bool, complex})


def static_leaf_signature(args: tuple) -> tuple[tuple, list] | None:
    """``(key, trees)`` of positional arguments some of which hold static leaves, or None when
    none does (the other plans' signatures read those: ``_plans.signature_of``).

    ``key``: per argument, a jax array's ``aval``, else ``(treedef, entries)``: each leaf's
    ``aval`` (jax arrays), ``_compat.key_entry`` (typed keys), type (Python scalars),
    ``(type, shape, dtype)`` (NumPy), else a ``Static`` of it (compared by ``structural_key``,
    never by the leaf's own ``__eq__``). ``trees``: per argument, ``(leaves, treedef, indices of
    its Static leaves)``, an array as ``([array], None, ())``: the lists hold one reference to
    every array of the arguments (``donated_unshared``'s ``array_base`` 1)."""
    key, trees = [], []
    found = False
    for i in range(len(args)):  # (no loop name bound to an argument: see split_if_static)
        if type(args[i]) is _ARRAY_IMPL:
            key.append(args[i].aval)
            trees.append(([args[i]], None, ()))
            continue
        leaves, treedef = tree_util.tree_flatten(args[i])
        if set(map(type, leaves)) <= _ONLY_ARRAYS:  # one C-level pass for a state of arrays
            key.append((treedef, tuple(map(_AVAL, leaves))))
            trees.append((leaves, treedef, ()))
            continue
        entries, static = [], []
        for j, x in enumerate(leaves):
            t = type(x)
            if t is _ARRAY_IMPL:
                entries.append(x.aval)
            elif t in _SCALAR_TYPES:
                entries.append(t)
            elif t is _KEY_ARRAY:
                entries.append(_compat.key_entry(x))
            elif isinstance(x, _HOST_ARRAYS):
                entries.append((t, x.shape, x.dtype))
            else:
                entries.append(Static(x))
                static.append(j)
        found = found or bool(static)
        key.append((treedef, tuple(entries)))
        trees.append((leaves, treedef, tuple(static)))
    return (tuple(key), trees) if found else None


class StaticLeafPlan:
    """A signature's plan at one call site, for arguments holding static leaves: the static half
    of the general path's decision (``_dispatch.plan_static_leaves``), kept.

    ``plan(args, trees) -> outputs`` (``trees``: ``static_leaf_signature``'s), or ``_plans.MISS``
    when a run-time check refuses. The checks are those of the general path for this signature:
    each donated argument, and every node and array inside it, held by the call alone (the
    reference counts of ``donated_unshared``, with static leaves skipped), nothing deleted, and
    ``jax_debug_nans``/``jax_debug_infs`` off; a plan donating nothing checks nothing. The
    signature fixed the rest (the static leaves by ``structural_key``, what each donated
    argument holds, the executable, what the output hands back)."""

    __slots__ = ("run", "positions", "base", "rebuilt", "recorded", "outputs")

    def __init__(self, run, positions: tuple, base: int, rebuilt: tuple, recorded, outputs):
        self.run = run  # ``_plans.kept``: the executable, through the placer when needed
        self.positions = positions  # the arguments donated
        self.base = base  # the reference count of an argument nothing else holds
        self.rebuilt = rebuilt  # the arguments holding static leaves
        # (``output_parts`` of the function for these leaves, the signature's key there, its
        # entry): a trace of the signature since (after ``jax.clear_caches()``) that recorded
        # another output makes the plan miss, as the general path reads the latest
        self.recorded = recorded
        # per output part holding static leaves: (its index in the output tuple, or None for the
        # whole output; its treedef; {leaf index: (argument, leaf index)})
        self.outputs = outputs

    def __call__(self, args: tuple, trees: list):
        if self.positions:
            if not donated_unshared(args, self.positions, self.base, 1):
                return _plans.MISS
            nans, infs = _DEBUG_STATES
            if nans.value or infs.value:  # jax re-runs the inputs op by op on a NaN
                return _plans.MISS
        parts, sig, part = self.recorded
        if parts.get(sig, _plans.MISS) is not part:
            return _plans.MISS
        dynamic = list(args)
        for i in self.rebuilt:
            leaves, treedef, static = trees[i]
            leaves = list(leaves)
            for j in static:
                leaves[j] = None
            dynamic[i] = tree_util.tree_unflatten(treedef, leaves)
        out = self.run(tuple(dynamic))
        if not self.outputs:
            return out

        def static_leaf(where, j):
            return trees[where][0][j]

        kids = list(out) if self.outputs[0][0] is not None else None
        for at, treedef, taken in self.outputs:
            if at is None:
                return _merged_output((treedef, taken), out, static_leaf)
            assert kids is not None
            kids[at] = _merged_output((treedef, taken), kids[at], static_leaf)
        return tuple(kids) if kids is not None else out


_DEBUG_STATES = _compat.DEBUG_NANS_STATES


def run_static_leaf_plan(plans: dict, args: tuple):
    """The output of the plan ``plans`` (a site's ``STATIC_LEAF_PLANS``) has for these
    arguments' signature, or ``_plans.MISS`` (none, or its checks refused)."""
    found = static_leaf_signature(args)
    if found is None:
        return _plans.MISS
    try:
        plan = plans.get(found[0])
    except Exception:  # noqa: BLE001 - unhashable node data: jax.jit's own call says so
        return _plans.MISS
    if plan is None:
        return _plans.MISS
    return plan(args, found[1])


def static_leaf_plan(
    split: StaticSplit, fn: Callable, run: Callable, positions: tuple, trees: list, base: int
) -> StaticLeafPlan | None:
    """The plan for a call split as ``split`` (of the same arguments as ``trees``), running
    ``run`` (the executable of ``fn``, the function for its static leaves) and donating
    ``positions``; None when the signature's static leaves are not those ``split`` took out (a
    leaf jax.jit traces that the signature does not read), or what the output hands back is not
    known (``with_static_leaves``' record of it)."""
    taken = {part[0]: tuple(j for j, _ in part[2]) for part in split.key}
    if any(taken.get(i, ()) != tree[2] for i, tree in enumerate(trees)):
        return None
    sig = _signature(split.args, split.kwargs, (), ())
    if sig not in fn.output_parts:
        return None
    part = fn.output_parts[sig]
    outputs: tuple = ()
    if part is not None:
        treedef, at = part
        outputs = ((None, treedef, at),)
        if treedef.node_data() is not None and treedef.node_data()[0] is tuple:
            # only the parts of an output tuple that hand back static leaves are rebuilt (the
            # updated model, not the optimizer state next to it)
            outputs, start = (), 0
            for k, kid in enumerate(tree_util.treedef_children(treedef)):
                n = kid.num_leaves
                mine = {j - start: at[j] for j in range(start, start + n) if j in at}
                if mine:
                    outputs += ((k, kid, mine),)
                start += n
    recorded = (fn.output_parts, sig, part)
    return StaticLeafPlan(run, positions, base, tuple(sorted(taken)), recorded, outputs)


def donatable_by_signature(tree: tuple) -> bool:
    """An argument (``static_leaf_signature``'s tree) whose leaves are jax arrays, at least
    one, and static leaves: a Python scalar, a NumPy leaf or a typed key inside it makes the
    general path refuse to donate it (``callsite.leaf_problem``), whatever the call."""
    leaves, _, static = tree
    arrays = sum(type(x) is _ARRAY_IMPL for x in leaves)
    return arrays > 0 and arrays + len(static) == len(leaves)


def holds_host_leaves(trees: list) -> bool:
    """Some argument (``static_leaf_signature``'s trees) holds a NumPy array or scalar: the
    placer puts it on the device (``_dispatch.remember_fast`` keeps the placer for them)."""
    return any(isinstance(x, _HOST_ARRAYS) for leaves, _, _ in trees for x in leaves)
