"""Dispatch and first-call overhead of autoopt.optimize against jax.jit.

Targets (issue 2): cached-call dispatch on a tiny function within 1.3x of jax.jit; first call
(trace + passes + compile) within 1.5x of jax.jit's first call. Interleaved in one process,
medians reported; quote the ratios (the machine is shared and noisy).

    python benchmarks/overhead.py [--rounds 15] [--quick]
    python benchmarks/overhead.py --issue30   # issue 30's table (rows from in_place.py and
                                              # host_feed.py too) and the per-check profile
    python benchmarks/overhead.py --dispatch-only  # the two cached-call rows, C path and Python

Where the C call path (``autoopt/_jit/_native.c``) is on, the cached-call rows and the profile
also run the same function through the Python call path, interleaved (``python_path``).
"""

from __future__ import annotations

import argparse
import linecache
import time

import jax
import jax.numpy as jnp
from _harness import interleave

import autoopt


def _calls(f, x, n: int):
    """``n + 1`` calls of ``y = f(x)``, blocking on the last."""

    def go():
        for _ in range(n):
            f(x)
        jax.block_until_ready(f(x))

    return go


def _rebinding(f, make_x, n: int):
    """``n`` calls of ``x = f(x)`` (the argument is dead after each call, so it can be donated)."""

    def go(x):
        for _ in range(n):
            x = f(x)
        jax.block_until_ready(x)

    return go, make_x


# A script's loop: ``x = f(x)`` at a module's top level, where ``x`` is a global (run by
# ``exec`` in a namespace of its own, as ``python script.py`` runs the script's body; its source
# registered with ``linecache``, where a script's is read from its file).
_SCRIPT_SOURCE = "for _ in range(n):\n    x = f(x)\nblock_until_ready(x)\n"
_SCRIPT_FILE = "<overhead.py: a script's loop>"
linecache.cache[_SCRIPT_FILE] = (
    len(_SCRIPT_SOURCE),
    None,
    _SCRIPT_SOURCE.splitlines(True),
    _SCRIPT_FILE,
)
_SCRIPT_LOOP = compile(_SCRIPT_SOURCE, _SCRIPT_FILE, "exec")
# The same loop with no source to read (``exec``'d text, a module without its ``.py``): its
# call site cannot be proven, so it donates nothing.
_SOURCELESS_LOOP = compile(_SCRIPT_SOURCE, "<overhead.py: no source>", "exec")


def _script_rebinding(f, make_x, n: int, code=_SCRIPT_LOOP):
    """``n`` calls of ``x = f(x)`` at a module's top level (the state a global)."""

    def go(x):
        namespace = {"f": f, "x": x, "n": n, "block_until_ready": jax.block_until_ready}
        del x  # (the namespace holds the state alone, as a script's globals do)
        exec(code, namespace)

    return go, make_x


def _rebinding_flag(f, make_x, n: int):
    """``n`` calls of ``x = f(x, training=True)``: a static flag passed by keyword, as a
    training step takes it (``static_argnames``)."""

    def go(x):
        for _ in range(n):
            x = f(x, training=True)
        jax.block_until_ready(x)

    return go, make_x


def python_path(f):
    """``f`` (an ``OptimizedFunction``) taking the pure-Python call path, sharing its caches, or
    None when the C call path is off (``AUTOOPT_NATIVE=0``, or not built): so both paths are
    measured interleaved in one process. Its class defines ``__call__`` as the Python path's
    ``_call``, as ``OptimizedFunction`` itself does without the C path."""
    from autoopt._jit import _function

    if not _function.NATIVE:
        return None

    class PythonPath(type(f)):
        __call__ = _function.OptimizedFunction._call

    g = f._fresh()  # noqa: SLF001 - a benchmark of internals
    g.__class__ = PythonPath
    return g


