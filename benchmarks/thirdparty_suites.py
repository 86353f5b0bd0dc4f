"""A third-party test suite run twice: plain ``pytest``, and ``autoopt run -m pytest``.

Code nobody here wrote is the test of the drop-in: every ``jax.jit`` in the suite and in the
library under test goes through ``autoopt.optimize``, and each test that passes plainly must
pass under autoopt. Prints the pass counts, the tests whose outcome differs (with the first line
of their failure), the fallbacks per pass (from ``autoopt run --report``), and the tests more
than 3x slower (baseline at least 0.1 s: shorter ones are noise on a shared machine).

    python benchmarks/thirdparty_suites.py                       # optax's shipped tests
    python benchmarks/thirdparty_suites.py ~/flax/tests --name flax
    python benchmarks/thirdparty_suites.py ~/equinox/tests --name equinox -- -k "not sharding"
    python benchmarks/thirdparty_suites.py --check optax/_src/transform_test.py ...   # CI
    python benchmarks/thirdparty_suites.py --fresh-wrappers   # jax.jit(f)(x) in a loop

Paths that do not exist are taken relative to the installed optax package (its wheel ships
its tests); flax's and equinox's suites are not in their wheels: pass a checkout's ``tests``
(at the installed release's tag). equinox's tests also need ``beartype``, flax nnx's
``cloudpickle`` (``pip install beartype cloudpickle``).
A suite's own pytest configuration applies (pytest finds it above the paths); the runs start
in an empty folder so that this project's configuration does not. ``--check`` exits 1 when the
two pass sets differ (the CI step).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SLOWER = 3.0
MIN_BASELINE_S = 0.1


def _optax_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("optax")
    if spec is None or spec.origin is None:
        raise SystemExit("optax is not installed: pip install -e '.[corpus]', or pass a suite path")
    return Path(spec.origin).parent


def _resolve(paths: list[str]) -> list[str]:
    if not paths:
        return [str(_optax_dir())]
    out = []
    for p in paths:
        path = Path(p).expanduser()
        if not path.exists():
            path = _optax_dir() / p
        if not path.exists():
            raise SystemExit(f"{p}: no such file or folder (here or under the optax package)")
        out.append(str(path.resolve()))
    return out


def outcomes(junit_xml: Path) -> dict[str, tuple[str, float, str]]:
    """test id -> (outcome, seconds, first line of the failure); a test reported more than
    once (subtests) takes its worst outcome and its total time."""
    result: dict[str, tuple[str, float, str]] = {}
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
    for case in ET.parse(junit_xml).iter("testcase"):
        tid = f"{case.get('classname', '')}::{case.get('name', '')}"
        seconds = float(case.get("time") or 0.0)
        outcome, why = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                why = (child.get("message") or child.text or "").strip().splitlines()
                why = why[0][:200] if why else ""
                break
        old = result.get(tid)
        if old is not None:
            if rank[old[0]] >= rank[outcome]:
                outcome, why = old[0], old[2]
            seconds += old[1]
        result[tid] = (outcome, seconds, why)
    return result


def run_suite(paths: list[str], under_autoopt: bool, extra: list[str], workdir: Path, timeout: int):
    """One pytest run; returns (outcomes, wall seconds, autoopt's report or None, exit status)."""
    tag = "autoopt" if under_autoopt else "plain"
    xml, report = workdir / f"{tag}.xml", workdir / f"{tag}.json"
    pytest = ["-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={xml}", *extra, *paths]
    if under_autoopt:
        cmd = [sys.executable, "-m", "autoopt", "run", "--report", str(report), *pytest]
    else:
        cmd = [sys.executable, *pytest]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    start = time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=workdir, env=env, timeout=timeout, capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - start
    (workdir / f"{tag}.log").write_text(proc.stdout + proc.stderr)
    if not xml.exists():
        tail = (proc.stdout + proc.stderr)[-2000:]
        raise SystemExit(f"{tag} run wrote no results (status {proc.returncode}):\n{tail}")
    data = json.loads(report.read_text()) if report.exists() else None
    return outcomes(xml), wall, data, proc.returncode


def fallbacks_per_pass(report: dict | None) -> dict[str, int]:
    counts: collections.Counter = collections.Counter()
    for fn in (report or {}).get("functions", ()):
        for f in fn["fallbacks"]:
            counts[f["pass"]] += f["count"]
    return dict(counts)


def compare(name: str, plain: dict, auto: dict, walls: tuple[float, float], report) -> dict:
    passed = {t for t, o in plain.items() if o[0] == "passed"}
    passed_auto = {t for t, o in auto.items() if o[0] == "passed"}
    slower = sorted(
        (auto[t][1] / plain[t][1], t)
        for t in passed & passed_auto
        if plain[t][1] >= MIN_BASELINE_S and auto[t][1] > SLOWER * plain[t][1]
    )
    return {
        "suite": name,
        "tests": len(plain),
        "passed_plain": len(passed),
        "passed_autoopt": len(passed_auto),
        "lost": sorted(passed - passed_auto),
        "gained": sorted(passed_auto - passed),
        "fallbacks": fallbacks_per_pass(report),
        "slower": slower,
        "wall_plain_s": round(walls[0], 1),
        "wall_autoopt_s": round(walls[1], 1),
        "functions": len((report or {}).get("functions", ())),
        "applied": dict(
            sum(
                (collections.Counter(f["applied"]) for f in (report or {}).get("functions", ())),
                collections.Counter(),
            )
        ),
    }


def render(r: dict, plain: dict, auto: dict) -> str:
    lines = [
        "| suite | tests | passed (pytest) | passed (autoopt run) | lost | gained | fallbacks per "
        f"pass | >{SLOWER:g}x slower | wall plain / autoopt |",
        "|---|---:|---:|---:|---:|---:|---|---:|---|",
        f"| {r['suite']} | {r['tests']} | {r['passed_plain']} | {r['passed_autoopt']} | "
        f"{len(r['lost'])} | {len(r['gained'])} | "
        f"{', '.join(f'{k} {v}' for k, v in sorted(r['fallbacks'].items())) or '0'} | "
        f"{len(r['slower'])} | {r['wall_plain_s']} s / {r['wall_autoopt_s']} s |",
        "",
        f"jitted functions seen: {r['functions']}; applied: {r['applied'] or 'nothing'}",
    ]
    for label, ids, source in (("lost", r["lost"], auto), ("gained", r["gained"], plain)):
        for t in ids:
            outcome, _, why = source.get(t, ("missing", 0.0, "not run"))
            lines.append(f"- {label}: `{t}`: {outcome}: {why}")
    for ratio, t in r["slower"]:
        lines.append(f"- {ratio:.1f}x slower: `{t}` ({plain[t][1]:.2f} s -> {auto[t][1]:.2f} s)")
    return "\n".join(lines) + "\n"


def fresh_wrappers(rounds: int = 15, n: int = 20) -> str:
    """``n`` wrappers made anew for each call of one new function (``jax.jit(f)(x)`` in a loop,
    as chex, optax's MultiSteps and many user loops do): plain jax.jit, ``autoopt.optimize(f)``
    made anew each time, and jax.jit under ``autoopt.patch()``; one trace and compile per round
    is what jax.jit pays."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import jax
    import jax.numpy as jnp
    from _harness import interleave, markdown_table

    import autoopt

    x = jnp.ones(64)

    def new_function():
        def f(v):
            return jnp.tanh(v) * 2.0 + 1.0

        return f

    def loop(make):
        def go(f):
            for _ in range(n):
                out = make(f)(x)
            jax.block_until_ready(out)

        return go

    # The patch is held for the whole measurement (installing it scans every module); the
    # plain variant reaches the real jax.jit through a local name, which the patch leaves alone.
    real_jit = jax.jit
    names = ("jax.jit", "autoopt.optimize", "jax.jit under autoopt.patch()")
    with autoopt.patch():
        patched_jit = jax.jit
        t = interleave(
            dict(zip(names, (loop(real_jit), loop(autoopt.optimize), loop(patched_jit)))),
            rounds,
            prepare=dict.fromkeys(names, new_function),
        )
    base = t.median("jax.jit")
    rows = [(name, f"{t.median(name):.4f}", f"{t.median(name) / base:.2f}") for name in t]
    return markdown_table(
        [f"{n} fresh wrappers of a new function", "s (median)", "vs jax.jit"], rows
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="*", help="test files or folders (default: all of optax's)")
    p.add_argument("--name", default="optax", help="the suite's name in the table")
    p.add_argument("--check", action="store_true", help="exit 1 when the pass sets differ")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per pytest run")
    p.add_argument("--keep", metavar="DIR", help="keep the junit XML, logs and report here")
    p.add_argument("--fresh-wrappers", action="store_true", help="time jax.jit(f)(x) in a loop")
    p.add_argument(
        "--parallel",
        action="store_true",
        help="run the two pytest runs at once (each is mostly one core; wall times then share "
        "the machine, so the >3x column is only comparable between the two runs)",
    )
    ns = p.parse_args(argv)
    if ns.fresh_wrappers:
        print(fresh_wrappers())
        return 0
    paths = _resolve(ns.paths)
    with tempfile.TemporaryDirectory(prefix="autoopt-suite-") as tmp:
        workdir = Path(ns.keep or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        if ns.parallel:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(2) as pool:
                runs = [
                    pool.submit(run_suite, paths, auto, extra, workdir, ns.timeout)
                    for auto in (False, True)
                ]
                (plain, wall_plain, _, _), (auto, wall_auto, report, _) = (r.result() for r in runs)
        else:
            plain, wall_plain, _, _ = run_suite(paths, False, extra, workdir, ns.timeout)
            auto, wall_auto, report, _ = run_suite(paths, True, extra, workdir, ns.timeout)
        result = compare(ns.name, plain, auto, (wall_plain, wall_auto), report)
        sys.stdout.write(render(result, plain, auto))
        (workdir / "comparison.json").write_text(json.dumps(result, indent=1))
    if ns.check and (result["lost"] or result["gained"]):
        print(
            f"FAILED: the pass sets differ ({len(result['lost'])} lost, "
            f"{len(result['gained'])} gained under autoopt run); see the list above",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
