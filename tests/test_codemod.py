"""Codemods: inline before/after snippets (including must-not-change cases), idempotence, exact
numbers of rewritten code, and a rewritten example file that imports, runs and agrees."""

from __future__ import annotations

import importlib.util
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from libcst.codemod import (
    CodemodContext,
    TransformFailure,
    TransformSkip,
    TransformSuccess,
    transform_module,
)

import autoopt
from autoopt.codemod import COMMANDS, CheckCall, plan_source_edits, rewrite_code
from autoopt.passes import registered_passes
from autoopt.passes._base import resolve
from autoopt.passes.donation.codemod import DonateCommand
from autoopt.passes.in_place.codemod import ScatterToDUSCommand
from autoopt.passes.placement.codemod import PlacementCommand
from autoopt.passes.remat.codemod import RematCommand
from autoopt.report import Finding


def F(kind, line, applied=True, **details):
    return Finding(kind, applied, "msg", location=f"snippet.py:{line}", details=details)


def donate(arg, line=1, **extra):
    return Finding(
        "donate",
        False,
        "can be donated",
        location=f"snippet.py:{line}",
        details={"arg": arg, "name": str(arg), "aliasable": True, **extra},
    )


def run_command(command, before, findings, **kw):
    cmd = command(CodemodContext(), findings, **kw)
    return transform_module(cmd, textwrap.dedent(before)), cmd


def assert_codemod(command, before, after, findings, **kw):
    result, cmd = run_command(command, before, findings, **kw)
    assert isinstance(result, TransformSuccess), getattr(result, "skip_description", result)
    assert result.code == textwrap.dedent(after)
    # Idempotent: the same findings on the rewritten code change nothing.
    again, _ = run_command(command, result.code, findings, **kw)
    assert isinstance(again, TransformSkip) or again.code == result.code
    return cmd


def assert_unchanged(command, before, findings, **kw):
    result, cmd = run_command(command, before, findings, **kw)
    assert isinstance(result, TransformSkip) or result.code == textwrap.dedent(before)
    return cmd


# --- every command -------------------------------------------------------------------------------


def test_every_command_has_a_description_and_a_kind():
    # One command per registered pass that declares one, for a kind that pass emits; commands
    # that may insert statements run after the in-line edits.
    declared = [p for p in registered_passes().values() if p.codemod]
    assert sorted(c.__name__ for c in COMMANDS) == sorted(
        resolve(p.codemod).__name__ for p in declared
    )
    assert all(resolve(p.codemod).KIND in p.kinds for p in declared)
    assert [c.INSERTS_STATEMENTS for c in COMMANDS] == sorted(
        c.INSERTS_STATEMENTS for c in COMMANDS
    )
    assert COMMANDS[-1] is PlacementCommand
    for c in COMMANDS:
        assert len(c.DESCRIPTION) > 20 and c.HINT


@pytest.mark.parametrize("command", COMMANDS)
def test_commands_never_raise_on_broken_code_or_odd_findings(command):
    odd = [
        F(command.KIND, 10**6, arg=object()),
        F(command.KIND, None),
        Finding(command.KIND, True, "m", location="nowhere", details={"arg": 0, "aliasable": True}),
    ]
    broken = transform_module(command(CodemodContext(), odd, function="f"), "def f(:\n")
    assert isinstance(broken, TransformFailure)
    odd_result = transform_module(command(CodemodContext(), odd, function="f"), "x = 1\n")
    assert isinstance(odd_result, TransformSkip | TransformSuccess)
    none = transform_module(command(CodemodContext(), []), "x = 1\n")
    assert isinstance(none, TransformSkip)


# --- scatter_to_dus ------------------------------------------------------------------------------


def test_row_set_becomes_guarded_dynamic_update():
    assert_codemod(
        ScatterToDUSCommand,
        """\
        from jax import lax

        def f(x, i, row):
            x = x.at[i].set(row)  # the row
            return x
        """,
        """\
        from jax import lax
        import jax.numpy as jnp

        def f(x, i, row):
            x = lax.cond(
                (-x.shape[0] <= i) & (i < x.shape[0]),
                lambda: lax.dynamic_update_index_in_dim(x, jnp.broadcast_to(row, x.shape[1:]).astype(x.dtype), i, 0),
                lambda: x,
            )  # the row
            return x
        """,
        [F("scatter_to_dus", 4)],
    )


