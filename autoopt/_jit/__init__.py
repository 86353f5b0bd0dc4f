"""The jit wrapper: ``optimize`` and ``OptimizedFunction``, whose call path is one story
(``_dispatch``), and ``Inspection``, the narrow view of it."""

from autoopt._jit._function import OptimizedFunction, explain, optimize
from autoopt._jit._inspect import Inspection

__all__ = ["Inspection", "OptimizedFunction", "explain", "optimize"]
