"""``equinox.filter_jit`` with the donation proof made at the user's call site.

``eqx.filter_jit`` calls ``jax.jit`` once, from its own frame, and every call goes through
equinox's ``_call``: a proof made where ``jax.jit``'s function is called would read equinox's
statement, never the user's ``model, opt_state, loss = make_step(model, opt_state, x, y)``.
``EquinoxJit`` is called by the user's statement itself, so the proof is made there, as for an
``OptimizedFunction``, and the reference counts are read on the user's own objects.

Equinox's semantics are kept: the arguments are bound to the signature, each leaf is an array
(``eqx.is_array``: jax and NumPy arrays) or static (everything else, Python scalars included,
hashed by jax.jit with the tree's structure, as equinox hashes it), the output's non-array
leaves come back as static values of the program, and the call blocks on a marker output so that
``eqx.error_if``'s runtime errors are raised by the call, as equinox raises them. Only
``donate="none"`` (equinox's default) is routed here: a user who asked for donation keeps
equinox's own wrapper and its donation (``patch``).

Layout of the inner function (an ``OptimizedFunction`` with ``static_argnums=0``):
``(static, fun leaves, keyword-only leaves, *leaves of each positional argument)``. ``static``
holds the function's static part, the bound arguments' tree structure and their static leaves;
each other position is a ``_Leaves`` group of one argument's array leaves (named by their paths
in the argument, so reports read ``dynamic_args[0].layers[0].weight``), so the user's bound
positional argument ``i`` is position ``i + FIRST_ARG`` and is donated, or passed as a copy, as a
whole. The output is ``(marker, array leaves, _StaticOut)``, rebuilt with one unflatten. One
executable per signature, whose donated set the first donating call fixes
(``Program.decide``).

A repeating call takes a cached plan (``_Plan``), as an ``OptimizedFunction``'s call does
(``_jit._plans``): per call site, keyed by the signature of the arguments' leaves (jax's treedef
of ``(args, kwargs)``, each leaf's type, and each leaf's aval or, for a static leaf, the leaf
itself, compared as jax.jit compares static arguments). The plan keeps the static half of the
general path's decision (the program's aliasing, the site's proof, the arguments' layout) and
re-checks the run-time half on every call: the reference counts of every donated argument and
of every node and array inside it (``_static_leaves.donated_unshared``: the rules of
``callsite.donation_checks``), nothing deleted, none a constant of the program, ``jax_debug_nans``
off. A failed check, a new signature, an unhashable static leaf: the general path.

NB: the analogous code in Equinox is ``equinox._jit`` (``_preprocess``, ``fun_wrapped`` in
``_filter_jit_cache``, ``_call``).
"""

from __future__ import annotations

import collections
import functools
import inspect
import itertools
import logging
import operator
import os
import sys
import warnings
from typing import Any

import jax
import numpy as np

from autoopt import _compat, _trace
from autoopt._jit import _plans, _reuse
from autoopt._jit._dispatch import Policy, placer_needed, plan_for
from autoopt._jit._function import (
    FRAMEWORK_ROUTES,
    OptimizedFunction,
    call_holding_signals,
    fn_location_of,
)
from autoopt._jit._plans import MISS
from autoopt._jit._program import FAST_ENTRIES, Site
from autoopt._jit._static_leaves import donated_unshared, held_elsewhere, static_kid
from autoopt.passes import make_options
from autoopt.passes.donation import callsite, host_callbacks

__all__ = ["EquinoxJit", "FIRST_ARG", "is_filter_jit", "from_filter_jit"]

FIRST_ARG = 3  # static, fun leaves, keyword-only leaves, then the positionals

# (name, qualname, location, options key) -> the inner OptimizedFunction (see EquinoxJit); the
# least recently built wrappers' entries are dropped beyond this many (a new wrapper of a
# dropped function builds a new inner function, as after ``forget_inner_functions``).
_INNERS: collections.OrderedDict[tuple, OptimizedFunction] = collections.OrderedDict()
MAX_INNERS = 256


def forget_inner_functions() -> None:
    """Later wrappers build new inner functions (``_function.forget_wrappers``)."""
    _INNERS.clear()


# --- the inner function's layout -------------------------------------------------------------


