"""The timing loop and the measurements every benchmark shares.

A benchmark builds its variants (the naive code under ``jax.jit``, the same code under
``autoopt.optimize``, the hand-written expert version, and any extra it explains), each as a
callable that runs a few steps and blocks on the result, then hands them to ``interleave``:
warm-up, rounds in a rotating order, medians. Rotating the order each round lets a burst of
load from other jobs on a shared machine land on every variant alike, and stops a variant from
always paying for the frees the one before it left behind; the median drops the bursts.

Memory comes from ``compiled.memory_analysis()`` (``memory``), which tracks peak RSS on XLA:CPU;
peak RSS is the cross-check, one configuration per fresh process (``run_fresh``, ``rss_*``).
A training loop's variants are timed by ``interleave_loops``, which also gives each variant's
final state (``same_arrays``) and the buffers its last step reused (``reused_buffers``).
``Compiles`` counts compiles. Tests import ``Compiles`` and ``equinox_cnn_class`` from here
too (``from benchmarks._harness import ...``: setup.cfg puts the repo root on their path).

This module imports no jax at its top (the functions that need it import it), so a parent
process that only spawns fresh ones never starts a backend. Figures go to benchmarks/RESULTS.md,
not into the scripts.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "Compiles",
    "Timings",
    "buffer_pointers",
    "equinox_cnn_class",
    "interleave",
    "interleave_loops",
    "markdown_table",
    "memory",
    "ratio",
    "reused_buffers",
    "rss_now",
    "rss_peak",
    "rss_reset",
    "run_fresh",
    "same_arrays",
]


class Timings(dict):
    """name -> per-step wall times of each round (seconds), and the medians; ``cpu`` holds the
    process CPU times (all threads) the same way."""

    cpu: Timings

    def median(self, name: str) -> float:
        return statistics.median(self[name])

    def medians(self) -> dict[str, float]:
        return {name: statistics.median(times) for name, times in self.items()}


def interleave(
    runs: Mapping[str, Callable[..., Any]],
    rounds: int,
    *,
    per: int = 1,
    warmup: int = 1,
    prepare: Mapping[str, Callable[[], Any]] | None = None,
) -> Timings:
    """Time every run ``rounds`` times, round-robin in a rotating order; per-step seconds.

    Each run does ``per`` steps and blocks on its result before returning (the time of a round
    is divided by ``per``). ``warmup`` untimed calls of each run come first (compile, fill
    caches). ``prepare[name]()``, when given, runs untimed before each call of that run and its
    result is the run's argument: a fresh function object for first-call timings, say.
    The result's ``cpu`` holds the process CPU times too: on a shared machine other jobs
    inflate wall time unevenly, while CPU time measures the work each variant does.
    """
    prepare = prepare or {}

    def call(name: str) -> tuple[float, float]:
        # The prepared value is handed over in a list emptied at the call, so the run holds the
        # only reference (a state it rebinds, which donate="safe" can then donate).
        box = [prepare[name]()] if name in prepare else []
        t, c = time.perf_counter(), time.process_time()
        if box:
            runs[name](box.pop())
        else:
            runs[name]()
        return time.perf_counter() - t, time.process_time() - c

    names = list(runs)
    for _ in range(warmup):
        for name in names:
            call(name)
    wall, proc = Timings({n: [] for n in names}), Timings({n: [] for n in names})
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            w, c = call(name)
            wall[name].append(w / per)
            proc[name].append(c / per)
    wall.cpu = proc
    return wall


def interleave_loops(
    variants: Mapping[str, Any],
    init: Callable[[], Any],
    loop: Callable[[str, Any], Callable[[list, int], tuple[Any, Any]]],
    steps: int,
    rounds: int,
) -> tuple[Timings, dict[str, Any], dict[str, Any]]:
    """Training loops timed by ``interleave``: the per-step timings, each variant's final state,
    and what ``run`` reported of each variant's last run (``reused_buffers`` of its last step).

    ``loop(name, fn)`` returns ``run(box, steps)``, which takes its state out of the list
    ``box`` (its own names are then the state's only holders: donation can reuse its buffers),
    runs ``steps`` steps of ``fn`` and returns ``(state, report)``. Each variant runs once from
    ``init()`` untimed, for the final state the rows compare; every timed run goes on from the
    state the variant's previous run left.
    """
    final = {k: loop(k, f)([init()], steps)[0] for k, f in variants.items()}
    holders = {k: {"s": init()} for k in variants}
    reports: dict[str, Any] = {}

    def runner(k):
        run = loop(k, variants[k])

        def go(state):
            box = [state]
            del state
            holders[k]["s"], reports[k] = run(box, steps)

        return go

    timings = interleave(
        {k: runner(k) for k in variants},
        rounds,
        per=steps,
        prepare={k: (lambda k=k: holders[k].pop("s")) for k in variants},
    )
    return timings, final, reports


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str = "") -> str:
    """A markdown table; ``align`` gives one character per column, ``l`` or ``r`` (default: the
    first column left, the others right)."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"
    lines = ["| " + " | ".join(header) + " |", rule]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def memory(compiled) -> dict[str, int]:
    """The compiled program's figures from ``memory_analysis()``, in bytes; ``peak`` is
    argument + output + temp - alias."""
    m = compiled.memory_analysis()
    figures = {
        "argument": int(m.argument_size_in_bytes),
        "output": int(m.output_size_in_bytes),
        "temp": int(m.temp_size_in_bytes),
        "alias": int(m.alias_size_in_bytes),
    }
    figures["peak"] = figures["argument"] + figures["output"] + figures["temp"] - figures["alias"]
    return figures


def flops(compiled) -> float:
    """``cost_analysis()``'s FLOPs (it counts a loop body once)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    return float(cost.get("flops", 0.0))


# --- compiles, counted from jax's own event -------------------------------------------------


COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class Compiles:
    """The backend compiles made while active (a context manager), from jax's compile event:
    ``own`` those of ``jit(name)``, ``other`` all the others (every one, without a ``name``),
    ``total`` both."""

    def __init__(self, name: str | None = None):
        self.name = None if name is None else f"jit({name})"
        self.own, self.other = 0, 0

    @property
    def total(self) -> int:
        return self.own + self.other

    def __call__(self, event, duration, fun_name=None, **kw):
        if event == COMPILE_EVENT:
            if self.name is not None and fun_name == self.name:
                self.own += 1
            else:
                self.other += 1

    def __enter__(self):
        import jax

        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        import jax

        jax.monitoring.unregister_event_duration_listener(self)


# --- a loop's arrays: the buffers its steps reuse, its final state --------------------------


def _arrays(tree) -> list:
    """The tree's ``jax.Array`` leaves (an equinox module's functions and ints left out)."""
    import jax

    return [x for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array)]


def buffer_pointers(tree) -> set[int]:
    """The buffers of the tree's arrays of at least one dimension (integers: no reference).
    Scalars are left out: XLA:CPU gives a scalar output a buffer of its own under every
    donation."""
    return {x.unsafe_buffer_pointer() for x in _arrays(tree) if x.ndim}


def reused_buffers(before: set[int], tree) -> tuple[int, int, int]:
    """Of the tree's arrays of at least one dimension: how many live in a buffer of ``before``
    (``buffer_pointers`` of the step's inputs), how many there are, and the bytes reused."""
    big = [x for x in _arrays(tree) if x.ndim]
    hit = [x for x in big if x.unsafe_buffer_pointer() in before]
    return len(hit), len(big), sum(x.nbytes for x in hit)


def same_arrays(a, b) -> bool:
    """Whether the two trees hold as many arrays, pairwise of one dtype and equal values."""
    import numpy as np

    la, lb = _arrays(a), _arrays(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)
    )


