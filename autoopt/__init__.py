"""autoopt: make JAX programs move less data and hold less device memory, automatically.

``@autoopt.optimize`` is a drop-in for ``@jax.jit``: it traces the function to a jaxpr, applies
what an expert would do by hand (buffer donation, in-place updates, rematerialization,
placement), and returns a jitted callable that computes the same numbers.
"""

from typing import TYPE_CHECKING

from autoopt._errors import AutooptWarning, ProcessMismatchError
from autoopt._jit import OptimizedFunction, explain, optimize
from autoopt.patch import patch
from autoopt.report import Finding, Report

if TYPE_CHECKING:  # for type checkers: at run time __getattr__ below imports them when asked
    from autoopt import testing
    from autoopt.passes.in_place.window import update_window
    from autoopt.passes.placement import constant, prefetch

__all__ = [
    "optimize",
    "explain",
    "patch",
    "OptimizedFunction",
    "Report",
    "Finding",
    "AutooptWarning",
    "ProcessMismatchError",
    "testing",
    "update_window",
    "prefetch",
    "constant",
]

_LAZY = ("testing", "update_window", "prefetch", "constant")

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: autoopt.testing imports hypothesis only when its strategies are used, and the
    # placement helpers load only when asked for.
    if name == "testing":
        import importlib

        return importlib.import_module("autoopt.testing")
    if name == "update_window":
        from autoopt.passes.in_place.window import update_window

        return update_window
    if name in ("prefetch", "constant"):
        import importlib

        return getattr(importlib.import_module("autoopt.passes.placement"), name)
    raise AttributeError(f"module 'autoopt' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_LAZY})
