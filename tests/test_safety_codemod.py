"""Source edits are exact or not offered: `.at[...]` rewrites keep scatter's broadcast and dtype
rules, donate_argnums is added only where no second holder can exist, every edit is run before
it is offered, and `rewrite --write` edits the file a path resolves to, in place."""

from __future__ import annotations

import importlib.util
import os
import stat
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import libcst as cst
import numpy as np
import pytest
from libcst.codemod import CodemodContext, transform_module

import autoopt
from autoopt import passes
from autoopt.cli import CliError, write_in_place
from autoopt.codemod import CheckCall, FindingCommand, plan_source_edits, rewrite_code
from autoopt.passes import Pass, PassResult
from autoopt.passes.donation.codemod import DonateCommand
from autoopt.report import Finding

HERE = os.path.abspath(__file__)


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


def _quiet(fn, *args):
    # A float32 value into a bfloat16 array warns (FutureWarning) under .at[...]: the same
    # numbers are compared, the warning is not the subject here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return np.asarray(jax.jit(fn)(*args))


# --- 11: .at[...] -> dynamic_update_*: scatter's broadcast and dtype rules --------------------

X_DTYPES = [jnp.float32, jnp.bfloat16, jnp.int32]


def _values(dtype, window):
    """Update values of every kind scatter accepts: the window's shape, shape (1,), lower
    rank, a 0-d array, a weakly typed Python scalar, and another dtype."""
    other = jnp.float32 if dtype != jnp.float32 else jnp.bfloat16
    return {
        "same": jnp.arange(np.prod(window), dtype=dtype).reshape(window) + 1,
        "shape (1,)": jnp.array([7], dtype),
        "lower rank": jnp.array([5, -3], dtype),
        "0-d": jnp.array(4, dtype),
        "python float": 2.7,
        "python int": 3,
        "other dtype": (jnp.arange(np.prod(window), dtype=other).reshape(window) / 3).astype(other),
    }


