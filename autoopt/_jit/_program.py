"""The per-signature ``Program``, the one notion of signature, and a call site's cached decisions.

One signature (``_trace.Signature``): the dynamic arguments' tree, the static values, the number
of positional arguments, one type per dynamic leaf, and the trace context (x64, dtype
promotion), as jax.jit's own cache keys it. A program is traced once per signature.

It is computed in three places, each a projection of the same tuple:

- inside jax.jit's trace of the wrapper (``_trace.signature_key``: ``jax.typeof`` of tracers),
  the key of the program cache;
- on the call side, from concrete arguments (``call_signature``): the same tuple, except that a
  jax array's type is its stored ``.aval`` and a Python scalar's is its Python type (as jax.jit
  weak-types it), both read without computing anything. It indexes a second dict holding the
  same ``Program`` objects, filled after the trace, so the two sides never need to agree;
- on a call site's plans (``_plans.lookup``): for positional-only calls without static
  arguments, the per-leaf types only (flat arguments: the tree is implied by the per-argument
  types; pytrees: with the treedef). The trace context is not in it: a fast entry belongs to a
  site, whose decision only ever selects among jit objects that key on the context themselves.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import tree_util

from autoopt import _compat, _jaxpr, _multiprocess, _trace
from autoopt.passes import PipelineResult
from autoopt.passes.donation import callsite

# Per call site, at most this many signatures keep a fast-path decision (a loop over many
# shapes falls back to the general path, which is correct, only slower).
FAST_ENTRIES = 32

_PY_SCALARS = frozenset({int, float, complex, bool})
_ARRAY_IMPL = _compat.ARRAY_IMPL


class Program:
    """One signature's traced program and everything decided about it. Immutable after build,
    except for the small memo of donatable sets (a dict; writes are atomic) and ``verified``."""

    __slots__ = (
        "traced",
        "pipeline",
        "final",
        "fallback_reason",
        "untouched",
        "_donatable",
        "verified",
        "_const_ids",
        "donates",
        "fingerprint",
        "compiled",
        "key",
        "ctx",
        "fit",
        "lost_updates",
        "_host_bytes",
        "value_guards",
        "guarded_choice",
        "bounded",
        "local",
        "compile_s",
        "__weakref__",
    )

    def __init__(
        self,
        traced: _trace.TracedProgram,
        pipeline: PipelineResult | None,
        fallback_reason: str | None,
    ):
        self.traced = traced
        self.pipeline = pipeline
        self.final = pipeline.jaxpr if pipeline is not None else traced.closed
        self.fallback_reason = fallback_reason
        # A program holding types the passes cannot see (``_jaxpr.opaque_type``): no pass ran,
        # and jit traces the user's function itself, as plain jax.jit does.
        self.untouched: str | None = None
        self._donatable: dict = {}
        self.verified = False
        self._const_ids: frozenset[int] | None = None
        # The (positions, names) the signature's one executable donates, fixed by its first
        # call (``decide``); None until then.
        self.donates: tuple[tuple, tuple] | None = None
        # In a jax.distributed job, a digest of the optimized program (``_build``): the scope
        # of the decisions the processes share about it (``_multiprocess``).
        self.fingerprint: str = ""
        # Built for this process alone in a jax.distributed job (``_multiprocess.local``): its
        # decisions are this process's, never exchanged with the others.
        self.local = False
        # How long its executable took to compile, where a call measured it (remat="fit"'s
        # check): what narrowing a refused site costs (``_dispatch.REFUSALS_BEFORE_NARROWING``).
        self.compile_s: float | None = None
        # Whether a jit traced it to compile (a call, or lower()), not only inspect()/explain()
        # tracing it for a report: what the recompile finding counts.
        self.compiled = False
        # The trace-side signature and the passes' context it was built with (a re-plan under
        # remat="fit" runs the passes again with a budget: ``_fit``).
        self.key: tuple | None = None
        self.ctx: Any = None
        # remat="fit": None until a call checked that its executable fits; then "checking",
        # "fits" or "planned" (``_fit``). Another value: nothing to check ("off").
        self.fit: str | None = None
        # Assignments the trace made to nnx objects of the arguments and did not return
        # (``_mutations.LostUpdate``): every call checks the caller cannot reach those objects
        # (``OptimizedFunction._run``), so such a program donates nothing and is never a
        # cached plan.
        self.lost_updates: tuple = ()
        # id(final or traced.closed) -> {const index: its NumPy constant's bytes at the first
        # evaluation into a jit that compiles} (``frozen_host_consts``)
        self._host_bytes: dict[int, dict[int, Any]] = {}
        # ((NumPy constant, its bytes when the passes read it), ...) for the constants whose
        # values the passes could rely on, when they changed the program
        # (``value_guards_of``); and ``final`` or ``traced.closed``, fixed by the first
        # evaluation into a call's jit (``OptimizedFunction._guarded``).
        self.value_guards: tuple = ()
        self.guarded_choice: Any = None
        # ``(((argument position, lo, hi), ...), program)``: a second program for calls whose
        # Python int arguments at those positions lie in those bounds, which prove writes this
        # one blends or leaves a scatter (``passes.value_specialized``); the call path checks
        # the values on the host and runs it through its own jit objects
        # (``_plans.bounded``). None: none.
        self.bounded: tuple[tuple[tuple[int, int, int], ...], Any] | None = None

    def frozen_host_consts(self, closed, skip=()) -> dict[int, Any]:
        """``{index: bytes}`` for each NumPy constant of ``closed`` (this program's ``final`` or
        ``traced.closed``): its bytes at the first call of this method, which
        ``OptimizedFunction._evaluate`` makes when it evaluates the program into a jit that
        compiles (a call or ``lower()``, not ``trace()`` or a report).

        jax.jit reads a closed-over NumPy array's bytes when it lowers a signature, and every
        later call of that signature runs them, whatever the caller writes into the array
        afterwards. autoopt evaluates one program into several jit traces, each lowered on its
        own (a jit object per donated set, a placement strategy on trial, a new large constant
        passed as an argument): each of them embeds these bytes, so the signature keeps the
        bytes of its first lowering, as under jax.jit. A constant with one value repeated is
        kept as a broadcast of that value (jax emits it as one). ``skip``: the constants the
        placer passes as arguments (``_hoist`` binds those itself), read on the first call."""
        key = id(closed)
        found = self._host_bytes.get(key)
        if found is not None:
            return found
        with _HOST_BYTES_LOCK:
            found = self._host_bytes.get(key)
            if found is None:
                skipped = {id(c) for c in skip}
                found = {
                    i: _frozen_bytes(c)
                    for i, c in enumerate(closed.consts)
                    if isinstance(c, np.ndarray) and id(c) not in skipped
                }
                self._host_bytes[key] = found
                if found:
                    _FROZEN.add(self)
        return found

    @property
    def const_ids(self) -> frozenset[int]:
        """Identities of the arrays the traced or optimized program holds as constants."""
        if self._const_ids is None:
            self._const_ids = _jaxpr.const_ids(self.traced.closed) | _jaxpr.const_ids(self.final)
        return self._const_ids

    def unpacks_to(self, patterns: tuple | None) -> bool:
        """The result unpacks into every target pattern of the statement (``a, b = f(x)``,
        ``(a, b), c = f(a, b, c)``: ``callsite.target_pattern``) at every level; True when the
        result is not unpacked. A level that is an array (unpacked along its first axis) or
        any other node than a tuple or list counts as not unpacking: nothing is donated."""
        if patterns is None:
            return True
        return all(unpacks_tree(self.traced.out_tree, p) for p in patterns)

    def decide(self, intended: tuple[tuple, tuple] | None = None) -> tuple[tuple, tuple]:
        """The arguments this signature's one executable donates, fixed by its first call: of
        ``intended`` (what that call's policy or call site would donate before the run-time
        checks; None: every argument), those an output can alias and
        whose leaves are all arrays or typed PRNG keys (a token is never donated). jax.jit
        compiles one executable per signature; so does autoopt, whatever each call's donation
        outcome: a call that must not donate some of them passes device copies instead
        (``CallPlan.copies``)."""
        d = self.donates
        if d is None:
            mine = self._decide(intended)
            d = mine
            if _multiprocess.several() and not self.local:
                # The executable must be the same on every process (its aliasing is part of
                # it): process 0's first call decides; a process whose own call site cannot
                # donate passes copies. Asked only where something could be donated, which
                # every process's first call asks alike (the answer for nothing aliasable is
                # no donation on every process, without asking).
                everything = self.donatable(*self.arguments())
                if everything[0] or everything[1]:
                    d = _multiprocess.shared(
                        "donation",
                        self.fingerprint,
                        lambda: mine,
                        lambda v: [list(v[0]), list(v[1])],
                        lambda v: (tuple(v[0]), tuple(v[1])),
                    )
            self.donates = d
        return d

    def _decide(self, intended: tuple[tuple, tuple] | None) -> tuple[tuple, tuple]:
        plain = self.arguments()
        if intended is not None:
            plain = (
                tuple(p for p in intended[0] if p in plain[0]),
                tuple(n for n in intended[1] if n in plain[1]),
            )
        return self.donatable(*plain) if plain[0] or plain[1] else ((), ())

    def arguments(self) -> tuple[tuple, tuple]:
        """(positions, names) of the arguments whose leaves are all arrays of a numeric
        dtype or typed PRNG keys; none when the program drops an update to an argument
        (``lost_updates``): a call that raises for it must find every argument as it was."""
        if self.lost_updates:
            return (), ()
        plain: dict = {}
        for arg, aval in zip(self.traced.in_arg_of_leaf, self.final.in_avals):
            dtype = getattr(aval, "dtype", None)
            # A typed PRNG key is donated as jax.jit donates it (its data array's buffer); the
            # run-time checks read that data array as they read an array (``callsite``'s
            # ``_key_problem``). A token or another extended dtype is never donated.
            ok = dtype is not None and (
                not jnp.issubdtype(dtype, jax.dtypes.extended)
                or jnp.issubdtype(dtype, jax.dtypes.prng_key)
            )
            plain[arg] = plain.get(arg, True) and ok
        return (
            tuple(a for a, ok in plain.items() if ok and isinstance(a, int)),
            tuple(a for a, ok in plain.items() if ok and isinstance(a, str)),
        )

    def donatable(self, positions: tuple, names: tuple) -> tuple[tuple, tuple]:
        """The subset of candidate arguments whose every leaf an output aliases."""
        key = (positions, names)
        hit = self._donatable.get(key)
        if hit is not None:
            return hit
        from autoopt.passes.donation import donatable_args

        t = self.traced
        chosen, _ = donatable_args(
            self.final.in_avals,
            self.final.out_avals,
            t.in_arg_of_leaf,
            list(positions) + list(names),
        )
        hit = (tuple(p for p in positions if p in chosen), tuple(n for n in names if n in chosen))
        self._donatable[key] = hit
        return hit


def unpacks_tree(tree, pattern: tuple | None) -> bool:
    if pattern is None:
        return True
    data = tree.node_data()  # None for a single leaf
    # Unpacking runs the class's own __iter__: user code after the call, which may raise
    # with the arguments already donated. Only the builtin iteration is known not to.
    if data is None or getattr(data[0], "__iter__", None) not in (tuple.__iter__, list.__iter__):
        return False
    kids = tree_util.treedef_children(tree)
    return len(kids) == len(pattern) and all(unpacks_tree(k, p) for k, p in zip(kids, pattern))


def _call_leaf_type(x: Any):
    aval = getattr(x, "aval", None)  # a stored attribute on jax.Array: no computation
    if aval is not None:
        return aval
    t = type(x)
    if t in _PY_SCALARS:  # weak-typed: one signature per Python type, as in jax.jit
        return t
    return _trace.leaf_type(x)


def call_signature(
    args: tuple, kwargs: dict, static_argnums: tuple, static_argnames: tuple
) -> _trace.Signature:
    """The signature of concrete arguments (see the module docstring)."""
    if static_argnums or static_argnames:
        dyn_tree, statics = _trace.split_args(args, kwargs, static_argnums, static_argnames)
    else:
        dyn_tree, statics = (args, kwargs), ()
    leaves, treedef = tree_util.tree_flatten(dyn_tree)
    return _trace.Signature(
        treedef,
        _trace.strict_statics(statics),
        len(args),
        tuple(map(_call_leaf_type, leaves)),
        _compat.trace_context(),
    )


def trace_signature(
    args: tuple, kwargs: dict, static_argnums: tuple, static_argnames: tuple
) -> tuple[_trace.Signature, list]:
    """``(signature, dynamic leaves)`` of the arguments jax.jit's trace hands the wrapper."""
    dyn_tree, statics = _trace.split_args(args, kwargs, static_argnums, static_argnames)
    leaves, in_tree = tree_util.tree_flatten(dyn_tree)
    return _trace.signature_key(leaves, in_tree, statics, len(args)), leaves


