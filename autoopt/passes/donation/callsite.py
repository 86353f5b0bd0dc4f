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
import inspect
import sys
from typing import Any

import executing
import jax
import numpy as np

from autoopt._compat import ARRAY_IMPL, debug_nans_enabled, flatten_one_level, is_tracer


@dataclasses.dataclass(frozen=True)
class CallSiteProof:
    """What one call site proves. ``positions``/``names``: arguments passed as a plain name that
    the statement rebinds. ``reasons``: for each other argument, why it is not proven dead."""

    positions: tuple[int, ...] = ()
    names: tuple[str, ...] = ()
    reasons: tuple[tuple[Any, str], ...] = ()
    location: str | None = None
    statement: str | None = None
    # The call's shape as written, which every call must match for the positions to mean the
    # arguments the function receives (a ``functools.partial`` in between shifts them): the
    # number of positional arguments (None after ``*``), the keyword names (None after ``**``).
    n_positional: int | None = None
    keywords: frozenset[str] | None = None
    # ``a, b = f(x)``: the number of targets, so the result's tree can be checked before
    # donating (a failed unpacking would leave ``x`` bound to the donated array).
    unpack: int | None = None

    @property
    def any(self) -> bool:
        return bool(self.positions or self.names)

    def matches(self, args: tuple, kwargs: dict, shift: int = 0) -> bool:
        """This call passes what the statement wrote; ``shift``: arguments in front of what the
        statement wrote (1 for a decorated method's instance)."""
        if self.n_positional is not None and len(args) - shift != self.n_positional:
            return False
        return self.keywords is None or self.keywords == kwargs.keys()


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
    scope: ast.AST = stmt
    while (parent := getattr(scope, "parent", None)) is not None and not isinstance(
        scope, ast.FunctionDef | ast.AsyncFunctionDef | ast.Module | ast.Lambda
    ):
        scope = parent
    end = getattr(stmt, "end_lineno", stmt.lineno)
    lines = sorted(
        {
            n.lineno
            for n in ast.walk(scope)
            if isinstance(n, ast.Name)
            and n.id == name
            and isinstance(n.ctx, ast.Load)
            and n.lineno > end
        }
    )
    return lines


def _refuse(loc: str, why: str) -> CallSiteProof:
    return CallSiteProof(location=loc, reasons=(("*", why),))


def _resolve_callee(expr: ast.AST, frame) -> tuple[bool, Any]:
    """``(resolved, value)`` of the called expression, read without running any code.

    Only a global or builtin name, or attributes of one (``module.step``, ``Trainer.step``), are
    resolved; a local or closure variable is not (reading a function's locals from its frame
    takes a snapshot that holds a reference to each of them, which would defeat every later
    reference count in that call of the function)."""
    chain = []
    while isinstance(expr, ast.Attribute):
        chain.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return False, None
    code = frame.f_code
    if expr.id in code.co_varnames or expr.id in code.co_cellvars or expr.id in code.co_freevars:
        return False, None
    namespaces = [frame.f_globals, frame.f_builtins]
    if not code.co_flags & inspect.CO_OPTIMIZED:
        namespaces.insert(0, frame.f_locals)  # module level: the namespace itself, no snapshot
    for ns in namespaces:
        if expr.id in ns:
            value = ns[expr.id]
            break
    else:
        return False, None
    try:
        for attr in reversed(chain):
            value = inspect.getattr_static(value, attr)
    except AttributeError:
        return False, None
    return True, value


