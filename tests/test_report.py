"""The report: a row per finding with the user's line, memory before/after, the program and
source diffs, colour only in a terminal, and ``explain=True`` logging once per signature."""

from __future__ import annotations

import inspect
import logging
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

import autoopt
from autoopt.report import KINDS, Finding, Report

HERE = os.path.abspath(__file__)
ANSI = "\x1b["


def def_line(fn) -> int:
    return inspect.getsourcelines(fn)[1]


def step(state, i, row):
    state = state.at[i].set(row)
    return state * 2.0


def test_findings_of_each_kind_render_with_their_lines_and_savings():
    findings = [
        Finding(
            kind,
            applied=(k % 2 == 0),
            message=f"{kind} message",
            location=f"{HERE}:{10 + k}",
            bytes_saved=(k + 1) * 2**20,
            transfers_avoided=k or None,
        )
        for k, kind in enumerate(KINDS)
    ]
    # (verbose: a transfer finding not applied that avoids nothing is hidden by default)
    text = Report(findings=findings, function="step").render(color=False, verbose=True)
    rows = {
        line.split()[0]: line
        for line in text.splitlines()
        if line.split()[:1] and line.split()[0] in KINDS
    }
    assert set(rows) == set(KINDS)
    # Applied findings first.
    order = [k for k in range(len(KINDS)) if k % 2 == 0] + [k for k in range(len(KINDS)) if k % 2]
    assert [r.split()[0] for r in rows.values()] == [KINDS[k] for k in order]
    for k, kind in enumerate(KINDS):
        row = rows[kind]
        cells = row.split()
        assert cells[1] == f"test_report.py:{10 + k}"
        assert cells[2] == ("yes" if k % 2 == 0 else "no")
        # a finding not applied saved nothing: no bytes in its row (issue 28)
        assert (f"{k + 1}.0 MiB" in row) == (k % 2 == 0), row
        assert f"{KINDS[k]} message" in row
    applied = len([k for k in range(len(KINDS)) if k % 2 == 0])
    assert f"{len(KINDS)} findings, {applied} applied" in text
    assert "transfers avoided per call" in text  # (from the applied findings that avoid some)
    # without a memory table, the headline says its bytes are a sum over findings
    assert "saved (sum over findings and call sites)" in text


def test_real_donation_finding_points_at_the_users_def_line():
    report = autoopt.explain(step, jnp.zeros((8, 4)), 3, jnp.ones(4))
    [state] = [f for f in report.findings if f.kind == "donate" and f.details.get("arg") == 0]
    assert state.location == f"{HERE}:{def_line(step)}"
    assert f"test_report.py:{def_line(step)}" in report.render(color=False)


def test_scatter_finding_points_at_the_at_set_line_and_the_diff_at_its_equation():
    report = autoopt.explain(step, jnp.zeros((8, 4)), 3, jnp.ones(4))
    line = def_line(step) + 1
    scatter = [f for f in report.findings if f.kind == "scatter_to_dus"]
    assert scatter and all(f.location == f"{HERE}:{line}" for f in scatter)
    changed = [s for s in report.diff.splitlines() if s.lstrip().startswith(("- ", "+ "))]
    assert changed and all(s.endswith(f"# {HERE}:{line}") for s in changed)
    assert "dynamic_update" in report.source_diff


def test_memory_before_and_after_come_from_the_compiled_program():
    report = autoopt.explain(step, jnp.zeros((256, 64)), 3, jnp.ones(64), donate="auto")
    before, after = report.memory["before"], report.memory["after"]
    assert before["argument_bytes"] == after["argument_bytes"] >= 256 * 64 * 4
    assert after["alias_bytes"] == 256 * 64 * 4 and before["alias_bytes"] == 0
    assert after["peak_bytes"] <= before["peak_bytes"] - 256 * 64 * 4 + 1024
    text = report.render(color=False)
    assert "compiled memory" in text
    change = next(line for line in text.splitlines() if line.startswith("change"))
    assert "+64.0 KiB" in change  # the alias column


