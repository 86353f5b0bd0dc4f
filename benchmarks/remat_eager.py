"""Remat for ``jax.grad(autoopt.optimize(loss))`` applied eagerly (no outer jit).

Applied eagerly, ``jax.grad`` of a jitted loss runs two executables, the forward and the
backward, and keeps the forward's residuals alive in between. XLA:CPU cannot merge a checkpoint
across two programs, so segments checkpointed in the forward pay off here, where inside one
program they do not (jax-ml/jax#19822). Configurations, on the 16-layer tanh MLP of
``benchmarks/remat.py``:

- plain: ``jax.value_and_grad(jax.jit(loss))``;
- expert: the loss with 4-layer segments under ``jax.checkpoint``, jitted, differentiated the same
  way;
- autoopt: ``jax.value_and_grad(autoopt.optimize(loss))``, by default and with budgets.

Memory: the bytes of the residuals the forward keeps for the backward (deterministic: the leaves
of ``jax.vjp``'s pullback), each configuration in its own process. The peak RSS growth is not
reported: with eager execution it swung from 276 to 663 MiB between two runs of the same
configuration. Step time: medians over rounds interleaved in one process.

    python benchmarks/remat_eager.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CONFIGS = ("plain", "expert", "autoopt", "autoopt, memory_budget=1MB")


def _build(config: str):
    import jax
    from remat import WORKLOADS

    import autoopt

    wl = WORKLOADS["mlp"](False)
    ps, x = wl["params"]()
    layer, head = wl["layer"], wl["head"]

    def loss(ps, x):
        for p in ps:
            x = layer(x, p)
        return head(x)

    def loss_segments(ps, x, seg=4):
        for j in range(0, len(ps), seg):
            def segment(x, pp):
                for p in pp:
                    x = layer(x, p)
                return x
            x = jax.checkpoint(segment)(x, ps[j:j + seg])
        return head(x)

    if config == "plain":
        f = jax.jit(loss)
    elif config == "expert":
        f = jax.jit(loss_segments)
    elif config == "autoopt":
        f = autoopt.optimize(loss)
    else:  # a budget below any plan's reach: the lowest-memory plan (the floor)
        f = autoopt.optimize(loss, memory_budget="1MB")
    return f, (ps, x), jax.value_and_grad(f)


def _residual_bytes(jax, f, *args) -> int:
    _, pullback = jax.vjp(f, *args)
    mine = {id(a) for a in jax.tree_util.tree_leaves(args)}
    return sum(r.nbytes for r in jax.tree_util.tree_leaves(pullback)
               if hasattr(r, "nbytes") and id(r) not in mine)


def run_one(config: str) -> dict:
    import jax

    f, args, grad = _build(config)
    t0 = time.perf_counter()
    jax.block_until_ready(grad(*args))
    first = time.perf_counter() - t0
    jax.block_until_ready(grad(*args))
    return {"config": config, "residuals": _residual_bytes(jax, f, *args), "first": first}


def time_all(rounds: int = 7) -> dict:
    import jax

    built = {c: _build(c) for c in CONFIGS}
    for _, args, grad in built.values():
        jax.block_until_ready(grad(*args))
    times: dict = {c: [] for c in CONFIGS}
    for r in range(rounds):
        order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]
        for c in order:
            _, args, grad = built[c]
            t = time.perf_counter()
            jax.block_until_ready(grad(*args))
            times[c].append(time.perf_counter() - t)
    return {c: statistics.median(t) for c, t in times.items()}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print(json.dumps(run_one(sys.argv[2])))
        return
    if len(sys.argv) == 2 and sys.argv[1] == "--time":
        print(json.dumps(time_all()))
        return
    me = os.path.abspath(__file__)
    rows = [json.loads(subprocess.run([sys.executable, me, "--one", c], capture_output=True,
                                      text=True, check=True).stdout.strip().splitlines()[-1])
            for c in CONFIGS]
    times = json.loads(subprocess.run([sys.executable, me, "--time"], capture_output=True,
                                      text=True, check=True).stdout.strip().splitlines()[-1])
    plain = rows[0]
    print("eager jax.value_and_grad of the 16-layer tanh MLP (N=8192, D=256), XLA:CPU\n")
    print("| config | residuals MiB | vs plain | step time vs plain | first call s |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        c = r["config"]
        print(f"| {c} | {r['residuals'] / 2**20:.1f} | {r['residuals'] / plain['residuals']:.2f}x"
              f" | {times[c] / times['plain']:.2f}x | {r['first']:.1f} |")


if __name__ == "__main__":
    main()
