"""One rule-table interpreter over ClosedJaxprs, and the walks every pass shares.

NB: the analogue in JAX is ``jax.core.eval_jaxpr`` (and autodidax's ``eval_jaxpr``): an ``env``,
``read``/``write``, one loop over equations. A pass supplies a table ``{primitive: rule}``; an
equation without a rule is re-bound unchanged, so unknown primitives pass through untouched.
Recursion into sub-jaxprs (jit/pjit, scan, while, cond, custom_jvp/custom_vjp, checkpoint,
closed_call) lives here and nowhere else; ``shard_map`` bodies are deliberately left alone
(their per-device shapes and collectives are the user's contract with SPMD).

Rewriting works by re-tracing (as Equinox's ``finalise_jaxpr`` does): the interpreter runs under
a fresh trace at the original avals, rules emit ordinary ``lax`` calls, and JAX builds and types
the new equations. Each equation is re-bound inside ``user_context`` of its own source info, so
what a rule emits keeps the user's file and line. A pass whose rules never fire costs one walk
over the equations and no re-trace.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import jax
import numpy as np
from jax.core import ShapedArray, eval_jaxpr
from jax.extend import source_info_util
from jax.extend.core import (
    AbstractToken,
    ClosedJaxpr,
    DropVar,
    Jaxpr,
    JaxprEqn,
    Literal,
    Primitive,
    check_jaxpr,
)

from autoopt import _compat

# A rule gets the equation and its input values (tracers of the re-trace, or Python/NumPy
# values for literals) and returns the output values, or None to decline (re-bind unchanged).
Rule = Callable[[JaxprEqn, Sequence[Any]], Sequence[Any] | None]

# Primitives whose bodies we never rewrite. shard_map's body is per-device code whose shapes
# and collectives are the user's contract with SPMD.
_OPAQUE_PRIMITIVES = frozenset({"shard_map", "pallas_call", "custom_partitioning"})


def user_location(eqn: JaxprEqn) -> str | None:
    """``"path.py:LINE"`` of the user's source that produced ``eqn``, or None."""
    frame = _compat.user_frame(eqn.source_info)
    return None if frame is None else f"{frame[0]}:{frame[1]}"


def shaped(atom: Any) -> ShapedArray:
    """``atom.aval`` for an array value. jax types ``Var.aval`` as the abstract base class; every
    value the passes read shapes of is an array (tokens and refs have no shape to read)."""
    return cast(ShapedArray, atom.aval)


# (a tuple, not ``ClosedJaxpr | Jaxpr``: every pass asks of every equation's parameters, and
# the union would be built again at each ask)
JAXPR_TYPES = (ClosedJaxpr, Jaxpr)


def subjaxprs(eqn: JaxprEqn) -> list[tuple[str, int | None, ClosedJaxpr | Jaxpr]]:
    """The sub-jaxprs held in ``eqn.params``: ``(param, index or None, jaxpr)``."""
    out = []
    for name, value in eqn.params.items():
        if isinstance(value, JAXPR_TYPES):
            out.append((name, None, value))
        elif (
            isinstance(value, tuple)
            and value
            and isinstance(value[0], JAXPR_TYPES)  # (most tuples are shapes: no generator)
            and all(isinstance(v, JAXPR_TYPES) for v in value)
        ):
            out.extend((name, i, v) for i, v in enumerate(value))
    return out


def _as_closed(j: ClosedJaxpr | Jaxpr) -> ClosedJaxpr:
    return j if isinstance(j, ClosedJaxpr) else ClosedJaxpr(j, ())


@dataclasses.dataclass(frozen=True)
class EqnSite:
    """An equation and where it sits: the chain of (primitive, param) it is nested in."""

    eqn: JaxprEqn
    path: tuple[tuple[str, str], ...]

    @property
    def in_loop(self) -> bool:
        return any(p in ("scan", "while") for p, _ in self.path)


def iter_eqns(
    jaxpr: ClosedJaxpr | Jaxpr, path: tuple = (), *, into_opaque: bool = False
) -> Iterator[EqnSite]:
    """Every equation of ``jaxpr`` and of all its sub-jaxprs, outermost first."""
    j = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    for eqn in j.eqns:
        yield EqnSite(eqn, path)
        if eqn.primitive.name in _OPAQUE_PRIMITIVES and not into_opaque:
            continue
        for name, _i, sub in subjaxprs(eqn):
            yield from iter_eqns(sub, path + ((eqn.primitive.name, name),), into_opaque=into_opaque)


