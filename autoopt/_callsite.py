"""Which arguments a call site proves dead: the statement rebinds the very names it passed.

``state = step(state, batch)`` proves ``state`` dead after the call (the name is rebound before
any other statement runs); ``new = step(state, batch)`` proves nothing. The proof is syntactic
and per call site, so it is computed once per ``(code object, instruction offset)`` and the
cached call path pays one dict lookup. Object-level aliasing (``old = state`` earlier, or the
same array inside two arguments) is not visible in the syntax; ``donation_checks`` rules it out
at run time with reference counts and identities.

NB: ``executing`` (the package behind ``icecream`` and ``stack_data``) maps a frame's current
instruction to the AST node being evaluated.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from typing import Any

import executing
import jax
import numpy as np

from autoopt._compat import flatten_one_level, is_tracer


@dataclasses.dataclass(frozen=True)
class CallSiteProof:
    """What one call site proves. ``positions``/``names``: arguments passed as a plain name that
    the statement rebinds. ``reasons``: for each other argument, why it is not proven dead."""

    positions: tuple[int, ...] = ()
    names: tuple[str, ...] = ()
    reasons: tuple[tuple[Any, str], ...] = ()
    location: str | None = None
    statement: str | None = None

    @property
    def any(self) -> bool:
        return bool(self.positions or self.names)


NO_PROOF = CallSiteProof()


def _target_names(target: ast.AST) -> set[str]:
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, ast.Tuple | ast.List):
        out: set[str] = set()
        for elt in target.elts:
            out |= _target_names(elt.value if isinstance(elt, ast.Starred) else elt)
        return out
    return set()  # attribute, subscript: not a plain rebinding


def _later_uses(stmt: ast.stmt, name: str) -> list[int]:
    """Lines after ``stmt`` in its enclosing scope where ``name`` is read (for the report)."""
    scope = stmt
    while getattr(scope, "parent", None) is not None and not isinstance(
        scope, ast.FunctionDef | ast.AsyncFunctionDef | ast.Module | ast.Lambda
    ):
        scope = scope.parent
    end = getattr(stmt, "end_lineno", stmt.lineno)
    lines = sorted(
        {n.lineno for n in ast.walk(scope)
         if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load) and n.lineno > end}
    )
    return lines


def prove_call_site(frame) -> CallSiteProof:
    """Analyse the statement that is calling us from ``frame``. Never raises."""
    try:
        ex = executing.Source.executing(frame)
        node = ex.node
    except Exception:  # noqa: BLE001 - no source (REPL, exec), or executing cannot tell
        node = None
    loc = f"{frame.f_code.co_filename}:{frame.f_lineno}"
    if not isinstance(node, ast.Call):
        return CallSiteProof(location=loc, reasons=(("*", "the call site could not be read (no source, "
                                                     "or the call is not a plain call expression)"),))
    parent = getattr(node, "parent", None)
    targets: set[str] = set()
    if isinstance(parent, ast.Assign) and parent.value is node:
        for t in parent.targets:
            targets |= _target_names(t)
    elif isinstance(parent, ast.AnnAssign) and parent.value is node:
        targets = _target_names(parent.target)
    stmt = parent if isinstance(parent, ast.stmt) else None
    try:
        text = ast.unparse(stmt if stmt is not None else node)
    except Exception:  # noqa: BLE001
        text = None

    positions, names, reasons = [], [], []

    def judge(key, expr: ast.AST):
        if not isinstance(expr, ast.Name):
            return f"it is passed as an expression (`{ast.unparse(expr)}`), not a plain name"
        if expr.id in targets:
            return None
        if not targets:
            what = "not assigned" if stmt is None else "assigned to something other than plain names"
            msg = f"the call's result is {what}, so `{expr.id}` may be used later"
        else:
            msg = f"the statement rebinds {', '.join(sorted(targets))}, not `{expr.id}`"
        if stmt is not None:
            uses = _later_uses(stmt, expr.id)
            if uses:
                msg = f"`{expr.id}` is used again on line {uses[0]} ({msg})"
        return msg

    for i, a in enumerate(node.args):
        if isinstance(a, ast.Starred):
            reasons.append((i, "arguments from `*` unpacking cannot be proven dead"))
            break
        why = judge(i, a)
        if why is None:
            positions.append(i)
        else:
            reasons.append((i, why))
    for kw in node.keywords:
        if kw.arg is None:
            reasons.append(("**", "arguments from `**` unpacking cannot be proven dead"))
            continue
        why = judge(kw.arg, kw.value)
        if why is None:
            names.append(kw.arg)
        else:
            reasons.append((kw.arg, why))
    return CallSiteProof(tuple(positions), tuple(names), tuple(reasons), loc, text)


# --- run-time checks -------------------------------------------------------------------------
# Reference-count baselines are measured, not assumed: CPython versions differ in how many
# references a call holds (the caller's stack, the *args tuple, the **kwargs dict). We measure
# them once through the same call shape the real path uses.


class _Probe:
    def __call__(self, *args, **kwargs):
        return _measure(args, kwargs)


def _measure(args, kwargs):
    return sys.getrefcount(args[0]), (sys.getrefcount(kwargs["k"]) if "k" in kwargs else None)


def _calibrate() -> tuple[int, int, int]:
    """Baselines for (positional arg, no keywords), (positional arg, with keywords), (keyword arg).

    A call with keywords holds one more transient reference per argument in CPython 3.11, so the
    two shapes get their own baseline. A call shape we did not calibrate (``functools.partial``
    for a decorated method) holds more references, which only makes the check refuse: safe.
    """
    probe = _Probe()

    def positional_only():
        x = object()
        return probe(x)

    def with_keywords():
        x = object()
        y = object()
        return probe(x, k=y)

    pos_only = min(positional_only()[0] for _ in range(3))
    with_kw = [with_keywords() for _ in range(3)]
    return pos_only, min(c[0] for c in with_kw), min(c[1] for c in with_kw)


_BASE_POS, _BASE_POS_KW, _BASE_KW = _calibrate()


def _kid_refcounts(obj) -> tuple[bool, list, list[int]]:
    kids, _ = flatten_one_level(obj)
    return kids is obj, list(kids), [sys.getrefcount(c) for c in kids]


def _calibrate_kids() -> tuple[int, int]:
    same, _, counts_same = _kid_refcounts([object()])
    new, _, counts_new = _kid_refcounts({"a": object()})
    assert same and not new
    # ``list(kids)`` in _kid_refcounts adds one reference to each child in both cases.
    return counts_same[0], counts_new[0]


_BASE_KID_SAME, _BASE_KID_NEW = _calibrate_kids()


# The concrete array type jax returns from every computation: checked with ``type(x) is`` first,
# because ``isinstance(x, jax.Array)`` goes through an ABC check (~0.5 us a leaf).
_ARRAY_IMPL = type(jax.numpy.zeros(()))
_HOST_SCALARS = (np.ndarray, np.generic, int, float, complex, bool)
_NO_ARRAYS = (int, float, complex, bool, str, type(None))


def _leaf_problem(obj, seen: set[int], check_refs: bool = True) -> str | None:
    """Why the pytree ``obj`` (whose own refcount was checked) cannot be donated, or None.

    ``check_refs=False`` (``donate="auto"``: the caller promised not to reuse the argument)
    skips the reference counts of the parts but keeps every other check."""
    if type(obj) is _ARRAY_IMPL or (isinstance(obj, jax.Array) and not is_tracer(obj)):
        if obj.is_deleted():
            return "it was already deleted (donated earlier)"
        if id(obj) in seen:
            return "the same array appears twice in the arguments"
        seen.add(id(obj))
        return None
    if isinstance(obj, jax.Array):
        return "it is traced by an enclosing transformation"
    if getattr(type(obj), "_autoopt_never_donate", False):
        return "it holds an autoopt.constant, whose device copy every call shares"
    if isinstance(obj, _HOST_SCALARS):
        return ("it holds a NumPy array or Python scalar; jax copies those to the device "
                "on every call, so donating saves nothing")
    try:
        same, kids, counts = _kid_refcounts(obj)
    except ValueError:
        return f"it holds a leaf of type {type(obj).__name__} that is not a jax.Array"
    base = _BASE_KID_SAME if same else _BASE_KID_NEW
    for kid, count in zip(kids, counts):
        if check_refs and count > base:
            return "a part of it is also referenced from elsewhere"
        why = _leaf_problem(kid, seen, check_refs)
        if why is not None:
            return why
    return None


def _add_leaf_ids(value, seen: set[int]) -> None:
    """Record the identity of every array in ``value`` (fast paths for the common leaves)."""
    if type(value) is _ARRAY_IMPL:
        seen.add(id(value))
    elif not isinstance(value, _NO_ARRAYS):
        seen.update(map(id, jax.tree_util.tree_leaves(value)))


def donation_checks(args: tuple, kwargs: dict, positions, names, *, check_refs: bool):
    """Filter the candidate arguments down to those safe to donate now.

    Returns ``(positions, names, reasons)``. ``check_refs`` is the ``"safe"`` policy's proof that
    no other reference exists; ``"auto"`` skips it (the caller promised). Never raises.
    """
    ok_pos, ok_names, reasons = [], [], []
    seen: set[int] = set()
    base_pos = _BASE_POS_KW if kwargs else _BASE_POS
    # Identities of every array in the non-candidate arguments: donating a buffer that is also
    # passed elsewhere would delete an input the program still reads.
    candidates = set(positions) | set(names)
    if len(candidates) < len(args) + len(kwargs):
        for i, a in enumerate(args):
            if i not in candidates:
                _add_leaf_ids(a, seen)
        for k, v in kwargs.items():
            if k not in candidates:
                _add_leaf_ids(v, seen)
    for key in positions:
        if key >= len(args):
            continue
        # Measured before binding a local name, exactly as ``_measure`` does.
        if check_refs and sys.getrefcount(args[key]) > base_pos:
            reasons.append((key, "another reference to the same object exists"))
            continue
        why = _leaf_problem(args[key], seen, check_refs)
        if why is None:
            ok_pos.append(key)
        else:
            reasons.append((key, why))
    for key in names:
        if key not in kwargs:
            continue
        if check_refs and sys.getrefcount(kwargs[key]) > _BASE_KW:
            reasons.append((key, "another reference to the same object exists"))
            continue
        why = _leaf_problem(kwargs[key], seen, check_refs)
        if why is None:
            ok_names.append(key)
        else:
            reasons.append((key, why))
    return tuple(ok_pos), tuple(ok_names), tuple(reasons)
