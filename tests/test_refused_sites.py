"""A rebinding call site whose run-time check keeps refusing an argument (held elsewhere too:
the carry tuple a helper unpacked, a list each step appends to) runs, after a few refused calls
in a row, an executable that does not donate it (``_dispatch.REFUSALS_BEFORE_NARROWING``),
instead of passing a device copy of it on every call to the executable the first call's proof
chose. Found by a new user's try: a helper-unpacked carry ran 2.5x jax.jit's step.

The properties: the numbers are jax.jit's, nothing the caller holds is deleted, what can still
be donated is, and a site refused now and then (a checkpoint kept every few steps) keeps its
executable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoopt
from autoopt._jit import _dispatch
from benchmarks._harness import Compiles

pytestmark = pytest.mark.filterwarnings("error:Some donated buffers")

ROWS = 64


def _step(x, buf, i):
    x = x + 1.0
    return x, buf.at[i].set(x)


def _advance(f, carry, i):
    x, buf = carry  # the caller's tuple still holds both: nothing here can be donated
    x, buf = f(x, buf, i)
    return x, buf


def _loop(f, pattern: str, n: int = 40, every: int = 8):
    """``n`` steps of ``pattern``; returns the final values, whether ``buf`` was updated in
    place at each step (its buffer kept), and everything kept along the way."""
    x, buf = jnp.zeros(8) + 0, jnp.zeros((ROWS, 8)) + 0
    kept: list = []
    in_place = []
    for i in range(n):
        if pattern == "xs kept":
            kept.append(x)
        elif pattern == "checkpoint" and i % every == 3:
            kept.append(buf)
        elif pattern == "warm-up" and i < 12:
            kept.append(buf)
        before = buf.unsafe_buffer_pointer()
        if pattern == "helper":
            x, buf = _advance(f, (x, buf), i % ROWS)
        else:
            x, buf = f(x, buf, i % ROWS)
        in_place.append(buf.unsafe_buffer_pointer() == before)
    return (x, buf), in_place, kept


@pytest.mark.parametrize("pattern", ["helper", "xs kept", "checkpoint", "warm-up"])
def test_a_site_refused_again_and_again_gives_jax_jits_numbers_and_loses_nothing(pattern):
    (x, buf), _, kept = _loop(jax.jit(_step), pattern)
    (x2, buf2), _, kept2 = _loop(autoopt.optimize(_step), pattern)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(x2))
    np.testing.assert_array_equal(np.asarray(buf), np.asarray(buf2))
    assert len(kept) == len(kept2)
    for a, b in zip(kept, kept2):
        assert not b.is_deleted()
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _in_a_fresh_process(pattern: str) -> dict:
    """Compiles of a loop of ``pattern`` run twice in a fresh interpreter (where no copy was
    compiled before), and whether ``buf`` was updated in place at each step after the first."""
    code = f"""
import json
import autoopt
from autoopt._jit import _dispatch
from benchmarks._harness import Compiles
from tests.test_refused_sites import _loop, _step

_dispatch._NARROW_AFTER_COMPILES = 0  # (narrowed after 8 refusals, however long they took)
f = autoopt.optimize(_step)
with Compiles("_copy_all") as copies, Compiles("_step") as steps:
    _, in_place, _ = _loop(f, {pattern!r})
with Compiles() as again:
    _loop(f, {pattern!r})
print(json.dumps(dict(copies=copies.own, steps=steps.own, again=again.total,
                      in_place=all(in_place[1:]))))
"""
    root = Path(__file__).parents[1]
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_site_refused_in_a_row_stops_copying_and_still_donates_what_it_can():
    """``kept.append(x)`` each step: ``x`` is refused on every call, ``buf`` is donated; after
    the first few calls no copy is made (none compiled: a copy is compiled after 16 device_put
    copies) and ``buf`` is still updated in place."""
    got = _in_a_fresh_process("xs kept")
    assert got == dict(copies=0, steps=2, again=0, in_place=True), got


def test_a_helper_unpacked_carry_runs_one_more_executable_and_no_copies():
    got = _in_a_fresh_process("helper")
    assert got == dict(copies=0, steps=2, again=0, in_place=False), got


@pytest.mark.parametrize("every", [2, 3, 5, 8])
def test_a_site_refused_now_and_then_keeps_donating_in_between(every):
    """A checkpoint kept every few steps: the step after each is refused (one copy), the others
    donate; refusals that are not in a row never narrow the site (a review found every 3 and
    every 5 narrowing it, counted by object ids that the allocator reuses)."""
    f = autoopt.optimize(_step)
    for _ in range(2):  # (a second loop at the same site: its count starts again)
        _, in_place, _ = _loop(f, "checkpoint", n=96, every=every)
        refused = [i for i, same in enumerate(in_place) if not same]
        assert refused == [i for i in range(96) if i % every == 3], refused


def test_a_narrowed_site_donates_again_once_its_calls_can(monkeypatch):
    """A warm-up that keeps its first 12 states narrows the site; one call in 64 checks again,
    and the loop's later steps update ``buf`` in place again (a review: stuck for good)."""
    monkeypatch.setattr(_dispatch, "_NARROW_AFTER_COMPILES", 0)
    _, in_place, _ = _loop(autoopt.optimize(_step), "warm-up", n=200)
    assert not any(in_place[1:12]) and all(in_place[100:]), in_place


