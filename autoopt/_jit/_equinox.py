"""``equinox.filter_jit`` with the donation proof made at the user's call site.

``eqx.filter_jit`` calls ``jax.jit`` once, from its own frame, and every call goes through
equinox's ``_call``: a proof made where ``jax.jit``'s function is called would read equinox's
statement, never the user's ``model, opt_state, loss = make_step(model, opt_state, x, y)``.
``EquinoxJit`` is called by the user's statement itself, so the proof is made there, as for an
``OptimizedFunction``, and the reference counts are read on the user's own objects before
anything is partitioned (the partitions hold the leaves too).

Equinox's semantics are kept: the arguments are bound to the signature, each is split into its
array leaves (``eqx.is_array``: jax and NumPy arrays; everything else, Python scalars included,
is static and hashed by jax.jit with the tree's structure, as equinox hashes it), the output's
non-array leaves come back through ``eqx.internal.Static``, and the call blocks on a marker
output so that ``eqx.error_if``'s runtime errors are raised by the call, as equinox raises
them. Only ``donate="none"`` (equinox's default) is routed here: a user who asked for donation
keeps equinox's own wrapper and its donation (``patch``).

Layout of the inner function (an ``OptimizedFunction`` with ``static_argnums=0``):
``(static, dynamic fun, dynamic keyword-only arguments, *dynamic positional arguments)``, so the
user's bound positional argument ``i`` is position ``i + FIRST_ARG``: one executable per
signature, whose donated set the first donating call fixes (``Program.decide``); a call that
must not donate passes copies, as every ``OptimizedFunction`` call does.

NB: the analogous code in Equinox is ``equinox._jit`` (``_preprocess``, ``fun_wrapped`` in
``_filter_jit_cache``, ``_call``).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
import warnings
from typing import Any

import jax

from autoopt import _compat
from autoopt._jit import _reuse
from autoopt._jit._dispatch import Policy, plan_for
from autoopt._jit._function import FRAMEWORK_ROUTES, OptimizedFunction, fn_location_of
from autoopt._jit._program import Site
from autoopt.passes import make_options
from autoopt.passes.donation import callsite, host_callbacks

__all__ = ["EquinoxJit", "FIRST_ARG", "is_filter_jit", "from_filter_jit"]

FIRST_ARG = 3  # static, dynamic fun, dynamic keyword-only arguments, then the positionals

# (name, qualname, location, options key) -> the inner OptimizedFunction (see EquinoxJit)
_INNERS: dict[tuple, OptimizedFunction] = {}


def forget_inner_functions() -> None:
    """Later wrappers build new inner functions (``_function.forget_wrappers``)."""
    _INNERS.clear()


def _inner_function(fun_name: str, fun_qualname: str):
    import equinox as eqx
    import jax.numpy as jnp
    from equinox._compile_utils import hashable_combine

    def fun_wrapped(static, dynamic_fun, dynamic_kwargs, *dynamic_args):
        static_fun, static_kwargs, static_args = static
        fun = hashable_combine(dynamic_fun, static_fun)
        kwargs = hashable_combine(dynamic_kwargs, static_kwargs)
        args = [hashable_combine(d, s) for d, s in zip(dynamic_args, static_args)]
        out = fun(*args, **kwargs)
        dynamic_out, static_out = eqx.partition(out, eqx.is_array)
        marker = jnp.array(0)
        return marker, dynamic_out, eqx.internal.Static(static_out)

    fun_wrapped.__name__ = fun_name
    fun_wrapped.__qualname__ = fun_qualname
    return fun_wrapped


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
        self._dynamic_fun, self._static_fun = hashable_partition(fun, eqx.is_array)
        self._is_array = eqx.is_array
        self._partition = hashable_partition
        name, qualname = get_fn_names(fun)
        opts = make_options(**{**options, "static_argnums": 0})
        location = fn_location_of(fun)
        policy = Policy.build(opts, location)
        self._donate = policy.donate  # "safe", "auto" or "off"
        # One inner function per name, location and options, shared by every wrapper, as
        # equinox shares its jax.jit per function name (``_filter_jit_cache``): a new
        # ``filter_jit(filter_grad(f))`` per call finds the programs of the first (the
        # function's static part, equal by equinox's ``==``, is the inner one's static argument,
        # hashed as jax.jit hashes it), and ``jax.grad`` of it JAX's caches of the first.
        key = _reuse.options_key(options)
        shared = (name, qualname, location, key) if key is not None else None
        inner = _INNERS.get(shared) if shared is not None else None
        if inner is None:
            inner = OptimizedFunction(_inner_function(name, qualname), opts, policy)
            # the caller's argument i is the inner function's FIRST_ARG + i (the summary)
            inner._proof_shift = FIRST_ARG  # pyright: ignore[reportAttributeAccessIssue]
            inner._proof_names = list(self._signature.parameters)  # pyright: ignore[reportAttributeAccessIssue]
            if shared is not None:
                inner = _INNERS.setdefault(shared, inner)
        self._inner = inner
        self._sites: dict = {}

    # --- the call --------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        __tracebackhide__ = True
        __equinox_jit_id__ = os.urandom(16)  # equinox's error_if looks for it up the stack
        try:
            positions: tuple = ()
            proof = None
            if self._donate != "off" and _compat.trace_state_clean():
                try:
                    frame = sys._getframe(1) if self._donate == "safe" else None
                except ValueError:  # no Python caller (a thread's entry point): no site
                    frame = None
                if frame is not None:
                    site = self._sites.get((id(frame.f_code), frame.f_lasti))
                    if site is None:
                        site = self._prove(frame)
                    proof = site.proof
                    if site.donates and proof.matches(args, kwargs):
                        if proof.check(frame, self, args, kwargs):
                            # On the user's own objects, before anything holds their leaves.
                            positions = self._bound_positions(proof, args, kwargs)
                            if positions:
                                positions = callsite.donation_checks(
                                    args, kwargs, positions, (), check_refs=True
                                )[0]
                    del frame
                elif self._donate == "auto":  # every argument an output can alias: promised
                    positions = tuple(range(len(args)))
            parts = self._parts(args, kwargs)
            return self._run(parts, positions, proof, __equinox_jit_id__)
        except Exception as e:
            _compat.filter_traceback(e)
            raise

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
        bound = self._signature.bind(*args, **kwargs)
        split = [self._partition(a, self._is_array) for a in bound.args]
        dyn_kwargs, static_kwargs = self._partition(bound.kwargs, self._is_array)
        static = (self._static_fun, static_kwargs, tuple(s for _, s in split))
        return (static, self._dynamic_fun, dyn_kwargs, *(d for d, _ in split))

    def _run(self, parts: tuple, positions: tuple, proof, jit_id: bytes):
        inner = self._inner
        if _compat.jit_disabled() or not _compat.trace_state_clean():
            plan = inner._dispatch(None, parts, {})  # eagerly, or inside a trace: as jax.jit
        else:
            plan = self._plan(parts, positions, proof)
        import equinox._jit as eqx_jit
        from equinox import combine

        filter = eqx_jit._FilterCallback()
        callback_logger = logging.getLogger("jax._src.callback")
        callback_logger.addFilter(filter)
        try:
            marker, dynamic_out, static_out = inner._run(plan, parts, {})
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
        return combine(dynamic_out, static_out.value)

    def _plan(self, parts: tuple, positions: tuple, proof):
        """The signature's one executable, donating ``positions`` (bound argument positions
        that passed the run-time checks) where its outputs alias them; copies of the rest."""
        inner = self._inner
        program = inner._program_for_call(parts, {})
        if program is None:
            return inner._plain_plan
        if self._donate == "off" or host_callbacks(program.final):
            return plan_for(inner, program, program.decide(((), ())), (), ())
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
        pos = tuple(p for p in candidates if p in d[0])
        if pos and not unpacks_tree(program, proof):
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
        return plan_for(inner, program, d, pos, ())

    def _prove(self, frame) -> Site:
        proof = callsite.prove_call_site(frame, self)
        site = Site(proof, False)
        self._sites[(id(frame.f_code), frame.f_lasti)] = site
        if proof.location:
            self._inner._caches.site_proofs[proof.location] = proof
        return site

    # --- equinox's other entry points ------------------------------------------------------

    def lower(self, /, *args, **kwargs):
        """As equinox's ``lower``: nothing donated (equinox's default)."""
        return self._plain.lower(*args, **kwargs)

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
    """The user's result unpacks into the statement's targets: the result is the second child
    of the inner output ``(marker, dynamic_out, Static)``, whose structure is the user's."""
    if proof is None or proof.unpack is None:
        return True
    from autoopt._jit._program import unpacks_tree as unpacks

    kids = jax.tree_util.treedef_children(program.traced.out_tree)
    if len(kids) != 3:
        return False
    return all(unpacks(kids[1], p) for p in proof.unpack)


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
