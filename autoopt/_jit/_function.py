"""``optimize`` and ``OptimizedFunction``: the signature cache and the call path.

How a call runs. ``jax.jit`` wraps a small function (``_wrapper``) that, while jit traces it,
traces the user's function once to a jaxpr, runs the passes, and evaluates the optimized jaxpr
into jit's trace. So JAX's own C++ dispatch keeps the signature cache: a cached call costs what
``jax.jit`` costs plus one Python method call (and, under ``donate="safe"``, one dict lookup on
the caller's code position). A naive ``make_jaxpr`` + ``jit`` per call costs ~26 ms; this path
costs microseconds.

Donation varies per call (the ``"safe"`` proof depends on the caller's statement), so there is
one ``jax.jit`` object per donated-argument set. Choosing it in full (reference walk, call-side
signature, the program's aliasing) costs 5-7 us; a call site that passes flat arguments (jax
arrays and Python scalars) caches that choice per signature (``_Site``) and re-checks only
what can change between calls, about 1 us (``_callsite.fast_hit``). Each traces the wrapper separately, but the
wrapper caches the traced and optimized program per signature, so the user's function is
traced once per signature whatever the variant.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np
from jax import tree_util

from autoopt import _compat, _jaxpr, _trace
from autoopt.passes.donation import _callsite
from autoopt._errors import AutooptWarning, PassError
from autoopt._options import Options
from autoopt.passes import PassContext, PipelineResult, jit_options_for, make_options, option_names, run_pipeline

log = logging.getLogger("autoopt")

__all__ = ["optimize", "explain", "OptimizedFunction"]


def _fn_location(fn: Callable) -> str | None:
    try:
        code = fn.__code__
        return f"{code.co_filename}:{code.co_firstlineno}"
    except AttributeError:
        return None


def _unwrap_jit(fn: Callable) -> Callable:
    """A ``jax.jit``-wrapped function is unwrapped; the options given to ``optimize`` apply."""
    while isinstance(fn, jax.stages.Wrapped) or type(fn).__name__ in ("PjitFunction", "JitWrapped"):
        inner = getattr(fn, "__wrapped__", None)
        if inner is None:
            break
        fn = inner
    if isinstance(fn, OptimizedFunction):
        fn = fn.__wrapped__
    return fn


def _check_callable(fn: Any) -> None:
    if not callable(fn):
        raise TypeError(
            f"optimize() needs a function, got {type(fn).__name__} ({fn!r:.60}). "
            "Use it as a decorator (@autoopt.optimize) or call autoopt.optimize(my_function)."
        )
    target = getattr(fn, "__func__", fn)
    if inspect.isgeneratorfunction(target) or inspect.isasyncgenfunction(target):
        raise TypeError(
            f"optimize() cannot compile the generator function {getattr(fn, '__name__', fn)!r}: "
            "a jitted function must return arrays. Optimize the per-step function it calls instead."
        )
    if inspect.iscoroutinefunction(target):
        raise TypeError(
            f"optimize() cannot compile the coroutine function {getattr(fn, '__name__', fn)!r}: "
            "make it a plain function returning arrays."
        )


def _check_argnums(fn: Callable, options: Options) -> None:
    """donate_argnums/static_argnums must name parameters the function has (jax.jit's own
    message says what is wrong but not what to pass instead)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for kw in ("donate_argnums", "static_argnums"):
        value = options.jit_kwargs.get(kw)
        nums = (value,) if isinstance(value, int) else tuple(value or ())
        bad = [i for i in nums if not -len(names) <= i < len(names)]
        if bad:
            raise ValueError(
                f"{kw}={value!r}: {getattr(fn, '__name__', 'the function')} takes "
                f"{len(names)} positional argument(s) ({', '.join(names) or 'none'}), so there is "
                f"no argument {bad[0]}. Pass positions from 0 to {len(names) - 1}, or name the "
                f"arguments with {kw.replace('nums', 'names')}=."
            )


