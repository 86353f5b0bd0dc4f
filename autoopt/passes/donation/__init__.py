"""Buffer donation: which arguments an output can reuse, and when the caller proves them dead.

The pass (``_pass``) finds what an output can alias; the call-site proof (``callsite``) decides
per call whether the caller's statement makes the argument dead; ``codemod`` suggests
``donate_argnums`` in the user's source.
"""

from autoopt.passes.donation._pass import (
    PASS,
    donatable_args,
    donation,
    host_callbacks,
    match_donations,
    mergeable,
    merged,
)

__all__ = [
    "PASS",
    "donatable_args",
    "donation",
    "host_callbacks",
    "match_donations",
    "mergeable",
    "merged",
]
