"""``autoopt run``: a script or module runs as under ``python`` (argv, ``__main__``, sys.path[0],
exceptions, exit status), with its jax.jit optimized and a per-function summary at exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys
    import jax
    import jax.numpy as jnp

    print("argv", sys.argv, __name__, sys.path[0], __file__)

    @jax.jit
    def step(s, x):
        return s + x

    s = jnp.zeros(1000)
    for _ in range(3):
        s = step(s, jnp.ones(1000))
    print("step is", type(step).__name__, float(s[0]))

    async def refused(x):  # jax.jit accepts it; optimize does not
        return x

    jax.jit(refused)

    def fail():
        raise ValueError("the script's own error")

    if sys.argv[1:2] == ["raise"]:
        fail()
    if sys.argv[1:2] == ["message"]:
        sys.exit("stopping with a message")
    sys.exit(int(sys.argv[1]) if sys.argv[1:] else 0)
    """
)


def run(*args, cwd):
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )


@pytest.fixture
def script(tmp_path):
    (tmp_path / "prog.py").write_text(SCRIPT)
    return tmp_path


def test_a_script_sees_argv_main_and_path_as_under_python_and_its_jit_is_optimized(script):
    plain = run("prog.py", "0", "--flag", cwd=script)
    under = run("-m", "autoopt", "run", "prog.py", "0", "--flag", cwd=script)
    assert plain.returncode == under.returncode == 0, under.stderr
    first = plain.stdout.splitlines()[0]
    assert first == f"argv ['prog.py', '0', '--flag'] __main__ {script} {script / 'prog.py'}"
    assert under.stdout.splitlines()[0] == first
    assert plain.stdout.splitlines()[1] == "step is PjitFunction 3.0"
    assert under.stdout.splitlines()[1] == "step is OptimizedFunction 3.0"


def test_the_exit_status_comes_through(script):
    assert run("-m", "autoopt", "run", "prog.py", "3", cwd=script).returncode == 3
    message = run("-m", "autoopt", "run", "prog.py", "message", cwd=script)
    assert message.returncode == 1
    assert message.stderr.startswith("stopping with a message\n")


def test_the_scripts_exception_prints_as_python_prints_it(script):
    plain = run("prog.py", "raise", cwd=script)
    under = run("-m", "autoopt", "run", "prog.py", "raise", cwd=script)
    assert plain.returncode == under.returncode == 1
    assert plain.stderr.startswith("Traceback (most recent call last):\n")
    assert under.stderr.startswith(plain.stderr), under.stderr


def test_a_module_runs_as_main_with_its_arguments(tmp_path):
    pkg = tmp_path / "runpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(
        "import sys, jax\nprint(__name__, sys.argv[1:], type(jax.jit(abs)).__name__)\nsys.exit(4)\n"
    )
    under = run("-m", "autoopt", "run", "-m", "runpkg", "a", "-b", cwd=tmp_path)
    assert under.returncode == 4, under.stderr
    assert under.stdout == "__main__ ['a', '-b'] OptimizedFunction\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (("missing.py",), "can't open file"),
        (("-m", "no_such_module_here"), "No module named"),
        (("--no-such-flag", "prog.py"), "unknown option"),
        (("--option", "donate=sometimes", "prog.py"), "bad --option"),
        ((), "name a script"),
    ],
)
def test_bad_input_is_one_line_and_status_2(script, args, message):
    out = run("-m", "autoopt", "run", *args, cwd=script)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and message in out.stderr, out.stderr
    assert out.stderr.startswith("autoopt run: error: ")