class Site:
    """One call site of an OptimizedFunction: its proof, and its plans (``_plans``) per
    signature. A site that donates keeps plans only when the function has no static arguments
    and no ``verify=True`` (whose general path does more per call), and not for a decorated
    method (its reference baselines are another call shape's): ``plans`` is None there. A site
    that donates nothing keeps the plan of each signature whose call runs its executable as it
    is (no copies)."""

    __slots__ = ("proof", "donates", "plans", "refusals", "outcomes", "_withheld")

    def __init__(self, proof: callsite.CallSiteProof, plans_ok: bool):
        self.proof = proof
        self.donates = proof.any  # read on every call: an attribute, not the property
        self.plans: dict | None = {} if plans_ok or not self.donates else None
        # signature -> the run-time check's refusals at this site (``_dispatch.Refusals``)
        self.refusals: dict = {}
        # what the run-time checks did at this site's calls, for the report (``Outcomes``)
        self.outcomes = Outcomes()
        self._withheld: Site | None = None

    def withheld(self) -> Site:
        """This site for a call whose run-time check refused donation (another callee, or a
        donated name another thread could read): it donates nothing, with plans of its own, so
        the call runs the signature's one executable on copies, as any non-donating call."""
        w = self._withheld
        if w is None:
            w = Site(self.proof, True)
            w.donates = False
            self._withheld = w
        return w

    def refused_by_check(self) -> Site:
        """``withheld()``, for a call whose proof's run-time check refused: recorded in this
        site's ``outcomes`` (every such call comes through the Python path), so that the report
        does not call the site's donation applied."""
        self.outcomes.record(
            (), tuple((k, _CHECK_REFUSED) for k in (*self.proof.positions, *self.proof.names))
        )
        return self.withheld()