def test_an_update_proven_for_the_traced_shapes_keeps_its_guard_in_the_source(tmp_path):
    # The pass proved `buf.at[3].set(row)` in bounds for the 8-row buf it traced; the source
    # serves every shape, and a 2-row buf drops the row where a bare dynamic_update_slice
    # clamps it into row 1 (and `buf.at[n]` with a static n proven for one n).
    before = """\
import jax.numpy as jnp


def put(buf, row):
    return buf.at[3].set(row)


def put_n(buf, row, n):
    return buf.at[n].set(row)


def put_block(buf, block, i):
    return buf.at[i + jnp.arange(2)].set(block)


def take(buf, i):
    return buf[i + jnp.arange(2)]
"""
    proven = [F("scatter_to_dus", n, guard="none") for n in (5, 9, 13)]
    proven.append(
        Finding(
            "scatter_to_dus",
            True,
            "gather rewritten",
            location="snippet.py:17",
            details={"op": "gather", "guard": "none", "window": (2, 4)},
        )
    )
    new = rewrite_code(before, proven).code
    assert new.count("lax.cond(") == 4 and ".at[" in new and "dynamic_slice_in_dim" in new
    ref, got = _load(before, "proven_before", tmp_path), _load(new, "proven_after", tmp_path)
    for rows in (8, 2, 4, 1):
        buf = jnp.arange(rows * 4, dtype=jnp.float32).reshape(rows, 4)
        row, block = jnp.full((4,), -1.0), jnp.full((2, 4), -2.0)
        np.testing.assert_array_equal(jax.jit(ref.put)(buf, row), jax.jit(got.put)(buf, row))
        for n in (-9, -3, -1, 0, 1, 3, 7, 9):
            args = (buf, row, n)
            np.testing.assert_array_equal(
                jax.jit(ref.put_n, static_argnums=2)(*args),
                jax.jit(got.put_n, static_argnums=2)(*args),
                err_msg=f"{rows} rows, n={n}",
            )
            np.testing.assert_array_equal(
                jax.jit(ref.put_block)(buf, block, n), jax.jit(got.put_block)(buf, block, n)
            )
            np.testing.assert_array_equal(jax.jit(ref.take)(buf, n), jax.jit(got.take)(buf, n))


def test_an_update_the_source_promises_in_bounds_has_no_guard():
    assert_codemod(
        ScatterToDUSCommand,
        """\
        import jax

        def f(x, i, row):
            return x.at[i].set(row, mode="promise_in_bounds")
        """,
        """\
        import jax

        def f(x, i, row):
            return jax.lax.dynamic_update_index_in_dim(
                x,
                jax.numpy.broadcast_to(row, x.shape[1:]).astype(x.dtype),
                i,
                0,
            )
        """,
        [F("scatter_to_dus", 4, guard="none")],
    )


def test_add_becomes_read_modify_write_and_lax_is_imported():
    assert_codemod(
        ScatterToDUSCommand,
        """\
        def f(x, i, v):
            return x.at[i].add(v, mode="promise_in_bounds")
        """,
        """\
        from jax import lax

        def f(x, i, v):
            return lax.dynamic_update_index_in_dim(x, (x[i] + v).astype(x.dtype), i, 0)
        """,
        [F("scatter_to_dus", 2)],
    )


def test_window_update_keeps_the_scatter_for_out_of_bounds_starts():
    cmd = assert_codemod(
        ScatterToDUSCommand,
        """\
        import jax.numpy as jnp
        from jax import lax

        def f(x, i, b):
            return x.at[i + jnp.arange(3)].set(b)
        """,
        """\
        import jax.numpy as jnp
        from jax import lax

        def f(x, i, b):
            return lax.cond(
                (0 <= i) & (i + 3 <= x.shape[0]),
                lambda: lax.dynamic_update_slice_in_dim(x, jnp.broadcast_to(b, (3, *x.shape[1:])).astype(x.dtype), i, 0) if 3 <= x.shape[0] else x.at[i + jnp.arange(3)].set(b),
                lambda: x.at[i + jnp.arange(3)].set(b),
            )
        """,
        [F("scatter_to_dus", 5)],
    )
    assert cmd.outcomes == {0: None}


def test_a_blended_window_becomes_one_update_window_call():
    cmd = assert_codemod(
        ScatterToDUSCommand,
        """\
        import jax.numpy as jnp

        def f(x, i, b):
            x = x.at[i + jnp.arange(8)].add(b)  # a running window
            return x.at[jnp.arange(i, i + 4)].set(0.0)
        """,
        """\
        import jax.numpy as jnp
        import autoopt

        def f(x, i, b):
            x = autoopt.update_window(x, i, b, size=8, op="add")  # a running window
            return autoopt.update_window(x, i, 0.0, size=4)
        """,
        [F("scatter_to_dus", 4, guard="blend"), F("scatter_to_dus", 5, guard="blend")],
    )
    assert cmd.outcomes == {0: None, 1: None}


def test_a_blended_tile_becomes_one_update_window_call_with_a_start_per_axis():
    cmd = assert_codemod(
        ScatterToDUSCommand,
        """\
        import jax.numpy as jnp

        def f(x, i, j, b):
            x = x.at[i + jnp.arange(8)[:, None], j + jnp.arange(16)].add(b)
            return x.at[(i + jnp.arange(2))[:, None], jnp.arange(3) + j].set(0.0)
        """,
        """\
        import jax.numpy as jnp
        import autoopt

        def f(x, i, j, b):
            x = autoopt.update_window(x, (i, j), b, size=(8, 16), op="add")
            return autoopt.update_window(x, (i, j), 0.0, size=(2, 3))
        """,
        [F("scatter_to_dus", 4, guard="blend"), F("scatter_to_dus", 5, guard="blend")],
    )
    assert cmd.outcomes == {0: None, 1: None}