def dispatch(rounds: int, n: int) -> dict[str, float]:
    def tiny(x):
        return x + 1.0

    def sim(s):  # a simulation step on a small pytree state, as samplers and integrators have
        return {"x": s["x"] + 0.1 * s["v"], "v": s["v"] * 0.99, "t": s["t"] + 0.1}

    jitted = jax.jit(tiny)

    def tiny_x(x):  # ``tiny`` again, for the rebinding rows
        return x + 1.0

    # Two functions: a signature's first call fixes its executable (one per signature, shared
    # by every ``optimize`` of one function), so ``fast(x)`` with ``x`` kept would leave the
    # rebinding rows running the plain executable, donating nothing (what a program that calls
    # ``f(x)`` once before its loop gets: README, limits).
    fast, fast_x = autoopt.optimize(tiny), autoopt.optimize(tiny_x)
    expert_donating = jax.jit(tiny_x, donate_argnums=0)
    sim_expert, sim_fast = jax.jit(sim, donate_argnums=0), autoopt.optimize(sim)

    def flagged(x, training=False):
        return x + 1.0 if training else x

    flag_expert = jax.jit(flagged, donate_argnums=0, static_argnames="training")
    flag_fast = autoopt.optimize(flagged, static_argnames="training")

    def state():
        return {"x": jnp.zeros(8), "v": jnp.ones(8), "t": jnp.zeros(())}

    def ones():
        return jnp.ones(8)

    x = jnp.ones(8)
    for f in (jitted, fast):
        f(x)
    y = expert_donating(jnp.ones(8))
    y = fast_x(y)
    runs, prepare = {}, {}
    runs["jit"] = _calls(jitted, x, n)
    runs["autoopt"] = _calls(fast, x, n)
    rebinding = [
        ("jit donate", expert_donating, ones),
        ("autoopt x=f(x)", fast_x, ones),
        ("jit donate tree", sim_expert, state),
        ("autoopt tree", sim_fast, state),
    ]
    slow, slow_x = python_path(fast), python_path(fast_x)
    if slow is not None and slow_x is not None:  # the same calls through the Python path
        slow(x)
        runs["autoopt (python path)"] = _calls(slow, x, n)
        rebinding.append(("autoopt x=f(x) (python path)", slow_x, ones))
    for name, f, make in rebinding:
        runs[name], prepare[name] = _rebinding(f, make, n)
    for name, f, make in (
        ("jit donate, script", expert_donating, ones),
        ("autoopt x=f(x), script", fast_x, ones),
        ("jit donate tree, script", sim_expert, state),
        ("autoopt tree, script", sim_fast, state),
    ):
        runs[name], prepare[name] = _script_rebinding(f, make, n)
    # A site that donates nothing, on the executable ``fast_x``'s rebinding calls made donate:
    # each call passes a device copy until the site's calls have copied for ten compiles' time,
    # then it runs the plain executable (``_dispatch._copies_paid_for``): run until then.
    go, _ = _script_rebinding(fast_x, ones, n, _SOURCELESS_LOOP)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 2.0:
        go(ones())
    runs["autoopt x=f(x), no source"], prepare["autoopt x=f(x), no source"] = go, ones
    for name, f in (("jit donate flag", flag_expert), ("autoopt flag", flag_fast)):
        runs[name], prepare[name] = _rebinding_flag(f, ones, n)
    # Per call: n + 1 calls for y = f(x), n for x = f(x).
    times = interleave(runs, rounds, warmup=0, prepare=prepare)
    med = times.medians()
    once = ("jit", "autoopt", "autoopt (python path)")
    return {k: v / (n + 1 if k in once else n) for k, v in med.items()}


