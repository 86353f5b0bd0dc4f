"""Whether rewriting one floating-point scatter/gather could change rounding from ``jax.jit``'s.

XLA:CPU contracts a multiply feeding an add into a fused multiply-add (one rounding instead of
two) when both sit in one fusion. The rewrites of ``_pass`` move fusion boundaries: a
``lax.cond`` guard (a conditional is a computation of its own) separates a window read from the
arithmetic around it, which jax.jit's gather had fused (measured: 1 ulp on some elements of
``(x * y)[i + jnp.arange(4)] + z``); and a ``dynamic_update_slice`` fuses where XLA:CPU's scatter
does not, so a combiner (``DS(x) + u``) or the written window contracts with arithmetic that
produced the operand or the update, or that consumes the result (measured: ``(x * y).at[i].add(u
* v)`` with a proven ``i``, the transposes of window reads under ``jax.grad``).

The rule, conservative: a value "meets arithmetic" when, looking through data movement
(reshapes, slices, selects, converts, ...) and calls that XLA inlines (``jit``, ``custom_jvp``,
``checkpoint``), it is produced or consumed by any floating-point operation other than data
movement; a parameter, a constant, a loop carry or a branch's operand is a fusion boundary
already (not the carry of an unrolled scan, whose iterations fuse), and whatever the walk cannot
follow counts as arithmetic. A program called inside another trace is inlined there, where its
parameters are no boundaries: it runs unrewritten (``_jit``'s nested route).

- a window read is refused when its operand and its result both meet arithmetic (a
  contraction needs a multiply on one side and an add on the other): under a ``cond`` guard
  for the boundary; unguarded too, because a ``dynamic_slice`` was measured to fuse otherwise
  than the gather in the backward pass (the transposes around it);
- a write with no arithmetic combiner (``.set``, ``.min``, ``.max``: they only choose values)
  when its operand or update meets arithmetic and so does its result;
- a write with an arithmetic combiner (``.add``, ``.multiply``, ``.apply``) when any of them
  does (the combiner is the add or the multiply of a contraction).

Integer, boolean and key windows never round.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Var

from autoopt import _jaxpr

# Primitives that only move or select values: a multiply and an add on either side can meet
# through them in one fusion, so the walk continues through them.
_MOVES = frozenset(
    {
        "reshape",
        "broadcast_in_dim",
        "squeeze",
        "expand_dims",
        "transpose",
        "slice",
        "dynamic_slice",
        "dynamic_update_slice",
        "gather",
        "scatter",
        "concatenate",
        "pad",
        "select_n",
        "convert_element_type",
        "copy",
        "copy_p",
        "rev",
        "optimization_barrier",
        "reduce_precision",
        "device_put",
        # min and max only choose one of their operands, exactly: a multiply before one and an
        # add after it are never contracted across it, so the walk looks through it.
        "max",
        "min",
    }
)
# Calls XLA inlines: their bodies are one fusion region with the caller.
_INLINED = frozenset(
    {
        "pjit",
        "jit",
        "closed_call",
        "core_call",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "checkpoint",
        "remat",
        "remat2",
        "custom_lin",
    }
)
# Control flow whose bodies are computations of their own: a fusion boundary.
_BOUNDARY = frozenset({"cond", "while", "scan"})

_LIMIT = 400  # nodes visited per question; past it the answer is "meets arithmetic"

_BOUND = ("boundary",)
_UNKNOWN = ("unknown",)


def _floating(atom: Any) -> bool:
    aval = getattr(atom, "aval", None)
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        return False
    try:
        # jax's issubdtype: numpy's counts bfloat16 and the float8 types as no inexact type
        return bool(jnp.issubdtype(dtype, np.inexact))
    except TypeError:  # an extended dtype (PRNG keys)
        return False


def _unrolled(eqn: JaxprEqn) -> bool:
    """A scan whose iterations XLA sees side by side: unrolled (``unroll`` > 1; ``True`` is the
    length), or of one iteration (XLA inlines a loop that runs once). Its carry is no boundary:
    one iteration's multiply meets the next one's add, and the first and last meet the code
    around the loop."""
    if eqn.primitive.name != "scan":
        return False
    unroll, length = eqn.params.get("unroll", 1), eqn.params.get("length", 2)
    return unroll is True or int(unroll) > 1 or int(length) <= 1


def _moves(eqn: JaxprEqn) -> bool:
    """``eqn`` only moves or selects values (a ``.set`` scatter, not ``.apply``'s)."""
    if eqn.primitive.name == "scatter":
        return eqn.params.get("update_jaxpr") is None
    if eqn.primitive.name in ("scatter-min", "scatter-max"):
        return True  # ``.min``/``.max`` choose values, as ``min``/``max`` do
    return eqn.primitive.name in _MOVES


def _visit(atom: Any) -> Iterator[tuple[Var | None, list]]:
    """Each ``Var`` reached from ``atom`` once, with the work list the caller adds the next ones
    to; ``(None, ...)`` once ``_LIMIT`` are visited, where the walk ends (each question then
    answers its cautious side)."""
    seen: set = set()
    todo = [atom]
    while todo:
        a = todo.pop()
        if not isinstance(a, Var) or id(a) in seen:
            continue
        seen.add(id(a))
        if len(seen) > _LIMIT:
            yield None, todo
            return
        yield a, todo


def _operands_of(eqn: JaxprEqn, param: str) -> list:
    """The operands outside that a body's first parameters are, as many as are the same value
    every time the body runs: a branch's operands, a loop's constants."""
    name, p = eqn.primitive.name, eqn.params
    if name == "cond":
        return list(eqn.invars[1:])
    if name == "while":
        nc, nb = p.get("cond_nconsts", 0), p.get("body_nconsts", 0)
        if param == "cond_jaxpr":
            return list(eqn.invars[:nc])
        if param == "body_jaxpr":
            return list(eqn.invars[nc : nc + nb])
    if name == "scan":
        return list(eqn.invars[: p.get("num_consts", 0)])
    return []


class Graph:
    """Producers and consumers of every ``Var`` of a program, calls inlined."""

    def __init__(self, closed: ClosedJaxpr) -> None:
        self.prod: dict[Var, tuple] = {}
        self.uses: dict[Var, list[tuple]] = {}
        # For ``_runtime``: the equation making each value (control flow's too), the values
        # known only at run time (the program's parameters, loop bodies' carries), and a
        # branch's parameters' operands outside.
        self.made_by: dict[Var, JaxprEqn] = {}
        self.params: set[Var] = set()
        self.outside: dict[Var, Any] = {}
        j = closed.jaxpr
        for v in (*j.invars, *j.constvars):
            self.prod[v] = _BOUND
        self.params.update(j.invars)
        self._walk(j, top=True)
        for v in j.outvars:
            if isinstance(v, Var):
                self.uses.setdefault(v, []).append(_BOUND)

    def _use(self, v: Any, what: tuple) -> None:
        if isinstance(v, Var):
            self.uses.setdefault(v, []).append(what)

    def _walk(self, j: Jaxpr, top: bool) -> None:
        for eqn in j.eqns:
            name = eqn.primitive.name
            # A scatter's ``update_jaxpr`` is its combiner, not a body: the scatter is one eqn
            # (``_moves`` says whether it computes).
            subs = () if name.startswith("scatter") else _jaxpr.subjaxprs(eqn)
            for v in eqn.outvars:
                if isinstance(v, Var):
                    self.made_by[v] = eqn
            if not subs:
                for v in eqn.invars:
                    self._use(v, ("eqn", eqn))
                for v in eqn.outvars:
                    self.prod[v] = ("eqn", eqn)
                continue
            if name in _INLINED and len(subs) >= 1:
                sub = subs[0][2]
                inner = sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub
                if len(inner.invars) == len(eqn.invars) and len(inner.outvars) == len(eqn.outvars):
                    for outer, v in zip(eqn.invars, inner.invars):
                        self._use(outer, ("alias", v))
                        self.prod[v] = ("alias", outer) if isinstance(outer, Var) else _BOUND
                    for v in inner.constvars:
                        self.prod[v] = _BOUND
                    self._walk(inner, top=False)
                    for v, outer in zip(inner.outvars, eqn.outvars):
                        self._use(v, ("alias", outer))
                        self.prod[outer] = ("alias", v) if isinstance(v, Var) else _BOUND
                    # The other sub-jaxprs (a custom rule's) are walked as opaque bodies.
                    for _, _, other in subs[1:]:
                        self._opaque(other)
                    continue
            # XLA inlines a conditional whose branch index it knows when it compiles (a flag
            # bound at trace time, ``lax.cond(True, ...)``): no boundary then.
            inlined = name == "cond" and not self._runtime(eqn.invars[0])
            bound = name in _BOUNDARY and not _unrolled(eqn) and not inlined
            what = _BOUND if bound else _UNKNOWN
            for v in eqn.invars:
                self._use(v, what)
            for v in eqn.outvars:
                self.prod[v] = what
            for param, _, sub in subs:
                inner = sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub
                outer = _operands_of(eqn, param)
                self.outside.update(zip(inner.invars, outer))
                self.params.update(inner.invars[len(outer) :])  # a loop's carry and slices
                self._body(sub, what)

    def _body(self, sub, what: tuple) -> None:
        inner = sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub
        for v in (*inner.invars, *inner.constvars):
            self.prod[v] = what
        self._walk(inner, top=False)
        for v in inner.outvars:
            self._use(v, what)

    def _opaque(self, sub) -> None:
        self._body(sub, _UNKNOWN)

    def _runtime(self, atom: Any) -> bool:
        """XLA cannot know ``atom`` when it compiles: it depends on a parameter of the program
        or a loop's carry. Constants, literals and what the walk cannot follow (past its limit)
        count as known, so that a conditional on them is no boundary (the cautious side)."""
        for a, todo in _visit(atom):
            if a is None:
                return False
            if a in self.params:
                return True
            if a in self.outside:
                todo.append(self.outside[a])
                continue
            p = self.prod.get(a)
            if p is not None and p[0] == "alias":
                todo.append(p[1])
                continue
            eqn = self.made_by.get(a)
            if eqn is not None:
                todo.extend(eqn.invars)
        return False

    # --- questions ----------------------------------------------------------------------------

    def upstream_arith(self, atom: Any) -> bool:
        """``atom`` is (through data movement) computed by floating-point arithmetic."""
        for a, todo in _visit(atom):
            if a is None:
                return True
            p = self.prod.get(a, _UNKNOWN)
            if p is _BOUND:
                continue
            if p is _UNKNOWN:
                if _floating(a):
                    return True
                continue
            if p[0] == "alias":
                todo.append(p[1])
                continue
            eqn: JaxprEqn = p[1]
            if _moves(eqn):
                todo.extend(v for v in eqn.invars if _floating(v))
                continue
            return True
        return False

    def downstream_arith(self, atom: Any) -> bool:
        """``atom`` is (through data movement) consumed by floating-point arithmetic."""
        for a, todo in _visit(atom):
            if a is None:
                return True
            for u in self.uses.get(a, ()):
                if u is _BOUND:
                    continue
                if u is _UNKNOWN:
                    return True
                if u[0] == "alias":
                    todo.append(u[1])
                    continue
                eqn: JaxprEqn = u[1]
                if _moves(eqn):
                    todo.extend(v for v in eqn.outvars if _floating(v))
                    continue
                if any(_floating(v) for v in eqn.outvars):
                    return True
        return False


def floating_window(eqn: JaxprEqn) -> bool:
    """The scatter/gather moves floating-point (or complex) values."""
    return _floating(eqn.invars[0])


def read_risk(graph: Graph, eqn: JaxprEqn) -> bool:
    """Rewriting the read ``eqn`` (a gather) could change rounding."""
    if not floating_window(eqn):
        return False
    return graph.upstream_arith(eqn.invars[0]) and graph.downstream_arith(eqn.outvars[0])


def write_risk(graph: Graph, eqn: JaxprEqn, combined: bool) -> bool:
    """Rewriting the scatter ``eqn`` (``combined``: with an arithmetic combiner) could change
    rounding."""
    if not floating_window(eqn):
        return False
    up = graph.upstream_arith(eqn.invars[0]) or graph.upstream_arith(eqn.invars[2])
    if combined:
        return up or graph.downstream_arith(eqn.outvars[0])
    return up and graph.downstream_arith(eqn.outvars[0])
