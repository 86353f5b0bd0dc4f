"""The jit wrapper: ``optimize`` and ``OptimizedFunction``, whose call path is one story."""

from autoopt._jit._function import OptimizedFunction, explain, optimize

__all__ = ["OptimizedFunction", "explain", "optimize"]