def check_profile(rounds: int, n: int) -> dict[str, float]:
    """Per-call cost of each check of ``x = f(x)``'s cached plan (issue 30), as staged loops:
    each stage is a wrapper around ``jax.jit(tiny, donate_argnums=0)`` doing what the previous
    did plus one more of the real path's steps, with autoopt's own objects (the call site's
    proof check and the signature's plan, read from the optimized function's caches: a profile
    of internals, not an API). The differences between stages are the checks' costs."""
    import sys

    from autoopt import _compat
    from autoopt._jit._plans import MISS

    def tiny(x):
        return x + 1.0

    def ones():
        return jnp.ones(8)

    expert = jax.jit(tiny, donate_argnums=0)
    fast = autoopt.optimize(tiny)
    go, _ = _rebinding(fast, ones, 3)
    go(ones())  # proves the loop's call site (every stage's loop runs the same code) and plans
    sites = fast._caches.sites  # noqa: SLF001 - a profile of internals
    site = next(s for s in sites.values() if s.donates and s.proof.code is go.__code__)
    check = site.proof.check  # reads the loop's frame: only ever called from that loop
    ((key, plan),) = site.plans.items()
    clean = _compat.trace_state_clean
    array = _compat.ARRAY_IMPL

    # Each stage is an instance with ``__call__``, as ``OptimizedFunction`` is: the call enters
    # the same way (and from the same instruction offset, which keys the call site). A stage
    # repeats the one before it inline instead of calling it or a shared helper: that call's own
    # cost would land in every later stage and in the differences.
    class Call:
        def __call__(self, *args, **kwargs):
            return expert(*args, **kwargs)

    class Trace:
        def __call__(self, *args, **kwargs):
            if clean():
                return expert(*args, **kwargs)

    class Site:
        def __call__(self, *args, **kwargs):
            if clean():
                frame = sys._getframe(1)
                s = sites.get((id(frame.f_code), frame.f_lasti))
                del frame
                if s is site:
                    return expert(*args, **kwargs)

    class Check:
        def __call__(self, *args, **kwargs):
            if clean():
                frame = sys._getframe(1)
                sites.get((id(frame.f_code), frame.f_lasti))
                ok = check(frame, self, args, kwargs)
                del frame
                if ok:
                    return expert(*args, **kwargs)

    class Lookup:
        def __call__(self, *args, **kwargs):
            if clean():
                frame = sys._getframe(1)
                sites.get((id(frame.f_code), frame.f_lasti))
                ok = check(frame, self, args, kwargs)
                del frame
                p = site.plans.get(tuple([a.aval if type(a) is array else type(a) for a in args]))
                if ok and p is not None:
                    return expert(*args, **kwargs)

    class Plan:
        def __call__(self, *args, **kwargs):
            if clean():
                frame = sys._getframe(1)
                sites.get((id(frame.f_code), frame.f_lasti))
                ok = check(frame, self, args, kwargs)
                del frame
                p = site.plans.get(tuple([a.aval if type(a) is array else type(a) for a in args]))
                if ok and p is not None:
                    out = p(args)
                    if out is not MISS:
                        return out

    stages = {
        "jax.jit(donate_argnums=0)": expert,
        "+ a Python call (*args, **kwargs)": Call(),
        "+ outside any transformation?": Trace(),
        "+ the call site (frame, dict)": Site(),
        "+ the proof's check (callee, names)": Check(),
        "+ the signature's plan looked up": Lookup(),
        "+ the plan's checks (references, deleted, nans)": Plan(),
        "autoopt.optimize": fast,
    }
    slow = python_path(fast)
    if slow is not None:  # the C call path is on: ``fast`` takes it; this is the Python path's
        stages = {
            **{k: v for k, v in stages.items() if k != "autoopt.optimize"},
            "autoopt.optimize, Python call path": slow,
            "autoopt.optimize, C call path": fast,
        }
    runs, prepare = {}, {}
    for name, f in stages.items():
        runs[name], prepare[name] = _rebinding(f, ones, n)
    times = interleave(runs, rounds, warmup=1, prepare=prepare)
    return {k: v / n for k, v in times.medians().items()}


def _big_state(leaves: int):
    """A state of ``leaves`` small arrays (an optimizer state, a simulation's fields)."""
    return lambda: {f"p{i:03d}": jnp.full(8, float(i)) for i in range(leaves)}


def _decay(s):
    return jax.tree_util.tree_map(lambda a: a * 0.99, s)


