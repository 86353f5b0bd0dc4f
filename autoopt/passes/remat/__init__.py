"""Rematerialization: what the backward pass keeps and what it recomputes, under a budget.

The pass (``_pass``) chooses among plans by compiling them; ``_plan`` builds plans for a
training step, ``_forward`` for a forward differentiated from outside; ``codemod`` suggests
``jax.checkpoint`` in source.
"""

from autoopt.passes.remat._pass import (
    CPU_FLAGS,
    PASS,
    Fit,
    Original,
    deferred,
    fence_for,
    forward_plannable,
    jit_options,
    measured_donating,
    measured_of,
    measuring_options,
    remat,
    with_remat,
)

__all__ = [
    "CPU_FLAGS",
    "PASS",
    "Fit",
    "Original",
    "deferred",
    "fence_for",
    "forward_plannable",
    "jit_options",
    "measured_donating",
    "measured_of",
    "measuring_options",
    "remat",
    "with_remat",
]
