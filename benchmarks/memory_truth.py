"""The report's "peak" against what the process really holds (issue 28).

autoopt's report gives, per executable, peak = argument + output - aliased + temporary bytes
(``memory_analysis()``), not XLA's ``peak_memory_in_bytes``. Here each of the six program kinds
of tests/test_report_claims.py (a flax classifier with adamw, an equinox CNN, a replay buffer, a
KV-cache decoder, a NumPy-fed loop, a deep residual MLP under a memory budget) runs in a fresh
process under its plain jit (``jax.jit``; equinox's ``filter_jit``) and under
``autoopt.optimize(remat="auto")``: the loop is compiled and its report built first, then every
array is dropped, the RSS high-water mark reset, and the loop runs again from inputs it makes
itself (``state = step(state, ...)``). What the steps add to peak RSS (high-water mark after the
steps minus RSS after compiling) is set against the report's peak (jax.jit: the report's
"before", autoopt: its "after", the executable the calls run) and XLA's
``peak_memory_in_bytes`` of the same executable.

The loop runs ``ROUNDS`` times each way, the median shown: with each step waited on
(``block_until_ready``: one call's memory at a time, what the report's per-call peak is about)
and as written, where JAX dispatches the next calls before the previous one ends (their
arguments' host-to-device copies are made ahead, so a NumPy-fed loop holds several batches).

    python benchmarks/memory_truth.py                     # the table (about 8 minutes on 2 cores)
    python benchmarks/memory_truth.py decoder numpy       # some kinds
    python benchmarks/memory_truth.py --one mlp autoopt   # one configuration, JSON
    python benchmarks/memory_truth.py --conv grad_w       # one convolution alone, JSON
    python benchmarks/memory_truth.py --device-stats      # on a TPU or GPU: the device's own count

``--device-stats`` (a backend that reports ``memory_stats()``: TPU, GPU) sets the report's peak
against the device allocator's own high-water mark, ``peak_bytes_in_use``, instead of RSS. That
mark cannot be reset, so the measured loop is the first thing each process runs: bytes in use
before it, the high-water mark after it (each step waited on; the first step compiles, which
holds no device memory: the process checks that on a throwaway compile first). ``--ballast``
measures every configuration in one process instead (a chip costs seconds to open per
process): before each loop an array of bytes brings what is in use up to the high-water mark
so far, so whatever the loop holds beyond its start raises the mark again; the fresh-process
rows check it.

Figures go to benchmarks/RESULTS.md, not into this script.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
from collections.abc import Callable
from typing import NamedTuple, cast

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import (  # noqa: E402
    equinox_cnn_class,
    markdown_table,
    rss_now,
    rss_peak,
    rss_reset,
    run_fresh,
)

MIB = 1 << 20
STEPS = 3
ROUNDS = 3  # measurements per process, the median shown


class Kind(NamedTuple):
    """One program kind: its step, a loop that runs ``STEPS`` steps from inputs it makes
    itself (``state = step(state, ...)``), the step's arguments (for the report), the options
    autoopt gets, and how a user jits it plainly. Each kind writes its loop out: autoopt proves
    donation at the statement that calls the step, so that statement is the user's own form."""

    step: Callable
    loop: Callable
    make_args: Callable
    options: dict
    plain_jit: Callable