# --- programs the benchmarks share with the tests -------------------------------------------


def equinox_cnn_class(*, ch: int, hw: int) -> type:
    """The class of issue 28's equinox CNN, ``CNN(key)``: two 3x3 convolutions of ``ch``
    channels on images of 3 channels, ``hw`` x ``hw``, then a linear head of 10 outputs
    (benchmarks/memory_truth.py, tests/test_report_claims.py). Make the class once per program:
    ``filter_jit`` traces again for a model of another class."""
    import equinox as eqx
    import jax

    class CNN(eqx.Module):
        c1: eqx.nn.Conv2d
        c2: eqx.nn.Conv2d
        head: eqx.nn.Linear

        def __init__(self, key):
            k1, k2, k3 = jax.random.split(key, 3)
            self.c1 = eqx.nn.Conv2d(3, ch, 3, padding=1, key=k1)
            self.c2 = eqx.nn.Conv2d(ch, ch, 3, padding=1, key=k2)
            self.head = eqx.nn.Linear(ch * hw * hw, 10, key=k3)

        def __call__(self, x):
            x = jax.nn.relu(self.c1(x))
            x = jax.nn.relu(self.c2(x))
            return self.head(x.reshape(-1))

    return CNN


# --- peak RSS, one configuration per fresh process ------------------------------------------


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def rss_reset() -> None:
    """Reset the RSS high-water mark (Linux ``clear_refs``), so that ``rss_peak`` counts from
    here: after compiling, say."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def rss_peak() -> int:
    return _status("VmHWM")


def rss_now() -> int:
    return _status("VmRSS")


def run_fresh(script: str, *args: str) -> dict:
    """Run ``python SCRIPT ARGS`` in a fresh process and return the JSON on its last line.

    Large buffers come from mmap and go back to the OS when freed (glibc otherwise raises its
    mmap threshold and keeps freed pages resident), so the RSS high-water mark follows live
    memory.
    """
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    out = subprocess.run(
        [sys.executable, os.path.abspath(script), *args],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    if out.returncode:
        sys.stderr.write(out.stderr[-3000:])
        raise SystemExit(f"{os.path.basename(script)} {' '.join(args)} failed")
    return json.loads(out.stdout.strip().splitlines()[-1])