@pytest.mark.parametrize("dtype", X_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize(
    "form, window, op",
    [("x.at[1:4]", (3, 2), "set")]  # a combine over a static slice is left as it is
    + [
        (form, window, op)
        for form, window in (("x.at[i]", (2,)), ("x.at[i + jnp.arange(3)]", (3, 2)))
        for op in ("set", "add", "multiply", "min")
    ],
)
def test_rewritten_update_broadcasts_and_casts_as_the_scatter_does(
    dtype, form, window, op, tmp_path
):
    code = f"import jax.numpy as jnp\n\n\ndef f(x, i, v):\n    return {form}.{op}(v)\n"
    finding = Finding("scatter_to_dus", True, "m", location="s.py:5", details={"guard": "none"})
    new = rewrite_code(code, [finding]).code
    assert "dynamic_update_" in new, new
    before, after = _load(code, "at_before", tmp_path), _load(new, "at_after", tmp_path)
    x = (jnp.arange(12).reshape(6, 2) - 4).astype(dtype)
    for kind, v in _values(dtype, window).items():
        expected = _quiet(before.f, x, 2, v)
        got = _quiet(after.f, x, 2, v)
        assert got.dtype == expected.dtype, kind
        np.testing.assert_array_equal(got, expected, err_msg=f"{kind}: {new}")


@pytest.mark.parametrize("op", ["set", "add"])
def test_a_list_value_is_made_an_array_as_the_scatter_does(op, tmp_path):
    code = f"def f(x, i):\n    return x.at[i].{op}([1, 2])\n"
    finding = Finding("scatter_to_dus", True, "m", location="s.py:2", details={"guard": "none"})
    before = _load(code, "list_before", tmp_path)
    after = _load(rewrite_code(code, [finding]).code, "list_after", tmp_path)
    x = jnp.ones((3, 2), jnp.bfloat16)
    np.testing.assert_array_equal(_quiet(after.f, x, 1), _quiet(before.f, x, 1))


def test_a_shape_1_value_over_a_slice_fills_the_whole_slice(tmp_path):
    code = "def f(x, v):\n    return x.at[1:4].set(v)\n"
    finding = Finding("scatter_to_dus", True, "m", location="s.py:2", details={"guard": "none"})
    mod = _load(rewrite_code(code, [finding]).code, "slice_after", tmp_path)
    np.testing.assert_array_equal(jax.jit(mod.f)(jnp.zeros(6), jnp.ones(1)), [0, 1, 1, 1, 0, 0])


# --- 12: donate_argnums only where the file shows no second holder ----------------------------


def donate(arg, line=1):
    return Finding(
        "donate",
        False,
        "can be donated",
        location=f"snippet.py:{line}",
        details={"arg": arg, "name": str(arg), "aliasable": True},
    )


def _donate_outcome(calls: str):
    before = (
        "import jax\nimport jax.numpy as jnp\n\n@jax.jit\ndef step(w, x):\n    return w\n\n"
        f"{calls}\n"
    )
    cmd = DonateCommand(CodemodContext(), [donate(0, 4)], function="step")
    result = transform_module(cmd, before)
    return getattr(result, "code", before), cmd.outcomes[0]


@pytest.mark.parametrize(
    "calls, why",
    [
        # Each of these returns the very array it is given: a second holder of the buffer.
        ("w = jnp.zeros(3)\nsnap = w[:]\nw = step(w, x)", "read on line 9 (`snap = w[:]`)"),
        ("w = jnp.zeros(3)\nsnap = w[...]\nw = step(w, x)", "read on line 9"),
        ("w = jnp.zeros((3, 1))\nt = w.T\nw = step(w, x)", "`w.T` on line 9"),
        ("w = jnp.zeros(3)\nc = w.astype(w.dtype)\nw = step(w, x)", "`w.astype` on line 9"),
        ("w = jnp.zeros(3)\nb = w.block_until_ready()\nw = step(w, x)", "`w.block_until_ready`"),
        ("w = jnp.reshape(w0, (3,))\nw = step(w, x)", "bound on line 8"),
        ("w = jnp.full((3,), w0)\nw = step(w, x)", "bound on line 8"),
        ("w = jnp.zeros(3)\ndef current():\n    return w\nw = step(w, x)", "nested function"),
        (  # the function reads the file's `w` and binds it (global): not its own variable
            "w = jnp.zeros(3)\ndef reset():\n    global w\n    w = jnp.ones(3)\nw = step(w, x)",
            "global",
        ),
        (  # binding the name in an inner function leaves the outer one reading the file's
            "w = jnp.zeros(3)\ndef outer():\n    def inner():\n        w = 1\n    return w\n"
            "w = step(w, x)",
            "nested function",
        ),
        # a second holder made after a loop of calls, with a later call after it
        (
            "w = jnp.zeros(3)\nfor x in xs:\n    w = step(w, x)\nsnap = w\nw = step(w, x)",
            "read on line 11 (`snap = w`)",
        ),
        # after the inner loop, but the outer loop comes back to the calls
        (
            "w = jnp.zeros(3)\nfor e in epochs:\n    for x in xs:\n        w = step(w, x)\n"
            "    hist.append(w)",
            "passed to another call on line 12",
        ),
        (
            "w = jnp.zeros(3)\nwhile go():\n    w = step(w, x)\n    if done():\n        print(w)",
            "passed to another call on line 12",
        ),
        ("w = jnp.zeros(3)\nw = v = step(w, x)", "does not rebind `w` (alone)"),
        ("w = jnp.zeros(3)\nw = step(w, w)", "passed to another call on line 9"),
        ("def g():\n    global w\n    w = jnp.zeros(3)\n    w = step(w, x)", "global"),
        # init functions whose result may be held elsewhere (issue 16: only provably fresh
        # ones count)
        (
            "W0 = jnp.zeros(3)\ndef init():\n    return {'w': W0}\nw = init()\nw = step(w, x)",
            "bound on line 11",
        ),
        (
            "import functools\n@functools.cache\ndef init():\n    return jnp.zeros(3)\n"
            "w = init()\nw = step(w, x)",
            "bound on line 12",
        ),
        (
            "def init():\n    s = {'w': jnp.zeros(3)}\n    KEEP.append(s)\n    return s\n"
            "w = init()\nw = step(w, x)",
            "bound on line 12",
        ),
        (
            "def init():\n    yield jnp.zeros(3)\nw = init()\nw = step(w, x)",
            "bound on line 10",
        ),
        (
            "def init():\n    return jnp.zeros(3)\ninit = other\nw = init()\nw = step(w, x)",
            "bound on line 11",
        ),
        (  # a parameter shadows the file's fresh init
            "def init():\n    return jnp.zeros(3)\ndef train(init, xs):\n    w = init()\n"
            "    for x in xs:\n        w = step(w, x)",
            "bound on line 11",
        ),
        (
            "def init():\n    return jnp.zeros(3)\nfor init in makers:\n    w = init()\n"
            "    w = step(w, x)",
            "bound on line 11",
        ),
        (
            "def init():\n    return jnp.zeros(3)\nfrom elsewhere import *\nw = init()\n"
            "w = step(w, x)",
            "bound on line 11",
        ),
        (
            "def helper():\n    return jnp.zeros(3)\ndef init(helper):\n    return helper()\n"
            "w = init(held)\nw = step(w, x)",
            "bound on line 12",
        ),
    ],
)
def test_donation_edit_is_refused_where_the_array_may_have_a_second_holder(calls, why):
    code, outcome = _donate_outcome(calls)
    assert "donate_argnums" not in code
    assert outcome is not None and why in outcome, outcome
    assert "--style autoopt" in outcome


@pytest.mark.parametrize(
    "calls",
    [
        "w = jnp.zeros(3)\nfor x in xs:\n    w = step(w, x)\nprint(w.shape)",
        "def train(xs):\n    w = jnp.full((3,), 0.5)\n    for x in xs:\n        w = step(w, x)\n"
        "    return w",
        "w = jax.random.normal(key, (3,))\nw = step(w, x)",
        # state built by an init function of the file, or as a display of fresh arrays
        "def init_state(key):\n    k1, k2 = jax.random.split(key)\n"
        "    return {'w': jax.random.normal(k1, (3,)), 'b': jnp.zeros(3), 'step': 0}\n"
        "w = init_state(key)\nfor x in xs:\n    w = step(w, x)",
        "def zeros_like_tree():\n    return [jnp.zeros(3), (jnp.ones(2), jnp.full((2,), 0.5))]\n"
        "def init():\n    return {'params': zeros_like_tree(), 'count': 0}\n"
        "w = init()\nw = step(w, x)",
        "w = {'a': jnp.zeros(3), 'b': [jnp.ones(2)]}\nw = step(w, x)",
        # another function's own `w` (assigned there) is another variable
        "def other(v):\n    w = v * 2\n    return w\nw = jnp.zeros(3)\nw = step(w, x)",
        "def other(vs):\n    for w in vs:\n        print(w)\nw = jnp.zeros(3)\nw = step(w, x)",
        # (a new user's loop, 2026-12-07) read or kept once no call can follow
        "w = jnp.zeros(3)\nfor x in xs:\n    w = step(w, x)\nprint(float(w[0]))",
        "w = jnp.zeros(3)\nfor x in xs:\n    w = step(w, x)\nfinal = w\nhist.append(w)",
        "def train(xs):\n    w = jnp.zeros(3)\n    for x in xs:\n        w = step(w, x)\n"
        "    for k in range(3):\n        print(w[k])\n    return w.T",
    ],
)
def test_donation_edit_is_offered_where_the_file_shows_a_fresh_array_and_no_other_use(calls):
    code, outcome = _donate_outcome(calls)
    assert outcome is None and "donate_argnums=(0,)" in code


def test_the_refused_patterns_really_keep_the_array():
    # Why the allow-list: each of these hands back the same array object.
    w = jnp.zeros(3)
    assert w[:] is w and w[...] is w and w.astype(w.dtype) is w
    assert w.block_until_ready() is w and jnp.full((3,), w) is w


# --- the check: every edit is run before it is offered ----------------------------------------


def doubled(x):
    return x * 2.0  # the toy codemods rewrite this line


DOUBLED_LINE = doubled.__code__.co_firstlineno + 1


def _toy(run_kind: str, replacement: str):
    """A pass that asks for an edit of ``doubled``'s line, and a command that makes it."""

    def run(closed, ctx):
        finding = Finding(run_kind, True, "toy edit", location=f"{HERE}:{DOUBLED_LINE}")
        return PassResult.unchanged(closed, (finding,))

    class ToyCommand(FindingCommand):
        DESCRIPTION = "Rewrite `x * 2.0` as the toy says (a test of the edit check)."
        KIND = run_kind
        HINT = "nothing"

        def leave_BinaryOperation(self, original_node, updated_node):
            hits = self.targets_within(original_node)
            for i in hits:
                self.outcomes[i] = None
            return cst.parse_expression(replacement) if hits else updated_node

    return Pass(name=run_kind, run=run, kinds=(run_kind,), codemod=ToyCommand)


@pytest.mark.parametrize(
    "replacement, offered",
    [("x + x", True), ("x * 3.0", False), ("x.astype(jnp.float16) * 2", False), ("y * 2", False)],
)
def test_an_edit_is_offered_only_when_the_rewritten_function_gives_the_same_numbers(
    replacement, offered
):
    with passes.register(_toy("toy_edit", replacement)):
        report = autoopt.explain(doubled, jnp.linspace(0.1, 1.0, 5))
    [toy] = report.by_kind("toy_edit")
    if offered:
        assert f"+    return {replacement}" in report.source_diff
        assert toy.details["source_edit"] == "in the source diff"
    else:
        assert report.source_diff == ""
        assert "checked and is not offered" in toy.details["source_edit"], toy.details
        assert "No source edit" in toy.message


def test_a_wrong_edit_is_dropped_and_the_right_ones_in_the_same_file_are_kept():
    with passes.register(_toy("toy_edit", "x * 3.0")):
        report = autoopt.explain(step_with_row, jnp.zeros((4, 2)), 1, jnp.ones(2))
    assert "dynamic_update_index_in_dim" in report.source_diff
    assert "x * 3.0" not in report.source_diff
    [toy] = report.by_kind("toy_edit")
    assert "not bit-identical" in toy.details["source_edit"]


def step_with_row(buf, i, row):
    buf = buf.at[i].set(row)
    return buf + doubled(row)


def test_edits_are_not_offered_without_arguments_to_check_them_on():
    findings = autoopt.explain(step_with_row, jnp.zeros((4, 2)), 1, jnp.ones(2)).findings
    plan = plan_source_edits(step_with_row, findings)
    assert plan.edits == () and any("report's arguments" in n for n in plan.notes.values())
    checked = plan_source_edits(
        step_with_row, findings, call=CheckCall((jnp.zeros((4, 2)), 1, jnp.ones(2)))
    )
    assert checked.edits


def test_checking_a_donation_edit_does_not_delete_the_reports_arguments(tmp_path):
    mod = _load(
        textwrap.dedent("""\
            import jax
            import jax.numpy as jnp


            @jax.jit
            def step(w, x):
                return w - 0.5 * x


            def train(xs):
                w = jnp.ones(4)
                for x in xs:
                    w = step(w, x)
                return w
            """),
        "donating",
        tmp_path,
    )
    w, x = jnp.ones(4), jnp.ones(4)
    report = autoopt.explain(mod.step, w, x)
    assert "donate_argnums=(0,)" in report.source_diff
    assert not w.is_deleted() and not x.is_deleted()


def test_checking_runs_the_files_definitions_not_its_top_level_code_again(tmp_path):
    script = textwrap.dedent("""\
        import jax
        import jax.numpy as jnp

        ROWS = 4


        @jax.jit
        def write_row(buf, i, row):
            return buf.at[i].set(row * ROWS)


        with open(__file__ + ".runs", "a") as fh:  # a script's top level: runs once
            fh.write("ran\\n")
        """)
    mod = _load(script, "top_level", tmp_path)
    report = autoopt.explain(mod.write_row, jnp.zeros((4, 2)), 1, jnp.ones(2))
    assert "dynamic_update_index_in_dim" in report.source_diff
    assert (tmp_path / "top_level.py.runs").read_text() == "ran\n"


# --- 13: --write edits the file a path resolves to, in place ----------------------------------


def test_write_goes_through_a_symlink_to_the_real_file(tmp_path):
    real = tmp_path / "real.py"
    real.write_text("x = 1\n")
    link = tmp_path / "link.py"
    link.symlink_to(real)
    write_in_place(str(link), "x = 2\n", expected="x = 1\n")
    assert link.is_symlink() and real.read_text() == "x = 2\n"


def test_write_keeps_the_inode_hard_links_and_permissions(tmp_path):
    path = tmp_path / "a.py"
    path.write_text("x = 1\n")
    os.chmod(path, 0o640)
    other = tmp_path / "b.py"
    os.link(path, other)
    inode = os.stat(path).st_ino
    write_in_place(str(path), "x = 22\n", expected="x = 1\n")
    assert os.stat(path).st_ino == inode and other.read_text() == "x = 22\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    assert sorted(os.listdir(tmp_path)) == ["a.py", "b.py"]


def test_write_refuses_a_read_only_file_saying_what_to_do(tmp_path):
    path = tmp_path / "ro.py"
    path.write_text("x = 1\n")
    os.chmod(path, 0o444)
    with pytest.raises(CliError, match="read-only.*chmod u\\+w"):
        write_in_place(str(path), "x = 2\n", expected="x = 1\n")
    assert path.read_text() == "x = 1\n" and stat.S_IMODE(os.stat(path).st_mode) == 0o444


ROW_FILE = textwrap.dedent("""\
    import jax
    import jax.numpy as jnp


    @jax.jit
    def write_row(buf, i, row):
        return buf.at[i].set(row)


    def make_args():
        return jnp.zeros((4, 2)), 1, jnp.ones(2)
""")


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "autoopt", *args], capture_output=True, text=True, timeout=300
    )


