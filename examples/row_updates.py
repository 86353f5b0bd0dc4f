"""Row updates in a loop: a buffer filled one row per step (a KV cache, a replay buffer).

The naive version copies the whole buffer on every call: jit cannot reuse the argument's buffer
unless it is donated, and the row is written with a scatter. The expert donates ``buf`` and
writes the row with ``lax.dynamic_update_slice``; ``autoopt.optimize`` does both (donation is
proven safe because the loop rebinds ``buf``).
"""

from functools import partial

import jax
import jax.numpy as jnp

ROWS, COLS = 4096, 256  # a 4 MiB float32 buffer


@jax.jit
def write_row(buf, i, row):
    buf = buf.at[i].set(row * 2.0)
    return buf


def make_args():
    buf = jnp.zeros((ROWS, COLS), jnp.float32)
    row = jnp.arange(COLS, dtype=jnp.float32)
    return buf, jnp.int32(3), row


def run(step, steps=64):
    _, _, row = make_args()
    buf = jnp.zeros((ROWS, COLS), jnp.float32)  # a fresh buffer the loop owns
    for i in range(steps):
        buf = step(buf, i, row + i)
    return buf


@partial(jax.jit, donate_argnums=0)
def expert_step(buf, i, row):
    """The hand-written version: ``buf`` donated, the row written in place."""
    return jax.lax.dynamic_update_slice_in_dim(buf, (row * 2.0)[None], i, 0)


if __name__ == "__main__":
    print(run(write_row)[:4, :4])
