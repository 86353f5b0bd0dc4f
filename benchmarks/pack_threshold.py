"""When does packing NumPy leaves into one transfer pay? (plain jax.jit, autoopt's default
placement="auto", which times both ways on a layout's first calls and keeps the faster, and
placement="pack", which always packs)

A step concatenating N NumPy f32[256,16] leaves into a matmul, interleaved rounds of 100 calls,
medians. Packing loses from some N on: each unpacking slice feeds the concatenate and becomes
its own XLA:CPU kernel, which costs more than jit's per-leaf transfer. The default must never be
meaningfully slower than plain jax.jit on this feed (benchmarks/RESULTS.md has the figures).

    python benchmarks/pack_threshold.py [--quick]
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from _harness import interleave, markdown_table

import autoopt


def step(w, cols):
    x = jnp.concatenate(cols, axis=1)
    return w - 0.01 * (x.T @ (x @ w)) / x.shape[0]


def loop(f, w0, cols, k=100):
    def go():
        w = w0
        for _ in range(k):
            w = f(w, cols)
        w.block_until_ready()

    return go


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--quick", action="store_true", help="N in (4, 16), 3 rounds of 20 calls")
    a = p.parse_args()
    sizes = (4, 16) if a.quick else (4, 9, 16, 32, 64)
    if a.quick:
        a.rounds, a.calls = 3, 20
    header = (
        "N leaves",
        "jax.jit us",
        "autoopt (auto) us",
        "auto speedup",
        "auto chose",
        "autoopt placement='pack' us",
        "pack speedup",
    )
    rows = []
    for n in sizes:
        cols = [np.random.rand(256, 16).astype(np.float32) for _ in range(n)]
        w0 = jnp.zeros((16 * n, 1))
        fj = jax.jit(step)
        fa = autoopt.optimize(step, donate="off")
        fp = autoopt.optimize(step, donate="off", placement="pack")
        runs = {"jit": loop(fj, w0, cols, a.calls), "auto": loop(fa, w0, cols, a.calls)}
        runs["pack"] = loop(fp, w0, cols, a.calls)
        med = interleave(runs, a.rounds, per=a.calls).medians()
        j, au, pk = (med[k] * 1e6 for k in ("jit", "auto", "pack"))
        modes = {layout.mode for layout in fa.inspect(w0, cols).placement.packed_layouts}
        chose = "/".join(sorted(modes)) or "jit (too few leaves)"
        rows.append(
            (n, f"{j:.1f}", f"{au:.1f}", f"{j / au:.2f}x", chose, f"{pk:.1f}", f"{j / pk:.2f}x")
        )
    print(markdown_table(header, rows, align="rrrrlrr"))


if __name__ == "__main__":
    main()
