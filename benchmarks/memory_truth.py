"""The report's "peak" against what the process really holds (issue 28).

autoopt's report gives, per executable, peak = argument + output - aliased + temporary bytes
(``memory_analysis()``), not XLA's ``peak_memory_in_bytes``. Here each program kind runs in a
fresh process under ``jax.jit`` and under ``autoopt.optimize``: the loop is compiled and its
report built first, then every array is dropped, the RSS high-water mark reset, and the loop
runs again from inputs it makes itself (``state = step(state, ...)``). What the steps add to peak
RSS (high-water mark after the steps minus RSS after compiling) is set against the report's
peak (jax.jit: the report's "before", autoopt: its "after", the executable the calls run) and
XLA's ``peak_memory_in_bytes`` of the same executable.

    python benchmarks/memory_truth.py                   # the table (about a minute on 2 cores)
    python benchmarks/memory_truth.py --one mlp autoopt   # one configuration, JSON

Figures go to benchmarks/RESULTS.md, not into this script.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import markdown_table, rss_now, rss_peak, rss_reset, run_fresh  # noqa: E402

MIB = 1 << 20
STEPS = 3


def _train_optax():
    """A 4-layer MLP of 1024 units trained with optax's adamw (the flax/optax training step)."""
    import jax
    import jax.numpy as jnp
    import optax

    d, n, layers = 1024, 1024, 4
    tx = optax.adamw(1e-3)

    def make_args():
        ks = jax.random.split(jax.random.key(0), layers + 1)
        params = [jax.random.normal(k, (d, d)) / math.sqrt(d) for k in ks[:-1]]
        return params, tx.init(params), jax.random.normal(ks[-1], (n, d))

    def step(params, opt_state, x):
        def loss(ps):
            h = x
            for w in ps:
                h = jnp.tanh(h @ w)
            return jnp.mean(h**2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    def loop(f):
        p, s, x = make_args()
        for _ in range(STEPS):
            p, s, _ = f(p, s, x)
        return p

    return step, loop, make_args


def _replay():
    """A DQN replay buffer of 64 MiB, one transition inserted per step."""
    import jax.numpy as jnp

    size, obs = 1 << 18, 64

    def make_args():
        return jnp.zeros((size, obs)), 3, jnp.ones(obs)

    def step(buf, i, transition):
        return buf.at[i % size].set(transition)

    def loop(f):
        buf, _, _ = make_args()
        for i in range(STEPS):
            buf = f(buf, i, jnp.full((obs,), float(i)))
        return buf

    return step, loop, make_args


def _mlp():
    """A deep MLP, 12 layers of 256 units on a batch of 8192 (the issue's deep residual MLP)."""
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

    def loop(f):
        ws, x = make_args()
        for _ in range(STEPS):
            ws, _ = f(ws, x)
        return ws

    return step, loop, make_args


KINDS = {"train step + optax": _train_optax, "replay buffer insert": _replay, "deep MLP": _mlp}
SHORT = {"optax": "train step + optax", "replay": "replay buffer insert", "mlp": "deep MLP"}


def one(kind: str, variant: str) -> dict:
    import jax

    import autoopt

    step, loop, make_args = KINDS[SHORT[kind]]()
    f = jax.jit(step) if variant == "jit" else autoopt.optimize(step, remat="auto")
    jax.block_until_ready(loop(f))  # compiles, and records the loop's call site
    fast = autoopt.optimize(step, remat="auto") if variant == "jit" else f
    if variant == "jit":
        jax.block_until_ready(loop(fast))
    args = make_args()
    report = fast.explain(*args)
    peak = report.memory["before" if variant == "jit" else "after"]["peak_bytes"]
    compiled = (f if variant == "jit" else fast.inspect(*args).jit).lower(*args).compile()
    xla_peak = int(getattr(compiled.memory_analysis(), "peak_memory_in_bytes", 0))
    del args, report, compiled
    gc.collect()
    base = rss_now()
    rss_reset()
    jax.block_until_ready(loop(f))
    return {"report_peak": peak, "xla_peak": xla_peak, "rss_added": rss_peak() - base}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--one", nargs=2, metavar=("KIND", "VARIANT"))
    ns = p.parse_args()
    if ns.one:
        print(json.dumps(one(*ns.one)))
        return
    rows = []
    for kind, name in SHORT.items():
        for variant in ("jit", "autoopt"):
            r = run_fresh(__file__, "--one", kind, variant)
            rows.append(
                (
                    name,
                    "jax.jit" if variant == "jit" else "autoopt",
                    f"{r['report_peak'] / MIB:.1f}",
                    f"{r['rss_added'] / MIB:.1f}",
                    f"{(r['report_peak'] - r['rss_added']) / max(r['rss_added'], 1):+.0%}",
                    f"{r['xla_peak'] / MIB:.1f}",
                )
            )
    print(
        markdown_table(
            (
                "program",
                "under",
                "report peak MiB",
                "steps add to peak RSS MiB",
                "report vs RSS",
                "XLA peak_memory_in_bytes MiB",
            ),
            rows,
            "llrrrr",
        )
    )


if __name__ == "__main__":
    main()
