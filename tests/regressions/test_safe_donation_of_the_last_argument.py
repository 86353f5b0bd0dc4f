"""Found while adding donation to decorated methods: ``x = f(c, x)`` never donated ``x``.

``donation_checks`` recorded the identities of the non-candidate arguments with
``for i, a in enumerate(args)``; after the loop ``a`` stayed bound to the last argument, one
more reference to it, so the reference-count proof refused exactly the argument the statement
rebinds whenever it came last and another argument was not a candidate. Nothing unsafe, only a
missed donation (a full copy of the buffer on every call). Fixed by indexing instead.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import autoopt


def test_rebound_last_argument_is_donated_after_a_kept_one():
    f = autoopt.optimize(lambda c, x: x + c)
    c = jnp.ones(3)
    x = jnp.zeros(3) + 0
    pointer = x.unsafe_buffer_pointer()
    x = f(c, x)
    assert x.unsafe_buffer_pointer() == pointer
    assert not c.is_deleted()
    np.testing.assert_array_equal(x, np.ones(3))


def test_rebound_last_keyword_argument_is_donated_after_a_kept_one():
    f = autoopt.optimize(lambda c, x: x + c)
    c = jnp.ones(3)
    x = jnp.zeros(3) + 0
    pointer = x.unsafe_buffer_pointer()
    x = f(c=c, x=x)
    assert x.unsafe_buffer_pointer() == pointer
    assert not c.is_deleted()
