"""Where the branch-free window blend beats XLA's scatter: the figures behind
``window_blend_min_bytes`` (issue 18).

A block ``x.at[i + jnp.arange(k)].set(v)`` with a traced start (bounds unproven) on a buffer of
rows of ``w`` float32, called as ``x = f(x, i)``, donated in every variant: the naive scatter
under ``jax.jit``, the program autoopt compiles with the blend forced
(``window_blend_min_bytes=0``) run through plain ``jax.jit``, and the expert's
``dynamic_update_slice`` at a start it knows is in bounds. Interleaved rounds, medians, ratios.

    python benchmarks/window_blend_sizes.py [--rounds 9] [--calls 100] [--only rows|tiles]
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp
from _harness import interleave
from jax import lax

import autoopt

SHAPES = [
    *itertools.product((4, 8, 16, 64), (16, 256, 4096)),
    (32, 4096),
    (128, 1024),
    (256, 256),
    (256, 1024),
    (1024, 16),
    (16, 16384),
]
# 2-D tiles ``x.at[i + arange(k)[:, None], j + arange(m)].set(v)`` in an (n, n) buffer: (k, m, n).
TILES = [
    (4, 4, 64),
    (8, 16, 256),
    (16, 64, 1024),
    (64, 64, 1024),
    (32, 256, 2048),
    (128, 1024, 4096),
]


def _rewritten(fn, *args):
    """The program autoopt compiles for ``fn`` (every unproven block blended), under jax.jit."""
    closed = autoopt.optimize(fn, donate="off", window_blend_min_bytes=0).trace(*args).jaxpr

    def program(*a):
        return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *a)[0]

    return jax.jit(program, donate_argnums=0)


def measure(k: int, w: int, rounds: int, calls: int, tile_n: int = 0) -> dict[str, float]:
    """Rows: ``k`` rows of ``w``; a tile (``tile_n``): ``k`` x ``w`` in an (n, n) buffer."""
    if tile_n:
        n, shape = tile_n, (tile_n, tile_n)
    else:
        n = max(2048, 4 * k) if w <= 1024 else 1024
        shape = (n, w)
    upd = jnp.full((k, w), 2.0, jnp.float32)

    def naive(x, i):
        if tile_n:
            return x.at[i + jnp.arange(k)[:, None], i // 2 + jnp.arange(w)].set(upd)
        return x.at[i + jnp.arange(k)].set(upd)

    def expert(x, i):
        return lax.dynamic_update_slice(x, upd, (i, i // 2 if tile_n else 0))

    fns = {
        "naive": jax.jit(naive, donate_argnums=0),
        "blend": _rewritten(naive, jnp.zeros(shape), 3),
        "expert": jax.jit(expert, donate_argnums=0),
    }
    state = {name: f(jnp.zeros(shape), 3) for name, f in fns.items()}
    hi = n - max(k, w) if tile_n else n - k

    def loop(name):
        f = fns[name]

        def go():
            x = state.pop(name)
            for j in range(calls):
                x = f(x, (j * 37) % hi)
            x.block_until_ready()
            state[name] = x

        return go

    times = interleave({name: loop(name) for name in fns}, rounds, per=calls, warmup=1)
    return times.medians()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--only", choices=("rows", "tiles"), default=None)
    a = p.parse_args()
    print(f"jax {jax.__version__}, backend {jax.default_backend()}; medians of {a.rounds} rounds\n")
    print(
        "| rows k | row width (f32) | window bytes | naive us | blend us | expert us "
        "| blend / naive | blend / expert |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k, w in [] if a.only == "tiles" else SHAPES:
        m = {name: v * 1e6 for name, v in measure(k, w, a.rounds, a.calls).items()}
        _row(f"{k} | {w}", k * w * 4, m)
    if a.only == "rows":
        return
    print(
        "\n| tile k x m | buffer n x n | window bytes | naive us | blend us | expert us "
        "| blend / naive | blend / expert |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k, m_, n in TILES:
        m = {name: v * 1e6 for name, v in measure(k, m_, a.rounds, a.calls, n).items()}
        _row(f"{k} x {m_} | {n} x {n}", k * m_ * 4, m)


def _row(what: str, nbytes: int, m: dict[str, float]) -> None:
    print(
        f"| {what} | {nbytes:,} | {m['naive']:.1f} | {m['blend']:.1f} | "
        f"{m['expert']:.1f} | {m['blend'] / m['naive']:.2f} | {m['blend'] / m['expert']:.2f} |",
        flush=True,
    )


if __name__ == "__main__":
    main()