def test_explain_runs_the_users_python_once_and_keeps_static_arguments():
    calls = []

    def f(x, scale, *, shift):
        calls.append(1)  # a Python side effect: runs at trace time only
        return x * scale + shift

    fast = autoopt.optimize(f, static_argnums=1, static_argnames="shift")
    report = fast.explain(jnp.ones((64, 64)), 3.0, shift=1.0)
    assert len(calls) == 1
    assert report.memory["before"]["output_bytes"] == 64 * 64 * 4
    # The report traced through a function of its own: the first call traces, as jax.jit's
    # first call does (a report must not decide what a call computes: test_review_consts_keys).
    fast(jnp.ones((64, 64)), 3.0, shift=1.0)
    assert len(calls) == 2
    fast(jnp.ones((64, 64)), 3.0, shift=1.0)  # the same signature: no new trace
    fast.explain(jnp.ones((64, 64)), 3.0, shift=1.0)  # a report of the call's own program
    assert len(calls) == 2


def test_report_without_arguments_has_no_memory_section():
    assert "compiled memory" not in Report(findings=[]).render(color=False)


def test_terminal_output_is_coloured_and_plain_output_is_not():
    report = autoopt.explain(step, jnp.zeros((8, 4)), 3, jnp.ones(4))
    assert ANSI in report.render(color=True)
    plain = report.render(color=False)
    assert ANSI not in plain
    assert all(line == line.rstrip() for line in plain.splitlines())


def test_piped_output_has_no_colour_codes():
    code = textwrap.dedent("""
        import jax.numpy as jnp, autoopt
        def step(s, i, r):
            return s.at[i].set(r) * 2.0
        print(autoopt.explain(step, jnp.zeros((8, 4)), 3, jnp.ones(4)))
    """)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "FORCE_COLOR": "1"},
    )
    assert out.returncode == 0, out.stderr
    assert "autoopt report for step" in out.stdout and ANSI not in out.stdout


def test_explain_option_logs_the_report_once_per_signature(caplog):
    caplog.set_level(logging.INFO, logger="autoopt")

    def scale(x):
        return x * 3.0

    fast = autoopt.optimize(scale, explain=True)
    fast(jnp.ones(4))
    fast(jnp.ones(4))
    fast(jnp.zeros(4))
    reports = [r for r in caplog.records if "autoopt report for" in r.getMessage()]
    assert len(reports) == 1
    fast(jnp.ones((2, 3)))
    jax.jit(fast)(jnp.ones(5))  # under an outer jit: a new signature, one more report
    reports = [r for r in caplog.records if "autoopt report for" in r.getMessage()]
    assert len(reports) == 3
    assert all(ANSI not in r.getMessage() for r in reports)
    assert all(r.levelno == logging.INFO and r.name == "autoopt" for r in reports)