class _Hole:
    """Where a static-leaf tuple has an array leaf (one object: compared by identity)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<array>"


_HOLE = _Hole()


class _Leaves:
    """One argument's array leaves: a pytree node whose children are the leaves, keyed by their
    paths in the argument (``".layers[0].weight"``), which are its node data."""

    __slots__ = ("leaves", "paths")

    def __init__(self, leaves: tuple, paths: tuple):
        self.leaves = leaves
        self.paths = paths


jax.tree_util.register_pytree_with_keys(
    _Leaves,
    lambda g: (tuple(zip(g.paths, g.leaves)), g.paths),
    lambda paths, leaves: _Leaves(tuple(leaves), paths),
    flatten_func=lambda g: (g.leaves, g.paths),
)


class _StaticOut:
    """The output's tree structure and static leaves (``_HOLE`` where an array goes), a pytree
    node without children: a static value of the program, as equinox's ``Static`` output."""

    __slots__ = ("treedef", "slots", "holes")

    def __init__(self, treedef, slots: tuple):
        self.treedef = treedef
        self.slots = slots
        self.holes = tuple(i for i, s in enumerate(slots) if s is _HOLE)

    def rebuild(self, leaves) -> Any:
        merged = list(self.slots)
        for i, x in zip(self.holes, leaves):
            merged[i] = x
        return jax.tree_util.tree_unflatten(self.treedef, merged)


jax.tree_util.register_pytree_node(_StaticOut, lambda s: ((), s), lambda s, _: s)


def _split(tree, is_array) -> tuple[Any, tuple, list, list]:
    """``(treedef, slots, array leaves, their paths)`` of a pytree: ``slots`` is its leaves
    with ``_HOLE`` in place of each array (``is_array``: equinox's ``eqx.is_array``)."""
    pathed, treedef = jax.tree_util.tree_flatten_with_path(tree)
    slots, arrays, paths = [], [], []
    for path, leaf in pathed:
        if is_array(leaf):
            slots.append(_HOLE)
            arrays.append(leaf)
            paths.append(path)
        else:
            slots.append(leaf)
    return treedef, tuple(slots), arrays, paths


def _inner_function(fun_name: str, fun_qualname: str, signature: inspect.Signature | None = None):
    import equinox as eqx
    import jax.numpy as jnp
    from equinox._compile_utils import hashable_combine

    keystr = jax.tree_util.keystr

    def fun_wrapped(static, dynamic_fun, dynamic_kwargs, *dynamic_args):
        static_fun, fun_treedef, treedef, slots = static
        fun = hashable_combine(
            jax.tree_util.tree_unflatten(fun_treedef, dynamic_fun.leaves), static_fun
        )
        arrays = itertools.chain(*(g.leaves for g in dynamic_args), dynamic_kwargs.leaves)
        leaves = [next(arrays) if s is _HOLE else s for s in slots]
        args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
        out = fun(*args, **kwargs)
        out_treedef, out_slots, out_arrays, out_paths = _split(out, eqx.is_array)
        marker = jnp.array(0)
        group = _Leaves(tuple(out_arrays), tuple(keystr(p) for p in out_paths))
        return marker, group, _StaticOut(out_treedef, out_slots)

    fun_wrapped.__name__ = fun_name
    fun_wrapped.__qualname__ = fun_qualname
    if signature is not None:
        # The findings name the user's arguments (``params['w']``), not ``dynamic_args[0]``:
        # position FIRST_ARG + i is the user's bound positional argument i. (Only autoopt's
        # names: jax.jit still reads fun_wrapped's own signature.)
        params = list(signature.parameters.values())
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        positional = [p.name for p in params if p.kind in kinds]
        varargs = next((p.name for p in params if p.kind is p.VAR_POSITIONAL), None)
        names = ("static", "dynamic_fun", "dynamic_kwargs", *positional)
        setattr(fun_wrapped, _trace.PARAM_NAMES, (names, varargs))
    return fun_wrapped


# --- the signature of a call's leaves (the plans' key) ------------------------------------------

_ARRAY_IMPL = _compat.ARRAY_IMPL
_HOST_ARRAYS = (np.ndarray, np.generic)
# per leaf type: 1 a jax array (its aval), 2 a NumPy array or scalar (shape, dtype), 0 static
# (the leaf itself), -1 a jax.Array of another type (a tracer): no plan
_LEAF_KIND: dict[type, int] = {_ARRAY_IMPL: 1}


def _leaf_kind(t: type) -> int:
    kind = _LEAF_KIND.get(t)
    if kind is None:
        if issubclass(t, jax.Array):
            kind = -1
        elif issubclass(t, _HOST_ARRAYS):
            kind = 2
        else:
            kind = 0
        _LEAF_KIND[t] = kind
    return kind