def test_a_tile_becomes_one_update_window_call_and_a_transposed_one_is_left():
    # (a tile proven in bounds for the traced shapes too: the blend is exact for every shape)
    cmd = assert_codemod(
        ScatterToDUSCommand,
        """\
        import jax.numpy as jnp

        def f(x, i, j, b):
            x = x.at[i + jnp.arange(8)[:, None], j + jnp.arange(16)].set(b)
            return x.at[i + jnp.arange(8), j + jnp.arange(16)[:, None]].set(b)
        """,
        """\
        import jax.numpy as jnp
        import autoopt

        def f(x, i, j, b):
            x = autoopt.update_window(x, (i, j), b, size=(8, 16))
            return x.at[i + jnp.arange(8), j + jnp.arange(16)[:, None]].set(b)
        """,
        [F("scatter_to_dus", 4, guard="none"), F("scatter_to_dus", 5, guard="none")],
    )
    assert cmd.outcomes[0] is None and "several axes" in cmd.outcomes[1]


def test_scalar_fill_is_broadcast_to_the_row_and_cast_to_the_array_dtype():
    assert_codemod(
        ScatterToDUSCommand,
        """\
        import jax.numpy as jnp
        from jax import lax

        def f(x):
            return x.at[2].set(0)
        """,
        """\
        import jax.numpy as jnp
        from jax import lax

        def f(x):
            return lax.cond(
                (-x.shape[0] <= 2) & (2 < x.shape[0]),
                lambda: lax.dynamic_update_index_in_dim(x, jnp.broadcast_to(0, x.shape[1:]).astype(x.dtype), 2, 0),
                lambda: x,
            )
        """,
        [F("scatter_to_dus", 5, guard="none")],
    )


@pytest.mark.parametrize(
    "line, reason",
    [
        ("x = x.at[i, j].set(v)", "several axes"),
        ("x = x.at[i].get()", None),
        ("x = x.at[i].set(v, mode='clip', wrap=1)", "wrap="),
        ("x = x.at[idx()].set(v)", "the index is an expression"),
        ("x = f(x).at[i].set(v)", "the updated array is an expression"),
        ("x = lax.cond(p, lambda: x.at[i].set(v), lambda: x)", "already inside a lax.cond"),
    ],
)
def test_updates_without_an_exact_rewrite_are_left_alone_with_a_reason(line, reason):
    cmd = assert_unchanged(
        ScatterToDUSCommand, f"from jax import lax\n{line}\n", [F("scatter_to_dus", 2)]
    )
    assert cmd.outcomes[0] is not None
    if reason:
        assert reason in cmd.outcomes[0]


def test_only_lines_with_an_applied_finding_are_rewritten():
    before = "x = x.at[i].set(v)\ny = y.at[i].set(v)\n"
    assert_unchanged(ScatterToDUSCommand, before, [F("scatter_to_dus", 1, applied=False)])
    result, _ = run_command(ScatterToDUSCommand, before, [F("scatter_to_dus", 2, guard="none")])
    assert result.code.splitlines()[:2] == ["import jax.numpy as jnp", "from jax import lax"]
    assert result.code.splitlines()[3] == "x = x.at[i].set(v)"
    assert "dynamic_update_index_in_dim(y, jnp.broadcast_to(v, y.shape[1:])" in result.code


SCATTER_FNS = """\
import jax.numpy as jnp
from jax import lax


def row_set(x, i, v):
    return x.at[i].set(v)


def row_add(x, i, v):
    return x.at[i].add(v)


def row_max(x, i, v):
    return x.at[i].max(v)


def window_set(x, i, v):
    return x.at[i + jnp.arange(3)].set(v)


def window_mul(x, i, v):
    return x.at[i + jnp.arange(3)].multiply(v)
"""


def _load(code: str, name: str, tmp_path):
    # A project of its own (a marker file): a donate edit searches the project for other files
    # naming the function, and the other tests' folders beside this one are not its callers.
    (tmp_path / "setup.cfg").write_text("")
    path = tmp_path / f"{name}.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("guard", ["cond", "select", "blend"])
def test_rewritten_updates_give_the_same_numbers_for_every_index(guard, tmp_path):
    lines = [i + 1 for i, s in enumerate(SCATTER_FNS.splitlines()) if ".at[" in s]
    new = rewrite_code(SCATTER_FNS, [F("scatter_to_dus", n, guard=guard) for n in lines]).code
    assert ".at[i].set" not in new
    assert new.count("lax.cond(") == (5 if guard == "cond" else 3 if guard == "blend" else 0)
    assert new.count("jnp.where(") == (3 if guard == "select" else 0)
    assert new.count("autoopt.update_window(") == (2 if guard == "blend" else 0)
    before = _load(SCATTER_FNS, "scatter_before", tmp_path)
    after = _load(new, f"scatter_after_{guard}", tmp_path)
    x = jnp.arange(8 * 2, dtype=jnp.float32).reshape(8, 2)
    row, block = jnp.array([-5.0, 7.0]), jnp.full((3, 2), 3.0)
    cases = [("row_set", row), ("row_add", row), ("row_max", row)]
    if guard != "select":
        cases += [("window_set", block), ("window_mul", block)]
    for name, v in cases:
        ref, got = jax.jit(getattr(before, name)), jax.jit(getattr(after, name))
        for i in (-100, -11, -10, -9, -8, -3, -2, -1, 0, 3, 5, 6, 7, 8, 9, 100):
            np.testing.assert_array_equal(ref(x, i, v), got(x, i, v), err_msg=f"{name} at {i}")