def big_trees(rounds: int, n: int, sizes=(64, 512)) -> dict[str, float]:
    """``s = f(s)`` on a dict of ``size`` leaves: autoopt (donated under "safe") against
    ``jax.jit(donate_argnums=0)``. And the cost of a call that must not donate: ``f(s)`` with
    ``s`` kept, on the executable that donates (device copies of ``s`` are donated instead)
    against plain jax.jit, which copies nothing."""
    runs, prepare = {}, {}
    for size in sizes:
        make = _big_state(size)
        expert, fast, plain = (
            jax.jit(_decay, donate_argnums=0),
            autoopt.optimize(_decay),
            jax.jit(_decay),
        )
        s = make()
        s = fast(s)  # decides the executable: it donates s
        s = expert(make())
        kept = make()
        plain(kept)
        for name, f in ((f"jit donate {size}", expert), (f"autoopt {size}", fast)):
            runs[name], prepare[name] = _rebinding(f, make, n)
        runs[f"jit kept {size}"] = _calls(plain, kept, n)
        runs[f"autoopt kept {size}"] = _calls(fast, kept, n)
    times = interleave(runs, rounds, warmup=1, prepare=prepare)
    med = times.medians()
    return {k: v / (n + 1 if "kept" in k else n) for k, v in med.items()}


def _mlp_step(depth: int):
    def step(params, x):
        def loss(params):
            h = x
            for w in params:
                h = jnp.tanh(h @ w)
            return jnp.mean(h**2)

        g = jax.grad(loss)(params)
        return [w - 0.01 * gw for w, gw in zip(params, g)]

    return step


def first_call(rounds: int) -> dict[str, dict[str, float]]:
    """Time of the first call of a fresh function (trace + passes + compile + run)."""
    out = {}
    workloads = {
        "tiny": (lambda: lambda x: x * 2.0 + 1.0, lambda: (jnp.ones(8),)),
        "mlp8 step": (
            lambda: _mlp_step(8),
            lambda: ([jnp.ones((64, 64)) * 0.01 for _ in range(8)], jnp.ones((32, 64))),
        ),
    }
    for name, (make_fn, make_args) in workloads.items():
        args = make_args()

        def first(f, args=args):
            jax.block_until_ready(f(*args))

        # A fresh function object each call, wrapped before the clock starts: no cache hits.
        prepare = {
            "jit": lambda make_fn=make_fn: jax.jit(make_fn()),
            "autoopt": lambda make_fn=make_fn: autoopt.optimize(make_fn(), donate="off"),
        }
        times = interleave({"jit": first, "autoopt": first}, rounds, warmup=0, prepare=prepare)
        out[name] = times.medians()
    return out


