"""Compiles per sequence of calls: jax.jit against autoopt (issue 15 item 4).

A drop-in must not compile more than ``jax.jit`` for the same calls. Each row is one sequence a
user writes (a training loop whose first state is still held elsewhere, a Python int counter that
becomes an array after one step, Python scalars of two types, a report before the first call,
AOT lowering) run on a fresh function under plain ``jax.jit`` and under ``autoopt.optimize``
with each ``donate`` policy; the counts come from jax's own compile event
(``/jax/core/compile/backend_compile_duration``) for the function's own name. autoopt's
measuring compiles (remat candidates, compiled under other names) are counted apart, in the
last column, since they are what a first call pays on top.

    python benchmarks/compile_count.py

A count, not a timing: it does not depend on the machine's load.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import jax
import jax.numpy as jnp
from _harness import Compiles

import autoopt

# --- the functions (module level: the donation proof reads the caller's source) ----------------


def train_step(params, state):
    return params * 0.9 + state, state + 1.0


def counter_step(params, count):
    return params * 2, count + 1


def scaled(x, s):
    return x * s


def grad_step(w, x):
    loss, g = jax.value_and_grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
    return w - 0.1 * g, loss


# --- the sequences: each takes the jitted function and runs the calls --------------------------


def held_fresh_discarded(step):
    """FINDINGS.md: the first state still held elsewhere, then fresh state, then a discarded
    result, then the loop."""
    params, state = jnp.ones(8), jnp.zeros(8)
    held = params
    params, state = step(params, state)
    params, state = jnp.ones(8), jnp.zeros(8)
    params, state = step(params, state)
    _ = step(jnp.ones(8), jnp.zeros(8))
    for _ in range(3):
        params, state = step(params, state)
    return held


def int_counter(step):
    """A Python int leaf that becomes an array after one step."""
    params, count = jnp.ones(4), 0
    for _ in range(4):
        params, count = step(params, count)


def two_scalar_types(step):
    """``f(x, 2.0)`` then ``f(x, 3)``: two programs under jax.jit (two result dtypes)."""
    x = jnp.ones(4)
    for s in (2.0, 3, 2.0, 3):
        x = step(x, s)


def explain_then_loop(step):
    """The report of the first arguments, then the loop (autoopt only: jit has no explain)."""
    w, x = jnp.ones((16, 16)) * 0.01, jnp.ones((8, 16))
    if hasattr(step, "explain"):
        step.explain(w, x)
    for _ in range(3):
        w, _loss = step(w, x)


def lower_then_loop(step):
    """AOT first: ``.lower(...).compile()``, then the calls."""
    w, x = jnp.ones((16, 16)) * 0.01, jnp.ones((8, 16))
    step.lower(w, x).compile()
    for _ in range(3):
        w, _loss = step(w, x)


SEQUENCES: list[tuple[str, Callable, Callable]] = [
    ("held, fresh, discarded, loop", train_step, held_fresh_discarded),
    ("int counter becomes an array", counter_step, int_counter),
    ("scalars 2.0 and 3", scaled, two_scalar_types),
    # explain() compiles the original once more, for its "before" memory figure.
    ("grad step: explain, then loop", grad_step, explain_then_loop),
    ("grad step: lower().compile(), then loop", grad_step, lower_then_loop),
]


def count(fn: Callable, run: Callable, jitted: Callable) -> tuple[int, int]:
    """(compiles of ``fn``'s own name, other compiles) while ``run(jitted)`` runs."""
    jax.clear_caches()  # jax shares executables between jit objects of one program
    with Compiles(fn.__name__) as c:
        run(jitted)
        jax.effects_barrier()
    return c.own, c.other


def main() -> None:
    argparse.ArgumentParser(description=__doc__).parse_args()
    header = "| sequence | jax.jit | safe | auto | off | autoopt's measuring compiles (safe) |"
    print(header)
    print("|---|---:|---:|---:|---:|---:|")
    for label, fn, run in SEQUENCES:
        # The sequence's own eager operations (jnp.ones, np.asarray) compile under both: the
        # column is what autoopt compiles beyond jax.jit's run's other compiles.
        ref, ref_other = count(fn, run, jax.jit(fn))
        cells, measuring = [], 0
        for donate in ("safe", "auto", "off"):
            own, other = count(fn, run, autoopt.optimize(fn, donate=donate))
            cells.append(f"{own}" + (" (more)" if own > ref else ""))
            if donate == "safe":
                measuring = max(0, other - ref_other)
        print(f"| {label} | {ref} | {' | '.join(cells)} | {measuring} |")


if __name__ == "__main__":
    main()
