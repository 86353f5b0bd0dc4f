"""Public training programs, not written here, run unmodified in fresh processes: plainly
(``python PROG``), under ``autoopt run --report FILE.json PROG``, and with the expert's
hand-written donation (``AUTOOPT_PUBLIC_EXPERT=1 python PROG``: each vendored copy adds its
``donate_argnums=`` / ``donate=`` then, and only then).

The programs are in benchmarks/public/, each with a header naming its repository, path and commit
and what was changed to run offline on CPU in seconds (synthetic data, fewer steps, a seed, and
the ``_bench`` lines that print the result; see benchmarks/public/_bench.py):

- an equinox GRU (equinox's docs/examples/train_rnn.ipynb): ``eqx.filter_jit``, optax adam;
- optax's getting-started loop (optax's docs/getting_started.ipynb): plain ``jax.jit`` + adam,
  1,000 small steps;
- a flax nnx MLP on MNIST-shaped data (optax's examples/mlp_mnist.ipynb): ``nnx.jit`` +
  ``nnx.Optimizer``;
- an LSTM seq2seq (flax's examples/seq2seq): flax linen + optax + ``TrainState`` under ``jax.jit``.

Per program and variant: the median over rounds of the time per training step (from the third
step on; wall time, and the process's CPU time over all threads, steadier on a shared
machine) and of the process's peak RSS (``ru_maxrss``, fresh process each run, glibc's mmap
threshold lowered as in ``_harness.run_fresh``); whether the final parameters (and optimizer
state) are bit-identical to plain (a SHA-256 of their bytes); the alias bytes: the expert's from
its compiled step (``memory_analysis().alias_size_in_bytes``), autoopt's from its report (the
bytes of the arguments it donated to the training step, ``bytes_saved`` of the step's row); and
what autoopt applied, and considered but did not apply, to the training step.

    python benchmarks/public_programs.py [--rounds 3] [--only NAME]... [--json OUT.json]

Rounds rotate the order of the variants. Figures go to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import markdown_table

HERE = os.path.dirname(os.path.abspath(__file__))
PUBLIC = os.path.join(HERE, "public")

# name -> (script, its arguments, the training step's name in autoopt's report)
PROGRAMS: dict[str, tuple[str, list[str], str]] = {
    "equinox GRU": ("equinox_train_rnn.py", [], "main.<locals>.make_step"),
    "optax getting started": ("optax_getting_started.py", [], "fit.<locals>.step"),
    "nnx MLP (optax mlp_mnist)": ("optax_mlp_mnist_nnx.py", [], "train_step"),
    "flax linen seq2seq": ("flax_seq2seq/train.py", ["--num_train_steps", "25"], "train_step"),
}

VARIANTS = ("plain", "autoopt run", "expert")


def _autoopt_command() -> list[str]:
    exe = shutil.which("autoopt", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "autoopt"]


def run_once(name: str, variant: str) -> dict:
    script, args, step_name = PROGRAMS[name]
    path = os.path.join(PUBLIC, script)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    env.pop("AUTOOPT_PUBLIC_EXPERT", None)
    report = None
    if variant == "plain":
        cmd = [sys.executable, path, *args]
    elif variant == "expert":
        cmd = [sys.executable, path, *args]
        env["AUTOOPT_PUBLIC_EXPERT"] = "1"
    else:
        fd, report = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        cmd = [*_autoopt_command(), "run", "--report", report, path, *args]
    t = time.perf_counter()
    out = subprocess.run(
        cmd, capture_output=True, text=True, check=False, env=env, cwd=os.path.dirname(path)
    )
    wall = time.perf_counter() - t
    if out.returncode:
        sys.stderr.write(out.stderr[-3000:])
        raise SystemExit(f"{name} ({variant}) failed with status {out.returncode}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["process_s"] = wall
    if report is not None:
        with open(report) as fh:
            data = json.load(fh)
        os.unlink(report)
        rows = [r for r in data["functions"] if r["name"] == step_name]
        row = max(rows, key=lambda r: r["compiles"]) if rows else None
        result["step_row"] = row
        result["all_applied"] = {
            r["name"]: (r["applied"], r["bytes_saved"]) for r in data["functions"] if r["applied"]
        }
        result["summary_tail"] = out.stderr.strip().splitlines()[-40:]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", action="append", help="run only this program (repeatable)")
    p.add_argument("--json", help="also write every run's figures here")
    ns = p.parse_args()
    names = ns.only or list(PROGRAMS)
    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    runs: dict = {(n, v): [] for n in names for v in VARIANTS}
    for r in range(ns.rounds):
        order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
        for n in names:
            for v in order:
                runs[n, v].append(run_once(n, v))
                print(f"round {r + 1}: {n}, {v}: done", file=sys.stderr, flush=True)
    load_after = os.getloadavg()

    rows = []
    for n in names:
        plain = runs[n, "plain"]
        plain_step = statistics.median(x["step_s"] for x in plain)
        plain_cpu = statistics.median(x["step_cpu_s"] for x in plain)
        expert_rss = statistics.median(x["peak_rss"] for x in runs[n, "expert"])
        for v in VARIANTS:
            xs = runs[n, v]
            step = statistics.median(x["step_s"] for x in xs)
            cpu = statistics.median(x["step_cpu_s"] for x in xs)
            rss = statistics.median(x["peak_rss"] for x in xs)
            same = all(x["checksum"] == plain[0]["checksum"] for x in xs)
            if v == "autoopt run":
                row = xs[-1].get("step_row") or {}
                alias = f"{row.get('bytes_saved', 0):,}"
                applied = ", ".join(f"{k} x{c}" for k, c in sorted(row.get("applied", {}).items()))
                applied = applied or "nothing"
            else:
                alias = xs[-1]["alias_bytes"]
                alias = f"{alias:,}" if isinstance(alias, int) else "?"
                applied = "-"
            rows.append(
                [
                    n if v == "plain" else "",
                    v,
                    f"{step * 1e3:.3f}",
                    f"{step / plain_step:.2f}",
                    f"{cpu * 1e3:.3f}",
                    f"{cpu / plain_cpu:.2f}",
                    f"{rss / 2**20:.0f}",
                    f"{rss / expert_rss:.3f}",
                    "-" if v == "plain" else ("bit-identical" if same else "DIFFERENT"),
                    alias,
                    applied,
                ]
            )
    print(
        f"{started}, {ns.rounds} rounds, load average before {load_before[0]:.1f} "
        f"{load_before[1]:.1f}, after {load_after[0]:.1f} {load_after[1]:.1f}"
    )
    print(
        markdown_table(
            [
                "program",
                "variant",
                "ms/step",
                "x plain",
                "CPU ms/step",
                "x plain",
                "peak RSS MiB",
                "x expert",
                "final state",
                "alias bytes (step)",
                "applied (step)",
            ],
            rows,
            "llrrrrrrlrl",
        )
    )
    for n in names:
        row = runs[n, "autoopt run"][-1].get("step_row") or {}
        print(f"\n{n}: autoopt applied per function: {runs[n, 'autoopt run'][-1]['all_applied']}")
        for item in row.get("not_applied", []):
            print(f"  not applied: {item['kind']} {item['what']}: {item['reason'][:160]}")
    if ns.json:
        with open(ns.json, "w") as fh:
            json.dump({f"{n} | {v}": xs for (n, v), xs in runs.items()}, fh, indent=1)


if __name__ == "__main__":
    main()
