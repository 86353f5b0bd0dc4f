"""A signature's cached plan: one callable that re-checks what the signature's decision left to
run time, then runs the executable.

``plan(args) -> outputs``, or ``MISS`` when a run-time check fails; the call then takes the
general path (``_dispatch``), which decides again with every check. A plan is built once, on
its signature's first call through the general path (``_dispatch.remember_fast``, ``plan_kept``),
and kept per call site under ``"safe"`` (``Site.plans``) and per function under ``"auto"``.
``flat_key``/``lookup_nested`` find it from the positional arguments' signature alone:

- flat arguments (jax arrays, typed PRNG keys and Python scalars): one aval or type per argument
  (``callsite.flat_signature``), ~0.3 us;
- arguments made of jax arrays, scalars, NumPy leaves, None and plain dicts, lists, tuples and
  NamedTuples of them at any depth (a model's parameters, an optax state, a batch of NumPy
  columns: ``callsite.nested_signature``), read off the containers without flattening;
- anything else (a registered node: an equinox module, a flax struct): jax's treedef and one
  type per leaf (``callsite.tree_signature``).

What a plan re-checks is the run-time half of ``callsite.donation_checks`` for the arguments it
donates: under ``"safe"`` that the call holds the only reference to each donated argument and
to every container and array inside it (so no array is also passed elsewhere), under ``"auto"``
that no array is passed twice or is a constant of the program; under both, that nothing is
deleted and ``jax_debug_nans`` is off (jax re-runs the inputs op by op on a NaN). A plan that
donates nothing checks nothing.

The C call path (``_native.c``) finds flat and nested signatures' plans itself, and runs
those marked ``_native = (jit, positions, runner)`` with the same checks: a plan with nothing
to check (placer None), and the plan donating ``positions`` under ``"safe"`` of a flat or
nested signature (``runner``: None to call ``jit`` directly, else the plan's placer-calling
``run``). It calls any other plan as ``__call__`` does.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax

from autoopt import _compat
from autoopt._errors import FitCheck
from autoopt._jit import _fit
from autoopt.passes.donation import callsite

# A plan's answer when a run-time check refuses: the call takes the general path.
MISS: Any = object()

_ARRAY_IMPL = _compat.ARRAY_IMPL
_KEY_ARRAY = _compat.KEY_ARRAY
# A typed PRNG key is read as ``callsite.flat_signature`` reads it (``_compat.key_entry``);
# the C path reads only jax arrays' avals (a key's entry there is its type, never equal to
# ``key_entry``), so it never finds the plan of a key and leaves it to ``_call``, whose checks
# read the key's data array too (the C path's do not: keep it from finding such plans).
_entry = callsite.non_array_entry
_CALL_REFS = callsite.CALL_REFS
_getrefcount = sys.getrefcount
_DEBUG_STATES = _compat.DEBUG_NANS_STATES
_nested_signature, _tree_signature = callsite.nested_signature, callsite.tree_signature


def flat_key(args: tuple) -> tuple:
    """The key of flat positional arguments (``callsite.flat_signature``): a jax array's stored
    ``aval``, a Python scalar's type. Only flat arguments' plans are stored under it: a pytree
    argument (its type here) never finds an entry. One and two arguments (``x = step(x)``,
    ``x = step(x, i)``) are written out: a comprehension costs a function of its own."""
    n = len(args)
    if n == 1:
        a = args[0]
        return (a.aval if type(a) is _ARRAY_IMPL else _entry(a),)
    if n == 2:
        a, b = args
        return (
            a.aval if type(a) is _ARRAY_IMPL else _entry(a),
            b.aval if type(b) is _ARRAY_IMPL else _entry(b),
        )
    return tuple([a.aval if type(a) is _ARRAY_IMPL else _entry(a) for a in args])


def lookup_nested(plans: dict, args: tuple) -> Callable | None:
    """The plan for positional arguments that are not flat (``flat_key`` found none), or
    None."""
    if callsite.is_flat(args):
        return None
    nested = _nested_signature(args)
    if nested is not None:
        return plans.get(nested[0])
    tree = _tree_signature(args)
    return None if tree is None else plans.get(tree[0])


def signature_of(args: tuple) -> tuple[Any, str, bool] | None:
    """``(the key lookup finds these arguments under, how it was read, whether they hold NumPy
    leaves)``, or None when they cannot have a plan (a leaf that is not a jax array, a Python
    scalar or a NumPy array or scalar). The kinds: ``"flat"``, ``"nested"``, ``"tree"``."""
    if callsite.is_flat(args):
        return callsite.flat_signature(args), "flat", False
    nested = _nested_signature(args)
    if nested is not None:
        return nested[0], "nested", nested[1]
    tree = _tree_signature(args)
    if tree is None:
        return None
    return tree[0], "tree", callsite.has_host_leaves(tree[1])


def _runner(jit: Any, placer: Any) -> Callable:
    """``run(args)``: the executable on these arguments, through the placer when it has work
    (a signature's first call under ``remat="fit"`` goes through ``_fit.first_call``)."""
    if placer is None:

        def run(args):
            try:
                return jit(*args)
            except FitCheck as e:
                return _fit.first_call(e, jit, None, args, {})

        run._native = (jit, (), None)  # pyright: ignore[reportFunctionMemberAccess]

    else:

        def run(args):
            try:
                return placer(jit, args, {})
            except FitCheck as e:
                return _fit.first_call(e, jit, placer, args, {})

    return run


def kept(jit: Any, placer: Any) -> Callable:
    """The plan of a signature the call donates nothing of: the executable, no check."""
    return _runner(jit, placer)


def donating(
    jit: Any,
    positions: tuple,
    placer: Any,
    const_ids: frozenset,
    check_refs: bool,
    kind: str,
) -> Callable:
    """The plan donating ``positions`` (an empty tuple: nothing, no check). ``check_refs``:
    ``"safe"`` (the reference counts prove each donated argument the call's only); else
    ``"auto"`` (identities: no array twice, none a constant of the program). ``kind``: how its
    arguments' signature was read (``"flat"``, ``"nested"`` or ``"tree"``, ``signature_of``)."""
    run = _runner(jit, placer)
    if not positions:
        return run
    getrefcount, base = _getrefcount, _CALL_REFS
    nans, infs = _DEBUG_STATES
    if kind == "flat" and check_refs and placer is None:
        # The plan of ``x = step(x, i)``: the one that repeats in a loop of small steps, written
        # out (one Python call fewer than going through ``run``).

        key_data_shared, weakly_held = callsite.key_data_shared, callsite.weakly_held

        def plan(args):
            for p in positions:
                # Counted before binding a local name, exactly as ``callsite._measure`` does.
                if getrefcount(args[p]) > base or weakly_held(args[p]) or args[p].is_deleted():
                    return MISS
                if type(args[p]) is not _ARRAY_IMPL and key_data_shared(args[p]):
                    return MISS  # a typed key whose data array the caller also holds
            if nans.value or infs.value:
                return MISS
            try:
                return jit(*args)
            except FitCheck as e:
                return _fit.first_call(e, jit, None, args, {})

        plan._native = (jit, positions, None)  # pyright: ignore[reportFunctionMemberAccess]

    elif check_refs:
        shared_parts, weakly_held = callsite.shared_parts, callsite.weakly_held

        def plan(args):
            # The reference counts alone prove each donated argument, and every container and
            # array inside it, the call's only (an array also passed elsewhere, or held by a
            # program, counts more): the signature fixed everything else the general path's
            # ``leaf_problem`` looks at. A deleted array inside a container is not looked for:
            # jax's call raises for it before it donates any input, as the general path's plan
            # would.
            for p in positions:
                if getrefcount(args[p]) > base:
                    return MISS
                if type(args[p]) is _ARRAY_IMPL:
                    if args[p].is_deleted() or weakly_held(args[p]):
                        return MISS
                elif shared_parts(args[p]):  # (a typed key: its data array's count; weakrefs)
                    return MISS
                elif type(args[p]) is _KEY_ARRAY and args[p].is_deleted():
                    return MISS
            return MISS if nans.value or infs.value else run(args)

        plan._native = (  # pyright: ignore[reportFunctionMemberAccess]
            jit,
            positions,
            None if placer is None else run,
        )

    elif kind == "flat":
        distinct = callsite.distinct_arrays

        def plan(args):
            for p in positions:
                if args[p].is_deleted():
                    return MISS
            if not distinct(args, const_ids, True) or nans.value or infs.value:
                return MISS
            return run(args)

    else:
        leaf_problem, distinct = callsite.leaf_problem, callsite.distinct_arrays
        tree_leaves = jax.tree_util.tree_leaves

        def plan(args):
            if not distinct(tree_leaves(args), const_ids, True):
                return MISS
            seen: set[int] = set()
            for p in positions:
                if leaf_problem(args[p], seen, False) is not None:
                    return MISS
            return MISS if nans.value or infs.value else run(args)

    return plan


# The plans call jit objects and catch ``FitCheck`` (a signature traced again under another
# trace context, ``x64`` or dtype promotion, is a first call there): see ``_fit.CATCHERS``.
_fit.CATCHERS.update(
    run.__code__
    for run in (_runner(None, None), _runner(None, object()))  # both variants
)