def test_cli_write_through_a_symlink_and_refusing_a_read_only_file(tmp_path):
    real = tmp_path / "rows.py"
    real.write_text(ROW_FILE)
    link = tmp_path / "rows_link.py"
    link.symlink_to(real)
    os.chmod(real, 0o444)
    refused = _cli("rewrite", f"{link}:write_row", "--args", "make_args", "--write")
    assert refused.returncode == 1
    [line] = [s for s in refused.stderr.splitlines() if not s.startswith("# not rewritten")]
    assert line.startswith("autoopt: error: ") and "read-only" in line and "chmod u+w" in line
    assert real.read_text() == ROW_FILE
    os.chmod(real, 0o644)
    out = _cli("rewrite", f"{link}:write_row", "--args", "make_args", "--write")
    assert out.returncode == 0, out.stderr
    assert link.is_symlink() and "dynamic_update_index_in_dim" in real.read_text()


def test_an_edit_claiming_a_peak_is_offered_only_when_its_compile_reproduces_it():
    # issue 16: remat edits reported savings their source form did not get; the check now
    # compiles the rewritten function and compares its peak with the plan's measured one
    from autoopt.codemod import EditChecker

    with open(HERE) as f:
        source = f.read()
    x = jnp.ones((256, 256))
    checker = EditChecker(doubled, CheckCall((x,)))
    # the function as it is: argument 256 KiB + output 256 KiB, nothing temporary
    assert checker.why_not(HERE, source, source, exact=True, claimed_peak=512 * 1024) is None
    assert checker.why_not(HERE, source, source, exact=True, claimed_peak=10 * 2**20) is None
    why = checker.why_not(HERE, source, source, exact=True, claimed_peak=100 * 1024)
    assert why is not None and "peak is 0.5 MiB, not the 0.1 MiB measured" in why, why
