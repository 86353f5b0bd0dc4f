"""Rebinding call sites whose arguments are also held elsewhere, so that donation is refused at
run time (``_dispatch.REFUSALS_BEFORE_NARROWING``): patterns a new user's try found slower under
autoopt than under jax.jit, while the signature's executable donated and each call passed
device copies.

Patterns, each a loop of ``x, buf = step(x, buf, i)`` writing row ``i`` of ``buf``:
- helper: a helper unpacks the carry tuple its caller still holds (nothing can be donated);
- xs kept: ``xs.append(x)`` each step (``x`` refused every call, ``buf`` donatable);
- checkpoint: ``buf`` kept every 5th step (refused now and then: the site must keep donating).

Variants, interleaved round by round in one process: naive ``jax.jit(step)``; autoopt
(``autoopt.optimize(step)``, defaults); expert: ``jax.jit(step, donate_argnums=...)`` donating
what the pattern lets it (nothing in helper, ``buf`` in xs kept, ``buf`` but for the
checkpoint steps, where the expert copies: ``jnp.copy``). Medians of the per-step time, after
autoopt's loop ran long enough to settle (a site narrows after ten compiles' time).

    python benchmarks/refused_sites.py [--rows 20000 --steps 200 --rounds 7] [--quick]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from _harness import interleave, markdown_table

import autoopt


def step(x, buf, i):
    x = x + 1.0
    return x, buf.at[i].set(x)


def _advance(f, carry, i):
    x, buf = carry  # the caller's tuple still holds both
    x, buf = f(x, buf, i)
    return x, buf


def loop(pattern: str, f, rows: int, steps: int, expert: bool = False):
    def go():
        x, buf = jnp.zeros(64) + 0, jnp.zeros((rows, 64)) + 0
        kept = []
        for i in range(steps):
            if pattern == "helper":
                x, buf = _advance(f, (x, buf), i % rows)
                continue
            if pattern == "xs kept":
                kept.append(x)
            elif pattern == "checkpoint" and i % 5 == 3:
                kept.append(buf)
                if expert:  # the expert's step donates buf: it keeps a copy instead
                    kept[-1] = jnp.copy(buf)
            x, buf = f(x, buf, i % rows)
        buf.block_until_ready()
        return buf

    return go


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="512 rows, 3 rounds (a smoke run)")
    a = p.parse_args()
    if a.quick:
        a.rows, a.rounds = 512, 3
    print(f"f32[{a.rows},64] buffer, {a.steps} steps a run, {a.rounds} rounds, medians")
    rows = []
    for pattern, donated in (("helper", None), ("xs kept", (1,)), ("checkpoint", (1,))):
        naive, fast = jax.jit(step), autoopt.optimize(step)
        expert = jax.jit(step) if donated is None else jax.jit(step, donate_argnums=donated)
        runs = {
            "naive": loop(pattern, naive, a.rows, a.steps),
            "autoopt": loop(pattern, fast, a.rows, a.steps),
            "expert": loop(pattern, expert, a.rows, a.steps, expert=True),
        }
        t0 = time.perf_counter()
        outs = {k: run() for k, run in runs.items()}
        assert all(bool((outs[k] == outs["naive"]).all()) for k in outs), pattern
        # The steady state of a long loop: a site refused in a row narrows once its refused
        # calls took ten times the compile (_dispatch._NARROW_AFTER_COMPILES); the first run
        # (three compiles and a loop) bounds that.
        warm = min(60.0, 12 * (time.perf_counter() - t0))
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < warm:
            runs["autoopt"]()
        med = interleave(runs, a.rounds, per=a.steps).medians()
        rows.append(
            [
                pattern,
                f"{med['naive'] * 1e6:.1f}",
                f"{med['autoopt'] / med['naive']:.2f}x",
                f"{med['expert'] / med['naive']:.2f}x",
                f"{med['autoopt'] / med['expert']:.2f}x",
            ]
        )
    print(
        markdown_table(
            ["pattern", "naive us/step", "autoopt / naive", "expert / naive", "autoopt / expert"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