def test_select_guard_writes_back_the_clamped_row():
    assert_codemod(
        ScatterToDUSCommand,
        """\
        import jax.numpy as jnp
        from jax import lax
        x = x.at[i].set(v)
        """,
        """\
        import jax.numpy as jnp
        from jax import lax
        x = lax.dynamic_update_index_in_dim(
            x,
            jnp.where((-x.shape[0] <= i) & (i < x.shape[0]), jnp.broadcast_to(v, x.shape[1:]).astype(x.dtype), x[i]),
            i,
            0,
        )
        """,
        [F("scatter_to_dus", 3, guard="select")],
    )


def test_proven_window_read_becomes_dynamic_slice():
    gather = Finding(
        "scatter_to_dus",
        True,
        "gather on f32[8,2] rewritten to dynamic_slice",
        location="snippet.py:3",
        details={"op": "gather", "guard": "none", "window": (3, 2)},
    )
    assert_codemod(
        ScatterToDUSCommand,
        """\
        import jax.numpy as jnp
        from jax import lax
        y = x[i + jnp.arange(3)] * 2
        """,
        """\
        import jax.numpy as jnp
        from jax import lax
        y = lax.cond(
            (0 <= i) & (i + 3 <= x.shape[0]),
            lambda: lax.dynamic_slice_in_dim(x, i, 3, 0) if 3 <= x.shape[0] else x[i + jnp.arange(3)],
            lambda: x[i + jnp.arange(3)],
        ) * 2
        """,
        [gather],
    )
    # (guarded so, the read is exact at any bounds: one the pass did not prove is written alike)
    unproven = gather.replace(details={"op": "gather", "guard": "select"})
    result, cmd = run_command(
        ScatterToDUSCommand, "import jax.numpy as jnp\n\ny = x[i + jnp.arange(3)]\n", [unproven]
    )
    assert "lambda: x[i + jnp.arange(3)]" in result.code and cmd.outcomes[0] is None


# --- donate -------------------------------------------------------------------------------------


def test_jit_decorator_gets_donate_argnums():
    assert_codemod(
        DonateCommand,
        """\
        import jax

        @jax.jit
        def step(state, batch):
            return state

        for batch in batches:
            state = step(state, batch)
        """,
        """\
        import jax
        from functools import partial

        @partial(jax.jit, donate_argnums=(0,))
        def step(state, batch):
            return state

        for batch in batches:
            state = step(state, batch)
        """,
        [donate(0, 3)],
        function="step",
        function_line=3,
    )


def test_partial_jit_and_decorator_factory_get_the_keyword_added():
    assert_codemod(
        DonateCommand,
        """\
        import functools, jax

        @functools.partial(jax.jit, static_argnums=2)
        def step(a, b, n):
            return a, b

        a, b = step(a, b, 3, c=c)
        """,
        """\
        import functools, jax

        @functools.partial(jax.jit, static_argnums=2, donate_argnums=(0, 1))
        def step(a, b, n):
            return a, b

        a, b = step(a, b, 3, c=c)
        """,
        [donate(0), donate(1), donate("c")],
        function="step",
    )
    assert_codemod(
        DonateCommand,
        """\
        from jax import jit

        @jit(static_argnums=1)
        def step(a, n):
            return a

        a = step(a, 2)
        """,
        """\
        from jax import jit

        @jit(static_argnums=1, donate_argnums=(0,))
        def step(a, n):
            return a

        a = step(a, 2)
        """,
        [donate(0)],
        function="step",
    )


def test_style_autoopt_replaces_the_jit_keeping_its_keywords():
    assert_codemod(
        DonateCommand,
        """\
        from functools import partial
        import jax

        @partial(jax.jit, static_argnums=1)
        def step(a, n):
            return a

        fast = jax.jit(step)
        """,
        """\
        from functools import partial
        import jax
        import autoopt

        @autoopt.optimize(static_argnums=1)
        def step(a, n):
            return a

        fast = autoopt.optimize(step)
        """,
        [donate(0)],
        function="step",
        style="autoopt",
    )


def test_module_level_jit_call_gets_donate_argnums():
    assert_codemod(
        DonateCommand,
        """\
        import jax

        def step(a, b):
            return a

        step_fast = jax.jit(step, static_argnums=1)
        a = step_fast(a, 1)
        """,
        """\
        import jax

        def step(a, b):
            return a

        step_fast = jax.jit(step, static_argnums=1, donate_argnums=(0,))
        a = step_fast(a, 1)
        """,
        [donate(0)],
        function="step",
    )


@pytest.mark.parametrize(
    "decorator, reason",
    [
        ("@partial(jax.jit, donate_argnums=1)", "already names"),
        ("@autoopt.optimize", "already under @autoopt.optimize"),
        ("@other.decorator", "not jitted in this file"),
    ],
)
def test_functions_already_donating_or_not_jitted_are_left_alone(decorator, reason):
    before = (
        "import autoopt, jax, other\nfrom functools import partial\n\n"
        f"{decorator}\ndef step(a):\n    return a\n"
    )
    cmd = assert_unchanged(DonateCommand, before, [donate(0)], function="step")
    assert reason in cmd.outcomes[0]


