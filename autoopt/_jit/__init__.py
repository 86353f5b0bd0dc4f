"""The jit wrapper: ``optimize`` and ``OptimizedFunction``, whose call path is one story
(``_dispatch``), and ``Inspection``, the narrow view of it."""

from autoopt._jit._dispatch import REFUSALS_BEFORE_NARROWING
from autoopt._jit._equinox import EquinoxJit  # also registers optimize's route for filter_jit
from autoopt._jit._function import (
    TRACING,
    OptimizedFunction,
    argnums_given,
    explain,
    forget_wrappers,
    nested_call,
    optimize,
)
from autoopt._jit._inspect import Inspection, SiteCalls, site_calls
from autoopt._jit._nnx import NnxJit, nnx_routable  # also registers optimize's route
from autoopt._jit._reuse import RECENT, WrapperCache, options_key

__all__ = [
    "EquinoxJit",
    "RECENT",
    "REFUSALS_BEFORE_NARROWING",
    "SiteCalls",
    "TRACING",
    "Inspection",
    "NnxJit",
    "OptimizedFunction",
    "WrapperCache",
    "argnums_given",
    "explain",
    "forget_wrappers",
    "nested_call",
    "nnx_routable",
    "optimize",
    "options_key",
    "site_calls",
]