def prove_call_site(frame, callee: Any = None) -> CallSiteProof:
    """Analyse the statement that is calling ``callee`` from ``frame``. Never raises.

    Besides the names the statement rebinds, the proof must be about the function being called
    with the arguments as written: a ``functools.partial`` or a builtin calling back (``sorted(
    xs, key=f)``) in between would shift or replace them. So the call expression must resolve to
    ``callee`` when it can be read without running code, and every call must have the written
    shape (``CallSiteProof.matches``)."""
    try:
        ex = executing.Source.executing(frame)
        node = ex.node
    except Exception:  # noqa: BLE001 - no source (REPL, exec), or executing cannot tell
        node = None
    loc = f"{frame.f_code.co_filename}:{frame.f_lineno}"
    if not isinstance(node, ast.Call):
        return _refuse(
            loc,
            "the call site could not be read (no source, or the call is not a "
            "plain call expression)",
        )
    code = frame.f_code
    if not code.co_flags & inspect.CO_OPTIMIZED and frame.f_locals is not frame.f_globals:
        # A class body (or exec with separate locals) reads names from one namespace and binds
        # them in another: ``x = f(x)`` there leaves the module's ``x`` bound to the argument.
        return _refuse(
            loc, "a class body or exec namespace: the name it rebinds is not the one it reads"
        )
    if isinstance(node.func, ast.Attribute) and node.func.attr == "__call__":
        return _refuse(
            loc,
            "the function is called through `__call__`, a call shape whose "
            "references autoopt does not measure",
        )
    starred = any(isinstance(a, ast.Starred) for a in node.args)
    double_starred = any(kw.arg is None for kw in node.keywords)
    resolved, value = _resolve_callee(node.func, frame)
    if resolved and value is not callee:
        return _refuse(
            loc,
            f"the statement calls `{ast.unparse(node.func)}`, which calls this "
            "function with other arguments (a functools.partial, or a builtin "
            "calling back)",
        )
    if starred and not resolved:
        return _refuse(
            loc,
            "arguments from `*` unpacking, and the called name is local, so "
            "positions cannot be matched to what the function receives",
        )
    parent = getattr(node, "parent", None)
    targets: set[str] = set()
    unpack = None
    if isinstance(parent, ast.Assign) and parent.value is node:
        for t in parent.targets:
            targets |= _target_names(t)
            if isinstance(t, ast.Tuple | ast.List):
                if any(isinstance(e, ast.Starred) for e in t.elts):
                    return _refuse(loc, "the result is unpacked with `*`")
                unpack = len(t.elts)
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
            what = (
                "not assigned" if stmt is None else "assigned to something other than plain names"
            )
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
    return CallSiteProof(
        tuple(positions),
        tuple(names),
        tuple(reasons),
        loc,
        text,
        n_positional=None if starred else len(node.args),
        # without ``**`` every keyword has a name: the filter only tells the type checker so
        keywords=(
            None
            if double_starred
            else frozenset(kw.arg for kw in node.keywords if kw.arg is not None)
        ),
        unpack=unpack,
    )


# --- run-time checks -------------------------------------------------------------------------
# Reference-count baselines are measured, not assumed: CPython versions differ in how many
# references a call holds (the caller's stack, the *args tuple, the **kwargs dict). We measure
# them once through the same call shape the real path uses.


class _Probe:
    def __call__(self, *args, **kwargs):
        return _measure(args, kwargs)


class _BoundProbe:
    """The call shape of a decorated method: ``_BoundOptimized`` prepends the instance."""

    def __call__(self, *args, **kwargs):
        full = (None, *args)  # as _BoundOptimized.__call__ builds it (both tuples stay alive)
        return _measure(full, kwargs, 1)


def _measure(args, kwargs, i=0):
    return sys.getrefcount(args[i]), (sys.getrefcount(kwargs["k"]) if "k" in kwargs else None)


def _calibrate(probe) -> tuple[int, int, int]:
    """Baselines for (positional arg, no keywords), (positional arg, with keywords), (keyword arg).

    A call with keywords holds one more transient reference per argument in CPython 3.11, so the
    two shapes get their own baseline. A call shape we did not calibrate (``functools.partial``
    around the function) holds more references, which only makes the check refuse: safe.
    """

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


_BASE_POS, _BASE_POS_KW, _BASE_KW = _calibrate(_Probe())
# A decorated method's call (``obj.step(state, batch)``): the arguments tuple is rebuilt with
# the instance in front, one more reference to each positional argument while the call runs.
BOUND_BASES = _calibrate(_BoundProbe())


_BUILTIN_NODES = (dict, list, tuple)


