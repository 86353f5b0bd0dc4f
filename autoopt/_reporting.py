"""Whether this thread's jit traces of an optimized function are a report's (explain's memory
figures), not a call's: a report compiles the executable a call would run, and must decide
nothing a call would then inherit (``OptimizedFunction._embedded`` freezes no constant's bytes
for it)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class _Reporting(threading.local):
    active = False
    # While a report's trace runs on this thread (``OptimizedFunction._reporting_on``): the
    # other optimized functions that built a program inside it (ones the reported function
    # calls), which keep none of them, as the reporter keeps none of its own, and forget the
    # traces jax made of them when the report is done: a call of such a function must trace it
    # anew, reading closed-over NumPy constants as they are then, as jax.jit's first call does.
    # None when no report traces.
    built_inside: list | None = None


REPORTING = _Reporting()


@contextlib.contextmanager
def reporting() -> Iterator[None]:
    outer, REPORTING.active = REPORTING.active, True
    try:
        yield
    finally:
        REPORTING.active = outer


@contextlib.contextmanager
def report_tracing() -> Iterator[list]:
    """Yields the list of functions that built a program inside the report's trace."""
    outer, REPORTING.built_inside = REPORTING.built_inside, []
    try:
        yield REPORTING.built_inside
    finally:
        REPORTING.built_inside = outer