def _flax_classifier() -> Kind:
    """A flax MLP classifier (4 Dense layers of 1024 units, 10 classes) trained with optax's
    adamw on a batch of 1024."""
    import flax.linen as nn
    import jax
    import optax

    d, n, classes = 1024, 1024, 10

    class Classifier(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(4):
                x = nn.relu(nn.Dense(d)(x))
            return nn.Dense(classes)(x)

    model, tx = Classifier(), optax.adamw(1e-3)

    def make_args():
        kx, ky, kp = jax.random.split(jax.random.key(0), 3)
        x = jax.random.normal(kx, (n, d))
        y = jax.random.randint(ky, (n,), 0, classes)
        params = model.init(kp, x[:1])
        return params, tx.init(params), x, y

    def step(params, opt_state, x, y):
        def loss(p):
            logits = cast(jax.Array, model.apply(p, x))  # (apply's type allows a tuple)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    def loop(f, wait=False):
        p, s, x, y = make_args()
        for _ in range(STEPS):
            p, s, _ = f(p, s, x, y)
            if wait:
                jax.block_until_ready(p)
        return p

    return Kind(step, loop, make_args, {}, jax.jit)


def _equinox_cnn() -> Kind:
    """An equinox CNN (two 3x3 convolutions of 64 channels, a linear head) trained with SGD on
    128 images of 32x32x3; plainly jitted with equinox's own ``filter_jit``."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    n, hw, ch = 128, 32, 64
    CNN = equinox_cnn_class(ch=ch, hw=hw)

    def make_args():
        kx, ky, km = jax.random.split(jax.random.key(0), 3)
        x = jax.random.normal(kx, (n, 3, hw, hw))
        y = jax.random.normal(ky, (n, 10))
        return CNN(km), x, y

    def step(model, x, y):
        def loss(m):
            return jnp.mean((jax.vmap(m)(x) - y) ** 2)

        value, g = eqx.filter_value_and_grad(loss)(model)
        return eqx.apply_updates(model, jax.tree_util.tree_map(lambda g: -0.1 * g, g)), value

    def loop(f, wait=False):
        m, x, y = make_args()
        for _ in range(STEPS):
            m, _ = f(m, x, y)
            if wait:
                jax.block_until_ready(m)
        return m

    return Kind(step, loop, make_args, {}, eqx.filter_jit)


def _replay() -> Kind:
    """A DQN replay buffer of 64 MiB, one transition inserted per step."""
    import jax
    import jax.numpy as jnp

    size, obs = 1 << 18, 64

    def make_args():
        return jnp.zeros((size, obs)), 3, jnp.ones(obs)

    def step(buf, i, transition):
        return buf.at[i % size].set(transition)

    def loop(f, wait=False):
        buf, _, _ = make_args()
        for i in range(STEPS):
            buf = f(buf, i, jnp.full((obs,), float(i)))
            if wait:
                jax.block_until_ready(buf)
        return buf

    return Kind(step, loop, make_args, {}, jax.jit)


def _decoder() -> Kind:
    """A KV-cache decoder step: a 32 MiB cache (8192 positions of 1024), one position written
    per step by ``dynamic_update_slice``, attention over the cache."""
    import jax
    import jax.numpy as jnp

    d, cache_len = 1024, 8192

    def make_args():
        return jnp.zeros((cache_len, d)), jnp.ones(d), 0

    def step(cache, x, t):
        cache = jax.lax.dynamic_update_slice_in_dim(cache, jnp.tanh(x)[None], t, 0)
        return cache, jnp.tanh(cache.T @ jax.nn.softmax(cache @ x))

    def loop(f, wait=False):
        cache, x, _ = make_args()
        for t in range(STEPS):
            cache, x = f(cache, x, t)
            if wait:
                jax.block_until_ready(cache)
        return cache

    return Kind(step, loop, make_args, {}, jax.jit)


def _numpy_fed() -> Kind:
    """A loop fed from NumPy: each step a batch of 4096x1024 float32 features and targets
    (32 MiB) from host memory, a linear model of 1024x1024 updated by SGD. The batches are made
    before the steps, as a data set loaded in host memory is: what the steps add is what the
    calls hold (the batch's device copies among the arguments), not the host's copy."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    n, d = 4096, 1024

    def batch(i):
        r = np.random.default_rng(i)
        return (
            r.standard_normal((n, d), dtype=np.float32),
            r.standard_normal((n, d), dtype=np.float32),
        )

    host = [batch(i) for i in range(STEPS)]

    def make_args():
        return jnp.zeros((d, d)), *host[0]

    def step(w, x, y):
        def loss(w):
            return jnp.mean((x @ w - y) ** 2)

        value, g = jax.value_and_grad(loss)(w)
        return w - 0.1 * g, value

    def loop(f, wait=False):
        w = jnp.zeros((d, d))
        for x, y in host:
            w, _ = f(w, x, y)
            if wait:
                jax.block_until_ready(w)
        return w

    return Kind(step, loop, make_args, {}, jax.jit)


def _residual_mlp() -> Kind:
    """A deep residual MLP, 12 blocks of 256 units on a batch of 8192, under a memory budget of
    200 MiB (its step's own peak is about 300 MiB: the budget needs a remat plan)."""
    import jax
    import jax.numpy as jnp

    layers, n, d = 12, 8192, 256

    def make_args():
        ws = [jax.random.normal(jax.random.key(i), (d, d)) / math.sqrt(d) for i in range(layers)]
        return ws, jax.random.normal(jax.random.key(99), (n, d))

    def step(ws, x):
        def loss(ws):
            h = x
            for w in ws:
                h = h + jnp.tanh(jnp.sin(h @ w))
            return jnp.mean(h**2)

        value, g = jax.value_and_grad(loss)(ws)
        return [w - 0.1 * gw for w, gw in zip(ws, g)], value

    def loop(f, wait=False):
        ws, x = make_args()
        for _ in range(STEPS):
            ws, _ = f(ws, x)
            if wait:
                jax.block_until_ready(ws)
        return ws

    return Kind(step, loop, make_args, {"memory_budget": "200MiB"}, jax.jit)


KINDS = {
    "flax": ("flax classifier + adamw", _flax_classifier),
    "equinox": ("equinox CNN", _equinox_cnn),
    "replay": ("replay buffer insert", _replay),
    "decoder": ("KV-cache decoder", _decoder),
    "numpy": ("NumPy-fed loop", _numpy_fed),
    "mlp": ("deep residual MLP, budget 200 MiB", _residual_mlp),
}


def one(kind: str, variant: str) -> dict:
    import jax

    import autoopt

    k = KINDS[kind][1]()
    options = {"remat": "auto", **k.options}
    f = k.plain_jit(k.step) if variant == "jit" else autoopt.optimize(k.step, **options)
    jax.block_until_ready(k.loop(f))  # compiles, and records the loop's call site
    fast = autoopt.optimize(k.step, **options) if variant == "jit" else f
    if variant == "jit":
        jax.block_until_ready(k.loop(fast))
    args = k.make_args()
    report = fast.explain(*args)
    peak = report.memory["before" if variant == "jit" else "after"]["peak_bytes"]
    try:
        compiled = (f if variant == "jit" else fast.inspect(*args).jit).lower(*args).compile()
        xla_peak = int(getattr(compiled.memory_analysis(), "peak_memory_in_bytes", 0))
    except Exception:  # noqa: BLE001 - equinox's filter_jit lowers its own way; no figure
        compiled, xla_peak = None, 0
    applied = sorted({x.kind for x in report.findings if x.applied})
    del args, report, compiled
    added: dict[bool, list[int]] = {False: [], True: []}
    for _ in range(ROUNDS):
        for wait in (False, True):  # as written (calls dispatched ahead), each step waited on
            gc.collect()
            base = rss_now()
            rss_reset()
            jax.block_until_ready(k.loop(f, wait))
            added[wait].append(rss_peak() - base)
    return {
        "report_peak": peak,
        "xla_peak": xla_peak,
        "rss_added": statistics.median(added[True]),
        "rss_added_ahead": statistics.median(added[False]),
        "rss_rounds": added,
        "applied": applied,
    }


def _device_memory() -> Callable[[], dict]:
    import jax

    device = jax.devices()[0]
    if not device.memory_stats():
        raise SystemExit(
            f"--device-stats needs a device whose allocator reports memory_stats() (a TPU or a "
            f"GPU); {device.platform} reports none: run without it for peak RSS"
        )
    return device.memory_stats


def _compile_holds_no_device_memory(stats) -> int:
    """Device bytes a throwaway compile adds to the high-water mark (0: the first step's compile
    does not count in what the loop adds)."""
    import jax
    import jax.numpy as jnp

    before = stats()["peak_bytes_in_use"]
    x = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    jax.jit(lambda a: jnp.tanh(a @ a.T).sum()).lower(x).compile()
    return stats()["peak_bytes_in_use"] - before


def _fill_to_high_water_mark(stats):
    """An array of bytes that brings what is in use up to the high-water mark so far (None when
    it is there already), and the bytes in use with it: the next allocation raises the mark."""
    import jax
    import jax.numpy as jnp

    gc.collect()
    s = stats()
    gap = s["peak_bytes_in_use"] - s["bytes_in_use"]
    ballast = jax.block_until_ready(jnp.zeros((gap,), jnp.uint8)) if gap > 0 else None
    return ballast, stats()["bytes_in_use"]


def one_device(kind: str, variant: str, stats=None) -> dict:
    """What the loop adds to the device's high-water mark (each step waited on), against the
    report's peak of the executable it ran; measured first thing, then the report is built."""
    import jax

    import autoopt

    fresh = stats is None
    stats = stats or _device_memory()
    compile_added = _compile_holds_no_device_memory(stats) if fresh else None
    k = KINDS[kind][1]()
    options = {"remat": "auto", **k.options}
    f = k.plain_jit(k.step) if variant == "jit" else autoopt.optimize(k.step, **options)
    if fresh:
        gc.collect()
        ballast, base = None, stats()["bytes_in_use"]
    else:
        ballast, base = _fill_to_high_water_mark(stats)
    mark_before = stats()["peak_bytes_in_use"]
    jax.block_until_ready(k.loop(f, True))  # the first step compiles (host memory only)
    added = stats()["peak_bytes_in_use"] - base
    del ballast
    fast = autoopt.optimize(k.step, **options) if variant == "jit" else f
    if variant == "jit":
        jax.block_until_ready(k.loop(fast))
    args = k.make_args()
    report = fast.explain(*args)
    peak = report.memory["before" if variant == "jit" else "after"]["peak_bytes"]
    try:
        compiled = (f if variant == "jit" else fast.inspect(*args).jit).lower(*args).compile()
        xla_peak = int(getattr(compiled.memory_analysis(), "peak_memory_in_bytes", 0))
    except Exception:  # noqa: BLE001 - equinox's filter_jit lowers its own way; no figure
        xla_peak = 0
    return {
        "report_peak": peak,
        "xla_peak": xla_peak,
        "device_added": added,
        "mark_above_base": mark_before - base,  # > 0: an earlier mark could hide the loop's
        "compile_added": compile_added,
        "applied": sorted({x.kind for x in report.findings if x.applied}),
        "device": jax.devices()[0].device_kind,
    }


def _fresh_json(*args: str) -> dict | str:
    """``run_fresh`` for a device: a failed process is a row's text, not the end of the table;
    a chip still held by the process before is asked again after a pause."""
    import subprocess
    import time

    for attempt in range(3):
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), *args],
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode == 0:
            return json.loads(out.stdout.strip().splitlines()[-1])
        if "lockfile" not in out.stderr or attempt == 2:
            sys.stderr.write(out.stderr[-2000:])
            return f"failed: {out.stderr.strip().splitlines()[-1][:120] if out.stderr else ''}"
        time.sleep(5)
    raise AssertionError("unreachable")


