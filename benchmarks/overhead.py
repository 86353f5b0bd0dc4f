"""Dispatch and first-call overhead of autoopt.optimize against jax.jit.

Targets (issue 2): cached-call dispatch on a tiny function within 1.3x of jax.jit; first call
(trace + passes + compile) within 1.5x of jax.jit's first call. Interleaved in one process,
medians reported; quote the ratios (the machine is shared and noisy).

    python benchmarks/overhead.py [--rounds 15] [--quick]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from _harness import interleave

import autoopt


def _calls(f, x, n: int):
    """``n + 1`` calls of ``y = f(x)``, blocking on the last."""

    def go():
        for _ in range(n):
            f(x)
        jax.block_until_ready(f(x))

    return go


def _rebinding(f, make_x, n: int):
    """``n`` calls of ``x = f(x)`` (the argument is dead after each call, so it can be donated)."""

    def go(x):
        for _ in range(n):
            x = f(x)
        jax.block_until_ready(x)

    return go, make_x


def dispatch(rounds: int, n: int) -> dict[str, float]:
    def tiny(x):
        return x + 1.0

    def sim(s):  # a simulation step on a small pytree state, as samplers and integrators have
        return {"x": s["x"] + 0.1 * s["v"], "v": s["v"] * 0.99, "t": s["t"] + 0.1}

    jitted = jax.jit(tiny)
    fast = autoopt.optimize(tiny)
    expert_donating = jax.jit(tiny, donate_argnums=0)
    sim_expert, sim_fast = jax.jit(sim, donate_argnums=0), autoopt.optimize(sim)

    def state():
        return {"x": jnp.zeros(8), "v": jnp.ones(8), "t": jnp.zeros(())}

    def ones():
        return jnp.ones(8)

    x = jnp.ones(8)
    for f in (jitted, fast):
        f(x)
    y = expert_donating(jnp.ones(8))
    y = fast(y)
    runs, prepare = {}, {}
    runs["jit"] = _calls(jitted, x, n)
    runs["autoopt"] = _calls(fast, x, n)
    for name, f, make in (
        ("jit donate", expert_donating, ones),
        ("autoopt x=f(x)", fast, ones),
        ("jit donate tree", sim_expert, state),
        ("autoopt tree", sim_fast, state),
    ):
        runs[name], prepare[name] = _rebinding(f, make, n)
    # Per call: n + 1 calls for y = f(x), n for x = f(x).
    times = interleave(runs, rounds, warmup=0, prepare=prepare)
    med = times.medians()
    return {k: v / (n + 1 if k in ("jit", "autoopt") else n) for k, v in med.items()}


def _mlp_step(depth: int):
    def step(params, x):
        def loss(params):
            h = x
            for w in params:
                h = jnp.tanh(h @ w)
            return jnp.mean(h**2)

        g = jax.grad(loss)(params)
        return [w - 0.01 * gw for w, gw in zip(params, g)]

    return step


def first_call(rounds: int) -> dict[str, dict[str, float]]:
    """Time of the first call of a fresh function (trace + passes + compile + run)."""
    out = {}
    workloads = {
        "tiny": (lambda: lambda x: x * 2.0 + 1.0, lambda: (jnp.ones(8),)),
        "mlp8 step": (
            lambda: _mlp_step(8),
            lambda: ([jnp.ones((64, 64)) * 0.01 for _ in range(8)], jnp.ones((32, 64))),
        ),
    }
    for name, (make_fn, make_args) in workloads.items():
        args = make_args()

        def first(f, args=args):
            jax.block_until_ready(f(*args))

        # A fresh function object each call, wrapped before the clock starts: no cache hits.
        prepare = {
            "jit": lambda make_fn=make_fn: jax.jit(make_fn()),
            "autoopt": lambda make_fn=make_fn: autoopt.optimize(make_fn(), donate="off"),
        }
        times = interleave({"jit": first, "autoopt": first}, rounds, warmup=0, prepare=prepare)
        out[name] = times.medians()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--quick", action="store_true", help="3 rounds of 200 calls (a smoke run)")
    a = p.parse_args()
    if a.quick:
        a.rounds, a.calls = 3, 200
    d = dispatch(a.rounds, a.calls)
    print(
        f"jax {jax.__version__}, backend {jax.default_backend()}, {a.rounds} interleaved rounds "
        f"of {a.calls} calls; medians\n"
    )
    print("| cached call (tiny f32[8] function) | us/call | ratio vs jax.jit |")
    print("|---|---:|---:|")
    print(f"| jax.jit | {d['jit'] * 1e6:.2f} | 1.00 |")
    print(
        f"| autoopt.optimize (`y = f(x)`, nothing donated) | {d['autoopt'] * 1e6:.2f} | "
        f"{d['autoopt'] / d['jit']:.2f} |"
    )
    print(
        f"| jax.jit(donate_argnums=0), `x = f(x)` | {d['jit donate'] * 1e6:.2f} | "
        f"{d['jit donate'] / d['jit']:.2f} |"
    )
    print(
        f"| autoopt.optimize, `x = f(x)` (donated) | {d['autoopt x=f(x)'] * 1e6:.2f} | "
        f"{d['autoopt x=f(x)'] / d['jit donate']:.2f} vs jit donate |"
    )
    print(
        f"| jax.jit(donate_argnums=0), `s = f(s)`, dict of 3 arrays | "
        f"{d['jit donate tree'] * 1e6:.2f} | {d['jit donate tree'] / d['jit']:.2f} |"
    )
    print(
        f"| autoopt.optimize, `s = f(s)`, dict of 3 arrays (donated) | "
        f"{d['autoopt tree'] * 1e6:.2f} | {d['autoopt tree'] / d['jit donate tree']:.2f} vs "
        "jit donate |"
    )
    fc = first_call(max(3, a.rounds // 3))
    print("\n| first call (trace + passes + compile + run) | jax.jit ms | autoopt ms | ratio |")
    print("|---|---:|---:|---:|")
    for name, r in fc.items():
        print(
            f"| {name} | {r['jit'] * 1e3:.1f} | {r['autoopt'] * 1e3:.1f} | "
            f"{r['autoopt'] / r['jit']:.2f} |"
        )


if __name__ == "__main__":
    main()