def issue_table(rounds: int, calls: int) -> None:
    """Every row of issue 30's table, with its target: the cached-call rows here, the in-place
    rows from ``in_place.py``, the host-feed row from ``host_feed.py`` (the same workloads and
    harness those scripts print in full)."""
    import host_feed
    import in_place

    d = dispatch(rounds, calls)
    b = big_trees(rounds, max(20, calls // 20), sizes=(64,))
    rows = in_place.run(rounds, 4096, 1024, only=("row set", "64-row block", "8-row window"))
    ip = {name.split(" `")[0]: (naive, auto, expert) for name, naive, auto, _, expert, _ in rows}
    feats = host_feed.many_leaves(rounds, 200).medians()
    bound = host_feed.many_leaves(rounds, 200, step=host_feed.feed_bound_step).medians()
    native = "autoopt (python path)" in d
    table = [
        ("`y = f(x)`, tiny function, vs jax.jit", d["autoopt"] / d["jit"], "<= 1.1x"),
        (
            "`x = f(x)` donated, vs `jax.jit(donate_argnums=0)`",
            d["autoopt x=f(x)"] / d["jit donate"],
            "<= 1.1x",
        ),
        (
            "`x = f(x)` donated at a script's top level, vs jit donate (not in the issue)",
            d["autoopt x=f(x), script"] / d["jit donate, script"],
            "",
        ),
        (
            "3-leaf dict state donated, in a function / at a script's top level (not in the issue)",
            (
                d["autoopt tree"] / d["jit donate tree"],
                d["autoopt tree, script"] / d["jit donate tree, script"],
            ),
            "",
        ),
        (
            "`x = f(x, training=True)`, a static flag, donated, vs jit donate (not in the issue)",
            d["autoopt flag"] / d["jit donate flag"],
            "(Python path)",
        ),
        (
            "64-leaf dict state, donated, vs jit with donate_argnums",
            b["autoopt 64"] / b["jit donate 64"],
            "<= 1.05x",
        ),
        (
            "row update f32[4096,4096] in a Python loop, vs the expert's donated DUS",
            ip["row set"][1] / ip["row set"][2],
            "<= 1.15x",
        ),
        (
            "64-row block, donated, vs the naive `.at` under donating jit (speed-up)",
            ip["64-row block"][0] / ip["64-row block"][1],
            ">= 1.0x",
        ),
        ("64-row block, vs the expert", ip["64-row block"][1] / ip["64-row block"][2], "<= 1.15x"),
        ("8-row window vs the expert", ip["8-row window"][1] / ip["8-row window"][2], "<= 1.15x"),
        (
            "64 NumPy leaves, placement='auto', vs jax.jit (speed-up), per-feature step",
            feats["naive"] / feats["autoopt"],
            ">= 1.0x",
        ),
        (
            "64 NumPy leaves, placement='auto', vs jax.jit (speed-up), feed-bound step",
            bound["naive"] / bound["autoopt"],
            ">= 1.0x (>= 1.5x where packing wins)",
        ),
    ]
    if native:  # the first two rows again, through the Python call path
        table[2:2] = [
            (
                "`y = f(x)` vs jax.jit, Python call path",
                d["autoopt (python path)"] / d["jit"],
                "(C path off)",
            ),
            (
                "`x = f(x)` donated vs jit donate, Python call path",
                d["autoopt x=f(x) (python path)"] / d["jit donate"],
                "(C path off)",
            ),
        ]
    path = "C call path on" if native else "Python call path only"
    head = f"issue 30's rows ({rounds} interleaved rounds, medians; {path})"
    print(f"\n| {head} | measured | target |")
    print("|---|---:|---|")
    for name, ratio, target in table:
        shown = (
            " / ".join(f"{r:.2f}x" for r in ratio) if isinstance(ratio, tuple) else f"{ratio:.2f}x"
        )
        print(f"| {name} | {shown} | {target} |")


def print_profile(rounds: int, calls: int) -> None:
    prof = check_profile(rounds, calls)
    print("| `x = f(x)`, tiny f32[8]: the cached plan's steps, staged | us/call | step |")
    print("|---|---:|---:|")
    last = None
    for name, t in prof.items():
        step = "" if last is None else f"{(t - last) * 1e6:+.2f}"
        print(f"| {name} | {t * 1e6:.2f} | {step} |")
        last = t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--quick", action="store_true", help="3 rounds of 200 calls (a smoke run)")
    p.add_argument("--trees-only", action="store_true", help="only the 64/512-leaf states")
    p.add_argument("--profile", action="store_true", help="only the per-check profile")
    p.add_argument("--issue30", action="store_true", help="only issue 30's table and profile")
    p.add_argument("--dispatch-only", action="store_true", help="only the cached-call rows")
    a = p.parse_args()
    if a.quick:
        a.rounds, a.calls = 3, 200
    if a.dispatch_only:
        d = dispatch(a.rounds, a.calls)
        for k, v in d.items():
            print(f"{k}: {v * 1e6:.2f} us")
        print(f"y = f(x) vs jit: {d['autoopt'] / d['jit']:.2f}x")
        print(f"x = f(x) vs jit donate: {d['autoopt x=f(x)'] / d['jit donate']:.2f}x")
        print(
            "x = f(x) at a script's top level vs jit donate: "
            f"{d['autoopt x=f(x), script'] / d['jit donate, script']:.2f}x"
        )
        print(
            "x = f(x) in code without source (donates nothing) vs jit donate: "
            f"{d['autoopt x=f(x), no source'] / d['jit donate, script']:.2f}x"
        )
        print(
            "3-leaf dict state vs jit donate, in a function / at a script's top level: "
            f"{d['autoopt tree'] / d['jit donate tree']:.2f}x / "
            f"{d['autoopt tree, script'] / d['jit donate tree, script']:.2f}x"
        )
        print(
            "x = f(x, training=True) vs jit donate: "
            f"{d['autoopt flag'] / d['jit donate flag']:.2f}x"
        )
        if "autoopt (python path)" in d:
            print(f"python path y = f(x) vs jit: {d['autoopt (python path)'] / d['jit']:.2f}x")
            print(
                "python path x = f(x) vs jit donate: "
                f"{d['autoopt x=f(x) (python path)'] / d['jit donate']:.2f}x"
            )
        return
    if a.issue30:
        issue_table(a.rounds, a.calls)
        print()
        print_profile(a.rounds, a.calls)
        return
    if a.profile:
        print_profile(a.rounds, a.calls)
        return
    if a.trees_only:
        b = big_trees(a.rounds, max(20, a.calls // 20))
        for k, v in b.items():
            print(f"{k}: {v * 1e6:.1f} us")
        return
    d = dispatch(a.rounds, a.calls)
    print(
        f"jax {jax.__version__}, backend {jax.default_backend()}, {a.rounds} interleaved rounds "
        f"of {a.calls} calls; medians\n"
    )
    print("| cached call (tiny f32[8] function) | us/call | ratio vs jax.jit |")
    print("|---|---:|---:|")
    print(f"| jax.jit | {d['jit'] * 1e6:.2f} | 1.00 |")
    print(
        f"| autoopt.optimize (`y = f(x)`, nothing donated) | {d['autoopt'] * 1e6:.2f} | "
        f"{d['autoopt'] / d['jit']:.2f} |"
    )
    print(
        f"| jax.jit(donate_argnums=0), `x = f(x)` | {d['jit donate'] * 1e6:.2f} | "
        f"{d['jit donate'] / d['jit']:.2f} |"
    )
    print(
        f"| autoopt.optimize, `x = f(x)` (donated) | {d['autoopt x=f(x)'] * 1e6:.2f} | "
        f"{d['autoopt x=f(x)'] / d['jit donate']:.2f} vs jit donate |"
    )
    print(
        f"| jax.jit(donate_argnums=0), `s = f(s)`, dict of 3 arrays | "
        f"{d['jit donate tree'] * 1e6:.2f} | {d['jit donate tree'] / d['jit']:.2f} |"
    )
    print(
        f"| autoopt.optimize, `s = f(s)`, dict of 3 arrays (donated) | "
        f"{d['autoopt tree'] * 1e6:.2f} | {d['autoopt tree'] / d['jit donate tree']:.2f} vs "
        "jit donate |"
    )
    print(
        f"| jax.jit(donate_argnums=0, static_argnames), `x = f(x, training=True)` | "
        f"{d['jit donate flag'] * 1e6:.2f} | {d['jit donate flag'] / d['jit']:.2f} |"
    )
    print(
        f"| autoopt.optimize(static_argnames), `x = f(x, training=True)` (donated) | "
        f"{d['autoopt flag'] * 1e6:.2f} | {d['autoopt flag'] / d['jit donate flag']:.2f} vs "
        "jit donate |"
    )
    b = big_trees(a.rounds, max(20, a.calls // 20))
    print("\n| cached call, state of N leaves (f32[8] each) | us/call | ratio |")
    print("|---|---:|---:|")
    for size in (64, 512):
        jd, ao = b[f"jit donate {size}"], b[f"autoopt {size}"]
        jk, ak = b[f"jit kept {size}"], b[f"autoopt kept {size}"]
        print(f"| N={size}: jax.jit(donate_argnums=0), `s = f(s)` | {jd * 1e6:.1f} | 1.00 |")
        print(f"| N={size}: autoopt, `s = f(s)` (donated) | {ao * 1e6:.1f} | {ao / jd:.2f} |")
        print(f"| N={size}: jax.jit, `f(s)`, s kept | {jk * 1e6:.1f} | 1.00 |")
        print(
            f"| N={size}: autoopt, `f(s)`, s kept (copies donated) | {ak * 1e6:.1f} | "
            f"{ak / jk:.2f} vs jax.jit |"
        )
    print()
    print_profile(a.rounds, a.calls)
    fc = first_call(max(3, a.rounds // 3))
    print("\n| first call (trace + passes + compile + run) | jax.jit ms | autoopt ms | ratio |")
    print("|---|---:|---:|---:|")
    for name, r in fc.items():
        print(
            f"| {name} | {r['jit'] * 1e3:.1f} | {r['autoopt'] * 1e3:.1f} | "
            f"{r['autoopt'] / r['jit']:.2f} |"
        )


if __name__ == "__main__":
    main()
