"""The ``autoopt`` command, run as a subprocess: explain, rewrite (--write), demo, bad input."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from autoopt.cli import CliError, write_in_place

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
ROW_UPDATES = os.path.join(EXAMPLES, "row_updates.py")
SCRIPT = os.path.join(os.path.dirname(sys.executable), "autoopt")


def autoopt(*args, cwd=None, module=False):
    cmd = (
        [sys.executable, "-m", "autoopt", *args]
        if module or not os.path.exists(SCRIPT)
        else [SCRIPT, *args]
    )
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "NO_COLOR")}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def row_copy(tmp_path):
    # A project of its own (a marker file): the donate edit searches the project for other
    # files that call the function, and the other tests' folders are not this one's callers.
    (tmp_path / "setup.cfg").write_text("")
    path = tmp_path / "row_updates.py"
    shutil.copy(ROW_UPDATES, path)
    return path


def test_explain_prints_the_report_without_colour_when_piped():
    out = autoopt("explain", f"{ROW_UPDATES}:write_row", "--args", f"{ROW_UPDATES}:make_args")
    assert out.returncode == 0, out.stderr
    assert "autoopt report for write_row" in out.stdout
    assert "compiled memory" in out.stdout and "suggested source edits" in out.stdout
    assert "row_updates.py:" in out.stdout and "\x1b[" not in out.stdout


def test_rewrite_prints_the_diff_and_leaves_the_file_alone_also_as_python_m(row_copy):
    before = row_copy.read_text()
    out = autoopt("rewrite", f"{row_copy}:write_row", "--args", "make_args", module=True)
    assert out.returncode == 0, out.stderr
    assert "+@partial(jax.jit, donate_argnums=(0,))" in out.stdout
    assert out.stdout.startswith("--- a/")
    assert row_copy.read_text() == before


def test_rewrite_write_applies_the_edits_and_the_file_still_gives_the_same_numbers(row_copy):
    out = autoopt("rewrite", f"{row_copy}:write_row", "--args", "make_args", "--write")
    assert out.returncode == 0, out.stderr
    assert "rewrote" in out.stdout
    assert sorted(os.listdir(row_copy.parent)) == ["row_updates.py", "setup.cfg"]  # no temp file
    text = row_copy.read_text()
    assert "donate_argnums=(0,)" in text and ".at[i].set" not in text
    original, rewritten = load(ROW_UPDATES, "row_original"), load(row_copy, "row_rewritten")
    np.testing.assert_array_equal(
        np.asarray(original.run(original.write_row, 5)),
        np.asarray(rewritten.run(rewritten.write_row, 5)),
    )
    again = autoopt("rewrite", f"{row_copy}:write_row", "--args", "make_args", "--write")
    assert again.returncode == 0, again.stderr
    assert "no source edits" in again.stdout and row_copy.read_text() == text


def test_rewrite_write_refuses_when_the_file_changed_since_it_was_read(tmp_path):
    path = tmp_path / "moving.py"
    path.write_text(
        textwrap.dedent("""\
        import jax
        import jax.numpy as jnp


        @jax.jit
        def step(x):
            return x * 2.0


        def loop():
            x = jnp.ones(4)
            for _ in range(3):
                x = step(x)
            return x


        def make_args():
            # Someone edits the file while autoopt analyses it.
            with open(__file__, "a") as fh:
                fh.write("# edited\\n")
            return (jnp.ones(4),)
    """)
    )
    out = autoopt("rewrite", f"{path}:step", "--args", "make_args", "--write")
    assert out.returncode == 1
    assert "changed" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert "donate_argnums" not in path.read_text()


def test_write_in_place_refuses_a_changed_file_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "f.py"
    path.write_text("x = 1\n")
    with pytest.raises(CliError, match="changed since"):
        write_in_place(str(path), "x = 2\n", expected="x = 0\n")
    assert path.read_text() == "x = 1\n"
    write_in_place(str(path), "x = 2\n", expected="x = 1\n")
    assert path.read_text() == "x = 2\n" and os.listdir(tmp_path) == ["f.py"]


BAD = textwrap.dedent("""\
    import jax.numpy as jnp

    def f(x):
        return x.reshape(7)

    def make_args():
        return (jnp.zeros(3),)

    def boom():
        raise ValueError("no data here")

    def not_a_tuple():
        return 3