def test_argument_a_call_site_reuses_is_not_donated():
    site = Finding(
        "donate",
        False,
        "not donated here",
        location="main.py:9",
        details={"arg": 0, "site": "main.py:9"},
    )
    cmd = assert_unchanged(
        DonateCommand,
        "import jax\n\n@jax.jit\ndef step(a):\n    return a\n",
        [donate(0), site],
        function="step",
    )
    assert "keeps using it" in cmd.outcomes[0]


@pytest.mark.parametrize(
    "calls, why",
    [
        ("new_w = step(w, x)\nprint(w.sum())", "the call on line 8 (`step(w, x)`) does not show"),
        ("w0 = w\nw = step(w, x)", "the call on line 9"),
        ("def train(w, xs):\n    for x in xs:\n        w = step(w, x)", "the call on line 10"),
        ("w, _ = step(w, x), 1", "the call on line 8"),
        ("w = step(*args)", "the call on line 8"),
        ("w = step(w, x)\nlog(step(w, x))", "the call on line 9"),
        ("w = step(w, x)\ncallbacks.append(step)", "passed around on line 9"),
        # A second holder of the same buffer, in the forms a reviewer found the first check missed.
        ("w = w0\nw = step(w, x)\nprint(w0)", "the call on line 9"),
        ("w = ws[0]\nw = step(w, x)", "the call on line 9"),
        ("for w in ws:\n    w = step(w, x)", "the call on line 9"),
        ("w = jnp.ones(3)\nhist.append(w)\nw = step(w, x)", "the call on line 10"),
        ("w = jnp.asarray(w0)\nw = step(w, x)", "the call on line 9"),
        ("w = init()\nw = step(w, x)", "the call on line 9"),
        ("w = jnp.ones(3)\nget = lambda: w\nw = step(w, x)", "the call on line 10"),
        ("", "no call of `step` in this file"),
    ],
)
def test_jit_donation_needs_every_call_in_the_file_to_rebind_the_argument(calls, why):
    # donate_argnums is a promise for every caller: a call that keeps using its argument (or
    # callers the file does not show) would find their array deleted. The report's own example:
    # `new_w = f(w, x)` followed by `w.sum()` raised "Array has been deleted" after the edit.
    before = (
        "import jax\nimport jax.numpy as jnp\n\n@jax.jit\ndef step(w, x):\n    return w\n\n"
        f"{calls}\n"
    )
    cmd = assert_unchanged(DonateCommand, before, [donate(0, 3)], function="step")
    assert why in cmd.outcomes[0] and "--style autoopt" in cmd.outcomes[0], cmd.outcomes[0]
    # The autoopt style is always safe: it proves donation at each call.
    result, _ = run_command(DonateCommand, before, [donate(0, 3)], function="step", style="autoopt")
    assert "@autoopt.optimize" in result.code


def test_rewritten_jit_donation_runs_where_the_callers_rebind(tmp_path):
    code = textwrap.dedent("""\
        import jax
        import jax.numpy as jnp

        @jax.jit
        def step(w, x):
            return w - 0.1 * x

        def train(xs):
            w = jnp.ones(4)
            for x in xs:
                w = step(w, x)
            return w
        """)
    new = rewrite_code(code, [donate(0, 4)], function="step").code
    assert "donate_argnums=(0,)" in new
    mod = _load(new, "donate_after", tmp_path)
    np.testing.assert_allclose(mod.train([jnp.ones(4)] * 3), jnp.full(4, 0.7), rtol=1e-6)


def test_donate_argnums_is_not_promised_for_a_function_another_module_imports(tmp_path):
    # The file's own caller rebinds `w`, but user.py imports `step` and keeps each old `w` in a
    # list: donate_argnums would delete them. Packages count too: the search starts above the
    # outermost package, so a sibling package's module is seen.
    code = textwrap.dedent("""\
        import jax

        @jax.jit
        def step(w, x):
            return w - 0.1 * x

        if __name__ == "__main__":
            w = jax.numpy.ones(4)
            for _ in range(3):
                w = step(w, 1.0)
        """)
    (tmp_path / "setup.cfg").write_text("")  # the project: only this test's files are searched
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    lib = pkg / "lib.py"
    lib.write_text(code)
    alone = rewrite_code(code, [donate(0, 4)], function="step", path=str(lib))
    assert "donate_argnums=(0,)" in alone.code, alone.outcomes  # (the test can fail)
    user = tmp_path / "app" / "train.py"
    user.parent.mkdir()
    user.write_text(
        "from pkg.lib import (\n    step,\n)\nhistory = []\n"
        "for _ in range(3):\n    history.append(w)\n    w = step(w, 1.0)\n"
    )
    shared = rewrite_code(code, [donate(0, 4)], function="step", path=str(lib))
    assert shared.code == code
    assert f"{user}:2 names `step` and its module" in shared.outcomes[0]
    assert "@autoopt.optimize" in shared.outcomes[0]  # what to do instead
    # style="autoopt" proves donation per call site at run time: still offered.
    safe = rewrite_code(code, [donate(0, 4)], function="step", path=str(lib), style="autoopt")
    assert "autoopt.optimize" in safe.code