def _kid_refcounts(obj) -> tuple[list, list[int], int]:
    """``(children, their reference counts, the count of a child nothing else refers to)``.

    Plain dicts, lists and tuples (jax flattens them to their values) are read directly, ~4x
    cheaper than ``flatten_one_level``; every other node goes through jax's registry."""
    if type(obj) in _BUILTIN_NODES:
        kids = list(obj.values()) if type(obj) is dict else list(obj)
        return kids, [sys.getrefcount(c) for c in kids], _BASE_KID_BUILTIN
    return _registry_kid_refcounts(obj)


def _registry_counts(obj) -> tuple[list, list[int], int, bool]:
    """``(children, their counts, the count of the children's container, container is obj)``."""
    kids, _ = flatten_one_level(obj)
    return list(kids), [sys.getrefcount(c) for c in kids], sys.getrefcount(kids), kids is obj


def _registry_kid_refcounts(obj) -> tuple[list, list[int], int]:
    kids, counts, container, same = _registry_counts(obj)
    if same:  # a list node: jax returns the node itself as its children
        return kids, counts, _BASE_KID_SAME
    if container == _FRESH_CONTAINER:  # a new container: the node holds each child itself
        return kids, counts, _BASE_KID_NEW
    if container == _FRESH_CONTAINER + 1:  # the node's own stored container (``b.parts``)
        return kids, counts, _BASE_KID_STORED
    # The container the node flattens to is reachable from elsewhere, and the leaves with it.
    return kids, counts, -1


_BASE_KID_SAME = _BASE_KID_NEW = _BASE_KID_BUILTIN = _BASE_KID_STORED = _FRESH_CONTAINER = 0


def _calibrate_kids() -> tuple[int, int, int, int, int]:
    """Each path of ``_kid_refcounts`` on a fresh child: its count when only the node holds it,
    and the count of a container the flatten function built afresh."""

    class Fresh:  # flattens to a new list; holds its child itself
        def __init__(self, kid):
            self.kid = kid

    class Stored:  # flattens to the list it stores (``lambda b: (b.parts, None)``)
        def __init__(self, kid):
            self.parts = [kid]

    jax.tree_util.register_pytree_node(
        Fresh, lambda n: ([n.kid], None), lambda _, kids: Fresh(*kids)
    )
    jax.tree_util.register_pytree_node(
        Stored, lambda n: (n.parts, None), lambda _, kids: Stored(*kids)
    )
    _, same_counts, _, same = _registry_counts([object()])
    assert same  # flatten_one_level returns a list node itself as its children
    _, new_counts, fresh, _ = _registry_counts(Fresh(object()))
    _, stored_counts, stored, _ = _registry_counts(Stored(object()))
    assert stored == fresh + 1
    builtin = _kid_refcounts({"a": object()})[1][0]
    return same_counts[0], new_counts[0], builtin, stored_counts[0], fresh


(_BASE_KID_SAME, _BASE_KID_NEW, _BASE_KID_BUILTIN, _BASE_KID_STORED, _FRESH_CONTAINER) = (
    _calibrate_kids()
)


# The concrete array type jax returns from every computation: checked with ``type(x) is`` first,
# because ``isinstance(x, jax.Array)`` goes through an ABC check (~0.5 us a leaf).
_ARRAY_IMPL = ARRAY_IMPL
_HOST_SCALARS = (np.ndarray, np.generic, int, float, complex, bool)
_NO_ARRAYS = (int, float, complex, bool, str, type(None))


def _array_problem(obj, seen: set[int]) -> str | None:
    if obj.is_deleted():
        return "it was already deleted (donated earlier)"
    if id(obj) in seen:
        return "the same array appears twice in the arguments"
    seen.add(id(obj))
    return None


