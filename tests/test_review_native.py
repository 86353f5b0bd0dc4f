"""Review of the C call path (``autoopt/_jit/_native.c``): behaviour that differs from the
Python path (``AUTOOPT_NATIVE=0``). Each test runs a script with the C path on and off and
asserts what the Python path does; a test that fails only with the C path on is a finding."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

from autoopt._jit import _function

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_native = pytest.mark.skipif(
    not _function.NATIVE, reason="the C call path is off (not built, or AUTOOPT_NATIVE=0)"
)


def _run(code: str, native: bool) -> str:
    """``code`` run as a script file (call sites are proved from their source), with the C
    path on or off; its output."""
    env = {**os.environ, "AUTOOPT_NATIVE": "1" if native else "0", "PYTHONPATH": ROOT}
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write(textwrap.dedent(code))
    try:
        done = subprocess.run(
            [sys.executable, script.name],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            cwd=ROOT,
        )
    finally:
        os.unlink(script.name)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


_INTERRUPT_IN_CHECK = """
    import sys
    import jax.numpy as jnp
    import autoopt
    from autoopt.passes.donation import callsite

    @autoopt.optimize
    def step(x):
        return x + 1.0

    x = jnp.zeros(4)

    def loop(n):
        global x
        for _ in range(n):
            x = step(x)  # a global: every call asks callsite.other_code_may_run

    loop(3)  # the site is proved and its plan made
    target = callsite.other_code_may_run.__code__

    def profile(frame, event, arg):
        # What a SIGINT arriving at that function's first instruction does: the eval loop runs
        # Python's handler there, which raises KeyboardInterrupt out of the function.
        if event == "call" and frame.f_code is target:
            raise KeyboardInterrupt

    sys.setprofile(profile)
    try:
        loop(1)
        print("returned")
    except KeyboardInterrupt:
        print("KeyboardInterrupt")
    finally:
        sys.setprofile(None)
    print(float(x[0]))
"""


@needs_native
def test_a_keyboard_interrupt_raised_in_the_checks_reaches_the_caller():
    # The C path clears any exception its checks raise (PyErr_Clear in fast_call/run_spec) and
    # falls back to the Python path: a KeyboardInterrupt raised by the Python code it calls
    # (other_code_may_run) is swallowed, the signal is consumed, and the call goes on.
    off = _run(_INTERRUPT_IN_CHECK, native=False)
    assert off.split() == ["KeyboardInterrupt", "3.0"]
    assert _run(_INTERRUPT_IN_CHECK, native=True) == off


_COMPILE_AFTER_CONTEXT_CHANGE = """
    import sys
    import jax
    import jax.numpy as jnp
    import autoopt
    patch = sys.modules["autoopt.patch"]

    with autoopt.patch():

        @jax.jit
        def step(x):
            return x * 2.0

        def loop(n):
            x = jnp.ones(4)
            for i in range(n):
                if i == 4:  # the same site and signature, traced and compiled again
                    jax.config.update("jax_default_matmul_precision", "highest")
                x = step(x)
            return x

        loop(6)
    jax.config.update("jax_default_matmul_precision", None)
    data = patch.summary()
    print([(r["name"], r["compiles"]) for r in data["functions"]])
    print(sorted(k for k in data["other_compiles"] if "step" in k))
"""


@needs_native
def test_the_summary_counts_a_compile_made_by_a_cached_plan():
    # patch._attribute_compile finds the optimized function by its ``_call``/``_run`` frames;
    # a plan the C path runs has none, so its retrace's compile goes to "other_compiles".
    off = _run(_COMPILE_AFTER_CONTEXT_CHANGE, native=False)
    assert off.splitlines() == ["[('step', 2)]", "[]"]
    assert _run(_COMPILE_AFTER_CONTEXT_CHANGE, native=True) == off


_COPY = """
    import copy
    import jax.numpy as jnp
    import autoopt

    fast = autoopt.optimize(lambda x: x + 1.0)
    try:
        print(copy.copy(fast)(jnp.zeros(2)).tolist())
    except TypeError as e:
        print("TypeError", e)
"""


@needs_native
def test_an_optimized_function_can_be_copied_as_a_jit_object_can():
    # copy.copy of a jax.jit object works, and of an OptimizedFunction on the Python path; with
    # the C path its base type is a C type with fields of its own, which object.__reduce_ex__
    # refuses: "cannot pickle 'OptimizedFunction' object".
    off = _run(_COPY, native=False)
    assert off.split() == ["[1.0,", "1.0]"]
    assert _run(_COPY, native=True) == off


_CLEAR_WHILE_CALLING = """
    import threading
    import jax.numpy as jnp
    import autoopt

    fast = autoopt.optimize(lambda x: x + 1.0)
    errors = []
    stop = threading.Event()

    def loop(n):
        try:
            x = jnp.zeros(4)
            for _ in range(n):
                x = fast(x)
            print(float(x[0]))
        except BaseException as e:
            errors.append(repr(e))

    def clearer():
        while not stop.is_set():
            fast.clear_cache()
            stop.wait(0.01)

    threads = [threading.Thread(target=clearer), threading.Thread(target=loop, args=(1500,))]
    for t in threads:
        t.start()
    threads[1].join()
    stop.set()
    threads[0].join()
    print(errors[:1])
"""


def test_clear_cache_from_another_thread_never_breaks_a_call():
    # Not the C path's: both paths. A clear_cache() while a signature's first call (remat="fit")
    # is in _fit.checked_call makes its jit(*args) trace a new program, whose FitCheck the
    # placer's catcher hands to first_call with the stand-in as the jit:
    # "AttributeError: '_Checked' object has no attribute 'lower'", or the FitCheck itself
    # reaches the caller.
    for native in (False, True) if _function.NATIVE else (False,):
        assert _run(_CLEAR_WHILE_CALLING, native).split() == ["1500.0", "[]"]
