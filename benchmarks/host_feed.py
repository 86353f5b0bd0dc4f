"""Host-to-device feeds: many NumPy leaves, a large read-only NumPy table, a training loop fed
from a Python iterator (with and without prefetch). Issue 5.

Each workload runs naive ``jax.jit``, ``autoopt.optimize`` of the same naive code, and the
hand-written expert version, interleaved in one process; medians of per-step times over rounds
are reported with throughput ratios.

Targets: autoopt >= 1.5x naive's throughput on the many-leaf feed, >= 5x on the table once it
is marked ``autoopt.constant``, and within 1.1x of the expert on each. A table that is only
read-only is transferred every call, as under jax.jit (a read-only flag proves nothing: issue 14).

    python benchmarks/host_feed.py [--rounds 9] [--quick]
"""

from __future__ import annotations

import argparse
import queue
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from _harness import Timings, interleave, markdown_table

import autoopt

# --- 1. a step fed NumPy batches of many leaves ---------------------------------------------------


def features_step(w, feats):
    """Naive: per-feature preprocessing of a dict of NumPy features (64 leaves of f32[64,64])."""
    return sum((v * w).sum(axis=0) for v in feats.values())


def features_step_vectorized(w, stacked):
    """Not a placement change: the step rewritten over the stacked array (one fused kernel
    instead of 64). Shown so the table says what is placement and what is not."""
    return (stacked * w).sum(axis=(0, 1))


def feed_bound_step(w, feats):
    """Feed-bound: reads one row of each feature (the transfer is nearly all the work)."""
    return sum(v[0] * w[0] for v in feats.values())


def many_leaves(rounds: int, steps: int, n_leaves: int = 64, step=features_step) -> Timings:
    rng = np.random.default_rng(0)
    batches = [
        {f"f{i:02d}": rng.standard_normal((64, 64)).astype(np.float32) for i in range(n_leaves)}
        for _ in range(4)
    ]
    w = jnp.asarray(rng.standard_normal((64, 64)).astype(np.float32))
    naive = jax.jit(step)
    fast = autoopt.optimize(step)
    packed = autoopt.optimize(step, placement="pack")
    off = autoopt.optimize(step, placement="off")

    def by_hand_step(w, stacked):  # the expert: one stacked array, the same step on its slices
        return step(w, {f"f{i:02d}": stacked[i] for i in range(stacked.shape[0])})

    expert = jax.jit(by_hand_step)
    vectorized = jax.jit(features_step_vectorized)

    def run(f):
        def go():
            for i in range(steps):
                out = f(w, batches[i % 4])
            out.block_until_ready()

        return go

    def by_hand(f):
        def go():
            for i in range(steps):
                b = batches[i % 4]
                out = f(w, np.stack([b[k] for k in sorted(b)]))
            out.block_until_ready()

        return go

    ref = naive(w, batches[0])
    np.testing.assert_allclose(
        np.asarray(fast(w, batches[0])), np.asarray(ref), rtol=1e-5, atol=1e-5
    )
    stacked = np.stack([batches[0][k] for k in sorted(batches[0])])
    np.testing.assert_allclose(
        np.asarray(expert(w, stacked)), np.asarray(ref), rtol=1e-5, atol=1e-4
    )
    np.testing.assert_allclose(
        np.asarray(packed(w, batches[0])), np.asarray(ref), rtol=1e-5, atol=1e-5
    )
    # placement="auto" times packing once the loop has run ten times as long as its first call
    # (the packed program's compile paid back): the steady state measured here is after that.
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 120:
        for i in range(50):
            fast(w, batches[i % 4])
        layouts = fast.inspect(w, batches[0]).placement.packed_layouts
        if all(layout.decisions for layout in layouts):
            break
    print(f"\n(placement='auto' tuned after {time.perf_counter() - t0:.1f} s of calls)")
    runs = {
        "naive": run(naive),
        "autoopt": run(fast),
        "autoopt placement='pack'": run(packed),
        "autoopt placement='off'": run(off),
        "expert": by_hand(expert),
    }
    if step is features_step:
        np.testing.assert_allclose(
            np.asarray(vectorized(w, stacked)), np.asarray(ref), rtol=1e-5, atol=1e-4
        )
        runs["vectorized rewrite (not placement)"] = by_hand(vectorized)
    times = _interleave(runs, rounds, steps)
    modes = {layout.mode for layout in fast.inspect(w, batches[0]).placement.packed_layouts}
    print(f"\n(placement='auto' chose: {'/'.join(sorted(modes)) or 'nothing to pack'})")
    return times


