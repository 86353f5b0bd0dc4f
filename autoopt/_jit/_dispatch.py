"""The general path of a call: ``dispatch(site, args, kwargs) -> CallPlan``.

The policy (``Policy``) is fixed when ``optimize`` builds the wrapper, as ``equinox.filter_jit``
fixes its filter; everything that changes between calls lives in one ``Caches`` object.
``Planned.__call__`` first looks up the cached plan of the call's signature
(``_plans``: per call site under ``"safe"``, per function under ``"auto"``) and runs it; a call
without one, or whose plan's run-time check refused, a decorated method's call, and a call
inside a transformation come here, and follow these steps:

1. under a transformation (``jax.grad`` applied eagerly, ``vmap``, an outer jit), the jit object
   made for that case, which donates nothing;
2. (the cached plans: ``__call__``);
3. otherwise non-array leaves are looked for before jax.jit is called: a call holding some goes
   to the function made for those static leaves (``_static_leaves``); under ``"safe"`` its
   array leaves are donated as the same call's would be without them (``plan_static_leaves``:
   the reference counts are read on the caller's objects, before the trees are rebuilt);
4. the donation policy: ``"safe"`` donates what the call site proves dead and the reference
   counts confirm, ``"auto"`` every aliasable argument, else the plain jit object. The plan
   for the signature is recorded for the next call (``remember_fast``, ``plan_kept``).

``make_dispatch`` builds the function that does this, once per ``Planned``.
The plan says which jit object runs, what it donates, whether the placer runs and whether to
verify; ``Planned`` executes it. Nothing here catches a TypeError: the user's own
errors propagate from the one call of the user's function, as from jax.jit.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

import jax

from autoopt import _compat, _multiprocess, _trace
from autoopt._jit import _plans, _static_leaves
from autoopt._jit._program import FAST_ENTRIES, Program
from autoopt._jit._static_leaves import PLAIN_TYPES, split_if_static
from autoopt._options import Options
from autoopt.passes import jit_options_for
from autoopt.passes.donation import callsite, host_callbacks


class Planned(Protocol):
    """What the general path reads of the function it plans a call for (an
    ``OptimizedFunction``, or the function made for a call's static leaves): this module
    declares it, so it needs nothing else of ``_function``."""

    __wrapped__: Callable
    _fn: Callable
    _policy: Policy
    _caches: Caches
    _plain: Any  # the jax.jit object donating nothing
    _plain_plan: CallPlan
    _placer: Any  # the placer, or None

    def _program_for_call(self, args: tuple, kwargs: dict) -> Program | None: ...

    def _jit_for(self, positions: tuple, names: tuple, bounded: tuple = ()) -> Any: ...

    def _static_leaf_fn(self, key: tuple) -> Planned: ...

    def _sync(self) -> None: ...

    def _static_leaf_plan(self, split: _static_leaves.StaticSplit) -> CallPlan: ...

    def _eager_ad_jit(self) -> Any: ...

    def _nested_jit(self, eager_forward: bool = False) -> Any: ...

    def _fall_back(self, error: BaseException, where: str) -> None: ...


@dataclasses.dataclass(frozen=True)
class Policy:
    """Everything decided when the wrapper is built; read, never written, by calls."""

    options: Options
    donate: str  # "safe" | "auto" | "off" | "explicit" (the user's donate_argnums/argnames)
    static_argnums: tuple[int, ...]
    static_argnames: tuple[str, ...]
    has_static: bool
    verify: bool
    # jax.jit's backend= keyword, or None for the default backend: asked for only when a call
    # needs it (``platform()``), since asking starts JAX's backend, after which
    # ``jax_num_cpu_devices`` and ``jax.distributed.initialize()`` can no longer be set.
    backend: str | None
    jit_kwargs: Mapping[str, Any]  # jax.jit's keywords, with the passes' compiler options
    # A call inside another trace (grad, vmap, jvp, an outer jit) goes to a jit without
    # compiler_options (jax.jit refuses them there; the outer program's options govern the
    # whole computation anyway) and without donate_argnums/argnames: an array passed next to a
    # tracer belongs to the outer computation (jax.grad's backward reads it), so nothing is
    # donated there. That jit runs the original program: XLA inlines it into the outer one,
    # where the rewrites' proofs (the rounding rule's fusion boundaries) do not hold.
    nested_kwargs: Mapping[str, Any]
    # ... except a call under an eager vmap or jvp (``_compat.eager_forward``), which jax
    # compiles on its own, with jax.jit's compiler_options: these keywords, with the caller's
    # own compiler_options (None when there are none: ``nested_kwargs``).
    eager_forward_kwargs: Mapping[str, Any] | None
    # Calls check for an outer transformation (always: every such call takes the nested jit).
    guard_transforms: bool
    remat_auto: bool  # remat may plan a forward for a caller that differentiates it eagerly
    # remat="fit": a signature's first call compiles the original, and plans only when its
    # executable does not fit (``_fit``); remat="auto": that call measures the original for
    # remat's decision (``_fit._checked_auto``)
    fit: bool
    # The fast path needs no static arguments (their positions shift its signature) and no
    # verify=True (which checks the first call of each signature).
    fast_ok: bool
    # The placer acts on every call, arrays or not (see ``remember_fast``).
    placer_every_call: bool
    fn_location: str | None

    def platform(self) -> str:
        """The platform programs compile for (starts JAX's backend: call it from a call)."""
        return self.backend or jax.default_backend()

    @classmethod
    def build(cls, options: Options, fn_location: str | None) -> Policy:
        backend = options.jit_kwargs.get("backend")
        jit_kwargs = dict(options.jit_kwargs)
        for k, v in jit_options_for(options, backend).items():
            if k == "compiler_options":
                jit_kwargs["compiler_options"] = {**v, **(jit_kwargs.get("compiler_options") or {})}
            else:
                jit_kwargs.setdefault(k, v)
        nested = {
            k: v
            for k, v in jit_kwargs.items()
            if k not in ("compiler_options", "donate_argnums", "donate_argnames")
        }
        own_options = options.jit_kwargs.get("compiler_options")
        has_static = bool(options.static_argnums or options.static_argnames)
        return cls(
            options=options,
            donate="explicit" if options.explicit_donation else options.donate,
            static_argnums=options.static_argnums,
            static_argnames=options.static_argnames,
            has_static=has_static,
            verify=bool(options.verify),
            backend=backend,
            jit_kwargs=jit_kwargs,
            nested_kwargs=nested,
            eager_forward_kwargs=(
                {**nested, "compiler_options": own_options} if own_options else None
            ),
            guard_transforms=True,
            remat_auto=options.remat == "auto" and not options.explicit_donation,
            fit=options.remat in ("fit", "auto"),
            fast_ok=not options.verify,
            placer_every_call=(
                options.transfer_guard in ("log", "disallow") or bool(options.canonicalize_scalars)
            ),
            fn_location=fn_location,
        )


class Caches:
    """What calls learn: programs per signature, jit objects per donated set, call sites."""

    __slots__ = (
        "programs",
        "eager_ad_programs",
        "by_call",
        "sites",
        "site_proofs",
        "jits",
        "auto_fast",
        "static_leaf_fns",
        "key_locks",
        "lock",
        "tls",
        "warned",
        "watch_autodiff",
        "any_plannable",
        "eager_ad_jit",
        "nested",
        "eager_forward_jit",
        "original_jit",
        "any_aliasable",
        "lookup_plain",
        "lost_updates",
        "reporter",
        "is_reporter",
        "placer",
        "__weakref__",
    )

    def __init__(self, policy: Policy):
        self.programs: dict[tuple, Program] = {}  # trace-side signature -> program
        self.eager_ad_programs: dict[tuple, Program] = {}  # the same, for the eager-autodiff jit
        self.by_call: dict[tuple, Program] = {}  # call-side signature -> program
        self.sites: dict[tuple, Any] = {}  # (id(code), instruction offset) -> _program.Site
        self.site_proofs: dict[str, callsite.CallSiteProof] = {}  # "file:line" -> proof
        self.jits: dict[tuple, Any] = {}  # (donated positions, names) -> jax.jit object
        self.auto_fast: dict | None = {} if policy.fast_ok else None  # "auto"'s fast plans
        self.static_leaf_fns: dict[tuple, Any] = {}  # static-leaf key -> Planned
        self.key_locks: dict[tuple, threading.RLock] = {}
        self.lock = threading.Lock()
        self.tls = threading.local()  # the program the last trace on this thread used
        self.warned = False
        # Eager autodiff is checked on every call only while remat could plan a forward for it:
        # until the first program is built, then only if a program was a forward remat can
        # plan (passes.remat.forward_plannable). A training step with its own backward, or
        # remat off, stops paying for the check after its first call.
        self.watch_autodiff = policy.remat_auto
        self.any_plannable = False
        self.eager_ad_jit: Any = None  # the jax.jit object for eager autodiff, once made
        self.nested: Any = None  # the jax.jit object for calls inside another trace, once made
        self.eager_forward_jit: Any = None  # the same, for an eager vmap or jvp (own options)
        self.original_jit: Any = None  # jax.jit of the original: eval_shape, verify=True
        # Some program has an argument an output can alias: its executable may donate.
        self.any_aliasable = False
        # Under "safe", a call that donates nothing still looks up its signature's executable
        # (it may donate: another call site decided it), until the programs built show that no
        # signature has anything to donate.
        self.lookup_plain = policy.donate == "safe"
        # Some program drops an update to an nnx object of its arguments
        # (``Program.lost_updates``): the general path checks each call's arguments.
        self.lost_updates = False
        # The function inspect() and explain() trace and compile through when no call has
        # built the signature's program yet (``OptimizedFunction._reporter``), once made.
        self.reporter: Any = None
        self.is_reporter = False  # these are a reporter's caches
        # The function's placer (``passes.placement``), whose hoisted large constants are
        # forgotten with the programs, or None.
        self.placer: Any = None
        with _LIVE_LOCK:
            _LIVE_CACHES.add(self)

    def forget_programs(self) -> None:
        """Drop every traced program and every plan that finds one, keeping the jit objects:
        the next call of each signature traces the user's function again and runs the passes
        on what it reads then (``OptimizedFunction.clear_cache``, ``jax.clear_caches()``)."""
        with self.lock:
            self.programs.clear()
            self.eager_ad_programs.clear()
            self.by_call.clear()
            for site in list(self.sites.values()):
                for plans in (site.plans, site.withheld().plans):
                    if plans:
                        plans.clear()
            if self.auto_fast:
                self.auto_fast.clear()
        placer = self.placer  # (once: a release may set it to None meanwhile)
        if placer is not None:
            placer.forget_hoisted()

    def drop_everything(self) -> None:
        """Empty every table and drop every jit object and function these hold, without a lock
        (``OptimizedFunction._release``: nothing can call them any more, and it runs where a
        wrapper or a function is dropped, on any thread, whatever lock that thread holds)."""
        for table in (self.programs, self.eager_ad_programs, self.by_call, self.sites):
            table.clear()
        for table in (self.site_proofs, self.jits, self.static_leaf_fns, self.key_locks):
            table.clear()
        if self.auto_fast:
            self.auto_fast.clear()
        if self.placer is not None:
            self.placer.forget_hoisted()
        self.eager_ad_jit = self.nested = self.eager_forward_jit = self.original_jit = None
        self.reporter = self.placer = None
        self.tls = threading.local()  # (each thread's last program)


# Every function's caches: ``jax.clear_caches()`` makes jax.jit trace every function again, which
# reads closed-over NumPy constants anew (jax converts a float64 one when it traces, and the
# in-place pass may read an index's value), so it drops every autoopt program too.
_LIVE_CACHES: weakref.WeakSet = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()  # (a WeakSet cannot be listed while another thread adds to it)


def _forget_every_program() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE_CACHES)
    for caches in live:
        caches.forget_programs()


_compat.on_clear_caches(_forget_every_program, "autoopt: traced programs per function")


class CallPlan(NamedTuple):
    """What one call of the general path runs."""

    jit: Any  # the jax.jit object (or, with ``static``, the Planned for those leaves)
    positions: tuple = ()  # donated positional arguments
    placer: Any = None  # the placer the call goes through, or None
    const_ids: frozenset = frozenset()  # the program's constants, never donated ("auto")
    names: tuple = ()  # donated keyword arguments
    verify: bool = False  # compare with jax.jit of the original on a signature's first call
    static: _static_leaves.StaticSplit | None = None  # the call's non-array leaves, taken out
    direct: bool = True  # no ``static``, ``verify`` or ``copies``: the jit object runs as it is
    # (positions, names) the executable donates but this call must not: their jax arrays are
    # passed as device copies (``Program.decide``).
    copies: tuple = ()
    # With ``static``: the Planned for those leaves, whose plan this is (``jit`` its
    # jax.jit object); None: ``jit`` is that function, and it plans the call itself.
    static_fn: Any = None


def make_dispatch(of: Planned) -> Callable[..., CallPlan]:
    """``dispatch(site, args, kwargs, shift=0) -> CallPlan`` for ``of``, its policy bound once.

    As ``equinox.filter_jit`` builds its wrapper once: the policy picks its route here (one
    function per donation policy), and the policy's fields are read here, so a call reads them
    as closure cells, not attributes. ``site``: the caller's ``Site`` under ``"safe"`` (None
    elsewhere); ``shift``: 1 for a decorated method, whose ``args`` start with the instance (its
    reference counts are checked against ``callsite.BOUND_BASES``).

    NB: ``args`` is passed down as the tuple the caller's ``*args`` built, never copied or
    unpacked into names while a reference count is read, so the counts the donation checks read
    are those of the calibrated probes (``callsite._Probe``, ``_BoundProbe``).
    """
    policy, caches = of._policy, of._caches
    static_argnums, static_argnames = policy.static_argnums, policy.static_argnames
    flat_ok = not policy.has_static
    plain_plan = of._plain_plan
    split_if_static = _static_leaves.split_if_static
    trace_state_clean, plain_types = _compat.trace_state_clean, PLAIN_TYPES
    eager_plan = CallPlan(of._fn, direct=False)
    jit_disabled = _compat.jit_disabled

    def has_static_leaves(args: tuple, kwargs: dict) -> bool:
        """Whether the call may hold non-array leaves (the test ``split_if_static`` makes
        first, for flat arrays and scalars; ``a`` is freed on return, before any count)."""
        return not flat_ok or bool(kwargs) or any(type(a) not in plain_types for a in args)

    def transformed(args: tuple, kwargs: dict) -> CallPlan:
        """1. Under a transformation: nothing donated."""
        split = split_if_static(args, kwargs, static_argnums, static_argnames)
        if split is not None:
            return of._static_leaf_plan(split)
        # Once an eager-autodiff jit exists, such calls keep going to it after the watch
        # stops: a second jax.grad of the function must find JAX's caches of the first
        # (its linearized and transposed programs belong to that jit's trace; a custom_vjp's
        # backward is traced once, as under jax.jit).
        if (caches.watch_autodiff or caches.eager_ad_jit is not None) and _compat.eager_autodiff(
            (args, kwargs)
        ):
            return CallPlan(of._eager_ad_jit())
        if policy.eager_forward_kwargs is not None and _compat.eager_forward():
            return CallPlan(of._nested_jit(eager_forward=True))
        return CallPlan(of._nested_jit())

    def plain(site, args: tuple, kwargs: dict, shift: int = 0) -> CallPlan:
        """3. The function for the call's static leaves, or 4. the plain jit object."""
        if not has_static_leaves(args, kwargs):
            return plain_plan
        split = split_if_static(args, kwargs, static_argnums, static_argnames)
        if split is not None:
            return of._static_leaf_plan(split)
        return plain_plan

    def safe(site, args: tuple, kwargs: dict, shift: int = 0) -> CallPlan:
        """What the call site proves dead and the reference counts confirm."""
        if site is None:
            return plain(site, args, kwargs)
        matches = site.proof.matches(args, kwargs, shift)  # else positions mean other arguments
        if caches.lookup_plain and not (site.donates and matches):
            if has_static_leaves(args, kwargs):
                # 3. the signature's executable for these leaves, copies of what it donates
                plans = None if shift else site.plans  # (a method's call takes no plan)
                plan = plan_static_leaves(of, (), (), args, kwargs, plans=plans)
                if plan is not None:
                    return plan
            return plan_kept(of, args, kwargs, site)  # 4. nothing donated
        if not (site.donates and matches):
            return plain(site, args, kwargs)
        proof = site.proof
        bases = callsite.BOUND_BASES if shift else None
        if has_static_leaves(args, kwargs):
            plans = None if shift else site.plans
            plan = plan_static_leaves(
                of,
                proof.positions,
                proof.names,
                args,
                kwargs,
                bases,
                plans,
                proof.unpack,
                site.outcomes,
            )
            if plan is not None:  # 3.
                return plan
        return plan_donating(  # 4.
            of,
            proof.positions,
            proof.names,
            args,
            kwargs,
            True,
            site.plans,
            bases,
            proof.unpack,
            site=site if not shift else None,
            outcomes=site.outcomes,
        )

    def auto(site, args: tuple, kwargs: dict, shift: int = 0) -> CallPlan:
        """Every argument an output can alias."""
        split = split_if_static(args, kwargs, static_argnums, static_argnames)
        if split is not None:  # 3.
            return of._static_leaf_plan(split)
        plans = caches.auto_fast if not shift else None
        return plan_donating(  # 4.
            of, tuple(range(len(args))), tuple(kwargs), args, kwargs, False, plans
        )

    route = {"safe": safe, "auto": auto}.get(policy.donate, plain)

    def dispatch(site, args: tuple, kwargs: dict, shift: int = 0) -> CallPlan:
        # 0. under ``jax.disable_jit()``: the function runs eagerly, as jax.jit runs it there
        # (no trace, no argument check; the cached plans ``__call__`` takes itself run jax.jit
        # objects, which do the same)
        if jit_disabled():
            of._sync()
            return eager_plan
        if not trace_state_clean():
            return transformed(args, kwargs)
        return route(site, args, kwargs, shift)

    return dispatch


def plan_donating(
    of: Planned,
    positions: tuple,
    names: tuple,
    args: tuple,
    kwargs: dict,
    check_refs: bool,
    fast: dict | None = None,
    bases: tuple | None = None,
    unpack: tuple | None = None,
    site: Any = None,
    outcomes: Any = None,
) -> CallPlan:
    """The general donating plan: every check, then the jit object for what may be donated.

    Most of its cost is the reference walk and the call-side signature. With ``fast`` (the
    site's cache), the decision for this signature is recorded there, so the next call with the
    same signature takes the fast path. With ``site``, a site whose check keeps refusing the
    same arguments runs an executable of its own that does not donate them (``narrowed``).
    With ``outcomes`` (the site's ``_program.Outcomes``), what this call donated and why the
    checks refused the rest, for the report.
    """
    policy = of._policy
    if _compat.jit_disabled() or _compat.debug_nans_enabled():
        return of._plain_plan
    if policy.has_static:
        static = _trace.normalize_static(policy.static_argnums, len(args))
        positions = tuple(p for p in positions if p not in static)
        names = tuple(n for n in names if n not in policy.static_argnames)
    positions, names = _without_self_keeping(args, kwargs, positions, names)
    # The program first, outside the try: tracing runs the user's function, whose errors are
    # the user's, as from jax.jit. And the references are counted after it, since a trace may
    # capture an argument as a constant (a global the function reads).
    program = of._program_for_call(args, kwargs) if positions or names else None
    if program is None:
        return of._plain_plan
    pos = nms = ()
    try:
        # Under "safe", nothing is donated into a program that calls back into Python
        # (``host_callbacks`` says why): its one executable donates nothing.
        if check_refs and host_callbacks(program.final):
            return plan_for(of, program, program.decide(((), ())), (), (), args)
        d = program.decide((positions, names))
        reasons: tuple = ()
        if program.unpacks_to(unpack):
            pos, nms = (
                tuple(p for p in positions if p in d[0]),
                tuple(n for n in names if n in d[1]),
            )
            if pos or nms:
                pos, nms, reasons = callsite.donation_checks(
                    args,
                    kwargs,
                    pos,
                    nms,
                    check_refs=check_refs,
                    bases=bases,
                    exclude=program.const_ids,
                )
        elif outcomes is not None:
            reasons = _not_unpacked(positions, names, d)
        if fast is not None and (not kwargs or policy.has_static) and len(fast) < FAST_ENTRIES:
            remember_fast(of, fast, program, positions, args, unpack, check_refs, kwargs)
        refused = tuple(p for p in d[0] if p not in pos)
        row = None
        if site is not None and fast is not None and (site.refusals or refused):
            row = _count_refusal(site, fast, args, kwargs, policy, refused)
        if outcomes is not None:
            # (a refused call's next call is observed where ``_count_refusal`` counted it, and
            # comes here anyway where the site keeps no plans)
            outcomes.record((*pos, *nms), reasons, row is not None or fast is None)
        if row is not None and fast is not None and row.paid_for(program.compile_s):
            row.narrowed = True
            return narrowed(of, fast, program, d, pos, args)
    except Exception as e:  # noqa: BLE001 - donation is an optimization; never break the call
        of._fall_back(e, "donation")
        d, pos, nms = program.decide((positions, names)), (), ()
    return plan_for(of, program, d, pos, nms, args)


# A rebinding call whose run-time check refuses an argument on every call (it is held elsewhere
# too: by the carry tuple a helper unpacked, by a list each step appends to) would pass a device
# copy of it on every call to the signature's executable, which donates it (chosen by the
# first call's proof), where jax.jit copies nothing. After this many refused calls in a row at
# one site, the site runs an executable donating only what its calls do donate: one more
# compile, then no copies. "In a row" is exact: after a refusal the site's next call is
# observed (a call that donates ends the count, one refused comes to the general path); a call
# that keeps its start value once (``x0 = x`` before a loop), or a checkpoint kept every few
# steps, never narrows. A narrowed site checks again (the general path) one call in
# _NARROWED_RECHECK: once its calls can donate again (a warm-up that kept its states is over),
# it runs the signature's executable again.
REFUSALS_BEFORE_NARROWING = 8
# ... and once the refused calls in a row have taken this many times as long as the signature's
# compile (the narrowed executable's costs as much): a loop that keeps a tiny argument for a few
# steps (``prev = x``) never pays a second compile to save microseconds of copies.
# (_UNKNOWN_COMPILE_S where no call measured the compile.)
_NARROW_AFTER_COMPILES = 10.0
_UNKNOWN_COMPILE_S = 0.5
_NARROWED_RECHECK = 64


class Refusals:
    """A site's refused calls in a row, for one signature and one set of refused positions
    (``Site.refusals``)."""

    __slots__ = ("positions", "count", "since", "narrowed")

    def __init__(self, positions: tuple):
        self.positions = positions
        self.count = 0
        self.since = time.perf_counter()  # when the first of them ran
        self.narrowed = False  # the site runs the executable that does not donate them

    def paid_for(self, compile_s: float | None) -> bool:
        """Whether the site narrows now (``REFUSALS_BEFORE_NARROWING``)."""
        seconds = _UNKNOWN_COMPILE_S if compile_s is None else compile_s
        return (
            self.count >= REFUSALS_BEFORE_NARROWING
            and time.perf_counter() - self.since >= _NARROW_AFTER_COMPILES * seconds
        )


def _count_refusal(
    site: Any, fast: dict, args: tuple, kwargs: dict, policy: Policy, refused: tuple
) -> Refusals | None:
    """(A general-path call at a donating ``site``.) The calls in a row, this one included,
    that refused ``refused`` (None when this call refused nothing: the count ends). A refused
    call has the site's cached plan of its signature observed (``_plans.observing``): the next
    call ends the count if the plan ran it (it donated), or comes here (it refused). Sites with
    keyword or static arguments, non-flat signatures and the processes of a jax.distributed job
    (which must run one executable) never count."""
    if kwargs or policy.has_static or _multiprocess.several():
        return None
    found = _plan_key(policy, args, kwargs)
    if found is None or found[1] != "flat":
        return None
    sig = found[0]
    if not refused:
        site.refusals.pop(sig, None)
        return None
    last = site.refusals.get(sig)
    if last is None or last.positions != refused:
        if len(site.refusals) >= FAST_ENTRIES:
            site.refusals.clear()
        last = site.refusals[sig] = Refusals(refused)
    last.count += 1
    plan = fast.get(sig)
    if plan is not None:

        def donated() -> None:  # the site's next call donated: the count ends
            site.refusals.pop(sig, None)
            site.outcomes.record(refused, ())
            if fast.get(sig) is observed:
                fast[sig] = plan

        observed = fast[sig] = _plans.observing(plan, donated)
    return last


def narrowed(
    of: Planned, fast: dict, program: Program, d: tuple, pos: tuple, args: tuple
) -> CallPlan:
    """The plan of a site whose calls keep refusing to donate what the executable donates
    (``REFUSALS_BEFORE_NARROWING``): the executable donating ``pos`` only, also for the site's
    next calls of this signature (``fast``), which check ``pos`` as any donating plan does and
    go to the general path one call in ``_NARROWED_RECHECK``."""
    narrow = (tuple(p for p in d[0] if p in pos), ())
    plan = plan_for(of, program, narrow, pos, (), args)
    found = _plan_key(of._policy, args, {})
    if found is not None and not program.lost_updates:
        sig, kind, host = found
        jitted, placer = _jit_and_placer(of, program, narrow, host)
        fast[sig] = _plans.rechecking(
            _with_twin(
                of,
                program,
                narrow,
                jitted,
                lambda jit: _plans.donating(jit, pos, placer, program.const_ids, True, kind),
            ),
            _NARROWED_RECHECK,
        )
    return plan


# Why an argument a site proves dead is not donated when the statement's targets do not take
# the result apart (``Program.unpacks_to``): the old values stay bound to them.
_NOT_UNPACKED = (
    "the statement's targets do not take the result apart as the function returns it, so "
    "they would keep the old values"
)


def _not_unpacked(positions: tuple, names: tuple, d: tuple) -> tuple:
    """``(argument, why)`` for each argument the executable ``d`` donates that a site whose
    statement does not unpack the result refuses (``_NOT_UNPACKED``)."""
    return tuple((k, _NOT_UNPACKED) for k in (*positions, *names) if k in d[0] or k in d[1])


def _without_self_keeping(
    args: tuple, kwargs: dict, positions: tuple, names: tuple
) -> tuple[tuple, tuple]:
    """The candidates without those holding a node whose type's ``__del__`` can keep it
    (``callsite.keeps_itself``): never donated, whatever the call site, so the executable is
    decided without them."""
    keeping = callsite.holds_node_keeping_itself
    return (
        tuple(p for p in positions if p >= len(args) or not keeping(args[p])),
        tuple(n for n in names if n not in kwargs or not keeping(kwargs[n])),
    )


def plan_static_leaves(
    of: Planned,
    positions: tuple,
    names: tuple,
    args: tuple,
    kwargs: dict,
    bases: tuple | None = None,
    plans: dict | None = None,
    unpack: tuple | None = None,
    outcomes: Any = None,
) -> CallPlan | None:
    """The plan of a call site under ``"safe"`` whose arguments hold non-array leaves (an
    equinox module's activation function), or None when they hold none.

    Donated exactly as the same call with array leaves only: the function for these static
    leaves traces its program, which decides what its one executable donates; the reference
    checks run on the caller's own arguments (static leaves skipped: they are constants of the
    program), before the split trees exist, since those hold the arguments too. With ``plans``
    (the site's, for a call without a bound instance), the decision for this signature is kept
    there for the next call (``remember_static_leaves``). With ``outcomes``, what the call
    donated and why the checks refused the rest (``plan_donating``).
    """
    policy = of._policy
    split = split_if_static(args, kwargs, policy.static_argnums, policy.static_argnames)
    if split is None:
        return None
    sub = of._static_leaf_fn(split.key)
    if _compat.jit_disabled() or _compat.debug_nans_enabled():
        return of._static_leaf_plan(split)
    program = sub._program_for_call(split.args, split.kwargs)
    if program is None:
        return of._static_leaf_plan(split)
    del split  # its trees hold the arguments: the reference counts below must not see them
    if policy.has_static:
        static = _trace.normalize_static(policy.static_argnums, len(args))
        positions = tuple(p for p in positions if p not in static)
        names = tuple(n for n in names if n not in policy.static_argnames)
    positions, names = _without_self_keeping(args, kwargs, positions, names)
    if host_callbacks(program.final):  # "safe" never donates into callbacks
        positions = names = ()
    pos = nms = ()
    decided = True
    try:
        d = program.decide((positions, names))
        reasons: tuple = ()
        # (the statement's targets must take the result apart: else they keep the old values)
        if program.unpacks_to(unpack):
            pos = tuple(p for p in positions if p in d[0])
            nms = tuple(n for n in names if n in d[1])
        elif outcomes is not None:
            reasons = _not_unpacked(positions, names, d)
        if pos or nms:
            pos, nms, reasons = callsite.donation_checks(
                args, kwargs, pos, nms, check_refs=True, bases=bases, exclude=program.const_ids
            )
        if outcomes is not None:
            # (a static-leaf plan's next calls are not observed: calls between refusals may
            # donate uncounted)
            outcomes.record((*pos, *nms), reasons, plans is None)
    except Exception as e:  # noqa: BLE001 - donation is an optimization; never break the call
        of._fall_back(e, "donation")
        d, pos, nms = program.decide((positions, names)), (), ()
        decided = False
    split = split_if_static(args, kwargs, policy.static_argnums, policy.static_argnames)
    assert split is not None  # the same arguments as above
    if decided and plans is not None and not kwargs and len(plans) < FAST_ENTRIES:
        remember_static_leaves(sub, plans, program, d, positions, args, split, unpack)
    return plan_for(sub, program, d, pos, nms)._replace(static=split, static_fn=sub, direct=False)


def remember_static_leaves(
    sub: Planned,
    plans: dict,
    program: Program,
    d: tuple,
    positions: tuple,
    args: tuple,
    split: _static_leaves.StaticSplit,
    unpack: tuple | None,
) -> None:
    """Record at a site, for positional arguments holding static leaves, the plan of their
    signature (``_static_leaves.StaticLeafPlan``): as ``remember_fast``, only the static half of
    the decision is kept (the executable of ``sub``, the function for these leaves; what the
    site proves and the signature allows to donate), and only where every call of the
    signature that passes the run-time checks runs that executable as it is."""
    policy = sub._policy
    if policy.has_static or policy.verify or program.lost_updates or d[1]:
        return
    table = plans.get(_static_leaves.STATIC_LEAF_PLANS)
    if table is None:
        table = plans[_static_leaves.STATIC_LEAF_PLANS] = {}
    found = _static_leaves.static_leaf_signature(args)
    if found is None or len(table) >= FAST_ENTRIES:
        return
    key, trees = found
    donatable = _static_leaves.donatable_by_signature
    pos = ()
    if program.unpacks_to(unpack):
        pos = tuple(p for p in positions if p in d[0] and p < len(trees) and donatable(trees[p]))
    if any(p not in pos for p in d[0]):
        return  # calls here pass copies of what the executable donates: the general path
    jit = sub._jit_for(*d) if d[0] else sub._plain
    host = _static_leaves.holds_host_leaves(trees)
    placer = sub._placer if host or placer_needed(sub, program) else None
    plan = _static_leaves.static_leaf_plan(
        split, sub._fn, _plans.kept(jit, placer), pos, trees, callsite.CALL_REFS
    )
    if plan is not None:
        try:
            table[key] = plan
        except Exception:  # noqa: BLE001 - unhashable node data: no plan
            pass


def plan_kept(of: Planned, args: tuple, kwargs: dict, site: Any) -> CallPlan:
    """The plan of a call at a site that donates nothing: the signature's executable, with
    copies of what it donates. A signature's first call made here fixes the plain executable
    (a device copy at every call would cost more than donation saves: benchmarks/RESULTS.md),
    unless the site passes fresh values (``state = step(init(), batch)``, how a loop that
    donates starts): then the executable donates what an output can alias, and only this
    call pays for copies."""
    program = of._program_for_call(args, kwargs)
    if program is None:
        return of._plain_plan
    fresh = any(why.startswith(_PASSED_FRESH) for _, why in site.proof.reasons)
    fresh = fresh and not host_callbacks(program.final)  # "safe" never donates into callbacks
    d = program.decide(None if fresh else ((), ()))
    if (d[0] or d[1]) and not fresh and _copies_paid_for(of, site, program, d, args, kwargs):
        d = ((), ())  # the plain executable from now on: one more compile, no more copies
    plan = plan_for(of, program, d, (), (), args)
    plans = site.plans
    if plan.direct and not program.lost_updates and len(plans) < FAST_ENTRIES:
        found = _plan_key(of._policy, args, kwargs)
        if found is not None:
            sig, _, host = found
            lean = not host and not placer_needed(of, program)
            placer = None if lean else plan.placer
            general = of._jit_for(*d) if d[0] or d[1] else of._plain
            if of._policy.has_static:
                plans[sig] = _plans.static_plan(
                    general, (), placer, frozenset(), True, bool(kwargs)
                )
            else:
                plans[sig] = _with_twin(
                    of, program, d, general, lambda jit: _plans.kept(jit, placer)
                )
    return plan


def _copies_paid_for(
    of: Planned, site: Any, program: Program, d: tuple, args: tuple, kwargs: dict
) -> bool:
    """(A call at a site that donates nothing, whose signature's executable donates ``d``: it
    passes device copies, on every call, and takes the general path.) Whether the site runs the
    plain executable now: its calls have copied as often and as long as a refused site's
    before it narrows (``REFUSALS_BEFORE_NARROWING``; every call of such a site copies, so
    the count is of calls). A site whose source cannot be read (``exec``'d code, a module
    without its ``.py``) or which passes an argument that is also used later, calling a
    function whose first call elsewhere donated, would otherwise pay copies forever. Sites
    with keyword or static arguments and the processes of a jax.distributed job (one
    executable) never switch."""
    if kwargs or of._policy.has_static or _multiprocess.several() or program.lost_updates:
        return False
    found = _plan_key(of._policy, args, kwargs)
    if found is None:
        return False
    sig = found[0]
    row = site.refusals.get(sig)
    if row is None:
        if len(site.refusals) >= FAST_ENTRIES:
            site.refusals.clear()
        row = site.refusals[sig] = Refusals(d[0])
    row.count += 1
    row.narrowed = row.narrowed or row.paid_for(program.compile_s)
    return row.narrowed


def _with_twin(
    of: Planned, program: Program, d: tuple, jit: Any, make: Callable[[Any], Callable]
) -> Callable:
    """``make(jit)``, the plan over the signature's jit object; where the program has a
    ``bounded`` twin, the plan choosing per call between it and ``make`` of the twin's jit
    object (``_plans.bounded``)."""
    plan = make(jit)
    if program.bounded is None:
        return plan
    checks = program.bounded[0]
    return _plans.bounded(plan, make(of._jit_for(d[0], d[1], checks)), checks)


def _plan_key(policy: Policy, args: tuple, kwargs: dict) -> tuple[Any, str, bool] | None:
    """``(key, kind, host)`` a call's plan is kept under (``_plans.signature_of``; with static
    arguments ``_plans.static_key``, the kind and host leaves those of the dynamic arguments),
    or None where it can have none."""
    if policy.has_static:
        keyed = _plans.static_key(args, kwargs, policy.static_argnums, policy.static_argnames)
        if keyed is None:
            return None
        found = _plans.signature_of(keyed[1])
        return None if found is None else (keyed[0], found[1], found[2])
    return None if kwargs else _plans.signature_of(args)


# callsite's reason for an argument written as an expression (a fresh value, not a name)
_PASSED_FRESH = "it is passed as an expression"


def plan_for(
    of: Planned,
    program: Program,
    d: tuple[tuple, tuple],
    pos: tuple,
    nms: tuple,
    args: tuple | None = None,
) -> CallPlan:
    """The plan running the executable donating ``d``, of which the call donates ``pos`` and
    ``nms`` and passes copies of the rest; with ``args`` (the call's positional arguments),
    that of the program's ``bounded`` twin where they are in its bounds, so a signature's first
    call compiles the executable the next calls in bounds run (``_plans.bounded``)."""
    twin = (
        program.bounded[0]
        if args is not None
        and program.bounded is not None
        and _plans.in_bounds(args, program.bounded[0])
        else ()
    )
    if not (d[0] or d[1]):
        return of._plain_plan._replace(jit=of._jit_for((), (), twin)) if twin else of._plain_plan
    policy = of._policy
    copies = (tuple(p for p in d[0] if p not in pos), tuple(n for n in d[1] if n not in nms))
    if not (copies[0] or copies[1]):
        copies = ()
    return CallPlan(
        of._jit_for(*d, twin),
        pos,
        of._placer,
        program.const_ids,
        nms,
        policy.verify,
        direct=not policy.verify and not copies,
        copies=copies,
    )


def remember_fast(
    of: Planned,
    fast: dict,
    program: Program | None,
    positions: tuple,
    args: tuple,
    unpack: tuple | None,
    check_refs: bool,
    kwargs: dict | None = None,
) -> None:
    """Record, for a call of positional arguments whose leaves are all jax arrays, Python
    scalars or NumPy arrays, the plan for its signature (``_plans``). For a function with
    static arguments, the signature holds their values (``_plans.static_key``), and they may
    be passed by keyword.

    Only the static half of the decision is cached (the program's aliasing, the call site's
    proof); the plan re-checks the run-time half (no other reference, not deleted, no array
    twice) on every call.
    """
    policy = of._policy
    found = _plan_key(policy, args, kwargs or {})
    if found is None:
        return
    sig, kind, host = found
    is_donatable: Callable = callsite.is_array if kind == "flat" else callsite.all_array_leaves
    program = program or of._program_for_call(args, kwargs or {})
    if program is None:
        return  # the program captured an outer tracer: never cached
    if program.lost_updates:
        return  # every call checks its arguments (``OptimizedFunction._run``)
    d = program.donates
    if d is None or d[1]:
        return
    arrays = tuple(p for p in positions if p < len(args) and is_donatable(args[p]))
    pos = tuple(p for p in arrays if p in d[0]) if program.unpacks_to(unpack) else ()
    if any(p not in pos for p in d[0]):
        # The executable donates a position this site does not (its calls pass copies of its
        # arrays), or one the plan would not check (it holds no array now: one put there
        # between the plan's lookup and the call would be deleted): the general path decides.
        return
    jitted, placer = _jit_and_placer(of, program, d, host)
    # The program's own constants are never donated: under "safe" the reference counts already
    # refuse them (the program holds one); "auto" compares identities.
    if policy.has_static:
        fast[sig] = _plans.static_plan(
            jitted, pos, placer, program.const_ids, check_refs, bool(kwargs)
        )
    else:
        fast[sig] = _with_twin(
            of,
            program,
            d,
            jitted,
            lambda jit: _plans.donating(jit, pos, placer, program.const_ids, check_refs, kind),
        )


def _jit_and_placer(of: Planned, program: Program, d: tuple, host: bool) -> tuple[Any, Any]:
    """The jit object of the executable donating ``d`` (positions only), and the placer a
    cached plan of ``program`` calls through: for NumPy leaves (``host``), or where
    ``placer_needed`` says so; else None."""
    jitted = of._jit_for(*d) if d[0] else of._plain
    return jitted, (of._placer if host or placer_needed(of, program) else None)


def placer_needed(of: Planned, program: Program) -> bool:
    """Whether a call of ``program`` without NumPy leaves must go through the placer: for large
    constants it passes as arguments, or when an option makes it act on every call. Otherwise it
    has nothing to do: it only counts Python scalars as implicit transfers, which the
    signature's first (general) call already did."""
    placer = of._placer
    return placer is not None and (of._policy.placer_every_call or placer.hoists(program))


def with_copies(args: tuple, kwargs: dict, copies: tuple) -> tuple[tuple, dict]:
    """The arguments with every jax array under ``copies`` (positions, names) replaced by a
    fresh device copy (``device_copies``)."""
    positions, names = copies
    keys = [p for p in positions if p < len(args)] + [n for n in names if n in kwargs]
    # (a list, not a dict keyed by both: jax sorts a dict's keys, and an int and a str do not
    # compare)
    leaves, treedef = jax.tree_util.tree_flatten(
        [args[k] if isinstance(k, int) else kwargs[k] for k in keys]
    )
    at = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    if not at:
        return args, kwargs
    copied = device_copies([leaves[i] for i in at])
    for i, c in zip(at, copied):
        leaves[i] = c
    picked = dict(zip(keys, jax.tree_util.tree_unflatten(treedef, leaves)))
    args = tuple(picked.get(i, a) for i, a in enumerate(args))
    kwargs = {k: picked.get(k, v) for k, v in kwargs.items()}
    return args, kwargs


# Copies of one set of arrays (by aval) made by ``jax.device_put`` before a compiled copy takes
# over: device_put compiles nothing but costs tens of jit dispatches per small array, a compiled
# copy one dispatch after a compile of tens of milliseconds (benchmarks/RESULTS.md, "kept").
COPIES_BEFORE_COMPILING = 16
_copy_counts: dict[tuple, int] = {}
_compiled_copy: Any = None


def _copy_all(xs: list) -> list:
    import jax.numpy as jnp

    return [jnp.copy(x) for x in xs]


def _put_copies(arrays: list) -> list:
    """``jax.device_put(arrays, may_alias=False)`` with each committed array's own sharding as
    its target: without one, jax 0.10.2 puts a typed PRNG key array on the default device,
    uncommitted, and a replicated one's "copy" there is shard 0's own buffer (donating it
    deleted the caller's key)."""
    targets = [x.sharding if x.committed else None for x in arrays]
    return jax.device_put(arrays, targets, may_alias=False)


def device_copies(arrays: list) -> list:
    """Fresh device buffers holding ``arrays``' values, with their shardings and committedness
    (a deleted array raises jax's own error). The first ``COPIES_BEFORE_COMPILING`` copies of
    a set of single-device arrays go through ``jax.device_put(may_alias=False)``, later ones
    through one compiled copy; multi-device arrays and sets holding a committed array always
    through ``device_put``, whose result keeps their sharding and committedness exactly (a
    compiled copy's sharding is XLA's choice)."""
    global _compiled_copy
    if not all(isinstance(x.sharding, jax.sharding.SingleDeviceSharding) for x in arrays):
        if all(x.is_fully_addressable for x in arrays):
            return _put_copies(arrays)
        # A global array of a jax.distributed job: this process copies its own shards only
        # (a device_put would be a cross-process transfer, which every process must join).
        return [
            jax.make_array_from_single_device_arrays(
                x.shape,
                x.sharding,
                [jax.device_put(s.data, s.device, may_alias=False) for s in x.addressable_shards],
            )
            for x in arrays
        ]
    if any(x.committed for x in arrays):
        # A jit's outputs are all committed when one input is: the copies of the uncommitted
        # ones would be a new signature for the step (a recompile), so device_put keeps each.
        return _put_copies(arrays)
    key = tuple(x.aval for x in arrays)
    count = _copy_counts.get(key, 0)
    if count < COPIES_BEFORE_COMPILING:
        if len(_copy_counts) >= 4096:  # many sets of leaves seen once: forget them
            _copy_counts.clear()
        _copy_counts[key] = count + 1
        return _put_copies(arrays)
    if _compiled_copy is None:
        _compiled_copy = jax.jit(_copy_all)
    return _compiled_copy(arrays)
