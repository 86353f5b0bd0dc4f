"""Donation on a training step: an MLP trained with Adam, written the naive way.

Three versions, interleaved in one process, each run as ``state = step(state, batch)``:
- naive: ``jax.jit(step)`` (every step copies parameters and optimizer state);
- autoopt: ``autoopt.optimize(step)`` with default settings (donate="safe" proves ``state`` dead);
- expert: ``jax.jit(step, donate_argnums=0)``.
Prints median step times, ratios, and ``alias_size_in_bytes`` from ``memory_analysis()``.
Targets (issue 3): autoopt within 1.05x of expert; aliased bytes equal to expert's.

    python benchmarks/train_step.py [--width 1024 --depth 4 --rounds 7] [--quick]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from _harness import interleave, markdown_table, memory

import autoopt


def init_state(key, width: int, depth: int):
    keys = jax.random.split(key, depth)
    params = [
        {
            "w": jax.random.normal(k, (width, width), jnp.float32) / width**0.5,
            "b": jnp.zeros((width,), jnp.float32),
        }
        for k in keys
    ]
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    return {
        "params": params,
        "m": zeros,
        "v": jax.tree_util.tree_map(jnp.zeros_like, params),
        "t": jnp.zeros((), jnp.int32),
    }


def loss_fn(params, batch):
    x, y = batch
    h = x
    for layer in params[:-1]:
        h = jnp.tanh(h @ layer["w"] + layer["b"])
    out = h @ params[-1]["w"] + params[-1]["b"]
    return jnp.mean((out - y) ** 2)


def step(state, batch):
    """One Adam step, written plainly: no donation, no in-place tricks."""
    lr, b1, b2, eps = 1e-3, 0.9, 0.999, 1e-8
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
    t = state["t"] + 1
    m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
    v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
    tf = t.astype(jnp.float32)
    params = jax.tree_util.tree_map(
        lambda p, m, v: p - lr * (m / (1 - b1**tf)) / (jnp.sqrt(v / (1 - b2**tf)) + eps),
        state["params"],
        m,
        v,
    )
    return {"params": params, "m": m, "v": v, "t": t}, loss


def run(step_fn, box: list, batches, n: int):
    """``n`` steps from the state in ``box``; the final state.

    The caller hands the state over in a one-element list it empties, so this loop holds the
    only reference (as a real training loop does); holding another would rightly stop autoopt
    from donating.
    """
    state = box.pop()
    loss = None
    for i in range(n):
        state, loss = step_fn(state, batches[i % len(batches)])
    jax.block_until_ready((state, loss))
    return state


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="MLP 2x256, 3 rounds of 5 steps")
    a = p.parse_args()
    if a.quick:
        a.width, a.depth, a.steps, a.rounds = 256, 2, 5, 3

    key = jax.random.PRNGKey(0)
    batches = [
        (jax.random.normal(k, (a.batch, a.width)), jax.random.normal(k, (a.batch, a.width)))
        for k in jax.random.split(key, 4)
    ]
    versions = {
        "naive jax.jit": jax.jit(step),
        "autoopt.optimize": autoopt.optimize(step),
        "expert donate_argnums=0": jax.jit(step, donate_argnums=0),
    }
    state_bytes = sum(
        x.nbytes for x in jax.tree_util.tree_leaves(init_state(key, a.width, a.depth))
    )

    # Equal numbers first: 3 steps of each from the same start.
    finals = {}
    for name, f in versions.items():
        finals[name] = run(f, [init_state(key, a.width, a.depth)], batches, 3)
    ref = jax.tree_util.tree_leaves(finals["naive jax.jit"])
    for name, st in finals.items():
        for x, y in zip(ref, jax.tree_util.tree_leaves(st)):
            assert (x == y).all(), f"{name} differs from naive"

    # Aliased bytes from the compiled programs each version runs.
    s0 = init_state(key, a.width, a.depth)
    alias = {
        name: memory(versions[name].lower(s0, batches[0]).compile())["alias"]
        for name in ("naive jax.jit", "expert donate_argnums=0")
    }
    explained = versions["autoopt.optimize"].explain(s0, batches[0])
    alias["autoopt.optimize"] = explained.memory["after"]["alias_bytes"]
    del s0

    states = {k: init_state(key, a.width, a.depth) for k in versions}

    def stepping(name):
        def go():
            states[name] = run(versions[name], [states.pop(name)], batches, a.steps)

        return go

    times = interleave({k: stepping(k) for k in versions}, a.rounds, per=a.steps, warmup=0)
    med = times.medians()
    expert = med["expert donate_argnums=0"]
    print(
        f"jax {jax.__version__}, {jax.default_backend()}; MLP {a.depth}x{a.width}, Adam, "
        f"batch {a.batch}; state {state_bytes / 2**20:.1f} MiB; {a.rounds} interleaved rounds "
        f"x {a.steps} steps; medians\n"
    )
    header = ("version", "ms/step", "vs expert", "vs naive", "alias_size_in_bytes")
    rows = [
        (
            name,
            f"{med[name] * 1e3:.2f}",
            f"{med[name] / expert:.2f}",
            f"{med[name] / med['naive jax.jit']:.2f}",
            f"{alias[name]:,}",
        )
        for name in versions
    ]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