# --- 2. a step taking a large read-only NumPy table -----------------------------------------------


def lookup_step(table, ids):
    """An embedding lookup over a 16 MiB table (f32[4096, 1024]) passed as NumPy every call."""
    return jnp.take(table, ids, axis=0).sum(axis=0)


def read_only_table(rounds: int, steps: int) -> Timings:
    rng = np.random.default_rng(1)
    table = rng.standard_normal((4096, 1024)).astype(np.float32)
    table.flags.writeable = False  # the only change the user makes
    ids = jnp.asarray(rng.integers(0, 4096, 256).astype(np.int32))
    naive = jax.jit(lookup_step)
    fast = autoopt.optimize(lookup_step)
    expert = jax.jit(lookup_step)
    table_dev = jax.device_put(table)  # expert: placed once, by hand
    table_const = autoopt.constant(table)  # the user's promise: placed once by autoopt

    def run(f, t):
        def go():
            for _ in range(steps):
                out = f(t, ids)
            out.block_until_ready()

        return go

    ref = naive(table, ids)
    np.testing.assert_allclose(np.asarray(fast(table, ids)), np.asarray(ref), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(fast(table_const, ids)), np.asarray(ref), rtol=1e-6)
    return _interleave(
        {
            "naive": run(naive, table),
            "autoopt": run(fast, table),
            "autoopt + autoopt.constant(table)": run(fast, table_const),
            "expert": run(expert, table_dev),
        },
        rounds,
        steps,
    )


# --- 3. a training loop fed from a Python iterator ------------------------------------------------


