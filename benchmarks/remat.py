"""Remat benchmark: memory and step time of a training step under each way of choosing what the
backward recomputes.

Configurations: plain ``jax.jit``; ``jax.checkpoint`` on every layer (naive); the best of JAX's
built-in policies (each applied per layer, the lowest compiled peak wins); the expert version
(``scan`` over checkpointed segments of sqrt(L) layers, stacked parameters); ``autoopt.optimize``
with ``remat="auto"`` (the planner, opt-in since the default became ``"fit"``, which plans only
at a call that does not fit, and this benchmark compiles ahead of time); and the same under a
sweep of memory budgets (fractions of the plain program's peak). Workloads: a 16-layer tanh MLP
and a stack of transformer blocks (attention + MLP, residual connections), both as
``value_and_grad`` training steps.

Each configuration runs in its own fresh process (``--one``), which reports the compiled
figures (``memory_analysis()``: temp bytes and argument+output+temp-alias peak; FLOPs from
``cost_analysis()``), the peak RSS while the steps run (``VmHWM`` reset after compiling, so
compile-time memory is not counted; the inputs are), and the median step time.

    python benchmarks/remat.py            # full run: writes results/remat.md and remat_sweep.png
    python benchmarks/remat.py --quick    # a smoke test: the smaller MLP, one policy, one
                                          # budget (writes nothing)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

from _harness import flops, interleave, memory, rss_now, rss_peak, rss_reset, run_fresh

HERE = os.path.dirname(os.path.abspath(__file__))
BUDGETS = (0.9, 0.75, 0.6, 0.5, 0.4, 0.3)
POLICIES = ("dots_saveable", "dots_with_no_batch_dims_saveable", "nothing_saveable")


# --- workloads (imported lazily: the parent process never touches jax) --------------------------


def _mlp(quick: bool):
    import jax
    import jax.numpy as jnp

    layers, n, d = 16, (2048 if quick else 8192), 256

    def layer(h, w):
        return jnp.tanh(h @ w)

    def params():
        k = jax.random.split(jax.random.key(0), layers + 1)
        ws = [jax.random.normal(k[i], (d, d)) / math.sqrt(d) for i in range(layers)]
        return ws, jax.random.normal(k[-1], (n, d))

    def head(h):
        return jnp.mean(h**2)

    return dict(
        name=f"mlp L={layers} N={n} D={d}", layers=layers, layer=layer, params=params, head=head
    )


def _transformer(quick: bool):
    import jax
    import jax.numpy as jnp

    layers, b, s, d, heads = 6, (4 if quick else 8), 128, 256, 4

    def ln(x):
        m = x.mean(-1, keepdims=True)
        return (x - m) * jax.lax.rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5)

    def layer(x, p):
        wqkv, wo, w1, w2 = p
        h = ln(x)
        q, k, v = jnp.split(h @ wqkv, 3, axis=-1)
        q, k, v = (t.reshape(b, s, heads, d // heads) for t in (q, k, v))
        att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // heads), axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, d)
        x = x + o @ wo
        return x + jax.nn.gelu(ln(x) @ w1) @ w2

    def params():
        k = jax.random.split(jax.random.key(0), 4 * layers + 1)
        ps = [
            (
                jax.random.normal(k[4 * i], (d, 3 * d)) / math.sqrt(d),
                jax.random.normal(k[4 * i + 1], (d, d)) / math.sqrt(d),
                jax.random.normal(k[4 * i + 2], (d, 4 * d)) / math.sqrt(d),
                jax.random.normal(k[4 * i + 3], (4 * d, d)) / math.sqrt(4 * d),
            )
            for i in range(layers)
        ]
        return ps, jax.random.normal(k[-1], (b, s, d))

    def head(x):
        return jnp.mean(x**2)

    return dict(
        name=f"transformer L={layers} B={b} S={s} D={d} H={heads}",
        layers=layers,
        layer=layer,
        params=params,
        head=head,
    )


WORKLOADS = {"mlp": _mlp, "transformer": _transformer}


def _build(workload: dict, config: str):
    """``(step, args, note)`` for one configuration."""
    import jax
    import jax.numpy as jnp

    import autoopt

    layer, head, layers = workload["layer"], workload["head"], workload["layers"]
    ps, x = workload["params"]()

    def loss_unrolled(ps, x, wrap=lambda f: f):
        for p in ps:
            x = wrap(layer)(x, p)
        return head(x)

    def step_of(loss):
        return lambda ps, x: jax.value_and_grad(loss)(ps, x)

    if config == "plain":
        return jax.jit(step_of(loss_unrolled)), (ps, x), ""
    if config == "naive":
        return jax.jit(step_of(lambda ps, x: loss_unrolled(ps, x, jax.checkpoint))), (ps, x), ""
    if config.startswith("policy:"):
        pol = getattr(jax.checkpoint_policies, config.split(":", 1)[1])
        wrap = lambda f: jax.checkpoint(f, policy=pol)  # noqa: E731
        return jax.jit(step_of(lambda ps, x: loss_unrolled(ps, x, wrap))), (ps, x), ""
    if config == "expert":
        seg = max(1, round(math.sqrt(layers)))
        while layers % seg:
            seg -= 1
        stacked = jax.tree_util.tree_map(
            lambda *a: jnp.stack(a).reshape((layers // seg, seg) + a[0].shape), *ps
        )

        @jax.checkpoint
        def segment(x, pseg):
            for i in range(seg):
                x = layer(x, jax.tree_util.tree_map(lambda a, i=i: a[i], pseg))
            return x

        def loss(stacked, x):
            x, _ = jax.lax.scan(lambda x, p: (segment(x, p), None), x, stacked)
            return head(x)

        return (
            jax.jit(step_of(loss)),
            (stacked, x),
            f"scan over {layers // seg} checkpointed segments of {seg}",
        )
    if config == "autoopt":
        return autoopt.optimize(step_of(loss_unrolled), remat="auto"), (ps, x), ""
    if config == "autoopt+flag":  # the user opts in to the XLA:CPU flag remat plans need
        from autoopt.passes.remat import CPU_FLAGS

        return (
            autoopt.optimize(step_of(loss_unrolled), remat="auto", compiler_options=CPU_FLAGS),
            (ps, x),
            "",
        )
    if config.startswith("budget:"):
        budget = int(config.split(":")[1])
        return (
            autoopt.optimize(step_of(loss_unrolled), remat="auto", memory_budget=budget),
            (ps, x),
            "",
        )
    raise ValueError(config)


def run_one(workload: str, config: str, quick: bool, steps: int) -> dict:
    import jax

    wl = WORKLOADS[workload](quick)
    step, args, note = _build(wl, config)
    t0 = time.perf_counter()
    compiled = step.lower(*args).compile()  # autoopt: trace, passes (their compiles), compile
    first_call = time.perf_counter() - t0
    m = memory(compiled)
    # The RSS high-water mark from just before the first execution: compile-time memory is not
    # counted, every buffer the executions allocate is.
    rss_reset()
    base_rss = rss_now()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t)
    rss = rss_peak() - base_rss
    if config in ("autoopt", "autoopt+flag") or config.startswith("budget:"):
        import autoopt
        from autoopt.passes.remat import CPU_FLAGS

        opts: dict = {"remat": "auto"}
        if config.startswith("budget:"):
            opts["memory_budget"] = int(config.split(":")[1])
        if config == "autoopt+flag":
            opts["compiler_options"] = CPU_FLAGS
        fs = autoopt.explain(step.__wrapped__, *args, **opts).by_kind("remat")
        note = (
            "; ".join(f.message.split(" [")[0] if f.applied else "not applied" for f in fs)
            or "no finding"
        )
    return dict(
        workload=wl["name"],
        config=config,
        note=note,
        temp=m["temp"],
        peak=m["peak"],
        flops=flops(compiled),
        rss=int(rss),
        time=statistics.median(times),
        first_call=first_call,
    )


def time_all(workload: str, configs: list[str], quick: bool, rounds: int) -> dict:
    """Median step time of every configuration, interleaved round by round in one process, so
    that load from other jobs on the machine falls on all of them alike."""
    import jax

    wl = WORKLOADS[workload](quick)
    built = {c: _build(wl, c)[:2] for c in configs}

    def stepping(c):
        step, args = built[c]
        return lambda: jax.block_until_ready(step(*args))

    return interleave({c: stepping(c) for c in configs}, rounds).medians()


def _spawn(workload: str, config: str, quick: bool, steps: int, mode: str = "--one") -> dict:
    """One configuration (or, with ``--time``, the step times of several) in a fresh process."""
    return run_fresh(
        __file__, mode, workload, config, "--steps", str(steps), *(["--quick"] if quick else [])
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", nargs=2, metavar=("WORKLOAD", "CONFIG"))
    ap.add_argument("--time", nargs=2, metavar=("WORKLOAD", "CONFIGS"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--workloads", default=None, help="default: mlp,transformer (quick: mlp)")
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_one(a.one[0], a.one[1], a.quick, a.steps)))
        return
    if a.time:
        print(json.dumps(time_all(a.time[0], a.time[1].split(","), a.quick, a.steps)))
        return
    rows: list[dict] = []
    workloads = a.workloads or ("mlp" if a.quick else "mlp,transformer")
    policies, budgets = (POLICIES[:1], (0.5,)) if a.quick else (POLICIES, BUDGETS)
    for wl in workloads.split(","):
        plain = _spawn(wl, "plain", a.quick, a.steps)
        rows.append(plain)
        for config in ("naive", "expert", "autoopt", "autoopt+flag"):
            rows.append(_spawn(wl, config, a.quick, a.steps))
            print(_fmt_row(rows[-1], plain), flush=True)
        pols = [_spawn(wl, f"policy:{p}", a.quick, a.steps) for p in policies]
        best = min(pols, key=lambda r: (r["peak"], r["time"]))
        best["note"] = f"best of {', '.join(policies)}"
        rows.append(best)
        for frac in budgets:
            r = _spawn(wl, f"budget:{int(frac * plain['peak'])}", a.quick, a.steps)
            r["note"] = f"budget {frac:.0%} of plain; " + r["note"]
            rows.append(r)
            print(_fmt_row(r, plain), flush=True)
        mine = [r for r in rows if r["workload"] == plain["workload"]]
        times = _spawn(wl, ",".join(r["config"] for r in mine), a.quick, 2 * a.steps, "--time")
        for r in mine:
            r["time_own_process"] = r["time"]
            r["time"] = times[r["config"]]
    table = _table(rows)
    print(table)
    if a.quick:  # a smoke run: the recorded results stay those of the full sizes
        return
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    cmd = "python benchmarks/remat.py" + (" --quick" if a.quick else "")
    with open(os.path.join(HERE, "results", "remat.md"), "w") as f:
        f.write("# remat benchmark\n\n")
        f.write(
            f"Command: `{cmd}` (XLA:CPU, jax {_jax_version()}), on the project's 2-core "
            "machine: step times are noisy, quote the ratios; the memory figures are "
            "deterministic. Memory: compiled `memory_analysis()` (peak = argument + output + "
            "temp - alias) and the peak RSS growth while the steps run, each configuration "
            "in its own process. MLP N scaled from the issue's 32768 to 8192 to keep the run "
            "to a few minutes.\n\n"
        )
        f.write(table + "\n")
        f.write(NOTES)
    _plot(rows, os.path.join(HERE, "remat_sweep.png"))


NOTES = """
Notes:
- plain, naive (`jax.checkpoint` per layer), the policies (`jax.checkpoint(layer, policy=...)`) and
  expert run under plain `jax.jit`, as a user would write them. On XLA:CPU the checkpointed
  unrolled versions do not drop memory (`cse_barrier_expander` removes their barriers before CSE,
  jax-ml/jax#19822); the expert's scan needs no flag.
- autoopt (default and budgets) on XLA:CPU recomputes inside `lax.cond`s whose two branches are
  the same computation (the recomputation and the backward equations up to the next one), on a
  predicate read from a backward value: branches are separate HLO computations that CSE does
  not merge with the forward, and XLA cannot fold the predicate, so no compiler flag is needed.
  `autoopt+flag` is the opt-in alternative
  (`compiler_options={"xla_disable_hlo_passes": "cse_barrier_expander"}`): optimization barriers
  instead of conditionals (it aborts XLA:CPU on a barrier inside a scan body, so it is not the
  default). On the transformer's default plan the conditionals hold less than the barriers
  (compare the autoopt and autoopt+flag rows).
- autoopt without a budget compiles the plan with the lowest estimated peak within the rule's
  10% FLOPs cap, which may recompute matmuls, and falls back to the best elementwise-only plan.
  Tanh MLP: every residual is a matmul input and no plan passes the 20%-for-10%-FLOPs rule, so
  nothing is applied by default; with a budget the floor comes from segments shrinking towards
  the end of the forward (`decreasing segments(5)`). The expert recomputes three quarters of
  the forward, which its loop hides from `cost_analysis()`.
- A budget never costs memory against the default: the default's plan is kept when it meets
  the budget (the transformer's 90% to 50% rows); otherwise the plan with the fewest FLOPs that
  meets it, or the lowest-memory plan compiled (the floor).
- "FLOPs vs plain" comes from `cost_analysis()`, which counts a loop body once: the scan-based
  expert's figure is not comparable.
- "first call s": trace + passes + compile; for autoopt it includes compiling the original and
  the candidate plans (one to six extra compiles of the training step).
- Step times: all configurations of a workload interleaved round by round in one process.
"""


def _jax_version() -> str:
    out = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.__version__)"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip()


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _fmt_row(r: dict, plain: dict) -> str:
    return (
        f"| {r['workload']} | {r['config']} | {_mb(r['peak'])} | {_mb(r['temp'])} | "
        f"{_mb(r['rss'])} | {r['time'] * 1e3:.0f} | {r['peak'] / plain['peak']:.2f}x | "
        f"{r['time'] / plain['time']:.2f}x | {r['flops'] / max(plain['flops'], 1):.2f}x | "
        f"{r['first_call']:.1f} | {r['note']} |"
    )


def _table(rows: list[dict]) -> str:
    head = (
        "| workload | config | peak MiB | temp MiB | RSS growth MiB | step ms | peak vs plain | "
        "time vs plain | FLOPs vs plain | first call s | note |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )
    out = [head]
    plain = None
    for r in rows:
        if r["config"] == "plain":
            plain = r
        out.append(_fmt_row(r, plain))
    return "\n".join(out)


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wls = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(wls), figsize=(6 * len(wls), 4.5), squeeze=False)
    for ax, wl in zip(axes[0], wls):
        rs = [r for r in rows if r["workload"] == wl]
        sweep = sorted(
            (r for r in rs if r["config"].startswith("budget:")), key=lambda r: r["peak"]
        )
        ax.plot(
            [r["time"] * 1e3 for r in sweep],
            [r["peak"] / 2**20 for r in sweep],
            "o-",
            label="autoopt, memory_budget sweep",
        )
        for r in sweep:
            ax.annotate(
                f"{int(r['config'].split(':')[1]) / 2**20:.0f}",
                (r["time"] * 1e3, r["peak"] / 2**20),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
            )
        for r, mk in zip([r for r in rs if not r["config"].startswith("budget:")], "sD^vPX*"):
            label = (
                r["config"]
                if not r["config"].startswith("policy:")
                else "best policy: " + r["config"][7:]
            )
            ax.plot([r["time"] * 1e3], [r["peak"] / 2**20], mk, label=label)
        ax.set_title(wl, fontsize=9)
        ax.set_xlabel("step time (ms)")
        ax.set_ylabel("compiled peak (MiB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
