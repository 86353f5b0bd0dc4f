"""The caller-side fuzzer of ``donate="safe"`` (``autoopt.testing.caller_programs``): random
caller modules around a donating call, each run under jax.jit and under autoopt, must raise the
same errors, lose no array and give the same numbers. Plus the holes issue 14 listed, as fixed
programs, and checks that the fuzzer itself can fail and does exercise donation."""

from __future__ import annotations

import jax
import pytest
from hypothesis import given

from autoopt.testing import (
    caller_programs,
    check_caller_program,
    run_caller_program,
)
from autoopt.testing._callers import TEMPLATES, render


def program(*statements: str, v: str = "x", w: str = "y", a: str = "a") -> str:
    return render([TEMPLATES.get(s, s).format(V=v, W=w, A=a) for s in statements])


@given(caller_programs())
def test_no_random_caller_loses_an_array_or_a_number(source):
    check_caller_program(source)


# Issue 14 items 5-9, each around a donating call of the same statement shape.
HOLES = {
    "alias, then a star call": program("alias", "star_rest", "read_alias", "read"),
    "alias, then a double-star call": program("alias", "star_kw", "read_alias", "read"),
    "a local name bound to functools.reduce": program("builtin_list", "read"),
    "reduce over a list holding the array": program("list", "reduce", "read"),
    "a subscript target evaluated after the call": program("subscript_target", "read"),
    "a host callback raising after donating": program("raise_caught", "read", "call", "read"),
    "a thread reading the global while the call runs": program("thread_reads_global", "read"),
    "a closure cell read after the call": program("closure", "call"),
    "a nonlocal rebinding with an alias": program("alias", "call_nonlocal", "read_alias"),
}


@pytest.mark.parametrize("source", HOLES.values(), ids=HOLES.keys())
def test_the_holes_issue_14_listed_lose_nothing(source):
    check_caller_program(source)


def test_the_plain_rebinding_call_donates():
    """The fuzzer exercises donation: its instrumented call donates when nothing else holds."""
    assert check_caller_program(program("call", "read")).donated == 1
    assert check_caller_program(program("alias", "call", "read_alias")).donated == 0


def test_the_checker_fails_on_a_caller_that_loses_an_array():
    """A checker that cannot fail is no check: with every argument donated regardless of the
    caller (jax.jit's donate_argnums), the alias's read finds a deleted array."""
    source = program("alias", "call", "read_alias")
    jit_run = run_caller_program(source, jax.jit)
    donating = run_caller_program(source, lambda fn: jax.jit(fn, donate_argnums=0))
    assert jit_run.error is None
    assert donating.error is not None and "deleted" in donating.error
