"""Ctrl-C (or any signal handler that raises) while ``state = step(state)`` runs under "safe".

The call donates ``state``'s arrays. CPython runs pending signal handlers at the end of every
call, between the call's return and the statement's store: before this was handled, the
``KeyboardInterrupt`` left ``state`` bound to the deleted arrays, and ``except
KeyboardInterrupt: save(state)`` raised "Array has been deleted" where jax.jit lost nothing.
Now the statement's names are bound to the result before the exception propagates
(``autoopt/_jit/_native.c``), so the handler finds the state after the step (one of the two
states jax.jit's call can leave, depending on when the signal lands).

Each scenario runs in a subprocess that sends itself SIGINT (from a child ``sh``, so that no
thread of its own exists and donation of globals is not refused) while a warm call's executable
runs; a signal that lands outside the statement is retried.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    sys.platform == "win32" or sys.version_info[:2] != (3, 11),
    reason="POSIX signals; the names are bound by the C call path, built for CPython 3.11",
)

_NATIVE = pytest.importorskip("autoopt._jit._function").NATIVE

SCRIPT = textwrap.dedent(
    r"""
    import json, os, subprocess, sys, time, functools
    from typing import NamedTuple
    import jax, jax.numpy as jnp
    jax.config.update("jax_cpu_enable_async_dispatch", False)  # the call runs the executable
    import autoopt

    SCENARIOS = sys.argv[1].split(",")
    if "nnx" in SCENARIOS:
        autoopt.patch()

    def heavy():
        m = jnp.full((192, 192), 0.001)
        return jax.lax.fori_loop(0, 2500, lambda i, m: jnp.tanh(m @ m), m)[0, 0] * 0

    class Tuner:
        # When to send SIGINT: after the executable started (else the call raises before
        # donating: the state is the old one, the case this test is not about) and before it
        # returns, tuned from what the last signal found.

        def __init__(self, took):
            self.delay, self.step, self.tries, self.new = took * 0.5, took * 0.15, 0, 0

        def more(self):
            return self.new < 2 and self.tries < 16

        def kill_soon(self):
            self.tries += 1
            return subprocess.Popen(
                ["sh", "-c", f"sleep {self.delay:.3f}; kill -INT {os.getpid()}"]
            )

        def saw(self, result, results):
            results.append(result)
            if result == "old":
                self.delay += self.step
            elif result == "no signal in the call":
                self.delay = max(0.0, self.delay - self.step)
            elif result == "new":
                self.new += 1

    def verdict(before, read):
        try:
            now = read()
        except Exception as e:  # noqa: BLE001
            return "LOST: " + str(e)[:60]
        return "old" if now == before else "new" if now == 2 * before else f"WRONG {now}"

    def timed(call):
        for _ in range(2):
            t = time.perf_counter()
            call()
        return time.perf_counter() - t

    def first(x):  # the first array of a state, as a float
        return float(jax.tree_util.tree_leaves(x)[0][0])

    def trials(name, call, read, reset):
        tuner, results = Tuner(timed(call)), []
        while tuner.more():
            before = read()
            p = tuner.kill_soon()
            try:
                try:
                    call()
                    result = "no signal in the call"
                except KeyboardInterrupt:
                    result = verdict(before, read)
                    if result.startswith("LOST"):
                        reset()
                p.wait()
            except KeyboardInterrupt:  # landed after the statement: retried
                p.wait()
                result = "no signal in the call"
            tuner.saw(result, results)
        print(json.dumps({name: results}), flush=True)

    def body(x):
        return x * 2.0 + heavy()

    f = autoopt.optimize(body)

    if "local" in SCENARIOS:
        def local():
            x = jnp.ones(1000)
            def call():
                nonlocal x
                x = f(x)
            def reset():
                nonlocal x
                x = jnp.ones(1000)
            trials("local", call, lambda: first(x), reset)
        local()  # (a cell: nonlocal)

        def plain_local():  # the statement itself in the loop, not in a closure
            x = jnp.ones(1000)
            tuner, results = Tuner(timed(lambda: f(jnp.ones(1000)))), []
            while tuner.more():
                before = float(x[0])
                p = tuner.kill_soon()
                try:
                    try:
                        x = f(x)
                        result = "no signal in the call"
                    except KeyboardInterrupt:
                        result = verdict(before, lambda: float(x[0]))
                        if result.startswith("LOST"):
                            x = jnp.ones(1000)
                    p.wait()
                except KeyboardInterrupt:
                    p.wait()
                    result = "no signal in the call"
                tuner.saw(result, results)
            print(json.dumps({"plain local": results}), flush=True)

        plain_local()

    if "keyword" in SCENARIOS:  # any keyword sends the call to the Python path
        def body_kw(x, training=False):
            return x * 2.0 + heavy() if training else x

        g = autoopt.optimize(body_kw, static_argnames="training")

        def keyword():
            x = jnp.ones(1000)
            def call():
                nonlocal x
                x = g(x, training=True)  # (a static flag, as a train step takes it)
            def reset():
                nonlocal x
                x = jnp.ones(1000)
            trials("keyword static", call, lambda: first(x), reset)
            def call_named():
                nonlocal x
                x = f(x=x)  # the donated argument itself passed by name
            trials("keyword donated", call_named, lambda: first(x), reset)
        keyword()

    class Opt(NamedTuple):  # an optax-like state: jax unflattens it with Python code
        mu: jax.Array
        count: jax.Array

    @autoopt.optimize
    def unpack(params, opt, k):
        params = {"w": params["w"] * 2.0 + heavy(), "b": [params["b"][0] * 2.0]}
        return params, Opt(opt.mu * 2.0, opt.count + 1), k + 1.0

    if "unpack" in SCENARIOS:
        def run_unpack():
            params = {"w": jnp.ones(1000), "b": [jnp.ones(3)]}
            opt = Opt(jnp.ones(1000), jnp.zeros((), jnp.int32))
            k = 0.0
            def call():
                nonlocal params, opt, k
                params, opt, k = unpack(params, opt, k)
            def reset():
                nonlocal params, opt, k
                k = 0.0
                params = {"w": jnp.ones(1000), "b": [jnp.ones(3)]}
                opt = Opt(jnp.ones(1000), jnp.zeros((), jnp.int32))
            trials("unpack", call, lambda: (first(params) + first(opt)) / 2, reset)
        run_unpack()

    if "namedtuple" in SCENARIOS:  # a NamedTuple result unpacked into the names
        @autoopt.optimize
        def nt_step(mu, count):
            return Opt(mu * 2.0 + heavy(), count + 1)

        def run_namedtuple():
            mu, count = jnp.ones(1000), jnp.zeros((), jnp.int32)
            def call():
                nonlocal mu, count
                mu, count = nt_step(mu, count)
            def reset():
                nonlocal mu, count
                mu, count = jnp.ones(1000), jnp.zeros((), jnp.int32)
            trials("namedtuple", call, lambda: first(mu), reset)
        run_namedtuple()

    if "callback" in SCENARIOS:  # donating calls in a callback of a call that donates nothing
        @autoopt.optimize
        def inner(y):
            return y * 1.0 + heavy()

        def cb(v):
            y = jnp.ones(1000)
            for _ in range(LOOP[0]):
                y = inner(y)

        @autoopt.optimize
        def outer(x):
            jax.debug.callback(cb, x[0])
            return x + 1.0

        LOOP = [1]
        x = jnp.ones(3)
        for _ in range(2):
            x = outer(x)
        t = time.perf_counter()
        x = outer(x)
        LOOP[0] = max(4, int(4.0 / (time.perf_counter() - t)))  # (about 4 s of calls)
        p = subprocess.Popen(["sh", "-c", f"sleep 0.5; kill -INT {os.getpid()}"])
        t = time.perf_counter()
        try:
            x = outer(x)
            took = "no signal"
        except (KeyboardInterrupt, Exception):  # (jax wraps the callback's KeyboardInterrupt)
            took = time.perf_counter() - t
        p.wait()
        print(json.dumps({"callback": took}), flush=True)

    if "struct" in SCENARIOS:
        import flax.struct

        @flax.struct.dataclass
        class State:
            w: jax.Array
            step: int = flax.struct.field(pytree_node=False, default=0)

        @autoopt.optimize
        def sstep(s):
            return s.replace(w=s.w * 2.0 + heavy())

        def run_struct():
            s = State(jnp.ones(1000))
            def call():
                nonlocal s
                s = sstep(s)
            def reset():
                nonlocal s
                s = State(jnp.ones(1000))
            trials("struct", call, lambda: first(s), reset)
        run_struct()

    if "method" in SCENARIOS:
        class Trainer:
            def __hash__(self):
                return 0
            def __eq__(self, other):
                return isinstance(other, Trainer)
            @functools.partial(autoopt.optimize, static_argnums=0)
            def step(self, w):
                return w * 2.0 + heavy()

        def run_method():
            t, w = Trainer(), jnp.ones(1000)
            def call():
                nonlocal w
                w = t.step(w)
            def reset():
                nonlocal w
                w = jnp.ones(1000)
            trials("method", call, lambda: first(w), reset)
        run_method()

    if "equinox" in SCENARIOS:
        import equinox as eqx

        class Model(eqx.Module):
            w: jax.Array
            act: object = eqx.field(static=True, default=jnp.tanh)

        @autoopt.optimize
        def estep(m):
            return eqx.tree_at(lambda m: m.w, m, m.w * 2.0 + heavy())

        def run_equinox():
            m = Model(jnp.ones(1000))
            def call():
                nonlocal m
                m = estep(m)
            def reset():
                nonlocal m
                m = Model(jnp.ones(1000))
            trials("equinox", call, lambda: first(m.w), reset)
        run_equinox()

    if "nnx" in SCENARIOS:
        from flax import nnx

        class Lin(nnx.Module):
            def __init__(self):
                self.w = nnx.Param(jnp.ones(1000))

        @nnx.jit
        def nstep(model):
            model.w.value = model.w.value * 2.0 + heavy()

        def run_nnx():
            box = [Lin()]
            def reset():
                box[0] = Lin()
            trials("nnx", lambda: nstep(box[0]), lambda: float(box[0].w.value[0]), reset)
        run_nnx()

    if "module" in SCENARIOS:  # module-level names: globals
        X = jnp.ones(1000)
        tuner, results = Tuner(timed(lambda: f(jnp.ones(1000)))), []
        while tuner.more():
            before = float(X[0])
            p = tuner.kill_soon()
            try:
                try:
                    X = f(X)
                    result = "no signal in the call"
                except KeyboardInterrupt:
                    result = verdict(before, lambda: float(X[0]))
                    if result.startswith("LOST"):
                        X = jnp.ones(1000)
                p.wait()
            except KeyboardInterrupt:
                p.wait()
                result = "no signal in the call"
            tuner.saw(result, results)
        print(json.dumps({"module": results}), flush=True)

    if "first" in SCENARIOS:  # each try a new function: its first call compiles, then runs
        def run_first():
            t = time.perf_counter()
            x = jnp.ones(1000)
            x = autoopt.optimize(lambda x: x * 2.0 + heavy())(x)
            tuner, results = Tuner(time.perf_counter() - t), []
            tuner.delay *= 1.5  # (past the trace and the compile, into the execution)
            while tuner.more():
                g = autoopt.optimize(lambda x: x * 2.0 + heavy())
                x = jnp.ones(1000)
                p = tuner.kill_soon()
                try:
                    try:
                        x = g(x)
                        result = "no signal in the call"
                    except KeyboardInterrupt:
                        result = verdict(1.0, lambda: float(x[0]))
                    p.wait()
                except KeyboardInterrupt:
                    p.wait()
                    result = "no signal in the call"
                tuner.saw(result, results)
            print(json.dumps({"first": results}), flush=True)

        run_first()

    if "trace" in SCENARIOS:  # a new signature at a warm site: the trace is interruptible
        def body_t(x):
            if x.shape[0] == 2000:
                time.sleep(4)  # (a long trace)
            return x * 2.0 + heavy()

        ft = autoopt.optimize(body_t)

        def run_trace():
            x = jnp.ones(1000)
            for _ in range(2):
                x = ft(x)
            x = jnp.ones(2000)
            p = subprocess.Popen(["sh", "-c", f"sleep 0.5; kill -INT {os.getpid()}"])
            t = time.perf_counter()
            try:
                x = ft(x)
                took = "no signal"
            except KeyboardInterrupt:
                took = time.perf_counter() - t
            p.wait()
            print(json.dumps({"trace": [took, float(x[0])]}), flush=True)

        run_trace()

    # Signals are handled as before once the calls are done: Ctrl-C raises at once, and a
    # handler can be set (the main thread is the main thread again).
    import signal
    try:
        signal.raise_signal(signal.SIGINT)
        print(json.dumps({"after": "not raised"}))
    except KeyboardInterrupt:
        previous = signal.signal(signal.SIGTERM, lambda *a: None)
        signal.signal(signal.SIGTERM, previous)
        print(json.dumps({"after": "raised"}))
    """
)


def _run(scenarios: str, tmp_path) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    script = tmp_path / "ctrl_c.py"  # a file: a call site with no source donates nothing
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), scenarios],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            out.update(json.loads(line))
    return out


def _check(results: dict, name: str) -> None:
    got = results[name]
    # The state the handler finds is the one before the step or after it, never deleted; and
    # the case at stake was seen: a signal that landed after the executable donated.
    bad = [r for r in got if r not in ("old", "new", "no signal in the call")]
    assert not bad, f"{name}: {got}"
    assert "new" in got, f"{name}: no signal landed after the executable ran ({got})"


@pytest.mark.skipif(not _NATIVE, reason="the C call path is not built here")
def test_ctrl_c_during_a_donating_call_leaves_the_names_bound_to_live_arrays(tmp_path):
    results = _run("local,unpack,namedtuple,module,first", tmp_path)
    for name in ("local", "plain local", "unpack", "namedtuple", "module", "first"):
        _check(results, name)
    assert results["after"] == "raised"


@pytest.mark.skipif(not _NATIVE, reason="the C call path is not built here")
def test_ctrl_c_during_a_call_with_keyword_arguments_leaves_live_arrays(tmp_path):
    # (the fourth review) `state = step(state, batch, training=True)`: a call with keywords
    # runs the Python path, whose binding read positional arguments only; the held
    # KeyboardInterrupt was raised with `state` bound to the deleted arrays.
    results = _run("keyword", tmp_path)
    for name in ("keyword static", "keyword donated"):
        _check(results, name)


@pytest.mark.skipif(not _NATIVE, reason="the C call path is not built here")
def test_ctrl_c_interrupts_the_trace_of_a_new_signature_at_once(tmp_path):
    # Handlers are held while jax lowers, compiles and runs, not while the user's function is
    # traced (here a trace that sleeps 4 s): Ctrl-C there raises at once, nothing donated.
    took, first = _run("trace", tmp_path)["trace"]
    assert took != "no signal" and took < 3.0, took
    assert first == 1.0


@pytest.mark.skipif(not _NATIVE, reason="the C call path is not built here")
def test_ctrl_c_in_a_loop_of_donating_calls_inside_a_callback_is_not_delayed(tmp_path):
    # A call holds a signal's exception until its own names are bound, not until an outer
    # optimized call (running the callback that loops for about 4 s) returns.
    took = _run("callback", tmp_path)["callback"]
    assert took != "no signal" and took < 2.5, took


@pytest.mark.skipif(not _NATIVE, reason="the C call path is not built here")
def test_ctrl_c_through_the_python_call_paths_leaves_live_arrays(tmp_path):
    pytest.importorskip("flax")
    pytest.importorskip("equinox")
    results = _run("struct,method,equinox,nnx", tmp_path)
    for name in ("struct", "method", "equinox", "nnx"):
        _check(results, name)
    assert results["after"] == "raised"


def test_the_names_bound_early_are_what_the_statement_binds():
    # The binding before the return runs the statement's own stores in its order; where the
    # statement's unpacking would fail it binds nothing (the names keep their arrays).
    import jax.numpy as jnp

    import autoopt

    three = autoopt.optimize(lambda a, b: (a + 1.0, b * 2.0, a - b))
    a, b = jnp.ones(3), jnp.full(3, 2.0)
    with pytest.raises(ValueError):
        a, b = three(a, b)
    assert float(a[0]) == 1.0 and float(b[0]) == 2.0  # untouched, not deleted

    inc = autoopt.optimize(lambda x: x + 1.0)
    x = jnp.zeros(3)
    x = y = inc(x)
    assert y is x and float(x[0]) == 1.0

    swap = autoopt.optimize(lambda p, q, r: ((q, p), r + 1.0))
    p, q, r = jnp.zeros(2), jnp.ones(2), jnp.full(2, 5.0)
    for _ in range(3):
        (p, q), r = swap(p, q, r)
    assert (float(p[0]), float(q[0]), float(r[0])) == (1.0, 0.0, 8.0)


def test_the_jit_object_inspect_returns_is_jax_jits():
    # (a donating jit object under "safe" is wrapped to hold signals: inspect() hands out
    # jax's own, which jax.jit and weak references accept)
    import weakref

    import jax
    import jax.numpy as jnp

    import autoopt

    f = autoopt.optimize(lambda x: x * 2.0)
    x = jnp.ones(3)
    x = f(x)
    x = f(x)
    j = f.inspect(x).jit
    weakref.ref(j)
    for _ in range(2):
        assert float(jax.jit(j)(jnp.ones(3))[0]) == 2.0


def test_a_finalizer_of_a_name_the_statement_rebinds_can_handle_signals():
    # (the fourth review) `x, g = step(x)` releases `g`'s old object when the names are bound
    # early; its finalizer ran while signals were held, where `signal.signal` raises
    # "ValueError: signal only works in main thread" (it runs after the release now).
    import signal

    import jax.numpy as jnp

    import autoopt

    seen = []

    class Old:
        def __del__(self):
            try:
                signal.signal(signal.SIGUSR1, signal.getsignal(signal.SIGUSR1))
                seen.append("ok")
            except ValueError as e:
                seen.append(str(e))

    step = autoopt.optimize(lambda x: (x * 2.0, x + 1.0))
    x = jnp.ones(3)
    for _ in range(3):
        g = Old()
        x, g = step(x)
    assert seen == ["ok"] * 3, seen
    assert float(x[0]) == 8.0 and float(g[0]) == 5.0


_CHANGING_RESULT = r"""
import gc
import jax, jax.numpy as jnp
import autoopt

