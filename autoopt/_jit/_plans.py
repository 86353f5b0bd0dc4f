"""A signature's cached plan: one callable that re-checks what the signature's decision left to
run time, then runs the executable.

``plan(args) -> outputs``, or ``MISS`` when a run-time check fails; the call then takes the
general path (``_dispatch``), which decides again with every check. A plan is built once, on
its signature's first call through the general path (``_dispatch.remember_fast``, ``plan_kept``),
and kept per call site under ``"safe"`` (``Site.plans``) and per function under ``"auto"``.
``flat_key``/``lookup_nested`` find it from the positional arguments' signature alone:

- flat arguments (jax arrays and Python scalars): one aval or type per argument
  (``callsite.flat_signature``), ~0.3 us;
- under ``"safe"``, arguments that are jax arrays or plain dicts, lists and tuples of them
  (``callsite.shallow_signature``), read off the containers without flattening;
- anything else: jax's treedef and one type per leaf (``callsite.tree_signature``).

What a plan re-checks is the run-time half of ``callsite.donation_checks`` for the arguments it
donates: under ``"safe"`` that the call holds the only reference to each donated argument and
to every container and array inside it (so no array is also passed elsewhere), under ``"auto"``
that no array is passed twice or is a constant of the program; under both, that nothing is
deleted and ``jax_debug_nans`` is off (jax re-runs the inputs op by op on a NaN). A plan that
donates nothing checks nothing.

The C call path (``_native.c``) runs two kinds of plan itself, with the same checks: those
marked ``_native = (jit, positions)``, a plan with nothing to check (placer None) and the flat
signature's plan donating ``positions`` under ``"safe"``. It calls any other plan as
``__call__`` does.
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
_CALL_REFS = callsite.CALL_REFS
_getrefcount = sys.getrefcount
_DEBUG_STATES = _compat.DEBUG_NANS_STATES
_shallow_signature, _tree_signature = callsite.shallow_signature, callsite.tree_signature


def flat_key(args: tuple) -> tuple:
    """The key of flat positional arguments (``callsite.flat_signature``): a jax array's stored
    ``aval``, a Python scalar's type. Only flat arguments' plans are stored under it: a pytree
    argument (its type here) never finds an entry. One and two arguments (``x = step(x)``,
    ``x = step(x, i)``) are written out: a comprehension costs a function of its own."""
    n = len(args)
    if n == 1:
        a = args[0]
        return (a.aval if type(a) is _ARRAY_IMPL else type(a),)
    if n == 2:
        a, b = args
        return (
            a.aval if type(a) is _ARRAY_IMPL else type(a),
            b.aval if type(b) is _ARRAY_IMPL else type(b),
        )
    return tuple([a.aval if type(a) is _ARRAY_IMPL else type(a) for a in args])


def lookup_nested(plans: dict, args: tuple, shallow: bool) -> Callable | None:
    """The plan for positional arguments that are not flat (``flat_key`` found none), or
    None. ``shallow``: the plans are keyed by ``callsite.shallow_signature`` where it applies
    (``"safe"``'s donating sites)."""
    if callsite.is_flat(args):
        return None
    if shallow:
        sig = _shallow_signature(args)
        if sig is not None:
            return plans.get(sig)
    tree = _tree_signature(args)
    return None if tree is None else plans.get(tree[0])


def signature_of(args: tuple, shallow: bool) -> tuple[Any, str, bool] | None:
    """``(the key lookup finds these arguments under, how it was read, whether they hold NumPy
    leaves)``, or None when they cannot have a plan (a leaf that is not a jax array, a Python
    scalar or a NumPy array or scalar). The kinds: ``"flat"``, ``"shallow"``, ``"tree"``."""
    if callsite.is_flat(args):
        return callsite.flat_signature(args), "flat", False
    if shallow:
        sig = _shallow_signature(args)
        if sig is not None:
            return sig, "shallow", False
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

        run._native = (jit, ())  # pyright: ignore[reportFunctionMemberAccess]

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
    arguments' signature was read (``"flat"``, ``"shallow"`` or ``"tree"``, ``signature_of``)."""
    run = _runner(jit, placer)
    if not positions:
        return run
    getrefcount, base = _getrefcount, _CALL_REFS
    nans, infs = _DEBUG_STATES
    if kind == "flat" and check_refs and placer is None:
        # The plan of ``x = step(x, i)``: the one that repeats in a loop of small steps, written
        # out (one Python call fewer than going through ``run``).

        def plan(args):
            for p in positions:
                # Counted before binding a local name, exactly as ``callsite._measure`` does.
                if getrefcount(args[p]) > base or args[p].is_deleted():
                    return MISS
            if nans.value or infs.value:
                return MISS
            try:
                return jit(*args)
            except FitCheck as e:
                return _fit.first_call(e, jit, None, args, {})

        plan._native = (jit, positions)  # pyright: ignore[reportFunctionMemberAccess]

    elif kind == "flat" and check_refs:

        def plan(args):
            for p in positions:
                if getrefcount(args[p]) > base or args[p].is_deleted():
                    return MISS
            return MISS if nans.value or infs.value else run(args)

    elif kind == "flat":
        distinct = callsite.distinct_arrays

        def plan(args):
            for p in positions:
                if args[p].is_deleted():
                    return MISS
            if not distinct(args, const_ids) or nans.value or infs.value:
                return MISS
            return run(args)

    elif kind == "shallow":  # "safe" only
        kid_refcounts = callsite.kid_refcounts

        def plan(args):
            # The reference counts alone prove each donated container and array is the call's
            # only (an array also passed elsewhere, or held by a program, counts more). A
            # deleted array inside a container is not looked for: jax's call raises for it
            # before it donates any input, as the general path's plan would.
            for p in positions:
                if getrefcount(args[p]) > base:
                    return MISS
                if type(args[p]) is not _ARRAY_IMPL:
                    _, counts, kid_base = kid_refcounts(args[p])
                    if max(counts) > kid_base:
                        return MISS
                elif args[p].is_deleted():
                    return MISS
            return MISS if nans.value or infs.value else run(args)

    elif check_refs:
        shared_parts = callsite.shared_parts

        def plan(args):
            for p in positions:
                if getrefcount(args[p]) > base or shared_parts(args[p]):
                    return MISS
            return MISS if nans.value or infs.value else run(args)

    else:
        leaf_problem, distinct = callsite.leaf_problem, callsite.distinct_arrays
        tree_leaves = jax.tree_util.tree_leaves

        def plan(args):
            if not check_refs and not distinct(tree_leaves(args), const_ids):
                return MISS
            seen: set[int] = set()
            for p in positions:
                if check_refs and getrefcount(args[p]) > base:
                    return MISS
                if leaf_problem(args[p], seen, check_refs) is not None:
                    return MISS
            return MISS if nans.value or infs.value else run(args)

    return plan


# The plans call jit objects and catch ``FitCheck`` (a signature traced again under another
# trace context, ``x64`` or dtype promotion, is a first call there): see ``_fit.CATCHERS``.
_fit.CATCHERS.update(
    run.__code__
    for run in (_runner(None, None), _runner(None, object()))  # both variants
)
