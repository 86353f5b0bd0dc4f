"""``flax.nnx.jit`` with the donation proof made at the user's call site.

``nnx.jit`` calls ``jax.jit`` once, from its own frame (``JitWrapped.__init__``), and every call
goes through ``JitWrapped.__call__``: split the arguments' graphs into pure states, run the jit,
merge the output states back, which gives every Variable the call received its new value. A
proof made where ``jax.jit``'s function is called would read nnx's statement, which rebinds
nothing. ``NnxJit`` is called by the user's statement itself (``loss = train_step(model,
optimizer, x)``), so the proof is made there, on the user's own objects, before nnx splits
anything (the split states hold the arrays too).

The proof (``donatable_variables``): the call replaces the value of every Variable reachable
from its arguments (nnx's merge after the call), so a Variable's old array is dead after the
call when nothing but that Variable holds it, and nothing but one parent holds the Variable.
Reference counts are read on the Variables and their arrays, calibrated on a probe module; the
array's identity is then looked up among the split leaves, each at most once. A copy of the old
array kept by the caller (``old = model.kernel.get_value()``, ``jax.tree.map(lambda a: a,
nnx.state(model))``), a Variable shared with another object, an array passed as another argument
too: refused, each with its reason in the report. While another Python thread runs or a Python
signal handler is set nothing is donated: a Variable is shared mutable state, which either could
read during the call.

nnx's semantics are kept by running nnx's own pieces: ``graphlib.update_context``,
``extract.to_tree``/``from_tree`` with nnx's split and merge functions, and nnx's ``JitFn`` as
the traced function, exactly as ``JitWrapped.__call__`` does; only the ``jax.jit`` in the middle
is an ``OptimizedFunction``. Routed only for graph mode with graph updates (nnx's default) and no
shardings, donation, device or backend: any other nnx option keeps nnx's own wrapper
(``from_nnx_jit``, ``patch``).

Layout of the inner function (an ``OptimizedFunction`` with ``static_argnums=0``):
``(static, *leaves)``: ``static`` holds the tree structure of nnx's pure arguments (its graph
definitions) and the user's static arguments; every array leaf is its own position, so each
Variable's array is donated, or passed as a copy, on its own. One executable per signature,
whose donated set the first call fixes (``Program.decide``) from that call's proven leaves; a
later call that cannot donate one of them passes a copy of it, as every ``OptimizedFunction``
call does.

flax private names used (flax 0.12; one place to update): ``flax.nnx.extract`` (``to_tree``,
``from_tree``), ``flax.nnx.graphlib`` (``update_context``, ``is_node``, ``get_node_impl``), and
in ``flax.nnx.transforms.compilation`` ``JitFn``, ``JitWrapped``, ``_jit_split_fn``,
``_jit_merge_fn``.

NB: the analogous code in flax is ``flax/nnx/transforms/compilation.py`` (``JitWrapped``).
"""

from __future__ import annotations

import functools
import gc
import inspect
import sys
from typing import Any

import jax

from autoopt import _compat
from autoopt._jit._dispatch import Policy, plan_for
from autoopt._jit._function import (
    FRAMEWORK_ROUTES,
    OptimizedFunction,
    call_holding_signals,
    fn_location_of,
)
from autoopt.passes import make_options
from autoopt.passes.donation import callsite, host_callbacks

__all__ = ["NnxJit", "is_nnx_jit", "from_nnx_jit", "nnx_routable", "donatable_variables"]

_ARRAY_IMPL = _compat.ARRAY_IMPL

# nnx.jit's keywords whose default NnxJit reproduces; anything else given keeps nnx's wrapper.
_DEFAULTS = {
    "in_shardings": None,
    "out_shardings": None,
    "donate_argnums": None,
    "donate_argnames": None,
    "keep_unused": False,
    "device": None,
    "backend": None,
    "inline": False,
}
_ROUTED = ("static_argnums", "static_argnames", "graph", "graph_updates")


def nnx_routable(kwargs: dict) -> bool:
    """``nnx.jit(f, **kwargs)`` can be an ``NnxJit``: graph mode with graph updates (nnx's
    default, ``JitWrapped``), no shardings, no donation of the user's own, no device/backend."""
    from flax.nnx import graphlib  # flax private: the current graph mode, as nnx.jit reads it

    for k, v in kwargs.items():
        if k in _ROUTED:
            continue
        if k not in _DEFAULTS or v is not _DEFAULTS[k] and v != _DEFAULTS[k]:
            return False
    graph = kwargs.get("graph")
    updates = kwargs.get("graph_updates")
    graph = graphlib.set_graph_mode.current_value() if graph is None else graph
    updates = graphlib.set_graph_updates.current_value() if updates is None else updates
    return bool(graph and updates)


