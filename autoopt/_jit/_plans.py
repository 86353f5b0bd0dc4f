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
  type per leaf (``callsite.tree_signature``);
- for a function with static arguments, the dynamic arguments' key as above with the static
  values (positional, and keywords, which such a plan passes on) beside it (``static_key``,
  ``lookup_static``): the Python path's alone.

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
from collections.abc import Callable, Sequence
from typing import Any

import jax

from autoopt import _compat, _trace
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
_CALL_REFS, _CALL_REFS_KW = callsite.CALL_REFS, callsite.CALL_REFS_KW
_getrefcount = sys.getrefcount
_shared_parts, _weakly_held = callsite.shared_parts, callsite.weakly_held
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


# The first item of a key with static arguments' values (``static_key``): never an aval or a
# type, so such a key never equals one of ``flat_key``'s (the C path's included).
STATIC_ARGS: Any = object()


def static_key(
    args: tuple, kwargs: dict, static_argnums: Sequence[int], static_argnames: Sequence[str]
) -> tuple[tuple, tuple] | None:
    """For a function with static arguments: ``(key, dynamic positional arguments)``, the key
    holding the static values as the general path's signature holds them (each with its type,
    compared by ``==``: ``_trace.strict_statics``, as jax.jit's cache compares them) and the
    dynamic arguments' own key (``flat_key``, else their nested or tree signature); or None,
    where no plan can be kept: a keyword that is not a static argument, an unhashable static
    value (jax.jit's error then comes from the general path), arguments with no signature."""
    for k in kwargs:
        if k not in static_argnames:
            return None
    static_pos = _trace.normalize_static(static_argnums, len(args))
    dyn = tuple([a for i, a in enumerate(args) if i not in static_pos])
    if callsite.is_flat(dyn):
        base = flat_key(dyn)
    else:
        nested = _nested_signature(dyn)
        if nested is None:
            tree = _tree_signature(dyn)
            if tree is None:
                return None
            base = tree[0]
        else:
            base = nested[0]
    statics = (
        tuple([(i, type(args[i]), args[i]) for i in sorted(static_pos) if 0 <= i < len(args)]),
        tuple([(k, type(kwargs[k]), kwargs[k]) for k in sorted(kwargs)]),
    )
    key = (STATIC_ARGS, base, statics)
    try:
        hash(key)
    except Exception:  # noqa: BLE001 - an unhashable (or raising) static value: no plan
        return None
    return key, dyn


def lookup_static(
    plans: dict, args: tuple, kwargs: dict, static_argnums: Sequence[int], static_argnames
) -> Callable | None:
    """The plan of a call of a function with static arguments (``static_key``), or None. (The
    dynamic arguments' tuple is gone when this returns: the plan counts references.)"""
    keyed = static_key(args, kwargs, static_argnums, static_argnames)
    if keyed is None:
        return None
    try:
        return plans.get(keyed[0])
    except Exception:  # noqa: BLE001 - a static value's __eq__ raised: the general path's error
        return None


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


def observing(plan: Callable, ran: Callable[[], None]) -> Callable:
    """``plan``, calling ``ran()`` after a call it ran (not a ``MISS``)."""

    def run(args):
        out = plan(args)
        if out is not MISS:
            ran()
        return out

    return run


def rechecking(plan: Callable, every: int) -> Callable:
    """``plan`` for ``every - 1`` calls, then ``MISS`` until the general path replaces it (a
    miss is asked again by the Python path after the C path's: it must not run then)."""
    calls = [0]

    def run(args):
        if calls[0] >= every - 1:
            return MISS
        calls[0] += 1
        return plan(args)

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

        def plan(args):
            if _shared_or_gone(args, positions, base) or nans.value or infs.value:
                return MISS
            return run(args)

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

        def plan(args):
            if _twice_or_gone(args, positions, const_ids) or nans.value or infs.value:
                return MISS
            return run(args)

    return plan


def in_bounds(args: tuple, checks: tuple[tuple[int, int, int], ...]) -> bool:
    """Whether ``args`` may run a ``Program.bounded`` program: each argument a check names is
    a Python int (never a jax array, whose value lives on the device) in its ``[lo, hi]``."""
    n = len(args)
    for p, lo, hi in checks:
        if not (p < n and type(args[p]) is int and lo <= args[p] <= hi):
            return False
    return True


def bounded(
    general: Callable, special: Callable, checks: tuple[tuple[int, int, int], ...]
) -> Callable:
    """The plan of a signature whose program has a ``Program.bounded`` twin: ``special`` (the
    same plan over the jit objects running the twin) for a call ``in_bounds``, ``general`` for
    any other. (The arguments are read in place, never bound to a name: the plans count
    references.) One check, the common case, is written out."""
    if len(checks) != 1:

        def plan(args):
            return special(args) if in_bounds(args, checks) else general(args)

        return _marked(plan, general, special, checks)
    ((p, lo, hi),) = checks

    def plan_one(args):
        if p < len(args) and type(args[p]) is int and lo <= args[p] <= hi:
            return special(args)
        return general(args)

    return _marked(plan_one, general, special, checks)