def device_table(kinds: list[str], fresh: list[str], ballast: bool) -> None:
    """The table of ``--device-stats``: ``fresh`` kinds one process per configuration, then
    (with ``ballast``) ``kinds`` all in one process; each row printed as it comes."""
    header = (
        "program",
        "under",
        "how",
        "report peak MiB",
        "steps add to peak_bytes_in_use MiB",
        "report vs device",
        "XLA peak_memory_in_bytes MiB",
    )
    print(markdown_table(header, [], "lllrrrr"), flush=True)

    def row(kind, variant, how, r):
        name = KINDS[kind][0]
        if isinstance(r, str):
            print(f"| {name} | {variant} | {how} | {r} | | | |", flush=True)
            return
        under = "jax.jit" if variant == "jit" else f"autoopt ({', '.join(r['applied'])})"
        diff = (r["report_peak"] - r["device_added"]) / max(r["device_added"], 1)
        note = f" (mark {r['mark_above_base'] / MIB:+.1f})" if r["mark_above_base"] else ""
        print(
            f"| {name} | {under} | {how}{note} | {r['report_peak'] / MIB:.1f} | "
            f"{r['device_added'] / MIB:.1f} | {diff:+.0%} | {r['xla_peak'] / MIB:.1f} |",
            flush=True,
        )

    for kind in fresh:
        for variant in ("jit", "autoopt"):
            r = _fresh_json("--one-device", kind, variant)
            if not isinstance(r, str):
                print(
                    f"<!-- {r['device']}; a throwaway compile added {r['compile_added']} bytes "
                    "to the mark -->",
                    flush=True,
                )
            row(kind, variant, "fresh process", r)
    if ballast:  # rows streamed: a run stopped at its time limit keeps those it printed
        import subprocess

        child = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--ballast", *kinds],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        for line in child.stdout:
            if line.startswith("ROW "):
                kind, variant, r = json.loads(line[4:])
                row(kind, variant, "one process, ballast", r)
        if child.wait():
            print(f"<!-- the ballast process exited with {child.returncode} -->", flush=True)


