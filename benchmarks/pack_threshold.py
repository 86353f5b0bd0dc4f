"""When does packing NumPy leaves into one transfer pay? (placement="pack" vs plain jax.jit)

A step concatenating N NumPy f32[256,16] leaves into a matmul, 9 interleaved rounds of 100 calls,
medians. Behind the decision to make packing opt-in (benchmarks/RESULTS.md).

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
    print("| N leaves | jax.jit us | autoopt placement='pack' us | speedup |")
    print("|---:|---:|---:|---:|")
    for n in (4, 9, 16, 32, 64):
        cols = [np.random.rand(256, 16).astype(np.float32) for _ in range(n)]
        w0 = jnp.zeros((16 * n, 1))
        fj = jax.jit(step)
        fa = autoopt.optimize(step, donate="off", placement="pack")
        loop(fj, w0, cols)
        loop(fa, w0, cols)
        r = {"jit": [], "pack": []}
        for _ in range(9):
            r["jit"].append(loop(fj, w0, cols))
            r["pack"].append(loop(fa, w0, cols))
        j, a = statistics.median(r["jit"]), statistics.median(r["pack"])
        print(f"| {n} | {j:.1f} | {a:.1f} | {j / a:.2f}x |")


if __name__ == "__main__":
    main()