# Why a call's run-time check of its call site's proof refused (``CallSiteProof.check``).
_CHECK_REFUSED = (
    "the call site's run-time check refused: another thread, a signal handler or a tracer "
    "could read the name during the call, or the callee or a name no longer holds what the "
    "call received"
)


class Outcomes:
    """What the run-time checks did at one call site, for the report (``Inspection.site_calls``)
    and the run summary: written only where a call already takes the general path (a
    signature's first call, a cached plan's refusal, the call observed after one), never by a
    cached plan that runs, so the calls that repeat pay nothing for it. Hence ``donated`` is a
    lower bound (the calls a cached plan ran are not counted), and ``refused`` exact where a
    refusal can only be made on the general path (every cached plan's refusal comes there).

    ``refused``/``why``: per argument (position or name), the calls whose check refused it and
    the last reason. ``donated``: the calls seen to donate it. ``unobserved``: some refused
    signature's next calls were not observed (no ``_plans.observing`` for it: keyword, static,
    pytree or static-leaf calls), so calls between refusals may have donated uncounted."""

    __slots__ = ("refused", "why", "donated", "unobserved")

    def __init__(self):
        self.refused: dict = {}
        self.why: dict = {}
        self.donated: dict = {}
        self.unobserved = False

    def record(self, donated, reasons, observed: bool = True) -> None:
        """One general-path call: the arguments it donated, ``(argument, why)`` of those the
        checks refused; ``observed``: a refusal whose signature's next call is observed."""
        for key in donated:
            self.donated[key] = self.donated.get(key, 0) + 1
        for key, why in reasons:
            self.refused[key] = self.refused.get(key, 0) + 1
            self.why[key] = why
        if reasons and not observed:
            self.unobserved = True