def _static_positions(fun: Any, argnums: Any, argnames: Any) -> tuple[frozenset, frozenset]:
    """(positions, names) of the static arguments, each completed from the other through the
    signature, as jax.jit completes them."""
    nums = () if argnums is None else (argnums,) if isinstance(argnums, int) else tuple(argnums)
    names = (
        () if argnames is None else (argnames,) if isinstance(argnames, str) else tuple(argnames)
    )
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    n = len(positional)
    pos = {i + n if i < 0 and n else i for i in nums}
    nm = set(names)
    for i, p in enumerate(positional):
        if i in pos and p.kind is p.POSITIONAL_OR_KEYWORD:
            nm.add(p.name)
        if p.name in nm:
            pos.add(i)
    return frozenset(pos), frozenset(nm)


class _Static:
    """The static half of one call: the pure arguments' tree structure (nnx's graph
    definitions) and the user's static arguments, hashed as jax.jit hashes static arguments."""

    __slots__ = ("treedef", "args", "kwargs", "_hash")

    def __init__(self, treedef, args: tuple, kwargs: tuple):
        self.treedef, self.args, self.kwargs = treedef, args, kwargs
        self._hash = hash((treedef, args, kwargs))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return other is self or (
            type(other) is _Static
            and self.treedef == other.treedef
            and self.args == other.args
            and self.kwargs == other.kwargs
        )


def _inner_function(jit_fn: Any, name: str, qualname: str):
    def fun_wrapped(static: _Static, *leaves):
        pure_args, pure_kwargs = jax.tree_util.tree_unflatten(static.treedef, leaves)
        pure_args = list(pure_args)
        for i, value in static.args:
            pure_args[i] = value
        pure_kwargs = {**pure_kwargs, **dict(static.kwargs)}
        return jit_fn(*pure_args, **pure_kwargs)  # nnx's JitFn: merge, call, split

    fun_wrapped.__name__ = name
    fun_wrapped.__qualname__ = qualname
    return fun_wrapped


