"""A call site's donation row says what its calls' run-time checks did, not only what the site
proves: ``keep = x; x = step(x, y)`` rebinds ``x``, but another reference holds it at every
call, so no call donates it (each passes a device copy). The report read "applied yes ...
donated at this call site" there; it now reads the site's recorded refusals
(``fn.inspect(...).site_calls``), and says when the site was narrowed to an executable that
does not donate the argument."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import autoopt
from autoopt._jit import REFUSALS_BEFORE_NARROWING


def _site_rows(report, arg: int = 0) -> list:
    return [
        f
        for f in report.findings
        if f.kind == "donate" and "site" in f.details and f.details.get("arg") == arg
    ]


def _step(x, y):
    return x * 2 + y


def _halve(x, y):
    return x * 0.5 + y


def _kept_every_call(step, n: int):
    x, y = jnp.ones(1000) + 0, jnp.ones(1000) + 0
    held = []
    for _ in range(n):
        keep = x
        held.append(keep)
        x = step(x, y)
    return x, y, held


def test_a_site_whose_every_call_was_refused_says_donation_was_not_applied():
    step = autoopt.optimize(_step)
    x, y, held = _kept_every_call(step, 3)
    assert not any(h.is_deleted() for h in held)  # the premise: nothing was donated
    (calls,) = step.inspect(x, y).site_calls.values()
    assert (dict(calls.refused), dict(calls.donated), calls.exact) == ({0: 3}, {}, True)
    assert calls.why[0] == "another reference to the same object exists"
    (row,) = _site_rows(step.explain(x, y))
    assert not row.applied and row.bytes_saved is None
    assert row.message == (
        "argument 0 (`x`) not donated at this call site: `x = step(x, y)` rebinds it, but the "
        "run-time check refused it at every call so far (3 calls): another reference to the "
        "same object exists; each call passed a device copy of it to the executable that "
        "donates it."
    )
    # the headline does not claim the donating executable's saving for these calls
    assert "where a call rebinds its arguments" in step.explain(x, y).render(color=False)


def test_a_site_refused_now_and_then_says_how_many_calls_were_refused():
    step = autoopt.optimize(_step)
    x, y = jnp.ones(1000) + 0, jnp.ones(1000) + 0
    kept = []
    for i in range(9):
        if i % 3 == 1:
            kept.append(x)
        x = step(x, y)
    (row,) = _site_rows(step.explain(x, y))
    assert row.applied and row.bytes_saved == 4000
    assert row.message == (
        "argument 0 (`x`) donated at this call site: `x = step(x, y)` rebinds it, so its "
        "buffers are dead after the call; except at 3 calls refused by the run-time check: "
        "another reference to the same object exists (each passed a device copy of it)."
    )


def test_a_site_whose_calls_were_never_refused_keeps_its_applied_row():
    step = autoopt.optimize(_step)
    x, y = jnp.ones(1000) + 0, jnp.ones(1000) + 0
    for _ in range(4):
        x = step(x, y)
    (row,) = _site_rows(step.explain(x, y))
    assert row.applied and row.bytes_saved == 4000
    assert "except" not in row.message
    (calls,) = step.inspect(x, y).site_calls.values()
    assert dict(calls.refused) == {} and calls.donated[0] >= 1  # (the calls a plan ran: uncounted)


def test_a_narrowed_site_says_it_runs_an_executable_not_donating_the_argument():
    """Narrowing waits for ``REFUSALS_BEFORE_NARROWING`` refused calls in a row that took ten
    compiles' time: the loop runs until the site's record says it narrowed."""
    step = autoopt.optimize(_halve)
    x, y = jnp.ones(1000) + 0, jnp.ones(1000) + 0
    expected = np.asarray(x)
    narrowed = False
    for _ in range(200):
        for _ in range(100):
            keep = x
            x = step(x, y)
            expected = expected * np.float32(0.5) + np.float32(1)
            del keep
        calls = step.inspect(x, y).site_calls
        if any(c.narrowed for c in calls.values()):
            narrowed = True
            break
    assert narrowed
    np.testing.assert_array_equal(np.asarray(x), expected)
    (row,) = _site_rows(step.explain(x, y))
    assert not row.applied and row.details["narrowed"]
    refused = row.details["refused_calls"]
    assert row.message == (
        "argument 0 (`x`) not donated at this call site now: `x = step(x, y)` rebinds it, but "
        f"the run-time check refused it at {refused} calls: another reference to the same "
        f"object exists; after {REFUSALS_BEFORE_NARROWING} refused calls in a row "
        "the site runs an executable that does not donate it (no device copies), checking "
        "again now and then."
    )


_global_state = jnp.ones(8)


def _loop_on_the_global(step, n: int) -> int:
    """``n`` calls of ``_global_state = step(_global_state, y)``: how many donated."""
    global _global_state
    y, donated = jnp.ones(8) + 0, 0
    for _ in range(n):
        before = _global_state.unsafe_buffer_pointer()
        _global_state = step(_global_state, y)
        donated += _global_state.unsafe_buffer_pointer() == before
    return donated


def test_a_global_refused_by_the_sites_check_while_a_thread_runs_is_not_called_donated():
    # (a review: refusals by the proof's check, another thread holding a Python frame here,
    # were never recorded, and the row read "applied yes ... donated at this call site")
    import threading

    global _global_state
    step = autoopt.optimize(_halve)
    _global_state = jnp.ones(8) + 0
    stop = threading.Event()
    reader = threading.Thread(target=stop.wait, daemon=True)
    reader.start()
    try:
        assert _loop_on_the_global(step, 5) == 0  # the premise: nothing was donated
    finally:
        stop.set()
        reader.join()
    (row,) = _site_rows(step.explain(_global_state, jnp.ones(8)))
    assert not row.applied, row.message
    assert "another thread, a signal handler or a tracer" in row.message, row.message