def _leaf_problem(obj, seen: set[int], check_refs: bool = True) -> str | None:
    """Why the pytree ``obj`` (whose own refcount was checked) cannot be donated, or None.

    ``check_refs=False`` (``donate="auto"``: the caller promised not to reuse the argument)
    skips the reference counts of the parts but keeps every other check."""
    t = type(obj)
    if t is _ARRAY_IMPL:
        return _array_problem(obj, seen)
    if t not in _BUILTIN_NODES:  # plain containers skip these checks (~1 us of ABC lookups)
        if isinstance(obj, jax.Array):
            if is_tracer(obj):
                return "it is traced by an enclosing transformation"
            return _array_problem(obj, seen)
        if getattr(t, "_autoopt_never_donate", False):
            return "it holds an autoopt.constant, whose device copy every call shares"
        if isinstance(obj, _HOST_SCALARS):
            return (
                "it holds a NumPy array or Python scalar; jax copies those to the device "
                "on every call, so donating saves nothing"
            )
    try:
        kids, counts, base = _kid_refcounts(obj)
    except ValueError:
        return f"it holds a leaf of type {type(obj).__name__} that is not a jax.Array"
    for kid, count in zip(kids, counts):
        if kid is None:  # an empty node (a None field): no buffer, and None is shared by all
            continue
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


def _repeated_array_ids(args: tuple, kwargs: dict) -> set[int]:
    """Identities of the arrays that occur more than once anywhere in the arguments."""
    once: set[int] = set()
    twice: set[int] = set()
    for leaf in jax.tree_util.tree_leaves((args, kwargs)):
        if isinstance(leaf, jax.Array):
            (twice if id(leaf) in once else once).add(id(leaf))
    return twice


def donation_checks(
    args: tuple,
    kwargs: dict,
    positions,
    names,
    *,
    check_refs: bool,
    bases: tuple[int, int, int] | None = None,
    exclude: frozenset[int] = frozenset(),
):
    """Filter the candidate arguments down to those safe to donate now.

    Returns ``(positions, names, reasons)``. ``check_refs`` is the ``"safe"`` policy's proof that
    no other reference exists; ``"auto"`` skips it (the caller promised). ``bases``: the
    reference-count baselines of the call shape (``BOUND_BASES`` for a decorated method).
    ``exclude``: identities of arrays never to donate (the program's own constants). Never
    raises.
    """
    ok_pos, ok_names, reasons = [], [], []
    base_only, base_with_kw, base_kw = bases or (_BASE_POS, _BASE_POS_KW, _BASE_KW)
    base_pos = base_with_kw if kwargs else base_only
    # Identities of every array in the non-candidate arguments, and of every array passed twice
    # among the candidates: donating a buffer that is also passed elsewhere would delete an input
    # the program still reads (XLA refuses the call). Under "safe" the reference counts already
    # rule out the second case; "auto" has only this.
    candidates = set(positions) | set(names)
    seen: set[int] = set(exclude) if check_refs else _repeated_array_ids(args, kwargs) | exclude
    if len(candidates) < len(args) + len(kwargs):
        # Indexing, not ``for a in args``: a loop variable left bound to the last argument is
        # one more reference to it, and the check below would refuse it.
        for i in range(len(args)):
            if i not in candidates:
                _add_leaf_ids(args[i], seen)
        for k in kwargs:
            if k not in candidates:
                _add_leaf_ids(kwargs[k], seen)
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
        if check_refs and sys.getrefcount(kwargs[key]) > base_kw:
            reasons.append((key, "another reference to the same object exists"))
            continue
        why = _leaf_problem(kwargs[key], seen, check_refs)
        if why is None:
            ok_names.append(key)
        else:
            reasons.append((key, why))
    return tuple(ok_pos), tuple(ok_names), tuple(reasons)


# --- the fast path's checks ------------------------------------------------------------------
# A call site that rebinds its arguments calls with the same signature again and again.
# ``OptimizedFunction`` caches the static half of the donation decision per site and signature
# (the program's aliasing, the site's proof), and ``fast_hit`` re-checks only the run-time half:
# ~1 us for flat arguments (each a jax array or a Python scalar), a few us for pytrees, instead
# of the general path's 5-12 us (benchmarks/overhead.py).

_FLAT_SCALARS = (int, float, bool, complex)