@pytest.mark.parametrize(
    "where, text",
    [
        # a src layout: the project (pyproject.toml) holds the scripts beside src/
        ("train.py", "from pkg.lib import step\n"),
        ("tests/test_step.py", "import pkg.lib as L\nL.step(w, 1.0)\n"),
        # a re-export: the caller names the package, not the module
        ("train.py", "from pkg import step\n"),
        (
            "notebook.ipynb",
            '{"cells": [{"source": ["from pkg import lib\\n", "lib.step(w, 1.0)"]}]}',
        ),
    ],
)
def test_donate_argnums_sees_callers_across_the_project(tmp_path, where, text):
    code = "import jax\n\n@jax.jit\ndef step(w, x):\n    return w - x\n"
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'p'\n")
    pkg = tmp_path / "src" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .lib import *\n")
    lib = pkg / "lib.py"
    lib.write_text(code)
    caller = tmp_path / where
    caller.parent.mkdir(parents=True, exist_ok=True)
    caller.write_text(text)
    got = rewrite_code(code, [donate(0, 4)], function="step", path=str(lib))
    assert got.code == code, got.outcomes
    assert str(caller) in got.outcomes[0]


def test_lambda_has_no_def_to_decorate():
    cmd = assert_unchanged(
        DonateCommand, "import jax\nf = jax.jit(lambda x: x)\n", [donate(0)], function="<lambda>"
    )
    assert "lambda" in cmd.outcomes[0]


def test_same_name_in_another_scope_is_not_touched():
    before = (
        "import jax\n\n@jax.jit\ndef step(a):\n    return a\n\nclass K:\n    @jax.jit\n"
        "    def step(a):\n        return a\n\na = step(a)\n"
    )
    result, _ = run_command(DonateCommand, before, [donate(0)], function="step", function_line=8)
    assert result.code.count("donate_argnums") == 1
    assert "@partial(jax.jit, donate_argnums=(0,))\n    def step" in result.code


# --- remat --------------------------------------------------------------------------------------


def test_call_of_a_user_function_is_checkpointed():
    assert_codemod(
        RematCommand,
        """\
        import jax

        def f(h, ps):
            for p in ps:
                h = block(h, p)  # layer
            return h
        """,
        """\
        import jax

        def f(h, ps):
            for p in ps:
                h = jax.checkpoint(block)(h, p)  # layer
            return h
        """,
        [F("remat", 5)],
    )


def test_loop_body_is_checkpointed_with_the_policy():
    assert_codemod(
        RematCommand,
        """\
        from jax import lax
        import jax

        def f(c, xs):
            return lax.scan(body, c, xs)
        """,
        """\
        from jax import lax
        import jax

        def f(c, xs):
            return lax.scan(jax.checkpoint(body, policy=jax.checkpoint_policies.dots_saveable), c, xs)
        """,
        [F("remat", 5, policy="dots_saveable")],
    )


def test_library_expression_becomes_a_checkpointed_lambda_of_its_locals():
    assert_codemod(
        RematCommand,
        """\
        import jax
        import jax.numpy as jnp
        SCALE = 2.0

        def f(h, w, b):
            h = jnp.tanh(h @ w + b) * SCALE
            return h
        """,
        """\
        import jax
        import jax.numpy as jnp
        SCALE = 2.0

        def f(h, w, b):
            h = jax.checkpoint(lambda h, w, b: jnp.tanh(h @ w + b) * SCALE)(h, w, b)
            return h
        """,
        [F("remat", 6)],
    )


def test_names_assigned_from_a_shape_stay_closed_over_in_the_checkpointed_lambda():
    # Passed as arguments they would be traced, and reshape(b, s, d) of tracers raises
    # ConcretizationTypeError (the demo's transformer, issue 28).
    assert_codemod(
        RematCommand,
        """\
        import jax
        import jax.numpy as jnp

        def f(x, w):
            b, s, d = x.shape
            n = len(w)
            x = jnp.tanh(x.reshape(b * s, d) @ w).reshape(b, s, n)
            return x
        """,
        """\
        import jax
        import jax.numpy as jnp

        def f(x, w):
            b, s, d = x.shape
            n = len(w)
            x = jax.checkpoint(lambda x, w: jnp.tanh(x.reshape(b * s, d) @ w).reshape(b, s, n))(x, w)
            return x
        """,
        [F("remat", 7)],
    )


def test_named_function_gets_the_checkpoint_decorator():
    assert_codemod(
        RematCommand,
        """\
        import jax

        def block(h, p):
            return h * p
        """,
        """\
        import jax

        @jax.checkpoint
        def block(h, p):
            return h * p
        """,
        [F("remat", 1, function="block")],
    )


def test_every_recomputed_line_is_checkpointed_keeping_the_matmuls():
    finding = F(
        "remat",
        4,
        recomputed=[
            {"values": 2, "bytes": 1024, "location": "snippet.py:5", "primitives": ["tanh"]},
            {"values": 1, "bytes": 512, "location": "snippet.py:6", "primitives": ["mul", "exp"]},
        ],
    )
    assert_codemod(
        RematCommand,
        """\
        import jax, jax.numpy as jnp

        def f(h, w):
            h = jnp.tanh(h @ w)
            g = jnp.exp(h) * 2
            return g
        """,
        """\
        import jax, jax.numpy as jnp

        def f(h, w):
            h = jax.checkpoint(lambda h, w: jnp.tanh(h @ w), policy=jax.checkpoint_policies.dots_saveable)(h, w)
            g = jax.checkpoint(lambda h: jnp.exp(h) * 2, policy=jax.checkpoint_policies.dots_saveable)(h)
            return g
        """,
        [finding],
    )