class NnxJit:
    """What ``nnx.jit(fun)`` returns under ``autoopt.patch()`` (and what ``autoopt.optimize``
    returns for an ``nnx.jit``-wrapped function): called like nnx's wrapper, computing the same
    values and updating the same Variables; donates the old arrays the call site proves dead."""

    def __init__(
        self, fun: Any, plain: Any, options: dict, static_argnums=None, static_argnames=None
    ):
        from flax.nnx.transforms import compilation  # flax private: nnx.jit's traced function

        self.__wrapped__ = self.fun = fun
        functools.update_wrapper(self, fun, updated=())
        self._plain = plain  # nnx's own wrapper: lower(), trace(), eval_shape()
        self._statics = {"static_argnums": static_argnums, "static_argnames": static_argnames}
        self._static_pos, self._static_names = _static_positions(
            fun, static_argnums, static_argnames
        )
        try:
            self._params = list(inspect.signature(fun).parameters)
        except (TypeError, ValueError):
            self._params = []
        # the ctxtag of nnx's update context is this object, as it is the JitWrapped in nnx
        jit_fn = compilation.JitFn(fun, None, None, None, self)
        name = getattr(fun, "__name__", type(fun).__name__)
        qualname = getattr(fun, "__qualname__", name)
        opts = make_options(**{**options, "static_argnums": 0})
        policy = Policy.build(opts, fn_location_of(fun))
        self._donate = policy.donate  # "safe", "auto" or "off"
        self._inner = OptimizedFunction(_inner_function(jit_fn, name, qualname), opts, policy)
        # the summary names the inner function's argument i + 1 by the Variable's path
        self._inner._proof_shift = 1  # pyright: ignore[reportAttributeAccessIssue]
        self._inner._proof_names = []  # pyright: ignore[reportAttributeAccessIssue]
        self._last: dict = {}  # call site -> the reasons last recorded for its report
        self._collected = False  # gc.collect() ran once for a refusal (``__call__``)
        self._last_static: _Static | None = None  # the last call's (``_parts``)

    # --- the call --------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        __tracebackhide__ = True
        if self._donate == "safe":
            # nnx writes the new arrays into the Variables after the executable donated the
            # old ones: a signal's exception raised in between waits until it has
            caller = sys._getframe(1)  # (the call site the report names)
            return call_holding_signals(lambda: self._checked_call(args, kwargs, caller))
        return self._checked_call(args, kwargs, None)

    def _checked_call(self, args: tuple, kwargs: dict, caller: Any):
        __tracebackhide__ = True
        try:
            proven: dict = {}
            reasons: list = []
            donating = self._donate != "off" and _compat.trace_state_clean()
            named: dict = {}
            if donating:
                # On the user's own objects, before nnx's split holds their arrays.
                safe = self._donate == "safe"
                proven, reasons, named = donatable_variables(
                    args, kwargs, check_refs=safe, params=self._params
                )
                if reasons and safe and not self._collected:
                    # Garbage in a reference cycle not yet collected (nnx.Optimizer's
                    # construction leaves some) still holds Variables: counted once more after
                    # a collection, once per wrapper, since the first call fixes what the
                    # signature's executable donates.
                    self._collected = True
                    gc.collect()
                    proven, reasons, named = donatable_variables(
                        args, kwargs, check_refs=safe, params=self._params
                    )
            return self._call(args, kwargs, proven, reasons, named, donating, caller)
        except Exception as e:
            _compat.filter_traceback(e)
            raise

    def _call(
        self,
        args: tuple,
        kwargs: dict,
        proven: dict,
        reasons: list,
        named: dict,
        donating: bool,
        caller: Any,
    ):
        from flax.nnx import extract, graphlib  # flax private: nnx.jit's own split and merge
        from flax.nnx.transforms import compilation

        with graphlib.update_context(self):
            pure_args, pure_kwargs = extract.to_tree(
                (args, kwargs), prefix=None, split_fn=compilation._jit_split_fn, ctxtag=self
            )
            parts, names = self._parts(pure_args, pure_kwargs, named)
            del pure_args, pure_kwargs
            positions: tuple = ()
            if donating:
                positions = self._positions(parts, proven)
                if self._donate == "safe":
                    self._record(caller, names, positions, named, reasons)
            out = self._run(parts, positions)
            del parts
            _, _, result = extract.from_tree(
                out, merge_fn=compilation._jit_merge_fn, is_inner=False, ctxtag=self
            )
        return result

    def _parts(self, pure_args: tuple, pure_kwargs: dict, named: dict) -> tuple[tuple, list]:
        """``(static, *leaves)`` for the inner function, and a name for each leaf (the
        Variable's path for a Variable's array, else the argument's name)."""
        static_args = tuple(
            (i, pure_args[i]) for i in sorted(self._static_pos) if i < len(pure_args)
        )
        static_kwargs = tuple(
            sorted((k, v) for k, v in pure_kwargs.items() if k in self._static_names)
        )
        dyn_args = tuple(None if i in self._static_pos else a for i, a in enumerate(pure_args))
        dyn_kwargs = {k: v for k, v in pure_kwargs.items() if k not in self._static_names}
        names: list = []
        for i, a in enumerate(dyn_args):
            arg = self._params[i] if i < len(self._params) else f"args[{i}]"
            names += [arg] * len(jax.tree_util.tree_leaves(a))
        for k in sorted(dyn_kwargs):
            names += [k] * len(jax.tree_util.tree_leaves(dyn_kwargs[k]))
        leaves, treedef = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
        if len(names) != len(leaves):  # dict keys flatten sorted; anything else: generic names
            names = [f"leaf {i}" for i in range(len(leaves))]
        for i, leaf in enumerate(leaves):
            hit = named.get(id(leaf))
            if hit is not None:
                names[i] = hit
        static = _Static(treedef, static_args, static_kwargs)
        # nnx's split makes new graph definitions every call, and comparing two is a deep walk
        # (about 60 us on an MLP and its optimizer): the signature lookups of the call compare
        # ``static`` twice. One comparison here against the last call's, and the same object
        # for the rest (compared by identity first).
        last = self._last_static
        if last is not None and last == static:
            static = last
        else:
            self._last_static = static
        return (static, *leaves), names

    def _positions(self, parts: tuple, proven: dict) -> tuple:
        """The inner positions of the proven arrays: each found by identity among the leaves,
        and only when it occurs there once."""
        seen: dict[int, int] = {}
        for p in range(1, len(parts)):
            key = id(parts[p])
            if key in proven:
                seen[key] = -1 if key in seen else p
        return tuple(sorted(p for p in seen.values() if p > 0))

    def _record(self, frame, names: list, positions: tuple, named: dict, reasons: list) -> None:
        """What this call site proved, for the summary's "not applied" lines: leaf positions
        donated, why each other Variable (by path) was not, and that the other leaves are not
        Variables' values."""
        try:
            loc = f"{frame.f_code.co_filename}:{frame.f_lineno}"
        finally:
            del frame
        why = tuple(reasons)
        key = (positions, why)
        if self._last.get(loc) == key:
            return
        self._last[loc] = key
        self._inner._proof_names = names  # pyright: ignore[reportAttributeAccessIssue]
        index = {n: i for i, n in enumerate(names)}
        keyed = [
            ("*" if path == "*" else index[path], r)
            for path, r in why
            if path in index or path == "*"
        ]
        paths = set(named.values())
        keyed += [
            (i, "not an nnx Variable's value: nnx.jit does not replace it, the caller keeps it")
            for i, n in enumerate(names)
            if n not in paths
        ]
        self._inner._caches.site_proofs[loc] = callsite.CallSiteProof(
            positions=tuple(p - 1 for p in positions), reasons=tuple(keyed), location=loc
        )

    def _run(self, parts: tuple, positions: tuple):
        inner = self._inner
        if _compat.jit_disabled() or not _compat.trace_state_clean():
            plan = inner._dispatch(None, parts, {})  # eagerly, or inside a trace: as jax.jit
        else:
            plan = self._plan(parts, positions)
        return inner._run(plan, parts, {})

    def _plan(self, parts: tuple, positions: tuple):
        """The signature's one executable, donating ``positions`` where its outputs alias
        them (the first call fixes which); copies of the rest it donates."""
        inner = self._inner
        program = inner._program_for_call(parts, {})
        if program is None:
            return inner._plain_plan
        if self._donate == "off" or host_callbacks(program.final):
            return plan_for(inner, program, program.decide(((), ())), (), ())
        d = program.decide((positions, ()))
        consts = program.const_ids
        pos = tuple(p for p in positions if p in d[0] and id(parts[p]) not in consts)
        return plan_for(inner, program, d, pos, ())

    # --- nnx's other entry points ----------------------------------------------------------

    def lower(self, *args, **kwargs):
        """As nnx's ``lower``: nothing donated (nnx's default)."""
        return self._plain.lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        return self._plain.trace(*args, **kwargs)

    def eval_shape(self, *args, **kwargs):
        return self._plain.eval_shape(*args, **kwargs)

    def __getattr__(self, name: str):
        # (only for names this object lacks) nnx's own wrapper's public attributes, as a caller
        # of the plain wrapper reads them (``f.fn``, ``f.static_argnums``); its private ones
        # (a cache whose size would not count autoopt's compiles) are not forwarded
        if name.startswith("_") or "_plain" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.__dict__["_plain"], name)

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        return functools.partial(self, instance)

    def inspect(self, *args, **kwargs):
        """``OptimizedFunction.inspect`` of the inner program for these arguments (nnx's split
        of them, as the call makes it)."""
        return self._with_parts(args, kwargs, lambda parts: self._inner.inspect(*parts))

    def explain(self, *args, **kwargs):
        return self._with_parts(args, kwargs, lambda parts: self._inner.explain(*parts))

    def _with_parts(self, args: tuple, kwargs: dict, then):
        from flax.nnx import extract, graphlib
        from flax.nnx.transforms import compilation

        with graphlib.update_context(self):
            pure_args, pure_kwargs = extract.to_tree(
                (args, kwargs), prefix=None, split_fn=compilation._jit_split_fn, ctxtag=self
            )
            named = donatable_variables(args, kwargs, params=self._params)[2]
            parts, _ = self._parts(pure_args, pure_kwargs, named)
            return then(parts)

    def __repr__(self) -> str:
        name = getattr(self.__wrapped__, "__qualname__", "?")
        return f"<autoopt.optimize of nnx.jit({name})>"