def _framework_check(args: tuple, kwargs: dict) -> None:
    """Refuse framework objects whose mutations plain jax.jit would drop without a word."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return
    base = getattr(nnx, "Pytree", None) or getattr(nnx, "Object", None)
    if base is None:
        return
    for i, a in enumerate(list(args) + list(kwargs.values())):
        if isinstance(a, base):
            raise TypeError(
                f"Argument {i} is a flax.nnx {type(a).__name__}. Functions that mutate nnx objects "
                "lose those updates under jax.jit and under autoopt.optimize. Split it and pass "
                "the state: `graphdef, state = nnx.split(model)`, inside the function "
                "`model = nnx.merge(graphdef, state)` ... `return nnx.state(model), ...`, or use "
                "nnx.jit for functions that mutate modules in place."
            )


def _concrete_type(x: Any):
    aval = getattr(x, "aval", None)  # a stored attribute on jax.Array: no computation
    if aval is not None:
        return aval
    t = type(x)
    if t in _PY_SCALARS:  # Python scalars: weak-typed, one signature per type (as in jax.jit)
        return t
    return _trace.leaf_type(x)


_PY_SCALARS = frozenset({int, float, complex, bool})


# --- non-array leaves ---------------------------------------------------------------------------
# Equinox modules carry activation functions, flags and other Python objects as pytree leaves;
# jax.jit refuses them. As ``equinox.filter_jit`` does, such leaves are made static: each argument
# holding them is passed as the same tree with those leaves set to None, and a function per set
# of static leaves puts them back (and takes non-array leaves out of the output the same way).
# Only tried after jax.jit has refused the call, so the normal call path pays nothing.

_ARRAY_LEAF_TYPES = (jax.Array, np.ndarray, np.generic, bool, int, float, complex, jax.ShapeDtypeStruct)


def _split_tree(where, value) -> tuple[Any, tuple | None]:
    """``(value with its non-array leaves set to None, (where, treedef, ((index, leaf), ...)))``;
    the second is None when every leaf is an array."""
    leaves, treedef = tree_util.tree_flatten(value)
    fixed = tuple((j, x) for j, x in enumerate(leaves)
                  if not (isinstance(x, _ARRAY_LEAF_TYPES) or hasattr(x, "__jax_array__")))
    if not fixed:
        return value, None
    at = dict(fixed)
    return tree_util.tree_unflatten(treedef, [None if j in at else x for j, x in enumerate(leaves)]), \
        (where, treedef, fixed)


def _put_back(part: tuple | None, value):
    """Inverse of ``_split_tree``."""
    if part is None:
        return value
    _, treedef, fixed = part
    at, arrays = dict(fixed), iter(tree_util.tree_leaves(value))
    return tree_util.tree_unflatten(treedef, [at[j] if j in at else next(arrays)
                                              for j in range(treedef.num_leaves)])


def _split_static_leaves(args: tuple, kwargs: dict, static_argnums, static_argnames):
    """``(key, dyn_args, dyn_kwargs)``, or None when every leaf is an array. ``key`` (hashable)
    holds each split argument's ``_split_tree`` part."""
    static_pos = _trace.normalize_static(static_argnums, len(args))
    parts: list = []

    def split(where, value):
        dyn, part = _split_tree(where, value)
        if part is not None:
            try:
                hash(part)
            except TypeError:
                bad = next(x for _, x in part[2] if not isinstance(x, Hashable))
                raise TypeError(
                    f"Argument {where!r} holds a {type(bad).__name__}, which is neither an array "
                    "nor hashable, so it can be neither traced nor made static. Make it hashable, "
                    "or pass the argument with static_argnums/static_argnames."
                ) from None
            parts.append(part)
        return dyn

    dyn_args = tuple(a if i in static_pos else split(i, a) for i, a in enumerate(args))
    dyn_kwargs = {k: v if k in static_argnames else split(k, v) for k, v in kwargs.items()}
    return (tuple(parts), dyn_args, dyn_kwargs) if parts else None


def _array_signature(args: tuple, kwargs: dict) -> tuple:
    """The same for concrete arrays and for tracers of them (static arguments by value)."""
    leaves, treedef = tree_util.tree_flatten((args, kwargs))
    return treedef, tuple(_trace.leaf_type(x) if isinstance(x, jax.Array | np.ndarray) else x
                          for x in leaves)


def _with_static_leaves(fn: Callable, key: tuple) -> Callable:
    """``fn`` taking the arguments ``_split_static_leaves`` made, with the static leaves put back;
    its output's non-array leaves are kept in ``.output_parts`` (per argument signature) for
    ``_put_back`` after the call."""
    by_arg = {part[0]: part for part in key}

    @functools.wraps(fn)  # jax.jit reads the signature (static_argnames) through __wrapped__
    def with_static_leaves(*args, **kwargs):
        sig = _array_signature(args, kwargs)
        args = tuple(_put_back(by_arg.get(i), a) for i, a in enumerate(args))
        out = fn(*args, **{k: _put_back(by_arg.get(k), v) for k, v in kwargs.items()})
        out, part = _split_tree("output", out)
        with_static_leaves.output_parts[sig] = part
        return out

    with_static_leaves.output_parts = {}
    return with_static_leaves


