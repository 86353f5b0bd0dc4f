"""Checkpoint segments inserted into a forward program, for when the user differentiates the
optimized function from outside (``jax.grad(autoopt.optimize(loss))``).

The pass sees only the forward then: JAX differentiates the jitted program afterwards. So the
plan is expressed the way a user would write it, with ``jax.checkpoint`` (the ``remat2``
primitive) around segments of the forward and around ``scan`` bodies; JAX's own partial
evaluation then saves only each segment's inputs and recomputes the rest in the backward.
Evaluating a program with ``remat2`` equations and no differentiation runs the same operations
as before (checkpoint lowers to its body), so plain forward calls are unaffected.

NB: ``jax.checkpoint`` in unrolled code needs its optimization barriers to survive XLA:CPU's
``cse_barrier_expander`` when forward and backward are compiled together; eager ``jax.grad`` of a
jitted function compiles them as two executables, where nothing can be merged. Loops need no
flag: the backward's recomputation runs inside its own loop body.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from autoopt import _compat, _jaxpr
from autoopt._memory import aval_bytes
from autoopt.passes.remat._plan import (
    choose_cuts,
    fine_cuts,
    heavy,
    is_var,
    run_eqn,
    segment_counts,
)

# A scan this long or longer is also offered as nested scans (sqrt(n) checkpoints).
NEST_MIN_LENGTH = 16


def _floating(aval) -> bool:
    return hasattr(aval, "dtype") and jax.numpy.issubdtype(aval.dtype, jax.numpy.inexact)


def _vjp_of(closed: ClosedJaxpr) -> Callable[[list], tuple] | None:
    """``vjp(args) -> (floating outputs, pullback)``: ``jax.vjp`` of ``closed`` with respect to
    its floating inputs, the others held at ``args``; None when nothing is differentiable."""
    diff = [i for i, a in enumerate(closed.in_avals) if _floating(a)]
    outs = [k for k, a in enumerate(closed.out_avals) if _floating(a)]
    if not diff or not outs:
        return None

    def vjp(args: list):
        def f(*d):
            full = list(args)
            for i, x in zip(diff, d):
                full[i] = x
            res = _jaxpr.eval_closed(closed, *full)
            return [res[k] for k in outs]

        return jax.vjp(f, *[args[i] for i in diff])

    return vjp


def vjp_program(closed: ClosedJaxpr) -> tuple[Callable, list] | None:
    """``(fn, avals)``: a training step built from the forward ``closed``: run it, then pull
    back a cotangent (an extra input) for every floating output into every floating input. What
    ``jax.grad`` of the optimized function will compile; None when nothing is differentiable."""
    vjp = _vjp_of(closed)
    if vjp is None:
        return None
    in_avals = list(closed.in_avals)
    n = len(in_avals)

    def step(*flat):
        primal, pullback = vjp(list(flat[:n]))
        return [*primal, *pullback(list(flat[n:]))]

    out_avals = [a for a in closed.out_avals if _floating(a)]
    return step, in_avals + out_avals


def vjp_halves(closed: ClosedJaxpr) -> tuple[Callable, Callable, list] | None:
    """``(forward, backward, avals)``: ``forward(*args)`` runs ``closed`` and returns its
    floating outputs and the pullback (whose leaves are the residuals); ``backward`` takes that
    and pulls cotangents of ones back. The two programs ``jax.grad`` of the jitted ``closed``
    runs when applied eagerly; None when nothing is differentiable."""
    vjp = _vjp_of(closed)
    if vjp is None:
        return None

    def forward(*args):
        return vjp(list(args))

    def backward(fwd_out):
        primal, pullback = fwd_out
        return pullback([jax.numpy.ones_like(p) for p in primal])

    return forward, backward, list(closed.in_avals)


def vjp_jaxpr(closed: ClosedJaxpr) -> ClosedJaxpr | None:
    built = vjp_program(closed)
    if built is None:
        return None
    fn, avals = built
    return _compat.trace_closed_jaxpr(fn, avals, name="autoopt.remat.vjp")


# --- segments of a straight-line forward ---------------------------------------------------------


def forward_cuts(closed: ClosedJaxpr) -> list[tuple[int, int]]:
    return fine_cuts(closed.jaxpr.eqns)


def segment_bounds(closed: ClosedJaxpr, k: int) -> list[int] | None:
    cuts = forward_cuts(closed)
    if not cuts or k < 2:
        return None
    return [0, *choose_cuts(cuts, k), len(closed.jaxpr.eqns)]


def forward_segment_counts(closed: ClosedJaxpr) -> list[int]:
    cuts = forward_cuts(closed)
    return segment_counts(len(cuts) + 1) if cuts else []


def checkpoint_segments(
    closed: ClosedJaxpr, bounds: Sequence[int], policy, skip_last: bool = True
) -> ClosedJaxpr:
    """``closed`` with each segment ``[bounds[j], bounds[j+1])`` of its top-level equations run
    under ``jax.checkpoint(policy=policy)``; the last segment is left alone when ``skip_last``
    (the backward would recompute it at once)."""
    j = closed.jaxpr
    eqns = j.eqns
    later_uses: list[set] = [set() for _ in range(len(bounds))]
    outvars = {v for v in j.outvars if is_var(v)}
    segs = list(zip(bounds, bounds[1:]))
    wrap = set(range(len(segs) - 1 if skip_last else len(segs)))
    for s_idx, (_lo, hi) in enumerate(segs):
        used = set(outvars)
        for e in eqns[hi:]:
            used.update(v for v in e.invars if is_var(v))
        later_uses[s_idx] = used

    def fn(*args):
        env = _jaxpr.initial_env(j, closed.consts, args)

        def read(v, local=None):
            if isinstance(v, Literal):
                return v.val
            if local is not None and v in local:
                return local[v]
            return env[v]

        for s_idx, (lo, hi) in enumerate(segs):
            seg = eqns[lo:hi]
            if s_idx not in wrap or not seg:
                for e in seg:
                    for v, val in zip(e.outvars, run_eqn(e, [read(u) for u in e.invars])):
                        if is_var(v):
                            env[v] = val
                continue
            defined = {v for e in seg for v in e.outvars if is_var(v)}
            ins = []
            for e in seg:
                for u in e.invars:
                    if is_var(u) and u not in defined and u not in ins:
                        ins.append(u)
            outs = [v for v in defined if v in later_uses[s_idx]]
            outs.sort(key=lambda v: next(k for k, e in enumerate(seg) if v in e.outvars))

            def segment(*vals, seg=seg, ins=ins, outs=outs):
                local = dict(zip(ins, vals))
                for e in seg:
                    for v, val in zip(e.outvars, run_eqn(e, [read(u, local) for u in e.invars])):
                        if is_var(v):
                            local[v] = val
                return [local[v] for v in outs]

            results = jax.checkpoint(segment, policy=policy, prevent_cse=True)(
                *[env[u] for u in ins]
            )
            env.update(zip(outs, results))
        return [read(v) for v in j.outvars]

    return _compat.trace_closed_jaxpr(fn, [v.aval for v in j.invars], name="autoopt.remat")


# --- loops ---------------------------------------------------------------------------------------


def _scan_has_residuals(eqn) -> bool:
    body = eqn.params["jaxpr"]
    return any(heavy(e) or e.primitive.name not in ("add", "mul", "sub") for e in body.jaxpr.eqns)


def forward_scans(closed: ClosedJaxpr) -> list:
    """Top-level scans worth checkpointing (their bodies do work worth saving per iteration)."""
    return [
        e
        for e in closed.jaxpr.eqns
        if e.primitive.name == "scan" and e.params["length"] > 1 and _scan_has_residuals(e)
    ]


def _factor(n: int) -> tuple[int, int] | None:
    """``(outer, inner)`` with outer*inner == n, outer near sqrt(n); None if n is prime-ish."""
    r = int(math.isqrt(n))
    for a in range(r, 1, -1):
        if n % a == 0 and a * a >= n / 4:
            return n // a, a
    return None


def checkpoint_scans(closed: ClosedJaxpr, policy, nest: bool) -> ClosedJaxpr:
    """``closed`` with every top-level ``scan`` body run under ``jax.checkpoint`` (so the
    backward keeps one carry per iteration), and with ``nest``, scans of ``NEST_MIN_LENGTH`` or
    more split into an outer scan of checkpointed chunks (sqrt(n) carries kept)."""
    scan_p = next(e.primitive for e in closed.jaxpr.eqns if e.primitive.name == "scan")

    def rule(eqn, invals):
        if eqn.primitive is not scan_p or not _scan_has_residuals(eqn) or eqn.params["length"] <= 1:
            return None
        p = eqn.params
        body: ClosedJaxpr = p["jaxpr"]
        n = p["length"]
        split = _factor(n) if nest and n >= NEST_MIN_LENGTH else None
        if split is None:

            def ck_body(*a):
                return jax.checkpoint(
                    lambda *b: _jaxpr.eval_closed(body, *b), policy=policy, prevent_cse=True
                )(*a)

            new_body = _compat.trace_closed_jaxpr(ck_body, body.in_avals, name="autoopt.remat.body")
            return eqn.primitive.bind(*invals, **dict(p, jaxpr=new_body))
        outer_n, inner_n = split
        nc, nk = p["num_consts"], p["num_carry"]
        consts, carry, xs = invals[:nc], invals[nc : nc + nk], invals[nc + nk :]
        xs_r = [x.reshape((outer_n, inner_n) + tuple(x.shape[1:])) for x in xs]

        def chunk(c, xc):
            out = eqn.primitive.bind(*consts, *c, *xc, **dict(p, length=inner_n))
            return list(out[:nk]), list(out[nk:])

        chunk_ck = jax.checkpoint(chunk, policy=policy, prevent_cse=True)
        c, ys = jax.lax.scan(
            lambda c, xc: chunk_ck(c, xc), list(carry), xs_r, length=outer_n, reverse=p["reverse"]
        )
        ys = [y.reshape((n,) + tuple(y.shape[2:])) for y in ys]
        return list(c) + list(ys)

    new, _ = _jaxpr.rewrite(closed, {scan_p: rule})
    return new


def has_loops_or_segments(closed: ClosedJaxpr) -> bool:
    return bool(forward_scans(closed)) or bool(forward_cuts(closed))


def as_jaxpr(j: ClosedJaxpr | Jaxpr) -> Jaxpr:
    return j.jaxpr if isinstance(j, ClosedJaxpr) else j


def float_bytes(avals: Sequence[Any]) -> int:
    return sum(aval_bytes(a) for a in avals if _floating(a))
