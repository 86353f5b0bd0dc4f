"""A host-fed loop: a data loader yields NumPy feature columns, one dictionary per step.

Every call transfers each column from host memory before the step can start, one transfer per
leaf. On a GPU the expert would batch the transfers and place batches ahead of the step
(``autoopt.prefetch``, which the report suggests); on XLA:CPU a transfer is a memcpy, the loop
is bound by making the batches in NumPy, and the expert only donates the weights the loop
rebinds (``prefetch``'s thread measured slower here: benchmarks/RESULTS.md).
"""

import jax
import jax.numpy as jnp
import numpy as np

COLUMNS, WIDTH, BATCH = 8, 16, 256  # eight float32 columns of [256, 16] a batch


def sgd_update(w, batch):
    x = jnp.concatenate([batch["columns"][k] for k in sorted(batch["columns"])], axis=1)
    grad = x.T @ (x @ w - batch["target"]) / x.shape[0]
    return w - 0.1 * grad


@jax.jit
def sgd_step(w, batch):
    return sgd_update(w, batch)


# The hand-written version on this machine: the weights donated.
expert_step = jax.jit(sgd_update, donate_argnums=0)


def batches(n, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        columns = {
            f"c{k}": rng.standard_normal((BATCH, WIDTH), dtype=np.float32) for k in range(COLUMNS)
        }
        yield {"columns": columns, "target": columns["c0"][:, :1] * 0.5}


def make_inputs_only(steps=64):
    """The loop's own host work (making the batches), without the step: what the demo compares
    the loop's time with."""
    for _ in batches(steps):
        pass


def make_args():
    return jnp.zeros((COLUMNS * WIDTH, 1), jnp.float32), next(batches(1))


def run(step, steps=64):
    w = jnp.zeros((COLUMNS * WIDTH, 1), jnp.float32)
    for batch in batches(steps):
        w = step(w, batch)
    return w


if __name__ == "__main__":
    print(run(sgd_step)[:4, 0])