""")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["explain", "{dir}/missing.py:f", "--args", "make_args"], "no such file"),
        (["explain", "{dir}/bad.py:nope", "--args", "make_args"], "has no function 'nope'"),
        (["explain", "{dir}/syntax.py:f", "--args", "make_args"], "syntax.py:2: syntax error"),
        (["explain", "{dir}/bad.py:f", "--args", "boom"], "boom() raised ValueError: no data here"),
        (["explain", "{dir}/bad.py:f", "--args", "make_args"], "tracing f failed"),
        (["rewrite", "{dir}/bad.py:f"], "--args {dir}/bad.py:make_args"),
        (["rewrite", "{dir}/bad.py:f", "--args", "not_a_tuple"], "return a tuple"),
    ],
)
def test_bad_input_gets_one_line_and_a_nonzero_exit(argv, message, tmp_path):
    (tmp_path / "bad.py").write_text(BAD)
    (tmp_path / "syntax.py").write_text("import jax\ndef f(:\n    pass\n")
    out = autoopt(*[a.format(dir=tmp_path) for a in argv])
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autoopt: error: "), out.stderr
    assert message.format(dir=tmp_path) in lines[0]


def test_usage_errors_exit_with_two():
    out = autoopt("explain")
    assert out.returncode == 2 and "FILE.py:FUNCTION" in out.stderr


def test_demo_prints_reports_and_measured_times_with_the_same_numbers():
    out = autoopt("demo", "--repeats", "1", "--scale", "0.25")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for name, fn, exact in (
        ("row_updates", "write_row", True),
        ("train_step", "train_step", True),
        ("transformer", "train_step", False),
        ("host_feed", "sgd_step", True),
    ):
        assert f"autoopt report for {fn}" in out.stdout
        i = next(i for i, line in enumerate(lines) if line.startswith(name + " "))
        row, why = lines[i], lines[i + 1]
        assert ("yes (bit-exact)" in row) if exact else ("yes (rel " in row), row
        # jit's time (in s past a second: the transformer's step on a loaded machine), two ratios
        assert row.count(" ms") + row.count(" s ") == 1 and row.count("x ") >= 2, row
        # peak MiB: jax.jit / autoopt / expert, all measured
        assert re.search(r"\d+\.\d / \d+\.\d / \d+\.\d", row), row
        # every row says what was applied, and where autoopt does not win, why
        assert why.startswith("  ") and ("faster than jax.jit" in why or "no " in why), why
        if name == "transformer":
            assert "remat plan" in why, why
    assert "interleaved" in out.stdout and jax.default_backend() in out.stdout
    # no broken promise (issue 28, item 6): no edit that failed its check, no traceback
    assert "No source edit" not in out.stdout and "raised" not in out.stdout, out.stdout
    assert "Traceback" not in out.stdout + out.stderr


def test_explain_summarizes_a_long_program_diff_and_diff_prints_it(tmp_path):
    (tmp_path / "rows.py").write_text(
        textwrap.dedent(
            """\
            import jax.numpy as jnp

            def write(buf, i, row):
                for k in range(6):
                    buf = buf.at[i + k].set(row * k)
                return buf

            def make_args():
                return jnp.zeros((64, 8)), 3, jnp.ones(8)
            """
        )
    )
    short = autoopt("explain", f"{tmp_path}/rows.py:write", "--args", "make_args")
    full = autoopt("explain", f"{tmp_path}/rows.py:write", "--args", "make_args", "--diff")
    assert short.returncode == 0 and full.returncode == 0, short.stderr + full.stderr
    assert "equations changed" in short.stdout and "rows.py:5: -" in short.stdout
    assert "dynamic_update_slice" not in short.stdout.split("program diff")[1]
    assert "program diff (equations" in full.stdout and "scatter" in full.stdout
    assert len(full.stdout.splitlines()) > len(short.stdout.splitlines()) + 20
