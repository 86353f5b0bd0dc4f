"""Memory of a loop that makes a new jitted function each step and drops it.

``jax.jit(lambda a: a + params)`` built anew each step (a closure over this step's parameters)
frees each step's ``params`` as soon as the step's jit object and lambda are dropped: jax's
caches hold them weakly. The same loop under ``autoopt.optimize``, and the expert's version
(one jit object, the parameters passed as an argument), each in a fresh process with the
garbage collector at its defaults. Printed: the largest total of live jax arrays seen after a
step (``jax.live_arrays()``), the process's peak RSS, and the step time, with ratios to the
naive jax.jit loop.

    python benchmarks/dropped_functions.py [--steps 200] [--mib 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_CHILD = """
import json, resource, sys, time
import jax, jax.numpy as jnp
variant, steps, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if variant == "autoopt":
    import autoopt
    jit = autoopt.optimize
else:
    jit = jax.jit
x = jnp.ones(n, jnp.float32)
expert = jax.jit(lambda a, p: a + p)
peak = 0
t0 = time.perf_counter()
for i in range(steps):
    params = jnp.full(n, float(i), jnp.float32)  # this step's parameters
    if variant == "expert":
        y = expert(x, params)
    else:
        y = jit(lambda a: a + params)(x)
    y.block_until_ready()
    del params, y
    peak = max(peak, sum(a.nbytes for a in jax.live_arrays()))
seconds = (time.perf_counter() - t0) / steps
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"live": peak, "rss": rss, "step": seconds}))
"""

VARIANTS = ("jax.jit", "autoopt", "expert")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--mib", type=float, default=2.0, help="size of each step's parameters")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    n = int(args.mib * 2**20 / 4)
    samples: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for v in VARIANTS:  # interleaved: each round runs every variant once
            out = subprocess.run(
                [sys.executable, "-c", _CHILD, v, str(args.steps), str(n)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            samples[v].append(json.loads(out.strip().splitlines()[-1]))
    med = {
        v: {k: statistics.median(s[k] for s in samples[v]) for k in ("live", "rss", "step")}
        for v in VARIANTS
    }
    base = med["jax.jit"]
    print(f"{args.steps} steps, {args.mib:g} MiB of parameters per step, {args.rounds} rounds")
    print(f"{'':10} {'live MiB':>9} {'ratio':>6} {'RSS MiB':>8} {'ratio':>6} {'step':>6}")
    for v in VARIANTS:
        m = med[v]
        print(
            f"{v:10} {m['live'] / 2**20:9.1f} {m['live'] / base['live']:6.2f} "
            f"{m['rss'] / 2**20:8.0f} {m['rss'] / base['rss']:6.2f} "
            f"{m['step'] / base['step']:5.2f}x"
        )


if __name__ == "__main__":
    main()
