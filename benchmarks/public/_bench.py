"""What every vendored program in benchmarks/public/ adds to its original (and nothing else):

- ``EXPERT``: true when ``AUTOOPT_PUBLIC_EXPERT=1``; the program then adds the hand-written
  donation an expert would write (``donate_argnums=`` / ``donate=``) to its training step, and
  nothing more;
- ``tick()`` at the top of each training step of the loop (the time a step takes is read from
  the ticks after the second: the first two steps compile);
- ``finish(tree, jitted, args)`` once at the end: waits for ``tree``, then prints one JSON line
  with a SHA-256 of the bytes of every array leaf of ``tree`` (the final parameters), the steps,
  the seconds per step, the process's peak RSS (``resource.getrusage``'s ``ru_maxrss``, read
  before anything else is done), and, where ``jitted.lower(*args)`` works, the alias bytes of
  the compiled step (``memory_analysis().alias_size_in_bytes``). Under ``autoopt run`` the
  lowering is autoopt's, which does not say which donation its calls ran with: read the
  ``--report`` JSON for that.

The benchmark (benchmarks/public_programs.py) reads the last line of stdout.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import time

EXPERT = os.environ.get("AUTOOPT_PUBLIC_EXPERT") == "1"
_TICKS: list[float] = []
_CPU: list[float] = []


def tick() -> None:
    _TICKS.append(time.perf_counter())
    _CPU.append(time.process_time())


def finish(tree, jitted=None, args=()) -> None:
    import jax
    import numpy as np

    leaves = [x for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array | np.ndarray)]
    jax.block_until_ready(leaves)
    end, end_cpu = time.perf_counter(), time.process_time()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    digest = hashlib.sha256()
    for x in leaves:
        a = np.asarray(x)
        digest.update(str((a.dtype, a.shape)).encode())
        digest.update(np.ascontiguousarray(a).tobytes())
    timed = _TICKS[2:]
    per_step = (end - timed[0]) / len(timed) if timed else None
    # the process's CPU time (all threads): on a shared machine, the work a step does
    cpu_step = (end_cpu - _CPU[2]) / len(timed) if timed else None
    alias = None
    if jitted is not None and hasattr(jitted, "lower"):
        try:
            compiled = jitted.lower(*args).compile()
            compiled = getattr(compiled, "compiled", compiled)  # equinox wraps jax's
            m = compiled.memory_analysis()
            alias = int(m.alias_size_in_bytes)
        except Exception as e:  # noqa: BLE001 - a figure we could not read is left out
            alias = f"unavailable: {type(e).__name__}: {str(e)[:120]}"
    out = {
        "checksum": digest.hexdigest(),
        "leaves": len(leaves),
        "param_bytes": int(sum(np.asarray(x).nbytes for x in leaves)),
        "steps": len(_TICKS),
        "step_s": per_step,
        "step_cpu_s": cpu_step,
        "peak_rss": peak_rss,
        "alias_bytes": alias,
        "expert": EXPERT,
    }
    print(json.dumps(out), flush=True)
