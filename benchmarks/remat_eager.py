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
reported: with eager execution it is not repeatable between two runs of the same configuration
(benchmarks/RESULTS.md). Step time: medians over rounds interleaved in one process.

    python benchmarks/remat_eager.py [--quick]    # --quick: the smaller MLP, 3 rounds
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import interleave, markdown_table, run_fresh  # noqa: E402

CONFIGS = ("plain", "expert", "autoopt", "autoopt, memory_budget=1MB")


def _build(config: str, quick: bool = False):
    import jax
    from remat import WORKLOADS

    import autoopt

    wl = WORKLOADS["mlp"](quick)
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

            x = jax.checkpoint(segment)(x, ps[j : j + seg])
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
    return sum(
        r.nbytes
        for r in jax.tree_util.tree_leaves(pullback)
        if hasattr(r, "nbytes") and id(r) not in mine
    )


def run_one(config: str, quick: bool) -> dict:
    import jax

    f, args, grad = _build(config, quick)
    t0 = time.perf_counter()
    jax.block_until_ready(grad(*args))
    first = time.perf_counter() - t0
    jax.block_until_ready(grad(*args))
    return {"config": config, "residuals": _residual_bytes(jax, f, *args), "first": first}


def time_all(rounds: int, quick: bool) -> dict:
    import jax

    built = {c: _build(c, quick) for c in CONFIGS}

    def stepping(c):
        _, args, grad = built[c]
        return lambda: jax.block_until_ready(grad(*args))

    return interleave({c: stepping(c) for c in CONFIGS}, rounds).medians()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", metavar="CONFIG")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.rounds = 3
    if a.one:
        print(json.dumps(run_one(a.one, a.quick)))
        return
    if a.time:
        print(json.dumps(time_all(a.rounds, a.quick)))
        return
    flags = ["--rounds", str(a.rounds)] + (["--quick"] if a.quick else [])
    rows = [run_fresh(__file__, "--one", c, *flags) for c in CONFIGS]
    times = run_fresh(__file__, "--time", *flags)
    plain = rows[0]
    size = "N=2048" if a.quick else "N=8192"
    print(f"eager jax.value_and_grad of the 16-layer tanh MLP ({size}, D=256), XLA:CPU\n")
    header = ("config", "residuals MiB", "vs plain", "step time vs plain", "first call s")
    body = [
        (
            r["config"],
            f"{r['residuals'] / 2**20:.1f}",
            f"{r['residuals'] / plain['residuals']:.2f}x",
            f"{times[r['config']] / times['plain']:.2f}x",
            f"{r['first']:.1f}",
        )
        for r in rows
    ]
    print(markdown_table(header, body))


if __name__ == "__main__":
    main()