@pytest.mark.parametrize(
    "line",
    [
        "h = jax.checkpoint(block)(h, p)",
        "h = lax.scan(jax.checkpoint(body), h, xs)",
        "return h",
        "h = x.sum",
    ],
)
def test_remat_must_not_change(line):
    assert_unchanged(RematCommand, f"import jax\nfrom jax import lax\n{line}\n", [F("remat", 3)])


# --- placement ------------------------------------------------------------------------------------


def test_host_fed_loop_is_prefetched_and_constant_placed_once():
    assert_codemod(
        PlacementCommand,
        """\
        import autoopt
        import jax

        def train(w, batches, table):
            # the loop
            for batch in batches:
                w = step(w, batch, table)
            return w
        """,
        """\
        import autoopt
        import jax

        def train(w, batches, table):
            # the loop
            table = jax.device_put(table)
            for batch in autoopt.prefetch(batches):
                w = step(w, batch, table)
            return w
        """,
        [F("placement", 7, arg=1), F("placement", 7, arg=2)],
        function="step",
    )


@pytest.mark.parametrize(
    "loop, fed",
    [
        # an RL loop: the environment the observations come from is stepped by the body
        (
            "for obs in env.observations():\n        action, w = step(w, obs)\n"
            "        env.act(action)",
            "env",
        ),
        # a generator of this file reading a name the body rebinds
        ("for obs in rollout():\n        w = step(w, obs)\n        latest = w", "latest"),
        ("for obs in source:\n        w = step(w, obs)\n        source.feedback(w)", "source"),
    ],
)
def test_prefetch_is_not_offered_where_the_batches_depend_on_the_loop_body(loop, fed):
    # issue 16: a prefetched batch would be made before the body's change it depends on
    before = (
        "import numpy as np\n\nlatest = None\n\ndef rollout():\n    while True:\n"
        "        yield np.asarray(latest)\n\ndef train(w, env, source):\n"
        f"    {loop}\n    return w\n"
    )
    why = _prefetch_refused(before)
    assert why is not None and f"changes `{fed}`" in why


def _prefetch_refused(before: str) -> str | None:
    """Why the placement codemod left the loop calling ``step(`` in ``before`` as it is."""
    line = before.splitlines().index(next(ln for ln in before.splitlines() if "step(" in ln)) + 1
    cmd = assert_unchanged(PlacementCommand, before, [F("placement", line, arg=1)], function="step")
    [why] = cmd.outcomes.values()
    return why


@pytest.mark.parametrize(
    "loop, why",
    [
        # the rest of the iterator is read after the loop: batches taken ahead would be lost
        (
            "for obs in source:\n        w = step(w, obs)\n        if w is None:\n"
            "            break",
            "can end before its batches do",
        ),
        ("for obs in source:\n        w = step(w, obs)\n        return w", "can end before"),
        # the body draws from the random stream the batches are drawn from
        (
            "for obs in noisy():\n        w = step(w, obs + np.random.rand())",
            "changes `np`",
        ),
        (
            "for obs in shuffled():\n        w = step(w, obs * random.random())",
            "changes `random`",
        ),
    ],
)
def test_prefetch_is_not_offered_where_running_ahead_changes_what_the_loop_sees(loop, why):
    # (a hostile review: a loop with `break` lost the items the prefetch thread took from an
    # iterator read after it; a body drawing np.random changed the batches' draws)
    before = (
        "import random\n\nimport numpy as np\n\ndef noisy():\n    while True:\n"
        "        yield np.random.rand(8)\n\ndef shuffled():\n    while True:\n"
        "        yield np.arange(8) * random.random()\n\ndef train(w, source):\n"
        f"    {loop}\n    return w\n"
    )
    got = _prefetch_refused(before)
    assert got is not None and why in got


def test_prefetch_is_offered_where_a_break_belongs_to_an_inner_loop_and_numpy_is_pure():
    before = (
        "import numpy as np\n\ndef train(w, source):\n    for obs in source:\n"
        "        w = step(w, obs)\n        for k in range(3):\n            if k:\n"
        "                break\n        print(np.mean(obs))\n    return w\n"
    )
    result, cmd = run_command(PlacementCommand, before, [F("placement", 5, arg=1)], function="step")
    assert "autoopt.prefetch(source)" in result.code, (cmd.outcomes, result.code)


def test_placement_finding_at_a_call_site_names_leaves_by_parameter():
    """The pass names leaves by the function's parameters (`batch['x']`); the caller passes
    `b`: ``params`` (added from the signature) maps them to positions."""
    pack = F(
        "placement", 5, strategy="pack", leaves=["batch['x']", "batch['y']"], params=[(1, "batch")]
    )
    const = F("placement", 5, strategy="constant", leaf="table", params=[(2, "table")])
    scalar = F("placement", 5, strategy="scalar", leaves=["n"])
    assert_codemod(
        PlacementCommand,
        """\
        import jax

        def train(w, loader, tab):
            for b in loader:
                w = my_step(w, b, tab)
            return w
        """,
        """\
        import jax
        import autoopt

        def train(w, loader, tab):
            tab = jax.device_put(tab)
            for b in autoopt.prefetch(loader):
                w = my_step(w, b, tab)
            return w
        """,
        [pack, const, scalar],
        function="step",
    )
    assert not PlacementCommand.wants(scalar)