class _Program:
    """One signature's traced program and everything decided about it. Immutable after build,
    except for the small memo of donatable sets (a dict; writes are atomic)."""

    __slots__ = ("traced", "pipeline", "final", "fallback_reason", "_donatable", "verified",
                 "_const_ids")

    def __init__(self, traced: _trace.TracedProgram, pipeline: PipelineResult | None,
                 fallback_reason: str | None):
        self.traced = traced
        self.pipeline = pipeline
        self.final = pipeline.jaxpr if pipeline is not None else traced.closed
        self.fallback_reason = fallback_reason
        self._donatable: dict = {}
        self.verified = False
        self._const_ids: frozenset[int] | None = None

    @property
    def const_ids(self) -> frozenset[int]:
        """Identities of the arrays the traced or optimized program holds as constants."""
        if self._const_ids is None:
            self._const_ids = _jaxpr.const_ids(self.traced.closed) | _jaxpr.const_ids(self.final)
        return self._const_ids

    def unpacks_to(self, n: int | None) -> bool:
        """The result unpacks into ``n`` targets (``a, b = f(x)``); True when not unpacked."""
        if n is None:
            return True
        tree = self.traced.out_tree
        data = tree.node_data()  # None for a single leaf
        return (data is not None and issubclass(data[0], tuple | list)
                and len(tree_util.treedef_children(tree)) == n)

    def donatable(self, positions: tuple, names: tuple) -> tuple[tuple, tuple]:
        """The subset of candidate arguments whose every leaf an output aliases."""
        key = (positions, names)
        hit = self._donatable.get(key)
        if hit is not None:
            return hit
        from autoopt.passes.donation import donatable_args

        t = self.traced
        chosen, _ = donatable_args(self.final.in_avals, self.final.out_avals, t.in_arg_of_leaf,
                                   list(positions) + list(names))
        hit = (tuple(p for p in positions if p in chosen), tuple(n for n in names if n in chosen))
        self._donatable[key] = hit
        return hit


# Per call site, at most this many signatures keep a fast-path decision (a loop over many
# shapes falls back to the general path, which is correct, only slower).
_FAST_ENTRIES = 32


class _Site:
    """One call site of an OptimizedFunction: its proof, and the fast path's decisions.

    ``fast`` maps the signature of flat positional arguments (every one a jax array or a Python
    scalar: ``_callsite.flat_signature``) to ``(jit object, donated positions)``. None when the
    function has static arguments or ``verify=True``, whose general path does more per call.
    """

    __slots__ = ("proof", "donates", "fast")

    def __init__(self, proof: _callsite.CallSiteProof, fast: dict | None):
        self.proof = proof
        self.donates = proof.any  # read on every call: an attribute, not the property
        self.fast = fast


_JAX_DIR = os.path.dirname(os.path.abspath(jax.__file__)) + os.sep


