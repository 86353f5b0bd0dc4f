"""In-place updates: ``scatter`` rewritten into ``dynamic_update_slice`` where exactly equivalent.

The pass (``_pass``) rewrites; the range analysis (``_ranges``) proves indices in bounds;
``codemod`` suggests the same edit in source.
"""

from autoopt.passes.in_place._pass import PASS, scatter_to_dus, value_bounds
from autoopt.passes.in_place._ranges import NUMPY_VALUE_MAX_BYTES

__all__ = ["NUMPY_VALUE_MAX_BYTES", "PASS", "scatter_to_dus", "value_bounds"]
