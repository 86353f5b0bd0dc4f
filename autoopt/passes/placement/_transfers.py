"""Device-to-host stalls inside the program: host callbacks, found anywhere in the jaxpr.

An analysis (it never changes the program): ``jax.pure_callback``, ``io_callback``,
``jax.debug.callback``
and ``jax.debug.print`` copy their operands to the host, run Python while the device waits for
the result (or, for the debug ones, for the ordered effect), and copy results back. Inside a
``scan`` or ``while`` they do so every iteration. They are reported, with the user's line and
the bytes they move, never removed: a callback is the user's own side effect.

Found through ``_jaxpr.iter_eqns``, so callbacks nested in ``jit``, ``scan``, ``cond``,
``custom_vjp`` and ``checkpoint`` bodies count; shard_map bodies are read too (reading is
harmless; only rewriting leaves them alone).

NB: the runtime analogue is ``jax.transfer_guard_device_to_host``, which does not fire on
XLA:CPU (the host already holds the buffer); this pass works on every backend.
"""

from __future__ import annotations

from autoopt import _jaxpr
from autoopt._finding import Finding
from autoopt._memory import aval_bytes
from autoopt._options import Option
from autoopt.passes._base import Pass, PassContext, PassResult

# Primitive name -> how users spell it.
CALLBACK_PRIMITIVES = {
    "pure_callback": "jax.pure_callback",
    "io_callback": "jax.experimental.io_callback",
    "debug_callback": "jax.debug.callback",
    "debug_print": "jax.debug.print",
}


def _nbytes(avals) -> int:
    return sum(aval_bytes(a) for a in avals)


def _loop_words(path: tuple[str, ...]) -> str:
    loops = [p for p in path if p in ("scan", "while")]
    if not loops:
        return " once a call"
    return " inside a " + " inside a ".join(reversed(loops)) + ", on every iteration"


def host_callbacks(closed) -> list[dict]:
    """Every host callback in ``closed`` (and its sub-jaxprs): primitive, user-facing name,
    location, bytes to the host and back, and the chain of primitives it is nested in."""
    out = []
    for site in _jaxpr.iter_eqns(closed, into_opaque=True):
        eqn = site.eqn
        name = eqn.primitive.name
        if name not in CALLBACK_PRIMITIVES:
            continue
        out.append(
            {
                "primitive": name,
                "api": CALLBACK_PRIMITIVES[name],
                "location": _jaxpr.user_location(eqn),
                "to_host_bytes": _nbytes(v.aval for v in eqn.invars),
                "to_device_bytes": _nbytes(v.aval for v in eqn.outvars),
                "in_loop": site.in_loop,
                "path": tuple(p for p, _ in site.path),
            }
        )
    return out


def transfers(closed, ctx: PassContext) -> PassResult:
    found = host_callbacks(closed)
    findings = []
    for cb in found:
        back = f" and {cb['to_device_bytes']:,} bytes back" if cb["to_device_bytes"] else ""
        debug = cb["primitive"] in ("debug_print", "debug_callback")
        advice = (
            "remove it, or guard it with a Python flag so production traces leave it out"
            if debug
            else "move the host work out of the step (precompute it, or express it in jax.numpy)"
            " if it is on the hot path"
        )
        findings.append(
            Finding(
                kind="transfer",
                applied=False,
                location=cb["location"] or ctx.fn_location,
                message=(
                    f"`{cb['api']}` stalls the device: it copies {cb['to_host_bytes']:,} bytes to "
                    f"the host{back} and waits for Python{_loop_words(cb['path'])}; "
                    f"{advice}."
                ),
                details=cb,
            )
        )
    return PassResult.unchanged(closed, findings)


TRANSFER_GUARDS = (None, "log", "disallow", "allow")
PLACEMENTS = ("auto", "pack", "off")


def _check_placement(placement):
    if placement not in PLACEMENTS:
        raise ValueError(
            f"placement={placement!r}: use 'auto' (pass large constants as arguments, "
            "pack many small NumPy leaves into one transfer where measured faster), "
            "'pack' (always pack) or 'off'."
        )
    return placement


def _check_guard(guard):
    if guard not in TRANSFER_GUARDS:
        raise ValueError(f"transfer_guard={guard!r}: use None, 'log', 'disallow' or 'allow'.")
    return guard


# An analysis of the final program. Its package's placer acts on every call's host inputs and
# reports "placement" findings; the options below are the placer's.
PASS = Pass(
    name="transfers",
    run=transfers,
    kinds=("placement", "transfer"),
    after=("remat",),
    options=(
        Option(
            "placement",
            "auto",
            _check_placement,
            "'auto', 'pack' or 'off': how host inputs and constants reach the device",
        ),
        Option(
            "transfer_guard",
            None,
            _check_guard,
            "None, 'log', 'disallow' or 'allow': implicit host-to-device transfers",
        ),
        Option(
            "canonicalize_scalars",
            False,
            bool,
            "place Python scalars as weakly typed device scalars once",
        ),
    ),
    codemod="autoopt.passes.placement.codemod:PlacementCommand",
)
