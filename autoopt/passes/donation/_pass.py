"""Donation analysis: which arguments an output can reuse.

Donation itself is not a rewrite of the program: it is a ``jax.jit`` option chosen per call (the
``"safe"`` policy needs the caller's statement, see ``callsite``). This pass computes, per
signature, which input leaves XLA will alias to an output, using the same matching JAX applies
(``jax._src.interpreters.mlir._set_up_aliases``: for each output in order, the first still
unmatched donated input of the same shape and dtype). An argument is donated whole or not at
all (``jax.jit`` donates per argument), so only arguments whose every leaf finds an output are
donatable; donating any other would trigger JAX's "Some donated buffers were not usable".

Same-size-different-shape inputs become XLA "buffer donors" with no guarantee of reuse; they
are never counted as savings here.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Iterable, Sequence

from autoopt import _jaxpr
from autoopt._finding import Finding
from autoopt._memory import aval_bytes
from autoopt._options import Option
from autoopt.passes._base import Pass, PassContext, PassResult


def _strip(aval):
    # The dtype as jax has it: a PRNG key's (key<fry>) has no NumPy equivalent, and two key
    # arrays of one implementation alias as any two arrays of one dtype do.
    return (tuple(aval.shape), aval.dtype) if hasattr(aval, "shape") else aval


def match_donations(
    in_avals: Sequence, out_avals: Sequence, donated: Sequence[bool]
) -> dict[int, int]:
    """``{input leaf: output leaf}`` exactly as JAX pairs donated inputs with outputs."""
    pool: dict = collections.defaultdict(collections.deque)
    for i, (aval, d) in enumerate(zip(in_avals, donated)):
        if d:
            pool[_strip(aval)].append(i)
    pairs = {}
    for o, aval in enumerate(out_avals):
        q = pool.get(_strip(aval))
        if q:
            pairs[q.popleft()] = o
    return pairs


def donatable_args(
    in_avals: Sequence, out_avals: Sequence, arg_of_leaf: Sequence, candidates: Iterable
) -> tuple[frozenset, dict[int, int]]:
    """The largest set of candidate arguments whose every leaf is aliased to an output.

    Removing an argument frees outputs for the others, so iterate to a fixed point (at most one
    round per argument). Returns the arguments and the leaf pairing for them.
    """
    chosen = {a for a in candidates if any(x == a for x in arg_of_leaf)}
    while True:
        donated = [a in chosen for a in arg_of_leaf]
        pairs = match_donations(in_avals, out_avals, donated)
        bad = {arg_of_leaf[i] for i, d in enumerate(donated) if d and i not in pairs}
        if not bad:
            return frozenset(chosen), pairs
        chosen -= bad


# Primitives that run Python on the host while the program executes, besides every primitive
# named ``*callback*`` (``io_callback``, ``pure_callback``, ``debug_callback``).
_HOST_PRIMITIVES = frozenset({"debug_print", "outside_call"})
_host_callbacks_memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def host_callbacks(closed) -> tuple[str, ...]:
    """The primitives of ``closed`` (sub-programs included) that call back into Python.

    ``donate="safe"`` donates nothing in such a program. A callback that raises fails the call
    after its arguments were donated, leaving the caller's name bound to a deleted array where
    plain ``jax.jit`` leaves it intact (``jax.debug.print`` too: a format that does not fit the
    value raises when it runs); and a callback that reads the donated variable (a global) sees
    a deleted array, or blocks waiting for the very computation that calls it. Memoized per
    program."""
    hit = _host_callbacks_memo.get(closed)
    if hit is None:
        names = {
            site.eqn.primitive.name
            for site in _jaxpr.iter_eqns(closed, into_opaque=True)
            if "callback" in site.eqn.primitive.name or site.eqn.primitive.name in _HOST_PRIMITIVES
        }
        hit = _host_callbacks_memo[closed] = tuple(sorted(names))
    return hit


def _size(leaves: Sequence[int], total: int) -> str:
    return f"{total:,} bytes" if len(leaves) == 1 else f"{len(leaves)} leaves, {total:,} bytes"


def mergeable(f: Finding) -> bool:
    """A function-level "can be donated" finding (``donation``'s, for one argument an output
    can reuse, before any call site donated it): the report shows those of one function in one
    row (``merged``)."""
    d = f.details or {}
    return (
        f.kind == "donate"
        and not f.applied
        and d.get("aliasable") is True
        and "arg" in d
        and "outputs" in d
        and "site" not in d
        and not d.get("host_callbacks")
    )


def merged(findings: Sequence[Finding]) -> Finding:
    """One finding standing for several ``mergeable`` ones of the same function (the report's
    row: a sampler's report had one 5-line row per argument, each ending with the same reason
    for no source edit, ``details["source_edit"]``, which the findings must share)."""
    first = findings[0]
    names = [f"`{f.details['name']}`" for f in findings]
    listed = ", ".join(names[:-1]) + f" and {names[-1]}"
    total = sum(f.bytes_saved or 0 for f in findings)
    reuse = "; ".join(f"{f.details['name']}: {', '.join(f.details['outputs'])}" for f in findings)
    message = (
        f"{listed} ({len(findings)} arguments, {total:,} bytes) can be donated: each has an "
        f"output of the same shape and dtype for every leaf ({reuse}). Donated when the caller "
        "rebinds them (`a, b = f(a, b, ...)`) under donate='safe', always under donate='auto'."
    )
    note = first.details.get("source_edit")
    if note:
        message += f" No source edit: {note}."
    return first.replace(
        message=message,
        bytes_saved=total,
        details={
            "args": tuple(f.details["arg"] for f in findings),
            "names": tuple(f.details["name"] for f in findings),
            "aliasable": True,
            "merged": len(findings),
            **({"source_edit": note} if note else {}),
        },
    )


def _arg_label(arg) -> str:
    return f"argument {arg}" if isinstance(arg, int) else f"keyword argument {arg!r}"


def donation(closed, ctx: PassContext) -> PassResult:
    in_avals = closed.in_avals
    out_avals = closed.out_avals
    args = list(dict.fromkeys(ctx.in_arg_of_leaf))
    chosen, pairs = donatable_args(in_avals, out_avals, ctx.in_arg_of_leaf, args)
    findings = []
    names = ctx.in_leaf_names or tuple(f"in[{i}]" for i in range(len(in_avals)))
    options = ctx.options
    callbacks = (
        host_callbacks(closed)
        if getattr(options, "donate", None) == "safe"
        and not getattr(options, "explicit_donation", False)
        else ()
    )
    for arg in args:
        leaves = [i for i, a in enumerate(ctx.in_arg_of_leaf) if a == arg]
        root = names[leaves[0]].split("[")[0].split(".")[0] if leaves else str(arg)
        total = sum(aval_bytes(in_avals[i]) for i in leaves)
        if arg in chosen:
            outs = sorted({pairs[i] for i in leaves})
            out_names = [
                ctx.out_leaf_names[o] if o < len(ctx.out_leaf_names) else f"out[{o}]" for o in outs
            ]
            if callbacks:
                findings.append(
                    Finding(
                        kind="donate",
                        applied=False,
                        location=ctx.fn_location,
                        bytes_saved=None,
                        message=(
                            f"`{root}` ({_size(leaves, total)}) has an output to "
                            "reuse its buffer but is not donated under donate='safe': the "
                            f"program calls back into Python ({', '.join(callbacks)}), and a "
                            "callback that raises would leave the caller's variable bound to a "
                            "deleted array (jax.jit keeps it). Pass donate='auto' or "
                            f"donate_argnums to donate it anyway."
                        ),
                        details={
                            "arg": arg,
                            "name": root,
                            "leaves": leaves,
                            "aliasable": True,
                            "host_callbacks": callbacks,
                        },
                    )
                )
                continue
            outs = f"{', '.join(out_names[:4])}{', ...' if len(out_names) > 4 else ''}"
            auto = ctx.options.donate == "auto"  # then every call donates it: applied
            findings.append(
                Finding(
                    kind="donate",
                    applied=auto,
                    location=ctx.fn_location,
                    bytes_saved=total,
                    message=(
                        f"`{root}` ({_size(leaves, total)}) donated at every "
                        f"call (donate='auto'): every leaf has an output of the same shape and "
                        f"dtype ({outs})."
                        if auto
                        else f"`{root}` ({_size(leaves, total)}) can be donated: "
                        f"every leaf has an output of the same shape and dtype ({outs}). "
                        f"Donated when the caller rebinds it (`{root} = f({root}, ...)`) under "
                        "donate='safe', always under donate='auto'."
                    ),
                    details={
                        "arg": arg,
                        "name": root,
                        "leaves": leaves,
                        "aliasable": True,
                        "outputs": tuple(out_names),
                    },
                )
            )
        else:
            unmatched = [
                names[i]
                for i in leaves
                if i
                not in match_donations(in_avals, out_avals, [a == arg for a in ctx.in_arg_of_leaf])
            ]
            if not unmatched:
                continue
            findings.append(
                Finding(
                    kind="donate",
                    applied=False,
                    location=ctx.fn_location,
                    bytes_saved=None,
                    message=(
                        f"`{root}` cannot be donated: {', '.join(unmatched[:3])}"
                        f"{' and others' if len(unmatched) > 3 else ''} "
                        "has no output of the same shape and dtype to reuse its buffer."
                    ),
                    details={"arg": arg, "name": root, "leaves": leaves, "aliasable": False},
                )
            )
    return PassResult.unchanged(closed, findings)


DONATE_POLICIES = ("safe", "auto", "off")


def _check_donate(donate):
    if donate not in DONATE_POLICIES:
        raise ValueError(
            f"donate={donate!r} is not a donation policy. Use 'safe' (default: donate what is "
            "provably dead after the call), 'auto' (donate every aliasable argument), 'off', or "
            "pass donate_argnums=/donate_argnames= for exactly jax.jit's behaviour."
        )
    return donate


# An analysis: it reads the final program, after every rewrite.
PASS = Pass(
    name="donation",
    run=donation,
    kinds=("donate",),
    after=("remat",),
    options=(
        Option(
            "donate",
            "safe",
            _check_donate,
            "'safe', 'auto' or 'off': which arguments' buffers the outputs may reuse",
        ),
    ),
    codemod="autoopt.passes.donation.codemod:DonateCommand",
)
