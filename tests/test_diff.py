"""The equation-level diff: one rewritten equation shows as exactly one change, with its line."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import primitives as P

from autoopt import _jaxpr
from autoopt.report._diff import diff_counts, equation_diff

HERE = __file__


def body_line(fn, text: str) -> int:
    import inspect

    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, s in enumerate(lines) if text in s)


def f(x, y):
    a = jnp.sin(x) * y
    b = a + 1.0
    return jnp.cos(b)


def g(x):
    def body(c, _):
        return jnp.sin(c) * 2.0, None

    c, _ = lax.scan(body, x, None, length=3)
    return c + 1


def h(x):
    inner = jax.jit(lambda z: jnp.sin(z) + 1.0)
    return inner(x) * 3.0


SIN_TO_TANH = {P.sin_p: lambda eqn, inv: [jnp.tanh(inv[0])]}
COS_TO_SIN = {P.cos_p: lambda eqn, inv: [jnp.sin(inv[0])]}
SIN_TO_TWO = {P.sin_p: lambda eqn, inv: [jnp.tanh(inv[0] * 2.0)]}


def rewritten(fn, rules, *args):
    closed = jax.make_jaxpr(fn)(*args)
    new, changed = _jaxpr.rewrite(closed, rules)
    assert changed
    return equation_diff(closed, new)


def test_one_equation_rewrite_shows_exactly_one_change():
    x = jnp.ones(3)
    diff = rewritten(f, SIN_TO_TANH, x, x)
    assert diff_counts(diff) == (1, 1)
    removed = next(s for s in diff.splitlines() if s.startswith("- "))
    added = next(s for s in diff.splitlines() if s.startswith("+ "))
    # Same output name on both sides; only the primitive differs.
    assert removed[2:].replace("sin", "tanh").split("#")[0] == added[2:].split("#")[0]


def test_changed_equations_are_annotated_with_the_users_line():
    x = jnp.ones(3)
    diff = rewritten(f, SIN_TO_TANH, x, x)
    line = body_line(f, "jnp.sin(x)")
    for s in diff.splitlines():
        if s.startswith(("- ", "+ ")):
            assert s.endswith(f"# {HERE}:{line}")
        else:
            assert "#" not in s  # context lines carry no annotation


def test_rewrite_of_the_returned_equation_does_not_change_the_return_line():
    x = jnp.ones(3)
    diff = rewritten(f, COS_TO_SIN, x, x)
    assert diff_counts(diff) == (1, 1)
    assert "return" not in diff


def test_one_equation_replaced_by_two_shows_one_removed_and_two_added():
    x = jnp.ones(3)
    diff = rewritten(f, SIN_TO_TWO, x, x)
    assert diff_counts(diff) == (1, 2)


def test_changed_loop_body_is_diffed_inside_its_loop():
    diff = rewritten(g, SIN_TO_TANH, jnp.ones(3))
    assert diff_counts(diff) == (1, 1)
    lines = diff.splitlines()
    scan_row = next(i for i, s in enumerate(lines) if "scan[" in s)
    assert lines[scan_row].endswith(f"# {HERE}:{body_line(g, 'lax.scan')}")
    assert lines[scan_row + 1].strip() == "~ jaxpr:"
    assert lines[scan_row + 2].startswith("    - ")  # indented under the loop


def test_changed_inner_jit_body_is_diffed_inside_it():
    diff = rewritten(h, SIN_TO_TANH, jnp.ones(3))
    assert diff_counts(diff) == (1, 1)
    assert any(s.strip().startswith("~ jaxpr") for s in diff.splitlines())


def test_two_traces_of_one_program_have_an_empty_diff():
    x = jnp.ones(3)
    for fn, args in ((f, (x, x)), (g, (x,)), (h, (x,))):
        assert equation_diff(jax.make_jaxpr(fn)(*args), jax.make_jaxpr(fn)(*args)) == ""


def test_identical_programs_and_missing_sides_have_an_empty_diff():
    closed = jax.make_jaxpr(f)(jnp.ones(3), jnp.ones(3))
    assert equation_diff(closed, closed) == ""
    assert equation_diff(None, closed) == ""


def test_only_changes_and_their_context_are_shown():
    def long(x):
        for _ in range(12):
            x = x * 2.0
        x = jnp.sin(x)
        for _ in range(12):
            x = x + 1.0
        return x

    diff = rewritten(long, SIN_TO_TANH, jnp.ones(3))
    assert diff_counts(diff) == (1, 1)
    assert len(diff.splitlines()) == 2 + 2 * 2  # two context lines either side
