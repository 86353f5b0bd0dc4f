"""Exactness: how far autoopt's numbers are from jax.jit's, per optimization.

Donation, in-place updates and placement leave every number bit-identical (the random-program
fuzzer and the test suite check that on every program they run). A remat plan recomputes
values in the backward instead of keeping them, and XLA may then fuse and order floating
point differently. This script measures how far that goes on training loops where a plan is
applied: N steps of the bundled transformer example and of ``benchmarks/remat.py``'s
transformer, under ``jax.jit``, under ``autoopt.optimize`` (its default plan), and under
``autoopt.optimize(remat="off")``, from the same start. Per run: whether a plan was applied,
the largest difference relative to each array's largest magnitude (normwise), and the largest
elementwise relative difference (of elements above 1e-3 of the array's largest magnitude).

    python benchmarks/exactness.py [--steps 20]
"""

from __future__ import annotations

import argparse

import numpy as np
from _harness import markdown_table


def _diffs(a, b) -> tuple[float, float, bool]:
    import jax

    norm = elem = 0.0
    exact = True
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if not np.array_equal(x, y):
            exact = False
        scale = max(float(np.max(np.abs(x))), 1e-30)
        d = np.abs(x - y)
        norm = max(norm, float(np.max(d)) / scale)
        big = np.abs(x) > 1e-3 * scale
        if big.any():
            elem = max(elem, float(np.max(d[big] / np.abs(x[big]))))
    return norm, elem, exact


def _workloads():
    import jax
    from autoopt.examples import transformer as ex

    yield "transformer example (L=6, B=4)", ex.train_step.__wrapped__, ex.make_args

    import remat as rb

    wl = rb._transformer(False)
    layer, head = wl["layer"], wl["head"]

    def step(ps, x):
        def loss(ps):
            h = x
            for p in ps:
                h = layer(h, p)
            return head(h)

        value, g = jax.value_and_grad(loss)(ps)
        return jax.tree_util.tree_map(lambda p, g: p - 1e-3 * g, ps, g), value

    yield f"benchmarks/remat.py {wl['name']}", step, wl["params"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    ns = p.parse_args()
    import jax

    import autoopt

    rows = []
    for name, step, make in _workloads():
        variants = {
            "jax.jit": jax.jit(step),
            "autoopt": autoopt.optimize(step),
            'autoopt remat="off"': autoopt.optimize(step, remat="off"),
        }
        outs = {}
        for label, f in variants.items():
            state, x = make()
            for _ in range(ns.steps):
                state, loss = f(state, x)
            outs[label] = (state, loss)
        for label in ("autoopt", 'autoopt remat="off"'):
            fast = variants[label]
            applied = any(f.kind == "remat" and f.applied for f in fast.inspect(*make()).findings)
            norm, elem, exact = _diffs(outs["jax.jit"], outs[label])
            rows.append(
                [
                    name,
                    label,
                    "yes" if applied else "no",
                    "yes" if exact else "no",
                    f"{norm:.1e}",
                    f"{elem:.1e}",
                ]
            )
            print(rows[-1], flush=True)
    print()
    print(f"after {ns.steps} steps, parameters and last loss against jax.jit's:")
    print(
        markdown_table(
            [
                "workload",
                "variant",
                "remat plan",
                "bit-identical",
                "max diff / max |value|",
                "max elementwise rel. diff",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