def test_explain_option_shows_the_report_without_any_logging_setup():
    code = textwrap.dedent("""
        import jax.numpy as jnp, autoopt
        f = autoopt.optimize(lambda x: x + 1, explain=True)
        f(jnp.ones(3)); f(jnp.ones(3))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("autoopt report for") == 1


def test_plot_memory_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    report = autoopt.explain(step, jnp.zeros((8, 4)), 3, jnp.ones(4))
    path = report.plot_memory(str(tmp_path / "memory.png"))
    with open(path, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_finding_without_source_says_why_in_its_row():
    fn = jax.jit(lambda x: x + 1.0)
    report = autoopt.explain(fn, jnp.zeros(4))
    [f] = [f for f in report.findings if f.details.get("aliasable")]
    assert "No source edit" in f.message and "lambda" in f.message
    assert "lambda" in report.render(color=False)


def test_a_report_keeps_no_reference_to_its_arguments_so_the_next_call_donates_them():
    """explain() checks its source edits on the call's arguments; a report that kept them would
    be a second holder, and ``state = fast(state)`` right after it could not donate."""

    def update(state, g):
        return state - 0.1 * g

    fast = autoopt.optimize(update, fallback="raise")
    state, g = jnp.ones(64), jnp.ones(64)
    report = fast.explain(state, g)
    before = state.unsafe_buffer_pointer()
    state = fast(state, g)
    assert state.unsafe_buffer_pointer() == before, "the first call after explain() did not donate"
    assert report.findings  # the report is still alive


def _rows(text: str, kind: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(kind + " ")]


def test_a_donated_argument_has_one_row_saying_what_happened_at_its_call_site():
    # issue 16: a "yes" row at the call site next to a "no, can be donated" row for the same
    # argument contradicted each other; and rows for arguments nothing can reuse are noise
    def update(params, x):
        return jax.tree_util.tree_map(lambda p: p * 0.5 + x.sum(), params), x.mean()

    fast = autoopt.optimize(update)
    params, x = {"w": jnp.ones((64, 64)), "b": jnp.ones(64)}, jnp.ones((8, 3))
    for _ in range(2):
        params, _ = fast(params, x)
    report = fast.explain(params, x)
    text = report.render(color=False)
    donate = _rows(text, "donate")
    assert len(donate) == 1 and " yes " in donate[0] and "donated at this call site" in donate[0]
    assert "16.2 KiB" in donate[0]  # the bytes the donated buffers hold
    assert "can be donated" not in text and "`x` cannot be donated" not in text
    assert "not shown: render(verbose=True) shows them" in text
    full = report.render(color=False, verbose=True)
    assert "can be donated" in full and "`x` cannot be donated" in full
    assert not _rows(text, "transfer") and _rows(full, "transfer")  # a scan that found nothing


def test_under_donate_auto_the_donated_argument_is_an_applied_row():
    fast = autoopt.optimize(lambda s: s * 2.0, donate="auto")
    s = fast(jnp.ones(16))
    text = fast.explain(s).render(color=False)
    [row] = _rows(text, "donate")
    assert " yes " in row and "donated at every call" in row and "(donate='auto')" in text


def test_repeated_findings_are_one_row_with_a_count():
    # one in-place rewrite a layer, the same message each time: one row, with where the others
    # are
    def fill(bufs, i, v):
        return [b.at[i].set(v) for b in bufs]

    fast = autoopt.optimize(fill, donate="off")
    bufs = [jnp.zeros((32, 4)) for _ in range(5)]
    report = fast.explain(bufs, 3, jnp.ones(4))
    rows = _rows(report.render(color=False), "scatter_to_dus")
    assert len([f for f in report.findings if f.kind == "scatter_to_dus"]) == 5
    assert len(rows) == 1 and "(x5)" in rows[0], rows
    [(finding, locations)] = [r for r in report.shown() if r[0].kind == "scatter_to_dus"]
    assert len(locations) == 5


def tile_step(x, i, j, t):
    return x.at[i + jnp.arange(32)[:, None], j + jnp.arange(256)].add(t)


def test_a_blended_tile_shows_in_the_program_diff_and_the_source_diff_at_its_line():
    """Issue 18: the blend (a window, a select, and the while_loop for jnp's negative-index
    wrap) replaces the scatter at the user's `.at[...]` line; the edit is `update_window`."""
    x, t = jnp.zeros((64, 512)), jnp.ones((32, 256))
    report = autoopt.explain(tile_step, x, 3, 5, t)
    line = def_line(tile_step) + 1
    (f,) = [f for f in report.findings if f.kind == "scatter_to_dus"]
    assert f.applied and f.details["guard"] == "blend" and f.location == f"{HERE}:{line}"
    changed = [s for s in report.diff.splitlines() if s.lstrip().startswith(("- ", "+ "))]
    assert any(s.lstrip().startswith("- ") and "scatter" in s for s in changed)
    added = [s for s in changed if s.lstrip().startswith("+ ")]
    assert any("dynamic_update_slice" in s for s in added) and any("while" in s for s in added)
    assert all(s.endswith(f"# {HERE}:{line}") for s in changed)
    assert 'update_window(x, (i, j), t, size=(32, 256), op="add")' in report.source_diff
