"""In-place updates: naive ``.at[...]`` code under jax.jit vs autoopt.optimize vs hand-written DUS.

Each workload is a step function called in a Python loop as ``x = step(x, ...)``: the naive code
under ``jax.jit(..., donate_argnums=0)``, the same code under ``autoopt.optimize`` (default
``donate="safe"``, which donates because the caller rebinds ``x``), and the expert's
``lax.dynamic_update_slice`` + donation. A fourth column, ``rewrite``, runs the program autoopt
compiles through plain ``jax.jit(..., donate_argnums=0)``: it separates what the rewrite buys
from the per-call cost of autoopt's Python call path (the ``"safe"`` call-site proof).
Interleaved in one process; medians of per-call times over rounds, and the ratios. Every
variant is checked to update in place (the output buffer is the input's).

Targets (issue 8): autoopt within 1.15x of expert on every row, at least 1.4x faster than naive
on the row set, never slower than naive.

    python benchmarks/in_place.py [--rounds 41] [--n 4096] [--out benchmarks/results/in_place.md]
    python benchmarks/in_place.py --quick    # x = f32[512,512], 5 rounds
"""

from __future__ import annotations

import argparse
import platform

import jax
import jax.numpy as jnp
from _harness import interleave, markdown_table
from jax import lax

import autoopt

BLOCK = 64
WINDOW = 8
TILE = (128, 1024)  # 512 KiB of f32: blended (window_blend_min_bytes)