def _leaf_signature(leaves: list) -> tuple | None:
    """Each leaf's aval (a jax array), ``(shape, dtype)`` (NumPy), or the leaf itself (static,
    hashed and compared as jax.jit hashes equinox's static part), or None (a tracer)."""
    kinds = _LEAF_KIND
    sig = []
    for x in leaves:
        k = kinds.get(type(x))
        if k is None:
            k = _leaf_kind(type(x))
        if k == 1:
            sig.append(x.aval)
        elif k == 0:
            sig.append(x)
        elif k == 2:
            sig.append((x.shape, x.dtype))
        else:
            return None
    return tuple(sig)


# --- the plans' reference check (``_static_leaves.held_elsewhere``) ----------------------------

_getrefcount = sys.getrefcount


class _CallProbe:
    """The call shape of ``EquinoxJit.__call__`` reaching ``_planned``, whose count of
    ``args[p]`` is that of an argument nothing but the caller's one name holds."""

    def __call__(self, *args, **kwargs):
        return self._planned(args)

    def _planned(self, args):
        return _getrefcount(args[0])


def _calibrate_call() -> tuple[int, int]:
    probe = _CallProbe()

    def positional():
        x = object()
        return probe(x)

    def with_keywords():
        x = object()
        return probe(x, k=None)

    return min(positional() for _ in range(3)), min(with_keywords() for _ in range(3))


# (positional call, call with keywords)
_CALL_BASES = _calibrate_call()


def _donatable_now(
    args: tuple, kwargs: dict, positions: tuple, refused: list | None = None
) -> tuple:
    """The general path's run-time check of the proven positional arguments (``positions``),
    on the user's own objects before anything else holds their parts: each held only by the
    call, and every node and array inside it only by its parent (``held_elsewhere``). Under
    ``"safe"`` these reference counts also rule out an array passed twice, or also passed
    inside another argument (it counts one more), which ``callsite.donation_checks`` looks for
    by identity. A keyword argument is never donated (as there). ``refused``: a list to add
    ``(position, why)`` of each refused argument to (the site's ``Outcomes``)."""
    base = _CALL_BASES[1] if kwargs else _CALL_BASES[0]
    ok = []
    for p in positions:
        if p >= len(args):
            continue
        # Counted before binding a local name, exactly as ``_calibrate_call`` measures it.
        if _getrefcount(args[p]) > base:
            if refused is not None:
                refused.append((p, _HELD))
            continue
        if type(args[p]) is _ARRAY_IMPL:
            if not args[p].is_deleted() and not callsite.weakly_held(args[p]):
                ok.append(p)
            elif refused is not None:
                refused.append((p, _GONE))
        elif static_kid(args[p]) is None and not held_elsewhere(args[p], 0):
            ok.append(p)
        elif refused is not None:
            refused.append((p, _PART_HELD))
    return tuple(ok)


# ``_donatable_now``'s reasons (``callsite.donation_checks`` says the first the same way)
_HELD = "another reference to the same object exists"
_GONE = "it is deleted, or a weak reference to it exists"
_PART_HELD = "an array or node inside it is also held elsewhere (or is a static leaf)"


# --- the plans ----------------------------------------------------------------------------------


class _Plan:
    """A signature's plan at one call site: the static half of the general path's decision."""

    __slots__ = ("run", "static", "fun_group", "getters", "positions", "base", "const_ids")

    def __init__(self, run, static, fun_group, getters, positions, base, const_ids):
        self.run = run  # the executable (``_plans.kept``: through the placer when needed)
        self.static = static  # the inner function's static argument, as first built
        self.fun_group = fun_group
        # per group (keyword-only, then each positional argument): (its leaves' indices among
        # the call's flattened leaves, their paths)
        self.getters = getters
        self.positions = positions  # the positional arguments donated (user's positions)
        self.base = base  # the reference count of an argument nothing else holds
        self.const_ids = const_ids  # the program's constants, never donated


def _take(indices: tuple) -> Any:
    """``leaves -> tuple of the leaves at indices``."""
    if not indices:
        return lambda leaves: ()
    if len(indices) == 1:
        i = indices[0]
        return lambda leaves: (leaves[i],)
    return operator.itemgetter(*indices)


