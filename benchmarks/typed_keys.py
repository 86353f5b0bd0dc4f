"""Loops of small steps carrying a typed PRNG key (``jax.random.key``): a sampler's random walk
``key, x = walk(key, x)``, a state dict holding its key, and draws from a kept key.

Each loop runs the naive code under ``jax.jit``, the same code under ``autoopt.optimize``, and
the expert version (``jax.jit`` donating what the loop rebinds), interleaved; medians and the
ratios to ``jax.jit``.

    python benchmarks/typed_keys.py [--rounds 9] [--steps 300]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from _harness import interleave, markdown_table

import autoopt


def walk(key, x):
    key, sub = jax.random.split(key)
    return key, x + 0.1 * jax.random.normal(sub, x.shape)


def state_step(s):
    rng, sub = jax.random.split(s["rng"])
    return {"rng": rng, "x": s["x"] + jax.random.normal(sub, s["x"].shape)}


def draw(key):
    return jax.random.normal(key, (16,))


def _walk_loop(step, n):
    def go():
        key, x = jax.random.key(0), jnp.zeros(16)
        for _ in range(n):
            key, x = step(key, x)
        jax.block_until_ready(x)

    return go


def _state_loop(step, n):
    def go():
        s = {"rng": jax.random.key(0), "x": jnp.zeros(16)}
        for _ in range(n):
            s = step(s)
        jax.block_until_ready(s["x"])

    return go


def _draw_loop(step, n):
    def go():
        key, out = jax.random.key(0), None
        for _ in range(n):
            out = step(key)
        jax.block_until_ready(out)

    return go


def run(rounds: int, steps: int) -> list[tuple]:
    cases = [
        ("key, x = walk(key, x)", walk, _walk_loop, {"donate_argnums": 1}),
        ("s = step(s), s holds its key", state_step, _state_loop, {"donate_argnums": 0}),
        ("y = draw(key), key kept", draw, _draw_loop, {}),
    ]
    rows = []
    for name, fn, loop, expert_kw in cases:
        runs = {
            "jax.jit": loop(jax.jit(fn), steps),
            "autoopt": loop(autoopt.optimize(fn), steps),
            "expert": loop(jax.jit(fn, **expert_kw), steps),
        }
        med = interleave(runs, rounds, per=steps, warmup=2).medians()
        us = {k: v * 1e6 for k, v in med.items()}
        rows.append(
            (
                name,
                f"{us['jax.jit']:.1f}",
                f"{us['autoopt']:.1f}",
                f"{us['expert']:.1f}",
                f"{us['autoopt'] / us['jax.jit']:.2f}x",
                f"{us['autoopt'] / us['expert']:.2f}x",
            )
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=300)
    a = p.parse_args()
    rows = run(a.rounds, a.steps)
    header = ("loop (us/step, medians)", "jax.jit", "autoopt", "expert", "/ jit", "/ expert")
    print(markdown_table(header, rows, "lrrrrr"))


if __name__ == "__main__":
    main()