def workloads(n: int, loop_n: int):
    """name -> (naive, expert, make_state, make_args(j), reps)."""
    row = jnp.linspace(0.0, 1.0, n, dtype=jnp.float32)
    block = jnp.ones((BLOCK, n), jnp.float32)
    window = jnp.full((WINDOW, n), 2.0, jnp.float32)
    tile = jnp.full(TILE, 0.5, jnp.float32)
    big = lambda: jnp.zeros((n, n), jnp.float32)  # noqa: E731
    loop_row = jnp.linspace(0.0, 1.0, loop_n, dtype=jnp.float32)

    def fill(buf):
        return lax.fori_loop(0, buf.shape[0], lambda i, b: b.at[i].set(loop_row * i), buf)

    def fill_expert(buf):
        return lax.fori_loop(
            0,
            buf.shape[0],
            lambda i, b: lax.dynamic_update_slice(b, (loop_row * i)[None], (i, 0)),
            buf,
        )

    rows = {
        "row set `x.at[i].set(row)`": (
            lambda x, i: x.at[i].set(row),
            lambda x, i: lax.dynamic_update_slice(x, row[None], (i, 0)),
            big,
            lambda j: (j % n,),
            100,
        ),
        "row add `x.at[i].add(row)`": (
            lambda x, i: x.at[i].add(row),
            lambda x, i: lax.dynamic_update_slice(
                x, lax.dynamic_slice(x, (i, 0), (1, n)) + row[None], (i, 0)
            ),
            big,
            lambda j: (j % n,),
            100,
        ),
        f"{BLOCK}-row block `x.at[i + arange({BLOCK})].set(b)`": (
            lambda x, i: x.at[i + jnp.arange(BLOCK)].set(block),
            lambda x, i: lax.dynamic_update_slice(x, block, (i, 0)),
            big,
            lambda j: ((j * BLOCK) % (n - BLOCK),),
            50,
        ),
        f"{WINDOW}-row window `x.at[i + arange({WINDOW})].set(w)`": (
            lambda x, i: x.at[i + jnp.arange(WINDOW)].set(window),
            lambda x, i: lax.dynamic_update_slice(x, window, (i, 0)),
            big,
            lambda j: ((j * 37) % (n - WINDOW),),
            100,
        ),
        f"{TILE[0]}x{TILE[1]} tile `x.at[i + arange({TILE[0]})[:, None], j + arange({TILE[1]})]`": (
            lambda x, i, k: x.at[i + jnp.arange(TILE[0])[:, None], k + jnp.arange(TILE[1])].add(
                tile
            ),
            lambda x, i, k: lax.dynamic_update_slice(
                x, lax.dynamic_slice(x, (i, k), TILE) + tile, (i, k)
            ),
            big,
            lambda j: ((j * 37) % (n - TILE[0]), (j * 101) % (n - TILE[1])),
            50,
        ),
        f"{TILE[0]}x{TILE[1]} tile, clamped starts (proven)": (
            lambda x, i, k: x.at[
                jnp.clip(i, 0, n - TILE[0]) + jnp.arange(TILE[0])[:, None],
                jnp.clip(k, 0, n - TILE[1]) + jnp.arange(TILE[1]),
            ].add(tile),
            lambda x, i, k: lax.dynamic_update_slice(
                x, lax.dynamic_slice(x, (i, k), TILE) + tile, (i, k)
            ),
            big,
            lambda j: ((j * 37) % (n - TILE[0]), (j * 101) % (n - TILE[1])),
            50,
        ),
        f"{TILE[0]}x{TILE[1]} tile `.add` at traced starts, 8 in a fori_loop": (
            lambda x, i, k: lax.fori_loop(
                0,
                8,
                lambda t, x: x.at[
                    i + 37 * t + jnp.arange(TILE[0])[:, None], k - t + jnp.arange(TILE[1])
                ].add(tile * t),
                x,
            ),
            lambda x, i, k: lax.fori_loop(
                0,
                8,
                lambda t, x: lax.dynamic_update_slice(
                    x,
                    lax.dynamic_slice(x, (i + 37 * t, k - t), TILE) + tile * t,
                    (i + 37 * t, k - t),
                ),
                x,
            ),
            big,
            lambda j: ((j * 37) % (n - TILE[0] - 300), 8 + (j * 101) % (n - TILE[1] - 8)),
            10,
        ),
        "scalar `x.at[i, j].set(v)`": (
            lambda x, i, k: x.at[i, k].set(1.5),
            lambda x, i, k: lax.dynamic_update_slice(x, jnp.full((1, 1), 1.5, x.dtype), (i, k)),
            big,
            lambda j: (j % n, (7 * j) % n),
            100,
        ),
        f"fill in fori_loop ({loop_n}x{loop_n})": (
            fill,
            fill_expert,
            lambda: jnp.zeros((loop_n, loop_n), jnp.float32),
            lambda j: (),
            10,
        ),
    }
    # (the tiles need x wider than a tile and its loop's reach: not under --quick's 512)
    return {k: v for k, v in rows.items() if "tile" not in k or n >= TILE[1] + 300}


def _timed(fn, state: dict, key, make_args, reps: int):
    """``reps`` calls of ``x = fn(x, ...)`` on ``state[key]``, as a harness run."""

    def go():
        x = state.pop(key)  # the loop's `x` is the only reference: donate="safe" proves it dead
        # Written out per arity: `x = fn(x, *args)` with a local `fn` is never donated under
        # "safe" (autoopt cannot match `*` positions to what the function receives without
        # reading fn).
        for j in range(reps):
            a = make_args(j)
            if len(a) == 1:
                x = fn(x, a[0])
            elif len(a) == 2:
                x = fn(x, a[0], a[1])
            else:
                x = fn(x)
        x.block_until_ready()
        state[key] = x

    return go


def _in_place(fn, make_state, make_args) -> bool:
    """The call reused the argument's buffer (donated and aliased): no copy of ``x``."""
    x = make_state()
    before = x.unsafe_buffer_pointer()  # an int: holding it keeps no reference to x
    a = make_args(1)
    if len(a) == 1:  # a plain `x = fn(...)` statement per arity, as in _timed
        x = fn(x, a[0])
    elif len(a) == 2:
        x = fn(x, a[0], a[1])
    else:
        x = fn(x)
    return x.unsafe_buffer_pointer() == before