def test_placement_must_not_change_an_argument_the_loop_rebinds():
    cmd = assert_unchanged(
        PlacementCommand,
        """\
        def train(w, xs):
            for x in xs:
                w = step(w, x)
            return w
        """,
        [F("placement", 3, arg=0)],
        function="step",
    )
    assert "neither comes from the loop variable" in cmd.outcomes[0]


# --- the whole plan, and the bundled examples --------------------------------------------------


def test_plan_for_a_notebook_cell_says_there_is_no_file():
    ns: dict = {}
    exec(compile("def f(x):\n    return x + 1\n", "<ipython-input-3-abc>", "exec"), ns)
    report = autoopt.explain(ns["f"], jnp.zeros(4))
    [f] = [f for f in report.findings if f.kind == "donate" and f.details.get("aliasable")]
    assert "notebook cell" in f.message and report.source_diff == ""


def test_plan_for_a_library_function_says_it_is_a_library(tmp_path):
    lib = tmp_path / "site-packages"
    lib.mkdir()
    (lib / "somelib_autoopt_test.py").write_text(
        "import jax\n\n@jax.jit\ndef g(x):\n    return x * 2\n"
    )
    sys.path.insert(0, str(lib))
    try:
        import somelib_autoopt_test as somelib

        report = autoopt.explain(somelib.g, jnp.zeros(1024))  # (a row under 1 KiB: verbose only)
    finally:
        sys.path.remove(str(lib))
    [f] = [f for f in report.findings if f.kind == "donate" and f.details.get("aliasable")]
    # said once under the table, not in every finding's message (issue 28)
    assert "library" in f.details["source_edit"] and report.source_diff == ""
    assert report.render(color=False).count("library code") == 1


def _example_findings(mod, fn):
    """Real findings, plus a scatter_to_dus finding on each `.at[` line (the pass's own findings
    are tested with the pass; here the codemod must handle them in a real file)."""
    report = autoopt.explain(fn, *mod.make_args())
    findings = list(report.findings)
    with open(mod.__file__) as fh:
        for n, line in enumerate(fh, 1):
            if ".at[" in line and not any(f.kind == "scatter_to_dus" for f in findings):
                findings.append(
                    Finding("scatter_to_dus", True, "row set", location=f"{mod.__file__}:{n}")
                )
    return findings


@pytest.mark.parametrize(
    "name, provable", [("row_updates", True), ("train_step", False), ("host_feed", True)]
)
def test_rewritten_example_imports_runs_and_gives_the_same_numbers(name, provable, tmp_path):
    from autoopt.examples import EXAMPLES

    # A copy in a folder of its own: in the installed package, other modules (the demo, these
    # tests) import the example, and donate_argnums is never promised for a function that
    # another module imports (its callers there are not in the file).
    shipped = importlib.import_module(f"autoopt.examples.{name}")
    (tmp_path / "setup.cfg").write_text("")  # the project: only this test's files are searched
    (tmp_path / "src").mkdir()
    with open(shipped.__file__) as fh:
        mod = _load(fh.read(), name, tmp_path / "src")
    fn = getattr(mod, EXAMPLES[name])
    findings = _example_findings(mod, fn)
    # jax style: donate_argnums only where the file shows the loop owns a fresh array; the
    # train_step example binds its parameters from make_args(), which it cannot show, so the
    # note says what to use instead.
    call = CheckCall(mod.make_args())
    jax_plan = plan_source_edits(fn, findings, call=call)
    promised = any("donate_argnums=(0,)" in e.new for e in jax_plan.edits)
    assert promised == provable
    if not provable:
        assert any("--style autoopt" in n for n in jax_plan.notes.values()), jax_plan.notes
    plan = plan_source_edits(fn, findings, style="autoopt", call=call)
    [edit] = plan.edits
    assert "autoopt.optimize" in edit.new
    copy = tmp_path / f"{name}_rewritten.py"
    copy.write_text(edit.new)
    spec = importlib.util.spec_from_file_location(f"{name}_rewritten", copy)
    new = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(new)
    new_fn = getattr(new, EXAMPLES[name])
    steps = 3
    for a, b in zip(
        jax.tree_util.tree_leaves(mod.run(fn, steps)),
        jax.tree_util.tree_leaves(new.run(new_fn, steps)),
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6)
    # Rewriting the rewritten file changes nothing.
    again = plan_source_edits(new_fn, _example_findings(new, new_fn), call=call)
    assert again.edits == ()


def test_host_fed_example_gets_prefetch_at_its_loop():
    from autoopt.examples import host_feed

    # placement="pack": the default leaves these host leaves to jit, so it places nothing.
    fast = autoopt.optimize(host_feed.sgd_step, placement="pack")
    host_feed.run(fast, 2)  # the call site is where the placement finding points
    report = fast.explain(*host_feed.make_args())
    placed = [f for f in report.findings if f.kind == "placement" and f.applied]
    assert placed
    assert "+    for batch in autoopt.prefetch(batches(steps)):" in report.source_diff
    assert all(f.details.get("source_edit") == "in the source diff" for f in placed)
