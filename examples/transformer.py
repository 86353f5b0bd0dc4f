"""A transformer's training step: six attention + MLP blocks, ``value_and_grad``, in a loop.

The naive version keeps every block's activations for the backward pass. With ``remat="auto"``
(``OPTIMIZE_OPTIONS``: the default, ``"fit"``, plans only when the step does not fit the device
or a ``memory_budget``) autoopt compiles candidate plans of what the backward recomputes instead,
and keeps one only where the compiled peak drops by 20% for at most 10% more FLOPs. The
expert's usual fix, ``jax.checkpoint`` on segments of sqrt(L) blocks under a ``scan``, is the
hand-written version. Remat reorders
floating point: numbers agree up to reassociation, not bit for bit (``remat="off"`` for
bit-exact training).
"""

import math

import jax
import jax.numpy as jnp

LAYERS, BATCH, SEQ, WIDTH, HEADS = 6, 4, 128, 256, 4

# What the demo passes to autoopt.optimize: a remat plan whenever it pays, not only when short.
OPTIMIZE_OPTIONS = {"remat": "auto"}


def _ln(x):
    m = x.mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5)


def block(x, p):
    wqkv, wo, w1, w2 = p
    b, s, d = x.shape
    q, k, v = jnp.split(_ln(x) @ wqkv, 3, axis=-1)
    q, k, v = (t.reshape(b, s, HEADS, d // HEADS) for t in (q, k, v))
    att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // HEADS), axis=-1)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, d) @ wo
    return x + jax.nn.gelu(_ln(x) @ w1) @ w2


def loss_fn(params, x):
    for p in params:
        x = block(x, p)
    return jnp.mean(x**2)


@jax.jit
def train_step(params, x):
    loss, grads = jax.value_and_grad(loss_fn)(params, x)
    return jax.tree_util.tree_map(lambda p, g: p - 1e-3 * g, params, grads), loss


def make_args():
    k = jax.random.split(jax.random.key(0), 4 * LAYERS + 1)
    d = WIDTH
    params = [
        (
            jax.random.normal(k[4 * i], (d, 3 * d)) / math.sqrt(d),
            jax.random.normal(k[4 * i + 1], (d, d)) / math.sqrt(d),
            jax.random.normal(k[4 * i + 2], (d, 4 * d)) / math.sqrt(d),
            jax.random.normal(k[4 * i + 3], (4 * d, d)) / math.sqrt(4 * d),
        )
        for i in range(LAYERS)
    ]
    return params, jax.random.normal(k[-1], (BATCH, SEQ, WIDTH))


def run(step, steps=3):
    params, x = make_args()
    for _ in range(steps):
        params, loss = step(params, x)
    return params, loss


# The hand-written version: blocks stacked in segments of sqrt(L), each segment checkpointed,
# a scan over the segments; the parameters donated.
SEGMENT = 2


def _stack(params):
    return jax.tree_util.tree_map(
        lambda *a: jnp.stack(a).reshape((LAYERS // SEGMENT, SEGMENT) + a[0].shape), *params
    )


def _unstack(stacked):
    return [
        jax.tree_util.tree_map(lambda a, i=i: a.reshape((LAYERS,) + a.shape[2:])[i], stacked)
        for i in range(LAYERS)
    ]


@jax.checkpoint
def _segment(x, pseg):
    for i in range(SEGMENT):
        x = block(x, jax.tree_util.tree_map(lambda a, i=i: a[i], pseg))
    return x


def _expert_loss(stacked, x):
    x, _ = jax.lax.scan(lambda x, p: (_segment(x, p), None), x, stacked)
    return jnp.mean(x**2)


def _expert_update(stacked, x):
    loss, grads = jax.value_and_grad(_expert_loss)(stacked, x)
    return jax.tree_util.tree_map(lambda p, g: p - 1e-3 * g, stacked, grads), loss


expert_step = jax.jit(_expert_update, donate_argnums=0)


def expert_args():
    params, x = make_args()
    return _stack(params), x


def run_expert(steps=3):
    stacked, x = expert_args()
    for _ in range(steps):
        stacked, loss = expert_step(stacked, x)
    return _unstack(stacked), loss


if __name__ == "__main__":
    print(run(train_step)[1])