def _rewritten_under_jit(fn, make_state, make_args):
    """The program autoopt compiles for ``fn``, called through plain ``jax.jit`` (donating x):
    what the rewrite buys, without autoopt's per-call Python path."""
    traced = autoopt.optimize(fn, donate="off").trace(make_state(), *make_args(0))
    closed = traced.jaxpr

    def program(*args):
        return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)[0]

    return jax.jit(program, donate_argnums=0)


VARIANTS = ("naive", "autoopt", "rewrite", "expert")


def run(rounds: int, n: int, loop_n: int, only: tuple[str, ...] | None = None) -> list[tuple]:
    """One row per workload (``only``: the workloads whose names start with one of these)."""
    rows = []
    for name, (naive, expert, make_state, make_args, reps) in workloads(n, loop_n).items():
        if only is not None and not name.startswith(only):
            continue
        fns = {
            "naive": jax.jit(naive, donate_argnums=0),
            "autoopt": autoopt.optimize(naive),
            "rewrite": _rewritten_under_jit(naive, make_state, make_args),
            "expert": jax.jit(expert, donate_argnums=0),
        }
        state = {}
        for k, f in fns.items():
            state[k] = make_state()
            _timed(f, state, k, make_args, 3)()  # compile and warm up
        in_place = all(_in_place(f, make_state, make_args) for f in fns.values())
        runs = {k: _timed(f, state, k, make_args, reps) for k, f in fns.items()}
        # Short rounds in a rotating order: a burst of load from other jobs lands on every
        # variant alike, and the median drops it.
        times = interleave(runs, rounds, per=reps, warmup=0)
        med = {k: v * 1e6 for k, v in times.medians().items()}
        rows.append((name, *(med[k] for k in VARIANTS), in_place))
        print(
            f"{name}: "
            + ", ".join(f"{k} {med[k]:.1f} us" for k in VARIANTS)
            + ("" if in_place else " (NOT all in place)"),
            flush=True,
        )
    return rows


def table(rows, rounds: int, n: int, loop_n: int) -> str:
    header = (
        "workload",
        "naive jit+donate (us)",
        "autoopt (us)",
        "rewrite (us)",
        "expert DUS+donate (us)",
        "autoopt / expert",
        "naive / autoopt",
        "rewrite / expert",
        "naive / rewrite",
    )
    body = []
    for name, naive, auto, rew, expert, in_place in rows:
        flag = "" if in_place else " (not all in place!)"
        body.append(
            (
                f"{name}{flag}",
                f"{naive:.1f}",
                f"{auto:.1f}",
                f"{rew:.1f}",
                f"{expert:.1f}",
                f"{auto / expert:.2f}x",
                f"{naive / auto:.2f}x",
                f"{rew / expert:.2f}x",
                f"{naive / rew:.2f}x",
            )
        )
    intro = (
        f"jax {jax.__version__}, backend {jax.default_backend()}, {platform.machine()}, "
        f"x = f32[{n},{n}] unless stated; per-call medians over {rounds} interleaved rounds. "
        "`rewrite` is the program autoopt compiles, called through plain jax.jit with "
        "donate_argnums=0 (no autoopt call path)."
    )
    return intro + "\n\n" + markdown_table(header, body)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--loop-n", type=int, default=1024)
    ap.add_argument("--out", default=None, help="also write the table (markdown) here")
    ap.add_argument("--quick", action="store_true", help="x = f32[512,512], 5 rounds")
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.n, a.loop_n = 5, 512, 256
    rows = run(a.rounds, a.n, a.loop_n)
    md = table(rows, a.rounds, a.n, a.loop_n)
    print()
    print(md)
    if a.out:
        with open(a.out, "w") as f:
            f.write("# In-place updates (benchmarks/in_place.py)\n\n")
            f.write(
                f"Command: `python benchmarks/in_place.py --rounds {a.rounds} --out {a.out}`. "
                "Measured on a 2-core machine shared with other jobs: ratios are indicative; "
                "re-run on a quiet machine before quoting.\n\n"
            )
            f.write(md + "\n")


if __name__ == "__main__":
    main()