def opaque_type(closed: ClosedJaxpr) -> str | None:
    """The first abstract value in ``closed`` that is neither an array (of any dtype, extended
    ones included) nor a token, as text, or None: a ``jax.Ref`` (mutable array, flax's
    ``hijax``/``ref`` Variables) or another hijax type. The passes reason about arrays only,
    and re-evaluating such a program loses the types' state: it must reach jit untouched."""

    def odd(v) -> str | None:
        aval = getattr(v, "aval", None)
        if aval is None or isinstance(aval, ShapedArray | AbstractToken):
            return None
        return str(aval)

    def walk(j: Jaxpr) -> str | None:
        for v in (*j.constvars, *j.invars, *j.outvars):
            if (why := odd(v)) is not None:
                return why
        for eqn in j.eqns:
            for v in (*eqn.invars, *eqn.outvars):
                if (why := odd(v)) is not None:
                    return why
            for _, _, sub in subjaxprs(eqn):
                if (why := walk(sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub)) is not None:
                    return why
        return None

    return walk(closed.jaxpr)


def opaque_input(leaves: Sequence[Any]) -> str | None:
    """The type of the first leaf whose abstract value is not an array (a flax ``hijax``
    Variable, a ``jax.Ref``), as text, or None. Such inputs cannot even be traced apart from
    jit (their state lives in the object): jit traces the user's function itself."""
    for x in leaves:
        if isinstance(x, np.ndarray | np.generic | int | float | complex | bool):
            continue
        try:
            aval = jax.typeof(x)
        except Exception:  # noqa: BLE001 - not a JAX value: jit's own error comes later
            continue
        if not isinstance(aval, ShapedArray | AbstractToken):
            return str(aval)
    return None


def const_ids(closed: ClosedJaxpr) -> frozenset[int]:
    """Identities of the jax arrays a program holds as constants, in every sub-jaxpr too.

    A function that reads a global array while it is traced captures that very object; an
    argument that is the same object must never be donated (the cached program reads it again).
    A typed PRNG key constant (the key object itself, in ``consts``) adds its data array
    (``_compat.key_base_array``: what ``jax.random.key_data`` of it returns, or the array
    ``jax.random.wrap_key_data`` wrapped), whose buffer is the key's.
    """
    closed_jaxprs = [closed] + [
        sub
        for site in iter_eqns(closed, into_opaque=True)
        for _name, _i, sub in subjaxprs(site.eqn)
        if isinstance(sub, ClosedJaxpr)
    ]
    ids: set[int] = set()
    for c in closed_jaxprs:
        for v in c.consts:
            if isinstance(v, jax.Array):
                ids.add(id(v))
                if type(v) is _compat.KEY_ARRAY:
                    ids.add(id(_compat.key_base_array(v)))
    return frozenset(ids)


def count_primitives(jaxpr: ClosedJaxpr | Jaxpr) -> dict[str, int]:
    counts: dict[str, int] = {}
    for site in iter_eqns(jaxpr):
        counts[site.eqn.primitive.name] = counts.get(site.eqn.primitive.name, 0) + 1
    return counts


class _State:
    __slots__ = ("changed",)

    def __init__(self) -> None:
        self.changed = False