class _SiteEntry:
    """One call site: its proof (``Site``), its plans, and those of its calls whose proof
    check refused (another callee, a thread): those donate nothing."""

    __slots__ = ("site", "plans", "withheld")

    def __init__(self, site: Site):
        self.site = site
        self.plans: dict = {}
        self.withheld: dict = {}


class EquinoxJit:
    """What ``eqx.filter_jit(fun)`` returns under ``autoopt.patch()`` (and what
    ``autoopt.optimize`` returns for a ``filter_jit``-wrapped function): called like equinox's
    wrapper, computing the same values; donates what the call site proves dead."""

    def __init__(self, fun: Any, plain: Any, options: dict):
        import equinox as eqx
        from equinox._compile_utils import get_fn_names, hashable_partition

        self.__wrapped__ = fun
        functools.update_wrapper(self, fun, updated=())
        self._plain = plain  # equinox's own wrapper: lower(), and errors as equinox raises them
        self._signature = inspect.signature(fun)
        dynamic_fun, self._static_fun = hashable_partition(fun, eqx.is_array)
        fun_pathed, self._fun_treedef = jax.tree_util.tree_flatten_with_path(dynamic_fun)
        self._fun_group = _Leaves(
            tuple(x for _, x in fun_pathed),
            tuple(jax.tree_util.keystr(p) for p, _ in fun_pathed),
        )
        self._is_array = eqx.is_array
        name, qualname = get_fn_names(fun)
        opts = make_options(**{**options, "static_argnums": 0})
        location = fn_location_of(fun)
        policy = Policy.build(opts, location)
        self._donate = policy.donate  # "safe", "auto" or "off"
        # One inner function per name, location and options, shared by every wrapper, as
        # equinox shares its jax.jit per function name (``_filter_jit_cache``): a new
        # ``filter_jit(filter_grad(f))`` per call finds the programs of the first (the
        # function's static part, equal by equinox's ``==``, is in the inner one's static
        # argument, hashed as jax.jit hashes it), and ``jax.grad`` of it JAX's caches of the first.
        key = _reuse.options_key(options)
        shared = (name, qualname, location, key) if key is not None else None
        inner = _INNERS.get(shared) if shared is not None else None
        if inner is None:
            inner = OptimizedFunction(
                _inner_function(name, qualname, self._signature), opts, policy
            )
            # the caller's argument i is the inner function's FIRST_ARG + i (the summary)
            inner._proof_shift = FIRST_ARG  # pyright: ignore[reportAttributeAccessIssue]
            inner._proof_names = list(self._signature.parameters)  # pyright: ignore[reportAttributeAccessIssue]
            # ... and the report's (``Inspection.site_shift``)
            inner._site_shift = FIRST_ARG  # pyright: ignore[reportAttributeAccessIssue]
            if shared is not None:
                inner = _INNERS.setdefault(shared, inner)
                while len(_INNERS) > MAX_INNERS:
                    _INNERS.popitem(last=False)
        elif shared is not None:
            _INNERS.move_to_end(shared)
        self._inner = inner
        self._sites: dict = {}  # (id(code), instruction offset) -> _SiteEntry

    # --- the call --------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        __tracebackhide__ = True
        __equinox_jit_id__ = os.urandom(16)  # equinox's error_if looks for it up the stack
        try:
            positions: tuple = ()
            proof = None
            plans = None
            bind = None
            outcomes = None  # the site's run-time record, where it donates (the report's)
            if self._donate != "off" and _compat.trace_state_clean():
                try:
                    frame = sys._getframe(1) if self._donate == "safe" else None
                except ValueError:  # no Python caller (a thread's entry point): no site
                    frame = None
                if frame is not None:
                    entry = self._sites.get((id(frame.f_code), frame.f_lasti))
                    if entry is None:
                        entry = self._prove(frame)
                    site = entry.site
                    proof = site.proof
                    plans = entry.plans
                    if site.donates and proof.matches(args, kwargs):
                        if proof.check(frame, self, args, kwargs):
                            positions = self._bound_positions(proof, args, kwargs)
                            bind = frame  # (its statement's names: ``call_holding_signals``)
                            outcomes = site.outcomes
                        else:  # another callee, or a thread could read a name: no donation
                            plans = entry.withheld
                    del frame
                elif self._donate == "auto":  # every argument an output can alias: promised
                    positions = tuple(range(len(args)))
            elif self._donate == "off" and _compat.trace_state_clean():
                plans = self._sites.get(None)
                if plans is None:
                    plans = self._sites[None] = {}

            def body():
                # The cached plan of this signature, checked on the user's own objects.
                key = None
                if plans is not None and not _compat.jit_disabled():
                    key, out = self._lookup(plans, args, kwargs, __equinox_jit_id__)
                    if out is not MISS:
                        return out
                donated = positions
                if donated and self._donate == "safe":
                    # On the user's own objects, before anything holds their leaves.
                    refused: list = []
                    donated = _donatable_now(args, kwargs, donated, refused)
                    if outcomes is not None:
                        # (a plan's calls are not observed: those between refusals uncounted)
                        outcomes.record(donated, refused, observed=False)
                parts = self._parts(args, kwargs)
                out, decided = self._run(parts, donated, proof, __equinox_jit_id__)
                if key is not None and plans is not None and len(plans) < FAST_ENTRIES:
                    if decided is not None:
                        self._remember(plans, key, decided, parts, args, kwargs, proof)
                return out

            if bind is not None:
                # the statement's names bound to the output, its Python-rebuilt parts included,
                # before a signal's exception propagates
                return call_holding_signals(body, bind, proof)
            return body()
        except Exception as e:
            _compat.filter_traceback(e)
            raise

    def _lookup(self, plans: dict, args: tuple, kwargs: dict, jit_id: bytes) -> tuple:
        """``(key, output)``: the key of this call's signature (None: it cannot have a plan)
        and the output of its plan, or ``MISS`` (no plan, or its checks refused). The leaves
        are local here: the general path's reference counts must not see them."""
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        sig = _leaf_signature(leaves)
        if sig is None:
            return None, MISS
        key = (treedef, tuple(map(type, leaves)), sig)
        try:
            plan = plans.get(key)
        except Exception:  # noqa: BLE001 - an unhashable or uncomparable static leaf
            return None, MISS
        if plan is None:
            return key, MISS
        return key, self._planned(plan, args, leaves, jit_id)

    def _planned(self, plan: _Plan, args: tuple, leaves: list, jit_id: bytes):
        """The plan's run-time checks, then its executable; ``MISS`` when a check refuses."""
        # (the leaf list holds one more reference to each array: ``array_base`` 1)
        if not donated_unshared(args, plan.positions, plan.base, 1):
            return MISS
        nans, infs = _compat.DEBUG_NANS_STATES
        if plan.positions and (nans.value or infs.value):
            return MISS
        groups = [_Leaves(take(leaves), paths) for take, paths in plan.getters]
        if plan.const_ids and plan.positions:
            consts = plan.const_ids
            for p in plan.positions:
                if any(id(x) in consts for x in groups[p + 1].leaves):
                    return MISS
        del leaves
        return self._execute(plan.run, (plan.static, plan.fun_group, *groups), jit_id)

    def _bound_positions(self, proof, args: tuple, kwargs: dict) -> tuple:
        """The proven arguments as positions of the bound call (a keyword naming a positional
        parameter is bound to its position, as ``signature.bind`` binds it)."""
        out = list(proof.positions)
        if proof.names:
            params = list(self._signature.parameters)
            for name in proof.names:
                p = self._signature.parameters.get(name)
                if p is not None and p.kind is p.POSITIONAL_OR_KEYWORD:
                    out.append(params.index(name))
        return tuple(sorted(set(out)))

    def _parts(self, args: tuple, kwargs: dict) -> tuple:
        """The inner function's arguments (the module docstring's layout)."""
        bound = self._signature.bind(*args, **kwargs)
        treedef, slots, arrays, paths = _split((bound.args, bound.kwargs), self._is_array)
        nargs = len(bound.args)
        groups: list[tuple[list, list]] = [([], []) for _ in range(nargs + 1)]
        keystr = jax.tree_util.keystr
        for x, path in zip(arrays, paths):
            if path[0].idx == 0:  # positional: (args, i, ...)
                g, rest = groups[path[1].idx + 1], path[2:]
            else:  # keyword-only: (kwargs, name, ...)
                g, rest = groups[0], path[1:]
            g[0].append(x)
            g[1].append(keystr(rest))
        static = (self._static_fun, self._fun_treedef, treedef, slots)
        return (
            static,
            self._fun_group,
            *(_Leaves(tuple(xs), tuple(ps)) for xs, ps in groups),
        )

    def _run(self, parts: tuple, positions: tuple, proof, jit_id: bytes) -> tuple[Any, Any]:
        """``(output, the decision to cache for this signature or None)``."""
        inner = self._inner
        decided = None
        if _compat.jit_disabled() or not _compat.trace_state_clean():
            plan = inner._dispatch(None, parts, {})  # eagerly, or inside a trace: as jax.jit
        else:
            plan, decided = self._plan(parts, positions, proof)

        def run(parts):
            return inner._run(plan, parts, {})

        return self._execute(run, parts, jit_id), decided

    def _execute(self, run, parts: tuple, jit_id: bytes):
        """``run(parts)``, blocking on its marker, with equinox's error messages, rebuilt."""
        import equinox._jit as eqx_jit

        filter = eqx_jit._FilterCallback()
        callback_logger = logging.getLogger("jax._src.callback")
        callback_logger.addFilter(filter)
        try:
            marker, out_leaves, static_out = run(parts)
            if not _compat.is_tracer(marker) and isinstance(marker, jax.Array):
                marker.block_until_ready()
        except (eqx_jit.JaxRuntimeError, ValueError) as e:
            # equinox's translation of its runtime errors (``equinox._jit._call``)
            info = eqx_jit.last_error_info
            if info is not None and "_EquinoxRuntimeError: " in str(e):
                last_msg, last_stack = info
                pieces: list[str] = []
                for id_or_str in last_stack:
                    if type(id_or_str) is str:
                        pieces.append(id_or_str)
                    elif id_or_str == jit_id:
                        break
                raise eqx_jit.EquinoxRuntimeError(
                    eqx_jit._on_error_msg.format(msg=last_msg, stack="".join(reversed(pieces)))
                ) from None
            raise
        finally:
            callback_logger.removeFilter(filter)
        return static_out.rebuild(out_leaves.leaves)

    def _plan(self, parts: tuple, positions: tuple, proof):
        """``(plan, decided)``: the signature's one executable, donating ``positions`` (bound
        argument positions that passed the run-time checks) where its outputs alias them, copies
        of the rest; ``decided``, for a plan of this signature (``_remember``): ``(program,
        executable's donated positions, positions the site donates when the checks pass)``,
        or None when the decision is not the same for every call of the signature."""
        inner = self._inner
        program = inner._program_for_call(parts, {})
        if program is None:
            return inner._plain_plan, None
        if self._donate == "off" or host_callbacks(program.final):
            d = program.decide(((), ()))
            return plan_for(inner, program, d, (), ()), (program, d[0], ())
        candidates = tuple(p + FIRST_ARG for p in positions if p + FIRST_ARG < len(parts))
        if self._donate == "auto":
            intended = candidates
        elif proof is not None and proof.any:
            intended = tuple(
                p + FIRST_ARG
                for p in self._bound_positions(proof, (), {})
                if p + FIRST_ARG < len(parts)
            )
        else:
            intended = ()
        d = program.decide((intended, ()))
        unpacks = unpacks_tree(program, proof)
        pos = tuple(p for p in candidates if p in d[0])
        if pos and not unpacks:
            pos = ()
        # Under jax_debug_nans jax re-runs a failing program op by op on its inputs.
        if pos and _compat.debug_nans_enabled():
            pos = ()
        if pos:
            consts = program.const_ids
            if self._donate == "auto":
                pos = callsite.donation_checks(
                    parts, {}, pos, (), check_refs=False, exclude=consts
                )[0]
            else:
                pos = tuple(
                    p
                    for p in pos
                    if not any(id(x) in consts for x in jax.tree_util.tree_leaves(parts[p]))
                )
        decided = None
        if self._donate == "safe":
            planned = intended if (positions and unpacks) else ()
            decided = (program, d[0], tuple(p for p in planned if p in d[0]))
        return plan_for(inner, program, d, pos, ()), decided

    def _remember(
        self, plans: dict, key: tuple, decided: tuple, parts: tuple, args, kwargs, proof
    ) -> None:
        """Record the plan of this call's signature at its site: the executable the general
        path chose, the positions it donates when the checks pass. Only where every call of
        the signature that passes them runs that executable as it is (no copies)."""
        program, donated, planned = decided
        # a proven argument passed by keyword is never donated (``donation_checks``)
        planned = tuple(p for p in planned if p - FIRST_ARG < len(args))
        if any(p not in planned for p in donated):
            return  # calls here pass copies of what the executable donates: general path
        leaves = jax.tree_util.tree_leaves((args, kwargs))
        index: dict[int, int] = {}
        for i, x in enumerate(leaves):
            if _leaf_kind(type(x)) > 0:
                if id(x) in index:
                    return  # an array passed twice: no plan (the general path refuses it)
                index[id(x)] = i
        getters = []
        for group in parts[2:]:
            try:
                at = tuple(index[id(x)] for x in group.leaves)
            except KeyError:
                return
            getters.append((_take(at), group.paths))
        inner = self._inner
        host = any(_leaf_kind(type(x)) == 2 for x in leaves)
        placer = inner._placer if host or placer_needed(inner, program) else None
        jit = inner._jit_for(donated, ()) if donated else inner._plain
        base = _CALL_BASES[1] if kwargs else _CALL_BASES[0]
        plans[key] = _Plan(
            _plans.kept(jit, placer),
            parts[0],
            parts[1],
            tuple(getters),
            tuple(p - FIRST_ARG for p in planned),
            base,
            program.const_ids,
        )

    def _prove(self, frame) -> _SiteEntry:
        proof = callsite.prove_call_site(frame, self)
        entry = _SiteEntry(Site(proof, False))
        self._sites[(id(frame.f_code), frame.f_lasti)] = entry
        if proof.location:
            self._inner._caches.site_proofs[proof.location] = proof
            # (also among the inner function's sites, under a key no call of its own looks
            # up, for ``inspect``'s record of what the calls here did: ``site_calls``)
            self._inner._caches.sites[("equinox", id(frame.f_code), frame.f_lasti)] = entry.site
        return entry

    # --- equinox's other entry points ------------------------------------------------------

    def lower(self, /, *args, **kwargs):
        """As equinox's ``lower``: nothing donated (equinox's default)."""
        return self._plain.lower(*args, **kwargs)

    def __getattr__(self, name: str):
        # (only for names this object lacks) equinox's own wrapper's public attributes, as a caller
        # of the plain wrapper reads them (``f.fn``, ``f.static_argnums``); its private ones
        # (a cache whose size would not count autoopt's compiles) are not forwarded
        if name.startswith("_") or "_plain" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.__dict__["_plain"], name)

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        import equinox as eqx

        return eqx.Partial(self, instance)

    def inspect(self, *args, **kwargs):
        """``OptimizedFunction.inspect`` of the inner program for these arguments."""
        return self._inner.inspect(*self._parts(args, kwargs))

    def explain(self, *args, **kwargs):
        return self._inner.explain(*self._parts(args, kwargs))

    def __repr__(self) -> str:
        name = getattr(self.__wrapped__, "__qualname__", "?")
        return f"<autoopt.optimize of eqx.filter_jit({name})>"