def _loader(n: int, seed: int = 2):
    """A Python data loader: NumPy decoding/augmentation work per batch, fresh arrays."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        x = rng.standard_normal((256, 256)).astype(np.float32)
        x = (x - x.mean(axis=0)) / (x.std(axis=0) + 1e-6)  # normalize
        x[:, ::2] = x[:, ::-2]  # a cheap "augmentation"
        y = np.tanh(x[:, :16] * 0.5).astype(np.float32)
        yield {"x": x, "y": y}


def train_step(params, batch):
    def loss_fn(p):
        h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)

    loss, g = jax.value_and_grad(loss_fn)(params)
    return jax.tree_util.tree_map(lambda p, gp: p - 0.01 * gp, params, g), loss


def _init_params():
    rng = np.random.default_rng(3)
    return {
        "w1": jnp.asarray(rng.standard_normal((256, 512)).astype(np.float32) * 0.05),
        "b1": jnp.zeros(512),
        "w2": jnp.asarray(rng.standard_normal((512, 16)).astype(np.float32) * 0.05),
    }


def _expert_prefetch(it, size=2):
    """By hand, as the training cookbook does: a thread places batches while the step runs."""
    q: queue.Queue = queue.Queue(maxsize=size)
    end = object()

    def work():
        for b in it:
            q.put(jax.device_put(b))
        q.put(end)

    threading.Thread(target=work, daemon=True).start()
    while (b := q.get()) is not end:
        yield b


def training_loop(rounds: int, steps: int) -> Timings:
    naive = jax.jit(train_step)
    fast = autoopt.optimize(train_step)
    expert = jax.jit(train_step, donate_argnums=0)

    def loop(step, feed):
        def go():
            params = _init_params()
            losses = []
            for batch in feed(_loader(steps)):
                params, loss = step(params, batch)
                losses.append(loss)
            jax.block_until_ready((params, losses))

        return go

    # Same numbers from every variant (donation and placement change no values).
    results = []
    for step, feed in ((naive, iter), (fast, autoopt.prefetch), (expert, _expert_prefetch)):
        params = _init_params()
        for batch in feed(_loader(3)):
            params, _ = step(params, batch)
        results.append(np.asarray(params["w2"]))
    for r in results[1:]:
        np.testing.assert_allclose(r, results[0], rtol=1e-5, atol=1e-6)
    return _interleave(
        {
            "naive": loop(naive, iter),
            "autoopt": loop(fast, iter),
            "autoopt + prefetch": loop(fast, autoopt.prefetch),
            "expert": loop(expert, _expert_prefetch),
        },
        rounds,
        steps,
    )


# --- 4. what placement costs a call that passes only device arrays --------------------------------


def lean_path(rounds: int, calls: int) -> Timings:
    def tiny(x):
        return x + 1.0

    jitted = jax.jit(tiny)
    on = autoopt.optimize(tiny, donate="off")
    off = autoopt.optimize(tiny, donate="off", placement="off")
    x = jnp.ones(8)

    def run(f):
        def go():
            for _ in range(calls):
                f(x)
            f(x).block_until_ready()

        return go

    return _interleave(
        {
            "jax.jit": run(jitted),
            "autoopt placement=auto": run(on),
            "autoopt placement=off": run(off),
        },
        rounds,
        calls + 1,
    )


# --- driver ---------------------------------------------------------------------------------------


def _interleave(runs: dict, rounds: int, steps: int) -> Timings:
    """Per-step wall time and process CPU time (all threads) of each run, interleaved.

    CPU time is reported too because the machine these run on is shared: other jobs inflate
    wall time unevenly, while CPU time measures the work each variant does. The order rotates
    each round: a variant run right after one that transfers 16 MiB a call pays for the frees
    it left behind. The warm-up call compiles, fills caches and starts the placer's watching
    period.
    """
    return interleave(runs, rounds, per=steps)


def _table(
    title: str,
    times: Timings,
    unit: str = "us",
    baseline: str = "naive",
    expert: str | None = "expert",
) -> str:
    scale = 1e6 if unit == "us" else 1e3
    med = {"wall": times.medians(), "cpu": times.cpu.medians()}
    header = ["variant"]
    for label in ("wall", "CPU"):
        header += [f"{label} {unit}/step", f"throughput vs {baseline} ({label})"]
        header += [f"{label} vs expert"] if expert else []
    rows = []
    for k in times:
        row = [k]
        for m in ("wall", "cpu"):
            v = med[m][k]
            row += [f"{v * scale:.1f}", f"{med[m][baseline] / v:.2f}x"]
            row += [f"{v / med[m][expert]:.2f}"] if expert else []
        rows.append(row)
    return f"\n**{title}**\n\n" + markdown_table(header, rows)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--quick", action="store_true", help="fewer steps, 3 rounds (a smoke run)")
    a = p.parse_args()
    if a.quick:
        a.rounds = 3
    k = 4 if a.quick else 1
    print(
        f"jax {jax.__version__}, backend {jax.default_backend()}, {a.rounds} interleaved rounds; "
        "medians of per-step wall time and of per-step process CPU time (all threads)"
    )
    print(
        _table(
            "1a. step fed 64 NumPy leaves of f32[64,64] a call, per-feature multiply-reduce "
            "(expert: stacks them into one array by hand, one transfer, same step)",
            many_leaves(a.rounds, 200 // k),
        )
    )
    print(
        _table(
            "1b. the same feed, feed-bound step (one row of each feature)",
            many_leaves(a.rounds, 200 // k, step=feed_bound_step),
        )
    )
    print(
        _table(
            "2. embedding lookup taking a read-only NumPy table f32[4096,1024] (16 MiB) a call "
            "(expert: device_put once)",
            read_only_table(a.rounds, 40 // k),
        )
    )
    print(
        _table(
            "3. training loop (MLP 256-512-16) fed by a Python loader of f32[256,256] batches "
            "(expert: hand-written thread prefetch + donate_argnums)",
            training_loop(a.rounds, 60 // k),
            unit="ms",
        )
    )
    print(
        _table(
            "4. cached call of a tiny function on device arrays: what placement='auto' costs",
            lean_path(a.rounds, 2000 // k),
            baseline="jax.jit",
            expert=None,
        )
    )


if __name__ == "__main__":
    main()