def _bind(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    # NB: as jax.core.eval_jaxpr does in jax 0.10 (get_bind_params returns the params only).
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    out = eqn.primitive.bind(*invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


@contextlib.contextmanager
def at_source(eqn: JaxprEqn) -> Iterator[None]:
    """Trace what runs inside as ``eqn`` was traced: its user's file and line, its name stack
    and its context (so a rule's new equations keep the user's source)."""
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with (
        source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
        eqn.ctx.manager,
    ):
        yield


def rebind(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Re-bind ``eqn`` unchanged on ``invals`` in the current trace, at its own source."""
    with at_source(eqn):
        return _bind(eqn, invals)


def _rewritten_params(eqn: JaxprEqn, rules: Mapping[Primitive, Rule]) -> dict[str, Any] | None:
    """New params with every changed sub-jaxpr rewritten, or None when none changed."""
    return with_subjaxprs(eqn, lambda sub: rewrite(sub, rules)[0])


def with_subjaxprs(
    eqn: JaxprEqn, fn: Callable[[ClosedJaxpr], ClosedJaxpr]
) -> dict[str, Any] | None:
    """New params for ``eqn`` with each sub-jaxpr ``s`` replaced by ``fn(s)`` (``s`` itself, the
    very object, means unchanged), or None when none changed.

    The one recursion into sub-jaxprs: ``rewrite`` passes itself as ``fn``, remat its per-level
    planner. Opaque primitives (shard_map, ...) are left alone.
    """
    if eqn.primitive.name in _OPAQUE_PRIMITIVES:
        return None
    subs = subjaxprs(eqn)
    if not subs:
        return None
    params = dict(eqn.params)
    any_changed = False
    for name, idx, sub in subs:
        closed = _as_closed(sub)
        new_sub = fn(closed)
        if new_sub is closed:
            continue
        if isinstance(sub, Jaxpr):
            if new_sub.consts:
                # An open sub-jaxpr (checkpoint, shard_map) cannot take new constants without
                # changing the equation's arity: keep the original body.
                continue
            new_sub = new_sub.jaxpr
        any_changed = True
        set_subjaxpr(params, name, idx, new_sub)
    return params if any_changed else None


def set_subjaxpr(params: dict, name: str, idx: int | None, new_sub) -> None:
    """Put ``new_sub`` where ``subjaxprs`` found the old one: ``params[name]``, or its
    ``idx``-th element."""
    if idx is None:
        params[name] = new_sub
    else:
        seq = list(params[name])
        seq[idx] = new_sub
        params[name] = tuple(seq)


def initial_env(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> dict[Any, Any]:
    """Var -> value for a jaxpr's constants and inputs: where every evaluation loop starts."""
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    return env


def interpret(
    jaxpr: Jaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    rules: Mapping[Primitive, Rule],
    state: _State | None = None,
) -> list[Any]:
    """Evaluate ``jaxpr`` in the current trace, applying ``rules``.

    As ``jax.core.eval_jaxpr``, but each equation goes through ``rules`` first, and
    sub-jaxprs are rewritten with the same rules.
    """
    state = state or _State()
    env = initial_env(jaxpr, consts, args)

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    def write(v, val):
        if not isinstance(v, DropVar):
            env[v] = val

    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        new_params = _rewritten_params(eqn, rules)
        if new_params is not None:
            state.changed = True
            eqn = eqn.replace(params=new_params)
        with at_source(eqn):
            outs = None
            rule = rules.get(eqn.primitive)
            if rule is not None:
                outs = rule(eqn, invals)
            if outs is None:
                outs = _bind(eqn, invals)
            else:
                outs = list(outs)
                state.changed = True
        for v, val in zip(eqn.outvars, outs):
            write(v, val)
    return [read(v) for v in jaxpr.outvars]


def rewrite(closed: ClosedJaxpr, rules: Mapping[Primitive, Rule]) -> tuple[ClosedJaxpr, bool]:
    """Apply ``rules`` everywhere in ``closed``; returns ``(new_closed, changed)``.

    When nothing changes the original object is returned, so identity is a cheap "unchanged".
    """
    if not rules or not any(site.eqn.primitive in rules for site in iter_eqns(closed)):
        return closed, False
    state = _State()
    in_avals = [v.aval for v in closed.jaxpr.invars]

    def fn(*args):
        return interpret(closed.jaxpr, closed.consts, args, rules, state)

    new = _compat.trace_closed_jaxpr(fn, in_avals, name="autoopt.rewrite")
    if not state.changed:
        return closed, False
    return new, True


def eval_closed(closed: ClosedJaxpr, *args: Any) -> list[Any]:
    """Evaluate ``closed`` in the current trace (used to stage the optimized program into jit)."""
    return eval_jaxpr(closed.jaxpr, closed.consts, *args)


def stage_closed(closed: ClosedJaxpr, *args: Any) -> list[Any]:
    """Stage ``closed`` into the jit trace its arguments belong to: its equations copied as
    they are (``_compat.stage_jaxpr``), or bound again where the arguments are not all that
    trace's (``eval_closed``). jit's wrapper calls this once per traced signature."""
    outs = _compat.stage_jaxpr(closed.jaxpr, closed.consts, args)
    return outs if outs is not None else eval_closed(closed, *args)


def fingerprint(closed: ClosedJaxpr) -> str:
    """A SHA-256 of ``closed``'s structure: what its text (``str``) shows, read without the
    pretty-printer (which costs about half of tracing a training step).

    Every equation's primitive, operands (numbered per program, literals by value and type),
    result types and parameters, sub-programs walked in place; parameter values as the text
    prints them (an object's address masked, as jax's printer does). Not effects, which the
    text does not show either: the primitive, its parameters and its operands make them, and a
    ref's effect names its variable by address. Constants count by type, not value, as in the
    text. Stable across processes: it keys decisions kept on disk."""
    out: list[str] = []
    seen: dict[int, int] = {}
    names: dict[Any, int] = {}

    # (by id: the program keeps each alive while it is read; a dtype or a sharding recurs)
    avals: dict[int, str] = {}
    texts: dict[int, str] = {}

    def aval(v) -> str:
        a = v.aval
        text = avals.get(id(a))
        if text is None:
            text = avals[id(a)] = str(a)
        return text

    def atom(a) -> str:
        if isinstance(a, Literal):
            # a scalar: its Python value prints exactly and fast (NumPy's printer does not)
            val = a.val
            item = getattr(val, "item", None)
            return f"{(item() if item is not None and np.ndim(val) == 0 else val)!r}:{aval(a)}"
        n = names.get(a)
        if n is None:
            n = names[a] = len(names)
        return f"%{n}"

    def param(v) -> str:
        if isinstance(v, JAXPR_TYPES):
            return jaxpr(v.jaxpr if isinstance(v, ClosedJaxpr) else v)
        if type(v) is tuple and all(isinstance(e, JAXPR_TYPES) for e in v):
            return "(" + ",".join(map(param, v)) + ")"  # (any other tuple: as the text)
        text = texts.get(id(v))
        if text is not None:
            return text
        if isinstance(v, frozenset):
            text = f"frozenset({{{', '.join(repr(e) for e in sorted(v))}}})"
        else:
            text = str(v)
            if " at 0x" in text:
                text = _ADDRESS.sub(" at 0x", text)
        texts[id(v)] = text
        return text

    def jaxpr(j: Jaxpr) -> str:
        n = seen.get(id(j))
        if n is not None:
            return f"@{n}"
        n = seen[id(j)] = len(seen)
        # (constvars apart from invars, as the text's "lambda consts; args.": a closed-over
        # constant is not an argument)
        binders = (" ".join(f"{atom(v)}:{aval(v)}" for v in vs) for vs in (j.constvars, j.invars))
        out.append(f"{{{n} " + "; ".join(binders))
        for eqn in j.eqns:
            out.append(
                f"{eqn.primitive.name} {' '.join(map(atom, eqn.invars))} -> "
                + " ".join(f"{atom(v)}:{aval(v)}" for v in eqn.outvars)
            )
            for k, v in eqn.params.items():
                out.append(f" {k}={param(v)}")
        out.append("} " + " ".join(map(atom, j.outvars)))
        return f"@{n}"

    jaxpr(closed.jaxpr)
    return hashlib.sha256("\n".join(out).encode()).hexdigest()


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def check(closed: ClosedJaxpr) -> None:
    """Type-check ``closed`` (and its sub-jaxprs); raises ``JaxprTypeError`` on a bad rewrite."""
    check_jaxpr(closed.jaxpr)


def same_avals(a: ClosedJaxpr, b: ClosedJaxpr) -> bool:
    """True when two programs take and return values of the same types (a rewrite's contract)."""

    def strip(avals):
        return [
            (tuple(x.shape), x.dtype, getattr(x, "weak_type", False)) if hasattr(x, "shape") else x
            for x in avals
        ]

    return strip(a.in_avals) == strip(b.in_avals) and strip(a.out_avals) == strip(b.out_avals)
