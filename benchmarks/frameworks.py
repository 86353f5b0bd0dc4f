"""Donation through the frameworks' jit: an equinox MLP + adam loop and a flax nnx MLP +
nnx.Optimizer loop, each run plainly, under ``autoopt.patch()``, and with the expert's
hand-written donation, interleaved in one process.

The patch is timed twice: with its defaults, and with ``remat="off"``, which leaves out the
default's fit check (under ``remat="fit"`` every call of an optimized function took jax's
Python dispatch path, ``pjit``'s ``cache_miss``, on 2026-12-05: see RESULTS.md).

Reported per variant: the median time of a step and its ratio to plain, whether the final
parameters are bit-identical to plain after the same steps, and the buffers one step reuses
(arrays of at least one dimension whose output lives in the buffer of the input: count and
bytes; XLA:CPU gives scalar outputs buffers of their own under every donation).

    python benchmarks/frameworks.py [--steps 20] [--rounds 9] [--width 256]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _harness import (
    buffer_pointers,
    interleave_loops,
    markdown_table,
    reused_buffers,
    same_arrays,
)

import autoopt

# variant name -> the keywords of the ``autoopt.patch()`` it is made under
PATCHES = {"autoopt.patch()": {}, 'autoopt.patch(remat="off")': {"remat": "off"}}


def _variants(jitted, patches, expert) -> dict:
    """``jitted()`` plainly and under each of ``patches``, then the expert's. ``jitted`` looks
    the framework's jit up when called (``lambda: eqx.filter_jit(step)``): the patch replaces
    the module's attribute, not a reference taken before."""
    variants = {"plain": jitted()}
    for name, options in patches.items():
        with autoopt.patch(**options):
            variants[name] = jitted()
    variants["expert"] = expert
    return variants


# --- equinox ---------------------------------------------------------------------------------


def equinox_variants(width: int, patches=PATCHES):
    import equinox as eqx

    tx = optax.adam(1e-3)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((64, 32)).astype(np.float32))
    y = jnp.asarray(rng.standard_normal((64, 32)).astype(np.float32))

    def init():
        model = eqx.nn.MLP(32, 32, width, 3, key=jax.random.key(0))
        return model, tx.init(eqx.filter(model, eqx.is_array))

    def step(model, opt_state, x, y):
        def loss(m):
            return jnp.mean((jax.vmap(m)(x) - y) ** 2)

        value, g = eqx.filter_value_and_grad(loss)(model)
        updates, opt_state = tx.update(g, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, value

    def step_batch_first(batch, model, opt_state):  # equinox's documented idiom for donation
        return step(model, opt_state, *batch)

    expert = eqx.filter_jit(step_batch_first, donate="all-except-first")

    def loop(kind, fn):
        def run(box, steps):
            # the state comes in a list emptied here: the loop's names are its only holders
            model, opt_state = box.pop()
            before: set[int] = set()
            for i in range(steps):
                if i == steps - 1:
                    before = buffer_pointers((model, opt_state))
                if kind == "expert":
                    model, opt_state, loss = fn((x, y), model, opt_state)
                else:
                    model, opt_state, loss = fn(model, opt_state, x, y)
            jax.block_until_ready(loss)
            return (model, opt_state), reused_buffers(before, (model, opt_state))

        return run

    return _variants(lambda: eqx.filter_jit(step), patches, expert), init, loop


# --- flax nnx --------------------------------------------------------------------------------


def nnx_variants(width: int, patches=PATCHES):
    from flax import nnx

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((64, 32)).astype(np.float32))
    y = jnp.asarray(rng.standard_normal((64, 32)).astype(np.float32))

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(32, width, rngs=rngs)
            self.l2 = nnx.Linear(width, width, rngs=rngs)
            self.l3 = nnx.Linear(width, 32, rngs=rngs)

        def __call__(self, x):
            return self.l3(jax.nn.relu(self.l2(jax.nn.relu(self.l1(x)))))

    def init():
        model = MLP(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    def step(model, optimizer, x, y):
        def loss(m):
            return jnp.mean((m(x) - y) ** 2)

        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value

    expert = nnx.jit(step, donate_argnums=(0, 1))

    def loop(kind, fn):
        def run(box, steps):
            model, optimizer = box.pop()
            before: set[int] = set()
            for i in range(steps):
                if i == steps - 1:
                    before = buffer_pointers(nnx.state((model, optimizer)))
                loss = fn(model, optimizer, x, y)
            jax.block_until_ready(loss)
            return (model, optimizer), reused_buffers(before, nnx.state((model, optimizer)))

        return run

    return _variants(lambda: nnx.jit(step), patches, expert), init, loop


def bench(name, make, width, steps, rounds):
    fns, init, loop = make(width)
    t, final, reused = interleave_loops(fns, init, loop, steps, rounds)
    rows = []
    base = t.median("plain")
    for k in fns:
        hit, of, nbytes = reused[k]
        rows.append(
            [
                name,
                k,
                f"{t.median(k) * 1e3:.3f} ms",
                f"{t.median(k) / base:.2f}",
                "bit-identical" if same_arrays(final["plain"], final[k]) else "DIFFERENT",
                f"{hit}/{of}",
                f"{nbytes:,}",
            ]
        )
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--width", type=int, default=256)
    a = ap.parse_args()
    rows = bench("equinox", equinox_variants, a.width, a.steps, a.rounds)
    rows += bench("flax nnx", nnx_variants, a.width, a.steps, a.rounds)
    print(
        markdown_table(
            ["loop", "variant", "step", "x plain", "final params", "buffers reused", "bytes"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
