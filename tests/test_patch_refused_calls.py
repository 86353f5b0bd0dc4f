"""The run summary (``autoopt run`` / ``autoopt.patch()``) counts what the passes applied per
compiled executable: an argument the executable donates counts once, whatever the calls did.
It said "applied donate x1" with no word of a call site whose every call was refused at run time
(another reference held the argument) unless 8 were refused in a row; it now says that it counts
executables, and lists every site's refused calls under "not applied", from the run-time
checks' record (the calls that repeat are not counted one by one: that would cost every
call)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import autoopt
from autoopt.patch import format_summary, summary


def _step_kept(x, y):
    return x * 2 + y


def _rows(data) -> list:
    return [
        r
        for r in data["functions"]
        if r["name"] == "_step_kept" and __file__ in (r["location"] or "")
    ]


def test_the_summary_lists_a_site_whose_every_call_was_refused_and_says_it_counts_executables():
    with autoopt.patch():
        step = jax.jit(_step_kept)
        x, y = jnp.ones(1000) + 0, jnp.ones(1000) + 0
        held = []
        for _ in range(3):
            keep = x
            held.append(keep)
            x = step(x, y)
        data = summary()
    assert not any(h.is_deleted() for h in held)  # the premise: no call donated `x`
    (row,) = _rows(data)
    assert row["applied"] == {"donate": 1}  # the executable donates `x` (per executable)
    (line,) = [n for n in row["not_applied"] if n["kind"] == "donate" and "run time" in n["reason"]]
    assert line["what"] == "argument 0"
    assert line["reason"].endswith(
        ": refused at run time on every call so far (3 calls): another reference to the same "
        "object exists; each passed a device copy of it"
    )
    text = format_summary(data)
    assert "(per compiled executable, not per call)" in text  # (every patched function's)
    assert "not applied: donate argument 0: " in text