_HOST_BYTES_LOCK = threading.Lock()
# Programs holding frozen bytes: ``jax.clear_caches()`` drops them, as it drops jax.jit's
# lowerings, so the next call's lowering reads the constants again, as jax.jit's does.
_FROZEN: weakref.WeakSet = weakref.WeakSet()


def _forget_frozen_bytes() -> None:
    with _HOST_BYTES_LOCK:
        for program in list(_FROZEN):
            program._host_bytes.clear()
        _FROZEN.clear()


_compat.on_clear_caches(_forget_frozen_bytes, "autoopt: NumPy constants' bytes per program")


def _frozen_bytes(c: np.ndarray) -> np.ndarray:
    """A private copy of ``c``'s bytes, read-only (a broadcast of one element where every
    element has the same bytes: no copy of the whole array)."""
    from autoopt.passes.placement import is_splat

    a = np.asarray(c)
    if a.size > 1 and a.nbytes >= _SPLAT_VIEW_MIN_BYTES and is_splat(a):
        return np.broadcast_to(a.reshape(-1)[:1].copy().reshape((1,) * a.ndim), a.shape)
    out = np.array(a, copy=True)
    out.flags.writeable = False
    return out


# From this size a splat constant is kept as a broadcast view rather than a full copy.
_SPLAT_VIEW_MIN_BYTES = 1 << 16


