"""The caller-side fuzzer of ``donate="safe"``, for long: random caller programs around a
donating call, each run under ``jax.jit`` and ``autoopt.optimize``
(``autoopt/testing/_callers.py``), until the time is up. Prints how many programs ran, how many
donated at least once (a fuzzer that never donates tests nothing), how many raised (the same
error both ways), and every counterexample with its source. Exits 1 when it found one.

    python benchmarks/caller_fuzz.py --minutes 30 [--seed 0] [--max-statements 8]
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import time

from autoopt.testing import build_program, check_caller_program


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-statements", type=int, default=8)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    end = time.monotonic() + 60 * args.minutes
    counts: collections.Counter[str] = collections.Counter()
    failures = []
    start = time.monotonic()
    while time.monotonic() < end:
        source = build_program(rng.choice, args.max_statements)
        counts["programs"] += 1
        try:
            run = check_caller_program(source)
        except AssertionError as e:
            counts["counterexamples"] += 1
            failures.append(str(e))
            print(f"COUNTEREXAMPLE {len(failures)}:\n{e}\n", flush=True)
            continue
        counts["donated"] += run.donated > 0
        counts["donations"] += run.donated
        counts["raised (both ways)"] += run.error is not None
        if counts["programs"] % 500 == 0:
            print(dict(counts), f"{time.monotonic() - start:.0f} s", flush=True)
    minutes = (time.monotonic() - start) / 60
    n = counts["programs"]
    print(
        f"{n} caller programs in {minutes:.1f} min (seed {args.seed}): "
        f"{counts['donated']} donated at least once ({100 * counts['donated'] / max(n, 1):.0f}%), "
        f"{counts['donations']} donations, {counts['raised (both ways)']} raised the same error "
        f"both ways, {counts['counterexamples']} counterexamples"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