# --- the proof ------------------------------------------------------------------------------


def _variables(args: tuple, kwargs: dict) -> tuple[list, list]:
    """Every nnx Variable reachable from the arguments (each once) and its path, named by the
    function's argument (``(0, 'kernel')`` -> ``args[0].kernel``).

    The same walk as ``nnx.iter_graph((args, kwargs))`` (graph mode: depth first, children in
    nnx's order, every node and Variable once by identity), with each type's kind asked of nnx
    once (``_node_kind``) instead of for every node: nnx's ``is_node`` runs several metaclass
    ``isinstance`` checks and ``is_array_ref`` per node, about half of ``iter_graph``'s time on an
    MLP and its optimizer (cProfile, width 16). A Module's children are its attributes sorted by
    name, as nnx's ``_graph_node_flatten`` gives them; any other node's are nnx's ``node_dict``.
    """
    found, paths = [], []
    visited: set[int] = set()
    kinds = _NODE_KINDS
    stack: list = [((), (args, kwargs))]
    while stack:
        path, node = stack.pop()
        kind = kinds.get(type(node))
        if kind is None:
            kind = kinds[type(node)] = _node_kind(node)
        if kind is _LEAF:
            continue
        if id(node) in visited:
            continue
        visited.add(id(node))
        if kind is _VARIABLE:
            found.append(node)
            paths.append(path)
            continue
        if kind is _MODULE:
            if node._pytree__has_int_keys:  # nnx.List: "0", "1" as ints, in nnx's order
                items = list(_module_impl(node).node_dict(node).items())
            else:
                items = sorted(vars(node).items())
        else:
            items = list(kind.node_dict(node).items())
        for key, child in reversed(items):
            stack.append(((*path, key), child))
        del items
    return found, paths


