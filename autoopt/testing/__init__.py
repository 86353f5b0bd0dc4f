"""Testing helpers: equivalence of optimized and original programs, and hypothesis strategies.

``assert_equivalent(fn, *args)`` is the contract every pass is held to: ``jax.jit(fn)`` and
``autoopt.optimize(fn)`` give the same numbers. Integers and booleans must be bit-identical;
floating outputs may differ only by XLA's own fusion choices, within a dtype-aware tolerance.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from autoopt._compare import assert_trees_equivalent, tolerance
from autoopt._jit import forget_wrappers
from autoopt._memory import SIMULATED_MEMORY_ENV, pop_simulated_memory, push_simulated_memory
from autoopt.testing._callers import (
    CallerResult,
    build_program,
    caller_programs,
    check_caller_program,
    run_caller_program,
)
from autoopt.testing._fuzz import (
    FuzzCase,
    Program,
    check_program,
    fuzz_cases,
    hypothesis_modules,
    program_args,
    programs,
)

__all__ = [
    "assert_equivalent",
    "forget_wrappers",
    "assert_trees_equivalent",
    "tolerance",
    "arrays",
    "pytrees",
    # Random programs for differential fuzzing (autoopt/_fuzz.py).
    "programs",
    "program_args",
    "fuzz_cases",
    "check_program",
    "FuzzCase",
    "Program",
    # Random caller programs around a donating call (autoopt/testing/_callers.py).
    "build_program",
    "caller_programs",
    "check_caller_program",
    "run_caller_program",
    "CallerResult",
    # remat="fit" against a device of a given size
    "simulated_device_memory",
    "SIMULATED_MEMORY_ENV",
]


@contextlib.contextmanager
def simulated_device_memory(nbytes: int | str, reported: bool = True) -> Iterator[None]:
    """While inside, calls of optimized functions run as on a device of ``nbytes`` (an int or
    a string such as "64MiB"), empty before each call: remat="fit" compares a first call's
    compiled peak with it, and an executable whose peak is above it raises what XLA raises
    when it runs out of memory (RESOURCE_EXHAUSTED), from the call path (checked on a
    signature's first call, where autoopt compiles). ``reported=False``: the device does not
    report its memory (as a backend without ``memory_stats()``), so only the out-of-memory
    error tells. The environment variable ``AUTOOPT_SIMULATED_DEVICE_MEMORY`` (bytes, or
    "64MiB") sets a reported one for a whole process. Only programs compiled while inside are
    affected: use fresh functions (or ``forget_wrappers()``)."""
    from autoopt._options import parse_bytes

    n = parse_bytes(nbytes, "nbytes")
    assert n is not None
    push_simulated_memory(n, reported)
    try:
        yield
    finally:
        pop_simulated_memory()


def assert_equivalent(fn, *args: Any, exact: bool = False, **kwargs: Any) -> Any:
    """Run ``jax.jit(fn)`` and ``autoopt.optimize(fn, fallback="raise")`` on the same inputs and
    assert equal outputs. Options of ``optimize`` may be given as keywords; ``static_argnums``/
    ``static_argnames`` apply to both. Returns the optimized output.

    Donation is turned off for the comparison (the reference must not see deleted inputs) unless
    ``donate`` is given explicitly.
    """
    from autoopt._jit import optimize
    from autoopt.passes import option_names

    names = option_names()
    opts = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
    opts.setdefault("fallback", "raise")
    opts.setdefault("donate", "off")
    static = {k: opts[k] for k in ("static_argnums", "static_argnames") if k in opts}
    expected = jax.jit(fn, **static)(*args, **kwargs)
    got = optimize(fn, **opts)(*args, **kwargs)
    assert_trees_equivalent(
        expected, got, exact=exact, what=f"optimize({getattr(fn, '__name__', 'fn')})"
    )
    return got


# --- hypothesis strategies ----------------------------------------------------------------------


DTYPES = ("float32", "int32", "bool", "bfloat16")


def arrays(dtype: str | None = None, shape=None, max_dims: int = 3, max_side: int = 5):
    """Strategy for jax arrays of small shapes and finite values (bfloat16 via float32)."""
    st, hnp = hypothesis_modules()
    dtypes = st.sampled_from(DTYPES) if dtype is None else st.just(dtype)
    shapes = (
        hnp.array_shapes(min_dims=0, max_dims=max_dims, min_side=1, max_side=max_side)
        if shape is None
        else st.just(tuple(shape))
    )

    @st.composite
    def build(draw):
        d = draw(dtypes)
        s = draw(shapes)
        if d == "bool":
            v = draw(hnp.arrays(np.bool_, s))
        elif d == "int32":
            v = draw(hnp.arrays(np.int32, s, elements=st.integers(-1000, 1000)))
        else:
            v = draw(hnp.arrays(np.float32, s, elements=st.floats(-100, 100, width=32)))
        return jnp.asarray(v, dtype=d)

    return build()


def pytrees(leaves=None, max_leaves: int = 6):
    """Strategy for nested dict/list/tuple pytrees of arrays."""
    st, _ = hypothesis_modules()
    leaves = leaves if leaves is not None else arrays()
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, min_size=1, max_size=3),
            st.lists(children, min_size=1, max_size=3).map(tuple),
            st.dictionaries(st.sampled_from("abcde"), children, min_size=1, max_size=3),
        ),
        max_leaves=max_leaves,
    )
