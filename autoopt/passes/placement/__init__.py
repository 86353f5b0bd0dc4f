"""Placement and transfers: host inputs placed in batches, host constants placed once, prefetch,
implicit transfers and device-to-host stalls found and reported.

``_transfers`` is the pass (an analysis of the program); ``_placer`` acts on every call's host
inputs, with ``_packing``, ``_host_constants``, ``_hoist`` and ``_host_arrays``; ``_prefetch``
is ``autoopt.prefetch``; ``_findings`` reports what the placer saw; ``codemod`` suggests
``autoopt.prefetch`` / ``jax.device_put`` in source.
"""

from autoopt.passes.placement._findings import findings_for
from autoopt.passes.placement._hoist import (
    HoistConstants,
    is_splat,
    large_consts,
    with_hoisted_consts,
)
from autoopt.passes.placement._host_constants import constant
from autoopt.passes.placement._packing import unpack
from autoopt.passes.placement._placer import placer_for
from autoopt.passes.placement._prefetch import prefetch
from autoopt.passes.placement._transfers import PASS, host_callbacks, transfers

__all__ = [
    "HoistConstants",
    "PASS",
    "constant",
    "findings_for",
    "host_callbacks",
    "is_splat",
    "large_consts",
    "placer_for",
    "prefetch",
    "transfers",
    "unpack",
    "with_hoisted_consts",
]
