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


REPORTING = _Reporting()


@contextlib.contextmanager
def reporting() -> Iterator[None]:
    outer, REPORTING.active = REPORTING.active, True
    try:
        yield
    finally:
        REPORTING.active = outer
