"""When does packing NumPy leaves into one transfer pay? (plain jax.jit, autoopt's default
placement="auto", which times both ways on a layout's first calls and keeps the faster, and
placement="pack", which always packs)

A step concatenating N NumPy f32[256,16] leaves into a matmul, 9 interleaved rounds of 100 calls,
medians. Packing loses here from N=9 on: each unpacking slice feeds the concatenate and becomes
its own XLA:CPU kernel (~10 us each), more than jit's per-leaf transfer (~3.6 us). The default
must never be meaningfully slower than plain jax.jit on this feed (benchmarks/RESULTS.md).

    python benchmarks/pack_threshold.py
"""
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import autoopt


def step(w, cols):
    x = jnp.concatenate(cols, axis=1)
    return w - 0.01 * (x.T @ (x @ w)) / x.shape[0]


def loop(f, w0, cols, k=100):
    w = w0
    t = time.perf_counter()
    for _ in range(k):
        w = f(w, cols)
    w.block_until_ready()
    return (time.perf_counter() - t) / k * 1e6


def main() -> None:
    print("| N leaves | jax.jit us | autoopt (auto) us | auto speedup | auto chose "
          "| autoopt placement='pack' us | pack speedup |")
    print("|---:|---:|---:|---:|---|---:|---:|")
    for n in (4, 9, 16, 32, 64):
        cols = [np.random.rand(256, 16).astype(np.float32) for _ in range(n)]
        w0 = jnp.zeros((16 * n, 1))
        fj = jax.jit(step)
        fa = autoopt.optimize(step, donate="off")
        fp = autoopt.optimize(step, donate="off", placement="pack")
        for f in (fj, fa, fp):
            loop(f, w0, cols)
        r = {"jit": [], "auto": [], "pack": []}
        for _ in range(9):
            r["jit"].append(loop(fj, w0, cols))
            r["auto"].append(loop(fa, w0, cols))
            r["pack"].append(loop(fp, w0, cols))
        j, a, p = (statistics.median(r[k]) for k in ("jit", "auto", "pack"))
        modes = {layout.mode for layout in fa.inspect(w0, cols).placement.packed_layouts}
        chose = "/".join(sorted(modes)) or "jit (too few leaves)"
        print(f"| {n} | {j:.1f} | {a:.1f} | {j / a:.2f}x | {chose} | {p:.1f} | {j / p:.2f}x |")


if __name__ == "__main__":
    main()
