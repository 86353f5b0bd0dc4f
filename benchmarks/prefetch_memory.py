"""Memory ``autoopt.prefetch`` keeps over a loader of ever new batch layouts.

A loader whose batches change shape, dtype or tree structure with the step (bucketed sequence
lengths, a last partial batch, a curriculum) must not make the prefetcher grow memory with the
number of layouts it has seen: it holds ``size`` batches ahead, whatever came before. Each row
feeds 200 batches that cycle over N distinct layouts (a dict of NumPy arrays whose shapes, dtypes
and keys vary with the layout; every other layout is 16 tiny leaves and a label of one dtype, which
prefetch packs into one buffer) through ``autoopt.prefetch(size=2)`` and through a plain loop of
``jax.device_put`` of the same batches, one configuration per fresh process; the consumer only
reads one value of each batch and drops it. Figures: peak RSS growth over the loop (VmHWM, from
after a warm-up that compiles once and starts the backend) and RSS still held after the loop once
the iterator is dropped and collected, in MiB.

    python benchmarks/prefetch_memory.py            # the table
    python benchmarks/prefetch_memory.py --one prefetch 200   # one configuration, JSON

Figures go to benchmarks/RESULTS.md, not into this script.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import markdown_table, rss_now, rss_peak, rss_reset, run_fresh  # noqa: E402

STEPS = 200
LAYOUTS = (10, 50, 200)
MIB = 1 << 20


def batch(step: int, layouts: int):
    """Batch ``step`` of a loader cycling over ``layouts`` distinct layouts."""
    import numpy as np

    k = step % layouts
    if k % 2:  # many tiny leaves of one dtype: prefetch packs them into one buffer
        return {
            "tiny": [np.full((k + j % 3,), step, np.float32) for j in range(16)],
            "label": np.arange(8 + k, dtype=np.float32),
        }
    dtype = (np.float32, np.float16, np.int32)[k % 3]
    b = {
        "image": np.full((8, 64, 64 + k), step, dtype),
        "label": np.arange(8 + k, dtype=np.int32),
    }
    if k % 5 == 0:
        b["mask"] = np.ones((8, 64 + k), bool)
    return b


def one(mode: str, layouts: int) -> dict:
    import gc
    import resource

    import jax
    import numpy as np

    import autoopt

    def feed(n: int, start: int = 0):
        src = (batch(start + s, layouts) for s in range(n))
        if mode == "prefetch":
            return autoopt.prefetch(src, size=2)
        return (jax.device_put(b) for b in src)

    # Warm-up, alike for both: the backend, a first compile of each kind, the prefetch thread.
    jax.block_until_ready(jax.jit(lambda *xs: xs)(np.zeros(3), np.zeros(2)))
    jax.block_until_ready(jax.jit(lambda x: x[1:])(np.zeros(3)))
    warm = {"w": np.zeros((3, 3)), "v": np.zeros(5, np.int32)}
    for b in autoopt.prefetch([warm, warm, warm]) if mode == "prefetch" else [warm]:
        jax.block_until_ready(jax.device_put(b))
    del b
    gc.collect()
    before = rss_now()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rss_reset()
    it = feed(STEPS)
    for b in it:
        np.asarray(b["label"])[-1]  # the step reads the batch (compiling nothing), drops it
        del b
    peak = rss_peak()
    del it
    gc.collect()
    after = rss_now()
    out = {"mode": mode, "layouts": layouts, "peak_mib": (peak - before) / MIB}
    out["held_mib"] = (after - before) / MIB
    out["maxrss_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base) / MIB
    if mode == "prefetch":
        from autoopt.passes.placement import _prefetch

        out["caches"] = _prefetch.cache_sizes()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--one", nargs=2, metavar=("MODE", "LAYOUTS"))
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]))))
        return
    rows = []
    for n in LAYOUTS:
        r = {m: run_fresh(__file__, "--one", m, str(n)) for m in ("device_put", "prefetch")}
        rows.append(
            (
                n,
                f"{r['device_put']['peak_mib']:.0f}",
                f"{r['prefetch']['peak_mib']:.0f}",
                f"{r['device_put']['held_mib']:.0f}",
                f"{r['prefetch']['held_mib']:.0f}",
                json.dumps(r["prefetch"].get("caches")),
            )
        )
    print(f"{STEPS} batches cycling over N layouts; RSS growth in MiB (fresh process each)")
    print(
        markdown_table(
            (
                "N layouts",
                "device_put peak",
                "prefetch peak",
                "device_put held",
                "prefetch held",
                "prefetch caches",
            ),
            rows,
        )
    )


if __name__ == "__main__":
    main()
