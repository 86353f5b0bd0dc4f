"""Large closed-over constants: device arguments, placed once, instead of HLO constants.

Closed-over constants of 1 MiB and up are passed to the program as device arguments, placed once,
instead of being embedded into the HLO, whose text, size and first compile grow with every
embedded byte. The wrapper's trace stops at them (``HoistConstants``), the placer
(``_placement``) places them and calls again with them under a hidden keyword (``HOISTED``);
calls that reach jit without the placer (AOT ``.lower``) embed them as jax.jit does.
"""

from __future__ import annotations

import contextlib
import threading

from jax import tree_util
from jax.core import Tracer

__all__ = ["HOISTED", "HoistConstants", "retrying", "with_hoisted_consts"]

# The keyword under which hoisted constants travel to the jitted wrapper (never a user's name).
HOISTED = "_autoopt_hoisted"
# Top-level consts of the optimized program at least this large are passed as device arguments,
# placed once, instead of being embedded in the HLO (an embedded constant is printed into the
# HLO text and copied into every executable). jax 0.10.2's own hoisting
# (jax_use_simplified_jaxpr_constants) still embeds them when lowering.
HOIST_MIN_BYTES = 1 << 20
_TLS = threading.local()  # .retry: the placer will retry a call whose trace asks to hoist


@contextlib.contextmanager
def retrying():
    """While inside, a trace that meets large constants the call did not pass raises
    ``HoistConstants`` (the placer will place them and call again) instead of embedding them.
    Nests: the outer state is restored on exit."""
    outer, _TLS.retry = getattr(_TLS, "retry", False), True
    try:
        yield
    finally:
        _TLS.retry = outer


class HoistConstants(Exception):
    """Raised out of jit's trace of the wrapper when the program has large constants the call
    did not pass as arguments; the placer places them and calls again. Never reaches the user."""

    def __init__(self, consts: list):
        super().__init__("autoopt: large constants to pass as arguments")
        self.consts = consts


class Hoisted:
    """Pytree node: the device copies of a function's large constants (children), keyed by the
    ``id`` of the program's host constant (static aux data, so a new constant is a new signature).
    """

    __slots__ = ("keys", "devs")

    def __init__(self, keys: tuple, devs: tuple):
        self.keys = keys
        self.devs = devs


tree_util.register_pytree_node(
    Hoisted, lambda h: (h.devs, h.keys), lambda keys, devs: Hoisted(keys, tuple(devs))
)


def large_consts(closed) -> list:
    return [
        c
        for c in closed.consts
        if getattr(c, "ndim", 0) > 0
        and int(getattr(c, "nbytes", 0) or 0) >= HOIST_MIN_BYTES
        and not isinstance(c, Tracer)
    ]


def with_hoisted_consts(closed, hoisted: Hoisted | None):
    """``closed`` with each large constant replaced by the argument ``hoisted`` carries for it.

    Runs inside jit's trace of the wrapper. When a large constant was not passed: raises
    ``HoistConstants`` if the placer is waiting to retry this call, else embeds it as before.
    """
    large = large_consts(closed)
    if not large:
        return closed
    passed = {} if hoisted is None else dict(zip(hoisted.keys, hoisted.devs))
    missing = [c for c in large if id(c) not in passed]
    if missing:
        if getattr(_TLS, "retry", False):
            raise HoistConstants(missing)
        if not passed:
            return closed
    consts = [passed.get(id(c), c) for c in closed.consts]
    return closed.replace(consts=consts)