def test_the_report_holds_each_jitted_function(script):
    out = run("-m", "autoopt", "run", "--report", "r.json", "prog.py", "0", cwd=script)
    assert out.returncode == 0, out.stderr
    data = json.loads((script / "r.json").read_text())
    assert data["exit_status"] == 0 and data["command"] == ["prog.py", "0"]
    rows = {r["name"]: r for r in data["functions"]}
    step = rows["step"]
    assert step["location"] == f"{script / 'prog.py'}:8"
    assert (step["jit_calls"], step["compiles"], step["signatures"]) == (1, 1, 1)
    assert step["applied"] == {"donate": 1} and step["bytes_saved"] == 4000
    assert step["fallbacks"] == []
    (fallback,) = rows["refused"]["fallbacks"]
    assert fallback["pass"] == "options" and "coroutine" in fallback["reason"]
    # the same figures on stderr, after the program's own output
    assert "step" in out.stderr and "donate x1" in out.stderr
    assert os.path.basename(sys.executable)  # the run used this interpreter


# --- as python runs the script, at its edges (a hostile review of `autoopt run`) ----------------

EDGES = textwrap.dedent(
    """
    import atexit, dataclasses, os, pickle, sys, threading

    os.environ["JAX_ENABLE_X64"] = "1"  # before jax is imported: jax reads it then
    import jax
    import jax.numpy as jnp

    print("dtype", (jax.jit(lambda x: x / 3)(jnp.arange(4))).dtype)

    @dataclasses.dataclass
    class Cfg:
        n: int

    atexit.register(lambda: print("at exit", len(pickle.dumps(Cfg(3))) > 0))

    def late():  # a thread still running when the script's code ends
        f = jax.jit(lambda x: x * 2)
        for _ in range(3):
            f(jnp.ones(3))

    threading.Thread(target=late).start()
    if sys.argv[1:] == ["hook"]:
        sys.excepthook = lambda t, e, tb: print("own hook:", t.__name__, e, file=sys.stderr)
        raise ValueError("boom")
    os.chdir(os.path.join(os.path.dirname(os.path.realpath(__file__)), "elsewhere"))
    """
)


@pytest.mark.parametrize("how", ["plain", "under autoopt"])
def test_a_script_runs_as_under_python_at_its_edges(tmp_path, how):
    real = tmp_path / "real"
    real.mkdir()
    (real / "elsewhere").mkdir()
    (real / "edges.py").write_text(EDGES)
    (tmp_path / "link.py").symlink_to(real / "edges.py")
    head = () if how == "plain" else ("-m", "autoopt", "run", "--report", "r.json")
    out = run(*head, "link.py", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    # the environment it set before importing jax (float32 when jax had read it before)
    assert out.stdout.splitlines()[0] == "dtype float64", out.stdout
    # its classes still pickle at exit (`__main__` left as its own)
    assert out.stdout.splitlines()[-1] == "at exit True", out.stdout
    if how == "plain":
        return
    # the report where it was asked for, not where the script moved to; the thread's jit ran
    # (the script's threads are waited for, as python waits) under the patch
    data = json.loads((tmp_path / "r.json").read_text())
    assert sum(r["jit_calls"] for r in data["functions"]) == 2, data["functions"]
    hooked = run("-m", "autoopt", "run", "link.py", "hook", cwd=tmp_path)
    assert hooked.returncode == 1 and "own hook: ValueError boom" in hooked.stderr, hooked.stderr
    assert "Traceback" not in hooked.stderr


@pytest.mark.skipif(os.name != "posix", reason="a process killed by a signal: POSIX")
def test_an_interrupted_script_ends_killed_by_sigint_as_under_python(tmp_path):
    import signal

    (tmp_path / "stop.py").write_text(
        "import os, signal, jax, jax.numpy as jnp\n"
        "print(jax.jit(lambda x: x * 2)(jnp.ones(2)), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "import time; time.sleep(5)\n"
    )
    plain = run("stop.py", cwd=tmp_path)
    under = run("-m", "autoopt", "run", "stop.py", cwd=tmp_path)
    assert plain.returncode == under.returncode == -signal.SIGINT, (plain, under.stderr)
    assert "KeyboardInterrupt" in under.stderr and "autoopt:" in under.stderr