_LEAF, _VARIABLE, _MODULE = object(), object(), object()
# type -> _LEAF, _VARIABLE, _MODULE (an nnx Pytree with nnx's own flatten), or nnx's node impl
_NODE_KINDS: dict[type, Any] = {}


def _module_impl(node: Any) -> Any:
    from flax.nnx import graphlib

    return graphlib.get_node_impl(node)


def _node_kind(node: Any) -> Any:
    """What ``nnx.iter_graph`` does with nodes of ``node``'s type (nnx decides by type)."""
    from flax import nnx
    from flax.nnx import graphlib  # flax private: is_node, get_node_impl

    t = type(node)
    if issubclass(t, nnx.Variable):
        return _VARIABLE
    if not graphlib.is_node(node):
        return _LEAF
    impl = graphlib.get_node_impl(node)
    if impl is None:
        return _LEAF
    pytree = getattr(nnx, "Pytree", None)
    if (
        pytree is not None
        and issubclass(t, pytree)
        and getattr(t, "_graph_node_flatten", None) is getattr(pytree, "_graph_node_flatten", 0)
    ):
        return _MODULE
    return impl


def _counts(args: tuple, kwargs: dict) -> list[tuple[Any, int, Any, int, Any]]:
    """``(variable path, its reference count, its raw value, the value's count, the Variable)``
    for each Variable reachable from the arguments, read with the references this function
    holds fixed (the calibration in ``_bases`` measures them through the same code; each count
    is read before the entry holding the Variable is made)."""
    found, paths = _variables(args, kwargs)
    out = []
    for i in range(len(found)):
        var_count = sys.getrefcount(found[i])
        value = found[i].get_raw_value()
        out.append((paths[i], var_count, value, sys.getrefcount(value), found[i]))
        del value
    return out


_BASES: tuple[int, int] | None = None


def _bases() -> tuple[int, int]:
    """The counts of a Variable held by one module attribute, and of an array held by nothing
    but that Variable, read through ``_counts``; in the counts the entries of ``_counts``'s
    own result add one to each value count (the tuple holds it)."""
    global _BASES
    if _BASES is None:
        import jax.numpy as jnp
        from flax import nnx

        class Probe(nnx.Module):
            def __init__(self):
                self.w = nnx.Param(jnp.zeros(2))

        probe = Probe()
        ((_, var_count, _, value_count, _),) = _counts((probe,), {})
        _BASES = (var_count, value_count)
    return _BASES


def _path_name(path: tuple, params: list | None = None) -> str:
    where, key, *rest = path if len(path) >= 2 else (*path, "?")
    head = (
        (params[key] if params and isinstance(key, int) and key < len(params) else f"args[{key}]")
        if where == 0
        else str(key)
    )
    return ".".join([head, *(str(p) for p in rest)])


