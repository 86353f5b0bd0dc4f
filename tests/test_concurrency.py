"""Concurrency: one optimized function called from 8 threads at once.

Every thread gets correct results, the user's function is traced once per signature (counted by a
Python side effect in its body), each signature compiles once (counted with ``jax.monitoring``),
and nothing deadlocks (every thread finishes within a generous timeout).
"""

from __future__ import annotations

import collections
import threading
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import pytest

import autoopt
from autoopt.testing import assert_trees_equivalent

THREADS = 8
TIMEOUT_S = 300  # a deadlock fails the test instead of hanging CI

_compiles = collections.Counter()
_counting = threading.Event()


def _on_event(name, duration, **kwargs):
    if _counting.is_set() and name == "/jax/core/compile/backend_compile_duration":
        _compiles["backend_compile"] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def _make_step(traces, lock):
    def step(x, rows):
        with lock:
            traces[(x.shape, str(x.dtype))] += 1  # runs once per trace of this signature

        def body(i, acc):
            return acc.at[i % acc.shape[0]].add(rows[i] * 0.5)

        acc = jax.lax.fori_loop(0, rows.shape[0], body, x)
        return acc, jnp.tanh(acc).sum()

    return step


def _inputs(signature, seed):
    (n, dtype) = signature
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((n, 3)), dtype)
    rows = jnp.asarray(rng.standard_normal((4, 3)), dtype)
    return x, rows


SIGNATURES = [(2, "float32"), (3, "float32"), (5, "float32"), (2, "bfloat16")]


def _run_threads(work):
    """Run ``work(thread_index)`` on 8 threads released together; returns their results."""
    barrier = threading.Barrier(THREADS)

    def run(t):
        barrier.wait(timeout=TIMEOUT_S)
        return work(t)

    with ThreadPoolExecutor(THREADS) as pool:
        futures = [pool.submit(run, t) for t in range(THREADS)]
        return [f.result(timeout=TIMEOUT_S) for f in futures]


@pytest.mark.parametrize("donate", ["off", "safe"])
def test_eight_threads_get_correct_results_with_one_trace_and_compile_per_signature(donate):
    traces, lock = collections.Counter(), threading.Lock()
    step = _make_step(traces, lock)
    fast = autoopt.optimize(step, donate=donate, fallback="raise")
    # Every thread calls every signature, in its own order, several times.
    plans = [
        [SIGNATURES[(t + k) % len(SIGNATURES)] for k in range(2 * len(SIGNATURES))]
        for t in range(THREADS)
    ]
    inputs = {
        (t, k): _inputs(sig, seed=t * 100 + k)
        for t in range(THREADS)
        for k, sig in enumerate(plans[t])
    }
    ref_traces = collections.Counter()
    reference = jax.jit(_make_step(ref_traces, threading.Lock()))
    expected = {key: reference(*args) for key, args in inputs.items()}
    jax.block_until_ready(expected)

    def work(t):
        outs = {}
        for k in range(len(plans[t])):
            out = fast(*inputs[(t, k)])
            outs[(t, k)] = jax.block_until_ready(out)
        return outs

    _compiles.clear()
    _counting.set()
    try:
        results = _run_threads(work)
    finally:
        _counting.clear()
    for outs in results:
        for key, got in outs.items():
            assert_trees_equivalent(expected[key], got, what=f"thread {key[0]} call {key[1]}")
    assert dict(traces) == {((n, 3), dtype): 1 for n, dtype in SIGNATURES}
    assert _compiles["backend_compile"] == len(SIGNATURES)


def test_eight_threads_rebinding_their_own_state_donate_it_and_agree_with_jax_jit():
    traces, lock = collections.Counter(), threading.Lock()
    step = _make_step(traces, lock)
    fast = autoopt.optimize(
        step, fallback="raise"
    )  # donate="safe": `x, _ = fast(x, rows)` proves x dead
    reference = jax.jit(_make_step(collections.Counter(), threading.Lock()))
    starts = {t: _inputs(SIGNATURES[t % len(SIGNATURES)], seed=t) for t in range(THREADS)}
    expected = {}
    for t, (x, rows) in starts.items():
        for _ in range(5):
            x, _ = reference(x, rows)
        expected[t] = x

    def work(t):
        x, rows = (jnp.copy(a) for a in starts[t])
        for _ in range(5):
            x, _ = fast(x, rows)
        return x

    results = _run_threads(work)
    for t, got in enumerate(results):
        assert_trees_equivalent(expected[t], got, what=f"thread {t}")
    assert dict(traces) == {((n, 3), dtype): 1 for n, dtype in SIGNATURES}


def test_explain_and_calls_from_many_threads_at_once_do_not_interfere():
    traces, lock = collections.Counter(), threading.Lock()
    fast = autoopt.optimize(_make_step(traces, lock), donate="off", fallback="raise")
    args = _inputs(SIGNATURES[0], seed=0)
    expected = jax.jit(_make_step(collections.Counter(), threading.Lock()))(*args)

    def work(t):
        if t % 2:
            return fast.explain(*args)
        return fast(*args)

    results = _run_threads(work)
    for t, r in enumerate(results):
        if t % 2:
            assert isinstance(r, autoopt.Report)
        else:
            assert_trees_equivalent(expected, r)
    # The call path traces once; explain's "before" memory figure compiles plain jax.jit of the
    # original function, which may trace it once more (once, whatever the number of threads).
    assert traces[((2, 3), "float32")] in (1, 2)


def test_static_arguments_from_many_threads_trace_once_per_static_value():
    traces, lock = collections.Counter(), threading.Lock()

    def power(x, n):
        with lock:
            traces[n] += 1
        return x**n

    fast = autoopt.optimize(power, static_argnums=1, fallback="raise")
    x = jnp.arange(4.0)

    def work(t):
        return [fast(x, n) for n in (t % 3, (t + 1) % 3, 2)]

    results = _run_threads(work)
    for t, outs in enumerate(results):
        for n, got in zip((t % 3, (t + 1) % 3, 2), outs):
            assert_trees_equivalent(x**n, got)
    assert dict(traces) == {0: 1, 1: 1, 2: 1}
