"""Found while building the call path's fast path: ``donate="auto"`` donated the first of two
identical arguments.

``f(c, c)`` under ``donate="auto"``: ``donation_checks`` recorded array identities only as it
walked the candidates, so the first ``c`` passed (not seen yet) and only the second was refused.
Donating position 0 while position 1 reads the same buffer makes XLA refuse the call
("Attempt to use a buffer that was previously donated in the same call"). ``donate="safe"`` was
not affected: the reference count of an array passed twice is above the baseline. Fixed: arrays
that occur more than once anywhere in the arguments are never donated.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import autoopt


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "inside-a-dict"])
def test_auto_policy_never_donates_an_array_passed_twice(nested):
    if nested:
        f = autoopt.optimize(
            lambda s, t: ({"v": s["v"] + t["v"]}, {"v": s["v"] - t["v"]}), donate="auto"
        )
        c = {"v": jnp.ones(3) + 0}
        a, b = f(c, {"v": c["v"]})
        got_a, got_b = a["v"], b["v"]
    else:
        f = autoopt.optimize(lambda s, t: (s + t, s - t), donate="auto")
        c = jnp.ones(3) + 0
        got_a, got_b = f(c, c)
    np.testing.assert_array_equal(got_a, 2 * np.ones(3))
    np.testing.assert_array_equal(got_b, np.zeros(3))