def detach_host_consts(program: Program) -> None:
    """Replace, in every program text ``program`` holds, each NumPy constant by a plain copy
    of it, for a report's program that the caller may keep (``inspect``, ``explain``). jax
    converts a closed-over NumPy constant when it traces (float64 to float32 is a copy) and
    reuses that conversion for as long as the converted array lives: a kept report holding it
    would make the next call's trace compute with the bytes of the report's moment, where
    jax.jit's first call reads the array as it is then. The report's program is never run
    again (the reporter is emptied), so a copy serves what the report shows."""
    closeds = [program.traced.closed, program.final]
    if program.pipeline is not None:
        closeds += [program.pipeline.original, program.pipeline.jaxpr]
        closeds += [result.jaxpr for _, result in program.pipeline.results]
    for closed in {id(c): c for c in closeds}.values():
        consts = closed.consts
        for i, c in enumerate(consts):
            if isinstance(c, np.ndarray) and type(c) is not np.ndarray:  # jax's converted one
                consts[i] = np.array(c, copy=True)
    program.value_guards = ()


def value_guards_of(traced_closed, final) -> tuple:
    """The guards of a program the passes rewrote (``Program.value_guards``): each NumPy
    constant whose values the passes may read (the range analysis proves indices from them;
    none over ``NUMPY_VALUE_MAX_BYTES``) with a private copy of its bytes now. jax.jit reads a
    closed-over NumPy array when it lowers, which may be later than this build (a program
    built inside another function's trace, then lowered by its own call): the rewrite holds
    only for these bytes."""
    from autoopt.passes.in_place import NUMPY_VALUE_MAX_BYTES  # (larger ones are never read)

    if final is traced_closed:
        return ()
    return tuple(
        (c, np.array(c, copy=True))
        for c in traced_closed.consts
        if isinstance(c, np.ndarray) and c.nbytes <= NUMPY_VALUE_MAX_BYTES
    )