def unpacks_tree(program, proof) -> bool:
    """The user's result unpacks into the statement's targets: the result's structure is the
    node data of the inner output's third child (``(marker, leaves, _StaticOut)``)."""
    if proof is None or proof.unpack is None:
        return True
    from autoopt._jit._program import unpacks_tree as unpacks

    kids = jax.tree_util.treedef_children(program.traced.out_tree)
    if len(kids) != 3:
        return False
    data = kids[2].node_data()
    if data is None or data[0] is not _StaticOut:
        return False
    return all(unpacks(data[1].treedef, p) for p in proof.unpack)


def is_filter_jit(fn: Any) -> bool:
    """``fn`` is what ``eqx.filter_jit`` returns (without importing equinox when unused)."""
    mod = sys.modules.get("equinox._jit")
    return mod is not None and isinstance(fn, mod._JitWrapper)


def from_filter_jit(fn: Any, options: dict) -> EquinoxJit | None:
    """``EquinoxJit`` for an ``eqx.filter_jit`` wrapper that donates nothing, else None (a
    wrapper that donates keeps equinox's own donation)."""
    if fn.donate_first or fn.donate_rest:
        return None
    with warnings.catch_warnings():
        return EquinoxJit(fn.__wrapped__, fn, options)


def filter_jit_subject(fn: Any) -> tuple[Any, tuple]:
    """What an ``eqx.filter_jit`` wrapper is made of: its function (the wrapper's other fields
    are derived from it) and its settings."""
    return fn.__wrapped__, (fn.filter_warning, fn.donate_first, fn.donate_rest)


FRAMEWORK_ROUTES.append(("equinox.filter_jit", is_filter_jit, from_filter_jit, filter_jit_subject))
