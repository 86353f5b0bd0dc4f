"""The caller-side fuzzer of ``donate="safe"`` (``autoopt.testing.caller_programs``): random
caller modules around a donating call, each run under jax.jit and under autoopt, must raise the
same errors, lose no array and give the same numbers. Plus the holes issue 14 listed and the
shapes of the later bugs (targets that fail to unpack, argument expressions that run code,
``locals()`` snapshots, a changing ``self`` or mutable argument, nnx modules mutated inside), as
fixed programs, one random test per group of those, and checks that the fuzzer itself can fail
and does exercise donation.

Sized for CI by the hypothesis profile in conftest.py (``AUTOOPT_HYPOTHESIS_EXAMPLES``, 25 by
default); the group tests run a third of that each. Shrinking is off (``phases``): a failing
program is printed with the check's message as it was drawn, and the fixed programs below are
the minimal reproductions; a shrink of a failing run took minutes."""

from __future__ import annotations

import copy

import jax
import pytest
from hypothesis import Phase, given, settings

from autoopt.testing import (
    caller_programs,
    check_caller_program,
    run_caller_program,
)
from autoopt.testing._callers import GROUPS, TEMPLATES, render

NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)
GROUP_EXAMPLES = max(4, settings().max_examples // 3)


def program(
    *statements: str,
    v: str = "x",
    w: str = "y",
    u: str = "z",
    a: str = "a",
    lr: str = "0.5",
    lr2: str = "0.25",
    mode: str = "function",
) -> str:
    scope = "nonlocal" if mode == "function" else "global"
    fmt = dict(V=v, W=w, U=u, A=a, SCOPE=scope, LR=lr, LR2=lr2)
    return render([TEMPLATES.get(s, s).format(**fmt) for s in statements], mode)


@settings(phases=NO_SHRINK)
@given(caller_programs())
def test_no_random_caller_loses_an_array_or_a_number(source):
    check_caller_program(source)


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_no_random_caller_of_a_group_loses_an_array_or_a_number(group):
    @settings(phases=NO_SHRINK, max_examples=GROUP_EXAMPLES)
    @given(caller_programs(max_statements=5, templates=GROUPS[group]))
    def run(source):
        check_caller_program(source)

    run()


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


# The later bugs' shapes, smallest programs first found by the fuzzer (each in a function and
# at module level where both apply).
SHAPES = {
    # 1. (x, y), z = f(x, y, z) with f's first output of three elements: the inner unpacking
    # raises after the call, x, y, z still bound to their arrays
    "nested target, inner unpacking fails": ("unpack_nested_fails",),
    "[x, (y, z)] target, second unpacking fails": ("unpack_inner_fails",),
    "x, y, *rest from a one-element list": ("unpack_starred_short",),
    "x, y from a dict of three keys": ("unpack_dict_keys",),
    "x, y from an array of three rows": ("unpack_rows",),
    "x, *rest from a 0-d array": ("unpack_scalar",),
    # 2. x = step(x, take()): take() moves the old x into keep and rebinds x
    "argument helper moves the array into another name": ("arg_take",),
    "keyword argument helper moves the array": ("arg_take_kw",),
    "argument helper moves the global G": ("arg_take_global",),
    "argument helper moves the array, then raises": ("arg_take_raises",),
    "argument expression raises": ("arg_raises",),
    "a nested call of step in the arguments": ("arg_nested_call", "arg_nested_first"),
    "a nested call, then an argument raises": ("arg_nested_raises",),
    "a walrus in the arguments": ("arg_walrus",),
    "an argument helper stashing the array": ("arg_stash",),
    # 3. snap = locals() before the call
    "locals() snapshot, plain callee": ("locals_call",),
    "locals() snapshot, local name as callee": ("locals_local_callee",),
    "vars() snapshot, attribute as callee": ("vars_attr_callee",),
    "a copy of locals()": ("locals_copy",),
    # 4. a changing self, a mutable argument
    "an optimized method, self.lr changed between calls": ("method_lr",),
    "an optimized method of a fresh instance each call": ("method_fresh_self",),
    "cfg passed as argument, cfg.gain changed between calls": ("cfg_gain",),
    "cfg inside a tuple argument": ("cfg_in_tuple",),
    "cfg passed by keyword": ("cfg_kw",),
    "a class passed as argument, Cfg.gain changed between calls": ("cls_gain",),
    "d.get passed as argument, d['gain'] changed between calls": ("dict_get",),
    "a new wrapper of a bound method per call, self.lr changed": ("fresh_wrapper_method",),
    # 5. an nnx module mutated inside, not returned
    "nnx: model.count.value += 1 inside": ("nnx_count",),
    "nnx: model.w.value = ... inside": ("nnx_assign",),
    "nnx: an optimized __call__ mutating self": ("nnx_method",),
}
SHAPE_PROGRAMS = {
    f"{name} [{mode}]": program(*statements, "read", "read_alias", mode=mode)
    for name, statements in SHAPES.items()
    for mode in ("function", "module")
    if mode == "function" or not any("nonlocal" in TEMPLATES[s] for s in statements)
    if not (mode == "module" and name.startswith("a copy of locals"))
}


@pytest.mark.parametrize("source", SHAPE_PROGRAMS.values(), ids=SHAPE_PROGRAMS.keys())
def test_the_shapes_of_the_later_bugs_lose_nothing(source):
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


def test_the_new_checks_fail_on_the_bugs_they_are_for():
    """Each new check, against a callee with the bug it is for: donating every argument
    regardless (the failed unpacking, the moved argument, the snapshot), a static first state
    (the mutable argument), and a dropped nnx mutation (plain jax.jit, not the reference run)."""

    def donating(fn):
        return jax.jit(fn, donate_argnums=0)

    for shape in ("unpack_nested_fails", "arg_take", "locals_call"):
        run = run_caller_program(program(shape), donating)
        assert run.error is not None and "deleted" in run.error, (shape, run.error)

    def first_state_forever(fn):
        # each non-array argument as it was the first time its identity was seen
        first: dict[int, object] = {}

        def call(*args):
            args = tuple(
                a if isinstance(a, jax.Array) else first.setdefault(id(a), copy.copy(a))
                for a in args
            )
            return fn(*args)

        return call

    for shape in ("method_lr", "cfg_gain"):
        run = run_caller_program(program(shape), first_state_forever)
        assert run.error is not None and "CallerMismatch" in run.error, (shape, run.error)

    run = run_caller_program(program("nnx_count"), jax.jit)
    assert run.error is not None and "CallerMismatch" in run.error, run.error