class OptimizedFunction:
    """What ``optimize`` returns: call it like the ``jax.jit`` of the original function."""

    def __init__(self, fn: Callable, options: Options):
        self.__wrapped__ = fn
        functools.update_wrapper(self, fn, updated=())
        self._options = options
        self._static_argnums = options.static_argnums
        self._static_argnames = options.static_argnames
        backend = options.jit_kwargs.get("backend") or jax.default_backend()
        self._backend = backend
        jit_kwargs = dict(options.jit_kwargs)
        for k, v in jit_options_for(options, backend).items():
            if k == "compiler_options":
                jit_kwargs["compiler_options"] = {**v, **(jit_kwargs.get("compiler_options") or {})}
            else:
                jit_kwargs.setdefault(k, v)
        # jax.jit refuses compiler_options on a jit called inside another trace (grad, an outer
        # jit, vmap): such calls go to a jit without them (the outer program's options govern
        # the whole computation anyway). None when there are no compiler options.
        nested_kwargs = {k: v for k, v in jit_kwargs.items() if k != "compiler_options"}
        self._nested_kwargs = nested_kwargs if jit_kwargs != nested_kwargs else None
        self._nested = None
        # Eager autodiff (see _eager_ad_call): checked on every call only while remat could plan
        # a forward for it (~0.2 us a call): until the first program is built, then only if a
        # program was a forward remat can plan (passes.remat.forward_plannable). A training
        # step with its own backward, or remat off, stops paying after its first call.
        self._remat_auto = options.remat == "auto" and not options.explicit_donation
        self._watch_autodiff = self._remat_auto
        self._any_plannable = False
        self._eager_ad_jit = None
        self._explicit_donation = options.explicit_donation
        self._jit_kwargs = jit_kwargs
        self._policy = "explicit" if options.explicit_donation else options.donate
        self._programs: dict[tuple, _Program] = {}  # trace-side signature -> program
        self._eager_ad_programs: dict[tuple, _Program] = {}  # the same, for _eager_ad_call
        self._by_concrete: dict[tuple, _Program] = {}  # call-side signature -> program
        self._tls = threading.local()  # the program the last trace on this thread used
        self._has_static = bool(self._static_argnums or self._static_argnames)
        self._key_locks: dict[tuple, threading.RLock] = {}
        self._lock = threading.Lock()
        self._warned = False
        self._sites: dict[tuple, _Site] = {}
        # The fast path needs no static arguments (their positions shift the flat signature)
        # and no verify=True (which checks the first call of each signature).
        self._fast_ok = not self._has_static and not options.verify
        self._auto_fast: dict | None = {} if self._fast_ok else None
        self._site_reasons: dict[str, _callsite.CallSiteProof] = {}
        self._wrapper = self._make_wrapper()
        self._jits: dict[tuple, Any] = {}
        self._plain = self._jit_for((), ())
        self._fn_location = _fn_location(fn)
        self._static_leaf_fns: dict[tuple, OptimizedFunction] = {}  # see _split_static_leaves
        from autoopt.passes.placement._placer import placer_for

        # Host inputs (packing, cached constants), scalar canonicalization, transfer guard; None
        # when no option asks for any of them. See _placement.
        self._placer = placer_for(self)
        # Options under which the placer acts on every call, arrays or not (see _remember_fast).
        self._placer_every_call = (options.transfer_guard in ("log", "disallow")
                                   or bool(options.canonicalize_scalars))

    # --- jit objects ---------------------------------------------------------------------------

    def _make_wrapper(self, eager_autodiff: bool = False) -> Callable:
        """The function jax.jit traces. ``eager_autodiff``: the wrapper of ``_eager_ad_jit``,
        whose programs are planned for a caller that differentiates them eagerly (see there)."""
        fn = self.__wrapped__

        def wrapper(*args, **kwargs):
            # large constants the placer passes as device arguments (see _hoist)
            hoisted = kwargs.pop("_autoopt_hoisted", None) if kwargs else None
            if "_autoopt_packed" in kwargs:  # host leaves the placer packed: slice them back
                from autoopt.passes.placement._packing import unpack

                args, kwargs = unpack(args, kwargs)
            if _compat.jit_disabled():
                # jax.jit calls us eagerly under disable_jit: run the original, as jit would.
                return fn(*args, **kwargs)
            program, leaves = self._program_for(args, kwargs, eager_autodiff)
            outs = self._evaluate(program, leaves, hoisted)
            return tree_util.tree_unflatten(program.traced.out_tree, outs)

        # jax.jit reads the signature (static_argnames, donate_argnames) through __wrapped__.
        functools.update_wrapper(wrapper, fn, updated=())
        return wrapper

    def _jit_for(self, positions: tuple, names: tuple):
        key = (positions, names)
        j = self._jits.get(key)
        if j is not None:
            return j
        with self._lock:
            j = self._jits.get(key)
            if j is not None:
                return j
            kw = dict(self._jit_kwargs)
            if not self._explicit_donation:
                kw["donate_argnums"] = positions
                kw["donate_argnames"] = names
            j = jax.jit(self._wrapper, **kw)
            self._jits[key] = j
        return j

    # --- tracing and passes (runs inside jax.jit's trace) -------------------------------------

    def _program_for(self, args: tuple, kwargs: dict,
                     eager_autodiff: bool = False) -> tuple[_Program, list]:
        dyn_tree, statics = _trace.split_args(args, kwargs, self._static_argnums, self._static_argnames)
        leaves, in_tree = tree_util.tree_flatten(dyn_tree)
        key = _trace.signature_key(leaves, in_tree, statics, len(args))
        programs = self._eager_ad_programs if eager_autodiff else self._programs
        program = programs.get(key)
        if program is not None:
            self._tls.last_program = program
            return program, leaves
        with self._lock:
            lock = self._key_locks.setdefault((key, eager_autodiff), threading.RLock())
        with lock:
            program = programs.get(key)
            if program is None:
                program = self._build(args, kwargs, eager_autodiff)
                if not program.traced.captures_tracers:
                    programs[key] = program
        self._tls.last_program = program
        return program, leaves

    def _build(self, args: tuple, kwargs: dict, eager_autodiff: bool = False) -> _Program:
        _framework_check(args, kwargs)
        # The user's own errors (shape mismatches, non-array outputs) propagate unchanged, as
        # from jax.jit: they are not autoopt's to swallow.
        traced = _trace.trace_program(self.__wrapped__, args, kwargs,
                                      self._static_argnums, self._static_argnames)
        ctx = PassContext(
            options=self._options,
            in_leaf_names=traced.in_leaf_names,
            in_arg_of_leaf=traced.in_arg_of_leaf,
            out_leaf_names=traced.out_leaf_names,
            backend=self._backend,
            fn_name=getattr(self.__wrapped__, "__name__", "fn"),
            fn_location=self._fn_location,
            under_autodiff=eager_autodiff,
        )
        if self._remat_auto and not eager_autodiff:
            from autoopt.passes.remat import forward_plannable

            if forward_plannable(traced.closed):
                self._any_plannable = True  # (never reset: one plannable program keeps it)
            self._watch_autodiff = self._any_plannable
        try:
            pipeline = run_pipeline(traced.closed, ctx)
        except PassError as e:
            self._fall_back(e, e.pass_name)
            program = _Program(traced, None, str(e))
        else:
            program = _Program(traced, pipeline, None)
        if self._options.explain:
            from autoopt.report._report import log_report

            log_report(self, program)  # once per signature: _build runs once per signature
        return program

    def _evaluate(self, program: _Program, leaves: list, hoisted=None) -> list:
        final, original = program.final, program.traced.closed
        if self._placer is not None:  # large constants become device arguments (_hoist)
            from autoopt.passes.placement._hoist import with_hoisted_consts

            final = with_hoisted_consts(final, hoisted)
        try:
            return _jaxpr.eval_closed(final, *leaves)
        except Exception as e:  # noqa: BLE001
            if program.final is original:
                raise  # the original program itself failed: the user's error
            self._fall_back(e, "evaluate")
            if self._placer is not None:
                original = with_hoisted_consts(original, hoisted)
            return _jaxpr.eval_closed(original, *leaves)

    def _fall_back(self, error: BaseException, where: str) -> None:
        if self._options.fallback == "raise":
            raise error
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"autoopt fell back to plain jax.jit for {getattr(self.__wrapped__, '__name__', 'fn')} "
                f"({where}): {str(error).rstrip('.')}. Results are unaffected; pass fallback='raise' to debug.",
                AutooptWarning,
                stacklevel=4,
            )

    # --- the call path -------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        try:  # free when nothing is raised (CPython 3.11+)
            if (self._watch_autodiff or self._nested_kwargs is not None) and \
                    not _compat.trace_state_clean():
                if self._watch_autodiff and _compat.eager_autodiff((args, kwargs)):
                    return self._eager_ad_call(args, kwargs)
                if self._nested_kwargs is not None:
                    if self._nested is None:
                        self._nested = jax.jit(self._wrapper, **self._nested_kwargs)
                    return self._nested(*args, **kwargs)
            policy = self._policy
            if policy == "safe":
                frame = sys._getframe(1)
                site = self._sites.get((frame.f_code, frame.f_lasti))
                if site is None:
                    site = self._prove(frame)
                del frame
                if site.donates:
                    fast = site.fast
                    if fast and not kwargs:  # see _Site: the cached decision for flat arguments
                        hit = _callsite.fast_hit(fast, args, True)
                        if hit is not None:
                            jitted, _, placer, _ = hit
                            return jitted(*args) if placer is None else placer(jitted, args, kwargs)
                    proof = site.proof
                    if proof.matches(args, kwargs):  # else positions would mean other arguments
                        return self._call_donating(proof.positions, proof.names, args, kwargs,
                                                   True, fast, unpack=proof.unpack)
            elif policy == "auto":
                fast = self._auto_fast
                if fast and not kwargs:
                    hit = _callsite.fast_hit(fast, args, False)
                    if hit is not None:
                        jitted, _, placer, _ = hit
                        return jitted(*args) if placer is None else placer(jitted, args, kwargs)
                return self._call_donating(tuple(range(len(args))), tuple(kwargs), args, kwargs,
                                           False, fast)
            if self._options.verify:
                self._verify(args, kwargs)
            placer = self._placer
            if placer is not None:
                return placer(self._plain, args, kwargs)
            return self._plain(*args, **kwargs)
        except TypeError:
            # jax.jit refuses non-array leaves (an equinox module's activation function).
            split = _split_static_leaves(args, kwargs, self._static_argnums, self._static_argnames)
            if split is None:
                raise
        return self._call_static_leaves(split)

    def _eager_ad_call(self, args: tuple, kwargs: dict):
        """A call differentiated eagerly (``jax.grad(f)(x)`` outside any jit): JAX runs the
        forward and the backward as two executables and keeps the forward's residuals alive in
        between, so remat plans for it are measured that way (``passes.remat``), in a program of
        its own: under an outer jit the two halves are one program again, where XLA:CPU merges
        checkpoints back (jax-ml/jax#19822). Nothing is donated (the arguments are traced)."""
        j = self._eager_ad_jit
        if j is None:
            with self._lock:
                if self._eager_ad_jit is None:
                    kw = {k: v for k, v in self._jit_kwargs.items()
                          if k not in ("compiler_options", "donate_argnums", "donate_argnames")}
                    self._eager_ad_jit = jax.jit(self._make_wrapper(eager_autodiff=True), **kw)
                j = self._eager_ad_jit
        return j(*args, **kwargs)

    def _static_leaf_fn(self, split: tuple) -> tuple[OptimizedFunction, tuple, dict]:
        """The optimized function for arguments with these static leaves (one per set of them)."""
        key, dyn_args, dyn_kwargs = split
        sub = self._static_leaf_fns.get(key)
        if sub is None:
            sub = OptimizedFunction(_with_static_leaves(self.__wrapped__, key), self._options)
            sub._fn_location = self._fn_location
            sub = self._static_leaf_fns.setdefault(key, sub)
        return sub, dyn_args, dyn_kwargs

    def _call_static_leaves(self, split: tuple):
        sub, args, kwargs = self._static_leaf_fn(split)
        # Under "safe" nothing is donated here: the proof's reference counts are about the
        # caller's objects, not the rebuilt trees. "auto" and explicit donation apply as usual.
        if self._policy == "auto":
            out = sub._call_donating(tuple(range(len(args))), tuple(kwargs), args, kwargs, False)
        else:
            if self._options.verify:
                sub._verify(args, kwargs)
            out = sub._plain(*args, **kwargs)
        parts = sub.__wrapped__.output_parts
        return _put_back(parts.get(_array_signature(args, kwargs)), out)

    def _prove(self, frame, shift: int = 0, key: tuple | None = None) -> _Site:
        """The call site's proof, cached; ``shift`` moves positions past a bound instance."""
        proof = _callsite.prove_call_site(frame, self)
        if shift:
            proof = dataclasses.replace(
                proof, positions=tuple(p + shift for p in proof.positions),
                reasons=tuple((k + shift if isinstance(k, int) else k, why)
                              for k, why in proof.reasons))
        static = set(self._static_argnums)
        if static or self._static_argnames:
            proof = dataclasses.replace(
                proof, positions=tuple(p for p in proof.positions if p not in static),
                names=tuple(n for n in proof.names if n not in self._static_argnames))
        site = _Site(proof, {} if self._fast_ok and not shift else None)
        self._sites[key or (frame.f_code, frame.f_lasti)] = site
        # A call from inside jax (jax.grad, vmap calling the function) is not the user's call
        # site: nothing is donated there (the arguments are traced), and the report should not
        # name a line of jax's own source.
        if proof.location and not frame.f_code.co_filename.startswith(_JAX_DIR):
            self._site_reasons[proof.location] = proof
        return site

    def _call_donating(self, positions: tuple, names: tuple, args: tuple, kwargs: dict,
                       check_refs: bool, fast: dict | None = None, bases: tuple | None = None,
                       unpack: int | None = None):
        """The general donating call: every check, then the jit object for what may be donated.

        Cost (measured, tiny function): ~5-7 us over a plain jax.jit call with donation, most of
        it the reference walk and the call-side signature. With ``fast`` (the site's cache), the
        decision for this signature is recorded there, so the next call with the same signature
        takes ``__call__``'s fast path (~1 us for flat arguments).
        """
        jitted = self._plain
        if not (_compat.jit_disabled() or _compat.debug_nans_enabled()):
            if self._has_static:
                static = _trace.normalize_static(self._static_argnums, len(args))
                positions = tuple(p for p in positions if p not in static)
                names = tuple(n for n in names if n not in self._static_argnames)
            # The program first, outside the try: tracing runs the user's function, whose errors
            # are the user's, as from jax.jit. And the references are counted after it, since a
            # trace may capture an argument as a constant (a global the function reads).
            program = self._program_concrete(args, kwargs) if positions or names else None
            try:
                if program is not None and program.unpacks_to(unpack):
                    pos, nms, _reasons = _callsite.donation_checks(
                        args, kwargs, positions, names, check_refs=check_refs, bases=bases,
                        exclude=program.const_ids)
                    pos, nms = program.donatable(pos, nms) if pos or nms else ((), ())
                    if pos or nms:
                        jitted = self._jits.get((pos, nms)) or self._jit_for(pos, nms)
                if fast is not None and not kwargs and len(fast) < _FAST_ENTRIES:
                    self._remember_fast(fast, program, positions, args, unpack)
            except Exception as e:  # noqa: BLE001 - donation is an optimization; never break the call
                self._fall_back(e, "donation")
                jitted = self._plain
        if self._options.verify:
            self._verify(args, kwargs)
        placer = self._placer
        if placer is not None:
            return placer(jitted, args, kwargs)
        return jitted(*args, **kwargs)

    def _remember_fast(self, fast: dict, program: _Program | None, positions: tuple,
                       args: tuple, unpack: int | None) -> None:
        """Record, for a call of positional arguments whose leaves are all jax arrays, Python
        scalars or NumPy arrays, which of ``positions`` this signature donates.

        Only the static half of the decision is cached (the program's aliasing, the call site's
        proof); the run-time half (no other reference, not deleted, no array twice) is
        re-checked on every fast call by ``_callsite.fast_hit``.
        """
        host = False
        if _callsite.is_flat(args):
            sig = _callsite.flat_signature(args)
            is_donatable = _callsite.is_array
        else:
            tree = _callsite.tree_signature(args)
            if tree is None:
                return
            sig, host = tree[0], _callsite.has_host_leaves(tree[1])
            is_donatable = _callsite.all_array_leaves
        program = program or self._program_concrete(args, {})
        if program is None:
            return  # the program captured an outer tracer: never cached
        arrays = tuple(p for p in positions if p < len(args) and is_donatable(args[p]))
        pos = program.donatable(arrays, ())[0] if arrays and program.unpacks_to(unpack) else ()
        jitted = (self._jits.get((pos, ())) or self._jit_for(pos, ())) if pos else self._plain
        # The placer stays in the call for NumPy leaves, for large constants it passes as
        # arguments, and when an option makes it act on every call. Otherwise it has nothing to
        # do: it only counts Python scalars as implicit transfers, which this first (general)
        # call already did, so the fast path skips it (~0.3 us a call).
        placer = self._placer
        if placer is not None and not (self._placer_every_call or host or placer.hoists(program)):
            placer = None
        # The program's own constants are never donated: under "safe" the reference counts
        # already refuse them (the program holds one); "auto" compares identities (fast_hit).
        fast[sig] = (jitted, pos, placer, program.const_ids)

    def _concrete_key(self, args: tuple, kwargs: dict) -> tuple:
        """Signature of concrete arguments, for finding their program without tracing.

        Cheaper than the trace-side key (``x.aval`` is a stored attribute of a jax.Array) and
        deliberately separate from it: the two sides never need to agree.
        """
        if self._has_static:
            dyn_tree, statics = _trace.split_args(args, kwargs, self._static_argnums, self._static_argnames)
        else:
            dyn_tree, statics = (args, kwargs), ()
        leaves, treedef = tree_util.tree_flatten(dyn_tree)
        return (treedef, statics, len(args), tuple(map(_concrete_type, leaves)),
                _compat.trace_context())

    def _program_concrete(self, args: tuple, kwargs: dict) -> _Program | None:
        """The program for concrete arguments, tracing (not compiling) on a miss."""
        ckey = self._concrete_key(args, kwargs)
        program = self._by_concrete.get(ckey)
        if program is None:
            dyn_tree, statics = _trace.split_args(args, kwargs, self._static_argnums,
                                                  self._static_argnames)
            leaves, in_tree = tree_util.tree_flatten(dyn_tree)
            key = _trace.signature_key(leaves, in_tree, statics, len(args))
            program = self._programs.get(key)
            if program is None:
                # jax.jit may answer .trace from its own cache without running our wrapper, so
                # take the program from the trace-side cache first, then from this thread's last.
                self._tls.last_program = None
                if self._placer is not None:  # may stop at large constants (see _hoist)
                    self._placer.trace_only(self._plain, args, kwargs)
                else:
                    self._plain.trace(*args, **kwargs)
                program = self._programs.get(key) or getattr(self._tls, "last_program", None)
            if program is not None and not program.traced.captures_tracers:
                self._by_concrete[ckey] = program
        return program

    def _verify(self, args: tuple, kwargs: dict) -> None:
        from autoopt._compare import assert_trees_equivalent

        program = self._program_concrete(args, kwargs)
        if program is None or program.verified:
            return
        static = dict(static_argnums=self._static_argnums or None,
                      static_argnames=self._static_argnames or None)
        expected = jax.jit(self.__wrapped__, **static)(*args, **kwargs)
        got = self._plain(*args, **kwargs)
        assert_trees_equivalent(expected, got, what=f"optimize(verify=True) of "
                                f"{getattr(self.__wrapped__, '__name__', 'fn')}")
        program.verified = True

    def __get__(self, instance, owner=None):
        # Decorating a method: bind like a function does (as jax.jit's wrappers do).
        if instance is None:
            return self
        return _BoundOptimized(self, instance)

    # --- AOT and explain -----------------------------------------------------------------------

    def _aot_jit(self, args: tuple, kwargs: dict):
        """The jit object a call would use when every aliasable argument is donated
        (``"auto"``), or the plain one otherwise."""
        if self._policy != "auto":
            return self._plain
        program = self._program_concrete(args, kwargs)
        if program is None:
            return self._plain
        pos, nms = program.donatable(tuple(range(len(args))), tuple(kwargs))
        return self._jit_for(pos, nms)

    def trace(self, *args, **kwargs) -> jax.stages.Traced:
        """As ``jax.jit(fn).trace``: the optimized program for these arguments."""
        split = _split_static_leaves(args, kwargs, self._static_argnums, self._static_argnames)
        if split is not None:
            sub, args, kwargs = self._static_leaf_fn(split)
            return sub.trace(*args, **kwargs)
        return self._aot_jit(args, kwargs).trace(*args, **kwargs)

    def lower(self, *args, **kwargs) -> jax.stages.Lowered:
        """As ``jax.jit(fn).lower``: the optimized program for these arguments."""
        split = _split_static_leaves(args, kwargs, self._static_argnums, self._static_argnames)
        if split is not None:
            sub, args, kwargs = self._static_leaf_fn(split)
            return sub.lower(*args, **kwargs)
        return self._aot_jit(args, kwargs).lower(*args, **kwargs)

    def explain(self, *args, **kwargs):
        """The Report for these arguments: findings, program diff, source edits, memory."""
        from autoopt.report import Report

        split = _split_static_leaves(args, kwargs, self._static_argnums, self._static_argnames)
        if split is not None:
            sub, args, kwargs = self._static_leaf_fn(split)
            return sub.explain(*args, **kwargs)
        program = self._program_concrete(args, kwargs)
        if program is None:
            raise ValueError("explain() cannot run on arguments traced by an enclosing "
                             "transformation; call it with concrete arrays.")
        report = Report.from_program(self, program, args=args, kwargs=kwargs)
        from autoopt.passes.placement._findings import findings_for

        report.add_findings(findings_for(self, program, args, kwargs))
        return report

    def __repr__(self) -> str:
        return f"<autoopt.optimize of {getattr(self.__wrapped__, '__qualname__', self.__wrapped__)!r}>"


