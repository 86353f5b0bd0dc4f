"""The caller-side fuzzer of ``donate="safe"``, for long: random caller programs around a
donating call, each run under ``jax.jit`` and ``autoopt.optimize``
(``autoopt/testing/_callers.py``), until the time is up. Prints how many programs ran, how many
donated at least once (a fuzzer that never donates tests nothing), how many raised (the same
error both ways), and the counterexamples: each with its seed and source the first time its
kind of failure (its first line, numbers left out) is seen, then a count per kind and per
template. Exits 1 when it found one.

Every program is built from a seed of its own (drawn from ``--seed``), so one can be rebuilt
and rerun alone: ``--replay SEED`` (with the same ``--max-statements``, ``--mode`` and
``--group``).

    python benchmarks/caller_fuzz.py --minutes 30 [--seed 0] [--max-statements 8]
        [--mode function|module] [--group unpack|argument_code|locals|mutable_self|nnx]
    python benchmarks/caller_fuzz.py --replay 1234567 [--group ...]
"""

from __future__ import annotations

import argparse
import collections
import random
import re
import sys
import time

from autoopt.testing import build_program, check_caller_program
from autoopt.testing._callers import GROUPS, MODES


def _program(seed: int, args: argparse.Namespace) -> str:
    templates = None if args.group is None else GROUPS[args.group]
    return build_program(random.Random(seed).choice, args.max_statements, args.mode, templates)


def _kind(message: str) -> str:
    """A failure's first line with its numbers and quoted values left out."""
    first = message.splitlines()[0]
    first = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", first)
    return re.sub(r"\d+(\.\d+)?", "N", first)[:160]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-statements", type=int, default=8)
    parser.add_argument("--mode", choices=MODES, default=None)
    parser.add_argument("--group", choices=sorted(GROUPS), default=None)
    parser.add_argument("--replay", type=int, default=None, help="run the program of this seed")
    parser.add_argument(
        "--max-failures", type=int, default=0, help="stop after this many (0: never)"
    )
    args = parser.parse_args()
    if args.replay is not None:
        source = _program(args.replay, args)
        try:
            run = check_caller_program(source, seed=args.replay)
        except AssertionError as e:
            print(f"COUNTEREXAMPLE (seed {args.replay}):\n{e}")
            return 1
        print(f"{source}\n--- passed (seed {args.replay}): {run.donated} donations")
        return 0

    seeds = random.Random(args.seed)
    end = time.monotonic() + 60 * args.minutes
    counts: collections.Counter[str] = collections.Counter()
    kinds: collections.Counter[str] = collections.Counter()
    labels: collections.Counter[str] = collections.Counter()  # in counterexamples
    drawn: collections.Counter[str] = collections.Counter()  # in every program
    smallest: dict[str, tuple[int, int]] = {}  # kind -> (source length, seed)
    start = time.monotonic()
    while time.monotonic() < end:
        seed = seeds.randrange(2**32)
        source = _program(seed, args)
        counts["programs"] += 1
        # a family's label names its choices: "unpack[targets <- kind]" counts as "unpack"
        present = {m.split("[")[0] for m in re.findall(r"^\s*# \[(.*)\]$", source, re.M)}
        drawn.update(present)
        try:
            run = check_caller_program(source, seed=seed)
        except AssertionError as e:
            counts["counterexamples"] += 1
            kind = _kind(str(e))
            if kind not in kinds:
                print(
                    f"COUNTEREXAMPLE {counts['counterexamples']} (seed {seed}):\n{e}\n", flush=True
                )
            else:
                print(f"counterexample (seed {seed}): {kind}", flush=True)
            kinds[kind] += 1
            labels.update(present)
            if kind not in smallest or len(source) < smallest[kind][0]:
                smallest[kind] = (len(source), seed)
            if args.max_failures and counts["counterexamples"] >= args.max_failures:
                break
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
    if kinds:
        print("counterexamples by kind (count, the smallest's seed):")
        for kind, count in kinds.most_common():
            print(f"  {count:5d}  seed {smallest[kind][1]:>10d}  {kind}")
        # every program has "call": a template whose share is well above the overall share of
        # counterexamples is what the counterexamples have in common
        print("templates by the share of the programs holding them that are counterexamples:")
        share = {t: labels[t] / drawn[t] for t in drawn}
        for t in sorted(share, key=lambda t: (-share[t], t))[:30]:
            print(f"  {100 * share[t]:5.1f}%  {labels[t]:5d}/{drawn[t]:<5d}  {t}")
    return 1 if kinds else 0


if __name__ == "__main__":
    sys.exit(main())
