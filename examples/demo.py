"""``autoopt demo``: each bundled example's report, then its loop timed under plain ``jax.jit``
and under ``autoopt.optimize``, interleaved, with the medians and whether the numbers agree.

Each timed run calls the example's ``run(step)``: the user's own Python loop, fresh inputs made
inside it, so donated buffers never leak from one run into the next. The two variants alternate
(ABAB..., the order flipped every repeat) so a machine that speeds up or slows down mid-run
affects both alike. Whole demo: about 15 s on 2 CPU cores, most of it compiling.
"""

from __future__ import annotations

import importlib
import statistics
import sys
import time

import numpy as np

__all__ = ["run_demo", "time_interleaved"]


def time_interleaved(variants: dict, run, repeats: int) -> dict[str, float]:
    """Median seconds of ``run(variant)`` per variant, over interleaved repeats."""
    import jax

    times: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            t0 = time.perf_counter()
            jax.block_until_ready(run(variants[name]))
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def same_numbers(a, b) -> bool:
    """Integers bit-identical, floats within a few ulps (XLA may fuse differently)."""
    import jax

    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if x.dtype.kind in "biu":
            if not np.array_equal(x, y):
                return False
        elif not np.allclose(x, y, rtol=2e-5, atol=1e-6, equal_nan=True):
            return False
    return True


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def run_demo(
    steps_scale: float = 1.0,
    repeats: int = 7,
    reports: bool = True,
    color: bool | None = None,
    only=None,
    out=None,
) -> int:
    import jax
    from autoopt.examples import EXAMPLES

    import autoopt

    out = out or sys.stdout
    names = list(EXAMPLES) if not only else [n for n in EXAMPLES if n in only]
    unknown = sorted(set(only or ()) - set(EXAMPLES))
    if unknown:
        print(
            f"autoopt: error: no example {unknown[0]!r} (there are: {', '.join(EXAMPLES)})",
            file=sys.stderr,
        )
        return 1
    rows = []
    for name in names:
        mod = importlib.import_module(f"autoopt.examples.{name}")
        naive = getattr(mod, EXAMPLES[name])
        fast = autoopt.optimize(naive)
        title = (mod.__doc__ or name).strip().splitlines()[0]
        print(f"== {name}: {title}", file=out)
        steps = max(1, round(mod.run.__defaults__[0] * steps_scale))

        def run(step, steps=steps, mod=mod):
            return mod.run(step, steps)

        expected, got = run(naive), run(fast)  # also compiles both
        medians = time_interleaved({"jax.jit": naive, "autoopt": fast}, run, repeats)
        if reports:  # after the loops ran, so the report knows the call sites
            print(fast.explain(*mod.make_args()).render(color=color), file=out)
        rows.append(
            (name, steps, medians["jax.jit"], medians["autoopt"], same_numbers(expected, got))
        )
    device = jax.devices()[0]
    print(
        f"== measured: medians of {repeats} interleaved runs of each example's loop "
        f"({jax.default_backend()}, {device.device_kind}; times include the Python loop)",
        file=out,
    )
    header = (
        f"{'example':<14}{'steps':>6}{'jax.jit':>12}{'autoopt':>12}{'speedup':>9}  same numbers"
    )
    print(header, file=out)
    print("-" * len(header), file=out)
    for name, steps, t_naive, t_fast, same in rows:
        print(
            f"{name:<14}{steps:>6}{_ms(t_naive):>12}{_ms(t_fast):>12}"
            f"{t_naive / t_fast:>8.2f}x  {'yes' if same else 'NO'}",
            file=out,
        )
    return 0 if all(r[4] for r in rows) else 1