def ballast_all(kinds: list[str]) -> None:
    stats = _device_memory()
    for kind in kinds:
        for variant in ("jit", "autoopt"):
            try:
                r: dict | str = one_device(kind, variant, stats)
            except Exception as e:  # noqa: BLE001 - one row's failure is that row's text
                r = f"failed: {type(e).__name__}: {str(e)[:100]}"
            print("ROW " + json.dumps([kind, variant, r]), flush=True)
            gc.collect()


def conv_probe(what: str) -> dict:
    """One convolution of the equinox CNN's second layer (128 images of 64 channels, 32x32, 3x3
    kernel), alone: its report-style peak against what one call adds to peak RSS, with its
    operands already made (``--conv fwd|grad_x|grad_w``)."""
    import jax

    n, ch, hw = 128, 64, 32
    x = jax.random.normal(jax.random.key(0), (n, ch, hw, hw))
    w = jax.random.normal(jax.random.key(1), (ch, ch, 3, 3))

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME")

    if what == "fwd":
        f, args = jax.jit(conv), (x, w)
    elif what == "grad_x":
        f, args = jax.jit(jax.grad(lambda x, w: conv(x, w).sum())), (x, w)
    else:
        f, args = jax.jit(jax.grad(lambda w, x: conv(x, w).sum())), (w, x)
    m = f.lower(*args).compile().memory_analysis()
    jax.block_until_ready(f(*args))
    rounds = []
    for _ in range(ROUNDS):
        gc.collect()
        base = rss_now()
        rss_reset()
        jax.block_until_ready(f(*args))
        rounds.append(rss_peak() - base)
    # the operands exist before the call: what it adds is its output and temporaries
    return {
        "output_plus_temp": int(m.output_size_in_bytes + m.temp_size_in_bytes),
        "rss_added": statistics.median(rounds),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--one", nargs=2, metavar=("KIND", "VARIANT"))
    p.add_argument("--conv", choices=("fwd", "grad_x", "grad_w"), help="one convolution alone")
    p.add_argument("--one-device", nargs=2, metavar=("KIND", "VARIANT"))
    p.add_argument(
        "--device-stats",
        action="store_true",
        help="the device allocator's peak_bytes_in_use instead of RSS (TPU, GPU)",
    )
    p.add_argument(
        "--fresh",
        default="equinox",
        help="with --device-stats: kinds measured one process per configuration (comma list, "
        "'all' or 'none'; the others in one process with a ballast)",
    )
    p.add_argument("--ballast", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("kinds", nargs="*", help=f"some of {', '.join(KINDS)} (default: all)")
    ns = p.parse_args()
    if ns.one:
        print(json.dumps(one(*ns.one)))
        return
    if ns.one_device:
        print(json.dumps(one_device(*ns.one_device)))
        return
    if ns.ballast:
        ballast_all(ns.kinds)
        return
    if ns.device_stats:
        kinds = [k for k in KINDS if not ns.kinds or k in ns.kinds]
        fresh = {"all": kinds, "none": []}.get(ns.fresh, ns.fresh.split(","))
        device_table(kinds, [k for k in kinds if k in fresh], ballast=True)
        return
    if ns.conv:
        print(json.dumps(conv_probe(ns.conv)))
        return
    rows = []
    for kind, (name, _) in KINDS.items():
        if ns.kinds and kind not in ns.kinds:
            continue
        for variant in ("jit", "autoopt"):
            r = run_fresh(__file__, "--one", kind, variant)
            rows.append(
                (
                    name,
                    "jax.jit" if variant == "jit" else f"autoopt ({', '.join(r['applied'])})",
                    f"{r['report_peak'] / MIB:.1f}",
                    f"{r['rss_added'] / MIB:.1f} ({min(r['rss_rounds']['true']) / MIB:.1f}"
                    f"-{max(r['rss_rounds']['true']) / MIB:.1f})",
                    f"{(r['report_peak'] - r['rss_added']) / max(r['rss_added'], 1):+.0%}",
                    f"{r['rss_added_ahead'] / MIB:.1f}",
                    f"{r['xla_peak'] / MIB:.1f}",
                )
            )
    print(
        markdown_table(
            (
                "program",
                "under",
                "report peak MiB",
                f"steps add to peak RSS MiB, median (min-max) of {ROUNDS}",
                "report vs RSS",
                "same, calls dispatched ahead MiB",
                "XLA peak_memory_in_bytes MiB",
            ),
            rows,
            "llrrrrr",
        )
    )


if __name__ == "__main__":
    main()