class _BoundOptimized:
    """An OptimizedFunction bound to an instance (a decorated method).

    Under ``donate="safe"`` the call site's proof is about the arguments the caller wrote
    (``state = trainer.step(state, batch)``), so its positions shift by one for the instance,
    and the reference counts are checked against the baselines of this call shape
    (``_callsite.BOUND_BASES``). The instance itself is never proven dead. ``donate="auto"`` and
    explicit argnums work as for functions.
    """

    __slots__ = ("_owner", "_instance")

    def __init__(self, owner: OptimizedFunction, instance: Any):
        self._owner = owner
        self._instance = instance

    def __call__(self, *args, **kwargs):
        owner = self._owner
        # A new name, so the caller's tuple stays alive exactly as in the calibrated probe.
        full = (self._instance, *args)
        if owner._policy == "safe":
            frame = sys._getframe(1)
            key = ("bound", frame.f_code, frame.f_lasti)
            site = owner._sites.get(key)
            if site is None:
                site = owner._prove(frame, shift=1, key=key)
            del frame
            proof = site.proof
            if site.donates and proof.matches(args, kwargs):
                return owner._call_donating(proof.positions, proof.names, full, kwargs, True,
                                            bases=_callsite.BOUND_BASES, unpack=proof.unpack)
        elif owner._policy == "auto":
            return owner._call_donating(tuple(range(len(full))), tuple(kwargs), full, kwargs,
                                        False)
        if owner._placer is not None:
            return owner._placer(owner._plain, full, kwargs)
        return owner._plain(*full, **kwargs)

    def __getattr__(self, name):
        attr = getattr(self._owner, name)
        if name in ("lower", "trace", "explain"):
            return functools.partial(attr, self._instance)
        return attr


def optimize(fn: Callable | None = None, /, **options: Any):
    """As ``jax.jit``, but the program is optimized first (donation, in-place updates, remat,
    placement), computing the same numbers.

    Three forms: ``@optimize``, ``@optimize(donate="auto", ...)``, ``optimize(fn, ...)``. Every
    ``jax.jit`` keyword passes through. A function already wrapped by ``jax.jit`` is unwrapped;
    the options given here apply.
    """
    opts = make_options(**options)  # validate before anything is built
    if fn is None:
        return lambda f: optimize(f, **options)
    _check_callable(fn)
    fn = _unwrap_jit(fn)
    _check_argnums(fn, opts)
    return OptimizedFunction(fn, opts)


def explain(fn: Callable, *args: Any, **kwargs: Any):
    """``Report`` of what ``optimize`` finds and changes for ``fn(*args, **kwargs)``.

    Options of ``optimize`` may be given as keywords too; a keyword that is both an option and
    an argument of ``fn`` is taken as an option.
    """
    opts = {k: kwargs.pop(k) for k in list(kwargs) if k in option_names()}
    return optimize(fn, **opts).explain(*args, **kwargs)
