"""The C call path (``autoopt/_jit/_native.c``) runs a repeating call's plan with the same checks
as the Python path, and nothing that path would refuse: the safety tests run with it on (the
default where it is built) and, here, the key ones again with it off (``AUTOOPT_NATIVE=0``).

Where the extension is not built (another Python, a failed compile), the tests that need it are
skipped and the Python path is the only one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoopt
from autoopt._jit import _function

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_native = pytest.mark.skipif(
    not _function.NATIVE, reason="the C call path is off (not built, or AUTOOPT_NATIVE=0)"
)


def _run(code: str, native: bool, extra_env: dict | None = None) -> str:
    """``code``'s stdout, run in a fresh interpreter with the C call path on or off."""
    env = {**os.environ, "AUTOOPT_NATIVE": "1" if native else "0", "PYTHONPATH": ROOT}
    env.update(extra_env or {})
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@needs_native
def test_a_repeating_donated_call_runs_no_python_frame_of_autoopt():
    def step(x):
        return x * 2.0

    fast = autoopt.optimize(step)
    frames: list[str] = []

    def loop(n):
        x = jnp.ones(4)  # the loop's own: the caller holds no reference to it
        for _ in range(n):
            x = fast(x)
        return x

    loop(3)  # the site is proved and its plan made by the Python path

    def profile(frame, event, arg):
        if event == "call" and "autoopt" in frame.f_code.co_filename:
            frames.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        x = loop(5)
    finally:
        sys.setprofile(None)
    assert frames == [], frames
    np.testing.assert_array_equal(np.asarray(x), np.full(4, 2.0**5))


@needs_native
def test_an_alias_of_the_argument_is_never_donated():
    fast = autoopt.optimize(lambda x: x + 1.0)

    def loop(x, n):
        kept = []
        for i in range(n):
            if i == 3:
                kept.append(x)  # another reference: this call must copy, not donate
            x = fast(x)
        return x, kept

    x, kept = loop(jnp.zeros(4), 6)
    assert not kept[0].is_deleted()
    np.testing.assert_array_equal(np.asarray(kept[0]), np.full(4, 3.0))
    np.testing.assert_array_equal(np.asarray(x), np.full(4, 6.0))


@needs_native
def test_a_rebound_callee_at_the_same_site_is_checked_on_every_call():
    f = autoopt.optimize(lambda x: x + 1.0)
    g = autoopt.optimize(lambda x: x + 1.0)

    def loop(x, n):
        h = f
        for i in range(n):
            if i == 3:
                h = g  # the site's callee is another function now
            x = h(x)
        return x

    np.testing.assert_array_equal(np.asarray(loop(jnp.zeros(4), 6)), np.full(4, 6.0))


def test_an_error_has_the_same_traceback_on_both_paths():
    code = """
        import traceback
        import jax.numpy as jnp
        import autoopt

        fast = autoopt.optimize(lambda x: x * 2.0)

        def call(x):
            return fast(x)

        x = jnp.ones(3)
        for _ in range(3):
            call(x)  # plans the site
        x.delete()
        try:
            call(x)
        except Exception as e:
            print(type(e).__name__)
            print([f.name for f in traceback.extract_tb(e.__traceback__)])
    """
    on, off = _run(code, native=True), _run(code, native=False)
    assert on == off
    assert "call" in on


@needs_native
def test_sites_made_by_another_thread_while_a_loop_runs():
    fast = autoopt.optimize(lambda x: x + 1.0)
    stop = threading.Event()
    errors: list[BaseException] = []

    def new_sites():  # each exec'd statement is a call site of its own
        try:
            i = 0
            while not stop.is_set() and i < 200:
                exec(f"y{i} = fast(jnp.ones(2))", {"fast": fast, "jnp": jnp})
                i += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def loop(x, n):
        for _ in range(n):
            x = fast(x)
        return x

    thread = threading.Thread(target=new_sites)
    thread.start()
    try:
        x = loop(jnp.zeros(4), 2000)
    finally:
        stop.set()
        thread.join()
    assert not errors
    np.testing.assert_array_equal(np.asarray(x), np.full(4, 2000.0))


def test_the_key_safety_tests_pass_with_the_c_path_off():
    env = {**os.environ, "AUTOOPT_NATIVE": "0", "PYTHONPATH": ROOT}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-x",
            "-q",
            "tests/test_review_call_path.py",
            "tests/test_safety_donation.py",
            "tests/test_donation_adversarial.py",
            "tests/test_fast_path_trees.py",
            "tests/test_nested_signatures.py",
            "tests/test_bounded_twin.py",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_the_c_path_is_off_when_asked():
    code = """
        from autoopt._jit import _function
        print(_function.NATIVE)
    """
    assert _run(code, native=False).strip() == "False"


@needs_native
def test_a_function_made_before_any_backend_runs_its_calls_in_c_once_one_started():
    """Until a backend starts, ``jax.distributed.initialize()`` may still make this process one
    of a job, where calls take the general path; the C path takes over the plain calls after
    the first call."""
    code = """
        import sys
        import jax.numpy as jnp
        import numpy as np
        import autoopt

        fast = autoopt.optimize(lambda v: v > 1.0)  # (nothing to donate: the plain plan)
        batch = jnp.arange(3.0)  # (the backend starts here)

        def loop(n):
            for _ in range(n):
                y = fast(batch)
            return y

        loop(2)
        frames = []

        def profile(frame, event, arg):
            if event == "call" and "autoopt" in frame.f_code.co_filename:
                frames.append(frame.f_code.co_name)

        sys.setprofile(profile)
        y = loop(3)
        sys.setprofile(None)
        print("_call" in frames, np.asarray(y).tolist())  # (the placer's frames are in C's plan)
    """
    assert _run(code, native=True).strip() == "False [False, False, True]"


@needs_native
def test_x64_changing_between_calls_at_one_site_gives_jax_jits_numbers():
    # The plan's executable is traced again under x64 (a first call there, under remat="fit"):
    # the C path catches the first-call check as the Python plans do.
    fast = autoopt.optimize(lambda x: x * 3)
    expert = jax.jit(lambda x: x * 3)

    def loop(x, n):
        out = []
        for i in range(n):
            with jax.enable_x64(i >= 2):
                out.append(fast(x))
        return out

    x = jnp.arange(4.0)
    for got in loop(x, 4):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expert(x)))


@needs_native
def test_two_threads_looping_at_two_sites_of_one_function():
    # Each thread's calls replace what the C path remembers of the last site and signature
    # while the other's executable runs (without the GIL): the results stay each loop's own.
    fast = autoopt.optimize(lambda x: x + 1.0)
    results: dict[str, np.ndarray] = {}

    def first(n):
        x = jnp.zeros(4)
        for _ in range(n):
            x = fast(x)
        results["first"] = np.asarray(x)

    def second(n):
        x = jnp.zeros((2, 3))
        for _ in range(n):
            x = fast(x)
        results["second"] = np.asarray(x)

    threads = [
        threading.Thread(target=first, args=(3000,)),
        threading.Thread(target=second, args=(3000,)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    np.testing.assert_array_equal(results["first"], np.full(4, 3000.0))
    np.testing.assert_array_equal(results["second"], np.full((2, 3), 3000.0))