def donatable_variables(args: tuple, kwargs: dict, *, check_refs: bool = True, params=None):
    """``(proven, reasons, named)``: ``proven`` ``{id(array): path}``, the Variables' arrays
    this call may donate (the call replaces each Variable's value); ``reasons`` ``[(path, why
    not)]`` for each other Variable; ``named`` ``{id(array): path}`` of every Variable's array
    (the report's names). ``params``: the function's parameter names (paths start with them).
    ``check_refs=False`` (``donate="auto"``: the caller promised) skips the reference counts,
    keeping the other checks. Never raises: an error refuses everything."""
    try:
        return _donatable(args, kwargs, check_refs, params)
    except Exception as e:  # noqa: BLE001 - a graph nnx cannot walk: nothing donated
        return {}, [("*", f"the arguments' graph could not be read ({type(e).__name__})")], {}


def _donatable(args: tuple, kwargs: dict, check_refs: bool, params) -> tuple[dict, list, dict]:
    if callsite.other_code_may_run():
        why = (
            "another Python thread runs or a Python signal handler is set: either could read "
            "a Variable while the call runs"
        )
        return {}, [("*", why)], {}
    var_base, value_base = _bases()
    counts = _counts(args, kwargs)
    proven: dict = {}
    reasons: list = []
    named: dict = {}
    seen: set[int] = set()
    for path, var_count, value, value_count, var in counts:
        name = _path_name(path, params)
        named[id(value)] = name
        why = None
        if type(value) is not _ARRAY_IMPL:
            why = "its value is not a jax array (a host value, a mutable array reference)"
        elif check_refs and var_count > var_base:
            why = "the Variable is also held by another object (not only its module)"
        elif check_refs and value_count > value_base:
            why = (
                "its array is also held elsewhere (a copy of the old value kept by the caller, "
                "another Variable, or another argument)"
            )
        elif check_refs and (callsite.weakly_held(value) or callsite.weakly_held(var)):
            why = callsite.WEAKLY_HELD
        elif value.is_deleted():
            why = "its array was already deleted"
        elif id(value) in seen:
            why = "the same array is the value of two Variables"
        if why is None:
            seen.add(id(value))
            proven[id(value)] = name
        else:
            reasons.append((name, why))
    del counts
    if proven and not check_refs:
        # "auto": no counts, but an array also passed outside a Variable must not be donated
        for leaf in jax.tree_util.tree_leaves((args, kwargs), is_leaf=_is_variable):
            if not _is_variable(leaf) and id(leaf) in proven:
                reasons.append((proven.pop(id(leaf)), "its array is also another argument"))
    return proven, reasons, named


def _is_variable(x: Any) -> bool:
    from flax import nnx

    return isinstance(x, nnx.Variable)


# --- optimize's route ------------------------------------------------------------------------


def is_nnx_jit(fn: Any) -> bool:
    """``fn`` is what ``nnx.jit`` returns in graph mode (without importing flax when unused),
    or an ``NnxJit`` (``nnx.jit`` under the patch)."""
    if isinstance(fn, NnxJit):
        return True
    mod = sys.modules.get("flax.nnx.transforms.compilation")
    return mod is not None and isinstance(fn, mod.JitWrapped)


def from_nnx_jit(fn: Any, options: dict) -> Any:
    """``NnxJit`` for an ``nnx.jit`` wrapper whose options ``NnxJit`` keeps exactly; else nnx's
    own wrapper, unchanged (its donation, shardings or device are the user's choice)."""
    if isinstance(fn, NnxJit):  # ``@autoopt.optimize`` over ``@nnx.jit`` under the patch
        return NnxJit(fn.fun, fn._plain, options, **fn._statics)
    jitted = getattr(fn, "jitted_fn", None)
    try:
        kw = _compat.jit_options(jitted)
    except ValueError:
        kw = None
    if kw is None or fn.in_shardings is not None or fn.out_shardings is not None:
        return fn
    kw = dict(kw)
    if kw.pop("out_shardings", (None, None, None)) != (None, None, None):
        return fn
    statics = {k: kw.pop(k) for k in ("static_argnums", "static_argnames") if k in kw}
    if kw:
        return fn
    return NnxJit(fn.fun, fn, options, **statics)


def nnx_jit_subject(fn: Any) -> tuple[Any, tuple]:
    """What ``optimize``'s wrapper cache keys an ``nnx.jit`` wrapper on: the wrapper itself (by
    identity, weakly; its options are fixed at construction)."""
    return fn, ()


FRAMEWORK_ROUTES.append(("flax.nnx.jit", is_nnx_jit, from_nnx_jit, nnx_jit_subject))