def flat_signature(args: tuple) -> tuple:
    """The signature of flat positional arguments, as ``fast_hit`` computes it.

    ``aval`` is a stored attribute of a jax array, and the same object across the outputs of one
    executable, so building and hashing this tuple costs ~0.3 us. Only signatures of flat
    arguments are stored under it, so a pytree argument (its type here) never finds an entry.
    """
    return tuple([a.aval if type(a) is _ARRAY_IMPL else type(a) for a in args])


_HOST_LEAVES = (np.ndarray, np.float32, np.float64, np.int32, np.int64, np.bool_, np.float16)


def tree_signature(args: tuple) -> tuple[tuple, list] | None:
    """``(signature, leaves)`` of pytree positional arguments, or None when a leaf is not a jax
    array, a Python scalar, or a NumPy array or scalar (tracers, anything else: the general path
    decides). NumPy leaves are never donated; they are in the signature by shape and dtype, as
    jax.jit sees them (a batch fed from the host to a step that rebinds its state)."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    sig = []
    for x in leaves:
        t = type(x)
        if t is _ARRAY_IMPL:
            sig.append(x.aval)
        elif t in _FLAT_SCALARS:
            sig.append(t)
        elif t in _HOST_LEAVES:
            sig.append((t, x.shape, x.dtype))
        else:
            return None
    return (treedef, tuple(sig)), leaves


def has_host_leaves(leaves: list) -> bool:
    return any(type(x) in _HOST_LEAVES for x in leaves)


def is_array(x) -> bool:
    return type(x) is _ARRAY_IMPL


def is_flat(args: tuple) -> bool:
    """Every argument is a concrete jax array or a Python scalar (no pytree, tracer, NumPy)."""
    return all(type(a) is _ARRAY_IMPL or type(a) in _FLAT_SCALARS for a in args)


def all_array_leaves(x) -> bool:
    """``x`` is a pytree with at least one leaf, and every leaf a concrete jax array."""
    leaves = jax.tree_util.tree_leaves(x)
    return bool(leaves) and all(type(v) is _ARRAY_IMPL for v in leaves)


def _distinct_arrays(values, exclude: frozenset[int]) -> bool:
    """No array occurs twice in ``values``, and none is in ``exclude`` (a program's constants)."""
    ids = [id(a) for a in values if type(a) is _ARRAY_IMPL]
    unique = set(ids)
    return len(unique) == len(ids) and unique.isdisjoint(exclude)


def fast_hit(fast: dict, args: tuple, check_refs: bool):
    """The site's cached ``(jit object, donated positions, placer, program constants)`` for this
    call, or None when the call must take the general path.

    Re-checks the run-time half of ``donation_checks``: with ``check_refs`` (``donate="safe"``)
    every donated argument, and every container and leaf inside it, is referenced only by the
    call (so no array appears anywhere else in the arguments either); without it (``"auto"``)
    identities are compared instead. Never under ``jax_debug_nans``/``jax_debug_infs`` (jax
    re-runs the inputs op by op on a NaN).
    """
    hit = fast.get(tuple([a.aval if type(a) is _ARRAY_IMPL else type(a) for a in args]))
    if hit is not None:  # flat: each donated argument is one array
        for p in hit[1]:
            # Measured before binding a local name, exactly as ``_measure`` does.
            if (check_refs and sys.getrefcount(args[p]) > _BASE_POS) or args[p].is_deleted():
                return None
        if not check_refs and hit[1] and not _distinct_arrays(args, hit[3]):
            return None
    else:
        tree = tree_signature(args)
        if tree is None:
            return None
        hit = fast.get(tree[0])
        if hit is None:
            return None
        if not check_refs and hit[1] and not _distinct_arrays(tree[1], hit[3]):
            return None
        # The leaves list holds a reference to every leaf: gone before the counts are read.
        del tree
        seen: set[int] = set()
        for p in hit[1]:
            if check_refs and sys.getrefcount(args[p]) > _BASE_POS:
                return None
            if _leaf_problem(args[p], seen, check_refs) is not None:
                return None
    if debug_nans_enabled():
        return None
    return hit