def _rows_of_step(data) -> list:
    """The summary's rows of this file's ``_step`` (the summary holds every patched function
    of the process)."""
    return [
        r
        for r in data["functions"]
        if r["name"].endswith("_step") and __file__ in (r["location"] or "")
    ]


def test_the_run_summary_says_a_site_runs_an_executable_that_does_not_donate():
    from autoopt.patch import format_summary, summary

    with autoopt.patch():
        step = jax.jit(_step)
        _loop(step, "helper", n=10)
        data = summary()
        (row,) = _rows_of_step(data)
        reasons = [n["reason"] for n in row["not_applied"] if n["kind"] == "donate"]
        assert any("on 10 calls in a row" in r and "passes a device copy" in r for r in reasons)
        _dispatch._NARROW_AFTER_COMPILES, outer = 0, _dispatch._NARROW_AFTER_COMPILES
        try:
            _loop(step, "helper", n=1)
        finally:
            _dispatch._NARROW_AFTER_COMPILES = outer
        data = summary()
    (row,) = _rows_of_step(data)
    reasons = [n["reason"] for n in row["not_applied"] if n["kind"] == "donate"]
    assert any("on 11 calls in a row" in r and "does not donate it" in r for r in reasons)
    assert "not applied: donate argument 0, 1" in format_summary(data)


def test_a_site_narrows_only_once_its_refusals_took_ten_compiles():
    """A convergence loop keeping its previous value (``prev = x``) refuses ``x`` on every call,
    but copying it costs microseconds where a second executable costs a compile: the site
    narrows only once its refused calls in a row have taken ten times the signature's compile
    (a review: a 1.5 s step compiled twice in an 8-step loop)."""

    def step(x, y):
        return x * 0.5 + y, y

    f = autoopt.optimize(step)
    x, y = jnp.ones(4) + 0, jnp.ones(4) + 0
    with Compiles("step") as compiles:
        for _ in range(40):
            prev = x
            x, y = f(x, y)
        del prev
    assert compiles.own == 1


_SOURCELESS_LOOP = compile(
    "for i in range(n):\n    x = f(x)\n    seen.append(x)\n", "<no source>", "exec"
)


def _twice(x):
    return x * 2.0


@pytest.mark.parametrize("why", ["no source", "used again"])
def test_a_site_that_donates_nothing_stops_copying_for_an_executable_that_donates(monkeypatch, why):
    """The signature's executable donates (its first call was at a site that rebinds), and
    another site can donate nothing: its source cannot be read (``exec``'d code), or it passes
    a name used again. Each of its calls passed a device copy and took the general path
    (6x jax.jit's call on a tiny step); now it runs the plain executable once its calls have
    copied as long as a refused site's (one more compile, then none and no copies)."""
    monkeypatch.setattr(_dispatch, "_NARROW_AFTER_COMPILES", 0)
    f = autoopt.optimize(_twice)
    x = f(jnp.ones(8) + 0)
    before = x.unsafe_buffer_pointer()
    x = f(x)
    assert x.unsafe_buffer_pointer() == before  # the signature's executable donates x
    start = jnp.ones(8) + 0
    with Compiles("_twice") as steps, Compiles("_copy_all") as copies:
        if why == "no source":
            seen: list = []
            exec(_SOURCELESS_LOOP, {"f": f, "x": start, "n": 40, "seen": seen})
        else:
            y, seen = start, []
            for _ in range(40):
                z = f(y)
                seen.append(z)
                y = z + 0 * y[0]  # ``y`` read again after the call: not donated
    assert steps.own == 1 and copies.own == 0, (steps.own, copies.own)
    assert not start.is_deleted() and all(not s.is_deleted() for s in seen)
    want = np.ones(8, np.float32)
    for s in seen:
        want = want * 2.0
        np.testing.assert_array_equal(np.asarray(s), want)
