"""First-call cost: trace, passes, compile and one run of a new function, against jax.jit's
(issue 15 item 5: a forward-only first call at most 1.2x jax.jit's, one with a backward at most
2x).

Each round builds a fresh function object and clears jax's caches, then times its first call
under plain ``jax.jit``, under ``autoopt.optimize`` (the default, remat="fit"), under
``autoopt.optimize(remat="auto")`` and, where an expert would write something
else, under the expert's version (hand-placed ``jax.checkpoint``); rounds interleave the
variants. Workloads: a forward-only KV-cache decode loop (``lax.scan`` over steps), a small GPT
training step with optax adamw, an equinox MLP training step, a 16-layer MLP training step.

    python benchmarks/first_call.py [--rounds 5] [--warm-cache] [--cpu] [--rebind]

Prints medians of wall time and the ratios to jax.jit's first call, then the backend compiles
of one more first call of each variant (jax.monitoring's backend_compile event, every function
name: a count, which the machine's load does not move) and, with ``--warm-cache``, how many of
them JAX's persistent cache did not answer. ``--warm-cache`` configures JAX's persistent
compilation cache in a temporary folder (autoopt keeps its measured remat decisions beside
it): after the untimed warm-up round every variant's first call finds both caches warm, as a
second process of the same program would. ``--cpu`` takes the ratios from the process's CPU
time instead of wall time (all threads: compiles too): on a shared machine other jobs stretch
wall time unevenly, while CPU time measures the work each variant does. ``--rebind``: the first
call rebinds the state it passes, as a training loop does (``params, opt_state, loss =
step(params, opt_state, tokens)``; fresh copies each round), so that ``donate="safe"``
donates it; by default the call keeps its arguments (``out = step(*args)``).
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics

from _harness import interleave, markdown_table


def _decode():
    import jax
    import jax.numpy as jnp

    d, steps, cache_len = 256, 64, 64  # residuals above the 1 MiB gate if differentiated
    k = jax.random.split(jax.random.key(0), 4)
    wq, wk, wv = (jax.random.normal(k[i], (d, d)) / math.sqrt(d) for i in range(3))
    x0 = jax.random.normal(k[3], (d,))

    def make():
        def decode(x, kcache, vcache):
            def step(carry, t):
                x, kc, vc = carry
                kc = jax.lax.dynamic_update_slice_in_dim(kc, (x @ wk)[None], t, 0)
                vc = jax.lax.dynamic_update_slice_in_dim(vc, (x @ wv)[None], t, 0)
                att = jax.nn.softmax((kc @ (x @ wq)) / math.sqrt(d))
                return (jnp.tanh(att @ vc + x), kc, vc), None

            (x, kc, vc), _ = jax.lax.scan(step, (x, kcache, vcache), jnp.arange(steps))
            return x, kc, vc

        return decode

    args = (x0, jnp.zeros((cache_len, d)), jnp.zeros((cache_len, d)))
    return make, None, args


def _gpt():
    import jax
    import jax.numpy as jnp
    import optax

    layers, d, t, vocab = 4, 128, 64, 256
    k = jax.random.split(jax.random.key(0), 4 * layers + 2)
    params = {
        "emb": jax.random.normal(k[0], (vocab, d)) * 0.02,
        "blocks": [
            {
                n: jax.random.normal(k[1 + 4 * i + j], (d, d)) / math.sqrt(d)
                for j, n in enumerate(("q", "k", "v", "mlp"))
            }
            for i in range(layers)
        ],
    }
    tokens = jax.random.randint(k[-1], (8, t), 0, vocab)
    tx = optax.adamw(1e-3)

    def block(h, p):
        q, kk, v = h @ p["q"], h @ p["k"], h @ p["v"]
        att = jax.nn.softmax(q @ kk.swapaxes(-1, -2) / math.sqrt(d) + jnp.tril(jnp.zeros((t, t))))
        h = h + att @ v
        return h + jax.nn.gelu(h @ p["mlp"])

    def make(checkpoint: bool = False):
        blk = jax.checkpoint(block) if checkpoint else block

        def loss(params, tokens):
            h = params["emb"][tokens]
            for p in params["blocks"]:
                h = blk(h, p)
            logits = h @ params["emb"].T
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

        def step(params, opt_state, tokens):
            value, grads = jax.value_and_grad(loss)(params, tokens)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        return step

    return make, (lambda: make(checkpoint=True)), (params, tx.init(params), tokens)


def _eqx_mlp():
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    model = eqx.nn.MLP(64, 64, 256, 4, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    x = jax.random.normal(jax.random.key(1), (128, 64))

    def make():
        def step(params, x):
            def loss(p):
                m = eqx.combine(p, static)
                return jnp.mean(jax.vmap(m)(x) ** 2)

            value, g = jax.value_and_grad(loss)(params)
            return jax.tree_util.tree_map(lambda p, g: p - 1e-3 * g, params, g), value

        return step

    return make, None, (params, x)


def _deep_mlp():
    import jax
    import jax.numpy as jnp

    layers, n, d = 16, 1024, 256
    k = jax.random.split(jax.random.key(0), layers + 1)
    ws = [jax.random.normal(k[i], (d, d)) / math.sqrt(d) for i in range(layers)]
    x = jax.random.normal(k[-1], (n, d))

    def make(checkpoint: bool = False):
        def layer(h, w):
            return jnp.tanh(h @ w)

        lyr = jax.checkpoint(layer) if checkpoint else layer

        def step(ws, x):
            def loss(ws):
                h = x
                for w in ws:
                    h = lyr(h, w)
                return jnp.mean(h**2)

            value, g = jax.value_and_grad(loss)(ws)
            return [w - 0.1 * gw for w, gw in zip(ws, g)], value

        return step

    return make, (lambda: make(checkpoint=True)), (ws, x)


WORKLOADS = {
    "decode loop (forward only)": _decode,
    "small GPT + adamw": _gpt,
    "equinox MLP step": _eqx_mlp,
    "deep MLP step (16 layers)": _deep_mlp,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default=None, help="a workload name's prefix")
    parser.add_argument(
        "--warm-cache",
        action="store_true",
        help="JAX's persistent compilation cache (and autoopt's plans beside it) in a temp dir",
    )
    parser.add_argument(
        "--rebind",
        action="store_true",
        help="the first call rebinds the state it passes (a training loop's statement)",
    )
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="ratios of the process's CPU time (all threads) instead of wall time",
    )
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp

    import autoopt

    if args.warm_cache:
        import tempfile

        jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="first_call_"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

    rows = []
    for name, build in WORKLOADS.items():
        if args.only and not name.startswith(args.only):
            continue
        make, expert, call_args = build()

        if args.rebind:
            first_call = _REBINDING[len(call_args)]
        else:

            def first_call(fn, call_args=call_args):
                jax.block_until_ready(fn(*call_args))

        def fresh(wrap, make=make, call_args=call_args):
            def new_function():
                if args.rebind:  # the state the call rebinds (and may donate), fresh
                    state = jax.block_until_ready(jax.tree_util.tree_map(jnp.copy, call_args))
                    jax.clear_caches()  # no executable shared with an earlier round
                    return [wrap(make()), *state]
                jax.clear_caches()
                return wrap(make())

            return new_function

        # "autoopt": the default (remat="fit": the original only, unless it does not fit);
        # "remat=auto": the opt-in planner, which compiles candidate plans on a first call.
        runs = {"jax.jit": first_call, "autoopt": first_call, "remat=auto": first_call}
        prepare = {
            "jax.jit": fresh(jax.jit),
            "autoopt": fresh(autoopt.optimize),
            "remat=auto": fresh(functools.partial(autoopt.optimize, remat="auto")),
        }
        if expert is not None:
            runs["expert"] = first_call
            prepare["expert"] = fresh(jax.jit, make=expert)
        times = interleave(runs, args.rounds, warmup=1, prepare=prepare)
        if args.cpu:
            times = times.cpu
        base = statistics.median(times["jax.jit"])
        cells = [f"{base:.2f} s"]
        for v in ("autoopt", "remat=auto", "expert"):
            cells.append(f"{statistics.median(times[v]) / base:.2f}x" if v in times else "-")
        for v in ("jax.jit", "autoopt", "remat=auto"):
            prepared = prepare[v]()
            with _Compiles() as counted:
                first_call(prepared)
            del prepared
            cells.append(counted.cell(args.warm_cache))
        rows.append([name, *cells])
        print(name, cells, flush=True)
    print()
    header = [
        "first call",
        "jax.jit (CPU time)" if args.cpu else "jax.jit",
        "default (fit) / jit",
        "remat='auto' / jit",
        "expert / jit",
    ]
    what = "compiles (not from JAX's cache)" if args.warm_cache else "compiles"
    header += [f"{what}: jax.jit", "default", "remat='auto'"]
    print(markdown_table(header, rows))


def _rebinding_2(prepared: list) -> None:
    # The prepared list is emptied: the statement's names hold the state's only references,
    # which donate="safe" proves before donating it.
    fn, a, b = prepared
    prepared.clear()
    a, value = fn(a, b)
    jax_block(value)


def _rebinding_3(prepared: list) -> None:
    fn, a, b, c = prepared
    prepared.clear()
    a, b, value = fn(a, b, c)
    jax_block(value)


_REBINDING = {2: _rebinding_2, 3: _rebinding_3}


def jax_block(x) -> None:
    import jax

    jax.block_until_ready(x)


class _Compiles:
    """Backend compiles while active, and JAX's persistent-cache misses among them."""

    def __init__(self):
        self.compiles = self.misses = 0

    def _duration(self, event: str, duration_secs: float, **kw: str | int) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.compiles += 1  # (recorded for an executable JAX's cache answers too)

    def _event(self, event: str, **kw: str | int) -> None:
        if event == "/jax/compilation_cache/cache_misses":
            self.misses += 1

    def cell(self, warm: bool) -> str:
        return f"{self.compiles} ({self.misses})" if warm else str(self.compiles)

    def __enter__(self):
        import jax

        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)
        return self

    def __exit__(self, *exc):
        import jax

        jax.monitoring.unregister_event_duration_listener(self._duration)
        jax.monitoring.unregister_event_listener(self._event)


if __name__ == "__main__":
    main()