step = autoopt.optimize(lambda a, b: [a + 1, b + 1])
ARMED = False

class Key:  # a key of the module's globals whose comparison empties the call's result list
    def __hash__(self):
        return hash("a")

    def __eq__(self, other):
        if ARMED:
            for o in gc.get_objects():
                if type(o) is list and len(o) == 2 and all(
                    isinstance(v, jax.Array) and v.shape == (7,) for v in o
                ) and float(o[0][0]) >= 1.0:
                    o.clear()
        return False

globals()[Key()] = "key"
a = jnp.zeros(7)
b = jnp.zeros(7)

def loop(n):
    global a, b
    for i in range(n):
        a, b = step(a, b)

loop(3)
ARMED = True
try:
    loop(1)
except ValueError:
    pass
print(float(a[0]), float(b[0]))
"""


def test_binding_reads_the_result_before_code_run_by_a_store_can_change_it(tmp_path):
    # (the fourth review) The early binding read a list result item by item between stores
    # into the globals, and a store can run Python code (a colliding key's __eq__): emptying
    # the list under it crashed the interpreter. Its items are taken first now, as CPython's
    # UNPACK_SEQUENCE takes them (the statement's own unpacking then fails, as it would on
    # the emptied list).
    script = tmp_path / "changing_result.py"
    script.write_text(_CHANGING_RESULT)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["4.0", "4.0"], proc.stdout