def _marked(plan: Callable, general: Callable, special: Callable, checks: tuple) -> Callable:
    """``plan``, marked for the C call path when both halves are plans it runs itself with the
    same checks (``_native``: ``(jit, positions, None)``): ``(jit, positions, None, checks,
    twin jit)``, whose twin it runs for arguments in bounds (``_native.c``'s ``in_bounds``,
    which reads Python ints as ``in_bounds`` here does)."""
    g, t = getattr(general, "_native", None), getattr(special, "_native", None)
    if g is not None and t is not None and g[1] == t[1] and g[2] is None and t[2] is None:
        plan._native = (g[0], g[1], None, checks, t[0])  # pyright: ignore[reportFunctionMemberAccess]
    return plan


def _shared_or_gone(args: tuple, positions: tuple, base: int) -> bool:
    """The run-time check of a plan donating ``positions`` under "safe": the reference counts
    alone prove each donated argument, and every container and array inside it, the call's
    only (an array also passed elsewhere, or held by a program, counts more): the signature
    fixed everything else the general path's ``leaf_problem`` looks at. A deleted array inside a
    container is not looked for: jax's call raises for it before it donates any input, as the
    general path's plan would. True: refused. (``args`` is the call's own tuple: an argument
    bound to a name here would count one more.)"""
    for p in positions:
        if _getrefcount(args[p]) > base:
            return True
        if type(args[p]) is _ARRAY_IMPL:
            if args[p].is_deleted() or _weakly_held(args[p]):
                return True
        elif _shared_parts(args[p]):  # (a typed key: its data array's count; weakrefs)
            return True
        elif type(args[p]) is _KEY_ARRAY and args[p].is_deleted():
            return True
    return False


def _twice_or_gone(args: tuple, positions: tuple, const_ids: frozenset) -> bool:
    """The run-time check of a plan donating ``positions`` under "auto": an array passed twice
    or a constant of the program, or a deleted one. True: refused."""
    if not callsite.distinct_arrays(jax.tree_util.tree_leaves(args), const_ids, True):
        return True
    seen: set[int] = set()
    return any(callsite.leaf_problem(args[p], seen, False) is not None for p in positions)


def _static_runner(jit: Any, placer: Any) -> Callable:
    """``_runner`` for a function with static arguments: ``run(args, kwargs)``, the call's own
    keywords passed on."""
    if placer is None:

        def run(args, kwargs):
            try:
                return jit(*args, **kwargs)
            except FitCheck as e:
                return _fit.first_call(e, jit, None, args, kwargs)

    else:

        def run(args, kwargs):
            try:
                return placer(jit, args, kwargs)
            except FitCheck as e:
                return _fit.first_call(e, jit, placer, args, kwargs)

    return run


def static_plan(
    jit: Any,
    positions: tuple,
    placer: Any,
    const_ids: frozenset,
    check_refs: bool,
    keywords: bool,
) -> Callable:
    """The plan of a signature with static arguments (``static_key``): ``plan(args, kwargs)``,
    with ``donating``'s checks. The call's own static values are passed on, never the first
    call's: values that compare equal share a plan (``0.0`` and ``-0.0``), and where jax traces
    again (``jax.disable_jit()``, ``jax_enable_x64`` switched) it must see the values passed.
    ``keywords``: the signature passes static keywords, whose call holds one more reference to
    each positional argument (``callsite.CALL_REFS_KW``). Only ``OptimizedFunction._call``
    calls these (the C path never finds their keys)."""
    run = _static_runner(jit, placer)
    if not positions:
        return run
    base = _CALL_REFS_KW if keywords else _CALL_REFS
    nans, infs = _DEBUG_STATES
    if check_refs:

        def plan(args, kwargs):
            if _shared_or_gone(args, positions, base) or nans.value or infs.value:
                return MISS
            return run(args, kwargs)

    else:

        def plan(args, kwargs):
            if _twice_or_gone(args, positions, const_ids) or nans.value or infs.value:
                return MISS
            return run(args, kwargs)

    return plan


# The plans call jit objects and catch ``FitCheck`` (a signature traced again under another
# trace context, ``x64`` or dtype promotion, is a first call there): see ``_fit.CATCHERS``.
_fit.CATCHERS.update(
    run.__code__
    for run in (  # every variant
        _runner(None, None),
        _runner(None, object()),
        _static_runner(None, None),
        _static_runner(None, object()),
    )
)
